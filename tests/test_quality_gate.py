"""The rollout-quality gate (quality_gate.py) on the planted-outlier Qwen2 (conftest.outlier_ckpt): a
policy that damages the model stops with the table and the cheapest setting that passes; accepting
the loss runs; the run's whole policy is measured (BF16 layer bands, not a default look-alike)."""

import dataclasses

import pytest

from megatron_trace.models import ModelArch, QuantPolicy
from megatron_trace.quality import measure as quality
from megatron_trace.quality.gate import QualityGateError, candidates, gate
from tests.helpers import random_prompts

pytestmark = pytest.mark.isa_avx2

# A random-init toy: every FP4 site costs it 0.2-0.5 nats/token, the planted K outlier 2.9 (NVFP4 K).
LIMITS = dict(max_nll_increase=0.6, max_accuracy_drop=0.125, max_new_tokens=12, dtype="float32")
KV_NVFP4 = QuantPolicy(format="bf16", weights="bf16", activations="bf16", kv="nvfp4")


def test_a_failing_policy_stops_with_the_cheapest_that_passes(outlier_ckpt):
    said = []
    with pytest.raises(QualityGateError) as e:
        gate(outlier_ckpt, KV_NVFP4, random_prompts(), accept_loss=False, log=said.append, **LIMITS)
    msg = str(e.value)
    fails = float(msg.split("| bf16:nvfp4:nvfp4 | ")[1].split(" |")[0])
    assert fails > 2.0, msg  # NVFP4 K spends its scale on the planted K outlier
    # de-biased NVFP4 K (9 bits per K+V pair) is the cheapest candidate; the outlier sits in the bias
    assert "the cheapest that passes is bf16:nvfp4+debias:nvfp4" in msg, msg
    assert "quant.kv_k=nvfp4 quant.kv_v=nvfp4 quant.kv_k_debias=true" in msg
    assert "quant.accept_quality_loss=true" in msg and "4 eval prompts, float32, up to 12 new tokens" in msg
    assert said[0].endswith("| FAIL |") and said[-1].endswith("| pass |")


def test_accepting_the_loss_runs_and_reports_it(outlier_ckpt):
    said = []
    res = gate(outlier_ckpt, KV_NVFP4, random_prompts(), accept_loss=True, log=said.append, **LIMITS)
    assert not res.passed and res.nll_increase > 2.0
    assert res.metrics() == {"quality/nll_increase": res.nll_increase, "quality/passed": 0.0}
    assert "WARNING" in said[-1] and "quant.accept_quality_loss=true" in said[-1]


class _IdsText:
    """Decodes ids to their numbers: enough text for an exact-match score on synthetic prompts."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_a_passing_policy_shows_its_answers_beside_bf16s(outlier_ckpt):
    tok, prompts = _IdsText(), random_prompts()
    ref = quality.run(outlier_ckpt, prompts, [], max_new_tokens=12, tokenizer=tok)["settings"][quality.REFERENCE]
    for p, text in zip(prompts, ref["texts"]):
        p["answer"], p["text"] = text, "q"
    policy = QuantPolicy(format="bf16", weights="bf16", activations="bf16", kv="nvfp4", kv_k_debias=True)
    limits = {**LIMITS, "max_accuracy_drop": 1.0}
    res = gate(
        outlier_ckpt,
        policy,
        prompts,
        accept_loss=False,
        tokenizer=tok,
        score=lambda texts, answers: [float(r == a) for r, a in zip(texts, answers)],
        **limits,
    )
    assert res.passed and res.bf16_accuracy == 1.0
    assert (
        res.accuracy == sum(o == r for o, r in zip(res.report["settings"][res.setting]["outputs"], ref["outputs"])) / 4
    )
    assert set(res.metrics()) == {"quality/nll_increase", "quality/passed", "quality/accuracy", "quality/bf16_accuracy"}
    rows = res.answers(prompts, 2)
    assert len(rows) == 2 and rows[0]["bf16_response"] == ref["texts"][0] and rows[0]["bf16_reward"] == 1.0


def test_the_gate_measures_the_runs_policy_not_a_look_alike(outlier_ckpt):
    """BF16 layer bands and FP4 targets change what is measured; candidates keep them."""
    w4a4 = QuantPolicy(kv="bf16")
    banded = QuantPolicy(kv="bf16", bf16_layers_start=3)  # explicit KV: resolved as written
    plain = gate(outlier_ckpt, w4a4, random_prompts(), accept_loss=True, log=lambda m: None, **LIMITS)
    band = gate(outlier_ckpt, banded, random_prompts(), accept_loss=True, log=lambda m: None, **LIMITS)
    assert band.nll_increase < plain.nll_increase / 2  # three of four layers' MLPs stay BF16
    arch = ModelArch.from_hf_config(outlier_ckpt)
    run = quality.Setting.of_policy(banded.resolve(arch))
    assert run.policy().bf16_layers_start == 3 and candidates(run, arch) == []  # bands: BF16 KV only
    down = QuantPolicy(kv="nvfp4", targets=("*.mlp.down_proj",)).resolve(arch)
    assert all(c.policy().targets == ("*.mlp.down_proj",) for c in candidates(quality.Setting.of_policy(down), arch))


def test_the_engine_refuses_a_quantized_kv_cache_under_bf16_layer_bands(outlier_ckpt):
    from sglang_backend.local import Engine

    with pytest.raises(ValueError, match="holds one format for every layer"):
        Engine(str(outlier_ckpt), quant_policy=QuantPolicy(kv="nvfp4", bf16_layers_end=1))


def test_candidates_fewest_bits_first_debiased_where_k_has_a_bias(outlier_ckpt):
    arch = ModelArch.from_hf_config(outlier_ckpt)
    run = quality.Setting.parse("w4a4:nvfp4:nvfp4")
    names = [c.name for c in candidates(run, arch)]
    assert names[:3] == ["w4a4:nvfp4+debias:nvfp4", "w4a4:fp8+debias:nvfp4", "w4a4:bf16:nvfp4"], names
    assert names[-1] == "w4a4:bf16:bf16" and run.name not in names
    no_bias = dataclasses.replace(arch, qkv_bias=False)
    assert [c.name for c in candidates(run, no_bias)][:2] == ["w4a4:fp8:nvfp4", "w4a4:bf16:nvfp4"]


def test_a_reused_reference_gives_the_fresh_numbers(outlier_ckpt):
    s = [quality.Setting.parse("bf16:fp8:nvfp4")]
    fresh = quality.run(outlier_ckpt, random_prompts(), s, max_new_tokens=12)
    ref_only = quality.run(outlier_ckpt, random_prompts(), [], max_new_tokens=12)
    reused = quality.run(outlier_ckpt, random_prompts(), s, max_new_tokens=12, reference=ref_only)
    assert reused["settings"]["bf16:fp8:nvfp4"]["nll_increase"] == fresh["settings"]["bf16:fp8:nvfp4"]["nll_increase"]
    with pytest.raises(ValueError, match="same prompts and max_new_tokens"):
        quality.run(outlier_ckpt, random_prompts(), s, max_new_tokens=8, reference=ref_only)


def test_a_bf16_rollout_has_nothing_to_gate(outlier_ckpt):
    said = []
    bf16 = QuantPolicy(format="bf16", weights="bf16", activations="bf16", kv="bf16")
    assert gate(outlier_ckpt, bf16, random_prompts(), accept_loss=False, log=said.append, **LIMITS) is None
    assert said == ["rollout quality gate: the rollout quantizes nothing (BF16), nothing to measure"]


def test_an_http_runs_embedded_server_must_serve_the_runs_policy(outlier_ckpt):
    """rollout.backend=http on an embedded server: the gate scores in-process (the same numerics bit
    for bit) only after the server's /model_info policy is the run's; another policy stops the run."""
    from types import SimpleNamespace

    from megatron_trace.quality.gate import _served_url
    from sglang_backend.local import Engine
    from sglang_backend.local.server import serve

    arch = ModelArch.from_hf_config(outlier_ckpt)
    eng = Engine(str(outlier_ckpt), quant_policy=KV_NVFP4)
    srv = serve(eng, "127.0.0.1", 0)
    try:
        cfg = SimpleNamespace(rollout=SimpleNamespace(urls=[srv.url], api_key=""))
        said = []
        assert _served_url(cfg, KV_NVFP4.resolve(arch), said.append) is None and "scored in-process" in said[0]
        # the same numerics written another way (kv=auto with both sides named) is the same policy
        written = dataclasses.replace(KV_NVFP4, kv="auto", kv_k="nvfp4", kv_v="nvfp4").resolve(arch)
        assert _served_url(cfg, written, said.append) is None
        with pytest.raises(ValueError, match=f"rollout server {srv.url} serves quant policy .* but the run's is"):
            _served_url(cfg, dataclasses.replace(KV_NVFP4, kv_k_debias=True).resolve(arch), said.append)
    finally:
        srv.shutdown()
        eng.shutdown()


class _SkipsSpecials(_IdsText):
    """Decodes ids to their numbers, dropping the specials (pad 0, bos 1, eos 2) as a tokenizer does."""

    def decode(self, ids, skip_special_tokens=True):
        return super().decode([i for i in ids if i > 2])


def test_a_reference_that_answered_nothing_is_refused_even_when_losses_are_accepted(outlier_ckpt, tmp_path):
    """A BF16 model whose every greedy answer is special tokens only (here: an all-zero LM head, so
    token 0, padding, wins every step) answers nothing; scored, that is 0 for BF16 and anything
    "passes" against it. The gate refuses to judge, quant.accept_quality_loss notwithstanding."""
    import shutil

    from safetensors.torch import load_file, save_file

    from megatron_trace.quality.gate import QualityGateUnmeasured

    ckpt = shutil.copytree(outlier_ckpt, tmp_path / "mute")
    sd = load_file(ckpt / "model.safetensors")
    sd["lm_head.weight"].zero_()
    save_file(sd, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QualityGateUnmeasured, match=r"BF16 reference's greedy answers are all empty \(4 of 4\)"):
        gate(
            ckpt, KV_NVFP4, random_prompts(), accept_loss=True, tokenizer=_SkipsSpecials(), log=lambda m: None, **LIMITS
        )


@pytest.mark.parametrize("n", [1, 3], ids=["bf16 reference", "the policy's answers"])
def test_an_engine_error_stops_the_gate_with_the_engines_message(outlier_ckpt, n):
    """An engine error inside a batched decode (the n-th decode step of each engine the gate builds)
    aborts its requests; the gate raises with the engine's message instead of scoring empty answers."""
    from megatron_trace import faults
    from sglang_backend.api import RolloutAborted

    faults.arm("engine.decode_step", faults.raise_error, n=n)
    try:
        with pytest.raises(RolloutAborted, match=r"engine error: injected fault at engine.decode_step") as e:
            gate(outlier_ckpt, KV_NVFP4, random_prompts(), accept_loss=True, log=lambda m: None, **LIMITS)
    finally:
        faults.disarm_all()
    assert "'s greedy answers (embedded engine): the rollout backend aborted 4 of 4 requests" in str(e.value)
