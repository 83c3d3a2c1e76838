"""Static activation scales for a live run (RL loop, probe): calibrate once, then use everywhere.

    amax = calibrate_static_amax(model_path, arch, policy, prompt_ids)   # {HF module: input amax}
    push_weights(..., input_amax=amax)                                   # buckets carry input_scale
    qat.set_static_activation_scales(static_site_scales(amax, arch, policy))

Which forward calibrates: the high-precision HF model of the starting checkpoint (fp32,
transformers' implementation; `transfer.calibrate`), the same pass `transfer.export
--calib-prompts` makes. Not the trainer's Megatron forward: under TP the inputs of row-parallel
linears (o_proj, down_proj) are sharded and every rank would need a max-reduce, and its fused
q/k/v / gate/up modules hide the per-member names the checkpoint's input_scale is keyed by. Not
the engine: it quantizes its activations itself, so it would calibrate on the rollout's own
rounding. One definition of amax (ModelOpt's PTQ) on the weights every side starts from keeps
the exported, synced and trained scales identical; a resumed run recalibrates the same amax from
the same checkpoint and prompts.

Routed experts: one amax per expert (gate/up shared, down its own), recomputed from the fused
experts module's input and HF's own routing (`transfer.calibrate_experts`); the trainer and the
engine use one S_enc per expert. An expert no calibration prompt reaches is refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..models import ModelArch, QuantPolicy


def static_amax_modules(arch: ModelArch, policy: QuantPolicy) -> list[str]:
    """The HF linears whose input the policy quantizes to FP4: the ones that need a static scale."""
    return [m for m in policy.quantized_linears(arch) if policy.activation_is_fp4(m, arch.num_layers)]


def calibrate_static_amax(
    model_path: str | Path, arch: ModelArch, policy: QuantPolicy, prompts: Sequence[Sequence[int]]
) -> dict[str, float]:
    """{HF module: max |input|} of every FP4-activation linear over `prompts` (token ids), from the
    fp32 forward of the checkpoint at `model_path`. Raises when the policy is not static or a site
    saw nothing (calibrate_input_amax names zero-amax modules)."""
    from .calibrate import calibrate_input_amax
    from .export import load_hf_dir

    modules = check_calibratable(arch, policy)
    _, hf_sd, hf_config = load_hf_dir(model_path)
    amax = calibrate_input_amax(hf_sd, hf_config, [list(p) for p in prompts], modules)
    missing = [m for m in modules if not amax.get(m, 0.0) > 0.0]
    if missing:
        raise ValueError(f"static activation calibration gave no amax for {missing[:4]}")
    return amax


def check_calibratable(arch: ModelArch, policy: QuantPolicy) -> list[str]:
    """The modules to calibrate, or a ValueError saying why this policy/model cannot be (cheap: every
    rank of a run calls it, so none is left waiting for a rank 0 that refused)."""
    if policy.activation_scale != "static":
        raise ValueError(
            f"calibrating static activation scales for a policy with activation_scale={policy.activation_scale!r}"
        )
    modules = static_amax_modules(arch, policy)
    if not modules:
        raise ValueError(
            "activation_scale='static' but the policy quantizes no linear's input to FP4 "
            f"(format {policy.format}, activations {policy.activations}): nothing to calibrate"
        )
    if policy.format != "nvfp4":
        raise ValueError(f"static activation scales are NVFP4's input_scale; format {policy.format} has none")
    return modules
