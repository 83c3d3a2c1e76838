"""Architecture facts of the Qwen family (Qwen2/Qwen2.5, Qwen3, Qwen3-MoE), read from an HF config.

One `ModelArch` is the single source of truth the rollout engine, the trainer's name maps and the
quantization policy share, so every HF spelling quirk is absorbed here and nowhere else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from os import PathLike
from pathlib import Path
from typing import Any

FAMILIES = ("qwen2", "qwen3", "qwen3_moe")
_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
_MOE_REQUIRED = ("num_experts_per_tok", "moe_intermediate_size")


def _require(cfg: dict, key: str, family: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"{family} config is missing required key {key!r}")
    return cfg[key]


def _dtype_name(value: Any) -> str:
    # HF writes "bfloat16"; older dumps or live configs may hold "torch.bfloat16" or a torch.dtype.
    if value is None:
        return "bfloat16"
    return str(value).removeprefix("torch.")


def _rope_extra(d: dict | None) -> dict:
    """Non-default rope settings without the theta, with the legacy `type` key renamed."""
    d = {k: v for k, v in (d or {}).items() if k != "rope_theta"}
    if "type" in d:
        d.setdefault("rope_type", d.pop("type"))
    return d if d.get("rope_type", "default") != "default" else {}


def _rope(cfg: dict, family: str) -> tuple[float, dict | None]:
    """(rope_theta, non-default rope parameters or None) from either HF config generation."""
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ValueError(
            f"{family} config is missing required key 'rope_theta' "
            "(expected top-level 'rope_theta' or 'rope_parameters.rope_theta')"
        )
    # Older configs keep YaRN & co. in `rope_scaling`; transformers 5 moves it into rope_parameters.
    extra = _rope_extra(params) or _rope_extra(cfg.get("rope_scaling"))
    return float(theta), (extra or None)


@dataclass(slots=True)
class ModelArch:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 32768
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    dtype: str = "bfloat16"
    rope_scaling: dict | None = field(default=None)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"model_type must be one of {', '.join(FAMILIES)}; got {self.family!r}")
        for name in _POSITIVE:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0; got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be divisible by num_key_value_heads ({self.num_kv_heads})"
            )
        self.mlp_only_layers = tuple(int(i) for i in self.mlp_only_layers)
        if self.family == "qwen3_moe":
            if self.num_experts <= 0 or not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"qwen3_moe needs num_experts > 0 and 0 < num_experts_per_tok <= num_experts; "
                    f"got num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}"
                )
            if self.decoder_sparse_step < 1:
                raise ValueError(f"decoder_sparse_step must be >= 1; got {self.decoder_sparse_step}")

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_hf_config(cls, cfg_or_path: dict | str | PathLike) -> ModelArch:
        """Read an HF `config.json` given as a dict, a file path or a checkpoint directory."""
        if isinstance(cfg_or_path, dict):
            cfg = cfg_or_path
        else:
            path = Path(cfg_or_path)
            if path.is_dir():
                path = path / "config.json"
            cfg = json.loads(path.read_text())
        family = cfg.get("model_type")
        if family not in FAMILIES:
            raise ValueError(f"model_type must be one of {', '.join(FAMILIES)}; got {family!r}")
        for key in _REQUIRED:
            _require(cfg, key, family)
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act must be 'silu' for {family}; got {act!r}")
        if cfg.get("use_sliding_window"):
            raise ValueError(
                f"use_sliding_window must be false for {family}; sliding-window attention is not supported"
            )

        heads = int(cfg["num_attention_heads"])
        # HF falls back to MHA when num_key_value_heads is absent; so do we.
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if family == "qwen2":
            head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
            qkv_bias, qk_norm = True, False
        else:
            # Qwen3 decouples head_dim from hidden/heads (e.g. Qwen3-0.6B: 1024 / 16 heads, head_dim 128).
            head_dim = int(_require(cfg, "head_dim", family))
            qkv_bias, qk_norm = bool(cfg.get("attention_bias", False)), True
        rope_theta, rope_scaling = _rope(cfg, family)

        moe: dict[str, Any] = {}
        if family == "qwen3_moe":
            # Hub checkpoints say num_experts; transformers 5 writes num_local_experts.
            num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
            if num_experts is None:
                raise ValueError("qwen3_moe config is missing required key 'num_experts' (or 'num_local_experts')")
            for key in _MOE_REQUIRED:
                _require(cfg, key, family)
            moe = dict(
                num_experts=int(num_experts),
                num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            )
        return cls(
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=rope_theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            dtype=_dtype_name(cfg.get("dtype", cfg.get("torch_dtype"))),
            rope_scaling=rope_scaling,
            **moe,
        )

    def to_hf_config(self) -> dict:
        """An HF `config.json` dict that `from_hf_config` (and transformers 4.5x/5.x) read back."""
        rope_parameters = {"rope_theta": self.rope_theta, "rope_type": "default", **(self.rope_scaling or {})}
        cfg: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            # Both spellings: transformers 5 reads rope_parameters, 4.x (and SGLang on it) rope_theta.
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "dtype": self.dtype,
        }
        if self.rope_scaling:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        if self.family != "qwen2":
            cfg["attention_bias"] = self.qkv_bias
        if self.family == "qwen3_moe":
            cfg.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        return cfg

    # ----------------------------------------------------------------- derived facts
    @property
    def is_moe(self) -> bool:
        return self.family == "qwen3_moe"

    @property
    def o_bias(self) -> bool:
        """Whether o_proj has a bias: Qwen3's attention_bias covers o_proj too, Qwen2's bias does not."""
        return self.qkv_bias and self.family != "qwen2"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_is_moe(self, i: int) -> bool:
        """Whether decoder layer `i` has a routed-expert MLP (HF's Qwen3-MoE rule, verbatim)."""
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} out of range for {self.num_layers} layers")
        return (
            self.is_moe
            and i not in self.mlp_only_layers
            and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0
        )

    def hf_param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF checkpoint parameter with its shape, in transformers' module-registration order.

        Experts are listed per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`), the on-disk
        layout; transformers 5 fuses them in memory (see `megatron_map.unfuse_hf_experts`).
        `lm_head.weight` is omitted when tied.
        """
        h, out = self.hidden_size, {}
        out["model.embed_tokens.weight"] = (self.vocab_size, h)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            for proj, rows in (("q_proj", self.q_size), ("k_proj", self.kv_size), ("v_proj", self.kv_size)):
                out[f"{p}self_attn.{proj}.weight"] = (rows, h)
                if self.qkv_bias:
                    out[f"{p}self_attn.{proj}.bias"] = (rows,)
            out[f"{p}self_attn.o_proj.weight"] = (h, self.q_size)
            if self.o_bias:
                out[f"{p}self_attn.o_proj.bias"] = (h,)
            if self.qk_norm:
                out[f"{p}self_attn.q_norm.weight"] = (self.head_dim,)
                out[f"{p}self_attn.k_norm.weight"] = (self.head_dim,)
            if self.layer_is_moe(i):
                ffn = self.moe_intermediate_size
                for e in range(self.num_experts):
                    q = f"{p}mlp.experts.{e}."
                    out[q + "gate_proj.weight"] = (ffn, h)
                    out[q + "up_proj.weight"] = (ffn, h)
                    out[q + "down_proj.weight"] = (h, ffn)
                out[f"{p}mlp.gate.weight"] = (self.num_experts, h)
            else:
                ffn = self.intermediate_size
                out[f"{p}mlp.gate_proj.weight"] = (ffn, h)
                out[f"{p}mlp.up_proj.weight"] = (ffn, h)
                out[f"{p}mlp.down_proj.weight"] = (h, ffn)
            out[f"{p}input_layernorm.weight"] = (h,)
            out[f"{p}post_attention_layernorm.weight"] = (h,)
        out["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab_size, h)
        return out

    def hf_linear_modules(self) -> list[str]:
        """HF module names of every nn.Linear (incl. router and lm_head), in parameter order."""
        return [
            k.removesuffix(".weight")
            for k, shape in self.hf_param_shapes().items()
            if len(shape) == 2 and k != "model.embed_tokens.weight"
        ]

    def replace(self, **changes: Any) -> ModelArch:
        """A copy with some fields changed (validated again)."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        kw.update(changes)
        return ModelArch(**kw)
