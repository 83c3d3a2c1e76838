"""The project's layer spec: Megatron's TransformerLayer built from QAT linears, QAT core attention
and RMSNorms, the same modules on CPU and GPU.

Each QAT linear owns (optional fused RMSNorm) -> quantize (weight by the quant policy, activation
round-to-nearest or guided by the rollout) -> GEMM. With `fused_norm` (the layout of Transformer
Engine's spec, `TELayerNormColumnParallelLinear`) `input_layernorm` and a dense layer's
`pre_mlp_layernorm` are identities and `linear_qkv` / `linear_fc1` hold the norm's weight under TE's
name (`layer_norm_weight`), so the quantized tensor is the NORMALIZED activation: the tensor the
rollout quantizes and its guidance describes. MoE layers keep `pre_mlp_layernorm` (the router reads
its output), as TE's spec does.

The GEMM is Megatron's own linear autograd function (torch.matmul: cuBLAS on GPU). The operands are
fake-quantized BF16/FP32 tensors, so there is no FP4 GEMM to hand to Transformer Engine and the
linears use none of TE's modules; the numerics never depend on which GEMM kernel runs. Attention
over packed micro-batches is Transformer Engine's (Megatron's TEDotProductAttention) where TE is
installed on a GPU, torch's flash SDPA otherwise (`packed_attention.py`); the fake-quantized K and
V are its inputs either way. The output layer (`LogprobHead`) hands the last hidden states to the
loss, which forms vocab-parallel logits chunk by chunk (`logprobs.py`).

Modules without a bound site (`qat_site is None`: mode off, a BF16 module, QAT not installed) run
exactly Megatron's ColumnParallelLinear / RowParallelLinear, and attention exactly as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_trace.kernels import cpu_routes

from .packed_attention import packed_attention, packed_attention_cp, te_attention


@dataclass
class LinearSite:
    """What install_qat binds to one QAT linear: the state (mode, guidance, counters), the
    rollout's site name, whether the input is FP4 (W4A4) or only the weight (W4A16), and for
    expert linears the function choosing the expert's guidance rows."""

    state: object  # qat.QATState (not imported: qat imports nothing of Megatron)
    site: str
    quantize_input: bool
    select: Callable | None = None


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm built the way Megatron builds norms; unlike WrappedTorchNorm it allows
    sequence parallelism (its weight is marked so Megatron all-reduces its grads over TP)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm":
            raise ValueError(
                f"the project's layer spec has RMSNorm only; config.normalization is {config.normalization!r}"
            )
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def _sequence_rows(module, x: torch.Tensor) -> slice | None:
    """Under sequence parallelism a column-parallel input is this rank's [S/TP, B, H] slice of the
    sequence; its rows (s*B + b order) are one contiguous range of the micro-batch's [S*B] rows."""
    if not getattr(module, "sequence_parallel", False) or getattr(module, "explicit_expert_comm", False):
        return None
    from megatron.core.utils import get_pg_rank

    n = x.shape[0] * x.shape[1]
    r = get_pg_rank(module.tp_group)
    return slice(r * n, (r + 1) * n)


class QATColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear whose input and weight are fake-quantized before Megatron's GEMM (which
    runs in fp32 on the operands' up-casts where this CPU has no bf16 GEMM: kernels/cpu_routes.py)."""

    qat_site: LinearSite | None = None

    def forward(self, input_, weight=None, runtime_gather_output=None):
        b = self.qat_site
        weight = self.weight if weight is None else weight
        if b is not None and b.state.mode != "off":
            if b.quantize_input:
                input_ = b.state.activation(input_, b.site, None, select=b.select, rows=_sequence_rows(self, input_))
            weight = b.state.weight(weight)
        return _in_gemm_dtype(super().forward, input_, weight, runtime_gather_output)


class QATLayerNormColumnParallelLinear(QATColumnParallelLinear):
    """RMSNorm fused into the column-parallel linear (TE's layout and parameter name): the norm's
    output is what gets quantized. Under TP without SP the GEMM all-reduces the input gradient, so
    the norm's weight gets the full gradient on every rank; under SP it is marked for Megatron's
    all-reduce of sequence-parallel parameters' grads."""

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, device=device, dtype=config.params_dtype))
        self.layer_norm_weight.sequence_parallel = config.sequence_parallel
        if config.normalization != "RMSNorm":
            raise ValueError(f"the fused norm is RMSNorm only; config.normalization is {config.normalization!r}")
        self.layer_norm_eps = config.layernorm_epsilon

    def forward(self, input_, weight=None, runtime_gather_output=None):
        # F.rms_norm is exactly what torch.nn.RMSNorm (the unfused layout's norm) computes.
        normed = F.rms_norm(input_, (self.input_size,), self.layer_norm_weight, self.layer_norm_eps)
        return super().forward(normed, weight=weight, runtime_gather_output=runtime_gather_output)


class QATRowParallelLinear(RowParallelLinear):
    """RowParallelLinear with fake-quantized operands. Its input holds a K slice of each row (the
    rows are complete: attention and the MLP see the gathered sequence), so the activation's
    per-token amax is MAX-reduced over TP and the guidance is sliced along K."""

    qat_site: LinearSite | None = None

    def forward(self, input_):
        b = self.qat_site
        qat = b is not None and b.state.mode != "off"
        gemm_dtype = cpu_routes.gemm_dtype(input_)
        if not qat and gemm_dtype == input_.dtype:
            return super().forward(input_)
        if not self.input_is_parallel:
            raise ValueError("the project's row-parallel linears take TP-split inputs (input_is_parallel=True)")
        weight = self.weight
        if qat:
            if b.quantize_input:
                k = input_.shape[-1]
                st = b.state
                k_slice = slice(st.tp_rank() * k, (st.tp_rank() + 1) * k) if st.tp_size() > 1 else None
                input_ = st.activation(input_, b.site, k_slice, select=b.select)
            weight = b.state.weight(weight)
        # Megatron's RowParallelLinear.forward with the fake-quantized weight, its GEMM in gemm_dtype.
        out = self._forward_impl(
            input=input_.to(gemm_dtype),
            weight=weight.to(gemm_dtype),
            bias=None,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=False,
            sequence_parallel=False,
            tp_group=None,
            grad_output_buffer=None,
        ).to(input_.dtype)
        if self.explicit_expert_comm:
            assert self.skip_bias_add
        elif self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
        else:
            out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None


class QATDotProductAttention(MegatronModule):
    """Core attention on K and V as the rollout caches them (FP4/FP8 fake-quantized), then:
    packed THD micro-batches (what the actor runs) through `packed_attention` (TE's fused/flash
    kernel where TE is installed on CUDA, torch's flash SDPA per sample otherwise; context parallel
    too), memory linear in S; the padded [S, B] layout through Megatron's unfused
    DotProductAttention (the S x S reference the tests compare with)."""

    # (state, site prefix "model.layers.N.self_attn.", (k_fmt, v_fmt), qat.KBias or None)
    qat_kv: tuple | None = None

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group = pg_collection.cp
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5
        # Megatron's local attention refuses context parallelism: the padded reference is CP1-only.
        ref_cfg = config if config.context_parallel_size == 1 else None
        self.unfused = (
            None
            if ref_cfg is None
            else DotProductAttention(
                ref_cfg,
                layer_number,
                attn_mask_type,
                attention_type,
                attention_dropout,
                softmax_scale,
                cp_comm_type,
                pg_collection,
            )
        )
        self.te = te_attention(
            config, layer_number, attn_mask_type, attention_type, softmax_scale, cp_comm_type, pg_collection
        )

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if self.qat_kv is not None and self.qat_kv[0].mode != "off":
            state, prefix, (k_fmt, v_fmt), k_bias = self.qat_kv
            if k_fmt != "bf16":  # a de-biased cache holds K - RoPE_pos(b): quantize that
                rb = None if k_bias is None else k_bias.rotated(state.positions_of_rows(key), key.device)
                key = state.kv(key, prefix + "k_cache", k_fmt, offset=None if rb is None else rb.view(key.shape))
            if v_fmt != "bf16":
                value = state.kv(value, prefix + "v_cache", v_fmt)
        if packed_seq_params is None:
            if self.unfused is None:
                raise ValueError("context parallelism needs packed micro-batches (the padded layout is CP1-only)")
            return self.unfused(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if attention_bias is not None:
            raise ValueError("the project's attention takes no attention bias")
        if self.te is not None:
            return self.te(query, key, value, None, attn_mask_type, None, packed_seq_params)
        cu = packed_seq_params.cu_seqlens_q
        # attention's GEMMs in fp32 on the up-casts where this CPU has no bf16 GEMM (kernels/cpu_routes.py:
        # torch's bf16 flash attention ran 5.8x slower than fp32 there, forward and backward)
        dtype = cpu_routes.gemm_dtype(query)
        q, k, v = (t.to(dtype) for t in (query, key, value))
        if self.cp_group is not None and self.cp_group.size() > 1:
            out = packed_attention_cp(q, k, v, cu, self.softmax_scale, self.cp_group)
        else:
            out = packed_attention(q, k, v, cu, self.softmax_scale)
        return out.to(query.dtype).reshape(out.shape[0], -1)


class LogprobHead(ColumnParallelLinear):
    """Megatron's output layer (vocab-parallel: `parallel_output=True`). With `emit_hidden` set it
    returns the hidden states mapped exactly as the GEMM's input would be (all-reduce of their grad
    over TP, or the sequence-parallel gather) and remembers the weight the GEMM would have used
    (the embedding's when tied), so the logits can be formed chunk by chunk by the loss."""

    emit_hidden = False
    _used: tuple = (None,)  # a tuple: assigning a Parameter to a module attribute would register it

    @property
    def head_weight(self) -> torch.Tensor | None:
        """The weight the last forward would have multiplied by (the embedding's when tied)."""
        return self._used[0]

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if not self.emit_hidden:
            weight = self.weight if weight is None else weight
            return _in_gemm_dtype(super().forward, input_, weight, runtime_gather_output)
        self._used = (self.weight if weight is None else weight,)
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(input_, True, group=self.tp_group), None
        return copy_to_tensor_model_parallel_region(input_, group=self.tp_group), None


def _in_gemm_dtype(column_forward, input_, weight, runtime_gather_output):
    """A ColumnParallelLinear.forward whose GEMM runs in this CPU's dtype for it (cpu_routes.gemm_dtype):
    bf16 operands without bf16 GEMM hardware multiply as fp32 up-casts (autograd's backward GEMMs too)
    and the output is rounded back to bf16; otherwise exactly Megatron's call."""
    gemm_dtype = cpu_routes.gemm_dtype(input_)
    if gemm_dtype == input_.dtype:
        return column_forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
    out, bias = column_forward(
        input_.to(gemm_dtype), weight=weight.to(gemm_dtype), runtime_gather_output=runtime_gather_output
    )
    return out.to(input_.dtype), bias


class QATSpecProvider(LocalSpecProvider):
    """Megatron's local backend with the QAT modules (used for the MoE experts' spec)."""

    def column_parallel_linear(self) -> type:
        return QATColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return QATRowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self) -> type:
        return QATLayerNormColumnParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return RMSNorm

    def core_attention(self) -> type:
        return QATDotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool):
        if moe_use_grouped_gemm:
            raise ValueError("the project's layer spec runs experts as SequentialMLP (moe_grouped_gemm=False)")
        return super().grouped_mlp_modules(False, False)[0], MLPSubmodules(
            linear_fc1=QATColumnParallelLinear, linear_fc2=QATRowParallelLinear
        )


def layer_spec(*, num_experts: int | None, qk_layernorm: bool, fused_norm: bool = True) -> ModuleSpec:
    """One decoder layer of the project's spec (see the module docstring for the layout)."""
    fused = QATLayerNormColumnParallelLinear if fused_norm else QATColumnParallelLinear
    if num_experts:
        mlp = get_moe_module_spec_for_backend(
            backend=QATSpecProvider(), num_experts=num_experts, moe_grouped_gemm=False
        )
    else:
        mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=fused, linear_fc2=QATRowParallelLinear))
    qk = RMSNorm if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp if fused_norm else RMSNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=fused,
                    core_attention=QATDotProductAttention,
                    linear_proj=QATRowParallelLinear,
                    q_layernorm=qk,
                    k_layernorm=qk,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm if (num_experts or not fused_norm) else IdentityOp,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def block_spec(
    config, *, num_experts: int | None, qk_layernorm: bool, fused_norm: bool = True
) -> TransformerBlockSubmodules:
    """This pipeline stage's layers and the final RMSNorm (Megatron's default block picks
    WrappedTorchNorm, which refuses sequence parallelism)."""
    spec = layer_spec(num_experts=num_experts, qk_layernorm=qk_layernorm, fused_norm=fused_norm)
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=RMSNorm)
