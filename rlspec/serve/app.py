"""The server's HTTP app. It knows no transport: `/bridge/receive` runs a named operation (`ops.py`), the engine
half of whichever `sync` transport the trainer uses, exactly as an in-process or Ray engine runs it. The server
runs only its own code: a request names the operation and carries data (JSON + safetensors), never code.

Endpoints:
- `GET /health`: status, weight version, model, pid, how the engine samples (`cuda_graph` or `plain (why)`).
- `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`: the OpenAI API (`openai_api.py`);
  each choice also carries `token_ids` and `prompt_token_ids`, and the log-probs are the engine's log-probs
  of the sampled tokens (log_softmax(logits / temperature), as the trainer computes them).
- `GET|POST /bridge/weight_version`: the trainer step whose weights the engine serves (null while a push is
  not yet labelled and after a failed sync: the weights are then of unknown version). A completion carries the
  `weight_version` its tokens were sampled with: a weight write or label waits for the rows in flight
  (`scheduler.py`), so no completion straddles two versions.
- `POST /bridge/receive`: a bridge message (`ops.pack`: safetensors whose metadata holds the JSON header
  `{"op": NAME, "payload": ...}`) -> the result, as JSON `{"result": ...}` or, when tensors come back, a
  bridge message; needs `Authorization: Bearer TOKEN`. A pickled body, a malformed one or an unknown operation
  gets a 400 naming the problem; a failing operation a 500 with JSON `{"error", "traceback", "sync_error"}`.

A bad request gets 400 with OpenAI's error object (`shapes.py`: `{"error": {"message", "type", "param",
"code"}}`, `param` naming the field; and, where a spec setting decides it, e.g. a prompt longer than
`rollout.max_prompt_tokens`, the `spec_key` and its `fix`, which a trainer's client turns back into the
`SpecError` the colocated engine raises), an unknown model 404; a failing bridge call a 500 with the server's
traceback. A request past the scheduler's bound of queued rows gets 429 with `Retry-After`. All engine work runs
on one engine thread, in order (every request in flight decoding in one batch); `/health` never waits for it.
"""

from __future__ import annotations

import hmac
import json
import os
import time
import traceback
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from pydantic import BaseModel, Field

from . import ops
from .openai_api import OpenAIRoutes
from .scheduler import Scheduler
from .shapes import install_error_handlers

MAX_QUEUED_ROWS = 8192
"""`rlspec serve --max-queued-rows`'s default: rows that may wait for a decode slot before requests get 429."""


class VersionRequest(BaseModel):
    version: int = Field(..., ge=0)


FAULT_ENV = "RLSPEC_SERVE_FAULT"
"""Test hook, `skip:NAME` (an operation's name or its function's qualname): bridge calls of that operation
return without running (a peer that never joins a group); `hang_start`: the server never becomes healthy."""


class EngineHost:
    """The engine behind the app: its scheduler (one engine thread: every request in flight in one decode batch,
    bridge jobs between decode steps; `scheduler.py`), plus the weight version it serves."""

    def __init__(self, engine, model_name: str, max_queued_rows: int = MAX_QUEUED_ROWS,
                 owns_weights: bool = False, max_model_len: int | None = None) -> None:
        fault = os.environ.get(FAULT_ENV, "")
        self.skip = fault.removeprefix("skip:") if fault.startswith("skip:") else None
        self.engine = engine
        self.model_name = model_name
        self.weight_version: int | None = 0
        """Changed only on the engine thread, by jobs, which run with no row in flight: a completion reports the
        version all of its tokens were sampled with."""
        self.thread = Scheduler(engine, self, max_queued_rows, on_submitted_error=self._weights_unknown,
                                on_submitted_start=self._weights_unknown, owns_weights=owns_weights,
                                max_model_len=max_model_len)
        self.started = time.time()

    def _weights_unknown(self, _err: BaseException | None = None) -> None:
        self.weight_version = None  # a sync may have written part of the weights

    async def label(self, version: int) -> None:
        """The weights now in the engine are trainer step `version`'s (after every job queued before)."""
        def set_version():
            self.weight_version = version

        await self.thread.run_async(set_version)

    async def receive(self, op, payload, version: int | None = None) -> Any:
        """Run operation `op` (an `ops.Operation`) on the engine thread. One that writes weights leaves them
        unlabelled (version null) until it succeeds with a `version` or the trainer labels them; a failure marks
        them unknown. Completions sampled meanwhile report null, never a version their weights are not."""
        if self.skip is not None and self.skip in (op.name, op.fn.__qualname__):
            return None

        def job():
            if op.writes_weights:
                self.weight_version = None
            try:
                result = op.fn(self.engine, payload)
            except BaseException:
                self._weights_unknown()
                raise
            if op.writes_weights and version is not None:
                self.weight_version = version
            return result

        return await self.thread.run_async(job)

    def state(self) -> dict:
        """What `/health` says of the engine: its weight version, how it samples, the scheduler's counters."""
        sampler = getattr(self.engine, "sampler_kind", None)
        return {"weight_version": self.weight_version, "sampler": sampler() if sampler else None,
                "scheduler": self.thread.describe()}

    async def bridge(self, body: bytes) -> tuple[int, str, bytes]:
        return await bridge_call(self, body)

    async def generate_alone(self, *args, abort=None):
        """A request the decode batch cannot take, sampled alone on the engine thread (`openai_api.generate_alone`;
        `abort`: its client went away)."""
        from .openai_api import generate_alone

        return await self.thread.run_async(generate_alone, self, *args, abort, beside=self.thread.outside)


def _json(value: dict, status_code: int = 200) -> tuple[int, str, bytes]:
    """(status, media type, body) of JSON that keeps non-finite floats (a sync's timings or a loss may be NaN;
    `JSONResponse` refuses them)."""
    return status_code, "application/json", json.dumps(value).encode()


async def bridge_call(host: EngineHost, body: bytes) -> tuple[int, str, bytes]:
    """`POST /bridge/receive`'s answer to a bridge message (the caller has checked the token): (status, media type,
    body). Runs where the engine is (`EngineHost.bridge`: this process, or the engine process of its own)."""
    known = ops.operations()
    try:
        header, payload = ops.unpack(body)
        op = known.get(header.get("op"))
        if op is None:
            raise ops.BridgeRequestError(f"unknown bridge operation {header.get('op')!r}; this server runs "
                                         f"{', '.join(sorted(known))}")
        version = header.get("weight_version")
        if version is not None and (not op.writes_weights or not isinstance(version, int) or version < 0):
            raise ops.BridgeRequestError(f"weight_version={version!r}: only an operation that writes weights "
                                         "takes one, and it is a step count (an integer >= 0)")
        if op.unpack is not None:
            payload = op.unpack(payload)
    except ops.BridgeRequestError as err:
        return _json({"detail": [{"loc": ["body"], "msg": str(err)}]}, 400)
    except (TypeError, ValueError) as err:  # a payload the operation cannot take
        return _json({"detail": [{"loc": ["body", "payload"], "msg": f"{header.get('op')}: {err}"}]}, 400)
    try:
        result = await host.receive(op, payload, version)
        tensors: dict = {}
        encoded = ops.encode(result, tensors)
    except Exception as err:  # noqa: BLE001 - reported to the trainer with the server's traceback
        return _json({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(),
                      "sync_error": type(err).__name__ == "SyncError"}, status_code=500)
    if not tensors:
        return _json({"result": encoded})
    return 200, ops.MEDIA_TYPE, ops.frame({"op": op.name, "payload": encoded}, tensors)


def build_app(host: EngineHost, token: str) -> FastAPI:
    app = FastAPI(title="rlspec rollout server", docs_url=None, redoc_url=None)
    install_error_handlers(app)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": host.model_name, "pid": os.getpid(), **host.state(),
                "uptime_s": round(time.time() - host.started, 3)}

    app.state.openai = OpenAIRoutes(host)
    app.include_router(app.state.openai.router())

    def authorize(request: Request) -> None:
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, detail=[{"loc": ["header", "authorization"],
                                              "msg": "missing or wrong bridge token (RLSPEC_SERVE_TOKEN)"}])

    @app.get("/bridge/weight_version")
    def get_version() -> dict:
        return {"weight_version": host.weight_version}

    @app.post("/bridge/weight_version")
    async def set_version(req: VersionRequest, request: Request) -> dict:
        authorize(request)
        await host.label(req.version)
        return {"weight_version": req.version}

    @app.post("/bridge/receive")
    async def receive(request: Request) -> Response:
        authorize(request)
        status, media_type, content = await host.bridge(await request.body())
        return Response(content, status_code=status, media_type=media_type)

    return app
