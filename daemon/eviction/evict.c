/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "common/layout.h"
#include "basic/macro.h"
#include "basic/size.h"
#include "config.h"
#include "compact.h"
#include "compensate.h"
#include "conn.h"
#include "envelope.h"
#include "evict.h"
#include "log.h"
#include "moments.h"
#include "mover.h"
#include "offload.h"
#include "policy.h"
#include "recall.h"
#include "round-gpu.h"
#include "server.h"
#include "unmap.h"
#include "tier.h"

/* A pressure round that found nothing to evict is not repeated sooner than this. */
#define EVICT_IDLE_MS 1000

struct evict_waiter {
	uint64_t conn_id, id;
	evict_done_fn done;
	uint32_t tenant_id;           /* 0: all */
	uint64_t bytes;
	/* A plan (evict_plan): bytes is the exact target, trigger and patch as it says. */
	bool dry;
	enum round_trigger trigger;
	struct evict_patch patch;
};

/* A SeqRecall waiting for its round. */
struct recall_waiter {
	uint64_t conn_id, id, seq_id;
	evict_done_fn done;
};

struct grant_waiter {
	uint64_t conn_id;
	struct parked_grow grow;      /* the requester's, handed back to retry */
	evict_grow_fn retry;
	uint32_t device;              /* the pool device its blocks come from */
	bool at_cap;                  /* waits at its tenant's max (evict_wait_grant) */
	uint64_t deadline_ms;
	uint64_t need_bytes;          /* the new chunks' bytes it lacked */
};

struct evictor {
	struct server *srv;
	struct round *running;
	/* Per pool device of a cuda pool: scoring on the GPU (round-gpu.h), NULL where the
	 * kernels did not load; tried once, at the first round. */
	struct round_gpu *gpu[BACKEND_DEVICES_MAX];
	bool gpu_tried;
	pthread_t thread;
	int efd;
	struct loop_op efd_op;
	uint64_t efd_buf;
	bool efd_armed;
	const char *gate;             /* KVD_TEST_ROUND_GATE */

	/* The Evict request the running round answers, if it runs for one. */
	bool running_request;
	struct evict_waiter running_waiter;
	struct evict_waiter waiters[EVICT_WAITERS_MAX];
	uint32_t n_waiters;
	/* SeqRecalls: the one the running round answers, and those waiting, in order. */
	struct recall_waiter running_recall;
	struct recall_waiter recalls[EVICT_WAITERS_MAX];
	uint32_t n_recalls;
	struct grant_waiter *grants;
	uint32_t n_grants;

	bool budget_lowered;          /* a budget set below use is waiting for a round */
	bool cap_lowered;             /* a cap set below use is waiting for a round */
	uint64_t idle_until_ms;       /* no pressure round before this */
	uint32_t draining_seen;       /* chunks draining at the last tick */
	uint64_t last_interval_ms;

	uint64_t next_id, rounds_total, rounds_failed, last_round_us;
	uint64_t gpu_layers, gpu_fallbacks; /* struct round's, summed */
	struct evict_record history[EVICT_HISTORY];
	uint32_t history_n, history_head;
};

/* Bytes of one token slot of a table: what evicting it frees inside the blocks. */
static uint64_t slot_bytes_of(uint32_t layout, uint32_t dtype, uint32_t head_dim, uint32_t kv_heads,
                              uint32_t index_dim) {
	uint64_t row = 2ull * head_dim * layout_dtype_bytes(dtype);

	return (layout == KVD_LAYOUT_PER_LAYER ? row * kv_heads : row) +
	       (uint64_t)index_dim * layout_dtype_bytes(dtype);
}

struct plan *plan_free(struct plan *p) {
	if (p) {
		free(p->drop_off);
		free(p->drop_slots);
		free(p->fold);
		free(p->fold_count);
		free(p);
	}
	return NULL;
}

static uint32_t tenant_index(const struct server *s, const struct tenant *t) {
	for (uint32_t i = 0; i < s->tenants.n; i++)
		if (s->tenants.tenants[i] == t)
			return i;
	return UINT32_MAX;
}

bool evict_engine_done(struct server *s, struct seq *q) {
	const struct conn *c;

	if (!q->wait_events)
		return true;
	c = registry_conn(s, q->conn_id);
	for (uint32_t i = 0; c && i < c->n_events; i++) {
		int r;

		if (!(q->wait_events & (UINT32_C(1) << i)))
			continue;
		r = s->pool->ops->event_query(q->device, c->events[i]);
		if (r == -EAGAIN)
			continue;
		if (r < 0)
			log_error("sequence %llu: its engine's event %u cannot be queried: %s",
			          (unsigned long long)q->id, i + 1, strerror(-r));
		q->wait_events &= ~(UINT32_C(1) << i);
		s->engine_events_done++;
	}
	if (!c)
		q->wait_events = 0;
	return q->wait_events == 0;
}

/* ---- snapshot ---- */

/* Copies the compensation block of (layer, kv head) h of q into buf (moments_bytes). */
static int compensation_read(struct pool *p, const struct seq *q, uint32_t h, void *buf) {
	return p->ops->read(q->device, pool_block_addr(p, desc_moments(q->desc)[h]), buf,
	                    q->model->moments_bytes);
}

/*
 * kvd-mi's inputs: each (layer, kv head)'s key mean and count, copied at the snapshot. A
 * kvd-mi tenant's model without moments gets empty summaries, so that every round measures
 * the misfit against its provisional summary (policy.h); its tokens then rank as they
 * would with moments on a sequence's first round.
 */
static int snapshot_moments(struct server *s, struct seq *sq, struct round_seq *q) {
	uint32_t heads = sq->model->layers * sq->model->kv_heads, d = sq->model->head_dim;
	_cleanup_(freep) struct kvd_moments_header *hdr = NULL;
	bool moments;

	q->compensation = sq->model->compensation;
	moments = q->compensation == KVD_COMPENSATION_MOMENTS && sq->desc->moments_blocks > 0;
	if (!moments && !(kvd_policy_info(sq->tenant->policy)->flags & KVD_POLICY_NEEDS_MOMENTS))
		return 0;
	q->mi_mean_k = calloc((uint64_t)heads * d, sizeof(float));
	q->mi_count = calloc(heads, sizeof(uint64_t));
	hdr = moments ? malloc(sq->model->moments_bytes) : NULL;
	if (!q->mi_mean_k || !q->mi_count || (moments && !hdr))
		return -ENOMEM;
	for (uint32_t h = 0; moments && h < heads; h++) {
		struct kvd_moments m;
		int r = compensation_read(s->pool, sq, h, hdr);

		if (r < 0)
			return r;
		kvd_moments_view(&m, d, (float *)((char *)hdr + KVD_MOMENTS_HEADER_BYTES));
		memcpy(q->mi_mean_k + (uint64_t)h * d, m.mean_k, d * sizeof(float));
		q->mi_count[h] = hdr->count;
	}
	return 0;
}

/* Slots of table t whose original position is below pos (positions ascend). */
static uint32_t slots_below(const struct kvd_seq_desc *d, uint32_t t, uint64_t pos) {
	return layout_slots_below(layout_positions(d, t), layout_tokens(d)[t], pos);
}

/* Whether the daemon lost its context on the pool's device d (backend_device.failed): no
 * K/V can be read or moved there. */
static bool device_lost(uint32_t d) {
	const struct backend_device *dev = backend_device(d);

	return dev && __atomic_load_n(&dev->failed, __ATOMIC_RELAXED) != 0;
}

static int snapshot_seq(struct server *s, struct seq *sq, uint32_t tenant, struct round_seq *q) {
	const struct model *m = sq->model;
	const struct kvd_seq_desc *d = sq->desc;
	uint64_t nb = 0;

	*q = (struct round_seq){
		.conn_id = sq->conn_id,
		.device = sq->device,
		.seq_id = sq->id,
		.epoch = sq->epoch,
		.tenant = tenant,
		.layers = m->layers,
		.q_heads = m->q_heads,
		.kv_heads = m->kv_heads,
		.head_dim = m->head_dim,
		.dtype = m->dtype,
		.block_tokens = m->block_tokens,
		.layout = m->layout,
		.unit = m->unit,
		.window = m->window,
		.n_tables = m->n_tables,
		.block_bytes = m->block_bytes,
		.block_stride = ALIGN_TO(m->block_bytes, LAYOUT_BLOCK_ALIGN),
		.index_heads = m->index_heads,
		.index_dim = m->index_dim,
		.index_offset = m->index_offset,
	};
	q->rows = m->unit == KVD_UNIT_LAYER_TOKEN ? m->layers : m->n_tables;
	q->tokens = malloc(m->n_tables * sizeof(uint32_t));
	q->sink_slots = malloc(m->n_tables * sizeof(uint32_t));
	q->window_end = malloc(m->n_tables * sizeof(uint32_t));
	q->written_end = malloc(m->n_tables * sizeof(uint32_t));
	q->block_off = malloc((m->n_tables + 1) * sizeof(uint64_t));
	q->grams = calloc(m->layers, sizeof(*q->grams));
	q->smooth_in = sq->smooth ? calloc(q->rows, sizeof(float *)) : NULL;
	if (!q->tokens || !q->sink_slots || !q->window_end || !q->written_end || !q->block_off ||
	    !q->grams ||
	    (sq->smooth && !q->smooth_in))
		return -ENOMEM;
	for (uint32_t t = 0; t < m->n_tables; t++) {
		uint32_t l = m->layout == KVD_LAYOUT_PER_HEAD ? t / m->kv_heads : t;
		uint64_t stamp = obs_stamp(sq->obs, l);

		q->tokens[t] = layout_tokens(d)[t];
		q->sink_slots[t] = MAX(slots_below(d, t, m->sinks), seq_shared_slots(sq, s->pool, t));
		q->window_end[t] = stamp ? slots_below(d, t, stamp) : 0;
		q->written_end[t] = slots_below(d, t, sq->written_pos);
		q->block_off[t] = nb;
		nb += DIV_ROUND_UP(q->tokens[t], m->block_tokens);
	}
	q->block_off[m->n_tables] = nb;
	q->block_addr = malloc(MAX(nb, 1u) * sizeof(*q->block_addr));
	q->block_chunk = malloc(MAX(nb, 1u) * sizeof(*q->block_chunk));
	if (!q->block_addr || !q->block_chunk)
		return -ENOMEM;
	for (uint32_t t = 0; t < m->n_tables; t++) {
		const struct kvd_block_ref *refs = layout_blocks(d, t);

		for (uint64_t b = 0; b < q->block_off[t + 1] - q->block_off[t]; b++) {
			const uint8_t *a = pool_block_addr(s->pool, refs[b]);

			if (!a)
				return -EFAULT;
			q->block_addr[q->block_off[t] + b] = a;
			q->block_chunk[q->block_off[t] + b] = refs[b].chunk_id;
		}
	}
	for (uint32_t rw = 0; sq->smooth && rw < q->rows; rw++) {
		uint32_t t = round_table_of_row(q, rw), n = q->tokens[t], have = MIN(n, sq->smooth_cap[t]);

		q->smooth_in[rw] = malloc(MAX(n, 1u) * sizeof(float));
		if (!q->smooth_in[rw])
			return -ENOMEM;
		if (have > 0)
			memcpy(q->smooth_in[rw], sq->smooth[t], have * sizeof(float));
		for (uint32_t i = have; i < n; i++)
			q->smooth_in[rw][i] = ROUND_UNSCORED;
	}
	for (uint32_t l = 0; m->grams && l < m->layers; l++)
		q->grams[l] = gram_layer_ref(m->grams->layer[l]);
	q->obs = obs_ref(sq->obs);
	return snapshot_moments(s, sq, q);
}

static int snapshot(struct evictor *e, struct round *r) {
	struct server *s = e->srv;
	const struct tenant *only = r->only >= 0 ? s->tenants.tenants[r->only] : NULL;
	uint32_t n = 0;

	r->n_tenants = s->tenants.n;
	r->tenants = calloc(MAX(r->n_tenants, 1u), sizeof(*r->tenants));
	if (!r->tenants)
		return -ENOMEM;
	for (uint32_t i = 0; i < r->n_tenants; i++) {
		const struct tenant *t = s->tenants.tenants[i];

		r->tenants[i] = (struct round_tenant){
			.id = t->id,
			.used = t->used_bytes,
			.min = t->min_bytes,
			.max = t->max_bytes,
			.weight = t->weight,
			.policy = t->policy,
		};
		memcpy(r->tenants[i].name, t->name, sizeof(t->name));
	}
	for (uint32_t g = 0; g < e->n_grants; g++) {
		const struct conn *c = registry_conn(s, e->grants[g].conn_id);

		for (uint32_t i = 0; c && i < r->n_tenants; i++)
			if (s->tenants.tenants[i] == c->tenant)
				r->tenants[i].waiting += e->grants[g].need_bytes;
	}
	/* A round for one tenant (kvd_evict on it) scores its sequences only: the others pay
	 * nothing for it, and their smoothed scores stay as their own rounds left them. */
	for (struct conn *c = s->conns; c; c = c->next)
		for (struct seq *q = c->seqs; q; q = q->next)
			n += q->model->unit != KVD_UNIT_NONE && !q->pending &&
			     (r->device < 0 || q->device == (uint32_t)r->device) &&
			     (!only || q->tenant == only);
	r->seqs = calloc(MAX(n, 1u), sizeof(*r->seqs));
	if (!r->seqs)
		return -ENOMEM;
	for (struct conn *c = s->conns; c; c = c->next)
		for (struct seq *q = c->seqs; q; q = q->next) {
			int k;

			/* A sequence whose plan waits for its unpin is left alone until then; one on
			 * another device frees nothing where the round is aimed. */
			if (q->model->unit == KVD_UNIT_NONE || q->pending ||
			    (r->device >= 0 && q->device != (uint32_t)r->device) ||
			    (only && q->tenant != only) || device_lost(q->device))
				continue;
			/* The round reads its K/V: the engine's last step must be done (a pinned
			 * one is read as it is written anyway; its plan waits for the unpin). */
			if (q->pins == 0 && !evict_engine_done(s, q))
				continue;
			k = snapshot_seq(s, q, tenant_index(s, q->tenant), &r->seqs[r->n_seqs]);
			r->n_seqs++;
			if (k < 0)
				return k;
		}
	return 0;
}

/* ---- applying ---- */

/* Grows q's smoothed arrays to its current tokens, new slots unscored. */
static int smooth_fit(struct seq *q) {
	const struct kvd_seq_desc *d = q->desc;

	if (!q->smooth) {
		q->smooth = calloc(d->n_tables, sizeof(float *));
		q->smooth_cap = calloc(d->n_tables, sizeof(uint32_t));
		if (!q->smooth || !q->smooth_cap)
			return -ENOMEM;
	}
	for (uint32_t t = 0; t < d->n_tables; t++) {
		uint32_t n = layout_tokens(d)[t];
		float *a;

		if (q->smooth_cap[t] >= n)
			continue;
		a = realloc(q->smooth[t], n * sizeof(float));
		if (!a)
			return -ENOMEM;
		for (uint32_t i = q->smooth_cap[t]; i < n; i++)
			a[i] = ROUND_UNSCORED;
		q->smooth[t] = a;
		q->smooth_cap[t] = n;
	}
	return 0;
}

/* Bytes of one slot of one table: the rows of every kv head it covers, K and V, and its
 * index key. */
/* Block bytes of what a round's selection drops from one sequence. */
static uint64_t seq_plan_bytes(const struct round_seq *rq) {
	if (!rq->drop_off)
		return 0;
	return rq->drop_off[rq->n_tables] *
	       slot_bytes_of(rq->layout, rq->dtype, rq->head_dim, rq->kv_heads, rq->index_dim);
}

/* Enters a finished round in the history, with a tenant entry for each tenant it selected
 * from; what is applied is added as it is (record_applied). */
static struct evict_record *record_round(struct evictor *e, const struct round *r) {
	struct evict_record *rec = &e->history[(e->history_head + e->history_n) % EVICT_HISTORY];
	uint32_t n = 0;

	if (e->history_n == EVICT_HISTORY) {
		rec = &e->history[e->history_head];
		e->history_head = (e->history_head + 1) % EVICT_HISTORY;
	} else
		e->history_n++;
	free(rec->tenants);
	*rec = (struct evict_record){
		.id = r->id,
		.trigger = r->trigger,
		.start_ms = r->start_ms,
		.score_us = r->score_us,
		.select_us = r->select_us,
		.target = r->target,
		.sequences = r->n_seqs,
		.units = r->units,
		.predicted_error = r->predicted_error,
		.error = r->error,
	};
	for (uint32_t i = 0; r->error >= 0 && i < r->n_seqs; i++)
		rec->planned += seq_plan_bytes(&r->seqs[i]);
	for (uint32_t i = 0; i < r->n_tenants; i++)
		n += r->tenants[i].evicted_tokens > 0;
	rec->tenants = n ? calloc(n, sizeof(*rec->tenants)) : NULL;
	for (uint32_t i = 0; rec->tenants && i < r->n_tenants; i++)
		if (r->tenants[i].evicted_tokens > 0)
			memcpy(rec->tenants[rec->n_tenants++].name, r->tenants[i].name,
			       sizeof(rec->tenants[0].name));
	e->rounds_total++;
	e->rounds_failed += r->error < 0;
	return rec;
}

static struct evict_record *record_find(struct evictor *e, uint64_t id) {
	for (uint32_t i = 0; i < e->history_n; i++)
		if (e->history[i].id == id)
			return &e->history[i];
	return NULL;
}

static void record_applied(struct evict_record *rec, const char *tenant, uint64_t bytes, uint64_t tokens) {
	for (uint32_t i = 0; rec && i < rec->n_tenants; i++)
		if (strcmp(rec->tenants[i].name, tenant) == 0) {
			rec->tenants[i].applied_bytes += bytes;
			rec->tenants[i].applied_tokens += tokens;
			return;
		}
}

static uint64_t record_applied_bytes(const struct evict_record *rec) {
	uint64_t bytes = 0;

	for (uint32_t i = 0; i < rec->n_tenants; i++)
		bytes += rec->tenants[i].applied_bytes;
	return bytes;
}

/* A plan that waited for an unpin is settled: applied (tokens >= 0) or dropped. */
static void record_plan_settled(struct evictor *e, const struct plan *p, const char *tenant,
                                int64_t tokens) {
	struct evict_record *rec = record_find(e, p->round_id);

	/* Older than the history: nothing left to correct. */
	if (!rec)
		return;
	rec->waiting -= MIN(rec->waiting, p->bytes);
	if (tokens >= 0)
		record_applied(rec, tenant, p->bytes, (uint64_t)tokens);
	else
		rec->dropped += p->bytes;
}

struct plan *evict_plan_drop(struct evictor *e, struct plan *p) {
	if (p)
		record_plan_settled(e, p, NULL, -1);
	return plan_free(p);
}

static uint64_t slot_bytes(const struct model *m) {
	return slot_bytes_of(m->layout, m->dtype, m->head_dim, m->kv_heads, m->index_dim);
}

/*
 * Merges the round's summaries of what q drops into q's compensation blocks. Runs with the
 * compaction that drops them: a plan that is not applied leaves the blocks alone.
 */
static void fold_compensation(struct evictor *e, struct seq *q, const float *fold,
                              const uint64_t *count) {
	struct pool *p = e->srv->pool;
	uint32_t heads = q->model->layers * q->model->kv_heads, d = q->model->head_dim;
	size_t per = compensate_floats(q->model->compensation, d);
	_cleanup_(freep) void *buf = NULL;

	if (!fold || q->desc->moments_blocks == 0)
		return;
	/* Merged in a host copy and written back: on cuda the block is device memory. */
	buf = malloc(q->model->moments_bytes);
	if (!buf) {
		log_warning("sequence %llu: out of memory: what was evicted is not compensated",
		            (unsigned long long)q->id);
		return;
	}
	for (uint32_t h = 0; h < heads; h++) {
		void *block = pool_block_addr(p, desc_moments(q->desc)[h]);

		if (count[h] == 0)
			continue;
		/* The block stays as it was where a copy fails (only a failing device) or the
		 * merge refuses (only a count past 2^64 tokens). */
		if (compensation_read(p, q, h, buf) >= 0 &&
		    compensate_merge(q->model->compensation, buf, d, fold + (uint64_t)h * per,
		                     count[h]) >= 0)
			(void)p->ops->write(q->device, block, buf, q->model->moments_bytes);
	}
}

/*
 * Drops what a plan names from q, now, folding fold (the round's summaries of the drops,
 * or NULL) into its compensation blocks. Chunks emptied go to *emptied. Returns the token slots
 * dropped, or a negative errno (nothing changed).
 */
static int64_t apply_drops(struct evictor *e, struct seq *q, const uint32_t *drop_off,
                           const uint32_t *drop_slots, const float *fold, const uint64_t *fold_count,
                           struct seq_emptied *emptied) {
	const struct model *m = q->model;
	_cleanup_(freep) struct compact_drop *drops = calloc(m->n_tables, sizeof(*drops));
	uint32_t n = 0;
	uint64_t slots = 0, blocks;
	int k, copy_error;

	if (!drops)
		return -ENOMEM;
	/* The smoothed costs move with their slots. */
	k = smooth_fit(q);
	if (k < 0)
		return k;
	for (uint32_t t = 0; t < m->n_tables; t++) {
		uint32_t c = drop_off[t + 1] - drop_off[t];

		if (c == 0)
			continue;
		drops[n++] = (struct compact_drop){ .table = t, .n = c, .slots = drop_slots + drop_off[t] };
		slots += c;
	}
	/* A tenant with recall keeps what leaves (recall.h): read before compaction moves the
	 * survivors over it. Not with compensation, whose summaries count what left. */
	if (q->tenant->recall > 0 && q->model->compensation == KVD_COMPENSATION_NONE) {
		int64_t kept = recall_keep(e->srv->tier, q, e->srv->pool, drops, n);

		if (kept < 0)
			log_warning("sequence %llu: what its round evicts could not be kept for recall: %s",
			            (unsigned long long)q->id, strerror((int)-kept));
	}
	k = seq_compact(q, e->srv->pool, e->gpu[q->device], drops, n, q->smooth, emptied, &blocks,
	                &copy_error);
	if (k < 0)
		return k;
	if (copy_error < 0)
		/* The slots are dropped all the same; what survived may be wrong. */
		log_error("sequence %llu: a K/V copy of its compaction failed: %s; its K/V are not to "
		          "be trusted", (unsigned long long)q->id, strerror(-copy_error));
	fold_compensation(e, q, fold, fold_count);
	/* Its published blocks from the first one that lost tokens hold other content now. */
	prefix_recheck(q);
	q->evicted_tokens += slots;
	q->evicted_bytes += slots * slot_bytes(m);
	q->tenant->evicted_tokens += slots;
	q->tenant->evicted_bytes += slots * slot_bytes(m);
	return (int64_t)slots;
}

static void send_changed(struct server *s, struct seq *q) {
	struct conn *c = registry_conn(s, q->conn_id);

	if (c && !c->closing)
		envelope_event_seq_changed(c, q->id, q->desc->generation);
}

uint64_t evict_settle_tenant(struct evictor *e, struct tenant *t, struct seq_emptied *emptied) {
	struct server *s = e->srv;
	_cleanup_(freep) struct seq **seqs = NULL;
	_cleanup_(freep) uint64_t *epochs = NULL, *ids = NULL;
	uint32_t n = 0, i = 0, changed = 0;
	uint64_t freed;

	for (struct conn *c = s->conns; c; c = c->next)
		if (c->tenant == t && !c->closing)
			n += c->n_seqs;
	seqs = calloc(MAX(n, 1u), sizeof(*seqs));
	epochs = malloc(MAX(n, 1u) * sizeof(*epochs));
	/* (connection, sequence) pairs: sending may close a connection and free its
	 * sequences, so those rewritten are found again by id afterwards. */
	ids = malloc(MAX(n, 1u) * 2 * sizeof(*ids));
	if (seqs && epochs && ids) {
		for (struct conn *c = s->conns; c; c = c->next)
			if (c->tenant == t && !c->closing)
				for (struct seq *q = c->seqs; q; q = q->next)
					/* Its blocks may move: not while its engine writes. */
					if (q->model->unit != KVD_UNIT_NONE && q->pins == 0 &&
					    evict_engine_done(s, q)) {
						epochs[i] = q->epoch;
						seqs[i++] = q;
					}
		if (compact_chunks(s->pool, t, seqs, i, emptied) < 0)
			log_warning("tenant %s: packing its blocks failed: out of memory", t->name);
		for (uint32_t j = 0; j < i; j++)
			if (seqs[j]->epoch != epochs[j]) {
				ids[2 * changed] = seqs[j]->conn_id;
				ids[2 * changed + 1] = seqs[j]->id;
				changed++;
			}
	}
	freed = (uint64_t)emptied->n * s->pool->chunk_bytes;
	unmap_reclaim(s, emptied, NULL, NULL);
	for (uint32_t j = 0; j < changed; j++) {
		struct seq *q = registry_seq(s, ids[2 * j], ids[2 * j + 1]);

		if (q)
			send_changed(s, q);
	}
	return freed;
}

static void retry_grants(struct evictor *e, bool due_only);

void evict_apply_pending(struct evictor *e, struct seq *q) {
	struct server *s = e->srv;
	struct plan *p = q->pending;
	struct seq_emptied emptied = { .chunks = s->scratch + s->scratch_used };
	uint64_t before;
	int64_t k;

	if (!p || q->pins > 0)
		return;
	/* Its engine's step is still running: the tick tries again (evict_tick). */
	if (!evict_engine_done(s, q))
		return;
	q->pending = NULL;
	if (p->epoch == q->epoch) {
		uint64_t conn_id = q->conn_id, seq_id = q->id;

		before = q->epoch;
		k = apply_drops(e, q, p->drop_off, p->drop_slots, p->fold, p->fold_count, &emptied);
		if (k < 0)
			log_warning("sequence %llu: its eviction plan could not be applied: %s",
			            (unsigned long long)q->id, strerror((int)-k));
		record_plan_settled(e, p, q->tenant->name, k);
		(void)evict_settle_tenant(e, q->tenant, &emptied);
		/* evict_settle_tenant only tells about what it moved itself; and its sends may have
		 * closed q's connection, so q is looked up again. */
		q = registry_seq(s, conn_id, seq_id);
		if (q && q->epoch != before)
			send_changed(s, q);
		if (!e->running) {
			e->idle_until_ms = 0;
			retry_grants(e, false);
		}
	} else {
		/* Rewritten since the round's snapshot (kept across a restart and claimed). */
		record_plan_settled(e, p, NULL, -1);
	}
	plan_free(p);
}

/* Applies a finished round on the loop, entering what it applied, parked and dropped in its
 * record; returns the chunk bytes it gave back. */
static uint64_t apply_round(struct evictor *e, struct round *r, struct evict_record *rec) {
	struct server *s = e->srv;
	struct seq_emptied emptied = { .chunks = s->scratch + s->scratch_used };
	_cleanup_(freep) bool *touched = calloc(MAX(r->n_tenants, 1u), sizeof(bool));
	uint64_t freed = 0;

	if (!touched)
		return 0;
	for (uint32_t i = 0; i < r->n_seqs; i++) {
		struct round_seq *rq = &r->seqs[i];
		uint64_t bytes = seq_plan_bytes(rq);
		struct seq *q;
		int64_t k;

		/* The sequence may be gone, or compacted since the snapshot (a plan waiting
		 * for its unpin was applied): then this round's view of it is stale. */
		q = registry_seq(s, rq->conn_id, rq->seq_id);
		if (!q || q->epoch != rq->epoch || !rq->smooth_out || smooth_fit(q) < 0) {
			rec->dropped += bytes;
			continue;
		}
		for (uint32_t rw = 0; rw < rq->rows; rw++) {
			uint32_t t = round_table_of_row(rq, rw), n = MIN(rq->tokens[t], q->smooth_cap[t]);

			/* A table without slots may have no array at all (NULL): nothing to copy. */
			if (n > 0)
				memcpy(q->smooth[t], rq->smooth_out[rw], n * sizeof(float));
		}
		if (!rq->drop_off)
			continue;
		/* Pinned, or its engine still writing: the plan waits (evict_apply_pending). */
		if (q->pins > 0 || !evict_engine_done(s, q)) {
			struct plan *p = calloc(1, sizeof(*p));

			if (!p) {
				rec->dropped += bytes;
				continue;
			}
			p->round_id = r->id;
			p->bytes = bytes;
			rec->waiting += bytes;
			p->epoch = q->epoch;
			p->n_tables = rq->n_tables;
			p->drop_off = TAKE_PTR(rq->drop_off);
			p->drop_slots = TAKE_PTR(rq->drop_slots);
			p->fold = TAKE_PTR(rq->fold);
			p->fold_count = TAKE_PTR(rq->fold_count);
			q->pending = p;
			continue;
		}
		k = apply_drops(e, q, rq->drop_off, rq->drop_slots, rq->fold, rq->fold_count, &emptied);
		if (k < 0) {
			log_warning("sequence %llu: eviction not applied: %s", (unsigned long long)q->id,
			            strerror((int)-k));
			rec->dropped += bytes;
			continue;
		}
		record_applied(rec, q->tenant->name, bytes, (uint64_t)k);
		send_changed(s, q);
		touched[rq->tenant] = true;
	}
	for (uint32_t i = 0; i < r->n_tenants; i++) {
		/* By id: tenants forgotten since the snapshot moved the others in the table (a
		 * touched tenant has sequences, so it is still there). */
		struct tenant *t = touched[i] ? tenant_find_id(&s->tenants, r->tenants[i].id) : NULL;

		if (t) {
			t->rounds++;
			freed += evict_settle_tenant(e, t, &emptied);
		}
	}
	if (emptied.n > 0) {
		freed += (uint64_t)emptied.n * s->pool->chunk_bytes;
		unmap_reclaim(s, &emptied, NULL, NULL);
	}
	return freed;
}

/* ---- replies ---- */

/* Why a round (or a plan) that selected `planned` bytes took nothing, as far as the round
 * itself can tell: writes the reason and returns true, or false when it selected some. */
static bool why_nothing(const struct round *r, uint64_t planned, char *buf, size_t n) {
	const struct round_tenant *only = r->only >= 0 ? &r->tenants[r->only] : NULL;
	char a[32], b[32];

	if (r->target == 0)
		snprintf(buf, n, "nothing to free: use is at or below the target already");
	else if (r->n_seqs == 0)
		snprintf(buf, n, "nothing to evict: no open sequence%s%s of a model registered with an "
		         "eviction unit, or all wait for an unpin", only ? " of tenant " : "",
		         only ? only->name : "");
	else if (planned == 0 && only && only->used <= only->min)
		snprintf(buf, n, "tenant %s holds %s, at or below its guaranteed minimum (%s)", only->name,
		         size_format(only->used, a, sizeof(a)), size_format(only->min, b, sizeof(b)));
	else if (planned == 0)
		snprintf(buf, n, "every resident token is kept: sinks, each table's last window, open "
		         "tail blocks, the eviction floor, or tenants at their minimums");
	else
		return false;
	return true;
}

/* A plan's answer: the round it would be, as a record (id 0), with each tenant's planned
 * bytes, token slots and predicted cost. */
static void answer_plan(struct evictor *e, const struct evict_waiter *w, const struct round *r) {
	struct evict_record plan = {
		.trigger = r->trigger,
		.target = r->target,
		.sequences = r->n_seqs,
		.units = r->units,
		.predicted_error = r->predicted_error,
		.score_us = r->score_us,
		.select_us = r->select_us + r->fold_us,
	};
	_cleanup_(freep) struct evict_record_tenant *ts = NULL;
	struct evict_outcome o = { .error = r->error, .why = "planning the round failed",
	                           .round = &plan };

	ts = r->error >= 0 ? calloc(MAX(r->n_tenants, 1u), sizeof(*ts)) : NULL;
	if (r->error >= 0 && !ts)
		o = (struct evict_outcome){ .error = -ENOMEM, .why = "out of memory" };
	for (uint32_t i = 0; ts && i < r->n_seqs; i++) {
		const struct round_seq *rq = &r->seqs[i];

		if (!rq->drop_off)
			continue;
		ts[rq->tenant].applied_bytes += seq_plan_bytes(rq);
		ts[rq->tenant].applied_tokens += rq->drop_off[rq->n_tables];
		plan.planned += seq_plan_bytes(rq);
	}
	/* Only the tenants it takes from, in place. */
	for (uint32_t i = 0; ts && i < r->n_tenants; i++) {
		if (ts[i].applied_bytes == 0)
			continue;
		ts[plan.n_tenants] = ts[i];
		memcpy(ts[plan.n_tenants].name, r->tenants[i].name, sizeof(ts[0].name));
		ts[plan.n_tenants].predicted_error = r->tenants[i].predicted;
		plan.n_tenants++;
	}
	plan.tenants = ts;
	why_nothing(r, plan.planned, plan.note, sizeof(plan.note));
	w->done(e->srv, w->conn_id, w->id, &o);
}

/* Sets a plan's snapshot to the tenant's settings as the change would make them. */
static void patch_snapshot(struct round *r, const struct evict_patch *patch) {
	for (uint32_t i = 0; patch->tenant_id && i < r->n_tenants; i++)
		if (r->tenants[i].id == patch->tenant_id) {
			r->tenants[i].min = patch->min_bytes;
			r->tenants[i].max = patch->max_bytes;
			r->tenants[i].weight = patch->weight;
			r->tenants[i].policy = patch->policy;
		}
}

/* An Evict request's answer, from its round's record (NULL when none was made: the round
 * never started). */
static void answer_evict(struct evictor *e, const struct evict_waiter *w, const struct round *r,
                         const struct evict_record *rec) {
	struct evict_record none = { .id = r->id, .target = r->target, .error = r->error };
	struct evict_outcome o = { .error = r->error, .why = "the eviction round failed",
	                           .round = rec ? rec : &none };

	if (w->dry)
		answer_plan(e, w, r);
	else
		w->done(e->srv, w->conn_id, w->id, &o);
}

/*
 * Retries parked grows: all of them (those that still fail wait on, until their deadline),
 * or with due_only those past their deadline alone, which get a last try and, short of
 * memory still, their refusal, whatever runs meanwhile: a round that lasts, or one
 * request's round after another, never holds a grow past grant-wait.
 */
static void retry_grants(struct evictor *e, bool due_only) {
	uint64_t now = now_ms();
	struct grant_waiter *list = e->grants;
	uint32_t n = e->n_grants, kept = 0;

	if (due_only) {
		/* Those not due stay where they are, in order; the due ones are taken out. */
		for (uint32_t i = 0; i < e->n_grants; i++)
			kept += now < e->grants[i].deadline_ms;
		if (kept == e->n_grants)
			return;
		/* Without memory for the list, the next tick tries again. */
		list = malloc((e->n_grants - kept) * sizeof(*list));
		if (!list)
			return;
		n = kept = 0;
		for (uint32_t i = 0; i < e->n_grants; i++)
			if (now < e->grants[i].deadline_ms)
				e->grants[kept++] = e->grants[i];
			else
				list[n++] = e->grants[i];
		e->n_grants = kept;
	} else {
		/* A retry may park its grow again: give it a fresh list to do so. */
		e->grants = NULL;
		e->n_grants = 0;
	}
	for (uint32_t i = 0; i < n; i++) {
		struct grant_waiter *g = &list[i];
		struct conn *c = registry_conn(e->srv, g->conn_id);

		if (!c || c->closing)
			continue;
		c->outstanding--;
		g->retry(c, &g->grow, now >= g->deadline_ms ? 0 : g->deadline_ms);
	}
	free(list);
}

/* ---- scheduling ---- */

static void *round_thread(void *userdata) {
	struct evictor *e = userdata;
	uint64_t one = 1;

	round_run(e->running);
	if (e->gate) {
		int fd = open(e->gate, O_RDONLY | O_CLOEXEC);
		char b;

		if (fd >= 0) {
			(void)!read(fd, &b, 1);
			close(fd);
		}
	}
	(void)!write(e->efd, &one, sizeof(one));
	return NULL;
}

static void on_round_done(struct loop_op *op, int res, bool more);

static int arm(struct evictor *e) {
	int k;

	if (e->efd_armed)
		return 0;
	k = loop_read(e->srv->loop, &e->efd_op, e->efd, &e->efd_buf, sizeof(e->efd_buf));
	if (k >= 0)
		e->efd_armed = true;
	return k;
}

/*
 * Bytes a round has already taken and the pool will have back once their holders unmap
 * them (DRAINING chunks within unmap-timeout), on one device or (-1) all. Rounds count them
 * as freed: a holder that cannot answer (stopped, hung) would otherwise see every later
 * round evict from it again for the same shortfall, and lose nearly all it holds. Past
 * the deadline they no longer count: the holder is late, then disconnected, and a process
 * that lives on keeps them until it exits (departed.h); rounds then free the shortfall
 * elsewhere rather than let every grow wait for them.
 */
static uint64_t awaiting_unmap(const struct server *s, int device) {
	const struct pool *p = s->pool;
	uint32_t n = 0;

	for (uint32_t d = 0; d < p->n_devices; d++)
		if (device < 0 || (uint32_t)device == d)
			n += p->device_draining[d] - MIN(s->draining_late[d], p->device_draining[d]);
	return (uint64_t)n * p->chunk_bytes;
}

/* Bytes in use that no round has taken yet. */
static uint64_t used_not_taken(const struct server *s) {
	return s->pool->used_bytes - awaiting_unmap(s, -1);
}

/* Bytes that waiting grows lack beyond those awaiting unmap. */
static uint64_t grants_need(const struct evictor *e) {
	uint64_t need = 0, coming = awaiting_unmap(e->srv, -1);

	for (uint32_t i = 0; i < e->n_grants; i++)
		need += e->grants[i].need_bytes;

	return need > coming ? need - coming : 0;
}

/*
 * The device a round for the waiting grows must free chunks on, or -1: when the budget has
 * room for a chunk, what the first waiting grow lacks is its device's free chunks (pool.h),
 * and evicting from other devices would free nothing it can use.
 */
static int full_device(const struct evictor *e) {
	const struct pool *p = e->srv->pool;
	uint32_t d;

	if (p->n_devices == 1 || e->n_grants == 0 || !pool_budget_has_room(p))
		return -1;
	d = e->grants[0].device;
	return pool_device_free_chunks(p, d) > 0 ? -1 : (int)d;
}

/*
 * With several devices, the first whose own pool is used past the high watermark (the
 * watermarks apply to each device's share as to the budget), or -1; *ret_target gets the
 * bytes down to its low watermark. A device can fill while the budget has room: its grows
 * would then wait for a round aimed at it (full_device()); this one comes first.
 */
static int device_over_watermark(const struct evictor *e, uint64_t *ret_target) {
	const struct pool *p = e->srv->pool;
	uint64_t share = (uint64_t)p->device_chunks * p->chunk_bytes;
	uint64_t high = size_percent(share, e->srv->limits.high_watermark);
	uint64_t low = size_percent(share, e->srv->limits.low_watermark);

	for (uint32_t d = 0; p->n_devices > 1 && d < p->n_devices; d++) {
		uint64_t used = pool_device_used_bytes(p, d) - awaiting_unmap(e->srv, (int)d);

		if (used > high) {
			*ret_target = used - low;
			return (int)d;
		}
	}
	return -1;
}

/* What a round, or moving idle sequences to the host tier before it (offload.h), may free. */
static bool evictable_exists(const struct server *s) {
	return s->evictable_seqs > 0 || s->tier->budget_bytes > 0;
}

/* The GPUs' scoring for a round (round.h), loaded at the first round; NULL on host. */
static struct round_gpu *const *gpus(struct evictor *e) {
	const struct pool *p = e->srv->pool;

	if (p->ops->host_access)
		return NULL;
	for (uint32_t d = 0; !e->gpu_tried && d < p->n_devices; d++) {
		const struct backend_device *dev = backend_device(d);
		char why[256] = "";
		int k;

#if KVD_TEST_HOOKS
		if (getenv("KVD_TEST_ROUND_CPU"))
			snprintf(why, sizeof(why), "KVD_TEST_ROUND_CPU is set");
#endif
		k = why[0] ? -ENODEV : round_gpu_new(d, &e->gpu[d], why, sizeof(why));
		if (k < 0)
			log_info("GPU %d: rounds score on the CPU, with the K/V copied there: %s",
			         dev ? dev->index : (int)d, why);
		else
			log_info("GPU %d: rounds score restkv and laprox there", dev ? dev->index : (int)d);
	}
	e->gpu_tried = true;
	/* A device whose context was lost scores nothing more (no round runs now). */
	for (uint32_t d = 0; d < p->n_devices; d++)
		if (e->gpu[d] && device_lost(d))
			e->gpu[d] = round_gpu_free(e->gpu[d]);
	return e->gpu;
}

/* Runs r on the worker. Returns 0 or a negative errno (nothing started). */
static int launch(struct evictor *e, struct round *r) {
	int k = arm(e);

	if (k < 0)
		return k;
	e->running = r;
	/* The worker reads blocks at the snapshot's addresses until on_round_done(). */
	pool_readers_begin(e->srv->pool);
	k = -pthread_create(&e->thread, NULL, round_thread, e);
	if (k < 0) {
		e->running = NULL;
		pool_readers_end(e->srv->pool);
	}
	return k;
}

static void start_round(struct evictor *e, enum round_trigger why, uint64_t target, int only,
                        int device) {
	struct server *s = e->srv;
	bool dry = e->running_request && e->running_waiter.dry;
	struct evict_record *rec;
	struct round *r;
	int k;

	r = calloc(1, sizeof(*r));
	if (!r) {
		struct round none = { .error = -ENOMEM, .trigger = why, .only = -1 };

		log_error("cannot start an eviction round: out of memory");
		if (e->running_request) {
			e->running_request = false;
			answer_evict(e, &e->running_waiter, &none, NULL);
		}
		return;
	}
	/* A plan is not a round: it takes no id of the history's. */
	r->id = dry ? 0 : ++e->next_id;
	r->dry_run = dry;
	r->trigger = why;
	r->start_ms = now_ms() - s->start_ms;
	r->target = target;
	r->only = only;
	r->device = device;
	if (device >= 0)
		log_debug("round %llu: aimed at device %d, whose own pool is short",
		          (unsigned long long)r->id, device);
	r->floor_pct = s->limits.eviction_floor;
	r->threads = s->limits.round_threads;
	r->mem = s->pool->ops;
	r->gpu = gpus(e);
	k = snapshot(e, r);
	if (k >= 0 && dry)
		patch_snapshot(r, &e->running_waiter.patch);
	if (k >= 0)
		k = launch(e, r);
	if (k < 0) {
		log_error_errno(k, "cannot start an eviction round");
		r->error = k;
		rec = dry ? NULL : record_round(e, r);
		if (e->running_request) {
			answer_evict(e, &e->running_waiter, r, rec);
			e->running_request = false;
		}
		round_free(r);
		return;
	}
	log_debug("eviction round %llu (%s): %u sequences, target %llu bytes", (unsigned long long)r->id,
	          round_trigger_to_string(why), r->n_seqs, (unsigned long long)target);
}

uint64_t evict_default_target(const struct evictor *e) {
	const struct server *s = e->srv;
	uint64_t used = used_not_taken(s), low = size_percent(s->pool->budget_bytes, s->limits.low_watermark);

	return used > low ? used - low : 0;
}

uint64_t evict_budget_target(const struct evictor *e, uint64_t budget) {
	const struct server *s = e->srv;
	uint64_t used = used_not_taken(s);

	if (used <= size_percent(budget, s->limits.high_watermark))
		return 0;
	return used - size_percent(budget, s->limits.low_watermark);
}

uint64_t evict_cap_target(const struct evictor *e, const struct tenant *t, uint64_t t_max) {
	const struct server *s = e->srv;
	uint64_t over = 0;

	for (uint32_t i = 0; i < s->tenants.n; i++) {
		const struct tenant *o = s->tenants.tenants[i];
		uint64_t max = o == t ? t_max : o->max_bytes;

		if (max != KVD_TENANT_NO_CAP && o->used_bytes > max)
			over += o->used_bytes - max;
	}
	return over;
}

/* What the change a plan is for would have a round free now (see evict_plan()). */
static uint64_t plan_target(const struct evictor *e, const struct evict_waiter *w) {
	const struct tenant *t;

	switch (w->trigger) {
	case ROUND_BUDGET:
		return evict_budget_target(e, w->bytes);
	case ROUND_CAP:
		t = w->patch.tenant_id ? tenant_find_id(&e->srv->tenants, w->patch.tenant_id) : NULL;
		/* Only a cap below what the tenant holds evicts at once. */
		return t && w->patch.max_bytes < t->used_bytes ?
		               evict_cap_target(e, t, w->patch.max_bytes) : 0;
	default:
		return w->bytes ? w->bytes : evict_default_target(e);
	}
}

static bool start_recall(struct evictor *e, const struct recall_waiter *w);

/*
 * Starts the round an Evict request, a plan or a SeqRecall waits for, the oldest first
 * (recalls before the others: their engines wait for them before their next step).
 * Returns whether one started.
 */
static bool start_request(struct evictor *e) {
	struct server *s = e->srv;

	while (e->n_recalls > 0) {
		struct recall_waiter w = e->recalls[0];

		memmove(e->recalls, e->recalls + 1, --e->n_recalls * sizeof(*e->recalls));
		if (start_recall(e, &w))
			return true;
	}
	while (e->n_waiters > 0) {
		struct evict_waiter w = e->waiters[0];
		uint64_t target;
		int only = -1;

		memmove(e->waiters, e->waiters + 1, --e->n_waiters * sizeof(*e->waiters));
		if (w.tenant_id)
			for (uint32_t i = 0; i < s->tenants.n; i++)
				if (s->tenants.tenants[i]->id == w.tenant_id)
					only = (int)i;
		if (w.tenant_id && only < 0)
			/* Its tenant was forgotten since (it held nothing): nothing to free, and
			 * certainly not from the others. */
			target = 0;
		else if (w.dry)
			/* Now, not when asked: a round that ran in between changed what is used. */
			target = plan_target(e, &w);
		else
			target = w.bytes ? w.bytes : evict_default_target(e);
		if (w.dry && target == 0) {
			/* Nothing to plan: the answer says so at once, as a round would. */
			struct round r = { .trigger = w.trigger, .only = -1 };

			answer_plan(e, &w, &r);
			continue;
		}
		e->running_request = true;
		e->running_waiter = w;
		start_round(e, w.dry ? w.trigger : ROUND_EVICT, target, only, -1);
		return true;
	}
	return false;
}

/*
 * Starts the round that pressure calls for, if any: grows waiting for memory, a budget or
 * a cap set below use, use past the high watermark, or the interval. Returns whether one
 * started.
 */
uint64_t evict_shed_cache(struct server *s, const struct tenant *t, uint64_t need) {
	struct seq_emptied emptied = { .chunks = s->scratch + s->scratch_used };
	uint64_t dropped = 0;

	/* One entry at a time: a chunk comes free only when its every block went. Cached
	 * blocks that share chunks with live ones free no chunk: past twice the bytes sought,
	 * the rest is left to the round. */
	while (s->prefix.cached_blocks > 0 && (uint64_t)emptied.n * s->pool->chunk_bytes < need &&
	       (t || dropped / 2 < need)) {
		uint64_t k = prefix_shed(&s->prefix, s->pool, t, 1, &emptied);

		if (k == 0)
			break;
		dropped += k;
		/* A tenant at its max gets room from its own blocks, chunk or not. */
		if (t && dropped >= need)
			break;
	}
	if (dropped > 0)
		log_debug("prefix cache: dropped %llu bytes of cached blocks for memory",
		          (unsigned long long)dropped);
	need = (uint64_t)emptied.n * s->pool->chunk_bytes;
	unmap_reclaim(s, &emptied, NULL, NULL);
	return t ? dropped : need;
}

static bool start_pressure(struct evictor *e) {
	struct server *s = e->srv;
	struct pool *p = s->pool;
	uint64_t now = now_ms(), high, low, target = 0, cap_target = 0, used = used_not_taken(s);
	enum round_trigger why;
	int device = -1;

	if (!evictable_exists(s) && s->prefix.cached_blocks == 0)
		return false;
	high = size_percent(p->budget_bytes, s->limits.high_watermark);
	low = size_percent(p->budget_bytes, s->limits.low_watermark);
	if (e->n_grants > 0)
		why = ROUND_GRANT;
	else if (e->budget_lowered && used > p->budget_bytes)
		why = ROUND_BUDGET;
	else if (e->cap_lowered && (cap_target = evict_cap_target(e, NULL, 0)) > 0)
		why = ROUND_CAP;
	else if (used > high)
		why = ROUND_WATERMARK;
	else if ((device = device_over_watermark(e, &target)) >= 0)
		why = ROUND_WATERMARK;
	else if (s->limits.round_interval_ms && now - e->last_interval_ms >= s->limits.round_interval_ms)
		why = ROUND_INTERVAL;
	else
		return false;
	if (why != ROUND_INTERVAL && now < e->idle_until_ms)
		return false;
	if (why == ROUND_INTERVAL)
		e->last_interval_ms = now;
	else if (why == ROUND_CAP)
		target = cap_target;
	else if (device < 0) {
		/* Grows waiting below the high watermark (bytes awaiting unmap do not count)
		 * need their chunks, not a round down to the low watermark. */
		target = grants_need(e);
		if (why != ROUND_GRANT || used > high)
			target = MAX(target, used > low ? used - low : 0);
	}
	/* A round runs for the shortfall only: what earlier rounds took and holders have yet
	 * to unmap covers the rest, and the grows waiting for it are served when it is back
	 * (evict_chunks_back). */
	if (why != ROUND_INTERVAL && target == 0)
		return false;
	if (why == ROUND_GRANT)
		device = full_device(e);
	e->budget_lowered = false;
	e->cap_lowered = false;
	/* Cached blocks (prefix.h) go first, then idle sequences leave whole, before any
	 * token is evicted: those on their way out count as freed, as bytes awaiting unmap
	 * do, and a round runs for the rest. */
	if (why != ROUND_INTERVAL && why != ROUND_CAP) {
		uint64_t coming = mover_out_bytes(s->mover);

		if (coming < target)
			coming += evict_shed_cache(s, NULL, target - coming);

		if (coming < target)
			coming += offload_for_pressure(s, target - coming, device);
		if (coming >= target)
			return false;
		target -= coming;
	}
	if (s->evictable_seqs == 0)
		return false;
	start_round(e, why, target, -1, device);
	return true;
}

/*
 * Starts the next round, if none runs. Grows waiting for memory come first: a round for
 * them runs before any request's (Evict, Plan, SeqRecall), which a tenant could otherwise
 * queue without end in front of everyone's grows (docs/security.md); requests then go
 * before the other pressure rounds, as their clients wait for them.
 */
void evict_kick(struct evictor *e, enum round_trigger why) {
	bool grants = e->n_grants > 0;

	if (why == ROUND_BUDGET)
		e->budget_lowered = true;
	if (e->running || e->srv->stopping)
		return;
	if (grants && start_pressure(e))
		return;
	/* With grows waiting, pressure was looked at already. */
	if (!start_request(e) && !grants)
		start_pressure(e);
}

/* ---- recall ---- */

/* A SeqRecall's answer: an error with why, or what rq traded (tokens slots back). */
static void answer_recall(struct evictor *e, const struct recall_waiter *w, int error,
                          const char *why, const struct round_seq *rq, uint64_t tokens) {
	struct evict_outcome o = { .error = error, .why = why, .tokens = tokens };

	if (rq) {
		o.bytes = tokens * slot_bytes_of(rq->layout, rq->dtype, rq->head_dim, rq->kv_heads,
		                                 rq->index_dim);
		o.candidates = rq->candidates;
	}
	w->done(e->srv, w->conn_id, w->id, &o);
}

/* The policy recalls of q score with (kvd.conf(5), recall-policy). */
static int recall_policy(const struct server *s, const struct seq *q) {
	if (s->limits.recall_policy >= 0)
		return s->limits.recall_policy;
	return q->model->index_dim ? KVD_POLICY_INDEXMEM : KVD_POLICY_RESTKV;
}

/* Why q cannot be recalled into now (0: it can). */
static int recall_refusal(struct evictor *e, struct seq *q, const char **why) {
	if (q->pins > 0)
		return *why = "the sequence is pinned: ask for a recall between steps", -EBUSY;
	if (q->tiered || q->move)
		return *why = "the sequence is moved out of the pool, or moving: pin it first", -EAGAIN;
	if (!evict_engine_done(e->srv, q))
		return *why = "the engine's last step on the sequence has not completed", -EAGAIN;
	if (device_lost(q->device))
		return *why = "the daemon lost its context on the sequence's GPU (a sticky error)",
		       -ENODEV;
	return 0;
}

/* Snapshot of a recall round: q alone, its tenant ranking by the recall policy. */
static int recall_snapshot(struct evictor *e, struct seq *q, struct round *r) {
	struct server *s = e->srv;
	const struct kvd_seq_desc *d = q->desc;
	struct round_seq *rq;
	uint64_t n = 0;
	int k;

	r->tenants = calloc(1, sizeof(*r->tenants));
	r->seqs = calloc(1, sizeof(*r->seqs));
	if (!r->tenants || !r->seqs)
		return -ENOMEM;
	r->n_tenants = 1;
	r->tenants[0] = (struct round_tenant){
		.id = q->tenant->id,
		.weight = q->tenant->weight,
		.policy = recall_policy(s, q),
	};
	memcpy(r->tenants[0].name, q->tenant->name, sizeof(q->tenant->name));
	rq = &r->seqs[0];
	k = snapshot_seq(s, q, 0, rq);
	r->n_seqs = 1;
	if (k < 0)
		return k;
	rq->pos_off = malloc((d->n_tables + 1) * sizeof(uint64_t));
	if (!rq->pos_off)
		return -ENOMEM;
	for (uint32_t t = 0; t < d->n_tables; t++) {
		rq->pos_off[t] = n;
		n += layout_tokens(d)[t];
	}
	rq->pos_off[d->n_tables] = n;
	rq->positions = malloc(MAX(n, 1u) * sizeof(uint32_t));
	if (!rq->positions)
		return -ENOMEM;
	for (uint32_t t = 0; t < d->n_tables; t++)
		memcpy(rq->positions + rq->pos_off[t], layout_positions(d, t),
		       layout_tokens(d)[t] * sizeof(uint32_t));
	rq->recall_max = q->tenant->recall;
	return 0;
}

/*
 * Starts the round of recall w, or answers it at once (the sequence gone, refused, or
 * nothing kept). Returns whether a round runs.
 */
static bool start_recall(struct evictor *e, const struct recall_waiter *w) {
	struct server *s = e->srv;
	struct seq *q = registry_seq(s, w->conn_id, w->seq_id);
	const char *why = "";
	struct round *r;
	int k;

	/* A plan waiting for the unpin goes first: the recall sees what it left. */
	if (q && q->pending && q->pins == 0) {
		evict_apply_pending(e, q);
		q = registry_seq(s, w->conn_id, w->seq_id);
	}
	if (!q) {
		answer_recall(e, w, -ENOENT, "the sequence was released", NULL, 0);
		return false;
	}
	k = recall_refusal(e, q, &why);
	if (k == 0 && q->pending)
		k = -EAGAIN, why = "an eviction plan for the sequence waits for its engine";
	if (k < 0) {
		answer_recall(e, w, k, why, NULL, 0);
		return false;
	}
	if (recall_kept_total(q->kept) == 0) {
		answer_recall(e, w, 0, NULL, NULL, 0);
		return false;
	}
	r = calloc(1, sizeof(*r));
	if (!r) {
		answer_recall(e, w, -ENOMEM, "out of memory", NULL, 0);
		return false;
	}
	r->id = ++e->next_id;
	r->recall = true;
	r->trigger = ROUND_RECALL;
	r->start_ms = now_ms() - s->start_ms;
	r->only = -1;
	r->device = -1;
	r->threads = s->limits.round_threads;
	r->mem = s->pool->ops;
	k = recall_snapshot(e, q, r);
	if (k >= 0) {
		/* The round holds the kept tokens until it is applied: nothing else adds to
		 * them meanwhile (one round at a time), and an offload waits (offload.h). */
		r->seqs[0].kept = TAKE_PTR(q->kept);
		recall_store_hold(r->seqs[0].kept, true);
		q->recalling = true;
		e->running_recall = *w;
		k = launch(e, r);
		if (k < 0) {
			q->kept = TAKE_PTR(r->seqs[0].kept);
			recall_store_hold(q->kept, false);
			q->recalling = false;
		}
	}
	if (k < 0) {
		log_error_errno(k, "cannot start a recall round");
		answer_recall(e, w, k, "cannot start the recall round", NULL, 0);
		round_free(r);
		return false;
	}
	return true;
}

/* Trades what the recall round r picked in q. Returns the token slots brought back, or a
 * negative errno. */
static int64_t recall_apply(struct evictor *e, struct round *r, struct seq *q,
                            struct recall_store *st) {
	struct round_seq *rq = &r->seqs[0];
	_cleanup_(freep) struct recall_trade *trades = NULL;
	int k, copy_error;

	if (smooth_fit(q) < 0)
		return -ENOMEM;
	for (uint32_t rw = 0; rw < rq->rows; rw++) {
		uint32_t t = round_table_of_row(rq, rw), n = MIN(rq->tokens[t], q->smooth_cap[t]);

		if (n > 0)
			memcpy(q->smooth[t], rq->smooth_out[rw], n * sizeof(float));
	}
	if (!rq->drop_off)
		return 0;
	trades = calloc(rq->n_tables, sizeof(*trades));
	if (!trades)
		return -ENOMEM;
	for (uint32_t t = 0; t < rq->n_tables; t++)
		trades[t] = (struct recall_trade){
			.n = rq->drop_off[t + 1] - rq->drop_off[t],
			.drop = rq->drop_slots + rq->drop_off[t],
			.take = rq->take + rq->take_off[t],
			.take_s = rq->take_s + rq->take_off[t],
		};
	k = recall_swap(q, e->srv->pool, st, trades, &copy_error);
	if (k < 0)
		return k;
	/* As after a round: its published blocks that traded slots hold other content. */
	prefix_recheck(q);
	if (copy_error < 0)
		log_error("sequence %llu: a K/V copy of its recall failed: %s; its K/V are not to be "
		          "trusted", (unsigned long long)q->id, strerror(-copy_error));
	return rq->drop_off[rq->n_tables];
}

static void recall_done(struct evictor *e, struct round *r) {
	struct server *s = e->srv;
	struct round_seq *rq = &r->seqs[0];
	struct recall_store *st = TAKE_PTR(rq->kept);
	struct seq *q = registry_seq(s, rq->conn_id, rq->seq_id);
	struct recall_waiter w = e->running_recall;
	const char *why = "the recall round failed";
	uint64_t t0 = now_us();
	struct evict_record *rec;
	int64_t k = r->error;

	rec = record_round(e, r);
	rec->planned = 0;
	rec->scored = rq->candidates;
	if (!q) {
		recall_store_free(s->tier, st);
		k = -ENOENT, why = "the sequence was released during its recall";
	} else {
		q->recalling = false;
		if (k >= 0 && (k = recall_refusal(e, q, &why)) == 0 && q->epoch != rq->epoch)
			k = -EAGAIN, why = "the sequence was rewritten during its recall";
		if (k >= 0) {
			k = recall_apply(e, r, q, st);
			if (k < 0)
				why = "its tables could not be rewritten";
		}
		/* Recall turned off meanwhile: nothing is kept any more (admin.c). */
		recall_store_hold(st, false);
		q->kept = q->tenant->recall > 0 ? st : recall_store_free(s->tier, st);
	}
	if (k >= 0 && rq->drop_off)
		rec->recalled = (uint64_t)k;
	rec->compact_us = now_us() - t0;
	rec->duration_us = r->score_us + rec->compact_us;
	s->tier->token_recalls++;
	s->tier->tokens_recalled += rec->recalled;
	s->tier->tokens_scored += rq->candidates;
	s->tier->token_recall_us += rec->duration_us;
	log_info("recall round %llu: sequence %llu: %llu token slots back of %llu kept ones scored; "
	         "%.1f ms (score %.1f, trade %.1f)%s%s", (unsigned long long)r->id,
	         (unsigned long long)rq->seq_id, (unsigned long long)rec->recalled,
	         (unsigned long long)rq->candidates, rec->duration_us / 1e3, r->score_us / 1e3,
	         rec->compact_us / 1e3, k < 0 ? ": " : "", k < 0 ? why : "");
	answer_recall(e, &w, k < 0 ? (int)k : 0, why, rq, rec->recalled);
	if (q && rec->recalled > 0) {
		q->tenant->recalled_tokens += rec->recalled;
		send_changed(s, q);
	}
}

int evict_recall(struct evictor *e, struct conn *c, uint64_t id, struct seq *q,
                 evict_done_fn done) {
	const char *why;
	int k;

	if (e->n_recalls == EVICT_WAITERS_MAX)
		return -EBUSY;
	k = recall_refusal(e, q, &why);
	if (k < 0)
		return k;
	e->recalls[e->n_recalls++] = (struct recall_waiter){ c->id, id, q->id, done };
	c->outstanding++;
	evict_kick(e, ROUND_RECALL);
	return 0;
}

void evict_cap_lowered(struct evictor *e) {
	e->cap_lowered = true;
	evict_kick(e, ROUND_CAP);
}

/* Why a round gave no chunk back, in its record's note (nothing when it did, or failed). */
static void note_nothing_freed(const struct round *r, struct evict_record *rec) {
	uint64_t applied = record_applied_bytes(rec);
	char a[32];

	if (r->error < 0 || rec->freed > 0 || why_nothing(r, rec->planned, rec->note, sizeof(rec->note)))
		return;
	if (applied == 0 && rec->waiting > 0)
		snprintf(rec->note, sizeof(rec->note), "its plan (%s) waits for pinned sequences to be "
		         "unpinned", size_format(rec->waiting, a, sizeof(a)));
	else if (applied == 0)
		snprintf(rec->note, sizeof(rec->note), "its plan was dropped: the sequences were released "
		         "or rewritten meanwhile");
	else
		snprintf(rec->note, sizeof(rec->note), "evicted %s inside the tenants' blocks, but no "
		         "chunk came free: each still holds other blocks",
		         size_format(applied, a, sizeof(a)));
}

/* One line per round at info level (rate-limited like every message: kvd(8), LOGGING). */
static void log_round(const struct round *r, struct evict_record *rec) {
	char target[32], planned[32], applied[32], waiting[32], dropped[32], freed[32];
	uint32_t tenants = 0;

	note_nothing_freed(r, rec);
	for (uint32_t i = 0; i < rec->n_tenants; i++)
		tenants += rec->tenants[i].applied_bytes > 0;
	log_info("eviction round %llu (%s): target %s; planned %s, applied %s from %u tenant%s, "
	         "waiting %s, dropped %s; chunks freed %s; %.1f ms (score %.1f, select %.1f, "
	         "compact %.1f)%s%s",
	         (unsigned long long)r->id, round_trigger_to_string(r->trigger),
	         size_format(r->target, target, sizeof(target)),
	         size_format(rec->planned, planned, sizeof(planned)),
	         size_format(record_applied_bytes(rec), applied, sizeof(applied)), tenants,
	         tenants == 1 ? "" : "s",
	         size_format(rec->waiting, waiting, sizeof(waiting)),
	         size_format(rec->dropped, dropped, sizeof(dropped)),
	         size_format(rec->freed, freed, sizeof(freed)), rec->duration_us / 1e3,
	         r->score_us / 1e3, (r->select_us + r->fold_us) / 1e3, rec->compact_us / 1e3,
	         rec->note[0] ? ": " : "", rec->note);
}

static void on_round_done(struct loop_op *op, int res, bool more) {
	struct evictor *e = container_of(op, struct evictor, efd_op);
	struct round *r = e->running;
	uint64_t t0 = now_us(), freed = 0;
	struct evict_record *rec;

	(void)more;
	e->efd_armed = false;
	if (!r)
		return;
	if (res < 0 && res != -EINTR)
		log_warning("reading the round's eventfd failed: %s", strerror(-res));
	pthread_join(e->thread, NULL);
	e->running = NULL;
	if (r->gpu_fallbacks > 0 && e->gpu_fallbacks == 0)
		log_warning("round %llu: %u layer(s) meant for the GPU were scored on the CPU after a "
		            "device error (%s); status gpu_fallbacks counts every such layer",
		            (unsigned long long)r->id, r->gpu_fallbacks, strerror(-r->gpu_error));
	e->gpu_layers += r->gpu_layers;
	e->gpu_fallbacks += r->gpu_fallbacks;
	if (r->recall) {
		recall_done(e, r);
		round_free(r);
		pool_readers_end(e->srv->pool);
		evict_kick(e, ROUND_WATERMARK);
		return;
	}
	if (r->dry_run) {
		/* A plan: answered, and nothing else; no state of the daemon changes. */
		e->running_request = false;
		answer_plan(e, &e->running_waiter, r);
		round_free(r);
		pool_readers_end(e->srv->pool);
		evict_kick(e, ROUND_WATERMARK);
		return;
	}
	rec = record_round(e, r);
	if (r->error < 0)
		log_warning("eviction round %llu failed: %s", (unsigned long long)r->id, strerror(-r->error));
	else
		freed = apply_round(e, r, rec);
	rec->compact_us = now_us() - t0;
	rec->freed = freed;
	rec->duration_us = r->score_us + r->select_us + r->fold_us + rec->compact_us;
	e->last_round_us = rec->duration_us;
	metrics_observe_round(&e->srv->metrics, rec->duration_us, r->score_us,
	                      r->select_us + r->fold_us, rec->compact_us);
	if (r->error >= 0)
		log_round(r, rec);
	if (e->running_request) {
		e->running_request = false;
		answer_evict(e, &e->running_waiter, r, rec);
	}
	/* Nothing evictable: do not spin on pressure nothing can relieve. A round that evicted
	 * without emptying a chunk still made room inside the tenants' chunks (their grows
	 * take those blocks first), so the next round may follow at once. */
	e->idle_until_ms = r->selected_bytes == 0 && r->trigger != ROUND_EVICT ?
	                           now_ms() + EVICT_IDLE_MS : 0;
	round_free(r);
	pool_readers_end(e->srv->pool);
	/* Grows still short of memory wait on, for a plan waiting for an unpin or the next
	 * round, until their deadline. */
	retry_grants(e, false);
	evict_kick(e, ROUND_WATERMARK);
}

void evict_chunks_back(struct evictor *e) {
	if (e->n_grants > 0 && !e->running) {
		e->idle_until_ms = 0;
		retry_grants(e, false);
	}
}

int evict_plan(struct evictor *e, struct conn *c, uint64_t id, enum round_trigger trigger,
               struct tenant *only, uint64_t bytes, const struct evict_patch *patch,
               evict_done_fn done) {
	struct evict_waiter w = {
		.conn_id = c->id,
		.id = id,
		.done = done,
		.tenant_id = only ? only->id : 0,
		.bytes = bytes,
		.dry = true,
		.trigger = trigger,
	};

	if (patch)
		w.patch = *patch;
	if (e->n_waiters == EVICT_WAITERS_MAX)
		return -EBUSY;
	e->waiters[e->n_waiters++] = w;
	c->outstanding++;
	evict_kick(e, ROUND_EVICT);
	return 0;
}

int evict_request(struct evictor *e, struct conn *c, uint64_t id, struct tenant *t, uint64_t bytes,
                  evict_done_fn done) {
	if (e->n_waiters == EVICT_WAITERS_MAX)
		return -EBUSY;
	e->waiters[e->n_waiters++] = (struct evict_waiter){
		.conn_id = c->id,
		.id = id,
		.done = done,
		.tenant_id = t ? t->id : 0,
		.bytes = bytes,
	};
	evict_kick(e, ROUND_EVICT);
	return 0;
}

int evict_wait_grant(struct evictor *e, struct conn *c, const struct parked_grow *grow, bool at_cap,
                     evict_grow_fn retry, uint64_t need_bytes, uint64_t deadline_ms) {
	struct server *s = e->srv;
	struct grant_waiter *g;

	if (e->n_grants >= GRANT_WAITERS_MAX) {
		conn_refused(c, LIMIT_GRANT_WAITERS);
		return -EAGAIN;
	}
	if (s->stopping || !evictable_exists(s))
		return -EAGAIN;
	g = realloc(e->grants, (e->n_grants + 1) * sizeof(*g));
	if (!g)
		return -ENOMEM;
	e->grants = g;
	e->grants[e->n_grants++] = (struct grant_waiter){
		.conn_id = c->id,
		.grow = *grow,
		.retry = retry,
		.device = c->device,
		.at_cap = at_cap,
		.deadline_ms = deadline_ms,
		.need_bytes = need_bytes,
	};
	/* After a round that found nothing, even a new grow waits for the idle time: the
	 * same round would run again. */
	evict_kick(e, ROUND_GRANT);
	return 0;
}

/* Applies the plans of unpinned sequences (only an engine's event, not yet complete at the
 * unpin or the round's end, keeps one waiting: evict_apply_pending), where it completed.
 * Applying sends events, which may close connections and free their sequences: the
 * candidates are named first and found again one by one. */
static void retry_waiting_plans(struct evictor *e) {
	struct server *s = e->srv;
	_cleanup_(freep) uint64_t *ids = NULL;
	uint32_t n = 0, i = 0;

	/* Only a connection with events can have such a plan: the others cost no walk. */
	for (struct conn *c = s->conns; c; c = c->next)
		for (struct seq *q = c->n_events ? c->seqs : NULL; q && !c->closing; q = q->next)
			n += q->pending && q->pins == 0;
	if (n == 0)
		return;
	ids = malloc((size_t)n * 2 * sizeof(*ids));
	if (!ids)
		return;
	for (struct conn *c = s->conns; c; c = c->next)
		for (struct seq *q = c->n_events ? c->seqs : NULL; q && !c->closing; q = q->next)
			if (q->pending && q->pins == 0) {
				ids[2 * i] = q->conn_id;
				ids[2 * i + 1] = q->id;
				i++;
			}
	for (uint32_t j = 0; j < i; j++) {
		struct seq *q = registry_seq(s, ids[2 * j], ids[2 * j + 1]);

		if (q && q->pending && q->pins == 0)
			evict_apply_pending(e, q);
	}
}

/* Grows whose deadline passed get their refusal, on the tick, whatever runs; plans that
 * waited for an engine's event apply once it completed. */
void evict_tick(struct evictor *e) {
	uint32_t draining = e->srv->pool->chunks_draining;

	retry_waiting_plans(e);
	/* Holders that went away, or whose processes exited, gave chunks back. */
	if (draining < e->draining_seen)
		evict_chunks_back(e);
	e->draining_seen = draining;

	retry_grants(e, true);
	evict_kick(e, ROUND_WATERMARK);
}

int evictor_new(struct server *s, struct evictor **ret) {
	struct evictor *e = calloc(1, sizeof(*e));

	if (!e)
		return -ENOMEM;
	e->srv = s;
	e->efd = eventfd(0, EFD_CLOEXEC);
	if (e->efd < 0) {
		int k = negative_errno();

		free(e);
		return k;
	}
	e->efd_op.handler = on_round_done;
#if KVD_TEST_HOOKS
	e->gate = getenv("KVD_TEST_ROUND_GATE");
#endif
	/* Said once at start: the first round would only say it then. */
	if (!s->pool->ops->host_access) {
		char why[320];

		if (!round_gpu_driver_ok(why, sizeof(why)))
			log_warning("%s", why);
	}
	e->last_interval_ms = now_ms();
	*ret = e;
	return 0;
}

struct evictor *evictor_free(struct evictor *e) {
	if (!e)
		return NULL;
	if (e->running) {
		pthread_join(e->thread, NULL);
		/* A recall's round holds its sequence's kept tokens (gone with it by now). */
		if (e->running->recall)
			recall_store_free(e->srv->tier, e->running->seqs[0].kept);
		round_free(e->running);
		pool_readers_end(e->srv->pool);
	}
	for (uint32_t i = 0; i < EVICT_HISTORY; i++)
		free(e->history[i].tenants);
	for (uint32_t d = 0; d < BACKEND_DEVICES_MAX; d++)
		e->gpu[d] = round_gpu_free(e->gpu[d]);
	free(e->grants);
	safe_close(e->efd);
	free(e);
	return NULL;
}

bool evict_running(const struct evictor *e) {
	return e->running;
}

uint64_t evict_rounds_total(const struct evictor *e) {
	return e->rounds_total;
}

uint64_t evict_rounds_failed(const struct evictor *e) {
	return e->rounds_failed;
}

uint64_t evict_gpu_layers(const struct evictor *e) {
	return e->gpu_layers;
}

uint64_t evict_gpu_fallbacks(const struct evictor *e) {
	return e->gpu_fallbacks;
}

uint32_t evict_grants_waiting(const struct evictor *e) {
	return e->n_grants;
}

uint32_t evict_grants_queued(const struct evictor *e, uint32_t device) {
	uint32_t n = 0;

	for (uint32_t i = 0; i < e->n_grants; i++)
		n += !e->grants[i].at_cap && e->grants[i].device == device;
	return n;
}

uint64_t evict_last_round_us(const struct evictor *e) {
	return e->last_round_us;
}

uint32_t evict_records(const struct evictor *e) {
	return e->history_n;
}

const struct evict_record *evict_record_at(const struct evictor *e, uint32_t i) {
	return i < e->history_n ? &e->history[(e->history_head + i) % EVICT_HISTORY] : NULL;
}
