"""A function the spec names by `module:function` or `path/to/file.py:function` (reward functions, agents)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Callable

from .errors import SpecError


def import_function(target: str, where: str) -> Callable:
    """The function `target` names; a file or module that cannot be imported, or that lacks the name, is a
    `SpecError` naming the spec key `where`. A file is imported once per process under a name derived from its
    resolved path, so two files of the same name do not replace each other."""
    location, _, name = target.rpartition(":")
    if location.endswith(".py"):
        module = _import_file(Path(location), where)
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as err:
            raise SpecError(where, f"cannot import {location}: {err}",
                            "install the package, or give a file path: path/to/file.py:function") from None
        except Exception as err:  # noqa: BLE001 - any import-time failure of user code is bad input
            raise SpecError(where, f"importing {location} failed: {type(err).__name__}: {err}", "fix the module") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)
        raise SpecError(where, f"{location} has no function {name!r}",
                        f"name a function defined there: {', '.join(defined) or '(none)'}")
    return fn


def _import_file(path: Path, where: str):
    if not path.is_file():
        raise SpecError(where, f"{path} does not exist", "paths are relative to the current directory")
    resolved = path.resolve()
    module_name = f"rlspec_user_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - any import-time failure of user code is bad input
        del sys.modules[module_name]
        raise SpecError(where, f"importing {path} failed: {type(err).__name__}: {err}", "fix the file") from None
    return module
