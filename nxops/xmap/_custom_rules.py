"""A custom_vjp's ``bwd`` under ``jax.grad`` outside the xmap, on mesh axes.

With no resources a name is a vmap level, and ``jax.grad`` of the xmap hands
a custom_vjp's ``bwd`` the cotangent of a result that does not vary along the
name whole (one value), as ``jax.vmap`` does; a result that varies gets its
cotangent per position. Over mesh axes the program is a ``shard_map``, whose
transpose (``check_vma=False``) splits the cotangent of a replicated value
among the devices instead (each holds a part; the parts sum to it). JAX's own
transposes agree with either, but a hand-written ``bwd`` does not: Megatron's
``g`` (``psum`` forward, identity backward) would get a 1/n part. So over
mesh axes xmap converts at the custom call (docs/xmap.md, "Custom rules"):

- the cotangent of a result replicated over a mesh axis is summed over it
  (whole, as with no resources) before ``bwd`` runs; where every device of
  the axis holds the same part (``_SameCotangents``), the sum is that part
  times the axis size, no all-reduce;
- ``bwd``'s cotangent for an operand replicated over a mesh axis goes back to
  a part: divided by the axis size when it does not vary along the axis (one
  value, as with no resources); left as it is when it varies (with no
  resources the positions' values are summed, which the parts then do).

A ``psum`` in ``bwd`` of a value that does not vary along its mesh axes (a
whole cotangent, as Megatron's ``f`` sums) is that value times their size
too. Which values vary along which mesh axes comes from a walk of the body's jaxpr
(``_varying.VaryingWalk``); only bodies whose custom calls run a named op over
mesh axes in their primal get their bwd converted. The walk reads the jaxpr
of the one trace of the body (``walk_program``); it does not call the body.
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import lax
from jax.extend.core import Literal

from nxops._errors import NxopsError
from nxops._jax import (bwd_cotangents, custom_rule_wrappers,
                        eval_closed_jaxpr_with, stage_to_evaluate)
from nxops.kernels.xla import collectives as xla_collectives
from nxops.ops._axis_env import mesh_platform as _mesh_platform
from nxops.ops._axis_env import CustomCall
from nxops.ops._named_params import named_axes_effect
from nxops.xmap._varying import (_CUSTOM_RULE_PRIMITIVES, NO_NAMES, Names, VaryingWalk,
                                 _sub_jaxprs)


def _float(x) -> bool:
    """An inexact array (a cotangent, not float0, nor bwd's marker for None)."""
    return isinstance(x, jax.Array) and _inexact(x.dtype)


@functools.lru_cache(maxsize=None)
def _inexact(dtype) -> bool:
    return jax.numpy.issubdtype(dtype, jax.numpy.inexact)


def walk_program(jaxpr, in_mesh_axes: Sequence, plan, typed: bool,
                 out_mesh_axes: Sequence = ()) -> tuple[list[Names], bool]:
    """Walks the jaxpr of a program traced inside the shard_map, in mesh axes:
    which of the plan's mesh axes each result varies along, and whether a
    cond's branches would differ per device around a collective (the plan
    then needs vmap levels). Refuses a while_loop whose trip count differs
    across the devices of a collective inside it. ``typed``: each custom_vjp
    call is also told which mesh axes its operands and results vary along.
    ``in_mesh_axes``: the mesh axes each input varies along;
    ``out_mesh_axes``: those each result is split along (its out spec's)."""
    mesh_axes = plan.mesh_axes
    shown = {m: (a.name, a.mesh_axes) for a in plan.axes for m in a.mesh_axes}
    analysis = VaryingWalk({m: m for m in mesh_axes}, {}, {m: (m,) for m in mesh_axes},
                         on_custom_vjp=_annotate if typed else None, shown=shown)
    names: dict = {}
    results = analysis.run(jaxpr, [Names(a) for a in in_mesh_axes], record=names)
    if typed:
        same = _SameCotangents(jaxpr, names, out_mesh_axes, Names(mesh_axes))
        for index, eqn in enumerate(jaxpr.eqns):
            call = _custom_call(eqn)
            if call is not None and call.typed_bwd is not None:
                call.typed_bwd.same = functools.partial(same.of_results, index)
    return results, analysis.branches_per_device


def _custom_call(eqn) -> CustomCall | None:
    """The CustomCall of a custom_vjp equation bound in an xmap body (else None)."""
    if eqn.primitive.name not in _CUSTOM_RULE_PRIMITIVES:   # (asked of every equation)
        return None
    calls = [getattr(w, "custom_call", None) for w in custom_rule_wrappers(eqn.params.get("bwd"))]
    return next((c for c in calls if isinstance(c, CustomCall)), None)


class _SameCotangents:
    """Along which mesh axes every device gets the same cotangent for a
    variable of ``jaxpr`` (the program inside the shard_map) under a
    ``jax.grad`` outside the xmap; parts that sum to the whole cotangent are
    then each the whole over the axis size.

    shard_map's transpose hands a result not split along a mesh axis its
    cotangent over the axis size on each of its devices: the same part. An
    equation none of whose operands vary along the axis, and that neither
    communicates over it nor asks for a position along it, computes the same
    on all its devices, and so does its transpose: same cotangents in, same
    out. A custom_vjp call's typed ``bwd`` gives an operand the same
    cotangent on every device where it divided one value (``alike_out``), once
    it has run. Any other use (an operand that varies, so a residual that
    differs per device; a custom rule not run yet) may make them differ, so is
    not counted on. Read backwards from the end as the transpose asks
    (``of_results``): the transpose runs the later custom calls' ``bwd`` first."""

    def __init__(self, jaxpr, names: dict, out_mesh_axes: Sequence, every: Names):
        self._eqns, self._names, self._every = jaxpr.eqns, names, every
        self._seen: dict = {}   # var -> axes so far (no use: a zero cotangent, the same)
        self._next = len(self._eqns) - 1   # the last equation not read yet
        for v, axes in zip(jaxpr.outvars, out_mesh_axes):
            self._meet(v, every - Names(axes))

    def of_results(self, index: int) -> list[Names]:
        """For each result of equation ``index``: every use of it comes after."""
        while self._next > index:
            self._read(self._eqns[self._next])
            self._next -= 1
        return [self._same(v) for v in self._eqns[index].outvars]

    def _same(self, v) -> Names:
        return self._seen.get(v, self._every) - self._names.get(v, NO_NAMES)

    def _meet(self, v, axes: Names) -> None:
        if not isinstance(v, Literal):
            self._seen[v] = self._seen.get(v, self._every) & axes

    def _read(self, eqn) -> None:
        operands = list(eqn.invars)
        call = _custom_call(eqn)
        if call is not None:
            n_consts = eqn.params.get("num_consts", 0)
            alike = getattr(call.typed_bwd, "alike_out", None) or []
            passed = [NO_NAMES] * n_consts + list(alike)
            passed += [NO_NAMES] * (len(operands) - len(passed))
        else:
            every = self._every
            same = every.intersection(*(self._same(v) for v in eqn.outvars))
            same -= Names().union(*(self._names.get(v, NO_NAMES) for v in operands
                                    if not isinstance(v, Literal)))
            if same:
                same -= _position_dependent(eqn, every)
            passed = [same] * len(operands)
        for v, axes in zip(operands, passed):
            self._meet(v, axes)


_ANY = object()   # in _mentioned: something inside may use any axis (_mentioned_by)
_MENTIONED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _position_dependent(eqn, every: Names) -> Names:
    """The mesh axes among ``every`` that ``eqn`` may communicate over or ask a
    position along: any its parameters (or those of the equations nested in
    it) name, all of them where ``_mentioned_by`` cannot tell."""
    found = _mentioned_by(eqn)
    for sub in _sub_jaxprs(eqn):
        found = found | _mentioned(sub)
    return every if _ANY in found else every & found


def _mentioned(jaxpr) -> frozenset:
    try:
        return _MENTIONED[jaxpr]
    except KeyError:
        pass
    found = frozenset().union(*(_mentioned_by(e) | frozenset().union(
        *(_mentioned(s) for s in _sub_jaxprs(e))) for e in jaxpr.eqns))
    _MENTIONED[jaxpr] = found
    return found


# The parameters in which JAX's primitives name axes (lax's collectives,
# axis_index, pcast).
_AXIS_PARAMS = ("axes", "axis_name", "axis_names")


def _mentioned_by(eqn) -> frozenset:
    """The axis names in ``eqn``'s parameters; ``_ANY`` for a custom rule, a
    shard_map, or one of nxops' primitives other than its named ops (a
    kernel may communicate over axes its parameters do not show)."""
    name = eqn.primitive.name
    named = named_axes_effect(eqn.primitive, eqn.params)
    if (name in _CUSTOM_RULE_PRIMITIVES or name == "shard_map"
            or (name.startswith("nx") and named is None)):
        return frozenset((_ANY,))
    found = set(named[0]) if named is not None else set()
    for key in _AXIS_PARAMS:
        value = eqn.params.get(key)
        if value is not None:
            found.update(value if isinstance(value, (tuple, list, frozenset)) else (value,))
    return frozenset(found)


def _annotate(eqn, ins: list[Names], outs: list[Names]) -> None:
    call = _custom_call(eqn)
    if call is None:
        return
    operands = ins[eqn.params.get("num_consts", 0):]
    previous = getattr(call.typed_bwd, "names", None)
    if previous is not None:   # a loop's fixed point visits it again: the names only grow
        operands = [a | b for a, b in zip(operands, previous[0])]
        outs = [a | b for a, b in zip(outs, previous[1])]
    call.typed_bwd = _TypedBwd(operands, outs)


class _TypedBwd:
    """``bwd`` of one custom_vjp call with its cotangents converted (see the
    module docstring). ``names``: (operand names, result names), mesh axes."""

    def __init__(self, operands: list[Names], results: list[Names]):
        self.names = (operands, results)
        # same(): per result, the mesh axes along which every device gets
        # the same cotangent (_SameCotangents); None: not known, none
        self.same: Callable | None = None
        # per operand, the mesh axes along which the cotangent bwd's last
        # run gave it is the same on every device
        self.alike_out: list[Names] | None = None

    def __call__(self, bwd: Callable, args: Sequence, mesh_axes: tuple) -> list:
        operands, results = self.names
        mesh = jax.sharding.get_abstract_mesh()
        n_res = len(args) - len(results)
        res, cts = list(args[:n_res]), list(args[n_res:])
        same = self.same() if self.same is not None else [NO_NAMES] * len(results)
        for j, names in enumerate(results):
            if not _float(cts[j]):
                continue
            parts = [m for m in mesh_axes if m not in names and m not in same[j]]
            alike = [m for m in mesh_axes if m not in names and m in same[j]]
            if alike:
                cts[j] = _times(cts[j], math.prod(mesh.shape[m] for m in alike))
            if parts:   # (16-bit floats summed in f32 on CPU)
                cts[j] = xla_collectives.psum(cts[j], tuple(parts), platform=_mesh_platform())
        traced = _TracedBwd(bwd, res, cts)
        cts_names = [Names(n) & Names(mesh_axes) for n in results]
        walked: dict = {}
        out_names = self._bwd_result_names(traced, len(res), cts_names, mesh_axes, walked)
        out, rebuild = traced.results(res, cts, _psum_of_alike(walked, mesh_axes))
        alike_out = []
        for i, names in enumerate(operands):
            one_value = [m for m in mesh_axes if m not in names and m not in out_names[i]]
            alike_out.append(Names(one_value) if _float(out[i]) else NO_NAMES)
            if one_value and _float(out[i]):
                out[i] = _over(out[i], math.prod(mesh.shape[m] for m in one_value))
        self.alike_out = alike_out
        return rebuild(out)

    def _bwd_result_names(self, traced: "_TracedBwd", n_res: int, cts_names: list,
                          mesh_axes: tuple, walked: dict) -> list:
        """The mesh axes each of ``bwd``'s cotangents varies along. A residual's
        are not known; an answer that depends on them is refused. ``walked``:
        filled with what each variable of ``bwd``'s jaxpr varies along when
        every residual varies along every mesh axis."""
        jaxpr = traced.closed.jaxpr
        logical = {m: m for m in mesh_axes}
        operands = self.names[0]
        answers = []
        for residual_names, record in ((Names(), None), (Names(mesh_axes), walked)):
            names = VaryingWalk(logical, {}).run(jaxpr, [residual_names] * n_res + cts_names,
                                                 record=record)
            per_operand = [Names()] * len(operands)
            for i, n in zip(traced.kept, names):
                per_operand[i] = n
            answers.append(per_operand)
        for i, (low, high) in enumerate(zip(*answers)):
            undecided = [m for m in mesh_axes if m not in operands[i] and (m in low) != (m in high)]
            if undecided:
                raise NxopsError(
                    f"A jax.custom_vjp called in the xmapped function has a bwd whose "
                    f"cotangent for its operand {i} varies along mesh axis {undecided[0]!r} "
                    f"or not depending on its residuals, and jax.grad is taken outside the "
                    f"xmap: nxops cannot give that bwd the cotangents it gets with no "
                    f"resources. Take jax.grad inside the xmapped function, or map the name "
                    f"on {undecided[0]!r} to no resources.")
        return answers[0]


def _psum_of_alike(names: dict, mesh_axes: tuple) -> Callable:
    """For ``eval_closed_jaxpr_with``: a ``psum`` over ``mesh_axes`` along
    which its operands do not vary (``names``: what each variable varies
    along, among ``mesh_axes``) sums the same value from every device, so it
    is that value times their size."""
    mesh = jax.sharding.get_abstract_mesh()

    def override(eqn, operands: list) -> list | None:
        axes = tuple(eqn.params.get("axes", ()))
        if (eqn.primitive.name != "psum" or eqn.params.get("axis_index_groups") is not None
                or not all(isinstance(a, str) for a in axes)):
            return None
        varying = Names().union(*(names.get(v, NO_NAMES) for v in eqn.invars
                                  if not isinstance(v, Literal)))
        alike = [a for a in axes if a in mesh_axes and a not in varying]
        if not alike:
            return None
        size = math.prod(mesh.shape[a] for a in alike)
        rest = tuple(a for a in axes if a not in alike)
        outs = [_times(x, size) for x in operands]
        return list(lax.psum(outs, rest)) if rest else outs
    return override


def _times(x, size: int):
    """``x * size`` in ``x``'s dtype, bound as one ``mul`` (no jax.numpy call:
    its promotion and nested jit cost more to trace than the product)."""
    return lax.mul(x, np.array(size, x.dtype))


def _over(x, size: int):
    """``x / size`` in ``x``'s dtype, bound as one ``div`` (as ``_times``)."""
    return lax.div(x, np.array(size, x.dtype))


class _TracedBwd:
    """``bwd`` traced once on its residuals and cotangents: the jaxpr the
    walk reads, then evaluated for the cotangents it returns (its Python is
    not run again)."""

    def __init__(self, bwd: Callable, res: list, cts: list):
        self._bwd = bwd
        self.kept: list[int] = []     # which of bwd's cotangents are arrays
        self._returned: Any = None    # what bwd returned (its other entries reused)

        def arrays(*a):
            self._returned = bwd(*a)
            outs, _ = bwd_cotangents(self._returned)
            self.kept[:] = [i for i, o in enumerate(outs) if isinstance(o, jax.Array)]
            return [outs[i] for i in self.kept]
        self.closed = stage_to_evaluate(arrays, *res, *cts)

    def results(self, res: list, cts: list, override: Callable) -> tuple[list, Callable]:
        """``bwd_cotangents(bwd(*res, *cts))``, from the jaxpr (equations as
        ``override`` says: ``eval_closed_jaxpr_with``); ``bwd`` is called
        again only when it returned more than cotangents (logs of JAX 0.12's
        ``defvjp_with_logs``), which may hold values of the trace."""
        returned = self._returned
        if isinstance(returned, tuple) and len(returned) == 2 and returned[1] is not None:
            return bwd_cotangents(self._bwd(*res, *cts))
        out, rebuild = bwd_cotangents(returned)
        for i, x in zip(self.kept, eval_closed_jaxpr_with(self.closed, override, *res, *cts)):
            out[i] = x
        return out, rebuild
