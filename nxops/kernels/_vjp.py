"""How every kernel becomes differentiable: the kernel computes the forward,
the reference's gradient (written out here, once per op) the backward.

A kernel has no AD rule of its own (a ``pallas_call`` differentiates through
its body, a Triton launch not at all), so :func:`with_vjp` wraps its forward
in one ``jax.custom_vjp`` whose backward is the op's VJP below. The static
parameters (axes, op, target, ...) are keyword arguments, hashable.

Kernels whose primitive carries an effect (the interpret-mode ring
collectives' ordered host callbacks) declare its type with
:func:`allow_kernel_effect`, so that the same wrapper takes them.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nxops._jax import effects as jax_effects
from nxops.kernels import _layout


def with_vjp(forward: Callable, vjp: Callable) -> Callable:
    """``forward(*operands, **static)`` differentiated by ``vjp(*operands,
    out=, g=, **static)``, which returns one cotangent per operand (None for
    an integer operand). The residuals are the operands and the result."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def call(static, *operands):
        return forward(*operands, **dict(static))

    def call_fwd(static, *operands):
        out = call(static, *operands)
        return out, (operands, out)

    def call_bwd(static, residuals, g):
        operands, out = residuals
        return tuple(vjp(*operands, out=out, g=g, **dict(static)))

    call.defvjp(call_fwd, call_bwd)

    @functools.wraps(forward)
    def run(*operands, **static):
        return call(tuple(sorted(static.items())), *operands)

    return run


def allow_kernel_effect(effect_type: type) -> None:
    """Lets a kernel primitive carry effects of ``effect_type`` wherever the
    kernels go: lowered, ordered (also over sharded programs), inside control
    flow, ``jax.checkpoint`` and the custom VJP of :func:`with_vjp`: its
    forward runs the kernel once, and the backward of such a kernel is its
    effect-free reference's (:func:`reference_vjp`). Without the last, the
    kernel's jaxpr fails JAX's own typecheck under ``jax_enable_checks``."""
    for allowed in (jax_effects.lowerable_effects, jax_effects.control_flow_allowed_effects,
                    jax_effects.ordered_effects, jax_effects.shardable_ordered_effects,
                    jax_effects.remat_allowed_effects,
                    jax_effects.custom_derivatives_allowed_effects):
        allowed.add_type(effect_type)


# ---------------------------------------------------------------------------
# The VJPs, one per op


def reduce_vjp(x: jax.Array, *, out: jax.Array, g: jax.Array, axes: tuple[int, ...], op: str,
               **static) -> tuple[jax.Array]:
    """The cotangent of ``x`` for ``out = jnp.<op>(x, axis=axes)``.

    ``max``/``min`` ties share the cotangent equally (as JAX's reduce_max JVP);
    ``prod`` takes the reference's own VJP, exact where ``x`` has zeros.
    """
    del static
    axes = _layout.normalize_axes(axes, x.ndim)

    def expand(v):
        return jnp.expand_dims(v, axes)

    if op == "sum":
        dx = jnp.broadcast_to(expand(g), x.shape)
    elif op in ("max", "min"):
        hits = (x == expand(out)).astype(g.dtype)
        dx = hits * expand(g / jnp.sum(hits, axis=axes))
    elif op == "logsumexp":
        dx = expand(g) * jnp.exp(x - expand(out))
    elif op == "prod":
        _, vjp = jax.vjp(lambda v: jnp.prod(v, axis=axes), x)
        (dx,) = vjp(g)
    else:
        raise ValueError(f"no VJP for the reduction {op!r}")
    return (dx.astype(x.dtype),)


def tile_vjp(x: jax.Array, index, *, out, g: jax.Array, dim: int, count: int,
             **static) -> tuple[jax.Array, None]:
    """The cotangent of ``x`` in ``tile(x, index)``: ``g`` at the tile, zeros
    elsewhere; none for the integer ``index``."""
    del out, static
    dim = dim % x.ndim
    start = _layout.effective_index(index, count) * (x.shape[dim] // count)
    return lax.dynamic_update_slice_in_dim(jnp.zeros(x.shape, g.dtype), g, start, axis=dim), None


def dot_general_vjp(forward: Callable) -> Callable:
    """The VJP of a contraction kernel ``forward(a, b, *, dimension_numbers,
    preferred_element_type, **static)``: its cotangents ``(da, db)`` are
    contractions too (JAX's transpose rule), computed by ``forward`` itself
    in the operands' common dtype, accumulated and returned in f32 before the
    cast to each operand's dtype."""
    def vjp(a, b, *, out, g, dimension_numbers, preferred_element_type, **static):
        del out, preferred_element_type

        def contract(x, y, dims):
            common = jnp.promote_types(x.dtype, y.dtype)
            return forward(x.astype(common), y.astype(common), dimension_numbers=dims,
                           preferred_element_type=jnp.float32, **static)

        (a_contract, b_contract), (a_batch, b_batch) = dimension_numbers
        swapped = ((b_contract, a_contract), (b_batch, a_batch))
        da = _transpose_lhs(g, a.ndim, b, dimension_numbers, contract, swap_ans=False)
        db = _transpose_lhs(g, b.ndim, a, swapped, contract, swap_ans=True)
        return da.astype(a.dtype), db.astype(b.dtype)
    return vjp


def _consecutive_ranges(*groups):
    start = 0
    for group in groups:
        yield tuple(range(start, start + len(group)))
        start += len(group)


def _transpose_lhs(g, a_ndim: int, b, dimension_numbers, contract, *, swap_ans: bool):
    """Cotangent of ``a`` in ``dot_general(a, b)`` (``swap_ans``: of ``b`` in
    ``dot_general(b, a)`` with swapped dimension numbers)."""
    (a_contract, b_contract), (a_batch, b_batch) = dimension_numbers
    a_kept = _layout.free_dims(a_ndim, a_contract, a_batch)
    b_kept = _layout.free_dims(b.ndim, b_contract, b_batch)
    if swap_ans:
        ans_batch, ans_b, _ = _consecutive_ranges(a_batch, b_kept, a_kept)
    else:
        ans_batch, _, ans_b = _consecutive_ranges(a_batch, a_kept, b_kept)
    dims = ((ans_b, tuple(b_kept)), (ans_batch, tuple(b_batch)))
    a_contract_in_b_order = [a_contract[i] for i in np.argsort(b_contract)]
    out_axes = np.argsort([*a_batch, *a_kept, *a_contract_in_b_order])
    return jnp.transpose(contract(g, b, dims), tuple(int(i) for i in out_axes))


def reference_vjp(reference: Callable) -> Callable:
    """The VJP of ``reference(x, **static)`` itself: for kernels whose
    reference is linear in ``x`` (the collectives: the backward of an
    all-gather is XLA's reduce-scatter and the other way round)."""
    def vjp(x, *, out, g, **static):
        del out
        _, transpose = jax.vjp(functools.partial(reference, **static), x)
        return transpose(g)
    return vjp
