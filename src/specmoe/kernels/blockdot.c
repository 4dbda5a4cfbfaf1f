/* y = x W^T with W kept in its GGUF block encoding (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K,
 * Q4_K, Q5_K, Q6_K, MXFP4): the weights are never widened to float in memory.
 *
 * specmoe compiles this file once per machine with the system's C compiler (-march=native,
 * -ffp-contract=off) and loads it with ctypes (experts/blockdot.py); it needs nothing else.
 *
 * The math (one definition, two code paths that give the same bits):
 *   - Activations: each row is quantized on its own to int8 in blocks, one scale dx per
 *     block, exactly as llama.cpp rounds them before the same weights: for K-quant weights
 *     blocks of 256 (its Q8_K: dx = 1 / (127 / max|x|)), for the others blocks of 32 (its
 *     Q8_0: dx = max|x| / 127 rounded to float16). Kept per 16 values: xs16 = dx and
 *     xsum16 = dx * (sum of the 16 codes).
 *   - Weights: a row is unpacked 256 values at a time (a "chunk": one K-quant super-block,
 *     or eight 32-value blocks) into unsigned 8-bit codes u and, per 16 values, a float
 *     scale ws and offset wm, so that each weight is ws * u + wm. Every block type is one
 *     unpacker into this form (a signed code q becomes u = q + c with wm = -c * ws).
 *   - Both keep a chunk's 16 groups of 16 values in "slot order" (to_slots below): vector i
 *     (i = 0..3, 64 bytes) holds in its 32-bit lane l four values of group lane_group(i, l),
 *     and the two vectors of a half, 2h and 2h + 1, hold the two groups of one 32-value
 *     block in the same lane.
 *   - Dot product of one activation row and one weight row, in 16 float lanes. Where a
 *     32-value block has one scale ("paired" types: all but Q2_K, Q3_K and Q6_K), lane l
 *     of set h (h = 0, 1) adds the exact integer sum of the 8 products u * xq of vectors
 *     2h and 2h + 1 times ws * xs16 of their group (one fused multiply-add per chunk and
 *     half, in chunk order); at the end (f0 + f1) + g. Where each 16 values have their own
 *     scale, lane l of set i adds vector i's 4 products times its group's ws * xs16, and
 *     the end is ((f0 + f1) + (f2 + f3)) + g. A last set g adds wm * xsum16, and the 16
 *     lanes are summed as a fixed tree.
 * So an output element depends only on its own activation row and weight row, summed in
 * one order whatever the number of rows in the call or the thread that computes it: the
 * product is batch-invariant by construction, and the AVX-512 VNNI path (vpdpbusd) and the
 * portable C path (SMK_PORTABLE, or a CPU without it) give identical results.
 */
#include <math.h>
#include <pthread.h>
#if defined(__F16C__) || defined(__SSSE3__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(SMK_PORTABLE)
#include <immintrin.h>
#define SMK_VNNI 1
#else
#define SMK_VNNI 0
#endif

#define CHUNK 256
#define PREFETCH(p) __builtin_prefetch((p), 0, 3)  /* a read, kept in every cache level */
#define GROUPS (CHUNK / 16)

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12,
       T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30, T_MXFP4 = 39 };

int smk_simd(void) { return SMK_VNNI; }

/* --- slot order: where a chunk keeps its 16 groups of 16 values ------------------------------- */

/* Each half of a chunk (values 128 h to 128 h + 127) keeps its 8 groups in bit-reversed order,
 * so that vector 2h + j, 32-bit lane l, holds group 8 h + SLOT_GROUP[l / 4] + j: the lanes of
 * vectors 2h and 2h + 1 hold the two halves of one 32-value block, whose integer products
 * one accumulator can add where the block has one scale. It is the order a 64-byte load of
 * Q4_K nibbles gives, so Q4_K's unpacker pays nothing for it. */
static const int SLOT_GROUP[8] = {0, 4, 2, 6, 1, 5, 3, 7};

static inline int lane_group(int i, int l) { return 8 * (i / 2) + SLOT_GROUP[l / 4] + i % 2; }

/* A chunk of 256 codes from value order into slot order. */
static void to_slots(uint8_t *chunk) {
    uint8_t t[CHUNK];
    memcpy(t, chunk, CHUNK);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 8; s++) memcpy(chunk + 128 * h + 16 * s, t + 128 * h + 16 * SLOT_GROUP[s], 16);
}

/* Whether a type's two 16-value groups of a 32-value block share one scale and offset. */
static inline int paired(int type) { return type != T_Q2_K && type != T_Q3_K && type != T_Q6_K; }

static inline float f16(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);  /* exact, as below */
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) bits = sign | 0x7F800000 | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else {  /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* --- weights: one chunk of a row into codes u[256], ws[16], wm[16] --------------------------- */

/* Bytes a block of the type takes and values it holds; 0 for an unknown type. */
static int block_bytes(int type, int *values) {
    *values = 32;
    switch (type) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_MXFP4: return 17;
    }
    *values = 256;
    switch (type) {
    case T_Q2_K: return 84;
    case T_Q3_K: return 110;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    }
    return 0;
}

static inline void put32(float *ws, float *wm, int g32, float s, float m) {
    ws[2 * g32] = ws[2 * g32 + 1] = s;
    wm[2 * g32] = wm[2 * g32 + 1] = m;
}

/* n bytes (a multiple of 8) -> their low nibbles at lo, their high nibbles at hi, eight
 * bytes at a time (byte stores one by one cost more than the rest of the product). */
static inline void nibbles(const uint8_t *q, int n, uint8_t *lo, uint8_t *hi) {
    for (int k = 0; k < n; k += 8) {
        uint64_t w;
        memcpy(&w, q + k, 8);
        uint64_t l = w & 0x0F0F0F0F0F0F0F0FULL, h = (w >> 4) & 0x0F0F0F0F0F0F0F0FULL;
        memcpy(lo + k, &l, 8);
        memcpy(hi + k, &h, 8);
    }
}

/* Codes 0-15 -> table[code], 16 at a time where the CPU has a byte shuffle. */
static inline void lookup16(const uint8_t *table, uint8_t *v) {
#if defined(__SSSE3__)
    __m128i t = _mm_loadu_si128((const __m128i *)table), c = _mm_loadu_si128((const __m128i *)v);
    _mm_storeu_si128((__m128i *)v, _mm_shuffle_epi8(t, c));
#else
    for (int j = 0; j < 16; j++) v[j] = table[v[j]];
#endif
}

/* 2^(e - 128): an e8m0 exponent halved, because the e2m1 table below is doubled. */
static inline float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* A 32-value block (legacy types) into u[32] and the scale and offset of its two groups. */
static inline __attribute__((always_inline)) void unpack32(int type, const uint8_t *b, uint8_t *u, float *ws, float *wm, int g32) {
    static const uint8_t e2m1[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};  /* value + 12 */
    float d;
    uint32_t qh;
    switch (type) {
    case T_Q8_0:
        d = f16(b);
        for (int j = 0; j < 32; j++) u[j] = (uint8_t)(b[2 + j] ^ 0x80);  /* int8 q -> q + 128 */
        put32(ws, wm, g32, d, -128.0f * d);
        return;
    case T_Q4_0:
    case T_Q4_1:
        d = f16(b);
        nibbles(b + (type == T_Q4_0 ? 2 : 4), 16, u, u + 16);
        put32(ws, wm, g32, d, type == T_Q4_0 ? -8.0f * d : f16(b + 2));
        return;
    case T_Q5_0:
    case T_Q5_1: {
        int at = type == T_Q5_0 ? 2 : 4;
        d = f16(b);
        memcpy(&qh, b + at, 4);
        for (int j = 0; j < 16; j++) {
            u[j] = (uint8_t)((b[at + 4 + j] & 0x0F) | (((qh >> j) & 1) << 4));
            u[j + 16] = (uint8_t)((b[at + 4 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
        }
        put32(ws, wm, g32, d, type == T_Q5_0 ? -16.0f * d : f16(b + 2));
        return;
    }
    case T_MXFP4:
        d = e8m0_half(b[0]);
        nibbles(b + 1, 16, u, u + 16);
        lookup16(e2m1, u);
        lookup16(e2m1, u + 16);
        put32(ws, wm, g32, d, -12.0f * d);
        return;
    }
}

static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* A K-quant super-block (256 values) into u[256], ws[16], wm[16]. */
static inline __attribute__((always_inline)) void unpack256(int type, const uint8_t *b, uint8_t *u, float *ws, float *wm) {
    switch (type) {
    case T_Q4_K:
    case T_Q5_K: {
        float d = f16(b), dmin = f16(b + 2);
        const uint8_t *sc12 = b + 4, *qh = b + 16, *qs = b + (type == T_Q4_K ? 16 : 48);
        for (int j = 0; j < 4; j++) {  /* 64 values: low nibbles of 32 bytes, then their high ones */
            uint8_t *o = u + 64 * j;
            const uint8_t *q = qs + 32 * j;
            nibbles(q, 32, o, o + 32);
            if (type == T_Q5_K)
                for (int l = 0; l < 32; l++) {
                    o[l] |= ((qh[l] >> (2 * j)) & 1) << 4;
                    o[l + 32] |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
                }
            for (int h = 0; h < 2; h++) {
                int sc, m;
                scale_min_k4(2 * j + h, sc12, &sc, &m);
                put32(ws, wm, 2 * j + h, d * (float)sc, -(dmin * (float)m));
            }
        }
        return;
    }
    case T_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = f16(b + 208);
        for (int n = 0; n < 2; n++) {  /* halves of 128 values */
            uint8_t *o = u + 128 * n;
            const uint8_t *l4 = ql + 64 * n, *h2 = qh + 32 * n;
            for (int l = 0; l < 32; l++) {
                o[l] = (uint8_t)((l4[l] & 0xF) | ((h2[l] & 3) << 4));
                o[l + 32] = (uint8_t)((l4[l + 32] & 0xF) | (((h2[l] >> 2) & 3) << 4));
                o[l + 64] = (uint8_t)((l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4));
                o[l + 96] = (uint8_t)((l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4));
            }
        }
        for (int g = 0; g < GROUPS; g++) {
            ws[g] = d * (float)sc[g];
            wm[g] = -32.0f * ws[g];
        }
        return;
    }
    case T_Q2_K: {
        const uint8_t *s = b, *qs = b + 16;
        float d = f16(b + 80), dmin = f16(b + 82);
        for (int n = 0; n < 2; n++)
            for (int f = 0; f < 4; f++)  /* field f of 32 bytes: 32 values */
                for (int l = 0; l < 32; l++) u[128 * n + 32 * f + l] = (qs[32 * n + l] >> (2 * f)) & 3;
        for (int g = 0; g < GROUPS; g++) {
            ws[g] = d * (float)(s[g] & 0xF);
            wm[g] = -(dmin * (float)(s[g] >> 4));
        }
        return;
    }
    case T_Q3_K: {
        const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
        float d = f16(b + 108);
        for (int n = 0; n < 2; n++)
            for (int f = 0; f < 4; f++)
                for (int l = 0; l < 32; l++) {
                    int v = 128 * n + 32 * f + l;
                    u[v] = (uint8_t)(((qs[32 * n + l] >> (2 * f)) & 3) | (((hm[l] >> (4 * n + f)) & 1) << 2));
                }
        for (int g = 0; g < GROUPS; g++) {
            int low = g < 8 ? s[g] & 0xF : s[g - 8] >> 4, top = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
            ws[g] = d * (float)((low | (top << 4)) - 32);
            wm[g] = -4.0f * ws[g];
        }
        return;
    }
    }
}

#if SMK_VNNI
/* AVX-512 unpackers of the most common K-quants: the same codes, scales and offsets as
 * unpack256 (the same float products), a few vector operations per super-block instead of
 * hundreds of byte operations. */

/* The AVX-512 unpackers give a chunk in registers: four vectors of 64 codes in slot order,
 * the scales and the offsets of its 16 groups. Stored (unpack_*_avx512) they are what the
 * portable unpackers write; a product of a few rows dots them where they are
 * (row_dots_fused). */
static inline void q4k_regs(const uint8_t *b, __m512i u[4], __m512 *ws, __m512 *wm) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    for (int h = 0; h < 2; h++) {  /* 64 bytes: half h; 16 bytes' low nibbles are group 8h + 0, 1, 4, 5, high 2, 3, 6, 7 */
        __m512i q = _mm512_loadu_si512((const void *)(b + 16 + 64 * h));
        __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        u[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x88);      /* groups 0, 4, 2, 6 */
        u[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xDD);  /* groups 1, 5, 3, 7 */
    }
    /* the 6-bit scales and mins (sc0..7, m0..7 as scale_min_k4 gives them) from the 12 bytes
     * as words d, m, md: sc0-3 = d & 63, sc4-7 = md & 15 | (d >> 2) & 48, the mins likewise
     * from m and md >> 4; in a vector, because scalar stores read back as one stalled the chunk */
    __m128i v = _mm_loadu_si128((const __m128i *)(b + 4));
    __m128i P = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)), _mm_set_epi32(4, 0, 0, 0));
    __m128i Q = _mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)), 2);
    __m128i sm = _mm_or_si128(_mm_and_si128(P, _mm_set_epi32(0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F)),
                              _mm_and_si128(Q, _mm_set_epi32(0x30303030, 0, 0x30303030, 0)));
    __m512 all = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sm));
    __m512 sc = _mm512_permutexvar_ps(pairs, all);
    __m512 mn = _mm512_permutexvar_ps(_mm512_add_epi32(pairs, _mm512_set1_epi32(8)), all);
    int d_dmin;
    memcpy(&d_dmin, b, 4);
    __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(d_dmin));
    *ws = _mm512_mul_ps(_mm512_broadcastss_ps(dd), sc);
    __m512 dm = _mm512_mul_ps(_mm512_broadcastss_ps(_mm_movehdup_ps(dd)), mn);
    *wm = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dm), _mm512_set1_epi32((int)0x80000000)));
}

/* Q6_K: half n is 64 bytes of low 4 bits (value l: byte l % 32 + 32 * (l / 32 % 2), nibble
 * l / 64) and 32 of high 2 bits (byte l % 32, bits 2 * (l / 32)). Vector 2n + j of slot order
 * holds groups 0, 4, 2, 6 (+ j): the nibbles of 16 bytes taken twice, and the 2 bits of the
 * same 16 high bytes (0-1, 4-5, 2-3, 6-7) rotated to bits 4-5, one lane each. */
static inline void q6k_regs(const uint8_t *b, __m512i u[4], __m512 *ws, __m512 *wm) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i nibble = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0), high = _mm512_set_epi64(62, 62, 2, 2, 0, 0, 4, 4);
    for (int n = 0; n < 2; n++) {
        __m512i L = _mm512_loadu_si512((const void *)(b + 64 * n));
        for (int j = 0; j < 2; j++) {
            __m512i lo = j ? _mm512_shuffle_i64x2(L, L, 0xF5) : _mm512_shuffle_i64x2(L, L, 0xA0);
            __m512i H = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(b + 128 + 32 * n + 16 * j)));
            u[2 * n + j] = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi64(lo, nibble), m4),
                                           _mm512_and_si512(_mm512_rolv_epi64(H, high), m30));
        }
    }
    __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192))));
    *ws = _mm512_mul_ps(_mm512_set1_ps(f16(b + 208)), sc);
    *wm = _mm512_mul_ps(_mm512_set1_ps(-32.0f), *ws);
}

/* Eight whole Q8_0 blocks (a chunk): codes xor 0x80 (q + 128), scale d and offset -128 d per 32.
 * Blocks 4h to 4h + 3 as [0 | 2] and [1 | 3] give, 16 bytes at a time, slot order's halves. */
static inline void q8_0_regs(const uint8_t *b, __m512i u[4], __m512 *ws, __m512 *wm) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    uint16_t h[8];
    for (int k = 0; k < 8; k++) h[k] = (uint16_t)(b[34 * k] | (b[34 * k + 1] << 8));
    for (int half = 0; half < 2; half++) {
        const uint8_t *q = b + 136 * half + 2;
        __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)q)),
                                       _mm256_loadu_si256((const __m256i *)(q + 68)), 1);
        __m512i y = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(q + 34))),
                                       _mm256_loadu_si256((const __m256i *)(q + 102)), 1);
        x = _mm512_xor_si512(x, flip);
        y = _mm512_xor_si512(y, flip);
        u[2 * half] = _mm512_shuffle_i64x2(x, y, 0x88);      /* groups 0, 4, 2, 6 */
        u[2 * half + 1] = _mm512_shuffle_i64x2(x, y, 0xDD);  /* groups 1, 5, 3, 7 */
    }
    *ws = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h))));
    *wm = _mm512_mul_ps(_mm512_set1_ps(-128.0f), *ws);
}

static inline void store_regs(const __m512i v[4], __m512 s, __m512 m, uint8_t *u, float *ws, float *wm) {
    for (int i = 0; i < 4; i++) _mm512_storeu_si512((void *)(u + 64 * i), v[i]);
    _mm512_storeu_ps(ws, s);
    _mm512_storeu_ps(wm, m);
}

static inline void unpack_q4k_avx512(const uint8_t *b, uint8_t *u, float *ws, float *wm) {
    __m512i v[4];
    __m512 s, m;
    q4k_regs(b, v, &s, &m);
    store_regs(v, s, m, u, ws, wm);
}

static inline void unpack_q6k_avx512(const uint8_t *b, uint8_t *u, float *ws, float *wm) {
    __m512i v[4];
    __m512 s, m;
    q6k_regs(b, v, &s, &m);
    store_regs(v, s, m, u, ws, wm);
}

/* Eight Q8_0 blocks (a chunk) or the fewer that end a row: codes, scale and offset per 32. */
static inline void unpack_q8_0_avx512(const uint8_t *b, uint8_t *u, float *ws, float *wm, int blocks) {
    if (blocks == 8) {
        __m512i v[4];
        __m512 s, m;
        q8_0_regs(b, v, &s, &m);
        store_regs(v, s, m, u, ws, wm);
        return;
    }
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    uint16_t h[8] = {0};
    for (int i = 0; i < blocks; i++) {
        const uint8_t *q = b + 34 * i;
        _mm256_storeu_si256((__m256i *)(u + 32 * i), _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + 2)), flip));
        h[i] = (uint16_t)(q[0] | (q[1] << 8));
    }
    __m512 d = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h))));
    __mmask16 keep = (__mmask16)((1u << (2 * blocks)) - 1);
    _mm512_mask_storeu_ps(ws, keep, d);
    _mm512_mask_storeu_ps(wm, keep, _mm512_mul_ps(_mm512_set1_ps(-128.0f), d));
    to_slots(u);  /* the codes past the row's end are the zeros unpack_row wrote */
}
#endif

/* Row `row` of W, all of its chunks: u[Kp] in slot order, ws[Kp/16], wm[Kp/16] (zeros past K). The
 * switch is outside the loop over blocks, so each type's loop is compiled on its own. */
#define EACH_BLOCK(TYPE, VALUES, BYTES, CALL) \
    case TYPE:                                \
        for (int64_t i = 0; i < blocks; i++) {  \
            const uint8_t *b = row + i * (BYTES); \
            CALL;                                \
        }                                        \
        break;

static void unpack_row(int type, const uint8_t *row, int64_t K, int64_t Kp, uint8_t *u, float *ws, float *wm,
                       int simd) {
    int values, bytes = block_bytes(type, &values);
    int64_t blocks = K / values;
    (void)bytes;
    (void)simd;
    memset(u + K, 0, (size_t)(Kp - K));
    for (int64_t g = K / 16; g < Kp / 16; g++) ws[g] = wm[g] = 0.0f;
#if SMK_VNNI
    if (simd && type == T_Q4_K) {
        for (int64_t i = 0; i < blocks; i++) unpack_q4k_avx512(row + 144 * i, u + 256 * i, ws + 16 * i, wm + 16 * i);
        return;
    }
    if (simd && type == T_Q8_0) {
        for (int64_t i = 0; i < blocks; i += 8)
            unpack_q8_0_avx512(row + 34 * i, u + 32 * i, ws + 2 * i, wm + 2 * i, blocks - i < 8 ? (int)(blocks - i) : 8);
        return;
    }
    if (simd && type == T_Q6_K) {
        for (int64_t i = 0; i < blocks; i++) unpack_q6k_avx512(row + 210 * i, u + 256 * i, ws + 16 * i, wm + 16 * i);
        return;
    }
#endif
    switch (type) {
        EACH_BLOCK(T_Q8_0, 32, 34, unpack32(T_Q8_0, b, u + 32 * i, ws, wm, (int)i))
        EACH_BLOCK(T_Q4_0, 32, 18, unpack32(T_Q4_0, b, u + 32 * i, ws, wm, (int)i))
        EACH_BLOCK(T_Q4_1, 32, 20, unpack32(T_Q4_1, b, u + 32 * i, ws, wm, (int)i))
        EACH_BLOCK(T_Q5_0, 32, 22, unpack32(T_Q5_0, b, u + 32 * i, ws, wm, (int)i))
        EACH_BLOCK(T_Q5_1, 32, 24, unpack32(T_Q5_1, b, u + 32 * i, ws, wm, (int)i))
        EACH_BLOCK(T_MXFP4, 32, 17, unpack32(T_MXFP4, b, u + 32 * i, ws, wm, (int)i))
        EACH_BLOCK(T_Q2_K, 256, 84, unpack256(T_Q2_K, b, u + 256 * i, ws + 16 * i, wm + 16 * i))
        EACH_BLOCK(T_Q3_K, 256, 110, unpack256(T_Q3_K, b, u + 256 * i, ws + 16 * i, wm + 16 * i))
        EACH_BLOCK(T_Q4_K, 256, 144, unpack256(T_Q4_K, b, u + 256 * i, ws + 16 * i, wm + 16 * i))
        EACH_BLOCK(T_Q6_K, 256, 210, unpack256(T_Q6_K, b, u + 256 * i, ws + 16 * i, wm + 16 * i))
        EACH_BLOCK(T_Q5_K, 256, 176, unpack256(T_Q5_K, b, u + 256 * i, ws + 16 * i, wm + 16 * i))
    }
    for (int64_t c = 0; c < Kp / CHUNK; c++) to_slots(u + CHUNK * c);
}

/* --- activations: each row to int8 codes in blocks of 32 --------------------------------------- */

/* f rounded to the nearest float16 (ties to even) and back, as llama.cpp stores a Q8_0
 * block's scale; kept as it is past float16's range (where llama.cpp's would be infinite)
 * and below its normal range (where float16 loses precision). */
static float as_half(float f) {
    if (!(f >= 6.103515625e-05f && f <= 65504.0f)) return f;
    uint32_t bits;
    memcpy(&bits, &f, 4);
    uint32_t rest = bits & 0x1FFF, keep = bits & ~0x1FFFu;  /* 13 mantissa bits go */
    if (rest > 0x1000 || (rest == 0x1000 && (keep & 0x2000))) keep += 0x2000;
    memcpy(&f, &keep, 4);
    return f;
}

/* One row's quantized activations: codes q[Kp] in slot order, then xs16[Kp/16] and xsum16[Kp/16]. */
int64_t smk_act_bytes(int64_t K) {
    int64_t Kp = (K + CHUNK - 1) / CHUNK * CHUNK;
    return Kp + 2 * (Kp / 16) * (int64_t)sizeof(float);
}

/* Blocks of `width` values (32 or 256) of a row to int8 codes with one scale each, as
 * llama.cpp rounds activations before its products: per 32 with the scale kept in float16
 * (Q8_0, for Q8_0, Q4_0/1, Q5_0/1 and MXFP4 weights), per 256 with the scale the
 * reciprocal of 127 / max|x| (Q8_K, for the K-quants). */
static void quantize_row(const float *x, int64_t K, int64_t Kp, int width, uint8_t *out) {
    int8_t *q = (int8_t *)out;
    float *xs = (float *)(out + Kp), *xsum = xs + Kp / 16;
    for (int64_t b = 0; b < Kp / width; b++) {
        const float *v = x + b * width;
        float amax = 0.0f, d, id;
        int64_t n = b * width < K ? (K - b * width < width ? K - b * width : width) : 0;
        for (int64_t j = 0; j < n; j++) amax = fmaxf(amax, fabsf(v[j]));
        id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d = width == 32 ? as_half(amax / 127.0f) : (amax > 0.0f ? 1.0f / id : 0.0f);
        for (int64_t j = 0; j < width; j++) q[b * width + j] = j < n ? (int8_t)nearbyintf(v[j] * id) : 0;
        for (int h = 0; h < width / 16; h++) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += q[b * width + 16 * h + j];
            xs[b * width / 16 + h] = d;
            xsum[b * width / 16 + h] = d * (float)s;
        }
        if ((b + 1) * width % CHUNK == 0) to_slots((uint8_t *)q + (b + 1) * width - CHUNK);
    }
}

/* The activation blocks a weight type is multiplied with: 256 for K-quants, else 32. */
int smk_act_width(int type) {
    int values;
    return block_bytes(type, &values) && values == 256 ? 256 : 32;
}

/* --- the dot products of one weight row with every activation row -------------------------- */

static float tree16(const float *v) {
    float t8[8], t4[4];
    for (int l = 0; l < 8; l++) t8[l] = v[l] + v[l + 8];
    for (int l = 0; l < 4; l++) t4[l] = t8[l] + t8[l + 4];
    return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

static void row_dots_portable(const uint8_t *u, const float *ws, const float *wm, int64_t Kp, const uint8_t *xq,
                              int64_t act, int64_t M, int pair, float *y, int64_t ldy) {
    for (int64_t m = 0; m < M; m++) {
        const uint8_t *a = xq + m * act;
        const int8_t *q = (const int8_t *)a;
        const float *xs = (const float *)(a + Kp), *xsum = xs + Kp / 16;
        float f[4][16] = {{0}}, g[16] = {0}, v[16];
        for (int64_t c = 0; c < Kp / CHUNK; c++) {
            float s[16];
            int32_t p[4][16];
            for (int l = 0; l < 16; l++) s[l] = ws[16 * c + l] * xs[16 * c + l];
            for (int i = 0; i < 4; i++)
                for (int l = 0; l < 16; l++) {
                    int64_t at = CHUNK * c + 64 * i + 4 * l;
                    p[i][l] = 0;
                    for (int t = 0; t < 4; t++) p[i][l] += (int32_t)u[at + t] * (int32_t)q[at + t];
                }
            for (int l = 0; l < 16; l++) {
                if (pair)
                    for (int h = 0; h < 2; h++)
                        f[h][l] = fmaf((float)(p[2 * h][l] + p[2 * h + 1][l]), s[lane_group(2 * h, l)], f[h][l]);
                else
                    for (int i = 0; i < 4; i++) f[i][l] = fmaf((float)p[i][l], s[lane_group(i, l)], f[i][l]);
                g[l] = fmaf(wm[16 * c + l], xsum[16 * c + l], g[l]);
            }
        }
        for (int l = 0; l < 16; l++)
            v[l] = pair ? (f[0][l] + f[1][l]) + g[l] : ((f[0][l] + f[1][l]) + (f[2][l] + f[3][l])) + g[l];
        y[m * ldy] = tree16(v);
    }
}

#if SMK_VNNI
static float tree16_avx512(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));  /* (b0 + b2, b1 + b3) */
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

/* The lane_group of every lane of vector i. */
static inline __m512i lane_groups(int i) {
    const __m512i half0 = _mm512_set_epi32(6, 6, 6, 6, 2, 2, 2, 2, 4, 4, 4, 4, 0, 0, 0, 0);
    return _mm512_add_epi32(half0, _mm512_set1_epi32(8 * (i / 2) + i % 2));
}

/* One chunk of one activation row (codes x, s = ws * xs16 per group) into the sets f, as
 * row_dots_portable adds them: vpdpbusd's integer sums are exact, so adding vectors 2h and
 * 2h + 1 in one accumulator is the portable path's p[2h] + p[2h + 1]. */
static inline __attribute__((always_inline)) void chunk_dots(const __m512i u[4], const uint8_t *x, __m512 s,
                                                             int pair, __m512 f[4]) {
    const __m512i zero = _mm512_setzero_si512();
    if (pair) {
        for (int h = 0; h < 2; h++) {
            __m512i p = _mm512_dpbusd_epi32(zero, u[2 * h], _mm512_loadu_si512((const void *)(x + 128 * h)));
            p = _mm512_dpbusd_epi32(p, u[2 * h + 1], _mm512_loadu_si512((const void *)(x + 128 * h + 64)));
            f[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(lane_groups(2 * h), s), f[h]);
        }
        return;
    }
    for (int i = 0; i < 4; i++) {
        __m512i p = _mm512_dpbusd_epi32(zero, u[i], _mm512_loadu_si512((const void *)(x + 64 * i)));
        f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(lane_groups(i), s), f[i]);
    }
}

static inline float row_sum(const __m512 f[4], __m512 g, int pair) {
    __m512 v = pair ? _mm512_add_ps(f[0], f[1]) : _mm512_add_ps(_mm512_add_ps(f[0], f[1]), _mm512_add_ps(f[2], f[3]));
    return tree16_avx512(_mm512_add_ps(v, g));
}

static void row_dots_vnni(const uint8_t *u, const float *ws, const float *wm, int64_t Kp, const uint8_t *xq,
                          int64_t act, int64_t M, int pair, float *y, int64_t ldy) {
    for (int64_t m = 0; m < M; m++) {
        const uint8_t *a = xq + m * act;
        const float *xs = (const float *)(a + Kp), *xsum = xs + Kp / 16;
        __m512 f[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        __m512 g = _mm512_setzero_ps();
        for (int64_t c = 0; c < Kp / CHUNK; c++) {
            __m512i w[4];
            for (int i = 0; i < 4; i++) w[i] = _mm512_loadu_si512((const void *)(u + CHUNK * c + 64 * i));
            chunk_dots(w, a + CHUNK * c, _mm512_mul_ps(_mm512_loadu_ps(ws + 16 * c), _mm512_loadu_ps(xs + 16 * c)),
                       pair, f);
            g = _mm512_fmadd_ps(_mm512_loadu_ps(wm + 16 * c), _mm512_loadu_ps(xsum + 16 * c), g);
        }
        y[m * ldy] = row_sum(f, g, pair);
    }
}

/* A product of a few activation rows (FUSED_ROWS or fewer: a decode step at batch 1, an
 * expert's picks) with a weight row of whole chunks: each chunk is dotted in the registers
 * it was unpacked into, instead of unpacked into memory for every row and read back; the
 * same operations on the same values as unpack_row + row_dots_vnni, in the same order. */
#define FUSED_ROWS 4
#define ROW_DOTS_FUSED(NAME, REGS, BYTES, PAIR)                                                                  \
    static void NAME(const uint8_t *row, int64_t K, const uint8_t *xq, int64_t act, int64_t M, float *y,        \
                     int64_t ldy) {                                                                              \
        __m512 f[FUSED_ROWS][4], g[FUSED_ROWS];                                                                  \
        for (int m = 0; m < FUSED_ROWS; m++) {                                                                   \
            g[m] = _mm512_setzero_ps();                                                                          \
            for (int i = 0; i < 4; i++) f[m][i] = _mm512_setzero_ps();                                           \
        }                                                                                                        \
        for (int64_t c = 0; c < K / CHUNK; c++) {                                                                \
            __m512i u[4];                                                                                        \
            __m512 ws, wm;                                                                                       \
            REGS(row + (BYTES) * c, u, &ws, &wm);                                                                \
            for (int m = 0; m < FUSED_ROWS && m < M; m++) {                                                      \
                const uint8_t *a = xq + m * act;                                                                 \
                const float *xs = (const float *)(a + K), *xsum = xs + K / 16;                                   \
                chunk_dots(u, a + CHUNK * c, _mm512_mul_ps(ws, _mm512_loadu_ps(xs + 16 * c)), PAIR, f[m]);       \
                g[m] = _mm512_fmadd_ps(wm, _mm512_loadu_ps(xsum + 16 * c), g[m]);                                \
            }                                                                                                    \
        }                                                                                                        \
        for (int m = 0; m < FUSED_ROWS && m < M; m++) y[m * ldy] = row_sum(f[m], g[m], PAIR);                    \
    }
ROW_DOTS_FUSED(row_dots_fused_q4k, q4k_regs, 144, 1)
ROW_DOTS_FUSED(row_dots_fused_q6k, q6k_regs, 210, 0)
ROW_DOTS_FUSED(row_dots_fused_q8_0, q8_0_regs, 272, 1)

/* The fused product of this type and shape, or NULL (unpack_row + row_dots_vnni). */
typedef void (*FusedDots)(const uint8_t *, int64_t, const uint8_t *, int64_t, int64_t, float *, int64_t);
static FusedDots fused_dots(int type, int64_t K, int64_t M) {
    if (M > FUSED_ROWS || K % CHUNK) return NULL;
    return type == T_Q4_K ? row_dots_fused_q4k : type == T_Q6_K ? row_dots_fused_q6k
         : type == T_Q8_0 ? row_dots_fused_q8_0 : NULL;
}
#endif

/* --- threads: a small pool, each part a contiguous range of weight rows ----------------------- */

/* A job the threads share: N units of work (weight rows; attention rows), split into
 * contiguous ranges, each run by `range`. */
typedef struct Job {
    int type;
    const uint8_t *w;
    int64_t N, K, Kp, row_bytes, M, act, ldy;
    const uint8_t *xq;
    float *y;
    int simd;
    void (*range)(const struct Job *, int64_t n0, int64_t n1);
    const void *ctx;  /* what a range of another kind of job reads */
} Job;

/* The next weight row asked for while this one is multiplied: a product of a few activation
 * rows is over before the hardware's own prefetching has the next row in cache (measured: a
 * 2048 x 2048 Q4_K matrix at one row, 2 threads, 11-14 GB/s without, 20-23 with). */
static inline void prefetch_row(const Job *j, int64_t n, int64_t n1) {
    if (n >= n1) return;
    const char *row = (const char *)(j->w + n * j->row_bytes);
    for (int64_t o = 0; o < j->row_bytes; o += 64) PREFETCH(row + o);
}

#define ROW_BLOCK 8   /* weight rows unpacked together: 8 x 2.5 KiB at 2,048 inputs */
#define ACT_BLOCK 16  /* activation rows dotted with them at a time: 16 x 2.3 KiB */
static void run_rows(const Job *j, int64_t n0, int64_t n1) {
#if SMK_VNNI
    FusedDots fused = j->simd ? fused_dots(j->type, j->K, j->M) : NULL;
    if (fused) {
        for (int64_t n = n0; n < n1; n++) {
            prefetch_row(j, n + 1, n1);
            fused(j->w + n * j->row_bytes, j->K, j->xq, j->act, j->M, j->y + n, j->ldy);
        }
        return;
    }
#endif
    /* Past ACT_BLOCK activation rows: ROW_BLOCK weight rows unpacked at once, then
     * ACT_BLOCK activation rows at a time dotted with each of them, so that an activation
     * row is read from memory once per block of weight rows, not once per weight row (a
     * prefill's rows outgrow the caches: 1,024 rows ran 1.9x as fast). Each output is the
     * same dot whatever the blocks, so a row's bits do not depend on how many share the call. */
    int block = j->M > ACT_BLOCK ? ROW_BLOCK : 1;  /* a few rows: one weight row at a time was faster */
    size_t scratch = ((size_t)j->Kp + 2 * (size_t)(j->Kp / 16) * sizeof(float) + 63) / 64 * 64;
    uint8_t *buf = aligned_alloc(64, block * scratch);
    if (!buf) return;
    for (int64_t n = n0; n < n1; n += block) {
        int rows = n1 - n < block ? (int)(n1 - n) : block;
        for (int r = 0; r < rows; r++) {
            uint8_t *u = buf + r * scratch;
            unpack_row(j->type, j->w + (n + r) * j->row_bytes, j->K, j->Kp, u, (float *)(u + j->Kp),
                       (float *)(u + j->Kp) + j->Kp / 16, j->simd);
        }
        for (int64_t m = 0; m < j->M; m += ACT_BLOCK) {
            int64_t M = j->M - m < ACT_BLOCK ? j->M - m : ACT_BLOCK;
            for (int r = 0; r < rows; r++) {
                const uint8_t *u = buf + r * scratch, *xq = j->xq + m * j->act;
                const float *ws = (const float *)(u + j->Kp), *wm = ws + j->Kp / 16;
                float *y = j->y + m * j->ldy + n + r;
#if SMK_VNNI
                if (j->simd) {
                    row_dots_vnni(u, ws, wm, j->Kp, xq, j->act, M, paired(j->type), y, j->ldy);
                    continue;
                }
#endif
                row_dots_portable(u, ws, wm, j->Kp, xq, j->act, M, paired(j->type), y, j->ldy);
            }
        }
    }
    free(buf);
}

#define MAX_THREADS 64
static struct {
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    pthread_t th[MAX_THREADS];
    int threads, started, pending;
    long generation;
    pid_t pid;
    const Job *job;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER};
static int wanted_threads = 1;

static void part(const Job *j, int k, int parts) {
    int64_t n0 = j->N * k / parts, n1 = j->N * (k + 1) / parts;
    if (n1 > n0) j->range(j, n0, n1);
}

/* A waiting thread first spins on the counter it waits for (a product of one token's row
 * is over in a fraction of a millisecond, less than a sleeping thread takes to wake), then
 * sleeps on the condition variable. */
#define SPINS 20000

static inline void pause_cpu(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *worker(void *arg) {
    int k = (int)(intptr_t)arg;
    long seen = 0, g;
    for (;;) {
        for (int i = 0; (g = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE)) == seen && i < SPINS; i++) pause_cpu();
        if (g == seen) {
            pthread_mutex_lock(&pool.mu);
            while (pool.generation == seen) pthread_cond_wait(&pool.go, &pool.mu);
            g = pool.generation;
            pthread_mutex_unlock(&pool.mu);
        }
        seen = g;
        const Job *j = pool.job;
        int parts = pool.threads;
        if (k >= parts) continue;  /* not needed this time (a product with few rows) */
        part(j, k, parts);
        if (__atomic_sub_fetch(&pool.pending, 1, __ATOMIC_ACQ_REL) == 0) {
            pthread_mutex_lock(&pool.mu);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.mu);
        }
    }
    return NULL;
}

/* Threads the products use (the caller's thread is one of them). */
void smk_set_threads(int n) { wanted_threads = n < 1 ? 1 : (n > MAX_THREADS ? MAX_THREADS : n); }

static int start_pool(void) {
    if (pool.pid != getpid()) {  /* first use, or a forked child: its threads did not come along */
        pool.started = 0;
        pool.pid = getpid();
    }
    while (pool.started < wanted_threads - 1) {
        if (pthread_create(&pool.th[pool.started], NULL, worker, (void *)(intptr_t)(pool.started + 1))) break;
        pthread_detach(pool.th[pool.started]);
        pool.started++;
    }
    return pool.started + 1 < wanted_threads ? pool.started + 1 : wanted_threads;
}

static void run(const Job *j) {
    int64_t work = j->N * j->Kp * (j->M < 4 ? 4 : j->M);
    int parts = work < (1 << 18) ? 1 : start_pool();  /* a tiny product is not worth waking anyone */
    if (parts > j->N) parts = (int)j->N;
    if (parts <= 1) {
        part(j, 0, 1);
        return;
    }
    pool.job = j;
    pool.threads = parts;
    __atomic_store_n(&pool.pending, parts - 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&pool.mu);
    __atomic_store_n(&pool.generation, pool.generation + 1, __ATOMIC_RELEASE);  /* publishes job and parts */
    pthread_cond_broadcast(&pool.go);
    pthread_mutex_unlock(&pool.mu);
    part(j, 0, parts);
    for (int i = 0; __atomic_load_n(&pool.pending, __ATOMIC_ACQUIRE) && i < SPINS; i++) pause_cpu();
    pthread_mutex_lock(&pool.mu);
    while (__atomic_load_n(&pool.pending, __ATOMIC_ACQUIRE)) pthread_cond_wait(&pool.done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
}

/* --- the entry points ------------------------------------------------------------------------- */

/* Bytes 0..3 of x to bytes 0, 2, 4, 6. */
static inline uint64_t spread_bytes(uint64_t x) {
    x &= 0xFFFFFFFFull;
    x = (x | (x << 16)) & 0x0000FFFF0000FFFFull;
    return (x | (x << 8)) & 0x00FF00FF00FF00FFull;
}

/* A quantized checkpoint's matrix as blocks of 32 (Q8_0, Q4_0, MXFP4): block b is its `head`
 * (1 or 2) scale bytes (heads + head * b), then its codes: 8-bit ones as they are (codes +
 * 32 * b); 4-bit ones, two a byte with the even column in the low nibble (codes + 16 * b),
 * in Q4_0's order, byte j holding value j low and value j + 16 high: byte 2m takes the low
 * nibbles of bytes m and 8 + m, byte 2m + 1 their high ones, eight at a time in a word.
 * Copies bits only. */
void smk_pack_blocks(const uint8_t *codes, const uint8_t *heads, int head, int bits, int64_t blocks,
                     uint8_t *out) {
    const uint64_t low = 0x0F0F0F0F0F0F0F0Full;
    int body = bits == 8 ? 32 : 16;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *c = codes + body * b;
        uint8_t *o = out + (head + body) * b;
        o[0] = heads[head * b];
        if (head == 2) o[1] = heads[2 * b + 1];
        o += head;
        if (bits == 8) {
            memcpy(o, c, 32);
            continue;
        }
        uint64_t first, second;
        memcpy(&first, c, 8);
        memcpy(&second, c + 8, 8);
        uint64_t even = (first & low) | ((second & low) << 4), odd = ((first >> 4) & low) | (second & ~low);
        uint64_t lo = spread_bytes(even) | (spread_bytes(odd) << 8);
        uint64_t hi = spread_bytes(even >> 32) | (spread_bytes(odd >> 32) << 8);
        memcpy(o, &lo, 8);
        memcpy(o + 8, &hi, 8);
    }
}

/* x [M, K] float32 (rows ldx apart) -> M rows of smk_act_bytes(K) at xq, in blocks of `width` (32 or 256). */
void smk_quantize(const float *x, int64_t M, int64_t K, int64_t ldx, uint8_t *xq, int width) {
    int64_t Kp = (K + CHUNK - 1) / CHUNK * CHUNK, act = smk_act_bytes(K);
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * ldx, K, Kp, width == 256 ? 256 : 32, xq + m * act);
}

/* y[m, n] (rows ldy apart) = activation row m . weight row n, for W [N, K] of `type`,
 * rows row_bytes apart. simd 0 takes the portable path. Returns 0, or -1 for a type or
 * width this file does not compute. */
/* The job of xq (M activation rows of K, quantized) times W [N, K] of a block type whose
 * rows are row_bytes apart, into y (rows ldy apart). */
static Job block_job(int type, const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes, const uint8_t *xq,
                     int64_t M, float *y, int64_t ldy, int simd) {
    Job j = {type, w, N, K, (K + CHUNK - 1) / CHUNK * CHUNK, row_bytes, M, smk_act_bytes(K), ldy, xq, y,
             simd && SMK_VNNI, run_rows, NULL};
    return j;
}

int smk_matmul(int type, const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes, const uint8_t *xq, int64_t M,
               float *y, int64_t ldy, int simd) {
    int values, bytes = block_bytes(type, &values);
    if (!bytes || K % values || row_bytes < K / values * bytes) return -1;
    Job j = block_job(type, w, N, K, row_bytes, xq, M, y, ldy, simd);
    run(&j);
    return 0;
}

/* --- exact float products for the few float32 matrices left (routers) ----------------------- */

/* y[m, n] = x[m] . w[n] for float32 w [N, K] and x [M, K]: 16 lanes over K (lane l takes
 * k = l, l + 16, ...), fused multiply-adds in k order, the lanes summed as tree16. No
 * rounding of the activations; the same bits for a row whatever M is. */
#if SMK_VNNI
/* Four weight rows at once (four chains side by side), each lane's fused multiply-adds in k
 * order and the lanes added as tree16: the portable loop's operations, vectorized. */
static void f32_rows4_avx512(const float *w, int64_t K, const float *x, float *y) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t k = 0; k < K; k += 16) {
        __m512 xv = _mm512_loadu_ps(x + k);
        for (int c = 0; c < 4; c++) acc[c] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w + c * K + k), acc[c]);
    }
    for (int c = 0; c < 4; c++) y[c] = tree16_avx512(acc[c]);
}
#endif

void smk_matmul_f32(const float *w, int64_t N, int64_t K, const float *x, int64_t M, float *y, int64_t ldy,
                    int simd) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
#if SMK_VNNI
            if (simd && K % 16 == 0 && n + 4 <= N) {  /* a router of 8-256 experts: 5x the scalar loop */
                f32_rows4_avx512(w + n * K, K, x + m * K, y + m * ldy + n);
                n += 3;
                continue;
            }
#endif
            const float *a = x + m * K, *b = w + n * K;
            float lanes[16] = {0};
            for (int64_t k = 0; k < K; k += 16)
                for (int l = 0; l < 16 && k + l < K; l++) lanes[l] = fmaf(a[k + l], b[k + l], lanes[l]);
            y[m * ldy + n] = tree16(lanes);
        }
}

/* --- RMSNorm, as llama.cpp computes it ------------------------------------------------------------ */

/* y[m] = x[m] / sqrt(mean(x[m]^2) + eps) * w for x [M, K] (rows ldx apart; w NULL: no weight):
 * the squares summed in double in k order, the scale 1 / sqrtf in float, then x * scale and
 * that times w, each rounded to float (ggml_rms_norm followed by ggml_mul). One order per row
 * whatever M is; torch's own rms_norm took 25 us for a row of 2048 on the Xeon, this 1-2. */
void smk_rms_norm(const float *x, int64_t M, int64_t K, int64_t ldx, const float *w, float eps, float *y, int64_t ldy) {
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * ldx;
        float *out = y + m * ldy;
        double sum = 0.0;
        for (int64_t k = 0; k < K; k++) sum += (double)(r[k] * r[k]);
        const float scale = 1.0f / sqrtf((float)(sum / (double)K) + eps);
        for (int64_t k = 0; k < K; k++) out[k] = r[k] * scale;
        if (w)
            for (int64_t k = 0; k < K; k++) out[k] = out[k] * w[k];
    }
}

/* --- bfloat16 weights times float32 activations --------------------------------------------------- */

/* y[m, n] = x[m] . w[n] for bfloat16 w [N, K] (rows side by side) and float32 x [M, K]: each
 * weight widened exactly to float32 (its 16 bits above 16 zero bits), the products summed as
 * smk_matmul_f32 sums them (16 lanes over K, fused multiply-adds in k order, a fixed tree):
 * the float32 reference's products, in one order per output whatever M is. The activations
 * are not rounded. AVX-512 takes rows of whole vectors (K % 16 == 0), the same operations. */
typedef struct {
    const uint16_t *w;
    const float *x;
    int64_t K, M, ldx, ldy;  /* activation rows ldx apart, output rows ldy apart */
    float *y;
    int simd;
} Bf16;

static inline float bf16_value(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#if SMK_VNNI
/* A tile of up to 4 activation rows x 4 weight rows (R x C): R x C chains of fused
 * multiply-adds side by side, each weight vector widened once and each activation vector
 * loaded once for the tile; an output's chain is its own, in k order, whatever the tile. */
static inline __attribute__((always_inline)) void bf16_tile_avx512(const uint16_t *w, const float *x, int64_t K,
                                                                  int64_t ldx, int R, int C, float *y, int64_t ldy) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 wv[4], xv[4];
        if ((k & 31) == 0)  /* 512 bytes ahead in each weight row: 10 % faster at one row */
            for (int c = 0; c < 4; c++)
                if (c < C) PREFETCH((const char *)(w + c * K + k) + 512);
        for (int c = 0; c < 4; c++)
            if (c < C) {
                __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + c * K + k)));
                wv[c] = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
            }
        for (int r = 0; r < 4; r++)
            if (r < R) xv[r] = _mm512_loadu_ps(x + r * ldx + k);
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < 4; c++)
                if (r < R && c < C) acc[r][c] = _mm512_fmadd_ps(xv[r], wv[c], acc[r][c]);
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++)
            if (r < R && c < C) y[r * ldy + c] = tree16_avx512(acc[r][c]);
}
#endif

#if SMK_VNNI
/* The tiles with their shapes as constants (so that the accumulators stay in registers):
 * 4 x 4 where both are whole, 1 x 4 for a single activation row, else one weight row at a time
 * against up to 4 activation rows. */
static void bf16_tile_4x4(const uint16_t *w, const float *x, int64_t K, int64_t ldx, float *y, int64_t ldy) {
    bf16_tile_avx512(w, x, K, ldx, 4, 4, y, ldy);
}

static void bf16_tile_1x4(const uint16_t *w, const float *x, int64_t K, float *y, int64_t ldy) {
    bf16_tile_avx512(w, x, K, K, 1, 4, y, ldy);
}

static void bf16_tile_rx1(const uint16_t *w, const float *x, int64_t K, int64_t ldx, int R, float *y, int64_t ldy) {
    switch (R) {
        case 1: bf16_tile_avx512(w, x, K, ldx, 1, 1, y, ldy); break;
        case 2: bf16_tile_avx512(w, x, K, ldx, 2, 1, y, ldy); break;
        case 3: bf16_tile_avx512(w, x, K, ldx, 3, 1, y, ldy); break;
        default: bf16_tile_avx512(w, x, K, ldx, 4, 1, y, ldy); break;
    }
}
#endif

#define BF16_BLOCK_ROWS 32  /* 32 rows of 2,048 weights: 128 KiB, in a core's L2 */

static void bf16_rows(const Job *j, int64_t n0, int64_t n1) {
    const Bf16 *a = j->ctx;
    int64_t K = a->K, M = a->M, ldy = a->ldy;
#if SMK_VNNI
    if (a->simd) {  /* weight rows in blocks that stay in cache while every activation row passes */
        for (int64_t b0 = n0; b0 < n1; b0 += BF16_BLOCK_ROWS) {
            int64_t b1 = b0 + BF16_BLOCK_ROWS < n1 ? b0 + BF16_BLOCK_ROWS : n1;
            for (int64_t m = 0; m < M; m += 4) {
                int R = M - m < 4 ? (int)(M - m) : 4;
                const float *x = a->x + m * a->ldx;
                float *y = a->y + m * ldy;
                int64_t n = b0;
                if (R == 4)
                    for (; n + 4 <= b1; n += 4) bf16_tile_4x4(a->w + n * K, x, K, a->ldx, y + n, ldy);
                if (R == 1)  /* four chains side by side: one alone waits on each multiply-add */
                    for (; n + 4 <= b1; n += 4) bf16_tile_1x4(a->w + n * K, x, K, y + n, ldy);
                for (; n < b1; n++) bf16_tile_rx1(a->w + n * K, x, K, a->ldx, R, y + n, ldy);
            }
        }
        return;
    }
#endif
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *w = a->w + n * K;
        for (int64_t m = 0; m < M; m++) {
            const float *x = a->x + m * a->ldx;
            float lanes[16] = {0};
            for (int64_t k = 0; k < K; k += 16)
                for (int l = 0; l < 16 && k + l < K; l++) lanes[l] = fmaf(x[k + l], bf16_value(w[k + l]), lanes[l]);
            a->y[m * ldy + n] = tree16(lanes);
        }
    }
}

/* The job of x (M rows of K floats, ldx apart) times bfloat16 W [N, K] into y (rows ldy
 * apart); `a` holds what its rows read and must outlive the job. */
static Job bf16_job(Bf16 *a, const uint16_t *w, int64_t N, int64_t K, const float *x, int64_t ldx, int64_t M,
                    float *y, int64_t ldy, int simd) {
    *a = (Bf16){w, x, K, M, ldx, ldy, y, simd && SMK_VNNI && K % 16 == 0};
    Job j = {0};
    j.N = N;
    j.Kp = K;  /* the work per unit, for run's small-job rule */
    j.M = M;
    j.range = bf16_rows;
    j.ctx = a;
    return j;
}

void smk_matmul_bf16(const uint16_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y, int64_t ldy,
                     int simd) {
    Bf16 a;
    Job j = bf16_job(&a, w, N, K, x, K, M, y, ldy, simd);
    run(&j);
}

/* Several products as one job for the threads: segment s is rows [start[s], start[s + 1])
 * of the whole, each its own product (a Job as smk_matmul or smk_matmul_bf16 runs it); a
 * part of the whole runs the pieces of the segments it covers, so a row is computed as its
 * own product computes it. */
#define MAX_SEGMENTS 32
typedef struct {
    int n;
    Job seg[MAX_SEGMENTS];
    Bf16 bf[MAX_SEGMENTS];  /* what a bfloat16 segment reads */
    int64_t start[MAX_SEGMENTS + 1];
} Segments;

/* An input of several products: float rows ldx apart and, made when a product first asks
 * for them, their 8-bit blocks of 256 (q[0]) and of 32 (q[1]), each M * smk_act_bytes(K). */
typedef struct {
    const float *x;
    int64_t M, K, ldx;
    uint8_t *q[2];
    int made[2];
} Input;

/* Whether this file multiplies weights of `type` with K inputs. */
static int takes(int type, int64_t K) {
    int values;
    return type == T_BF16 || (block_bytes(type, &values) && K % values == 0);
}

/* The product in->x W^T for W [N, K] of `type` as the next segment, into y (rows ldy apart). */
static void add_product(Segments *s, Input *in, int type, const uint8_t *w, int64_t N, float *y, int64_t ldy,
                        int simd) {
    if (type == T_BF16) {
        s->seg[s->n] = bf16_job(&s->bf[s->n], (const uint16_t *)w, N, in->K, in->x, in->ldx, in->M, y, ldy, simd);
    } else {
        int values, bytes = block_bytes(type, &values), q = smk_act_width(type) == 256 ? 0 : 1;
        if (!in->made[q]) smk_quantize(in->x, in->M, in->K, in->ldx, in->q[q], q ? 32 : 256);
        in->made[q] = 1;
        s->seg[s->n] = block_job(type, w, N, in->K, in->K / values * bytes, in->q[q], in->M, y, ldy, simd);
    }
    s->start[s->n + 1] = s->start[s->n] + N;
    s->n++;
}

static void segment_rows(const Job *j, int64_t n0, int64_t n1) {
    const Segments *s = j->ctx;
    for (int i = 0; i < s->n; i++) {
        int64_t a = s->start[i] > n0 ? s->start[i] : n0, b = s->start[i + 1] < n1 ? s->start[i + 1] : n1;
        if (a < b) s->seg[i].range(&s->seg[i], a - s->start[i], b - s->start[i]);
    }
}

static void run_segments(const Segments *s, int64_t K, int64_t M) {
    Job whole = {0};
    whole.N = s->start[s->n];
    whole.K = K;
    whole.Kp = (K + CHUNK - 1) / CHUNK * CHUNK;
    whole.M = M;
    whole.range = segment_rows;
    whole.ctx = s;
    run(&whole);
}

/* The gated activation in place over the gate half of each row of h [M, 2I]:
 * silu(g) * u with silu(g) = g / (1 + exp(-g)) in float. */
static void silu_gate(float *h, int64_t M, int64_t I) {
    for (int64_t m = 0; m < M; m++) {
        float *r = h + m * 2 * I;
        for (int64_t i = 0; i < I; i++) r[i] = r[i] / (1.0f + expf(-r[i])) * r[I + i];
    }
}

/* Gated SiLU experts on the same rows: y [M, D] = sum over k < n of weights[k] * expert k on
 * x [M, D], added in the order given, ((w0 e0 + w1 e1) + w2 e2) ..., each product and sum
 * rounded to float as torch rounds `y * w` and then `out + y` (n = 1 with weight 1: one
 * expert, exactly). Expert k is down(silu(gate x) * (up x)) with gate and up [I, D] and down
 * [D, I] at mats[3k .. 3k + 2], of types types[3k .. 3k + 2] (block types: x and the
 * activation rounded to their 8-bit blocks, as smk_matmul takes them; BF16: unrounded, as
 * smk_matmul_bf16). So expert k's output has the same bits alone or beside others; all the
 * experts' gate and up rows are one job for the threads, then all their down rows another.
 * Returns -1, computing nothing, for a type or shape this file does not take. scratch:
 * smk_experts_scratch(n, M, D, I) bytes. */
int64_t smk_experts_scratch(int n, int64_t M, int64_t D, int64_t I) {
    return 2 * M * smk_act_bytes(D) + n * M * (2 * smk_act_bytes(I) + (2 * I + D) * (int64_t)sizeof(float));
}

int smk_experts(int n, const int *types, const uint8_t *const *mats, const float *weights, int64_t D, int64_t I,
                const float *x, int64_t M, float *y, uint8_t *scratch, int simd) {
    if (n < 1 || 2 * n > MAX_SEGMENTS) return -1;
    for (int k = 0; k < 3 * n; k++)
        if (!takes(types[k], k % 3 == 2 ? I : D)) return -1;
    Input in = {x, M, D, D, {scratch, scratch + M * smk_act_bytes(D)}, {0, 0}};
    float *h = (float *)(scratch + 2 * M * smk_act_bytes(D)), *ys = h + n * M * 2 * I;
    uint8_t *hq = (uint8_t *)(ys + n * M * D);
    Segments *s = malloc(sizeof(Segments));
    if (!s) return -1;
    s->n = 0;
    s->start[0] = 0;
    for (int k = 0; k < n; k++) {  /* gate rows into each h row's first half, up rows into its second */
        add_product(s, &in, types[3 * k], mats[3 * k], I, h + k * M * 2 * I, 2 * I, simd);
        add_product(s, &in, types[3 * k + 1], mats[3 * k + 1], I, h + k * M * 2 * I + I, 2 * I, simd);
    }
    run_segments(s, D, M);
    Input act[MAX_SEGMENTS / 2];
    s->n = 0;
    for (int k = 0; k < n; k++) {
        uint8_t *q = hq + k * 2 * M * smk_act_bytes(I);
        silu_gate(h + k * M * 2 * I, M, I);
        act[k] = (Input){h + k * M * 2 * I, M, I, 2 * I, {q, q + M * smk_act_bytes(I)}, {0, 0}};
        add_product(s, &act[k], types[3 * k + 2], mats[3 * k + 2], D, ys + k * M * D, D, simd);
    }
    run_segments(s, I, M);
    free(s);
    for (int64_t i = 0; i < M * D; i++) {
        float acc = ys[i] * weights[0];
        for (int k = 1; k < n; k++) acc = acc + ys[k * M * D + i] * weights[k];
        y[i] = acc;
    }
    return 0;
}

/* y [M, rows] (rows ldy apart) = x W^T for float32 x [M, K] (rows side by side) and W stored as
 * n parts one under another, part p being rows[p] rows of type types[p] at w[p]: a fused
 * q/k/v matrix of a Q4_K_M file (Q4_K q and k rows, Q6_K v rows), a bfloat16 matrix (one
 * BF16 part). Each part's rows are computed as smk_matmul (x rounded once per activation
 * width for all parts) or smk_matmul_bf16 computes them; all parts are one job for the
 * threads. Returns -1, computing nothing, for a type or width this file does not take.
 * scratch: 2 * M * smk_act_bytes(K). */
int smk_linear(int n, const int *types, const uint8_t *const *w, const int64_t *rows, int64_t K, const float *x,
               int64_t M, float *y, int64_t ldy, uint8_t *scratch, int simd) {
    if (n < 1 || n > MAX_SEGMENTS) return -1;
    for (int p = 0; p < n; p++)
        if (!takes(types[p], K)) return -1;
    Input in = {x, M, K, K, {scratch, scratch + M * smk_act_bytes(K)}, {0, 0}};
    Segments *s = malloc(sizeof(Segments));
    if (!s) return -1;
    s->n = 0;
    s->start[0] = 0;
    float *at = y;
    for (int p = 0; p < n; at += rows[p], p++) add_product(s, &in, types[p], w[p], rows[p], at, ldy, simd);
    run_segments(s, K, M);
    free(s);
    return 0;
}

/* --- attention with one order of additions per query row --------------------------------------- */

/* out[b, g, i] = softmax(q[b, g, i] . keys[b, g, j] * scale over the keys j that mask[b, i, j]
 * lets it see) . values[b, g, j]: for each query row, the scores in key order, their maximum,
 * exp(score - max) summed in key order, and each output element summed in key order, so a
 * row gives the same bits however many rows (tokens, sequences) share the call.
 * q [B, G, R, d], out [B, G, R, dv] contiguous; keys [B, G, L, d] and values [B, G, L, dv] with
 * rows of d (dv) floats side by side and any stride between heads and between sequences (the
 * KV cache's rows up to L, read where they are); mask [B, R or 1, L] (1: visible); scratch: L
 * floats. A score is eight running sums over d, added as a fixed tree; the exponential is
 * this file's own (exp_fixed), so that the AVX-512 path and the portable one, written with the
 * same fused multiply-adds in the same order, give the same bits. */
static float dot8(const float *q, const float *k, int64_t d, int simd) {
#if SMK_VNNI
    if (simd && d % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t t = 0; t < d; t += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + t), _mm256_loadu_ps(k + t), acc);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));  /* p_l + p_l+4 */
        __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));                                       /* (s0 + s2, s1 + s3) */
        return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
    }
#endif
    (void)simd;
    float part[8] = {0};
    int64_t t = 0;
    for (; t + 8 <= d; t += 8)
        for (int l = 0; l < 8; l++) part[l] = fmaf(q[t + l], k[t + l], part[l]);
    for (int l = 0; t + l < d; l++) part[l] = fmaf(q[t + l], k[t + l], part[l]);
    return ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
}

/* e^x for x <= 0 within 2 ulp, 0 below -87 (where float's normal range ends): x = n ln 2 + r,
 * e^r by its Taylor series to r^6 in fused multiply-adds, times 2^n built from its bits. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
static const float EXP_TAYLOR[7] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

static inline float exp_fixed(float x) {
    if (!(x >= -87.0f)) return 0.0f;
    float n = nearbyintf(x * EXP_LOG2E);
    float r = fmaf(n, -EXP_LN2_LO, fmaf(n, -EXP_LN2_HI, x));
    float p = EXP_TAYLOR[0];
    for (int i = 1; i < 7; i++) p = fmaf(p, r, EXP_TAYLOR[i]);
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return p * two_n;
}

#if SMK_VNNI
static inline __m512 exp_fixed16(__m512 x) {
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-EXP_LN2_LO), _mm512_fmadd_ps(n, _mm512_set1_ps(-EXP_LN2_HI), x));
    __m512 p = _mm512_set1_ps(EXP_TAYLOR[0]);
    for (int i = 1; i < 7; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_TAYLOR[i]));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(e));
}
#endif

/* score[j] = exp(score[j] - top) for the visible keys, 0 for the others. */
static void softmax_weights(float *score, const uint8_t *visible, int64_t L, float top, int simd) {
    int64_t j = 0;
#if SMK_VNNI
    if (simd)
        for (; j + 16 <= L; j += 16) {
            __mmask16 seen = _mm_cmpneq_epi8_mask(_mm_loadu_si128((const __m128i *)(visible + j)), _mm_setzero_si128());
            __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(seen, score + j), _mm512_set1_ps(top));
            _mm512_storeu_ps(score + j, _mm512_maskz_mov_ps(seen, exp_fixed16(x)));
        }
#endif
    (void)simd;
    for (; j < L; j++) score[j] = visible[j] ? exp_fixed(score[j] - top) : 0.0f;
}

/* out[e] = fma(p, v[e], out[e]) over the row. */
static inline void add_scaled(float *out, float p, const float *v, int64_t dv, int simd) {
    int64_t e = 0;
#if SMK_VNNI
    if (simd)
        for (; e + 16 <= dv; e += 16)
            _mm512_storeu_ps(out + e, _mm512_fmadd_ps(_mm512_set1_ps(p), _mm512_loadu_ps(v + e), _mm512_loadu_ps(out + e)));
#endif
    (void)simd;
    for (; e < dv; e++) out[e] = fmaf(p, v[e], out[e]);
}

#if SMK_VNNI
/* add_scaled over every visible key, the row's sums kept in registers (dv up to 16 x
 * VALUE_VECTORS): the same fused multiply-adds in the same order, without a store and a
 * load of the row per key. */
#define VALUE_VECTORS 8
static void weighted_values(float *out, const float *p, const uint8_t *visible, const float *values, int64_t L,
                            int64_t dv) {
    __m512 acc[VALUE_VECTORS];
    int n = (int)(dv / 16);
    for (int i = 0; i < VALUE_VECTORS; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < L; j++) {
        if (!visible[j]) continue;
        __m512 w = _mm512_set1_ps(p[j]);
        const float *v = values + j * dv;
        for (int i = 0; i < VALUE_VECTORS; i++)
            if (i < n) acc[i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16 * i), acc[i]);
    }
    for (int i = 0; i < VALUE_VECTORS; i++)
        if (i < n) _mm512_storeu_ps(out + 16 * i, acc[i]);
}
#endif

static void attend_row(const float *q, const float *keys, const float *values, const uint8_t *visible, int64_t L,
                       int64_t d, int64_t dv, float scale, float *out, float *score, int simd) {
    float top = -INFINITY, total = 0.0f;
    for (int64_t j = 0; j < L; j++) {
        if (!visible[j]) continue;
        score[j] = dot8(q, keys + j * d, d, simd) * scale;
        top = fmaxf(top, score[j]);
    }
    softmax_weights(score, visible, L, top, simd);
    for (int64_t j = 0; j < L; j++) total += score[j];  /* (adding an unseen key's 0 changes nothing) */
    for (int64_t e = 0; e < dv; e++) out[e] = 0.0f;
#if SMK_VNNI
    if (simd && dv % 16 == 0 && dv <= 16 * VALUE_VECTORS) {
        weighted_values(out, score, visible, values, L, dv);
        for (int64_t e = 0; e < dv; e++) out[e] = total > 0.0f ? out[e] / total : 0.0f;
        return;
    }
#endif
    for (int64_t j = 0; j < L; j++)
        if (visible[j]) add_scaled(out, score[j], values + j * dv, dv, simd);  /* an unseen value may be anything */
    for (int64_t e = 0; e < dv; e++) out[e] = total > 0.0f ? out[e] / total : 0.0f;
}

typedef struct {
    const float *q, *keys, *values;
    const uint8_t *mask;
    int64_t G, R, L, d, dv;
    int64_t k_seq, k_head, v_seq, v_head;  /* strides in floats */
    int mask_rows, simd;
    float scale;
    float *out;
} Attend;

static void attend_rows(const Job *j, int64_t t0, int64_t t1) {  /* t: (b, g, i) flattened */
    const Attend *a = j->ctx;
    float *score = malloc((size_t)(a->L > 0 ? a->L : 1) * sizeof(float));
    if (!score) return;
    for (int64_t t = t0; t < t1; t++) {
        int64_t bg = t / a->R, i = t % a->R, b = bg / a->G, g = bg % a->G;
        const uint8_t *visible = a->mask + (b * a->mask_rows + (a->mask_rows > 1 ? i : 0)) * a->L;
        attend_row(a->q + t * a->d, a->keys + b * a->k_seq + g * a->k_head, a->values + b * a->v_seq + g * a->v_head,
                   visible, a->L, a->d, a->dv, a->scale, a->out + t * a->dv, score, a->simd);
    }
    free(score);
}

void smk_attend(const float *q, const float *keys, const float *values, const uint8_t *mask, int64_t B, int64_t G,
                int64_t R, int64_t L, int64_t d, int64_t dv, int mask_rows, float scale, float *out,
                int64_t k_seq, int64_t k_head, int64_t v_seq, int64_t v_head, int simd) {
    Attend a = {q, keys, values, mask, G, R, L, d, dv, k_seq, k_head, v_seq, v_head, mask_rows, simd && SMK_VNNI, scale, out};
    Job j = {0};
    j.N = B * G * R;
    j.Kp = L * (d + dv);  /* the work per unit, for run's small-job rule */
    j.M = 1;
    j.range = attend_rows;
    j.ctx = &a;
    run(&j);
}
