"""Smoke test of benchmarks/rollout.py: `--quick` runs end to end and prints every table row."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")


def _load():
    from benchmarks import rollout

    return rollout


@pytest.mark.timeout(120)
def test_quick_prints_all_rows(capsys):
    bench = _load()
    report = bench.main(["--quick"])
    assert report in capsys.readouterr().out
    batch = bench.QUICK["batch"]
    rows = [line for line in report.splitlines() if line.startswith("| ") and not line.startswith("| Metric")]
    labels = [row.split("|")[1].strip() for row in rows]
    assert labels == [label.format(B=batch) for label in bench.ROW_LABELS]

    cells = {row.split("|")[1].strip(): [c.strip() for c in row.split("|")[2:-1]] for row in rows}
    for label in labels[:4]:  # throughput rows: engine tok/s, HF tok/s, ratio
        engine, hf, ratio = cells[label][:3]
        assert re.fullmatch(r"\d+ tok/s", engine) and re.fullmatch(r"HF \d+ tok/s", hf)
        assert re.fullmatch(r"\d+\.\d\dx", ratio)
    # KV accounting is exact: 16-bit over 4.5-bit
    assert cells["KV bytes/token BF16 / NVFP4"][2] == "3.56x"
    assert cells["KV bytes/token BF16 / NVFP4"][4] == "yes"
    assert cells["KV bytes/token BF16 / MXFP4"][2] == "3.56x"
    for mode in ("mantissa", "full"):
        assert re.fullmatch(r"[+-]\d+\.\d%", cells[f"guidance overhead, {mode}"][2])
        assert float(cells[f"guidance bytes/token, {mode}"][0].split()[0]) > 0
    # mantissa mode keeps 1 bit per element instead of 4: fewer bytes than full
    m = float(cells["guidance bytes/token, mantissa"][0].split()[0])
    f = float(cells["guidance bytes/token, full"][0].split()[0])
    assert m < f
    # the BF16-equivalent engine in fp32 decodes HF's greedy tokens exactly
    assert "greedy tokens equal to HF's, engine BF16-equiv: 100.0%" in report
