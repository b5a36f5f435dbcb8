/* The row kernels for one storage dtype. cpu_rows.c includes this file once per dtype with
 *   ELEM            the storage type of a logit (float, uint16_t for bf16, half for fp16)
 *   SFX             the suffix of the generated names
 *   LOAD(p, i)      element i of p as float
 *   STORE(p, i, v)  write float v to element i of p, rounded to nearest even
 *   VLOAD(p), VSTORE(p, v)   the same for LANES consecutive elements (a vf)
 * Every function here handles rows [r0, r1) of a (B, T, V) tensor on the calling thread; cpu_rows.c spreads rows
 * over threads. A row is read once for its maximum and once for its sums (the second read comes from L2), and the
 * gradient pass reads it a third time while it is still in L2 when it follows the statistics (fused_rows, which
 * forms the per-token coefficient in between with cpu_rows.c's token_coef: see ops/coef.py for its other copies). */

/* Largest element of row[0, n); NaNs are skipped here and reach the sums instead, which they poison. */
static ALWAYS_INLINE float CAT(row_max_, SFX)(const ELEM *row, int64_t n) {
    vf m = vf_splat(-INFINITY);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        vf v = VLOAD(row + i);
        m = vsel(v > m, v, m);
    }
    float mx = vf_max(m);
    for (; i < n; i++) {
        float v = LOAD(row, i);
        mx = v > mx ? v : mx;
    }
    return mx;
}

/* Σ e and Σ e·z over row[lo, hi), z = (x − shift)·k, e = exp(z); a term with e == 0 adds nothing to Σ e·z (so a
 * −inf logit gives 0, not 0·(−inf)). Blocks of SUM_BLOCK elements are summed in SIMD lanes, then in double. */
static ALWAYS_INLINE void CAT(row_sums_, SFX)(const ELEM *row, int64_t lo, int64_t hi, float shift, float k,
                                              double *s_out, double *t_out) {
    double s = 0.0, t = 0.0;
    vf vshift = vf_splat(shift), vk = vf_splat(k);
    int64_t i = lo;
    while (i + LANES <= hi) {
        int64_t end = i + SUM_BLOCK < hi ? i + SUM_BLOCK : hi;
        vf sb = vf_splat(0.0f), tb = vf_splat(0.0f);
        for (; i + LANES <= end; i += LANES) {
            vf z = (VLOAD(row + i) - vshift) * vk;
            vf e = vexp(z);
            sb += e;
            tb += vsel(e > 0.0f, e * z, vf_splat(0.0f));
        }
        s += vf_sum(sb);
        t += vf_sum(tb);
    }
    for (; i < hi; i++) { /* the ragged end, with the same exp */
        float z = (LOAD(row, i) - shift) * k;
        float e = exp_ps(z);
        s += e;
        t += e > 0.0f ? e * z : 0.0f;
    }
    *s_out = s;
    *t_out = t;
}

/* The statistics of one row against target column y (0 <= y < V): Σ_{v≠y} e, Σ_{v≠y} e·z, z_y, e_y. */
static ALWAYS_INLINE void CAT(row_scan_, SFX)(const ELEM *row, int64_t V, int64_t y, float shift, float k,
                                              double *others, double *weighted, float *z_y, float *e_y) {
    double s1, t1, s2, t2;
    CAT(row_sums_, SFX)(row, 0, y, shift, k, &s1, &t1);
    CAT(row_sums_, SFX)(row, y + 1, V, shift, k, &s2, &t2);
    *z_y = (LOAD(row, y) - shift) * k;
    *e_y = exp_ps(*z_y);
    *others = s1 + s2;
    *weighted = t1 + t2;
}

/* out[v] = (−g·p_v − h·p_v·(z_v − c))·k for every v, then the target's entry is replaced by
 * (g·q − h·p_y·(z_y − c))·k with q = 1 − p_y given exactly. x_y is read before the loop: out may be the logits. */
static ALWAYS_INLINE void CAT(row_grad_store_, SFX)(const ELEM *row, ELEM *orow, int64_t V, int64_t y, float shift,
                                                    float k, float log_sum, float q, float c, float g, float h,
                                                    int has_h) {
    int inside = y >= 0 && y < V;
    float z_y = inside ? (LOAD(row, y) - shift) * k : 0.0f;
    vf vshift = vf_splat(shift), vk = vf_splat(k), vls = vf_splat(log_sum), vc = vf_splat(c);
    vf vg = vf_splat(g), vh = vf_splat(h), zero = vf_splat(0.0f);
    int64_t i = 0;
    if (has_h) {
        for (; i + LANES <= V; i += LANES) {
            vf z = (VLOAD(row + i) - vshift) * vk;
            vf p = vexp(z - vls);
            vf ent = vsel(p > 0.0f, p * (z - vc), zero);
            VSTORE(orow + i, (-vg * p - vh * ent) * vk);
        }
    } else {
        for (; i + LANES <= V; i += LANES) {
            vf z = (VLOAD(row + i) - vshift) * vk;
            VSTORE(orow + i, -vg * vexp(z - vls) * vk);
        }
    }
    for (; i < V; i++) {
        float z = (LOAD(row, i) - shift) * k;
        float p = exp_ps(z - log_sum);
        float ent = has_h && p > 0.0f ? p * (z - c) : 0.0f;
        STORE(orow, i, (-g * p - h * ent) * k);
    }
    if (inside) {
        float p_y = exp_ps(z_y - log_sum);
        float ent = has_h && p_y > 0.0f ? h * (p_y * (z_y - c)) : 0.0f;
        STORE(orow, y, (g * q - ent) * k);
    }
}

/* A row whose g and h are both 0 (a masked token): exact zeros, its logits never read (NaN there stays out). */
static ALWAYS_INLINE void CAT(row_zero_store_, SFX)(ELEM *orow, int64_t V) {
    for (int64_t i = 0; i < V; i++) STORE(orow, i, 0.0f);
}

/* (logp, entropy, state = (shift, log Σe, 1 − p_y)) of one row; sets *log_sum_out, *q, *c = Σ p·z. ℓ is formed in
 * float64 from the target's own z_y and e_y in float64 and the double sum of the other tokens' fp32 exponentials:
 * exact to that sum's rounding (a few 1e-8 absolute) for any |ℓ|, where an fp32 ℓ or log Σe of size 10 carries
 * 5e-7 (ops/backend.py, "ℓ in float64"). */
static ALWAYS_INLINE void CAT(row_stats_one_, SFX)(const ELEM *row, int64_t V, int64_t y, float k, double k64,
                                                   float *shift_out, double *logp, float *ent, float *log_sum_out,
                                                   float *q_out, float *c_out) {
    float m = CAT(row_max_, SFX)(row, V);
    float shift = m == -INFINITY ? 0.0f : m; /* an all −inf row: Σe = 0 and NaN/−inf results, no −inf − −inf */
    double others, weighted;
    float z_y32, e_y32;
    CAT(row_scan_, SFX)(row, V, y, shift, k, &others, &weighted, &z_y32, &e_y32);
    double z_y = ((double)LOAD(row, y) - (double)shift) * k64, e_y = exp(z_y);
    double total = others + e_y;
    double log_sum = log(total);
    weighted += e_y > 0.0 ? e_y * z_y : 0.0;
    /* ℓ = −log(1 + Σ_{v≠y} e / e_y): exact near 0 through log1p; plain z_y − log Σe where p_y is tiny. */
    *logp = z_y > -20.0 ? -log1p(others / e_y) : z_y - log_sum;
    *ent = (float)(log_sum - weighted / total);
    *shift_out = shift;
    *log_sum_out = (float)log_sum;
    *q_out = (float)(others / total);
    *c_out = (float)(weighted / total);
}

static NOINLINE CLONES void CAT(stats_rows_, SFX)(const Rows *a, int64_t r0, int64_t r1) {
    const ELEM *x = (const ELEM *)a->x;
    for (int64_t r = r0; r < r1; r++) {
        const ELEM *row = x + (r / a->T) * a->sxb + (r % a->T) * a->sxt;
        float shift, log_sum, q, c;
        CAT(row_stats_one_, SFX)(row, a->V, a->ids[r], a->k, a->k64, &shift, &a->logp[r], &a->ent[r], &log_sum, &q,
                                 &c);
        a->state[3 * r] = shift;
        a->state[3 * r + 1] = log_sum;
        a->state[3 * r + 2] = q;
    }
}

static NOINLINE CLONES void CAT(grad_rows_, SFX)(const Rows *a, int64_t r0, int64_t r1) {
    const ELEM *x = (const ELEM *)a->x;
    ELEM *out = (ELEM *)a->out;
    for (int64_t r = r0; r < r1; r++) {
        int64_t b = r / a->T, t = r % a->T;
        const float *st = a->state + 3 * r;
        float shift = st[0] == -INFINITY ? 0.0f : st[0];
        float h = a->h ? a->h[r] : 0.0f;
        if (a->g[r] == 0.0f && h == 0.0f) {
            CAT(row_zero_store_, SFX)(out + b * a->sob + t * a->sot, a->V);
            continue;
        }
        CAT(row_grad_store_, SFX)(x + b * a->sxb + t * a->sxt, out + b * a->sob + t * a->sot, a->V,
                                  a->ids[r] - a->offset, shift, a->k, st[1], st[2], st[1] - a->ent[r], a->g[r], h,
                                  a->h != NULL);
    }
}

static NOINLINE CLONES void CAT(fused_rows_, SFX)(const Rows *a, int64_t r0, int64_t r1) {
    const ELEM *x = (const ELEM *)a->x;
    ELEM *out = (ELEM *)a->out;
    for (int64_t r = r0; r < r1; r++) {
        int64_t b = r / a->T, t = r % a->T;
        const ELEM *row = x + b * a->sxb + t * a->sxt;
        float shift, log_sum, q, c;
        int64_t y = a->ids[r];
        CAT(row_stats_one_, SFX)(row, a->V, y, a->k, a->k64, &shift, &a->logp[r], &a->ent[r], &log_sum, &q, &c);
        double lp = a->logp[r]; /* float64: g below is formed from it */
        float g = token_coef(a->coef, lp, r);
        float h = a->coef->hw ? a->coef->hw[r] : 0.0f;
        if (g == 0.0f && h == 0.0f) {
            CAT(row_zero_store_, SFX)(out + b * a->sob + t * a->sot, a->V);
            continue;
        }
        CAT(row_grad_store_, SFX)(row, out + b * a->sob + t * a->sot, a->V, a->ids[r], shift, a->k, log_sum, q, c,
                                  g, h, a->coef->hw != NULL);
    }
}

/* The partials of one vocabulary shard [offset, offset + V): (raw max, Σe, Σe·z, raw target logit or −inf,
 * Σ_{v≠y} e), as vocab_parallel.shard_partials. */
static NOINLINE CLONES void CAT(partial_rows_, SFX)(const Rows *a, int64_t r0, int64_t r1) {
    const ELEM *x = (const ELEM *)a->x;
    for (int64_t r = r0; r < r1; r++) {
        const ELEM *row = x + (r / a->T) * a->sxb + (r % a->T) * a->sxt;
        float m = CAT(row_max_, SFX)(row, a->V);
        float shift = m == -INFINITY ? 0.0f : m;
        int64_t y = a->ids[r] - a->offset;
        float *p = a->state + 5 * r;
        double others, weighted, total;
        if (y >= 0 && y < a->V) {
            float z_y, e_y;
            CAT(row_scan_, SFX)(row, a->V, y, shift, a->k, &others, &weighted, &z_y, &e_y);
            total = others + (double)e_y;
            weighted += e_y > 0.0f ? (double)e_y * (double)z_y : 0.0;
            p[3] = LOAD(row, y);
        } else {
            CAT(row_sums_, SFX)(row, 0, a->V, shift, a->k, &total, &weighted);
            others = total;
            p[3] = -INFINITY;
        }
        p[0] = m;
        p[1] = (float)total;
        p[2] = (float)weighted;
        p[4] = (float)others;
    }
}
