"""``nx.cross_entropy``: the fused ``einsum`` + ``logsumexp`` + take-by-label
of a language model's loss, over a named (or positional) vocab axis, that
never holds the tokens x vocab logits, forward or backward.

The named layer: names resolve to physical axes; the vmap part of the hidden
and vocab names is gathered into positional dims (a reshape once batched);
the tokens (``h``'s other dims and every vmapped name ``h`` varies along) are
flattened by the primitive's batching rule into one positional token dim, so
the kernel sees [T, H] x [H, V] and its backward sums dw over all tokens
itself. Vocab names on mesh axes make it vocab-parallel: each device's
kernel gives its shard's logsumexp and the label's logit where it owns the
label; one ``pmax`` and one ``psum`` of per-token scalars combine them.
"""
from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad, batching

from nxops._errors import NxopsError
from nxops._typing import ArrayLike
from nxops.kernels.xla import cross_entropy as xla_cross_entropy
from nxops.ops import _axis_env, _sum_then_tile
from nxops.ops._axis_env import mesh_platform as _mesh_platform
from nxops.ops._named_layout import along_vmap_names as _along_vmap_names
from nxops.ops._primitive import kernel_primitive, match_varying, selection_param

cross_entropy_p = kernel_primitive("nx_cross_entropy", "cross_entropy",
                                   xla_cross_entropy.cross_entropy)
# Operands h [T, H], w [H, V], labels [T] (local to this vocab shard); one
# result, f32 [2, T]: the shard's logsumexp and the label's logit. Parameters:
# chunk (vocab columns per step), kernels (the selection).


def _bind(h, w, labels, *, chunk, kernels):
    return cross_entropy_p.bind(h, w, labels, chunk=chunk, kernels=kernels)


# --- batching: every vmapped name of h / labels becomes more tokens ----------


def _cross_entropy_batcher(vals_in, dims_in, *, chunk, kernels):
    (h, w, labels), (h_dim, w_dim, labels_dim) = vals_in, dims_in
    if w_dim is not None:
        # A weight per batch member: no shared matmul to fold the tokens into.
        per_member = jax.vmap(lambda *a: xla_cross_entropy.cross_entropy(*a, chunk=chunk),
                              in_axes=dims_in, out_axes=1)
        return per_member(h, w, labels), 1
    size = h.shape[h_dim] if h_dim is not None else labels.shape[labels_dim]
    h = _batch_first(h, h_dim, size)
    labels = _batch_first(labels, labels_dim, size)
    tokens = h.shape[1]
    out = _bind(h.reshape(size * tokens, h.shape[2]), w, labels.reshape(size * tokens),
                chunk=chunk, kernels=kernels)
    return out.reshape(2, size, tokens), 1


def _batch_first(x, dim, size):
    if dim is None:
        return jnp.broadcast_to(x, (size, *x.shape))
    return jnp.moveaxis(x, dim, 0)


batching.primitive_batchers[cross_entropy_p] = _cross_entropy_batcher


# --- differentiation: the registry's forward, the reference's backward -------


def _cross_entropy_jvp(primals, tangents, *, chunk, kernels):
    """The forward is this primitive again (its kernel from the registry); the
    backward recomputes the logits chunk by chunk (the reference's)."""
    h, w, labels = primals
    dh, dw = (ad.instantiate_zeros(t) for t in tangents[:2])
    size = xla_cross_entropy.chunk_size(h.shape[0], w.shape[1], chunk)
    forward = lambda h, w, labels, size: _bind(h, w, labels, chunk=size, kernels=kernels)  # noqa: E731
    fused = xla_cross_entropy.differentiable(forward)
    return jax.jvp(lambda h, w: fused(h, w, labels, size), (h, w), (dh, dw))


ad.primitive_jvps[cross_entropy_p] = _cross_entropy_jvp


# --- the public function ------------------------------------------------------


def _resolve_name(name, *, what: str, op: str):
    """(vmap names, mesh names) carrying logical axis ``name``."""
    physical = _axis_env.resolve((name,), op=op)
    vmap_names, mesh_names = _axis_env.split_vmap_and_mesh(physical, op=op)
    if vmap_names and mesh_names and physical != mesh_names + vmap_names:
        raise NxopsError(f"{op}: the {what} axis {name!r} runs on {physical!r}, mesh axes "
                         f"after its local tile; map it to mesh axes major to minor "
                         f"(as nx.xmap does).")
    return vmap_names, mesh_names


def _check_axis_argument(axis, *, what: str, op: str):
    if isinstance(axis, bool) or axis is None or not isinstance(axis, (str, numbers.Integral)):
        raise NxopsError(f"{op}: {what}={axis!r}; give the {what} axis as a name (str) or a "
                         f"position (int).")


def _positional_dim(dim, ndim: int, *, what: str, operand: str, shape, op: str) -> int:
    if not -ndim <= int(dim) < ndim:
        raise NxopsError(f"{op}: {what}={dim} is out of range for {operand} of shape "
                         f"{tuple(shape)} (rank {ndim}).")
    return int(dim) % ndim


def _hidden_last(h, hidden, op: str):
    """h with its hidden axis as the last positional dim."""
    if isinstance(hidden, str):
        vmap_names, mesh_names = _resolve_name(hidden, what="hidden", op=op)
        if mesh_names:
            raise NxopsError(f"{op}: the hidden axis {hidden!r} runs on mesh axes "
                             f"{mesh_names!r}; the fused loss contracts it locally. Map "
                             f"{hidden!r} to no mesh axes in axis_resources (shard the vocab "
                             f"or the tokens instead).")
        return _along_vmap_names(h[..., None], "gather", vmap_names, h.ndim)
    dim = _positional_dim(hidden, h.ndim, what="hidden", operand="h", shape=h.shape, op=op)
    return jnp.moveaxis(h, dim, -1)


def _weight_as_matrix(w, hidden, vocab, op: str):
    """(w as [hidden, vocab local], the vocab's mesh names). w's positional
    dims are its hidden and vocab axes where those are positions; an int
    ``vocab`` is w's dim, and w's hidden dim is its other one."""
    positional = [a for a in (hidden, vocab) if not isinstance(a, str)]
    if w.ndim != len(positional):
        raise NxopsError(
            f"{op}: w has shape {tuple(w.shape)}, but with hidden={hidden!r} and vocab={vocab!r} "
            f"it must have {len(positional)} positional dim(s) (the positional ones of hidden "
            f"and vocab; named axes are not in the shape).")
    if not isinstance(vocab, str):
        dim = _positional_dim(vocab, w.ndim, what="vocab", operand="w", shape=w.shape, op=op)
        matrix = jnp.moveaxis(w, dim, -1) if w.ndim == 2 else w[None, :]
        mesh_names: tuple = ()
    else:
        matrix = w[:, None] if w.ndim == 1 else w[None, None]
        vmap_names, mesh_names = _resolve_name(vocab, what="vocab", op=op)
        matrix = _along_vmap_names(matrix, "gather", vmap_names, 1)
    if isinstance(hidden, str):
        vmap_names, _ = _resolve_name(hidden, what="hidden", op=op)
        matrix = _along_vmap_names(matrix, "gather", vmap_names, 0)
    return matrix, mesh_names


def _check_dtypes(h, w, labels, op: str):
    for operand, x in (("h", h), ("w", w)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise NxopsError(f"{op}: {operand} has dtype {x.dtype}; it must be floating "
                             f"(float32, bfloat16, float16).")
    if h.dtype != w.dtype:
        raise NxopsError(f"{op}: h is {h.dtype} and w is {w.dtype}; give both the same dtype "
                         f"(the logits accumulate in float32 either way).")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise NxopsError(f"{op}: labels have dtype {labels.dtype}; they must be integers "
                         f"(vocab ids).")


def _combine_vocab_shards(stats, mesh_names):
    """The global (logsumexp, label logit) from each vocab shard's: one pmax
    and one psum of per-token scalars."""
    lse_local, picked = stats[0], stats[1]
    varying = jax.typeof(lse_local).manual_axis_type.varying
    invariant = tuple(n for n in mesh_names if n not in varying)
    if invariant:   # a shard that does not vary (check_vma): its collectives want varying
        stats = lax.pcast(stats, invariant, to="varying")
        lse_local = stats[0]
    # The shift cancels in value; its gradient is zero (and pmax has none).
    top = lax.pmax(lax.stop_gradient(lse_local), mesh_names)
    # The psum of the named reductions (its transpose too: the in-body gradient rule).
    summed = _sum_then_tile.mesh_sum(jnp.stack([jnp.exp(lse_local - top), stats[1]]), mesh_names,
                              platform=_mesh_platform())
    return top + jnp.log(summed[0]), summed[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _summed_over_vocab_shards(h, mesh_names):
    """``h`` (replicated over the vocab's mesh axes); its cotangent is each
    shard's contribution: summed over the shards here, so that dh is the
    whole gradient on every shard, as where the vocab is a local tile. (The
    division undoes the psum that transposes the combining psum; a gradient
    taken outside the xmap then psums the replicated h's cotangent once more,
    over the cotangent shard_map divided by the shard count.)"""
    return h


def _summed_fwd(h, mesh_names):
    return h, None


def _summed_bwd(mesh_names, _, ct):
    count = math.prod(_axis_env.physical_axis_size(n) for n in mesh_names)
    return (_sum_then_tile.mesh_sum(ct, mesh_names, platform=_mesh_platform()) / count,)


_summed_over_vocab_shards.defvjp(_summed_fwd, _summed_bwd)


def cross_entropy(h: ArrayLike, w: ArrayLike, labels: ArrayLike, *, hidden: str | int,
                  vocab: str | int, ignore_index: int | None = None, return_lse: bool = False,
                  vocab_chunk: int | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Per-position ``logsumexp_v(h·w) - (h·w)[label]`` without the logits.

    ``hidden`` and ``vocab`` name the contracted and the class axis: a name
    (logical, as in ``nx.einsum``; the vocab may run on mesh axes:
    vocab-parallel) or a position: an int ``hidden`` is a dim of ``h``, an int
    ``vocab`` a dim of ``w``; ``w``'s positional dims are the positional ones
    of the two (an int hidden is w's dim other than vocab). ``labels`` has
    ``h``'s positional shape without the hidden dim, and holds global vocab
    ids. Positions whose label is ``ignore_index`` give 0 and no gradient.
    Returns float32 losses of ``labels``' shape (and the logsumexp, 0 at
    ignored positions, with ``return_lse=True``, e.g. for a z-loss).
    ``vocab_chunk``: vocab columns per step of the loop (default: as many as
    keep one step's f32 logits within 4 MiB, 128 to 4096).

    Examples:
        >>> h, w = jnp.ones((2, 4)), jnp.zeros((4, 5))   # uniform logits over 5 classes
        >>> print(np.asarray(nx.cross_entropy(h, w, jnp.array([1, 3]), hidden=1, vocab=1)).round(4))
        [1.6094 1.6094]
    """
    op = "nx.cross_entropy"
    h, w, labels = jnp.asarray(h), jnp.asarray(w), jnp.asarray(labels)
    _check_axis_argument(hidden, what="hidden", op=op)
    _check_axis_argument(vocab, what="vocab", op=op)
    _check_dtypes(h, w, labels, op)
    if vocab_chunk is not None and (not isinstance(vocab_chunk, numbers.Integral) or vocab_chunk < 1):
        raise NxopsError(f"{op}: vocab_chunk={vocab_chunk!r}; give a positive int (or None).")
    h2 = _hidden_last(h, hidden, op)
    w2, vocab_mesh = _weight_as_matrix(w, hidden, vocab, op)
    token_shape = h2.shape[:-1]
    if h2.shape[-1] != w2.shape[0]:
        raise NxopsError(f"{op}: the hidden axis {hidden!r} has size {h2.shape[-1]} in h "
                         f"(shape {tuple(h.shape)}) but {w2.shape[0]} in w (shape "
                         f"{tuple(w.shape)}); they must match.")
    if w2.shape[1] == 0:
        raise NxopsError(f"{op}: the vocab axis {vocab!r} has size 0 (w has shape "
                         f"{tuple(w.shape)}); a logsumexp over no classes is undefined.")
    if labels.shape != token_shape:
        raise NxopsError(f"{op}: labels have shape {tuple(labels.shape)}, but h of shape "
                         f"{tuple(h.shape)} without its hidden axis {hidden!r} has shape "
                         f"{tuple(token_shape)}; give one label per position.")
    labels = labels.astype(jnp.int32).reshape(-1)
    local_labels = labels
    if vocab_mesh:
        local_labels = labels - lax.axis_index(vocab_mesh) * w2.shape[1]
        h2 = _summed_over_vocab_shards(h2, vocab_mesh)
    h2, w2, local_labels = match_varying(h2.reshape(math.prod(token_shape), h2.shape[-1]),
                                         w2, local_labels)
    chunk = None if vocab_chunk is None else int(vocab_chunk)
    stats = _bind(h2, w2, local_labels, chunk=chunk, kernels=selection_param())
    lse, picked = _combine_vocab_shards(stats, vocab_mesh) if vocab_mesh else (stats[0], stats[1])
    loss = lse - picked
    if ignore_index is not None:
        kept = labels != ignore_index
        loss, lse = jnp.where(kept, loss, 0.0), jnp.where(kept, lse, 0.0)
    loss, lse = loss.reshape(token_shape), lse.reshape(token_shape)
    return (loss, lse) if return_lse else loss
