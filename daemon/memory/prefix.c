/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "basic/size.h"
#include "common/layout.h"
#include "prefix.h"
#include "seq.h"
#include "tenant.h"

uint64_t prefix_keys_bytes(uint32_t n, uint32_t block_tokens) {
	return (uint64_t)n * (PREFIX_KEY_BYTES + sizeof(struct prefix_ref) +
	                      (uint64_t)block_tokens * sizeof(uint32_t));
}

/* FNV-1a over n bytes, from h. */
static uint64_t fnv(uint64_t h, const void *p, size_t n) {
	const unsigned char *b = p;

	for (size_t i = 0; i < n; i++)
		h = (h ^ b[i]) * UINT64_C(0x100000001b3);
	return h;
}

/* The namespace of w's keys: its tenant and its model's identity (model_same_kv). */
static uint64_t namespace_of(const struct prefix_who *w) {
	const struct model *m = w->model;
	uint32_t shape[] = { m->layers, m->kv_heads, m->head_dim, m->dtype, m->block_tokens,
	                     m->layout, m->index_heads, m->index_dim };
	uint64_t h = UINT64_C(0xcbf29ce484222325);

	h = fnv(h, &w->tenant, sizeof(w->tenant));
	h = fnv(h, m->name, strlen(m->name));
	return fnv(h, shape, sizeof(shape));
}

/* The index id of key in w's namespace: keys are SHA-256 outputs, so 8 of their bytes are
 * as good as any hash of them. */
static uint64_t key_id(const struct prefix_who *w, const uint8_t key[PREFIX_KEY_BYTES]) {
	uint64_t k, id;

	memcpy(&k, key, sizeof(k));
	id = k ^ w->ns;
	return id ? id : 1;
}

void prefix_who_init(struct prefix_who *w) {
	w->ns = namespace_of(w);
}

struct prefix_who prefix_who_of(const struct seq *s) {
	struct prefix_who w = { .tenant = s->tenant, .model = s->model, .device = s->device,
		                .self = s };

	prefix_who_init(&w);
	return w;
}

int prefix_keys_set(struct seq *s, const uint8_t (*keys)[PREFIX_KEY_BYTES], const uint32_t *tokens,
                    uint32_t n) {
	struct prefix_keys *pk = &s->prefix;
	size_t n_tokens = (size_t)n * s->model->block_tokens;

	if (n == 0)
		return 0;
	pk->keys = malloc((size_t)n * PREFIX_KEY_BYTES);
	pk->refs = calloc(n, sizeof(*pk->refs));
	pk->tokens = tokens ? malloc(n_tokens * sizeof(*tokens)) : NULL;
	if (!pk->keys || !pk->refs || (tokens && !pk->tokens)) {
		free(pk->keys);
		free(pk->refs);
		free(pk->tokens);
		*pk = (struct prefix_keys){};
		return -ENOMEM;
	}
	memcpy(pk->keys, keys, (size_t)n * PREFIX_KEY_BYTES);
	if (tokens)
		memcpy(pk->tokens, tokens, n_tokens * sizeof(*tokens));
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

/* Whether namespace ns holds key as block b: a sequence's entry or a cached block. */
static bool present(const struct prefix_index *x, uint64_t id, uint64_t ns, uint32_t b,
                    const uint8_t key[PREFIX_KEY_BYTES]) {
	for (const struct prefix_ref *ref = idmap_get(&x->map, id); ref; ref = ref->next)
		if (ref->block == b && memcmp(ref->seq->prefix.keys[b], key, PREFIX_KEY_BYTES) == 0 &&
		    prefix_who_of(ref->seq).ns == ns)
			return true;
	for (const struct prefix_cached *e = idmap_get(&x->cached, id); e; e = e->next)
		if (e->ns == ns && e->block == b && memcmp(e->key, key, PREFIX_KEY_BYTES) == 0)
			return true;
	return false;
}

static void notify_removed(const struct prefix_index *x, uint64_t id, uint64_t ns, uint32_t b,
                           const uint8_t key[PREFIX_KEY_BYTES]) {
	if (x->notify && !present(x, id, ns, b, key))
		x->notify(x->userdata, false, key, NULL, NULL, 0, 0);
}

/* Takes block b's entry out of its chain. */
static void unlink_ref(struct seq *s, uint32_t b) {
	struct prefix_keys *pk = &s->prefix;
	struct prefix_who who = prefix_who_of(s);
	uint64_t id = key_id(&who, pk->keys[b]);
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
	notify_removed(pk->index, id, who.ns, b, pk->keys[b]);
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
	struct prefix_who who = prefix_who_of(s);
	uint32_t b;
	int r;

	if (blocks > pk->n)
		return -EINVAL;
	for (b = pk->published; b < blocks; b++)
		if (!prefix_block_intact(s, b))
			return -EINVAL;
	pk->index = x;
	for (b = pk->published; b < blocks; b++) {
		uint64_t id = key_id(&who, pk->keys[b]);
		struct prefix_ref *ref = &pk->refs[b];

		bool known = x->notify && present(x, id, who.ns, b, pk->keys[b]);

		*ref = (struct prefix_ref){ .seq = s, .block = b, .next = idmap_get(&x->map, id) };
		r = idmap_put(&x->map, id, ref);
		if (r < 0) {
			/* Nothing of this call stays. */
			*ref = (struct prefix_ref){};
			unlink_range(s, pk->published, b);
			return r;
		}
		if (x->notify && !known) {
			uint32_t bt = s->model->block_tokens;

			x->notify(x->userdata, true, pk->keys[b], b > 0 ? pk->keys[b - 1] : NULL,
			          pk->tokens ? pk->tokens + (size_t)b * bt : NULL, pk->tokens ? bt : 0, bt);
		}
	}
	pk->published = MAX(pk->published, blocks);
	return 0;
}

void prefix_recheck(struct seq *s) {
	struct prefix_keys *pk = &s->prefix;
	uint32_t b = 0;

	while (b < pk->published && prefix_block_intact(s, b))
		b++;
	unlink_range(s, b, pk->published);
	pk->published = MIN(pk->published, b);
}

void prefix_forget(struct seq *s, uint32_t from) {
	struct prefix_keys *pk = &s->prefix;

	unlink_range(s, from, pk->n);
	pk->n = MIN(pk->n, from);
	pk->published = MIN(pk->published, from);
	if (pk->n == 0) {
		free(pk->keys);
		free(pk->refs);
		free(pk->tokens);
		*pk = (struct prefix_keys){};
	}
}

/* A sequence of x that holds key as its block b for asker to share, or NULL. */
static struct seq *find_seq(const struct prefix_index *x, const struct prefix_who *asker,
                            uint32_t b, const uint8_t key[PREFIX_KEY_BYTES]) {
	for (const struct prefix_ref *ref = idmap_get(&x->map, key_id(asker, key)); ref;
	     ref = ref->next) {
		struct seq *q = ref->seq;

		if (ref->block != b || q == asker->self || q->tenant != asker->tenant ||
		    q->device != asker->device || !model_same_kv(q->model, asker->model) ||
		    memcmp(q->prefix.keys[b], key, PREFIX_KEY_BYTES) != 0)
			continue;
		/* Its blocks must be in the pool and stay put while shared: not in a tier, not
		 * moving, not traded by a recall; nor a sequence a restart kept that no
		 * connection has claimed. */
		if (q->conn_id == 0 || q->tiered || q->move || q->recalling)
			continue;
		return q;
	}
	return NULL;
}

/* The cached block of key as block b in asker's namespace, or NULL. */
static struct prefix_cached *find_cached(const struct prefix_index *x,
                                         const struct prefix_who *asker, uint32_t b,
                                         const uint8_t key[PREFIX_KEY_BYTES]) {
	for (struct prefix_cached *e = idmap_get(&x->cached, key_id(asker, key)); e; e = e->next)
		if (e->ns == asker->ns && e->tenant == asker->tenant && e->block == b &&
		    e->device == asker->device && e->n_tables == asker->model->n_tables &&
		    memcmp(e->key, key, PREFIX_KEY_BYTES) == 0)
			return e;
	return NULL;
}

/* Recency list. */
static void lru_unlink(struct prefix_index *x, struct prefix_cached *e) {
	*(e->older ? &e->older->newer : &x->oldest) = e->newer;
	*(e->newer ? &e->newer->older : &x->newest) = e->older;
	e->older = e->newer = NULL;
}

static void lru_push(struct prefix_index *x, struct prefix_cached *e) {
	e->older = x->newest;
	e->newer = NULL;
	*(x->newest ? &x->newest->newer : &x->oldest) = e;
	x->newest = e;
}

bool prefix_find(const struct prefix_index *x, const struct prefix_who *asker, uint32_t b,
                 const uint8_t key[PREFIX_KEY_BYTES], const struct prefix_hit *prev,
                 struct prefix_hit *ret) {
	const struct seq *q = prev ? prev->seq : NULL;

	/* The sequence that held block b - 1 passed every check but the block's own. */
	if (q && b < q->prefix.published && memcmp(q->prefix.keys[b], key, PREFIX_KEY_BYTES) == 0) {
		*ret = (struct prefix_hit){ .seq = prev->seq };
		return true;
	}
	*ret = (struct prefix_hit){ .seq = find_seq(x, asker, b, key) };
	if (!ret->seq)
		ret->cached = find_cached(x, asker, b, key);
	return ret->seq || ret->cached;
}

void prefix_used(struct prefix_index *x, const struct prefix_hit *h) {
	if (!h->cached)
		return;
	h->cached->hits++;
	lru_unlink(x, h->cached);
	lru_push(x, h->cached);
}

struct kvd_block_ref prefix_hit_ref(const struct prefix_hit *h, uint32_t t, uint32_t b) {
	return h->seq ? layout_blocks(h->seq->desc, t)[b] : h->cached->refs[t];
}

/* Drops cached entry e: its holds go (blocks left with no holder are freed, chunks
 * emptied into *emptied). */
static void cached_drop(struct prefix_index *x, struct pool *p, struct prefix_cached *e,
                        struct seq_emptied *emptied) {
	struct prefix_cached *head = idmap_get(&x->cached, e->id), **pp = &head;

	while (*pp && *pp != e)
		pp = &(*pp)->next;
	if (*pp)
		*pp = e->next;
	if (head)
		(void)idmap_put(&x->cached, e->id, head);
	else
		idmap_del(&x->cached, e->id);
	lru_unlink(x, e);
	notify_removed(x, e->id, e->ns, e->block, e->key);
	seq_blocks_free(p, e->refs, e->n_tables, emptied);
	x->cached_bytes -= e->bytes;
	x->cached_blocks--;
	x->dropped++;
	e->tenant->cached_bytes -= e->bytes;
	free(e);
}

uint64_t prefix_shed(struct prefix_index *x, struct pool *p, const struct tenant *t,
                     uint64_t bytes, struct seq_emptied *emptied) {
	uint64_t done = 0;

	for (struct prefix_cached *e = x->oldest, *newer; e && (bytes == 0 || done < bytes); e = newer) {
		newer = e->newer;
		if (t && e->tenant != t)
			continue;
		done += e->bytes;
		cached_drop(x, p, e, emptied);
	}
	return done;
}

/* Whether s is the last holder of every table's block b. */
static bool held_last(const struct seq *s, const struct pool *p, uint32_t b) {
	for (uint32_t t = 0; t < s->desc->n_tables; t++)
		if (pool_block_shared(p, layout_blocks(s->desc, t)[b]))
			return false;
	return true;
}

void prefix_retire(struct prefix_index *x, struct seq *s, struct pool *p,
                   struct seq_emptied *emptied) {
	const struct prefix_keys *pk = &s->prefix;
	struct prefix_who who = prefix_who_of(s);
	uint32_t n_tables = s->desc->n_tables;
	uint64_t cap = size_percent(p->budget_bytes, x->max_percent);
	uint64_t bytes = (uint64_t)n_tables * s->model->block_bytes;

	/* Kept sequences leave for the keeper, not for good; moved ones hold no blocks. */
	if (pk->published == 0 || bytes > cap || s->tiered || s->move)
		return;
	/* The last block first, so that it is the older: a chain loses its tail before its
	 * head, without which the tail is never found. */
	for (uint32_t b = pk->published; b-- > 0;) {
		struct prefix_cached *e;
		uint32_t t;

		if (!prefix_block_intact(s, b) || !held_last(s, p, b) ||
		    find_cached(x, &who, b, pk->keys[b]))
			continue;
		if (s->tenant->cached_bytes + bytes > cap)
			prefix_shed(x, p, s->tenant, s->tenant->cached_bytes + bytes - cap, emptied);
		e = calloc(1, sizeof(*e) + n_tables * sizeof(e->refs[0]));
		if (!e)
			return;
		for (t = 0; t < n_tables; t++) {
			e->refs[t] = layout_blocks(s->desc, t)[b];
			/* The cache's own hold: s's free then lets go of s's alone. */
			if (pool_block_share(p, e->refs[t]) < 0)
				break;
		}
		if (t < n_tables) {
			while (t-- > 0)
				pool_block_free(p, pool_chunk(p, e->refs[t].chunk_id), e->refs[t].index);
			free(e);
			return;
		}
		e->id = key_id(&who, pk->keys[b]);
		e->ns = who.ns;
		memcpy(e->key, pk->keys[b], PREFIX_KEY_BYTES);
		e->tenant = s->tenant;
		e->device = s->device;
		e->block = b;
		e->n_tables = n_tables;
		e->bytes = bytes;
		e->next = idmap_get(&x->cached, e->id);
		if (idmap_put(&x->cached, e->id, e) < 0) {
			seq_blocks_free(p, e->refs, n_tables, emptied);
			free(e);
			return;
		}
		lru_push(x, e);
		x->cached_bytes += bytes;
		x->cached_blocks++;
		s->tenant->cached_bytes += bytes;
	}
}

void prefix_index_done(struct prefix_index *x) {
	/* The pool goes with the daemon: only the entries are freed. */
	for (struct prefix_cached *e = x->oldest, *newer; e; e = newer) {
		newer = e->newer;
		free(e);
	}
	idmap_done(&x->map);
	idmap_done(&x->cached);
}
