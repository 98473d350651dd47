"""The ``xla`` backend: pure-JAX reference implementations of every op."""
from nxops.kernels.xla import attention, collectives, cross_entropy, dot_general, reduce, tile  # noqa: F401  (registers)
