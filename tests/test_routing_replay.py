"""Routing replay in the trainer against HF transformers with the same routing forced, and the
probe's numbers with and without replay on the tiny Qwen3-MoE.

HF is the reference for a forced routing: each layer's router keeps its logits but takes the given
experts, weighted by the softmax of their logits (renormalized top-k, as Qwen3-MoE). Megatron's
RouterReplay must give the same logits AND the same router-weight gradients (replay in backward).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.models import ModelArch, QuantPolicy, make_tiny_checkpoint
from megatron_trace.trainer.batching import columns

TOKENS = [[5, 17, 3, 99, 42, 7, 7, 61, 200, 13], [8, 1, 250, 4, 33, 90, 12, 6, 71, 2]]


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3_moe", seed=3)


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _hf_forced(path, forced: torch.Tensor | None):
    """HF logits [B, S, V] and router-weight grads (of the summed next-token logprob) with every
    layer's routing forced to `forced` [B*S, layers, k] (None: HF's own routing)."""
    hf = _hf(path)
    for layer, block in enumerate(hf.model.layers):
        gate = block.mlp.gate
        if forced is not None:

            def fwd(h, gate=gate, ids=forced[:, layer]):
                logits = torch.nn.functional.linear(h.reshape(-1, gate.hidden_dim), gate.weight)
                w = torch.softmax(logits.gather(1, ids), dim=-1)  # = renormalized top-k probs
                return logits, w.to(logits.dtype), ids

            gate.forward = fwd
    ids = torch.tensor(TOKENS)
    logits = hf(ids[:, :-1]).logits
    loss = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).sum()
    loss.backward()
    return logits.detach(), [b.mlp.gate.weight.grad.clone() for b in hf.model.layers]


def _megatron(actor, routed: list[torch.Tensor | None]):
    from megatron_trace.trainer.gpt import _unwrap

    ids = torch.tensor(TOKENS)
    b, s = ids.shape[0], ids.shape[1] - 1
    pos = torch.arange(s).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    actor.ddp.zero_grad_buffer()
    actor.routing.clear_counters()
    actor.routing.begin(routed, [f"s{i}" for i in range(b)], columns(b, s), b * s)
    try:
        logits = actor.ddp(ids[:, :-1], pos, mask)[..., : actor.arch.vocab_size]
        loss = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).sum()
        loss.backward()
    finally:
        actor.routing.end()
    model = _unwrap(actor.ddp)
    grads = [model.decoder.layers[i].mlp.router.weight.main_grad.clone() for i in range(actor.arch.num_layers)]
    return logits.detach(), grads, actor.routing.agreement()


@pytest.fixture(scope="module")
def actor(moe_ckpt):
    from megatron_trace.config import TrainerConfig
    from megatron_trace.trainer.actor import Actor
    from megatron_trace.trainer.parallel import destroy, init_distributed

    init_distributed()
    arch = ModelArch.from_hf_config(moe_ckpt)
    yield Actor(
        arch,
        QuantPolicy(kv="bf16"),
        TrainerConfig(qat_mode="off", routing_replay="on", lr=1e-5, micro_batch_size=4),
        hf_path=moe_ckpt,
    )
    destroy()


def test_replay_forward_and_backward_equal_hf_with_the_routing_forced(moe_ckpt, actor):
    arch = actor.arch
    hf = _hf(moe_ckpt).eval()
    with torch.no_grad():
        router_logits = hf(torch.tensor(TOKENS)[:, :-1], output_router_logits=True).router_logits
    # the experts HF's own router ranks LAST: a routing nobody would choose, so replay must show
    bottom = torch.stack([torch.topk(-r, arch.num_experts_per_tok, -1).indices for r in router_logits], 1)
    own = torch.stack([torch.topk(r, arch.num_experts_per_tok, -1).indices for r in router_logits], 1)
    s = len(TOKENS[0]) - 1

    def per_sample(t):
        return [t[i * s : (i + 1) * s] for i in range(len(TOKENS))]

    ref_logits, ref_grads = _hf_forced(moe_ckpt, bottom)
    logits, grads, agree = _megatron(actor, per_sample(bottom))
    assert torch.allclose(logits, ref_logits, atol=1e-4), (logits - ref_logits).abs().max()
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, atol=1e-4, rtol=1e-4), (g - r).abs().max()
    # the trainer's own router disagrees (not on all: after forced layers its inputs are another model's)
    assert agree["routing_replayed"] == 1.0 and agree["routing_agreement"] < 0.5
    # replaying the trainer's own choice changes nothing; it is what HF routes unforced
    own_logits, own_ref_grads = _hf_forced(moe_ckpt, None)
    logits, grads, agree = _megatron(actor, per_sample(own))
    assert torch.allclose(logits, own_logits, atol=1e-4)
    for g, r in zip(grads, own_ref_grads):
        assert torch.allclose(g, r, atol=1e-4, rtol=1e-4)
    assert agree == {"routing_agreement": 1.0, "routing_replayed": 1.0}
    assert (ref_logits - own_logits).abs().max() > 0.05  # the forced routing really is another function


def test_replay_on_refuses_samples_without_routed_experts(actor):
    with pytest.raises(ValueError, match=r"routing_replay is on but samples \['s1'\] carry no routed experts"):
        actor.routing.begin(
            [torch.zeros(9, actor.arch.num_layers, 2, dtype=torch.int32), None], ["s0", "s1"], columns(2, 9), 18
        )
    with pytest.raises(ValueError, match=r"routed experts of shape \(9, 1, 2\)"):
        actor.routing.begin([torch.zeros(9, 1, 2, dtype=torch.int32)], ["s0"], columns(1, 9), 9)
    actor.routing.end()


def test_routing_replay_config_values(moe_ckpt):
    from types import SimpleNamespace

    from megatron_trace.trainer.routing_replay import replay_enabled

    moe, dense = ModelArch.from_hf_config(moe_ckpt), SimpleNamespace(is_moe=False, family="qwen2")
    assert replay_enabled("auto", moe) and replay_enabled("on", moe) and not replay_enabled("off", moe)
    assert not replay_enabled("auto", dense)
    with pytest.raises(ValueError, match="routing_replay=on needs an MoE model; qwen2 has no routers"):
        replay_enabled("on", dense)
    with pytest.raises(ValueError, match="trainer.routing_replay must be one of auto, on, off; got 'yes'"):
        replay_enabled("yes", moe)


def test_probe_replay_buys_expert_agreement_and_logprob(moe_ckpt):
    """The issue's check on the tiny Qwen3-MoE: with replay, expert-site full-code agreement >= 99.9%
    and the rollout's routing is what the trainer used (100%); without it less of both, and a larger
    mean |dlogp|. A rollout plus five recompute modes: ~30 s on 2 cores."""
    from megatron_trace.quality.probe import NO_REPLAY, parse_args, probe

    res = probe(parse_args(["--model-path", str(moe_ckpt), "--num-prompts", "6", "--max-new-tokens", "24"]))
    m = res["modes"]

    def experts(mode):
        return min(v for k, v in m[mode]["agreement"].items() if ".mlp.experts." in k)

    assert res["routing_replay"] is True
    assert experts("guided-full") >= 0.999
    assert m["guided-full"]["routing_replayed"] == 1.0
    assert m[NO_REPLAY]["routing_replayed"] < 1.0
    assert experts(NO_REPLAY) < experts("guided-full")
    assert m["guided-full"]["mean_abs_dlogp"] < m[NO_REPLAY]["mean_abs_dlogp"]
    assert m["guided-full"]["mean_abs_dlogp"] < m["rtn"]["mean_abs_dlogp"] < m["off"]["mean_abs_dlogp"]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 9),
    copies=st.integers(1, 3),
    num_local=st.integers(1, 3),
    ep_rank=st.integers(0, 1),
    seed=st.integers(0, 2**16),
)
def test_expert_rows_pick_the_slot_the_rollout_gave_this_expert(n, copies, num_local, ep_rank, seed):
    """expert_rows against a brute-force walk over the allgather dispatcher's state: `copies` TP x EP
    copies of n tokens, this rank's experts [ep_rank * num_local, ...), the rollout's top-k ids and
    the trainer's own routing map drawn independently."""
    from types import SimpleNamespace

    from megatron_trace.fp4 import RolloutRounding
    from megatron_trace.trainer.routing_replay import expert_rows

    g = torch.Generator().manual_seed(seed)
    k, experts = 2, 2 * num_local
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])  # rollout [n, k]
    own = torch.zeros(n, experts, dtype=torch.bool)
    for t in range(n):
        own[t, torch.randperm(experts, generator=g)[:k]] = True
    first = ep_rank * num_local
    local_map = own[:, first : first + num_local].repeat(copies, 1)  # gathered [copies * n, num_local]
    probs = torch.rand(copies * n, num_local, generator=g) + 0.1
    local_probs = probs.T.contiguous().masked_select(local_map.T.contiguous())
    moe = SimpleNamespace(
        local_expert_indices=list(range(first, first + num_local)),
        token_dispatcher=SimpleNamespace(local_map=local_map, local_probs=local_probs),
    )
    state = SimpleNamespace(
        routing_replay=SimpleNamespace(rollout_ids=lambda layer: (ids, torch.ones(n, dtype=torch.bool)))
    )
    tag = torch.arange(n * k, dtype=torch.float32).view(n, k)  # names (token, slot)
    rr = RolloutRounding(tag.to(torch.uint8)[..., None], tag + 1.0, codes=tag.to(torch.uint8)[..., None])
    mask = torch.rand(n, generator=g) < 0.8
    for e in range(num_local):
        select = expert_rows(state, moe, 0, e, per_slot=True)
        sel, keep = select(rr, mask)
        # the routing weight Megatron multiplied into this row (QATState divides it out before quantizing)
        weights = select.input_weights()
        rows = local_map[:, e].nonzero().squeeze(-1)
        assert len(keep) == len(rows) == len(weights)
        for i, j in enumerate(rows.tolist()):
            t = j % n
            hit = (ids[t] == first + e).nonzero().squeeze(-1).tolist()
            assert bool(keep[i]) == (bool(mask[t]) and len(hit) == 1)
            assert float(weights[i]) == float(probs[j, e])
            if keep[i]:
                assert int(sel.codes[i, 0]) == int(tag[t, hit[0]])
                assert float(sel.global_scale[i]) == float(tag[t, hit[0]] + 1)  # the record's S_enc of the slot
        sel, keep = expert_rows(state, moe, 0, e, per_slot=False)(
            RolloutRounding(tag[:, 0].to(torch.uint8)[:, None], tag[:, 0], codes=tag[:, 0].to(torch.uint8)[:, None]),
            mask,
        )
        assert torch.equal(sel.codes[:, 0], tag[rows % n, 0].to(torch.uint8)) and torch.equal(keep, mask[rows % n])
