/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Keeping KV across a crash. Under a service manager with a file descriptor store (systemd's
 * FileDescriptorStoreMax=), the daemon hands it the fds that hold the KV: each chunk's memfd
 * ("kvd-chunk-ID"), each kept sequence's descriptor ("kvd-desc-SEQID"), and a journal
 * ("kvd-journal"): a memfd of fixed size, mapped by the daemon only, with one slot per kept
 * sequence naming its id and tenant. When the daemon dies and is started again (Restart=),
 * the store passes those fds back (LISTEN_FDS, LISTEN_FDNAMES) and keep_restore() rebuilds
 * from them: the sequences come back owned by their tenants and charged to the budget, but
 * without a connection, until one of the same tenant claims them (SeqClaim) or restore-claim
 * passes; then they are freed.
 *
 * Isolation: which processes of the last life still map a chunk is not known (a client that
 * did not reconnect keeps its mappings), so a stored chunk is never given to another
 * tenant: one that no kept sequence uses is dropped at start, and a restored one stays its
 * tenant's memory, as every chunk's memory stays its last owner's (pool.h, "Isolation").
 *
 * Nothing read back is trusted. The journal's header and slots carry CRCs; each descriptor
 * is checked against the model limits and the layout seq_new() gives its shape; each block
 * against the chunks; no block may be used twice, and a chunk serves one tenant and one
 * block size. Any failure discards everything: an empty start, every stored fd dropped.
 * A sequence that was being rewritten when the daemon died (odd generation), or whose
 * descriptor or chunk the store lacks, or whose tenant no longer fits the table, is dropped
 * alone: its blocks are simply free.
 *
 * Kept: sequences of models without an eviction unit, on either backend. Not kept:
 * sequences of models with eviction or compensation (their observation buffers, smoothed
 * costs and moments), models (a client registers them again), connections, rings, and which
 * connections map which chunks.
 *
 * The journal is written in place: a slot per open and per release, and the header's last
 * sequence id with each kept open; each write is a few dozen bytes of the daemon's own
 * mapping, no system call. Pushing a descriptor to the store is one sendmsg() per kept open,
 * one per release, and one per chunk when it is first created.
 */

#include <stdbool.h>
#include <stdint.h>

#include "model.h"
#include "pool.h"
#include "seq.h"
#include "tenant.h"

struct server;

/* Sequences the journal can hold; more are served, just not kept. */
#define KEEP_SLOTS 65536u

struct keep_journal;
struct keep_stored;

/* A sequence kept across the restart that no connection claimed yet. */
struct keep_orphan {
	struct seq *seq;              /* NULL once claimed or freed */
	struct model model;           /* its shape, read from its descriptor */
};

struct keep {
	bool on;                      /* a store to keep things in, and restore-claim > 0 */
	uint64_t claim_ms;
	struct pool *pool;
	/* The passed fds that are not ours: the listening socket, for server_new(). */
	int *sockets;
	unsigned n_sockets;
	/* The journal. */
	int journal_fd;
	struct keep_journal *journal;
	uint32_t *free_slots;         /* a stack of the free slots' indices */
	uint32_t n_free;
	bool full_logged;
	/* What the store passed at start, until keep_restore() took or dropped it. */
	struct keep_stored *stored;
	/* After keep_restore(). */
	struct keep_orphan *orphans;
	uint32_t n_orphans, orphans_left;
	uint64_t deadline_ms;
};

/*
 * Takes the fds a service manager passed (sd_listen_fds_with_names()): the store's go to
 * k, the others to k->sockets. Turns keeping on when claim_ms is not 0, NOTIFY_SOCKET is
 * set, and $FDSTORE (systemd 254 and later) is not 0. Returns 0 or
 * -ENOMEM.
 */
int keep_new(struct pool *p, uint64_t claim_ms, struct keep **ret);
/* Frees the orphans' memory, leaving the journal and the store as they are: a daemon that
 * exits on a failure is restarted and restores them. */
struct keep *keep_free(struct keep *k);

/*
 * Rebuilds the kept sequences into s, once its tenants are set up (admin_new()), before the
 * loop runs; then starts the journal. Discarding what was stored, or failing to make a
 * journal (keeping is then off), is logged, not an error. Returns 0 or -ENOMEM.
 */
int keep_restore(struct keep *k, struct server *s);

/* Records an opened sequence while q->desc_fd is still open (k may be NULL: nothing kept);
 * last_seq_id is the server's last sequence id. Failures only leave q unkept. */
void keep_seq_opened(struct keep *k, struct seq *q, uint64_t last_seq_id);
/* Forgets a sequence about to be freed; nothing when it was not kept. */
void keep_seq_dropped(struct keep *k, struct seq *q);

/*
 * Finds sequence seq_id, kept and not yet claimed, for a connection of tenant t that claims
 * it with model m, which must have the sequence's shape. Returns 0 with it in *ret (still
 * kept's: see keep_adopt()), -ENOENT (no such sequence of t waits), or -EINVAL (m's shape
 * differs, or m has an eviction unit).
 */
int keep_claim(struct keep *k, uint64_t seq_id, const struct tenant *t, const struct model *m,
               struct seq **ret);
/* Takes q, found by keep_claim(), out of the orphans, with m as its model; the caller links
 * it to its connection. */
void keep_adopt(struct keep *k, struct seq *q, const struct model *m);

/* Once per tick: past the deadline, frees the orphans left. */
void keep_tick(struct keep *k, struct server *s);
