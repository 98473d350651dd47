"""nxops: named-axis ops for JAX."""
from nxops._errors import NxopsError
from nxops import kernels

__version__ = "0.1.0"
