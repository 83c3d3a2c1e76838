"""Where the engine keeps the quantized inputs of guided sites between decode steps.

    step k reserves rows [first, first + rows) ─► quantizers write each site's codes, E4M3 scales
    and S_enc straight into those rows (the C layer at `pointers`, torch paths through `store`)
    ─► samples remember their global row numbers ─► when samples finish: one index_select per site
    and tensor, the mantissa conversion on just those rows ─► guidance.encode_records
Each site owns three growing arrays (codes, scales, S_enc per row; or one 0-d S_enc when static).
Rows no live sample needs are dropped from the front once they are the larger part of the arrays.
"""

from __future__ import annotations

import itertools

import torch

from megatron_trace.fp4 import FP8Tensor, MXFP4Tensor, NVFP4Tensor
from megatron_trace.guidance import SiteRecord, make_site, quantized_parts

_LAYOUTS = itertools.count()


class _SiteRows:
    def __init__(self, data_row, scale_row, gs_row, static_gs: torch.Tensor | None, capacity: int):
        self.data = torch.empty(capacity, *data_row, dtype=torch.uint8)
        self.scale = torch.empty(capacity, *scale_row, dtype=torch.uint8)
        self.gs = None if static_gs is not None else torch.empty(capacity, *gs_row, dtype=torch.float32)
        self.static_gs = static_gs
        self.static_value = None if static_gs is None else static_gs.item()
        self._note_addresses()

    def _note_addresses(self) -> None:
        """Row-0 address of each array (None: no per-row S_enc), for `GuidanceLog.pointers`."""
        self.addr = tuple(None if t is None else t.data_ptr() for t in (self.data, self.scale, self.gs))

    def to_per_row(self) -> None:
        """From now on one S_enc per row; rows already written keep the old static value."""
        self.gs = torch.full((self.data.shape[0],), self.static_value, dtype=torch.float32)
        self.static_gs = self.static_value = None
        self._note_addresses()

    def grow(self, capacity: int, keep: int) -> None:
        for name in ("data", "scale", "gs"):
            t = getattr(self, name)
            if t is not None:
                bigger = torch.empty(capacity, *t.shape[1:], dtype=t.dtype)
                bigger[:keep] = t[:keep]
                setattr(self, name, bigger)
        self._note_addresses()

    def drop_front(self, cut: int, used: int) -> None:
        for t in (self.data, self.scale, self.gs):
            if t is not None:
                t[: used - cut] = t[cut:used].clone()


class GuidanceLog:
    def __init__(self, mode: str, capacity: int = 1024):
        self.mode = mode
        self.base = 0  # global row number of array row 0
        self.rows = 0  # global rows handed out so far
        self.capacity = capacity
        self.sites: dict[str, _SiteRows] = {}
        self.layout = next(_LAYOUTS)  # changes whenever an array's row-0 address may have (C callers cache them)

    # -- writing -----------------------------------------------------------------------------------
    def reserve(self, num_rows: int) -> int:
        """Rows for one step; returns the first one's global number."""
        need = self.rows + num_rows - self.base
        if need > self.capacity:
            cap = self.capacity
            while cap < need:
                cap *= 2
            for s in self.sites.values():
                s.grow(cap, self.rows - self.base)
            self.capacity = cap
            self.layout = next(_LAYOUTS)
        first = self.rows
        self.rows += num_rows
        return first

    def _site(
        self, site: str, data_row, scale_row, gs_row, static_gs: torch.Tensor | None, static_value: float | None = None
    ) -> _SiteRows:
        """The site's arrays, made on first use; a static S_enc is copied then (one value for every
        row). A later different static value (a re-sync) switches the site to one S_enc per row."""
        s = self.sites.get(site)
        if s is None:
            static = None if static_gs is None else static_gs.detach().clone()
            s = self.sites[site] = _SiteRows(tuple(data_row), tuple(scale_row), tuple(gs_row), static, self.capacity)
            self.layout = next(_LAYOUTS)
        elif s.gs is None and (
            static_gs is None or (static_value if static_value is not None else static_gs.item()) != s.static_value
        ):
            s.to_per_row()  # rows already written keep the S_enc they were quantized with
            self.layout = next(_LAYOUTS)
        return s

    def buffers(
        self, site: str, first: int, num_rows: int, data_row, scale_row, gs_row, static_gs: torch.Tensor | None = None
    ):
        """(codes, scales, S_enc or None when static) views of rows [first, first + num_rows) to write."""
        s = self._site(site, data_row, scale_row, gs_row, static_gs)
        a, b = first - self.base, first - self.base + num_rows
        if static_gs is not None and s.gs is not None:
            return s.data[a:b], s.scale[a:b], s.gs[a:b].fill_(static_gs)
        return s.data[a:b], s.scale[a:b], (None if s.gs is None else s.gs[a:b])

    def pointers(
        self,
        site: str,
        data_row,
        scale_row,
        gs_row,
        static_gs: torch.Tensor | None = None,
        static_value: float | None = None,
    ):
        """Row-0 addresses (codes, scales, S_enc or None while one static value stands for all rows)
        of a site's arrays, for a C kernel that writes a step's rows from array row `first - base`
        on and, given an S_enc address under a static scale, fills it with that scale. Valid while
        `layout` is unchanged. `static_value` (a float) spares reading `static_gs`."""
        s = self._site(site, data_row, scale_row, gs_row, static_gs, static_value)
        return s.addr

    def store(self, site: str, first: int, q: NVFP4Tensor | MXFP4Tensor | FP8Tensor) -> None:
        """Copy one quantizer output (rows = the step's rows) into the site's arrays, as
        `guidance.quantized_parts` names them (MXFP4: a static 1.0; FP8: S_enc per row, no block scales)."""
        scale, global_scale, data = quantized_parts(q)
        static = global_scale if global_scale.dim() == 0 else None
        d, sc, gs = self.buffers(
            site, first, data.shape[0], data.shape[1:], scale.shape[1:], global_scale.shape[1:], static
        )
        d.copy_(data)
        sc.copy_(scale)
        if gs is not None:
            gs.copy_(global_scale)

    # -- reading -----------------------------------------------------------------------------------
    def gather(self, finished, alive) -> tuple[dict[str, SiteRecord], list[int]]:
        """The finished samples' rows of every site, one sample after another, and each one's row
        count; their row lists are emptied, and front rows no alive sample needs are dropped."""
        lens = [len(s.guidance_rows) for s in finished]
        idx = (
            torch.tensor(list(itertools.chain.from_iterable(s.guidance_rows for s in finished)), dtype=torch.long)
            - self.base
        )
        sites = {
            site: make_site(
                s.scale.index_select(0, idx),
                s.static_gs if s.gs is None else s.gs.index_select(0, idx),
                s.data.index_select(0, idx),
                self.mode,
            )
            for site, s in self.sites.items()
        }
        for s in finished:
            s.guidance_rows = []
        keep_from = min([s.guidance_rows[0] for s in alive if s.guidance_rows] or [self.rows])
        cut, used = keep_from - self.base, self.rows - self.base
        if cut > 0 and 2 * cut >= used:  # the dead front is most of the arrays: move the live rows down
            for s in self.sites.values():
                s.drop_front(cut, used)
            self.base = keep_from
        return sites, lens


class LoggedCapture:
    """What the layers receive to record one step's guidance into a GuidanceLog: called with (site,
    quantized input) by torch and per-kernel paths; the C layers write straight into the log from
    `row` on (run_plan sends a layer whose capture is not one of these down the per-kernel path).
    `layers`: the guided layers; the model hands the others no capture at all."""

    def __init__(self, log: GuidanceLog, first: int, layers) -> None:
        self.log, self.first, self.layers = log, first, frozenset(layers)
        self.row = first - log.base  # the row in the log's arrays, where the C quantizers start
        self._guided: dict[str, bool] = {}

    def __call__(self, site: str, q) -> None:
        g = self._guided.get(site)
        if g is None:
            g = self._guided[site] = int(site.split(".")[2]) in self.layers
        if g:
            self.log.store(site, self.first, q)
