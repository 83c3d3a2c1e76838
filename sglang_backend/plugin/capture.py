"""The batch a guided layer records into: `capture_batch(slots, positions, buffer)` names the KV slot
of each row of the forward and the process's capture buffer (slot_capture.SlotCapture, made at the
first forward); the quant methods call `record(site, q)` with each quantized input, which the
buffer keeps by KV slot. Finished requests' records are published to `guidance_dir()` (shared
memory by default), where the HTTP route of the server process reads them back.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_trace.fp4 import mxfp4, nvfp4

from .. import plugin_settings as settings

if TYPE_CHECKING:
    from .slot_capture import SlotCapture

GUIDANCE_DIR_ENV = settings.env_name("guidance_dir")


def guidance_dir(directory: str | Path | None = None) -> Path:
    if directory is not None:
        return Path(directory)
    default = (
        "/dev/shm/trace_guidance"
        if Path("/dev/shm").is_dir()
        else os.path.join(tempfile.gettempdir(), "trace_guidance")
    )
    return Path(settings.current().guidance_dir or default)


# -- the batch being run ---------------------------------------------------------------------
_STATE: dict = {"buffer": None, "slots": None, "positions": None}


def set_capture_buffer(buffer: SlotCapture | None) -> None:
    _STATE["buffer"] = buffer


def get_capture_buffer() -> SlotCapture | None:
    return _STATE["buffer"]


@contextlib.contextmanager
def capture_batch(slots: torch.Tensor, positions, buffer: SlotCapture | None = None):
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
    buf.write(site, slots, pos, q)  # a row mismatch is recorded as the capture's error
