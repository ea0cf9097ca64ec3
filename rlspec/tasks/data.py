"""Local data for `rollout.task.name: dataset` (and gsm8k, one instance of it): a .jsonl or .parquet file, or a
directory saved by `datasets` (`save_to_disk`).

Two halves. `data_columns` reads only the column names (a parquet schema, a JSON line, the saved directory's
json files), so `rlspec plan` checks a mapping in milliseconds without importing `datasets`, torch or
transformers. `load_records` reads the records through `datasets` when a run starts.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any, Callable

from ..spec import SpecError, TaskSpec
from ..spec.files import check_file
from .base import Prompt

KEY = "rollout.task.data_path"
FORMATS = "a .jsonl or .parquet file, or a directory saved by datasets (save_to_disk)"


Columns = dict
"""{column name: the names inside it where it is a struct (a nested Columns), else None}, in the data's order."""


def data_columns(spec: TaskSpec) -> Columns:
    """The columns of the data `spec` names; a missing or unreadable file, an unknown split, is a `SpecError`."""
    path = Path(spec.data_path)
    if path.is_dir():
        return _saved_columns(path, spec.split)
    check_file(path, KEY, FORMATS)
    if spec.split != "train":
        raise SpecError("rollout.task.split", f"{path} is one file, one split (train); there is no split {spec.split!r}",
                        "remove rollout.task.split, or save the splits with DatasetDict.save_to_disk and point data_path there")
    if path.suffix == ".parquet":
        return _parquet_columns(path)
    if path.suffix == ".jsonl":
        return _jsonl_columns(path)
    raise SpecError(KEY, f"{path} is not {FORMATS} (by its suffix)", "convert it, or rename a JSON-lines file to .jsonl")


def _parquet_columns(path: Path) -> Columns:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SpecError(KEY, "reading parquet needs pyarrow", "pip install 'rlspec[data]' or use .jsonl") from None
    try:
        schema = pq.read_schema(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises its own types for corrupt files
        raise SpecError(KEY, f"{path} is not a readable parquet file ({type(err).__name__}: {str(err)[:200]})",
                        "write it again (e.g. Dataset.to_parquet), or give a .jsonl") from None
    return {field.name: _arrow_fields(field.type) for field in schema}


def _arrow_fields(kind) -> Columns | None:
    import pyarrow as pa

    return {f.name: _arrow_fields(f.type) for f in kind} if pa.types.is_struct(kind) else None


def _jsonl_columns(path: Path) -> Columns:
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    return _value_fields(_json_object(line, f"{path}:{lineno}", 1))
    except UnicodeDecodeError:
        raise SpecError(KEY, f"{path} is not UTF-8 text", "give a JSON-lines file (one JSON object per line)") from None
    except OSError as err:
        raise SpecError(KEY, f"{path} cannot be read: {err.strerror or err}", "check the file's permissions") from None
    raise SpecError(KEY, f"{path} holds no records", "give a file with at least one record")


def _value_fields(value) -> Columns | None:
    return {key: _value_fields(item) for key, item in value.items()} if isinstance(value, dict) else None


def _json_object(line: str, where: str, number: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise SpecError(where, f"record {number} is not valid JSON ({err.msg})", "one JSON object per line") from None
    if not isinstance(record, dict):
        raise SpecError(where, f"record {number} is a JSON {type(record).__name__}, not an object",
                        "one JSON object per line, e.g. {\"prompt\": ...}")
    return record


def _saved_columns(path: Path, split: str) -> Columns:
    """A `save_to_disk` directory: a `DatasetDict` (dataset_dict.json lists its splits, one directory each) or a
    `Dataset` (its features in dataset_info.json)."""
    splits_file = path / "dataset_dict.json"
    if splits_file.is_file():
        splits = _read_json(splits_file).get("splits", [])
        if split not in splits:
            raise SpecError("rollout.task.split", f"{path} has no split {split!r}", f"use one of: {', '.join(splits)}")
        return _saved_columns(path / split, "train")
    info, state = path / "dataset_info.json", path / "state.json"
    if not info.is_file() or not state.is_file():
        raise SpecError(KEY, f"{path} is a directory but not one saved by datasets (no dataset_dict.json, or "
                        "dataset_info.json and state.json)", f"give {FORMATS}")
    saved_split = _read_json(state).get("_split")
    if split not in ("train", saved_split):
        raise SpecError("rollout.task.split", f"{path} holds one saved split ({saved_split or 'unnamed'}), not {split!r}",
                        "remove rollout.task.split, or save the splits with DatasetDict.save_to_disk")
    features = _read_json(info).get("features")
    if not isinstance(features, dict):
        raise SpecError(KEY, f"{info} lists no features", "save the dataset again with save_to_disk")
    return _feature_fields(features)


def _feature_fields(features: dict) -> Columns:
    """A struct feature is saved as a plain mapping of its fields; every other feature names its `_type`."""
    return {name: _feature_fields(f) if isinstance(f, dict) and "_type" not in f else None for name, f in features.items()}


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SpecError(KEY, f"{path} cannot be read ({type(err).__name__})", "save the dataset again with save_to_disk") from None
    return data if isinstance(data, dict) else {}


def check_mapping(spec: TaskSpec, columns: Columns, template: str | None) -> None:
    """Every column the spec maps (the prompt column or the template's fields, the answer column) exists."""
    have = f"the columns are: {', '.join(columns)}"
    if template is not None:
        for name in template_fields(template):
            if name not in columns:
                raise SpecError("rollout.task.prompt_template", f"names the column {name!r}, which {spec.data_path} "
                                "does not have", have)
    elif spec.prompt_column not in columns:
        raise SpecError("rollout.task.prompt_column", f"{spec.data_path} has no column {spec.prompt_column!r}", have)
    if spec.answer_column is not None:
        level, path = columns, []
        for part in spec.answer_column.split("."):
            if not isinstance(level, dict) or part not in level:
                inside = f" in {'.'.join(path)}" if path else ""
                there = (f"the fields of {'.'.join(path)} are: {', '.join(level)}" if isinstance(level, dict)
                         else f"{'.'.join(path)} is not a struct") if path else have
                raise SpecError("rollout.task.answer_column",
                                f"{spec.data_path} has no {'field' if path else 'column'} {part!r}{inside}", there)
            level, path = level[part], [*path, part]


def template_fields(template: str) -> list[str]:
    """The {field} names of a prompt template; a malformed one, or a positional {}, is a `SpecError`."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise SpecError("rollout.task.prompt_template", f"is not a valid format string ({err})",
                        "write fields as {question}; double literal braces as {{ }}") from None
    for name in names:
        if not name.isidentifier():
            raise SpecError("rollout.task.prompt_template", f"has the field {{{name}}}, not a column name",
                            "name a column in each {}, e.g. {question}; double literal braces as {{ }}")
    return names


def load_records(spec: TaskSpec, skip: int = 0) -> list[dict[str, Any]]:
    """The records (at most `num_records`, after the first `skip`: an eval's held-out records), read through
    `datasets`."""
    try:
        import datasets
    except ImportError:
        raise SpecError(KEY, "reading a dataset needs the datasets library, not installed in this environment",
                        "pip install 'rlspec[data]'") from None
    datasets.disable_progress_bars()
    path = Path(spec.data_path)
    try:
        if path.is_dir():
            data = datasets.load_from_disk(str(path))
            if isinstance(data, datasets.DatasetDict):
                data = data[spec.split]
        else:
            builder = "parquet" if path.suffix == ".parquet" else "json"
            data = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as err:  # noqa: BLE001 - datasets and pyarrow raise many types for a bad file
        if path.suffix == ".jsonl":
            _find_bad_line(path)
        raise SpecError(KEY, f"{path} cannot be read by datasets ({type(err).__name__}: {str(err)[:300]})",
                        f"give {FORMATS}") from None
    if spec.num_records or skip:
        stop = min(skip + spec.num_records, len(data)) if spec.num_records else len(data)
        data = data.select(range(min(skip, len(data)), stop))
    records = data.to_list()
    if not records:
        if skip:
            raise SpecError("eval.holdout_records", f"{path} holds no records past the first {skip} kept out for eval",
                            "lower eval.holdout_records")
        raise SpecError(KEY, f"{path} holds no records", "give data with at least one record")
    return records


def _find_bad_line(path: Path) -> None:
    """Raise a `SpecError` naming the first line of a JSON-lines file that is not a JSON object."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    numbered = [(lineno, line) for lineno, line in enumerate(lines, 1) if line.strip()]
    for number, (lineno, line) in enumerate(numbered, 1):
        _json_object(line, f"{path}:{lineno}", number)


Render = Callable[[list], str]
"""Chat messages -> the prompt text (the tokenizer's chat template with the generation prompt)."""


def to_prompts(records: list[dict[str, Any]], spec: TaskSpec, template: str | None, render: Render | None) -> list[Prompt]:
    """One `Prompt` per record: its text (the template filled in, the prompt column's text, or its chat messages
    rendered) and every column as metadata (the answer column also as `answer`)."""
    prompts = []
    for i, record in enumerate(records):
        if template is not None:
            text = template.format_map(record)
        else:
            text = _prompt_text(record[spec.prompt_column], render, f"{spec.data_path}: record {i + 1}", spec.prompt_column)
        meta = dict(record)
        if spec.answer_column is not None:
            meta["answer"] = field_value(record, spec.answer_column)
        prompts.append(Prompt(text, meta))
    return prompts


def field_value(record: dict, dotted: str) -> Any:
    """`record["a"]["b"]` for "a.b" (a struct column's field, e.g. verl's reward_model.ground_truth)."""
    value = record
    for part in dotted.split("."):
        value = value[part] if isinstance(value, dict) else None
    return value


def _prompt_text(value: Any, render: Render | None, where: str, column: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        if render is None:
            raise SpecError(where, f"column {column!r} holds chat messages but no tokenizer renders them", "")
        return render([{k: v for k, v in m.items() if v is not None} for m in value])
    raise SpecError(where, f"column {column!r} holds {type(value).__name__} {str(value)[:80]!r}, neither text nor chat "
                    "messages ([{role, content}, ...])", "point rollout.task.prompt_column at the prompt text or messages")


def chat_renderer(tokenizer) -> Render:
    """`render(messages)` with the tokenizer's chat template; a tokenizer without one is a `SpecError`."""
    if not getattr(tokenizer, "chat_template", None):
        raise SpecError("rollout.task.prompt_column", "holds chat messages, but the model's tokenizer has no chat template",
                        "use a model whose tokenizer has one (instruct models do), or a text prompt column")

    def render(messages: list) -> str:
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as err:  # noqa: BLE001 - a template's own error (e.g. an unsupported role order) is bad input
            raise SpecError("rollout.task.prompt_column", f"the chat template refused a record's messages: "
                            f"{type(err).__name__}: {err}", "check the messages' roles and order") from None

    return render
