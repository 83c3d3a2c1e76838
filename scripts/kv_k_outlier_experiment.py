"""Issue 18 item 4, an experiment: per-channel schemes for NVFP4 K on the real Qwen2.5, in HF fake-quant.

    .venv/bin/python scripts/kv_k_outlier_experiment.py bf16 nvfp4 keep:2 keep:4 smooth:1 [nvfp4+ ...]

After scripts/quality_real_model.py (the checkpoint and the BF16 continuations). Each argument is a
K scheme (a trailing "+" also quantizes V to NVFP4): nvfp4 plain; keep:N keeps the N largest-amax
channels of each KV head (closed under rotary pairs) in BF16; smooth:T divides K by a power of two
per rotary pair (>= 1, amax over T x the head's median pair amax) before NVFP4 and multiplies back,
which is exact if applied to Q instead. Channel amax is calibrated on the prompts alone. Prints
NLL/token on the BF16 continuations. Measured 2026-12-01 (docs/quality.md): bf16 0.1954, keep:2
0.3019, keep:4 0.2957, smooth:1 0.2955 (plain NVFP4 K 0.4570; the bias residual, the scheme the
engine has as quant.kv_k_debias, 0.2050).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
from transformers import AttentionInterface, AutoModelForCausalLM  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from megatron_trace import quality  # noqa: E402
from megatron_trace.fp4 import nvfp4  # noqa: E402

torch.set_num_threads(2)
ck = str(Path.home() / ".cache" / "megatron_trace" / "qwen2.5-coder-0.5b" / "hf_bf16")
res = Path(__file__).resolve().parents[1] / "results" / "quality_real_model"
rep = json.loads((res / "quality.json").read_text())
prompts = quality.load_prompts(res / "prompts.jsonl", ck)
ref = rep["settings"]["bf16:bf16:bf16"]["outputs"]


def nv(t):
    return nvfp4.dequantize(nvfp4.quantize(t.float(), global_scale=torch.tensor(1.0)), t.dtype)


MODE = {"k": None}
AMAX = {}  # layer -> [Hkv, D] running amax


def attn(module, q, k, v, mask, **kw):
    m, li = MODE["k"], module.layer_idx
    if m == "calib":
        a = k.detach().abs().amax(dim=(0, 2))
        AMAX[li] = torch.maximum(AMAX.get(li, a), a)
    elif m == "nvfp4":
        k = nv(k)
    elif m and m.startswith("smooth"):
        a = AMAX[li]
        d = a.shape[-1]
        pair = torch.maximum(a[:, : d // 2], a[:, d // 2 :])
        pair = torch.cat([pair, pair], -1)
        target = pair.median(dim=-1, keepdim=True).values * float(m.split(":")[1])
        s = torch.exp2(torch.ceil(torch.log2((pair / target).clamp(min=1.0))))  # powers of two >= 1
        s = s.view(1, -1, 1, d)
        k = nv(k / s) * s
    elif m and m.startswith("keep"):
        n, a = int(m.split(":")[1]), AMAX[li]
        d = a.shape[-1]
        pair = torch.maximum(a[:, : d // 2], a[:, d // 2 :])
        idx = pair.topk(n // 2, dim=-1).indices  # pairs kept
        keep = torch.zeros_like(a, dtype=torch.bool)
        keep.scatter_(1, idx, True)
        keep.scatter_(1, idx + d // 2, True)
        keep = keep.view(1, -1, 1, d)
        kq = nv(torch.where(keep, torch.zeros_like(k), k))
        k = torch.where(keep, k.to(torch.bfloat16).to(k.dtype), kq)
    if MODE.get("v"):
        v = nv(v)
    return sdpa_attention_forward(module, q, k, v, mask, **kw)


AttentionInterface.register("fq", attn)
model = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32, attn_implementation="fq").eval()


def nll():
    tot, n = 0.0, 0
    for p, c in zip(prompts, ref):
        ids = torch.tensor([p["ids"] + c])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
        rows = torch.arange(len(p["ids"]) - 1, ids.shape[1] - 1)
        tot += (-lp[rows, torch.tensor(c)]).sum().item()
        n += len(c)
    return tot / n


# calibrate on the prompts alone (no continuations): the amax a rollout would see at prefill
MODE["k"] = "calib"
for p in prompts:
    with torch.no_grad():
        model(torch.tensor([p["ids"]]))
for m in sys.argv[1:]:
    k, _, v = m.partition("+")
    MODE["k"], MODE["v"] = (None if k == "bf16" else k), bool(v)
    print(f"{m}: {nll():.4f}", flush=True)
