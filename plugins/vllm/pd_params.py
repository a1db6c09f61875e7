"""Prefill/decode disaggregation: vLLM's ``kv_role`` and the ``kv_transfer_params``
kvsdk's connector exchanges through a P/D router.

The protocol (what vLLM's P/D proxies and ``vllm-router --vllm-pd-disaggregation``
do; the router forwards the prefill response's ``kv_transfer_params`` verbatim):

1. The router sends the prompt to the prefill engine (``kv_role: kv_producer``)
   with ``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode": true, ...}``.
2. The prefill engine stores every chunk of the prompt (its tail included) into
   its tiers, and its response's ``kv_transfer_params`` carry a :class:`Handoff`
   under the key ``"kvsdk"``: the namespace the chunks are keyed under, the
   prompt tokens they cover and a readiness token (a digest of their keys).
3. The router sends the request to the decode engine (``kv_role: kv_consumer``)
   with those params. The decode engine checks the namespace and the digest
   against its own keys for the prompt, then waits, bounded by ``pd.wait_s`` and
   without blocking its scheduler (vLLM is told "ask again"), until the chunks
   are readable in a tier both engines share, and loads them. A foreign
   namespace, a digest that differs, or the deadline passing: it loads only what
   its own lookup verifies and recomputes the rest (each counted in
   ``kvsdk_pd_handoffs_total`` by outcome).

``do_remote_prefill`` is left false in the returned params on purpose: with it
true, vLLM reports the prefill engine's cache hits as the decode response's
``cached_tokens``; without it the decode engine reports what it loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvsdk.config import KVSDKConfig

HANDOFF_KEY = "kvsdk"
"""The key of kvsdk's hand-off in ``kv_transfer_params``."""

HANDOFF_VERSION = 1


class Role(Enum):
    BOTH = "kv_both"
    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"


def engine_role(kv_role: object, cfg: KVSDKConfig) -> Role:
    """The engine's role from vLLM's ``kv_transfer_config.kv_role`` (unset: ``kv_both``).
    Raises ValueError with one sentence for a role kvsdk does not know, or a
    producer or consumer without a tier another engine can read."""
    if kv_role is None:
        return Role.BOTH
    try:
        role = Role(kv_role)
    except ValueError:
        known = ", ".join(r.value for r in Role)
        raise ValueError(
            f"kv_role {kv_role!r} is not supported by kvsdk; expected {known}"
        ) from None
    if role is not Role.BOTH and len(cfg.tiers) < 2:
        raise ValueError(
            f"kv_role {role.value!r} needs a tier both engines read (disk, redis, mooncake) "
            "after the host tier; the config has only the engine-private host tier"
        )
    return role


@dataclass(frozen=True)
class Handoff:
    namespace: str
    """Hex of the fingerprint the chunks are keyed under."""
    tokens: int
    """Prompt tokens the stored chunks cover (from the first)."""
    ready: str
    """Hex digest of the chunks' keys (see ``OffloadScheduler.handoff_digest``)."""

    def params(self) -> dict[str, Any]:
        """The prefill response's ``kv_transfer_params``."""
        return {
            "do_remote_decode": False,
            "do_remote_prefill": False,
            HANDOFF_KEY: {
                "v": HANDOFF_VERSION,
                "namespace": self.namespace,
                "tokens": self.tokens,
                "ready": self.ready,
            },
        }


def wants_remote_decode(params: object) -> bool:
    """Whether a request's ``kv_transfer_params`` ask for a remote decode (a P/D prefill)."""
    return isinstance(params, Mapping) and params.get("do_remote_decode") is True


def parse_handoff(params: object) -> Handoff | str | None:
    """The hand-off a decode request carries; None where it carries none; a
    sentence saying what is wrong where the ``"kvsdk"`` entry is malformed."""
    if not isinstance(params, Mapping) or HANDOFF_KEY not in params:
        return None
    h = params[HANDOFF_KEY]
    if not isinstance(h, Mapping):
        return f"kv_transfer_params.{HANDOFF_KEY}: got {type(h).__name__}; expected an object"
    if h.get("v") != HANDOFF_VERSION:
        return f"kv_transfer_params.{HANDOFF_KEY}.v: got {h.get('v')!r}; expected {HANDOFF_VERSION}"
    ns, tokens, ready = h.get("namespace"), h.get("tokens"), h.get("ready")
    if not isinstance(ns, str) or not isinstance(ready, str):
        return f"kv_transfer_params.{HANDOFF_KEY}: namespace and ready must be strings"
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        return f"kv_transfer_params.{HANDOFF_KEY}.tokens: got {tokens!r}; expected an integer >= 0"
    return Handoff(ns, tokens, ready)
