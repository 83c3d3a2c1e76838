"""Start a rollout server: `python -m sglang_backend.launch --backend local --model-path DIR ...`.

`--backend local` serves the embedded engine (`sglang_backend.local.server`) with SGLang's
flag names and runs until SIGINT/SIGTERM. `--backend sglang` execs `python -m
sglang.launch_server` with the flags translated (quantization nvfp4 -> trace_fp4, mxfp4 ->
trace_mxfp4; KV nvfp4 -> nvfp4, mxfp4 -> fp4_mx_block16) and SGLANG_PLUGINS=trace_fp4 so our
plugin (sglang_backend.plugin) loads; arguments after `--` go to SGLang unchanged. `--dry-run`
prints that command instead of running it.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import signal
import sys
import threading

QUANTIZATIONS = ["nvfp4", "w4a16_nvfp4", "mxfp4", "w4a16_mxfp4", "modelopt_fp4"]
SGLANG_QUANT = {"nvfp4": "trace_fp4", "mxfp4": "trace_mxfp4", "modelopt_fp4": "modelopt_fp4"}
SGLANG_KV = {"auto": "auto", "bf16": "bf16", "nvfp4": "nvfp4", "mxfp4": "fp4_mx_block16"}
PLUGIN_NAME = "trace_fp4"


def _guided_layers(v: str):
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
    p.add_argument("--kv-cache-dtype", choices=["auto", "bf16", "nvfp4", "mxfp4"], default="auto")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--guidance-mode", choices=["full", "mantissa"], default="mantissa")
    p.add_argument("--guided-layers", type=_guided_layers, default="last_half", metavar="last_half|all|none|N")
    p.add_argument("--max-running-requests", type=_positive, default=64)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--max-body-mb", type=_positive, default=64, help="request body limit in MiB (default 64)")
    p.add_argument("--tp-size", type=_positive, default=1, help="tensor parallel size (--backend sglang)")
    p.add_argument("--dry-run", action="store_true", help="--backend sglang: print the command, do not run it")
    return p


def sglang_command(args: argparse.Namespace, extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) of the SGLang server for our parsed flags."""
    if args.quantization is not None and args.quantization not in SGLANG_QUANT:
        raise ValueError(f"--quantization {args.quantization} is served by --backend local only; SGLang takes "
                         f"{', '.join(SGLANG_QUANT)}")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_path, "--host", args.host,
           "--port", str(args.port), "--tp-size", str(args.tp_size), "--dtype", args.dtype,
           "--kv-cache-dtype", SGLANG_KV[args.kv_cache_dtype], "--random-seed", str(args.random_seed),
           "--max-running-requests", str(args.max_running_requests)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    if args.quantization is not None:
        cmd += ["--quantization", SGLANG_QUANT[args.quantization]]
    env = {"SGLANG_PLUGINS": PLUGIN_NAME, "TRACE_GUIDANCE_MODE": args.guidance_mode,
           "TRACE_GUIDED_LAYERS": str(args.guided_layers)}
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
        print("error: --backend sglang needs the 'sglang' package, which is not installed in this Python "
              f"({sys.executable}); install it with pip install 'megatron-trace[sglang]' (CUDA only)", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, {**os.environ, **env})
    return 0  # not reached


def main(argv: list[str] | None = None, *, ready: threading.Event | None = None,
         stop: threading.Event | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.backend == "sglang":
        if not args.dry_run and not _loopback(args.host) and not args.api_key:
            print(f"error: --host {args.host} is not loopback; --api-key is required there", file=sys.stderr)
            return 2
        return _run_sglang(args, extra)
    if extra:
        print(f"error: arguments after -- ({shlex.join(extra)}) are for --backend sglang", file=sys.stderr)
        return 2
    from sglang_backend.local.engine import Engine
    from sglang_backend.local.http_util import is_loopback
    from sglang_backend.local.server import serve

    if not is_loopback(args.host) and not args.api_key:  # before loading a model, fail fast
        print(f"error: --host {args.host} is not loopback; --api-key is required there", file=sys.stderr)
        return 2
    try:
        engine = Engine(args.model_path, dtype=args.dtype, quantization=args.quantization,
                        kv_cache_dtype=args.kv_cache_dtype, guidance_mode=args.guidance_mode,
                        guided_layers=args.guided_layers, max_running_requests=args.max_running_requests,
                        random_seed=args.random_seed)
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
