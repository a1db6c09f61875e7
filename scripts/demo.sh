#!/usr/bin/env bash
# The main job on a fresh machine. Until the vLLM adapter lands this is the core
# benchmark: the whole core driven by a synthetic paged-KV engine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
exec .venv/bin/kvsdk bench core "$@"
