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
  (whole, as with no resources) before ``bwd`` runs;
- ``bwd``'s cotangent for an operand replicated over a mesh axis goes back to
  a part: divided by the axis size when it does not vary along the axis (one
  value, as with no resources); left as it is when it varies (with no
  resources the positions' values are summed, which the parts then do).

Which values vary along which mesh axes comes from a walk of the body's jaxpr
(``_varying.VaryingWalk``); only bodies whose custom calls run a named op over
mesh axes in their primal get their bwd converted. The walk reads the jaxpr
of the one trace of the body (``walk_program``); it does not call the body.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax

from nxops._errors import NxopsError
from nxops._jax import (bwd_cotangents, custom_rule_wrappers, eval_closed_jaxpr,
                        stage_to_evaluate)
from nxops.kernels.xla import collectives as xla_collectives
from nxops.ops._axis_env import mesh_platform as _mesh_platform
from nxops.ops._axis_env import CustomCall
from nxops.xmap._varying import Names, VaryingWalk


def _float(x) -> bool:
    """An inexact array (a cotangent, not float0, nor bwd's marker for None)."""
    return isinstance(x, jax.Array) and jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)


def walk_program(jaxpr, in_mesh_axes: Sequence, plan, typed: bool) -> tuple[list[Names], bool]:
    """Walks the jaxpr of a program traced inside the shard_map, in mesh axes:
    which of the plan's mesh axes each result varies along, and whether a
    cond's branches would differ per device around a collective (the plan
    then needs vmap levels). Refuses a while_loop whose trip count differs
    across the devices of a collective inside it. ``typed``: each custom_vjp
    call is also told which mesh axes its operands and results vary along.
    ``in_mesh_axes``: the mesh axes each input varies along."""
    mesh_axes = plan.mesh_axes
    shown = {m: (a.name, a.mesh_axes) for a in plan.axes for m in a.mesh_axes}
    analysis = VaryingWalk({m: m for m in mesh_axes}, {}, {m: (m,) for m in mesh_axes},
                         on_custom_vjp=_annotate if typed else None, shown=shown)
    results = analysis.run(jaxpr, [Names(a) for a in in_mesh_axes])
    return results, analysis.branches_per_device


def _annotate(eqn, ins: list[Names], outs: list[Names]) -> None:
    calls = [getattr(w, "custom_call", None) for w in custom_rule_wrappers(eqn.params.get("bwd"))]
    call = next((c for c in calls if isinstance(c, CustomCall)), None)
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

    def __call__(self, bwd: Callable, args: Sequence, mesh_axes: tuple) -> list:
        operands, results = self.names
        mesh = jax.sharding.get_abstract_mesh()
        n_res = len(args) - len(results)
        res, cts = list(args[:n_res]), list(args[n_res:])
        for j, names in enumerate(results):
            whole = tuple(m for m in mesh_axes if m not in names)
            if whole and _float(cts[j]):   # (16-bit floats summed in f32 on CPU)
                cts[j] = xla_collectives.psum(cts[j], whole, platform=_mesh_platform())
        traced = _TracedBwd(bwd, res, cts)
        cts_names = [Names(n) & Names(mesh_axes) for n in results]
        out_names = self._bwd_result_names(traced, len(res), cts_names, mesh_axes)
        out, rebuild = traced.results(res, cts)
        for i, names in enumerate(operands):
            if not _float(out[i]):
                continue
            one_value = [m for m in mesh_axes if m not in names and m not in out_names[i]]
            if one_value:
                out[i] = out[i] / math.prod(mesh.shape[m] for m in one_value)
        return rebuild(out)

    def _bwd_result_names(self, traced: "_TracedBwd", n_res: int, cts_names: list,
                          mesh_axes: tuple) -> list:
        """The mesh axes each of ``bwd``'s cotangents varies along. A residual's
        are not known; an answer that depends on them is refused."""
        jaxpr = traced.closed.jaxpr
        logical = {m: m for m in mesh_axes}
        operands = self.names[0]
        answers = []
        for residual_names in (Names(), Names(mesh_axes)):
            names = VaryingWalk(logical, {}).run(jaxpr, [residual_names] * n_res + cts_names)
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

    def results(self, res: list, cts: list) -> tuple[list, Callable]:
        """``bwd_cotangents(bwd(*res, *cts))``, from the jaxpr; ``bwd`` is called
        again only when it returned more than cotangents (logs of JAX 0.12's
        ``defvjp_with_logs``), which may hold values of the trace."""
        returned = self._returned
        if isinstance(returned, tuple) and len(returned) == 2 and returned[1] is not None:
            return bwd_cotangents(self._bwd(*res, *cts))
        out, rebuild = bwd_cotangents(returned)
        for i, x in zip(self.kept, eval_closed_jaxpr(self.closed, *res, *cts)):
            out[i] = x
        return out, rebuild
