"""Weight transports, registered by name: the only code that moves weights from trainer to engine."""

from __future__ import annotations

from typing import Callable

from .base import (Bucket, Fingerprints, LocalWeights, SyncError, Transport, WeightSource, as_source, buckets,
                   check_mapping, checksums, collect_cpu, compare_checksums, compare_fingerprints, fingerprint,
                   is_adapter, receive_beside, send_beside, verify_written, write_weights)

_REGISTRY: dict[str, Callable[..., Transport]] = {}
_MODULES = {"shared": ".shared", "checkpoint": ".checkpoint", "ray": ".ray_store", "nccl": ".collective",
            "cuda_ipc": ".cuda_ipc", "lora": ".lora"}


def register(name: str):
    """Class decorator: make a transport available as `sync.method=<name>`."""
    def wrap(cls):
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return wrap


def transport_class(name: str):
    """The transport class for `name`, importing its module on first use."""
    if name not in _REGISTRY and name in _MODULES:
        import importlib

        importlib.import_module(_MODULES[name], __name__)
    if name not in _REGISTRY:
        raise KeyError(f"no transport named {name!r}; known: {', '.join(sorted(_MODULES))}")
    return _REGISTRY[name]


def build_transport(name: str, sync_spec, **options) -> Transport:
    return transport_class(name)(sync_spec, **options)


__all__ = ["Bucket", "Fingerprints", "LocalWeights", "SyncError", "Transport", "WeightSource", "as_source", "buckets",
           "build_transport", "check_mapping", "checksums", "collect_cpu", "compare_checksums",
           "compare_fingerprints", "fingerprint", "is_adapter", "receive_beside", "register", "send_beside", "transport_class", "verify_written",
           "write_weights"]
