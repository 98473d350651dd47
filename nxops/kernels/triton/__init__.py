"""The ``triton`` backend: Triton kernels through jax-triton (GPU only).
Registered only when jax-triton is installed."""
