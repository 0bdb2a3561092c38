/* Whole chains of unadjusted Langevin or MALA for separable analytic energies, on the CPU.
 *
 * The C counterpart of fnebm/kernels/langevin_chain.py's Triton kernel: a block of CB chains
 * keeps its positions and gradients in small arrays (one vector register per element across the
 * block) and runs every step: the step's key fold_in(keys[c], t) (MALA: split into the noise's and
 * the uniform's keys), the noise normal(key, (d,)) of the fnebm.random stream (Philox4x32-10,
 * Box-Muller on lanes (0, 1) and (2, 3), element i lane i // m of block i % m), the energy and
 * gradient in closed form at the proposal, the divergence check, MALA's accept/reject, and the
 * kept draws written straight into the trace.
 *
 * Built by fnebm/kernels/cpu_chain.py with the system C compiler (-O2 -march=native -fopenmp; log,
 * exp, sin and cos are Cephes' polynomials in _cpu_common.h, written so that GCC vectorises them) and called
 * through ctypes, which releases the GIL. What it computes is fnebm.langevin's and fnebm.mala's steps
 * (tests/test_cpu_chain.py runs both from the same keys).
 */
#include "_cpu_common.h"

/* out[r] = sum_k in[k] L[k * k_stride + r * r_stride] for a block of CB chains (rows of CB floats);
 * all of L: after training a Gaussian's factor need not be triangular */
static inline __attribute__((always_inline)) void block_matvec(float *restrict out, const float *restrict in,
                                                               const float *restrict L, int64_t d,
                                                               int64_t k_stride, int64_t r_stride) {
    for (int64_t r = 0; r < d; r++) {
        float acc[CB];
        for (int j = 0; j < CB; j++)
            acc[j] = 0.0f;
        for (int64_t k = 0; k < d; k++) {
            const float l = L[k * k_stride + r * r_stride];
#pragma omp simd
            for (int j = 0; j < CB; j++)
                acc[j] += in[k * CB + j] * l;
        }
        for (int j = 0; j < CB; j++)
            out[r * CB + j] = acc[j];
    }
}

typedef struct {
    int64_t n_chains, d, key_stride_c, key_stride_w, start, h_stride, s_stride;
    const float *x_in, *e_in, *g_in, *h_ptr, *s_ptr, *scalars, *vectors;
    const int64_t *keys;
    int64_t n_total, first, thin, n_keep, j0;
    float *x_out, *e_out, *g_out, *trace;
    int8_t *div;
    float *rate;  /* MALA: the acceptance rate of each kept step */
    int8_t *acc;  /* MALA: whether it was accepted */
    float *e_trace; /* the energy at each kept step (draws, n_chains), or NULL */
} args_t;

/* every step of the chains c0 .. c0 + CB - 1 (those past n_chains run on zeros, never stored);
 * buf: 6 d CB floats of scratch. Inlined with a constant family, so each family's loops
 * vectorise on their own. */
static inline __attribute__((always_inline)) void run_block(const args_t *a, int64_t c0, float *buf,
                                                            const int family, const int mala) {
    const int64_t d = a->d, m = (d + 3) / 4, n_chains = a->n_chains;
    float *restrict x = buf, *restrict g = buf + d * CB, *restrict z = buf + 2 * d * CB,
                    *restrict nb = buf + 3 * d * CB, *restrict dl = buf + 4 * d * CB, *restrict yv = buf + 5 * d * CB;
    float e[CB], h[CB], sc[CB];
    uint32_t k0[CB], k1[CB];
    int32_t take[CB], ok[CB];
    float rate[CB], logu[CB];
    const int64_t nc = n_chains - c0 < CB ? n_chains - c0 : CB;
    for (int64_t j = 0; j < CB; j++) {
        int live = j < nc;
        int64_t c = c0 + j;
        e[j] = live ? a->e_in[c] : 0.0f;
        h[j] = live ? a->h_ptr[c * a->h_stride] : 1.0f;
        sc[j] = (live ? a->s_ptr[c * a->s_stride] : 1.0f) * sqrtf(2.0f * h[j]);
        k0[j] = live ? (uint32_t)a->keys[c * a->key_stride_c] : 0u;
        k1[j] = live ? (uint32_t)a->keys[c * a->key_stride_c + a->key_stride_w] : 0u;
        for (int64_t i = 0; i < d; i++) {
            x[i * CB + j] = live ? a->x_in[c * d + i] : 0.0f;
            g[i * CB + j] = live ? a->g_in[c * d + i] : 0.0f;
        }
    }
    const float pa = a->scalars[0], pb = a->scalars[1];
    const int64_t trace_stride = n_chains * d;
    for (int64_t s = 0; s < a->n_total; s++) {
        const uint64_t t = (uint64_t)(a->start + s);
        uint32_t sk0[CB], sk1[CB], w[4][CB];
        for (int j = 0; j < CB; j++) { /* fold_in(key, t) */
            w[0][j] = (uint32_t)t;
            w[1][j] = (uint32_t)(t >> 32);
            w[2][j] = FOLD_TAG;
            w[3][j] = 0;
        }
        philox_lanes(w, k0, k1);
        memcpy(sk0, w[0], sizeof sk0);
        memcpy(sk1, w[1], sizeof sk1);
        if (mala) { /* split(key): words 0-1 the noise's key, 2-3 the uniform's; log uniform(k1, ()) */
            for (int j = 0; j < CB; j++) {
                w[0][j] = w[1][j] = w[3][j] = 0;
                w[2][j] = SPLIT_TAG;
            }
            philox_lanes(w, sk0, sk1);
            uint32_t uk0[CB], uk1[CB], v[4][CB];
            memcpy(sk0, w[0], sizeof sk0);
            memcpy(sk1, w[1], sizeof sk1);
            memcpy(uk0, w[2], sizeof uk0);
            memcpy(uk1, w[3], sizeof uk1);
            memset(v, 0, sizeof v);
            philox_lanes(v, uk0, uk1);
#pragma omp simd
            for (int j = 0; j < CB; j++) {
                float u = to_unit(v[0][j]);
                uint32_t is0 = 0u - (uint32_t)(u == 0.0f); /* log 0 = -inf */
                logu[j] = as_f32((as_u32(vlogf(u)) & ~is0) | (as_u32(-INFINITY) & is0));
            }
        }
        for (int64_t b = 0; b < m; b++) { /* normal(key, (d,)): Philox block b, lanes to b, b + m, ... */
            uint32_t q[4][CB];
            float o0[CB], o1[CB], o2[CB], o3[CB];
            for (int j = 0; j < CB; j++) {
                q[0][j] = (uint32_t)b;
                q[1][j] = (uint32_t)((uint64_t)b >> 32);
                q[2][j] = q[3][j] = 0;
            }
            philox_lanes(q, sk0, sk1);
            const uint32_t *q0 = q[0], *q1 = q[1], *q2 = q[2], *q3 = q[3];
#pragma omp simd
            for (int j = 0; j < CB; j++) { /* Box-Muller on lanes (0, 1) and (2, 3) */
                float r0 = sqrtf(-2.0f * vlogf(floor_unit(to_unit(q0[j]))));
                float r1 = sqrtf(-2.0f * vlogf(floor_unit(to_unit(q2[j]))));
                float s0, cs0, s1, cs1;
                VSINCOSF(TWO_PI * to_unit(q1[j]), s0, cs0);
                VSINCOSF(TWO_PI * to_unit(q3[j]), s1, cs1);
                o0[j] = r0 * cs0;
                o1[j] = r0 * s0;
                o2[j] = r1 * cs1;
                o3[j] = r1 * s1;
            }
            const float *o[4] = {o0, o1, o2, o3};
            for (int lane = 0; lane < 4; lane++) {
                int64_t i = lane * m + b;
                if (i < d)
                    memcpy(z + i * CB, o[lane], sizeof(float) * CB);
            }
        }
        float acc[CB], quad[CB];
        int32_t bad[CB], badp[CB];
        for (int j = 0; j < CB; j++) {
            acc[j] = 0.0f;
            quad[j] = 0.0f;
            bad[j] = 0;
            badp[j] = 0;
        }
        if (family == GAUSSIAN_FULL) {
            /* 0.5 |L^T (x - mean)|^2 and its gradient L (L^T (x - mean)), as fnebm.energies.Gaussian
             * computes them: y = delta @ L, then grad = y @ L^T (vectors: mean (d), then L row-major) */
            const float *mean = a->vectors, *L = a->vectors + d;
            for (int64_t i = 0; i < d; i++) {
#pragma omp simd
                for (int j = 0; j < CB; j++) {
                    float p = x[i * CB + j] - h[j] * g[i * CB + j] + sc[j] * z[i * CB + j];
                    badp[j] |= !(fabsf(p) <= FLT_BIG);
                    z[i * CB + j] = p;
                    dl[i * CB + j] = p - mean[i];
                }
            }
            block_matvec(yv, dl, L, d, d, 1); /* y_c = sum_i delta_i L[i][c] */
            for (int64_t c = 0; c < d; c++) {
#pragma omp simd
                for (int j = 0; j < CB; j++)
                    acc[j] += yv[c * CB + j] * yv[c * CB + j];
            }
            block_matvec(nb, yv, L, d, 1, d); /* grad_i = sum_c y_c L[i][c] */
            for (int64_t i = 0; i < d; i++) {
#pragma omp simd
                for (int j = 0; j < CB; j++) {
                    float n = nb[i * CB + j];
                    bad[j] |= !(fabsf(n) <= FLT_BIG);
                    if (mala) {
                        float fw = z[i * CB + j] - x[i * CB + j] + h[j] * g[i * CB + j];
                        float bw = x[i * CB + j] - z[i * CB + j] + h[j] * n;
                        quad[j] += fw * fw - bw * bw;
                    }
                }
            }
        } else
        for (int64_t i = 0; i < d; i++) {
            float va = pa, vb = pb, vc = pb;
            if (family == GAUSSIAN) {
                va = a->vectors[i];
                vb = a->vectors[d + i];
                vc = a->vectors[2 * d + i];
            }
#pragma omp simd
            for (int j = 0; j < CB; j++) {
                /* fnebm.integrators.euler_maruyama, then the energy's closed forms */
                float p = x[i * CB + j] - h[j] * g[i * CB + j] + sc[j] * z[i * CB + j];
                float q, n;
                separable_term(family, p, va, vb, vc, &q, &n);
                acc[j] += q;
                bad[j] |= !(fabsf(n) <= FLT_BIG);
                badp[j] |= !(fabsf(p) <= FLT_BIG);
                if (mala) { /* fnebm.samplers.mala.log_acceptance_ratio's proposal densities */
                    float fw = p - x[i * CB + j] + h[j] * g[i * CB + j];
                    float bw = x[i * CB + j] - p + h[j] * n;
                    quad[j] += fw * fw - bw * bw;
                }
                z[i * CB + j] = p;
                nb[i * CB + j] = n;
            }
        }
#pragma omp simd
        for (int j = 0; j < CB; j++) {
            float v = separable_energy(family, acc[j], pa, d);
            int32_t finite = !bad[j] & (fabsf(v) <= FLT_BIG);
            if (mala) { /* metropolis_hastings: a non-finite energy, gradient or log alpha is rejected */
                float la = e[j] - v + quad[j] / (4.0f * h[j]);
                ok[j] = finite & (fabsf(la) <= FLT_BIG);
                la = ok[j] ? la : -INFINITY;
                take[j] = logu[j] < la;
                rate[j] = vexpf(fminf(la, 0.0f));
            } else { /* a non-finite move is dropped */
                take[j] = finite & !badp[j];
                ok[j] = take[j];
            }
            e[j] = take[j] ? v : e[j];
        }
        for (int64_t i = 0; i < d; i++) {
#pragma omp simd
            for (int j = 0; j < CB; j++) {
                x[i * CB + j] = take[j] ? z[i * CB + j] : x[i * CB + j];
                g[i * CB + j] = take[j] ? nb[i * CB + j] : g[i * CB + j];
            }
        }
        int64_t k = s - a->first;
        if (k >= 0 && k % a->thin == 0 && k / a->thin < a->n_keep) {
            int64_t draw = a->j0 + k / a->thin;
            float *row = a->trace + draw * trace_stride + c0 * d;
            for (int64_t j = 0; j < nc; j++)
                for (int64_t i = 0; i < d; i++)
                    row[j * d + i] = x[i * CB + j];
            for (int64_t j = 0; j < nc; j++)
                a->div[draw * n_chains + c0 + j] = !ok[j];
            if (a->e_trace != NULL)
                for (int64_t j = 0; j < nc; j++)
                    a->e_trace[draw * n_chains + c0 + j] = e[j];
            if (mala)
                for (int64_t j = 0; j < nc; j++) {
                    a->rate[draw * n_chains + c0 + j] = rate[j];
                    a->acc[draw * n_chains + c0 + j] = take[j] != 0;
                }
        }
    }
    for (int64_t j = 0; j < nc; j++) {
        int64_t c = c0 + j;
        a->e_out[c] = e[j];
        for (int64_t i = 0; i < d; i++) {
            a->x_out[c * d + i] = x[i * CB + j];
            a->g_out[c * d + i] = g[i * CB + j];
        }
    }
}

/* The file is compiled twice, in parallel: -DFNEBM_MALA=0 gives fnebm_langevin_chain, -DFNEBM_MALA=1
 * fnebm_mala_chain (each holds a specialised copy of run_block per family). */
#ifndef FNEBM_MALA
#error "compile with -DFNEBM_MALA=0 (Langevin) or -DFNEBM_MALA=1 (MALA)"
#endif
#if FNEBM_MALA
#define ENTRY fnebm_mala_chain
#else
#define ENTRY fnebm_langevin_chain
#endif

/* Returns 0, or -1 when a thread could not allocate its scratch (nothing is then valid). */
int ENTRY(const args_t *a, int family, int n_threads) {
    const int64_t n_blocks = (a->n_chains + CB - 1) / CB;
    int failed = 0;
#pragma omp parallel num_threads(n_threads)
    {
        float *buf = (float *)aligned_alloc(64, sizeof(float) * 6 * (size_t)(a->d * CB));
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4) /* blocks of 64 chains: a thread on a busy core takes fewer */
        for (int64_t blk = 0; blk < n_blocks; blk++) {
            if (buf == NULL)
                continue;
            int64_t c0 = blk * CB;
            /* one specialised copy of run_block per family */
#define FNEBM_RUN(NAME, ID, TERM, TOTAL) if (family == NAME) run_block(a, c0, buf, NAME, FNEBM_MALA); else
            FNEBM_SEPARABLE(FNEBM_RUN)
            run_block(a, c0, buf, GAUSSIAN_FULL, FNEBM_MALA);
#undef FNEBM_RUN
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
