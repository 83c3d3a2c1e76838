"""Megatron-Core GPTModel for Qwen2 / Qwen3 / Qwen3-MoE: build, load HF weights, export, logits.

Call `parallel.init_distributed(tp, pp, ep)` first; every function here works on the calling
rank's shard and uses Megatron's parallel_state groups. Numerics were checked against HF
transformers in fp32 on CPU. The layers are the project's layer spec (`layer_spec.py`) on CPU and
GPU alike; its default layout fuses the pre-attention / pre-MLP RMSNorms into the following linear
under Transformer Engine's parameter names, translated to the unfused names the HF map speaks (see
`_te_alias`).

Layouts: the actor packs samples into THD streams (Megatron's PackedSeqParams: RoPE restarts per
sample, attention stays inside each, `layer_spec.QATDotProductAttention`); `forward_logits` takes
the padded [B, S] layout (each row one sequence from position 0 under a causal mask), the
reference. The output layer is vocab-parallel (`layer_spec.LogprobHead`): logits are never gathered
over TP except by `forward_logits`.
"""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..models import ModelArch, hf_to_megatron, megatron_to_hf, padded_vocab_size

# trainer.recompute -> Megatron's TransformerConfig settings
RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}

# The fused layout (TE's, and the project spec's default) holds the pre-attention / pre-MLP norms in
# the following linear: unfused name -> fused name.
_TE_NORM_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel under DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _sequence_parallel(wanted: bool, tp: int) -> bool:
    """Sequence parallelism splits the residual stream over TP ranks; the project's layer spec
    supports it on every backend (its norms mark their weights for Megatron's SP grad all-reduce,
    its QAT linears slice the guidance to the rank's rows). With TP=1 there is nothing to split."""
    return wanted and tp > 1


def build_model(
    arch: ModelArch,
    *,
    dtype: torch.dtype = torch.float32,
    vocab_divisible_by: int = 128,
    sequence_parallel: bool = False,
    fused_norm: bool = True,
    recompute: str = "none",
) -> list:
    """This rank's model chunks (one GPTModel; pre/post-process set by its pipeline stage).

    The vocab is padded to a multiple of `vocab_divisible_by * TP` as Megatron-LM does (pass 1 to
    only pad to a multiple of TP). `arch` is attached to each chunk as `.hf_arch` so the other
    helpers know the real vocab. On CPU, `apply_cpu_workarounds()` must be active (it is after
    `init_distributed`), and fp32 is the validated dtype.

    The layers are the project's layer spec (`layer_spec.py`) on every machine: QAT linears and
    attention; `fused_norm` (the default, TE's layout) fuses the pre-attention and dense pre-MLP
    RMSNorms into linear_qkv / linear_fc1 so QAT quantizes the normalized activation; False keeps
    them as separate modules (the unfused layout, same logits).

    recompute (trainer.recompute): none; selective, Megatron's selective recompute of core
    attention and the dense MLPs; full, every layer's input kept and the layer recomputed.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from .layer_spec import LogprobHead, block_spec

    if arch.rope_scaling:
        raise ValueError(f"unsupported: rope scaling {arch.rope_scaling} is not mapped to Megatron")
    tp = ps.get_tensor_model_parallel_world_size()
    if recompute not in RECOMPUTE:
        raise ValueError(f"trainer.recompute must be one of {', '.join(RECOMPUTE)}; got {recompute!r}")
    moe = arch.is_moe
    if moe and (arch.mlp_only_layers or arch.decoder_sparse_step != 1):
        raise ValueError("unsupported: MoE models with dense layers (mlp_only_layers / decoder_sparse_step)")
    cpu = not torch.cuda.is_available()
    cfg = TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        qk_layernorm=arch.qk_norm,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        sequence_parallel=_sequence_parallel(sequence_parallel, tp),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=cpu,
        # HF matches need exact dropout-free, unfused math; the fusions need CUDA kernels anyway.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        num_moe_experts=arch.num_experts if moe else None,
        moe_ffn_hidden_size=arch.moe_intermediate_size if moe else None,
        moe_router_topk=arch.num_experts_per_tok if moe else 2,
        moe_router_score_function="softmax",
        # Qwen3-MoE: softmax over all experts, top-k, renormalize iff norm_topk_prob. Megatron's
        # pre-softmax mode is exactly "softmax then top-k without renormalizing".
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_load_balancing_type="none",
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",  # alltoall needs CUDA streams
        moe_router_dtype="fp32" if moe else None,
        **RECOMPUTE[recompute],
    )
    spec = block_spec(
        cfg, num_experts=arch.num_experts if moe else None, qk_layernorm=arch.qk_norm, fused_norm=fused_norm
    )
    model = GPTModel(
        cfg,
        spec,
        vocab_size=padded_vocab_size(arch.vocab_size, tp, vocab_divisible_by),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,  # logits stay vocab-parallel over TP
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,  # float: RotaryEmbedding only exponentiates it
    )
    if model.post_process:
        # GPTModel builds a plain ColumnParallelLinear; the subclass only adds the hidden-states mode
        model.output_layer.__class__ = LogprobHead
    if not cpu:
        model.cuda(torch.cuda.current_device())
    model.hf_arch = arch
    return [model]


def _te_alias(model_keys: set[str], name: str) -> str:
    """The model's name for unfused-layout parameter `name` (differs in the fused-norm layout)."""
    if name in model_keys:
        return name
    for local, te_name in _TE_NORM_ALIASES.items():
        if name.endswith("." + local):
            alias = name[: -len(local)] + te_name
            if alias in model_keys:
                return alias
    return name


def _local_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (no `_extra_state`) under the unfused layout's names (the HF map's)."""
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    reverse = {}
    for k in sd:
        for local, te_name in _TE_NORM_ALIASES.items():
            if k.endswith("." + te_name):
                reverse[k] = k[: -len(te_name)] + local
    return {reverse.get(k, k): v for k, v in sd.items()}


def _ranks() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    if ps.get_expert_tensor_parallel_world_size() != ps.get_tensor_model_parallel_world_size():
        raise ValueError("unsupported: expert tensor parallel size != tensor parallel size")
    return dict(
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
    )


@torch.no_grad()
def load_hf_weights(
    model_chunks: list, hf_dir_or_state_dict: str | PathLike | Mapping[str, torch.Tensor], arch: ModelArch
) -> None:
    """Copy an HF checkpoint (directory of *.safetensors, or a state dict) into this rank's shard.

    Every parameter of the chunk must be covered and every produced tensor must land (strict);
    padded vocab rows are zero. Each rank reads the whole checkpoint (fine for the model sizes
    this runs on; a large model would want per-rank lazy safetensors reads).
    """
    if isinstance(hf_dir_or_state_dict, Mapping):
        hf_sd = hf_dir_or_state_dict
    else:
        from safetensors.torch import load_file

        files = sorted(Path(hf_dir_or_state_dict).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {hf_dir_or_state_dict}")
        hf_sd = {}
        for f in files:
            hf_sd.update(load_file(str(f)))
    (chunk,) = model_chunks  # one chunk per rank (no virtual pipeline)
    model = _unwrap(chunk)
    ours = hf_to_megatron(hf_sd, arch, padded_vocab_size=model.vocab_size, **_ranks())
    params = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    keys = set(params)
    ours = {_te_alias(keys, k): v for k, v in ours.items()}
    missing, unexpected = sorted(keys - set(ours)), sorted(set(ours) - keys)
    if missing or unexpected:
        raise KeyError(f"HF -> Megatron mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
    for k, t in params.items():
        if t.shape != ours[k].shape:
            raise ValueError(f"{k}: model shape {tuple(t.shape)} != converted {tuple(ours[k].shape)}")
        t.copy_(ours[k])  # in place: keeps DDP's parameter views into its buffers valid


@torch.no_grad()
def export_hf_state_dict(model_chunks: list, arch: ModelArch) -> dict[str, torch.Tensor] | None:
    """The full HF state dict on global rank 0 (None on the other ranks). Collective: all ranks call.

    One rank per (pp, tp, ep) coordinate (the expert-data-parallel rank 0 one) sends its CPU copy
    to rank 0, which merges them with `megatron_to_hf` (pure layout, so bit-exact). Fine for the
    small models the tests and CPU runs use; a large model would stream per parameter instead.
    """
    from megatron.core import parallel_state as ps

    (chunk,) = model_chunks
    r = _ranks()
    mine = None
    if ps.get_expert_data_parallel_rank() == 0:
        sd = {k: v.detach().cpu().clone() for k, v in _local_state_dict(_unwrap(chunk)).items()}
        mine = ((r["pp_rank"], r["tp_rank"], r["ep_rank"]), sd)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    shards = dict(g for g in gathered if g is not None)
    return megatron_to_hf(shards, arch, tp_size=r["tp_size"], pp_size=r["pp_size"], ep_size=r["ep_size"])


def forward_logits(model_chunks: list, input_ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits [B, S, V] (V = the real vocab) for `input_ids` [B, S], on every rank.

    Runs Megatron's pipeline schedule (`get_forward_backward_func`, forward_only, one
    micro-batch of B rows) so TP/PP/EP all work; the last stage's logits are then broadcast over
    the pipeline group. Every rank must pass the same `input_ids`.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    (chunk,) = model_chunks
    model = _unwrap(chunk)
    vocab = model.hf_arch.vocab_size
    device = next(model.parameters()).device
    b, s = input_ids.shape
    ids = input_ids.to(device)
    position_ids = torch.arange(s, device=device).expand(b, s)
    # Explicit causal mask (True = masked): Megatron's default one is built on "cuda".
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None]

    def forward_step(data_iterator, m):
        out = m(ids, position_ids, mask)

        def collect(output_tensor, non_loss_data=False):
            # The vocab-parallel logits, gathered over TP; clone: the schedule may free the buffer.
            from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

            return gather_from_tensor_model_parallel_region(output_tensor.detach()).float().clone()

        return out, collect

    was_training = chunk.training
    chunk.eval()
    try:
        with torch.no_grad():
            store = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter([None]),
                model=model_chunks,
                num_microbatches=1,
                seq_length=s,
                micro_batch_size=b,
                forward_only=True,
                collect_non_loss_data=True,
            )
    finally:
        chunk.train(was_training)
    logits = store[0] if ps.is_pipeline_last_stage() else torch.empty(b, s, model.vocab_size, device=device)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_pipeline_model_parallel_group()
        src = dist.get_global_rank(group, dist.get_world_size(group) - 1)
        dist.broadcast(logits, src=src, group=group)
    return logits[..., :vocab]
