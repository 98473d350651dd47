"""nxops' named ops written without nxops: the reference the composed oracle
compares against.

Each function here has the signature of the nx op of the same name and runs
inside ``jax.vmap(..., axis_name=name)`` (the positional program): every
collective is ``jax.lax.all_gather`` followed by jax.numpy on the gathered
(global) array, and this position is ``lax.axis_index``. ``all_gather``
transposes to a sum over positions, so a gradient taken inside the body
follows the declared convention (docs/xmap.md: a named reduction's cotangent
is summed over the name, as ``lax.psum`` transposes; a replicated input's
gradient stays per position) with no rule of its own.
"""
from __future__ import annotations

import re
import sys
import types

import jax
import jax.numpy as jnp
from jax import lax


def axis_size(name):
    return lax.all_gather(jnp.zeros((), jnp.int32), name).shape[0]


def axis_index(name):
    return lax.axis_index(name)


def _all_gather(x, name, *, axis=0, tiled=False):
    """``lax.all_gather``; over a name with no positions, its (empty) result
    itself: JAX's transpose of all_gather batched over a size-0 name (a
    gradient inside the body) divides by the size."""
    if axis_size(name) == 0:
        x = jnp.asarray(x)
        shape = list(x.shape)
        if tiled:
            shape[axis] = 0
        else:
            shape.insert(axis, 0)
        return jnp.zeros(shape, x.dtype)
    return lax.all_gather(x, name, axis=axis, tiled=tiled)


def _gather(x, name):
    return _all_gather(x, name)


def _here(G, name):
    """Row ``axis_index(name)`` of a gathered array (zeros when the name has no
    positions: the body is traced but never runs)."""
    if G.shape[0] == 0:
        return jnp.zeros(G.shape[1:], G.dtype)
    return G[lax.axis_index(name)]


def _names_and_dims(axis):
    axes = axis if isinstance(axis, tuple) else (axis,)
    return [a for a in axes if isinstance(a, str)], [a for a in axes if not isinstance(a, str)]


def _reduction(jnp_fn):
    def reduce(x, axis):
        names, dims = _names_and_dims(axis)
        for name in names:            # each gathered name becomes a leading dim
            x = _gather(x, name)
        lead = len(names)
        dims = tuple(range(lead)) + tuple(d % (x.ndim - lead) + lead for d in dims)
        return jnp_fn(x, axis=dims)
    return reduce


sum = _reduction(jnp.sum)  # mirrors nx.sum
max = _reduction(jnp.max)
min = _reduction(jnp.min)
mean = _reduction(jnp.mean)
prod = _reduction(jnp.prod)
logsumexp = _reduction(jax.nn.logsumexp)
psum, pmax, pmin, pmean = sum, max, min, mean


_GROUP = re.compile(r"[<{]\s*([A-Za-z_][\w#]*)\s*[>}]")


def einsum(spec, *operands):
    """One named group per term (as the oracle writes them): each operand whose
    group names the axis is gathered along a new leading letter Z."""
    ins, out = spec.split("->")
    terms, gathered, name = [], [], None
    for term, x in zip(ins.split(","), operands):
        m = _GROUP.search(term)
        if m:
            name = m.group(1)
            x, term = _gather(x, name), "Z" + _GROUP.sub("", term)
        terms.append(term)
        gathered.append(x)
    m = _GROUP.search(out)
    out_term = ("Z" + _GROUP.sub("", out)) if m else out
    result = jnp.einsum(",".join(terms) + "->" + out_term, *gathered)
    return _here(result, name) if m else result


def pdot(x, y, name, *, pos_contract=((), ())):
    cx, cy = pos_contract
    return jnp.tensordot(_gather(x, name), _gather(y, name),
                         axes=((0,) + tuple(c + 1 for c in cx), (0,) + tuple(c + 1 for c in cy)))


def all_gather(x, name, *, axis=0, tiled=False):
    return _all_gather(x, name, axis=axis, tiled=tiled)


def untile(x, spec):
    ((name, dim),) = spec.items()
    return _all_gather(x, name, axis=dim, tiled=True)


def tile(x, spec):
    ((name, dim),) = spec.items()
    chunk = x.shape[dim] // axis_size(name)
    return lax.dynamic_slice_in_dim(x, lax.axis_index(name) * chunk, chunk, dim)


def psum_scatter(x, name, *, scatter_dimension=0, tiled=False):
    total = _gather(x, name).sum(0)
    n = axis_size(name)
    if not tiled:
        return _here(jnp.moveaxis(total, scatter_dimension, 0), name)
    chunk = total.shape[scatter_dimension] // n
    return lax.dynamic_slice_in_dim(total, lax.axis_index(name) * chunk, chunk, scatter_dimension)


def all_to_all(x, name, split_axis, concat_axis, *, tiled=False):
    assert tiled, "the oracle uses the tiled form"
    split_axis, concat_axis = split_axis % x.ndim, concat_axis % x.ndim
    G, n = _gather(x, name), axis_size(name)
    chunk = x.shape[split_axis] // n
    mine = [lax.dynamic_slice_in_dim(G[j], lax.axis_index(name) * chunk, chunk, split_axis)
            for j in range(n)]
    return jnp.concatenate(mine, concat_axis)


def ppermute(x, name, perm):
    n = axis_size(name)
    source = [-1] * n
    for src, dst in perm:
        source[dst] = src
    G = _gather(x, name)
    if n == 0:
        return jnp.zeros_like(x)
    src = jnp.asarray(source)[lax.axis_index(name)]
    return jnp.where(src >= 0, G[jnp.maximum(src, 0)], jnp.zeros_like(x))


def one_hot(x, *, axis):
    return (lax.axis_index(axis) == x).astype(jnp.float32)


def _uniform(key, shape, dtype=jnp.float32, minval=0.0, maxval=1.0, *, names):
    return jax.random.uniform(jax.random.fold_in(key, lax.axis_index(names)), shape, dtype,
                              minval, maxval)


random = types.SimpleNamespace(uniform=_uniform)


def inner_map(fn, xs, name, resources):
    """An inner xmap over the leading dim of ``xs``: a vmap with the name."""
    del resources
    return jax.vmap(fn, axis_name=name)(xs)


def fg(name, inside_grad):
    """Megatron's f/g (tests/_megatron.py: fg_operators) as the
    positional program means them. Inside a gradient, JAX differentiates the
    custom_vjps themselves (per position). Outside, JAX cannot (their bwd's
    psum finds the name unbound under grad of vmap), so here they are written
    with what they mean there (docs/xmap.md), for f on a value that does not
    vary along the name and g on one that does: f's cotangent is the psum of
    its result's (of a replicated value's whole cotangent: times the size of
    the name), and g is psum, whose transpose under vmap hands each position
    the whole cotangent."""
    from tests._megatron import fg_operators
    if inside_grad:
        return fg_operators(psum, name)
    f = lambda v: lax.stop_gradient(v) + psum(v, name) - lax.stop_gradient(psum(v, name))
    return f, lambda v: psum(v, name)


def custom_rules(name, inside_grad):
    """The custom rules of tests/_sequence_parallel.py and Megatron's f/g as
    the positional program means them. Inside a gradient, JAX differentiates
    the custom_vjps themselves (per position), written with lax's
    collectives: with this module's, built on all_gather, a rule's gradient
    inside a per-position lax.switch under jax.vmap comes out zero at the
    positions of one branch (JAX 0.10; lax's own agree with nxops there).
    Outside, JAX cannot (a bwd's collective finds the name unbound under grad
    of vmap), so here each is its forward with the derivative its bwd means
    there (docs/xmap.md), for an operand that varies along the name: a result
    that does not vary (the gather's, untile's, g's) hands its bwd its whole
    cotangent, the sum of the positions' cotangents, which JAX's transposes
    of all_gather and psum under vmap also sum. So every rule differentiates
    as its forward, except the gather, whose psum_scatter sums that whole
    cotangent over the name again (the size of the name times all_gather's
    transpose), and f, whose bwd is a psum (psum's transpose)."""
    from tests._megatron import fg_operators
    from tests._sequence_parallel import LAX, sequence_parallel_operators
    if inside_grad:
        f, g = fg_operators(lax.psum, name)
        return {**sequence_parallel_operators(LAX, name), "f": f, "g": g}
    rules = sequence_parallel_operators(sys.modules[__name__], name)
    forward = {kind: rule.fun for kind, rule in rules.items()}   # the custom_vjp's function
    return {
        **{kind: forward[kind] for kind in ("scatter", "all_to_all", "ring", "untile")},
        "gather": _differentiated_as(forward["gather"],
                                     lambda v: axis_size(name) * forward["gather"](v)),
        "f": _differentiated_as(lambda v: v, lambda v: psum(v, name)),
        "g": lambda v: psum(v, name),
    }


def _differentiated_as(forward, linear):
    """``forward``'s value with ``linear``'s derivative."""
    def op(v):
        return lax.stop_gradient(forward(v)) + linear(v) - lax.stop_gradient(linear(v))
    return op
