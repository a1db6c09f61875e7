"""Configuration: YAML (or a dict) → typed, validated, immutable objects.

Every error is one :class:`ConfigError` sentence naming the key path, the
value and what was expected, e.g.::

    tiers[1].capacity: got '8 GB'; expected a size such as 512MiB or 8GiB

Backend options are each backend's own frozen ``Options`` dataclass,
validated by the same code; an ``int`` field whose metadata says
``{"unit": "bytes"}`` accepts sizes with units.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from kvsdk import plugins_manager

BYTES = {"unit": "bytes"}

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


MAX_BYTES = 1 << 60
"""The largest size a config accepts (1 EiB): past it a value is a typo."""
INT_RANGE = (-(1 << 63), (1 << 63) - 1)
"""Integers a config accepts: what the tiers and engines store them in."""
SECRET = {"secret": True}
"""Field metadata: the value holds a credential and never appears in an error."""
_SECRET_KEY = re.compile(r"passw|secret(?!_file)|credential|api_?key|token$", re.IGNORECASE)


class ConfigError(ValueError):
    """A configuration problem, stated in one sentence."""


def is_secret_key(key: str, meta: Mapping[str, Any] | None = None) -> bool:
    """Whether a key's value is a credential (field metadata :data:`SECRET`, or a
    name such as ``password``, ``token`` or ``api_key``)."""
    return bool(meta and meta.get("secret")) or bool(_SECRET_KEY.search(key))


def shown(value: Any, key: str = "", meta: Mapping[str, Any] | None = None) -> str:
    """``value`` as an error message may show it: a credential's value never (only
    its kind), and a mapping or list with any credential in it masked."""
    if is_secret_key(key.rsplit(".", 1)[-1], meta):
        kind = "null" if value is None else _KIND.get(type(value), type(value).__name__)
        return f"a {kind} (not shown: it holds a credential)"
    return repr(_masked(value))


_KIND = {
    bool: "boolean",
    int: "number",
    float: "number",
    str: "string",
    list: "list",
    dict: "mapping",
}


def _masked(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {
            k: "***" if isinstance(k, str) and is_secret_key(k) else _masked(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_masked(v) for v in value]
    return value


def parse_size(value: Any, path: str = "size") -> int:
    """``512MiB`` / ``8GiB`` / ``1.5GB`` / ``4096`` → bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{path}: got {value!r}; expected a size such as 512MiB or 8GiB")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE_RE.match(str(value)) if isinstance(value, str) else None
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(f"{path}: got {value!r}; expected a size such as 512MiB or 8GiB")
        number = float(m.group(1))
        if not number < MAX_BYTES:  # an overlong figure, before it becomes inf
            raise ConfigError(f"{path}: got {shown(value)[:40]}; expected at most 1EiB")
        n = int(number * _UNITS[unit])
    if n <= 0:
        raise ConfigError(f"{path}: got {value!r}; expected a positive size")
    if n > MAX_BYTES:
        raise ConfigError(f"{path}: got {shown(value)[:40]}; expected at most 1EiB")
    return n


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if isinstance(key, str) and key in seen:
            mark = key_node.start_mark
            raise ConfigError(
                f"{key}: given twice (line {mark.line + 1}); expected each key once per mapping"
            )
        if isinstance(key, str):
            seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


# -- the schema ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TierConfig:
    backend: str
    options: Any
    """The backend's own ``Options`` dataclass instance."""


ADMISSION_POLICIES = ("auto", "second_sight", "all")


@dataclass(frozen=True)
class AdmissionConfig:
    policy: str = "auto"
    """``all``: store every chunk. ``second_sight``: store every chunk while at
    least 1 in 32 of the chunks seen comes back, otherwise only the ones seen
    before (a prompt that never repeats is not copied; see ``kvsdk.admission``).
    ``auto``: ``second_sight`` where the host tier is the only tier (the
    default), ``all`` where there are slower tiers (disk, Redis, a plugin's:
    another engine, or this one after a restart, may read what it stores)."""
    min_lookups: int = 0
    """Store a chunk only after it was looked up this many times (0: always)."""


@dataclass(frozen=True)
class StoreBackoffConfig:
    after_failures: int = 3
    """Write batches a slower tier refuses in a row (it raised, or took none of
    the chunks: a full disk, a Redis out of memory or read-only) before kvsdk
    stops offering it stores for a while; reads go on. ``0``: never pause."""
    initial_s: float = 1.0
    """The first pause, in seconds; each refused probe after a pause doubles it."""
    max_s: float = 60.0
    """The longest pause, in seconds. A write the tier takes ends the back-off."""


@dataclass(frozen=True)
class MetricsConfig:
    prometheus_port: int | None = None
    """Serve Prometheus metrics on this port (needs ``prometheus-client``)."""


@dataclass(frozen=True)
class EventsConfig:
    enabled: bool = True
    """Record events (drained by the engine adapter and published to event sinks)."""
    max_pending: int = 100_000
    """Oldest undrained events are dropped (and counted) beyond this."""


@dataclass(frozen=True)
class PDConfig:
    wait_s: float = 5.0
    """Prefill/decode disaggregation (vLLM ``kv_role`` ``kv_producer`` /
    ``kv_consumer``): the longest a decode request carrying a prefill engine's
    hand-off waits, without blocking the scheduler, for the prompt's chunks to
    be readable in a shared tier; past it the rest is recomputed."""


@dataclass(frozen=True)
class KVSDKConfig:
    tiers: tuple[TierConfig, ...] = ()
    chunk_tokens: int | None = None
    """Offload unit in tokens: a multiple of the engine's block size, or unset
    (the default) for the engine's block size, so a hit is as fine-grained as
    the engine's own prefix cache. A larger unit means fewer, larger entries on
    disk and in Redis, at the cost of up to ``chunk_tokens - 1`` prompt tokens
    recomputed that the engine's block size would have served."""
    prompt_tail: bool = True
    """Store a prompt's last, partial chunk as an entry of its own, so a repeated
    prompt is served to its end and the engine recomputes one token instead of
    up to a block (full-attention models; prompts named by token ids alone).
    Outputs then equal the engine's own one-token recompute, not a longer one's.
    ``false``: a hit stops at the last whole chunk, as the engine's own cache."""
    prompt_tail_share: float = 0.125
    """Share of the host tier prompt tails may hold, in (0, 1]: over it, the
    least recently used tail makes room for a new one. A tail takes a whole
    slot and serves only an exact repeat of its prompt, where a whole chunk
    serves every prompt that extends it: tails never crowd the chunks out of
    the tier."""
    eviction: str = "lru"
    """Eviction policy of the tiers that evict locally: ``lru``, ``arc`` or a plugin's.
    Of chunks stored or used together, a prompt's later chunks leave before its
    first ones (every prompt with the prefix needs its head, only some its tail)."""
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    """When a chunk is worth storing."""
    transfer: str = "auto"
    """Transfer worker: ``auto`` picks ``cuda`` for CUDA tensors, else ``cpu``."""
    max_load_tokens: int | None = None
    """Per-request cap on tokens loaded from kvsdk (None: unlimited)."""
    tenant: str = ""
    """Salt mixed into the namespace: tenants never share chunks."""
    tenant_quotas: tuple[tuple[str, float], ...] = ()
    """Share of each tier a request tenant may hold (vLLM: the request's ``cache_salt``;
    ``""`` for unsalted requests; ``"*"``: every tenant not listed, together), e.g.
    ``{"*": 0.5, "acme": 0.25}``. Over its share, a tenant's own least recently
    used chunks go first. Unlisted tenants share the one ``"*"`` share and its accounting, so
    rotating ``cache_salt`` cannot add up shares, and the state kept is one
    account per listed tenant plus one. Slower tiers count what this instance
    wrote against their byte capacity (tiers without one, like Redis, are not
    shared out). Without ``"*"``, unlisted tenants have no limit."""
    model_id: str | None = None
    """Overrides the model identity the adapter derives (e.g. a weights digest)."""
    secret_file: str | None = None
    """File holding the deployment secret (owner-only, mode 0600) that authenticates
    frames and keys in shared tiers; or set ``KVSDK_SECRET`` (not both). See
    docs/security.md."""
    io_threads: int = 4
    """Threads that talk to the slower tiers."""
    lookup_wait_ms: float = 5.0
    """Time the scheduler may wait in one step, all requests together, for the
    slower tiers to say whether they hold a request's chunks (a disk's
    ``lstat``, a Redis ``EXISTS`` on a quiet server take well under it). An
    answer in time schedules a request that cannot hit at once; past it the
    request asks again at the next step (and loads what was found). While the
    tiers' recent answers took longer than this on average, the scheduler does
    not wait at all. Tiers with a local index (Redis) answer a chunk they
    surely lack without asking their server. ``0``: never wait: every lookup
    that misses host RAM defers its request a step."""
    promotion_wait_ms: float = 250.0
    """At most this long in one step, all requests together, the scheduler waits
    for chunks a request can hit in a slower tier to reach host RAM (their
    promotion), and never longer than the engine's recent steps took: a request
    whose promotion is not done is deferred a step, which costs it about a
    step, so waiting up to a step is never the worse choice for it; on a CPU
    engine the promotion takes its CPU from the step anyway. Past it the
    request asks again at the next step. ``0``: never wait."""
    store_backoff: StoreBackoffConfig = field(default_factory=StoreBackoffConfig)
    """Back-pressure from the slower tiers: pause stores to a tier that keeps refusing them."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Counters and histograms; an optional Prometheus endpoint."""
    events: EventsConfig = field(default_factory=EventsConfig)
    """Stored / removed / cleared events for KV-aware routers."""
    pd: PDConfig = field(default_factory=PDConfig)
    """Prefill/decode disaggregation through the shared tiers."""


DEFAULT_TIERS: tuple[dict[str, Any], ...] = ({"backend": "cpu", "capacity": "4GiB"},)


# -- validation ------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _coerce(value: Any, tp: Any, path: str, meta: Mapping[str, Any]) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _coerce(value, non_none[0], path, meta)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{path}: got {shown(value, path, meta)}; expected {_type_name(tp)}")
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _build(tp, value, path)
    if tp is int and meta.get("unit") == "bytes":
        return parse_size(value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not INT_RANGE[0] <= value <= INT_RANGE[1]:
                raise ConfigError(
                    f"{path}: got {shown(value, path, meta)[:40]}; expected a 64-bit integer"
                )
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, int) and not INT_RANGE[0] <= value <= INT_RANGE[1]:
                raise ConfigError(
                    f"{path}: got {shown(value, path, meta)[:40]}; expected a finite number"
                )
            if not math.isfinite(value):
                raise ConfigError(
                    f"{path}: got {shown(value, path, meta)}; expected a finite number"
                )
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is dict:
        if isinstance(value, Mapping):
            return dict(value)
    elif origin is tuple and isinstance(value, list | tuple):
        (item_tp, *_rest) = typing.get_args(tp)
        return tuple(_coerce(v, item_tp, f"{path}[{i}]", {}) for i, v in enumerate(value))
    else:
        return value
    raise ConfigError(f"{path}: got {shown(value, path, meta)}; expected {_type_name(tp)}")


def _unknown_key(path: str, key: str, allowed: list[str]) -> ConfigError:
    hint = difflib.get_close_matches(key, allowed, n=1)
    did = f" (did you mean {hint[0]!r}?)" if hint else ""
    name = key if key.isidentifier() else repr(key)
    return ConfigError(
        f"{path}{name}: unknown key; expected one of: {', '.join(sorted(allowed))}{did}"
    )


def _build(cls: type, data: Any, path: str, skip: tuple[str, ...] = ()) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'}: got {shown(data, path)}; expected a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in skip}
    prefix = f"{path}." if path else ""
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key in skip:
            continue
        if not isinstance(key, str) or key not in fields:
            raise _unknown_key(prefix, str(key), [*fields, *skip])
        kwargs[key] = _coerce(value, hints[key], prefix + key, fields[key].metadata)
    for name, f in fields.items():
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name not in kwargs and no_default:
            raise ConfigError(f"{prefix}{name}: missing; expected {_type_name(hints[name])}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{path or 'config'}: {exc}") from None


def _build_tier(item: Any, path: str, backends: Mapping[str, type]) -> TierConfig:
    if not isinstance(item, Mapping):
        raise ConfigError(f"{path}: got {shown(item)}; expected a mapping with a 'backend:' key")
    name = item.get("backend")
    if name is None:
        raise ConfigError(
            f"{path}.backend: missing; expected one of: {', '.join(sorted(backends))}"
        )
    if not isinstance(name, str) or name not in backends:
        raise ConfigError(
            f"{path}.backend: got {name!r}; expected an installed backend: "
            f"{', '.join(sorted(backends))}"
        )
    options_cls = getattr(backends[name], "Options", None)
    assert isinstance(options_cls, type) and dataclasses.is_dataclass(options_cls)
    options = _build(options_cls, {k: v for k, v in item.items() if k != "backend"}, path)
    return TierConfig(backend=name, options=options)


def build_tier_config(item: Any, path: str) -> TierConfig:
    """Validate one tier mapping (``backend:`` plus its options); for wrapper tiers."""
    return _build_tier(item, path, plugins_manager.backends())


def read_config_source(source: str | Path | Mapping[str, Any] | None) -> dict[str, Any]:
    """The raw mapping of a YAML path, a YAML string, a mapping, or None (empty)."""
    data: Any
    if source is None:
        data = {}
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        text = str(source)
        if isinstance(source, Path) or (
            "\n" not in text and Path(text).suffix in (".yaml", ".yml")
        ):
            path = Path(text)
            if not path.is_file():
                raise ConfigError(f"config: file {str(path)!r} not found")
            text = path.read_text()
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"config: invalid YAML{where}: {problem}") from None
        if data is None:
            data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config: got {shown(data)}; expected a mapping at the top level")
    return dict(data)


def load_config(
    source: str | Path | Mapping[str, Any] | None, *, require_host_tier: bool = True
) -> KVSDKConfig:
    """Build the config from a YAML path, a YAML string, a mapping, or None (defaults).

    ``require_host_tier=False`` is for engines that bring their own host tier
    (SGLang's HiCache host pool): then the tiers may start below host memory.
    """
    data = read_config_source(source)
    backends = plugins_manager.backends()
    raw_tiers = data.get("tiers", list(DEFAULT_TIERS))
    if not isinstance(raw_tiers, list) or not raw_tiers:
        raise ConfigError(
            f"tiers: got {shown(raw_tiers)}; expected a non-empty list of tier mappings"
        )
    tiers = tuple(_build_tier(t, f"tiers[{i}]", backends) for i, t in enumerate(raw_tiers))
    cfg: KVSDKConfig = _build(KVSDKConfig, data, "", skip=("tiers", "tenant_quotas"))
    cfg = dataclasses.replace(cfg, tiers=tiers, tenant_quotas=_tenant_quotas(data))
    _check(cfg, backends, require_host_tier=require_host_tier)
    from kvsdk.trust import load_secret  # trust builds on this module's ConfigError

    load_secret(cfg.secret_file)  # a missing, exposed, short or guessable secret: refused here
    return cfg


def _tenant_quotas(data: Mapping[str, Any]) -> tuple[tuple[str, float], ...]:
    quotas = data.get("tenant_quotas") or {}
    if not isinstance(quotas, Mapping):
        raise ConfigError(
            f"tenant_quotas: got {shown(quotas)}; expected a mapping of tenant to share, e.g. "
            "{'*': 0.5, 'acme': 0.25}"
        )
    out = []
    for name, share in quotas.items():
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise ConfigError(
                f"tenant_quotas.{name}: got {shown(share)}; expected a share of the tier in (0, 1]"
            )
        out.append((str(name), float(share)))
    return tuple(out)


def _check(
    cfg: KVSDKConfig, backends: Mapping[str, type], *, require_host_tier: bool = True
) -> None:
    from kvsdk.backend import HostTier

    if cfg.chunk_tokens is not None and cfg.chunk_tokens <= 0:
        raise ConfigError(
            f"chunk_tokens: got {cfg.chunk_tokens}; expected a positive integer "
            "(or leave it unset for the engine's block size)"
        )
    policies = plugins_manager.eviction_policies()
    if cfg.eviction not in policies:
        raise ConfigError(
            f"eviction: got {cfg.eviction!r}; expected one of: {', '.join(sorted(policies))}"
        )
    workers = ["auto", *plugins_manager.transfer_workers()]
    if cfg.transfer not in workers:
        raise ConfigError(f"transfer: got {cfg.transfer!r}; expected one of: {', '.join(workers)}")
    if require_host_tier and not issubclass(backends[cfg.tiers[0].backend], HostTier):
        hosts = sorted(n for n, b in backends.items() if issubclass(b, HostTier))
        raise ConfigError(
            f"tiers[0].backend: got {cfg.tiers[0].backend!r}; the first tier must be a "
            f"host-memory tier: {', '.join(hosts)}"
        )
    if cfg.max_load_tokens is not None and cfg.max_load_tokens <= 0:
        raise ConfigError(
            f"max_load_tokens: got {cfg.max_load_tokens}; expected a positive integer"
        )
    if not 0 < cfg.prompt_tail_share <= 1:
        raise ConfigError(
            f"prompt_tail_share: got {cfg.prompt_tail_share}; expected a share of the host "
            "tier in (0, 1]"
        )
    if cfg.admission.policy not in ADMISSION_POLICIES:
        raise ConfigError(
            f"admission.policy: got {cfg.admission.policy!r}; expected one of: "
            f"{', '.join(ADMISSION_POLICIES)}"
        )
    if cfg.admission.min_lookups < 0:
        raise ConfigError(
            f"admission.min_lookups: got {cfg.admission.min_lookups}; expected 0 or more"
        )
    port = cfg.metrics.prometheus_port
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError(f"metrics.prometheus_port: got {port}; expected a port from 1 to 65535")
    if cfg.events.max_pending < 1:
        raise ConfigError(f"events.max_pending: got {cfg.events.max_pending}; expected at least 1")
    if not 0 <= cfg.pd.wait_s <= 600:
        raise ConfigError(f"pd.wait_s: got {cfg.pd.wait_s}; expected seconds in [0, 600]")
    if cfg.io_threads < 1:
        raise ConfigError(f"io_threads: got {cfg.io_threads}; expected at least 1")
    backoff = cfg.store_backoff
    if backoff.after_failures < 0:
        raise ConfigError(
            f"store_backoff.after_failures: got {backoff.after_failures}; expected 0 or more"
        )
    if not 0 < backoff.initial_s <= 3600:
        raise ConfigError(
            f"store_backoff.initial_s: got {backoff.initial_s}; expected seconds in (0, 3600]"
        )
    if not backoff.initial_s <= backoff.max_s <= 86400:
        raise ConfigError(
            f"store_backoff.max_s: got {backoff.max_s}; expected seconds from "
            f"store_backoff.initial_s ({backoff.initial_s}) to 86400"
        )
    if not 0 <= cfg.lookup_wait_ms <= 1000:
        raise ConfigError(
            f"lookup_wait_ms: got {cfg.lookup_wait_ms}; expected milliseconds from 0 to 1000"
        )
    if not 0 <= cfg.promotion_wait_ms <= 10000:
        raise ConfigError(
            f"promotion_wait_ms: got {cfg.promotion_wait_ms}; expected milliseconds from 0 to 10000"
        )


# -- JSON Schema -----------------------------------------------------------------------------


def _schema_of(tp: Any, meta: Mapping[str, Any]) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_schema_of(a, meta) for a in typing.get_args(tp)]}
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    if tp is type(None):
        return {"type": "null"}
    if tp is int and meta.get("unit") == "bytes":
        return {
            "anyOf": [
                {"type": "integer", "minimum": 1},
                {
                    "type": "string",
                    "pattern": r"^\s*\d+(\.\d+)?\s*([kKmMgGtT][iI]?[bB]?|[bB])?\s*$",
                },
            ]
        }
    if typing.get_origin(tp) is dict:
        return {"type": "object"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _dataclass_schema(tp)
    return {}


def _dataclass_schema(cls: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {}
    required = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        props[f.name] = _schema_of(hints[f.name], f.metadata)
        if f.default is not dataclasses.MISSING and not dataclasses.is_dataclass(f.default):
            props[f.name]["default"] = f.default
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = required
    return out


def json_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of the config file, for editors and CI linting."""
    root = _dataclass_schema(KVSDKConfig, skip=("tiers",))
    root["properties"]["tenant_quotas"] = {
        "type": "object",
        "additionalProperties": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    }
    tier_variants = []
    for name, cls in sorted(plugins_manager.backends().items()):
        opt = _dataclass_schema(cls.Options)
        opt["properties"] = {"backend": {"const": name}, **opt["properties"]}
        opt["required"] = ["backend", *opt.get("required", [])]
        tier_variants.append(opt)
    root["properties"]["tiers"] = {
        "type": "array",
        "minItems": 1,
        "items": {"oneOf": tier_variants},
    }
    root["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    root["title"] = "kvsdk configuration"
    return root


def dump_json_schema() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=False)
