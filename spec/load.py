"""YAML file + command-line overrides -> validated `Spec`, through Hydra composition.

The user's YAML is composed on top of the typed schema, so unknown keys and wrong types in the file
or in an override are caught with their full key path. Presets in `spec/presets/<group>/<name>.yaml`
are Hydra config groups: `model=qwen2_0p5b_shape` on the command line, or `defaults: [model: ...]`
in the file.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .errors import SpecError
from .files import read_text
from .schema import Spec

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
_SCHEMA_NAME = "rlspec_schema"


def _preset_groups() -> list[str]:
    return sorted(p.name for p in PRESETS_DIR.iterdir() if p.is_dir())


def preset_names(group: str) -> list[str]:
    """Names of the shipped presets of one config group (e.g. `model`)."""
    return sorted(p.stem for p in (PRESETS_DIR / group).glob("*.yaml"))


def load_spec(path: str | Path, overrides: Sequence[str] = (), backend: str | None = None) -> Spec:
    """Compose `path` with `overrides` (Hydra syntax) and return the validated spec.

    `backend`, when given, replaces the spec's `backend` key (the CLI's `--backend`).
    """
    path = Path(path)
    data = _check_yaml_file(path)
    if backend is not None:
        overrides = [*overrides, f"backend={backend}"]
    cfg = _compose(path, list(overrides), _declared_groups(data))
    try:
        # Through a plain container: Hydra's result keeps keys added with `+key=...` past the schema.
        merged = OmegaConf.merge(OmegaConf.structured(Spec), OmegaConf.to_container(cfg))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _from_omegaconf(err, str(path)) from None


def with_overrides(spec: Spec, overrides: Sequence[str], source: str = "overrides") -> Spec:
    """`spec` (built in code) with `key.path=value` overrides applied and every section validated again: the
    command line's key syntax, without presets. `source` names where the overrides came from in an error."""
    for override in overrides:
        if "=" not in override:
            raise SpecError(source, f"cannot parse override {override!r}", "write overrides as key.path=value")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(spec), OmegaConf.from_dotlist(list(overrides))))
    except OmegaConfBaseException as err:
        raise _from_omegaconf(err, source) from None


def split_label(label: str) -> tuple[str, list[str]]:
    """A backend label, as `rlspec bench --backends` and `rlspec conformance --backends` name a run -> (backend name,
    spec overrides): `deepspeed@hardware.deepspeed.zero_stage=2` is `deepspeed` with that override; `@` separates
    several."""
    name, *overrides = label.split("@")
    return name, overrides


def _check_yaml_file(path: Path) -> dict:
    """The file's top-level mapping; refuses a missing, unreadable, binary, malformed or empty file."""
    if not path.exists() and not path.is_dir():
        raise SpecError(str(path), "spec file not found", "check the path (it is relative to the current directory)")
    text = read_text(path, str(path), "a YAML spec file")
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise SpecError(where, f"YAML syntax error: {err.problem}", "fix the YAML at that line") from None
    except yaml.YAMLError as err:
        raise SpecError(str(path), f"YAML error: {err}", "fix the YAML") from None
    if data is None:
        # Nothing but defaults is almost always a wrong file; `{}` says "all defaults" on purpose.
        raise SpecError(str(path), "the spec file is empty (only whitespace or comments)",
                        "write the sections to set (see examples/tiny.yaml), or `{}` to run every default on purpose")
    if not isinstance(data, dict):
        raise SpecError(str(path), f"top level is a {type(data).__name__}, not a mapping",
                        "a spec is a mapping with sections algorithm, model, rollout, sync, hardware")
    return data


def _declared_groups(data: dict) -> set[str]:
    """Config groups the file's own `defaults:` list already chooses."""
    groups = set()
    for entry in data.get("defaults", None) or []:
        if isinstance(entry, dict):
            groups.update(k.split(" ")[-1].split("@")[0].lstrip("/") for k in entry)
    return groups


def _compose(path: Path, overrides: list[str], declared: set[str]):
    # Imported here: Hydra's import costs ~0.3 s and only the CLI paths that read YAML need it.
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    store = ConfigStore.instance()
    store.store(name=_SCHEMA_NAME, node=Spec)
    primary = f"rlspec_primary_{path.stem}"
    # A null placeholder per preset group the file does not choose, so `hardware=gpu1` works on any spec.
    # They come after the file: a preset picked on the command line overrides the file's values for that
    # section (a preset the file picks itself is overridden by the file's own values, as usual in Hydra).
    placeholders = [{g: None} for g in _preset_groups() if g not in declared]
    store.store(name=primary, node={"defaults": [_SCHEMA_NAME, path.stem, *placeholders, "_self_"]})
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(path.resolve().parent), version_base=None):
            return compose(primary, overrides=[*overrides, f"hydra.searchpath=[file://{PRESETS_DIR}]"])
    except (HydraException, OmegaConfBaseException) as err:
        raise _from_hydra(err, str(path), overrides) from None
    finally:
        GlobalHydra.instance().clear()


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and the exceptions it was raised from or during, outermost first."""
    seen: list[BaseException] = []
    while err is not None and err not in seen:
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


def _from_omegaconf(err: OmegaConfBaseException, source: str) -> SpecError:
    key = getattr(err, "full_key", None) or source
    msg = str(err).split("\n")[0]
    fix = None
    section = getattr(err, "object_type", None)
    if "." not in key and section not in (None, Spec) and (path := _section_path(section)) is not None:
        # a section inside a list (rollout.task.rewards): OmegaConf names the field alone
        key = f"{path}.{key}"
        fix = f"valid keys in {path}: {', '.join(f.name for f in dataclasses.fields(section))}"
    if "not in" in msg or "Key '" in msg and "not" in msg:
        return SpecError(key, f"unknown key ({msg})", fix or _key_fix(key))
    if "Value '" in msg or "could not convert" in msg.lower() or "Invalid type" in msg:
        return SpecError(key, f"wrong type ({msg})", f"give a value of the type documented in {documented_in(key)}")
    return SpecError(key, msg, f"see {documented_in(key)} for the field's type and meaning")


def _section_path(cls: type) -> str | None:
    """Where sections of type `cls` sit in the spec, `[]` marking a list of them (`rollout.task.rewards[]`)."""
    todo = [(Spec, "")]
    while todo:
        node, prefix = todo.pop()
        hints = typing.get_type_hints(node)
        for f in dataclasses.fields(node):
            hint = hints[f.name]
            listed = typing.get_origin(hint) is list
            inner = typing.get_args(hint)[0] if listed else hint
            if isinstance(inner, type) and dataclasses.is_dataclass(inner):
                path = f"{prefix}{f.name}{'[]' if listed else ''}"
                if inner is cls:
                    return path
                todo.append((inner, f"{path}."))
    return None


def documented_in(key: str) -> str:
    """The file whose dataclass documents `key`: what a rollout samples from has its own (`spec.sources`)."""
    return "spec/sources.py" if key.startswith(("rollout.task", "rollout.env", "rollout.agent")) else "spec/schema.py"


def _from_hydra(err: BaseException, source: str, overrides: list[str]) -> SpecError:
    from hydra.errors import MissingConfigException, OverrideParseException

    chain = _chain(err)
    cause = chain[-1]
    text = str(err)
    keyed = [e for e in chain if isinstance(e, OmegaConfBaseException) and getattr(e, "full_key", None)]
    if keyed and "Could not override" not in text:
        return _from_omegaconf(keyed[0], source)
    if isinstance(err, OverrideParseException) or isinstance(cause, OverrideParseException):
        return SpecError("overrides", f"cannot parse override: {text.splitlines()[0]}",
                         "write overrides as key.path=value, e.g. algorithm.lr=1e-5")
    match = re.search(r"Could not override '([^']+)'", text)
    listed = [e for e in chain if isinstance(e, OmegaConfBaseException) and "." not in str(getattr(e, "full_key", ""))
              and getattr(e, "object_type", None) not in (None, Spec) and _section_path(e.object_type) is not None]
    if match and listed:  # a bad field of a section inside a list: name it in full
        return _from_omegaconf(listed[0], source)
    if match:
        key = match.group(1)
        detail = str(cause).split("\n")[0]
        if "not in struct" in text or "not in" in detail or "Key '" in detail:
            return SpecError(key, "unknown key in override", _key_fix(key))
        return SpecError(key, f"bad override value ({detail})", f"give a value of the field's type ({documented_in(key)})")
    if isinstance(err, MissingConfigException) or isinstance(cause, MissingConfigException):
        group = _missing_group(text)
        if group:
            return SpecError(group, f"no preset named in {text.splitlines()[0]!r}",
                             f"choose one of: {', '.join(preset_names(group)) or '(none shipped)'}")
        return SpecError(source, text.splitlines()[0], "check the defaults list and the preset names")
    return SpecError(source, text.splitlines()[0], "check the spec file and overrides")


def _missing_group(text: str) -> str | None:
    match = re.search(r"(?:group|for) '?([a-z_]+)'?", text)
    if match and (PRESETS_DIR / match.group(1)).is_dir():
        return match.group(1)
    for group in ("model", "algorithm", "rollout", "hardware"):
        if f"{group}/" in text or f"'{group}'" in text:
            return group
    return None


def _key_fix(key: str) -> str:
    """Name the keys that are valid where `key` was given."""
    import dataclasses

    cls, parts = Spec, key.split(".")
    for depth, part in enumerate(parts[:-1]):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        sub = fields.get(part)
        factory = None if sub is None else sub.default_factory
        if factory is dict:  # a free-form mapping (e.g. dataset_kwargs): a new key needs Hydra's append syntax
            return f"to add a key to the mapping {'.'.join(parts[:depth + 1])}, prefix the override with +: +{key}=..."
        if not (isinstance(factory, type) and dataclasses.is_dataclass(factory)):
            break
        cls = factory  # type: ignore[assignment]
    valid = ", ".join(f.name for f in dataclasses.fields(cls))
    where = ".".join(parts[:-1]) or "the top level"
    return f"valid keys in {where}: {valid}"
