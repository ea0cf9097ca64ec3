"""GPU-only checks (skipped without CUDA): bf16 runs and trainer-versus-engine agreement on the device."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from rlspec.runtime.metrics import read_metrics
from tests.conftest import REPO, rlspec_cmd

pytestmark = pytest.mark.gpu


def test_standalone_bf16_run_on_cuda(tmp_path):
    out = tmp_path / "gpu"
    proc = subprocess.run(rlspec_cmd("run", "examples/tiny.yaml", "hardware=gpu1", "model.dtype=bfloat16",
                                     "algorithm.steps=5", "--out", str(out), "--no-progress"),
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 5 and all(0 < r["mem/peak_gb"] < 80 for r in rows)
    assert json.loads((out / "plan.json").read_text())["placement"]["trainer_devices"] == ["cuda:0"]


def test_bf16_engine_and_trainer_logprobs_agree_on_cuda():
    from rlspec.models.base import byte_tokenizer
    from rlspec.models.factory import load_model
    from rlspec.core.policy import batch_logprobs
    from rlspec.rollout.base import collate, engine_logprobs_tensor
    from rlspec.rollout.hf import HFEngine
    from rlspec.spec import ModelSpec, RolloutSpec

    model = load_model(ModelSpec(dtype="bfloat16", attn_implementation="eager"), 0).cuda()
    engine = HFEngine(model, byte_tokenizer(), RolloutSpec(max_new_tokens=16), "cuda")
    rollout = engine.generate(["a=", "bcd=", "x="], n=4, seed=0)
    batch = collate(rollout, torch.zeros(12), torch.zeros(12), 0)
    trainer = batch_logprobs(model, batch, 1.0, 4, "cuda")
    diff = ((trainer - engine_logprobs_tensor(rollout, batch)) * batch.loss_mask).abs().max().item()
    print(f"bf16 cuda engine-vs-trainer max abs logprob diff: {diff:.3e}")
    assert diff < 0.1  # bf16: padding layout changes the reduction order; fp32 on CPU agrees to 1e-6


def test_graph_engine_logprobs_match_trainer_in_bf16():
    """token_mult_prob_error = mean over completion tokens of exp(|trainer - engine|) <= 1.01, at 0.5B shapes."""
    from rlspec.models.base import byte_tokenizer
    from rlspec.models.factory import load_model
    from rlspec.core.policy import batch_logprobs
    from rlspec.rollout.base import collate, engine_logprobs_tensor
    from rlspec.rollout.hf import HFEngine
    from rlspec.spec import ModelSpec, RolloutSpec

    model = load_model(ModelSpec(preset="qwen2_0p5b_shape", dtype="bfloat16", attn_implementation="sdpa"), 0).cuda()
    engine = HFEngine(model, byte_tokenizer(), RolloutSpec(max_new_tokens=64, temperature=0.9, top_p=0.95), "cuda")
    assert engine._fast_sampler() is not None, "the CUDA-graph path runs this model"
    prompts = ["a=", "bcd=", "hello world=", "x" * 20 + "="]
    rollout = engine.generate(prompts, n=4, seed=0)
    assert engine.generate(prompts, n=4, seed=0).completion_ids == rollout.completion_ids, "reproducible per seed"
    assert engine.generate(prompts, n=4, seed=1).completion_ids != rollout.completion_ids

    def mult_prob_error(engine: HFEngine, rollout) -> tuple[float, float]:
        batch = collate(rollout, torch.zeros(16), torch.zeros(16), 0)
        trainer = batch_logprobs(model, batch, 0.9, 8, "cuda")
        diff = (trainer - engine_logprobs_tensor(rollout, batch)).abs()[batch.loss_mask > 0]
        return diff.exp().mean().item(), diff.max().item()

    error, worst = mult_prob_error(engine, rollout)
    plain = HFEngine(model, byte_tokenizer(), RolloutSpec(max_new_tokens=64, temperature=0.9, top_p=0.95,
                                                          cuda_graph=False), "cuda")
    plain_error, plain_worst = mult_prob_error(plain, plain.generate(prompts, n=4, seed=0))
    print(f"bf16 engine vs trainer token_mult_prob_error: graph path {error:.5f} (max |diff| {worst:.3e}), "
          f"plain transformers loop {plain_error:.5f} (max |diff| {plain_worst:.3e})")
    assert error <= 1.01


def test_graph_captured_sampling_follows_a_known_categorical():
    """The sampler inside a replayed CUDA graph (noise keyed by sample and step, the step advanced in the graph):
    right frequencies (chi-square) and reproducible per seed."""
    from rlspec.rollout.noise import sample_keys
    from rlspec.rollout.sampling import sample_from_logits

    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04], device="cuda")
    rows, replays = 4096, 25
    logits = probs.log().expand(rows, -1).contiguous()
    keys = torch.zeros(rows, dtype=torch.long, device="cuda")
    steps = torch.zeros(rows, dtype=torch.long, device="cuda")
    out = torch.zeros(rows, dtype=torch.long, device="cuda")
    sample_from_logits(logits, 1.0, 1.0, keys, steps)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(sample_from_logits(logits, 1.0, 1.0, keys, steps)[0])
        steps.add_(1)

    def draw(seed: int) -> torch.Tensor:
        keys.copy_(sample_keys(seed, torch.arange(rows, device="cuda")))
        steps.zero_()
        samples = []
        for _ in range(replays):
            graph.replay()
            samples.append(out.clone())
        return torch.cat(samples)

    first = draw(0)
    assert torch.equal(first, draw(0)) and not torch.equal(first, draw(1))
    counts = torch.bincount(first, minlength=5).double()
    expected = rows * replays * probs.double()
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    print(f"graph sampling chi-square (4 dof) over {rows * replays} draws: {chi2:.2f}")
    assert chi2 < 20.5  # P(chi2_4 > 20.5) < 4e-4


def test_continuous_batching_on_cuda_samples_like_the_static_batch():
    """The CUDA-graph pool with refills and a shrunk tail (fp32 tiny model, end-token hazard 0.12): its samples match
    the static batch's (noise keyed by sample and position; a near tie may resolve differently between the batch
    shapes' kernels, so nearly all, not all), and its log-probs the trainer's. The tail's pool (32 slots into 16,
    the floor) is captured ahead, while the GPU runs the 32-slot pool's first steps."""
    from rlspec.core.policy import batch_logprobs
    from rlspec.models.base import byte_tokenizer
    from rlspec.models.factory import load_model
    from rlspec.rollout.base import collate, engine_logprobs_tensor
    from rlspec.rollout.hf import HFEngine
    from rlspec.spec import ModelSpec, RolloutSpec

    model = load_model(ModelSpec(eos_hazard=0.12), 0).cuda()
    prompts = ["a=", "bcd=", "hello=", "xy="]

    def run(**rollout):
        engine = HFEngine(model, byte_tokenizer(), RolloutSpec(max_new_tokens=48, **rollout), "cuda")
        sampler = engine._fast_sampler()
        assert sampler is not None
        sampler.timeline = []
        return engine.generate(prompts, n=16, seed=3), sampler.timeline

    static, _ = run(continuous_batching=False)
    rolled, timeline = run(decode_slots=32)
    captures = [t for t in timeline if t[0] == "capture"]
    assert [(t[1], t[3]) for t in captures] == [(32, False), (16, True)], captures
    assert {t[1] for t in timeline if t[0] == "decode"} == {32, 16}
    same = sum(a == b for a, b in zip(rolled.completion_ids, static.completion_ids))
    lengths = sorted(len(c) for c in rolled.completion_ids)
    print(f"continuous vs static on cuda: {same}/64 samples identical; lengths {lengths[::8]}")
    assert same >= 60 and lengths[0] < 10 and lengths[-1] > 20
    batch = collate(rolled, torch.zeros(64), torch.zeros(64), 0)
    trainer = batch_logprobs(model, batch, 1.0, 16, "cuda")
    diff = ((trainer - engine_logprobs_tensor(rolled, batch)) * batch.loss_mask).abs().max().item()
    assert diff < 1e-3, diff


def test_the_step_outside_the_layers_samples_alike_compiled_or_eager_on_cuda():
    """The decode step's work outside the decoder layers (recording the sample, the counters, the embedding, the
    final norm) captured compiled (the default) and eagerly (`compile_ends=False`, what a step runs if compiling
    fails): both capture, and sample the same tokens (fp32 tiny model, refilled slots, a shrunk tail)."""
    from rlspec.models.factory import load_model
    from rlspec.rollout.static import GraphSampler
    from rlspec.spec import ModelSpec

    model = load_model(ModelSpec(eos_hazard=0.12), 0).cuda()
    ids = torch.randint(4, 250, (24, 5), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    samplers = [GraphSampler(model, "cuda", compile_ends=ends, shrink_floor=2) for ends in (True, False)]
    tokens = [sampler.sample(ids, mask, seed=3, max_new_tokens=40, temperature=1.0, top_p=1.0,
                             eos=model.config.eos_token_id, slots=8)[0] for sampler in samplers]
    assert torch.equal(tokens[0], tokens[1])


def test_a_rollout_keeps_the_allocators_cached_blocks():
    """Capturing the decode graphs must not empty the caching allocator: a colocated trainer's freed activation
    blocks stay cached through a rollout, so its next train phase allocates nothing from the driver. Checked over a
    second rollout, as in a run's later steps: run alone without one before (the rollout that compiles), the
    256 MB block was no longer whole afterwards on an H200, and the assertion on it failed, before and after the
    tail's pools changed."""
    from rlspec.models.base import byte_tokenizer
    from rlspec.models.factory import load_model
    from rlspec.rollout.hf import HFEngine
    from rlspec.spec import ModelSpec, RolloutSpec

    model = load_model(ModelSpec(eos_hazard=0.12), 0).cuda()
    engine = HFEngine(model, byte_tokenizer(), RolloutSpec(max_new_tokens=32, decode_slots=32), "cuda")
    assert engine._fast_sampler() is not None
    engine.generate(["a=", "bcd=", "hello="], n=16, seed=1)
    activations = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # a trainer's freed activations
    del activations
    freed = torch.cuda.memory_stats()["segment.all.freed"]
    engine.generate(["a=", "bcd=", "hello="], n=16, seed=0)  # graphs captured for the pool and its shrunk tail
    assert torch.cuda.memory_stats()["segment.all.freed"] == freed
    again = torch.cuda.memory_stats()["segment.all.allocated"]
    activations = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    assert torch.cuda.memory_stats()["segment.all.allocated"] == again, "served from the cache"
