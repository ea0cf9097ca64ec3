"""Faults during a run (standalone backend): a stall, non-finite numbers, a full disk while checkpointing,
SIGTERM. Each test prints the error the user sees and how long the fault took to stop the run."""

from __future__ import annotations

import errno
import functools
import itertools
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlspec.cli import main
from rlspec.runtime.metrics import read_metrics
from rlspec.tasks import copy_char
from tests.conftest import REPO, interrupt_after_rows, rlspec_cmd

TINY = str(REPO / "examples" / "tiny.yaml")
SMALL = ["rollout.prompts_per_step=2", "algorithm.group_size=2", "algorithm.micro_batch_size=4", "rollout.max_new_tokens=4"]


def cli(capsys, out: Path, *args: str) -> tuple[int, str, float]:
    start = time.monotonic()
    code = main(["run", TINY, *args, "--out", str(out), "--no-progress"])
    return code, capsys.readouterr().err, time.monotonic() - start


def hang_reward_at(monkeypatch, call: int, seconds: float) -> None:
    """The copy_char reward sleeps `seconds` on its `call`-th call (counting from 0)."""
    calls = itertools.count()
    real = copy_char.reward

    @functools.wraps(real)  # the same signature: it receives what the real one does
    def reward(**kwargs):
        if next(calls) == call:
            time.sleep(seconds)
        return real(**kwargs)

    monkeypatch.setattr(copy_char, "reward", reward)


def test_stall_dumps_stacks_and_fails(monkeypatch, tmp_path, capsys):
    """Step 2 blocks (in the reward); after hardware.stall_timeout_s the driver's stacks are in OUT/stall/1 and
    the run exits 1 naming the last completed step."""
    hang_reward_at(monkeypatch, call=2 * 4, seconds=600)  # 4 rewards per step: the first of step 2
    out = tmp_path / "o"
    code, err, took = cli(capsys, out, *SMALL, "algorithm.steps=5", "hardware.stall_timeout_s=5")
    print(f"\nstall: exit {code} after {took:.1f} s; {err.strip().splitlines()[-1]}")
    assert code == 1, err
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert steps == list(range(len(steps))) and len(steps) <= 2  # a slow machine may stall on an earlier step
    assert "stalled: no step completed" in err and f"after step {steps[-1]}" in err and str(out / "stall" / "1") in err
    driver = (out / "stall" / "1" / "driver.txt").read_text()
    if steps == [0, 1]:
        assert "in reward" in driver and "time.sleep(seconds)" in driver and "rollout_batch" in driver
    assert "stalled" in (out / "run.log").read_text()
    assert took < 60


def test_the_first_step_has_a_window_of_its_own(tmp_path):
    """A short stall_timeout_s (to catch a stuck collective in seconds) does not fire on the first step, which
    compiles and captures graphs: that step has hardware.stall_first_step_s; every later step the short window."""
    from rlspec.runtime.stall import StallWatchdog

    def fired_after(beat: bool) -> tuple[float, str]:
        fired: list[str] = []
        dog = StallWatchdog(0.3, tmp_path / str(beat), lambda: [], fired.append, first_step_s=1.5)
        start = dog.start()._last_beat
        if beat:
            dog.beat(0)
        while not fired and time.monotonic() - start < 10:
            time.sleep(0.02)
        dog.stop()
        return time.monotonic() - start, fired[0] if fired else ""

    took, message = fired_after(beat=False)
    assert 1.5 <= took < 5 and "after the start of the loop (hardware.stall_first_step_s=1.5" in message, message
    took, message = fired_after(beat=True)
    assert took < 1.4 and "after step 0 (hardware.stall_timeout_s=0.3)" in message, message


def test_a_failed_run_kills_its_actors_before_closing_the_transport(monkeypatch, tmp_path, capsys):
    """Closing a transport calls into the trainer (cuda_ipc's release runs in the ranks), and a stuck rank never
    answers: a failed run of Ray actors shuts the backend down first; a run that ended well closes the transport
    first, and so does any run of a backend without actors (the standalone one here, as a Ray backend's stand-in:
    it is given an `actors` for the failed run)."""
    import rlspec.run
    import rlspec.sync

    order: list[str] = []
    real_backend, real_transport = rlspec.run.create_backend, rlspec.sync.build_transport

    def backend(name):
        made = real_backend(name)
        if with_actors:
            made.actors = lambda: []
        shutdown = made.shutdown
        made.shutdown = lambda: (order.append("backend"), shutdown())[1]
        return made

    def transport(*args, **kwargs):
        made = real_transport(*args, **kwargs)
        close = made.close
        made.close = lambda: (order.append("transport"), close())[1]
        return made

    monkeypatch.setattr(rlspec.run, "create_backend", backend)
    monkeypatch.setattr(rlspec.sync, "build_transport", transport)
    nan_at_step_1 = ["algorithm.steps=4", "sync.method=checkpoint", "sync.every_n_steps=1000",
                     "algorithm.optimizer=sgd", "algorithm.lr=1e30", "algorithm.max_grad_norm=0"]
    for with_actors, args, want in [(True, [*SMALL, "algorithm.steps=1"], 0), (True, nan_at_step_1, 1),
                                    (False, nan_at_step_1, 1)]:
        order.clear()
        code, err, _ = cli(capsys, tmp_path / f"{with_actors}{want}", *args)
        assert code == want, err
        assert order == (["backend", "transport"] if with_actors and want else ["transport", "backend"]), order


STUCK_TEARDOWN = """
import functools, sys, time
import rlspec.runtime.monitor as monitor, rlspec.sync as sync
from rlspec.tasks import copy_char
monitor.HARD_EXIT_AFTER_S = 3.0
real_build, real_reward, calls = sync.build_transport, copy_char.reward, [0]
def build(*args, **kwargs):
    made = real_build(*args, **kwargs)
    made.close = lambda: time.sleep(600)  # a transport whose close waits on a rank that never answers
    return made
@functools.wraps(real_reward)  # the same signature: it receives what the real one does
def reward(**kwargs):
    calls[0] += 1
    if calls[0] == 5:  # the first reward of step 1
        time.sleep(600)
    return real_reward(**kwargs)
sync.build_transport, copy_char.reward = build, reward
from rlspec.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_stall_whose_teardown_hangs_still_exits_1(tmp_path):
    """After a stall the run's hard exit covers the teardown too: a transport close that never returns (a stopped
    rank on CUDA, where closing cuda_ipc calls into it) ends with exit 1 HARD_EXIT_AFTER_S after the stall."""
    out = tmp_path / "o"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", STUCK_TEARDOWN, "run", TINY, *SMALL, "algorithm.steps=5",
                           "hardware.stall_timeout_s=2", "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    took = time.monotonic() - start
    print(f"\nstuck teardown: exit {proc.returncode} after {took:.1f} s")
    assert proc.returncode == 1, proc.stderr
    assert "stalled: no step completed" in proc.stderr and "did not unwind within 3 s" in proc.stderr, proc.stderr
    assert took < 90


def test_stall_warn_dumps_and_keeps_going(monkeypatch, tmp_path, capsys):
    hang_reward_at(monkeypatch, call=4, seconds=5)  # the first reward of step 1
    out = tmp_path / "o"
    code, err, _ = cli(capsys, out, *SMALL, "algorithm.steps=3", "hardware.stall_timeout_s=2",
                       "hardware.stall_action=warn")
    print(f"\nstall (warn): exit {code}; {[line for line in err.splitlines() if 'stalled' in line][:1]}")
    assert code == 0, err
    assert (out / "stall" / "1" / "driver.txt").is_file() and (out / "stall" / "2" / "driver.txt").is_file()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]


def test_non_finite_loss_stops_before_checkpoint(tmp_path, capsys):
    """An absurd learning rate blows the weights up after step 0; step 1's loss is NaN: exit 1 naming step 1,
    and no checkpoint of those weights (the engine keeps its own copy: sync only every 1000 steps)."""
    out = tmp_path / "o"
    code, err, took = cli(capsys, out, "algorithm.steps=4", "checkpoint.every_n_steps=1", "sync.method=checkpoint",
                          "sync.every_n_steps=1000", "algorithm.optimizer=sgd", "algorithm.lr=1e30",
                          "algorithm.max_grad_norm=0")
    print(f"\nnon-finite: exit {code} after {took:.1f} s; {err.strip().splitlines()[-1]}")
    assert code == 1 and "step 1: non-finite loss=nan" in err and "Traceback" not in err, err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000000"]
    from safetensors.torch import load_file

    assert all(torch.isfinite(t).all() for t in load_file(out / "checkpoints" / "step_000000" / "model.safetensors").values())


def test_disk_full_during_checkpoint_keeps_the_previous_one(monkeypatch, tmp_path, capsys):
    """ENOSPC while writing step 3's optimizer state (after its weights): exit 1 saying so; step 1's checkpoint
    stays the latest, the partial one is gone, and --resume continues from step 1 to the end."""
    import safetensors.torch

    real_save = safetensors.torch.save_file

    def full_disk(tensors, path, *args, **kwargs):
        if "step_000003" in str(path) and str(path).endswith("state.safetensors"):
            Path(path).write_bytes(b"\0" * 1000)  # the part that fit
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    out = tmp_path / "o"
    args = [*SMALL, "algorithm.steps=6", "checkpoint.every_n_steps=2", "checkpoint.keep_last=1"]
    code, err, took = cli(capsys, out, *args)
    print(f"\ndisk full: exit {code} after {took:.1f} s; {err.strip().splitlines()[-1]}")
    assert code == 1 and "writing checkpoint step_000003 failed: no space left on device" in err, err
    assert "step_000001" in err and "--resume" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001"]

    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    code, err, _ = cli(capsys, out, *args, "--resume")
    assert code == 0, err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(6))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000005"]


def test_sigterm_checkpoints_then_exits_143_and_resume_continues(tmp_path):
    """SIGTERM to `rlspec run` (the real entry point): the current step finishes, a checkpoint of it is written,
    exit 143; `--resume` continues from the step after it."""
    out = tmp_path / "o"
    args = ["run", TINY, *SMALL, "algorithm.steps=30", "checkpoint.every_n_steps=0", "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(rlspec_cmd(*args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err, took = interrupt_after_rows(proc, out / "metrics.jsonl", 2, lambda: proc.send_signal(signal.SIGTERM))
    print(f"\nSIGTERM: exit {proc.returncode} {took:.2f} s after the signal; {err.strip().splitlines()[-1]}")
    assert proc.returncode == 143, err[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    last = rows[-1]["step"]
    assert 1 <= last < 29
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{last:06d}"]
    assert f"stopped after step {last}" in err and "--resume" in err

    proc = subprocess.run(rlspec_cmd(*args, "--resume"), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(30))


def test_check_finite_unit():
    from rlspec.errors import RunError
    from rlspec.runtime.monitor import check_finite

    check_finite(3, {"step": 3, "loss": 0.5, "grad_norm": 1.0, "kl": None})
    with pytest.raises(RunError, match=r"step 3: non-finite grad_norm=inf"):
        check_finite(3, {"step": 3, "loss": 0.5, "grad_norm": float("inf"), "kl": None})
    check_finite(3, {"step": 3, "loss": 0.5, "grad_norm": float("inf")}, loss_scaled=True)  # fp16: a skipped step
    with pytest.raises(RunError, match=r"non-finite loss=nan"):
        check_finite(3, {"step": 3, "loss": float("nan"), "grad_norm": float("inf")}, loss_scaled=True)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_while_sampling_abandons_the_step_and_checkpoints_the_last(monkeypatch, tmp_path, capsys, signum):
    """The signal lands inside step 2's reward (no update made in that step yet): step 2 is dropped at once, step 1
    is checkpointed, exit 128 + signal; --resume runs steps 2.. again."""
    import os

    calls = itertools.count()
    real = copy_char.reward

    @functools.wraps(real)
    def reward(**kwargs):
        if next(calls) == 2 * 4:  # the first reward of step 2
            os.kill(os.getpid(), signum)
        return real(**kwargs)

    monkeypatch.setattr(copy_char, "reward", reward)
    out = tmp_path / "o"
    code, err, _ = cli(capsys, out, *SMALL, "algorithm.steps=4")
    assert code == 128 + signum, err
    name = signal.Signals(signum).name
    assert "abandoning this step" in err and f"{name}: stopped after step 1" in err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000001"]
    monkeypatch.setattr(copy_char, "reward", real)
    code, err, _ = cli(capsys, out, *SMALL, "algorithm.steps=4", "--resume")
    assert code == 0, err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]


def test_past_the_grace_period_the_run_exits_without_that_checkpoint(monkeypatch):
    """A step that outlasts hardware.preempt_grace_s after the signal: exit 143 at the deadline, no checkpoint."""
    import os

    from rlspec.run import build_plan
    from rlspec.runtime import monitor as monitor_module

    exits = []
    monkeypatch.setattr(monitor_module.os, "_exit", exits.append)
    plan = build_plan(TINY, ["hardware.preempt_grace_s=0.2", "hardware.stall_timeout_s=0"])[0]
    with monitor_module.RunMonitor(plan, Path(".")) as monitor:
        os.kill(os.getpid(), signal.SIGTERM)  # outside `abandonable`: the step would finish first
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
        assert monitor.stop_signal == signal.SIGTERM
    assert exits == [143]


def test_a_stop_signal_wrapped_by_a_c_extension_still_abandons_the_step():
    """The stop signal's `StepAbandoned` raised inside Ray's `ray.wait` comes out as a `SystemError` caused by it
    (seen on a loaded CI machine: a SIGTERM to an fsdp run then ended in a traceback and exit 1); the loop must
    still take it for the stop, and nothing else for one."""
    from rlspec.core.loop import _abandoned
    from rlspec.runtime.monitor import StepAbandoned

    def raised(make):
        try:
            make()
        except BaseException as err:  # noqa: BLE001 - the point is what comes out
            return err

    def wrapped():
        try:
            raise StepAbandoned()
        except StepAbandoned as cause:
            raise SystemError("returned a result with an exception set") from cause

    assert _abandoned(raised(lambda: (_ for _ in ()).throw(StepAbandoned())))
    assert _abandoned(raised(wrapped))
    assert not _abandoned(raised(lambda: 1 / 0))
    assert not _abandoned(raised(lambda: (_ for _ in ()).throw(SystemError("other"))))


def test_a_fatal_signal_in_an_actor_dumps_every_threads_stack():
    """An actor's crash in another thread (as in a collective's worker thread) still shows the method that was
    running: `report_fatal_signals` widens the one-thread dump that Ray's worker enables."""
    script = """
import faulthandler, sys, threading, time
from rlspec.runtime.stall import report_fatal_signals
faulthandler.enable(all_threads=False)  # what a Ray worker sets up
if sys.argv[1] == "widen":
    report_fatal_signals()
def crash_later():
    time.sleep(0.3)
    faulthandler._sigsegv()
def the_running_actor_method():
    threading.Thread(target=crash_later, daemon=True).start()
    threading.Event().wait(30)
the_running_actor_method()
"""
    for mode, shown in (("ray_default", False), ("widen", True)):
        done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=60,
                              cwd=REPO)
        assert done.returncode != 0
        assert "crash_later" in done.stderr, done.stderr
        assert ("the_running_actor_method" in done.stderr) is shown, done.stderr
