"""The ``pallas`` backend: Pallas kernels (Triton lowering on GPU, Mosaic on
TPU, interpret mode on CPU). Each module registers its kernels on import.

See README.md in this folder for block shapes, bytes moved and what was
verified without a GPU/TPU.
"""
from nxops.kernels.pallas import attention, collectives, cross_entropy, dot_general, reduce, tile  # noqa: F401  (registers)
