"""The fault-injection points themselves: arming is checked, and only the named place fires."""

import pytest

from megatron_trace import faults


@pytest.fixture(autouse=True)
def clean():
    yield
    faults.disarm_all()


def test_only_the_armed_place_fires():
    seen = []
    faults.arm("train.done", lambda name, where: seen.append((name, where)), step=2)
    for step in range(4):
        faults.hit("train.done", step=step)
        faults.hit("rollout.done", step=step)
    assert seen == [("train.done", {"step": 2})]


def test_unknown_points_and_keys_are_refused():
    with pytest.raises(ValueError, match="unknown fault point 'train.dnoe'"):
        faults.arm("train.done".replace("done", "dnoe"))
    with pytest.raises(ValueError, match=r"has keys \('step',\); got \['steps'\]"):
        faults.arm("train.done", steps=1)
    assert faults.parse_spec("engine.decode_step:n=3") == ("engine.decode_step", {"n": 3})
    with pytest.raises(ValueError, match="expected name:key=INT"):
        faults.parse_spec("train.done:step=two")
