"""Work-arounds applied when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``).

Import this module before defining kernels; it patches only when interpreting.
"""
from __future__ import annotations

from ...core.runtime import interpreting


def fix_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a runtime scalar loop bound into ``int(array)``, which NumPy
    >= 2.4 refuses for its 1-element arrays; read the element instead. Idempotent."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "scalar_index", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.scalar_index = True
    interpreter._patch_lang_tensor = patched


if interpreting():
    fix_interpreter_index()


def add_interpreter_descriptor_reduce() -> None:
    """Triton's interpreter (3.6 to 3.9) has no tensor-descriptor reduction (``desc.atomic_add``):
    add it as the masked atomic add of the descriptor's block (rows past the end dropped, as TMA
    drops them). Idempotent."""
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if hasattr(builder, "create_descriptor_reduce"):
        return

    def create_descriptor_reduce(self, kind, desc, value, indices):
        if kind != ir.DESCRIPTOR_REDUCE_KIND.ADD:
            raise NotImplementedError(f"descriptor reduction {kind}")
        ptrs, mask = desc.materialize_pointers(indices)
        return self.create_atomic_rmw(ir.ATOMIC_OP.FADD, ptrs, value, mask, ir.MEM_SEMANTIC.RELAXED,
                                      ir.MEM_SYNC_SCOPE.GPU)

    builder.create_descriptor_reduce = create_descriptor_reduce


if interpreting():
    add_interpreter_descriptor_reduce()


def round_bf16_to_nearest() -> None:
    """Triton's interpreter (3.6 to 3.9) casts float32 to bfloat16 by truncation (round toward zero),
    and its round-to-nearest mode carries into the exponent wrongly; the GPU rounds to nearest even.
    Truncation is biased (every P, dS and result rounded down in magnitude): make the interpreter's
    float32 -> bfloat16 casts round to nearest even, as the GPU does (explicit ``"rtz"`` stays).
    Idempotent."""
    import numpy as np
    from triton._C.libtriton import ir
    from triton.runtime import interpreter
    import triton.language as tl

    convert = interpreter._convert_float
    if getattr(convert, "nearest_even", False):
        return

    def patched(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype != tl.float32 or output_dtype != tl.bfloat16 or rounding_mode == ir.ROUNDING_MODE.RTZ:
            return convert(data, input_dtype, output_dtype, rounding_mode)
        u = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
        even = (u >> 16) & 1
        out = ((u + np.uint32(0x7FFF) + even) >> 16).astype(np.uint16)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        out = np.where(nan, ((u >> 16) | 0x0040).astype(np.uint16), out)
        return out.reshape(np.shape(data))

    patched.nearest_even = True
    interpreter._convert_float = patched


if interpreting():
    round_bf16_to_nearest()
