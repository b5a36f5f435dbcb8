/* grpo_kernels._cpu_rows: the fused CPU row kernels of the GRPO loss (ops/cpu_rows.py is the Python side).
 *
 * Plain C on raw pointers, so that building it needs a C compiler and Python's headers only (no torch): the Python
 * side passes data pointers, sizes and strides of tensors it has validated. Rows are spread over OpenMP threads (the
 * count is passed in: torch.get_num_threads()); each row is vectorized along the vocabulary in 16-float vectors
 * (GCC/clang vector extensions) with a branch-free exp. On x86-64 the hot functions are compiled for AVX-512,
 * AVX2+FMA and the baseline, picked at load time (target_clones).
 *
 * Precision, as ops/torch_rows.py: every logit is taken relative to the row's raw maximum, z = (x − max)/τ; the
 * sums run over v != y so that 1 − p_y = Σ_{v≠y} e / Σ e has no cancellation; H = log Σe − Σ e·z / Σe. Sums are
 * taken in fp32 SIMD lanes over blocks of SUM_BLOCK elements and in double across blocks. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#define NOINLINE __attribute__((noinline))
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif
#define SUM_BLOCK 1024

/* ------------------------------------------------------------------------------------------------------------ */
/* Scalar and vector helpers: the scalar ones serve the ragged ends of rows, with the same arithmetic */

typedef union {
    float f;
    uint32_t u;
    int32_t i;
} Bits;

static ALWAYS_INLINE float bits_to_float(uint32_t u) {
    Bits b;
    b.u = u;
    return b.f;
}

static ALWAYS_INLINE uint32_t float_to_bits(float f) {
    Bits b;
    b.f = f;
    return b.u;
}

/* exp(x) within about 2 ulp (Cephes' expf polynomial, Cody-Waite reduction), branch-free. NaN gives NaN, −inf and
 * anything below −87 give 0 (exp(−87) = 1.6e-38: the subnormal tail is dropped rather than computed slowly). Every
 * argument here is a logit minus the row's max (or log-sum), so <= 0 up to rounding; there is no overflow branch,
 * and x > 88.7 would give garbage. */
static ALWAYS_INLINE float exp_ps(float x) {
    float xc = x < -87.0f ? -87.0f : x;
    float kf = xc * 1.44269504088896341f + 12582912.0f; /* + 1.5·2^23: round to an integer in the low bits */
    int32_t n = (int32_t)float_to_bits(kf) - 0x4B400000;
    kf -= 12582912.0f;
    float r = xc - kf * 0.693359375f;
    r = r - kf * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * (r * r) + r + 1.0f;
    y *= bits_to_float((uint32_t)(n + 127) << 23);
    return x < -87.0f ? 0.0f : y; /* a NaN x fails the comparison and keeps y, which is NaN */
}

/* The same exp on LANES floats at once, in GCC/clang vector extensions: the compiler lowers a 64-byte vector to one
 * AVX-512 register, two AVX2 ones or four SSE ones, whichever the clone being compiled has. */
#define LANES 16
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));
typedef uint16_t vu16 __attribute__((vector_size(2 * LANES)));

static ALWAYS_INLINE vf vf_splat(float x) { return (vf){} + x; }

static ALWAYS_INLINE vf vsel(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

static ALWAYS_INLINE double vf_sum(vf v) {
    double s = 0.0;
    for (int j = 0; j < LANES; j++) s += v[j];
    return s;
}

static ALWAYS_INLINE float vf_max(vf v) {
    float m = v[0];
    for (int j = 1; j < LANES; j++) m = v[j] > m ? v[j] : m;
    return m;
}

static ALWAYS_INLINE vf vexp(vf x) {
    vf xc = vsel(x < -87.0f, vf_splat(-87.0f), x);
    vf kf = xc * 1.44269504088896341f + 12582912.0f;
    vi n = (vi)kf - 0x4B400000;
    kf -= 12582912.0f;
    vf r = xc - kf * 0.693359375f;
    r = r - kf * -2.12194440e-4f;
    vf p = vf_splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    vf y = p * (r * r) + r + 1.0f;
    y *= (vf)((n + 127) << 23);
    return vsel(x < -87.0f, vf_splat(0.0f), y);
}

static ALWAYS_INLINE vf vload_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static ALWAYS_INLINE void vstore_f32(float *p, vf v) { memcpy(p, &v, sizeof v); }

static ALWAYS_INLINE vf vload_bf16(const uint16_t *p) {
    vu16 h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

static ALWAYS_INLINE void vstore_bf16(uint16_t *p, vf v) {
    vu u = (vu)v;
    vu rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    vu bits = (vu)vsel(v != v, (vf)(vu){} + 0x7FC0u, (vf)rounded); /* NaN stays a quiet NaN */
    vu16 h = __builtin_convertvector(bits, vu16);
    memcpy(p, &h, sizeof h);
}

static ALWAYS_INLINE float load_bf16(const uint16_t *p, int64_t i) { return bits_to_float((uint32_t)p[i] << 16); }

static ALWAYS_INLINE void store_bf16(uint16_t *p, int64_t i, float v) {
    uint32_t u = float_to_bits(v);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16; /* round to nearest even */
    p[i] = (uint16_t)(v != v ? 0x7FC0u : rounded);
}

/* fp16 through the compiler's _Float16 where it has one (F16C instructions on x86-64-v3 and up, NEON on aarch64),
 * else by bit manipulation (F. Giesen's round-to-nearest-even conversions). */
#if defined(__FLT16_MAX__) && !defined(GRPO_SOFT_FP16)
typedef _Float16 half;
static ALWAYS_INLINE float load_f16(const half *p, int64_t i) { return (float)p[i]; }
static ALWAYS_INLINE void store_f16(half *p, int64_t i, float v) { p[i] = (half)v; }
typedef _Float16 vhalf __attribute__((vector_size(2 * LANES)));
static ALWAYS_INLINE vf vload_f16(const half *p) {
    vhalf h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, vf);
}
static ALWAYS_INLINE void vstore_f16(half *p, vf v) {
    vhalf h = __builtin_convertvector(v, vhalf);
    memcpy(p, &h, sizeof h);
}
#else
typedef uint16_t half;
static ALWAYS_INLINE float load_f16(const half *p, int64_t i) {
    uint32_t h = p[i], o = (h & 0x7FFFu) << 13, exp = o & (0x7C00u << 13);
    o += (uint32_t)(127 - 15) << 23;
    if (exp == 0x7C00u << 13) {
        o += (uint32_t)(128 - 16) << 23; /* inf / NaN */
    } else if (exp == 0) {
        o = float_to_bits(bits_to_float(o + (1u << 23)) - bits_to_float(113u << 23)); /* subnormal */
    }
    return bits_to_float(o | (h & 0x8000u) << 16);
}
static ALWAYS_INLINE void store_f16(half *p, int64_t i, float v) {
    uint32_t u = float_to_bits(v), sign = u & 0x80000000u, o;
    u ^= sign;
    if (u >= (uint32_t)(127 + 16) << 23) {
        o = u > 255u << 23 ? 0x7E00u : 0x7C00u; /* NaN, or overflow to inf */
    } else if (u < 113u << 23) {
        float magic = bits_to_float((uint32_t)((127 - 15) + (23 - 10) + 1) << 23);
        o = float_to_bits(bits_to_float(u) + magic) - float_to_bits(magic); /* subnormal or zero */
    } else {
        uint32_t odd = (u >> 13) & 1u;
        u += ((uint32_t)(15 - 127) << 23) + 0xFFFu + odd;
        o = u >> 13;
    }
    p[i] = (uint16_t)(o | sign >> 16);
}
static ALWAYS_INLINE vf vload_f16(const half *p) {
    vf v;
    for (int j = 0; j < LANES; j++) v[j] = load_f16(p, j);
    return v;
}
static ALWAYS_INLINE void vstore_f16(half *p, vf v) {
    for (int j = 0; j < LANES; j++) store_f16(p, j, v[j]);
}
#endif

/* ------------------------------------------------------------------------------------------------------------ */
/* The per-token coefficient g = ∂loss/∂ℓ of w·(ρ·L + β·kl): one of three copies, with loss_math.per_token_terms
 * (the definition) and triton_logits._token_coef (ops/coef.py manages the set; the scalars of Coef come in the order
 * of its FLOAT_FIELDS). Autograd's tie rules (clamp passes the gradient on the closed interval, min splits ties); a
 * NaN ratio stays NaN. */

typedef struct {
    const float *adv, *old, *ref, *rho, *w, *hw; /* [B·T] each, contiguous; old, ref, rho, hw may be NULL */
    int loss;                                     /* 0: the clipped family, 1: cispo, 2: sapo */
    int has_delta, bias_kl;
    float lo, hi, delta, eps_high, beta, sapo_pos, sapo_neg;
} Coef;

static float token_coef(const Coef *c, double lp, int64_t r) {
    /* ℓ comes in float64 (see fused_rows): ℓ − ℓ_old and ℓ_ref − ℓ are formed in float64, then rounded for exp */
    float adv = c->adv[r], w = c->w[r];
    double old = c->old ? (double)c->old[r] : lp; /* ℓ_old = sg(ℓ): the ratio is exactly 1 */
    float ratio = expf((float)(lp - old)), dl;
    if (c->loss == 0) {
        float rc = ratio < c->lo ? c->lo : (ratio > c->hi ? c->hi : ratio);
        float db = adv * ratio * (float)(ratio >= c->lo && ratio <= c->hi);
        float r1 = ratio, da = adv * ratio;
        if (c->has_delta) {
            r1 = ratio > c->delta ? c->delta : ratio;
            da = adv * ratio * (float)(ratio <= c->delta);
        }
        float ua = r1 * adv, ub = rc * adv;
        dl = -(ua < ub ? da : (ub < ua ? db : 0.5f * (da + db)));
    } else if (c->loss == 1) {
        dl = -(ratio > c->eps_high ? c->eps_high : ratio) * adv;
    } else {
        float ts = adv > 0 ? c->sapo_pos : c->sapo_neg;
        float e = expf(-fabsf(ts * (ratio - 1.0f)));
        dl = -4.0f * (e / ((1.0f + e) * (1.0f + e))) * ratio * adv;
    }
    if (c->rho) dl *= c->rho[r];
    if (c->ref) { /* k3: exp(ℓ_ref − ℓ) − (ℓ_ref − ℓ) − 1 */
        float diff = (float)((double)c->ref[r] - lp), ed = expf(diff), dkl = 1.0f - ed;
        if (c->bias_kl) dkl = (dkl + (ed - diff - 1.0f)) * ratio;
        dl += c->beta * dkl;
    }
    return w == 0.0f ? 0.0f : w * dl; /* a masked token contributes nothing, even with inf inputs */
}

/* ------------------------------------------------------------------------------------------------------------ */
/* One call's arguments: a (B, T, V) logits tensor (strides in elements, unit along V) and its row outputs. */

typedef struct {
    const void *x;
    void *out;
    int64_t T, V, sxb, sxt, sob, sot, offset;
    const int64_t *ids; /* [B·T] */
    float k;            /* 1/τ */
    double k64;         /* 1/τ in float64, for the float64 ℓ */
    double *logp;       /* [B·T]: ℓ, in float64 */
    float *ent;         /* [B·T] */
    float *state;       /* [B·T, 3] (shift, log Σe, 1 − p_y), or [B·T, 5] partials */
    const float *g, *h; /* [B·T]; h may be NULL */
    const Coef *coef;
} Rows;

#define ELEM float
#define SFX f32
#define LOAD(p, i) ((p)[i])
#define STORE(p, i, v) ((p)[i] = (v))
#define VLOAD(p) vload_f32(p)
#define VSTORE(p, v) vstore_f32(p, v)
#include "rows_impl.h"
#undef ELEM
#undef SFX
#undef LOAD
#undef STORE
#undef VLOAD
#undef VSTORE

#define ELEM uint16_t
#define SFX bf16
#define LOAD(p, i) load_bf16(p, i)
#define STORE(p, i, v) store_bf16(p, i, v)
#define VLOAD(p) vload_bf16(p)
#define VSTORE(p, v) vstore_bf16(p, v)
#include "rows_impl.h"
#undef ELEM
#undef SFX
#undef LOAD
#undef STORE
#undef VLOAD
#undef VSTORE

#define ELEM half
#define SFX f16
#define LOAD(p, i) load_f16(p, i)
#define STORE(p, i, v) store_f16(p, i, v)
#define VLOAD(p) vload_f16(p)
#define VSTORE(p, v) vstore_f16(p, v)
#include "rows_impl.h"
#undef ELEM
#undef SFX
#undef LOAD
#undef STORE
#undef VLOAD
#undef VSTORE

/* ------------------------------------------------------------------------------------------------------------ */
/* The fused-linear folds (ops/linear_folds_torch.py): one fp32 tile z [R, Vt] of x @ W_tileᵀ + b, before the 1/τ. */

typedef struct {
    float *z; /* [R, Vt] contiguous; overwritten by dz in fold_grad */
    int64_t Vt, v0;
    const int64_t *ids; /* [R] */
    float k;
    float *max, *sum_exp, *sum_exp_z, *target; /* fold_stats: the running statistics, [R] each */
    const float *lse, *mean_z, *g, *h;         /* fold_grad; mean_z and h may be NULL */
} Tile;

/* Σ e and Σ e·z' over one tile row, z' = z·k − shift (the order of the torch fold: scale, then shift). */
static ALWAYS_INLINE void tile_sums(const float *z, int64_t n, float k, float shift, double *s_out, double *t_out) {
    double s = 0.0, t = 0.0;
    vf vshift = vf_splat(shift), vk = vf_splat(k);
    int64_t i = 0;
    while (i + LANES <= n) {
        int64_t end = i + SUM_BLOCK < n ? i + SUM_BLOCK : n;
        vf sb = vf_splat(0.0f), tb = vf_splat(0.0f);
        for (; i + LANES <= end; i += LANES) {
            vf zi = vload_f32(z + i) * vk - vshift;
            vf e = vexp(zi);
            sb += e;
            tb += vsel(e > 0.0f, e * zi, vf_splat(0.0f));
        }
        s += vf_sum(sb);
        t += vf_sum(tb);
    }
    for (; i < n; i++) {
        float zi = z[i] * k - shift, e = exp_ps(zi);
        s += e;
        t += e > 0.0f ? e * zi : 0.0f;
    }
    *s_out = s;
    *t_out = t;
}

static NOINLINE CLONES void fold_stats_rows(const Tile *a, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const float *z = a->z + r * a->Vt;
        float k = a->k;
        float tile_max = row_max_f32(z, a->Vt) * k; /* rounding is monotone: max(z)·k == max(z·k) */
        float old = a->max[r];
        float new_max = tile_max > old ? tile_max : old;
        float shift = new_max == -INFINITY ? 0.0f : new_max; /* a row with only −inf so far stays at 0, not NaN */
        float rescale = expf(old - shift);
        float moved = a->sum_exp[r] > 0.0f ? old - shift : 0.0f;
        int64_t local = a->ids[r] - a->v0;
        if (local >= 0 && local < a->Vt) a->target[r] = z[local] * k;
        double s, t;
        tile_sums(z, a->Vt, k, shift, &s, &t);
        a->sum_exp_z[r] = (float)(((double)a->sum_exp_z[r] + (double)moved * a->sum_exp[r]) * rescale + t);
        a->sum_exp[r] = (float)((double)a->sum_exp[r] * rescale + s);
        a->max[r] = new_max;
    }
}

static NOINLINE CLONES void fold_grad_rows(const Tile *a, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        float *z = a->z + r * a->Vt;
        float k = a->k, lse = a->lse[r], g = a->g[r];
        float h = a->h ? a->h[r] : 0.0f, mz = a->h ? a->mean_z[r] : 0.0f;
        vf vk = vf_splat(k), vlse = vf_splat(lse), vg = vf_splat(g), vh = vf_splat(h), vmz = vf_splat(mz);
        int64_t i = 0;
        if (a->h) {
            for (; i + LANES <= a->Vt; i += LANES) {
                vf zi = vload_f32(z + i) * vk;
                vf p = vexp(zi - vlse);
                vf ent = vsel(p > 0.0f, p * (zi - vmz), vf_splat(0.0f));
                vstore_f32(z + i, (-vg * p - vh * ent) * vk);
            }
        } else {
            for (; i + LANES <= a->Vt; i += LANES) vstore_f32(z + i, -vg * vexp(vload_f32(z + i) * vk - vlse) * vk);
        }
        for (; i < a->Vt; i++) {
            float zi = z[i] * k, p = exp_ps(zi - lse);
            float ent = a->h && p > 0.0f ? p * (zi - mz) : 0.0f;
            z[i] = (-g * p - h * ent) * k;
        }
        int64_t local = a->ids[r] - a->v0;
        if (local >= 0 && local < a->Vt) z[local] += g * k;
    }
}

/* ------------------------------------------------------------------------------------------------------------ */
/* Threading: rows [0, n) in equal contiguous blocks, one per thread, the GIL released. */

typedef void (*RowFn)(const void *args, int64_t r0, int64_t r1);

static void run_rows(RowFn fn, const void *args, int64_t n, int threads) {
    if (threads > n) threads = (int)n;
    Py_BEGIN_ALLOW_THREADS
    if (threads <= 1) {
        fn(args, 0, n);
    } else {
#pragma omp parallel num_threads(threads)
        {
            int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
            int64_t r0 = n * id / nt, r1 = n * (id + 1) / nt;
            if (r0 < r1) fn(args, r0, r1);
        }
    }
    Py_END_ALLOW_THREADS
}

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static RowFn pick(int dtype, RowFn f32, RowFn bf16, RowFn f16) {
    if (dtype == DT_F32) return f32;
    if (dtype == DT_BF16) return bf16;
    if (dtype == DT_F16) return f16;
    return NULL;
}

#define BY_DTYPE(dtype, name) pick(dtype, (RowFn)CAT(name, _f32), (RowFn)CAT(name, _bf16), (RowFn)CAT(name, _f16))

static PyObject *dispatch(int dtype, RowFn fn, const void *args, int64_t n, int threads) {
    if (fn == NULL) {
        PyErr_Format(PyExc_TypeError, "_cpu_rows: unsupported dtype code %d", dtype);
        return NULL;
    }
    run_rows(fn, args, n, threads);
    Py_RETURN_NONE;
}

#define PTR(v) ((void *)(uintptr_t)(v))

/* stats(x, dtype, B·T, T, V, sxb, sxt, ids, k, k64, logp (float64), ent, state, threads) */
static PyObject *py_stats(PyObject *self, PyObject *args) {
    unsigned long long x, ids, logp, ent, state;
    long long n, T, V, sxb, sxt;
    int dtype, threads;
    float k;
    double k64;
    if (!PyArg_ParseTuple(args, "KiLLLLLKfdKKKi", &x, &dtype, &n, &T, &V, &sxb, &sxt, &ids, &k, &k64, &logp, &ent,
                          &state, &threads))
        return NULL;
    Rows a = {.x = PTR(x), .T = T, .V = V, .sxb = sxb, .sxt = sxt, .ids = PTR(ids), .k = k, .k64 = k64,
              .logp = PTR(logp), .ent = PTR(ent), .state = PTR(state)};
    return dispatch(dtype, BY_DTYPE(dtype, stats_rows), &a, n, threads);
}

/* grad(x, dtype, B·T, T, V, sxb, sxt, ids, offset, k, state, ent, g, h, out, sob, sot, threads) */
static PyObject *py_grad(PyObject *self, PyObject *args) {
    unsigned long long x, ids, state, ent, g, h, out;
    long long n, T, V, sxb, sxt, offset, sob, sot;
    int dtype, threads;
    float k;
    if (!PyArg_ParseTuple(args, "KiLLLLLKLfKKKKKLLi", &x, &dtype, &n, &T, &V, &sxb, &sxt, &ids, &offset, &k, &state,
                          &ent, &g, &h, &out, &sob, &sot, &threads))
        return NULL;
    Rows a = {.x = PTR(x), .out = PTR(out), .T = T, .V = V, .sxb = sxb, .sxt = sxt, .sob = sob, .sot = sot,
              .offset = offset, .ids = PTR(ids), .k = k, .ent = PTR(ent), .state = PTR(state), .g = PTR(g),
              .h = PTR(h)};
    return dispatch(dtype, BY_DTYPE(dtype, grad_rows), &a, n, threads);
}

/* fused(x, dtype, B·T, T, V, sxb, sxt, ids, k, k64, out, sob, sot, logp (float64), ent, adv, old, ref, rho, w, hw,
 *       loss, has_delta, bias_kl, lo, hi, delta, eps_high, beta, sapo_pos, sapo_neg, threads) */
static PyObject *py_fused(PyObject *self, PyObject *args) {
    unsigned long long x, ids, out, logp, ent, adv, old, ref, rho, w, hw;
    long long n, T, V, sxb, sxt, sob, sot;
    int dtype, threads;
    float k;
    double k64;
    Coef c;
    if (!PyArg_ParseTuple(args, "KiLLLLLKfdKLLKKKKKKKKiiifffffffi", &x, &dtype, &n, &T, &V, &sxb, &sxt, &ids, &k,
                          &k64, &out, &sob, &sot, &logp, &ent, &adv, &old, &ref, &rho, &w, &hw, &c.loss, &c.has_delta,
                          &c.bias_kl, &c.lo, &c.hi, &c.delta, &c.eps_high, &c.beta, &c.sapo_pos, &c.sapo_neg,
                          &threads))
        return NULL;
    c.adv = PTR(adv), c.old = PTR(old), c.ref = PTR(ref), c.rho = PTR(rho), c.w = PTR(w), c.hw = PTR(hw);
    Rows a = {.x = PTR(x), .out = PTR(out), .T = T, .V = V, .sxb = sxb, .sxt = sxt, .sob = sob, .sot = sot,
              .ids = PTR(ids), .k = k, .k64 = k64, .logp = PTR(logp), .ent = PTR(ent), .coef = &c};
    return dispatch(dtype, BY_DTYPE(dtype, fused_rows), &a, n, threads);
}

/* partials(x, dtype, B·T, T, V, sxb, sxt, ids, offset, k, parts, threads) */
static PyObject *py_partials(PyObject *self, PyObject *args) {
    unsigned long long x, ids, parts;
    long long n, T, V, sxb, sxt, offset;
    int dtype, threads;
    float k;
    if (!PyArg_ParseTuple(args, "KiLLLLLKLfKi", &x, &dtype, &n, &T, &V, &sxb, &sxt, &ids, &offset, &k, &parts,
                          &threads))
        return NULL;
    Rows a = {.x = PTR(x), .T = T, .V = V, .sxb = sxb, .sxt = sxt, .offset = offset, .ids = PTR(ids), .k = k,
              .state = PTR(parts)};
    return dispatch(dtype, BY_DTYPE(dtype, partial_rows), &a, n, threads);
}

/* fold_stats(z, R, Vt, ids, v0, k, max, sum_exp, sum_exp_z, target, threads) */
static PyObject *py_fold_stats(PyObject *self, PyObject *args) {
    unsigned long long z, ids, mx, se, sez, tg;
    long long R, Vt, v0;
    int threads;
    float k;
    if (!PyArg_ParseTuple(args, "KLLKLfKKKKi", &z, &R, &Vt, &ids, &v0, &k, &mx, &se, &sez, &tg, &threads)) return NULL;
    Tile a = {.z = PTR(z), .Vt = Vt, .v0 = v0, .ids = PTR(ids), .k = k, .max = PTR(mx), .sum_exp = PTR(se),
              .sum_exp_z = PTR(sez), .target = PTR(tg)};
    run_rows((RowFn)fold_stats_rows, &a, R, threads);
    Py_RETURN_NONE;
}

/* fold_grad(z, R, Vt, ids, v0, k, lse, mean_z, g, h, threads) */
static PyObject *py_fold_grad(PyObject *self, PyObject *args) {
    unsigned long long z, ids, lse, mz, g, h;
    long long R, Vt, v0;
    int threads;
    float k;
    if (!PyArg_ParseTuple(args, "KLLKLfKKKKi", &z, &R, &Vt, &ids, &v0, &k, &lse, &mz, &g, &h, &threads)) return NULL;
    Tile a = {.z = PTR(z), .Vt = Vt, .v0 = v0, .ids = PTR(ids), .k = k, .lse = PTR(lse), .mean_z = PTR(mz),
              .g = PTR(g), .h = PTR(h)};
    run_rows((RowFn)fold_grad_rows, &a, R, threads);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"stats", py_stats, METH_VARARGS, "Row statistics: logp, entropy, state."},
    {"grad", py_grad, METH_VARARGS, "Row gradient from the statistics."},
    {"fused", py_fused, METH_VARARGS, "Statistics, token coefficient and gradient in one read of each row."},
    {"partials", py_partials, METH_VARARGS, "Per-row partials of one vocabulary shard."},
    {"fold_stats", py_fold_stats, METH_VARARGS, "Fold one fused-linear logits tile into the running statistics."},
    {"fold_grad", py_fold_grad, METH_VARARGS, "One fused-linear logits tile -> its gradient, in place."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_rows", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cpu_rows(void) {
    return PyModule_Create(&module);
}
