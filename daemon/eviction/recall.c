/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "common/layout.h"
#include "recall.h"
#include "round.h"
#include "tier.h"

/* One table's kept slots, by position. */
struct kept_table {
	uint32_t n, cap;
	uint32_t *pos;                /* ascending */
	uint32_t *rec;                /* each one's record */
};

struct recall_store {
	struct tier *tr;
	/* Its sequence's (q->kept), unless held: a recall round took it (recall_store_hold);
	 * its tenant, charged for its segments (tenant.tier_kept_bytes); the tier's list of
	 * stores, oldest first, which whole sequences moving out take room from
	 * (recall_yield). */
	struct seq *seq;
	struct tenant *tenant;
	bool held;
	struct recall_store *older, *newer;
	uint32_t n_tables;
	uint32_t heads;               /* kv heads a table covers: the per-layer layout's all */
	uint64_t row_bytes, index_bytes, rec_bytes;
	uint32_t per_seg;             /* records in a segment */
	struct kept_table *tables;
	uint32_t *segs, n_segs;
	uint32_t *free, n_free;       /* free records (room for n_segs * per_seg) */
	uint64_t kept;
	uint64_t meta;                /* bytes of the arrays, in the server's metadata count */
};

static uint8_t *rec_addr(const struct recall_store *st, uint32_t id) {
	return st->tr->base + (uint64_t)st->segs[id / st->per_seg] * st->tr->seg_bytes +
	       (uint64_t)(id % st->per_seg) * st->rec_bytes;
}

uint32_t recall_kept(const struct recall_store *st, uint32_t t) {
	return st && t < st->n_tables ? st->tables[t].n : 0;
}

const uint32_t *recall_positions(const struct recall_store *st, uint32_t t) {
	return st->tables[t].pos;
}

const uint8_t *recall_record(const struct recall_store *st, uint32_t t, uint32_t i) {
	return rec_addr(st, st->tables[t].rec[i]);
}

uint64_t recall_kept_total(const struct recall_store *st) {
	return st ? st->kept : 0;
}

static void meta_add(struct recall_store *st, int64_t bytes) {
	st->meta += (uint64_t)bytes;
	*st->tr->metadata_bytes += (uint64_t)bytes;
}

static struct recall_store *store_new(struct tier *tr, struct seq *q) {
	const struct kvd_seq_desc *d = q->desc;
	struct recall_store *st = calloc(1, sizeof(*st));

	if (!st)
		return NULL;
	st->tr = tr;
	st->seq = q;
	st->tenant = q->tenant;
	st->n_tables = d->n_tables;
	st->heads = d->layout == KVD_LAYOUT_PER_HEAD ? 1 : d->kv_heads;
	st->row_bytes = layout_row_bytes(d);
	st->index_bytes = layout_index_row_bytes(d);
	st->rec_bytes = 2 * st->heads * st->row_bytes + st->index_bytes;
	st->per_seg = (uint32_t)MIN(tr->seg_bytes / st->rec_bytes, (uint64_t)UINT32_MAX);
	st->tables = calloc(d->n_tables, sizeof(*st->tables));
	if (!st->tables) {
		free(st);
		return NULL;
	}
	meta_add(st, (int64_t)(sizeof(*st) + d->n_tables * sizeof(*st->tables)));
	st->older = tr->kept_newest;
	if (tr->kept_newest)
		tr->kept_newest->newer = st;
	else
		tr->kept_oldest = st;
	tr->kept_newest = st;
	return st;
}

struct recall_store *recall_store_free(struct tier *tr, struct recall_store *st) {
	if (!st)
		return NULL;
	if (st->older)
		st->older->newer = st->newer;
	else
		tr->kept_oldest = st->newer;
	if (st->newer)
		st->newer->older = st->older;
	else
		tr->kept_newest = st->older;
	st->tenant->tier_kept_bytes -= (uint64_t)st->n_segs * tr->seg_bytes;
	for (uint32_t i = 0; i < st->n_segs; i++)
		tr->free_segs[tr->n_free++] = st->segs[i];
	tr->used_bytes -= (uint64_t)st->n_segs * tr->seg_bytes;
	tr->kept_bytes -= (uint64_t)st->n_segs * tr->seg_bytes;
	tr->kept_tokens -= st->kept;
	*tr->metadata_bytes -= st->meta;
	for (uint32_t t = 0; t < st->n_tables; t++) {
		free(st->tables[t].pos);
		free(st->tables[t].rec);
	}
	free(st->tables);
	free(st->segs);
	free(st->free);
	free(st);
	return NULL;
}

/* Makes room for n more records: takes free segments of the tier, never more than it has
 * free. Returns 0, -ENOSPC (not enough: nothing taken), -ENOMEM. */
static int reserve(struct recall_store *st, uint64_t n) {
	struct tier *tr = st->tr;
	uint64_t segs;
	uint32_t *a, *f;

	if (n <= st->n_free)
		return 0;
	if (st->per_seg == 0)
		return -ENOSPC;
	segs = DIV_ROUND_UP(n - st->n_free, st->per_seg);
	if (segs > tr->n_free)
		return -ENOSPC;
	a = realloc(st->segs, (st->n_segs + segs) * sizeof(*a));
	if (!a)
		return -ENOMEM;
	st->segs = a;
	f = realloc(st->free, (st->n_segs + segs) * st->per_seg * sizeof(*f));
	if (!f)
		return -ENOMEM;
	st->free = f;
	meta_add(st, (int64_t)(segs * (sizeof(*a) + st->per_seg * sizeof(*f))));
	for (uint64_t i = 0; i < segs; i++) {
		uint32_t id0 = st->n_segs * st->per_seg;

		st->segs[st->n_segs++] = tr->free_segs[--tr->n_free];
		/* Lowest id on top: records fill a segment before the next. */
		for (uint32_t j = st->per_seg; j-- > 0;)
			st->free[st->n_free++] = id0 + j;
	}
	tr->used_bytes += segs * tr->seg_bytes;
	tr->kept_bytes += segs * tr->seg_bytes;
	st->tenant->tier_kept_bytes += segs * tr->seg_bytes;
	return 0;
}

/* Where part i of a slot lies (the K row of head i, for i below heads; the V row of head
 * i - heads, below 2 heads; the index key): at a block's row, or (row < 0) in a record. */
static uint64_t part_offset(const struct kvd_seq_desc *d, const struct recall_store *st, uint32_t i,
                            int64_t row) {
	if (row < 0)
		return i * st->row_bytes;
	if (i < st->heads)
		return layout_k_offset(d, i, (uint32_t)row);
	if (i < 2 * st->heads)
		return layout_v_offset(d, i - st->heads, (uint32_t)row);
	return layout_index_offset(d, (uint32_t)row);
}

/* Copies a slot's K and V rows and index key from src (a block image at src_row, or a
 * record: row -1) to dst (likewise). */
static void slot_copy(const struct kvd_seq_desc *d, const struct recall_store *st, uint8_t *dst,
                      int64_t dst_row, const uint8_t *src, int64_t src_row) {
	uint32_t parts = 2 * st->heads + (st->index_bytes ? 1 : 0);

	for (uint32_t i = 0; i < parts; i++)
		memcpy(dst + part_offset(d, st, i, dst_row), src + part_offset(d, st, i, src_row),
		       i < 2 * st->heads ? st->row_bytes : st->index_bytes);
}

/* Grows table kt to hold n slots. */
static int table_reserve(struct recall_store *st, struct kept_table *kt, uint32_t n) {
	uint32_t cap = MAX(n, kt->cap * 2), *p, *r;

	if (n <= kt->cap)
		return 0;
	p = realloc(kt->pos, cap * sizeof(*p));
	if (!p)
		return -ENOMEM;
	kt->pos = p;
	r = realloc(kt->rec, cap * sizeof(*r));
	if (!r)
		return -ENOMEM;
	kt->rec = r;
	meta_add(st, (int64_t)(cap - kt->cap) * 2 * (int64_t)sizeof(uint32_t));
	kt->cap = cap;
	return 0;
}

/* Merges n slots (positions pos ascending, records rec) into kt, which has room. */
static void table_merge(struct kept_table *kt, const uint32_t *pos, const uint32_t *rec, uint32_t n) {
	uint32_t i = kt->n, j = n, w = kt->n + n;

	/* From the end, so that no entry is overwritten before it moved. */
	while (j > 0) {
		if (i > 0 && kt->pos[i - 1] > pos[j - 1]) {
			i--;
			w--;
			kt->pos[w] = kt->pos[i];
			kt->rec[w] = kt->rec[i];
		} else {
			j--;
			w--;
			kt->pos[w] = pos[j];
			kt->rec[w] = rec[j];
		}
	}
	kt->n += n;
}

int64_t recall_keep(struct tier *tr, struct seq *q, struct pool *p, const struct compact_drop *drops,
                    uint32_t n) {
	const struct kvd_seq_desc *d = q->desc;
	struct recall_store *st = q->kept;
	_cleanup_(freep) uint8_t *img = NULL;
	_cleanup_(freep) uint32_t *pos = NULL, *rec = NULL;
	uint64_t total = 0, at = 0;
	int k = 0;

	for (uint32_t i = 0; i < n; i++)
		total += drops[i].n;
	if (total == 0)
		return 0;
	if (!st) {
		st = q->kept = store_new(tr, q);
		if (!st)
			return -ENOMEM;
	}
	for (uint32_t i = 0; i < n && k >= 0; i++)
		k = table_reserve(st, &st->tables[drops[i].table], st->tables[drops[i].table].n + drops[i].n);
	img = malloc(d->block_bytes);
	pos = malloc(total * sizeof(*pos));
	rec = malloc(total * sizeof(*rec));
	if (k < 0 || !img || !pos || !rec)
		return -ENOMEM;
	k = reserve(st, total);
	if (k == -ENOSPC) {
		tr->kept_lost += total;
		return 0;
	}
	if (k < 0)
		return k;
	for (uint32_t i = 0; i < n; i++) {
		const struct compact_drop *x = &drops[i];
		const struct kvd_block_ref *blocks = layout_blocks(d, x->table);
		const uint32_t *tpos = layout_positions(d, x->table);
		uint32_t bt = d->block_tokens, have = UINT32_MAX;

		for (uint32_t j = 0; j < x->n; j++) {
			uint32_t s = x->slots[j];

			/* A block read once for all its slots: on a device pool, one copy. */
			if (s / bt != have) {
				have = s / bt;
				k = p->ops->read(q->device, pool_block_addr(p, blocks[have]), img,
				                 d->block_bytes);
				if (k < 0)
					goto fail;
			}
			rec[at] = st->free[--st->n_free];
			pos[at] = tpos[s];
			slot_copy(d, st, rec_addr(st, rec[at]), -1, img, s % bt);
			at++;
		}
	}
	at = 0;
	for (uint32_t i = 0; i < n; i++) {
		table_merge(&st->tables[drops[i].table], pos + at, rec + at, drops[i].n);
		at += drops[i].n;
	}
	st->kept += total;
	tr->kept_tokens += total;
	return (int64_t)total;
fail:
	while (at > 0)
		st->free[st->n_free++] = rec[--at];
	return k;
}

static int trade_check(const struct kvd_seq_desc *d, const struct recall_store *st,
                       const struct recall_trade *x, uint32_t t) {
	uint32_t tokens = layout_tokens(d)[t];

	for (uint32_t j = 0; j < x->n; j++)
		if (x->drop[j] >= tokens || x->take[j] >= st->tables[t].n ||
		    (j > 0 && (x->drop[j] <= x->drop[j - 1] || x->take[j] <= x->take[j - 1])))
			return -EINVAL;
	return 0;
}

/*
 * One table's trade. From the first slot that changes to the table's end, its blocks are
 * read into img, the new order is written into out (the resident slots that stay and the
 * kept ones that come back, merged by position), and out goes back into the same blocks;
 * then the resident slots that left go to the records of those that came back, and the
 * kept list trades their entries. Whole blocks go each way: on a device pool, one copy per
 * block.
 */
static int table_trade(struct seq *q, struct pool *p, struct recall_store *st, uint32_t t,
                       const struct recall_trade *x, uint32_t *npos, float *nside, int *copy_error) {
	struct kvd_seq_desc *d = q->desc;
	struct kept_table *kt = &st->tables[t];
	uint32_t bt = d->block_tokens, tokens = desc_tokens(d)[t], n = x->n;
	uint32_t *pos = desc_positions(d, t);
	const struct kvd_block_ref *blocks = desc_blocks(d, t);
	float *side = q->smooth && q->smooth[t] && q->smooth_cap[t] >= tokens ? q->smooth[t] : NULL;
	uint32_t first, b0, nb = DIV_ROUND_UP(tokens, bt), r, jd = 0, k = 0, keep_n = 0;
	uint64_t bb = d->block_bytes;
	_cleanup_(freep) uint8_t *img = NULL, *out = NULL;
	_cleanup_(freep) uint32_t *tpos = NULL, *left_pos = NULL, *left_rec = NULL;

	first = MIN(x->drop[0], layout_slots_below(pos, tokens, kt->pos[x->take[0]]));
	b0 = first / bt;
	img = malloc((nb - b0) * bb);
	out = malloc((nb - b0) * bb);
	tpos = malloc(n * sizeof(*tpos));
	left_pos = malloc(n * sizeof(*left_pos));
	left_rec = malloc(n * sizeof(*left_rec));
	if (!img || !out || !tpos || !left_pos || !left_rec)
		return -ENOMEM;
	for (uint32_t j = 0; j < n; j++)
		tpos[j] = kt->pos[x->take[j]];
	for (uint32_t b = b0; b < nb; b++) {
		int e = p->ops->read(q->device, pool_block_addr(p, blocks[b]), img + (b - b0) * bb, bb);

		if (e < 0 && *copy_error == 0)
			*copy_error = e;
	}
	memcpy(out, img, (nb - b0) * bb);
	r = first;
	for (uint32_t w = first; w < tokens; w++) {
		uint8_t *dst = out + (w / bt - b0) * bb;

		while (jd < n && r == x->drop[jd]) {
			r++;
			jd++;
		}
		if (k < n && (r >= tokens || tpos[k] < pos[r])) {
			slot_copy(d, st, dst, w % bt, rec_addr(st, kt->rec[x->take[k]]), -1);
			npos[w - first] = tpos[k];
			nside[w - first] = x->take_s ? x->take_s[k] : ROUND_UNSCORED;
			k++;
		} else {
			slot_copy(d, st, dst, w % bt, img + (r / bt - b0) * bb, r % bt);
			npos[w - first] = pos[r];
			nside[w - first] = side ? side[r] : ROUND_UNSCORED;
			r++;
		}
	}
	/* The slots that left take the records of those that came back (read above). */
	for (uint32_t j = 0; j < n; j++) {
		uint32_t s = x->drop[j];

		left_rec[j] = kt->rec[x->take[j]];
		left_pos[j] = pos[s];
		slot_copy(d, st, rec_addr(st, left_rec[j]), -1, img + (s / bt - b0) * bb, s % bt);
	}
	for (uint32_t i = 0, j = 0; i < kt->n; i++) {
		if (j < n && x->take[j] == i) {
			j++;
			continue;
		}
		kt->pos[keep_n] = kt->pos[i];
		kt->rec[keep_n++] = kt->rec[i];
	}
	kt->n = keep_n;
	table_merge(kt, left_pos, left_rec, n);
	for (uint32_t b = b0; b < nb; b++) {
		int e = p->ops->write(q->device, pool_block_addr(p, blocks[b]), out + (b - b0) * bb, bb);

		if (e < 0 && *copy_error == 0)
			*copy_error = e;
	}
	memcpy(pos + first, npos, (tokens - first) * sizeof(*pos));
	if (side)
		memcpy(side + first, nside, (tokens - first) * sizeof(*side));
	return 0;
}

int recall_swap(struct seq *q, struct pool *p, struct recall_store *st,
                const struct recall_trade *trades, int *ret_copy_error) {
	struct kvd_seq_desc *d = q->desc;
	_cleanup_(freep) uint32_t *npos = NULL;
	_cleanup_(freep) float *nside = NULL;
	uint32_t most = 0;
	bool any = false;
	int k = 0;

	*ret_copy_error = 0;
	for (uint32_t t = 0; t < d->n_tables; t++) {
		if (trades[t].n == 0)
			continue;
		k = trade_check(d, st, &trades[t], t);
		if (k < 0)
			return k;
		most = MAX(most, desc_tokens(d)[t]);
		any = true;
	}
	if (!any)
		return 0;
	npos = malloc(most * sizeof(*npos));
	nside = malloc(most * sizeof(*nside));
	if (!npos || !nside)
		return -ENOMEM;
	desc_write_begin(d);
	for (uint32_t t = 0; t < d->n_tables && k >= 0; t++)
		if (trades[t].n > 0)
			k = table_trade(q, p, st, t, &trades[t], npos, nside, ret_copy_error);
	desc_write_end(d);
	q->epoch++;
	return k;
}

void recall_truncate(struct recall_store *st, uint32_t end) {
	for (uint32_t t = 0; st && t < st->n_tables; t++) {
		struct kept_table *kt = &st->tables[t];

		/* Ascending: what a truncate dropped is at the end. */
		while (kt->n > 0 && kt->pos[kt->n - 1] >= end) {
			st->free[st->n_free++] = kt->rec[--kt->n];
			st->kept--;
			st->tr->kept_tokens--;
		}
	}
}

void recall_store_hold(struct recall_store *st, bool held) {
	if (st)
		st->held = held;
}

bool recall_yield(struct tier *tr) {
	struct recall_store *st = tr->kept_oldest;

	while (st && st->held)
		st = st->newer;
	if (!st)
		return false;
	tr->kept_lost += st->kept;
	st->seq->kept = recall_store_free(tr, st);
	return true;
}
