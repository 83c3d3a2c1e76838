"""What hangs on the run's steps (torchtitan's style): each hook sees the run before its first step,
every step's result, and the run after its last step, in the order the run lists them.

    HeapTrim        the step's freed heap back to the system            (rank 0)
    Evaluation      the eval split before the first step and after the last (rank 0)
    Logging         scalars, histograms and readable samples to every logger, the progress bar,
                    the run's history for its summary                    (rank 0)
    Checkpointing   every trainer.save_every steps and after the last      (every rank)
    QualityAfter    the quality gate's measurement on the trained weights  (every rank: the gather)
The step itself (run/run.py: rollout ─► reward ─► advantages ─► train ─► sync) knows none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron_trace.kernels import cpu_alloc

from . import console
from .metrics import step_scalars

if TYPE_CHECKING:
    from .run import Run
    from .step import StepResult


class Hook:
    def before_steps(self, run: Run) -> None:
        """Before the run's first step (of this process: a resumed run's first is its start step)."""

    def after_step(self, run: Run, result: StepResult) -> None:
        """After every step: trained, weights synced."""

    def after_steps(self, run: Run) -> None:
        """After the last step."""


def return_freed_memory(what: str) -> float:
    """A phase's freed heap back to the system (cpu_alloc: the engine's allocator policy keeps it
    resident otherwise, and the 0.5B trainer needs those GB); returns GiB, said when it is any."""
    freed = cpu_alloc.return_freed_memory() / 2**30
    if freed >= 2**-10:
        print(f"memory: {freed:.2f} GiB freed by {what} returned to the system", flush=True)
    return freed


class HeapTrim(Hook):
    """The step's freed heap back before the next rollout: the engine's allocator policy (cpu_alloc)
    keeps it, and kept, the 0.5B config's resident size grew 0.3-0.5 GiB a step with an FP4 rollout
    (2-6 GiB returned a step). What still grew after the trim was live: oneDNN's and ideep's kernel
    caches, now bounded (cpu_alloc.bound_kernel_caches)."""

    def after_step(self, run, result) -> None:
        result.metrics["perf/heap_returned_gib"] = cpu_alloc.return_freed_memory() / 2**30


class Evaluation(Hook):
    """rollout.eval_prompts of the eval split, and for a code run (rollout.reward=code)
    rollout.humaneval_problems of HumanEval, before the first step (a resumed run keeps the eval it
    started with) and after the last; the results go to the run's `evals` for its summary."""

    def before_steps(self, run) -> None:
        if run.resumed_before is not None:
            run.evals["before"] = run.resumed_before
        else:
            self._eval(run, "before", run.start_step)

    def after_steps(self, run) -> None:
        self._eval(run, "after", run.cfg.trainer.steps)

    @staticmethod
    def _eval(run, when: str, step: int) -> None:
        rc = run.cfg.rollout
        found, shown = run.rollout.evaluate(rc.eval_prompts)
        if found:
            run.hub.text(step, f"eval/answers_{when}", shown)
        if rc.reward == "code" and rc.humaneval_problems:
            humaneval, shown = run.rollout.humaneval(rc.humaneval_problems)
            run.hub.text(step, f"eval/humaneval_answers_{when}", shown)
            found.update(humaneval)
        if found:
            run.evals[when] = found
            run.hub.log(step, found)


class Logging(Hook):
    """Every step's scalars (run/metrics.step_scalars), the |Δlogp| and importance-ratio histograms,
    the readable samples and the progress bar; the quality gate's result at the start. Keeps the
    run's history (a resumed run's earlier steps first) and phase time totals for its summary."""

    PHASES = ("rollout_s", "train_s", "transfer_s")

    def __init__(self):
        self.bar = None

    def before_steps(self, run) -> None:
        if run.gate is not None:
            run.hub.log(run.start_step, run.gate.metrics())
            n = run.cfg.logging.samples_per_step
            run.hub.text(run.start_step, "quality/answers_vs_bf16", run.gate.answers(run.gate_rows, n))
        run.history = list(run.resumed_history)  # a resumed run's summary covers the whole run
        run.totals = {k: sum(h.get(f"perf/{k}", 0.0) for h in run.history) for k in self.PHASES}
        self.bar = console.progress_bar(run.cfg.trainer.steps - run.start_step, run.cfg.logging.progress)

    def after_step(self, run, result) -> None:
        m = step_scalars(result, run.store.stats() if run.store is not None else {})
        run.hub.log(result.step, m)
        if result.trained.step is not None:
            d = torch.cat(result.trained.deltas) if result.trained.deltas else torch.zeros(0)
            run.hub.histogram(result.step, "mismatch/abs_dlogp", d.abs())
            run.hub.histogram(result.step, "mismatch/importance_ratio", d.exp())
        run.hub.text(result.step, "rollout/samples", result.batch.shown)
        run.history.append(m)
        for k in self.PHASES:
            run.totals[k] += m[f"perf/{k}"]
        self.bar.set_postfix(
            reward=f"{m['rollout/reward_mean']:.2f}", dlogp=f"{m.get('mismatch/mean_abs_dlogp', 0):.3f}"
        )
        self.bar.update(1)

    def after_steps(self, run) -> None:
        self.bar.close()


class Checkpointing(Hook):
    """The actor's checkpoint (weights, optimizer, the weight version) every trainer.save_every steps
    and after the last; collective. What the save freed goes back to the system at once: it comes
    after the step's heap trim, and kept, it sat under the next rollout (the real config's rollout
    peak 0.8-1.8 GiB higher after each save step: 10.8-11.8 against 9.9-10.0)."""

    def after_step(self, run, result) -> None:
        t = run.cfg.trainer
        if t.save_every and (result.step + 1) % t.save_every == 0 or result.step + 1 == t.steps:
            run.actor.save_checkpoint(run.run_dir / "checkpoints", result.step, {"version": run.version})
            cpu_alloc.return_freed_memory()


class QualityAfter(Hook):
    """quant.quality_after: the gate's prompts again on the trained weights, beside BF16's answers.
    What the steps held goes first: the optimizer (the last checkpoint holds it) and the rollout
    engine; this phase builds two engines of its own, and the 0.5B config's run peaked at 23 GiB of
    its 24 GB box here otherwise."""

    def after_steps(self, run) -> None:
        from megatron_trace.trainer.comm import broadcast_json
        from megatron_trace.transfer.gather import iter_hf_params

        if not broadcast_json(run.gate is not None):  # rank 0 knows whether its gate measured anything
            return
        run.actor.finish_training()
        run.close_rollout()
        return_freed_memory("the optimizer and the rollout engine")
        hf_sd = {}
        for name, t in iter_hf_params(run.actor.chunks, run.arch):  # collective: every rank iterates
            if run.rank0:
                hf_sd[name] = t.to(torch.bfloat16)
        if run.rank0:
            from megatron_trace.quality.gate import measure_after

            res = measure_after(
                run.cfg,
                run.policy,
                run.model_path,
                run.run_dir,
                hf_sd,
                run.gate_rows,
                run.tok,
                log=print,
                reward=run.reward_fn,
            )
            steps, n = run.cfg.trainer.steps, run.cfg.logging.samples_per_step
            run.hub.log(steps, res.metrics())
            run.hub.text(steps, "quality/answers_vs_bf16", res.answers(run.gate_rows, n))


def hooks_for(cfg, rank0: bool) -> list[Hook]:
    """The run's hooks, each method called in this order: trimmed before the step is logged (its
    metrics say what was returned), logged before it is checkpointed; the eval after the last step
    before the quality measurement, which releases the rollout engine."""
    after = [QualityAfter()] if cfg.quant.quality_after else []
    if not rank0:
        return [Checkpointing(), *after]
    return [HeapTrim(), Evaluation(), Logging(), Checkpointing(), *after]
