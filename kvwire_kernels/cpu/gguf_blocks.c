/* GGUF block formats as stored (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) x int8 activations per block of 32.
 * Included by kvwire_cpu.c (its types and helpers); the reference is kvwire_kernels/reference.py's
 * linear_gguf, the packing kvwire_kernels/cpu.py's pack_gguf.
 *
 * A weight block is 32 inputs of one output row: Q4_0 value d * (q - 8), Q4_1 d * q + m (q in 0..15),
 * Q8_0 d * q (q in -128..127), d and m fp16; Q4_K super-blocks of 256 = 8 blocks of 32 with 6-bit
 * scales sc and mins mn under fp16 d and dmin: value (d * sc) * q - dmin * mn (both products exact in
 * fp32); Q5_K the same with 5-bit q (a fifth bit plane); Q6_K 16 blocks of 16 with int8 scales sc
 * under fp16 d: value (d * sc) * (q - 32), q 6-bit (a nibble plane and a 2-bit plane). Activations are quantized as kvw_gemm_i8a8's (q8_0:
 * s = amax / 127, a = round-to-nearest-even(x * 127 / amax)), and their integer block sums kept, so
 *     y[r][o] = sum_b (d_ob * s_rb) * (q_ob . a_rb)  [Q4_0: q - 8;  Q4_1: + m_ob * (s_rb * sum(a_rb))]
 * with the block dot products exact in int32 (|.| <= 32 * 128 * 127 < 2^24, so exact in fp32 too).
 *
 * Layout (built once at load): panels of 16 output rows; a panel's blocks follow each other, each
 * QB_BYTES(fmt) bytes: the quants, then 16 fp16 d, then (Q4_1) 16 fp16 m. The quants are 64-byte
 * vectors of 16 outputs x 4 bytes, what vpdpbusd sums over:
 *   Q4: vector k (0..3), output o, byte j = the stored block's qs[4k + j]: low nibble input 4k + j,
 *       high nibble input 16 + 4k + j (GGUF's own nibble order, so packing only moves whole bytes);
 *   Q8: vector k (0..7), output o, byte j = q[4k + j] (signed).
 *   Q4_K (unit: a super-block, QK_BYTES): vector 8g + k (g 0..3, k 0..7), output o, byte j = qs[32g + 4k + j]:
 *       low nibble input 64g + 4k + j (block 2g), high nibble 64g + 32 + 4k + j (block 2g + 1); then
 *       16 fp16 d, 16 fp16 dmin, sc [8 blocks][16 outputs] and mn [8][16] as bytes (unpacked from
 *       the file's 12 bytes once, at load: 2.8% more bytes than the file).
 *   Q5_K (Q5K_BYTES): Q4_K's quant vectors, then 8 vectors of the fifth bits: vector k, output o,
 *       byte j = qh[4k + j], whose bit b is input 32b + 4k + j's; then d, dmin, sc, mn as Q4_K's.
 *   Q6_K (Q6K_BYTES): 32 nibble vectors, vector 16h + k (h 0..1, k 0..15), output o, byte j = ql[64h + 4k + j]:
 *       low nibble input 128h + 4k + j, high 128h + 64 + 4k + j; 16 vectors of the 2-bit parts,
 *       vector 8h + k, byte j = qh[32h + 4k + j], bits 2s..2s+1 input 128h + 32s + 4k + j; then
 *       sc [16 blocks of 16][16 outputs] int8 and 16 fp16 d: exactly the file's bytes, moved.
 * So one row (batch-1 decode) reads the weights as one sequential stream of the file's bytes.
 *
 * Paths, chosen at compile time from -march=native: AVX512-VNNI (vpdpbusd: unsigned nibbles x signed
 * activations directly; Q8_0 flipped to unsigned in a register, 128 * sum(a) taken back), AVX2
 * (vpmaddubsw + vpmaddwd: nibble pairs cannot saturate int16; Q8_0 by the sign trick) and plain C.
 * Every path computes the same integers; each output element's fp32 steps are the same in every row
 * tile and thread split, so a row's result does not depend on its batch or the thread count.
 */

#define QF_Q4_0 0
#define QF_Q4_1 1
#define QF_Q8_0 2
#define QF_Q4_K 3
#define QB_BYTES(F) ((F) == QF_Q8_0 ? 512 + 32 : (F) == QF_Q4_1 ? 256 + 64 : 256 + 32)
#define QK_BYTES (2048 + 64 + 256)  /* one Q4_K super-block of a panel */
#define QF_Q5_K 4
#define QF_Q6_K 5
#define Q5K_BYTES (2048 + 512 + 64 + 256)
#define Q6K_BYTES (2048 + 1024 + 256 + 32)
#define UNIT_BYTES(F) ((F) == QF_Q4_K ? QK_BYTES : (F) == QF_Q5_K ? Q5K_BYTES : (F) == QF_Q6_K ? Q6K_BYTES : QB_BYTES(F))
#define UNIT_VALUES(F) ((F) >= QF_Q4_K ? 256 : 32)

typedef uint8_t u8x64 __attribute__((vector_size(64)));

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QG_NR 6  /* activation rows per tile: 2 int32 sums + 1 fp32 accumulator each stay in registers */
#define Q8_BIAS 128  /* vpdpbusd takes unsigned weights: Q8_0 goes in as q + 128 */
#elif defined(__AVX2__)
#define QG_NR 2
#define Q8_BIAS 0
#else
#define QG_NR 4
#define Q8_BIAS 0
#endif

/* acc + per output lane o: sum_j w[4o + j] * a4's byte j. Unsigned w (nibbles, or Q8_0 + Q8_BIAS). */
ALWAYS_INLINE i32x16 dot_u8(i32x16 acc, u8x64 w, int32_t a4) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return (i32x16)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(a4));
#elif defined(__AVX2__)
    __m256i wh[2], ah[2];
    memcpy(wh, &w, 64); memcpy(ah, &acc, 64);
    const __m256i av = _mm256_set1_epi32(a4), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++)  /* pairs of nibble x int8 products: |.| <= 2 * 15 * 128, no int16 saturation */
        ah[h] = _mm256_add_epi32(ah[h], _mm256_madd_epi16(_mm256_maddubs_epi16(wh[h], av), ones));
    memcpy(&acc, ah, 64); return acc;
#else
    int8_t a[4]; memcpy(a, &a4, 4);
    for (int o = 0; o < 16; o++)
        for (int j = 0; j < 4; j++) acc[o] += (int32_t)w[4 * o + j] * a[j];
    return acc;
#endif
}

/* The same for signed weights (Q8_0), plus Q8_BIAS * sum(a4's bytes) per lane. */
ALWAYS_INLINE i32x16 dot_s8(i32x16 acc, u8x64 w, int32_t a4) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return dot_u8(acc, w ^ 0x80, a4);
#elif defined(__AVX2__)
    __m256i wh[2], ah[2];
    memcpy(wh, &w, 64); memcpy(ah, &acc, 64);
    const __m256i av = _mm256_set1_epi32(a4), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {  /* |w| x sign(w) * a: pairs <= 2 * 128 * 127, no saturation */
        const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wh[h], wh[h]), _mm256_sign_epi8(av, wh[h]));
        ah[h] = _mm256_add_epi32(ah[h], _mm256_madd_epi16(p, ones));
    }
    memcpy(&acc, ah, 64); return acc;
#else
    int8_t a[4]; memcpy(a, &a4, 4);
    for (int o = 0; o < 16; o++)
        for (int j = 0; j < 4; j++) acc[o] += (int32_t)(int8_t)w[4 * o + j] * a[j];
    return acc;
#endif
}

ALWAYS_INLINE f32x16 load_f16(const uint8_t *p) {  /* 16 fp16 -> fp32 (exact) */
#if defined(__AVX512F__)
    __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    __m256 v[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))};
#else
    float v[16];
    for (int i = 0; i < 16; i++) {
        uint16_t h; memcpy(&h, p + 2 * i, 2);
        const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
        float f = e == 0 ? ldexpf((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(m | 0x400), (int)e - 25);
        v[i] = f32_from(f32_bits(f) | sign);
    }
#endif
    f32x16 r; memcpy(&r, &v, 64); return r;
}
ALWAYS_INLINE u8x64 load_u8x64(const uint8_t *p) { u8x64 v; memcpy(&v, p, 64); return v; }

typedef struct {
    int8_t *q;  /* [rows, in] */
    float *s;  /* [rows, in / 32]: each block's scale */
    int32_t *sum;  /* [rows, in / 32]: each block's sum of q */
    int32_t *sum16;  /* [rows, in / 16]: each half block's sum of q (Q6_K's blocks of 16) */
} actq_t;

/* reference.quantize_act8 bit for bit, plus the block sums. */
static void quantize_blocks(const float *x, int64_t rows, int64_t in, actq_t a) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < in / 32; b++) {
            const float *xp = x + r * in + 32 * b;
            const u32x16 abs_mask = (u32x16){0} + 0x7FFFFFFFu;
            const f32x16 v0 = (f32x16)((u32x16)load_f32(xp) & abs_mask), v1 = (f32x16)((u32x16)load_f32(xp + 16) & abs_mask);
            const float amax = hmax(vsel((i32x16)(v0 > v1), v0, v1));
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *qp = a.q + r * in + 32 * b;
            int32_t sum[2] = {0, 0};
#if defined(__AVX512F__)
            for (int h = 0; h < 2; h++) {  /* rintf's numbers: vcvtps2dq rounds as MXCSR says, nearest even */
                const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xp + 16 * h), _mm512_set1_ps(inv)));
                _mm_storeu_si128((__m128i *)(qp + 16 * h), _mm512_cvtepi32_epi8(qi));
                sum[h] = _mm512_reduce_add_epi32(qi);
            }
#else
            for (int i = 0; i < 32; i++) qp[i] = (int8_t)rintf(xp[i] * inv);  /* default rounding: nearest even */
            for (int i = 0; i < 32; i++) sum[i / 16] += qp[i];
#endif
            a.s[r * (in / 32) + b] = amax / 127.0f;
            a.sum[r * (in / 32) + b] = sum[0] + sum[1];
            a.sum16[r * (in / 16) + 2 * b] = sum[0];
            a.sum16[r * (in / 16) + 2 * b + 1] = sum[1];
        }
}

/* A tile's NR rows x 16 outputs from their fp32 accumulators: acc * scale + bias (+ residual). */
ALWAYS_INLINE void qtile_store(const f32x16 *acc, int64_t o0, int64_t r0, int64_t out, float *y, const float *scale,
                               const float *bias, const float *res, const int NR) {
    const f32x16 sc = scale ? load_f32(scale + o0) : (f32x16){0} + 1.0f;
    const f32x16 bi = bias ? load_f32(bias + o0) : (f32x16){0};
    for (int r = 0; r < NR; r++) {
        f32x16 v = acc[r] * sc + bi;
        float *yp = y + (r0 + r) * out + o0;
        if (res) v = load_f32(res + (r0 + r) * out + o0) + v;
        store_f32(yp, v);
    }
}

/* NR activation rows from r0 x the 16 outputs of one panel (its blocks from wp). */
ALWAYS_INLINE void qgemm_tile(actq_t a, int64_t in, const uint8_t *wp, int64_t o0, int64_t r0, int64_t out,
                              float *y, const float *scale, const float *bias, const float *res, const int F,
                              const int NR) {
    const int64_t nb = in / 32;
    f32x16 acc[QG_NR];
    for (int r = 0; r < NR; r++) acc[r] = (f32x16){0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wp + (size_t)b * QB_BYTES(F);
        i32x16 s0[QG_NR], s1[QG_NR];  /* two chains per row (added at the block's end: integers, exact) */
        for (int r = 0; r < NR; r++) s0[r] = s1[r] = (i32x16){0};
        const int8_t *aq = a.q + r0 * in + 32 * b;
        if (F == QF_Q8_0) {
            for (int k = 0; k < 8; k += 2) {
                const u8x64 w0 = load_u8x64(blk + 64 * k), w1 = load_u8x64(blk + 64 * k + 64);
                for (int r = 0; r < NR; r++) {
                    int32_t a0, a1;
                    memcpy(&a0, aq + r * in + 4 * k, 4); memcpy(&a1, aq + r * in + 4 * k + 4, 4);
                    s0[r] = dot_s8(s0[r], w0, a0);
                    s1[r] = dot_s8(s1[r], w1, a1);
                }
            }
        } else {
            for (int k = 0; k < 4; k++) {
                const u8x64 v = load_u8x64(blk + 64 * k), lo = v & 0x0F, hi = (v >> 4) & 0x0F;
                for (int r = 0; r < NR; r++) {
                    int32_t a0, a1;
                    memcpy(&a0, aq + r * in + 4 * k, 4); memcpy(&a1, aq + r * in + 16 + 4 * k, 4);
                    s0[r] = dot_u8(s0[r], lo, a0);
                    s1[r] = dot_u8(s1[r], hi, a1);
                }
            }
        }
        const int qbytes = F == QF_Q8_0 ? 512 : 256;
        const f32x16 d = load_f16(blk + qbytes);
        for (int r = 0; r < NR; r++) {
            const int64_t ab = (r0 + r) * nb + b;
            const float s = a.s[ab];
            const int32_t asum = a.sum[ab];
            i32x16 dot = s0[r] + s1[r];
            if (F == QF_Q4_0) dot -= 8 * asum;
            if (F == QF_Q8_0) dot -= Q8_BIAS * asum;
            acc[r] += __builtin_convertvector(dot, f32x16) * (d * s);
            if (F == QF_Q4_1) acc[r] += load_f16(blk + qbytes + 32) * (s * (float)asum);
        }
    }
    qtile_store(acc, o0, r0, out, y, scale, bias, res, NR);
}

/* Q4_K / Q5_K, blocks 2g (low nibbles) and 2g + 1 (high) of a super-block for NR rows. */
ALWAYS_INLINE void qk_pair(actq_t a, int64_t in, const uint8_t *blk, int64_t sb, int64_t r0, f32x16 *acc,
                           f32x16 d, f32x16 dmin, const int F, const int g, const int NR) {
    const int64_t nb = in / 32;
    const int hb = F == QF_Q5_K ? 512 : 0;  /* bytes of fifth bits after the nibbles */
    const uint8_t *sc8 = blk + 2048 + hb + 64;
    i32x16 s0[QG_NR], s1[QG_NR];
    for (int r = 0; r < NR; r++) s0[r] = s1[r] = (i32x16){0};
    const int8_t *aq = a.q + r0 * in + 256 * sb + 64 * g;
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        const u8x64 v = load_u8x64(blk + 64 * (8 * g + k));
        u8x64 lo = v & 0x0F, hi = (v >> 4) & 0x0F;
        if (F == QF_Q5_K) {
            const u8x64 h5 = load_u8x64(blk + 2048 + 64 * k);
            lo |= ((h5 >> (2 * g)) & 1) << 4;
            hi |= ((h5 >> (2 * g + 1)) & 1) << 4;
        }
        for (int r = 0; r < NR; r++) {
            int32_t a0, a1;
            memcpy(&a0, aq + r * in + 4 * k, 4); memcpy(&a1, aq + r * in + 32 + 4 * k, 4);
            s0[r] = dot_u8(s0[r], lo, a0);
            s1[r] = dot_u8(s1[r], hi, a1);
        }
    }
    for (int h = 0; h < 2; h++) {
        const int j = 2 * g + h;  /* block j of the super-block */
        const f32x16 dj = d * __builtin_convertvector(widen_u8(sc8 + 16 * j), f32x16);
        const f32x16 mj = dmin * __builtin_convertvector(widen_u8(sc8 + 128 + 16 * j), f32x16);
        for (int r = 0; r < NR; r++) {
            const int64_t ab = (r0 + r) * nb + 8 * sb + j;
            const float s = a.s[ab];
            acc[r] += __builtin_convertvector(h ? s1[r] : s0[r], f32x16) * (dj * s);
            acc[r] -= mj * (s * (float)a.sum[ab]);
        }
    }
}

/* The same for Q4_K and Q5_K: NR rows x one panel, a super-block (8 blocks of 32) at a time. Up to 2
 * rows (decode) its four pairs of blocks are spelled out, g constant in each: Q4_K 1.1-1.2x and Q5_K
 * 1.6-2x the rolled loop's bytes per second at 1-2 rows, the same bits. */
ALWAYS_INLINE void qk_tile(actq_t a, int64_t in, const uint8_t *wp, int64_t o0, int64_t r0, int64_t out,
                           float *y, const float *scale, const float *bias, const float *res, const int F,
                           const int NR) {
    f32x16 acc[QG_NR];
    for (int r = 0; r < NR; r++) acc[r] = (f32x16){0};
    for (int64_t sb = 0; sb < in / 256; sb++) {
        const uint8_t *blk = wp + (size_t)sb * UNIT_BYTES(F);
        const int hb = F == QF_Q5_K ? 512 : 0;
        const f32x16 d = load_f16(blk + 2048 + hb), dmin = load_f16(blk + 2048 + hb + 32);
        if (NR <= 2) {
            qk_pair(a, in, blk, sb, r0, acc, d, dmin, F, 0, NR);
            qk_pair(a, in, blk, sb, r0, acc, d, dmin, F, 1, NR);
            qk_pair(a, in, blk, sb, r0, acc, d, dmin, F, 2, NR);
            qk_pair(a, in, blk, sb, r0, acc, d, dmin, F, 3, NR);
        } else {
            for (int g = 0; g < 4; g++) qk_pair(a, in, blk, sb, r0, acc, d, dmin, F, g, NR);
        }
    }
    qtile_store(acc, o0, r0, out, y, scale, bias, res, NR);
}

/* Q6_K, one quarter of a super-block for NR rows: the half blocks 8h + 2t + kh (t 0..3), their
 * vectors k in 4kh .. 4kh + 3; q6 = nibble | 2 bits << 4 in 0..63 (vpmaddubsw pairs stay below
 * 2 * 63 * 128), minus 32 through the half-block sums. */
ALWAYS_INLINE void q6k_quarter(actq_t a, int64_t in, const uint8_t *blk, int64_t sb, int64_t r0, f32x16 *acc,
                               const int h, const int kh, const int NR) {
    const int64_t nb = in / 32;
    const int8_t *sc8 = (const int8_t *)(blk + 3072);
    const f32x16 d = load_f16(blk + 3072 + 256);
    i32x16 sums[4][QG_NR];
    for (int t = 0; t < 4; t++)
        for (int r = 0; r < NR; r++) sums[t][r] = (i32x16){0};
#pragma GCC unroll 4
    for (int k = 4 * kh; k < 4 * kh + 4; k++) {
        const u8x64 l0 = load_u8x64(blk + 64 * (16 * h + k)), l1 = load_u8x64(blk + 64 * (16 * h + 8 + k));
        const u8x64 qh = load_u8x64(blk + 2048 + 64 * (8 * h + k));
        /* each 2-bit part masked where it lands (bits 4-5): one shift fewer per value */
        const u8x64 q[4] = {(l0 & 0x0F) | ((qh << 4) & 0x30), (l1 & 0x0F) | ((qh << 2) & 0x30),
                            ((l0 >> 4) & 0x0F) | (qh & 0x30), ((l1 >> 4) & 0x0F) | ((qh >> 2) & 0x30)};
        for (int r = 0; r < NR; r++) {
            const int8_t *aq = a.q + (r0 + r) * in + 256 * sb + 128 * h + 4 * k;
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                int32_t a4; memcpy(&a4, aq + 32 * t, 4);
                sums[t][r] = dot_u8(sums[t][r], q[t], a4);
            }
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < 4; t++) {
        const int j = 8 * h + 2 * t + kh;  /* half block j of the super-block */
        const f32x16 dj = d * __builtin_convertvector(widen_i8(sc8 + 16 * j), f32x16);
        for (int r = 0; r < NR; r++) {
            const float s = a.s[(r0 + r) * nb + 8 * sb + 4 * h + t];
            const int32_t asum = a.sum16[(r0 + r) * 2 * nb + 16 * sb + j];
            acc[r] += __builtin_convertvector(sums[t][r] - 32 * asum, f32x16) * (dj * s);
        }
    }
}

/* Q6_K: NR rows x one panel, a super-block at a time. Up to 2 rows (decode) the four quarters are
 * spelled out, so h and kh are constants in each: 2.2-3x the rolled loop's bytes per second at one
 * row (the rolled loop kept the half-block sums out of registers); past that the loop is as fast. */
ALWAYS_INLINE void q6k_tile(actq_t a, int64_t in, const uint8_t *wp, int64_t o0, int64_t r0, int64_t out,
                            float *y, const float *scale, const float *bias, const float *res, const int F,
                            const int NR) {
    (void)F;
    f32x16 acc[QG_NR];
    for (int r = 0; r < NR; r++) acc[r] = (f32x16){0};
    for (int64_t sb = 0; sb < in / 256; sb++) {
        const uint8_t *blk = wp + (size_t)sb * Q6K_BYTES;
        if (NR <= 2) {
            q6k_quarter(a, in, blk, sb, r0, acc, 0, 0, NR);
            q6k_quarter(a, in, blk, sb, r0, acc, 0, 1, NR);
            q6k_quarter(a, in, blk, sb, r0, acc, 1, 0, NR);
            q6k_quarter(a, in, blk, sb, r0, acc, 1, 1, NR);
        } else {
            for (int h = 0; h < 2; h++)
                for (int kh = 0; kh < 2; kh++) q6k_quarter(a, in, blk, sb, r0, acc, h, kh, NR);
        }
    }
    qtile_store(acc, o0, r0, out, y, scale, bias, res, NR);
}

/* T's tile for the next min(rows - r, N) rows (N <= QG_NR), with NR a constant in each case. */
#define QTILE(T, F, NR) T(a, in, panel, o, r, out, y, scale, bias, res, F, NR); break;
#if QG_NR == 6
#define QTILE_CASES(T, F, N) switch (rows - r < (N) ? rows - r : (N)) { \
    case 1: QTILE(T, F, 1) case 2: QTILE(T, F, 2) case 3: QTILE(T, F, 3) case 4: QTILE(T, F, 4) case 5: QTILE(T, F, 5) \
    default: QTILE(T, F, N) }
#elif QG_NR == 4
#define QTILE_CASES(T, F, N) switch (rows - r < (N) ? rows - r : (N)) { \
    case 1: QTILE(T, F, 1) case 2: QTILE(T, F, 2) case 3: QTILE(T, F, 3) default: QTILE(T, F, N) }
#else
#define QTILE_CASES(T, F, N) switch (rows - r < (N) ? rows - r : (N)) { case 1: QTILE(T, F, 1) default: QTILE(T, F, N) }
#endif

/* Q6_K's tile keeps four half-block sums per row in registers: at 6 rows they spill, so its tiles
 * take at most 4 rows (docs/decisions/070-fp8-through-f16c-and-parallel-act-quant.md). */
#define Q6_NR (QG_NR > 4 ? 4 : QG_NR)

static void range_qgemm(actq_t a, int64_t rows, int64_t in, const uint8_t *wp, int64_t out, int64_t g_begin,
                        int64_t g_end, float *y, const float *scale, const float *bias, const float *res, const int F) {
    /* One panel (16 outputs x in inputs: L1/L2-resident) against every row tile in turn. */
    const int64_t nr = F == QF_Q6_K ? Q6_NR : QG_NR;
    for (int64_t g = g_begin; g < g_end; g++) {
        const uint8_t *panel = wp + (size_t)g * (in / UNIT_VALUES(F)) * UNIT_BYTES(F);
        const int64_t o = g * 16;
        for (int64_t r = 0; r < rows; r += nr) {
            if (F == QF_Q4_0) { QTILE_CASES(qgemm_tile, QF_Q4_0, QG_NR) }
            else if (F == QF_Q4_1) { QTILE_CASES(qgemm_tile, QF_Q4_1, QG_NR) }
            else if (F == QF_Q8_0) { QTILE_CASES(qgemm_tile, QF_Q8_0, QG_NR) }
            else if (F == QF_Q4_K) { QTILE_CASES(qk_tile, QF_Q4_K, QG_NR) }
            else if (F == QF_Q5_K) { QTILE_CASES(qk_tile, QF_Q5_K, QG_NR) }
            else { QTILE_CASES(q6k_tile, QF_Q6_K, Q6_NR) }
        }
    }
}

/* y [rows, out] = q8_0(x) . w (* scale) + bias + res, w packed as above; out % 16 == 0, in % 32 == 0
 * (K types: in % 256 == 0).
 * Threads take contiguous ranges of panels, so each output element has one owner. */
static void qgemm(const float *x, int64_t rows, int64_t in, const uint8_t *wp, int64_t out, float *y,
                  const float *scale, const float *bias, const float *res, int nthreads, const int F) {
    const int64_t nb = in / 32;
    actq_t a = {malloc((size_t)rows * in + 64), malloc(sizeof(float) * rows * nb), malloc(sizeof(int32_t) * rows * nb),
                malloc(sizeof(int32_t) * rows * nb * 2)};
    const int split = rows >= QUANT_SPLIT_ROWS;  /* as kvw_gemm_i8a8 */
    if (!split) quantize_blocks(x, rows, in, a);
    const int64_t groups = out / 16;
#pragma omp parallel num_threads(nthreads)
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        if (split) {
            const int64_t r0 = rows * id / nt, r1 = rows * (id + 1) / nt;
            quantize_blocks(x + r0 * in, r1 - r0, in, (actq_t){a.q + r0 * in, a.s + r0 * nb, a.sum + r0 * nb, a.sum16 + r0 * nb * 2});
#pragma omp barrier
        }
        range_qgemm(a, rows, in, wp, out, groups * id / nt, groups * (id + 1) / nt, y, scale, bias, res, F);
    }
    free(a.q); free(a.s); free(a.sum); free(a.sum16);
}

/* The exported entry points, one per block type (ctypes looks them up by name). */
#define QGEMM_ENTRY(NAME, F)                                                                                   \
    void kvw_gemm_##NAME(const float *x, int64_t rows, int64_t in, const uint8_t *wp, int64_t out, float *y,    \
                         const float *scale, const float *bias, const float *res, int nthreads) {              \
        qgemm(x, rows, in, wp, out, y, scale, bias, res, nthreads, F);                                          \
    }
QGEMM_ENTRY(q4_0, QF_Q4_0)
QGEMM_ENTRY(q4_1, QF_Q4_1)
QGEMM_ENTRY(q8_0, QF_Q8_0)
QGEMM_ENTRY(q4_k, QF_Q4_K)
QGEMM_ENTRY(q5_k, QF_Q5_K)
QGEMM_ENTRY(q6_k, QF_Q6_K)
#undef QGEMM_ENTRY

/* q [rows, in] int8, s and block sums [rows, in / 32], half-block sums [rows, in / 16] as the kernels
 * above read them (tests). */
void kvw_quantize_blocks(const float *x, int64_t rows, int64_t in, int8_t *q, float *s, int32_t *sum, int32_t *sum16) {
    quantize_blocks(x, rows, in, (actq_t){q, s, sum, sum16});
}

/* 2 with AVX512-VNNI, 1 with AVX2, 0 plain C: the path this build's GGUF kernels take (tests). */
int kvw_gguf_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}
