"""Megatron-Core GPTModel (megatron_trace.trainer) against HF transformers, across TP/PP/EP.

Each torchrun launch costs ~10 s of imports per process on CPU, so everything is batched into two
launches of tests/mp_scripts/megatron_check.py: one 1-process (TP1: HF parity, round trip, a
training smoke) and one 4-process run that re-initializes the model-parallel groups for
TP2 (DP2), PP2 (DP2), TP2xPP2 and EP2 (MoE). Results come back as safetensors / JSON files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
from safetensors.torch import load_file  # noqa: E402

from megatron_trace.models import FAMILIES, make_tiny_checkpoint  # noqa: E402
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "mp_scripts" / "megatron_check.py"
MP_CONFIGS = ["2x1x1", "1x2x1", "2x2x1", "1x1x2"]  # TPxPPxEP; EP2 runs the MoE family only


def _torchrun(nproc: int, out: Path, ckpts: Path, *args: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(SCRIPT),
        "--ckpts",
        str(ckpts),
        "--out",
        str(out),
        *args,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    if proc.returncode != 0 or not (out / "done").exists():
        pytest.fail(f"torchrun failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mt_ckpts")
    for fam in FAMILIES:
        make_tiny_checkpoint(root / fam, fam, seed=0)
    gen = torch.Generator().manual_seed(0)
    torch.save(torch.randint(0, 320, (2, 12), generator=gen), root / "input_ids.pt")
    return root


@pytest.fixture(scope="module")
def tp1_run(ckpts, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mt_tp1")
    return _torchrun(1, out, ckpts, "--configs", "1x1x1", "--export", "1x1x1", "--train", "1x1x1")


@pytest.fixture(scope="module")
def mp_run(ckpts, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mt_mp")
    cfgs = ",".join(MP_CONFIGS)
    return _torchrun(4, out, ckpts, "--configs", cfgs, "--export", "2x2x1,1x1x2", "--train", "2x2x1")


def _logits(run: Path, fam: str, cfg: str) -> torch.Tensor:
    return load_file(str(run / f"logits_{fam}_{cfg}.safetensors"))["logits"]


@pytest.mark.parametrize("fam", FAMILIES)
def test_tp1_logits_match_hf(fam, ckpts, tp1_run):
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpts / fam, dtype=torch.float32).eval()
    ids = torch.load(ckpts / "input_ids.pt")
    with torch.no_grad():
        want = ref(ids).logits.float()
    got = _logits(tp1_run, fam, "1x1x1")
    assert got.shape == want.shape == (2, 12, 320)  # padded vocab rows trimmed
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("fam", FAMILIES)
def test_parallel_logits_match_tp1(fam, tp1_run, mp_run):
    ref = _logits(tp1_run, fam, "1x1x1")
    scale = ref.abs().max().item()
    cfgs = MP_CONFIGS if fam == "qwen3_moe" else [c for c in MP_CONFIGS if not c.endswith("x2")]
    for cfg in cfgs:
        got = _logits(mp_run, fam, cfg)
        assert got.shape == ref.shape, cfg
        assert (got - ref).abs().max().item() / scale <= 1e-5, cfg


@pytest.mark.parametrize("fam", FAMILIES)
def test_export_round_trip_bit_exact(fam, ckpts, tp1_run, mp_run):
    hf = load_file(str(ckpts / fam / "model.safetensors"))
    runs = [(tp1_run, "1x1x1"), (mp_run, "2x2x1")] + ([(mp_run, "1x1x2")] if fam == "qwen3_moe" else [])
    for run, cfg in runs:
        got = load_file(str(run / f"export_{fam}_{cfg}.safetensors"))
        assert sorted(got) == sorted(hf), cfg
        for k, v in hf.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), f"{cfg}: {k}"


def test_cpu_training_steps_agree_across_parallelism(tp1_run, mp_run):
    """DDP + Megatron optimizer + grad clipping on CPU (cpu_compat items 3-5): the loss falls and
    TP2xPP2 follows TP1's trajectory (same data, same init)."""
    one = json.loads((tp1_run / "train_1x1x1.json").read_text())
    four = json.loads((mp_run / "train_2x2x1.json").read_text())
    assert one["losses"][-1] < one["losses"][0]
    assert len(one["losses"]) == len(four["losses"]) == 3
    torch.testing.assert_close(torch.tensor(four["losses"]), torch.tensor(one["losses"]), rtol=1e-4, atol=0)
    torch.testing.assert_close(torch.tensor(four["grad_norms"]), torch.tensor(one["grad_norms"]), rtol=1e-4, atol=0)


def test_cpu_megatron_fusions_run_eagerly_without_inductor(tp1_run):
    """cpu_compat item 7: Megatron's jit_fuser is a pass-through on CPU (its import no longer pulls
    in dynamo and inductor, ~3 s of every process's start-up) and torch.compile is left as it was."""
    assert json.loads((tp1_run / "jit.json").read_text()) == {"fuser_passthrough": True, "torch_compile_restored": True}
