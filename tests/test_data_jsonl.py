"""data/jsonl.py: the one reader of prompt files (training, the quality probe, calibration)."""

import pytest


def test_one_jsonl_reader_takes_every_prompt_form_and_names_bad_lines(tmp_path):
    """data/jsonl.py, the reader of training, quality and calibration prompt files: ids, text, chat."""
    from megatron_trace.data.jsonl import prompt_ids, read_lines

    class Tok:
        def __call__(self, text):
            return {"input_ids": [ord(c) for c in text]}

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return {"input_ids": [len(m["content"]) for m in messages] + [0]}

    f = tmp_path / "p.jsonl"
    f.write_text(
        '[1, 2]\n{"input_ids": [3]}\n\n"ab"\n{"prompt": "c", "answer": 1}\n{"text": "d"}\n'
        '{"messages": [{"role": "user", "content": "xyz"}]}\n'
    )
    got = [(w.rsplit(":", 1)[1], prompt_ids(item, Tok, w)) for w, item in read_lines(f)]
    assert got == [
        ("1", ([1, 2], None)),
        ("2", ([3], None)),
        ("4", ([97, 98], "ab")),
        ("5", ([99], "c")),
        ("6", ([100], "d")),
        ("7", ([3, 0], "xyz")),
    ]
    for line, msg in (
        ("{nope", ":1: not valid JSON"),
        ('{"q": 1}', r":1: a prompt line is .*\['q'\]"),
        ("[]", ":1: empty"),
    ):
        f.write_text(line + "\n")
        with pytest.raises(ValueError, match=msg):
            [prompt_ids(item, Tok, w) for w, item in read_lines(f)]
    f.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        list(read_lines(f))
