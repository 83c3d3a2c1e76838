"""The embedded default's starting point: a tiny Qwen model taught the task for a few hundred
supervised steps, so RL starts with a nonzero reward. Cached by everything that determines it.

    tiny config + tokenizer + task + steps/lr/seed ──hash──► <cache>/<key>/ (HF checkpoint + tokenizer)
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from megatron_trace.data.prompts import ArithmeticTask
from megatron_trace.models import tiny_hf_config


def tiny_config_for(family: str, tokenizer, overrides: dict) -> dict:
    """The tiny HF config sized to the tokenizer (its vocab and special ids)."""
    base = {
        "vocab_size": tokenizer.vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
    }
    return tiny_hf_config(family, **{**base, **overrides})


def cache_key(hf_cfg: dict, tokenizer, task: ArithmeticTask, steps: int, lr: float, seed: int) -> str:
    blob = json.dumps(
        {
            "cfg": hf_cfg,
            "vocab": tokenizer.vocab_size,
            "chars": getattr(tokenizer, "chars", ""),
            "task": _task_key(task),
            "steps": steps,
            "lr": lr,
            "seed": seed,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _task_key(task) -> list:
    """What of the prompt source shapes the warm start (any source with sample() and solutions)."""
    if isinstance(task, ArithmeticTask):
        return [task.max_operand, task.ops, task.template, task.worked, task.eval_fraction]
    return [type(task).__name__, sorted((k, v) for k, v in vars(task).items() if k != "tokenizer")]


def build_warm_start(
    cache_root: str | Path,
    family: str,
    tokenizer,
    task: ArithmeticTask,
    *,
    overrides: dict,
    steps: int,
    lr: float,
    seed: int,
    batch: int = 64,
    log=print,
) -> Path:
    """Return the cached checkpoint dir, training it first when missing (atomic: tmp + rename)."""
    hf_cfg = tiny_config_for(family, tokenizer, overrides)
    out = Path(cache_root) / cache_key(hf_cfg, tokenizer, task, steps, lr, seed)
    if (out / "config.json").exists():
        return out
    from transformers import AutoConfig, AutoModelForCausalLM  # seconds of imports: only when training
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its "Writing model shards" bar says nothing about a 1-file save

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**hf_cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if steps:
        _train(model, tokenizer, task, steps=steps, lr=lr, batch=batch, seed=seed, log=log)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save(str(tmp))
    tmp.replace(out)
    return out


def warm_start_for(cfg, tokenizer, task: ArithmeticTask, log=print) -> Path:
    """The run's cached starting checkpoint (next to its run dir), built on first use."""
    t = cfg.trainer
    return build_warm_start(
        Path(cfg.logging.run_dir).parent / ".warm_start_cache",
        cfg.model.family,
        tokenizer,
        task,
        overrides=cfg.model.tiny,
        steps=t.warm_start_steps,
        lr=t.warm_start_lr,
        seed=t.seed,
        log=log,
    )


def _train(model, tokenizer, task: ArithmeticTask, *, steps: int, lr: float, batch: int, seed: int, log) -> None:
    """Teacher forcing on prompt + answer + eos, loss on the answer tokens only."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / steps))
    model.train()
    for step in range(steps):
        prompts = task.sample(batch, step=-(seed * 100_000 + step + 1))  # disjoint from RL steps >= 0
        seqs, masks = [], []
        for p in prompts:
            prompt = tokenizer.encode_prompt(p.text)
            answer = tokenizer.encode(p.solution or p.answer) + [tokenizer.eos_id]
            seqs.append(prompt + answer)
            masks.append([0] * len(prompt) + [1] * len(answer))
        width = max(map(len, seqs))
        ids = torch.full((batch, width), tokenizer.pad_id)
        labels = torch.full((batch, width), -100)
        for i, (s, m) in enumerate(zip(seqs, masks)):
            ids[i, : len(s)] = torch.tensor(s)
            labels[i, : len(s)] = torch.where(torch.tensor(m) == 1, torch.tensor(s), torch.tensor(-100))
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"warm start step {step}/{steps}: loss {loss.item():.3f}")


def main(argv: list[str] | None = None) -> int:
    """`python -m megatron_trace.run.warm_start --config FILE [section.key=value ...]`: build (or find) the
    run's starting checkpoint the way `megatron_trace.train` does and print its directory on stdout
    (progress goes to stderr). Launch scripts use it to start rollout servers before the trainer."""
    import argparse
    import sys

    from megatron_trace.config import parse_cli
    from megatron_trace.data import TASKS, ArithmeticTask, CharTokenizer, load_tokenizer

    ap = argparse.ArgumentParser(
        prog="python -m megatron_trace.run.warm_start",
        description="Build (or find) the run's starting checkpoint; print its directory.",
    )
    cfg, _ = parse_cli(ap, argv)
    if cfg.model.path:  # a real checkpoint: nothing to build
        print(cfg.model.path)
        return 0
    if cfg.rollout.prompts not in TASKS:
        ap.error(
            f"the tiny warm start trains on a built-in task ({', '.join(TASKS)}); set model.path for other prompts"
        )
    tok = CharTokenizer() if cfg.model.tokenizer == "char" else load_tokenizer(cfg.model.tokenizer)
    task = ArithmeticTask.named(cfg.rollout.prompts, cfg.trainer.seed, tok, cfg.rollout.eval_fraction)
    out = warm_start_for(cfg, tok, task, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(out, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
