"""Parsing and checking of ``in_axes`` / ``out_axes`` specs.

A spec says which positional dimensions of one array carry which named axes:
``['batch', None, ...]`` (a list, ``None`` for a positional dim, an optional
trailing ``...``; without it the list asserts the rank) or ``{0: 'batch'}``.
Errors quote the spec as the user wrote it.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Sequence

import jax

from nxops._errors import NxopsError


@dataclasses.dataclass(frozen=True)
class AxisSpec:
    """One leaf spec: ``names[pos] = name``; ``rank`` is asserted when not None."""

    names: tuple[tuple[int, str], ...]
    rank: int | None
    user_repr: str
    # The positional dims the spec lists (names and Nones, before any ...):
    # an array has at least that many.
    min_rank: int = 0

    @property
    def mapping(self) -> dict[int, str]:
        return dict(self.names)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(name for _, name in self.names)


def _show_entry(entry: Any) -> str:
    if isinstance(entry, dict):
        return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in entry.items()) + "}"
    items = ", ".join("..." if e is Ellipsis else repr(e) for e in entry)
    if isinstance(entry, tuple):
        return f"({items},)" if len(entry) == 1 else f"({items})"
    return f"[{items}]"


def is_axes_leaf(entry: Any) -> bool:
    """Whether ``entry`` is one spec (as opposed to a container of specs)."""
    if isinstance(entry, dict):
        return all(_is_position(k) for k in entry) and all(
            isinstance(v, str) for v in entry.values())
    if isinstance(entry, (tuple, list)):
        return all(e is None or e is Ellipsis or isinstance(e, str) for e in entry)
    return False


def _is_position(key: Any) -> bool:
    return isinstance(key, int) and not isinstance(key, bool)


def _check_dict_specs(tree: Any, what: str, whole: Any) -> None:
    """A dict with a numeric key (int, bool, float) is meant as one spec: all its
    keys must be positions (``{True: 'a'}`` is not position 1, ``{0.5: 'a'}``
    no position at all)."""
    if isinstance(tree, dict):
        if any(isinstance(k, numbers.Number) for k in tree) and not is_axes_leaf(tree):
            raise _spec_error(what, tree, whole)
        for value in tree.values():
            _check_dict_specs(value, what, whole)
    elif isinstance(tree, (list, tuple)) and not is_axes_leaf(tree):
        if any(e is Ellipsis for e in tree):
            # A list holding ... is one spec, not a container of specs: say which
            # entry of it is not a name ([('a',), ...] holds a tuple).
            raise _spec_error(what, tree, whole)
        for value in tree:
            _check_dict_specs(value, what, whole)


def _quote(tree: Any) -> str:
    return repr(tree).replace("Ellipsis", "...")


def _spec_error(what: str, entry: Any, whole: Any = None) -> NxopsError:
    where = "" if whole is None or whole is entry else f" (in {what}={_quote(whole)})"
    return NxopsError(
        f"Invalid xmap {what} entry {_quote(entry)}{where}. A spec is either a list of axis names "
        f"(str), with None for a positional dimension and an optional trailing ... "
        f"(e.g. ['batch', None, ...]), or a dict from positional dimension (int >= 0) "
        f"to axis name (e.g. {{0: 'batch'}}); [...], [] and {{}} mean no named axes. "
        f"Specs may be nested in a pytree prefix of the {what[:-5] or 'value'}s.")


def parse_spec(entry: Any, what: str, whole: Any = None) -> AxisSpec:
    """Parses one spec leaf; ``what`` is 'in_axes' or 'out_axes' (for messages),
    ``whole`` the user's whole spec tree (quoted when it is more than ``entry``)."""
    if isinstance(entry, dict):
        if not is_axes_leaf(entry):
            raise _spec_error(what, entry, whole)
        user_repr = _show_entry(entry)
        if any(pos < 0 for pos in entry):
            raise NxopsError(
                f"xmap doesn't support negative axes in {what}, but got {user_repr}: "
                f"count positional dimensions from the front (0, 1, ...).")
        pairs, rank = sorted(entry.items()), None
        min_rank = max(entry) + 1 if entry else 0
    elif isinstance(entry, (list, tuple)):
        if not is_axes_leaf(entry) or Ellipsis in entry[:-1]:
            raise _spec_error(what, entry, whole)
        user_repr = _show_entry(entry)
        if entry and entry[-1] is Ellipsis:
            entry, rank = entry[:-1], None
        else:
            rank = len(entry)
        min_rank = len(entry)
        pairs = [(pos, name) for pos, name in enumerate(entry) if name is not None]
    else:
        raise _spec_error(what, entry, whole)
    names = [name for _, name in pairs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise NxopsError(
            f"Named axes should be unique within each {what} specification, but "
            f"{user_repr} names {', '.join(map(repr, duplicates))} more than once: "
            f"a value has at most one dimension per named axis.")
    return AxisSpec(tuple(pairs), rank, user_repr, min_rank)


def parse_spec_tree(tree: Any, what: str) -> Any:
    """Parses a pytree (prefix) of specs into a pytree of ``AxisSpec`` leaves.

    A top-level list of specs means a tuple (lists and tuples are interchangeable
    at the top level, as in the old xmap).
    """
    whole = tree
    if isinstance(tree, list) and not is_axes_leaf(tree):
        if any(e is Ellipsis for e in tree):   # meant as one spec
            raise _spec_error(what, whole)
        tree = tuple(tree)
    if is_axes_leaf(tree):
        return parse_spec(tree, what)
    _check_dict_specs(tree, what, whole)
    # Any other leaf (a str, an int, ...) is not a spec: parse_spec raises.
    return jax.tree.map(lambda e: parse_spec(e, what, whole), tree, is_leaf=is_axes_leaf)


def spec_names(parsed_tree: Any) -> list[str]:
    """Axis names in a parsed spec tree, in order of first appearance."""
    seen: dict[str, None] = {}
    for spec in spec_leaves(parsed_tree):
        for name in spec.axis_names:
            seen.setdefault(name)
    return list(seen)


def spec_leaves(parsed_tree: Any) -> list[AxisSpec]:
    return jax.tree.leaves(parsed_tree, is_leaf=lambda x: isinstance(x, AxisSpec))


def broadcast_specs(parsed_tree: Any, values: Any, what: str, user_tree: Any) -> list[AxisSpec]:
    """One ``AxisSpec`` per leaf of ``values`` (``parsed_tree`` is a prefix of it)."""
    if isinstance(parsed_tree, AxisSpec):
        return [parsed_tree] * len(jax.tree.leaves(values))
    if type(parsed_tree) is tuple and type(values) is list and len(values) == len(parsed_tree):
        # A top-level list of specs was read as a tuple (one spec per result); a
        # body returning a list of results takes it too (leaf order is the same).
        values = tuple(values)
    try:
        per_subtree = jax.tree.map(
            lambda spec, sub: _SpecGroup([spec] * len(jax.tree.leaves(sub))), parsed_tree, values,
            is_leaf=lambda x: isinstance(x, AxisSpec))
    except ValueError:
        structure = jax.tree.structure(values)
        raise NxopsError(
            f"xmap {what} specification must be a tree prefix of the corresponding "
            f"value, got specification {user_tree!r} for value tree {structure}. "
            f"Give one spec per {'argument' if what == 'in_axes' else 'result'} (or one "
            f"spec for all). ({_prefix_mismatch(parsed_tree, values, what) or 'the trees differ'})"
        ) from None
    return [spec for group in jax.tree.leaves(per_subtree, is_leaf=lambda x: isinstance(x, _SpecGroup))
            for spec in group]


class _SpecGroup(list):
    """The specs of one subtree's leaves: not a pytree node (unlike a list of
    specs the user gave for a list argument), so flattening stops at it."""


def _prefix_mismatch(spec: Any, value: Any, what: str, path: str = "") -> str:
    """Where and how ``spec`` stops being a prefix of ``value``, in the user's
    terms (JAX's own message names tracer classes and "tree_map tree")."""
    if isinstance(spec, AxisSpec):
        return ""
    children = _children(value)
    spec_children = _children(spec)
    same_node = (children is not None and spec_children is not None
                 and type(spec) is type(value)
                 and [k for k, _ in spec_children] == [k for k, _ in children])
    if not same_node:
        where = f"{what}{path}" if path else f"the {what} value"
        return f"at {where} the spec is {_describe(spec)} but the value is {_describe(value)}"
    for (key, sub_spec), (_, sub_value) in zip(spec_children, children):
        found = _prefix_mismatch(sub_spec, sub_value, what, path + key)
        if found:
            return found
    return ""


def _children(node: Any) -> list[tuple[str, Any]] | None:
    """``node``'s pytree children with their key paths, or None for a leaf."""
    flat = jax.tree_util.default_registry.flatten_one_level(node)
    if flat is None:
        return None
    kids, aux = flat
    if isinstance(node, dict):
        keys = [f"[{k!r}]" for k in aux]
    elif hasattr(node, "_fields"):
        keys = [f".{f}" for f in node._fields]
    else:
        keys = [f"[{i}]" for i in range(len(kids))]
    return list(zip(keys, kids))


def _describe(node: Any) -> str:
    if node is None:
        return "None"
    if isinstance(node, AxisSpec):
        return f"the spec {node.user_repr}"
    children = _children(node)
    if children is None:
        if hasattr(node, "shape") and hasattr(node, "dtype"):
            return f"an array of shape {tuple(node.shape)} ({node.dtype})"
        return f"a {type(node).__name__}"
    if isinstance(node, dict):
        return "a dict with keys " + ", ".join(map(repr, node))
    return f"a {type(node).__name__} of {len(children)}"


def _where(path: str) -> str:
    return f" {path}" if path else ""


def check_input_rank(spec: AxisSpec, shape: Sequence[int], path: str) -> None:
    ndim = len(shape)
    if spec.rank is not None and ndim != spec.rank:
        raise NxopsError(
            f"xmap argument{_where(path)} has an in_axes specification of {spec.user_repr}, "
            f"which asserts that it should be of rank {spec.rank}, but the argument has "
            f"rank {ndim} (and shape {tuple(shape)}). End the spec with ... to allow "
            f"extra positional dimensions.")
    if spec.min_rank > ndim:
        raise NxopsError(
            f"One of xmap arguments{_where(path)} has an in_axes specification of "
            f"{spec.user_repr}, which implies that it has at least "
            f"{spec.min_rank} dimensions, but the argument has rank {ndim} "
            f"(and shape {tuple(shape)}). List one entry (a name or None) per "
            f"dimension it has, at most.")


def check_output_rank(spec: AxisSpec, positional_shape: Sequence[int], path: str) -> None:
    """``positional_shape``: the shape of one result as the body returned it."""
    ndim = len(positional_shape) + len(spec.names)
    if spec.rank is not None and ndim != spec.rank:
        raise NxopsError(
            f"One of xmap results{_where(path)} has an out_axes specification of "
            f"{spec.user_repr}, which asserts that it should be of rank {spec.rank}, but "
            f"the body returned a value of shape {tuple(positional_shape)}, so the "
            f"result would have rank {ndim}. End the spec with ... to allow extra "
            f"positional dimensions.")
    if spec.min_rank > ndim:
        needed = spec.min_rank - len(spec.names)
        raise NxopsError(
            f"One of xmap results{_where(path)} has an out_axes specification of "
            f"{spec.user_repr}, which requires the result of the xmapped function to "
            f"have at least {needed} positional dimensions, but it only has "
            f"{len(positional_shape)} (shape {tuple(positional_shape)}).")


def infer_axis_sizes(flat_specs: Sequence[AxisSpec], shapes: Sequence[Sequence[int]],
                     paths: Sequence[str], axis_sizes: dict[str, int]) -> dict[str, int]:
    """Checks ranks and returns ``{name: size}`` from the arguments and ``axis_sizes``."""
    sizes = dict(axis_sizes)
    source = {name: "axis_sizes" for name in axis_sizes}
    for spec, shape, path in zip(flat_specs, shapes, paths):
        check_input_rank(spec, shape, path)
        for pos, name in spec.names:
            size = shape[pos]
            if name in sizes and sizes[name] != size:
                raise NxopsError(
                    f"The size of axis {name!r} was previously inferred to be "
                    f"{sizes[name]} (from {source[name]}), but found an argument"
                    f"{_where(path)} of shape {tuple(shape)} with in_axes specification "
                    f"{spec.user_repr}. Shape mismatch occurs in dimension {pos}: "
                    f"{size} != {sizes[name]}. All dimensions named {name!r} must have "
                    f"the same size.")
            if name not in sizes:
                sizes[name] = size
                source[name] = f"argument{_where(path)} with in_axes {spec.user_repr}"
    return sizes
