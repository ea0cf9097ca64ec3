"""The trainer's side of the server: `ServerClient` (HTTP) and `ServedEngine` (a `RolloutEngine` over it).

Every failure names the server and what was being done: a connection that fails (the server died), a
timeout, a 4xx (the request was bad) or a 500 from the bridge (the engine half of a transport raised; the
server's traceback is attached). A request that times out is followed by a health check: a server that answers
neither is stopped (SIGSTOP) or hung (`ServerHung`), which `ServedEngine` restarts when the run started it and
names in the failure when the run joined it.

Several rollout servers behind one `RolloutEngine`: `ServedReplicas`, the standalone backend's engine when
`hardware.num_rollout_engines` > 1 (servers it starts, one per engine device, or joins: `rollout.server_urls`).

- **Sampling.** A step's prompt groups go out in contiguous runs of whole groups (`rlspec.cluster.dispatch`): by
  work (`queue`: chunks, each server taking the next as it finishes one) or one run per server (`split`), one
  completions request per run; the plan picks (`dispatch` in `rlspec plan`). Each request carries `first_sample`,
  the index of its first sample in the step, so sample i of the step draws the noise of sample i whichever server
  runs it: the step's samples equal one server's.
- **Weights.** Each server has a transport of its own (`sync.replicas.PerReplica`: the configured transport
  once per server, pushed concurrently), not one broadcast group to all: a lost server then takes only its own
  channel down, and comes back (restarted or waited for, reconnected, re-pushed) through its own `ServedEngine`
  while the others keep theirs. The price is the trainer sending the weights once per server (its link's
  bandwidth shared by the pushes in flight) where a broadcast would send them about once.
- **Reliability.** Each server is a `ServedEngine`, with its recovery: a server lost mid-step is restarted or
  waited for, gets the current weights, and re-runs its own part of the step; the other parts are kept.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from torch import Tensor

from ..cluster.dispatch import dispatch, parts
from ..core.batch import TrainBatch
from ..errors import RunError, SpecError
from ..rollout.base import Rollout
from . import TOKEN_ENV, TOKEN_FILE_ENV, ops


@dataclass
class _Recovery:
    lock: threading.RLock = field(default_factory=threading.RLock)
    epoch: int = 0
    """Recoveries so far: a thread that saw the loss before the last one retries instead of recovering again."""
    running: bool = False


HEALTH_PROBE_S = 5.0
"""How long the health check after a timed-out request waits: a live server answers it from its event loop, however
busy its engine is."""


class ServerLost(RunError):
    """The server did not answer at all (connection refused or dropped): it died, or is restarting."""


class ServerHung(ServerLost):
    """The server holds its connections but answers nothing, not a request and not the health check after it: its
    process is stopped (SIGSTOP, a debugger) or hung."""


class ServerClient:
    """HTTP calls to one rollout server. `describe()` (optional) adds what is known about its process."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 120.0,
                 describe: Callable[[], str] | None = None, transport: str | None = None) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.transport = transport
        self.token = token if token is not None else joining_token()
        self.timeout_s = timeout_s
        self.describe = describe or (lambda: "")
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s, trust_env=False,
                                 headers={"authorization": f"Bearer {self.token}"})

    @property
    def label(self) -> str:
        via = f" (sync.method={self.transport})" if self.transport else ""
        return f"rollout server at {self.url}{via}"

    def _call(self, what: str, method: str, path: str, timeout_s: float | None = None, **kwargs):
        """One request; a 429 (the server's queue is full) is retried after its Retry-After until `timeout_s`."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            response = self._call_once(what, method, path, timeout_s, **kwargs)
            if response.status_code != 429:
                return response
            wait_s = float(response.headers.get("retry-after") or 1.0)
            if time.monotonic() + wait_s > deadline:
                raise RunError(f"{self.label} refused {what} with 429 (its queue stayed full) for "
                               f"{timeout_s or self.timeout_s:g} s: {response.text}")
            time.sleep(wait_s)

    def _call_once(self, what: str, method: str, path: str, timeout_s: float | None = None, **kwargs):
        import httpx

        try:
            if timeout_s:  # otherwise the client's own (`timeout_s` at construction)
                kwargs["timeout"] = timeout_s
            response = self.http.request(method, path, **kwargs)
        except httpx.TimeoutException as err:
            waited = timeout_s or self.timeout_s
            if path == "/health":
                raise ServerHung(f"{self.label}: {what} did not answer within {waited:g} s ({type(err).__name__})"
                                 f"{self.describe()}") from None
            self._check_answers(what, waited)
            raise RunError(f"{self.label}: {what} did not answer within {waited:g} s ({type(err).__name__}; the "
                           f"server still answers health checks){self.describe()}") from None
        except httpx.TransportError as err:  # refused, reset, closed mid-answer: the server is gone
            raise ServerLost(f"{self.label} is unreachable during {what}: {type(err).__name__}: {err}{self.describe()}") from None
        except httpx.HTTPError as err:
            raise RunError(f"{self.label} is unreachable during {what}: {type(err).__name__}: {err}{self.describe()}") from None
        if 400 <= response.status_code < 500 and response.status_code != 429:
            _raise_spec_error(response, f"{self.label} refused {what}")
            raise RunError(f"{self.label} refused {what} ({response.status_code}): {response.text}")
        return response

    def _check_answers(self, what: str, waited: float) -> None:
        """After `what` timed out: raise `ServerHung` if the health check gets no answer either (`ServerLost` if the
        server is gone meanwhile)."""
        try:
            self.health(HEALTH_PROBE_S)
        except ServerHung:
            raise ServerHung(f"{self.label} stopped answering: {what} got no answer within {waited:g} s, nor a health "
                             f"check within {HEALTH_PROBE_S:g} s (its process is stopped or hung){self.describe()}"
                             ) from None

    def health(self, timeout_s: float = HEALTH_PROBE_S) -> dict:
        response = self._call("a health check", "GET", "/health", timeout_s)
        response.raise_for_status()
        return response.json()

    def wait_healthy(self, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> dict:
        """Poll `/health` until it answers; `RunError` after `timeout_s`, or at once if `alive()` turns false."""
        import httpx

        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            if not alive():
                raise RunError(f"{self.label} exited before it became healthy{self.describe()}")
            try:
                response = self.http.get("/health", timeout=2.0)
                if response.status_code == 200:
                    return response.json()
                last = f"status {response.status_code}"
            except httpx.HTTPError as err:
                last = f"{type(err).__name__}"
            time.sleep(0.2)
        raise RunError(f"{self.label} did not become healthy within {timeout_s:g} s (rollout.server_start_timeout_s; last: {last})"
                       f"{self.describe()}")

    def completions(self, body: dict, timeout_s: float | None = None) -> dict:
        response = self._call("a completions request", "POST", "/v1/completions", timeout_s, json=body)
        response.raise_for_status()
        return response.json()

    def call(self, op_name: str, payload, timeout_s: float | None = None, weight_version: int | None = None) -> Any:
        """Run the server's operation `op_name` (`ops.py`) on `payload`; the engine half's exception comes back
        as `SyncError` (a transport failure) or `RunError`, with the server's traceback. `weight_version` (for an
        operation that writes weights) labels the new weights in the same engine job."""
        op = ops.operations()[op_name]
        header = {"op": op_name} if weight_version is None else {"op": op_name, "weight_version": weight_version}
        body = ops.pack(header, op.pack(payload) if op.pack is not None else payload)
        response = self._call(f"bridge operation {op_name}", "POST", "/bridge/receive", timeout_s, content=body,
                              headers={"content-type": ops.MEDIA_TYPE})
        kind = response.headers.get("content-type", "")
        if response.status_code == 500 and kind.startswith("application/json"):
            failure = response.json()
            message = f"{self.label}: {op_name} failed: {failure['error']}"
            if failure["sync_error"]:
                from ..sync import SyncError

                raise SyncError(f"{message}\n--- server traceback ---\n{failure['traceback'].rstrip()}")
            raise RunError(message, failure["traceback"])
        response.raise_for_status()
        if kind.startswith(ops.MEDIA_TYPE):
            return ops.unpack(response.content)[1]
        return ops.decode(response.json()["result"], {})

    def receive(self, fn, payload, timeout_s: float | None = None) -> Any:
        """Run a transport's engine half `fn` in the server, as the operation registered for it."""
        try:
            op = ops.operation_for(fn)
        except ValueError as err:
            raise RunError(f"{self.label}: {err}") from None
        return self.call(op.name, payload, timeout_s)

    def set_weight_version(self, version: int) -> None:
        self._call("setting the weight version", "POST", "/bridge/weight_version", json={"version": version})

    def close(self) -> None:
        self.http.close()


def joining_token() -> str:
    """The bridge token of a server this run joins: `RLSPEC_SERVE_TOKEN`, else the file `RLSPEC_SERVE_TOKEN_FILE`
    names (a missing or unreadable file is bad input, exit 2)."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    path = os.environ.get(TOKEN_FILE_ENV)
    if not path:
        return ""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as err:
        raise SpecError(TOKEN_FILE_ENV, f"cannot read the bridge token file {path}: {err.strerror}",
                        "name the file `rlspec serve` printed, or set RLSPEC_SERVE_TOKEN") from None


def _raise_spec_error(response, context: str) -> None:
    """A 4xx whose detail names a spec key (the input broke a spec limit, e.g. `rollout.max_prompt_tokens`)
    is bad input, as in the colocated engine: raise that `SpecError` (exit 2)."""
    try:
        body = response.json()
    except ValueError:
        return
    error = body.get("error") if isinstance(body, dict) else None  # OpenAI's error object (`serve/shapes.py`)
    if isinstance(error, dict) and error.get("spec_key"):
        raise SpecError(error["spec_key"], f"{error.get('message', '')} ({context})", error.get("fix", ""))
    detail = body.get("detail") if isinstance(body, dict) else None  # a server of an earlier release
    for item in detail if isinstance(detail, list) else ():
        if isinstance(item, dict) and item.get("spec_key"):
            raise SpecError(item["spec_key"], f"{item.get('msg', '')} ({context})", item.get("fix", ""))


class ServedEngine:
    """`RolloutEngine` over a rollout server: sampling through `/v1/completions`, everything else through the
    bridge. `starts_in_sync` is false for a server this run joined (it may hold another run's weights), so
    the loop pushes before the first rollout.

    A lost server (`ServerLost`) is waited for, up to `reconnect_s` (`rollout.server_reconnect_s`; 0: the loss
    fails the run at once): `restart` (for a server this run started) starts a new one, then, once it is healthy,
    `resync` (installed by the training loop) reconnects the transport and pushes the trainer's current weights,
    and the interrupted call runs again: the interrupted step's rollouts are re-run, and each request of an agent
    gateway waiting on this engine is retried. One thread recovers; the others wait for it and retry.

    A hung server (`ServerHung`: a request timed out, `rollout.request_timeout_s`, and a health check got no answer)
    that this run started is recovered the same way, its stopped process killed by the restart; one it joined
    (`joined_as`, the spec key that names it) is not the run's to restart: the run fails naming it.
    """

    def __init__(self, client: ServerClient, tokenizer, rollout_spec, starts_in_sync: bool,
                 reconnect_s: float = 0.0, restart: Callable[[], None] | None = None,
                 joined_as: str | None = None) -> None:
        self.client = client
        self.joined_as = joined_as
        self.tokenizer = tokenizer
        self.spec = rollout_spec
        self.starts_in_sync = starts_in_sync
        self.num_engines = 1
        self.reconnect_s = reconnect_s
        self.restart = restart
        self.resync: Callable[[], None] | None = None
        self.version: int | None = None
        """The last weight version this trainer labelled the server's weights with."""
        self.recovery = _Recovery()
        """Shared by the shallow copies an agent gateway makes (one per request's sampling settings)."""

    @property
    def label(self) -> str:
        return self.client.label

    def _resilient(self, call: Callable[[], Any]) -> Any:
        while True:
            epoch = self.recovery.epoch
            try:
                return call()
            except ServerLost as lost:
                self._refuse_hung_joined(lost)
                if self.reconnect_s <= 0 or self.recovery.running:
                    raise  # no waiting asked for, or lost again while recovering (the recovery reports it)
                self.recover(epoch, lost)

    def _refuse_hung_joined(self, lost: ServerLost) -> None:
        """A hung server that this run did not start fails the run, named: waiting for it would wait for whoever
        stopped it, and killing it is its owner's call."""
        if isinstance(lost, ServerHung) and self.restart is None:
            key = f"{self.joined_as}: " if self.joined_as else ""
            raise RunError(f"{key}{lost}\nthe run joined this server and does not restart it: resume or restart it "
                           "(rlspec serve), then continue the run with --resume") from None

    def recover(self, epoch: int, lost: BaseException) -> None:
        """Bring the server back (see the class docstring), unless another thread did since `epoch`."""
        state = self.recovery
        with state.lock:
            if state.epoch != epoch:
                return  # another thread brought the server back meanwhile
            start = time.monotonic()
            print(f"rlspec: {str(lost).splitlines()[0]}", file=sys.stderr, flush=True)
            print(f"rlspec: {self.label} was lost; waiting up to {self.reconnect_s:g} s for it to come back "
                  f"(rollout.server_reconnect_s)", file=sys.stderr, flush=True)
            state.running = True
            try:
                if self.restart is not None:
                    self.restart()
                self.client.wait_healthy(self.reconnect_s)
                if self.resync is not None:
                    self.resync()
            except RunError as err:
                raise RunError(f"{self.label} was lost and is not back within rollout.server_reconnect_s="
                               f"{self.reconnect_s:g}: {err}\n(the loss: {lost})") from None
            finally:
                state.running = False
            state.epoch += 1
            print(f"rlspec: {self.label} is back after {time.monotonic() - start:.1f} s; the trainer's current weights "
                  f"are pushed and the interrupted requests run again", file=sys.stderr, flush=True)

    def generate(self, prompts: list[str], n: int, seed: int, first_sample: int = 0, options=None) -> Rollout:
        """`options.greedy` (an eval's) asks for temperature 0, the server's greedy decoding."""
        greedy = options is not None and options.greedy
        body = {"prompt": list(prompts), "n": n, "seed": seed, "first_sample": first_sample, "logprobs": 0,
                "max_tokens": self.spec.max_new_tokens,
                "temperature": 0.0 if greedy else self.spec.temperature, "top_p": self.spec.top_p}
        out = self._resilient(lambda: self.client.completions(body, self.spec.request_timeout_s))
        choices = sorted(out["choices"], key=lambda c: c["index"])
        return Rollout([c["prompt_token_ids"] for c in choices], [c["token_ids"] for c in choices],
                       [c["logprobs"]["token_logprobs"] for c in choices], [c["text"] for c in choices],
                       weight_version=out.get("weight_version"))

    def logprobs(self, batch: TrainBatch) -> Tensor:
        return self._resilient(lambda: self.client.call("engine.logprobs", batch, self.spec.request_timeout_s))

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        self.client.call("engine.load_weights", [(n, t.detach().cpu()) for n, t in named_tensors])

    def receive(self, fn, payload) -> Any:
        """A transport's engine half. Not retried here: after a loss the transport's own channel (an NCCL group)
        may be gone with the server, so the push fails and the next request recovers (reconnect + push)."""
        return self.client.receive(fn, payload)

    def named_weights(self) -> list[tuple[str, Tensor]]:
        return self._resilient(lambda: self.client.call("engine.named_weights", None))

    def set_weight_version(self, version: int) -> None:
        self.version = version  # a recovery in between labels the pushed weights with it
        self._resilient(lambda: self.client.set_weight_version(version))

    def reconnecting(self, transport, weights) -> "ReconnectingTransport":
        """`transport` wrapped so that a push that fails because the server was lost recovers (see the class
        docstring); installs the `resync` a recovery runs."""
        def resync() -> None:
            try:
                transport.close()  # the channel to the lost server (an NCCL group) is dead
            except Exception:  # noqa: BLE001 - best effort: its peer is gone
                pass
            transport.connect(self, weights)
            transport.push(weights, self)
            if self.version is not None:
                self.client.set_weight_version(self.version)

        if self.reconnect_s > 0:
            self.resync = resync
        return ReconnectingTransport(transport, self)

    def lost(self) -> ServerLost | None:
        """How the server fails a health check now (gone or hung), or None when it answers."""
        try:
            self.client.health()
        except ServerLost as err:
            return err
        except RunError as err:
            return ServerLost(str(err))
        return None


class ReconnectingTransport:
    """A transport whose push survives a lost rollout server: when a push fails and the server does not answer,
    the engine recovers (waits for it, reconnects the transport, pushes the current weights); any other failure
    is raised as it was. Everything else is the wrapped transport's."""

    def __init__(self, transport, engine: ServedEngine) -> None:
        self.transport = transport
        self.engine = engine

    def __getattr__(self, name: str):
        return getattr(self.transport, name)

    def push(self, weights, engine) -> int:
        epoch = self.engine.recovery.epoch
        try:
            return self.transport.push(weights, engine)
        except RunError as err:  # SyncError included
            loss = self.engine.lost() if not self.engine.recovery.running else None
            if loss is None:
                raise
            self.engine._refuse_hung_joined(loss)
            if self.engine.reconnect_s <= 0:
                raise
            self.engine.recover(epoch, err)
            return 0  # the recovery pushed the current weights

    def weight_version(self) -> int | None:
        return self.client.health()["weight_version"]


class ServedReplicas:
    """`RolloutEngine` over several rollout servers (see the module docstring); `replicas[i]` is server i's."""

    def __init__(self, replicas: Sequence[ServedEngine], tokenizer, dispatch: str = "split",
                 chunk_prompts: int = 1) -> None:
        self.replicas = list(replicas)
        self.dispatch = dispatch
        """`queue` or `split` (`rlspec.cluster.dispatch`; the plan's `dispatch.method`)."""
        self.chunk_prompts = chunk_prompts
        """`queue`: prompts (groups) per chunk."""
        self.tokenizer = tokenizer
        self.starts_in_sync = all(r.starts_in_sync for r in self.replicas)
        self.pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="rlspec-replica")
        self.last_generate: dict[str, float] = {}
        """Per server, the last `generate`'s seconds and samples (`metrics`)."""

    @property
    def label(self) -> str:
        return f"{len(self.replicas)} rollout servers ({', '.join(r.client.url for r in self.replicas)})"

    def _on_all(self, calls: Sequence[Callable[[], Any]]) -> list:
        """Run the calls concurrently, one per server; wait for all of them, then raise the first failure (in
        server order), so no request is left running behind a failed step."""
        futures = [self.pool.submit(call) for call in calls]
        wait(futures)
        return [f.result() for f in futures]

    def generate(self, prompts: list[str], n: int, seed: int, first_sample: int = 0, options=None) -> Rollout:
        queue = self.dispatch == "queue"
        chunks = parts(self.dispatch, len(prompts), len(self.replicas), self.chunk_prompts)
        extra = () if options is None else (options,)  # an eval's; a step's rollout passes none

        def run(i: int, part: range) -> tuple[Rollout | None, float]:
            if not part:
                return None, 0.0
            start = time.perf_counter()
            out = self.replicas[i].generate(prompts[part.start:part.stop], n, seed, first_sample + part.start * n,
                                            *extra)
            return out, time.perf_counter() - start

        outs, workers = dispatch(chunks, len(self.replicas), run, queue)
        self.last_generate = {}
        for i in range(len(self.replicas)):
            self.last_generate[f"timing_s/gen_replica_{i}"] = 0.0
            self.last_generate[f"rollout/samples_replica_{i}"] = 0.0
        for part, worker, (_, seconds) in zip(chunks, workers, outs):
            self.last_generate[f"timing_s/gen_replica_{worker}"] += seconds
            self.last_generate[f"rollout/samples_replica_{worker}"] += float(len(part) * n)
        done = [out for out, _ in outs if out is not None]
        versions = [o.weight_version for o in done]
        return Rollout(*(sum((getattr(o, f) for o in done), []) for f in
                         ("prompt_ids", "completion_ids", "completion_logprobs", "texts")),
                       weight_version=None if None in versions or not versions else min(versions))

    def metrics(self) -> dict[str, float]:
        """Per server: the last step's generation seconds (`timing_s/gen_replica_<i>`: the step's `timing_s/gen`
        is the slowest one's plus the split) and samples (`rollout/samples_replica_<i>`)."""
        return dict(self.last_generate)

    def logprobs(self, batch: TrainBatch) -> Tensor:
        return self.replicas[0].logprobs(batch)

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        named = [(name, t.detach().cpu()) for name, t in named_tensors]
        self._on_all([lambda r=r: r.load_weights(named) for r in self.replicas])

    def receive(self, fn, payload) -> list:
        """A transport's engine half in every server (a transport built for one engine per server goes through
        `replicas` instead: `sync.replicas.PerReplica`)."""
        return self._on_all([lambda r=r: r.receive(fn, payload) for r in self.replicas])

    def named_weights(self) -> list[tuple[str, Tensor]]:
        return self.replicas[0].named_weights()

    def set_weight_version(self, version: int) -> None:
        self._on_all([lambda r=r: r.set_weight_version(version) for r in self.replicas])

    def weight_versions(self) -> list[int | None]:
        """The weight version each server reports now (`/health`)."""
        return [r.client.health()["weight_version"] for r in self.replicas]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for replica in self.replicas:
            replica.client.close()
