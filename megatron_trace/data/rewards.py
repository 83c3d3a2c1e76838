"""Verifiable rewards: exact match and a math answer verifier.

`score` is what the loop calls: a reward function that raises scores 0 and hands the error back,
so one malformed response (or a verifier bug) costs a sample, not the run.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Callable

RewardFn = Callable[[str, str], float]


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response equals the answer after stripping surrounding whitespace."""
    return 1.0 if str(response).strip() == str(answer).strip() else 0.0


# ---------------------------------------------------------------------------------------------
# math verification


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} (or \\fbox{...}), honouring nested braces; None if
    there is none or it is unclosed (a truncated response)."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        m = list(re.finditer(r"\\boxed ([^\s$]+)", text))  # "\boxed 5" is valid LaTeX too
        return m[-1].group(1) if m else None
    i = start = starts[-1]
    depth = 1
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def _brace_arg(s: str, i: int) -> tuple[str, int]:
    """The argument starting at s[i]: a {...} group (nested) or a single character."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        raise ValueError("missing argument")
    if s[i] != "{":
        return s[i], i + 1
    depth, j = 0, i
    while j < len(s):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1 : j], j + 1
        j += 1
    raise ValueError("unbalanced braces")


def _replace_frac(s: str) -> str:
    """\\frac{a}{b}, \\dfrac, \\tfrac and the shorthand \\frac12 -> a/b (compound parts in
    parentheses), innermost first."""
    pat = re.compile(r"\\[dt]?frac")
    while True:
        # the last one: its arguments hold no further \frac (they come after it)
        m = next(reversed(list(pat.finditer(s))), None)
        if m is None:
            return s
        try:
            num, j = _brace_arg(s, m.end())
            den, k = _brace_arg(s, j)
        except ValueError:
            return s  # malformed: leave it and let the comparison fail
        s = s[: m.start()] + f"{_group(num)}/{_group(den)}" + s[k:]


def _group(x: str) -> str:
    # Parenthesize only compound arguments, so \frac{1}{2} and \frac{\pi}{2} read as the
    # plain "1/2" and "\pi/2" a reference is likely to use.
    x = x.strip()
    return x if re.fullmatch(r"[A-Za-z0-9.]+|\\[A-Za-z]+(?:\{[^{}]*\})?", x) else f"({x})"


def _unwrap_text(s: str) -> str:
    """\\text{x}, \\mathrm{x}, \\textbf{x}, \\mbox{x} -> x (units and words inside answers)."""
    pat = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{")
    while True:
        m = pat.search(s)
        if m is None:
            return s
        try:
            inner, k = _brace_arg(s, m.end() - 1)
        except ValueError:
            return s
        s = s[: m.start()] + inner + s[k:]


_NUM = r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
_GROUPED = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def normalize_math(s: str) -> str:
    """A canonical string for a math answer (the boxed part is taken by the caller)."""
    s = str(s).strip()
    # Math delimiters: $...$, $$...$$, \( \), \[ \]
    s = re.sub(r"^\$+|\$+$", "", s).strip()
    s = re.sub(r"^\\[(\[]|\\[)\]]$", "", s).strip()
    s = _unwrap_text(s)
    s = re.sub(r"\\sqrt\s*([A-Za-z0-9])", r"\\sqrt{\1}", s)  # \sqrt2 -> \sqrt{2}, before fracs group
    s = _replace_frac(s)
    for pat in (r"\\left", r"\\right", r"\\[,;:! ]", r"\\displaystyle", r"\^\{?\\circ\}?", r"\\%|%"):
        s = re.sub(pat, "", s)
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\div", "/")
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")  # a sentence-final period: "7." -> "7"
    # "x=3" -> "3": a single assignment to one variable states the value.
    m = re.fullmatch(r"[a-zA-Z]=(.+)", s)
    if m:
        s = m.group(1)
    if _GROUPED.match(s):  # thousands separators only where the whole answer is a grouped number
        s = s.replace(",", "")
    return s


def _strip_parens(s: str) -> str:
    while s.startswith("(") and s.endswith(")") and _balanced(s[1:-1]):
        s = s[1:-1]
    return s


def _balanced(s: str) -> bool:
    depth = 0
    for c in s:
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth < 0:
            return False
    return depth == 0


def to_number(s: str) -> Fraction | None:
    """A normalized answer as an exact number: ints, decimals, a/b (also (a)/(b) and -(a)/(b));
    None when it is not a plain number."""
    s = _strip_parens(s)
    sign = 1
    if s[:1] in "+-" and s[1:2] == "(":
        sign, s = (-1 if s[0] == "-" else 1), _strip_parens(s[1:])
    cut = _last_top_level_slash(s)
    if cut is not None:  # a/b/c reads (a/b)/c: split at the last top-level slash
        num = to_number(s[:cut]) if s[:cut] else None
        den = to_number(s[cut + 1 :]) if s[cut + 1 :] else None
        if num is None or den is None or den == 0:
            return None
        return sign * num / den
    m = re.fullmatch(_NUM, s)
    if m:
        exp = re.search(r"[eE]([+-]?\d+)$", s)
        if exp and abs(int(exp.group(1))) > 300:  # "1e999999999" would build a huge exact int
            return None
        try:
            return sign * Fraction(s)
        except (ValueError, ZeroDivisionError):
            return None
    return None


def _last_top_level_slash(s: str) -> int | None:
    depth, cut = 0, None
    for i, c in enumerate(s):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if c == "/" and depth == 0:
            cut = i
    return cut


def extract_answer(response: str) -> str:
    """The answer part of a response: the last boxed expression, or the whole text if none."""
    boxed = last_boxed(response)
    return response if boxed is None else boxed


def math_verify(response: str, answer: str, tol: float = 1e-6) -> float:
    """1.0 when the response's final answer matches the reference.

    The reference may itself be boxed. Numbers compare by value, |a-b| <= tol (absolute: a
    relative tolerance would call 1000001 and 1000000 equal), so 0.5 == 1/2 == \\frac{1}{2} and
    1,000 == 1000.0; anything else compares as normalized strings.
    """
    got = normalize_math(extract_answer(str(response)))
    want = normalize_math(extract_answer(str(answer)))
    if not got:
        return 0.0
    if got == want:
        return 1.0
    a, b = to_number(got), to_number(want)
    if a is None or b is None:
        return 0.0
    return 1.0 if abs(a - b) <= Fraction(tol) else 0.0  # exact: float() overflows on huge numbers


# ---------------------------------------------------------------------------------------------


def final_answer(response: str, answer: str) -> float:
    """1.0 when the last comma-separated field of a worked answer ("7+8=15,4+3+1=8,85") equals the
    answer; the steps before it earn nothing by themselves."""
    return exact_match(str(response).rsplit(",", 1)[-1], answer)


REWARD_FNS: dict[str, RewardFn] = {"exact_match": exact_match, "final_answer": final_answer, "math": math_verify}


def get_reward_fn(name: str) -> RewardFn:
    if name not in REWARD_FNS:
        raise ValueError(f"unknown reward function {name!r}; allowed: {', '.join(sorted(REWARD_FNS))}")
    return REWARD_FNS[name]


def score(fn: RewardFn, response: str, answer: str) -> tuple[float, str | None]:
    """(reward, None), or (0.0, "ErrorType: message") when `fn` raises or returns a non-finite
    or non-numeric value: the loop counts these errors and keeps going."""
    try:
        r = float(fn(response, answer))
    except Exception as e:  # noqa: BLE001 - any verifier failure scores 0, by design
        return 0.0, f"{type(e).__name__}: {e}"
    if not math.isfinite(r):
        return 0.0, f"ValueError: reward function returned {r}"
    return r, None
