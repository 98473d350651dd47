"""``nx.einsum`` and ``nx.pdot``: contractions over positional and named axes.

Names are resolved to physical axes. Manual mesh axes are taken out of the
local problem: the local einsum runs on this device's shards, and one psum
over the contracted mesh axes finishes it (einsum is multilinear, so summing
the partial results is exact). The remaining labels (letters and vmap names)
are contracted pairwise in ``opt_einsum``'s order with ``nx_dot_general``;
labels that occur in one operand only and are not needed later are summed
first with ``nx_reduce``.
"""
from __future__ import annotations

import dataclasses
import functools
import jax
import jax.numpy as jnp
import opt_einsum
from jax.lax import PrecisionLike

from nxops._errors import NxopsError
from nxops.kernels.xla import collectives as xla_collectives
from nxops.ops import _axis_env, _sum_then_tile
from nxops.ops._dot import bind_dot_general
from nxops.ops._einsum_spec import (ELLIPSIS, EinsumSpec, Term, omitted_groups,
                                    parse_einsum_spec, term_text)
from nxops.ops._primitive import selection_param
from nxops.ops._reduce import bind_reduce
from nxops._typing import ArrayLike, AxisNames, DTypeLike, PosDims


@dataclasses.dataclass
class _Operand:
    """A value during contraction: its positional labels and the vmap names it has."""

    value: object
    labels: list[str]
    names: tuple[str, ...]
    mesh: tuple[str, ...] = ()   # mesh axes of its named groups (summed by a psum)


def _expand_ellipsis(spec: EinsumSpec, operands) -> tuple[list[list[str]], list[str], list]:
    """Positional labels per operand and for the result, with ``...`` replaced
    by labels ``'0'``, ``'1'``, ... (right-aligned, numpy-style broadcasting)."""
    n_ellipsis = 0
    for term, x in zip(spec.inputs, operands):
        ndim = jnp.ndim(x)
        if term.has_ellipsis:
            if ndim < len(term.letters):
                raise NxopsError(f"nx.einsum {spec.text!r}: an operand of shape {jnp.shape(x)} has "
                                 f"fewer dims than the letters of {term_text(term)!r}.")
            n_ellipsis = max(n_ellipsis, ndim - len(term.letters))
        elif ndim != len(term.letters):
            raise NxopsError(
                f"nx.einsum {spec.text!r}: term {term_text(term)!r} has {len(term.letters)} "
                f"positional letters but its operand has shape {jnp.shape(x)} (rank {ndim}). "
                f"Give one letter per positional dim (named axes are not dims of the operand), "
                f"or use '...'.")
    ellipsis_labels = [str(i) for i in range(n_ellipsis)]
    labels_per_operand, new_operands = [], []
    for term, x in zip(spec.inputs, operands):
        own = ellipsis_labels[n_ellipsis - (jnp.ndim(x) - len(term.letters)):] if term.has_ellipsis else []
        labels_per_operand.append(_splice(term, own))
        new_operands.append(x)
    out_labels = _splice(spec.output, ellipsis_labels)
    new_operands = _broadcast_ellipsis(spec, new_operands, labels_per_operand, ellipsis_labels)
    return labels_per_operand, out_labels, new_operands


def _splice(term: Term, ellipsis_labels: list[str]) -> list[str]:
    out: list[str] = []
    for p in term.positional:
        out.extend(ellipsis_labels if p == ELLIPSIS else [p])
    return out


def _broadcast_ellipsis(spec, operands, labels_per_operand, ellipsis_labels):
    """Broadcasts size-1 ellipsis dims (numpy semantics) so sizes agree."""
    sizes: dict[str, int] = {}
    for x, labels in zip(operands, labels_per_operand):
        for label, size in zip(labels, jnp.shape(x)):
            if label in ellipsis_labels and size != 1:
                if sizes.setdefault(label, size) != size:
                    raise NxopsError(f"nx.einsum {spec.text!r}: the '...' dims of the operands "
                                     f"do not broadcast ({[jnp.shape(o) for o in operands]}).")
    out = []
    for x, labels in zip(operands, labels_per_operand):
        target = tuple(sizes.get(label, size) if label in ellipsis_labels else size
                       for label, size in zip(labels, jnp.shape(x)))
        out.append(jnp.broadcast_to(x, target) if target != jnp.shape(x) else x)
    return out


def _check_sizes(spec: EinsumSpec, operands, labels_per_operand) -> None:
    sizes: dict[str, int] = {}
    for x, labels in zip(operands, labels_per_operand):
        for label, size in zip(labels, jnp.shape(x)):
            if sizes.setdefault(label, size) != size:
                raise NxopsError(
                    f"nx.einsum {spec.text!r}: letter {label!r} has size {sizes[label]} in one "
                    f"operand and {size} in another (shapes {[jnp.shape(o) for o in operands]}).")


def _take_diagonals(op: _Operand) -> _Operand:
    """Repeated letters in one operand ('ii') select its diagonal."""
    if len(set(op.labels)) == len(op.labels):
        return op
    unique = list(dict.fromkeys(op.labels))
    symbols = {lab: opt_einsum.get_symbol(i) for i, lab in enumerate(unique)}
    expr = "".join(symbols[lab] for lab in op.labels) + "->" + "".join(symbols[lab] for lab in unique)
    return _Operand(jnp.einsum(expr, op.value), unique, op.names)


def _sum_unneeded(op: _Operand, needed: set[str], kernels: str) -> _Operand:
    """Sums the labels, vmap names and mesh axes no later operand or the result
    needs. A mesh axis is summed (psum) as soon as no remaining operand carries
    it, exactly as a vmapped name: operands whose groups lack the name are not
    indexed by it, so they multiply the finished sum (never enter it)."""
    axes = tuple(i for i, lab in enumerate(op.labels) if lab not in needed)
    names = tuple(n for n in op.names if n not in needed)
    mesh = tuple(m for m in op.mesh if m not in needed)
    if not axes and not names and not mesh:
        return op
    value = op.value
    if axes or names:
        value = bind_reduce(value, axes=axes, op="sum", axis_names=names, kernels=kernels)
    if mesh:
        value = xla_collectives.psum(value, mesh, platform=_axis_env.mesh_platform())
    return _Operand(value, [lab for lab in op.labels if lab in needed],
                    tuple(n for n in op.names if n in needed),
                    tuple(m for m in op.mesh if m in needed))


def _carried(op: _Operand) -> set[str]:
    return set(op.labels) | set(op.names) | set(op.mesh)


def _contract_pair(a: _Operand, b: _Operand, needed: set[str], kernels: str, precision,
                   preferred_element_type) -> _Operand:
    a = _sum_unneeded(a, needed | _carried(b), kernels)
    b = _sum_unneeded(b, needed | _carried(a), kernels)
    common = [lab for lab in a.labels if lab in b.labels]
    batch = [lab for lab in common if lab in needed]
    contract = [lab for lab in common if lab not in needed]
    contract_names = tuple(n for n in a.names if n in b.names and n not in needed)
    dims = ((tuple(a.labels.index(c) for c in contract), tuple(b.labels.index(c) for c in contract)),
            (tuple(a.labels.index(c) for c in batch), tuple(b.labels.index(c) for c in batch)))
    value = bind_dot_general(a.value, b.value, dimension_numbers=dims, contract_names=contract_names,
                             precision=precision, preferred_element_type=preferred_element_type,
                             kernels=kernels)
    labels = batch + [lab for lab in a.labels if lab not in common] + \
        [lab for lab in b.labels if lab not in common]
    names = tuple(dict.fromkeys(n for n in a.names + b.names if n not in contract_names))
    return _Operand(value, labels, names, tuple(dict.fromkeys(a.mesh + b.mesh)))


def _contract_all(ops: list[_Operand], needed: set[str], *, kernels: str, precision,
                  preferred_element_type) -> _Operand:
    """Contracts ``ops`` pairwise in opt_einsum's order into one operand."""
    for i, j in _contraction_order(ops):
        a, b = ops[i], ops[j]
        rest = [op for k, op in enumerate(ops) if k not in (i, j)]
        pair_needed = needed | set().union(*map(_carried, rest))
        ops = rest + [_contract_pair(a, b, pair_needed, kernels, precision, preferred_element_type)]
    (result,) = ops
    return result


def _contraction_order(operands: list[_Operand]) -> list[tuple[int, int]]:
    if len(operands) <= 2:
        return [(0, 1)] if len(operands) == 2 else []
    labels = sorted({lab for op in operands for lab in op.labels + list(op.names)}, key=repr)
    symbols = {lab: opt_einsum.get_symbol(i) for i, lab in enumerate(labels)}
    sizes = {}
    for op in operands:
        for lab, size in zip(op.labels, jnp.shape(op.value)):
            sizes[lab] = size
        for name in op.names:
            sizes[name] = _axis_env.physical_axis_size(name)
    terms = ["".join(symbols[lab] for lab in op.labels + list(op.names)) for op in operands]
    shapes = [tuple(sizes[lab] for lab in op.labels + list(op.names)) for op in operands]
    path, _ = opt_einsum.contract_path(",".join(terms), *shapes, shapes=True, optimize="auto")
    return [tuple(p) for p in path]


def _resolve_names(spec: EinsumSpec) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Each logical name of the spec -> (its vmap names, its mesh names), once.

    Contracted names may not be looped (a loop step sees one chunk), and two
    names carried by one physical axis are refused: no device holds the pairs
    of positions the spec combines, only matching chunks of both.
    """
    op = f"nx.einsum {spec.text!r}"
    contracted = {n for t in spec.inputs for n in t.names} - set(spec.output.names)
    resolved, owner = {}, {}
    for name in dict.fromkeys(n for t in (*spec.inputs, spec.output) for n in t.names):
        physical = _axis_env.resolve((name,), op=op, allow_loop=name not in contracted)
        for axis in physical:
            other = owner.setdefault(axis, name)
            if other != name:
                raise NxopsError(
                    f"{op}: names {other!r} and {name!r} are both carried by axis {axis!r}, so "
                    f"no device holds the pairs of positions the spec combines. Map one of "
                    f"them to other mesh axes (or none) in axis_resources.")
        resolved[name] = _axis_env.split_vmap_and_mesh(
            physical, op=op, positional_hint=_positional_hint(spec))
    return resolved


def _positional_hint(spec: EinsumSpec) -> str:
    """How to write ``spec`` for positional dims: its names as letters, when
    each name is one letter that no term uses positionally."""
    names = {n for t in (*spec.inputs, spec.output) for n in t.names}
    letters = {p for t in (*spec.inputs, spec.output) for p in t.positional}
    generic = "for positional dims, write letters instead of a named group"
    if not all(len(n) == 1 and n.isalpha() for n in names) or names & letters:
        return generic
    sides = []
    for side in spec.text.replace(" ", "").split("->"):   # '>' of '->' closes no group
        spelled, in_group = [], False
        for char in side:
            if char in "<{":
                in_group = True
            elif char in ">}":
                in_group = False
            elif not (in_group and char == ","):
                spelled.append(char)
        sides.append("".join(spelled))
    return f"{generic} (e.g. {'->'.join(sides)!r})"


def _term_axes(term: Term, resolved) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(vmap names, mesh names) that carry the term's logical names."""
    vmap_names = tuple(v for n in term.names for v in resolved[n][0])
    mesh_names = tuple(m for n in term.names for m in resolved[n][1])
    return vmap_names, mesh_names


def einsum(spec: str, *operands: ArrayLike, precision: PrecisionLike = None,
           preferred_element_type: DTypeLike | None = None) -> jax.Array:
    """Einsum over positional letters and named axes.

    ``spec`` is e.g. ``'n<b,k>,<k,m>->n<b,m>'`` (or xeinsum-style ``{b,k}``):
    letters are positional dims, names in ``<...>`` are named axes; a name in
    operands but not in the result is summed (across devices where it is
    mapped to a mesh). Output dtype and ``precision`` as in ``jnp.einsum``.

    Examples:
        >>> dot = nx.xmap(lambda a, b: nx.einsum('<k>,<k>-><>', a, b), [['k'], ['k']], [...])
        >>> print(dot(jnp.array([1., 2.]), jnp.array([3., 4.])))    # contracts the named 'k'
        11.0
        >>> print(nx.einsum('ij,j->i', jnp.ones((2, 3)), jnp.arange(3.)))   # letters alone: jnp.einsum
        [3. 3.]
    """
    parsed = parse_einsum_spec(spec)
    for name, fixed in omitted_groups(parsed).items():
        _axis_env.note_varies_hint(name, (
            f"If it comes from nx.einsum {spec!r}: {name!r} is summed only in the operands "
            f"whose groups list it, and an operand that omits <{name}> keeps varying along "
            f"it. To contract {name!r} in every operand, write {fixed!r}."))
    if len(operands) != len(parsed.inputs):
        raise NxopsError(f"nx.einsum {spec!r} has {len(parsed.inputs)} operand terms but was "
                         f"given {len(operands)} operands.")
    if not operands:
        raise NxopsError("nx.einsum needs at least one operand.")
    # Names first: outside any xmap an unbound name is the error to report,
    # not the rank mismatch it causes (named axes are not dims of the operand).
    resolved = _resolve_names(parsed)
    dtype, logical = _compute_dtype(jnp.result_type(*operands), preferred_element_type)
    operands = [jnp.asarray(x, dtype) for x in operands]
    labels_per_operand, out_labels, operands = _expand_ellipsis(parsed, operands)
    _check_sizes(parsed, operands, labels_per_operand)
    out_vmap, out_mesh = _term_axes(parsed.output, resolved)
    kernels = selection_param()
    work = []
    for term, x, labels in zip(parsed.inputs, operands, labels_per_operand):
        vmap_names, mesh_names = _term_axes(term, resolved)
        work.append(_take_diagonals(_Operand(x, labels, vmap_names, mesh_names)))
    needed_at_end = set(out_labels) | set(out_vmap) | set(out_mesh)
    contract = functools.partial(_contract_all, kernels=kernels, precision=precision,
                                 preferred_element_type=preferred_element_type)
    # Operands whose groups carry no contracted name are not indexed by those
    # names: they join after the names are summed, whatever opt_einsum's order
    # (the same result whether a name is vmapped or on mesh devices).
    contracted = set().union(*(set(op.names) | set(op.mesh) for op in work)) - needed_at_end
    carrying = [op for op in work if (set(op.names) | set(op.mesh)) & contracted]
    plain = [op for op in work if not (set(op.names) | set(op.mesh)) & contracted]
    if carrying and plain:
        needed = needed_at_end | set().union(*map(_carried, plain))
        work = [_sum_unneeded(contract(carrying, needed), needed, kernels)] + plain
    result = contract(work, needed_at_end)
    # The last mesh sum comes after the layout fix-ups below, so that a
    # following nx.tile over the same axes can fuse it into a reduce-scatter.
    mesh_contracted = tuple(sorted(m for m in result.mesh if m not in out_mesh))
    result = _sum_unneeded(result, needed_at_end | set(result.mesh), kernels)
    value = result.value
    if result.labels != out_labels:
        value = jnp.transpose(value, [result.labels.index(lab) for lab in out_labels])
    out_dtype = preferred_element_type or dtype
    if value.dtype != out_dtype:   # sums promote small ints and bool; jnp.einsum does not
        value = value.astype(out_dtype)
    if mesh_contracted:
        value = _sum_then_tile.mesh_sum(value, mesh_contracted, platform=_axis_env.mesh_platform())
    return value != 0 if logical else value


def _compute_dtype(dtype, preferred_element_type) -> tuple:
    """(the dtype to contract in, whether the result is logical). A bool einsum
    is jnp.einsum's OR of ANDs: it is contracted as int32 counts and made bool
    (nonzero) at the end, so that sums over names and devices (psum would
    count) give the same dtype and values on every placement."""
    if dtype == jnp.bool_ and preferred_element_type is None:
        return jnp.dtype(jnp.int32), True
    return dtype, False


def pdot(x: ArrayLike, y: ArrayLike, axis_name: AxisNames, *, pos_contract: PosDims = ((), ()),
         pos_batch: PosDims = ((), ()), precision: PrecisionLike = None) -> jax.Array:
    """``lax.pdot``: contract ``x`` and ``y`` over named ``axis_name`` (a name or
    tuple) and positional ``pos_contract``, batching over ``pos_batch``.

    The result's dims are the batch dims, then x's, then y's remaining dims.

    Examples:
        >>> f = nx.xmap(lambda a, b: nx.pdot(a, b, 'k'), [['k', ...], ['k', ...]], [...])
        >>> print(f(jnp.ones((4, 2)), jnp.ones((4, 3))))   # [2] x [3] summed over 4 positions of 'k'
        [[4. 4. 4.]
         [4. 4. 4.]]
    """
    names = _axis_env.as_name_tuple(axis_name)
    physical = _axis_env.resolve(names, op="nx.pdot")
    vmap_names, mesh_names = _axis_env.split_vmap_and_mesh(physical, op="nx.pdot")
    dtype, logical = _compute_dtype(jnp.result_type(x, y), None)
    x, y = jnp.asarray(x, dtype), jnp.asarray(y, dtype)
    dims = _check_pdot_dims(x, y, pos_contract, pos_batch)
    out = bind_dot_general(x, y, dimension_numbers=dims, contract_names=vmap_names,
                           precision=precision, kernels=selection_param())
    if mesh_names:
        out = _sum_then_tile.mesh_sum(out, mesh_names, platform=_axis_env.mesh_platform())
    return out != 0 if logical else out


def _check_pdot_dims(x, y, pos_contract, pos_batch):
    try:
        (xc, yc), (xb, yb) = pos_contract, pos_batch
        if not all(isinstance(d, (tuple, list)) for d in (xc, yc, xb, yb)):
            raise TypeError
    except (TypeError, ValueError):
        raise NxopsError(f"nx.pdot: pos_contract={pos_contract!r} and pos_batch={pos_batch!r} must "
                         f"each be a pair (x_dims, y_dims).") from None
    normalized = []
    for dims, arr, which in ((xc, x, "x"), (yc, y, "y"), (xb, x, "x"), (yb, y, "y")):
        dims = tuple(dims)
        for d in dims:
            if not -arr.ndim <= d < arr.ndim:
                raise NxopsError(f"nx.pdot: dim {d} is out of range for {which} of shape {arr.shape}.")
        normalized.append(tuple(d % arr.ndim for d in dims))
    xc, yc, xb, yb = normalized
    for a, b, what in ((xc, yc, "pos_contract"), (xb, yb, "pos_batch")):
        if len(a) != len(b) or any(x.shape[i] != y.shape[j] for i, j in zip(a, b)):
            raise NxopsError(f"nx.pdot: {what} dims {a} of x{list(x.shape)} and {b} of "
                             f"y{list(y.shape)} must pair up with equal sizes.")
    return (xc, yc), (xb, yb)

