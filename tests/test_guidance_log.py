"""The engine's guidance log: rows written per step come back per sample, through growth and compaction."""

import torch

from megatron_trace.fp4 import nvfp4
from megatron_trace.guidance import GuidanceRecord, encode_records, make_site
from sglang_backend.local.guidance_log import GuidanceLog


class _Sample:
    def __init__(self):
        self.guidance_rows, self.guidance, self.written = [], None, []


def _gather(log, finished, alive):
    """The engine's path: the log's batch of rows -> one record's bytes per sample -> read back."""
    sites, lens = log.gather(finished, alive)
    for i, (s, b) in enumerate(
        zip(finished, encode_records([f"s{i}" for i in range(len(lens))], log.mode, lens, sites))
    ):
        rec = GuidanceRecord.from_bytes(b)
        assert rec.sample_id == f"s{i}" and rec.num_positions == lens[i]
        s.guidance = rec.sites


def _step_q(rows: int, seed: int, static: bool):
    x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(seed))
    return nvfp4.quantize(x, global_scale=torch.tensor(0.5)) if static else nvfp4.quantize(x, per_row_global=True)


def test_rows_round_trip_through_growth_and_compaction():
    log = GuidanceLog("mantissa", capacity=4)  # tiny: every few steps the arrays grow or compact
    live = [_Sample() for _ in range(3)]
    done = []
    for step in range(40):
        first = log.reserve(len(live))
        qa, qk = _step_q(len(live), step, static=False), _step_q(len(live), 1000 + step, static=True)
        log.store("model.layers.0.mlp.down_proj", first, qa)
        d, sc, gs = log.buffers(
            "model.layers.0.self_attn.k_cache", first, len(live), (16,), (2,), (), static_gs=torch.tensor(0.5)
        )
        assert gs is None
        d.copy_(qk.data)
        sc.copy_(qk.scale)
        for i, s in enumerate(live):
            s.guidance_rows.append(first + i)
            s.written.append((qa.data[i], qa.scale[i], qa.global_scale[i], qk.data[i], qk.scale[i]))
        if step % 7 == 6:  # the oldest sample finishes, a new one joins
            fin, live = live[:1], live[1:] + [_Sample()]
            _gather(log, fin, live)
            done += fin
    _gather(log, live, [])
    for s in done + live:
        a, k = s.guidance["model.layers.0.mlp.down_proj"], s.guidance["model.layers.0.self_attn.k_cache"]
        rows = list(zip(*s.written))
        want_a = make_site(torch.stack(rows[1]), torch.stack(rows[2]), torch.stack(rows[0]), "mantissa")
        want_k = make_site(torch.stack(rows[4]), torch.tensor(0.5), torch.stack(rows[3]), "mantissa")
        for got, want in ((a, want_a), (k, want_k)):
            assert torch.equal(got.scale, want.scale) and torch.equal(got.payload, want.payload)
            assert torch.equal(got.global_scale, want.global_scale)
        assert k.global_scale.dim() == 0 and s.guidance_rows == []
    assert log.capacity >= 3 and log.base > 0  # it compacted instead of only growing


def test_a_resynced_static_scale_keeps_each_row_its_own():
    log = GuidanceLog("full", capacity=2)
    s = _Sample()
    for gs in (0.5, 0.5, 2.0, 2.0):
        first = log.reserve(1)
        q = nvfp4.quantize(torch.randn(1, 32), global_scale=torch.tensor(gs))
        log.store("model.layers.0.mlp.down_proj", first, q)
        s.guidance_rows.append(first)
    _gather(log, [s], [])
    assert s.guidance["model.layers.0.mlp.down_proj"].global_scale.tolist() == [0.5, 0.5, 2.0, 2.0]
