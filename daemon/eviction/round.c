/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/layout.h"
#include "basic/macro.h"
#include "basic/time-util.h"
#include "compensate.h"
#include "policy.h"
#include "round-gpu.h"
#include "round.h"
#include "select.h"

static const char *const trigger_names[_ROUND_TRIGGER_MAX] = {
	[ROUND_WATERMARK] = "watermark",
	[ROUND_GRANT] = "grant",
	[ROUND_BUDGET] = "budget",
	[ROUND_EVICT] = "evict",
	[ROUND_INTERVAL] = "interval",
	[ROUND_CAP] = "cap",
	[ROUND_RECALL] = "recall",
};

const char *round_trigger_to_string(enum round_trigger t) {
	return t < _ROUND_TRIGGER_MAX ? trigger_names[t] : NULL;
}

/* Layer-token units on the per-head layout: one row per layer over its aligned tables. */
static bool rows_are_layers(const struct round_seq *q) {
	return q->unit == KVD_UNIT_LAYER_TOKEN;
}

uint32_t round_row_of_table(const struct round_seq *q, uint32_t t) {
	if (rows_are_layers(q) && q->layout == KVD_LAYOUT_PER_HEAD)
		return t / q->kv_heads;
	return t;
}

uint32_t round_table_of_row(const struct round_seq *q, uint32_t row) {
	if (rows_are_layers(q) && q->layout == KVD_LAYOUT_PER_HEAD)
		return row * q->kv_heads;
	return row;
}

/* The table of (layer, kv head), and where the head's rows start inside its blocks. */
static uint32_t table_of(const struct round_seq *q, uint32_t l, uint32_t kh) {
	return q->layout == KVD_LAYOUT_PER_HEAD ? l * q->kv_heads + kh : l;
}

/* Where a block's V rows start: half its K and V bytes, which its index keys follow. */
static uint64_t v_offset(const struct round_seq *q) {
	return (q->index_dim ? q->index_offset : q->block_bytes) / 2;
}

/*
 * Copies `part` bytes at offset off of each of the first nb blocks of table t into dst, back
 * to back (block b's at dst + b * part), of the last block its first `last` bytes only.
 * Blocks that lie one stride apart in one chunk (a grow's blocks usually do) go in one
 * read_rows: on a device pool, one driver call per run instead of per block. A run never
 * spans two chunks, even adjacent ones: each is an allocation of its own. Returns 0 or the
 * backend's -errno.
 */
static int read_blocks(const struct round *r, const struct round_seq *q, struct round_gpu *gpu,
                       uint32_t t, uint32_t nb, uint64_t off, uint64_t part, uint64_t last,
                       uint8_t *dst) {
	const uint8_t *const *blocks = q->block_addr + q->block_off[t];
	const uint32_t *chunk = q->block_chunk + q->block_off[t];

	for (uint32_t b = 0, run; b < nb; b += run) {
		uint8_t *to = dst + (uint64_t)b * part;
		int e;

		/* The last block (maybe partial) goes alone. */
		run = 1;
		while (b + run < nb - 1 && chunk[b + run] == chunk[b] &&
		       blocks[b + run] == blocks[b] + (uint64_t)run * q->block_stride)
			run++;
		/* With gpu, dst is a device buffer the copies stay on the device for. */
		if (gpu)
			e = round_gpu_copy_rows(gpu, to, part, blocks[b] + off, q->block_stride,
			                        b == nb - 1 ? last : part, run);
		else if (b == nb - 1)
			e = r->mem->read(q->device, blocks[b] + off, to, last);
		else if (run == 1)
			e = r->mem->read(q->device, blocks[b] + off, to, part);
		else
			e = r->mem->read_rows(q->device, blocks[b] + off, q->block_stride, to, part, run);
		if (e < 0)
			return e;
	}
	return 0;
}

/* Copies the K and V rows of slots [0, n) (n > 0) of (layer, kv head) into k and v,
 * contiguous: host memory, or with gpu device buffers. Returns 0 or the backend's -errno. */
static int gather(const struct round *r, const struct round_seq *q, struct round_gpu *gpu,
                  uint32_t l, uint32_t kh, uint32_t n, uint8_t *k, uint8_t *v) {
	uint32_t t = table_of(q, l, kh), bt = q->block_tokens, nb = DIV_ROUND_UP(n, bt);
	uint64_t row = (uint64_t)q->head_dim * layout_dtype_bytes(q->dtype);
	uint64_t head_off = q->layout == KVD_LAYOUT_PER_HEAD ? 0 : (uint64_t)kh * bt * row;
	uint64_t last = (uint64_t)(n - (nb - 1) * bt) * row;
	int e;

	e = read_blocks(r, q, gpu, t, nb, head_off, bt * row, last, k);
	return e < 0 ? e : read_blocks(r, q, gpu, t, nb, v_offset(q) + head_off, bt * row, last, v);
}

/* Copies the index keys of slots [0, n) (n > 0) of table t into ik, contiguous. Returns 0
 * or the backend's -errno. */
static int gather_index(const struct round *r, const struct round_seq *q, uint32_t t, uint32_t n,
                        uint8_t *ik) {
	uint32_t bt = q->block_tokens, nb = DIV_ROUND_UP(n, bt);
	uint64_t row = (uint64_t)q->index_dim * layout_dtype_bytes(q->dtype);

	return read_blocks(r, q, NULL, t, nb, q->index_offset, bt * row,
	                   (uint64_t)(n - (nb - 1) * bt) * row, ik);
}

/* Work buffers of one round, sized for its largest layer. */
struct scratch {
	uint8_t *k, *v, *ik;
	float *scores;
};

/*
 * The costs of kv heads [kh0, kh0 + nkv) of layer l by policy, from the K and V rows of
 * L slots in kb and vb (head after head, L rows each) and their index keys in ik (with
 * indexmem), the window's being the last: with gpu on that GPU, kb and vb there. Returns
 * 0 or a negative errno.
 */
static int policy_layer(struct round *r, struct round_seq *q, uint32_t l, uint32_t kh0, uint32_t nkv,
                        int policy, uint32_t L, const uint8_t *kb, const uint8_t *vb,
                        const uint8_t *ik, struct round_gpu *gpu, float *scores) {
	uint32_t g = q->q_heads / q->kv_heads, w = q->window;
	uint64_t row = (uint64_t)q->head_dim * layout_dtype_bytes(q->dtype);
	struct kvd_policy_params p;
	struct kvd_attn_in in;
	const float *gram;

	in = (struct kvd_attn_in){
		.dtype = q->dtype,
		.heads = nkv * g,
		.kv_heads = nkv,
		.window = w,
		.len = L,
		.dim = q->head_dim,
		.scale = 1.0f / sqrtf((float)q->head_dim),
		.q = (const uint8_t *)obs_queries(q->obs, l) + (uint64_t)kh0 * g * w * row,
		.k = kb,
		.v = vb,
	};
	kvd_attn_in_contiguous(&in);
	kvd_policy_params_default(policy, &p);
	/* What the adaptive pooling expects to keep: half the prefix, since a round's
	 * outcome for this layer is not known before the global selection. */
	p.capacity = w + (L - w + 1) / 2;
	p.laprox_joint = 0;
	p.layer = l;
	p.n_layers = q->layers;
	p.threads = r->threads;
	if ((kvd_policy_info(policy)->flags & KVD_POLICY_NEEDS_MOMENTS) && q->mi_mean_k) {
		uint64_t first = (uint64_t)l * q->kv_heads + kh0;

		p.mi_mean_k = q->mi_mean_k + first * q->head_dim;
		p.mi_count = q->mi_count + first;
	}
	if (kvd_policy_info(policy)->flags & KVD_POLICY_NEEDS_INDEX) {
		p.index_q = obs_index_queries(q->obs, l);
		p.index_k = ik;
		p.index_k_stride = q->index_dim;
		p.index_heads = q->index_heads;
		p.index_dim = q->index_dim;
	}
	gram = q->grams && q->grams[l] ? q->grams[l]->g + (uint64_t)kh0 * g * q->head_dim * q->head_dim
	                               : NULL;
	return gpu ? kvd_policy_scores_via(&p, &in, gram, NULL, round_gpu_score_layer, gpu, scores)
	           : kvd_policy_scores(&p, &in, gram, NULL, scores);
}

/*
 * The costs of kv heads [kh0, kh0 + nkv) of layer l over its first L slots into
 * sc->scores, by policy: with gpu on that GPU (round-gpu.h), the K/V gathered there, else
 * on the CPU. Returns 0 or a negative errno.
 */
static int layer_scores(struct round *r, struct round_seq *q, uint32_t l, uint32_t kh0, uint32_t nkv,
                        int policy, uint32_t L, struct round_gpu *gpu, struct scratch *sc) {
	uint32_t t0 = table_of(q, l, kh0);
	uint64_t row = (uint64_t)q->head_dim * layout_dtype_bytes(q->dtype);
	uint8_t *kb = sc->k, *vb = sc->v;
	int k;

	if (gpu) {
		k = round_gpu_kv(gpu, (uint64_t)nkv * L * row, &kb, &vb);
		if (k < 0)
			return k;
	}
	for (uint32_t j = 0; j < nkv; j++) {
		k = gather(r, q, gpu, l, kh0 + j, L, kb + (uint64_t)j * L * row,
		           vb + (uint64_t)j * L * row);
		if (k < 0)
			return k;
	}
	if (kvd_policy_info(policy)->flags & KVD_POLICY_NEEDS_INDEX) {
		/* The aligned tables of a layer hold the same tokens: kh0's keys stand for all. */
		k = gather_index(r, q, t0, L, sc->ik);
		if (k < 0)
			return k;
	}
	return policy_layer(r, q, l, kh0, nkv, policy, L, kb, vb, sc->ik, gpu, sc->scores);
}


/*
 * Scores kv heads [kh0, kh0 + nkv) of layer l (their tables all hold the same slots when
 * nkv > 1) and folds the costs into the rows' S. Returns 0 or a negative errno.
 */
static int score_heads(struct round *r, struct round_seq *q, uint32_t l, uint32_t kh0, uint32_t nkv,
                       float share, struct scratch *sc) {
	uint32_t t0 = table_of(q, l, kh0), w = q->window;
	uint32_t n = q->tokens[t0], end = q->window_end[t0];
	int policy = r->tenants[q->tenant].policy, k = -ENODEV;
	uint32_t L, prefix;

	if ((kvd_policy_info(policy)->flags & KVD_POLICY_NEEDS_INDEX) && q->index_dim == 0)
		/* A model registered without an indexer has no index keys. */
		policy = kvd_policy_info(policy)->fallback;
	if (end > w) {
		L = end;
	} else {
		/* No window for this layer: recency ranks it, over everything resident. */
		policy = KVD_POLICY_STREAMINGLLM;
		L = n;
	}
	if (L <= w)
		return 0;
	prefix = L - w;
	/* The GPU scores where it can, the K/V staying there; where it cannot (its memory, a
	 * limit of its kernels), the CPU scores the layer. */
	if (r->gpu && r->gpu[q->device] && kvd_policy_scores_via_layer(policy) &&
	    q->head_dim <= ROUND_GPU_DIM_MAX) {
		int none = 0;

		k = layer_scores(r, q, l, kh0, nkv, policy, L, r->gpu[q->device], sc);
		/* Counted either way: a fallback must never pass for GPU scoring (status
		 * gpu_fallbacks, a warning at the first). */
		if (k >= 0)
			__atomic_fetch_add(&r->gpu_layers, 1, __ATOMIC_RELAXED);
		else if (__atomic_fetch_add(&r->gpu_fallbacks, 1, __ATOMIC_RELAXED) == 0)
			__atomic_compare_exchange_n(&r->gpu_error, &none, k, false, __ATOMIC_RELAXED,
			                            __ATOMIC_RELAXED);
	}
	if (k < 0)
		k = layer_scores(r, q, l, kh0, nkv, policy, L, NULL, sc);
	if (k < 0)
		return k;

	/* One row per call: a layer's row sums its kv heads (the triangle bound, §7.1), a
	 * table's row is its one head. */
	for (uint32_t j = 1; j < nkv; j++)
		for (uint32_t i = 0; i < prefix; i++)
			sc->scores[i] += sc->scores[(uint64_t)j * prefix + i];
	{
		uint32_t rw = round_row_of_table(q, t0);
		float *S = q->smooth_out[rw];
		const float *S0 = q->smooth_in ? q->smooth_in[rw] : NULL;

		for (uint32_t i = 0; i < prefix; i++) {
			float x = share * sc->scores[i];

			S[i] = S0 && S0[i] >= 0 ? (1 - ROUND_BETA) * S0[i] + ROUND_BETA * x : x;
		}
	}
	return 0;
}

static int score_seq(struct round *r, struct round_seq *q, struct scratch *sc) {
	bool aligned = q->layout == KVD_LAYOUT_PER_LAYER || rows_are_layers(q);
	int k;

	for (uint32_t rw = 0; rw < q->rows; rw++) {
		uint32_t n = q->tokens[round_table_of_row(q, rw)];
		const float *S0 = q->smooth_in ? q->smooth_in[rw] : NULL;

		q->smooth_out[rw] = malloc(MAX(n, 1u) * sizeof(float));
		if (!q->smooth_out[rw])
			return -ENOMEM;
		/* Slots a layer does not score this round keep what they had. */
		for (uint32_t i = 0; i < n; i++)
			q->smooth_out[rw][i] = S0 ? S0[i] : ROUND_UNSCORED;
	}
	for (uint32_t l = 0; l < q->layers; l++) {
		if (aligned) {
			k = score_heads(r, q, l, 0, q->kv_heads, 1.0f, sc);
			if (k < 0)
				return k;
			continue;
		}
		for (uint32_t kh = 0; kh < q->kv_heads; kh++) {
			/* Each head's call is normalised alone: weigh it so that the layer's
			 * shares still sum to one. */
			k = score_heads(r, q, l, kh, 1, 1.0f / (float)q->kv_heads, sc);
			if (k < 0)
				return k;
		}
	}
	return 0;
}

/* ---- selection ---- */

struct units {
	uint64_t n, cap;
	float *value;
	uint32_t *bytes;
	uint8_t *state;               /* UNIT_* */
	uint32_t *slot;               /* first slot of the unit in its row */
	uint32_t *group;              /* per unit */
	/* Per group: its sequence and row, its unit range, how many it may still give. */
	uint32_t n_groups;
	uint32_t *g_seq, *g_row, *g_start, *g_max;
	uint32_t *s_group;            /* per sequence: its first group (one per row) */
	float *raw;                   /* S without the weight, for the predicted error */
};

enum {
	UNIT_CANDIDATE,
	UNIT_EXCLUDED,
	UNIT_SELECTED,
};

static void units_done(struct units *u) {
	free(u->value);
	free(u->bytes);
	free(u->state);
	free(u->slot);
	free(u->group);
	free(u->g_seq);
	free(u->g_row);
	free(u->g_start);
	free(u->g_max);
	free(u->s_group);
	free(u->raw);
}

static uint32_t unit_bytes(const struct round_seq *q) {
	uint64_t row = (uint64_t)q->head_dim * layout_dtype_bytes(q->dtype) * 2;
	/* A token's index key goes with it: one per table. */
	uint64_t index = (uint64_t)q->index_dim * layout_dtype_bytes(q->dtype);

	switch (q->unit) {
	case KVD_UNIT_HEAD_TOKEN:
		return (uint32_t)(row + index);
	case KVD_UNIT_LAYER_TOKEN:
		return (uint32_t)(row * q->kv_heads +
		                  index * (q->layout == KVD_LAYOUT_PER_HEAD ? q->kv_heads : 1));
	default:
		return (uint32_t)q->block_bytes;
	}
}

/* Slots of a row that a round may take: after the sinks, before the protected end. */
static void row_range(const struct round_seq *q, uint32_t rw, uint32_t *ret_lo, uint32_t *ret_hi) {
	uint32_t t = round_table_of_row(q, rw), n = q->tokens[t], end = q->window_end[t];
	uint32_t hi = end > q->window ? end - q->window : (n > q->window ? n - q->window : 0);

	/* The open tail block is the engine's to fill; slots grown since its last unpin are
	 * not written yet (their K/V would score as nothing, and go first). */
	hi = MIN(hi, n - n % q->block_tokens);
	hi = MIN(hi, q->written_end[t]);
	*ret_lo = MIN(q->sink_slots[t], hi);
	*ret_hi = hi;
}

static int units_build(struct round *r, struct units *u) {
	uint64_t n = 0, groups = 0;

	for (uint32_t s = 0; s < r->n_seqs; s++) {
		const struct round_seq *q = &r->seqs[s];

		if (!q->smooth_out)
			continue;
		groups += q->rows;
		for (uint32_t rw = 0; rw < q->rows; rw++) {
			uint32_t lo, hi;

			row_range(q, rw, &lo, &hi);
			n += hi - lo;
		}
	}
	if (n > UINT32_MAX || groups > UINT32_MAX)
		return -E2BIG;
	u->cap = n;
	u->value = malloc(MAX(n, 1u) * sizeof(float));
	u->raw = malloc(MAX(n, 1u) * sizeof(float));
	u->bytes = malloc(MAX(n, 1u) * sizeof(uint32_t));
	u->state = calloc(MAX(n, 1u), 1);
	u->slot = malloc(MAX(n, 1u) * sizeof(uint32_t));
	u->group = malloc(MAX(n, 1u) * sizeof(uint32_t));
	u->g_seq = malloc(MAX(groups, 1u) * sizeof(uint32_t));
	u->g_row = malloc(MAX(groups, 1u) * sizeof(uint32_t));
	u->g_start = malloc((groups + 1) * sizeof(uint32_t));
	u->g_max = malloc(MAX(groups, 1u) * sizeof(uint32_t));
	u->s_group = malloc(MAX(r->n_seqs, 1u) * sizeof(uint32_t));
	if (!u->s_group || !u->value || !u->raw || !u->bytes || !u->state || !u->slot || !u->group || !u->g_seq ||
	    !u->g_row || !u->g_start || !u->g_max)
		return -ENOMEM;

	for (uint32_t s = 0; s < r->n_seqs; s++) {
		const struct round_seq *q = &r->seqs[s];
		const struct round_tenant *rt = &r->tenants[q->tenant];
		uint32_t bytes = unit_bytes(q), bt = q->block_tokens;

		u->s_group[s] = u->n_groups;
		if (!q->smooth_out)
			continue;
		for (uint32_t rw = 0; rw < q->rows; rw++) {
			uint32_t t = round_table_of_row(q, rw), tokens = q->tokens[t], lo, hi, g = u->n_groups++;
			/* The floor: a row keeps at least floor_pct of its tokens. */
			uint64_t keep = ((uint64_t)tokens * r->floor_pct + 99) / 100;
			uint32_t may = tokens > keep ? (uint32_t)(tokens - keep) : 0;
			const float *S = q->smooth_out[rw];

			row_range(q, rw, &lo, &hi);
			u->g_seq[g] = s;
			u->g_row[g] = rw;
			u->g_start[g] = (uint32_t)u->n;
			if (q->unit == KVD_UNIT_BLOCK) {
				uint32_t b0 = DIV_ROUND_UP(lo, bt), b1 = hi / bt, n_tok = b1 * bt;
				_cleanup_(freep) float *blocks = malloc(MAX(b1, 1u) * sizeof(float));
				_cleanup_(freep) uint8_t *needle = malloc(MAX(b1, 1u));

				if (!blocks || !needle)
					return -ENOMEM;
				if (n_tok > 0 && kvd_block_scores(S, n_tok, bt, KVD_NEEDLE_PPM_DEFAULT, blocks,
				                                  needle) < 0)
					return -EINVAL;
				for (uint32_t b = b0; b < b1; b++) {
					bool scored = true;

					for (uint32_t i = b * bt; i < (b + 1) * bt; i++)
						scored = scored && S[i] >= 0;
					if (!scored || needle[b])
						continue;
					u->raw[u->n] = blocks[b];
					u->value[u->n] = blocks[b] * (float)rt->weight;
					u->bytes[u->n] = bytes;
					u->slot[u->n] = b * bt;
					u->group[u->n] = g;
					u->n++;
				}
				u->g_max[g] = may / bt;
			} else {
				for (uint32_t i = lo; i < hi; i++) {
					if (S[i] < 0)
						continue;
					u->raw[u->n] = S[i];
					u->value[u->n] = S[i] * (float)rt->weight;
					u->bytes[u->n] = bytes;
					u->slot[u->n] = i;
					u->group[u->n] = g;
					u->n++;
				}
				u->g_max[g] = may;
			}
		}
	}
	u->g_start[u->n_groups] = (uint32_t)u->n;
	return 0;
}

static float unit_density(const struct units *u, uint32_t i) {
	return kvd_density(u->value[i], u->bytes[i]);
}

/* Orders unit ids by density, then by id: the greedy's own order (select.h). */
static int cmp_density(const void *a, const void *b, void *userdata) {
	const struct units *u = userdata;
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
	float dx = unit_density(u, x), dy = unit_density(u, y);

	if (isnan(dx) != isnan(dy))
		return isnan(dx) ? -1 : 1;
	if (dx != dy && !isnan(dx))
		return dx < dy ? -1 : 1;
	return x > y ? -1 : x < y;
}

/*
 * One greedy pass over the candidates of the tenants allowed by `allowed` (NULL: all),
 * taking up to target bytes, each tenant at most allowance[tenant] bytes. Accepted units
 * become UNIT_SELECTED; their bytes are added to *taken. Returns 0 or a negative errno.
 */
static int select_pass(struct round *r, struct units *u, const bool *allowed, uint64_t *allowance,
                       uint64_t target, uint64_t *taken, void *scratch, size_t scratch_bytes) {
	_cleanup_(freep) uint8_t *pinned = malloc(MAX(u->n, 1u));
	_cleanup_(freep) uint32_t *ids = malloc(MAX(u->n, 1u) * sizeof(uint32_t));
	_cleanup_(freep) uint64_t *got = calloc(r->n_tenants, sizeof(uint64_t));
	_cleanup_(freep) bool *over = calloc(r->n_tenants, sizeof(bool));
	uint64_t done = 0;

	if (!pinned || !ids || !got || !over)
		return -ENOMEM;
	/* Each round of this loop either meets the target or closes a tenant for good. */
	for (uint32_t pass = 0; pass <= r->n_tenants && done < target; pass++) {
		struct kvd_evict_in in = {
			.n = (uint32_t)u->n,
			.value = u->value,
			.bytes = u->bytes,
			.pinned = pinned,
			.n_groups = u->n_groups,
			.group_start = u->g_start,
			.group_max_units = u->g_max,
			.target = target - done,
		};
		uint32_t n_ids;
		uint64_t freed;
		bool trimmed = false, any_over = false;
		int k;

		for (uint64_t i = 0; i < u->n; i++) {
			uint32_t tn = r->seqs[u->g_seq[u->group[i]]].tenant;

			pinned[i] = u->state[i] != UNIT_CANDIDATE || (allowed && !allowed[tn]) ||
			            allowance[tn] == 0;
		}
		k = kvd_evict_greedy_buf(&in, scratch, scratch_bytes, ids, &n_ids, &freed);
		if (k < 0)
			return k;
		if (n_ids == 0)
			break;
		memset(got, 0, r->n_tenants * sizeof(uint64_t));
		for (uint32_t j = 0; j < n_ids; j++)
			got[r->seqs[u->g_seq[u->group[ids[j]]]].tenant] += u->bytes[ids[j]];
		for (uint32_t tn = 0; tn < r->n_tenants; tn++) {
			over[tn] = got[tn] > allowance[tn];
			any_over = any_over || over[tn];
		}
		/* A tenant past its allowance keeps its cheapest units up to it, and is done:
		 * only then does the order matter (a sort of the selected units, not of all). */
		if (any_over)
			qsort_r(ids, n_ids, sizeof(*ids), cmp_density, u);
		for (uint32_t j = 0; j < n_ids; j++) {
			uint32_t id = ids[j], g = u->group[id], tn = r->seqs[u->g_seq[g]].tenant;

			if (over[tn] && u->bytes[id] > allowance[tn]) {
				trimmed = true;
				continue;
			}
			u->state[id] = UNIT_SELECTED;
			u->g_max[g]--;
			allowance[tn] -= u->bytes[id];
			done += u->bytes[id];
		}
		for (uint32_t tn = 0; tn < r->n_tenants; tn++)
			if (over[tn])
				allowance[tn] = 0;
		if (!trimmed)
			break;
	}
	*taken += done;
	return 0;
}

/*
 * What each tenant keeps in a round ranked across tenants: its fair share of what the
 * tenants that may give (those above their min) will hold once the rest of the target is
 * taken, split by weight, or its min if higher. held: each tenant's bytes less what the
 * round took already; rest: the bytes still to take. The shares sum to what is left, so
 * the target is met from what tenants hold above them, unless those bytes are pinned,
 * protected or waiting for an unpin: the round then takes less, and the next one the rest.
 *
 * Without the floor, whoever is between two steps pays for the growth of the tenants busy
 * at that moment (their sequences pinned, their plans waiting), and a short sequence goes
 * down to a few tokens one round and keeps all of them the next. With it a tenant keeps at
 * least what equal caps would give it, and the value ranking shares out what some tenants
 * do not need.
 */
static void fair_keep(const struct round *r, const uint64_t *held, uint64_t rest, uint64_t *keep) {
	double weights = 0, hold = 0;

	for (uint32_t tn = 0; tn < r->n_tenants; tn++)
		if (held[tn] > r->tenants[tn].min)
			weights += r->tenants[tn].weight, hold += (double)held[tn];
	hold = hold > (double)rest ? hold - (double)rest : 0;
	for (uint32_t tn = 0; tn < r->n_tenants; tn++) {
		const struct round_tenant *rt = &r->tenants[tn];
		uint64_t fair = held[tn] > rt->min ? (uint64_t)(hold * rt->weight / weights) : 0;

		keep[tn] = MAX(rt->min, fair);
	}
}

static int select_units(struct round *r, struct units *u) {
	_cleanup_(freep) uint64_t *allowance = calloc(MAX(r->n_tenants, 1u), sizeof(uint64_t));
	_cleanup_(freep) bool *allowed = calloc(MAX(r->n_tenants, 1u), sizeof(bool));
	_cleanup_(freep) uint64_t *held = calloc(MAX(r->n_tenants, 1u), sizeof(uint64_t));
	_cleanup_(freep) uint64_t *keep = calloc(MAX(r->n_tenants, 1u), sizeof(uint64_t));
	_cleanup_(freep) uint64_t *slack = calloc(MAX(r->n_tenants, 1u), sizeof(uint64_t));
	/* One scratch for every pass of the round: its pages fault in once. */
	size_t scratch_bytes = kvd_evict_greedy_scratch_bytes((uint32_t)u->n);
	_cleanup_(freep) void *scratch = malloc(scratch_bytes);
	uint64_t taken = 0;
	int k;

	if (!allowance || !allowed || !held || !keep || !slack || !scratch)
		return -ENOMEM;
	/* First, each tenant over its cap gives up the excess, from its own units, and so does
	 * one whose waiting grows would pass it: only its own bytes can serve them. */
	for (uint32_t tn = 0; tn < r->n_tenants; tn++) {
		const struct round_tenant *rt = &r->tenants[tn];
		uint64_t excess, got = 0;

		if (rt->max == KVD_TENANT_NO_CAP || rt->used + rt->waiting <= rt->max)
			continue;
		excess = rt->used + rt->waiting - rt->max;
		memset(allowed, 0, r->n_tenants * sizeof(bool));
		allowed[tn] = true;
		allowance[tn] = excess;
		k = select_pass(r, u, allowed, allowance, excess, &got, scratch, scratch_bytes);
		if (k < 0)
			return k;
		taken += got;
	}
	/* A round for lowered caps takes the excess and nothing else: the others are not
	 * short of anything. */
	if (taken >= r->target || r->trigger == ROUND_CAP)
		return 0;
	/* Then the rest: across tenants, none below what fair_keep() leaves it; from the one
	 * named (a request on one tenant), down to its guaranteed minimum. Units are whole: a
	 * share that ends inside a unit would leave each tenant up to one unit above it and
	 * the round short of its target by as many, so each may go below its share (never its
	 * min) by less than its largest unit (slack). */
	for (uint32_t tn = 0; tn < r->n_tenants; tn++)
		held[tn] = r->tenants[tn].used;
	for (uint64_t i = 0; i < u->n; i++) {
		uint32_t tn = r->seqs[u->g_seq[u->group[i]]].tenant;

		if (u->state[i] == UNIT_SELECTED)
			held[tn] -= MIN(held[tn], (uint64_t)u->bytes[i]);
		slack[tn] = MAX(slack[tn], (uint64_t)u->bytes[i] - 1);
	}
	if (r->only < 0)
		fair_keep(r, held, r->target - taken, keep);
	for (uint32_t tn = 0; tn < r->n_tenants; tn++) {
		uint64_t floor = r->only < 0 ? MAX(r->tenants[tn].min, keep[tn] - MIN(keep[tn], slack[tn]))
		                             : r->tenants[tn].min;

		allowed[tn] = r->only < 0 || (uint32_t)r->only == tn;
		allowance[tn] = held[tn] > floor ? held[tn] - floor : 0;
	}
	return select_pass(r, u, allowed, allowance, r->target - taken, &taken, scratch, scratch_bytes);
}

/* Turns the selected units into each sequence's per-table drop lists. */
static int units_plan(struct round *r, const struct units *u) {
	_cleanup_(freep) uint64_t *count = calloc(MAX(r->n_seqs, 1u), sizeof(uint64_t));

	if (!count)
		return -ENOMEM;
	for (uint64_t i = 0; i < u->n; i++)
		if (u->state[i] == UNIT_SELECTED) {
			uint32_t s = u->g_seq[u->group[i]];
			struct round_seq *q = &r->seqs[s];
			struct round_tenant *rt = &r->tenants[q->tenant];

			count[s]++;
			q->dropped_units++;
			rt->freed_bytes += u->bytes[i];
			rt->predicted += u->raw[i];
			r->selected_bytes += u->bytes[i];
			r->predicted_error += u->raw[i];
		}
	for (uint32_t s = 0; s < r->n_seqs; s++) {
		struct round_seq *q = &r->seqs[s];
		struct round_tenant *rt = &r->tenants[q->tenant];
		uint32_t per = q->unit == KVD_UNIT_BLOCK ? q->block_tokens : 1;
		uint32_t tables = rows_are_layers(q) && q->layout == KVD_LAYOUT_PER_HEAD ? q->kv_heads : 1;
		uint32_t at = 0;

		if (count[s] == 0)
			continue;
		q->drop_off = calloc(q->n_tables + 1, sizeof(uint32_t));
		q->drop_slots = malloc(count[s] * per * tables * sizeof(uint32_t));
		if (!q->drop_off || !q->drop_slots)
			return -ENOMEM;
		/* Table order, so that drop_off is a prefix sum; a layer row's tables all
		 * drop its slots. */
		for (uint32_t t = 0; t < q->n_tables; t++) {
			uint32_t g = u->s_group[s] + round_row_of_table(q, t);

			q->drop_off[t] = at;
			for (uint32_t i = u->g_start[g]; i < u->g_start[g + 1]; i++)
				if (u->state[i] == UNIT_SELECTED)
					for (uint32_t j = 0; j < per; j++)
						q->drop_slots[at++] = u->slot[i] + j;
			rt->evicted_tokens += at - q->drop_off[t];
		}
		q->drop_off[q->n_tables] = at;
	}
	return 0;
}

/* ---- compensation ---- */

/*
 * Summarises the K/V of the slots q drops, per (layer, kv head), into q->fold: read now,
 * on the worker, from the same blocks the round scored, so that evict.c only merges.
 */
static int fold_seq(const struct round *r, struct round_seq *q) {
	uint32_t d = q->head_dim, bt = q->block_tokens, heads = q->layers * q->kv_heads;
	uint64_t row = (uint64_t)d * layout_dtype_bytes(q->dtype), max = 0;
	size_t per = compensate_floats(q->compensation, d);
	_cleanup_(freep) uint8_t *k = NULL, *v = NULL;

	for (uint32_t t = 0; t < q->n_tables; t++)
		max = MAX(max, (uint64_t)(q->drop_off[t + 1] - q->drop_off[t]));
	k = malloc(MAX(max * row, 1u));
	v = malloc(MAX(max * row, 1u));
	q->fold = calloc(heads * per, sizeof(float));
	q->fold_count = calloc(heads, sizeof(uint64_t));
	if (!k || !v || !q->fold || !q->fold_count)
		return -ENOMEM;
	for (uint32_t t = 0; t < q->n_tables; t++) {
		const uint32_t *slots = q->drop_slots + q->drop_off[t];
		uint32_t n = q->drop_off[t + 1] - q->drop_off[t];
		const uint8_t *const *blocks = q->block_addr + q->block_off[t];
		/* A per-layer table holds every kv head of its layer; a per-head one, one. */
		uint32_t kh0 = q->layout == KVD_LAYOUT_PER_HEAD ? t % q->kv_heads : 0;
		uint32_t nkv = q->layout == KVD_LAYOUT_PER_HEAD ? 1 : q->kv_heads;
		uint32_t l = q->layout == KVD_LAYOUT_PER_HEAD ? t / q->kv_heads : t;

		for (uint32_t j = 0; n > 0 && j < nkv; j++) {
			uint32_t h = l * q->kv_heads + kh0 + j;
			uint64_t head_off = q->layout == KVD_LAYOUT_PER_HEAD ? 0 : (uint64_t)j * bt * row;
			int e = 0;

			for (uint32_t i = 0, m; i < n && e >= 0; i += m) {
				uint32_t s0 = slots[i];
				const uint8_t *b = blocks[s0 / bt] + head_off + (s0 % bt) * row;

				/* Dropped slots side by side in one block: one read of their rows
				 * (on a device pool, one driver call). */
				for (m = 1; i + m < n && slots[i + m] == s0 + m && (s0 + m) % bt != 0; m++)
					;
				e = r->mem->read(q->device, b, k + (uint64_t)i * row, m * row);
				if (e >= 0)
					e = r->mem->read(q->device, b + v_offset(q), v + (uint64_t)i * row,
					                 m * row);
			}
			if (e >= 0)
				e = compensate_batch(q->compensation, k, v, q->dtype, n, d,
				                     q->fold + h * per);
			if (e < 0)
				return e;
			q->fold_count[h] = n;
		}
	}
	return 0;
}

/* ---- recall ---- */

/* A recall's work buffers, per row. */
struct recall_scratch {
	uint8_t *tk, *tv, *ti;        /* one head's resident rows [0, window end), index keys */
	uint8_t *kb, *vb, *ib;        /* the candidates then the window, head after head */
	float *scores, *pooled;
	int64_t *src;                 /* per candidate: its resident slot, or -1 - its kept index */
	uint32_t *order;
};

static void recall_scratch_done(struct recall_scratch *sc) {
	free(sc->tk);
	free(sc->tv);
	free(sc->ti);
	free(sc->kb);
	free(sc->vb);
	free(sc->ib);
	free(sc->scores);
	free(sc->pooled);
	free(sc->src);
	free(sc->order);
	*sc = (struct recall_scratch){};
}

/* Per table, what a recall trades, before they are laid out in the round_seq. */
struct recall_pick {
	uint32_t n;
	uint32_t *drop, *take;
	float *take_s;
};

/* Candidates by cost, ascending (ties: the earlier first). */
static int cmp_cost(const void *a, const void *b, void *userdata) {
	const float *cost = userdata;
	float x = cost[*(const uint32_t *)a], y = cost[*(const uint32_t *)b];

	return x < y ? -1 : x > y ? 1 : (*(const uint32_t *)a > *(const uint32_t *)b) -
	                                      (*(const uint32_t *)a < *(const uint32_t *)b);
}

static int cmp_u32(const void *a, const void *b) {
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;

	return (x > y) - (x < y);
}

/* Where a kept slot's rows of kv head kh are in its record (recall.h's layout). */
static const uint8_t *kept_part(const struct round_seq *q, uint32_t t, uint32_t i, uint32_t kh,
                                uint32_t part) {
	uint32_t heads = q->layout == KVD_LAYOUT_PER_HEAD ? 1 : q->kv_heads;
	uint32_t h = q->layout == KVD_LAYOUT_PER_HEAD ? 0 : kh;
	uint64_t row = (uint64_t)q->head_dim * layout_dtype_bytes(q->dtype);
	const uint8_t *rec = recall_record(q->kept, t, i);

	return part == 0 ? rec + h * row : part == 1 ? rec + (heads + h) * row : rec + 2 * heads * row;
}

/*
 * Gathers the candidates of a recall (recall_heads) into sc: the resident slots before the
 * window (ws of them) and the T kept, in position order, then the window, for each kv head
 * of the row, and their index keys where the policy ranks by them. Returns 0 or a negative
 * errno.
 */
static int recall_gather(struct round *r, struct round_seq *q, uint32_t l, uint32_t kh0,
                         uint32_t nkv, uint32_t ws, uint32_t T, bool index,
                         struct recall_scratch *sc) {
	uint32_t t0 = table_of(q, l, kh0), w = q->window, end = q->window_end[t0];
	uint32_t M = ws + T, L = M + w;
	uint64_t row = (uint64_t)q->head_dim * layout_dtype_bytes(q->dtype);
	uint64_t irow = (uint64_t)q->index_dim * layout_dtype_bytes(q->dtype);
	const uint32_t *pos = q->positions + q->pos_off[t0];
	int k;

	/* Candidates in position order: the resident slots before the window and the kept. */
	{
		const uint32_t *kp = recall_positions(q->kept, t0);

		for (uint32_t i = 0, j = 0, m = 0; m < M; m++)
			sc->src[m] = j >= T || (i < ws && pos[i] < kp[j]) ? (int64_t)i++ : -1 - (int64_t)j++;
	}
	for (uint32_t j = 0; j < nkv; j++) {
		uint32_t t = table_of(q, l, kh0 + j);
		uint8_t *kd = sc->kb + (uint64_t)j * L * row, *vd = sc->vb + (uint64_t)j * L * row;

		k = gather(r, q, NULL, l, kh0 + j, end, sc->tk, sc->tv);
		if (k < 0)
			return k;
		for (uint32_t m = 0; m < M; m++) {
			int64_t s = sc->src[m];
			uint32_t i = (uint32_t)(-1 - s);

			memcpy(kd + m * row, s >= 0 ? sc->tk + s * row : kept_part(q, t, i, kh0 + j, 0), row);
			memcpy(vd + m * row, s >= 0 ? sc->tv + s * row : kept_part(q, t, i, kh0 + j, 1), row);
		}
		memcpy(kd + (uint64_t)M * row, sc->tk + (uint64_t)ws * row, (uint64_t)w * row);
		memcpy(vd + (uint64_t)M * row, sc->tv + (uint64_t)ws * row, (uint64_t)w * row);
	}
	if (index) {
		k = gather_index(r, q, t0, end, sc->ti);
		if (k < 0)
			return k;
		for (uint32_t m = 0; m < M; m++) {
			int64_t s = sc->src[m];
			const uint8_t *from = s >= 0 ? sc->ti + s * irow :
			                               kept_part(q, t0, (uint32_t)(-1 - s), kh0, 2);

			memcpy(sc->ib + m * irow, from, irow);
		}
		memcpy(sc->ib + (uint64_t)M * irow, sc->ti + (uint64_t)ws * irow, (uint64_t)w * irow);
	}
	return 0;
}

/*
 * The value of each of M candidates (sc->pooled), from the scores of nkv heads (sc->scores,
 * summed) times share: runs, not tokens. What the window matches is rarely all the answer
 * needs (a value follows its key, and the answer copies it), so each candidate is worth
 * the most of its neighbours within RECALL_SPAN positions in candidate order.
 */
static void recall_pool(uint32_t nkv, uint32_t M, float share, struct recall_scratch *sc) {
	float *x = sc->scores;

	for (uint32_t j = 1; j < nkv; j++)
		for (uint32_t m = 0; m < M; m++)
			x[m] += x[(uint64_t)j * M + m];
	for (uint32_t m = 0; m < M; m++)
		x[m] *= share;
	for (uint32_t m = 0; m < M; m++) {
		float v = x[m];

		for (uint32_t j = m > RECALL_SPAN ? m - RECALL_SPAN : 0; j <= MIN(m + RECALL_SPAN, M - 1); j++)
			v = MAX(v, x[j]);
		sc->pooled[m] = v;
	}
}

/*
 * Records n trades of a row into picks[] (each table of the row the same): the resident
 * candidates drop_from[0..n) go, the kept ones take_from[0..n) come back (candidate
 * indices into sc->src; costs in sc->pooled). Returns 0 or -ENOMEM.
 */
static int recall_give_picks(struct round_seq *q, uint32_t l, uint32_t kh0, uint32_t nkv,
                             uint32_t n, const struct recall_scratch *sc,
                             const uint32_t *drop_from, const uint32_t *take_from,
                             struct recall_pick *picks) {
	/* As slots and kept indices, each ascending; the costs follow their slots. */
	uint32_t *drop = malloc(n * sizeof(*drop)), *take = malloc(n * sizeof(*take));
	float *take_s = malloc(n * sizeof(*take_s));
	const float *x = sc->pooled;

	if (!drop || !take || !take_s) {
		free(drop);
		free(take);
		free(take_s);
		return -ENOMEM;
	}
	for (uint32_t i = 0; i < n; i++) {
		drop[i] = (uint32_t)sc->src[drop_from[i]];
		take[i] = take_from[n - 1 - i];  /* a candidate index for now */
	}
	qsort(drop, n, sizeof(*drop), cmp_u32);
	qsort(take, n, sizeof(*take), cmp_u32);
	for (uint32_t i = 0; i < n; i++) {
		take_s[i] = x[take[i]];
		take[i] = (uint32_t)(-1 - sc->src[take[i]]);
	}
	/* Each table of the row (one per kv head on the per-head layout; the per-layer
	 * layout's one table holds them all). */
	for (uint32_t j = 0; j < (q->layout == KVD_LAYOUT_PER_HEAD ? nkv : 1); j++) {
		struct recall_pick *pk = &picks[table_of(q, l, kh0 + j)];

		pk->n = n;
		pk->drop = j == 0 ? drop : malloc(n * sizeof(*drop));
		pk->take = j == 0 ? take : malloc(n * sizeof(*take));
		pk->take_s = j == 0 ? take_s : malloc(n * sizeof(*take_s));
		if (!pk->drop || !pk->take || !pk->take_s)
			return -ENOMEM;
		if (j > 0) {
			memcpy(pk->drop, drop, n * sizeof(*drop));
			memcpy(pk->take, take, n * sizeof(*take));
			memcpy(pk->take_s, take_s, n * sizeof(*take_s));
		}
	}
	return 0;
}

/*
 * Scores the candidates of kv heads [kh0, kh0 + nkv) of layer l (one row: their tables
 * hold the same slots when nkv > 1) and picks its trades into picks[] (each table of the
 * row the same). Returns 0 or a negative errno.
 */
static int recall_heads(struct round *r, struct round_seq *q, uint32_t l, uint32_t kh0, uint32_t nkv,
                        float share, struct recall_pick *picks) {
	uint32_t t0 = table_of(q, l, kh0), w = q->window, end = q->window_end[t0];
	uint64_t row = (uint64_t)q->head_dim * layout_dtype_bytes(q->dtype);
	uint64_t irow = (uint64_t)q->index_dim * layout_dtype_bytes(q->dtype);
	const uint32_t *pos = q->positions + q->pos_off[t0];
	int policy = r->tenants[q->tenant].policy;
	bool index = kvd_policy_info(policy)->flags & KVD_POLICY_NEEDS_INDEX;
	struct recall_scratch sc = {};
	uint32_t ws, T, M, L, ne = 0, nk = 0, n = 0;
	uint32_t *E, *K;
	float *x;
	int k = -ENOMEM;

	if (end <= w)
		return 0;                 /* no window: nothing asks for anything */
	ws = end - w;
	T = recall_kept(q->kept, t0);
	/* Kept slots after the window's start are not candidates (a window republished
	 * over slots evicted since it was first published). */
	while (T > 0 && recall_positions(q->kept, t0)[T - 1] >= pos[ws])
		T--;
	if (T == 0)
		return 0;
	for (uint32_t j = 1; j < nkv; j++) {
		uint32_t t = table_of(q, l, kh0 + j);

		/* The tables of a layer row lose and keep the same slots: one that does not is
		 * left as it is rather than traded out of line. */
		if (recall_kept(q->kept, t) < T ||
		    memcmp(recall_positions(q->kept, t), recall_positions(q->kept, t0), T * 4) != 0)
			return 0;
	}
	M = ws + T;
	L = M + w;
	if (index && q->index_dim == 0)
		policy = kvd_policy_info(policy)->fallback, index = false;
	sc.tk = malloc(MAX((uint64_t)end * row, 1u));
	sc.tv = malloc(MAX((uint64_t)end * row, 1u));
	sc.kb = malloc((uint64_t)nkv * L * row);
	sc.vb = malloc((uint64_t)nkv * L * row);
	sc.scores = malloc((uint64_t)q->q_heads * L * sizeof(float));
	sc.pooled = malloc((uint64_t)M * sizeof(float));
	sc.src = malloc(M * sizeof(int64_t));
	sc.order = malloc(2 * (uint64_t)M * sizeof(uint32_t));
	if (index) {
		sc.ti = malloc(MAX((uint64_t)end * irow, 1u));
		sc.ib = malloc(MAX((uint64_t)L * irow, 1u));
	}
	if (!sc.tk || !sc.tv || !sc.kb || !sc.vb || !sc.scores || !sc.pooled || !sc.src || !sc.order ||
	    (index && (!sc.ti || !sc.ib)))
		goto out;
	k = recall_gather(r, q, l, kh0, nkv, ws, T, index, &sc);
	if (k < 0)
		goto out;
	k = policy_layer(r, q, l, kh0, nkv, policy, L, sc.kb, sc.vb, sc.ib, NULL, sc.scores);
	if (k < 0)
		goto out;
	recall_pool(nkv, M, share, &sc);
	x = sc.pooled;
	/* The pairs: kept slots from the most valuable, resident ones (sinks protected) from
	 * the least, as long as the kept one is worth more. */
	E = sc.order;
	K = sc.order + M;
	for (uint32_t m = 0; m < M; m++) {
		if (sc.src[m] < 0)
			K[nk++] = m;
		else if ((uint32_t)sc.src[m] >= q->sink_slots[t0] &&
		         (uint32_t)sc.src[m] < q->written_end[t0])
			E[ne++] = m;
	}
	qsort_r(E, ne, sizeof(*E), cmp_cost, x);
	qsort_r(K, nk, sizeof(*K), cmp_cost, x);
	while (n < MIN(MIN(ne, nk), q->recall_max) && x[K[nk - 1 - n]] > x[E[n]])
		n++;
	q->candidates += T;
	{
		uint32_t rw = round_row_of_table(q, t0);

		/* The window is new: its costs replace what the resident slots had. */
		for (uint32_t m = 0; m < M; m++)
			if (sc.src[m] >= 0)
				q->smooth_out[rw][sc.src[m]] = x[m];
	}
	k = n > 0 ? recall_give_picks(q, l, kh0, nkv, n, &sc, E, K + nk - n, picks) : 0;
out:
	recall_scratch_done(&sc);
	return k;
}

/* Lays the picks out in q's results (table order, prefix sums). */
static int recall_plan(struct round_seq *q, const struct recall_pick *picks) {
	uint64_t total = 0, at = 0;

	for (uint32_t t = 0; t < q->n_tables; t++)
		total += picks[t].n;
	if (total == 0)
		return 0;
	q->drop_off = malloc((q->n_tables + 1) * sizeof(uint32_t));
	q->take_off = malloc((q->n_tables + 1) * sizeof(uint32_t));
	q->drop_slots = malloc(total * sizeof(uint32_t));
	q->take = malloc(total * sizeof(uint32_t));
	q->take_s = malloc(total * sizeof(float));
	if (!q->drop_off || !q->take_off || !q->drop_slots || !q->take || !q->take_s)
		return -ENOMEM;
	for (uint32_t t = 0; t < q->n_tables; t++) {
		q->drop_off[t] = q->take_off[t] = (uint32_t)at;
		if (picks[t].n == 0)
			continue;             /* its arrays are NULL */
		memcpy(q->drop_slots + at, picks[t].drop, picks[t].n * sizeof(uint32_t));
		memcpy(q->take + at, picks[t].take, picks[t].n * sizeof(uint32_t));
		memcpy(q->take_s + at, picks[t].take_s, picks[t].n * sizeof(float));
		at += picks[t].n;
	}
	q->drop_off[q->n_tables] = q->take_off[q->n_tables] = (uint32_t)at;
	q->dropped_units = at;
	return 0;
}

static int recall_seq(struct round *r, struct round_seq *q) {
	bool aligned = q->layout == KVD_LAYOUT_PER_LAYER || rows_are_layers(q);
	struct recall_pick *picks = calloc(q->n_tables, sizeof(*picks));
	int k = 0;

	if (!picks)
		return -ENOMEM;
	q->smooth_out = calloc(q->rows, sizeof(float *));
	if (!q->smooth_out)
		k = -ENOMEM;
	for (uint32_t rw = 0; rw < q->rows && k >= 0; rw++) {
		uint32_t n = q->tokens[round_table_of_row(q, rw)];
		const float *S0 = q->smooth_in ? q->smooth_in[rw] : NULL;

		q->smooth_out[rw] = malloc(MAX(n, 1u) * sizeof(float));
		if (!q->smooth_out[rw])
			k = -ENOMEM;
		for (uint32_t i = 0; k >= 0 && i < n; i++)
			q->smooth_out[rw][i] = S0 ? S0[i] : ROUND_UNSCORED;
	}
	for (uint32_t l = 0; l < q->layers && k >= 0; l++) {
		if (aligned) {
			k = recall_heads(r, q, l, 0, q->kv_heads, 1.0f, picks);
			continue;
		}
		for (uint32_t kh = 0; kh < q->kv_heads && k >= 0; kh++)
			k = recall_heads(r, q, l, kh, 1, 1.0f / (float)q->kv_heads, picks);
	}
	if (k >= 0)
		k = recall_plan(q, picks);
	for (uint32_t t = 0; t < q->n_tables; t++) {
		free(picks[t].drop);
		free(picks[t].take);
		free(picks[t].take_s);
	}
	free(picks);
	return k;
}

/* A recall round: scores and picks, on the worker; the loop trades (recall_swap). */
static void recall_run(struct round *r) {
	uint64_t t0 = now_us();
	int k = 0;

	for (uint32_t s = 0; s < r->n_seqs && k >= 0; s++)
		k = recall_seq(r, &r->seqs[s]);
	r->score_us = now_us() - t0;
	if (k < 0)
		r->error = k;
}

void round_run(struct round *r) {
	struct scratch sc = {};
	struct units u = {};
	uint64_t t0 = now_us(), kv = 0, sc_n = 0, ik = 0;
	int k = 0;

	if (r->recall) {
		recall_run(r);
		return;
	}
	/* Buffers for the largest layer of the round. */
	for (uint32_t s = 0; s < r->n_seqs; s++) {
		const struct round_seq *q = &r->seqs[s];
		uint64_t row = (uint64_t)q->head_dim * layout_dtype_bytes(q->dtype);

		for (uint32_t t = 0; t < q->n_tables; t++) {
			uint64_t heads = q->layout == KVD_LAYOUT_PER_LAYER || rows_are_layers(q) ? q->kv_heads : 1;

			kv = MAX(kv, heads * q->tokens[t] * row);
			sc_n = MAX(sc_n, heads * q->tokens[t]);
			ik = MAX(ik, (uint64_t)q->tokens[t] * q->index_dim * layout_dtype_bytes(q->dtype));
		}
	}
	sc.k = malloc(MAX(kv, 1u));
	sc.v = malloc(MAX(kv, 1u));
	sc.ik = malloc(MAX(ik, 1u));
	sc.scores = malloc(MAX(sc_n, 1u) * sizeof(float));
	if (!sc.k || !sc.v || !sc.ik || !sc.scores)
		k = -ENOMEM;
	for (uint32_t s = 0; s < r->n_seqs && k >= 0; s++) {
		struct round_seq *q = &r->seqs[s];

		q->smooth_out = calloc(q->rows, sizeof(float *));
		if (!q->smooth_out)
			k = -ENOMEM;
		else
			k = score_seq(r, q, &sc);
	}
	free(sc.k);
	free(sc.v);
	free(sc.ik);
	free(sc.scores);
	r->score_us = now_us() - t0;
	if (k < 0) {
		r->error = k;
		return;
	}

	t0 = now_us();
	k = units_build(r, &u);
	if (k >= 0) {
		r->units = u.n;
		k = select_units(r, &u);
	}
	if (k >= 0)
		k = units_plan(r, &u);
	units_done(&u);
	r->select_us = now_us() - t0;

	t0 = now_us();
	for (uint32_t s = 0; s < r->n_seqs && k >= 0; s++)
		if (r->seqs[s].compensation != KVD_COMPENSATION_NONE && r->seqs[s].drop_off)
			k = fold_seq(r, &r->seqs[s]);
	r->fold_us = now_us() - t0;
	if (k < 0)
		r->error = k;
}

static void round_seq_done(struct round_seq *q) {
	free(q->tokens);
	free(q->sink_slots);
	free(q->window_end);
	free(q->written_end);
	free(q->block_off);
	free(q->block_addr);
	free(q->block_chunk);
	obs_unref(q->obs);
	if (q->grams) {
		for (uint32_t l = 0; l < q->layers; l++)
			gram_layer_unref(q->grams[l]);
		free(q->grams);
	}
	for (uint32_t rw = 0; rw < q->rows; rw++) {
		if (q->smooth_in)
			free(q->smooth_in[rw]);
		if (q->smooth_out)
			free(q->smooth_out[rw]);
	}
	free(q->smooth_in);
	free(q->smooth_out);
	free(q->drop_off);
	free(q->drop_slots);
	free(q->mi_mean_k);
	free(q->mi_count);
	free(q->fold);
	free(q->fold_count);
	free(q->positions);
	free(q->pos_off);
	free(q->take_off);
	free(q->take);
	free(q->take_s);
}

struct round *round_free(struct round *r) {
	if (!r)
		return NULL;
	for (uint32_t s = 0; s < r->n_seqs; s++)
		round_seq_done(&r->seqs[s]);
	free(r->seqs);
	free(r->tenants);
	free(r);
	return NULL;
}
