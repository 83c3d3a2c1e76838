"""rollout.reward=code (data/code_reward.py): a response's first python block against HumanEval-style
hidden tests in the sandbox; 1.0 only for a run that reached its end, a counted reason otherwise."""

import json
import logging
import os
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_trace.data import REWARD_NAMES, get_reward_fn, score
from megatron_trace.data.code_reward import REASONS, CodeReward, answer_json, check_program, extract_code, task_text
from megatron_trace.data.sandbox import SandboxUnavailable

ANSWER = answer_json(
    "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n", "add"
)
RIGHT = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nIt adds."


@pytest.fixture(scope="module")
def reward():
    return get_reward_fn("code", code_workers=4, code_timeout_s=20.0)


# ------------------------------------------------------------------ the program a response holds


def test_extract_code_takes_the_first_python_block():
    assert extract_code(RIGHT) == "def add(a, b):\n    return a + b\n"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"  # untagged counts as python
    assert extract_code("```bash\nrm -rf /\n```\n```py\nx = 2\n```\n```python\nx = 3\n```") == "x = 2\n"
    assert extract_code("def f():\n    return 1\n") == "def f():\n    return 1\n"  # no fence: all of it
    assert extract_code("```js\nlet x = 1\n```") == ""  # fenced, but no python
    assert extract_code("- item\n  ```python\n  x = 1\n  ```") == "x = 1\n"  # indented fence, dedented
    assert extract_code("```python\ndef f():\n    return 1") == "def f():\n    return 1"  # truncated


_prose = st.text(st.characters(blacklist_characters="`"), max_size=40)


@given(_prose, st.text(max_size=80).filter(lambda c: "```" not in c and not c.endswith("`")), _prose)
def test_extract_code_returns_a_fenced_block_as_written(before, code, after):
    text = f"{before}\n```python\n{code}\n```\n{after}"
    assert extract_code(text) == textwrap.dedent(code + "\n")


@given(_prose)
def test_extract_code_takes_an_unfenced_response_whole(text):
    assert extract_code(text) == text


def test_check_program_is_humaneval_s():
    assert (
        check_program("def f(): pass", "def check(c): pass", "f") == "def f(): pass\n\ndef check(c): pass\n\ncheck(f)\n"
    )
    assert "```python\ndef add(a, b):\n```" in task_text("def add(a, b):\n")


# ------------------------------------------------------------------ scoring


def test_right_wrong_early_exit_and_malformed_answers(reward):
    responses = [
        RIGHT,
        "```python\ndef add(a, b):\n    return a - b\n```",
        "```python\nimport sys\ndef add(a, b):\n    return 0\nsys.exit(0)\n```",  # exits before check() runs
        "```python\nimport os\ndef add(a, b):\n    return 0\nos._exit(0)\n```",
        "I don't know.\n```text\nno\n```",
        RIGHT,
        RIGHT,
        "```python\ndef add(a, b):\n    while True:\n        pass\n```",
    ]
    answers = [ANSWER] * 5 + ["not json", json.dumps({"test": "def check(c): pass"}), ANSWER]
    short = CodeReward(type(reward.sandbox)(timeout_s=1.0), workers=4)
    got = reward.score_many(responses[:7], answers[:7]) + short.score_many(responses[7:], answers[7:])
    assert got == [
        (1.0, None),
        (0.0, "failed"),
        (0.0, "no_sentinel"),
        (0.0, "no_sentinel"),
        (0.0, "no_code"),
        (0.0, "bad_answer"),
        (0.0, "bad_answer"),
        (0.0, "timeout"),
    ]
    assert {r for _, r in got if r} <= set(REASONS)
    assert reward(RIGHT, ANSWER) == 1.0 and reward.isolation == "bwrap"


def test_the_loops_score_contract_holds(reward):
    """rewards.score: a model's failure is a 0, a malformed answer is a counted reward error."""
    assert score(reward, RIGHT, ANSWER) == (1.0, None)
    assert score(reward, "def add(a, b): return 0", ANSWER) == (0.0, None)
    r, err = score(reward, RIGHT, "{bad json")
    assert r == 0.0 and err.startswith("ValueError: a code task's answer is JSON")
    r, err = score(reward, RIGHT, json.dumps({"test": "x", "entry_point": "os.system('x')"}))
    assert r == 0.0 and "Python identifier" in err


def test_hostile_answers_score_zero_and_leave_the_host_alone(reward, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("42")
    hostile = [
        "```python\nimport os\nos.kill(os.getppid(), 9)\ndef add(a, b):\n    return 0\n```",
        f"```python\ndef add(a, b):\n    return int(open({str(secret)!r}).read()) * 0 + a + b\n```",
        "```python\nimport os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        break\n```",
        "```python\nx = bytearray(16 << 30)\n```",
        "```python\nimport socket\nsocket.create_connection(('127.0.0.1', 1), timeout=2)\n```",
        "```python\nopen('/tmp/pwned', 'w').write('x')\ndef add(a, b):\n    return 0\n```",
        "```python\nimport sys\nprint('x' * (8 << 20))\n```",
    ]
    got = reward.score_many(hostile, [ANSWER] * len(hostile))
    assert [r for r, _ in got] == [0.0] * len(hostile)
    assert [why for _, why in got] == ["failed", "failed", "failed", "oom", "failed", "failed", "output_limit"]
    os.kill(os.getpid(), 0)
    assert secret.read_text() == "42" and not os.path.exists("/tmp/pwned")


# ------------------------------------------------------------------ loading


def test_registry_knows_code_and_its_settings_are_checked():
    assert "code" in REWARD_NAMES
    with pytest.raises(ValueError, match="code, exact_match, final_answer, math"):
        get_reward_fn("unit_tests")
    with pytest.raises(ValueError, match="bwrap, rlimits"):
        get_reward_fn("code", code_sandbox="docker")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        get_reward_fn("code", code_timeout_s=0)


def test_without_bwrap_the_code_reward_fails_at_load_naming_the_opt_in(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match=r"bwrap.*apt-get install bubblewrap.*rollout\.code_sandbox=rlimits"):
        get_reward_fn("code")


def test_rlimits_is_an_explicit_opt_in_and_says_so(caplog):
    with caplog.at_level(logging.WARNING):
        weak = get_reward_fn("code", code_sandbox="rlimits", code_timeout_s=20.0)
    assert weak.isolation == "rlimits" and "no filesystem or network isolation" in caplog.text
    assert weak.score_many([RIGHT, "x = 1"], [ANSWER, ANSWER]) == [(1.0, None), (0.0, "failed")]
