"""The ``xla`` backend: pure-JAX reference implementations of every op."""
from nxops.kernels.xla import (attention, attention_backward, collectives, cross_entropy,  # noqa: F401  (registers)
                               dot_general, reduce, tile)
