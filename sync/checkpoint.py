"""`checkpoint`: the trainer writes safetensors files; the engine reloads them from the directory.

The slowest transport but the most robust: it needs only a filesystem both sides see (a shared mount
across nodes), and it is how an external inference server that can only reload from disk is fed.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from ..models.factory import read_safetensors_dir
from . import register
from .base import Fingerprints, as_source, buckets, verify_written, write_weights


@register("checkpoint")
class CheckpointTransport:
    def __init__(self, sync_spec, directory: str | Path | None = None, **_options) -> None:
        self.spec = sync_spec
        self._owned = directory is None
        self.directory = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="rlspec-sync-"))

    def connect(self, engine, weights=None) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)

    def push(self, weights, engine) -> int:
        version = self.directory / "current"
        staging = self.directory / "staging"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        total, expected = as_source(weights).run_sender(
            CheckpointTransport.send, {"path": str(staging), "bucket_mb": self.spec.bucket_mb, "verify": self.spec.verify})
        shutil.rmtree(version, ignore_errors=True)
        staging.rename(version)  # the engine never sees a half-written version
        engine.receive(CheckpointTransport.receive, {"path": str(version), "expected": expected or None})
        return total

    @staticmethod
    def send(named, payload) -> tuple[int, dict]:
        """Sender half (next to the weights): write the buckets as safetensors files into `payload["path"]`."""
        total, prints = 0, Fingerprints() if payload["verify"] else None
        # fingerprinted as the trainer holds them, before bucketing: a packing bug shows on the engine
        for i, bucket in enumerate(buckets(prints.tap(named) if prints else named, payload["bucket_mb"])):
            tensors = {name: t.contiguous().cpu() for name, t in bucket.unpack()}
            save_file(tensors, str(Path(payload["path"]) / f"part-{i:05d}.safetensors"))
            total += bucket.nbytes
        return total, prints.result() if prints else {}

    @staticmethod
    def receive(engine, payload) -> None:
        written: list[str] = []
        write_weights(engine, read_safetensors_dir(Path(payload["path"])).items(), written)
        verify_written(engine, written, payload["expected"])

    def close(self) -> None:
        if self._owned:
            shutil.rmtree(self.directory, ignore_errors=True)
