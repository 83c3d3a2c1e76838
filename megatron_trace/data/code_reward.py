"""`rollout.reward=code`: a response's program against a task's hidden tests, in the sandbox.

The contract with the prompt sources (data/code_tasks.py, data/humaneval.py, HumanEval-format JSONL
files): a task's answer is the JSON `{"test": ..., "entry_point": ...}` of HumanEval's fields, and
its prompt asks for the function in a ```python block (`task_text`). The program is the response's
first python block (or the whole response when it has no fenced block at all), run as HumanEval's
check program, `<code>\\n\\n<test>\\n\\ncheck(<entry_point>)`, inside `sandbox.Sandbox`. Reward 1.0
only when the sandbox says "passed": the tests ran to their end and the process exited 0.

`CodeReward.score_many` scores a step's answers in parallel and says why each failed one scored 0
(REASONS), so the loop can count them; calling the object scores one answer.
"""

from __future__ import annotations

import json
import logging
import re
import textwrap
from dataclasses import dataclass, field

from .sandbox import STATUSES, Sandbox, SandboxUnavailable

# Why an answer scored 0: the sandbox's statuses, an answer without code, a task whose answer is
# not the JSON above (a data bug, not the model's).
REASONS = tuple(s for s in STATUSES if s != "passed") + ("no_code", "bad_answer")
HOST_FAULTS = ("bad_answer", "sandbox_error")  # what __call__ raises for: errors to count, not model failures
PYTHON_TAGS = ("", "python", "py", "python3")

_OPEN = re.compile(r"```[ \t]*([\w+.-]*)[^\n`]*\n")
_CLOSE = "```"


def extract_code(response: str) -> str:
    """The body of the first fenced block tagged python (or untagged), dedented; an unclosed one (a
    truncated response) runs to the end. A response without any fence is taken whole as code; one
    whose fenced blocks are all in other languages has none ("")."""
    pos, fenced = 0, False
    while (m := _OPEN.search(response, pos)) is not None:
        end = response.find(_CLOSE, m.end())
        body = response[m.end() : end if end >= 0 else len(response)]
        if m.group(1).lower() in PYTHON_TAGS:
            return textwrap.dedent(body)
        if end < 0:
            return ""
        pos, fenced = end + len(_CLOSE), True
    return "" if fenced or _CLOSE in response else response


def answer_json(test: str, entry_point: str) -> str:
    """A code task's answer: what `parse_answer` reads back."""
    return json.dumps({"test": test, "entry_point": entry_point})


def parse_answer(answer: str) -> tuple[str, str]:
    """(test, entry_point) of an answer; ValueError saying what is wrong with it."""
    try:
        obj = json.loads(answer)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"a code task's answer is JSON with 'test' and 'entry_point'; got {str(answer)[:80]!r} ({e})"
        ) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("test"), str) or not isinstance(obj.get("entry_point"), str):
        raise ValueError(f"a code task's answer is JSON with string 'test' and 'entry_point'; got {str(answer)[:80]!r}")
    if not obj["entry_point"].isidentifier():
        raise ValueError(f"a code task's entry_point must be a Python identifier; got {obj['entry_point']!r}")
    return obj["test"], obj["entry_point"]


def check_program(code: str, test: str, entry_point: str) -> str:
    """HumanEval's check program (the sandbox's harness adds the sentinel after it)."""
    return f"{code}\n\n{test}\n\ncheck({entry_point})\n"


def task_text(prompt: str) -> str:
    """The user turn of a code task: HumanEval's function stub with the instruction the reward needs."""
    return (
        "Complete the following Python function. Reply with the complete function, including its "
        f"signature, in a single ```python code block.\n\n```python\n{prompt.rstrip()}\n```"
    )


@dataclass
class CodeReward:
    """The code reward over one sandbox. `isolation` ("bwrap" or "rlimits") is the sandbox's, for the
    caller to log with every step's counts."""

    sandbox: Sandbox
    workers: int | None = None  # answers run at once by score_many (default: the sandbox's)
    isolation: str = field(init=False)

    def __post_init__(self) -> None:
        self.isolation = self.sandbox.isolation

    def score_many(self, responses: list[str], answers: list[str]) -> list[tuple[float, str | None]]:
        """(reward, None) for each passing answer, (0.0, reason in REASONS) for the rest, in order."""
        if len(responses) != len(answers):
            raise ValueError(f"score_many: {len(responses)} responses for {len(answers)} answers")
        out: list[tuple[float, str | None]] = [(0.0, None)] * len(responses)
        programs, where = [], []
        for i, (response, answer) in enumerate(zip(responses, answers)):
            try:
                test, entry_point = parse_answer(answer)
            except ValueError:
                out[i] = (0.0, "bad_answer")
                continue
            code = extract_code(str(response))
            if not code.strip():
                out[i] = (0.0, "no_code")
                continue
            programs.append(check_program(code, test, entry_point))
            where.append(i)
        for i, r in zip(where, self.sandbox.run_many(programs, self.workers)):
            out[i] = (1.0, None) if r.passed else (0.0, r.status)
        return out

    def __call__(self, response: str, answer: str) -> float:
        """One answer's reward. A malformed answer or a sandbox that failed to start raises (`rewards.score`
        then counts it as a reward error); whatever the model's code did scores 0."""
        [(reward, reason)] = self.score_many([response], [answer])
        if reason == "bad_answer":
            parse_answer(answer)
        if reason == "sandbox_error":
            raise RuntimeError(f"the {self.isolation} sandbox failed to run a program")
        return reward


def code_reward(sandbox: str = "bwrap", workers: int = 4, timeout_s: float = 10.0) -> CodeReward:
    """`rollout.reward=code` with `rollout.code_sandbox` (its mode), `rollout.code_workers` and
    `rollout.code_timeout_s`; raises SandboxUnavailable at load when the sandbox cannot run here."""
    try:
        box = Sandbox(sandbox, timeout_s=timeout_s, workers=workers)
    except SandboxUnavailable as e:
        raise SandboxUnavailable(
            f"rollout.reward=code: {e}. The weaker mode is rollout.code_sandbox=rlimits (an explicit opt-in)"
        ) from None
    if box.isolation != "bwrap":
        logging.getLogger(__name__).warning(
            "rollout.reward=code runs model-written code with rollout.code_sandbox=%s: resource limits only, "
            "no filesystem or network isolation",
            box.isolation,
        )
    return CodeReward(box, workers)
