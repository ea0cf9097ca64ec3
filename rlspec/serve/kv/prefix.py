"""Prefix reuse across turns: the K/V of rows that ended, kept by their token ids (`PrefixCache`), and the eager
forward that extends a kept sequence with a prompt's new tokens (`extend`). The pool's prefills
(`rlspec.serve.kv.prefill.Prefills`) look every prompt up here and extend the hits, captured where they can.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

BLOCK = 16
"""Tokens per hashed block: a prompt is matched a block at a time, then token by token within the kept sequence."""
MIN_SHARE = 0.5
"""A match reused only when it covers at least this share of the prompt: a short shared head (a system prompt, a
group's task prompt) is left to the ordinary prefill."""
@dataclass
class _Entry:
    ids: tuple[int, ...]
    stack: Tensor
    """[2 * layers, Hkv, >= len(ids), D]: every layer's K then V (a view of the copy it was taken in)."""
    cost: int
    """Tokens counted against the bound (its share of that copy's buffer)."""
    hashes: list[int] = field(default_factory=list)


KEEP_RUNS = 8
"""Rows that end together are kept with one stack per run of consecutive slots up to this many runs (else one gather
per layer)."""


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Sorted `slots` as runs of consecutive slots: (first position, end position, first slot) each."""
    runs, first = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((first, i, slots[first]))
            first = i
    return runs


class PrefixCache:
    """The K/V of rows that ended, kept by their token ids, so that a prompt extending one of them (an agent's next
    turn: the conversation so far, then a tool result) prefills only its new tokens. Not thread-safe (the engine
    thread's).

        a row ends (end token, max tokens, a stop string, a client gone)
            -> `PrefixCache.keep`: the K/V of its prompt and every token it sampled, copied out of its slot
        a new prompt is admitted
            -> `PrefixCache.match`: the longest kept sequence it starts with (found through a hash per 16-token block)
            -> `extend`: the kept K/V copied in, the new tokens alone through the model, attending to them

    A row's K/V in its slot hold its prompt and all its sampled tokens: the decode step writes a token's K/V in the
    step that samples it, and nothing writes below a row's position afterwards. A match reuses at most the prompt's
    length less one (the last token is always computed: its hidden state is what the first new token is sampled from).

    Bounded by tokens (`max_tokens`: by default the pool's own cache, one more full pool's worth of K/V at most),
    least recently used first out. Cleared with the pool's kept prefills at `ServingPool.refresh_weights` (a push or a
    weight change: K/V of other weights are not reused), and whenever a copy out fails (no memory: serving goes on).

    On CPU (fp32, each prompt extended alone) a turn's K/V, last hidden state, sampled tokens and log-probs equal a
    fresh prefill's bit for bit (tested); on CUDA the prefix came from other kernels (decode steps, packed prefills)
    and they agree within bf16 rounding (`tests/serve/test_prefix_cache.py`, GPU-marked).
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._index: dict[int, _Entry] = {}
        self.stats = {"kept": 0, "evicted": 0, "hits": 0, "misses": 0, "reused_tokens": 0, "new_tokens": 0,
                      "declined": 0, "captured": 0}
        """Counters since start: rows kept and evicted; admitted prompts with a match (hits) and without (misses); the
        tokens reused and computed for the hits; hits prefilled whole all the same (`prefill.GRAPH_MIN_REUSED`);
        hits extended by a captured forward (`prefill.Prefills.extension_graph`)."""

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self.tokens = 0

    @torch.no_grad()
    def keep(self, rows: list[tuple[list[int], int]], keys: list[Tensor], values: list[Tensor]) -> None:
        """Keep rows (their token ids, their slot) of a slot pool whose per-layer caches are `keys`, `values`
        [slots, Hkv, S, D]: one gather per layer for all of them."""
        rows = [(ids, slot) for ids, slot in rows if len(ids) > BLOCK]
        if not rows or self.max_tokens <= 0:
            return
        width = max(len(ids) for ids, _ in rows)
        cost = width
        if cost > self.max_tokens:
            return
        caches = keys + values
        order = sorted(range(len(rows)), key=lambda i: rows[i][1])
        runs = slot_runs([rows[i][1] for i in order])
        parts: dict[int, tuple[Tensor, int]] = {}  # row -> (its copy, its place there)
        try:
            if len(runs) <= KEEP_RUNS:
                # one stack per run of consecutive slots, of slices (indexing a tensor takes no lock turn; a
                # gather per layer would be 2L torch calls, each a turn of the lock the agents' thread holds)
                for first, last, at in runs:
                    stack = torch.stack([t[at:at + last - first, :, :width] for t in caches])  # [2L, n, Hkv, W, D]
                    parts.update((order[p], (stack, p - first)) for p in range(first, last))
            else:
                index = torch.tensor([slot for _, slot in rows], device=keys[0].device)
                stack = torch.stack([t[index, :, :width] for t in caches])  # [2L, rows, Hkv, width, D]
                parts.update((i, (stack, i)) for i in range(len(rows)))
        except Exception:  # noqa: BLE001 - no memory, or a device already failing: never worth failing a row for
            self.clear()
            return
        for i, (ids, _) in enumerate(rows):
            stack, place = parts[i]
            self._add(tuple(ids), stack[:, place], cost)

    def _add(self, ids: tuple[int, ...], stack: Tensor, cost: int) -> None:
        entry = _Entry(ids, stack, cost)
        h = 0
        for start in range(0, len(ids) - BLOCK + 1, BLOCK):
            h = hash((h, ids[start:start + BLOCK]))
            entry.hashes.append(h)
            self._index[h] = entry  # the newest sequence through a block answers for it
        self._entries[id(entry)] = entry
        self.tokens += cost
        self.stats["kept"] += 1
        while self.tokens > self.max_tokens and self._entries:
            self._evict(next(iter(self._entries.values())))

    def _evict(self, entry: _Entry) -> None:
        self._entries.pop(id(entry))
        for h in entry.hashes:
            if self._index.get(h) is entry:
                del self._index[h]
        self.tokens -= entry.cost
        self.stats["evicted"] += 1

    def match(self, prompt: tuple[int, ...]) -> tuple[_Entry | None, int]:
        """The kept sequence sharing the longest prefix with `prompt` among those found block by block, and how many
        tokens to reuse (at most len(prompt) - 1); (None, 0) when nothing of a block's length matches, or the match
        covers less than `MIN_SHARE` of the prompt."""
        found, h = None, 0
        for start in range(0, len(prompt) - BLOCK, BLOCK):  # a block ending at the prompt's last token is never reused
            h = hash((h, prompt[start:start + BLOCK]))
            entry = self._index.get(h)
            if entry is None:
                break
            found, blocks = entry, start + BLOCK
        if found is None or found.ids[:blocks] != prompt[:blocks]:  # (a hash collision: no match)
            self.stats["misses"] += 1
            return None, 0
        reused, end = blocks, min(len(found.ids), len(prompt) - 1)
        while reused < end and found.ids[reused] == prompt[reused]:
            reused += 1
        if reused < MIN_SHARE * len(prompt):
            self.stats["misses"] += 1
            return None, 0
        self._entries.move_to_end(id(found))
        self.stats["hits"] += 1
        self.stats["reused_tokens"] += reused
        self.stats["new_tokens"] += len(prompt) - reused
        return found, reused


@torch.no_grad()
def extend(decoder, rows: list[tuple[tuple[int, ...], _Entry, int]], eos: int, device) -> tuple[Tensor, Tensor,
                                                                                                list[int], list[int]]:
    """One forward of prompts that each extend a kept sequence (prompt, entry, tokens reused): the reused K/V copied
    in, the new tokens right-padded to the longest, each attending to its own prefix and new tokens. Returns the
    prompts as one row (every layer's K/V [2 * layers, Hkv, rows * W, D], each prompt's from `starts[i]`), their last
    hidden [rows, H], starts and widths: a `prefill.Prefill`'s fields."""
    count = len(rows)
    reused = [m for _, _, m in rows]
    new = [len(p) - m for p, _, m in rows]
    n = max(new)
    width = max(reused) + n
    d, layers = decoder, decoder.num_layers
    stack = torch.zeros(2 * layers, count, d.num_kv_heads, width, d.head_dim, dtype=d.dtype, device=device)
    for i, (_, entry, m) in enumerate(rows):
        stack[:, i, :, :m] = entry.stack[:, :, :m]
    views = list(stack.unbind(0))
    ids = torch.tensor([list(p[m:]) + [eos] * (n - len(p) + m) for p, _, m in rows], device=device)
    offset = torch.tensor(reused, device=device)[:, None]
    positions = offset + torch.arange(n, device=device)[None, :]  # [rows, n]: also the cache slot each token goes to
    allowed = torch.arange(width, device=device)[None, None, :] <= positions[:, :, None]  # [rows, n, width]
    last = torch.tensor(new, device=device) - 1
    hidden = decoder.forward(ids, positions, positions, allowed, views[:layers], views[layers:], head=False, last=last)
    stack = stack.transpose(1, 2).reshape(stack.shape[0], stack.shape[2], count * width, stack.shape[4])
    return stack, hidden, [i * width for i in range(count)], [len(p) for p, _, _ in rows]


def extension_batches(rows: list, separate: bool, cells: int) -> list[list]:
    """`rows` (prompt, entry, reused) split into extension forwards: each alone when `separate` (CPU: a prompt's K/V
    then do not depend on the others'), else by similar widths up to `cells` rows x width a forward
    (`prefill.EXTEND_BYTES`)."""
    if separate:
        return [[row] for row in rows]
    batches, part = [], []
    for row in sorted(rows, key=lambda r: len(r[0])):
        widest = max([r[2] for r in part + [row]]) + max(len(r[0]) - r[2] for r in part + [row])
        if part and (len(part) + 1) * widest > cells:
            batches.append(part)
            part = []
        part.append(row)
    if part:
        batches.append(part)
    return batches
