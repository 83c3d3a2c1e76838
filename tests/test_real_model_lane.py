"""The real-model lane: a real pretrained Qwen2.5-0.5B-Instruct (the `real_qwen` fixture) in bf16,
under the quantization `configs/qwen2.5_0.5b_cpu.yaml` ships (NVFP4 W4A4 MLPs, de-biased FP8 K,
NVFP4 V, mantissa guidance on every layer). Random weights have no outlier channels and no trained
attention, so these are the tests that see what FP4 does to a trained model."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_trace.config import Config
from megatron_trace.models import ModelArch

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "qwen2.5_0.5b_cpu.yaml"


@pytest.fixture(scope="module")
def cfg(real_qwen):
    return Config.load(CONFIG, [f"model.path={real_qwen}", f"model.tokenizer={real_qwen}"])


def test_the_shipped_qwen25_policy_passes_the_quality_gate_in_bf16(cfg, real_qwen):
    """The run's own gate (16 held-out word problems, greedy, its 256 new tokens: most answers need
    over 128 to reach their \\boxed{} number; bf16, math-verify):
    the config's policy costs at most quant.max_nll_increase nats/token and keeps greedy accuracy
    within quant.max_accuracy_drop of BF16's (it raises QualityGateError otherwise)."""
    from megatron_trace.data import load_tokenizer, prompt_source
    from megatron_trace.quality.gate import gate_run

    tok = load_tokenizer(str(real_qwen))
    prompts = prompt_source("word_problems", seed=cfg.trainer.seed, tokenizer=tok, eval_fraction=0.1)
    res, rows = gate_run(cfg, cfg.quant.resolve(ModelArch.from_hf_config(real_qwen)), real_qwen, tok, prompts)
    print(
        f"gate: {res.setting} {res.nll_increase:+.4f} nats/token, accuracy {res.accuracy} vs BF16 {res.bf16_accuracy}"
    )
    assert len(rows) == 16 and res.passed and "debias" in res.setting
    assert res.nll_increase <= cfg.quant.max_nll_increase
    assert res.bf16_accuracy - res.accuracy <= cfg.quant.max_accuracy_drop
    assert res.bf16_accuracy >= 0.1  # the task is within the model's reach, so the accuracy check means something


def test_trace_guides_every_site_and_beats_plain_qat_on_the_real_model(real_qwen):
    """The probe with the config's policy: a bf16 rollout against the fp32 trainer. Guided (full and
    mantissa) < rtn < off; K and V are guided sites and agree on >= 99.9% of their codes in full mode
    (FP8 through fp8.GUIDE_REACH, de-biased K computed without its bias), the FP4 sites on >= 99.5%
    (measured 99.9% at 8 x 64 tokens: docs/quality.md)."""
    from megatron_trace.quality import probe

    args = ["--model-path", str(real_qwen), "--dataset", "word_problems", "--num-prompts", "4"]
    args += ["--max-new-tokens", "32", "--quantization", "nvfp4", "--kv-k", "fp8", "--kv-v", "nvfp4"]
    res = probe.probe(probe.parse_args([*args, "--kv-k-debias", "--guided-layers", "all"]))
    m = res["modes"]
    print({mode: round(v["mean_abs_dlogp"], 5) for mode, v in m.items()})
    for mode in ("guided-full", "guided-mantissa"):
        assert m[mode]["mean_abs_dlogp"] < 0.5 * m["rtn"]["mean_abs_dlogp"] < m["off"]["mean_abs_dlogp"]
    agree = m["guided-full"]["agreement"]
    assert {"k_cache", "v_cache", "gate_up_proj", "down_proj"} == {k.rsplit(".", 1)[1] for k in agree}
    print("lowest agreement", sorted(agree.items(), key=lambda kv: kv[1])[:4])
    kv = [v for k, v in agree.items() if k.endswith("_cache")]
    assert min(kv) >= 0.999 and min(agree.values()) >= 0.995, sorted(agree.items(), key=lambda kv: kv[1])[:4]
    rtn = m["rtn"]["agreement"]
    assert all(agree[k] > rtn[k] for k in agree if k.endswith("k_cache"))  # FP8 K follows the record
