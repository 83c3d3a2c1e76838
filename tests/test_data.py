"""megatron_trace.data: tokenizers, prompt sources (determinism, JSONL validation) and rewards."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_trace.data import (
    ArithmeticTask,
    CharTokenizer,
    HFTokenizer,
    JsonlPrompts,
    exact_match,
    get_reward_fn,
    load_tokenizer,
    math_verify,
    score,
)
from megatron_trace.data.tokenizer import DEFAULT_CHARS

# ------------------------------------------------------------------ tokenizers


def test_char_tokenizer_basics():
    tok = CharTokenizer()
    assert tok.vocab_size < 64
    assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
    ids = tok.encode("3+4=7")
    assert tok.decode(ids) == "3+4=7"
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == "3+4=7"  # specials skipped by default
    assert tok.decode([tok.eos_id], skip_special_tokens=False) == "<|im_end|>"
    assert tok.encode_prompt("1+1=") == [tok.bos_id] + tok.encode("1+1=")
    with pytest.raises(ValueError, match="'#'"):
        tok.encode("1#2")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


@given(st.text(alphabet=DEFAULT_CHARS, max_size=40))
def test_char_tokenizer_round_trip(text):
    tok = CharTokenizer()
    assert tok.decode(tok.encode(text)) == text
    assert all(0 <= i < tok.vocab_size for i in tok.encode(text))


def test_char_tokenizer_save_load(tmp_path):
    tok = CharTokenizer()
    path = tok.save(str(tmp_path / "tok"))
    assert path.endswith("char_tokenizer.json")
    assert CharTokenizer.load(str(tmp_path / "tok")) == tok
    loaded = load_tokenizer(str(tmp_path / "tok"))
    assert isinstance(loaded, CharTokenizer) and loaded.encode("12+3=") == tok.encode("12+3=")
    assert isinstance(load_tokenizer("char"), CharTokenizer) and isinstance(load_tokenizer(None), CharTokenizer)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "char_tokenizer.json").write_text(json.dumps({"type": "bpe"}))
    with pytest.raises(ValueError, match="not a CharTokenizer"):
        load_tokenizer(str(tmp_path / "bad"))


def _tiny_hf_tokenizer(chat_template=None):
    """A PreTrainedTokenizerFast over an in-memory WordLevel model: no hub, no files."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {
        w: i
        for i, w in enumerate(
            ["<unk>", "<s>", "<|im_end|>", "<|im_start|>", "user", "assistant", "what", "is", "1+1", "?", "\n"]
        )
    }
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>"
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    if chat_template:
        tok.chat_template = chat_template
    return tok


TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def test_hf_tokenizer_chat_template(tmp_path):
    tok = HFTokenizer(_tiny_hf_tokenizer(TEMPLATE))
    assert tok.has_chat_template and tok.eos_id == 2 and tok.pad_id == 2  # no pad token: falls back to EOS
    rendered = tok.render_prompt("what is 1+1 ?")
    assert rendered.startswith("<|im_start|> user what is 1+1 ?") and rendered.rstrip().endswith("assistant")
    ids = tok.encode_prompt("what is 1+1 ?")
    assert ids == tok.encode(rendered) and ids[0] == 3 and ids[-1] == 5
    # The saved directory loads back through load_tokenizer (AutoTokenizer, offline).
    tok.save(str(tmp_path / "hf"))
    again = load_tokenizer(str(tmp_path / "hf"))
    assert isinstance(again, HFTokenizer) and again.encode_prompt("what is 1+1 ?") == ids
    # JSONL prompts go through the template.
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "what is 1+1 ?", "answer": 2}) + "\n")
    (p,) = JsonlPrompts(path, tokenizer=tok).sample(1, 0)
    assert p.text == "what is 1+1 ?" and p.answer == "2" and p.input_ids == ids


def test_hf_tokenizer_without_template_uses_raw_prompt():
    tok = HFTokenizer(_tiny_hf_tokenizer(None))
    assert not tok.has_chat_template
    assert tok.render_prompt("what is 1+1 ?") == "what is 1+1 ?"
    assert tok.encode("what is 1+1 ?") == [6, 7, 8, 9]
    assert tok.encode_prompt("what is 1+1 ?")[-4:] == [6, 7, 8, 9]  # raw text (plus any specials it adds)
    assert tok.decode(tok.encode("what is 1+1 ?")) == "what is 1+1 ?"


# ------------------------------------------------------------------ prompts


def test_arithmetic_deterministic_per_seed_and_step():
    tok = CharTokenizer()
    a, b = ArithmeticTask(seed=7, tokenizer=tok), ArithmeticTask(seed=7, tokenizer=tok)
    # Drawing other steps first (as a fresh run would, unlike a resumed one) changes nothing.
    a.sample(8, 0), a.sample(8, 1)
    assert a.sample(8, 5) == b.sample(8, 5)
    assert a.sample(8, 5) != a.sample(8, 6)
    assert ArithmeticTask(seed=8).sample(8, 5) != ArithmeticTask(seed=7).sample(8, 5)
    ps = a.sample(64, 3)
    assert len({p.prompt_id for p in ps}) == 64
    assert not {p.prompt_id for p in ps} & {p.prompt_id for p in a.sample(64, 4)}
    for p in ps:
        assert p.input_ids == [tok.bos_id] + tok.encode(p.text)


@given(st.integers(0, 2**31), st.integers(0, 10**6), st.sampled_from([("+",), ("-",), ("+", "-"), ("*",)]))
def test_arithmetic_answers_are_correct(seed, step, ops):
    for p in ArithmeticTask(seed, ops=ops).sample(4, step):
        a, op, b = p.text[0], p.text[1], p.text[2]
        assert p.text == f"{a}{op}{b}="
        assert int(p.answer) == eval(p.text[:-1]) >= 0  # noqa: S307 - digits and one operator
        if ops == ("+",):
            assert 0 <= int(p.answer) <= 18


def test_arithmetic_validation():
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(0, ops=("/",))
    with pytest.raises(ValueError, match="template"):
        ArithmeticTask(0, template="{a}+{b}")


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_order_deterministic_and_covers_epochs(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)] + [""])
    ds = JsonlPrompts(path, shuffle_seed=3)
    assert len(ds) == 10  # the blank line is skipped
    steps = [ds.sample(4, s) for s in range(5)]  # 20 items: two full epochs
    assert [p.text for p in steps[2]] == [p.text for p in JsonlPrompts(path, shuffle_seed=3).sample(4, 2)]
    flat = [p.text for s in steps for p in s]
    assert sorted(flat[:10]) == sorted(f"q{i}" for i in range(10))  # each epoch is a permutation
    assert sorted(flat[10:]) == sorted(flat[:10]) and flat[10:] != flat[:10]
    assert flat[:10] != [f"q{i}" for i in range(10)]  # shuffled
    assert [p.text for p in JsonlPrompts(path, shuffle_seed=4).sample(10, 0)] != flat[:10]
    ids = [p.prompt_id for s in steps for p in s]
    assert len(set(ids)) == len(ids)
    assert all(p.answer == p.text[1:] for s in steps for p in s)


@pytest.mark.parametrize(
    "bad, match",
    [
        ('{"prompt": "x"}', r":3: missing key 'answer'"),
        ('{"answer": "x"}', r":3: missing key 'prompt'"),
        ("{not json", r":3: not valid JSON"),
        ('["prompt", "answer"]', r":3: expected a JSON object"),
        ('{"prompt": "", "answer": "1"}', r":3: 'prompt' must be a non-empty string"),
        ('{"prompt": "x", "answer": null}', r":3: 'answer' must be a string or a number"),
    ],
)
def test_jsonl_validation_names_line(tmp_path, bad, match):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, "", bad])
    with pytest.raises(ValueError, match=match) as e:
        JsonlPrompts(path)
    assert str(path) in str(e.value)


def test_jsonl_empty_file(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="no prompts"):
        JsonlPrompts(tmp_path / "e.jsonl")


# ------------------------------------------------------------------ rewards


def test_exact_match():
    assert exact_match(" 7\n", "7") == 1.0
    assert exact_match("7", 7) == 1.0
    assert exact_match("07", "7") == 0.0 and exact_match("", "7") == 0.0


@pytest.mark.parametrize(
    "response, answer",
    [
        (r"so \boxed{\frac{1}{2}}", "0.5"),
        (r"\boxed{\dfrac{1}{2}}", "1/2"),
        ("1,000", "1000"),
        ("1,234,567.5", "1234567.5"),
        ("+5", "5"),
        ("5.0", "5"),
        ("5", "5.000"),
        (r"$\frac12$", "0.5"),
        (r"first \boxed{3}, then \boxed{4}", "4"),
        (r"\boxed{\boxed{4}}", "4"),
        (r"\boxed{\frac{\frac{1}{2}}{3}}", "1/6"),
        (r"\boxed{-\frac{3}{4}}", "-0.75"),
        (r"\boxed{\text{yes}}", "yes"),
        (r"\boxed{5\text{ cm}}", "5cm"),
        (r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt2}{2}"),
        (r"\boxed{\frac{\pi}{2}}", r"\pi/2"),
        ("x = 3", "3"),
        (r"\boxed{90^\circ}", "90"),
        ("7.", r"\boxed{7}"),  # boxed reference, sentence-final period
        (r"\boxed{(1,2)}", "(1, 2)"),
        ("0.3333333", "1/3"),
    ],
)
def test_math_verify_equal(response, answer):
    assert math_verify(response, answer) == 1.0


@pytest.mark.parametrize(
    "response, answer",
    [
        ("7", "8"),
        (r"\boxed{1}{2}", "12"),
        (r"\boxed{", "1"),  # truncated: no closed box, whole text compared
        ("", "0"),
        ("1/0", "0"),
        ("0.49", "1/2"),
        (r"\boxed{(1,2)}", "(2,1)"),
        ("1,00", "100"),  # not a thousands grouping
        ("abc", "abd"),
    ],
)
def test_math_verify_not_equal(response, answer):
    assert math_verify(response, answer) == 0.0


@given(st.integers(-(10**6), 10**6))
def test_math_verify_integer_forms(n):
    assert math_verify(rf"\boxed{{{n}}}", str(n)) == 1.0
    assert math_verify(f"{n}.0", str(n)) == 1.0
    assert math_verify(f"{n:,}", str(n)) == 1.0
    assert math_verify(str(n + 1), str(n)) == 0.0


@given(st.integers(-50, 50), st.integers(1, 50))
def test_math_verify_fraction_forms(p, q):
    from fractions import Fraction

    assert math_verify(rf"\boxed{{\frac{{{p}}}{{{q}}}}}", str(float(Fraction(p, q)))) == 1.0
    assert math_verify(f"{p}/{q}", rf"\frac{{{p}}}{{{q}}}") == 1.0


def test_score_and_registry():
    def boom(response, answer):
        raise RuntimeError("verifier bug")

    assert score(boom, "x", "y") == (0.0, "RuntimeError: verifier bug")
    assert score(lambda r, a: float("nan"), "x", "y")[0] == 0.0
    assert score(lambda r, a: float("nan"), "x", "y")[1] is not None
    assert score(get_reward_fn("math"), r"\boxed{2}", "2") == (1.0, None)
    assert get_reward_fn("exact_match") is exact_match
    with pytest.raises(ValueError, match="exact_match, final_answer, math"):
        get_reward_fn("f1")
    assert get_reward_fn("final_answer")("7+8=15,4+3+1=8,85", "85") == 1.0
    assert get_reward_fn("final_answer")("7+8=15,4+3+1=8,84", "85") == 0.0


@given(st.text(max_size=60), st.text(max_size=20))
def test_math_verify_never_raises(response, answer):
    assert math_verify(response, answer) in (0.0, 1.0)


@pytest.mark.parametrize("name", ["arithmetic", "long_addition"])
def test_eval_split_never_meets_training(name):
    task = ArithmeticTask.named(name, seed=3)
    evals = task.eval_problems()
    every = {
        task._canonical(a, op, b)
        for a in range(task.max_operand + 1)
        for b in range(task.max_operand + 1)
        for op in task.ops
    }
    assert 0 < len(evals) < len(every) and len(set(evals)) == len(evals)
    eval_texts = {task.make(*p)[0] for p in evals}
    drawn = {p.text for step in range(-300, 300) for p in task.sample(32, step)}  # RL steps and warm start
    assert not drawn & eval_texts
    assert {p.text for p in task.eval_set(10**6)} == eval_texts
    # the split is a fact of the problem, not of the seed: every run evaluates on the same set
    assert ArithmeticTask.named(name, seed=99).eval_problems() == evals
    if name == "long_addition":  # big enough that 80 steps x 32 prompts cannot exhaust either side
        assert len(evals) > 900 and len(every) - len(evals) > 8000


def test_worked_addition_solution_and_its_carry():
    task = ArithmeticTask.named("long_addition")
    assert task.solution(47, 38) == "7+8=15,4+3+1=8,85"
    assert task.solution(67, 58) == "7+8=15,6+5+1=12,125"
    assert task.solution(5, 0) == "5+0=5,5" and task.solution(0, 0) == "0+0=0,0"
    p = task.sample(1, 0)[0]
    a, b = map(int, p.text[:-1].split("+"))
    assert p.solution == task.solution(a, b) and p.answer == str(a + b) and p.solution.endswith("," + p.answer)
    with pytest.raises(ValueError, match="addition only"):
        ArithmeticTask(ops=("+", "-"), worked=True)


def test_jsonl_eval_split(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"prompt": "q{i}", "answer": "{i}"}}\n' for i in range(200)))
    src = JsonlPrompts(path, eval_fraction=0.2)
    held = {p.text for p in src.eval_set(1000)}
    trained = {p.text for step in range(20) for p in src.sample(16, step)}
    assert 20 < len(held) < 60 and len(held) + len(src) == 200 and not held & trained
    assert len(trained) == len(src)  # training cycles through every line outside the split


def test_math_reward_needs_math_verify_and_says_so_at_load(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if not installed
    with pytest.raises(ImportError, match=r"rollout\.reward=math needs the math-verify package"):
        get_reward_fn("math")


def test_math_verify_runs_off_the_main_thread():
    """The async rollout scores in a worker thread, where math-verify's SIGALRM timeouts cannot be
    set: it verifies there without them (said once), instead of scoring every sample 0."""
    import threading

    got = []
    t = threading.Thread(target=lambda: got.append(math_verify(r"so \boxed{\frac{1}{2}}", "0.5")))
    t.start()
    t.join()
    assert got == [1.0]


# ------------------------------------------------------------------ word problems
def test_word_problems_split_determinism_and_answers():
    import re

    from megatron_trace.data import prompt_source
    from megatron_trace.data.word_problems import WordProblems

    wp = prompt_source("word_problems", seed=0, tokenizer=None, eval_fraction=0.1)
    assert isinstance(wp, WordProblems)
    ev = wp.eval_set(50)
    assert len(ev) == 50 and [p.text for p in ev] == [p.text for p in WordProblems(7).eval_set(50)]  # any seed
    train = [p for step in range(20) for p in wp.sample(16, step)]
    assert not {p.text for p in ev} & {p.text for p in train}  # the eval split is never drawn
    assert [p.text for p in wp.sample(16, 3)] == [p.text for p in WordProblems(0).sample(16, 3)]  # resume
    assert [p.text for p in wp.sample(16, 3)] != [p.text for p in WordProblems(1).sample(16, 3)]  # seed
    kinds = set()
    for p in ev + train:
        assert p.text.endswith("give the final answer as a number in \\boxed{}.")
        assert int(p.answer) >= 0 and math_verify(rf"so \boxed{{{p.answer}}}", p.answer) == 1.0
        kinds.add(p.text.split()[1])
        m = re.match(r"(\w+) has (\d+) \w+\. \1 buys (\d+) boxes with (\d+) \w+ in each box, then gives (\d+)", p.text)
        if m:  # recomputed from the text: a + b*c - d
            a, b, c, d = map(int, m.groups()[1:])
            assert int(p.answer) == a + b * c - d
    assert len(kinds) >= 5  # the templates all appear


def test_word_problems_need_a_held_out_split():
    from megatron_trace.data.word_problems import WordProblems

    with pytest.raises(ValueError, match=r"0 < rollout\.eval_fraction < 1"):
        WordProblems(0, eval_fraction=0.0)
