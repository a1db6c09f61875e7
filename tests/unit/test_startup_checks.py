"""What a user meets at start-up, before an engine builds anything: the vLLM
adapter's version range and host-tier floor, and ``kvsdk config check``'s
sentences and exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsdk.cli import main
from kvsdk.config import ConfigError, load_config
from kvsdk.plugins.vllm import SUPPORTED_VLLM, load_vllm_config, vllm_version_problem


@pytest.mark.parametrize(
    "version", ["0.32.0", "0.32.1", "0.32.0+cpu", "0.32.1rc1", "0.33.0", "0.33.2", "0.33.0+cu130"]
)
def test_supported_vllm_versions(version: str) -> None:
    assert vllm_version_problem(version) is None


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "0.34.0rc1", "1.0.0", "dev"])
def test_unsupported_vllm_version_is_one_sentence_naming_it(version: str) -> None:
    problem = vllm_version_problem(version)
    assert problem is not None
    assert f"this is vLLM {version}" in problem and "kvsdk supports vLLM >=0.32.0,<0.34" in problem
    assert problem.count(". ") == 0 and "\n" not in problem


def test_the_vllm_range_is_stated_once_everywhere() -> None:
    """The start-up check, the ``[vllm]`` extra and the install scripts name one range."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    spec = ",".join(SUPPORTED_VLLM)
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert extras["optional-dependencies"]["vllm"] == [f"vllm{spec}"]
    for script, pin in (("install_vllm.sh", "0.32.0"), ("install_vllm033.sh", "0.33.0")):
        text = (root / "scripts" / script).read_text()
        assert f'VLLM_VERSION="{pin}"' in text, script
        assert vllm_version_problem(pin) is None
        assert f"SUPPORTED_VLLM {spec}" in text, script


def test_vllm_refuses_a_host_tier_without_a_unit() -> None:
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.capacity: got 8 bytes; .* e\.g\. 8GiB$"):
        load_vllm_config({"tiers": [{"backend": "cpu", "capacity": 8}]})
    assert load_vllm_config({"tiers": [{"backend": "cpu", "capacity": "1MiB"}]})


def test_top_level_typo_lists_tiers_and_tenant_quotas() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config({"tier": [{"backend": "cpu"}]})
    msg = str(exc.value)
    assert "tiers" in msg and "tenant_quotas" in msg and "did you mean 'tiers'?" in msg


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvsdk.yaml"
    path.write_text(text)
    return str(path)


def test_config_check_warns_about_a_tier_too_small_for_a_chunk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, "tiers:\n  - backend: cpu\n    capacity: 8\n")
    assert main(["config", "check", path]) == 0
    err = capsys.readouterr().err
    assert f"{path}: warning: tiers[0].capacity: 8 bytes holds no chunk" in err
    assert main(["config", "check", "--engine", "vllm", path]) == 2
    assert "tiers[0].capacity: got 8 bytes" in capsys.readouterr().err
