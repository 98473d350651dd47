"""The types in nxops' public signatures (nxops ships ``py.typed``, so a
user's mypy or pyright checks calls against these)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Tuple, Union

from jax.typing import ArrayLike, DTypeLike

if TYPE_CHECKING:   # nxops.xmap imports the ops, which import this module
    from nxops.xmap._resources import SerialLoop

__all__ = ["ArrayLike", "Axis", "AxisNames", "AxisResources", "AxisRules", "DTypeLike",
           "PosDims", "PyTree", "Tiling"]

# A named axis: a name, or several names (major to minor) taken as one axis.
AxisNames = Union[str, Sequence[str]]
# A reduction axis: a name, a position, or a tuple mixing both.
Axis = Union[str, int, Sequence[Union[str, int]]]
# {name: positional dim} for nx.tile / nx.untile.
Tiling = Mapping[str, int]
# (dims of x, dims of y) for nx.pdot's pos_contract / pos_batch.
PosDims = Tuple[Sequence[int], Sequence[int]]
# Any pytree of arrays (lax.psum-style ops map over it, keeping its structure).
PyTree = Any

# axis_resources: {name: mesh axis | loop name | SerialLoop(n) | a tuple of them}
# or a flax-style rule table [(name, mesh axes or None), ...].
MeshAxes = Optional[Union[str, Sequence[str]]]
AxisRules = Sequence[Tuple[str, MeshAxes]]
Resource = Union[str, "SerialLoop", Sequence[Union[str, "SerialLoop"]]]
AxisResources = Union[Mapping[str, Resource], AxisRules]
