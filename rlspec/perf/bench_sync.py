"""`python -m rlspec.perf.bench_sync`: one transport's push time beside the raw figure for the same bytes, on GPUs.

    python -m rlspec.perf.bench_sync --method cuda_ipc     # 1 GPU: engine in a rollout server on the trainer's GPU;
                                                      #        raw = a device-to-device copy of the same bytes
    python -m rlspec.perf.bench_sync --method nccl         # 2 GPUs: trainer on cuda:0, server on cuda:1;
                                                      #        raw = one broadcast of the same bytes, same communicator

The trainer's weights (model preset `--model`, `--dtype`) start from a different seed than the server's, so
the first push really moves them; after the pushes the engine's log-probs on a sampled batch are compared
with the trainer's. Prints one JSON object (and writes it to `--json`) and, on stderr, a table with the
median of each phase of a push (`breakdown_verified` / `breakdown_unverified` in the JSON: the transport's
`last_push`, host seconds per phase of the sender and the engine half; `engine/call` is the bridge).

    python -m rlspec.perf.bench_sync --method nccl --device cpu --model qwen2_24l_tiny --dtype float32
                                                      # CPU (gloo): 291 tensors, 3.7 MB: the fixed cost per push

With `--backend fsdp` the trainer is the fsdp backend's own rank actors and the engines its Ray engine actors,
placed as a run places them (`rlspec.cluster.placement`), and a push is the run's own (the bucket-by-bucket
gather included):

    python -m rlspec.perf.bench_sync --backend fsdp --method nccl --engines 3 --model qwen2_7b_shape
                      # split: 1 rank on GPU 0 broadcasting to 3 engines on GPUs 1-3 in one group; raw = one
                      # broadcast of the same bytes to the same group
    python -m rlspec.perf.bench_sync --backend fsdp --method cuda_ipc --ranks 4 --model qwen2_7b_shape
                      # colocated: each of 4 ranks feeds the engine on its own GPU; raw = a device copy

Presets are initialised on the GPU in their dtype (`rlspec.models.factory.load_model`), so the 7B shape is
ready in seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _d2d_copy_s(nbytes: int, repeats: int, chunk_bytes: int = 1 << 30) -> list[float]:
    """Seconds to copy `nbytes` device to device, `repeats` times: one buffer of at most `chunk_bytes` copied as
    often as it takes (beside a 7B trainer and engine on one GPU there is no room for two copies of the weights)."""
    numel = min(nbytes, chunk_bytes) // 2
    src = torch.empty(numel, dtype=torch.bfloat16, device="cuda:0")
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for offset in range(0, nbytes // 2, numel):
            n = min(numel, nbytes // 2 - offset)
            dst[:n].copy_(src[:n])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[1:]


def _table(result: dict) -> str:
    """The medians side by side, for a log or a README; then each phase's median in ms."""
    rows = [("push, sync.verify=true", "push_verified"), ("push, sync.verify=false", "push_unverified"),
            (f"raw {result['raw_name']}", "raw")]
    lines = [f"{result['method']} {result['model']} {result['dtype']} {result['bytes'] / 1e9:.4f} GB, "
             f"{result['num_tensors']} tensors on {result['device']} (median of {result['repeats']})",
             f"{'':26} {'ms':>8} {'GB/s':>8}"]
    lines += [f"{label:26} {result[key + '_s'] * 1e3:8.2f} {result[key + '_gb_per_s']:8.2f}" for label, key in rows]
    verified, unverified = result["breakdown_verified"], result["breakdown_unverified"]
    lines += ["", f"{'phase (median ms)':26} {'verify':>8} {'no verify':>9}"]
    for name in sorted(set(verified) | set(unverified), key=_phase_order):
        cells = [f"{d[name] * 1e3:.3f}" if name in d else "-" for d in (verified, unverified)]
        lines.append(f"{name:26} {cells[0]:>8} {cells[1]:>9}")
    return "\n".join(lines)


def _phase_order(name: str) -> tuple:
    return (0 if name == "total_s" else 1 if name.startswith("sender/") else 2, name.endswith("/call"), name)


def _medians(reports: list[dict]) -> dict[str, float]:
    """Per phase, the median over the pushes (0 in a push that skipped the phase)."""
    names = {name for report in reports for name in report}
    return {name: statistics.median(report.get(name, 0.0) for report in reports) for name in sorted(names)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m rlspec.perf.bench_sync", description=__doc__.split("\n")[0])
    parser.add_argument("--method", choices=("cuda_ipc", "nccl"), required=True)
    parser.add_argument("--model", default="qwen2_0p5b_shape")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=10, help="timed pushes per setting (their median is reported)")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke test of the nccl path over gloo (no figures worth reporting)")
    parser.add_argument("--backend", choices=("standalone", "fsdp"), default="standalone",
                        help="fsdp: the trainer is the fsdp backend's rank actors, the engines its Ray engine actors")
    parser.add_argument("--engines", type=int, default=1, help="--backend fsdp --method nccl: engines in the group")
    parser.add_argument("--ranks", type=int, default=1,
                        help="--backend fsdp: trainer ranks (cuda_ipc: each with an engine on its GPU)")
    args = parser.parse_args(argv)
    if args.backend == "fsdp":
        return _finish(_ray_backend(args), args)

    from ..core.backend import all_caps
    from ..core.policy import batch_logprobs
    from ..core.weights import state_items
    from ..models.factory import load_model, load_tokenizer
    from ..rollout.base import collate
    from ..serve.client import ServedEngine, ServerClient
    from ..serve.process import ServerProcess
    from ..spec import HardwareSpec, ModelSpec, RolloutSpec, Spec, SyncSpec, compile_plan
    from ..sync import LocalWeights, build_transport

    needed = 2 if args.method == "nccl" else 1
    cuda = args.device == "cuda"
    if cuda and torch.cuda.device_count() < needed:
        raise SystemExit(f"--method {args.method} needs {needed} CUDA device(s), found {torch.cuda.device_count()}")
    spec = Spec(model=ModelSpec(preset=args.model, dtype=args.dtype, attn_implementation="sdpa"),
                rollout=RolloutSpec(max_new_tokens=16, prompts_per_step=4),
                sync=SyncSpec(method=args.method, bucket_mb=args.bucket_mb, timeout_s=120),
                hardware=HardwareSpec(device=args.device, rollout="separate" if args.method == "nccl" else "colocated"),
                backend="standalone")
    spec.algorithm.group_size = 2
    plan = compile_plan(spec, all_caps())
    device = "cuda:0" if cuda else "cpu"
    model = load_model(plan.spec.model, plan.spec.algorithm.seed + 1, device).to(device).eval()  # not the server's weights

    def export():  # as the standalone trainer's `export_weights`: a generator over the model's kept state views
        yield from state_items(model)

    source = LocalWeights(export)
    num_tensors = len(model.state_dict())
    server = ServerProcess(plan)
    server.start()
    result: dict = {"method": args.method, "model": args.model, "dtype": args.dtype, "bucket_mb": args.bucket_mb,
                    "repeats": args.repeats, "num_tensors": num_tensors, "device": torch.cuda.get_device_name(0) if cuda else "cpu", "gpus": torch.cuda.device_count()}
    transport = build_transport(plan.sync_method, plan.spec.sync)
    try:
        client = ServerClient(server.url, server.token, 300, server.describe, transport=args.method)
        client.wait_healthy(600, server.alive)
        engine = ServedEngine(client, load_tokenizer(plan.spec.model), plan.spec.rollout, starts_in_sync=True)
        transport.connect(engine, source)
        _timed_pushes(transport, source, engine, args, result, device)
        nbytes = result["bytes"]
        rollout = engine.generate(["abc=", "hello="], 2, seed=0)
        batch = collate(rollout, torch.zeros(4), torch.zeros(4), engine.tokenizer.pad_token_id)
        got = engine.logprobs(batch)
        want = batch_logprobs(model, batch, 1.0, 4, device).cpu()
        result["logprobs_max_abs_diff"] = float(((got - want).abs() * batch.loss_mask).max())
        if args.method == "nccl":
            from ..sync.collective import CollectiveTransport

            payload = {"id": transport.channel_id, "numel": nbytes // 2, "repeats": args.repeats}
            raw, _ = transport._both(CollectiveTransport.raw_send, payload, CollectiveTransport.raw_receive, payload,
                                     gather=False)
            result["raw_name"] = "broadcast"
        else:
            raw = _d2d_copy_s(nbytes, args.repeats)
            result["raw_name"] = "device_to_device_copy"
        result["raw_s"] = statistics.median(raw)
    finally:
        transport.close()
        server.stop()
    return _finish(result, args)


def _finish(result: dict, args) -> dict:
    gb = result["bytes"] / 1e9
    for key in ("push_verified", "push_unverified", "raw"):
        result[key + "_gb_per_s"] = gb / result[key + "_s"]
    result["unverified_vs_raw_bandwidth"] = result["push_unverified_gb_per_s"] / result["raw_gb_per_s"]
    print(json.dumps(result, indent=1))
    print(_table(result), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _timed_pushes(transport, source, engine, args, result: dict, device) -> None:
    """`--repeats` timed pushes (after one untimed: handles, buffers, graphs) with and without `sync.verify`."""
    from ..spec import SyncSpec

    for verify in (True, False):
        transport.spec = SyncSpec(method=args.method, bucket_mb=args.bucket_mb, timeout_s=300, verify=verify)
        times, reports = [], []
        for _ in range(args.repeats + 1):
            _sync(device)
            start = time.perf_counter()
            nbytes = transport.push(source, engine)
            times.append(time.perf_counter() - start)
            reports.append(dict(transport.last_push))
        key = "push_verified" if verify else "push_unverified"
        result[key + "_s"] = statistics.median(times[1:])
        result[key + "_first_s"] = times[0]
        result["breakdown_" + key.removeprefix("push_")] = _medians(reports[1:])
        result["breakdown_" + key.removeprefix("push_") + "_first"] = reports[0]
        result["bytes"] = nbytes


def _ray_backend(args) -> dict:
    """The fsdp backend's ranks and engines as a run places them; push with the run's transport."""
    from ..cluster.ray_utils import wait_all
    from ..core.backend import all_caps, create_backend
    from ..errors import RunError
    from ..rollout.base import collate
    from ..spec import HardwareSpec, ModelSpec, RolloutSpec, Spec, SyncSpec, compile_plan
    from ..sync import build_transport
    from ..sync.collective import CollectiveTransport

    colocated = args.method == "cuda_ipc"
    engines = args.ranks if colocated else args.engines
    # The engine samples only the few sequences of the log-prob check: HF's generate, without the CUDA-graph
    # engine's fused weight copies (the 7B shape colocated on one 80 GB GPU has no room for them).
    spec = Spec(model=ModelSpec(preset=args.model, dtype=args.dtype, attn_implementation="sdpa"),
                rollout=RolloutSpec(max_new_tokens=16, prompts_per_step=4, cuda_graph=False),
                sync=SyncSpec(method=args.method, bucket_mb=args.bucket_mb, timeout_s=300),
                hardware=HardwareSpec(device=args.device, num_trainer_ranks=args.ranks, num_rollout_engines=engines,
                                      rollout="colocated" if colocated else "separate"),
                backend="fsdp")
    spec.algorithm.group_size = 2
    spec.algorithm.micro_batch_size = 1
    plan = compile_plan(spec, all_caps())
    backend = create_backend("fsdp")
    start = time.perf_counter()
    backend.setup(plan)
    result: dict = {"method": args.method, "backend": "fsdp", "model": args.model, "dtype": args.dtype,
                    "bucket_mb": args.bucket_mb, "repeats": args.repeats, "ranks": args.ranks, "engines": engines,
                    "setup_s": time.perf_counter() - start, "layout": "colocated" if colocated else "separate",
                    "device": _device_name(args.device), "gpus": torch.cuda.device_count()}
    engine, source = backend.rollout_engine(), backend.weight_source()
    # counted in the engine: `named_weights` would bring every weight to the driver (the 7B shape's 15 GB spilled
    # from Ray's object store, ~25 s on a fresh H200 machine)
    result["num_tensors"] = wait_all([engine.actors[0].receive.remote(_count_weights, None)], engine.labels[:1])[0]
    transport = build_transport(plan.sync_method, plan.spec.sync)
    try:
        transport.connect(engine, source)
        _timed_pushes(transport, source, engine, args, result, "cpu")
        print(f"pushes done: {result['push_unverified_s']:.4f} s unverified, {result['push_verified_s']:.4f} s verified",
              file=sys.stderr, flush=True)
        try:
            rollout = engine.generate(["abc=", "hello="], 2, seed=0)
            batch = collate(rollout, torch.zeros(4), torch.zeros(4), engine.tokenizer.pad_token_id)
            want = backend.logprobs(batch)
            got = wait_all([a.logprobs.remote(batch) for a in engine.actors], engine.labels)
            result["logprobs_max_abs_diff"] = max(float(((g - want).abs() * batch.loss_mask).max()) for g in got)
        except RunError as err:  # the push figures stand; say why the check is missing
            result["logprobs_check_failed"] = str(err).splitlines()[0]
        if colocated:
            result["raw_s"] = statistics.median(wait_all([a.receive.remote(_copy_seconds, (result["bytes"] // engines,
                                                                                           args.repeats))
                                                          for a in engine.actors], engine.labels)[0])
            result["raw_name"] = "device_to_device_copy (one engine's bytes, on its GPU)"
            result["bytes"] //= engines  # the table's GB/s: what each GPU moved, as the raw copy's
        else:
            payload = {"id": transport.channel_id, "numel": result["bytes"] // 2, "repeats": args.repeats}
            raw, _ = transport._both(CollectiveTransport.raw_send, payload, CollectiveTransport.raw_receive, payload,
                                     gather=False)
            result["raw_s"] = statistics.median(raw)
            result["raw_name"] = f"broadcast to {engines} engine(s)"
    finally:
        transport.close()
        backend.shutdown()
    return result


def _count_weights(engine, _payload) -> int:
    """Engine half: how many named weights the engine holds."""
    return sum(1 for _ in engine.named_weights())


def _copy_seconds(_engine, payload) -> list[float]:
    """Engine half: time a device-to-device copy of `nbytes` on this engine's GPU (`repeats` times)."""
    nbytes, repeats = payload
    return _d2d_copy_s(nbytes, repeats)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main(sys.argv[1:])
