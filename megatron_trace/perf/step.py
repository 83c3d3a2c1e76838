"""Roofline model of the RL step outside the rollout: weight-sync bytes, TRACE guidance bytes
per token, QAT fake-quant overhead. Stdlib only; builds on `megatron_trace.perf.roofline`'s model
specs, byte counts and efficiencies."""

from __future__ import annotations

from .roofline import GPU, PRECISIONS, Eff, ModelSpec, active_linear_params, linear_params, weight_bytes


def sync_bytes(m: ModelSpec, prec: str) -> float:
    """Bytes of a trainer -> rollout weight sync with prec on the wire (BF16 for non-linears)."""
    return weight_bytes(m, PRECISIONS[prec])


def guidance_sites(m: ModelSpec, dedup_experts: bool = False) -> tuple[list[int], list[int]]:
    """(activation site widths, KV site widths) per token of one layer, as guidance/record.py
    records them: qkv, o, gate_up, down (or per routed slot, + shared expert) and k/v caches.
    `dedup_experts`: the expert gate_up input is the same vector for all top_k slots; count once."""
    act = [m.hidden, m.o_width]
    if m.moe:
        act += [m.hidden] if dedup_experts else [m.hidden] * m.top_k
        act += [m.moe_inter] * m.top_k
        if m.shared_inter:
            act += [m.hidden, m.shared_inter]
    else:
        act += [m.hidden, m.ffn]
    return act, [m.kv_heads * m.head_dim] * 2


def site_bytes(width: int, mode: str, global_bytes: int = 4) -> float:
    """One token of one site: codes (4 bits full / 1 mantissa bit) + E4M3 per 16 + fp32 global."""
    payload = {"full": 0.5, "mantissa": 1 / 8}[mode]
    return width * (payload + 1 / 16) + global_bytes


def guidance_bytes_per_token(
    m: ModelSpec, mode: str, layers: str = "half", dedup_experts: bool = False, global_bytes: int = 4
) -> tuple[float, float]:
    """(activation bytes, KV bytes) per token; layers = "all" or "half" (the last half)."""
    n = m.layers if layers == "all" else m.layers - m.layers // 2
    act, kv = guidance_sites(m, dedup_experts)
    kv_layers = m.n_kv_layers if layers == "all" else m.n_kv_layers - m.n_kv_layers // 2
    return (
        n * sum(site_bytes(w, mode, global_bytes) for w in act),
        kv_layers * sum(site_bytes(w, mode, global_bytes) for w in kv),
    )


def paper_style_guidance(m: ModelSpec, mode: str, layers: str = "all") -> tuple[float, float]:
    """One hidden-wide activation site per layer, no per-token global scales (how the TRACE paper
    figures for Qwen3.5-35B-A3B come out exactly)."""
    n = m.layers if layers == "all" else m.layers - m.layers // 2
    kv_layers = m.n_kv_layers if layers == "all" else m.n_kv_layers - m.n_kv_layers // 2
    return (n * site_bytes(m.hidden, mode, 0), kv_layers * 2 * site_bytes(m.kv_heads * m.head_dim, mode, 0))


def qat_overhead(
    m: ModelSpec, gpu: GPU, tp: int, tokens: int, eff: Eff, passes: float = 2.0, weight_refresh: bool = True
) -> dict:
    """Fake-quant cost of one trainer micro-batch of `tokens` tokens relative to its fwd+bwd.
    Each quantized linear's input is read and written once in BF16 (passes=2 -> 4 B/element; the
    fused kernel; the CPU reference makes ~15), and (weight_refresh) every quantized weight is
    fake-quantized once per micro-batch (read+write BF16). Backward uses the STE: no extra pass.
    fwd+bwd compute: 6 x active params x tokens at BF16 peak x mma efficiency."""
    act, _ = guidance_sites(m, dedup_experts=False)
    act_bytes = tokens * m.layers * sum(act) * 2 * passes
    w_bytes = linear_params(m) * 2 * passes if weight_refresh else 0.0
    bw = eff.bw(gpu, "gemv") * tp
    compute_s = 6 * (active_linear_params(m) + m.vocab * m.hidden) * tokens / (gpu.peak("bf16") * eff.mma * tp)
    act_s, w_s = act_bytes / bw, w_bytes / bw
    return {
        "act_s": act_s,
        "weight_s": w_s,
        "compute_s": compute_s,
        "act_frac": act_s / compute_s,
        "weight_frac": w_s / compute_s,
    }
