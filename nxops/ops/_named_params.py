"""Which nxops primitives carry axis names in their parameters (before
batching turns them positional), for analyses of body jaxprs such as xmap's
shared-resource check. The one place that knows these parameter names."""
from __future__ import annotations

from typing import Any

from nxops.ops._named_layout import GATHERS, named_layout_p
from nxops.ops._dot import dot_general_p
from nxops.ops._mesh_variance import mesh_variance_p
from nxops.ops._reduce import reduce_p


def named_axes_effect(primitive: Any, params: dict) -> tuple[tuple, bool] | None:
    """``(names, drops)`` for an nxops primitive: the axis names its params
    carry, and whether its result stops varying along them (a reduction or
    a gather) rather than starts (a scatter or tile). None for other primitives."""
    if primitive is reduce_p:
        return tuple(params["axis_names"]), True
    if primitive is dot_general_p:
        return tuple(params["contract_names"]), True
    if primitive is named_layout_p:
        return (params["name"],), params["kind"] in GATHERS
    if primitive is mesh_variance_p:   # names mesh axes (a collective's result)
        return tuple(params["axes"]), not params["varies"]
    return None
