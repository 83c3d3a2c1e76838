"""Optimizer state on disk between optimizer steps (trainer.optimizer_offload=disk).

Adam's moments are touched once a step, by the optimizer, yet sit resident through the rollout, the
forward/backward and the weight sync: 4.7 GiB of the real 0.5B config's 11.7 GiB of trainer state
(fp32 m and v of 630M parameters), on top of which each of those phases makes its own peak. With
the offload they live in one file between steps:

    optimizer.step() ─► store(): every moment written (O_DIRECT, no page cache), its memory freed
    ... sync, rollout, forward/backward: the moments are not in memory ...
    load(): read back into page-aligned tensors of their own ─► optimizer.step()

The bytes come back exactly (the step's result is bit-identical to a resident run). The optimizer's
small per-parameter scalars (Adam's step count) stay resident. A checkpoint save or load holds the
state resident for its duration (`resident()`). This is ZeRO-Infinity's NVMe offload of the
optimizer state, for the one-box CPU run; the file costs a disk write and a read of the moments'
size each step (perf/optimizer_offload_s; ~1.2 GiB/s each way on the project's VM disk with four
requests in flight, BENCHMARKS.md; benchmarks/optimizer_offload.py times it on yours).
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import time
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
    reads them back (`load`). The state is re-read from the optimizer at each store, so a
    checkpoint load's new tensors are what the next store writes."""

    def __init__(self, optimizer, path: str | os.PathLike):
        self.optimizer = optimizer
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
        self.seconds = 0.0  # store + load time since the last take_seconds()

    @property
    def offloaded(self) -> bool:
        return bool(self._layout)

    def _state_tensors(self):
        for opt in torch_optimizers(self.optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    state = opt.state.get(p)
                    for key in sorted(state or {}):
                        t = state[key]
                        if isinstance(t, torch.Tensor) and t.dim() > 0:
                            yield state, key, t

    def _open(self, write: bool) -> int:
        flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
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
                    offset += -(-n // _ALIGN) * _ALIGN
                for f in jobs:
                    f.result()
            bounce = memoryview(self._bounce)
            for src, at in staged:
                for pos in range(0, len(src), _BOUNCE):
                    chunk = src[pos : pos + _BOUNCE]
                    bounce[: len(chunk)] = chunk
                    _write_all(fd, bounce[: -(-len(chunk) // _ALIGN) * _ALIGN], at + pos)
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
                for state, key, offset, shape, dtype in self._layout:
                    numel = math.prod(shape)
                    n = -(-numel * dtype.itemsize // _ALIGN) * _ALIGN
                    # its own anonymous mapping: page-aligned for O_DIRECT, unmapped when the tensor dies
                    buf = mmap.mmap(-1, n)
                    buf.madvise(mmap.MADV_HUGEPAGE)  # fewer page faults where the kernel allows it
                    view = memoryview(buf)
                    for pos in range(0, n, _CHUNK):
                        jobs.append(pool.submit(_read_all, fd, view[pos : min(pos + _CHUNK, n)], offset + pos))
                    made.append((state, key, buf, numel, shape, dtype))
                    del view
                for f in jobs:
                    f.result()
            for state, key, buf, numel, shape, dtype in made:
                state[key] = torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)
            if not self._direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        self._layout = []
        self.seconds += time.perf_counter() - t0

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
