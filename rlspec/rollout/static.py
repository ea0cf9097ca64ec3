"""The `hf` engine's CUDA path: a slot-indexed KV cache and a decode step captured in CUDA graphs, over the
forward of `rlspec.rollout.decoder.StaticDecoder`.

`GraphSampler` runs one rollout batch over a pool of slots (continuous batching; see its docstring):

    prefill each distinct prompt once (row chunks, eager) -> its K/V and its last token's final-normed hidden h
    fill the pool: copy a pending sample's prompt K/V and h into each free slot
    repeat:  [one CUDA graph replay per token]
        logits = h W^T (the LM head; W [V, H])
        top_p = 1: token = argmax(logits / T - log E), logp = logits[token] / T - logsumexp(logits / T)
        top_p < 1: logp = log_softmax(logits / T); token = argmax(top_p(exp(logp)) / E)      (E ~ Exp(1))
        ended slots emit the end token; record token and logp[token] at the slot's own column
        write K/V of `token` into the slot's next cache position; h = forward(token)
        every `check_every` steps (the only host sync): copy ended slots' samples out, refill them

`argmax(p_i / E_i)` with `E_i ~ Exp(1)` samples i with probability p_i / sum(p) (the exponential race),
which needs no data-dependent shapes, so sampling lives inside the graph; E is keyed by (seed, sample,
position) (`rlspec.rollout.noise`). With top_p = 1 on CUDA the head and the race are one Triton kernel
(`rlspec.rollout.sampled_head`): each tile of logits is reduced where it is computed, and the [slots, V]
logits are never written (`sampling.sample_from_hidden`; elsewhere the logits are formed and raced as above).
One graph is captured per (slot bucket, cache length bucket): the pool is padded up to the next power of two
with empty (ended) slots, and the cache length is rounded up to a multiple of `CACHE_STEP`. Without CUDA
(`use_graphs=False`) the same step function runs eagerly, which is how the CPU tests check its logic.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.batch import position_ids
from .decoder import StaticDecoder
from .noise import sample_keys
from .sampling import sample_from_hidden

BATCH_BUCKETS = tuple(2 ** i for i in range(11))  # 1 .. 1024 rows per graph
CACHE_STEP = 128
PREFILL_ROWS = 64
SHRINK_FLOOR = 16
"""The smallest pool the long tail moves into (`GraphSampler(shrink_floor=...)`)."""
CAPTURE_HEADROOM = 2 << 30
"""Free device bytes below which a capture first hands the allocator's cached blocks back to the driver."""


def bucket_for(rows: int) -> int:
    """The graph bucket (slots) that `rows` rows run in."""
    return next(b for b in BATCH_BUCKETS if b >= rows)


def graph_key(shape: tuple[int, int], max_new_tokens: int, temperature: float, top_p: float, eos: int) -> tuple:
    """The (slot bucket, cache length, sampling settings) a pool of `rows` slots with prompts `width` wide is
    captured under, for `shape` = (rows, width)."""
    rows, width = shape
    bucket = bucket_for(rows)
    length = math.ceil((width + max_new_tokens) / CACHE_STEP) * CACHE_STEP
    return bucket, length, max_new_tokens, temperature, top_p, eos


@dataclass
class _Prompts:
    """A batch's distinct prompts, prefilled once: what a slot copies when it starts one of their samples."""

    keys: list[Tensor]         # [P, Hkv, W, D] per layer
    values: list[Tensor]
    hidden: Tensor             # [P, H] final-normed hidden the first completion token is sampled from
    mask: Tensor               # [P, W] real (not padding) prompt tokens
    next_position: Tensor      # [P] RoPE position of the first completion token
    index: Tensor              # [rows] the prompt of each sample


@dataclass
class _State:
    """Static buffers of one (slot bucket, cache length) graph; replays read and write only these. A slot is a
    row: it decodes one sample at a time, and every row has its own position, cache slot and output column."""

    keys: list[Tensor]   # [B, Hkv, S, D] per layer
    values: list[Tensor]
    hidden: Tensor       # [B, H] final-normed hidden the next token is sampled from (not [B, V] logits)
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
    forward pass. Once no sample is pending and at most 1 / `shrink_ratio` of the pool is live (half by default),
    the live slots move into the smallest pool that holds them and `shrink_floor` slots (`shrink_tail`; its own
    graph), so the long tail does not pay for a full pool's step (each bucket's decode layer is compiled once per
    process). With graphs, the pool a tail will move into next is captured while the GPU runs the current pool's
    first steps (the host is otherwise idle then), so a move costs the copy of the live slots, not a capture. A pool
    the tail has left is dropped at the move (`keep_graphs=False`), so at most two pools are held at a time: with
    halving, K/V for 1.5x the first pool's slots.
    Without `slots`, the pool holds all rows (up to 1,024; more run in waves, each started when the whole pool has
    ended): the static batch.

    Reproducibility: sample i's token at position t is drawn with noise keyed by (seed, i, t), and its logits
    depend only on its prompt and its own earlier tokens, so a sample's tokens do not depend on the slot it ran
    in, when it started, the pool size, or whether the batch ran continuously or statically — up to floating-point
    differences between kernels for different batch shapes (on CPU the eager path gives the same tokens; on
    CUDA a near tie can resolve differently).

    KV memory: slots x cache length x layers x 2 x kv_heads x head_dim x 2 bytes (bf16), whatever the lengths
    the samples reach (no paging: a slot reserves the full length). For the 0.5B shape (24 layers, 2 K/V heads
    of 64) that is 12,288 bytes per cached token: 256 rows x 1,152 (a 1,024-token budget plus a prompt of up to
    128, rounded to `CACHE_STEP`) = 3.6 GB as a static batch; with 64 slots 0.91 GB for any number of rows.
    Between steps a slot holds the final-normed hidden [H] it samples from, not the logits [V]: at 256 slots of the
    0.5B shape 0.46 MB where bf16 logits took 77.8 MB; with top_p = 1 on CUDA the head's [256, V] output inside the
    graph's pool (as much again) goes too, for 6 MB of the fused kernel's per-tile partials.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, use_graphs: bool | None = None,
                 compile_blocks: bool | None = None, check_every: int = 8, keep_graphs: bool = False,
                 fuse_weights: bool | None = None, sdpa: bool | None = None, compile_layers: bool | None = None,
                 share_prefill: bool = True, shrink_tail: bool = True, shrink_ratio: int = 2,
                 shrink_floor: int = SHRINK_FLOOR, capture_ahead: bool = True, autotune: bool = False,
                 live_attention: bool | None = None, skinny: bool | None = None,
                 gated_mlp: bool | None = None, sampled_head: bool | None = None,
                 rope_attention: bool | None = None, skinny_qkv: bool | None = None,
                 compile_ends: bool = True) -> None:
        self.device = torch.device(device)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        # The defaults on CUDA are the fastest measured (`python -m rlspec.perf.profile_engine`, H200, 0.5B shape, 64
        # rows: 1.43 ms a decode step fused + SDPA + per-layer compile, 1.98 ms with none of them; on an H100, 1.41 ms
        # -> 1.21 ms with the decode kernels, `live_attention` and `skinny`, on where Triton runs; with `gated_mlp` and
        # `sampled_head` too, 1.112 ms against 1.193 without them on an H100, 1.021 against 1.107 ms on an H200; with
        # `rope_attention` and `skinny_qkv`, 0.847 against 0.957 ms on an H200, and `compile_ends` 0.847 against 0.917).
        self.decoder = StaticDecoder(model, sdpa=self.use_graphs if sdpa is None else sdpa,
                                     live_attention=live_attention, skinny=skinny, gated_mlp=gated_mlp,
                                     sampled_head=sampled_head, rope_attention=rope_attention,
                                     skinny_qkv=skinny_qkv)
        self.compiled = self.use_graphs if compile_blocks is None else compile_blocks
        self.fuse = self.use_graphs if fuse_weights is None else fuse_weights
        if self.compiled:
            self.decoder.compile_blocks(layers=self.use_graphs if compile_layers is None else compile_layers,
                                        autotune=autotune, ends=compile_ends)
        # `compile_ends`: the step's own element-wise work around the decoder (recording the sample, the counters)
        # compiled with it, as the decoder's work before its first layer and after its last: about 40 small
        # kernels a step otherwise, ten with them compiled.
        # (Only where the blocks are compiled, which alone uses them: `torch.compile` imports Inductor, 6-14 s of a
        # CPU process's start on a busy 2-core machine, for nothing.)
        self._bookkeeping = ((torch.compile(_record, dynamic=False), torch.compile(_advance, dynamic=False))
                             if compile_ends and self.compiled else (_record, _advance))
        self.check_every = check_every
        self.share_prefill = share_prefill  # False: one prefill per row (the equivalence tests' reference)
        self.shrink_tail = shrink_tail
        # The tail moves into a smaller pool once at most 1 / `shrink_ratio` of the pool is live: 2 wastes at most
        # half a pool's rows on ended slots for more captures (one per halving, made while the GPU decodes), 4
        # wastes up to three quarters.
        if shrink_ratio < 2:
            raise ValueError(f"shrink_ratio must be at least 2, got {shrink_ratio}")
        self.shrink_ratio = shrink_ratio
        # ... but never into a pool of fewer than `shrink_floor` slots: below it a step costs about the same (a few
        # rows' step is the same ~170 kernels, each short of the bandwidth), so a smaller pool only adds a capture.
        if shrink_floor < 1:
            raise ValueError(f"shrink_floor must be at least 1, got {shrink_floor}")
        self.shrink_floor = shrink_floor
        self.capture_ahead = capture_ahead  # False: each pool is captured when the tail moves into it
        self.timeline: list[tuple] | None = None
        """A list to record into (profiling): ("capture", slots, s, ahead) per graph captured (`ahead`: beside queued
        decode steps, s the host's time), ("decode", slots, steps, s) per stretch of decode steps between two host
        checks (their refills and copies out, and a capture ahead, included), ("batch", s) per batch sampled (its
        tokens and log-probs on the host)."""
        # Dropping the graphs (their KV cache and memory pool) after each batch gives that memory back to a
        # colocated trainer; a later capture of a seen shape skips warm-up and costs a few milliseconds.
        self.keep_graphs = keep_graphs
        self._capture_stream = None
        self._states: dict[tuple, _State] = {}
        self._pointers: tuple[int, ...] = ()
        self._warmed: set[tuple] = set()

    @torch.no_grad()
    def sample(self, input_ids: Tensor, attention_mask: Tensor, seed: int, max_new_tokens: int,
               temperature: float, top_p: float, eos: int, slots: int | None = None,
               first_sample: int = 0) -> tuple[Tensor, Tensor]:
        """[B, T] tokens and log-probs on CPU, T = the longest sample; ended rows carry `eos` onward (as `HFEngine`).
        `slots`: continuous batching over that many slots; None: the static batch. Row i is sample
        `first_sample + i` of `seed` (its noise key), so a step split over engines samples what one engine would.

        On CUDA everything runs with the sampler's device as the calling thread's current device: a capture
        records only the current device's capture stream, so kernels of a model on another device (a rollout
        server on cuda:1, called from a worker thread whose current device is cuda:0) would run uncaptured.
        """
        args = (input_ids, attention_mask, seed, max_new_tokens, temperature, top_p, eos, slots, first_sample)
        began = time.perf_counter()
        if self.device.type != "cuda":
            out = self._sample(*args)
        else:
            with torch.cuda.device(self.device):
                out = self._sample(*args)
        if self.timeline is not None:
            self.timeline.append(("batch", time.perf_counter() - began))
        return out

    def _sample(self, input_ids: Tensor, attention_mask: Tensor, seed: int, max_new_tokens: int,
                temperature: float, top_p: float, eos: int, slots: int | None,
                first_sample: int) -> tuple[Tensor, Tensor]:
        if self.fuse:
            self.decoder.fuse_weights()
        state = self._state(graph_key(self.pool_shape(input_ids.shape, slots), max_new_tokens, temperature, top_p, eos))
        prompts = self._prefill(input_ids, attention_mask)
        tokens, logps = self._decode(state, prompts, seed, max_new_tokens, temperature, top_p, eos, waves=slots is None,
                                     first_sample=first_sample)
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
        bucket = bucket_for(wanted)
        return min(bucket, rows), width

    def _decode(self, state: _State, prompts: _Prompts, seed: int, max_new_tokens: int, temperature: float,
                top_p: float, eos: int, waves: bool, first_sample: int = 0) -> tuple[Tensor, Tensor]:
        """Run the pool until every sample has ended; `waves`: refill only once the whole pool has ended."""
        rows, n, dev = prompts.index.shape[0], max_new_tokens, self.device
        bucket = state.done.shape[0]
        tokens = torch.full((rows, n), eos, dtype=torch.long, device=dev)
        logps = torch.zeros(rows, n, dtype=torch.float32, device=dev)
        lengths = torch.zeros(rows, dtype=torch.long, device=dev)
        keys = sample_keys(seed, torch.arange(first_sample, first_sample + rows, device=dev))
        state.done.fill_(True)
        occupant, started = [-1] * bucket, [0] * bucket  # sample in each slot (-1: empty), decode step it began at
        next_sample, clock = 0, 0
        moves = self.shrink_tail and not waves  # the tail moves into smaller pools
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
            if (moves and next_sample == rows and len(live) * self.shrink_ratio <= bucket
                    and (key := self._tail_key(state, len(live), temperature, top_p, eos))[0] < bucket):
                state = self._shrink(state, live, key)
                occupant, started = [occupant[b] for b in live], [started[b] for b in live]
                bucket = state.done.shape[0]
                occupant += [-1] * (bucket - len(live))
                started += [0] * (bucket - len(live))
                live = list(range(len(live)))
            chunk = min(self.check_every, max(n - (clock - started[b]) for b in live))
            began = time.perf_counter()
            for _ in range(chunk):
                if state.graph is not None:
                    state.graph.replay()
                else:
                    self._step(state, temperature, top_p, eos)
            clock += chunk
            if moves and self.capture_ahead and state.graph is not None:
                self._capture_ahead(state, temperature, top_p, eos)  # while the GPU runs the steps just queued
            done = state.done.tolist()  # the loop's only host sync
            ended = [b for b in live if done[b]]
            if ended:
                self._harvest(state, ended, [occupant[b] for b in ended], tokens, logps, lengths, eos)
                for b in ended:
                    occupant[b] = -1
            if self.timeline is not None:
                self.timeline.append(("decode", bucket, chunk, time.perf_counter() - began))
        width = max(int(lengths.max()), 1)
        return tokens[:, :width].cpu(), logps[:, :width].cpu()

    def _shrink(self, state: _State, live: list[int], key: tuple) -> _State:
        """The pool's tail: its `live` slots moved into the first slots of the pool of graph `key` (`_tail_key`: the
        smallest bucket that holds them and `shrink_floor` slots, its own graph), so the last long samples stop paying
        for a full pool's decode step."""
        small = self._state(key)
        moved = torch.tensor(live, device=self.device)
        into = slice(0, len(live))
        for name in ("keys", "values"):
            for target, source in zip(getattr(small, name), getattr(state, name)):
                target[into] = source[moved]
        for name in ("hidden", "position", "write", "step", "key", "valid", "done", "out_tokens", "out_logps"):
            getattr(small, name)[into] = getattr(state, name)[moved]
        small.done[len(live):] = True
        if not self.keep_graphs:  # the pool left behind (its ended samples are copied out), and a pool captured ahead
            # for a move that went further, give their graphs and K/V back
            self._states = {key: kept for key, kept in self._states.items() if kept is small}
        return small

    def _tail_key(self, state: _State, live: int, temperature: float, top_p: float, eos: int) -> tuple:
        """The graph key of the pool that `live` of `state`'s slots move into: the same cache length."""
        length, n = state.valid.shape[1], state.out_tokens.shape[1] - 1
        return graph_key((max(live, self.shrink_floor), length - n), n, temperature, top_p, eos)

    def _capture_ahead(self, state: _State, temperature: float, top_p: float, eos: int) -> None:
        """Capture the pool `state`'s tail moves into next when it shrinks as the ratio says (a pool 1 / `shrink_ratio`
        the size, or `shrink_floor` slots), if it is smaller and not captured yet. Called with the GPU busy: the
        capture only records, and nothing here waits for the device."""
        bucket = state.done.shape[0]
        key = self._tail_key(state, bucket // self.shrink_ratio, temperature, top_p, eos)
        if key[0] < bucket and key not in self._states:
            self._state(key, ahead=True)

    def _start(self, state: _State, prompts: _Prompts, keys: Tensor, slots: list[int], first: int) -> None:
        """Start samples first, first + 1, ... in `slots`: their prompt's K/V and last hidden, fresh counters."""
        dev = self.device
        slot = torch.tensor(slots, device=dev)
        sample = torch.arange(first, first + len(slots), device=dev)
        prompt = prompts.index[sample]
        width = prompts.mask.shape[1]
        for cache, store in zip(state.keys + state.values, prompts.keys + prompts.values):
            cache[slot, :, :width] = store[prompt]
        state.hidden[slot] = prompts.hidden[prompt]
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
        hidden = torch.empty(count, self.decoder.hidden_size, dtype=self.decoder.dtype, device=self.device)
        positions = position_ids(mask)
        valid = mask.bool()
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        slots = torch.arange(width, device=self.device)
        for start in range(0, count, PREFILL_ROWS):
            part = slice(start, start + PREFILL_ROWS)
            hidden[part] = self.decoder.forward(ids[part], positions[part], slots, causal & valid[part, None, :],
                                                [k[part] for k in keys], [v[part] for v in values], head=False)
        return _Prompts(keys, values, hidden, valid, positions[:, -1] + 1, index.to(self.device))

    def _state(self, key: tuple, ahead: bool = False) -> _State:
        """The pool of graph `key`, made and captured if it is new. `ahead`: the GPU may still be running queued
        steps (`_capture_ahead`): nothing waits for it, and the timeline records the capture's host time."""
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

        state = _State(keys=keys, values=values, hidden=rows(self.decoder.dtype, (self.decoder.hidden_size,)),
                       position=rows(), write=rows(), step=rows(), key=rows(), valid=rows(torch.bool, (length,)),
                       done=torch.ones(bucket, dtype=torch.bool, device=dev),
                       out_tokens=rows(torch.long, (max_new_tokens + 1,)),
                       out_logps=rows(torch.float32, (max_new_tokens + 1,)))
        if self.use_graphs:
            began = time.perf_counter()
            state.graph = self._capture(state, temperature, top_p, eos, warm_up=key not in self._warmed,
                                        wait=not ahead)
            self._warmed.add(key)
            if self.timeline is not None:
                if not ahead:
                    torch.cuda.synchronize(self.device)
                self.timeline.append(("capture", bucket, time.perf_counter() - began, ahead))
        self._states[key] = state
        return state

    def _capture(self, state: _State, temperature: float, top_p: float, eos: int, warm_up: bool, wait: bool = True):
        """Capture one decode step; the first time for a shape, warm up on a side stream before (compilation,
        cuBLAS workspaces). `wait`: for the device's queued work first (else the capture goes on beside it)."""
        if warm_up:
            self._warm_up(state, temperature, top_p, eos)
        graph = torch.cuda.CUDAGraph()
        if self._capture_stream is None:  # on the sampler's device, not the (process-wide) default one
            self._capture_stream = torch.cuda.Stream(self.device)
        # Not `torch.cuda.graph`: it empties the caching allocator before every capture, which hands a colocated
        # trainer's cached activation blocks back to the driver, so its next train phase allocated them again
        # (226 cudaMalloc calls a 32 x 8 phase, most of them in its first forward, where the host sets the pace).
        # The cache is emptied here only when the device is short of memory; the step's own intermediates come
        # from the graph's private pool either way.
        if wait:
            torch.cuda.synchronize(self.device)
        if torch.cuda.mem_get_info(self.device)[0] < CAPTURE_HEADROOM:
            torch.cuda.empty_cache()
        with torch.cuda.stream(self._capture_stream):
            graph.capture_begin()
            try:
                self._step(state, temperature, top_p, eos)
            finally:
                graph.capture_end()
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
        """Sample from `state.hidden`, record, then run the decoder on the sampled tokens (graph body). Ended
        slots ride along: their token is `eos`, their counters stay, their record goes to the spare column."""
        decoder = self.decoder
        token, logp = sample_from_hidden(state.hidden, decoder.head_weight, temperature, top_p, state.key, state.step,
                                         decoder.race, decoder.noise, fused=decoder.sampled_head,
                                         softcap=decoder.arch.final_softcap)
        record, advance = self._bookkeeping if self.compiled else (_record, _advance)
        token, slot, lengths, live = record(token, logp, state.done, state.step, state.write, state.valid,
                                            state.out_tokens, state.out_logps, eos)
        hidden = decoder.forward(token[:, None], state.position[:, None], slot, state.valid[:, None, :], state.keys,
                                 state.values, compiled=self.compiled, lengths=lengths, head=False)
        advance(hidden, live, state.hidden, state.position, state.write, state.step)


def _record(token: Tensor, logp: Tensor, done: Tensor, step: Tensor, write: Tensor, valid: Tensor, out_tokens: Tensor,
            out_logps: Tensor, eos: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A decode step's sampled `token` and `logp` [B] into the slots' records (ended slots: `eos`, to the spare
    column), the slots that end now marked `done`, the cache slot of each row's new token marked `valid`. Returns
    the tokens to decode, their cache slots [B, 1], the rows' attended lengths [B] (slot + 1) and which slots were
    live. Index stores, not `scatter_`: compiled, a scatter became a copy of its whole target and a copy back."""
    last = out_tokens.shape[1] - 1
    rows = torch.arange(token.shape[0], device=token.device)
    live = ~done
    token = torch.where(live, token, eos)
    column = torch.where(live, step, last)
    out_tokens[rows, column] = token
    out_logps[rows, column] = logp
    done.logical_or_((token == eos) | (step >= last - 1))
    slot = write.clamp(max=valid.shape[1] - 1)
    valid[rows, slot] = live.new_ones(())  # a device scalar: a Python True is a host tensor, copied while capturing
    return token, slot[:, None], slot + 1, live


def _advance(new_hidden: Tensor, live: Tensor, hidden: Tensor, position: Tensor, write: Tensor, step: Tensor) -> None:
    """After the decoder: the hidden state to sample from next, and the live slots' counters one on."""
    hidden.copy_(new_hidden)
    advance = live.long()
    position.add_(advance)
    write.add_(advance)
    step.add_(advance)
