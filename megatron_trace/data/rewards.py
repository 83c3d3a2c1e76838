"""Verifiable rewards: exact match, a math answer verifier and (data/code_reward.py) code run
against hidden tests in a sandbox.

`score` is what the loop calls: a reward function that raises scores 0 and hands the error back,
so one malformed response (or a verifier bug) costs a sample, not the run.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from dataclasses import dataclass, field
from typing import Callable

RewardFn = Callable[[str, str], float]


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response equals the answer after stripping surrounding whitespace."""
    return 1.0 if str(response).strip() == str(answer).strip() else 0.0


# ---------------------------------------------------------------------------------------------
# math verification: HF's math-verify (the parser and sympy comparison open-r1, TRL and verl use)


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


_warned_threads: list[bool] = []


def _math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(
            "rollout.reward=math needs the math-verify package (pip install 'math-verify[antlr4_13_2]'; "
            f"the project's setup.py installs it): {e}"
        ) from None
    return math_verify


def _timeout_s() -> int | None:
    """math-verify's timeouts use SIGALRM, which only the main thread may set: elsewhere (the async
    rollout's worker thread) it runs without them, said once."""
    if threading.current_thread() is threading.main_thread():
        return 5
    if not _warned_threads:
        _warned_threads.append(True)
        logging.getLogger(__name__).warning(
            "rollout.reward=math off the main thread: math-verify runs without its 5 s parse/compare timeout"
        )
    return None


def math_verify(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the reference, by math-verify (sympy comparison:
    0.5 == 1/2 == \\frac{1}{2}, (1,2) != (2,1)). The reference is read as the content of a \\boxed{}
    (as verl does); the response as its LAST boxed expression (math-verify alone takes the first),
    or, without one, as math-verify extracts from the text (then as inline math: it reads no bare
    "+5")."""
    mv = _math_verify()
    t = _timeout_s()
    ref = str(answer).strip()
    gold = mv.parse(ref if last_boxed(ref) is not None else f"\\boxed{{{ref}}}", parsing_timeout=t)
    text = str(response)
    boxed = last_boxed(text)
    if boxed is not None:
        pred = mv.parse(f"\\boxed{{{boxed}}}", parsing_timeout=t)
    else:
        pred = mv.parse(text, parsing_timeout=t) or mv.parse(f"${text.strip()}$", parsing_timeout=t)
    if not gold or not pred:
        return 0.0
    return 1.0 if mv.verify(gold, pred, timeout_seconds=t) else 0.0


def check_math_verify() -> None:
    """Raise at load (not at the first rollout) when rollout.reward=math cannot run."""
    _math_verify()


# ---------------------------------------------------------------------------------------------


def final_answer(response: str, answer: str) -> float:
    """1.0 when the last comma-separated field of a worked answer ("7+8=15,4+3+1=8,85") equals the
    answer; the steps before it earn nothing by themselves."""
    return exact_match(str(response).rsplit(",", 1)[-1], answer)


REWARD_FNS: dict[str, RewardFn] = {"exact_match": exact_match, "final_answer": final_answer, "math": math_verify}
# What rollout.reward names: "code" is an object built per run around its sandbox (code_reward.CodeReward).
REWARD_NAMES = tuple(sorted([*REWARD_FNS, "code"]))


def get_reward_fn(
    name: str, *, code_sandbox: str = "bwrap", code_workers: int = 4, code_timeout_s: float = 10.0
) -> RewardFn:
    """The reward `name` names, checked at load. The code_* settings are rollout.code_sandbox,
    rollout.code_workers and rollout.code_timeout_s; only rollout.reward=code reads them."""
    if name not in REWARD_NAMES:
        raise ValueError(f"unknown reward function {name!r}; allowed: {', '.join(REWARD_NAMES)}")
    if name == "code":
        from .code_reward import code_reward

        return code_reward(code_sandbox, code_workers, code_timeout_s)
    if name == "math":
        check_math_verify()
    return REWARD_FNS[name]


def reward_for(rollout) -> RewardFn:
    """The reward a run's rollout section names (rollout.reward, with its code_* settings): built once
    by the run and handed to its rollout and its quality gate."""
    return get_reward_fn(
        rollout.reward,
        code_sandbox=rollout.code_sandbox,
        code_workers=rollout.code_workers,
        code_timeout_s=rollout.code_timeout_s,
    )


@dataclass
class Scores:
    """A batch of answers scored: what the loop logs per step."""

    rewards: list[float]
    errors: int  # answers the reward could not score: it raised, a malformed task, a sandbox that failed
    reasons: dict[str, int] = field(default_factory=dict)  # the code reward: why answers scored 0 (all REASONS)


def score_all(fn: RewardFn, responses: list[str], answers: list[str]) -> Scores:
    """Each answer's reward, in order. A reward that scores a batch at once (the code reward's
    `score_many`, in parallel) does so and says why each zero is one; any other goes through `score`."""
    many = getattr(fn, "score_many", None)
    if many is None:
        scored = [score(fn, r, a) for r, a in zip(responses, answers)]
        return Scores([r for r, _ in scored], sum(e is not None for _, e in scored))
    from .code_reward import HOST_FAULTS, REASONS

    scored = many(responses, answers)
    why = [w for _, w in scored if w is not None]
    return Scores([r for r, _ in scored], sum(w in HOST_FAULTS for w in why), {k: why.count(k) for k in REASONS})


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
