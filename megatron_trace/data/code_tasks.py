"""Generated function-writing problems with hidden tests: `rollout.prompts=code_tasks`.

Sixteen families of small list, string and number functions ("the 3 largest in ascending order",
"count the letters 'b', 'k', 'q' ignoring case", "rotate right by 4", "run-length encode as 3a2b",
"sum of the digits in base 7", ...), each with parameters, so the distinct problems number in the
thousands. Problem k is a pure function of k, in HumanEval's row format (`row`), labelled easy,
medium or hard. Its tests are the reference solution's own outputs on generated inputs: run here,
in-process, because the reference solutions are this file's code, never a model's. The prompt asks
for the function in a ```python block and the answer is `{"test", "entry_point"}` JSON, the
contract of `rollout.reward=code` (data/code_reward.py).

The eval split is a hash of the problem's identity, its family and parameters (`in_eval_split`),
not of its example inputs: the same function with other examples is never on the other side.
"""

from __future__ import annotations

import copy
import functools
import random
import string
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from .code_reward import answer_json, task_text
from .prompts import Prompt, _rng, in_eval_split

SPACE = 1_000_000  # problem ids 0 .. SPACE-1
DIFFICULTIES = ("easy", "medium", "hard")
WORDS = (
    "apple", "bird", "cat", "dog", "egg", "fish", "go", "hat", "ink", "jam", "kite", "lamp", "moon",
    "nest", "owl", "pear", "queen", "rain", "sun", "tree", "up", "van", "wind", "box", "yes", "zoo",
    "garden", "river", "stone", "window", "orange", "planet", "a", "an", "it", "kitchen", "morning", "elephant",
)  # fmt: skip


@dataclass
class _Spec:
    """One problem before its tests: the reference body and the inputs it is run on."""

    key: str  # family and parameters: what the eval split hashes
    name: str
    args: str  # the signature's parameters
    returns: str
    doc: str
    body: str  # the reference solution, indented as a function body
    inputs: list[tuple]  # argument tuples; the first two become the prompt's examples
    difficulty: str


# ---------------------------------------------------------------------------------------- inputs


def _nums(r: random.Random, lo: int = -30, hi: int = 30, short: int = 0, long: int = 9) -> list[int]:
    return [r.randint(lo, hi) for _ in range(r.randint(short, long))]


def _num_lists(r: random.Random, n: int = 8, **kw) -> list[tuple]:
    return [(_nums(r, short=3, **kw),), (_nums(r, short=4, **kw),), ([],)] + [(_nums(r, **kw),) for _ in range(n - 3)]


def _text(r: random.Random, alphabet: str, long: int = 16) -> str:
    return "".join(r.choice(alphabet) for _ in range(r.randint(0, long)))


def _sentence(r: random.Random, short: int = 0) -> str:
    return " ".join(r.choice(WORDS) for _ in range(r.randint(short, 8)))


# ---------------------------------------------------------------------------------------- families


def _top_k(r: random.Random) -> _Spec:
    k, which, order = r.randint(1, 8), r.choice(("largest", "smallest")), r.choice(("descending", "ascending"))
    body = f"    return sorted(sorted(nums, reverse={which == 'largest'})[:{k}], reverse={order == 'descending'})\n"
    doc = (
        f"Return the {k} {which} numbers of `nums` (repeats count separately) in {order} order; "
        f"all of them, sorted, when `nums` has fewer than {k}."
    )
    return _Spec(
        f"top_k:{k}:{which}:{order}", f"{which}_{k}", "nums: list[int]", "list[int]", doc, body, _num_lists(r), "easy"
    )


def _count_letters(r: random.Random) -> _Spec:
    letters = "aeiou" if r.random() < 0.2 else "".join(sorted(r.sample(string.ascii_lowercase, r.randint(2, 6))))
    fold = r.random() < 0.5
    body = f"    return sum(1 for c in s{'.lower()' if fold else ''} if c in {letters!r})\n"
    which = "vowels ('a', 'e', 'i', 'o', 'u')" if letters == "aeiou" else "letters " + ", ".join(map(repr, letters))
    case = "ignoring case" if fold else "counting lowercase only (an uppercase letter never counts)"
    doc = f"Return how many characters of `s` are one of the {which}, {case}."
    alphabet = letters + letters.upper() + "xyzXYZ bt"
    inputs = [(_text(r, alphabet, 20),) for _ in range(7)] + [("",)]
    name = "count_vowels" if letters == "aeiou" else "count_letters"
    return _Spec(f"count_letters:{letters}:{fold}", name, "s: str", "int", doc, body, inputs, "easy")


def _rotate(r: random.Random) -> _Spec:
    k, left = r.randint(1, 12), r.random() < 0.5
    cut = f"{k} % len(lst)" if left else f"len(lst) - {k} % len(lst)"
    body = f"    if not lst:\n        return []\n    cut = {cut}\n    return lst[cut:] + lst[:cut]\n"
    way = "left (the first element moves to the end)" if left else "right (the last element moves to the front)"
    doc = f"Return `lst` rotated {way} by {k} positions, that is by {k} modulo its length; [] stays []."
    return _Spec(
        f"rotate:{k}:{left}",
        f"rotate_{'left' if left else 'right'}_{k}",
        "lst: list[int]",
        "list[int]",
        doc,
        body,
        _num_lists(r, lo=0, hi=99),
        "easy",
    )


def _rle(r: random.Random) -> _Spec:
    form = r.choice(("after", "before", "omit_ones", "pairs", "decode_after", "decode_before"))
    letters = "abcdxyz"[: r.randint(2, 7)]
    runs = [[(r.choice(letters), r.randint(1, 12)) for _ in range(r.randint(0, 6))] for _ in range(8)]
    runs = [[(c, n) for i, (c, n) in enumerate(rs) if i == 0 or rs[i - 1][0] != c] for rs in runs]
    texts = ["".join(c * n for c, n in rs) for rs in runs]
    group = (
        "    out = []\n    for c in s:\n        if out and out[-1][0] == c:\n            out[-1][1] += 1\n"
        "        else:\n            out.append([c, 1])\n"
    )
    encode = {
        "after": ("letter then count", "    return ''.join(f'{c}{n}' for c, n in out)\n", "'aaab' -> 'a3b1'"),
        "before": ("count then letter", "    return ''.join(f'{n}{c}' for c, n in out)\n", "'aaab' -> '3a1b'"),
        "omit_ones": (
            "letter then count, the count left out when it is 1",
            "    return ''.join(c + (str(n) if n > 1 else '') for c, n in out)\n",
            "'aaab' -> 'a3b'",
        ),
        "pairs": (
            "a list of (letter, count) tuples",
            "    return [(c, n) for c, n in out]\n",
            "'aaab' -> [('a', 3), ('b', 1)]",
        ),
    }
    if form in encode:
        how, tail, eg = encode[form]
        doc = (
            f"Run-length encode `s`: each run of one repeated character becomes {how} ({eg}); '' gives an empty result."
        )
        returns = "list[tuple[str, int]]" if form == "pairs" else "str"
        return _Spec(
            f"rle:{form}", "run_length_encode", "s: str", returns, doc, group + tail, [(t,) for t in texts], "medium"
        )
    after = form == "decode_after"
    encoded = ["".join(f"{c}{n}" if after else f"{n}{c}" for c, n in rs) for rs in runs]
    pattern = r"([a-z])(\d+)" if after else r"(\d+)([a-z])"
    pick = "c * int(n) for c, n" if after else "c * int(n) for n, c"
    body = f"    import re\n\n    return ''.join({pick} in re.findall({pattern!r}, s))\n"
    eg = "'a3b10' -> 'aaabbbbbbbbbb'" if after else "'3a10b' -> 'aaabbbbbbbbbb'"
    doc = (
        f"Decode a run-length encoding in which every run is written as "
        f"{'a letter then its count' if after else 'a count then its letter'} ({eg}); counts may have several digits."
    )
    return _Spec(f"rle:{form}", "run_length_decode", "s: str", "str", doc, body, [(e,) for e in encoded], "hard")


def _digits(r: random.Random) -> _Spec:
    base = r.randint(2, 16)
    stat = r.choice(("sum", "product", "largest", "nonzero", "count"))
    d = r.randrange(base)
    ret = {
        "sum": ("the sum of", "    return sum(digits)\n"),
        "product": ("the product of", "    p = 1\n    for x in digits:\n        p *= x\n    return p\n"),
        "largest": ("the largest of", "    return max(digits)\n"),
        "nonzero": ("how many are non-zero among", "    return sum(1 for x in digits if x)\n"),
        "count": (f"how many equal {d} among", f"    return digits.count({d})\n"),
    }[stat]
    body = f"    digits = []\n    while True:\n        digits.append(n % {base})\n        n //= {base}\n"
    body += "        if n == 0:\n            break\n" + ret[1]
    doc = f"Return {ret[0]} the digits of the non-negative integer `n` written in base {base} (0 has the one digit 0)."
    inputs = [(r.randint(base, 5000),), (r.randint(10**4, 10**6),), (0,), (base - 1,), (base,)]
    inputs += [(r.randint(0, 10**7),) for _ in range(3)]
    name = {"nonzero": "count_nonzero_digits", "count": f"count_digit_{d}"}.get(stat, f"{stat}_of_digits")
    return _Spec(
        f"digits:{base}:{stat}:{d if stat == 'count' else ''}",
        f"{name}_base_{base}",
        "n: int",
        "int",
        doc,
        body,
        inputs,
        "medium",
    )


def _every_nth(r: random.Random) -> _Spec:
    m = r.randint(2, 7)
    rem, total = r.randrange(m), r.random() < 0.5
    body = f"    return {'sum(' if total else ''}lst[{rem}::{m}]{')' if total else ''}\n"
    what = "the sum of the elements" if total else "the elements"
    doc = f"Return {what} of `lst` at the 0-based positions i with i % {m} == {rem}" + ("." if total else ", in order.")
    return _Spec(
        f"every_nth:{m}:{rem}:{total}",
        f"{'sum_' if total else ''}every_{m}_from_{rem}",
        "lst: list[int]",
        "int" if total else "list[int]",
        doc,
        body,
        _num_lists(r, long=14),
        "easy",
    )


def _caesar(r: random.Random) -> _Spec:
    k, lower_only = r.randint(1, 25), r.random() < 0.3
    body = (
        "    out = []\n    for c in s:\n        if 'a' <= c <= 'z':\n"
        f"            out.append(chr((ord(c) - ord('a') + {k}) % 26 + ord('a')))\n"
    )
    if not lower_only:
        body += (
            f"        elif 'A' <= c <= 'Z':\n            out.append(chr((ord(c) - ord('A') + {k}) % 26 + ord('A')))\n"
        )
    body += "        else:\n            out.append(c)\n    return ''.join(out)\n"
    which = "lowercase ASCII letter" if lower_only else "ASCII letter"
    keep = "uppercase letters and other characters" if lower_only else "other characters"
    doc = (
        f"Return `s` with every {which} shifted {k} places forward in the alphabet, wrapping around "
        f"from z to a{'' if lower_only else ' and keeping its case'}; {keep} stay as they are."
    )
    inputs = [(_sentence(r, 1),), (_sentence(r, 1).title() + "!",), ("",), ("xyz XYZ",)]
    inputs += [(_text(r, string.ascii_letters + " .,-", 20),) for _ in range(4)]
    name = f"caesar_{'lowercase_' if lower_only else ''}shift_{k}"
    return _Spec(f"caesar:{k}:{lower_only}", name, "s: str", "str", doc, body, inputs, "medium")


def _running(r: random.Random) -> _Spec:
    op = r.choice(("sum", "maximum", "minimum", "product", "even_count"))
    step = {
        "sum": "acc = x if i == 0 else acc + x",
        "maximum": "acc = x if i == 0 else max(acc, x)",
        "minimum": "acc = x if i == 0 else min(acc, x)",
        "product": "acc = x if i == 0 else acc * x",
        "even_count": "acc = (0 if i == 0 else acc) + (x % 2 == 0)",
    }[op]
    body = f"    out = []\n    for i, x in enumerate(nums):\n        {step}\n        out.append(acc)\n    return out\n"
    what = "how many of nums[0..i] are even" if op == "even_count" else f"the {op} of nums[0..i]"
    doc = f"Return the running {op.replace('_', ' ')} of `nums`: element i of the result is {what}."
    return _Spec(
        f"running:{op}", f"running_{op}", "nums: list[int]", "list[int]", doc, body, _num_lists(r, lo=-9, hi=9), "easy"
    )


def _divisible(r: random.Random) -> _Spec:
    d, e = r.sample(range(2, 16), 2)
    while d % e == 0:
        d, e = r.sample(range(2, 16), 2)
    count = r.random() < 0.5
    keep = f"for x in nums if x % {d} == 0 and x % {e} != 0"
    body = f"    return sum(1 {keep})\n" if count else f"    return [x {keep}]\n"
    what = "how many numbers" if count else "the numbers"
    doc = f"Return {what} of `nums` that are divisible by {d} but not by {e}" + ("." if count else ", in order.")
    return _Spec(
        f"divisible:{d}:{e}:{count}",
        f"{'count_' if count else ''}divisible_by_{d}_not_{e}",
        "nums: list[int]",
        "int" if count else "list[int]",
        doc,
        body,
        _num_lists(r, lo=-60, hi=120, long=12),
        "easy",
    )


def _words(r: random.Random) -> _Spec:
    kind = r.choice(("longer", "starts", "ends", "contains"))
    n = r.randint(2, 7)
    letters = {"starts": {w[0] for w in WORDS}, "ends": {w[-1] for w in WORDS}}.get(kind, set("".join(WORDS)))
    c = r.choice(sorted(letters))
    cond, what, name = {
        "longer": (f"len(w) >= {n}", f"have at least {n} letters", f"with_at_least_{n}_letters"),
        "starts": (f"w.startswith({c!r})", f"start with {c!r}", f"starting_with_{c}"),
        "ends": (f"w.endswith({c!r})", f"end with {c!r}", f"ending_with_{c}"),
        "contains": (f"{c!r} in w", f"contain the letter {c!r}", f"containing_{c}"),
    }[kind]
    count = r.random() < 0.5
    keep = f"for w in s.split() if {cond}"
    body = f"    return sum(1 {keep})\n" if count else f"    return [w {keep}]\n"
    doc = "`s` holds lowercase words separated by spaces. "
    doc += f"Return how many words of `s` {what}." if count else f"Return the words of `s` that {what}, in order."
    hit = {
        "longer": lambda w: len(w) >= n,
        "starts": lambda w: w.startswith(c),
        "ends": lambda w: w.endswith(c),
        "contains": lambda w: c in w,
    }[kind]
    pools = [w for w in WORDS if hit(w)] or list(WORDS), [w for w in WORDS if not hit(w)] or list(WORDS)

    def sentence(short: int) -> str:  # about a third of the words match
        return " ".join(r.choice(pools[r.random() > 0.35]) for _ in range(r.randint(short, 8)))

    inputs = [(sentence(3),), (sentence(3),), ("",)] + [(sentence(0),) for _ in range(5)]
    return _Spec(
        f"words:{kind}:{n if kind == 'longer' else c}:{count}",
        f"{'count_' if count else ''}words_{name}",
        "s: str",
        "int" if count else "list[str]",
        doc,
        body,
        inputs,
        "easy",
    )


def _pairs(r: random.Random) -> _Spec:
    divisible = r.random() < 0.5
    m, t = r.randint(2, 15), r.randint(-15, 30)
    cond = f"(nums[i] + nums[j]) % {m} == 0" if divisible else f"nums[i] + nums[j] == {t}"
    body = (
        "    n = 0\n    for i in range(len(nums)):\n        for j in range(i + 1, len(nums)):\n"
        f"            if {cond}:\n                n += 1\n    return n\n"
    )
    what = f"is divisible by {m}" if divisible else f"equals {t}"
    doc = f"Return how many pairs of positions i < j in `nums` have a sum nums[i] + nums[j] that {what}."
    return _Spec(
        f"pairs:{divisible}:{m if divisible else t}",
        f"count_pairs_{'divisible_by' if divisible else 'summing_to'}_{m if divisible else t}".replace("-", "minus_"),
        "nums: list[int]",
        "int",
        doc,
        body,
        _num_lists(r, lo=-10, hi=20, long=12),
        "hard" if not divisible else "medium",
    )


def _multiples(r: random.Random) -> _Spec:
    a, b = sorted(r.sample(range(2, 21), 2))
    both = r.random() < 0.5
    cond = f"x % {a} == 0 {'and' if both else 'or'} x % {b} == 0"
    body = f"    return sum(x for x in range(1, n) if {cond})\n"
    doc = f"Return the sum of the positive integers below `n` that are multiples of {a} {'and' if both else 'or'} {b}."
    inputs = [(r.randint(10, 60),), (r.randint(60, 500),), (0,), (1,), (a,), (b + 1,)] + [
        (r.randint(0, 2000),) for _ in range(2)
    ]
    return _Spec(
        f"multiples:{a}:{b}:{both}",
        f"sum_multiples_of_{a}_{'and' if both else 'or'}_{b}",
        "n: int",
        "int",
        doc,
        body,
        inputs,
        "easy",
    )


def _kth_distinct(r: random.Random) -> _Spec:
    k, largest = r.randint(1, 4), r.random() < 0.5
    body = f"    values = sorted(set(nums), reverse={largest})\n"
    body += f"    return values[{k - 1}] if len(values) >= {k} else None\n"
    which = "largest" if largest else "smallest"
    nth = ("", "second ", "third ", "fourth ")[k - 1]
    doc = f"Return the {nth}{which} distinct value of `nums` (repeats count once), or None if it has fewer than {k}."
    return _Spec(
        f"kth_distinct:{k}:{largest}",
        f"{nth}{which}_distinct".replace(" ", "_"),
        "nums: list[int]",
        "int | None",
        doc,
        body,
        _num_lists(r, lo=-5, hi=9),
        "medium",
    )


def _chunks(r: random.Random) -> _Spec:
    k, op = r.randint(2, 8), r.choice(("sum", "max", "min"))
    body = f"    return [{op}(nums[i:i + {k}]) for i in range(0, len(nums), {k})]\n"
    what = {"sum": "sum", "max": "largest value", "min": "smallest value"}[op]
    doc = f"Split `nums` into consecutive chunks of {k} (the last one may be shorter) and return each chunk's {what}."
    return _Spec(
        f"chunks:{k}:{op}",
        f"chunk_{op}_{k}",
        "nums: list[int]",
        "list[int]",
        doc,
        body,
        _num_lists(r, long=15),
        "medium",
    )


def _longest_run(r: random.Random) -> _Spec:
    kind = r.choice(("equal", "increasing", "decreasing", "consecutive"))
    cond, what = {
        "equal": ("b == prev", "are all equal"),
        "increasing": ("b > prev", "strictly increase"),
        "decreasing": ("b < prev", "strictly decrease"),
        "consecutive": ("b == prev + 1", "each exceed the previous one by exactly 1"),
    }[kind]
    body = (
        "    best = run = 0\n    prev = None\n    for b in nums:\n"
        f"        run = run + 1 if prev is not None and {cond} else 1\n"
        "        best = max(best, run)\n        prev = b\n    return best\n"
    )
    doc = f"Return the length of the longest stretch of adjacent elements of `nums` that {what} (0 for [])."
    return _Spec(
        f"longest_run:{kind}",
        f"longest_{kind}_run",
        "nums: list[int]",
        "int",
        doc,
        body,
        _num_lists(r, lo=0, hi=5, long=14),
        "medium",
    )


def _brackets(r: random.Random) -> _Spec:
    pairs = [p for p in ("()", "[]", "{}", "<>") if r.random() < 0.6] or ["()"]
    opens = "".join(p[0] for p in pairs)
    closes = {p[1]: p[0] for p in pairs}
    body = (
        f"    stack = []\n    for c in s:\n        if c in {opens!r}:\n            stack.append(c)\n"
        f"        elif c in {closes!r}:\n            if not stack or stack.pop() != {closes!r}[c]:\n"
        "                return False\n    return not stack\n"
    )
    kinds = " ".join(pairs)
    doc = f"Return whether the brackets {kinds} in `s` are balanced and properly nested; other characters are ignored."

    def balanced(depth: int) -> str:
        if depth == 0 or r.random() < 0.3:
            return r.choice(("", "x"))
        p = r.choice(pairs)
        return p[0] + balanced(depth - 1) + p[1] + balanced(depth - 1)

    inputs = [(balanced(4),), (_text(r, "".join(pairs) + "x", 8),), ("",)]
    inputs += [(balanced(5),) for _ in range(3)] + [(_text(r, "".join(pairs), 10),) for _ in range(3)]
    return _Spec(f"brackets:{kinds}", "balanced", "s: str", "bool", doc, body, inputs, "hard")


FAMILIES: tuple[Callable[[random.Random], _Spec], ...] = (
    _top_k, _count_letters, _rotate, _rle, _digits, _every_nth, _caesar, _running, _divisible, _words, _pairs,
    _multiples, _kth_distinct, _chunks, _longest_run, _brackets,
)  # fmt: skip


# ---------------------------------------------------------------------------------------- problems


def _calls(s: _Spec) -> list[tuple[str, str]]:
    """(the call's arguments, the reference's result) for each distinct input, as source text."""
    ns: dict = {}
    exec(f"def {s.name}({s.args}):\n{s.body}", ns)  # this file's own reference solution, never model code
    calls = [(", ".join(map(repr, args)), repr(ns[s.name](*copy.deepcopy(args)))) for args in s.inputs]
    return list(dict.fromkeys(calls))  # generated inputs repeat ([] often): each is asserted once


@functools.lru_cache(maxsize=1 << 16)  # sampling and the split both ask for a problem's spec
def _problem(k: int) -> tuple[_Spec, list[tuple[str, str]]]:
    """Problem k's spec and test calls. A draw whose tests a constant could pass (one result for
    every input) or that has under 4 of them is redrawn from the same stream."""
    r = _rng("code_task", k)
    while True:
        s = r.choice(FAMILIES)(r)
        calls = _calls(s)
        if len(calls) >= 4 and len({out for _, out in calls}) >= 2:
            return s, calls


def _spec(k: int) -> _Spec:
    return _problem(k)[0]


def row(k: int) -> dict:
    """Problem k as a HumanEval row (task_id, prompt, entry_point, canonical_solution, test) with its
    difficulty. The prompt's examples and the test's asserts are the reference's outputs."""
    s, calls = _problem(k)
    head = f"def {s.name}({s.args}) -> {s.returns}:\n"
    doc = textwrap.fill(s.doc, 92, initial_indent="    ", subsequent_indent="    ").lstrip()
    examples = "".join(f"    >>> {s.name}({a})\n    {out}\n" for a, out in calls[:2])
    prompt = f'{head}    """{doc}\n{examples}    """\n'
    test = "def check(candidate):\n" + "".join(f"    assert candidate({a}) == {out}\n" for a, out in calls)
    return {
        "task_id": f"code_tasks/{k}",
        "prompt": prompt,
        "entry_point": s.name,
        "canonical_solution": s.body,
        "test": test,
        "difficulty": s.difficulty,
    }


def to_prompt(pid: str, r: dict, tokenizer=None) -> Prompt:
    """A HumanEval-format row as the loop's Prompt: the stub in `task_text`'s instruction, the
    `{"test", "entry_point"}` answer, and the reference as the warm start's solution."""
    text = task_text(r["prompt"])
    ids = tokenizer.encode_prompt(text) if tokenizer is not None else None
    solution = f"```python\n{r['prompt']}{r['canonical_solution']}```" if "canonical_solution" in r else None
    return Prompt(pid, text, answer_json(r["test"], r["entry_point"]), ids, solution)


class CodeTasks:
    """The prompt-source contract of `prompts.ArithmeticTask` over the generated code problems,
    optionally only some difficulties."""

    def __init__(
        self, seed: int = 0, tokenizer=None, eval_fraction: float = 0.1, difficulties: tuple[str, ...] = DIFFICULTIES
    ) -> None:
        if not 0 < eval_fraction < 1:
            raise ValueError(f"code_tasks needs 0 < rollout.eval_fraction < 1; got {eval_fraction}")
        bad = [d for d in difficulties if d not in DIFFICULTIES]
        if not difficulties or bad:
            raise ValueError(
                f"code_tasks difficulties must be a non-empty subset of {DIFFICULTIES}; got {difficulties}"
            )
        self.seed, self.tokenizer, self.eval_fraction = seed, tokenizer, eval_fraction
        self.difficulties = tuple(difficulties)

    def is_eval(self, k: int) -> bool:
        return in_eval_split("code:" + _spec(k).key, self.eval_fraction)

    def _wanted(self, k: int) -> bool:
        return _spec(k).difficulty in self.difficulties

    def sample(self, n: int, step: int) -> list[Prompt]:
        """n training problems for `step` (never one of the eval split)."""
        rng = _rng("code_tasks", self.seed, step)
        out = []
        while len(out) < n:
            k = rng.randrange(SPACE)
            if self._wanted(k) and not self.is_eval(k):
                out.append(to_prompt(f"s{step}-p{len(out)}-c{k}", row(k), self.tokenizer))
        return out

    def eval_problems(self, n: int) -> list[int]:
        """The ids of the first n distinct problems of the eval split, in id order (the same for
        every seed): a function already taken with other examples is skipped."""
        out, seen, k = [], set(), 0
        while len(out) < n and k < SPACE:
            key = _spec(k).key
            if key not in seen and self._wanted(k) and self.is_eval(k):
                seen.add(key)
                out.append(k)
            k += 1
        return out

    def eval_set(self, n: int) -> list[Prompt]:
        return [to_prompt(f"eval-{i}-c{k}", row(k), self.tokenizer) for i, k in enumerate(self.eval_problems(n))]
