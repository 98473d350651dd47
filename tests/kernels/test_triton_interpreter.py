"""The bridge from JAX to Triton's interpreter (``nxops/kernels/triton/_interpreter.py``):
NumPy arrays as the torch-like tensors the interpreter takes, compiled-mode
helpers interpreted within a launch, and bfloat16 ``tl.dot``."""
import types

import ml_dtypes
import numpy as np
import pytest

from tests._extras import require_extra

require_extra("triton", "triton")
import triton
import triton.language as tl
from triton import knobs
from triton.runtime import jit as triton_jit

from nxops.kernels.triton import _interpreter


@triton.jit
def _scale_rows(x_ptr, n_cols, factor, o_ptr, BC: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BC)
    x = tl.load(x_ptr + row * n_cols + cols, mask=cols < n_cols, other=0.0)
    tl.store(o_ptr + row * n_cols + cols, (x.to(tl.float32) * factor).to(o_ptr.dtype.element_ty),
             mask=cols < n_cols)


@triton.jit
def _row_sums_via_helpers(x_ptr, n_cols, o_ptr, BC: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BC)
    acc = tl.zeros((BC,), tl.float32)   # tl.zeros and tl.sum are @jit helpers in Triton
    acc += tl.load(x_ptr + row * n_cols + cols, mask=cols < n_cols, other=0.0)
    tl.store(o_ptr + row, tl.sum(acc, 0))


@triton.jit
def _dot16(a_ptr, b_ptr, o_ptr):
    r = tl.arange(0, 16)
    a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
    b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
    tl.store(o_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b))


def _shape(shape, dtype):
    return types.SimpleNamespace(shape=shape, dtype=dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_kernel_reads_inputs_and_writes_outputs_in_jax_tritons_argument_order(dtype):
    x = np.arange(15, dtype=np.float32).reshape(3, 5).astype(dtype)
    (out,) = _interpreter.run(_scale_rows, (3,), [x, 5, 2.0], [_shape((3, 5), dtype)],
                              {"BC": 8})
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out.astype(np.float32), 2 * x.astype(np.float32))


def test_unwritten_outputs_show_as_nan():
    x = np.ones((2, 5), np.float32)
    (out,) = _interpreter.run(_scale_rows, (1,), [x, 5, 1.0], [_shape((2, 5), np.float32)],
                              {"BC": 8})   # one program: the second row is never stored
    np.testing.assert_array_equal(out[0], 1.0)
    assert np.isnan(out[1]).all()


def test_tritons_own_jit_helpers_run_interpreted_and_the_patches_are_undone():
    before = (triton_jit.JITFunction.__call__, knobs.runtime.interpret)
    x = np.random.default_rng(0).standard_normal((4, 7)).astype(np.float32)
    (out,) = _interpreter.run(_row_sums_via_helpers, (4,), [x, 7], [_shape((4,), np.float32)],
                              {"BC": 8})
    np.testing.assert_allclose(out, x.sum(1), rtol=1e-6)
    assert (triton_jit.JITFunction.__call__, knobs.runtime.interpret) == before
    with pytest.raises(RuntimeError, match="outside of the scope of a kernel"):
        tl.zeros((2,), tl.float32)   # compiled mode again outside a launch


def test_bfloat16_dot_multiplies_numbers_not_bit_patterns():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16)
    (out,) = _interpreter.run(_dot16, (1,), [a, b], [_shape((16, 16), np.float32)], {})
    np.testing.assert_allclose(out, a.astype(np.float32) @ b.astype(np.float32), rtol=1e-5,
                               atol=1e-5)


def test_host_tensor_refuses_non_contiguous_arrays():
    with pytest.raises(ValueError, match="C-contiguous"):
        _interpreter.HostTensor(np.ones((4, 4))[:, ::2])


def test_compiling_for_cuda_still_works_after_an_interpreted_launch():
    """Triton's device-function path leaves the language patched for the
    interpreter; the bridge must undo it, or later compilations fail."""
    import jax
    import jax.numpy as jnp
    from nxops.kernels.triton import _launch

    x = np.ones((4, 7), np.float32)
    _interpreter.run(_row_sums_via_helpers, (4,), [x, 7], [_shape((4,), np.float32)], {"BC": 8})

    def on_cuda(v):
        return _launch.launch(_row_sums_via_helpers, v, 7, target=_launch.Target("cuda", 90),
                              name="sums",
                              out_shape=[jax.ShapeDtypeStruct((4,), jnp.float32)],
                              grid=(4,), BC=8)[0]

    text = jax.jit(on_cuda).trace(jax.ShapeDtypeStruct((4, 7), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton_kernel_call" in text


def _launch_records_kwargs(monkeypatch, triton_call):
    import jax
    import jax.numpy as jnp
    from nxops.kernels.triton import _launch

    monkeypatch.setattr(_launch, "_jax_triton", lambda: types.SimpleNamespace(triton_call=triton_call))
    _launch.launch(_row_sums_via_helpers, jnp.ones((4, 7)), 7, target=_launch.Target("cuda", 90),
                   name="sums", out_shape=[jax.ShapeDtypeStruct((4,), jnp.float32)], grid=(4,),
                   BC=8)


def _fake_outputs(kwargs):
    import jax.numpy as jnp
    from nxops.kernels.triton import _launch
    return [jnp.zeros(s.shape, s.dtype) for s in kwargs[_launch._OUT_KEYWORD]]


def test_every_launch_sets_fp_fusion_itself(monkeypatch):
    """jax-triton 0.3 takes ``enable_fp_fusion`` per launch: nxops passes it
    there instead of changing Triton's process-wide default."""
    calls = []

    def triton_call(*args, **kwargs):   # 0.3: no backend_options
        calls.append(kwargs)
        return _fake_outputs(kwargs)

    _launch_records_kwargs(monkeypatch, triton_call)
    assert calls[0]["enable_fp_fusion"] is True and "backend_options" not in calls[0]


def test_jax_triton_04_gets_fp_fusion_in_its_backend_options(monkeypatch):
    """jax-triton 0.4 passes unknown keywords to the kernel as constexprs: the
    option goes in ``backend_options``, never as a keyword of its own."""
    calls = []

    def triton_call(*args, backend_options=None, **kwargs):
        calls.append(dict(kwargs, backend_options=backend_options))
        return _fake_outputs(kwargs)

    _launch_records_kwargs(monkeypatch, triton_call)
    assert calls[0]["backend_options"] == {"enable_fp_fusion": True}
    assert "enable_fp_fusion" not in calls[0]


def test_importing_nxops_leaves_tritons_environment_alone():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_DEFAULT_FP_FUSION"}
    out = subprocess.run(
        [sys.executable, "-c", "import os, nxops; print(os.environ.get('TRITON_DEFAULT_FP_FUSION'))"],
        env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None", out
