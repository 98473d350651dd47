"""Shared machinery for nxops primitives whose positional work runs in a kernel.

Each such primitive:
- takes ``kernels`` (the selection string, read when the op is called: it is
  part of jit's cache key, so a jaxpr always carries the selection it was
  traced under);
- has the abstract evaluation of its ``xla`` reference (so shapes, dtypes,
  shardings and shard_map's varying-axes types follow JAX's own rules);
- lowers, per platform, to the kernel that the registry picks for the case.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from jax._src import api_util, dispatch
from jax._src.interpreters import partial_eval as pe
from jax.extend.core import Primitive
from jax.interpreters import mlir

from nxops.kernels import _registry


def selection_param() -> str:
    """The kernel selection in force, validated, as a primitive parameter."""
    return str(_registry.current_selection())


def abstract_eval_of(reference: Callable[..., Any]):
    def abstract_eval(*avals, kernels, **params):
        del kernels
        fn = functools.partial(reference, **params)
        info = api_util.debug_info("nxops abstract eval", reference, avals, {})
        (out,) = pe.abstract_eval_fun(fn, *avals, debug_info=info)
        return out
    return abstract_eval


def _lower_with_kernel(ctx, *args, op: str, platform: str, kernels: str, **params):
    selection = _registry.parse_selection(kernels)
    choice = _registry.choose(op, platform, selection, ctx.avals_in, **params)
    _registry.report(op, choice, ctx.avals_in, params)
    fn = functools.partial(choice.kernel.fn, platform=platform, **params)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)


def kernel_primitive(name: str, op: str, reference: Callable[..., Any]) -> Primitive:
    """A primitive computing registry op ``op``; ``reference`` is its xla kernel."""
    prim = Primitive(name)
    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
    prim.def_abstract_eval(abstract_eval_of(reference))
    for platform in _registry.PLATFORMS:
        mlir.register_lowering(
            prim, functools.partial(_lower_with_kernel, op=op, platform=platform),
            platform=platform)
    return prim
