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
 * eviction round that took tokens of it makes it another content), so nothing has to
 * follow rounds, compactions or tier moves to keep the index true.
 */

#include <stdbool.h>
#include <stdint.h>

#include "idmap.h"

#define PREFIX_KEY_BYTES 32

struct seq;

/* One published block: an entry of the index, chained with the others whose ids collide
 * (ids are 64 bits of the key mixed with the namespace; the full key is compared). */
struct prefix_ref {
	struct seq *seq;
	uint32_t block;
	struct prefix_ref *next;
};

struct prefix_index {
	struct idmap map;             /* id -> the first prefix_ref of its chain */
};

/* A sequence's keys: given at its open, published up to `published`; refs[b] is block b's
 * entry once published. */
struct prefix_keys {
	uint8_t (*keys)[PREFIX_KEY_BYTES];
	struct prefix_ref *refs;
	uint32_t n, published;
	struct prefix_index *index;   /* where refs are (NULL before the first publish) */
};

/* Bytes of daemon memory the keys of n blocks take (counted in the sequence's metadata). */
uint64_t prefix_keys_bytes(uint32_t n);

/* Gives s the n keys at keys (copied); none published. Returns 0, -ENOMEM. */
int prefix_keys_set(struct seq *s, const uint8_t (*keys)[PREFIX_KEY_BYTES], uint32_t n);

/* Adds s's blocks [published, blocks) to the index. Returns 0, or -EINVAL (blocks past the
 * keys or past a block s holds whole in every table), -ENOMEM (nothing added). */
int prefix_publish(struct prefix_index *x, struct seq *s, uint32_t blocks);

/* Drops s's keys of blocks `from` onwards (from the index too): a truncate rewrote them,
 * or the sequence goes (from 0, which frees the keys). */
void prefix_forget(struct seq *s, uint32_t from);

/* Whether every table of s holds block b whole, at positions b * block_tokens onwards,
 * untouched by eviction. */
bool prefix_block_intact(const struct seq *s, uint32_t b);

/* A sequence that published key as its block b and can share it now with asker (same
 * tenant, model identity and device; resident, not moving, the block intact), or NULL. */
struct seq *prefix_find(const struct prefix_index *x, const struct seq *asker, uint32_t b,
                        const uint8_t key[PREFIX_KEY_BYTES]);

void prefix_index_done(struct prefix_index *x);
