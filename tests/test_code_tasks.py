"""Code tasks (data/code_tasks.py), HumanEval (data/humaneval.py) and HumanEval-format JSONL files:
HumanEval rows whose reference solutions pass the real sandbox and reward, and whose wrong ones fail."""

import json
import random
import re

import pytest

from megatron_trace.data import CodeTasks, JsonlPrompts, get_reward_fn, load_humaneval, prompt_source
from megatron_trace.data.code_reward import answer_json, parse_answer, task_text
from megatron_trace.data.code_tasks import DIFFICULTIES, FAMILIES, _spec, row
from megatron_trace.data.humaneval import humaneval_rows


@pytest.fixture(scope="module")
def reward():
    return get_reward_fn("code", code_workers=4, code_timeout_s=20.0)


def _k(prompt_id: str) -> int:
    return int(prompt_id.rsplit("-c", 1)[1])


def _constant(r: dict) -> str:
    """A wrong answer with the right name: the first example's result for every input."""
    first = re.search(r"== (.*)\n", r["test"]).group(1)
    return f"```python\ndef {r['entry_point']}(*args):\n    return {first}\n```"


# ------------------------------------------------------------------ the generated problems


def test_rows_are_humaneval_rows_with_hidden_tests():
    for k in range(300):
        r = row(k)
        assert set(r) == {"task_id", "prompt", "entry_point", "canonical_solution", "test", "difficulty"}
        assert r["task_id"] == f"code_tasks/{k}" and r["difficulty"] in DIFFICULTIES
        assert r["prompt"].startswith(f"def {r['entry_point']}(") and r["prompt"].count(">>> ") == 2
        assert r["test"].startswith("def check(candidate):\n") and r["test"].count("    assert candidate(") >= 4
        compile(r["prompt"] + r["canonical_solution"] + "\n" + r["test"], r["task_id"], "exec")
    assert row(7) == row(7)


def test_families_difficulties_and_the_size_of_the_space():
    specs = [_spec(k) for k in range(2000)]
    assert len(FAMILIES) >= 12
    assert {s.key.split(":")[0] for s in specs} == {f.__name__.lstrip("_") for f in FAMILIES}
    assert {s.difficulty for s in specs} == set(DIFFICULTIES)
    draws = [f(random.Random(i)) for i in range(1500) for f in FAMILIES]  # each family's parameters alone
    keys = {d.key for d in draws}
    assert len(keys) > 2000  # distinct functions, before counting their inputs
    assert len({k for k in keys if not k.startswith("count_letters:")}) > 1000  # not one family's letter sets


def test_sampling_is_deterministic_and_never_meets_the_eval_split():
    tasks = prompt_source("code_tasks", seed=0, tokenizer=None, eval_fraction=0.1)
    assert isinstance(tasks, CodeTasks)
    ev = tasks.eval_set(40)
    assert len(ev) == 40 and [p.text for p in ev] == [p.text for p in CodeTasks(5).eval_set(40)]  # any seed
    eval_keys = {_spec(_k(p.prompt_id)).key for p in ev}
    assert len(eval_keys) == 40  # distinct functions
    train = [p for step in range(30) for p in tasks.sample(16, step)]
    assert not eval_keys & {_spec(_k(p.prompt_id)).key for p in train}
    assert all(not tasks.is_eval(_k(p.prompt_id)) for p in train)
    assert [p.answer for p in tasks.sample(8, 3)] == [p.answer for p in CodeTasks(0).sample(8, 3)]  # resume
    assert [p.text for p in tasks.sample(8, 3)] != [p.text for p in CodeTasks(1).sample(8, 3)]  # seed
    p = train[0]
    r = row(_k(p.prompt_id))
    assert p.text == task_text(r["prompt"]) and "```python" in p.text
    assert parse_answer(p.answer) == (r["test"], r["entry_point"])
    assert p.solution == f"```python\n{r['prompt']}{r['canonical_solution']}```"


def test_difficulties_and_settings():
    hard = CodeTasks(0, difficulties=("hard",))
    assert {row(_k(p.prompt_id))["difficulty"] for p in hard.sample(12, 0) + hard.eval_set(4)} == {"hard"}
    with pytest.raises(ValueError, match="non-empty subset"):
        CodeTasks(difficulties=("expert",))
    with pytest.raises(ValueError, match=r"0 < rollout\.eval_fraction < 1"):
        CodeTasks(eval_fraction=0.0)


def test_reference_solutions_pass_the_sandbox_and_wrong_ones_fail(reward):
    per_family: dict[str, list[int]] = {}
    for k in range(5000):  # the first three problems of every family
        taken = per_family.setdefault(_spec(k).key.split(":")[0], [])
        if len(taken) < 3:
            taken.append(k)
    rows = [row(k) for ks in per_family.values() for k in ks]
    assert len(rows) == 3 * len(FAMILIES)
    prompts = [CodeTasks().sample(1, 0)[0]]  # and one through the Prompt the loop sees
    right = [p.solution for p in prompts] + [f"```python\n{r['prompt']}{r['canonical_solution']}```" for r in rows]
    wrong = [_constant(r) for r in rows]
    answers = [p.answer for p in prompts] + [answer_json(r["test"], r["entry_point"]) for r in rows]
    got = reward.score_many(right + wrong, answers + answers[1:])
    assert got[: len(right)] == [(1.0, None)] * len(right), [(r["task_id"], g) for r, g in zip(rows, got[1:])]
    assert got[len(right) :] == [(0.0, "failed")] * len(wrong)


# ------------------------------------------------------------------ HumanEval


def test_humaneval_loads_from_the_package_and_its_solutions_pass(reward):
    rows = humaneval_rows()
    assert len(rows) == 164 and rows[0]["task_id"] == "HumanEval/0"
    prompts = load_humaneval(20)
    assert [p.prompt_id for p in prompts] == [f"HumanEval-{i}" for i in range(20)]
    assert prompts[3].text == task_text(rows[3]["prompt"])
    wrong = [f"```python\ndef {r['entry_point']}(*args):\n    return None\n```" for r in rows[:20]]
    got = reward.score_many([p.solution for p in prompts] + wrong, [p.answer for p in prompts] * 2)
    assert got[:20] == [(1.0, None)] * 20, [(p.prompt_id, g) for p, g in zip(prompts, got)]
    assert got[20:] == [(0.0, "failed")] * 20


def test_a_humaneval_jsonl_file_is_a_code_task_source(tmp_path, reward):
    path = tmp_path / "he.jsonl"
    rows = humaneval_rows(6)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = JsonlPrompts(path, shuffle_seed=0)
    got = sorted(src.sample(6, 0), key=lambda p: int(p.prompt_id.rsplit("-", 1)[1]))
    assert [p.prompt_id.split("-", 2)[2] for p in got] == [f"HumanEval-{i}" for i in range(6)]
    assert [p.text for p in got] == [task_text(r["prompt"]) for r in rows]
    assert [p.answer for p in got] == [answer_json(r["test"], r["entry_point"]) for r in rows]
    solved = [f"```python\n{r['prompt']}{r['canonical_solution']}```" for r in rows]
    assert reward.score_many(solved, [p.answer for p in got]) == [(1.0, None)] * 6


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"prompt": "def f():\n", "test": "def check(c): pass"}, r":2: a HumanEval row needs .*'entry_point'"),
        ({"prompt": "", "test": "x", "entry_point": "f"}, r":2: a HumanEval row needs .*'prompt'"),
        ({"prompt": "def f():\n", "test": "x", "entry_point": "f()"}, r":2: 'entry_point' must be a Python identifier"),
    ],
)
def test_bad_humaneval_rows_are_named_at_load(tmp_path, bad, match):
    path = tmp_path / "he.jsonl"
    path.write_text(json.dumps({"prompt": "q", "answer": "1"}) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=match):
        JsonlPrompts(path)
