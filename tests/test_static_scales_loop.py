"""quant.activation_scale=static in the RL loop: calibrated once at start, the same S_enc on both sides.

Two in-process steps of the tiny config (few prompts): every rollout record of every step carries,
per FP4-activation site, the one static S_enc the trainer's QAT rounds that site with.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = [
    "trainer.warm_start_steps=40",
    "rollout.prompts_per_step=2",
    "rollout.n_samples=2",
    "rollout.eval_prompts=0",
    "trainer.micro_batch_size=4",
    "logging.progress=false",
    "trainer.steps=2",
    "trainer.save_every=0",
    "quant.activation_scale=static",
    "quant.calib_prompts=4",
    "quant.quality_gate=false",  # static scales are the subject; the gate has its own tests
]


def _static_scales_seen(run) -> list[dict[str, float]]:
    """Wraps the step trainer: each step's records' 0-d S_enc per linear site (-1: a per-token scale)."""
    seen, train = [], run.trainer.train

    def spy(batch, version):
        per_step: dict[str, set[float]] = {}
        for s in batch.samples:
            for site, rec in run.store.get(s.guidance.key).sites.items():
                if site.rsplit(".", 1)[1] in ("gate_up_proj", "down_proj"):
                    gs = rec.global_scale
                    per_step.setdefault(site, set()).add(float(gs) if gs.dim() == 0 else -1.0)
        seen.append(per_step)
        return train(batch, version)

    run.trainer.train = spy
    return seen


def test_two_steps_with_static_scales_share_the_trainers_senc(tmp_path):
    from megatron_trace.config import Config
    from megatron_trace.run.run import Run
    from megatron_trace.trainer.parallel import destroy

    cfg = Config.load(ROOT / "configs/tiny_cpu.yaml", [*OVERRIDES, f"logging.run_dir={tmp_path / 'run'}"])
    try:
        run = Run(cfg, resume=False)
        trainer = {site: float(v) for site, v in run.actor.qat.static_scales.items()}
        assert len(run.input_amax) == 4 * 3 and len(trainer) == 4 * 2 and min(trainer.values()) > 0
        seen = _static_scales_seen(run)
        summary = run.run()
    finally:
        destroy()
    assert summary["steps"] == 2 and len(seen) == 2
    for per_step in seen:  # one value per site in every record, and it is the trainer's (after a sync too)
        assert {site: sorted(v) for site, v in per_step.items()} == {site: [v] for site, v in trainer.items()}
    # guided QAT with the rollout's static scale follows it closely (measured 0.0023 on this run)
    assert 0 < summary["mean_abs_dlogp"] < 0.02
