"""Policy losses and mismatch metrics against hand-computed values."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.config import AlgoConfig
from megatron_trace.rl import mismatch_metrics, policy_loss


def test_mismatch_metrics_by_hand():
    roll = [[-1.0, -2.0], [-0.5]]
    train = [[-1.1, -2.0], [-0.2]]
    m = mismatch_metrics(roll, train, is_clip=1.2)
    assert m["mean_abs_dlogp"] == pytest.approx((0.1 + 0 + 0.3) / 3)
    assert m["max_abs_dlogp"] == pytest.approx(0.3)
    d = [-0.1, 0.0, 0.3]
    assert m["k3_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3)
    assert m["ratio_max"] == pytest.approx(math.exp(0.3))
    assert m["clipped_frac"] == pytest.approx(1 / 3)
    assert m["dlogp_pos_0_8"] == pytest.approx(m["mean_abs_dlogp"])
    with pytest.raises(ValueError, match="sample 0"):
        mismatch_metrics([[-1.0]], [[-1.0, -2.0]])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-3, 3), min_size=1, max_size=30))
def test_k3_is_nonnegative_and_zero_iff_equal(d):
    roll = [[-1.0] * len(d)]
    train = [[-1.0 + x for x in d]]
    m = mismatch_metrics(roll, train)
    assert m["k3_kl"] >= -1e-12
    if all(x == 0 for x in d):
        assert m["k3_kl"] == 0 and m["mean_abs_dlogp"] == 0


def test_ppo_clip_gradient_and_dual_clip():
    logp = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    roll = torch.tensor([-1.0, -3.0, -3.0])  # ratios 1, e^2, e^2
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, m = policy_loss(logp, roll, adv, torch.ones(3), AlgoConfig(is_clip=5.0))
    # token 0: -r*A with r=1; token 1: clipped at 1.28 (no grad); token 2: A<0, max(min(rA, 1.28A... ), 5A) = -5
    assert float(loss) == pytest.approx(-1.0 - 1.28 + 5.0, rel=1e-5)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.0, 0.0, 0.0])
    assert m["is_clipped_frac"] == pytest.approx(2 / 3)


def test_tis_mis_none():
    logp = torch.tensor([-1.0, -1.0], requires_grad=True)
    roll = torch.tensor([-1.0, -4.0])
    adv = torch.tensor([2.0, 2.0])
    loss, _ = policy_loss(logp, roll, adv, torch.ones(2), AlgoConfig(loss="tis", tis_cap=2.0))
    assert float(loss) == pytest.approx(-(1 * -1 * 2) - (2 * -1 * 2))
    loss, m = policy_loss(logp, roll, adv, torch.ones(2), AlgoConfig(loss="mis"))
    assert m["masked_frac"] == pytest.approx(0.5) and float(loss) == pytest.approx(-2.0)
    loss, _ = policy_loss(logp, roll, adv, torch.tensor([1.0, 0.0]), AlgoConfig(loss="none"))
    assert float(loss) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="algo.loss must be one of"):
        AlgoConfig(loss="grpo")
