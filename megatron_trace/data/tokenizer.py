"""Tokenizers the RL loop uses: a tiny character tokenizer for the built-in arithmetic task and a
thin wrapper over a Hugging Face tokenizer for JSONL datasets.

Both expose the same small surface: `vocab_size`, `pad_id`, `bos_id`, `eos_id`, `encode`,
`decode`, `render_prompt` (the text the model actually sees: the chat template when there is
one), `encode_prompt` (its token ids) and `save(dir)`. `load_tokenizer` picks one from a spec.
"""

from __future__ import annotations

import json
import os
from typing import Any

CHAR_TOKENIZER_FILE = "char_tokenizer.json"

# Specials come first so their ids are stable (0, 1, 2) whatever the character set is.
PAD, BOS, EOS = "<pad>", "<bos>", "<|im_end|>"
DEFAULT_SPECIALS = (PAD, BOS, EOS)
# Digits and operators for the arithmetic task, plus lowercase letters and a little punctuation
# so short natural-language prompt formats ("what is 3+4?") also fit; 48 symbols in all.
DEFAULT_CHARS = "0123456789+-*= " + "abcdefghijklmnopqrstuvwxyz" + "?.,:\n()"


class CharTokenizer:
    """A deterministic character-level tokenizer: one id per character, specials first.

    Unknown characters raise (silently mapping them to an <unk> would let a prompt format typo
    train the model on garbage).
    """

    def __init__(self, chars: str = DEFAULT_CHARS, specials: tuple[str, ...] = DEFAULT_SPECIALS) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer chars must not repeat")
        if len(specials) < 3 or set(specials) & set(chars):
            raise ValueError(f"CharTokenizer needs pad, bos, eos specials (distinct from chars); got {specials}")
        self.chars = chars
        self.specials = tuple(specials)
        self._itos = list(self.specials) + list(chars)
        self._stoi = {c: i + len(self.specials) for i, c in enumerate(chars)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.eos_token = self.specials[2]

    @property
    def vocab_size(self) -> int:
        return len(self._itos)

    @property
    def has_chat_template(self) -> bool:
        return False

    def encode(self, text: str) -> list[int]:
        try:
            return [self._stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(f"CharTokenizer has no token for character {e.args[0]!r} in {text!r}") from None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self._itos):
                raise ValueError(f"CharTokenizer id {i} is outside the vocabulary (size {self.vocab_size})")
            if i < len(self.specials) and skip_special_tokens:
                continue
            out.append(self._itos[i])
        return "".join(out)

    def render_prompt(self, text: str) -> str:
        return text

    def encode_prompt(self, text: str) -> list[int]:
        """BOS then the characters: the generation starts right after the prompt (e.g. "3+4=")."""
        return [self.bos_id] + self.encode(text)

    def save(self, directory: str) -> str:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, CHAR_TOKENIZER_FILE)
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"type": "char", "specials": list(self.specials), "chars": self.chars}, f)
        return path

    @classmethod
    def load(cls, directory: str) -> CharTokenizer:
        path = directory if directory.endswith(".json") else os.path.join(directory, CHAR_TOKENIZER_FILE)
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        if spec.get("type") != "char" or "chars" not in spec:
            raise ValueError(f"{path} is not a CharTokenizer file (want type 'char' and 'chars')")
        return cls(spec["chars"], tuple(spec.get("specials", DEFAULT_SPECIALS)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and (self.chars, self.specials) == (other.chars, other.specials)


class HFTokenizer:
    """A `transformers` tokenizer behind the same surface as CharTokenizer.

    `transformers` is imported lazily so the arithmetic default never pays for it. The pad id
    falls back to EOS (many causal-LM tokenizers define no pad token).
    """

    def __init__(self, path_or_tokenizer: Any) -> None:
        if isinstance(path_or_tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer  # lazy: heavy import

            self.path = os.fspath(path_or_tokenizer)
            self.tok = AutoTokenizer.from_pretrained(self.path)
        else:
            self.path = getattr(path_or_tokenizer, "name_or_path", None)
            self.tok = path_or_tokenizer
        if self.tok.eos_token_id is None:
            raise ValueError(f"tokenizer {self.path!r} defines no eos token; the rollout needs one to stop")
        self.eos_id = int(self.tok.eos_token_id)
        self.eos_token = self.tok.eos_token
        self.pad_id = int(self.tok.pad_token_id) if self.tok.pad_token_id is not None else self.eos_id
        self.bos_id = int(self.tok.bos_token_id) if self.tok.bos_token_id is not None else None

    @property
    def vocab_size(self) -> int:
        return len(self.tok)  # includes added tokens, unlike tok.vocab_size

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_prompt(self, text: str) -> str:
        """The user turn through the chat template (with the assistant header), or the raw text."""
        if not self.has_chat_template:
            return text
        return self.tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )

    def encode_prompt(self, text: str) -> list[int]:
        if self.has_chat_template:
            # The template already writes any BOS it wants; adding specials again would double it.
            return self.encode(self.render_prompt(text))
        return list(self.tok.encode(text, add_special_tokens=True))

    def save(self, directory: str) -> str:
        self.tok.save_pretrained(directory)
        return directory


def load_tokenizer(path_or_spec: str | os.PathLike | None = "char"):
    """ "char" (or None) -> the default CharTokenizer; a directory or file holding
    char_tokenizer.json -> that CharTokenizer; anything else -> HFTokenizer(path)."""
    if path_or_spec is None or path_or_spec == "char":
        return CharTokenizer()
    spec = os.fspath(path_or_spec)
    if os.path.basename(spec) == CHAR_TOKENIZER_FILE or os.path.isfile(os.path.join(spec, CHAR_TOKENIZER_FILE)):
        return CharTokenizer.load(spec)
    return HFTokenizer(spec)
