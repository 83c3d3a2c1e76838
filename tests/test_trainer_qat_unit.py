"""QAT sites without Megatron: rtn equals the fp4 reference; guided follows the rollout's records."""

import pytest
import torch

from megatron_trace.fp4 import mxfp4, nvfp4
from megatron_trace.guidance import GuidanceRecord, make_site
from megatron_trace.models import ModelArch, QuantPolicy, tiny_hf_config
from megatron_trace.trainer.batching import MicroBatchGuidance
from megatron_trace.trainer.qat import QATState

ARCH = ModelArch.from_hf_config(tiny_hf_config("qwen2"))
SITE = "model.layers.3.mlp.down_proj"


def _records(xs, mode):
    """What the engine records for each sample's [T, K] input of SITE."""
    recs = []
    for i, x in enumerate(xs):
        q = nvfp4.quantize(x, per_row_global=True)
        recs.append(GuidanceRecord(f"s{i}", mode, x.shape[0], {SITE: make_site(q.scale, q.global_scale, q.data, mode)}))
    return recs


def test_rtn_activation_and_weight_match_reference():
    st = QATState(ARCH, QuantPolicy(kv="bf16"), "rtn")
    x = torch.randn(5, 2, 64, requires_grad=True)
    y = st.activation(x, SITE, None)
    ref = nvfp4.dequantize(nvfp4.quantize(x.detach().reshape(-1, 64), per_row_global=True)).reshape(5, 2, 64)
    assert torch.equal(y, ref)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    w = torch.randn(32, 64)
    assert torch.equal(st.weight(w), nvfp4.dequantize(nvfp4.quantize(w)))


def test_guided_micro_batch_reproduces_rollout_codes_in_seq_batch_layout():
    g = torch.Generator().manual_seed(0)
    lens = [7, 4]
    xs_roll = [torch.randn(t, 64, generator=g) for t in lens]
    recs = _records(xs_roll, "full")
    s = max(lens)
    x_train = torch.zeros(s, 2, 64)
    for j, xr in enumerate(xs_roll):
        x_train[: lens[j], j] = xr * (1 + 0.02 * torch.randn(xr.shape, generator=g))
    out = {}
    for mode in ("rtn", "guided"):
        st = QATState(ARCH, QuantPolicy(kv="bf16"), mode)
        st.guidance = MicroBatchGuidance.padded(recs, s)
        out[mode] = st.activation(x_train, SITE, None)
        out[mode + "_agree"] = st.agreement()[SITE]
    for j, xr in enumerate(xs_roll):
        want = nvfp4.dequantize(nvfp4.quantize(xr, per_row_global=True))
        assert torch.equal(out["guided"][: lens[j], j], want)
    assert out["guided_agree"] == 1.0 and out["rtn_agree"] < 1.0
    # Padding rows (no record) fall back to round-to-nearest.
    assert torch.equal(out["guided"][4:, 1], out["rtn"][4:, 1])


@pytest.mark.parametrize("mode", ["full", "mantissa"])
def test_bf16_guided_site_is_the_fp32_reference_route_with_its_counts(mode):
    """A bf16 trainer's guided site (read and written in bf16, one C pass on CPU) equals the fp32
    reference composition cast to bf16: guided_quantize on covered rows, round-to-nearest on the
    rest, and the same override share (codes moved off rtn) and agreement (full records)."""
    from megatron_trace.fp4 import guided_quantize, unpack_fp4
    from megatron_trace.fp4.guided import mantissa_bits_packed

    g = torch.Generator().manual_seed(5)
    lens = [9, 5]
    xs_roll = [torch.randn(t, 64, generator=g) * torch.logspace(-2, 2, 64) for t in lens]
    recs = _records(xs_roll, mode)
    s = max(lens)
    x = torch.zeros(s, 2, 64)
    for j, xr in enumerate(xs_roll):
        x[: lens[j], j] = xr * (1 + 0.05 * torch.randn(xr.shape, generator=g))
    x = x.to(torch.bfloat16).requires_grad_()
    st = QATState(ARCH, QuantPolicy(kv="bf16"), "guided")
    st.guidance = MicroBatchGuidance.padded(recs, s)
    y = st.activation(x, SITE, None)
    assert y.dtype is torch.bfloat16
    flat = x.detach().reshape(-1, 64).float()
    rtn = nvfp4.quantize(flat, per_row_global=True)
    want, moved, agree, n = nvfp4.dequantize(rtn).clone(), 0, 0, 0
    for j, xr in enumerate(xs_roll):  # row t * 2 + j holds position t of sample j
        rows = torch.arange(lens[j]) * 2 + j
        full = nvfp4.quantize(xr, per_row_global=True)
        guide = dict(codes=full.data) if mode == "full" else dict(mantissa=mantissa_bits_packed(full.data))
        gq = guided_quantize(flat[rows], full.scale, full.global_scale, **guide)
        want[rows] = nvfp4.dequantize(gq)
        codes = unpack_fp4(gq.data)
        moved += int((codes != unpack_fp4(rtn.data[rows])).sum())
        ref = unpack_fp4(full.data)
        agree += int((torch.where(codes == 8, 0, codes) == torch.where(ref == 8, 0, ref)).sum())
        n += codes.numel()
    assert torch.equal(y.detach().reshape(-1, 64), want.to(torch.bfloat16))
    assert st.override_rate()[SITE] == moved / n and 0 < moved
    assert st.agreement() == ({SITE: agree / n} if mode == "full" else {})
    y.float().sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_row_parallel_slice_matches_full_width():
    g = torch.Generator().manual_seed(1)
    x_roll = torch.randn(6, 64, generator=g)
    recs = _records([x_roll], "mantissa")
    st = QATState(ARCH, QuantPolicy(kv="bf16"), "guided")
    st.guidance = MicroBatchGuidance.padded(recs, 6)
    full = st.guidance.site(SITE, None, "cpu")[0]
    half = st.guidance.site(SITE, slice(32, 64), "cpu")[0]
    assert torch.equal(half.scale, full.scale[:, 2:]) and torch.equal(half.mantissa, full.mantissa[:, 4:])


def test_kv_only_policy_still_models_the_kv_cache():
    """format bf16 + NVFP4 KV: no FP4 linear, but every layer's K and V are fake-quantized (this
    returned early once, leaving a KV-only run with no QAT at all and no word about it)."""
    from megatron_trace.models import ModelArch, QuantPolicy, tiny_hf_config
    from megatron_trace.trainer.gpt import build_model
    from megatron_trace.trainer.parallel import destroy, init_distributed
    from megatron_trace.trainer.qat import install_qat

    arch = ModelArch.from_hf_config(tiny_hf_config("qwen2"))
    init_distributed(tp=1, pp=1, seed=0)
    try:
        chunks = build_model(arch, dtype=torch.float32)
        policy = QuantPolicy(format="bf16", weights="bf16", activations="bf16", kv="nvfp4")
        install_qat(chunks, arch, policy, "rtn", [0])
        kv = [n for n, m in chunks[0].named_modules() if getattr(m, "qat_kv", None) is not None]
        linears = [n for n, m in chunks[0].named_modules() if getattr(m, "qat_site", None) is not None]
        assert len(kv) == arch.num_layers and all(n.endswith("self_attention.core_attention") for n in kv)
        assert linears == []
    finally:
        destroy()


def test_sequence_parallel_rank_rows_equal_the_unsliced_result():
    """Under sequence parallelism a column-parallel input is one rank's [S/TP, B, K] slice; with the
    guidance rows sliced to match, each rank's quantized rows are exactly the rows of the unsliced
    (TP1) result, in rtn and guided mode, and the agreement counts add up to the unsliced ones."""
    g = torch.Generator().manual_seed(2)
    lens, s, tp = [8, 5, 8], 8, 2
    xs_roll = [torch.randn(t, 64, generator=g) for t in lens]
    recs = _records(xs_roll, "full")
    x = torch.randn(s, len(lens), 64, generator=g)
    for j, xr in enumerate(xs_roll):
        x[: lens[j], j] = xr * (1 + 0.02 * torch.randn(xr.shape, generator=g))
    for mode in ("rtn", "guided"):
        whole = QATState(ARCH, QuantPolicy(kv="bf16"), mode)
        whole.guidance = MicroBatchGuidance.padded(recs, s)
        want = whole.activation(x, SITE, None)
        per_rank, counts = [], [0, 0]
        n = (s // tp) * len(lens)
        for r in range(tp):
            st = QATState(ARCH, QuantPolicy(kv="bf16"), mode)
            st.guidance = MicroBatchGuidance.padded(recs, s)
            per_rank.append(
                st.activation(x[r * s // tp : (r + 1) * s // tp], SITE, None, rows=slice(r * n, (r + 1) * n))
            )
            a, c = st.agree[SITE]
            counts = [counts[0] + a, counts[1] + c]
        assert torch.equal(torch.cat(per_rank), want), mode
        assert counts == whole.agree[SITE], mode
    # Unsliced guidance against one rank's rows is a layout error, not a silent round-to-nearest.
    st = QATState(ARCH, QuantPolicy(kv="bf16"), "guided")
    st.guidance = MicroBatchGuidance.padded(recs, s)
    with pytest.raises(
        ValueError, match=r"QAT site model\.layers\.3\.mlp\.down_proj: the guidance has 24 rows .* has 12 rows"
    ):
        st.activation(x[: s // tp], SITE, None)


def test_mxfp4_policy_weights_and_activations_are_the_engines_mxfp4():
    """quant.format=mxfp4: the trainer's weight and activation equal the embedded engine's MXFP4
    linear (its dequantized weight and quantize-dequantized input), not NVFP4; TP shards of the
    weight (K split at block boundaries) quantize to the full weight's slices."""
    from sglang_backend.local.layers import EngineLinear

    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(48, 128, generator=g), torch.randn(6, 128, generator=g)
    eng = EngineLinear({"w": 48}, 128, bias=False, weight_fmt="mxfp4", act_fmt="mxfp4", dtype=torch.float32, site=SITE)
    eng.load_shard("w", w)
    eng.finalize()
    st = QATState(ARCH, QuantPolicy(kv="bf16", format="mxfp4"), "rtn")
    assert torch.equal(st.weight(w), eng.weight.data)
    assert not torch.equal(st.weight(w), QATState(ARCH, QuantPolicy(kv="bf16"), "rtn").weight(w))
    assert torch.equal(st.weight(w[:, 64:]), eng.weight.data[:, 64:])
    want = eng._matmul_input(x, None, None)
    assert torch.equal(st.activation(x.reshape(3, 2, 128), SITE, None).reshape(6, 128), want)


def _mx_records(xs, mode, block=32):
    """MXFP4 records as an engine would write them: E8M0 scale bytes [T, K/block], no global scale."""
    recs = []
    for i, x in enumerate(xs):
        q = mxfp4.quantize(x, block=block)
        recs.append(GuidanceRecord(f"s{i}", mode, x.shape[0], {SITE: make_site(q.scale, torch.ones(()), q.data, mode)}))
    return recs


@pytest.mark.parametrize("mode", ["full", "mantissa"])
def test_guided_mxfp4_follows_the_rollouts_e8m0_scales_and_codes(mode):
    g = torch.Generator().manual_seed(6)
    xs_roll = [torch.randn(5, 128, generator=g), torch.randn(5, 128, generator=g)]
    x = torch.stack([xr * (1 + 0.02 * torch.randn(xr.shape, generator=g)) for xr in xs_roll], dim=1)
    out = {}
    for qat_mode in ("rtn", "guided"):
        st = QATState(ARCH, QuantPolicy(kv="bf16", format="mxfp4"), qat_mode)
        st.guidance = MicroBatchGuidance.padded(_mx_records(xs_roll, mode), 5)
        out[qat_mode] = st.activation(x, SITE, None)
        out[qat_mode + "_override"] = st.override_rate()
        if mode == "full":
            out[qat_mode + "_agree"] = st.agreement()[SITE]
    for j, xr in enumerate(xs_roll):
        want = mxfp4.dequantize(mxfp4.quantize(xr))
        assert torch.equal(out["guided"][:, j], want)
        assert not torch.equal(out["rtn"][:, j], want)
    assert out["guided_override"][SITE] > 0
    if mode == "full":
        assert out["guided_agree"] == 1.0 and out["rtn_agree"] < 1.0
    # A row-parallel K slice takes whole 32-blocks of the guidance.
    st = QATState(ARCH, QuantPolicy(kv="bf16", format="mxfp4"), "guided")
    st.guidance = MicroBatchGuidance.padded(_mx_records(xs_roll, mode), 5)
    half = st.activation(x[..., 64:], SITE, slice(64, 128))
    assert torch.equal(half, out["guided"][..., 64:])


def test_static_activation_scale_is_used_in_rtn_and_for_uncovered_guided_rows():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 2, 64, generator=g)
    s_enc = nvfp4.encode_scale_from_amax(torch.tensor(5.0))
    ref = nvfp4.dequantize(nvfp4.quantize(x.reshape(-1, 64), global_scale=s_enc)).reshape(4, 2, 64)
    for mode in ("rtn", "guided"):
        st = QATState(ARCH, QuantPolicy(kv="bf16"), mode)
        st.set_static_activation_scales({SITE: s_enc})
        assert torch.equal(st.activation(x, SITE, None), ref), mode
    per_token = QATState(ARCH, QuantPolicy(kv="bf16"), "rtn").activation(x, SITE, None)
    assert not torch.equal(per_token, ref)
    with pytest.raises(ValueError, match="finite S_enc > 0"):
        st.set_static_activation_scales({SITE: 0.0})


def test_guided_mxfp4_kv_follows_the_rollouts_pages():
    """MXFP4 K as the engine's pages (E8M0 per 16, ceil rule), guided by a record of them."""
    g = torch.Generator().manual_seed(7)
    site = "model.layers.3.self_attn.k_cache"
    k_roll = torch.randn(6, 2, 32, generator=g)  # [T, kv_heads, head_dim]
    q = mxfp4.quantize(k_roll, rule=mxfp4.KV_RULE, block=mxfp4.KV_BLOCK)
    rec = GuidanceRecord("s0", "full", 6, {site: make_site(q.scale, torch.ones(()), q.data, "full")})
    k_train = (k_roll * (1 + 0.02 * torch.randn(k_roll.shape, generator=g))).unsqueeze(1)  # [S, B=1, 2, 32]
    res = {}
    for mode in ("rtn", "guided"):
        st = QATState(ARCH, QuantPolicy(kv="mxfp4"), mode)
        st.guidance = MicroBatchGuidance.padded([rec], 6)
        res[mode] = st.kv(k_train, site, "mxfp4").squeeze(1)
    assert torch.equal(res["guided"], mxfp4.dequantize(q)) and not torch.equal(res["rtn"], mxfp4.dequantize(q))


def test_static_scales_from_calibrated_amax_match_the_engine_reading_the_checkpoint():
    """input amax -> ModelOpt input_scale -> the engine's static S_enc, and the trainer's rtn input
    of the fused gate/up site equals the engine's quantize-dequantize under it."""
    from megatron_trace.fp4.modelopt import to_modelopt_fused
    from megatron_trace.transfer.static_scales import static_site_scales
    from sglang_backend.local.layers import EngineLinear

    g = torch.Generator().manual_seed(8)
    h, f = ARCH.hidden_size, ARCH.intermediate_size
    wg, wu, x = torch.randn(f, h, generator=g), torch.randn(f, h, generator=g), 2 * torch.randn(6, h, generator=g)
    prefix = "model.layers.2.mlp."
    amax = {prefix + "gate_proj": 3.0, prefix + "up_proj": 5.0, prefix + "down_proj": 7.0}
    eng = EngineLinear(
        {"gate_proj": f, "up_proj": f},
        h,
        bias=False,
        weight_fmt="nvfp4",
        act_fmt="nvfp4",
        dtype=torch.float32,
        site=prefix + "gate_up_proj",
    )
    for shard, t in zip(("gate_proj", "up_proj"), to_modelopt_fused([wg, wu], input_amax=5.0)):
        for kind, v in t.items():
            eng.load_shard(shard, v, "weight_packed" if kind == "weight" else kind)
    eng.finalize()
    policy = QuantPolicy(kv="bf16", activation_scale="static")
    scales = static_site_scales(
        {
            f"model.layers.{i}.mlp.{m}": a
            for i in range(ARCH.num_layers)
            for m, a in (("gate_proj", 3.0), ("up_proj", 5.0), ("down_proj", 7.0))
        },
        ARCH,
        policy,
    )
    assert sorted(scales) == sorted(
        f"model.layers.{i}.mlp.{s}" for i in range(ARCH.num_layers) for s in ("gate_up_proj", "down_proj")
    )
    assert torch.equal(scales[prefix + "gate_up_proj"], eng.input_global_scale)
    st = QATState(ARCH, policy, "rtn")
    st.set_static_activation_scales(scales)
    got = st.activation(x.reshape(3, 2, h), prefix + "gate_up_proj", None).reshape(6, h)
    assert torch.equal(got, eng._matmul_input(x, None, None))
    with pytest.raises(KeyError, match="no calibrated input amax"):
        static_site_scales(amax, ARCH, policy)  # only layer 2 calibrated


@pytest.mark.parametrize("mode", ["full", "mantissa"])
def test_cuda_route_runs_the_triton_kernels_with_the_reference_bits(monkeypatch, mode):
    """On CUDA the QAT sites quantize and round through megatron_trace.kernels.dispatch, which picks the Triton
    kernels there. Here the interpreter stands in for the GPU (the dispatcher forced to 'triton'):
    weight, guided activation and guided NVFP4 K equal the reference route's output bit for bit."""
    import importlib

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not importable")
    from megatron_trace.kernels import dispatch, kv_codec
    from megatron_trace.trainer import qat

    if not importlib.import_module("megatron_trace.kernels.nvfp4_quantize").INTERPRETED:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    g = torch.Generator().manual_seed(9)
    x_roll = torch.randn(6, 64, generator=g)
    k_site = "model.layers.3.self_attn.k_cache"
    k_roll = torch.randn(6, 2, 32, generator=g)
    qk = nvfp4.quantize(k_roll, global_scale=torch.tensor(qat.KV_SCALE))
    recs = _records([x_roll], mode)
    recs[0].sites[k_site] = make_site(qk.scale, qk.global_scale, qk.data, mode)
    x = (x_roll * (1 + 0.02 * torch.randn(x_roll.shape, generator=g))).unsqueeze(1)  # [S, B=1, K]
    k = (k_roll * (1 + 0.02 * torch.randn(k_roll.shape, generator=g))).unsqueeze(1)
    w = torch.randn(32, 64, generator=g)

    def run():
        st = QATState(ARCH, QuantPolicy(kv="bf16"), "guided")
        st.guidance = MicroBatchGuidance.padded(recs, 6)
        return st.weight(w), st.activation(x, SITE, None), st.kv(k, k_site)

    want = run()
    calls = []

    def forced(fn):
        def on_triton(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, backend="triton", **kwargs)

        return on_triton

    # weights, activations and K take the one-pass quantize-dequantize, whose route off CPU is
    # dispatch.nvfp4_quantize
    to_triton = forced(dispatch.nvfp4_quantize)

    def qdq_on_triton(x, dequant_dtype=None, **kw):
        q = to_triton(x, **kw)
        return q, (None if dequant_dtype is None else nvfp4.dequantize(q, dequant_dtype))

    monkeypatch.setattr(qat, "nvfp4_quantize_dequantize", qdq_on_triton)
    # guided sites go through dispatch.nvfp4_guided_dequantize_into, whose route off CPU is the
    # Triton guided quantizer (backend "triton" skips the CPU's C pass)
    monkeypatch.setattr(qat, "nvfp4_guided_dequantize_into", forced(dispatch.nvfp4_guided_dequantize_into))
    monkeypatch.setattr(kv_codec, "nvfp4_quantize_dequantize", qdq_on_triton)
    got = run()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert calls.count("nvfp4_quantize") == 3 and calls.count("nvfp4_guided_dequantize_into") == 2
    # The guidance did move codes: the guided activation is the rollout's, not round-to-nearest's.
    assert torch.equal(got[1].squeeze(1), nvfp4.dequantize(nvfp4.quantize(x_roll, per_row_global=True)))


def test_guided_site_missing_from_a_guided_layer_stops_instead_of_rounding_to_nearest():
    """A record that covers layer 3 but lacks one of its FP4 sites (a rollout that cannot capture a
    format or the experts) must stop guided QAT by name; layers the rollout does not guide, and rtn
    mode, are unaffected."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 1, 64, generator=g)
    recs = MicroBatchGuidance.padded(_records([x[:, 0]], "full"), 6)
    st = QATState(ARCH, QuantPolicy(kv="bf16"), "guided")
    st.guidance = recs
    other = "model.layers.3.mlp.gate_up_proj"
    with pytest.raises(ValueError, match=r"mlp\.gate_up_proj is FP4 in the trainer.*hold no such site.*down_proj"):
        st.activation(x, other, None)
    unguided_layer = "model.layers.0.mlp.down_proj"
    ref = nvfp4.dequantize(nvfp4.quantize(x.reshape(-1, 64), per_row_global=True)).reshape(x.shape)
    assert torch.equal(st.activation(x, unguided_layer, None), ref)  # layer 0 is not guided: rtn
    rtn = QATState(ARCH, QuantPolicy(kv="bf16"), "rtn")
    rtn.guidance = recs
    assert torch.equal(rtn.activation(x, other, None), ref)  # rtn only measures against records
