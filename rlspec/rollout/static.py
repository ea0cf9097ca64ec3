"""The `hf` engine's CUDA path: a static KV cache and a decode step captured in CUDA graphs.

`StaticDecoder` is a small forward pass for Llama-style decoders (Qwen2, Llama, Mistral without a
sliding window) that reads the transformers module's own weight tensors — weights still arrive by HF
name through `HFEngine.load_weights`, and a colocated trainer's in-place optimizer steps are seen
directly. Without `sdpa` its attention follows transformers' eager attention (scores in the model dtype,
softmax in fp32); with it (the CUDA default) it is `scaled_dot_product_attention`; either way the engine's
log-probs agree with the trainer's within bf16 rounding (`tests/test_gpu.py`). On CUDA it also runs each
layer's q/k/v and gate/up projections as one GEMM each, over fused copies refreshed before every batch
(`fuse_weights`), and compiles one function per decoder layer.

`GraphSampler` runs one rollout batch over a pool of slots (continuous batching; see its docstring):

    prefill each distinct prompt once (row chunks, eager) -> its K/V and first logits
    fill the pool: copy a pending sample's prompt K/V and logits into each free slot
    repeat:  [one CUDA graph replay per token]
        top_p = 1: token = argmax(logits / T - log E), logp = logits[token] / T - logsumexp(logits / T)
        top_p < 1: logp = log_softmax(logits / T); token = argmax(top_p(exp(logp)) / E)      (E ~ Exp(1))
        ended slots emit the end token; record token and logp[token] at the slot's own column
        write K/V of `token` into the slot's next cache position; logits = forward(token)
        every `check_every` steps (the only host sync): copy ended slots' samples out, refill them

`argmax(p_i / E_i)` with `E_i ~ Exp(1)` samples i with probability p_i / sum(p) (the exponential race),
which needs no data-dependent shapes, so sampling lives inside the graph; E is keyed by (seed, sample,
position) (`rlspec.rollout.noise`). One graph is captured per (slot bucket, cache length bucket): the pool is
padded up to the next power of two with empty (ended) slots, and the cache length is rounded up to a
multiple of `CACHE_STEP`. Without CUDA (`use_graphs=False`) the same step function runs eagerly, which is how
the CPU tests check its logic.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.batch import position_ids
from .noise import keyed_exponential, sample_keys
from .sampling import top_p_filter

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "mistral")
BATCH_BUCKETS = tuple(2 ** i for i in range(11))  # 1 .. 1024 rows per graph
CACHE_STEP = 128
PREFILL_ROWS = 64


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `StaticDecoder` cannot run `model` (None when it can)."""
    if hasattr(model, "peft_config"):
        return "the model carries LoRA adapters"
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"model_type {getattr(config, 'model_type', None)!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "the model uses sliding-window layers"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") != "default":
        return "the model's RoPE is not the default kind"
    return None


class StaticDecoder:
    """Forward pass over the HF module's weights, writing K/V into caller-owned static caches."""

    def __init__(self, model: torch.nn.Module, sdpa: bool = False) -> None:
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"StaticDecoder cannot run this model: {reason}")
        config = model.config
        self.model = model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.eps = config.rms_norm_eps
        self.num_layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        self.rotary = model.model.rotary_emb
        self.sdpa = sdpa
        self._compiled = None
        self.race = None  # the compiled `exponential_race` and `keyed_exponential`, with the compiled blocks
        self.noise = None
        self._fused: list[tuple[Tensor, Tensor | None, Tensor]] | None = None
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self._qkv_sizes = (q_size, kv_size, kv_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    def weight_pointers(self) -> tuple[int, ...]:
        """Storage addresses a captured graph baked in; they change only if a weight is re-allocated."""
        return tuple(p.data_ptr() for p in self.model.parameters())

    @torch.no_grad()
    def fuse_weights(self) -> None:
        """Keep each layer's q/k/v projections as one [q+k+v, hidden] matrix and gate/up as one [2 x ffn, hidden]
        (and refresh them from the module's current weights): a decode step then runs 2 GEMMs where it ran 5.

        The fused matrices are copies (for the 0.5B shape about 0.47 GB in bf16), so call this before every
        batch: a colocated trainer's optimizer steps and a sync write the module's weights, not these.
        Refreshing copies into the same buffers, so captured graphs stay valid.
        """
        layers = self.model.model.layers
        if self._fused is None:
            self._fused = []
            for layer in layers:
                attn, ffn = layer.self_attn, layer.mlp
                wqkv = torch.empty(sum(self._qkv_sizes), attn.q_proj.weight.shape[1], dtype=attn.q_proj.weight.dtype,
                                   device=attn.q_proj.weight.device)
                bqkv = None if attn.q_proj.bias is None else torch.empty(sum(self._qkv_sizes), dtype=attn.q_proj.bias.dtype,
                                                                         device=attn.q_proj.bias.device)
                w_gate_up = torch.empty(2 * ffn.gate_proj.weight.shape[0], ffn.gate_proj.weight.shape[1],
                                        dtype=ffn.gate_proj.weight.dtype, device=ffn.gate_proj.weight.device)
                self._fused.append((wqkv, bqkv, w_gate_up))
        for layer, (wqkv, bqkv, w_gate_up) in zip(layers, self._fused):
            attn, ffn = layer.self_attn, layer.mlp
            torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], out=wqkv)
            if bqkv is not None:
                torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias], out=bqkv)
            torch.cat([ffn.gate_proj.weight, ffn.up_proj.weight], out=w_gate_up)

    def unfuse_weights(self) -> None:
        """Drop the fused copies (their memory goes back to the allocator)."""
        self._fused = None

    def new_cache(self, batch: int, length: int, device) -> tuple[list[Tensor], list[Tensor]]:
        shape = (batch, self.num_kv_heads, length, self.head_dim)
        keys = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)]
        values = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)]
        return keys, values

    def _rms_norm(self, x: Tensor, weight: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x.to(dtype)

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions[..., None].float() * self.rotary.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.rotary.attention_scaling
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    @staticmethod
    def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _attend(self, q: Tensor, keys: Tensor, values: Tensor, allowed: Tensor) -> Tensor:
        """q [b, H, T, D] against the whole cache [b, Hkv, S, D]; `allowed` [b, T, S] (bool).

        Query heads are grouped onto their shared K/V head with a reshape, not a copy of the cache.
        """
        b, _, t, d = q.shape
        if self.sdpa:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None], scale=self.scaling,
                                                  enable_gqa=True)
        groups = self.num_heads // self.num_kv_heads
        q = q.reshape(b, self.num_kv_heads, groups * t, d)
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.scaling
        scores = scores.view(b, self.num_kv_heads, groups, t, -1)
        scores = scores.masked_fill(~allowed[:, None, None], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs.view(b, self.num_kv_heads, groups * t, -1), values)
        return out.view(b, self.num_heads, t, d)

    def _qkv(self, x: Tensor, norm: Tensor, weights: tuple, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`weights`: (wq, bq, wk, bk, wv, bv), or the fused (wqkv, bqkv)."""
        b, t, _ = x.shape
        h = self._rms_norm(x, norm)
        if len(weights) == 2:
            q, k, v = F.linear(h, *weights).split(self._qkv_sizes, dim=-1)
        else:
            wq, bq, wk, bk, wv, bv = weights
            q, k, v = F.linear(h, wq, bq), F.linear(h, wk, bk), F.linear(h, wv, bv)
        q, k, v = (z.reshape(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin), v

    def _attention_block(self, x: Tensor, q: Tensor, keys: Tensor, values: Tensor, allowed: Tensor, wo: Tensor,
                         bo: Tensor | None) -> Tensor:
        b, t, _ = x.shape
        out = self._attend(q, keys, values, allowed)
        return x + F.linear(out.transpose(1, 2).reshape(b, t, -1), wo, bo)

    def _mlp_block(self, x: Tensor, norm: Tensor, weights: tuple) -> Tensor:
        """`weights`: (w_gate, w_up, w_down), or the fused (w_gate_up, w_down)."""
        h = self._rms_norm(x, norm)
        if len(weights) == 2:
            gate, up = F.linear(h, weights[0]).chunk(2, dim=-1)
        else:
            gate, up = F.linear(h, weights[0]), F.linear(h, weights[1])
        return x + F.linear(F.silu(gate) * up, weights[-1])

    def compile_blocks(self, layers: bool = False) -> None:
        """Fuse the elementwise work (norms, RoPE, softmax, SiLU, residual adds) with torch.compile; shapes are
        static. `layers`: one compiled function per decoder layer (the K/V cache writes included, so fusion
        crosses the block boundaries), compiled once and reused by every layer; else one per block."""
        if layers:
            self._compiled = torch.compile(self._layer, dynamic=False)
        else:
            blocks = tuple(torch.compile(f, dynamic=False) for f in self._blocks())
            self._compiled = lambda *args: self._layer(*args, blocks=blocks)
        self.race = torch.compile(exponential_race, dynamic=False)
        self.noise = torch.compile(keyed_exponential, dynamic=False)  # top-p < 1: one kernel, not ~30 over [B, V]

    def uncompile_blocks(self) -> None:
        self._compiled = None
        self.race = self.noise = None

    def _blocks(self):
        return self._qkv, self._attention_block, self._mlp_block

    def _layer(self, x: Tensor, weights: tuple, k_cache: Tensor, v_cache: Tensor, slots: Tensor, allowed: Tensor,
               cos: Tensor, sin: Tensor, blocks=None) -> Tensor:
        """One decoder layer; its K/V go to cache `slots` [b, T] (each row its own). `weights` from `_layer_weights`."""
        qkv, attention, mlp = blocks or self._blocks()
        norm1, qkv_weights, wo, bo, norm2, mlp_weights = weights
        q, k, v = qkv(x, norm1, qkv_weights, cos, sin)
        index = slots[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        k_cache.scatter_(2, index, k)
        v_cache.scatter_(2, index, v)
        x = attention(x, q, k_cache, v_cache, allowed, wo, bo)
        return mlp(x, norm2, mlp_weights)

    def _layer_weights(self, index: int, layer) -> tuple:
        attn, ffn = layer.self_attn, layer.mlp
        if self._fused is not None:
            wqkv, bqkv, w_gate_up = self._fused[index]
            qkv, mlp = (wqkv, bqkv), (w_gate_up, ffn.down_proj.weight)
        else:
            qkv = (attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight, attn.k_proj.bias, attn.v_proj.weight,
                   attn.v_proj.bias)
            mlp = (ffn.gate_proj.weight, ffn.up_proj.weight, ffn.down_proj.weight)
        return (layer.input_layernorm.weight, qkv, attn.o_proj.weight, attn.o_proj.bias,
                layer.post_attention_layernorm.weight, mlp)

    def forward(self, ids: Tensor, positions: Tensor, slots: Tensor, allowed: Tensor,
                keys: list[Tensor], values: list[Tensor], compiled: bool = False) -> Tensor:
        """Logits [b, V] of the last of `ids` [b, T]; K/V of all T tokens go to cache `slots`: [T] (the same for
        every row) or [b, T] (each row its own, as the continuous-batching decode step writes).

        `compiled` uses the torch.compile'd layers or blocks (decode steps: one shape per graph); prefill
        shapes vary with the prompt width, so prefill runs the plain ones.
        """
        run = self._compiled if compiled and self._compiled is not None else self._layer
        body = self.model.model
        if slots.dim() == 1:
            slots = slots.expand(ids.shape[0], -1)
        x = body.embed_tokens(ids)
        cos, sin = self._rope(positions, x.dtype)
        cos, sin = cos[:, None], sin[:, None]
        for index, (layer, k_cache, v_cache) in enumerate(zip(body.layers, keys, values)):
            x = run(x, self._layer_weights(index, layer), k_cache, v_cache, slots, allowed, cos, sin)
        x = self._rms_norm(x[:, -1], body.norm.weight)
        return F.linear(x, self.model.get_output_embeddings().weight)


def sample_from_logits(logits: Tensor, temperature: float, top_p: float, keys: Tensor, steps: Tensor,
                       race=None, noise=None) -> tuple[Tensor, Tensor]:
    """One token per row and its log-probability under the full softmax at `temperature` (the trainer's
    definition, before top-p). Row i's noise is keyed by (`keys[i]`, `steps[i]`) (`keyed_exponential`).

    The exponential race `argmax(p / E)`, `E ~ Exp(1)` i.i.d., picks i with probability p_i / sum(p): a
    categorical sample with static shapes and no host sync. Without top-p it is `argmax(logits / T - log E)`
    (`race`, which a caller may pass compiled: the noise, the race and the log-sum-exp in one pass over the
    logits, no [B, V] softmax); with top-p, `noise` may be the compiled `keyed_exponential`.
    """
    if top_p >= 1.0:
        return (race or exponential_race)(logits, keys, steps, temperature)
    draws = (noise or keyed_exponential)(keys, steps, logits.shape[-1])
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    token = torch.argmax(top_p_filter(logp.exp(), top_p) / draws, dim=-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def exponential_race(logits: Tensor, keys: Tensor, steps: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """`argmax(softmax(logits / T) / E)` and the winner's log-probability, without forming the softmax."""
    noise = keyed_exponential(keys, steps, logits.shape[-1])
    scaled = logits.float() / temperature
    token = torch.argmax(scaled - noise.log(), dim=-1)
    logp = scaled.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    return token, logp


def graph_key(shape: tuple[int, int], max_new_tokens: int, temperature: float, top_p: float, eos: int) -> tuple:
    """The (slot bucket, cache length, sampling settings) a pool of `rows` slots with prompts `width` wide is
    captured under, for `shape` = (rows, width)."""
    rows, width = shape
    bucket = next(b for b in BATCH_BUCKETS if b >= rows)
    length = math.ceil((width + max_new_tokens) / CACHE_STEP) * CACHE_STEP
    return bucket, length, max_new_tokens, temperature, top_p, eos


@dataclass
class _Prompts:
    """A batch's distinct prompts, prefilled once: what a slot copies when it starts one of their samples."""

    keys: list[Tensor]         # [P, Hkv, W, D] per layer
    values: list[Tensor]
    logits: Tensor             # [P, V] logits of the first completion token
    mask: Tensor               # [P, W] real (not padding) prompt tokens
    next_position: Tensor      # [P] RoPE position of the first completion token
    index: Tensor              # [rows] the prompt of each sample


@dataclass
class _State:
    """Static buffers of one (slot bucket, cache length) graph; replays read and write only these. A slot is a
    row: it decodes one sample at a time, and every row has its own position, cache slot and output column."""

    keys: list[Tensor]   # [B, Hkv, S, D] per layer
    values: list[Tensor]
    logits: Tensor       # [B, V] next-token logits
    position: Tensor     # [B] RoPE position of the next token
    write: Tensor        # [B] cache slot of the next token
    step: Tensor         # [B] output column of the next token (= tokens sampled so far by the slot's sample)
    key: Tensor          # [B] noise key of the slot's sample
    valid: Tensor        # [B, S] cache slots holding a real token
    done: Tensor         # [B] slot's sample has ended (end token or max_new_tokens), or the slot is empty
    out_tokens: Tensor   # [B, N + 1]; column N takes the writes of ended slots
    out_logps: Tensor    # [B, N + 1]
    graph: object = None


class GraphSampler:
    """Samples a rollout batch with a `StaticDecoder`, one CUDA graph replay per token, over a pool of slots.

    Continuous batching (`sample(..., slots=K)`): the pool has min(rows, K) slots (rounded up to the graph's
    bucket while samples remain); every `check_every` steps the host reads which slots have ended, copies their
    samples' tokens out, and starts the next pending samples in them — it copies the prompt's K/V (prefilled once
    per distinct prompt: the G completions of a GRPO group share one prefill) into the slot, so a refill runs no
    forward pass. Once no sample is pending and at most a quarter of the pool is live, the live slots move into a
    pool a quarter the size or less (`shrink_tail`; its own graph), so the long tail does not pay for a full
    pool's step (each bucket's decode layer is compiled once per process). Without `slots`, the pool holds all rows (up to 1,024; more run in waves, each started when
    the whole pool has ended): the static batch.

    Reproducibility: sample i's token at position t is drawn with noise keyed by (seed, i, t), and its logits
    depend only on its prompt and its own earlier tokens, so a sample's tokens do not depend on the slot it ran
    in, when it started, the pool size, or whether the batch ran continuously or statically — up to floating-point
    differences between kernels for different batch shapes (on CPU the eager path gives the same tokens; on
    CUDA a near tie can resolve differently).

    KV memory: slots x cache length x layers x 2 x kv_heads x head_dim x 2 bytes (bf16), whatever the lengths
    the samples reach (no paging: a slot reserves the full length). For the 0.5B shape (24 layers, 2 K/V heads
    of 64) that is 12,288 bytes per cached token: 256 rows x 1,152 (a 1,024-token budget plus a prompt of up to
    128, rounded to `CACHE_STEP`) = 3.6 GB as a static batch; with 64 slots 0.91 GB for any number of rows.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, use_graphs: bool | None = None,
                 compile_blocks: bool | None = None, check_every: int = 8, keep_graphs: bool = False,
                 fuse_weights: bool | None = None, sdpa: bool | None = None, compile_layers: bool | None = None,
                 share_prefill: bool = True, shrink_tail: bool = True) -> None:
        self.device = torch.device(device)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        # The defaults on CUDA are the fastest measured (`python -m rlspec.perf.profile_engine`, H200, 0.5B shape, 64
        # rows: 1.43 ms a decode step fused + SDPA + per-layer compile, 1.98 ms with none of them).
        self.decoder = StaticDecoder(model, sdpa=self.use_graphs if sdpa is None else sdpa)
        self.compiled = self.use_graphs if compile_blocks is None else compile_blocks
        self.fuse = self.use_graphs if fuse_weights is None else fuse_weights
        if self.compiled:
            self.decoder.compile_blocks(layers=self.use_graphs if compile_layers is None else compile_layers)
        self.check_every = check_every
        self.share_prefill = share_prefill  # False: one prefill per row (the equivalence tests' reference)
        self.shrink_tail = shrink_tail
        # Dropping the graphs (their KV cache and memory pool) after each batch gives that memory back to a
        # colocated trainer; a later capture of a seen shape skips warm-up and costs a few milliseconds.
        self.keep_graphs = keep_graphs
        self._capture_stream = None
        self._states: dict[tuple, _State] = {}
        self._pointers: tuple[int, ...] = ()
        self._warmed: set[tuple] = set()

    @torch.no_grad()
    def sample(self, input_ids: Tensor, attention_mask: Tensor, seed: int, max_new_tokens: int,
               temperature: float, top_p: float, eos: int, slots: int | None = None) -> tuple[Tensor, Tensor]:
        """[B, T] tokens and log-probs on CPU, T = the longest sample; ended rows carry `eos` onward (as `HFEngine`).
        `slots`: continuous batching over that many slots; None: the static batch.

        On CUDA everything runs with the sampler's device as the calling thread's current device: a capture
        records only the current device's capture stream, so kernels of a model on another device (a rollout
        server on cuda:1, called from a worker thread whose current device is cuda:0) would run uncaptured.
        """
        args = (input_ids, attention_mask, seed, max_new_tokens, temperature, top_p, eos, slots)
        if self.device.type != "cuda":
            return self._sample(*args)
        with torch.cuda.device(self.device):
            return self._sample(*args)

    def _sample(self, input_ids: Tensor, attention_mask: Tensor, seed: int, max_new_tokens: int,
                temperature: float, top_p: float, eos: int, slots: int | None) -> tuple[Tensor, Tensor]:
        if self.fuse:
            self.decoder.fuse_weights()
        state = self._state(graph_key(self.pool_shape(input_ids.shape, slots), max_new_tokens, temperature, top_p, eos))
        prompts = self._prefill(input_ids, attention_mask)
        tokens, logps = self._decode(state, prompts, seed, max_new_tokens, temperature, top_p, eos, waves=slots is None)
        if not self.keep_graphs:
            self._states.clear()
            self.decoder.unfuse_weights()
        return tokens, logps

    @staticmethod
    def pool_shape(shape: tuple[int, int], slots: int | None) -> tuple[int, int]:
        """(slots, prompt width) of the pool a [rows, width] batch decodes in: a graph runs its whole bucket, so
        the pool takes all of it while there are rows to fill it."""
        rows, width = shape
        wanted = min(rows, slots or BATCH_BUCKETS[-1], BATCH_BUCKETS[-1])
        bucket = next(b for b in BATCH_BUCKETS if b >= wanted)
        return min(bucket, rows), width

    def _decode(self, state: _State, prompts: _Prompts, seed: int, max_new_tokens: int, temperature: float,
                top_p: float, eos: int, waves: bool) -> tuple[Tensor, Tensor]:
        """Run the pool until every sample has ended; `waves`: refill only once the whole pool has ended."""
        rows, n, dev = prompts.index.shape[0], max_new_tokens, self.device
        bucket = state.done.shape[0]
        tokens = torch.full((rows, n), eos, dtype=torch.long, device=dev)
        logps = torch.zeros(rows, n, dtype=torch.float32, device=dev)
        lengths = torch.zeros(rows, dtype=torch.long, device=dev)
        keys = sample_keys(seed, torch.arange(rows, device=dev))
        state.done.fill_(True)
        occupant, started = [-1] * bucket, [0] * bucket  # sample in each slot (-1: empty), decode step it began at
        next_sample, clock = 0, 0
        while True:
            free = [b for b in range(bucket) if occupant[b] < 0]
            if waves and len(free) < bucket:
                free = []
            take = free[:rows - next_sample]
            if take:
                self._start(state, prompts, keys, take, next_sample)
                for offset, b in enumerate(take):
                    occupant[b], started[b] = next_sample + offset, clock
                next_sample += len(take)
            live = [b for b in range(bucket) if occupant[b] >= 0]
            if not live:
                break
            if self.shrink_tail and not waves and next_sample == rows and len(live) * 4 <= bucket:
                state = self._shrink(state, live, temperature, top_p, eos)
                occupant, started = [occupant[b] for b in live], [started[b] for b in live]
                bucket = state.done.shape[0]
                occupant += [-1] * (bucket - len(live))
                started += [0] * (bucket - len(live))
                live = list(range(len(live)))
            chunk = min(self.check_every, max(n - (clock - started[b]) for b in live))
            for _ in range(chunk):
                if state.graph is not None:
                    state.graph.replay()
                else:
                    self._step(state, temperature, top_p, eos)
            clock += chunk
            done = state.done.tolist()  # the loop's only host sync
            ended = [b for b in live if done[b]]
            if ended:
                self._harvest(state, ended, [occupant[b] for b in ended], tokens, logps, lengths, eos)
                for b in ended:
                    occupant[b] = -1
        width = max(int(lengths.max()), 1)
        return tokens[:, :width].cpu(), logps[:, :width].cpu()

    def _shrink(self, state: _State, live: list[int], temperature: float, top_p: float, eos: int) -> _State:
        """The pool's tail: its `live` slots moved into the first slots of a pool of the smallest bucket that holds
        them (its own graph), so the last long samples stop paying for a full pool's decode step."""
        length, n = state.valid.shape[1], state.out_tokens.shape[1] - 1
        small = self._state(graph_key((len(live), length - n), n, temperature, top_p, eos))  # the same cache length
        moved = torch.tensor(live, device=self.device)
        into = slice(0, len(live))
        for name in ("keys", "values"):
            for target, source in zip(getattr(small, name), getattr(state, name)):
                target[into] = source[moved]
        for name in ("logits", "position", "write", "step", "key", "valid", "done", "out_tokens", "out_logps"):
            getattr(small, name)[into] = getattr(state, name)[moved]
        small.done[len(live):] = True
        return small

    def _start(self, state: _State, prompts: _Prompts, keys: Tensor, slots: list[int], first: int) -> None:
        """Start samples first, first + 1, ... in `slots`: their prompt's K/V and first logits, fresh counters."""
        dev = self.device
        slot = torch.tensor(slots, device=dev)
        sample = torch.arange(first, first + len(slots), device=dev)
        prompt = prompts.index[sample]
        width = prompts.mask.shape[1]
        for cache, store in zip(state.keys + state.values, prompts.keys + prompts.values):
            cache[slot, :, :width] = store[prompt]
        state.logits[slot] = prompts.logits[prompt]
        valid = torch.zeros(len(slots), state.valid.shape[1], dtype=torch.bool, device=dev)
        valid[:, :width] = prompts.mask[prompt]
        state.valid[slot] = valid
        state.position[slot] = prompts.next_position[prompt]
        state.write[slot] = width
        state.step[slot] = 0
        state.key[slot] = keys[sample]
        state.done[slot] = False

    @staticmethod
    def _harvest(state: _State, slots: list[int], samples: list[int], tokens: Tensor, logps: Tensor, lengths: Tensor,
                 eos: int) -> None:
        """Copy ended slots' samples out (columns past a sample's end hold an earlier occupant's tokens: masked)."""
        slot = torch.tensor(slots, device=tokens.device)
        sample = torch.tensor(samples, device=tokens.device)
        n = tokens.shape[1]
        steps = state.step[slot]
        kept = torch.arange(n, device=tokens.device) < steps[:, None]
        tokens.index_copy_(0, sample, torch.where(kept, state.out_tokens[slot, :n], eos))
        logps.index_copy_(0, sample, torch.where(kept, state.out_logps[slot, :n], 0.0))
        lengths.index_copy_(0, sample, steps)

    def _prefill(self, input_ids: Tensor, attention_mask: Tensor) -> _Prompts:
        """Each distinct prompt of the batch through the decoder once (identical left-padded rows are one prompt)."""
        rows, width = input_ids.shape
        mask = attention_mask.long()
        if self.share_prefill:
            distinct, index = torch.unique(torch.cat([input_ids, mask], dim=1), dim=0, return_inverse=True)
            ids, mask = distinct[:, :width], distinct[:, width:]
        else:
            ids, index = input_ids, torch.arange(rows, device=input_ids.device)
        count = ids.shape[0]
        keys, values = self.decoder.new_cache(count, width, self.device)
        logits = torch.empty(count, self.decoder.vocab_size, dtype=self.decoder.dtype, device=self.device)
        positions = position_ids(mask)
        valid = mask.bool()
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        slots = torch.arange(width, device=self.device)
        for start in range(0, count, PREFILL_ROWS):
            part = slice(start, start + PREFILL_ROWS)
            logits[part] = self.decoder.forward(ids[part], positions[part], slots, causal & valid[part, None, :],
                                                [k[part] for k in keys], [v[part] for v in values])
        return _Prompts(keys, values, logits, valid, positions[:, -1] + 1, index.to(self.device))

    def _state(self, key: tuple) -> _State:
        pointers = self.decoder.weight_pointers()
        if pointers != self._pointers:  # a weight was re-allocated: captured graphs read stale memory
            self._states.clear()
            self._pointers = pointers
        bucket, length, max_new_tokens, temperature, top_p, eos = key
        if key in self._states:
            return self._states[key]
        dev = self.device
        keys, values = self.decoder.new_cache(bucket, length, dev)

        def rows(dtype=torch.long, columns=()):
            return torch.zeros(bucket, *columns, dtype=dtype, device=dev)

        state = _State(keys=keys, values=values, logits=rows(self.decoder.dtype, (self.decoder.vocab_size,)),
                       position=rows(), write=rows(), step=rows(), key=rows(), valid=rows(torch.bool, (length,)),
                       done=torch.ones(bucket, dtype=torch.bool, device=dev),
                       out_tokens=rows(torch.long, (max_new_tokens + 1,)),
                       out_logps=rows(torch.float32, (max_new_tokens + 1,)))
        if self.use_graphs:
            state.graph = self._capture(state, temperature, top_p, eos, warm_up=key not in self._warmed)
            self._warmed.add(key)
        self._states[key] = state
        return state

    def _capture(self, state: _State, temperature: float, top_p: float, eos: int, warm_up: bool):
        """Capture one decode step; the first time for a shape, warm up on a side stream before (compilation,
        cuBLAS workspaces)."""
        if warm_up:
            self._warm_up(state, temperature, top_p, eos)
        graph = torch.cuda.CUDAGraph()
        if self._capture_stream is None:  # on the sampler's device, not the (process-wide) default one
            self._capture_stream = torch.cuda.Stream(self.device)
        with torch.cuda.graph(graph, stream=self._capture_stream):
            self._step(state, temperature, top_p, eos)
        return graph

    def _warm_up(self, state: _State, temperature: float, top_p: float, eos: int) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            try:
                self._step(state, temperature, top_p, eos)
            except Exception as err:  # noqa: BLE001 - e.g. no working compiler for Triton kernels
                if not self.compiled:
                    raise
                warnings.warn(f"rlspec: torch.compile of the decode blocks failed ({type(err).__name__}: {err}); "
                              "decoding with the plain blocks")
                self.compiled = False
                self.decoder.uncompile_blocks()
            for _ in range(2):
                self._step(state, temperature, top_p, eos)
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _step(self, state: _State, temperature: float, top_p: float, eos: int) -> None:
        """Sample from `state.logits`, record, then run the decoder on the sampled tokens (graph body). Ended
        slots ride along: their token is `eos`, their counters stay, their record goes to the spare column."""
        last = state.out_tokens.shape[1] - 1
        token, logp = sample_from_logits(state.logits, temperature, top_p, state.key, state.step, self.decoder.race,
                                         self.decoder.noise)
        live = ~state.done
        token = torch.where(live, token, eos)
        column = torch.where(live, state.step, last)[:, None]
        state.out_tokens.scatter_(1, column, token[:, None])
        state.out_logps.scatter_(1, column, logp[:, None])
        state.done.logical_or_((token == eos) | (state.step >= last - 1))
        slot = state.write.clamp(max=state.valid.shape[1] - 1)[:, None]
        state.valid.scatter_(1, slot, True)
        state.logits.copy_(self.decoder.forward(token[:, None], state.position[:, None], slot, state.valid[:, None, :],
                                                state.keys, state.values, compiled=self.compiled))
        advance = live.long()
        state.position.add_(advance)
        state.write.add_(advance)
        state.step.add_(advance)
