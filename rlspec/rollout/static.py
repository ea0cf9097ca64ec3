"""The `hf` engine's CUDA path: a static KV cache and a decode step captured in CUDA graphs.

`StaticDecoder` is a small forward pass for Llama-style decoders (Qwen2, Llama, Mistral without a
sliding window) that reads the transformers module's own weight tensors — weights still arrive by HF
name through `HFEngine.load_weights`, and a colocated trainer's in-place optimizer steps are seen
directly. Without `sdpa` its attention follows transformers' eager attention (scores in the model dtype,
softmax in fp32); with it (the CUDA default) it is `scaled_dot_product_attention`; either way the engine's
log-probs agree with the trainer's within bf16 rounding (`tests/test_gpu.py`). On CUDA it also runs each
layer's q/k/v and gate/up projections as one GEMM each, over fused copies refreshed before every batch
(`fuse_weights`), and compiles one function per decoder layer.

`GraphSampler` runs one rollout batch:

    prefill (row chunks, eager) -> logits
    repeat max_new_tokens times:  [one CUDA graph replay]
        top_p = 1: token = argmax(logits / T - log E), logp = logits[token] / T - logsumexp(logits / T)
        top_p < 1: logp = log_softmax(logits / T); token = argmax(top_p(exp(logp)) / E)      (E ~ Exp(1))
        finished rows emit the end token; record token and logp[token]
        write K/V of `token` into the next cache slot; logits = forward(token)
    every `check_every` steps: stop if every row has finished (the only host sync)

`argmax(p_i / E_i)` with `E_i ~ Exp(1)` samples i with probability p_i / sum(p) (the exponential race),
which needs no data-dependent shapes, so sampling lives inside the graph. One graph is captured per
(batch bucket, cache length bucket): a batch is padded up to the next power of two with finished dummy
rows, and the cache length is rounded up to a multiple of `CACHE_STEP`. Without CUDA (`use_graphs=False`)
the same step function runs eagerly, which is how the CPU tests check its logic.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.batch import position_ids
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
        self.race = None  # the compiled `exponential_race`, with the compiled blocks
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

    def uncompile_blocks(self) -> None:
        self._compiled = None
        self.race = None

    def _blocks(self):
        return self._qkv, self._attention_block, self._mlp_block

    def _layer(self, x: Tensor, weights: tuple, k_cache: Tensor, v_cache: Tensor, slots: Tensor, allowed: Tensor,
               cos: Tensor, sin: Tensor, blocks=None) -> Tensor:
        """One decoder layer; its K/V go to cache `slots`. `weights` from `_layer_weights`."""
        qkv, attention, mlp = blocks or self._blocks()
        norm1, qkv_weights, wo, bo, norm2, mlp_weights = weights
        q, k, v = qkv(x, norm1, qkv_weights, cos, sin)
        k_cache.index_copy_(2, slots, k)
        v_cache.index_copy_(2, slots, v)
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
        """Logits [b, V] of the last of `ids` [b, T]; K/V of all T tokens go to cache `slots` [T].

        `compiled` uses the torch.compile'd layers or blocks (decode steps: one shape per graph); prefill
        shapes vary with the prompt width, so prefill runs the plain ones.
        """
        run = self._compiled if compiled and self._compiled is not None else self._layer
        body = self.model.model
        x = body.embed_tokens(ids)
        cos, sin = self._rope(positions, x.dtype)
        cos, sin = cos[:, None], sin[:, None]
        for index, (layer, k_cache, v_cache) in enumerate(zip(body.layers, keys, values)):
            x = run(x, self._layer_weights(index, layer), k_cache, v_cache, slots, allowed, cos, sin)
        x = self._rms_norm(x[:, -1], body.norm.weight)
        return F.linear(x, self.model.get_output_embeddings().weight)


def sample_from_logits(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator,
                       race=None) -> tuple[Tensor, Tensor]:
    """One token per row and its log-probability under the full softmax at `temperature` (the trainer's
    definition, before top-p).

    The exponential race `argmax(p / E)`, `E ~ Exp(1)` i.i.d., picks i with probability p_i / sum(p): a
    categorical sample with static shapes and no host sync. Without top-p it is `argmax(logits / T - log E)`
    (`race`, which a caller may pass compiled: one pass over the logits and the noise, no [B, V] softmax).
    """
    noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_(generator=generator)
    if top_p >= 1.0:
        return (race or exponential_race)(logits, noise, temperature)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    token = torch.argmax(top_p_filter(logp.exp(), top_p) / noise, dim=-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def exponential_race(logits: Tensor, noise: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """`argmax(softmax(logits / T) / noise)` and the winner's log-probability, without forming the softmax."""
    scaled = logits.float() / temperature
    token = torch.argmax(scaled - noise.log(), dim=-1)
    logp = scaled.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    return token, logp


def graph_key(shape: tuple[int, int], max_new_tokens: int, temperature: float, top_p: float, eos: int) -> tuple:
    """The (batch bucket, cache length, sampling settings) a [rows, prompt width] batch is captured under."""
    rows, width = shape
    bucket = next(b for b in BATCH_BUCKETS if b >= rows)
    length = math.ceil((width + max_new_tokens) / CACHE_STEP) * CACHE_STEP
    return bucket, length, max_new_tokens, temperature, top_p, eos


@dataclass
class _State:
    """Static buffers of one (batch bucket, cache length) graph; replays read and write only these."""

    keys: list[Tensor]
    values: list[Tensor]
    logits: Tensor       # [B, V] next-token logits
    position: Tensor     # [B] RoPE position of the next token
    slot: Tensor         # [1] cache slot of the next token (shared by all rows)
    step: Tensor         # [1] output column of the next sample
    valid: Tensor        # [B, S] cache slots holding a real token
    done: Tensor         # [B] row has emitted the end token (or is a dummy row)
    out_tokens: Tensor   # [B, N]
    out_logps: Tensor    # [B, N]
    graph: object = None


class GraphSampler:
    """Samples a rollout batch with a `StaticDecoder`, one CUDA graph replay per token."""

    def __init__(self, model: torch.nn.Module, device: torch.device, use_graphs: bool | None = None,
                 compile_blocks: bool | None = None, check_every: int = 8, keep_graphs: bool = False,
                 fuse_weights: bool | None = None, sdpa: bool | None = None, compile_layers: bool | None = None) -> None:
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
        # Dropping the graphs (their KV cache and memory pool) after each batch gives that memory back to a
        # colocated trainer; a later capture of a seen shape skips warm-up and costs a few milliseconds.
        self.keep_graphs = keep_graphs
        self.generator = torch.Generator(device=self.device)
        self._capture_stream = None
        self._states: dict[tuple, _State] = {}
        self._pointers: tuple[int, ...] = ()
        self._warmed: set[tuple] = set()

    @torch.no_grad()
    def sample(self, input_ids: Tensor, attention_mask: Tensor, seed: int, max_new_tokens: int,
               temperature: float, top_p: float, eos: int) -> tuple[Tensor, Tensor]:
        """[B, T] tokens and log-probs on CPU, T <= max_new_tokens; ended rows carry `eos` onward (as `HFEngine`).

        On CUDA everything runs with the sampler's device as the calling thread's current device: a capture
        records only the current device's capture stream, so kernels of a model on another device (a rollout
        server on cuda:1, called from a worker thread whose current device is cuda:0) would run uncaptured
        while the generator is in capture mode ("Offset increment outside graph capture").
        """
        if self.device.type != "cuda":
            return self._sample(input_ids, attention_mask, seed, max_new_tokens, temperature, top_p, eos)
        with torch.cuda.device(self.device):
            return self._sample(input_ids, attention_mask, seed, max_new_tokens, temperature, top_p, eos)

    def _sample(self, input_ids: Tensor, attention_mask: Tensor, seed: int, max_new_tokens: int,
                temperature: float, top_p: float, eos: int) -> tuple[Tensor, Tensor]:
        rows = input_ids.shape[0]
        limit = BATCH_BUCKETS[-1]
        if self.fuse:
            self.decoder.fuse_weights()
        parts = [self._sample_rows(input_ids[s:s + limit], attention_mask[s:s + limit], seed + s, max_new_tokens,
                                   temperature, top_p, eos) for s in range(0, rows, limit)]
        width = max(t.shape[1] for t, _ in parts)
        tokens = torch.cat([F.pad(t, (0, width - t.shape[1]), value=eos) for t, _ in parts])
        logps = torch.cat([F.pad(lp, (0, width - lp.shape[1])) for _, lp in parts])
        if not self.keep_graphs:
            self._states.clear()
            self.decoder.unfuse_weights()
        return tokens, logps

    def _sample_rows(self, input_ids: Tensor, attention_mask: Tensor, seed: int, max_new_tokens: int,
                     temperature: float, top_p: float, eos: int) -> tuple[Tensor, Tensor]:
        rows = input_ids.shape[0]
        state = self._state(graph_key(input_ids.shape, max_new_tokens, temperature, top_p, eos))
        self.generator.manual_seed(seed)  # after a capture, whose warm-up steps draw from the generator
        self._prefill(state, input_ids, attention_mask, rows)
        steps = 0
        for steps in range(1, max_new_tokens + 1):
            if state.graph is not None:
                state.graph.replay()
            else:
                self._step(state, temperature, top_p, eos)
            if steps % self.check_every == 0 and bool(state.done.all()):
                break
        return state.out_tokens[:rows, :steps].cpu(), state.out_logps[:rows, :steps].float().cpu()

    def _state(self, key: tuple) -> _State:
        pointers = self.decoder.weight_pointers()
        if pointers != self._pointers:  # a weight was re-allocated: captured graphs read stale memory
            self._states.clear()
            self._pointers = pointers
        if key in self._states:
            return self._states[key]
        bucket, length, max_new_tokens, temperature, top_p, eos = key
        dev = self.device
        keys, values = self.decoder.new_cache(bucket, length, dev)
        state = _State(keys=keys, values=values,
                       logits=torch.zeros(bucket, self.decoder.vocab_size, dtype=self.decoder.dtype, device=dev),
                       position=torch.zeros(bucket, dtype=torch.long, device=dev),
                       slot=torch.zeros(1, dtype=torch.long, device=dev),
                       step=torch.zeros(1, dtype=torch.long, device=dev),
                       valid=torch.zeros(bucket, length, dtype=torch.bool, device=dev),
                       done=torch.ones(bucket, dtype=torch.bool, device=dev),
                       out_tokens=torch.zeros(bucket, max_new_tokens, dtype=torch.long, device=dev),
                       out_logps=torch.zeros(bucket, max_new_tokens, dtype=torch.float32, device=dev))
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
        graph.register_generator_state(self.generator)
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

    def _prefill(self, state: _State, input_ids: Tensor, attention_mask: Tensor, rows: int) -> None:
        """Prompts into the cache (slots 0..width-1) and the first logits; resets the step counters."""
        width = input_ids.shape[1]
        bucket, length = state.valid.shape
        ids = torch.zeros(bucket, width, dtype=torch.long, device=self.device)
        mask = torch.zeros(bucket, width, dtype=torch.long, device=self.device)
        ids[:rows], mask[:rows] = input_ids, attention_mask
        positions = position_ids(mask)
        state.valid.zero_()
        state.valid[:, :width] = mask.bool()
        causal = torch.ones(width, length, dtype=torch.bool, device=self.device).tril()
        slots = torch.arange(width, device=self.device)
        for start in range(0, bucket, PREFILL_ROWS):
            part = slice(start, min(start + PREFILL_ROWS, bucket))
            allowed = causal & state.valid[part, None, :]
            state.logits[part] = self.decoder.forward(
                ids[part], positions[part], slots, allowed,
                [k[part] for k in state.keys], [v[part] for v in state.values])
        state.position.copy_(positions[:, -1] + 1)
        state.slot.fill_(width)
        state.step.zero_()
        state.done.copy_(torch.arange(bucket, device=self.device) >= rows)

    def _step(self, state: _State, temperature: float, top_p: float, eos: int) -> None:
        """Sample from `state.logits`, record, then run the decoder on the sampled token (graph body)."""
        token, logp = sample_from_logits(state.logits, temperature, top_p, self.generator, self.decoder.race)
        token = torch.where(state.done, torch.full_like(token, eos), token)
        state.out_tokens.index_copy_(1, state.step, token[:, None])
        state.out_logps.index_copy_(1, state.step, logp[:, None])
        state.done.logical_or_(token == eos)
        state.valid.index_fill_(1, state.slot, True)
        allowed = state.valid[:, None, :]
        state.logits.copy_(self.decoder.forward(token[:, None], state.position[:, None], state.slot, allowed,
                                                state.keys, state.values, compiled=self.compiled))
        state.position.add_(1)
        state.slot.add_(1)
        state.step.add_(1)
