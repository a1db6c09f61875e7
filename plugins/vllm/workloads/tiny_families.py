"""Tiny models of the families beyond plain attention, with seeded random
weights, for end-to-end tests on vLLM-CPU: a pure Mamba2 and a Granite 4.0-H
style hybrid (Mamba2 layers interleaved with attention), whose Mamba state
group vLLM keeps per block boundary in its 'align' prefix-caching mode, and
a Gemma3 (five sliding-window layers to one global, as Gemma3 ships).

The state-space parameters get the ranges their own initialisers use (decay
rates ``A = -exp(A_log)`` spread over 1..heads, skip ``D = 1``, zero ``dt``
bias): plain normal noise there would make the state blow up or vanish, and
then a wrong state would not show in the tokens. Everything else is normal
noise (std 0.1) from a generator seeded with ``seed``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvsdk.plugins.vllm.workloads.tiny_model import (
    MARKER_FILE,
    _save_random,
    gemma_embeddings,
    gemma_fill,
)

__all__ = ["MAMBA_BLOCK_TOKENS", "make_tiny_gemma3", "make_tiny_granite_hybrid", "make_tiny_mamba2"]

MAMBA_BLOCK_TOKENS = 256
"""vLLM-CPU's Mamba block (and attention block) size for these models in
float32. Its CPU scan kernel needs ``max_num_batched_tokens`` equal to it."""

_FORMAT_VERSION = 1


def _fill(name: str, p: Any, gen: Any) -> None:
    import torch

    if name.endswith("norm.weight") or name.endswith(".D"):
        p.fill_(1.0)
    elif name.endswith("A_log"):
        p.copy_(torch.log(torch.arange(1, p.numel() + 1, dtype=torch.float32)).view_as(p))
    elif name.endswith("dt_bias"):
        p.zero_()
    else:
        p.copy_(torch.empty(p.shape).normal_(0.0, 0.1, generator=gen))


def _built(out: Path, spec: dict[str, Any]) -> bool:
    marker = out / MARKER_FILE
    return marker.is_file() and json.loads(marker.read_text()) == spec


def make_tiny_granite_hybrid(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """``GraniteMoeHybridForCausalLM``: Mamba2, attention, Mamba2, attention
    (hidden 256, 8 Mamba heads of 64, state 64; 4 attention heads, 2 KV heads).
    vLLM-CPU: conv state (3, 640), SSM state (8, 64, 64) per layer."""
    out = Path(path)
    spec: dict[str, Any] = {"arch": "granitemoehybrid", "seed": seed, "format": _FORMAT_VERSION}
    if _built(out, spec):
        return out
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        shared_intermediate_size=512,
        num_local_experts=0,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=8,
        mamba_n_groups=1,
        mamba_d_state=64,
        mamba_d_head=64,
        mamba_d_conv=4,
        mamba_expand=2,
        position_embedding_type="rope",
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        dtype="float32",
    )
    return _save_random(GraniteMoeHybridForCausalLM, config, out, spec, _fill)


def make_tiny_mamba2(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """``Mamba2ForCausalLM``, two layers (hidden 256, 8 heads of 64, state 64):
    every KV byte vLLM keeps for it is a Mamba state."""
    out = Path(path)
    spec: dict[str, Any] = {"arch": "mamba2", "seed": seed, "format": _FORMAT_VERSION}
    if _built(out, spec):
        return out
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(
        vocab_size=4096,
        hidden_size=256,
        num_hidden_layers=2,
        num_heads=8,
        head_dim=64,
        state_size=64,
        n_groups=1,
        expand=2,
        conv_kernel=4,
        tie_word_embeddings=False,
        dtype="float32",
    )
    return _save_random(Mamba2ForCausalLM, config, out, spec, _fill)


def make_tiny_gemma3(
    path: str | os.PathLike[str], *, seed: int = 0, sliding_window: int = 64
) -> Path:
    """``Gemma3ForCausalLM`` (text), six layers: five sliding-window layers of
    ``sliding_window`` tokens and one global layer, Gemma3's own pattern; vLLM
    gives it a sliding-window group beside a full-attention group."""
    out = Path(path)
    spec: dict[str, Any] = {
        "arch": "gemma3",
        "seed": seed,
        "sliding_window": sliding_window,
        "format": _FORMAT_VERSION,
    }
    if _built(out, spec):
        return out
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=sliding_window,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        max_position_embeddings=4096,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        tie_word_embeddings=True,
        dtype="float32",
    )

    return _save_random(Gemma3ForCausalLM, config, out, spec, gemma_fill, gemma_embeddings)
