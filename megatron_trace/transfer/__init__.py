"""Trainer -> rollout weight transfer: gather TP/PP/EP shards into HF names, quantize per the
QuantPolicy (ModelOpt NVFP4), pack into byte-budgeted buckets, and send them with one atomic
commit per version over in-process / HTTP / torch.distributed-broadcast / disk transports.

Submodules: gather (Megatron collectives), quantize, bucket, transports, pipeline (end to end),
export (checkpoint writer + `python -m megatron_trace.transfer.export`). Importing this package imports
none of them (Megatron stays unimported until gather runs).
"""
