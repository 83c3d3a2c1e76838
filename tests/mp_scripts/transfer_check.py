"""torchrun worker for tests/test_transfer.py.

    python -m torch.distributed.run --nproc-per-node 4 tests/mp_scripts/transfer_check.py \
        --ckpts DIR --out DIR [--configs 2x2x1,1x1x2] [--url URL --api-key K --master-port P --send DIR]

For each TPxPPxEP config and family under --ckpts/<family>: load the HF checkpoint into the
sharded Megatron model, stream it back out with `iter_hf_params` (every rank iterates; rank 0
saves) to --out/rt_<family>_<cfg>.safetensors. With --url, the TP2xPP2 qwen3 model loaded from
--send is pushed to that rollout server over the distributed (broadcast) transport as version 7
(rank 0 is the sender; the other ranks only join the gather) and rank 0 writes the stats.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch.distributed as dist

from megatron_trace.models import ModelArch, QuantPolicy  # noqa: E402
from megatron_trace.trainer import gpt, parallel  # noqa: E402
from megatron_trace.transfer.bucket import BucketStats  # noqa: E402
from megatron_trace.transfer.gather import hf_order, iter_hf_params, model_parallel  # noqa: E402
from megatron_trace.transfer.pipeline import push_weights  # noqa: E402
from megatron_trace.transfer.transports import DistributedTransport  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--families", default="qwen2,qwen3,qwen3_moe")
    ap.add_argument("--configs", default="2x2x1,1x1x2")
    ap.add_argument("--url", default="")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--master-port", type=int, default=0)
    ap.add_argument("--send", default="")
    args = ap.parse_args()
    from safetensors.torch import save_file

    out = Path(args.out)
    for cfg_s in args.configs.split(","):
        tp, pp, ep = (int(x) for x in cfg_s.split("x"))
        parallel.init_distributed(tp=tp, pp=pp, ep=ep, seed=1234)
        for fam in args.families.split(","):
            ckpt = Path(args.ckpts) / fam
            arch = ModelArch.from_hf_config(ckpt)
            if ep > 1 and not arch.is_moe:
                continue
            chunks = gpt.build_model(arch)
            gpt.load_hf_weights(chunks, ckpt, arch)
            got = {}
            for name, t in iter_hf_params(chunks, arch):
                got[name] = t.clone()  # the stream may alias live parameters
            par, vocab = model_parallel(chunks)
            order_ok = [n for n in got] == [n for n, _ in hf_order(arch, par, vocab)]
            if dist.get_rank() == 0:
                save_file(got, str(out / f"rt_{fam}_{cfg_s}.safetensors"))
                (out / f"order_{fam}_{cfg_s}.json").write_text(json.dumps({"ok": order_ok}))
        if args.url and cfg_s == "2x2x1":
            arch = ModelArch.from_hf_config(args.send)
            chunks = gpt.build_model(arch)
            gpt.load_hf_weights(chunks, args.send, arch)
            transport = None
            if dist.get_rank() == 0:
                transport = DistributedTransport(args.url, args.api_key, "127.0.0.1", args.master_port)
            bstats = BucketStats()
            # A small budget forces many buckets into the one version.
            stats = push_weights(
                chunks, arch, QuantPolicy(kv="bf16"), transport, version=7, bucket_mb=0.05, bucket_stats=bstats
            )
            if transport is not None:
                transport.close()
                (out / "send_stats.json").write_text(json.dumps({**stats.__dict__, **bstats.__dict__}))
    dist.barrier()
    parallel.destroy()
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "done").write_text("ok")


if __name__ == "__main__":
    main()
