"""Ray plumbing shared by the multi-process backends: start or join Ray, place actors, and the watchdog.

Every driver-side call into an actor goes through `wait_all`, which waits on all the futures of one
fan-out together and raises `RunError` with the failing actor's traceback as soon as *any* of them fails
or its process dies — the others may be blocked in a collective with the dead one and would never
return. A failed task is first given `DEATH_GRACE_S` for a peer's death to show: a dead rank is the cause
its peers' connection errors follow from, and it is the one named. Ray is imported lazily so that
`rlspec plan` and the backend registry never need it.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import time
from typing import Any, Sequence

from ..errors import RunError, SpecError
from ..runtime.stall import STOP_SIGNALS

POLL_S = 0.2
"""How often the watchdog looks at pending futures; an actor death is reported within about this."""
DEATH_GRACE_S = 5.0
"""After one actor's task fails, how long `wait_all` looks for another whose actor died. A killed rank makes its
peers' collectives fail too ("Connection reset by peer"), often before Ray has noticed the death; the death is the
cause to name. A failure with no death behind it is reported this much later."""


def start_ray(address: str | None) -> bool:
    """Join the cluster at `address`, or start a local one with sane defaults when it is null.

    An already-initialised Ray in this process is reused (one driver may set up many runs). Returns
    whether this call started Ray.
    """
    import ray

    if ray.is_initialized():
        return False
    if address is not None:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
        return True
    # A private local cluster on this machine: token auth would need a token the workers cannot have.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray's processes start with SIGTERM and SIGINT blocked (a signal mask survives fork and exec; the raylet's
    # workers inherit it): a scheduler's preemption signals every process of the run at once, and the raylet
    # would shut the node down, actors and all, within seconds, before the driver has the ranks checkpoint
    # (`rlspec.runtime.monitor`). The driver's own threads get the mask back at once.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        # address="local": a new cluster even if `ray start` left one (or its stale record) on this machine.
        ray.init(address="local", num_cpus=local_cpus(), object_store_memory=1 << 30,
                 include_dashboard=False, log_to_driver=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    # Registered after ray.init's own hook, so it runs first (and leaves that one nothing to do).
    atexit.register(stop_ray)
    return True


def stop_ray() -> None:
    """Leave Ray; a local cluster this process started is stopped at once. Ray's own shutdown asks each kind of
    process to exit and waits a second for each: these ignore SIGTERM (`start_ray` blocks it), so that took ~5 s
    (and killing them first, then leaving, ~15 s: the driver's disconnect waited on the dead ones). Here the
    driver disconnects while they run, then they are killed without the wait: ~0.4 s."""
    import ray

    if not ray.is_initialized():
        return
    node = getattr(ray._private.worker, "_global_node", None)  # None when this process joined a cluster
    if node is not None:
        graceful = node.kill_all_processes

        def at_once(**kwargs) -> None:
            # The raylet's own children (its agents, idle workers) outlive a raylet killed this way: them too.
            children = _children(node.all_processes.get("raylet", []))
            graceful(**{**kwargs, "allow_graceful": False})
            for child in children:
                try:
                    child.kill()
                except Exception:  # noqa: BLE001 - gone already
                    pass

        node.kill_all_processes = at_once
    try:
        ray.shutdown()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def _children(processes) -> list:
    """The descendants of Ray's process records `processes` (psutil.Process objects)."""
    try:
        import psutil
    except ImportError:  # ray[default] brings it; without it the raylet's children are left to themselves
        return []
    found = []
    for info in processes:
        try:
            found += psutil.Process(info.process.pid).children(recursive=True)
        except Exception:  # noqa: BLE001 - gone already
            pass
    return found


def local_cpus() -> int:
    """The CPUs of the local cluster `start_ray` starts (at least 2: PLATFORM.md's fractional actors need them)."""
    return max(2, os.cpu_count() or 2)


def check_cluster_fits(bundles: Sequence[dict[str, float]], address: str | None) -> None:
    """Refuse (bad input, exit 2) a plan whose bundles need more CPUs or GPUs than the whole Ray cluster has;
    Ray would otherwise wait for them until the placement timeout. Before Ray is up for a local cluster, only the
    CPUs are checked (`local_cpus`: known without starting it); call again once it is up for the GPUs."""
    import ray

    if ray.is_initialized():
        total = {"GPU": 0, "CPU": 0, **ray.cluster_resources()}  # a cluster without GPUs lists none
    else:
        total = {"CPU": local_cpus()}  # the GPUs are Ray's to find when it starts
    where = f"the Ray cluster at {address}" if address else "the local Ray cluster"
    for resource, key in (("GPU", "hardware.num_trainer_ranks"), ("CPU", "hardware.num_trainer_ranks")):
        need = sum(b.get(resource, 0) for b in bundles)
        have = total.get(resource)
        if have is not None and need > have:
            raise SpecError(key, f"the plan's ranks and engines need {need:g} {resource}s, {where} has {have:g} in all",
                            "lower hardware.num_trainer_ranks / num_rollout_engines, or add nodes to the cluster")


def node_address() -> tuple[str, int]:
    """This process's node IP and a free TCP port on it (for a rendezvous that peers connect to)."""
    try:
        import ray

        host = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray, loopback is the only address peers can use
        host = "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return host, port


def describe(err: BaseException) -> str:
    """The remote traceback Ray carries in a task error, or how the actor died."""
    return str(err).strip()


def wait_all(refs: Sequence[Any], labels: Sequence[str], timeout_s: float | None = None) -> list:
    """Results of `refs` in order; raise `RunError` as soon as one fails, its actor dies, or time runs out.

    `labels` name the actor behind each future (`trainer rank 1`) for the error message.
    """
    import ray

    assert len(refs) == len(labels)
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=POLL_S)
        for ref in ready:
            i = index[ref]
            try:
                results[i] = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                raise RunError(f"{labels[i]} died", describe(err)) from None
            except ray.exceptions.RayTaskError as err:
                failed = f"{labels[i]} failed: {type(err.cause).__name__ if err.cause else 'error'}"
                dead = _first_death(pending, [labels[index[r]] for r in pending], DEATH_GRACE_S)
                if dead is not None:
                    label, how = dead
                    raise RunError(f"{label} died", f"{how}\n\nthen {failed}:\n{describe(err)}") from None
                raise RunError(failed, describe(err)) from None
            except ray.exceptions.RayError as err:
                raise RunError(f"{labels[i]} failed", describe(err)) from None
        if pending and deadline is not None and time.monotonic() > deadline:
            waiting = ", ".join(labels[index[r]] for r in pending)
            raise RunError(f"timed out after {timeout_s:.0f} s waiting for {waiting}")
    return results


def _first_death(refs: list, labels: list[str], timeout_s: float) -> tuple[str, str] | None:
    """(label, how it died) of the first of `refs` whose actor dies within `timeout_s`, else None."""
    import ray

    label_of = dict(zip(refs, labels))
    deadline = time.monotonic() + timeout_s
    while refs and (left := deadline - time.monotonic()) > 0:
        ready, refs = ray.wait(refs, num_returns=1, timeout=min(left, POLL_S))
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as err:
                return label_of[ref], describe(err)
            except ray.exceptions.RayError:
                pass  # another failure, not a death: the first one is reported
    return None


def call_all(actors: Sequence[Any], labels: Sequence[str], method: str, *args, **kwargs) -> list:
    """Call `method` on every actor with the same arguments and wait through the watchdog."""
    return wait_all([getattr(a, method).remote(*args, **kwargs) for a in actors], labels)


def kill_all(actors: Sequence[Any]) -> None:
    """Kill actors without waiting for them (idempotent; a dead actor is fine)."""
    import ray

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


class ActorWeightSource:
    """A `rlspec.core.weights.WeightSource` over trainer-rank actors: the sender half runs inside the ranks.

    Each rank actor implements `run_sender(fn, payload, gather, senders)`: all ranks join the collective gather
    of the full weights and the ranks in `senders` pass their copy to `fn`. `run_sender` has rank 0 send and
    returns its result. `run_senders` gives one result per engine: with `feeders` (a colocated layout, engine i
    beside trainer rank `feeders[i]`, `rlspec.cluster.placement`) each feeding rank sends for its own engine;
    without, rank 0's one result serves every engine.
    """

    def __init__(self, actors: Sequence[Any], labels: Sequence[str], feeders: Sequence[int] | None = None) -> None:
        self.actors = list(actors)
        self.labels = list(labels)
        self.feeders = None if feeders is None else list(feeders)

    def run_sender(self, fn, payload, gather: bool = True):
        return call_all(self.actors, self.labels, "run_sender", fn, payload, gather, (0,))[0]

    def run_senders(self, fn, payload, gather: bool = True) -> list:
        if self.feeders is None:
            return [self.run_sender(fn, payload, gather)]
        results = call_all(self.actors, self.labels, "run_sender", fn, payload, gather, tuple(sorted(set(self.feeders))))
        return [results[rank] for rank in self.feeders]
