"""The low-bit CPU kernels (`laneplay.kernels.lowbit`, C extension `_lowbit`) against plain torch.

Packing is checked against the formats' own error bounds; every product against x @ W.T with W the
same packed codes unpacked in torch (`PackedWeight.dequantize`), within the exact bound that the
activations' int8 quantisation allows (each input element is off by at most its block's max / 254);
the AVX2 kernels against the portable ones; the fused attention against the engine's torch attention.
"""
import math

import pytest
import torch

from laneplay.kernels import lowbit

pytestmark = pytest.mark.skipif(not lowbit.available(), reason="the _lowbit extension is not built")

KERNELS = list(lowbit.kernels()) if lowbit.available() else ["generic"]  # what this CPU can run (cpuid)


@pytest.fixture(params=[16, 8], ids=["act16", "act8"])
def bits(request):
    """The products' activation width; the bounds below follow it."""
    before = lowbit.activation_bits(request.param)
    yield request.param
    lowbit.activation_bits(before)


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [..., nb, 32], zero-padded."""
    k = t.shape[-1]
    kp = -(-k // 32) * 32
    return torch.nn.functional.pad(t, (0, kp - k)).unflatten(-1, (-1, 32))


def _act_error_bound(x: torch.Tensor, w: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """The largest |y - x @ w.T| that the activation blocks allow: int8 codes (scale max/127, round to
    nearest) are off by max/254 at most; with their rounding rest coded too (16), by max/64516."""
    step = 254 if bits == 8 else 254 * 254
    err = (_blocks(x).abs().amax(-1, keepdim=True) / step).expand(*x.shape[:-1], -1, 32).flatten(-2)
    err = err[..., :x.shape[-1]]
    return err @ w.abs().transpose(-1, -2) * 1.001 + 1e-5 * (1 + (x.abs() @ w.abs().transpose(-1, -2)))


def _assert_lanes_match(y, a, w, bits, slack=0.0):
    """y [L, ..., N] from a lane weight w [L, N, K] is a @ w[l].T per lane, within the activation bound."""
    ref = torch.einsum("lbsk,lnk->lbsn", a, w)
    bound = torch.stack([_act_error_bound(a[i], w[i], bits) for i in range(w.shape[0])])
    assert y.shape == ref.shape and ((y - ref).abs() <= bound * (1 + slack) + slack / 100).all()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(64, 96), (7, 70), (3, 5, 100), (1, 32)])
def test_pack_stays_within_the_format_error(fmt, shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.rand(shape[-2], 1) * 3  # rows of different scales
    p = lowbit.pack(w, fmt)
    assert p.shape == tuple(shape) and p.fmt == fmt
    deq = p.dequantize()
    assert deq.shape == w.shape and deq.dtype == torch.float32
    b, e = _blocks(w), _blocks(deq - w).abs().amax(-1)
    if fmt == "int8":
        step = b.abs().amax(-1) / 127
    else:
        step = (b.amax(-1) - b.amin(-1)) / 15
    fp16 = 2e-3 * b.abs().amax(-1)  # the fp16 scale (and minimum) are rounded too
    assert (e <= 0.5 * step * 1.01 + fp16 + 1e-7).all()
    again = lowbit.pack(deq, fmt)  # the unpacked codes pack back to themselves
    assert torch.allclose(again.dequantize(), deq, rtol=0, atol=1e-6 * float(w.abs().max()))
    kp = -(-shape[-1] // 32) * 32
    scales = -(-kp // 256) * 8  # per row, padded to a multiple of 8
    per_row = kp + 2 * scales if fmt == "int8" else kp // 2 + 4 * scales
    assert p.nbytes == per_row * w.numel() // shape[-1]  # what a product streams: codes and scales only


def test_pack_keeps_zero_and_constant_blocks():
    w = torch.zeros(4, 64)
    w[1] = 2.5
    w[2, :32] = -1.0
    for fmt in ("int8", "int4"):
        assert torch.allclose(lowbit.pack(w, fmt).dequantize(), w, atol=1e-3)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("m,n,k", [(1, 96, 64), (1, 10, 70), (5, 33, 100), (3, 7, 256), (70, 18, 96), (2, 1, 32)])
def test_linear_matches_the_unpacked_weight(kernel, bits, fmt, m, n, k):
    torch.manual_seed(1)
    p = lowbit.pack(torch.randn(n, k), fmt)
    w = p.dequantize()
    x = torch.randn(m, k) * 2
    y = p.linear(x)
    ref = x @ w.T
    assert y.shape == (m, n)
    assert ((y - ref).abs() <= _act_error_bound(x, w, bits)).all(), float((y - ref).abs().max())


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("m,n,k", [(2, 8, 64), (3, 10, 96), (5, 33, 200), (16, 12, 576), (4, 4, 32), (11, 7, 70)])
def test_a_row_in_a_batch_gets_exactly_what_it_gets_alone(kernel, bits, fmt, m, n, k):
    """Each row of a product (a sample of a batch) gets bit for bit what it gets alone, plain or with the
    fused RMSNorm or SwiGLU, in a lane weight too: a sample's tokens do not depend on its batch."""
    torch.manual_seed(4)
    p = lowbit.pack(torch.randn(2, n, k), fmt)
    x, g = torch.randn(2, m, k) * 2, torch.rand(k) + 0.5
    assert torch.equal(p.linear(x), torch.cat([p.linear(x[:, i:i + 1]) for i in range(m)], 1))
    assert torch.equal(p.linear(x, norm=g, eps=1e-5),
                       torch.cat([p.linear(x[:, i:i + 1], norm=g, eps=1e-5) for i in range(m)], 1))
    u = torch.randn(2, m, 2 * k)
    assert torch.equal(p.linear(u, swiglu=True), torch.cat([p.linear(u[:, i:i + 1], swiglu=True) for i in range(m)], 1))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_lane_weights_multiply_each_lane_by_its_own_slice(kernel, bits, fmt):
    torch.manual_seed(2)
    L, n, k = 3, 20, 96
    p = lowbit.pack(torch.randn(L, n, k), fmt)
    w = p.dequantize()
    x = torch.randn(L, 2, 1, k)
    _assert_lanes_match(p.linear(x), x, w, bits)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_avx2_and_generic_kernels_agree(bits, fmt):
    if "avx2" not in KERNELS:
        pytest.skip("this CPU has no AVX2: only the portable kernel runs")
    torch.manual_seed(3)
    p = lowbit.pack(torch.randn(2, 45, 200), fmt)
    x = torch.randn(2, 3, 200)
    before = lowbit.kernel_name()
    try:
        lowbit.use_kernel("generic")
        a = p.linear(x)
        lowbit.use_kernel("avx2")
        b = p.linear(x)
    finally:
        lowbit.use_kernel(before)
    # the same integer sums; only the float accumulation order differs
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("m,n,k", [(1, 45, 200), (3, 8, 64), (4, 12, 576), (8, 33, 1536), (13, 7, 70), (16, 5, 32)])
def test_vnni_and_avx2_kernels_agree(bits, fmt, m, n, k):
    """The VNNI tiles form the same block sums as the AVX2 kernel and scale them in the AMX tiles' order:
    the two agree within float rounding (and each row of the VNNI kernel is its own, see above)."""
    if "vnni" not in KERNELS:
        pytest.skip("this CPU has no AVX-512 VNNI: the AVX2 kernel runs (its own tests cover it)")
    torch.manual_seed(5)
    p = lowbit.pack(torch.randn(2, n, k), fmt)
    x, g, u = torch.randn(2, m, k) * 3, torch.rand(k) + 0.5, torch.randn(2, m, 2 * k)
    before = lowbit.kernel_name()
    out = {}
    try:
        for name in ("avx2", "vnni"):
            lowbit.use_kernel(name)
            out[name] = (p.linear(x), p.linear(x, norm=g, eps=1e-5), p.linear(u, swiglu=True))
    finally:
        lowbit.use_kernel(before)
    for a, b in zip(out["avx2"], out["vnni"]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


@pytest.mark.parametrize("k", [1, 7, 8, 15, 16, 17, 24, 40, 576, 1536, 1543])
def test_the_pre_processing_loops_agree_bit_for_bit(k):
    """A product's RMSNorm row is the same on the scalar and AVX2 loops bit for bit (the sum of squares is
    one partial sum per element index mod 16 and one tree at both levels), and its SwiGLU row within the
    polynomial exp's rounding."""
    from laneplay.kernels import _lowbit

    top = 1 if "avx2" in KERNELS else 0
    torch.manual_seed(k)
    x, g, u = torch.randn(k) * 3, torch.rand(k) + 0.5, torch.randn(2 * k) * 4
    u[:4] = torch.tensor([0.0, -0.0, 90.0, -90.0])[:min(4, 2 * k)]  # zero, both signs; exp's clamp

    def row(pre, src, level):
        out = torch.empty(k)
        _lowbit.pre_row(pre, src.data_ptr(), k, level, out.data_ptr(), g.data_ptr(), 1e-5)
        return out

    norms = [row(lowbit.PRE_RMSNORM, x, level) for level in range(top + 1)]
    ref = x / torch.sqrt(x.double().pow(2).mean() + 1e-5).float() * g
    assert torch.allclose(norms[0], ref, rtol=1e-6, atol=1e-6)
    swi = [row(lowbit.PRE_SWIGLU, u, level) for level in range(top + 1)]
    assert torch.allclose(swi[0], torch.nn.functional.silu(u[:k]) * u[k:], rtol=1e-5, atol=1e-5)
    for level in range(1, top + 1):
        assert torch.equal(norms[level], norms[0])
        assert torch.allclose(swi[level], swi[0], rtol=1e-5, atol=1e-5)  # level 0: expf, not the polynomial
    with pytest.raises(ValueError, match="pre_row"):
        row(lowbit.PRE_NONE, x, 0)
    with pytest.raises(ValueError, match="pre_row"):
        row(lowbit.PRE_RMSNORM, x, top + 1)


def test_the_import_picks_the_best_kernel_the_cpu_has():
    assert lowbit.kernels()[0] == "generic"
    assert lowbit.kernel_name() == lowbit.kernels()[-1]


def _rms(x, g, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("per_lane", [False, True])
def test_fused_rmsnorm_input(kernel, bits, fmt, per_lane):
    torch.manual_seed(4)
    L, n, k, eps = 2, 24, 96, 1e-5
    p = lowbit.pack(torch.randn(L, n, k), fmt)
    w = p.dequantize()
    x = torch.randn(L, 1, 1, k) * 5
    g = torch.rand(L, 1, 1, k) + 0.5 if per_lane else torch.rand(k) + 0.5
    y = p.linear(x, norm=g, eps=eps)
    _assert_lanes_match(y, _rms(x, g, eps), w, bits, slack=0.01)  # the norm itself is computed in float32 too
    with pytest.raises(ValueError, match="norm weight"):
        p.linear(x, norm=torch.ones(k + 1), eps=eps)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_fused_swiglu_input(kernel, bits, fmt):
    torch.manual_seed(5)
    L, n, k = 2, 16, 64
    p = lowbit.pack(torch.randn(L, n, k), fmt)
    w = p.dequantize()
    x = torch.randn(L, 3, 1, 2 * k) * 2
    y = p.linear(x, swiglu=True)
    gate, up = x.split(k, dim=-1)
    _assert_lanes_match(y, torch.nn.functional.silu(gate) * up, w, bits, slack=0.01)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(64, 96), (7, 70), (3, 5, 100), (2, 9, 33)])
def test_unpacked_is_the_dequantized_reference_exactly(fmt, shape):
    torch.manual_seed(9)
    p = lowbit.pack(torch.randn(shape) * 3, fmt)
    u = p.unpacked()
    assert u.shape == (p.lanes, p.rows, p.cols) and torch.equal(u.view(shape), p.dequantize())


@pytest.fixture
def gemm_from_rows():
    """Moves the float-GEMM threshold for one test and puts it back."""
    before = lowbit.gemm_min_rows()
    yield lowbit.gemm_min_rows
    lowbit.gemm_min_rows(before)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("pre", ["none", "norm", "norm-per-lane", "swiglu"])
def test_long_products_are_float_gemms_on_the_unpacked_weight(gemm_from_rows, fmt, pre):
    """From gemm_min_rows rows per lane on, linear() is x @ unpacked.T in float (no activation
    quantization): equal to the reference up to float rounding; one row fewer takes the integer kernels."""
    torch.manual_seed(10)
    L, n, k, eps = 2, 40, 96, 1e-5
    p = lowbit.pack(torch.randn(L, n, k), fmt)
    w = p.dequantize()
    gemm_from_rows(8)
    for m, gemm in ((8, True), (7, False)):
        x = torch.randn(L, 1, m, 2 * k if pre == "swiglu" else k) * 3
        kw, a = {}, x
        if pre.startswith("norm"):
            g = torch.rand(L, 1, 1, k) + 0.5 if pre == "norm-per-lane" else torch.rand(k) + 0.5
            kw, a = dict(norm=g, eps=eps), _rms(x, g, eps)
        elif pre == "swiglu":
            gate, up = x.split(k, dim=-1)
            kw, a = dict(swiglu=True), torch.nn.functional.silu(gate) * up
        y = p.linear(x, **kw)
        ref = torch.einsum("lbsk,lnk->lbsn", a, w)
        exact = torch.allclose(y, ref, rtol=1e-5, atol=1e-4)
        assert exact == gemm, (m, float((y - ref).abs().max()))
        if not gemm:
            _assert_lanes_match(y, a, w, 16, slack=0.01)
    with pytest.raises(ValueError, match="at least 1"):
        gemm_from_rows(0)


def test_16_bit_activations_are_closer_than_8_bit():
    """The rest codes matter: on the same product the 16-bit error is a small fraction of the 8-bit one,
    for a decode step's few rows and for a short prompt chunk's tens of rows alike (every product below
    `gemm_min_rows` keeps 16 bits)."""
    torch.manual_seed(8)
    p = lowbit.pack(torch.randn(64, 256), "int4")
    w = p.dequantize()
    chunk = lowbit.gemm_min_rows() - 1
    assert chunk > 16
    for rows in (4, chunk):
        x = torch.randn(rows, 256)
        ref = x @ w.T
        before = lowbit.activation_bits(8)
        try:
            e8 = float((p.linear(x) - ref).abs().max())
            lowbit.activation_bits(16)
            e16 = float((p.linear(x) - ref).abs().max())
        finally:
            lowbit.activation_bits(before)
        assert e16 < e8 / 20, (rows, e16, e8)
    with pytest.raises(ValueError, match="8 or 16"):
        lowbit.activation_bits(4)


def test_bad_inputs_are_refused():
    p = lowbit.pack(torch.randn(3, 8, 64), "int4")
    with pytest.raises(ValueError, match="features"):
        p.linear(torch.randn(3, 1, 63))
    with pytest.raises(ValueError, match="lanes"):
        p.linear(torch.randn(2, 1, 64))
    with pytest.raises(ValueError, match="unknown low-bit format"):
        lowbit.pack(torch.randn(4, 32), "int3")
    with pytest.raises(ValueError, match="pack"):
        lowbit.pack(torch.randn(32), "int8")
    with pytest.raises(ValueError):
        lowbit.use_kernel("sse9")


# ---------------------------------------------------------------- attention


def _rope(x, cos, sin):
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def _reference(qkv, cos, sin, kc, vc, slot, n, hq, hkv):
    """RoPE, the cache write and softmax attention over slots [0, n), written out in torch."""
    N, hd = qkv.shape[0], kc.shape[-1]
    q, k, v = qkv.view(N, hq + 2 * hkv, hd).split([hq, hkv, hkv], dim=1)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    kc, vc = kc.clone(), vc.clone()
    kc[:, :, slot], vc[:, :, slot] = k, v  # rounded to the cache's dtype, then read back widened
    rep = hq // hkv
    keys, vals = kc[:, :, :n].float().repeat_interleave(rep, 1), vc[:, :, :n].float().repeat_interleave(rep, 1)
    s = torch.einsum("nhd,nhtd->nht", q, keys) / math.sqrt(hd)
    out = torch.einsum("nht,nhtd->nhd", s.softmax(-1), vals)
    return out.reshape(N, hq * hd), kc, vc, torch.cat([q, k], 1).reshape(N, -1)


@pytest.mark.parametrize("N,hq,hkv,hd,slots,slot,n", [
    (1, 4, 2, 64, 16, 0, 1),       # the first token: it sees only itself
    (2, 4, 2, 64, 16, 9, 10),      # two sequences, part of the cache
    (1, 3, 3, 8, 8, 5, 8),         # no GQA sharing, a full ring buffer written mid-way
    (1, 6, 2, 64, 1024, 999, 1000),  # long: split along the sequence and merged
    (3, 2, 1, 12, 300, 150, 300),  # head dim not a multiple of 8: the portable loops
    (1, 2, 1, 16, 257, 0, 257),    # wrapped ring: the new key lands in slot 0 of a full cache
    (1, 9, 3, 64, 300, 128, 129),  # one key past a stretch of 128 slots
    (2, 4, 2, 128, 40, 16, 17),    # one key past a block of 16, a longer head
    (1, 2, 1, 24, 50, 30, 31),     # head dim a multiple of 8, not of 16: the AVX2 loops on any kernel
    (1, 2, 1, 528, 40, 19, 20),    # a head longer than the 256 columns the value loops hold at once
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32-cache", "f16-cache"])
def test_attend_matches_torch(kernel, N, hq, hkv, hd, slots, slot, n, dtype):
    torch.manual_seed(6)
    qkv = torch.randn(N, (hq + 2 * hkv) * hd)
    ang = torch.rand(hd // 2) * 6
    cos, sin = ang.cos(), ang.sin()
    kc, vc = torch.randn(N, hkv, slots, hd).to(dtype), torch.randn(N, hkv, slots, hd).to(dtype)
    ref, ref_k, ref_v, rotated = _reference(qkv, cos, sin, kc, vc, slot, n, hq, hkv)
    work = qkv.clone()
    out = lowbit.attend(work, cos, sin, kc, vc, slot, n, hq, hkv)
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5), float((out - ref).abs().max())
    assert kc.dtype == vc.dtype == dtype
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)  # only the slot changed, rounded as torch rounds
    assert torch.allclose(work[:, :(hq + hkv) * hd], rotated, atol=1e-6)  # q and k rotated in place


def test_a_float16_cache_saturates_outliers_instead_of_storing_inf(kernel):
    """A key or value beyond float16's range is stored as its largest finite value (as the engine's prompt
    chunks clamp theirs), so one outlier cannot turn every later score into inf or NaN."""
    hq, hkv, hd, slots = 2, 1, 16, 8
    qkv = torch.randn(1, (hq + 2 * hkv) * hd) * 0.1
    qkv[0, hq * hd:hq * hd + 3] = torch.tensor([1e6, -1e6, 7e4])  # k, unrotated (cos 1, sin 0)
    qkv[0, (hq + hkv) * hd] = 1e9  # v
    cos, sin = torch.ones(hd // 2), torch.zeros(hd // 2)
    kc, vc = torch.zeros(1, hkv, slots, hd, dtype=torch.float16), torch.zeros(1, hkv, slots, hd, dtype=torch.float16)
    out = lowbit.attend(qkv.clone(), cos, sin, kc, vc, 2, 3, hq, hkv)
    top = torch.finfo(torch.float16).max
    assert kc[0, 0, 2, :3].tolist() == [top, -top, top] and vc[0, 0, 2, 0].item() == top
    assert torch.isfinite(kc).all() and torch.isfinite(vc).all() and torch.isfinite(out).all()


def test_attend_agrees_with_the_engine_attention():
    from laneplay.engine.model import apply_rope, decode_attention

    torch.manual_seed(7)
    N, hq, hkv, hd, T = 2, 8, 4, 32, 40
    qkv = torch.randn(N, (hq + 2 * hkv) * hd)
    ang = torch.rand(1, hd // 2) * 3
    kc, vc = torch.randn(N, hkv, T, hd), torch.randn(N, hkv, T, hd)
    q, k, v = qkv.view(N, 1, -1).split([hq * hd, hkv * hd, hkv * hd], dim=-1)
    q = apply_rope(q.reshape(N, 1, hq, hd), ang.cos(), ang.sin()).transpose(1, 2)
    k = apply_rope(k.reshape(N, 1, hkv, hd), ang.cos(), ang.sin()).transpose(1, 2)
    kr, vr = kc.clone(), vc.clone()
    kr[:, :, T - 1:], vr[:, :, T - 1:] = k, v.reshape(N, 1, hkv, hd).transpose(1, 2)
    ref = decode_attention(q, kr, vr).reshape(N, -1)
    out = lowbit.attend(qkv.clone(), ang.cos().view(-1), ang.sin().view(-1), kc, vc, T - 1, T, hq, hkv)
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_attend_refuses_bad_slots_and_shapes():
    qkv, cs = torch.randn(1, 4 * 8), torch.ones(4)
    kc = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match="slot"):
        lowbit.attend(qkv.clone(), cs, cs, kc, kc.clone(), 4, 4, 2, 1)
    with pytest.raises(ValueError, match="slot"):
        lowbit.attend(qkv.clone(), cs, cs, kc, kc.clone(), 0, 0, 2, 1)
    with pytest.raises(ValueError, match="do not fit"):
        lowbit.attend(qkv.clone(), cs, cs, kc, kc.clone(), 0, 1, 3, 1)
    with pytest.raises(ValueError, match="contiguous float32"):
        lowbit.attend(qkv.double(), cs, cs, kc, kc.clone(), 0, 1, 2, 1)
    with pytest.raises(ValueError, match="float16 cache"):
        lowbit.attend(qkv.clone(), cs, cs, kc.bfloat16(), kc.bfloat16(), 0, 1, 2, 1)
    with pytest.raises(ValueError, match="float16 cache"):
        lowbit.attend(qkv.clone(), cs, cs, kc, kc.half(), 0, 1, 2, 1)


@pytest.mark.parametrize("k", [32, 70, 576, 1536])
@pytest.mark.parametrize("rest", [True, False], ids=["act16", "act8"])
@pytest.mark.parametrize("paired", [True, False])
def test_the_vector_activation_quantizer_is_the_scalar_one_bit_for_bit(k, rest, paired):
    """The AVX2 and VNNI kernels quantize a product's inputs with vector code: the same codes, rests,
    scales and sums as the portable loop, so the kernel choice never changes what a row is multiplied by."""
    if "avx2" not in KERNELS:
        pytest.skip("this CPU has no AVX2: only the scalar quantizer runs")
    torch.manual_seed(k)
    kp = -(-k // 32) * 32
    ns = -(-(kp // 32) // 8) * 8
    for scale in (1e-3, 1.0, 3e4):
        x = torch.randn(k) * scale
        x[:7] = 0.0  # an all-zero stretch
        x[40:45] = torch.tensor([0.5, -0.5, 1.5, -2.5, 127.0])[: max(0, min(5, k - 40))]  # ties
        outs = []
        for fast in (0, 1):
            q, q2 = torch.zeros(kp, dtype=torch.int8), torch.zeros(kp, dtype=torch.int8)
            d, s = torch.full((ns,), 7.0), torch.full((ns,), 7.0)
            lowbit._lowbit.quantize(fast, k, kp, int(paired), x.data_ptr(), q.data_ptr(),
                                    q2.data_ptr() if rest else 0, d.data_ptr(), s.data_ptr())
            outs.append((q, q2, d, s))
        for a, b in zip(*outs):
            assert torch.equal(a, b)


def test_top2_is_torch_argmax_and_topk_with_ties_to_the_lower_index(kernel):
    torch.manual_seed(3)
    x = torch.randn(6, 49152)
    x[1, 100] = x[1, 7] = 50.0  # a tie for the top: the lower index first, then the other
    x[2, 9] = 40.0
    x[2, 300] = x[2, 20] = 30.0  # a tie for second place: the lower index
    x[3] = -torch.inf  # nothing but -inf: the first two indices
    x[4, 5] = float("nan")  # NaNs are passed over
    x[5] = 1.0  # all equal
    idx, val = lowbit.top2(x)
    assert idx[:, 0].tolist() == [int(x[0].argmax()), 7, 9, 0, int(x[4].nan_to_num(-1e9).argmax()), 0]
    assert idx[1:, 1].tolist() == [100, 20, 1, int(x[4].nan_to_num(-1e9).topk(2).indices[1]), 1]
    ref = x[0].topk(2)
    assert idx[0].tolist() == ref.indices.tolist() and torch.equal(val[0], ref.values)
    assert torch.equal(val[:, 0], x.gather(1, idx[:, :1]).squeeze(1))
    assert lowbit.top2(torch.empty(0, 5))[0].shape == (0, 2)
    with pytest.raises(ValueError):
        lowbit.top2(torch.zeros(3, dtype=torch.float64))


def test_top2_is_the_same_on_every_kernel_for_any_row():
    """The AVX-512 passes (VNNI and AMX kernels) and the scalar loop: the same indices and values bit for bit,
    for rows of every length around the 16 lanes, with NaNs, infinities, signed zeros and ties anywhere."""
    gen = torch.Generator().manual_seed(11)
    rows = []
    for V in (1, 2, 3, 15, 16, 17, 31, 32, 33, 100, 49152):
        for kind in range(6):
            x = torch.randn(V, generator=gen)
            if kind == 1:
                x = torch.randint(-3, 4, (V,), generator=gen).float()  # ties everywhere
            elif kind == 2:
                x[torch.rand(V, generator=gen) < 0.5] = float("nan")
            elif kind == 3:
                x = torch.full((V,), -torch.inf)
                x[torch.rand(V, generator=gen) < 0.2] = float("nan")
            elif kind == 4:
                x = torch.where(torch.rand(V, generator=gen) < 0.5, torch.tensor(0.0), torch.tensor(-0.0))
            elif kind == 5:
                x[torch.randint(0, V, (2,), generator=gen)] = torch.inf
            rows.append(x)
    results = {}
    before = lowbit.kernel_name()
    try:
        for k in lowbit.kernels():
            lowbit.use_kernel(k)
            results[k] = [lowbit.top2(x.view(1, -1)) for x in rows]
    finally:
        lowbit.use_kernel(before)
    first = next(iter(results.values()))
    for k, got in results.items():
        for (i, v), (i0, v0), x in zip(got, first, rows):
            assert torch.equal(i, i0) and torch.equal(v.view(torch.int32), v0.view(torch.int32)), (k, x[:8])


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(45, 200), (2, 16, 64), (3, 33, 1536), (1, 7, 70)])
def test_the_tile_copy_holds_each_block_in_the_tiles_column_order(fmt, shape):
    """The AMX tiles' copy of a weight (built on any CPU): per lane, 16 rows at a time (zeros past the
    last), each block's bytes four per row and column, and the 16 rows' scales side by side."""
    torch.manual_seed(1)
    p = lowbit.pack(torch.randn(*shape), fmt)
    qt, dt, mt = lowbit.tile_copy(p)
    L, N, nb = p.lanes, p.rows, p.padded // 32
    G = -(-N // 16)
    q = p.qs.view(torch.int8).reshape(L, N, nb, -1)
    q = torch.cat([q, torch.zeros(L, G * 16 - N, nb, q.shape[-1], dtype=torch.int8)], 1)
    want = q.view(L, G, 16, nb, -1, 4).permute(0, 1, 3, 4, 2, 5).reshape(L, G, nb, -1)
    assert torch.equal(qt, want)

    def side_by_side(s):
        s = torch.cat([s.reshape(L, N, -1)[..., :nb], torch.zeros(L, G * 16 - N, nb, dtype=s.dtype)], 1)
        return s.view(L, G, 16, nb).transpose(2, 3)

    assert torch.equal(dt, side_by_side(p.d))
    assert (mt is None) == (fmt == "int8") and (mt is None or torch.equal(mt, side_by_side(p.m)))
    assert (p.tiles is not None) == ("amx" in lowbit.kernels())


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("m,n,k", [(1, 45, 200), (5, 16, 64), (8, 17, 96), (9, 33, 64), (17, 45, 200),
                                   (20, 16, 64), (33, 40, 576), (40, 7, 70), (48, 33, 1536)])
def test_the_amx_tiles_and_the_vnni_kernel_agree_bit_for_bit(bits, fmt, lanes, m, n, k):
    """'amx': products of tile_min_rows rows or more run on the tiles, fewer on the VNNI kernel, and both
    give each row bit for bit the same result (the same block sums, the same float order), plain or with
    the fused RMSNorm or SwiGLU: a row's logits do not depend on which ran, nor on the other rows. One
    lane with at most 8 rows takes the codes and their rests in one tile."""
    if "amx" not in KERNELS:
        pytest.skip("this CPU (or its kernel) offers no AMX tiles: the VNNI or AVX2 kernel runs")
    torch.manual_seed(6)
    p = lowbit.pack(torch.randn(lanes, n, k), fmt)
    w = p.dequantize()
    x, g, u = torch.randn(lanes, m, k) * 2, torch.rand(k) + 0.5, torch.randn(lanes, m, 2 * k)
    before, gemm = lowbit.kernel_name(), lowbit.gemm_min_rows(10 ** 6)
    out = {}
    try:
        lowbit.use_kernel("amx")
        default = lowbit.tile_min_rows()
        assert default == 1  # by default: every product
        for rows in (1, 10 ** 6):  # everything on the tiles, then nothing
            lowbit.tile_min_rows(rows)
            out[rows] = (p.linear(x), p.linear(x, norm=g, eps=1e-5), p.linear(u, swiglu=True))
        lowbit.tile_min_rows(default)
        order = torch.randperm(m)
        again = (p.linear(x[:, order]), torch.cat([p.linear(x[:, i:i + 1]) for i in range(m)], 1))
        lowbit.use_kernel("vnni")
        vnni = p.linear(x)
    finally:
        lowbit.use_kernel(before)
        lowbit.gemm_min_rows(gemm)
    for a, b in zip(out[1], out[10 ** 6]):
        assert torch.equal(a, b)
    tiles = out[1][0]
    assert torch.equal(tiles, vnni) and torch.equal(again[0], tiles[:, order]) and torch.equal(again[1], tiles)
    for i in range(lanes):
        assert ((tiles[i] - x[i] @ w[i].T).abs() <= _act_error_bound(x[i], w[i], bits)).all()


def test_the_portable_c_path_compiles_without_x86(tmp_path):
    """The extension's non-x86 build (no intrinsics, no AMX): every x86-only helper must stay behind LP_X86.
    Compiled here with the x86 detection switched off, warnings as errors."""
    import shutil
    import subprocess
    import sysconfig
    from pathlib import Path

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    src = (Path(__file__).resolve().parents[2] / "kernels" / "lowbit.c").read_text()
    marker = "#if defined(__x86_64__) || defined(__i386__)"
    assert marker in src
    (tmp_path / "portable.c").write_text(src.replace(marker, "#if 0", 1))
    r = subprocess.run([cc, "-fsyntax-only", "-Wall", "-Werror", "-fopenmp", "-std=gnu11",
                        f"-I{sysconfig.get_paths()['include']}", str(tmp_path / "portable.c")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_environment_can_pick_a_lesser_kernel_for_a_process_and_its_engines():
    import os
    import subprocess
    import sys

    code = "from laneplay.kernels import lowbit; print(lowbit.kernel_name(), lowbit.gemm_min_rows())"
    for name in ("avx2", "generic"):
        if name not in lowbit.kernels():
            continue
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "LANEPLAY_LOWBIT_KERNEL": name},
                             capture_output=True, text=True, timeout=120)
        assert out.stdout.split() == [name, str(lowbit.GEMM_MIN_ROWS[name])], out.stderr
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "LANEPLAY_LOWBIT_KERNEL": "sse9"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "LANEPLAY_LOWBIT_KERNEL=sse9" in out.stderr and "this CPU runs" in out.stderr
