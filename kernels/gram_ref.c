/* SPDX-License-Identifier: MIT */
/* The reference Gram blocks: the defining sum, in double. */
#include <errno.h>

#include "dtype.h"
#include "gram.h"

int kvd_wo_check(const struct kvd_wo *wo) {
	if (!wo || !wo->w || kvd_dtype_size(wo->dtype) == 0 || wo->c_out == 0 || wo->heads == 0 ||
	    wo->dim == 0 || wo->row_stride < (size_t)wo->heads * wo->dim)
		return -EINVAL;
	return 0;
}

int kvd_gram_ref(const struct kvd_wo *wo, uint32_t h0, uint32_t nh, float *g) {
	uint32_t d, n;
	size_t es;

	if (kvd_wo_check(wo) < 0 || !g || nh == 0 || h0 >= wo->heads || nh > wo->heads - h0)
		return -EINVAL;
	d = wo->dim, n = nh * d, es = kvd_dtype_size(wo->dtype);
	for (uint32_t a = 0; a < n; a++)
		for (uint32_t b = 0; b < n; b++) {
			double s = 0;

			for (uint32_t c = 0; c < wo->c_out; c++) {
				const char *row = (const char *)wo->w + c * wo->row_stride * es;

				s += (double)kvd_load(row, wo->dtype, (size_t)h0 * d + a) *
				     kvd_load(row, wo->dtype, (size_t)h0 * d + b);
			}
			g[(size_t)a * n + b] = (float)s;
		}
	return 0;
}
