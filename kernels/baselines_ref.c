/* SPDX-License-Identifier: MIT */
/*
 * The reference baselines: one head after the other, plain loops over the reference
 * window attention and smoothing, double accumulation wherever a sum runs over tokens or
 * queries. Also the glue both paths share (baselines_impl.h), the budget helpers and the
 * names.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "baselines.h"
#include "baselines_impl.h"
#include "dtype.h"

static const char *const baseline_names[_KVD_BASELINE_MAX] = {
	[KVD_BASELINE_STREAMINGLLM] = "streamingllm",
	[KVD_BASELINE_H2O] = "h2o",
	[KVD_BASELINE_SNAPKV] = "snapkv",
	[KVD_BASELINE_PYRAMIDKV] = "pyramidkv",
	[KVD_BASELINE_ADAKV] = "adakv",
	[KVD_BASELINE_TOVA] = "tova",
	[KVD_BASELINE_KNORM] = "knorm",
	[KVD_BASELINE_KEYDIFF] = "keydiff",
	[KVD_BASELINE_EXPECTED_ATTENTION] = "expected_attention",
};

const char *kvd_baseline_to_string(enum kvd_baseline b) {
	if ((int)b < 0 || b >= _KVD_BASELINE_MAX)
		return NULL;
	return baseline_names[b];
}

enum kvd_baseline kvd_baseline_from_string(const char *s) {
	if (!s)
		return _KVD_BASELINE_INVALID;
	for (int i = 0; i < _KVD_BASELINE_MAX; i++)
		if (strcmp(s, baseline_names[i]) == 0)
			return (enum kvd_baseline)i;
	return _KVD_BASELINE_INVALID;
}

void kvd_baseline_params_init(enum kvd_baseline b, struct kvd_baseline_params *p) {
	*p = (struct kvd_baseline_params){
		.n_sink = 4,
		.eq_first = 4,
		.temporal = KVD_TEMPORAL_SUM,
		.alpha = KVD_TEMPORAL_EMA_ALPHA,
		.pool = KVD_POOL_AVG,
		.kernel = KVD_POOL_KERNEL,
		.h2o_block = 64,
		.n_future = 512,
		.rope_theta = 10000.0f,
		.use_covariance = 1,
		.use_vnorm = 1,
	};
	if (b == KVD_BASELINE_ADAKV) {
		p->temporal = KVD_TEMPORAL_MEAN;
		p->pool = KVD_POOL_MAX;
		p->kernel = 7;
	}
}

uint32_t kvd_baseline_rows(const struct kvd_baseline_params *p, const struct kvd_attn_in *in) {
	return p->per_query_head ? in->heads : in->kv_heads;
}

int kvd_bl_needs_q(enum kvd_baseline b) {
	return b == KVD_BASELINE_H2O || b == KVD_BASELINE_SNAPKV || b == KVD_BASELINE_PYRAMIDKV ||
	       b == KVD_BASELINE_ADAKV || b == KVD_BASELINE_TOVA;
}

int kvd_bl_per_kv_head(enum kvd_baseline b) {
	return b == KVD_BASELINE_KNORM || b == KVD_BASELINE_KEYDIFF;
}

static int snap_family(enum kvd_baseline b) {
	return b == KVD_BASELINE_SNAPKV || b == KVD_BASELINE_PYRAMIDKV || b == KVD_BASELINE_ADAKV;
}

int kvd_bl_check(enum kvd_baseline b, const struct kvd_baseline_params *p,
		 const struct kvd_attn_in *in, const float *scores) {
	if (!p || !in || !scores || (int)b < 0 || b >= _KVD_BASELINE_MAX)
		return -EINVAL;
	if (in->heads == 0 || in->kv_heads == 0 || in->heads % in->kv_heads != 0 || in->len == 0 ||
	    in->window == 0 || in->window > in->len)
		return -EINVAL;
	if (b == KVD_BASELINE_STREAMINGLLM)
		return 0;
	if (!in->k || kvd_dtype_size(in->dtype) == 0 || in->dim == 0)
		return -EINVAL;
	if (kvd_bl_needs_q(b) && kvd_attn_in_check(in) < 0)
		return -EINVAL;
	if (snap_family(b)) {
		if ((int)p->temporal < 0 || p->temporal >= _KVD_TEMPORAL_MAX)
			return -EINVAL;
		if (p->temporal == KVD_TEMPORAL_EMA && (!(p->alpha > 0) || p->alpha > 1))
			return -EINVAL;
		if ((int)p->pool < 0 || p->pool >= _KVD_POOL_MAX || p->pool == KVD_POOL_ADAPTIVE)
			return -EINVAL;
		if (p->pool != KVD_POOL_NONE && p->kernel % 2 == 0)
			return -EINVAL;
	}
	if (b == KVD_BASELINE_H2O && p->h2o_block == 0)
		return -EINVAL;
	if (b == KVD_BASELINE_EXPECTED_ATTENTION) {
		if (!p->eq_q || p->eq_rows <= p->eq_first || in->dim % 2 != 0 || p->n_future == 0 ||
		    !isfinite(in->scale))
			return -EINVAL;
		if (p->use_vnorm && !in->v)
			return -EINVAL;
		if (!p->rope_inv_freq && !(p->rope_theta > 0 && isfinite(p->rope_theta)))
			return -EINVAL;
	}
	return 0;
}

int kvd_bl_finish(enum kvd_baseline b, const struct kvd_baseline_params *p,
		  const struct kvd_attn_in *in, const float *qrows, const float *vnorm,
		  kvd_bl_pool_fn pool, float *scores) {
	uint32_t rows = kvd_baseline_rows(p, in), L = in->len, g = in->heads / in->kv_heads;
	uint32_t lo = 0, hi = 0; /* protected [lo, hi) */
	int pool_after = kvd_bl_pool_after_mean(b, p, in);
	float *mean = pool_after ? malloc((size_t)L * sizeof(float)) : NULL;

	if (pool_after && !mean)
		return -ENOMEM;

	switch (b) {
	case KVD_BASELINE_STREAMINGLLM:
	case KVD_BASELINE_EXPECTED_ATTENTION:
		hi = p->n_sink < L ? p->n_sink : L;
		break;
	case KVD_BASELINE_H2O:
		lo = L - (p->recent < L ? p->recent : L), hi = L;
		break;
	case KVD_BASELINE_SNAPKV:
	case KVD_BASELINE_PYRAMIDKV:
	case KVD_BASELINE_ADAKV:
		lo = L - in->window, hi = L;
		break;
	case KVD_BASELINE_TOVA:
		lo = L - 1, hi = L;
		break;
	default:
		break;
	}

	for (uint32_t r = 0; r < rows; r++) {
		float *out = scores + (size_t)r * L;
		uint32_t kv = p->per_query_head ? r / g : r;

		if (b == KVD_BASELINE_STREAMINGLLM) {
			for (uint32_t i = 0; i < L; i++)
				out[i] = (float)i;
		} else if (b == KVD_BASELINE_TOVA) {
			memcpy(out, qrows, (size_t)L * sizeof(float));
		} else if (kvd_bl_per_kv_head(b)) {
			memcpy(out, qrows + (size_t)kv * L, (size_t)L * sizeof(float));
		} else if (p->per_query_head) {
			memcpy(out, qrows + (size_t)r * L, (size_t)L * sizeof(float));
		} else {
			/* kvpress: mean over the group, fp32, in head order. */
			for (uint32_t i = 0; i < L; i++) {
				float acc = 0;

				for (uint32_t h = r * g; h < (r + 1) * g; h++)
					acc += qrows[(size_t)h * L + i];
				out[i] = acc / (float)g;
			}
			if (pool_after) {
				/* The prefix only, as the per-head pooling does; checked arguments. */
				memcpy(mean, out, (size_t)(L - in->window) * sizeof(float));
				(void)pool(p->pool, p->kernel, 0, mean, L - in->window, out);
			}
		}
		if (vnorm)
			for (uint32_t i = 0; i < L; i++)
				out[i] = (out[i] + p->epsilon) * vnorm[(size_t)kv * L + i];
		for (uint32_t i = 0; i < L; i++)
			if (isnan(out[i]))
				out[i] = -INFINITY;
		for (uint32_t i = lo; i < hi; i++)
			out[i] = INFINITY;
	}
	free(mean);
	return 0;
}

void kvd_bl_window_rows(const struct kvd_attn_in *in, uint32_t t0, uint32_t t1,
			struct kvd_attn_in *ret) {
	*ret = *in;
	ret->q = (const char *)in->q + (size_t)t0 * in->q_row_stride * kvd_dtype_size(in->dtype);
	ret->window = t1 - t0;
	ret->len = in->len - in->window + t1;
}

/* HF's default frequencies: 1 / theta^(2j/d), in fp32 as transformers computes them. */
static float default_inv_freq(uint32_t j, uint32_t d, float theta) {
	float e = (float)(2 * j) / (float)d;

	return 1.0f / powf(theta, e);
}

int kvd_bl_rope_mean(const struct kvd_baseline_params *p, const struct kvd_attn_in *in,
		     double *cbar, double *sbar) {
	uint32_t half = in->dim / 2;
	uint64_t pos0 = p->position ? p->position : in->len;

	for (uint32_t j = 0; j < half; j++) {
		float f = p->rope_inv_freq ? p->rope_inv_freq[j] :
					     default_inv_freq(j, in->dim, p->rope_theta);
		double c = 0, s = 0;

		for (uint32_t t = 0; t < p->n_future; t++) {
			/* The angle rounded to fp32 as HF's rotary embedding forms it. */
			double a = (double)((float)(pos0 + t) * f);

			c += cos(a);
			s += sin(a);
		}
		cbar[j] = c / p->n_future;
		sbar[j] = s / p->n_future;
	}
	return 0;
}

/* y = R x for a vector with element stride st (in place): rotate_half pairs (j, j + d/2). */
static void rotate_vec(uint32_t d, const double *c, const double *s, double *x, size_t st) {
	uint32_t half = d / 2;

	for (uint32_t j = 0; j < half; j++) {
		double a = x[j * st], b = x[(j + half) * st];

		x[j * st] = c[j] * a - s[j] * b;
		x[(j + half) * st] = c[j] * b + s[j] * a;
	}
}

void kvd_bl_rotate(uint32_t d, const double *cbar, const double *sbar, double *mu, double *sigma) {
	rotate_vec(d, cbar, sbar, mu, 1);
	if (!sigma)
		return;
	/* R Sigma column by column, then (R Sigma) R^T row by row. */
	for (uint32_t col = 0; col < d; col++)
		rotate_vec(d, cbar, sbar, sigma + col, d);
	for (uint32_t row = 0; row < d; row++)
		rotate_vec(d, cbar, sbar, sigma + (size_t)row * d, 1);
}

uint32_t kvd_bl_adakv_round(uint32_t n_h, uint32_t budget, double floor_alpha) {
	/* Python int() of a double product; then torch's fp32 n*(1-f) + floor and round half
	 * to even. volatile: the product must round to fp32 before the sum, as in torch, and
	 * not be contracted into an fma. */
	uint32_t floor_budget = (uint32_t)((double)budget * floor_alpha);
	volatile float prod = (float)n_h * (float)(1.0 - floor_alpha);
	float x = prod + (float)floor_budget;

	return (uint32_t)rintf(x);
}

/* Python's // on integers. */
static int64_t floordiv(int64_t a, int64_t b) {
	int64_t q = a / b;

	if (a % b != 0 && ((a < 0) != (b < 0)))
		q--;
	return q;
}

int kvd_pyramidkv_budgets(uint32_t capacity, uint32_t window, uint32_t len, uint32_t n_layers,
			  uint32_t beta, uint32_t *ret_budgets) {
	int64_t B, n, min, max, step;

	if (!ret_budgets || capacity <= window || window > len || beta == 0 || n_layers == 0)
		return -EINVAL;
	B = (int64_t)capacity - window;
	n = (int64_t)len - window;
	if (len < capacity) {
		/* Published: a prompt shorter than the capacity is not compressed. */
		for (uint32_t l = 0; l < n_layers; l++)
			ret_budgets[l] = (uint32_t)n;
		return 0;
	}
	if (n_layers == 1 || len < 2 * (uint64_t)B) {
		/* Published: below 2B the pyramid would be clamped flat by len - w; every layer
		 * keeps B, as SnapKV. */
		for (uint32_t l = 0; l < n_layers; l++)
			ret_budgets[l] = (uint32_t)B;
		return 0;
	}
	min = B / beta;
	max = 2 * B - min;
	if (max >= n) {
		max = n;
		min = 2 * B - max;
	}
	step = floordiv(max - min, (int64_t)n_layers - 1);
	for (uint32_t l = 0; l < n_layers; l++) {
		int64_t v = max - (int64_t)l * step;

		/* Never outside [0, n] for len >= capacity; the clamp is only a guard. */
		ret_budgets[l] = (uint32_t)(v < 0 ? 0 : v > n ? n : v);
	}
	return 0;
}

int kvd_rope_inv_freq_llama3(uint32_t dim, double theta, double factor, double low_freq_factor,
			     double high_freq_factor, double original_max, float *ret_inv_freq) {
	double low_wl, high_wl;

	if (!ret_inv_freq || dim == 0 || dim % 2 != 0 || !(theta > 0) || !isfinite(theta) ||
	    factor < 0 || !isfinite(factor))
		return -EINVAL;
	if (factor > 0 && (!(low_freq_factor > 0) || !(high_freq_factor > low_freq_factor) ||
			   !(original_max > 0)))
		return -EINVAL;
	low_wl = original_max / low_freq_factor;
	high_wl = original_max / high_freq_factor;
	for (uint32_t j = 0; j < dim / 2; j++) {
		float inv = default_inv_freq(j, dim, (float)theta);
		double wl = 2 * M_PI / inv, r = inv;

		if (factor > 0) {
			if (wl > low_wl)
				r = inv / factor;
			else if (wl >= high_wl) {
				double smooth = (original_max / wl - low_freq_factor) /
						(high_freq_factor - low_freq_factor);

				r = (1 - smooth) * inv / factor + smooth * inv;
			}
		}
		ret_inv_freq[j] = (float)r;
	}
	return 0;
}

/* ---- AdaKV budgets, by sorting ---- */

struct flat {
	float v;
	uint32_t idx; /* head * n + position: the tie order */
};

/* Descending, NaN last, -0 == +0, then ascending index (select.h's order). */
static int flat_cmp(const void *a, const void *b) {
	const struct flat *x = a, *y = b;
	int xn = isnan(x->v), yn = isnan(y->v);

	if (xn != yn)
		return xn - yn;
	if (!xn && x->v != y->v)
		return x->v > y->v ? -1 : 1;
	return x->idx < y->idx ? -1 : x->idx > y->idx;
}

int kvd_adakv_budgets_ref(const float *scores, size_t stride, uint32_t heads, uint32_t n,
			  uint32_t budget, double floor_alpha, int normalize, uint32_t *ret_budgets) {
	struct flat *all, *head = NULL;
	uint8_t *top = NULL;
	uint32_t *count;
	size_t total = (size_t)heads * n, k = (size_t)heads * budget;

	if (!ret_budgets || (heads > 0 && n > 0 && !scores) || stride < n ||
	    !(floor_alpha >= 0 && floor_alpha <= 1))
		return -EINVAL;
	if (budget > n) {
		for (uint32_t h = 0; h < heads; h++)
			ret_budgets[h] = n;
		return 0;
	}
	all = malloc((total ? total : 1) * sizeof(*all));
	count = calloc(heads ? heads : 1, sizeof(*count));
	if (normalize) {
		top = malloc(n ? n : 1);
		head = malloc((n ? n : 1) * sizeof(*head));
	}
	if (!all || !count || (normalize && (!top || !head))) {
		free(all), free(count), free(top), free(head);
		return -ENOMEM;
	}
	for (uint32_t h = 0; h < heads; h++) {
		const float *row = scores + h * stride;
		float ratio = 1;

		if (normalize) {
			double mass = 0, sum = 0;

			/* Each head's top-budget mass over its total, both summed in position
			 * order (so that both paths add the same numbers in the same order). */
			for (uint32_t i = 0; i < n; i++)
				head[i] = (struct flat){ row[i], i };
			qsort(head, n, sizeof(*head), flat_cmp);
			memset(top, 0, n);
			for (uint32_t i = 0; i < budget; i++)
				top[head[i].idx] = 1;
			for (uint32_t i = 0; i < n; i++) {
				sum += row[i];
				if (top[i])
					mass += row[i];
			}
			ratio = (float)(mass / sum);
		}
		for (uint32_t i = 0; i < n; i++)
			all[(size_t)h * n + i] = (struct flat){ normalize ? row[i] * ratio : row[i],
							       (uint32_t)((size_t)h * n + i) };
	}
	qsort(all, total, sizeof(*all), flat_cmp);
	for (size_t i = 0; i < k; i++)
		count[all[i].idx / n]++;
	for (uint32_t h = 0; h < heads; h++)
		ret_budgets[h] = kvd_bl_adakv_round(count[h], budget, floor_alpha);
	free(all), free(count), free(top), free(head);
	return 0;
}

/* ---- the reference scores ---- */

static float load_at(const void *base, uint32_t dtype, size_t off) {
	return kvd_load(base, dtype, off);
}

static const void *krow(const struct kvd_attn_in *in, uint32_t g, uint32_t i) {
	return (const char *)in->k +
	       (g * in->k_head_stride + (size_t)i * in->k_row_stride) * kvd_dtype_size(in->dtype);
}

static const void *vrow(const struct kvd_attn_in *in, uint32_t g, uint32_t i) {
	return (const char *)in->v +
	       (g * in->v_head_stride + (size_t)i * in->v_row_stride) * kvd_dtype_size(in->dtype);
}

static int h2o_ref(const struct kvd_baseline_params *p, const struct kvd_attn_in *in,
		   float *qrows) {
	uint32_t L = in->len, w = in->window;
	float *prow = malloc((size_t)L * sizeof(float));
	double *acc = malloc((size_t)L * sizeof(double));
	int r = 0;

	if (!prow || !acc) {
		r = -ENOMEM;
		goto out;
	}
	for (uint32_t h = 0; h < in->heads; h++) {
		for (uint32_t i = 0; i < L; i++)
			acc[i] = 0;
		/* One query row at a time, as the queries arrive. */
		for (uint32_t t = 0; t < w; t++) {
			struct kvd_attn_in row;

			kvd_bl_window_rows(in, t, t + 1, &row);
			r = kvd_attn_head_ref(&row, h, prow);
			if (r < 0)
				goto out;
			for (uint32_t i = 0; i < row.len; i++)
				acc[i] += prow[i];
		}
		for (uint32_t i = 0; i < L; i++) {
			double s = acc[i];

			if (p->h2o_normalize)
				s /= kvd_bl_h2o_count(in, i);
			qrows[(size_t)h * L + i] = (float)s;
		}
	}
out:
	free(prow), free(acc);
	return r;
}

static int snap_ref(enum kvd_baseline b, const struct kvd_baseline_params *p,
		    const struct kvd_attn_in *in, float *qrows) {
	uint32_t L = in->len, w = in->window, n = L - w;
	int pool_after = kvd_bl_pool_after_mean(b, p, in);
	float *probs = malloc((size_t)w * L * sizeof(float));
	float *tmp = malloc((size_t)L * sizeof(float));
	int r = 0;

	if (!probs || !tmp) {
		r = -ENOMEM;
		goto out;
	}
	for (uint32_t h = 0; h < in->heads && r >= 0; h++) {
		float *row = qrows + (size_t)h * L;

		r = kvd_attn_head_ref(in, h, probs);
		if (r >= 0)
			r = kvd_temporal_agg_ref(p->temporal, p->alpha, probs, w, L, n, tmp);
		/* AdaKV over a group pools after the group mean (kvd_bl_finish). */
		if (r >= 0)
			r = kvd_pool_row_ref(pool_after ? KVD_POOL_NONE : p->pool, p->kernel, 0, tmp, n,
					     row);
		for (uint32_t i = n; i < L; i++)
			row[i] = 0;
	}
out:
	free(probs), free(tmp);
	return r;
}

static int tova_ref(const struct kvd_attn_in *in, float *layer) {
	uint32_t L = in->len;
	float *prow = malloc((size_t)L * sizeof(float));
	double *acc = calloc(L, sizeof(double));
	struct kvd_attn_in last;
	int r = 0;

	if (!prow || !acc) {
		r = -ENOMEM;
		goto out;
	}
	kvd_bl_window_rows(in, in->window - 1, in->window, &last);
	for (uint32_t h = 0; h < in->heads; h++) {
		r = kvd_attn_head_ref(&last, h, prow);
		if (r < 0)
			goto out;
		for (uint32_t i = 0; i < L; i++)
			acc[i] += prow[i];
	}
	for (uint32_t i = 0; i < L; i++)
		layer[i] = (float)(acc[i] / in->heads);
out:
	free(prow), free(acc);
	return r;
}

static void knorm_ref(const struct kvd_attn_in *in, float *kvrows) {
	for (uint32_t g = 0; g < in->kv_heads; g++)
		for (uint32_t i = 0; i < in->len; i++) {
			const void *k = krow(in, g, i);
			double s = 0;

			for (uint32_t j = 0; j < in->dim; j++) {
				double x = load_at(k, in->dtype, j);

				s += x * x;
			}
			kvrows[(size_t)g * in->len + i] = -(float)sqrt(s);
		}
}

static int keydiff_ref(const struct kvd_attn_in *in, float *kvrows) {
	uint32_t d = in->dim, L = in->len;
	double *anchor = malloc((size_t)d * sizeof(double));

	if (!anchor)
		return -ENOMEM;
	for (uint32_t g = 0; g < in->kv_heads; g++) {
		double an = 0;
		uint32_t finite = 0;

		for (uint32_t j = 0; j < d; j++)
			anchor[j] = 0;
		/* F.normalize(k, eps 1e-12), averaged over the finite keys. */
		for (uint32_t i = 0; i < L; i++) {
			const void *k = krow(in, g, i);
			double s = 0;
			int ok = 1;

			for (uint32_t j = 0; j < d; j++) {
				double x = load_at(k, in->dtype, j);

				ok &= isfinite(x) != 0;
				s += x * x;
			}
			if (!ok)
				continue;
			s = fmax(sqrt(s), 1e-12);
			for (uint32_t j = 0; j < d; j++)
				anchor[j] += load_at(k, in->dtype, j) / s;
			finite++;
		}
		for (uint32_t j = 0; j < d; j++) {
			anchor[j] /= finite ? finite : 1;
			an += anchor[j] * anchor[j];
		}
		an = fmax(sqrt(an), 1e-8);
		/* -F.cosine_similarity(k, anchor, eps 1e-8); non-finite keys score NaN -> -inf. */
		for (uint32_t i = 0; i < L; i++) {
			const void *k = krow(in, g, i);
			double dot = 0, kn = 0;
			int ok = 1;

			for (uint32_t j = 0; j < d; j++) {
				double x = load_at(k, in->dtype, j);

				ok &= isfinite(x) != 0;
				dot += x * anchor[j];
				kn += x * x;
			}
			kvrows[(size_t)g * L + i] =
				ok ? -(float)(dot / (fmax(sqrt(kn), 1e-8) * an)) : NAN;
		}
	}
	free(anchor);
	return 0;
}

static const void *eq_row(const struct kvd_baseline_params *p, const struct kvd_attn_in *in,
			  uint32_t h, uint32_t t) {
	return (const char *)p->eq_q +
	       (h * p->eq_head_stride + (size_t)t * p->eq_row_stride) * kvd_dtype_size(in->dtype);
}

static int ea_ref(const struct kvd_baseline_params *p, const struct kvd_attn_in *in, float *qrows,
		  float *vnorm) {
	uint32_t d = in->dim, L = in->len, H = in->heads, n0 = p->n_sink < L ? p->n_sink : L;
	uint32_t N = p->eq_rows - p->eq_first;
	double *cbar = malloc(d * sizeof(double)), *sbar = cbar ? cbar + d / 2 : NULL;
	double *mu = malloc(d * sizeof(double)), *sigma = malloc((size_t)d * d * sizeof(double));
	double *z = malloc((size_t)L * sizeof(double)), s = in->scale;
	int r = 0;

	if (!cbar || !mu || !sigma || !z) {
		r = -ENOMEM;
		goto out;
	}
	kvd_bl_rope_mean(p, in, cbar, sbar);
	for (uint32_t h = 0; h < H; h++) {
		uint32_t g = kvd_attn_kv_head(in, h);
		double max = -INFINITY, sum = 0;
		float *row = qrows + (size_t)h * L;

		/* Statistics of the pre-RoPE queries, from row eq_first. */
		for (uint32_t a = 0; a < d; a++)
			mu[a] = 0;
		for (uint32_t t = p->eq_first; t < p->eq_rows; t++) {
			const void *q = eq_row(p, in, h, t);

			for (uint32_t a = 0; a < d; a++)
				mu[a] += kvd_load(q, in->dtype, a);
		}
		for (uint32_t a = 0; a < d; a++)
			mu[a] /= N;
		for (size_t a = 0; a < (size_t)d * d; a++)
			sigma[a] = 0;
		if (p->use_covariance) {
			for (uint32_t t = p->eq_first; t < p->eq_rows; t++) {
				const void *q = eq_row(p, in, h, t);

				for (uint32_t a = 0; a < d; a++)
					for (uint32_t b = 0; b < d; b++)
						sigma[(size_t)a * d + b] +=
							(kvd_load(q, in->dtype, a) - mu[a]) *
							(kvd_load(q, in->dtype, b) - mu[b]);
			}
			for (size_t a = 0; a < (size_t)d * d; a++)
				sigma[a] /= N;
		}
		kvd_bl_rotate(d, cbar, sbar, mu, p->use_covariance ? sigma : NULL);

		/* z_i = s k.mu + s^2/2 k^T Sigma k, then a softmax over the non-sink tokens. */
		for (uint32_t i = n0; i < L; i++) {
			const void *k = krow(in, g, i);
			double lin = 0, quad = 0;

			for (uint32_t a = 0; a < d; a++) {
				double ka = load_at(k, in->dtype, a);

				lin += ka * mu[a];
				if (p->use_covariance)
					for (uint32_t b = 0; b < d; b++)
						quad += ka * sigma[(size_t)a * d + b] *
							load_at(k, in->dtype, b);
			}
			z[i] = s * lin + s * s / 2 * quad;
			if (z[i] > max)
				max = z[i];
		}
		for (uint32_t i = n0; i < L; i++) {
			z[i] = exp(z[i] - max);
			sum += z[i];
		}
		for (uint32_t i = 0; i < L; i++)
			row[i] = i < n0 ? 0 : (float)(z[i] / sum);
	}
	if (vnorm)
		for (uint32_t g = 0; g < in->kv_heads; g++)
			for (uint32_t i = 0; i < L; i++) {
				const void *v = vrow(in, g, i);
				double n2 = 0;

				for (uint32_t a = 0; a < d; a++) {
					double x = load_at(v, in->dtype, a);

					n2 += x * x;
				}
				vnorm[(size_t)g * L + i] = (float)sqrt(n2);
			}
out:
	free(cbar), free(mu), free(sigma), free(z);
	return r;
}

int kvd_baseline_scores_ref(enum kvd_baseline b, const struct kvd_baseline_params *p,
			    const struct kvd_attn_in *in, float *scores) {
	float *qrows = NULL, *vnorm = NULL;
	size_t nrows;
	int r;

	r = kvd_bl_check(b, p, in, scores);
	if (r < 0)
		return r;
	nrows = b == KVD_BASELINE_TOVA ? 1 : kvd_bl_per_kv_head(b) ? in->kv_heads : in->heads;
	if (b != KVD_BASELINE_STREAMINGLLM) {
		qrows = malloc(nrows * in->len * sizeof(float));
		if (!qrows)
			return -ENOMEM;
	}
	if (b == KVD_BASELINE_EXPECTED_ATTENTION && p->use_vnorm) {
		vnorm = malloc((size_t)in->kv_heads * in->len * sizeof(float));
		if (!vnorm) {
			free(qrows);
			return -ENOMEM;
		}
	}

	switch (b) {
	case KVD_BASELINE_H2O:
		r = h2o_ref(p, in, qrows);
		break;
	case KVD_BASELINE_SNAPKV:
	case KVD_BASELINE_PYRAMIDKV:
	case KVD_BASELINE_ADAKV:
		r = snap_ref(b, p, in, qrows);
		break;
	case KVD_BASELINE_TOVA:
		r = tova_ref(in, qrows);
		break;
	case KVD_BASELINE_KNORM:
		knorm_ref(in, qrows);
		break;
	case KVD_BASELINE_KEYDIFF:
		r = keydiff_ref(in, qrows);
		break;
	case KVD_BASELINE_EXPECTED_ATTENTION:
		r = ea_ref(p, in, qrows, vnorm);
		break;
	default:
		break;
	}
	if (r >= 0)
		r = kvd_bl_finish(b, p, in, qrows, vnorm, kvd_pool_row_ref, scores);
	free(qrows), free(vnorm);
	return r < 0 ? r : 0;
}
