"""The meshes in scope when the enclosing ``nx.xmap`` was called: a nested
xmap plans against them (it may not change the mesh) and traces its body
inline in the enclosing one."""
from __future__ import annotations

import contextlib
import contextvars

from nxops._jax import mesh_lib as _mesh_lib
from nxops.xmap._plan import mesh_in_scope

# The meshes in scope when the enclosing xmap was called (None: no enclosing xmap).
ENCLOSING_MESH: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "nxops_enclosing_xmap_mesh", default=None)


def meshes_in_scope() -> tuple:
    """The mesh xmap uses, and the legacy ``with mesh:`` one (to see any change)."""
    return (mesh_in_scope(), _mesh_lib.thread_resources.env.physical_mesh)


@contextlib.contextmanager
def enclosing_mesh():
    token = ENCLOSING_MESH.set(meshes_in_scope())
    try:
        yield
    finally:
        ENCLOSING_MESH.reset(token)
