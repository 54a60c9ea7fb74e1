/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * A map from non-zero 64-bit ids to pointers: the daemon's registry of connections and of
 * sequences by id (server.h), found in constant time instead of by walking their lists.
 * Open addressing with linear probing, at most half full, grown by doubling; a removal
 * shifts the entries after it back (no tombstones), so lookups stay short however long
 * the daemon runs.
 */

#include <stddef.h>
#include <stdint.h>

struct idmap {
	uint64_t *keys;               /* 0: empty */
	void **values;
	size_t cap;                   /* a power of two, or 0 before the first put */
	size_t n;
};

/* The value of id, or NULL. */
void *idmap_get(const struct idmap *m, uint64_t id);
/* Adds or replaces id (not 0). Returns 0 or -ENOMEM (the map unchanged). */
int idmap_put(struct idmap *m, uint64_t id, void *value);
/* Removes id, if there. */
void idmap_del(struct idmap *m, uint64_t id);
void idmap_done(struct idmap *m);
