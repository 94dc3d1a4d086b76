"""Faults the disk tier must survive: kill -9 mid-write, corrupted bytes, concurrent processes,
a full disk. Each runs real processes against a real directory."""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ragfuse.engine.kvstore import (
    CorruptEntryError,
    DiskFullError,
    DiskTier,
    EntryMeta,
    KVShape,
    MemoryTier,
    TieredKVStore,
    open_source,
)
from tests.kvstore_helpers import DIM, HEADS, LAYERS, make_entry, same

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _check_consistent(root: Path) -> DiskTier:
    """Every listed entry reads back and verifies; nothing half-written lies around."""
    disk = DiskTier(root, capacity_bytes=1 << 40)
    for key in disk.entry_keys():
        assert disk.get(key) is not None, f"listed entry {key} does not verify"
    assert disk.stats().corrupt == 0
    assert not list(root.glob("data/*/*.tmp"))
    listed = {disk.path_of(k) for k in disk.entry_keys()}
    assert set(root.glob("data/*/*.safetensors")) == listed
    return disk


WRITER = """
    import sys
    from ragfuse.engine.kvstore import DiskTier
    from tests.kvstore_helpers import make_entry
    disk = DiskTier(sys.argv[1], capacity_bytes=1 << 40)
    i = 0
    while True:
        disk.put(make_entry(i, tokens=4096))  # 2 MiB entries: the kill lands mid-write most times
        print(i, flush=True)
        i += 1
"""


def test_kill_9_mid_write_leaves_no_half_written_entry(tmp_path):
    for attempt in range(3):
        proc = _python(WRITER, str(tmp_path))
        # wait for three finished entries (not a fixed time: a loaded machine writes slowly), then
        # kill at a varying point of the writes that follow
        for want in ("0", "1", "2"):
            assert proc.stdout.readline().strip() == want, proc.stderr.read()
        time.sleep(0.01 + 0.02 * attempt)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    disk = _check_consistent(tmp_path)
    assert disk.stats().entries >= 3
    assert disk.get(make_entry(0, tokens=4096).key) is not None


def test_corrupt_entry_is_dropped_and_recomputed(tmp_path, engine):
    store = TieredKVStore([DiskTier(tmp_path, 1 << 30)])
    ids = engine.tokenizer.encode("Stored KV must never be served when its bytes are wrong.")
    (entry,) = store.get_or_compute(engine.fingerprint, engine.dtype, [ids], engine.compute_kv)
    disk = store.tier("disk")
    path = disk.path_of(entry.key)
    with open(path, "r+b") as f:  # flip bytes inside the last layer's data
        f.seek(path.stat().st_size - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert store.get(entry.key) is None
    assert disk.stats().corrupt == 1 and not disk.contains(entry.key) and not path.exists()
    (again,) = store.get_or_compute(engine.fingerprint, engine.dtype, [ids], engine.compute_kv)
    assert same(again, entry)  # recomputed from the model, identical to the first computation
    assert same(store.get(entry.key), entry)


def test_truncated_or_garbled_header_is_a_miss(tmp_path):
    disk = DiskTier(tmp_path, 1 << 30)
    a, b = make_entry(1), make_entry(2)
    disk.put(a)
    disk.put(b)
    disk.path_of(a.key).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    path_b = disk.path_of(b.key)
    path_b.write_bytes(path_b.read_bytes()[:-10])
    assert disk.get(a.key) is None and disk.get(b.key) is None
    assert disk.stats().corrupt == 2 and disk.stats().entries == 0


SHARER = """
    import sys
    from ragfuse.engine.kvstore import DiskTier
    from tests.kvstore_helpers import make_entry, same
    root, me = sys.argv[1], int(sys.argv[2])
    disk = DiskTier(root, capacity_bytes=int(sys.argv[3]))
    for round in range(40):
        i = (me * 7 + round) % 30  # overlapping keys between processes
        e = make_entry(i, tokens=64)
        disk.put(e)
        got = disk.get(make_entry((i + 3) % 30, tokens=64).key)
        assert got is None or same(got, make_entry((i + 3) % 30, tokens=64)), "served a wrong entry"
    s = disk.stats()
    assert s.corrupt == 0, s
    print("ok", flush=True)
"""


def test_processes_sharing_a_disk_store_do_not_corrupt_it(tmp_path):
    size = make_entry(0, tokens=64).nbytes + 2048
    capacity = 12 * size  # small: the processes keep evicting each other's entries
    procs = [_python(SHARER, str(tmp_path), str(me), str(capacity)) for me in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "ok", err
    disk = _check_consistent(tmp_path)
    assert 0 < disk.stats().bytes <= capacity


FILLER = """
    import resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    from ragfuse.engine.kvstore import DiskTier, DiskFullError
    from tests.kvstore_helpers import make_entry
    disk = DiskTier(sys.argv[1], capacity_bytes=1 << 40)
    try:
        disk.put(make_entry(99, tokens=8192))  # 4 MiB: over the 1 MiB file-size limit
    except DiskFullError as exc:
        print("full:", exc, flush=True)
"""


def test_full_disk_is_a_clear_error_and_the_store_stays_consistent(tmp_path):
    disk = DiskTier(tmp_path, capacity_bytes=1 << 40)
    kept = make_entry(1)
    disk.put(kept)
    disk.close()
    proc = _python(FILLER, str(tmp_path))
    out, err = proc.communicate(timeout=60)
    assert out.startswith("full: disk full while writing a KV entry"), (out, err)
    disk = _check_consistent(tmp_path)
    assert disk.entry_keys() == [kept.key] and same(disk.get(kept.key), kept)


def test_free_space_check_refuses_before_writing(tmp_path):
    # reserve the disk's whole size: more than is ever free, however other processes change it meanwhile
    disk = DiskTier(tmp_path, capacity_bytes=1 << 50, reserve_bytes=shutil.disk_usage(tmp_path).total)
    with pytest.raises(DiskFullError, match="no room on disk"):
        disk.put(make_entry(3))
    assert disk.entry_keys() == [] and not list(tmp_path.glob("data/*/*"))


def _flip_header_digit(path: Path, field: str, mask: int) -> None:
    """Flip bits ``mask`` of the last digit of ``field`` in an entry file's header (its JSON metadata)."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    i = raw.index(f'{field}\\": '.encode(), 8, 8 + n) + len(f'{field}\\": ')
    while chr(raw[i + 1]).isdigit():
        i += 1
    raw[i] ^= mask
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(("field", "mask"), [("num_layers", 0x06), ("num_tokens", 1), ("num_kv_heads", 1),
                                             ("head_dim", 1)])
def test_a_damaged_shape_field_in_the_header_is_corrupt_not_served(tmp_path, field, mask):
    """A shape field damaged (4 layers read as 2, one token or head more): the entry's checksum
    covers its whole metadata, so the entry is dropped as corrupt, by the whole-entry read and by
    the fusor's layer-by-layer source alike (the checksum covered only the layers': a short entry
    was served, or a layer read IndexError'd)."""
    disk = DiskTier(tmp_path, 1 << 30)
    store = TieredKVStore([disk])
    a, b = make_entry(1), make_entry(2)
    for e in (a, b):
        disk.put(e)
        _flip_header_digit(disk.path_of(e.key), field, mask)
    assert disk.get(a.key) is None
    damaged: list[str] = []
    assert open_source(store, b.key, damaged=damaged) is None
    assert len(damaged) == 1 and damaged[0].startswith("disk: ")  # told, so the caller can say so
    assert disk.stats().corrupt == 2 and disk.entry_keys() == []
    assert not list(tmp_path.glob("data/*/*.safetensors"))


def test_metadata_needs_one_checksum_per_layer():
    meta = make_entry(1).meta.to_json()
    with pytest.raises(CorruptEntryError, match="4 layers but 3 layer checksums"):
        EntryMeta.from_json({**meta, "layer_checksums": meta["layer_checksums"][:3]})
    with pytest.raises(CorruptEntryError, match="fails its checksum"):
        EntryMeta.from_json({**meta, "num_tokens": 31})


def test_an_entry_of_another_shape_than_the_model_is_dropped_by_its_reader(tmp_path):
    """An intact entry whose metadata is not the reading model's KV of the text's tokens (what a
    key collision or a writer's bug would leave) is dropped from every tier that holds it, counted
    corrupt, and the lookup is a miss, so the caller's recomputed KV can take its place."""
    cpu, disk = MemoryTier("cpu", "cpu", 1 << 20), DiskTier(tmp_path, 1 << 30)
    store = TieredKVStore([cpu, disk])
    e = make_entry(1, tokens=32)
    store.put(e)
    shape = KVShape(LAYERS, HEADS, DIM, torch.float32)
    assert open_source(store, e.key, shape, 32) is not None
    assert open_source(store, e.key, shape, 33) is None
    assert (cpu.stats().corrupt, disk.stats().corrupt) == (1, 1) and store.locate(e.key) is None
    store.put(e)
    assert open_source(store, e.key, KVShape(LAYERS + 1, HEADS, DIM, torch.float32)) is None
    assert store.locate(e.key) is None
    store.put(e)
    assert disk.contains(e.key)


def test_an_entry_file_removed_behind_the_manifest_is_stored_again(tmp_path):
    """A listed entry whose file went (a cleaner, a user): the miss unlists it, so the recomputed KV
    is stored again and served after, and the ghost stops counting toward the capacity (the row
    stayed: every later lookup recomputed, and the put found the key listed and stored nothing)."""
    disk = DiskTier(tmp_path, 1 << 30)
    store = TieredKVStore([disk])
    calls = []

    def compute(token_lists):
        calls.append(len(token_lists))
        e = make_entry(7)
        return [e.kv() for _ in token_lists]

    (first,) = store.get_or_compute("m", torch.float32, [[1, 2, 3]], compute)
    disk.path_of(first.key).unlink()
    for _ in range(3):
        (again,) = store.get_or_compute("m", torch.float32, [[1, 2, 3]], compute)
        assert same(again, first)
    assert calls == [1, 1] and disk.path_of(first.key).exists()
    assert disk.stats().bytes == disk.path_of(first.key).stat().st_size
    # a put finding the ghost row (no read went first) replaces it too
    other = make_entry(8)
    disk.put(other)
    disk.path_of(other.key).unlink()
    assert disk.put(other) == [] and same(disk.get(other.key), other)
