"""Quantization-aware forward in Megatron's linears and on K/V, driven by the rollout's policy.

    mode off     : BF16 trainer, nothing quantized (the naive FP4-rollout baseline)
    mode rtn     : plain QAT, weights and activations fake-quantized with round-to-nearest
    mode guided  : TRACE, activations and K/V rounded to the rollout's recorded codewords
                   (where a guidance record covers the position; rtn elsewhere)
Weights use the exporter's quantizer (one global amax over the full, TP-gathered fused weight), so trainer and
rollout weights are bit-identical. Backward is straight-through everywhere. NVFP4 quantization and guided
rounding go through `megatron_trace.kernels.dispatch`: the Triton kernels on CUDA tensors, one C pass per
site on CPU (guided rounding, dequantize and the agreement counts together; a bf16 trainer's activations
read and written as bf16), fp4's references where neither takes the input, the same bits every way.

Megatron lays activations out [seq, batch, hidden]; a micro-batch's guidance is assembled into that layout once
per site (`MicroBatchGuidance`), with each sample's positions 0..T-1 in its batch column. Row-parallel inputs
hold a K slice per TP rank: per-token amax is all-reduced (MAX) over TP and the guidance is sliced along K, so
every rank rounds exactly like the rollout's full-width quantizer. Under sequence parallelism a column-parallel
input is the rank's [S/TP, B, H] rows (gathered for the GEMM after quantization; per-token rounding is
row-local), and the guidance is sliced to those rows. Guidance whose row count does not match the activation's
is an error naming the site, never a silent round-to-nearest.

The modules that call this state are the project's layer spec (`layer_spec.py`).
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict

import torch
import torch.distributed as dist

from megatron_trace.fp4 import (
    RolloutRounding,
    dequantize_any,
    fp8,
    guided_quantize_mxfp4,
    mantissa_bits,
    mxfp4,
    nvfp4,
    straight_through,
    unpack_fp4,
)
from megatron_trace.kernels import kv_codec
from megatron_trace.kernels.dispatch import (
    mantissa_bits_packed,
    nvfp4_guided_dequantize_into,
    nvfp4_quantize_dequantize,
)
from megatron_trace.models import ModelArch, QuantPolicy
from megatron_trace.models.quant_policy import fused_group_of
from megatron_trace.models.rope import rotated_bias

from .batching import MicroBatchGuidance
from .routing_replay import expert_rows

log = logging.getLogger(__name__)
QAT_MODES = ("off", "rtn", "guided")  # trainer.qat_mode: no FP4, round-to-nearest QAT, TRACE
# Megatron linear -> (an HF linear it holds, the rollout's site: that linear's fused group)
_LINEAR_SITES = {
    meg: (hf, fused_group_of(hf))
    for meg, hf in (
        ("self_attention.linear_qkv", "self_attn.q_proj"),
        ("self_attention.linear_proj", "self_attn.o_proj"),
        ("mlp.linear_fc1", "mlp.gate_proj"),
        ("mlp.linear_fc2", "mlp.down_proj"),
    )
}
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_(fc1|fc2)$")
KV_SCALE = 1.0  # per-layer K/V S_enc, the engine's default (SGLang's k_scale/v_scale = 1.0)


class QATState:
    """Owns the mode, the current micro-batch's guidance and the agreement counters."""

    def __init__(self, arch: ModelArch, policy: QuantPolicy, mode: str, tp_group=None):
        if mode not in QAT_MODES:
            raise ValueError(f"trainer.qat_mode must be one of {', '.join(QAT_MODES)}; got {mode!r}")
        self.arch, self.policy, self.mode, self.tp_group = arch, policy, mode, tp_group
        self.guidance: MicroBatchGuidance | None = None
        self.row_positions: torch.Tensor | None = None  # each row's position in its sample (the micro-batch's)
        # True while autograd recomputes a checkpointed forward: the same rounding, counted once
        self.recomputing = False
        self.agree = defaultdict(lambda: [0, 0])  # site -> [elements agreeing with the rollout's codes, compared]
        # site -> [elements whose guided code differs from rtn, guided]: what mantissa guidance can measure in RL
        self.override = defaultdict(lambda: [0, 0])
        # The probe's honest mantissa measure: round with only the mantissa bits of full records, count
        # agreement against their full codes.
        self.mantissa_from_codes = False
        self.unguided = defaultdict(int)  # site -> rows with a record this rank could not match
        self.static_scales: dict[str, torch.Tensor] = {}  # site -> static activation S_enc (0-d)
        # the actor's RoutingReplay (the micro-batch's rollout expert ids): expert guidance matched by id
        self.routing_replay = None

    def set_micro_batch(self, guidance: MicroBatchGuidance | None, row_positions: torch.Tensor | None) -> None:
        """The micro-batch the next forward (or recomputed forward) belongs to."""
        self.guidance, self.row_positions = guidance, row_positions

    def positions_of_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's position in its sample for K/V rows x ([S, B, g, D] or packed [T, g, D]): the
        micro-batch's, or 0..S-1 per batch column for a direct call on the padded layout."""
        b = x.shape[1] if x.dim() == 4 else 1
        if self.row_positions is None:
            return torch.arange(x.shape[0]).repeat_interleave(b)
        if len(self.row_positions) != x.shape[0] * b:
            raise ValueError(
                f"the micro-batch has {len(self.row_positions)} rows of positions but attention sees "
                f"{x.shape[0] * b} rows: the layout and the model's input disagree"
            )
        return self.row_positions

    def tp_size(self) -> int:
        return dist.get_world_size(self.tp_group) if self.tp_group is not None and dist.is_initialized() else 1

    def tp_rank(self) -> int:
        return dist.get_rank(self.tp_group) if self.tp_group is not None and dist.is_initialized() else 0

    def _all_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp_size() > 1:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.tp_group)
        return t

    # -- the three quantization sites ------------------------------------------------------
    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """Fake-quantized weight in the policy's format. NVFP4: one global amax over the TP-gathered (fused)
        weight, as the exporter quantizes it. MXFP4: 32-element E8M0 blocks along K with the OCP floor rule,
        the engine's default (no global scale: each TP shard quantizes alone as the full weight's blocks)."""
        if self.policy.format == "mxfp4":
            return straight_through(w, mxfp4.dequantize(mxfp4.quantize(w.detach()), w.dtype))
        # |w|'s max is exact in w's dtype: no fp32 copy of the weight (the step quantizes it at every forward)
        amax = self._all_max(nvfp4.nan_free_amax(w.detach()).float().reshape(1)).reshape(())
        # the dispatcher: one C pass on CPU, Triton on CUDA, bit-identical to the reference
        _, deq = nvfp4_quantize_dequantize(w.detach(), global_amax=amax, dequant_dtype=w.dtype)
        return straight_through(w, deq)

    def set_static_activation_scales(self, scales: dict[str, float | torch.Tensor]) -> None:
        """site -> the static activation S_enc the rollout quantizes that site's input with (a
        checkpoint's input_scale as the engine reads it). Every mode uses it: rtn rounds with it,
        guided rows take the record's (the same value), uncovered rows it."""
        for site, v in scales.items():
            t = torch.as_tensor(v, dtype=torch.float32)
            if t.dim() or not (torch.isfinite(t) and t > 0):
                raise ValueError(f"static activation scale for {site} must be one finite S_enc > 0; got {v!r}")
            self.static_scales[site] = t

    def activation(
        self, x: torch.Tensor, site: str, k_slice: slice | None, select=None, rows: slice | None = None
    ) -> torch.Tensor:
        """Per-token NVFP4 of x [S, B, K_local] (or [n, K] rows picked by `select`, a function of
        the site's [S*B, ...] guidance tensors); guided rows follow the rollout's codes.
        rows: under sequence parallelism, which of the micro-batch's [S*B] rows x holds."""
        # The C quantizers read and write x's bf16 as it is (it widens to fp32 exactly: the same codes
        # and values), saving two conversion passes per site; experts (re-weighted rows), MXFP4 (the
        # torch reference) and row-parallel TP (the amax reduction) work in fp32.
        native = select is None and self.policy.format != "mxfp4" and (k_slice is None or self.tp_size() == 1)
        flat = x.detach().reshape(-1, x.shape[-1])
        flat = flat if native else flat.float()
        deq_dtype = flat.dtype
        # An expert's linear_fc2 input carries Megatron's routing weight, which neither E8M0 block scales
        # nor a static S_enc absorb: quantize the unweighted rows the engine quantizes, weight them again.
        weights = select.input_weights() if hasattr(select, "input_weights") else None
        w = None if weights is None else weights[:, None].to(flat.device)
        flat = flat if w is None else flat / w
        deq = None
        if self.policy.format == "mxfp4":
            # the engine's MXFP4 linears: 32-blocks along K, floor rule (a row-parallel K slice holds
            # whole blocks, no global scale to reduce over TP)
            q = mxfp4.quantize(flat)
        else:
            static = select.expert_site(site) if hasattr(select, "expert_site") else site  # experts: one per expert
            if static in self.static_scales:
                q, deq = nvfp4_quantize_dequantize(
                    flat, global_scale=self.static_scales[static].to(flat.device), dequant_dtype=deq_dtype
                )
            elif k_slice is None or self.tp_size() == 1:
                q, deq = nvfp4_quantize_dequantize(flat, per_row_global=True, dequant_dtype=deq_dtype)
            else:
                # row-parallel: the token's amax spans every TP rank's slice (the engine's and plugin's rule too)
                gs = nvfp4.per_token_global_scale(flat, self._all_max)
                q, deq = nvfp4_quantize_dequantize(flat, global_scale=gs, dequant_dtype=torch.float32)
        out = self._guide(flat, q, site, k_slice, select=select, rows=rows, deq=deq)
        out = out if w is None else out * w
        return straight_through(x, out.reshape(x.shape).to(x.dtype))

    def kv(self, t: torch.Tensor, site: str, fmt: str = "nvfp4", offset: torch.Tensor | None = None) -> torch.Tensor:
        """K or V [S, B, groups_local, D] as the rollout caches it in `fmt`: NVFP4 along D with the
        per-layer scale or MXFP4 as the engine's pages (16-blocks, ceil rule), or FP8 E4M3 with one
        scale per token over its KV heads (amax MAX-reduced over TP, which splits the heads; a guided
        row takes the rollout's S_enc), each guided where the rollout recorded the site.
        offset (fp32, broadcast to t): the cache holds t - offset (a de-biased K); subtracted and added
        back in fp32, so a large offset cancels without bf16 rounding."""
        x = t.detach().float() if offset is None else t.detach().float() - offset
        rows = x.reshape(-1, t.shape[-2], t.shape[-1])
        q = kv_codec.quantize(fmt, rows, nvfp4_scale=KV_SCALE, all_max=self._all_max)
        groups = t.shape[-2]
        g0 = self.tp_rank() * groups
        out = self._guide(rows, q, site, None, heads=slice(g0, g0 + groups)).reshape(t.shape)
        return straight_through(t, (out if offset is None else out + offset).to(t.dtype))

    def _guide(
        self, x_rows, q, site, k_slice, heads: slice | None = None, select=None, rows: slice | None = None, deq=None
    ) -> torch.Tensor:
        """The dequantized rows of q (an NVFP4Tensor or MXFP4Tensor of x_rows; deq: those values in fp32
        when the quantizer already made them), with the rows the micro-batch's guidance covers rounded
        to the rollout's codes in guided mode."""
        deq = dequantize_any(q) if deq is None else deq
        got = self.guidance.site(site, k_slice, x_rows.device) if self.guidance is not None and site else None
        if got is None:
            if self.mode == "guided" and self.guidance is not None and site:
                err = self.guidance.missing_site_error(site)
                if err is not None:
                    raise err
            return deq
        if rows is not None:  # sequence parallel: this rank's rows of the micro-batch
            rr, mask = got

            def pick(t):
                return None if t is None else t[rows]

            got = RolloutRounding(pick(rr.scale), pick(rr.global_scale), pick(rr.codes), pick(rr.mantissa)), mask[rows]
        if select is not None:
            got = select(*got)
            if got is None:  # an expert whose tokens this rank cannot map to the rollout's
                self._unguided(site, x_rows.shape[0])
                return deq
        rr, mask = got
        if mask.numel() != x_rows.shape[0]:
            raise ValueError(
                f"QAT site {site}: the guidance has {mask.numel()} rows for this rank's "
                f"activation but the activation has {x_rows.shape[0]} rows (tokens x batch"
                f"{' x top-k' if select is not None else ''}); the record and the micro-batch "
                f"layout disagree"
            )
        if heads is not None:

            def pick(t):
                return None if t is None else t[:, heads]

            gs = rr.global_scale[:, heads] if rr.global_scale.dim() > 1 else rr.global_scale
            if isinstance(q, fp8.FP8Tensor):  # one S_enc per token, repeated over the heads when assembled
                gs = gs[:, 0] if gs.dim() > 1 else gs
            rr = RolloutRounding(pick(rr.scale), gs, pick(rr.codes), pick(rr.mantissa))
        if self.mode != "guided":
            if not self.recomputing:
                self._count(site, q, rr, mask)
            return deq
        codes, mant = rr.codes, rr.mantissa
        is_fp8 = isinstance(q, fp8.FP8Tensor)
        if self.mantissa_from_codes and codes is not None:
            codes, mant = None, (mantissa_bits(codes) if is_fp8 else mantissa_bits_packed(codes))
        if isinstance(q, nvfp4.NVFP4Tensor):  # one pass: guided values into deq's covered rows, counted
            counting = not self.recomputing
            changed, agree, n = nvfp4_guided_dequantize_into(
                deq,
                x_rows,
                rr.scale,
                rr.global_scale,
                mask,
                codes=codes,
                mantissa=mant,
                rtn_codes=q.data if counting else None,
                agree_codes=rr.codes if counting else None,
            )
            if counting:
                self._add(self.override, site, changed, n)
                if rr.codes is not None:  # agreement against full codes only (see _count)
                    self._add(self.agree, site, agree, n)
            return deq
        if is_fp8:
            g = fp8.guided_quantize(x_rows, rr.global_scale, codes=codes, mantissa=mant)
        else:  # MXFP4: E8M0 block scales, no global scale
            g = guided_quantize_mxfp4(x_rows, rr.scale, codes=codes, mantissa=mant, block=q.block)
        if not self.recomputing:
            self._count(site, g, rr, mask)
            changed = (_codes(g) != _codes(q))[mask]
            self._add(self.override, site, int(changed.sum()), changed.numel())
        m = mask.reshape(-1, *([1] * (deq.dim() - 1)))
        return torch.where(m, dequantize_any(g), deq)

    @staticmethod
    def _add(counter, site: str, hits: int, n: int) -> None:
        if n:
            c = counter[site]
            c[0] += hits
            c[1] += n

    def _unguided(self, site: str, n: int) -> None:
        """Rows that had a record but could not be matched to it: round-to-nearest, said loudly
        (once per site) and counted (`unguided_rows`)."""
        if self.recomputing:
            return
        if site not in self.unguided and self.mode == "guided":
            log.warning(
                "QAT site %s: guidance could not be matched to this rank's rows (experts under "
                "TP/EP > 1 before routing replay): these rows use round-to-nearest",
                site,
            )
        self.unguided[site] += n

    def unguided_rows(self) -> dict[str, int]:
        """site -> rows that had guidance this rank could not use (rtn instead), since the last clear."""
        return dict(sorted(self.unguided.items()))

    def _count(self, site, q, rr: RolloutRounding, mask) -> None:
        """Codeword agreement of this mode's rounding with the rollout's full codes, on covered rows.
        Mantissa-only records cannot say which codeword the rollout used (matching bits are not
        matching codes), so they count nothing here: `override` is their metric."""
        if not mask.any() or rr.codes is None:
            return
        fp8_site = isinstance(q, fp8.FP8Tensor)
        ref = rr.codes if fp8_site else unpack_fp4(rr.codes)
        same = _zero_as_one(_codes(q)[mask], fp8_site) == _zero_as_one(ref[mask], fp8_site)
        c = self.agree[site]
        c[0] += int(same.sum())
        c[1] += same.numel()

    def set_mode(self, mode: str) -> None:
        if mode not in QAT_MODES:
            raise ValueError(f"trainer.qat_mode must be one of {', '.join(QAT_MODES)}; got {mode!r}")
        self.mode = mode
        self.clear_counters()

    def agreement(self) -> dict[str, float]:
        """site -> share of elements whose code equals the rollout's (full-code records only)."""
        return {s: a / n for s, (a, n) in sorted(self.agree.items()) if n}

    def override_rate(self) -> dict[str, float]:
        """site -> share of guided elements where guidance overrode round-to-nearest."""
        return {s: a / n for s, (a, n) in sorted(self.override.items()) if n}

    def clear_counters(self) -> None:
        self.agree.clear()
        self.override.clear()
        self.unguided.clear()


def _codes(q) -> torch.Tensor:
    """One code per element: FP8 bytes as they are, FP4 codes unpacked."""
    return q.data if isinstance(q, fp8.FP8Tensor) else unpack_fp4(q.data)


def _zero_as_one(codes: torch.Tensor, fp8_codes: bool = False) -> torch.Tensor:
    # -0 (E2M1 0x8, E4M3 0x80) and +0 dequantize to the same value: agreement is about values, not
    # zero's sign (mantissa guidance cannot name the sign of a zero, and it changes nothing downstream).
    return torch.where(codes == (0x80 if fp8_codes else 8), torch.zeros_like(codes), codes)


class KBias:
    """This rank's k_proj bias [groups, D] from linear_qkv's (interleaved per KV group: q heads, k, v),
    read at every call (it trains) for a de-biased K cache (quant.kv_k_debias)."""

    def __init__(self, linear_qkv, arch: ModelArch):
        if getattr(linear_qkv, "bias", None) is None:
            raise ValueError("quant.kv_k_debias needs linear_qkv's bias (add_qkv_bias); this model has none")
        self.linear_qkv, self.per_group, self.theta = linear_qkv, arch.num_heads // arch.num_kv_heads, arch.rope_theta
        self.head_dim = arch.head_dim

    def rotated(self, positions: torch.Tensor, device) -> torch.Tensor:
        """RoPE_pos(b) in fp32 [rows, groups, D] at each row's position."""
        b = self.linear_qkv.bias.view(-1, self.per_group + 2, self.head_dim)[:, self.per_group]
        return rotated_bias(b, positions.to(device), self.theta)


def install_qat(
    model_chunks, arch: ModelArch, policy: QuantPolicy, mode: str, layer_offsets: list[int], tp_group=None
) -> QATState:
    """Bind the QAT state and the rollout's site names to the QAT modules of each model chunk
    (built by `gpt.build_model` from the project's layer spec, `layer_spec.py`): FP4 linears get a
    `LinearSite`, attention the K/V formats. The modules read `state.mode` at every call, so one
    installed model can switch modes.

    layer_offsets[i]: the global index of chunk i's first decoder layer (pipeline stages).
    """
    from .layer_spec import LinearSite, QATColumnParallelLinear, QATDotProductAttention, QATRowParallelLinear

    policy.check_resolved(arch)
    state = QATState(arch, policy, mode, tp_group)
    if not policy.enabled and policy.k_format == policy.v_format == "bf16":
        return state  # nothing is quantized (a BF16 rollout): the trainer runs plain
    # (a KV-only policy, format bf16 with FP4/FP8 K or V, still binds attention below)
    fp4_input = policy.activations == "fp4"

    def bind(module, name: str, site: str, select=None) -> None:
        if not isinstance(module, (QATColumnParallelLinear, QATRowParallelLinear)):
            raise TypeError(
                f"install_qat: {name} is a {type(module).__name__}, not a QAT linear of the project's "
                f"layer spec (build the model with megatron_trace.trainer.gpt.build_model)"
            )
        k_local = getattr(module, "input_size_per_partition", None)  # row-parallel: this rank's K slice
        if policy.format == "mxfp4" and isinstance(module, QATRowParallelLinear) and k_local % mxfp4.BLOCK:
            # an E8M0 block would straddle TP ranks, which quantize their slices alone
            raise ValueError(
                f"install_qat: {name} holds K={k_local} per TP rank, not a multiple of MXFP4's "
                f"{mxfp4.BLOCK}-element blocks: lower trainer.tp (or use quant.format=nvfp4)"
            )
        module.qat_site = LinearSite(state, site, fp4_input, select)

    for chunk, offset in zip(model_chunks, layer_offsets):
        for name, module in chunk.named_modules():
            parts = name.split(".")
            if len(parts) < 4 or parts[0] != "decoder" or parts[1] != "layers":
                continue
            layer = offset + int(parts[2])
            local = ".".join(parts[3:])
            prefix = f"model.layers.{layer}."
            expert = _EXPERT.match(local)
            if expert:
                e, which = int(expert.group(1)), expert.group(2)
                moe = chunk.get_submodule(".".join(parts[:3]) + ".mlp")
                g = int(moe.local_expert_indices[e])  # the HF / rollout expert id (expert parallel: not e)
                hf = f"mlp.experts.{g}.{'gate_proj' if which == 'fc1' else 'down_proj'}"
                if policy.linear_is_fp4(prefix + hf, arch.num_layers):
                    site = prefix + ("mlp.experts.gate_up_proj" if which == "fc1" else "mlp.experts.down_proj")
                    bind(module, name, site, select=expert_rows(state, moe, layer, e, which == "fc2"))
            elif local in _LINEAR_SITES:
                hf_module, site = _LINEAR_SITES[local]
                if policy.linear_is_fp4(prefix + hf_module, arch.num_layers):
                    bind(module, name, prefix + site)
            elif local == "self_attention.core_attention" and policy.kv_is_fp4(layer, arch.num_layers):
                if not isinstance(module, QATDotProductAttention):
                    raise TypeError(
                        f"install_qat: {name} is a {type(module).__name__}, not the layer spec's "
                        f"QATDotProductAttention (build the model with gpt.build_model)"
                    )
                fmts = tuple(policy.kv_format(layer, arch.num_layers, w) for w in ("k", "v"))
                k_bias = None
                if policy.kv_k_debias and fmts[0] != "bf16":
                    qkv = chunk.get_submodule(".".join(parts[:3]) + ".self_attention.linear_qkv")
                    k_bias = KBias(qkv, arch)
                module.qat_kv = (state, prefix + "self_attn.", fmts, k_bias)
    return state
