"""The RL step, sync or async, from prompts to the next weight version.

    prompts(step) ─► rollout: n samples per prompt (FP4 W/A/KV, logprobs, guidance handles)
      ─► rewards ─► GRPO advantages; each guidance record, as it is fetched ─► GuidanceStore
      ─► Actor.train_step: FP4-aware recompute (QAT guided by the store's records) + policy loss
      ─► weight transfer (version + 1) ─► metrics (rollout/ train/ mismatch/ perf/ eval/)
Async (`algo.async_rollout`): the rollout of step k+1 runs while step k trains; samples more than
`algo.max_version_diff` versions old are dropped and counted. Rank 0 owns the rollout, the data
and the store; every trainer rank receives the step's samples as JSON + safetensors bytes.

Why a store: the rollout puts a record the moment it has fetched it, so in async mode step k+1's
records are written (and, past `guidance.memory_budget_mb`, spilled to disk by the store's writer
thread) while step k trains, and the batch waiting for its turn holds only `StoredRecord` handles;
the records come back when their step trains and the step is released after it. Host memory for
waiting guidance is the budget, not a whole step's bytes (at scale, GBs per step).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_trace.config import Config
from megatron_trace.guidance import GuidanceRecord
from megatron_trace.guidance.routing import sample_routed_experts
from megatron_trace.rl import mismatch_metrics
from megatron_trace.trainer.actor import Sample
from megatron_trace.trainer.comm import broadcast_blobs, broadcast_json
from sglang_backend.api import GenerateRequest, SamplingParams, version_step


@dataclass(frozen=True)
class StoredRecord:
    """A sample's guidance record waiting in rank 0's GuidanceStore under `key`, instead of its bytes."""

    key: str


@dataclass
class RolloutBatch:
    step: int
    version: int  # weight version the rollout started from
    samples: list[dict]  # prompt_id, prompt, response, logprobs, reward, advantage, sample_id
    guidance: list[bytes | StoredRecord | None]  # per sample: the record's bytes, its handle, or none
    stats: dict[str, float] = field(default_factory=dict)
    # a few samples as text (the first answer to each of the first logging.samples_per_step prompts)
    shown: list[dict] = field(default_factory=list)


def grpo_advantages(rewards: list[float], group: int) -> list[float]:
    """(r - group mean) / (group std + 1e-6); a group with one reward value teaches nothing: 0."""
    out = []
    for i in range(0, len(rewards), group):
        g = torch.tensor(rewards[i : i + group], dtype=torch.float64)
        std = g.std(unbiased=False)
        adv = (g - g.mean()) / (std + 1e-6) if std > 0 else torch.zeros_like(g)
        out += adv.tolist()
    return out


def guided_sites(cfg: Config) -> list[str]:
    """Which sites TRACE guidance covers under this config (`QuantPolicy.guided_site_kinds`);
    refuses a guided run with none."""
    sites = cfg.quant.policy().guided_site_kinds()
    if not sites:
        q = cfg.quant
        raise ValueError(
            f"trainer.qat_mode=guided has nothing to guide: guidance records quantized activations and "
            f"K/V, and this run has quant.format={q.format}, activations={q.activations}, "
            f"K={q.kv_k or q.kv}, V={q.kv_v or q.kv}. Use trainer.qat_mode=rtn, or FP4 activations or a "
            "quantized KV cache"
        )
    return sites


class Rollout:
    """Rank 0's side of a step: prompts, generation, rewards (a raising reward scores 0, counted).
    With a `store`, each guidance record goes into it as soon as it is fetched (see the module doc)."""

    def __init__(self, cfg: Config, backend, tokenizer, prompts, reward_fn, arch=None, store=None):
        self.cfg, self.backend, self.tok, self.prompts, self.reward_fn = cfg, backend, tokenizer, prompts, reward_fn
        self.store = store
        self.want_guidance = cfg.trainer.qat_mode == "guided"
        if self.want_guidance:
            guided_sites(cfg)
        # MoE: the routed experts feed routing replay, name expert-site guidance slots and measure
        # routing agreement, so every MoE rollout returns them
        self.want_routing = arch is not None and arch.is_moe

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

    def run(self, step: int, version: int) -> RolloutBatch:
        from megatron_trace.data import score

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
        results = self.backend.generate(reqs) if reqs else []
        samples, guidance, shown = [], [], []
        for j, res in enumerate(results):
            p, ids = kept[j // rc.n_samples]
            text = self.decode(res.output_ids)
            reward, err = score(self.reward_fn, text, p.answer)
            stats["reward_errors"] += err is not None
            if j % rc.n_samples == 0 and len(shown) < self.cfg.logging.samples_per_step:
                shown.append({"prompt": p.text, "response": text, "answer": p.answer, "reward": reward})
            samples.append(
                {
                    "sample_id": res.rid,
                    "prompt_id": p.prompt_id,
                    "prompt": ids,
                    "response": res.output_ids,
                    "logprobs": res.output_logprobs,
                    "reward": reward,
                    "version": version_step(res.weight_version),
                    "routed_experts": res.routed_experts,
                }
            )
            guidance.append(self._keep(step, res.rid, self._guidance(res)) if self.want_guidance else None)
        for s, a in zip(samples, grpo_advantages([s["reward"] for s in samples], rc.n_samples)):
            s["advantage"] = a
        return RolloutBatch(step, version, samples, guidance, stats, shown)

    def _guidance(self, res) -> bytes:
        """The sample's record; guided QAT without it would silently be plain QAT, so that stops the run."""
        if not res.guidance_handle:
            where = getattr(self.backend, "urls", None) or type(self.backend).__name__
            raise RuntimeError(
                f"trainer.qat_mode=guided, but the rollout ({where}) returned no guidance handle for "
                f"sample {res.rid}: the server must run the TRACE plugin (`python -m "
                "sglang_backend.launch --backend sglang`) or the embedded engine, and record quantized sites"
            )
        return self.backend.fetch_guidance(res.guidance_handle)

    def _keep(self, step: int, rid: str, data: bytes) -> bytes | StoredRecord:
        if self.store is None:
            return data
        # Keyed by step too: in async mode step k+1 starts from the version step k did, so a prompt
        # drawn by both has the same rid while step k's records are still in the store.
        key = f"{step}/{rid}"
        self.store.put(key, step, data)
        return StoredRecord(key)

    def evaluate(self, n: int, samples: int = 4) -> tuple[dict[str, float], list[dict]]:
        """On the eval split (problems training never draws; the first n of it): greedy accuracy,
        and the mean reward of `samples` answers per prompt at the rollout's temperature; and the
        greedy answers to the first logging.samples_per_step prompts as text."""
        if n == 0:
            return {}, []
        from megatron_trace.data import score

        prompts = self.prompts.eval_set(n)
        if not prompts:
            raise ValueError(
                "rollout.eval_prompts > 0 but the eval split is empty: raise rollout.eval_fraction "
                "or set rollout.eval_prompts=0"
            )
        n = len(prompts)
        rc = self.cfg.rollout
        tag = time.monotonic_ns()
        greedy = [
            GenerateRequest(
                self.tok.encode_prompt(p.text),
                SamplingParams(max_new_tokens=rc.max_new_tokens, temperature=0.0),
                rid=f"eval-g{i}-{tag}",
            )
            for i, p in enumerate(prompts)
        ]
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
        res = self.backend.generate(greedy + sampled)
        answers = [p.answer for p in prompts] + [p.answer for p in prompts for _ in range(samples)]
        texts = [self.decode(r.output_ids) for r in res]
        rewards = [score(self.reward_fn, t, a)[0] for t, a in zip(texts, answers)]
        shown = [
            {"prompt": p.text, "response": t, "answer": p.answer, "reward": r}
            for p, t, r in list(zip(prompts, texts, rewards))[: self.cfg.logging.samples_per_step]
        ]
        metrics = {
            "eval/accuracy": sum(rewards[:n]) / n,
            "eval/reward_sampled": sum(rewards[n:]) / (n * samples),
            "eval/set_size": n,
        }
        return metrics, shown

    def decode(self, ids: list[int]) -> str:
        # Models often have more embedding rows than the tokenizer has tokens: such ids are junk.
        return self.tok.decode([i for i in ids if i < self.tok.vocab_size])


def share_batch(batch: RolloutBatch | None, store=None) -> RolloutBatch:
    """Rank 0's batch to every trainer rank (JSON + record bytes; no pickle). A single process keeps
    its batch as it is (stored records stay in the store); across ranks the records travel as bytes."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return batch
    meta = broadcast_json(
        None
        if batch is None
        else {
            "step": batch.step,
            "version": batch.version,
            "samples": batch.samples,
            "stats": batch.stats,
            "shown": batch.shown,
            "has": [g is not None for g in batch.guidance],
        }
    )
    blobs = broadcast_blobs(
        None if batch is None else [_record_bytes(g, store) for g in batch.guidance if g is not None]
    )
    it = iter(blobs)
    guidance = [next(it) if has else None for has in meta["has"]]
    return RolloutBatch(meta["step"], meta["version"], meta["samples"], guidance, meta["stats"], meta["shown"])


def _record_bytes(g: bytes | StoredRecord, store) -> bytes:
    return store.get_bytes(g.key) if isinstance(g, StoredRecord) else g


class StepRunner:
    """Trains one batch: its guidance records (from the store), recompute + update, mismatch metrics;
    then releases the step's records from the store."""

    def __init__(self, cfg: Config, actor, store, rank0: bool):
        self.cfg, self.actor, self.store, self.rank0 = cfg, actor, store, rank0

    def train(self, batch: RolloutBatch, current_version: int) -> tuple[dict, list[torch.Tensor]]:
        try:
            return self._train(batch, current_version)
        finally:
            if self.store is not None:
                self.store.release_step(batch.step)  # stale samples' records too

    def _train(self, batch: RolloutBatch, current_version: int) -> tuple[dict, list[torch.Tensor]]:
        limit = self.cfg.algo.max_version_diff
        keep = [i for i, s in enumerate(batch.samples) if current_version - min(s["version"], batch.version) <= limit]
        dropped = len(batch.samples) - len(keep)
        records = [self._record(batch.guidance[i]) for i in keep]
        samples = [
            Sample(
                batch.samples[i]["sample_id"],
                batch.samples[i]["prompt"],
                batch.samples[i]["response"],
                batch.samples[i]["logprobs"],
                batch.samples[i]["advantage"],
                records[n],
                self._routed(batch.samples[i]),
            )
            for n, i in enumerate(keep)
        ]
        if not samples:
            return {"rollout/dropped_stale": dropped, "train/skipped": 1}, []
        self.actor.qat.clear_counters()
        self.actor.routing.clear_counters()
        metrics, train_lp = self.actor.train_step(samples, self.cfg.algo)
        routing = self.actor.routing_agreement()  # collective: every rank
        m = mismatch_metrics(
            [s.rollout_logprobs for s in samples], [t.tolist() for t in train_lp], is_clip=self.cfg.algo.is_clip
        )
        out = {f"train/{k}": float(v) for k, v in metrics.items()}
        out["rollout/dropped_stale"] = dropped
        # the train step's parts (perf/train_s is their sum plus batching): the QAT forward that
        # recomputes the logprobs, the backward, the optimizer step
        out.update({f"perf/{k}_s": v for k, v in self.actor.step_times.items()})
        out.update({f"mismatch/{k}": v for k, v in routing.items()})
        out["_mismatch"] = m
        out["_records"] = [r for r in records if r is not None]
        return out, [t - torch.tensor(s.rollout_logprobs) for t, s in zip(train_lp, samples)]

    def _record(self, g: bytes | StoredRecord | None) -> GuidanceRecord | None:
        if g is None:
            return None
        if isinstance(g, StoredRecord):
            return self.store.get(g.key)
        return GuidanceRecord.from_bytes(g)

    def _routed(self, s: dict) -> torch.Tensor | None:
        """A sample's routed experts [T, layers, top_k] (None when the rollout sent none)."""
        return None if s.get("routed_experts") is None else sample_routed_experts(s, self.actor.arch)


def async_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
