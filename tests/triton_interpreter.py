"""Running the project's Triton kernels on CPU under Triton's interpreter (`TRITON_INTERPRET=1`, in a fresh
process: the interpreter is chosen when the kernels are defined)."""

from __future__ import annotations


def allow_scalar_loop_bounds() -> None:
    """The interpreter (Triton 3.5) holds a scalar (a loaded value, a kernel argument in arithmetic) as a
    1-element array, which a loop bound cannot take: give its tensors `__index__`."""
    import triton.runtime.interpreter as interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor):
        patch(tensor)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

    interpreter._patch_lang_tensor = patched
