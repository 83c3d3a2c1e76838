"""Trainer memory: it grows linearly in a sample's length and stays small at reasoning lengths
(measured); the memory model (megatron_trace/perf/memory.py): its parameter counts, its fit check
and advice, and its step estimate against the peak RSS growth measured on CPU shapes (fp32, one
rank, every recompute mode: within 25%). Each measurement runs in its own process
(tests/mp_scripts/trainer_memory.py): the kernel's peak-RSS mark is reset after a warm-up step and
read after the measured one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_trace.config import Config
from megatron_trace.models import ModelArch, QuantPolicy, make_tiny_checkpoint
from megatron_trace.perf import memory as pm
from megatron_trace.perf.roofline import MODELS

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "mp_scripts" / "trainer_memory.py"
POLICY = QuantPolicy(format="nvfp4", weights="fp4", activations="fp4", kv="nvfp4")
SHAPE = dict(
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=8192,
    max_position_embeddings=8192,
)


def test_parameters_per_rank_add_up_to_the_model():
    m = MODELS["qwen2.5-72b"]
    one = pm._stage_params(m, pm.TrainerPlan())
    assert 72.0e9 < one < 73.5e9  # Qwen2.5-72B: 72.7 B parameters
    split = pm._stage_params(m, pm.TrainerPlan(tp=8, pp=4))
    assert one / 32 < split < one / 32 * 1.15  # the busiest stage carries the embedding


def test_the_72b_config_fits_its_b200s_at_its_answer_length_and_names_the_knob_when_not():
    cfg = Config.load(str(REPO / "configs" / "qwen2.5_72b.yaml"), [])
    assert cfg.cluster.gpu == "b200" and cfg.rollout.max_new_tokens >= 16384
    m, source, arch = pm.shape_and_arch(cfg)
    assert source.startswith("built-in shape") and arch.family == "qwen2" and arch.num_layers == m.layers == 80
    policy = cfg.quant.resolve(arch)
    assert (policy.k_format, policy.kv_k_debias) == ("fp8", True)  # a Qwen2.5's auto K, from its built-in shape
    est = pm.estimate(m, pm.plan_from_config(cfg, policy, m, 1), "b200")
    assert est["fits"], pm.table(m, pm.plan_from_config(cfg, policy, m, 1), "b200")
    tight = Config.load(
        str(REPO / "configs" / "qwen2.5_72b.yaml"),
        ["rollout.max_new_tokens=65536", "trainer.recompute=none", "cluster.gpu=h200"],
    )
    p = pm.plan_from_config(tight, policy, m, 1)
    est = pm.estimate(m, p, "h200")
    assert not est["fits"] and "trainer.recompute=full" in pm.advice(m, p, est)
    out = subprocess.run(
        [sys.executable, "-m", "megatron_trace.perf.memory", "--config", str(REPO / "configs" / "qwen2.5_72b.yaml")]
        + ["rollout.max_new_tokens=65536", "trainer.recompute=none", "cluster.gpu=h200"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "does NOT fit: set trainer.recompute=full" in out.stdout


def test_a_plan_that_cannot_fit_here_is_refused_before_the_model_is_built(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "qwen2", seed=0)
    cfg = Config.load(None, ["trainer.max_tokens_per_microbatch=400000000"])
    policy = cfg.quant.resolve(ModelArch.from_hf_config(ckpt))
    with pytest.raises(ValueError, match=r"does NOT fit; .*trainer.memory_check=false"):
        pm.check_here(cfg, policy, str(ckpt), world=1, ranks_here=1)
    pm.check_here(Config.load(None, []), policy, str(ckpt), world=1, ranks_here=1)  # the default plan fits


def _checkpoint_and_record(root: Path, **shape) -> tuple[Path, Path]:
    """A tiny Qwen2 of `shape` and one bf16 engine rollout's guidance record (full codes) of it."""
    from sglang_backend.local import Engine

    ckpt = make_tiny_checkpoint(root / "ckpt", "qwen2", seed=0, **shape)
    eng = Engine(str(ckpt), dtype="bfloat16", quant_policy=POLICY, guidance_mode="full", guided_layers="all")
    try:
        out = eng.generate(
            input_ids=list(range(100, 116)),
            sampling_params={"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True},
            return_guidance=True,
        )
        (root / "record.bin").write_bytes(eng.fetch_guidance(out["meta_info"]["guidance_handle"]).to_bytes())
    finally:
        eng.shutdown()
    return ckpt, root / "record.bin"


def _measure(ckpt: Path, record: Path, runs: str, *extra: str) -> list[dict]:
    """tests/mp_scripts/trainer_memory.py in its own process: one dict per MODE:TOKENS run."""
    cmd = [sys.executable, str(SCRIPT), "--ckpt", str(ckpt), "--record", str(record), "--runs", runs]
    cmd += ["--policy", json.dumps(POLICY.to_dict()), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.strip().splitlines()[-len(runs.split(",")) :]]


@pytest.fixture(scope="module")
def qwen_vocab(tmp_path_factory):
    """2 layers, Qwen's 151,936-token vocabulary: the logits, not the layers, would dominate."""
    shape = dict(vocab_size=151936, num_hidden_layers=2, max_position_embeddings=8192)
    return _checkpoint_and_record(tmp_path_factory.mktemp("qwen_vocab"), **shape)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    return _checkpoint_and_record(tmp_path_factory.mktemp("pm"), **SHAPE)


def test_long_sample_step_memory_is_small_and_linear(qwen_vocab):
    """One logprob recompute + one train step on one sample: before packing and chunked vocab-parallel
    logprobs this grew 1.9 GB per 1,000 tokens (7.7 GB at 4,096)."""
    short, long, guided = _measure(*qwen_vocab, "rtn:1024,rtn:4096,guided:4096")
    print(json.dumps([short, long, guided]))
    assert long["growth_gb"] <= 2.0, long
    assert guided["growth_gb"] <= 2.0, guided
    assert long["growth_gb"] <= 5 * max(short["growth_gb"], 0.05), (short, long)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_estimate_is_within_25_percent_of_the_measured_step(record, recompute):
    ckpt, rec = record
    tokens = 4096
    (run,) = _measure(ckpt, rec, f"guided:{tokens}", "--recompute", recompute, "--chunk-mb", "16")
    measured = run["growth_gb"] * pm.GIB
    m = pm.spec_from_hf_config(json.loads((ckpt / "config.json").read_text()), "cpu shape")
    plan = pm.TrainerPlan(
        dtype="float32",
        recompute=recompute,
        tokens_per_microbatch=tokens,
        logprob_chunk_mb=16,
        guided_layers=4,
        guided_sites_per_layer=(256, 1024, 64, 64),  # gate_up, down, K, V inputs
        guidance_bytes_per_element=0.5,
        qat_input_width=1024,  # down_proj's input
        qat_weight_params=3 * 256 * 1024,  # the MLP's FP4 linears
    )
    est = pm.estimate(m, plan)
    # weights, grads, Adam: allocated before; the head and a recomputed layer's backward one after the other
    saved = est["activations_saved"]
    step = saved + est["guidance"] + max(est["activations"] - saved, est["logits"])
    print(recompute, f"measured {measured / pm.GIB:.3f} GiB, estimated {step / pm.GIB:.3f} GiB")
    assert abs(step - measured) <= 0.25 * measured, (recompute, measured / pm.GIB, step / pm.GIB)


def _real_config(*overrides: str) -> tuple:
    """configs/qwen2.5_0.5b_cpu.yaml with its model's built-in shape (no checkpoint needed), resolved."""
    cfg = Config.load(str(REPO / "configs" / "qwen2.5_0.5b_cpu.yaml"), ["model.path=/nowhere/Qwen2.5-0.5B-Instruct"])
    cfg = Config.load(str(REPO / "configs" / "qwen2.5_0.5b_cpu.yaml"), [f"model.path={cfg.model.path}", *overrides])
    m, source, arch = pm.shape_and_arch(cfg)
    assert source.startswith("built-in shape 'qwen2.5-0.5b'"), source
    return cfg, m, cfg.quant.resolve(arch)


def test_the_real_configs_one_process_plan_adds_up_and_names_the_knob_that_fits_it():
    from megatron_trace.run.rollout import engine_sleeps

    shipped, m, pol = _real_config()
    assert shipped.trainer.optimizer_offload == "disk" and shipped.trainer.optimizer_offload_keep_mb == 2048
    all_on_disk, _, _ = _real_config("trainer.optimizer_offload_keep_mb=0")
    on_disk = pm.process_estimate(all_on_disk, pol, m, engine_sleeps(all_on_disk))
    # the shipped config keeps 2 GiB of the moments in memory: every phase between steps holds them, the
    # optimizer step streams the rest (more than its window) beside them
    kept = pm.process_estimate(shipped, pol, m, engine_sleeps(shipped))
    for phase in ("forward_backward_phase", "sync_phase", "optimizer_phase"):
        assert kept[phase] - on_disk[phase] == pytest.approx(2 * 2**30)
    cfg, _, _ = _real_config("trainer.optimizer_offload=none")
    est = pm.process_estimate(cfg, pol, m, engine_sleeps(cfg))
    # Adam's moments on disk between steps: the forward/backward and the sync hold them no more (the
    # rollout neither, beside the first rollout's masters that stood in for them); the optimizer step
    # streams them through its window: the embedding's m and v (more than the 512 MiB window) at most,
    # beside Adam's temporaries (two fp32 copies of the embedding)
    for phase in ("forward_backward_phase", "sync_phase"):
        assert est[phase] - on_disk[phase] == pytest.approx(est["adam"])
    assert on_disk["rollout_phase"] < est["rollout_phase"]
    resident = est["runtime"] + est["trainer_build"] + est["guidance_store"]
    assert est["optimizer_phase"] == pytest.approx(resident + est["adam"] + 2 * 4 * 136e6, rel=0.01)
    assert on_disk["optimizer_phase"] == pytest.approx(resident + 2 * 4 * 136e6 + 2 * 4 * 136e6, rel=0.01)
    wide, _, _ = _real_config("trainer.optimizer_offload_window_mb=100000")  # a window wider than the moments
    assert pm.process_estimate(wide, pol, m, True)["optimizer_phase"] == est["optimizer_phase"]
    assert on_disk["peak"] == on_disk["rollout_phase"] < est["peak"]
    # Qwen2.5-0.5B: 494 M parameters, each a bf16 weight, an fp32 grad and main param, Adam's m and v
    assert est["trainer_build"] + est["adam"] == pytest.approx(494e6 * (2 + 4 + 4 + 8), rel=0.01)
    # the engine runs 358 M linear weights (314 M of them the MLP's, NVFP4: codes and scales beside the
    # dequantized bf16 and its transposed copy) and the tied 136 M-entry embedding with a packed copy
    assert est["engine_weights"] == pytest.approx((44e6 * 4 + 314e6 * (4 + 0.5 + 1 / 16) + 136e6 * 4), rel=0.02)
    masters = pm.engine_weight_bytes(m, pol, "bfloat16", masters=True) - est["engine_weights"]
    assert masters == pytest.approx(314e6 * 4, rel=0.02)  # a BF16 checkpoint's, until the first sync
    # asleep through the train phase: the engine awake beside the trainer peaks (the sync: one bucket more)
    assert est["peak"] == est["sync_phase"] > est["rollout_phase"] > est["train_phase"]
    assert est["train_phase"] == est["forward_backward_phase"] > est["optimizer_phase"]
    awake = pm.process_estimate(cfg, pol, m, False)
    assert awake["train_phase"] - est["train_phase"] == pytest.approx(est["engine_weights"] + est["kv_pool"])
    budget = (est["peak"] + awake["peak"]) / 2 / pm.GIB
    pm.check_budget(Config.load(None, []), pol, m, True)  # no budget: nothing checked
    resident = "trainer.optimizer_offload=none"
    sleeping, _, _ = _real_config(f"trainer.memory_budget_gib={budget}", resident)
    pm.check_budget(sleeping, pol, m, engine_sleeps(sleeping))
    off, _, _ = _real_config(f"trainer.memory_budget_gib={budget}", "rollout.colocated=off", resident)
    with pytest.raises(ValueError, match=r"(?s)exceeds trainer.memory_budget_gib=.*set rollout\.colocated=on"):
        pm.check_budget(off, pol, m, engine_sleeps(off))
    tight = (est["peak"] + on_disk["peak"]) / 2 / pm.GIB  # the moments on disk fit it; nothing else alone does
    over, _, _ = _real_config(f"trainer.memory_budget_gib={tight}", resident)
    with pytest.raises(ValueError, match=r"set trainer\.optimizer_offload=disk$"):
        pm.check_budget(over, pol, m, True)
    big_pool, _, _ = _real_config(f"trainer.memory_budget_gib={budget}", "rollout.max_total_tokens=4000000", resident)
    with pytest.raises(ValueError, match=r"lower rollout\.max_total_tokens \(now 4000000\) to \d+"):
        pm.check_budget(big_pool, pol, m, True)


def test_a_run_over_its_memory_budget_stops_before_its_models_are_built(tmp_path):
    from megatron_trace.run.run import Run
    from megatron_trace.trainer.parallel import destroy

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "qwen2", seed=0)
    run_dir = tmp_path / "run"
    overrides = [f"model.path={ckpt}", f"logging.run_dir={run_dir}", "quant.quality_gate=false"]
    cfg = Config.load(str(REPO / "configs" / "tiny_cpu.yaml"), [*overrides, "trainer.memory_budget_gib=0.8"])
    try:
        with pytest.raises(ValueError, match=r"predicted peak .* GiB exceeds trainer.memory_budget_gib=0.8") as err:
            Run(cfg, resume=False)
    finally:
        destroy()
    assert str(err.value).endswith("set trainer.recompute=full")  # the tiny train phase: its activations
    assert not run_dir.exists()  # nothing built, nothing written


@pytest.mark.parametrize("kv", ["nvfp4", "fp8"])
def test_an_sglang_ranks_weights_are_the_bytes_a_sync_sends_it(tmp_path, kv):
    """The colocation estimate's weights are what the transfer quantizes a real checkpoint into
    (ModelOpt FP4 codes, scales and S_enc; BF16 elsewhere), split over SGLang's TP; its KV per token
    is the engine pool's."""

    from megatron_trace.transfer.export import load_hf_dir
    from megatron_trace.transfer.pipeline import hf_state_dict_stream
    from megatron_trace.transfer.quantize import rollout_tensors

    ckpt = make_tiny_checkpoint(tmp_path / "m", "qwen2", seed=0, dtype="bfloat16")
    arch, hf_sd, raw = load_hf_dir(ckpt)
    pol = QuantPolicy(format="nvfp4", weights="fp4", activations="fp4", kv=kv).resolve(arch)
    sent = sum(
        t.numel() * t.element_size()
        for unit in rollout_tensors(hf_state_dict_stream(hf_sd, arch), arch, pol)
        for _, t in unit
    )
    m = pm.spec_from_hf_config(raw, "tiny")
    one, two = pm.sglang_rank_bytes(m, arch, pol, 1), pm.sglang_rank_bytes(m, arch, pol, 2)
    assert one["weights"] == sent and two["weights"] == sent / 2
    assert one["kv_per_token"] == pm.kv_pool_bytes(m, pol, 1, "bfloat16") == 2 * two["kv_per_token"]
    bf16 = sum(t.numel() * 2 for t in hf_sd.values())
    assert sent < 0.75 * bf16  # the FP4 MLPs travel at ~0.56 bytes a weight
    est = pm.estimate(m, pm.TrainerPlan(dtype="bfloat16"), "b200")
    line = pm.colocation_line(m, arch, pol, 2, est)
    assert "not measured on a GPU" in line and "gives back" in line
