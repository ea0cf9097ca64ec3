"""Programmatic dependent launch (PDL) for the decode step's kernels: each kernel's programs are placed on the SMs,
and ask L2 for their weights, while the kernel ahead of it is still running.

At a few rows a decode step is some 200 small kernels in a row (eight a layer), each a few microseconds long: at
four rows on an H200 a split-K projection reading 1.6 MB of weights takes 3.1 us against 0.3 us of bandwidth. On
Hopper and later a kernel launched with the programmatic-serialization attribute may start before the kernel ahead
of it ends: its programs run up to `griddepcontrol.wait`, which returns once the kernel ahead has ended and its
writes are visible. So every decode kernel here does, in this order:

1. `prefetch_l2`: asks L2 for the weight lines this program will read (weights never depend on the kernel ahead);
2. `wait_for_inputs`: waits for the kernel ahead, then lets the kernel behind it launch (`launch_dependents`), so
   only the next kernel's programs are placed early, not the whole step's (their prefetches would crowd L2);
3. reads its inputs and computes as before.

Every program waits before its first read of another kernel's output and before its first write, and lets the
next kernel launch only after that wait, so a kernel's end still implies the end of every kernel before it, as in
plain stream order. Inductor's own kernels between them (the norms, residual adds and the step's bookkeeping)
follow the same rule when compiled with `triton.enable_pdl` (`StaticDecoder.compile`). A kernel launched without
the attribute (cuBLAS's; any of these on an older GPU) waits for the whole kernel ahead as usual, and there
`griddepcontrol.wait` returns at once. The numbers a kernel computes do not change.

`PDL` is a compile-time switch of each kernel (False: neither instruction is emitted, as under Triton's CPU
interpreter); `launch_options` gives the matching launch keyword.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None

L2_LINE_BYTES = 128


def supported(device: torch.device) -> bool:
    """Whether kernels on `device` can launch dependently: CUDA with compute capability 9.0 or later, and a Triton
    that has the grid-dependency intrinsics."""
    device = torch.device(device)
    if triton is None or device.type != "cuda" or not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(pdl: bool) -> dict:
    """The launch keyword that goes with a kernel compiled with `PDL=pdl`."""
    return {"launch_pdl": True} if pdl else {}


def line_elements(tensor: torch.Tensor) -> int:
    """Elements of `tensor`'s dtype in one L2 line (`prefetch_l2`'s stride along a row)."""
    return max(1, L2_LINE_BYTES // tensor.element_size())


if triton is not None:
    @triton.jit
    def prefetch_l2(ptrs):
        """Ask L2 for the line at each of `ptrs` (addresses that must lie inside the tensor: clamp, don't mask),
        without waiting for it and without reading it into registers. Worth it only before `wait_for_inputs` in a
        dependently launched kernel: otherwise nothing runs ahead of the kernel before, so there is nothing to
        overlap."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def wait_for_inputs(PDL: tl.constexpr):
        """Wait until the kernel ahead has ended and its writes are visible, then let the kernel behind launch."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
