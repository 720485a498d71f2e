/* Weight-only low-bit matrix products for the CPU decode path (`laneplay.kernels.lowbit`).
 *
 * A weight matrix [N, K] is kept packed in blocks of 32 along K (K padded with zeros to Kp):
 *   q8: int8 codes qs[N, Kp] and one fp16 scale per block d[N, S]                 w = d * q
 *   q4: 4-bit codes qs[N, Kp/2] (block b's 16 bytes hold element j in the low nibble and
 *       element j + 16 in the high nibble), fp16 scale d and fp16 minimum m per block  w = d * q + m
 * where S = Kp/32 rounded up to a multiple of 8 (the padding scales are zero), so the kernels read
 * scales 8 at a time with no tail.
 * The activations are quantized per call to int8 blocks of 32 (scale = max|x| / 127), by default with
 * a second int8 code per value for its rounding rest (16-bit activations; see quantize_act), and each
 * block's dot products are integer sums scaled once, so a token streams ~0.56 (q4) or ~1.06 (q8)
 * bytes per weight instead of 4. AVX2 kernels where the CPU has them, portable C otherwise; rows
 * are shared out over OpenMP threads (torch's own pool: torch has loaded libgomp before us).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define LP_X86 1
#endif

#define QK 32
#define SPAD(nb) (((nb) + 7) / 8 * 8) /* scales per row */
#define AMX_ROWS 16 /* weight rows per AMX tile (and per group of a weight's tile copy) */
enum { FMT_Q8 = 0, FMT_Q4 = 1 };
/* bytes of one block of AMX_ROWS rows in a weight's tile copy (tile_pack) */
static int64_t tile_bytes(int fmt) { return fmt == FMT_Q8 ? QK * AMX_ROWS : QK / 2 * AMX_ROWS; }

#define F16_MAX 65504.0f /* the largest finite float16 */
static inline float f16_range(float x) { return x < -F16_MAX ? -F16_MAX : x > F16_MAX ? F16_MAX : x; }
static inline float h2f(uint16_t h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
static inline uint16_t f2h(float f) { _Float16 v = (_Float16)f; uint16_t h; memcpy(&h, &v, 2); return h; }

/* ---- packing ------------------------------------------------------------------------------- */

/* One row of K floats -> Kp/32 blocks. Codes are computed against the fp16-rounded scale (and
 * minimum), so a row that already holds exactly representable values (a GGUF Q8_0 / Q4_1 tensor
 * dequantized to float) packs back to the same codes. */
static void pack_row(int fmt, const float *x, int64_t K, int64_t Kp, int8_t *qs, uint16_t *d, uint16_t *m) {
    float buf[QK];
    for (int64_t b = Kp / QK; b < SPAD(Kp / QK); b++) {
        d[b] = 0;
        if (m) m[b] = 0;
    }
    for (int64_t b = 0; b < Kp / QK; b++) {
        for (int j = 0; j < QK; j++) buf[j] = (b * QK + j < K) ? x[b * QK + j] : 0.0f;
        if (fmt == FMT_Q8) {
            float amax = 0.0f;
            for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(buf[j]));
            uint16_t dh = f2h(amax / 127.0f);
            float df = h2f(dh), id = df != 0.0f ? 1.0f / df : 0.0f;
            d[b] = dh;
            for (int j = 0; j < QK; j++) {
                float v = nearbyintf(buf[j] * id);
                qs[b * QK + j] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
            }
        } else {
            float lo = buf[0], hi = buf[0];
            for (int j = 1; j < QK; j++) { lo = fminf(lo, buf[j]); hi = fmaxf(hi, buf[j]); }
            uint16_t mh = f2h(lo);
            float mf = h2f(mh);
            uint16_t dh = f2h((hi - mf) / 15.0f);
            float df = h2f(dh), id = df != 0.0f ? 1.0f / df : 0.0f;
            d[b] = dh;
            m[b] = mh;
            uint8_t *out = (uint8_t *)qs + b * (QK / 2);
            for (int j = 0; j < QK / 2; j++) {
                float v0 = nearbyintf((buf[j] - mf) * id), v1 = nearbyintf((buf[j + QK / 2] - mf) * id);
                int c0 = (int)(v0 < 0 ? 0 : v0 > 15 ? 15 : v0), c1 = (int)(v1 < 0 ? 0 : v1 > 15 ? 15 : v1);
                out[j] = (uint8_t)(c0 | (c1 << 4));
            }
        }
    }
}

/* ---- activations: float rows -> int8 blocks ------------------------------------------------------
 * Each block of 32 gets a scale d and int8 codes q (x ~ d q, |error| <= max|x| / 254); with q2 (the
 * "16-bit" activations) also the rounding rest in 254ths of a step (x ~ d (254 q + q2), |error| <=
 * max|x| / 64516), which the dot products take as a second integer sum over the same weight codes. */

/* paired: the AVX2 q4 kernel's order, blocks b, b + 1 (b even) stored as [b 0..15 | b+1 0..15 | b 16..31 |
 * b+1 16..31], which is how one 32-byte load of their packed codes splits into low and high nibbles. */
/* quantize_act from block `from` on (the blocks before it are done), then the paired order */
static void quantize_act_from(const float *x, int64_t K, int64_t Kp, int8_t *q, float *d, float *s, int paired,
                              int8_t *q2, int64_t from) {
    for (int64_t b = Kp / QK; b < SPAD(Kp / QK); b++) d[b] = s[b] = 0.0f;
    for (int64_t b = from; b < Kp / QK; b++) {
        float buf[QK], amax = 0.0f;
        for (int j = 0; j < QK; j++) {
            buf[j] = (b * QK + j < K) ? x[b * QK + j] : 0.0f;
            amax = fmaxf(amax, fabsf(buf[j]));
        }
        int sum = 0;
        float df = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        for (int j = 0; j < QK; j++) {
            float v = nearbyintf(buf[j] * id);
            q[b * QK + j] = (int8_t)v;
            sum += (q2 ? 254 : 1) * (int)v;
            if (q2) {  /* the rest, |x - df v| <= df / 2, in steps of df / 254 */
                float v2 = nearbyintf((buf[j] - df * v) * id * 254.0f);
                v2 = v2 > 127.0f ? 127.0f : v2 < -127.0f ? -127.0f : v2;
                q2[b * QK + j] = (int8_t)v2;
                sum += (int)v2;
            }
        }
        d[b] = q2 ? df / 254.0f : df;  /* q2: the block's value is d * (254 q + q2) */
        /* for q4's minimum: the sum of the inputs as quantized, so that each weight's error is its own
         * value times its input's (the minimum's term cancels against the codes' term) */
        s[b] = d[b] * (float)sum;
    }
    for (int pass = 0; paired && pass < (q2 ? 2 : 1); pass++) {
        int8_t *base = pass ? q2 : q;
        for (int64_t b = 0; b + 1 < Kp / QK; b += 2) {
            int8_t t[2 * QK];
            int8_t *p = base + b * QK;
            memcpy(t, p + 16, 16);       /* b 16..31 */
            memcpy(p + 16, p + 32, 16);  /* b+1 0..15 */
            memcpy(p + 32, t, 16);
        }
    }
}

static void quantize_act(const float *x, int64_t K, int64_t Kp, int8_t *q, float *d, float *s, int paired,
                         int8_t *q2) {
    quantize_act_from(x, K, Kp, q, d, s, paired, q2, 0);
}

#ifdef LP_X86
/* quantize_act with AVX2: the same operations on 8 values at a time, so the same codes, scales and sums
 * bit for bit (max is exact in any order, the products and differences are the scalar ones, unfused,
 * and rounding is to nearest even in both); blocks that run past K take the scalar loop. */
__attribute__((target("avx2,fma,f16c"), optimize("fp-contract=off"))) static void
quantize_act_avx2(const float *x, int64_t K, int64_t Kp, int8_t *q, float *d, float *s, int paired, int8_t *q2) {
    const __m256 sign = _mm256_set1_ps(-0.0f), k254 = _mm256_set1_ps(254.0f);
    const __m256 lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int64_t full = K / QK;
    for (int64_t b = 0; b < full; b++) {
        __m256 v[4], am = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * QK + 8 * i);
            am = _mm256_max_ps(am, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(am), _mm256_extractf128_ps(am, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        float df = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        __m256 idv = _mm256_set1_ps(id), dfv = _mm256_set1_ps(df);
        __m256i c[4], c2[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            c[i] = _mm256_cvtps_epi32(r);
            if (q2) {
                __m256 rest = _mm256_mul_ps(_mm256_mul_ps(_mm256_sub_ps(v[i], _mm256_mul_ps(dfv, r)), idv), k254);
                rest = _mm256_round_ps(rest, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                c2[i] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(rest, lim), nlim));
                sum = _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_mullo_epi32(c[i], _mm256_set1_epi32(254)), c2[i]));
            } else {
                sum = _mm256_add_epi32(sum, c[i]);
            }
        }
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        _mm256_storeu_si256((__m256i *)(q + b * QK), _mm256_permutevar8x32_epi32(p, order));
        if (q2) {
            p = _mm256_packs_epi16(_mm256_packs_epi32(c2[0], c2[1]), _mm256_packs_epi32(c2[2], c2[3]));
            _mm256_storeu_si256((__m256i *)(q2 + b * QK), _mm256_permutevar8x32_epi32(p, order));
        }
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        d[b] = q2 ? df / 254.0f : df;
        s[b] = d[b] * (float)_mm_cvtsi128_si32(s4);
    }
    /* the rest (a block past K, the padding blocks and scales) and the paired order: the scalar path */
    quantize_act_from(x, K, Kp, q, d, s, paired, q2, full);
}
#endif

/* ---- dot products of up to 4 packed rows with one activation row ------------------------------
 * Rows r < R start at qs + r * row_bytes, wd + r * SPAD(nb), wm + r * SPAD(nb). */

#define MAXR 4
#ifndef PFD
#define PFD 1
#endif
#ifndef PF
#define PF 1
#endif

static void dot_generic(int fmt, int64_t nb, int64_t row_bytes, const int8_t *qs, const uint16_t *wd,
                        const uint16_t *wm, int R, const int8_t *xq, const int8_t *xq2, const float *xd,
                        const float *xs, float *out) {
    int64_t ns = SPAD(nb);
    for (int r = 0; r < R; r++) {
        const int8_t *q = qs + r * row_bytes;
        const uint16_t *d = wd + r * ns, *m = wm ? wm + r * ns : NULL;
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            int isum = 0, isum2 = 0;
            const int8_t *a = xq + b * QK, *a2 = xq2 ? xq2 + b * QK : xq + b * QK;
            if (fmt == FMT_Q8) {
                for (int j = 0; j < QK; j++) {
                    isum += (int)q[b * QK + j] * (int)a[j];
                    isum2 += (int)q[b * QK + j] * (int)a2[j];
                }
            } else {
                const uint8_t *p = (const uint8_t *)q + b * (QK / 2);
                for (int j = 0; j < QK / 2; j++) {
                    isum += (int)(p[j] & 15) * a[j] + (int)(p[j] >> 4) * a[j + QK / 2];
                    isum2 += (int)(p[j] & 15) * a2[j] + (int)(p[j] >> 4) * a2[j + QK / 2];
                }
            }
            if (xq2) isum = 254 * isum + isum2;
            acc += h2f(d[b]) * xd[b] * (float)isum + (fmt == FMT_Q4 ? h2f(m[b]) * xs[b] : 0.0f);
        }
        out[r] = acc;
    }
}

#ifdef LP_X86
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))

AVX2_FN static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* R rows at once: the activation block is loaded once for all of them, and R independent
 * accumulator chains keep the FMA pipes busy. Scales are converted and multiplied 8 blocks at a
 * time (rows and activations carry zero scales up to a multiple of 8); the q4 minimum's
 * contribution is one FMA per 8 blocks. */
AVX2_FN static inline __attribute__((always_inline)) void
dot_rows_avx2(const int fmt, const int R, const int hi, int64_t nb, int64_t row_bytes, const int8_t *qs,
              const uint16_t *wd, const uint16_t *wm, const int8_t *xq, const int8_t *xq2, const float *xd,
              const float *xs, float *out) {
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
    const __m256i k254 = _mm256_set1_epi16(254);  /* hi: 254 * (first sum) + second sum */
    __m256 acc[MAXR], macc[MAXR];
    const int64_t ns = SPAD(nb);
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); macc[r] = _mm256_setzero_ps(); }
    for (int64_t g = 0; g < nb; g += 8) {
        int n8 = nb - g < 8 ? (int)(nb - g) : 8;
        __m256 xdv = _mm256_loadu_ps(xd + g);
        float sc[MAXR][8];
        for (int r = 0; r < R; r++) {
            __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + r * ns + g)));
            _mm256_storeu_ps(sc[r], _mm256_mul_ps(dv, xdv));
            if (fmt == FMT_Q4) {
                __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + r * ns + g)));
                macc[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + g), macc[r]);
            }
        }
        if (fmt == FMT_Q4) {  /* two blocks per step (activations in the paired order) */
            int j = 0;
            for (; j + 1 < n8; j += 2) {
                int64_t b = g + j;
                __m256i alo = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
                __m256i ahi = _mm256_loadu_si256((const __m256i *)(xq + b * QK + QK));
                const __m256i idx = _mm256_setr_epi32(j, j, j, j, j + 1, j + 1, j + 1, j + 1);
                if (PF && (j & 3) == 0)
                    for (int r = 0; r < R; r++) _mm_prefetch((const char *)(qs + (PFD * R + r) * row_bytes + b * (QK / 2)), _MM_HINT_T0);
                for (int r = 0; r < R; r++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + r * row_bytes + b * (QK / 2)));
                    __m256i lo = _mm256_and_si256(raw, low4), hn = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                    __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo), _mm256_maddubs_epi16(hn, ahi));
                    __m256i isum;
                    if (hi) {
                        __m256i blo = _mm256_loadu_si256((const __m256i *)(xq2 + b * QK));
                        __m256i bhi = _mm256_loadu_si256((const __m256i *)(xq2 + b * QK + QK));
                        __m256i p2 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, blo), _mm256_maddubs_epi16(hn, bhi));
                        isum = _mm256_add_epi32(_mm256_madd_epi16(p, k254), _mm256_madd_epi16(p2, ones));
                    } else {
                        isum = _mm256_madd_epi16(p, ones);
                    }
                    __m256 scv = _mm256_permutevar8x32_ps(_mm256_loadu_ps(sc[r]), idx);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scv, acc[r]);
                }
            }
            if (j < n8) {  /* the row's last block, alone (natural order) */
                int64_t b = g + j;
                __m256i a = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
                for (int r = 0; r < R; r++) {
                    __m128i raw = _mm_loadu_si128((const __m128i *)(qs + r * row_bytes + b * (QK / 2)));
                    __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
                    __m256i isum = _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), hi ? k254 : ones);
                    if (hi)
                        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(
                            w, _mm256_loadu_si256((const __m256i *)(xq2 + b * QK))), ones));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_broadcast_ss(&sc[r][j]), acc[r]);
                }
            }
            continue;
        }
        for (int j = 0; j < n8; j++) {
            int64_t b = g + j;
            __m256i a = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
            if (PF && (j & 1) == 0)  /* the next rows' codes, a group ahead: one line per row per 64 bytes */
                for (int r = 0; r < R; r++)
                    _mm_prefetch((const char *)(qs + (PFD * R + r) * row_bytes + b * (fmt == FMT_Q8 ? QK : QK / 2)), _MM_HINT_T0);
            __m256i a2 = hi ? _mm256_loadu_si256((const __m256i *)(xq2 + b * QK)) : a;
            for (int r = 0; r < R; r++) {
                __m256i p, p2 = ones;
                if (fmt == FMT_Q8) {
                    __m256i w = _mm256_loadu_si256((const __m256i *)(qs + r * row_bytes + b * QK));
                    __m256i aw = _mm256_sign_epi8(w, w);
                    p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(a, w));
                    if (hi) p2 = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(a2, w));
                } else {
                    __m128i raw = _mm_loadu_si128((const __m128i *)(qs + r * row_bytes + b * (QK / 2)));
                    __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
                    p = _mm256_maddubs_epi16(w, a);
                    if (hi) p2 = _mm256_maddubs_epi16(w, a2);
                }
                __m256i isum = _mm256_madd_epi16(p, hi ? k254 : ones);
                if (hi) isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p2, ones));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_broadcast_ss(&sc[r][j]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]) + (fmt == FMT_Q4 ? hsum8(macc[r]) : 0.0f);
}

AVX2_FN static void dot_avx2(int fmt, int64_t nb, int64_t row_bytes, const int8_t *qs, const uint16_t *wd,
                             const uint16_t *wm, int R, const int8_t *xq, const int8_t *xq2, const float *xd,
                             const float *xs, float *out) {
#define ROWS(F, HI)                                                                                          \
    do {                                                                                                     \
        if (R == 4) { dot_rows_avx2(F, 4, HI, nb, row_bytes, qs, wd, wm, xq, xq2, xd, xs, out); return; }    \
        for (int r = 0; r < R; r++)                                                                          \
            dot_rows_avx2(F, 1, HI, nb, row_bytes, qs + r * row_bytes, wd + r * SPAD(nb),                    \
                          F == FMT_Q4 ? wm + r * SPAD(nb) : NULL, xq, xq2, xd, xs, out + r);                  \
        return;                                                                                              \
    } while (0)
    if (fmt == FMT_Q8) {
        if (xq2) ROWS(FMT_Q8, 1);
        ROWS(FMT_Q8, 0);
    }
    if (xq2) ROWS(FMT_Q4, 1);
    ROWS(FMT_Q4, 0);
#undef ROWS
}

/* ---- AVX-512 VNNI: several activation rows per pass over the weights ---------------------------
 * A batched decode step multiplies the same weights with a few activation rows (one per request).
 * Here a tile of R weight rows meets T activation rows. Each activation row comes as 16-bit values
 * x16 = 254 q + q2 (its int8 code and rounding rest, see quantize_act; q alone with 8-bit activations),
 * laid out per 32 values as their 16 even-indexed values then their 16 odd ones (widen16), and the weight
 * codes are widened to int16 pairs to match, once per tile. VPMADDWD + VPDPWSSD give each 32-bit lane 4
 * (q8) or 8 (q4) products as one integer (no product or sum overflows: |w| <= 127, |x16| <= 32385); each
 * block's lanes are then summed across, the R rows' sums side by side (two unpack-and-add rounds), into
 * the block's exact integer sum per row: 254 sum(w q) + sum(w q2). The float part is the AMX tiles' (see
 * there): per output one chain over the blocks, acc = fma(S_b, d_b x_b, acc), q4's minimum in a second,
 * macc = fma(m_b, s_b, macc), and out = acc + macc; so a row's result is bit for bit the same alone, in
 * a tile of any size, or on the tiles. Against the AVX2 kernel (its own order, float rounding apart) a
 * row takes half the integer instructions and a quarter of the float ones; 256-bit vectors,
 * EVEX-encoded (32 registers). */
#define VNNI_FN __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
#ifndef MAXT
#define MAXT 4
#endif

VNNI_FN static inline __m256i sum4x2(__m256i i0, __m256i i1, __m256i i2, __m256i i3) {
    /* per 128-bit half (one block): [sum of i0's four lanes, i1's, i2's, i3's] */
    __m256i a = _mm256_add_epi32(_mm256_unpacklo_epi32(i0, i1), _mm256_unpackhi_epi32(i0, i1));
    __m256i b = _mm256_add_epi32(_mm256_unpacklo_epi32(i2, i3), _mm256_unpackhi_epi32(i2, i3));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
}

VNNI_FN static inline __m128i sum4x1(__m256i i0, __m256i i1, __m256i i2, __m256i i3) {
    /* one block in eight lanes each: [sum of i0's eight lanes, i1's, i2's, i3's] */
    __m256i h = sum4x2(i0, i1, i2, i3);
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* 4 rows' fp16 scales of blocks g..g+7 as floats, [block][row] (rows past R: zero) */
VNNI_FN static inline void scales_by_block(const uint16_t *s, int64_t ns, int R, int64_t g, float out[8][4]) {
    __m256 r[4];
    for (int i = 0; i < 4; i++)
        r[i] = i < R ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i * ns + g))) : _mm256_setzero_ps();
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 u[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE), _mm256_shuffle_ps(t1, t3, 0x44),
                   _mm256_shuffle_ps(t1, t3, 0xEE)};
    for (int j = 0; j < 4; j++) {  /* u[j]: block j (low half), block j + 4 (high half) */
        _mm_storeu_ps(out[j], _mm256_castps256_ps128(u[j]));
        _mm_storeu_ps(out[j + 4], _mm256_extractf128_ps(u[j], 1));
    }
}

VNNI_FN static inline __attribute__((always_inline)) void
tile16b_t(const int fmt, const int R, const int T, int64_t nb, int64_t row_bytes, const int8_t *qs,
          const uint16_t *wd, const uint16_t *wm, const int16_t *x16, int64_t xstride, const float *xd,
          const float *xs, int64_t sstride, float *out) {
    const __m256i nib2 = _mm256_set1_epi32(0x000F000F), byte2 = _mm256_set1_epi16(0x00FF), low4 = _mm256_set1_epi8(0x0F);
    const __m256i zero = _mm256_setzero_si256();
    const int64_t ns = SPAD(nb);
    __m128 acc[MAXT], macc[MAXT];
    __m256i is[MAXT][4];  /* a step's integer lanes per activation and weight row (rows past R: zero) */
    for (int t = 0; t < T; t++) {
        acc[t] = macc[t] = _mm_setzero_ps();
        for (int r = R; r < 4; r++) is[t][r] = zero;
    }
    for (int64_t g = 0; g < nb; g += 8) {
        int n8 = nb - g < 8 ? (int)(nb - g) : 8;
        float dT[8][4], mT[8][4];
        scales_by_block(wd, ns, R, g, dT);
        if (fmt == FMT_Q4) scales_by_block(wm, ns, R, g, mT);
#define SC(t, j) _mm_mul_ps(_mm_loadu_ps(dT[j]), _mm_set1_ps(xd[(t) * sstride + g + (j)]))
#define MIN(t, j)                                                                                                \
    if (fmt == FMT_Q4) macc[t] = _mm_fmadd_ps(_mm_loadu_ps(mT[j]), _mm_set1_ps(xs[(t) * sstride + g + (j)]), macc[t])
        if (fmt == FMT_Q4) {  /* two blocks per step (activations in the paired order) */
            int j = 0;
            for (; j + 1 < n8; j += 2) {
                int64_t b = g + j;
                if (PF && (j & 3) == 0)
                    for (int r = 0; r < R; r++) _mm_prefetch((const char *)(qs + (PFD * R + r) * row_bytes + b * (QK / 2)), _MM_HINT_T0);
                for (int r = 0; r < R; r++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + r * row_bytes + b * (QK / 2)));
                    __m256i w1 = _mm256_and_si256(raw, nib2), w2 = _mm256_and_si256(_mm256_srli_epi32(raw, 8), nib2);
                    __m256i w3 = _mm256_and_si256(_mm256_srli_epi32(raw, 4), nib2);
                    __m256i w4 = _mm256_and_si256(_mm256_srli_epi32(raw, 12), nib2);
                    for (int t = 0; t < T; t++) {
                        const __m256i *a = (const __m256i *)(x16 + t * xstride + b * QK);
                        __m256i isum = _mm256_madd_epi16(w1, _mm256_loadu_si256(a));
                        isum = _mm256_dpwssd_epi32(isum, w2, _mm256_loadu_si256(a + 1));
                        isum = _mm256_dpwssd_epi32(isum, w3, _mm256_loadu_si256(a + 2));
                        is[t][r] = _mm256_dpwssd_epi32(isum, w4, _mm256_loadu_si256(a + 3));
                    }
                }
                for (int t = 0; t < T; t++) {
                    __m256 f = _mm256_cvtepi32_ps(sum4x2(is[t][0], is[t][1], is[t][2], is[t][3]));
                    acc[t] = _mm_fmadd_ps(_mm256_castps256_ps128(f), SC(t, j), acc[t]);
                    MIN(t, j);
                    acc[t] = _mm_fmadd_ps(_mm256_extractf128_ps(f, 1), SC(t, j + 1), acc[t]);
                    MIN(t, j + 1);
                }
            }
            if (j < n8) {  /* the row's last block, alone (natural order) */
                int64_t b = g + j;
                for (int r = 0; r < R; r++) {
                    __m128i raw = _mm_loadu_si128((const __m128i *)(qs + r * row_bytes + b * (QK / 2)));
                    __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
                    __m256i w1 = _mm256_and_si256(w, byte2), w2 = _mm256_srli_epi16(w, 8);
                    for (int t = 0; t < T; t++) {
                        const __m256i *a = (const __m256i *)(x16 + t * xstride + b * QK);
                        is[t][r] = _mm256_dpwssd_epi32(_mm256_madd_epi16(w1, _mm256_loadu_si256(a)), w2,
                                                       _mm256_loadu_si256(a + 1));
                    }
                }
                for (int t = 0; t < T; t++) {
                    __m128 f = _mm_cvtepi32_ps(sum4x1(is[t][0], is[t][1], is[t][2], is[t][3]));
                    acc[t] = _mm_fmadd_ps(f, SC(t, j), acc[t]);
                    MIN(t, j);
                }
            }
            continue;
        }
        for (int j = 0; j < n8; j++) {  /* q8: the codes' even and odd bytes, sign-extended */
            int64_t b = g + j;
            if (PF && (j & 1) == 0)
                for (int r = 0; r < R; r++) _mm_prefetch((const char *)(qs + (PFD * R + r) * row_bytes + b * QK), _MM_HINT_T0);
            for (int r = 0; r < R; r++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(qs + r * row_bytes + b * QK));
                __m256i we = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8), wo = _mm256_srai_epi16(w, 8);
                for (int t = 0; t < T; t++) {
                    const __m256i *a = (const __m256i *)(x16 + t * xstride + b * QK);
                    is[t][r] = _mm256_dpwssd_epi32(_mm256_madd_epi16(we, _mm256_loadu_si256(a)), wo,
                                                   _mm256_loadu_si256(a + 1));
                }
            }
            for (int t = 0; t < T; t++) {
                __m128 f = _mm_cvtepi32_ps(sum4x1(is[t][0], is[t][1], is[t][2], is[t][3]));
                acc[t] = _mm_fmadd_ps(f, SC(t, j), acc[t]);
            }
        }
#undef SC
#undef MIN
    }
    for (int t = 0; t < T; t++) {
        float o[4];
        _mm_storeu_ps(o, fmt == FMT_Q4 ? _mm_add_ps(acc[t], macc[t]) : acc[t]);
        for (int r = 0; r < R; r++) out[t * MAXR + r] = o[r];
    }
}

/* out[t * MAXR + r]: weight row r (r < R) with activation row t (t < T) */
VNNI_FN static void tile16b_vnni(int fmt, int64_t nb, int64_t row_bytes, const int8_t *qs, const uint16_t *wd,
                                 const uint16_t *wm, int R, int T, const int16_t *x16, int64_t xstride,
                                 const float *xd, const float *xs, int64_t sstride, float *out) {
#define TILE_R(F, TT)                                                                                          \
    do {                                                                                                       \
        if (R == MAXR) tile16b_t(F, MAXR, TT, nb, row_bytes, qs, wd, wm, x16, xstride, xd, xs, sstride, out);  \
        else if (R == 3) tile16b_t(F, 3, TT, nb, row_bytes, qs, wd, wm, x16, xstride, xd, xs, sstride, out);   \
        else if (R == 2) tile16b_t(F, 2, TT, nb, row_bytes, qs, wd, wm, x16, xstride, xd, xs, sstride, out);   \
        else tile16b_t(F, 1, TT, nb, row_bytes, qs, wd, wm, x16, xstride, xd, xs, sstride, out);               \
        return;                                                                                                \
    } while (0)
#define TILE_TT(F)                                                                                             \
    do {                                                                                                       \
        switch (T) {                                                                                           \
        case 1: TILE_R(F, 1);                                                                                  \
        case 2: TILE_R(F, MAXT >= 2 ? 2 : 1);                                                                  \
        case 3: TILE_R(F, MAXT >= 3 ? 3 : 1);                                                                  \
        default: TILE_R(F, MAXT);                                                                              \
        }                                                                                                      \
    } while (0)
    if (fmt == FMT_Q8) TILE_TT(FMT_Q8);
    TILE_TT(FMT_Q4);
#undef TILE_TT
#undef TILE_R
}

/* ---- AMX: 16 weight rows with up to 16 activation rows per tile operation -------------------------
 * Sapphire Rapids and later multiply int8 tiles: C[t][r] += sum_k A[t][k] B[k/4][4r + k%4], A the
 * activation codes (rows of one block's 32 values, read in place: natural order), B one block of
 * 16 weight rows, four values of a row per 32-bit column. B comes from the weight's tile copy (tile_pack:
 * per 16 rows and block, the packed bytes in B's column order, and the 16 rows' scales side by side), so
 * a block is a few sequential loads (q4: split into nibbles on the way). TDPBSUD (q4: codes 0..15) or
 * TDPBSSD (q8) gives each (t, r) its block's exact integer sum, once for the codes and, with 16-bit
 * activations, once for their rests (254 sum(w q) + sum(w q2), formed in float with one rounding, none
 * for q4's sums). The float part is the VNNI kernel's, in its order (see tile16b_t): per output, one
 * chain over the blocks, acc = fma(S_b, d_b x_b, acc), for q4 a second chain for the minimum,
 * macc = fma(m_b, s_b, macc), and out = acc + macc. A row's result is the same alone, with any other
 * rows, or on the VNNI kernel.
 * With 16-bit activations each row's rests are quantized right after its codes (act_at: row t's codes,
 * then its rests, then row t + 1's), so one A tile of 2T rows holds T rows' codes and rests, and one
 * product gives both sums; the rows go in chunks of AMX_PAIRS.
 * What a tile operation costs is mostly waiting: the unpacked weights are stored, then loaded as a tile;
 * the sums are stored from a tile, then loaded into vectors. So the blocks go AMX_NB at a time, each
 * phase over all of them (unpack, tile products, float part), two blocks' products at a time on tiles
 * of their own, and a load never waits on the store just before it.
 * Products of AMX_MIN_ROWS rows or more (by default all of them) run on the tiles where the weight has its
 * tile copy: with the copy prefetched (AMX_PREFETCH) the tiles are ahead from one row on. */
#define AMX_FN __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,amx-tile,amx-int8")))
#define AMX_PAIRS 8 /* rows per chunk with 16-bit activations: codes and rests, 2 x 8 tile rows */

typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* tmm0, tmm1: C (A's rows x 16 int32); tmm2, tmm3: A (rows x 32 bytes); tmm4, tmm5: B; the two sets
 * take alternate blocks. A's rows: T, or 2T with the rests (`pairs`). */
AMX_FN static void amx_config(int T, int pairs) {
    tilecfg_t c __attribute__((aligned(64)));
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = c.rows[1] = c.rows[2] = c.rows[3] = (uint8_t)(pairs ? 2 * T : T);
    c.colsb[0] = c.colsb[1] = 64;
    c.colsb[2] = c.colsb[3] = QK;
    c.rows[4] = c.rows[5] = QK / 4;
    c.colsb[4] = c.colsb[5] = 64;
    __asm__ volatile("" : : "r"(&c) : "memory");  /* GCC 12 drops the stores before ldtilecfg otherwise */
    _tile_loadconfig(&c);
}

/* Where the float part keeps row i's sums (its codes' chain at i, q4's minimum at rows + i): in the
 * second KB of each 2 KB from a 2 KB boundary, while the tiles store into the first KB of each 2 KB of
 * the (2 KB-aligned) cb. A load that shares its address's low 12 bits with a store still in flight waits
 * for it (4K aliasing): where the sums met the tile stores, 3-8 row products on 2 threads took up to
 * 1.45x the time. */
#define AMX_SUM(base, i) ((__m512 *)((char *)(base) + ((i) >> 4) * 2048 + 1024) + ((i) & 15))
/* the bytes of sums for `vectors` of them (the place they start from is 2 KB-aligned) */
static size_t amx_sum_span(int64_t vectors) { return (size_t)((vectors + 15) / 16) * 2048; }

/* How M rows go on the tiles: `chunks` chunks of T rows (the last one padded), as few as A's 16 tile rows
 * allow (AMX_PAIRS rows with their rests), so every chunk meets each block of the weights in one pass. */
static int amx_chunks(int64_t M, int pairs, int64_t *chunks) {
    const int64_t most = pairs ? AMX_PAIRS : AMX_ROWS, n = (M + most - 1) / most;
    *chunks = n;
    return (int)((M + n - 1) / n);
}

/* 16 weight rows (the R <= 16 of them that exist give outputs; qt, dt, mt: their group in the tile copy)
 * with `chunks` x T activation rows, the first `live` of them real (the others pad the last chunk: their
 * outputs are not stored), T <= 16 (codes xq; with `pairs`, T <= AMX_PAIRS, each row's codes
 * then its rests, so row t's codes at xq + 2 t xstride; else row t at xq + t xstride; scales and sums
 * at xd, xs + t * sstride), each block of the weights unpacked once for all of them: y[t * ystride + r]
 * set (or added to, acc_y). The tile configuration for T must be loaded (amx_config). `sums`: 2 KB-aligned,
 * amx_sum_span(2 T chunks) bytes, used where the rows' sums do not fit beside the tiles' (T chunks > 8). */
#define AMX_NB 6
/* How far ahead (bytes of the tile copy; its scales: an eighth of that) the next blocks are fetched: the
 * copy is one sequential stream per thread (groups follow each other), and without this a step on the
 * tiles waited on memory (the default model's one-row step 6.9 ms against the VNNI kernel's 6.3; with
 * it 4.9; 1,536-3,072 bytes all did as well). */
#define AMX_PREFETCH 2048
AMX_FN static void tile_amx(int fmt, int64_t nb, const int8_t *qt, const uint16_t *dt, const uint16_t *mt, int R,
                            int T, int chunks, int live, int pairs, const int8_t *xq, int64_t xstride,
                            const float *xd, const float *xs, int64_t sstride, float *y, int64_t ystride, int acc_y,
                            char *sums) {
    const int rows = T * chunks;
    const int64_t tb = tile_bytes(fmt);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512 k254 = _mm512_set1_ps(254.0f);
    int8_t bt[AMX_NB][QK / 4][64] __attribute__((aligned(64)));
    int32_t cb[2 * AMX_NB][2][AMX_ROWS][AMX_ROWS] __attribute__((aligned(2048)));  /* [chunk x block][first KB: C] */
    char *sb = 2 * rows <= AMX_ROWS ? (char *)cb : sums;  /* the sums' place (AMX_SUM) */
    __m512 ds[AMX_NB], ms[AMX_NB];
    for (int t = 0; t < rows; t++) *AMX_SUM(sb, t) = *AMX_SUM(sb, rows + t) = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += AMX_NB) {
        const int nj = nb - b0 < AMX_NB ? (int)(nb - b0) : AMX_NB;
        for (int j = 0; j < nj; j++) {  /* the blocks' scales; q4: the blocks split into nibbles */
            const int64_t b = b0 + j;
            for (int64_t o = 0; o < tb; o += 64)
                _mm_prefetch((const char *)(qt + b * tb + o + AMX_PREFETCH), _MM_HINT_T0);
            if ((b & 1) == 0) {
                _mm_prefetch((const char *)(dt + b * AMX_ROWS) + AMX_PREFETCH / 8, _MM_HINT_T0);
                if (mt) _mm_prefetch((const char *)(mt + b * AMX_ROWS) + AMX_PREFETCH / 8, _MM_HINT_T0);
            }
            ds[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dt + b * AMX_ROWS)));
            if (fmt == FMT_Q4) {  /* byte j: value j (low nibble) and j + 16 (high) */
                ms[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mt + b * AMX_ROWS)));
                for (int k = 0; k < 4; k++) {
                    __m512i p = _mm512_loadu_si512((const void *)(qt + (b * 4 + k) * 64));
                    _mm512_store_si512((void *)bt[j][k], _mm512_and_si512(p, low4));
                    _mm512_store_si512((void *)bt[j][k + 4], _mm512_and_si512(_mm512_srli_epi16(p, 4), low4));
                }
            }
        }
        for (int c = 0; c < chunks; c += 2) {
            /* two chunks: block by block, both chunks' products from one B (alternate B tiles); one chunk: two
             * blocks at a time. Either way two chains of tile operations are in flight. */
            const int both = c + 1 < chunks;
            const int64_t t0 = (int64_t)c * T, cstride = (int64_t)T * (pairs ? 2 : 1) * xstride;
            const int8_t *xa = xq + t0 * (pairs ? 2 : 1) * xstride + b0 * QK;
#define AMX_B(j) (fmt == FMT_Q4 ? (const void *)bt[j] : (const void *)(qt + (b0 + (j)) * QK / 4 * 64))
#define AMX_DP(C, A, B) do { if (fmt == FMT_Q4) _tile_dpbsud(C, A, B); else _tile_dpbssd(C, A, B); } while (0)
#define AMX_BOTH(j, B)                                                                                        \
    do {                                                                                                      \
        _tile_loadd(B, AMX_B(j), 64);                                                                         \
        _tile_loadd(2, xa + (j) * QK, xstride);                                                               \
        _tile_loadd(3, xa + cstride + (j) * QK, xstride);                                                     \
        _tile_zero(0);                                                                                        \
        _tile_zero(1);                                                                                        \
        AMX_DP(0, 2, B);                                                                                      \
        AMX_DP(1, 3, B);                                                                                      \
        _tile_stored(0, cb[j][0], 64);                                                                        \
        _tile_stored(1, cb[AMX_NB + (j)][0], 64);                                                             \
    } while (0)
            for (int j = 0; both && j < nj; j += 2) {
                AMX_BOTH(j, 4);
                if (j + 1 < nj) AMX_BOTH(j + 1, 5);
            }
            for (int j = 0; !both && j < nj; j += 2) {
                const int two = j + 1 < nj;
                _tile_loadd(4, AMX_B(j), 64);
                _tile_loadd(2, xa + j * QK, xstride);
                _tile_zero(0);
                if (two) {
                    _tile_loadd(5, AMX_B(j + 1), 64);
                    _tile_loadd(3, xa + (j + 1) * QK, xstride);
                    _tile_zero(1);
                }
                AMX_DP(0, 2, 4);
                if (two) AMX_DP(1, 3, 5);
                _tile_stored(0, cb[j][0], 64);
                if (two) _tile_stored(1, cb[j + 1][0], 64);
            }
#undef AMX_BOTH
#undef AMX_DP
#undef AMX_B
            for (int t = 0; t < (both ? 2 * T : T); t++) {  /* the float part, row by row over the blocks */
                const int64_t row = t0 + t;
                const int tt = t < T ? t : t - T, jc = t < T ? 0 : AMX_NB;  /* its row in its chunk's sums */
                const float *xdr = xd + row * sstride + b0, *xsr = xs + row * sstride + b0;
                __m512 a = *AMX_SUM(sb, row), ma = *AMX_SUM(sb, rows + row);
                for (int j = 0; j < nj; j++) {
                    const int32_t(*C)[AMX_ROWS] = cb[jc + j][0];
                    __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)C[pairs ? 2 * tt : tt]));
                    if (pairs) s = _mm512_fmadd_ps(s, k254, _mm512_cvtepi32_ps(_mm512_load_si512((const void *)C[2 * tt + 1])));
                    a = _mm512_fmadd_ps(s, _mm512_mul_ps(ds[j], _mm512_set1_ps(xdr[j])), a);
                    if (fmt == FMT_Q4) ma = _mm512_fmadd_ps(ms[j], _mm512_set1_ps(xsr[j]), ma);
                }
                *AMX_SUM(sb, row) = a;
                *AMX_SUM(sb, rows + row) = ma;
            }
        }
    }
    const __mmask16 keep = (__mmask16)((1u << R) - 1);
    for (int t = 0; t < live; t++) {
        __m512 out = fmt == FMT_Q4 ? _mm512_add_ps(*AMX_SUM(sb, t), *AMX_SUM(sb, rows + t)) : *AMX_SUM(sb, t);
        if (acc_y) out = _mm512_add_ps(_mm512_maskz_loadu_ps(keep, y + t * ystride), out);
        _mm512_mask_storeu_ps(y + t * ystride, keep, out);
    }
}

AMX_FN static void amx_release(void) { _tile_release(); }

/* The CPU has AMX-TILE and AMX-INT8 (cpuid 7.0 EDX bits 24, 25) besides the AVX-512 the epilogue uses, and
 * the kernel lets this process use the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+). */
static int has_vnni(void);
static int has_amx(void) {
    static int known = -1;
    if (known >= 0) return known;
    unsigned a, b, c, d;
    known = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1) && has_vnni()
        && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
#ifdef SYS_arch_prctl
        known = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#endif
    }
    return known;
}
static int USE_AMX = 0;
/* Products of this many rows per lane or more run on the tiles; fewer, the VNNI kernel in the tiles' float
 * order (tile16b_vnni), which gives every row bit for bit the same result: the threshold is speed alone
 * (with the tile copy prefetched, a decode step of the default model is faster on the tiles from one row
 * on: 5.7 against 6.1 ms for one request, 15.4 against 20.8 for eight). */
static int AMX_MIN_ROWS = 1;
#endif

typedef void (*dot_fn)(int, int64_t, int64_t, const int8_t *, const uint16_t *, const uint16_t *, int,
                       const int8_t *, const int8_t *, const float *, const float *, float *);
static dot_fn DOT = dot_generic;
static const char *KERNEL = "generic";

/* A tile: R weight rows with T activation rows (T <= MAXT; rows t at xq + t * xstride, their scales at
 * xd + t * sstride), out[t * MAXR + r]: a row at a time with DOT, or (TILE16, the VNNI kernel) in one
 * pass over the weights from the rows' widened values. */
#ifndef MAXT
#define MAXT 4
#endif
typedef void (*tile16_fn)(int, int64_t, int64_t, const int8_t *, const uint16_t *, const uint16_t *, int, int,
                          const int16_t *, int64_t, const float *, const float *, int64_t, float *);
static tile16_fn TILE16 = NULL;

static void tile_rows(int fmt, int64_t nb, int64_t row_bytes, const int8_t *qs, const uint16_t *wd,
                      const uint16_t *wm, int R, int T, const int8_t *xq, const int8_t *xq2, int64_t xstride,
                      const float *xd, const float *xs, int64_t sstride, float *out) {
    for (int t = 0; t < T; t++)
        DOT(fmt, nb, row_bytes, qs, wd, wm, R, xq + t * xstride, xq2 ? xq2 + t * xstride : NULL, xd + t * sstride,
            xs + t * sstride, out + t * MAXR);
}
static int ACT_BITS = 16;  /* activations: 8 (int8 blocks) or 16 (int8 blocks plus their rounding rest) */
/* 16 bits for every product the integer kernels run: decode steps, batches and verifies, and prompt chunks
 * shorter than Python's `gemm_min_rows` (longer ones run as float GEMMs on unpack()ed weights). With int8
 * alone a 17-55-token chunk's logits moved by up to 0.65 from float (16 bits: 0.004), and on the VNNI
 * kernel the rest costs nothing there (one VPDPWSSD lane takes both codes). */

/* ---- Python entry points (pointers and sizes as ints; the torch side owns every buffer) ----- */

static int args_i64(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, int64_t *out) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* pack(fmt, rows, K, Kp, src, qs, d, m): float32 [rows, K] -> packed rows */
static PyObject *py_pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[8];
    if (args_i64(args, nargs, 8, a) < 0) return NULL;
    int fmt = (int)a[0];
    int64_t rows = a[1], K = a[2], Kp = a[3], nb = Kp / QK;
    const float *src = (const float *)(intptr_t)a[4];
    int8_t *qs = (int8_t *)(intptr_t)a[5];
    uint16_t *d = (uint16_t *)(intptr_t)a[6], *m = (uint16_t *)(intptr_t)a[7];
    int64_t row_bytes = fmt == FMT_Q8 ? Kp : Kp / 2;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows; n++)
        pack_row(fmt, src + n * K, K, Kp, qs + n * row_bytes, d + n * SPAD(nb), fmt == FMT_Q4 ? m + n * SPAD(nb) : NULL);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* The tile copy of a packed weight (the AMX tiles' B operands): rows in groups of 16 (per lane; rows past
 * the lane's last are zeros), and per group and block, the block's bytes as B's columns read them: piece
 * k (bytes 4k..4k+3 of each row's block; q4: 16 bytes a row, q8: 32) is 64 bytes, four of each of the 16
 * rows; then the 16 rows' scales (and q4's minimums) of each block side by side.
 * tile_pack(fmt, L, N, Kp, qs, d, m, qt, dt, mt): qt int8 [L, G, nb, tile_bytes], dt/mt fp16 [L, G, nb, 16],
 * G = ceil(N / 16) */
static PyObject *py_tile_pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[10];
    if (args_i64(args, nargs, 10, a) < 0) return NULL;
    int fmt = (int)a[0];
    int64_t L = a[1], N = a[2], Kp = a[3], nb = Kp / QK, G = (N + AMX_ROWS - 1) / AMX_ROWS, tb = tile_bytes(fmt);
    const int8_t *qs = (const int8_t *)(intptr_t)a[4];
    const uint16_t *d = (const uint16_t *)(intptr_t)a[5], *m = (const uint16_t *)(intptr_t)a[6];
    int8_t *qt = (int8_t *)(intptr_t)a[7];
    uint16_t *dt = (uint16_t *)(intptr_t)a[8], *mt = (uint16_t *)(intptr_t)a[9];
    int64_t row_bytes = fmt == FMT_Q8 ? Kp : Kp / 2, bb = tb / AMX_ROWS, ns = SPAD(nb);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static)
    for (int64_t lg = 0; lg < L * G; lg++) {
        int64_t l = lg / G, g = lg % G;
        for (int64_t b = 0; b < nb; b++) {
            int8_t *out = qt + (lg * nb + b) * tb;
            uint16_t *od = dt + (lg * nb + b) * AMX_ROWS, *om = fmt == FMT_Q4 ? mt + (lg * nb + b) * AMX_ROWS : NULL;
            for (int r = 0; r < AMX_ROWS; r++) {
                int64_t n = g * AMX_ROWS + r;
                const int8_t *src = n < N ? qs + (l * N + n) * row_bytes + b * bb : NULL;
                for (int64_t c = 0; c < bb; c++) out[(c / 4) * 64 + r * 4 + c % 4] = src ? src[c] : 0;
                od[r] = n < N ? d[(l * N + n) * ns + b] : 0;
                if (om) om[r] = n < N ? m[(l * N + n) * ns + b] : 0;
            }
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* top2(x, rows, V, idx, val): per row of x float32 [rows, V] its largest value and the next largest, with
 * their indices (ties: the lower index first, as torch.argmax takes the first maximum; NaNs are passed
 * over) -> idx int64 [rows, 2], val float32 [rows, 2] (-inf and index -1 where a row has fewer values).
 * A greedy pick reads it instead of torch's argmax, which takes ~0.2 ms over a 49,152-entry row here. */
#ifdef LP_X86
/* The largest entry of row[0..V) other than index `skip` (NaNs passed over), and the first index other than
 * `skip` that holds it (-1: none), 16 lanes at a time. */
__attribute__((target("avx512f"))) static int64_t top1_avx512(const float *row, int64_t V, int64_t skip) {
    const int64_t n16 = V / 16 * 16;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n16; i += 16) {
        __m512 v = _mm512_loadu_ps(row + i);
        __mmask16 ok = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
        if (skip >= i && skip < i + 16) ok &= (__mmask16)~(1u << (skip - i));
        mx = _mm512_mask_max_ps(mx, ok, mx, v);
    }
    float best = _mm512_reduce_max_ps(mx);
    for (int64_t i = n16; i < V; i++)
        if (i != skip && row[i] > best) best = row[i];
    const __m512 b = _mm512_set1_ps(best);
    for (int64_t i = 0; i < n16; i += 16) {
        __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), b, _CMP_EQ_OQ);
        if (skip >= i && skip < i + 16) eq &= (__mmask16)~(1u << (skip - i));
        if (eq) return i + __builtin_ctz(eq);
    }
    for (int64_t i = n16; i < V; i++)
        if (i != skip && row[i] == best) return i;
    return -1;
}
#endif

/* top2(x, rows, V, idx, val): each row's largest entry and the largest of the others, the lower index first
 * on ties, NaNs passed over (-1 and -inf where a row has fewer than two numbers). With AVX-512 (the VNNI and
 * AMX kernels) in two passes of 16 lanes each, ~5x the scalar loop's speed on the default model's 49,152
 * logits; the same indices and values either way. */
static PyObject *py_top2(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[5];
    if (args_i64(args, nargs, 5, a) < 0) return NULL;
    const float *x = (const float *)(intptr_t)a[0];
    int64_t rows = a[1], V = a[2], *idx = (int64_t *)(intptr_t)a[3];
    float *val = (float *)(intptr_t)a[4];
    Py_BEGIN_ALLOW_THREADS
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * V;
#ifdef LP_X86
        if (TILE16) {
            int64_t i1 = top1_avx512(row, V, -1), i2 = i1 < 0 ? -1 : top1_avx512(row, V, i1);
            idx[2 * r] = i1, idx[2 * r + 1] = i2;
            val[2 * r] = i1 < 0 ? -INFINITY : row[i1], val[2 * r + 1] = i2 < 0 ? -INFINITY : row[i2];
            continue;
        }
#endif
        float b1 = -INFINITY, b2 = -INFINITY;
        int64_t i1 = -1, i2 = -1;
        for (int64_t i = 0; i < V; i++) {
            float v = row[i];
            if (v > b2 || (i2 < 0 && v == b2)) {
                if (v > b1 || (i1 < 0 && v == b1)) {
                    b2 = b1, i2 = i1;
                    b1 = v, i1 = i;
                } else {
                    b2 = v, i2 = i;
                }
            }
        }
        idx[2 * r] = i1, idx[2 * r + 1] = i2;
        val[2 * r] = b1, val[2 * r + 1] = b2;
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* unpack(fmt, rows, K, Kp, qs, d, m, dst): packed rows -> float32 [rows, K], the codes times their
 * scales (plus the minimum for q4), exactly as PackedWeight.dequantize() computes them. Long products
 * (prompt chunks) run as a float GEMM on the unpacked weight: there the arithmetic, not the bytes,
 * sets the time, and the float GEMM does it faster than integer dot products, with no activation
 * quantization at all. */
static PyObject *py_unpack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[8];
    if (args_i64(args, nargs, 8, a) < 0) return NULL;
    int fmt = (int)a[0];
    int64_t rows = a[1], K = a[2], Kp = a[3], nb = Kp / QK;
    const int8_t *qs = (const int8_t *)(intptr_t)a[4];
    const uint16_t *d = (const uint16_t *)(intptr_t)a[5], *m = (const uint16_t *)(intptr_t)a[6];
    float *dst = (float *)(intptr_t)a[7];
    int64_t row_bytes = fmt == FMT_Q8 ? Kp : Kp / 2;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows; n++) {
        const int8_t *q = qs + n * row_bytes;
        const uint16_t *rd = d + n * SPAD(nb), *rm = fmt == FMT_Q4 ? m + n * SPAD(nb) : NULL;
        float *out = dst + n * K;
        for (int64_t b = 0; b < nb; b++) {
            float df = h2f(rd[b]), mf = rm ? h2f(rm[b]) : 0.0f, v[QK];
            if (fmt == FMT_Q8) {
                for (int j = 0; j < QK; j++) v[j] = df * (float)q[b * QK + j];
            } else {
                const uint8_t *p = (const uint8_t *)q + b * (QK / 2);
                for (int j = 0; j < QK / 2; j++) {
                    v[j] = df * (float)(p[j] & 15) + mf;
                    v[j + QK / 2] = df * (float)(p[j] >> 4) + mf;
                }
            }
            int64_t take = K - b * QK < QK ? K - b * QK : QK;
            memcpy(out + b * QK, v, sizeof(float) * (size_t)take);
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* What linear() does to each input row before quantizing it. */
enum { PRE_NONE = 0, PRE_RMSNORM = 1, PRE_SWIGLU = 2 };

/* silu(gate) * up of one value, as every SwiGLU loop takes the values it does not vectorise */
static inline float swiglu1(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }
#ifdef LP_X86
AVX2_FN static void swiglu_avx2(const float *x, int64_t K, float *tmp);
#endif

/* The sum of squares an RMSNorm takes, in double (each square exact): element k goes to partial sum k % 16,
 * in order, and the 16 partials are added by one fixed tree, so the AVX2 loop (four vectors of four
 * partials) gives the same sum bit for bit as this one. */
static double squares_tree(const double *p) {
    double t[4];
    for (int i = 0; i < 4; i++) t[i] = (p[i] + p[4 + i]) + (p[8 + i] + p[12 + i]);
    return (t[0] + t[1]) + (t[2] + t[3]);
}

static double sum_squares(const float *x, int64_t K) {
    double p[16] = {0};
    for (int64_t k = 0; k < K; k++) p[k % 16] += (double)x[k] * x[k];
    return squares_tree(p);
}

#ifdef LP_X86
AVX2_FN static double sum_squares_avx2(const float *x, int64_t K) {
    __m256d a[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
        for (int i = 0; i < 4; i++) {
            __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(x + k + 4 * i));
            a[i] = _mm256_add_pd(a[i], _mm256_mul_pd(v, v));
        }
    double p[16];
    for (int i = 0; i < 4; i++) _mm256_storeu_pd(p + 4 * i, a[i]);
    for (; k < K; k++) p[k % 16] += (double)x[k] * x[k];
    return squares_tree(p);
}
#endif

/* The row the product sees. RMSNorm: x * rsqrt(mean(x^2) + eps) * g (g one vector, or one per lane).
 * SwiGLU: the input row holds [gate | up] (2K values): silu(gate) * up; at level 1 (pre_level: the
 * kernels other than the generic one) 8 values at a time, exp from a polynomial (relative error ~2e-7). */
static const float *pre_row(int pre, const float *x, int64_t K, const float *g, float eps, float *tmp, int level) {
    if (pre == PRE_NONE) return x;
    if (pre == PRE_RMSNORM) {
#ifdef LP_X86
        double ss = level ? sum_squares_avx2(x, K) : sum_squares(x, K);
#else
        double ss = sum_squares(x, K);
#endif
        float r = 1.0f / sqrtf((float)(ss / (double)K) + eps);
        for (int64_t k = 0; k < K; k++) tmp[k] = (x[k] * r) * g[k];
        return tmp;
    }
#ifdef LP_X86
    if (level) {
        swiglu_avx2(x, K, tmp);
        return tmp;
    }
#endif
    for (int64_t k = 0; k < K; k++) tmp[k] = swiglu1(x[k], x[K + k]);
    return tmp;
}

/* The loops pre_row takes: 0 the scalar ones (the generic kernel), 1 AVX2 (every other kernel) */
static int pre_level(void) { return DOT != dot_generic; }

/* ---- the team: one OpenMP region per call, with our own barrier inside it -------------------------
 * A decode step is ~100 short phases (a product, the attention, ...), each ending where every thread
 * must have finished. As separate OpenMP regions they cost a wake-up each, and libgomp's policy for
 * waking is fragile: as soon as a second thread has its own pool (a server that loads the model on
 * one thread and decodes on another), libgomp stops spinning and puts idle threads to sleep within
 * microseconds, so every phase pays a futex sleep and wake-up (tens of microseconds, far more on a
 * VM whose idle CPU has halted). So a call opens one region and its phases meet at team_sync(): a
 * short spin, then sched_yield() while a thread still has to wait, so a thread that waits never
 * sleeps while it is alone on its core, and gives the core away when something else wants it. */
typedef struct {
    _Atomic int arrived, phase;
} team_t;

#define TEAM_SPINS 2000 /* pauses before a waiting thread starts yielding */

static inline void cpu_relax(void) {
#ifdef LP_X86
    _mm_pause();
#endif
}

/* Every one of the nth threads calls it; none returns before all have arrived. */
static void team_sync(team_t *t, int nth) {
    if (nth == 1) return;
    int phase = atomic_load_explicit(&t->phase, memory_order_relaxed);
    if (atomic_fetch_add_explicit(&t->arrived, 1, memory_order_acq_rel) == nth - 1) {
        atomic_store_explicit(&t->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&t->phase, phase + 1, memory_order_release);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&t->phase, memory_order_acquire) == phase; spins++) {
        if (spins < TEAM_SPINS)
            cpu_relax();
        else
            sched_yield();
    }
}

/* [*lo, *hi): thread tid's share of n items among nth threads */
static inline void share(int64_t n, int tid, int nth, int64_t *lo, int64_t *hi) {
    *lo = n * tid / nth;
    *hi = n * (tid + 1) / nth;
}

/* A packed weight as the C side sees it: its codes and scales, and its tile copy (tile_pack) or NULLs. */
typedef struct {
    int fmt;
    int64_t L, N, K, Kp;
    const int8_t *qs;
    const uint16_t *d, *m;
    const int8_t *qt;
    const uint16_t *dt, *mt;
} packed_t;

static packed_t packed_from(const int64_t *a) {  /* fmt, L, N, K, Kp, qs, d, m, qt, dt, mt */
    packed_t w = {(int)a[0], a[1], a[2], a[3], a[4], (const int8_t *)(intptr_t)a[5],
                  (const uint16_t *)(intptr_t)a[6], (const uint16_t *)(intptr_t)a[7], (const int8_t *)(intptr_t)a[8],
                  (const uint16_t *)(intptr_t)a[9], (const uint16_t *)(intptr_t)a[10]};
    return w;
}

/* A product's scratch: its M rows quantized (plus their rests with 16-bit activations), their block
 * scales and sums, and one pre-processed row for each of `nthreads` threads. */
typedef struct {
    int8_t *xq, *xq2;
    float *xd, *xs, *tmp;
    int16_t *x16;  /* activations widened for TILE16 */
    float *sums;   /* the tiles' sums per thread, from a 2 KB boundary (amx_sum_bytes, AMX_SUM) */
} act_t;

static int act_hi(void) { return ACT_BITS == 16; }

/* The rows a product's scratch holds per lane: M, and on the tiles the last chunk's padding (amx_chunks) */
static int64_t act_rows(int64_t M) {
#ifdef LP_X86
    if (USE_AMX && M >= AMX_MIN_ROWS) {
        int64_t chunks;
        return amx_chunks(M, act_hi(), &chunks) * chunks;
    }
#endif
    return M;
}

/* The tiles' per-thread sums (a vector per row for the codes, one for q4's minimum, AMX_SUM's places) when a
 * product runs on them */
static size_t amx_sum_bytes(int64_t M, int nthreads) {
#ifdef LP_X86
    if (USE_AMX && M >= AMX_MIN_ROWS) return amx_sum_span(2 * act_rows(M)) * (size_t)nthreads + 2048;  /* + alignment */
#endif
    return 0;
}

static size_t act_bytes(const packed_t *w, int64_t M, int pre, int nthreads, size_t *q_bytes) {
    int64_t rows = w->L * act_rows(M), ns = SPAD(w->Kp / QK);
    size_t q = (size_t)(rows * w->Kp + 63) / 64 * 64, s = 2 * sizeof(float) * (size_t)(rows * ns);
    size_t t = pre != PRE_NONE ? sizeof(float) * (size_t)(w->K * nthreads) : 0;
    if (q_bytes) *q_bytes = q;
    return ((1 + act_hi()) * q + s + t + 63) / 64 * 64 + 2 * q + amx_sum_bytes(M, nthreads);
}

/* The rests' codes start right after the codes' (rows x Kp bytes); a product on the AMX tiles puts them
 * row by row instead (row t's codes, its rests, row t + 1's codes...: linear_team), so that a tile reads
 * a few rows of both (tile_amx, pairs). */
static act_t act_at(int8_t *base, const packed_t *w, int64_t M, int pre, int nthreads) {
    size_t q;
    size_t all = act_bytes(w, M, pre, nthreads, &q), sums = amx_sum_bytes(M, nthreads);
    int hi = act_hi();
    int64_t rows = w->L * act_rows(M), ns = SPAD(w->Kp / QK);
    act_t a = {base, hi ? base + rows * w->Kp : NULL, (float *)(base + (1 + hi) * q), NULL, NULL, NULL, NULL};
    a.xs = a.xd + rows * ns;
    a.tmp = a.xs + rows * ns;
    a.x16 = (int16_t *)(base + (all - sums - 2 * q));
    if (sums) a.sums = (float *)(base + (all - sums));
    return a;
}

#ifdef LP_X86
#define QUANTIZE_FAST quantize_act_avx2
#else
#define QUANTIZE_FAST quantize_act
#endif

/* A row's activations for TILE16: x16 = 254 q + q2 per value (q alone with 8-bit activations), each 32
 * values (in the order the codes are stored: paired for q4) as their even-indexed values, then their odd
 * ones. */
static void widen16(const int8_t *q, const int8_t *q2, int64_t Kp, int16_t *x16) {  /* q2 NULL: q alone */
    for (int64_t c = 0; c < Kp; c += QK)
        for (int k = 0; k < QK / 2; k++) {
            x16[c + k] = (int16_t)(q2 ? 254 * q[c + 2 * k] + q2[c + 2 * k] : q[c + 2 * k]);
            x16[c + QK / 2 + k] = (int16_t)(q2 ? 254 * q[c + 2 * k + 1] + q2[c + 2 * k + 1] : q[c + 2 * k + 1]);
        }
}

/* Products smaller than this (rows x outputs x inputs) run on one thread: waking others costs more. */
static int linear_wide(const packed_t *w, int64_t M) { return w->L * M * w->N * w->Kp >= (1 << 16); }

/* y[l, i, n] (+)= sum_k pre(x[l, i])[k] * w[l, n, k]
 * x: float32 [L, M, K] ([L, M, 2K] for SwiGLU), y: float32 [L, M, N], weights packed [L, N, ...];
 * g: the RMSNorm weight, [K] or [L, K] (g_lanes); acc: add into y instead of storing.
 * Called by each of the nth threads of a team (thread tid), with scratch from act_at(); returns when
 * y is complete. */
static void linear_team(const packed_t *w, int64_t M, const float *x, float *y, int pre, const float *g,
                        int g_lanes, float eps, int acc, const act_t *a, int tid, int nth, team_t *team) {
    const int fmt = w->fmt;
    const int64_t L = w->L, N = w->N, K = w->K, Kp = w->Kp, nb = Kp / QK, ns = SPAD(nb);
    const int8_t *qs = w->qs;
    const uint16_t *wd = w->d, *wm = w->m;
    int64_t row_bytes = fmt == FMT_Q8 ? Kp : Kp / 2, rows = L * M, xstride = pre == PRE_SWIGLU ? 2 * K : K;
#ifdef LP_X86
    const int amx = USE_AMX && M >= AMX_MIN_ROWS && w->qt;
#else
    const int amx = 0;
#endif
    /* the VNNI tiles take 8-bit activations too (q alone), in the same order as 16-bit ones */
    int paired = fmt == FMT_Q4 && DOT != dot_generic && !amx, hi = act_hi(), wide16 = TILE16 && !amx;
    int nw = linear_wide(w, M) ? nth : 1;  /* the threads that work; the others only meet them */
    int64_t lo, up, chunks = 1;
    /* on the tiles: chunks of T rows, each lane's rows padded to Mp (amx_chunks), each row's rests right
     * after its codes (tile_amx: `pairs`) */
#ifdef LP_X86
    const int T = amx ? amx_chunks(M, hi, &chunks) : 0;
#else
    const int T = 0;
#endif
    const int64_t Mp = amx ? T * chunks : M, step = amx && hi ? 2 : 1;
    if (tid < nw) {
        float *mine = a->tmp + (pre != PRE_NONE ? K * tid : 0);
        share(rows, tid, nw, &lo, &up);
        for (int64_t r = lo; r < up; r++) {
            const float *row = pre_row(pre, x + r * xstride, K, g + (g_lanes ? (r / M) * K : 0), eps, mine,
                                       pre_level());
            const int64_t at = (r / M) * Mp + r % M;  /* its place in the scratch */
            int8_t *xq = a->xq + step * at * Kp;
            int8_t *xq2 = !hi ? NULL : amx ? xq + Kp : a->xq2 + at * Kp;
            (DOT != dot_generic ? QUANTIZE_FAST : quantize_act)(row, K, Kp, xq, a->xd + at * ns, a->xs + at * ns,
                                                                paired, xq2);
            if (wide16) widen16(a->xq + r * Kp, hi ? a->xq2 + r * Kp : NULL, Kp, a->x16 + r * Kp);
        }
        if (tid == 0 && Mp > M)  /* the padding rows: zeros (their outputs are not stored) */
            for (int64_t l = 0; l < L; l++) {
                memset(a->xq + step * (l * Mp + M) * Kp, 0, (size_t)(step * (Mp - M) * Kp));
                memset(a->xd + (l * Mp + M) * ns, 0, sizeof(float) * (size_t)((Mp - M) * ns));
                memset(a->xs + (l * Mp + M) * ns, 0, sizeof(float) * (size_t)((Mp - M) * ns));
            }
    }
    team_sync(team, nth);
#ifdef LP_X86
    if (amx && tid < nw) {  /* 16 weight rows at a time with each lane's rows in chunks of T */
        const int64_t groups = (N + AMX_ROWS - 1) / AMX_ROWS;
        share(groups, tid, nw, &lo, &up);
        char *sums = (char *)(((uintptr_t)a->sums + 2047) & ~(uintptr_t)2047) + amx_sum_span(2 * Mp) * (size_t)tid;
        if (lo < up) amx_config(T, hi);
        for (int64_t l = 0; l < L && lo < up; l++)
            for (int64_t gi = lo; gi < up; gi++) {
                int64_t n = gi * AMX_ROWS, g = l * groups + gi;
                int R = (int)(N - n < AMX_ROWS ? N - n : AMX_ROWS);
                tile_amx(fmt, nb, w->qt + g * nb * tile_bytes(fmt), w->dt + g * nb * AMX_ROWS,
                         fmt == FMT_Q4 ? w->mt + g * nb * AMX_ROWS : NULL, R, T, (int)chunks, (int)M, hi,
                         a->xq + step * l * Mp * Kp, Kp, a->xd + l * Mp * ns, a->xs + l * Mp * ns, ns,
                         y + l * M * N + n, N, acc, sums);
            }
        amx_release();
    }
#endif
    if (!amx && tid < nw) {
        /* Tokens are taken in tiles so that a tile's quantized rows stay in cache while the packed
         * weights stream past them once per tile. */
        const int64_t tile = 64;
        share((N + MAXR - 1) / MAXR, tid, nw, &lo, &up);
        for (int64_t l = 0; l < L; l++) {
            const int8_t *wq = qs + l * N * row_bytes;
            const uint16_t *ld = wd + l * N * ns, *lm = fmt == FMT_Q4 ? wm + l * N * ns : NULL;
            for (int64_t t0 = 0; t0 < M; t0 += tile) {
                int64_t t1 = t0 + tile < M ? t0 + tile : M;
                for (int64_t n = lo * MAXR; n < up * MAXR && n < N; n += MAXR) {
                    int R = (int)(N - n < MAXR ? N - n : MAXR);
                    for (int64_t i = t0; i < t1; i += MAXT) {
                        int T = (int)(t1 - i < MAXT ? t1 - i : MAXT);
                        int64_t row = l * M + i;
                        float out[MAXT * MAXR];
                        if (wide16)
                            TILE16(fmt, nb, row_bytes, wq + n * row_bytes, ld + n * ns, lm ? lm + n * ns : NULL, R,
                                   T, a->x16 + row * Kp, Kp, a->xd + row * ns, a->xs + row * ns, ns, out);
                        else
                            tile_rows(fmt, nb, row_bytes, wq + n * row_bytes, ld + n * ns, lm ? lm + n * ns : NULL, R,
                                      T, a->xq + row * Kp, hi ? a->xq2 + row * Kp : NULL, Kp, a->xd + row * ns,
                                      a->xs + row * ns, ns, out);
                        for (int t = 0; t < T; t++) {
                            float *yr = y + (row + t) * N + n;
                            if (acc)
                                for (int r = 0; r < R; r++) yr[r] += out[t * MAXR + r];
                            else
                                for (int r = 0; r < R; r++) yr[r] = out[t * MAXR + r];
                        }
                    }
                }
            }
        }
    }
    team_sync(team, nth);
}

/* linear(fmt, L, N, K, Kp, M, qs, d, m, qt, dt, mt, x, y, pre, g, g_per_lane, eps): one product from Python */
static PyObject *py_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[17];
    if (args_i64(args, nargs - 1, 17, a) < 0) return NULL;
    double eps = PyFloat_AsDouble(args[17]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    int64_t wa[11] = {a[0], a[1], a[2], a[3], a[4], a[6], a[7], a[8], a[9], a[10], a[11]};
    packed_t w = packed_from(wa);
    int64_t M = a[5];
    int pre = (int)a[14];
    int nthreads = linear_wide(&w, M) ? omp_get_max_threads() : 1;
    int8_t *buf = (int8_t *)aligned_alloc(64, act_bytes(&w, M, pre, nthreads, NULL));
    if (!buf) return PyErr_NoMemory();
    act_t act = act_at(buf, &w, M, pre, nthreads);
    team_t team = {0, 0};
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(nthreads)
    linear_team(&w, M, (const float *)(intptr_t)a[12], (float *)(intptr_t)a[13], pre, (const float *)(intptr_t)a[15],
                (int)a[16], (float)eps, 0, &act, omp_get_thread_num(), omp_get_num_threads(), &team);
    Py_END_ALLOW_THREADS
    free(buf);
    Py_RETURN_NONE;
}

/* ---- decode attention: RoPE on q and k, this token's K/V into its cache slot, attention ------- */

__attribute__((target_clones("avx2", "default")))
static float dot_f32(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[j + k] * b[j + k];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; j < n; j++) s += a[j] * b[j];
    return s;
}

__attribute__((target_clones("avx2", "default")))
static void axpy_f32(float *y, float a, const float *x, int64_t n) {
    for (int64_t j = 0; j < n; j++) y[j] += a * x[j];
}

#ifdef LP_X86
/* Eight keys' sums at once, each summed exactly as hsum8 sums it alone: ((v0 + v4) + (v2 + v6)) +
 * ((v1 + v5) + (v3 + v7)), the halves added by 128-bit lane swaps and HADD instead of one key at a time. */
AVX2_FN static inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                                     __m256 a7) {
#define HALVES(x, y) _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31))
#define EVEN_ODD(x) _mm256_permute_ps(x, _MM_SHUFFLE(3, 1, 2, 0))
    __m256 b04 = EVEN_ODD(HALVES(a0, a4)), b15 = EVEN_ODD(HALVES(a1, a5));  /* [v0+v4, v2+v6, v1+v5, v3+v7] */
    __m256 b26 = EVEN_ODD(HALVES(a2, a6)), b37 = EVEN_ODD(HALVES(a3, a7));
#undef EVEN_ODD
#undef HALVES
    /* [keys 0, 1 | 4, 5] and [2, 3 | 6, 7] as (c0 + c2, c1 + c3) pairs, then each pair's sum: keys 0..7 */
    return _mm256_hadd_ps(_mm256_hadd_ps(b04, b15), _mm256_hadd_ps(b26, b37));
}

/* sc[t] = scale * q . K[t] for t < n; eight keys at a time (independent FMA chains), then one. Each key's
 * products and sums are the same operations in the same order whichever way it is grouped. hd % 8 == 0. */
AVX2_FN static void scores_avx2(const float *q, const float *K, int64_t n, int64_t hd, float scale, float *sc) {
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        __m256 a[8];
        const float *k = K + t * hd;
        for (int c = 0; c < 8; c++) a[c] = _mm256_setzero_ps();
        for (int64_t j = 0; j < hd; j += 8) {
            __m256 qv = _mm256_loadu_ps(q + j);
            for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + c * hd + j), a[c]);
        }
        _mm256_storeu_ps(sc + t, _mm256_mul_ps(hsum8x8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]),
                                               _mm256_set1_ps(scale)));
    }
    for (; t < n; t++) {
        __m256 a0 = _mm256_setzero_ps();
        for (int64_t j = 0; j < hd; j += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(K + t * hd + j), a0);
        sc[t] = hsum8(a0) * scale;
    }
}

/* exp(x) for x <= 0 (softmax after subtracting the max): 2^k * p(r), r in [-ln2/2, ln2/2], a degree-6
 * polynomial (relative error ~2e-7); under -87 it is 0. */
AVX2_FN static inline __m256 exp_avx2(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* the largest of x[0..n) (exact in any order: -inf for n = 0) */
AVX2_FN static float max_avx2(const float *x, int64_t n) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
        m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + t));
        m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + t + 8));
    }
    for (; t + 8 <= n; t += 8) m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + t));
    m0 = _mm256_max_ps(m0, m1);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m0), _mm256_extractf128_ps(m0, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float mx = _mm_cvtss_f32(m4);
    for (; t < n; t++) mx = x[t] > mx ? x[t] : mx;
    return mx;
}

/* tmp[k] = silu(x[k]) * x[K + k]: silu(g) = g * s, the sigmoid s = 1 / (1 + e) for g >= 0 and e / (1 + e)
 * below, e = exp(-|g|) (so the polynomial only sees arguments <= 0, where it holds) */
AVX2_FN static void swiglu_avx2(const float *x, int64_t K, float *tmp) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 g = _mm256_loadu_ps(x + k), u = _mm256_loadu_ps(x + K + k);
        __m256 e = exp_avx2(_mm256_or_ps(g, sign)), r = _mm256_div_ps(one, _mm256_add_ps(one, e));
        __m256 s = _mm256_blendv_ps(r, _mm256_mul_ps(e, r), _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
        _mm256_storeu_ps(tmp + k, _mm256_mul_ps(_mm256_mul_ps(g, s), u));
    }
    for (; k < K; k++) tmp[k] = swiglu1(x[k], x[K + k]);
}

/* sc[t] = exp(sc[t] - mx) for t < n; returns their sum. */
AVX2_FN static float softmax_exp_avx2(float *sc, int64_t n, float mx) {
    __m256 m = _mm256_set1_ps(mx), acc = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(sc + t), m));
        _mm256_storeu_ps(sc + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum8(acc);
    for (; t < n; t++) {
        sc[t] = expf(sc[t] - mx);
        sum += sc[t];
    }
    return sum;
}

/* o[j] += sum_t e[t] * V[t][j], 64 (then 32, 8) columns at a time in registers: eight independent FMA
 * chains keep both FMA pipes busy. Each column sums over t in order however the columns are grouped.
 * hd % 8 == 0. */
AVX2_FN static void values_avx2(float *o, const float *e, const float *V, int64_t n, int64_t hd) {
    int64_t j = 0;
    for (; j + 64 <= hd; j += 64) {
        __m256 a[8];
        for (int c = 0; c < 8; c++) a[c] = _mm256_loadu_ps(o + j + 8 * c);
        for (int64_t t = 0; t < n; t++) {
            __m256 w = _mm256_broadcast_ss(e + t);
            const float *v = V + t * hd + j;
            for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * c), a[c]);
        }
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(o + j + 8 * c, a[c]);
    }
    for (; j + 32 <= hd; j += 32) {
        __m256 a0 = _mm256_loadu_ps(o + j), a1 = _mm256_loadu_ps(o + j + 8), a2 = _mm256_loadu_ps(o + j + 16),
               a3 = _mm256_loadu_ps(o + j + 24);
        for (int64_t t = 0; t < n; t++) {
            __m256 w = _mm256_broadcast_ss(e + t);
            const float *v = V + t * hd + j;
            a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
        }
        _mm256_storeu_ps(o + j, a0);
        _mm256_storeu_ps(o + j + 8, a1);
        _mm256_storeu_ps(o + j + 16, a2);
        _mm256_storeu_ps(o + j + 24, a3);
    }
    for (; j < hd; j += 8) {
        __m256 a0 = _mm256_loadu_ps(o + j);
        for (int64_t t = 0; t < n; t++) a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(e + t), _mm256_loadu_ps(V + t * hd + j), a0);
        _mm256_storeu_ps(o + j, a0);
    }
}

/* n floats into float16 cache entries, clamped to float16's range (a NaN stays one) and rounded to nearest
 * even, as the engine's prompt chunks store them (LaneModel.attention: clamp, then torch's .half()) */
AVX2_FN static void store_f16_avx2(uint16_t *dst, const float *x, int64_t n) {
    const __m256 hi = _mm256_set1_ps(F16_MAX), lo = _mm256_set1_ps(-F16_MAX);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(x + j)));  /* NaN: the second operand */
        _mm_storeu_si128((__m128i *)(dst + j), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
    for (; j < n; j++) dst[j] = f2h(f16_range(x[j]));
}
#endif

static void scores_generic(const float *q, const float *K, int64_t n, int64_t hd, float scale, float *sc) {
    for (int64_t t = 0; t < n; t++) sc[t] = dot_f32(q, K + t * hd, hd) * scale;
}

static void values_generic(float *o, const float *e, const float *V, int64_t n, int64_t hd) {
    for (int64_t t = 0; t < n; t++) axpy_f32(o, e[t], V + t * hd, hd);
}

/* float16 cache entries widened to float32 (exact) */
static void widen_f16(const uint16_t *x, int64_t n, float *out) {
    for (int64_t j = 0; j < n; j++) out[j] = h2f(x[j]);
}

static void store_f16(uint16_t *dst, const float *x, int64_t n) {
    for (int64_t j = 0; j < n; j++) dst[j] = f2h(f16_range(x[j]));
}

#ifdef LP_X86
#define SOFTMAX_EXP_AVX2 softmax_exp_avx2
#define MAX_AVX2 max_avx2
#else
#define SOFTMAX_EXP_AVX2(sc, n, mx) 0.0f
#define MAX_AVX2(x, n) 0.0f
#define scores_avx2 scores_generic
#define values_avx2 values_generic
#define store_f16_avx2 store_f16
#endif

static void rope(float *v, const float *cos, const float *sin, int64_t hd) {  /* interleaved pairs */
    for (int64_t t = 0; t < hd / 2; t++) {
        float x0 = v[2 * t], x1 = v[2 * t + 1];
        v[2 * t] = x0 * cos[t] - x1 * sin[t];
        v[2 * t + 1] = x0 * sin[t] + x1 * cos[t];
    }
}

/* attend(N, hq, hkv, hd, qkv, cos, sin, kc, vc, slots, slot, nvis, out, half)
 * qkv: float32 [N, (hq + 2 hkv) hd] (this token's projections; q and k are rotated in place);
 * kc, vc: [N, hkv, slots, hd], float32, or float16 with `half` (the token's k and v are rounded to
 * nearest even as they are stored, every key and value read back widened); the token goes to `slot`,
 * then each query head attends over slots [0, nvis) (exactly the visible keys: a ring buffer holds the
 * last W positions in some order, and attention does not depend on the order). out: float32 [N, hq hd].
 * Work is split over (sequence, KV head, stretch of slots): see attend_cut. */
typedef struct {
    int64_t N, hq, hkv, hd, slots, slot, nvis;
    float *qkv;
    void *kc, *vc; /* float, or uint16_t (float16) with half */
    float *out;
    const float *cos, *sin;
    int half;
} attend_t;

/* How an attention is cut: per (sequence, KV head), `parts` stretches of ATT_STRETCH slots from slot 0,
 * each with its own max, sum of exponentials and weighted values, merged by their log-sum-exp
 * (flash-decoding), so one long sequence still uses every thread. The stretches do not depend on the
 * thread count, and every attention on one cache (a verify's positions) has the same stretches, so a
 * stretch's keys and values are read once for all of them. `floats`: its partial results, per (unit,
 * part, query head of the group): the max, the sum and the weighted values. */
#ifndef ATT_STRETCH
#define ATT_STRETCH 128
#endif
#define ATT_BLOCK 16 /* keys a block: read (and widened from float16) once for every query that sees them */
typedef struct {
    int64_t parts;
    size_t floats;
    /* set by attend_share: the first group on the same cache (the head) and where this one's partials go;
     * on the head: the last group on its cache, the most parts any of them has, and how many there are */
    int64_t head, off, last, most, groups;
} attend_cut_t;

static attend_cut_t attend_cut(const attend_t *at) {
    int64_t units = at->N * at->hkv, rep = at->hq / at->hkv;
    attend_cut_t c = {(at->nvis + ATT_STRETCH - 1) / ATT_STRETCH, 0, 0, 0, 0, 0, 0};
    c.floats = (size_t)(units * c.parts * rep * (at->hd + 2));
    return c;
}

/* A thread's own floats for one stretch of a head group: each group's scores (a row of ATT_STRETCH per
 * query head), then a block of keys and one of values widened to float32. */
static int64_t attend_row(const attend_t *at, const attend_cut_t *head) {
    return head->groups * (at->hq / at->hkv) * ATT_STRETCH + 2 * ATT_BLOCK * at->hd;
}

static int64_t attend_work(const attend_t *at) { return at->N * at->hkv * at->nvis * at->hd; }

/* The scratch floats for G attentions run in one team (after attend_share): each one's partial results,
 * then each thread's row, as long as the longest. */
static size_t attend_scratch(const attend_t *ats, const attend_cut_t *cuts, int64_t G, int nthreads) {
    size_t parts = 0;
    int64_t row = 0;
    for (int64_t g = 0; g < G; g++) {
        parts += cuts[g].floats;
        if (cuts[g].head == g && attend_row(ats + g, cuts + g) > row) row = attend_row(ats + g, cuts + g);
    }
    return parts + (size_t)nthreads * (size_t)row;
}

/* G attentions' cuts, told which groups read the same cache and where each group's partials go. */
static void attend_share(const attend_t *ats, attend_cut_t *cuts, int64_t G) {
    size_t off = 0;
    for (int64_t g = 0; g < G; g++) {
        attend_cut_t *c = cuts + g;
        c->head = g;
        for (int64_t e = 0; e < g; e++)
            if (ats[e].kc == ats[g].kc) {
                c->head = e;
                break;
            }
        attend_cut_t *h = cuts + c->head;
        h->last = g;
        h->most = c->head == g || c->parts > h->most ? c->parts : h->most;
        h->groups = c->head == g ? 1 : h->groups + 1;
        c->off = (int64_t)off;
        off += c->floats;
    }
}

/* The part of the global work items [lo, up) that falls in [base, base + n), as local indices. */
static int clip(int64_t lo, int64_t up, int64_t base, int64_t n, int64_t *a, int64_t *b) {
    *a = lo > base ? lo - base : 0;
    *b = up < base + n ? up - base : n;
    return *a < *b;
}

#ifdef LP_X86
AVX2_FN static void widen_f16_avx2(const uint16_t *x, int64_t n, float *out) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + j))));
    for (; j < n; j++) out[j] = h2f(x[j]);
}

#define AVX512_FN __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512dq")))

/* The sums of 16 accumulators' lanes, out[k] = a[k]'s, every one by the same tree: within each 128-bit
 * lane (x0 + x2) + (x1 + x3), then across them (L0 + L2) + (L1 + L3). */
AVX512_FN static inline __attribute__((always_inline)) __m512 hsum16x16(const __m512 *a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
    __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xDD));
}

/* sc[k] = scale * q . K[k] for the 16 keys of a block (hd % 16 == 0): one product, then an FMA chain per
 * key over the head, then hsum16x16. A key's score is the same operations wherever it sits in its block,
 * and whichever queries read the block. */
AVX512_FN static void scores512(const float *q, const float *K, int64_t hd, float scale, float *sc) {
    if (hd == 64) { /* the same operations with the row offsets known to the compiler */
        __m512 a[ATT_BLOCK], qv[4];
        for (int j = 0; j < 4; j++) qv[j] = _mm512_loadu_ps(q + 16 * j);
        for (int k = 0; k < ATT_BLOCK; k++) a[k] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(K + k * 64));
        for (int j = 1; j < 4; j++)
            for (int k = 0; k < ATT_BLOCK; k++) a[k] = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(K + k * 64 + 16 * j), a[k]);
        _mm512_storeu_ps(sc, _mm512_mul_ps(hsum16x16(a), _mm512_set1_ps(scale)));
        return;
    }
    __m512 a[ATT_BLOCK];
    for (int k = 0; k < ATT_BLOCK; k++) a[k] = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(K + k * hd));
    for (int64_t j = 16; j < hd; j += 16) {
        __m512 qv = _mm512_loadu_ps(q + j);
        for (int k = 0; k < ATT_BLOCK; k++) a[k] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(K + k * hd + j), a[k]);
    }
    _mm512_storeu_ps(sc, _mm512_mul_ps(hsum16x16(a), _mm512_set1_ps(scale)));
}

/* o[q][j] += sum_t e[q][t] * V[t][j] for t < n, for nq <= 4 query heads of 64 values: each column sums over
 * t in order (as values512 does for one), the heads side by side so the FMA chains overlap. */
AVX512_FN static void values512_64(int nq, float *const *o, const float *const *e, int64_t n, const float *V) {
    __m512 a[4][4];
    for (int q = 0; q < 4; q++)
        for (int c = 0; c < 4; c++) a[q][c] = q < nq ? _mm512_loadu_ps(o[q] + 16 * c) : _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        __m512 v[4];
        for (int c = 0; c < 4; c++) v[c] = _mm512_loadu_ps(V + t * 64 + 16 * c);
        for (int q = 0; q < 4; q++) {
            if (q >= nq) break;
            __m512 w = _mm512_set1_ps(e[q][t]);
            for (int c = 0; c < 4; c++) a[q][c] = _mm512_fmadd_ps(w, v[c], a[q][c]);
        }
    }
    for (int q = 0; q < 4; q++)
        if (q < nq)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(o[q] + 16 * c, a[q][c]);
}

/* float16 cache entries widened to float32, 16 at a time */
AVX512_FN static void widen_f16_512(const uint16_t *x, int64_t n, float *out) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(out + j, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + j))));
    widen_f16_avx2(x + j, n - j, out + j);
}

/* the same for one query head of any hd % 16 == 0 (256 columns at a time in registers) */
AVX512_FN static void values512(float *o, const float *e, int64_t n, const float *V, int64_t hd) {
    for (int64_t j0 = 0; j0 < hd; j0 += 256) {
        __m512 a[16];
        int nc = (int)((hd - j0 < 256 ? hd - j0 : 256) / 16);
        for (int c = 0; c < nc; c++) a[c] = _mm512_loadu_ps(o + j0 + 16 * c);
        for (int64_t t = 0; t < n; t++) {
            __m512 w = _mm512_set1_ps(e[t]);
            for (int c = 0; c < nc; c++) a[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(V + t * hd + j0 + 16 * c), a[c]);
        }
        for (int c = 0; c < nc; c++) _mm512_storeu_ps(o + j0 + 16 * c, a[c]);
    }
}
#define WIDEN_F16_FAST widen_f16_avx2
#define WIDEN_F16_512 widen_f16_512
#else
#define WIDEN_F16_FAST widen_f16
#define WIDEN_F16_512 widen_f16
#endif

/* Which attention loops run: 0 the generic C, 1 AVX2 (8 keys at a time), 2 AVX-512 (blocks of 16 keys)
 * with the kernels that use AVX-512 for the products. A model's attention always takes one of them (it
 * depends on the kernel and the head size only), so a row's result does not depend on its batch. */
static int attend_level(int64_t hd);

/* A block of cnt keys (or values) from a cache's element `at` on, as float32 rows of hd: the cache itself
 * where it is float32 (and whole, with pad), else widened or copied into buf, and with pad zero-padded
 * to ATT_BLOCK rows (the AVX-512 scores take whole blocks). */
static const float *kv_block(const void *base, int half, int64_t at, int64_t cnt, int64_t hd, int level, int pad,
                             float *buf) {
    pad = pad && cnt < ATT_BLOCK;
    if (!half && !pad) return (const float *)base + at;
    if (half)
        (level == 2 ? WIDEN_F16_512 : level ? WIDEN_F16_FAST : widen_f16)((const uint16_t *)base + at, cnt * hd, buf);
    else
        memcpy(buf, (const float *)base + at, sizeof(float) * (size_t)(cnt * hd));
    if (pad) memset(buf + cnt * hd, 0, sizeof(float) * (size_t)((ATT_BLOCK - cnt) * hd));
    return buf;
}

/* Keys (or values) [t, t1) of a stream asked for ahead of their use: a step reads each cache once, from
 * memory, a stretch at a time, and the hardware's prefetchers see only short runs of it. */
#ifndef ATT_AHEAD
#define ATT_AHEAD 2 /* blocks */
#endif
static inline void kv_prefetch(const void *base, int half, int64_t kv0, int64_t t, int64_t t1, int64_t hd) {
    const char *p = (const char *)base + (kv0 + t * hd) * (half ? 2 : 4);
    for (int64_t l = 0, n = (t1 - t) * hd * (half ? 2 : 4); l < n; l += 64) __builtin_prefetch(p + l, 0, 3);
}

/* Where a group that sees nvis slots stops reading the stretch from t0: its end, at most the stretch's */
static inline int64_t stretch_end(int64_t t0, int64_t nvis) { return t0 + ATT_STRETCH < nvis ? t0 + ATT_STRETCH : nvis; }

/* Work item w of a head group (the groups on one cache, from g0): a sequence, a KV head and a stretch of
 * slots. For each of its groups that sees the stretch and each query head of the KV head: the stretch's
 * max score, its sum of exponentials and its exp-weighted values, into that group's partial results.
 * Keys and values come a block at a time for all of them. row: this thread's attend_row floats. */
static void attend_item(const attend_t *ats, const attend_cut_t *cuts, int64_t g0, int64_t w, float *scratch,
                        float *row, int level) {
    const attend_t *a = ats + g0;
    const attend_cut_t *h = cuts + g0;
    const int64_t hq = a->hq, hkv = a->hkv, hd = a->hd, slots = a->slots, rep = hq / hkv;
    const int64_t width = (hq + 2 * hkv) * hd, S = ATT_STRETCH;
    const float scale = 1.0f / sqrtf((float)hd);
    int64_t unit = w / h->most, p = w % h->most, n = unit / hkv, kh = unit % hkv, t0 = p * S, tmax = t0;
    for (int64_t g = g0; g <= h->last; g++) {
        if (cuts[g].head != g0) continue;
        int64_t end = stretch_end(t0, ats[g].nvis);
        tmax = end > tmax ? end : tmax;
    }
    const int64_t kv0 = (n * hkv + kh) * slots * hd;
    float *sc = row, *kb = row + h->groups * rep * S, *vb = kb + ATT_BLOCK * hd;
    const int64_t ahead = ATT_AHEAD * ATT_BLOCK;
    kv_prefetch(a->kc, a->half, kv0, t0, t0 + ahead < tmax ? t0 + ahead : tmax, hd);
    kv_prefetch(a->vc, a->half, kv0, t0, t0 + ahead < tmax ? t0 + ahead : tmax, hd);
    for (int64_t b = t0; b < tmax; b += ATT_BLOCK) {
        int64_t cnt = tmax - b < ATT_BLOCK ? tmax - b : ATT_BLOCK;
        if (b + ahead < tmax)
            kv_prefetch(a->kc, a->half, kv0, b + ahead, b + ahead + ATT_BLOCK < tmax ? b + ahead + ATT_BLOCK : tmax, hd);
        const float *K = kv_block(a->kc, a->half, kv0 + b * hd, cnt, hd, level, level == 2, kb);
        for (int64_t g = g0, gi = 0; g <= h->last; g++) {
            if (cuts[g].head != g0) continue;
            float *s = sc + gi++ * rep * S + (b - t0);
            if (ats[g].nvis <= b) continue;
            const float *q = ats[g].qkv + n * width + kh * rep * hd;
            for (int64_t r = 0; r < rep; r++) {
#ifdef LP_X86
                if (level == 2)
                    scores512(q + r * hd, K, hd, scale, s + r * S);
                else if (level == 1)
                    scores_avx2(q + r * hd, K, cnt, hd, scale, s + r * S);
                else
#endif
                    scores_generic(q + r * hd, K, cnt, hd, scale, s + r * S);
            }
        }
    }
    for (int64_t g = g0, gi = 0; g <= h->last; g++) {
        if (cuts[g].head != g0) continue;
        int64_t m = stretch_end(t0, ats[g].nvis) - t0;
        float *e0 = sc + gi++ * rep * S;
        if (m <= 0) continue;
        for (int64_t r = 0; r < rep; r++) {
            float *res = scratch + cuts[g].off + ((unit * cuts[g].parts + p) * rep + r) * (hd + 2), *e = e0 + r * S;
            float mx = -INFINITY, sum = 0.0f;
            if (level) {
                mx = MAX_AVX2(e, m);
                sum = SOFTMAX_EXP_AVX2(e, m, mx);
            } else {
                for (int64_t t = 0; t < m; t++) mx = e[t] > mx ? e[t] : mx;
                for (int64_t t = 0; t < m; t++) {
                    e[t] = expf(e[t] - mx);
                    sum += e[t];
                }
            }
            memset(res + 2, 0, sizeof(float) * (size_t)hd);
            res[0] = mx;
            res[1] = sum;
        }
    }
    for (int64_t b = t0; b < tmax; b += ATT_BLOCK) {
        int64_t cnt = tmax - b < ATT_BLOCK ? tmax - b : ATT_BLOCK;
        if (b + ahead < tmax)
            kv_prefetch(a->vc, a->half, kv0, b + ahead, b + ahead + ATT_BLOCK < tmax ? b + ahead + ATT_BLOCK : tmax, hd);
        const float *V = kv_block(a->vc, a->half, kv0 + b * hd, cnt, hd, level, 0, vb);
        for (int64_t g = g0, gi = 0; g <= h->last; g++) {
            if (cuts[g].head != g0) continue;
            const float *e = sc + gi++ * rep * S + (b - t0);
            int64_t c = stretch_end(t0, ats[g].nvis) - b;
            if (c <= 0) continue;
            c = c < cnt ? c : cnt;
            float *res = scratch + cuts[g].off + (unit * cuts[g].parts + p) * rep * (hd + 2);
#ifdef LP_X86
            if (level == 2 && hd == 64) {
                for (int64_t r0 = 0; r0 < rep; r0 += 4) {
                    float *o[4];
                    const float *ev[4];
                    int nq = (int)(rep - r0 < 4 ? rep - r0 : 4);
                    for (int q = 0; q < nq; q++) {
                        o[q] = res + (r0 + q) * (hd + 2) + 2;
                        ev[q] = e + (r0 + q) * S;
                    }
                    values512_64(nq, o, ev, c, V);
                }
                continue;
            }
#endif
            for (int64_t r = 0; r < rep; r++) {
                float *o = res + r * (hd + 2) + 2;
#ifdef LP_X86
                if (level == 2)
                    values512(o, e + r * S, c, V, hd);
                else if (level == 1)
                    values_avx2(o, e + r * S, V, c, hd);
                else
#endif
                    values_generic(o, e + r * S, V, c, hd);
            }
        }
    }
}

/* G attentions (one per group of a batched step, or one alone), cut by attend_cut and attend_share, run
 * by a team in three phases: every group's work is shared out together, so a step with many requests
 * meets at three barriers per layer, not three per request. Called by each of the nth threads (nth <=
 * nthreads), with scratch of attend_scratch(.., nthreads) floats; returns when every `out` is complete. A
 * group's result does not depend on the others or on the thread count. */
static void attend_team_n(const attend_t *ats, const attend_cut_t *cuts, int64_t G, int nthreads, float *scratch,
                          int tid, int nth, team_t *team) {
    int64_t work = 0, n1 = 0, n2 = 0, n3 = 0, row = 0;
    size_t own = 0;
    for (int64_t g = 0; g < G; g++) {
        const attend_t *at = ats + g;
        work += attend_work(at);
        n1 += at->N * (at->hq + at->hkv);
        n3 += at->N * at->hq;
        own += cuts[g].floats;
        if (cuts[g].head == g) {
            n2 += at->N * at->hkv * cuts[g].most;
            row = attend_row(at, cuts + g) > row ? attend_row(at, cuts + g) : row;
        }
    }
    float *mine = scratch + own + row * tid;
    int level = attend_level(ats[0].hd);
    int nw = work >= 8192 ? nth : 1;
    int64_t lo, up, a, b;
    if (tid < nw) {  /* RoPE on every q and k head; K/V into the slot */
        share(n1, tid, nw, &lo, &up);
        for (int64_t g = 0, base = 0; g < G; base += ats[g].N * (ats[g].hq + ats[g].hkv), g++) {
            const attend_t *at = ats + g;
            const int64_t hq = at->hq, hkv = at->hkv, hd = at->hd, width = (hq + 2 * hkv) * hd;
            if (!clip(lo, up, base, at->N * (hq + hkv), &a, &b)) continue;
            for (int64_t u = a; u < b; u++) {
                int64_t n = u / (hq + hkv), h = u % (hq + hkv);
                float *v = at->qkv + n * width + h * hd;
                rope(v, at->cos, at->sin, hd);
                if (h >= hq) {
                    int64_t kh = h - hq, to = ((n * hkv + kh) * at->slots + at->slot) * hd;
                    const float *val = at->qkv + n * width + (hq + hkv + kh) * hd;
                    if (at->half) {
                        (level ? store_f16_avx2 : store_f16)((uint16_t *)at->kc + to, v, hd);
                        (level ? store_f16_avx2 : store_f16)((uint16_t *)at->vc + to, val, hd);
                    } else {
                        memcpy((float *)at->kc + to, v, sizeof(float) * (size_t)hd);
                        memcpy((float *)at->vc + to, val, sizeof(float) * (size_t)hd);
                    }
                }
            }
        }
    }
    team_sync(team, nth);
    if (tid < nw) {  /* each stretch of each cache: its groups' maxima, sums of exponentials, weighted values */
        share(n2, tid, nw, &lo, &up);
        for (int64_t g = 0, base = 0; g < G; g++) {
            if (cuts[g].head != g) continue;
            int64_t items = ats[g].N * ats[g].hkv * cuts[g].most;
            if (clip(lo, up, base, items, &a, &b))
                for (int64_t w = a; w < b; w++) attend_item(ats, cuts, g, w, scratch, mine, level);
            base += items;
        }
    }
    team_sync(team, nth);
    if (tid < nw) {  /* merge the stretches of each query head */
        share(n3, tid, nw, &lo, &up);
        for (int64_t g = 0, base = 0; g < G; g++) {
            const attend_t *at = ats + g;
            const int64_t hq = at->hq, hkv = at->hkv, hd = at->hd, rep = hq / hkv, parts = cuts[g].parts;
            const float *part = scratch + cuts[g].off;
            if (clip(lo, up, base, at->N * hq, &a, &b)) {
                for (int64_t u = a; u < b; u++) {
                    int64_t unit = u / rep, r = u % rep, n = unit / hkv, kh = unit % hkv;
                    float mx = -INFINITY, sum = 0.0f;
                    for (int64_t p = 0; p < parts; p++) {
                        const float *res = part + ((unit * parts + p) * rep + r) * (hd + 2);
                        if (res[1] > 0.0f && res[0] > mx) mx = res[0];
                    }
                    float *o = at->out + n * hq * hd + (kh * rep + r) * hd;
                    memset(o, 0, sizeof(float) * (size_t)hd);
                    for (int64_t p = 0; p < parts; p++) {
                        const float *res = part + ((unit * parts + p) * rep + r) * (hd + 2);
                        if (res[1] <= 0.0f) continue;
                        float wgt = expf(res[0] - mx);
                        sum += wgt * res[1];
                        axpy_f32(o, wgt, res + 2, hd);
                    }
                    for (int64_t j = 0; j < hd; j++) o[j] /= sum;
                }
            }
            base += at->N * hq;
        }
    }
    team_sync(team, nth);
}

static int attend_level(int64_t hd) {
    if (DOT == dot_generic || hd % 8) return 0;
    return TILE16 && hd % 16 == 0 ? 2 : 1; /* TILE16: the VNNI and AMX kernels, on CPUs with AVX-512 */
}

static int attend_args_ok(int64_t hq, int64_t hkv, int64_t hd, int64_t slots, int64_t slot, int64_t nvis) {
    return nvis >= 1 && nvis <= slots && slot >= 0 && slot < slots && hkv >= 1 && hq % hkv == 0 && hd >= 1;
}

static PyObject *py_attend(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[14];
    if (args_i64(args, nargs, 14, a) < 0) return NULL;
    if (!attend_args_ok(a[1], a[2], a[3], a[9], a[10], a[11])) {
        PyErr_SetString(PyExc_ValueError, "attend: bad slot, visible count, head size or head counts");
        return NULL;
    }
    attend_t at = {a[0], a[1], a[2], a[3], a[9], a[10], a[11], (float *)(intptr_t)a[4], (void *)(intptr_t)a[7],
                   (void *)(intptr_t)a[8], (float *)(intptr_t)a[12], (const float *)(intptr_t)a[5],
                   (const float *)(intptr_t)a[6], a[13] != 0};
    int nthreads = omp_get_max_threads();  /* the cut does not depend on how many threads run it */
    attend_cut_t cut = attend_cut(&at);
    attend_share(&at, &cut, 1);
    float *scratch = (float *)malloc(sizeof(float) * attend_scratch(&at, &cut, 1, nthreads));
    if (!scratch) return PyErr_NoMemory();
    team_t team = {0, 0};
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(attend_work(&at) >= 8192 ? nthreads : 1)
    attend_team_n(&at, &cut, 1, nthreads, scratch, omp_get_thread_num(), omp_get_num_threads(), &team);
    Py_END_ALLOW_THREADS
    free(scratch);
    Py_RETURN_NONE;
}

/* ---- a whole decode step of a one-lane model ---------------------------------------------------
 * For a model whose residual stream needs no cross-lane sums (one lane, one process), the step is a
 * fixed sequence of the calls above, so it runs here in one call, and in one team, with no Python
 * between layers: per layer  h += wo . attend(rope(wqkv . rmsnorm(h)))  and
 * h += w2 . swiglu(w13 . rmsnorm(h)),  then logits = head . rmsnorm(h). The products and the
 * attention are the same functions the per-block path calls, and the residual adds are the same float
 * additions. */

enum { LW = 11, PL_ANORM = 0, PL_WQKV = 1, PL_WO = 1 + LW, PL_FNORM = 1 + 2 * LW, PL_W13 = 2 + 2 * LW,
       PL_W2 = 2 + 3 * LW, PLAN = 2 + 4 * LW };

static size_t max_size(size_t a, size_t b) { return a > b ? a : b; }

/* How many threads a step runs on. On an idle machine all of them are fastest, but when other work
 * wants the cores (the browser rendering the stream and the web app relaying it, a test run beside
 * the server), a team whose members keep losing their core waits at every phase, and fewer threads are
 * faster (measured on 2 cores beside one busy process: 50 tok/s on 2 threads, 105 on 1; idle, 165 on
 * 2). So the steps are timed: rung k of the ladder runs max(1, nmax >> k) threads, and a step now and
 * then tries a neighbouring rung; the team moves there when that rung's smoothed time is lower. Probes
 * start PROBE_MIN steps apart and back off (doubling, up to PROBE_MAX) while they lose, so an idle
 * machine pays ~2% for them and a change in the machine's load is noticed within about half a second.
 * A change of shape (batch, layers, thread count) forgets the times but keeps the rung: the load on the
 * machine does not depend on the request. The results do not depend on the rung: every product and
 * attention is cut the same way for any number of threads. */
#define RUNGS 8
#define PROBE_MIN 4
#define PROBE_MAX 64
static struct {
    int64_t B, layers;
    int nmax, rungs, cur, pinned, probes, gap;
    int64_t until; /* steps before the next probe */
    double ms[RUNGS]; /* smoothed step time per rung; 0: not timed yet */
} LADDER;

static int rung_threads(int k) { return LADDER.nmax >> k > 1 ? LADDER.nmax >> k : 1; }

static int ladder_pick(int64_t B, int64_t layers, int nmax) {
    if (B != LADDER.B || layers != LADDER.layers || nmax != LADDER.nmax) {
        LADDER.B = B;
        LADDER.layers = layers;
        LADDER.nmax = nmax;
        for (LADDER.rungs = 1; LADDER.rungs < RUNGS && rung_threads(LADDER.rungs - 1) > 1; LADDER.rungs++) {}
        LADDER.cur = LADDER.cur < LADDER.rungs ? LADDER.cur : LADDER.rungs - 1;
        LADDER.gap = LADDER.until = PROBE_MIN;
        memset(LADDER.ms, 0, sizeof LADDER.ms);
    }
    if (LADDER.pinned) return -1;
    if (--LADDER.until > 0 || LADDER.rungs == 1 || LADDER.ms[LADDER.cur] == 0.0) return LADDER.cur;
    LADDER.until = LADDER.gap;
    int down = LADDER.cur + 1 < LADDER.rungs, up = LADDER.cur > 0;
    int go_up = up && (!down || LADDER.probes++ % 2);
    return LADDER.cur + (go_up ? -1 : 1);
}

static void ladder_record(int rung, double ms) {
    if (rung < 0) return;
    double *m = &LADDER.ms[rung];
    *m = *m == 0.0 ? ms : *m + (rung == LADDER.cur ? 0.25 : 0.5) * (ms - *m);
    if (rung == LADDER.cur) return;
    if (*m < 0.97 * LADDER.ms[LADDER.cur]) {  /* the probe won: move, and probe again soon */
        LADDER.cur = rung;
        LADDER.gap = LADDER.until = PROBE_MIN;
    } else if (LADDER.gap < PROBE_MAX) {
        LADDER.gap *= 2;
    }
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

/* A step's attention in one layer for one group of rows at position pos: c is the group's cache row
 * for the layer (k, v, slots, half: float16 buffers); the token goes to slot pos % slots and sees min(pos + 1, slots) slots. */
static attend_t step_attention(const int64_t *c, int64_t B, int64_t hq, int64_t hkv, int64_t hd, int64_t pos,
                               float *qkv, float *o, const float *cos, const float *sin) {
    attend_t at = {B, hq, hkv, hd, c[2], pos % c[2], pos + 1 < c[2] ? pos + 1 : c[2], qkv,
                   (void *)(intptr_t)c[0], (void *)(intptr_t)c[1], o, cos, sin, c[3] != 0};
    return at;
}

/* One group of a step: `rows` consecutive rows of h that share a KV cache and a position (one
 * request's samples). groups: int64 [G, GROUP]. */
enum { GR_ROWS = 0, GR_POS = 1, GR_COS = 2, GR_SIN = 3, GR_CACHE = 4, GROUP = 5 };
enum { CACHE_ROW = 4 }; /* a cache's row per layer: k, v, slots, half */

static attend_t group_attention(const int64_t *gr, int64_t layer, int64_t hq, int64_t hkv, int64_t hd, float *qkv,
                                float *o) {
    const int64_t *c = (const int64_t *)(intptr_t)gr[GR_CACHE] + layer * CACHE_ROW;
    return step_attention(c, gr[GR_ROWS], hq, hkv, hd, gr[GR_POS], qkv, o, (const float *)(intptr_t)gr[GR_COS],
                          (const float *)(intptr_t)gr[GR_SIN]);
}

/* step(plan, layers, groups, G, hq, hkv, hd, h, head, norm, logits, first, eps)
 * plan: int64 [layers, PLAN]: attn_norm, wqkv (fmt, L, N, K, Kp, qs, d, m, qt, dt, mt), wo (...), ffn_norm, w13, w2;
 * groups: int64 [G, GROUP]: each group's row count, position, cos/sin of that position ([hd/2] each)
 * and KV cache (int64 [layers, CACHE_ROW]: k, v, slots, half; the cache holds exactly the group's rows);
 * h: float32 [B, D] (B = all groups' rows, in group order), the residual (updated in place);
 * head: int64 [11] (as a weight in plan), norm: the final norm; logits: float32 [B - first, V], the logits of
 * rows first..B-1 (a prompt's chunk needs its last row's only; a row's logits are the same either way).
 * The products run over all B rows at once (each row's result is the one it gets alone); the
 * attention runs per group, cut exactly as it is for that group alone. */
static PyObject *py_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[12];
    if (args_i64(args, nargs - 1, 12, a) < 0) return NULL;
    double eps = PyFloat_AsDouble(args[12]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    const int64_t first = a[11];
    const int64_t *plan = (const int64_t *)(intptr_t)a[0], *groups = (const int64_t *)(intptr_t)a[2];
    int64_t layers = a[1], G = a[3], hq = a[4], hkv = a[5], hd = a[6], B = 0;
    float *h = (float *)(intptr_t)a[7];
    const packed_t head = packed_from((const int64_t *)(intptr_t)a[8]);
    const float *norm = (const float *)(intptr_t)a[9];
    float *logits = (float *)(intptr_t)a[10];
    if (G < 1) {
        PyErr_SetString(PyExc_ValueError, "step: no groups");
        return NULL;
    }
    for (int64_t g = 0; g < G; g++) {
        const int64_t *gr = groups + g * GROUP;
        if (gr[GR_ROWS] < 1 || gr[GR_POS] < 0 || !gr[GR_CACHE] || !gr[GR_COS] || !gr[GR_SIN]) {
            PyErr_Format(PyExc_ValueError, "step: group %lld is malformed", (long long)g);
            return NULL;
        }
        B += gr[GR_ROWS];
    }
    if (first < 0 || first >= B) {
        PyErr_Format(PyExc_ValueError, "step: logits from row %lld of %lld rows", (long long)first, (long long)B);
        return NULL;
    }
    int nthreads = omp_get_max_threads();
    int64_t qkv_w = 0, o_w = 0, u_w = 0;
    size_t act = act_bytes(&head, B, PRE_RMSNORM, nthreads, NULL), att = 0;
    /* every layer's attentions, per group, and how they are cut (filled in once the widths are known) */
    attend_t *ats = (attend_t *)malloc((sizeof(attend_t) + sizeof(attend_cut_t)) * (size_t)(layers * G));
    if (!ats) return PyErr_NoMemory();
    attend_cut_t *cuts = (attend_cut_t *)(ats + layers * G);
    for (int64_t i = 0; i < layers; i++) {
        const int64_t *p = plan + i * PLAN;
        if (p[PL_WQKV + 2] != (hq + 2 * hkv) * hd || p[PL_WO + 3] != hq * hd || p[PL_W2 + 3] * 2 != p[PL_W13 + 2]
            || p[PL_WQKV + 1] != 1 || p[PL_WO + 1] != 1 || p[PL_W13 + 1] != 1 || p[PL_W2 + 1] != 1) {
            PyErr_Format(PyExc_ValueError, "step: layer %lld does not fit the plan", (long long)i);
            free(ats);
            return NULL;
        }
        for (int64_t g = 0; g < G; g++) {
            const int64_t *c = (const int64_t *)(intptr_t)groups[g * GROUP + GR_CACHE] + i * CACHE_ROW;
            attend_t at = c[2] >= 1 ? group_attention(groups + g * GROUP, i, hq, hkv, hd, NULL, NULL) : (attend_t){0};
            if (!attend_args_ok(hq, hkv, hd, at.slots, at.slot, at.nvis)) {
                PyErr_Format(PyExc_ValueError, "step: layer %lld of group %lld does not fit the plan", (long long)i,
                             (long long)g);
                free(ats);
                return NULL;
            }
        }
        qkv_w = p[PL_WQKV + 2] > qkv_w ? p[PL_WQKV + 2] : qkv_w;
        o_w = p[PL_WO + 3] > o_w ? p[PL_WO + 3] : o_w;
        u_w = p[PL_W13 + 2] > u_w ? p[PL_W13 + 2] : u_w;
        packed_t wqkv = packed_from(p + PL_WQKV), wo = packed_from(p + PL_WO);
        packed_t w13 = packed_from(p + PL_W13), w2 = packed_from(p + PL_W2);
        act = max_size(act, act_bytes(&wqkv, B, PRE_RMSNORM, nthreads, NULL));
        act = max_size(act, act_bytes(&wo, B, PRE_NONE, nthreads, NULL));
        act = max_size(act, act_bytes(&w13, B, PRE_RMSNORM, nthreads, NULL));
        act = max_size(act, act_bytes(&w2, B, PRE_SWIGLU, nthreads, NULL));
    }
    for (int64_t i = 0; i < layers; i++) {
        attend_t *at = ats + i * G;
        for (int64_t g = 0; g < G; g++) {
            at[g] = group_attention(groups + g * GROUP, i, hq, hkv, hd, NULL, NULL);
            cuts[i * G + g] = attend_cut(at + g);
        }
        attend_share(at, cuts + i * G, G);
        att = max_size(att, attend_scratch(at, cuts + i * G, G, nthreads));
    }
    size_t fbytes = sizeof(float) * (size_t)(B * (qkv_w + o_w + u_w) + att);
    int8_t *buf = (int8_t *)aligned_alloc(64, (act + fbytes + 63) / 64 * 64);
    if (!buf) {
        free(ats);
        return PyErr_NoMemory();
    }
    float *qkv = (float *)(buf + act), *o = qkv + B * qkv_w, *u = o + B * o_w, *scratch = u + B * u_w;
    for (int64_t i = 0; i < layers; i++)
        for (int64_t g = 0, r0 = 0; g < G; r0 += groups[g * GROUP + GR_ROWS], g++) {
            ats[i * G + g].qkv = qkv + r0 * qkv_w;
            ats[i * G + g].out = o + r0 * o_w;
        }
    float e = (float)eps;
    team_t team = {0, 0};
    int rung = ladder_pick(B, layers, nthreads);
    int threads = rung < 0 ? LADDER.pinned : rung_threads(rung);
    double t0 = now_ms();
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads < nthreads ? threads : nthreads)
    {
        int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        for (int64_t i = 0; i < layers; i++) {
            const int64_t *p = plan + i * PLAN;
            packed_t wqkv = packed_from(p + PL_WQKV), wo = packed_from(p + PL_WO);
            packed_t w13 = packed_from(p + PL_W13), w2 = packed_from(p + PL_W2);
            act_t aq = act_at(buf, &wqkv, B, PRE_RMSNORM, nthreads), ao = act_at(buf, &wo, B, PRE_NONE, nthreads);
            act_t au = act_at(buf, &w13, B, PRE_RMSNORM, nthreads), ad = act_at(buf, &w2, B, PRE_SWIGLU, nthreads);
            linear_team(&wqkv, B, h, qkv, PRE_RMSNORM, (const float *)(intptr_t)p[PL_ANORM], 0, e, 0, &aq, tid, nth,
                        &team);
            attend_team_n(ats + i * G, cuts + i * G, G, nthreads, scratch, tid, nth, &team);
            linear_team(&wo, B, o, h, PRE_NONE, NULL, 0, e, 1, &ao, tid, nth, &team);
            linear_team(&w13, B, h, u, PRE_RMSNORM, (const float *)(intptr_t)p[PL_FNORM], 0, e, 0, &au, tid, nth,
                        &team);
            linear_team(&w2, B, u, h, PRE_SWIGLU, NULL, 0, e, 1, &ad, tid, nth, &team);
        }
        act_t ah = act_at(buf, &head, B - first, PRE_RMSNORM, nthreads);
        linear_team(&head, B - first, h + first * head.K, logits, PRE_RMSNORM, norm, 0, e, 0, &ah, tid, nth, &team);
    }
    Py_END_ALLOW_THREADS
    ladder_record(rung, now_ms() - t0);
    free(buf);
    free(ats);
    Py_RETURN_NONE;
}

/* pre_row(pre, x, K, level, out, g, eps): one row as a product sees it, by the loops of one level (0: the
 * scalar ones, 1: AVX2; a level the CPU's kernels lack is refused). The tests hold the RMSNorm of both
 * levels to the same values bit for bit. */
static PyObject *py_pre_row(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[6];
    if (args_i64(args, nargs - 1, 6, a) < 0) return NULL;
    double eps = PyFloat_AsDouble(args[6]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    int pre = (int)a[0], level = (int)a[3];
    int64_t K = a[2];
    const float *x = (const float *)(intptr_t)a[1], *g = (const float *)(intptr_t)a[5];
    float *out = (float *)(intptr_t)a[4];
    int top = pre_level();
    if ((pre != PRE_RMSNORM && pre != PRE_SWIGLU) || level < 0 || level > top || K < 1) {
        PyErr_Format(PyExc_ValueError, "pre_row: pre %d at level %d (this CPU's kernels go to %d)", pre, level, top);
        return NULL;
    }
    const float *r = pre_row(pre, x, K, g, (float)eps, out, level);
    if (r != out) memcpy(out, r, sizeof(float) * (size_t)K);
    Py_RETURN_NONE;
}

static PyObject *py_kernel(PyObject *self, PyObject *noargs) { return PyUnicode_FromString(KERNEL); }

/* tile_min_rows(n): from how many rows per lane a product runs on the AMX tiles; n >= 1 sets it, 0 only
 * reads. Returns the setting before (0: this kernel has no tiles). */
static PyObject *py_tile_min_rows(PyObject *self, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "tile_min_rows: n must be >= 1 (or 0 to read)");
        return NULL;
    }
#ifdef LP_X86
    int before = USE_AMX ? AMX_MIN_ROWS : 0;
    if (n) AMX_MIN_ROWS = (int)n;
    return PyLong_FromLong(before);
#else
    return PyLong_FromLong(0);
#endif
}

/* quantize(fast, K, Kp, paired, x, q, q2, d, s): one row's activations as the products quantize them
 * (q2 = 0: no rounding rest), by the scalar loop (fast = 0) or the AVX2 one; the tests compare them. */
static PyObject *py_quantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[9];
    if (args_i64(args, nargs, 9, a) < 0) return NULL;
    if (a[1] < 1 || a[2] < a[1] || a[2] % QK) {
        PyErr_SetString(PyExc_ValueError, "quantize: K must be at least 1 and Kp a multiple of 32 no less than K");
        return NULL;
    }
#ifdef LP_X86
    __builtin_cpu_init();
    if (a[0] && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) {
#else
    if (a[0]) {
#endif
        PyErr_SetString(PyExc_RuntimeError, "quantize: this CPU has no AVX2 loop");
        return NULL;
    }
    (a[0] ? QUANTIZE_FAST : quantize_act)((const float *)(intptr_t)a[4], a[1], a[2], (int8_t *)(intptr_t)a[5],
                                          (float *)(intptr_t)a[7], (float *)(intptr_t)a[8], (int)a[3],
                                          a[6] ? (int8_t *)(intptr_t)a[6] : NULL);
    Py_RETURN_NONE;
}

/* kernels(): the kernels this CPU can run, the one chosen at import last */
static PyObject *py_kernels(PyObject *self, PyObject *noargs) {
#ifdef LP_X86
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (has_amx()) return Py_BuildValue("(ssss)", "generic", "avx2", "vnni", "amx");
    if (has_vnni()) return Py_BuildValue("(sss)", "generic", "avx2", "vnni");
    if (avx2) return Py_BuildValue("(ss)", "generic", "avx2");
#endif
    return Py_BuildValue("(s)", "generic");
}

/* step_threads(n): n >= 1 pins the threads a step runs on, 0 lets the ladder choose; returns the
 * count the next step would run on (-1 pins nothing and changes nothing). */
static PyObject *py_step_threads(PyObject *self, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < -1) {
        PyErr_SetString(PyExc_ValueError, "step_threads: n must be >= 0 (or -1 to read)");
        return NULL;
    }
    if (n >= 0) LADDER.pinned = (int)n;
    if (LADDER.pinned) return PyLong_FromLong(LADDER.pinned);
    return PyLong_FromLong(LADDER.nmax ? rung_threads(LADDER.cur) : omp_get_max_threads());
}

/* activation_bits(bits): 8 or 16 (see quantize_act); returns the previous setting. 0 only reads it. */
static PyObject *py_activation_bits(PyObject *self, PyObject *arg) {
    long bits = PyLong_AsLong(arg);
    if (bits == -1 && PyErr_Occurred()) return NULL;
    if (bits != 0 && bits != 8 && bits != 16) {
        PyErr_SetString(PyExc_ValueError, "activation bits must be 8 or 16");
        return NULL;
    }
    int before = ACT_BITS;
    if (bits) ACT_BITS = (int)bits;
    return PyLong_FromLong(before);
}

#ifdef LP_X86
static int has_vnni(void) {  /* __builtin_cpu_supports also checks that the OS keeps the AVX-512 state */
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")
           && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")
           && __builtin_cpu_supports("avx512vnni");
}
#endif

/* use(name): pick the dot kernel ("vnni", "avx2" or "generic"; the tests compare them) */
static PyObject *py_use(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
#ifdef LP_X86
    USE_AMX = 0;
#endif
    if (strcmp(name, "generic") == 0) { DOT = dot_generic; TILE16 = NULL; KERNEL = "generic"; Py_RETURN_NONE; }
#ifdef LP_X86
    if (strcmp(name, "avx2") == 0) {
        __builtin_cpu_init();
        if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))) {
            PyErr_SetString(PyExc_RuntimeError, "this CPU lacks AVX2/FMA/F16C");
            return NULL;
        }
        DOT = dot_avx2; TILE16 = NULL; KERNEL = "avx2"; Py_RETURN_NONE;
    }
    if (strcmp(name, "vnni") == 0) {
        if (!has_vnni()) {
            PyErr_SetString(PyExc_RuntimeError, "this CPU lacks AVX-512 VNNI (with AVX-512VL, AVX2, FMA, F16C)");
            return NULL;
        }
        DOT = dot_avx2; TILE16 = tile16b_vnni; KERNEL = "vnni"; Py_RETURN_NONE;
    }
    if (strcmp(name, "amx") == 0) {
        if (!has_amx()) {
            PyErr_SetString(PyExc_RuntimeError, "this CPU (or kernel) offers no AMX-INT8 tiles with AVX-512");
            return NULL;
        }
        DOT = dot_avx2; TILE16 = tile16b_vnni; USE_AMX = 1; KERNEL = "amx"; Py_RETURN_NONE;
    }
#endif
    PyErr_Format(PyExc_ValueError, "unknown or unavailable kernel %s", name);
    return NULL;
}

static PyMethodDef METHODS[] = {
    {"pre_row", (PyCFunction)(void (*)(void))py_pre_row, METH_FASTCALL, "A row as a product sees it (tests)."},
    {"pack", (PyCFunction)(void (*)(void))py_pack, METH_FASTCALL, "pack(fmt, rows, K, Kp, src, qs, d, m)"},
    {"unpack", (PyCFunction)(void (*)(void))py_unpack, METH_FASTCALL, "unpack(fmt, rows, K, Kp, qs, d, m, dst)"},
    {"top2", (PyCFunction)(void (*)(void))py_top2, METH_FASTCALL,
     "top2(x, rows, V, idx, val): each row's two largest values and their indices"},
    {"tile_pack", (PyCFunction)(void (*)(void))py_tile_pack, METH_FASTCALL,
     "tile_pack(fmt, L, N, Kp, qs, d, m, qt, dt, mt): the weight's copy for the AMX tiles"},
    {"linear", (PyCFunction)(void (*)(void))py_linear, METH_FASTCALL,
     "linear(fmt, L, N, K, Kp, M, qs, d, m, qt, dt, mt, x, y, pre, g, g_per_lane, eps)"},
    {"attend", (PyCFunction)(void (*)(void))py_attend, METH_FASTCALL,
     "attend(N, hq, hkv, hd, qkv, cos, sin, kc, vc, slots, slot, nvis, out, half)"},
    {"step", (PyCFunction)(void (*)(void))py_step, METH_FASTCALL,
     "step(plan, layers, groups, G, hq, hkv, hd, h, head, norm, logits, first, eps)"},
    {"kernel", py_kernel, METH_NOARGS, "the dot-product kernel in use"},
    {"step_threads", py_step_threads, METH_O, "step_threads(n): pin (n >= 1) or free (0) a step's threads"},
    {"activation_bits", py_activation_bits, METH_O, "activation_bits(8 | 16 | 0) -> the previous setting"},
    {"quantize", (PyCFunction)(void (*)(void))py_quantize, METH_FASTCALL,
     "quantize(fast, K, Kp, paired, x, q, q2, d, s)"},
    {"kernels", py_kernels, METH_NOARGS, "kernels(): the kernels this CPU can run"},
    {"use", py_use, METH_O, "use('amx' | 'vnni' | 'avx2' | 'generic')"},
    {"tile_min_rows", py_tile_min_rows, METH_O, "tile_min_rows(n) -> rows from which products run on AMX tiles (0: none)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_lowbit", "Low-bit CPU matrix products.", -1, METHODS};

PyMODINIT_FUNC PyInit__lowbit(void) {
#ifdef LP_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
        DOT = dot_avx2;
        KERNEL = "avx2";
    }
    if (has_vnni()) {
        TILE16 = tile16b_vnni;
        KERNEL = "vnni";
    }
    if (has_amx()) {
        USE_AMX = 1;
        KERNEL = "amx";
    }
#endif
    return PyModule_Create(&MODULE);
}
