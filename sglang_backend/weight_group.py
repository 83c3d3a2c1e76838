"""The weight-update group of SGLang's `/init_weights_update_group` + `/update_weights_from_distributed`,
built the way SGLang 0.5.23 builds its end, so that a trainer meets a real SGLang server (and our
embedded server) in one group.

    trainer (rank 0, WeightSender: the rendezvous master)  ──broadcast(src=0), in `names` order──►
    server  (rank = rank_offset [+ tp_rank])  receives every tensor, then ONE engine update

SGLang (`sglang.srt.utils.common.init_custom_process_group`, called by the model runner's weight
updater with `init_method=tcp://addr:port`) does: torch's `tcp://` rendezvous (rank 0 hosts a
TCPStore), `PrefixStore(group_name, store)`, then `_new_process_group_helper(world_size, rank, [],
backend, store, group_name=group_name, ...)`, which adds its own `group_name/` key prefix, and
registers an identity rank map. `_make_group` builds the same store keys and backend (without
importing SGLang: trainer nodes do not have it; see its docstring for the two steps it does
differently), so both ends meet. Checked against SGLang's own function in tests (a real server's
group: tests/test_sglang_weight_sync.py). A bare
`ProcessGroupGloo` on `PrefixStore(group_name)` misses the second prefix and never meets SGLang
(its store wait on `/weight_update_group/0/1` times out).

The group never touches torch.distributed's default group, so a trainer that already runs
Megatron/NCCL collectives can own one. Backends: gloo on CPU, NCCL on GPUs (what SGLang's GPU
servers join with; CUDA tensors).

Gloo cannot broadcast float8 tensors ("Invalid scalar type"), on either side. So over gloo a 1-byte
float tensor (the ModelOpt `weight_scale`, E4M3) is ANNOUNCED as `uint8` (`wire_dtype`) and sent as
its uint8 view: the receiver allocates uint8, and its weight loader reinterprets the bytes
(`view(torch.float8_e4m3fn)`: the plugin's `load_shard`, our engine's loader). The bytes are the
same; NCCL moves float8 natively and keeps the real dtype name.
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
BACKENDS = ("gloo", "nccl")


def dtype_from_name(name: str) -> torch.dtype:
    """'bfloat16' / 'torch.bfloat16' -> torch.bfloat16; anything else is a ValueError naming it."""
    attr = name.removeprefix("torch.") if isinstance(name, str) else None
    dt = getattr(torch, attr, None) if attr else None
    if not isinstance(dt, torch.dtype):
        raise ValueError(
            f"unknown dtype {name!r}; use a torch attribute name like 'bfloat16', 'uint8', 'float8_e4m3fn'"
        )
    return dt


def wire_dtype(dtype: torch.dtype, backend: str) -> torch.dtype:
    """The dtype a tensor is announced and broadcast as: uint8 for 1-byte floats over gloo."""
    return torch.uint8 if backend == "gloo" and dtype in _BYTE_VIEW else dtype


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in _BYTE_VIEW else t


def _make_group(
    address: str, port: int, rank: int, world_size: int, group_name: str, timeout_s: float, backend: str = "gloo"
):
    """SGLang's init_custom_process_group(backend, init_method=tcp://address:port, world_size, rank,
    group_name), key for key: the tcp:// rendezvous store (a TCPStore rank 0 hosts),
    `PrefixStore(group_name)`, then what `_new_process_group_helper` builds on it:
    `PrefixStore(group_name + "/")`, ONE backend on `PrefixStore(first device + "/")` (gloo:
    "cpu/"; nccl: "cuda/") registered for every device of the backend's map, and its sequence
    number. Two differences, neither visible on the wire: the store is a TCPStore made directly
    (see below), and the helper's process-wide registration of the name is skipped, so both ends
    of a group can live in one process (tests); broadcasts then go through the group object."""
    from torch.distributed.distributed_c10d import BackendConfig, PrefixStore, ProcessGroup

    if backend not in BACKENDS:
        raise ValueError(f"weight-update group backend must be one of {BACKENDS}; got {backend!r}")
    if not group_name:
        raise ValueError("a weight-update group needs a non-empty name")
    timeout = datetime.timedelta(seconds=timeout_s)
    # torch's tcp:// rendezvous (SGLang's side) is a bare TCPStore hosted by rank 0. Build it directly:
    # under torchrun the rendezvous handler would instead join torchelastic's agent store (a trainer
    # rank 0 would then host nothing and the servers would wait for it forever).
    store = dist.TCPStore(
        address,
        int(port),
        world_size,
        is_master=(rank == 0),
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=True,
    )
    store = PrefixStore(f"{group_name}/", PrefixStore(group_name, store))
    pg = ProcessGroup(store, rank, world_size)
    kind = ProcessGroup.BackendType.GLOO if backend == "gloo" else ProcessGroup.BackendType.NCCL
    pg._set_default_backend(kind)
    devices = BackendConfig(dist.Backend(backend)).get_device_backend_map()
    # as the helper: one backend (on the first device's prefix) registered for every device
    first = next(iter(devices))
    dev_store = PrefixStore(f"{first}/", store)
    if backend == "gloo":
        b = dist.ProcessGroupGloo(dev_store, rank, world_size, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        b = dist.ProcessGroupNCCL(dev_store, rank, world_size, opts)
    b._set_sequence_number_for_group()
    for device in devices:
        pg._register_backend(torch.device(device), kind, b)
    return pg


def _destroy(pg) -> None:
    if pg is not None:
        try:
            pg.shutdown()
        except Exception:  # noqa: BLE001 - a broken group is dropped either way
            pass


class WeightGroup:
    """The server's end of one named update group (our embedded server: rank = rank_offset, tp 1)."""

    def __init__(
        self,
        address: str,
        port: int,
        rank: int,
        world_size: int,
        group_name: str,
        timeout_s: float = 300.0,
        backend: str = "gloo",
    ):
        self.rank, self.world_size, self.name, self.backend = rank, world_size, group_name, backend
        self._pg = _make_group(address, port, rank, world_size, group_name, timeout_s, backend)
        self._lock = threading.Lock()  # one transfer at a time: broadcasts must pair up in order

    def receive(
        self, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]
    ) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of one update, in order; raises (and the caller keeps old weights) on failure."""
        out = []
        with self._lock:
            for name, dt, shape in zip(names, dtypes, shapes):
                t = torch.empty(shape, dtype=dt)
                self._pg.broadcast(_wire(t), 0).wait()
                out.append((name, t))
        return out

    def close(self) -> None:
        pg, self._pg = self._pg, None
        _destroy(pg)


class WeightSender:
    """The trainer's end (rank 0, broadcast source, rendezvous master).

    Construct it while (or before) the servers handle `/init_weights_update_group`: the
    constructor returns once every rank has joined. Then, for each update, POST
    `/update_weights_from_distributed` with `describe()`'s fields (it blocks in the server) and
    call `send` concurrently.
    """

    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str = "weight_update_group",
        timeout_s: float = 300.0,
        backend: str = "gloo",
    ):
        self.world_size, self.group_name, self.backend = world_size, group_name, backend
        self._pg = _make_group(master_address, master_port, 0, world_size, group_name, timeout_s, backend)

    @staticmethod
    def describe(named: dict[str, torch.Tensor], backend: str = "gloo") -> dict[str, list]:
        """The `names`, `dtypes`, `shapes` fields of /update_weights_from_distributed (wire dtypes)."""
        return {
            "names": list(named),
            "dtypes": [str(wire_dtype(t.dtype, backend)).removeprefix("torch.") for t in named.values()],
            "shapes": [list(t.shape) for t in named.values()],
        }

    def send(self, named: dict[str, torch.Tensor]) -> None:
        for t in named.values():
            t = t.detach().contiguous()
            t = t.cuda() if self.backend == "nccl" else _wire(t.cpu())  # NCCL moves float8 natively
            self._pg.broadcast(t, 0).wait()

    def close(self) -> None:
        pg, self._pg = self._pg, None
        _destroy(pg)
