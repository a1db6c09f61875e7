"""Config values an attacker or a tired operator writes: refused when the config is
read, in one sentence, never echoing a credential, never a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvsdk.cli import main
from kvsdk.config import ConfigError, load_config
from kvsdk.plugins.vllm import load_vllm_config


def _check(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    path = tmp_path / "kvsdk.yaml"
    path.write_text(text)
    rc = main(["config", "check", str(path)])
    err = capsys.readouterr().err
    return rc, err


REDIS = (
    "tiers:\n  - backend: cpu\n    capacity: 1GiB\n  - backend: redis\n    url: redis://h:6379\n"
)


@pytest.mark.parametrize(
    "value", ["123456789", "[hunter2hunter2]", "{p: hunter2hunter2}", "true", "12.5"]
)
def test_a_password_of_any_type_is_never_echoed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    rc, err = _check(tmp_path, REDIS + f"    password: {value}\n", capsys)
    assert rc == 2
    assert "tiers[1].password: got a " in err and "(not shown: it holds a credential)" in err
    for secret in ("123456789", "hunter2", "12.5", "True"):
        assert secret not in err, err


def test_a_credential_inside_a_misplaced_mapping_is_masked() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"tiers": {"backend": "redis", "password": "hunter2hunter2"}})
    assert "hunter2" not in str(info.value) and "'password': '***'" in str(info.value)


@pytest.mark.parametrize("capacity", ["1" + "0" * 400, "1" + "0" * 400 + "GiB", "2EiB", "9e999"])
def test_an_overlong_capacity_is_one_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], capacity: str
) -> None:
    rc, err = _check(tmp_path, f"tiers:\n  - backend: cpu\n    capacity: {capacity}\n", capsys)
    assert rc == 2
    assert err.count("\n") == 1 and "tiers[0].capacity: got " in err, err
    assert "expected" in err and "Traceback" not in err


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "1" + "0" * 400])
def test_a_timeout_that_is_not_a_finite_number_is_refused_when_read(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.socket_timeout: got .*; expected a"):
        load_config(REDIS + f"    socket_timeout: {value}\n")


def test_an_integer_past_64_bits_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^io_threads: got 1000.*; expected a 64-bit integer$"):
        load_config({"io_threads": 10**30})


def _secret(tmp_path: Path, material: bytes) -> Path:
    path = tmp_path / "secret"
    path.write_bytes(material)
    os.chmod(path, 0o600)
    return path


@pytest.mark.parametrize(
    ("material", "says"),
    [
        (b"short-secret", "12 bytes; expected at least 16"),
        (b"a" * 32, "1 distinct bytes in 32; expected at least 6"),
        (b"abab" * 8, "2 distinct bytes in 32"),
    ],
)
def test_a_weak_secret_is_refused_by_config_check_and_before_the_engine_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], material: bytes, says: str
) -> None:
    secret = _secret(tmp_path, material)
    rc, err = _check(tmp_path, f"secret_file: {secret}\n", capsys)
    assert rc == 2 and says in err and err.count("\n") == 1, err
    assert material.decode() not in err
    with pytest.raises(ConfigError, match=says):  # vLLM's pre-start check (KVTransferConfig)
        load_vllm_config({"secret_file": str(secret)})


def test_a_random_secret_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    secret = _secret(tmp_path, os.urandom(16).hex().encode())
    rc, err = _check(tmp_path, f"secret_file: {secret}\n", capsys)
    assert rc == 0, err


def test_a_weak_secret_in_the_environment_is_named_by_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSDK_SECRET", "x" * 40)
    with pytest.raises(ConfigError, match=r"^KVSDK_SECRET: 1 distinct bytes in 40"):
        load_config({})
