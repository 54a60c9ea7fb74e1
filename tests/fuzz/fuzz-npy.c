/* SPDX-License-Identifier: MIT */
/*
 * Fuzz target: the .npy reader. The input is a whole .npy image, parsed with every accept
 * mask and number of dimensions a caller may ask for. Checked: the documented results only;
 * on success the array lies inside the input and matches its header (dtype accepted, ndim
 * as asked, count = product of the shape, data ending exactly at the end of the input) and
 * no message is set; on failure *ret is zeroed and the message is a terminated line naming
 * the input. The shape's formatting is tried with every buffer size up to what it needs.
 */
#include <errno.h>
#include <string.h>

#include "fuzz.h"
#include "npy.h"

static const uint32_t accepts[] = {
	KVD_NPY_ACCEPT_FLOAT,
	KVD_NPY_ACCEPT_INT,
	KVD_NPY_ACCEPT_FLOAT | KVD_NPY_ACCEPT_INT,
	KVD_NPY_ACCEPT(KVD_NPY_F32),
	KVD_NPY_ACCEPT(KVD_NPY_I64),
	0,
	UINT32_MAX,
};

static const int ndims[] = { KVD_NPY_ANY_NDIM, 0, 1, 2, 3, KVD_NPY_MAX_DIMS, KVD_NPY_MAX_DIMS + 1 };

static void check_ok(const struct kvd_npy *a, const uint8_t *data, size_t size, uint32_t accept,
                     int ndim, const char *err) {
	const uint8_t *p = a->data;
	uint64_t count = 1;
	char shape[KVD_NPY_MAX_DIMS * 22 + 4];

	FUZZ_CHECK(err[0] == '\0', "message on success: %s", err);
	FUZZ_CHECK(kvd_npy_dtype_name(a->dtype) != NULL);
	FUZZ_CHECK(accept & KVD_NPY_ACCEPT(a->dtype), "dtype %u not accepted", a->dtype);
	FUZZ_CHECK(ndim < 0 || a->ndim == (uint32_t)ndim);
	FUZZ_CHECK(a->ndim <= KVD_NPY_MAX_DIMS);
	for (uint32_t i = 0; i < a->ndim; i++)
		FUZZ_CHECK(!__builtin_mul_overflow(count, a->shape[i], &count));
	FUZZ_CHECK(count == a->count);
	FUZZ_CHECK(a->elem_size == 2 || a->elem_size == 4 || a->elem_size == 8);
	FUZZ_CHECK(a->data_bytes == a->count * a->elem_size);
	FUZZ_CHECK(p >= data + 10 && p <= data + size);
	FUZZ_CHECK((size_t)(data + size - p) == a->data_bytes, "data does not end the input");
	FUZZ_CHECK(!a->map_ && !a->copy_);

	/* Any buffer size: terminated, never written past n. */
	kvd_npy_shape_format(a, shape, sizeof(shape));
	FUZZ_CHECK(strlen(shape) < sizeof(shape) - 1, "shape text truncated: %s", shape);
	for (size_t n = 0; n <= strlen(shape) + 1; n++) {
		char *small = malloc(n ? n : 1);

		FUZZ_CHECK(small);
		kvd_npy_shape_format(a, small, n);
		if (n > 0) {
			FUZZ_CHECK(strlen(small) < n);
			FUZZ_CHECK(strncmp(small, shape, strlen(small)) == 0);
		}
		free(small);
	}
}

static void check_failed(int r, const struct kvd_npy *a, const char *err) {
	static const struct kvd_npy zero;

	FUZZ_CHECK(r == -EBADMSG || r == -EOPNOTSUPP || r == -EINVAL || r == -E2BIG ||
	           r == -EOVERFLOW, "undocumented result %d (%s)", r, err);
	FUZZ_CHECK(memcmp(a, &zero, sizeof(zero)) == 0, "result not zeroed on failure");
	FUZZ_CHECK(strncmp(err, "fuzz.npy: ", 10) == 0 && strlen(err) > 10, "message: '%s'", err);
	FUZZ_CHECK(strlen(err) < KVD_NPY_ERROR_MAX);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
	for (size_t i = 0; i < sizeof(accepts) / sizeof(accepts[0]); i++)
		for (size_t j = 0; j < sizeof(ndims) / sizeof(ndims[0]); j++) {
			char err[KVD_NPY_ERROR_MAX];
			struct kvd_npy a;
			int r;

			memset(&a, 0xa5, sizeof(a));
			memset(err, 'x', sizeof(err));
			r = kvd_npy_parse("fuzz.npy", data, size, accepts[i], ndims[j], &a, err, sizeof(err));
			if (r == 0)
				check_ok(&a, data, size, accepts[i], ndims[j], err);
			else
				check_failed(r, &a, err);
		}
	/* A short message buffer, and none at all. */
	{
		char err[8];
		struct kvd_npy a;
		int r1, r2;

		memset(err, 'x', sizeof(err));
		r1 = kvd_npy_parse("fuzz.npy", data, size, KVD_NPY_ACCEPT_FLOAT, -1, &a, err, sizeof(err));
		FUZZ_CHECK(memchr(err, '\0', sizeof(err)) != NULL, "short message not terminated");
		r2 = kvd_npy_parse(NULL, data, size, KVD_NPY_ACCEPT_FLOAT, -1, &a, NULL, 0);
		FUZZ_CHECK(r1 == r2, "result depends on the message buffer: %d, %d", r1, r2);
	}
	return 0;
}
