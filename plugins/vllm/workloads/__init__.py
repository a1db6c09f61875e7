"""Workloads that drive a real vLLM engine with kvsdk: the demo, the fault soak,
the multi-round serve benchmark, the seeded tiny models they run, and the
probes that read the engine's state from other processes.

None of it is part of the connector: ``KVSDKConnector`` runs without this
package, and nothing here imports vLLM or changes the environment at import
time. Each run sets vLLM-CPU's environment defaults (:func:`use_cpu_engine_defaults`)
right before it builds an engine.
"""

from __future__ import annotations

import os


def use_cpu_engine_defaults(kv_cache_gib: int) -> None:
    """vLLM-CPU settings for kvsdk's workloads, unless the caller set them.

    No OpenMP thread pinning (the machine is shared; pinned threads contend),
    and a KV cache of ``kv_cache_gib`` GiB. Engine processes inherit them.
    """
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))


def engine_block_size(model: str, *, max_model_len: int) -> int:
    """The KV block size vLLM picks for ``model`` when none is given (its
    platform's default: 128 tokens on vLLM-CPU for Llama-like models), so that a
    workload can size a KV budget in whole blocks before building the engine."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=max_model_len,
    )
    return int(args.create_engine_config().cache_config.block_size)
