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
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from nxops._errors import NxopsError
from nxops._jax import config as jax_config
from nxops._jax import dispatch
from nxops._typing import ArrayLike
from nxops.kernels._selection import parse_selection
from nxops.kernels.pallas import cross_entropy as pallas_cross_entropy
from nxops.kernels.xla import cross_entropy as xla_cross_entropy
from nxops.ops import _axis_env, _sum_then_tile
from nxops.ops._axis_env import mesh_platform as _mesh_platform
from nxops.ops._named_layout import along_vmap_names as _along_vmap_names
from nxops.ops._primitive import (_abstract_eval_cached, _local_aval, jvp_of_evaluation, kernel_primitive,
                                  local_primitive, match_varying, selection_param)

cross_entropy_p = kernel_primitive("nx_cross_entropy", "cross_entropy",
                                   xla_cross_entropy.cross_entropy)
# Operands h [T, H], w [H, V], labels [T] (local to this vocab shard); one
# result, f32 [2, T]: the shard's logsumexp and the label's logit. Parameters:
# chunk (vocab columns per step), backward (how derivatives are made: see
# ``_stores_grads``), kernels (the selection).

F32 = jnp.float32
BACKWARDS = ("auto", "in_forward", "recompute")


def _bind(h, w, labels, *, chunk, backward, kernels):
    return cross_entropy_p.bind(h, w, labels, chunk=chunk, backward=backward, kernels=kernels)


# --- batching: every vmapped name of h / labels becomes more tokens ----------


def _fold_tokens(bind, args, dims, token_args):
    """Binds with the batch folded into the token dim of the ``token_args``
    (their dim 0); the others unbatched. Result [2, batch, T]."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    folded = list(args)
    for i in token_args:
        x = _batch_first(args[i], dims[i], size)
        folded[i] = x.reshape(size * x.shape[1], *x.shape[2:])
    out = bind(*folded)
    return out.reshape(2, size, out.shape[1] // size), 1


def _per_member(bind, args, dims):
    """A weight per batch member: no shared matmul to fold the tokens into;
    one loop per member (``lax.map``), each the primitive again."""
    batched = [i for i, d in enumerate(dims) if d is not None]

    def member(xs):
        full = list(args)
        for i, x in zip(batched, xs):
            full[i] = x
        return bind(*full)
    return lax.map(member, [jnp.moveaxis(args[i], dims[i], 0) for i in batched]), 0


def _cross_entropy_batcher(vals_in, dims_in, **params):
    bind = functools.partial(_bind, **params)
    if dims_in[1] is not None:
        return _per_member(bind, vals_in, dims_in)
    return _fold_tokens(bind, vals_in, dims_in, (0, 2))


def _batch_first(x, dim, size):
    if dim is None:
        return jnp.broadcast_to(x, (size, *x.shape))
    return jnp.moveaxis(x, dim, 0)


batching.primitive_batchers[cross_entropy_p] = _cross_entropy_batcher


# --- differentiation ------------------------------------------------------------
#
# The JVP of the primitive is its forward plus ``cross_entropy_tangent_p``, a
# primitive linear in the tangents dh, dw: evaluated, it is forward mode
# (jax.jvp, jacfwd, linearize); transposed, it is the backward (jax.grad,
# jacrev), which never holds the logits. Its operands: h, w, labels, lse,
# dh_unit, dw_unit (``forward_with_grads``' products, or empty), dh, dw (the
# tangents, or empty where zero).

EMPTY = (0,)


def _stores_grads(backward: str, tokens, hidden, vocab, kernels: str = "auto") -> bool:
    """Whether the forward pass makes the gradients (three matmuls) or the
    backward recomputes the logits (four): ``auto`` stores while the f32 dw
    and dh it holds fit ``STORED_GRADS_BYTES``, unless a kernel is selected
    (``cross_entropy=pallas``: its stored path, the Pallas softmax between
    XLA's matmuls, has no GPU measurement; ``backward="in_forward"`` takes it). No tokens, or a symbolic count
    (``nx.export``): nothing to store, or no static block; recompute."""
    if not (isinstance(tokens, int) and tokens > 0):
        return False
    if backward == "auto":
        selected = parse_selection(kernels).backend_for("cross_entropy")
        return selected in ("auto", "xla") and \
            xla_cross_entropy.stored_grads_fit(tokens, hidden, vocab)
    return backward == "in_forward"


# The stored path's forward with the Pallas kernel: a primitive lowered on
# local avals outside the mesh context (as kernels are), since a Pallas call
# traced in a shard_map body would see the operands' mesh shardings.
stored_forward_pallas_p = local_primitive(
    "nx_cross_entropy_stored_forward_pallas",
    lambda h, w, labels, *, platform: pallas_cross_entropy.forward_with_grads(
        h, w, labels, platform=platform), platform_param="platform",
    typed_by=xla_cross_entropy.forward_with_grads)


def _stored_forward_pallas_batcher(vals_in, dims_in, **params):
    """One program per batch member (``lax.map``): dw sums over a member's
    tokens only."""
    batched = [i for i, d in enumerate(dims_in) if d is not None]

    def member(xs):
        full = list(vals_in)
        for i, x in zip(batched, xs):
            full[i] = x
        return tuple(stored_forward_pallas_p.bind(*full, **params))
    outs = lax.map(member, [jnp.moveaxis(vals_in[i], dims_in[i], 0) for i in batched])
    return list(outs), [0] * len(outs)


batching.primitive_batchers[stored_forward_pallas_p] = _stored_forward_pallas_batcher
# Its derivative (a second-order one of the loss) is the reference's: the same values.
ad.primitive_jvps[stored_forward_pallas_p] = jvp_of_evaluation(
    lambda h, w, labels, *, platform: xla_cross_entropy.forward_with_grads(h, w, labels),
    without_tangent=(2,))


def _forward_with_grads(h, w, labels, kernels: str):
    """The stored path's forward: the reference's, or with the Pallas
    kernel's softmax where ``cross_entropy=pallas`` is selected (``auto``
    never stores then: see ``_stores_grads``)."""
    platform = _mesh_platform()
    if parse_selection(kernels).backend_for("cross_entropy") == "pallas" and \
            platform in pallas_cross_entropy.STORED_PLATFORMS:
        return tuple(stored_forward_pallas_p.bind(h, w, labels, platform=platform))
    return xla_cross_entropy.forward_with_grads(h, w, labels)


def _tangent_impl(h, w, labels, lse, dh_unit, dw_unit, dh, dw, *, size, stored, with_dh,
                  with_dw):
    del dh_unit, dw_unit, stored   # the backward's: forward mode recomputes by chunks
    return xla_cross_entropy.tangent(h, w, labels, lse, dh if with_dh else None,
                                     dw if with_dw else None, size)


cross_entropy_tangent_p = Primitive("nx_cross_entropy_tangent")
cross_entropy_tangent_p.def_impl(functools.partial(dispatch.apply_primitive,
                                                   cross_entropy_tangent_p))


@cross_entropy_tangent_p.def_abstract_eval
def _tangent_abstract_eval(*avals, **params):
    return _abstract_eval_cached(_tangent_impl, tuple(avals), tuple(sorted(params.items())),
                                 bool(jax.config.jax_enable_x64))


def _tangent_lowering(ctx, *args, **params):
    # A local computation: traced on plain avals, outside any mesh context (as kernels are).
    local_ctx = ctx.replace(avals_in=[_local_aval(a) for a in ctx.avals_in],
                            avals_out=[_local_aval(a) for a in ctx.avals_out])
    with (jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())),
          jax_config._check_vma(False)):
        return mlir.lower_fun(functools.partial(_tangent_impl, **params),
                              multiple_results=False)(local_ctx, *args)


mlir.register_lowering(cross_entropy_tangent_p, _tangent_lowering)


def _tangent_transpose(ct, h, w, labels, lse, dh_unit, dw_unit, dh, dw, *, size, stored,
                       with_dh, with_dw):
    need_dh = with_dh and ad.is_undefined_primal(dh)
    need_dw = with_dw and ad.is_undefined_primal(dw)
    if type(ct) is ad.Zero or not (need_dh or need_dw):
        return [None] * 8
    if stored:
        grads = xla_cross_entropy.backward_from_stored(h, w, labels, lse, ct, dh_unit, dw_unit,
                                                       size, need_dh, need_dw)
    else:
        block = xla_cross_entropy.backward_token_block(h.shape[0], h.shape[1])
        grads = xla_cross_entropy.backward(h, w, labels, lse, ct, size, need_dh, need_dw, block)
    return [None] * 6 + list(grads)


ad.primitive_transposes[cross_entropy_tangent_p] = _tangent_transpose


# Forward mode of forward mode: the loop's own JVP (labels and the stored units get none).
ad.primitive_jvps[cross_entropy_tangent_p] = jvp_of_evaluation(_tangent_impl, without_tangent=(2, 4, 5))


def _tangent_batcher(vals_in, dims_in, **params):
    bind = functools.partial(cross_entropy_tangent_p.bind, **params)
    if any(dims_in[i] is not None for i in (1, 5, 7)):   # w, dw_unit, dw
        return _per_member(bind, vals_in, dims_in)
    token_args = (0, 2, 3) + ((4,) if params["stored"] else ()) + ((6,) if params["with_dh"] else ())
    return _fold_tokens(bind, vals_in, dims_in, token_args)


batching.primitive_batchers[cross_entropy_tangent_p] = _tangent_batcher


def _cross_entropy_jvp(primals, tangents, *, chunk, backward, kernels):
    h, w, labels = primals
    dh, dw = tangents[:2]
    (tokens, hidden), vocab = h.shape, w.shape[1]
    stored = _stores_grads(backward, tokens, hidden, vocab, kernels)
    if stored:
        stats, dh_unit, dw_unit = _forward_with_grads(h, w, labels, kernels)
    else:
        stats = _bind(h, w, labels, chunk=chunk, backward=backward, kernels=kernels)
        dh_unit = dw_unit = jnp.zeros(EMPTY, F32)
    with_dh, with_dw = type(dh) is not ad.Zero, type(dw) is not ad.Zero
    if not (with_dh or with_dw):
        return stats, ad.Zero.from_primal_value(stats)
    tangent = cross_entropy_tangent_p.bind(
        h, w, labels, stats[0], dh_unit, dw_unit,
        dh if with_dh else jnp.zeros(EMPTY, h.dtype), dw if with_dw else jnp.zeros(EMPTY, w.dtype),
        size=xla_cross_entropy.chunk_size(tokens, vocab, chunk), stored=stored,
        with_dh=with_dh, with_dw=with_dw)
    return stats, tangent


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
    lse_local = stats[0]
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _summed_over_vocab_shards(h, mesh_names, vocab):
    """``h`` (replicated over the vocab's mesh axes); its cotangent is each
    shard's contribution. For a gradient taken in the body they are summed
    over the shards, so that dh is the whole gradient on every shard, as
    where the vocab is a local tile (the division undoes the psum that
    transposes the combining psum there). For a gradient taken outside the
    xmap the ``shard_map`` sums the replicated ``h``'s cotangent over those
    axes itself, and each shard's contribution is already 1x: it goes to
    that one sum as it is (one all-reduce of dh, as in the unfused program)."""
    return h


def _summed_fwd(h, mesh_names, vocab):
    return h, None


def _summed_bwd(mesh_names, vocab, _, ct):
    if _axis_env.unbound_in_running_rule(vocab):
        return (ct,)
    count = math.prod(_axis_env.physical_axis_size(n) for n in mesh_names)
    return (_sum_then_tile.mesh_sum(ct, mesh_names, platform=_mesh_platform()) / count,)


_summed_over_vocab_shards.defvjp(_summed_fwd, _summed_bwd)


INT32 = jnp.iinfo(jnp.int32)


def _check_options(ignore_index, return_lse, vocab_chunk, backward, op: str):
    if ignore_index is not None and (isinstance(ignore_index, bool) or
                                     not isinstance(ignore_index, numbers.Integral) or
                                     not INT32.min <= ignore_index <= INT32.max):
        raise NxopsError(f"{op}: ignore_index={ignore_index!r}; give an int in the int32 range "
                         f"(the labels' dtype), e.g. -100, or None to ignore nothing.")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise NxopsError(f"{op}: return_lse={return_lse!r}; give True or False.")
    if vocab_chunk is not None and (isinstance(vocab_chunk, bool) or
                                    not isinstance(vocab_chunk, numbers.Integral) or
                                    vocab_chunk < 1):
        raise NxopsError(f"{op}: vocab_chunk={vocab_chunk!r}; give a positive int (or None).")
    if not isinstance(backward, str) or backward not in BACKWARDS:
        raise NxopsError(f"{op}: backward={backward!r}; give one of {', '.join(map(repr, BACKWARDS))}.")


def _vocab_size(w2, vocab_mesh) -> int:
    """The whole vocabulary's size (the local columns times the vocab's shards)."""
    return w2.shape[1] * math.prod(_axis_env.physical_axis_size(n) for n in vocab_mesh)


def cross_entropy(h: ArrayLike, w: ArrayLike, labels: ArrayLike, *, hidden: str | int,
                  vocab: str | int, ignore_index: int | None = None, return_lse: bool = False,
                  vocab_chunk: int | None = None,
                  backward: str = "auto") -> jax.Array | tuple[jax.Array, jax.Array]:
    """Per-position ``logsumexp_v(h·w) - (h·w)[label]`` without the logits.

    ``hidden`` and ``vocab`` name the contracted and the class axis: a name
    (logical, as in ``nx.einsum``; the vocab may run on mesh axes:
    vocab-parallel) or a position: an int ``hidden`` is a dim of ``h``, an int
    ``vocab`` a dim of ``w``; ``w``'s positional dims are the positional ones
    of the two (an int hidden is w's dim other than vocab). ``labels`` has
    ``h``'s positional shape without the hidden dim, and holds global vocab
    ids; a label outside [0, vocab) (and not ``ignore_index``) gives a NaN
    loss there. Positions whose label is ``ignore_index`` give 0 and no
    gradient (whatever ``h`` holds there). Returns float32 losses of
    ``labels``' shape (and the logsumexp, 0 at ignored positions, with
    ``return_lse=True``, e.g. for a z-loss). ``vocab_chunk``: vocab columns
    per step of the loop (default: as many as keep one step's f32 logits
    within 4 MiB, 128 to 4096). ``backward``: ``"in_forward"`` makes the
    gradients in the forward pass (three matmuls, an f32 dw held until the
    backward), ``"recompute"`` recomputes the logits in the backward (four
    matmuls, nothing of the vocab's size held); ``"auto"`` stores while the
    f32 dw and dh fit 256 MiB.

    Examples:
        >>> h, w = jnp.ones((2, 4)), jnp.zeros((4, 5))   # uniform logits over 5 classes
        >>> print(np.asarray(nx.cross_entropy(h, w, jnp.array([1, 3]), hidden=1, vocab=1)).round(4))
        [1.6094 1.6094]
    """
    op = "nx.cross_entropy"
    h, w, labels = jnp.asarray(h), jnp.asarray(w), jnp.asarray(labels)
    _check_axis_argument(hidden, what="hidden", op=op)
    _check_axis_argument(vocab, what="vocab", op=op)
    _check_options(ignore_index, return_lse, vocab_chunk, backward, op)
    _check_dtypes(h, w, labels, op)
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
    h2 = h2.reshape(math.prod(token_shape), h2.shape[-1])
    kept = None if ignore_index is None else labels != ignore_index
    if kept is not None:
        # An ignored row's inputs never reach a matmul (a NaN there: no NaN in dw).
        h2 = jnp.where(kept[:, None], h2, jnp.zeros((), h2.dtype))
    local_labels = labels
    if vocab_mesh:
        local_labels = labels - lax.axis_index(vocab_mesh) * w2.shape[1]
        h2 = _summed_over_vocab_shards(h2, vocab_mesh, vocab)
    h2, w2, local_labels = match_varying(h2, w2, local_labels)
    chunk = None if vocab_chunk is None else int(vocab_chunk)
    stats = _bind(h2, w2, local_labels, chunk=chunk, backward=backward, kernels=selection_param())
    lse, picked = _combine_vocab_shards(stats, vocab_mesh) if vocab_mesh else (stats[0], stats[1])
    # A label that is no vocab id (nor ignored) has no logit: NaN, as the
    # unfused take would give; made by the subtraction, so that checkify's
    # nan_checks reports it as an error.
    outside = (labels < 0) | (labels >= _vocab_size(w2, vocab_mesh))
    if kept is not None:
        outside = outside & kept
    loss = lse - jnp.where(outside, jnp.nan, picked)
    if kept is not None:
        loss, lse = jnp.where(kept, loss, 0.0), jnp.where(kept, lse, 0.0)
    loss, lse = loss.reshape(token_shape), lse.reshape(token_shape)
    return (loss, lse) if return_lse else loss
