"""Fixtures of the vLLM integration tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def router() -> str:
    """``vllm-router`` beside this interpreter, installed by
    ``scripts/install_vllm_router.sh`` when missing (a failed install fails)."""
    exe = Path(sys.executable).with_name("vllm-router")
    if not exe.exists():
        venv = Path(sys.executable).parent.parent
        res = subprocess.run(
            [str(ROOT / "scripts/install_vllm_router.sh")],
            env={**os.environ, "VENV": str(venv)},
            capture_output=True,
            text=True,
            timeout=600,
        )
        if res.returncode != 0 or not exe.exists():
            pytest.fail(f"vllm-router cannot be installed: {(res.stderr or res.stdout)[-500:]}")
    return str(exe)
