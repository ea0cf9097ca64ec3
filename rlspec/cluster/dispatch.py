"""How a step's prompts reach several rollout engines: by work (a shared queue of chunks) or a fixed split.

`split` gives engine i one contiguous run of the prompts (`split_groups`): the step then waits for the engine whose
run holds the longest samples. `queue` cuts the prompts into contiguous chunks of whole groups (`chunk_groups`),
and every engine takes the next chunk as soon as its last one is done, so a slow engine (a long tail, a busier GPU)
takes fewer chunks and the others take the rest. An engine runs its chunks one after another, each to its own
longest sample, where one call would start every sample at once (its decode slots permitting): the queue pays
where an engine's share does not fit its slots anyway, or where engines differ in speed.

Either way a chunk is sent with the index of its first sample in the step (`first_sample`), so each sample draws
the noise it would draw on one engine (`rlspec.rollout.noise`), and the results are put back in prompt order: the
step's samples do not depend on which engine took which chunk, nor on the dispatch. The chunk boundaries depend
only on the number of prompts and engines, never on timing.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def split_groups(num_groups: int, num_parts: int) -> list[range]:
    """Contiguous runs of whole groups, one per part, sizes differing by at most one (the first parts the larger);
    a part with no group gets an empty range."""
    share, extra = divmod(num_groups, num_parts)
    parts, start = [], 0
    for i in range(num_parts):
        size = share + (i < extra)
        parts.append(range(start, start + size))
        start += size
    return parts


def chunk_groups(num_groups: int, chunk: int) -> list[range]:
    """`queue`'s chunks: contiguous runs of `chunk` groups (the last one the rest), none empty."""
    return [range(start, min(start + chunk, num_groups)) for start in range(0, num_groups, chunk)]


def parts(method: str, num_groups: int, num_workers: int, chunk: int) -> list[range]:
    """A step's parts for `dispatch`: `queue`'s chunks of `chunk` groups, or `split`'s one run per worker."""
    return chunk_groups(num_groups, chunk) if method == "queue" else split_groups(num_groups, num_workers)


def dispatch(chunks: Sequence[range], num_workers: int, run: Callable[[int, range], T],
             queue: bool = True) -> tuple[list[T], list[int]]:
    """Run every chunk on a worker: with `queue`, worker threads take the next chunk as they finish one; without,
    worker i runs chunk i (`len(chunks) <= num_workers`). Returns the results in chunk order and the worker that ran
    each chunk. A failure stops workers from taking more chunks; once every running chunk is done, the first
    failure (in chunk order) is raised."""
    results: list = [None] * len(chunks)
    workers: list[int] = [-1] * len(chunks)
    errors: dict[int, BaseException] = {}
    lock = threading.Lock()
    taken = [0]

    def take(worker: int) -> int | None:
        with lock:
            if errors or taken[0] >= len(chunks):
                return None
            taken[0] += 1
            return taken[0] - 1

    def work(worker: int) -> None:
        mine = iter([worker] if worker < len(chunks) else []) if not queue else None
        while True:
            index = take(worker) if queue else next(mine, None)
            if index is None:
                return
            try:
                results[index] = run(worker, chunks[index])
                workers[index] = worker
            except BaseException as err:  # noqa: BLE001 - raised on the calling thread
                with lock:
                    errors[index] = err
                return

    threads = [threading.Thread(target=work, args=(w,), name=f"rlspec-dispatch-{w}", daemon=True)
               for w in range(num_workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[min(errors)]
    return results, workers
