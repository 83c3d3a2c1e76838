"""The one reader of JSON-lines prompt files: training prompts (`rollout.prompts=FILE`,
data/prompts.JsonlPrompts), the quality probe's (`megatron_trace.quality --prompts`) and the
static-scale calibration's (`transfer.static_scales`).

    for where, item in read_lines(path): ...          # "path:N" and the parsed JSON of each line
    ids, text = prompt_ids(item, tokenizer, where)    # one prompt line as token ids

A prompt line is a JSON list of token ids, `{"input_ids": [...]}`, `{"messages": [...]}` (the
tokenizer's chat template), `{"prompt": "..."}` / `{"text": "..."}`, or a JSON string; other keys
(`answer`, `id`) are the caller's. Blank lines are skipped; a line that is not JSON, or holds none of
these, is an error naming the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

PROMPT_FORMS = "a list of token ids, {'input_ids'}, {'messages'}, {'prompt'}, {'text'} or a string"


def read_lines(path: str | Path) -> Iterator[tuple[str, Any]]:
    """("path:N", the JSON value) of every non-blank line; ValueError naming a line that is not JSON,
    or the file when it holds no line at all."""
    seen = False
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
            seen = True
            yield f"{path}:{n}", value
    if not seen:
        raise ValueError(f"{path}: no prompts (the file is empty)")


def prompt_ids(item: Any, tokenizer: Callable[[], Any], where: str) -> tuple[list[int], str | None]:
    """(token ids, the prompt's text or None) of one prompt line. `tokenizer()` returns an HF tokenizer;
    it is called only for a line with text."""
    if isinstance(item, dict) and "input_ids" in item:
        item = item["input_ids"]
    if isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
        ids, text = item, None
    elif isinstance(item, dict) and "messages" in item:
        out = tokenizer().apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=True)
        ids = list(out["input_ids"] if isinstance(out, Mapping) or hasattr(out, "keys") else out)  # transformers 5
        text = item["messages"][-1].get("content", "") if item["messages"] else ""
    elif isinstance(item, (dict, str)):
        text = item if isinstance(item, str) else item.get("prompt", item.get("text"))
        if not isinstance(text, str):
            keys = sorted(item) if isinstance(item, dict) else type(item).__name__
            raise ValueError(f"{where}: a prompt line is {PROMPT_FORMS}; got {keys}")
        ids = tokenizer()(text)["input_ids"]
    else:
        raise ValueError(f"{where}: a prompt line is {PROMPT_FORMS}; got {type(item).__name__}")
    if not ids:
        raise ValueError(f"{where}: empty prompt")
    return [int(t) for t in ids], text
