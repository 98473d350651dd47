"""Pallas kernels (interpret mode) and Triton kernels (Triton's interpreter)
inside nx.xmap programs, with and without mesh axes on 8 simulated devices:
same results and gradients as xla."""
import jax
import numpy as np
import pytest

from tests._extras import skip_without_triton

import nxops as nx

IN_AXES = [["inputs", "hidden", ...], ["hidden", "classes", ...], ["batch", "inputs", ...],
           ["batch", ...]]
RESOURCES = [{}, {"batch": "x"}, {"hidden": "y"}, {"batch": "x", "hidden": "y"},
             {"batch": ("x", "y")}, {"batch": "y", "hidden": "x"}]

# Triton's interpreter runs in a pure_callback: where every mesh axis is manual.
TRITON_RESOURCES = [{"batch": "x", "hidden": "y"}, {"batch": ("x", "y")}]


def named_loss(w1, w2, images, labels):
    hidden = jax.nn.relu(nx.pdot(images, w1, "inputs"))
    logits = nx.einsum("<hidden>,<hidden,classes>-><classes>", hidden, w2)
    predictions = logits - nx.logsumexp(logits, "classes")
    targets = nx.one_hot(labels, nx.psum(1, "classes"), axis="classes")
    return -nx.pmean(nx.psum(targets * predictions, "classes"), "batch")


def args():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((12, 8)).astype(np.float32) / 3,
            rng.standard_normal((8, 5)).astype(np.float32) / 3,
            rng.standard_normal((8, 12)).astype(np.float32),
            rng.integers(0, 5, 8).astype(np.int32))


@pytest.mark.parametrize("backend, resources",
                         [("pallas", r) for r in RESOURCES]
                         + [pytest.param("triton", r, marks=skip_without_triton)
                            for r in TRITON_RESOURCES],
                         ids=str)
def test_kernels_match_xla_in_xmap(backend, resources):
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    a = args()
    loss = nx.xmap(named_loss, IN_AXES, [...], axis_resources=resources)
    grad = jax.grad(loss, argnums=(0, 1))
    with jax.set_mesh(mesh):
        with nx.kernels.use("xla"):
            want, want_grads = loss(*a), grad(*a)
        with nx.kernels.use(backend):
            got, got_grads = loss(*a), grad(*a)
            report = nx.kernels.explain(loss, *a)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    assert report.backends() == {"dot_general": {backend}, "reduce": {backend}}


@skip_without_triton
def test_interpreted_triton_kernels_refuse_auto_partitioned_mesh_axes():
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    loss = nx.xmap(named_loss, IN_AXES, [...], axis_resources={"batch": "x"})   # y is automatic
    with jax.set_mesh(mesh), nx.kernels.use("triton"), pytest.raises(
            nx.NxopsError, match="cannot be partitioned automatically.*every mesh axis is manual"):
        loss(*args())
