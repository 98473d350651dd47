"""Runs ``@triton.jit`` kernels in Triton's interpreter on NumPy arrays.

On CPU the triton backend's kernels run here (through ``jax.pure_callback``),
so CI checks their numerics with no GPU. Two things stand between Triton's
interpreter and a JAX program, and this module bridges both:

- The interpreter takes torch tensors: it reads ``data_ptr()``, ``dtype``,
  ``untyped_storage()`` and rebuilds host copies with
  ``new_empty(0).set_(storage, offset, size, stride)``, then ``copy_``s them
  back. :class:`HostTensor` is that protocol over a NumPy array, which is
  already on the host: storage and "copies" are the array itself. (torch is
  gigabytes; this is forty lines.)
- Triton decides at import whether ``@triton.jit`` means compile or
  interpret (``TRITON_INTERPRET``); its own helpers (``tl.zeros``, the
  reductions' combine functions) are compiled-mode ``JITFunction`` s here,
  because the same kernels must also lower through jax-triton.
  :func:`interpreting` makes such calls interpret for the duration of one
  launch (and fixes the interpreter's ``tl.dot`` on bfloat16, which it
  stores as raw ``uint16`` bits and would multiply as integers).

Tested against Triton 3.8.0 (the pinned version); ``tests/kernels/
test_triton_interpreter.py`` checks the bridge itself.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import types
from typing import Any, Callable, Iterator, Sequence

import ml_dtypes
import numpy as np
import triton
from triton import knobs
from triton.runtime import interpreter as _interp
from triton.runtime import jit as _jit


class _Storage:
    """A tensor's storage: the NumPy array itself (already host memory)."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def cpu(self) -> "_Storage":
        return self

    def copy_(self, other: "_Storage") -> None:
        if other.array is not self.array:
            np.copyto(self.array, other.array)


class HostTensor:
    """The part of torch's tensor protocol that Triton's interpreter uses,
    over a C-contiguous NumPy array (read and written in place)."""

    device = "cpu"

    def __init__(self, array: np.ndarray):
        if not array.flags.c_contiguous:
            raise ValueError("HostTensor needs a C-contiguous array")
        self.array = array
        self.dtype = array.dtype      # str(dtype) -> 'float32', 'bfloat16', ...
        self.shape = array.shape

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> _Storage:
        return _Storage(self.array)

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.array.shape

    def stride(self, dim: int | None = None):
        strides = tuple(s // self.array.itemsize for s in self.array.strides)
        return strides if dim is None else strides[dim]

    def element_size(self) -> int:
        return self.array.itemsize

    def new_empty(self, *shape, **kwargs) -> "HostTensor":
        del shape, kwargs  # only ever followed by set_(storage, ...)
        return self

    def set_(self, storage: _Storage, offset: int, size, stride) -> "HostTensor":
        del offset, size, stride  # always this tensor's own (offset 0, contiguous)
        return HostTensor(storage.array)

    def copy_(self, other: "HostTensor") -> None:
        if other.array is not self.array:
            np.copyto(self.array, other.array)


@functools.cache
def _interpreted(fn: Callable) -> _interp.InterpretedFunction:
    return _interp.InterpretedFunction(fn)


def _dot_with_bf16_as_f32(create_dot):
    def create_dot_fixed(a, b, d, *args):
        if a.dtype == triton.language.bfloat16:   # raw uint16 bits in the interpreter
            a = _interp.TensorHandle(a.data.view(ml_dtypes.bfloat16).astype(np.float32),
                                     triton.language.float32)
            b = _interp.TensorHandle(b.data.view(ml_dtypes.bfloat16).astype(np.float32),
                                     triton.language.float32)
        return create_dot(a, b, d, *args)
    return create_dot_fixed


# The patches below are process-wide: one interpreted launch at a time.
_LOCK = threading.Lock()


@contextlib.contextmanager
def interpreting() -> Iterator[None]:
    """Within the block, calls of compiled-mode ``@triton.jit`` helpers
    interpret, and ``tl.dot`` reads bfloat16 operands as numbers.

    ``triton.language`` (and ``.core``, which Triton's helpers import) are
    switched to their interpreter builtins once for the block and switched
    back after it: Triton's own device-function call path switches them
    without switching back (harmless in an interpreter-only process, fatal
    to later compilations in ours).
    """
    builder = _interp.interpreter_builder
    with _LOCK:
        saved = (_jit.JITFunction.__call__, knobs.runtime.interpret, builder.create_dot)
        lang = _interp._patch_lang(types.SimpleNamespace(
            __globals__={"tl": triton.language, "core": triton.language.core}))
        _jit.JITFunction.__call__ = lambda self, *a, **k: _interpreted(self.fn).rewrite()(*a, **k)
        knobs.runtime.interpret = True
        builder.create_dot = _dot_with_bf16_as_f32(saved[2])
        try:
            yield
        finally:
            _jit.JITFunction.__call__, knobs.runtime.interpret, builder.create_dot = saved
            lang.restore()


def _host_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    return np.dtype(ml_dtypes.bfloat16) if dtype.name == "bfloat16" else dtype


def _unwritten(shape, dtype) -> np.ndarray:
    """An output buffer that shows a missing store: NaN (floats), or -1s."""
    dtype = _host_dtype(dtype)
    fill = np.nan if np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16" else -1
    return np.full(shape, fill, dtype)


def run(kernel, grid: Sequence[int], args: Sequence[Any], out_shapes: Sequence[Any],
        constexprs: dict[str, Any]) -> list[np.ndarray]:
    """Launches ``kernel`` (a ``@triton.jit`` function) over ``grid`` in the
    interpreter, with jax-triton's parameter order: ``args`` (arrays as
    pointers, Python scalars as values), then the outputs, then
    ``constexprs``. Returns the outputs as NumPy arrays."""
    outs = [_unwritten(s.shape, s.dtype) for s in out_shapes]
    tensors = [HostTensor(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
               for a in args]
    with interpreting(), np.errstate(all="ignore"):   # inf/NaN arithmetic is expected
        _interpreted(kernel.fn)[tuple(grid)](
            *tensors, *(HostTensor(o) for o in outs), **constexprs)
    return outs
