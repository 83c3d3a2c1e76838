"""Issue 18 item 4, an experiment (not a feature): NVFP4 K with K's bias taken out before quantizing.

    .venv/bin/python scripts/kv_bias_residual_experiment.py     (after scripts/quality_real_model.py)

Qwen2.5's K outliers come from k_proj's bias: a per-layer constant vector b that RoPE rotates with
the position. Quantizing K - RoPE(b) to NVFP4 and adding RoPE(b) back exactly (both sides can
compute it from the position; attention could add q . RoPE_j(b) per key instead) keeps 4.5 bits
per K element. HF fake-quantization (fp32) on the quality probe's 12 prompts and the BF16 model's
continuations (results/quality_real_model/quality.json), 2026-12-01: BF16 0.1954, NVFP4 K 0.4570,
NVFP4 K bias-residual 0.2050 (+0.0096), + NVFP4 V 0.2031 (+0.0077). Not in the engine, trainer or
plugin: docs/quality.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import json

import torch
import transformers.models.qwen2.modeling_qwen2 as mq
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from megatron_trace import quality
from megatron_trace.fp4 import nvfp4

ck = str(Path.home() / ".cache" / "megatron_trace" / "qwen2.5-coder-0.5b" / "hf_bf16")
res = Path(__file__).resolve().parents[1] / "results" / "quality_real_model"
rep = json.loads((res / "quality.json").read_text())
prompts = quality.load_prompts(res / "prompts.jsonl", ck)
ref = rep["settings"]["bf16:bf16:bf16"]["outputs"]
ROT = {}
orig = mq.apply_rotary_pos_emb


def cap(q, k, cos, sin, *a, **kw):
    ROT["cos"], ROT["sin"] = cos, sin
    return orig(q, k, cos, sin, *a, **kw)


mq.apply_rotary_pos_emb = cap
MODE = {"k": None}


def nv(t):
    return nvfp4.dequantize(nvfp4.quantize(t.float(), global_scale=torch.tensor(1.0)), t.dtype)


def attn(module, q, k, v, mask, **kw):
    m = MODE["k"]
    if m == "nvfp4":
        k = nv(k)
    elif m == "nvfp4_biasres":  # quantize K - RoPE(bias) in NVFP4, add RoPE(bias) back exactly
        b = module.k_proj.bias.view(1, -1, 1, k.shape[-1]).to(k.dtype)  # [1, Hkv, 1, D]
        cos, sin = ROT["cos"].unsqueeze(1), ROT["sin"].unsqueeze(1)
        rb = b * cos + mq.rotate_half(b) * sin
        k = nv(k - rb) + rb
    if MODE.get("v"):
        v = nv(v)
    return sdpa_attention_forward(module, q, k, v, mask, **kw)


AttentionInterface.register("fq", attn)
model = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32, attn_implementation="fq").eval()
for m, v in ((None, False), ("nvfp4", False), ("nvfp4_biasres", False), ("nvfp4_biasres", True)):
    MODE["k"], MODE["v"] = m, v
    tot, n = 0.0, 0
    for p, c in zip(prompts, ref):
        ids = torch.tensor([p["ids"] + c])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
        rows = torch.arange(len(p["ids"]) - 1, ids.shape[1] - 1)
        tot += (-lp[rows, torch.tensor(c)]).sum().item()
        n += len(c)
    print(f"K {m or 'bf16'} V {'nvfp4' if v else 'bf16'}: NLL/token {tot / n:.4f} over {n} tokens", flush=True)
