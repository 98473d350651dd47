"""``nx.SequenceLayout``: the order in which a sequence is stored, for
``nx.attention``'s causal mask on a balanced ring.

A contiguous causal ring is unbalanced: with the sequence cut into n shards
in order, device i's queries see i + 1 of the n key shards. Stored in
another order, every device sees the same share:

- ``zigzag``: the sequence cut into 2n chunks; shard d holds chunks d and
  2n - 1 - d (one early, one late). Against another device's shard exactly
  half of the block pairs are unmasked (ring-flash-attention's layout);
- ``striped``: shard d holds the tokens d, d + n, d + 2n, ... (Brandon et
  al., 2023, "Striped Attention"): every shard pair is a near-triangle.

The data are permuted once, when loaded (``order``); the causal mask then
compares the stored positions' global positions (``positions``).
"""
from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from nxops._errors import NxopsError

KINDS = ("zigzag", "striped")


class SequenceLayout:
    """A sequence stored in ``kind`` order (``"zigzag"`` or ``"striped"``)
    for ``shards`` devices; pass it to ``nx.attention(sequence_layout=...)``.

    ``order(length)``: the global position of each stored element (``x[...,
    order, ...]`` permutes data into the layout; ``inverse(length)`` back).

    Examples:
        >>> layout = nx.SequenceLayout("zigzag", shards=2)
        >>> print(layout.order(8))                   # shard 0: chunks 0, 3; shard 1: 1, 2
        [0 1 6 7 2 3 4 5]
        >>> print(nx.SequenceLayout("striped", shards=2).order(8))
        [0 2 4 6 1 3 5 7]
    """

    def __init__(self, kind: str, shards: int):
        if kind not in KINDS:
            raise NxopsError(f"nx.SequenceLayout: kind={kind!r}; give one of {KINDS}.")
        if isinstance(shards, bool) or not isinstance(shards, numbers.Integral) or shards < 1:
            raise NxopsError(f"nx.SequenceLayout: shards={shards!r}; give a positive int (the "
                             f"devices the sequence is split over).")
        self.kind, self.shards = kind, int(shards)

    def __repr__(self):
        return f"SequenceLayout({self.kind!r}, shards={self.shards})"

    def __eq__(self, other):
        return isinstance(other, SequenceLayout) and (self.kind, self.shards) == \
            (other.kind, other.shards)

    def __hash__(self):
        return hash((self.kind, self.shards))

    def _chunks(self) -> int:
        return 2 * self.shards if self.kind == "zigzag" else self.shards

    def check_length(self, length: int, what: str) -> None:
        if length % self._chunks():
            raise NxopsError(
                f"{what} has length {length}, which {self!r} cannot split: it needs a multiple "
                f"of {self._chunks()} ({'2 x ' if self.kind == 'zigzag' else ''}shards).")

    def positions(self, stored: jax.Array, length: int) -> jax.Array:
        """The global positions (int32) of stored positions ``stored`` of a
        sequence of ``length`` (traceable: ``stored`` may be a tracer)."""
        self.check_length(length, "the sequence")
        stored = jnp.asarray(stored).astype(jnp.int32)
        n = self.shards
        per_shard = length // n
        shard, offset = stored // per_shard, stored % per_shard
        if self.kind == "striped":
            return offset * n + shard
        chunk = per_shard // 2
        late = offset >= chunk
        return jnp.where(late, (2 * n - 1 - shard) * chunk + offset - chunk,
                         shard * chunk + offset)

    def order(self, length: int) -> np.ndarray:
        """The global position of each stored element: ``x[order]`` is ``x``
        stored in this layout."""
        return np.asarray(self.positions(np.arange(length), length))

    def inverse(self, length: int) -> np.ndarray:
        """Where each global position is stored: ``y[inverse]`` undoes ``order``."""
        return np.argsort(self.order(length))
