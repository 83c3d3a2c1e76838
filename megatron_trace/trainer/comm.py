"""Bytes between trainer ranks with tensor collectives only (no pickle crosses a process boundary)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def _multi() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def broadcast_blobs(blobs: list[bytes] | None, src: int = 0) -> list[bytes]:
    """src's list of byte strings to every rank (others pass None)."""
    if not _multi():
        return blobs
    mine = dist.get_rank() == src
    n = torch.tensor([len(blobs) if mine else 0], dtype=torch.long)
    dist.broadcast(n, src)
    sizes = torch.tensor([len(b) for b in blobs], dtype=torch.long) if mine else torch.empty(int(n), dtype=torch.long)
    dist.broadcast(sizes, src)
    if mine:
        buf = (
            torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
            if sum(map(len, blobs))
            else torch.empty(0, dtype=torch.uint8)
        )
    else:
        buf = torch.empty(int(sizes.sum()), dtype=torch.uint8)
    if buf.numel():
        dist.broadcast(buf, src)
    data, out, off = buf.numpy().tobytes(), [], 0
    for s in sizes.tolist():
        out.append(data[off : off + s])
        off += s
    return out


def broadcast_json(obj, src: int = 0):
    """A JSON-able object from src to every rank."""
    if not _multi():
        return obj
    blobs = broadcast_blobs([json.dumps(obj).encode()] if dist.get_rank() == src else None, src)
    return json.loads(blobs[0].decode())


def all_gather_json(obj) -> list:
    """Every rank's JSON-able object, on every rank."""
    if not _multi():
        return [obj]
    mine = json.dumps(obj).encode()
    size = torch.tensor([len(mine)])
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    width = int(max(s.item() for s in sizes))
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    bufs = [torch.zeros(width, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(bufs, buf)
    return [json.loads(b[: int(s)].numpy().tobytes().decode()) for b, s in zip(bufs, sizes)]
