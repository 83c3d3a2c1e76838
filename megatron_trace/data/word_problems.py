"""Generated word problems with integer answers: `rollout.prompts=word_problems`.

Multi-step problems (two or three operations on small numbers) in a handful of everyday templates,
each asking for the final answer in \\boxed{} (`rollout.reward=math` checks it). Problem k of the
space is a pure function of k, so the eval split is a hash of the problem text
(`prompts.in_eval_split`), the same for every seed and run, and training never draws from it.
Sized for a 0.5B instruct model to start well below perfect and have room to improve.
"""

from __future__ import annotations

from .prompts import Prompt, _rng, in_eval_split

SPACE = 1_000_000  # problem ids 0 .. SPACE-1
NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lena")
ITEMS = ("apples", "books", "coins", "pens", "stamps", "marbles", "shells", "cards", "stickers", "buttons")
ASK = " Reason step by step, then give the final answer as a number in \\boxed{}."


def _problem(k: int) -> tuple[str, int]:
    """(text, answer) of problem k."""
    r = _rng("word_problem", k)
    name, item = r.choice(NAMES), r.choice(ITEMS)
    kind = r.randrange(6)
    if kind == 0:
        a, b, c = r.randint(5, 40), r.randint(2, 9), r.randint(3, 12)
        d = r.randint(1, a + b * c - 1)
        text = (
            f"{name} has {a} {item}. {name} buys {b} boxes with {c} {item} in each box, "
            f"then gives {d} {item} to a friend. How many {item} does {name} have now?"
        )
        return text, a + b * c - d
    if kind == 1:
        a, b = r.randint(3, 9), r.randint(6, 15)
        c, d = r.randint(1, a * b // 3), r.randint(1, a * b // 3)
        text = (
            f"A bakery bakes {a} trays of {b} cookies. It sells {c} cookies in the morning and {d} "
            "in the afternoon. How many cookies are left?"
        )
        return text, a * b - c - d
    if kind == 2:
        a = r.randint(5, 30)
        b = r.randint(3 * a + 10, 3 * a + 120)
        text = (
            f"{name} reads {a} pages of a {b}-page book on Monday and twice as many pages on Tuesday. "
            "How many pages are left to read?"
        )
        return text, b - 3 * a
    if kind == 3:
        a, b, c = r.randint(3, 12), r.randint(20, 60), r.randint(2, 6)
        d = r.randint(1, c * a * b // 4)
        text = (
            f"A train has {a} cars with {b} seats each. It makes {c} full trips, and on the last trip "
            f"{d} seats stay empty. How many passengers does it carry in all?"
        )
        return text, c * a * b - d
    if kind == 4:
        a, b = r.randint(4, 25), r.randint(3, 12)
        c = r.randint(1, a * b - 1)
        text = (
            f"{name} saves {a} dollars every week for {b} weeks, then spends {c} dollars on a gift. "
            "How many dollars are left?"
        )
        return text, a * b - c
    m, b, c = r.randint(2, 9), r.randint(3, 12), r.randint(2, 6)
    a = m * c
    text = (
        f"A school buys {a} packs of {b} {item} and shares them equally among {c} classes. "
        f"How many {item} does each class get?"
    )
    return text, m * b


class WordProblems:
    """The prompt-source contract of `prompts.ArithmeticTask` over the generated problems."""

    def __init__(self, seed: int = 0, tokenizer=None, eval_fraction: float = 0.1) -> None:
        if not 0 < eval_fraction < 1:
            raise ValueError(f"word_problems needs 0 < rollout.eval_fraction < 1; got {eval_fraction}")
        self.seed, self.tokenizer, self.eval_fraction = seed, tokenizer, eval_fraction

    def _prompt(self, pid: str, k: int) -> Prompt:
        text, answer = _problem(k)
        text += ASK
        ids = self.tokenizer.encode_prompt(text) if self.tokenizer is not None else None
        return Prompt(pid, text, str(answer), ids)

    def is_eval(self, k: int) -> bool:
        return in_eval_split("word:" + _problem(k)[0], self.eval_fraction)

    def sample(self, n: int, step: int) -> list[Prompt]:
        """n training problems for `step` (never one of the eval split)."""
        rng = _rng("word_problems", self.seed, step)
        out = []
        while len(out) < n:
            k = rng.randrange(SPACE)
            if not self.is_eval(k):
                out.append(self._prompt(f"s{step}-p{len(out)}-w{k}", k))
        return out

    def eval_set(self, n: int) -> list[Prompt]:
        """The first n problems of the eval split, in problem-id order (the same for every seed)."""
        out, k = [], 0
        while len(out) < n and k < SPACE:
            if self.is_eval(k):
                out.append(self._prompt(f"eval-{len(out)}-w{k}", k))
            k += 1
        return out
