"""Shared machinery for nxops primitives whose positional work runs in a kernel.

Each such primitive:
- takes ``kernels`` (the selection string, read when the op is called: it is
  part of jit's cache key, so a jaxpr always carries the selection it was
  traced under);
- may take *naming* parameters (e.g. ``axis_names``: vmap names not yet
  batched into positional axes). Batching rules empty them; abstract
  evaluation ignores them (a vmapped name is not a dim of the aval) and
  lowering requires them empty;
- has the abstract evaluation of its ``xla`` reference (so shapes, dtypes,
  shardings and shard_map's varying-axes types follow JAX's own rules);
- lowers, per platform, to the kernel that the registry picks for the case.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

from nxops._jax import (api_util, core, dispatch, lower_per_platform, pe, sharding_impls,
                        source_info_util)
from nxops._jax import config as jax_config
from nxops._errors import NxopsError
from nxops._platforms import PLATFORMS
from nxops.kernels import _autotune, _choice, _reports, _selection
from nxops.kernels._auto import ARGUMENT, UNKNOWN
from nxops.kernels._gpu_target import kernel_mesh, target_devices


def selection_param() -> str:
    """The kernel selection in force, validated, as a primitive parameter."""
    return str(_selection.current_selection())


def _kernel_params(params: dict, naming_params: Sequence[str]) -> dict:
    return {k: v for k, v in params.items() if k not in naming_params and k != "kernels"}


@functools.lru_cache(maxsize=4096)
def _abstract_eval_cached(reference, avals, items, x64: bool):
    del x64   # a cache key only: it changes the reference's promotions (int8 sum: int32/int64)
    params = dict(items)
    fn = lambda *args: [reference(*args, **params)]  # a list: one output
    info = api_util.debug_info("nxops abstract eval", reference, avals, {})
    (out,) = pe.abstract_eval_fun(fn, *avals, debug_info=info)
    return out


def _lower_with_kernel(ctx, *args, registry_op: str, platform: str, naming_params: Sequence[str],
                       kernels: str, multiple_results: bool = False, **params):
    pending = {k: params[k] for k in naming_params if params.get(k)}
    if pending:
        raise NxopsError(f"nxops op {registry_op!r} reached lowering with unbound names {pending}: "
                         f"a named axis must be bound by an enclosing vmap, shard_map or xmap.")
    params = _kernel_params(params, naming_params)
    choice = _choose(ctx, args, registry_op, platform, kernels, ctx.avals_in, params)
    fn = functools.partial(choice.kernel.fn, platform=platform, **params)
    return _lower_locally(ctx, args, fn, platform, multiple_results)


def _lower_locally(ctx, args, fn, platform: str, multiple_results: bool):
    """``fn(*args)`` lowered as a kernel: a local computation, traced on plain
    avals (no sharding, no shard_map varying-axes types) outside any mesh
    context, for the target GPU of the devices the module is lowered for."""
    # A fresh name stack: kernels are named as they were when each lowering was
    # a function of its own (not "jvp_..." after the transformations above them).
    local_ctx = ctx.replace(avals_in=[_local_aval(a) for a in ctx.avals_in],
                            avals_out=[_local_aval(a) for a in ctx.avals_out],
                            name_stack=source_info_util.new_name_stack())
    with target_devices(_lowering_devices(ctx)):
        with (jax.sharding.use_abstract_mesh(kernel_mesh(platform)),
              jax_config._check_vma(False)):
            return mlir.lower_fun(fn, multiple_results=multiple_results)(local_ctx, *args)


def _choose(ctx, args, registry_op: str, platform: str, kernels: str, avals, params: dict):
    """The registry's choice for ``registry_op`` on operands ``args`` of
    types ``avals`` in lowering context ``ctx``, reported."""
    selection = _selection.parse_selection(kernels)
    devices = _lowering_devices(ctx)
    # The target's GPU architecture picks the measured table; a real local GPU
    # may be autotuned on (NXOPS_AUTOTUNE=on).
    with target_devices(devices), _autotune.lowering_for(devices):
        choice = _choice.choose(registry_op, platform, selection, avals,
                                _is_auto_partitioned(ctx), _producers(args), **params)
    _reports.report(registry_op, choice, avals)
    return choice


# Ops that only re-view their operand (XLA makes them bitcasts): the producer
# that matters is their operand's.
_VIEWS = ("stablehlo.reshape", "stablehlo.bitcast_convert")
# Regions whose block arguments XLA cannot fuse across: the program's entry
# function and loop / branch bodies.
_UNFUSABLE_REGIONS = ("stablehlo.while", "stablehlo.case", "stablehlo.if")


def _producers(args) -> tuple[str, ...]:
    """What made each operand, for `auto`'s rule (``ARGUMENT``, the
    StableHLO op's name, or ``UNKNOWN``)."""
    return tuple(_producer(a) for a in args)


def _producer(value) -> str:
    try:
        for _ in range(8):
            if isinstance(value, mlir.ir.BlockArgument):
                parent = value.owner.owner.operation
                if parent.name in _UNFUSABLE_REGIONS:
                    return ARGUMENT
                if parent.name == "func.func" and \
                        mlir.ir.StringAttr(parent.attributes["sym_name"]).value == "main":
                    return ARGUMENT
                return UNKNOWN   # a nested function's argument: its caller is not visible
            op = value.owner.operation
            if op.name not in _VIEWS:
                return op.name
            value = op.operands[0]
    except Exception:
        return UNKNOWN
    return UNKNOWN


def _lowering_devices(ctx) -> tuple:
    """The devices this module is lowered for (the target topology's on a
    deviceless compile): they tell the kernels which GPU to build for."""
    axis_context = ctx.module_context.axis_context
    if getattr(axis_context, "device_assignment", None):
        return tuple(axis_context.device_assignment)
    mesh = getattr(axis_context, "mesh", None)
    # An AbstractMesh (pjit under the legacy `with mesh:`) has no devices: it raises.
    devices = mesh.devices if isinstance(mesh, jax.sharding.Mesh) else None
    if devices is not None and getattr(devices, "size", 0):
        return tuple(devices.flat)
    backend = ctx.module_context.backend   # e.g. the compile-only client of a topology
    return tuple(backend.devices()) if backend is not None else ()


def _is_auto_partitioned(ctx) -> bool:
    """Whether XLA's SPMD partitioner splits this op over some mesh axes."""
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, sharding_impls.ShardingContext):
        return axis_context.num_devices > 1
    if isinstance(axis_context, sharding_impls.SPMDAxisContext):
        return any(size > 1 for name, size in axis_context.mesh.shape.items()
                   if name not in axis_context.manual_axes)
    return False


def _local_aval(aval):
    return core.ShapedArray(aval.shape, aval.dtype, aval.weak_type)


def kernel_primitive(name: str, op: str, reference: Callable[..., Any],
                     naming_params: Sequence[str] = (),
                     multiple_results: bool = False) -> Primitive:
    """A primitive computing registry op ``op``; ``reference`` is its xla kernel
    (``multiple_results``: it returns a tuple of arrays)."""
    prim = Primitive(name)
    prim.multiple_results = multiple_results
    naming_params = tuple(naming_params)
    evaluate = _abstract_eval_many if multiple_results else _abstract_eval_cached

    def abstract_eval(*avals, **params):
        items = tuple(sorted(_kernel_params(params, naming_params).items()))
        return evaluate(reference, tuple(avals), items, bool(jax.config.jax_enable_x64))

    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
    prim.def_abstract_eval(abstract_eval)
    _register_per_platform(prim, {
        platform: functools.partial(_lower_with_kernel, registry_op=op, platform=platform,
                                    naming_params=naming_params,
                                    multiple_results=multiple_results)
        for platform in PLATFORMS})
    return prim


def _register_per_platform(prim: Primitive, rules: dict) -> None:
    """Lowers ``prim`` with ``rules[platform]``, each picking its kernel."""
    if lower_per_platform is None:
        for platform, rule in rules.items():
            mlir.register_lowering(prim, rule, platform=platform)
        return

    # Inline (not cacheable): a cached lowering is emitted as a function of
    # its own, which would hide the operands' producers from `auto`'s rule.
    def lower(ctx, *args, **params):
        ctx = ctx.replace(avals_out=list(ctx.avals_out))   # see nxops/_jax.py
        return lower_per_platform(ctx, prim.name, rules, None, (), *args, **params)
    mlir.register_lowering(prim, lower, cacheable=False)


def match_varying(*xs):
    """Casts operands to the union of their varying mesh axes, as JAX's own
    binary ops do under ``check_vma=True``: the cast transposes to a psum, so a
    replicated operand's cotangent comes back replicated (summed over devices)."""
    varying = [frozenset(jax.typeof(x).manual_axis_type.varying) for x in xs]
    union = frozenset().union(*varying)
    return tuple(lax.pcast(x, tuple(sorted(union - v)), to="varying") if union - v else x
                 for x, v in zip(xs, varying))


@functools.lru_cache(maxsize=1024)
def _abstract_eval_many(reference, avals, items, x64: bool):
    del x64   # a cache key only (see _abstract_eval_cached)
    params = dict(items)
    fn = lambda *args: list(reference(*args, **params))
    info = api_util.debug_info("nxops abstract eval", reference, avals, {})
    return pe.abstract_eval_fun(fn, *avals, debug_info=info)


def local_primitive(name: str, reference: Callable[..., Sequence[Any]],
                    platform_param: str | None = None,
                    typed_by: Callable[..., Sequence[Any]] | None = None) -> Primitive:
    """A primitive with several results that always runs ``reference`` (pure
    JAX, every platform; no registry choice): a place for a batching rule of
    its own where JAX's vmap of ``reference`` would do more work. With
    ``platform_param`` (the name of its platform parameter), ``reference``
    may call a Pallas kernel of that platform: it is lowered as kernels are,
    for the target GPU of the devices the module is lowered for; then
    ``typed_by``, its pure-JAX twin (without the platform parameter), gives
    the results' types (a Pallas call traced in a ``shard_map`` body under
    ``check_vma=True`` would need its outputs' varying axes, which a kernel
    does not know)."""
    prim = Primitive(name)
    prim.multiple_results = True

    def abstract_eval(*avals, **params):
        if typed_by is not None:
            params = {k: v for k, v in params.items() if k != platform_param}
        return _abstract_eval_many(typed_by or reference, tuple(avals),
                                   tuple(sorted(params.items())), bool(jax.config.jax_enable_x64))

    def lower(ctx, *args, **params):
        local_ctx = ctx.replace(avals_in=[_local_aval(a) for a in ctx.avals_in],
                                avals_out=[_local_aval(a) for a in ctx.avals_out],
                                name_stack=source_info_util.new_name_stack())
        platform = params[platform_param] if platform_param else "cpu"
        devices = _lowering_devices(ctx) if platform_param else ()
        with (target_devices(devices), jax.sharding.use_abstract_mesh(kernel_mesh(platform)),
              jax_config._check_vma(False)):
            return mlir.lower_fun(functools.partial(reference, **params),
                                  multiple_results=True)(local_ctx, *args)

    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, lower)
    return prim


def step_primitive(name: str, registry_op: str, reference: Callable[..., Sequence[Any]],
                   with_kernel: Callable[..., Sequence[Any]], operands: Sequence[int],
                   op_params: dict | None = None) -> Primitive:
    """A primitive with several results for one step of a larger algorithm
    (a ring's pass over one key shard) built on registry op ``registry_op``.
    It takes ``kernels`` (the selection) besides ``reference``'s parameters.
    Lowered, it picks the kernel for ``registry_op`` as a kernel primitive
    would, for its operands at positions ``operands`` (the op's own, in the
    op's order; one held as its bits, an unsigned int of a float's width,
    is shown to the choice in the first one's dtype) and the step's
    parameters with ``op_params`` (the op's that the step fixes). Where that
    is XLA's reference it runs ``reference(*operands, **params)`` (the
    step's own fused form), else ``with_kernel(kernel_fn, *operands,
    **params)``, ``kernel_fn`` the kernel's function with its platform bound."""
    prim = Primitive(name)
    prim.multiple_results = True
    operands = tuple(operands)

    def abstract_eval(*avals, kernels, **params):
        del kernels
        return _abstract_eval_many(reference, tuple(avals), tuple(sorted(params.items())),
                                   bool(jax.config.jax_enable_x64))

    def op_avals(avals):
        dtype = avals[operands[0]].dtype
        return [core.ShapedArray(a.shape, dtype)
                if a.dtype.kind == "u" and a.dtype.itemsize == dtype.itemsize else a
                for a in (avals[i] for i in operands)]

    def lower_on(ctx, *args, platform: str, kernels: str, **params):
        choice = _choose(ctx, [args[i] for i in operands], registry_op, platform, kernels,
                         op_avals(ctx.avals_in), dict(params, **(op_params or {})))
        if choice.kernel.backend == "xla":
            fn = functools.partial(reference, **params)
        else:
            fn = functools.partial(with_kernel, functools.partial(choice.kernel.fn,
                                                                  platform=platform), **params)
        return _lower_locally(ctx, args, fn, platform, multiple_results=True)

    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
    prim.def_abstract_eval(abstract_eval)
    _register_per_platform(prim, {platform: functools.partial(lower_on, platform=platform)
                                  for platform in PLATFORMS})
    return prim


def jvp_of_evaluation(impl: Callable[..., Any], without_tangent: tuple[int, ...]):
    """A primitive's JVP rule that is JAX's JVP of ``impl``, its evaluation
    (forward mode of forward mode: jacfwd of jacfwd), over every operand but
    those at ``without_tangent`` (integer positions, saved residuals)."""
    def rule(primals, tangents, **params):
        tangent_at = [i for i in range(len(primals)) if i not in without_tangent]

        def at(*xs):
            args = list(primals)
            for i, x in zip(tangent_at, xs):
                args[i] = x
            return impl(*args, **params)
        return jax.jvp(at, [primals[i] for i in tangent_at],
                       [ad.instantiate_zeros(tangents[i]) for i in tangent_at])
    return rule
