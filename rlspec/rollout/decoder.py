"""`StaticDecoder`: the forward pass the CUDA-graph sampler (`rlspec.rollout.static`) runs.

A small forward for the decoders of `rlspec.rollout.architecture` (Llama-style: Qwen2, Llama, Mistral; Qwen3;
Gemma 2 and 3; its docstring lists what differs between them) that reads the transformers module's own weight
tensors — weights still arrive by HF name through `HFEngine.load_weights`,
and a colocated trainer's in-place optimizer steps are seen directly. Without `sdpa` its attention follows
transformers' eager attention (scores in the model dtype, softmax in fp32); with it (the CUDA default) it is
`scaled_dot_product_attention`, and a decode step (one token a row) on CUDA attends with the Triton kernel of
`live_attention` over each row's reached positions only; either way the engine's log-probs agree with the
trainer's within bf16 rounding (`tests/test_gpu.py`); that kernel also applies RoPE to the step's q and k and
writes the new K/V into the cache (`live_attention_rope`). Decode steps of up to `SKINNY_ROWS` rows run the
q/k/v (its parts added by the attention kernel), output and down projections with the split-K `skinny_linear`.
On CUDA it also runs each layer's q/k/v and gate/up projections as one GEMM each, over fused copies refreshed
before every batch (`fuse_weights`), and compiles one function per decoder layer (and the work before the first
layer and after the last); decode steps of up to `GATED_MLP_ROWS` rows run the gate/up GEMM and silu(gate) * up as
one Triton kernel, `gated_mlp`.

`forward` ends with the final norm and the LM head (logits), or, `head=False`, with the final-normed hidden of the
last position: the sampler keeps that and samples from it (`sampling.sample_from_hidden`), on CUDA without top-p
with the head GEMM and the race fused in one Triton kernel (`sampled_head`: no [rows, V] logits are written).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..core.packing import packed_causal_mask, varlen_causal, varlen_usable
from . import gated_mlp as gated
from . import live_attention as live
from . import sampled_head as head_kernel
from .architecture import architecture, rope_attributes
from .architecture import unsupported_reason  # noqa: F401 - callers ask here whether the decoder runs a model
from .noise import keyed_exponential
from .sampling import exponential_race
from .skinny_linear import skinny_linear

SKINNY_ROWS = 64  # decode steps of at most this many rows run the output and down projections split-K
GATED_MLP_ROWS = SKINNY_ROWS  # ... and gate/up with silu(gate) * up in one kernel (`gated_mlp`)

PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""SDPA's kernels for a prefill (rows of several tokens, the eager forward) on CUDA: not cuDNN's, which builds an
execution plan for every new shape (an H100 took ~70 ms for each new number of rows or prompt width: a serving pool's
admissions come in any number of rows, and a rollout's prompts in any width), where these kernels run any shape at
once."""


@dataclass(frozen=True)
class Packed:
    """A packed prefill's attention (`forward(packed=...)`): prompts one after another in one row, `offsets` [n + 1]
    int32 their starts and the end (what varlen kernels take), `longest` an upper bound on a prompt's tokens.

    An extension (prompts that each continue a sequence whose K/V are in the cache already) also gives `key_offsets`
    [n + 1]: sequence i's keys are cache positions `key_offsets[i]` to `key_offsets[i + 1]`, its queries the last
    of them (causal, aligned to the end: query j of m sees every key up to the (m - j)-th from its sequence's end);
    `key_longest` bounds a sequence's keys."""

    offsets: Tensor
    longest: int
    key_offsets: Tensor | None = None
    key_longest: int = 0


LIVE_HEAD_DIM_MAX = 128
"""`live_attention` runs head dims up to this (the sizes its tiles were measured at); wider heads (Gemma 3's 256)
attend with SDPA."""


class StaticDecoder:
    """Forward pass over the HF module's weights, writing K/V into caller-owned static caches."""

    def __init__(self, model: torch.nn.Module, sdpa: bool = False, live_attention: bool | None = None,
                 skinny: bool | None = None, gated_mlp: bool | None = None,
                 sampled_head: bool | None = None, rope_attention: bool | None = None,
                 skinny_qkv: bool | None = None) -> None:
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"StaticDecoder cannot run this model: {reason}")
        config = model.config
        self.model = model
        self.arch = arch = architecture(model)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = arch.scaling
        self.eps = config.rms_norm_eps
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        # One RoPE per distinct layer type (Gemma 3: local and global bases), computed once per forward.
        kinds = tuple(dict.fromkeys(arch.layer_types))
        self._ropes = tuple(rope_attributes(model.model, kind) for kind in kinds)
        self._rope_index = tuple(kinds.index(t) for t in arch.layer_types)
        self._embed_scale = (None if arch.embed_scale is None
                             else float(torch.tensor(arch.embed_scale, dtype=self.dtype)))  # as transformers rounds it
        # SDPA and `live_attention` take no soft-capping of the scores (Gemma 2): the eager attention does it.
        self.sdpa = sdpa and arch.attn_softcap is None
        device = model.get_input_embeddings().weight.device
        usable = (live.available(self.head_dim, device) and self.head_dim <= LIVE_HEAD_DIM_MAX
                  and arch.attn_softcap is None)
        if live_attention and not usable:
            raise ValueError("live_attention needs Triton, a CUDA model, a power-of-two head dim of at most "
                             f"{LIVE_HEAD_DIM_MAX} and no soft-capped attention")
        # Decode steps (one token a row, given the rows' cache lengths) attend with `live_attention`: only the
        # positions each row has reached are read, instead of SDPA over the whole cache.
        self.live_attention = (usable and sdpa) if live_attention is None else live_attention
        # ... and, at up to `SKINNY_ROWS` rows, run the output and down projections with `skinny_linear` (split-K)
        # instead of cuBLAS, whose few output tiles leave most SMs idle. Their parts' sum fuses into the residual
        # add and the next norm. q/k/v is split only where the attention kernel adds its parts (`skinny_qkv` below):
        # read by the compiled cache write and the attention op, its sum became a kernel of its own and cost more
        # than the split gained. Gate/up is not split (wide enough as it is).
        self.skinny = (live.triton_runs_on(device) and sdpa) if skinny is None else skinny
        # ... and, with fused q/k/v weights, take the projection's output as it is: the RoPE of q and of the new k,
        # the new K/V's cache writes and the attention in one kernel (`live_attention_rope`), where the compiled
        # layer ran two element-wise kernels (q's rotation; k's rotation with both cache writes) before it.
        # (Not with q/k norms, which come between the projection and RoPE: those layers rotate in the compiled layer.)
        if rope_attention and not (self.live_attention and not arch.qk_norm):
            raise ValueError("rope_attention needs live_attention and a model without q/k norms")
        self.rope_attention = self.live_attention and not arch.qk_norm if rope_attention is None else rope_attention
        # ... and, at up to `SKINNY_ROWS` rows, that q/k/v projection split-K too: the attention kernel adds its
        # parts (and the bias), so the split costs no kernel of its own there.
        if skinny_qkv and not self.rope_attention:
            raise ValueError("skinny_qkv needs rope_attention")
        self.skinny_qkv = self.rope_attention and self.skinny if skinny_qkv is None else skinny_qkv
        # ... and, at up to `GATED_MLP_ROWS` rows with fused weights, run gate/up and silu(gate) * up as one kernel
        # (`gated_mlp`: the SiLU gate in the GEMM's epilogue) instead of a cuBLAS GEMM and an element-wise kernel.
        if gated_mlp and not (gated.available(device) and arch.activation == "silu"):
            raise ValueError("gated_mlp needs Triton and a CUDA model, and a SiLU gate")
        self.gated_mlp = (gated.available(device) and sdpa and arch.activation == "silu") if gated_mlp is None else gated_mlp
        # Sampling without top-p (`sampling.sample_from_hidden`) runs the head GEMM and the race as one kernel
        # (`sampled_head`) where Triton runs on CUDA; False forms the logits and races them as before.
        # (Not with soft-capped logits, Gemma 2's: the kernel races the head's plain output.)
        if sampled_head and not (head_kernel.available(device) and arch.final_softcap is None):
            raise ValueError("sampled_head needs Triton and a CUDA model, and logits without soft-capping")
        self.sampled_head = (head_kernel.available(device) and arch.final_softcap is None
                             if sampled_head is None else sampled_head)
        self._compiled = None
        self.race = None  # the compiled `exponential_race` and `keyed_exponential`, with the compiled blocks
        self.noise = None
        self._fused: list[tuple[Tensor, Tensor | None, Tensor]] | None = None
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self._qkv_sizes = (q_size, kv_size, kv_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def head_weight(self) -> Tensor:
        """The LM head's weight [V, H] (the input embedding's, when tied)."""
        return self.model.get_output_embeddings().weight

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

    def _linear_parts(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """`F.linear` as parts to add (`_summed`): for a decode step's few rows (x [b, 1, in], b <= `SKINNY_ROWS`)
        the split-K parts of `skinny_linear` [splits, b, 1, out] in fp32, else F.linear's output as the one part,
        so that the sum fuses into the compiled kernel that reads it next."""
        if self.skinny and x.dim() == 3 and x.shape[1] == 1 and x.shape[0] <= SKINNY_ROWS:
            return skinny_linear(x, weight, bias)
        return F.linear(x, weight, bias)[None]

    @staticmethod
    def _summed(parts: Tensor, dtype: torch.dtype) -> Tensor:
        """`_linear_parts`'s parts summed, in `dtype`; one part is taken as it is (no copy on the eager prefill path).

        Added part by part (element-wise adds, in order), not `.sum(0)`: Inductor fuses element-wise work into the
        norm that reads the result next, where a reduction over the parts became a kernel of its own whenever
        that norm's reduction followed inside the same compiled layer (the output projection's sum, 2.7 us a
        layer on an H100)."""
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total.to(dtype)

    def _rms_norm(self, x: Tensor, weight: Tensor) -> Tensor:
        """RMSNorm over the last dim: `w * x_normed.to(dtype)`, or Gemma's `(x_normed * (1 + w)).to(dtype)` in fp32."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.arch.offset_norm:
            return (x * (1.0 + weight.float())).to(dtype)
        return weight * x.to(dtype)

    def _rope(self, positions: Tensor, dtype: torch.dtype, names: tuple[str, str, str]) -> tuple[Tensor, Tensor]:
        rotary = getattr(self.model.model, names[0])
        inv_freq, scale = getattr(rotary, names[1]), getattr(rotary, names[2])
        freqs = positions[..., None].float() * inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def logits(self, hidden: Tensor) -> Tensor:
        """The LM head on final-normed `hidden`, soft-capped where the model caps its logits (Gemma 2)."""
        logits = F.linear(hidden, self.head_weight)
        return softcapped(logits, self.arch.final_softcap)

    @staticmethod
    def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def attention_mask(self, allowed: Tensor, lengths: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """What `_attend` takes for `allowed` [b, T, S] (bool): itself, or with SDPA an additive [b, 1, T, S] mask in
        the model dtype (0 or the dtype's min), made once per forward rather than once per layer: from a bool mask
        the compiled SDPA built the additive one in every layer (two extra kernels a layer in a decode step).
        A decode step (T = 1) that gives each row's `lengths` (no position at or past it is allowed) takes
        (allowed as uint8 [b, S], lengths) for `live_attention`, when the decoder uses it."""
        if lengths is not None and self.live_attention and allowed.shape[1] == 1:
            return allowed[:, 0].view(torch.uint8), lengths
        if not self.sdpa:
            return allowed
        blocked = torch.finfo(self.dtype).min  # not -inf: a row with nothing allowed (an empty slot) stays finite
        return torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill_(~allowed, blocked)[:, None]

    def _attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | tuple[Tensor, Tensor]) -> Tensor:
        """q [b, H, T, D] against the cache [b, Hkv, S, D]; `mask` from `attention_mask`.

        Query heads are grouped onto their shared K/V head with a reshape, not a copy of the cache.
        """
        b, _, t, d = q.shape
        if isinstance(mask, Packed):  # one row [1, H, T, D]: each prompt's causal block alone
            q, keys, values = (z[0].transpose(0, 1).contiguous() for z in (q, keys, values))
            return varlen_causal(q, keys, values, mask.offsets, mask.longest, self.scaling, mask.key_offsets,
                                 mask.key_longest).transpose(0, 1)[None]
        if isinstance(mask, tuple):
            return live.live_attention(q, keys, values, *mask, self.scaling)
        if self.sdpa:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=True)
        groups = self.num_heads // self.num_kv_heads
        q = q.reshape(b, self.num_kv_heads, groups * t, d)
        scores = softcapped(torch.matmul(q, keys.transpose(2, 3)) * self.scaling, self.arch.attn_softcap)
        scores = scores.view(b, self.num_kv_heads, groups, t, -1)
        scores = scores.masked_fill(~mask[:, None, None], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs.view(b, self.num_kv_heads, groups * t, -1), values)
        return out.view(b, self.num_heads, t, d)

    def _qkv(self, x: Tensor, norm: Tensor, weights: tuple, cos: Tensor, sin: Tensor,
             qk_norms: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """`weights`: (wq, bq, wk, bk, wv, bv), or the fused (wqkv, bqkv); `qk_norms`: the per-head norms' weights of
        q and k (Qwen3, Gemma 3), applied before RoPE."""
        b, t, _ = x.shape
        h = self._rms_norm(x, norm)
        if len(weights) == 2:
            q, k, v = F.linear(h, *weights).split(self._qkv_sizes, dim=-1)
        else:
            wq, bq, wk, bk, wv, bv = weights
            q, k, v = F.linear(h, wq, bq), F.linear(h, wk, bk), F.linear(h, wv, bv)
        q, k, v = (z.reshape(b, t, -1, self.head_dim) for z in (q, k, v))
        if qk_norms is not None:
            q, k = self._rms_norm(q, qk_norms[0]), self._rms_norm(k, qk_norms[1])
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin), v

    def _attention_block(self, x: Tensor, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, wo: Tensor,
                         bo: Tensor | None, post_norm: Tensor | None = None) -> Tensor:
        return self._attended(x, self._attend(q, keys, values, mask), wo, bo, post_norm)

    def _rope_attention_block(self, x: Tensor, norm: Tensor, weights: tuple, keys: Tensor, values: Tensor,
                              mask: tuple[Tensor, Tensor], slots: Tensor, cos: Tensor, sin: Tensor, wo: Tensor,
                              bo: Tensor | None, post_norm: Tensor | None = None) -> Tensor:
        """A decode step's attention block from the fused q/k/v GEMM's output (`weights`: (wqkv, bqkv)): RoPE, the
        new K/V's cache writes at `slots` [b, 1] and live attention as one kernel (`live_attention_rope`), which also
        adds the projection's split-K parts (`skinny_qkv`)."""
        b = x.shape[0]
        h = self._rms_norm(x, norm)
        if self.skinny_qkv and b <= SKINNY_ROWS:  # fp32 parts [P, b, N]; the kernel adds them and the bias
            qkv, bias = skinny_linear(h, weights[0])[:, :, 0], weights[1]
        else:
            qkv, bias = F.linear(h, *weights)[:, 0], None
        out = live.live_attention_rope(qkv, bias, cos.reshape(b, -1), sin.reshape(b, -1), keys, values, *mask,
                                       slots[:, 0], self.scaling, self.num_heads)
        return self._attended(x, out, wo, bo, post_norm)

    def _attended(self, x: Tensor, out: Tensor, wo: Tensor, bo: Tensor | None, post_norm: Tensor | None = None) -> Tensor:
        """The residual stream after the output projection of attention's `out` [b, H, T, D] (normed by
        `post_norm` before the add, where the model norms attention's output: Gemma)."""
        b, t, _ = x.shape
        out = self._summed(self._linear_parts(out.transpose(1, 2).reshape(b, t, -1), wo, bo), x.dtype)
        return x + (out if post_norm is None else self._rms_norm(out, post_norm))

    def _mlp_block(self, x: Tensor, norm: Tensor, weights: tuple, post_norm: Tensor | None = None) -> Tensor:
        """The MLP's output as parts [splits, b, T, hidden] to be summed (`_linear_parts`; the residual add is
        left to the caller), or, with `post_norm` (Gemma), as the one part of its normed sum. `weights`: (w_gate,
        w_up, w_down), or the fused (w_gate_up, w_down)."""
        h = self._rms_norm(x, norm)
        if len(weights) == 2 and self.gated_mlp and h.dim() == 3 and h.shape[1] == 1 and h.shape[0] <= GATED_MLP_ROWS:
            parts = self._linear_parts(gated.gated_mlp(h, weights[0]), weights[-1])
        else:
            if len(weights) == 2:
                gate, up = F.linear(h, weights[0]).chunk(2, dim=-1)
            else:
                gate, up = F.linear(h, weights[0]), F.linear(h, weights[1])
            act = F.silu(gate) if self.arch.activation == "silu" else F.gelu(gate, approximate="tanh")
            parts = self._linear_parts(act * up, weights[-1])
        if post_norm is None:
            return parts
        return self._rms_norm(self._summed(parts, x.dtype), post_norm)[None]

    def compile_blocks(self, layers: bool = False, autotune: bool = False, ends: bool = True) -> None:
        """Fuse the elementwise work (norms, RoPE, softmax, SiLU, residual adds) with torch.compile; shapes are
        static. `layers`: one compiled function per decoder layer (the K/V cache writes included, so fusion
        crosses the block boundaries), compiled once and reused by every layer; else one per block.
        `autotune`: let Inductor time its own GEMM kernels against cuBLAS for each shape (mode
        max-autotune-no-cudagraphs; minutes of compilation per pool size)."""
        mode = "max-autotune-no-cudagraphs" if autotune else None
        # Shapes are static, so each (pool bucket, cache length) compiles once: the tail's smaller pools and a few
        # prompt widths pass Dynamo's default limit of 8, past which the layer would silently run uncompiled.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        if layers:
            layer = torch.compile(self._layer, dynamic=False, mode=mode)
        else:
            blocks = tuple(torch.compile(f, dynamic=False, mode=mode) for f in self._blocks())
            layer = lambda *args: self._layer(*args, blocks=blocks)  # noqa: E731
        # `ends`: with the work before the first layer (embedding, RoPE) and after the last (final norm) compiled too
        self._compiled = ((layer, torch.compile(self._start, dynamic=False), torch.compile(self._end, dynamic=False))
                          if ends else (layer, self._start, self._end))
        self.race = torch.compile(exponential_race, dynamic=False)
        self.noise = torch.compile(keyed_exponential, dynamic=False)  # top-p < 1: one kernel, not ~30 over [B, V]

    def uncompile_blocks(self) -> None:
        self._compiled = None
        self.race = self.noise = None

    def _blocks(self):
        return self._qkv, self._attention_block, self._mlp_block, self._rope_attention_block

    def _layer(self, x: Tensor, delta: Tensor, weights: tuple, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
               mask: Tensor, cos: Tensor, sin: Tensor, blocks=None) -> tuple[Tensor, Tensor]:
        """One decoder layer on the residual stream `x` + `delta` (the last layer's MLP output as parts to sum,
        `_mlp_block`: added here so the sum and the add fuse into this layer's first norm); returns the stream after
        attention and this layer's MLP output (as parts). Its K/V go to cache `slots` [b, T] (each row its own).
        `weights` from `_layer_weights`."""
        qkv, attention, mlp, rope_attention = blocks or self._blocks()
        norm1, qkv_weights, wo, bo, norm2, mlp_weights, (qk_norms, post_attention, post_mlp) = weights
        x = x + self._summed(delta, x.dtype)
        if self.rope_attention and isinstance(mask, tuple) and len(qkv_weights) == 2:
            x = rope_attention(x, norm1, qkv_weights, k_cache, v_cache, mask, slots, cos, sin, wo, bo, post_attention)
            return x, mlp(x, norm2, mlp_weights, post_mlp)
        q, k, v = qkv(x, norm1, qkv_weights, cos, sin, qk_norms)
        # An indexed store, not scatter_: compiled, scatter_ became a scatter into a copy of the whole cache and a
        # copy back (two full-cache passes per layer and cache); index_put_ writes only the new positions in place.
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        k_cache[rows, :, slots] = k.transpose(1, 2)
        v_cache[rows, :, slots] = v.transpose(1, 2)
        x = attention(x, q, k_cache, v_cache, mask, wo, bo, post_attention)
        return x, mlp(x, norm2, mlp_weights, post_mlp)

    def _layer_weights(self, index: int, layer) -> tuple:
        """(input norm, q/k/v, o weight, o bias, MLP input norm, MLP, (q/k norms, attention output norm, MLP output
        norm)), the last three None where the model has none."""
        attn, ffn = layer.self_attn, layer.mlp
        if self._fused is not None:
            wqkv, bqkv, w_gate_up = self._fused[index]
            qkv, mlp = (wqkv, bqkv), (w_gate_up, ffn.down_proj.weight)
        else:
            qkv = (attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight, attn.k_proj.bias, attn.v_proj.weight,
                   attn.v_proj.bias)
            mlp = (ffn.gate_proj.weight, ffn.up_proj.weight, ffn.down_proj.weight)
        qk_norms = (attn.q_norm.weight, attn.k_norm.weight) if self.arch.qk_norm else None
        if self.arch.sandwich:  # Gemma: post_attention_layernorm norms attention's output, not the MLP's input
            norms = (layer.pre_feedforward_layernorm.weight,
                     (qk_norms, layer.post_attention_layernorm.weight, layer.post_feedforward_layernorm.weight))
        else:
            norms = (layer.post_attention_layernorm.weight, (qk_norms, None, None))
        return (layer.input_layernorm.weight, qkv, attn.o_proj.weight, attn.o_proj.bias, norms[0], mlp, norms[1])

    def forward(self, ids: Tensor, positions: Tensor, slots: Tensor, allowed: Tensor,
                keys: list[Tensor], values: list[Tensor], compiled: bool = False,
                lengths: Tensor | None = None, head: bool = True, last: Tensor | None = None,
                packed: Packed | None = None) -> Tensor:
        """Logits [b, V] of the last of `ids` [b, T] (`head=False`: its final-normed hidden [b, H] in the model
        dtype, which `sampling.sample_from_hidden` samples from); K/V of all T tokens go to cache `slots`: [T] (the
        same for every row) or [b, T] (each row its own, as the continuous-batching decode step writes). `lengths`
        [b] (decode steps): no cache position at or past a row's length is allowed, so attention may stop there.
        `last` [b] (a right-padded prefill): each row's logits or hidden at that position instead of the last.
        `packed` (a packed prefill: `ids` [1, T] several prompts one after another, `positions` each token's own
        in its prompt, `last` [n] the prompts' last tokens, `allowed` None): each prompt attends to its own tokens
        only, with torch's varlen kernel where `varlen_prefill` says so, else under the block-diagonal causal mask.

        `compiled` uses the torch.compile'd layers or blocks (decode steps: one shape per graph); prefill
        shapes vary with the prompt width, so prefill runs the plain ones.
        """
        compiled = compiled and self._compiled is not None
        run, start, end = self._compiled if compiled else (self._layer, self._start, self._end)
        if packed is not None and not self.varlen_prefill(ids.device):
            allowed = packed_causal_mask(packed.offsets, ids.shape[1], packed.key_offsets, keys[0].shape[2])[None]
            packed = None
        prefill = not compiled and self.sdpa and ids.is_cuda and ids.shape[1] > 1
        with sdpa_kernel(PREFILL_ATTENTION) if prefill else contextlib.nullcontext():
            return self._forward(run, start, end, ids, positions, slots, allowed, keys, values, lengths, head, last,
                                 packed)

    def varlen_prefill(self, device) -> bool:
        """A packed prefill on `device` attends with torch's varlen flash kernel: CUDA, 16 bits, SDPA, torch >=
        2.10, and a model whose attention it computes (no soft-capped scores, no sliding window)."""
        return (self.sdpa and torch.device(device).type == "cuda" and self.dtype in (torch.float16, torch.bfloat16)
                and varlen_usable() and self.arch.sliding_window is None)

    def _forward(self, run, start, end, ids: Tensor, positions: Tensor, slots: Tensor, allowed: Tensor,
                 keys: list[Tensor], values: list[Tensor], lengths: Tensor | None, head: bool,
                 last: Tensor | None, packed: Packed | None = None) -> Tensor:
        body = self.model.model
        if slots.dim() == 1:
            slots = slots.expand(ids.shape[0], -1)
        masks = [packed if packed is not None else self.attention_mask(allowed, lengths)]
        if self.arch.sliding_window is not None and packed is None:
            masks.append(self.attention_mask(self.windowed(allowed, slots), lengths))
        sliding = self.arch.sliding
        x, delta, ropes = start(ids, positions)
        for index, (layer, k_cache, v_cache) in enumerate(zip(body.layers, keys, values)):
            cos, sin = ropes[self._rope_index[index]]
            x, delta = run(x, delta, self._layer_weights(index, layer), k_cache, v_cache, slots,
                           masks[int(sliding[index])], cos, sin)
        if last is not None:  # `end` takes the last position: each row's own last token's, then
            rows = torch.arange(x.shape[0], device=x.device)
            x, delta = x[rows, last][:, None], delta[:, rows, last][:, :, None]
        x = end(x, delta, body.norm.weight)
        return self.logits(x) if head else x

    def windowed(self, allowed: Tensor, slots: Tensor) -> Tensor:
        """`allowed` [b, T, S] of a sliding-window layer: also no key `sliding_window` or more cache slots before the
        query's (`slots` [b, T]): a row's slots and positions differ by its left padding alone, so this is
        transformers' `kv_idx > q_idx - sliding_window`."""
        keys = torch.arange(allowed.shape[-1], device=allowed.device)
        return allowed & (keys > slots[..., None] - self.arch.sliding_window)

    def _start(self, ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, tuple[tuple[Tensor, Tensor], ...]]:
        """The embedded tokens, a zero MLP delta for the first layer, and the RoPE (cos, sin) [b, 1, T, D] of each
        distinct layer type."""
        x = self.model.model.embed_tokens(ids)
        if self._embed_scale is not None:
            x = x * self._embed_scale
        ropes = tuple((cos[:, None], sin[:, None]) for cos, sin in
                      (self._rope(positions, x.dtype, names) for names in self._ropes))
        return x, torch.zeros_like(x)[None], ropes

    def _end(self, x: Tensor, delta: Tensor, norm: Tensor) -> Tensor:
        """The last position's final-normed hidden: the stream plus the last layer's MLP parts, normed."""
        return self._rms_norm(x[:, -1] + self._summed(delta[:, :, -1], x.dtype), norm)


def softcapped(x: Tensor, cap: float | None) -> Tensor:
    """`cap * tanh(x / cap)` in x's dtype, as transformers soft-caps Gemma 2's scores and logits; x where no cap."""
    return x if cap is None else torch.tanh(x / cap) * cap
