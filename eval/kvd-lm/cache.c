/* SPDX-License-Identifier: MIT */
/* The KV caches of kvd-lm: a private full one and one in kvd blocks; see cache.h. */
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache.h"
#include "basic/macro.h"

struct cache_ops {
	int (*begin)(struct kvdlm_cache *c, uint32_t n, uint32_t *ret_pos0);
	int (*observe)(struct kvdlm_cache *c, uint32_t layer, const float *q, size_t ldq, uint32_t n,
	               const float *iq);
	int (*end)(struct kvdlm_cache *c);
	int (*stats)(struct kvdlm_cache *c, struct kvdlm_cache_stats *ret);
};

struct kvdlm_cache {
	const struct cache_ops *ops;
	uint32_t layers, q_heads, kv_heads, head_dim, tables, max_tokens;
	uint32_t next_pos;
	uint32_t prefix_blocks;      /* kvd: the keys its open gave (kvdlm_cache_kvd_publish) */
	bool in_step;
	struct kvdlm_kv_view *views; /* [tables] */

	/* full: K then V of each table, [tables][2][max_tokens][head_dim] */
	float *kv;
	uint32_t *positions;         /* [max_tokens]: 0, 1, 2, ... shared by every table */
	float **rows;                /* [tables][2]: each table's one block, K and V */

	/* kvd */
	kvd_client *client;
	kvd_seq *seq;
	uint64_t seq_id, changed;
	uint32_t window, max_blocks;
	bool observe;
	float **kblk, **vblk;        /* [tables][max_blocks] */
	struct kvd_moments *moments; /* [tables]: views of the moments blocks (compensation) */
	enum kvd_moments_form form;
	struct kvd_latent *latent;   /* [tables]: views of the latent blocks (compensation) */
	uint32_t index_heads, index_dim; /* the indexer (0: none) */
	float **iblk;                /* [tables][max_blocks]: index key rows (indexer) */
	float *ring;                 /* [layers][window][q_heads * head_dim]: recent queries */
	float *iring;                /* [layers][window][index_heads * index_dim]: their index
	                              * queries (indexer) */
	uint32_t *ring_next, *ring_count; /* [layers] */
};

static int cache_alloc(const struct kvdlm_config *cfg, uint32_t max_tokens, struct kvdlm_cache **ret) {
	struct kvdlm_cache *c;

	if (!cfg || !ret || max_tokens == 0)
		return -EINVAL;
	c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	c->layers = cfg->layers;
	c->q_heads = cfg->q_heads;
	c->kv_heads = cfg->kv_heads;
	c->head_dim = cfg->head_dim;
	c->tables = cfg->layers * cfg->kv_heads;
	c->max_tokens = max_tokens;
	c->views = calloc(c->tables, sizeof(*c->views));
	*ret = c;
	return c->views ? 0 : -ENOMEM;
}

struct kvdlm_cache *kvdlm_cache_free(struct kvdlm_cache *c) {
	if (!c)
		return NULL;
	if (c->seq) {
		if (c->in_step)
			(void)kvd_seq_unpin(c->seq);
		(void)kvd_seq_release(c->seq);
	}
	free(c->views);
	free(c->kv);
	free(c->positions);
	free(c->rows);
	free(c->kblk);
	free(c->vblk);
	free(c->moments);
	free(c->latent);
	free(c->iblk);
	free(c->iring);
	free(c->ring);
	free(c->ring_next);
	free(c->ring_count);
	free(c);
	return NULL;
}

int kvdlm_cache_begin(struct kvdlm_cache *c, uint32_t n, uint32_t *ret_pos0) {
	int r;

	if (!c || n == 0 || c->in_step)
		return -EINVAL;
	r = c->ops->begin(c, n, ret_pos0);
	if (r < 0)
		return r;
	c->in_step = true;
	return 0;
}

const struct kvdlm_kv_view *kvdlm_cache_view(const struct kvdlm_cache *c, uint32_t layer, uint32_t kv_head) {
	if (!c || !c->in_step || layer >= c->layers || kv_head >= c->kv_heads)
		return NULL;
	return &c->views[layer * c->kv_heads + kv_head];
}

int kvdlm_cache_observe(struct kvdlm_cache *c, uint32_t layer, const float *q, size_t ldq, uint32_t n,
                        const float *iq) {
	if (!c || !c->in_step || layer >= c->layers || !q)
		return -EINVAL;
	return c->ops->observe ? c->ops->observe(c, layer, q, ldq, n, iq) : 0;
}

int kvdlm_cache_end(struct kvdlm_cache *c) {
	if (!c || !c->in_step)
		return -EINVAL;
	c->in_step = false;
	return c->ops->end ? c->ops->end(c) : 0;
}

uint32_t kvdlm_cache_index_heads(const struct kvdlm_cache *c) {
	return c ? c->index_heads : 0;
}

uint32_t kvdlm_cache_index_dim(const struct kvdlm_cache *c) {
	return c ? c->index_dim : 0;
}

uint32_t kvdlm_cache_position(const struct kvdlm_cache *c) {
	return c ? c->next_pos : 0;
}

int kvdlm_cache_stats(struct kvdlm_cache *c, struct kvdlm_cache_stats *ret) {
	if (!c || !ret)
		return -EINVAL;
	return c->ops->stats(c, ret);
}

int kvdlm_cache_copy_queries(struct kvdlm_cache *dst, const struct kvdlm_cache *src) {
	size_t q = (size_t)src->layers * src->window * src->q_heads * src->head_dim;

	if (!dst || !src || !dst->ring || !src->ring || dst->layers != src->layers ||
	    dst->window != src->window || dst->q_heads != src->q_heads ||
	    dst->head_dim != src->head_dim ||
	    (dst->iring && (!src->iring || dst->index_heads != src->index_heads ||
	                    dst->index_dim != src->index_dim)))
		return -EINVAL;
	memcpy(dst->ring, src->ring, q * sizeof(float));
	if (dst->iring)
		memcpy(dst->iring, src->iring, (size_t)src->layers * src->window * src->index_heads *
		                                       src->index_dim * sizeof(float));
	memcpy(dst->ring_next, src->ring_next, src->layers * sizeof(uint32_t));
	memcpy(dst->ring_count, src->ring_count, src->layers * sizeof(uint32_t));
	return 0;
}

kvd_seq *kvdlm_cache_seq(const struct kvdlm_cache *c) {
	return c ? c->seq : NULL;
}

/* Fills the resident counts of *ret from tokens[tables]. */
static void stats_fill(const struct kvdlm_cache *c, const uint32_t *tokens, struct kvdlm_cache_stats *ret) {
	*ret = (struct kvdlm_cache_stats){
		.positions = c->next_pos,
		.tables = c->tables,
		.resident_min = UINT32_MAX,
		.changed = c->changed,
	};
	for (uint32_t t = 0; t < c->tables; t++) {
		ret->resident += tokens[t];
		ret->resident_min = MIN(ret->resident_min, tokens[t]);
		ret->resident_max = MAX(ret->resident_max, tokens[t]);
	}
}

/* ---- the full cache ---- */

static int full_begin(struct kvdlm_cache *c, uint32_t n, uint32_t *ret_pos0) {
	if (n > c->max_tokens - c->next_pos)
		return -EFBIG;
	for (uint32_t t = 0; t < c->tables; t++) {
		c->views[t].n = c->next_pos + n;
		c->views[t].first_new = c->next_pos;
	}
	*ret_pos0 = c->next_pos;
	c->next_pos += n;
	return 0;
}

static int full_stats(struct kvdlm_cache *c, struct kvdlm_cache_stats *ret) {
	*ret = (struct kvdlm_cache_stats){
		.positions = c->next_pos,
		.resident = (uint64_t)c->next_pos * c->tables,
		.tables = c->tables,
		.resident_min = c->next_pos,
		.resident_max = c->next_pos,
	};
	return 0;
}

static const struct cache_ops full_ops = {
	.begin = full_begin,
	.stats = full_stats,
};

int kvdlm_cache_full_new(const struct kvdlm_config *cfg, uint32_t max_tokens, struct kvdlm_cache **ret) {
	_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *c = NULL;
	size_t rows;
	int r;

	if (max_tokens > KVDLM_FULL_MAX_TOKENS)
		return -EINVAL;
	r = cache_alloc(cfg, max_tokens, &c);
	if (r < 0)
		return r;
	c->ops = &full_ops;
	/* tables <= 2^20 and max_tokens <= 2^20, head_dim <= 2^12: the product fits in size_t
	 * on 64-bit hosts, and malloc refuses what does not fit in memory. */
	rows = (size_t)c->tables * 2 * max_tokens;
	c->kv = malloc(rows * c->head_dim * sizeof(float));
	c->positions = malloc((size_t)max_tokens * sizeof(uint32_t));
	c->rows = malloc((size_t)c->tables * 2 * sizeof(float *));
	if (!c->kv || !c->positions || !c->rows)
		return -ENOMEM;
	for (uint32_t i = 0; i < max_tokens; i++)
		c->positions[i] = i;
	for (uint32_t t = 0; t < c->tables; t++) {
		c->rows[2 * t] = c->kv + (size_t)(2 * t) * max_tokens * c->head_dim;
		c->rows[2 * t + 1] = c->kv + (size_t)(2 * t + 1) * max_tokens * c->head_dim;
		c->views[t] = (struct kvdlm_kv_view){
			.block_tokens = max_tokens,
			.pos = c->positions,
			.k = &c->rows[2 * t],
			.v = &c->rows[2 * t + 1],
		};
	}
	*ret = TAKE_PTR(c);
	return 0;
}

/* ---- kvd ---- */

/* The descriptor's arrays (kvd.h): stable while the sequence is pinned. */
static const uint32_t *desc_tokens(const struct kvd_seq_desc *d) {
	return (const uint32_t *)((const char *)d + d->tokens_offset);
}

static const uint32_t *desc_positions(const struct kvd_seq_desc *d, uint32_t table) {
	return (const uint32_t *)((const char *)d + d->positions_offset) + (size_t)table * d->max_tokens;
}

/* The first of pos[n] (ascending) that is >= want. */
static uint32_t lower_bound(const uint32_t *pos, uint32_t n, uint32_t want) {
	uint32_t lo = 0, hi = n;

	while (lo < hi) {
		uint32_t mid = lo + (hi - lo) / 2;

		if (pos[mid] < want)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

static int kvd_begin(struct kvdlm_cache *c, uint32_t n, uint32_t *ret_pos0) {
	const struct kvd_seq_desc *d;
	const uint32_t *tokens;
	uint32_t pos0;
	int r;

	if (n > c->max_tokens - c->next_pos)
		return -EFBIG;
	/* Grow before pinning: a grow over the budget waits for a round, and a round cannot
	 * take anything from a pinned sequence. */
	r = kvd_seq_grow(c->seq, n);
	if (r < 0)
		return r;
	r = kvd_seq_pin(c->seq);
	if (r < 0)
		return r;
	d = kvd_seq_descriptor(c->seq);
	tokens = desc_tokens(d);
	pos0 = d->next_position - n;
	for (uint32_t t = 0; t < c->tables; t++) {
		struct kvdlm_kv_view *v = &c->views[t];
		uint32_t nt = tokens[t], blocks = DIV_ROUND_UP(nt, KVDLM_KVD_BLOCK_TOKENS);

		if (nt > c->max_tokens || blocks > c->max_blocks) {
			(void)kvd_seq_unpin(c->seq);
			return -EPROTO;
		}
		for (uint32_t b = 0; b < blocks; b++) {
			void *addr;

			r = kvd_seq_block(c->seq, t, b, &addr);
			if (r < 0) {
				(void)kvd_seq_unpin(c->seq);
				return r;
			}
			c->kblk[(size_t)t * c->max_blocks + b] = addr;
			c->vblk[(size_t)t * c->max_blocks + b] =
				(float *)((char *)addr + (d->index_dim ? d->index_offset : d->block_bytes) / 2);
			if (c->iblk)
				c->iblk[(size_t)t * c->max_blocks + b] = (float *)((char *)addr + d->index_offset);
		}
		v->n = nt;
		v->pos = desc_positions(d, t);
		v->moments = NULL;
		if (c->moments) {
			const struct kvd_moments_header *h;

			r = kvd_seq_moments(c->seq, t / c->kv_heads, t % c->kv_heads, &h);
			if (r >= 0 && h->head_dim != c->head_dim)
				r = -EPROTO;
			if (r < 0) {
				(void)kvd_seq_unpin(c->seq);
				return r;
			}
			/* An empty summary adds nothing: leave attention exactly as it was. */
			if (h->count > 0) {
				kvd_moments_view(&c->moments[t], c->head_dim,
				                 (float *)((char *)h + KVD_MOMENTS_HEADER_BYTES));
				c->moments[t].count = h->count;
				c->moments[t].key_norm_max = h->key_norm_max;
				c->moments[t].key_radius = h->key_radius;
				v->moments = &c->moments[t];
				v->form = c->form;
			}
		}
		v->latent = NULL;
		if (c->latent) {
			const struct kvd_latent_header *h;

			r = kvd_seq_latent(c->seq, t / c->kv_heads, t % c->kv_heads, &h);
			if (r >= 0 && h->head_dim != c->head_dim)
				r = -EPROTO;
			if (r < 0) {
				(void)kvd_seq_unpin(c->seq);
				return r;
			}
			if (h->count > 0) {
				kvd_latent_view(&c->latent[t], c->head_dim,
				                (float *)((char *)h + KVD_LATENT_HEADER_BYTES));
				c->latent[t].count = h->count;
				v->latent = &c->latent[t];
			}
		}
		/* Usually the last n slots; but a round that ran between the grow and the pin may
		 * have taken some of the new slots of a layer that had no window yet, so the
		 * step's tokens are found by position. */
		v->first_new = lower_bound(v->pos, nt, pos0);
	}
	c->next_pos = d->next_position;
	*ret_pos0 = pos0;
	return 0;
}

static int kvd_observe(struct kvdlm_cache *c, uint32_t layer, const float *q, size_t ldq, uint32_t n,
                       const float *iq) {
	size_t qd = (size_t)c->q_heads * c->head_dim, id = (size_t)c->index_heads * c->index_dim;
	float *ring = c->ring + (size_t)layer * c->window * qd, *out;
	float *iring = c->iring ? c->iring + (size_t)layer * c->window * id : NULL;
	uint32_t *next = &c->ring_next[layer], *count = &c->ring_count[layer];
	int r;

	if (!c->observe)
		return 0;
	if (iring && !iq)
		return -EINVAL;
	for (uint32_t i = n > c->window ? n - c->window : 0; i < n; i++) {
		memcpy(ring + (size_t)*next * qd, q + i * ldq, qd * sizeof(float));
		if (iring)
			memcpy(iring + (size_t)*next * id, iq + i * id, id * sizeof(float));
		*next = (*next + 1) % c->window;
		*count = MIN(*count + 1, c->window);
	}
	if (*count < c->window)
		return 0;
	r = kvd_seq_observation(c->seq, layer, (void **)&out);
	if (r == -EOPNOTSUPP) {
		/* A daemon without eviction: nothing to observe, ever. */
		c->observe = false;
		return 0;
	}
	if (r < 0)
		return r;
	/* The buffer is q[q_heads][window][head_dim], oldest first; the ring's oldest row is
	 * the one `next` overwrites next. */
	for (uint32_t w = 0; w < c->window; w++) {
		const float *row = ring + (size_t)((*next + w) % c->window) * qd;

		for (uint32_t h = 0; h < c->q_heads; h++)
			memcpy(out + ((size_t)h * c->window + w) * c->head_dim, row + (size_t)h * c->head_dim,
			       c->head_dim * sizeof(float));
	}
	if (iring) {
		/* iq[window][index_heads][index_dim]: the ring's rows, oldest first. */
		r = kvd_seq_index_observation(c->seq, layer, (void **)&out);
		if (r < 0)
			return r;
		for (uint32_t w = 0; w < c->window; w++)
			memcpy(out + (size_t)w * id, iring + (size_t)((*next + w) % c->window) * id,
			       id * sizeof(float));
	}
	return kvd_seq_observe(c->seq, layer);
}

static int kvd_end(struct kvdlm_cache *c) {
	kvd_event ev;
	int r;

	r = kvd_seq_unpin(c->seq);
	if (r < 0)
		return r;
	/* Events only tell that a round rewrote a sequence; every step re-reads the
	 * descriptor after pinning anyway, so they are counted, not acted on. Events of other
	 * sequences on a shared client are consumed here too. */
	while ((r = kvd_client_next_event(c->client, &ev)) > 0)
		if (ev.type == KVD_EVENT_SEQ_CHANGED && ev.arg == c->seq_id)
			c->changed++;
	return r;
}

static int kvd_stats(struct kvdlm_cache *c, struct kvdlm_cache_stats *ret) {
	int r;

	r = kvd_seq_pin(c->seq);
	if (r < 0)
		return r;
	stats_fill(c, desc_tokens(kvd_seq_descriptor(c->seq)), ret);
	return kvd_seq_unpin(c->seq);
}

static const struct cache_ops kvd_ops = {
	.begin = kvd_begin,
	.observe = kvd_observe,
	.end = kvd_end,
	.stats = kvd_stats,
};

/* How long kvdlm_kvd_register() retries an upload the daemon is too busy for. */
#define UPLOAD_RETRY_MS 10
#define UPLOAD_RETRIES 1000

int kvdlm_kvd_register(kvd_client *client, const struct kvdlm_model *m, const char *name,
                       uint32_t unit, uint32_t window, struct kvdlm_kvd_model *ret) {
	return kvdlm_kvd_register_compensated(client, m, name, unit, window, KVD_COMPENSATION_NONE, ret);
}

int kvdlm_kvd_register_compensated(kvd_client *client, const struct kvdlm_model *m, const char *name,
                                   uint32_t unit, uint32_t window, uint32_t compensation,
                                   struct kvdlm_kvd_model *ret) {
	return kvdlm_kvd_register_indexed(client, m, name, unit, window, compensation, NULL, ret);
}

int kvdlm_kvd_register_indexed(kvd_client *client, const struct kvdlm_model *m, const char *name,
                               uint32_t unit, uint32_t window, uint32_t compensation,
                               const kvd_index_spec *ix, struct kvdlm_kvd_model *ret) {
	const struct kvdlm_config *cfg;
	kvd_model_spec spec;
	kvd_eviction_spec ev;
	int id;

	if (!client || !m || !ret)
		return -EINVAL;
	cfg = &m->cfg;
	spec = (kvd_model_spec){
		.name = name,
		.layers = cfg->layers,
		.q_heads = cfg->q_heads,
		.kv_heads = cfg->kv_heads,
		.head_dim = cfg->head_dim,
		.dtype = KVD_DTYPE_F32,
		.block_tokens = KVDLM_KVD_BLOCK_TOKENS,
		.layout = KVD_LAYOUT_PER_HEAD,
	};
	ev = (kvd_eviction_spec){ .unit = unit, .window = window, .sinks = KVD_SINKS_DEFAULT };
	id = kvd_model_register_indexed(client, &spec, &ev, compensation, ix);
	if (id < 0)
		return id;
	for (uint32_t l = 0; unit != KVD_UNIT_NONE && l < cfg->layers; l++) {
		int r;

		for (uint32_t tries = 0;; tries++) {
			const struct timespec pause = { 0, UPLOAD_RETRY_MS * 1000000L };

			r = kvd_model_output_proj(client, id, l, KVD_DTYPE_F32, cfg->dim, m->layers[l].wo);
			if (r != -EBUSY || tries >= UPLOAD_RETRIES)
				break;
			/* The daemon computes uploads off its loop and refuses past a limit: wait
			 * for one to finish. */
			nanosleep(&pause, NULL);
		}
		if (r < 0)
			return r;
	}
	*ret = (struct kvdlm_kvd_model){
		.client = client,
		.model_id = id,
		.unit = unit,
		.window = window,
		.observe = unit != KVD_UNIT_NONE,
		.compensation = compensation,
		.form = KVD_MOMENTS_PLAIN,
		.index_heads = ix ? ix->heads : 0,
		.index_dim = ix ? ix->dim : 0,
	};
	return 0;
}

/* A cache over sequence seq of km (taken, even on failure), opened or forked. */
static int kvd_cache_new(const struct kvdlm_kvd_model *km, const struct kvdlm_config *cfg,
                         uint32_t max_tokens, kvd_seq *seq, struct kvdlm_cache **ret) {
	_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *c = NULL;
	const struct kvd_seq_desc *d;
	int r;

	r = cache_alloc(cfg, max_tokens, &c);
	if (r < 0) {
		kvd_seq_release(seq);
		return r;
	}
	c->ops = &kvd_ops;
	c->client = km->client;
	c->window = km->window;
	c->observe = km->observe;
	c->seq = seq;
	d = kvd_seq_descriptor(c->seq);
	/* What forward.c relies on: the shape it registered, and f32 rows in per-head blocks. */
	if (!d || d->layers != c->layers || d->kv_heads != c->kv_heads || d->head_dim != c->head_dim ||
	    d->dtype != KVD_DTYPE_F32 || d->layout != KVD_LAYOUT_PER_HEAD ||
	    d->block_tokens != KVDLM_KVD_BLOCK_TOKENS || d->n_tables != c->tables ||
	    d->max_tokens < max_tokens || d->index_dim != km->index_dim ||
	    d->block_bytes != (2ull * c->head_dim + d->index_dim) * KVDLM_KVD_BLOCK_TOKENS * sizeof(float))
		return -EPROTO;
	c->seq_id = kvd_seq_id(c->seq);
	c->max_blocks = d->max_blocks;
	c->kblk = calloc((size_t)c->tables * c->max_blocks, sizeof(float *));
	c->vblk = calloc((size_t)c->tables * c->max_blocks, sizeof(float *));
	c->ring = malloc((size_t)c->layers * c->window * c->q_heads * c->head_dim * sizeof(float));
	c->ring_next = calloc(c->layers, sizeof(uint32_t));
	c->ring_count = calloc(c->layers, sizeof(uint32_t));
	if (!c->kblk || !c->vblk || !c->ring || !c->ring_next || !c->ring_count)
		return -ENOMEM;
	if (km->compensation == KVD_COMPENSATION_MOMENTS) {
		c->moments = calloc(c->tables, sizeof(*c->moments));
		if (!c->moments)
			return -ENOMEM;
		c->form = km->form;
	}
	if (km->compensation == KVD_COMPENSATION_LATENT) {
		c->latent = calloc(c->tables, sizeof(*c->latent));
		if (!c->latent)
			return -ENOMEM;
	}
	if (km->index_dim) {
		c->index_heads = km->index_heads, c->index_dim = km->index_dim;
		c->iblk = calloc((size_t)c->tables * c->max_blocks, sizeof(float *));
		c->iring = malloc((size_t)c->layers * c->window * c->index_heads * c->index_dim *
		                  sizeof(float));
		if (!c->iblk || !c->iring)
			return -ENOMEM;
	}
	for (uint32_t t = 0; t < c->tables; t++)
		c->views[t] = (struct kvdlm_kv_view){
			.block_tokens = KVDLM_KVD_BLOCK_TOKENS,
			.k = &c->kblk[(size_t)t * c->max_blocks],
			.v = &c->vblk[(size_t)t * c->max_blocks],
			.ik = c->iblk ? &c->iblk[(size_t)t * c->max_blocks] : NULL,
		};
	c->next_pos = d->next_position;
	*ret = TAKE_PTR(c);
	return 0;
}

int kvdlm_cache_kvd_new(const struct kvdlm_kvd_model *km, const struct kvdlm_config *cfg,
                        uint32_t max_tokens, struct kvdlm_cache **ret) {
	kvd_seq *s;
	int r;

	if (!km || !km->client || km->window == 0)
		return -EINVAL;
	r = kvd_seq_open(km->client, km->model_id, max_tokens, &s);
	return r < 0 ? r : kvd_cache_new(km, cfg, max_tokens, s, ret);
}

int kvdlm_cache_kvd_open_prefix(const struct kvdlm_kvd_model *km, const struct kvdlm_config *cfg,
                                uint32_t max_tokens, const uint32_t *tokens, uint32_t n,
                                struct kvdlm_cache **ret) {
	kvd_open_params p = { .size = sizeof(p), .max_tokens = max_tokens };
	_cleanup_(freep) uint8_t *keys = NULL;
	uint8_t root[KVD_KEY_BYTES];
	int64_t n_keys;
	kvd_seq *s;
	int r;

	if (!km || !km->client || km->window == 0 || (n > 0 && !tokens))
		return -EINVAL;
	keys = malloc(MAX(n / KVDLM_KVD_BLOCK_TOKENS, 1u) * KVD_KEY_BYTES);
	if (!keys)
		return -ENOMEM;
	(void)kvd_key_root("kvd-lm", root);
	n_keys = kvd_prefix_keys(root, tokens, n, KVDLM_KVD_BLOCK_TOKENS, NULL, keys,
	                         MIN(n, max_tokens) / KVDLM_KVD_BLOCK_TOKENS);
	if (n_keys < 0)
		return (int)n_keys;
	p.model_id = km->model_id;
	p.n_prefix_keys = (uint32_t)n_keys;
	p.prefix_keys = n_keys > 0 ? keys : NULL;
	r = kvd_seq_open_params(km->client, &p, &s);
	if (r < 0)
		return r;
	r = kvd_cache_new(km, cfg, max_tokens, s, ret);
	if (r == 0)
		(*ret)->prefix_blocks = (uint32_t)n_keys;
	return r;
}

int kvdlm_cache_kvd_publish(struct kvdlm_cache *c) {
	if (!c || !c->seq)
		return -EINVAL;
	return kvd_seq_publish(c->seq, c->prefix_blocks);
}

int kvdlm_cache_kvd_fork(const struct kvdlm_kvd_model *km, const struct kvdlm_config *cfg,
                         const struct kvdlm_cache *parent, struct kvdlm_cache **ret) {
	_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *c = NULL;
	kvd_seq *s;
	int r;

	if (!km || !km->client || km->window == 0 || !parent || !parent->seq || parent->in_step)
		return -EINVAL;
	r = kvd_seq_fork(parent->seq, &s);
	if (r < 0)
		return r;
	r = kvd_cache_new(km, cfg, parent->max_tokens, s, &c);
	if (r < 0)
		return r;
	/* The queries it has seen are its parent's: its windows go on from theirs. */
	r = kvdlm_cache_copy_queries(c, parent);
	if (r < 0)
		return r;
	*ret = TAKE_PTR(c);
	return 0;
}
