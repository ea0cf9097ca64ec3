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
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..rollout.decoder import Packed
from ..rollout.noise import keyed_exponential
from ..rollout.sampling import exponential_race
from ..rollout.static import BATCH_BUCKETS, CACHE_STEP, SHRINK_FLOOR, GraphSampler, bucket_for

MAX_TOP = 20
"""Top log-probs a row may ask for (the `full` step records this many for every row)."""
PREFILL_TOKENS = 16384
"""Tokens (prompts one after another, or padded to the longest of their forward) a prefill forward takes at most on
CUDA."""
PREFILL_GRAPH_TOKENS = 8192
"""Packed prefills of up to this many tokens replay a captured graph, one per power of two from `PREFILL_GRAPH_MIN`
tokens (the prompts, then padding): an eager prefill forward is ~1,100 torch calls, ~40 ms of host time on an H100
for the 0.5B shape whatever its size, and a server admits a few rows at a time."""
PREFILL_GRAPH_MIN = 128
PREFILL_PADDING = 2048
"""Padding a padded prefill forward (models the packed one cannot run) may carry beyond its prompts' own tokens
before it splits: short prompts of different widths go in one forward."""
PROMPT_CACHE = 128
"""Distinct prompts whose prefill is kept beyond a full pool's (a group's G requests of one prompt prefill once);
dropped at `refresh_weights`."""


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
                 check_every: int | None = None, floor: int = SHRINK_FLOOR) -> None:
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
        self.live: dict[int, int] = {}
        """slot -> the caller's row id."""
        self._rows: dict[int, RowSampling] = {}
        self._sampled: dict[int, int] = {}
        """slot -> tokens its row has sampled (host side: how many steps a `run` may take)."""
        self._prompts: OrderedDict[tuple[int, ...], tuple] = OrderedDict()
        self._pointers: tuple[int, ...] = ()
        self.captures, self.capture_s = 0, 0.0
        """Graphs captured so far (a decode step per pool size and variant, a prefill per token bucket, on first
        use), and the seconds they took."""
        self.packed = sampler.use_graphs and self.decoder.varlen_prefill(self.device)
        """Prefill prompts one after another in one row (varlen attention), not padded to the longest."""
        self._prefill_graphs: dict[int, _PrefillGraph] = {}
        self._prefill_memory = None
        self.refresh_weights()

    # --- the caller's interface ---------------------------------------------------------------------------
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
        if self.sampler.fuse:
            self.decoder.fuse_weights()
        self._prompts.clear()
        fused = tuple(t.data_ptr() for layer in self.decoder._fused or () for t in layer if t is not None)
        pointers = self.decoder.weight_pointers() + fused
        if pointers != self._pointers:  # a weight (or a fused copy) was re-allocated: graphs would read stale memory
            for pool in self._pools.values():
                pool.graphs.clear()
            self._prefill_graphs.clear()
            self._pointers = pointers

    @torch.no_grad()
    def admit(self, rows: list[tuple[int, list[int], RowSampling]]) -> None:
        """Start rows (caller's id, prompt ids, sampling) in free slots; at most `free()` of them."""
        assert len(rows) <= self.free(), (len(rows), self.free())
        if not rows:
            return
        with self._on_device():
            self._resize(len(self.live) + len(rows))
            self.prefill([ids for _, ids, _ in rows])
            pool, dev = self._pool, self.device
            empty = [b for b in range(self.slots) if b not in self.live][:len(rows)]
            # The prompts' K/V copied in: one gather of every layer's K and V and one indexed store per layer and
            # prefill batch they came from (each op is host time, and the server's event loop contends for the
            # interpreter while this runs). A slot takes its prompt's tokens and what follows them in the batch up to the
            # longest prompt copied; `valid` keeps those out, and decoding overwrites them.
            sources: dict[int, tuple[_Prefill, list[int], list[int]]] = {}
            for i, (_, ids, _) in enumerate(rows):
                batch, index = self._prefilled(ids)
                group = sources.setdefault(id(batch), (batch, [], []))
                group[1].append(empty[i])
                group[2].append(index)
            for batch, slots, indices in sources.values():
                width = max(batch.widths[i] for i in indices)
                host = torch.tensor([slots, indices, [batch.starts[i] for i in indices]])
                slot, index, start = host.to(dev, non_blocking=True).unbind(0)
                tokens = (start[:, None] + torch.arange(width, device=dev)).clamp_(max=batch.tokens - 1)
                gathered = batch.stack[:, :, tokens]  # [2 * layers, Hkv, rows, width, D]
                for cache, part in zip(pool.keys + pool.values, gathered):
                    cache[slot, :, :width] = part.transpose(0, 1)
                pool.hidden[slot] = batch.hidden[index]
            slot = torch.tensor(empty, device=dev)
            widths = torch.tensor([len(ids) for _, ids, _ in rows], device=dev)
            samplings = [sampling for _, _, sampling in rows]

            def column(values, dtype=torch.long):
                return torch.tensor(values, dtype=dtype, device=dev)

            pool.valid[slot] = torch.arange(self.length, device=dev)[None, :] < widths[:, None]
            pool.position[slot] = widths
            pool.write[slot] = widths
            pool.step[slot] = 0
            pool.key[slot] = column([s.key for s in samplings])
            pool.limit[slot] = column([s.max_tokens for s in samplings])
            pool.temperature[slot] = column([[1.0 if s.greedy else s.temperature] for s in samplings], torch.float32)
            pool.top_p[slot] = column([[s.top_p] for s in samplings], torch.float32)
            pool.greedy[slot] = column([s.greedy for s in samplings], torch.bool)
            pool.plain[slot] = column([s.plain for s in samplings], torch.bool)
            pool.done[slot] = False
        for (row_id, _, sampling), b in zip(rows, empty):
            self.live[b] = row_id
            self._rows[b] = sampling
            self._sampled[b] = 0

    def release(self, slots: list[int]) -> None:
        """Free rows before they end (the caller drops what they sampled)."""
        if not slots:
            return
        with self._on_device():
            self._pool.done[torch.tensor(slots, device=self.device)] = True
        for b in slots:
            self.live.pop(b, None)
            self._rows.pop(b, None)
            self._sampled.pop(b, None)

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
            if d.ended:
                self.live.pop(d.slot)
                self._rows.pop(d.slot)
                self._sampled.pop(d.slot)
        return deliveries

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
            self.captures += 1
            self.capture_s += time.perf_counter() - began
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
            if self.packed:
                tokens = PREFILL_GRAPH_MIN
                while tokens <= PREFILL_GRAPH_TOKENS:
                    self._prefill_graph(tokens)
                    tokens *= 2

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

    # --- prefill --------------------------------------------------------------------------------------------
    def _prefilled(self, ids: list[int]) -> tuple["_Prefill", int]:
        """The prefill batch holding prompt `ids` and its row there (prefilled once while cached)."""
        key = tuple(ids)
        if key in self._prompts:
            self._prompts.move_to_end(key)
            return self._prompts[key]
        self.prefill([ids])
        return self._prompts[key]

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> None:
        """Prefill the distinct prompts not cached yet. On CUDA, several prompts per forward: one after another in
        one row (`packed`, each attending to its own tokens: varlen attention), up to `PREFILL_TOKENS` tokens and
        a full pool's prompts a forward, a captured graph for up to `PREFILL_GRAPH_TOKENS`; where the model's
        attention is not varlen's (a sliding window), right-padded to the longest of their forward (the padding at
        most the prompts' own tokens plus `PREFILL_PADDING`). An admission is then one forward or a few, whatever
        its prompts' widths. On CPU each alone (a prompt's K/V then do not depend on the others)."""
        todo = list(dict.fromkeys(tuple(p) for p in prompts if tuple(p) not in self._prompts))
        with self._on_device():
            if not self.sampler.use_graphs and not self.packed:
                for p in todo:
                    self._prefill_padded([p])
                return
            part: list[tuple[int, ...]] = []
            own = 0
            for p in (todo if self.packed else sorted(todo, key=len)):
                if self.packed:
                    full = own + len(p) > PREFILL_TOKENS or len(part) == self.max_slots
                else:
                    padded = (len(part) + 1) * len(p)
                    full = padded > PREFILL_TOKENS or padded - own - len(p) > own + len(p) + PREFILL_PADDING
                if part and full:
                    (self._prefill_packed if self.packed else self._prefill_padded)(part)
                    part, own = [], 0
                part.append(p)
                own += len(p)
            if part:
                (self._prefill_packed if self.packed else self._prefill_padded)(part)

    def _prefill_padded(self, part: list[tuple[int, ...]]) -> None:
        """One prefill forward of prompts `part`, right-padded to the longest; each row's hidden is its last token's."""
        dev = self.device
        widths = [len(p) for p in part]
        width, count = max(widths), len(part)
        ids = torch.tensor([list(p) + [self.eos] * (width - len(p)) for p in part], device=dev)
        stack, keys, values = self._new_cache(count, width)
        positions = torch.arange(width, device=dev).expand(count, width)
        causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril().expand(count, width, width)
        last = None if min(widths) == width else torch.tensor(widths, device=dev) - 1
        hidden = self.decoder.forward(ids, positions, torch.arange(width, device=dev), causal, keys, values,
                                      head=False, last=last)
        # as one row: [2L, Hkv, count * W, D], row i's tokens from i * W
        stack = stack.transpose(1, 2).reshape(stack.shape[0], stack.shape[2], count * width, stack.shape[4])
        self._keep(part, _Prefill(stack, hidden, [i * width for i in range(count)], widths))

    def _prefill_packed(self, part: list[tuple[int, ...]]) -> None:
        """One prefill forward of prompts `part` one after another in one row (each attends to its own tokens); a
        captured graph's (the next power of two of tokens, the rest padding) where there is one."""
        widths = [len(p) for p in part]
        total = sum(widths)
        starts = [0]
        for w in widths:
            starts.append(starts[-1] + w)
        ids = [t for p in part for t in p]
        positions = [i for w in widths for i in range(w)]
        last = [s - 1 for s in starts[1:]]
        tokens = max(PREFILL_GRAPH_MIN, 1 << (total - 1).bit_length())
        if self.sampler.use_graphs and tokens <= PREFILL_GRAPH_TOKENS and max(widths) <= self._longest(tokens):
            graph = self._prefill_graph(tokens)
            fill = tokens - total  # one padding sequence after the prompts, then empty ones
            offsets = starts + [tokens] * (graph.rows + 2 - len(starts))
            graph.inputs.copy_(torch.tensor(ids + [self.eos] * fill + positions + list(range(fill))
                                            + last + [0] * (graph.rows - len(last)) + offsets), non_blocking=True)
            graph.graph.replay()
            stack, hidden = graph.stack[:, 0, :, :total].clone(), graph.hidden[:len(part)].clone()
        else:
            stack, keys, values = self._new_cache(1, total)
            host = torch.tensor(ids + positions + last + starts).to(self.device, non_blocking=True)
            hidden = self._packed_forward(host, total, len(part), max(widths), keys, values)
            stack = stack[:, 0]
        self._keep(part, _Prefill(stack, hidden, starts[:-1], widths))

    def _packed_forward(self, inputs: Tensor, tokens: int, rows: int, longest: int, keys: list[Tensor],
                        values: list[Tensor]) -> Tensor:
        """The packed prefill forward of `inputs` (ids [tokens], positions [tokens], each prompt's last token [rows],
        offsets [rows + 1 or more]); K/V into caches [1, Hkv, tokens, D]; the prompts' hidden [rows, H]."""
        ids, positions = inputs[:tokens][None], inputs[tokens:2 * tokens][None]
        last, offsets = inputs[2 * tokens:2 * tokens + rows], inputs[2 * tokens + rows:].int()
        return self.decoder.forward(ids, positions, torch.arange(tokens, device=ids.device), None, keys, values,
                                    head=False, last=last, packed=Packed(offsets, longest))

    def _longest(self, tokens: int) -> int:
        """The longest prompt a prefill graph of `tokens` tokens takes: varlen attention covers each sequence's
        first this many tokens (the padding sequence's rest is left uncomputed, and nothing reads it)."""
        return min(tokens, self.length)

    def _prefill_graph(self, tokens: int) -> "_PrefillGraph":
        """The captured packed prefill of `tokens` tokens (up to a full pool's prompts), captured on first use."""
        if tokens in self._prefill_graphs:
            return self._prefill_graphs[tokens]
        began = time.perf_counter()
        rows, dev = min(tokens, self.max_slots), self.device
        inputs = torch.zeros(2 * tokens + 2 * rows + 2, dtype=torch.long, device=dev)
        inputs[2 * tokens + rows + 1:] = tokens  # one sequence of every token for the warm-up runs
        stack, keys, values = self._new_cache(1, tokens)
        longest = self._longest(tokens)
        if self._prefill_memory is None:
            self._prefill_memory = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._packed_forward(inputs, tokens, rows, longest, keys, values)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.sampler._capture_stream is None:
            self.sampler._capture_stream = torch.cuda.Stream(dev)
        with torch.cuda.graph(graph, pool=self._prefill_memory, stream=self.sampler._capture_stream):
            hidden = self._packed_forward(inputs, tokens, rows, longest, keys, values)
        self._prefill_graphs[tokens] = _PrefillGraph(graph, inputs, stack, hidden, rows)
        self.captures += 1
        self.capture_s += time.perf_counter() - began
        return self._prefill_graphs[tokens]

    def _keep(self, part: list[tuple[int, ...]], batch: "_Prefill") -> None:
        for i, p in enumerate(part):
            self._prompts[p] = (batch, i)
            while len(self._prompts) > PROMPT_CACHE + self.max_slots:
                self._prompts.popitem(last=False)

    def _new_cache(self, rows: int, length: int) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """A prefill's K/V caches of every layer as one tensor [2 * layers, rows, Hkv, length, D] (one op gathers a
        prompt's from all of them), and its per-layer views (keys, values) the eager prefill forward writes."""
        d, layers = self.decoder, self.decoder.num_layers
        stack = torch.zeros(2 * layers, rows, d.num_kv_heads, length, d.head_dim, dtype=d.dtype, device=self.device)
        views = list(stack.unbind(0))
        return stack, views[:layers], views[layers:]

    def _on_device(self):
        import contextlib

        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()


@dataclass
class _Prefill:
    """One prefill forward's prompts as one row: every layer's K and V [2 * layers, Hkv, tokens, D] (prompt i's from
    `starts[i]`, `widths[i]` tokens), their final-normed last hidden [prompts, H]. Kept while any of its prompts is
    in the prompt cache."""

    stack: Tensor
    hidden: Tensor
    starts: list[int]
    widths: list[int]

    @property
    def tokens(self) -> int:
        return self.stack.shape[2]


@dataclass
class _PrefillGraph:
    """A captured packed prefill of a fixed number of tokens: it reads `inputs` (ids, positions, each prompt's last
    token, offsets: `_packed_forward`), writes `stack` [2 * layers, 1, Hkv, tokens, D] and `hidden` [rows, H]."""

    graph: "torch.cuda.CUDAGraph"
    inputs: Tensor
    stack: Tensor
    hidden: Tensor
    rows: int


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
