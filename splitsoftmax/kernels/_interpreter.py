"""Work-arounds applied when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``).

Import this module before defining kernels; it patches only when interpreting.
"""
from __future__ import annotations

from ..local import interpreting


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
