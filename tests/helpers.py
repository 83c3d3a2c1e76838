"""Helpers several test modules share (no test module imports another): synthetic prompts and
records, the probe run in-process, the wide test layer, HF's MoE router as the reference."""

from __future__ import annotations

import torch

from megatron_trace.fp4 import nvfp4
from megatron_trace.guidance import GuidanceRecord, make_site

GUIDANCE_SITES = ("model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj")

# hidden 512 x (2 x 4224) gate_up weights: above run_plan.ONE_CALL_MAX_WEIGHTS, one layer to stay quick
WIDE = dict(
    hidden_size=512,
    intermediate_size=4224,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    tie_word_embeddings=False,
)


def random_prompts(n: int = 4) -> list[dict]:
    """n prompts of 12 random token ids, as quality.run takes them (no text, no answer)."""
    g = torch.Generator().manual_seed(0)
    return [{"ids": torch.randint(3, 320, (12,), generator=g).tolist(), "text": None, "answer": None} for _ in range(n)]


def make_record(sample_id: str, positions: int = 5, k: int = 64, mode: str = "full", seed: int = 0):
    """A real record: NVFP4-quantized random activations, per-token global scale."""
    g = torch.Generator().manual_seed(seed)
    sites = {}
    for name in GUIDANCE_SITES:
        q = nvfp4.quantize(torch.randn(positions, k, generator=g), per_row_global=True)
        sites[name] = make_site(q.scale, q.global_scale, q.data, mode)
    return GuidanceRecord(sample_id, mode, positions, sites)


def probe_in_process(ckpt, *flags):
    """The quality probe's report on 4 prompts x 12 tokens with `flags` (NVFP4 K and V unless they say)."""
    from megatron_trace.quality import probe

    base = ["--model-path", str(ckpt), "--num-prompts", "4", "--max-new-tokens", "12", "--kv-cache-dtype", "nvfp4"]
    return probe.probe(probe.parse_args([*base, *flags]))


def hf_topk(path, tokens: list[int], top_k: int) -> torch.Tensor:
    """HF transformers' MoE router top-k expert ids [positions, layers, top_k] (the model reference)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_router_logits=True)
    return torch.stack([torch.topk(r.float().softmax(-1), top_k, -1).indices for r in out.router_logits], 1)


def tiny_rollout(cfg, backend, tok, prompts, reward_fn, store=None, family: str = "qwen2"):
    """run.rollout.Rollout as a run builds it, for the tiny model of `family`: the config's policy
    resolved for that architecture."""
    from megatron_trace.models import ModelArch, tiny_hf_config
    from megatron_trace.run.rollout import Rollout

    arch = ModelArch.from_hf_config(tiny_hf_config(family))
    return Rollout(cfg, cfg.quant.resolve(arch), arch, backend, tok, prompts, reward_fn, store)
