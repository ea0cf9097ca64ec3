"""The server process: building its engine from a plan, `rlspec serve`'s main, and `ServerProcess`, which
starts a server as a child of the trainer and never leaves it behind.

No orphans, on every exit path: the child runs in its own process group, which `stop()` terminates (then
kills) on a normal exit, an exception (the backend's `shutdown` runs in `rlspec run`'s `finally`) and at
interpreter exit (`atexit`); and the child watches its parent's pid, exiting within a second if the
trainer is killed outright (SIGKILL runs no handler).
"""

from __future__ import annotations

import atexit
import errno
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..errors import RunError, SpecError
from ..spec import RunPlan
from . import TOKEN_ENV, TOKEN_FILE_ENV

PARENT_POLL_S = 0.5
STOP_GRACE_S = 5.0
SHUTDOWN_TIMEOUT_S = 5.0
"""`rlspec serve --shutdown-timeout-s`'s default: what the requests in flight get to finish once the server is told to
stop (SIGTERM: `docker stop` and Kubernetes wait 10 and 30 s before they kill)."""


SWITCH_INTERVAL_S = 0.0005
"""`sys.setswitchinterval` of a server process (Python's default is 0.005 s; see `serve`); the environment variable
`SWITCH_INTERVAL_ENV` sets another (seconds), for measuring."""
SWITCH_INTERVAL_ENV = "RLSPEC_SERVE_SWITCH_INTERVAL_S"


def build_engine(plan: RunPlan, index: int = 0):
    """The `hf` engine a server runs: the plan's model with its seed (the trainer's initial weights), on the
    plan's engine device `index` (the run's server `index`); with `sync.method=lora`, wrapped with the same
    adapters as the trainer. Each server is its own transport's only engine (a push per server)."""
    import torch

    from ..models.factory import apply_lora, load_model, load_tokenizer
    from ..rollout.hf import HFEngine

    spec = plan.spec
    device = plan.placement.engine_devices[index]
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RunError(f"the rollout server's device is {device} but no CUDA device is visible to it")
    model = load_model(spec.model, spec.algorithm.seed, device)
    if plan.sync_method == "lora":
        model = apply_lora(model, spec.model, spec.algorithm.seed)
    model = model.to(device).eval().requires_grad_(False)
    engine = HFEngine(model, load_tokenizer(spec.model), spec.rollout, device, spec.algorithm.micro_batch_size)
    engine.engine_index, engine.num_engines = 0, 1
    return engine


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine (`localhost`, 127.0.0.0/8, ::1)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, allow_remote: bool) -> None:
    """A non-loopback address needs `--allow-remote` (bad input otherwise: exit 2); with it, a warning."""
    if is_loopback(host):
        return
    if not allow_remote:
        raise SpecError("--host", f"{host!r} is not a loopback address: the server would take requests from other "
                        "machines", "pass --allow-remote to bind it anyway (the bridge still needs the token), or "
                        "bind 127.0.0.1 and reach it through an SSH tunnel")
    print(f"rlspec serve: WARNING: binding {host} (--allow-remote): anyone who reaches this address can request "
          "completions; the weight bridge needs the bridge token, which travels unencrypted over plain http",
          file=sys.stderr, flush=True)


def bind_port(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before anything is built or announced: a port another process holds is
    bad input naming `--port` (exit 2), and once bound the port stays this server's (no other process can take it
    between a check and the server's start)."""
    where = f"{host}:{port}"
    if not 0 < port < 65536:
        raise SpecError("--port", f"{port} is not a TCP port", "choose a port from 1 to 65535, e.g. --port 8000")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a restart reuses its port at once
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise SpecError("--port", f"port {port} is already in use on {host} (another process listens there)",
                            f"choose a free port, e.g. --port {free_port(host)}, or stop the process on {where}"
                            ) from None
        if err.errno == errno.EACCES:
            raise SpecError("--port", f"binding {where} is not permitted for this user ({err.strerror})",
                            "choose a port above 1023") from None
        raise SpecError("--host", f"cannot bind {where}: {err.strerror or err}",
                        "choose an address of this machine, e.g. --host 127.0.0.1") from None
    return sock


def bridge_token(port: int) -> tuple[str, Path | None]:
    """The bridge token: `RLSPEC_SERVE_TOKEN`, or a fresh one written to a file only this user can read (in a
    new private directory), whose path is returned to be named. The token itself is never printed."""
    given = os.environ.get(TOKEN_ENV)
    if given:
        return given, None
    token = secrets.token_hex(16)
    path = Path(tempfile.mkdtemp(prefix=f"rlspec-serve-{port}-")) / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, path


ENGINE_PROCESS = ("off", "on")
"""`rlspec serve --engine-process`: `on` (the command's default) runs the engine in a process of its own
(`engine_process.py`); `off` on the server's engine thread. Measured side by side on GPUs (docs/serving_concurrency.md,
with `--warm-pool` and the packed prefill graphs), `on` led at 64 streams (445.6 against 341.9 requests/s, TTFT p50 64
against 100 ms) and at 256 (0.73 against 0.58 of the engine's batched tokens/s). A trainer's own servers
(`ServerProcess`) keep `off` unless asked: their traffic is a few large requests and the weight bridge, whose bodies
`on` passes over one more pipe."""


def serve(plan: RunPlan, host: str, port: int, parent_pid: int | None = None, allow_remote: bool = False,
          engine_index: int = 0, max_queued_rows: int | None = None, engine_process: str = "on",
          warm_pool: bool = False, shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S,
          max_model_len: int | None = None) -> None:
    """Run the server in this process until it is stopped (SIGTERM/SIGINT) or its parent dies; with `engine_process`
    (see `ENGINE_PROCESS`) its engine runs in a child process, which ends with it. `warm_pool`: every pool size's
    decode step and every token bucket's packed prefill captured before it serves (`Scheduler.warm_pool`).
    Stopping: no new connection is accepted, the requests in flight get `shutdown_timeout_s` to finish (then are cut
    off), and the process exits (the engine process told to stop, not waited out). `max_model_len`: the most tokens a
    request's prompt plus max_tokens may reach (None: the model's context; `scheduler.py`'s long lane)."""
    import uvicorn

    from .app import FAULT_ENV, MAX_QUEUED_ROWS, EngineHost, build_app
    from .engine_process import settle_heap

    check_bind(host, allow_remote)
    if not shutdown_timeout_s >= 0:
        raise SpecError("--shutdown-timeout-s", f"must be a number of seconds >= 0, got {shutdown_timeout_s}",
                        f"e.g. --shutdown-timeout-s {SHUTDOWN_TIMEOUT_S:g} (what requests in flight get to finish "
                        "when the server stops)")
    if max_model_len is not None:
        context = _model_context(plan.spec.model)
        if max_model_len < 1 or (context is not None and max_model_len > context):
            raise SpecError("--max-model-len", f"must be 1 to the model's context ({context}), got {max_model_len}",
                            f"e.g. --max-model-len {min(4096, context or 4096)}, or leave it out (the model's "
                            "context)")
    if max_queued_rows is not None and max_queued_rows < 1:
        raise SpecError("--max-queued-rows", f"must be at least 1, got {max_queued_rows}",
                        "e.g. --max-queued-rows 8192 (rows waiting for a decode slot before requests get 429)")
    if plan.spec.hardware.num_threads:
        import torch

        torch.set_num_threads(plan.spec.hardware.num_threads)
    # The engine thread's work is a thousand and more short torch calls an admission, each giving up the interpreter
    # lock and taking it back; while the event loop holds the lock (requests arriving, chunks going out) each
    # take-back can wait up to Python's switch interval (5 ms by default). On one H200 an admission of 64 rows
    # took 28 ms alone and 145 ms on average in the server under 64 streams.
    if engine_process not in ENGINE_PROCESS:
        raise SpecError("--engine-process", f"must be one of {', '.join(ENGINE_PROCESS)}, got {engine_process!r}",
                        "e.g. --engine-process on (the engine in a process of its own)")
    interval = os.environ.get(SWITCH_INTERVAL_ENV)
    try:
        switch_interval = SWITCH_INTERVAL_S if interval is None else float(interval)
        sys.setswitchinterval(switch_interval)
    except ValueError:
        raise SpecError(SWITCH_INTERVAL_ENV, f"must be a positive number of seconds, got {interval!r}",
                        f"e.g. {SWITCH_INTERVAL_ENV}=0.0005, or unset it") from None
    sock = bind_port(host, port)  # before the first line is printed: a taken port is exit 2 with nothing announced
    token, token_path = bridge_token(port)
    if token_path is not None:
        print(f"rlspec serve: bridge token written to {token_path} (mode 0600); a trainer that joins reads it "
              f"from {TOKEN_FILE_ENV}={token_path} or {TOKEN_ENV}", file=sys.stderr, flush=True)
    spec = plan.spec
    name = spec.model.path or spec.model.preset
    bound = max_queued_rows or MAX_QUEUED_ROWS
    gone: list[str] = []
    if engine_process == "on":
        from .engine_process import RemoteHost

        def engine_gone(why: str) -> None:  # the server stops through its own shutdown; serve then raises
            gone.append(why)
            print(f"rlspec serve: {why}; stopping the server", file=sys.stderr, flush=True)
            web.should_exit = True

        engine_host = RemoteHost(build_engine, plan, engine_index, name, bound, switch_interval, on_exit=engine_gone,
                                 warm_pool=warm_pool, max_model_len=max_model_len)
        warmed = engine_host.warmed
    else:
        engine_host = EngineHost(build_engine(plan, engine_index), name, bound, owns_weights=True,
                                 max_model_len=max_model_len)
        warmed = engine_host.thread.warm_pool() if warm_pool else None
    if warmed is not None:
        print(f"rlspec serve: serving pool warmed: {warmed[0]} graphs (decode steps, packed prefills) captured in "
              f"{warmed[1]:.1f} s", file=sys.stderr, flush=True)
    app = build_app(engine_host, token)
    web = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                        timeout_graceful_shutdown=shutdown_timeout_s))
    if parent_pid is not None:
        threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    if os.environ.get(FAULT_ENV) == "hang_start":
        while True:
            time.sleep(1)
    where = f"pid {os.getpid()}" + (f", engine process pid {engine_host.engine_pid}" if engine_process == "on" else "")
    print(f"rlspec serve: {name} on http://{host}:{port} ({where})", file=sys.stderr, flush=True)
    # uvicorn re-raises the SIGTERM it shut down on: exit through Python, so the token file goes with the server.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    settle_heap()
    code = None
    try:
        web.run(sockets=[sock])
    except SystemExit as stop:  # SIGTERM, after uvicorn's shutdown (`shutdown_timeout_s`)
        code = stop.code
    except KeyboardInterrupt:
        code = 130
    finally:
        sock.close()
        if engine_process == "on":
            engine_host.stop()
        if token_path is not None:
            shutil.rmtree(token_path.parent, ignore_errors=True)
    if code is not None:
        # Stopped: nothing is left to write, so exit now, without the interpreter's teardown of torch and the model
        # (a second of a server's idle exit, measured on CPU).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if gone:
        raise RunError(gone[0])


def _model_context(model) -> int | None:
    """The positions the spec's model was built for (its config's `max_position_embeddings`), read without loading
    it; None where the config does not say (the engine then checks `--max-model-len` once built)."""
    try:
        if model.kind == "vla":
            return None
        if model.path is None:
            from ..models.factory import preset_config

            config = preset_config(model.preset)
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model.path)
    except Exception:  # noqa: BLE001 - a model the engine's own build then reports
        return None
    context = getattr(config, "max_position_embeddings", None)
    return context if isinstance(context, int) else None


def _exit_on_sigterm(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(0)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`rlspec serve` as a child process of this one, for one plan (its engine on the plan's engine device `index`);
    `stop()` is idempotent."""

    def __init__(self, plan: RunPlan, host: str = "127.0.0.1", index: int = 0, engine_process: str = "off",
                 warm_pool: bool = False) -> None:
        self.plan = plan
        self.engine_process = engine_process
        self.warm_pool = warm_pool
        self.index = index
        self.host = host
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.token = secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix="rlspec-serve-"))
        self.log_path = self.workdir / "server.log"

    def start(self) -> None:
        from omegaconf import OmegaConf

        spec_path = self.workdir / "spec.yaml"
        spec_path.write_text(OmegaConf.to_yaml(OmegaConf.structured(self.plan.spec)))
        cmd = [sys.executable, "-m", "rlspec.cli", "serve", str(spec_path), "--backend", self.plan.backend,
               "--host", self.host, "--port", str(self.port), "--parent-pid", str(os.getpid()),
               "--engine-index", str(self.index), "--engine-process", self.engine_process] \
            + (["--warm-pool"] if self.warm_pool else [])
        env = {**os.environ, TOKEN_ENV: self.token}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)
        atexit.register(self.stop)
        print(f"rlspec: rollout server pid {self.proc.pid} at {self.url} (log {self.log_path}), engine on "
              f"{self.plan.placement.engine_devices[self.index]}", file=sys.stderr)

    def restart(self) -> None:
        """Stop what is left of the server and start a new one on the same port with the same token (a server
        that died mid-run; it starts from the plan's initial weights, so the trainer pushes its own next)."""
        self.stop()
        self.workdir = Path(tempfile.mkdtemp(prefix="rlspec-serve-"))
        self.log_path = self.workdir / "server.log"
        self.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def describe(self) -> str:
        """The process's state and the tail of its log, for error messages."""
        if self.proc is None:
            return ""
        try:  # a server that just died may not be reaped yet
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        state = "still running" if code is None else f"exited with code {code}"
        try:
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-15:]
        except OSError:
            tail = []
        return f"; server pid {self.proc.pid} {state}" + ("\n--- server log (tail) ---\n" + "\n".join(tail) if tail else "")

    def stop(self) -> None:
        """Terminate the server's whole process group, then kill what is left after a grace period."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
            try:
                os.killpg(proc.pid, sig)
                if sig == signal.SIGTERM:  # a stopped (SIGSTOP) server takes the SIGTERM only once continued
                    os.killpg(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # the group may hold children of the server that outlived it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(self.workdir, ignore_errors=True)  # its spec and log; a failure quoted the log's tail
