/* One NUTS transition of every chain, on the CPU, for the energies the C kernels compute in closed form.
 *
 * The C counterpart of fnebm/samplers/nuts.py's flat loop, which is its pure-torch twin: the same
 * algorithm step for step (progressive multinomial sampling inside a subtree, biased sampling at a
 * merge, the generalised U-turn criterion checked on every balanced sub-subtree through the
 * checkpoints indexed by popcount, Stan's extra checks across the halves of every merge), the same
 * draws (the momentum normal(split(key)[0], (d,)) scaled by the metric, and uniform(fold_in(
 * split(key)[1], i), 3) at the chain's i-th integrator step) and the same float32 arithmetic: built
 * with -ffp-contract=off, so that a - c * b rounds twice as torch's two operations do (dot products
 * still sum in another order).
 * Where the twin holds every chain in lockstep and masks the finished ones, each chain here builds
 * its own tree: a thread takes a chain, runs its transition to the end and takes the next, so no
 * chain waits for the longest tree.
 *
 * Built by fnebm/kernels/cpu_nuts.py (with fnebm/kernels/_cbuild.py, as _cpu_chain.c) into a library
 * of its own (cpu_nuts-*.so), and called from there through ctypes (the GIL is released).
 */
#include "_cpu_common.h"

#define MAX_COEF 15 /* integrator coefficients: a palindrome of at most 15 (Yoshida's has 7) */

typedef struct {
    int64_t n_chains, d, depth, n_coef, extra_checks;
    int64_t key_stride_c, key_stride_w;
    int64_t h_stride;    /* 0: one step size, 1: one per chain */
    int64_t m_stride;    /* 0: one metric; else the per-chain stride of imm and mfac (d or d * d) */
    int64_t dense;       /* imm is (d, d) (mfac: p = mfac z), else (d,) (mfac: the scale rsqrt(imm)) */
    const float *x_in, *e_in, *g_in, *h_ptr, *imm, *mfac, *scalars, *vectors;
    const int64_t *keys;
    const double *coef;
    double threshold;
    float *x_out, *e_out, *g_out, *accept, *energy_error;
    int8_t *divergent, *turning;
    int64_t *tree_depth, *n_steps;
} nuts_args_t;

static inline float dotf(const float *restrict a, const float *restrict b, int64_t d) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < d; i++)
        s += a[i] * b[i];
    return s;
}

/* ATen's logaddexp: equal infinities give themselves (not inf - inf), NaN propagates */
static inline float logaddexpf(float a, float b) {
    if (isinf(a) && a == b)
        return a;
    float m = a < b ? b : a;
    return m + log1pf(expf(-fabsf(a - b)));
}

/* exp(min(x, 0)) as torch's clamp_max then exp: NaN stays NaN (fminf would give 0) */
static inline float exp_clamped(float x) { return expf(x > 0.0f ? 0.0f : x); }

/* E(x), and its gradient into g: the closed forms of _cpu_chain.c, for one chain (vectorised over
 * the d elements). tmp: d floats of scratch. */
static inline __attribute__((always_inline)) float energy_grad(const int family, const float *restrict sc,
                                                               const float *restrict vec, int64_t d,
                                                               const float *restrict x, float *restrict g,
                                                               float *restrict tmp) {
    float acc = 0.0f;
    if (family == GAUSSIAN_FULL) { /* 0.5 |L^T (x - mean)|^2; grad L (L^T (x - mean)); vec: mean, L row-major */
        const float *mean = vec, *L = vec + d;
        for (int64_t c = 0; c < d; c++)
            tmp[c] = 0.0f;
        for (int64_t i = 0; i < d; i++) {
            const float dl = x[i] - mean[i];
            const float *row = L + i * d;
#pragma omp simd
            for (int64_t c = 0; c < d; c++)
                tmp[c] += dl * row[c];
        }
        acc = dotf(tmp, tmp, d);
        for (int64_t i = 0; i < d; i++)
            g[i] = dotf(tmp, L + i * d, d);
        return 0.5f * acc;
    }
    const float pa = sc[0], pb = sc[1];
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < d; i++) {
        float q, n;
        if (family == GAUSSIAN) /* vec: mean, precision, sqrt(precision) */
            separable_term(family, x[i], vec[i], vec[d + i], vec[2 * d + i], &q, &n);
        else
            separable_term(family, x[i], pa, pb, pb, &q, &n);
        acc += q;
        g[i] = n;
    }
    return separable_energy(family, acc, pa, d);
}

/* energy_grad for the family given at run time: each case is its own vectorised copy */
static float energy_grad_any(int family, const float *restrict sc, const float *restrict vec, int64_t d,
                             const float *restrict x, float *restrict g, float *restrict tmp) {
    switch (family) {
#define FNEBM_CASE(NAME, ID, TERM, TOTAL) case NAME: return energy_grad(NAME, sc, vec, d, x, g, tmp);
    FNEBM_SEPARABLE(FNEBM_CASE)
#undef FNEBM_CASE
    default:
        return energy_grad(GAUSSIAN_FULL, sc, vec, d, x, g, tmp);
    }
}

/* out = m in for a metric's matrix m: diagonal (d,) elementwise, or dense (d, d) row by row; the
 * velocity M^{-1} p (m = imm) and the momentum draw's scaling of z (m = mfac) */
static inline void apply_metric(float *restrict out, const float *restrict in, const float *restrict m, int64_t d,
                                int dense) {
    if (dense) {
        for (int64_t r = 0; r < d; r++)
            out[r] = dotf(m + r * d, in, d);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < d; i++)
            out[i] = m[i] * in[i];
    }
}

/* normal(key, (d,)) of fnebm.random: element i is lane i // m of Philox block i % m, Box-Muller on
 * lanes (0, 1) and (2, 3) */
static void normal_vec(float *restrict z, uint32_t k0, uint32_t k1, int64_t d) {
    const int64_t m = (d + 3) / 4;
    for (int64_t b = 0; b < m; b++) {
        uint32_t w0 = (uint32_t)b, w1 = (uint32_t)((uint64_t)b >> 32), w2 = 0, w3 = 0;
        PHILOX(w0, w1, w2, w3, k0, k1);
        float r0 = sqrtf(-2.0f * vlogf(floor_unit(to_unit(w0))));
        float r1 = sqrtf(-2.0f * vlogf(floor_unit(to_unit(w2))));
        float s0, c0, s1, c1;
        VSINCOSF(TWO_PI * to_unit(w1), s0, c0);
        VSINCOSF(TWO_PI * to_unit(w3), s1, c1);
        const float o[4] = {r0 * c0, r0 * s0, r1 * c1, r1 * s1};
        for (int lane = 0; lane < 4; lane++) {
            int64_t i = lane * m + b;
            if (i < d)
                z[i] = o[lane];
        }
    }
}

static inline int all_finite(const float *restrict a, int64_t d) {
    int bad = 0;
#pragma omp simd reduction(| : bad)
    for (int64_t i = 0; i < d; i++)
        bad |= !(fabsf(a[i]) <= FLT_BIG);
    return !bad;
}

static inline int turning_span(const float *pl, const float *vl, const float *pr, const float *vr,
                               const float *sum, float *rho, int64_t d) {
    /* the generalised U-turn of a span with end momenta pl, pr (velocities vl, vr), momentum sum `sum` */
#pragma omp simd
    for (int64_t i = 0; i < d; i++)
        rho[i] = sum[i] - 0.5f * (pl[i] + pr[i]);
    return dotf(vl, rho, d) <= 0.0f || dotf(vr, rho, d) <= 0.0f;
}

static inline unsigned popcount64(int64_t n) { return (unsigned)__builtin_popcountll((unsigned long long)n); }

#define SWAP(a, b)          \
    do {                    \
        float *_t = (a);    \
        (a) = (b);          \
        (b) = _t;           \
    } while (0)

/* the number of floats of scratch one chain's transition uses */
static int64_t scratch_floats(int64_t d, int64_t depth) { return (26 + 4 * depth) * d + 3 * depth + 64; }

static void transition(const nuts_args_t *a, int64_t c, float *buf, const int family) {
    const int64_t d = a->d, depth = a->depth;
    const int dense = (int)a->dense, extra = (int)a->extra_checks;
    const float *imm = a->imm + c * a->m_stride, *mfac = a->mfac + c * a->m_stride;
    const float h = a->h_ptr[c * a->h_stride];
    float *w = buf;
    float *x = w, *p = w + d, *g = w + 2 * d, *v = w + 3 * d;
    float *xf = w + 4 * d, *pf = w + 5 * d, *gf = w + 6 * d, *vf = w + 7 * d;
    float *nx = w + 8 * d, *np = w + 9 * d, *ng = w + 10 * d, *nv = w + 11 * d;
    float *px = w + 12 * d, *pg = w + 13 * d, *sx = w + 14 * d, *sg = w + 15 * d;
    float *tree_sum = w + 16 * d, *sub_sum = w + 17 * d, *r0 = w + 18 * d, *v0 = w + 19 * d;
    float *q0 = w + 20 * d, *w0 = w + 21 * d, *y = w + 22 * d, *tmp = w + 23 * d, *tmp2 = w + 24 * d;
    float *rho = w + 25 * d;
    float *v_ck = w + 26 * d, *e_ck = v_ck + depth * d, *w_ck = e_ck + depth * d, *f_ck = w_ck + depth * d;
    float *a_ck = f_ck + depth * d, *c_ck = a_ck + depth, *pair_ck = c_ck + depth;
    memset(v_ck, 0, sizeof(float) * (size_t)(4 * depth * d + 3 * depth));

    /* the keys: split(key, 2) -> the momentum's key (words 0, 1) and the trajectory's (words 2, 3) */
    uint32_t kk0 = (uint32_t)a->keys[c * a->key_stride_c], kk1 = (uint32_t)a->keys[c * a->key_stride_c + a->key_stride_w];
    uint32_t s0 = 0, s1 = 0, s2 = SPLIT_TAG, s3 = 0;
    PHILOX(s0, s1, s2, s3, kk0, kk1);
    const uint32_t kt0 = s2, kt1 = s3;

    /* the start: x0, its energy and gradient, and the momentum p0 ~ N(0, M) */
    const float e0 = a->e_in[c];
    memcpy(x, a->x_in + c * d, sizeof(float) * d);
    memcpy(g, a->g_in + c * d, sizeof(float) * d);
    normal_vec(tmp, s0, s1, d);
    apply_metric(p, tmp, mfac, d, dense); /* p = scale z, or L^{-T} z */
    apply_metric(v, p, imm, d, dense);
    const float h0 = e0 + 0.5f * dotf(p, v, d);
    memcpy(xf, x, sizeof(float) * d);
    memcpy(pf, p, sizeof(float) * d);
    memcpy(gf, g, sizeof(float) * d);
    memcpy(vf, v, sizeof(float) * d);
    memcpy(px, x, sizeof(float) * d);
    memcpy(pg, g, sizeof(float) * d);
    memcpy(sx, x, sizeof(float) * d);
    memcpy(sg, g, sizeof(float) * d);
    memcpy(tree_sum, p, sizeof(float) * d);
    memset(sub_sum, 0, sizeof(float) * d);
    memcpy(r0, p, sizeof(float) * d);
    memcpy(v0, v, sizeof(float) * d);
    memcpy(q0, p, sizeof(float) * d);
    memcpy(w0, v, sizeof(float) * d);
    float u = e0, uf = e0, pu = e0, ph = h0, pw = 0.0f, su = e0, sh = h0, sw = 0.0f, accept_sum = 0.0f;
    int64_t k = 0, n = 0, steps = 0;
    int fwd = 1, diverged = 0, turned = 0;
    const float thr = (float)a->threshold;

    for (uint64_t i = 0;; i++) {
        /* uniform(fold_in(k_traj, i), (3,)): the subtree's, the merge's and the direction's draws */
        uint32_t f0 = (uint32_t)i, f1 = (uint32_t)(i >> 32), f2 = FOLD_TAG, f3 = 0;
        PHILOX(f0, f1, f2, f3, kt0, kt1);
        uint32_t b0 = 0, b1 = 0, b2 = 0, b3 = 0;
        PHILOX(b0, b1, b2, b3, f0, f1);
        const float u_sub = to_unit(b0), u_merge = to_unit(b1), u_dir = to_unit(b2);

        const int first = n == 0;
        const int new_fwd = first ? u_dir < 0.5f : fwd;
        if (new_fwd != fwd) { /* grow on the other side: start from that edge */
            SWAP(x, xf);
            SWAP(p, pf);
            SWAP(g, gf);
            SWAP(v, vf);
            float t = u;
            u = uf;
            uf = t;
        }
        fwd = new_fwd;

        /* one integrator step of fnebm.integrators.integrate (momentum first) */
        const float eps = new_fwd ? h : -h;
        memcpy(nx, x, sizeof(float) * d);
        memcpy(np, p, sizeof(float) * d);
        memcpy(ng, g, sizeof(float) * d);
        float nu = u;
        for (int64_t j = 0; j < a->n_coef; j++) {
            const float ce = (float)a->coef[j] * eps;
            if (j % 2 == 0) {
#pragma omp simd
                for (int64_t q = 0; q < d; q++)
                    np[q] = np[q] - ce * ng[q];
            } else {
                apply_metric(tmp2, np, imm, d, dense);
#pragma omp simd
                for (int64_t q = 0; q < d; q++)
                    nx[q] = nx[q] + ce * tmp2[q];
                nu = energy_grad_any(family, a->scalars, a->vectors, d, nx, ng, tmp);
            }
        }
        apply_metric(nv, np, imm, d, dense);
        const float nh = nu + 0.5f * dotf(np, nv, d);
        const int finite = fabsf(nh) <= FLT_BIG && all_finite(ng, d) && all_finite(nx, d);
        const float delta = finite ? h0 - nh : -INFINITY; /* the log weight exp(-(H - H0)) */
        const int divergent = !(finite && -delta <= thr);
        accept_sum += exp_clamped(delta);
        steps++;

        /* progressive uniform sampling inside the subtree (its first point is taken outright) */
        if (first || u_sub < 1.0f / (1.0f + expf(-(delta - sw)))) {
            memcpy(sx, nx, sizeof(float) * d);
            memcpy(sg, ng, sizeof(float) * d);
            su = nu;
            sh = nh;
        }
        sw = first ? delta : logaddexpf(sw, delta);
        if (first) {
            memcpy(sub_sum, np, sizeof(float) * d);
        } else {
#pragma omp simd
            for (int64_t q = 0; q < d; q++)
                sub_sum[q] += np[q];
        }
#pragma omp simd
        for (int64_t q = 0; q < d; q++)
            y[q] = sub_sum[q] - 0.5f * np[q];

        /* checkpoints at even steps, in slot popcount(n) */
        const int64_t bits_n = popcount64(n), bits_next = popcount64(n + 1);
        const int write = (n % 2 == 0);
        if (write) {
            memcpy(v_ck + bits_n * d, nv, sizeof(float) * d);
            memcpy(e_ck + bits_n * d, y, sizeof(float) * d);
            a_ck[bits_n] = dotf(nv, y, d);
        }
        if (first) {
            memcpy(r0, np, sizeof(float) * d);
            memcpy(v0, nv, sizeof(float) * d);
            memcpy(q0, p, sizeof(float) * d);
            memcpy(w0, v, sizeof(float) * d);
        }

        /* U-turns of the balanced subtrees completed at step n: slots popcount(n + 1) - 1 .. popcount(n) - 1 */
        const int64_t hi = bits_n - 1, lo = bits_next - 1;
        int sub_turning = 0;
        const float nvy = dotf(nv, y, d);
        for (int64_t j = lo; j <= hi && !sub_turning; j++)
            sub_turning = dotf(v_ck + j * d, y, d) - a_ck[j] <= 0.0f || nvy - dotf(nv, e_ck + j * d, d) <= 0.0f;
        if (extra && depth > 1) {
            if (write) { /* A + first(B) for the halves that meet at this slot, and last(A) + B's pieces */
                const int64_t prev = bits_n - 1 > 0 ? bits_n - 1 : 0;
                const float *v_a = v_ck + prev * d, *e_a = e_ck + prev * d;
#pragma omp simd
                for (int64_t q = 0; q < d; q++)
                    rho[q] = y[q] - e_a[q];
                const int pair = dotf(v_a, rho, d) <= 0.0f || dotf(nv, rho, d) <= 0.0f;
                float *fb = f_ck + bits_n * d;
#pragma omp simd
                for (int64_t q = 0; q < d; q++)
                    fb[q] = np[q] - sub_sum[q] + 0.5f * p[q];
                memcpy(w_ck + bits_n * d, v, sizeof(float) * d);
                c_ck[bits_n] = dotf(v, fb, d);
                pair_ck[bits_n] = pair ? 1.0f : 0.0f;
            }
            for (int64_t j = lo + 1; j <= hi && !sub_turning; j++)
                sub_turning = pair_ck[j] > 0.0f || dotf(w_ck + j * d, y, d) + c_ck[j] <= 0.0f
                              || nvy + dotf(nv, f_ck + j * d, d) <= 0.0f;
        }
        sub_turning = sub_turning && !divergent; /* a divergent point's momentum is not checked */

        /* the subtree's end: merge it, or stop */
        const int end = n + 1 == ((int64_t)1 << k);
        const int stop = divergent || sub_turning;
        const int merge = end && !stop;
        int tree_turning = 0;
        if (merge) {
            if (u_merge < exp_clamped(sw - pw)) { /* biased progressive sampling */
                memcpy(px, sx, sizeof(float) * d);
                memcpy(pg, sg, sizeof(float) * d);
                pu = su;
                ph = sh;
            }
            pw = logaddexpf(pw, sw);
#pragma omp simd
            for (int64_t q = 0; q < d; q++)
                tmp[q] = tree_sum[q] + sub_sum[q];
            tree_turning = turning_span(pf, vf, np, nv, tmp, rho, d);
            if (extra && !tree_turning) { /* the tree + the subtree's first point; the tree's edge + the subtree */
#pragma omp simd
                for (int64_t q = 0; q < d; q++)
                    tmp2[q] = tree_sum[q] + r0[q];
                tree_turning = turning_span(pf, vf, r0, v0, tmp2, rho, d);
                if (!tree_turning) {
#pragma omp simd
                    for (int64_t q = 0; q < d; q++)
                        tmp2[q] = sub_sum[q] + q0[q];
                    tree_turning = turning_span(q0, w0, np, nv, tmp2, rho, d);
                }
            }
            memcpy(tree_sum, tmp, sizeof(float) * d);
        }
        const int done = stop || tree_turning || (merge && k + 1 >= depth);
        if (merge && !done)
            k++;
        n = end ? 0 : n + 1;

        /* integration continues from the new point (a non-finite one ends the tree anyway) */
        if (finite) {
            SWAP(x, nx);
            SWAP(p, np);
            SWAP(g, ng);
            SWAP(v, nv);
            u = nu;
        }
        diverged |= divergent;
        turned |= sub_turning || tree_turning;
        if (done)
            break;
    }
    memcpy(a->x_out + c * d, px, sizeof(float) * d);
    memcpy(a->g_out + c * d, pg, sizeof(float) * d);
    a->e_out[c] = pu;
    a->accept[c] = accept_sum / (float)(steps > 1 ? steps : 1);
    a->energy_error[c] = ph - h0;
    a->divergent[c] = (int8_t)diverged;
    a->turning[c] = (int8_t)turned;
    a->tree_depth[c] = k + 1;
    a->n_steps[c] = steps;
}

/* Returns 0, or -1 when a thread could not allocate its scratch (nothing is then valid). */
int fnebm_nuts_step(const nuts_args_t *a, int family, int n_threads) {
    int failed = 0;
    const size_t floats = (size_t)scratch_floats(a->d, a->depth);
#pragma omp parallel num_threads(n_threads)
    {
        float *buf = (float *)aligned_alloc(64, sizeof(float) * ((floats + 15) / 16 * 16));
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) /* one chain at a time: trees differ in length */
        for (int64_t c = 0; c < a->n_chains; c++) {
            if (buf == NULL)
                continue;
            transition(a, c, buf, family);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
