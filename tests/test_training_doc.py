"""docs/training.md's loop, run as written on 8 devices (a (2, 4) mesh): the
parameters keep the shardings the plan gives them, the step compiles once,
and the losses and parameters are those of the same loop written
positionally (no xmap, no mesh)."""
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import nxops as nx

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "training.md"


def doc_loop() -> str:
    return re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)


def positional_loss(params, x, labels):
    """The doc's block with every name written as a positional dim."""
    h = jax.nn.relu(jnp.einsum("pbd,sdh->psbh", x, params["w1"]))
    out = jnp.einsum("psbh,shd->pbd", h, params["w2"])
    logits = out @ params["wv"]
    picked = jnp.take_along_axis(logits, labels[..., None], 2)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, 2) - picked)


def positional_run(ns: dict, steps: int):
    k = jax.random.split(jax.random.key(0), 5)
    D, H, V, B, DP, MP = (ns[n] for n in ("D", "H", "V", "B", "DP", "MP"))
    params = {"w1": jax.random.normal(k[0], (MP, D, H // MP)) / D**0.5,
              "w2": jax.random.normal(k[1], (MP, H // MP, D)) / H**0.5,
              "wv": jax.random.normal(k[2], (D, V)) / D**0.5}
    x = jax.random.normal(k[3], (DP, B, D))
    labels = jax.random.randint(k[4], (DP, B), 0, V)
    velocity = jax.tree.map(jnp.zeros_like, params)
    losses = []
    for _ in range(steps):
        loss, grads = jax.value_and_grad(positional_loss)(params, x, labels)
        velocity = jax.tree.map(lambda v, g: ns["MOMENTUM"] * v + g, velocity, grads)
        params = jax.tree.map(lambda p, v: p - ns["LEARNING_RATE"] * v, params, velocity)
        losses.append(float(loss))
    return params, losses


@pytest.fixture(scope="module")
def ran():
    assert jax.device_count() == 8, "tests/conftest.py gives 8 CPU devices"
    ns: dict = {}
    exec(compile(doc_loop(), str(DOC), "exec"), ns)   # asserts layout, one trace, learning
    return ns


def test_runs_on_a_2x4_mesh_and_keeps_the_plans_shardings(ran):
    mesh = ran["mesh"]
    assert dict(mesh.shape) == {"dp": 2, "mp": 4}
    expected = {"w1": P("mp", None, None), "w2": P("mp", None, None), "wv": P(None, None)}
    for tree in (ran["params"], ran["velocity"]):
        assert {k: v.sharding for k, v in tree.items()} == {
            k: NamedSharding(mesh, spec) for k, spec in expected.items()}
    assert ran["x"].sharding == NamedSharding(mesh, P("dp", None, None))


def test_the_step_compiled_once_and_more_steps_compile_nothing(ran):
    assert ran["step"]._cache_size() == 1
    compiles = []
    listener = lambda event, duration, **kw: compiles.append(event) if "compile" in event else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        with jax.set_mesh(ran["mesh"]):
            params, velocity = ran["params"], ran["velocity"]
            for _ in range(3):
                params, velocity, loss = ran["step"](params, velocity, ran["x"], ran["labels"])
            jax.block_until_ready(params)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []   # no trace, lowering or backend compile
    assert ran["step"]._cache_size() == 1


def test_losses_and_parameters_match_the_positional_loop(ran):
    params, losses = positional_run(ran, steps=3)
    np.testing.assert_allclose(ran["losses"], losses, rtol=2e-5)
    for name in params:
        np.testing.assert_allclose(np.asarray(ran["params"][name]), params[name],
                                   rtol=2e-4, atol=2e-5)


def test_in_shardings_without_a_mesh_says_to_set_one():
    f = nx.xmap(lambda w: w, ["a", ...], ["a", ...], axis_resources={"a": "x"})
    with pytest.raises(nx.NxopsError, match=r"in_shardings\(\.\.\.\) needs the mesh .* jax\.set_mesh"):
        f.in_shardings(jnp.ones((8, 2)))


def test_in_shardings_is_full_rank_and_replicates_unnamed_arguments():
    f = nx.xmap(lambda w, b: w * b, [["a", ...], [...]], ["a", ...], axis_resources={"a": "x"})
    mesh = jax.make_mesh((8,), ("x",))
    with jax.set_mesh(mesh):
        w_at, b_at = f.in_shardings(jnp.ones((8, 2, 3)), jnp.ones((2, 3)))
    assert w_at == NamedSharding(mesh, P("x", None, None))
    assert b_at == NamedSharding(mesh, P(None, None))
