"""Qwen-family architecture facts, HF <-> Megatron-Core layout maps and the FP4 quantization policy.

Pure torch + stdlib: importing this package pulls in neither transformers nor megatron.
"""

from .arch import FAMILIES, ModelArch
from .megatron_map import (
    hf_to_megatron,
    megatron_param_to_hf,
    megatron_to_hf,
    padded_vocab_size,
    pp_layer_range,
    tp_split_dim,
    unfuse_hf_experts,
)
from .quant_policy import DEFAULT_TARGETS, QuantPolicy
from .tiny import make_tiny_checkpoint, tiny_hf_config

__all__ = [
    "DEFAULT_TARGETS",
    "FAMILIES",
    "ModelArch",
    "QuantPolicy",
    "hf_to_megatron",
    "make_tiny_checkpoint",
    "megatron_param_to_hf",
    "megatron_to_hf",
    "padded_vocab_size",
    "pp_layer_range",
    "tiny_hf_config",
    "tp_split_dim",
    "unfuse_hf_experts",
]
