"""Summarize `py-spy record --subprocesses --threads -f raw` stacks per process and thread: samples, the top frames
by own samples, and the top rlspec frames by inclusive samples (idle threads are not sampled: py-spy's default).
    python tests/gpu/pyspy_top.py profile.txt [rows]"""

import collections
import sys


def main(path: str, rows: int = 12) -> None:
    own: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    for line in open(path, errors="replace"):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        where = []
        while frames and frames[0].startswith(("process ", "thread ", " spawn_main(")):
            frame = frames.pop(0)  # (a spawned process's command line has a ';' of its own: its rest is dropped)
            if not frame.startswith(" spawn_main("):
                where.append(_short(frame))
        key = " / ".join(where) or "?"
        n = int(count)
        totals[key] += n
        if frames:
            own[key][frames[-1]] += n
        for f in set(frames):
            if "rlspec" in f or "uvicorn" in f or "starlette" in f or "fastapi" in f:
                inclusive[key][f] += n
    for key, total in totals.most_common(8):
        print(f"## {key}: {total} samples")
        for f, n in own[key].most_common(rows):
            print(f"   own {n:6d} {100 * n / total:5.1f}% {f[:140]}")
        for f, n in inclusive[key].most_common(rows):
            print(f"   inc {n:6d} {100 * n / total:5.1f}% {f[:140]}")


def _short(frame: str) -> str:
    """`process PID:"command line"` as `process PID (what it runs)`; a thread frame as it is."""
    if not frame.startswith("process "):
        return frame
    pid, _, command = frame[len("process "):].partition(":")
    what = ("engine process" if "multiprocessing.spawn" in command else
            "rlspec serve" if " serve " in command else "bench client" if "bench_serve" in command
            else command.strip('"')[:40])
    return f"process {pid} ({what})"


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
