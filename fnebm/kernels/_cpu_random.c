/* fnebm.random's eager draws on the CPU, one pass each: Philox4x32-10, the conversion to units,
 * Box-Muller and the planar layout (element i of a key's n values is lane i / m of block i % m,
 * m = ceil(n / 4)), and the derived keys of split and fold_in. The stream is the one documented in
 * fnebm/random.py, with the Philox rounds, the conversion and the float32 Box-Muller of
 * _cpu_common.h (the chain and NUTS kernels draw with the same code, so their noise is these bits).
 *
 * Keys arrive as int64 words: key j is (k0[j * ks], k1[j * ks]). Outputs are contiguous:
 * draws (n_keys, n); split (2, num, n_keys) (word, key index, chain); fold_in (2, n).
 * Loaded by fnebm/_random_cpu.py; built by fnebm/_cbuild.py. */
#include "_cpu_common.h"

#ifndef FNEBM_RANDOM_PART
#define FNEBM_RANDOM_PART 0
#endif

/* parallel (OpenMP) only from this many Philox blocks (four million values): below it the threads'
 * start and their wait afterwards (they share torch's OpenMP runtime) cost more than they save. On
 * the 2-core test host under load, a million normals took 2.3 ms on one thread and 5.7 ms on two;
 * four million 15.5 and 11.7 ms. */
#define PAR_BLOCKS 1048576

/* Whether a key word lies outside [0, 2**32) (fnebm.random.check_key's value check, done here in
 * one pass instead of five torch operations): the entry points then return 1 and compute nothing,
 * and the caller raises the usual error. */
static inline int bad_keys(int64_t n_keys, const int64_t *k0, const int64_t *k1, int64_t ks) {
    uint64_t high = 0;
#pragma omp simd reduction(| : high)
    for (int64_t j = 0; j < n_keys; j++)
        high |= ((uint64_t)k0[j * ks] | (uint64_t)k1[j * ks]) >> 32;
    return high != 0;
}

enum { UNIFORM = 0, NORMAL_ONE_PAIR = 1, NORMAL_TWO_PAIRS = 2 };

/* the four values of a Philox block's words (w0, w1, w2, w3), float32: units, or Box-Muller on lanes
 * (0, 1) and, with NORMAL_TWO_PAIRS, (2, 3) (lanes that are never stored need not be computed) */
static inline __attribute__((always_inline)) void block_f32(const int mode, uint32_t w0, uint32_t w1, uint32_t w2,
                                                            uint32_t w3, float *o0, float *o1, float *o2, float *o3) {
    if (mode == UNIFORM) {
        *o0 = to_unit(w0);
        *o1 = to_unit(w1);
        *o2 = to_unit(w2);
        *o3 = to_unit(w3);
        return;
    }
    float r0 = sqrtf(-2.0f * vlogf(floor_unit(to_unit(w0))));
    float s0, c0;
    VSINCOSF(TWO_PI * to_unit(w1), s0, c0);
    *o0 = r0 * c0;
    *o1 = r0 * s0;
    if (mode == NORMAL_TWO_PAIRS) {
        float r1 = sqrtf(-2.0f * vlogf(floor_unit(to_unit(w2))));
        float s1, c1;
        VSINCOSF(TWO_PI * to_unit(w3), s1, c1);
        *o2 = r1 * c1;
        *o3 = r1 * s1;
    } else {
        *o2 = 0.0f;
        *o3 = 0.0f;
    }
}

static inline double to_unit64(uint32_t w) {
    int32_t x = (int32_t)w;
    x ^= x >> 31;
    return (double)x * 0x1p-31;
}

/* float64: the same bits scaled by 2**-31 in float64; Box-Muller in float64 with the C library's
 * log, sin and cos (as the torch path: u1 floored at 1e-7, th = 2 pi u2) */
static inline __attribute__((always_inline)) void block_f64(const int mode, uint32_t w0, uint32_t w1, uint32_t w2,
                                                            uint32_t w3, double *o0, double *o1, double *o2, double *o3) {
    if (mode == UNIFORM) {
        *o0 = to_unit64(w0);
        *o1 = to_unit64(w1);
        *o2 = to_unit64(w2);
        *o3 = to_unit64(w3);
        return;
    }
    double r0 = sqrt(-2.0 * log(fmax(to_unit64(w0), 1.0e-7)));
    double th0 = 6.283185307179586 * to_unit64(w1);
    *o0 = r0 * cos(th0);
    *o1 = r0 * sin(th0);
    if (mode == NORMAL_TWO_PAIRS) {
        double r1 = sqrt(-2.0 * log(fmax(to_unit64(w2), 1.0e-7)));
        double th1 = 6.283185307179586 * to_unit64(w3);
        *o2 = r1 * cos(th1);
        *o3 = r1 * sin(th1);
    } else {
        *o2 = 0.0;
        *o3 = 0.0;
    }
}

/* Two loop orders, one result. Many values per key (m >= CB): a task is CB consecutive blocks of
 * one key, vectorised over the blocks, each lane stored as one contiguous run. Few values per key
 * (a number or two per chain): a task is CB keys, vectorised over the keys, the values scattered.
 * One function per mode: the mode must be a constant inside the loops OpenMP outlines, or they do
 * not vectorise. */
#define DEFINE_DRAW(T, SUFFIX, BLOCK, mode)                                                                   \
    static void draw_##SUFFIX##_##mode(int64_t n_keys, const int64_t *k0, const int64_t *k1, int64_t ks,     \
                                       int64_t n, T *out, int threads) {                                      \
        const int64_t m = (n + 3) / 4;                                                                        \
        const int par = threads > 1 && n_keys * m >= PAR_BLOCKS;                                              \
        if (m >= CB) {                                                                                        \
            const int64_t chunks = (m + CB - 1) / CB, tasks = n_keys * chunks;                                \
            _Pragma("omp parallel for num_threads(threads) if (par) schedule(static)")                        \
            for (int64_t t = 0; t < tasks; t++) {                                                             \
                const int64_t j = t / chunks, b0 = (t % chunks) * CB;                                         \
                uint32_t kk0[CB], kk1[CB], w[4][CB];                                                          \
                for (int i = 0; i < CB; i++) {                                                                \
                    kk0[i] = (uint32_t)k0[j * ks];                                                            \
                    kk1[i] = (uint32_t)k1[j * ks];                                                            \
                    w[0][i] = (uint32_t)(b0 + i);                                                             \
                    w[1][i] = (uint32_t)((uint64_t)(b0 + i) >> 32);                                           \
                    w[2][i] = w[3][i] = 0;                                                                    \
                }                                                                                             \
                philox_lanes(w, kk0, kk1);                                                                    \
                T o[4][CB];                                                                                   \
                _Pragma("omp simd")                                                                           \
                for (int i = 0; i < CB; i++)                                                                  \
                    BLOCK(mode, w[0][i], w[1][i], w[2][i], w[3][i], &o[0][i], &o[1][i], &o[2][i], &o[3][i]);  \
                T *row = out + j * n;                                                                         \
                const int64_t live = m - b0 < CB ? m - b0 : CB;                                               \
                for (int lane = 0; lane < 4; lane++) {                                                        \
                    const int64_t start = lane * m + b0;                                                      \
                    int64_t count = n - start < live ? n - start : live;                                      \
                    if (count > 0)                                                                            \
                        memcpy(row + start, o[lane], sizeof(T) * (size_t)count);                              \
                }                                                                                             \
            }                                                                                                 \
        } else {                                                                                              \
            const int64_t tasks = (n_keys + CB - 1) / CB;                                                     \
            _Pragma("omp parallel for num_threads(threads) if (par) schedule(static)")                        \
            for (int64_t t = 0; t < tasks; t++) {                                                             \
                const int64_t j0 = t * CB;                                                                    \
                const int64_t live = n_keys - j0 < CB ? n_keys - j0 : CB;                                     \
                uint32_t kk0[CB], kk1[CB];                                                                    \
                for (int i = 0; i < CB; i++) {                                                                \
                    const int64_t j = i < live ? j0 + i : j0; /* past the end: any live key, not stored */   \
                    kk0[i] = (uint32_t)k0[j * ks];                                                            \
                    kk1[i] = (uint32_t)k1[j * ks];                                                            \
                }                                                                                             \
                for (int64_t b = 0; b < m; b++) {                                                             \
                    uint32_t w[4][CB];                                                                        \
                    for (int i = 0; i < CB; i++) {                                                            \
                        w[0][i] = (uint32_t)b;                                                                \
                        w[1][i] = (uint32_t)((uint64_t)b >> 32);                                              \
                        w[2][i] = w[3][i] = 0;                                                                \
                    }                                                                                         \
                    philox_lanes(w, kk0, kk1);                                                                \
                    T o[4][CB];                                                                               \
                    _Pragma("omp simd")                                                                       \
                    for (int i = 0; i < CB; i++)                                                              \
                        BLOCK(mode, w[0][i], w[1][i], w[2][i], w[3][i], &o[0][i], &o[1][i], &o[2][i], &o[3][i]); \
                    for (int lane = 0; lane < 4; lane++) {                                                    \
                        const int64_t e = lane * m + b;                                                       \
                        if (e >= n)                                                                           \
                            break;                                                                            \
                        for (int64_t i = 0; i < live; i++)                                                    \
                            out[(j0 + i) * n + e] = o[lane][i];                                               \
                    }                                                                                         \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }

/* lanes 2 and 3 are read when some element lies at or past 2 m (n > 2 m) */
static inline int normal_mode(int64_t n) { return n > 2 * ((n + 3) / 4) ? NORMAL_TWO_PAIRS : NORMAL_ONE_PAIR; }


/* The eager samplers' elementwise helpers beside the draws (fnebm.integrators.diffusion and
 * fnebm.samplers.base call them on large eager CPU states, where NumPy made two or three passes):
 *
 * em: Euler-Maruyama's x' = (x - h g) + c z, each operation rounded once as torch's separate
 * operations round them (no fused multiply-add: GCC contracts across statements by default),
 * over n_rows rows of n values; h and c are one value (stride 0) or one per row (stride 1). Also
 * writes whether each row of x' is finite (finite[r] = 0/1), when finite is not NULL.
 *
 * rows_finite: finite[r] &= every value of row r is finite.
 *
 * all_finite: whether every one of the n values is finite (one flat pass: the common case, before
 * any row is looked at).
 *
 * axpy: out = y + sign (a x) (sign +1 or -1: y - a x), the leapfrog's momentum and position
 * steps, each operation rounded once; a is one value (stride 0) or one per row (stride 1).
 *
 * mala_diff: MALA's proposal densities' elementwise part (fnebm.samplers.mala.log_acceptance_ratio),
 * out = f f - b b with f = (p - x) + h g and b = (x - p) + h g'. */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else /* clang contracts only within one expression by default: each operation is its own statement */
#define NO_CONTRACT
#endif

#define DEFINE_HELPERS(T, SUFFIX, EXP_MASK, UINT)                                                              \
    NO_CONTRACT void fnebm_em_##SUFFIX(int64_t n_rows, int64_t n, const T *x, const T *g, const T *z,          \
                                       const T *h, int64_t hs, const T *c, int64_t cs, T *out,                \
                                       unsigned char *finite) {                                               \
        for (int64_t r = 0; r < n_rows; r++) {                                                                \
            const T hr = h[r * hs], cr = c[r * cs];                                                           \
            const T *xr = x + r * n, *gr = g + r * n, *zr = z + r * n;                                        \
            T *o = out + r * n;                                                                               \
            UINT bad = 0;                                                                                     \
            _Pragma("omp simd reduction(| : bad)")                                                            \
            for (int64_t i = 0; i < n; i++) {                                                                 \
                const T step = hr * gr[i];                                                                    \
                const T moved = xr[i] - step;                                                                 \
                const T noise = cr * zr[i];                                                                   \
                const T v = moved + noise;                                                                    \
                o[i] = v;                                                                                     \
                UINT u;                                                                                       \
                memcpy(&u, &v, sizeof u);                                                                     \
                bad |= (UINT)((u & EXP_MASK) == EXP_MASK);                                                    \
            }                                                                                                 \
            if (finite)                                                                                       \
                finite[r] = !bad;                                                                             \
        }                                                                                                     \
    }                                                                                                         \
    NO_CONTRACT void fnebm_axpy_##SUFFIX(int64_t n_rows, int64_t n, const T *y, int sign, const T *a,         \
                                         int64_t as, const T *x, T *out) {                                    \
        for (int64_t r = 0; r < n_rows; r++) {                                                                \
            const T ar = a[r * as];                                                                           \
            const T *yr = y + r * n, *xr = x + r * n;                                                         \
            T *o = out + r * n;                                                                               \
            if (sign > 0) {                                                                                   \
                _Pragma("omp simd")                                                                           \
                for (int64_t i = 0; i < n; i++) {                                                             \
                    const T t = ar * xr[i];                                                                   \
                    o[i] = yr[i] + t;                                                                         \
                }                                                                                             \
            } else {                                                                                          \
                _Pragma("omp simd")                                                                           \
                for (int64_t i = 0; i < n; i++) {                                                             \
                    const T t = ar * xr[i];                                                                   \
                    o[i] = yr[i] - t;                                                                         \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    NO_CONTRACT void fnebm_mala_diff_##SUFFIX(int64_t n_rows, int64_t n, const T *x, const T *p, const T *g,  \
                                              const T *gp, const T *h, int64_t hs, T *out) {                  \
        for (int64_t r = 0; r < n_rows; r++) {                                                                \
            const T hr = h[r * hs];                                                                           \
            const T *xr = x + r * n, *pr = p + r * n, *gr = g + r * n, *qr = gp + r * n;                      \
            T *o = out + r * n;                                                                               \
            _Pragma("omp simd")                                                                               \
            for (int64_t i = 0; i < n; i++) {                                                                 \
                const T fd = pr[i] - xr[i], fs = hr * gr[i], f = fd + fs;                                     \
                const T bd = xr[i] - pr[i], bs = hr * qr[i], b = bd + bs;                                     \
                const T ff = f * f, bb = b * b;                                                               \
                o[i] = ff - bb;                                                                               \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    static inline UINT nonfinite_##SUFFIX(int64_t n, const T *x) { /* nonzero: some value is inf or NaN */   \
        UINT bad = 0;                                                                                         \
        _Pragma("omp simd reduction(| : bad)")                                                                \
        for (int64_t i = 0; i < n; i++) {                                                                     \
            UINT u;                                                                                           \
            memcpy(&u, &x[i], sizeof u);                                                                      \
            bad |= (UINT)((u & EXP_MASK) == EXP_MASK);                                                        \
        }                                                                                                     \
        return bad;                                                                                           \
    }                                                                                                         \
    int fnebm_all_finite_##SUFFIX(int64_t n, const T *x) { return !nonfinite_##SUFFIX(n, x); }               \
    void fnebm_rows_finite_##SUFFIX(int64_t n_rows, int64_t n, const T *x, unsigned char *finite) {          \
        if (n < 8) { /* short rows (a 2-D position): a scalar loop, no vector loop set up per row */          \
            for (int64_t r = 0; r < n_rows; r++) {                                                            \
                const T *xr = x + r * n;                                                                      \
                UINT bad = 0;                                                                                 \
                for (int64_t i = 0; i < n; i++) {                                                             \
                    UINT u;                                                                                   \
                    memcpy(&u, &xr[i], sizeof u);                                                             \
                    bad |= (UINT)((u & EXP_MASK) == EXP_MASK);                                                \
                }                                                                                             \
                finite[r] = finite[r] && !bad;                                                                \
            }                                                                                                 \
            return;                                                                                           \
        }                                                                                                     \
        for (int64_t r = 0; r < n_rows; r++) {                                                                \
            if (finite[r])                                                                                    \
                finite[r] = !nonfinite_##SUFFIX(n, x + r * n);                                                \
        }                                                                                                     \
    }

/* Two objects, compiled at once (FNEBM_RANDOM_PART 0: the float32 draws, about two thirds of the
 * build; 1: the float64 draws and the keys) */
#if FNEBM_RANDOM_PART == 0
DEFINE_HELPERS(float, f32, 0x7f800000u, uint32_t)
DEFINE_DRAW(float, f32, block_f32, UNIFORM)
DEFINE_DRAW(float, f32, block_f32, NORMAL_ONE_PAIR)
DEFINE_DRAW(float, f32, block_f32, NORMAL_TWO_PAIRS)

int fnebm_uniform_f32(int64_t n_keys, const int64_t *k0, const int64_t *k1, int64_t ks, int64_t n, float *out,
                      int threads) {
    if (bad_keys(n_keys, k0, k1, ks))
        return 1;
    draw_f32_UNIFORM(n_keys, k0, k1, ks, n, out, threads);
    return 0;
}


int fnebm_normal_f32(int64_t n_keys, const int64_t *k0, const int64_t *k1, int64_t ks, int64_t n, float *out,
                     int threads) {
    if (bad_keys(n_keys, k0, k1, ks))
        return 1;
    if (normal_mode(n) == NORMAL_TWO_PAIRS)
        draw_f32_NORMAL_TWO_PAIRS(n_keys, k0, k1, ks, n, out, threads);
    else
        draw_f32_NORMAL_ONE_PAIR(n_keys, k0, k1, ks, n, out, threads);
    return 0;
}


#else
DEFINE_HELPERS(double, f64, 0x7ff0000000000000ull, uint64_t)
DEFINE_DRAW(double, f64, block_f64, UNIFORM)
DEFINE_DRAW(double, f64, block_f64, NORMAL_ONE_PAIR)
DEFINE_DRAW(double, f64, block_f64, NORMAL_TWO_PAIRS)

int fnebm_uniform_f64(int64_t n_keys, const int64_t *k0, const int64_t *k1, int64_t ks, int64_t n, double *out,
                      int threads) {
    if (bad_keys(n_keys, k0, k1, ks))
        return 1;
    draw_f64_UNIFORM(n_keys, k0, k1, ks, n, out, threads);
    return 0;
}

int fnebm_normal_f64(int64_t n_keys, const int64_t *k0, const int64_t *k1, int64_t ks, int64_t n, double *out,
                     int threads) {
    if (bad_keys(n_keys, k0, k1, ks))
        return 1;
    if (normal_mode(n) == NORMAL_TWO_PAIRS)
        draw_f64_NORMAL_TWO_PAIRS(n_keys, k0, k1, ks, n, out, threads);
    else
        draw_f64_NORMAL_ONE_PAIR(n_keys, k0, k1, ks, n, out, threads);
    return 0;
}

/* split(key, num): block b (third counter word SPLIT_TAG) gives keys 2b (words 0, 1) and 2b + 1
 * (words 2, 3); out[w][i][j] is word w of key i of chain j */
int fnebm_split(int64_t n_keys, const int64_t *k0, const int64_t *k1, int64_t ks, int64_t num, int64_t *out,
                int threads) {
    if (bad_keys(n_keys, k0, k1, ks))
        return 1;
    const int64_t blocks = (num + 1) / 2;
    const int par = threads > 1 && n_keys * blocks >= PAR_BLOCKS;
    int64_t *first = out, *second = out + num * n_keys;
    const int64_t pairs = blocks * n_keys, tasks = (pairs + CB - 1) / CB;
    /* CB (block, key) pairs at a time, block-major (philox_lanes): vectorised over the keys, or over the
     * blocks of one key */
#pragma omp parallel for num_threads(threads) if (par) schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t p0 = t * CB;
        const int live = pairs - p0 < CB ? (int)(pairs - p0) : CB;
        uint32_t kk0[CB], kk1[CB], w[4][CB];
        for (int i = 0; i < CB; i++) {
            const int64_t p = i < live ? p0 + i : p0; /* past the end: any live pair, not stored */
            const int64_t b = p / n_keys, j = p - b * n_keys;
            kk0[i] = (uint32_t)k0[j * ks];
            kk1[i] = (uint32_t)k1[j * ks];
            w[0][i] = (uint32_t)b;
            w[1][i] = (uint32_t)((uint64_t)b >> 32);
            w[2][i] = SPLIT_TAG;
            w[3][i] = 0;
        }
        philox_lanes(w, kk0, kk1);
        for (int i = 0; i < live; i++) {
            const int64_t p = p0 + i, b = p / n_keys, j = p - b * n_keys;
            first[2 * b * n_keys + j] = w[0][i];
            second[2 * b * n_keys + j] = w[1][i];
            if (2 * b + 1 < num) {
                first[(2 * b + 1) * n_keys + j] = w[2][i];
                second[(2 * b + 1) * n_keys + j] = w[3][i];
            }
        }
    }
    return 0;
}

/* fold_in(key, data): counter (data_lo, data_hi, FOLD_TAG, 0), the new key words 0 and 1; element i
 * reads key (k0[i * ks], k1[i * ks]) and data[i * ds] (a stride 0 broadcasts); out is (2, n) */
int fnebm_fold_in(int64_t n, const int64_t *k0, const int64_t *k1, int64_t ks, const int64_t *data, int64_t ds,
                  int64_t *out, int threads) {
    if (bad_keys(n, k0, k1, ks))
        return 1;
    const int par = threads > 1 && n >= PAR_BLOCKS;
    const int64_t tasks = (n + CB - 1) / CB; /* CB keys at a time (philox_lanes) */
#pragma omp parallel for num_threads(threads) if (par) schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t i0 = t * CB;
        const int live = n - i0 < CB ? (int)(n - i0) : CB;
        uint32_t kk0[CB], kk1[CB], w[4][CB];
        for (int l = 0; l < CB; l++) {
            const int64_t i = l < live ? i0 + l : i0; /* past the end: any live element, not stored */
            const uint64_t d = (uint64_t)data[i * ds];
            kk0[l] = (uint32_t)k0[i * ks];
            kk1[l] = (uint32_t)k1[i * ks];
            w[0][l] = (uint32_t)d;
            w[1][l] = (uint32_t)(d >> 32);
            w[2][l] = FOLD_TAG;
            w[3][l] = 0;
        }
        philox_lanes(w, kk0, kk1);
        for (int l = 0; l < live; l++) {
            out[i0 + l] = w[0][l];
            out[n + i0 + l] = w[1][l];
        }
    }
    return 0;
}
#endif
