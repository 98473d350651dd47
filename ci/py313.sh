#!/usr/bin/env bash
# Python 3.13 + JAX 0.12 for CI on a machine that has only Python 3.11: a
# Debian 13 ("trixie") chroot in .ci-chroot/ with the checkout bind-mounted at
# /nxops. Made fresh from the machine's own Debian mirror; nothing is cached
# outside the repository.
#   bash ci/py313.sh prepare        debootstrap the chroot and make its venv
#   bash ci/py313.sh run CMD...     run CMD in /nxops inside the chroot
#   bash ci/py313.sh unmount        undo the mounts (CI does this on exit)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
ROOT=$REPO/.ci-chroot
# The JAX this run tests (also what NXOPS_EXTRAS' `compile`/`triton` resolve to on 3.13).
JAX_VERSION=${NXOPS_PY313_JAX:-0.12.0.1}

mirror() {   # the Debian mirror this machine's apt already uses
  local uri
  uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  [ -n "$uri" ] || uri=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

mount_all() {
  mkdir -p "$ROOT/nxops"
  mountpoint -q "$ROOT/nxops" || mount --bind "$REPO" "$ROOT/nxops"
  mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
  mountpoint -q "$ROOT/sys" || mount --rbind /sys "$ROOT/sys"
  mountpoint -q "$ROOT/dev" || mount --rbind /dev "$ROOT/dev"
  # shared/ beside the checkout (the defect repros the tests compare with)
  if [ -d "$REPO/../shared" ]; then
    mkdir -p "$ROOT/shared"
    mountpoint -q "$ROOT/shared" || mount --bind -o ro "$REPO/../shared" "$ROOT/shared"
  fi
  # name resolution (pip; the multi-process tests resolve the hostname) and the
  # CA bundle pip trusts here
  cp /etc/resolv.conf /etc/hosts "$ROOT/etc/"
  cp "${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" "$ROOT/etc/ssl/certs/ca-certificates.crt"
}

unmount_all() {
  for m in nxops shared proc sys dev; do
    mountpoint -q "$ROOT/$m" 2>/dev/null && umount -R -l "$ROOT/$m" || true
  done
}

in_chroot() {
  chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 PATH=/usr/local/bin:/usr/bin:/bin \
    JAX_PLATFORMS=cpu CI="${CI:-}" PIP_DEFAULT_TIMEOUT=180 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NXOPS_VENV=.venv-py313 PYTHON=python3.13 NXOPS_JAX="jax==$JAX_VERSION" \
    ${NXOPS_ORACLE_PROFILE:+NXOPS_ORACLE_PROFILE=$NXOPS_ORACLE_PROFILE} \
    /bin/bash -c "cd /nxops && $*"
}

case "${1:-}" in
  prepare)
    if [ ! -x "$ROOT/usr/bin/python3.13" ]; then
      command -v debootstrap > /dev/null || {
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap; }
      rm -rf "$ROOT"
      debootstrap --variant=minbase --include=python3.13-venv,ca-certificates \
        trixie "$ROOT" "$(mirror)"
    fi
    mount_all
    # The same venv script as the README's commands, in .venv-py313 (the host's
    # is .venv) and .venv-py313-compile (the compile and triton extras on top).
    in_chroot "NXOPS_EXTRAS=test source ci/_venv.sh && install_compile_venv \
      && python ci/py313_check.py $JAX_VERSION && \$COMPILE_PYTHON ci/py313_check.py $JAX_VERSION"
    ;;
  run)
    shift
    mount_all
    in_chroot "$@"
    ;;
  unmount)
    unmount_all
    ;;
  *)
    echo "usage: bash ci/py313.sh prepare | run CMD... | unmount" >&2
    exit 2
    ;;
esac
