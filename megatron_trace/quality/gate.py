"""The run's rollout-quality gate: what its quantization does to the policy, measured before step 0.

    train.py  ── eval prompts, rollout dtype, max_new_tokens, the run's verifier ──▶  gate()
                   │ quality.run: BF16 vs the run's WEIGHTS:K:V on the embedded engine, or for
                   │ rollout.backend=http on its SGLang server (an embedded server: in-process)
                   ▼
              within quant.max_nll_increase and quant.max_accuracy_drop? ── yes ──▶ run (metrics logged)
                   │ no
                   ├── quant.accept_quality_loss=true ──▶ run anyway, loudly, the loss in quality/*
                   ▼
              candidates (cheapest KV first, same weights) until one passes
                   ▼
              QualityGateError: the table of what was tried and the cheapest setting that passes

Train/rollout agreement (TRACE, the probe) cannot see this: a rollout can be matched exactly and
still be broken. Greedy answers at the run's full answer length count, not only the NLL: a long
worked answer's many easy tokens can hide its wrong final digits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from megatron_trace.models import ModelArch, QuantPolicy
from megatron_trace.models.quant_policy import kv_side_bits
from megatron_trace.quality import measure as quality

MAX_CANDIDATES = 4  # each costs one greedy decode of the prompts at the run's answer length


class QualityGateError(RuntimeError):
    """The run's quantization loses more than its limits allow; the message names what passes."""


class QualityGateUnmeasured(RuntimeError):
    """The gate cannot judge: its BF16 reference answered nothing. Not a verdict on the policy, so
    quant.accept_quality_loss does not wave it through."""


@dataclass
class GateResult:
    setting: str
    nll_increase: float
    accuracy: float | None  # greedy, under the run's verifier; None without answers
    bf16_accuracy: float | None
    passed: bool
    report: dict  # quality.run's, with every setting tried
    rewards: list[float | None]  # per prompt, the run's setting then BF16 (None: no verifier or answer)
    bf16_rewards: list[float | None]

    def metrics(self) -> dict[str, float]:
        m = {"quality/nll_increase": self.nll_increase, "quality/passed": float(self.passed)}
        if self.accuracy is not None:
            m.update({"quality/accuracy": self.accuracy, "quality/bf16_accuracy": self.bf16_accuracy})
        return m

    def answers(self, prompts: list[dict], n: int) -> list[dict]:
        """The first n prompts' greedy answers, the run's setting beside BF16's."""
        r, ref = self.report["settings"][self.setting], self.report["settings"][quality.REFERENCE]
        if r["texts"] is None:
            return []
        rows = zip(prompts, r["texts"], ref["texts"], self.rewards, self.bf16_rewards)
        return [
            {
                "prompt": p["text"],
                "answer": p["answer"],
                "response": t,
                "reward": a,
                "bf16_response": u,
                "bf16_reward": b,
            }
            for p, t, u, a, b in list(rows)[:n]
        ]


def candidates(run: quality.Setting, arch: ModelArch) -> list[quality.Setting]:
    """KV settings to try when the run's fails, fewest bits per K+V pair first, the run's weights kept;
    K de-biased where the model has a k_proj bias (Qwen2/2.5: what plain K loses there)."""
    k_opts = [f + quality.DEBIASED if arch.qkv_bias else f for f in ("nvfp4", "fp8")] + ["bf16"]
    v_opts = ("nvfp4", "bf16")
    if run.base is not None and (run.base.bf16_layers_start or run.base.bf16_layers_end):
        k_opts, v_opts = ["bf16"], ("bf16",)  # BF16 layer bands: the engine serves them with BF16 KV only
    out = {quality.Setting(run.weights, k, v, base=run.base) for k in k_opts for v in v_opts} - {run}

    def bits(fmt: str) -> float:  # per element of one head's K or V row, scales included
        return kv_side_bits(fmt.removesuffix(quality.DEBIASED), arch.head_dim)

    return sorted(out, key=lambda s: (bits(s.k) + bits(s.v), s.name))


def _judge(report: dict, name: str, prompts: list[dict], score, limits: tuple[float, float]) -> GateResult:
    r, ref = report["settings"][name], report["settings"][quality.REFERENCE]
    scored = score is not None and r["texts"] is not None
    answered = [i for i, p in enumerate(prompts) if p["answer"] is not None]

    def rewards_of(texts) -> list[float | None]:
        """One call per setting: a batch scorer (the code reward) runs the answers in parallel."""
        out = [None] * len(prompts)
        if scored and texts is not None and answered:
            got = score([texts[i] for i in answered], [prompts[i]["answer"] for i in answered])
            for i, v in zip(answered, got):
                out[i] = v
        return out

    rewards, bf16_rewards = rewards_of(r["texts"]), rewards_of(ref["texts"])
    pairs = [(a, b) for a, b in zip(rewards, bf16_rewards) if a is not None]
    acc, ref_acc = (sum(x) / len(pairs) for x in zip(*pairs)) if pairs else (None, None)
    max_nll, max_drop = limits
    ok = r["nll_increase"] <= max_nll and (acc is None or ref_acc - acc <= max_drop)
    return GateResult(name, r["nll_increase"], acc, ref_acc, ok, report, rewards, bf16_rewards)


def _row(g: GateResult) -> str:
    acc = "—" if g.accuracy is None else f"{g.accuracy:.2f} (BF16 {g.bf16_accuracy:.2f})"
    return f"| {g.setting} | {g.nll_increase:+.4f} | {acc} | {'pass' if g.passed else 'FAIL'} |"


def gate(
    model_path,
    policy: QuantPolicy,
    prompts: list[dict],
    *,
    max_nll_increase: float,
    max_accuracy_drop: float,
    accept_loss: bool,
    max_new_tokens: int,
    dtype: str,
    tokenizer=None,
    score=None,
    log=print,
    url: str | None = None,
    api_key: str | None = None,
) -> GateResult | None:
    """The run's setting (its resolved `policy`) judged against BF16 on `prompts` ([{"ids", "text",
    "answer"}]); raises QualityGateError when it fails and `accept_loss` is off, after finding the
    cheapest candidate that passes (at most MAX_CANDIDATES tried). None when the policy quantizes
    nothing. `url`: the run's setting is scored on that running rollout server (SGLang with the
    plugin), BF16 and the candidates on the embedded engine beside it. `score(texts, answers)`: the
    run's reward of a setting's greedy answers, all at once (the code reward runs them in parallel)."""
    arch = ModelArch.from_hf_config(model_path)
    policy.check_resolved(arch)
    setting = quality.Setting.of_policy(policy)
    if setting.name == quality.REFERENCE:
        log("rollout quality gate: the rollout quantizes nothing (BF16), nothing to measure")
        return None
    limits = (max_nll_increase, max_accuracy_drop)
    kw = dict(max_new_tokens=max_new_tokens, dtype=dtype, targets=policy.targets, tokenizer=tokenizer)
    if url is None:
        report = quality.run(model_path, prompts, [setting], **kw)
    else:
        ref = quality.run(model_path, prompts, [], **kw)
        served = dict(kw, targets=None)  # the server quantizes what it was launched with
        report = quality.run(
            model_path, prompts, [setting], reference=ref, backend="http", url=url, api_key=api_key, **served
        )
    where = _where(prompts, dtype, max_new_tokens) + (f", served by {url}" if url else "")
    _check_reference_answered(report, where)
    res = _judge(report, setting.name, prompts, score, limits)
    log(f"rollout quality gate ({where}): {_row(res)}")
    if res.passed:
        return res
    if accept_loss:
        log(
            f"WARNING: rollout quality gate FAILED for {setting.name} (limits: {max_nll_increase} nats/token, "
            f"accuracy drop {max_accuracy_drop}); running anyway because quant.accept_quality_loss=true. "
            "The loss is logged under quality/*."
        )
        return res
    tried, passing = [res], None
    for cand in candidates(setting, arch)[:MAX_CANDIDATES]:
        rep = quality.run(model_path, prompts, [cand], reference=report, **kw)
        g = _judge(rep, cand.name, prompts, score, limits)
        tried.append(g)
        log(f"rollout quality gate, candidate: {_row(g)}")
        if g.passed:
            passing = g
            break
    table = "\n".join(["| weights:K:V | NLL/token vs BF16 | greedy accuracy | gate |", "|---|---:|---:|---|"])
    table += "\n" + "\n".join(_row(g) for g in tried)
    fix = (
        f"the cheapest that passes is {passing.setting}: set {_keys(passing.setting)}"
        if passing
        else f"none of the {len(tried) - 1} cheapest KV candidates passed: try quant.activations=bf16 or BF16 weights"
    )
    raise QualityGateError(
        f"rollout quantization {setting.name} (weights:K:V) fails the quality gate on {where} "
        f"(limits: quant.max_nll_increase={max_nll_increase} nats/token, "
        f"quant.max_accuracy_drop={max_accuracy_drop}):\n{table}\n{fix}; or quant.accept_quality_loss=true "
        "to run anyway with the loss logged (python -m megatron_trace.quality compares more settings)"
    )


def _check_reference_answered(report: dict, where: str) -> None:
    """Every BF16 answer empty (no text, or without a tokenizer no tokens): a reference that answered
    nothing scores 0 and any setting "passes" against it (what an engine failing every request looked
    like before aborted requests raised)."""
    ref = report["settings"][quality.REFERENCE]
    answers = ref["outputs"] if ref["texts"] is None else [t.strip() for t in ref["texts"]]
    if answers and not any(answers):
        raise QualityGateUnmeasured(
            f"rollout quality gate on {where}: the BF16 reference's greedy answers are all empty "
            f"({len(answers)} of {len(answers)}), so there is nothing to measure the quantization against. "
            "The model answers nothing in BF16: check the checkpoint, its tokenizer and the prompts "
            "(quant.quality_prompts of the eval split), or set quant.quality_gate=false to run unmeasured"
        )


def _where(prompts: list[dict], dtype: str, max_new_tokens: int) -> str:
    return f"{len(prompts)} eval prompts, {dtype}, up to {max_new_tokens} new tokens"


def _keys(name: str) -> str:
    s = quality.Setting.parse(name)
    return (
        f"quant.kv_k={s.k.removesuffix(quality.DEBIASED)} quant.kv_v={s.v} "
        f"quant.kv_k_debias={str(s.k.endswith(quality.DEBIASED)).lower()}"
    )


def _run_inputs(cfg, policy: QuantPolicy, reward, log) -> tuple[QuantPolicy, dict]:
    """The run's policy as the gate measures it and gate()'s keyword arguments from the config."""
    from megatron_trace.data import score_all

    q, rc = cfg.quant, cfg.rollout
    if policy.activation_scale == "static":  # its engine loads the BF16 checkpoint: no input_scale yet
        log("note: the quality gate measures per-token activation scales (static ones come after)")
        policy = dataclasses.replace(policy, activation_scale="per_token")
    return policy, dict(
        max_nll_increase=q.max_nll_increase,
        max_accuracy_drop=q.max_accuracy_drop,
        max_new_tokens=rc.max_new_tokens,
        dtype=rc.dtype,
        score=lambda texts, answers: score_all(reward, texts, answers).rewards,
    )


def gate_run(
    cfg, policy: QuantPolicy, model_path, tok, prompts, log=print, reward=None
) -> tuple[GateResult | None, list[dict]]:
    """The gate as a run applies it (rank 0, before the actor exists): the run's resolved policy on
    `quant.quality_prompts` of its eval split (a code run's: of HumanEval, its evaluation), its
    tokenizer, answer length, dtype and reward (`reward`: the run's, else built from the config).
    Returns the result (None: nothing measured) and the prompts it decoded."""
    from megatron_trace.data import load_humaneval, reward_for

    q, rc = cfg.quant, cfg.rollout
    if not q.quality_gate:
        log("WARNING: quant.quality_gate=false: nothing checks what FP4 does to this policy")
        return None, []
    if rc.reward == "code":
        picked = load_humaneval(q.quality_prompts)
    else:
        picked = prompts.eval_set(q.quality_prompts) or prompts.sample(q.quality_prompts, 0)
    rows = [{"ids": tok.encode_prompt(p.text), "text": p.text, "answer": p.answer} for p in picked]
    policy, kw = _run_inputs(cfg, policy, reward if reward is not None else reward_for(rc), log)
    if rc.backend == "http":
        kw.update(url=_served_url(cfg, policy, log), api_key=rc.api_key or None)
    return gate(model_path, policy, rows, accept_loss=q.accept_quality_loss, tokenizer=tok, log=log, **kw), rows


def _numerics(p: QuantPolicy) -> tuple:
    """What a resolved policy does to the rollout: its formats per site (a kv shorthand read as K and V),
    not how it was written; activation scales aside (the gate measures per-token ones)."""
    return (p.format, p.weights, p.activations, p.k_format, p.v_format, p.kv_k_debias, tuple(p.targets)) + (
        p.bf16_layers_start,
        p.bf16_layers_end,
    )


def _served_url(cfg, policy: QuantPolicy, log) -> str | None:
    """rollout.backend=http: the server the gate scores (every server serves one model: the first),
    or None when it is an embedded server, whose numerics the in-process engine has bit for bit: then
    its policy must be the run's, checked here, or the gate would measure a look-alike."""
    from sglang_backend.client import RolloutClient

    url = cfg.rollout.urls[0]
    client = RolloutClient([url], api_key=cfg.rollout.api_key or None)
    try:
        served = client.model_info(url).get("quant_policy")
    finally:
        client.close()
    if served is None:  # SGLang: its own numerics, scored through its /generate
        return url
    if _numerics(QuantPolicy.from_dict(served)) != _numerics(policy):
        raise ValueError(
            f"the rollout server {url} serves quant policy {served}, but the run's is {policy.to_dict()}: "
            "restart it with the run's quant settings (python -m sglang_backend.launch ...)"
        )
    log(f"rollout quality gate: {url} is an embedded server with the run's policy; scored in-process")
    return None


def measure_after(
    cfg, policy: QuantPolicy, model_path, run_dir, hf_sd: dict, rows: list[dict], tok, log=print, reward=None
) -> GateResult:
    """The gate's measurement on the trained weights `hf_sd` (HF names, exported BF16 to
    run_dir/final_bf16, then emptied): the run's answers beside BF16's after training, and what FP4
    costs the policy now. Never stops anything."""
    import json

    import torch

    from megatron_trace.data import reward_for
    from megatron_trace.transfer.export import export_checkpoint

    arch = ModelArch.from_hf_config(model_path)
    hf = json.loads((Path(model_path) / "config.json").read_text())
    out = export_checkpoint(hf_sd, arch, Path(run_dir) / "final_bf16", fmt="bf16", dtype=torch.bfloat16, hf_config=hf)
    hf_sd.clear()  # the engines below load the export; the real 0.5B's run peaks near a 24 GB box's RAM
    policy, kw = _run_inputs(cfg, policy, reward if reward is not None else reward_for(cfg.rollout), log)
    setting = quality.Setting.of_policy(policy)
    report = quality.run(
        out,
        rows,
        [setting],
        max_new_tokens=kw["max_new_tokens"],
        dtype=kw["dtype"],
        targets=policy.targets,
        tokenizer=tok,
    )
    res = _judge(report, setting.name, rows, kw["score"], (kw["max_nll_increase"], kw["max_accuracy_drop"]))
    log(f"rollout quality after training ({_where(rows, kw['dtype'], kw['max_new_tokens'])}): {_row(res)}")
    return res
