/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Sequence groups (docs/engines.md, "Tensor-parallel groups"): the sequences of one
 * request on the ranks of a tensor-parallel engine, one per rank, each on its rank's
 * connection and model (its kv heads). A step's grows are admitted all or none: the first
 * member to grow by n for a step grows every member by n (or none, when one cannot), and
 * each other member's own grow by n then finds its tokens there. A member that goes breaks
 * the group: the others' grows are refused until they are released too. Rounds choose per
 * member, as for any sequence: each rank's tables are its own.
 */

#include <stdbool.h>
#include <stdint.h>

#define SEQ_GROUP_MAX 16

struct seq;
struct pool;
struct seq_grants;
struct seq_emptied;

struct seq_group {
	uint64_t id;                  /* its first member's sequence id */
	uint32_t size, n;             /* members it is opened for, and has */
	struct seq *members[SEQ_GROUP_MAX];
	/* Tokens each member's own grows have yet to claim of the group's steps. */
	uint32_t pending[SEQ_GROUP_MAX];
	bool broken;                  /* a member went */
};

/* Makes q the first member of a new group of size members (2..SEQ_GROUP_MAX). Returns 0,
 * -EINVAL, -ENOMEM. */
int group_new(struct seq *q, uint32_t size);

/* Adds q to g: -EBUSY when g is full, broken, or has grown already (its members join
 * before its first step), else 0. */
int group_join(struct seq_group *g, struct seq *q);

/* Takes q out of its group (the group breaks; the last member frees it). */
void group_leave(struct seq *q);

/*
 * A grow of member q by n within its group: when q's own grows have n tokens to claim of a
 * step already made, claims them (*ret_grown false); otherwise makes a step, growing every
 * member by n or none (*ret_grown true): q's new chunks into grants[q's rank], the other
 * members' into theirs (conn ids: each member's), chunks emptied by a failed attempt into
 * *emptied. Returns 0, or -EPIPE (the group is broken), -EAGAIN (not every member has
 * joined), -EINVAL (q has another number of tokens to claim), seq_grow()'s errors (with
 * the failing member's grants short_bytes in grants[q's rank]).
 */
int group_grow(struct seq *q, struct pool *p, uint32_t n, struct seq_grants *grants,
               struct seq_emptied *emptied, bool *ret_grown);

/* Bytes of new blocks a step of n would take, over every member. */
uint64_t group_grow_bytes(const struct seq *q, const struct pool *p, uint32_t n);
