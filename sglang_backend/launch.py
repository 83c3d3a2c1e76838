"""Start a rollout server: `python -m sglang_backend.launch --backend local --model-path DIR ...`.

`--backend local` serves the embedded engine (`sglang_backend.local.server`) with SGLang's
flag names and runs until SIGINT/SIGTERM. `--backend sglang` execs `python -m
sglang.launch_server` with the flags translated and SGLANG_PLUGINS=trace_fp4 so our plugin
(sglang_backend.plugin) loads; arguments after `--` go to SGLang unchanged. `--dry-run` prints
that command instead of running it.

Quantization: an exported NVFP4 (ModelOpt) checkpoint needs no flag (the plugin claims it; an
explicit nvfp4 is dropped for it); on a BF16/FP32 checkpoint nvfp4 -> trace_nvfp4 and mxfp4 ->
trace_mxfp4 quantize online with the same policy as the engine (passed in TRACE_QUANT_POLICY).
KV nvfp4 -> nvfp4, mxfp4 -> fp4_mx_block16 (on GPUs). K and V in their own formats (`--kv-k` /
`--kv-v`, the policy's quant.kv_k / quant.kv_v), FP8 KV and MXFP4 KV on the CPU engine go through
the plugin's per-side method (plugin/kv_sides.py): SGLang's --kv-cache-dtype nvfp4 plus
TRACE_KV_SIDES=<k>,<v>, read through torch_native attention (added, with a warning, on GPUs).
`--device cpu` (the default without CUDA) adds what SGLang's CPU engine needs:
SGLANG_USE_CPU_ENGINE=1, --device cpu, --attention-backend torch_native, --sampling-backend
pytorch, --disable-cuda-graph, --sleep-on-idle, a --mem-fraction-static sized to the weights + KV.
Always: --skip-tokenizer-init (the rollout speaks token ids) and --weight-version (default "0",
the trainer's first version).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

from sglang_backend.cpu_engine_sizing import cpu_mem_fraction, cpu_thread_binding
from sglang_backend.launch_moe import refuse_unserved_fp4_experts
from sglang_backend.plugin_settings import SIDE_FORMATS, PluginSettings, env_names

QUANTIZATIONS = ["nvfp4", "w4a16_nvfp4", "mxfp4", "w4a16_mxfp4", "modelopt_fp4"]
SGLANG_QUANT = {"nvfp4": "trace_nvfp4", "mxfp4": "trace_mxfp4", "modelopt_fp4": "modelopt_fp4"}
CPU_FLAGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--disable-cuda-graph",
    # An idle scheduler otherwise busy-polls its sockets at 100% of a core: on a CPU box that core is
    # the trainer's or another server's (measured: 1.0 core per idle server on 2 cores).
    "--sleep-on-idle",
]
SGLANG_KV = {"auto": "auto", "bf16": "bf16", "nvfp4": "nvfp4", "mxfp4": "fp4_mx_block16"}
PLUGIN_NAME = "trace_fp4"
KV_SIDES = SIDE_FORMATS  # what the plugin can store per side


def _parse_guided_layers(v: str):
    if v in ("last_half", "all", "none"):
        return v
    if v.isdigit():
        return int(v)
    raise argparse.ArgumentTypeError(f"must be last_half, all, none or an int N (the last N layers); got {v!r}")


def _positive(v: str) -> int:
    if not v.isdigit() or int(v) < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1; got {v!r}")
    return int(v)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_backend.launch", description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["local", "sglang"], default="local")
    p.add_argument("--model-path", required=True, help="HF checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="required on a non-loopback host")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None)
    # SGLang's flag: auto is the model's dtype (BF16), as SGLang reads it
    p.add_argument("--kv-cache-dtype", choices=["auto", *KV_SIDES], default="auto")
    p.add_argument("--kv-k", choices=KV_SIDES, default=None, help="K cache format (default: --kv-cache-dtype)")
    p.add_argument("--kv-v", choices=KV_SIDES, default=None, help="V cache format (default: --kv-cache-dtype)")
    p.add_argument(
        "--kv-k-debias",
        action="store_true",
        help="the K cache holds K minus its rotated k_proj bias (quant.kv_k_debias); --backend sglang reads it "
        "through the plugin's plain path (torch_native attention)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--guidance-mode", choices=["full", "mantissa"], default="mantissa")
    p.add_argument("--guided-layers", type=_parse_guided_layers, default="last_half", metavar="last_half|all|none|N")
    p.add_argument("--max-running-requests", type=_positive, default=64)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--max-body-mb", type=_positive, default=64, help="request body limit in MiB (default 64)")
    p.add_argument("--tp-size", type=_positive, default=1, help="tensor parallel size (--backend sglang)")
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="--backend sglang: auto = cuda when torch sees a GPU, else SGLang's CPU engine",
    )
    p.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="--backend sglang (default: SGLang's on GPU; on CPU what the weights + KV need, >= 0.05)",
    )
    p.add_argument("--max-total-tokens", type=_positive, default=None, help="KV pool tokens (default 16384 on CPU)")
    p.add_argument("--weight-version", default="0", help="--backend sglang: the served version's name (default '0')")
    p.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="routing replay: SGLang keeps each token's routed expert ids (the embedded engine always can)",
    )
    p.add_argument("--dry-run", action="store_true", help="--backend sglang: print the command, do not run it")
    return p


def _is_fp4_export(model_path: str) -> bool:
    """An exported NVFP4 checkpoint: a ModelOpt quant config in config.json or hf_quant_config.json."""
    root = Path(model_path)
    try:
        cfg = json.loads((root / "config.json").read_text()).get("quantization_config")
        if cfg is None and (root / "hf_quant_config.json").exists():
            cfg = json.loads((root / "hf_quant_config.json").read_text())
    except (OSError, ValueError):
        return False
    if cfg is None:
        return False
    from sglang_backend.plugin.quant_config import is_modelopt_nvfp4  # imports SGLang: only for a quantized checkpoint

    return is_modelopt_nvfp4(cfg)


def _online_policy(args: argparse.Namespace) -> str:
    """The plugin's quant_policy for online quantization: the engine's policy for these flags + the layer count."""
    from megatron_trace.models import ModelArch

    policy = _policy(args)
    layers = ModelArch.from_hf_config(Path(args.model_path)).num_layers
    return json.dumps({"policy": policy.to_dict(), "num_layers": layers})


def _policy(args: argparse.Namespace):
    """The engine's QuantPolicy for these flags, with --kv-k / --kv-v applied."""
    from megatron_trace.models import QuantPolicy
    from sglang_backend.local.quant_flags import policy_for

    policy = policy_for(args.quantization, args.kv_cache_dtype, Path(args.model_path))
    if args.kv_k is None and args.kv_v is None and not args.kv_k_debias:
        return policy
    sides = {"kv_k": args.kv_k or policy.kv_k, "kv_v": args.kv_v or policy.kv_v}
    return QuantPolicy.from_dict({**policy.to_dict(), **sides, "kv_k_debias": args.kv_k_debias})


def kv_sides(args: argparse.Namespace) -> tuple[str, str]:
    """(K format, V format) of these flags; 'auto' is the model dtype (bf16 in the policy's words)."""
    both = "bf16" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    return args.kv_k or both, args.kv_v or both


def sglang_kv(args: argparse.Namespace, device: str) -> tuple[list[str], tuple[str, str] | None]:
    """SGLang's KV flags, and the (K, V) formats the plugin must serve itself (None: SGLang's flag says it)."""
    sides = kv_sides(args)
    debias = args.kv_k_debias and sides[0] != "bf16"  # the per-side method de-biases K (plugin/kv_debias.py)
    if sides == ("bf16", "bf16"):
        return ["--kv-cache-dtype", args.kv_cache_dtype if args.kv_cache_dtype in SGLANG_KV else "bf16"], None
    if not debias and (sides == ("nvfp4", "nvfp4") or (sides == ("mxfp4", "mxfp4") and device != "cpu")):
        return ["--kv-cache-dtype", SGLANG_KV[sides[0]]], None
    flags = ["--kv-cache-dtype", "nvfp4"]
    if device != "cpu":  # the CPU flags select torch_native already
        print(
            f"warning: K cache {sides[0]} + V cache {sides[1]} is read through the plugin's plain dequantized "
            "path, which only SGLang's torch_native attention takes: adding --attention-backend torch_native "
            "(slower than the GPU backends; plugin/kv_sides.py)",
            file=sys.stderr,
        )
        flags += ["--attention-backend", "torch_native"]
    return flags, sides


def _resolve_guided_layers(args: argparse.Namespace) -> list[int]:
    """--guided-layers resolved against the checkpoint's layer count (the plugin gets explicit indices)."""
    from megatron_trace.guidance import resolve_guided_layers
    from megatron_trace.models import ModelArch

    try:
        layers = ModelArch.from_hf_config(Path(args.model_path)).num_layers
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot read the model config of {args.model_path}: {e}") from None
    return resolve_guided_layers(layers, args.guided_layers)


def _device(args: argparse.Namespace) -> str:
    if args.device != "auto":
        return args.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def sglang_command(args: argparse.Namespace, extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) of the SGLang server for our parsed flags."""
    if args.quantization is not None and args.quantization not in SGLANG_QUANT:
        raise ValueError(
            f"--quantization {args.quantization} is served by --backend local only; SGLang takes "
            f"{', '.join(SGLANG_QUANT)}"
        )
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        args.model_path,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--tp-size",
        str(args.tp_size),
        "--dtype",
        args.dtype,
        "--random-seed",
        str(args.random_seed),
        "--max-running-requests",
        str(args.max_running_requests),
        "--skip-tokenizer-init",
        "--weight-version",
        str(args.weight_version),
    ]
    env = {"SGLANG_PLUGINS": PLUGIN_NAME}
    plugin = {
        "guidance_mode": args.guidance_mode,
        "guided_layers": tuple(_resolve_guided_layers(args)),
        "kv_k_debias": args.kv_k_debias,
    }
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    if args.enable_return_routed_experts:
        cmd += ["--enable-return-routed-experts"]
    export = args.quantization in (None, "nvfp4", "modelopt_fp4") and _is_fp4_export(args.model_path)
    online = args.quantization in ("nvfp4", "mxfp4") and not export
    refuse_unserved_fp4_experts(
        args.model_path,
        export=export and args.quantization != "modelopt_fp4",
        policy=_policy(args) if online else None,
        tp_size=args.tp_size,
        quantization=args.quantization,
    )
    if args.quantization == "modelopt_fp4" or (args.quantization is not None and not export):
        cmd += ["--quantization", SGLANG_QUANT[args.quantization]]
        if args.quantization in ("nvfp4", "mxfp4"):
            plugin["quant_policy"] = _online_policy(args)
    device = _device(args)
    kv_flags, plugin["kv_sides"] = sglang_kv(args, device)
    cmd += kv_flags
    # The plugin's settings travel in the server's environment (plugin_settings.py); those the
    # flags do not decide pass through from ours.
    env.update(dataclasses.replace(PluginSettings.from_env(), kv_read_dtype=args.dtype, **plugin).to_env())
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        if args.tp_size > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
            env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(args.tp_size)
        tokens = args.max_total_tokens or 16384
        cmd += CPU_FLAGS + [
            "--mem-fraction-static",
            str(args.mem_fraction_static or cpu_mem_fraction(args, tokens)),
            "--max-total-tokens",
            str(tokens),
        ]
    else:
        if args.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(args.mem_fraction_static)]
        if args.max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(args.max_total_tokens)]
    return cmd + list(extra), env


def _run_sglang(args: argparse.Namespace, extra: list[str]) -> int:
    try:
        cmd, env = sglang_command(args, extra)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        shown = [a if a != args.api_key else "***" for a in cmd] if args.api_key else cmd
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(shown))
        return 0
    if importlib.util.find_spec("sglang") is None:
        print(
            "error: --backend sglang needs the 'sglang' package, which is not installed in this Python "
            f"({sys.executable}); install it with pip install 'megatron-trace[sglang]' (CUDA only)",
            file=sys.stderr,
        )
        return 2
    sys.stdout.flush()
    # The plugin's variables are exactly `env`'s: one the flags left unset must not leak in from ours.
    inherited = {k: v for k, v in os.environ.items() if k not in env_names()}
    os.execvpe(cmd[0], cmd, {**inherited, **env})
    return 0  # not reached


def main(
    argv: list[str] | None = None, *, ready: threading.Event | None = None, stop: threading.Event | None = None
) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.backend == "sglang":
        if not args.dry_run and not _loopback(args.host) and not args.api_key:
            print(f"error: --host {args.host} is not loopback; --api-key is required there", file=sys.stderr)
            return 2
        return _run_sglang(args, extra)
    if extra:
        print(f"error: arguments after -- ({shlex.join(extra)}) are for --backend sglang", file=sys.stderr)
        return 2
    from megatron_trace.kernels import cpu_alloc
    from sglang_backend.local.engine import Engine
    from sglang_backend.local.http_util import is_loopback
    from sglang_backend.local.server import serve

    cpu_alloc.bound_kernel_caches()  # before the engine's first GEMM

    if not is_loopback(args.host) and not args.api_key:  # before loading a model, fail fast
        print(f"error: --host {args.host} is not loopback; --api-key is required there", file=sys.stderr)
        return 2
    try:
        engine = Engine(
            args.model_path,
            dtype=args.dtype,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            quant_policy=_policy(args),
            guidance_mode=args.guidance_mode,
            guided_layers=args.guided_layers,
            max_running_requests=args.max_running_requests,
            random_seed=args.random_seed,
        )
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: cannot load {args.model_path}: {e}", file=sys.stderr)
        return 2
    try:
        server = serve(engine, args.host, args.port, args.api_key, args.max_body_mb << 20)
    except (ValueError, OSError) as e:
        engine.shutdown()
        print(f"error: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    print(f"serving {args.model_path} at {server.url}", flush=True)
    if ready is not None:
        ready.set()
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        engine.shutdown()
    return 0


def _loopback(host: str) -> bool:
    from sglang_backend.local.http_util import is_loopback

    return is_loopback(host)


if __name__ == "__main__":
    sys.exit(main())
