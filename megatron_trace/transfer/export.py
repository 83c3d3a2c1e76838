"""Write a rollout-ready HF checkpoint: ModelOpt NVFP4 (what stock SGLang/vLLM load) or unquantized.

    python -m megatron_trace.transfer.export --load CKPT --out DIR --format nvfp4|bf16 \
        [--quant-targets '*.mlp.*' ...] [--dtype auto|bfloat16|float32] [--max-shard-mb 4096] \
        (--calib-prompts prompts.jsonl | --input-amax amax.json) [--hf-config DIR]

An NVFP4 export is W4A4 and carries static `input_scale`s (stock engines quantize activations with
them): from a calibration pass over `--calib-prompts` (transfer/static_scales.py) or a measured
`--input-amax` table. Without either it refuses.

`--load` is an HF checkpoint directory (config.json + *.safetensors), or an `Actor` checkpoint
root (`root/latest` -> `root/step_N/rank_00000.pt` + meta.json) saved by a SINGLE-rank run; its
config comes from `--hf-config` (or a config.json in the root). Checkpoints saved by a TP/PP run
hold one shard per rank and must be loaded by the same world (`Actor.load_checkpoint`), then
exported from there (`transfer.pipeline.push_weights` with a DiskTransport, or
`gpt.export_hf_state_dict`); this CLI refuses them with that advice.

Output: config.json (with `quantization_config` for nvfp4: quant_method modelopt, quant_algo
NVFP4, group_size 16 in config_groups, ignore = every high-precision linear incl. lm_head), and
hf_quant_config.json in the forms ModelOpt 0.47 writes (see `quant_configs`; plus `trace_targets`,
the policy's targets, which our engine reads back), safetensors shards (<= --max-shard-mb each,
with model.safetensors.index.json when more than one), and the tokenizer files (chat template
included) when the source has them. The quantization is
`transfer.quantize`, the same code the live transfer uses, so an exported checkpoint and a live
update hold the same bits. `--dtype auto` keeps the source dtype for high-precision tensors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from ..models import ModelArch, QuantPolicy, megatron_to_hf
from .pipeline import hf_state_dict_stream
from .quantize import rollout_tensors

# The tokenizer and its chat template (transformers 5 writes chat_template.jinja; older ones keep it in
# tokenizer_config.json; processors use chat_template.json).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
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


def load_megatron_checkpoint(
    root: str | Path, hf_config: str | Path | None = None
) -> tuple[ModelArch, dict[str, torch.Tensor], dict]:
    """An `Actor` checkpoint of a single-rank run -> (arch, HF state dict, config)."""
    root = Path(root)
    ckpt = root / (root / "latest").read_text().strip()
    meta = json.loads((ckpt / "meta.json").read_text())
    if meta.get("world_size", 1) != 1:
        raise ValueError(
            f"{ckpt} was saved by {meta['world_size']} ranks; each holds its own TP/PP shard, so it must be "
            "loaded by the same world (Actor.load_checkpoint) and exported from there (push_weights with a "
            "DiskTransport, or gpt.export_hf_state_dict). This CLI reads single-rank checkpoints only."
        )
    cfg_path = Path(hf_config) if hf_config else root
    cfg_file = cfg_path / "config.json" if cfg_path.is_dir() else cfg_path
    if not cfg_file.exists():
        raise FileNotFoundError(f"a Megatron checkpoint needs its HF config: pass --hf-config (tried {cfg_file})")
    cfg = json.loads(cfg_file.read_text())
    try:
        state = torch.load(ckpt / "rank_00000.pt", map_location="cpu", weights_only=True)
    except Exception:  # optimizer state may hold plain Python objects; this is our own local file
        state = torch.load(ckpt / "rank_00000.pt", map_location="cpu", weights_only=False)
    te = {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    }
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


CALIBRATION_NEEDED = (
    "a W4A4 NVFP4 export must carry calibrated activation scales (input_scale), which stock SGLang/vLLM "
    "quantize activations with: pass --calib-prompts PROMPTS.jsonl (a calibration pass over prompts) or "
    "--input-amax AMAX.json ({module: amax}); export_checkpoint(input_amax=calibrate_input_amax(...))"
)
MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.47.0"}  # the format we write; loaders check the name
EXPORTER = {"name": "megatron_trace", "version": "0.1"}


def quant_configs(arch: ModelArch, policy: QuantPolicy, *, kv_cache_quant_algo: str | None = None) -> tuple[dict, dict]:
    """(config.json's quantization_config, hf_quant_config.json) in the forms ModelOpt 0.47 writes.

    hf_quant_config.json: {"producer", "quantization": {quant_algo, kv_cache_quant_algo, group_size,
    exclude_modules}} (+ our `trace_targets` / `activation_scale`, which our engine reads back, and
    `exporter`). config.json: ModelOpt's `convert_hf_quant_config_format` of it: {config_groups,
    ignore, quant_algo, [kv_cache_scheme,] producer, quant_method: "modelopt"}. SGLang and vLLM read
    the excluded modules from `ignore` there (and `exclude_modules` in hf_quant_config.json); the
    list holds every high-precision linear by its HF name (fused q/k/v, gate/up shards are listed
    one by one: both loaders expand a fused layer into its shards), plus lm_head.
    """
    fp4 = set(policy.quantized_linears(arch))
    exclude = [m for m in arch.hf_linear_modules() if m not in fp4]
    if "lm_head" not in exclude and arch.tie_word_embeddings:
        exclude.append("lm_head")  # tied: no lm_head tensor, but the module stays high precision
    banded = policy.bf16_layers_start or policy.bf16_layers_end
    # With BF16 layer bands, list the FP4 modules themselves so the reader needs no band logic.
    targets = sorted(fp4) if banded else list(policy.targets)
    w4a4 = policy.activations == "fp4"
    algo = "NVFP4" if w4a4 else "W4A16_NVFP4"
    hq = {
        "producer": dict(MODELOPT_PRODUCER),
        "exporter": dict(EXPORTER),
        "quantization": {
            "quant_algo": algo,
            "kv_cache_quant_algo": kv_cache_quant_algo,
            "group_size": 16,
            "exclude_modules": exclude,
            "trace_targets": targets,
            "activation_scale": policy.activation_scale,
        },
    }
    fmt = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    group = {"input_activations": dict(fmt), "weights": dict(fmt)} if w4a4 else {"weights": dict(fmt)}
    qc = {"config_groups": {"group_0": {**group, "targets": ["Linear"]}}, "ignore": list(exclude), "quant_algo": algo}
    if kv_cache_quant_algo:
        qc["kv_cache_scheme"] = (
            {"dynamic": False, "num_bits": 8, "type": "float"} if kv_cache_quant_algo == "FP8" else kv_cache_quant_algo
        )
    qc["producer"] = dict(MODELOPT_PRODUCER)
    qc["quant_method"] = "modelopt"
    return qc, hq


def export_checkpoint(
    hf_sd: Mapping[str, torch.Tensor],
    arch: ModelArch,
    out: str | Path,
    *,
    fmt: str = "nvfp4",
    policy: QuantPolicy | None = None,
    dtype: torch.dtype | None = None,
    max_shard_mb: float = 4096.0,
    input_amax: Mapping[str, float] | None = None,
    hf_config: dict | None = None,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Write the checkpoint directory `out` (replaced if it exists); returns it."""
    from safetensors.torch import save_file

    if fmt not in ("nvfp4", "bf16"):
        raise ValueError(f"format must be nvfp4 or bf16; got {fmt!r}")
    policy = policy or QuantPolicy(kv="bf16")  # an export names a KV format only when its policy does
    if fmt == "bf16":
        policy = QuantPolicy(format="bf16", weights="bf16", activations="bf16", kv="bf16")
    elif policy.format != "nvfp4" or not policy.enabled:
        raise ValueError(f"--format nvfp4 needs an nvfp4 policy with FP4 weights; got {policy.to_dict()}")
    elif policy.activations != "fp4":
        raise ValueError(
            "W4A16 NVFP4 exports are not supported (the engines here would serve them W4A4); "
            "export W4A4 with calibrated activation scales"
        )
    elif input_amax is None:
        raise ValueError(CALIBRATION_NEEDED)
    else:  # stock engines quantize activations with the checkpoint's static input_scale
        policy = dataclasses.replace(policy, activation_scale="static")
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
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    cfg = dict(hf_config or arch.to_hf_config())
    cfg.pop("quantization_config", None)
    if dtype is not None:
        cfg["dtype"] = cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    if fmt == "nvfp4":
        policy.check_resolved(arch)
        qc, hq = quant_configs(arch, policy, kv_cache_quant_algo=policy.kv_cache_quant_algo())
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
    p = argparse.ArgumentParser(prog="python -m megatron_trace.transfer.export", description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="HF checkpoint dir, or a single-rank Actor checkpoint root")
    p.add_argument("--out", required=True)
    p.add_argument("--format", choices=["nvfp4", "bf16"], default="nvfp4")
    p.add_argument("--quant-targets", nargs="+", default=None, help="fnmatch patterns over HF module names")
    p.add_argument("--bf16-layers-start", type=int, default=0)
    p.add_argument("--bf16-layers-end", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="auto")
    p.add_argument("--max-shard-mb", type=float, default=4096.0)
    p.add_argument(
        "--calib-prompts",
        default=None,
        help="JSON lines of prompts (token ids, text or chat messages) for the activation-scale "
        "calibration pass that a W4A4 export needs",
    )
    p.add_argument("--input-amax", default=None, help="JSON {module: amax}: measured activation amax instead")
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
        if args.calib_prompts and args.input_amax:
            raise ValueError("pass --calib-prompts or --input-amax, not both")
        amax = json.loads(Path(args.input_amax).read_text()) if args.input_amax else None
        kw = dict(
            kv="bf16",  # the export CLI writes weights; it names no KV cache format
            bf16_layers_start=args.bf16_layers_start,
            bf16_layers_end=args.bf16_layers_end,
            activation_scale="static" if amax or args.calib_prompts else "per_token",
        )
        if args.quant_targets:
            kw["targets"] = tuple(args.quant_targets)
        policy = QuantPolicy(**kw).resolve(arch)
        if args.calib_prompts and args.format == "nvfp4":
            from .static_scales import calibrate_input_amax, load_prompts

            amax = calibrate_input_amax(sd, cfg, load_prompts(args.calib_prompts, tok), policy.quantized_linears(arch))
        out = export_checkpoint(
            sd,
            arch,
            args.out,
            fmt=args.format,
            policy=policy,
            dtype=_DTYPES[args.dtype],
            max_shard_mb=args.max_shard_mb,
            input_amax=amax,
            hf_config=cfg,
            tokenizer_from=tok,
        )
    except (ValueError, KeyError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({args.format})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
