"""The Pallas kernels behind the named ops: ``nx.sum`` / ``nx.einsum`` under
``nx.kernels.use("pallas")`` on CPU (interpret mode) against the xla kernels,
``nx.kernels.explain`` for cuda/tpu, and the kernel custom calls in programs
lowered for cuda/tpu under ``pallas`` (and ``auto`` where its rule takes a kernel)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx
from tests._extras import missing_extra
from tests.kernels._lowered import CALL_TARGET, kernel_calls, lower_text
from tests._tolerances import assert_close


def data(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]


PROGRAMS = {
    "sum": (lambda x: nx.sum(x, (0, 2)), [(6, 7, 5)]),
    "logsumexp": (lambda x: nx.logsumexp(x, 1), [(9, 33)]),
    "einsum": (lambda a, b: nx.einsum("bij,bjk->bik", a, b), [(2, 5, 7), (2, 7, 3)]),
    "vmap_named_sum": (jax.vmap(lambda x: nx.sum(x, "i") * x, axis_name="i"), [(4, 6)]),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_pallas_on_cpu_matches_xla(name):
    fn, shapes = PROGRAMS[name]
    args = data(*shapes)
    with nx.kernels.use("xla"):
        want = jax.jit(fn)(*args)
    with nx.kernels.use("pallas"):
        got = jax.jit(fn)(*args)
        backends = nx.kernels.explain(fn, *args).backends()
    assert backends and all(b == {"pallas"} for b in backends.values()), backends
    assert_close(got, want, jnp.float32, scale=3.0)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_accelerators_lower_the_selected_kernels(platform, name):
    """"pallas": Pallas on cuda and tpu; "triton": jax-triton's calls on cuda."""
    fn, shapes = PROGRAMS[name]
    args = data(*shapes)
    selections = ("pallas", "triton") if platform == "cuda" else ("pallas",)
    for selection in selections:
        backend = "triton" if selection == "triton" else "pallas"
        if backend == "triton" and (reason := missing_extra("triton", "triton", "jax_triton")):
            pytest.skip(reason)   # (after the pallas half ran)
        with nx.kernels.use(selection):
            explanation = nx.kernels.explain(fn, *args, platform=platform)
            text = lower_text(fn, *args, platform=platform)
        assert explanation.backends() and all(
            b == {backend} for b in explanation.backends().values()), str(explanation)
        if backend == "triton":
            assert "triton_kernel_call" in text and CALL_TARGET[platform] not in text
        else:
            assert CALL_TARGET[platform] in text and kernel_calls(text, platform)
        if platform == "cuda":
            assert "mosaic_gpu" not in text


# What `auto` picks for PROGRAMS (nxops/kernels/_registry.py): XLA. No TPU has
# measured a kernel, and on cuda nothing this small was measured.
AUTO: dict = {}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_auto_lowers_kernels_where_its_rule_takes_them(platform, name):
    fn, shapes = PROGRAMS[name]
    args = data(*shapes)
    want = AUTO.get((name, platform), "xla")
    explanation = nx.kernels.explain(fn, *args, platform=platform)
    assert all(b == {want} for b in explanation.backends().values()), str(explanation)
    assert (CALL_TARGET[platform] in lower_text(fn, *args, platform=platform)) == (want == "pallas")


def test_auto_keeps_xla_on_cpu_and_for_unsupported_cases(measured_kernels):
    # 4096^2 bf16 column sums: the H200 measured the Pallas kernel at 0.84x XLA
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.int32)
    fn = lambda x: nx.sum(x, 0)
    bf16 = jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
    assert nx.kernels.explain(fn, bf16, platform="cpu").backends() == {"reduce": {"xla"}}
    assert nx.kernels.explain(fn, bf16, platform="cuda").backends() == {"reduce": {"pallas"}}
    explanation = nx.kernels.explain(fn, x, platform="cuda")
    assert explanation.backends() == {"reduce": {"xla"}}
    assert "int32" in str(explanation)
    with nx.kernels.use("pallas"), pytest.raises(nx.NxopsError, match="int32"):
        nx.kernels.explain(fn, x, platform="cuda")
