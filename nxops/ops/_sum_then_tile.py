"""The sum-then-tile rewrite: ``nx.tile(psum(p, axes), {name: dim})``, where
``name`` is mapped to exactly the mesh ``axes``, is one reduce-scatter of
``p`` instead of an all-reduce followed by a slice (half the bytes per
device, the same values).

Where it happens:

- producers: named ops whose result is a sum over mesh axes (``nx.sum``,
  ``nx.psum``, contracted mesh names of ``nx.einsum`` / ``nx.pdot``) compute it
  with :func:`mesh_sum`, which records the partial value beside the result;
- the consumer: ``nx.tile`` asks :func:`summed_partial` for the tiled value;
  on an answer it reduce-scatters the partial
  (``_tiling._tile_as_reduce_scatter``). The psum it no longer uses is
  dead code, which jit removes.

Why ``id()``: JAX tracers take no attributes and are not hashable, so the
record is keyed by the result's id and checked through a weak reference: it
lives as long as the result, and a new object that reuses the id never
matches.
"""
from __future__ import annotations

import weakref

import jax.numpy as jnp
from jax import lax

from nxops.kernels.xla import collectives as xla_collectives

# id(result) -> (weak reference to result, partial, mesh axes summed over)
_summed: dict[int, tuple[weakref.ref, object, tuple[str, ...]]] = {}


def mesh_sum(partial, mesh_names: tuple[str, ...], *, platform: str):
    """``lax.psum(partial, mesh_names)`` (in f32 on CPU for 16-bit floats, see
    ``kernels/xla/collectives.py``), recorded so that an ``nx.tile`` over the
    same mesh axes can reduce-scatter ``partial`` instead."""
    result = _psum(partial, mesh_names, platform)
    key = id(result)
    try:
        ref = weakref.ref(result, lambda _: _summed.pop(key, None))
    except TypeError:  # not weak-referenceable (a concrete constant): nothing to fuse
        return result
    _summed[key] = (ref, partial, tuple(mesh_names))
    return result


def _psum(partial, mesh_names: tuple[str, ...], platform: str):
    if jnp.iscomplexobj(partial) and platform == "cpu":
        # XLA:CPU aborts ("Check failed: buffer != nullptr") on a complex
        # all-reduce of a constant (a sum over a size-0 name): sum the real and
        # imaginary parts as one real all-reduce, which is exact.
        parts = xla_collectives.psum(jnp.stack([jnp.real(partial), jnp.imag(partial)]),
                                     mesh_names, platform=platform)
        return lax.complex(parts[0], parts[1])
    return xla_collectives.psum(partial, mesh_names, platform=platform)


def summed_partial(value, mesh_names: tuple[str, ...]):
    """The ``partial`` of ``value = mesh_sum(partial, mesh_names)``, or None when
    ``value`` is not such a sum over exactly ``mesh_names``."""
    entry = _summed.get(id(value))
    if entry is None or entry[0]() is not value or entry[2] != tuple(mesh_names):
        return None
    return entry[1]
