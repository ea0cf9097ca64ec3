"""Checks of the model a spec names, before anything is built: a known preset, or a `model.path` directory whose
config, tokenizer and safetensors files are intact (and, where the run is about to start, fit each other).

Imports neither torch nor transformers at module level: `rlspec plan` runs the file checks without them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..spec import ModelSpec, SpecError
from ..spec.files import read_text
from .presets import PRESETS, VLA_PRESETS


def check_model_spec(spec: ModelSpec, weights: bool = True) -> None:
    """Refuse, before anything is built, an unknown preset or a `model.path` that would not load as it should:
    unreadable config, no tokenizer, missing, corrupt or truncated weights (the compiler has checked that
    the directory and its config.json exist).

    `weights=False` (`rlspec plan`) checks the files without torch or transformers: config.json parses, the
    safetensors headers are intact and the files hold every byte they describe. `weights=True` (`rlspec run`) also
    loads the config with transformers and checks each weight's shape against the model it builds (on the meta
    device)."""
    if spec.kind == "vla":
        if spec.path is None and spec.preset not in VLA_PRESETS:
            raise SpecError("model.preset", f"{spec.preset!r} is not a VLA preset (model.kind=vla)",
                            f"use one of: {', '.join(VLA_PRESETS)}, or set model.path to a local image-text-to-text model")
        return
    if spec.path is None:
        if spec.preset not in PRESETS:
            raise SpecError("model.preset", f"unknown preset {spec.preset!r}",
                            f"use one of: {', '.join(PRESETS)}, or set model.path to a local model directory")
        return
    path, key = Path(spec.path), "model.path"
    config = read_config(path, key) if weights else _read_config_json(path, key)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise SpecError(key, f"{path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})",
                        "save it there with tokenizer.save_pretrained(model.path)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if any(path.glob("pytorch_model*.bin")):
            return  # legacy PyTorch weights: transformers checks them while loading
        raise SpecError(key, f"{path} holds no weights (*.safetensors)", "save the model there with save_pretrained")
    if weights:
        check_weights(files, config, key, strict=False)
    else:
        for file in files:
            safetensors_header(file, key)


def _read_config_json(path: Path, key: str) -> dict:
    """config.json as a mapping, without transformers; an unreadable one is a `SpecError` naming `key`."""
    try:
        config = json.loads(read_text(path / "config.json", key, "a Hugging Face config.json"))
    except ValueError as err:
        raise SpecError(key, f"{path / 'config.json'} cannot be read (JSONDecodeError: {str(err)[:200]})",
                        "save the model there again with save_pretrained") from None
    if not isinstance(config, dict):
        raise SpecError(key, f"{path / 'config.json'} holds a {type(config).__name__}, not a mapping",
                        "save the model there again with save_pretrained")
    return config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
"""One of these must be beside a `model.path` model: without them `AutoTokenizer` silently builds an
empty tokenizer from the config's model type (every prompt encodes to no tokens)."""
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


def read_config(path: Path, key: str):
    """The Hugging Face config of a model directory; an unreadable one is a `SpecError` naming `key`."""
    from transformers import AutoConfig

    try:
        json.loads(read_text(path / "config.json", key, "a Hugging Face config.json"))
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except SpecError:
        raise
    except Exception as err:  # noqa: BLE001 - json and transformers raise many types for a bad config
        raise SpecError(key, f"{path / 'config.json'} cannot be read ({type(err).__name__}: {str(err)[:200]})",
                        "save the model there again with save_pretrained") from None


def safetensors_header(file: Path, key: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """`{name: (dtype, shape)}` of a safetensors file, after checking that its header is intact and that the
    file holds every byte the header describes (a truncated copy fails here, not inside `from_pretrained`)."""
    fix = "copy or save the file again (an interrupted download or copy leaves it truncated)"
    size = file.stat().st_size
    try:
        with file.open("rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= size - 8:
                raise SpecError(key, f"{file} is not a safetensors file (corrupt or truncated header)", fix)
            header = json.loads(f.read(length))
    except (OSError, ValueError) as err:
        raise SpecError(key, f"{file} has a corrupt safetensors header ({type(err).__name__})", fix) from None
    header.pop("__metadata__", None)
    tensors, end = {}, 0
    for name, info in header.items():
        try:
            begin, stop = info["data_offsets"]
            shape = tuple(int(d) for d in info["shape"])
            dtype = info["dtype"]
        except (KeyError, TypeError, ValueError):
            raise SpecError(key, f"{file} has a corrupt safetensors header (entry {name!r})", fix) from None
        width = _SAFETENSORS_BYTES.get(dtype)
        if width is not None and stop - begin != width * math.prod(shape):
            raise SpecError(key, f"{file} is corrupt: tensor {name!r} has {stop - begin} bytes for shape {list(shape)}", fix)
        tensors[name] = (dtype, shape)
        end = max(end, stop)
    if 8 + length + end > size:
        raise SpecError(key, f"{file} is truncated: its header describes {8 + length + end} bytes, the file has {size}", fix)
    return tensors


def check_weights(files: list[Path], config, key: str, strict: bool, fix: str = "") -> None:
    """Refuse safetensors `files` that are corrupt or do not fit the model `config` builds.

    Every tensor whose name the model has must have the model's shape. `strict` (rlspec's own
    checkpoints) also refuses names the model lacks and weights the files lack; otherwise (a user's
    `model.path`, which transformers may rename while loading) the files only need to share names with it.
    """
    found: dict[str, tuple[int, ...]] = {}
    for file in files:
        found.update({name: shape for name, (_, shape) in safetensors_header(file, key).items()})
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = model.state_dict(keep_vars=True)
    fix = fix or "point model.path at the model these weights belong to"
    for name, shape in found.items():
        if name in params and tuple(params[name].shape) != shape:
            raise SpecError(key, f"{files[0].parent} holds weights of another model: {name} is {list(shape)}, "
                            f"the config's model has {list(params[name].shape)}", fix)
    shared = [name for name in found if name in params]
    if not shared:
        raise SpecError(key, f"{files[0].parent} holds no weight of this model (e.g. it has {next(iter(found), 'none')!r}, "
                        f"the model expects {next(iter(params))!r})", fix)
    if strict:
        unknown = [name for name in found if name not in params]
        by_tensor: dict[int, list[str]] = {}
        for name, tensor in params.items():  # tied weights are one tensor under several names
            by_tensor.setdefault(id(tensor), []).append(name)
        missing = [names[0] for names in by_tensor.values() if not any(n in found for n in names)]
        if unknown or missing:
            detail = f"weights this model lacks: {unknown[:3]}" if unknown else f"no weight for {missing[:3]}"
            raise SpecError(key, f"{files[0].parent} holds weights of another model ({detail})", fix)


