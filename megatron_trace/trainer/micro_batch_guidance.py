"""One micro-batch's rollout guidance in Megatron's row layout, assembled once per site.

Each sample's record covers its positions 0..T-1; a `packing.Placement` says which rows of the
micro-batch (Megatron's [S, B] flattened, or a packed stream) hold which of its positions. Rows past
a record, padding and samples without one are left uncovered in the mask, where QAT rounds to
nearest. A row-parallel linear asks for its TP rank's K slice of the codes and scales. `QATState`
(qat.py) reads it at every guided site.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_trace.fp4 import RolloutRounding
from megatron_trace.guidance import GuidanceRecord
from megatron_trace.guidance.record import layer_of

from .packing import Placement, columns


@dataclass
class MicroBatchGuidance:
    """Rollout records of one micro-batch's samples (records[i] sits at placements[i]), over
    `n_rows` rows."""

    records: list[GuidanceRecord | None]
    placements: list[Placement]
    n_rows: int
    _cache: dict = field(default_factory=dict)

    @classmethod
    def padded(cls, records: list[GuidanceRecord | None], seq_len: int) -> MicroBatchGuidance:
        """Records of a [seq_len, B = len(records)] micro-batch, sample j in batch column j."""
        return cls(records, columns(len(records), seq_len), seq_len * len(records))

    def release(self) -> None:
        """Drop the assembled (device) site tensors; they are rebuilt from the records if asked again."""
        self._cache.clear()

    def recorded_layers(self) -> set[int]:
        """Layers the rollout recorded any site of: in guided mode each of their FP4 sites must be
        there, or that site would silently round to nearest (`missing_site_error`)."""
        if "layers" not in self._cache:
            self._cache["layers"] = {layer_of(n) for r in self.records if r is not None for n in r.sites}
        return self._cache["layers"]

    def missing_site_error(self, name: str) -> ValueError | None:
        """The error for a guided site that no record of this micro-batch holds although its layer
        is guided, or None when the layer is not guided (nothing recorded there by design)."""
        if layer_of(name) not in self.recorded_layers():
            return None
        held = sorted({n for r in self.records if r is not None for n in r.sites if layer_of(n) == layer_of(name)})
        ids = [r.sample_id for r in self.records if r is not None][:3]
        return ValueError(
            f"trainer.qat_mode=guided: QAT site {name} is FP4 in the trainer, but the rollout's guidance "
            f"records (samples {ids}) hold no such site; its layer has {held}. The rollout did not record "
            "this site (a server or plugin that cannot capture this format or these experts?), so it "
            "would silently round to nearest: make the rollout record it, or keep the site out of "
            "quant.targets / use trainer.qat_mode=rtn"
        )

    def site(self, name: str, k_slice: slice | None, dev) -> tuple[RolloutRounding, torch.Tensor] | None:
        """Rounding tensors [rows, ..., K_local/...] and the mask of covered rows, or None."""
        key = (name, None if k_slice is None else (k_slice.start, k_slice.stop))
        if key in self._cache:
            return self._cache[key]
        present = [r for r in self.records if r is not None and name in r.sites]
        if not present:
            self._cache[key] = None
            return None
        ref = present[0].sites[name]
        full = present[0].mode == "full"
        n = self.n_rows
        inner = tuple(ref.scale.shape[1:-1])
        scale = torch.zeros(n, *inner, ref.scale.shape[-1], dtype=torch.uint8)
        payload = torch.zeros(n, *inner, ref.payload.shape[-1], dtype=torch.uint8)
        gs = torch.ones(n, *inner, dtype=torch.float32)
        mask = torch.zeros(n, dtype=torch.bool)
        for rec, place in zip(self.records, self.placements):
            if rec is None or name not in rec.sites:
                continue
            site = rec.sites[name]
            if place.start is not None:
                t = min(site.positions(), len(place.rows))
                rows, pos = slice(place.start, place.start + t), slice(0, t)
            else:
                held = place.positions < site.positions()
                rows, pos = place.rows[held], place.positions[held]
            scale[rows], payload[rows] = site.scale[pos], site.payload[pos]
            g = site.global_scale if site.global_scale.dim() == 0 else site.global_scale[pos]
            gs[rows] = g.reshape(*g.shape, *([1] * (gs.dim() - g.dim()))) if g.dim() else g  # FP8: S_enc per token
            mask[rows] = True
        if k_slice is not None:
            k0, k1 = k_slice.start, k_slice.stop
            per = 2 if full else 8  # elements per payload byte
            block = ref.payload.shape[-1] * per // ref.scale.shape[-1]  # 16 (NVFP4) or 32 (MXFP4)
            scale = scale[..., k0 // block : k1 // block]
            payload = payload[..., k0 // per : k1 // per]

        def flat(t):
            return t.contiguous().to(dev)

        rr = RolloutRounding(
            flat(scale), flat(gs), codes=flat(payload) if full else None, mantissa=None if full else flat(payload)
        )
        out = (rr, mask.to(dev))
        self._cache[key] = out
        return out
