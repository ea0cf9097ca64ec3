"""Model-side glue shared by every backend: forward to token log-probs, and the micro-batch loss loop.

Backends differ in how they wrap the model (plain, FSDP2, ZeRO-3) and how they call backward; the
forward, the loss (`rlspec.core.grpo`) and the accumulation of statistics are this one code path.

Packed sequences (the default for text causal LMs of `PACKED_MODEL_TYPES` with full attention in every
layer): a micro-batch's forward runs over its real tokens only, concatenated into one row [1, T] with
positions restarting at 0 for each sequence (`rlspec.core.packing.Packing`); the log-probs and entropies come
back in the padded [n, L] layout, 0 at padding, so the loss reads the same tokens as unpacked. Attention is
kept within each sequence by the model's own attention implementation, fed as follows:

- `flash_attention_2`: the varlen kernel, given the sequences' offsets (`cu_seq_lens_q/k`, `max_length_q/k`,
  computed on the host) so that transformers does not derive them from the positions (a device read per layer);
- `sdpa`: the model is switched to `rlspec.core.packing.PACKED_SDPA`, which is transformers' sdpa for any
  unpacked forward and, given the offsets, runs torch's varlen flash kernel on CUDA in 16 bits (each
  sequence's causal block only, as flash_attention_2 does, without the flash-attn package), or elsewhere
  (CPU, fp32) sdpa under a block-diagonal causal mask (all T x T scores: `micro_batch_tokens` bounds T);
- `eager`: no mask; transformers 5 finds the packed sequences in the restarting `position_ids`
  (`masking_utils.find_packed_sequence_indices`) and builds the block-causal mask itself (it reads the
  device once per forward to do so, which costs nothing on the CPU, where eager is used).

The padded path stays for VLA batches (images, action vocabularies), other model types, and sliding-window
attention.

The LM head never forms the full [T, V] logits of a text micro-batch: `token_logprobs_and_entropy` runs it chunk
by chunk (`rlspec.core.grpo`). A plain transformers model (or its PEFT wrapper) is split here into its decoder and
head. A model wrapped by a backend (FSDP2's root module, the ZeRO-3 engine, PEFT inside either) cannot be split
from outside: FSDP2 gathers the root's own parameters (embeddings, final norm, the head, tied in Qwen) only inside
the root's forward, ZeRO-3 gathers a module's parameters in that module's forward hooks. So it runs its own
forward, and for that one forward the head module's `forward` (not `__call__`: the wrappers' hooks stay) is
replaced by the chunked head (`_head_returns_logprobs`): it receives the final hidden states after the wrapper
has gathered the head's weight, and returns (log-probs, entropies), which come back in the output's `logits`
field (the plain-head model types pass the head's output through untouched). The gradient reaches the real
weight, so FSDP2's reduce-scatter and ZeRO-3's partitioned gradients work as for a plain head. A head that is
not a `Linear` (LoRA on the head) keeps the full logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import Tensor

from ..runtime.collector import collection_paused
from .batch import TrainBatch, position_ids
from .grpo import LossConfig, LossNorm, policy_loss, token_logprobs_and_entropy
from .packing import PACKED_SDPA, Packing, chunk_sizes, use_packed_sdpa

PEAK_STATS = ("peak_mem_gb", "gpu_used_gb")
"""Memory statistics of a train phase (GB): maxima over mini-batches and ranks, not sums."""
STAT_KEYS = ("loss", "clipped_tokens", "kl_sum", "tokens", "entropy_sum", "is_ratio_sum", "is_clipped_tokens")


# Causal LMs whose logits are exactly `lm_head(final hidden states)` (no soft-capping or logit scale).
PLAIN_HEAD_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")
# Causal LMs whose forward takes packed inputs as above (restarting positions, a 4-D mask or none).
PACKED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
# ... and of those, the ones that take a prepared {layer type: mask} mapping, which skips their mask builder.
MASK_MAPPING_MODEL_TYPES = ("qwen2", "qwen3")
PACKED_ATTENTION = ("eager", "sdpa", "flash_attention_2", PACKED_SDPA)


def forward_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                     temperature: float) -> tuple[Tensor, Tensor]:
    """Token log-probs and (detached) entropies, as `token_logprobs` / `token_entropy` define them.

    The LM head runs chunk by chunk inside `token_logprobs_and_entropy`, so the batch's full logits are never
    materialised (module docstring: a plain model is split into decoder and head, a wrapped one runs its own
    forward with the head replaced).
    """
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                  use_cache=False)
    return _chunked_forward(model, inputs, input_ids, temperature)


def packed_logprobs(model: torch.nn.Module, input_ids: Tensor, packing: Packing,
                    temperature: float) -> tuple[Tensor, Tensor]:
    """`forward_logprobs` of a micro-batch through one packed row (module docstring): [n, L] log-probs and
    entropies, 0 at each sequence's first token (no prefix) and at padding."""
    ids = packing.gather(input_ids)
    inputs = dict(input_ids=ids, position_ids=packing.position_ids, use_cache=False,
                  **_packed_attention(_base_model(model).config, packing))
    logp, entropy = _chunked_forward(model, inputs, ids, temperature)
    first = packing.first  # its log-prob in the row is the previous sequence's last token predicting it
    return packing.scatter(logp[0].masked_fill(first, 0.0)), packing.scatter(entropy[0].masked_fill(first, 0.0))


def _chunked_forward(model: torch.nn.Module, inputs: dict, ids: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """[n, L] log-probs and entropies of `ids` from the forward of `model` on `inputs`, through the chunked head
    where the model allows it (module docstring), else from its full logits."""
    split = _decoder_and_head(model)
    if split is not None:
        decoder, head = split
        return token_logprobs_and_entropy(decoder(**inputs).last_hidden_state, ids, temperature, head=head)
    head = _wrapped_head(model)
    if head is None:
        return token_logprobs_and_entropy(model(**inputs).logits, ids, temperature)
    with _head_returns_logprobs(head, ids, temperature):
        out = model(**inputs).logits
    if not isinstance(out, tuple):
        raise RuntimeError(f"{type(_base_model(model)).__name__} changed its head's output: cannot read the "
                           "chunked head's log-probs from its logits")
    return out


class _HeadView(torch.nn.Linear):
    """The head's current weight and bias as a `Linear` without the head module's hooks: the chunked head calls
    it inside the head's own forward, where calling the head again would run the wrappers' hooks twice."""

    def __init__(self, head: torch.nn.Linear) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = head.in_features, head.out_features
        self.weight, self.bias = head.weight, head.bias  # read now: a wrapper swaps them in for its forward


@contextmanager
def _head_returns_logprobs(head: torch.nn.Linear, ids: Tensor, temperature: float) -> Iterator[None]:
    """For one forward, `head` maps the final hidden states [n, L, H] to the (log-prob, entropy) pair of `ids`
    [n, L] through `token_logprobs_and_entropy`, instead of to logits."""

    def forward(hidden: Tensor) -> tuple[Tensor, Tensor]:
        if hidden.shape[:-1] != ids.shape:
            raise RuntimeError(f"the head got hidden states {tuple(hidden.shape)} for ids {tuple(ids.shape)}")
        return token_logprobs_and_entropy(hidden, ids, temperature, head=_HeadView(head))

    own = head.__dict__.get("forward")  # an instance forward set by someone else is put back after
    head.forward = forward
    try:
        yield
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def _wrapped_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The `Linear` head of a backend-wrapped plain-head model (module docstring), or None."""
    base = _base_model(model)
    if base is None or getattr(base.config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    head = base.get_output_embeddings()
    return head if isinstance(head, torch.nn.Linear) else None


def _packed_attention(config, packing: Packing) -> dict:
    """The attention inputs of a packed forward (module docstring); switches an `sdpa` model to
    `rlspec.core.packing.PACKED_SDPA` on first use."""
    if config._attn_implementation == "sdpa":
        use_packed_sdpa(config)
    if config._attn_implementation == "eager":
        return dict(attention_mask=None)
    mapping = {"full_attention": None} if config.model_type in MASK_MAPPING_MODEL_TYPES else None
    return dict(attention_mask=mapping, cu_seq_lens_q=packing.cu_seqlens, cu_seq_lens_k=packing.cu_seqlens,
                max_length_q=packing.max_length, max_length_k=packing.max_length)


def packs(model: torch.nn.Module, batch: TrainBatch) -> bool:
    """Whether `batch` goes through `model` packed (module docstring)."""
    if batch.pixel_values is not None or batch.action_vocab is not None:
        return False
    base = _base_model(model)
    if base is None:
        return False
    config = base.config
    full = all(kind == "full_attention" for kind in (getattr(config, "layer_types", None) or ()))
    return (getattr(config, "model_type", None) in PACKED_MODEL_TYPES and full
            and getattr(config, "_attn_implementation", None) in PACKED_ATTENTION)


def _base_model(model: torch.nn.Module):
    """The transformers model inside PEFT and backend wrappers (a ZeRO-3 engine's `module`), or None."""
    from transformers import PreTrainedModel

    for _ in range(4):
        if isinstance(model, PreTrainedModel):
            return model
        if _is_peft(model):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            return None
    return None


def _is_peft(model: torch.nn.Module) -> bool:
    # Through the class's bases: FSDP2 renames a sharded PEFT model's class (FSDPPeftModel, in torch's module).
    return hasattr(model, "get_base_model") and any(cls.__module__.startswith("peft.") for cls in type(model).__mro__)


def _decoder_and_head(model: torch.nn.Module):
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        base = model
    elif _is_peft(model):
        base = model.get_base_model()
    else:
        return None  # a backend's wrapper (e.g. a ZeRO-3 engine) runs its own forward
    if not isinstance(base, PreTrainedModel) or getattr(base.config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    if any(cls.__name__ == "FSDPModule" for cls in (*type(model).__mro__, *type(base).__mro__)):
        return None  # FSDP2 gathers the root's weights in the root's forward only
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear:  # e.g. a LoRA-wrapped head
        return None
    return base.get_decoder(), head


def forward_logits(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                   pixel_values: Tensor | None = None) -> Tensor:
    """Logits of a causal LM (or, with `pixel_values`, an image-text-to-text model) on right- or left-padded
    sequences (positions count real tokens only)."""
    images = {} if pixel_values is None else {"pixel_values": pixel_values.to(getattr(model, "dtype", pixel_values.dtype))}
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids(attention_mask), use_cache=False, **images)
    return out.logits


def restrict_vocab(logits: Tensor, input_ids: Tensor, vocab: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Logits over each sequence's own token subset `vocab` [N, A]: returns the [N, L, A] logits, the ids of
    `input_ids` as indices into `vocab`, and where a token is in `vocab` at all ([N, L] bool)."""
    n, length = input_ids.shape
    sub = logits.gather(-1, vocab[:, None, :].expand(n, length, vocab.shape[-1]))
    match = input_ids[..., None] == vocab[:, None, :]
    return sub, match.long().argmax(-1), match.any(-1)


def sequence_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float,
                      packing: Packing | None = None) -> tuple[Tensor, Tensor]:
    """[N, L] log-probs of `batch`'s tokens and the (detached) entropies of the distributions they come from.

    With `batch.action_vocab` the distribution is the softmax over those ids only; a token outside them
    (a prompt token) gets log-prob 0. A text batch takes `forward_logprobs` (no full logits), or with its
    `packing` `packed_logprobs`.
    """
    if packing is not None:
        return packed_logprobs(model, batch.input_ids, packing, temperature)
    if batch.pixel_values is None and batch.action_vocab is None:
        return forward_logprobs(model, batch.input_ids, batch.attention_mask, temperature)
    logits = forward_logits(model, batch.input_ids, batch.attention_mask, batch.pixel_values)
    if batch.action_vocab is None:
        return token_logprobs_and_entropy(logits, batch.input_ids, temperature)
    logits, ids, member = restrict_vocab(logits, batch.input_ids, batch.action_vocab)
    logp, entropy = token_logprobs_and_entropy(logits, ids, temperature)
    return logp * member.to(logp.dtype), entropy


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """`model` in eval mode inside (dropout off), every module's own mode put back after. The no-gradient passes
    score the policy itself, not one dropout draw of it: the old log-probs (two passes agree exactly, and the
    ratio departs from 1 only by the update forward's own dropout, as in verl), the reference's, and those checked
    against the engine's, which samples in eval mode. The update's forward stays in train mode."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@torch.no_grad()
def batch_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float, micro_batch_size: int,
                   device: torch.device | str) -> Tensor:
    """[N, L] token log-probs of `batch` under `model` in eval mode (`eval_mode`), computed micro-batch by
    micro-batch, returned on CPU (gathered on `device`, then copied once); automatic garbage collection off
    meanwhile, as in `accumulate`."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=device)
    split = batch.split(chunk_sizes(len(batch), micro_batch_size), device, packs(model, batch))
    with collection_paused(), eval_mode(model):
        for start, (mb, packing) in zip(range(0, len(batch), micro_batch_size), split):
            logp, _ = sequence_logprobs(model, mb, temperature, packing)
            out[start:start + len(mb), :mb.input_ids.shape[1]] = logp.float()
        return out.cpu()


def micro_batch_loss(model: torch.nn.Module, mb: TrainBatch, norm: LossNorm, cfg: LossConfig,
                     temperature: float, packing: Packing | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Forward one micro-batch and return its GRPO loss share and statistic sums (0-dim device tensors)."""
    logp, entropy = sequence_logprobs(model, mb, temperature, packing)
    old = mb.old_logprobs if mb.old_logprobs is not None else logp.detach()
    loss, stats = policy_loss(logp, old.to(logp.dtype), mb.advantages, mb.loss_mask.to(logp.dtype), norm, cfg,
                              None if mb.ref_logprobs is None else mb.ref_logprobs.to(logp.dtype),
                              None if mb.engine_logprobs is None else mb.engine_logprobs.to(logp.dtype))
    with torch.no_grad():
        stats["entropy_sum"] = (entropy * mb.loss_mask).sum()
        stats["loss"] = loss.detach()
    return loss, stats


def accumulate(model: torch.nn.Module, shard: TrainBatch, micro_batch_size: int, norm: LossNorm, cfg: LossConfig,
               temperature: float, backward: Callable[[Tensor], None], device: torch.device | str,
               sizes: list[int] | None = None, boundary: Callable[[bool], None] | None = None,
               read_now: bool = True) -> Mapping[str, float]:
    """Run forward + `backward(loss)` over `shard` in micro-batches; return summed statistics.

    The micro-batches are `sizes` consecutive rows each (the token-budget split, `TrainBatch.token_shards`;
    0 = a placeholder), by default `micro_batch_size` rows each. Each is packed where `packs` says so.

    `backward` receives the loss share of each micro-batch (see `rlspec.core.grpo.aggregate`): the caller
    scales it for its gradient reduction (e.g. x world size under an averaging all-reduce). `boundary`, when
    given, is told before each backward whether it is the last one (a sharded model reduces its gradients
    across ranks only then).

    The statistics stay on the device, summed in fp64 (what adding them as Python floats gives), and are
    read once at the end: the loop itself never waits for the device. With `read_now=False` not even then: the
    sums come back as `DeviceSums`, read on first access, so a caller can queue its optimizer step before the
    host waits for the device. Python's automatic garbage collection is off while it runs
    (`rlspec.runtime.collector`).
    """
    totals = None
    sizes = chunk_sizes(len(shard), micro_batch_size) if sizes is None else sizes
    with collection_paused():
        for i, (mb, packing) in enumerate(shard.split(sizes, device, packs(model, shard))):
            loss, stats = micro_batch_loss(model, mb, norm, cfg, temperature, packing)
            if boundary is not None:
                boundary(i == len(sizes) - 1)
            backward(loss)
            part = torch.stack([stats[key].detach().to(torch.float64) for key in STAT_KEYS])
            totals = part if totals is None else totals + part
    sums = DeviceSums(totals)
    return dict(sums) if read_now else sums


class DeviceSums(Mapping):
    """`accumulate`'s statistic sums (`STAT_KEYS` -> float), left on the device until one of them is read, then
    copied over at once. Reading them drains the device's queue first (the host waits for the last backward);
    a caller that queues more work before reading (the optimizer step) keeps the device busy meanwhile."""

    def __init__(self, totals: Tensor | None) -> None:
        self._totals, self._values = totals, None

    def _read(self) -> dict[str, float]:
        if self._values is None:
            self._values = (dict.fromkeys(STAT_KEYS, 0.0) if self._totals is None
                            else dict(zip(STAT_KEYS, self._totals.tolist())))
            self._totals = None
        return self._values

    def __getitem__(self, key: str) -> float:
        return self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(STAT_KEYS)

    def __len__(self) -> int:
        return len(STAT_KEYS)


def block_classes(model: torch.nn.Module) -> set[str]:
    """Class names of the model's repeated blocks: its `_no_split_modules` (transformers collects them from every
    sub-model, so a VLM names its vision-encoder layers too)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return set(getattr(base, "_no_split_modules", None) or ())


def block_modules(model: torch.nn.Module, purpose: str) -> list[torch.nn.Module]:
    """The model's repeated blocks (`block_classes`), matched through each module's class bases: FSDP2 renames a
    sharded block's class (FSDPQwen2DecoderLayer). Raises, naming `purpose`, when the model names none."""
    names = block_classes(model)
    if not names:
        raise RuntimeError(f"{type(model).__name__} names no _no_split_modules: no blocks to {purpose}")
    return [m for m in model.modules() if any(cls.__name__ in names for cls in type(m).__mro__)]


class CompiledBlocks:
    """Regional compilation (`model.compile_layers`): `torch.compile` of each block's `forward`, switched on only
    inside `active()`, which the trainers wrap around the train forward/backward.

    The block's own forward is compiled, not its `__call__`, so module hooks (FSDP2's gathers) stay outside the
    graph, and the state-dict names do not change. `dynamic=True`: a packed row's length changes with every
    micro-batch, and a graph specialised on it would recompile each time. Off `active()` (log-prob passes, and
    the rollout engine, which may decode with the trainer's own model) the blocks run their plain forward.
    """

    def __init__(self, model: torch.nn.Module, enabled: bool) -> None:
        blocks = block_modules(model, "compile") if enabled else []
        self.blocks = [(m, torch.compile(m.forward, dynamic=True)) for m in blocks]
        for block, _ in self.blocks:
            trace_as_plain_modules(block)

    @contextmanager
    def active(self) -> Iterator[None]:
        for block, compiled in self.blocks:
            block.forward = compiled
        try:
            yield
        finally:
            for block, _ in self.blocks:
                del block.forward  # the class's forward again


def trace_as_plain_modules(block: torch.nn.Module) -> None:
    """Let Dynamo trace an FSDP2-sharded block (and its submodules) as the plain modules they are in its forward.

    FSDP2 marks every module it manages for Dynamo, which then takes none of their integer attributes as
    constants: under `dynamic=True` the head size and head counts become symbols. Inductor then compiles a
    different, slower graph than for the unsharded block (on one H100 at 8 x 8: 144 more kernels and 50.2 ms of
    Triton kernel time per train step instead of the plain model's 40.3; with the marks cleared, 40.7 ms and the
    plain model's kernels), and each call checks a few hundred Python guards on those symbols (370 instead of 28
    on the tiny CPU model). Inside the block's forward FSDP2's parameters are plain unsharded tensors (its hooks
    run outside the compiled forward), which Dynamo treats as graph inputs like any module's, so nothing else
    changes. A no-op for unsharded modules.
    """
    for module in block.modules():
        if getattr(module, "_is_fsdp_managed_module", False):
            module._is_fsdp_managed_module = False


def add_stats(*parts: dict[str, float]) -> dict[str, float]:
    """Sum statistic dicts (e.g. from several ranks)."""
    return {key: sum(p[key] for p in parts) for key in STAT_KEYS}
