"""Smoke test of benchmarks/rollout_real.py: `--quick` (a tiny random model) prints every row."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")


@pytest.mark.timeout(120)
def test_quick_prints_every_contender_at_both_batches(capsys):
    from benchmarks import rollout_real as bench

    report = bench.main(["--quick", "--threads", "1"])
    assert report in capsys.readouterr().out
    rows = [
        line.split("|")[1:-1] for line in report.splitlines() if line.startswith("| engine") or line.startswith("| HF")
    ]
    names = [(r[0].strip(), int(r[1])) for r in rows]
    contenders = list(bench.ENGINES) + ["HF generate BF16"]
    assert names == [(c, b) for b in (1, 4) for c in contenders]
    for r in rows:
        assert re.fullmatch(r"\d+\.\d", r[2].strip()) and float(r[2]) > 0
        if r[0].startswith(" engine"):
            assert re.fullmatch(r"\d+", r[4].strip()) and r[6].strip().endswith("%")
            assert r[7].strip().startswith(("cpu_gemv/", "torch ("))  # which linears ran, never unsaid
    # the tiny model runs the one-call C layer, which reads the dequantized weights: BF16's bytes
    mb = {(r[0].strip(), int(r[1])): int(r[4]) for r in rows if r[0].startswith(" engine")}
    assert len(set(mb.values())) == 1
    assert "read bandwidth" in report and "anchors" in report


def _kv_bench():
    from benchmarks import kv_attention

    return kv_attention


@pytest.mark.timeout(60)
def test_kv_attention_bench_quick_reports_all_page_formats(capsys):
    bench = _kv_bench()
    report = bench.main(["--quick", "--threads", "1", "--batch", "2"])
    rows = {
        r.split("|")[1].strip(): r.split("|")[2:-1]
        for r in report.splitlines()
        if r.startswith("| ") and "pages" in r.split("|")[1] and not r.startswith("| pages")
    }
    assert list(rows) == ["BF16 pages", "NVFP4 pages (in registers)", "MXFP4 pages (in registers)"]
    mb = {k: float(v[3]) for k, v in rows.items()}  # ms, ratio, CPU ms, then MB
    assert mb["MXFP4 pages (in registers)"] == mb["NVFP4 pages (in registers)"]  # E8M0 per 16: 4.5 bits too
    assert mb["BF16 pages"] / mb["NVFP4 pages (in registers)"] == pytest.approx(128 / 36, rel=0.02)  # 16 vs 4.5 bits


@pytest.mark.timeout(60)
def test_kv_attention_bench_times_each_layer_over_its_own_pages():
    bench = _kv_bench()
    g = torch.Generator().manual_seed(0)
    a, b = bench.layer_pages(64, 2, 32, g), bench.layer_pages(64, 2, 32, g)
    assert not torch.equal(a["kb"], b["kb"])  # a layer of its own, not the same pages again
    report = bench.main(["--quick", "--threads", "1", "--batch", "2", "--layers", "3"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--layers", "0"])
    assert "3 layer(s) of own pages a pass" in report and "ms/layer" in report
    mb = [float(r.split("|")[5]) for r in report.splitlines() if r.startswith("| ") and "pages (" in r]
    per_layer = 2 * (2 * 512) * 2 * (64 // 2 + 64 // 16) / 1e6  # K + V, batch x context slots, 2 KV heads
    assert mb == pytest.approx([per_layer] * 2, abs=1e-3)  # NVFP4 and MXFP4, per layer, not per pass
