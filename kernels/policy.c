/* SPDX-License-Identifier: MIT */
/*
 * The policy table (see policy.h): every policy becomes prefix scores per row (the
 * baselines from baselines.h, the output-aware ones from score.h), per-row budgets (uniform,
 * PyramidKV's, AdaKV's, or one layer-wide top-k), and a selection (select.h) to which the
 * window is appended.
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "baselines.h"
#include "dtype.h"
#include "indexmem.h"
#include "moments.h"
#include "policy.h"
#include "score.h"
#include "select.h"

/* Every policy: its entry (policy.h) and the baseline kernel that scores it, if one does. */
static const struct policy {
	struct kvd_policy_info info;
	enum kvd_baseline baseline;
} policies[_KVD_POLICY_MAX] = {
#define POLICY(id, name, flags, baseline) \
	[KVD_POLICY_##id] = { { name, flags, KVD_POLICY_##id }, baseline }
#define NONE _KVD_BASELINE_INVALID
	POLICY(FULL, "full", 0, NONE),
	POLICY(STREAMINGLLM, "streamingllm", 0, KVD_BASELINE_STREAMINGLLM),
	POLICY(H2O, "h2o", 0, KVD_BASELINE_H2O),
	POLICY(SNAPKV, "snapkv", 0, KVD_BASELINE_SNAPKV),
	POLICY(PYRAMIDKV, "pyramidkv", 0, KVD_BASELINE_PYRAMIDKV),
	POLICY(ADAKV, "adakv", 0, KVD_BASELINE_ADAKV),
	POLICY(TOVA, "tova", 0, KVD_BASELINE_TOVA),
	POLICY(KNORM, "knorm", 0, KVD_BASELINE_KNORM),
	POLICY(KEYDIFF, "keydiff", 0, KVD_BASELINE_KEYDIFF),
	POLICY(EXPECTED_ATTENTION, "expected_attention", 0, KVD_BASELINE_EXPECTED_ATTENTION),
	POLICY(RESTKV, "restkv", KVD_POLICY_LAYER_PIPELINE, NONE),
	POLICY(LAPROX, "laprox", KVD_POLICY_LAYER_PIPELINE | KVD_POLICY_LAYERWIDE_TOPK, NONE),
	/* Not the layer pipeline alone: its key novelty reads K (novelty_union()). */
	POLICY(KVD, "kvd", KVD_POLICY_LAYERWIDE_TOPK, NONE),
	POLICY(KVD_MI, "kvd-mi", KVD_POLICY_NEEDS_MOMENTS | KVD_POLICY_LAYERWIDE_TOPK, NONE),
	[KVD_POLICY_INDEXMEM] = { { "indexmem", KVD_POLICY_NEEDS_INDEX, KVD_POLICY_KVD }, NONE },
#undef NONE
#undef POLICY
};

const struct kvd_policy_info *kvd_policy_info(enum kvd_policy p) {
	return (int)p >= 0 && p < _KVD_POLICY_MAX ? &policies[p].info : NULL;
}

const char *kvd_policy_to_string(enum kvd_policy p) {
	return (int)p >= 0 && p < _KVD_POLICY_MAX ? policies[p].info.name : NULL;
}

enum kvd_policy kvd_policy_from_string(const char *s) {
	for (int p = 0; s && p < _KVD_POLICY_MAX; p++)
		if (strcmp(s, policies[p].info.name) == 0)
			return (enum kvd_policy)p;
	return _KVD_POLICY_INVALID;
}

static const char *const granularity_names[_KVD_GRANULARITY_MAX] = {
	[KVD_GRANULARITY_HEAD] = "head",
	[KVD_GRANULARITY_LAYER] = "layer",
};

const char *kvd_granularity_to_string(enum kvd_granularity g) {
	return (int)g >= 0 && g < _KVD_GRANULARITY_MAX ? granularity_names[g] : NULL;
}

enum kvd_granularity kvd_granularity_from_string(const char *s) {
	for (int g = 0; s && g < _KVD_GRANULARITY_MAX; g++)
		if (strcmp(s, granularity_names[g]) == 0)
			return (enum kvd_granularity)g;
	return _KVD_GRANULARITY_INVALID;
}

/* The baseline behind a policy, or _KVD_BASELINE_INVALID for the others. */
static enum kvd_baseline baseline_of(enum kvd_policy p) {
	return policies[p].baseline;
}

void kvd_policy_params_default(enum kvd_policy policy, struct kvd_policy_params *p) {
	enum kvd_baseline b = baseline_of(policy);

	*p = (struct kvd_policy_params){
		.policy = policy,
		.temporal = KVD_TEMPORAL_EMA,
		.alpha = KVD_TEMPORAL_EMA_ALPHA,
		.pooling = KVD_POOL_ADAPTIVE,
		.kernel = KVD_POOL_KERNEL,
		.aws_scale = KVD_AWS_SCALE,
		.laprox_joint = 1,
		.layer_weight = 1.0f,
		.n_layers = 1,
		.beta = KVD_PYRAMIDKV_BETA,
		.mi_eta = KVD_MI_ETA,
	};
	kvd_restkv_opts_default(&p->restkv);
	if (b >= 0) {
		struct kvd_baseline_params bp;

		kvd_baseline_params_init(b, &bp);
		p->temporal = bp.temporal, p->alpha = bp.alpha, p->pooling = bp.pool;
		p->kernel = bp.kernel;
	} else if (policy == KVD_POLICY_FULL)
		p->pooling = KVD_POOL_NONE;
}

struct kvd_keep *kvd_keep_free(struct kvd_keep *k) {
	if (k) {
		free(k->off);
		free(k->pos);
		free(k);
	}
	return NULL;
}

/* Prefix scores from a baseline: scores[rows][L], the first L - w columns used. */
static int baseline_scores(enum kvd_baseline b, const struct kvd_policy_params *p,
			   const struct kvd_attn_in *in, float *scores) {
	struct kvd_baseline_params bp;

	kvd_baseline_params_init(b, &bp);
	bp.threads = p->threads;
	bp.per_query_head = p->per_query_head;
	if (b == KVD_BASELINE_SNAPKV || b == KVD_BASELINE_PYRAMIDKV || b == KVD_BASELINE_ADAKV) {
		bp.temporal = p->temporal, bp.alpha = p->alpha;
		bp.pool = p->pooling, bp.kernel = p->kernel;
	}
	if (b == KVD_BASELINE_EXPECTED_ATTENTION) {
		if (p->eq_q) {
			bp.eq_q = p->eq_q, bp.eq_rows = p->eq_rows;
			bp.eq_row_stride = in->dim, bp.eq_head_stride = (size_t)p->eq_rows * in->dim;
		} else {
			/* Offline there may be no pre-RoPE queries: the window's stand in, all of
			 * them (its first rows are not the prompt's sinks). */
			bp.eq_q = in->q, bp.eq_rows = in->window, bp.eq_first = 0;
			bp.eq_row_stride = in->q_row_stride, bp.eq_head_stride = in->q_head_stride;
		}
	}
	return p->reference ? kvd_baseline_scores_ref(b, &bp, in, scores) :
			      kvd_baseline_scores(b, &bp, in, scores);
}

/* A layer's costs by score.h's pipeline: fn (kvd_policy_scores_via) where given, else the
 * CPU's optimised kernels or, with p->reference, their references. */
static int own_scores(const struct kvd_policy_params *p, const struct kvd_attn_in *in,
		      const float *gram, const float *gram_group, kvd_score_layer_fn fn,
		      void *userdata, float *scores) {
	struct kvd_score_params sp;

	kvd_score_params_default(p->policy == KVD_POLICY_LAPROX ? KVD_SCORE_LAPROX : KVD_SCORE_RESTKV,
				 &sp);
	sp.restkv = p->restkv;
	sp.restkv.temporal = p->temporal, sp.restkv.alpha = p->alpha;
	sp.per_query_head = p->per_query_head;
	sp.laprox_joint = p->laprox_joint;
	sp.pooling = p->pooling, sp.kernel = p->kernel, sp.aws_scale = p->aws_scale;
	sp.aws_topk = p->capacity - in->window;
	/* N1: one (sequence, layer) per call; it decides nothing inside one layer, but makes
	 * the scores the shares a node-wide ranking compares. */
	sp.normalize = p->policy != KVD_POLICY_RESTKV;
	sp.layer_weight = p->layer_weight;
	sp.threads = p->threads;
	if (p->policy == KVD_POLICY_LAPROX && sp.laprox_joint && !sp.per_query_head && gram &&
	    !gram_group)
		return -EINVAL;
	if (fn)
		return fn(userdata, in, gram, gram_group, &sp, scores);
	return p->reference ? kvd_score_layer_ref(in, gram, gram_group, &sp, scores) :
			      kvd_score_layer(in, gram, gram_group, &sp, scores);
}

/* Policies whose rows share one layer-wide top-k (policy.h). */
static bool layerwide(enum kvd_policy p) {
	return policies[p].info.flags & KVD_POLICY_LAYERWIDE_TOPK;
}

/*
 * The key mean of the prefix tokens of kv head kv that the base costs would drop, keeping the
 * capacity - window highest (all of them dropped when capacity <= window): the summary a
 * round is about to build when the head has none yet. Without it kvd-mi would be kvd on a
 * sequence's first round, which is the only round of a one-shot eviction. Returns 1 with
 * mean[dim] set, 0 when nothing would be dropped, or -ENOMEM.
 */
static int provisional_mean(const struct kvd_policy_params *p, const struct kvd_attn_in *in, uint32_t kv,
			    const float *scores, size_t stride, uint32_t per, float *mean) {
	uint32_t n = in->len - in->window, d = in->dim;
	uint32_t keep = p->capacity > in->window ? p->capacity - in->window : 0;
	size_t es = kvd_dtype_size(in->dtype);
	float *sum = NULL, *key = NULL;
	uint32_t *kept = NULL;
	double *acc = NULL;
	bool *is_kept = NULL;
	uint64_t dropped = 0;
	int r = -ENOMEM;

	if (keep >= n)
		return 0;
	sum = malloc((size_t)n * sizeof(float));
	kept = malloc(((size_t)keep + 1) * sizeof(uint32_t));
	is_kept = calloc(n, sizeof(bool));
	acc = calloc(d, sizeof(double));
	key = malloc((size_t)d * sizeof(float));
	if (!sum || !kept || !is_kept || !acc || !key)
		goto out;
	/* A kv head's rows (its query heads when per_query_head) ranked together, by their sum. */
	for (uint32_t i = 0; i < n; i++) {
		float x = 0;

		for (uint32_t row = kv * per; row < (kv + 1) * per; row++)
			x += scores[row * stride + i];
		sum[i] = x;
	}
	r = kvd_topk(sum, n, keep, kept);
	if (r < 0)
		goto out;
	for (uint32_t j = 0; j < keep; j++)
		is_kept[kept[j]] = true;
	for (uint32_t i = 0; i < n; i++) {
		if (is_kept[i])
			continue;
		kvd_row_to_f32((const char *)in->k + ((size_t)kv * in->k_head_stride + (size_t)i * in->k_row_stride) * es,
			       in->dtype, d, key);
		for (uint32_t c = 0; c < d; c++)
			acc[c] += key[c];
		dropped++;
	}
	for (uint32_t c = 0; c < d; c++)
		mean[c] = (float)(acc[c] / (double)dropped);
	r = 1;
out:
	free(sum), free(kept), free(is_kept), free(acc), free(key);
	return r;
}

/*
 * kvd-mi: scores[rows][stride] (prefix columns) times 1 + mi_eta * misfit, per kv head,
 * against its summary of what was evicted, or against the provisional one above while the
 * summary is empty; a no-op for the other policies and without summaries (mi_mean_k NULL).
 */
static int mi_modulate(const struct kvd_policy_params *p, const struct kvd_attn_in *in, float *scores,
		       size_t stride) {
	uint32_t n = in->len - in->window, g = in->heads / in->kv_heads;
	uint32_t per = p->per_query_head ? g : 1;
	float *misfit, *provisional;
	int r = 0;

	if (!(policies[p->policy].info.flags & KVD_POLICY_NEEDS_MOMENTS) || !p->mi_mean_k ||
	    !p->mi_count || n == 0)
		return 0;
	misfit = malloc((size_t)n * sizeof(float));
	provisional = malloc((size_t)in->dim * sizeof(float));
	if (!misfit || !provisional) {
		r = -ENOMEM;
		goto out;
	}
	for (uint32_t kv = 0; kv < in->kv_heads; kv++) {
		const float *mean = p->mi_mean_k + (size_t)kv * in->dim;

		if (p->mi_count[kv] == 0) {
			r = provisional_mean(p, in, kv, scores, stride, per, provisional);
			if (r < 0)
				goto out;
			if (r == 0)
				continue;
			mean = provisional;
		}
		r = (p->reference ? kvd_moments_misfit_ref : kvd_moments_misfit)(in, kv, mean, misfit);
		if (r < 0)
			goto out;
		for (uint32_t row = kv * per; row < (kv + 1) * per; row++)
			for (uint32_t i = 0; i < n; i++)
				scores[row * stride + i] *= 1.0f + p->mi_eta * misfit[i];
	}
	r = 0;
out:
	free(misfit), free(provisional);
	return r;
}

/*
 * A key whose unsigned order is select.h's order, ascending: the score's bits made monotonic
 * in the high half (NaN 0, below -inf's 0x007fffff; -0.0 as +0.0), the complemented position
 * in the low half, so that of equal scores the higher position ranks lower.
 */
static uint64_t rank_key(float f, uint32_t i) {
	uint32_t u = 0;

	if (!isnan(f)) {
		if (f == 0)
			f = 0.0f;
		memcpy(&u, &f, sizeof(u));
		u = u >> 31 ? ~u : u | 0x80000000u;
	}
	return (uint64_t)u << 32 | (uint32_t)~i;
}

static int cmp_u64(const void *a, const void *b) {
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return (x > y) - (x < y);
}

/* The positions of s[n] in select.h's order, ascending, into order[n] (key: scratch[n]). */
static void rank_order(const float *s, uint32_t n, uint64_t *key, uint32_t *order) {
	for (uint32_t i = 0; i < n; i++)
		key[i] = rank_key(s[i], i);
	qsort(key, n, sizeof(*key), cmp_u64);
	for (uint32_t j = 0; j < n; j++)
		order[j] = (uint32_t)~key[j];
}

/*
 * kvd (docs/algorithms.md §7.5): ReST-KV's costs in scores[rows][stride] (prefix columns)
 * joined with KeyDiff's key novelty. In each row, the token whose key is the j-th least
 * novel of its kv head is worth at least the row's j-th lowest cost:
 *
 *     v_i = max(c_i, c_(j_i))
 *
 * So within the row a token ranks as the higher of its two ranks (kept when either the
 * window's queries need it or its key stands out, for queries the window has not shown),
 * and the row keeps ReST-KV's spread of values, which the node-wide ranking compares across
 * rows. Non-finite costs lend nothing (a sink's +inf stays its own). In place.
 */
static int novelty_union(const struct kvd_policy_params *p, const struct kvd_attn_in *in,
			 float *scores, size_t stride, uint32_t rows) {
	uint32_t n = in->len - in->window;
	float *novelty = malloc((size_t)rows * in->len * sizeof(float));
	float *sorted = malloc(((size_t)n + 1) * sizeof(float));
	uint64_t *key = malloc(((size_t)n + 1) * sizeof(uint64_t));
	uint32_t *order = malloc(((size_t)n + 1) * sizeof(uint32_t));
	int r = -ENOMEM;

	if (!novelty || !sorted || !key || !order)
		goto out;
	r = baseline_scores(KVD_BASELINE_KEYDIFF, p, in, novelty);
	if (r < 0)
		goto out;
	for (uint32_t row = 0; row < rows; row++) {
		float *c = scores + (size_t)row * stride;

		rank_order(c, n, key, order);
		for (uint32_t j = 0; j < n; j++)
			sorted[j] = c[order[j]];
		rank_order(novelty + (size_t)row * in->len, n, key, order);
		for (uint32_t j = 0; j < n; j++)
			if (isfinite(sorted[j]) && !(c[order[j]] >= sorted[j]))
				c[order[j]] = sorted[j];
	}
	r = 0;
out:
	free(novelty), free(sorted), free(key), free(order);
	return r;
}

/* The checks both entry points share; the capacity is kvd_policy_keep's alone. */
static int params_check(const struct kvd_policy_params *p, const struct kvd_attn_in *in) {
	if (!p || kvd_attn_in_check(in) < 0 || (int)p->policy < 0 || p->policy >= _KVD_POLICY_MAX ||
	    (int)p->granularity < 0 || p->granularity >= _KVD_GRANULARITY_MAX)
		return -EINVAL;
	if (p->policy == KVD_POLICY_PYRAMIDKV && (p->n_layers == 0 || p->layer >= p->n_layers))
		return -EINVAL;
	if ((policies[p->policy].info.flags & KVD_POLICY_NEEDS_MOMENTS) &&
	    (!isfinite(p->mi_eta) || p->mi_eta < 0))
		return -EINVAL;
	if ((policies[p->policy].info.flags & KVD_POLICY_NEEDS_INDEX) &&
	    (!p->index_q || !p->index_k || p->index_heads == 0 || p->index_heads > KVD_INDEX_HEADS_MAX ||
	     p->index_dim == 0 || p->index_dim > KVD_INDEX_DIM_MAX || p->index_k_stride < p->index_dim))
		return -EINVAL;
	return 0;
}

static struct kvd_keep *keep_new(uint32_t rows, size_t total) {
	struct kvd_keep *k = calloc(1, sizeof(*k));

	if (!k)
		return NULL;
	k->rows = rows;
	k->off = calloc(rows + 1, sizeof(uint32_t));
	k->pos = malloc((total ? total : 1) * sizeof(uint32_t));
	if (!k->off || !k->pos)
		return kvd_keep_free(k);
	return k;
}

int kvd_policy_keep(const struct kvd_policy_params *p, const struct kvd_attn_in *in,
		    const float *gram, const float *gram_group, struct kvd_keep **ret) {
	enum kvd_baseline b;
	uint32_t L, w, n, B, srows, rows, *budget = NULL, *sel = NULL;
	size_t stride, total = 0;
	float *scores = NULL;
	struct kvd_keep *k = NULL;
	int r;

	if (params_check(p, in) < 0 || p->capacity < in->window || !ret)
		return -EINVAL;
	/* Index keys exist in the daemon's blocks only. */
	if (policies[p->policy].info.flags & KVD_POLICY_NEEDS_INDEX)
		return -EOPNOTSUPP;
	b = baseline_of(p->policy);
	L = in->len, w = in->window, n = L - w, B = p->capacity - w;
	srows = kvd_policy_score_rows(p, in);
	rows = p->granularity == KVD_GRANULARITY_LAYER ? 1 : srows;

	if (p->policy == KVD_POLICY_FULL || L <= p->capacity) {
		k = keep_new(rows, (size_t)rows * L);
		if (!k)
			return -ENOMEM;
		for (uint32_t row = 0; row < rows; row++) {
			for (uint32_t i = 0; i < L; i++)
				k->pos[(size_t)row * L + i] = i;
			k->off[row + 1] = (row + 1) * L;
		}
		*ret = k;
		return 0;
	}
	if (b < 0 && !in->v)
		return -EINVAL;
	if (B == 0 && p->policy != KVD_POLICY_PYRAMIDKV) {
		/* No prefix budget: the window alone, nothing to score. */
		k = keep_new(rows, (size_t)rows * w);
		if (!k)
			return -ENOMEM;
		for (uint32_t row = 0; row < rows; row++) {
			for (uint32_t i = 0; i < w; i++)
				k->pos[(size_t)row * w + i] = n + i;
			k->off[row + 1] = (row + 1) * w;
		}
		*ret = k;
		return 0;
	}

	stride = b >= 0 ? L : n;
	r = -ENOMEM;
	scores = malloc(((size_t)srows * stride + 1) * sizeof(float));
	budget = calloc(srows, sizeof(uint32_t));
	if (!scores || !budget)
		goto out;
	r = b >= 0 ? baseline_scores(b, p, in, scores) :
		     own_scores(p, in, gram, gram_group, NULL, NULL, scores);
	if (r >= 0)
		r = mi_modulate(p, in, scores, stride);
	if (r >= 0 && p->policy == KVD_POLICY_KVD)
		r = novelty_union(p, in, scores, stride, srows);
	if (r < 0)
		goto out;

	if (rows == 1 && srows > 1) {
		/* One row for the layer: the rows' scores summed per token, in row order. */
		for (uint32_t row = 1; row < srows; row++)
			for (uint32_t i = 0; i < n; i++)
				scores[i] += scores[(size_t)row * stride + i];
	}
	for (uint32_t row = 0; row < rows; row++)
		budget[row] = B;
	if (p->policy == KVD_POLICY_PYRAMIDKV) {
		uint32_t *all = calloc(p->n_layers, sizeof(uint32_t));

		if (!all)
			goto out;
		r = kvd_pyramidkv_budgets(p->capacity, w, L, p->n_layers, p->beta, all);
		for (uint32_t row = 0; r >= 0 && row < rows; row++)
			budget[row] = all[p->layer];
		free(all);
		if (r < 0)
			goto out;
	} else if (p->policy == KVD_POLICY_ADAKV && rows > 1) {
		r = (p->reference ? kvd_adakv_budgets_ref : kvd_adakv_budgets)(
			scores, stride, rows, n, B, KVD_ADAKV_FLOOR_ALPHA, 0, budget);
		if (r < 0)
			goto out;
	}
	for (uint32_t row = 0; row < rows; row++) {
		if (budget[row] > n)
			budget[row] = n;
		total += budget[row] + w;
	}
	if (layerwide(p->policy) && rows > 1)
		/* Layer-wide ranking: at most the same number of tokens in all as uniform budgets. */
		total = (size_t)rows * (B + w);
	k = keep_new(rows, total);
	sel = malloc(((size_t)rows * n + 1) * sizeof(uint32_t));
	if (!k || !sel) {
		r = -ENOMEM;
		goto out;
	}

	if (layerwide(p->policy) && rows > 1) {
		const float **rp = calloc(rows, sizeof(*rp));
		uint32_t *lens = calloc(rows, sizeof(uint32_t));

		if (!rp || !lens) {
			free(rp), free(lens);
			r = -ENOMEM;
			goto out;
		}
		for (uint32_t row = 0; row < rows; row++)
			rp[row] = scores + (size_t)row * stride, lens[row] = n;
		r = (p->reference ? kvd_topk_rows_ref : kvd_topk_rows)(
			rp, lens, rows, (uint64_t)rows * B, p->threads, budget, sel);
		free(rp), free(lens);
		if (r < 0)
			goto out;
	}

	for (uint32_t row = 0, done = 0; row < rows; row++) {
		uint32_t *dst = k->pos + k->off[row];

		if (layerwide(p->policy) && rows > 1) {
			memcpy(dst, sel + done, budget[row] * sizeof(uint32_t));
			done += budget[row];
		} else {
			r = (p->reference ? kvd_topk_ref : kvd_topk)(scores + (size_t)row * stride, n,
								       budget[row], dst);
			if (r < 0)
				goto out;
		}
		for (uint32_t i = 0; i < w; i++)
			dst[budget[row] + i] = n + i;
		k->off[row + 1] = k->off[row] + budget[row] + w;
	}
	*ret = k;
	k = NULL;
	r = 0;
out:
	kvd_keep_free(k);
	free(sel);
	free(budget);
	free(scores);
	return r;
}

uint32_t kvd_policy_score_rows(const struct kvd_policy_params *p, const struct kvd_attn_in *in) {
	return p->per_query_head ? in->heads : in->kv_heads;
}

/*
 * N3: the ranks within each row of src[rows][stride] (its first n columns) into
 * dst[rows][n], rank r (0 lowest) as r + 1, scaled so that the layer sums to lambda.
 * A sort per row: O(n log n), and the keys make it deterministic whatever qsort does.
 */
static int rank_shares(const float *src, size_t stride, uint32_t rows, uint32_t n, float lambda,
		       float *dst) {
	uint64_t *key = malloc((size_t)n * sizeof(uint64_t));
	uint32_t *order = malloc((size_t)n * sizeof(uint32_t));
	/* Ranks 1..n sum to n(n + 1)/2 per row. */
	double unit = lambda / ((double)rows * n * (n + 1.0) / 2);

	if (!key || !order) {
		free(key), free(order);
		return -ENOMEM;
	}
	for (uint32_t row = 0; row < rows; row++) {
		rank_order(src + (size_t)row * stride, n, key, order);
		for (uint32_t r = 0; r < n; r++)
			dst[(size_t)row * n + order[r]] = (float)((r + 1.0) * unit);
	}
	free(key), free(order);
	return 0;
}

/*
 * N1 shares of c[n], one (sequence, layer), times lambda, in place. A NaN or infinite cost
 * says nothing about the token (bad K/V, attn.h), and a negative one is rounding below a
 * norm or a PSD form: they count as 0, so that the shares stay finite and sum to lambda.
 */
static void cost_shares(float *c, size_t n, float lambda) {
	double sum = 0;

	for (size_t i = 0; i < n; i++) {
		if (!(c[i] > 0) || isinf(c[i]))
			c[i] = 0;
		sum += c[i];
	}
	for (size_t i = 0; i < n; i++)
		c[i] = sum > 0 ? (float)(lambda * (c[i] / sum)) : (float)((double)lambda / (double)n);
}

/* indexmem: the softmax of the indexer's I(s) over the n prefix tokens, in every row. */
static int indexmem_shares(const struct kvd_policy_params *p, const struct kvd_attn_in *in,
			   uint32_t rows, uint32_t n, float *scores) {
	double sum = 0;
	float mx = -INFINITY, lambda = p->layer_weight / (float)rows;
	int r;

	r = (p->reference ? kvd_indexer_scores_ref : kvd_indexer_scores)(
		p->index_q, in->window, p->index_heads, p->index_k, p->index_k_stride, in->dtype, n,
		p->index_dim, scores);
	if (r < 0)
		return r;
	for (uint32_t i = 0; i < n; i++)
		if (isfinite(scores[i]) && scores[i] > mx)
			mx = scores[i];
	for (uint32_t i = 0; i < n; i++) {
		scores[i] = isfinite(scores[i]) ? expf(scores[i] - mx) : 0.0f;
		sum += scores[i];
	}
	for (uint32_t i = 0; i < n; i++)
		scores[i] = sum > 0 ? (float)(lambda * (scores[i] / sum)) : lambda / (float)n;
	for (uint32_t row = 1; row < rows; row++)
		memcpy(scores + (size_t)row * n, scores, n * sizeof(float));
	return 0;
}

static int policy_scores(const struct kvd_policy_params *p, const struct kvd_attn_in *in,
			 const float *gram, const float *gram_group, kvd_score_layer_fn fn,
			 void *userdata, float *scores) {
	enum kvd_baseline b;
	uint32_t n, rows;
	size_t total;
	float *all;
	int r;

	if (params_check(p, in) < 0 || !isfinite(p->layer_weight) || p->layer_weight < 0)
		return -EINVAL;
	n = in->len - in->window, rows = kvd_policy_score_rows(p, in), total = (size_t)rows * n;
	if (n == 0)
		return 0;
	if (!scores)
		return -EINVAL;
	b = baseline_of(p->policy);

	if (policies[p->policy].info.flags & KVD_POLICY_NEEDS_INDEX)
		return indexmem_shares(p, in, rows, n, scores);
	if (p->policy == KVD_POLICY_FULL) {
		float share = (float)((double)p->layer_weight / (double)total);

		for (size_t i = 0; i < total; i++)
			scores[i] = share;
		return 0;
	}
	if (b < 0) {
		struct kvd_policy_params q = *p;

		/* A round need not have a per-row capacity, but adaptive pooling needs a top-K:
		 * half the prefix stands in. The weight is applied once, after the cleaning. */
		if (q.capacity <= in->window)
			q.capacity = in->window + (n + 1) / 2;
		q.layer_weight = 1.0f;
		r = own_scores(&q, in, gram, gram_group, fn, userdata, scores);
		if (r >= 0)
			r = mi_modulate(&q, in, scores, n);
		if (r >= 0 && p->policy == KVD_POLICY_KVD)
			r = novelty_union(&q, in, scores, n, rows);
		if (r < 0)
			return r;
		cost_shares(scores, total, p->layer_weight);
		return 0;
	}

	/* Baselines score every position ([rows][L], the window +inf): rank the prefix only. */
	all = malloc((size_t)rows * in->len * sizeof(float));
	if (!all)
		return -ENOMEM;
	r = baseline_scores(b, p, in, all);
	if (r >= 0)
		r = rank_shares(all, in->len, rows, n, p->layer_weight, scores);
	free(all);
	return r;
}

int kvd_policy_scores(const struct kvd_policy_params *p, const struct kvd_attn_in *in,
		      const float *gram, const float *gram_group, float *scores) {
	return policy_scores(p, in, gram, gram_group, NULL, NULL, scores);
}

bool kvd_policy_scores_via_layer(enum kvd_policy policy) {
	return (int)policy >= 0 && policy < _KVD_POLICY_MAX &&
	       (policies[policy].info.flags & KVD_POLICY_LAYER_PIPELINE);
}

int kvd_policy_scores_via(const struct kvd_policy_params *p, const struct kvd_attn_in *in,
			  const float *gram, const float *gram_group, kvd_score_layer_fn fn,
			  void *userdata, float *scores) {
	if (!p || !fn)
		return -EINVAL;
	if (!kvd_policy_scores_via_layer(p->policy))
		return -EOPNOTSUPP;
	return policy_scores(p, in, gram, gram_group, fn, userdata, scores);
}
