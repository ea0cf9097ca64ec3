"""The `rlspec` command: run, plan, eval, serve, conformance, bench.

Exit codes: 0 ok, 1 run failure, 2 bad input, 128 + N stopped by signal N after a checkpoint (143: SIGTERM).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Sequence

from .errors import RunError, SpecError, Stopped

EXIT_OK, EXIT_RUN_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlspec", description="Declarative GRPO post-training with interchangeable backends.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train from a spec; writes plan.json, metrics.jsonl, checkpoints/ under --out",
                         usage="rlspec run SPEC [key=value ...] [-m key=a,b ...] [--backend B] [--out DIR] [--resume]")
    run.add_argument("spec", help="experiment YAML")
    run.add_argument("--backend", help="trainer backend; overrides the spec's `backend`")
    run.add_argument("--out", help="output directory (default outputs/<spec>/<time>)")
    run.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("-m", "--multirun", action="store_true",
                     help="sweep: one run per combination of the overrides' values (key=a,b), in --out/<n>/")

    plan = sub.add_parser("plan", help="print the compiled run plan as JSON",
                          usage="rlspec plan SPEC [key=value ...] [--backend B]")
    plan.add_argument("spec")
    plan.add_argument("--backend")

    ev = sub.add_parser("eval", help="score checkpoints or a HF model on the spec's eval set; prints a table, writes "
                        "eval.json", usage="rlspec eval SPEC [key=value ...] [-m key=a,b ...] (--checkpoint DIR ... | "
                                           "--checkpoints OUT | --model DIR) [--backend B] [--out DIR]")
    ev.add_argument("spec")
    ev.add_argument("--checkpoint", action="append", default=[], help="a checkpoint directory (OUT/checkpoints/step_N); "
                    "repeat for several")
    ev.add_argument("--checkpoints", help="every completed checkpoint of the run (or of every job of the sweep) in "
                    "this --out directory")
    ev.add_argument("--model", help="a local Hugging Face model directory (instead of the spec's model.path)")
    ev.add_argument("--backend")
    ev.add_argument("--out", help="output directory (default outputs/eval/<spec>/<time>)")
    ev.add_argument("-m", "--multirun", action="store_true",
                    help="sweep: every target scored with each combination of the overrides' values (key=a,b); "
                         "--checkpoint takes a,b too; one table and eval.json")

    serve = sub.add_parser("serve", help="run the spec's rollout engine as an HTTP server (OpenAI-compatible completions)",
                           usage="rlspec serve SPEC [key=value ...] [--host H [--allow-remote]] [--port P] [--backend B] "
                                 "[--max-queued-rows N] [--max-model-len N] [--engine-process off] [--warm-pool] "
                                 "[--shutdown-timeout-s S]")
    serve.add_argument("spec")
    serve.add_argument("--backend")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--allow-remote", action="store_true",
                       help="allow a --host that is not a loopback address (other machines can then reach the server)")
    serve.add_argument("--max-queued-rows", type=int,
                       help="rows (a request's prompts x n) that may wait for a decode slot; a request past it gets 429 "
                            "with Retry-After (default 8192)")
    serve.add_argument("--max-model-len", type=int,
                       help="the most tokens a request's prompt plus max_tokens may reach; past it a request gets 400 "
                            "(default: the model's context). Rows longer than the spec's rollout.max_prompt_tokens + "
                            "rollout.max_new_tokens decode in a lane of 4 rows this long, beside the others")
    serve.add_argument("--engine-process", default="on", choices=("off", "on"),
                       help="on (default): the engine in a process of its own, beside the HTTP side (more requests/s "
                            "and a shorter TTFT at 64 and 256 streams on a GPU; docs/serving_concurrency.md); off: on "
                            "the HTTP process's engine thread")
    serve.add_argument("--warm-pool", action="store_true",
                       help="capture the decode step of every pool size and the prefill of every token bucket before "
                            "serving (a minute at start on a GPU; else the first burst to reach a size waits while its "
                            "graph compiles and captures)")
    serve.add_argument("--shutdown-timeout-s", type=float, default=5.0,
                       help="on SIGTERM/SIGINT the server stops accepting, gives the requests in flight this long to "
                            "finish (then cuts them off) and exits (default 5)")
    serve.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)  # exit when this process dies
    serve.add_argument("--engine-index", type=int, default=0, help=argparse.SUPPRESS)  # a run's server i: its device

    bench = sub.add_parser("bench", help="run one spec on several backends and compare throughput",
                           usage="rlspec bench SPEC [key=value ...] [-m key=a,b ...] [--backends a,b] [--out DIR] "
                                 "[--reference trl]")
    bench.add_argument("spec")
    bench.add_argument("--backends", help="comma-separated backend names (default: the spec's backend)")
    bench.add_argument("--out", help="output directory (default outputs/bench/<spec>/<time>)")
    bench.add_argument("--warmup-steps", type=int, default=1, help="steps left out of the medians")
    bench.add_argument("--reference", action="append", default=[],
                       help="also run a reference trainer outside rlspec on the same spec: trl (needs rlspec[trl])")
    bench.add_argument("-m", "--multirun", action="store_true",
                       help="sweep: one bench per combination of the overrides' values (key=a,b), in --out/<n>/")

    conf = sub.add_parser("conformance", help="check that backends compute the same GRPO step as the reference")
    conf.add_argument("--backends", help="comma-separated backend names (default: all registered); NAME@KEY=VALUE "
                                         "runs a backend with spec overrides, e.g. deepspeed@hardware.deepspeed.zero_stage=2")
    conf.add_argument("--json", dest="json_path", help="write the checks as JSON to this file")
    conf.add_argument("--dump", help="write the fixture and each backend's steps/weights under this directory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    # Overrides (key=value, Hydra syntax) may stand anywhere after the spec, between options too.
    args, extra = parser.parse_known_args(argv)
    flags = [a for a in extra if a.startswith("-")]
    if flags or (extra and args.command not in ("run", "plan", "eval", "bench", "serve")):
        parser.error(f"unrecognized arguments: {' '.join(flags or extra)}")
    args.overrides = extra
    try:
        return _dispatch(args)
    except SpecError as err:
        print(f"rlspec: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("rlspec: interrupted", file=sys.stderr)
        return 130
    except RunError as err:
        print(f"rlspec: run failed: {err}", file=sys.stderr)
        return EXIT_RUN_FAILED
    except Stopped as stop:
        print(f"rlspec: {stop}", file=sys.stderr)
        return stop.exit_code
    except Exception:  # noqa: BLE001 - any other failure is a run failure, reported with its traceback
        traceback.print_exc()
        print("rlspec: run failed (traceback above)", file=sys.stderr)
        return EXIT_RUN_FAILED


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "plan":
        from .plan import build_plan

        plan, _ = build_plan(args.spec, args.overrides, args.backend, full=False)
        print(plan.to_json())
        return EXIT_OK
    if getattr(args, "multirun", False) and args.command != "eval":
        return _sweep(args)
    if args.command == "run":
        from .run import run

        out = run(args.spec, args.overrides, args.backend, args.out, args.resume,
                  progress=False if args.no_progress else None)
        print(f"rlspec: run finished; outputs in {out}", file=sys.stderr)
        return EXIT_OK
    if args.command == "eval":
        from .evaluation.command import evaluate

        evaluate(args.spec, args.overrides, args.backend, args.checkpoint, args.checkpoints, args.model, args.out,
                 sweep=args.multirun)
        return EXIT_OK
    if args.command == "serve":
        from .plan import build_plan
        from .serve.process import serve

        plan, _ = build_plan(args.spec, args.overrides, args.backend)
        serve(plan, args.host, args.port, args.parent_pid, args.allow_remote, args.engine_index, args.max_queued_rows,
              args.engine_process, args.warm_pool, args.shutdown_timeout_s, args.max_model_len)
        return EXIT_OK
    if args.command == "bench":
        from pathlib import Path

        from .perf.bench import bench, table
        from .run import default_out_dir
        from .spec import load_spec

        names = args.backends.split(",") if args.backends else [load_spec(args.spec, args.overrides).backend]
        out = Path(args.out) if args.out else default_out_dir(args.spec, root="outputs/bench")
        print(table(bench(args.spec, args.overrides, names, out, args.warmup_steps, args.reference)))
        print(f"rlspec: bench written to {out}/bench.json", file=sys.stderr)
        return EXIT_OK
    if args.command == "conformance":
        from .conformance.cli import main as conformance_main

        return conformance_main(args.backends, args.json_path, args.dump)
    raise AssertionError(args.command)


def _sweep(args: argparse.Namespace) -> int:
    """`-m`: the same command once per combination of the overrides' values (`rlspec.sweep`)."""
    from pathlib import Path

    from .sweep import sweep

    if args.command == "run":
        if args.resume:
            raise SpecError("--resume", "a sweep cannot resume", "resume one job: rlspec run SPEC --out OUT/<n> --resume")
        options = ["--no-progress"] if args.no_progress else []
        root = "outputs"
    else:
        options = [*(["--backends", args.backends] if args.backends else []), "--warmup-steps", str(args.warmup_steps),
                   *(f"--reference={ref}" for ref in args.reference)]
        root = "outputs/bench"
    from .plan import default_out_dir

    out = Path(args.out) if args.out else default_out_dir(args.spec, root=root)
    backend = args.backend if args.command == "run" else None
    return sweep(args.command, args.spec, args.overrides, out, options, backend)


if __name__ == "__main__":
    sys.exit(main())
