/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Sequences: block tables plus the shared descriptor (layout in kvd/kvd.h) that the daemon
 * writes and the owning client maps read-only. The descriptor is the only copy of the
 * tables: the daemon reads what it wrote there, so the two can never disagree.
 */

#include <stdint.h>

#include "kvd/kvd.h"
#include "model.h"
#include "pool.h"

struct seq {
	uint64_t id;
	const struct model *model;
	struct tenant *tenant;
	int desc_fd;                  /* kept until the open reply took a copy */
	struct kvd_seq_desc *desc;    /* the daemon's writable mapping */
	struct seq *next;             /* in the owning connection's list */
};

/* Chunks a grow handed to a connection that had not mapped them yet. */
struct seq_grants {
	struct chunk *chunks[253];
	uint32_t n;
};

/* Chunks whose last block an operation freed; the caller reclaims them. chunks has room
 * for every chunk of the pool (a chunk empties at most once per operation), so adding
 * never fails. */
struct seq_emptied {
	struct chunk **chunks;
	uint32_t n;
};

/* Creates an empty sequence able to hold max_tokens per table. Returns 0, or -EINVAL
 * (max_tokens 0, or the descriptor would exceed desc_max bytes), -ENOMEM, -errno. */
int seq_new(uint64_t id, const struct model *m, struct tenant *t, uint32_t max_tokens,
            uint64_t desc_max, struct seq **ret);

/*
 * Appends n tokens to every table, taking blocks from the pool for the tenant. Chunks that
 * conn_id does not hold yet are listed in *grants and conn_id is made their holder.
 * All or nothing. Returns 0, or -EINVAL (n is 0), -EFBIG (past max_tokens), -E2BIG (more
 * new chunks than one frame can carry), -ENOSPC, -EDQUOT, -ENOMEM; on failure the chunks
 * the attempt emptied are in *emptied.
 */
int seq_grow(struct seq *s, struct pool *p, uint64_t conn_id, uint32_t n,
             struct seq_grants *grants, struct seq_emptied *emptied);

/* Frees every block of the sequence and the sequence itself; chunks left empty are added
 * to *emptied. */
void seq_free(struct seq *s, struct pool *p, struct seq_emptied *emptied);

/* Digest of the resident K/V through the daemon's mapping (see kvd_seq_digest). */
int seq_digest(const struct seq *s, struct pool *p, uint64_t *ret_digest, uint64_t *ret_bytes);
