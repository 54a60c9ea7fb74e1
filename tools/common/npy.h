/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * numpy .npy files: how tensors get into and out of the tools (kvdctl score, tests, golden
 * vectors). The reader takes format versions 1.0, 2.0 and 3.0, little-endian C-order arrays
 * of the dtypes below, and nothing else; the caller says which dtypes and how many
 * dimensions it accepts, and every refusal comes with a message naming the file and what
 * is wrong ("k.npy: expected 3 dimensions, got 2") for the caller to print.
 *
 * Who accepts what:
 *   - q, k, v and wo of kvdctl score: float32 or float16 (KVD_NPY_ACCEPT_FLOAT). numpy has
 *     no bfloat16, so bf16 tensors travel as float32;
 *   - index and position arrays (kept sets, token positions, golden files): int64 or
 *     int32 (KVD_NPY_ACCEPT_INT).
 *
 * Bounds: headers over KVD_NPY_HEADER_MAX bytes, more than KVD_NPY_MAX_DIMS dimensions,
 * shapes whose byte size overflows, and files whose size is not exactly header + data are
 * refused. The parser reads only inside the buffer it is given and keeps no global state,
 * so it can be fuzzed on kvd_npy_parse() directly.
 */

#include <stddef.h>
#include <stdint.h>

#define KVD_NPY_MAX_DIMS 16
#define KVD_NPY_HEADER_MAX (64 * 1024)
/* Room for any message of this module, the caller's file name included up to 256 bytes. */
#define KVD_NPY_ERROR_MAX 512

/* Element types. F16 and F32 have the numbers of KVD_DTYPE_F16 and KVD_DTYPE_F32 (kvd-abi.h). */
enum {
	KVD_NPY_F16 = 1, /* '<f2' */
	KVD_NPY_F32 = 3, /* '<f4' */
	KVD_NPY_I32 = 8, /* '<i4' */
	KVD_NPY_I64 = 9, /* '<i8' */
};

/* Masks of accepted dtypes, for the accept arguments. */
#define KVD_NPY_ACCEPT(dtype) (1u << (dtype))
#define KVD_NPY_ACCEPT_FLOAT (KVD_NPY_ACCEPT(KVD_NPY_F32) | KVD_NPY_ACCEPT(KVD_NPY_F16))
#define KVD_NPY_ACCEPT_INT (KVD_NPY_ACCEPT(KVD_NPY_I64) | KVD_NPY_ACCEPT(KVD_NPY_I32))

/* Any number of dimensions, for the ndim arguments. */
#define KVD_NPY_ANY_NDIM (-1)

struct kvd_npy {
	uint32_t dtype;                     /* KVD_NPY_* */
	uint32_t ndim;                      /* 0 for a scalar */
	uint64_t shape[KVD_NPY_MAX_DIMS];   /* [ndim] */
	uint64_t count;                     /* elements: the product of shape */
	size_t elem_size;                   /* bytes per element */
	size_t data_bytes;                  /* count * elem_size */
	const void *data;                   /* C order, little-endian */
	/* Private: what kvd_npy_close() releases. */
	void *map_;
	size_t map_len_;
	void *copy_;
};

/*
 * Parses the .npy image buf[len] (header and data), named name in messages. On success
 * ret describes it and ret->data points into buf (aligned only as buf + header is; the
 * array needs no kvd_npy_close() but buf must outlive it). accept is a mask of
 * KVD_NPY_ACCEPT(); ndim the required number of dimensions, or KVD_NPY_ANY_NDIM.
 *
 * Returns 0, or -errno with a message in err[errlen] (err may be NULL), *ret zeroed:
 *   -EBADMSG     not a .npy file, malformed header, truncated, or bytes after the data;
 *   -EOPNOTSUPP  format version, dtype (not accepted, unknown or big-endian) or
 *                fortran_order True;
 *   -EINVAL      not ndim dimensions, or bad arguments;
 *   -E2BIG       header over KVD_NPY_HEADER_MAX, or more than KVD_NPY_MAX_DIMS dimensions;
 *   -EOVERFLOW   the shape's size does not fit in memory sizes.
 */
int kvd_npy_parse(const char *name, const void *buf, size_t len, uint32_t accept, int ndim,
		  struct kvd_npy *ret, char *err, size_t errlen);

/*
 * Opens and maps path, then parses it as kvd_npy_parse() does; ret->data is aligned to
 * the element size (copied if the header leaves it unaligned). Release with
 * kvd_npy_close(). Returns what kvd_npy_parse() returns, or the -errno of open/fstat/mmap
 * (-ENOENT, -EACCES...), -EISDIR or -EINVAL for files that are not regular, -ENOMEM.
 */
int kvd_npy_open(const char *path, uint32_t accept, int ndim, struct kvd_npy *ret, char *err,
		 size_t errlen);

/* Releases what kvd_npy_open() mapped or copied and zeroes a; a zeroed a is fine. */
void kvd_npy_close(struct kvd_npy *a);

/*
 * Writes data (count elements of dtype in C order, count = the product of shape) to path as
 * a version 1.0 .npy file (2.0 if the header needs it), replacing any file there; a failed
 * write removes what it wrote. Any dtype above; float32 and int64 are what the tools use.
 * Returns 0 or -errno with a message: -EINVAL (dtype, ndim), -EOVERFLOW, or the write's.
 */
int kvd_npy_write(const char *path, uint32_t dtype, uint32_t ndim, const uint64_t *shape,
		  const void *data, char *err, size_t errlen);

/* "float32", "float16", "int64", "int32", or NULL for anything else. */
const char *kvd_npy_dtype_name(uint32_t dtype);

/* Formats a's shape as "(8, 4096, 128)" ("(3,)" for one dimension) into buf[n]; returns buf. */
char *kvd_npy_shape_format(const struct kvd_npy *a, char *buf, size_t n);
