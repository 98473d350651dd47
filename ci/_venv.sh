# Sourced by the README commands: makes a venv in the repo root (once; .venv,
# or $NXOPS_VENV) and installs nxops with the extras in NXOPS_EXTRAS (default:
# test) into it: the README's venv, nxops and its test tools. With $NXOPS_JAX
# (e.g. "jax==0.12.0.1") that JAX goes in first, as a user's venv has it;
# installing nxops must keep it (CI checks: ci/py313_check.py).
#
# install_compile_venv (ci/test.sh, ci/py313.sh) makes a second venv beside it,
# $VENV-compile (or $NXOPS_COMPILE_VENV), for what only the deviceless GPU/TPU
# compiles and Triton's interpreter need: the compile extras (the CUDA plugin,
# nvcc, libtpu; 2-3 GB, and the CUDA plugin logs a CUDA traceback at every
# `import jax` on a machine without a GPU), the triton extra, and the docs
# extra (mkdocs, to build the site with its API reference). It sees the
# first venv's packages through a .pth file, so JAX and the test tools are
# installed once; only the extras go into it.
#
# pip's output goes to <venv>/install.log; only a failure shows it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
absolute() { case $1 in /*) echo "$1";; *) echo "$PWD/$1";; esac; }
VENV=$(absolute "${NXOPS_VENV:-.venv}")
COMPILE_VENV=$(absolute "${NXOPS_COMPILE_VENV:-$VENV-compile}")
NXOPS_EXTRAS=${NXOPS_EXTRAS:-test}
# nxops runs on the host CPU here; the compile extras (the CUDA plugin, libtpu)
# only compile for GPU/TPU, and the CUDA plugin's device probe fails without this.
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}

site_packages() {   # venv -> its site-packages folder
  "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}

install_nxops() {   # venv extras [base venv whose packages it sees]
  local venv=$1 extras=$2 base=${3:-}
  local stamp=$venv/.nxops-installed-${extras//,/-}${NXOPS_JAX:+-${NXOPS_JAX//[^A-Za-z0-9.]/}}
  if [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ] \
     && { [ -z "$base" ] || [ ! "$base/.nxops-base-changed" -nt "$stamp" ]; }; then
    return 0
  fi
  echo "installing nxops[$extras] ${NXOPS_JAX:-} into $venv${base:+ (on top of $base)} (first run only; log: $venv/install.log)"
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  if [ -n "$base" ]; then   # relative: the checkout may move (or be bind-mounted elsewhere)
    local site base_site
    site=$(site_packages "$venv"); base_site=$(site_packages "$base")
    "$venv/bin/python" -c 'import os, sys; print(os.path.relpath(sys.argv[2], sys.argv[1]))' \
      "$site" "$base_site" > "$site/nxops-base-venv.pth"
  fi
  if ! { "$venv/bin/python" -m pip install --upgrade pip \
         && { [ -n "$base" ] || [ -z "${NXOPS_JAX:-}" ] || "$venv/bin/python" -m pip install "$NXOPS_JAX"; } \
         && "$venv/bin/python" -m pip install -e ".[$extras]"; } \
       > "$venv/install.log" 2>&1; then
    grep -iE "error|conflict" "$venv/install.log" | tail -20 >&2
    echo "pip install failed; full log: $venv/install.log" >&2
    exit 1
  fi
  touch "$stamp" "$venv/.nxops-base-changed"
}

install_compile_venv() {   # sets COMPILE_PYTHON
  install_nxops "$COMPILE_VENV" test,compile,triton,docs "$VENV"
  COMPILE_PYTHON=$COMPILE_VENV/bin/python
}

install_nxops "$VENV" "$NXOPS_EXTRAS"
export PATH="$VENV/bin:$PATH"
