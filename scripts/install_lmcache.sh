#!/usr/bin/env bash
# Install LMCache (lmcache==0.5.6, PyPI) for the LMCache peer of
# benchmarks/bench_vllm_connector.py, in a package directory of its own,
# .venv-lmcache, so the project venv (.venv) is never touched.
#
# On vLLM-CPU, LMCache's in-process connector (LMCacheConnectorV1) has no CPU
# path; its multi-process mode does: an LMCache server
# (`python -m lmcache.v1.multiprocess.http_server`) holds the KV, and vLLM's
# `LMCacheMPConnector` talks to it over ZMQ, copying KV itself
# (`engine_driven` transfer mode). That path needs LMCache's Python and its
# compiled helpers, not its CUDA-only requirements (cupy, cuda-python, nvtx,
# cufile, ...), and everything else it imports is already in .venv (vLLM-CPU
# brings torch, zmq, fastapi, uvicorn, msgspec, blake3, ...). So the wheel
# goes in with --no-deps into .venv-lmcache (`pip install --target`), and the
# benchmark runs both the LMCache server and the LMCache engine with .venv's
# Python and .venv-lmcache on PYTHONPATH; every other engine never sees it.
#
# Idempotent: the install ends with an import check of the server and
# connector modules, then a stamp (this script's hash); a second run finds
# the stamp and LMCache's metadata and installs nothing (in well under a second).
#
# Usage: scripts/install_lmcache.sh                 (into <repo>/.venv-lmcache, using <repo>/.venv)
#        VENV=/path/to/venv LMCACHE_DIR=/path/to/dir scripts/install_lmcache.sh
set -euo pipefail

LMCACHE_VERSION="0.5.6"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-.venv}"
LMCACHE_DIR="${LMCACHE_DIR:-.venv-lmcache}"
case "${VENV}" in
    /*) ;;
    *) VENV="${REPO_ROOT}/${VENV}" ;;
esac
case "${LMCACHE_DIR}" in
    /*) ;;
    *) LMCACHE_DIR="${REPO_ROOT}/${LMCACHE_DIR}" ;;
esac
PY="${VENV}/bin/python"

if [[ ! -x "${PY}" ]]; then
    echo "install_lmcache: no python at ${PY}; create the venv first (scripts/setup.sh vllm)" >&2
    exit 1
fi

# What the benchmark imports: the server's modules and vLLM's connector, which
# resolves to LMCache's own LMCacheMPConnector when lmcache is importable.
CHECK_IMPORTS='
import lmcache
import lmcache.v1.multiprocess.server
from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
from vllm.distributed.kv_transfer.kv_connector.v1 import lmcache_mp_connector as m
assert m.LMCacheMPConnector is LMCacheMPConnector, m.LMCacheMPConnector
print(lmcache.__version__)
'

check() {
    # Prints lmcache's version when every import works; nothing otherwise.
    (cd / && PYTHONPATH="${LMCACHE_DIR}" "${PY}" -c "${CHECK_IMPORTS}" 2>/dev/null | tail -1) || true
}

stamp="${LMCACHE_DIR}/.kvsdk-lmcache-$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)"
if [[ -f "${stamp}" && -d "${LMCACHE_DIR}/lmcache-${LMCACHE_VERSION}.dist-info" ]]; then
    echo "install_lmcache: lmcache ${LMCACHE_VERSION} already usable from ${LMCACHE_DIR}; nothing to do"
    exit 0
fi

start=$(date +%s)
rm -rf "${LMCACHE_DIR}"
echo "install_lmcache: installing lmcache==${LMCACHE_VERSION} (--no-deps) into ${LMCACHE_DIR}"
"${PY}" -m pip install --disable-pip-version-check -q --no-deps --target "${LMCACHE_DIR}" \
    "lmcache==${LMCACHE_VERSION}" 2>&1 | { grep -v -e "is ignored: it is neither" || true; }

got="$(check)"
if [[ "${got}" != "${LMCACHE_VERSION}" ]]; then
    echo "install_lmcache: the imports fail after install:" >&2
    (cd / && PYTHONPATH="${LMCACHE_DIR}" "${PY}" -c "${CHECK_IMPORTS}" 2>&1 | tail -5) >&2 || true
    exit 1
fi
touch "${stamp}"
echo "install_lmcache: lmcache ${LMCACHE_VERSION} ready in ${LMCACHE_DIR} ($(($(date +%s) - start)) s)"
