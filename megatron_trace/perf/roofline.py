"""Roofline model of one RL rollout (and the rest of the step) under BF16 / FP8 / NVFP4.

Stdlib only (no torch): `benchmarks/perf_model.py` prints the tables, `tests/test_perf_model.py`
checks the math; the rest of the step (weight sync, guidance bytes, QAT cost) is in
`megatron_trace/perf/step.py`. Every number here is an estimate, not a measurement; `Eff` records which of its
kernel-efficiency inputs were measured (`--measured FILE.json`) and which are assumed defaults.

Rollout model (one replica = `tp` GPUs, tensor parallel):
  * N = G answers x prompts sequences, each P prompt + L answer tokens, all of length P+L.
  * Memory-limited batch: B = floor((HBM*usable - reserve - weights/tp) / KV_per_seq_per_gpu(P+L)),
    capped at `max_batch`; the N sequences run in ceil(N/B) sequential waves (equal lengths, so
    continuous batching gives the same waves).
  * Decode step at context c with b sequences, per GPU:
        t = max(W_step/(BW*e_gemv) + b*KV_tok*c/(BW*e_attn), FLOPs/(peak*e_mma)) + overhead
    W_step = weights read once per step (MoE: only the experts some token of the batch routes to;
    the embedding table is not read, lm_head is). Summed over c = P..P+L by midpoint segments.
  * Prefill: compute-bound, one prefill of P tokens per prompt (the G answers share the prefix).
  * NVFP4 runs its FLOPs on FP4 tensor cores where the GPU has them (Blackwell, W4A4); Hopper
    has none, so NVFP4 there is W4A16 (dequantize -> BF16 FLOPs): only bytes and batch gain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

GB = 1e9


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_gb: float
    bw_tbs: float  # HBM TB/s (spec)
    peak_pflops: dict  # dense tensor-core PFLOP/s by compute format; a missing key = unsupported

    def peak(self, fmt: str) -> float:
        """FLOP/s for `fmt`, falling back to BF16 where the format has no tensor cores (W4A16)."""
        return self.peak_pflops.get(fmt, self.peak_pflops["bf16"]) * 1e15


GPUS = {
    "h200": GPU("H200", 141, 4.8, {"bf16": 0.99, "fp8": 1.98}),
    "b200": GPU("B200", 192, 8.0, {"bf16": 2.25, "fp8": 4.5, "fp4": 9.0}),
    # GB200: 186 GB is the per-GPU HBM3e of an NVL72 (13.4 TB / 72); FP8 not given -> 2x BF16.
    "gb200": GPU("GB200", 186, 8.0, {"bf16": 2.5, "fp8": 5.0, "fp4": 10.0}),
}


@dataclass(frozen=True)
class Precision:
    name: str
    weight_bits: float  # quantized linears (embeddings, lm_head, norms, router stay BF16)
    kv_bits: float
    compute: str  # tensor-core format for its GEMMs (falls back to bf16, see GPU.peak)


NVFP4_BITS = 4 + 8 / 16  # E2M1 + one E4M3 scale per 16 (the per-tensor fp32 global is negligible)


def kv_side_bits(fmt: str, row: int = 128) -> float:
    """Stored bits per K or V element in a cache format (quant.kv_k / quant.kv_v), scales included:
    FP8 E4M3 carries one fp32 scale per token over its KV heads (`row` = KV heads per GPU x
    head_dim; 128 = one head, the worst case), NVFP4/MXFP4 one 8-bit scale per 16."""
    bits = {"bf16": 16.0, "fp8": 8 + 32 / row, "nvfp4": NVFP4_BITS, "mxfp4": NVFP4_BITS}
    if fmt not in bits:
        raise ValueError(f"KV format must be one of {', '.join(bits)}; got {fmt!r}")
    return bits[fmt]


def kv_pair_bits(k_fmt: str, v_fmt: str, row: int = 128) -> float:
    """Bits of one K element plus one V element (BF16: 32; FP8 K + NVFP4 V, one head of 128: 12.75)."""
    return kv_side_bits(k_fmt, row) + kv_side_bits(v_fmt, row)


PRECISIONS = {
    "bf16": Precision("bf16", 16.0, 16.0, "bf16"),
    "fp8": Precision("fp8", 8 + 32 / (128 * 128), 8.0, "fp8"),  # 128x128 fp32 block scales
    "nvfp4": Precision("nvfp4", NVFP4_BITS, NVFP4_BITS, "fp4"),
    # NVFP4 weights, FP8 K (per-token scale over one KV head of 128) + NVFP4 V: the Qwen2/2.5 default
    # (quant.kv=auto); kv_bits is the mean over K and V.
    "nvfp4_fp8k": Precision("nvfp4_fp8k", NVFP4_BITS, kv_pair_bits("fp8", "nvfp4") / 2, "fp4"),
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    ffn: int = 0  # dense MLP intermediate (0 for MoE)
    experts: int = 0
    top_k: int = 0
    moe_inter: int = 0
    shared_inter: int = 0  # shared expert intermediate (0 = none)
    kv_layers: int = 0  # layers with a KV cache (0 = all); hybrid models have fewer
    o_in: int = 0  # width of the o_proj / out_proj input (0 = heads*head_dim)

    @property
    def n_kv_layers(self) -> int:
        return self.kv_layers or self.layers

    @property
    def o_width(self) -> int:
        return self.o_in or self.heads * self.head_dim

    @property
    def moe(self) -> bool:
        return self.experts > 0


MODELS = {
    # the CPU configs' model (configs/qwen2.5_0.5b_cpu.yaml): its plan without the checkpoint here
    "qwen2.5-0.5b": ModelSpec("Qwen2.5-0.5B", 24, 896, 14, 2, 64, 151936, tied=True, qkv_bias=True, ffn=4864),
    "qwen2.5-72b": ModelSpec("Qwen2.5-72B", 80, 8192, 64, 8, 128, 152064, qkv_bias=True, ffn=29568),
    "qwen3-30b-a3b": ModelSpec(
        "Qwen3-30B-A3B", 48, 2048, 32, 4, 128, 151936, qk_norm=True, experts=128, top_k=8, moe_inter=768
    ),
    "qwen3-235b-a22b": ModelSpec(
        "Qwen3-235B-A22B", 94, 4096, 64, 4, 128, 151936, qk_norm=True, experts=128, top_k=8, moe_inter=1536
    ),
}
# Guidance cross-check only (hybrid: 30 Gated-DeltaNet + 10 gated-attention layers; both have a
# 4096-wide output-projection input). Assumed from the public config, not used for rollout.
QWEN35_35B_A3B = ModelSpec(
    "Qwen3.5-35B-A3B (assumed)",
    40,
    2048,
    16,
    2,
    256,
    248320,
    experts=256,
    top_k=8,
    moe_inter=512,
    shared_inter=512,
    kv_layers=10,
    o_in=4096,
)


# ---------------------------------------------------------------- parameter and byte counts
def attn_params(m: ModelSpec) -> int:
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return m.hidden * (q + 2 * kv) + q * m.hidden


def mlp_params(m: ModelSpec) -> tuple[int, int]:
    """(routed-expert params, always-read MLP params) per layer."""
    if m.moe:
        shared = 3 * m.hidden * m.shared_inter
        return m.experts * 3 * m.hidden * m.moe_inter, shared
    return 0, 3 * m.hidden * m.ffn


def linear_params(m: ModelSpec) -> int:
    """Parameters of the quantizable linears (attention + MLP / experts), all layers."""
    routed, dense = mlp_params(m)
    return m.layers * (attn_params(m) + routed + dense)


def other_params(m: ModelSpec) -> int:
    """Kept in BF16: embeddings, lm_head, norms, biases, router."""
    emb = m.vocab * m.hidden * (1 if m.tied else 2)
    per_layer = 2 * m.hidden + (2 * m.head_dim if m.qk_norm else 0) + m.hidden * m.experts
    if m.qkv_bias:
        per_layer += (m.heads + 2 * m.kv_heads) * m.head_dim
    return emb + m.layers * per_layer + m.hidden


def total_params(m: ModelSpec) -> int:
    return linear_params(m) + other_params(m)


def weight_bytes(m: ModelSpec, p: Precision) -> float:
    return linear_params(m) * p.weight_bits / 8 + other_params(m) * 2


def active_linear_params(m: ModelSpec) -> int:
    """Linear params one token multiplies through (attention + top-k experts + shared)."""
    if m.moe:
        mlp = m.top_k * 3 * m.hidden * m.moe_inter + 3 * m.hidden * m.shared_inter
    else:
        mlp = 3 * m.hidden * m.ffn
    return m.layers * (attn_params(m) + mlp)


def expert_fraction_read(m: ModelSpec, b: int) -> float:
    """Expected share of a layer's experts some token of a b-token decode step routes to
    (uniform routing: 1 - (1 - k/E)^b)."""
    return 1.0 if not m.moe else 1 - (1 - m.top_k / m.experts) ** max(b, 1)


def step_weight_bytes(m: ModelSpec, p: Precision, b: int) -> float:
    """Weight bytes one decode step of b sequences reads (whole replica)."""
    routed, dense = mlp_params(m)
    lin = m.layers * (attn_params(m) + dense + routed * expert_fraction_read(m, b))
    lm_head = m.vocab * m.hidden
    return lin * p.weight_bits / 8 + (lm_head + other_params(m) - m.vocab * m.hidden * (1 if m.tied else 2)) * 2


def kv_bytes_per_token(m: ModelSpec, p: Precision) -> float:
    return m.n_kv_layers * 2 * m.kv_heads * m.head_dim * p.kv_bits / 8


def kv_bytes_per_token_gpu(m: ModelSpec, p: Precision, tp: int) -> float:
    """Per GPU: KV heads split over TP, replicated once tp > kv_heads (each rank keeps >= 1)."""
    heads = math.ceil(m.kv_heads / tp)
    return m.n_kv_layers * 2 * heads * m.head_dim * p.kv_bits / 8


def flops_per_token(m: ModelSpec, context: float) -> tuple[float, float]:
    """(linear FLOPs incl. lm_head, attention FLOPs at `context`) for one new token."""
    return (2 * (active_linear_params(m) + m.vocab * m.hidden), 4 * m.n_kv_layers * m.heads * m.head_dim * context)


# ---------------------------------------------------------------- efficiencies
@dataclass
class Eff:
    gemv: float = 0.80  # weight streaming in decode GEMV / small-batch GEMM, share of spec HBM BW
    attn: float = 0.75  # decode attention KV streaming, share of spec HBM BW
    mma: float = 0.60  # prefill / compute-bound GEMM, share of dense tensor-core peak
    copy_bw_tbs: float = 0.0  # measured device copy BW; when set, caps gemv and attn
    usable: float = 0.90  # share of HBM the engine may use
    reserve_gb: float = 4.0  # per GPU: activations, CUDA graphs, workspaces
    step_overhead_ms: float = 0.5  # per decode step: sampling, scheduling, launch gaps
    allreduce_us: float = 8.0  # per TP all-reduce (2 per layer) when tp > 1
    max_batch: int = 1024  # engine cap on running sequences
    measured: set = field(default_factory=set)  # names of fields that came from measurements

    def source(self, name: str) -> str:
        return "measured" if name in self.measured else "assumed"

    def bw(self, gpu: GPU, kind: str) -> float:
        e = getattr(self, kind)
        if self.copy_bw_tbs:
            e = min(e, self.copy_bw_tbs / gpu.bw_tbs)
        return gpu.bw_tbs * 1e12 * e

    def overhead_s(self, m: ModelSpec, tp: int) -> float:
        return self.step_overhead_ms * 1e-3 + (2 * m.layers * self.allreduce_us * 1e-6 if tp > 1 else 0.0)


MEASURED_KEYS = {
    "gemv": "gemv",
    "gemv_pct_roofline": "gemv",
    "attn": "attn",
    "attn_pct_roofline": "attn",
    "mma": "mma",
    "gemm_pct_roofline": "mma",
    "copy_bw_tbs": "copy_bw_tbs",
    "step_overhead_ms": "step_overhead_ms",
    "allreduce_us": "allreduce_us",
}


def eff_from_measured(data: dict, gpu_key: str, base: Eff | None = None) -> Eff:
    """Efficiencies from a measurement dict: flat or keyed by GPU ("h200": {...}). Percentages
    (> 1.5) are read as percent of roofline."""
    e = replace(base) if base else Eff()
    e.measured = set(e.measured)
    flat = {k: v for k, v in data.items() if not isinstance(v, dict)}
    flat.update(data.get(gpu_key, {}))
    for k, v in flat.items():
        if k not in MEASURED_KEYS:
            continue
        name = MEASURED_KEYS[k]
        v = float(v)
        if name in ("gemv", "attn", "mma") and v > 1.5:
            v /= 100
        setattr(e, name, v)
        e.measured.add(name)
    return e


# ---------------------------------------------------------------- rollout
@dataclass(frozen=True)
class Scenario:
    """Which precision sets each effect: bytes moved, memory (batch), FLOP rate."""

    bytes: str
    batch: str
    flops: str


def max_batch(m: ModelSpec, gpu: GPU, tp: int, p: Precision, ctx: int, eff: Eff) -> int:
    free = gpu.hbm_gb * GB * eff.usable - eff.reserve_gb * GB - weight_bytes(m, p) / tp
    if free <= 0:
        return 0
    return min(int(free // (kv_bytes_per_token_gpu(m, p, tp) * ctx)), eff.max_batch)


def decode_time(
    m: ModelSpec, gpu: GPU, tp: int, b: int, P: int, L: int, pb: Precision, compute: str, eff: Eff, segments: int = 64
) -> float:
    """Seconds for one wave of b sequences to decode L tokens after a P-token prompt."""
    if b <= 0 or L <= 0:
        return 0.0
    w = step_weight_bytes(m, pb, b) / tp / eff.bw(gpu, "gemv")
    kv_tok = b * kv_bytes_per_token_gpu(m, pb, tp) / eff.bw(gpu, "attn")
    peak = gpu.peak(compute) * eff.mma * tp
    over = eff.overhead_s(m, tp)
    seg = L / segments
    total = 0.0
    for i in range(segments):
        c = P + (i + 0.5) * seg
        lin, att = flops_per_token(m, c)
        total += seg * (max(w + kv_tok * c, b * (lin + att) / peak) + over)
    return total


def prefill_time(m: ModelSpec, gpu: GPU, tp: int, prompts: int, P: int, compute: str, eff: Eff) -> float:
    lin, att = flops_per_token(m, P / 2)  # causal: mean context P/2
    return prompts * P * (lin + att) / (gpu.peak(compute) * eff.mma * tp)


@dataclass
class Rollout:
    batch: int
    waves: int
    prefill_s: float
    decode_s: float

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


def rollout(m: ModelSpec, gpu: GPU, tp: int, G: int, prompts: int, P: int, L: int, sc: Scenario, eff: Eff) -> Rollout:
    """One rollout of G answers x prompts on one replica; inf times if one sequence won't fit."""
    n = G * prompts
    b = max_batch(m, gpu, tp, PRECISIONS[sc.batch], P + L, eff)
    compute = PRECISIONS[sc.flops].compute
    if b < 1:
        return Rollout(0, 0, math.inf, math.inf)
    full, rest = divmod(n, b)
    pb = PRECISIONS[sc.bytes]
    dec = full * decode_time(m, gpu, tp, b, P, L, pb, compute, eff)
    dec += decode_time(m, gpu, tp, rest, P, L, pb, compute, eff)
    return Rollout(b, full + (1 if rest else 0), prefill_time(m, gpu, tp, prompts, P, compute, eff), dec)


def same(prec: str) -> Scenario:
    return Scenario(prec, prec, prec)


DECOMP_STEPS = (
    ("bytes", lambda q: Scenario(q, "bf16", "bf16")),
    ("batch", lambda q: Scenario(q, q, "bf16")),
    ("flops", lambda q: Scenario(q, q, q)),
)


def decompose(m, gpu, tp, G, prompts, P, L, prec, eff, attr: str = "total_s") -> dict:
    """Multiplicative factors BF16 -> prec: bytes (same batch), + batch, + FLOPs. Their product
    is the full speedup; `attr` picks total_s or decode_s."""
    prev = getattr(rollout(m, gpu, tp, G, prompts, P, L, same("bf16"), eff), attr)
    out, total = {}, 1.0
    for name, mk in DECOMP_STEPS:
        cur = getattr(rollout(m, gpu, tp, G, prompts, P, L, mk(prec), eff), attr)
        f = prev / cur if cur and math.isfinite(prev) and math.isfinite(cur) else math.nan
        out[name] = f
        total *= f
        prev = cur
    out["total"] = total
    return out


def byte_ceiling(prec: str) -> float:
    return 16 / PRECISIONS[prec].kv_bits
