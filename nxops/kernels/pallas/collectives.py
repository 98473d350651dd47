"""Ring all-gather and ring reduce-scatter over one mesh axis, as Pallas TPU
(Mosaic) kernels with remote DMAs and semaphores.

Reference (same signatures, tested against): ``nxops/kernels/xla/collectives.py``
(``lax.all_gather`` / ``lax.psum_scatter``). Algorithms, bytes moved and what
was verified: ``COLLECTIVES.md`` next to this file.

Both are called inside a ``jax.shard_map`` body where ``axis_name`` is one
manual mesh axis. ``platform="tpu"`` lowers to Mosaic; ``platform="cpu"`` runs
the same kernel under the TPU interpret mode, which simulates the devices'
memories, remote DMAs and semaphores on the (simulated) CPU devices.
``platform="cuda"`` uses JAX's Mosaic GPU multimem collectives, opt-in
(``_collectives_mgpu.py``).

Layout: the kernels index only the *leading* dimension with a device index.
The wrappers move the gathered / scattered dimension to the front (a free
reshape when it already is the first dimension, a local transpose otherwise)
and back.

Bidirectional ring: every chunk is split in two halves along one dimension;
half A travels to the right neighbour (device i -> i+1), half B to the left,
so both links of every device carry data at once. When a chunk cannot be
split cleanly for a TPU DMA (see ``_split``), half A is the whole chunk and
the ring is unidirectional.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.interpreters import mlir

from nxops._jax import config as jax_config
from nxops._jax import effects as jax_effects
from nxops._jax import pallas_core
from nxops.kernels import _layout, _vjp
from nxops.kernels._registry import Kernel, register
from nxops.kernels.pallas import _collectives_mgpu, _common
from nxops.kernels.xla import collectives as xla_collectives

# Barrier semaphores of different collective kernels must not be confused.
_ALL_GATHER_COLLECTIVE_ID = 0
_REDUCE_SCATTER_COLLECTIVE_ID = 1

# Interpret mode: eager DMAs (the default "on_wait" mode gives wrong results
# for 3+ devices, see DESIGN.md) and the race detector on.
INTERPRET_PARAMS = pltpu.InterpretParams(dma_execution_mode="eager", detect_races=True)

# Interpret mode simulates every device on the host, and deadlocks (0% CPU)
# once buffers grow: measured on a 2-core machine, JAX's own example
# all-gather too, 8 devices hang with 16 KiB shards (a 128 KiB gathered
# buffer), 2 and 4 devices ran 256 KiB ones. Limit the full buffer N (the
# gathered result, the reduce-scatter input) per device count.
MAX_INTERPRET_BUFFER_BYTES = {2: 256 * 1024, 4: 256 * 1024}
MAX_INTERPRET_BUFFER_BYTES_DEFAULT = 64 * 1024  # other device counts, 8 included
# The reduce-scatter keeps its input, a receive buffer (as large) and its
# output in VMEM; stay well inside the default scoped VMEM limit.
MAX_TPU_REDUCE_SCATTER_VMEM_BYTES = 12 * 1024 * 1024

ALL_GATHER_DTYPES = frozenset(map(np.dtype, (
    jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.uint32, jnp.int16,
    jnp.uint16, jnp.int8, jnp.uint8)))
REDUCE_SCATTER_DTYPES = frozenset(map(np.dtype, (
    jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32)))


# ---------------------------------------------------------------------------
# Ring geometry


@dataclasses.dataclass(frozen=True)
class _Halves:
    """How a chunk of ``shape`` is split between the two ring directions:
    ``a`` (travels right) is ``[0, cut)`` of dimension ``dim``, ``b`` (travels
    left) the rest. ``dim`` is None when the chunk is not split."""

    shape: tuple[int, ...]
    dim: int | None
    cut: int = 0

    @property
    def bidirectional(self) -> bool:
        return self.dim is not None

    def a(self) -> tuple:
        if self.dim is None:
            return tuple(slice(None) for _ in self.shape)
        return self._window(0, self.cut)

    def b(self) -> tuple:
        return self._window(self.cut, self.shape[self.dim] - self.cut)

    def _window(self, start: int, size: int) -> tuple:
        return tuple(pl.ds(start, size) if d == self.dim else slice(None)
                     for d in range(len(self.shape)))


def _split(chunk_shape: tuple[int, ...], itemsize: int) -> _Halves:
    """Halves along the outermost dimension a TPU DMA can cut cleanly.

    Leading (untiled) dimensions can be cut anywhere; the second-minor one
    only at a multiple of the sublane tile, the minor one at a multiple of
    128 lanes.
    """
    rank = len(chunk_shape)
    sublanes = 8 * max(1, 4 // itemsize)
    for d, size in enumerate(chunk_shape):
        half = size // 2
        if d < rank - 2:
            ok = half > 0
        elif d == rank - 2:
            ok = half > 0 and half % sublanes == 0
        else:
            ok = half > 0 and half % 128 == 0
        if ok:
            return _Halves(chunk_shape, d, half)
    return _Halves(chunk_shape, None)


def _ring(axis_name: str):
    """(me, n, right, left): this device's index along ``axis_name``, the
    axis size, and the neighbours as MESH device ids (other mesh axes keep
    this device's coordinates)."""
    me = lax.axis_index(axis_name)
    n = lax.axis_size(axis_name)
    right = {axis_name: lax.rem(me + 1, n)}
    left = {axis_name: lax.rem(me + n - 1, n)}
    return me, n, right, left


def _barrier_with_neighbours(right, left) -> None:
    """Waits until both neighbours have entered the kernel, so their buffers
    are theirs (not XLA's) when we write into them."""
    sem = pltpu.get_barrier_semaphore()
    pl.semaphore_signal(sem, 1, device_id=right)
    pl.semaphore_signal(sem, 1, device_id=left)
    pl.semaphore_wait(sem, 2)


def _exchange(halves, a, b, send_sems, recv_sems, right, left) -> None:
    """One ring step: sends half A (``a = (src, dst)`` refs) right and half B
    left, then waits until ours are sent and our neighbours' have arrived
    (they are symmetric: same sizes, same semaphores)."""
    dmas = [pltpu.make_async_remote_copy(
        a[0].at[halves.a()], a[1].at[halves.a()], send_sems.at[0], recv_sems.at[0],
        device_id=right)]
    if halves.bidirectional:
        dmas.append(pltpu.make_async_remote_copy(
            b[0].at[halves.b()], b[1].at[halves.b()], send_sems.at[1], recv_sems.at[1],
            device_id=left))
    for dma in dmas:
        dma.start()
    for dma in dmas:
        dma.wait()


# ---------------------------------------------------------------------------
# All-gather


def _all_gather_kernel(x_ref, o_ref, local_sem, send_sems, recv_sems, *, axis_name, halves):
    """o[j] = x of device j for every j, over a (bidirectional) ring.

    Step s sends the chunk of device me-s (half A, to the right) and of
    device me+s (half B, to the left); step 0 sends straight from x, later
    steps forward what the previous step received. Every chunk of every
    device's output is written exactly once, so there is no flow control.
    """
    me, n, right, left = _ring(axis_name)
    own = pltpu.make_async_copy(x_ref, o_ref.at[me], local_sem)
    own.start()
    _barrier_with_neighbours(right, left)
    exchange = functools.partial(_exchange, halves, send_sems=send_sems, recv_sems=recv_sems,
                                 right=right, left=left)
    exchange((x_ref, o_ref.at[me]), (x_ref, o_ref.at[me]))

    def step(s, carry):
        a_chunk, b_chunk = lax.rem(me + n - s, n), lax.rem(me + s, n)
        exchange((o_ref.at[a_chunk], o_ref.at[a_chunk]), (o_ref.at[b_chunk], o_ref.at[b_chunk]))
        return carry

    lax.fori_loop(1, n - 1, step, 0)
    own.wait()


def all_gather(x: jax.Array, axis_name, *, axis: int, tiled: bool, platform: str = "cpu") -> jax.Array:
    """``lax.all_gather(x, axis_name, axis=axis, tiled=tiled)`` as a Pallas ring kernel.

    ``axis_name`` is one manual mesh axis of the enclosing ``shard_map``. As
    the xla reference, the result is typed invariant over ``axis_name``.
    Differentiable and batchable (see ``_collective``).
    """
    axis_name = _one_axis(axis_name)
    axis = _layout.normalize_axis(axis, x.ndim if tiled else x.ndim + 1)
    return _run(x, op="all_gather", axis_name=axis_name, dim=axis, tiled=tiled, platform=platform)


def _all_gather_call(x, axis_name: str, axis: int, tiled: bool, platform: str):
    if platform == "cuda":
        return _collectives_mgpu.all_gather(x, axis_name, axis=axis, tiled=tiled)
    n = lax.axis_size(axis_name)
    kernel = functools.partial(_all_gather_kernel, axis_name=axis_name,
                               halves=_split(x.shape, x.dtype.itemsize))
    stacked = _pallas_call(
        kernel, x, _out_type((n, *x.shape), x, invariant_over=axis_name),
        scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA((2,)),
                        pltpu.SemaphoreType.DMA((2,))],
        memory_space=pl.ANY, collective_id=_ALL_GATHER_COLLECTIVE_ID, platform=platform,
        name="nxops_ring_all_gather",
        # Every device writes n chunks and reads (sends) n - 1 of them plus its own.
        cost=_common.cost_estimate([x] * n, [((n, *x.shape), x.dtype)],
                                   remote_bytes=(n - 1) * _nbytes(x)))
    gathered = jnp.moveaxis(stacked, 0, axis)  # (..., n, *x.shape[axis:])
    if not tiled:
        return gathered
    return gathered.reshape(x.shape[:axis] + (n * x.shape[axis],) + x.shape[axis + 1:])


# ---------------------------------------------------------------------------
# Reduce-scatter


def _accumulate(acc_ref, x_ref, chunk, window) -> None:
    """acc[chunk][window] += x[chunk][window], adding floats in at least f32."""
    acc, mine = acc_ref.at[chunk], x_ref.at[chunk]
    wide = jnp.promote_types(acc_ref.dtype, jnp.float32) if jnp.issubdtype(
        acc_ref.dtype, jnp.floating) else acc_ref.dtype
    acc[window] = (acc[window].astype(wide) + mine[window].astype(wide)).astype(acc_ref.dtype)


def _reduce_scatter_kernel(x_ref, o_ref, acc_ref, send_sems, recv_sems, *, axis_name, halves):
    """o = sum over devices j of x_j[me] (x is (n, *chunk)), over a (bidirectional) ring.

    Half A of the partial sum of chunk c travels right: at step s device me
    sends chunk me-s-1; its right neighbour adds its own x[c] and forwards it
    at step s+1, until after n-1 hops it reaches device c, which adds its own
    x[c] last. Half B travels left with chunk me+s+1. Partial sums land in
    ``acc[c]`` on the receiver, each slot written once: no flow control.
    """
    me, n, right, left = _ring(axis_name)
    _barrier_with_neighbours(right, left)
    exchange = functools.partial(_exchange, halves, send_sems=send_sems, recv_sems=recv_sems,
                                 right=right, left=left)

    def chunks(s):
        return lax.rem(me + 2 * n - s - 1, n), lax.rem(me + s + 1, n)

    a_chunk, b_chunk = chunks(0)
    exchange((x_ref.at[a_chunk], acc_ref.at[a_chunk]), (x_ref.at[b_chunk], acc_ref.at[b_chunk]))

    def add_own(a_chunk, b_chunk):
        _accumulate(acc_ref, x_ref, a_chunk, halves.a())
        if halves.bidirectional:
            _accumulate(acc_ref, x_ref, b_chunk, halves.b())

    def step(s, carry):
        a_chunk, b_chunk = chunks(s)  # what arrived at step s-1
        add_own(a_chunk, b_chunk)
        exchange((acc_ref.at[a_chunk], acc_ref.at[a_chunk]),
                 (acc_ref.at[b_chunk], acc_ref.at[b_chunk]))
        return carry

    lax.fori_loop(1, n - 1, step, 0)
    add_own(me, me)
    o_ref[...] = acc_ref[me]


def reduce_scatter(x: jax.Array, axis_name, *, scatter_dimension: int, tiled: bool,
                   platform: str = "cpu") -> jax.Array:
    """``lax.psum_scatter(x, axis_name, scatter_dimension=..., tiled=...)`` as a Pallas ring kernel.

    ``axis_name`` is one manual mesh axis of the enclosing ``shard_map``.
    """
    axis_name = _one_axis(axis_name)
    n = lax.axis_size(axis_name)
    d = _layout.normalize_axis(scatter_dimension, x.ndim)
    if n > 1 and (x.shape[d] % n or (not tiled and x.shape[d] != n)):
        want = f"a multiple of {n}" if tiled else f"equal to {n}"
        raise ValueError(f"reduce_scatter: dimension {d} of {x.shape} must be {want}")
    return _run(x, op="reduce_scatter", axis_name=axis_name, dim=d, tiled=tiled, platform=platform)


def _reduce_scatter_call(x, axis_name: str, d: int, tiled: bool, platform: str):
    if platform == "cuda":
        return _collectives_mgpu.reduce_scatter(x, axis_name, scatter_dimension=d, tiled=tiled)
    n = lax.axis_size(axis_name)
    m = x.shape[d] // n
    chunk_shape = x.shape[:d] + (m,) + x.shape[d + 1:]
    chunks = jnp.moveaxis(x.reshape(x.shape[:d] + (n, m) + x.shape[d + 1:]), d, 0)
    kernel = functools.partial(_reduce_scatter_kernel, axis_name=axis_name,
                               halves=_split(chunk_shape, x.dtype.itemsize))
    out = _pallas_call(
        kernel, chunks, _out_type(chunk_shape, x),
        scratch_shapes=[pltpu.VMEM((n, *chunk_shape), x.dtype),
                        pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,))],
        memory_space=pltpu.VMEM, collective_id=_REDUCE_SCATTER_COLLECTIVE_ID, platform=platform,
        name="nxops_ring_reduce_scatter",
        # Reads its n chunks and n - 1 received partial sums, adds n - 1 chunks.
        cost=_common.cost_estimate([x, ((n - 1, *chunk_shape), x.dtype)],
                                   [((n - 1, *chunk_shape), x.dtype), (chunk_shape, x.dtype)],
                                   flops=(n - 1) * math.prod(chunk_shape),
                                   remote_bytes=(n - 1) * _nbytes(x) // n))
    return out if tiled else jnp.squeeze(out, d)


# ---------------------------------------------------------------------------
# Differentiation and batching
#
# The kernels have no AD or batching rules of their own. Reverse mode uses
# the transpose of the xla reference (all-gather <-> reduce-scatter; for the
# invariant all-gather a local slice), so the backward pass runs XLA's
# collective; the forward keeps the input as the residual. Under vmap the
# batch becomes one more leading dimension of the same collective.

_CALLS = {"all_gather": _all_gather_call, "reduce_scatter": _reduce_scatter_call}


def _reference(x, *, op: str, axis_name: str, dim: int, tiled: bool, platform: str):
    if op == "all_gather":
        return xla_collectives.all_gather(x, axis_name, axis=dim, tiled=tiled, platform=platform)
    return xla_collectives.reduce_scatter(x, axis_name, scatter_dimension=dim, tiled=tiled,
                                          platform=platform)


@functools.lru_cache(maxsize=256)
def _batchable(op: str, axis_name: str, dim: int, tiled: bool, platform: str):
    """The kernel call for ``op`` as a ``custom_vmap`` function of its operand."""

    @jax.custom_batching.custom_vmap
    def call(x):
        return _CALLS[op](x, axis_name, dim, tiled, platform)

    @call.def_vmap
    def batched(axis_size, in_batched, x):
        del axis_size
        (is_batched,) = in_batched
        if not is_batched:
            return call(x), False
        return _batchable(op, axis_name, dim + 1, tiled, platform)(x), True  # batch at 0

    return call


def _forward(x, *, op: str, axis_name: str, dim: int, tiled: bool, platform: str):
    return _batchable(op, axis_name, dim, tiled, platform)(x)


_collective = _vjp.with_vjp(_forward, _vjp.reference_vjp(_reference))


def _run(x, **static):
    """The ring kernel, differentiable; the reference where the axis has one
    position (nothing to move)."""
    if lax.axis_size(static["axis_name"]) == 1:
        return _reference(x, **static)
    return _collective(_varying(x, static["axis_name"]), **static)


# ---------------------------------------------------------------------------
# The pallas_call, its types, and lowering inside shard_map


def _pallas_call(kernel, x, out_type, *, scratch_shapes, memory_space, collective_id, platform,
                 name, cost):
    call = pl.pallas_call(
        kernel,
        out_shape=out_type,
        in_specs=[pl.BlockSpec(memory_space=memory_space)],
        out_specs=pl.BlockSpec(memory_space=memory_space),
        scratch_shapes=scratch_shapes,
        compiler_params=pltpu.CompilerParams(collective_id=collective_id),
        cost_estimate=cost,
        name=name,
        interpret=INTERPRET_PARAMS if platform == "cpu" else False,
    )
    out_aval = jax.typeof(jax.eval_shape(call, x))
    effects = frozenset(pallas_core.get_interpret_effects(INTERPRET_PARAMS if platform == "cpu" else False))
    (out,) = _without_vma_check_p.bind(x, fn=lambda v: [call(v)], out_aval=out_aval,
                                       kernel_effects=effects)
    return out


def _nbytes(x) -> int:
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize


def _out_type(shape, x, *, invariant_over=None) -> jax.ShapeDtypeStruct:
    """The result type: varying over the mesh axes ``x`` varies over, except
    ``invariant_over`` (the all-gathered result is the same on every device)."""
    mat = jax.typeof(x).mat
    if invariant_over is not None:
        mat = mat.update(varying=frozenset(a for a in mat.varying if a != invariant_over))
    return jax.ShapeDtypeStruct(shape, x.dtype, manual_axis_type=mat)


def _varying(x, axis_name: str):
    """``x`` typed as varying over ``axis_name`` (what the collective consumes)."""
    if axis_name in jax.typeof(x).mat.varying:
        return x
    return lax.pcast(x, axis_name, to="varying")


# The kernels are traced without varying-axes types (pallas_call does so), but
# lowering them inside a shard_map body with check_vma=True (the default)
# fails in JAX 0.10.2: TPU interpret mode replays the kernel's jaxpr on values
# that vary over the manual axis ("add requires varying manual axes to
# match"), and Mosaic cannot lower the `pvary` that a MESH device id picks
# up. This primitive has the pallas_call's type and lowers it with the check off.
_without_vma_check_p = jax.extend.core.Primitive("nxops_pallas_collective")
_without_vma_check_p.multiple_results = True


class InterpretCollectiveEffect(jax_effects.Effect):
    """The host callbacks of the interpret-mode ring kernels, as one ordered
    effect of nxops' own. They must stay ordered (the kernels share the TPU
    interpreter's global state), but their own effect types (JAX's io_callback
    effects) make jax.checkpoint refuse the collective ("Effects not supported
    in partial-eval of checkpoint/remat"; GPT-J's remat'ed layers), and
    allowing those for remat would change every io_callback. The lowering
    threads this effect's token through the kernel's ordered callbacks."""


_INTERPRET_EFFECT = InterpretCollectiveEffect()
_vjp.allow_kernel_effect(InterpretCollectiveEffect)


def _without_vma_check_abstract_eval(x_aval, *, fn, out_aval, kernel_effects):
    del x_aval, fn
    return [out_aval], {_INTERPRET_EFFECT} if kernel_effects else set()


def _without_vma_check_lowering(ctx, x, *, fn, out_aval, kernel_effects):
    del out_aval
    if not kernel_effects:
        with jax_config._check_vma(False):
            return mlir.lower_fun(fn, multiple_results=True)(ctx, x)
    token = ctx.tokens_in.get(_INTERPRET_EFFECT)
    inner = ctx.replace(tokens_in=mlir.TokenSet({
        e: token for e in kernel_effects if jax_effects.ordered_effects.contains(e)}))
    with jax_config._check_vma(False):
        outs = mlir.lower_fun(fn, multiple_results=True)(inner, x)
    token_out = next((inner.tokens_out.get(e) for e in kernel_effects
                      if jax_effects.ordered_effects.contains(e)), token)
    ctx.set_tokens_out(mlir.TokenSet({_INTERPRET_EFFECT: token_out}))
    return outs


_without_vma_check_p.def_effectful_abstract_eval(_without_vma_check_abstract_eval)
mlir.register_lowering(_without_vma_check_p, _without_vma_check_lowering)


# ---------------------------------------------------------------------------
# Arguments and the registry


def _one_axis(axis_name):
    if isinstance(axis_name, (tuple, list)):
        if len(axis_name) != 1:
            raise ValueError(f"the Pallas collectives run over one mesh axis, got {axis_name!r}")
        (axis_name,) = axis_name
    return axis_name


def _axis_size_or_device_count(axis_name) -> int:
    """The axis size inside the shard_map body; outside, the device count (an upper bound)."""
    try:
        return lax.axis_size(_one_axis(axis_name))
    except (NameError, ValueError, TypeError):
        return jax.device_count()


def _reasons(x, axis_name, platform, dtypes, *, gathers: bool) -> list[str]:
    reasons = []
    if isinstance(axis_name, (tuple, list)) and len(axis_name) != 1:
        reasons.append(f"it runs over one mesh axis, not {len(axis_name)} ({tuple(axis_name)})")
    dtype = np.dtype(x.dtype)
    if dtype not in dtypes:
        reasons.append(f"dtype {dtype} is not one of {', '.join(sorted(map(str, dtypes)))}")
    if platform == "cpu" and jax.process_count() > 1:
        # Interpret mode simulates DMAs between devices of one process only; across
        # processes its semaphore waits never return.
        reasons.append("TPU interpret mode on CPU cannot send DMAs between processes "
                       f"({jax.process_count()} processes here)")
    if platform == "cpu" and not reasons:
        n = _axis_size_or_device_count(axis_name)
        buffer = math.prod(x.shape) * dtype.itemsize * (n if gathers else 1)
        limit = MAX_INTERPRET_BUFFER_BYTES.get(n, MAX_INTERPRET_BUFFER_BYTES_DEFAULT)
        if buffer > limit:
            reasons.append(f"a {buffer}-byte buffer over {n} devices is too large for the TPU "
                           f"interpret mode on CPU (at most {limit} bytes; larger ones deadlock)")
    return reasons


def all_gather_not_supported_reasons(x, axis_name=None, *, platform, **params) -> list[str]:
    """Why the Pallas all-gather cannot take this case (empty when it can)."""
    if platform == "cuda":
        return _collectives_mgpu.not_supported_reasons(x, axis_name, op="all_gather", **params)
    return _reasons(x, axis_name, platform, ALL_GATHER_DTYPES, gathers=True)


def reduce_scatter_not_supported_reasons(x, axis_name=None, *, platform, **params) -> list[str]:
    """Why the Pallas reduce-scatter cannot take this case (empty when it can)."""
    if platform == "cuda":
        return _collectives_mgpu.not_supported_reasons(x, axis_name, op="reduce_scatter", **params)
    reasons = _reasons(x, axis_name, platform, REDUCE_SCATTER_DTYPES, gathers=False)
    nbytes = math.prod(x.shape) * np.dtype(x.dtype).itemsize
    if platform == "tpu" and 2.5 * nbytes > MAX_TPU_REDUCE_SCATTER_VMEM_BYTES:
        reasons.append(f"a {nbytes}-byte operand does not fit the kernel's VMEM budget "
                       f"(input, receive buffer and output: at most "
                       f"{MAX_TPU_REDUCE_SCATTER_VMEM_BYTES} bytes)")
    return reasons


def _register(op: str, fn, not_supported_reasons, splits: str) -> Kernel:
    return register(Kernel(
        op=op, backend="pallas", platforms=_common.PLATFORMS, fn=fn,
        not_supported_reasons=not_supported_reasons,
        # Ring kernels address devices of manual axes (and interpret mode uses host
        # callbacks, which XLA cannot partition): every mesh axis must be manual.
        manual_only_platforms=_common.PLATFORMS,
        description=f"Pallas TPU ring {op.replace('_', '-')}, bidirectional where the {splits} "
                    "splits (remote DMAs; TPU interpret mode on CPU); opt-in Mosaic GPU multimem "
                    "on cuda"))


ALL_GATHER = _register("all_gather", all_gather, all_gather_not_supported_reasons, "shard")
REDUCE_SCATTER = _register("reduce_scatter", reduce_scatter, reduce_scatter_not_supported_reasons,
                           "chunk")
