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

/* One chain's transition as a state machine, so that its energy and gradient can come from outside:
 * tree_run advances it to the next point whose energy and gradient it needs (nx; it returns 1, and
 * the caller writes E(nx) to nu and the gradient to ng) or to the transition's end (it returns 0).
 * The closed-form families call tree_run in a loop of their own (fnebm_nuts_step); a user's energy
 * is evaluated in torch for every chain at once between calls (fnebm_nuts_begin / _resume). */
typedef struct {
    float *x, *p, *g, *v, *xf, *pf, *gf, *vf, *nx, *np, *ng, *nv; /* swapped as the tree grows */
    float *px, *pg, *sx, *sg, *tree_sum, *sub_sum, *r0, *v0, *q0, *w0, *y, *tmp, *tmp2, *rho;
    float *v_ck, *e_ck, *w_ck, *f_ck, *a_ck, *c_ck, *pair_ck;
    const float *imm, *mfac;
    float h, h0, u, uf, nu, pu, ph, pw, su, sh, sw, accept_sum, eps, u_sub, u_merge;
    int64_t k, n, steps, j;
    uint64_t i;
    uint32_t kt0, kt1;
    int fwd, diverged, turned, first;
} tree_t;

/* the scratch layout of one chain, its metric and step size */
static void tree_setup(tree_t *t, const nuts_args_t *a, int64_t c, float *w) {
    const int64_t d = a->d, depth = a->depth;
    t->imm = a->imm + c * a->m_stride;
    t->mfac = a->mfac + c * a->m_stride;
    t->h = a->h_ptr[c * a->h_stride];
    t->x = w, t->p = w + d, t->g = w + 2 * d, t->v = w + 3 * d;
    t->xf = w + 4 * d, t->pf = w + 5 * d, t->gf = w + 6 * d, t->vf = w + 7 * d;
    t->nx = w + 8 * d, t->np = w + 9 * d, t->ng = w + 10 * d, t->nv = w + 11 * d;
    t->px = w + 12 * d, t->pg = w + 13 * d, t->sx = w + 14 * d, t->sg = w + 15 * d;
    t->tree_sum = w + 16 * d, t->sub_sum = w + 17 * d, t->r0 = w + 18 * d, t->v0 = w + 19 * d;
    t->q0 = w + 20 * d, t->w0 = w + 21 * d, t->y = w + 22 * d, t->tmp = w + 23 * d, t->tmp2 = w + 24 * d;
    t->rho = w + 25 * d;
    t->v_ck = w + 26 * d, t->e_ck = t->v_ck + depth * d, t->w_ck = t->e_ck + depth * d;
    t->f_ck = t->w_ck + depth * d;
    t->a_ck = t->f_ck + depth * d, t->c_ck = t->a_ck + depth, t->pair_ck = t->c_ck + depth;
}

/* the start of a transition from (x0, e0, g0) with the chain's key words (kk0, kk1) */
static void tree_start(tree_t *t, const nuts_args_t *a, const float *x0, float e0, const float *g0, uint32_t kk0,
                       uint32_t kk1) {
    const int64_t d = a->d, depth = a->depth;
    const int dense = (int)a->dense;
    memset(t->v_ck, 0, sizeof(float) * (size_t)(4 * depth * d + 3 * depth));

    /* the keys: split(key, 2) -> the momentum's key (words 0, 1) and the trajectory's (words 2, 3) */
    uint32_t s0 = 0, s1 = 0, s2 = SPLIT_TAG, s3 = 0;
    PHILOX(s0, s1, s2, s3, kk0, kk1);
    t->kt0 = s2, t->kt1 = s3;

    /* the start: x0, its energy and gradient, and the momentum p0 ~ N(0, M) */
    memcpy(t->x, x0, sizeof(float) * d);
    memcpy(t->g, g0, sizeof(float) * d);
    normal_vec(t->tmp, s0, s1, d);
    apply_metric(t->p, t->tmp, t->mfac, d, dense); /* p = scale z, or L^{-T} z */
    apply_metric(t->v, t->p, t->imm, d, dense);
    t->h0 = e0 + 0.5f * dotf(t->p, t->v, d);
    const size_t bytes = sizeof(float) * d;
    memcpy(t->xf, t->x, bytes);
    memcpy(t->pf, t->p, bytes);
    memcpy(t->gf, t->g, bytes);
    memcpy(t->vf, t->v, bytes);
    memcpy(t->px, t->x, bytes);
    memcpy(t->pg, t->g, bytes);
    memcpy(t->sx, t->x, bytes);
    memcpy(t->sg, t->g, bytes);
    memcpy(t->tree_sum, t->p, bytes);
    memset(t->sub_sum, 0, bytes);
    memcpy(t->r0, t->p, bytes);
    memcpy(t->v0, t->v, bytes);
    memcpy(t->q0, t->p, bytes);
    memcpy(t->w0, t->v, bytes);
    t->u = t->uf = t->pu = t->su = e0;
    t->ph = t->sh = t->h0;
    t->pw = t->sw = t->accept_sum = 0.0f;
    t->k = t->n = t->steps = 0;
    t->i = 0;
    t->fwd = 1, t->diverged = 0, t->turned = 0;
}

/* the start of integrator step i: its draws, its direction, and the copy of the edge it leaves from */
static void step_start(tree_t *t, const nuts_args_t *a) {
    const int64_t d = a->d;
    /* uniform(fold_in(k_traj, i), (3,)): the subtree's, the merge's and the direction's draws */
    uint32_t f0 = (uint32_t)t->i, f1 = (uint32_t)(t->i >> 32), f2 = FOLD_TAG, f3 = 0;
    PHILOX(f0, f1, f2, f3, t->kt0, t->kt1);
    uint32_t b0 = 0, b1 = 0, b2 = 0, b3 = 0;
    PHILOX(b0, b1, b2, b3, f0, f1);
    t->u_sub = to_unit(b0), t->u_merge = to_unit(b1);
    const float u_dir = to_unit(b2);

    t->first = t->n == 0;
    const int new_fwd = t->first ? u_dir < 0.5f : t->fwd;
    if (new_fwd != t->fwd) { /* grow on the other side: start from that edge */
        SWAP(t->x, t->xf);
        SWAP(t->p, t->pf);
        SWAP(t->g, t->gf);
        SWAP(t->v, t->vf);
        float s = t->u;
        t->u = t->uf;
        t->uf = s;
    }
    t->fwd = new_fwd;

    /* one integrator step of fnebm.integrators.integrate (momentum first) */
    t->eps = new_fwd ? t->h : -t->h;
    memcpy(t->nx, t->x, sizeof(float) * d);
    memcpy(t->np, t->p, sizeof(float) * d);
    memcpy(t->ng, t->g, sizeof(float) * d);
    t->nu = t->u;
    t->j = 0;
}

/* the integrator's coefficients from t->j on: 1 when it needs E and the gradient at nx (it then
 * resumes at the next coefficient), 0 when the step's coefficients are done */
static int integrate(tree_t *t, const nuts_args_t *a) {
    const int64_t d = a->d;
    float *restrict np = t->np, *restrict nx = t->nx, *restrict tmp2 = t->tmp2;
    const float *restrict ng = t->ng;
    for (; t->j < a->n_coef; t->j++) {
        const float ce = (float)a->coef[t->j] * t->eps;
        if (t->j % 2 == 0) {
#pragma omp simd
            for (int64_t q = 0; q < d; q++)
                np[q] = np[q] - ce * ng[q];
        } else {
            apply_metric(tmp2, np, t->imm, d, (int)a->dense);
#pragma omp simd
            for (int64_t q = 0; q < d; q++)
                nx[q] = nx[q] + ce * tmp2[q];
            t->j++;
            return 1;
        }
    }
    return 0;
}

/* the end of an integrator step: sampling, checkpoints, U-turns, the merge; 1 when the tree is done */
static int step_finish(tree_t *t, const nuts_args_t *a) {
    const int64_t d = a->d, depth = a->depth;
    const int dense = (int)a->dense, extra = (int)a->extra_checks;
    const float thr = (float)a->threshold, h0 = t->h0;
    const int first = t->first;
    const int64_t n = t->n, k = t->k;
    float *nx = t->nx, *np = t->np, *ng = t->ng, *nv = t->nv, *y = t->y, *rho = t->rho, *tmp = t->tmp;
    float *tmp2 = t->tmp2, *sub_sum = t->sub_sum, *tree_sum = t->tree_sum;
    float *v_ck = t->v_ck, *e_ck = t->e_ck, *w_ck = t->w_ck, *f_ck = t->f_ck, *a_ck = t->a_ck, *c_ck = t->c_ck;
    float *pair_ck = t->pair_ck;
    const float nu = t->nu;

    apply_metric(nv, np, t->imm, d, dense);
    const float nh = nu + 0.5f * dotf(np, nv, d);
    const int finite = fabsf(nh) <= FLT_BIG && all_finite(ng, d) && all_finite(nx, d);
    const float delta = finite ? h0 - nh : -INFINITY; /* the log weight exp(-(H - H0)) */
    const int divergent = !(finite && -delta <= thr);
    t->accept_sum += exp_clamped(delta);
    t->steps++;

    /* progressive uniform sampling inside the subtree (its first point is taken outright) */
    if (first || t->u_sub < 1.0f / (1.0f + expf(-(delta - t->sw)))) {
        memcpy(t->sx, nx, sizeof(float) * d);
        memcpy(t->sg, ng, sizeof(float) * d);
        t->su = nu;
        t->sh = nh;
    }
    t->sw = first ? delta : logaddexpf(t->sw, delta);
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
        memcpy(t->r0, np, sizeof(float) * d);
        memcpy(t->v0, nv, sizeof(float) * d);
        memcpy(t->q0, t->p, sizeof(float) * d);
        memcpy(t->w0, t->v, sizeof(float) * d);
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
            const float *p = t->p;
#pragma omp simd
            for (int64_t q = 0; q < d; q++)
                fb[q] = np[q] - sub_sum[q] + 0.5f * p[q];
            memcpy(w_ck + bits_n * d, t->v, sizeof(float) * d);
            c_ck[bits_n] = dotf(t->v, fb, d);
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
        if (t->u_merge < exp_clamped(t->sw - t->pw)) { /* biased progressive sampling */
            memcpy(t->px, t->sx, sizeof(float) * d);
            memcpy(t->pg, t->sg, sizeof(float) * d);
            t->pu = t->su;
            t->ph = t->sh;
        }
        t->pw = logaddexpf(t->pw, t->sw);
#pragma omp simd
        for (int64_t q = 0; q < d; q++)
            tmp[q] = tree_sum[q] + sub_sum[q];
        tree_turning = turning_span(t->pf, t->vf, np, nv, tmp, rho, d);
        if (extra && !tree_turning) { /* the tree + the subtree's first point; the tree's edge + the subtree */
            const float *r0 = t->r0, *q0 = t->q0;
#pragma omp simd
            for (int64_t q = 0; q < d; q++)
                tmp2[q] = tree_sum[q] + r0[q];
            tree_turning = turning_span(t->pf, t->vf, t->r0, t->v0, tmp2, rho, d);
            if (!tree_turning) {
#pragma omp simd
                for (int64_t q = 0; q < d; q++)
                    tmp2[q] = sub_sum[q] + q0[q];
                tree_turning = turning_span(t->q0, t->w0, np, nv, tmp2, rho, d);
            }
        }
        memcpy(tree_sum, tmp, sizeof(float) * d);
    }
    const int done = stop || tree_turning || (merge && k + 1 >= depth);
    if (merge && !done)
        t->k = k + 1;
    t->n = end ? 0 : n + 1;

    /* integration continues from the new point (a non-finite one ends the tree anyway) */
    if (finite) {
        SWAP(t->x, t->nx);
        SWAP(t->p, t->np);
        SWAP(t->g, t->ng);
        SWAP(t->v, t->nv);
        t->u = nu;
    }
    t->diverged |= divergent;
    t->turned |= sub_turning || tree_turning;
    return done;
}

/* advances a chain's transition until it needs E and the gradient at nx (1) or is done (0) */
static int tree_run(tree_t *t, const nuts_args_t *a) {
    for (;;) {
        if (integrate(t, a))
            return 1;
        if (step_finish(t, a))
            return 0;
        t->i++;
        step_start(t, a);
    }
}

/* the transition's result and info, into row c of the outputs */
static void tree_output(const tree_t *t, const nuts_args_t *a, int64_t c) {
    /* (a row of (transition, chain) when several transitions run: row = transition * n_chains + chain) */
    const int64_t d = a->d;
    memcpy(a->x_out + c * d, t->px, sizeof(float) * d);
    memcpy(a->g_out + c * d, t->pg, sizeof(float) * d);
    a->e_out[c] = t->pu;
    a->accept[c] = t->accept_sum / (float)(t->steps > 1 ? t->steps : 1);
    a->energy_error[c] = t->ph - t->h0;
    a->divergent[c] = (int8_t)t->diverged;
    a->turning[c] = (int8_t)t->turned;
    a->tree_depth[c] = t->k + 1;
    a->n_steps[c] = t->steps;
}

static void tree_begin(tree_t *t, const nuts_args_t *a, int64_t c, float *buf) {
    tree_setup(t, a, c, buf);
    tree_start(t, a, a->x_in + c * a->d, a->e_in[c], a->g_in + c * a->d,
               (uint32_t)a->keys[c * a->key_stride_c], (uint32_t)a->keys[c * a->key_stride_c + a->key_stride_w]);
    step_start(t, a);
}

static void transition(const nuts_args_t *a, int64_t c, float *buf, const int family) {
    tree_t t;
    tree_begin(&t, a, c, buf);
    while (tree_run(&t, a))
        t.nu = energy_grad_any(family, a->scalars, a->vectors, a->d, t.nx, t.ng, t.tmp);
    tree_output(&t, a, c);
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


/* A user's energy: every chain's transitions advance between evaluations that the caller makes in
 * torch, for all chains at once. fnebm_nuts_begin starts every chain and writes, row by row, the
 * point whose energy and gradient each chain needs next into `pending` (n_chains x d);
 * fnebm_nuts_resume takes E and the gradient at those points, advances every chain that was
 * waiting, writes the next points and returns how many chains still wait (0: the outputs are
 * written). With n_trans > 1 each chain runs n_trans transitions one after another, the next
 * from the last one's result with the keys of its row (keys + t * key_stride_t), without waiting
 * for the other chains' trees: the outputs are (n_trans, n_chains) rows. A finished chain's row of
 * `pending` holds its result, so the caller can evaluate every row. The context keeps the
 * arguments' pointers: the tensors behind them must live until fnebm_nuts_end. */
/* Window adaptation's iterations (fnebm.adaptation.window), run by fnebm_nuts_adapt_begin: every chain
 * takes iteration t's transition with the step size and metric in force, then (all chains done: the
 * pooled statistics need every chain) dual averaging (fnebm/adaptation/step_size.py's update) and, in
 * a slow window, Welford's update (mass_matrix.py's) run here, in float32, in torch's order of
 * operations (torch's sqrt and exp are not C's, and a sum over many chains may add in another order: the
 * last bit can differ). A window's end returns to Python, which
 * computes the new metric and restarts dual averaging (mass_matrix.final, step_size.init) in torch
 * and writes them into these buffers. The step size of the next iteration is exp(log_step_size). */
typedef struct {
    int64_t n_da;             /* step sizes: 1 (pooled) or n_chains */
    int64_t n_w;              /* Welford statistics: 1 (pooled) or n_chains */
    const int8_t *slow, *end; /* per iteration of the call: the draw feeds the statistic; it ends a window */
    double target, t0, gamma, kappa; /* Python floats: used as torch uses them (float32, pow in double) */
    float *da;                /* 5 x n_da: log_step_size, log_step_size_avg, avg_error, mu, count */
    float *h;                 /* n_da: the step size in use (the args' h_ptr) */
    float *w_mean, *w_m2, *w_count; /* n_w x d, n_w x d (x d when dense), 1 */
    const float *imm;         /* n_w x d (x d): the metric in use (the args' imm) */
    /* per iteration t of the call, written once it is done: the warm-up's state after it */
    float *hist_da, *hist_h, *hist_mean, *hist_m2, *hist_count, *hist_imm; /* hist_h: the step size after t */
    int64_t *at;              /* the iteration that ended a window, when a call returns -1 */
} adapt_args_t;

typedef struct {
    nuts_args_t a;
    tree_t *trees;
    float *bufs;
    int8_t *waiting;
    int64_t *trans; /* each chain's transition */
    int64_t stride, n_trans, key_stride_t;
    int adapt;      /* iterations of window adaptation (ad), all chains at one iteration */
    adapt_args_t ad;
    float *scratch; /* 2 d floats for Welford's update */
} nuts_ctx_t;

void fnebm_nuts_end(void *ctx) {
    nuts_ctx_t *s = (nuts_ctx_t *)ctx;
    if (s == NULL)
        return;
    free(s->trees);
    free(s->bufs);
    free(s->waiting);
    free(s->trans);
    free(s->scratch);
    free(s);
}

static int64_t advance_all(nuts_ctx_t *s, float *pending) {
    const nuts_args_t *a = &s->a;
    const int64_t n = a->n_chains, d = a->d;
    int64_t left = 0;
    for (int64_t c = 0; c < n; c++) {
        if (!s->waiting[c])
            continue;
        tree_t *t = s->trees + c;
        for (;;) {
            if (tree_run(t, a)) {
                memcpy(pending + c * d, t->nx, sizeof(float) * d);
                left++;
                break;
            }
            tree_output(t, a, s->trans[c] * n + c);
            if (++s->trans[c] >= s->n_trans || s->adapt) {
                memcpy(pending + c * d, t->px, sizeof(float) * d);
                s->waiting[c] = 0;
                break;
            }
            /* the next transition from this one's result (tree_start reads px and pg before it writes them) */
            const int64_t *k = a->keys + s->trans[c] * s->key_stride_t + c * a->key_stride_c;
            tree_start(t, a, t->px, t->pu, t->pg, (uint32_t)k[0], (uint32_t)k[a->key_stride_w]);
            step_start(t, a);
        }
    }
    return left;
}

/* the transitions every chain has finished, summed over chains */
int64_t fnebm_nuts_done(void *ctx) {
    const nuts_ctx_t *s = (const nuts_ctx_t *)ctx;
    int64_t done = 0;
    for (int64_t c = 0; c < s->a.n_chains; c++)
        done += s->trans[c];
    return done;
}

/* NULL when the scratch could not be allocated; *left: the chains that wait for an evaluation */
void *fnebm_nuts_begin(const nuts_args_t *a, int64_t n_trans, int64_t key_stride_t, float *pending, int64_t *left) {
    nuts_ctx_t *s = (nuts_ctx_t *)calloc(1, sizeof(nuts_ctx_t));
    if (s == NULL)
        return NULL;
    s->a = *a;
    s->n_trans = n_trans > 0 ? n_trans : 1;
    s->key_stride_t = key_stride_t;
    s->stride = (scratch_floats(a->d, a->depth) + 15) / 16 * 16;
    const int64_t n = a->n_chains > 0 ? a->n_chains : 1;
    s->trees = (tree_t *)calloc((size_t)n, sizeof(tree_t));
    s->bufs = (float *)aligned_alloc(64, sizeof(float) * (size_t)(s->stride * n));
    s->waiting = (int8_t *)malloc((size_t)n);
    s->trans = (int64_t *)calloc((size_t)n, sizeof(int64_t));
    if (s->trees == NULL || s->bufs == NULL || s->waiting == NULL || s->trans == NULL) {
        fnebm_nuts_end(s);
        return NULL;
    }
    for (int64_t c = 0; c < a->n_chains; c++) {
        tree_begin(s->trees + c, &s->a, c, s->bufs + c * s->stride);
        s->waiting[c] = 1;
    }
    *left = advance_all(s, pending);
    return s;
}

/* energy: (n_chains,), grad: (n_chains, d) at the rows of `pending` fnebm_nuts_begin or the last
 * call wrote; returns the chains that still wait */
static void take_evaluation(nuts_ctx_t *s, const float *energy, const float *grad) {
    const int64_t d = s->a.d;
    for (int64_t c = 0; c < s->a.n_chains; c++) {
        if (!s->waiting[c])
            continue;
        memcpy(s->trees[c].ng, grad + c * d, sizeof(float) * d);
        s->trees[c].nu = energy[c];
    }
}

int64_t fnebm_nuts_resume(void *ctx, const float *energy, const float *grad, float *pending) {
    nuts_ctx_t *s = (nuts_ctx_t *)ctx;
    take_evaluation(s, energy, grad);
    return advance_all(s, pending);
}


/* torch's safe_acceptance: NaN -> 0, +inf -> 1, clamped to [0, 1] */
static inline float safe_accept(float x) {
    if (isnan(x))
        return 0.0f;
    return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x);
}

/* iteration t is done for every chain: dual averaging, Welford in a slow window, and the history */
static void adapt_update(nuts_ctx_t *s, int64_t t) {
    const nuts_args_t *a = &s->a;
    adapt_args_t *ad = &s->ad;
    const int64_t n = a->n_chains, d = a->d, nda = ad->n_da, nw = ad->n_w;
    const float *acc_row = a->accept + t * n, *x_row = a->x_out + t * n * d;
    const int64_t m_el = a->dense ? d * d : d;
    /* Welford (mass_matrix.update): pooled, the chains are one batch of n_b = n draws */
    if (ad->slow[t]) {
        const int64_t nb = n / nw;
        const float na = ad->w_count[0];
        const float nn = na + (float)nb;
        const float frac = (1.0f / nn) * (float)nb;  /* n_b / n: torch's reciprocal, then the product */
        const float weight = na * (float)nb / nn;
        float *mb = s->scratch;
        float *delta = mb + d;
        for (int64_t k = 0; k < nw; k++) {
            const float *xk = x_row + k * nb * d;
            float *mean = ad->w_mean + k * d, *m2 = ad->w_m2 + k * m_el;
            for (int64_t j = 0; j < d; j++) {
                float sum = 0.0f;
                for (int64_t c = 0; c < nb; c++)
                    sum += xk[c * d + j];
                mb[j] = sum / (float)nb;
                delta[j] = mb[j] - mean[j];
            }
            if (!a->dense) {
                for (int64_t j = 0; j < d; j++) {
                    float ss = 0.0f;
                    for (int64_t c = 0; c < nb; c++) {
                        const float z = xk[c * d + j] - mb[j];
                        ss += z * z;
                    }
                    m2[j] = (m2[j] + ss) + delta[j] * delta[j] * weight;
                }
            } else {
                for (int64_t i = 0; i < d; i++)
                    for (int64_t j = 0; j < d; j++) {
                        float ss = 0.0f;
                        for (int64_t c = 0; c < nb; c++)
                            ss += (xk[c * d + i] - mb[i]) * (xk[c * d + j] - mb[j]);
                        m2[i * d + j] = (m2[i * d + j] + ss) + delta[i] * delta[j] * weight;
                    }
            }
            for (int64_t j = 0; j < d; j++)
                mean[j] = mean[j] + delta[j] * frac;
        }
        ad->w_count[0] = nn;
    }
    /* dual averaging (step_size.update), each step size on the mean statistic of its chains */
    const int64_t per = n / nda;
    for (int64_t k = 0; k < nda; k++) {
        float acc = 0.0f;
        for (int64_t c = 0; c < per; c++)
            acc += safe_accept(acc_row[k * per + c]);
        if (per > 1)
            acc = acc / (float)per;
        float *log_h = ad->da + k, *log_h_avg = ad->da + nda + k, *err = ad->da + 2 * nda + k;
        const float mu = ad->da[3 * nda + k];
        float *count = ad->da + 4 * nda + k;
        const float tt = *count + 1.0f;
        const float eta = 1.0f / (tt + (float)ad->t0);
        *err = (1.0f - eta) * *err + eta * ((float)ad->target - acc);
        *log_h = mu - sqrtf(tt) / (float)ad->gamma * *err;
        /* t ** -kappa: torch raises a float32 0-dim tensor to a Python float in double, then rounds */
        const float w = (float)pow((double)tt, -ad->kappa);
        *log_h_avg = w * *log_h + (1.0f - w) * *log_h_avg;
        *count = tt;
        ad->h[k] = expf(*log_h);
    }
}

/* the state after iteration t, into the history (after a window's end, once Python has written it) */
static void adapt_record(nuts_ctx_t *s, int64_t t) {
    const nuts_args_t *a = &s->a;
    adapt_args_t *ad = &s->ad;
    const int64_t d = a->d, nda = ad->n_da, nw = ad->n_w, m_el = a->dense ? d * d : d;
    memcpy(ad->hist_da + t * 5 * nda, ad->da, sizeof(float) * 5 * nda);
    memcpy(ad->hist_h + t * nda, ad->h, sizeof(float) * nda); /* the step size of iteration t + 1 */
    memcpy(ad->hist_mean + t * nw * d, ad->w_mean, sizeof(float) * nw * d);
    memcpy(ad->hist_m2 + t * nw * m_el, ad->w_m2, sizeof(float) * nw * m_el);
    ad->hist_count[t] = ad->w_count[0];
    memcpy(ad->hist_imm + t * nw * m_el, ad->imm, sizeof(float) * nw * m_el);
}

/* every chain starts iteration t (its key row), from the last one's result, with the step size in use */
static void adapt_start(nuts_ctx_t *s, int64_t t) {
    const nuts_args_t *a = &s->a;
    for (int64_t c = 0; c < a->n_chains; c++) {
        tree_t *tr = s->trees + c;
        tr->h = a->h_ptr[c * a->h_stride];
        const int64_t *k = a->keys + t * s->key_stride_t + c * a->key_stride_c;
        tree_start(tr, a, tr->px, tr->pu, tr->pg, (uint32_t)k[0], (uint32_t)k[a->key_stride_w]);
        step_start(tr, a);
        s->waiting[c] = 1;
    }
}

/* advance until some chain waits for an evaluation (> 0), a window ends (-1: *at is the iteration;
 * Python writes the new metric and dual averaging, then calls fnebm_nuts_adapt_next), or every
 * iteration is done (0) */
static int64_t adapt_run(nuts_ctx_t *s, float *pending) {
    for (;;) {
        const int64_t left = advance_all(s, pending);
        if (left)
            return left;
        const int64_t t = s->trans[0] - 1; /* every chain finished iteration t */
        adapt_update(s, t);
        if (s->ad.end[t]) {
            *s->ad.at = t;
            return -1;
        }
        adapt_record(s, t);
        if (t + 1 >= s->n_trans)
            return 0;
        adapt_start(s, t + 1);
    }
}

/* n_iter iterations of window adaptation (adapt_args_t): as fnebm_nuts_begin, with a return of -1 at a
 * window's end. The args' h_ptr and imm/mfac must be ad->h and the metric buffers Python rewrites. */
void *fnebm_nuts_adapt_begin(const nuts_args_t *a, const adapt_args_t *ad, int64_t n_iter, int64_t key_stride_t,
                             float *pending, int64_t *left) {
    nuts_ctx_t *s = (nuts_ctx_t *)fnebm_nuts_begin(a, 0, key_stride_t, pending, left); /* starts iteration 0 */
    if (s == NULL)
        return NULL;
    s->scratch = (float *)malloc(sizeof(float) * (size_t)(2 * (a->d > 0 ? a->d : 1)));
    if (s->scratch == NULL) {
        fnebm_nuts_end(s);
        return NULL;
    }
    /* fnebm_nuts_begin ran with n_trans = 1 (a finished chain stopped); the call runs n_iter */
    s->n_trans = n_iter > 0 ? n_iter : 1;
    s->adapt = 1;
    s->ad = *ad;
    if (*left == 0)
        *left = adapt_run(s, pending);
    return s;
}

/* after a window's end (-1): record iteration *at's state as Python left it, start the next */
int64_t fnebm_nuts_adapt_next(void *ctx, float *pending) {
    nuts_ctx_t *s = (nuts_ctx_t *)ctx;
    const int64_t t = *s->ad.at;
    adapt_record(s, t);
    if (t + 1 >= s->n_trans)
        return 0;
    adapt_start(s, t + 1);
    return adapt_run(s, pending);
}

/* as fnebm_nuts_resume, in a warm-up: the evaluation, then on (-1 at a window's end) */
int64_t fnebm_nuts_adapt_resume(void *ctx, const float *energy, const float *grad, float *pending) {
    nuts_ctx_t *s = (nuts_ctx_t *)ctx;
    take_evaluation(s, energy, grad);
    return adapt_run(s, pending);
}
