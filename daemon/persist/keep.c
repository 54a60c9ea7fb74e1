/* SPDX-License-Identifier: MIT */
/*
 * Keeping KV across a crash: the fd store, the journal, and the restore. See keep.h.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "common/layout.h"
#include "basic/macro.h"
#include "basic/number.h"
#include "keep.h"
#include "log.h"
#include "memfd.h"
#include "server.h"
#include "unmap.h"

#define NAME_JOURNAL "kvd-journal"
#define NAME_CHUNK "kvd-chunk-"
#define NAME_DESC "kvd-desc-"
#define FD_NAME_MAX 64

#define JOURNAL_MAGIC UINT64_C(0x4c4e524a2d44564b) /* "KVD-JRNL" */
#define JOURNAL_VERSION 2
#define JOURNAL_SLOTS_OFFSET 4096u
#define JOURNAL_BYTES (JOURNAL_SLOTS_OFFSET + (uint64_t)KEEP_SLOTS * sizeof(struct keep_slot))

struct keep_header {
	uint64_t magic;
	uint32_t version;
	uint32_t n_slots;
	uint64_t chunk_bytes;
	uint32_t n_chunks;
	uint32_t slot_bytes;
	uint64_t last_seq_id;         /* the server's, at the last kept open */
	/* The pool's devices in chunk order (pool.h), each one's UUID (zeros on host): the
	 * chunks of a GPU come back on that GPU only. */
	uint32_t n_devices;
	uint32_t reserved;
	uint8_t device_uuid[BACKEND_DEVICES_MAX][16];
	uint32_t crc;                 /* of the bytes before it */
	uint32_t reserved2;
};

_Static_assert(sizeof(struct keep_header) <= 4096, "the header fits before the slots");

/* All zero when free. */
struct keep_slot {
	uint64_t seq_id;
	char tenant[KVD_TENANT_NAME_MAX + 1];
	uint32_t crc;                 /* of the bytes before it */
	uint32_t reserved;
};

struct keep_journal {
	struct keep_header header;
};

struct stored_desc {
	uint64_t seq_id;
	int fd;
};

struct keep_stored {
	int journal;
	int *chunks;                  /* per chunk id; -EBADF: none */
	struct stored_desc *descs;    /* sorted by seq_id once taken */
	uint32_t n_descs;
};

/* ---- CRC-32 (IEEE), for torn or stray writes: nothing here defends against malice ---- */

static uint32_t crc_table[256];

static uint32_t crc32_bytes(const void *p, size_t n) {
	const uint8_t *b = p;
	uint32_t crc = UINT32_MAX;

	if (crc_table[1] == 0)
		for (uint32_t i = 0; i < 256; i++) {
			uint32_t c = i;

			for (int k = 0; k < 8; k++)
				c = c & 1 ? 0xedb88320u ^ (c >> 1) : c >> 1;
			crc_table[i] = c;
		}
	for (size_t i = 0; i < n; i++)
		crc = crc_table[(crc ^ b[i]) & 0xff] ^ (crc >> 8);
	return ~crc;
}

static struct keep_slot *journal_slot(struct keep_journal *j, uint32_t i) {
	return (struct keep_slot *)((char *)j + JOURNAL_SLOTS_OFFSET) + i;
}

static void header_seal(struct keep_header *h) {
	h->crc = crc32_bytes(h, offsetof(struct keep_header, crc));
}

/* ---- the store ---- */

static void store_remove(const char *name) {
	int r = sd_notifyf(0, "FDSTOREREMOVE=1\nFDNAME=%s", name);

	if (r < 0)
		log_debug("cannot remove %s from the fd store: %s", name, strerror(-r));
}

/* FDPOLL=0: a memfd never hangs up, and the store must not drop it for POLLIN. */
static int store_push(const char *name, int fd) {
	char msg[32 + FD_NAME_MAX];
	int r;

	snprintf(msg, sizeof(msg), "FDSTORE=1\nFDPOLL=0\nFDNAME=%s", name);
	r = sd_pid_notify_with_fds(0, 0, msg, &fd, 1);
	if (r == 0)
		return -ENOENT;               /* NOTIFY_SOCKET went away */
	return r < 0 ? r : 0;
}

static void chunk_name(uint32_t id, char name[static FD_NAME_MAX]) {
	snprintf(name, FD_NAME_MAX, NAME_CHUNK "%" PRIu32, id);
}

static void desc_name(uint64_t id, char name[static FD_NAME_MAX]) {
	snprintf(name, FD_NAME_MAX, NAME_DESC "%" PRIu64, id);
}

static void on_chunk_created(void *userdata, struct chunk *c) {
	char name[FD_NAME_MAX];
	int r;

	(void)userdata;
	chunk_name(c->id, name);
	r = store_push(name, c->mem.fd);
	if (r < 0)
		log_warning_errno(r, "cannot put chunk %u in the fd store; the sequences using it "
		                  "will not survive a crash", c->id);
}

static void on_chunk_destroyed(void *userdata, struct chunk *c) {
	char name[FD_NAME_MAX];

	(void)userdata;
	chunk_name(c->id, name);
	store_remove(name);
}

static int cmp_desc(const void *a, const void *b) {
	const struct stored_desc *x = a, *y = b;

	return x->seq_id < y->seq_id ? -1 : x->seq_id > y->seq_id;
}

/* Parses the decimal number after prefix in name; -EINVAL when it is not exactly that. */
static int name_number(const char *name, const char *prefix, uint64_t max, uint64_t *ret) {
	size_t n = strlen(prefix);

	if (strncmp(name, prefix, n) != 0)
		return -EINVAL;
	return number_parse_u64(name + n, 0, max, ret);
}

static void stored_free(struct keep_stored *st, uint32_t n_chunks) {
	if (!st)
		return;
	safe_close(st->journal);
	for (uint32_t i = 0; st->chunks && i < n_chunks; i++)
		safe_close(st->chunks[i]);
	for (uint32_t i = 0; i < st->n_descs; i++)
		safe_close(st->descs[i].fd);
	free(st->chunks);
	free(st->descs);
	free(st);
}

/* Takes fd, named name, into the store's lists; a duplicate or a number out of range is
 * dropped from the store. Returns 1 when it was ours, 0 when not (a socket), or -ENOMEM. */
static int stored_take(struct keep *k, const char *name, int fd) {
	struct keep_stored *st = k->stored;
	uint64_t v;

	if (strcmp(name, NAME_JOURNAL) == 0) {
		if (st->journal >= 0)
			goto drop;
		st->journal = fd;
		return 1;
	}
	if (name_number(name, NAME_CHUNK, UINT32_MAX, &v) >= 0) {
		if (v >= k->pool->n_chunks || st->chunks[v] >= 0)
			goto drop;
		st->chunks[v] = fd;
		return 1;
	}
	if (name_number(name, NAME_DESC, UINT64_MAX, &v) >= 0) {
		struct stored_desc *d;

		if (st->n_descs >= KEEP_SLOTS)
			goto drop;
		d = realloc(st->descs, (st->n_descs + 1) * sizeof(*d));
		if (!d) {
			safe_close(fd);
			return -ENOMEM;
		}
		st->descs = d;
		st->descs[st->n_descs++] = (struct stored_desc){ .seq_id = v, .fd = fd };
		return 1;
	}
	if (strncmp(name, "kvd-", 4) == 0)
		goto drop;
	return 0;
drop:
	log_warning("dropping '%s' from the fd store: not one this kvd expects", name);
	store_remove(name);
	safe_close(fd);
	return 1;
}

int keep_new(struct pool *p, uint64_t claim_ms, struct keep **ret) {
	_cleanup_(freep) char **names = NULL;
	const char *fdstore = getenv("FDSTORE");
	struct keep *k;
	int n, r = 0;

	k = calloc(1, sizeof(*k));
	if (!k)
		return -ENOMEM;
	k->pool = p;
	k->claim_ms = claim_ms;
	k->journal_fd = -EBADF;
	k->stored = calloc(1, sizeof(*k->stored));
	if (!k->stored) {
		free(k);
		return -ENOMEM;
	}
	k->stored->journal = -EBADF;
	k->stored->chunks = malloc(p->n_chunks * sizeof(int));
	if (!k->stored->chunks) {
		keep_free(k);
		return -ENOMEM;
	}
	for (uint32_t i = 0; i < p->n_chunks; i++)
		k->stored->chunks[i] = -EBADF;

	n = sd_listen_fds_with_names(1, &names);
	if (n < 0) {
		log_warning_errno(n, "cannot read the fds passed by the service manager, ignoring");
		n = 0;
	}
	if (n > 0) {
		k->sockets = calloc(n, sizeof(int));
		if (!k->sockets)
			r = -ENOMEM;
	}
	for (int i = 0; i < n; i++) {
		int fd = SD_LISTEN_FDS_START + i;

		if (r >= 0)
			r = stored_take(k, names[i], fd);
		else
			safe_close(fd);
		if (r == 0)
			k->sockets[k->n_sockets++] = fd;
	}
	for (int i = 0; names && i < n; i++)
		free(names[i]);
	if (r < 0) {
		keep_free(k);
		return r;
	}
	/* qsort() wants an array even for no elements. */
	if (k->stored->n_descs > 0)
		qsort(k->stored->descs, k->stored->n_descs, sizeof(*k->stored->descs), cmp_desc);

	if (claim_ms == 0)
		log_info("restore-claim is 0: no KV is kept across a restart");
	else if (!getenv("NOTIFY_SOCKET"))
		log_debug("no service manager: no KV is kept across a restart");
	else if (fdstore && strcmp(fdstore, "0") == 0)
		log_info("the service manager keeps no fds (FileDescriptorStoreMax=0): no KV is kept "
		         "across a restart");
	else
		k->on = true;
	if (k->on && fdstore) {
		uint64_t max;

		if (number_parse_u64(fdstore, 0, UINT64_MAX, &max) >= 0 && max < p->n_chunks + 1)
			log_warning("the fd store holds %" PRIu64 " fds, fewer than the pool's %u chunks "
			            "and the journal: raise FileDescriptorStoreMax=", max, p->n_chunks);
	}
	*ret = k;
	return 0;
}

static void orphan_forget(struct seq *q) {
	/* Not seq_free(): at exit the journal and the pool stay as they are. */
	munmap(q->desc, q->desc->total_bytes);
	safe_close(q->desc_fd);
	safe_close(q->obs_fd);
	free(q);
}

struct keep *keep_free(struct keep *k) {
	if (!k)
		return NULL;
	for (uint32_t i = 0; i < k->n_orphans; i++)
		if (k->orphans[i].seq)
			orphan_forget(k->orphans[i].seq);
	free(k->orphans);
	for (unsigned i = 0; i < k->n_sockets; i++)
		safe_close(k->sockets[i]);
	free(k->sockets);
	stored_free(k->stored, k->pool->n_chunks);
	if (k->journal)
		munmap(k->journal, JOURNAL_BYTES);
	safe_close(k->journal_fd);
	free(k->free_slots);
	free(k);
	return NULL;
}

/* ---- restoring ---- */

/* What the restore learns about one chunk before it commits. */
struct rchunk {
	struct backend_chunk mem;     /* the stored chunk, adopted (chunk_adopt); addr NULL: none */
	struct tenant *owner;
	uint64_t block_bytes, stride;
	uint32_t n_blocks;
	uint64_t *used;
	uint16_t *shares;             /* per block, sequences past the first (NULL: none) */
};

struct restore {
	struct keep *k;
	struct server *s;
	struct keep_journal *j;       /* the stored journal, mapped */
	struct rchunk *chunks;
	struct keep_orphan *orphans;
	uint32_t n_orphans;
	uint32_t *orphan_slot;        /* each orphan's slot */
	uint32_t dropped;
	char why[160];                /* why everything was discarded */
};

_printf_(2, 3) static int inconsistent(struct restore *rs, const char *fmt, ...) {
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(rs->why, sizeof(rs->why), fmt, ap);
	va_end(ap);
	return -EBADMSG;
}

static bool sealed_size(int fd) {
	int seals = fcntl(fd, F_GET_SEALS);

	return seals >= 0 && (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) == (F_SEAL_SHRINK | F_SEAL_GROW);
}

/* Maps fd whole when it is a memfd sealed against resizing, of exactly bytes. */
static void *map_sealed(int fd, uint64_t bytes, int prot) {
	struct stat st;
	void *p;

	if (fstat(fd, &st) < 0 || (uint64_t)st.st_size != bytes || !sealed_size(fd))
		return NULL;
	p = mmap(NULL, bytes, prot, MAP_SHARED, fd, 0);
	return p == MAP_FAILED ? NULL : p;
}

struct journal_devices {
	uint8_t uuid[BACKEND_DEVICES_MAX][16];
};

/* The UUIDs of p's devices in chunk order, as the journal keeps them. */
static struct journal_devices journal_devices(const struct pool *p) {
	struct journal_devices j = {};

	for (uint32_t i = 0; i < p->n_devices; i++) {
		const struct backend_device *dev = backend_device(i);

		if (dev)
			memcpy(j.uuid[i], dev->uuid, sizeof(j.uuid[i]));
	}
	return j;
}

static int check_journal(struct restore *rs) {
	struct keep_stored *st = rs->k->stored;
	struct keep_header h;

	if (st->journal < 0)
		return inconsistent(rs, "no journal");
	rs->j = map_sealed(st->journal, JOURNAL_BYTES, PROT_READ | PROT_WRITE);
	if (!rs->j)
		return inconsistent(rs, "the journal is not a sealed memfd of %" PRIu64 " bytes",
		                    (uint64_t)JOURNAL_BYTES);
	memcpy(&h, &rs->j->header, sizeof(h));
	if (h.magic != JOURNAL_MAGIC || h.version != JOURNAL_VERSION ||
	    h.crc != crc32_bytes(&h, offsetof(struct keep_header, crc)))
		return inconsistent(rs, "the journal's header is damaged");
	if (h.n_slots != KEEP_SLOTS || h.slot_bytes != sizeof(struct keep_slot))
		return inconsistent(rs, "the journal's geometry is not this kvd's");
	if (h.chunk_bytes != rs->k->pool->chunk_bytes || h.n_chunks != rs->k->pool->n_chunks)
		return inconsistent(rs, "the pool changed (%" PRIu32 " chunks of %" PRIu64 " bytes "
		                    "before)", h.n_chunks, h.chunk_bytes);
	if (h.n_devices != rs->k->pool->n_devices ||
	    memcmp(h.device_uuid, journal_devices(rs->k->pool).uuid, sizeof(h.device_uuid)) != 0)
		return inconsistent(rs, "the pool's devices changed (%" PRIu32 " before, or others)",
		                    h.n_devices);
	return 0;
}

static int map_chunks(struct restore *rs) {
	struct keep_stored *st = rs->k->stored;
	struct pool *p = rs->k->pool;

	for (uint32_t i = 0; i < p->n_chunks; i++) {
		int r;

		if (st->chunks[i] < 0)
			continue;
		r = p->ops->chunk_adopt(i, p->chunks[i].mem.device, st->chunks[i], p->chunk_bytes,
		                        &rs->chunks[i].mem);
		if (r < 0)
			return inconsistent(rs, "chunk %" PRIu32 " is not a %s chunk of the chunk size (%s)",
			                    i, p->ops->name, strerror(-r));
	}
	return 0;
}

static int stored_desc_fd(struct keep_stored *st, uint64_t seq_id) {
	struct stored_desc key = { .seq_id = seq_id }, *d;

	d = bsearch(&key, st->descs, st->n_descs, sizeof(*d), cmp_desc);
	return d ? d->fd : -EBADF;
}

/* Whether a descriptor's fixed part and layout are what seq_new() makes for its shape. */
static bool same_layout(const struct kvd_seq_desc *a, const struct kvd_seq_desc *b) {
	return a->layers == b->layers && a->kv_heads == b->kv_heads && a->head_dim == b->head_dim &&
	       a->dtype == b->dtype && a->block_tokens == b->block_tokens && a->layout == b->layout &&
	       a->n_tables == b->n_tables && a->max_tokens == b->max_tokens &&
	       a->max_blocks == b->max_blocks && a->block_bytes == b->block_bytes &&
	       a->tokens_offset == b->tokens_offset && a->positions_offset == b->positions_offset &&
	       a->blocks_offset == b->blocks_offset && a->total_bytes == b->total_bytes &&
	       a->compensation == b->compensation && a->moments_bytes == b->moments_bytes &&
	       a->index_heads == b->index_heads && a->index_dim == b->index_dim &&
	       a->index_offset == b->index_offset;
}

/*
 * Rebuilds the sequence of one slot from its stored descriptor od (size bytes, read-only)
 * into a new sequence with a new descriptor, and marks its blocks in rs->chunks. Returns 0,
 * 1 when the sequence is dropped alone (why says why), or a negative errno: -EBADMSG
 * discards everything.
 */
static int restore_seq(struct restore *rs, uint64_t id, struct tenant *t,
                       const struct kvd_seq_desc *od, uint64_t size, struct keep_orphan *o,
                       const char **why) {
	Kvd__V1__RegisterModel req = KVD__V1__REGISTER_MODEL__INIT;
	struct pool *p = rs->k->pool;
	struct kvd_seq_desc h;
	struct seq *q;
	const char *mwhy;
	int r;

	if (size < sizeof(h) || size > rs->s->limits.max_descriptor_bytes)
		return inconsistent(rs, "sequence %" PRIu64 ": a descriptor of %" PRIu64 " bytes", id, size);
	/* The fixed part is copied once and checked on the copy. */
	memcpy(&h, od, sizeof(h));
	if (h.magic != KVD_SEQ_DESC_MAGIC || h.version != KVD_SEQ_DESC_VERSION || h.seq_id != id ||
	    h.total_bytes != size)
		return inconsistent(rs, "sequence %" PRIu64 ": not its descriptor", id);
	if (h.generation % 2 != 0) {
		*why = "it was being rewritten when the daemon died";
		return 1;
	}
	if (h.compensation != KVD_COMPENSATION_NONE || h.moments_blocks != 0)
		return inconsistent(rs, "sequence %" PRIu64 ": compensated sequences are not kept", id);
	req.has_layers = req.has_q_heads = req.has_kv_heads = req.has_head_dim = true;
	req.layers = h.layers;
	/* Not in the descriptor, and without eviction nothing depends on it. */
	req.q_heads = h.kv_heads;
	req.kv_heads = h.kv_heads;
	req.head_dim = h.head_dim;
	req.has_dtype = req.has_block_tokens = req.has_layout = true;
	req.dtype = h.dtype;
	req.block_tokens = h.block_tokens;
	req.layout = h.layout;
	if (model_from_request(&req, p->chunk_bytes, UINT64_MAX, &o->model, &mwhy) < 0)
		return inconsistent(rs, "sequence %" PRIu64 ": %s", id, mwhy);
	r = seq_new(id, &o->model, t, h.max_tokens, rs->s->limits.max_descriptor_bytes, &q);
	if (r == -EINVAL)
		return inconsistent(rs, "sequence %" PRIu64 ": no descriptor fits its shape", id);
	if (r < 0)
		return r;
	if (!same_layout(&h, q->desc)) {
		orphan_forget(q);
		return inconsistent(rs, "sequence %" PRIu64 ": its layout is not this kvd's", id);
	}

	/* Every check first, so that a sequence dropped alone has marked nothing. A sequence's
	 * blocks are on one device (its connection's): q->device is the first block's. */
	q->device = UINT32_MAX;
	for (uint32_t tb = 0; tb < h.n_tables; tb++) {
		uint32_t tokens = layout_tokens(od)[tb];
		const struct kvd_block_ref *refs = layout_blocks(od, tb);

		if (tokens > h.max_tokens) {
			orphan_forget(q);
			return inconsistent(rs, "sequence %" PRIu64 ": %u tokens in a table", id, tokens);
		}
		for (uint32_t b = 0; b < DIV_ROUND_UP(tokens, h.block_tokens); b++) {
			struct kvd_block_ref ref = refs[b];

			if (ref.chunk_id >= p->n_chunks || ref.index >= p->chunk_bytes /
			    ALIGN_TO(h.block_bytes, LAYOUT_BLOCK_ALIGN)) {
				orphan_forget(q);
				return inconsistent(rs, "sequence %" PRIu64 ": block (%u, %u) out of range",
				                    id, ref.chunk_id, ref.index);
			}
			if (q->device != UINT32_MAX && p->chunks[ref.chunk_id].mem.device != q->device) {
				orphan_forget(q);
				return inconsistent(rs, "sequence %" PRIu64 ": blocks on two devices", id);
			}
			q->device = p->chunks[ref.chunk_id].mem.device;
			if (!rs->chunks[ref.chunk_id].mem.addr) {
				orphan_forget(q);
				*why = "a chunk it uses is not in the fd store";
				return 1;
			}
		}
	}
	/* A sequence without blocks has no device of its own: the first's is as good. */
	if (q->device == UINT32_MAX)
		q->device = 0;
	for (uint32_t tb = 0; tb < h.n_tables; tb++) {
		uint32_t tokens = layout_tokens(od)[tb];
		const struct kvd_block_ref *refs = layout_blocks(od, tb);

		for (uint32_t b = 0; b < DIV_ROUND_UP(tokens, h.block_tokens); b++) {
			struct rchunk *rc = &rs->chunks[refs[b].chunk_id];
			uint32_t index = refs[b].index;

			if (!rc->owner) {
				rc->owner = t;
				rc->block_bytes = h.block_bytes;
				rc->stride = ALIGN_TO(h.block_bytes, LAYOUT_BLOCK_ALIGN);
				rc->n_blocks = p->chunk_bytes / rc->stride;
				rc->used = calloc(DIV_ROUND_UP(rc->n_blocks, 64), sizeof(uint64_t));
				if (!rc->used) {
					orphan_forget(q);
					return -ENOMEM;
				}
			} else if (rc->owner != t || rc->block_bytes != h.block_bytes) {
				orphan_forget(q);
				return inconsistent(rs, "chunk %u serves two tenants or block sizes",
				                    refs[b].chunk_id);
			}
			/* Forks share their parent's blocks (pool_block_share()): a block one
			 * tenant's sequences name again is shared, not inconsistent. */
			if (rc->used[index / 64] & (UINT64_C(1) << (index % 64))) {
				if (!rc->shares)
					rc->shares = calloc(rc->n_blocks, sizeof(*rc->shares));
				if (!rc->shares) {
					orphan_forget(q);
					return -ENOMEM;
				}
				if (rc->shares[index] == UINT16_MAX) {
					orphan_forget(q);
					return inconsistent(rs, "block (%u, %u) is shared too often",
					                    refs[b].chunk_id, index);
				}
				rc->shares[index]++;
			}
			rc->used[index / 64] |= UINT64_C(1) << (index % 64);
		}
	}
	/* The geometry is the same, so the arrays copy whole. The new descriptor is ours to
	 * write: the stored one is sealed against writable mappings (seq.c). */
	desc_write_begin(q->desc);
	memcpy((char *)q->desc + h.tokens_offset, (const char *)od + h.tokens_offset,
	       h.total_bytes - h.tokens_offset);
	q->desc->next_position = h.next_position;
	desc_write_end(q->desc);
	/* Its engine wrote it before the restart, or has it pinned now and its unpin says so. */
	q->written_pos = h.next_position;
	o->seq = q;
	return 0;
}

static int restore_slots(struct restore *rs) {
	struct keep_stored *st = rs->k->stored;
	uint64_t last = rs->j->header.last_seq_id;

	for (uint32_t i = 0; i < KEEP_SLOTS; i++) {
		struct keep_slot sl, *live = journal_slot(rs->j, i);
		static const struct keep_slot zero;
		const char *why = NULL;
		struct tenant *t = NULL;
		void *od;
		uint64_t size;
		struct stat stt;
		int fd, r;

		memcpy(&sl, live, sizeof(sl));
		if (memcmp(&sl, &zero, sizeof(sl)) == 0)
			continue;
		if (sl.crc != crc32_bytes(&sl, offsetof(struct keep_slot, crc)) || sl.seq_id == 0 ||
		    sl.seq_id > last || memchr(sl.tenant, 0, sizeof(sl.tenant)) == NULL ||
		    !tenant_name_valid(sl.tenant))
			return inconsistent(rs, "journal slot %" PRIu32 " is damaged", i);
		for (uint32_t o = 0; o < rs->n_orphans; o++)
			if (rs->orphans[o].seq->id == sl.seq_id)
				return inconsistent(rs, "sequence %" PRIu64 " is in the journal twice",
				                    sl.seq_id);
		fd = stored_desc_fd(st, sl.seq_id);
		if (fd < 0)
			why = "its descriptor is not in the fd store";
		else if ((r = tenant_get(&rs->s->tenants, sl.tenant, &t)) < 0)
			why = r == -EUSERS ? "its tenant does not fit max-tenants" : "no memory for its tenant";
		if (why) {
			log_warning("sequence %" PRIu64 " of tenant %s is not restored: %s", sl.seq_id,
			            sl.tenant, why);
			memset(live, 0, sizeof(*live));
			rs->dropped++;
			continue;
		}
		if (fstat(fd, &stt) < 0 || stt.st_size < (off_t)sizeof(struct kvd_seq_desc))
			return inconsistent(rs, "sequence %" PRIu64 ": its descriptor is too small",
			                    sl.seq_id);
		size = (uint64_t)stt.st_size;
		if (size > rs->s->limits.max_descriptor_bytes)
			return inconsistent(rs, "sequence %" PRIu64 ": a descriptor of %" PRIu64 " bytes",
			                    sl.seq_id, size);
		od = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
		if (od == MAP_FAILED)
			return inconsistent(rs, "sequence %" PRIu64 ": its descriptor cannot be mapped",
			                    sl.seq_id);
		r = restore_seq(rs, sl.seq_id, t, od, size, &rs->orphans[rs->n_orphans], &why);
		munmap(od, size);
		if (r < 0)
			return r;
		if (r > 0) {
			log_warning("sequence %" PRIu64 " of tenant %s is not restored: %s", sl.seq_id,
			            sl.tenant, why);
			memset(live, 0, sizeof(*live));
			rs->dropped++;
			continue;
		}
		rs->orphan_slot[rs->n_orphans++] = i;
	}
	return 0;
}

/* Undoes what a failed restore built; the stored fds stay in k->stored. */
static void restore_undo(struct restore *rs) {
	struct pool *p = rs->k->pool;

	for (uint32_t i = 0; i < rs->n_orphans; i++)
		orphan_forget(rs->orphans[i].seq);
	rs->n_orphans = 0;
	for (uint32_t i = 0; rs->chunks && i < p->n_chunks; i++) {
		if (rs->chunks[i].mem.addr)
			p->ops->chunk_destroy(&rs->chunks[i].mem);
		free(rs->chunks[i].used);
		free(rs->chunks[i].shares);
		rs->chunks[i] = (struct rchunk){};
	}
	if (rs->j)
		munmap(rs->j, JOURNAL_BYTES);
	rs->j = NULL;
}

/* Drops every stored fd from the store and closes it. */
static void stored_drop_all(struct keep *k) {
	struct keep_stored *st = k->stored;
	char name[FD_NAME_MAX];

	if (st->journal >= 0)
		store_remove(NAME_JOURNAL);
	st->journal = safe_close(st->journal);
	for (uint32_t i = 0; i < k->pool->n_chunks; i++)
		if (st->chunks[i] >= 0) {
			chunk_name(i, name);
			store_remove(name);
			st->chunks[i] = safe_close(st->chunks[i]);
		}
	for (uint32_t i = 0; i < st->n_descs; i++) {
		desc_name(st->descs[i].seq_id, name);
		store_remove(name);
		st->descs[i].fd = safe_close(st->descs[i].fd);
	}
	st->n_descs = 0;
}

/* Makes the restore's result the daemon's state. Cannot fail. */
static void restore_commit(struct restore *rs) {
	struct keep *k = rs->k;
	struct keep_stored *st = k->stored;
	struct pool *p = k->pool;
	char name[FD_NAME_MAX];
	uint32_t chunks = 0;

	for (uint32_t i = 0; i < p->n_chunks; i++) {
		struct rchunk *rc = &rs->chunks[i];
		struct chunk *c = &p->chunks[i];

		if (!rc->mem.addr)
			continue;
		if (!rc->owner) {
			/* Processes of the last life may still map it: never reused. Its fd leaves
			 * the store with the others left in st. */
			p->ops->chunk_destroy(&rc->mem);
			continue;
		}
		/* Its store entry stays: the same fd, under the same name. */
		c->mem = rc->mem;
		c->mem.fd = TAKE_FD(st->chunks[i]);
		rc->mem = (struct backend_chunk){ .fd = -EBADF };
		pool_chunk_restore(p, c, rc->owner, rc->block_bytes, TAKE_PTR(rc->used),
		                   TAKE_PTR(rc->shares));
		chunks++;
	}
	pool_restore_done(p);

	/* The old descriptors go; the new ones take their names. */
	for (uint32_t i = 0; i < st->n_descs; i++) {
		desc_name(st->descs[i].seq_id, name);
		store_remove(name);
		st->descs[i].fd = safe_close(st->descs[i].fd);
	}
	st->n_descs = 0;
	for (uint32_t i = 0; i < rs->n_orphans; i++) {
		struct seq *q = rs->orphans[i].seq;

		q->keep_slot = rs->orphan_slot[i] + 1;
		registry_seq_opened(rs->s, q);
		desc_name(q->id, name);
		if (store_push(name, q->desc_fd) < 0)
			log_warning("cannot put sequence %" PRIu64 "'s descriptor in the fd store; it "
			            "will not survive another crash", q->id);
	}
	k->orphans = TAKE_PTR(rs->orphans);
	k->n_orphans = k->orphans_left = rs->n_orphans;
	/* The stored journal goes on, as it is. */
	k->journal = TAKE_PTR(rs->j);
	k->journal_fd = TAKE_FD(st->journal);
	rs->s->next_seq_id = MAX(rs->s->next_seq_id, k->journal->header.last_seq_id);
	if (k->n_orphans > 0 || rs->dropped > 0)
		log_notice("kept across the restart: %" PRIu32 " sequences in %" PRIu32 " chunks, "
		           "waiting %" PRIu64 " ms for their tenants to claim them; %" PRIu32
		           " dropped", k->n_orphans, chunks, k->claim_ms, rs->dropped);
}

/* A fresh journal, in the store. */
static int journal_create(struct keep *k) {
	_cleanup_(closep) int fd = -EBADF;
	struct keep_journal *j;
	void *map;
	int r;

	r = memfd_sealed(NAME_JOURNAL, JOURNAL_BYTES, 0, &fd, &map);
	if (r < 0)
		return r;
	j = map;
	j->header = (struct keep_header){
		.magic = JOURNAL_MAGIC,
		.version = JOURNAL_VERSION,
		.n_slots = KEEP_SLOTS,
		.chunk_bytes = k->pool->chunk_bytes,
		.n_chunks = k->pool->n_chunks,
		.slot_bytes = sizeof(struct keep_slot),
		.n_devices = k->pool->n_devices,
	};
	memcpy(j->header.device_uuid, journal_devices(k->pool).uuid, sizeof(j->header.device_uuid));
	header_seal(&j->header);
	r = store_push(NAME_JOURNAL, fd);
	if (r < 0) {
		munmap(j, JOURNAL_BYTES);
		return r;
	}
	k->journal = j;
	k->journal_fd = TAKE_FD(fd);
	return 0;
}

int keep_restore(struct keep *k, struct server *s) {
	struct restore rs = { .k = k, .s = s };
	bool stored;
	int r;

	if (!k)
		return 0;
	stored = k->stored->journal >= 0 || k->stored->n_descs > 0;
	for (uint32_t i = 0; !stored && i < k->pool->n_chunks; i++)
		stored = k->stored->chunks[i] >= 0;
	if (!k->on) {
		if (stored)
			log_info("dropping the fds stored by an earlier kvd: keeping KV is off");
		stored_drop_all(k);
		return 0;
	}
	if (stored) {
		rs.chunks = calloc(k->pool->n_chunks, sizeof(*rs.chunks));
		rs.orphans = calloc(KEEP_SLOTS, sizeof(*rs.orphans));
		rs.orphan_slot = calloc(KEEP_SLOTS, sizeof(*rs.orphan_slot));
		if (!rs.chunks || !rs.orphans || !rs.orphan_slot)
			r = -ENOMEM;
		else {
			r = check_journal(&rs);
			if (r >= 0)
				r = map_chunks(&rs);
			if (r >= 0)
				r = restore_slots(&rs);
		}
		if (r >= 0)
			restore_commit(&rs);
		else {
			if (r == -EBADMSG)
				log_warning("discarding the KV kept across the restart, starting empty: %s",
				            rs.why);
			else
				log_error_errno(r, "cannot restore the KV kept across the restart, "
				                "starting empty");
			restore_undo(&rs);
		}
		free(rs.chunks);
		free(rs.orphans);
		free(rs.orphan_slot);
	}
	/* Whatever is left was not taken: a discarded restore, or chunks without a journal. */
	stored_drop_all(k);
	k->deadline_ms = now_ms() + k->claim_ms;

	if (!k->journal) {
		r = journal_create(k);
		if (r < 0) {
			k->on = false;
			log_error_errno(r, "cannot set up the journal of what is kept across a restart; "
			                "keeping nothing");
			return 0;
		}
	}
	k->free_slots = malloc(KEEP_SLOTS * sizeof(uint32_t));
	if (!k->free_slots)
		return -ENOMEM;
	/* Lowest slots on top, so that the journal stays dense. */
	for (uint32_t i = KEEP_SLOTS; i-- > 0;)
		if (journal_slot(k->journal, i)->seq_id == 0)
			k->free_slots[k->n_free++] = i;
	k->pool->chunk_created = on_chunk_created;
	k->pool->chunk_destroyed = on_chunk_destroyed;
	k->pool->chunk_created_userdata = k;
	/* Chunks already created (restored ones) are in the store under their names. */
	return 0;
}

/* ---- recording ---- */

void keep_seq_opened(struct keep *k, struct seq *q, uint64_t last_seq_id) {
	struct keep_slot sl = { .seq_id = q->id };
	char name[FD_NAME_MAX];
	uint32_t i;
	int r;

	if (!k || !k->on || !k->journal || q->model->unit != KVD_UNIT_NONE)
		return;
	if (k->n_free == 0) {
		if (!k->full_logged)
			log_warning("more than %u sequences open: the others are not kept across a "
			            "restart", KEEP_SLOTS);
		k->full_logged = true;
		return;
	}
	desc_name(q->id, name);
	r = store_push(name, q->desc_fd);
	if (r < 0) {
		log_warning_errno(r, "cannot put sequence %" PRIu64 "'s descriptor in the fd store; "
		                  "it will not survive a crash", q->id);
		return;
	}
	i = k->free_slots[--k->n_free];
	snprintf(sl.tenant, sizeof(sl.tenant), "%s", q->tenant->name);
	sl.crc = crc32_bytes(&sl, offsetof(struct keep_slot, crc));
	/* The header first: a slot must never name an id beyond it. */
	k->journal->header.last_seq_id = last_seq_id;
	header_seal(&k->journal->header);
	memcpy(journal_slot(k->journal, i), &sl, sizeof(sl));
	q->keep_slot = i + 1;
}

void keep_seq_dropped(struct keep *k, struct seq *q) {
	char name[FD_NAME_MAX];

	if (!k || !q->keep_slot)
		return;
	/* The slot first: a journal that names a sequence whose descriptor the store lost
	 * only drops that sequence, but the other way round it would still be restored. */
	memset(journal_slot(k->journal, q->keep_slot - 1), 0, sizeof(struct keep_slot));
	k->free_slots[k->n_free++] = q->keep_slot - 1;
	q->keep_slot = 0;
	desc_name(q->id, name);
	store_remove(name);
}

/* ---- claims ---- */

int keep_claim(struct keep *k, uint64_t seq_id, const struct tenant *t, const struct model *m,
               struct seq **ret) {
	for (uint32_t i = 0; k && i < k->n_orphans; i++) {
		struct keep_orphan *o = &k->orphans[i];
		const struct model *om = &o->model;

		if (!o->seq || o->seq->id != seq_id || o->seq->tenant != t)
			continue;
		if (m->unit != KVD_UNIT_NONE || m->compensation != KVD_COMPENSATION_NONE ||
		    m->layers != om->layers || m->kv_heads != om->kv_heads ||
		    m->head_dim != om->head_dim || m->dtype != om->dtype ||
		    m->block_tokens != om->block_tokens || m->layout != om->layout ||
		    m->block_bytes != om->block_bytes)
			return -EINVAL;
		*ret = o->seq;
		return 0;
	}
	return -ENOENT;
}

void keep_adopt(struct keep *k, struct seq *q, const struct model *m) {
	for (uint32_t i = 0; i < k->n_orphans; i++)
		if (k->orphans[i].seq == q) {
			k->orphans[i].seq = NULL;
			k->orphans_left--;
			q->model = m;
			return;
		}
}

void keep_tick(struct keep *k, struct server *s) {
	struct seq_emptied emptied = { .chunks = s->scratch + s->scratch_used };
	uint32_t n = 0;

	if (!k || k->orphans_left == 0 || now_ms() < k->deadline_ms)
		return;
	for (uint32_t i = 0; i < k->n_orphans; i++) {
		struct seq *q = k->orphans[i].seq;

		if (!q)
			continue;
		k->orphans[i].seq = NULL;
		keep_seq_dropped(k, q);
		registry_seq_closed(s, q);
		seq_free(q, s->pool, &emptied);
		n++;
	}
	k->orphans_left = 0;
	/* Nobody holds them: the chunks are free at once (their memory stays their tenant's:
	 * pool.h, "Isolation"). */
	unmap_reclaim(s, &emptied, NULL, NULL);
	log_notice("%" PRIu32 " sequences kept across the restart were not claimed within %" PRIu64
	           " ms (restore-claim): freed", n, k->claim_ms);
}
