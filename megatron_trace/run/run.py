"""One RL run: its parts, built once, and its steps.

    config ─► tokenizer, prompts ─► the starting checkpoint (warm start, cached) and its arch
           ─► the quantization policy, resolved once for that arch (saved in config.yaml)
           ─► memory check ─► quality gate (rank 0) ─► Megatron actor ─► rollout backend, guidance
              store, weight transport (rank 0)
           ─► for each step:  rollout ─► reward ─► advantages ─► train ─► sync  (Run.step; colocated,
              the engine's KV pool and weights are released for the train phase, the sync refills them)
              with hooks around it: heap trim, evals, logging, checkpoints, the measurement after
              training (run/hooks.py)
           ─► summary
Multi-process (`torchrun ... trainer.tp=2`): rank 0 owns the rollout, data, store and logs; every
rank trains, syncs and checkpoints.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist

from megatron_trace import faults
from megatron_trace.config import Config
from sglang_backend.api import serves_version
from sglang_backend.http_errors import RolloutError

from . import console
from .hooks import hooks_for, return_freed_memory
from .metrics import JsonlLogger, MetricsHub, TensorBoardLogger, resumed_part, run_summary
from .rollout import Rollout, RolloutBatch, engine_sleeps
from .step import StepResult, StepTrainer, share_batch


class Run:
    def __init__(self, cfg: Config, resume: bool):
        from megatron_trace.data import reward_for
        from megatron_trace.trainer.actor import Actor
        from megatron_trace.trainer.parallel import init_distributed

        self.t0 = time.perf_counter()
        self.run_dir = Path(cfg.logging.run_dir)
        t = cfg.trainer
        init_distributed(tp=t.tp, pp=t.pp, ep=t.ep, seed=t.seed, cp=t.cp)
        self.rank0 = not dist.is_initialized() or dist.get_rank() == 0
        # rollout.colocated, resolved once (rank 0 holds the engine): the plan says it, the steps do it
        self.engine_sleeps = engine_sleeps(cfg) and self.rank0
        if self.rank0:
            print("\n".join(console.plan_lines(cfg, self.engine_sleeps)), flush=True)
        self.tok, prompts, self.model_path, self.arch = task_and_checkpoint(cfg)
        if self.arch.is_moe and t.tp > 1 and not t.sequence_parallel:
            # Megatron's MoELayer raises at the first training forward otherwise (after a whole rollout)
            raise ValueError(
                "an MoE model with trainer.tp > 1 trains only with trainer.sequence_parallel=true "
                "(Megatron-Core's MoELayer refuses TP without it); set it, or use trainer.ep for the "
                "experts with trainer.tp=1"
            )
        # The run's one resolution of its quantization policy; every part below gets this object.
        self.policy = cfg.quant.resolve(self.arch)
        self.cfg = cfg = cfg.with_policy(self.policy)
        if self.rank0:
            print(console.policy_line(self.policy, self.arch), flush=True)
        if t.memory_check:  # before the model exists: refuse a plan that cannot fit here
            from megatron_trace.perf.memory import check_launch

            check_launch(cfg, self.policy, str(self.model_path))
        if t.memory_budget_gib:  # ... or that the user's budget does not hold
            from megatron_trace.perf.memory import check_budget, model_spec

            shape, source = model_spec(str(self.model_path))
            if shape is None:  # a budget nothing can be checked against is not a budget
                raise ValueError(f"trainer.memory_budget_gib set, but the model's shape is unknown: {source}")
            check_budget(cfg, self.policy, shape, self.engine_sleeps)
        self.gate, self.gate_rows = None, []  # the rollout-quality gate's result (rank 0)
        # the run's reward, built once (the code sandbox is checked here): the gate and rollout score with it
        self.reward_fn = reward_for(cfg.rollout) if self.rank0 else None
        if self.rank0:
            self._check_rollout_quality(prompts)
        # what the process holds before the trainer, and what building the trainer added (the first
        # step's metrics carry both; perf.memory --measured sets them beside its prediction)
        self.memory_at_build = {"perf/mem_runtime_gib": _trimmed_resident()}
        self.actor = Actor(self.arch, self.policy, t, cfg.rollout, hf_path=self.model_path, offload_dir=self.run_dir)
        self.memory_at_build["perf/mem_trainer_built_gib"] = (
            _trimmed_resident() - self.memory_at_build["perf/mem_runtime_gib"]
        )
        self.part_peaks: dict[str, float] = {}  # the train phase's peak per part of the actor's step
        self.actor.on_part_done = self._part_peak
        self.input_amax = self._static_activation_amax(prompts)
        self.start_step, self.version = 0, 0
        if resume:
            meta = self.actor.load_checkpoint(self.run_dir / "checkpoints")
            self.start_step, self.version = meta["step"] + 1, meta["version"]
        self.backend = self.rollout = self.store = self.hub = self.transport = None
        self.resumed_history, self.resumed_before = [], None
        # what the hooks keep for the summary: every step's scalars (a resumed run's earlier steps
        # first), the phase time totals, the evals before and after
        self.history: list[dict] = []
        self.totals: dict[str, float] = {}
        self.evals: dict[str, dict] = {}
        self.wire_bytes = 0
        if self.rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            cfg.save(self.run_dir / "config.yaml")  # the resolved policy: what ran
            self.backend = rollout_backend(cfg, self.policy, self.model_path)
            self.store = guidance_store(cfg, self.run_dir)
            self.rollout = Rollout(
                cfg,
                self.policy,
                self.arch,
                self.backend,
                self.tok,
                prompts,
                self.reward_fn,
                self.store,
            )
            from megatron_trace.transfer.pipeline import make_transport

            self.transport = make_transport(cfg, self.backend, self.run_dir, self.arch)
            self.hub = MetricsHub(loggers(cfg, self.run_dir, resume))
            if self.start_step:
                self.resumed_history, self.resumed_before = resumed_part(self.run_dir, self.start_step)
        self.trainer = StepTrainer(cfg, self.actor, self.store)
        self.hooks = hooks_for(cfg, self.rank0)
        if resume or self.version or self.input_amax is not None:
            # the rollout serves what the checkpoint holds; static scales: its input_scale before the first rollout
            self.sync_weights()
        if self.rank0 and cfg.rollout.backend == "http":
            check_server_versions(self.backend, self.version)

    # -- the step --------------------------------------------------------------------------------
    def step(self, step: int, prefetched: RolloutBatch | None = None) -> StepResult:
        """rollout ─► reward ─► advantages (rank 0; async: rolled out while the last step trained)
        ─► [engine released] train (every rank) [engine resumed, empty] ─► sync the weights as the
        next version (which refills it)."""
        from megatron_trace.kernels import cpu_alloc

        t_step = time.perf_counter()
        memory, self.memory_at_build = self.memory_at_build, {}
        cpu_alloc.reset_peak_rss()
        batch = share_batch(prefetched or self.produce(step), self.store)
        if prefetched is None:  # async: the rollout ran during the last train phase, no phase of its own
            memory["perf/mem_rollout_peak_gib"] = cpu_alloc.peak_rss()
            if self.store is not None:  # its writer done (training waits for it anyway): the step's records
                self.store.flush()
                memory["perf/mem_guidance_store_gib"] = self.store.stats()["bytes_in_memory"] / 2**30
        faults.hit("rollout.done", step=step)
        memory |= self._engine_release()
        memory["perf/mem_before_train_gib"] = cpu_alloc.reset_peak_rss()
        t = time.perf_counter()
        trained = self.trainer.train(batch, self.version)
        train_s = time.perf_counter() - t
        peaks, self.part_peaks = self.part_peaks, {}  # the mark is reset after each part (_part_peak)
        memory |= {f"perf/mem_{part}_peak_gib": gib for part, gib in peaks.items()}
        memory["perf/mem_train_peak_gib"] = max([cpu_alloc.peak_rss(), *peaks.values()])
        if self.actor.offload is not None:  # Adam's moments on disk until the next step
            memory["perf/optimizer_offload_gib"] = self.actor.offload.bytes / 2**30
            if self.actor.offload.kept_bytes:  # trainer.optimizer_offload_keep_mb: the first parameters' stay
                memory["perf/optimizer_offload_kept_gib"] = self.actor.offload.kept_bytes / 2**30
            if self.actor.offload.held_peak:  # a streamed step: the most of them it held at once
                memory["perf/optimizer_offload_held_gib"] = self.actor.offload.held_peak / 2**30
        memory["perf/step_tokens"] = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch.samples)
        faults.hit("train.done", step=step)
        self.version += 1
        memory |= self._engine_resume()  # an empty model: the sync below refills every tensor
        cpu_alloc.reset_peak_rss()
        transfer_s = self.sync_weights()
        memory["perf/mem_sync_peak_gib"] = cpu_alloc.peak_rss()
        times = {
            "rollout_s": batch.stats.get("rollout_s", 0.0),
            "train_s": train_s,
            "transfer_s": transfer_s,
            "step_s": time.perf_counter() - t_step,
        }
        return StepResult(step, batch, trained, times, self.wire_bytes, metrics=memory if self.rank0 else {})

    def _part_peak(self, part: str) -> None:
        """After each part of the actor's step (forward_backward, optimizer): its peak, then what it
        freed back to the system before the next part. The engine's allocator policy (cpu_alloc)
        keeps freed heap resident, and kept, it sat under the next part's own peak: 1.6-2.1 GiB free
        in the heap at the optimizer's peak on the real config (mallinfo2), then under the sync's."""
        from megatron_trace.kernels import cpu_alloc

        self.part_peaks[part] = cpu_alloc.peak_rss()
        cpu_alloc.return_freed_memory()
        cpu_alloc.reset_peak_rss()

    def _engine_release(self) -> dict[str, float]:
        """Colocated (rollout.colocated): the engine's KV pool and weights go back to the system for
        the train phase. In this process (the embedded engine) the resident GiB before and after say
        what that gave the trainer; a server's release shows in its own process, not here."""
        if not self.engine_sleeps:
            return {}
        from megatron_trace.kernels import cpu_alloc

        in_process = self.cfg.rollout.backend == "local"
        if in_process:
            cpu_alloc.return_freed_memory()  # the rollout's freed temporaries first: the drop is the engine's
        out, t = {}, time.perf_counter()
        for tag, key in (("kv_cache", "perf/mem_engine_kv_gib"), ("weights", "perf/mem_engine_weights_gib")):
            before = cpu_alloc.resident_gib()
            self.backend.release_memory_occupation([tag])
            if in_process:
                out[key] = before - cpu_alloc.resident_gib()
        out["perf/engine_release_s"] = time.perf_counter() - t
        if in_process:
            out["perf/engine_released_gib"] = out["perf/mem_engine_kv_gib"] + out["perf/mem_engine_weights_gib"]
        return out

    def _engine_resume(self) -> dict[str, float]:
        if not self.engine_sleeps:
            return {}
        t = time.perf_counter()
        self.backend.resume_memory_occupation(["weights", "kv_cache"])
        return {"perf/engine_resume_s": time.perf_counter() - t}

    def produce(self, step: int) -> RolloutBatch | None:
        return self.rollout.run(step, self.version) if self.rank0 else None

    def sync_weights(self) -> float:
        """Trainer weights -> rollout as the current version (collective); returns seconds."""
        from megatron_trace.transfer.pipeline import sync_weights

        t = time.perf_counter()
        stats = sync_weights(
            self.actor.chunks,
            self.arch,
            self.policy,
            self.cfg,
            self.transport,
            self.version,
            input_amax=self.input_amax,
        )
        if stats is not None:
            self.wire_bytes = stats.bytes
        if self.backend is not None:  # a rollout server that died is re-admitted at this version
            self.backend.note_version(self.version)
        return time.perf_counter() - t

    def run(self) -> dict:
        for h in self.hooks:
            h.before_steps(self)
        steps = range(self.start_step, self.cfg.trainer.steps)
        # async: the rollout of step k+1 runs while step k trains (samples more than
        # algo.max_version_diff versions old are dropped and counted)
        pool = ThreadPoolExecutor(1, "rollout") if self.cfg.algo.async_rollout and self.rank0 else None
        pending = pool.submit(self.produce, steps.start) if pool and len(steps) else None
        try:
            for step in steps:
                prefetched = pending.result() if pending else None
                if pool and step + 1 < self.cfg.trainer.steps:
                    pending = pool.submit(self.produce, step + 1)
                result = self.step(step, prefetched)
                for h in self.hooks:
                    h.after_step(self, result)
        finally:
            if pool:
                pool.shutdown(wait=True)
        for h in self.hooks:
            h.after_steps(self)
        return self.close()

    def close_rollout(self) -> None:
        """The rollout's side of the run is done (the engine's memory goes back before the
        measurement after training builds engines of its own)."""
        if self.backend is not None:
            self.backend.close()
        self.backend = self.rollout = self.transport = None

    def close(self) -> dict:
        """The run's summary (rank 0); everything it opened closed (the optimizer too: its state's
        offload file goes with it; the last checkpoint holds it)."""
        self.actor.finish_training()
        if not self.rank0:
            return {}
        summary = run_summary(self.history, self.evals, self.totals, wall_s=time.perf_counter() - self.t0)
        self.hub.close()
        if self.store is not None:
            self.store.close()
        self.close_rollout()  # the engine, or the client's probes of dead servers
        return summary

    # -- parts that need the run's state -----------------------------------------------------------
    def _static_activation_amax(self, prompts) -> dict[str, float] | None:
        """quant.activation_scale=static: each FP4-activation linear's input amax, calibrated once on
        quant.calib_prompts training prompts (rank 0, fp32 HF forward of the starting checkpoint; why
        that forward: transfer/static_scales.py), shared with every rank. The trainer's QAT rounds
        with the S_enc it gives and every weight sync sends it as input_scale, so both sides agree."""
        if self.policy.activation_scale != "static":
            return None
        from megatron_trace.trainer.comm import broadcast_json
        from megatron_trace.transfer.static_scales import calibrate_static_amax, check_calibratable, static_site_scales

        check_calibratable(self.arch, self.policy)  # every rank: none waits below for a rank 0 that refused
        amax = None
        if self.rank0:
            ids = [self.tok.encode_prompt(p.text) for p in prompts.sample(self.cfg.quant.calib_prompts, 0)]
            amax = calibrate_static_amax(self.model_path, self.arch, self.policy, ids)
            print(f"static activation scales: calibrated {len(amax)} linears on {len(ids)} prompts", flush=True)
        amax = broadcast_json(amax)
        self.actor.qat.set_static_activation_scales(static_site_scales(amax, self.arch, self.policy))
        return amax

    def _check_rollout_quality(self, prompts) -> None:
        from megatron_trace.quality.gate import gate_run

        self.gate, self.gate_rows = gate_run(
            self.cfg,
            self.policy,
            self.model_path,
            self.tok,
            prompts,
            log=lambda m: print(m, flush=True),
            reward=self.reward_fn,
        )
        if self.gate is not None:  # quant.quality_gate=false builds no engines: nothing of theirs to return
            return_freed_memory("the quality gate's engines")


def _trimmed_resident() -> float:
    """This process's resident GiB once its heap's freed pages are back with the system."""
    from megatron_trace.kernels import cpu_alloc

    cpu_alloc.return_freed_memory()
    return cpu_alloc.resident_gib()


def gate_only(cfg: Config) -> dict:
    """`python -m megatron_trace.train --config FILE --gate-only`: the run's quality gate alone, as the run
    would apply it (its checkpoint, resolved policy, answer length, dtype, reward and
    quant.quality_prompts prompts), without a trainer. Returns what gate.json holds: the verdict, BF16's
    and the policy's greedy accuracy (a code run's: HumanEval pass@1) and per-prompt rewards."""
    from megatron_trace.data import reward_for
    from megatron_trace.quality.gate import gate_run

    if not cfg.quant.quality_gate:
        raise ValueError("--gate-only runs the quality gate, but quant.quality_gate=false")
    tok, prompts, model_path, arch = task_and_checkpoint(cfg)
    policy = cfg.quant.resolve(arch)
    print(console.policy_line(policy, arch), flush=True)
    t0 = time.perf_counter()
    res, rows = gate_run(
        cfg, policy, model_path, tok, prompts, log=lambda m: print(m, flush=True), reward=reward_for(cfg.rollout)
    )
    if res is None:
        return {"setting": "bf16:bf16:bf16", "passed": True, "measured": False}
    return {
        "setting": res.setting,
        "passed": res.passed,
        "prompts": len(rows),
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "dtype": cfg.rollout.dtype,
        "nll_increase": res.nll_increase,
        "accuracy": res.accuracy,
        "bf16_accuracy": res.bf16_accuracy,
        "rewards": res.rewards,
        "bf16_rewards": res.bf16_rewards,
        "seconds": round(time.perf_counter() - t0, 1),
    }


# -- the run's parts ---------------------------------------------------------------------------------
def task_and_checkpoint(cfg: Config):
    """(tokenizer, prompt source, starting checkpoint, its ModelArch): what a run and its gate start from."""
    from megatron_trace.data import prompt_source
    from megatron_trace.models import ModelArch

    check_checkpoint_dirs(cfg)
    tok = load_run_tokenizer(cfg)
    prompts = prompt_source(
        cfg.rollout.prompts, seed=cfg.trainer.seed, tokenizer=tok, eval_fraction=cfg.rollout.eval_fraction
    )
    model_path = starting_checkpoint(cfg, tok, prompts)
    return tok, prompts, model_path, ModelArch.from_hf_config(model_path)


def check_checkpoint_dirs(cfg: Config) -> None:
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


def load_run_tokenizer(cfg: Config):
    from megatron_trace.data import CharTokenizer, load_tokenizer

    return CharTokenizer() if cfg.model.tokenizer == "char" else load_tokenizer(cfg.model.tokenizer)


def starting_checkpoint(cfg: Config, tok, prompts) -> Path:
    """model.path, or the tiny model's warm start (built by rank 0, cached, its path shared)."""
    if cfg.model.path:
        return Path(cfg.model.path)
    from megatron_trace.trainer.comm import broadcast_json

    from .warm_start import warm_start_for

    path = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = str(warm_start_for(cfg, tok, prompts, log=lambda m: print(m, flush=True)))
    return Path(broadcast_json(path))


def rollout_backend(cfg: Config, policy, model_path: Path):
    """rollout.backend: the embedded engine in this process, or the client of running servers, each
    checked to serve what the trainer assumes."""
    rc = cfg.rollout
    if rc.backend == "http":
        from sglang_backend.client import RolloutClient

        client = RolloutClient(rc.urls, api_key=rc.api_key or None)
        if policy.kv_k_debias:  # every server: one caching plain K would mismatch its samples
            for url in client.urls:
                check_debiased_server(client, url)
        return client
    from sglang_backend.local import Engine, InProcessBackend

    g = cfg.guidance
    return InProcessBackend(
        Engine(
            str(model_path),
            dtype=rc.dtype,
            quant_policy=policy,
            guidance_mode=g.mode,
            guided_layers=g.layers,
            max_running_requests=rc.max_running,
            max_total_tokens=rc.max_total_tokens,
            random_seed=cfg.trainer.seed,
        )
    )


def guidance_store(cfg: Config, run_dir: Path):
    from megatron_trace.guidance import GuidanceStore

    g = cfg.guidance
    return GuidanceStore(int(g.memory_budget_mb * 2**20), g.spill_dir or str(run_dir / "guidance_spill"))


def loggers(cfg: Config, run_dir: Path, resume: bool) -> list:
    out = [JsonlLogger(run_dir, append=resume)]
    if cfg.logging.tensorboard:
        out.append(TensorBoardLogger(run_dir))
    return out


# -- checks of the HTTP rollout servers before the first step: each must serve what the trainer
# assumes (its weight version, a de-biased K cache when asked), or the run stops naming the server
def check_server_versions(client, expected: int) -> None:
    """Before the first rollout every server must serve the trainer's weight version: one still holding
    another run's (or an earlier step's) weights would sample from a policy the trainer never had,
    and the mismatch would only show as a large |logp gap| in the metrics."""
    for url in client.urls:
        served = client.model_info(url).get("weight_version")
        if not serves_version(served, expected):
            raise ValueError(
                f"rollout server {url} serves weight version {served!r}, but the trainer starts at version "
                f"{expected}: it holds other weights than the trainer's (another run's, or a later step's). "
                f"Restart it from the start checkpoint with --weight-version {expected} (python -m "
                "sglang_backend.launch ...), or resume the run that left it there"
            )


def check_debiased_server(client, url: str) -> None:
    """quant.kv_k_debias over HTTP: the trainer quantizes K - RoPE(b), so a server caching plain K
    would leave TRACE guiding the wrong tensor; refuse it before the first step. Both the embedded
    server and SGLang with the plugin answer GET /trace_policy."""
    try:
        served = client.trace_policy(url).get("kv_k_debias")
    except RolloutError as e:
        served = f"unknown: {e}"
    if served is not True:
        raise ValueError(
            f"quant.kv_k_debias=true, but the rollout server {url} does not serve a de-biased K cache "
            f"(its /trace_policy kv_k_debias is {served!r}); start it with python -m sglang_backend.launch "
            "--kv-k-debias (--backend local, or --backend sglang with the trace_fp4 plugin)"
        )
