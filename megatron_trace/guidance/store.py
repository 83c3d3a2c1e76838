"""Where guidance records wait between the rollout that writes them and the training step that
reads them.

Its purpose, in the RL loop (megatron_trace/run/): the rollout puts each record the moment it
has fetched it, and the step that trains on it gets it back and releases the step afterwards. In
async mode (`algo.async_rollout`) the rollout of step k+1 runs while step k trains, so k+1's records
are written, and past the memory budget spilled, on the writer thread during step k's training;
the waiting batch holds handles, not bytes, and host memory for waiting guidance stays within
`guidance.memory_budget_mb`. Records are read back when their step starts (a memory read or one
mmap read per spilled record), not prefetched earlier: the trainer needs all of a step's records
for its first micro-batches, and reading them sooner would only move the bytes back into memory.

The rollout produces one record (a GuidanceRecord: tensors) per sample; training reads it a few
seconds or a few steps later. `put` must not stall the rollout, so records go through a bounded
queue to one writer thread (a full queue blocks `put`: back-pressure instead of unbounded host
memory). The writer keeps records as they are, objects in host memory, up to `memory_budget_bytes`
of their tensors; past it it writes their safetensors bytes (`GuidanceRecord.to_bytes`, on the
writer thread, so the rollout never serializes) to shard files in a private directory under
`spill_dir`, read back through `mmap`: the disk is the only place a record becomes bytes here, and
nothing is pickled. `release_step` frees a whole step once training is done with it, unlinking a
shard as soon as its last record is released.

A failed spill write (a full disk above all) stops the writer; every later put/get raises
GuidanceStoreError naming the spill dir, rather than training silently without guidance.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import shutil
import tempfile
import threading
from dataclasses import dataclass

from .record import GuidanceRecord

_STOP = object()


class GuidanceStoreError(RuntimeError):
    """The store can no longer accept or serve records (spill failure, or closed)."""


@dataclass(frozen=True)
class StoredRecord:
    """A sample's guidance record waiting in a GuidanceStore under `key`, in place of the record."""

    key: str


@dataclass
class _Shard:
    path: str
    size: int = 0  # bytes appended so far
    live: int = 0  # records in it not yet released
    sealed: bool = False  # no more appends: it may be unlinked once live reaches 0


@dataclass
class _Entry:
    step: int
    nbytes: int  # the record's tensor bytes (in memory) or its serialized bytes (spilled)
    positions: int
    record: GuidanceRecord | None = None  # in memory, or
    shard: int = -1  # spilled: shard number, offset, length (= nbytes)
    offset: int = 0


class GuidanceStore:
    """Asynchronous, memory-budgeted, disk-spilling store of guidance records.

    memory_budget_bytes: host bytes of stored records' tensors (the queue's in-flight records, at
        most `max_queue`, come on top).
    spill_dir: where spill shards go (a private subdirectory is made in it and removed by close).
    max_queue: records in flight to the writer before `put` blocks.
    shard_bytes: a shard is sealed and a new one started once it reaches this size.
    """

    def __init__(
        self, memory_budget_bytes: int, spill_dir: str | os.PathLike, max_queue: int = 64, shard_bytes: int = 256 << 20
    ) -> None:
        if memory_budget_bytes < 0 or max_queue < 1 or shard_bytes < 1:
            raise ValueError("GuidanceStore needs memory_budget_bytes >= 0, max_queue >= 1, shard_bytes >= 1")
        self.memory_budget_bytes = int(memory_budget_bytes)
        self.spill_dir = os.fspath(spill_dir)
        self.shard_bytes = int(shard_bytes)
        self._dir: str | None = None  # made on first spill: a store that never spills touches no disk
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # signalled whenever a put lands or fails
        self._entries: dict[str, _Entry] = {}
        self._pending: dict[str, int] = {}  # sample_id -> step, queued but not yet stored
        self._by_step: dict[int, set[str]] = {}
        self._shards: dict[int, _Shard] = {}
        self._active: int | None = None  # the shard being appended to (writer-owned file handle)
        self._active_fh = None
        self._next_shard = 0
        self._mem_bytes = 0
        self._spilled_total = 0
        self._bytes_total = 0
        self._positions_total = 0
        self._error: GuidanceStoreError | None = None
        self._closed = False
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        # Daemon: a store someone forgot to close must not keep the interpreter alive.
        self._thread = threading.Thread(target=self._writer, name="guidance-store-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API

    def put(self, sample_id: str, step: int, record: GuidanceRecord) -> StoredRecord:
        """Queue a record; returns its handle at once unless the queue is full (then it blocks)."""
        if not isinstance(record, GuidanceRecord):
            raise TypeError(f"the guidance store holds GuidanceRecords; got {type(record).__name__}")
        record.validate()  # a record whose sites disagree fails its producer, not the writer
        with self._lock:
            self._check()
            if sample_id in self._entries or sample_id in self._pending:
                raise ValueError(f"guidance record {sample_id!r} is already in the store")
            self._pending[sample_id] = step
        item = (sample_id, int(step), record)
        while True:  # poll, so a put blocked on a full queue wakes up when the writer dies
            try:
                self._queue.put(item, timeout=0.05)
                return StoredRecord(sample_id)
            except queue.Full:
                with self._lock:
                    if self._error is not None or self._closed:
                        self._pending.pop(sample_id, None)
                        self._check()

    def get(self, sample_id: str) -> GuidanceRecord:
        """The record; waits for a pending put of this id."""
        entry, fd = self._entry(sample_id)
        if fd is None:
            return entry.record
        try:
            with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
                return GuidanceRecord.from_bytes(mm[entry.offset : entry.offset + entry.nbytes])
        finally:
            os.close(fd)

    def get_bytes(self, sample_id: str) -> bytes:
        """The record's safetensors bytes, for a process boundary (the trainer's other ranks)."""
        entry, fd = self._entry(sample_id)
        if fd is None:
            return entry.record.to_bytes()
        try:
            with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
                return mm[entry.offset : entry.offset + entry.nbytes]
        finally:
            os.close(fd)

    def _entry(self, sample_id: str) -> tuple[_Entry, int | None]:
        """The entry, and for a spilled one an open descriptor of its shard (the caller closes it)."""
        with self._cond:
            while sample_id in self._pending and self._error is None:
                self._cond.wait()
            self._check()
            e = self._entries.get(sample_id)
            if e is None:
                raise KeyError(
                    f"guidance record {sample_id!r} is not in the store (never put, or its step was released)"
                )
            if e.record is not None:
                return e, None
            # Open under the lock: once we hold a descriptor, a concurrent release may unlink the
            # shard and the read still sees the bytes.
            return e, os.open(self._shards[e.shard].path, os.O_RDONLY)

    def __contains__(self, sample_id: str) -> bool:
        with self._lock:
            return sample_id in self._entries or sample_id in self._pending

    def release_step(self, step: int) -> int:
        """Delete every record of `step` (waiting for its pending puts); returns how many."""
        with self._cond:
            while step in self._pending.values() and self._error is None:
                self._cond.wait()
            ids = self._by_step.pop(step, set())
            for sid in ids:
                e = self._entries.pop(sid)
                if e.record is not None:
                    self._mem_bytes -= e.nbytes
                    continue
                shard = self._shards[e.shard]
                shard.live -= 1
                if shard.live == 0 and shard.sealed:
                    self._unlink_shard(e.shard)
            return len(ids)

    def stats(self) -> dict:
        """records/pending now, bytes_in_memory (tensors) and bytes_on_disk (serialized) now,
        bytes_spilled_total (serialized) and bytes_total (every record's tensor bytes ever put),
        bytes_per_token = bytes_total / positions_total."""
        with self._lock:
            return {
                "records": len(self._entries),
                "pending": len(self._pending),
                "bytes_in_memory": self._mem_bytes,
                "bytes_spilled_total": self._spilled_total,
                "bytes_on_disk": sum(s.size for s in self._shards.values()),
                "shards": len(self._shards),
                "bytes_total": self._bytes_total,
                "positions_total": self._positions_total,
                "bytes_per_token": self._bytes_total / self._positions_total if self._positions_total else 0.0,
            }

    def flush(self) -> None:
        """Wait until every queued record is stored (or the writer failed)."""
        with self._cond:
            while self._pending and self._error is None:
                self._cond.wait()
            self._check()

    def close(self) -> None:
        """Stop the writer and remove the spill files. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while self._thread.is_alive():
            try:
                self._queue.put(_STOP, timeout=0.05)
                break
            except queue.Full:
                continue
        self._thread.join()
        with self._cond:
            if self._active_fh is not None:
                self._active_fh.close()
                self._active_fh = None
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
            self._entries.clear()
            self._pending.clear()
            self._by_step.clear()
            self._shards.clear()
            self._mem_bytes = 0
            self._cond.notify_all()

    def __enter__(self) -> GuidanceStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ writer thread

    def _check(self) -> None:
        if self._error is not None:  # a fresh exception each time, chained to the OSError
            raise GuidanceStoreError(str(self._error)) from self._error.__cause__
        if self._closed:
            raise GuidanceStoreError("the guidance store is closed")

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            sid, step, record = item
            try:
                self._store(sid, step, record)
            except OSError as e:
                why = "the disk is full (ENOSPC)" if e.errno == errno.ENOSPC else f"{type(e).__name__}: {e}"
                err = GuidanceStoreError(
                    f"guidance store: spilling to {self.spill_dir} failed: {why}. Free space there, point "
                    f"the spill dir elsewhere, or raise the memory budget; the store has stopped."
                )
                err.__cause__ = e
                with self._cond:
                    self._error = err
                    self._pending.clear()  # the waiters wake up and raise
                    self._cond.notify_all()
                return  # the thread stops; puts poll and see the error

    def _store(self, sid: str, step: int, record: GuidanceRecord) -> None:
        n, positions = record.nbytes(), record.num_positions
        with self._cond:
            if self._mem_bytes + n <= self.memory_budget_bytes:
                self._add(sid, _Entry(step, n, positions, record=record), n)
                self._mem_bytes += n
                return
        # Serialization and disk I/O outside the lock: gets of in-memory records must not wait for them.
        data = record.to_bytes()
        shard, offset = self._append(data)
        with self._cond:
            self._shards[shard].size = offset + len(data)
            self._shards[shard].live += 1
            self._add(sid, _Entry(step, len(data), positions, shard=shard, offset=offset), n)
            self._spilled_total += len(data)
            if offset + len(data) >= self.shard_bytes:
                self._seal_active()

    def _add(self, sid: str, entry: _Entry, record_bytes: int) -> None:
        # Caller holds the lock. The totals count the records' tensor bytes, spilled or not.
        self._entries[sid] = entry
        self._by_step.setdefault(entry.step, set()).add(sid)
        self._pending.pop(sid, None)
        self._bytes_total += record_bytes
        self._positions_total += entry.positions
        self._cond.notify_all()

    def _append(self, data: bytes) -> tuple[int, int]:
        """Append to the active shard (opening a new one if needed); returns (shard, offset)."""
        with self._lock:
            active = self._shards.get(self._active) if self._active is not None else None
            if active is not None and active.live == 0 and active.size:
                # Everything in it was released: unlink it and start afresh rather than let a
                # never-filled shard hold dead bytes. (Not truncate: a reader may still have it
                # mapped, and touching a mapping past a truncated end is SIGBUS; unlink is safe.)
                self._seal_active()
        if self._active is None:
            if self._dir is None:
                os.makedirs(self.spill_dir, exist_ok=True)
                self._dir = tempfile.mkdtemp(prefix="guidance-", dir=self.spill_dir)
            num = self._next_shard
            self._next_shard += 1
            path = os.path.join(self._dir, f"shard-{num:06d}.bin")
            fh = open(path, "ab", buffering=0)
            with self._lock:
                self._shards[num] = _Shard(path)
                self._active, self._active_fh = num, fh
        offset = self._shards[self._active].size
        self._write(self._active_fh, data)
        return self._active, offset

    @staticmethod
    def _write(fh, data: bytes) -> None:
        """Write all of `data` (raw files may write short). Tests patch this to simulate ENOSPC."""
        view = memoryview(data)
        while view:
            view = view[fh.write(view) :]

    def _seal_active(self) -> None:
        # Caller holds the lock.
        self._active_fh.close()
        num = self._active
        self._active, self._active_fh = None, None
        self._shards[num].sealed = True
        if self._shards[num].live == 0:
            self._unlink_shard(num)

    def _unlink_shard(self, num: int) -> None:
        # Caller holds the lock.
        shard = self._shards.pop(num)
        try:
            os.unlink(shard.path)
        except FileNotFoundError:
            pass
