/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "basic/time-util.h"
#include "config.h"
#include "tier.h"

/* One sequence moved out: its blocks' bytes, compensation blocks first, then each table's
 * blocks in table order, with a checksum each. */
struct tier_seq {
	struct seq *seq;
	struct tier_seq *older, *newer;
	uint64_t bytes;               /* of data */
	uint64_t meta_bytes;          /* this struct, tokens and sums */
	uint32_t n_moments;           /* compensation blocks */
	uint64_t n_blocks;            /* all blocks */
	uint32_t *tokens;             /* [n_tables]: each table's tokens when moved out */
	uint64_t *sums;               /* [n_blocks] */
	unsigned char *data;
};

const char *tier_mode_to_string(int v) {
	static const char *const names[_TIER_MODE_MAX] = {
		[TIER_DROP] = "drop",
		[TIER_HOST] = "host",
	};

	return v >= 0 && v < _TIER_MODE_MAX ? names[v] : NULL;
}

/*
 * A block's checksum: four lanes of a 64-bit Fletcher sum (a running sum, and the sum of
 * the running sums, which sees order) over little-endian 8-byte words, folded with the
 * length. Chosen over the digest's FNV (digest.h) because it keeps pace with a memcpy: its
 * adds do not wait on a multiply. Block sizes are multiples of 8 (rows of 2-byte elements
 * times even head dimensions, or 64-byte aligned compensation blocks); a tail is
 * zero-padded anyway.
 */
static uint64_t block_sum(const void *data, uint64_t n) {
	const unsigned char *p = data;
	uint64_t a[4] = { 0 }, b[4] = { 0 }, w, h = n;
	uint64_t i = 0;

	for (; i + 32 <= n; i += 32)
		for (int l = 0; l < 4; l++) {
			memcpy(&w, p + i + 8 * l, 8);
			a[l] += w;
			b[l] += a[l];
		}
	for (int l = 0; i < n; i += 8, l = (l + 1) % 4) {
		w = 0;
		memcpy(&w, p + i, MIN(8, n - i));
		a[l] += w;
		b[l] += a[l];
	}
	for (int l = 0; l < 4; l++) {
		h = (h ^ a[l]) * UINT64_C(0x100000001b3);
		h = (h ^ b[l]) * UINT64_C(0x100000001b3);
	}
	return h;
}

int tier_mode_from_string(const char *name) {
	for (int v = 0; v < _TIER_MODE_MAX; v++)
		if (strcmp(tier_mode_to_string(v), name) == 0)
			return v;
	return -EINVAL;
}

int tier_new(uint64_t budget, uint64_t *metadata_bytes, struct tier **ret) {
	struct tier *tr = calloc(1, sizeof(*tr));

	if (!tr)
		return -ENOMEM;
	tr->budget_bytes = budget;
	tr->metadata_bytes = metadata_bytes;
#if KVD_TEST_HOOKS
	tr->corrupt = getenv("KVD_TEST_TIER_CORRUPT") != NULL;
#endif
	*ret = tr;
	return 0;
}

struct tier *tier_free(struct tier *tr) {
	if (!tr)
		return NULL;
	while (tr->oldest)
		tier_forget(tr, tr->oldest->seq);
	free(tr);
	return NULL;
}

static uint64_t block_size(const struct tier_seq *e, const struct kvd_seq_desc *d, uint64_t i) {
	return i < e->n_moments ? d->moments_bytes : d->block_bytes;
}

uint64_t tier_recall_bytes(const struct seq *q) {
	const struct tier_seq *e = q->tiered;

	if (!e)
		return 0;
	return (uint64_t)e->n_moments * q->desc->moments_bytes +
	       (e->n_blocks - e->n_moments) * q->desc->block_bytes;
}

/* Takes e out of the tier and frees it; q->tiered becomes NULL. */
static void entry_drop(struct tier *tr, struct tier_seq *e) {
	struct seq *q = e->seq;

	if (e->older)
		e->older->newer = e->newer;
	else
		tr->oldest = e->newer;
	if (e->newer)
		e->newer->older = e->older;
	else
		tr->newest = e->older;
	tr->n_seqs--;
	tr->used_bytes -= e->bytes;
	tr->meta_bytes -= e->meta_bytes;
	*tr->metadata_bytes -= e->meta_bytes;
	q->tenant->tier_bytes -= e->bytes;
	q->tenant->tier_seqs--;
	q->tiered = NULL;
	free(e->data);
	free(e->sums);
	free(e->tokens);
	free(e);
}

/* q's entry goes, and with it its K/V: q is lost, and its engine hears so at its next pin. */
static void entry_lose(struct tier *tr, struct tier_seq *e) {
	struct seq *q = e->seq;

	for (uint32_t t = 0; t < q->desc->n_tables; t++)
		q->evicted_tokens += e->tokens[t];
	q->evicted_bytes += e->bytes;
	q->tenant->tier_lost++;
	q->recall = KVD_RECALL_LOST;
	entry_drop(tr, e);
}

void tier_lose(struct tier *tr, struct seq *q) {
	if (!q->tiered)
		return;
	tr->lost_no_memory++;
	entry_lose(tr, q->tiered);
}

void tier_forget(struct tier *tr, struct seq *q) {
	if (q->tiered)
		entry_drop(tr, q->tiered);
}

/* The block refs of q in the tier's order: compensation blocks, then each table's. */
static void collect_refs(const struct seq *q, struct kvd_block_ref *refs) {
	struct kvd_seq_desc *d = q->desc;
	uint64_t k = d->moments_blocks;

	memcpy(refs, desc_moments(d), k * sizeof(*refs));
	for (uint32_t t = 0; t < d->n_tables; t++) {
		uint32_t n = DIV_ROUND_UP(desc_tokens(d)[t], d->block_tokens);

		memcpy(refs + k, desc_blocks(d, t), n * sizeof(*refs));
		k += n;
	}
}

static struct tier_seq *entry_free(struct tier_seq *e) {
	if (e) {
		free(e->data);
		free(e->sums);
		free(e->tokens);
		free(e);
	}
	return NULL;
}

static void entry_freep(struct tier_seq **e) {
	entry_free(*e);
}

int tier_offload(struct tier *tr, struct seq *q, struct pool *p, uint64_t metadata_max,
                 struct seq_emptied *emptied) {
	struct kvd_seq_desc *d = q->desc;
	_cleanup_(entry_freep) struct tier_seq *e = NULL;
	_cleanup_(freep) struct kvd_block_ref *refs = NULL;
	uint64_t start = now_ns(), off = 0;
	int r;

	e = calloc(1, sizeof(*e));
	if (!e)
		return -ENOMEM;
	e->seq = q;
	e->n_moments = d->moments_blocks;
	e->n_blocks = e->n_moments;
	for (uint32_t t = 0; t < d->n_tables; t++)
		e->n_blocks += DIV_ROUND_UP(desc_tokens(d)[t], d->block_tokens);
	if (e->n_blocks == e->n_moments)
		return -ENODATA;
	e->bytes = (uint64_t)e->n_moments * d->moments_bytes +
	           (e->n_blocks - e->n_moments) * d->block_bytes;
	if (e->bytes > tr->budget_bytes)
		return -EFBIG;
	e->meta_bytes = sizeof(*e) + 4ull * d->n_tables + 8 * e->n_blocks;
	if (*tr->metadata_bytes + e->meta_bytes > metadata_max)
		return -ENOMEM;
	e->tokens = malloc(4ull * d->n_tables);
	e->sums = malloc(8 * e->n_blocks);
	refs = malloc(e->n_blocks * sizeof(*refs));
	e->data = malloc(e->bytes);
	if (!e->tokens || !e->sums || !refs || !e->data)
		return -ENOMEM;
	collect_refs(q, refs);
	for (uint64_t i = 0; i < e->n_blocks; i++) {
		uint64_t n = block_size(e, d, i);

		r = p->ops->read(q->device, pool_block_addr(p, refs[i]), e->data + off, n);
		if (r < 0)
			return r;
		/* Right after the copy, while the block is still in cache. */
		e->sums[i] = block_sum(e->data + off, n);
		off += n;
	}
	if (tr->corrupt)
		e->data[e->bytes - 1] ^= 1;

	/* Room, oldest first: those lost are told at their next pin. */
	while (tr->used_bytes + e->bytes > tr->budget_bytes) {
		tr->lost_full++;
		entry_lose(tr, tr->oldest);
	}

	desc_write_begin(d);
	for (uint32_t t = 0; t < d->n_tables; t++) {
		e->tokens[t] = desc_tokens(d)[t];
		desc_tokens(d)[t] = 0;
	}
	d->moments_blocks = 0;
	desc_write_end(d);
	seq_blocks_free(p, refs, e->n_blocks, emptied);
	q->epoch++;

	e->older = tr->newest;
	if (tr->newest)
		tr->newest->newer = e;
	else
		tr->oldest = e;
	tr->newest = e;
	tr->n_seqs++;
	tr->used_bytes += e->bytes;
	tr->meta_bytes += e->meta_bytes;
	*tr->metadata_bytes += e->meta_bytes;
	q->tenant->tier_bytes += e->bytes;
	q->tenant->tier_seqs++;
	tr->offloads++;
	tr->offload_bytes += e->bytes;
	tr->offload_ns += now_ns() - start;
	q->tiered = TAKE_PTR(e);
	return 0;
}

int tier_recall(struct tier *tr, struct seq *q, struct pool *p, uint64_t conn_id,
                struct seq_granted *g, struct seq_emptied *emptied) {
	struct tier_seq *e = q->tiered;
	struct kvd_seq_desc *d = q->desc;
	_cleanup_(freep) struct kvd_block_ref *refs = NULL;
	uint64_t start = now_ns(), off = 0, k;
	int r;

	if (!e)
		return 0;
	refs = malloc(e->n_blocks * sizeof(*refs));
	if (!refs)
		return -ENOMEM;
	r = seq_alloc_blocks(q, p, conn_id, e->n_moments, e->n_blocks, refs, g, emptied);
	if (r < 0)
		return r;
	for (uint64_t i = 0; i < e->n_blocks; i++) {
		uint64_t n = block_size(e, d, i);

		/* Before it goes back, while it is read anyway: the write then finds it in
		 * cache. */
		r = block_sum(e->data + off, n) == e->sums[i] ? 0 : -EBADMSG;
		if (r == 0)
			r = p->ops->write(q->device, pool_block_addr(p, refs[i]), e->data + off, n);
		if (r < 0) {
			seq_alloc_undo(p, conn_id, refs, e->n_blocks, g, emptied);
			tr->lost_corrupt++;
			entry_lose(tr, e);
			return r;
		}
		off += n;
	}

	desc_write_begin(d);
	memcpy(desc_moments(d), refs, e->n_moments * sizeof(*refs));
	d->moments_blocks = e->n_moments;
	k = e->n_moments;
	for (uint32_t t = 0; t < d->n_tables; t++) {
		uint32_t n = DIV_ROUND_UP(e->tokens[t], d->block_tokens);

		memcpy(desc_blocks(d, t), refs + k, n * sizeof(*refs));
		desc_tokens(d)[t] = e->tokens[t];
		k += n;
	}
	desc_write_end(d);
	q->epoch++;
	q->recall = KVD_RECALL_HOST;
	tr->recalls++;
	tr->recall_bytes += e->bytes;
	entry_drop(tr, e);
	tr->recall_ns += now_ns() - start;
	return 0;
}
