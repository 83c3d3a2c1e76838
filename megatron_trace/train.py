"""`python -m megatron_trace.train --config FILE [--resume] [section.key=value ...]`: one RL run.

    config ─► warm start (cached) ─► Megatron actor + rollout backend + guidance store
           ─► for each step: rollout ─► train ─► transfer weights ─► log ─► checkpoint
           ─► summary (reward before/after, mismatch, time split)
Multi-process (`torchrun --nproc-per-node N -m megatron_trace.train ... trainer.tp=2`): rank 0
owns the rollout, data, store and logs; every rank trains.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_trace import faults
from megatron_trace.run import console

console.quiet_third_party()  # before the imports below pull in Megatron, which warns at import time

from megatron_trace.config import Config, describe, parse_cli  # noqa: E402
from megatron_trace.kernels import cpu_alloc  # noqa: E402
from megatron_trace.perf.memory import peak_rss, resident_gib  # noqa: E402
from megatron_trace.run.checks import check_debiased_server, check_server_versions  # noqa: E402
from megatron_trace.run.metrics import (  # noqa: E402
    JsonlLogger,
    MetricsHub,
    TensorBoardLogger,
    mismatch_scalars,
    resumed_part,
    run_summary,
)
from megatron_trace.run.step import Rollout, RolloutBatch, StepRunner, async_executor, share_batch  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m megatron_trace.train",
        description=__doc__.splitlines()[0],
        epilog="config keys:\n" + describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--resume", action="store_true", help="continue from <run_dir>/checkpoints/latest")
    cfg, args = parse_cli(ap, argv)
    return cfg, args.resume


def _return_freed_memory(what: str) -> None:
    """A phase's freed heap back to the system before the trainer allocates (cpu_alloc: the engine's
    allocator policy keeps it resident otherwise, and the 0.5B trainer needs those GB)."""
    freed = cpu_alloc.return_freed_memory()
    if freed >= 2**20:
        print(f"memory: {freed / 2**30:.2f} GiB freed by {what} returned to the system", flush=True)


def _check_checkpoint_dirs(cfg: Config) -> None:
    """A named checkpoint that is not there stops the run here, before any process group waits on it."""
    for key, path, needs in (
        ("model.path", cfg.model.path, "config.json"),
        ("model.tokenizer", cfg.model.tokenizer, ""),
    ):
        if not path or path == "char":
            continue
        if not (Path(path) / needs).exists() if needs else not Path(path).exists():
            raise FileNotFoundError(
                f"{key}={path}: no HF checkpoint directory there (wanted {needs or 'a tokenizer directory'}). Give "
                f"{key}=DIR of a Qwen2/2.5/3 HF checkpoint; `python -m megatron_trace.models.real_qwen` builds "
                "Qwen2.5-Coder-0.5B-Instruct into ~/.cache/megatron_trace/qwen2.5-coder-0.5b/hf_bf16"
            )


class Run:
    def __init__(self, cfg: Config, resume: bool):
        from megatron_trace.data import CharTokenizer, get_reward_fn, load_tokenizer, prompt_source
        from megatron_trace.models import ModelArch
        from megatron_trace.trainer.actor import Actor
        from megatron_trace.trainer.parallel import init_distributed

        self.cfg, self.t0 = cfg, time.perf_counter()
        self.gate, self.gate_rows = None, []  # the rollout-quality gate's result (rank 0, embedded engine)
        self.run_dir = Path(cfg.logging.run_dir)
        init_distributed(
            tp=cfg.trainer.tp, pp=cfg.trainer.pp, ep=cfg.trainer.ep, seed=cfg.trainer.seed, cp=cfg.trainer.cp
        )
        self.rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if self.rank0:
            print("\n".join(console.plan_lines(cfg)), flush=True)
        _check_checkpoint_dirs(cfg)
        tok = CharTokenizer() if cfg.model.tokenizer == "char" else load_tokenizer(cfg.model.tokenizer)
        prompts = prompt_source(
            cfg.rollout.prompts, seed=cfg.trainer.seed, tokenizer=tok, eval_fraction=cfg.rollout.eval_fraction
        )
        model_path = self._model_path(tok, prompts)
        self.model_path, self.tok = model_path, tok  # the quality measurement after training reads them
        self.arch = ModelArch.from_hf_config(model_path)
        if self.arch.is_moe and cfg.trainer.tp > 1 and not cfg.trainer.sequence_parallel:
            # Megatron's MoELayer raises at the first training forward otherwise (after a whole rollout)
            raise ValueError(
                "an MoE model with trainer.tp > 1 trains only with trainer.sequence_parallel=true "
                "(Megatron-Core's MoELayer refuses TP without it); set it, or use trainer.ep for the "
                "experts with trainer.tp=1"
            )
        if cfg.trainer.memory_check:  # before the model exists: refuse a plan that cannot fit here
            from megatron_trace.perf.memory import check_launch

            check_launch(cfg, str(model_path))
        if self.rank0:
            self._check_rollout_quality(model_path, tok, prompts)
        self.actor = Actor(self.arch, cfg.quant.policy(), cfg.trainer, cfg.rollout, hf_path=model_path)
        self.input_amax = self._static_activation_amax(model_path, tok, prompts)
        self.start_step, self.version = 0, 0
        if resume:
            meta = self.actor.load_checkpoint(self.run_dir / "checkpoints")
            self.start_step, self.version = meta["step"] + 1, meta["version"]
        self.backend = self.rollout = self.store = self.hub = self.transport = None
        self.wire_bytes = 0
        if self.rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            cfg.save(self.run_dir / "config.yaml")
            self.backend = self._backend(model_path)
            self.store = self._store()
            self.rollout = Rollout(
                cfg, self.backend, tok, prompts, get_reward_fn(cfg.rollout.reward), self.arch, store=self.store
            )
            from megatron_trace.transfer.sync import make_transport

            self.transport = make_transport(cfg, self.backend, self.run_dir, self.arch)
            loggers = [JsonlLogger(self.run_dir, append=resume)]
            if cfg.logging.tensorboard:
                loggers.append(TensorBoardLogger(self.run_dir))
            self.hub = MetricsHub(loggers)
        self.runner = StepRunner(cfg, self.actor, self.store, self.rank0)
        if resume or self.version or self.input_amax is not None:
            # the rollout serves what the checkpoint holds; static scales: its input_scale before the first rollout
            self.sync_weights()
        if self.rank0 and cfg.rollout.backend == "http":
            check_server_versions(self.backend, self.version)

    def _model_path(self, tok, prompts) -> Path:
        if self.cfg.model.path:
            return Path(self.cfg.model.path)
        from megatron_trace.run.warm_start import warm_start_for
        from megatron_trace.trainer.comm import broadcast_json

        path = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            path = str(warm_start_for(self.cfg, tok, prompts, log=lambda m: print(m, flush=True)))
        return Path(broadcast_json(path))

    def _static_activation_amax(self, model_path: Path, tok, prompts) -> dict[str, float] | None:
        """quant.activation_scale=static: each FP4-activation linear's input amax, calibrated once on
        quant.calib_prompts training prompts (rank 0, fp32 HF forward of the starting checkpoint; why
        that forward: transfer/static_scales.py), shared with every rank. The trainer's QAT rounds
        with the S_enc it gives and every weight sync sends it as input_scale, so both sides agree."""
        if self.cfg.quant.activation_scale != "static":
            return None
        from megatron_trace.trainer.comm import broadcast_json
        from megatron_trace.transfer.static_scales import calibrate_static_amax, check_calibratable, static_site_scales

        policy = self.cfg.quant.policy()
        check_calibratable(self.arch, policy)  # every rank: none waits below for a rank 0 that refused
        amax = None
        if self.rank0:
            ids = [tok.encode_prompt(p.text) for p in prompts.sample(self.cfg.quant.calib_prompts, 0)]
            amax = calibrate_static_amax(model_path, self.arch, policy, ids)
            print(f"static activation scales: calibrated {len(amax)} linears on {len(ids)} prompts", flush=True)
        amax = broadcast_json(amax)
        self.actor.qat.set_static_activation_scales(static_site_scales(amax, self.arch, policy))
        return amax

    def _check_rollout_quality(self, model_path: Path, tok, prompts) -> None:
        from megatron_trace.quality.gate import gate_run

        self.gate, self.gate_rows = gate_run(self.cfg, model_path, tok, prompts, log=lambda m: print(m, flush=True))
        if self.gate is not None:  # quant.quality_gate=false builds no engines: nothing of theirs to return
            _return_freed_memory("the quality gate's engines")

    def _backend(self, model_path: Path):
        rc = self.cfg.rollout
        if rc.backend == "http":
            from sglang_backend.client import RolloutClient

            client = RolloutClient(rc.urls, api_key=rc.api_key or None)
            if self.cfg.quant.kv_k_debias:  # every server: one caching plain K would mismatch its samples
                for url in client.urls:
                    check_debiased_server(client, url)
            return client
        from sglang_backend.local import Engine, InProcessBackend

        g = self.cfg.guidance
        return InProcessBackend(
            Engine(
                str(model_path),
                dtype=rc.dtype,
                quant_policy=self.cfg.quant.policy(),
                guidance_mode=g.mode,
                guided_layers=g.layers,
                max_running_requests=rc.max_running,
                random_seed=self.cfg.trainer.seed,
            )
        )

    def _store(self):
        from megatron_trace.guidance import GuidanceStore

        g = self.cfg.guidance
        return GuidanceStore(int(g.memory_budget_mb * 2**20), g.spill_dir or str(self.run_dir / "guidance_spill"))

    # -- the step ------------------------------------------------------------------------------
    def sync_weights(self) -> float:
        """Trainer weights -> rollout as the next version; returns seconds."""
        from megatron_trace.transfer.sync import sync_weights

        t = time.perf_counter()
        stats = sync_weights(
            self.actor.chunks, self.arch, self.cfg, self.transport, self.version, input_amax=self.input_amax
        )
        if stats is not None:
            self.wire_bytes = stats.bytes
        if self.backend is not None:  # a rollout server that died is re-admitted at this version
            self.backend.note_version(self.version)
        return time.perf_counter() - t

    def produce(self, step: int) -> RolloutBatch | None:
        if not self.rank0:
            return None
        t = time.perf_counter()
        batch = self.rollout.run(step, self.version)
        batch.stats["rollout_s"] = time.perf_counter() - t
        return batch

    def run(self) -> dict:
        cfg = self.cfg
        steps = range(self.start_step, cfg.trainer.steps)
        evals = {}
        if self.rank0 and self.gate is not None:
            self.hub.log(self.start_step, self.gate.metrics())
            n = cfg.logging.samples_per_step
            self.hub.text(self.start_step, "quality/answers_vs_bf16", self.gate.answers(self.gate_rows, n))
        # a resumed run's summary covers the whole run: its earlier steps and the eval it started with
        history, before = resumed_part(self.run_dir, self.start_step) if self.rank0 and self.start_step else ([], None)
        if before is not None:
            evals["before"] = before
        elif self.rank0 and cfg.rollout.eval_prompts:
            evals["before"], shown = self.rollout.evaluate(cfg.rollout.eval_prompts)
            self.hub.log(self.start_step, evals["before"])
            self.hub.text(self.start_step, "eval/answers_before", shown)
        pool = async_executor() if cfg.algo.async_rollout and self.rank0 else None
        pending = pool.submit(self.produce, steps.start) if pool and len(steps) else None
        bar = console.progress_bar(len(steps), self.rank0 and cfg.logging.progress)
        totals = {k: sum(h.get(f"perf/{k}", 0.0) for h in history) for k in ("rollout_s", "train_s", "transfer_s")}
        for step in steps:
            t_step = time.perf_counter()
            batch = pending.result() if pending else self.produce(step)
            if pool and step + 1 < cfg.trainer.steps:
                pending = pool.submit(self.produce, step + 1)  # overlaps this step's training
            batch = share_batch(batch, self.store)
            faults.hit("rollout.done", step=step)
            t = time.perf_counter()
            out, deltas = self.runner.train(batch, self.version)
            train_s = time.perf_counter() - t
            faults.hit("train.done", step=step)
            self.version += 1
            transfer_s = self.sync_weights()
            if self.rank0:
                # the step's freed heap back before the next rollout: the engine's allocator policy
                # (cpu_alloc) keeps it, and kept, the 0.5B config's resident size grew 0.3-0.5 GiB a
                # step with an FP4 rollout; trimmed, 0.04 GiB a step over 12 steps (2-6 GiB returned a step)
                out["perf/heap_returned_gib"] = cpu_alloc.return_freed_memory() / 2**30
                metrics = self._metrics(batch, out, deltas, train_s, transfer_s, time.perf_counter() - t_step)
                history.append(metrics)
                for k in totals:
                    totals[k] += metrics[f"perf/{k}"]
                bar.set_postfix(
                    reward=f"{metrics['rollout/reward_mean']:.2f}",
                    dlogp=f"{metrics.get('mismatch/mean_abs_dlogp', 0):.3f}",
                )
                bar.update(1)
            if cfg.trainer.save_every and (step + 1) % cfg.trainer.save_every == 0 or step + 1 == cfg.trainer.steps:
                self.actor.save_checkpoint(self.run_dir / "checkpoints", step, {"version": self.version})
        bar.close()
        if pool:
            pool.shutdown(wait=True)
        if self.rank0 and cfg.rollout.eval_prompts:
            evals["after"], shown = self.rollout.evaluate(cfg.rollout.eval_prompts)
            self.hub.log(cfg.trainer.steps, evals["after"])
            self.hub.text(cfg.trainer.steps, "eval/answers_after", shown)
        if cfg.quant.quality_after:
            from megatron_trace.trainer.comm import broadcast_json

            if broadcast_json(self.gate is not None):  # rank 0 knows whether its gate measured anything
                self._release_training_state()
                self._quality_after()
        return self._summary(history, evals, totals)

    def _release_training_state(self) -> None:
        """The measurement after training builds two engines of its own; what the steps held is done
        with: the optimizer (the last checkpoint holds it) and, after its eval, the rollout engine.
        The 0.5B config's run peaked at 23 GiB of its 24 GB box in this phase otherwise."""
        self.actor.finish_training()
        if self.backend is not None:
            self.backend.close()
        self.backend = self.rollout = self.transport = None
        _return_freed_memory("the optimizer and the rollout engine")

    def _quality_after(self) -> None:
        """The gate's prompts again on the trained weights (gathered from every rank, exported BF16)."""
        from megatron_trace.quality.gate import measure_after
        from megatron_trace.transfer.gather import iter_hf_params

        hf_sd = {}
        for name, t in iter_hf_params(self.actor.chunks, self.arch):  # collective: every rank iterates
            if self.rank0:
                hf_sd[name] = t.to(torch.bfloat16)
        if self.rank0:
            res = measure_after(self.cfg, self.model_path, self.run_dir, hf_sd, self.gate_rows, self.tok, log=print)
            steps, n = self.cfg.trainer.steps, self.cfg.logging.samples_per_step
            self.hub.log(steps, res.metrics())
            self.hub.text(steps, "quality/answers_vs_bf16", res.answers(self.gate_rows, n))

    def _metrics(self, batch, out, deltas, train_s, transfer_s, step_s) -> dict:
        rewards = [s["reward"] for s in batch.samples]
        tokens = sum(len(s["response"]) for s in batch.samples)
        m = {
            "rollout/reward_mean": sum(rewards) / max(len(rewards), 1),
            "rollout/response_len_mean": tokens / max(len(rewards), 1),
            "rollout/weight_version": batch.version,
            "rollout/samples": len(rewards),
        }
        m.update({f"rollout/{k}": v for k, v in batch.stats.items() if k != "rollout_s"})
        m.update({k: v for k, v in out.items() if not k.startswith("_")})
        if "_mismatch" in out:
            recs = out["_records"]
            bpt = sum(r.nbytes() for r in recs) / max(sum(r.num_positions for r in recs), 1)
            m.update(
                mismatch_scalars(out["_mismatch"], self.actor.qat.agreement(), bpt, self.actor.qat.override_rate())
            )
            d = torch.cat(deltas) if deltas else torch.zeros(0)
            self.hub.histogram(batch.step, "mismatch/abs_dlogp", d.abs())
            self.hub.histogram(batch.step, "mismatch/importance_ratio", d.exp())
        st = self.store.stats() if self.store is not None else {}
        m.update(
            {
                "perf/rollout_s": batch.stats.get("rollout_s", 0.0),
                "perf/train_s": train_s,
                "perf/transfer_s": transfer_s,
                "perf/step_s": step_s,
                "perf/transfer_wire_bytes": self.wire_bytes,
                "perf/rollout_tokens_per_s": tokens / max(batch.stats.get("rollout_s", 1e-9), 1e-9),
                "perf/guidance_spilled_bytes": st.get("bytes_spilled_total", 0),
                "perf/guidance_bytes_per_token": st.get("bytes_per_token", 0.0),
                # this process (rank 0: engine and trainer): resident now and its peak so far
                "perf/rss_gib": resident_gib(),
                "perf/peak_rss_gib": peak_rss(),
            }
        )
        self.hub.log(batch.step, m)
        self.hub.text(batch.step, "rollout/samples", batch.shown)
        return m

    def _summary(self, history, evals, totals) -> dict:
        if not self.rank0:
            return {}
        summary = run_summary(history, evals, totals, wall_s=time.perf_counter() - self.t0)
        self.hub.close()
        if self.store is not None:
            self.store.close()
        if self.backend is not None:  # the engine, or the client's probes of dead servers
            self.backend.close()
        return summary


def main(argv=None) -> int:
    cfg, resume = parse_args(argv)
    from megatron_trace.trainer.parallel import destroy

    try:
        run = Run(cfg, resume)
        summary = run.run()
        if run.rank0:
            console.print_summary(summary)
            import json

            (Path(cfg.logging.run_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
    finally:
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
