"""Engine adapters (``kvsdk.plugins.vllm``, ``kvsdk.plugins.sglang``)."""
