/* kvwire's CPU decode kernels: the few ops a decode step spends its time in, for few rows.
 *
 * Built at first use by kvwire_kernels/cpu.py with the machine's own flags (-march=native), so the
 * 16-wide vectors below become AVX-512 registers where the CPU has them and pairs of AVX2 registers
 * where it does not. Plain C (GCC vector extensions; intrinsics only for byte widening and the
 * AVX512-VNNI int8 dot products; no torch headers): it compiles in about a second and is called
 * through ctypes with raw pointers.
 *
 * Determinism: every output element is computed with the same sequence of operations whatever
 * the number of rows in the call, the tile it falls in or the thread count (by one thread, except
 * attention, whose fixed position chunks are merged in order; see kvw_paged_attention).
 * So a row's result does not depend on what it was batched with: a speculative verification of
 * k + 1 rows gives each row exactly the logits one-row decoding gives (greedy exactness).
 *
 * Layouts (row-major, contiguous):
 *   x [rows, in] fp32; weights [out, in] int8 (per-output-row fp32 scale), bf16 (uint16 bits,
 *   optional scale) or fp32; y [rows, out] fp32.
 *   KV pages [num_pages, num_kv_heads, block_size, head_dim] fp8 e4m3 (bytes) or bf16 (uint16),
 *   scales [num_pages, num_kv_heads, block_size] bf16 bits (fp8 only); see kvwire_kernels/reference.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* ---- tuned: each constant below was chosen by a measurement in docs/decisions/044-cpu-kernel-tuning.md.
 * Only ATT_CHUNK changes results (the order attention's partial sums merge in); the rest is speed. */
/* Bytes of software prefetch ahead of a one-row (batch-1) weight stream: AMX builds only, the other
 * CPUs measured stream one row fastest on their hardware prefetchers alone. */
#if defined(__AMX_TILE__) && !defined(KVW_ROW_PF)
#define KVW_ROW_PF 2048
#endif
#ifndef KVW_PF
#define KVW_PF 2048  /* bytes of prefetch ahead of a weight row that several activation rows share */
#endif
#ifndef L1_TILE_MAX_IN
#define L1_TILE_MAX_IN 1024  /* widest input whose 4-row fp32 weight tile (16 KB) is kept in L1 */
#endif
#define GEMM_NR 12  /* activation rows per kvw_gemm_i8a8 tile (x 16 outputs); range_gemm's switch spells 1-11 */
#define QUANT_SPLIT_ROWS 16  /* a GEMM of this many activation rows or more quantizes them on every thread */
#ifndef KVW_AMX_MIN_ROWS
#define KVW_AMX_MIN_ROWS 3  /* rows from which a kvw_gemm_i8a8 tile goes to AMX instead of VNNI */
#endif
#ifndef ATT_GROUP
#define ATT_GROUP 16  /* rows of one sequence that share each position's K/V read in attention */
#endif
#ifndef ATT_CHUNK
#define ATT_CHUNK 64  /* positions per attention task, a multiple of 16 */
#endif

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE f32x16 load_f32(const float *p) { f32x16 v; memcpy(&v, p, 64); return v; }
ALWAYS_INLINE void store_f32(float *p, f32x16 v) { memcpy(p, &v, 64); }
/* Byte -> 32-bit widening: GCC scalarizes __builtin_convertvector for bytes, so it is spelled out. */
ALWAYS_INLINE i32x16 widen_i8(const int8_t *p) {
#if defined(__AVX512F__)
    __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i v[2] = {_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))};
#else
    int32_t v[16]; for (int i = 0; i < 16; i++) v[i] = p[i];
#endif
    i32x16 r; memcpy(&r, &v, 64); return r;
}
ALWAYS_INLINE u32x16 widen_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i v[2] = {_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))};
#else
    uint32_t v[16]; for (int i = 0; i < 16; i++) v[i] = p[i];
#endif
    u32x16 r; memcpy(&r, &v, 64); return r;
}
ALWAYS_INLINE f32x16 load_i8(const int8_t *p) { return __builtin_convertvector(widen_i8(p), f32x16); }
ALWAYS_INLINE f32x16 load_bf16(const uint16_t *p) {
    u16x16 h; memcpy(&h, p, 32);
    u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    return (f32x16)w;
}
/* e4m3fn -> fp32, exactly: exponent and mantissa move into fp32's fields (bias 127 instead of 7,
 * so scale by 2^120); subnormals become fp32 subnormals, which the multiplication makes exact. */
ALWAYS_INLINE f32x16 load_fp8(const uint8_t *p) {
    u32x16 w = widen_u8(p);
    u32x16 bits = ((w & 0x7Fu) << 20) | ((w & 0x80u) << 24);
    return (f32x16)bits * 0x1p120f;
}
/* load_fp8 times 2^-8, exactly, through the half-precision converter (4 instructions per 16 values,
 * three of them 256 bits wide, against load_fp8's 6 of 512): the byte sign-extended to 16 bits
 * and shifted left by 7 holds e4m3's exponent and mantissa in fp16's fields (bias 15 instead of 7,
 * hence 2^-8) once bit 14, a copy of the sign, is cleared; subnormals stay subnormals. A caller
 * multiplies 2^8 into a scale it applies anyway: scaling by a power of two is exact, so every
 * product, sum and scaled result has load_fp8's bits. */
ALWAYS_INLINE f32x16 load_fp8_x2e8(const uint8_t *p) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7),
                                       _mm256_set1_epi16((short)0xBFFF));
#if defined(__AVX512F__)
    __m512 v = _mm512_cvtph_ps(h);
#else
    __m256 v[2] = {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
#endif
    f32x16 r; memcpy(&r, &v, 64); return r;
#else
    return load_fp8(p) * 0x1p-8f;
#endif
}
#define KV_FP8_UNIT 0x1p8f  /* what load_fp8_x2e8's callers multiply into their scales */
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef float f32x2 __attribute__((vector_size(8)));
ALWAYS_INLINE float hsum(f32x16 v) {  /* a fixed tree (halves, then quarters...), so the same bits everywhere */
    f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    f32x2 c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
    return c[0] + c[1];
}
static inline float bf16_to_f32(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }
static inline float f32_from(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }

/* ---- linear: y = x @ w.T (* scale) (+ bias) (+ residual) ------------------------------------ */
/* Per output element: two accumulators (even and odd 16-wide chunks of the input), added, reduced
 * by hsum, then the scalar tail, then scale, bias, residual — the same steps for every element. */

#define WT_I8 0
#define WT_BF16 1
#define WT_F32 2
#define WT_I8A8 3  /* int8 weights x int8 activations (kvw_linear_i8a8, VNNI builds only) */
#define WT_I8A8_PACKED 4  /* the same, weights packed for kvw_gemm_i8a8 (VNNI builds only) */
#define WT_BF16A16 5  /* bf16 weights x bf16 activations (kvw_linear_bf16a16, AVX512-BF16 builds only) */
#define WT_Q4_0 6  /* GGUF blocks as stored, packed for kvw_gemm_q4_0 ... q6_k (gguf_blocks.c) */
#define WT_Q4_1 7
#define WT_Q8_0 8
#define WT_Q4_K 9
#define WT_Q5_K 10
#define WT_Q6_K 11
#define WT_ROWS 12  /* w: kvw_linear_t parts (ended by one with out 0) whose outputs lie side by side */

ALWAYS_INLINE f32x16 load_w(const void *w, int64_t i, const int wt) {
    if (wt == WT_I8) return load_i8((const int8_t *)w + i);
    if (wt == WT_BF16) return load_bf16((const uint16_t *)w + i);
    return load_f32((const float *)w + i);
}
ALWAYS_INLINE float scalar_w(const void *w, int64_t i, const int wt) {
    if (wt == WT_I8) return (float)((const int8_t *)w)[i];
    if (wt == WT_BF16) return bf16_to_f32(((const uint16_t *)w)[i]);
    return ((const float *)w)[i];
}
ALWAYS_INLINE size_t w_size(const int wt) { return wt == WT_I8 ? 1 : wt == WT_BF16 ? 2 : 4; }

/* One tile: NO output rows starting at o0 (whose weights start at w), NR activation rows from r0. */
ALWAYS_INLINE void linear_tile(const float *x, int64_t in, const void *w, int64_t o0, int64_t r0,
                               int64_t out, float *y, const float *scale, const float *bias,
                               const float *res, const int wt, const int NO, const int NR) {
    f32x16 acc[4][4][2];  /* fixed sizes (not VLAs), so that the accumulators live in registers */
    for (int o = 0; o < NO; o++)
        for (int r = 0; r < NR; r++) acc[o][r][0] = acc[o][r][1] = (f32x16){0};
    const char *wb = (const char *)w;
    const size_t ws = w_size(wt);
    int64_t i = 0;
    for (; i + 32 <= in; i += 32) {  /* chunk i into accumulator 0, chunk i + 16 into accumulator 1 */
        for (int half = 0; half < 2; half++) {
            f32x16 wv[4];
            for (int o = 0; o < NO; o++) wv[o] = load_w(wb + (size_t)o * in * ws, i + 16 * half, wt);
            for (int r = 0; r < NR; r++) {
                f32x16 xv = load_f32(x + (r0 + r) * in + i + 16 * half);
                for (int o = 0; o < NO; o++) acc[o][r][half] += wv[o] * xv;
            }
        }
    }
    if (i + 16 <= in) {
        f32x16 wv[4];
        for (int o = 0; o < NO; o++) wv[o] = load_w(wb + (size_t)o * in * ws, i, wt);
        for (int r = 0; r < NR; r++) {
            f32x16 xv = load_f32(x + (r0 + r) * in + i);
            for (int o = 0; o < NO; o++) acc[o][r][0] += wv[o] * xv;
        }
        i += 16;
    }
    for (int o = 0; o < NO; o++) {
        const void *wr = wb + (size_t)o * in * ws;
        for (int r = 0; r < NR; r++) {
            float s = hsum(acc[o][r][0] + acc[o][r][1]);
            for (int64_t t = i; t < in; t++) s += scalar_w(wr, t, wt) * x[(r0 + r) * in + t];
            if (scale) s *= scale[o0 + o];
            if (bias) s += bias[o0 + o];
            int64_t k = (r0 + r) * out + o0 + o;
            y[k] = res ? res[k] + s : s;
        }
    }
}

#define TILE_CASES(NO, W, WT) \
    switch (nr) { case 1: linear_tile(x, in, W, o, r, out, y, scale, bias, res, WT, NO, 1); break; \
                  case 2: linear_tile(x, in, W, o, r, out, y, scale, bias, res, WT, NO, 2); break; \
                  case 3: linear_tile(x, in, W, o, r, out, y, scale, bias, res, WT, NO, 3); break; \
                  default: linear_tile(x, in, W, o, r, out, y, scale, bias, res, WT, NO, 4); break; }

ALWAYS_INLINE void linear_range(const float *x, int64_t rows, int64_t in, const void *w, int64_t out,
                                int64_t o_begin, int64_t o_end, float *y, const float *scale,
                                const float *bias, const float *res, const int wt) {
    /* One activation row (batch-1 decode): one output row at a time, so the weights stream
     * sequentially and the prefetchers keep up (8 interleaved rows per tile ran at about half the
     * bandwidth; the loop over output rows still overlaps their FMA chains out of order).
     * 2-4 rows: 4 output x all rows, converting weights on the fly. More rows (batched decode,
     * verification): each 4-row weight tile is converted to fp32 once into an L1 buffer, then every
     * group of 4 activation rows runs on it, so the conversion no longer scales with the rows
     * (for inputs up to L1_TILE_MAX_IN wide; wider ones convert on the fly, 4 x 4 tiles).
     * The per-element arithmetic is the same in every case (conversions are exact). */
    const size_t ws = w_size(wt);
    if (rows > 4 && wt != WT_F32 && in <= L1_TILE_MAX_IN) {  /* the fp32 tile stays in L1 */
        float *buf = malloc(sizeof(float) * 4 * in);
        for (int64_t o = o_begin; o < o_end;) {
            const int64_t no = o_end - o >= 4 ? 4 : 1;
            const char *src = (const char *)w + (size_t)o * in * ws;
            for (int64_t k = 0; k < no; k++) {
                int64_t i = 0;
                for (; i + 16 <= in; i += 16) store_f32(buf + k * in + i, load_w(src + (size_t)k * in * ws, i, wt));
                for (; i < in; i++) buf[k * in + i] = scalar_w(src + (size_t)k * in * ws, i, wt);
            }
            for (int64_t r = 0; r < rows; r += 4) {
                const int64_t nr = rows - r < 4 ? rows - r : 4;
                if (no == 4) { TILE_CASES(4, buf, WT_F32) }
                else { TILE_CASES(1, buf, WT_F32) }
            }
            o += no;
        }
        free(buf);
        return;
    }
    const int64_t ot = rows == 1 ? 1 : 4;
    for (int64_t o = o_begin; o < o_end;) {
        const int64_t left = o_end - o, no = left >= ot ? ot : left >= 4 ? 4 : 1;
        const char *wo = (const char *)w + (size_t)o * in * ws;
        for (int64_t r = 0; r < rows; r += 4) {
            const int64_t nr = rows - r < 4 ? rows - r : 4;
            if (no == 4) { TILE_CASES(4, wo, wt) }
            else { TILE_CASES(1, wo, wt) }
        }
        o += no;
    }
}

/* Inside a parallel region: this thread's contiguous range of output rows [o0, o1), in multiples
 * of 8, so each output element has one owner whatever the thread count. */
ALWAYS_INLINE void thread_outputs(int64_t out, int64_t *o0, int64_t *o1) {
    const int64_t chunks = (out + 7) / 8, nt = omp_get_num_threads(), id = omp_get_thread_num();
    *o0 = chunks * id / nt * 8;
    *o1 = chunks * (id + 1) / nt * 8 < out ? chunks * (id + 1) / nt * 8 : out;
}

static void linear(const float *x, int64_t rows, int64_t in, const void *w, int64_t out, float *y,
                   const float *scale, const float *bias, const float *res, int nthreads, const int wt) {
    /* Threads take contiguous ranges of output rows (multiples of 8), so each element has one owner. */
#pragma omp parallel num_threads(nthreads)
    {
        int64_t o0, o1;
        thread_outputs(out, &o0, &o1);
        if (o0 < o1) {
            if (wt == WT_I8) linear_range(x, rows, in, w, out, o0, o1, y, scale, bias, res, WT_I8);
            else if (wt == WT_BF16) linear_range(x, rows, in, w, out, o0, o1, y, scale, bias, res, WT_BF16);
            else linear_range(x, rows, in, w, out, o0, o1, y, scale, bias, res, WT_F32);
        }
    }
}

void kvw_linear_i8(const float *x, int64_t rows, int64_t in, const int8_t *w, int64_t out, float *y,
                   const float *scale, const float *bias, const float *res, int nthreads) {
    linear(x, rows, in, w, out, y, scale, bias, res, nthreads, WT_I8);
}
void kvw_linear_bf16(const float *x, int64_t rows, int64_t in, const uint16_t *w, int64_t out, float *y,
                     const float *scale, const float *bias, const float *res, int nthreads) {
    linear(x, rows, in, w, out, y, scale, bias, res, nthreads, WT_BF16);
}
void kvw_linear_f32(const float *x, int64_t rows, int64_t in, const float *w, int64_t out, float *y,
                    const float *scale, const float *bias, const float *res, int nthreads) {
    linear(x, rows, in, w, out, y, scale, bias, res, nthreads, WT_F32);
}

/* ---- bf16 x bf16 linear (AVX512-BF16): y = x @ w.T with x rounded to bf16 ---------------------
 * What bf16 layers run where the CPU has AVX512-BF16: the activations are rounded to bf16 once per
 * call (nearest even, as the PyTorch bf16 path rounds them) and vdpbf16ps multiplies 32 pairs per
 * instruction straight from the stored weights, against converting every weight to fp32 and two
 * FMAs (the path above: batched bf16 steps ran at 0.7x llama.cpp f16's). Each product of two bf16
 * is exact in fp32; the instruction adds the pair's products to the accumulator in a fixed order.
 * Per output element: two accumulators (even and odd 32-input chunks), added, hsum, scale, bias,
 * residual, the same in every tile and thread split. in % 32 == 0. */
#if defined(__AVX512BF16__)
#define KVW_BF16 1
ALWAYS_INLINE void bf16_tile(const uint16_t *xb, int64_t in, const uint16_t *w, int64_t o0, int64_t r0,
                             int64_t out, float *y, const float *scale, const float *bias, const float *res,
                             const int NO, const int NR) {
    __m512 acc[4][4][2];
    for (int o = 0; o < NO; o++)
        for (int r = 0; r < NR; r++) acc[o][r][0] = acc[o][r][1] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= in; i += 64) {
#ifdef KVW_ROW_PF
        if (NO == 1 && NR == 1) {  /* one row's weight stream: fetch ahead (see KVW_ROW_PF) */
            _mm_prefetch((const char *)(w + i) + KVW_ROW_PF, _MM_HINT_T0);
            _mm_prefetch((const char *)(w + i) + KVW_ROW_PF + 64, _MM_HINT_T0);
        }
#endif
        for (int half = 0; half < 2; half++) {
            __m512bh wv[4];
            for (int o = 0; o < NO; o++) wv[o] = (__m512bh)_mm512_loadu_si512(w + (size_t)o * in + i + 32 * half);
            for (int r = 0; r < NR; r++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + (r0 + r) * in + i + 32 * half);
                for (int o = 0; o < NO; o++) acc[o][r][half] = _mm512_dpbf16_ps(acc[o][r][half], wv[o], xv);
            }
        }
    }
    if (i < in) {  /* in % 64 == 32 */
        __m512bh wv[4];
        for (int o = 0; o < NO; o++) wv[o] = (__m512bh)_mm512_loadu_si512(w + (size_t)o * in + i);
        for (int r = 0; r < NR; r++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + (r0 + r) * in + i);
            for (int o = 0; o < NO; o++) acc[o][r][0] = _mm512_dpbf16_ps(acc[o][r][0], wv[o], xv);
        }
    }
    for (int o = 0; o < NO; o++)
        for (int r = 0; r < NR; r++) {
            f32x16 v; __m512 t = _mm512_add_ps(acc[o][r][0], acc[o][r][1]); memcpy(&v, &t, 64);
            float sum = hsum(v);
            if (scale) sum *= scale[o0 + o];
            if (bias) sum += bias[o0 + o];
            const int64_t k = (r0 + r) * out + o0 + o;
            y[k] = res ? res[k] + sum : sum;
        }
}

#define BF16_CASES(NO) \
    switch (nr) { case 1: bf16_tile(xb, in, wo, o, r, out, y, scale, bias, res, NO, 1); break; \
                  case 2: bf16_tile(xb, in, wo, o, r, out, y, scale, bias, res, NO, 2); break; \
                  case 3: bf16_tile(xb, in, wo, o, r, out, y, scale, bias, res, NO, 3); break; \
                  default: bf16_tile(xb, in, wo, o, r, out, y, scale, bias, res, NO, 4); break; }

static void range_bf16(const uint16_t *xb, int64_t rows, int64_t in, const uint16_t *w, int64_t out,
                       int64_t o_begin, int64_t o_end, float *y, const float *scale, const float *bias,
                       const float *res) {
    /* One activation row: one output row at a time (a sequential weight stream); more: 4 output
     * rows (64 x in bytes, L1-resident) against every group of 4 activation rows. */
    const int64_t ot = rows == 1 ? 1 : 4;
    for (int64_t o = o_begin; o < o_end;) {
        const int64_t left = o_end - o, no = left >= ot ? ot : 1;
        const uint16_t *wo = w + (size_t)o * in;
        for (int64_t r = 0; r < rows; r += 4) {
            const int64_t nr = rows - r < 4 ? rows - r : 4;
            if (no == 4) { BF16_CASES(4) } else { BF16_CASES(1) }
        }
        o += no;
    }
}
#endif

int kvw_has_bf16(void) {
#ifdef KVW_BF16
    return 1;
#else
    return 0;
#endif
}

void kvw_linear_bf16a16(const float *x, int64_t rows, int64_t in, const uint16_t *w, int64_t out, float *y,
                        const float *scale, const float *bias, const float *res, int nthreads) {
#ifdef KVW_BF16
    uint16_t *xb = aligned_alloc(64, sizeof(uint16_t) * (size_t)(rows * in + 32));
    for (int64_t k = 0; k < rows * in; k += 32) {  /* in % 32 == 0: whole vectors of one row */
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k));
        _mm512_storeu_si512(xb + k, (__m512i)v);
    }
#pragma omp parallel num_threads(nthreads)
    {
        int64_t o0, o1;
        thread_outputs(out, &o0, &o1);
        if (o0 < o1) range_bf16(xb, rows, in, w, out, o0, o1, y, scale, bias, res);
    }
    free(xb);
#else
    (void)x; (void)rows; (void)in; (void)w; (void)out; (void)y; (void)scale; (void)bias; (void)res; (void)nthreads;
    abort();  /* callers check kvw_has_bf16() first */
#endif
}

/* ---- int8 x int8 linear (AVX512-VNNI): y = sum over blocks of 32 of s_x * (q_x . q_w), * w scale --
 * The activation rows are quantized as llama.cpp's q8_0 does: blocks of 32 values, symmetric int8,
 * one fp32 scale per block (amax / 127; q = round-to-nearest-even(x * (127 / amax)); a zero block
 * has scale 0 and q 0), which kvwire_kernels.reference.quantize_act8 reproduces bit for bit. The weights
 * keep their per-output-row int8 and scale. vpdpbusd multiplies unsigned by signed bytes, so the
 * weights go in as (w + 128) (a byte xor); what that adds, 128 * sum_b s_b * sum(q_b), depends on
 * the activation row only and is subtracted once per output (k below).
 * Per 64 inputs and (output, activation) row: one vpdpbusd, one int32 -> fp32 (exact: each lane
 * sums 4 products), one FMA by the scales (lanes 0-7 carry the first block's, 8-15 the second's),
 * against six vector instructions per 32 weights for the int8 -> fp32 path above. in % 64 == 0.
 * Determinism as above: each element's sequence of operations is the same in every tile. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KVW_VNNI 1
typedef struct {
    int8_t *q;  /* [rows, in] */
    float *s;  /* [rows, in / 4]: per 4 inputs (a vpdpbusd lane), their block's scale */
    float *k;  /* [rows]: 128 * sum over blocks of s_b * sum(q_b) */
} act8_t;

static void quantize_act8(const float *x, int64_t rows, int64_t in, act8_t a) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t r = 0; r < rows; r++) {
        float k = 0.0f;
        for (int64_t i = 0; i < in; i += 64) {
            const float *xp = x + r * in + i;
            __m512 v[4];
            for (int j = 0; j < 4; j++) v[j] = _mm512_loadu_ps(xp + 16 * j);
            float sc[2];
            __m128i b[4];
            for (int h = 0; h < 2; h++) {
                float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[2 * h]), _mm512_abs_ps(v[2 * h + 1])));
                __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
                sc[h] = amax / 127.0f;
                for (int j = 2 * h; j < 2 * h + 2; j++)
                    b[j] = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v[j], inv)));  /* MXCSR: nearest even */
            }
            int8_t *qp = a.q + r * in + i;
            for (int j = 0; j < 4; j++) _mm_storeu_si128((__m128i *)(qp + 16 * j), b[j]);
            /* lane sums of q (exact), then per block: lanes 0-7 and 8-15 */
            __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(qp));
            k += sc[0] * (float)_mm512_mask_reduce_add_epi32(0x00FF, sum) + sc[1] * (float)_mm512_mask_reduce_add_epi32(0xFF00, sum);
            _mm512_storeu_ps(a.s + (r * in + i) / 4, _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sc[0]), _mm512_set1_ps(sc[1])));
        }
        a.k[r] = 128.0f * k;
    }
}

ALWAYS_INLINE void tile_i8a8(act8_t a, int64_t in, const int8_t *w, int64_t o0, int64_t r0, int64_t out,
                             float *y, const float *scale, const float *bias, const float *res, const int NR) {
    /* One output row x NR activation rows: the weight row is read once, as a sequential stream. */
    __m512 acc[4];
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t i = 0; i < in; i += 64) {
        /* Several rows share this weight row, so its stream waits on their arithmetic: fetch
         * ahead in software. One row alone streams faster on the hardware prefetcher only. */
        if (NR > 1) _mm_prefetch((const char *)(w + i) + KVW_PF, _MM_HINT_T0);
        const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(w + i), flip);
        for (int r = 0; r < NR; r++) {
            const int64_t at = (r0 + r) * in + i;
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, _mm512_loadu_si512(a.q + at));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(a.s + at / 4), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) {
        f32x16 v; memcpy(&v, &acc[r], 64);
        float s = hsum(v) - a.k[r0 + r];
        if (scale) s *= scale[o0];
        if (bias) s += bias[o0];
        int64_t k = (r0 + r) * out + o0;
        y[k] = res ? res[k] + s : s;
    }
}

static void range_i8a8(act8_t a, int64_t rows, int64_t in, const int8_t *w, int64_t out, int64_t o_begin,
                       int64_t o_end, float *y, const float *scale, const float *bias, const float *res) {
    /* One output row at a time, so the weights are read as one sequential stream, which the
     * hardware prefetchers follow (interleaved rows ran at half the bandwidth, see
     * docs/decisions/044-cpu-kernel-tuning.md); activation rows in groups of 4, the weight row
     * staying in L1 across the groups. */
    for (int64_t o = o_begin; o < o_end; o++) {
        const int8_t *wo = w + (size_t)o * in;
        for (int64_t r = 0; r < rows; r += 4) {
            switch (rows - r < 4 ? rows - r : 4) {
                case 1: tile_i8a8(a, in, wo, o, r, out, y, scale, bias, res, 1); break;
                case 2: tile_i8a8(a, in, wo, o, r, out, y, scale, bias, res, 2); break;
                case 3: tile_i8a8(a, in, wo, o, r, out, y, scale, bias, res, 3); break;
                default: tile_i8a8(a, in, wo, o, r, out, y, scale, bias, res, 4); break;
            }
        }
    }
}
#endif

int kvw_has_vnni(void) {
#ifdef KVW_VNNI
    return 1;
#else
    return 0;
#endif
}

/* q [rows, in] int8, s [rows, in / 4] fp32, k [rows] fp32 as the kernel reads them (tests). */
void kvw_quantize_act8(const float *x, int64_t rows, int64_t in, int8_t *q, float *s, float *k) {
#ifdef KVW_VNNI
    quantize_act8(x, rows, in, (act8_t){q, s, k});
#else
    (void)x; (void)rows; (void)in; (void)q; (void)s; (void)k;
    abort();  /* callers check kvw_has_vnni() first */
#endif
}

void kvw_linear_i8a8(const float *x, int64_t rows, int64_t in, const int8_t *w, int64_t out, float *y,
                     const float *scale, const float *bias, const float *res, int nthreads) {
#ifdef KVW_VNNI
    act8_t a = {malloc((size_t)rows * in), malloc((size_t)rows * in), malloc(sizeof(float) * rows)};
    quantize_act8(x, rows, in, a);
#pragma omp parallel num_threads(nthreads)
    {
        int64_t o0, o1;
        thread_outputs(out, &o0, &o1);
        if (o0 < o1) range_i8a8(a, rows, in, w, out, o0, o1, y, scale, bias, res);
    }
    free(a.q); free(a.s); free(a.k);
#else
    (void)x; (void)rows; (void)in; (void)w; (void)out; (void)y; (void)scale; (void)bias; (void)res; (void)nthreads;
    abort();
#endif
}

/* ---- int8 x int8 GEMM, AVX512-VNNI: kvw_linear_i8a8's numbers (within fp32 round-off) ------------
 * (q8_0 activations per block of 32, per-row int8 weights and scales, the 128 * ... correction).
 * What int8 layers run on VNNI CPUs, for prompts and the fused step alike; kvw_linear_i8a8 stays
 * for weights in [out, in] order. The weights are repacked once (at load) so that one
 * 512-bit vector holds 16 output rows x 4 consecutive inputs, the layout vpdpbusd sums over:
 *     wp[o / 16][i / 4][o % 16][i % 4] = w[o][i] ^ 0x80   (unsigned, as kvw_linear_i8a8 flips them)
 * A tile of 16 outputs x NR activation rows keeps its int32 sums in registers for a whole block
 * of 32 inputs (8 vpdpbusd, each with the row's 4 activation bytes broadcast from memory), then
 * converts once and adds block scale x sum to fp32 accumulators: 2 ops per 8 vpdpbusd, where the
 * one-output-row kernel above needs 2 per vpdpbusd. A panel of 16 outputs is 16 x in contiguous
 * bytes and panels follow each other, so at one row the weights are still one sequential stream
 * (speed against the bf16 and one-row paths: docs/decisions/044-cpu-kernel-tuning.md). Each output
 * element's operations are the same in every tile (NR) and thread split. Requires out % 16 == 0,
 * in % 64 == 0. */
#ifdef KVW_VNNI
/* A tile's NR rows x 16 outputs from their fp32 accumulators: (acc - k) * scale + bias (+ residual). */
ALWAYS_INLINE void gemm_store(const __m512 *acc, act8_t a, int64_t o0, int64_t r0, int64_t out, float *y,
                              const float *scale, const float *bias, const float *res, const int NR) {
    const __m512 sc = scale ? _mm512_loadu_ps(scale + o0) : _mm512_set1_ps(1.0f);
    const __m512 bi = bias ? _mm512_loadu_ps(bias + o0) : _mm512_setzero_ps();
    for (int r = 0; r < NR; r++) {
        __m512 v = _mm512_fmadd_ps(_mm512_sub_ps(acc[r], _mm512_set1_ps(a.k[r0 + r])), sc, bi);
        float *yp = y + (r0 + r) * out + o0;
        if (res) v = _mm512_add_ps(_mm512_loadu_ps(res + (r0 + r) * out + o0), v);
        _mm512_storeu_ps(yp, v);
    }
}

ALWAYS_INLINE void gemm_tile(act8_t a, int64_t in, const uint8_t *wp, int64_t o0, int64_t r0, int64_t out,
                             float *y, const float *scale, const float *bias, const float *res, const int NR) {
    __m512 acc[GEMM_NR];
    __m512i sum[GEMM_NR];
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < in; b += 32) {
        for (int r = 0; r < NR; r++) sum[r] = _mm512_setzero_si512();
        /* Unrolled: as a loop, GCC 12 copied every sum register twice per multiply at the back edge
         * (measured in docs/decisions/044-cpu-kernel-tuning.md). */
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
#ifdef KVW_ROW_PF
            if (NR == 1) _mm_prefetch((const char *)(wp + (b / 4 + j) * 64) + KVW_ROW_PF, _MM_HINT_T0);
#endif
            const __m512i wv = _mm512_loadu_si512(wp + (b / 4 + j) * 64);
            for (int r = 0; r < NR; r++) {
                int32_t q4; memcpy(&q4, a.q + (r0 + r) * in + b + 4 * j, 4);
                sum[r] = _mm512_dpbusd_epi32(sum[r], wv, _mm512_set1_epi32(q4));
            }
        }
        for (int r = 0; r < NR; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_set1_ps(a.s[((r0 + r) * in + b) / 4]), acc[r]);
    }
    gemm_store(acc, a, o0, r0, out, y, scale, bias, res, NR);
}

/* ---- the same GEMM on AMX tiles (Sapphire Rapids and later: AMX-INT8) ----------------------------
 * The packed panel is already what a tile multiply reads as its B operand: 8 tile rows of 64 bytes
 * (16 outputs x 4 inputs) cover one block of 32 inputs, so B for block b is the 512 contiguous bytes
 * at panel + 16 * b. A is m <= 16 activation rows x the block's 32 bytes (stride in). One tdpbsud
 * (signed activations x unsigned weights: the same products as vpdpbusd above) gives all m x 16
 * int32 block sums; they are stored, and each row's are converted and added to its fp32
 * accumulator by block scale exactly as gemm_tile does, so a row's output is the same bits on AMX
 * and on VNNI, whichever tile it falls in. Two sum tiles alternate (block b + 32 multiplies while
 * block b's sums are scaled). The per-block store and reload of the sums is what this costs, so
 * only tiles of KVW_AMX_MIN_ROWS rows or more go to AMX and shorter tails to gemm_tile (see
 * docs/decisions/044-cpu-kernel-tuning.md).
 * Tiles: 0-1 sums [m x 64 B], 2-3 A [m x 32 B], 4-5 B [8 x 64 B]. Linux hands out AMX state on
 * request (arch_prctl), once per process. */
#if defined(KVW_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KVW_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
static int amx_granted = -1;  /* -1: not asked yet */
static int amx_wanted = 1;

static int amx_permission(void) {
    if (amx_granted < 0) amx_granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_granted;
}

static void amx_configure(int m) {
    struct __attribute__((packed, aligned(64))) {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 2; t++) {
        cfg.colsb[t] = 64; cfg.rows[t] = (uint8_t)m;  /* sums */
        cfg.colsb[2 + t] = 32; cfg.rows[2 + t] = (uint8_t)m;  /* A */
        cfg.colsb[4 + t] = 64; cfg.rows[4 + t] = 8;  /* B */
    }
    _tile_loadconfig(&cfg);
}

ALWAYS_INLINE void amx_scale_block(const int32_t *sums, act8_t a, int64_t in, int64_t r0, int64_t b, __m512 *acc,
                                   const int NR) {
    for (int r = 0; r < NR; r++)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + 16 * r)),
                                 _mm512_set1_ps(a.s[((r0 + r) * in + b) / 4]), acc[r]);
}

/* NR rows from r0 (the tiles configured for NR rows) x one 16-output panel. */
ALWAYS_INLINE void amx_tile(act8_t a, int64_t in, const uint8_t *panel, int64_t o0, int64_t r0, int64_t out,
                            float *y, const float *scale, const float *bias, const float *res, const int NR) {
    __m512 acc[16];
    int32_t sums[2][256] __attribute__((aligned(64)));
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    const int8_t *aq = a.q + r0 * in;
    _tile_zero(0); _tile_loadd(2, aq, in); _tile_loadd(4, panel, 64); _tile_dpbsud(0, 2, 4);
    for (int64_t b = 0; b < in; b += 64) {  /* in % 64 == 0: blocks come in pairs */
        _tile_zero(1); _tile_loadd(3, aq + b + 32, in); _tile_loadd(5, panel + 16 * (b + 32), 64); _tile_dpbsud(1, 3, 5);
        _tile_stored(0, sums[0], 64);
        amx_scale_block(sums[0], a, in, r0, b, acc, NR);
        if (b + 64 < in) {
            _tile_zero(0); _tile_loadd(2, aq + b + 64, in); _tile_loadd(4, panel + 16 * (b + 64), 64); _tile_dpbsud(0, 2, 4);
        }
        _tile_stored(1, sums[1], 64);
        amx_scale_block(sums[1], a, in, r0, b + 32, acc, NR);
    }
    gemm_store(acc, a, o0, r0, out, y, scale, bias, res, NR);
}

/* Rows [0, end) of panels [g_begin, g_end) on AMX; returns end: the tiles of 16 rows, and the last
 * partial one when it has KVW_AMX_MIN_ROWS rows or more (0 when AMX is off or rows are too few). */
#define AMX_CASE(N) case N: amx_tile(a, in, wp + (size_t)g * 16 * in, g * 16, full, out, y, scale, bias, res, N); break;
static int64_t range_amx(act8_t a, int64_t rows, int64_t in, const uint8_t *wp, int64_t out, int64_t g_begin,
                         int64_t g_end, float *y, const float *scale, const float *bias, const float *res) {
    if (rows < KVW_AMX_MIN_ROWS || !amx_wanted || amx_granted != 1) return 0;
    const int64_t full = rows / 16 * 16, tail = rows - full;
    if (full) {
        amx_configure(16);
        for (int64_t g = g_begin; g < g_end; g++)
            for (int64_t r = 0; r < full; r += 16)
                amx_tile(a, in, wp + (size_t)g * 16 * in, g * 16, r, out, y, scale, bias, res, 16);
    }
    if (tail >= KVW_AMX_MIN_ROWS) {
        amx_configure((int)tail);
        for (int64_t g = g_begin; g < g_end; g++)
            switch (tail) {
                AMX_CASE(3) AMX_CASE(4) AMX_CASE(5) AMX_CASE(6) AMX_CASE(7) AMX_CASE(8) AMX_CASE(9)
                AMX_CASE(10) AMX_CASE(11) AMX_CASE(12) AMX_CASE(13) AMX_CASE(14) default: AMX_CASE(15)
            }
    }
    _tile_release();
    return tail >= KVW_AMX_MIN_ROWS ? rows : full;
}
#endif

/* 1 when the GEMM below multiplies on AMX tiles for KVW_AMX_MIN_ROWS rows or more: built with
 * AMX-INT8, the kernel granted the tile state, and not switched off (kvw_set_amx(0)). */
int kvw_set_amx(int on) {
#ifdef KVW_AMX
    amx_wanted = on;
    return amx_wanted && amx_permission();
#else
    (void)on;
    return 0;
#endif
}

#define GEMM_CASE(N) case N: gemm_tile(a, in, panel, o, r, out, y, scale, bias, res, N); break;
static void range_gemm(act8_t a, int64_t rows, int64_t in, const uint8_t *wp, int64_t out, int64_t g_begin,
                       int64_t g_end, float *y, const float *scale, const float *bias, const float *res) {
    int64_t r_begin = 0;  /* rows below it are done on AMX */
#ifdef KVW_AMX
    r_begin = range_amx(a, rows, in, wp, out, g_begin, g_end, y, scale, bias, res);
#endif
    /* One 16-output panel (16 x in bytes: L1-resident) against every row tile in turn. */
    for (int64_t g = g_begin; g < g_end; g++) {
        const uint8_t *panel = wp + (size_t)g * 16 * in;
        const int64_t o = g * 16;
        for (int64_t r = r_begin; r < rows; r += GEMM_NR) {
            switch (rows - r < GEMM_NR ? rows - r : GEMM_NR) {
                GEMM_CASE(1) GEMM_CASE(2) GEMM_CASE(3) GEMM_CASE(4) GEMM_CASE(5) GEMM_CASE(6)
                GEMM_CASE(7) GEMM_CASE(8) GEMM_CASE(9) GEMM_CASE(10) GEMM_CASE(11)
                default: gemm_tile(a, in, panel, o, r, out, y, scale, bias, res, GEMM_NR); break;
            }
        }
    }
}
#endif

/* y [rows, out] = (q8_0(x) . w) * scale + bias + res, w packed as above (kvwire_kernels.cpu.pack_i8a8; VNNI builds). */
void kvw_gemm_i8a8(const float *x, int64_t rows, int64_t in, const uint8_t *wp, int64_t out, float *y,
                   const float *scale, const float *bias, const float *res, int nthreads) {
#ifdef KVW_VNNI
    act8_t a = {malloc((size_t)rows * in), malloc((size_t)rows * in), malloc(sizeof(float) * rows)};
    const int split = rows >= QUANT_SPLIT_ROWS;  /* rows quantized by all threads (a barrier), else before */
    if (!split) quantize_act8(x, rows, in, a);
    const int64_t groups = out / 16;
#pragma omp parallel num_threads(nthreads)
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        if (split) {
            const int64_t r0 = rows * id / nt, r1 = rows * (id + 1) / nt;
            quantize_act8(x + r0 * in, r1 - r0, in, (act8_t){a.q + r0 * in, a.s + r0 * in / 4, a.k + r0});
#pragma omp barrier
        }
        range_gemm(a, rows, in, wp, out, groups * id / nt, groups * (id + 1) / nt, y, scale, bias, res);
    }
    free(a.q); free(a.s); free(a.k);
#else
    (void)x; (void)rows; (void)in; (void)wp; (void)out; (void)y; (void)scale; (void)bias; (void)res; (void)nthreads;
    abort();
#endif
}

/* ---- small row ops -------------------------------------------------------------------------- */

/* y = x / sqrt(mean(x^2) + eps) * w, per row. */
void kvw_rms_norm(const float *x, int64_t rows, int64_t n, const float *w, float eps, float *y) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        double ss = 0;
        for (int64_t i = 0; i < n; i++) ss += (double)xr[i] * xr[i];
        float inv = 1.0f / sqrtf((float)(ss / n) + eps);
        for (int64_t i = 0; i < n; i++) y[r * n + i] = xr[i] * inv * w[i];
    }
}

/* gu [rows, 2 * inter] = [gate | up] -> out [rows, inter] = silu(gate) * up. */
ALWAYS_INLINE f32x16 splat(float x) { return (f32x16){0} + x; }
ALWAYS_INLINE f32x16 vsel(i32x16 m, f32x16 a, f32x16 b) { return (f32x16)(((i32x16)a & m) | ((i32x16)b & ~m)); }
ALWAYS_INLINE float hmax(f32x16 v) { float m = v[0]; for (int i = 1; i < 16; i++) m = v[i] > m ? v[i] : m; return m; }

/* e^x for x <= 0 (NaN-free), Cephes' expf: x = n ln2 + r, e^r by a degree-7 polynomial, 2^n into
 * the exponent; within 2 ulp of expf. x < -87 (below fp32's normal range, -inf included) gives 0. */
ALWAYS_INLINE f32x16 exp_nonpos(f32x16 x) {
    const i32x16 under = x < splat(-87.0f);
    x = vsel(under, splat(-87.0f), x);
    const f32x16 fx = x * 1.44269504088896341f + 0.5f;
    i32x16 n = __builtin_convertvector(fx, i32x16);  /* toward zero; then floor */
    n += (i32x16)(__builtin_convertvector(n, f32x16) > fx);
    const f32x16 fn = __builtin_convertvector(n, f32x16);
    const f32x16 r = x - fn * 0.693359375f - fn * -2.12194440e-4f;
    f32x16 y = r * 1.9875691500e-4f + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    y *= (f32x16)((n + 127) << 23);
    return vsel(under, splat(0.0f), y);
}

/* out = silu(gate) * up, gu = [gate | up] per row. sigmoid(g) from e = e^-|g| (never overflows):
 * 1 / (1 + e) for g >= 0, e / (1 + e) below; 16 at a time, not a scalar expf per element (see
 * docs/decisions/044-cpu-kernel-tuning.md). */
void kvw_silu_mul(const float *gu, int64_t rows, int64_t inter, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gu + r * 2 * inter, *up = gate + inter;
        int64_t i = 0;
        for (; i + 16 <= inter; i += 16) {
            const f32x16 g = load_f32(gate + i);
            const i32x16 neg = g < splat(0.0f);
            const f32x16 e = exp_nonpos(vsel(neg, g, -g)), one = splat(1.0f);
            store_f32(out + r * inter + i, g * (vsel(neg, e, one) / (one + e)) * load_f32(up + i));
        }
        for (; i < inter; i++) {
            const float g = gate[i], e = expf(-fabsf(g));
            out[r * inter + i] = g * ((g < 0.0f ? e : 1.0f) / (1.0f + e)) * up[i];
        }
    }
}

/* ---- sampling: one token per row from softmax(logits / T) ----------------------------------------
 * The inverse of the cumulative distribution, as kvwire.sampler.draw, without materializing it:
 * weights e_i = exp((x_i - max) / T) (one vector polynomial per 16, e^-87 and below count as zero),
 * summed per block of SAMPLE_BLOCK entries; the draw skips whole blocks while the running sum (in
 * double) stays at or below u * total and adds the weights one by one, in order, only in the block
 * where it crosses. A sequential cumulative sum over the vocabulary is a chain of dependent adds:
 * torch's float64 cumsum of 49,152 entries took 42 us of a sampled row's 116 (docs/decisions/045). */
#define SAMPLE_BLOCK 256

ALWAYS_INLINE f32x16 load_logits(const float *x, int64_t i, int64_t vocab) {  /* -inf past the vocabulary */
    if (i + 16 <= vocab) return load_f32(x + i);
    f32x16 v = splat(-INFINITY);
    memcpy(&v, x + i, sizeof(float) * (size_t)(vocab - i));
    return v;
}

static int64_t sample_row(const float *x, int64_t vocab, float inv_t, double u, double *bsum) {
    f32x16 mv = splat(-INFINITY);
    for (int64_t i = 0; i < vocab; i += 16) {
        const f32x16 v = load_logits(x, i, vocab);
        mv = vsel(v > mv, v, mv);
    }
    const float mx = hmax(mv);
    if (!(mx > -INFINITY) || !(mx < INFINITY)) return -1;
    const int64_t nb = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    double total = 0.0;
    int64_t lastb = 0;  /* the last block of positive weight: always scanned, never skipped */
    for (int64_t b = 0; b < nb; b++) {
        f32x16 acc = {0};
        for (int64_t i = b * SAMPLE_BLOCK; i < (b + 1) * SAMPLE_BLOCK && i < vocab; i += 16)
            acc += exp_nonpos((load_logits(x, i, vocab) - mx) * inv_t);
        bsum[b] = hsum(acc);
        total += bsum[b];
        lastb = bsum[b] > 0.0 ? b : lastb;
    }
    if (!(total > 0.0) || !isfinite(total)) return -1;  /* NaN logits */
    const double target = u * total;
    double run = 0.0;
    int64_t last = -1;  /* the last entry of positive weight seen: where rounding leaves the sum short */
    for (int64_t b = 0; b <= lastb; b++) {
        if (b < lastb && run + bsum[b] <= target) { run += bsum[b]; continue; }
        for (int64_t i = b * SAMPLE_BLOCK; i < (b + 1) * SAMPLE_BLOCK && i < vocab; i += 16) {
            const f32x16 e = exp_nonpos((load_logits(x, i, vocab) - mx) * inv_t);
            for (int64_t t = 0; t < 16 && i + t < vocab; t++)
                if (e[t] > 0.0f) {  /* a zero weight is never drawn */
                    run += e[t];
                    last = i + t;
                    if (run > target) return last;
                }
        }
    }
    return last;
}

/* rows[r] [vocab] at temperature temp[r] > 0 with a uniform u[r] in [0, 1) -> out[r]: the first
 * index whose running weight exceeds u[r] times the total, or -1 where the total is not finite and
 * positive (NaN or infinite logits). Rows are independent: the same tokens at any thread count. */
void kvw_sample_rows(const float *const *rows, int64_t n, int64_t vocab, const float *temp, const double *u,
                     int64_t *out, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (n > 1)
    {
        double *bsum = malloc(sizeof(double) * (size_t)((vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) out[r] = sample_row(rows[r], vocab, 1.0f / temp[r], u[r], bsum);
        free(bsum);
    }
}

/* ---- KV writes: bit-exact with kvwire_kernels/reference.py write_kv -------------------------------- */

/* fp32 -> float8_e4m3fn, round to nearest even (c10's fp8e4m3fn_from_fp32_value). The caller
 * has clamped to +-448, so the out-of-range (NaN) branch is never taken for written values. */
static uint8_t f32_to_e4m3(float f) {
    uint32_t bits = f32_bits(f);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t result;
    if (bits >= (1087u << 20)) {
        result = 0x7f;
    } else if (bits < (121u << 23)) {
        const uint32_t denorm_mask = 141u << 23;
        bits = f32_bits(f32_from(bits) + f32_from(denorm_mask));
        result = (uint8_t)(bits - denorm_mask);
    } else {
        uint32_t mant_odd = (bits >> 20) & 1;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7FFFF;
        bits += mant_odd;
        result = (uint8_t)(bits >> 20);
    }
    return result | (uint8_t)(sign >> 24);
}

static uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch */
    uint32_t b = f32_bits(f);
    if (f != f) return 0x7FC0;
    return (uint16_t)((b + (((b >> 16) & 1) + 0x7FFF)) >> 16);
}

/* amax / 448, floored at 1e-12, rounded up to a bfloat16 (reference.token_scale). */
static float token_scale(float amax) {
    float s = amax / 448.0f;
    if (s < 1e-12f) s = 1e-12f;
    uint32_t b = f32_bits(s);
    uint32_t up = (b & 0xFFFFu) != 0 ? 0x10000u : 0;
    return f32_from((b & 0xFFFF0000u) + up);
}

static void write_row(const float *x, int64_t d, void *pages, uint16_t *scales, int64_t idx, int fp8) {
    if (!fp8) {
        uint16_t *dst = (uint16_t *)pages + idx * d;
        for (int64_t i = 0; i < d; i++) dst[i] = f32_to_bf16(x[i]);
        return;
    }
    float amax = 0.0f;
    for (int64_t i = 0; i < d; i++) { float a = fabsf(x[i]); amax = a > amax ? a : amax; }
    float s = token_scale(amax);
    uint8_t *dst = (uint8_t *)pages + idx * d;
    for (int64_t i = 0; i < d; i++) {
        float v = x[i] / s;
        v = v > 448.0f ? 448.0f : (v < -448.0f ? -448.0f : v);
        dst[i] = f32_to_e4m3(v);
    }
    scales[idx] = (uint16_t)(f32_bits(s) >> 16);
}

/* k, v [T, Hkv, D] -> their slots (slot = page * block_size + offset). */
void kvw_write_kv(const float *k, const float *v, int64_t T, int64_t hkv, int64_t d, const int64_t *slots,
                  int64_t block_size, void *k_pages, void *v_pages, uint16_t *k_scale, uint16_t *v_scale,
                  int fp8) {
    for (int64_t t = 0; t < T; t++) {
        int64_t page = slots[t] / block_size, off = slots[t] % block_size;
        for (int64_t h = 0; h < hkv; h++) {
            int64_t idx = (page * hkv + h) * block_size + off;  /* [page, h, off] */
            write_row(k + (t * hkv + h) * d, d, k_pages, k_scale, idx, fp8);
            write_row(v + (t * hkv + h) * d, d, v_pages, v_scale, idx, fp8);
        }
    }
}

/* qkv [T, (H + 2 Hkv) D] -> q_out [T, H, D] and k_out [T, Hkv, D] with RoPE ("rotate half":
 * x * cos + rotate_half(x) * sin, cos/sin [T, D]), v_out [T, Hkv, D] copied. */
void kvw_rope_split(const float *qkv, int64_t T, int64_t h, int64_t hkv, int64_t d, const float *cos_,
                    const float *sin_, float *q_out, float *k_out, float *v_out) {
    const int64_t width = (h + 2 * hkv) * d, half = d / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *row = qkv + t * width, *c = cos_ + t * d, *s = sin_ + t * d;
        for (int64_t hh = 0; hh < h + hkv; hh++) {
            const float *x = row + hh * d;
            float *o = hh < h ? q_out + (t * h + hh) * d : k_out + (t * hkv + hh - h) * d;
            for (int64_t i = 0; i < half; i++) {
                float a = x[i] * c[i], b = -x[i + half] * s[i];
                o[i] = a + b;
            }
            for (int64_t i = half; i < d; i++) {
                float a = x[i] * c[i], b = x[i - half] * s[i];
                o[i] = a + b;
            }
        }
        memcpy(v_out + t * hkv * d, row + (h + hkv) * d, (size_t)(hkv * d) * sizeof(float));
    }
}

/* ---- paged attention, one query row per (token), GQA, reading fp8/bf16 pages in place --------- */

/* FP8 rows come times 2^-8 (load_fp8_x2e8): the caller's scales carry KV_FP8_UNIT. */
ALWAYS_INLINE f32x16 load_kv(const void *pages, int64_t idx, int64_t d, int64_t c, int fp8) {
    if (fp8) return load_fp8_x2e8((const uint8_t *)pages + idx * d + c * 16);
    return load_bf16((const uint16_t *)pages + idx * d + c * 16);
}

/* q [S, H, D] -> out [S, H, D]. Row s sits at position p = ctx[s] - 1 and sees positions j <= p
 * (and j > p - window when window > 0) of its block table tables[s, :max_blocks]. D must be a
 * multiple of 16 (at most 256), h / hkv at most 8.
 *
 * Work is split three ways, and none of them changes a row's bits:
 *   - rows: consecutive rows of one sequence (the same block table, positions one apart: a
 *     speculative verification, a short chunk) form a group of at most ATT_GROUP rows that reads
 *     and dequantizes each position's K and V once for all its rows and query heads;
 *   - positions: fixed chunks of ATT_CHUNK absolute positions are separate tasks (so one sequence's
 *     attention spreads over the threads), each giving a row its chunk's max score, softmax
 *     denominator and weighted sum, merged afterwards in chunk order (as flash-decoding does);
 *   - inside a chunk, scores come 16 positions at a time (16 dot products reduced by one
 *     transpose-add tree into a vector, lane = position mod 16) and the softmax's exponentials are
 *     one vector polynomial per 16 positions.
 * Chunks and blocks of 16 sit on absolute positions, a row's sums run over its own positions in
 * increasing order and a chunk it does not reach is skipped, so each row gets the same bits alone,
 * in any group and with any number of threads. */
static int64_t att_group_end(const int32_t *tables, int64_t max_blocks, const int32_t *ctx, int64_t s0, int64_t S) {
    int64_t s1 = s0 + 1;
    while (s1 < S && s1 - s0 < ATT_GROUP && ctx[s1] == ctx[s1 - 1] + 1
           && memcmp(tables + s1 * max_blocks, tables + s0 * max_blocks, sizeof(int32_t) * max_blocks) == 0)
        s1++;
    return s1;
}

/* a[m] (16 vectors) -> the vector of their horizontal sums, lane m = sum of a[m]: hsum's tree
 * (lane i + lane i + 8, then + 4, + 2, + 1) for all 16 at once. */
ALWAYS_INLINE f32x16 hsum16(const f32x16 *a) {
    f32x16 b[8], c[4], e[2];
    for (int p = 0; p < 8; p++)
        b[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(a[2 * p], a[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int p = 0; p < 4; p++)
        c[p] = __builtin_shufflevector(b[2 * p], b[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(b[2 * p], b[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int p = 0; p < 2; p++)
        e[p] = __builtin_shufflevector(c[2 * p], c[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(c[2 * p], c[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* Positions a .. b of a sequence with block table tab: their rows in kv head g's pages (K/V element
 * offset / d) into at[0 .. b - a]; no division per position. */
static void att_rows(const int32_t *tab, int64_t hkv, int64_t g, int64_t block_size, int64_t a, int64_t b,
                     int64_t *at) {
    for (int64_t j = a, pg = a / block_size, off = a % block_size; j <= b; j++) {
        at[j - a] = ((int64_t)tab[pg] * hkv + g) * block_size + off;
        if (++off == block_size) { off = 0; pg++; }
    }
}

/* An attention task's scratch for nq query vectors, one buffer per thread kept for the thread's life
 * (tasks are many and small: a malloc and free of three buffers each cost more than a chunk's loads). */
static float *att_scratch(int64_t nq) {
    static __thread float *buf;
    static __thread int64_t cap;
    if (nq > cap) {
        free(buf);
        buf = aligned_alloc(64, (size_t)nq * (sizeof(float) * ATT_CHUNK + 2 * 16 * sizeof(f32x16)));
        cap = nq;
    }
    return buf;
}

/* One task: rows s0 .. s0 + n - 1 (a group), kv head g, the chunk at absolute position cs. For each
 * of its n * ratio query vectors, writes [max score, denominator, weighted sum (d)] to part.
 * Memory: requests its own K and V lines up front unless `ahead` (the previous task did), and the
 * rows nxt[0 .. nn - 1] of the task this thread will likely run next as its loops go (K with the
 * scores, V with the V rows), so those misses overlap this task's work. */
ALWAYS_INLINE void attend_chunk(const float *q, int64_t s0, int64_t n, int64_t h, int64_t hkv, const int64_t d,
                                int64_t g, int64_t cs, const void *k_pages, const void *v_pages,
                                const uint16_t *k_scale, const uint16_t *v_scale, int64_t block_size,
                                const int32_t *tab, const int64_t *lo, const int64_t *hi, float sm_scale,
                                const int fp8, float *part, int ahead, const int64_t *nxt, int64_t nn) {
    const int64_t ratio = h / hkv, nc = d / 16, nq = n * ratio;
    const int64_t jlo = lo[0] > cs ? lo[0] : cs, jhi = hi[n - 1] < cs + ATT_CHUNK - 1 ? hi[n - 1] : cs + ATT_CHUNK - 1;
    int64_t blo[ATT_GROUP], bhi[ATT_GROUP];  /* row i's blocks of 16 in this chunk (empty when blo > bhi) */
    for (int64_t i = 0; i < n; i++) {
        const int64_t a = lo[i] > jlo ? lo[i] : jlo, b = hi[i] < jhi ? hi[i] : jhi;
        blo[i] = a <= b ? (a - cs) / 16 : 1;
        bhi[i] = a <= b ? (b - cs) / 16 : 0;
    }
    float *sc = att_scratch(nq);  /* [nq, ATT_CHUNK], then qv and acc [nq][16] vectors */
    f32x16 (*qv)[16] = (f32x16 (*)[16])(sc + nq * ATT_CHUNK), (*acc)[16] = qv + nq;
    for (int64_t i = 0; i < n; i++)
        for (int64_t r = 0; r < ratio; r++)
            for (int64_t c = 0; c < nc; c++) {
                qv[i * ratio + r][c] = load_f32(q + (((s0 + i) * h) + g * ratio + r) * d + c * 16);
                acc[i * ratio + r][c] = (f32x16){0};
            }
    int64_t at[ATT_CHUNK];  /* position cs + i's row in the pages */
    att_rows(tab, hkv, g, block_size, jlo, jhi, at + (jlo - cs));
    /* The pages are scattered, so loading them as the loops reach them waits on one miss after
     * another (docs/decisions/069-decode-attention-prefetch.md). */
    const int64_t row_bytes = d * (fp8 ? 1 : 2);
    if (!ahead)
        for (int64_t j = jlo; j <= jhi; j++)
            for (int64_t o = 0; o < row_bytes; o += 64) {
                __builtin_prefetch((const char *)k_pages + at[j - cs] * row_bytes + o);
                __builtin_prefetch((const char *)v_pages + at[j - cs] * row_bytes + o);
            }
    const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    /* scores, 16 positions at a time */
    for (int64_t b = (jlo - cs) / 16; b <= (jhi - cs) / 16; b++) {
        const int64_t base = cs + 16 * b, u0 = 16 * (b - (jlo - cs) / 16);  /* the next task's rows u0 .. u0 + 15 */
        for (int64_t u = u0; u < nn && u < u0 + 16; u++)
            for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch((const char *)k_pages + nxt[u] * row_bytes + o);
        f32x16 kb[16][nc], ksv = {0};
        for (int64_t t = 0; t < 16; t++) {
            const int64_t j = base + t;
            if (j < jlo || j > jhi) { for (int64_t c = 0; c < nc; c++) kb[t][c] = (f32x16){0}; continue; }
            const int64_t idx = at[j - cs];
            for (int64_t c = 0; c < nc; c++) kb[t][c] = load_kv(k_pages, idx, d, c, fp8);
            ksv[t] = fp8 ? bf16_to_f32(k_scale[idx]) * (sm_scale * KV_FP8_UNIT) : sm_scale;
        }
        const i32x16 pos = lane + (int32_t)base;
        for (int64_t i = 0; i < n; i++) {
            if (b < blo[i] || b > bhi[i]) continue;
            const i32x16 valid = (pos >= (int32_t)lo[i]) & (pos <= (int32_t)hi[i]);
            for (int64_t r = 0; r < ratio; r++) {
                const f32x16 *qq = qv[i * ratio + r];
                f32x16 a[16];
                for (int64_t t = 0; t < 16; t++) {
                    a[t] = qq[0] * kb[t][0];
                    for (int64_t c = 1; c < nc; c++) a[t] += qq[c] * kb[t][c];
                }
                store_f32(sc + (i * ratio + r) * ATT_CHUNK + 16 * b, vsel(valid, hsum16(a) * ksv, splat(-INFINITY)));
            }
        }
    }
    /* softmax numerators and denominators, per query vector over its own blocks */
    for (int64_t i = 0; i < n; i++)
        for (int64_t r = 0; r < ratio; r++) {
            float *row = sc + (i * ratio + r) * ATT_CHUNK, *out = part + (i * ratio + r) * (d + 2);
            if (blo[i] > bhi[i]) { out[0] = -INFINITY; continue; }  /* no position of this row here */
            f32x16 mv = splat(-INFINITY), den = {0};
            for (int64_t b = blo[i]; b <= bhi[i]; b++) { f32x16 s = load_f32(row + 16 * b); mv = vsel(s > mv, s, mv); }
            const float m = hmax(mv);
            for (int64_t b = blo[i]; b <= bhi[i]; b++) {
                const f32x16 p = exp_nonpos(load_f32(row + 16 * b) - m);
                store_f32(row + 16 * b, p);
                den += p;
            }
            out[0] = m;
            out[1] = hsum(den);
        }
    /* weighted sums of V: the chunk's V rows are dequantized once (into L1), then each query
     * vector runs over its positions with its sums in registers (sums in memory wait on a store
     * and a reload per add; see docs/decisions/044-cpu-kernel-tuning.md). The same operations in
     * the same order for every element, so the same bits in any group. */
    f32x16 vb[ATT_CHUNK][nc];
    float vsc[ATT_CHUNK];
    for (int64_t j = jlo; j <= jhi; j++) {
        const int64_t idx = at[j - cs];
        if (j - jlo < nn)
            for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch((const char *)v_pages + nxt[j - jlo] * row_bytes + o);
        for (int64_t c = 0; c < nc; c++) vb[j - cs][c] = load_kv(v_pages, idx, d, c, fp8);
        vsc[j - cs] = fp8 ? bf16_to_f32(v_scale[idx]) * KV_FP8_UNIT : 1.0f;
    }
    for (int64_t u = 16 * ((jhi - cs) / 16 - (jlo - cs) / 16 + 1); u < nn; u++)  /* a next task longer than this one */
        for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch((const char *)k_pages + nxt[u] * row_bytes + o);
    for (int64_t u = jhi - jlo + 1; u < nn; u++)
        for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch((const char *)v_pages + nxt[u] * row_bytes + o);
    for (int64_t i = 0; i < n; i++) {
        const int64_t a = lo[i] > jlo ? lo[i] : jlo, b = hi[i] < jhi ? hi[i] : jhi;
        for (int64_t r = 0; r < ratio; r++) {
            const float *w = sc + (i * ratio + r) * ATT_CHUNK;  /* [ATT_CHUNK]: position cs + t at t */
            f32x16 ac[nc];
            for (int64_t c = 0; c < nc; c++) ac[c] = acc[i * ratio + r][c];
            for (int64_t j = a; j <= b; j++) {
                const float wgt = w[j - cs] * vsc[j - cs];
                for (int64_t c = 0; c < nc; c++) ac[c] += wgt * vb[j - cs][c];
            }
            for (int64_t c = 0; c < nc; c++) acc[i * ratio + r][c] = ac[c];
        }
    }
    for (int64_t k = 0; k < nq; k++)
        if (part[k * (d + 2)] != -INFINITY)
            for (int64_t c = 0; c < nc; c++) store_f32(part + k * (d + 2) + 2 + c * 16, acc[k][c]);
}

void kvw_paged_attention(const float *q, int64_t S, int64_t h, int64_t hkv, int64_t d,
                         const void *k_pages, const void *v_pages, const uint16_t *k_scale,
                         const uint16_t *v_scale, int64_t block_size, const int32_t *tables,
                         int64_t max_blocks, const int32_t *ctx, int64_t window, float sm_scale,
                         float *out, int fp8, int nthreads) {
    const int64_t ratio = h / hkv, nc = d / 16, slot = d + 2;
    int64_t *lo = malloc(sizeof(int64_t) * S), *hi = malloc(sizeof(int64_t) * S);  /* row s sees lo[s] .. hi[s] */
    for (int64_t s = 0; s < S; s++) {
        hi[s] = ctx[s] - 1;
        lo[s] = window > 0 && hi[s] - window + 1 > 0 ? hi[s] - window + 1 : 0;
    }
    /* groups; then tasks (group, chunk, kv head) in that order, each with its slice of part */
    int64_t *starts = malloc(sizeof(int64_t) * (S + 1)), *task0 = malloc(sizeof(int64_t) * (S + 1)), ng = 0, nt = 0;
    for (int64_t s = 0; s < S; s = att_group_end(tables, max_blocks, ctx, s, S)) starts[ng++] = s;
    starts[ng] = S;
    for (int64_t gi = 0; gi < ng; gi++) {
        task0[gi] = nt;
        nt += (hi[starts[gi + 1] - 1] / ATT_CHUNK - lo[starts[gi]] / ATT_CHUNK + 1) * hkv;
    }
    task0[ng] = nt;
    int64_t *tgroup = malloc(sizeof(int64_t) * nt), *toff = malloc(sizeof(int64_t) * (nt + 1));
    toff[0] = 0;
    for (int64_t gi = 0; gi < ng; gi++)
        for (int64_t t = task0[gi]; t < task0[gi + 1]; t++) {
            tgroup[t] = gi;
            toff[t + 1] = toff[t] + (starts[gi + 1] - starts[gi]) * ratio * slot;
        }
    float *part = malloc(sizeof(float) * (toff[nt] > 0 ? toff[nt] : 1));
#pragma omp parallel num_threads(nthreads)
    {
    /* With one task at a time handed out in order, a thread's next task is most likely t + nthreads:
     * its K/V lines are requested during task t (a wrong guess costs only the requests). */
    int64_t ahead = -1, nxt[ATT_CHUNK];
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < nt; t++) {
        const int64_t gi = tgroup[t], s0 = starts[gi], k = t - task0[gi];
        const int64_t n = starts[gi + 1] - s0, g = k % hkv, cs = (lo[s0] / ATT_CHUNK + k / hkv) * ATT_CHUNK;
        const int32_t *tab = tables + s0 * max_blocks;
        const int got = ahead == t;
        int64_t nn = 0;
        ahead = t + nthreads < nt ? t + nthreads : -1;
        if (ahead >= 0) {
            const int64_t gu = tgroup[ahead], su = starts[gu], ku = ahead - task0[gu];
            const int64_t cu = (lo[su] / ATT_CHUNK + ku / hkv) * ATT_CHUNK, hu = hi[starts[gu + 1] - 1];
            const int64_t a = lo[su] > cu ? lo[su] : cu, b = hu < cu + ATT_CHUNK - 1 ? hu : cu + ATT_CHUNK - 1;
            att_rows(tables + su * max_blocks, hkv, ku % hkv, block_size, a, b, nxt);
            nn = b - a + 1;
        }
        /* head dims 64 and 128 with FP8 pages get their own copies, unrolled with the vectors in registers */
#define ATTEND(D, FP8) attend_chunk(q, s0, n, h, hkv, D, g, cs, k_pages, v_pages, k_scale, v_scale, block_size, \
                                    tab, lo + s0, hi + s0, sm_scale, FP8, part + toff[t], got, nxt, nn)
        if (d == 64 && fp8) ATTEND(64, 1);
        else if (d == 128 && fp8) ATTEND(128, 1);
        else ATTEND(d, fp8);
#undef ATTEND
    }
    }
    /* merge each (row, head)'s chunks in order */
#pragma omp parallel for num_threads(nthreads) schedule(static) if (S * h >= 64)
    for (int64_t sh = 0; sh < S * h; sh++) {
        const int64_t s = sh / h, hh = sh % h, g = hh / ratio, r = hh % ratio;
        int64_t gi = 0;
        while (starts[gi + 1] <= s) gi++;
        const int64_t i = s - starts[gi], nch = (task0[gi + 1] - task0[gi]) / hkv;
        float m = -INFINITY;
        for (int64_t c = 0; c < nch; c++) {
            const float mc = part[toff[task0[gi] + c * hkv + g] + (i * ratio + r) * slot];
            m = mc > m ? mc : m;
        }
        f32x16 acc[16] = {{0}};
        float den = 0.0f;
        for (int64_t c = 0; c < nch; c++) {
            const float *p = part + toff[task0[gi] + c * hkv + g] + (i * ratio + r) * slot;
            if (p[0] == -INFINITY) continue;
            const float w = expf(p[0] - m);
            den += w * p[1];
            for (int64_t cc = 0; cc < nc; cc++) acc[cc] += w * load_f32(p + 2 + cc * 16);
        }
        const float inv = 1.0f / den;
        for (int64_t cc = 0; cc < nc; cc++) store_f32(out + (s * h + hh) * d + cc * 16, acc[cc] * inv);
    }
    free(part); free(toff); free(tgroup); free(task0); free(starts); free(lo); free(hi);
}

/* ---- causal attention over a prompt's own K/V (prefill) ---------------------------------------
 * q [n, h, d] at positions q0 .. q0 + n - 1; k, v [m, hkv, d] at positions k0 .. k0 + m - 1 (fp32,
 * contiguous); a query sees keys at or before its position (and within `window` of it when > 0).
 * Flash attention: a task is one head x PA_ROWS query rows, running over the visible keys 16 at a
 * time with an online softmax (running max, denominator and weighted V sums in registers). K is
 * transposed once per kv head, 16 keys at a time ([m / 16, d, 16]: one key block is 16 d contiguous
 * floats, where a [d, m] layout strided its rows by m and thrashed L1 from 1,024 keys on), so 16
 * scores are one vector per query row. A row's result
 * depends only on its own keys, in a fixed order: the same bits in any task split or thread count.
 * Against torch's CPU flash kernel: docs/decisions/061-prefill-attention.md. Requires d % 16 == 0,
 * d <= 128. */
#define PA_ROWS 4
ALWAYS_INLINE void prefill_attend_rows(const float *q, int64_t n, int64_t h, int64_t d, const float *kt,
                                       int64_t m_pad, const float *v, int64_t m, int64_t hkv, int64_t q0,
                                       int64_t k0, int64_t window, float sm_scale, int64_t hh, int64_t g,
                                       int64_t r0, float *out, const int NV, const int NR) {
    float qs[PA_ROWS][128];
    int64_t pos[PA_ROWS];
    for (int r = 0; r < NR; r++) {
        const int64_t row = r0 + r < n ? r0 + r : n - 1;  /* a short last task repeats its last row */
        pos[r] = q0 + row;
        for (int64_t i = 0; i < d; i++) qs[r][i] = q[(row * h + hh) * d + i] * sm_scale;
    }
    f32x16 acc[PA_ROWS][8];
    float mx[PA_ROWS], den[PA_ROWS];
    for (int r = 0; r < NR; r++) {
        mx[r] = -INFINITY; den[r] = 0.0f;
        for (int c = 0; c < NV; c++) acc[r][c] = (f32x16){0};
    }
    const int64_t first = window > 0 ? pos[0] - window + 1 : 0;
    const int64_t jlo = first > k0 ? first - k0 : 0, jhi = pos[NR - 1] - k0;  /* key indices, inclusive */
    const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int64_t j0 = jlo / 16 * 16; j0 <= jhi; j0 += 16) {
        f32x16 s[PA_ROWS];
        for (int r = 0; r < NR; r++) s[r] = (f32x16){0};
        for (int64_t i = 0; i < d; i++) {
            const f32x16 kv = load_f32(kt + (j0 * d + i * 16));  /* block j0 / 16 starts at j0 * d */
            for (int r = 0; r < NR; r++) s[r] += qs[r][i] * kv;
        }
        const i32x16 kpos = lane + (int32_t)(k0 + j0);
        /* The rows' softmax steps side by side, so the core overlaps their dependent chains (max,
         * exponentials, sum); per row the same operations as one row at a time. Where the running max
         * held, the factor is expf(0) = 1 and the rescale is skipped: the same bits. */
        float p[PA_ROWS][16], nm[PA_ROWS];
        f32x16 sv[PA_ROWS], e[PA_ROWS];
        for (int r = 0; r < NR; r++) {
            i32x16 ok = kpos <= (int32_t)pos[r];
            if (window > 0) ok &= kpos > (int32_t)(pos[r] - window);
            sv[r] = vsel(ok, s[r], splat(-INFINITY));
            const float bm = hmax(sv[r]);
            nm[r] = bm > mx[r] ? bm : mx[r];
        }
        for (int r = 0; r < NR; r++) {
            e[r] = nm[r] == -INFINITY ? (f32x16){0} : exp_nonpos(sv[r] - nm[r]);  /* nothing visible yet: zeros */
            store_f32(p[r], e[r]);
        }
        for (int r = 0; r < NR; r++) {
            if (nm[r] == -INFINITY) continue;
            if (nm[r] == mx[r]) {
                den[r] += hsum(e[r]);
                continue;
            }
            const float corr = mx[r] == -INFINITY ? 0.0f : expf(mx[r] - nm[r]);
            den[r] = den[r] * corr + hsum(e[r]);
            mx[r] = nm[r];
            for (int c = 0; c < NV; c++) acc[r][c] *= corr;
        }
        const int64_t tn = m - j0 < 16 ? m - j0 : 16;
        for (int64_t t = 0; t < tn; t++) {
            const float *vr = v + ((j0 + t) * hkv + g) * d;
            f32x16 vv[8];
            for (int c = 0; c < NV; c++) vv[c] = load_f32(vr + 16 * c);
            for (int r = 0; r < NR; r++)
                for (int c = 0; c < NV; c++) acc[r][c] += p[r][t] * vv[c];
        }
    }
    for (int r = 0; r < NR && r0 + r < n; r++) {
        const float inv = 1.0f / den[r];
        for (int c = 0; c < NV; c++) store_f32(out + ((r0 + r) * h + hh) * d + 16 * c, acc[r][c] * inv);
    }
}

void kvw_prefill_attention(const float *q, int64_t n, int64_t h, int64_t hkv, int64_t d, const float *k,
                           const float *v, int64_t m, int64_t q0, int64_t k0, int64_t window, float sm_scale,
                           float *out, int nthreads) {
    const int64_t m_pad = (m + 15) / 16 * 16, ratio = h / hkv, blocks = (n + PA_ROWS - 1) / PA_ROWS;
    float *kt = aligned_alloc(64, sizeof(float) * hkv * d * m_pad);  /* [hkv, m_pad / 16, d, 16] */
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < hkv * (m_pad / 16); t++) {  /* (group, block of 16 keys): all threads, any hkv */
            const int64_t g = t / (m_pad / 16), j0 = t % (m_pad / 16) * 16;
            for (int64_t j = j0; j < j0 + 16; j++)
                for (int64_t i = 0; i < d; i++)
                    kt[g * d * m_pad + (j / 16 * d + i) * 16 + j % 16] = j < m ? k[(j * hkv + g) * d + i] : 0.0f;
        }
        /* later row blocks see more keys: largest first, then dynamic, for balance */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < blocks * h; t++) {
            const int64_t b = blocks - 1 - t / h, hh = t % h, g = hh / ratio;
            const float *ktg = kt + g * d * m_pad;
/* 4 rows' sums in registers up to d = 64, 2 rows at a time above (32 vector registers) */
#define PA_CALL(NV) for (int64_t r = 0; r < PA_ROWS && b * PA_ROWS + r < n; r += (NV <= 4 ? PA_ROWS : 2)) \
                        prefill_attend_rows(q, n, h, d, ktg, m_pad, v, m, hkv, q0, k0, window, sm_scale, hh, g, \
                                            b * PA_ROWS + r, out, NV, NV <= 4 ? PA_ROWS : 2)
            switch (d / 16) {
                case 1: PA_CALL(1); break;
                case 2: PA_CALL(2); break;
                case 4: PA_CALL(4); break;
                case 8: PA_CALL(8); break;
                default: abort();
            }
#undef PA_CALL
        }
    }
    free(kt);
}

/* ---- GGUF block formats (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) as stored: kvw_gemm_q* ----------------- */
#include "gguf_blocks.c"

/* ---- the whole decode step's layers in one call ------------------------------------------------ */

typedef struct {
    const void *w;  /* [out, in] */
    const float *scale, *bias;  /* [out] or NULL */
    int64_t in, out;
    int64_t wt;  /* WT_I8, WT_BF16, WT_F32, WT_I8A8, WT_I8A8_PACKED, WT_BF16A16, WT_Q4_0 .. WT_Q6_K, WT_ROWS */
} kvw_linear_t;

typedef struct {
    const float *attn_norm, *mlp_norm;  /* [hidden] */
    kvw_linear_t qkv, o, gate_up, down;
    int64_t window;  /* 0: none */
} kvw_layer_t;

void kvw_linear_i8a8(const float *x, int64_t rows, int64_t in, const int8_t *w, int64_t out, float *y,
                     const float *scale, const float *bias, const float *res, int nthreads);
void kvw_gemm_i8a8(const float *x, int64_t rows, int64_t in, const uint8_t *wp, int64_t out, float *y,
                   const float *scale, const float *bias, const float *res, int nthreads);
static void run_linear(const kvw_linear_t *l, const float *x, int64_t rows, float *y, const float *res, int nthreads) {
    if (l->wt == WT_ROWS) {  /* each part into its columns: rows are independent, so the same numbers */
        int64_t off = 0;
        for (const kvw_linear_t *p = l->w; p->out; off += p->out, p++) {
            float *part = malloc(sizeof(float) * rows * p->out);
            run_linear(p, x, rows, part, NULL, nthreads);
            for (int64_t r = 0; r < rows; r++)
                for (int64_t o = 0; o < p->out; o++) {
                    float v = part[r * p->out + o];
                    if (l->bias) v += l->bias[off + o];
                    const int64_t k = r * l->out + off + o;
                    y[k] = res ? res[k] + v : v;
                }
            free(part);
        }
        return;
    }
    if (l->wt == WT_BF16A16) { kvw_linear_bf16a16(x, rows, l->in, l->w, l->out, y, l->scale, l->bias, res, nthreads); return; }
    if (l->wt == WT_I8A8) { kvw_linear_i8a8(x, rows, l->in, l->w, l->out, y, l->scale, l->bias, res, nthreads); return; }
    if (l->wt == WT_I8A8_PACKED) { kvw_gemm_i8a8(x, rows, l->in, l->w, l->out, y, l->scale, l->bias, res, nthreads); return; }
    if (l->wt == WT_Q4_0) { kvw_gemm_q4_0(x, rows, l->in, l->w, l->out, y, l->scale, l->bias, res, nthreads); return; }
    if (l->wt == WT_Q4_1) { kvw_gemm_q4_1(x, rows, l->in, l->w, l->out, y, l->scale, l->bias, res, nthreads); return; }
    if (l->wt == WT_Q8_0) { kvw_gemm_q8_0(x, rows, l->in, l->w, l->out, y, l->scale, l->bias, res, nthreads); return; }
    if (l->wt == WT_Q4_K) { kvw_gemm_q4_k(x, rows, l->in, l->w, l->out, y, l->scale, l->bias, res, nthreads); return; }
    if (l->wt == WT_Q5_K) { kvw_gemm_q5_k(x, rows, l->in, l->w, l->out, y, l->scale, l->bias, res, nthreads); return; }
    if (l->wt == WT_Q6_K) { kvw_gemm_q6_k(x, rows, l->in, l->w, l->out, y, l->scale, l->bias, res, nthreads); return; }
    linear(x, rows, l->in, l->w, l->out, y, l->scale, l->bias, res, nthreads, (int)l->wt);
}

/* The row ops of a step, rows split between threads: each row's bytes are the serial call's. */
static void rows_rms_norm(const float *x, int64_t rows, int64_t n, const float *w, float eps, float *y, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows >= 8)
    for (int64_t r = 0; r < rows; r++) kvw_rms_norm(x + r * n, 1, n, w, eps, y + r * n);
}

static void rows_silu_mul(const float *gu, int64_t rows, int64_t inter, float *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows >= 8)
    for (int64_t r = 0; r < rows; r++) kvw_silu_mul(gu + r * 2 * inter, 1, inter, out + r * inter);
}

static void rows_rope_write(const float *qkv, int64_t T, int64_t h, int64_t hkv, int64_t d, const float *cos_,
                            const float *sin_, float *q, float *k, float *v, const int64_t *slots, int64_t block_size,
                            void *kp, void *vp, uint16_t *ks, uint16_t *vs, int fp8, int nthreads) {
    const int64_t width = (h + 2 * hkv) * d;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T >= 8)
    for (int64_t t = 0; t < T; t++) {
        kvw_rope_split(qkv + t * width, 1, h, hkv, d, cos_ + t * d, sin_ + t * d, q + t * h * d, k + t * hkv * d,
                       v + t * hkv * d);
        kvw_write_kv(k + t * hkv * d, v + t * hkv * d, 1, hkv, d, slots + t, block_size, kp, vp, ks, vs, fp8);
    }
}

/* A step's activations for n rows. */
typedef struct { float *hbuf, *qkv, *q, *attn, *k, *v, *gu, *act; } step_bufs_t;

static step_bufs_t step_bufs(int64_t n, int64_t hidden, int64_t h, int64_t hkv, int64_t d, int64_t inter) {
    return (step_bufs_t){malloc(sizeof(float) * n * hidden), malloc(sizeof(float) * n * (h + 2 * hkv) * d),
                         malloc(sizeof(float) * n * h * d), malloc(sizeof(float) * n * h * d),
                         malloc(sizeof(float) * n * hkv * d), malloc(sizeof(float) * n * hkv * d),
                         malloc(sizeof(float) * n * 2 * inter), malloc(sizeof(float) * n * inter)};
}

static void step_bufs_free(step_bufs_t *b) {
    free(b->hbuf); free(b->qkv); free(b->q); free(b->attn); free(b->k); free(b->v); free(b->gu); free(b->act);
}

/* Layer i's pages and scales (NULL for bf16 pages): layer l starts l * page_stride elements (scales:
 * l * scale_stride) into the cache's tensors. */
typedef struct { void *k, *v; uint16_t *ks, *vs; } layer_pages_t;

static layer_pages_t layer_pages(int64_t i, void *k_base, void *v_base, uint16_t *ks_base, uint16_t *vs_base,
                                 int64_t page_stride, int64_t scale_stride, int fp8) {
    const size_t elem = fp8 ? 1 : 2;
    return (layer_pages_t){(char *)k_base + i * page_stride * elem, (char *)v_base + i * page_stride * elem,
                           fp8 ? ks_base + i * scale_stride : NULL, fp8 ? vs_base + i * scale_stride : NULL};
}

/* x [n, hidden] -> Q, K, V of layer L (in b) with RoPE, K/V written to the layer's pages. */
static void layer_qkv(const kvw_layer_t *L, const float *x, int64_t n, int64_t hidden, int64_t h, int64_t hkv,
                      int64_t d, float eps, const float *cos_, const float *sin_, const int64_t *slots,
                      int64_t block_size, layer_pages_t P, int fp8, const step_bufs_t *b, int nthreads) {
    rows_rms_norm(x, n, hidden, L->attn_norm, eps, b->hbuf, nthreads);
    run_linear(&L->qkv, b->hbuf, n, b->qkv, NULL, nthreads);
    rows_rope_write(b->qkv, n, h, hkv, d, cos_, sin_, b->q, b->k, b->v, slots, block_size, P.k, P.v, P.ks, P.vs,
                    fp8, nthreads);
}

/* The layer after attention (b->attn): x += o(attn); x += down(silu(gate) * up) of rms_norm(x). */
static void layer_rest(const kvw_layer_t *L, float *x, int64_t n, int64_t hidden, int64_t inter, float eps,
                       const step_bufs_t *b, int nthreads) {
    run_linear(&L->o, b->attn, n, x, x, nthreads);
    rows_rms_norm(x, n, hidden, L->mlp_norm, eps, b->hbuf, nthreads);
    run_linear(&L->gate_up, b->hbuf, n, b->gu, NULL, nthreads);
    rows_silu_mul(b->gu, n, inter, b->act, nthreads);
    run_linear(&L->down, b->act, n, x, x, nthreads);
}

/* x [n, hidden] (the embeddings in, the last layer's output out, in place) through every layer:
 * the sequence of kvw_* calls kvwire/model/fast_decode.py documents, without going back to Python.
 * Layer l's pages start at k_base + l * page_stride elements (scales: l * scale_stride). */
void kvw_decode_layers(const kvw_layer_t *layers, int64_t num_layers, float *x, int64_t n, int64_t hidden,
                       int64_t h, int64_t hkv, int64_t d, int64_t inter, float eps, const float *cos_,
                       const float *sin_, const int64_t *slots, const int32_t *tables, int64_t max_blocks,
                       const int32_t *ctx, void *k_base, void *v_base, uint16_t *ks_base, uint16_t *vs_base,
                       int64_t page_stride, int64_t scale_stride, int64_t block_size, int fp8, float sm_scale,
                       int nthreads) {
    step_bufs_t b = step_bufs(n, hidden, h, hkv, d, inter);
    for (int64_t i = 0; i < num_layers; i++) {
        const kvw_layer_t *L = layers + i;
        const layer_pages_t P = layer_pages(i, k_base, v_base, ks_base, vs_base, page_stride, scale_stride, fp8);
        layer_qkv(L, x, n, hidden, h, hkv, d, eps, cos_, sin_, slots, block_size, P, fp8, &b, nthreads);
        kvw_paged_attention(b.q, n, h, hkv, d, P.k, P.v, P.ks, P.vs, block_size, tables, max_blocks, ctx, L->window,
                            sm_scale, b.attn, fp8, nthreads);
        layer_rest(L, x, n, hidden, inter, eps, &b, nthreads);
    }
    step_bufs_free(&b);
}

/* ---- a prefill step's layers in one call ------------------------------------------------------- */

/* Positions [lo, lo + m) of a sequence from its pages (table: page per block) into dst [m, hkv, d] fp32:
 * kvwire_kernels.reference.dequantize_pages' values (fp8 * its bf16 scale, one fp32 rounding; bf16 exact). */
static void gather_pages(const void *pages, const uint16_t *scales, const int32_t *table, int64_t lo, int64_t m,
                         int64_t hkv, int64_t d, int64_t block_size, int fp8, float *dst, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (m >= 64)
    for (int64_t j = 0; j < m; j++) {
        const int64_t pos = lo + j, page = table[pos / block_size], off = pos % block_size;
        for (int64_t g = 0; g < hkv; g++) {
            const int64_t idx = (page * hkv + g) * block_size + off;
            float *o = dst + (j * hkv + g) * d;
            if (fp8) {
                const f32x16 s = splat(bf16_to_f32(scales[idx]) * KV_FP8_UNIT);
                for (int64_t i = 0; i < d; i += 16) store_f32(o + i, load_fp8_x2e8((const uint8_t *)pages + idx * d + i) * s);
            } else {
                for (int64_t i = 0; i < d; i += 16) store_f32(o + i, load_bf16((const uint16_t *)pages + idx * d + i));
            }
        }
    }
}

/* x [n, hidden] through every layer for a prefill step: S segments, segment s the rows [row0[s], row0[s] +
 * len[s]) of one sequence at positions start[s] .. (block table tables[s], max_blocks wide). Each layer
 * writes every row's K/V to the pages first; each segment's queries then attend over its pages before
 * start[s] (from its window's first block), dequantized, then causally over their own full-precision
 * K/V: kvwire.kv.paged.PagedKVCache.attend's prefill rows, the same kvw_prefill_attention on the same
 * inputs. A segment continuing the one before it (the same sequence's next chunk in this step) so reads
 * that one's K/V from the pages, as in a step of its own.
 * Rows [0, np) (np >= 0) are decode or verification rows riding along: row i attends as kvw_decode_layers'
 * (kvw_paged_attention over its block table ptables[i], pmax_blocks wide, up to pctx[i] positions), so
 * a mixed step gives every row the bits a step of its own kind gives it (the GEMMs' rows are independent).
 * head_dim is a multiple of 16. after_layer (or NULL), called once a layer's pages are written, returns
 * the thread count for the next layer, or 0 to stop there. */
void kvw_prefill_layers(const kvw_layer_t *layers, int64_t num_layers, float *x, int64_t n, int64_t hidden,
                        int64_t h, int64_t hkv, int64_t d, int64_t inter, float eps, const float *cos_,
                        const float *sin_, const int64_t *slots, int64_t S, const int64_t *row0, const int64_t *len,
                        const int64_t *start, const int32_t *tables, int64_t max_blocks, void *k_base, void *v_base,
                        uint16_t *ks_base, uint16_t *vs_base, int64_t page_stride, int64_t scale_stride,
                        int64_t block_size, int fp8, float sm_scale, int nthreads, int (*after_layer)(int64_t),
                        int64_t np, const int32_t *ptables, int64_t pmax_blocks, const int32_t *pctx) {
    int64_t most = 0;  /* the most keys any segment gathers */
    for (int64_t s = 0; s < S; s++) most = start[s] + len[s] > most ? start[s] + len[s] : most;
    /* A segment that continues the one before it (the same sequence's next chunk in this step) keeps the
     * positions that one gathered and adds that one's own, from the pages: the same values, read once. */
    int64_t have_lo = -1, have = 0;  /* kb, vb hold positions [have_lo, have_lo + have) of the last segment's sequence */
    step_bufs_t b = step_bufs(n, hidden, h, hkv, d, inter);
    float *kb = malloc(sizeof(float) * most * hkv * d), *vb = malloc(sizeof(float) * most * hkv * d);
    for (int64_t i = 0; i < num_layers; i++) {
        const kvw_layer_t *L = layers + i;
        const layer_pages_t P = layer_pages(i, k_base, v_base, ks_base, vs_base, page_stride, scale_stride, fp8);
        layer_qkv(L, x, n, hidden, h, hkv, d, eps, cos_, sin_, slots, block_size, P, fp8, &b, nthreads);
        if (np > 0)
            kvw_paged_attention(b.q, np, h, hkv, d, P.k, P.v, P.ks, P.vs, block_size, ptables, pmax_blocks, pctx,
                                L->window, sm_scale, b.attn, fp8, nthreads);
        have_lo = -1;  /* each layer gathers its own pages */
        for (int64_t s = 0; s < S; s++) {
            const int64_t r = row0[s], st = start[s], w = L->window;
            const float *keys = b.k + r * hkv * d, *vals = b.v + r * hkv * d;
            int64_t lo = st, m = len[s];
            if (st > 0) {  /* earlier chunks (or a reused prefix): from the pages, then this segment's own */
                lo = (w ? (st - w + 1 > 0 ? st - w + 1 : 0) : 0) / block_size * block_size;
                m = st - lo + len[s];
                const int cont = s > 0 && lo == have_lo && start[s - 1] + len[s - 1] == st && have <= st - lo &&
                                 !memcmp(tables + s * max_blocks, tables + (s - 1) * max_blocks, sizeof(int32_t) * max_blocks);
                const int64_t from = cont ? have : 0;  /* positions lo + from .. st still to gather */
                gather_pages(P.k, P.ks, tables + s * max_blocks, lo + from, st - lo - from, hkv, d, block_size, fp8,
                             kb + from * hkv * d, nthreads);
                gather_pages(P.v, P.vs, tables + s * max_blocks, lo + from, st - lo - from, hkv, d, block_size, fp8,
                             vb + from * hkv * d, nthreads);
                have_lo = lo;
                have = st - lo;  /* beyond it, kb / vb hold this segment's own rows at full precision */
                memcpy(kb + (st - lo) * hkv * d, keys, sizeof(float) * len[s] * hkv * d);
                memcpy(vb + (st - lo) * hkv * d, vals, sizeof(float) * len[s] * hkv * d);
                keys = kb;
                vals = vb;
            } else {
                have_lo = -1;
            }
            kvw_prefill_attention(b.q + r * h * d, len[s], h, hkv, d, keys, vals, m, st, lo, w, sm_scale,
                                  b.attn + r * h * d, nthreads);
        }
        layer_rest(L, x, n, hidden, inter, eps, &b, nthreads);
        if (after_layer && (nthreads = after_layer(i)) < 1) break;  /* the caller's next thread count, 0: stop */
    }
    step_bufs_free(&b);
    free(kb); free(vb);
}

/* ---- a draft head (kvwire/model/draft_head.py) in C ------------------------------------------- */

typedef struct {
    const float *norm;  /* [hidden] */
    kvw_linear_t gate_up, down;
} kvw_head_block_t;

typedef struct {
    const void *embed;  /* [vocab, hidden]: the target's embedding table, fp32 or (embed_bf16) bf16 */
    int64_t embed_bf16;
    const float *tok_norm;  /* [hidden] */
    kvw_linear_t fc;  /* [hidden, 2 * hidden] */
    const kvw_head_block_t *blocks;
    int64_t num_blocks;
    kvw_linear_t head;  /* [head_vocab rounded up to 16, hidden] */
    const int64_t *head_vocab;  /* [head_vocab_n] token ids */
    int64_t head_vocab_n, hidden, inter;
    float eps;
} kvw_draft_head_t;

/* One evaluation of DraftHead.forward for A rows: cat [A, 2 * hidden] holds each row's feature in
 * its first half (the second half is written here: rms_norm(embed[tok]) * tok_norm); x [A, hidden]
 * and logits [A, head.out] receive the predicted hidden state and the head's scores:
 *   x = fc(cat); per block x += down(silu_mul(gate_up(rms_norm(x)))); logits = head(x). */
static void head_eval(const kvw_draft_head_t *H, int64_t A, const int64_t *tok, float *cat, float *x,
                      float *logits, int nthreads) {
    const int64_t h = H->hidden;
    float *hbuf = malloc(sizeof(float) * A * h), *gu = malloc(sizeof(float) * A * 2 * H->inter);
    float *act = malloc(sizeof(float) * A * H->inter);
    for (int64_t a = 0; a < A; a++) {
        const float *e = (const float *)H->embed + tok[a] * h;
        if (H->embed_bf16) {
            const uint16_t *row = (const uint16_t *)H->embed + tok[a] * h;
            for (int64_t j = 0; j < h; j++) hbuf[j] = bf16_to_f32(row[j]);
            e = hbuf;
        }
        kvw_rms_norm(e, 1, h, H->tok_norm, H->eps, cat + a * 2 * h + h);
    }
    run_linear(&H->fc, cat, A, x, NULL, nthreads);
    for (int64_t b = 0; b < H->num_blocks; b++) {
        const kvw_head_block_t *B = H->blocks + b;
        kvw_rms_norm(x, A, h, B->norm, H->eps, hbuf);
        run_linear(&B->gate_up, hbuf, A, gu, NULL, nthreads);
        kvw_silu_mul(gu, A, H->inter, act);
        run_linear(&B->down, act, A, x, x, nthreads);
    }
    run_linear(&H->head, x, A, logits, NULL, nthreads);
    free(hbuf); free(gu); free(act);
}

/* One evaluation for S rows (a chain that samples each proposal in Python): feat [S, hidden], tok [S]
 * -> out_x [S, hidden], out_logits [S, head.out]. */
void kvw_draft_head_eval(const kvw_draft_head_t *H, int64_t S, const float *feat, const int64_t *tok,
                         float *out_x, float *out_logits, int nthreads) {
    float *cat = malloc(sizeof(float) * S * 2 * H->hidden);
    for (int64_t i = 0; i < S; i++) memcpy(cat + i * 2 * H->hidden, feat + i * H->hidden, sizeof(float) * H->hidden);
    head_eval(H, S, tok, cat, out_x, out_logits, nthreads);
    free(cat);
}

/* The greedy chain, as ModelRunner._propose_head runs it, for S sequences at once without going back
 * to Python between proposals (right after a target step every torch op starts on cold caches; see
 * docs/decisions/044-cpu-kernel-tuning.md). Per proposal, over the sequences still drafting: head_eval; tok =
 * head_vocab[argmax] (the first of tied maxima); conf = softmax's top probability = 1 /
 * sum(exp(logits - max)) over the head vocabulary; the next feature is x. Sequence i drafts until it
 * has k[i] (<= kmax) proposals or the product of its confidences is below stop_below. Writes out_tok /
 * out_conf [S, kmax] (-1 / 0 past a sequence's proposals); returns the evaluations made (the longest
 * chain). */
int64_t kvw_draft_head_chain(const kvw_draft_head_t *H, int64_t S, const float *feat, const int64_t *tok,
                             const int64_t *k, int64_t kmax, float stop_below, int64_t *out_tok, float *out_conf,
                             int nthreads) {
    const int64_t h = H->hidden, nv = H->head_vocab_n;
    float *cat = malloc(sizeof(float) * S * 2 * h), *x = malloc(sizeof(float) * S * h);
    float *logits = malloc(sizeof(float) * S * H->head.out);
    double *reach = malloc(sizeof(double) * S);
    int64_t *seq = malloc(sizeof(int64_t) * S), *cur = malloc(sizeof(int64_t) * S), *cnt = calloc(S, sizeof(int64_t));
    int64_t A = 0, calls = 0;
    for (int64_t i = 0; i < S * kmax; i++) { out_tok[i] = -1; out_conf[i] = 0.0f; }
    for (int64_t i = 0; i < S; i++) {
        reach[i] = 1.0;
        if (k[i] <= 0) continue;
        memcpy(cat + A * 2 * h, feat + i * h, sizeof(float) * h);
        seq[A] = i, cur[A] = tok[i], A++;
    }
    while (A > 0) {
        calls++;
        head_eval(H, A, cur, cat, x, logits, nthreads);
        int64_t next = 0;
        for (int64_t a = 0; a < A; a++) {
            const float *l = logits + a * H->head.out;
            int64_t j = 0, best = 0;
            f32x16 vm = splat(-INFINITY);
            for (; j + 16 <= nv; j += 16) { const f32x16 v = load_f32(l + j); vm = vsel(v > vm, v, vm); }
            float m = hmax(vm);
            for (; j < nv; j++) m = l[j] > m ? l[j] : m;
            while (l[best] != m) best++;  /* the first of tied maxima */
            f32x16 vs = splat(0.0f);
            for (j = 0; j + 16 <= nv; j += 16) vs += exp_nonpos(load_f32(l + j) - m);
            double sum = 0;
            for (int i = 0; i < 16; i++) sum += vs[i];
            for (; j < nv; j++) sum += expf(l[j] - m);
            const int64_t i = seq[a], n = cnt[i]++;
            const float conf = (float)(1.0 / sum);
            out_tok[i * kmax + n] = H->head_vocab[best], out_conf[i * kmax + n] = conf;
            reach[i] *= conf;
            if (cnt[i] < k[i] && cnt[i] < kmax && reach[i] >= stop_below) {  /* drafts on from its own prediction */
                memcpy(cat + next * 2 * h, x + a * h, sizeof(float) * h);
                seq[next] = i, cur[next] = H->head_vocab[best], next++;
            }
        }
        A = next;
    }
    free(cat); free(x); free(logits); free(reach); free(seq); free(cur); free(cnt);
    return calls;
}

int kvw_abi_version(void) { return 13; }
