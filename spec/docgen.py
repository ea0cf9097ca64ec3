"""docs/spec.md, generated from the schema dataclasses: every key's type, default, allowed values and meaning.

    python -m rlspec.spec.docgen            # rewrite docs/spec.md
    python -m rlspec.spec.docgen --check    # exit 1 if docs/spec.md is out of date

A key's meaning is its attribute docstring; its allowed values are the tuple its section passes to `one_of` in
`__post_init__` (where the section validates itself), so the page cannot drift from the checks.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Iterator

from .schema import Spec

DOC_PATH = Path("docs") / "spec.md"
COMMAND = "python -m rlspec.spec.docgen"

HEADER = f"""# Spec reference

Every key of an experiment spec, generated from the schema dataclasses (`spec/schema.py`, `spec/sources.py`,
`spec/evaluation.py`) by
`{COMMAND}`; edit the docstrings there, not this page. A key is set in the YAML file (`algorithm: {{lr: 1e-5}}`)
or on the command line after the spec (`algorithm.lr=1e-5`, Hydra syntax); a key of a free-form mapping is added
with `+` (`+rollout.task.reward_kwargs.target_len=4`). Presets are Hydra config groups under `spec/presets/`
(`model=qwen2_0p5b_shape`, `hardware=gpu1`): a preset chosen on the command line overrides that section's values in
the file, a preset the file chooses in its own `defaults:` list is overridden by the file's values, and a
`key=value` override always wins. `null` means unset. Checks that span sections (placement, sync method against
backend) are the compiler's (`spec/compile.py`); `rlspec plan SPEC` runs them all.
"""


@dataclasses.dataclass(frozen=True)
class Key:
    path: str
    type: str
    default: str
    allowed: str
    meaning: str


def _attribute_docs(cls: type) -> dict[str, str]:
    """`{field: docstring}` from the string literal that follows each annotated field in the class body."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def _allowed_values(cls: type) -> dict[str, tuple]:
    """`{field: values}` for each `one_of(self.<field>, <values>, ...)` in the section's `__post_init__`."""
    post_init = cls.__dict__.get("__post_init__")
    if post_init is None:
        return {}
    module = sys.modules[cls.__module__]
    tree = ast.parse(textwrap.dedent(inspect.getsource(post_init)))
    found = {}
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "one_of"
                and len(call.args) >= 2):
            continue
        target, values = call.args[0], call.args[1]
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            if isinstance(values, ast.Name):
                found[target.attr] = tuple(getattr(module, values.id))
            elif isinstance(values, (ast.Tuple, ast.List)):
                found[target.attr] = tuple(ast.literal_eval(values))
    return found


def _sub_section(field: dataclasses.Field) -> type | None:
    factory = field.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None  # type: ignore[return-value]


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    else:
        value = field.default_factory()  # type: ignore[misc]
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"' if value else '""'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _type(annotation: object) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    for old, new in (("Optional[", "optional "), ("List[", "list of "), ("Dict[str, Any]", "mapping"), ("]", "")):
        text = text.replace(old, new)
    return text


def sections(cls: type = Spec, prefix: str = "") -> Iterator[tuple[str, type, list[Key]]]:
    """(section path, its class, its own keys), the section first, then its sub-sections, depth first."""
    docs, allowed = _attribute_docs(cls), _allowed_values(cls)
    keys, subs = [], []
    for field in dataclasses.fields(cls):
        path = f"{prefix}{field.name}"
        sub = _sub_section(field)
        if sub is not None:
            subs.append((path, sub))
            continue
        values = allowed.get(field.name, ())
        keys.append(Key(path, _type(field.type), _default(field), " \\| ".join(f"`{v}`" for v in values),
                        docs.get(field.name, "")))
    yield prefix.rstrip(".") or "top level", cls, keys
    for path, sub in subs:
        yield from sections(sub, f"{path}.")


def render() -> str:
    lines = [HEADER]
    for path, cls, keys in sections():
        if not keys:
            continue
        level = "##" if path.count(".") == 0 else "###"
        lines += [f"{level} `{path}`" if path != "top level" else "## Top level", ""]
        lines += [" ".join(inspect.cleandoc(cls.__doc__ or "").split()), ""]
        lines += ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        for key in keys:
            meaning = key.meaning.replace("|", "\\|")
            lines.append(f"| `{key.path}` | {key.type} | `{key.default}` | {key.allowed} | {meaning} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Write docs/spec.md from the schema dataclasses.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from what would be written")
    parser.add_argument("--out", type=Path, default=DOC_PATH, help=f"where to write (default {DOC_PATH})")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.is_file() else ""
        if current != text:
            print(f"{args.out} is out of date: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
