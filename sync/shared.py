"""`shared`: trainer and engine hold the same module in one process, so a sync moves nothing."""

from __future__ import annotations

from . import register


@register("shared")
class SharedTransport:
    def __init__(self, sync_spec, **_options) -> None:
        self.spec = sync_spec

    def connect(self, engine, weights=None) -> None:
        pass

    def push(self, weights, engine) -> int:
        return 0

    @staticmethod
    def receive(engine, payload) -> None:
        pass

    def close(self) -> None:
        pass
