"""Faults and a soak on the GPUs of one machine: the `faults` and `soak` parts of tests/gpu/measure.sh.

  python3 tests/gpu/faults.py faults --spec SPEC --out DIR [--backends fsdp,deepspeed] [--faults F,...]
  python3 tests/gpu/faults.py soak   --spec SPEC --out DIR [--backend fsdp] [--seconds 480]

Both run `rlspec run` (python3 -m rlspec.cli, the installed package) colocated on every GPU this process may use, at
most 4: 4 GPUs run `hardware=gpu4_colocated`, 2 or 3 run `gpu2_colocated`, 1 runs `gpu1` (so a 2-GPU machine still
runs every row, on 2). FAULTS_CPU=1 runs the same rows on 2 CPU ranks (GPU columns empty), to try the script.

faults: per backend, one run per fault (SPEC with 2 prompts per GPU x its group, checkpoints every 2 steps, stall
timeout 20 s, compiled layers off so that a run starts sooner), the fault injected once the run has written
3 metrics rows:
  kill_rank    SIGKILL to a trainer rank's process, in the train phase  -> exit 1, "trainer rank N died"
  kill_engine  SIGKILL to a rollout engine's process, mid-rollout       -> exit 1, "rollout engine N died"
  stop_rank    SIGSTOP to a trainer rank (its peers wait in a collective) -> exit 1, the stall names it
  oom          a rank out of GPU memory (RLSPEC_FAULT_INJECT=...,mode=oom)   -> exit 1, names the micro-batch budget
  sigterm      SIGTERM to every process of the run                      -> exit 143, then --resume on half the GPUs
One row per fault: exit code (and the one expected), seconds from the fault to the exit, whether the message names
what it should, GPU processes of the run left 20 s after the exit (checked as soon as they are gone), GPU memory in
use then against before the run (MiB, all GPUs), whether the latest checkpoint loads (transformers'
from_pretrained), and for sigterm the resumed run's exit code and mean reward of its steps against the 3 before the
signal. Rows go to stdout and DIR/faults.jsonl.
Every fault row should end within 60 s; one call on a 4-GPU machine runs one backend (`--backends` one at a time:
about 5 x 100 s); a call cut short keeps the rows it finished (faults.jsonl), `--faults` runs the rest.

soak: one run of SPEC as it is (its prompts, lengths, token budget), weights pushed every step, stopped by SIGTERM
after --seconds from its launch. It reports GPU memory in use (nvidia-smi, every GPU) at step 10 and at the end (the
last sample before the SIGTERM: after it the processes exit) (within 2% is the bound), each step's time against the
median of steps 2.. (none above 2x), and the host RSS of the run's processes (driver, Ray, actors) at step 10, at the
end, and its slope over the second half before the SIGTERM (MiB/min), and
every ~30 s the host RSS by kind of process (driver, trainer, engine, ray, other: the sum counts the first steps'
compile workers and shared pages once per process). Written to stdout and DIR/soak.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

FAULTS = ("kill_rank", "kill_engine", "stop_rank", "oom", "sigterm")
WORKER_TITLES = {"fsdp": "FSDPWorker", "deepspeed": "DeepSpeedWorker"}
NAMED = {"kill_rank": r"trainer rank \d+ died", "kill_engine": r"rollout engine \d+ died",
         "stop_rank": r"trainer rank \d+.*did not answer \(stopped", "oom": r"out of GPU memory .*micro_batch",
         "sigterm": r"SIGTERM: stopped after step \d+"}
EXPECTED_EXIT = {"sigterm": 143}


def visible_gpus() -> list[str]:
    """The GPU indices this process may use (CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists)."""
    if CPU:
        return ["0", "1"]
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given:
        return [g for g in given.split(",") if g]
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return [str(i) for i in range(len(out.strip().splitlines()))]


CPU = os.environ.get("FAULTS_CPU") == "1"
"""FAULTS_CPU=1: the same rows on CPU ranks (2, resumed on 1), to try this script where there is no GPU (its GPU
columns then read empty)."""


def hardware_for(count: int) -> tuple[list[str], int]:
    """The hardware overrides for `count` GPUs, and how many GPUs they use."""
    if CPU:
        n = min(count, 2)
        return ["hardware.device=cpu", f"hardware.num_trainer_ranks={n}", f"hardware.num_rollout_engines={n}",
                "hardware.rollout=colocated"], n
    if count >= 4:
        return ["hardware=gpu4_colocated"], 4
    if count >= 2:
        return ["hardware=gpu2_colocated"], 2
    return ["hardware=gpu1"], 1


def gpu_memory_mib(gpus: list[str]) -> list[int]:
    if CPU:
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    used = dict(line.split(", ") for line in out.strip().splitlines())
    return [int(used[g]) for g in gpus if g in used]


def gpu_pids() -> set[int]:
    if CPU:
        return set()
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout
    return {int(p) for p in out.split() if p.strip().isdigit()}


def tree(pid: int) -> list:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def titled(pid: int, title: str) -> list[int]:
    """Pids under `pid` whose command line names `title` (Ray titles an actor process `ray::<class>.<method>`)."""
    found = []
    for proc in tree(pid)[1:]:
        try:
            if title in " ".join(proc.cmdline()):
                found.append(proc.pid)
        except Exception:  # noqa: BLE001 - gone meanwhile
            pass
    return found


def rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def launch(spec: str, backend: str, out: Path, overrides: list[str], env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rlspec.cli", "run", spec, "--backend", backend, *overrides, "--out", str(out),
           "--no-progress"]
    log = open(out.parent / f"{out.name}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True)


def wait_rows(proc: subprocess.Popen, out: Path, n: int, timeout_s: float = 400) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        got = rows(out)
        if len(got) >= n:
            return got
        time.sleep(0.05)
    raise RuntimeError(f"the run wrote {len(rows(out))} rows (exit {proc.poll()}), not {n}")


def checkpoint_loads(out: Path) -> str:
    folder = out / "checkpoints"
    done = sorted(p for p in folder.iterdir() if p.name.startswith("step_")) if folder.is_dir() else []
    if not done:
        return "no checkpoint"
    try:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(done[-1])
        return f"{done[-1].name} loads"
    except Exception as err:  # noqa: BLE001 - reported in the row
        return f"{done[-1].name} FAILS: {type(err).__name__}: {err}"[:200]


def inject(fault: str, proc: subprocess.Popen, backend: str, last: dict) -> list[int]:
    """Inject `fault` into the run; return the pids signalled."""
    if fault == "sigterm":
        members = tree(proc.pid)
        for member in members:
            try:
                member.send_signal(signal.SIGTERM)
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass
        return [m.pid for m in members]
    if fault == "oom":
        return []  # the hook fires by itself
    title = "EngineWorker" if fault == "kill_engine" else WORKER_TITLES[backend]
    if fault == "kill_rank":  # the next step's train phase: after its generation (and reward) time
        time.sleep(last.get("timing_s/gen", 0.0) + last.get("timing_s/reward", 0.0)
                   + 0.25 * last.get("timing_s/train", 0.0))
    else:  # mid-rollout
        time.sleep(0.3 * last.get("timing_s/gen", 0.0))
    pids = titled(proc.pid, title)
    if not pids:
        raise RuntimeError(f"no {title} process under the run")
    os.kill(pids[-1], signal.SIGSTOP if fault == "stop_rank" else signal.SIGKILL)
    return pids[-1:]


def fault_row(spec: str, backend: str, fault: str, gpus: list[str], root: Path) -> dict:
    hardware, used = hardware_for(len(gpus))
    out = root / f"{backend}_{fault}"
    overrides = [*hardware, f"rollout.prompts_per_step={2 * used}", "algorithm.steps=1000", "checkpoint.every_n_steps=2",
                 "checkpoint.keep_last=1", "hardware.stall_timeout_s=20", "model.compile_layers=false"]
    env = {"RLSPEC_FAULT_INJECT": f"rank={used - 1},step=3,mode=oom"} if fault == "oom" else {}
    before = gpu_memory_mib(gpus)
    proc = launch(spec, backend, out, overrides, env)
    row: dict = {"backend": backend, "fault": fault, "gpus": used}
    signalled: list[int] = []
    try:
        last = wait_rows(proc, out, 3)[-1]
        run_gpu_pids = gpu_pids() & {p.pid for p in tree(proc.pid)}
        fault_at = time.monotonic()
        signalled = inject(fault, proc, backend, last)
        try:
            row["exit"] = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            row["exit"] = "still running after 120 s (killed)"
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        row["fault_to_exit_s"] = round(time.monotonic() - fault_at, 1)
    except RuntimeError as err:
        row["error"] = str(err)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the run ended by itself
            pass
        proc.wait()
        run_gpu_pids = set()
    row["expected_exit"] = EXPECTED_EXIT.get(fault, 1)
    log = (root / f"{out.name}.log").read_text(errors="replace")
    row["named"] = bool(re.search(NAMED[fault], log))
    row["message"] = next((line for line in reversed(log.splitlines()) if line.startswith("rlspec: ")), "")[:300]
    deadline = time.monotonic() + 20
    while any(_exists(p) for p in run_gpu_pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2)  # the driver's memory accounting after the last process left
    row["gpu_procs_left"] = sorted(p for p in run_gpu_pids if _exists(p))
    row["gpu_mem_mib_before_after"] = [sum(before), sum(gpu_memory_mib(gpus))]
    row["checkpoint"] = checkpoint_loads(out)
    for pid in signalled:  # a stopped rank the run failed to end must not hold its GPU for the next row
        if _exists(pid) and fault == "stop_rank":
            os.kill(pid, signal.SIGKILL)
    if fault == "sigterm" and row.get("exit") == 143:
        row.update(resume_on_half(spec, backend, out, gpus, used))
    return row


def resume_on_half(spec: str, backend: str, out: Path, gpus: list[str], used: int) -> dict:
    """`--resume` of a stopped run on half its GPUs (1 of 1 when it had one) for 4 more steps."""
    half = max(used // 2, 1)
    hardware, _ = hardware_for(half)
    before = rows(out)
    last = before[-1]["step"]
    overrides = [*hardware, f"rollout.prompts_per_step={2 * used}", f"algorithm.steps={last + 5}",
                 "checkpoint.every_n_steps=2", "checkpoint.keep_last=1", "model.compile_layers=false", "--resume"]
    proc = launch(spec, backend, out, overrides, {"CUDA_VISIBLE_DEVICES": ",".join(gpus[:half])})
    code = proc.wait(timeout=400)
    after = [r for r in rows(out) if r["step"] > last]
    mean = lambda rs: round(statistics.fmean(r["reward/mean"] for r in rs), 4) if rs else None  # noqa: E731
    return {"resume_gpus": half, "resume_exit": code, "resumed_steps": [r["step"] for r in after],
            "reward_3_before": mean(before[-3:]), "reward_resumed": mean(after)}


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def soak(spec: str, backend: str, seconds: float, gpus: list[str], root: Path) -> dict:
    hardware, used = hardware_for(len(gpus))
    out = root / "soak"
    proc = launch(spec, backend, out, [*hardware, "algorithm.steps=100000", "sync.every_n_steps=1",
                                       "checkpoint.every_n_steps=0", "hardware.preempt_grace_s=60"])
    started = time.monotonic()
    samples: list[tuple[float, int, int, float]] = []  # (s since launch, rows, GPU MiB, host RSS MiB)
    kinds: list[tuple[int, dict[str, float]]] = []  # (rows, host RSS MiB by kind of process), one per sample
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            by_kind: dict[str, float] = {}
            for member in tree(proc.pid):
                try:
                    kind = process_kind(member, proc.pid, backend)
                    by_kind[kind] = by_kind.get(kind, 0.0) + member.memory_info().rss / 2**20
                except Exception:  # noqa: BLE001 - gone meanwhile
                    pass
            n = len(rows(out))
            samples.append((time.monotonic() - started, n, sum(gpu_memory_mib(gpus)), sum(by_kind.values())))
            kinds.append((n, {k: round(v) for k, v in sorted(by_kind.items())}))
            stop.wait(2.0)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    while time.monotonic() - started < seconds and proc.poll() is None:
        time.sleep(1)
    signalled = time.monotonic() - started
    for member in tree(proc.pid):
        try:
            member.send_signal(signal.SIGTERM)
        except Exception:  # noqa: BLE001
            pass
    code = proc.wait(timeout=120)
    stop.set()
    watcher.join()
    steps = rows(out)
    times = [r["timing_s/step"] for r in steps[2:]]
    median = statistics.median(times) if times else None
    at10 = next((s for s in samples if s[1] >= 11), None)
    # The end is the last sample before the SIGTERM: after it the processes exit and their memory goes with them
    running = [s for s in samples if s[0] < signalled]
    end = running[-1] if running else None
    half = [s for s in running if s[0] >= running[-1][0] / 2] if running else []
    slope = None
    if len(half) >= 2:
        xs, ys = [s[0] / 60 for s in half], [s[3] for s in half]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-9)
    result = {"backend": backend, "gpus": used, "exit": code, "steps": len(steps), "seconds": round(seconds),
              "gpu_mib_step10": at10[2] if at10 else None, "gpu_mib_end": end[2] if end else None,
              "step_s_median": median, "step_s_max": max(times) if times else None,
              "slow_steps": [r["step"] for r in steps[2:] if median and r["timing_s/step"] > 2 * median],
              "rss_mib_step10": round(at10[3]) if at10 else None, "rss_mib_end": round(end[3]) if end else None,
              "rss_slope_mib_per_min_2nd_half": round(slope, 1) if slope is not None else None}
    if at10 and end:
        result["gpu_mem_change_pct"] = round(100 * (end[2] - at10[2]) / max(at10[2], 1), 2)
        result["gpu_mem_within_2pct"] = abs(result["gpu_mem_change_pct"]) <= 2
    result["no_step_over_2x_median"] = not result["slow_steps"]
    # Host memory by kind of process, every ~30 s: a sum over every process of the run counts the compile
    # workers of the first steps, and shared pages once per process, so the trend is read per kind
    kept = kinds[:len(running)]
    result["rss_mib_by_kind"] = [{"step": n, **k} for n, k in kept[::15]]
    if kept:
        result["rss_mib_by_kind"].append({"step": kept[-1][0], **kept[-1][1]})
    return result


def process_kind(member, driver: int, backend: str) -> str:
    """driver, trainer, engine, ray (its own daemons and workers) or other (compile workers, ...)."""
    if member.pid == driver:
        return "driver"
    line = " ".join(member.cmdline())
    if WORKER_TITLES[backend] in line:
        return "trainer"
    if "EngineWorker" in line:
        return "engine"
    if "ray" in line.split(" ")[0] or "raylet" in line or "gcs_server" in line or "ray::" in line:
        return "ray"
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("faults", "soak"))
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backends", default="fsdp")
    parser.add_argument("--backend", default="fsdp")
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--seconds", type=float, default=480)
    args = parser.parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    gpus = visible_gpus()
    if args.part == "soak":
        result = soak(args.spec, args.backend, args.seconds, gpus, root)
        print(json.dumps(result), flush=True)
        (root / "soak.json").write_text(json.dumps(result, indent=1))
        return
    for backend in args.backends.split(","):
        for fault in args.faults.split(","):
            row = fault_row(args.spec, backend, fault, gpus, root)
            print(json.dumps(row), flush=True)
            with open(root / "faults.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
