/* SPDX-License-Identifier: MIT */
/*
 * The optimised baselines (see baselines.h): the same steps as baselines_ref.c, with the
 * optimised window attention on caller-owned scratch, the smooth.h kernels, the SIMD ops
 * (gemm for ExpectedAttention's covariance and k^T Sigma k, vector dots and axpys
 * elsewhere), and plain pthreads over independent heads. Every work item writes its own
 * rows and the cross-head sums run afterwards in head order on one thread, so the results
 * do not depend on the thread count.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "baselines.h"
#include "baselines_impl.h"
#include "dtype.h"
#include "select.h"
#include "simd.h"

/* H2O rows per attention block come from params; these are the ExpectedAttention tiles. */
#define EA_STAT_ROWS 256u /* query rows per covariance gemm; fp32 inside, double across */
#define EA_TOK_ROWS 128u  /* keys per k^T Sigma k gemm */
#define KD_BLOCK 256u     /* keys per fp32 partial sum of KeyDiff's mean key */

struct job {
	enum kvd_baseline b;
	const struct kvd_baseline_params *p;
	const struct kvd_attn_in *in;
	const struct kvd_simd_ops *ops;
	float *rows;   /* [H][L], or [Hkv][L] for the per-kv-head baselines */
	float *vnorm;  /* ExpectedAttention: [Hkv][L] or NULL */
	double *rope;  /* ExpectedAttention: cbar[d/2], sbar[d/2] */
	uint32_t items;
	size_t scratch_floats;
	int (*fn)(struct job *j, uint32_t item, float *scratch);
	uint32_t next; /* atomic: the next item to take */
	int err;       /* atomic: the first error */
};

static void job_fail(struct job *j, int r) {
	int zero = 0;

	__atomic_compare_exchange_n(&j->err, &zero, r, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}

static void *worker(void *arg) {
	struct job *j = arg;
	float *scratch = malloc((j->scratch_floats ? j->scratch_floats : 1) * sizeof(float));

	if (!scratch) {
		job_fail(j, -ENOMEM);
		return NULL;
	}
	for (;;) {
		uint32_t item = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
		int r;

		if (item >= j->items || __atomic_load_n(&j->err, __ATOMIC_RELAXED))
			break;
		r = j->fn(j, item, scratch);
		if (r < 0) {
			job_fail(j, r);
			break;
		}
	}
	free(scratch);
	return NULL;
}

/*
 * Runs every item of j on up to `threads` threads (0: the online CPUs), the caller's
 * included. Threads that cannot be started leave their share to the others.
 */
static int job_run(struct job *j, uint32_t threads) {
	pthread_t *tid = NULL;
	uint32_t n = threads, started = 0;

	if (n == 0) {
		long c = sysconf(_SC_NPROCESSORS_ONLN);

		n = c > 0 ? (uint32_t)c : 1;
	}
	if (n > j->items)
		n = j->items;
	if (n > 1)
		tid = malloc((n - 1) * sizeof(*tid));
	for (uint32_t t = 0; tid && t + 1 < n; t++) {
		if (pthread_create(&tid[t], NULL, worker, j) != 0)
			break;
		started++;
	}
	worker(j);
	for (uint32_t t = 0; t < started; t++)
		pthread_join(tid[t], NULL);
	free(tid);
	return j->err;
}

static const char *row_ptr(const void *base, const struct kvd_attn_in *in, size_t head_stride,
			   size_t row_stride, uint32_t head, uint32_t row) {
	return (const char *)base +
	       (head * head_stride + (size_t)row * row_stride) * kvd_dtype_size(in->dtype);
}

/* ---- attention-based items: one query head each ---- */

static int snap_item(struct job *j, uint32_t h, float *scratch) {
	const struct kvd_attn_in *in = j->in;
	uint32_t L = in->len, w = in->window, n = L - w;
	float *row = j->rows + (size_t)h * L, *probs = scratch, *tmp = probs + (size_t)w * L;
	int r;

	r = kvd_attn_head_buf(in, h, probs, tmp + L);
	if (r >= 0)
		r = kvd_temporal_agg(j->p->temporal, j->p->alpha, probs, w, L, n, tmp);
	/* AdaKV over a group pools after the group mean (kvd_bl_finish). */
	if (r >= 0)
		r = kvd_pool_row(kvd_bl_pool_after_mean(j->b, j->p, in) ? KVD_POOL_NONE : j->p->pool,
				 j->p->kernel, 0, tmp, n, row);
	memset(row + n, 0, (size_t)w * sizeof(float));
	return r;
}

static size_t snap_scratch(const struct kvd_attn_in *in) {
	return (size_t)in->window * in->len + in->len + kvd_attn_scratch_floats(in);
}

static struct kvd_attn_in h2o_block_view(const struct kvd_attn_in *in, uint32_t block) {
	struct kvd_attn_in v = *in;

	v.window = block < in->window ? block : in->window;
	return v;
}

static int h2o_item(struct job *j, uint32_t h, float *scratch) {
	const struct kvd_attn_in *in = j->in;
	const struct kvd_simd_ops *ops = j->ops;
	uint32_t L = in->len, w = in->window, B = j->p->h2o_block < w ? j->p->h2o_block : w;
	double *acc = (double *)scratch;
	float *colsum = scratch + 2 * (size_t)L, *probs = colsum + L, *attn = probs + (size_t)B * L;
	float *row = j->rows + (size_t)h * L;

	for (uint32_t i = 0; i < L; i++)
		acc[i] = 0;
	/* Blocks of B query rows: O(B*L) memory whatever the prompt length. */
	for (uint32_t t0 = 0; t0 < w; t0 += B) {
		uint32_t t1 = t0 + B < w ? t0 + B : w;
		struct kvd_attn_in v;
		int r;

		kvd_bl_window_rows(in, t0, t1, &v);
		r = kvd_attn_head_buf(&v, h, probs, attn);
		if (r < 0)
			return r;
		memset(colsum, 0, (size_t)v.len * sizeof(float));
		for (uint32_t t = 0; t < v.window; t++)
			ops->axpy(v.len, 1.0f, probs + (size_t)t * v.len, colsum);
		for (uint32_t i = 0; i < v.len; i++)
			acc[i] += colsum[i];
	}
	for (uint32_t i = 0; i < L; i++) {
		double s = acc[i];

		if (j->p->h2o_normalize)
			s /= kvd_bl_h2o_count(in, i);
		row[i] = (float)s;
	}
	return 0;
}

static size_t h2o_scratch(const struct kvd_attn_in *in, uint32_t block) {
	struct kvd_attn_in v = h2o_block_view(in, block);

	return 3 * (size_t)in->len + (size_t)v.window * in->len + kvd_attn_scratch_floats(&v);
}

/* TOVA, per kv head: only the last window row matters, so the attention runs on that one
 * query of each of the g query heads that read the kv head, together, so that the keys are
 * read and converted once for all g (the rows of consecutive heads are consecutive). */
static int tova_item(struct job *j, uint32_t kv, float *scratch) {
	const struct kvd_attn_in *in = j->in;
	uint32_t g = in->heads / in->kv_heads;
	struct kvd_attn_in last;

	kvd_bl_window_rows(in, in->window - 1, in->window, &last);
	return kvd_attn_heads_buf(&last, kv * g, g, j->rows + (size_t)kv * g * in->len, scratch);
}

/* ---- per-key items: one kv head each ---- */

/* ||x||^2 of a converted key: fp32 dot, redone in double only if that overflowed. */
static double sq_norm(const struct kvd_simd_ops *ops, const float *x, uint32_t d) {
	float s = ops->dot(d, x, x);
	double sd = 0;

	if (isfinite(s))
		return s;
	for (uint32_t a = 0; a < d; a++)
		sd += (double)x[a] * x[a];
	return sd;
}

static int knorm_item(struct job *j, uint32_t g, float *scratch) {
	const struct kvd_attn_in *in = j->in;
	float *row = j->rows + (size_t)g * in->len;

	for (uint32_t i = 0; i < in->len; i++) {
		const char *k = row_ptr(in->k, in, in->k_head_stride, in->k_row_stride, g, i);

		j->ops->to_f32(k, in->dtype, in->dim, 1.0f, scratch);
		row[i] = -(float)sqrt(sq_norm(j->ops, scratch, in->dim));
	}
	return 0;
}

static int all_finite(const float *x, uint32_t d) {
	for (uint32_t a = 0; a < d; a++)
		if (!isfinite(x[a]))
			return 0;
	return 1;
}

static int keydiff_item(struct job *j, uint32_t g, float *scratch) {
	const struct kvd_attn_in *in = j->in;
	const struct kvd_simd_ops *ops = j->ops;
	uint32_t d = in->dim, L = in->len, finite = 0;
	double *acc = (double *)scratch, an = 0; /* first: double-aligned for any d */
	float *row = j->rows + (size_t)g * L, *x = scratch + 2 * (size_t)d, *part = x + d;
	float *anchor = part + d;

	for (uint32_t a = 0; a < d; a++)
		acc[a] = 0;
	/* Pass 1: the mean normalised key, fp32 within blocks and double across them; the
	 * key norms are kept in row meanwhile (NaN for keys left out). */
	for (uint32_t i0 = 0; i0 < L; i0 += KD_BLOCK) {
		uint32_t i1 = i0 + KD_BLOCK < L ? i0 + KD_BLOCK : L;

		memset(part, 0, d * sizeof(float));
		for (uint32_t i = i0; i < i1; i++) {
			const char *k =
				row_ptr(in->k, in, in->k_head_stride, in->k_row_stride, g, i);
			double n;

			ops->to_f32(k, in->dtype, d, 1.0f, x);
			n = sq_norm(ops, x, d);
			if (!isfinite(n) && !all_finite(x, d)) {
				row[i] = NAN;
				continue;
			}
			n = sqrt(n);
			row[i] = (float)n;
			ops->axpy(d, (float)(1.0 / fmax(n, 1e-12)), x, part);
			finite++;
		}
		for (uint32_t a = 0; a < d; a++)
			acc[a] += part[a];
	}
	for (uint32_t a = 0; a < d; a++) {
		double m = acc[a] / (finite ? finite : 1);

		anchor[a] = (float)m;
		an += m * m;
	}
	an = fmax(sqrt(an), 1e-8);
	/* Pass 2: -cos(k, anchor). */
	for (uint32_t i = 0; i < L; i++) {
		const char *k = row_ptr(in->k, in, in->k_head_stride, in->k_row_stride, g, i);
		double kn = row[i];

		if (isnan(kn))
			continue;
		ops->to_f32(k, in->dtype, d, 1.0f, x);
		row[i] = -(float)(ops->dot(d, x, anchor) / (fmax(kn, 1e-8) * an));
	}
	return 0;
}

/* ---- ExpectedAttention: one query head each ---- */

static size_t ea_scratch(const struct kvd_attn_in *in) {
	size_t d = in->dim;

	/* x block and its transpose, the block's X^T X, Sigma and mu in double, Sigma and mu
	 * in fp32, the key block and K Sigma, one value row. */
	return 2 * EA_STAT_ROWS * d + d * d + 2 * d * d + 2 * d + d * d + d +
	       2 * EA_TOK_ROWS * d + d;
}

static int ea_item(struct job *j, uint32_t h, float *scratch) {
	const struct kvd_attn_in *in = j->in;
	const struct kvd_baseline_params *p = j->p;
	const struct kvd_simd_ops *ops = j->ops;
	uint32_t d = in->dim, L = in->len, g = kvd_attn_kv_head(in, h);
	uint32_t gs = in->heads / in->kv_heads;
	uint32_t n0 = p->n_sink < L ? p->n_sink : L, N = p->eq_rows - p->eq_first;
	float *xb = scratch, *xt = xb + (size_t)EA_STAT_ROWS * d;
	float *sb = xt + (size_t)EA_STAT_ROWS * d;
	double *sig = (double *)(sb + (size_t)d * d), *mu = sig + (size_t)d * d;
	float *sigf = (float *)(mu + d), *muf = sigf + (size_t)d * d, *kb = muf + d;
	float *yb = kb + (size_t)EA_TOK_ROWS * d, *vr = yb + (size_t)EA_TOK_ROWS * d;
	float *row = j->rows + (size_t)h * L, s = in->scale, half_s2 = in->scale * in->scale / 2;
	float m, sum;

	/* The query mean (double), then the covariance as X^T X gemms of centred blocks. */
	for (uint32_t a = 0; a < d; a++)
		mu[a] = 0;
	for (uint32_t t = p->eq_first; t < p->eq_rows; t++) {
		ops->to_f32(row_ptr(p->eq_q, in, p->eq_head_stride, p->eq_row_stride, h, t),
			    in->dtype, d, 1.0f, xb);
		for (uint32_t a = 0; a < d; a++)
			mu[a] += xb[a];
	}
	for (uint32_t a = 0; a < d; a++)
		mu[a] /= N;
	for (size_t a = 0; a < (size_t)d * d; a++)
		sig[a] = 0;
	if (p->use_covariance) {
		for (uint32_t t0 = p->eq_first; t0 < p->eq_rows; t0 += EA_STAT_ROWS) {
			uint32_t nb = p->eq_rows - t0;

			if (nb > EA_STAT_ROWS)
				nb = EA_STAT_ROWS;

			for (uint32_t r = 0; r < nb; r++) {
				float *x = xb + (size_t)r * d;

				ops->to_f32(row_ptr(p->eq_q, in, p->eq_head_stride,
						    p->eq_row_stride, h, t0 + r),
					    in->dtype, d, 1.0f, x);
				for (uint32_t a = 0; a < d; a++) {
					x[a] = (float)(x[a] - mu[a]);
					xt[(size_t)a * EA_STAT_ROWS + r] = x[a];
				}
			}
			ops->gemm(d, d, nb, xt, EA_STAT_ROWS, xb, d, sb, d, 0);
			for (size_t a = 0; a < (size_t)d * d; a++)
				sig[a] += sb[a];
		}
		for (size_t a = 0; a < (size_t)d * d; a++)
			sig[a] /= N;
	}
	kvd_bl_rotate(d, j->rope, j->rope + d / 2, mu, p->use_covariance ? sig : NULL);
	for (size_t a = 0; a < (size_t)d * d; a++)
		sigf[a] = (float)sig[a];
	for (uint32_t a = 0; a < d; a++)
		muf[a] = (float)mu[a];

	/* z_i = s k.mu + s^2/2 k^T Sigma k: K Sigma by gemm, key block by key block. */
	for (uint32_t i0 = n0; i0 < L; i0 += EA_TOK_ROWS) {
		uint32_t nb = L - i0 < EA_TOK_ROWS ? L - i0 : EA_TOK_ROWS;

		for (uint32_t r = 0; r < nb; r++)
			ops->to_f32(row_ptr(in->k, in, in->k_head_stride, in->k_row_stride, g,
					    i0 + r),
				    in->dtype, d, 1.0f, kb + (size_t)r * d);
		if (p->use_covariance)
			ops->gemm(nb, d, d, kb, d, sigf, d, yb, d, 0);
		for (uint32_t r = 0; r < nb; r++) {
			const float *k = kb + (size_t)r * d;
			float z = s * ops->dot(d, k, muf);

			if (p->use_covariance)
				z += half_s2 * ops->dot(d, k, yb + (size_t)r * d);
			row[i0 + r] = z;
		}
	}
	memset(row, 0, n0 * sizeof(float));
	if (n0 < L) {
		m = ops->max(row + n0, L - n0);
		sum = ops->exp_sum(row + n0, L - n0, m);
		ops->scale(row + n0, L - n0, 1.0f / sum);
	}

	/* The first query head of each group also writes its kv head's value norms. */
	if (j->vnorm && h % gs == 0)
		for (uint32_t i = 0; i < L; i++) {
			ops->to_f32(row_ptr(in->v, in, in->v_head_stride, in->v_row_stride, g, i),
				    in->dtype, d, 1.0f, vr);
			j->vnorm[(size_t)g * L + i] = (float)sqrt(sq_norm(ops, vr, d));
		}
	return 0;
}

int kvd_baseline_scores(enum kvd_baseline b, const struct kvd_baseline_params *p,
			const struct kvd_attn_in *in, float *scores) {
	struct job j = { .b = b, .p = p, .in = in, .ops = kvd_simd() };
	float *layer = NULL;
	double *rope = NULL;
	int r;

	r = kvd_bl_check(b, p, in, scores);
	if (r < 0)
		return r;
	if (b == KVD_BASELINE_STREAMINGLLM)
		return kvd_bl_finish(b, p, in, NULL, NULL, kvd_pool_row, scores);

	j.items = kvd_bl_per_kv_head(b) ? in->kv_heads : in->heads;
	switch (b) {
	case KVD_BASELINE_H2O:
		j.fn = h2o_item, j.scratch_floats = h2o_scratch(in, p->h2o_block);
		break;
	case KVD_BASELINE_SNAPKV:
	case KVD_BASELINE_PYRAMIDKV:
	case KVD_BASELINE_ADAKV:
		j.fn = snap_item, j.scratch_floats = snap_scratch(in);
		break;
	case KVD_BASELINE_TOVA: {
		struct kvd_attn_in last;

		kvd_bl_window_rows(in, in->window - 1, in->window, &last);
		j.fn = tova_item, j.scratch_floats = kvd_attn_scratch_floats(&last);
		j.items = in->kv_heads;
		break;
	}
	case KVD_BASELINE_KNORM:
		j.fn = knorm_item, j.scratch_floats = in->dim;
		break;
	case KVD_BASELINE_KEYDIFF:
		j.fn = keydiff_item, j.scratch_floats = 5 * (size_t)in->dim;
		break;
	default:
		j.fn = ea_item, j.scratch_floats = ea_scratch(in);
		break;
	}

	j.rows = malloc((size_t)(kvd_bl_per_kv_head(b) ? in->kv_heads : in->heads) * in->len *
			sizeof(float));
	if (!j.rows)
		return -ENOMEM;
	if (b == KVD_BASELINE_EXPECTED_ATTENTION) {
		rope = malloc(in->dim * sizeof(double));
		if (p->use_vnorm)
			j.vnorm = malloc((size_t)in->kv_heads * in->len * sizeof(float));
		if (!rope || (p->use_vnorm && !j.vnorm)) {
			r = -ENOMEM;
			goto out;
		}
		kvd_bl_rope_mean(p, in, rope, rope + in->dim / 2);
		j.rope = rope;
	}

	r = job_run(&j, p->threads);
	if (r < 0)
		goto out;
	if (b == KVD_BASELINE_TOVA) {
		/* The layer-wide mean over all query heads, in head order. */
		layer = malloc((size_t)in->len * sizeof(float));
		if (!layer) {
			r = -ENOMEM;
			goto out;
		}
		memcpy(layer, j.rows, (size_t)in->len * sizeof(float));
		for (uint32_t h = 1; h < in->heads; h++)
			j.ops->axpy(in->len, 1.0f, j.rows + (size_t)h * in->len, layer);
		j.ops->scale(layer, in->len, 1.0f / (float)in->heads);
	}
	r = kvd_bl_finish(b, p, in, layer ? layer : j.rows, j.vnorm, kvd_pool_row, scores);
out:
	free(j.rows), free(j.vnorm), free(rope), free(layer);
	return r;
}

/* ---- AdaKV budgets by radix selection ---- */

int kvd_adakv_budgets(const float *scores, size_t stride, uint32_t heads, uint32_t n,
		      uint32_t budget, double floor_alpha, int normalize, uint32_t *ret_budgets) {
	const float **rows = NULL;
	uint32_t *lens = NULL, *count = NULL, *keep = NULL;
	float *scaled = NULL;
	uint64_t k = (uint64_t)heads * budget;
	int r = -ENOMEM;

	if (!ret_budgets || (heads > 0 && n > 0 && !scores) || stride < n ||
	    !(floor_alpha >= 0 && floor_alpha <= 1))
		return -EINVAL;
	if (budget > n) {
		for (uint32_t h = 0; h < heads; h++)
			ret_budgets[h] = n;
		return 0;
	}
	rows = malloc((heads ? heads : 1) * sizeof(*rows));
	lens = malloc((heads ? heads : 1) * sizeof(*lens));
	count = malloc((heads ? heads : 1) * sizeof(*count));
	keep = malloc((k ? k : 1) * sizeof(*keep));
	if (normalize)
		scaled = malloc(((size_t)heads * n + 1) * sizeof(*scaled));
	if (!rows || !lens || !count || !keep || (normalize && !scaled))
		goto out;
	for (uint32_t h = 0; h < heads; h++) {
		const float *row = scores + h * stride;

		lens[h] = n;
		rows[h] = row;
		if (normalize) {
			float *out = scaled + (size_t)h * n, ratio;
			double mass = 0, sum = 0;

			/* The same sums, in the same (position) order, as the reference. */
			r = kvd_topk(row, n, budget, keep);
			if (r < 0)
				goto out;
			for (uint32_t i = 0, t = 0; i < n; i++) {
				sum += row[i];
				if (t < budget && keep[t] == i) {
					mass += row[i];
					t++;
				}
			}
			ratio = (float)(mass / sum);
			for (uint32_t i = 0; i < n; i++)
				out[i] = row[i] * ratio;
			rows[h] = out;
		}
	}
	r = kvd_topk_rows(rows, lens, heads, k, 1, count, keep);
	if (r < 0)
		goto out;
	for (uint32_t h = 0; h < heads; h++)
		ret_budgets[h] = kvd_bl_adakv_round(count[h], budget, floor_alpha);
	r = 0;
out:
	free(rows), free(lens), free(count), free(keep), free(scaled);
	return r;
}
