/* What the CPU kernels share: the fnebm.random stream (Philox4x32-10, fold_in, split, the
 * uniform and Box-Muller conversions) and Cephes' float log/exp/sin/cos written so that GCC
 * vectorises them; the energy families (FNEBM_SEPARABLE). Included by _cpu_chain.c and _cpu_nuts.c. */
#ifndef FNEBM_CPU_COMMON_H
#define FNEBM_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CB 16 /* chains per block: one AVX-512 register of float32 */


#define ROUND_A 0xD2511F53u
#define ROUND_B 0xCD9E8D57u
#define KEY_A 0x9E3779B9u
#define KEY_B 0xBB67AE85u
#define FOLD_TAG 0x666F6C64u
#define SPLIT_TAG 0x73706C74u
#define FLT_BIG 3.402823466e38f
#define UNIFORM_SCALE 4.6566127342e-10f
#define NORMAL_FLOOR 1.0e-7f
#define TWO_PI 6.283185307179586f


/* one Philox4x32 round; the key words advance after it */
#define PHILOX_ROUND(c0, c1, c2, c3, k0, k1)                           \
    do {                                                               \
        uint64_t _p0 = (uint64_t)(c0) * ROUND_A;                       \
        uint64_t _p1 = (uint64_t)(c2) * ROUND_B;                       \
        uint32_t _n0 = (uint32_t)(_p1 >> 32) ^ (c1) ^ (k0);            \
        uint32_t _n2 = (uint32_t)(_p0 >> 32) ^ (c3) ^ (k1);            \
        (c1) = (uint32_t)_p1;                                          \
        (c3) = (uint32_t)_p0;                                          \
        (c0) = _n0;                                                    \
        (c2) = _n2;                                                    \
        (k0) += KEY_A;                                                 \
        (k1) += KEY_B;                                                 \
    } while (0)
#define PHILOX_2(c0, c1, c2, c3, k0, k1) \
    PHILOX_ROUND(c0, c1, c2, c3, k0, k1); PHILOX_ROUND(c0, c1, c2, c3, k0, k1)
/* Philox4x32-10 on the counter (c0, c1, c2, c3) under the key (k0, k1), in place (fnebm.random.philox4x32) */
#define PHILOX(c0, c1, c2, c3, k0, k1)                                                                       \
    do {                                                                                                     \
        uint32_t _k0 = (k0), _k1 = (k1);                                                                     \
        PHILOX_2(c0, c1, c2, c3, _k0, _k1); PHILOX_2(c0, c1, c2, c3, _k0, _k1);                              \
        PHILOX_2(c0, c1, c2, c3, _k0, _k1); PHILOX_2(c0, c1, c2, c3, _k0, _k1);                              \
        PHILOX_2(c0, c1, c2, c3, _k0, _k1);                                                                  \
    } while (0)

/* Philox4x32-10 on CB lanes of words in place: w[0..3][i] is lane i's counter in, its block out;
 * k0[i], k1[i] its key. The same words as PHILOX lane by lane. On AVX2 (without AVX-512, where GCC's
 * own vectorisation of PHILOX already uses 64-bit lanes in 512-bit registers), eight lanes a register
 * with the 32 x 32 -> 64-bit products of even and odd lanes (vpmuludq) taken apart by blends: GCC
 * vectorises PHILOX in four 64-bit lanes, about twice as slow (10,000 fold_ins: 92 us against 41). */
#if defined(__AVX2__) && !defined(__AVX512F__) && (CB % 8 == 0)
#include <immintrin.h>
#define FNEBM_PHILOX_AVX2 1
static inline __attribute__((always_inline)) void philox_mul8(__m256i a, __m256i m, __m256i *lo, __m256i *hi) {
    __m256i even = _mm256_mul_epu32(a, m);                        /* lanes 0, 2, 4, 6 as 64-bit products */
    __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m); /* lanes 1, 3, 5, 7 */
    *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}
static inline __attribute__((always_inline)) void philox8(__m256i *c0, __m256i *c1, __m256i *c2, __m256i *c3,
                                                          __m256i k0, __m256i k1) {
    const __m256i ra = _mm256_set1_epi32((int)ROUND_A), rb = _mm256_set1_epi32((int)ROUND_B);
    const __m256i ka = _mm256_set1_epi32((int)KEY_A), kb = _mm256_set1_epi32((int)KEY_B);
    for (int r = 0; r < 10; r++) {
        __m256i lo0, hi0, lo1, hi1;
        philox_mul8(*c0, ra, &lo0, &hi0);
        philox_mul8(*c2, rb, &lo1, &hi1);
        const __m256i n0 = _mm256_xor_si256(_mm256_xor_si256(hi1, *c1), k0);
        const __m256i n2 = _mm256_xor_si256(_mm256_xor_si256(hi0, *c3), k1);
        *c1 = lo1;
        *c3 = lo0;
        *c0 = n0;
        *c2 = n2;
        k0 = _mm256_add_epi32(k0, ka);
        k1 = _mm256_add_epi32(k1, kb);
    }
}
#endif

static inline __attribute__((always_inline)) void philox_lanes(uint32_t w[4][CB], const uint32_t k0[CB],
                                                               const uint32_t k1[CB]) {
#ifdef FNEBM_PHILOX_AVX2
    for (int i = 0; i < CB; i += 8) {
        __m256i c0 = _mm256_loadu_si256((const __m256i *)(w[0] + i)), c1 = _mm256_loadu_si256((const __m256i *)(w[1] + i));
        __m256i c2 = _mm256_loadu_si256((const __m256i *)(w[2] + i)), c3 = _mm256_loadu_si256((const __m256i *)(w[3] + i));
        philox8(&c0, &c1, &c2, &c3, _mm256_loadu_si256((const __m256i *)(k0 + i)),
                _mm256_loadu_si256((const __m256i *)(k1 + i)));
        _mm256_storeu_si256((__m256i *)(w[0] + i), c0);
        _mm256_storeu_si256((__m256i *)(w[1] + i), c1);
        _mm256_storeu_si256((__m256i *)(w[2] + i), c2);
        _mm256_storeu_si256((__m256i *)(w[3] + i), c3);
    }
#else
#pragma omp simd
    for (int i = 0; i < CB; i++)
        PHILOX(w[0][i], w[1][i], w[2][i], w[3][i], k0[i], k1[i]);
#endif
}

static inline uint32_t as_u32(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float as_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* max(u, 1e-7) as a bit mask: GCC 12 does not vectorise fmaxf or a float select here */
static inline float floor_unit(float u) {
    uint32_t below = 0u - (uint32_t)(u < NORMAL_FLOOR);
    return as_f32((as_u32(u) & ~below) | (as_u32(NORMAL_FLOOR) & below));
}

static inline float to_unit(uint32_t w) {
    /* Triton's uint_to_uniform_float: the word as int32, negative x -> -x - 1 (= x ^ -1), times 2**-31 */
    int32_t x = (int32_t)w;
    x ^= x >> 31;
    return (float)x * UNIFORM_SCALE;
}

/* log(x) for finite x > 0 (normal): Cephes' logf (about 1 ulp), branch-free so that it
 * vectorises across a block of chains. */
static inline float vlogf(float x) {
    uint32_t u = as_u32(x);
    int32_t ex = (int32_t)((u >> 23) & 0xffu) - 126;
    float m = as_f32((u & 0x807fffffu) | 0x3f000000u); /* mantissa in [0.5, 1) */
    int32_t small = m < 0.707106781186547524f; /* then use 2m - 1 and the exponent less one */
    float e = (float)(ex - small);
    m = m + m * (float)small - 1.0f; /* exact: m * 1 or m * 0 */
    float z = m * m;
    float y = 7.0376836292e-2f;
    y = y * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z;
    y += -2.12194440e-4f * e;
    y += -0.5f * z;
    return m + y + 0.693359375f * e;
}

/* exp(x) for x <= 0 (-inf included, giving 0): Cephes' expf (about 1 ulp), branch-free.
 * MALA's acceptance rate exp(min(log alpha, 0)). */
static inline float vexpf(float x) {
    float xc = fmaxf(x, -87.0f); /* below this the result is 0 (set at the end) */
    float n = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    y = as_f32(as_u32(y) + ((uint32_t)((int32_t)n) << 23)); /* times 2**n */
    uint32_t zero = 0u - (uint32_t)(x < -87.0f);
    return as_f32(as_u32(y) & ~zero);
}

/* sin and cos of 0 <= x < 8192: Cephes' sinf/cosf (Cody-Waite reduction by pi/4, octant
 * polynomials), with the octant's swap and signs as bit masks so that it vectorises. */
#define VSINCOSF(x, s_out, c_out)                                                                           \
    do {                                                                                                    \
        int32_t _j = (int32_t)((x) * 1.27323954473516f); /* 4 / pi */                                       \
        _j = (_j + 1) & ~1;                                                                                 \
        float _y = (float)_j;                                                                               \
        float _r = (((x) - _y * 0.78515625f) - _y * 2.4187564849853515625e-4f) - _y * 3.77489497744594108e-8f; \
        float _z = _r * _r;                                                                                 \
        uint32_t _ps = as_u32(((-1.9515295891e-4f * _z + 8.3321608736e-3f) * _z - 1.6666654611e-1f) * _z * _r + _r); \
        uint32_t _pc = as_u32(((2.443315711809948e-5f * _z - 1.388731625493765e-3f) * _z + 4.166664568298827e-2f) \
                              * _z * _z - 0.5f * _z + 1.0f);                                                \
        uint32_t _q = (uint32_t)(_j >> 1);                      /* quadrant, mod 4 below */                 \
        uint32_t _swap = 0u - (_q & 1u);                        /* odd quadrants swap sin and cos */        \
        uint32_t _sv = (_ps & ~_swap) | (_pc & _swap);                                                      \
        uint32_t _cv = (_pc & ~_swap) | (_ps & _swap);                                                      \
        _sv ^= (_q & 2u) << 30;                                 /* quadrants 2, 3: -sin */                  \
        _cv ^= ((_q + 1u) & 2u) << 30;                          /* quadrants 1, 2: -cos */                  \
        (s_out) = as_f32(_sv);                                                                              \
        (c_out) = as_f32(_cv);                                                                              \
    } while (0)


/* The separable families, each once: X(NAME, id, term, total). `term` sets *q, element p's summand
 * of the energy, and *n, the gradient there, from the element's parameters va, vb, vc (a scalar
 * family's pa, pb, pb; the diagonal Gaussian's mean, precision and its square root at the element);
 * `total` is the energy from the summands' sum acc, pa and d. The ids, names and parameter packing
 * are fnebm/kernels/families.py's (tests/test_kernel_families.py checks them against this list);
 * the enum, separable_term, separable_energy and both kernels' dispatch are made from it. A term
 * has no comma outside parentheses (it is a macro argument). */
#define FNEBM_SEPARABLE(X)                                                                                  \
    /* h (x^2 - b^2)^2 summed; grad 4 h x (x^2 - b^2) */                                                    \
    X(DOUBLE_WELL, 0, {                                                                                     \
        float r = p * p - vb * vb;                                                                          \
        *q = r * r;                                                                                         \
        *n = 4.0f * va * p * r;                                                                             \
    }, pa * acc)                                                                                            \
    /* 0.5 k |x|^2; grad k x */                                                                             \
    X(HARMONIC, 1, {                                                                                        \
        *q = p * p;                                                                                         \
        *n = va * p;                                                                                        \
    }, 0.5f * pa * acc)                                                                                     \
    /* diagonal: 0.5 |(x - mean) sqrt(P)|^2; grad (x - mean) P */                                           \
    X(GAUSSIAN, 2, {                                                                                        \
        float delta = p - va;                                                                               \
        float y = delta * vc;                                                                               \
        *q = y * y;                                                                                         \
        *n = delta * vb;                                                                                    \
    }, 0.5f * acc)                                                                                          \
    /* a d + sum(x^2 - a cos(2 pi x)); grad 2 x + 2 pi a sin(2 pi x). cos and sin have period 1 in x:       \
     * reduce first, exactly for x >= 0; a p that is not finite gives u = 0, not a NaN cast to int */      \
    X(RASTRIGIN, 3, {                                                                                       \
        float u = p - floorf(p);                                                                            \
        uint32_t nan = 0u - (uint32_t)!(fabsf(u) <= 1.0f);                                                  \
        u = as_f32(as_u32(u) & ~nan);                                                                       \
        float sv;                                                                                           \
        float cv;                                                                                           \
        VSINCOSF(TWO_PI * u, sv, cv);                                                                       \
        *q = p * p - va * cv;                                                                               \
        *n = 2.0f * p + TWO_PI * va * sv;                                                                   \
    }, pa * (float)d + acc)

/* the families' numbers: the separable ones, then GAUSSIAN_FULL, a Gaussian with a full factor L of
 * its precision (vectors: mean, then L row-major; its code is in each kernel) */
#define FNEBM_ENUM(NAME, ID, TERM, TOTAL) NAME = ID,
enum { FNEBM_SEPARABLE(FNEBM_ENUM) GAUSSIAN_FULL = 4 };
#undef FNEBM_ENUM

/* The term of a separable family at one element p (FNEBM_SEPARABLE). Inlined with a constant
 * family, so the loops around it vectorise. */
static inline __attribute__((always_inline)) void separable_term(const int family, float p, float va, float vb,
                                                                 float vc, float *q, float *n) {
#define FNEBM_TERM(NAME, ID, TERM, TOTAL) if (family == NAME) TERM else
    FNEBM_SEPARABLE(FNEBM_TERM) {
        *q = 0.0f; /* not a separable family: not called */
        *n = 0.0f;
    }
#undef FNEBM_TERM
}

/* The energy from the sum of the terms (pa: scalars[0]); GAUSSIAN_FULL's acc is |L^T (x - mean)|^2 */
static inline __attribute__((always_inline)) float separable_energy(const int family, float acc, float pa,
                                                                    int64_t d) {
#define FNEBM_TOTAL(NAME, ID, TERM, TOTAL) family == NAME ? (TOTAL) :
    return FNEBM_SEPARABLE(FNEBM_TOTAL) 0.5f * acc;
#undef FNEBM_TOTAL
}

#endif
