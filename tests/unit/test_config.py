"""Config loading: units, defaults, immutability, JSON Schema, and a corpus of
broken files that must each fail with one sentence naming the key path.

Each file in ``tests/data/bad_configs`` starts with comment lines saying what
the error must contain::

    # path: tiers[1].capacity          the message starts with this key path
    # mentions: '8 XB' | 512MiB        substrings the message must contain
    # needs: test-backend              (optional) register a non-host backend first
    # xfail: why                       (optional) a known bug this file documents
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvsdk import plugins_manager
from kvsdk.backend import Backend, Buffer
from kvsdk.config import (
    AdmissionConfig,
    ConfigError,
    KVSDKConfig,
    json_schema,
    load_config,
    parse_size,
)
from kvsdk.hooks import hookimpl
from kvsdk.types import ChunkKey, Locality, Medium

BAD_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "bad_configs"

GOOD_CONFIGS: dict[str, str] = {
    "empty": "",
    "one_cpu_tier": "tiers:\n  - backend: cpu\n    capacity: 512MiB\n",
    "everything": """
tiers:
  - backend: cpu
    capacity: 8GiB
    pin_memory: never
chunk_tokens: 512
eviction: arc
admission:
  min_lookups: 2
transfer: cpu
max_load_tokens: 65536
tenant: team-a
model_id: sha256:abc
io_threads: 2
metrics:
  prometheus_port: 9400
events:
  enabled: false
  max_pending: 1000
""",
    "integer_capacity": "tiers:\n  - backend: cpu\n    capacity: 1073741824\n",
    "decimal_units": "tiers:\n  - backend: cpu\n    capacity: 1.5GB\n",
    "nulls_where_allowed": "max_load_tokens: null\nmodel_id: null\n",
}


# -- the bad-config corpus -----------------------------------------------------------------


@dataclass(frozen=True)
class Expectation:
    path: str
    mentions: tuple[str, ...]
    needs_test_backend: bool
    xfail: str | None


def _expectation(file: Path) -> Expectation:
    header: dict[str, str] = {}
    for line in file.read_text().splitlines():
        if not line.startswith("# "):
            break
        name, _, value = line[2:].partition(":")
        header[name.strip()] = value.strip()
    assert "path" in header, f"{file.name}: header lacks '# path:'"
    mentions = tuple(m.strip() for m in header.get("mentions", "").split(" | ") if m.strip())
    return Expectation(
        path=header["path"],
        mentions=mentions,
        needs_test_backend=header.get("needs") == "test-backend",
        xfail=header.get("xfail"),
    )


def _corpus() -> list[Any]:
    params = []
    for file in sorted(BAD_CONFIGS.glob("*.yaml")):
        exp = _expectation(file)
        marks = [pytest.mark.xfail(strict=True, reason=exp.xfail)] if exp.xfail else []
        params.append(pytest.param(file, exp, id=file.stem, marks=marks))
    return params


class RemoteOnlyBackend(Backend):
    """A non-host tier, so a config can put one first (no built-in one exists yet)."""

    name = "kvsdk-test-remote"
    medium = Medium.REMOTE
    locality = Locality.CLUSTER

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [False] * len(keys)

    def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        return [None] * len(keys)

    def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return [False] * len(items)

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        return 0

    def clear(self) -> None:
        return None


class _TestBackendPlugin:
    @hookimpl
    def kvsdk_backends(self) -> dict[str, type[Backend]]:
        return {RemoteOnlyBackend.name: RemoteOnlyBackend}


@pytest.fixture
def test_backend() -> Iterator[None]:
    pm = plugins_manager.plugin_manager()
    plugin = _TestBackendPlugin()
    pm.register(plugin, name="kvsdk-test-backend")
    try:
        yield
    finally:
        pm.unregister(plugin)


def test_corpus_has_at_least_fifteen_broken_files() -> None:
    assert len(list(BAD_CONFIGS.glob("*.yaml"))) >= 15


@pytest.mark.parametrize(("file", "exp"), _corpus())
def test_bad_config_fails_with_one_line_naming_key_path_and_value(
    file: Path, exp: Expectation, request: pytest.FixtureRequest
) -> None:
    if exp.needs_test_backend:
        request.getfixturevalue("test_backend")
    with pytest.raises(ConfigError) as info:
        load_config(file)
    message = str(info.value)
    assert "\n" not in message, f"message spans lines: {message!r}"
    assert message.lstrip("'\"").startswith(exp.path), message
    for fragment in exp.mentions:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_unknown_backend_message_lists_every_installed_backend() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"tiers": [{"backend": "nosuchstore"}]})
    message = str(info.value)
    assert "'nosuchstore'" in message
    for name in plugins_manager.backends():
        assert name in message


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.yaml")


# -- the CLI: exit code 2, one line on stderr, no traceback --------------------------------

CLI_SAMPLE = ("invalid_yaml_syntax", "top_level_list", "size_unknown_unit")
"""One file per kind of failure (YAML syntax, structure, a value at a key path).
The CLI reuses ``load_config`` and every run imports torch (~1.5 s of CPU), so
the whole corpus goes through ``load_config`` above, not through the CLI."""


def _cli() -> str:
    script = shutil.which("kvsdk", path=str(Path(sys.executable).parent))
    assert script is not None, "the kvsdk console script is not installed (pip install -e .)"
    return script


def test_cli_config_check_prints_one_line_and_exits_2() -> None:
    script = _cli()
    procs = {
        stem: subprocess.Popen(
            [script, "config", "check", str(BAD_CONFIGS / f"{stem}.yaml")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for stem in CLI_SAMPLE
    }
    for stem, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        exp = _expectation(BAD_CONFIGS / f"{stem}.yaml")
        assert proc.returncode == 2, (stem, proc.returncode, out, err)
        assert "Traceback" not in err, (stem, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1, (stem, err)
        assert exp.path in lines[0], (stem, lines[0])


def test_cli_config_check_accepts_a_good_file(tmp_path: Path) -> None:
    script = _cli()
    good = tmp_path / "good.yaml"
    good.write_text(GOOD_CONFIGS["everything"])
    proc = subprocess.run(
        [script, "config", "check", str(good)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


# -- sizes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * 1024**2),
        ("8GiB", 8 * 1024**3),
        ("1.5GB", 1_500_000_000),
        ("1.5GiB", 3 * 1024**3 // 2),
        ("4 KiB", 4096),
        ("2k", 2000),
        ("100", 100),
        ("64b", 64),
        (" 1TiB ", 1024**4),
        (4096, 4096),
    ],
)
def test_parse_size_accepts_units_and_plain_integers(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["8 XB", "-1GiB", 0, -5, "0GiB", "", "GiB", "1e3", True, None, 1.5])
def test_parse_size_rejects_impossible_sizes(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(bad, "tiers[0].capacity")
    assert str(info.value).startswith("tiers[0].capacity: got ")
    assert repr(bad) in str(info.value)


def test_tier_capacity_accepts_units_through_load_config() -> None:
    cfg = load_config({"tiers": [{"backend": "cpu", "capacity": "512MiB"}]})
    assert cfg.tiers[0].options.capacity == 512 * 1024**2


# -- defaults and immutability ----------------------------------------------------------------


def test_defaults_from_none_empty_yaml_and_empty_mapping_agree() -> None:
    assert load_config(None) == load_config("") == load_config({})


def test_defaults() -> None:
    cfg = load_config(None)
    assert cfg.chunk_tokens is None  # the engine's block size
    assert cfg.eviction == "lru"
    assert cfg.transfer == "auto"
    assert cfg.admission.min_lookups == 0
    assert cfg.max_load_tokens is None
    assert cfg.tenant == ""
    assert cfg.events.enabled is True
    assert cfg.metrics.prometheus_port is None
    assert [t.backend for t in cfg.tiers] == ["cpu"]
    assert cfg.tiers[0].options.capacity == 4 * 1024**3


def test_every_option_of_a_full_file_is_read() -> None:
    cfg = load_config(GOOD_CONFIGS["everything"])
    assert cfg.tiers[0].options.capacity == 8 * 1024**3
    assert cfg.tiers[0].options.pin_memory == "never"
    assert cfg.chunk_tokens == 512
    assert cfg.eviction == "arc"
    assert cfg.admission == AdmissionConfig(min_lookups=2)
    assert cfg.transfer == "cpu"
    assert cfg.max_load_tokens == 65536
    assert cfg.tenant == "team-a"
    assert cfg.model_id == "sha256:abc"
    assert cfg.io_threads == 2
    assert cfg.metrics.prometheus_port == 9400
    assert (cfg.events.enabled, cfg.events.max_pending) == (False, 1000)


def test_yaml_file_path_string_and_mapping_give_equal_configs(tmp_path: Path) -> None:
    file = tmp_path / "kvsdk.yaml"
    file.write_text(GOOD_CONFIGS["everything"])
    mapping = yaml.safe_load(GOOD_CONFIGS["everything"])
    assert load_config(file) == load_config(str(file)) == load_config(mapping)


def test_config_is_immutable() -> None:
    cfg = load_config(GOOD_CONFIGS["everything"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.chunk_tokens = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.admission.min_lookups = 9  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tiers[0].options.capacity = 1
    assert isinstance(cfg.tiers, tuple)
    hash(cfg)  # frozen all the way down: usable as a dict key


def test_loading_does_not_alias_the_callers_mapping() -> None:
    data: dict[str, Any] = {"tiers": [{"backend": "cpu", "capacity": "1GiB"}]}
    cfg = load_config(data)
    data["tiers"][0]["capacity"] = "2GiB"
    data["tiers"].append({"backend": "cpu"})
    assert len(cfg.tiers) == 1
    assert cfg.tiers[0].options.capacity == 1024**3


def test_kvsdkconfig_is_the_loaded_type() -> None:
    assert isinstance(load_config(None), KVSDKConfig)


# -- JSON Schema ------------------------------------------------------------------------------


def test_json_schema_is_json_serialisable() -> None:
    schema = json.loads(json.dumps(json_schema()))
    assert schema["type"] == "object"
    assert "tiers" in schema["properties"]


def test_json_schema_is_a_valid_draft_2020_12_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(json_schema())


@pytest.mark.parametrize("name", sorted(GOOD_CONFIGS))
def test_json_schema_accepts_every_good_config(name: str) -> None:
    data = yaml.safe_load(GOOD_CONFIGS[name]) or {}
    load_config(data)  # the loader agrees it is good
    jsonschema.Draft202012Validator(json_schema()).validate(data)


@pytest.mark.parametrize(
    "bad",
    [
        {"chunk_token": 256},
        {"tiers": []},
        {"tiers": [{"backend": "cpu", "capasity": "1GiB"}]},
        {"tiers": [{"backend": "nosuchstore"}]},
        {"tiers": [{"backend": "cpu", "capacity": "8 XB"}]},
        {"tiers": [{"backend": "cpu", "capacity": 0}]},
        {"chunk_tokens": "256"},
        {"events": {"enabled": "maybe"}},
    ],
    ids=str,
)
def test_json_schema_rejects_bad_configs(bad: dict[str, Any]) -> None:
    validator = jsonschema.Draft202012Validator(json_schema())
    assert not validator.is_valid(bad)
    with pytest.raises(ConfigError):
        load_config(bad)


def test_json_schema_accepts_every_size_the_loader_accepts() -> None:
    validator = jsonschema.Draft202012Validator(json_schema())
    for size in ["512MiB", "8GiB", "1.5GB", "4 KiB", "2k", "100", "8GIB", "1MIB"]:
        data = {"tiers": [{"backend": "cpu", "capacity": size}]}
        load_config(data)
        assert validator.is_valid(data), size
