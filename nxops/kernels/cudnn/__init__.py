"""The ``cudnn`` backend: what cuDNN ships, called through JAX
(``jax.nn.dot_product_attention(implementation="cudnn")``), where its
constraints hold. Each module registers its kernels on import."""
from nxops.kernels.cudnn import attention  # noqa: F401  (registers)
