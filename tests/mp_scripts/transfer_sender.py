"""A sender process the interrupted-transfer test kills mid-version (tests/test_transfer.py).

    python tests/mp_scripts/transfer_sender.py --ckpt DIR --url URL --api-key K --port P --version V

Pushes the HF checkpoint over the distributed transport with a tiny bucket budget; after the
first bucket is on the wire it prints SENT_ONE and stalls, so the test can SIGKILL it mid-version.
"""

from __future__ import annotations

import argparse
import time

from megatron_trace.models import QuantPolicy  # noqa: E402
from megatron_trace.transfer.export import load_hf_dir  # noqa: E402
from megatron_trace.transfer.pipeline import push_hf_state_dict  # noqa: E402
from megatron_trace.transfer.transports import DistributedTransport  # noqa: E402


class _StallAfterOne(DistributedTransport):
    def send(self, buckets, version, *, manifest=None):
        def stalled():
            it = iter(buckets)
            yield next(it)
            print("SENT_ONE", flush=True)  # the first bucket has been broadcast by now
            time.sleep(600)
            yield from it

        return super().send(stalled(), version, manifest=manifest)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--version", type=int, required=True)
    args = ap.parse_args()
    arch, sd, _ = load_hf_dir(args.ckpt)
    t = _StallAfterOne(args.url, args.api_key, "127.0.0.1", args.port)
    push_hf_state_dict(sd, arch, QuantPolicy(kv="bf16"), t, args.version, bucket_mb=0.02)


if __name__ == "__main__":
    main()
