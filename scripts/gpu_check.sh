#!/usr/bin/env bash
# GPU checks of the CUDA transfer worker, in one command, on a GPU host that
# has python3 with torch, numpy and pytest (no package registry, no install):
# kvsdk is imported from a copy of this source tree laid out as installed
# (kvsdk/ with plugins/ and backends/ under it, as pyproject's package-dir maps them).
#
#   scripts/gpu_check.sh            # ~3-5 minutes on an H200; hard limit below 8
#
# Runs: the CPU tests of the worker's parts, the CUDA tests (tests/gpu, marked
# cuda), and the bandwidth benchmark (fused layout, all sizes; FlashAttention
# K/V-split-on-dim-0 layout, four sizes). Results land in out/ (and in $OUT
# when that is set); the exit status is non-zero if any step failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
tree=out/gpu-tree
rm -rf "$tree" && mkdir -p "$tree"
cp -r kvsdk "$tree/kvsdk" && cp -r plugins "$tree/kvsdk/plugins" && cp -r backends "$tree/kvsdk/backends"
export PYTHONPATH="$PWD/$tree${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1   # the root's kvsdk/ is the core alone: never import it from there
export PYTHONUNBUFFERED=1
mkdir -p out
failed=()

step() {  # step NAME TIMEOUT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    echo
    echo "== $name: $*  (limit ${limit}s)"
    local t0=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0))s"
    [[ $rc -eq 0 ]] || failed+=("$name (exit $rc)")
}

echo "== host"
$PY - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device:", p.name, f"{p.total_memory / 2**30:.0f} GiB,", p.multi_processor_count, "SMs")
else:
    print("NO CUDA DEVICE: the cuda tests will skip and the benchmark will refuse")
EOF
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current \
    --format=csv 2>/dev/null || echo "(nvidia-smi not available)"

step "import from the source tree (as installed)" 60 $PY -c \
    "import kvsdk, kvsdk.transfer.layout, kvsdk.transfer.cuda as t; print('kvsdk', kvsdk.__version__, 'from', kvsdk.__file__); print('worker:', t.CUDATransferWorker.name)"
step "CPU tests of the worker's parts" 120 $PY -m pytest -q -p no:cacheprovider \
    tests/unit/test_kv_layout.py tests/unit/test_transfer_cuda_cpu_parts.py
step "CUDA tests" 240 $PY -m pytest -q -p no:cacheprovider -rs -s -m cuda tests/gpu \
    --junitxml=out/gpu_tests.xml
step "benchmark, fused layout" 180 $PY benchmarks/bench_cuda_copy.py --layout fused --out out
step "benchmark, K/V split on dim 0" 90 $PY benchmarks/bench_cuda_copy.py --layout kv_dim0 \
    --sizes 65536,262144,1048576,4194304 --total-mib 128 --repeats 3 --out out/kv_dim0

if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then
    cp out/bench_cuda_copy.json out/bench_cuda_copy.png out/gpu_tests.xml "$OUT"/ 2>/dev/null
    for f in out/kv_dim0/bench_cuda_copy.json out/kv_dim0/bench_cuda_copy.png; do
        [[ -f $f ]] && cp "$f" "$OUT/kv_dim0_$(basename "$f")"
    done
    echo "copied results to $OUT"
fi
echo
if ((${#failed[@]})); then
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu_check: all steps passed"
