"""Python's garbage collector around the train phase's forward and backward passes.

Autograd, the compiled layers' wrappers and the loss allocate tens of thousands of short-lived Python objects per
step; with automatic collection on, the collector ran about a hundred young-generation passes inside a 32 x 8
train phase (the 0.5B shape on one H100: 23.5 ms of them, and 15.6 ms of middle-generation ones) and now and then
a full one over every object the process holds (168 ms, with the model, the tokenizer and torch.compile's caches
tracked). The host time is the train phase's time wherever the host, not the GPU, sets its pace: pausing the
collector took that phase from 0.672 to 0.612 s (`python -m rlspec.perf.profile_train --gc`).

`collection_paused` turns automatic collection off while a micro-batch loop runs. Objects freed by reference
counting (nearly all of them) are freed as before; the collector runs again once the loop is done, over what
is still young then. The first time the loop finishes in a process, everything alive (the model, the compiled
code, the tokenizer: the objects a full collection would keep scanning for nothing) is moved out of the
collector's view (`gc.freeze`), after one full collection.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

_frozen = False


@contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic garbage collection inside (module docstring). A caller that turned the collector off itself
    keeps it off; nested uses are fine."""
    global _frozen
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        if not _frozen:
            _frozen = True
            gc.collect()
            gc.freeze()
