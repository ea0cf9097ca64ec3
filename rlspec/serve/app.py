"""The server's HTTP app. It knows no transport: `/bridge/receive` runs `fn(engine, payload)`, the engine
half of whichever `sync` transport the trainer uses, exactly as an in-process or Ray engine does.

Endpoints:
- `GET /health`: status, weight version, model, pid, how the engine samples (`cuda_graph` or `plain (why)`).
- `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`: the OpenAI API (`openai_api.py`);
  each choice also carries `token_ids` and `prompt_token_ids`, and the log-probs are the engine's log-probs
  of the sampled tokens (log_softmax(logits / temperature), as the trainer computes them).
- `GET|POST /bridge/weight_version`: the trainer step whose weights the engine serves (null after a failed
  sync: the weights are then of unknown version).
- `POST /bridge/receive`: pickled `(fn, payload)` -> pickled result; needs `Authorization: Bearer TOKEN`.

A bad request gets a 4xx whose `detail` names the field (and, where a spec setting decides it, e.g. a prompt
longer than `rollout.max_prompt_tokens`, the `spec_key` and its `fix`, which a trainer's client turns back
into the `SpecError` the colocated engine raises); a failing bridge call a 500 with the server's
traceback. All engine work runs on one engine thread, in order; `/health` never waits for it.
"""

from __future__ import annotations

import hmac
import os
import pickle
import queue
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any, Callable

from fastapi import FastAPI, HTTPException, Request, Response
from pydantic import BaseModel, Field

from .openai_api import OpenAIRoutes


class VersionRequest(BaseModel):
    version: int = Field(..., ge=0)


FAULT_ENV = "RLSPEC_SERVE_FAULT"
"""Test hook, `skip:QUALNAME`: bridge calls of that function return without running (a peer that never
joins a group); `hang_start`: the server never becomes healthy."""


class EngineThread:
    """One thread that runs all of the engine's work, in order.

    CUDA state that a CUDA-graph sampler relies on is per thread (the current device and stream; a capture is
    recorded from the thread that began it), so captures and replays must not hop between the web server's
    worker threads. Requests and bridge calls queue here instead; `/health` never waits for it.
    """

    def __init__(self, device, on_submitted_error: Callable[[BaseException], None] | None = None) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.device = device
        self.on_submitted_error = on_submitted_error
        threading.Thread(target=self._loop, name="rlspec-engine", daemon=True).start()

    def _loop(self) -> None:
        import torch

        from ..sync.base import bind_engine_thread

        if self.device is not None and torch.device(self.device).type == "cuda":
            torch.cuda.set_device(torch.device(self.device))
        bind_engine_thread(self.submit)
        while True:
            fn, args, done = self.jobs.get()
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn(*args))
                except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                    done.set_exception(err)

    def run(self, fn, *args):
        """`fn(*args)` on the engine thread; blocks the caller until it returns (or raises)."""
        done: Future = Future()
        self.jobs.put((fn, args, done))
        return done.result()

    def submit(self, fn, *args) -> None:
        """Queue `fn(*args)` without waiting for it: a sync's engine half that a transport starts on its own
        (the trainer's bridge call collects the outcome). A failure goes to `on_submitted_error`."""
        def guarded():
            try:
                fn(*args)
            except BaseException as err:  # noqa: BLE001 - the bridge call reports it; the host marks the weights
                if self.on_submitted_error is not None:
                    self.on_submitted_error(err)

        self.jobs.put((guarded, (), Future()))


class EngineHost:
    """The engine behind the app: one job at a time on its own thread, plus the weight version it serves."""

    def __init__(self, engine, model_name: str) -> None:
        fault = os.environ.get(FAULT_ENV, "")
        self.skip = fault.removeprefix("skip:") if fault.startswith("skip:") else None
        self.engine = engine
        self.model_name = model_name
        self.thread = EngineThread(getattr(engine, "device", None), on_submitted_error=self._weights_unknown)
        self.weight_version: int | None = 0
        self.started = time.time()

    def _weights_unknown(self, _err: BaseException) -> None:
        self.weight_version = None  # a sync may have written part of the weights

    def receive(self, fn, payload) -> Any:
        if self.skip is not None and getattr(fn, "__qualname__", "") == self.skip:
            return None
        try:
            return self.thread.run(fn, self.engine, payload)
        except BaseException as err:
            self._weights_unknown(err)
            raise


def build_app(host: EngineHost, token: str) -> FastAPI:
    app = FastAPI(title="rlspec rollout server", docs_url=None, redoc_url=None)

    @app.get("/health")
    def health() -> dict:
        sampler = getattr(host.engine, "sampler_kind", None)
        return {"status": "ok", "model": host.model_name, "weight_version": host.weight_version, "pid": os.getpid(),
                "sampler": sampler() if sampler else None,
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
    def set_version(req: VersionRequest, request: Request) -> dict:
        authorize(request)
        host.weight_version = req.version
        return {"weight_version": host.weight_version}

    @app.post("/bridge/receive")
    async def receive(request: Request) -> Response:
        authorize(request)
        body = await request.body()
        try:
            fn, payload = pickle.loads(body)
        except Exception as err:  # noqa: BLE001
            raise HTTPException(400, detail=[{"loc": ["body"], "msg": f"not a pickled (fn, payload): {err}"}]) from None
        from starlette.concurrency import run_in_threadpool

        try:
            result = await run_in_threadpool(host.receive, fn, payload)
        except Exception as err:  # noqa: BLE001 - reported to the trainer with the server's traceback
            return Response(pickle.dumps({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(),
                                          "sync_error": type(err).__name__ == "SyncError"}),
                            status_code=500, media_type="application/octet-stream")
        return Response(pickle.dumps(result), media_type="application/octet-stream")

    return app
