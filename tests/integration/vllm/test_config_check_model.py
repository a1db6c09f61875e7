"""``kvsdk config check --engine vllm --model DIR``: the host tier against one
chunk of that model, on vLLM's own config classes and the adapter's own
geometry (a real tiny Llama directory; no weights loaded, no engine started).

The expected bytes are derived here independently: K and V x layers x KV
heads x head dim x dtype bytes x tokens per chunk, with vLLM-CPU's default
block size (128; 16 on a GPU build). ``test_openai_server.py`` checks the
same number against what the adapter logs in a running server. It runs on
vLLM-CPU 0.32 and on vLLM 0.33's Python (``scripts/test.sh``): 0.33 picks the
CPU block size only when its executor starts, so a ``VllmConfig`` alone says
16 there, and the check must apply the platform's rule itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.platforms import current_platform

from kvsdk.cli import main

pytestmark = pytest.mark.integration

LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 64  # make_tiny_llama: hidden 256 / 4 heads
BLOCK = 128 if current_platform.is_cpu() else 16  # what vLLM picks when none is set


def kv_bytes_per_token(dtype_bytes: int) -> int:
    return 2 * LAYERS * KV_HEADS * HEAD_DIM * dtype_bytes


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvsdk.plugins.vllm.workloads.tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("check-model") / "tiny-llama", seed=0)


def check(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, config: str, *args: str
) -> tuple[int, str, list[str]]:
    path = tmp_path / "kvsdk.yaml"
    path.write_text(config)
    rc = main(["config", "check", "--engine", "vllm", *args, str(path)])
    out, err = capsys.readouterr()
    return rc, out, err.splitlines()


HOST = "tiers:\n  - backend: cpu\n    capacity: {}\n"


def test_the_chunk_of_a_model_is_computed_as_the_adapter_does(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = check(capsys, tmp_path, HOST.format("256MiB"), "--model", str(model),
                         "--dtype", "float32")  # fmt: skip
    chunk = kv_bytes_per_token(4) * BLOCK
    assert rc == 0 and err == [], err
    assert f"one chunk of {model} is {chunk} bytes ({BLOCK} tokens x " in out, out
    assert f"the host tier holds {(256 << 20) // chunk}" in out

    rc, out, _ = check(capsys, tmp_path, HOST.format("256MiB"), "--model", str(model),
                       "--dtype", "float32", "--block-size", "32")  # fmt: skip
    assert rc == 0 and f"is {kv_bytes_per_token(4) * 32} bytes (32 tokens x " in out, out

    # chunk_tokens set: that many tokens per chunk; dtype bfloat16: half the bytes
    config = "chunk_tokens: 512\n" + HOST.format("256MiB")
    rc, out, _ = check(capsys, tmp_path, config, "--model", str(model), "--dtype", "bfloat16")
    assert rc == 0 and f"is {kv_bytes_per_token(2) * 512} bytes (512 tokens x " in out, out


def test_a_host_tier_smaller_than_one_chunk_is_refused_in_one_line(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chunk = kv_bytes_per_token(4) * 512  # 2 MiB: above the 1 MiB floor every host tier needs
    config = "chunk_tokens: 512\n" + HOST.format("1MiB")
    rc, out, err = check(capsys, tmp_path, config, "--model", str(model), "--dtype", "float32")
    assert rc == 2 and out == "" and len(err) == 1, err
    assert (
        f"tiers[0].capacity: got {1 << 20} bytes; one chunk of {model} is {chunk} bytes" in err[0]
    )
    assert f"at least {chunk} bytes (2MiB)" in err[0]

    # without --model the same file passes: the chunk size is not known there
    assert check(capsys, tmp_path, config)[0] == 0
    config = "chunk_tokens: 512\n" + HOST.format("2MiB")  # exactly one chunk
    assert check(capsys, tmp_path, config, "--model", str(model), "--dtype", "float32")[0] == 0


def test_model_arguments_that_cannot_work_are_refused_in_one_line(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = HOST.format("256MiB")
    rc, _, err = check(capsys, tmp_path, config, "--model", str(tmp_path))  # no config.json
    assert (
        rc == 2
        and len(err) == 1
        and "expected a local model directory with a config.json" in err[0]
    )

    path = tmp_path / "plain.yaml"
    path.write_text(config)
    assert main(["config", "check", "--model", str(model), str(path)]) == 2  # no --engine
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--model needs --engine vllm" in err[0], err

    rc, _, err = check(capsys, tmp_path, config, "--model", str(model), "--dtype", "int7")
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"{tmp_path / 'kvsdk.yaml'}: --model: ")


def test_without_model_a_tiny_disk_tier_still_gets_the_warning_naming_the_minimum(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = HOST.format("256MiB") + f"  - backend: disk\n    path: {tmp_path}\n    capacity: 8\n"
    rc, _, err = check(capsys, tmp_path, config)
    assert rc == 0 and len(err) == 1
    assert "tiers[1].capacity: 8 bytes holds no chunk of a real model" in err[0]
    assert "--engine vllm --model DIR gives a model's exact chunk size" in err[0]
