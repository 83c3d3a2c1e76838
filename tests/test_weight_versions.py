"""Weight versions: the trainer's step numbers everywhere, strings only on the wire (SGLang's
weight_version), converted by `wire_version` / `version_step` and compared by `serves_version`."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_backend.api import DEFAULT_VERSION, serves_version, version_step, wire_version


@given(st.integers(min_value=0, max_value=10**9))
def test_a_step_survives_the_wire(step):
    assert version_step(wire_version(step)) == step
    assert serves_version(wire_version(step), step) and serves_version(step, wire_version(step))
    assert not serves_version(wire_version(step + 1), step)


def test_sglangs_launch_default_is_version_zero():
    assert serves_version(DEFAULT_VERSION, 0) and not serves_version(DEFAULT_VERSION, 1)
    assert wire_version(DEFAULT_VERSION) == "0"


@pytest.mark.parametrize("served", ["other-run-7", "", None, "7.0", True, " 7"])
def test_a_version_the_trainer_never_set_is_served_by_no_step(served):
    assert not serves_version(served, 7)


def test_a_name_the_trainer_cannot_send_is_refused_by_name():
    with pytest.raises(ValueError, match="'v2' is not one the trainer set"):
        wire_version("v2")
