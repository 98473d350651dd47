"""After ci/py313.sh made its venv: installing nxops kept the JAX asked for
(pip may not move it), and nxops imports with it."""
import sys

import jax

import nxops  # noqa: F401

wanted = sys.argv[1]
if jax.__version__ != wanted:
    sys.exit(f"installing nxops changed JAX: wanted {wanted}, have {jax.__version__}")
print(f"Python {sys.version.split()[0]} + JAX {jax.__version__} ready")
