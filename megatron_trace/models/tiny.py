"""Tiny random Qwen-family checkpoints for tests: real transformers models, real safetensors.

Shapes are chosen to exercise the layout corner cases (GQA with 2 groups, Qwen3's
head_dim != hidden / heads, a MoE with top-2 of 4 experts) while staying a few hundred KB.
"""

from __future__ import annotations

import inspect
import math
from os import PathLike
from pathlib import Path
from typing import Any

import torch

from .arch import FAMILIES

_BASE: dict[str, Any] = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.02,
}
_FAMILY: dict[str, dict[str, Any]] = {
    "qwen2": {"architectures": ["Qwen2ForCausalLM"]},
    # head_dim 32 while hidden / heads = 16: catches any code that derives head_dim.
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "head_dim": 32, "attention_bias": False},
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "head_dim": 32,
        "attention_bias": False,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}
_MODEL_CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_CONFIG_CLASSES = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig"}


def tiny_hf_config(family: str, **overrides: Any) -> dict:
    """A tiny HF `config.json` dict for `family`; `overrides` replace or add keys."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}; got {family!r}")
    cfg = {"model_type": family, **_BASE, **_FAMILY[family], **overrides}
    # Both rope spellings, kept consistent, so transformers 4.x and 5.x read the same theta.
    cfg["rope_parameters"] = {"rope_theta": cfg["rope_theta"], "rope_type": "default"}
    return cfg


@torch.no_grad()
def _reinit(model: torch.nn.Module, hidden: int) -> None:
    """Fan-in scaled weights and non-trivial norms/biases.

    HF's 0.02-std init gives near-uniform logits at hidden 64, and its all-ones norms and zero
    biases would hide any mix-up between them in layout tests; this keeps every tensor distinct
    and the logits spread out (std ~ 2).
    """
    for name, p in model.named_parameters():
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            # Same std for both so a tied head gives the same logit spread as an untied one.
            p.normal_(0.0, 2.0 / math.sqrt(hidden))
        elif "norm" in name:
            p.uniform_(0.8, 1.2)
        elif name.endswith("bias"):
            p.normal_(0.0, 0.1)
        else:
            # Linear [out, in] or transformers-5 fused experts [E, out, in]: fan-in is the last dim.
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))


def make_tiny_checkpoint(
    path: str | PathLike, family: str, seed: int = 0, dtype: str = "float32", **overrides: Any
) -> Path:
    """Write a random-init tiny HF checkpoint (config.json + model.safetensors) to `path`.

    Deterministic in `seed`; needs no network and no tokenizer.
    """
    import transformers  # lazy: importing megatron_trace.models must stay light

    cfg = tiny_hf_config(family, **overrides)
    torch_dtype = getattr(torch, dtype)
    config = getattr(transformers, _CONFIG_CLASSES[family])(**{k: v for k, v in cfg.items() if k != "model_type"})
    torch.manual_seed(seed)
    model = getattr(transformers, _MODEL_CLASSES[family])(config)
    _reinit(model, cfg["hidden_size"])
    if cfg.get("tie_word_embeddings"):
        model.tie_weights()
    model = model.to(torch_dtype).eval()
    out = Path(path)
    kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers 4.x; 5.x always writes safetensors
    model.save_pretrained(out, **kwargs)
    return out
