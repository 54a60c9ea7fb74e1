/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "common/layout.h"
#include "prefix.h"
#include "seq.h"

uint64_t prefix_keys_bytes(uint32_t n) {
	return (uint64_t)n * (PREFIX_KEY_BYTES + sizeof(struct prefix_ref));
}

/* FNV-1a over n bytes, from h. */
static uint64_t fnv(uint64_t h, const void *p, size_t n) {
	const unsigned char *b = p;

	for (size_t i = 0; i < n; i++)
		h = (h ^ b[i]) * UINT64_C(0x100000001b3);
	return h;
}

/* The namespace of s's keys: its tenant and its model's identity (model_same_kv). */
static uint64_t namespace_of(const struct seq *s) {
	const struct model *m = s->model;
	uint32_t shape[] = { m->layers, m->kv_heads, m->head_dim, m->dtype, m->block_tokens,
	                     m->layout, m->index_heads, m->index_dim };
	uint64_t h = UINT64_C(0xcbf29ce484222325);

	h = fnv(h, &s->tenant, sizeof(s->tenant));
	h = fnv(h, m->name, strlen(m->name));
	return fnv(h, shape, sizeof(shape));
}

/* The index id of key in s's namespace: keys are SHA-256 outputs, so 8 of their bytes are
 * as good as any hash of them. */
static uint64_t key_id(const struct seq *s, const uint8_t key[PREFIX_KEY_BYTES]) {
	uint64_t k, id;

	memcpy(&k, key, sizeof(k));
	id = k ^ namespace_of(s);
	return id ? id : 1;
}

int prefix_keys_set(struct seq *s, const uint8_t (*keys)[PREFIX_KEY_BYTES], uint32_t n) {
	struct prefix_keys *pk = &s->prefix;

	if (n == 0)
		return 0;
	pk->keys = malloc((size_t)n * PREFIX_KEY_BYTES);
	pk->refs = calloc(n, sizeof(*pk->refs));
	if (!pk->keys || !pk->refs) {
		free(pk->keys);
		free(pk->refs);
		*pk = (struct prefix_keys){};
		return -ENOMEM;
	}
	memcpy(pk->keys, keys, (size_t)n * PREFIX_KEY_BYTES);
	pk->n = n;
	pk->published = 0;
	return 0;
}

bool prefix_block_intact(const struct seq *s, uint32_t b) {
	const struct kvd_seq_desc *d = s->desc;
	uint32_t last = (b + 1) * d->block_tokens - 1;

	/* Each table's slots hold distinct positions in rising order: the slot `last` holding
	 * position `last` means every slot up to it holds its own position. */
	for (uint32_t t = 0; t < d->n_tables; t++)
		if (layout_tokens(d)[t] <= last || layout_positions(d, t)[last] != last)
			return false;
	return true;
}

/* Takes block b's entry out of its chain. */
static void unlink_ref(struct seq *s, uint32_t b) {
	struct prefix_keys *pk = &s->prefix;
	uint64_t id = key_id(s, pk->keys[b]);
	struct prefix_ref *head = idmap_get(&pk->index->map, id), **p = &head;

	while (*p && *p != &pk->refs[b])
		p = &(*p)->next;
	if (!*p)
		return;
	*p = pk->refs[b].next;
	/* Replacing an id the map holds never allocates. */
	if (head)
		(void)idmap_put(&pk->index->map, id, head);
	else
		idmap_del(&pk->index->map, id);
}

/* Takes the entries of blocks [from, to) out of the index. */
static void unlink_range(struct seq *s, uint32_t from, uint32_t to) {
	struct prefix_keys *pk = &s->prefix;

	for (uint32_t b = from; pk->index && b < to; b++)
		if (pk->refs[b].seq) {
			unlink_ref(s, b);
			pk->refs[b] = (struct prefix_ref){};
		}
}

int prefix_publish(struct prefix_index *x, struct seq *s, uint32_t blocks) {
	struct prefix_keys *pk = &s->prefix;
	uint32_t b;
	int r;

	if (blocks > pk->n)
		return -EINVAL;
	for (b = pk->published; b < blocks; b++)
		if (!prefix_block_intact(s, b))
			return -EINVAL;
	pk->index = x;
	for (b = pk->published; b < blocks; b++) {
		uint64_t id = key_id(s, pk->keys[b]);
		struct prefix_ref *ref = &pk->refs[b];

		*ref = (struct prefix_ref){ .seq = s, .block = b, .next = idmap_get(&x->map, id) };
		r = idmap_put(&x->map, id, ref);
		if (r < 0) {
			/* Nothing of this call stays. */
			*ref = (struct prefix_ref){};
			unlink_range(s, pk->published, b);
			return r;
		}
	}
	pk->published = MAX(pk->published, blocks);
	return 0;
}

void prefix_forget(struct seq *s, uint32_t from) {
	struct prefix_keys *pk = &s->prefix;

	unlink_range(s, from, pk->n);
	pk->n = MIN(pk->n, from);
	pk->published = MIN(pk->published, from);
	if (pk->n == 0) {
		free(pk->keys);
		free(pk->refs);
		*pk = (struct prefix_keys){};
	}
}

struct seq *prefix_find(const struct prefix_index *x, const struct seq *asker, uint32_t b,
                        const uint8_t key[PREFIX_KEY_BYTES]) {
	for (const struct prefix_ref *ref = idmap_get(&x->map, key_id(asker, key)); ref;
	     ref = ref->next) {
		struct seq *q = ref->seq;

		if (ref->block != b || q == asker || q->tenant != asker->tenant ||
		    q->device != asker->device || !model_same_kv(q->model, asker->model) ||
		    memcmp(q->prefix.keys[b], key, PREFIX_KEY_BYTES) != 0)
			continue;
		/* Its blocks must be in the pool and stay put while shared: not in a tier, not
		 * moving, not traded by a recall; nor a sequence a restart kept that no
		 * connection has claimed. */
		if (q->conn_id == 0 || q->tiered || q->move || q->recalling)
			continue;
		if (prefix_block_intact(q, b))
			return q;
	}
	return NULL;
}

void prefix_index_done(struct prefix_index *x) {
	idmap_done(&x->map);
}
