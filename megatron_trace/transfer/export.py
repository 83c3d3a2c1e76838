"""Write a rollout-ready HF checkpoint: ModelOpt NVFP4 (what stock SGLang/vLLM load) or unquantized.

    python -m megatron_trace.export --load CKPT --out DIR --format nvfp4|bf16 \
        [--quant-targets '*.mlp.*' ...] [--dtype auto|bfloat16|float32] [--max-shard-mb 4096] \
        [--input-amax amax.json] [--hf-config DIR]

`--load` is an HF checkpoint directory (config.json + *.safetensors), or an `Actor` checkpoint
root (`root/latest` -> `root/step_N/rank_00000.pt` + meta.json) saved by a SINGLE-rank run; its
config comes from `--hf-config` (or a config.json in the root). Checkpoints saved by a TP/PP run
hold one shard per rank and must be loaded by the same world (`Actor.load_checkpoint`), then
exported from there (`transfer.pipeline.push_weights` with a DiskTransport, or
`gpt.export_hf_state_dict`); this CLI refuses them with that advice.

Output: config.json (with `quantization_config` for nvfp4: quant_method modelopt, quant_algo
NVFP4, group_size 16, exclude_modules = every high-precision linear incl. lm_head), and
hf_quant_config.json (ModelOpt's file, plus `trace_targets`, the policy's targets, which our
engine reads back), safetensors shards (<= --max-shard-mb each, with model.safetensors.index.json
when more than one), and the tokenizer files when the source has them. The quantization is
`transfer.quantize`, the same code the live transfer uses, so an exported checkpoint and a live
update hold the same bits. `--dtype auto` keeps the source dtype for high-precision tensors.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from ..models import ModelArch, QuantPolicy, megatron_to_hf
from .pipeline import hf_state_dict_stream
from .quantize import rollout_tensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "generation_config.json", "tokenizer.model")
_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def load_hf_dir(path: str | Path) -> tuple[ModelArch, dict[str, torch.Tensor], dict]:
    """(arch, state dict, raw config) of an HF checkpoint directory."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    if any(t.dtype == torch.uint8 for t in sd.values()):
        raise ValueError(f"{path} is already quantized (uint8 weights); export from a high-precision checkpoint")
    from ..models import unfuse_hf_experts

    return ModelArch.from_hf_config(cfg), unfuse_hf_experts(sd), cfg


def load_megatron_checkpoint(root: str | Path, hf_config: str | Path | None = None
                             ) -> tuple[ModelArch, dict[str, torch.Tensor], dict]:
    """An `Actor` checkpoint of a single-rank run -> (arch, HF state dict, config)."""
    root = Path(root)
    ckpt = root / (root / "latest").read_text().strip()
    meta = json.loads((ckpt / "meta.json").read_text())
    if meta.get("world_size", 1) != 1:
        raise ValueError(
            f"{ckpt} was saved by {meta['world_size']} ranks; each holds its own TP/PP shard, so it must be "
            "loaded by the same world (Actor.load_checkpoint) and exported from there (push_weights with a "
            "DiskTransport, or gpt.export_hf_state_dict). This CLI reads single-rank checkpoints only.")
    cfg_path = Path(hf_config) if hf_config else root
    cfg_file = cfg_path / "config.json" if cfg_path.is_dir() else cfg_path
    if not cfg_file.exists():
        raise FileNotFoundError(f"a Megatron checkpoint needs its HF config: pass --hf-config (tried {cfg_file})")
    cfg = json.loads(cfg_file.read_text())
    try:
        state = torch.load(ckpt / "rank_00000.pt", map_location="cpu", weights_only=True)
    except Exception:  # optimizer state may hold plain Python objects; this is our own local file
        state = torch.load(ckpt / "rank_00000.pt", map_location="cpu", weights_only=False)
    te = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
          "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
    sd = {}
    for k, v in state["model"].items():
        if k.endswith("_extra_state"):
            continue
        for te_name, local in te.items():  # TE-spec runs fuse the norms into the next linear
            if k.endswith("." + te_name):
                k = k[: -len(te_name)] + local
        sd[k] = v
    arch = ModelArch.from_hf_config(cfg)
    return arch, megatron_to_hf({(0, 0, 0): sd}, arch), cfg


def quant_configs(arch: ModelArch, policy: QuantPolicy) -> tuple[dict, dict]:
    """(config.json's quantization_config, hf_quant_config.json) for an NVFP4 export."""
    fp4 = set(policy.quantized_linears(arch))
    exclude = [m for m in arch.hf_linear_modules() if m not in fp4]
    if "lm_head" not in exclude and arch.tie_word_embeddings:
        exclude.append("lm_head")  # tied: no lm_head tensor, but the module stays high precision
    banded = policy.bf16_layers_start or policy.bf16_layers_end
    # With BF16 layer bands, list the FP4 modules themselves so the reader needs no band logic.
    targets = sorted(fp4) if banded else list(policy.targets)
    qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": exclude,
          "kv_cache_quant_algo": None}
    hq = {"producer": {"name": "megatron_trace", "version": "0.1"},
          "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": exclude,
                           "kv_cache_quant_algo": None, "trace_targets": targets,
                           "activation_scale": policy.activation_scale}}
    return qc, hq


def export_checkpoint(hf_sd: Mapping[str, torch.Tensor], arch: ModelArch, out: str | Path, *,
                      fmt: str = "nvfp4", policy: QuantPolicy | None = None, dtype: torch.dtype | None = None,
                      max_shard_mb: float = 4096.0, input_amax: Mapping[str, float] | None = None,
                      hf_config: dict | None = None, tokenizer_from: str | Path | None = None) -> Path:
    """Write the checkpoint directory `out` (replaced if it exists); returns it."""
    from safetensors.torch import save_file

    if fmt not in ("nvfp4", "bf16"):
        raise ValueError(f"format must be nvfp4 or bf16; got {fmt!r}")
    policy = policy or QuantPolicy()
    if fmt == "bf16":
        policy = QuantPolicy(format="bf16", weights="bf16", activations="bf16")
    elif policy.format != "nvfp4" or not policy.enabled:
        raise ValueError(f"--format nvfp4 needs an nvfp4 policy with FP4 weights; got {policy.to_dict()}")
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    limit = int(max_shard_mb * (1 << 20))
    shards: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush():
        nonlocal current, size
        save_file(current, str(tmp / f"part-{len(shards):05d}.safetensors"))
        shards.append(list(current))
        current, size = {}, 0

    units = rollout_tensors(hf_state_dict_stream(hf_sd, arch), arch, policy, input_amax=input_amax, dtype=dtype)
    for unit in units:  # a unit (fused group / module) never straddles two shards
        n = sum(t.numel() * t.element_size() for _, t in unit)
        if current and size + n > limit:
            flush()
        current.update({k: v.contiguous() for k, v in unit})
        size, total = size + n, total + n
    if current:
        flush()
    if len(shards) == 1:
        (tmp / "part-00000.safetensors").rename(tmp / "model.safetensors")
    else:
        weight_map = {}
        for i, names in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            (tmp / f"part-{i:05d}.safetensors").rename(tmp / fname)
            weight_map.update({n: fname for n in names})
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    cfg = dict(hf_config or arch.to_hf_config())
    cfg.pop("quantization_config", None)
    if dtype is not None:
        cfg["dtype"] = cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    if fmt == "nvfp4":
        qc, hq = quant_configs(arch, policy)
        cfg["quantization_config"] = qc
        (tmp / "hf_quant_config.json").write_text(json.dumps(hq, indent=2))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).exists():
                shutil.copy2(Path(tokenizer_from) / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_trace.export", description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="HF checkpoint dir, or a single-rank Actor checkpoint root")
    p.add_argument("--out", required=True)
    p.add_argument("--format", choices=["nvfp4", "bf16"], default="nvfp4")
    p.add_argument("--quant-targets", nargs="+", default=None, help="fnmatch patterns over HF module names")
    p.add_argument("--bf16-layers-start", type=int, default=0)
    p.add_argument("--bf16-layers-end", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="auto")
    p.add_argument("--max-shard-mb", type=float, default=4096.0)
    p.add_argument("--input-amax", default=None, help="JSON {module: amax}: static activation scales")
    p.add_argument("--hf-config", default=None, help="config.json (or its dir) for a Megatron checkpoint")
    args = p.parse_args(argv)
    src = Path(args.load)
    try:
        if (src / "latest").exists():
            arch, sd, cfg = load_megatron_checkpoint(src, args.hf_config)
            tok = Path(args.hf_config) if args.hf_config and Path(args.hf_config).is_dir() else src
        else:
            arch, sd, cfg = load_hf_dir(src)
            tok = src
        amax = json.loads(Path(args.input_amax).read_text()) if args.input_amax else None
        kw = dict(bf16_layers_start=args.bf16_layers_start, bf16_layers_end=args.bf16_layers_end,
                  activation_scale="static" if amax else "per_token")
        if args.quant_targets:
            kw["targets"] = tuple(args.quant_targets)
        policy = QuantPolicy(**kw)
        out = export_checkpoint(sd, arch, args.out, fmt=args.format, policy=policy, dtype=_DTYPES[args.dtype],
                                max_shard_mb=args.max_shard_mb, input_amax=amax, hf_config=cfg, tokenizer_from=tok)
    except (ValueError, KeyError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({args.format})")
    return 0
