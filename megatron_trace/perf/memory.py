"""Trainer memory per rank: what one train step of a config needs on its busiest pipeline stage.

Stdlib only (no torch), beside the rollout model (`perf_model.py`, whose `ModelSpec`/`GPUS` it
uses). Every figure is an estimate from the layer spec's saved tensors, checked against measured
peaks on CPU shapes (tests/test_perf_memory.py: within 25%).

    weights    this rank's parameters (TP x PP x EP split; the busiest stage: embedding or head)
    grads      Megatron DDP's grad buffer, in the parameter dtype
    optimizer  Adam m and v in fp32 (+ fp32 master weights for bf16 params); / (DP x CP) with the
               distributed optimizer
    activations  tokens per micro-batch on this rank (trainer.max_tokens_per_microbatch / CP) x
               saved elements per token per layer (below) x layers of the stage x micro-batches
               1F1B keeps in flight (PP on the first stage), plus the dequantized FP4 weights QAT
               saves per layer and micro-batch; recompute trades them:
                 none       attention: norm input + GEMM input (h each), o_proj's input and SDPA's
                            q, k, v, out (flash attention: no S x S term); MLP: norm + GEMM input
                            (2h), five intermediate-width tensors of the SwiGLU and down GEMM (5I)
                 selective  core attention and the dense MLP recomputed (Megatron's core_attn + mlp):
                            their inputs only
                 full       each layer's input (h)
               and what the backward holds at once: one layer's activation grads (a recomputed
               layer's activations too) and the fp32 quantizer temporaries of the widest QAT input;
               under sequence parallelism the residual-stream terms are / TP too
    logits     the chunked vocab-parallel logprobs: its workspace, three fp32 buffers of one chunk
               (trainer.logprob_chunk_mb) and one in the weight's dtype, and in the backward the
               fp32 grad of this rank's vocab rows beside one chunk's product (in the weight's
               dtype) before it is added; trainer.logprob_keep_logits_mb: the micro-batch's logits
               in the weight's dtype kept from the forward, where they fit
    guidance   the device copy of a micro-batch's guidance for its guided sites (codes or mantissa
               bits + E4M3 scales + fp32 S_enc per token): one micro-batch's, freed after its
               forward; under recompute kept until its backward, so one per micro-batch in flight
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .roofline import GPUS, MODELS, ModelSpec, kv_side_bits

if TYPE_CHECKING:
    from megatron_trace.models import ModelArch

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# the chunked head's workspace (trainer/logprobs.py): fp32 logits, log-softmax and probabilities (and
# the chunk's logits in the weight's dtype beside them)
LOGIT_CHUNKS = 3
USABLE = 0.92  # share of HBM a run may plan for (allocator fragmentation, NCCL and CUDA context)


@dataclass(frozen=True)
class TrainerPlan:
    """The trainer knobs the estimate depends on (the `trainer` section's)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    dtype: str = "bfloat16"
    recompute: str = "none"
    tokens_per_microbatch: int = 8192
    logprob_chunk_mb: float = 128.0
    logprob_keep_logits_mb: float = 0.0
    guided_layers: int = 0  # layers whose sites carry guidance
    guided_sites_per_layer: tuple = ()  # per guided layer: the K width of each guided site
    guidance_bytes_per_element: float = 0.0  # 0.5 full codes, 0.125 mantissa bits (+ scales below)
    guided_fp8_sites_per_layer: tuple = ()  # FP8 K/V sites' widths: a byte per element full, a bit mantissa
    qat_input_width: int = 0  # the widest FP4-quantized activation (its fp32 quantizer temporaries); 0: no QAT
    qat_weight_params: float = 0.0  # per layer: weights of the FP4 linears (QAT saves their dequantized copy)


def spec_from_hf_config(c: dict, name: str) -> ModelSpec:
    """A ModelSpec from an HF config (Qwen2 / Qwen3 / Qwen3-MoE)."""
    heads = c["num_attention_heads"]
    return ModelSpec(
        name,
        c["num_hidden_layers"],
        c["hidden_size"],
        heads,
        c.get("num_key_value_heads", heads),
        c.get("head_dim") or c["hidden_size"] // heads,
        c["vocab_size"],
        tied=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=c.get("model_type") == "qwen2",
        qk_norm=c.get("model_type", "").startswith("qwen3"),
        ffn=0 if c.get("num_experts") else c["intermediate_size"],
        experts=c.get("num_experts", 0),
        top_k=c.get("num_experts_per_tok", 0),
        moe_inter=c.get("moe_intermediate_size", 0),
    )


def model_spec(path: str, tiny: dict | None = None) -> tuple[ModelSpec | None, str]:
    """(the shape of model.path, where it came from): its config.json; else the built-in shape its
    name spells (e.g. .../Qwen2.5-72B-Instruct on a machine without the checkpoint); the tiny
    model's config when path is empty; (None, why) otherwise."""
    if not path:
        return spec_from_hf_config(tiny or {}, "tiny"), "the tiny model"
    cfg = Path(path, "config.json")
    if cfg.exists():
        return spec_from_hf_config(json.loads(cfg.read_text()), Path(path).name), str(cfg)
    for key, spec in MODELS.items():
        if key in Path(path).name.lower():
            return spec, f"built-in shape {key!r} (no {cfg} here)"
    return None, f"no {cfg} and no built-in shape named like {Path(path).name!r}"


def _padded_vocab(m: ModelSpec, tp: int) -> int:
    return -(-m.vocab // (128 * tp)) * 128 * tp


def _stage_params(m: ModelSpec, p: TrainerPlan) -> float:
    """Parameters of the busiest pipeline stage on one rank."""
    q, kv, h = m.heads * m.head_dim, m.kv_heads * m.head_dim, m.hidden
    attn = (h * (q + 2 * kv) + q * h) / p.tp + ((q + 2 * kv) / p.tp if m.qkv_bias else 0)
    if m.moe:
        mlp = m.experts * 3 * h * m.moe_inter / (p.ep * p.tp) + h * m.experts
    else:
        mlp = 3 * h * m.ffn / p.tp
    norms = 2 * h + (2 * m.head_dim if m.qk_norm else 0)
    layers = math.ceil(m.layers / p.pp)
    vocab = _padded_vocab(m, p.tp) * h / p.tp
    ends = vocab * (1 if p.pp > 1 or m.tied else 2)  # embedding on the first stage, head on the last
    return layers * (attn + mlp + norms) + ends


def _act_elements(m: ModelSpec, p: TrainerPlan, mode: str) -> float:
    """Saved elements per token per layer on one rank (counted with torch's saved-tensor hooks on
    the layer spec: 4 residual-width tensors, o_proj's input and SDPA's q, k, v, out, the SwiGLU's
    5 intermediate-width tensors)."""
    q, kv, h, t = m.heads * m.head_dim, m.kv_heads * m.head_dim, m.hidden, p.tp
    res = h / t if p.sequence_parallel else h  # residual-stream tensors
    if mode == "full":  # the layer's input only
        return res
    if m.moe:  # the allgather dispatcher hands each rank every token's slots on its experts
        mlp = 2 * res + m.top_k * (h + 5 * m.moe_inter / t) + m.experts
    else:
        mlp = 2 * res + 5 * m.ffn / t
    if mode == "selective":  # core attention and a dense MLP keep only their inputs
        return 2 * res + (2 * q + 2 * kv) / t + (mlp if m.moe else res)
    return 2 * res + (3 * q + 2 * kv) / t + mlp


def guidance_bytes_per_token(m: ModelSpec, p: TrainerPlan) -> float:
    """A token's guidance on this rank's stage: per guided site the codes or mantissa bits, an E4M3
    scale per 16 and the fp32 S_enc; an FP8 K/V site a byte per element (full) or its low bit."""
    site_bytes = sum(k * p.guidance_bytes_per_element + k / 16 + 4 for k in p.guided_sites_per_layer)
    fp8_per_element = 1.0 if p.guidance_bytes_per_element > 0.125 else 0.125  # E4M3 bytes or their low bits
    site_bytes += sum(k * fp8_per_element + 4 for k in p.guided_fp8_sites_per_layer)
    return site_bytes * min(p.guided_layers, math.ceil(m.layers / p.pp))


def estimate(m: ModelSpec, p: TrainerPlan, gpu: str | None = None) -> dict:
    """Bytes per rank by category (and the fit against `gpu`'s HBM, when given)."""
    b = DTYPE_BYTES[p.dtype]
    params = _stage_params(m, p)
    opt_per_param = 8 + (4 if p.dtype != "float32" else 0)
    opt_share = p.dp * p.cp if p.distributed_optimizer else 1
    tokens = p.tokens_per_microbatch / p.cp
    layers = math.ceil(m.layers / p.pp)
    in_flight = p.pp
    one_layer = _act_elements(m, p, "none") * b * tokens
    # a QAT linear saves its fake-quantized weight for the backward unless its layer is recomputed (full:
    # the whole layer; selective: the MLP, where the FP4 linears are): measured, the real config's forward
    # left 0.15 GiB live over 24 layers under full recompute, not their 0.6 GiB of quantized MLP weights
    qat_saved = p.qat_weight_params / p.tp * b if p.recompute == "none" else 0.0
    saved = (_act_elements(m, p, p.recompute) * b * tokens + qat_saved) * layers * in_flight
    # backward holds one layer's activation grads; a recomputed layer's activations on top
    transient = one_layer * (2 if p.recompute != "none" else 1) + 3 * p.qat_input_width / p.tp * 4 * tokens
    vocab_local = _padded_vocab(m, p.tp) / p.tp
    chunk = min(p.logprob_chunk_mb * 2**20, tokens * vocab_local * 4)
    # its backward: the fp32 grad of this rank's vocab rows and a chunk's product in the weight's dtype
    # before it is added (through a few MB of fp32 blocks)
    logits = (LOGIT_CHUNKS + b / 4) * chunk + vocab_local * m.hidden * (4 + b) + tokens * m.hidden * b
    kept = tokens * vocab_local * b  # the forward's logits kept for the backward, where they fit
    logits += kept if kept <= p.logprob_keep_logits_mb * 2**20 else 0
    guidance = guidance_bytes_per_token(m, p) * tokens * (in_flight if p.recompute != "none" else 1)
    out = {
        "weights": params * b,
        # Megatron's DDP grad buffer: fp32 under bf16 params (the actor's grad_reduce_in_fp32, which
        # the optimizer takes as its main grads)
        "grads": params * (4 if p.dtype == "bfloat16" else b),
        "optimizer": params * opt_per_param / opt_share,
        "activations": saved + transient,
        "logits": logits,
        "guidance": guidance,
    }
    # every category at once: the bound a GPU plan (its caching allocator keeps freed blocks, unmeasured) is
    # held to; the one-process CPU model (process_estimate) takes the head and the layers one at a time
    out["total"] = sum(out.values())
    out["activations_saved"] = saved  # of "activations": what the layers keep through the step
    if gpu is not None:
        out["capacity"] = GPUS[gpu].hbm_gb * 1e9 * USABLE
        out["fits"] = out["total"] <= out["capacity"]
    return out


def advice(m: ModelSpec, p: TrainerPlan, est: dict) -> str:
    """The knob that would cut the largest share, in words."""
    big = max(("weights", "grads", "optimizer", "activations", "logits", "guidance"), key=lambda k: est[k])
    if big == "activations":
        if p.recompute != "full":
            return "set trainer.recompute=full (or selective)"
        if p.cp < 8:
            return f"raise trainer.cp (now {p.cp}) or lower trainer.max_tokens_per_microbatch"
        return "lower trainer.max_tokens_per_microbatch"
    if big == "optimizer" and not p.distributed_optimizer:
        return "set trainer.distributed_optimizer=true"
    if big == "logits":
        if p.logprob_keep_logits_mb:
            return "set trainer.logprob_keep_logits_mb=0 or lower trainer.logprob_chunk_mb"
        return "lower trainer.logprob_chunk_mb"
    if big == "guidance":
        return "guidance.mode=mantissa, fewer guided layers, or a smaller token budget"
    return f"raise trainer.tp (now {p.tp}) or trainer.pp (now {p.pp})"


def plan_from_config(cfg, pol, m: ModelSpec, dp: int) -> TrainerPlan:
    """The TrainerPlan of a run config (config.Config) and its resolved policy (`pol`, resolved for
    the model `m` describes) on `dp` data-parallel ranks."""
    from megatron_trace.guidance.record import resolve_guided_layers

    t, g = cfg.trainer, cfg.guidance
    last = f"model.layers.{m.layers - 1}."
    kv = m.kv_heads * m.head_dim
    linears = _layer_linears(m, t.ep)
    qat = t.qat_mode != "off"
    widths = [k for name, k, _ in linears if pol.activation_is_fp4(last + name, m.layers)]
    fp4_weights = sum(n for name, _, n in linears if pol.weight_is_fp4(last + name, m.layers)) if qat else 0.0
    kv_fmts = [pol.kv_format(m.layers - 1, m.layers, s) for s in ("k", "v")]
    sites = widths + [kv for f in kv_fmts if f in ("nvfp4", "mxfp4")]
    guided = len(resolve_guided_layers(m.layers, g.layers)) if t.qat_mode == "guided" else 0
    longest = cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens  # an oversized sample runs alone
    budget = t.max_tokens_per_microbatch if t.packing else t.micro_batch_size * longest
    return TrainerPlan(
        tp=t.tp,
        pp=t.pp,
        cp=t.cp,
        ep=t.ep,
        dp=dp,
        sequence_parallel=t.sequence_parallel,
        distributed_optimizer=t.distributed_optimizer,
        dtype=t.dtype,
        recompute=t.recompute,
        tokens_per_microbatch=max(budget, longest),
        logprob_chunk_mb=t.logprob_chunk_mb,
        logprob_keep_logits_mb=t.logprob_keep_logits_mb,
        guided_layers=guided,
        guided_sites_per_layer=tuple(sites),
        guided_fp8_sites_per_layer=tuple(kv for f in kv_fmts if f == "fp8"),
        guidance_bytes_per_element=0.5 if g.mode == "full" else 0.125,
        qat_input_width=max(widths, default=0) if qat else 0,
        qat_weight_params=fp4_weights,
    )


def table(m: ModelSpec, p: TrainerPlan, gpu: str | None = None) -> str:
    est = estimate(m, p, gpu)
    rows = [
        f"trainer memory per rank ({m.name}, TP{p.tp} PP{p.pp} CP{p.cp} EP{p.ep} DP{p.dp}, {p.dtype}, "
        f"recompute {p.recompute}, {p.tokens_per_microbatch} tokens/micro-batch):"
    ]
    for k in ("weights", "grads", "optimizer", "activations", "logits", "guidance", "total"):
        rows.append(f"  {k:<12} {est[k] / GIB:8.1f} GiB")
    if gpu is not None:
        verdict = "fits" if est["fits"] else f"does NOT fit: {advice(m, p, est)}"
        rows.append(
            f"  {GPUS[gpu].name} {GPUS[gpu].hbm_gb:.0f} GB x {USABLE:.0%} usable = "
            f"{est['capacity'] / GIB:.1f} GiB: {verdict}"
        )
    return "\n".join(rows)


# -- one process: the embedded engine beside the trainer (rank 0 of a CPU run) ---------------------
RUNTIME_GIB = 0.6  # torch, Megatron-Core, transformers and the tokenizer imported (perf/mem_runtime_gib: 0.6)
# bytes per weight element the embedded engine holds (sglang_backend/local/layers.py): the weight in
# the rollout dtype (an FP4 linear's dequantized) and its transposed copy for the C layers' GEMMs;
# an FP4 linear also its codes and scales, and, loaded from a BF16 checkpoint, the fp32 master its
# shards are written into, until the first weight sync brings ModelOpt FP4 tensors instead
ENGINE_FP4_CODES = {"nvfp4": 0.5 + 1 / 16, "mxfp4": 0.5 + 1 / 32}
ENGINE_FP4_MASTER = 4
# (key, what it is, the run's metric that measures it): the one-process table's rows
PROCESS_ROWS = (
    ("runtime", "runtime (libraries, tokenizer)", "perf/mem_runtime_gib"),
    ("trainer_build", "trainer: bf16 weights, fp32 grads, fp32 main params", "perf/mem_trainer_built_gib"),
    ("adam", "Adam m, v (measured: + slack; offloaded: file + kept)", None),
    ("engine_weights", "engine weights (+ transposed copies, FP4 codes)", "perf/mem_engine_weights_gib"),
    ("kv_pool", "engine KV pool", "perf/mem_engine_kv_gib"),
    ("guidance_store", "guidance store (the step's records)", "perf/mem_guidance_store_gib"),
    ("activations", "activations", None),
    ("logits", "logits chunks (+ a micro-batch's guidance)", None),
    ("train_transient", "forward/backward on top (activations + logits)", None),
    ("rollout_phase", "rollout phase peak", "perf/mem_rollout_peak_gib"),
    ("forward_backward_phase", "forward/backward peak", "perf/mem_forward_backward_peak_gib"),
    ("optimizer_phase", "optimizer step peak (Adam m, v or their window)", "perf/mem_optimizer_peak_gib"),
    ("train_phase", "train phase peak", "perf/mem_train_peak_gib"),
    ("sync_phase", "weight sync peak (the engine refilled)", "perf/mem_sync_peak_gib"),
    ("peak", "peak", None),
)


def engine_weight_bytes(m: ModelSpec, pol, dtype: str, masters: bool = False) -> float:
    """The embedded engine's weights as it runs them: every linear (per its policy format; with
    `masters`, as loaded from a BF16 checkpoint before the first sync), the embedding, the LM head
    (tied: the embedding itself) and the head's oneDNN-packed copy for batched decode."""
    b = DTYPE_BYTES[dtype]
    total = 0.0
    for name, _, n in _layer_linears(m):
        per = 2 * b
        if pol.weight_is_fp4(f"model.layers.{m.layers - 1}.{name}", m.layers):
            per += ENGINE_FP4_CODES[pol.format] + (ENGINE_FP4_MASTER if masters else 0)
        total += m.layers * n * per
    head = m.vocab * m.hidden
    return total + head * b * (2 if m.tied else 3)


def _layer_linears(m: ModelSpec, ep: int = 1) -> list[tuple[str, float, float]]:
    """(an HF linear of a layer, its input width per token, the parameters it stands for)."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    if m.moe:
        return [
            ("self_attn.q_proj", m.hidden, m.hidden * (q + 2 * kv)),
            ("self_attn.o_proj", m.o_width, m.o_width * m.hidden),
            ("mlp.experts.0.gate_proj", m.top_k * m.hidden, m.experts * 2 * m.hidden * m.moe_inter / ep),
            ("mlp.experts.0.down_proj", m.top_k * m.moe_inter, m.experts * m.hidden * m.moe_inter / ep),
        ]
    return [
        ("self_attn.q_proj", m.hidden, m.hidden * (q + 2 * kv)),
        ("self_attn.o_proj", m.o_width, m.o_width * m.hidden),
        ("mlp.gate_proj", m.hidden, 2 * m.hidden * m.ffn),
        ("mlp.down_proj", m.ffn, m.ffn * m.hidden),
    ]


def kv_pool_bytes(m: ModelSpec, pol, tokens: int, dtype: str) -> float:
    """The engine's paged KV pool of `tokens` slots, K and V in the policy's cache formats."""
    bits = 0.0
    for layer in range(m.layers):
        for side in ("k", "v"):
            fmt = pol.kv_format(layer, m.layers, side)
            bits += 8 * DTYPE_BYTES[dtype] if fmt == "bf16" else kv_side_bits(fmt, m.kv_heads * m.head_dim)
    return tokens * m.kv_heads * m.head_dim * bits / 8


def process_estimate(cfg, pol, m: ModelSpec, engine_sleeps: bool, step_tokens: float | None = None) -> dict:
    """Bytes of a one-process run (the embedded engine beside a one-rank trainer) by part, and its
    phases: the rollout (engine awake, the trainer's state resident, the step's guidance stored), the
    train phase's forward/backward (the engine asleep when `engine_sleeps`, activations and logits on
    top) and optimizer step (Adam's temporaries on top), and the weight sync. With
    trainer.optimizer_offload=disk Adam's m and v are never all resident: the optimizer step streams
    them through trainer.optimizer_offload_window_mb, beside the part trainer.optimizer_offload_keep_mb
    keeps.
    step_tokens: a step's prompt + response tokens (default: every sample at its longest)."""
    rc = cfg.rollout
    trainer_plan = plan_from_config(cfg, pol, m, 1)
    est = estimate(m, trainer_plan)
    if step_tokens is None:
        step_tokens = rc.prompts_per_step * rc.n_samples * (rc.max_prompt_len + rc.max_new_tokens)
    # the store holds the step's records (every position, every guided site) up to its budget
    store = min(guidance_bytes_per_token(m, trainer_plan) * step_tokens, cfg.guidance.memory_budget_mb * 2**20)
    main_params = est["optimizer"] * (1 / 3 if cfg.trainer.dtype == "bfloat16" else 0.0)  # 4 of its 12 B/param
    out = {
        "runtime": RUNTIME_GIB * GIB,
        "trainer_build": est["weights"] + est["grads"] + main_params,
        "adam": est["optimizer"] - main_params,
        # the embedded engine lives in this process; a server's memory is its own machine's
        "engine_weights": engine_weight_bytes(m, pol, rc.dtype) if rc.backend == "local" else 0.0,
        "kv_pool": kv_pool_bytes(m, pol, rc.max_total_tokens, rc.dtype) if rc.backend == "local" else 0.0,
        "guidance_store": store,
        "activations": est["activations"],
        "logits": est["logits"] + est["guidance"],  # the micro-batch's device copy of its guidance too
    }
    # the layers' saved activations, and on top the larger of the head (its logits and the micro-batch's
    # guidance) and a recomputed layer's backward: they come one after the other, and the CPU trainer
    # returns freed heap before each micro-batch's backward and before the embedding's (measured: an RSS
    # trace of the real step)
    saved = est["activations_saved"]
    out["train_transient"] = saved + max(out["activations"] - saved, out["logits"])
    offloaded = cfg.trainer.optimizer_offload == "disk"
    # + Adam's m, v where not offloaded, or the part trainer.optimizer_offload_keep_mb keeps (whole
    # parameters: at most that)
    kept = min(cfg.trainer.optimizer_offload_keep_mb * 2**20, out["adam"]) if offloaded else out["adam"]
    between_steps = out["runtime"] + out["trainer_build"] + store + kept
    engine = out["engine_weights"] + out["kv_pool"]
    # the first rollout: a BF16 checkpoint's masters, no Adam state yet (the first step makes it)
    masters = engine_weight_bytes(m, pol, rc.dtype, masters=True) - engine_weight_bytes(m, pol, rc.dtype)
    masters *= rc.backend == "local"
    out["rollout_phase"] = between_steps + engine + max(masters - kept, 0.0)
    asleep = 0 if engine_sleeps else engine
    out["forward_backward_phase"] = between_steps + out["train_transient"] + asleep
    # torch's single-tensor Adam (CPU): two fp32 temporaries of the largest parameter (the embedding);
    # offloaded, the step streams the moments through a window (one parameter's m and v at least)
    largest = m.vocab * m.hidden / max(cfg.trainer.tp, 1) * 4
    moments = 0.0
    if offloaded and kept < out["adam"]:
        moments = min(out["adam"] - kept, max(cfg.trainer.optimizer_offload_window_mb * 2**20, 2 * largest))
    out["optimizer_phase"] = between_steps + moments + 2 * largest + asleep
    out["train_phase"] = max(out["forward_backward_phase"], out["optimizer_phase"])
    # the sync: the engine refilled beside the trainer, one bucket in flight
    out["sync_phase"] = between_steps + engine + cfg.transfer.bucket_mb * 2**20
    out["peak"] = max(out["rollout_phase"], out["train_phase"], out["sync_phase"])
    return out


def _with(cfg, section: str, **values):
    return replace(cfg, **{section: replace(getattr(cfg, section), **values)})


def process_advice(cfg, pol, m: ModelSpec, engine_sleeps: bool, budget_bytes: float) -> str:
    """The first knob that alone brings the one-process peak under budget_bytes, in words (each is
    tried on the estimate: the cheapest in step time first)."""
    r, t, g = cfg.rollout, cfg.trainer, cfg.guidance
    tries = []
    if not engine_sleeps and r.backend == "local" and not cfg.algo.async_rollout:
        tries.append(("set rollout.colocated=on (the engine sleeps through the train phase)", cfg, True))
    if t.optimizer_offload == "none":  # a disk write and read of Adam's state a step
        tries.append(
            ("set trainer.optimizer_offload=disk", _with(cfg, "trainer", optimizer_offload="disk"), engine_sleeps)
        )
    if t.optimizer_offload == "disk" and t.optimizer_offload_keep_mb:  # disk traffic instead
        tries.append(
            (
                "set trainer.optimizer_offload_keep_mb=0",
                _with(cfg, "trainer", optimizer_offload_keep_mb=0.0),
                engine_sleeps,
            )
        )
    if t.logprob_keep_logits_mb:  # one GEMM of the head's four a micro-batch
        tries.append(
            (
                "set trainer.logprob_keep_logits_mb=0",
                _with(cfg, "trainer", logprob_keep_logits_mb=0.0),
                engine_sleeps,
            )
        )
    if t.recompute != "full":
        tries.append(("set trainer.recompute=full", _with(cfg, "trainer", recompute="full"), engine_sleeps))
    tokens = max(t.max_tokens_per_microbatch // 2, 1)
    # the KV pool is linear in its slots: the most a page-aligned pool may hold under the budget
    est = process_estimate(cfg, pol, m, engine_sleeps)
    awake = max(est["rollout_phase"], est["sync_phase"])  # the phases the pool is resident in
    without_pool = max(awake, est["train_phase"] + (est["kv_pool"] if engine_sleeps else 0)) - est["kv_pool"]
    per_slot = kv_pool_bytes(m, pol, 1, r.dtype) if r.backend == "local" else float("inf")
    pool = max(int((budget_bytes - without_pool) / per_slot) // 16 * 16, 16) if per_slot else r.max_total_tokens
    tries += [
        (
            f"lower trainer.max_tokens_per_microbatch (now {t.max_tokens_per_microbatch}) to {tokens}",
            _with(cfg, "trainer", max_tokens_per_microbatch=tokens),
            engine_sleeps,
        ),
        (
            f"lower trainer.logprob_chunk_mb (now {t.logprob_chunk_mb:g}) to {t.logprob_chunk_mb / 4:g}",
            _with(cfg, "trainer", logprob_chunk_mb=t.logprob_chunk_mb / 4),
            engine_sleeps,
        ),
        (
            f"lower rollout.max_total_tokens (now {r.max_total_tokens}) to {pool}",
            _with(cfg, "rollout", max_total_tokens=pool),
            engine_sleeps,
        ),
        (
            f"lower guidance.memory_budget_mb (now {g.memory_budget_mb:g}) to {g.memory_budget_mb / 4:g} "
            "(the rest spills to disk)",
            _with(cfg, "guidance", memory_budget_mb=g.memory_budget_mb / 4),
            engine_sleeps,
        ),
    ]
    for words, tried, sleeps in tries:
        if process_estimate(tried, pol, m, sleeps)["peak"] <= budget_bytes:
            return words
    return (
        "no single knob (rollout.colocated, trainer.optimizer_offload, trainer.recompute, the token budgets, "
        "guidance.memory_budget_mb) is enough: a smaller model, more trainer ranks, or a larger budget"
    )


def process_table(est: dict, measured: dict | None = None) -> str:
    """The one-process table, GiB: predicted, and beside it what a run measured (keyed like est)."""
    measured = measured or {}
    rows = [f"  {'part':<52} {'predicted':>9} {'measured':>9}"]
    for key, what, _ in PROCESS_ROWS:
        got = measured.get(key)
        cell = "" if got is None else f" {got / GIB:9.2f}"
        if got is not None and est[key]:
            cell += f"  {got / est[key] - 1:+.0%}"
        rows.append(f"  {what:<52} {est[key] / GIB:9.2f}{cell}")
    return "\n".join(rows)


def measured_parts(history: list[dict]) -> tuple[dict, float]:
    """(bytes by process_table key, the step's prompt + response tokens) from a run's metrics.jsonl
    rows: each per-step figure the median over the steps after the first (whose train phase also
    allocates Adam's state); the figures measured once from the first step."""
    first = next((h for h in history if "perf/mem_runtime_gib" in h), {})
    later = [h for h in history if "perf/mem_train_peak_gib" in h][1:] or [
        h for h in history if "perf/mem_train_peak_gib" in h
    ]

    def med(key: str, unit: float = GIB) -> float | None:
        vals = sorted(h[key] for h in later if key in h)
        return vals[len(vals) // 2] * unit if vals else None

    out = {
        key: first[metric] * GIB
        for key, _, metric in PROCESS_ROWS
        if metric in first and metric.startswith("perf/mem_")
    }
    for key, _, metric in PROCESS_ROWS:
        if metric and med(metric) is not None and key not in ("runtime", "trainer_build"):
            out[key] = med(metric)
    before = med("perf/mem_before_train_gib")
    fwd_bwd = out.get("forward_backward_phase", out.get("train_phase"))
    if before is not None and fwd_bwd is not None:
        out["train_transient"] = fwd_bwd - before
        offloaded = med("perf/optimizer_offload_gib")
        if offloaded is not None:  # the moments were on disk: the file holds what they took, beside the kept
            out["adam"] = offloaded + (med("perf/optimizer_offload_kept_gib") or 0.0)
        elif "runtime" in out and "trainer_build" in out:  # the engine is released by then (colocated)
            out["adam"] = before - out["runtime"] - out["trainer_build"] - out.get("guidance_store", 0.0)
    if "rollout_phase" in out and "train_phase" in out:
        out["peak"] = max(out["rollout_phase"], out["train_phase"], out.get("sync_phase", 0.0))
    return out, med("perf/step_tokens", 1.0) or 0.0


def check_budget(cfg, pol, m: ModelSpec, engine_sleeps: bool) -> None:
    """Refuse a one-process plan whose predicted peak exceeds trainer.memory_budget_gib (0: no
    budget), before any model is built, naming the knob that cuts its largest part."""
    budget = cfg.trainer.memory_budget_gib
    if not budget:
        return
    est = process_estimate(cfg, pol, m, engine_sleeps)
    if est["peak"] > budget * GIB:
        raise ValueError(
            f"predicted peak {est['peak'] / GIB:.1f} GiB exceeds trainer.memory_budget_gib={budget:g} "
            f"({m.name}; every sample at its longest):\n{process_table(est)}\n  "
            f"{process_advice(cfg, pol, m, engine_sleeps, budget * GIB)}"
        )


def here_capacity(ranks_here: int) -> tuple[float, str]:
    """(bytes one trainer rank may use on this machine, what that is): the CUDA device's memory,
    or the host's available memory shared by the ranks on it."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.total_memory * USABLE, f"{props.name} {props.total_memory / GIB:.0f} GiB x {USABLE:.0%}"
    avail = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    return avail / ranks_here, f"{avail / GIB:.1f} GiB available on this host / {ranks_here} ranks"


def check_here(cfg, policy, model_path: str, world: int, ranks_here: int) -> None:
    """Refuse (ValueError with the table and the knob to turn) a trainer plan whose estimate does
    not fit this machine; `trainer.memory_check=false` skips it."""
    m, _ = model_spec(model_path)
    t = cfg.trainer
    p = plan_from_config(cfg, policy, m, max(world // (t.tp * t.pp * t.cp), 1))
    est = estimate(m, p)
    cap, what = here_capacity(ranks_here)
    if est["total"] > cap:
        raise ValueError(
            f"{table(m, p)}\n  this machine: {what} = {cap / GIB:.1f} GiB per rank: does NOT fit; "
            f"{advice(m, p, est)} (or trainer.memory_check=false to run anyway)"
        )


def check_launch(cfg, policy, model_path: str) -> None:
    """`check_here` for this torchrun launch (its world and the ranks on this host)."""
    import torch.distributed as dist

    from megatron_trace.config import LaunchEnv

    here = LaunchEnv.from_env()
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_here(cfg, policy, model_path, world, here.local_world_size if here else 1)


def hf_config_of(m: ModelSpec) -> dict:
    """The HF config a ModelSpec stands for (a built-in shape without its checkpoint here): what the
    policy is resolved against, as a run resolves it against the checkpoint's config.json."""
    family = "qwen3_moe" if m.moe else ("qwen3" if m.qk_norm else "qwen2")
    cfg = {
        "model_type": family,
        "vocab_size": m.vocab,
        "hidden_size": m.hidden,
        "intermediate_size": m.ffn or m.moe_inter,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "tie_word_embeddings": m.tied,
        "attention_bias": m.qkv_bias,
        "rope_theta": 1_000_000.0,  # Qwen2.5's and Qwen3's; no quantization default reads it
    }
    if m.moe:
        cfg.update(num_experts=m.experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.moe_inter)
    return cfg


def shape_and_arch(cfg) -> tuple[ModelSpec | None, str, ModelArch | None]:
    """(the model's shape, where it came from, its arch) for a run config (config.Config) on this
    machine: the checkpoint's config.json where it is here, else the built-in shape its name
    spells, else the tiny model's. What a launcher or this command resolves the policy against
    before any checkpoint is loaded (a run resolves against the checkpoint it loads)."""
    from megatron_trace.models import ModelArch, tiny_hf_config

    tiny = tiny_hf_config(cfg.model.family, **cfg.model.tiny)
    m, source = model_spec(cfg.model.path, tiny)
    if m is None:
        return None, source, None
    if not cfg.model.path:
        return m, source, ModelArch.from_hf_config(tiny)
    if Path(cfg.model.path, "config.json").exists():
        return m, source, ModelArch.from_hf_config(Path(cfg.model.path))
    return m, source, ModelArch.from_hf_config(hf_config_of(m))


def sglang_rank_bytes(m: ModelSpec, arch: ModelArch, pol, sglang_tp: int) -> dict[str, float]:
    """One SGLang rank of a `pol` rollout at TP `sglang_tp`: the weights a sync loads into it (the
    transfer's own manifest of ModelOpt FP4 codes and scales, BF16 elsewhere) split over its TP, and
    its KV bytes per cached token in the policy's cache formats (heads split over TP)."""
    import torch

    from megatron_trace.transfer.quantize import manifest

    plan = manifest(arch.hf_param_shapes().items(), arch, pol, model_dtype=torch.bfloat16)
    weights = sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() for _, dt, shape in plan)
    return {"weights": weights / sglang_tp, "kv_per_token": kv_pool_bytes(m, pol, 1, "bfloat16") / sglang_tp}


def colocation_line(m: ModelSpec, arch: ModelArch, pol, sglang_tp: int, est: dict) -> str:
    """What sleeping SGLang through the train phase would give one GPU that also holds a trainer rank
    (est: that rank's `estimate`). An estimate: no GPU run has measured it."""
    r = sglang_rank_bytes(m, arch, pol, sglang_tp)
    line = (
        f"colocated (rollout.colocated=on, SGLang --enable-memory-saver; estimated, not measured on a GPU): "
        f"an SGLang TP{sglang_tp} rank holds {r['weights'] / GIB:.1f} GiB of weights and "
        f"{r['kv_per_token'] / 1024:.1f} KiB of KV per cached token"
    )
    if "capacity" not in est:
        return line
    state = est["weights"] + est["grads"] + est["optimizer"]
    free = est["capacity"] - state - r["weights"]
    if free <= 0:
        return line + f"; beside this trainer rank's {state / GIB:.1f} GiB of state it does not fit"
    return line + (
        f"; beside this trainer rank's {state / GIB:.1f} GiB of state, a {free / GIB:.1f} GiB KV pool "
        f"({free / r['kv_per_token'] / 1e6:.1f} M tokens) while it rolls out, and asleep it gives back "
        f"{(r['weights'] + free) / GIB:.1f} GiB to the train phase's activations and logits"
    )


def main(argv=None) -> int:
    """python -m megatron_trace.perf.memory --config FILE [--dp N] [--answers 4096,16384] [key=value ...]"""
    import argparse

    from megatron_trace.config import Config

    ap = argparse.ArgumentParser(description="trainer memory per rank for a run config")
    ap.add_argument("--config", required=True)
    ap.add_argument("--dp", type=int, default=1, help="data-parallel ranks of the trainer")
    ap.add_argument(
        "--answers",
        default="",
        help="comma-separated answer lengths: also the plan at micro-batches of one such sample",
    )
    ap.add_argument(
        "--measured",
        default="",
        help="a run directory: the one-process table (embedded engine + trainer) predicted at its steps' "
        "token counts beside what its metrics.jsonl measured",
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    cfg = Config.load(args.config, args.overrides)
    m, source, arch = shape_and_arch(cfg)
    if m is None:
        print(f"trainer memory: unknown model shape ({source}): no estimate", flush=True)
        return 2
    policy = cfg.quant.resolve(arch)  # this command's one resolution, as a run makes its own
    if cfg.rollout.backend == "local" and cfg.trainer.tp * cfg.trainer.pp * cfg.trainer.cp == 1:
        from megatron_trace.run.rollout import engine_sleeps

        sleeps = engine_sleeps(cfg)
        measured, tokens = {}, None
        if args.measured:
            rows = [json.loads(line) for line in Path(args.measured, "metrics.jsonl").read_text().splitlines()]
            measured, tokens = measured_parts(rows)
        est = process_estimate(cfg, policy, m, sleeps, step_tokens=tokens or None)
        at = f"{tokens:.0f} tokens a step (the run's median)" if tokens else "every sample at its longest"
        print(f"one process, engine {'asleep' if sleeps else 'awake'} in the train phase, {at}:")
        print(process_table(est, measured))
    gpu = cfg.cluster.gpu or None
    p = plan_from_config(cfg, policy, m, args.dp)
    print(f"model shape: {source}")
    print(table(m, p, gpu))
    if cfg.rollout.backend == "http":
        print(colocation_line(m, arch, policy, cfg.cluster.sglang_tp, estimate(m, p, gpu)))
    for n in [int(x) for x in args.answers.split(",") if x]:
        longest = cfg.rollout.max_prompt_len + n  # a micro-batch of one longest sample
        e = estimate(m, replace(p, tokens_per_microbatch=longest), gpu)
        verdict = "" if gpu is None else (" fits" if e["fits"] else " does NOT fit")
        print(f"  {n}-token answers, {longest}-token micro-batches: {e['total'] / GIB:.1f} GiB per rank{verdict}")
    return 0 if gpu is None or estimate(m, p, gpu)["fits"] else 2


if __name__ == "__main__":
    raise SystemExit(main())
