"""The ``pallas`` backend: Pallas kernels (Triton lowering on GPU, Mosaic on
TPU, interpret mode on CPU). Each module registers its kernels on import."""
