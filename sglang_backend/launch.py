"""Start a rollout server: `python -m sglang_backend.launch --backend local --model-path DIR ...`.

`--backend local` serves the embedded engine (`sglang_backend.local.server`) with SGLang's
flag names; `--backend sglang` (a real SGLang server with our plugin) lands with the cluster
issue and exits 2 for now. Runs until SIGINT/SIGTERM.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading

QUANTIZATIONS = ["nvfp4", "w4a16_nvfp4", "mxfp4", "w4a16_mxfp4", "modelopt_fp4"]


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
    return p


def main(argv: list[str] | None = None, *, ready: threading.Event | None = None,
         stop: threading.Event | None = None) -> int:
    args = parser().parse_args(argv)
    if args.backend == "sglang":
        print("error: --backend sglang (a real SGLang server with our plugin) is not available yet; it lands "
              "with the cluster issue. Use --backend local.", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())
