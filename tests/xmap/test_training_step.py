"""An xmapped training step compiles to the program its hand-written
``jax.shard_map`` twin compiles to: the same optimized HLO,
instruction for instruction once names and source locations are left out
(so the same op counts, layouts and collectives), and the same values and
gradients, for data-parallel, model-parallel and mixed placements, forward
and under ``jax.value_and_grad``. Also: an xmap with no resources under a
mesh runs on one device, not replicated on every one."""
import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import nxops as nx
from tests._megatron import fg_operators
from tests._training import DP, IN_AXES, MP, PLACEMENTS, named_block, shard_map_twin, training_mesh

B, D, H, V = 8, 32, 64, 48     # per-batch-position examples, model, hidden, vocab
# The ops whose counts must match (layout work, collectives, matmuls, fusions).
KINDS = ("transpose", "copy", "all-reduce", "all-gather", "reduce-scatter",
         "collective-permute", "dot", "fusion", "reduce", "broadcast")


def operands():
    k = jax.random.split(jax.random.key(0), 5)
    return (jax.random.normal(k[0], (MP, D, H // MP)) / D**0.5,    # w1: column-parallel
            jax.random.normal(k[1], (MP, H // MP, D)) / H**0.5,    # w2: row-parallel
            jax.random.normal(k[2], (D, V)) / D**0.5,              # vocab projection
            jax.random.normal(k[3], (DP, B, D)),                   # x
            jax.random.randint(k[4], (DP, B), 0, V))               # labels


def positional_loss(w1, w2, wv, x, y):
    h = jax.nn.relu(jnp.einsum("pbd,sdh->psbh", x, w1))
    logits = jnp.einsum("psbh,shd->pbd", h, w2) @ wv
    picked = jnp.take_along_axis(logits, y[..., None], 2)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, 2) - picked)


def instructions(compiled) -> collections.Counter:
    """The optimized HLO's lines without what names the source: instruction and
    computation names, metadata, the module header and its stack-frame tables."""
    lines = collections.Counter()
    for line in compiled.as_text().splitlines():
        line = re.sub(r"metadata=\{[^}]*\}|, stack_frame_id=\d+", "", line)
        line = re.sub(r"%[\w.\-]+", "%", line)
        line = re.sub(r"\b([a-z_]+)\.\d+: ", r"\1: ", line).rstrip(", ")
        if line.strip() and not re.match(r"\s*(HloModule|\d+ |FileNames|FunctionNames|"
                                          r"FileLocations|StackFrames)", line):
            lines[line] += 1
    return lines


def op_counts(compiled) -> dict[str, int]:
    found = collections.Counter(
        m.group(1) for m in re.finditer(r"=\s*\S+\s+([a-z\-]+)\(", compiled.as_text()))
    return {kind: found[kind] for kind in KINDS}


TRANSFORMS = {"forward": lambda f: f,
              "value_and_grad": lambda f: jax.value_and_grad(f, argnums=(0, 1, 2))}


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_training_step_compiles_like_its_shard_map_twin(placement, transform):
    resources = PLACEMENTS[placement]
    mesh = training_mesh()
    with jax.set_mesh(mesh):
        twin, specs = shard_map_twin(resources, mesh)
        args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(operands(), specs)]
        step = jax.jit(TRANSFORMS[transform](
            nx.xmap(named_block, IN_AXES, [], axis_resources=resources)))
        twin_step = jax.jit(TRANSFORMS[transform](twin))
        compiled, twin_compiled = step.lower(*args).compile(), twin_step.lower(*args).compile()
        assert op_counts(compiled) == op_counts(twin_compiled)
        # and the calls move nothing the twin's do not
        assert compiled.input_shardings == twin_compiled.input_shardings
        assert compiled.output_shardings == twin_compiled.output_shardings
        mine, theirs = instructions(compiled), instructions(twin_compiled)
        assert mine == theirs, ("only in the xmap program:\n" + "\n".join(mine - theirs)
                                + "\nonly in the shard_map twin:\n" + "\n".join(theirs - mine))
        got, want = step(*args), twin_step(*args)
        reference = jax.jit(TRANSFORMS[transform](positional_loss))(*operands())
    for g, w, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(reference)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_result_varying_along_a_mesh_only_name_its_out_axes_omit_is_an_error():
    # Mesh axes alone carry 'batch' (no vmap level): the body's variance walk
    # still catches a result that varies along it.
    mesh = jax.make_mesh((DP, MP), ("dp", "mp"))
    f = nx.xmap(lambda x: x * 2, ["batch", ...], [...], axis_resources={"batch": "dp"})
    with jax.set_mesh(mesh), pytest.raises(nx.NxopsError, match="varies along the named axis 'batch'"):
        f(jnp.ones((DP, 3)))


def test_no_resources_under_a_mesh_runs_on_one_device():
    x = jax.random.normal(jax.random.key(1), (16, 8, 8))
    f = nx.xmap(lambda v: jnp.tanh(v @ v.T).sum(), ["a", ...], ["a"])
    mesh = jax.make_mesh((DP, MP), ("dp", "mp"))
    with jax.set_mesh(mesh):
        replicated = jax.device_put(x, NamedSharding(mesh, P()))
        compiled = f.lower(replicated).compile()
        got = f(replicated)
    assert compiled.input_shardings[0][0] == SingleDeviceSharding(mesh.devices.flat[0])
    # The result is replicated over the mesh as before, so it mixes with its arrays.
    assert got.sharding == NamedSharding(mesh, P())
    np.testing.assert_allclose(np.asarray(got), np.tanh(np.einsum("aij,akj->aik", x, x)).sum((1, 2)),
                               rtol=1e-5, atol=1e-5)


def test_no_resources_outside_with_a_nested_xmap_on_the_mesh():
    inner = nx.xmap(lambda v: v * 2, ["b", ...], ["b", ...], axis_resources={"b": "mp"})
    outer = nx.xmap(lambda v: inner(v) + 1, ["a", ...], ["a", ...])
    x = np.arange(2 * MP * 3, dtype=np.float32).reshape(2, MP, 3)
    with jax.set_mesh(jax.make_mesh((DP, MP), ("dp", "mp"))):
        got = outer(x)
    np.testing.assert_array_equal(np.asarray(got), x * 2 + 1)


def _spec(*axes) -> P:
    """A PartitionSpec as a jax.jit user writes it: no trailing Nones."""
    axes = list(axes)
    while axes and axes[-1] is None:
        axes.pop()
    return P(*axes)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_compiled_shardings_are_the_named_shardings_jax_jit_gives(placement, axis_type):
    # Inputs with no sharding of their own (NumPy): the compiled program reports
    # the plan's NamedShardings, as jax.jit of the same placement does (its
    # arguments typed with their shardings), not bare GSPMDShardings.
    batch, shard = PLACEMENTS[placement].get("batch"), PLACEMENTS[placement].get("shard")
    explicit = axis_type == "Explicit"
    mesh = jax.make_mesh((DP, MP), ("dp", "mp"),
                         axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2)
    named = lambda *axes: NamedSharding(mesh, _spec(*axes))
    w1, w2, wv, x, y = (np.asarray(a) for a in operands())
    hidden = nx.xmap(lambda w, v: jax.nn.relu(v @ w), (["shard", ...], ["batch", ...]),
                     ["batch", "shard", ...], axis_resources=PLACEMENTS[placement])
    hidden_twin = jax.jit(jax.shard_map(
        lambda w, v: jax.nn.relu(jnp.einsum("sdh,pbd->psbh", w, v)), mesh=mesh,
        in_specs=(_spec(shard), _spec(batch)), out_specs=_spec(batch, shard),
        axis_names=frozenset(a for a in (batch, shard) if a)),
        out_shardings=None if explicit else named(batch, shard))
    loss = nx.xmap(named_block, IN_AXES, [], axis_resources=PLACEMENTS[placement])
    # (On Explicit axes computed replicated: jnp cannot contract the sharded dims.)
    replicated = (lambda a: jax.sharding.reshard(a, P())) if explicit else (lambda a: a)
    loss_twin = jax.jit(lambda *a: positional_loss(*map(replicated, a)))
    # (Uncommitted jax.Arrays, made before the mesh, have no sharding of their own either.)
    cases = ((hidden, hidden_twin, (jnp.asarray(w1), jnp.asarray(x)), (named(shard), named(batch))),
             (loss, loss_twin, (w1, w2, wv, x, y),
              (named(shard), named(shard), named(), named(batch), named(batch))))
    with jax.set_mesh(mesh):
        for mine, twin, args, shardings in cases:
            typed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                     for a, s in zip(args, shardings)]
            compiled, expected = mine.lower(*args).compile(), twin.lower(*typed).compile()
            assert compiled.input_shardings == expected.input_shardings
            assert compiled.output_shardings == expected.output_shardings
            np.testing.assert_allclose(np.asarray(compiled(*args)), np.asarray(expected(*args)),
                                       rtol=1e-5, atol=1e-5)


# --- the same step with Megatron/GPT-J f/g operators -----------------------
# GPT-J writes its tensor parallelism with f (identity forward, psum backward)
# and g (psum forward, identity backward) and takes jax.value_and_grad inside
# the xmapped step, then averages the gradients over 'batch'. Its twin is the
# same step in jax.shard_map, with the same f/g over lax.psum.


def fg_step(w1, w2, wv, x, y, psum, pmean, shard):
    """The loss of one batch position and its gradients, averaged over 'batch'."""
    f, g = fg_operators(psum, shard)

    def loss(w1, w2, wv):
        logits = g(jax.nn.relu(f(x) @ w1) @ w2) @ wv
        picked = jnp.take_along_axis(logits, y[:, None], 1)[:, 0]
        return jnp.mean(nx.logsumexp(logits, 1) - picked)
    return pmean(jax.value_and_grad(loss, argnums=(0, 1, 2))(w1, w2, wv))


def named_fg_step(w1, w2, wv, x, y):
    return fg_step(w1, w2, wv, x, y, nx.psum, lambda t: jax.tree.map(
        lambda v: nx.pmean(v, "batch"), t), "shard")


def fg_shard_map_twin(resources, mesh):
    batch_axis, shard_axis = resources.get("batch"), resources.get("shard")
    pmean = lambda t: jax.tree.map(lambda v: lax.pmean(v, batch_axis or "batch"), t)

    def local(w1, w2, wv, x, y):
        def step(w1, w2, x, y):
            return fg_step(w1, w2, wv, x, y, lax.psum, pmean, shard_axis or "shard")
        if shard_axis is None:
            over_shard = jax.vmap(step, in_axes=(0, 0, None, None),
                                  out_axes=(None, (0, 0, None)), axis_name="shard")
        else:
            over_shard = lambda w1, w2, x, y: step(w1[0], w2[0], x, y)
        if batch_axis is None:
            loss, (g1, g2, gv) = jax.vmap(over_shard, in_axes=(None, None, 0, 0), out_axes=None,
                                          axis_name="batch")(w1, w2, x, y)
        else:
            loss, (g1, g2, gv) = over_shard(w1, w2, x[0], y[0])
        if shard_axis is not None:
            g1, g2 = g1[None], g2[None]
        return loss, (g1, g2, gv)

    specs = (P(shard_axis), P(shard_axis), P(), P(batch_axis), P(batch_axis))
    used = frozenset(a for a in (batch_axis, shard_axis) if a)
    out_specs = (P(), (P(shard_axis), P(shard_axis), P()))
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs, axis_names=used,
                         check_vma=False), specs


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_fg_training_step_compiles_like_its_shard_map_twin(placement):
    resources = PLACEMENTS[placement]
    mesh = training_mesh()
    with jax.set_mesh(mesh):
        twin, specs = fg_shard_map_twin(resources, mesh)
        args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(operands(), specs)]
        step = jax.jit(nx.xmap(named_fg_step, IN_AXES, ([], (["shard", ...], ["shard", ...], [...])),
                               axis_resources=resources))
        twin_step = jax.jit(twin)
        compiled, twin_compiled = step.lower(*args).compile(), twin_step.lower(*args).compile()
        assert op_counts(compiled) == op_counts(twin_compiled)
        mine, theirs = instructions(compiled), instructions(twin_compiled)
        assert mine == theirs, ("only in the xmap program:\n" + "\n".join(mine - theirs)
                                + "\nonly in the shard_map twin:\n" + "\n".join(theirs - mine))
        got, want = step(*args), twin_step(*args)
    reference = jax.value_and_grad(positional_loss, argnums=(0, 1, 2))(*operands())
    for g, w, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(reference)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)
