/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Eviction policies by name (docs/architecture.md §5): each maps one layer's window queries, K and V
 * (and W_o's Gram matrices where it needs them) to the positions each head keeps. This is
 * the table behind `kvdctl score --policy` and the quality harness; the daemon's rounds
 * use the same scoring (score.h) with cross-round smoothing and node-wide selection on top.
 *
 * Budget. capacity counts tokens per row (kv head, query head, or layer) INCLUDING the
 * window, like ReST-KV's max_capacity_prompt: a row keeps capacity - w prefix tokens
 * ([0, L-w)) and then all w window tokens, always. When L <= capacity nothing is evicted.
 * Kept positions are returned ascending per row.
 *
 * Rows. granularity HEAD gives one row per kv head (the cache is GQA-native; per-query
 * quantities are aggregated over the group as each policy's kernel documents), or per
 * query head with per_query_head (the published ReST-KV layout, §1.7). LAYER gives one row
 * for the whole layer: the rows' prefix scores summed per token (the triangle bound for
 * the output-aware costs), and capacity tokens kept for all heads alike.
 *
 * The policies (what "keep" means for each; their definitions in docs/algorithms.md):
 *   full               every token.
 *   streamingllm       the first n_sink (4) tokens and the most recent ones (§5.1, ReST's
 *                      harness: 4 + (capacity - 4)); the window is among the most recent.
 *   h2o                heavy hitters by attention accumulated over the given window
 *                      queries (baselines.h), plus the window.
 *   snapkv, pyramidkv  window-summed, avg-pooled (k 5) attention, per-row top; PyramidKV's
 *                      budget for layer `layer` of `n_layers` (beta 20) replaces
 *                      capacity - w (§1.6).
 *   adakv              mean, max-pooled (k 7) attention, per-head budgets from the layer's
 *                      flattened top-k with the 0.2 floor (§1.6, §5.5).
 *   tova               the last query's attention averaged over all heads (one decision
 *                      for the layer), plus the window.
 *   knorm, keydiff     lowest key norm; most distinctive key (§5.7, 5.8), plus the window.
 *   expected_attention kvpress's expected attention with the window queries as the query
 *                      statistics (only post-RoPE queries are available offline; see
 *                      eq_q), sinks, plus the window.
 *   restkv             ReST-KV as published: output-reconstruction cost with the window EMA,
 *                      adaptive window pooling, per-row top-(capacity - w) (§1).
 *   laprox             LaProx-style CR costs (GQA-joint within a group), adaptive window
 *                      pooling, N1 shares, one top-k over all rows of the layer: rows keep
 *                      different numbers of tokens, rows * (capacity - w) prefix tokens in
 *                      all (§2.2).
 *   kvd                the default: ReST-KV costs with both smoothings (EMA + AWS), summed
 *                      over the GQA group, joined with KeyDiff's key novelty (each token
 *                      worth at least the cost of its novelty rank), N1 shares, and the same
 *                      layer-wide top-k as laprox (§7.1, §7.5).
 *   kvd-mi             kvd's ReST-KV costs, moment-informed (§4.4): each token's cost times
 *                      1 + mi_eta * its misfit (moments.h) against its kv head's summary of
 *                      what was evicted before (mi_mean_k, mi_count). A head whose summary
 *                      is empty (a sequence's first round) is measured against a provisional
 *                      one: the key mean of the prefix tokens those costs would drop
 *                      keeping capacity - w. Without summaries (mi_mean_k NULL) it is kvd
 *                      exactly; the daemon and kvdctl score pass empty ones for models
 *                      without moments.
 *   indexmem           IndexMem's learned indexer (indexmem.h): each token's I(s) against
 *                      the window's index queries, softmax over the layer's prefix as N1
 *                      shares (the same in every row). Reads no key of the model, only
 *                      index_q and index_k (below); rounds only (see kvd_policy_keep).
 * The output-aware policies (restkv, laprox, kvd) use W_o when gram is given and the
 * value-space norm otherwise.
 *
 * Selection follows select.h's order (NaN lowest, ties to the lower position), so the
 * result is deterministic and no input crashes it.
 */

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>

#include "attn.h"
#include "restkv.h"
#include "score.h"
#include "smooth.h"

enum kvd_policy {
	KVD_POLICY_FULL,
	KVD_POLICY_STREAMINGLLM,
	KVD_POLICY_H2O,
	KVD_POLICY_SNAPKV,
	KVD_POLICY_PYRAMIDKV,
	KVD_POLICY_ADAKV,
	KVD_POLICY_TOVA,
	KVD_POLICY_KNORM,
	KVD_POLICY_KEYDIFF,
	KVD_POLICY_EXPECTED_ATTENTION,
	KVD_POLICY_RESTKV,
	KVD_POLICY_LAPROX,
	KVD_POLICY_KVD,
	KVD_POLICY_KVD_MI,
	KVD_POLICY_INDEXMEM,
	_KVD_POLICY_MAX,
	_KVD_POLICY_INVALID = -EINVAL,
};

/* The names of kvd.conf(5)'s policy key ("full", ..., "expected_attention", "restkv",
 * "laprox", "kvd", "kvd-mi", "indexmem"). */
const char *kvd_policy_to_string(enum kvd_policy p);
enum kvd_policy kvd_policy_from_string(const char *s);

/* What a policy reads besides the window queries, K and V, and how it ranks: the one place
 * that says it, so that callers (the daemon's rounds) ask rather than name policies. */
#define KVD_POLICY_NEEDS_MOMENTS (1u << 0)  /* each kv head's summary of what was evicted
                                             * (mi_mean_k, mi_count; empty ones allowed) */
#define KVD_POLICY_NEEDS_INDEX (1u << 1)    /* index queries and keys (index_q, index_k);
                                             * where a model has no indexer, `fallback` ranks */
#define KVD_POLICY_LAYERWIDE_TOPK (1u << 2) /* one top-k over all rows of a layer */
#define KVD_POLICY_LAYER_PIPELINE (1u << 3) /* score.h's layer pipeline, which
                                             * kvd_policy_scores_via() can run elsewhere */

struct kvd_policy_info {
	const char *name;
	unsigned flags;                 /* KVD_POLICY_NEEDS_*, ... */
	enum kvd_policy fallback;       /* with NEEDS_INDEX: what ranks a model without index keys */
};

/* The policy's entry, or NULL for a value that is not a policy. */
const struct kvd_policy_info *kvd_policy_info(enum kvd_policy p);

enum kvd_granularity {
	KVD_GRANULARITY_HEAD,
	KVD_GRANULARITY_LAYER,
	_KVD_GRANULARITY_MAX,
	_KVD_GRANULARITY_INVALID = -EINVAL,
};

const char *kvd_granularity_to_string(enum kvd_granularity g);
enum kvd_granularity kvd_granularity_from_string(const char *s);

struct kvd_policy_params {
	enum kvd_policy policy;
	uint32_t capacity;               /* tokens per row, window included */
	enum kvd_granularity granularity;
	uint32_t per_query_head;         /* HEAD rows are query heads */
	/* Window smoothing and pooling, where the policy has them. */
	enum kvd_temporal_mode temporal;
	float alpha;
	enum kvd_pool_mode pooling;
	uint32_t kernel;
	double aws_scale;
	/* ReST-KV cost (restkv, kvd): metric, tau, use_norm; temporal/alpha above. */
	struct kvd_restkv_opts restkv;
	/* LaProx: the joint GQA form (else the diagonal sum); N2 layer weight. */
	uint32_t laprox_joint;
	float layer_weight;
	/* PyramidKV: this layer's index and the model's layer count; beta. */
	uint32_t layer, n_layers, beta;
	/* ExpectedAttention: pre-RoPE query statistics ([H][eq_rows][d], in->dtype), or NULL
	 * to use the window queries themselves. */
	const void *eq_q;
	uint32_t eq_rows;
	/* kvd-mi: per kv head, the key mean ([Hkv][d] fp32) and the token count of the
	 * summary of what was evicted (NULL: none); the misfit's weight. */
	const float *mi_mean_k;
	const uint64_t *mi_count;
	float mi_eta;
	/* indexmem: the window's index queries ([window][index_heads][index_dim], in->dtype,
	 * contiguous) and the index keys of the layer's len tokens (index_dim elements of
	 * in->dtype each, index_k_stride elements apart). */
	const void *index_q, *index_k;
	size_t index_k_stride;
	uint32_t index_heads, index_dim;
	uint32_t threads;                /* 0: the online CPUs */
	uint32_t reference;              /* run the plain-C reference kernels */
};

/*
 * The published defaults of policy (capacity left 0: set it). restkv/laprox/kvd/kvd-mi: after,
 * EMA 0.3, tau 1, adaptive pooling k 5, scale 2000 (laprox's own are not published: §2.2);
 * snapkv/pyramidkv: sum, avg k 5; adakv: mean, max k 7; laprox: joint; layer weight 1;
 * n_layers 1, beta 20; kvd-mi: no summary, mi_eta KVD_MI_ETA.
 */
#define KVD_MI_ETA 1.0f

void kvd_policy_params_default(enum kvd_policy policy, struct kvd_policy_params *p);

/* Kept positions: row r keeps pos[off[r]] .. pos[off[r+1]-1], ascending. */
struct kvd_keep {
	uint32_t rows;
	uint32_t *off; /* [rows + 1] */
	uint32_t *pos;
};

/* Frees k and its arrays; NULL is fine. Returns NULL. */
struct kvd_keep *kvd_keep_free(struct kvd_keep *k);

/*
 * Runs policy p on one layer: in (q, k, v; v may be NULL for policies that do not read it:
 * full, streamingllm, h2o, snapkv, pyramidkv, adakv, tova, knorm, keydiff), gram
 * ([H][d][d] G_h, or NULL), gram_group ([Hkv][g*d][g*d], or NULL: needed only for laprox's
 * joint form with W_o). On success *ret holds the keep sets; free it with kvd_keep_free().
 *
 * Returns 0, -EINVAL (bad in or params: capacity < w, an invalid policy or option, a
 * missing v or gram_group where needed), -EOPNOTSUPP (indexmem, which only rounds use:
 * index keys exist in engines' pools alone), -ENOMEM or -EAGAIN (threads).
 */
int kvd_policy_keep(const struct kvd_policy_params *p, const struct kvd_attn_in *in,
		    const float *gram, const float *gram_group, struct kvd_keep **ret);

/*
 * Node-wide comparable prefix values of one layer for policy p->policy, the input of the
 * daemon's eviction rounds (one call per (sequence, layer)): scores[rows][L - w] (row stride
 * L - w; rows = kvd_policy_score_rows(): kv heads, or query heads with per_query_head), where
 * a higher value means more valuable to keep, every value is finite and >= 0, and the
 * values of the whole layer sum to p->layer_weight. They are shares of the (sequence, layer)
 * (docs/algorithms.md §7.1, N1/N2), so that one global ranking can compare them across layers,
 * sequences and models:
 *  - restkv, laprox, kvd, kvd-mi: the output-aware costs (kvd-mi's with the misfit factor) (kvd_score_layer(), with the options of
 *    kvd_policy_keep()) as N1 shares of the whole layer times layer_weight; restkv's per-row
 *    costs are normalised over the whole layer too. Non-finite and negative costs count as
 *    0; a layer whose costs are all 0 gets equal values (no information to tell tokens apart).
 *  - the baselines (streamingllm, h2o, snapkv, pyramidkv, adakv, tova, knorm, keydiff,
 *    expected_attention): their scores only order tokens and live on incomparable scales,
 *    so they become N3 rank shares: within each row the token of rank r (0 = the lowest by
 *    select.h's order: NaN lowest, +inf, i.e. protected, highest, ties to the lower position)
 *    gets r + 1, and the layer's values are scaled to sum to layer_weight.
 *  - full: every value equal, layer_weight / (rows * (L - w)).
 *  - indexmem: softmax_s I(s) over the prefix (a non-finite I counts as no information:
 *    share 0, or equal shares when nothing is finite), times layer_weight / rows, in
 *    every row.
 * The rows are always heads: granularity is only checked, not used. capacity may be
 * anything: it only sets the AWS top-K of adaptive pooling, capacity - w when capacity > w,
 * else (L - w)/2 rounded up. When L == w there is no prefix: nothing is written (scores may
 * be NULL) and the call returns 0.
 *
 * in, gram and gram_group are as for kvd_policy_keep(). Returns 0, -EINVAL (bad in or params:
 * an invalid policy, granularity or option, a layer_weight not finite and >= 0, a missing
 * v or gram_group where needed, NULL scores), -ENOMEM, or -EAGAIN (threads).
 */
int kvd_policy_scores(const struct kvd_policy_params *p, const struct kvd_attn_in *in,
		      const float *gram, const float *gram_group, float *scores);

/*
 * A layer's costs by score.h's pipeline, as kvd_score_layer() computes them from in, gram,
 * gram_group and sp into scores[rows][L - w]; returns 0 or -errno.
 */
typedef int (*kvd_score_layer_fn)(void *userdata, const struct kvd_attn_in *in, const float *gram,
				  const float *gram_group, const struct kvd_score_params *sp,
				  float *scores);

/*
 * Whether kvd_policy_scores_via() takes policy: those whose costs are score.h's layer
 * pipeline alone (restkv, laprox, kvd). kvd-mi is not among them: its misfit reads K on
 * the CPU.
 */
bool kvd_policy_scores_via_layer(enum kvd_policy policy);

/*
 * kvd_policy_scores() with the layer pipeline computed by fn (the daemon's GPU path: in's
 * K and V, which only fn reads, may then be device memory). Returns what kvd_policy_scores
 * does, or -EOPNOTSUPP for a policy kvd_policy_scores_via_layer() does not take.
 */
int kvd_policy_scores_via(const struct kvd_policy_params *p, const struct kvd_attn_in *in,
			  const float *gram, const float *gram_group, kvd_score_layer_fn fn,
			  void *userdata, float *scores);

/* The rows kvd_policy_scores() writes for p and in: in->heads with per_query_head, else
 * in->kv_heads. */
uint32_t kvd_policy_score_rows(const struct kvd_policy_params *p, const struct kvd_attn_in *in);
