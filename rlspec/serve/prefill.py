"""A serving pool's prefills (`rlspec.serve.pool.ServingPool` admits rows from them): each distinct prompt's K/V and
last hidden state, computed once and kept while more rows of it may start (a group's G samples as G requests).

On CUDA an admission's new prompts go in one forward: one after another in one row (`packed`), each attending to its
own tokens only (torch's varlen flash kernel, `StaticDecoder.forward(packed=...)`), replayed from a captured graph per
power of two of tokens up to `PREFILL_GRAPH_TOKENS` (the eager forward is ~1,100 torch calls, ~40 ms of host time
for the 0.5B shape on an H100, whatever its size); a model whose attention the varlen kernel does not compute (a
sliding window) right-pads its prompts to the longest of their forward. On CPU each prompt alone: its K/V then do not
depend on the others. A prefill keeps every layer's K and V as one tensor, so a slot's copy is one gather.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from ..rollout.decoder import Packed
from . import prefix_cache
from .prefix_cache import PrefixCache, extend, extension_batches

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
        """Ended rows' K/V by token ids: a prompt extending one prefills only its new tokens (`prefix_cache.py`)."""
        self.graphs: dict[int, _Graph] = {}
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
        """Prefill the prompts of `todo` that extend a kept sequence from it (`prefix_cache.extend`); the others."""
        if not len(self.prefix):
            return todo
        rest, rows = [], []
        for p in todo:
            entry, reused = self.prefix.match(p)
            if entry is None:
                rest.append(p)
            else:
                rows.append((p, entry, reused))
        if self.sampler.use_graphs and sum(m for _, _, m in rows) < prefix_cache.GRAPH_MIN_REUSED:
            self.prefix.stats["declined"] += len(rows)  # the captured packed prefill is cheaper here
            return rest + [p for p, _, _ in rows]
        for part in extension_batches(rows, separate=not self.sampler.use_graphs and not self.packed):
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
        if self._memory is None:
            self._memory = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._packed_forward(inputs, tokens, rows, longest, keys, values)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.sampler._capture_stream is None:
            self.sampler._capture_stream = torch.cuda.Stream(dev)
        with torch.cuda.graph(graph, pool=self._memory, stream=self.sampler._capture_stream):
            hidden = self._packed_forward(inputs, tokens, rows, longest, keys, values)
        self.graphs[tokens] = _Graph(graph, inputs, stack, hidden, rows)
        self.captures += 1
        self.capture_s += time.perf_counter() - began
        return self.graphs[tokens]

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
