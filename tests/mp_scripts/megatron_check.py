"""torchrun worker for tests/test_trainer_megatron.py.

    python -m torch.distributed.run --nproc-per-node N tests/mp_scripts/megatron_check.py \
        --ckpts DIR --out DIR --configs 1x1x1,2x2x1 [--export 2x2x1] [--train 2x2x1]

For each TPxPPxEP config (world size must be a multiple of TP*PP; the rest is data parallel) and
each family checkpoint under --ckpts/<family>, rank 0 writes the logits for --ckpts/input_ids.pt
to --out/logits_<family>_<cfg>.safetensors; --export also writes the HF round trip to
--out/export_<family>_<cfg>.safetensors; --train runs a few optimizer steps (qwen3) and writes
the losses / grad norms to --out/train_<cfg>.json. Re-initializing the model-parallel groups
between configs keeps this to one launch (imports dominate the cost on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_trace.models import ModelArch  # noqa: E402
from megatron_trace.trainer import gpt, parallel  # noqa: E402


def _cfg(s: str) -> tuple[int, int, int]:
    tp, pp, ep = (int(x) for x in s.split("x"))
    return tp, pp, ep


def _train(chunks, arch: ModelArch, ids: torch.Tensor, steps: int = 3) -> dict:
    """A few Adam steps with Megatron's DDP + (non-distributed) optimizer + grad clipping on the
    next-token loss; exercises the schedule/optimizer/clip-grad CPU workarounds."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    model = chunks[0]
    # As Megatron-LM's training loop does: DP grad all-reduce + the TP all-reduce of the
    # replicated qk-layernorm grads (each TP rank only sees its own heads' contribution).
    model.config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=False), model)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-2, clip_grad=0.5, bf16=False, fp16=False, use_distributed_optimizer=False
        ),
        [ddp],
    )
    b, s = ids.shape
    inp, labels = ids[:, :-1], ids[:, 1:]
    pos = torch.arange(s - 1).expand(b, s - 1)
    mask = torch.triu(torch.ones(s - 1, s - 1, dtype=torch.bool), 1)[None, None]
    losses, norms = [], []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()

        def step(_it, m):
            out = m(inp, pos, mask)
            if not ps.is_pipeline_last_stage():
                return out, None  # hidden states for the next stage
            # the model's logits are vocab-parallel: this plain CE reference gathers them over TP
            logits = gather_from_tensor_model_parallel_region(out)[..., : arch.vocab_size]

            def loss_fn(out):
                loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten())
                return loss, {"loss": loss.detach().clone()}  # clone: the schedule divides in place

            return logits, loss_fn

        store = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter([None]),
            model=[ddp],
            num_microbatches=1,
            seq_length=s - 1,
            micro_batch_size=b,
            forward_only=False,
        )
        ok, grad_norm, _ = opt.step()
        assert ok, "optimizer step skipped"
        norms.append(float(grad_norm))
        if store:
            losses.append(float(store[0]["loss"]))
    return {"losses": losses, "grad_norms": norms}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--families", default="qwen2,qwen3,qwen3_moe")
    ap.add_argument("--configs", default="1x1x1")
    ap.add_argument("--export", default="")
    ap.add_argument("--train", default="")
    args = ap.parse_args()
    from safetensors.torch import save_file

    out = Path(args.out)
    ids = torch.load(Path(args.ckpts) / "input_ids.pt")
    for cfg_s in args.configs.split(","):
        tp, pp, ep = _cfg(cfg_s)
        parallel.init_distributed(tp=tp, pp=pp, ep=ep, seed=1234)
        for fam in args.families.split(","):
            ckpt = Path(args.ckpts) / fam
            arch = ModelArch.from_hf_config(ckpt)
            if ep > 1 and not arch.is_moe:
                continue
            chunks = gpt.build_model(arch)
            gpt.load_hf_weights(chunks, ckpt, arch)
            logits = gpt.forward_logits(chunks, ids)
            if dist.get_rank() == 0:
                save_file({"logits": logits.contiguous()}, str(out / f"logits_{fam}_{cfg_s}.safetensors"))
            if cfg_s in args.export.split(","):
                hf = gpt.export_hf_state_dict(chunks, arch)
                if dist.get_rank() == 0:
                    save_file(
                        {k: v.contiguous() for k, v in hf.items()}, str(out / f"export_{fam}_{cfg_s}.safetensors")
                    )
            if cfg_s in args.train.split(",") and fam == "qwen3":
                res = _train(chunks, arch, ids)
                # The last stage holds the loss; its TP/DP rank 0 reports.
                from megatron.core import parallel_state as ps

                if (
                    ps.is_pipeline_last_stage()
                    and ps.get_tensor_model_parallel_rank() == 0
                    and ps.get_data_parallel_rank() == 0
                ):
                    (out / f"train_{cfg_s}.json").write_text(json.dumps(res))
    dist.barrier()
    parallel.destroy()
    if int(os.environ.get("RANK", "0")) == 0:
        from megatron.core import jit

        compiled = jit.jit_fuser(_cfg)  # cpu_compat item 7: a pass-through, torch.compile itself restored
        (out / "jit.json").write_text(
            json.dumps(
                {"fuser_passthrough": compiled is _cfg, "torch_compile_restored": torch.compile.__module__ == "torch"}
            )
        )
        (out / "done").write_text("ok")


if __name__ == "__main__":
    main()
