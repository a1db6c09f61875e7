"""The host tier's shared-memory slab: created private to its user, attached
by the engine's other processes, one strided region per rank, unlinked by its
creator and reclaimed after a crash."""

from __future__ import annotations

import gc
import os
import stat
import struct
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvsdk.slab
from kvsdk.slab import (
    HEADER_BYTES,
    PREFIX,
    SHM_DIR,
    SharedSlab,
    SlabError,
    SlabGeometry,
    reclaim_stale,
    segment_name,
)

GEOMETRY = SlabGeometry(num_slots=5, region_bytes=48, num_regions=3)


def fresh_name() -> str:
    return segment_name(f"test-slab-{uuid.uuid4()}")


def run_child(code: str) -> None:
    """Run ``code`` in a fresh interpreter (another process, as a vLLM worker is)."""
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True, timeout=120)


def make_segment(path: Path, header: bytes, size: int, mode: int = 0o600) -> None:
    """A file that looks like a segment: ``header`` at byte 0, ``size`` bytes long."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)
        os.pwrite(fd, header, 0)
        os.ftruncate(fd, size)  # after the header: a size below it cuts the header
    finally:
        os.close(fd)


def header_of(path: Path) -> bytes:
    with path.open("rb") as f:
        return f.read(HEADER_BYTES)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture
def slab(tmp_path: Path) -> Iterator[SharedSlab]:
    s = SharedSlab.create(fresh_name(), GEOMETRY, shm_dir=tmp_path)
    yield s
    s.unlink()


# -- geometry and names ------------------------------------------------------------------------


def test_geometry_sizes_and_the_segment_on_disk(slab: SharedSlab) -> None:
    g = GEOMETRY
    assert g.slot_bytes == 48 * 3
    assert g.nbytes == HEADER_BYTES + 5 * 48 * 3
    assert slab.path.stat().st_size == g.nbytes
    assert slab.tensor.shape == (5, 144) and slab.tensor.dtype == torch.uint8
    assert slab.tensor.is_contiguous()
    assert slab.tensor.data_ptr() % 4096 == 0  # slots start page-aligned after the header
    assert slab.owner
    assert SlabGeometry(7, 10).num_regions == 1 and SlabGeometry(7, 10).slot_bytes == 10


def test_segment_names_are_per_engine_and_per_user() -> None:
    a, b = segment_name("engine-a"), segment_name("engine-b")
    assert a == segment_name("engine-a")  # every process of the engine finds it
    assert a != b
    prefix = f"{PREFIX}{os.geteuid()}-"
    assert a.startswith(prefix)
    digest = a.removeprefix(prefix)
    assert len(digest) == 24 and int(digest, 16) >= 0
    assert "/" not in a


# -- create / attach ---------------------------------------------------------------------------


def test_bytes_written_through_one_mapping_are_seen_through_another(slab: SharedSlab) -> None:
    other = SharedSlab.attach(slab.name, shm_dir=slab.path.parent)
    assert not other.owner
    assert other.geometry == GEOMETRY
    assert other.tensor.data_ptr() != slab.tensor.data_ptr()  # two mappings, one segment
    pattern = torch.arange(slab.tensor.numel(), dtype=torch.int64).remainder(251).to(torch.uint8)
    slab.tensor.copy_(pattern.view(slab.tensor.shape))
    assert torch.equal(other.tensor, slab.tensor)
    other.region(2)[3].fill_(0xAB)
    assert torch.all(slab.tensor[3, 96:144] == 0xAB)
    assert torch.equal(slab.tensor[3, :96], pattern.view(slab.tensor.shape)[3, :96])


def test_a_child_process_writes_into_its_region(slab: SharedSlab) -> None:
    slab.tensor.fill_(0x11)
    run_child(
        f"""
        from pathlib import Path
        from kvsdk.slab import SharedSlab
        s = SharedSlab.attach({slab.name!r}, shm_dir=Path({str(slab.path.parent)!r}))
        assert int(s.tensor[0, 0]) == 0x11  # sees the creator's bytes
        r = s.region(1)
        for i in range(r.shape[0]):
            r[i].fill_(0x40 + i)
        """
    )
    for i in range(GEOMETRY.num_slots):
        row = slab.tensor[i]
        assert torch.all(row[48:96] == 0x40 + i)
        assert torch.all(row[:48] == 0x11) and torch.all(row[96:] == 0x11)
    assert slab.path.exists()  # an attached process never unlinks


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_the_segment_is_0600_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        s = SharedSlab.create(fresh_name(), GEOMETRY, shm_dir=tmp_path)
    finally:
        os.umask(old)
    try:
        st = s.path.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.geteuid()
        SharedSlab.attach(s.name, shm_dir=tmp_path)  # and the owner can attach it
    finally:
        s.unlink()


def test_creating_a_live_engines_segment_fails_naming_engine_id(slab: SharedSlab) -> None:
    before = header_of(slab.path)
    with pytest.raises(SlabError, match=r"engine_id") as info:
        SharedSlab.create(slab.name, GEOMETRY, shm_dir=slab.path.parent)
    assert slab.name in str(info.value)
    assert header_of(slab.path) == before  # the live engine's segment is left alone
    assert slab.path.exists()


def test_attaching_a_missing_segment_talks_about_another_machine(tmp_path: Path) -> None:
    with pytest.raises(SlabError, match=r"another machine"):
        SharedSlab.attach(fresh_name(), shm_dir=tmp_path)


def test_attach_refuses_a_segment_other_users_can_open(slab: SharedSlab) -> None:
    for mode in (0o644, 0o660, 0o606):
        os.chmod(slab.path, mode)
        with pytest.raises(SlabError, match=r"not private"):
            SharedSlab.attach(slab.name, shm_dir=slab.path.parent)
    os.chmod(slab.path, 0o600)
    SharedSlab.attach(slab.name, shm_dir=slab.path.parent)


def _header(
    *,
    magic: bytes = b"KVSDKSLB",
    version: int = 1,
    uid: int | None = None,
    pid: int | None = None,
    start: int | None = None,
    geometry: SlabGeometry = GEOMETRY,
    slot_bytes: int | None = None,
) -> bytes:
    me = os.getpid()
    return struct.pack(
        "<8sIIqqqqqI",
        magic,
        version,
        os.geteuid() if uid is None else uid,
        me if pid is None else pid,
        (kvsdk.slab._start_time(me) or 0) if start is None else start,
        geometry.num_slots,
        geometry.slot_bytes if slot_bytes is None else slot_bytes,
        geometry.region_bytes,
        geometry.num_regions,
    )


def test_our_header_builder_matches_the_real_one(slab: SharedSlab) -> None:
    """The hand-made headers below differ from a real one only where intended."""
    assert header_of(slab.path)[: len(_header())] == _header()


@pytest.mark.parametrize(
    ("header", "size", "match"),
    [
        (b"", GEOMETRY.nbytes, "no valid kvsdk header"),  # all zeros
        (_header(magic=b"NOTKVSDK"), GEOMETRY.nbytes, "no valid kvsdk header"),
        (_header(version=2), GEOMETRY.nbytes, "no valid kvsdk header"),
        (_header(uid=os.geteuid() + 1), GEOMETRY.nbytes, "no valid kvsdk header"),
        (_header(slot_bytes=GEOMETRY.slot_bytes + 1), GEOMETRY.nbytes, "no valid kvsdk header"),
        (_header(), GEOMETRY.nbytes - 1, "truncated"),
        (_header(), 20, "no valid kvsdk header"),  # shorter than a header
    ],
    ids=["zeros", "magic", "version", "uid", "geometry", "truncated", "short_header"],
)
def test_attach_refuses_a_segment_without_a_valid_header(
    tmp_path: Path, header: bytes, size: int, match: str
) -> None:
    name = fresh_name()
    make_segment(tmp_path / name, header, size)
    with pytest.raises(SlabError, match=match):
        SharedSlab.attach(name, shm_dir=tmp_path)


def test_attach_reads_the_geometry_from_the_header(tmp_path: Path) -> None:
    name = fresh_name()
    g = SlabGeometry(num_slots=3, region_bytes=16, num_regions=2)
    make_segment(tmp_path / name, _header(geometry=g), g.nbytes)
    s = SharedSlab.attach(name, shm_dir=tmp_path)
    assert s.geometry == g and s.tensor.shape == (3, 32)
    assert s.region(1).shape == (3, 16)


def test_create_needs_a_shared_memory_directory(tmp_path: Path) -> None:
    with pytest.raises(SlabError, match=r"POSIX shared memory"):
        SharedSlab.create(fresh_name(), GEOMETRY, shm_dir=tmp_path / "absent")


def test_create_checks_free_shared_memory_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[Path] = []

    def free(path: Path) -> int:
        asked.append(path)
        return GEOMETRY.nbytes - 1

    monkeypatch.setattr(kvsdk.slab, "_free_bytes", free)
    name = fresh_name()
    with pytest.raises(SlabError) as info:
        SharedSlab.create(name, GEOMETRY, shm_dir=tmp_path)
    msg = str(info.value)
    assert f"needs {GEOMETRY.nbytes} B" in msg and f"{GEOMETRY.nbytes - 1} B free" in msg
    assert "capacity" in msg and "shm-size" in msg
    assert asked == [tmp_path]
    assert not (tmp_path / name).exists()  # nothing half-made is left
    monkeypatch.setattr(kvsdk.slab, "_free_bytes", lambda path: GEOMETRY.nbytes)
    SharedSlab.create(name, GEOMETRY, shm_dir=tmp_path).unlink()  # exactly enough fits


def test_free_bytes_reads_the_filesystem(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    assert kvsdk.slab._free_bytes(tmp_path) == pytest.approx(st.f_bavail * st.f_frsize, rel=0.01)


# -- regions -----------------------------------------------------------------------------------


def test_regions_are_disjoint_strided_views_that_cover_each_slot(slab: SharedSlab) -> None:
    g = GEOMETRY
    regions = [slab.region(i) for i in range(g.num_regions)]
    for i, r in enumerate(regions):
        assert r.shape == (g.num_slots, g.region_bytes)
        assert r.stride() == (g.slot_bytes, 1)  # a row is a slot: strided, not contiguous
        assert r.data_ptr() == slab.tensor.data_ptr() + i * g.region_bytes
    for i, r in enumerate(regions):
        r.fill_(i + 1)
    expected = torch.cat(
        [torch.full((g.num_slots, g.region_bytes), i + 1, dtype=torch.uint8) for i in range(3)],
        dim=1,
    )
    assert torch.equal(slab.tensor, expected)  # every byte of every slot, each in one region
    regions[1][2, 5] = 99
    assert int(regions[0][2].max()) == 1 and int(regions[2][2].max()) == 3


@pytest.mark.parametrize("index", [-1, 3, 10])
def test_a_region_outside_the_slot_is_refused(slab: SharedSlab, index: int) -> None:
    with pytest.raises(SlabError, match=r"3 region"):
        slab.region(index)


# -- unlink and collection ---------------------------------------------------------------------


def test_unlink_removes_the_name_and_mappings_stay_valid(slab: SharedSlab) -> None:
    other = SharedSlab.attach(slab.name, shm_dir=slab.path.parent)
    slab.unlink()
    assert not slab.path.exists()
    slab.tensor[1].fill_(7)  # both mappings still work: the memory lives until unmapped
    assert torch.all(other.tensor[1] == 7)
    slab.unlink()  # twice is fine
    with pytest.raises(SlabError, match=r"another machine"):
        SharedSlab.attach(slab.name, shm_dir=slab.path.parent)
    # the name is free again for a new engine
    SharedSlab.create(slab.name, GEOMETRY, shm_dir=slab.path.parent).unlink()


def test_an_unlinked_name_reused_is_not_unlinked_by_the_old_owner(tmp_path: Path) -> None:
    name = fresh_name()
    old = SharedSlab.create(name, GEOMETRY, shm_dir=tmp_path)
    old.unlink()
    new = SharedSlab.create(name, GEOMETRY, shm_dir=tmp_path)
    del old
    gc.collect()  # the old owner's finalizer was detached at unlink
    assert new.path.exists()
    new.unlink()


def test_the_creator_unlinks_when_collected_an_attacher_never(tmp_path: Path) -> None:
    owner = SharedSlab.create(fresh_name(), GEOMETRY, shm_dir=tmp_path)
    path = owner.path
    attached = SharedSlab.attach(owner.name, shm_dir=tmp_path)
    del attached
    gc.collect()
    assert path.exists()
    del owner
    gc.collect()
    assert not path.exists()


def test_the_creator_unlinks_at_interpreter_exit(tmp_path: Path) -> None:
    name = fresh_name()
    run_child(
        f"""
        from pathlib import Path
        from kvsdk.slab import SharedSlab, SlabGeometry
        keep = SharedSlab.create({name!r}, SlabGeometry(2, 8), shm_dir=Path({str(tmp_path)!r}))
        assert keep.path.exists()
        """
    )
    assert not (tmp_path / name).exists()


# -- reclaiming a crashed engine's segment -----------------------------------------------------


def create_and_crash(name: str, shm_dir: Path) -> None:
    """A child creates the segment and dies without unlinking it (as after ``kill -9``)."""
    run_child(
        f"""
        import os
        from pathlib import Path
        from kvsdk.slab import SharedSlab, SlabGeometry
        s = SharedSlab.create({name!r}, SlabGeometry(2, 8, 2), shm_dir=Path({str(shm_dir)!r}))
        s.tensor.fill_(5)
        os._exit(0)  # no finalizers: the segment stays behind
        """
    )
    assert (shm_dir / name).exists()


def test_reclaim_removes_segments_of_dead_creators_and_keeps_live_ones(
    slab: SharedSlab, tmp_path: Path
) -> None:
    crashed = fresh_name()
    create_and_crash(crashed, tmp_path)
    reused_pid = fresh_name()  # our pid, but another process's start time: pid reuse
    make_segment(tmp_path / reused_pid, _header(start=1), GEOMETRY.nbytes)
    gone = fresh_name()
    make_segment(tmp_path / gone, _header(pid=dead_pid()), GEOMETRY.nbytes)
    half_made = fresh_name()  # no header yet: being created, not ours to judge
    make_segment(tmp_path / half_made, b"", GEOMETRY.nbytes)
    foreign = tmp_path / "psm_other_program"
    make_segment(foreign, _header(pid=dead_pid()), GEOMETRY.nbytes)

    assert sorted(reclaim_stale(tmp_path)) == sorted([crashed, reused_pid, gone])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [slab.name, half_made, foreign.name]
    )
    assert reclaim_stale(tmp_path) == []
    SharedSlab.attach(slab.name, shm_dir=tmp_path)  # the live one is intact


def test_create_reclaims_a_crashed_engines_segment_of_the_same_name(tmp_path: Path) -> None:
    name = fresh_name()
    create_and_crash(name, tmp_path)
    s = SharedSlab.create(name, GEOMETRY, shm_dir=tmp_path)  # the restarted engine
    try:
        assert s.geometry == GEOMETRY
        assert int(s.tensor.max()) == 0  # a fresh segment, not the crashed one's bytes
        assert SharedSlab.attach(name, shm_dir=tmp_path).geometry == GEOMETRY
    finally:
        s.unlink()


# -- on the real /dev/shm ----------------------------------------------------------------------


def test_on_dev_shm_create_attach_crash_and_reclaim() -> None:
    live = fresh_name()
    crashed = fresh_name()
    s = SharedSlab.create(live, GEOMETRY)
    try:
        assert s.path == SHM_DIR / live
        assert stat.S_IMODE(s.path.stat().st_mode) == 0o600
        s.region(0).fill_(3)
        run_child(
            f"""
            from kvsdk.slab import SharedSlab
            s = SharedSlab.attach({live!r})
            assert int(s.region(0).min()) == 3
            s.region(2).fill_(9)
            """
        )
        assert torch.all(s.region(2) == 9) and torch.all(s.region(1) == 0)
        create_and_crash(crashed, SHM_DIR)
        assert crashed in reclaim_stale()
        assert not (SHM_DIR / crashed).exists()
        assert s.path.exists()
    finally:
        s.unlink()
        (SHM_DIR / crashed).unlink(missing_ok=True)
    assert not (SHM_DIR / live).exists()
    assert not (SHM_DIR / crashed).exists()
