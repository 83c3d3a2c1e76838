"""What the rollout benchmarks (bench_rollout.py, bench_rollout_real.py) share to set the embedded
engine beside HF transformers: the prompts, HF's `generate` as the baseline (one left-padded batch,
EOS off, the same greedy or temperature-1 decoding) and interleaved timing of every contender."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token ids in [3, vocab): no pad (0), bos (1) or eos (2) inside prompts."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


def interleaved_times(runs: dict, rounds: int) -> tuple[dict, dict]:
    """One warm-up call each, then `rounds` rounds timing every contender once in turn (drift on a
    shared machine hits all alike). Returns ({name: [seconds]}, {name: last output})."""
    times, last = {k: [] for k in runs}, {k: f() for k, f in runs.items()}
    for _ in range(rounds):
        for k, f in runs.items():
            t0 = time.perf_counter()
            last[k] = f()
            times[k].append(time.perf_counter() - t0)
    return times, last


def hf_generate_fn(path: Path, args):
    """prompts -> the [B, new_tokens] ids HF `generate` appends (left-padded batch, EOS off)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype)).eval()
    gc = model.generation_config
    gc.eos_token_id = None  # = ignore_eos: every row generates exactly new_tokens
    gc.pad_token_id = 0
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, use_cache=True)
    if args.sampling == "greedy":
        kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    else:
        kw.update(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)

    @torch.inference_mode()
    def run(prompts):
        ids, mask = left_pad(prompts, pad_id=0)
        return model.generate(ids, attention_mask=mask, **kw)[:, ids.shape[1] :]

    return run
