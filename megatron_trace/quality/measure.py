"""Rollout quality against BF16: what each quantization setting does to the policy itself.

    python -m megatron_trace.quality --model-path HF_DIR --prompts prompts.jsonl [--out DIR]
        [--settings bf16:bf16:bf16 w4a4:fp8:nvfp4 ...] [--max-new-tokens 48] [--dtype float32]
        [--backend embedded|sglang]

The mismatch probe (probe.py) measures train/rollout agreement, which a damaged rollout can
satisfy perfectly; this measures the damage. For each setting WEIGHTS:K:V (weights bf16 | w4a16 |
w4a4, NVFP4 on the policy's default targets; K and V in bf16 | fp8 | nvfp4 | mxfp4, K also de-biased as
e.g. `nvfp4+debias`, quant.kv_k_debias):

- NLL per token, teacher-forced on the BF16 model's own greedy continuations, and its increase
  over BF16 (nats/token); top-1 agreement with those continuations;
- the setting's own greedy answers, side by side with BF16's, and their accuracy where the prompt
  carries an `answer` (the math verifier of megatron_trace.data.rewards on the last boxed
  expression, else on the last number);
- a markdown table, quality.json and quality.png under --out.

Prompts: JSONL lines {"prompt": text} (tokenized as is), {"messages": [...]} (the checkpoint
tokenizer's chat template, generation prompt added) or {"input_ids": [...]}; optional "answer".
Runs on the embedded engine (greedy answers through its decode path; the teacher-forced pass is
one prefill over the engine's paged, quantized KV cache, the numerics decode uses) or, with
`--backend sglang`, on a real SGLang server with the TRACE plugin started per setting
(quality_backends.py: SGLang's own input-token logprobs over its quantized KV).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from megatron_trace.models import QuantPolicy
from megatron_trace.models.quant_policy import KV_FORMATS
from megatron_trace.rl.mismatch import bucket_means

WEIGHTS = ("bf16", "w4a16", "w4a4")
KV = KV_FORMATS
DEBIASED = "+debias"  # K minus its rotated k_proj bias before quantizing (quant.kv_k_debias)
K_FORMATS = (*KV, *(f + DEBIASED for f in KV if f != "bf16"))
REFERENCE = "bf16:bf16:bf16"
DEFAULT_SETTINGS = (
    REFERENCE,
    "bf16:nvfp4:nvfp4",
    "bf16:bf16:nvfp4",
    "bf16:nvfp4:bf16",
    "bf16:fp8:nvfp4",
    "w4a4:bf16:bf16",
    "w4a4:nvfp4:nvfp4",
    "w4a4:fp8:nvfp4",
)
# The plot's line: the quality gate's default NLL limit (quant.max_nll_increase; quality_gate.py).
GATE_NATS_PER_TOKEN = 0.05


@dataclass(frozen=True)
class Setting:
    weights: str
    k: str
    v: str
    # The run's whole policy when the setting came from one (the quality gate): its FP4 format, targets,
    # BF16 layer bands and activation scales are what gets measured, not a default-policy look-alike.
    base: QuantPolicy | None = field(default=None, compare=False, repr=False)

    @classmethod
    def parse(cls, spec: str) -> Setting:
        parts = spec.split(":")
        if len(parts) != 3:
            raise ValueError(f"a setting is WEIGHTS:K:V (e.g. w4a4:fp8:nvfp4); got {spec!r}")
        s = cls(*parts)
        if s.weights not in WEIGHTS:
            raise ValueError(f"setting {spec!r}: weights must be one of {', '.join(WEIGHTS)}; got {s.weights!r}")
        for side, fmt, allowed in (("K", s.k, K_FORMATS), ("V", s.v, KV)):
            if fmt not in allowed:
                raise ValueError(f"setting {spec!r}: {side} must be one of {', '.join(allowed)}; got {fmt!r}")
        return s

    @classmethod
    def of_policy(cls, policy: QuantPolicy) -> Setting:
        """The setting a (resolved) policy runs: its weights/activations and K/V formats."""
        w = "bf16" if not policy.enabled else ("w4a4" if policy.activations == "fp4" else "w4a16")
        debiased = policy.kv_k_debias and policy.k_format != "bf16"
        return cls(w, policy.k_format + (DEBIASED if debiased else ""), policy.v_format, base=policy)

    @property
    def name(self) -> str:
        return f"{self.weights}:{self.k}:{self.v}"

    def policy(self, targets: tuple[str, ...] | None = None) -> QuantPolicy:
        fp4 = self.weights != "bf16"
        b = self.base
        if b is not None and Setting.of_policy(b) == self:
            return b
        fields = dict(
            weights="fp4" if fp4 else "bf16",
            activations="fp4" if self.weights == "w4a4" else "bf16",
            kv="bf16",
            kv_k=self.k.removesuffix(DEBIASED),
            kv_v=self.v,
            kv_k_debias=self.k.endswith(DEBIASED),
        )
        if b is not None:  # the run's policy with this setting's weights and K/V
            return replace(b, format=(b.format if b.format != "bf16" else "nvfp4") if fp4 else "bf16", **fields)
        return QuantPolicy(format="nvfp4" if fp4 else "bf16", targets=targets or QuantPolicy().targets, **fields)


# ------------------------------------------------------------------ prompts
def load_prompts(path: str | Path, model_path: str | Path) -> list[dict]:
    """[{"ids": [...], "text": str | None, "answer": str | None}] from a JSONL file (data/jsonl.py's
    prompt lines; text through the checkpoint's tokenizer)."""
    from megatron_trace.data.jsonl import prompt_ids, read_lines

    rows = []
    for where, item in read_lines(path):
        ids, text = prompt_ids(item, lambda: _tokenizer(str(model_path)), where)
        rows.append({"ids": ids, "text": text, "answer": item.get("answer") if isinstance(item, dict) else None})
    return rows


@functools.lru_cache(maxsize=2)
def _tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def verify_answer(text: str, answer: str) -> float:
    """The math verifier on the response's last boxed expression or, when it boxes nothing (chat
    models answer "17 + 25 equals 42."), on its last number."""
    from megatron_trace.data.rewards import last_boxed, math_verify

    if last_boxed(text) is None:
        numbers = _NUMBER.findall(text)
        text = numbers[-1].rstrip(",") if numbers else text
    return math_verify(text, str(answer))


def accuracy(texts: list[str] | None, prompts: list[dict]) -> float | None:
    """Mean verify_answer over the prompts that carry an answer (None: no answers or no texts)."""
    if texts is None or not any(p["answer"] is not None for p in prompts):
        return None
    scored = [verify_answer(t, p["answer"]) for p, t in zip(prompts, texts) if p["answer"] is not None]
    return sum(scored) / len(scored)


def run(
    model_path,
    prompts: list[dict],
    settings: list[Setting],
    *,
    max_new_tokens: int = 48,
    dtype: str = "float32",
    targets: tuple[str, ...] | None = None,
    tokenizer=None,
    backend: str = "embedded",
    workdir: str | Path | None = None,
    reference: dict | None = None,
    url: str | None = None,
    api_key: str | None = None,
) -> dict:
    """The quality report (a JSON-friendly dict) of each setting against the BF16 reference, every
    setting (the reference too) served by `backend` (quality_backends: embedded | sglang).
    `reference`: an earlier report on the same prompts whose BF16 row is reused, not decoded again.
    backend "http": the running server at `url` serves the one setting (the BF16 row comes from `reference`)."""
    from megatron_trace.quality.backends import open_scorer

    if backend == "http" and reference is None:
        raise ValueError("quality.run(backend='http') scores the server's own setting: pass the BF16 reference report")
    ref_setting = Setting.parse(REFERENCE)
    settings = [ref_setting] + [s for s in settings if s != ref_setting]
    ref_out: list[list[int]] | None = None
    results = {}
    if reference is not None:
        if reference["num_prompts"] != len(prompts) or reference["max_new_tokens"] != max_new_tokens:
            raise ValueError("quality.run(reference=...) must come from the same prompts and max_new_tokens")
        results[REFERENCE] = reference["settings"][REFERENCE]
        ref_out, settings = results[REFERENCE]["outputs"], settings[1:]
    for s in settings:
        scorer = open_scorer(
            backend, model_path, s, dtype=dtype, targets=targets, workdir=workdir, url=url, api_key=api_key
        )
        try:
            outs = scorer.greedy(prompts, max_new_tokens)
            ref_out = outs if ref_out is None else ref_out
            nll, top1, nll_seqs = [], [], []
            for p, cont in zip(prompts, ref_out):
                a, b = scorer.teacher_forced(p["ids"], cont)
                nll += a
                top1 += b
                nll_seqs.append(a)
            kv_bytes = scorer.kv_bytes_per_token()
        finally:
            scorer.close()
        mean = sum(nll) / max(len(nll), 1)
        texts = [_decode(tokenizer, o) for o in outs] if tokenizer else None
        results[s.name] = {
            "setting": {"weights": s.weights, "k": s.k, "v": s.v},
            "nll_per_token": mean,
            "tokens": len(nll),
            # KV error accumulates along the answer: NLL per token by answer-position bucket
            "nll_by_position": bucket_means(nll_seqs),
            "top1_agreement": sum(top1) / max(len(top1), 1),
            "same_greedy_answers": sum(o == r for o, r in zip(outs, ref_out)) / len(prompts),
            "accuracy": accuracy(texts, prompts),
            "kv_bytes_per_token": kv_bytes,
            "outputs": outs,
            "texts": texts,
        }
    base, base_pos = results[REFERENCE]["nll_per_token"], results[REFERENCE]["nll_by_position"]
    for r in results.values():
        r["nll_increase"] = r["nll_per_token"] - base
        r["nll_increase_by_position"] = {k: v - base_pos[k] for k, v in r["nll_by_position"].items()}
    return {
        "model_path": str(model_path),
        "backend": backend,
        "dtype": dtype,
        "max_new_tokens": max_new_tokens,
        "num_prompts": len(prompts),
        "reference": REFERENCE,
        "settings": results,
    }


def _decode(tokenizer, ids: list[int]) -> str:
    """A greedy answer as text; ids past the tokenizer's vocabulary (an untrained model's padded rows,
    which a server does not mask) are dropped, as the rollout drops them."""
    vocab = getattr(tokenizer, "vocab_size", None)
    return tokenizer.decode([i for i in ids if vocab is None or i < vocab], skip_special_tokens=True)


# ------------------------------------------------------------------ reports
def format_table(report: dict) -> str:
    lines = [
        "| weights:K:V | NLL/token | increase vs BF16 | top-1 agreement | same greedy answer | accuracy | KV B/token |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["settings"].items():
        acc = "—" if r["accuracy"] is None else f"{r['accuracy']:.2f}"
        lines.append(
            f"| {name} | {r['nll_per_token']:.4f} | {r['nll_increase']:+.4f} | {r['top1_agreement']:.2%} | "
            f"{r['same_greedy_answers']:.2%} | {acc} | {r['kv_bytes_per_token']:.0f} |"
        )
    return "\n".join(lines)


def format_positions(report: dict) -> str:
    """NLL increase vs BF16 per answer-position bucket, one row per setting."""
    buckets = list(next(iter(report["settings"].values()))["nll_by_position"])
    lines = [
        "| weights:K:V | " + " | ".join(b.replace("_", "-") for b in buckets) + " |",
        "|---|" + "---:|" * len(buckets),
    ]
    for name, r in report["settings"].items():
        inc = r["nll_increase_by_position"]
        lines.append(f"| {name} | " + " | ".join(f"{inc[b]:+.4f}" for b in buckets) + " |")
    return "\n".join(lines)


def format_answers(report: dict, prompts: list[dict], width: int = 60) -> str:
    """Each prompt's greedy answer under every setting, side by side (text when a tokenizer is known)."""
    out = []
    for i, p in enumerate(prompts):
        out.append(f"### prompt {i}: {(p['text'] or str(p['ids'][:16]))[:width]!r}")
        for name, r in report["settings"].items():
            ans = r["texts"][i] if r["texts"] else str(r["outputs"][i][:24])
            out.append(f"- {name}: {ans[: width * 2]!r}")
    return "\n".join(out)


def plot(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["settings"])
    inc = [report["settings"][n]["nll_increase"] for n in names]
    top1 = [report["settings"][n]["top1_agreement"] for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(16, 0.45 * len(names) + 2.5))
    axes[0].barh(names, inc, color=["tab:red" if v > GATE_NATS_PER_TOKEN else "tab:green" for v in inc])
    axes[0].axvline(GATE_NATS_PER_TOKEN, color="k", ls="--", lw=0.8)
    axes[0].set_xlabel("NLL increase vs BF16 (nats/token)")
    axes[1].barh(names, top1)
    axes[1].set_xlim(min(top1 + [0.9]) - 0.02, 1.0)
    axes[1].set_xlabel("top-1 agreement with BF16 continuations")
    for ax in axes[:2]:
        ax.invert_yaxis()
    for n in names:  # by answer position: where along the answer the loss accrues
        inc_pos = report["settings"][n]["nll_increase_by_position"]
        axes[2].plot(range(len(inc_pos)), list(inc_pos.values()), marker="o", label=n)
        axes[2].set_xticks(range(len(inc_pos)), [b.replace("_", "-") for b in inc_pos], rotation=45)
    axes[2].axhline(0, color="k", lw=0.5)
    axes[2].set_xlabel("answer position")
    axes[2].set_ylabel("NLL increase vs BF16")
    axes[2].legend(fontsize=7)
    fig.suptitle(
        f"{Path(report['model_path']).name}: {report['num_prompts']} prompts x <= {report['max_new_tokens']} tokens"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ the train CLI's hook
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m megatron_trace.quality", description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True, help="HF checkpoint directory (config.json + safetensors)")
    ap.add_argument("--prompts", required=True, help="JSONL: {prompt | messages | input_ids, [answer]} per line")
    ap.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS), help="WEIGHTS:K:V each")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--targets", default=None, help="comma-separated FP4 module patterns (default: MLP + experts)")
    ap.add_argument("--out", default=None, help="directory for quality.json and quality.png")
    ap.add_argument(
        "--backend",
        default="embedded",
        choices=["embedded", "sglang"],
        help="sglang: a real SGLang server per setting (python -m sglang_backend.launch --backend sglang)",
    )
    args = ap.parse_args(argv)
    if args.backend == "sglang" and args.targets:
        ap.error("--targets is not supported with --backend sglang (the launcher serves the default FP4 targets)")
    if args.max_new_tokens < 1:
        ap.error(f"--max-new-tokens must be >= 1; got {args.max_new_tokens}")
    try:
        args.settings = [Setting.parse(s) for s in args.settings]
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    prompts = load_prompts(args.prompts, args.model_path)
    tok = None if all(p["text"] is None for p in prompts) else _tokenizer(args.model_path)
    targets = tuple(args.targets.split(",")) if args.targets else None
    with tempfile.TemporaryDirectory(prefix="quality-") as tmp:
        workdir = Path(args.out) if args.out else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        rep = run(
            args.model_path,
            prompts,
            args.settings,
            max_new_tokens=args.max_new_tokens,
            dtype=args.dtype,
            targets=targets,
            tokenizer=tok,
            backend=args.backend,
            workdir=workdir,
        )
    print(format_table(rep))
    print()
    print(format_positions(rep))
    print()
    print(format_answers(rep, prompts))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "quality.json").write_text(json.dumps(rep, indent=1))
        plot(rep, out / "quality.png")
        print(f"\nwrote {out / 'quality.json'} and {out / 'quality.png'}")
    bad = [n for n, r in rep["settings"].items() if not math.isfinite(r["nll_per_token"])]
    return 1 if bad else 0
