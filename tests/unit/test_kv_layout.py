"""Layout detection and copy plans for paged KV caches, on CPU tensors shaped
like the vLLM GPU attention backends' caches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsdk.transfer import layout as kvl
from kvsdk.transfer.layout import TensorGeometry, block_regions, kv_layout

NB, N, H, D = 10, 4, 2, 8  # blocks, tokens per block, KV heads, head size
ITEM = 2  # float16


def physical(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-30000, 30000, shape, dtype=torch.int16, generator=g).view(torch.float16)


def nbytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes."""
    return t.contiguous().reshape(-1).view(torch.uint8)


# -- block regions ----------------------------------------------------------------------


def test_kv_split_on_dim1_is_one_region_per_block() -> None:
    t = physical((NB, 2, N, H, D))  # FlashInfer / Triton
    r = block_regions(t)
    assert (r.block_dim, r.num_blocks, r.regions_per_block) == (0, NB, 1)
    assert r.region_bytes == r.block_stride == 2 * N * H * D * ITEM


def test_kv_split_on_dim0_is_two_regions_per_block_k_then_v() -> None:
    t = physical((2, NB, N, H, D))  # FlashAttention / FlexAttention
    r = block_regions(t)
    half = N * H * D * ITEM
    assert (r.block_dim, r.num_blocks, r.region_bytes) == (1, NB, half)
    assert r.region_offsets == (0, NB * half)
    assert r.block_stride == half and r.block_bytes == 2 * half


def test_hnd_stride_order_keeps_regions_whole() -> None:
    # vLLM allocates HND physically and hands out the NHD-shaped permuted view
    fa = physical((2, NB, H, N, D)).permute(0, 1, 3, 2, 4)
    fi = physical((NB, 2, H, N, D)).permute(0, 1, 3, 2, 4)
    assert not fa[:, 0].is_contiguous() and not fi[0].is_contiguous()
    assert block_regions(fa).regions_per_block == 2
    assert block_regions(fi).regions_per_block == 1
    assert block_regions(fi).region_bytes == 2 * N * H * D * ITEM


def test_head_outer_layout_is_one_region_per_head() -> None:
    # vLLM >= 0.32, LHBNC: logical (B, H, N, C), heads outermost in memory
    t = physical((H, NB, N, 2 * D)).permute(1, 0, 2, 3)
    r = block_regions(t)
    assert (r.block_dim, r.regions_per_block, r.region_bytes) == (0, H, N * 2 * D * ITEM)
    assert r.region_offsets == tuple(h * NB * N * 2 * D * ITEM for h in range(H))


def test_num_blocks_settles_a_two_block_cache() -> None:
    t = physical((2, 16, 64))  # MLA-like: 2 blocks of 16 tokens
    assert block_regions(t).block_dim == 1  # the heuristic reads K/V on dim 0
    r = block_regions(t, num_blocks=2)
    assert (r.block_dim, r.regions_per_block, r.num_blocks) == (0, 1, 2)
    with pytest.raises(ValueError, match="num_blocks=7"):
        block_regions(t, num_blocks=7)


def test_padded_blocks_keep_their_stride() -> None:
    base = torch.zeros(NB * 40, dtype=torch.uint8)
    t = base.as_strided((NB, 36), (40, 1))  # 36-byte blocks, 40 bytes apart
    r = block_regions(t)
    assert (r.region_bytes, r.block_stride) == (36, 40)
    layout = kv_layout([t])
    assert len(layout.views) == 1 and not layout.views[0].contiguous


def test_broadcast_or_overlapping_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="broadcast"):
        block_regions(torch.zeros(1, 2, 8).expand(NB, 2, 8))
    with pytest.raises(ValueError, match="overlap"):
        block_regions(torch.zeros(64).as_strided((NB, 8), (4, 1)))


def test_geometry_alone_is_enough_for_a_real_size_cache() -> None:
    # 100k blocks of Llama-70B-like pages, never allocated
    shape = (2, 100_000, 16, 8, 128)
    stride = (100_000 * 16 * 8 * 128, 16 * 8 * 128, 8 * 128, 128, 1)
    geom = TensorGeometry(
        shape, stride, 0, 2, storage=1, storage_nbytes=2 * 100_000 * 16 * 8 * 128 * 2
    )
    layout = kv_layout([geom], num_blocks=100_000)
    assert layout.region_bytes == 16 * 8 * 128 * 2 and layout.regions_per_block == 2


# -- row views --------------------------------------------------------------------------


def test_separate_allocations_give_one_view_per_layer_with_k_and_v_fused() -> None:
    layers = [physical((2, NB, N, H, D), seed=i) for i in range(3)]
    layout = kv_layout(layers)
    assert len(layout.views) == 3 and not layout.fused
    v = layout.views[1]
    assert v.layers.tolist() == [1, 1] and v.regions.tolist() == [0, 1]
    assert v.starts.tolist() == [0, NB] and v.rows_per_block.tolist() == [1, 1]


def test_layers_in_one_allocation_fuse_into_one_view() -> None:
    big = physical((3, NB, 2, N, H, D))  # layer-outermost, one storage (vLLM-CPU)
    layout = kv_layout(list(big.unbind(0)))
    assert layout.fused
    assert layout.views[0].starts.tolist() == [0, NB, 2 * NB]


def test_cross_layer_layout_fuses_with_layer_interleaved_rows() -> None:
    big = physical((NB, 3, 2, N, H, D))  # block-outermost: all layers of a block together
    layout = kv_layout([big[:, i] for i in range(3)])
    assert layout.fused
    v = layout.views[0]
    assert v.starts.tolist() == [0, 1, 2] and v.rows_per_block.tolist() == [3, 3, 3]


def test_layers_of_a_group_must_match() -> None:
    with pytest.raises(ValueError, match="layer 1"):
        kv_layout([physical((NB, 2, N, H, D)), physical((NB, 2, N, H, 2 * D))])


# -- plans ------------------------------------------------------------------------------


def reference_slot_bytes(blocks_kv: list[torch.Tensor], b: int) -> torch.Tensor:
    """Expected bytes of engine block ``b`` for every layer, from each layer's
    physical allocation of shape (2, NB, ...) or (NB, 2, ...) / (NB, ...)."""
    out = []
    for alloc in blocks_kv:
        if alloc.shape[0] == 2 and alloc.shape[1] == NB:
            out += [nbytes(alloc[0, b]), nbytes(alloc[1, b])]
        else:
            out.append(nbytes(alloc[b]))
    return torch.cat(out)


def execute(
    layout: kvl.KVLayout,
    pairs: kvl.JobPairs,
    slab: torch.Tensor,
    tensors: list[torch.Tensor],
    *,
    staged_bytes: int | None,
) -> None:
    """Run a store plan with plain CPU byte copies (what the worker's kernels do)."""
    storages = {int(t.untyped_storage().data_ptr()): t.untyped_storage() for t in tensors}
    mem = {
        k: torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),), (1,))
        for k, s in storages.items()
    }
    flat = slab.view(-1)
    if staged_bytes is None:
        for v, e, s, n in kvl.direct_plan(layout, pairs).runs.tolist():
            o = layout.views[v].origin
            flat[s : s + n] = mem[layout.views[v].storage][o + e : o + e + n]
        return
    staging = torch.zeros(staged_bytes, dtype=torch.uint8)
    size = pairs.row_bytes
    for piece in kvl.staged_plan(pairs, staged_bytes).pieces:
        for g in piece.gathers:
            view = layout.views[g.view]
            for i, row in enumerate(g.rows.tolist()):
                a = view.origin + row * view.pitch
                k = g.staging_row + i
                staging[k * size : (k + 1) * size] = mem[view.storage][a : a + size]
        for s, o, n in piece.runs.tolist():
            flat[s : s + n] = staging[o : o + n]


LAYOUTS = {
    "fa_dim0_separate": lambda L: [physical((2, NB, N, H, D), seed=i) for i in range(L)],
    "fi_dim1_separate": lambda L: [physical((NB, 2, N, H, D), seed=i) for i in range(L)],
    "fa_dim0_one_storage": lambda L: list(physical((L, 2, NB, N, H, D)).unbind(0)),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("staged_bytes", [None, 1 << 20, 3 * N * H * D * ITEM])
def test_store_plans_put_every_block_where_the_slot_layout_says(
    name: str, staged_bytes: int | None
) -> None:
    L, bpc = 3, 2
    allocs = LAYOUTS[name](L)
    layout = kv_layout(allocs)
    slot_bytes = layout.chunk_bytes(bpc) + 24
    slab = torch.zeros((4, slot_bytes), dtype=torch.uint8)
    blocks = np.array([7, 2, 3, 4], dtype=np.int64)
    slots = np.array([3, 3, 1, 1], dtype=np.int64)
    offsets = np.array([0, 1, 0, 1], dtype=np.int64)
    pairs = kvl.job_pairs(
        layout, blocks, slots, offsets, blocks_per_chunk=bpc, slot_bytes=slot_bytes, num_slots=4
    )
    assert pairs.num_bytes == len(blocks) * L * layout.block_bytes
    execute(layout, pairs, slab, allocs, staged_bytes=staged_bytes)
    bb = layout.block_bytes
    for b, s, o in zip(blocks, slots, offsets, strict=True):
        want = reference_slot_bytes(allocs, int(b)).view(L, bb)
        got = slab[s, : L * bpc * bb].view(L, bpc, bb)[:, o]
        assert torch.equal(got, want)
    assert int(slab[0].sum()) == 0 and int(slab[2].sum()) == 0
    assert int(slab[:, layout.chunk_bytes(bpc) :].sum()) == 0


def test_kv_split_on_dim0_and_dim1_give_the_same_slot_bytes() -> None:
    fi = physical((NB, 2, N, H, D))
    fa = fi.transpose(0, 1).contiguous()  # the same K/V, split on dim 0
    slabs = []
    for t in (fa, fi):
        layout = kv_layout([t])
        slab = torch.zeros((2, layout.chunk_bytes(2)), dtype=torch.uint8)
        pairs = kvl.job_pairs(
            layout,
            np.array([5, 6]),
            np.array([1, 1]),
            np.array([0, 1]),
            blocks_per_chunk=2,
            slot_bytes=slab.shape[1],
            num_slots=2,
        )
        execute(layout, pairs, slab, [t], staged_bytes=1 << 16)
        slabs.append(slab)
    assert torch.equal(slabs[0], slabs[1]) and int(slabs[0].sum()) != 0


def test_consecutive_blocks_coalesce_into_one_copy_per_layer() -> None:
    layers = [physical((NB, 2, N, H, D), seed=i) for i in range(3)]
    layout = kv_layout(layers)
    bpc = 4
    pairs = kvl.job_pairs(
        layout,
        np.arange(2, 6),
        np.zeros(4, dtype=np.int64),
        np.arange(4),
        blocks_per_chunk=bpc,
        slot_bytes=layout.chunk_bytes(bpc),
        num_slots=1,
    )
    plan = kvl.direct_plan(layout, pairs)
    assert len(plan.runs) == 3  # one per layer: blocks 2..5 → offsets 0..3
    assert plan.runs[:, kvl.NBYTES].tolist() == [4 * layout.block_bytes] * 3
    assert plan.mean_run_bytes == 4 * layout.block_bytes


def test_cross_layer_layout_with_one_block_chunks_is_one_copy_per_block() -> None:
    big = physical((NB, 3, 2, N, H, D))
    layout = kv_layout([big[:, i] for i in range(3)])
    pairs = kvl.job_pairs(
        layout,
        np.array([4, 8]),
        np.array([0, 1]),
        np.array([0, 0]),
        blocks_per_chunk=1,
        slot_bytes=layout.chunk_bytes(1),
        num_slots=2,
    )
    plan = kvl.direct_plan(layout, pairs)
    assert plan.runs[:, kvl.NBYTES].tolist() == [3 * layout.block_bytes] * 2


def test_scattered_blocks_stage_into_few_large_copies() -> None:
    big = physical((3, NB, 2, N, H, D))
    layout = kv_layout(list(big.unbind(0)))
    bpc = 4
    blocks = np.array([9, 1, 6, 3, 0, 8, 2, 5])  # no two consecutive in a row
    pairs = kvl.job_pairs(
        layout,
        blocks,
        np.repeat([1, 0], 4),
        np.tile(np.arange(4), 2),
        blocks_per_chunk=bpc,
        slot_bytes=layout.chunk_bytes(bpc),
        num_slots=2,
    )
    assert len(kvl.direct_plan(layout, pairs).runs) == 24
    staged = kvl.staged_plan(pairs, 1 << 20)
    assert staged.num_copies == 1  # slots 0 and 1 are adjacent: one copy of both chunks
    assert len(staged.pieces) == 1 and len(staged.pieces[0].gathers) == 1
    small = kvl.staged_plan(pairs, 5 * layout.block_bytes)
    assert [p.rows for p in small.pieces] == [5, 5, 5, 5, 4]
    assert small.num_bytes == staged.num_bytes == pairs.num_bytes


@pytest.mark.parametrize(
    ("blocks", "slots", "offsets", "match"),
    [
        ([NB], [0], [0], "engine block 10"),
        ([-1], [0], [0], "engine block -1"),
        ([0], [2], [0], "slot 2"),
        ([0], [0], [2], "block offset 2"),
    ],
)
def test_ids_out_of_range_are_refused_on_the_host(
    blocks: list[int], slots: list[int], offsets: list[int], match: str
) -> None:
    layout = kv_layout([physical((NB, 2, N, H, D))])
    with pytest.raises(ValueError, match=match):
        kvl.job_pairs(
            layout,
            np.array(blocks),
            np.array(slots),
            np.array(offsets),
            blocks_per_chunk=2,
            slot_bytes=layout.chunk_bytes(2),
            num_slots=2,
        )


def test_a_chunk_larger_than_a_slot_is_refused() -> None:
    layout = kv_layout([physical((NB, 2, N, H, D))])
    with pytest.raises(ValueError, match="does not fit"):
        kvl.job_pairs(
            layout,
            np.array([0]),
            np.array([0]),
            np.array([0]),
            blocks_per_chunk=2,
            slot_bytes=layout.chunk_bytes(2) - 1,
            num_slots=1,
        )
