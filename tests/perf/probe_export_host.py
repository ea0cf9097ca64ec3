"""The host time of a sharded trainer's export, on one CPU rank: what an fsdp rank spends walking its state dict and
gathering a bucket at a time at every push, without the copies a large model would add.

    python tests/perf/probe_export_host.py [PRESET]    # default qwen2_24l_tiny: 291 tensors, 3.7 MB

Builds PRESET in bf16 with each decoder layer and the root under FSDP2 (`fully_shard`, gloo, one rank), then runs the
fsdp backend's export path (`merged_weights(detach=False)`, tied names left out, groups of a 256 MB bucket,
`gather_flat` with its flat path forced as on CUDA) into `sync.base.buckets` 15 times after 3 untimed: the median and
the least, in ms. With each DTensor detached in the walk and each shard taken by `to_local()` (the path before
this probe) it read 8.4-8.6 ms median on a 2-core host, and 4.2 ms after, side by side.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from rlspec.core.shards import gather_flat
    from rlspec.core.trainer import merged_weights
    from rlspec.core.weights import gather_groups, tied_aliases, untied
    from rlspec.models.factory import preset_config
    from rlspec.sync.base import buckets

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config(sys.argv[1] if len(sys.argv) > 1 else "qwen2_24l_tiny"),
                                             dtype=torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    aliases = tied_aliases(model)

    def push() -> int:
        named = untied(merged_weights(model, detach=False), aliases)
        groups = gather_groups(named, 256 << 20, lambda t: t.numel() * 2)
        full = (x for group in groups for x in gather_flat(group, torch.bfloat16, flat=True))
        return sum(bucket.nbytes for bucket in buckets(full, 256))

    for _ in range(3):
        push()
    times = []
    for _ in range(15):
        start = time.perf_counter()
        push()
        times.append(time.perf_counter() - start)
    print(f"export host time: median {statistics.median(times) * 1e3:.2f} ms, least {min(times) * 1e3:.2f} ms "
          f"({len(model.state_dict())} tensors)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
