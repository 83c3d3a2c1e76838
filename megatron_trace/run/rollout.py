"""A step's rollout, rank 0's side: prompts ─► generate ─► Samples with rewards and GRPO advantages.

    prompts.sample(n, step) ─► GenerateRequests (n samples each, seeded per step and prompt)
      ─► backend.generate (an aborted request stops the run: api.check_answered)
      ─► per result: tokens, the rollout's logprobs, weight version,
         routed experts (MoE), and under guided QAT its guidance record ─► the store (a handle
         stays in the sample)
      ─► rewards of the step's answers (a raising reward scores 0, counted; the code reward runs
         them in its sandbox in parallel and counts why each zero is one) ─► GRPO advantages per group
Why a store: the rollout puts a record the moment it has fetched it, so in async mode step k+1's
records are written (and, past `guidance.memory_budget_mb`, spilled to disk by the store's writer
thread) while step k trains, and the batch waiting for its turn holds only `StoredRecord` handles.
Host memory for waiting guidance is the budget, not a whole step's records (at scale, GBs per step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from megatron_trace.config import Config
from megatron_trace.data import score_all
from megatron_trace.guidance import GuidanceRecord, StoredRecord, sample_routed_experts
from megatron_trace.models import ModelArch, QuantPolicy
from megatron_trace.rl import Sample, grpo_advantages
from sglang_backend.api import GenerateRequest, SamplingParams, check_answered, version_step


@dataclass
class RolloutBatch:
    step: int
    version: int  # weight version the rollout started from
    samples: list[Sample]
    stats: dict[str, float] = field(default_factory=dict)  # prompts rejected/truncated, reward errors, rollout_s
    # a few samples as text (the first answer to each of the first logging.samples_per_step prompts)
    shown: list[dict] = field(default_factory=list)
    # rollout.reward=code: why answers scored 0 (code_reward.REASONS, each counted, zeros too)
    reward_reasons: dict[str, int] = field(default_factory=dict)


def check_guided(policy: QuantPolicy) -> list[str]:
    """The sites TRACE guidance covers under the run's policy (`QuantPolicy.guided_site_kinds`);
    refuses a guided run with none: guided QAT without a record would silently be plain QAT."""
    sites = policy.guided_site_kinds()
    if not sites:
        raise ValueError(
            f"trainer.qat_mode=guided has nothing to guide: guidance records quantized activations and "
            f"K/V, and this run has quant.format={policy.format}, activations={policy.activations}, "
            f"K={policy.k_format}, V={policy.v_format}. Use trainer.qat_mode=rtn, or FP4 activations or a "
            "quantized KV cache"
        )
    return sites


def engine_sleeps(cfg: Config) -> bool:
    """rollout.colocated, resolved once: whether the rollout engine sleeps through each train phase.
    An async run rolls out step k+1 while step k trains, so its engine cannot sleep."""
    colocated = cfg.rollout.colocated
    if cfg.algo.async_rollout:
        if colocated == "on":
            raise ValueError(
                "rollout.colocated=on frees the rollout engine while the trainer trains, and "
                "algo.async_rollout=true rolls out during training: set rollout.colocated=off (or auto)"
            )
        return False
    return colocated == "on" or (colocated == "auto" and cfg.rollout.backend == "local")


class Rollout:
    """Rank 0's side of a step: prompts, generation, rewards (a raising reward scores 0, counted).
    With a `store`, each guidance record goes into it as soon as it is fetched (see the module doc)."""

    def __init__(
        self,
        cfg: Config,
        policy: QuantPolicy,
        arch: ModelArch,
        backend,
        tokenizer,
        prompts,
        reward_fn,
        store=None,
    ):
        self.cfg, self.arch, self.backend, self.tok, self.prompts = cfg, arch, backend, tokenizer, prompts
        self.reward_fn, self.store = reward_fn, store
        self.want_guidance = cfg.trainer.qat_mode == "guided"
        if self.want_guidance:
            check_guided(policy)
        # MoE: the routed experts feed routing replay, name expert-site guidance slots and measure
        # routing agreement, so every MoE rollout returns them
        self.want_routing = arch.is_moe

    def run(self, step: int, version: int) -> RolloutBatch:
        t0 = time.perf_counter()
        rc, stats = self.cfg.rollout, {"prompts_rejected": 0, "prompts_truncated": 0, "reward_errors": 0}
        reqs, kept = [], []
        for i, p in enumerate(self.prompts.sample(rc.prompts_per_step, step)):
            ids = self._encode(p.text, stats)
            if ids is None:
                continue
            seed = (self.cfg.trainer.seed * 1_000_003 + step) * 1009 + i * rc.n_samples
            sp = SamplingParams(
                max_new_tokens=rc.max_new_tokens,
                temperature=rc.temperature,
                top_p=rc.top_p,
                top_k=rc.top_k,
                n=rc.n_samples,
                sampling_seed=seed,
            )
            reqs.append(
                GenerateRequest(
                    ids,
                    sp,
                    rid=f"{p.prompt_id}-v{version}",
                    return_guidance=self.want_guidance,
                    return_routed_experts=self.want_routing,
                )
            )
            kept.append((p, ids))
        # an aborted request (an engine error) stops the run here, never scored as an empty answer
        results = check_answered(self.backend.generate(reqs), f"step {step}'s rollout") if reqs else []
        texts = [self.decode(res.output_ids) for res in results]
        scores = score_all(self.reward_fn, texts, [kept[j // rc.n_samples][0].answer for j in range(len(results))])
        stats["reward_errors"] = scores.errors
        self._say_weak_sandbox(step)
        samples, shown = [], []
        for j, (res, text, reward) in enumerate(zip(results, texts, scores.rewards)):
            p, ids = kept[j // rc.n_samples]
            if j % rc.n_samples == 0 and len(shown) < self.cfg.logging.samples_per_step:
                shown.append({"prompt": p.text, "response": text, "answer": p.answer, "reward": reward})
            samples.append(
                Sample(
                    res.rid,
                    ids,
                    res.output_ids,
                    res.output_logprobs,
                    guidance=self._keep(step, res.rid, self._guidance(res)) if self.want_guidance else None,
                    routed_experts=None
                    if res.routed_experts is None  # a dense model's rollout sends none
                    else sample_routed_experts(res.routed_experts, len(ids), len(res.output_ids), self.arch, res.rid),
                    reward=reward,
                    version=version_step(res.weight_version),
                    prompt_id=str(p.prompt_id),
                )
            )
        for s, a in zip(samples, grpo_advantages([s.reward for s in samples], rc.n_samples)):
            s.advantage = a
        stats["rollout_s"] = time.perf_counter() - t0
        return RolloutBatch(step, version, samples, stats, shown, scores.reasons)

    def _say_weak_sandbox(self, step: int) -> None:
        """rollout.code_sandbox=rlimits runs model code without namespaces: every step says so."""
        isolation = getattr(self.reward_fn, "isolation", None)
        if isolation is not None and isolation != "bwrap":
            print(
                f"step {step}: WARNING model-written code ran with rollout.code_sandbox={isolation} "
                "(resource limits only: no filesystem or network isolation)",
                flush=True,
            )

    def _encode(self, text: str, stats: dict) -> list[int] | None:
        ids = self.tok.encode_prompt(text)
        limit = self.cfg.rollout.max_prompt_len
        if len(ids) > limit:
            if self.cfg.rollout.long_prompts == "reject":
                stats["prompts_rejected"] += 1
                return None
            stats["prompts_truncated"] += 1
            ids = ids[-limit:]
        return ids

    def _guidance(self, res) -> GuidanceRecord:
        """The sample's record; guided QAT without it would silently be plain QAT, so that stops the run."""
        if not res.guidance_handle:
            where = getattr(self.backend, "urls", None) or type(self.backend).__name__
            raise RuntimeError(
                f"trainer.qat_mode=guided, but the rollout ({where}) returned no guidance handle for "
                f"sample {res.rid}: the server must run the TRACE plugin (`python -m "
                "sglang_backend.launch --backend sglang`) or the embedded engine, and record quantized sites"
            )
        return self.backend.fetch_guidance(res.guidance_handle)

    def _keep(self, step: int, rid: str, record: GuidanceRecord) -> GuidanceRecord | StoredRecord:
        if self.store is None:
            return record
        # Keyed by step too: in async mode step k+1 starts from the version step k did, so a prompt
        # drawn by both has the same rid while step k's records are still in the store.
        return self.store.put(f"{step}/{rid}", step, record)

    def evaluate(self, n: int, samples: int = 4) -> tuple[dict[str, float], list[dict]]:
        """On the eval split (problems training never draws; the first n of it): greedy accuracy,
        and the mean reward of `samples` answers per prompt at the rollout's temperature; and the
        greedy answers to the first logging.samples_per_step prompts as text."""
        if n == 0:
            return {}, []
        prompts = self.prompts.eval_set(n)
        if not prompts:
            raise ValueError(
                "rollout.eval_prompts > 0 but the eval split is empty: raise rollout.eval_fraction "
                "or set rollout.eval_prompts=0"
            )
        n = len(prompts)
        rc = self.cfg.rollout
        tag = time.monotonic_ns()
        sampled = [
            GenerateRequest(
                self.tok.encode_prompt(p.text),
                SamplingParams(
                    max_new_tokens=rc.max_new_tokens,
                    temperature=rc.temperature,
                    top_p=rc.top_p,
                    top_k=rc.top_k,
                    n=samples,
                    sampling_seed=7_777_777 + i * samples,
                ),
                rid=f"eval-s{i}-{tag}",
            )
            for i, p in enumerate(prompts)
        ]
        res = check_answered(self.backend.generate(self._greedy(prompts, f"eval-g{tag}") + sampled), "the evaluation")
        answers = [p.answer for p in prompts] + [p.answer for p in prompts for _ in range(samples)]
        texts = [self.decode(r.output_ids) for r in res]
        rewards = score_all(self.reward_fn, texts, answers).rewards
        metrics = {
            "eval/accuracy": sum(rewards[:n]) / n,
            "eval/reward_sampled": sum(rewards[n:]) / (n * samples),
            "eval/set_size": n,
        }
        return metrics, self._shown(prompts, texts, rewards)

    def humaneval(self, n: int) -> tuple[dict[str, float], list[dict]]:
        """HumanEval pass@1 of the rollout's policy: its first n problems (of 164, never trained on),
        greedy, rollout.max_new_tokens, each answer run against the problem's tests in the code
        reward's sandbox; and the first logging.samples_per_step answers as text."""
        from megatron_trace.data import load_humaneval

        if n == 0:
            return {}, []
        if not hasattr(self.reward_fn, "score_many"):
            raise ValueError(
                "the HumanEval evaluation scores answers with the code reward: it needs rollout.reward=code "
                f"(this run's is {self.cfg.rollout.reward!r})"
            )
        prompts = load_humaneval(n)
        res = check_answered(
            self.backend.generate(self._greedy(prompts, f"humaneval-{time.monotonic_ns()}")), "the HumanEval evaluation"
        )
        texts = [self.decode(r.output_ids) for r in res]
        scores = score_all(self.reward_fn, texts, [p.answer for p in prompts])
        metrics = {
            "eval/humaneval_pass@1": sum(scores.rewards) / len(prompts),
            "eval/humaneval_problems": len(prompts),
            **{f"eval/humaneval_code_{k}": v for k, v in scores.reasons.items()},
        }
        return metrics, self._shown(prompts, texts, scores.rewards)

    def _greedy(self, prompts, tag: str) -> list[GenerateRequest]:
        """A greedy answer of rollout.max_new_tokens to each prompt (the whole prompt: an evaluation
        scores every problem, whatever rollout.max_prompt_len lets training draw)."""
        sp = SamplingParams(max_new_tokens=self.cfg.rollout.max_new_tokens, temperature=0.0)
        return [GenerateRequest(self.tok.encode_prompt(p.text), sp, rid=f"{tag}-{i}") for i, p in enumerate(prompts)]

    def _shown(self, prompts, texts: list[str], rewards: list[float]) -> list[dict]:
        return [
            {"prompt": p.text, "response": t, "answer": p.answer, "reward": r}
            for p, t, r in list(zip(prompts, texts, rewards))[: self.cfg.logging.samples_per_step]
        ]

    def decode(self, ids: list[int]) -> str:
        # Models often have more embedding rows than the tokenizer has tokens: such ids are junk.
        return self.tok.decode([i for i in ids if i < self.tok.vocab_size])
