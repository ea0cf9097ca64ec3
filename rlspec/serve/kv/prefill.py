"""A serving pool's prefills (`rlspec.serve.pool.ServingPool` admits rows from them): each distinct prompt's K/V and
last hidden state, computed once and kept while more rows of it may start (a group's G samples as G requests).

On CUDA an admission's new prompts go in one forward: one after another in one row (`packed`), each attending to its
own tokens only (torch's varlen flash kernel, `StaticDecoder.forward(packed=...)`), replayed from a captured graph per
power of two of tokens up to `PREFILL_GRAPH_TOKENS` (the eager forward is ~1,100 torch calls, ~40 ms of host time
for the 0.5B shape on an H100, whatever its size); a model whose attention the varlen kernel does not compute (a
sliding window) right-pads its prompts to the longest of their forward. On CPU each prompt alone: its K/V then do not
depend on the others. A prefill keeps every layer's K and V as one tensor, so a slot's copy is one gather.

Prefix reuse across turns (`prefix.PrefixCache`): the K/V of rows that ended are kept by their token ids, so that a
prompt extending one of them (an agent's next turn: the conversation so far, then a tool result) prefills only its
new tokens. Where prefills are packed (CUDA), an admission's extensions go in one forward too, replayed
from a captured graph per power of two of new tokens and of key tokens (`Prefills.extension_graph`): their kept K/V
copied one after another into one key buffer, their new tokens one after another in one row, each attending to its
own context (varlen attention with key offsets of their own). Elsewhere, or for a turn the graphs cannot take, the
eager `extend`.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from ...rollout.decoder import Packed
from .prefix import PrefixCache, extend, extension_batches

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
dropped at the pool's `refresh_weights`."""
GRAPH_MIN_REUSED = PREFILL_GRAPH_TOKENS
"""Where the pool's prefills replay captured packed graphs (CUDA, 16-bit, varlen attention), the turns that the
captured extension cannot take (over `PREFILL_GRAPH_TOKENS` new tokens, a context past its key buffer, no memory for
that buffer) are extended eagerly only when they reuse this many tokens together; else they take the captured packed
prefill. The eager extension is host-bound: on one H200, 0.5B shape, ~2.1k-token contexts + 50 new tokens
(`tests/gpu/probe_prefix.py`, 168d605), 26 ms for 1 row against 19 ms for the captured full prefill, 29 against 75
ms for 8 rows, 144 against 490 ms for 64 rows."""
EXTEND_BYTES = 2 << 30
"""The K/V buffer of one extension forward at most: the captured one's key buffer (the contexts one after another,
made once per pool, at most a full pool's K/V), the eager one's rows x (their longest kept prefix + new tokens). Each
eager forward is ~1,100 torch calls of host time whatever its size, so as few as fit. 2 GiB: 64 rows of 2.2k tokens
of the 0.5B shape (12 KiB a token) in one forward."""


class Prefills:
    """The prefills of one serving pool and the graphs that compute them (see the module docstring). Not
    thread-safe: the pool's thread calls everything."""

    def __init__(self, sampler, eos: int, max_slots: int, length: int) -> None:
        self.sampler = sampler
        self.decoder = sampler.decoder
        self.device = sampler.device
        self.eos = eos
        self.max_slots = max_slots
        """Rows a pool admits at most (the prompts of one packed forward)."""
        self.length = length
        """The pool's cache length: no prompt is longer."""
        self.cache: OrderedDict[tuple[int, ...], tuple] = OrderedDict()
        """prompt -> (its prefill batch, its row there): the last `PROMPT_CACHE` distinct prompts beyond a full
        pool's."""
        self.packed = sampler.use_graphs and self.decoder.varlen_prefill(self.device)
        """Prefill prompts one after another in one row (varlen attention), not padded to the longest."""
        self.prefix = PrefixCache(max_slots * length)
        """Ended rows' K/V by token ids: a prompt extending one prefills only its new tokens (`PrefixCache`)."""
        self.graphs: dict = {}
        """Captured forwards: the packed prefill per token bucket (by its tokens), the extension per bucket of new
        tokens and of key tokens (by ("extend", tokens, keys))."""
        self._keys = None
        self._keys_failed = False
        self._key_tokens = 0
        """The extension forwards' key buffer (`_keys_buffer`): contexts of this many tokens together at most."""
        self._memory = None
        self.captures, self.capture_s = 0, 0.0
        """Graphs captured (one per token bucket, on first use) and the seconds they took."""

    def warm_up(self) -> None:
        """Capture the packed prefill of every token bucket now."""
        if self.packed:
            with on_device(self.device):
                tokens = PREFILL_GRAPH_MIN
                while tokens <= PREFILL_GRAPH_TOKENS:
                    self.graph(tokens)
                    tokens *= 2

    def get(self, ids: list[int]) -> tuple["Prefill", int]:
        """The prefill batch holding prompt `ids` and its row there (prefilled once while cached)."""
        key = tuple(ids)
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        self.prefill([ids])
        return self.cache[key]

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> None:
        """Prefill the distinct prompts not cached yet. On CUDA, several prompts per forward: one after another in
        one row (`packed`, each attending to its own tokens: varlen attention), up to `PREFILL_TOKENS` tokens and
        a full pool's prompts a forward, a captured graph for up to `PREFILL_GRAPH_TOKENS`; where the model's
        attention is not varlen's (a sliding window), right-padded to the longest of their forward (the padding at
        most the prompts' own tokens plus `PREFILL_PADDING`). An admission is then one forward or a few, whatever
        its prompts' widths. On CPU each alone (a prompt's K/V then do not depend on the others)."""
        todo = list(dict.fromkeys(tuple(p) for p in prompts if tuple(p) not in self.cache))
        with on_device(self.device):
            todo = self._extend(todo)
            if not self.sampler.use_graphs and not self.packed:
                for p in todo:
                    self.padded([p])
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
                    (self._packed if self.packed else self.padded)(part)
                    part, own = [], 0
                part.append(p)
                own += len(p)
            if part:
                (self._packed if self.packed else self.padded)(part)

    def _extend(self, todo: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Prefill the prompts of `todo` that extend a kept sequence from it (`extend`); the others."""
        if not len(self.prefix):
            return todo
        rest, rows = [], []
        for p in todo:
            entry, reused = self.prefix.match(p)
            if entry is None:
                rest.append(p)
            else:
                rows.append((p, entry, reused))
        if self.packed:
            rows = self._extend_captured(rows)
        if self.packed and sum(m for _, _, m in rows) < GRAPH_MIN_REUSED:
            self.prefix.stats["declined"] += len(rows)  # the captured packed prefill is cheaper here
            return rest + [p for p, _, _ in rows]
        for part in extension_batches(rows, separate=not self.sampler.use_graphs and not self.packed,
                                      cells=EXTEND_BYTES // self._token_bytes()):
            stack, hidden, starts, widths = extend(self.decoder, part, self.eos, self.device)
            self._keep([p for p, _, _ in part], Prefill(stack, hidden, starts, widths))
        return rest

    def padded(self, part: list[tuple[int, ...]]) -> None:
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
        self._keep(part, Prefill(stack, hidden, [i * width for i in range(count)], widths))

    def _packed(self, part: list[tuple[int, ...]]) -> None:
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
            graph = self.graph(tokens)
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
        self._keep(part, Prefill(stack, hidden, starts[:-1], widths))

    def _packed_forward(self, inputs: Tensor, tokens: int, rows: int, longest: int, keys: list[Tensor],
                        values: list[Tensor]) -> Tensor:
        """The packed prefill forward of `inputs` (ids [tokens], positions [tokens], each prompt's last token [rows],
        offsets [rows + 1 or more]); K/V into caches [1, Hkv, tokens, D]; the prompts' hidden [rows, H]."""
        ids, positions = inputs[:tokens][None], inputs[tokens:2 * tokens][None]
        last, offsets = inputs[2 * tokens:2 * tokens + rows], inputs[2 * tokens + rows:].int()
        return self.decoder.forward(ids, positions, torch.arange(tokens, device=ids.device), None, keys, values,
                                    head=False, last=last, packed=Packed(offsets, longest))

    def _extend_captured(self, rows: list) -> list:
        """Extend `rows` (prompt, kept entry, tokens reused) by captured extension forwards (`extension_graph`), as
        many a forward as its graph takes; the rows it cannot take (more new tokens than `PREFILL_GRAPH_TOKENS`, a
        context past the key buffer, or no memory for that buffer), for the eager `extend`."""
        if not rows or self._keys_buffer() is None:
            return rows
        limit = self._key_tokens
        eager, part, new, keys = [], [], 0, 0
        for row in rows:
            prompt, _, reused = row
            if len(prompt) - reused > PREFILL_GRAPH_TOKENS or len(prompt) > limit:
                eager.append(row)
                continue
            if part and (len(part) == self.max_slots or new + len(prompt) - reused > PREFILL_GRAPH_TOKENS
                         or keys + len(prompt) > limit):
                self._extension(part)
                part, new, keys = [], 0, 0
            part.append(row)
            new += len(prompt) - reused
            keys += len(prompt)
        if part:
            self._extension(part)
        return eager

    def _extension(self, part: list) -> None:
        """One captured extension forward of `part` (prompt, kept entry, tokens reused): each prompt's kept K/V copied
        into the key buffer (prompt i's whole context from `starts[i]`, one after another), its new tokens one after
        another in one row, each attending to its own context (`Packed` with key offsets); the new tokens' K/V
        written after their prefix, the padding's after the last context."""
        new = [len(p) - m for p, _, m in part]
        widths = [len(p) for p, _, _ in part]
        total, context = sum(new), sum(widths)
        tokens = max(PREFILL_GRAPH_MIN, 1 << (total - 1).bit_length())
        fill = tokens - total
        graph = self.extension_graph(tokens, self._key_bucket(context + fill))
        stack = self._keys
        starts, q_offsets = [0], [0]
        for width, n in zip(widths, new):
            starts.append(starts[-1] + width)
            q_offsets.append(q_offsets[-1] + n)
        # one call for every row's copy: each torch call of the engine thread gives the interpreter lock up, and
        # while agents run, takes a while to get it back
        torch._foreach_copy_([stack[:, 0, :, start:start + m] for (_, _, m), start in zip(part, starts)],
                             [entry.stack[:, :, :m] for _, entry, m in part])
        ids = [t for p, _, m in part for t in p[m:]] + [self.eos] * fill
        positions = [m + j for p, _, m in part for j in range(len(p) - m)] + list(range(fill))
        slots = ([start + m + j for (p, _, m), start in zip(part, starts) for j in range(len(p) - m)]
                 + [context + j for j in range(fill)])
        last = [q - 1 for q in q_offsets[1:]] + [0] * (graph.rows - len(part))
        spare = graph.rows + 2 - len(q_offsets)  # the padding sequence, then empty ones
        graph.inputs.copy_(torch.tensor(ids + positions + slots + last + q_offsets + [tokens] * spare
                                        + starts + [context + fill] * spare), non_blocking=True)
        graph.graph.replay()
        kept = stack[:, 0, :, :context].clone(memory_format=torch.contiguous_format)
        self._keep([p for p, _, _ in part], Prefill(kept, graph.hidden[:len(part)].clone(), starts[:-1], widths))
        self.prefix.stats["captured"] += len(part)

    def _extension_forward(self, inputs: Tensor, tokens: int, rows: int, keys: list[Tensor],
                           values: list[Tensor]) -> Tensor:
        """The extension forward of `inputs` (new tokens' ids, positions and key-buffer slots [tokens] each, each
        prompt's last new token [rows], query offsets and key offsets [rows + 2] each) against the key buffer's
        per-layer `keys`, `values` [1, Hkv, S, D]; the prompts' hidden [rows, H]."""
        t = tokens
        ids, positions, slots = inputs[:t][None], inputs[t:2 * t][None], inputs[2 * t:3 * t]
        last = inputs[3 * t:3 * t + rows]
        q_offsets, k_offsets = inputs[3 * t + rows:3 * t + 2 * rows + 2].int(), inputs[3 * t + 2 * rows + 2:].int()
        return self.decoder.forward(ids, positions, slots, None, keys, values, head=False, last=last,
                                    packed=Packed(q_offsets, self._longest(tokens), k_offsets, self.length))

    def _keys_buffer(self):
        """The extension forwards' key buffer [2 * layers, 1, Hkv, tokens, D], made on first use (`_key_tokens`
        contexts, then room for a graph's padding); None where there is no memory for it (extensions then go the
        eager way)."""
        if self._keys is None and not self._keys_failed:
            d = self.decoder
            self._key_tokens = min(EXTEND_BYTES // self._token_bytes(), self.max_slots * self.length)
            try:  # [2 * layers, tokens, Hkv, D] in memory, seen as [2 * layers, 1, Hkv, tokens, D]: the layout the
                # varlen kernel reads keys in ([tokens, Hkv, D]), so no layer copies it
                memory = torch.zeros(2 * d.num_layers, self._key_tokens + PREFILL_GRAPH_TOKENS, d.num_kv_heads,
                                     d.head_dim, dtype=d.dtype, device=self.device)
            except torch.OutOfMemoryError:
                self._keys_failed = True
                return None
            self._keys = memory.permute(0, 2, 1, 3)[:, None]
        return self._keys

    def _token_bytes(self) -> int:
        """One token's K and V of every layer, in bytes."""
        d = self.decoder
        return 2 * d.num_layers * d.num_kv_heads * d.head_dim * d.dtype.itemsize

    def _key_bucket(self, keys: int) -> int:
        """The key buffer's first this many tokens hold `keys`: a power of two from `PREFILL_GRAPH_TOKENS`, or the
        whole buffer."""
        whole = self._key_tokens + PREFILL_GRAPH_TOKENS
        return min(whole, max(PREFILL_GRAPH_TOKENS, 1 << (keys - 1).bit_length()))

    def extension_graph(self, tokens: int, key_tokens: int) -> "_Graph":
        """The captured extension forward of `tokens` new tokens (up to a full pool's prompts) against the key buffer's
        first `key_tokens` tokens (`_key_bucket`: where torch's varlen kernel takes no grouped-query heads, every layer
        repeats the keys it is given per query head, so it is given no more than the contexts need), captured on
        first use; every one reads and writes the one key buffer."""
        key = ("extend", tokens, key_tokens)
        if key in self.graphs:
            return self.graphs[key]
        began = time.perf_counter()
        rows, dev = min(tokens, self.max_slots), self.device
        stack = self._keys
        views = list(stack[..., :key_tokens, :].unbind(0))
        keys, values = views[:self.decoder.num_layers], views[self.decoder.num_layers:]
        inputs = torch.zeros(3 * tokens + 3 * rows + 4, dtype=torch.long, device=dev)
        inputs[2 * tokens:3 * tokens] = torch.arange(tokens, device=dev)  # warm-up runs: one sequence of every token
        inputs[3 * tokens + rows + 1:3 * tokens + 2 * rows + 2] = tokens
        inputs[3 * tokens + 2 * rows + 3:] = tokens  # (a bucket of keys holds at least a bucket of new tokens)
        return self._captured(key, began, lambda: self._extension_forward(inputs, tokens, rows, keys, values),
                              inputs, stack, rows)

    def _longest(self, tokens: int) -> int:
        """The longest prompt a prefill graph of `tokens` tokens takes: varlen attention covers each sequence's
        first this many tokens (the padding sequence's rest is left uncomputed, and nothing reads it)."""
        return min(tokens, self.length)

    def graph(self, tokens: int) -> "_Graph":
        """The captured packed prefill of `tokens` tokens (up to a full pool's prompts), captured on first use."""
        if tokens in self.graphs:
            return self.graphs[tokens]
        began = time.perf_counter()
        rows, dev = min(tokens, self.max_slots), self.device
        inputs = torch.zeros(2 * tokens + 2 * rows + 2, dtype=torch.long, device=dev)
        inputs[2 * tokens + rows + 1:] = tokens  # one sequence of every token for the warm-up runs
        stack, keys, values = self._new_cache(1, tokens)
        longest = self._longest(tokens)
        return self._captured(tokens, began, lambda: self._packed_forward(inputs, tokens, rows, longest, keys, values),
                              inputs, stack, rows)

    def _captured(self, key, began: float, forward, inputs: Tensor, stack: Tensor, rows: int) -> "_Graph":
        """`forward` captured (`_capture`) and kept under `key` with its inputs and outputs, counted in `captures` and
        `capture_s` (the seconds since `began`)."""
        graph, hidden = self._capture(forward)
        self.graphs[key] = _Graph(graph, inputs, stack, hidden, rows)
        self.captures += 1
        self.capture_s += time.perf_counter() - began
        return self.graphs[key]

    def _capture(self, forward) -> tuple["torch.cuda.CUDAGraph", Tensor]:
        """`forward` run twice on a side stream (warm-up), then captured in the pool's graph memory; the graph and
        what the captured run returned."""
        dev = self.device
        if self._memory is None:
            self._memory = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.sampler._capture_stream is None:
            self.sampler._capture_stream = torch.cuda.Stream(dev)
        with torch.cuda.graph(graph, pool=self._memory, stream=self.sampler._capture_stream):
            out = forward()
        return graph, out

    def _keep(self, part: list[tuple[int, ...]], batch: "Prefill") -> None:
        for i, p in enumerate(part):
            self.cache[p] = (batch, i)
            while len(self.cache) > PROMPT_CACHE + self.max_slots:
                self.cache.popitem(last=False)

    def _new_cache(self, rows: int, length: int) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """A prefill's K/V caches of every layer as one tensor [2 * layers, rows, Hkv, length, D] (one op gathers a
        prompt's from all of them), and its per-layer views (keys, values) the eager prefill forward writes."""
        d, layers = self.decoder, self.decoder.num_layers
        stack = torch.zeros(2 * layers, rows, d.num_kv_heads, length, d.head_dim, dtype=d.dtype, device=self.device)
        views = list(stack.unbind(0))
        return stack, views[:layers], views[layers:]


@dataclass
class Prefill:
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
class _Graph:
    """A captured packed prefill of a fixed number of tokens: it reads `inputs` (ids, positions, each prompt's last
    token, offsets: `_packed_forward`), writes `stack` [2 * layers, 1, Hkv, tokens, D] and `hidden` [rows, H]."""

    graph: "torch.cuda.CUDAGraph"
    inputs: Tensor
    stack: Tensor
    hidden: Tensor
    rows: int


def on_device(device: torch.device):
    """`device` current for CUDA work (a no-op on CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
