"""The actor: FP4-aware logprob recompute and the policy update on Megatron-Core.

    samples (prompt, response, rollout logprobs, advantage, guidance record, routed experts)
      ─► batching.plan: packed THD streams under a token budget (or the padded reference layout),
         dealt over data-parallel ranks, each sample split in zigzag halves over context parallel
      ─► Megatron pipeline schedule; before each micro-batch's forward (and again before its
         backward, for a recomputed forward) the QAT state and routing replay get that
         micro-batch's guidance and routed experts, laid out in its rows
      ─► the last hidden states of the response rows ─► logprobs.chunked_logprobs: logp of each
         response token at the rollout's temperature and top-k/top-p, vocab-parallel over TP, a
         chunk of logits at a time (and the policy's entropy)
      ─► (train) policy loss summed over response tokens / all response tokens of the batch,
         STE backward, DDP/TP grad reduction, grad clipping, Adam step
Every rank passes the same samples; logprobs come back on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_trace.config import AlgoConfig, RolloutConfig, TrainerConfig
from megatron_trace.kernels import cpu_alloc
from megatron_trace.models import ModelArch, QuantPolicy, pp_layer_range
from megatron_trace.rl import Sample, policy_loss

from . import checkpoint
from .batching import MicroBatch, Partition, plan
from .gpt import _unwrap, build_model, load_hf_weights
from .logprobs import VocabSpec, chunked_logprobs
from .qat import install_qat
from .routing_replay import RoutingReplay, assert_same_micro_batch, replay_enabled

__all__ = ["Actor", "TrainStepResult"]
log = logging.getLogger(__name__)
_SUMMED = ("loss_sum", "clipped_frac", "is_clipped_frac", "masked_frac", "ratio_mean", "entropy", "tokens")


@dataclass
class TrainStepResult:
    """What one optimizer step reports: its `train/` metrics, the trainer's pre-update logprobs of
    every response token (the same forward the loss used: what mismatch metrics compare with the
    rollout's), the step's time split, and what its QAT and routing did (per site / layer)."""

    metrics: dict[str, float]  # loss, clipped fractions, ratio mean, entropy, grad_norm, update_ok, ...
    logprobs: list[torch.Tensor]
    times: dict[str, float]  # seconds: recompute (the QAT forward + logprobs), backward, optimizer
    codeword_agreement: dict[str, float]  # site -> share of the trainer's codes equal to the rollout's
    guidance_override: dict[str, float]  # site -> share guided rounding moved off round-to-nearest
    routing: dict[str, float]  # MoE: routing_agreement / routing_replayed (empty for dense models)


class _RestoreForBackward(torch.autograd.Function):
    """Identity on a micro-batch's output whose backward runs first in that micro-batch's backward
    pass: it re-binds the micro-batch's guidance and routing before any recomputed forward (under
    1F1B other micro-batches' forwards ran in between)."""

    @staticmethod
    def forward(ctx, x, restore):
        ctx.restore = restore
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.restore()
        return grad, None


class Actor:
    def __init__(
        self,
        arch: ModelArch,
        policy: QuantPolicy,
        cfg: TrainerConfig,
        sampling: RolloutConfig | None = None,
        hf_path=None,
        offload_dir=None,
    ):
        """Call `parallel.init_distributed` first. Loads `hf_path` (an HF checkpoint) when given.
        `cfg` is the run's `trainer` section; `sampling` its `rollout` section, whose temperature and
        top-k/top-p filters define the policy the logprobs are recomputed under (default: plain sampling).
        `offload_dir`: where trainer.optimizer_offload=disk keeps the optimizer state between steps
        (one file per rank)."""
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
        if cfg.optimizer_offload == "disk" and torch.cuda.is_available():  # its buffers are host memory
            raise ValueError(
                "trainer.optimizer_offload=disk keeps a CPU trainer's Adam state on disk; on GPUs shard it "
                "with trainer.distributed_optimizer=true instead (set trainer.optimizer_offload=none)"
            )
        ep = ps.get_expert_model_parallel_world_size()
        if ep > 1 and (not arch.is_moe or arch.num_experts % ep):
            raise ValueError(
                f"trainer.ep={ep} needs an MoE model whose experts split evenly over it; "
                f"{arch.family} has {arch.num_experts} experts"
            )
        cp = ps.get_context_parallel_world_size()
        if cp > 1 and not cfg.packing:
            raise ValueError("trainer.cp > 1 needs packed micro-batches (trainer.packing=true)")
        if cp > 1 and ep > 1:
            raise ValueError(
                "trainer.cp > 1 with trainer.ep > 1 is not supported: expert-site guidance maps the "
                "dispatcher's gathered rows of identical micro-batches, which context parallel halves are not"
            )
        chunks = build_model(arch, dtype=dtype, sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute)
        if hf_path is not None:
            load_hf_weights(chunks, hf_path, arch)
        model = chunks[0]
        model.config.finalize_model_grads_func = finalize_model_grads  # TP-replicated grads (q/k norms)
        dist_opt = cfg.distributed_optimizer
        # bf16 params: grads accumulate and reduce in fp32 (Megatron's advice for bf16), which also
        # lets the optimizer use the fp32 buffer as its main grads instead of copying it
        ddp_cfg = DistributedDataParallelConfig(
            use_distributed_optimizer=dist_opt, grad_reduce_in_fp32=dtype == torch.bfloat16
        )
        self.ddp = DistributedDataParallel(model.config, ddp_cfg, model)
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
        self.lr_scheduler = None
        if cfg.lr_warmup_steps:
            from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

            # constant after the warmup; its first update already moves (lr/N), unlike init_lr=0
            self.lr_scheduler = OptimizerParamScheduler(
                self.optimizer,
                init_lr=0.0,
                max_lr=cfg.lr,
                min_lr=cfg.lr,
                lr_warmup_steps=cfg.lr_warmup_steps,
                lr_decay_steps=cfg.lr_warmup_steps + 1,
                lr_decay_style="constant",
                start_wd=cfg.weight_decay,
                end_wd=cfg.weight_decay,
                wd_incr_steps=1,
                wd_incr_style="constant",
            )
            self.lr_scheduler.step(1)
        self.offload = None
        if cfg.optimizer_offload == "disk":
            if offload_dir is None:
                raise ValueError("trainer.optimizer_offload=disk needs a directory for the state (the run dir)")
            from .offload import OptimizerStateOffload

            rank = dist.get_rank() if dist.is_initialized() else 0
            self.offload = OptimizerStateOffload(
                self.optimizer,
                Path(offload_dir) / f"optimizer_state.rank{rank}.bin",
                window_bytes=int(cfg.optimizer_offload_window_mb * 2**20),
                keep_bytes=int(cfg.optimizer_offload_keep_mb * 2**20),
            )
        start, _ = pp_layer_range(
            arch.num_layers, ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        )
        self.qat = install_qat(
            [_unwrap(model)], arch, policy, cfg.qat_mode, [start], tp_group=ps.get_tensor_model_parallel_group()
        )
        self.routing = RoutingReplay(_unwrap(model), arch, start, replay_enabled(cfg.routing_replay, arch))
        self.qat.routing_replay = self.routing  # expert-site guidance names slots by the rollout's ids
        self._ep_group = ps.get_expert_model_parallel_group() if ep > 1 else None
        # Data-parallel ranks split the micro-batches, except under expert parallelism, whose expert
        # guidance needs every rank of the EP group to hold the same micro-batch.
        dp = ps.get_data_parallel_world_size()
        tp = ps.get_tensor_model_parallel_world_size()
        shards = dp if ep == 1 else 1
        self.part = Partition(
            shards,
            ps.get_data_parallel_rank() if shards > 1 else 0,
            cp,
            ps.get_context_parallel_rank(),
            tp if cfg.sequence_parallel and tp > 1 else 1,
            ps.get_pipeline_model_parallel_world_size() > 1,
        )
        # DDP averages grads over the data x context parallel ranks; the loss is a sum over the data
        # shards (Megatron's schedule already multiplies each rank's loss by the CP size)
        self._grad_replicas = shards
        self._combine = (
            ps.get_data_parallel_group(with_context_parallel=True)
            if shards > 1
            else (ps.get_context_parallel_group() if cp > 1 else None)
        )
        # a CPU trainer returns freed heap before the embedding's backward too (see _run): its dense
        # [V, H] weight grad is a fresh mapping on top of what the layers' backward freed and kept
        self._trimming = False
        embedding = getattr(_unwrap(model), "embedding", None)
        if embedding is not None and not torch.cuda.is_available():
            embedding.register_forward_hook(self._trim_before_embedding_backward)
        head = _unwrap(model).output_layer if ps.is_pipeline_last_stage() else None
        self.head = head
        if head is not None:
            vocab_local = head.output_size_per_partition
            self.vocab = VocabSpec(
                ps.get_tensor_model_parallel_rank() * vocab_local,
                arch.vocab_size,
                self.sampling.temperature,
                self.sampling.top_k,
                self.sampling.top_p,
                chunk_bytes=int(cfg.logprob_chunk_mb * (1 << 20)),
                keep_logits_bytes=int(cfg.logprob_keep_logits_mb * (1 << 20)),
                group=ps.get_tensor_model_parallel_group() if tp > 1 else None,
            )

        # seconds of the last train_step: recompute (the QAT forward + logprobs), backward, optimizer
        self.step_times: dict[str, float] = {}
        # called after each part of train_step ("forward_backward", "optimizer"): the run's memory marks
        self.on_part_done = None
        self._restored: MicroBatch | None = None  # the micro-batch whose backward runs (recompute)

    def _trim_before_embedding_backward(self, _module, _inputs, out: torch.Tensor) -> None:
        if self._trimming and out.requires_grad:

            def trim(_grad: torch.Tensor) -> None:  # the grad passes unchanged
                cpu_alloc.return_freed_memory(collect=False)

            out.register_hook(trim)

    @property
    def chunks(self) -> list:
        return [self.ddp]

    # -- one pass over the micro-batches --------------------------------------------------------
    def _plan(self, samples: list[Sample], forward_only: bool) -> list[MicroBatch]:
        c = self.cfg
        budget = c.max_tokens_per_logprob_microbatch if forward_only else c.max_tokens_per_microbatch
        return plan(samples, packed=c.packing, budget=budget, batch=c.micro_batch_size, part=self.part)

    def _bind(self, mb: MicroBatch, recomputing: bool) -> None:
        if recomputing:  # backward runs micro-batches in forward order: the previous one is done
            if self._restored is not None and self._restored.guidance is not None:
                self._restored.guidance.release()
            self._restored = mb
        self.qat.set_micro_batch(mb.guidance, mb.layout.row_positions())
        self.qat.recomputing = self.routing.recomputing = recomputing
        self.routing.begin(mb.routed, mb.names, mb.layout.placements, mb.layout.ids.numel())

    def _run(self, micro: list[MicroBatch], forward_only: bool, loss_cfg: AlgoConfig | None, total: float):
        from megatron.core.packed_seq_params import PackedSeqParams
        from megatron.core.pipeline_parallel import get_forward_backward_func

        recompute = self.cfg.recompute != "none" and not forward_only
        # A CPU trainer gives the heap's freed memory back before each micro-batch, before its
        # backward and before the embedding's backward. The engine's heap policy
        # (kernels/cpu_alloc.keep_freed_memory) keeps what is freed, and the head's backward takes two
        # fresh 0.5 GiB mappings (the real 0.5B's fp32 weight grad and product), the embedding's
        # backward a 0.25 GiB one (its dense bf16 grad), that cannot reuse it: the forward's freed
        # activations sat under the first, the layers' backward's under the last, and the kept heap
        # grew micro-batch by micro-batch (the real config's forward/backward 2.4-2.8 GiB over the
        # trainer's state in benchmarks/train_phase.py's batch; with the first two trims 1.7, for 1-2 s
        # more of its ~76; the embedding's grad on the layers' kept heap was then the peak).
        trim = not forward_only and not torch.cuda.is_available()
        self._trimming = trim

        def forward_step(data_iterator, model):
            t0 = time.perf_counter()
            if trim:
                cpu_alloc.return_freed_memory(collect=False)
            mb = next(data_iterator)
            self._bind(mb, False)
            lay = mb.layout
            if mb.guidance is not None:
                assert_same_micro_batch(lay.ids, self._ep_group)
            if lay.packed:
                packed = PackedSeqParams(
                    qkv_format="thd",
                    cu_seqlens_q=lay.cu_seqlens,
                    cu_seqlens_kv=lay.cu_seqlens,
                    max_seqlen_q=lay.max_seqlen,
                    max_seqlen_kv=lay.max_seqlen,
                )
                out = model(lay.ids, lay.positions, None, packed_seq_params=packed)
            else:
                s = lay.ids.shape[1]
                causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
                out = model(lay.ids, lay.positions, causal)
            if recompute:
                out = _RestoreForBackward.apply(out, lambda: self._bind(mb, True))
            elif mb.guidance is not None:
                mb.guidance.release()  # nothing reads it again: free its device copy now
            forward_s[0] += time.perf_counter() - t0

            def loss(hidden):
                t1 = time.perf_counter()
                try:
                    return self._loss(mb, hidden, forward_only, loss_cfg, len(micro), total)
                finally:
                    if trim:  # the forward is done; its backward follows
                        cpu_alloc.return_freed_memory(collect=False)
                    forward_s[0] += time.perf_counter() - t1

            return out, loss

        forward_s = [0.0]
        self._restored = None

        s = max(m.layout.ids.shape[1] for m in micro)
        if self.head is not None:
            self.head.emit_hidden = True  # the loss forms the logits chunk by chunk
        t_run = time.perf_counter()
        try:
            store = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro),
                model=self.chunks,
                num_microbatches=len(micro),
                seq_length=s,
                micro_batch_size=micro[0].layout.ids.shape[0],
                forward_only=forward_only,
            )
            self.step_times = {"recompute": forward_s[0], "backward": time.perf_counter() - t_run - forward_s[0]}
            return store
        finally:
            self._trimming = False
            if self.head is not None:
                self.head.emit_hidden = False
            for mb in micro:
                if mb.guidance is not None:
                    mb.guidance.release()
            self.qat.set_micro_batch(None, None)
            self.qat.recomputing = self.routing.recomputing = False
            self.routing.end()

    def _loss(self, mb: MicroBatch, hidden, forward_only: bool, loss_cfg, n_micro: int, total: float):
        """Response-token logprobs from the last hidden states [B, S, H]; the policy loss."""
        rows = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])  # Megatron's row order s*B + b
        labels = mb.layout.labels.t().reshape(-1)[mb.resp_rows]
        if len(mb.resp_rows):
            tok_lp, ent = chunked_logprobs(rows[mb.resp_rows], self.head.head_weight, labels, self.vocab)
        else:  # a filler micro-batch: nothing to score, but the schedule backpropagates its loss
            tok_lp, ent = rows[:0, 0] * 0, torch.zeros(0)
        out = {
            "logp": tok_lp.detach().clone(),
            "entropy": ent.sum().detach(),
            "tokens": torch.tensor(float(len(labels))),
        }
        if forward_only:
            return torch.zeros(()), out
        ones = torch.ones_like(mb.rollout_lp)
        loss, metrics = policy_loss(tok_lp, mb.rollout_lp, mb.adv, ones, loss_cfg)
        # Sum over tokens / the batch's response tokens; the schedule divides by #micro-batches
        # (and multiplies by the CP size), DDP averages over the data x context parallel ranks.
        scaled = (loss if len(labels) else rows.sum() * 0.0) * n_micro * self._grad_replicas / total
        out.update({k: torch.tensor(v * len(labels)) for k, v in metrics.items()})
        out["loss_sum"] = loss.detach().clone()
        return scaled, out

    def _gather(self, store, micro: list[MicroBatch], samples: list[Sample]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(per sample, the trainer's logprob of each response token; the summed metrics), on every
        rank: filled by the ranks that computed them, summed over data/context parallel ranks, sent
        from the last pipeline stage."""
        from megatron.core import parallel_state as ps

        sizes = [len(s.response_ids) for s in samples]
        starts = torch.tensor([0] + sizes).cumsum(0)
        flat = torch.zeros(int(starts[-1]) + len(_SUMMED))
        if ps.is_pipeline_last_stage():
            for mb, d in zip(micro, store):
                flat[starts[mb.resp_sample] + mb.resp_offset] = d["logp"].float()
                for j, k in enumerate(_SUMMED):
                    flat[int(starts[-1]) + j] += float(d.get(k, 0.0))
        if self._combine is not None:
            dist.all_reduce(flat, group=self._combine)
        _broadcast_from_last_stage(flat)
        lps = [flat[int(a) : int(b)].clone() for a, b in zip(starts[:-1], starts[1:])]
        return lps, flat[int(starts[-1]) :]

    # -- public --------------------------------------------------------------------------------
    def compute_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Per sample, the trainer's logprob of each response token (fp32), on every rank."""
        micro = self._plan(samples, True)
        self.ddp.eval()
        try:
            with torch.no_grad():
                store = self._run(micro, True, None, 1.0)
        finally:
            self.ddp.train()
        return self._gather(store, micro, samples)[0]

    def train_step(self, samples: list[Sample], loss_cfg: AlgoConfig) -> TrainStepResult:
        """One optimizer step on `samples` (guidance as records, not store handles). Collective: every
        rank passes the same samples and gets the same result."""
        self.qat.clear_counters()
        self.routing.clear_counters()
        micro = self._plan(samples, False)
        total = float(sum(len(s.response_ids) for s in samples))
        self.ddp.zero_grad_buffer()
        self._optimizer().zero_grad()
        store = self._run(micro, False, loss_cfg, max(total, 1.0))
        if self.on_part_done is not None:
            self.on_part_done("forward_backward")
        t_opt = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]
        # trainer.optimizer_offload=disk: Adam's state streams from its file and back, a parameter at a time
        with self.offload.stepping() if self.offload is not None else contextlib.nullcontext():
            ok, grad_norm, _ = self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step(1)
        self.step_times["optimizer"] = time.perf_counter() - t_opt
        if self.offload is not None:  # part of the optimizer's seconds, also on its own
            self.step_times["optimizer_offload"] = self.offload.take_seconds()
        if self.on_part_done is not None:
            self.on_part_done("optimizer")
        lps, sums = self._gather(store, micro, samples)
        s = dict(zip(_SUMMED, sums.tolist()))
        n = max(s.pop("tokens"), 1.0)
        metrics = {"loss": s.pop("loss_sum") / n, **{k: v / n for k, v in s.items()}}
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["update_ok"] = bool(ok)
        metrics["micro_batches"] = float(len(micro))
        metrics["lr"] = float(lr)
        return TrainStepResult(
            metrics,
            lps,
            dict(self.step_times),
            self.qat.agreement(),
            self.qat.override_rate(),
            self.routing_agreement(),  # collective over PP: every rank
        )

    def routing_agreement(self) -> dict[str, float]:
        """routing_agreement / routing_replayed since the last `routing.clear_counters()` (collective over PP)."""
        from megatron.core import parallel_state as ps

        return self.routing.agreement(ps.get_pipeline_model_parallel_group())

    def finish_training(self) -> None:
        """Drops what only further steps need: the optimizer's fp32 main params and Adam state (6 GB
        for a 0.5B model in bf16; the last checkpoint holds them). The weights stay for gathers and
        exports; train_step and save_checkpoint refuse afterwards."""
        self.optimizer = None
        if self.offload is not None:
            self.offload.close()
            self.offload = None

    def _state_resident(self):
        """The optimizer state in memory inside the block (trainer.optimizer_offload=disk: read back
        before, written out and freed after)."""
        return self.offload.resident() if self.offload is not None else contextlib.nullcontext()

    def _optimizer(self):
        if self.optimizer is None:
            raise RuntimeError("the actor's training is finished (finish_training dropped its optimizer)")
        return self.optimizer

    # -- checkpoints (trainer/checkpoint.py) --------------------------------------------------------
    def save_checkpoint(self, root: str | os.PathLike, step: int, extra: dict | None = None) -> Path:
        optimizer = self._optimizer()
        with self._state_resident():
            saved = checkpoint.save(
                root,
                step,
                _unwrap(self.ddp),
                optimizer,
                extra,
                keep=self.cfg.keep_checkpoints,
                scheduler=self.lr_scheduler,
            )
        if self.offload is not None:  # the save's own time holds its reload and write-back
            self.offload.take_seconds()
        return saved

    def load_checkpoint(self, root: str | os.PathLike) -> dict:
        with self._state_resident():  # the loaded state replaces the stored one, then goes to disk
            return checkpoint.load(root, _unwrap(self.ddp), self.optimizer, scheduler=self.lr_scheduler)


def _broadcast_from_last_stage(t: torch.Tensor) -> None:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_pipeline_model_parallel_group()
        dist.broadcast(t, src=dist.get_global_rank(group, dist.get_world_size(group) - 1), group=group)
