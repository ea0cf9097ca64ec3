"""An admission's writes into its slots while another thread runs Python, as agents and a server's routes do beside
the engine thread (`rlspec.serve.pool.ServingPool._write_prompts`): each torch call gives the interpreter lock up,
and taking it back can wait a switch interval. The spec's model in a serving pool (CPU or GPU), `--rows` rows whose
prompts are prefilled beforehand (the admission is then its writes alone, as where a captured graph prefills), into
a pool whose live rows leave every other slot free (on CUDA the rows come from one packed prefill batch, so they
form as many runs of slots as rows; on CPU each prompt is a batch of its own); the median of `--repeats` admissions
with the other thread idle and busy, at the gateway's switch interval. One JSON line per row count.
    python tests/gpu/probe_admit_contended.py examples/tiny.yaml model=qwen2_24l_tiny hardware.num_threads=1"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()

    import torch

    from rlspec.run import build_plan
    from rlspec.serve.pool import RowSampling
    from rlspec.serve.process import SWITCH_INTERVAL_S, build_engine
    from rlspec.serve.scheduler import make_pool

    plan, _ = build_plan(args.spec, args.overrides)
    if plan.spec.hardware.num_threads:
        torch.set_num_threads(plan.spec.hardware.num_threads)
    engine = build_engine(plan)
    pool = make_pool(engine)
    cuda = torch.device(engine.device).type == "cuda"
    sync = (lambda: torch.cuda.synchronize(engine.device)) if cuda else (lambda: None)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    busy = threading.Event()
    done = threading.Event()

    def python_work() -> None:  # pure Python, as an agent's client and the gateway's routes are
        x = 0
        while not done.is_set():
            if busy.is_set():
                x += 1
            else:
                time.sleep(0.001)

    threading.Thread(target=python_work, daemon=True).start()
    key = iter(range(1, 1 << 30))
    for rows in [int(r) for r in args.rows.split(",")]:
        times: dict[str, list[float]] = {"idle": [], "busy": []}
        prompts = [[40 + i % 50, 41, 42, 43 + i % 7] for i in range(rows)]
        for repeat in range(args.repeats + 1):
            for state in ("idle", "busy"):
                pool.admit([(1000 + b, [7, 8, 9, b % 50], RowSampling(next(key), 4)) for b in range(2 * rows)])
                pool.release([b for b in sorted(pool.live) if b % 2 == 0])  # every other slot free
                pool.prefills.prefill(prompts)  # prefilled beforehand: the admission below is its writes
                (busy.set if state == "busy" else busy.clear)()
                sync()
                began = time.perf_counter()
                pool.admit([(i, p, RowSampling(next(key), 4)) for i, p in enumerate(prompts)])
                sync()
                took = time.perf_counter() - began
                busy.clear()
                pool.release(sorted(pool.live))
                if repeat:
                    times[state].append(took)
        print(json.dumps({"rows": rows, "layers": engine.model.config.num_hidden_layers,
                          "admit_idle_ms": round(statistics.median(times["idle"]) * 1e3, 3),
                          "admit_busy_ms": round(statistics.median(times["busy"]) * 1e3, 3)}), flush=True)
    done.set()


if __name__ == "__main__":
    main()
