/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/layout.h"
#include "basic/macro.h"
#include "gram.h"
#include "memfd.h"
#include "observe.h"

int obs_new(const struct model *m, uint64_t seq_id, struct obs **ret, int *ret_fd) {
	_cleanup_(closep) int fd = -EBADF;
	struct kvd_obs_header geo;
	uint64_t bytes = model_obs_bytes(m->layers, m->q_heads, m->window, m->head_dim, m->dtype,
	                                 m->index_heads, m->index_dim, &geo);
	void *map;
	struct obs *o;
	char name[40];
	int r;

	snprintf(name, sizeof(name), "kvd-obs-%llu", (unsigned long long)seq_id);
	/* The client writes queries into it. */
	r = memfd_sealed(name, bytes, 0, &fd, &map);
	if (r < 0)
		return r;
	/* Writable only to write the header once; the daemon reads it through this mapping. */
	memcpy(map, &geo, sizeof(geo));
	if (mprotect(map, bytes, PROT_READ) < 0) {
		r = negative_errno();
		munmap(map, bytes);
		return r;
	}
	o = calloc(1, sizeof(*o));
	if (!o) {
		munmap(map, bytes);
		return -ENOMEM;
	}
	o->refs = 1;
	o->map = map;
	o->geo = geo;
	*ret = o;
	*ret_fd = TAKE_FD(fd);
	return 0;
}

struct obs *obs_ref(struct obs *o) {
	if (o)
		__atomic_add_fetch(&o->refs, 1, __ATOMIC_RELAXED);
	return o;
}

struct obs *obs_unref(struct obs *o) {
	if (o && __atomic_sub_fetch(&o->refs, 1, __ATOMIC_ACQ_REL) == 0) {
		munmap(o->map, o->geo.total_bytes);
		free(o);
	}
	return NULL;
}

uint64_t obs_stamp(const struct obs *o, uint32_t l) {
	const uint64_t *stamps = (const uint64_t *)((const char *)o->map + o->geo.stamps_offset);

	return __atomic_load_n(&stamps[l], __ATOMIC_ACQUIRE);
}

const void *obs_queries(const struct obs *o, uint32_t l) {
	return (const char *)o->map + o->geo.q_offset + (uint64_t)l * o->geo.layer_bytes;
}

const void *obs_index_queries(const struct obs *o, uint32_t l) {
	return (const char *)o->map + o->geo.iq_offset + (uint64_t)l * o->geo.iq_layer_bytes;
}

struct gram_layer *gram_layer_ref(struct gram_layer *g) {
	if (g)
		__atomic_add_fetch(&g->refs, 1, __ATOMIC_RELAXED);
	return g;
}

struct gram_layer *gram_layer_unref(struct gram_layer *g) {
	if (g && __atomic_sub_fetch(&g->refs, 1, __ATOMIC_ACQ_REL) == 0)
		free(g);
	return NULL;
}

int grams_check(const struct model *m, uint32_t layer, int fd, uint32_t dtype, uint32_t hidden,
                struct wo_map *ret, const char **ret_why) {
	uint64_t per_layer = (uint64_t)m->q_heads * m->head_dim * m->head_dim, bytes;
	struct stat st;
	void *map;
	int seals;

	if (layer >= m->layers) {
		*ret_why = "layer out of range";
		return -EINVAL;
	}
	if (layout_dtype_bytes(dtype) == 0) {
		*ret_why = "unknown dtype";
		return -EINVAL;
	}
	if (hidden < 1 || hidden > 65536) {
		*ret_why = "hidden must be 1..65536";
		return -EINVAL;
	}
	if (per_layer * 4 * m->layers > GRAMS_MODEL_MAX) {
		*ret_why = "the model's Gram matrices would exceed the daemon's limit";
		return -EFBIG;
	}
	/* Without the write seal the client could change W_o while we read it; without the
	 * others, truncate it under our mapping (SIGBUS). */
	seals = fcntl(fd, F_GET_SEALS);
	if (seals < 0 || (seals & (F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW)) !=
	                         (F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW)) {
		*ret_why = "the output projection must come in a memfd sealed against writing and resizing";
		return -EINVAL;
	}
	bytes = (uint64_t)hidden * m->q_heads * m->head_dim * layout_dtype_bytes(dtype);
	if (fstat(fd, &st) < 0)
		return negative_errno();
	if ((uint64_t)st.st_size != bytes) {
		*ret_why = "the memfd's size is not hidden x q_heads x head_dim elements";
		return -EINVAL;
	}
	map = mmap(NULL, bytes, PROT_READ, MAP_SHARED, fd, 0);
	if (map == MAP_FAILED)
		return negative_errno();
	*ret = (struct wo_map){
		.map = map,
		.bytes = bytes,
		.dtype = dtype,
		.hidden = hidden,
		.q_heads = m->q_heads,
		.head_dim = m->head_dim,
	};
	return 0;
}

int gram_layer_compute(const struct wo_map *wo, struct gram_layer **ret) {
	uint64_t dd = (uint64_t)wo->head_dim * wo->head_dim, per_layer = wo->q_heads * dd;
	struct gram_layer *g;
	int r = 0;

	g = malloc(sizeof(*g) + per_layer * sizeof(float));
	if (!g)
		return -ENOMEM;
	g->refs = 1;
	g->floats = per_layer;
	for (uint32_t h = 0; h < wo->q_heads && r >= 0; h++) {
		struct kvd_wo v = {
			.dtype = wo->dtype,
			.c_out = wo->hidden,
			.heads = wo->q_heads,
			.dim = wo->head_dim,
			.w = wo->map,
			.row_stride = (size_t)wo->q_heads * wo->head_dim,
		};

		r = kvd_gram(&v, h, 1, g->g + h * dd);
	}
	if (r < 0) {
		free(g);
		return r;
	}
	*ret = g;
	return 0;
}

void wo_map_done(struct wo_map *wo) {
	if (wo->map)
		munmap(wo->map, wo->bytes);
	wo->map = NULL;
}

int grams_install(struct model *m, uint32_t layer, struct gram_layer *g) {
	if (!m->grams) {
		m->grams = calloc(1, sizeof(*m->grams));
		if (!m->grams)
			return -ENOMEM;
		m->grams->layers = m->layers;
		m->grams->layer = calloc(m->layers, sizeof(*m->grams->layer));
		if (!m->grams->layer) {
			free(m->grams);
			m->grams = NULL;
			return -ENOMEM;
		}
	}
	gram_layer_unref(m->grams->layer[layer]);
	m->grams->layer[layer] = g;
	return 0;
}

void grams_free(struct model *m) {
	if (!m->grams)
		return;
	for (uint32_t l = 0; l < m->grams->layers; l++)
		gram_layer_unref(m->grams->layer[l]);
	free(m->grams->layer);
	free(m->grams);
	m->grams = NULL;
}
