/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "basic/macro.h"
#include "basic/size.h"
#include "basic/time-util.h"
#include "common/layout.h"
#include "config.h"
#include "tier-file.h"
#include "tier.h"

/*
 * One sequence moved out: its blocks' bytes, compensation blocks first, then each table's
 * blocks in table order, with a checksum each, packed into segments of the tier (at 64-byte
 * aligned offsets; a block never spans two segments, and every block fits in one, since
 * segments are the pool's chunk size).
 */
struct tier_seq {
	struct seq *seq;
	struct tier_seq *older, *newer;
	uint64_t bytes;               /* of data */
	uint64_t meta_bytes;          /* this struct, tokens, sums, macs and segs */
	uint32_t n_moments;           /* compensation blocks */
	uint64_t n_blocks;            /* all blocks */
	uint32_t *tokens;             /* [n_tables]: each table's tokens when moved out */
	uint64_t *sums;               /* [n_blocks] */
	uint64_t *macs;               /* [n_segs]: in_file, each file segment's MAC (mac.h) */
	uint32_t n_segs;
	uint32_t *segs;               /* [n_segs]: the segments, in order, of the host tier's
	                               * or, in_file, of the file's */
	bool in_file;
	bool busy;                    /* a recall or a demotion reads it: not to be dropped */
	bool returning;               /* a recall reads it */
};

/* Where the next block of an entry goes: segment index k of its list, at offset off. */
struct cursor {
	uint32_t k;
	uint64_t off;
};

const char *tier_mode_to_string(int v) {
	static const char *const names[_TIER_MODE_MAX] = {
		[TIER_DROP] = "drop",
		[TIER_HOST] = "host",
		[TIER_HOST_FILE] = "host+file",
	};

	return v >= 0 && v < _TIER_MODE_MAX ? names[v] : NULL;
}

/*
 * A block's checksum: a 64-bit Fletcher sum (a running sum of little-endian 8-byte words,
 * and the sum of the running sums, which sees their order) in four lanes, a lane per word
 * of each 32 bytes, folded with the length; a tail shorter than 32 bytes is zero-padded.
 * Chosen over the digest's FNV (digest.h) because it keeps pace with a memcpy: its adds
 * wait on no multiply, and the four lanes are one vector. Taken while copying (dst not
 * NULL: the n bytes of src go there too), so that the bytes are read once: with AVX2 where
 * the CPU has it, SSE2 otherwise (the same sum).
 */
typedef uint64_t u64x4 __attribute__((vector_size(32)));

__attribute__((target_clones("avx2", "default")))
static uint64_t copy_sum(void *dst, const void *src, uint64_t n) {
	const unsigned char *p = src;
	unsigned char *q = dst;
	u64x4 a = { 0 }, b = { 0 }, w;
	uint64_t h = n, i = 0;

	for (; i + 32 <= n; i += 32) {
		memcpy(&w, p + i, 32);
		if (q)
			memcpy(q + i, &w, 32);
		a += w;
		b += a;
	}
	if (i < n) {
		unsigned char tail[32] = { 0 };

		memcpy(tail, p + i, n - i);
		if (q)
			memcpy(q + i, tail, n - i);
		memcpy(&w, tail, 32);
		a += w;
		b += a;
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

int tier_new(uint64_t budget, uint64_t segment_bytes, uint64_t *metadata_bytes,
             struct tier **ret) {
	struct tier *tr = calloc(1, sizeof(*tr));
	uint64_t n = segment_bytes ? budget / segment_bytes : 0;

	if (!tr)
		return -ENOMEM;
	if (n > UINT32_MAX) {
		free(tr);
		return -EINVAL;
	}
	tr->n_segs = (uint32_t)n;
	tr->seg_bytes = segment_bytes;
	tr->budget_bytes = n * segment_bytes;
	tr->metadata_bytes = metadata_bytes;
	if (n > 0) {
		/* Touched now, all of it, so that moving a sequence out never waits for the
		 * kernel to find and zero pages. */
		tr->base = mmap(NULL, tr->budget_bytes, PROT_READ | PROT_WRITE,
		                MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
		tr->free_segs = malloc(n * sizeof(*tr->free_segs));
		if (tr->base == MAP_FAILED || !tr->free_segs) {
			int r = tr->base == MAP_FAILED ? -errno : -ENOMEM;

			if (tr->base != MAP_FAILED)
				munmap(tr->base, tr->budget_bytes);
			free(tr->free_segs);
			free(tr);
			return r;
		}
		for (uint32_t i = 0; i < n; i++)
			tr->free_segs[i] = (uint32_t)(n - 1 - i);
		tr->n_free = (uint32_t)n;
	}
#if KVD_TEST_HOOKS
	tr->corrupt = getenv("KVD_TEST_TIER_CORRUPT") != NULL;
#endif
	*ret = tr;
	return 0;
}

int tier_file_add(struct tier *tr, const char *dir, uint64_t bytes, const char **ret_what) {
	uint64_t n = tr->seg_bytes ? bytes / tr->seg_bytes : 0;

	int r;

	*ret_what = "its size";
	if (n == 0 || n > UINT32_MAX)
		return -EINVAL;
	*ret_what = "a key for its MACs";
	r = mac_key_new(&tr->file_key);
	if (r < 0)
		return r;
	return tier_file_open(dir, (uint32_t)n, tr->seg_bytes, &tr->file, ret_what);
}

struct tier *tier_free(struct tier *tr) {
	if (!tr)
		return NULL;
	while (tr->oldest)
		tier_forget(tr, tr->oldest->seq);
	if (tr->base)
		munmap(tr->base, tr->budget_bytes);
	tr->file = tier_file_close(tr->file);
	free(tr->free_segs);
	free(tr);
	return NULL;
}

static uint64_t block_size(const struct tier_seq *e, const struct kvd_seq_desc *d, uint64_t i) {
	return i < e->n_moments ? d->moments_bytes : d->block_bytes;
}

/* Moves c past the next block of n bytes of an entry (a block never spans two segments);
 * returns the block's offset in segment c->k. */
static uint64_t advance(const struct tier *tr, struct cursor *c, uint64_t n) {
	uint64_t off;

	if (c->off + n > tr->seg_bytes) {
		c->k++;
		c->off = 0;
	}
	off = c->off;
	c->off += ALIGN_TO(n, 64);
	return off;
}

/* Segments e's blocks take. */
static uint32_t segments_needed(const struct tier *tr, const struct tier_seq *e,
                                const struct kvd_seq_desc *d) {
	struct cursor c = { 0, 0 };

	for (uint64_t i = 0; i < e->n_blocks; i++)
		(void)advance(tr, &c, block_size(e, d, i));
	return c.k + 1;
}

/* An entry out of the tier, or never in it: its segments go back, where they are. */
static struct tier_seq *entry_free(struct tier *tr, struct tier_seq *e) {
	if (e) {
		for (uint32_t i = 0; i < e->n_segs; i++)
			if (e->in_file)
				tr->file->free_segs[tr->file->n_free++] = e->segs[i];
			else
				tr->free_segs[tr->n_free++] = e->segs[i];
		free(e->segs);
		free(e->macs);
		free(e->sums);
		free(e->tokens);
		free(e);
	}
	return NULL;
}

/* Counts e (sign 1) or stops counting it (-1) where it is. */
static void account(struct tier *tr, const struct tier_seq *e, int64_t sign) {
	struct tenant *t = e->seq->tenant;
	uint64_t bytes = (uint64_t)e->n_segs * tr->seg_bytes;

	if (e->in_file) {
		tr->file_used_bytes += (uint64_t)sign * bytes;
		tr->file_seqs += (uint32_t)sign;
		t->tier_file_bytes += (uint64_t)sign * bytes;
	} else {
		tr->used_bytes += (uint64_t)sign * bytes;
		tr->n_seqs += (uint32_t)sign;
		t->tier_bytes += (uint64_t)sign * bytes;
	}
	t->tier_seqs += (uint32_t)sign;
}

/* Takes e out of the tier's list and counts, keeping its segments; q->tiered becomes NULL. */
static void entry_unlink(struct tier *tr, struct tier_seq *e) {
	struct seq *q = e->seq;

	if (e->older)
		e->older->newer = e->newer;
	else
		tr->oldest = e->newer;
	if (e->newer)
		e->newer->older = e->older;
	else
		tr->newest = e->older;
	e->older = e->newer = NULL;
	account(tr, e, -1);
	*tr->metadata_bytes -= e->meta_bytes;
	q->tiered = NULL;
}

static void entry_drop(struct tier *tr, struct tier_seq *e) {
	entry_unlink(tr, e);
	entry_free(tr, e);
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

const char *tier_place(const struct seq *q) {
	if (!q->tiered)
		return q->move ? "leaving" : "pool";
	if (q->tiered->returning)
		return "returning";
	return q->tiered->in_file ? "file" : "host";
}

uint32_t tier_seq_tokens(const struct seq *q) {
	return q->tiered ? q->tiered->tokens[0] : layout_tokens(q->desc)[0];
}

void tier_forget(struct tier *tr, struct seq *q) {
	if (q->tiered)
		entry_drop(tr, q->tiered);
}

struct tier_seq *tier_detach(struct tier *tr, struct seq *q) {
	struct tier_seq *e = q->tiered;

	if (e) {
		entry_unlink(tr, e);
		e->seq = NULL;
	}
	return e;
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

/* A move between the pool and the tier (tier.h): what the loop set up, what the worker
 * copies, and what the loop needs to finish it. */
struct tier_move {
	enum tier_move_kind kind;
	struct tier_seq *e;           /* out: not yet in the tier; in, demote: the entry */
	uint64_t generation, pins;    /* out: q's, when it began */
	const struct backend_ops *ops;
	uint32_t device;
	/* out, in: e's blocks. */
	struct kvd_block_ref *refs;   /* [e->n_blocks]: the pool's blocks */
	void **pool;                  /* [e->n_blocks]: their addresses in the daemon */
	uint32_t *seg;                /* [e->n_blocks]: the index in e->segs of the segment... */
	uint64_t *off;                /* [e->n_blocks]: ...and the offset in it of each block */
	uint64_t *len;                /* [e->n_blocks] */
	unsigned char *host;          /* the host tier's mapping */
	uint64_t seg_bytes;
	/* demote: the host segments e leaves, written to e->segs (the file's) in order. */
	unsigned char **src;
	const struct mac_key *key;    /* demote, in from the file: of e->macs */
	struct tenant *tenant;        /* out: q's, charged tier_moving until the end */
	bool corrupt;                 /* KVD_TEST_TIER_CORRUPT */
	int error;                    /* the worker's */
	uint64_t ns;                  /* the worker's time */
	uint64_t io_ns;               /* of which waiting for the file's reads */
};

static struct tier_move *move_free(struct tier_move *mv) {
	if (mv) {
		free(mv->refs);
		free(mv->pool);
		free(mv->seg);
		free(mv->off);
		free(mv->len);
		free(mv->src);
		free(mv);
	}
	return NULL;
}

/* A move of e's blocks: refs and their places in e's segments filled, the pool's
 * addresses left to the caller (out: q's blocks; in: new ones). */
static int move_new(struct tier *tr, struct tier_seq *e, const struct kvd_seq_desc *d,
                    struct pool *p, uint32_t device, enum tier_move_kind kind,
                    struct tier_move **ret) {
	struct tier_move *mv = calloc(1, sizeof(*mv));
	struct cursor c = { 0, 0 };

	if (!mv)
		return -ENOMEM;
	mv->kind = kind;
	mv->e = e;
	mv->ops = p->ops;
	mv->device = device;
	mv->host = tr->base;
	mv->seg_bytes = tr->seg_bytes;
	mv->key = &tr->file_key;
	mv->corrupt = tr->corrupt;
	mv->refs = malloc(e->n_blocks * sizeof(*mv->refs));
	mv->pool = malloc(e->n_blocks * sizeof(*mv->pool));
	mv->seg = malloc(e->n_blocks * sizeof(*mv->seg));
	mv->off = malloc(e->n_blocks * sizeof(*mv->off));
	mv->len = malloc(e->n_blocks * sizeof(*mv->len));
	if (!mv->refs || !mv->pool || !mv->seg || !mv->off || !mv->len) {
		move_free(mv);
		return -ENOMEM;
	}
	for (uint64_t i = 0; i < e->n_blocks; i++) {
		mv->len[i] = block_size(e, d, i);
		mv->off[i] = advance(tr, &c, mv->len[i]);
		mv->seg[i] = c.k;
	}
	*ret = mv;
	return 0;
}

/* ---- shares (tier_offload_begin) ---- */

/* What t holds of a tier, its moves out in flight included (their segments are taken). */
static uint64_t usage(const struct tenant *t, bool in_file) {
	return in_file ? t->tier_file_bytes : t->tier_bytes + t->tier_moving + t->tier_kept_bytes;
}

static uint64_t capacity(const struct tier *tr, bool in_file) {
	return in_file ? (uint64_t)tr->file->n_segs * tr->seg_bytes : tr->budget_bytes;
}

/* A tenant's share of a tier: an equal part among the tenants holding entries there, the
 * one that wants room (wants) counted. */
static uint64_t share(struct tier *tr, bool in_file, struct tenant *wants) {
	uint32_t n = 1;

	tr->mark++;
	wants->tier_mark = tr->mark;
	for (struct tier_seq *e = tr->oldest; e; e = e->newer) {
		struct tenant *t = e->seq->tenant;

		if (e->in_file == in_file && t->tier_mark != tr->mark) {
			t->tier_mark = tr->mark;
			n++;
		}
	}
	return capacity(tr, in_file) / n;
}

/* Whether where in_file says has the free segments for need more bytes of wants, within
 * its cap (max_pct percent of it). */
static bool fits(const struct tier *tr, bool in_file, const struct tenant *wants, uint64_t need,
                 uint32_t max_pct) {
	uint64_t free_bytes = (uint64_t)(in_file ? tr->file->n_free : tr->n_free) * tr->seg_bytes;

	return free_bytes >= need &&
	       usage(wants, in_file) + need <= size_percent(capacity(tr, in_file), max_pct);
}

/*
 * The entry that makes room where in_file says for need more bytes of wants (never one a
 * move reads), or NULL when none may: past wants' cap (max_pct), its own oldest; else the
 * oldest of a tenant over its share; else, when wants would pass its own share, its own
 * oldest; else the oldest.
 */
static struct tier_seq *victim(struct tier *tr, bool in_file, struct tenant *wants, uint64_t need,
                               uint32_t max_pct) {
	uint64_t cap = size_percent(capacity(tr, in_file), max_pct), fair = share(tr, in_file, wants);
	struct tier_seq *own = NULL, *any = NULL;

	for (struct tier_seq *e = tr->oldest; e; e = e->newer) {
		if (e->busy || e->in_file != in_file)
			continue;
		if (usage(e->seq->tenant, in_file) > fair && usage(wants, in_file) + need <= cap)
			return e;
		if (!own && e->seq->tenant == wants)
			own = e;
		if (!any)
			any = e;
	}
	return usage(wants, in_file) + need > MIN(fair, cap) ? own : any;
}

/* Whether e may go to the file rather than be lost: its tenant's tier says so, the file
 * tier did not fail it, and the file has room, or can be given it by dropping its oldest
 * entries (not from under a move). */
static bool demotable(struct tier *tr, const struct tier_seq *e) {
	const struct tenant *t = e->seq->tenant;
	uint32_t room;

	if (!tr->file || t->tier != TIER_HOST_FILE || t->tier_degraded || e->n_segs > tr->file->n_segs)
		return false;
	room = tr->file->n_free;
	for (const struct tier_seq *o = tr->oldest; o && room < e->n_segs; o = o->newer)
		if (o->in_file && !o->busy)
			room += o->n_segs;
	return room >= e->n_segs;
}

/* Sets up writing host entry e to the file: its file segments are taken (the file's oldest
 * entries lost for room), its host segments go back at once (the worker writes them out
 * before any move queued after this one fills them), and it counts in the file. */
static int demote_begin(struct tier *tr, struct tier_seq *e, uint32_t max_pct,
                        struct tier_move **ret) {
	struct tenant *t = e->seq->tenant;
	uint64_t bytes = (uint64_t)e->n_segs * tr->seg_bytes;
	struct tier_move *mv;

	/* Room in the file, by shares (victim()). */
	while (!fits(tr, true, t, bytes, max_pct)) {
		struct tier_seq *old = victim(tr, true, t, bytes, max_pct);

		if (!old)
			return -ENOSPC;
		tr->lost_full++;
		entry_lose(tr, old);
	}
	mv = calloc(1, sizeof(*mv));
	if (!mv)
		return -ENOMEM;
	mv->src = malloc(e->n_segs * sizeof(*mv->src));
	if (!mv->src) {
		free(mv);
		return -ENOMEM;
	}
	mv->kind = TIER_MOVE_DEMOTE;
	mv->e = e;
	mv->seg_bytes = tr->seg_bytes;
	mv->key = &tr->file_key;
	account(tr, e, -1);
	for (uint32_t i = 0; i < e->n_segs; i++) {
		mv->src[i] = tr->base + (uint64_t)e->segs[i] * tr->seg_bytes;
		tr->free_segs[tr->n_free++] = e->segs[i];
		e->segs[i] = tr->file->free_segs[--tr->file->n_free];
	}
	e->in_file = true;
	e->busy = true;
	account(tr, e, 1);
	*ret = mv;
	return 0;
}

int tier_offload_begin(struct tier *tr, struct seq *q, struct pool *p, uint64_t metadata_max,
                       uint32_t max_pct, struct tier_move **ret, struct tier_move ***ret_demotes,
                       uint32_t *ret_n_demotes) {
	struct kvd_seq_desc *d = q->desc;
	_cleanup_(freep) struct tier_move **demotes = NULL;
	uint32_t need, n_demotes = 0;
	struct tier_move *mv;
	struct tier_seq *e;
	int r;

	*ret_demotes = NULL;
	*ret_n_demotes = 0;
	e = calloc(1, sizeof(*e));
	if (!e)
		return -ENOMEM;
	e->seq = q;
	e->n_moments = d->moments_blocks;
	e->n_blocks = e->n_moments;
	for (uint32_t t = 0; t < d->n_tables; t++)
		e->n_blocks += DIV_ROUND_UP(desc_tokens(d)[t], d->block_tokens);
	r = e->n_blocks == e->n_moments ? -ENODATA : 0;
	need = r == 0 ? segments_needed(tr, e, d) : 0;
	if (r == 0 && need > tr->n_segs)
		r = -EFBIG;
	e->meta_bytes = sizeof(*e) + 4ull * d->n_tables + 8 * e->n_blocks + 12ull * need;
	if (r == 0 && *tr->metadata_bytes + e->meta_bytes > metadata_max)
		r = -ENOMEM;
	if (r == 0) {
		e->tokens = malloc(4ull * d->n_tables);
		e->sums = malloc(8 * e->n_blocks);
		e->segs = malloc(4ull * need);
		e->macs = tr->file ? malloc(8ull * need) : NULL;
		/* Each entry that makes room frees at least a segment. */
		demotes = malloc(need * sizeof(*demotes));
		if (!e->tokens || !e->sums || !e->segs || (tr->file && !e->macs) || !demotes)
			r = -ENOMEM;
	}
	if (r < 0) {
		entry_free(tr, e);
		return r;
	}
	/* Room in the host tier, by shares (victim()), never from under a move: to the file
	 * where the tenant's tier says so, else lost (told at the next pin). The segments are
	 * taken now, so that moves running at once never share one. */
	while (!fits(tr, false, q->tenant, need * tr->seg_bytes, max_pct)) {
		struct tier_seq *old;

		/* Kept tokens go first. */
		if (tr->n_free < need && tr->yield && tr->yield(tr))
			continue;
		old = victim(tr, false, q->tenant, need * tr->seg_bytes, max_pct);

		if (!old) {
			entry_free(tr, e);
			*ret_demotes = TAKE_PTR(demotes);
			*ret_n_demotes = n_demotes;
			return -ENOSPC;
		}
		if (demotable(tr, old) && demote_begin(tr, old, max_pct, &demotes[n_demotes]) == 0) {
			n_demotes++;
			continue;
		}
		tr->lost_full++;
		entry_lose(tr, old);
	}
	for (uint32_t i = 0; i < need; i++)
		e->segs[e->n_segs++] = tr->free_segs[--tr->n_free];
	*ret_demotes = TAKE_PTR(demotes);
	*ret_n_demotes = n_demotes;
	r = move_new(tr, e, d, p, q->device, TIER_MOVE_OUT, &mv);
	if (r < 0) {
		entry_free(tr, e);
		return r;
	}
	/* Counted in its tenant's share until it lands (or not). */
	mv->tenant = q->tenant;
	mv->tenant->tier_moving += (uint64_t)need * tr->seg_bytes;
	collect_refs(q, mv->refs);
	for (uint64_t i = 0; i < e->n_blocks; i++) {
		mv->pool[i] = pool_block_addr(p, mv->refs[i]);
		e->bytes += mv->len[i];
	}
	for (uint32_t t = 0; t < d->n_tables; t++)
		e->tokens[t] = desc_tokens(d)[t];
	mv->generation = d->generation;
	mv->pins = q->pin_serial;
	*ret = mv;
	return 0;
}

/* Block i of a move from or to the host tier. */
static unsigned char *host_block(const struct tier_move *mv, uint64_t i) {
	return mv->host + (uint64_t)mv->e->segs[mv->seg[i]] * mv->seg_bytes + mv->off[i];
}

/* Puts back block i from src (in the host tier, or a staging segment), checking its sum. A
 * block that fails it is written into a new block of its own tenant, never entered in a
 * table, and freed: not served. */
static int restore_block(struct tier_move *mv, uint64_t i, const unsigned char *src) {
	uint64_t n = mv->len[i];

	if (mv->ops->host_access)
		return copy_sum(mv->pool[i], src, n) == mv->e->sums[i] ? 0 : -EBADMSG;
	if (copy_sum(NULL, src, n) != mv->e->sums[i])
		return -EBADMSG;
	return mv->ops->write(mv->device, mv->pool[i], src, n);
}

/* A recall from the file: batches of segments into the two halves of the staging in turn,
 * each batch's blocks put back from there while the next batch is read. mv->io_ns is the
 * time spent waiting for the file. */
static int recall_from_file(struct tier_move *mv, struct tier_io *io) {
	const uint32_t half = TIER_IO_DEPTH / 2;
	struct tier_seq *e = mv->e;
	unsigned char *buf[2][TIER_IO_DEPTH / 2];
	uint32_t k0 = 0, n = MIN(e->n_segs, half), checked = UINT32_MAX;
	uint64_t i = 0, t0 = now_ns();
	unsigned cur = 0;
	int r;

	r = tier_io_read_start(io, e->segs, n, cur, buf[cur]);
	mv->io_ns += now_ns() - t0;
	while (r == 0 && n > 0) {
		uint32_t next = k0 + n, nn = MIN(e->n_segs - next, half);

		t0 = now_ns();
		r = tier_io_finish(io);
		if (r == 0 && nn > 0)
			r = tier_io_read_start(io, e->segs + next, nn, cur ^ 1, buf[cur ^ 1]);
		mv->io_ns += now_ns() - t0;
		for (; r == 0 && i < e->n_blocks && mv->seg[i] < next; i++) {
			const unsigned char *seg = buf[cur][mv->seg[i] - k0];

			/* Whoever may write the file could have rewritten what was read: a
			 * segment that fails its MAC is never served (the sums, unkeyed, could
			 * be forged). Checked before its first block, while it is in cache. */
			if (mv->seg[i] != checked) {
				checked = mv->seg[i];
				if (mac_sum(mv->key, seg, mv->seg_bytes) != e->macs[checked]) {
					r = -EBADMSG;
					break;
				}
			}
			r = restore_block(mv, i, seg + mv->off[i]);
		}
		k0 = next;
		n = nn;
		cur ^= 1;
	}
	/* Nothing may still be landing in the staging when the next move uses it. */
	(void)tier_io_finish(io);
	return r;
}

/* A demotion: batches of segments written to the file, each batch's MACs taken while it is
 * written (the host segments stay as they are until the move ends). */
static int demote_to_file(struct tier_move *mv, struct tier_io *io) {
	struct tier_seq *e = mv->e;
	int r = 0;

	for (uint32_t k0 = 0; r == 0 && k0 < e->n_segs; k0 += TIER_IO_DEPTH) {
		uint32_t n = MIN(e->n_segs - k0, TIER_IO_DEPTH);
		int k;

		r = tier_io_write_start(io, mv->src + k0, e->segs + k0, n);
		for (uint32_t j = 0; j < n; j++)
			e->macs[k0 + j] = mac_sum(mv->key, mv->src[k0 + j], mv->seg_bytes);
		k = tier_io_finish(io);
		if (r == 0)
			r = k;
	}
	return r;
}

void tier_move_run(struct tier_move *mv, struct tier_io *io) {
	struct tier_seq *e = mv->e;
	uint64_t start = now_ns();

	switch (mv->kind) {
	case TIER_MOVE_OUT:
		for (uint64_t i = 0; i < e->n_blocks && mv->error == 0; i++) {
			unsigned char *dst = host_block(mv, i);
			uint64_t n = mv->len[i];

			/* Device memory comes through the backend, and is summed in the tier. */
			if (mv->ops->host_access) {
				e->sums[i] = copy_sum(dst, mv->pool[i], n);
			} else {
				mv->error = mv->ops->read(mv->device, mv->pool[i], dst, n);
				e->sums[i] = copy_sum(NULL, dst, n);
			}
			if (mv->corrupt && i == e->n_blocks - 1)
				dst[n - 1] ^= 1;
		}
		break;
	case TIER_MOVE_IN:
		if (e->in_file) {
			mv->error = io ? recall_from_file(mv, io) : -EIO;
			break;
		}
		for (uint64_t i = 0; i < e->n_blocks && mv->error == 0; i++)
			mv->error = restore_block(mv, i, host_block(mv, i));
		break;
	case TIER_MOVE_DEMOTE:
		mv->error = io ? demote_to_file(mv, io) : -EIO;
		break;
	}
	mv->ns = now_ns() - start;
}

struct seq *tier_move_seq(const struct tier_move *mv) {
	return mv->e->seq;
}

void tier_move_fail(struct tier_move *mv, int error) {
	mv->error = error;
}

uint64_t tier_move_bytes(const struct tier_move *mv) {
	return mv->kind == TIER_MOVE_DEMOTE ? (uint64_t)mv->e->n_segs * mv->seg_bytes : mv->e->bytes;
}

int tier_offload_end(struct tier *tr, struct tier_move *mv, struct seq *q, struct pool *p,
                     struct seq_emptied *emptied) {
	struct tier_seq *e = mv->e;
	struct kvd_seq_desc *d;
	int r = mv->error;

	mv->tenant->tier_moving -= (uint64_t)e->n_segs * tr->seg_bytes;
	/* Gone, or used meanwhile: the copy may be of bytes that changed since. */
	if (r == 0 && (!q || q->pins > 0 || q->pin_serial != mv->pins ||
	               q->desc->generation != mv->generation))
		r = -ECANCELED;
	if (r < 0) {
		entry_free(tr, e);
		move_free(mv);
		return r;
	}
	d = q->desc;
	desc_write_begin(d);
	for (uint32_t t = 0; t < d->n_tables; t++)
		desc_tokens(d)[t] = 0;
	d->moments_blocks = 0;
	desc_write_end(d);
	seq_blocks_free(p, mv->refs, e->n_blocks, emptied);
	q->epoch++;

	e->older = tr->newest;
	if (tr->newest)
		tr->newest->newer = e;
	else
		tr->oldest = e;
	tr->newest = e;
	account(tr, e, 1);
	*tr->metadata_bytes += e->meta_bytes;
	tr->offloads++;
	tr->offload_bytes += e->bytes;
	tr->offload_ns += mv->ns;
	q->tiered = e;
	move_free(mv);
	return 0;
}

int tier_demote_end(struct tier *tr, struct tier_move *mv, struct seq *q) {
	struct tier_seq *e = mv->e;
	int r = mv->error;

	e->busy = false;
	if (!q) {
		/* Detached when q went (tier_detach). */
		entry_free(tr, e);
	} else if (r < 0) {
		tr->lost_io++;
		entry_lose(tr, e);
	} else {
		tr->demotes++;
		tr->demote_bytes += tier_move_bytes(mv);
		tr->demote_ns += mv->ns;
	}
	move_free(mv);
	return r;
}

int tier_recall_begin(struct tier *tr, struct seq *q, struct pool *p, uint64_t conn_id,
                      struct seq_granted *g, struct seq_emptied *emptied,
                      struct tier_move **ret) {
	struct tier_seq *e = q->tiered;
	struct tier_move *mv;
	int r;

	r = move_new(tr, e, q->desc, p, q->device, TIER_MOVE_IN, &mv);
	if (r < 0)
		return r;
	r = seq_alloc_blocks(q, p, conn_id, e->n_moments, e->n_blocks, mv->refs, g, emptied);
	if (r < 0) {
		move_free(mv);
		return r;
	}
	for (uint64_t i = 0; i < e->n_blocks; i++)
		mv->pool[i] = pool_block_addr(p, mv->refs[i]);
	e->busy = e->returning = true;
	*ret = mv;
	return 0;
}

int tier_recall_end(struct tier *tr, struct tier_move *mv, struct seq *q, struct pool *p,
                    uint64_t conn_id, struct seq_granted *g, struct seq_emptied *emptied) {
	struct tier_seq *e = mv->e;
	struct kvd_seq_desc *d;
	uint64_t k;
	int r = mv->error;

	e->busy = e->returning = false;
	if (!q || r < 0) {
		/* The blocks it filled go back; the connection never heard of their chunks. */
		seq_alloc_undo(p, conn_id, mv->refs, e->n_blocks, g, emptied);
		if (!q)
			/* Detached when q went (tier_detach). */
			entry_free(tr, e);
		else if (r != -ECANCELED) {
			if (r == -EBADMSG)
				tr->lost_corrupt++;
			else
				tr->lost_io++;
			entry_lose(tr, e);
		}
		move_free(mv);
		return q ? r : -ECANCELED;
	}
	d = q->desc;
	desc_write_begin(d);
	memcpy(desc_moments(d), mv->refs, e->n_moments * sizeof(*mv->refs));
	d->moments_blocks = e->n_moments;
	k = e->n_moments;
	for (uint32_t t = 0; t < d->n_tables; t++) {
		uint32_t n = DIV_ROUND_UP(e->tokens[t], d->block_tokens);

		memcpy(desc_blocks(d, t), mv->refs + k, n * sizeof(*mv->refs));
		desc_tokens(d)[t] = e->tokens[t];
		k += n;
	}
	desc_write_end(d);
	q->epoch++;
	q->recall = e->in_file ? KVD_RECALL_FILE : KVD_RECALL_HOST;
	if (e->in_file) {
		tr->file_recalls++;
		tr->file_recall_bytes += e->bytes;
		tr->file_recall_ns += mv->ns;
		tr->file_read_ns += mv->io_ns;
	} else {
		tr->recalls++;
		tr->recall_bytes += e->bytes;
		tr->recall_ns += mv->ns;
	}
	entry_drop(tr, e);
	move_free(mv);
	return 0;
}
