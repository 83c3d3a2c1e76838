"""Data for the RL loop: tokenizers, prompt sources and verifiable rewards.

Light on purpose: stdlib only at import (transformers loads lazily inside HFTokenizer).
"""

from .prompts import BUILTIN_PROMPTS, TASKS, ArithmeticTask, JsonlPrompts, Prompt, in_eval_split, prompt_source
from .rewards import REWARD_FNS, exact_match, final_answer, get_reward_fn, math_verify, score
from .tokenizer import CharTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "REWARD_FNS",
    "BUILTIN_PROMPTS",
    "TASKS",
    "ArithmeticTask",
    "CharTokenizer",
    "HFTokenizer",
    "JsonlPrompts",
    "Prompt",
    "exact_match",
    "final_answer",
    "get_reward_fn",
    "in_eval_split",
    "load_tokenizer",
    "math_verify",
    "prompt_source",
    "score",
]
