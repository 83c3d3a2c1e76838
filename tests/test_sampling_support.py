"""Top-p/top-k sampling: the recorded logprob is the one of the distribution sampled from, and the
trainer's recompute of it is the same number (importance ratio exactly 1 for identical logits)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.config import Config, RolloutConfig, TrainerConfig
from megatron_trace.trainer.actor import Actor
from megatron_trace.trainer.logprobs import VocabSpec, logprobs_from_logits
from sglang_backend.api import SamplingParams, keep_mask, support_logprob
from sglang_backend.local.sampling import sample_batch


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3.0  # peaked enough that top-p drops tokens


def _trainer_logprobs(cfg: RolloutConfig, logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    # The actor's own recompute function (one TP rank holding the whole vocabulary).
    spec = VocabSpec(0, logits.shape[-1], cfg.temperature, cfg.top_k, cfg.top_p)
    return logprobs_from_logits(logits, torch.tensor(tokens), spec)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    top_p=st.floats(0.05, 0.95),
    temperature=st.floats(0.3, 1.5),
    top_k=st.sampled_from([-1, 3, 17]),
)
def test_rollout_logprob_is_the_filtered_one_and_the_trainer_matches_it(seed, top_p, temperature, top_k):
    logits = _logits(6, 64, seed)
    params = [
        SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, sampling_seed=seed + i) for i in range(6)
    ]
    gens = [torch.Generator().manual_seed(seed + i) for i in range(6)]
    toks, lps = sample_batch(logits, params, gens)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    keep = keep_mask(logp.exp(), top_k, top_p)
    assert all(keep[i, t] for i, t in enumerate(toks)), "a token outside the support was sampled"
    # the distribution sampled from: renormalized over the support, so its logprobs sum to 1 there
    for i in range(6):
        support = keep[i].nonzero()[:, 0]
        full = support_logprob(logp[i].expand(len(support), -1), support, keep[i].expand(len(support), -1))
        assert torch.exp(full).sum().item() == pytest.approx(1.0, abs=1e-5)
        assert lps[i] == pytest.approx(full[(support == toks[i]).nonzero()[0, 0]].item(), abs=0)
        if logp[i].exp()[keep[i]].sum() < 0.999:  # mass was filtered: the unfiltered logprob is smaller
            assert lps[i] > logp[i, toks[i]].item()
    train = _trainer_logprobs(RolloutConfig(temperature=temperature, top_p=top_p, top_k=top_k), logits, toks)
    assert torch.equal(train, torch.tensor(lps)), "identical logits must give importance ratio exactly 1"


def test_trainer_keeps_a_sampled_token_its_own_nucleus_misses():
    logits = torch.tensor([[4.0, 3.9, 0.0, -2.0]])
    cfg = RolloutConfig(top_p=0.5)  # the trainer's nucleus is token 0 alone
    lp = _trainer_logprobs(cfg, logits, [1])  # the rollout (other numerics) sampled token 1
    p = torch.softmax(logits[0], -1)
    assert torch.isfinite(lp).all() and lp.item() == pytest.approx(torch.log(p[1] / (p[0] + p[1])).item(), rel=1e-6)


def test_greedy_temperature_is_refused_for_rl():
    with pytest.raises(ValueError, match=r"rollout\.temperature must be > 0.*Evaluation is greedy"):
        Config.load(None, ["rollout.temperature=0"])
    with pytest.raises(ValueError, match=r"rollout\.top_p must be in \(0, 1\]"):
        Config.load(None, ["rollout.top_p=0"])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        Actor(None, None, TrainerConfig(), RolloutConfig(temperature=0.0))


def test_greedy_rows_split_over_threads_give_the_serial_bits():
    """32 greedy rows of a real vocabulary: the C pick (rows over torch's threads) equals itself on
    one thread bit for bit, torch's argmax, and log_softmax in float64 to 1e-6 (measured 1.2e-7;
    torch's fp32 log_softmax is 1.3e-5 off it, the C sum in fp32 lanes was 1e-4 off)."""
    logits = _logits(32, 151936, 5)
    params = [SamplingParams(temperature=0)] * 32
    gens = [torch.Generator() for _ in range(32)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = sample_batch(logits, params, gens)
        torch.set_num_threads(2)
        two = sample_batch(logits, params, gens)
    finally:
        torch.set_num_threads(threads)
    assert one == two
    assert one[0] == logits.argmax(-1).tolist()
    want = torch.log_softmax(logits.double(), -1).gather(1, logits.argmax(-1)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(one[1]).double(), want, rtol=0, atol=1e-6)
