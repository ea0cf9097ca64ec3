"""The bridge's operations: what a trainer may ask a rollout server to run, by name, and how a call travels.

A `sync` transport hands its engine half to `engine.receive(fn, payload)`. In-process and in a Ray actor that
runs `fn(engine, payload)`; over HTTP no code travels: `operation_for(fn)` finds the operation registered for
that function, the request names it, and the server runs *its own* copy of the function. A function that is
not in `OPERATIONS` cannot be sent, and a request naming an unknown operation is refused.

A call travels as one safetensors file: its tensors, and in its metadata a JSON header `{"op": NAME,
"payload": VALUE}`. `encode` turns a payload into JSON plus tensors: tensors (and bytes, dtypes) are replaced
by tagged references (`{"$tensor": "t0"}`), tuples are tagged so they come back as tuples; nothing else is
accepted (a dataclass is flattened by its operation's `pack`). Decoding reads JSON and safetensors only: no
pickle, so a request can name work but never bring it. A reply is JSON, or the same safetensors framing when
tensors come back.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch
from torch import Tensor

HEADER_KEY = "rlspec_bridge"
"""The safetensors metadata key that holds a call's (or a reply's) JSON header."""
MEDIA_TYPE = "application/x-rlspec-bridge"
"""A body in the bridge's framing (safetensors with the JSON header in its metadata)."""
_TAGS = ("$tensor", "$tuple", "$bytes", "$dtype")


class BridgeRequestError(ValueError):
    """A request the server refuses (4xx): a pickle, a malformed body, an unknown operation."""


@dataclass(frozen=True)
class Operation:
    name: str
    fn: Callable[[Any, Any], Any]
    """The engine half, `fn(engine, payload)`, run in the server."""
    pack: Callable[[Any], Any] | None = None
    """Trainer side: the payload as `encode` takes it (e.g. a dataclass as a dict)."""
    unpack: Callable[[Any], Any] | None = None
    """Server side: the inverse of `pack`."""
    writes_weights: bool = False
    """It changes the engine's weights: a call may carry the `weight_version` they become (`EngineHost.receive`)."""


# --- the plain engine calls of `ServedEngine` (engine halves that belong to no transport) ----------------------

def engine_logprobs(engine, batch) -> Tensor:
    return engine.logprobs(batch).cpu()


def engine_load_weights(engine, named: list) -> None:
    engine.load_weights(named)


def engine_named_weights(engine, _payload) -> list:
    return [(name, t.detach().cpu()) for name, t in engine.named_weights()]


def engine_describe(engine, _payload) -> dict:
    """Where engine work runs and how the engine samples (the server's tests and GPU checks read it)."""
    import threading

    sampler = getattr(engine, "_graph_sampler", None)
    kind = getattr(engine, "sampler_kind", None)
    return {"thread": threading.current_thread().name, "sampler": kind() if kind else None,
            "sampler_class": type(sampler).__name__ if sampler is not None else None,
            "use_graphs": getattr(sampler, "use_graphs", None),
            "captured": len(getattr(sampler, "_warmed", ()) or ())}


def _pack_batch(batch) -> dict:
    return {f.name: getattr(batch, f.name) for f in fields(batch)}


def _unpack_batch(value: dict):
    from ..core.batch import TrainBatch

    return TrainBatch(**value)


def operations() -> dict[str, Operation]:
    """Every operation a server runs, by name: the engine halves of the transports a rollout server takes
    (`checkpoint`, `lora`, `nccl`, `cuda_ipc`) and the plain engine calls."""
    from ..sync.checkpoint import CheckpointTransport
    from ..sync.collective import CollectiveTransport
    from ..sync.cuda_ipc import CudaIpcTransport
    from ..sync.lora import LoraTransport

    ops = [
        Operation("engine.logprobs", engine_logprobs, _pack_batch, _unpack_batch),
        Operation("engine.load_weights", engine_load_weights, writes_weights=True),
        Operation("engine.named_weights", engine_named_weights),
        Operation("engine.describe", engine_describe),
        Operation("checkpoint.receive", CheckpointTransport.receive, writes_weights=True),
        Operation("lora.receive", LoraTransport.receive, writes_weights=True),
        Operation("nccl.join", CollectiveTransport.join_receiver),
        Operation("nccl.receive", CollectiveTransport.receive, writes_weights=True),
        Operation("nccl.receive_streamed", CollectiveTransport.receive_streamed, writes_weights=True),
        Operation("nccl.leave", CollectiveTransport.leave),
        Operation("nccl.raw_receive", CollectiveTransport.raw_receive),
        Operation("cuda_ipc.receive", CudaIpcTransport.receive, writes_weights=True),
        Operation("cuda_ipc.forget", CudaIpcTransport.forget),
    ]
    return {op.name: op for op in ops}


def operation_for(fn) -> Operation:
    """The operation whose engine half is `fn`; `ValueError` naming `fn` when it has none."""
    for op in operations().values():
        if op.fn is fn:
            return op
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    raise ValueError(f"{name} is not a bridge operation: a rollout server runs only its own operations "
                     f"({', '.join(sorted(operations()))}); register the engine half in rlspec/serve/ops.py")


# --- the wire format ------------------------------------------------------------------------------------------

def encode(value: Any, tensors: dict[str, Tensor]) -> Any:
    """`value` as JSON-able data; its tensors are moved into `tensors` (CPU, contiguous, own storage)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().to("cpu").contiguous().clone()  # safetensors refuses shared storage
        return {"$tensor": key}
    if isinstance(value, (tuple, torch.Size)):
        return {"$tuple": [encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [encode(v, tensors) for v in value]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str) or k in _TAGS]
        if bad:
            raise TypeError(f"bridge payload: dict key {bad[0]!r} is not a plain string")
        return {k: encode(v, tensors) for k, v in value.items()}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    raise TypeError(f"bridge payload: a {type(value).__name__} cannot travel (only JSON values, tuples, bytes, "
                    "dtypes and tensors)")


def decode(value: Any, tensors: dict[str, Tensor]) -> Any:
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (tag, inner), = value.items()
        if tag == "$tensor":
            if inner not in tensors:
                raise BridgeRequestError(f"the header names tensor {inner!r}, which the body lacks")
            return tensors[inner]
        if tag == "$tuple":
            return tuple(decode(v, tensors) for v in inner)
        if tag == "$bytes":
            return base64.b64decode(inner)
        if tag == "$dtype":
            dtype = getattr(torch, str(inner), None)
            if not isinstance(dtype, torch.dtype):
                raise BridgeRequestError(f"{inner!r} is not a torch dtype")
            return dtype
    return {k: decode(v, tensors) for k, v in value.items()}


def pack(header: dict, value: Any) -> bytes:
    """One message: the safetensors file of `value`'s tensors, `header` (plus the encoded value) in its metadata."""
    tensors: dict[str, Tensor] = {}
    return frame({**header, "payload": encode(value, tensors)}, tensors)


def frame(header: dict, tensors: dict[str, Tensor]) -> bytes:
    """A message of an already encoded header (its `payload` refers to `tensors`)."""
    from safetensors.torch import save

    return save(tensors, metadata={HEADER_KEY: json.dumps(header)})


def unpack(body: bytes) -> tuple[dict, Any]:
    """(header, decoded value) of a message from `pack`; `BridgeRequestError` naming what is wrong otherwise."""
    from safetensors.torch import load

    if looks_pickled(body):
        raise BridgeRequestError("the body is a Python pickle, which this server never loads: the bridge takes a "
                                 "named operation (JSON header + safetensors); update the trainer's rlspec")
    if len(body) < 8:
        raise BridgeRequestError("empty or truncated body: expected a safetensors message with a JSON header")
    try:
        header_len = int.from_bytes(body[:8], "little")
        meta = json.loads(body[8:8 + header_len]).get("__metadata__") or {}
        header = json.loads(meta[HEADER_KEY])
        tensors = load(body)
    except Exception as err:  # noqa: BLE001 - any parse failure is the sender's
        raise BridgeRequestError(f"not a bridge message (safetensors with a {HEADER_KEY!r} JSON header): "
                                 f"{type(err).__name__}: {err}") from None
    if not isinstance(header, dict):
        raise BridgeRequestError("the bridge header is not a JSON object")
    return header, decode(header.pop("payload", None), tensors)


def looks_pickled(body: bytes) -> bool:
    """A pickle of protocol 2 or later starts with the PROTO opcode and its version."""
    return len(body) >= 2 and body[0] == 0x80 and 2 <= body[1] <= 5
