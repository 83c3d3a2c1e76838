"""Data for the RL loop: tokenizers, prompt sources and verifiable rewards.

Light on purpose: stdlib only at import (transformers loads lazily inside HFTokenizer).
"""
from .prompts import ArithmeticTask, JsonlPrompts, Prompt
from .rewards import REWARD_FNS, exact_match, get_reward_fn, math_verify, score
from .tokenizer import CharTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "REWARD_FNS",
    "ArithmeticTask",
    "CharTokenizer",
    "HFTokenizer",
    "JsonlPrompts",
    "Prompt",
    "exact_match",
    "get_reward_fn",
    "load_tokenizer",
    "math_verify",
    "score",
]
