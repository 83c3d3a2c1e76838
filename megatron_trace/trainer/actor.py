"""The actor: FP4-aware logprob recompute and the policy update on Megatron-Core.

    samples (prompt, response, rollout logprobs, advantage, guidance record)
      ─► micro-batches [mbs, S] (right-padded; input = tokens[:-1], labels = tokens[1:])
      ─► Megatron pipeline schedule; before each micro-batch's forward the QAT state gets that
         micro-batch's guidance, laid out [S, mbs] like Megatron's activations
      ─► logp of each response token at the rollout's temperature
      ─► (train) policy loss summed over response tokens / all response tokens of the batch,
         STE backward, DDP/TP grad reduction, grad clipping, Adam step
Every rank passes the same samples; logprobs come back on every rank.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_trace import faults
from megatron_trace.config import AlgoConfig, RolloutConfig, TrainerConfig
from megatron_trace.guidance import GuidanceRecord
from megatron_trace.models import ModelArch, QuantPolicy, pp_layer_range
from megatron_trace.rl import policy_loss
from sglang_backend.sampling_support import keep_mask, needs_filter, support_logprob

from .gpt import _unwrap, build_model, load_hf_weights
from .micro_batch_guidance import MicroBatchGuidance
from .qat import install_qat
from .routing_replay import RoutingReplay, assert_same_micro_batch, replay_enabled


@dataclass
class Sample:
    sample_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    advantage: float = 0.0
    guidance: GuidanceRecord | None = None
    routed_experts: torch.Tensor | None = None  # the rollout's expert ids [T, layers, top_k] (MoE)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids


@dataclass
class _MicroBatch:
    ids: torch.Tensor
    labels: torch.Tensor
    resp_mask: torch.Tensor
    rollout_lp: torch.Tensor
    adv: torch.Tensor
    guidance: MicroBatchGuidance | None
    count: int  # real samples (the rest is padding)
    routed: list = field(default_factory=list)  # per batch column: the sample's routed experts or None
    names: list = field(default_factory=list)  # per batch column: the sample id, None for padding
    extra: dict = field(default_factory=dict)


class Actor:
    def __init__(
        self,
        arch: ModelArch,
        policy: QuantPolicy,
        cfg: TrainerConfig,
        sampling: RolloutConfig | None = None,
        hf_path=None,
    ):
        """Call `parallel.init_distributed` first. Loads `hf_path` (an HF checkpoint) when given.
        `cfg` is the run's `trainer` section; `sampling` its `rollout` section, whose temperature and
        top-k/top-p filters define the policy the logprobs are recomputed under (default: plain sampling)."""
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.arch, self.policy, self.cfg = arch, policy, cfg
        self.sampling = sampling if sampling is not None else RolloutConfig()  # temperature > 0: the section checks it
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
        if cfg.distributed_optimizer and not torch.cuda.is_available():
            raise ValueError(
                "trainer.distributed_optimizer needs CUDA (Megatron rejects CPU parameters); "
                "set it false on this machine"
            )
        ep = ps.get_expert_model_parallel_world_size()
        if ep > 1 and (not arch.is_moe or arch.num_experts % ep):
            raise ValueError(
                f"trainer.ep={ep} needs an MoE model whose experts split evenly over it; "
                f"{arch.family} has {arch.num_experts} experts"
            )
        chunks = build_model(arch, dtype=dtype, sequence_parallel=cfg.sequence_parallel)
        if hf_path is not None:
            load_hf_weights(chunks, hf_path, arch)
        model = chunks[0]
        model.config.finalize_model_grads_func = finalize_model_grads  # TP-replicated grads (q/k norms)
        dist_opt = cfg.distributed_optimizer
        self.ddp = DistributedDataParallel(
            model.config, DistributedDataParallelConfig(use_distributed_optimizer=dist_opt), model
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=cfg.lr,
                weight_decay=cfg.weight_decay,
                clip_grad=cfg.clip_grad,
                bf16=dtype == torch.bfloat16,
                fp16=False,
                use_distributed_optimizer=dist_opt,
            ),
            [self.ddp],
        )
        start, _ = pp_layer_range(
            arch.num_layers, ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        )
        self.qat = install_qat(
            [_unwrap(model)], arch, policy, cfg.qat_mode, [start], tp_group=ps.get_tensor_model_parallel_group()
        )
        self.routing = RoutingReplay(_unwrap(model), arch, start, replay_enabled(cfg.routing_replay, arch))
        self.qat.routing_replay = self.routing  # expert-site guidance names slots by the rollout's ids
        self._ep_group = ps.get_expert_model_parallel_group() if ps.get_expert_model_parallel_world_size() > 1 else None

    @property
    def chunks(self) -> list:
        return [self.ddp]

    # -- batching ------------------------------------------------------------------------------
    def _micro_batches(self, samples: list[Sample]) -> tuple[list[_MicroBatch], int]:
        mbs = self.cfg.micro_batch_size
        seq = max(len(s.tokens) - 1 for s in samples)
        if self.cfg.sequence_parallel:  # SP splits the sequence over TP: pad it to a multiple of TP
            from megatron.core import parallel_state as ps

            tp = ps.get_tensor_model_parallel_world_size()
            seq = -(-seq // tp) * tp
        out = []
        for i in range(0, len(samples), mbs):
            part = samples[i : i + mbs]
            ids = torch.zeros(mbs, seq, dtype=torch.long)
            labels = torch.zeros(mbs, seq, dtype=torch.long)
            mask = torch.zeros(mbs, seq)
            lp = torch.zeros(mbs, seq)
            adv = torch.zeros(mbs, seq)
            for j, s in enumerate(part):
                t = torch.tensor(s.tokens)
                n, p = len(t) - 1, len(s.prompt_ids)
                if len(s.rollout_logprobs) != len(s.response_ids):
                    raise ValueError(
                        f"sample {s.sample_id}: {len(s.rollout_logprobs)} rollout logprobs "
                        f"for {len(s.response_ids)} response tokens"
                    )
                ids[j, :n], labels[j, :n] = t[:-1], t[1:]
                mask[j, p - 1 : n] = 1
                lp[j, p - 1 : n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
                adv[j, p - 1 : n] = s.advantage
                if s.guidance is not None:
                    s.guidance.validate(n)
            records = [s.guidance for s in part] + [None] * (mbs - len(part))
            guidance = MicroBatchGuidance(records, seq) if any(r is not None for r in records) else None
            pad = [None] * (mbs - len(part))
            out.append(
                _MicroBatch(
                    ids,
                    labels,
                    mask,
                    lp,
                    adv,
                    guidance,
                    len(part),
                    [s.routed_experts for s in part] + pad,
                    [s.sample_id for s in part] + pad,
                )
            )
        return out, seq

    def _run(self, micro: list[_MicroBatch], seq: int, forward_only: bool, loss_cfg: AlgoConfig | None, total: float):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        vocab = self.arch.vocab_size
        pos = torch.arange(seq).expand(self.cfg.micro_batch_size, seq)
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            self.qat.guidance = mb.guidance
            if mb.guidance is not None:
                assert_same_micro_batch(mb.ids, self._ep_group)
            self.routing.begin(mb.routed, mb.names, seq)
            out = model(mb.ids, pos, causal)

            def loss_func(logits):
                tok_lp = self._token_logprobs(logits[..., :vocab], mb.labels)
                if forward_only:
                    return torch.zeros(()), {"logp": tok_lp.detach().clone()}
                m = mb.resp_mask.flatten()
                loss, metrics = policy_loss(tok_lp.flatten(), mb.rollout_lp.flatten(), mb.adv.flatten(), m, loss_cfg)
                # Sum over tokens / the batch's response tokens; the schedule divides by #micro-batches.
                scaled = loss * len(micro) / total
                metrics = {k: torch.tensor(v * float(m.sum())) for k, v in metrics.items()}
                metrics["loss_sum"] = loss.detach().clone()
                metrics["tokens"] = m.sum()
                metrics["logp"] = tok_lp.detach().clone()
                return scaled, metrics

            return out, loss_func

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=self.chunks,
            num_microbatches=len(micro),
            seq_length=seq,
            micro_batch_size=self.cfg.micro_batch_size,
            forward_only=forward_only,
        )

    def _token_logprobs(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """logp of each label under the rollout's sampling distribution (temperature, then the
        top-k/top-p support renormalized: the rollout records exactly this)."""
        c = self.sampling
        logp = torch.log_softmax(logits.float() / c.temperature, dim=-1)
        if not needs_filter(c.top_k, c.top_p, 0.0, logp.shape[-1]):
            return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        flat, tok = logp.flatten(0, -2), labels.flatten()
        with torch.no_grad():
            keep = keep_mask(flat.exp(), c.top_k, c.top_p)
        return support_logprob(flat, tok, keep).view_as(labels)

    # -- public --------------------------------------------------------------------------------
    def compute_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Per sample, the trainer's logprob of each response token (fp32), on every rank."""

        micro, seq = self._micro_batches(samples)
        self.ddp.eval()
        try:
            with torch.no_grad():
                store = self._run(micro, seq, True, None, 1.0)
        finally:
            self.ddp.train()
            self.qat.guidance = None
            self.routing.end()
        return self._response_logprobs(store, micro, seq, samples)

    def _response_logprobs(self, store, micro, seq, samples) -> list[torch.Tensor]:
        from megatron.core import parallel_state as ps

        if ps.is_pipeline_last_stage():
            full = torch.cat([d["logp"] for d in store])
        else:
            full = torch.empty(len(micro) * self.cfg.micro_batch_size, seq)
        _broadcast_from_last_stage(full)
        return [full[i, len(s.prompt_ids) - 1 : len(s.tokens) - 1].clone() for i, s in enumerate(samples)]

    def train_step(self, samples: list[Sample], loss_cfg: AlgoConfig) -> tuple[dict[str, float], list[torch.Tensor]]:
        """One optimizer step; returns its metrics and the trainer's pre-update response logprobs
        (the same forward the loss used: what mismatch metrics compare with the rollout's)."""
        from megatron.core import parallel_state as ps

        micro, seq = self._micro_batches(samples)
        total = float(sum(len(s.response_ids) for s in samples))
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        try:
            store = self._run(micro, seq, False, loss_cfg, max(total, 1.0))
        finally:
            self.qat.guidance = None
            self.routing.end()
        ok, grad_norm, _ = self.optimizer.step()
        sums = torch.zeros(6)
        if ps.is_pipeline_last_stage() and store:
            keys = ("loss_sum", "clipped_frac", "is_clipped_frac", "masked_frac", "ratio_mean", "tokens")  # summed
            sums = torch.tensor([sum(float(d[k]) for d in store) for k in keys])
        _broadcast_from_last_stage(sums)
        n = max(float(sums[5]), 1.0)
        metrics = {
            "loss": float(sums[0]) / n,
            "clipped_frac": float(sums[1]) / n,
            "is_clipped_frac": float(sums[2]) / n,
            "masked_frac": float(sums[3]) / n,
            "ratio_mean": float(sums[4]) / n,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "update_ok": bool(ok),
        }
        return metrics, self._response_logprobs(store, micro, seq, samples)

    def routing_agreement(self) -> dict[str, float]:
        """routing_agreement / routing_replayed since the last `routing.clear_counters()` (collective over PP)."""
        from megatron.core import parallel_state as ps

        return self.routing.agreement(ps.get_pipeline_model_parallel_group())

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, root: str | os.PathLike, step: int, extra: dict | None = None) -> Path:
        """Write root/step_N atomically: every rank writes into step_N.tmp, then rank 0 renames it
        and points root/latest at it. A crash mid-save leaves the previous checkpoint as latest."""
        root = Path(root)
        final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        torch.save(
            {
                "model": _unwrap(self.ddp).state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "rng": torch.get_rng_state(),
            },
            tmp / f"rank_{rank:05d}.pt",
        )
        faults.hit("checkpoint.shard_written", step=step, rank=rank)
        _barrier()
        if rank == 0:
            (tmp / "meta.json").write_text(json.dumps({"step": step, "world_size": _world(), **(extra or {})}))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            latest_tmp = root / "latest.tmp"
            latest_tmp.write_text(final.name)
            os.replace(latest_tmp, root / "latest")
        _barrier()
        return final

    def load_checkpoint(self, root: str | os.PathLike) -> dict:
        """Load root/latest; returns its meta (step and what the caller stored)."""
        root = Path(root)
        pointer = root / "latest"
        if not pointer.exists():
            raise FileNotFoundError(f"no checkpoint under {root} (missing 'latest')")
        ckpt = root / pointer.read_text().strip()
        meta = json.loads((ckpt / "meta.json").read_text())
        if meta.get("world_size") != _world():
            raise ValueError(f"checkpoint {ckpt} was saved by {meta.get('world_size')} ranks; this run has {_world()}")
        rank = dist.get_rank() if dist.is_initialized() else 0
        try:
            state = torch.load(ckpt / f"rank_{rank:05d}.pt", weights_only=False)
        except Exception as e:
            raise ValueError(f"checkpoint shard {ckpt}/rank_{rank:05d}.pt is unreadable: {e}") from None
        _unwrap(self.ddp).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        return meta


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_from_last_stage(t: torch.Tensor) -> None:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_pipeline_model_parallel_group()
        dist.broadcast(t, src=dist.get_global_rank(group, dist.get_world_size(group) - 1), group=group)
