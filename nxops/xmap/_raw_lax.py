"""Raw ``jax.lax`` collectives and ``jnp`` reductions on xmap names: say which nx op to use.

An xmap name mapped to mesh axes is not a name JAX knows: inside the body only
the mesh axes and the local vmap tile are bound, so ``jax.lax.psum(x, 'batch')``
fails with JAX's bare ``NameError: unbound axis name``. ``jnp.sum(x,
axis='batch')`` fails the same way on every placement (jnp reads the string as
the names 'b', 'a', ...). The body is traced in one place (``_program``): it
turns that NameError into an NxopsError naming the nx replacement.
"""
from __future__ import annotations

import re
import traceback

import jax

from nxops._errors import NxopsError
from nxops.ops._axis_env import current_logical_axes, looped_name_hint

# The public JAX function (by its name where JAX defines it) -> the nx op.
_LAX_REPLACEMENTS = {
    "psum": "nx.psum", "pmean": "nx.pmean", "pmax": "nx.pmax", "pmin": "nx.pmin",
    "all_gather": "nx.all_gather", "ppermute": "nx.ppermute", "pshuffle": "nx.ppermute",
    "all_to_all": "nx.all_to_all", "psum_scatter": "nx.psum_scatter",
    "axis_index": "nx.axis_index", "axis_size": "nx.axis_size",
}
_JNP_REPLACEMENTS = {
    "sum": "nx.sum", "mean": "nx.mean", "max": "nx.max", "amax": "nx.max", "min": "nx.min",
    "amin": "nx.min", "prod": "nx.prod", "var": "nx.var", "std": "nx.std",
    "logsumexp": "nx.logsumexp",
}
# Position queries work on looped names (a position is global); collectives do not.
_POSITION_QUERIES = ("axis_index", "axis_size")
_LAX_FILE = "/jax/_src/lax/parallel.py"
_JNP_FILES = ("/jax/_src/numpy/reductions.py", "/jax/_src/ops/special.py",
              "/jax/_src/nn/functions.py")
_UNBOUND = re.compile(r"unbound axis name: (.+?)(?:\. To fix|$)", re.S)


def _public_call(error: NameError) -> tuple[str, str, object] | None:
    """(module, function name, its axis argument) of the outermost JAX
    collective or reduction the failing call went through, if any."""
    for frame, _ in traceback.walk_tb(error.__traceback__):
        path, name = frame.f_code.co_filename.replace("\\", "/"), frame.f_code.co_name
        if path.endswith(_LAX_FILE) and name in _LAX_REPLACEMENTS:
            return "jax.lax", name, frame.f_locals.get("axis_name")
        if path.endswith(_JNP_FILES) and name in _JNP_REPLACEMENTS:
            return "jnp", name, frame.f_locals.get("axis")
    return None


def _where_bound(name, logical: dict) -> str:
    axis = logical.get(name)
    if axis is None:
        known = ", ".join(map(repr, logical)) or "none"
        return f"{name!r} is not an axis name bound here (xmap names: {known})"
    # The physical names are its mesh axes, then its vmap tile unless mesh axes alone carry it.
    on_mesh = jax.sharding.get_abstract_mesh().axis_names
    mesh = [p for p in axis.physical if p in on_mesh]
    loops = [getattr(loop, "name", None) or repr(loop) for loop in axis.loops]
    where = " and ".join(([f"mesh axes {tuple(mesh)}"] if mesh else []) +
                         ([f"serial loops ({', '.join(loops)})"] if loops else [])) or "a vmap"
    return (f"{name!r} is an nx.xmap name, mapped to {where}; raw JAX collectives see "
            f"only physical axis names, so they cannot find it")


def _jnp_replacement(function: str, axis) -> str:
    import nxops   # the public namespace (nx.var/nx.std may be absent)
    name = _JNP_REPLACEMENTS[function]
    if hasattr(nxops, name[3:]):
        return f"{name}(x, {axis!r})"
    mean = f"nx.mean(x, {axis!r})"
    var = f"nx.mean(abs(x - {mean}) ** 2, {axis!r})"
    return var if function == "var" else f"jnp.sqrt({var})"


def raw_lax_error(error: NameError) -> NxopsError | None:
    """The NxopsError for JAX's unbound-axis NameError raised by a raw
    ``jax.lax``/``jnp`` call on an xmap name; None for any other NameError."""
    match = _UNBOUND.search(str(error))
    if match is None:
        return None
    unbound = match.group(1).strip()
    call = _public_call(error)
    logical = current_logical_axes()
    if call is None:
        return NxopsError(
            f"A raw JAX collective in the xmapped function uses axis name {unbound!r}: "
            f"{_where_bound(unbound, logical)}. Use the nx ops on xmap names (nx.psum, "
            f"nx.pmean, nx.pmax, nx.pmin, nx.all_gather, nx.ppermute, nx.all_to_all, "
            f"nx.psum_scatter, nx.axis_index, nx.sum(x, name), ...). (JAX: {error})")
    module, function, axis = call
    if module == "jnp":
        return NxopsError(
            f"jnp.{function}(x, axis={axis!r}) in the xmapped function: jnp reductions "
            f"take positional (int) axes only, and JAX reads a string axis as a sequence of "
            f"axis names ({unbound!r}, ...). Reduce over a named axis with "
            f"{_jnp_replacement(function, axis)} (nx reductions also take ints, or a tuple "
            f"of both).")
    replacement = _LAX_REPLACEMENTS[function]
    names = axis if isinstance(axis, tuple) else (axis,) if axis is not None else (unbound,)
    shown = names[0] if len(names) == 1 else names
    reason = _where_bound(unbound, logical)
    looped = unbound in logical and logical[unbound].loops
    if looped and function not in _POSITION_QUERIES:
        return NxopsError(
            f"jax.lax.{function} over {shown!r} in the xmapped function: {reason}. No "
            f"collective spans a serial loop ({replacement} is refused there too: each loop "
            f"step sees one chunk). {looped_name_hint(unbound, f'jax.lax.{function}')}")
    return NxopsError(
        f"jax.lax.{function} over {shown!r} in the xmapped function: {reason}. Use "
        f"{replacement} (same arguments), which resolves xmap names on every placement.")
