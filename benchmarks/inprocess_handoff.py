"""What handing a step's guidance and weights over as objects saves in one process, side by side.

    .venv/bin/python benchmarks/inprocess_handoff.py --model-path DIR [--prompts 4 --samples 4 --tokens 256]

On a checkpoint (the real Qwen2.5-Coder-0.5B for the figures in BENCHMARKS.md) under the real
config's policy (NVFP4 W4A4 MLPs, de-biased FP8 K + NVFP4 V, mantissa guidance on every layer), one
step's rollout on the embedded engine, then, interleaved over --repeats rounds (best of each):

* guidance: the step's records as the rollout hands them to the trainer. As bytes (what every step
  did before records stayed objects in one process): `encode_records` over the step's sites, then
  `GuidanceRecord.from_bytes` of each record when its step trains. As objects: `split_records`
  (views of the step's tensors).
* weights: one version from the HF state dict into the engine. Through buckets (`transfer.bucket_mb`
  64 MiB) merged back into one update, with the engine's former all-or-nothing copy of its whole
  state dict (timed as that clone); as tensors: the in-process transport's `send_units`, whose
  engine checks the whole update before writing instead (`loader.check_update`).
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_trace.guidance import GuidanceRecord, concat_sites, encode_records, split_records
from megatron_trace.models import ModelArch, QuantPolicy
from megatron_trace.transfer.bucket import pack_buckets
from megatron_trace.transfer.export import load_hf_dir
from megatron_trace.transfer.pipeline import hf_state_dict_stream, push_hf_state_dict
from megatron_trace.transfer.quantize import rollout_tensors
from megatron_trace.transfer.transports import InProcessTransport, TransferStats, _merge
from sglang_backend.api import GenerateRequest, SamplingParams
from sglang_backend.local import Engine, InProcessBackend

POLICY = dict(kv="bf16", kv_k="fp8", kv_v="nvfp4", kv_k_debias=True)


def best(fn, repeats: int) -> float:
    out = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    arch = ModelArch.from_hf_config(args.model_path)
    policy = QuantPolicy(**POLICY).resolve(arch)
    engine = Engine(
        args.model_path, dtype="bfloat16", quant_policy=policy, guided_layers="all", max_running_requests=64
    )
    backend = InProcessBackend(engine)
    try:
        g = torch.Generator().manual_seed(0)
        reqs = [
            GenerateRequest(
                torch.randint(100, 20000, (64,), generator=g).tolist(),
                SamplingParams(max_new_tokens=args.tokens, ignore_eos=True, n=args.samples, sampling_seed=i),
                rid=f"p{i}",
                return_guidance=True,
            )
            for i in range(args.prompts)
        ]
        results = backend.generate(reqs)
        records = [backend.fetch_guidance(r.guidance_handle) for r in results]
        ids, lens, mode = [r.sample_id for r in records], [r.num_positions for r in records], records[0].mode
        sites = {name: concat_sites([r.sites[name] for r in records]) for name in records[0].sites}
        nbytes = sum(r.nbytes() for r in records)

        def as_bytes():
            return [GuidanceRecord.from_bytes(b) for b in encode_records(ids, mode, lens, sites)]

        def as_objects():
            return split_records(ids, mode, lens, sites)

        _, hf_sd, _ = load_hf_dir(args.model_path)
        hf_sd = {k: v.to(torch.bfloat16) for k, v in hf_sd.items()}
        version = [0]

        def through_buckets():
            version[0] += 1
            units = rollout_tensors(hf_state_dict_stream(hf_sd, arch), arch, policy)
            merged = _merge(pack_buckets(units, version[0], 64.0), version[0], TransferStats(version[0]))
            {k: v.detach().clone() for k, v in engine.model.state_dict().items()}  # the former rollback copy
            backend.update_weights(merged)

        def as_tensors():
            version[0] += 1
            push_hf_state_dict(hf_sd, arch, policy, InProcessTransport(backend), version[0])

        guide_b, guide_o, sync_b, sync_o = [], [], [], []
        for _ in range(args.repeats):  # interleaved: the box is shared
            guide_b.append(best(as_bytes, 1))
            guide_o.append(best(as_objects, 1))
            sync_b.append(best(through_buckets, 1))
            sync_o.append(best(as_tensors, 1))
    finally:
        engine.shutdown()
    pos = sum(lens)
    print(f"{len(records)} records, {pos} positions, {nbytes / pos:.0f} B/token of guidance ({nbytes / 2**20:.1f} MiB)")
    print("| handoff | as bytes / through buckets (s) | as objects / tensors (s) | ratio |")
    print("|---|---:|---:|---:|")
    for name, a, b in (("a step's guidance records", guide_b, guide_o), ("one weight version", sync_b, sync_o)):
        print(f"| {name} | {min(a):.3f} | {min(b):.3f} | {min(a) / max(min(b), 1e-9):.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
