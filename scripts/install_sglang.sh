#!/usr/bin/env bash
# Install SGLang's HiCache classes (sglang==0.5.23, PyPI) into a SEPARATE venv,
# .venv-sglang, so the vLLM venv (.venv) is never touched.
#
# SGLang cannot serve a model on CPU from PyPI, but its cache machinery runs:
# MHATokenToKVPool(device="cpu"), the host pools, the HiCache controllers and
# the storage backends. That is what the kvsdk adapter's tests drive. Steps:
#   1. python3.11 venv at .venv-sglang, torch==2.13.0+cpu (scripts/constraints.txt),
#   2. kvsdk itself, editable, with its test and redis extras,
#   3. sglang==0.5.23 --no-deps, then only what its imports need (no triton
#      kernels are run; flashinfer, sgl-kernel, CUDA wheels are never installed),
#   4. torchvision --no-deps plus a startup shim (a .pth-loaded module in the
#      venv's site-packages) that defines the `torchvision::nms` / `qnms` op
#      schemas before torchvision is imported: PyPI's torchvision cannot load
#      its C ops beside the CPU torch, and SGLang imports it at import time.
#
# Idempotent: a second run checks the imports and installs nothing new (until
# pyproject.toml, scripts/constraints.txt or this script change).
#
# Usage: scripts/install_sglang.sh                 (venv at <repo>/.venv-sglang)
#        VENV=/path/to/venv scripts/install_sglang.sh
set -euo pipefail

SGLANG_VERSION="0.5.23"
TORCH_SPEC="torch==2.13.0+cpu"
TORCHVISION_SPEC="torchvision==0.28.0"   # the release paired with torch 2.13
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-.venv-sglang}"
case "${VENV}" in
    /*) ;;
    *) VENV="${REPO_ROOT}/${VENV}" ;;
esac
PYTHON="${PYTHON:-python3.11}"
command -v "${PYTHON}" >/dev/null || PYTHON=python3
PY="${VENV}/bin/python"
CONSTRAINTS="${REPO_ROOT}/scripts/constraints.txt"

# What the `import sglang.srt...` chain of the HiCache classes needs, beyond
# torch and kvsdk's own dependencies (found by importing and adding until the
# imports below succeed).
SGLANG_IMPORT_DEPS=(
    numpy orjson psutil pybase64 requests packaging pillow starlette msgspec
    pydantic pyzmq tqdm IPython aiohttp dill gguf triton "transformers==5.19.0"
    "apache-tvm-ffi==0.1.11" sentencepiece compressed-tensors
)

# The imports the adapter and its tests rely on.
CHECK_IMPORTS='
import sglang, torch, torchvision
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
import kvsdk.plugins.sglang
assert torch.__version__.endswith("+cpu"), torch.__version__
print(sglang.__version__)
'

check() {
    # Prints sglang's version when every import works; nothing otherwise.
    (cd / && "${PY}" -c "${CHECK_IMPORTS}" 2>/dev/null) || true
}

# A change to kvsdk's dependencies, the constraints or this script re-runs the installs.
stamp="${VENV}/.kvsdk-sglang-$(cat "${REPO_ROOT}/pyproject.toml" "${CONSTRAINTS}" "${BASH_SOURCE[0]}" \
    | sha256sum | cut -c1-16)"
if [[ -x "${PY}" && -f "${stamp}" ]] && [[ "$(check)" == "${SGLANG_VERSION}" ]]; then
    echo "install_sglang: sglang ${SGLANG_VERSION} already usable in ${VENV}; nothing to do"
    exit 0
fi

start=$(date +%s)
if [[ ! -x "${PY}" ]]; then
    echo "install_sglang: creating ${VENV} with ${PYTHON}"
    "${PYTHON}" -m venv "${VENV}"
fi
PIP=("${PY}" -m pip install --disable-pip-version-check -q -c "${CONSTRAINTS}")
# pip's resolver lists every sglang requirement left out on purpose (CUDA kernels,
# the serving stack): expected here, so those lines are dropped.
quiet() {
    grep -v -e "is ignored: it is neither" -e "^sglang .* requires " \
        -e "^ERROR: pip's dependency resolver does not currently" || true
}

echo "install_sglang: ${TORCH_SPEC}"
"${PIP[@]}" "${TORCH_SPEC}" 2>&1 | quiet
echo "install_sglang: kvsdk (editable) with [test,redis]"
"${PIP[@]}" -e "${REPO_ROOT}[test,redis]" 2>&1 | quiet
echo "install_sglang: sglang==${SGLANG_VERSION} and ${TORCHVISION_SPEC} (--no-deps)"
"${PIP[@]}" --no-deps "sglang==${SGLANG_VERSION}" "${TORCHVISION_SPEC}" 2>&1 | quiet
echo "install_sglang: sglang's import dependencies"
"${PIP[@]}" "${SGLANG_IMPORT_DEPS[@]}" 2>&1 | quiet

# Step 4: the torchvision op-schema shim, loaded by every process of this venv.
SITE="$("${PY}" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cat > "${SITE}/_kvsdk_torchvision_shim.py" <<'PYEOF'
"""Defines torchvision's C-op schemas before torchvision is imported.

Written by kvsdk's scripts/install_sglang.sh into the .venv-sglang venv only.
PyPI's torchvision wheel cannot load its compiled ops beside the CPU build of
torch ("operator torchvision::nms does not exist"), and SGLang imports
torchvision at import time. This hook waits for the first `import torchvision`
(so plain processes never import torch because of it), then registers the two
schemas torchvision's meta registrations expect. Nothing here runs an op.
"""

import importlib.abc
import sys


def _define_schemas() -> None:
    import torch

    try:
        torch.ops.torchvision.nms.default  # noqa: B018  (real ops loaded)
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define(
        "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
    )
    sys.modules[__name__]._lib = lib  # keep the registration alive


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        try:
            _define_schemas()
        except Exception:  # the shim must never break an import
            pass
        return None  # let the normal finders load torchvision


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
PYEOF
echo "import _kvsdk_torchvision_shim" > "${SITE}/_kvsdk_torchvision_shim.pth"

current="$(check)"
if [[ "${current}" != "${SGLANG_VERSION}" ]]; then
    echo "install_sglang: the SGLang imports fail after install:" >&2
    (cd / && "${PY}" -c "${CHECK_IMPORTS}") || true
    exit 1
fi
rm -f "${VENV}"/.kvsdk-sglang-*
touch "${stamp}"
echo "install_sglang: sglang ${current} ready in ${VENV} ($(( $(date +%s) - start )) s)"
