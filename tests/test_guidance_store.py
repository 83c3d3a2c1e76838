"""GuidanceStore: async put/get from memory and spill shards, release, back-pressure, ENOSPC."""

import errno
import os
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.fp4 import nvfp4
from megatron_trace.guidance import GuidanceRecord, GuidanceStore, encode_records, make_site
from megatron_trace.guidance.store import GuidanceStoreError
from tests.helpers import make_record
from tests.waiting import wait_until

SITES = ("model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj")


def assert_same(a: GuidanceRecord, b: GuidanceRecord):
    assert (a.sample_id, a.mode, a.num_positions) == (b.sample_id, b.mode, b.num_positions)
    assert a.sites.keys() == b.sites.keys()
    for n in a.sites:
        for f in ("scale", "global_scale", "payload"):
            assert torch.equal(getattr(a.sites[n], f), getattr(b.sites[n], f)), (n, f)


def shard_files(store):
    if store._dir is None or not os.path.isdir(store._dir):
        return []
    return sorted(os.listdir(store._dir))


@pytest.fixture
def store_factory(tmp_path):
    made = []

    def make(**kw):
        kw.setdefault("memory_budget_bytes", 1 << 30)
        kw.setdefault("spill_dir", tmp_path / "spill")
        s = GuidanceStore(**kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_round_trip_in_memory(store_factory):
    store = store_factory()
    recs = [make_record(f"r{i}", seed=i, mode=("full", "mantissa")[i % 2]) for i in range(4)]
    for r in recs:
        store.put(r.sample_id, 0, r)
    for r in recs:
        assert_same(store.get(r.sample_id), r)
    st = store.stats()
    assert st["records"] == 4 and st["bytes_spilled_total"] == 0 and st["bytes_on_disk"] == 0
    assert st["bytes_in_memory"] == sum(r.nbytes() for r in recs)  # the records' own tensors
    assert store._dir is None  # never spilled: no disk touched


def test_spill_past_budget_round_trip(store_factory):
    recs = [make_record(f"r{i}", seed=i) for i in range(6)]
    held, size = recs[0].nbytes(), len(recs[0].to_bytes())  # in memory: its tensors; on disk: its bytes
    store = store_factory(memory_budget_bytes=2 * held, shard_bytes=2 * size)
    for r in recs:
        store.put(r.sample_id, 0, r)
    store.flush()
    st = store.stats()
    assert st["records"] == 6
    assert st["bytes_in_memory"] == 2 * held
    assert st["bytes_spilled_total"] == 4 * size == st["bytes_on_disk"]
    assert len(shard_files(store)) == 2  # two sealed shards of two records each
    for r in recs:
        assert_same(store.get(r.sample_id), r)
    assert store._entries["r0"].record is recs[0] and store._entries["r5"].record is None  # kept as it was put


def test_zero_budget_spills_everything(store_factory):
    store = store_factory(memory_budget_bytes=0)
    r = make_record("only")
    store.put("only", 3, r)
    assert_same(store.get("only"), r)
    assert store.stats()["bytes_in_memory"] == 0 and store.stats()["bytes_on_disk"] == len(r.to_bytes())


def test_release_step_deletes_records_and_shards(store_factory):
    recs = {step: [make_record(f"s{step}-{i}", seed=10 * step + i) for i in range(3)] for step in range(3)}
    size = recs[0][0].nbytes()
    # Budget for one record's tensors, and shards that seal after each record: one shard file per spill.
    store = store_factory(memory_budget_bytes=size, shard_bytes=1)
    for step, rs in recs.items():
        for r in rs:
            store.put(r.sample_id, step, r)
    store.flush()
    assert len(shard_files(store)) == 8  # 9 records, the first in memory
    assert store.release_step(1) == 3
    assert len(shard_files(store)) == 5
    for r in recs[1]:
        with pytest.raises(KeyError, match=r.sample_id):
            store.get(r.sample_id)
    for step in (0, 2):
        for r in recs[step]:
            assert_same(store.get(r.sample_id), r)
    assert store.release_step(0) == 3 and store.release_step(2) == 3
    assert shard_files(store) == [] and store.stats()["bytes_on_disk"] == 0
    assert store.stats()["records"] == 0 and store.stats()["bytes_in_memory"] == 0
    assert store.release_step(7) == 0


def test_shared_shard_removed_only_when_all_released(store_factory):
    a, b = make_record("a", seed=1), make_record("b", seed=2)
    store = store_factory(memory_budget_bytes=0, shard_bytes=2 * len(a.to_bytes()))
    store.put("a", 0, a)
    store.put("b", 1, b)
    store.flush()
    assert len(shard_files(store)) == 1  # both in one (now sealed) shard
    store.release_step(0)
    assert len(shard_files(store)) == 1
    assert_same(store.get("b"), b)
    store.release_step(1)
    assert shard_files(store) == []


def test_fully_released_active_shard_is_replaced(store_factory):
    r = make_record("x")
    store = store_factory(memory_budget_bytes=0)  # default shard size: never seals here
    for step in range(5):
        store.put(f"x{step}", step, r)
        store.flush()
        store.release_step(step)
    # One shard, holding only the last (released) record: each append after a full release
    # starts a new shard instead of growing the old one to 5 records.
    assert len(shard_files(store)) == 1
    assert store.stats()["bytes_on_disk"] == len(r.to_bytes())


def test_get_waits_for_pending_put_and_unknown_key(store_factory):
    store = store_factory()
    gate = threading.Event()
    real = store._store

    def slow_store(*args):
        gate.wait(5)
        real(*args)

    store._store = slow_store  # the writer calls self._store: hold it until the gate opens
    r = make_record("late")
    store.put("late", 0, r)
    assert "late" in store
    threading.Timer(0.2, gate.set).start()
    t0 = time.monotonic()
    assert_same(store.get("late"), r)
    assert time.monotonic() - t0 >= 0.15
    with pytest.raises(KeyError, match="'nope'"):
        store.get("nope")
    with pytest.raises(ValueError, match="already in the store"):
        store.put("late", 0, r)


def test_back_pressure_blocks_put(store_factory):
    store = store_factory(max_queue=2)
    gate = threading.Event()
    real = store._store
    store._store = lambda *a: (gate.wait(5), real(*a))
    data = make_record("r")
    # One record is held by the writer, two fill the queue: the fourth put must block.
    for i in range(3):
        store.put(f"r{i}", 0, data)
    done = threading.Event()
    t = threading.Thread(target=lambda: (store.put("r3", 0, data), done.set()))
    t.start()
    assert not done.wait(0.3), "put returned although the queue was full"
    gate.set()
    assert done.wait(5)
    t.join()
    store.flush()
    assert store.stats()["records"] == 4


def test_enospc_surfaces_as_clear_error(store_factory, tmp_path):
    store = store_factory(memory_budget_bytes=0)

    def full_disk(fh, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    store._write = full_disk
    data = make_record("r")
    store.put("r0", 0, data)  # accepted: the failure happens in the writer
    spill = str(tmp_path / "spill")
    with pytest.raises(GuidanceStoreError, match="ENOSPC") as e:
        store.get("r0")
    assert spill in str(e.value)
    with pytest.raises(GuidanceStoreError, match="disk is full"):
        store.put("r1", 0, data)
    with pytest.raises(GuidanceStoreError):
        store.flush()
    assert isinstance(store.stats(), dict)  # stats keep working for the error report
    store.close()


def test_enospc_wakes_a_put_blocked_on_full_queue(store_factory):
    store = store_factory(memory_budget_bytes=0, max_queue=1)
    gate = threading.Event()

    def full_disk(fh, data):
        gate.wait(5)
        raise OSError(errno.ENOSPC, "No space left on device")

    store._write = full_disk
    data = make_record("r")
    store.put("r0", 0, data)
    store.put("r1", 0, data)
    errors = []

    def blocked():
        try:
            store.put("r2", 0, data)
        except GuidanceStoreError as e:
            errors.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    # r2 is registered before its put waits on the full queue (r1 fills it, the writer holds r0):
    # from then on it can only leave through the writer's error, whenever the gate opens.
    wait_until(lambda: "r2" in store, "the third put to be pending")
    gate.set()
    t.join(5)
    assert not t.is_alive() and len(errors) == 1 and "spill" in str(errors[0])


def test_bytes_or_a_broken_record_rejected_at_put(store_factory):
    """The store holds records; bytes, or a record whose sites disagree on its positions, fail the
    producer at put, never the writer thread."""
    store = store_factory()
    with pytest.raises(TypeError, match="GuidanceRecord"):
        store.put("bad", 0, b"\x01")
    broken = make_record("bad", positions=4)
    broken.num_positions = 5
    with pytest.raises(ValueError, match="covers 4 positions"):
        store.put("bad", 0, broken)
    assert "bad" not in store


def test_stats_bytes_per_token(store_factory):
    store = store_factory(memory_budget_bytes=0)
    recs = [make_record(f"r{i}", positions=p, seed=i) for i, p in enumerate((3, 7))]
    for r in recs:
        store.put(r.sample_id, 0, r)
    store.flush()
    st = store.stats()
    total = sum(r.nbytes() for r in recs)  # the records' tensors, spilled or not
    assert st["bytes_total"] == total and st["positions_total"] == 10
    assert st["bytes_per_token"] == pytest.approx(total / 10)


def test_concurrent_producers_and_consumers(store_factory):
    size = len(make_record("x").to_bytes())
    store = store_factory(memory_budget_bytes=10 * size, max_queue=4, shard_bytes=3 * size)
    n_threads, per = 4, 12
    recs = {f"t{t}-{i}": make_record(f"t{t}-{i}", seed=100 * t + i) for t in range(n_threads) for i in range(per)}
    errors = []
    queued = {sid: threading.Event() for sid in recs}  # put returned: the id is known to the store

    def producer(t):
        for i in range(per):
            sid = f"t{t}-{i}"
            store.put(sid, i % 3, recs[sid])
            queued[sid].set()

    def consumer(t):
        try:
            for i in range(per):
                sid = f"t{t}-{i}"
                assert queued[sid].wait(10)
                assert_same(store.get(sid), recs[sid])  # may still be pending in the queue
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=producer, args=(t,)) for t in range(n_threads)]
    threads += [threading.Thread(target=consumer, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors, errors[:3]
    store.flush()
    assert store.stats()["records"] == n_threads * per
    assert store.stats()["bytes_spilled_total"] > 0
    released = sum(store.release_step(s) for s in range(3))
    assert released == n_threads * per
    assert len(shard_files(store)) <= 1  # at most the unsealed active shard remains


def test_close_removes_spill_files_and_rejects_use(tmp_path):
    store = GuidanceStore(0, tmp_path / "spill")
    store.put("a", 0, make_record("a"))
    store.flush()
    private = store._dir
    assert os.listdir(private)
    store.close()
    assert not os.path.exists(private) and os.path.isdir(tmp_path / "spill")
    with pytest.raises(GuidanceStoreError, match="closed"):
        store.put("b", 0, make_record("b"))
    store.close()  # idempotent


@pytest.mark.parametrize("mode", ["full", "mantissa"])
def test_record_bytes_are_safetensors_and_round_trip(mode):
    from safetensors.torch import load

    rec = make_record("s0", positions=4, mode=mode, seed=2)
    data = rec.to_bytes()
    tensors = load(data)  # any safetensors reader takes the bytes
    for name, site in rec.sites.items():
        for f in ("scale", "global_scale", "payload"):
            assert torch.equal(tensors[f"{name}/{f}"], getattr(site, f))
    assert_same(GuidanceRecord.from_bytes(data), rec)


def _rewrite_header(data: bytes, edit) -> bytes:
    import json

    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    edit(header)
    head = json.dumps(header).encode()
    return len(head).to_bytes(8, "little") + head + data[8 + n :]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h: h[next(k for k in h if k.endswith("/payload"))].update(data_offsets=[0, 10**9]), "outside"),
        (lambda h: h[next(k for k in h if k.endswith("/scale"))].update(shape=[999, 4]), "do not hold shape"),
        (lambda h: h[next(k for k in h if k.endswith("/scale"))].update(dtype="F64"), "bad header entry"),
        (lambda h: h["__metadata__"].pop("sites"), "lacks"),
    ],
)
def test_damaged_record_headers_are_refused_by_name(edit, message):
    data = _rewrite_header(make_record("s0").to_bytes(), edit)
    with pytest.raises(ValueError, match=message):
        GuidanceRecord.from_bytes(data)
    with pytest.raises(ValueError, match="not valid JSON"):
        GuidanceRecord.from_bytes((5).to_bytes(8, "little") + b"{nope")


@settings(max_examples=25)
@given(
    lens=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    mode=st.sampled_from(["full", "mantissa"]),
    static_kv=st.booleans(),
    seed=st.integers(0, 100),
)
def test_batch_encoding_writes_each_records_own_bytes(lens, mode, static_kv, seed):
    """encode_records (the engine's writer, one conversion per tensor per batch) gives, sample by
    sample, the bytes of that sample's own record, which a plain safetensors reader loads."""
    from safetensors.torch import load

    g = torch.Generator().manual_seed(seed)
    total, sites = sum(lens), {}
    for name in ("model.layers.0.mlp.down_proj", "model.layers.0.self_attn.k_cache"):
        static = static_kv and name.endswith("k_cache")
        q = nvfp4.quantize(
            torch.randn(total, 32, generator=g),
            **({"global_scale": torch.tensor(0.75)} if static else {"per_row_global": True}),
        )
        sites[name] = make_site(q.scale, q.global_scale, q.data, mode)
    ids = [f"sample-{i}" for i in range(len(lens))]
    got = encode_records(ids, mode, lens, sites)
    start = 0
    for sid, n, data in zip(ids, lens, got):
        want = GuidanceRecord(sid, mode, n, {k: s.select(start, start + n) for k, s in sites.items()})
        assert data == want.to_bytes()
        assert_same(GuidanceRecord.from_bytes(data), want)
        tensors = load(data)
        for name, site in want.sites.items():
            for f in ("scale", "global_scale", "payload"):
                assert torch.equal(tensors[f"{name}/{f}"], getattr(site, f))
        start += n
    with pytest.raises(ValueError, match="holds .* positions; the samples have"):
        encode_records(ids, mode, [n + 1 for n in lens], sites)
