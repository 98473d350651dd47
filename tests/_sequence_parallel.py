"""Custom rules over named collectives, as sequence-parallel code writes them:
the gather/scatter pair (all_gather one way, psum_scatter the other), an
all_to_all exchange, a hand-written ring step (ppermute forward, the inverse
ppermute backward) and untile/tile. Each is written once against a namespace
``c`` of collectives with nx's signatures (nxops itself, the oracle's
reference module, or lax spelled like nx)."""
import types

import jax
from jax import lax


def custom_rule(forward, backward):
    """A custom_vjp operator: ``forward`` its value, ``backward`` its bwd."""
    @jax.custom_vjp
    def op(x):
        return forward(x)
    op.defvjp(lambda x: (op(x), None), lambda _, ct: (backward(ct),))
    return op


def ring(size: int, step: int = 1) -> list:
    return [(i, (i + step) % size) for i in range(size)]


def sequence_parallel_operators(c, name: str) -> dict:
    """The rules over ``name``. ``gather``, ``scatter`` and ``untile`` work on
    dim 0; ``all_to_all`` splits dim 0 and concatenates dim 1 (and back)."""
    return {
        "gather": custom_rule(lambda x: c.all_gather(x, name, axis=0, tiled=True),
                              lambda t: c.psum_scatter(t, name, scatter_dimension=0, tiled=True)),
        "scatter": custom_rule(lambda x: c.psum_scatter(x, name, scatter_dimension=0, tiled=True),
                               lambda t: c.all_gather(t, name, axis=0, tiled=True)),
        "all_to_all": custom_rule(lambda x: c.all_to_all(x, name, 0, 1, tiled=True),
                                  lambda t: c.all_to_all(t, name, 1, 0, tiled=True)),
        "ring": custom_rule(lambda x: c.ppermute(x, name, ring(c.axis_size(name))),
                            lambda t: c.ppermute(t, name, ring(c.axis_size(name), -1))),
        "untile": custom_rule(lambda x: c.untile(x, {name: 0}), lambda t: c.tile(t, {name: 0})),
    }


def _lax_untile(x, axes):
    (name, dim), = axes.items()
    return lax.all_gather(x, name, axis=dim, tiled=True)


def _lax_tile(x, axes):
    (name, dim), = axes.items()
    size = x.shape[dim] // lax.axis_size(name)
    return lax.dynamic_slice_in_dim(x, lax.axis_index(name) * size, size, dim)


# lax's collectives spelled like nx's (for jax.vmap references)
LAX = types.SimpleNamespace(
    all_gather=lax.all_gather,
    psum_scatter=lax.psum_scatter,
    all_to_all=lambda x, name, split, concat, *, tiled: lax.all_to_all(
        x, name, split, concat, tiled=tiled),
    ppermute=lax.ppermute,
    axis_size=lax.axis_size,
    untile=_lax_untile,
    tile=_lax_tile,
)
