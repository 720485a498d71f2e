"""Weight-only low-bit projections for the CPU decode path.

`pack(w, "int8" | "int4")` turns a float weight [N, K] or lane weight [L, N, K] into a `PackedWeight`
kept in blocks of 32 along K: int8 codes with one fp16 scale per block (`int8`, 1.06 bytes per
weight), or 4-bit codes with an fp16 scale and minimum per block (`int4`, 0.56 bytes per weight; the
layout of GGUF's Q4_1, as int8 is Q8_0's). The products run in the `_lowbit` C extension (built by
the normal install): activations are quantized per call to int8 blocks of 32, with a second int8 code
for each value's rounding rest (16-bit activations, see `activation_bits`), each block's integer dot
products are scaled once, so a decode step streams the packed bytes and nothing else. Where the CPU
has AVX-512 VNNI, the rows of a batched decode step (one per request) are taken in tiles that share
each pass over the weights, each row bit for bit what it gets alone; where it also has AMX, products of
`tile_min_rows` rows or more (by default all of them) run on the int8 tiles, from a copy of the weight
kept in the tiles' order (`tile_copy`), bit for bit the VNNI kernel's results. Long products
(`gemm_min_rows` tokens or more) unpack the weight in C and run one float GEMM.

`PackedWeight.dequantize()` is the reference: the same packed codes unpacked in plain torch.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

FORMATS = {"int8": 0, "int4": 1}  # weight-only formats, named by their code width
BLOCK = 32
# Products of at least this many rows per lane (prompt chunks) unpack the weight to float and run one
# float GEMM: there the arithmetic sets the time, not the bytes, and the float GEMM quantizes nothing.
# Below it the integer kernels, with 16-bit activations, are faster: measured on the default model, 2
# threads of a Sapphire Rapids host, VNNI kernel 131 ms against the GEMM's 150 at 55 rows; the AVX2
# kernel, which sums the rest separately, breaks even at ~43 rows (127 ms against 132 at 41, 146
# against 138 at 48). With AMX tiles ('amx': products from `tile_min_rows` rows on) the integer path
# stays ahead much longer: the default model's products per 128-row prompt chunk 64 ms against the
# GEMM's 101 (256 rows: 136 against 166; 512: 286 against 291). The default follows the kernel chosen
# at import; see `gemm_min_rows`.
GEMM_MIN_ROWS = {"amx": 384, "vnni": 56, "avx2": 44, "generic": 44}

try:  # torch first: the extension uses the OpenMP runtime torch has already loaded
    from laneplay.kernels import _lowbit
except ImportError as e:  # pragma: no cover - only without a C compiler at install time
    _lowbit, _IMPORT_ERROR = None, e
else:
    _IMPORT_ERROR = None
if _lowbit is not None and os.environ.get("LANEPLAY_LOWBIT_KERNEL"):  # a lesser kernel than cpuid's pick
    try:
        _lowbit.use(os.environ["LANEPLAY_LOWBIT_KERNEL"])
    except (ValueError, RuntimeError) as e:
        raise RuntimeError(f"LANEPLAY_LOWBIT_KERNEL={os.environ['LANEPLAY_LOWBIT_KERNEL']}: {e} (this CPU runs "
                           f"{', '.join(_lowbit.kernels())})") from None
_GEMM_MIN_ROWS = [GEMM_MIN_ROWS.get(_lowbit.kernel(), GEMM_MIN_ROWS["generic"]) if _lowbit is not None else 56]
_TILES = _lowbit is not None and "amx" in _lowbit.kernels()  # weights keep a copy for the tiles


def available() -> bool:
    return _lowbit is not None


def require() -> None:
    if _lowbit is None:
        raise RuntimeError(f"the low-bit CPU kernels are not built ({_IMPORT_ERROR}); reinstall with "
                           "`make venv` (it needs a C compiler), or use dtype float32")


def kernel_name() -> str:
    """Which dot-product kernel runs: 'amx' ('vnni', with products of `tile_min_rows` rows or more on the
    AMX tiles), 'vnni' (AVX-512 VNNI: a batched step's rows share each pass over the weights), 'avx2', or
    'generic' (portable C). The import picks the best one this CPU has (cpuid). 'vnni' and 'amx' give
    bit-identical results; 'avx2' and 'generic' each sum in their own float order."""
    require()
    return _lowbit.kernel()


def kernels() -> tuple[str, ...]:
    """The kernels this CPU can run (the last is the one chosen at import)."""
    require()
    return _lowbit.kernels()


def tile_min_rows(rows: int | None = None) -> int:
    """With the 'amx' kernel, products of this many rows per lane or more (by default 1: all of them) run
    on the AMX tiles, fewer on the VNNI kernel; both give every row bit for bit the same result, so this
    is a matter of speed only (a decode step of the default model at 200 positions, 2 threads, Sapphire
    Rapids: one request 5.5-5.9 ms on the tiles against 6.3 on the VNNI kernel, 3 requests 8.3-8.5
    against 9.2, 16 requests 25 against 38). Sets it when given; returns the setting before (0 with any
    other kernel)."""
    require()
    if rows is not None and int(rows) < 1:
        raise ValueError("tile_min_rows must be at least 1")
    return _lowbit.tile_min_rows(0 if rows is None else int(rows))


def use_kernel(name: str) -> None:
    require()
    _lowbit.use(name)


def activation_bits(bits: int | None = None) -> int:
    """How the products quantize their inputs: 16 (the default: int8 blocks of 32 plus their rounding
    rest, error <= max|x| / 64516 per block) or 8 (int8 blocks alone, error <= max|x| / 254, less
    integer work). It applies to every product the integer kernels run: decode steps, batches and
    verifies, and prompt chunks of fewer than `gemm_min_rows` tokens (from there a float GEMM quantizes
    nothing). Sets it when given; returns the setting before."""
    require()
    return _lowbit.activation_bits(0 if bits is None else int(bits))


def gemm_min_rows(rows: int | None = None) -> int:
    """From how many rows per lane a product unpacks its weight and runs a float GEMM instead of the
    integer kernels (prompt chunks; by default GEMM_MIN_ROWS of the kernel chosen at import). Sets it
    when given (a huge value keeps every product on the integer kernels); returns the setting before."""
    before = _GEMM_MIN_ROWS[0]
    if rows is not None:
        if int(rows) < 1:
            raise ValueError("gemm_min_rows must be at least 1")
        _GEMM_MIN_ROWS[0] = int(rows)
    return before


def step_threads(n: int | None = None) -> int:
    """How many threads a whole decode step (`step`) runs on. By default (0) the step times itself
    and settles on the fastest of all, half, a quarter, ... of the threads, which is all of them on an
    idle machine and fewer when other work competes for the cores; n >= 1 pins the count. Sets it when
    given; returns the count the next step runs on. Results do not depend on it."""
    require()
    if n is not None and int(n) < 0:
        raise ValueError("step_threads must be 0 (adaptive) or a thread count")
    return _lowbit.step_threads(-1 if n is None else int(n))


class PackedWeight:
    """A packed [N, K] or [L, N, K] weight. qs: codes [L, N, Kp] int8 or [L, N, Kp/2] uint8 (two
    4-bit codes per byte); d (and m for int4): fp16 [L, N, S], one per block of 32, S = Kp/32 rounded
    up to a multiple of 8 (zeros past the last block: the kernels read scales 8 at a time).

    Where the CPU has AMX tiles, the weight also keeps `tiles`: the same codes and scales in the order
    the tiles read them (16 rows at a time, block by block; `tile_copy`), so a multi-row product streams
    one sequential buffer. It doubles the weight's memory there; a product reads one copy or the other."""

    def __init__(self, fmt: str, shape: tuple[int, ...], qs: Tensor, d: Tensor, m: Tensor | None):
        self.fmt, self.shape = fmt, tuple(shape)
        self.qs, self.d, self.m = qs, d, m
        self.lanes = shape[0] if len(shape) == 3 else 1
        self.rows, self.cols = shape[-2], shape[-1]
        self.padded = qs.shape[-1] * (2 if fmt == "int4" else 1)
        self._code = FORMATS[fmt]
        self.tiles = tile_copy(self) if _TILES else None
        tiles = self.tiles or (None, None, None)
        self._ptrs = tuple(t.data_ptr() if t is not None else 0 for t in (qs, d, m, *tiles))
        self._args = (self._code, self.lanes, self.rows, self.cols, self.padded)
        self.lanes_first = len(shape) == 3

    dtype = torch.float32  # what it computes in and returns
    device = torch.device("cpu")

    @property
    def nbytes(self) -> int:
        """Bytes one product streams."""
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def desc(self) -> list[int]:
        """The weight as the C step reads it: fmt, lanes, rows, cols, padded cols, and its buffers."""
        return [*self._args[:1], self.lanes, self.rows, self.cols, self.padded, *self._ptrs]

    def __repr__(self) -> str:
        return f"PackedWeight({self.fmt}, shape={list(self.shape)}, {self.nbytes / 2**20:.1f} MiB)"

    def dequantize(self) -> Tensor:
        """The packed weight as float32, unpacked in plain torch (the reference of the kernels)."""
        L, N = self.lanes, self.rows
        nb = self.padded // BLOCK
        d = self.d[..., :nb].float().view(L, N, nb, 1)
        if self.fmt == "int8":
            w = self.qs.float().view(L, N, nb, BLOCK) * d
        else:
            b = self.qs.view(L, N, nb, BLOCK // 2)
            codes = torch.cat([b & 15, b >> 4], dim=-1).float()  # element j low nibble, j + 16 high
            w = codes * d + self.m[..., :nb].float().view(L, N, nb, 1)
        w = w.reshape(L, N, self.padded)[..., :self.cols]
        return w.reshape(self.shape).contiguous()

    def unpacked(self) -> Tensor:
        """The packed weight as float32 [L, N, K], unpacked by the C extension (the same values as
        `dequantize()`, which is its reference)."""
        require()
        out = torch.empty(self.lanes, self.rows, self.cols, dtype=torch.float32)
        if out.numel():
            _lowbit.unpack(self._code, self.lanes * self.rows, self.cols, self.padded, *self._ptrs[:3], out.data_ptr())
        return out

    def _gemm(self, x: Tensor, m: int, norm: Tensor | None, eps: float, swiglu: bool) -> Tensor:
        """linear() as one float GEMM per lane on the unpacked weight (long products)."""
        L, K = self.lanes, self.cols
        x3 = x.view(L, m, -1)
        if norm is not None:  # RMSNorm of the float32 rows, then the weight (one per lane or shared)
            x3 = x3 * torch.rsqrt(x3.pow(2).mean(-1, keepdim=True) + eps) * norm.reshape(L if norm.numel() != K else 1, 1, K)
        elif swiglu:
            gate, up = x3.split(K, dim=-1)
            x3 = torch.nn.functional.silu(gate) * up
        return torch.bmm(x3, self.unpacked().transpose(1, 2))

    def linear(self, x: Tensor, norm: Tensor | None = None, eps: float = 0.0, swiglu: bool = False) -> Tensor:
        """x [..., K] -> [..., N] (a 2-D weight), or x [L, ..., K] -> [L, ..., N] (a lane weight).

        norm: RMSNorm x first with this weight ([K], or one per lane [L, ..., K]) and `eps`.
        swiglu: x holds [gate | up] ([..., 2K]); the product sees silu(gate) * up.
        """
        shape = x.shape
        k_in = 2 * self.cols if swiglu else self.cols
        if shape[-1] != k_in:
            raise ValueError(f"input has {shape[-1]} features, the weight expects {k_in}")
        if self.lanes_first and (len(shape) < 2 or shape[0] != self.lanes):
            raise ValueError(f"input {list(shape)} does not start with the weight's {self.lanes} lanes")
        if x.dtype != torch.float32:
            x = x.float()
        if not x.is_contiguous():
            x = x.contiguous()
        m = x.numel() // (self.lanes * k_in)
        pre, g, per_lane = PRE_NONE, 0, 0
        if norm is not None:
            per_lane = int(norm.numel() != self.cols)
            if norm.numel() != self.cols * (self.lanes if per_lane else 1) or norm.dtype != torch.float32:
                raise ValueError(f"norm weight {list(norm.shape)} does not fit {self.cols} features")
            pre, g = PRE_RMSNORM, norm.contiguous().data_ptr()
        elif swiglu:
            pre = PRE_SWIGLU
        if m >= _GEMM_MIN_ROWS[0]:
            return self._gemm(x, m, norm, eps, swiglu).view(*shape[:-1], self.rows)
        y = torch.empty(*shape[:-1], self.rows, dtype=torch.float32)
        if m:
            _lowbit.linear(*self._args, m, *self._ptrs, x.data_ptr(), y.data_ptr(), pre, g, per_lane, eps)
        return y


PRE_NONE, PRE_RMSNORM, PRE_SWIGLU = 0, 1, 2
TILE_ROWS = 16  # weight rows per AMX tile


def tile_copy(w: PackedWeight) -> tuple[Tensor, Tensor, Tensor | None]:
    """`w`'s codes and scales in the AMX tiles' order: per lane, rows in groups of 16 (zeros past the
    last row), and per group and block of 32 the block's bytes as the tiles' columns take them (four
    bytes of each of the 16 rows at a time), then the 16 rows' fp16 scales (and int4 minimums) side by
    side. -> (codes int8 [L, G, blocks, 16 x block bytes], scales and minimums fp16 [L, G, blocks, 16])."""
    require()
    L, nb = w.lanes, w.padded // BLOCK
    G = -(-w.rows // TILE_ROWS)
    block_bytes = BLOCK if w.fmt == "int8" else BLOCK // 2
    qt = torch.empty(L, G, nb, TILE_ROWS * block_bytes, dtype=torch.int8)
    dt = torch.empty(L, G, nb, TILE_ROWS, dtype=torch.float16)
    mt = torch.empty(L, G, nb, TILE_ROWS, dtype=torch.float16) if w.m is not None else None
    if qt.numel():
        _lowbit.tile_pack(w._code, L, w.rows, w.padded, w.qs.data_ptr(), w.d.data_ptr(),
                          w.m.data_ptr() if w.m is not None else 0, qt.data_ptr(), dt.data_ptr(),
                          mt.data_ptr() if mt is not None else 0)
    return qt, dt, mt


# What a low-bit model's KV cache holds (`LaneModel.kv_dtype`). A decode step reads every cached key and
# value once per token, so at long contexts and with many rows the cache's bytes are much of a step's
# memory traffic: float16 halves them (at 1,000 positions on the default model a step's attention takes
# ~3 ms of 7.4 from a float32 cache). llama.cpp keeps its cache in float16 by default too.
KV_DTYPE = torch.float16


def cache_half(kc: Tensor, vc: Tensor) -> int:
    """What the C attention is told about a layer's K/V buffers: 1 for float16, 0 for float32; anything
    else (another dtype, K and V apart, not contiguous, not on the host) is refused."""
    if (kc.dtype not in (torch.float32, torch.float16) or vc.dtype != kc.dtype or kc.device.type != "cpu"
            or vc.device.type != "cpu" or not (kc.is_contiguous() and vc.is_contiguous())):
        raise ValueError(f"the low-bit attention takes a contiguous float32 or float16 cache on the host, got "
                         f"{kc.dtype} and {vc.dtype} on {kc.device}")
    return int(kc.dtype == torch.float16)


def attend(qkv: Tensor, cos: Tensor, sin: Tensor, kc: Tensor, vc: Tensor, slot: int, n: int,
           heads: int, kv_heads: int) -> Tensor:
    """One decode token's attention, fused: qkv [N, (Hq + 2 Hkv) hd] float32 (q and k are rotated in
    place by cos/sin [hd/2] of this position, interleaved pairs), k and v written into slot `slot` of
    kc/vc [N, Hkv, slots, hd], then every query head attends over slots [0, n). -> [N, Hq hd].
    The cache may be float32 or float16 (`KV_DTYPE`): k and v are then rounded to nearest even as they
    are stored, and every key and value is read back widened, exactly."""
    N, hd, slots = qkv.shape[0], kc.shape[-1], kc.shape[2]
    for t in (qkv, cos, sin):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError("attend() takes contiguous float32 projections and rotations")
    half = cache_half(kc, vc)
    if qkv.shape[1] != (heads + 2 * kv_heads) * hd or tuple(kc.shape) != (N, kv_heads, slots, hd):
        raise ValueError(f"attend(): qkv {list(qkv.shape)} and cache {list(kc.shape)} do not fit")
    out = torch.empty(N, heads * hd, dtype=torch.float32)
    _lowbit.attend(N, heads, kv_heads, hd, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), kc.data_ptr(),
                   vc.data_ptr(), slots, int(slot), int(n), out.data_ptr(), half)
    return out


def step(plan: Tensor, table: Tensor, groups: int, heads: int, kv_heads: int, head_dim: int, h: Tensor,
         head: Tensor, norm: Tensor, logits: Tensor, eps: float, first: int = 0) -> Tensor:
    """A whole decode step of a one-lane packed model in one C call, for rows h [B, D] (float32, their
    embeddings; overwritten) -> logits [B - first, V] of rows first..B-1 (written in place, returned; a
    row's logits are the same whichever rows get theirs). Every layer adds
    wo . attend(wqkv . rmsnorm(h)) and w2 . swiglu(w13 . rmsnorm(h)) to h; the logits are
    head . rmsnorm(h). The operands are int64 tables of pointers (the caller keeps their tensors alive):
    plan [layers, 34], per layer: the attention norm, `desc()` of wqkv and of wo, the MLP norm, `desc()` of
    w13 and of w2; table [groups, 5] per group of rows: rows, position, cos and sin of that position, and its cache
    table [layers, 4] (k buffer, v buffer, slots, 1 for a float16 cache); head: the head's `desc()`; norm: the final norm."""
    require()
    for t in (h, logits, norm):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError("step() takes contiguous float32 rows, logits and norm")
    if not 0 <= first < h.shape[0] or logits.shape[0] != h.shape[0] - first:
        raise ValueError(f"step() writes the logits of rows {first}..{h.shape[0] - 1}, not {logits.shape[0]} rows")
    _lowbit.step(plan.data_ptr(), plan.shape[0], table.data_ptr(), int(groups), heads, kv_heads, head_dim,
                 h.data_ptr(), head.data_ptr(), norm.data_ptr(), logits.data_ptr(), int(first), eps)
    return logits


def top2(x: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's two largest entries of a float32 [rows, V] CPU tensor, largest first: (indices int64
    [rows, 2], values [rows, 2]). Ties go to the lower index first, as torch.argmax takes the first
    maximum; NaNs are passed over. What a greedy pick and a verify's acceptance read: torch's argmax and
    topk take ~0.2-0.4 ms over a 49,152-entry row on 2 threads, this one pass a small part of that."""
    require()
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"top2() takes a float32 CPU tensor [rows, V], got {x.dtype} {list(x.shape)} on {x.device}")
    x = x.contiguous()
    idx = torch.empty(x.shape[0], 2, dtype=torch.int64)
    val = torch.empty(x.shape[0], 2, dtype=torch.float32)
    if x.shape[0]:
        _lowbit.top2(x.data_ptr(), x.shape[0], x.shape[1], idx.data_ptr(), val.data_ptr())
    return idx, val


def pack(w: Tensor, fmt: str) -> PackedWeight:
    """Pack a float weight [N, K] or [L, N, K] (blocks of 32 along K, K zero-padded)."""
    require()
    if fmt not in FORMATS:
        raise ValueError(f"unknown low-bit format {fmt!r}; use one of {', '.join(FORMATS)}")
    if w.dim() not in (2, 3) or w.device.type != "cpu":
        raise ValueError(f"pack() takes a CPU weight [N, K] or [L, N, K], got {list(w.shape)} on {w.device}")
    src = w.detach().float().contiguous()
    K = src.shape[-1]
    rows = src.numel() // K if K else 0
    kp = -(-K // BLOCK) * BLOCK
    lead = tuple(src.shape[:-1]) if src.dim() == 3 else (1, src.shape[0])
    nb = -(-kp // (8 * BLOCK)) * 8  # scales per row, padded (see PackedWeight)
    if fmt == "int8":
        qs, m = torch.empty(*lead, kp, dtype=torch.int8), None
    else:
        qs, m = torch.empty(*lead, kp // 2, dtype=torch.uint8), torch.empty(*lead, nb, dtype=torch.float16)
    d = torch.empty(*lead, nb, dtype=torch.float16)
    if rows:
        _lowbit.pack(FORMATS[fmt], rows, K, kp, src.data_ptr(), qs.data_ptr(), d.data_ptr(),
                     m.data_ptr() if m is not None else 0)
    return PackedWeight(fmt, tuple(src.shape), qs, d, m)


MATRICES = ("wqkv", "wo", "w13", "w2")


def pack_weights(weights: dict[str, Tensor], fmt: str, head_fmt: str = "int8") -> dict:
    """The engine's weights with every projection packed as `fmt` and the LM head as `head_fmt`
    (int8 by default: the head is the one matrix whose error every logit sees). The embedding
    stays float (a token reads one row of it)."""
    out = dict(weights)
    for name, t in weights.items():
        if name.rsplit(".", 1)[-1] in MATRICES:
            out[name] = pack(t, fmt)
    out["head"] = pack(weights["head"], head_fmt)
    return out


def unpack_weights(weights: dict) -> dict[str, Tensor]:
    """The float reference of packed weights (the same codes, unpacked in plain torch)."""
    return {k: v.dequantize() if isinstance(v, PackedWeight) else v for k, v in weights.items()}
