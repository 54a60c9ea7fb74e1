/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdlib.h>

#include "idmap.h"

/* Ids are counters: a multiplicative hash spreads consecutive ones over the table. */
static size_t slot(const struct idmap *m, uint64_t id) {
	return (size_t)((id * UINT64_C(0x9e3779b97f4a7c15)) >> 32) & (m->cap - 1);
}

void *idmap_get(const struct idmap *m, uint64_t id) {
	if (m->cap == 0 || id == 0)
		return NULL;
	for (size_t i = slot(m, id);; i = (i + 1) & (m->cap - 1)) {
		if (m->keys[i] == id)
			return m->values[i];
		if (m->keys[i] == 0)
			return NULL;
	}
}

static void place(struct idmap *m, uint64_t id, void *value) {
	size_t i = slot(m, id);

	while (m->keys[i] != 0 && m->keys[i] != id)
		i = (i + 1) & (m->cap - 1);
	if (m->keys[i] == 0)
		m->n++;
	m->keys[i] = id;
	m->values[i] = value;
}

static int grow(struct idmap *m) {
	struct idmap bigger = { .cap = m->cap ? 2 * m->cap : 64 };

	bigger.keys = calloc(bigger.cap, sizeof(*bigger.keys));
	bigger.values = calloc(bigger.cap, sizeof(*bigger.values));
	if (!bigger.keys || !bigger.values) {
		free(bigger.keys);
		free(bigger.values);
		return -ENOMEM;
	}
	for (size_t i = 0; i < m->cap; i++)
		if (m->keys[i] != 0)
			place(&bigger, m->keys[i], m->values[i]);
	idmap_done(m);
	*m = bigger;
	return 0;
}

int idmap_put(struct idmap *m, uint64_t id, void *value) {
	if (id == 0)
		return -EINVAL;
	if (2 * (m->n + 1) > m->cap && !idmap_get(m, id)) {
		int r = grow(m);

		if (r < 0)
			return r;
	}
	place(m, id, value);
	return 0;
}

void idmap_del(struct idmap *m, uint64_t id) {
	size_t i, j;

	if (m->cap == 0 || id == 0)
		return;
	for (i = slot(m, id); m->keys[i] != id; i = (i + 1) & (m->cap - 1))
		if (m->keys[i] == 0)
			return;
	/* Backward shift: each entry after the hole that may move into it does, so that no
	 * probe for it ever crosses an empty slot. */
	for (j = (i + 1) & (m->cap - 1); m->keys[j] != 0; j = (j + 1) & (m->cap - 1)) {
		size_t home = slot(m, m->keys[j]);

		/* j's entry stays where its home lies cyclically in (i, j]. */
		if (i <= j ? (home > i && home <= j) : (home > i || home <= j))
			continue;
		m->keys[i] = m->keys[j];
		m->values[i] = m->values[j];
		i = j;
	}
	m->keys[i] = 0;
	m->values[i] = NULL;
	m->n--;
}

void idmap_done(struct idmap *m) {
	free(m->keys);
	free(m->values);
	*m = (struct idmap){};
}
