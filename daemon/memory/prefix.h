/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Blocks by content within a tenant (docs/engines.md, "Prefix sharing"): the index of the
 * content keys that sequences published, so that a prefix open finds, for each key of its
 * prompt, a block that holds that content and shares it instead of prefilling it again.
 *
 * A key names the content of one logical block of a sequence (block b of every table) in a
 * namespace of the tenant and the model's identity (its name and block layout: two models
 * of one shape never share, nor do two layouts of one name). The index holds what the
 * sequences published and checks the rest when asked: a block is found only while its
 * sequence is resident and every table still holds exactly the block's positions (an
 * eviction round that took tokens of it makes it another content: rounds and recalls
 * unpublish what they change, prefix_recheck(), so that the KV events say so too).
 *
 * Cached blocks: when a sequence goes, each published block of it that it held last (and
 * intact) stays, held by a cache entry instead, and later opens find it as they find a
 * sequence's. The cache keeps each tenant's cached bytes within its cap, and sheds its
 * least recently used entries (a hit makes an entry recent) whenever memory is short,
 * before any round evicts a token: an unreferenced prefix goes before anything live.
 */

#include <stdbool.h>
#include <stdint.h>

#include "idmap.h"
#include "kvd/kvd-abi.h"

#define PREFIX_KEY_BYTES 32

struct model;
struct pool;
struct seq;
struct seq_emptied;
struct tenant;

/* One published block: an entry of the index, chained with the others whose ids collide
 * (ids are 64 bits of the key mixed with the namespace; the full key is compared). */
struct prefix_ref {
	struct seq *seq;
	uint32_t block;
	struct prefix_ref *next;
};

/* A cached block: the block of every table that held key's content, now held by the
 * cache alone (or with the sequences that attached it since). */
struct prefix_cached {
	uint64_t id;                  /* its index id */
	uint64_t ns;                  /* its namespace (key_id's) */
	uint8_t key[PREFIX_KEY_BYTES];
	struct tenant *tenant;
	uint32_t device, block, n_tables;
	uint64_t bytes;               /* of its blocks */
	uint64_t hits;
	struct prefix_cached *next;   /* its id's chain */
	struct prefix_cached *older, *newer; /* recency: the least recently used first */
	struct kvd_block_ref refs[];  /* n_tables */
};

struct prefix_index {
	struct idmap map;             /* id -> the first prefix_ref of its chain */
	struct idmap cached;          /* id -> the first prefix_cached of its chain */
	struct prefix_cached *oldest, *newest;
	uint64_t cached_bytes, cached_blocks;
	uint32_t max_percent;         /* of the budget, each tenant's cached bytes at most */
	uint64_t dropped;             /* cached blocks dropped, since the start */
	/* Told when a key becomes findable in its namespace (stored) and when its last holder
	 * there goes (KV events); NULL: nobody. tokens may be NULL (n_tokens 0). */
	void (*notify)(void *userdata, bool stored, const uint8_t key[PREFIX_KEY_BYTES],
	               const uint8_t *parent, const uint32_t *tokens, uint32_t n_tokens,
	               uint32_t block_tokens);
	void *userdata;
};

/* Who asks for keys: a tenant's model on a device, and the sequence asking (NULL: none,
 * a lookup). */
struct prefix_who {
	const struct tenant *tenant;
	const struct model *model;
	uint32_t device;
	const struct seq *self;
	uint64_t ns;                  /* the namespace's hash: prefix_who_init() */
};

/* Sets w->ns from the rest; prefix_who_of() does it for a sequence. */
void prefix_who_init(struct prefix_who *w);
struct prefix_who prefix_who_of(const struct seq *s);

/* Where a prefix open found a block: a sequence's, or a cached one. */
struct prefix_hit {
	struct seq *seq;
	struct prefix_cached *cached;
};

/* A sequence's keys: given at its open, published up to `published`; refs[b] is block b's
 * entry once published. */
struct prefix_keys {
	uint8_t (*keys)[PREFIX_KEY_BYTES];
	uint32_t *tokens;             /* the blocks' token ids, when the open gave them; NULL */
	struct prefix_ref *refs;
	uint32_t n, published;
	struct prefix_index *index;   /* where refs are (NULL before the first publish) */
};

/* Bytes of daemon memory the keys of n blocks (and their token ids) take, at most (counted
 * in the sequence's metadata). */
uint64_t prefix_keys_bytes(uint32_t n, uint32_t block_tokens);

/* Gives s the n keys at keys (copied), and their blocks' token ids (NULL: none; else n x
 * block_tokens, copied); none published. Returns 0, -ENOMEM. */
int prefix_keys_set(struct seq *s, const uint8_t (*keys)[PREFIX_KEY_BYTES], const uint32_t *tokens,
                    uint32_t n);

/* Adds s's blocks [published, blocks) to the index. Returns 0, or -EINVAL (blocks past the
 * keys or past a block s holds whole in every table), -ENOMEM (nothing added). */
int prefix_publish(struct prefix_index *x, struct seq *s, uint32_t blocks);

/* After a round changed s's tables: unpublishes its blocks from the first one no longer
 * intact (an eviction shifts every later slot, so none after it is either). */
void prefix_recheck(struct seq *s);

/* Drops s's keys of blocks `from` onwards (from the index too): a truncate rewrote them,
 * or the sequence goes (from 0, which frees the keys). */
void prefix_forget(struct seq *s, uint32_t from);

/* Whether every table of s holds block b whole, at positions b * block_tokens onwards,
 * untouched by eviction. */
bool prefix_block_intact(const struct seq *s, uint32_t b);

/*
 * A sequence that published key as its block b and can share it now with asker (same
 * tenant, model identity and device; resident, not moving), else a cached block of key,
 * into *ret. Returns whether one was found. A published block is intact: whatever
 * rewrites a table unpublishes what it touched (prefix_recheck, prefix_forget), so the
 * find does not look at the tables. prev: the hit of block b - 1 of the same keys, or
 * NULL: a prompt found in a sequence is usually found there whole, which saves the
 * index's lookups of a long prompt's blocks.
 */
bool prefix_find(const struct prefix_index *x, const struct prefix_who *asker, uint32_t b,
                 const uint8_t key[PREFIX_KEY_BYTES], const struct prefix_hit *prev,
                 struct prefix_hit *ret);

/* Counts a hit's use: a cached block becomes the most recent. An open marks its hits from
 * the last to the first, so that a chain's head stays the more recent. */
void prefix_used(struct prefix_index *x, const struct prefix_hit *h);

/* The block of table t of a hit of block b. */
struct kvd_block_ref prefix_hit_ref(const struct prefix_hit *h, uint32_t t, uint32_t b);

/*
 * When s goes: keeps each published, intact block that s holds last (no other sequence
 * does) as a cached block, within its tenant's cap (the tenant's oldest entries dropped
 * for room, into *emptied). Call before s's blocks are freed: the cache takes its own hold.
 */
void prefix_retire(struct prefix_index *x, struct seq *s, struct pool *p,
                   struct seq_emptied *emptied);

/* Drops cached blocks, the least recently used first, of tenant t (NULL: any), until
 * `bytes` of them went (0: all); chunks emptied into *emptied. Returns the bytes dropped. */
uint64_t prefix_shed(struct prefix_index *x, struct pool *p, const struct tenant *t,
                     uint64_t bytes, struct seq_emptied *emptied);

void prefix_index_done(struct prefix_index *x);
