"""Static activation calibration of routed experts (tiny Qwen3-MoE): one amax per expert from the
fp32 HF forward, against a reference that routes and runs every expert itself from the checkpoint,
and the rule for an expert no calibration token reaches."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_trace.models import ModelArch, QuantPolicy, make_tiny_checkpoint
from megatron_trace.transfer.static_scales import calibrate_static_amax

ROOT = Path(__file__).resolve().parents[1]
STATIC = QuantPolicy(kv="bf16", format="nvfp4", activation_scale="static")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe_calib"), "qwen3_moe", seed=0)


def _prompts(arch: ModelArch, n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, arch.vocab_size, (length,), generator=g).tolist() for _ in range(n)]


def _reference(ckpt, prompts) -> tuple[dict[str, float], dict[int, list[int]]]:
    """{expert module: amax}, {layer: experts no token reached}: transformers' from_pretrained model
    gives each MoE block's input (the post-attention-normed hidden state); routing (softmax, top-k)
    and every expert's gate/up/down run here on the checkpoint's own per-expert weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    arch = ModelArch.from_hf_config(ckpt)
    top_k = arch.num_experts_per_tok  # top-k of the softmax: norm_topk_prob rescales the weights only
    sd = {name: t.float() for f in sorted(ckpt.glob("*.safetensors")) for name, t in load_file(str(f)).items()}
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(arch.num_layers)}
    hooks = [
        model.model.layers[i].mlp.register_forward_pre_hook(
            lambda _m, a, i=i: inputs[i].append(a[0].reshape(-1, a[0].shape[-1]))
        )
        for i in range(arch.num_layers)
    ]
    with torch.no_grad():
        for ids in prompts:
            model(input_ids=torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    amax, unreached = {}, {}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}.mlp."
        routed = [
            torch.topk(F.softmax(x @ sd[p + "gate.weight"].T, -1, dtype=torch.float32), top_k, -1).indices
            for x in inputs[i]
        ]
        unreached[i] = [e for e in range(arch.num_experts) if not any((c == e).any() for c in routed)]
        for x, chosen in zip(inputs[i], routed):  # one forward (prompt) at a time, as HF's experts see them
            for e in range(arch.num_experts):
                # an expert no token reaches: all of the layer's tokens (the documented rule)
                xe = x if e in unreached[i] else x[(chosen == e).any(-1)]
                if not len(xe):
                    continue
                q = f"{p}experts.{e}."
                h = F.silu(xe @ sd[q + "gate_proj.weight"].T) * (xe @ sd[q + "up_proj.weight"].T)
                for name, v in ((q + "gate_proj", xe), (q + "up_proj", xe), (q + "down_proj", h)):
                    amax[name] = max(amax.get(name, 0.0), float(v.abs().amax()))
    return amax, unreached


def test_expert_amax_is_the_per_expert_recompute(moe):
    """Every routed expert's gate/up amax (shared) and down amax equal the reference's, fp32."""
    arch = ModelArch.from_hf_config(moe)
    prompts = _prompts(arch, 6, 16)
    want, unreached = _reference(moe, prompts)
    assert not any(unreached.values())  # these prompts reach every expert of every layer
    got = calibrate_static_amax(moe, arch, STATIC, prompts)
    assert sorted(got) == sorted(want) and len(got) == arch.num_layers * arch.num_experts * 3
    for name, v in want.items():
        assert got[name] == v, (name, got[name], v)
    per_layer = {
        i: {got[f"model.layers.{i}.mlp.experts.{e}.down_proj"] for e in range(arch.num_experts)} for i in range(4)
    }
    assert all(len(v) > 1 for v in per_layer.values())  # per expert, not one value per layer


def test_an_expert_no_prompt_reaches_is_calibrated_on_all_its_layers_tokens(moe, caplog):
    """Two short prompts leave some experts without a token: calibration says which (a WARNING) and
    records them as if every token of their layer had been routed to them; the others as routed."""
    import logging

    arch = ModelArch.from_hf_config(moe)
    prompts = [[1, 5, 9, 2], [7, 3, 3, 8, 4]]
    want, unreached = _reference(moe, prompts)
    assert any(unreached.values()) and not all(unreached.values())
    with caplog.at_level(logging.WARNING, logger="megatron_trace.transfer.static_scales"):
        got = calibrate_static_amax(moe, arch, STATIC, prompts)
    assert got == want
    assert "no calibration token was routed to" in caplog.text
    for i, experts in unreached.items():
        if experts:
            assert f"model.layers.{i}.mlp.experts: experts {experts}" in caplog.text
            # gate_up: the layer's whole MoE input, the max over the routed experts' gate_up amax
            gate = [got[f"model.layers.{i}.mlp.experts.{e}.gate_proj"] for e in range(arch.num_experts)]
            assert all(gate[e] == max(gate) for e in experts)


def test_probe_with_static_expert_scales_guides_every_expert_site(moe):
    """--activation-scale static on the MoE: per-expert S_enc calibrated, pushed as each expert's
    input_scale, used by the trainer's QAT; guided < rtn < off, every expert site >= 99.9%."""
    from megatron_trace.quality import probe

    args = ["--model-path", str(moe), "--num-prompts", "4", "--max-new-tokens", "16", "--activation-scale", "static"]
    res = probe.probe(probe.parse_args(args))
    m = res["modes"]
    assert res["policy"]["activation_scale"] == "static" and res["guided_skipped"] is None
    assert m["guided-full"]["mean_abs_dlogp"] < m["rtn"]["mean_abs_dlogp"] < m["off"]["mean_abs_dlogp"]
    experts = {k: v for k, v in m["guided-full"]["agreement"].items() if ".mlp.experts." in k}
    assert len(experts) == 4 * 2 and min(experts.values()) >= 0.999
    # every (token, slot) of every record carries its expert's S_enc, the one the trainer rounds with
    scales = res["static_scales"]
    assert len(scales["trainer"]) == 4 * 4 * 2 and scales["rollout"] == scales["trainer"]
    assert len({v[0] for k, v in scales["trainer"].items() if k.startswith("model.layers.1.")}) > 1


def test_two_rl_steps_with_static_expert_scales(tmp_path):
    """configs/tiny_moe_cpu.yaml with quant.activation_scale=static and guided QAT: two in-process
    steps; every rollout record's per-slot S_enc is its expert's, the trainer's, after a sync too."""
    from megatron_trace.config import Config
    from megatron_trace.quality.probe import static_scales_by_site
    from megatron_trace.run.run import Run
    from megatron_trace.trainer.parallel import destroy

    overrides = [
        "trainer.warm_start_steps=0",  # the random tiny MoE: a warm start would cost minutes
        "rollout.prompts_per_step=2",
        "rollout.n_samples=2",
        "rollout.eval_prompts=0",
        "trainer.micro_batch_size=4",
        "trainer.steps=2",
        "trainer.save_every=0",
        "logging.progress=false",
        "quant.activation_scale=static",
        "quant.calib_prompts=4",
        "quant.quality_gate=false",
        f"logging.run_dir={tmp_path / 'run'}",
    ]
    cfg = Config.load(ROOT / "configs/tiny_moe_cpu.yaml", overrides)
    assert cfg.trainer.qat_mode == "guided"
    try:
        run = Run(cfg, resume=False)
        trainer = {site: float(v) for site, v in run.actor.qat.static_scales.items()}
        assert len(run.input_amax) == 4 * 4 * 3 and len(trainer) == 4 * 4 * 2
        seen, train = [], run.trainer.train

        def spy(batch, version):
            records = [run.store.get(s.guidance.key) for s in batch.samples]
            routed = [s.routed_experts for s in batch.samples]
            seen.append(static_scales_by_site(run.actor.qat.static_scales, records, routed)["rollout"])
            return train(batch, version)

        run.trainer.train = spy
        summary = run.run()
    finally:
        destroy()
    assert summary["steps"] == 2 and len(seen) == 2
    for rollout in seen:
        assert rollout and all(v == [trainer.get(site)] for site, v in rollout.items()), rollout
        assert {site.split(".")[2] for site in rollout} == {"0", "1", "2", "3"}  # every layer's experts
    assert 0 < summary["mean_abs_dlogp"] < 0.02
