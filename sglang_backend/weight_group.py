"""The distributed weight-update path (SGLang's `/init_weights_update_group` +
`/update_weights_from_distributed`) over a private gloo group.

    trainer (rank 0, WeightSender: owns the TCPStore)  ──broadcast(src=0), in `names` order──►
    server  (rank = rank_offset, WeightGroup)  receives every tensor, then ONE engine update

The group is a bare `ProcessGroupGloo` on its own `TCPStore`: it never touches
torch.distributed's default group, so a trainer that already runs Megatron/NCCL collectives and
this server (which has none) can both use it. Gloo cannot move float8 tensors, so 1-byte float
dtypes travel as their uint8 view on both sides (the bytes on the wire are the same).
"""
from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

_BYTE_VIEW = {torch.float8_e4m3fn, torch.float8_e5m2}
for _name in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"):
    if hasattr(torch, _name):
        _BYTE_VIEW.add(getattr(torch, _name))


def dtype_from_name(name: str) -> torch.dtype:
    """'bfloat16' / 'torch.bfloat16' -> torch.bfloat16; anything else is a ValueError naming it."""
    attr = name.removeprefix("torch.") if isinstance(name, str) else None
    dt = getattr(torch, attr, None) if attr else None
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use a torch attribute name like 'bfloat16', 'uint8', 'float8_e4m3fn'")
    return dt


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in _BYTE_VIEW else t


def _make_group(address: str, port: int, rank: int, world_size: int, group_name: str,
                timeout_s: float, backend: str = "gloo") -> tuple[dist.Store, dist.ProcessGroup]:
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=(rank == 0), timeout=timeout,
                          wait_for_workers=False)
    # A prefix per group name: two groups on one store never read each other's keys.
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "nccl":  # what a real SGLang server on GPUs joins with (CUDA tensors)
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)
    elif backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        raise ValueError(f"weight-update group backend must be gloo or nccl; got {backend!r}")
    return store, pg


class WeightGroup:
    """The server's end of one named update group (rank = rank_offset; tp is 1 here)."""

    def __init__(self, address: str, port: int, rank: int, world_size: int, group_name: str,
                 timeout_s: float = 300.0):
        self.rank, self.world_size, self.name = rank, world_size, group_name
        self._store, self._pg = _make_group(address, port, rank, world_size, group_name, timeout_s)
        self._lock = threading.Lock()  # one transfer at a time: broadcasts must pair up in order

    def receive(self, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of one update, in order; raises (and the caller keeps old weights) on failure."""
        out = []
        with self._lock:
            for name, dt, shape in zip(names, dtypes, shapes):
                t = torch.empty(shape, dtype=dt)
                self._pg.broadcast(_wire(t), 0).wait()
                out.append((name, t))
        return out

    def close(self) -> None:
        self._pg = None
        self._store = None


class WeightSender:
    """The trainer's end (rank 0, broadcast source): creates the master TCPStore.

    Construct it while (or before) the servers handle `/init_weights_update_group`: the
    constructor returns once every rank has joined. Then, for each update, POST
    `/update_weights_from_distributed` (it blocks in the server) and call `send` concurrently.
    """

    def __init__(self, master_address: str, master_port: int, world_size: int,
                 group_name: str = "weight_update_group", timeout_s: float = 300.0, backend: str = "gloo"):
        self.world_size, self.group_name, self.backend = world_size, group_name, backend
        self._store, self._pg = _make_group(master_address, master_port, 0, world_size, group_name, timeout_s, backend)

    @staticmethod
    def describe(named: dict[str, torch.Tensor]) -> dict[str, list]:
        """The `names`, `dtypes`, `shapes` fields of /update_weights_from_distributed."""
        return {"names": list(named), "dtypes": [str(t.dtype).removeprefix("torch.") for t in named.values()],
                "shapes": [list(t.shape) for t in named.values()]}

    def send(self, named: dict[str, torch.Tensor]) -> None:
        for t in named.values():
            t = t.detach().contiguous()
            t = t.cuda() if self.backend == "nccl" else _wire(t.cpu())  # NCCL moves float8 natively
            self._pg.broadcast(t, 0).wait()

    def close(self) -> None:
        self._pg = None
        self._store = None
