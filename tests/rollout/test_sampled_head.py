"""The fused LM head and exponential race (`rlspec.rollout.sampled_head`) against what it replaces, `F.linear` then
`exponential_race`, and its in-kernel noise against `noise.keyed_uniform`. On CPU under Triton's interpreter in
fp32 where Triton is installed (CPU-only torch ships without it, so CI skips that case); on CUDA in bf16, also
inside a captured CUDA graph and as the graph sampler's head.

Tokens: the kernel's logits differ from `F.linear`'s in accumulation order only, so its token must be the
reference's wherever the reference's two best scores are further apart than `slack`, and everywhere within
`slack` of the reference's best score (fp32: 1e-4 on logits of order 10; bf16: two bf16 ulps of the row's
largest |z|, as one rounding of a logit may land one ulp away). Log-probs: the kernel's against log_softmax(z)
at the kernel's own token, to 1e-5 in fp32 and to one bf16 ulp of that token's z (plus 1e-4) in bf16.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rlspec.rollout.live_attention import triton
from rlspec.rollout.noise import keyed_exponential, keyed_uniform, sample_keys
from rlspec.rollout.sampled_head import config_for, sampled_head_eager
from rlspec.rollout.sampling import exponential_race, sample_from_hidden, sample_from_logits
from tests.triton_interpreter import allow_scalar_loop_bounds, run_interpreted

# rows, vocabulary, hidden, config: rows and vocabulary off the tile sizes, a K not a multiple of its block
SMALL_SHAPES = ((5, 300, 48, {"block_m": 16, "block_n": 64, "block_k": 32}),
                (37, 200, 64, {"block_m": 32, "block_n": 32, "block_k": 64}),
                (70, 1000, 96, config_for(70)))


def _inputs(rows: int, vocab: int, hidden: int, dtype, device, seed: int = 0):
    torch.manual_seed(seed)
    x = torch.randn(rows, hidden, device=device).to(dtype)
    weight = (torch.randn(vocab, hidden, device=device) * (3 / hidden ** 0.5)).to(dtype)  # logits of std ~3
    keys = sample_keys(seed, torch.arange(rows, device=device))
    steps = torch.randint(0, 4096, (rows,), device=device)
    return x, weight, keys, steps


def _check_against_race(x, weight, keys, steps, temperature, config, bf16: bool):
    token, logp = sampled_head_eager(x, weight, keys, steps, temperature, **config)
    assert token.dtype == torch.int64 and logp.dtype == torch.float32 and token.shape == logp.shape == (x.shape[0],)
    logits = F.linear(x, weight)
    expected, _ = exponential_race(logits, keys, steps, temperature)
    z = logits.float() / temperature
    score = z - keyed_exponential(keys, steps, weight.shape[0]).log()
    top2 = score.topk(2, dim=-1).values
    slack = 2 * 2.0 ** -7 * z.abs().amax(-1) if bf16 else torch.full_like(top2[:, 0], 1e-4)
    clear = top2[:, 0] - top2[:, 1] > slack
    assert torch.equal(token[clear], expected[clear]), "a clear winner differs"
    assert bool((score.gather(-1, token[:, None]).squeeze(-1) >= top2[:, 0] - slack).all()), "a loser won"
    # near ties resolved the other way: none in fp32, about none in bf16 (a bound that catches a broken kernel)
    assert (token != expected).sum().item() <= (1 + x.shape[0] // 10 if bf16 else 0)
    want = torch.log_softmax(z, dim=-1).gather(-1, token[:, None]).squeeze(-1)
    picked = z.gather(-1, token[:, None]).squeeze(-1)
    tolerance = 2.0 ** -7 * picked.abs() + 1e-4 if bf16 else torch.full_like(want, 1e-5)
    assert bool(((logp - want).abs() <= tolerance).all()), (logp - want).abs().max().item()


def _check(dtype, device, shapes) -> None:
    bf16 = dtype == torch.bfloat16
    for rows, vocab, hidden, config in shapes:
        x, weight, keys, steps = _inputs(rows, vocab, hidden, dtype, device)
        for temperature in (1.0, 0.7, 1.3):
            _check_against_race(x, weight, keys, steps, temperature, config or config_for(rows), bf16)


def _check_ties(dtype, device, config) -> None:
    """Rows whose best logits are exactly equal (2^28: no noise term moves a score by half an ulp, so the scores tie
    too) across and inside vocabulary tiles: the token is the row's first tied column, as a whole-row argmax takes
    it, and its log-prob -log(ties)."""
    tied = ([5, 40, 41, 70, 299], [70, 130, 131], [299, 0])  # block_n 64: tiles 0, 0, 0, 1, 4 / 1, 2, 2 / 4, 0
    vocab, hidden = 300, 16
    weight = torch.randn(vocab, hidden, device=device)
    x = torch.zeros(len(tied), hidden, device=device)
    for row, columns in enumerate(tied):
        weight[:, row] = 0.0
        weight[columns, row] = 1.0
        x[row, row] = 2.0 ** 28
    x, weight = x.to(dtype), weight.to(dtype)
    keys, steps = sample_keys(7, torch.arange(len(tied), device=device)), torch.arange(len(tied), device=device)
    for temperature in (1.0, 0.7):
        token, logp = sampled_head_eager(x, weight, keys, steps, temperature, **config)
        expected, _ = exponential_race(F.linear(x, weight), keys, steps, temperature)
        assert token.tolist() == [min(columns) for columns in tied] == expected.tolist()
        want = torch.tensor([-math.log(len(columns)) for columns in tied], device=device)
        torch.testing.assert_close(logp, want, atol=1e-5, rtol=0)


if triton is not None:
    import triton.language as tl

    from rlspec.rollout.sampled_head import _keyed_uniform

    @triton.jit
    def _uniform_kernel(keys_ptr, steps_ptr, out_ptr, V, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        u = _keyed_uniform(tl.load(keys_ptr + rows), tl.load(steps_ptr + rows), cols)
        tl.store(out_ptr + rows[:, None] * V + cols[None, :], u, mask=cols[None, :] < V)


def _check_noise(device) -> None:
    """The kernel's uniforms are `keyed_uniform`'s bit for bit, at extreme keys and steps past 2^31 and 2^32."""
    rows, vocab = 16, 1000
    keys = sample_keys(3, torch.arange(rows, device=device))
    keys[:4] = torch.tensor([0, 2**32 - 1, 2**31, 2**31 - 1])
    steps = torch.arange(rows, device=device) * 977
    steps[:4] = torch.tensor([2**31 + 5, 2**32 + 3, 2**40 + 7, 2**32 - 1])
    out = torch.empty(rows, vocab, device=device)
    _uniform_kernel[(triton.cdiv(vocab, 128),)](keys, steps, out, vocab, BLOCK_M=rows, BLOCK_N=128)
    assert torch.equal(out.view(torch.int32), keyed_uniform(keys, steps, vocab).view(torch.int32))


def _interpreted() -> None:
    """fp32 only: the interpreter's bf16 dot is wrong (CUDA checks bf16 below)."""
    allow_scalar_loop_bounds()
    _check_noise("cpu")
    _check(torch.float32, "cpu", SMALL_SHAPES)
    _check_ties(torch.float32, "cpu", {"block_m": 16, "block_n": 64, "block_k": 16})


def test_sampled_head_matches_linear_and_race_under_the_interpreter():
    run_interpreted("tests.rollout.test_sampled_head")


def test_sample_from_hidden_without_the_kernel_is_linear_then_the_race():
    """Off CUDA (and with top-p) the hidden is put through `F.linear` and sampled as the logits are: the same
    tokens and log-probs as `sample_from_logits`, bit for bit."""
    x, weight, keys, steps = _inputs(6, 500, 32, torch.float32, "cpu")
    for top_p in (1.0, 0.8):
        got = sample_from_hidden(x, weight, 0.8, top_p, keys, steps)
        want = sample_from_logits(F.linear(x, weight), 0.8, top_p, keys, steps)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
def test_sampled_head_matches_linear_and_race_on_cuda():
    """bf16: the 0.5B head (896 x 151,936) at the engine's row counts, shapes off the tiles, and ties."""
    shapes = [(rows, 151_936, 896, None) for rows in (1, 16, 64, 256)] + [(37, 1000 + 77, 200, None)]
    _check(torch.bfloat16, "cuda", shapes + list(SMALL_SHAPES))
    _check_ties(torch.bfloat16, "cuda", {"block_m": 16, "block_n": 64, "block_k": 16})
    _check_noise("cuda")


@pytest.mark.gpu
def test_sampled_head_follows_its_inputs_inside_a_captured_graph():
    """The custom op captured in a CUDA graph reads the hidden, keys and steps written before each replay."""
    from rlspec.rollout.sampled_head import sampled_head

    x, weight, keys, steps = _inputs(64, 151_936, 896, torch.bfloat16, "cuda")
    sampled_head(x, weight, keys, steps, 0.9)  # warm-up outside the capture (Triton compiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        token, logp = sampled_head(x, weight, keys, steps, 0.9)
    for seed in (1, 2):
        fresh = _inputs(64, 151_936, 896, torch.bfloat16, "cuda", seed=seed)
        for buffer, value in zip((x, keys, steps), (fresh[0], fresh[2], fresh[3])):
            buffer.copy_(value)
        graph.replay()
        want = sampled_head_eager(x, weight, keys, steps, 0.9, **config_for(64))
        assert torch.equal(token, want[0]) and torch.equal(logp, want[1])


@pytest.mark.gpu
def test_graph_captured_sampled_head_follows_a_known_categorical():
    """Logits log p through the fused head (x one-hot, the head's first column log p, exact in bf16) inside a
    replayed CUDA graph, the step advanced in the graph: right frequencies (chi-square)."""
    from rlspec.rollout.sampled_head import sampled_head

    log_probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04], device="cuda").log().bfloat16()
    probs = torch.softmax(log_probs.double(), -1)  # of the bf16 logits the kernel sees
    rows, replays, hidden = 4096, 25, 16
    weight = torch.zeros(5, hidden, device="cuda", dtype=torch.bfloat16)
    weight[:, 0] = log_probs
    x = torch.zeros(rows, hidden, device="cuda", dtype=torch.bfloat16)
    x[:, 0] = 1.0
    keys = sample_keys(0, torch.arange(rows, device="cuda"))
    steps = torch.zeros(rows, dtype=torch.long, device="cuda")
    out = torch.zeros(rows, dtype=torch.long, device="cuda")
    sampled_head(x, weight, keys, steps, 1.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(sampled_head(x, weight, keys, steps, 1.0)[0])
        steps.add_(1)
    steps.zero_()
    draws = []
    for _ in range(replays):
        graph.replay()
        draws.append(out.clone())
    counts = torch.bincount(torch.cat(draws), minlength=5).double()
    expected = rows * replays * probs
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    print(f"fused head graph sampling chi-square (4 dof) over {rows * replays} draws: {chi2:.2f}")
    assert chi2 < 20.5  # P(chi2_4 > 20.5) < 4e-4


@pytest.mark.gpu
def test_graph_sampler_with_the_fused_head_samples_like_the_logits_path():
    """The CUDA-graph engine at top_p 1 (bf16, 0.5B shape): with the fused head, nearly the same samples as with
    the logits formed and raced (a near tie may resolve differently), and log-probs that match the trainer's."""
    from rlspec.core.policy import batch_logprobs
    from rlspec.models.base import byte_tokenizer
    from rlspec.models.factory import load_model
    from rlspec.rollout.base import collate, engine_logprobs_tensor
    from rlspec.rollout.hf import HFEngine
    from rlspec.rollout.static import GraphSampler
    from rlspec.spec import ModelSpec, RolloutSpec

    model = load_model(ModelSpec(preset="qwen2_0p5b_shape", dtype="bfloat16", attn_implementation="sdpa"), 0).cuda()
    prompts = ["a=", "bcd=", "hello world=", "x" * 20 + "="]

    def run(fused: bool):
        engine = HFEngine(model, byte_tokenizer(), RolloutSpec(max_new_tokens=64, temperature=0.9), "cuda")
        sampler = GraphSampler(model, "cuda", sampled_head=fused)
        assert sampler.decoder.sampled_head == fused
        engine._fast_sampler = lambda: sampler
        return engine.generate(prompts, n=4, seed=0)

    fused, plain = run(True), run(False)
    same = sum(a == b for a, b in zip(fused.completion_ids, plain.completion_ids))
    batch = collate(fused, torch.zeros(16), torch.zeros(16), 0)
    trainer = batch_logprobs(model, batch, 0.9, 8, "cuda")
    diff = (trainer - engine_logprobs_tensor(fused, batch)).abs()[batch.loss_mask > 0]
    error = diff.exp().mean().item()
    print(f"fused head: {same}/16 samples as the logits path; token_mult_prob_error {error:.5f}, "
          f"max |diff| {diff.max().item():.3e}")
    assert same >= 12 and error <= 1.01
