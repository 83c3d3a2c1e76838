"""Data for the RL loop: tokenizers, prompt sources and verifiable rewards (model-written code runs
only in data/sandbox.py).

Light on purpose: stdlib only at import (transformers loads lazily inside HFTokenizer).
"""

from .code_reward import CodeReward
from .code_tasks import CodeTasks
from .humaneval import load_humaneval
from .prompts import BUILTIN_PROMPTS, TASKS, ArithmeticTask, JsonlPrompts, Prompt, in_eval_split, prompt_source
from .rewards import (
    REWARD_FNS,
    REWARD_NAMES,
    Scores,
    exact_match,
    final_answer,
    get_reward_fn,
    math_verify,
    reward_for,
    score,
    score_all,
)
from .sandbox import RunResult, Sandbox, SandboxUnavailable
from .tokenizer import CharTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "REWARD_FNS",
    "REWARD_NAMES",
    "BUILTIN_PROMPTS",
    "TASKS",
    "ArithmeticTask",
    "CharTokenizer",
    "CodeReward",
    "CodeTasks",
    "HFTokenizer",
    "JsonlPrompts",
    "Prompt",
    "RunResult",
    "Sandbox",
    "SandboxUnavailable",
    "exact_match",
    "final_answer",
    "get_reward_fn",
    "in_eval_split",
    "load_humaneval",
    "load_tokenizer",
    "math_verify",
    "prompt_source",
    "Scores",
    "reward_for",
    "score",
    "score_all",
]
