"""The C NVFP4 quantizers (megatron_trace/kernels/cpu_quant) are the reference (`fp4.nvfp4`) bit for bit, in the
build the engine runs (the target MEGATRON_TRACE_CPU_ISA allows) and the baseline build's scalar code, or step aside."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.fp4 import fp8, nvfp4
from megatron_trace.fp4.codecs import _E2M1_BOUNDARIES, e2m1_grid, pack_fp4
from megatron_trace.fp4.guided import mantissa_bits_packed
from megatron_trace.kernels import cpu_build, cpu_quant, dispatch

pytestmark = [
    pytest.mark.isa_avx2,
    pytest.mark.isa_baseline,
    pytest.mark.skipif(cpu_build.library() is None, reason=f"no CPU kernels: {cpu_build.ENGINE.reason()}"),
]
BUILDS = ["engine", "baseline"]


def _lib(build):
    return cpu_build.library() if build == "engine" else cpu_build.baseline()


def _same(q, r):
    assert torch.equal(q.data, r.data) and torch.equal(q.scale, r.scale)
    assert torch.equal(q.global_scale, r.global_scale)


def _inputs(seed, rows, blocks, spread):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 16 * blocks, generator=g) * torch.logspace(-spread, spread, 16 * blocks)
    x[0, :16] = 0.0  # an all-zero block
    if rows > 1:
        x[1, 3] = -0.0
    return x


@pytest.mark.parametrize("build", BUILDS)
def test_c_decode_tables_are_fp4s(build):
    lut, grid, bounds, one_sixth = _lib(build).decode_tables()
    want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(lut.view(torch.int32), want.view(torch.int32))  # bit patterns: -0.0 and NaN included
    assert torch.equal(grid.view(torch.int32), e2m1_grid("cpu").view(torch.int32))
    assert torch.equal(bounds, torch.tensor(_E2M1_BOUNDARIES)) and one_sixth == nvfp4._ONE_SIXTH


def test_gemv_tables_are_twice_fp4s_grid():
    f, i8, bf = cpu_build.library().gemv_tables()
    two = 2 * e2m1_grid("cpu")
    assert torch.equal(f.view(torch.int32), two.view(torch.int32))  # -0.0 kept
    assert torch.equal(i8, two.to(torch.int8))
    assert torch.equal(bf, two.to(torch.bfloat16).view(torch.int16).repeat(2))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 6),
    blocks=st.integers(1, 5),
    spread=st.sampled_from([0, 3, 12]),
    static=st.booleans(),
    bf16=st.booleans(),
    build=st.sampled_from(BUILDS),
)
def test_quantize_dequantize_is_the_reference(seed, rows, blocks, spread, static, bf16, build):
    x = _inputs(seed, rows, blocks, spread)
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = x.to(dtype)
    kw = dict(global_scale=torch.tensor(0.731)) if static else dict(per_row_global=True)
    q, xhat = cpu_quant.quantize_dequantize(x, dequant_dtype=dtype, lib=_lib(build), **kw)
    r = nvfp4.quantize(x, **kw)
    _same(q, r)
    assert torch.equal(xhat, nvfp4.dequantize(r, dtype))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_quantize_dequantize_split_over_threads_is_the_reference(build, dtype, static):
    """A batch-32 decode's MLP input (64 x 4864 here) is split over torch's threads: the same bytes
    as the reference, block scales over 18 decades, an fp32-subnormal row (its dequantized values
    subnormal too) and a NaN in the last row still declined."""
    x = _inputs(7, 64, 304, 9)
    x[5] = torch.randn(4864) * 1e-39
    x = x.to(dtype)
    kw = dict(global_scale=torch.tensor(1e-3)) if static else dict(per_row_global=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, xhat = cpu_quant.quantize_dequantize(x, dequant_dtype=dtype, lib=_lib(build), **kw)
        r = nvfp4.quantize(x, **kw)
        _same(q, r)
        assert torch.equal(
            xhat.view(torch.int16 if dtype is torch.bfloat16 else torch.int32),
            nvfp4.dequantize(r, dtype).view(torch.int16 if dtype is torch.bfloat16 else torch.int32),
        )
        if not static:
            assert (xhat[5] != 0).any() and (xhat[5].abs() < torch.finfo(torch.float32).tiny).any()
        x[63, 4000] = float("nan")
        assert cpu_quant.quantize_dequantize(x, dequant_dtype=dtype, lib=_lib(build), **kw) is None
    finally:
        torch.set_num_threads(threads)


def test_nan_and_huge_inputs_fall_back_to_the_reference():
    x = torch.randn(2, 32)
    x[1, 5] = float("nan")
    assert cpu_quant.quantize_dequantize(x, per_row_global=True) is None  # C declines: the reference decides NaN
    q, _ = dispatch.nvfp4_quantize_dequantize(x, per_row_global=True)
    _same(q, nvfp4.quantize(x, per_row_global=True))
    big = torch.full((1, 16), 3.0e38)
    _same(cpu_quant.quantize_dequantize(big, per_row_global=True)[0], nvfp4.quantize(big, per_row_global=True))


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    spread=st.integers(0, 6),
    amax_kind=st.sampled_from(["own", "zero", "tiny", "shared"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_global_amax_route_is_the_reference_bit_for_bit(seed, spread, amax_kind, dtype):
    """The trainer's weight fake-quant: one global amax (a fused weight's, TP-reduced) through the one
    C pass equals nvfp4.quantize(x, global_amax=...) and its dequantize, zero and tiny amax included."""
    x = _inputs(seed, 7, 3, spread).to(dtype)
    own = nvfp4.nan_free_amax(x.float())
    amax = {"own": own, "zero": torch.tensor(0.0), "tiny": torch.tensor(1e-42), "shared": own * 3}[amax_kind]
    q, xhat = dispatch.nvfp4_quantize_dequantize(x, global_amax=amax, dequant_dtype=dtype)
    r = nvfp4.quantize(x, global_amax=amax)
    _same(q, r)
    assert torch.equal(xhat, nvfp4.dequantize(r, dtype))


@pytest.mark.parametrize("gs", [1.0, 0.0625, 448.0 * 6.0])
def test_quantize_to_slots_writes_reference_codes_and_nothing_else(gs):
    x = _inputs(3, 5, 4, 3).reshape(5, 2, 32)
    codes, scales = torch.full((9, 2, 16), 0xAA, dtype=torch.uint8), torch.full((9, 2, 2), 0x55, dtype=torch.uint8)
    slots = torch.tensor([8, 0, 4, 2, 6])
    assert cpu_quant.quantize_to_slots(x, torch.tensor(gs), codes, scales, slots)
    r = nvfp4.quantize(x, global_scale=torch.tensor(gs))
    assert torch.equal(codes[slots], r.data) and torch.equal(scales[slots], r.scale)
    rest = torch.tensor([1, 3, 5, 7])
    assert (codes[rest] == 0xAA).all() and (scales[rest] == 0x55).all()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), spread=st.integers(0, 30), build=st.sampled_from(BUILDS))
def test_fp8_to_slots_writes_fp8_quantize_bytes_and_nothing_else(seed, spread, build):
    """fp4.fp8.quantize(x, dims=2) per token over its KV heads, written into its slot: codes and S_dec
    bit for bit across 2^-30..2^30 magnitudes, with +-0, NaN, +-Inf, an all-zero row and a row whose
    amax is a NaN-free subnormal among them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 2, 16, generator=g) * torch.logspace(-spread, spread, 32, base=2.0).reshape(2, 16)
    x[0] = 0.0
    x[1, 0, :4] = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf")])
    x[2] = torch.randn(2, 16, generator=g) * 1e-40  # subnormal fp32
    x[3, 1, 5] = float("nan")
    codes, sdec = torch.full((10, 2, 16), 0xAA, dtype=torch.uint8), torch.full((10,), -1.0)
    slots = torch.tensor([9, 0, 4, 2, 6, 7])
    assert cpu_quant.fp8_quantize_to_slots(x, codes, sdec, slots, lib=_lib(build))
    r = fp8.quantize(x, dims=2)
    assert torch.equal(codes[slots], r.data) and torch.equal(sdec[slots], r.scale)
    rest = torch.tensor([1, 3, 5, 8])
    assert (codes[rest] == 0xAA).all() and (sdec[rest] == -1.0).all()


def test_fp8_to_slots_refuses_what_it_cannot_do():
    x, codes, sdec = torch.randn(2, 2, 16), torch.zeros(4, 2, 16, dtype=torch.uint8), torch.zeros(4)
    with pytest.raises(IndexError, match="slot out of range"):
        cpu_quant.fp8_quantize_to_slots(x, codes, sdec, torch.tensor([0, 4]))
    assert not codes.any()
    assert not cpu_quant.fp8_quantize_to_slots(x, codes, sdec, torch.tensor([0, 1], dtype=torch.int32))
    assert not cpu_quant.fp8_quantize_to_slots(x, codes[:, :1], sdec, torch.tensor([0, 1]))


def test_quantize_to_slots_refuses_what_it_cannot_do():
    x, codes, scales = torch.randn(2, 32), torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8)
    with pytest.raises(IndexError, match="slot out of range"):
        cpu_quant.quantize_to_slots(x, torch.tensor(1.0), codes, scales, torch.tensor([0, 4]))
    assert not codes.any()
    assert not cpu_quant.quantize_to_slots(x, torch.tensor(0.0), codes, scales, torch.tensor([0, 1]))  # bad S_enc
    assert not cpu_quant.quantize_to_slots(x, torch.tensor(1.0), codes, scales, torch.tensor([0, 1], dtype=torch.int32))
    x[0, 0] = float("nan")
    assert not cpu_quant.quantize_to_slots(x, torch.tensor(1.0), codes, scales, torch.tensor([0, 1]))


@pytest.mark.parametrize("build", BUILDS)
def test_dequantize_rows_is_gather_then_dequantize(build):
    q = nvfp4.quantize(_inputs(4, 6, 2, 3).reshape(6, 1, 32), global_scale=torch.tensor(0.5))
    q.scale[2, 0, 1] = 0xFE  # a negative E4M3 byte decodes signed, as torch's float8_e4m3fn
    idx = torch.tensor([5, 0, 0, 3, 2])
    want = nvfp4.dequantize(nvfp4.NVFP4Tensor(q.data[idx], q.scale[idx], q.global_scale), torch.bfloat16)
    got = cpu_quant.dequantize_rows(q.data, q.scale, idx, q.global_scale, torch.bfloat16, lib=_lib(build))
    assert torch.equal(got, want)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    shards=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    spread=st.integers(0, 6),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    nan=st.booleans(),
)
def test_the_weight_syncs_quantizer_and_the_engines_dequantize_are_the_references(seed, shards, spread, dtype, nan):
    """What a weight sync runs: fused shards quantized with one shared amax through the C pass
    (fp4.modelopt's quantizer), and the engine's dequantize of the shards' rows, each run of rows
    with its own global scale (its per-row [N] S_enc) in one C call. A NaN weight goes to the
    reference, which decides its bytes."""
    from megatron_trace.fp4.modelopt import to_modelopt_fused

    ws = [_inputs(seed + i, n, 3, spread).to(dtype) * (i + 1) for i, n in enumerate(shards)]
    if nan:
        ws[-1][0, 5] = float("nan")
    got = to_modelopt_fused(ws, quantizer=dispatch.nvfp4_weight_quantize)
    for g, r in zip(got, to_modelopt_fused(ws)):
        assert g.keys() == r.keys()
        for k in g:
            assert torch.equal(
                g[k].view(torch.uint8) if k == "weight_scale" else g[k],
                r[k].view(torch.uint8) if k == "weight_scale" else r[k],
            ), k
    qs = [nvfp4.quantize(w) for w in ws]
    q = nvfp4.NVFP4Tensor(
        torch.cat([x.data for x in qs]),
        torch.cat([x.scale for x in qs]),
        torch.cat([x.global_scale.expand(n) for x, n in zip(qs, shards)]),
    )
    for out in (torch.bfloat16, torch.float32):
        assert torch.equal(dispatch.nvfp4_dequantize(q, out), nvfp4.dequantize(q, out))
    one = qs[0]
    assert torch.equal(dispatch.nvfp4_dequantize(one, dtype), nvfp4.dequantize(one, dtype))  # a 0-d S_enc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_all_finite_sees_every_nan_and_inf_and_is_not_fooled_by_an_overflowing_sum(dtype):
    big = {torch.float16: 6e4, torch.float8_e4m3fn: 448.0}.get(dtype, 3e38)
    x = torch.full((64,), big).to(dtype)  # its sum overflows: the exact check decides
    assert dispatch.all_finite(x) and dispatch.all_finite(torch.zeros(3, dtype=torch.int64))
    for bad in (float("nan"), float("inf"), float("-inf")):
        if dtype == torch.float8_e4m3fn and bad != bad:
            y = x.clone().view(torch.uint8)
            y[17] = 0x7F  # E4M3fn's NaN (it has no Inf)
            assert not dispatch.all_finite(y.view(dtype))
            continue
        if dtype == torch.float8_e4m3fn:
            continue
        y = x.clone()
        y[17] = bad
        assert not dispatch.all_finite(y), bad


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 4), groups=st.integers(1, 6), build=st.sampled_from(BUILDS))
def test_mantissa_bits_are_the_references(seed, rows, groups, build):
    codes = torch.randint(0, 16, (rows, 8 * groups), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert torch.equal(cpu_quant.mantissa_bits_packed(packed, lib=_lib(build)), mantissa_bits_packed(packed))
    assert torch.equal(dispatch.mantissa_bits_packed(packed), mantissa_bits_packed(packed))


def _guided_reference(out, x, scale, gs, mask, rtn, agree_ref, codes=None, mantissa=None):
    """dispatch's torch route (the fp4 reference quantizer, dequantize, where, counts)."""
    want = out.clone()
    kw = dict(codes=codes, mantissa=mantissa, rtn_codes=rtn, agree_codes=agree_ref)
    counts = dispatch.nvfp4_guided_dequantize_into(want, x, scale, gs, mask, backend="reference", **kw)
    return want, counts


def _same_bits(a, b) -> bool:
    """Bit for bit (-0.0 too), NaN for NaN: a NaN's bf16 pattern is torch's choice per code path
    (0xFFFF from its vectorized cast here, 0x7FC0 from its scalar one)."""
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    bits = torch.int16 if a.dtype is torch.bfloat16 else torch.int32
    return torch.equal(a[~nan].view(bits), b[~nan].view(bits))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 6),
    blocks=st.integers(1, 4),
    full=st.booleans(),
    x_bf16=st.booleans(),
    out_bf16=st.booleans(),
    per_row=st.booleans(),
    hostile=st.booleans(),
    build=st.sampled_from(BUILDS),
)
def test_guided_dequantize_into_is_the_reference(seed, rows, blocks, full, x_bf16, out_bf16, per_row, hostile, build):
    """The trainer's guided site in one C pass = guided_quantize + dequantize + where, bit for bit,
    and the same override / agreement counts: the rollout's codes from a nearby activation (the
    bf16-vs-fp32 gap TRACE closes), or hostile ones (random codes, zero and NaN block scales, NaN,
    Inf, -0 and values exactly on the grid in x)."""
    g = torch.Generator().manual_seed(seed)
    k = 16 * blocks
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, k)
    gs_kw = dict(per_row_global=True) if per_row else dict(global_scale=torch.tensor(0.37))
    rollout = nvfp4.quantize((x * (1 + 0.01 * torch.randn(rows, k, generator=g))).to(torch.bfloat16), **gs_kw)
    scale, gs, codes = rollout.scale.clone(), rollout.global_scale, rollout.data.clone()
    if hostile:
        codes = torch.randint(0, 256, codes.shape, generator=g, dtype=torch.uint8)
        scale[0, 0] = 0  # sfd 0: enc saturates at FLT_MAX
        if blocks > 1:
            scale[-1, 1] = 0x7F  # an E4M3 NaN block scale
        x[0, 1], x[-1, 2], x[-1, 3], x[0, 4] = float("nan"), float("inf"), -0.0, -float("inf")
        # exactly on the grid: z = x * enc lands on an E2M1 value
        sdec = nvfp4.decode_scale(gs if gs.dim() == 0 else gs[-1])
        sfd = torch.tensor(scale[-1, -1].item(), dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        if sfd > 0:
            x[-1, -16:] = e2m1_grid("cpu") * (sfd * sdec)
    x = x.to(torch.bfloat16 if x_bf16 else torch.float32)
    mask = torch.rand(rows, generator=g) < 0.7
    rtn, _ = dispatch.nvfp4_quantize_dequantize(x, dequant_dtype=torch.float32, **gs_kw)
    out = torch.randn(rows, k, generator=g).to(torch.bfloat16 if out_bf16 else torch.float32)
    guide = dict(codes=codes) if full else dict(mantissa=mantissa_bits_packed(codes))
    want, want_counts = _guided_reference(out, x, scale, gs, mask, rtn=rtn.data, agree_ref=codes, **guide)
    got = out.clone()
    counts = cpu_quant.guided_dequantize_into(
        got, x, scale, gs, mask, rtn_codes=rtn.data, agree_codes=codes, lib=_lib(build), **guide
    )
    assert counts == want_counts
    assert _same_bits(got, want)
    assert counts[2] == int(mask.sum()) * k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_guided_dequantize_into_kv_rows_over_threads(dtype):
    """A V site's shape: x [tokens, groups, D], one S_enc per token and group, the mask per token;
    the rows split over two threads give the reference's bits and counts."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 2, 64, generator=g).to(dtype)
    rollout = nvfp4.quantize(x.float() * 1.001, global_scale=torch.tensor(1.0))
    gs = torch.rand(300, 2, generator=g) + 0.5
    mask = torch.rand(300, generator=g) < 0.8
    rtn = nvfp4.quantize(x, global_scale=torch.tensor(1.0))
    out = nvfp4.dequantize(rtn, dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for guide in (dict(codes=rollout.data), dict(mantissa=mantissa_bits_packed(rollout.data))):
            want, want_counts = _guided_reference(out, x, rollout.scale, gs, mask, rtn.data, None, **guide)
            got = out.clone()
            counts = cpu_quant.guided_dequantize_into(got, x, rollout.scale, gs, mask, rtn_codes=rtn.data, **guide)
            assert counts == want_counts and counts[1] == 0
            assert _same_bits(got, want)
    finally:
        torch.set_num_threads(threads)


def test_guided_dequantize_into_refuses_what_it_cannot_do():
    x, out = torch.randn(2, 32), torch.zeros(2, 32)
    q = nvfp4.quantize(x, per_row_global=True)
    mask = torch.ones(2, dtype=torch.bool)
    ok = dict(codes=q.data)
    assert cpu_quant.guided_dequantize_into(out, x, q.scale, q.global_scale, mask, **ok) is not None
    for bad in (
        dict(codes=q.data, mantissa=mantissa_bits_packed(q.data)),  # both
        dict(codes=q.data[:, :8]),  # wrong width
        dict(codes=q.data, rtn_codes=q.data.to(torch.int32)),
    ):
        assert cpu_quant.guided_dequantize_into(torch.zeros(2, 32), x, q.scale, q.global_scale, mask, **bad) is None
    assert cpu_quant.guided_dequantize_into(torch.zeros(2, 31), x, q.scale, q.global_scale, mask, **ok) is None
    assert cpu_quant.guided_dequantize_into(out, x, q.scale, torch.ones(3), mask, **ok) is None
