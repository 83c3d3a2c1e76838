"""Load test of the rollout server's HTTP API: N concurrent clients for a bounded time.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/load_rollout.py --clients 16 --max-running-requests 4 --duration 20
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/load_rollout.py --url http://127.0.0.1:30000 --api-key K --clients 32

Without `--url` it starts the embedded server itself on 127.0.0.1 (an ephemeral port, with an API
key) over `--model-path` or a tiny random-init qwen2 (`make_tiny_checkpoint`), with
`--max-running-requests` as its batch capacity. Each client is a thread that POSTs `/generate`
(a random prompt of `--prompt-len` tokens, `--new-tokens` sampled tokens, ignore_eos) in a loop
until `--duration` seconds have passed, then finishes the request it has in flight. No retries:
every non-200 answer, connection error or short answer is an error. Prints one markdown table:
requests, requests/s, generated tokens/s, p50/p99 latency, errors, the peak number of requests
the clients had in flight and (own server only) the peak queue and batch the scheduler held.
With more clients than capacity the server must queue, never drop: exit status 1 if errors > 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


class _Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.tokens = 0
        self.errors: list[str] = []
        self.in_flight = self.peak_in_flight = 0

    def start(self):
        with self.lock:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def done(self, latency: float | None, tokens: int = 0, error: str | None = None):
        with self.lock:
            self.in_flight -= 1
            if error is None:
                self.latencies.append(latency)
                self.tokens += tokens
            else:
                self.errors.append(error)


def _client(i: int, url: str, key: str | None, args, stop_at: float, stats: _Stats, vocab: int) -> None:
    rng = random.Random(1000 + i)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    while time.monotonic() < stop_at:
        body = {
            "input_ids": [rng.randrange(1, vocab) for _ in range(args.prompt_len)],
            "rid": f"load-{i}-{rng.random()}",
            "sampling_params": {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True},
        }
        req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), headers=headers, method="POST")
        stats.start()
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=args.request_timeout) as r:
                out = json.loads(r.read())
            n = len(out.get("output_ids", []))
            if n != args.new_tokens:
                stats.done(None, error=f"short answer: {n} of {args.new_tokens} tokens")
            else:
                stats.done(time.monotonic() - t0, n)
        except urllib.error.HTTPError as e:
            stats.done(None, error=f"HTTP {e.code}: {e.read()[:200]!r}")
        except Exception as e:  # connection refused/reset, timeout: all errors here (no retries)
            stats.done(None, error=f"{type(e).__name__}: {e}")


def run_load(url: str, key: str | None, args, vocab: int, engine=None) -> dict:
    stats = _Stats()
    peak = {"queued": 0, "running": 0}
    stop_at = time.monotonic() + args.duration
    threads = [
        threading.Thread(target=_client, args=(i, url, key, args, stop_at, stats, vocab), daemon=True)
        for i in range(args.clients)
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if engine is not None:  # the scheduler's queue and batch, sampled
            s = engine.scheduler
            peak["queued"] = max(peak["queued"], sum(len(g.rids) for g in list(s.waiting)))
            peak["running"] = max(peak["running"], len(s.running))
        time.sleep(0.01)
    wall = time.monotonic() - t0
    n = len(stats.latencies)
    return {
        "clients": args.clients,
        "capacity": args.max_running_requests if engine is not None else None,
        "wall_s": wall,
        "requests": n,
        "req_per_s": n / wall,
        "tokens_per_s": stats.tokens / wall,
        "p50_s": _percentile(stats.latencies, 50),
        "p99_s": _percentile(stats.latencies, 99),
        "errors": len(stats.errors),
        "first_errors": stats.errors[:3],
        "peak_in_flight": stats.peak_in_flight,
        "peak_queued": peak["queued"] if engine is not None else None,
        "peak_running": peak["running"] if engine is not None else None,
    }


def table(r: dict) -> str:
    def fmt(v):
        return "n/a" if v is None else f"{v}"

    head = [
        "clients",
        "server capacity",
        "wall (s)",
        "requests",
        "requests/s",
        "tokens/s",
        "p50 latency (s)",
        "p99 latency (s)",
        "errors",
        "peak in flight",
        "peak queued",
        "peak running",
    ]
    row = [
        r["clients"],
        fmt(r["capacity"]),
        f"{r['wall_s']:.1f}",
        r["requests"],
        f"{r['req_per_s']:.2f}",
        f"{r['tokens_per_s']:.1f}",
        f"{r['p50_s']:.3f}",
        f"{r['p99_s']:.3f}",
        r["errors"],
        r["peak_in_flight"],
        fmt(r["peak_queued"]),
        fmt(r["peak_running"]),
    ]
    return "\n".join(
        ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), "| " + " | ".join(str(x) for x in row) + " |"]
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/load_rollout.py", description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="an already running server (default: start one on loopback)")
    p.add_argument("--api-key", default=None, help="the server's key (own server: a random one)")
    p.add_argument("--model-path", default=None, help="own server: HF checkpoint (default: tiny random qwen2)")
    p.add_argument("--max-running-requests", type=int, default=4, help="own server's batch capacity")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load (then in-flight requests finish)")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--vocab", type=int, default=None, help="token ids are drawn below this (--url; default 256)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.clients < 1 or args.duration <= 0 or args.max_running_requests < 1:
        parser().error("--clients, --max-running-requests must be >= 1 and --duration > 0")
    if args.url:
        result = run_load(args.url.rstrip("/"), args.api_key, args, args.vocab or 256)
    else:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sglang_backend.local import Engine
        from sglang_backend.local.server import serve

        with tempfile.TemporaryDirectory() as tmp:
            path = args.model_path
            if path is None:
                from megatron_trace.models.tiny import make_tiny_checkpoint

                path = str(make_tiny_checkpoint(Path(tmp) / "tiny", "qwen2", seed=0))
            engine = Engine(path, max_running_requests=args.max_running_requests)
            key = args.api_key or os.urandom(12).hex()
            srv = serve(engine, host="127.0.0.1", port=0, api_key=key)
            try:
                vocab = min(args.vocab or engine.arch.vocab_size, engine.arch.vocab_size)
                result = run_load(srv.url, key, args, vocab, engine)
            finally:
                srv.shutdown()
                engine.shutdown()
    print(table(result))
    if result["errors"]:
        print("first errors:", *result["first_errors"], sep="\n  ", file=sys.stderr)
    return result


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
