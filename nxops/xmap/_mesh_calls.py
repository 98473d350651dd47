"""How a jitted xmap program is called with respect to the mesh in scope:
made on first use, under ``jax.set_mesh`` for the legacy ``with mesh:``, or
off the mesh when its resources name no mesh axis."""
from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from nxops._errors import NxopsError
from nxops._jax import ArrayImpl as _ArrayImpl
from nxops._jax import core as _jax_core
from nxops.xmap._plan import off_mesh


class MadeOnFirstUse:
    """The jitted program, made when first called or lowered: an xmap called
    inside an enclosing trace (a jax.jit, jax.grad) traces ``run`` inline and
    never needs it, and making a jax.jit costs (it inspects the signature)."""

    def __init__(self, make: Callable[[], Callable]):
        self._make, self._made = make, None

    def _program(self) -> Callable:
        if self._made is None:
            self._made = self._make()
        return self._made

    def __call__(self, *args):
        return self._program()(*args)

    def lower(self, *args):
        return self._program().lower(*args)


class UnderMesh:
    """A jitted program called under ``jax.set_mesh`` (for the legacy ``with mesh:``)."""

    def __init__(self, mesh: Mesh, jitted):
        self._mesh, self._jitted = mesh, jitted

    def __call__(self, *args):
        if not _jax_core.trace_state_clean():   # inside jax.jit: set_mesh is refused there
            return self._jitted(*args)
        with jax.set_mesh(self._mesh):
            return self._jitted(*args)

    def lower(self, *args):
        with jax.set_mesh(self._mesh):
            return self._jitted.lower(*args)


class OffMesh:
    """A program whose resources name no mesh axis, called under a mesh.

    jit under ``jax.set_mesh`` partitions over the whole mesh, so every device
    would compute everything. The old xmap ran such a program on one device;
    so does this: the mesh is unset around the call and the inputs moved to the
    mesh's first device. The results are then replicated over the mesh, as they
    were (so they mix with other arrays on the mesh). Inside a trace (an
    enclosing jit or xmap) the enclosing program decides. If a nested xmap
    uses mesh axes (``NeedsMesh``), or the program does not build off the mesh
    (e.g. the body closes over an array typed for the mesh: a key made under
    ``jax.set_mesh``), it runs on the mesh after all, as before.
    """

    def __init__(self, mesh: Mesh, jitted, on_mesh):
        self._mesh, self._jitted, self._on_mesh = mesh, jitted, on_mesh
        # A sharding, not a device: device_put(x, device) keeps a mesh-typed
        # aval (the array then does not jit off the mesh); this drops it.
        self._one_device = SingleDeviceSharding(mesh.devices.flat[0])
        self._needs_mesh = False

    def __call__(self, *args):
        if self._needs_mesh or not _jax_core.trace_state_clean():
            return self._on_mesh(*args)
        results = self._try_off_mesh(self._jitted, args)
        if results is None:
            return self._on_mesh(*args)
        replicated = NamedSharding(self._mesh, PartitionSpec())
        return jax.tree.map(lambda x: jax.device_put(x, replicated), results)

    def lower(self, *args):
        lowered = None if self._needs_mesh else self._try_off_mesh(self._jitted.lower, args)
        return self._on_mesh.lower(*args) if lowered is None else lowered

    def _try_off_mesh(self, fn, args):
        """``fn`` off the mesh, or None (from now on) where that cannot work."""
        try:
            with jax.set_mesh(None), off_mesh(self._mesh):
                return fn(*self._on_one_device(args))
        except NxopsError:
            raise   # the user's error, wherever the program runs
        except Exception:
            # On the mesh the program either works, or reports its own error.
            self._needs_mesh = True
            return None

    def _on_one_device(self, args: tuple) -> tuple:
        def move(x):
            if isinstance(x, _ArrayImpl) and x.sharding != self._one_device:
                return jax.device_put(x, self._one_device)
            return x
        return jax.tree.map(move, args)


def names_mesh_axes(resources: dict, mesh: Mesh) -> bool:
    """Whether some resource is an axis of ``mesh``."""
    return any(r in mesh.axis_names for rs in resources.values() for r in rs
               if isinstance(r, str))
