"""Guidance capture into preallocated buffers, keyed by a request slot.

A rollout's guidance is the per-token NVFP4 quantization (codes, E4M3 block scales, per-token
S_enc) of each guided linear's input. Inside SGLang the linear sees a flat batch of tokens;
`capture_batch(slots, positions)` tells it which request slot (SGLang's req_pool_index) and
which position each row belongs to. Every write is an `index_put_` into tensors allocated up
front, with padding rows routed to a dump slot, so a CUDA graph that captured the write keeps
writing into the same storage on replay (CUDA-graph replay skips Python; only the contents
of `slots`/`positions` change, which the runner updates in place before each replay).

The HTTP route lives in the server process and the buffers in the model worker process, so
the worker `publish`es a finished request's guidance to a directory (shared memory by
default) and the route reads it back (`load_published`).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path

import torch

from megatron_trace.fp4 import mxfp4, nvfp4

from .. import plugin_settings as settings

GUIDANCE_DIR_ENV = settings.env_name("guidance_dir")
_SAFE_RID = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")


class GuidanceCaptureBuffer:
    """codes/scales/global_scale per site, [max_slots + 1, max_tokens, ...]; the last slot is the dump."""

    def __init__(self, sites: dict[str, int], *, max_slots: int, max_tokens: int, device: torch.device | str = "cpu"):
        if max_slots < 1 or max_tokens < 1:
            raise ValueError(f"max_slots and max_tokens must be >= 1; got {max_slots}, {max_tokens}")
        bad = {s: k for s, k in sites.items() if k % nvfp4.BLOCK}
        if bad:
            raise ValueError(f"capture sites need in_features divisible by 16; got {bad}")
        self.max_slots, self.max_tokens, self.dump = max_slots, max_tokens, max_slots
        self.sites = dict(sites)
        rows = (max_slots + 1, max_tokens)
        self.codes = {s: torch.zeros(*rows, k // 2, dtype=torch.uint8, device=device) for s, k in sites.items()}
        self.scales = {s: torch.zeros(*rows, k // 16, dtype=torch.uint8, device=device) for s, k in sites.items()}
        self.global_scale = {s: torch.ones(*rows, dtype=torch.float32, device=device) for s in sites}
        self.lengths = torch.zeros(max_slots + 1, dtype=torch.long, device=device)

    def _rows(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots, positions = slots.to(torch.long), positions.to(torch.long)
        ok = (slots >= 0) & (slots < self.max_slots) & (positions >= 0) & (positions < self.max_tokens)
        return torch.where(ok, slots, torch.full_like(slots, self.dump)), torch.where(
            ok, positions, torch.zeros_like(positions)
        )

    def write(self, site: str, slots: torch.Tensor, positions: torch.Tensor, q: nvfp4.NVFP4Tensor) -> None:
        """q: the [T, K] quantized input of `site`; row t goes to (slots[t], positions[t])."""
        if site not in self.codes:
            return
        if not isinstance(q, nvfp4.NVFP4Tensor):
            raise TypeError(
                f"{site}: GuidanceCaptureBuffer holds NVFP4 sites only; got {type(q).__name__} "
                "(a server captures MXFP4 sites through slot_capture.SlotCapture)"
            )
        s, p = self._rows(slots, positions)
        t = q.data.shape[0]
        gs = q.global_scale.reshape(-1).to(torch.float32)
        gs = gs.expand(t) if gs.numel() == 1 else gs
        self.codes[site].index_put_((s, p), q.data)
        self.scales[site].index_put_((s, p), q.scale)
        self.global_scale[site].index_put_((s, p), gs)
        self.lengths.scatter_reduce_(0, s, p + 1, reduce="amax")

    def read(self, slot: int, site: str, length: int | None = None) -> nvfp4.NVFP4Tensor:
        n = int(self.lengths[slot]) if length is None else length
        return nvfp4.NVFP4Tensor(
            self.codes[site][slot, :n].clone(),
            self.scales[site][slot, :n].clone(),
            self.global_scale[site][slot, :n].clone(),
        )

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0

    def publish(self, slot: int, rid: str, directory: str | Path | None = None) -> Path:
        """Write slot's guidance for request `rid` where the HTTP route finds it; returns the file."""
        out = _record_path(rid, directory)
        out.parent.mkdir(parents=True, exist_ok=True)
        rec = {}
        for site in self.sites:
            q = self.read(slot, site)
            rec[site] = {"codes": q.data.cpu(), "scales": q.scale.cpu(), "global_scale": q.global_scale.cpu()}
        tmp = out.with_suffix(".tmp")
        torch.save(rec, tmp)
        os.replace(tmp, out)
        return out


def guidance_dir(directory: str | Path | None = None) -> Path:
    if directory is not None:
        return Path(directory)
    default = (
        "/dev/shm/trace_guidance"
        if Path("/dev/shm").is_dir()
        else os.path.join(tempfile.gettempdir(), "trace_guidance")
    )
    return Path(settings.current().guidance_dir or default)


def _record_path(rid: str, directory: str | Path | None) -> Path:
    if not isinstance(rid, str) or not _SAFE_RID.match(rid):
        raise ValueError(f"rid must match {_SAFE_RID.pattern}; got {rid!r}")
    return guidance_dir(directory) / f"{rid}.pt"


def load_published(rid: str, directory: str | Path | None = None, *, pop: bool = True) -> dict[str, nvfp4.NVFP4Tensor]:
    """The guidance `publish` wrote for `rid` (KeyError when there is none); removed unless pop=False."""
    path = _record_path(rid, directory)
    if not path.exists():
        raise KeyError(f"no guidance published for request {rid!r}")
    rec = torch.load(path, map_location="cpu", weights_only=True)
    if pop:
        path.unlink(missing_ok=True)
    return {s: nvfp4.NVFP4Tensor(t["codes"], t["scales"], t["global_scale"]) for s, t in rec.items()}


# -- the batch being run ---------------------------------------------------------------------
_STATE: dict = {"buffer": None, "slots": None, "positions": None}


def set_capture_buffer(buffer: GuidanceCaptureBuffer | None) -> None:
    _STATE["buffer"] = buffer


def get_capture_buffer() -> GuidanceCaptureBuffer | None:
    return _STATE["buffer"]


@contextlib.contextmanager
def capture_batch(slots: torch.Tensor, positions: torch.Tensor, buffer: GuidanceCaptureBuffer | None = None):
    """Within the block, guided linears record their quantized input rows at (slots, positions)."""
    prev = dict(_STATE)
    _STATE.update(slots=slots, positions=positions)
    if buffer is not None:
        _STATE["buffer"] = buffer
    try:
        yield
    finally:
        _STATE.clear()
        _STATE.update(prev)


def record(site: str | None, q: nvfp4.NVFP4Tensor | mxfp4.MXFP4Tensor) -> None:
    """Called by the quant methods with each quantized input (NVFP4 or MXFP4); a no-op outside `capture_batch`."""
    buf, slots, pos = _STATE["buffer"], _STATE["slots"], _STATE["positions"]
    if site is None or buf is None or slots is None:
        return
    if isinstance(buf, GuidanceCaptureBuffer) and (q.data.dim() != 2 or slots.shape[0] != q.data.shape[0]):
        return
    buf.write(site, slots, pos, q)  # a SlotCapture (slot_capture.py) records a row mismatch as its error
