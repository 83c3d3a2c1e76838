"""Optimizer state on disk between optimizer steps (trainer.optimizer_offload=disk).

Adam's moments are touched once a step, by the optimizer, yet sit resident through the rollout, the
forward/backward and the weight sync: 4.7 GiB of the real 0.5B config's 11.7 GiB of trainer state
(fp32 m and v of 630M parameters), on top of which each of those phases makes its own peak. With
the offload they live in one file between steps:

    first optimizer.step() ─► store(): every moment written (O_DIRECT, no page cache), its memory freed
    ... sync, rollout, forward/backward: the moments are not in memory ...
    stepping(): the optimizer's own step() run one parameter at a time,
        read its m, v ─► Adam on that parameter ─► write them back in place, free them
        the next parameters' reads and the last ones' writes in flight meanwhile, at most
        trainer.optimizer_offload_window_mb of moments (or one parameter's) in memory at once

The bytes come back exactly (the step's result is bit-identical to a resident run: torch's CPU Adam
updates each parameter on its own). The optimizer's small per-parameter scalars (Adam's step count)
stay resident, and so do the moments of the first parameters in stepping order up to
trainer.optimizer_offload_keep_mb: less disk traffic a step for that much more memory, and the step
starts on them while the reads of the next ones are in flight. A checkpoint save or load holds the
whole state resident for its duration (`resident()`). This is ZeRO-Infinity's NVMe offload of the
optimizer state, for the one-box CPU run; the file costs a read and a write of the offloaded
moments' size each step, overlapped with Adam's arithmetic (perf/optimizer_offload_s is the time the
step waited on the disk; ~1.2 GiB/s each way on the project's VM disk with four requests in flight,
BENCHMARKS.md; benchmarks/optimizer_offload.py times it on yours).
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

_ALIGN = 4096  # O_DIRECT wants buffer, offset and length aligned to the device's block; a page always is
_BOUNCE = 64 << 20  # bytes staged per write of a tensor that is not page-aligned
_CHUNK = 32 << 20  # bytes per read or write in flight
_IO_THREADS = 4  # in flight at once: one O_DIRECT request at a time leaves the device half idle
_MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}

log = logging.getLogger(__name__)


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers under a Megatron optimizer (ChainedOptimizer or a single one)."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (/proc/mounts' longest matching mount point)."""
    path = Path(os.path.realpath(path))
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                if (path == Path(mount) or Path(mount) in path.parents) and len(mount) > len(best):
                    best, kind = mount, fields[2]
    except OSError:
        pass
    return kind


class OptimizerStateOffload:
    """Writes every non-scalar tensor of the optimizer's state to `path` and frees it (`store`),
    reads them back (`load`), or streams them through an optimizer step (`stepping`). The state is
    re-read from the optimizer at each store, so a checkpoint load's new tensors are what the next
    store writes."""

    def __init__(self, optimizer, path: str | os.PathLike, window_bytes: int = 512 << 20, keep_bytes: int = 0):
        self.optimizer = optimizer
        self.window_bytes = window_bytes  # stepping(): the most moment bytes held at once (one parameter's at least)
        self.keep_bytes = keep_bytes  # the first parameters' moments, in stepping order, that never go to the file
        self.kept_bytes = 0  # what the last store() kept
        self._kept: set[int] = set()  # ids of the kept parameters' state dicts
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fs = filesystem_type(self.path.parent)
        if fs in _MEMORY_FILESYSTEMS:
            # the bits stay right, the memory does not go anywhere: say so every time it is built
            log.warning(
                "trainer.optimizer_offload=disk writes to %s, a %s filesystem held in memory: offloading "
                "there saves no memory (point logging.run_dir at a disk)",
                self.path.parent,
                fs,
            )
        self.filesystem = fs
        self._layout: list[tuple[dict, str, int, torch.Size, torch.dtype]] = []  # (state, key, offset, shape, dtype)
        self._bounce = mmap.mmap(-1, _BOUNCE)  # page-aligned; its pages are given back after each store
        self._direct = True
        self.bytes = 0
        self.seconds = 0.0  # time spent on (or waiting for) the disk since the last take_seconds()
        self.held_peak = 0  # stepping(): the most moment bytes it held at once, last step

    @property
    def offloaded(self) -> bool:
        return bool(self._layout)

    def _state_tensors(self):
        """(state, key, tensor) of every moment that goes to the file: all but the first parameters'
        up to keep_bytes (a parameter's are kept whole or not at all)."""
        kept, keeping = 0, True
        self._kept = set()
        for opt in torch_optimizers(self.optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    state = opt.state.get(p)
                    tensors = [(k, state[k]) for k in sorted(state or {})]
                    tensors = [(k, t) for k, t in tensors if isinstance(t, torch.Tensor) and t.dim() > 0]
                    n = sum(t.numel() * t.element_size() for _, t in tensors)
                    keeping = keeping and kept + n <= self.keep_bytes
                    if tensors and keeping:
                        kept += n
                        self._kept.add(id(state))
                        continue
                    for key, t in tensors:
                        yield state, key, t
        self.kept_bytes = kept

    def _open(self, write: bool, read: bool = False) -> int:
        flags = (os.O_RDWR if read else os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
        if self._direct:
            try:
                return os.open(self.path, flags | os.O_DIRECT, 0o600)
            except OSError:  # tmpfs and some network filesystems refuse O_DIRECT
                self._direct = False
                log.warning(
                    "optimizer offload: %s refuses O_DIRECT; using buffered I/O and dropping the file's pages "
                    "after each write (slower)",
                    self.path.parent,
                )
        return os.open(self.path, flags, 0o600)

    def store(self) -> int:
        """Writes the state to the file and frees it; returns the bytes written (0: no state yet,
        before the first step)."""
        if self._layout:
            raise RuntimeError("optimizer offload: store() twice without a load() between")
        t0 = time.perf_counter()
        entries = list(self._state_tensors())
        if not entries:
            return 0
        fd = self._open(write=True)
        offset, staged = 0, []
        try:
            with ThreadPoolExecutor(_IO_THREADS) as pool:
                jobs = []
                for state, key, t in entries:
                    src = memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy())
                    n = len(src)
                    # a tensor load() made is page-aligned: its whole blocks go to the file as they are;
                    # Adam's own (the first step's, a checkpoint's) and the tail of any go through the bounce
                    direct = (n // _ALIGN) * _ALIGN if t.data_ptr() % _ALIGN == 0 else 0
                    for pos in range(0, direct, _CHUNK):
                        jobs.append(pool.submit(_write_all, fd, src[pos : min(pos + _CHUNK, direct)], offset + pos))
                    staged.append((src[direct:], offset + direct))
                    self._layout.append((state, key, offset, t.shape, t.dtype))
                    offset += _aligned(n)
                for f in jobs:
                    f.result()
            bounce = memoryview(self._bounce)
            for src, at in staged:
                for pos in range(0, len(src), _BOUNCE):
                    chunk = src[pos : pos + _BOUNCE]
                    bounce[: len(chunk)] = chunk
                    _write_all(fd, bounce[: _aligned(len(chunk))], at + pos)
            if not self._direct:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        del entries, staged, src
        for state, key, *_ in self._layout:
            state[key] = None  # the last reference: the memory goes back (a large tensor is its own mmap)
        self._bounce.madvise(mmap.MADV_DONTNEED)  # its 64 MiB go back too
        self.bytes = offset
        self.seconds += time.perf_counter() - t0
        return offset

    def load(self) -> None:
        """Reads the state back into fresh page-aligned tensors, straight from the file (no-op when
        nothing is stored)."""
        if not self._layout:
            return
        t0 = time.perf_counter()
        fd = self._open(write=False)
        try:
            with ThreadPoolExecutor(_IO_THREADS) as pool:
                jobs, made = [], []
                for entry in self._layout:
                    buf, reads = _submit_read(pool, fd, entry)
                    jobs += reads
                    made.append((entry, buf))
                for f in jobs:
                    f.result()
            for (state, key, _, shape, dtype), buf in made:
                state[key] = _tensor_of(buf, shape, dtype)
            if not self._direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        self._layout = []
        self.seconds += time.perf_counter() - t0

    @contextlib.contextmanager
    def stepping(self):
        """Inside the block each torch optimizer's step() streams its state from the file and back,
        a parameter at a time (the module docstring draws it); the state is on disk after it. Before
        the first step (nothing on disk yet), or when a parameter about to step has state the file
        does not hold, the block runs resident instead (the same bits)."""
        self.held_peak = 0
        if not self._layout:
            with self.resident():
                yield
            return
        originals = []
        for opt in torch_optimizers(self.optimizer):
            originals.append((opt, opt.__dict__.get("step")))
            opt.step = _streamed_step(self, opt, opt.step)
        try:
            yield
        finally:
            for opt, own in originals:
                if own is None:
                    del opt.step
                else:
                    opt.step = own

    def _units(self, opt) -> list | None:
        """(group index, parameter, its layout entries) for each parameter of `opt` that will step, in
        the optimizer's order; None when one of them has state the file does not hold."""
        by_state: dict[int, list] = {}
        for entry in self._layout:
            by_state.setdefault(id(entry[0]), []).append(entry)
        units = []
        for gi, group in enumerate(opt.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue  # torch's step skips it; its state stays in the file
                state = opt.state.get(p)
                entries = by_state.get(id(state), [])
                resident = [k for k, t in (state or {}).items() if isinstance(t, torch.Tensor) and t.dim() > 0]
                if id(state) in self._kept and resident and not entries:  # kept in memory: steps in place
                    units.append((gi, p, []))
                    continue
                if not state or resident:  # Adam would make or use state the file does not hold
                    return None
                units.append((gi, p, entries))
        return units

    @contextlib.contextmanager
    def resident(self):
        """The state in memory inside the block (an optimizer step, a checkpoint), on disk after it."""
        self.load()
        try:
            yield
        finally:
            self.store()

    def take_seconds(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s

    def close(self) -> None:
        """Deletes the file; the state is dropped with it (finish_training: no further steps)."""
        self._layout = []
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _streamed_step(offload: OptimizerStateOffload, opt, step):
    """`opt.step` run on one parameter at a time (every other group emptied), each parameter's state
    read just before and written back in place just after; reads ahead and writes behind in flight
    up to offload.window_bytes of moments held (one parameter's at least). The parameters that step
    are known only now (Megatron hands the main params their grads inside its step)."""

    def streamed(closure=None):
        if closure is not None:
            raise RuntimeError("optimizer offload: a streamed step takes no closure")
        units = offload._units(opt)
        if units is None:  # state the file does not hold (a parameter's first step): whole, same bits
            log.warning(
                "optimizer offload: a parameter steps with state %s does not hold (its first step); this step "
                "reads every moment back and holds them all (%.2f GiB)",
                offload.path,
                offload.bytes / 2**30,
            )
            offload.load()
            step()
            offload.store()
            return None
        groups = opt.param_groups
        params = [g["params"] for g in groups]
        fd = offload._open(write=True, read=True)
        reads: deque = deque()  # ([(entry, buf)], futures) submitted, not yet stepped
        writes: deque = deque()  # ([bufs], futures, bytes) submitted, not yet done
        held, waited, nxt = 0, 0.0, 0
        nbytes = [sum(_padded(e) for e in u[2]) for u in units]

        def wait(futures) -> None:
            nonlocal waited
            t0 = time.perf_counter()
            for f in futures:
                f.result()
            waited += time.perf_counter() - t0

        def retire_writes(block: bool) -> None:
            nonlocal held
            while writes and (block or all(f.done() for f in writes[0][1])):
                _, futures, n = writes.popleft()
                wait(futures)
                held -= n
                block = False

        try:
            with ThreadPoolExecutor(_IO_THREADS) as pool:
                for i, (gi, p, _) in enumerate(units):
                    while nxt < len(units):  # read ahead while the window allows
                        retire_writes(block=False)
                        if held and held + nbytes[nxt] > offload.window_bytes:
                            if nxt > i or not writes:
                                break
                            retire_writes(block=True)  # this parameter's read waits for room
                            continue
                        made, futures = [], []
                        for entry in units[nxt][2]:
                            buf, jobs = _submit_read(pool, fd, entry)
                            made.append((entry, buf))
                            futures += jobs
                        reads.append((made, futures))
                        held += nbytes[nxt]
                        offload.held_peak = max(offload.held_peak, held)
                        nxt += 1
                    made, futures = reads.popleft()
                    wait(futures)
                    for (state, key, _, shape, dtype), buf in made:
                        state[key] = _tensor_of(buf, shape, dtype)
                    for g in groups:
                        g["params"] = []
                    groups[gi]["params"] = [p]
                    try:
                        step()
                    finally:
                        for g, ps in zip(groups, params):
                            g["params"] = ps
                    jobs = []
                    for (state, key, offset, _, _), buf in made:
                        t = state[key]
                        mine = _tensor_of(buf, t.shape, t.dtype)
                        if t.data_ptr() != mine.data_ptr():  # the optimizer replaced it: the new values go
                            mine.copy_(t)
                        del mine, t
                        state[key] = None
                        view = memoryview(buf)
                        jobs += [
                            pool.submit(_write_all, fd, view[pos : pos + _CHUNK], offset + pos)
                            for pos in range(0, len(buf), _CHUNK)
                        ]
                        del view
                    writes.append(([b for _, b in made], jobs, nbytes[i]))
                    made = buf = None  # this unit's references go (a kept unit made none)
                while writes:
                    retire_writes(block=True)
            if not offload._direct:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
            offload.seconds += waited
        return None

    return streamed


def _aligned(n: int) -> int:
    """n bytes rounded up to whole O_DIRECT blocks."""
    return -(-n // _ALIGN) * _ALIGN


def _padded(entry) -> int:
    _, _, _, shape, dtype = entry
    return _aligned(math.prod(shape) * dtype.itemsize)


def _submit_read(pool: ThreadPoolExecutor, fd: int, entry) -> tuple[mmap.mmap, list]:
    """A page-aligned buffer of its own for one layout entry (an anonymous mapping: O_DIRECT takes it,
    and it is unmapped when the last tensor on it dies) and the reads that fill it."""
    _, _, offset, _, _ = entry
    n = _padded(entry)
    buf = mmap.mmap(-1, n)
    buf.madvise(mmap.MADV_HUGEPAGE)  # fewer page faults where the kernel allows it
    view = memoryview(buf)
    jobs = [pool.submit(_read_all, fd, view[pos : min(pos + _CHUNK, n)], offset + pos) for pos in range(0, n, _CHUNK)]
    del view
    return buf, jobs


def _tensor_of(buf: mmap.mmap, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)


def _write_all(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        done += os.pwrite(fd, buf[done:], offset + done)


def _read_all(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got == 0:  # past the end: the tail of the last padded block
            buf[done:] = b"\0" * (len(buf) - done)
            return
        done += got
