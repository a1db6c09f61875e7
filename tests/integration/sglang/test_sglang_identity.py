"""The model's identity in ``KVSDKStorage``'s namespaces, on SGLang's real classes.

SGLang names the model to a storage backend by its served name alone; kvsdk
names it by what the weights are (:mod:`kvsdk.plugins.sglang.identity`). Each
deployment here publishes SGLang's server arguments as its scheduler process
does (the model path is read from them) and builds SGLang's real cache
controller over one shared disk directory.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from sglang.srt import runtime_context
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.server_args import ServerArgs
from sglang_rig import Rig, disk_config, kvsdk_extra_config, set_parallel, tokens_for
from test_sglang_hybrid import attach_mamba, mamba_host, put_states, query

from kvsdk.plugins.sglang import KVSDKStorage

pytestmark = pytest.mark.filterwarnings(
    "ignore:Only CUDA:UserWarning",
    "ignore::DeprecationWarning",
)
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
    "num_hidden_layers": 3, "vocab_size": 256, "max_position_embeddings": 512,
    "torch_dtype": "bfloat16",
}  # fmt: skip
Serve = Callable[..., str]
TRAILING = PoolHitPolicy.TRAILING_PAGES


def model_dir(path: Path, seed: int) -> Path:
    """A small model directory: ``config.json`` and seeded weights in a safetensors file."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    gen = torch.Generator().manual_seed(seed)
    weights = {"model.embed_tokens.weight": torch.randn(256, 64, generator=gen)}
    save_file(weights, str(path / "model.safetensors"))
    return path


@pytest.fixture
def serve() -> Iterator[Serve]:
    """Publishes SGLang's server arguments for a model as its scheduler process
    does; returns the served model name. Unpublished again after the test (the
    rigs a test builds after requesting this fixture are closed before that)."""

    def publish(model_path: Path, served_model_name: str | None = None) -> str:
        args = ServerArgs(
            model_path=str(model_path), served_model_name=served_model_name, device="cpu"
        )
        runtime_context.publish(args, role="scheduler")
        set_parallel()
        return str(runtime_context.get_serving().served_model_name)

    yield publish
    runtime_context.reset_context()
    set_parallel()


def deployment(make_rig: Any, disk: Path, served: str, **config: Any) -> Rig:
    rig: Rig = make_rig(
        extra_config=kvsdk_extra_config({**disk_config(disk), **config}), model_name=served
    )
    assert isinstance(rig.storage, KVSDKStorage)
    return rig


def test_same_served_name_with_other_weights_loads_nothing(
    serve: Serve, make_rig: Any, tmp_path: Path
) -> None:
    """A new fine-tune served under the old name shares a disk tier with the old
    weights: none of the old pages (nor Mamba states) is found or loaded."""
    disk = tmp_path / "tier"
    served = serve(model_dir(tmp_path / "base", seed=1), "org/chat-model")
    old = deployment(make_rig, disk, served)
    tokens = tokens_for(4, old.page)
    hashes = old.hashes(tokens)
    assert old.backup(old.fill(4, seed=7), tokens) == 4 * old.page
    host = mamba_host()
    attach_mamba(old, host)
    slots, _ = put_states(host, 1, seed=8)
    state = PoolTransfer(PoolName.MAMBA, host_indices=slots, keys=hashes[3:], hit_policy=TRAILING)
    assert old.storage.batch_set_v2([state]) == {"mamba": [True]}
    assert old.storage.batch_exists_v2(hashes, query(hashes)).kv_hit_pages == 4
    assert old.prefetch(tokens, load=False)[0] == 4 * old.page

    assert serve(model_dir(tmp_path / "fine-tune", seed=2), "org/chat-model") == served
    new = deployment(make_rig, disk, served)
    new_host = mamba_host()
    attach_mamba(new, new_host)
    assert new.storage.batch_exists(hashes) == 0
    assert new.prefetch(tokens) == (0, 0, None)
    got = new.pool.alloc(4 * new.page)
    assert new.storage.batch_get_v1(hashes, got) == [False] * 4
    assert new.storage.batch_exists_v2(hashes, query(hashes)).kv_hit_pages == 0
    new_slots = new_host.alloc(1)
    assert new_slots is not None
    read = PoolTransfer(PoolName.MAMBA, host_indices=new_slots, keys=hashes[3:])
    assert new.storage.batch_get_v2([read]) == {"mamba": [False]}
    assert new.storage.namespace != old.storage.namespace


def test_same_weights_at_another_path_share_pages(
    serve: Serve, make_rig: Any, tmp_path: Path
) -> None:
    """Identity is what the weights are, not where they lie nor what they are
    called: a copy of the model directory served under its own path (SGLang's
    default served name) loads the first deployment's pages, byte for byte."""
    disk = tmp_path / "tier"
    first_dir = model_dir(tmp_path / "models-a" / "llama", seed=3)
    first = deployment(make_rig, disk, serve(first_dir))
    assert first.storage.storage_config.model_name == str(first_dir)
    tokens = tokens_for(3, first.page)
    idx = first.fill(3, seed=9)
    assert first.backup(idx, tokens) == 3 * first.page

    copy_dir = tmp_path / "models-b" / "llama-copy"
    shutil.copytree(first_dir, copy_dir)
    second = deployment(make_rig, disk, serve(copy_dir))
    assert second.storage.storage_config.model_name == str(copy_dir)
    assert second.storage.namespace == first.storage.namespace
    hit, loaded, idx2 = second.prefetch(tokens)
    assert hit == loaded == 3 * second.page
    assert second.pages(idx2, 3) == first.pages(idx, 3)


def test_weights_kvsdk_cannot_locate_are_refused(make_rig: Any, tmp_path: Path) -> None:
    """No published model path and a served name that is no directory (or a
    directory without weight files): SGLang's attach fails with one sentence
    naming what is missing and ``model_id``; with ``model_id`` set, deployments
    of that id share."""
    disk = tmp_path / "tier"
    # SGLang's controller re-raises kvsdk's ConfigError as a ValueError with its sentence
    with pytest.raises(ValueError, match=r"served model name 'org/chat-model'.*model_id"):
        deployment(make_rig, disk, "org/chat-model")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(MODEL_CONFIG))
    with pytest.raises(ValueError, match=r"no weight files .* in .*bare.*model_id"):
        deployment(make_rig, disk, str(bare))
    a = deployment(make_rig, disk, "org/chat-model", model_id="chat-model@2024-06")
    tokens = tokens_for(2, a.page)
    assert a.backup(a.fill(2, seed=4), tokens) == 2 * a.page
    b = deployment(make_rig, disk, "org/other-name", model_id="chat-model@2024-06")
    c = deployment(make_rig, disk, "org/chat-model", model_id="chat-model@2024-07")
    assert b.prefetch(tokens, load=False)[0] == 2 * b.page
    assert c.prefetch(tokens, load=False)[0] == 0
    # the served name, when it is a model directory, is fingerprinted as it is
    local = deployment(make_rig, disk, str(model_dir(tmp_path / "local", seed=5)))
    assert local.storage.identity.model.startswith("weights:")
    assert local.prefetch(tokens, load=False)[0] == 0
