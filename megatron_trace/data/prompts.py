"""Prompt sources for the RL loop: a synthetic verifiable arithmetic task and JSONL datasets.

Both follow one contract: `sample(n, step) -> list[Prompt]` depends only on (seed, step, n), never
on how many batches were drawn before, so a `--resume` at step k sees exactly the prompts the
original run saw at step k. Prompt ids are unique per (step, index) because the guidance store
keys records by sample id and releases them per step.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass


@dataclass
class Prompt:
    prompt_id: str
    text: str  # the raw prompt (before any chat template)
    answer: str  # the reference answer the reward function checks against
    input_ids: list[int] | None = None  # tokenized prompt (chat template applied) when a tokenizer was given


def _rng(*key) -> random.Random:
    # Seeding with a string goes through SHA-512 in CPython: stable across processes and
    # unaffected by PYTHONHASHSEED, unlike hash(tuple).
    return random.Random(":".join(str(k) for k in key))


class ArithmeticTask:
    """"a+b=" -> "c": small enough that a tiny model learns it in a few hundred GRPO steps.

    Operands are drawn from 0..max_operand. Subtraction orders its operands so the answer is never
    negative (a tiny model then has no sign to learn); "*" is allowed for a harder variant.
    With the defaults answers are 0..18 (a sum of two single digits).
    """

    OPS = ("+", "-", "*")

    def __init__(self, seed: int = 0, max_operand: int = 9, ops: tuple[str, ...] = ("+", "-"),
                 tokenizer=None, template: str = "{a}{op}{b}=") -> None:
        bad = [op for op in ops if op not in self.OPS]
        if not ops or bad:
            raise ValueError(f"ArithmeticTask ops must be a non-empty subset of {self.OPS}; got {ops}")
        if max_operand < 1:
            raise ValueError(f"ArithmeticTask max_operand must be >= 1; got {max_operand}")
        for key in ("{a}", "{op}", "{b}"):
            if key not in template:
                raise ValueError(f"ArithmeticTask template must contain {key}; got {template!r}")
        self.seed, self.max_operand, self.ops = seed, max_operand, tuple(ops)
        self.tokenizer, self.template = tokenizer, template

    def make(self, a: int, op: str, b: int) -> tuple[str, str]:
        """The prompt text and answer for one problem."""
        if op == "-" and a < b:
            a, b = b, a
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return self.template.format(a=a, op=op, b=b), str(value)

    def sample(self, n: int, step: int) -> list[Prompt]:
        rng = _rng("arith", self.seed, step)
        out = []
        for i in range(n):
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            text, answer = self.make(a, rng.choice(self.ops), b)
            ids = self.tokenizer.encode_prompt(text) if self.tokenizer is not None else None
            out.append(Prompt(f"s{step}-p{i}", text, answer, ids))
        return out


class JsonlPrompts:
    """Prompts from a JSONL file, one object per line with "prompt" and "answer" (an optional
    "id" names the prompt). Every line is validated at load so a bad line fails the run before any
    rollout, naming its line number. Blank lines are skipped.

    Order: the stream of prompts is a sequence of epochs, each a permutation of the file drawn
    from (shuffle_seed, epoch); step k takes items [k*n, (k+1)*n) of that stream.
    """

    def __init__(self, path: str | os.PathLike, tokenizer=None, shuffle_seed: int = 0) -> None:
        self.path = os.fspath(path)
        self.tokenizer, self.shuffle_seed = tokenizer, shuffle_seed
        self.items: list[tuple[str, str, str]] = []  # (source id, prompt, answer)
        with open(self.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    self.items.append(self._parse(line, lineno))
        if not self.items:
            raise ValueError(f"{self.path}: no prompts (the file is empty)")
        self._perm_cache: dict[int, list[int]] = {}

    def _parse(self, line: str, lineno: int) -> tuple[str, str, str]:
        where = f"{self.path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object with 'prompt' and 'answer'; got {type(obj).__name__}")
        for key in ("prompt", "answer"):
            if key not in obj:
                raise ValueError(f"{where}: missing key {key!r}")
        prompt, answer = obj["prompt"], obj["answer"]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: 'prompt' must be a non-empty string; got {prompt!r}")
        # Numeric answers are common in math sets; the verifier compares strings, so keep the text.
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"{where}: 'answer' must be a string or a number; got {answer!r}")
        return str(obj.get("id", f"L{lineno}")), prompt, str(answer)

    def __len__(self) -> int:
        return len(self.items)

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perm_cache:
            if len(self._perm_cache) > 4:  # resume jumps forward; old epochs are never revisited
                self._perm_cache.clear()
            perm = list(range(len(self.items)))
            _rng("jsonl", self.shuffle_seed, epoch).shuffle(perm)
            self._perm_cache[epoch] = perm
        return self._perm_cache[epoch]

    def sample(self, n: int, step: int) -> list[Prompt]:
        out, size = [], len(self.items)
        for i in range(n):
            pos = step * n + i
            src, prompt, answer = self.items[self._perm(pos // size)[pos % size]]
            ids = self.tokenizer.encode_prompt(prompt) if self.tokenizer is not None else None
            out.append(Prompt(f"s{step}-p{i}-{src}", prompt, answer, ids))
        return out
