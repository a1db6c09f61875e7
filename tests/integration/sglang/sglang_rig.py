"""Real SGLang HiCache classes on CPU, driving ``KVSDKStorage`` (test helpers).

SGLang (0.5.23, PyPI) cannot run a model on a CPU, but its cache machinery
can: :class:`Rig` builds the real ``MHATokenToKVPool`` / ``MLATokenToKVPool``
with ``device="cpu"``, a real host pool from it in a given layout, and the
real cache controller (``HybridCacheController``, what SGLang's radix cache
builds, or the base ``HiCacheController``), which creates the storage backend
through SGLang's ``StorageBackendFactory`` (``dynamic`` for kvsdk, ``file``
for SGLang's own). The scheduler thread's part of a prefetch (allocate host
pages for the hit, hand the operation to the I/O thread, drain the acks) is
played by :meth:`Rig.prefetch`; everything else is SGLang's own threads.

Run as a script, this file is the worker for the multi-process tests
(restart, two tensor-parallel ranks): ``python sglang_rig.py <json>``.

Needs the ``.venv-sglang`` environment (``scripts/install_sglang.sh``); the
test module skips without SGLang.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve()
TIMEOUT_S = 30.0
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
HOST_BUDGET_BYTES = 8 << 30
TINY_MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                     "hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 3}  # fmt: skip


def tiny_model_dir(seed: int = 0) -> str:
    """A small model directory (``config.json`` and seeded weights) for kvsdk to
    fingerprint; the same seed gives the same weights in every process."""
    root = Path(tempfile.gettempdir()) / f"kvsdk-sglang-test-model-{os.getuid()}-{seed}"
    if not (root / "model.safetensors").is_file():
        import torch
        from safetensors.torch import save_file

        tmp = Path(tempfile.mkdtemp(prefix=f"{root.name}.", dir=root.parent))
        (tmp / "config.json").write_text(json.dumps(TINY_MODEL_CONFIG))
        weights = torch.randn(32, 32, generator=torch.Generator().manual_seed(seed))
        save_file({"weight": weights}, str(tmp / "model.safetensors"))
        try:
            tmp.rename(root)
        except OSError:  # another process made it first
            shutil.rmtree(tmp)
    return str(root)


def set_parallel(tp_rank: int = 0, tp_size: int = 1) -> None:
    """SGLang's process-wide parallel state, as a launcher would publish it."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
    )


def kvsdk_extra_config(config: Any, *, interface_v1: int = 1, **more: Any) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config`` for kvsdk (as SGLang parses it)."""
    return {
        "backend_name": "kvsdk",
        "module_path": "kvsdk.plugins.sglang",
        "class_name": "KVSDKStorage",
        "interface_v1": interface_v1,
        "config": config,
        **more,
    }


def disk_config(path: Path | str, **disk: Any) -> dict[str, Any]:
    return {"tiers": [{"backend": "disk", "path": str(path), **disk}]}


def tokens_for(n_pages: int, page: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n_pages * page))


@dataclass
class Rig:
    """One SGLang cache stack on CPU with a storage backend attached."""

    backend: str = "dynamic"
    extra_config: dict[str, Any] | None = None
    layout: str = "page_first"
    mla: bool = False
    page: int = 4
    layers: int = 3
    heads: int = 2
    head_dim: int = 16
    kv_lora_rank: int = 32
    rope_dim: int = 8
    device_tokens: int = 512
    dtype: str = "bfloat16"
    controller: str = "hybrid"
    model_name: str = field(default_factory=tiny_model_dir)
    tp_group: Any = None
    file_dir: str | None = None
    ctrl: Any = field(init=False, default=None)

    def __post_init__(self) -> None:
        import torch
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

        dtype = getattr(torch, self.dtype)
        if self.mla:
            self.kv = MLATokenToKVPool(
                size=self.device_tokens, page_size=self.page, dtype=dtype,
                kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.rope_dim,
                layer_num=self.layers, device="cpu", enable_memory_saver=False,
            )  # fmt: skip
        else:
            self.kv = MHATokenToKVPool(
                size=self.device_tokens, page_size=self.page, dtype=dtype,
                head_num=self.heads, head_dim=self.head_dim, layer_num=self.layers,
                device="cpu", enable_memory_saver=False,
            )  # fmt: skip
        self.allocator = TokenToKVPoolAllocator(
            size=self.device_tokens, dtype=dtype, device="cpu", kvcache=self.kv, need_sort=False
        )
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

        # SGLang refuses a host pool unless 10 GiB more than it asks for is free on
        # the machine; these pools are small, so book them against a fixed budget.
        with host_memory_budget_scope(HOST_BUDGET_BYTES):
            self.host = self._host_pool()
        if self.file_dir is not None:  # SGLang's file backend reads its directory from here
            os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = self.file_dir
        extra = dict(self.extra_config or {})
        if self.controller == "hybrid":
            from sglang.srt.mem_cache.hicache_storage import PoolName
            from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
                HybridCacheController,
            )
            from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
            from sglang.srt.mem_cache.pool_host import HostPoolGroup

            entry = build_pool_entry(
                name=PoolName.KV, host_pool=self.host, device_pool=self.kv,
                layer_mapping={i: i for i in range(self.layers)},
                transfer_layer_id_max=self.layers, is_anchor=True,
            )  # fmt: skip
            self.pool = HostPoolGroup([entry])
            self.ctrl = HybridCacheController(
                self.allocator, self.pool, self.page, self.tp_group, threading.Event(),
                io_backend="direct", storage_backend=self.backend, model_name=self.model_name,
                storage_backend_extra_config=extra,
            )  # fmt: skip
        else:
            from sglang.srt.managers.cache_controller import HiCacheController

            self.pool = self.host
            self.ctrl = HiCacheController(
                self.allocator, self.host, self.page, self.tp_group, threading.Event(),
                io_backend="direct", storage_backend=self.backend, model_name=self.model_name,
                storage_backend_extra_config=extra,
            )  # fmt: skip
        self.storage = getattr(self.ctrl.storage_backend, "_backend", self.ctrl.storage_backend)
        self._rid = 0

    def _host_pool(self) -> Any:
        kw = dict(
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=self.kv.size,
            start_layer=self.kv.start_layer,
            end_layer=self.kv.end_layer,
        )
        info = self.kv.get_device_pool_infos()[0].buffer_info
        if self.mla:
            from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

            return MLATokenToKVPoolHost(
                info, 2.0, 0, self.page, self.layout, target_layer_num=self.kv.layer_num,
                override_kv_cache_dim=self.kv.kv_cache_dim, **kw,
            )  # fmt: skip
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        return MHATokenToKVPoolHost(
            info, 2.0, 0, self.page, self.layout,
            write_back_staging=self.kv.hicache_write_back_staging, **kw,
        )  # fmt: skip

    # -- pages ------------------------------------------------------------------------------
    def hashes(self, tokens: Sequence[int]) -> list[str]:
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        out: list[str] = get_storage_hash_str(list(tokens), None, page_size=self.page)
        return out

    def fill(self, n_pages: int, seed: int = 0) -> Any:
        """Host pages with random contents; their host indices."""
        import torch

        idx = self.pool.alloc(n_pages * self.page)
        assert idx is not None, "host pool full"
        gen = torch.Generator().manual_seed(seed)
        for p in range(n_pages):
            flat = self.host.get_dummy_flat_data_page()
            raw = torch.randint(0, 256, (flat.numel() * flat.element_size(),), generator=gen)
            flat.view(torch.uint8).copy_(raw.to(torch.uint8))
            self.host.set_from_flat_data_page(int(idx[p * self.page]), flat)
        return idx

    def page_bytes(self, idx: Any, p: int) -> bytes:
        import torch

        page = self.host.get_data_page(int(idx[p * self.page]), flat=True).contiguous()
        return bytes(page.view(torch.uint8).numpy().tobytes())

    def pages(self, idx: Any, n: int) -> list[bytes]:
        return [self.page_bytes(idx, p) for p in range(n)]

    # -- what the scheduler thread does ---------------------------------------------------
    def backup(self, idx: Any, tokens: Sequence[int]) -> int:
        """Back pages up to storage through the controller; tokens it completed."""
        self.ctrl.write_storage(idx, list(tokens), hash_value=self.hashes(tokens))
        op = self.ctrl.ack_backup_queue.get(timeout=TIMEOUT_S)
        return int(op.completed_tokens)

    def prefetch(self, tokens: Sequence[int], *, load: bool = True) -> tuple[int, int, Any]:
        """Query storage and prefetch the hit into fresh host pages through the
        controller: ``(hit_tokens, loaded_tokens, host_indices)``."""
        self._rid += 1
        rid = f"req-{self._rid}"
        handle = SimpleNamespace(rid=rid) if self.controller == "hybrid" else rid
        self.ctrl.prefetch(handle, list(tokens), None)
        op = self.ctrl.prefetch_hit_queue.get(timeout=TIMEOUT_S)
        hit = int(op.storage_hit_count)
        if hit == 0 or not load:
            return hit, 0, None
        idx = self.pool.alloc(hit)
        assert idx is not None, "host pool full"
        op.host_indices = idx
        op.hash_value = op.hash_value[: hit // self.page]
        self.ctrl.prefetch_buffer.put(op)
        loaded = 0
        while True:
            ack = self.ctrl.ack_prefetch_queue.get(timeout=TIMEOUT_S)
            if ack.completed_tokens is not None:
                loaded = max(loaded, int(ack.completed_tokens))
            if ack.completed_req:
                return hit, loaded, idx

    def free(self, idx: Any) -> None:
        if idx is not None:
            self.pool.free(idx)

    def close(self) -> None:
        if self.ctrl is not None and self.ctrl.storage_backend is not None:
            self.ctrl.detach_storage_backend()
        self.host.destroy()


def run_worker(spec: dict[str, Any], *, timeout: float = 120.0) -> dict[str, Any]:
    """Run this file as a worker process; its JSON answer."""
    proc = subprocess.run(
        [sys.executable, str(HERE), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    if proc.returncode != 0:
        raise AssertionError(f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    answer: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return answer


def start_workers(specs: list[dict[str, Any]]) -> list[subprocess.Popen[str]]:
    return [
        subprocess.Popen(
            [sys.executable, str(HERE), json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        for spec in specs
    ]


def join_workers(
    procs: list[subprocess.Popen[str]], timeout: float = 120.0
) -> list[dict[str, Any]]:
    answers = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        if p.returncode != 0:
            raise AssertionError(f"worker failed ({p.returncode}):\n{err[-4000:]}")
        answers.append(json.loads(out.strip().splitlines()[-1]))
    return answers


# -- worker process ---------------------------------------------------------------------------


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    """``write``: back up pages; ``read``: prefetch them (a fresh process, so
    a restart); ``tp``: one tensor-parallel rank of two (gloo)."""
    import torch

    mode = spec["mode"]
    tp_group = None
    rank, world = spec.get("rank", 0), spec.get("world", 1)
    if world > 1:
        import datetime

        torch.distributed.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{spec['port']}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        tp_group = torch.distributed.group.WORLD
    set_parallel(tp_rank=rank, tp_size=world)
    rig = Rig(
        extra_config=kvsdk_extra_config(spec["config"]),
        layout=spec.get("layout", "page_first"),
        page=spec.get("page", 4),
        tp_group=tp_group,
    )
    n = spec["pages"]
    tokens = tokens_for(n, rig.page)
    answer: dict[str, Any] = {"rank": rank}
    if mode in ("write", "tp"):
        stored = spec.get("store_pages", n)
        idx = rig.fill(stored, seed=spec.get("seed", 0) + (rank if mode == "tp" else 0))
        answer["backed_up"] = rig.backup(idx, tokens[: stored * rig.page])
        answer["written"] = [p.hex() for p in rig.pages(idx, stored)]
        if world > 1:
            torch.distributed.barrier()
    if mode in ("read", "tp"):
        answer["local_hit_pages"] = rig.storage.batch_exists(rig.hashes(tokens))
        hit, loaded, idx = rig.prefetch(tokens)
        answer.update(hit=hit, loaded=loaded)
        answer["read"] = [p.hex() for p in rig.pages(idx, loaded // rig.page)] if loaded else []
    rig.close()
    if world > 1:
        torch.distributed.destroy_process_group()
    return answer


if __name__ == "__main__":
    _answer = _worker(json.loads(sys.argv[1]))
    sys.stdout.flush()
    print(json.dumps(_answer))
    sys.stdout.flush()
    # SGLang's daemon threads and gloo can keep an exiting interpreter busy.
    os._exit(0)
