"""Prompt sources for the RL loop: a synthetic verifiable arithmetic task and JSONL datasets
(data/word_problems.py and data/code_tasks.py hold the other generated tasks).

Both follow one contract: `sample(n, step) -> list[Prompt]` depends only on (seed, step, n), never
on how many batches were drawn before, so a `--resume` at step k sees exactly the prompts the
original run saw at step k. Prompt ids are unique per (step, index) because the guidance store
keys records by sample id and releases them per step.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

from .code_reward import answer_json, task_text
from .jsonl import read_lines


@dataclass
class Prompt:
    prompt_id: str
    text: str  # the raw prompt (before any chat template)
    answer: str  # the reference answer the reward function checks against
    input_ids: list[int] | None = None  # tokenized prompt (chat template applied) when a tokenizer was given
    solution: str | None = None  # the full worked answer supervised warm starts teach (default: answer)


def _rng(*key) -> random.Random:
    # Seeding with a string goes through SHA-512 in CPython: stable across processes and
    # unaffected by PYTHONHASHSEED, unlike hash(tuple).
    return random.Random(":".join(str(k) for k in key))


def in_eval_split(key: str, eval_fraction: float) -> bool:
    """Whether a problem (by its canonical text) belongs to the eval split: a hash of the problem
    alone, so every seed, step and run agrees, and a problem is never in both splits."""
    return eval_fraction > 0 and _rng("split", key).random() < eval_fraction


class ArithmeticTask:
    """ "a+b=" -> "c": small enough that a tiny model learns it in a few hundred GRPO steps.

    Operands are drawn from 0..max_operand. Subtraction orders its operands so the answer is never
    negative (a tiny model then has no sign to learn); "*" is allowed for a harder variant.
    With the defaults answers are 0..18 (a sum of two single digits).

    Splits: a fixed `eval_fraction` of the distinct problems (by hash, `in_eval_split`) is the
    eval set; `sample` (RL steps and the warm start) draws only from the rest, `eval_set` only
    from it. `worked=True` (addition only) teaches a digit-by-digit solution, least significant
    digit first with its carry, ending in the sum: "47+38=" -> "7+8=15,4+3+1=8,85"; the reward
    checks the final field (`final_answer`).
    """

    OPS = ("+", "-", "*")

    def __init__(
        self,
        seed: int = 0,
        max_operand: int = 9,
        ops: tuple[str, ...] = ("+", "-"),
        tokenizer=None,
        template: str = "{a}{op}{b}=",
        worked: bool = False,
        eval_fraction: float = 0.1,
    ) -> None:
        bad = [op for op in ops if op not in self.OPS]
        if not ops or bad:
            raise ValueError(f"ArithmeticTask ops must be a non-empty subset of {self.OPS}; got {ops}")
        if max_operand < 1:
            raise ValueError(f"ArithmeticTask max_operand must be >= 1; got {max_operand}")
        for key in ("{a}", "{op}", "{b}"):
            if key not in template:
                raise ValueError(f"ArithmeticTask template must contain {key}; got {template!r}")
        if worked and tuple(ops) != ("+",):
            raise ValueError(f"ArithmeticTask worked solutions exist for addition only (ops=('+',)); got {ops}")
        if not 0 <= eval_fraction < 1:
            raise ValueError(f"ArithmeticTask eval_fraction must be in [0, 1); got {eval_fraction}")
        self.seed, self.max_operand, self.ops = seed, max_operand, tuple(ops)
        self.tokenizer, self.template, self.worked, self.eval_fraction = tokenizer, template, worked, eval_fraction

    @classmethod
    def named(cls, name: str, seed: int = 0, tokenizer=None, eval_fraction: float = 0.1) -> ArithmeticTask:
        """The built-in tasks: 'arithmetic' (single digits, + and -: 155 problems) and 'long_addition'
        (0..99 + 0..99 with a worked answer: 10,000 problems, answers up to 19 characters)."""
        if name == "arithmetic":
            return cls(seed, tokenizer=tokenizer, eval_fraction=eval_fraction)
        if name == "long_addition":
            return cls(seed, max_operand=99, ops=("+",), tokenizer=tokenizer, worked=True, eval_fraction=eval_fraction)
        raise ValueError(f"unknown built-in task {name!r}; known: {', '.join(TASKS)}")

    def _canonical(self, a: int, op: str, b: int) -> tuple[int, str, int]:
        return (b, op, a) if op == "-" and a < b else (a, op, b)

    def make(self, a: int, op: str, b: int) -> tuple[str, str]:
        """The prompt text and answer for one problem."""
        a, op, b = self._canonical(a, op, b)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return self.template.format(a=a, op=op, b=b), str(value)

    def solution(self, a: int, b: int) -> str:
        """The worked addition: each digit's sum (with the carry in), then the result."""
        steps, carry, x, y = [], 0, a, b
        while x or y or not steps:
            dx, dy = x % 10, y % 10
            total = dx + dy + carry
            steps.append(f"{dx}+{dy}" + (f"+{carry}" if carry else "") + f"={total}")
            carry, x, y = total // 10, x // 10, y // 10
        return ",".join(steps + [str(a + b)])

    def _prompt(self, pid: str, a: int, op: str, b: int) -> Prompt:
        text, answer = self.make(a, op, b)
        ids = self.tokenizer.encode_prompt(text) if self.tokenizer is not None else None
        return Prompt(pid, text, answer, ids, self.solution(a, b) if self.worked else None)

    def is_eval(self, a: int, op: str, b: int) -> bool:
        return in_eval_split("arith:" + "".join(map(str, self._canonical(a, op, b))), self.eval_fraction)

    def sample(self, n: int, step: int) -> list[Prompt]:
        """n training problems for `step` (never one of the eval split)."""
        rng = _rng("arith", self.seed, step)
        out = []
        while len(out) < n:
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            op = rng.choice(self.ops)
            if not self.is_eval(a, op, b):
                out.append(self._prompt(f"s{step}-p{len(out)}", a, op, b))
        return out

    def eval_problems(self) -> list[tuple[int, str, int]]:
        """Every problem of the eval split, in a fixed (hash) order."""
        seen = {
            self._canonical(a, op, b)
            for a in range(self.max_operand + 1)
            for b in range(self.max_operand + 1)
            for op in self.ops
        }
        keep = [p for p in seen if self.is_eval(*p)]
        return sorted(keep, key=lambda p: _rng("order", *p).random())

    def eval_set(self, n: int) -> list[Prompt]:
        """The first n problems of the eval split (all of them when n exceeds its size)."""
        return [self._prompt(f"eval-{i}", a, op, b) for i, (a, op, b) in enumerate(self.eval_problems()[:n])]


TASKS = ("arithmetic", "long_addition")
BUILTIN_PROMPTS = (*TASKS, "word_problems", "code_tasks")  # what rollout.prompts (and the probe's --dataset) name


class JsonlPrompts:
    """Prompts from a JSONL file, one object per line with "prompt" and "answer" (an optional
    "id" names the prompt), or a HumanEval row: "prompt" (the function stub), "test" and
    "entry_point" without "answer" (an optional "task_id" names it), which becomes a code task for
    `rollout.reward=code` (the stub in `code_reward.task_text`, the answer its test JSON). Every
    line is validated at load so a bad line fails the run before any rollout, naming its line
    number. Blank lines are skipped.

    Splits: a fixed `eval_fraction` of the lines (by a hash of the prompt text, `in_eval_split`)
    is the eval set; training draws only from the rest. Order: the training stream is a sequence
    of epochs, each a permutation of the training lines drawn from (shuffle_seed, epoch); step k
    takes items [k*n, (k+1)*n) of that stream.
    """

    def __init__(
        self, path: str | os.PathLike, tokenizer=None, shuffle_seed: int = 0, eval_fraction: float = 0.0
    ) -> None:
        self.path = os.fspath(path)
        self.tokenizer, self.shuffle_seed = tokenizer, shuffle_seed
        # (source id, prompt, answer) of each line: read by the one JSONL reader (data/jsonl.py)
        lines = [self._parse(obj, where) for where, obj in read_lines(self.path)]
        held = [in_eval_split("jsonl:" + prompt, eval_fraction) for _, prompt, _ in lines]
        self.items = [x for x, h in zip(lines, held) if not h]
        self.eval_items = [x for x, h in zip(lines, held) if h]
        if not self.items:
            raise ValueError(
                f"{self.path}: every one of its {len(lines)} prompts fell in the eval split "
                f"(eval_fraction {eval_fraction}); add prompts"
            )
        self._perm_cache: dict[int, list[int]] = {}

    def eval_set(self, n: int) -> list[Prompt]:
        """The first n prompts of the eval split, in file order."""
        return [
            self._make(f"eval-{i}-{src}", prompt, answer) for i, (src, prompt, answer) in enumerate(self.eval_items[:n])
        ]

    def _make(self, pid: str, prompt: str, answer: str) -> Prompt:
        ids = self.tokenizer.encode_prompt(prompt) if self.tokenizer is not None else None
        return Prompt(pid, prompt, answer, ids)

    def _parse(self, obj, where: str) -> tuple[str, str, str]:
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object with 'prompt' and 'answer'; got {type(obj).__name__}")
        if "answer" not in obj and ("test" in obj or "entry_point" in obj):
            return self._parse_humaneval(obj, where)
        for key in ("prompt", "answer"):
            if key not in obj:
                raise ValueError(f"{where}: missing key {key!r} (or a HumanEval row's 'test' and 'entry_point')")
        prompt, answer = obj["prompt"], obj["answer"]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: 'prompt' must be a non-empty string; got {prompt!r}")
        # Numeric answers are common in math sets; the verifier compares strings, so keep the text.
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"{where}: 'answer' must be a string or a number; got {answer!r}")
        return str(obj.get("id", "L" + where.rsplit(":", 1)[1])), prompt, str(answer)

    def _parse_humaneval(self, obj: dict, where: str) -> tuple[str, str, str]:
        for key in ("prompt", "test", "entry_point"):
            if not isinstance(obj.get(key), str) or not obj[key].strip():
                raise ValueError(f"{where}: a HumanEval row needs a non-empty string {key!r}; got {obj.get(key)!r}")
        if not obj["entry_point"].isidentifier():
            raise ValueError(f"{where}: 'entry_point' must be a Python identifier; got {obj['entry_point']!r}")
        src = str(obj.get("id", obj.get("task_id", "L" + where.rsplit(":", 1)[1]))).replace("/", "-")
        return src, task_text(obj["prompt"]), answer_json(obj["test"], obj["entry_point"])

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
            out.append(self._make(f"s{step}-p{i}-{src}", prompt, answer))
        return out


def prompt_source(spec: str, *, seed: int, tokenizer, eval_fraction: float = 0.1):
    """`rollout.prompts`: a built-in task name (BUILTIN_PROMPTS) or a JSONL path."""
    if spec == "word_problems":
        from .word_problems import WordProblems

        return WordProblems(seed, tokenizer, eval_fraction)
    if spec == "code_tasks":
        from .code_tasks import CodeTasks

        return CodeTasks(seed, tokenizer, eval_fraction)
    if spec in TASKS:
        return ArithmeticTask.named(spec, seed, tokenizer, eval_fraction)
    return JsonlPrompts(spec, tokenizer=tokenizer, shuffle_seed=seed, eval_fraction=eval_fraction)
