"""What one ``nx.xmap(...)`` call defines, validated once: the body, its
parsed specs, sizes and resources; and the plan of a call's arguments."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nxops._errors import NxopsError
from nxops._jax import mesh_lib as _mesh_lib
from nxops._platforms import normalize_platform
from nxops.ops._axis_env import current_logical_axes
from nxops.xmap._enclosing import ENCLOSING_MESH, meshes_in_scope
from nxops.xmap._plan import (Plan, check_shared_resources, mesh_in_scope,
                              normalize_axis_resources, plan_axis_resources)
from nxops.xmap._rules import check_rules, current_axis_rules, resources_from_rules
from nxops.xmap._specs import (AxisSpec, broadcast_specs, infer_axis_sizes, parse_spec_tree,
                               spec_names)
from nxops.xmap._xmap_errors import missing_out_names_error


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else tuple(jax.numpy.shape(x))


@dataclasses.dataclass(frozen=True)
class Definition:
    fun: Callable
    user_in_axes: Any
    user_out_axes: Any
    in_axes: Any                   # parsed spec trees
    out_axes: Any
    axis_sizes: dict
    names: list                    # every name: the inputs', then axis_sizes'
    # Names only the body may use (old xmap: `lax.psum(x, 'i')` with
    # axis_sizes={'i': 4}); checked once the body is traced.
    body_only_names: list
    # A rule table resolves now; no axis_resources at all follows the
    # nx.axis_rules(...) in scope at each call (part of the context key).
    follows_rule_context: bool
    resources: dict
    donate_argnums: tuple
    backend: str | None

    @classmethod
    def define(cls, fun, in_axes, out_axes, *, axis_sizes, axis_resources, donate_argnums,
               backend) -> Definition:
        if not callable(fun):
            raise NxopsError(f"xmap requires a callable as its first argument, got {fun!r}.")
        parsed_in, parsed_out = parse_spec_tree(in_axes, "in_axes"), parse_spec_tree(out_axes,
                                                                                    "out_axes")
        axis_sizes = _checked_sizes(axis_sizes)
        in_names, out_names = spec_names(parsed_in), spec_names(parsed_out)
        defined = list(dict.fromkeys(in_names + list(axis_sizes)))
        missing = [n for n in out_names if n not in defined]
        if missing:
            raise missing_out_names_error(missing, defined, in_axes, out_axes)
        follows_rule_context = axis_resources is None
        if isinstance(axis_resources, (list, tuple)):
            axis_resources = resources_from_rules(defined, check_rules(axis_resources))
        return cls(fun, in_axes, out_axes, parsed_in, parsed_out, axis_sizes, defined,
                   [n for n in axis_sizes if n not in in_names + out_names],
                   follows_rule_context, normalize_axis_resources(axis_resources, defined),
                   _checked_donation(donate_argnums), _checked_backend(backend))

    def key(self) -> tuple:
        """Equal for two definitions that make the same programs of ``fun``."""
        return (_hashable_tree(self.in_axes), _hashable_tree(self.out_axes),
                tuple(sorted(self.axis_sizes.items())), tuple(sorted(self.resources.items())),
                self.donate_argnums, self.backend)

    def resources_for(self, rules) -> dict:
        """The resources under the axis rules in scope (``rules``, or none)."""
        if not rules:
            return self.resources
        return normalize_axis_resources(resources_from_rules(self.names, rules), self.names)

    def plan(self, args: tuple, mesh: Mesh | None,
             resources: dict) -> tuple[Plan, list[AxisSpec]]:
        """Checks the arguments against the specs and plans every named axis."""
        self._check_call(args)
        flat_specs = broadcast_specs(self.in_axes, args, "in_axes", self.user_in_axes)
        path_leaves = jax.tree_util.tree_flatten_with_path(args)[0]
        paths = [f"args{jax.tree_util.keystr(p)}" for p, _ in path_leaves]
        shapes = [shape_of(x) for _, x in path_leaves]
        sizes = infer_axis_sizes(flat_specs, shapes, paths, self.axis_sizes)
        unknown = [n for n in self.names if n not in sizes]
        if unknown:
            raise NxopsError(
                f"Failed to infer size of axes: {', '.join(map(repr, unknown))}. You've "
                f"probably passed in empty containers in place of arguments that had "
                f"those axes in their in_axes. Provide the sizes of missing axes "
                f"explicitly via axis_sizes to fix this error.")
        plan = plan_axis_resources(sizes, resources, self.names)
        for spec, path in zip(flat_specs, paths):
            check_shared_resources(plan, spec, f"argument {path}")
        return plan, flat_specs

    def _check_call(self, args: tuple) -> None:
        beyond = [i for i in self.donate_argnums if i >= len(args)]
        if beyond:
            raise NxopsError(
                f"donate_argnums={self.donate_argnums!r} names argument position(s) "
                f"{', '.join(map(str, beyond))}, but the call passes {len(args)} "
                f"argument(s): donate only positions 0..{len(args) - 1}.")
        enclosing = ENCLOSING_MESH.get()
        if enclosing is not None and enclosing != meshes_in_scope():
            raise NxopsError(
                f"Changing the physical mesh is not allowed inside xmap: the enclosing "
                f"xmap was called with mesh {enclosing[0]} in scope, but this call sees "
                f"{meshes_in_scope()[0]}. Set the mesh once, around the outermost xmap.")
        shadowed = [n for n in self.names if n in current_logical_axes()]
        if shadowed:
            raise NxopsError(
                f"Nested xmaps cannot shadow names of enclosing ones: "
                f"{', '.join(map(repr, shadowed))} already named by an enclosing xmap. "
                f"Rename the inner axes (the inner body may use the outer names).")

    def shardings(self, args: tuple) -> tuple[list[NamedSharding], bool] | None:
        """(each input's sharding per the plan on the mesh in scope, replicated
        where the plan maps nothing to the mesh; whether the plan uses mesh
        axes), or None without a mesh or inside a manual region."""
        mesh = mesh_in_scope()
        if mesh is None or _mesh_lib.get_abstract_mesh().manual_axes:
            return None
        rules = current_axis_rules() if self.follows_rule_context else None
        plan, flat_specs = self.plan(args, mesh, self.resources_for(rules))
        shapes = [shape_of(x) for x in jax.tree.leaves(args)]
        on_mesh = plan.mesh is not None
        return [NamedSharding(mesh, plan.partition_spec(spec, len(shape)) if on_mesh
                              else PartitionSpec())
                for shape, spec in zip(shapes, flat_specs)], on_mesh


def _checked_sizes(axis_sizes) -> dict:
    axis_sizes = dict(axis_sizes or {})
    for name, size in axis_sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise NxopsError(f"axis_sizes[{name!r}] = {size!r}: sizes are positive ints.")
    return axis_sizes


def _checked_donation(donate_argnums) -> tuple:
    positions = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in positions):
        raise NxopsError(f"donate_argnums={donate_argnums!r}: give argument positions "
                         f"as ints >= 0.")
    return positions


def _checked_backend(backend: str | None) -> str | None:
    """``backend`` as jax.jit takes it (lowercased; 'gpu' stays JAX's alias
    for whichever GPU platform is present); an unknown name is an NxopsError."""
    if backend is None:
        return None
    normalize_platform(backend, f"nx.xmap(..., backend={backend!r})")
    return str(backend).lower()


def _hashable_tree(tree: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return tuple(leaves), treedef
