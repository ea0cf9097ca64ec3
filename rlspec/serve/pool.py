"""A slot pool that stays open: rows join at any decode step and leave as soon as they end (a rollout server's
scheduler drives it, `rlspec.serve.scheduler`).

It is `static.GraphSampler`'s slot pool (the same decoder, K/V layout, captured decode step, prompt copy into a
slot, moves between pool sizes), with two differences that a server needs:
- every row samples with its own settings, held in per-slot tensors the captured step reads: max tokens,
  temperature, top-p, greedy, and the top log-probs a request asked for;
- the pool has no end: `admit` starts rows in free slots (growing the pool to the next bucket if needed), `run`
  decodes a few steps and returns each live row's new tokens, `release` frees rows (a stop string, a client gone).

A step samples each row as it would sample alone: the noise is keyed by (the row's key, its own position)
(`rlspec.rollout.noise`), and a row's sampler does not depend on the others' settings. Two captured variants of
the step: `race` when every live row samples the full distribution at its temperature (the exponential race over
the head's logits), `full` otherwise (top-p, greedy and the top log-probs per row, the race for the other rows,
selected row by row: a row's token and log-prob are the same in either variant). On CPU (no graphs) the step runs
eagerly and a row's tokens equal its solo run's exactly (the pool keeps one bucket for up to `floor` rows, and
each prompt is prefilled alone); on CUDA a near tie can resolve differently between pool sizes (different
kernels for a different number of rows), as in `GraphSampler`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..rollout.noise import keyed_exponential
from ..rollout.sampling import exponential_race
from ..rollout.static import BATCH_BUCKETS, CACHE_STEP, SHRINK_FLOOR, GraphSampler, bucket_for
from .kv.prefill import Prefill, Prefills, on_device
from .kv.prefix import slot_runs

MAX_TOP = 20
"""Top log-probs a row may ask for (the `full` step records this many for every row)."""
FOREACH_RUNS = 8
"""An admission writes its rows with one `_foreach_copy_` of slot views where their slots form at most this many runs
of consecutive slots (else an indexed store per tensor: building a view per tensor and run costs host time too)."""


@dataclass(frozen=True)
class RowSampling:
    """How one row samples."""

    key: int
    """Its noise key (`noise.sample_keys(seed, sample index)`)."""
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    """Argmax; log-probs under the plain log_softmax (temperature 1)."""
    top_logprobs: int = 0

    @property
    def plain(self) -> bool:
        """Samples in the `race` step."""
        return not self.greedy and self.top_p >= 1.0 and self.top_logprobs == 0


@dataclass
class Delivery:
    """What one row got from a `run`: its new tokens and log-probs (and top ids/log-probs when it asked)."""

    row_id: int
    slot: int
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None
    ended: bool


@dataclass
class _Slots:
    """The per-slot tensors of one pool size; captured steps read and write only these."""

    keys: list[Tensor]
    values: list[Tensor]
    hidden: Tensor       # [B, H] final-normed hidden the next token is sampled from
    position: Tensor     # [B] RoPE position of the next token
    write: Tensor        # [B] cache slot of the next token
    step: Tensor         # [B] tokens sampled so far by the slot's row (its output column)
    key: Tensor          # [B] noise key
    limit: Tensor        # [B] max tokens
    temperature: Tensor  # [B, 1] float32
    top_p: Tensor        # [B, 1] float32
    greedy: Tensor       # [B] bool
    plain: Tensor        # [B] bool: samples by the race
    valid: Tensor        # [B, S] cache slots holding a real token
    done: Tensor         # [B] ended or empty
    start: Tensor        # [B] `step` when the current `run` began (its new tokens are columns start..step)
    out_tokens: Tensor   # [B, N + 1] (column N takes ended slots' writes)
    out_logps: Tensor
    out_top_ids: Tensor  # [B, N + 1, MAX_TOP]
    out_top_logps: Tensor
    graphs: dict


class ServingPool:
    """Rows of any number of requests decoded together; see the module docstring. Not thread-safe: one thread
    (the server's engine thread) calls everything."""

    PER_ROW = ("hidden", "position", "write", "step", "key", "limit", "temperature", "top_p", "greedy", "plain",
               "valid", "done", "out_tokens", "out_logps", "out_top_ids", "out_top_logps")

    def __init__(self, sampler: GraphSampler, max_tokens_per_row: int, max_slots: int, eos: int,
                 check_every: int | None = None, floor: int = SHRINK_FLOOR,
                 prefills: Prefills | None = None) -> None:
        """`prefills`: another pool's, whose prompts this one admits too (the server's long lane: its prompts are no
        longer than the pool's); that pool then refreshes them and the fused weights (`refresh_weights`, called on
        it first)."""
        self.sampler = sampler
        self.decoder = sampler.decoder
        self.device = sampler.device
        self.eos = eos
        self.length = math.ceil(max_tokens_per_row / CACHE_STEP) * CACHE_STEP
        """Cache positions per slot: a row's prompt plus its max tokens fit in it."""
        self.max_slots = bucket_for(min(max_slots, BATCH_BUCKETS[-1]))
        self.floor = min(bucket_for(floor), self.max_slots)
        self.check_every = check_every or (sampler.check_every if sampler.use_graphs else 1)
        self._pools: dict[int, _Slots] = {}
        self._pool: _Slots | None = None
        self._heads: Tensor | None = None
        self.live: dict[int, int] = {}
        """slot -> the caller's row id."""
        self._rows: dict[int, RowSampling] = {}
        self._sampled: dict[int, int] = {}
        """slot -> tokens its row has sampled (host side: how many steps a `run` may take)."""
        self._sequence: dict[int, list[int]] = {}
        """slot -> its row's prompt and sampled ids: what its K/V hold, kept by the prefix cache when it ends."""
        self._own_prefills = prefills is None
        self.prefills = prefills or Prefills(sampler, eos, self.max_slots, self.length)
        self._pointers: tuple[int, ...] = ()
        self._decode_captures, self._decode_capture_s = 0, 0.0
        self.refresh_weights()

    # --- the caller's interface ---------------------------------------------------------------------------
    @property
    def captures(self) -> int:
        """Graphs captured so far (a decode step per pool size and variant, a prefill per token bucket, on first
        use)."""
        return self._decode_captures + self.prefills.captures

    @property
    def capture_s(self) -> float:
        """The seconds those captures took."""
        return self._decode_capture_s + self.prefills.capture_s

    @property
    def slots(self) -> int:
        return 0 if self._pool is None else self._pool.done.shape[0]

    def free(self) -> int:
        """Rows `admit` can start now."""
        return self.max_slots - len(self.live)

    def fits(self, prompt_tokens: int, max_tokens: int) -> bool:
        return prompt_tokens + max_tokens <= self.length

    def refresh_weights(self) -> None:
        """After the module's weights changed (a push): the fused copies refreshed, cached prefills dropped."""
        if self.sampler.fuse and self._own_prefills:
            self.decoder.fuse_weights()  # into the same buffers once they exist
        if self._own_prefills:
            self.prefills.cache.clear()
            self.prefills.prefix.clear()
        fused = tuple(t.data_ptr() for layer in self.decoder._fused or () for t in layer if t is not None)
        pointers = self.decoder.weight_pointers() + fused
        if pointers != self._pointers:  # a weight (or a fused copy) was re-allocated: graphs would read stale memory
            for pool in self._pools.values():
                pool.graphs.clear()
            if self._own_prefills:
                self.prefills.graphs.clear()
            self._pointers = pointers

    @torch.no_grad()
    def admit(self, rows: list[tuple[int, list[int], RowSampling]]) -> None:
        """Start rows (caller's id, prompt ids, sampling) in free slots; at most `free()` of them."""
        assert len(rows) <= self.free(), (len(rows), self.free())
        if not rows:
            return
        with self._on_device():
            self._resize(len(self.live) + len(rows))
            self.prefills.prefill([ids for _, ids, _ in rows])
            pool = self._pool
            empty = [b for b in range(self.slots) if b not in self.live][:len(rows)]
            # The prompts' K/V, last hidden states and settings written into their slots (`_write_prompts`,
            # `_write_settings`): a few torch calls whatever the layers, where the free slots run in order.
            sources: dict[int, tuple[Prefill, list[int], list[int]]] = {}
            for i, (_, ids, _) in enumerate(rows):
                batch, index = self.prefills.get(ids)
                group = sources.setdefault(id(batch), (batch, [], []))
                group[1].append(empty[i])
                group[2].append(index)
            for batch, slots, indices in sources.values():
                self._write_prompts(pool, batch, slots, indices)
            self._write_settings(pool, empty, [len(ids) for _, ids, _ in rows], [s for _, _, s in rows])
        for (row_id, ids, sampling), b in zip(rows, empty):
            self.live[b] = row_id
            self._rows[b] = sampling
            self._sampled[b] = 0
            self._sequence[b] = list(ids)

    def _write_prompts(self, pool: "_Slots", batch: Prefill, slots: list[int], indices: list[int]) -> None:
        """Rows `indices` of prefill `batch` into `slots`: every layer's K/V and the last hidden state. Each torch
        call of the engine thread gives the interpreter lock up, and while agents or a server's routes run,
        taking it back can wait a switch interval: where the slots form few runs of consecutive slots, one gather
        and one `_foreach_copy_` of views (indexing a tensor takes no lock turn), not an indexed store per layer."""
        dev = self.device
        order = sorted(range(len(slots)), key=slots.__getitem__)
        slots, indices = [slots[i] for i in order], [indices[i] for i in order]
        width = max(batch.widths[i] for i in indices)
        runs = slot_runs(slots)
        host = torch.tensor([slots, indices, [batch.starts[i] for i in indices]])
        slot, index, start = host.to(dev, non_blocking=True).unbind(0)
        tokens = (start[:, None] + torch.arange(width, device=dev)).clamp_(max=batch.tokens - 1)
        caches = pool.keys + pool.values
        if len(runs) > FOREACH_RUNS:
            # A slot takes its prompt's tokens and what follows them in the batch up to the longest prompt copied;
            # `valid` keeps those out, and decoding overwrites them.
            gathered = batch.stack[:, :, tokens]  # [2 * layers, Hkv, rows, width, D]
            for cache, part in zip(caches, gathered):
                cache[slot, :, :width] = part.transpose(0, 1)
            pool.hidden[slot] = batch.hidden[index]
            return
        heads = self._head_index(batch.stack.shape[1])
        gathered = batch.stack[:, heads, tokens[:, None, :]]  # [2 * layers, rows, Hkv, width, D]
        hidden = batch.hidden[index]
        into, out = [], []
        for first, last, at in runs:
            n = last - first
            into += [cache[at:at + n, :, :width] for cache in caches] + [pool.hidden[at:at + n]]
            out += [gathered[layer, first:last] for layer in range(len(caches))] + [hidden[first:last]]
        torch._foreach_copy_(into, out)

    def _head_index(self, heads: int) -> Tensor:
        """[1, heads, 1] on the pool's device: indexes a prefill's K/V heads beside its tokens."""
        if self._heads is None or self._heads.shape[1] != heads:
            self._heads = torch.arange(heads, device=self.device)[None, :, None]
        return self._heads

    def _write_settings(self, pool: "_Slots", slots: list[int], widths: list[int],
                        samplings: list[RowSampling]) -> None:
        """Each new row's position, cache mask, noise key, limits and sampling settings into its slot: one tensor of
        each dtype to the device, then one `_foreach_copy_` per few runs of consecutive slots (`_write_prompts`)."""
        dev = self.device
        order = sorted(range(len(slots)), key=slots.__getitem__)
        slots = [slots[i] for i in order]
        widths = [widths[i] for i in order]
        samplings = [samplings[i] for i in order]
        runs = slot_runs(slots)
        longs = torch.tensor([[w, w, 0, s.key, s.max_tokens] for w, s in zip(widths, samplings)], device=dev)
        floats = torch.tensor([[1.0 if s.greedy else s.temperature, s.top_p] for s in samplings], dtype=torch.float32,
                              device=dev)
        flags = torch.tensor([[s.greedy, s.plain, False] for s in samplings], dtype=torch.bool, device=dev)
        valid = torch.arange(self.length, device=dev)[None, :] < longs[:, :1]
        columns = [("position", longs, 0), ("write", longs, 1), ("step", longs, 2), ("key", longs, 3),
                   ("limit", longs, 4), ("greedy", flags, 0), ("plain", flags, 1), ("done", flags, 2)]
        if len(runs) > FOREACH_RUNS:
            slot = torch.tensor(slots, device=dev)
            for name, source, column in columns:
                getattr(pool, name)[slot] = source[:, column]
            pool.temperature[slot] = floats[:, :1]
            pool.top_p[slot] = floats[:, 1:]
            pool.valid[slot] = valid
            return
        into, out = [], []
        for first, last, at in runs:
            end = at + last - first
            for name, source, column in columns:
                into.append(getattr(pool, name)[at:end])
                out.append(source[first:last, column])
            into += [pool.temperature[at:end], pool.top_p[at:end], pool.valid[at:end]]
            out += [floats[first:last, :1], floats[first:last, 1:], valid[first:last]]
        torch._foreach_copy_(into, out)

    def release(self, slots: list[int]) -> None:
        """Free rows before they end (the caller drops what they sampled)."""
        if not slots:
            return
        with self._on_device():
            self._keep_prefixes([b for b in slots if b in self.live])
            self._pool.done[torch.tensor(slots, device=self.device)] = True
        for b in slots:
            self.live.pop(b, None)
            self._rows.pop(b, None)
            self._sampled.pop(b, None)
            self._sequence.pop(b, None)

    @torch.no_grad()
    def run(self) -> list[Delivery]:
        """Decode up to `check_every` steps of the live rows; each live row's new tokens (ended rows leave)."""
        if not self.live:
            return []
        with self._on_device():
            pool = self._pool
            variant = "race" if all(r.plain for r in self._rows.values()) else "full"
            left = max(r.max_tokens - self._sampled[b] for b, r in self._rows.items())
            steps = min(self.check_every, left)
            pool.start.copy_(pool.step)
            graph = self._graph(pool, variant)
            for _ in range(steps):
                if graph is not None:
                    graph.replay()
                else:
                    self._step(pool, variant)
            columns = (pool.start[:, None] + torch.arange(steps, device=self.device)).clamp(max=pool.out_tokens.shape[1] - 1)
            packed = [pool.done.long(), pool.step - pool.start, pool.out_tokens.gather(1, columns)]
            logps = pool.out_logps.gather(1, columns)
            top = None
            if any(r.top_logprobs for r in self._rows.values()):
                index = columns[:, :, None].expand(-1, -1, MAX_TOP)
                top = (pool.out_top_ids.gather(1, index).cpu(), pool.out_top_logps.gather(1, index).cpu())
            ints = torch.cat([packed[0][:, None], packed[1][:, None], packed[2]], dim=1).cpu().tolist()
            logps = logps.cpu().tolist()
        deliveries = []
        for b in sorted(self.live):
            done, new, *tokens = ints[b]
            sampling = self._rows[b]
            k = sampling.top_logprobs
            row_top = None
            if k and top is not None:
                row_top = [list(zip(top[0][b, t, :k].tolist(), top[1][b, t, :k].tolist())) for t in range(new)]
            deliveries.append(Delivery(self.live[b], b, tokens[:new], logps[b][:new], row_top, bool(done)))
        for d in deliveries:
            self._sampled[d.slot] += len(d.tokens)
            self._sequence[d.slot] += d.tokens
        ended = [d.slot for d in deliveries if d.ended]
        if ended:
            with self._on_device():
                self._keep_prefixes(ended)
        for b in ended:
            self.live.pop(b)
            self._rows.pop(b)
            self._sampled.pop(b)
            self._sequence.pop(b)
        return deliveries

    def _keep_prefixes(self, slots: list[int]) -> None:
        """The K/V of rows that end (their prompt and every token they sampled) into the prefix cache."""
        if slots:
            self.prefills.prefix.keep([(self._sequence[b], b) for b in slots], self._pool.keys, self._pool.values)

    # --- pool sizes ---------------------------------------------------------------------------------------
    def _resize(self, rows: int) -> None:
        """Move the live rows into the pool for `rows` rows: grown to the bucket that holds them, or shrunk once
        a quarter of the pool or less is live (never below `floor` slots)."""
        want = max(bucket_for(max(rows, 1)), self.floor)
        if self._pool is not None and (self.slots >= want and not (self.slots > self.floor and rows * 4 <= self.slots)):
            return
        target = self._slots_of(want)
        if self._pool is not None and target is not self._pool:
            live = sorted(self.live)
            if live:
                moved = torch.tensor(live, device=self.device)
                into = torch.arange(len(live), device=self.device)
                for name in ("keys", "values"):
                    for t, s in zip(getattr(target, name), getattr(self._pool, name)):
                        t[into] = s[moved]
                for name in self.PER_ROW:
                    getattr(target, name)[into] = getattr(self._pool, name)[moved]
            target.done[len(live):] = True
            self.live = {i: self.live[b] for i, b in enumerate(live)}
            self._rows = {i: self._rows[b] for i, b in enumerate(live)}
            self._sampled = {i: self._sampled[b] for i, b in enumerate(live)}
            self._sequence = {i: self._sequence[b] for i, b in enumerate(live)}
        self._pool = target

    def shrink(self) -> None:
        """Move a mostly empty pool into a smaller one (called between runs)."""
        if self._pool is not None and self.slots > self.floor and len(self.live) * 4 <= self.slots:
            with self._on_device():
                self._resize(len(self.live))

    def _slots_of(self, bucket: int) -> _Slots:
        if bucket in self._pools:
            return self._pools[bucket]
        dev, n = self.device, self.length
        # one tensor per layer, not views of one: the compiled decode layers write into them
        keys, values = self.decoder.new_cache(bucket, self.length, dev)

        def rows(dtype=torch.long, columns=(), fill=0):
            return torch.full((bucket, *columns), fill, dtype=dtype, device=dev)

        pool = _Slots(keys=keys, values=values, hidden=rows(self.decoder.dtype, (self.decoder.hidden_size,)),
                      position=rows(), write=rows(), step=rows(), key=rows(), limit=rows(fill=1),
                      temperature=rows(torch.float32, (1,), 1.0), top_p=rows(torch.float32, (1,), 1.0),
                      greedy=rows(torch.bool), plain=rows(torch.bool, fill=True), valid=rows(torch.bool, (n,)),
                      done=rows(torch.bool, fill=True), start=rows(), out_tokens=rows(torch.long, (n + 1,)),
                      out_logps=rows(torch.float32, (n + 1,)), out_top_ids=rows(torch.long, (n + 1, MAX_TOP)),
                      out_top_logps=rows(torch.float32, (n + 1, MAX_TOP)), graphs={})
        self._pools[bucket] = pool
        return pool

    def _graph(self, pool: _Slots, variant: str):
        """The captured step of `pool` in `variant`, captured on first use (None without graphs)."""
        if not self.sampler.use_graphs:
            return None
        if variant not in pool.graphs:
            began = time.perf_counter()
            pool.graphs[variant] = self._capture(pool, variant)
            self._decode_captures += 1
            self._decode_capture_s += time.perf_counter() - began
        return pool.graphs[variant]

    def _capture(self, pool: _Slots, variant: str):
        """Capture one step, after warm-up runs on a side stream on copies of the pool's row state (a warm-up
        step writes K/V and counters: live rows must not advance)."""
        saved = {name: getattr(pool, name).clone() for name in self.PER_ROW}
        saved_cache = [t.clone() for t in pool.keys + pool.values] if self.live else None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(3):
                self._step(pool, variant)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.sampler._capture_stream is None:
            self.sampler._capture_stream = torch.cuda.Stream(self.device)
        torch.cuda.synchronize(self.device)
        with torch.cuda.stream(self.sampler._capture_stream):
            graph.capture_begin()
            try:
                self._step(pool, variant)
            finally:
                graph.capture_end()
        torch.cuda.synchronize(self.device)
        for name, value in saved.items():
            getattr(pool, name).copy_(value)
        if saved_cache is not None:
            for t, s in zip(pool.keys + pool.values, saved_cache):
                t.copy_(s)
        return graph

    def warm_up(self, buckets: list[int] | None = None) -> None:
        """Capture the `race` step of each pool size and the packed prefill of each token bucket up front (the first
        request at a new size pays it else)."""
        with self._on_device():
            for bucket in buckets or [b for b in BATCH_BUCKETS if self.floor <= b <= self.max_slots]:
                pool = self._slots_of(bucket)
                self._graph(pool, "race")
        self.prefills.warm_up()

    # --- one decode step ----------------------------------------------------------------------------------
    def _step(self, pool: _Slots, variant: str) -> None:
        decoder = self.decoder
        logits = F.linear(pool.hidden, decoder.head_weight)
        race = decoder.race or exponential_race
        token, logp = race(logits, pool.key, pool.step, pool.temperature)
        top_ids = top_logps = None
        if variant == "full":
            scaled = logits.float() / pool.temperature
            full = torch.log_softmax(scaled, dim=-1)
            draws = (decoder.noise or keyed_exponential)(pool.key, pool.step, logits.shape[-1])
            nucleus = torch.argmax(_top_p_rows(full.exp(), pool.top_p) / draws, dim=-1)
            chosen = torch.where(pool.greedy, full.argmax(dim=-1), nucleus)
            token = torch.where(pool.plain, token, chosen)
            logp = torch.where(pool.plain, logp, full.gather(-1, chosen[:, None])[:, 0])
            best = full.topk(MAX_TOP, dim=-1)
            top_ids, top_logps = best.indices, best.values
        token, slot, lengths, live = _record_rows(token, logp, top_ids, top_logps, pool, self.eos)
        hidden = decoder.forward(token[:, None], pool.position[:, None], slot, pool.valid[:, None, :], pool.keys,
                                 pool.values, compiled=self.sampler.compiled, lengths=lengths, head=False)
        pool.hidden.copy_(hidden)
        advance = live.long()
        pool.position.add_(advance)
        pool.write.add_(advance)
        pool.step.add_(advance)

    def _on_device(self):
        return on_device(self.device)


def _top_p_rows(probs: Tensor, top_p: Tensor) -> Tensor:
    """`sampling.top_p_filter` with a top-p per row ([B, 1])."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs > top_p
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(outside, 0.0))


def _record_rows(token: Tensor, logp: Tensor, top_ids: Tensor | None, top_logps: Tensor | None, pool: _Slots,
                 eos: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`static._record` with a token limit per row (and the top log-probs of the `full` step)."""
    last = pool.out_tokens.shape[1] - 1
    rows = torch.arange(token.shape[0], device=token.device)
    live = ~pool.done
    token = torch.where(live, token, eos)
    column = torch.where(live, pool.step, last)
    pool.out_tokens[rows, column] = token
    pool.out_logps[rows, column] = logp.float()
    if top_ids is not None:
        pool.out_top_ids[rows, column] = top_ids
        pool.out_top_logps[rows, column] = top_logps
    pool.done.logical_or_((token == eos) | (pool.step >= pool.limit - 1))
    slot = pool.write.clamp(max=pool.valid.shape[1] - 1)
    pool.valid[rows, slot] = live.new_ones(())
    return token, slot[:, None], slot + 1, live
