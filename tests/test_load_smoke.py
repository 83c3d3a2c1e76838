"""Smoke test of benchmarks/load_rollout.py: 16 clients against a server of capacity 4 for a few
seconds: it queues (the scheduler holds waiting requests, its batch never exceeds 4), never drops."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "load_rollout.py"


def _load():
    spec = importlib.util.spec_from_file_location("load_rollout", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(120)
def test_four_times_capacity_queues_never_drops(capsys):
    r = _load().main(["--clients", "16", "--max-running-requests", "4", "--duration", "3", "--new-tokens", "4"])
    out = capsys.readouterr().out
    assert "| clients |" in out and "p99 latency (s)" in out
    assert r["errors"] == 0, r["first_errors"]
    assert r["requests"] >= 16 and r["req_per_s"] > 0 and r["p50_s"] <= r["p99_s"]
    assert r["peak_in_flight"] > 4  # more requests out at once than the server can batch
    assert r["peak_running"] <= 4 and r["peak_queued"] > 0  # over capacity: queued at the server
