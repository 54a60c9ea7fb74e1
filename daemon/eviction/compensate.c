/* SPDX-License-Identifier: MIT */
#include <errno.h>

#include "compensate.h"
#include "indexmem.h"
#include "kvd/kvd-abi.h"
#include "moments.h"

/* A moments fold: the summary's arrays, then its two key bounds (the header's, in a block). */
#define FOLD_BOUNDS 2

size_t compensate_floats(uint32_t compensation, uint32_t d) {
	switch (compensation) {
	case KVD_COMPENSATION_MOMENTS:
		return kvd_moments_floats(d) + FOLD_BOUNDS;
	case KVD_COMPENSATION_LATENT:
		return kvd_latent_floats(d);
	default:
		return 0;
	}
}

int compensate_batch(uint32_t compensation, const void *k, const void *v, uint32_t dtype,
                     uint32_t n, uint32_t d, float *fold) {
	struct kvd_moments m;
	struct kvd_latent l;
	float *bounds = fold + kvd_moments_floats(d); /* moments only: see FOLD_BOUNDS */
	int r;

	/* The kernels' dtype numbers are the wire's (dtype.h). */
	switch (compensation) {
	case KVD_COMPENSATION_MOMENTS:
		kvd_moments_view(&m, d, fold);
		r = kvd_moments_batch(k, d, v, d, dtype, n, &m);
		bounds[0] = m.key_norm_max, bounds[1] = m.key_radius;
		return r;
	case KVD_COMPENSATION_LATENT:
		kvd_latent_view(&l, d, fold);
		return kvd_latent_batch(k, d, v, d, dtype, n, &l);
	default:
		return -EINVAL;
	}
}

int compensate_merge(uint32_t compensation, void *block, uint32_t d, const float *fold, uint64_t n) {
	struct kvd_moments_header *h = block;
	struct kvd_latent_header *lh = block;
	const float *bounds = fold + kvd_moments_floats(d);
	struct kvd_moments ma, mb;
	struct kvd_latent la, lb;
	int r;

	switch (compensation) {
	case KVD_COMPENSATION_MOMENTS:
		kvd_moments_view(&ma, d, (float *)((char *)block + KVD_MOMENTS_HEADER_BYTES));
		kvd_moments_view(&mb, d, (float *)fold);
		ma.count = h->count, mb.count = n;
		ma.key_norm_max = h->key_norm_max, ma.key_radius = h->key_radius;
		mb.key_norm_max = bounds[0], mb.key_radius = bounds[1];
		r = kvd_moments_merge(&ma, &mb);
		if (r == 0) {
			h->count = ma.count;
			h->key_norm_max = ma.key_norm_max, h->key_radius = ma.key_radius;
		}
		return r;
	case KVD_COMPENSATION_LATENT:
		kvd_latent_view(&la, d, (float *)((char *)block + KVD_LATENT_HEADER_BYTES));
		kvd_latent_view(&lb, d, (float *)fold);
		la.count = lh->count, lb.count = n;
		r = kvd_latent_merge(&la, &lb);
		if (r == 0)
			lh->count = la.count;
		return r;
	default:
		return -EINVAL;
	}
}
