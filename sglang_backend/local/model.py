"""Qwen2/2.5, Qwen3 and Qwen3-MoE for the embedded engine, over a paged (optionally FP4) KV cache.

    tokens ─► embed ─► [ norm ─► qkv (FP4?) ─► q/k norm ─► RoPE ─► KV write (FP4?) ─► attention
                         ─► o_proj (FP4?) ─► + ─► norm ─► gate_up (FP4?) ─► SiLU·up ─► down (FP4?) ─► + ] × L
           ─► norm ─► lm_head (BF16) ─► logits of each sequence's last token
Which linears and KV entries are FP4 comes from the QuantPolicy; every quantized input can be
reported to a capture function under its guidance site name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_trace.kernels import cpu_attention, cpu_fused, cpu_routes, onednn_linear
from megatron_trace.models import ModelArch, QuantPolicy
from megatron_trace.models.rope import ColumnOffsets, rotated_bias

from ..routed_experts import routed_experts, slot_record, swiglu
from . import attention, layer_c, run_plan
from .guidance_log import LoggedCapture
from .kv_cache import PagedKVCache
from .layers import CaptureFn, EngineLinear, Rope, lm_head_logits, rms_norm


@dataclass
class ForwardBatch:
    """One forward over several sequences' new tokens, flattened."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    spans: list[tuple[int, int]]  # each sequence's rows in the flat batch
    write_slots: torch.Tensor  # [T] KV slot of each new token
    read_slots: list[torch.Tensor]  # per sequence, KV slots of positions 0..last new token
    logits_rows: list[int] | None = None  # rows whose logits are wanted (default: each span's last)
    read_index: torch.Tensor | None = None  # decode: [B, W] slots, row i valid up to read_lens[i]
    read_lens: torch.Tensor | None = None  # decode: [B]
    kv_decode_scales: list | None = None  # NVFP4 KV: per layer [S_dec of K, S_dec of V], set by the model
    kv_global_scales: list | None = None  # NVFP4 KV: per layer (S_enc of K, S_enc of V), set by the model
    decode: bool | None = None  # every span one token (the scheduler knows; otherwise spans are scanned)
    routed_experts: torch.Tensor | None = None  # int32 [T, layers, top_k]: MoE layers write their top-k ids

    def __post_init__(self):
        self.is_decode = self.decode if self.decode is not None else all(e - s == 1 for s, e in self.spans)
        self._gather = None
        self._layout = None

    def attention_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(slot table [S, >= W] with contiguous rows, sequence of each row [T], visible positions of
        each row [T], W = the most any row sees) for the fused paged attention: prefill and decode
        alike, built once per forward."""
        if self._layout is None:
            if self.read_index is not None:
                table, row_seq = self.read_index, torch.arange(len(self.spans))
            else:
                table = torch.nn.utils.rnn.pad_sequence(self.read_slots, batch_first=True)
                row_seq = torch.repeat_interleave(
                    torch.arange(len(self.spans)), torch.tensor([e - s for s, e in self.spans])
                )
            row_len = self.positions + 1
            self._layout = (table.contiguous(), row_seq, row_len, int(row_len.max()))
        return self._layout

    def decode_gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat slot index [B*W], visibility mask [B, W]) of a decode batch: built once per forward."""
        if self._gather is None:
            idx, lens = self.read_index, self.read_lens
            if idx is None:
                lens = torch.tensor([s.numel() for s in self.read_slots])
                idx = torch.nn.utils.rnn.pad_sequence(self.read_slots, batch_first=True)
            width = int(lens.max())
            idx = idx[:, :width]
            self._gather = (idx.reshape(-1), torch.arange(width)[None, :] < lens[:, None])
        return self._gather


class _Layer(nn.Module):
    def __init__(self, arch: ModelArch, policy: QuantPolicy, idx: int, dtype: torch.dtype):
        super().__init__()
        self.idx, self.arch = idx, arch
        p = f"model.layers.{idx}."
        self.kv_sites = (p + "self_attn.k_cache", p + "self_attn.v_cache")
        h, d = arch.hidden_size, arch.head_dim

        def linear(hf_module, site, shards, k, bias=False, held_out=None):
            # The policy decides per HF module; fused groups were checked to be all-or-none.
            fp4 = policy.enabled and policy.linear_is_fp4(p + hf_module, arch.num_layers)
            wfmt = policy.format if fp4 and policy.weights == "fp4" else None
            afmt = policy.format if fp4 and policy.activations == "fp4" else None
            return EngineLinear(
                shards, k, bias=bias, weight_fmt=wfmt, act_fmt=afmt, dtype=dtype, site=p + site, bias_held_out=held_out
            )

        # quant.kv_k_debias: this layer's K cache holds RoPE_pos(x W_k), K without its k_proj bias b, and
        # attention adds RoPE_pos(b) back in fp32 at read (models/rope.py); the linear never adds b to K
        self.k_debias = policy.kv_k_debias and policy.kv_format(idx, arch.num_layers, "k") != "bf16"
        if self.k_debias and not arch.qkv_bias:
            raise ValueError(f"quant.kv_k_debias needs a k_proj bias; {arch.family} has none")
        self.qkv = linear(
            "self_attn.q_proj",
            "self_attn.qkv_proj",
            {"q": arch.q_size, "k": arch.kv_size, "v": arch.kv_size},
            h,
            arch.qkv_bias,
            "k" if self.k_debias else None,
        )
        self._k_columns = ColumnOffsets(arch.head_dim, arch.rope_theta)  # k_bias_columns' table
        self.o_proj = linear("self_attn.o_proj", "self_attn.o_proj", {"o": h}, arch.q_size, arch.o_bias)
        self.input_norm = nn.Parameter(torch.ones(h, dtype=dtype), requires_grad=False)
        self.post_norm = nn.Parameter(torch.ones(h, dtype=dtype), requires_grad=False)
        if arch.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(d, dtype=dtype), requires_grad=False)
            self.k_norm = nn.Parameter(torch.ones(d, dtype=dtype), requires_grad=False)
        self.moe = arch.layer_is_moe(idx)
        if self.moe:
            ffn, n = arch.moe_intermediate_size, arch.num_experts
            self.router = nn.Parameter(torch.zeros(n, h, dtype=dtype), requires_grad=False)
            self.experts_gate_up = nn.ModuleList(
                linear(f"mlp.experts.{e}.gate_proj", "mlp.experts.gate_up_proj", {"gate": ffn, "up": ffn}, h)
                for e in range(n)
            )
            self.experts_down = nn.ModuleList(
                linear(f"mlp.experts.{e}.down_proj", "mlp.experts.down_proj", {"down": h}, ffn) for e in range(n)
            )
        else:
            ffn = arch.intermediate_size
            self.gate_up = linear("mlp.gate_proj", "mlp.gate_up_proj", {"gate": ffn, "up": ffn}, h)
            self.down = linear("mlp.down_proj", "mlp.down_proj", {"down": h}, ffn)

    def attention(self, x, batch: ForwardBatch, kv: PagedKVCache, rot, capture) -> torch.Tensor:
        a = self.arch
        qkv = self.qkv(x, capture)
        v = qkv[:, a.q_size + a.kv_size :].reshape(-1, a.num_kv_heads, a.head_dim)
        if a.qk_norm:
            q = qkv[:, : a.q_size].reshape(-1, a.num_heads, a.head_dim)
            k = qkv[:, a.q_size : a.q_size + a.kv_size].reshape(-1, a.num_kv_heads, a.head_dim)
            q, k = rms_norm(q, self.q_norm, a.rms_norm_eps), rms_norm(k, self.k_norm, a.rms_norm_eps)
            q, k = Rope.apply(q, *rot), Rope.apply(k, *rot)
        else:  # one rotation over q's and k's heads together (elementwise: same values)
            qk = Rope.apply(qkv[:, : a.q_size + a.kv_size].reshape(-1, a.num_heads + a.num_kv_heads, a.head_dim), *rot)
            q, k = qk[:, : a.num_heads], qk[:, a.num_heads :]
        if self.k_debias:  # the linear left b out: k is RoPE(x W_k), what the cache stores
            k = k.float()
        self._store_kv(k, v, batch, kv, capture)
        k_add = self.k_bias_at if self.k_debias else None
        out = (
            attention.decode_attention(q, batch, kv, self.idx, k_add)
            if batch.is_decode
            else attention.prefill_attention(q, batch, kv, self.idx, k_add)
        )
        return self.o_proj(out.reshape(-1, a.q_size), capture)

    def k_bias_at(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """RoPE_pos(k_proj bias) [T, kv_heads, D]: what a de-biased K cache leaves out of K."""
        a = self.arch
        return rotated_bias(self.qkv.held_bias.view(a.num_kv_heads, a.head_dim), positions, a.rope_theta).to(dtype)

    def k_bias_columns(self, width: int) -> torch.Tensor:
        """k_bias_at(arange(width), fp32), contiguous, kept until the bias changes (weight loads bump
        the linear's generation, load_state_dict the bias's version)."""
        a, bias = self.arch, self.qkv.held_bias
        b = bias.view(a.num_kv_heads, a.head_dim)
        return self._k_columns.rows(b, width, (bias.data_ptr(), bias._version, self.qkv.generation))

    def _store_kv(self, k, v, batch: ForwardBatch, kv: PagedKVCache, capture) -> None:
        for which, t in ((0, k), (1, v)):
            qt = None
            # Guidance covers every quantized side (FP4 and FP8); a BF16 side has nothing to record.
            if capture is not None and kv.side_fmt[which] != "bf16":  # else write() quantizes
                qt = kv.quantize(self.idx, which, t)
                capture(self.kv_sites[which], qt)
            kv.write(self.idx, which, batch.write_slots, t, qt, return_values=False)

    def mlp(self, x, capture, batch: ForwardBatch) -> torch.Tensor:
        if not self.moe:
            return self.down(swiglu(self.gate_up(x, capture)), capture)
        return self._moe(x, capture, batch.routed_experts)

    def _moe(self, x, capture, routed: torch.Tensor | None = None) -> torch.Tensor:
        a = self.arch
        probs = F.softmax(cpu_routes.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, a.num_experts_per_tok, dim=-1)
        if routed is not None:  # routing replay: the trainer replays these ids, in this top-k order
            routed[:, self.idx] = experts
        if a.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        site_gu = self.experts_gate_up[0].site
        # Static input scales are per expert: a token's gate_up input is then quantized differently by
        # each of its experts, and the site is recorded per (token, slot) like down_proj's.
        gu_per_slot = any(lin.input_global_scale is not None for lin in self.experts_gate_up)
        if capture is not None and not gu_per_slot and self.experts_gate_up[0].act_fmt in ("nvfp4", "mxfp4"):
            # Per-token NVFP4 scaling and MXFP4's per-row 32-blocks quantize a token's input identically
            # for every expert: one site.
            capture(site_gu, self.experts_gate_up[0].quantize_input(x))
        gu_parts = [] if capture is not None and gu_per_slot else None
        down_parts = [] if capture is not None else None
        out = routed_experts(
            x,
            weights,
            experts,
            a.num_experts,
            lambda e, rows, tok, slot: self.experts_gate_up[e](rows, _slot_sink(gu_parts, tok, slot)),
            lambda e, h, tok, slot: self.experts_down[e](h, _slot_sink(down_parts, tok, slot)),
        )
        for site, parts in ((site_gu, gu_parts), (self.experts_down[0].site, down_parts)):
            if parts:
                capture(site, slot_record(parts, x.shape[0], a.num_experts_per_tok))
        return out

    def forward(self, x, batch, kv, rot, capture) -> torch.Tensor:
        eps = self.arch.rms_norm_eps
        x = x + self.attention(rms_norm(x, self.input_norm, eps), batch, kv, rot, capture)
        return x + self.mlp(rms_norm(x, self.post_norm, eps), capture, batch)

    def forward_fused(self, x, residual, batch, kv, rot, capture) -> torch.Tensor:
        """The C-kernel path (CPU): x is the residual stream, updated in place with the previous
        layer's pending `residual`; returns this layer's MLP output, still to be added."""
        eps = self.arch.rms_norm_eps
        h = cpu_fused.add_rmsnorm(x, residual, self.input_norm, eps)
        h = cpu_fused.add_rmsnorm(x, self.attention_fused(h, batch, kv, rot, capture), self.post_norm, eps)
        if self.moe:
            return self._moe(h, capture, batch.routed_experts)
        # .forward_cpu, not __call__: module hooks cost more than these small GEMMs on a tiny model;
        # decode widths stream the weights as stored (run_plan.linear_stream_rows)
        return self.down.forward_cpu(cpu_fused.silu_mul(self.gate_up.forward_cpu(h, capture)), capture)

    def attention_fused(self, h, batch: ForwardBatch, kv: PagedKVCache, rot, capture) -> torch.Tensor:
        a = self.arch
        qkv = self.qkv.forward_cpu(h, capture)
        norms = (self.q_norm, self.k_norm) if a.qk_norm else (None, None)
        table, row_seq, row_len, width = batch.attention_layout()
        # RoPE_j(b) of columns 0..width-1, which hold every position of this batch: added to K at read
        k_off = self.k_bias_columns(width) if self.k_debias else None
        if kv.fmt == "bf16":  # K and V go straight into their cache slots
            kc, vc = kv.layer_pages[self.idx]
            q = cpu_fused.qkv_rope(
                qkv,
                a.num_heads,
                a.num_kv_heads,
                a.head_dim,
                *rot,
                batch.positions,
                *norms,
                a.rms_norm_eps,
                kc,
                vc,
                batch.write_slots,
            )
        else:  # FP4 pages: quantize (and capture) the new K/V first
            k, v = (torch.empty(qkv.shape[0], a.num_kv_heads, a.head_dim, dtype=qkv.dtype) for _ in range(2))
            q = cpu_fused.qkv_rope(
                qkv, a.num_heads, a.num_kv_heads, a.head_dim, *rot, batch.positions, *norms, a.rms_norm_eps, k, v, None
            )
            if k_off is not None:  # RoPE(x W_k): the linear left b out
                k = k.float()
            self._store_kv(k, v, batch, kv, capture)
        scale = a.head_dim**-0.5
        if k_off is not None:  # the page kernel adds RoPE_j(b) to the K it decodes at column (position) j
            sdec_k, sdec_v = batch.kv_decode_scales[self.idx] if batch.kv_decode_scales else (1.0, 1.0)
            pages = kv.layer_pages[self.idx]
            out = cpu_attention.paged_attention_kv(
                q,
                kv.k_fmt,
                pages[:2],
                sdec_k,
                kv.v_fmt,
                pages[2:],
                sdec_v,
                table,
                row_seq,
                row_len,
                scale,
                k_add=k_off,
            )
        elif kv.fmt == "nvfp4":  # attention decodes the pages itself
            sdec_k, sdec_v = batch.kv_decode_scales[self.idx]
            kd, ks, vd, vs = kv.layer_pages[self.idx]
            out = cpu_attention.paged_attention_nvfp4(q, kd, ks, vd, vs, sdec_k, sdec_v, table, row_seq, row_len, scale)
        elif kv.fmt != "bf16":
            # FP8, MXFP4 and mixed pages (e.g. FP8 K + NVFP4 V): each side decoded in registers; a side
            # format the kernel does not know is refused there by name
            sdec_k, sdec_v = batch.kv_decode_scales[self.idx] if batch.kv_decode_scales else (1.0, 1.0)
            pages = kv.layer_pages[self.idx]
            out = cpu_attention.paged_attention_kv(
                q, kv.k_fmt, pages[:2], sdec_k, kv.v_fmt, pages[2:], sdec_v, table, row_seq, row_len, scale
            )
        else:
            out = cpu_attention.paged_attention(q, kc, vc, table, row_seq, row_len, scale)
        return self.o_proj.forward_cpu(out.view(qkv.shape[0], a.q_size), capture)


def _slot_sink(parts: list | None, tok: torch.Tensor, slot: torch.Tensor):
    """A capture fn that keeps one expert's quantized input with its (token, slot) rows, or None."""
    if parts is None:
        return None

    def sink(_site, q) -> None:
        parts.append((tok, slot, q))

    return sink


class QwenEngineModel(nn.Module):
    def __init__(self, arch: ModelArch, policy: QuantPolicy, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.arch, self.policy, self.dtype = arch, policy, dtype
        self.embed = nn.Parameter(torch.zeros(arch.vocab_size, arch.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(_Layer(arch, policy, i, dtype) for i in range(arch.num_layers))
        self.final_norm = nn.Parameter(torch.ones(arch.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = (
            self.embed
            if arch.tie_word_embeddings
            else nn.Parameter(torch.zeros(arch.vocab_size, arch.hidden_size, dtype=dtype), requires_grad=False)
        )
        self.rope = Rope(arch.head_dim, arch.rope_theta)
        self._head_packed = onednn_linear.PackedWeight()  # the LM head above decode widths

    def linears(self):
        return [m for m in self.modules() if isinstance(m, EngineLinear)]

    def run_plan(self, kv: PagedKVCache) -> run_plan.RunPlan:
        """How each layer runs over kv (run_plan.py), decided once per cache."""
        cached = self.__dict__.get("_plan_for")
        if cached is None or cached[0] is not kv:
            cached = self.__dict__["_plan_for"] = (kv, run_plan.plan_for(self, kv))
        return cached[1]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: PagedKVCache, capture: CaptureFn | None = None) -> torch.Tensor:
        """Returns fp32 logits [len(logits_rows), vocab] (default: each sequence's last token)."""
        x = F.embedding(batch.input_ids, self.embed)
        all_rows = batch.is_decode and batch.logits_rows is None  # every row's logits, in order
        rows = (
            None
            if all_rows
            else (batch.logits_rows if batch.logits_rows is not None else [e - 1 for _, e in batch.spans])
        )
        eps = self.arch.rms_norm_eps
        # The guidance log's capture names the layers it records; the others skip capture work.
        wanted = capture.layers if isinstance(capture, LoggedCapture) else None
        caps = [capture if wanted is None or i in wanted else None for i in range(len(self.layers))]
        plan = self.run_plan(kv)
        if plan.fused:
            rot = self.rope.tables_upto(batch.attention_layout()[3], x.dtype)  # the kernels index by position
            if "nvfp4" in kv.side_fmt:
                batch.kv_decode_scales, batch.kv_global_scales = kv.scales_as_floats()
            residual = layer_c.run_layers(self.layers, plan.modes(x.shape[0], caps), x, batch, kv, rot, caps)
            if all_rows:
                h = cpu_fused.add_rmsnorm(x, residual, self.final_norm, eps)
            else:
                rows_t = torch.tensor(rows)
                h = cpu_fused.add_rmsnorm(
                    x.index_select(0, rows_t), residual.index_select(0, rows_t), self.final_norm, eps
                )
        else:
            rot = self.rope.tables(batch.positions, x.dtype)  # cos/sin once for every layer's q and k
            for layer, cap in zip(self.layers, caps):
                x = layer(x, batch, kv, rot, cap)
            h = rms_norm(x if all_rows else x[rows], self.final_norm, eps)
            return cpu_routes.linear(h, self.lm_head).float()
        return lm_head_logits(h, self.lm_head, self._head_packed)
