#!/usr/bin/env bash
# The main job on a fresh machine: real vLLM (CPU build here) with kvsdk's default
# host-RAM tier on a small local model, a shared-prefix workload cold and warm.
# Prints a table; writes out/demo.json and out/demo.png.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh vllm
exec .venv/bin/kvsdk demo "$@"
