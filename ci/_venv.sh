# Sourced by the README commands: makes .venv in the repo root (once) and
# installs nxops with the extras in NXOPS_EXTRAS (default: test) into it.
# pip's output goes to .venv/install.log; only a failure shows it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
NXOPS_EXTRAS=${NXOPS_EXTRAS:-test}
# nxops runs on the host CPU here; the compile extras (jax-cuda12-plugin, libtpu)
# only compile for GPU/TPU, and the CUDA plugin's device probe fails without this.
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
stamp=.venv/.nxops-installed-${NXOPS_EXTRAS//,/-}
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "installing nxops[$NXOPS_EXTRAS] into .venv (first run only; log: .venv/install.log)"
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  if ! { .venv/bin/python -m pip install --upgrade pip \
         && .venv/bin/python -m pip install -e ".[$NXOPS_EXTRAS]"; } > .venv/install.log 2>&1; then
    grep -iE "error|conflict" .venv/install.log | tail -20 >&2
    echo "pip install failed; full log: .venv/install.log" >&2
    exit 1
  fi
  touch "$stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"
