"""nx.export: nx programs with their kernels through jax.export (round trips,
several platforms at once, symbolic sizes)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx


def _named_loss():
    return nx.xmap(lambda x, w: nx.logsumexp(nx.einsum("<k>,<k>c->c", x, w), 0),
                   (["b", "k"], ["k", ...]), ["b"])


X = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)), jnp.float32)
W = jnp.asarray(np.random.default_rng(1).standard_normal((16, 4)), jnp.float32)


def _positional(x, w):
    return jax.nn.logsumexp(x @ w, axis=-1)


@pytest.mark.parametrize("kernels", ["xla", "pallas"])
def test_export_round_trip_gives_the_positional_result(kernels):
    f = _named_loss()
    with nx.kernels.use(kernels):
        exported = nx.export(f, X, W, platforms=("cpu",))
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_allclose(restored.call(X, W), _positional(X, W), rtol=1e-5)


def test_export_for_cpu_cuda_and_tpu_at_once_keeps_the_pallas_kernels():
    with nx.kernels.use("pallas"):
        exported = nx.export(_named_loss(), X, W, platforms=("cpu", "cuda", "tpu"))
    text = exported.mlir_module()
    assert "__gpu$xla.gpu.triton" in text and "tpu_custom_call" in text
    np.testing.assert_allclose(jax.export.deserialize(exported.serialize()).call(X, W),
                               _positional(X, W), rtol=1e-5)


def test_plain_jax_export_refuses_the_triton_kernels_that_nx_export_allows():
    with nx.kernels.use("pallas"), pytest.raises(ValueError, match="xla.gpu.triton"):
        jax.export.export(jax.jit(lambda x, w: _named_loss()(x, w)), platforms=("cuda",))(X, W)


def test_symbolic_batch_sizes_fall_back_to_xla_under_auto():
    (b,) = jax.export.symbolic_shape("b")
    exported = nx.export(_named_loss(), jax.ShapeDtypeStruct((b, 16), jnp.float32), W,
                         platforms=("cpu", "cuda"))
    restored = jax.export.deserialize(exported.serialize())
    for n in (3, 8):
        x = X[:n]
        np.testing.assert_allclose(restored.call(x, W), _positional(x, W), rtol=1e-5)


def test_symbolic_sizes_with_explicit_pallas_raise_with_the_reason():
    (b,) = jax.export.symbolic_shape("b")
    with nx.kernels.use("pallas"), pytest.raises(nx.NxopsError, match="symbolic sizes"):
        nx.export(_named_loss(), jax.ShapeDtypeStruct((b, 16), jnp.float32), W, platforms=("cpu",))


def test_export_of_a_mesh_mapped_xmap_round_trips_under_the_mesh():
    f = nx.xmap(lambda x: nx.psum(x, "b"), ["b", ...], [...], axis_resources={"b": "x"})
    with jax.set_mesh(jax.make_mesh((8,), ("x",))):
        exported = nx.export(f, X, platforms=("cpu",))
        got = jax.export.deserialize(exported.serialize()).call(X)
    np.testing.assert_allclose(got, X.sum(0), rtol=1e-5)


def test_gpu_platform_means_cuda_as_in_explain():
    # jax.export alone says "Unknown backend: 'gpu'"; JAX names CUDA devices "gpu".
    exported = nx.export(_named_loss(), X, W, platforms=("gpu",))
    assert exported.platforms == ("cuda",)
    assert jax.export.deserialize(exported.serialize()).platforms == ("cuda",)


def test_an_unknown_platform_is_refused_with_the_valid_names():
    with pytest.raises(nx.NxopsError, match=r"nx.export: unknown platform 'gpus'\. Use one of "
                                            r"'cpu', 'cuda', 'rocm', 'tpu' \('gpu' means 'cuda'"):
        nx.export(_named_loss(), X, W, platforms=("cpu", "gpus"))


@pytest.mark.parametrize("op", ["var", "std"])
def test_var_and_std_over_a_symbolic_named_size_export(op):
    """t07 in general: a named axis and a positional one, ddof, and sizes where
    ddof >= N (nan, as jnp) from one export."""
    (b,) = jax.export.symbolic_shape("b")
    f = nx.xmap(lambda x: getattr(nx, op)(x, ("b", 0), ddof=4), [["b", ...]], [...])
    exported = nx.export(f, jax.ShapeDtypeStruct((b, 2), jnp.float32), platforms=("cpu",))
    restored = jax.export.deserialize(exported.serialize())
    for n in (1, 2, 5):   # N = 2n elements: n = 1 and 2 leave no degrees of freedom
        x = X[:n, :2]
        want = getattr(jnp, op)(x, ddof=4)
        np.testing.assert_allclose(restored.call(x), want, rtol=1e-5, equal_nan=True)
        assert np.isnan(want) == (n <= 2)
