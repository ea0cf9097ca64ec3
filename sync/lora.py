"""`lora`: only the LoRA adapter tensors move; the engine holds the same frozen base and swaps its adapters.

A LoRA run changes nothing but the adapters, so moving the merged full weights every step (what the other
transports do) moves the whole model for a few MB of change. Here the engine is built with the same base
and the same adapter layout as the trainer (same spec and seed), and a push copies the adapter tensors
(`lora_A` / `lora_B`, PEFT state-dict names) into the engine's adapters. The engine then verifies that
every one of its adapter tensors was written exactly once and matches the trainer's fingerprint.

The sender half runs through the weight source's `run_adapter_sender` (a source offers it when its
trainer has adapters); the adapters travel as CPU tensors inside the payload, in-process or over the serve
bridge.
"""

from __future__ import annotations

from . import register
from .base import SyncError, as_source, fingerprint, is_adapter, verify_written, write_weights


@register("lora")
class LoraTransport:
    def __init__(self, sync_spec, **_options) -> None:
        self.spec = sync_spec

    def connect(self, engine, weights=None) -> None:
        if weights is not None and not hasattr(as_source(weights), "run_adapter_sender"):
            raise SyncError("sync.method=lora: the backend's weight source offers no adapters "
                            "(run_adapter_sender); use a backend with LoRA support or another sync.method")

    def push(self, weights, engine) -> int:
        source = as_source(weights)
        if not hasattr(source, "run_adapter_sender"):
            raise SyncError("sync.method=lora: the weight source offers no adapters (run_adapter_sender)")
        sent = source.run_adapter_sender(LoraTransport.send, {"verify": self.spec.verify})
        engine.receive(LoraTransport.receive, sent)
        return sent["bytes"]

    @staticmethod
    def send(named, payload) -> dict:
        tensors = [(name, t.detach().to("cpu", copy=True)) for name, t in named]
        if not tensors:
            raise SyncError("sync.method=lora: the trainer has no LoRA adapters (model.lora.r=0?)")
        return {"tensors": tensors, "expected": fingerprint(tensors) if payload["verify"] else None,
                "bytes": sum(t.numel() * t.element_size() for _, t in tensors)}

    @staticmethod
    def receive(engine, payload) -> None:
        written: list[str] = []
        write_weights(engine, payload["tensors"], written)
        verify_written(engine, written, payload["expected"], scope=is_adapter)

    def close(self) -> None:
        pass
