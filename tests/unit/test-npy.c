/* SPDX-License-Identifier: MIT */
/*
 * The .npy reader and writer (tools/common/npy.h) on hand-built files: headers of format
 * versions 1.0, 2.0 and 3.0, shapes with trailing commas, scalars and 0-sized dimensions,
 * and every refusal with its exact message. The files live in a temporary directory that
 * is the working directory, so that messages name them as "k.npy: ...".
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "npy.h"
#include "test.h"

static char tmpdir[] = "/tmp/test-npy-XXXXXX";
static char created[64][64];
static unsigned n_created;

static void cleanup(void) {
	for (unsigned i = 0; i < n_created; i++)
		unlink(created[i]);
	if (chdir("/") == 0)
		rmdir(tmpdir);
}

int test_setup(void) {
	if (!mkdtemp(tmpdir) || chdir(tmpdir) < 0)
		return -errno;
	atexit(cleanup);
	return 0;
}

static void put_file(const char *name, const void *buf, size_t len) {
	FILE *f = fopen(name, "wb");

	ASSERT_NOT_NULL(f);
	ASSERT_EQ(fwrite(buf, 1, len, f), len);
	ASSERT_EQ(fclose(f), 0);
	for (unsigned i = 0; i < n_created; i++)
		if (strcmp(created[i], name) == 0)
			return;
	ASSERT_LT(n_created, 64u);
	snprintf(created[n_created++], sizeof(created[0]), "%s", name);
}

/*
 * A .npy image: version major.0 preamble, the dict, spaces to align the data to `align`
 * bytes (0: no padding at all), a newline, then data_len bytes of data (a counting
 * pattern unless data is given). Returns its length; free(*ret).
 */
static size_t build(unsigned major, const char *dict, size_t align, const void *data,
		    size_t data_len, unsigned char **ret) {
	size_t pre = major == 1 ? 10 : 12, dl = strlen(dict), hdr = pre + dl + 1, pad = 0, hlen;
	unsigned char *b;

	if (align)
		pad = (align - hdr % align) % align;
	hlen = dl + pad + 1;
	b = malloc(pre + hlen + data_len + 1);
	ASSERT_NOT_NULL(b);
	memcpy(b, "\x93NUMPY", 6);
	b[6] = (unsigned char)major;
	b[7] = 0;
	if (major == 1) {
		b[8] = (unsigned char)(hlen & 0xff);
		b[9] = (unsigned char)(hlen >> 8);
	} else {
		for (int i = 0; i < 4; i++)
			b[8 + i] = (unsigned char)(hlen >> (8 * i));
	}
	memcpy(b + pre, dict, dl);
	memset(b + pre + dl, ' ', pad);
	b[pre + dl + pad] = '\n';
	for (size_t i = 0; i < data_len; i++)
		b[pre + hlen + i] = data ? ((const unsigned char *)data)[i] : (unsigned char)i;
	*ret = b;
	return pre + hlen + data_len;
}

/* Writes name from build() and opens it; returns open's result, the message in err. */
static int try_open(const char *name, unsigned major, const char *dict, size_t data_len,
		    uint32_t accept, int ndim, struct kvd_npy *a, char *err) {
	unsigned char *b;
	size_t len = build(major, dict, 64, NULL, data_len, &b);

	put_file(name, b, len);
	free(b);
	return kvd_npy_open(name, accept, ndim, a, err, KVD_NPY_ERROR_MAX);
}

static void expect_error(const char *name, unsigned major, const char *dict, size_t data_len,
			 uint32_t accept, int ndim, int want, const char *message) {
	struct kvd_npy a;
	char err[KVD_NPY_ERROR_MAX];

	ASSERT_ERRNO(try_open(name, major, dict, data_len, accept, ndim, &a, err), want);
	if (message)
		ASSERT_STREQ(err, message);
	else if (strncmp(err, name, strlen(name)) != 0 || strlen(err) < strlen(name) + 10)
		test_fail(__FILE__, __LINE__, "message \"%s\" does not name %s", err, name);
	/* A refusal leaves nothing to release, and close accepts it. */
	ASSERT_NULL(a.data);
	kvd_npy_close(&a);
}

TEST(versions_1_2_3) {
	const char *dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
	char err[KVD_NPY_ERROR_MAX];
	struct kvd_npy a;

	for (unsigned major = 1; major <= 3; major++) {
		const float *f;

		ASSERT_OK(try_open("v.npy", major, dict, 24, KVD_NPY_ACCEPT_FLOAT, 2, &a, err));
		ASSERT_EQ(a.dtype, (uint32_t)KVD_NPY_F32);
		ASSERT_EQ(a.ndim, 2u);
		ASSERT_EQ(a.shape[0], 2u);
		ASSERT_EQ(a.shape[1], 3u);
		ASSERT_EQ(a.count, 6u);
		ASSERT_EQ(a.elem_size, 4u);
		ASSERT_EQ(a.data_bytes, 24u);
		f = a.data;
		ASSERT_EQ((uintptr_t)f % 4, 0u);
		/* The counting pattern, bytes 0..3 little-endian. */
		ASSERT_EQ(memcmp(f, "\x00\x01\x02\x03", 4), 0);
		kvd_npy_close(&a);
		ASSERT_NULL(a.data);
	}
}

TEST(shapes) {
	char err[KVD_NPY_ERROR_MAX], s[64];
	struct kvd_npy a;

	/* Trailing commas, no spaces, double quotes, keys in any order, a Python 2 long. */
	ASSERT_OK(try_open("a.npy", 1, "{'descr':'<i8','fortran_order':False,'shape':(3,)}", 24,
			   KVD_NPY_ACCEPT_INT, 1, &a, err));
	ASSERT_EQ(a.dtype, (uint32_t)KVD_NPY_I64);
	ASSERT_EQ(a.shape[0], 3u);
	ASSERT_STREQ(kvd_npy_shape_format(&a, s, sizeof(s)), "(3,)");
	kvd_npy_close(&a);
	ASSERT_OK(try_open("a.npy", 1, "{\"shape\": (4L, 2, ), \"fortran_order\": False, \"descr\": \"<f2\"}",
			   16, KVD_NPY_ACCEPT_FLOAT, 2, &a, err));
	ASSERT_EQ(a.dtype, (uint32_t)KVD_NPY_F16);
	ASSERT_STREQ(kvd_npy_shape_format(&a, s, sizeof(s)), "(4, 2)");
	kvd_npy_close(&a);
	/* A scalar: no dimensions, one element. */
	ASSERT_OK(try_open("a.npy", 1, "{'descr': '<i4', 'fortran_order': False, 'shape': (), }", 4,
			   KVD_NPY_ACCEPT_INT, 0, &a, err));
	ASSERT_EQ(a.ndim, 0u);
	ASSERT_EQ(a.count, 1u);
	ASSERT_STREQ(kvd_npy_shape_format(&a, s, sizeof(s)), "()");
	kvd_npy_close(&a);
	/* 0-sized dimensions: no data at all, even with a huge other dimension. */
	ASSERT_OK(try_open("a.npy", 1,
			   "{'descr': '<f4', 'fortran_order': False, 'shape': (0, 18446744073709551615), }",
			   0, KVD_NPY_ACCEPT_FLOAT, KVD_NPY_ANY_NDIM, &a, err));
	ASSERT_EQ(a.count, 0u);
	ASSERT_EQ(a.data_bytes, 0u);
	kvd_npy_close(&a);
	ASSERT_OK(try_open("a.npy", 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (8, 0, 128), }",
			   0, KVD_NPY_ACCEPT_FLOAT, 3, &a, err));
	ASSERT_EQ(a.shape[1], 0u);
	kvd_npy_close(&a);
}

TEST(messages) {
	const char *f32_2d = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";

	expect_error("k.npy", 1, f32_2d, 24, KVD_NPY_ACCEPT_FLOAT, 3, -EINVAL,
		     "k.npy: expected 3 dimensions, got 2");
	expect_error("k.npy", 1, f32_2d, 24, KVD_NPY_ACCEPT_FLOAT, 1, -EINVAL,
		     "k.npy: expected 1 dimension, got 2");
	expect_error("q.npy", 1, "{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }", 48,
		     KVD_NPY_ACCEPT_FLOAT, 2, -EOPNOTSUPP,
		     "q.npy: dtype '<f8' not supported (want float32 or float16)");
	expect_error("q.npy", 1, f32_2d, 24, KVD_NPY_ACCEPT_INT, 2, -EOPNOTSUPP,
		     "q.npy: dtype '<f4' not supported (want int64 or int32)");
	expect_error("q.npy", 1, "{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }", 24,
		     KVD_NPY_ACCEPT_FLOAT, 2, -EOPNOTSUPP,
		     "q.npy: big-endian dtype '>f4' not supported (want float32 or float16)");
	expect_error("q.npy", 1, "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }", 8,
		     KVD_NPY_ACCEPT_FLOAT, 1, -EOPNOTSUPP, "q.npy: structured dtypes are not supported");
	expect_error("v.npy", 1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", 24,
		     KVD_NPY_ACCEPT_FLOAT, 2, -EOPNOTSUPP,
		     "v.npy: fortran_order arrays are not supported (save a C-order array, e.g. "
		     "numpy.ascontiguousarray)");
	expect_error("v.npy", 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (512, 512), }", 12,
		     KVD_NPY_ACCEPT_FLOAT, 2, -EBADMSG,
		     "v.npy: truncated: 1048576 bytes of data expected, 12 present");
	expect_error("v.npy", 1, f32_2d, 28, KVD_NPY_ACCEPT_FLOAT, 2, -EBADMSG,
		     "v.npy: 24 bytes of data expected, 28 present (trailing bytes)");
	expect_error("o.npy", 1,
		     "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }", 0,
		     KVD_NPY_ACCEPT_FLOAT, 2, -EOVERFLOW, "o.npy: shape overflows 64-bit sizes");
	expect_error("o.npy", 1,
		     "{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904,), }", 0,
		     KVD_NPY_ACCEPT_FLOAT, 1, -EOVERFLOW, "o.npy: shape is too large for this machine");
	expect_error("o.npy", 1,
		     "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }", 0,
		     KVD_NPY_ACCEPT_FLOAT, 1, -EOVERFLOW, "o.npy: dimension 0 of the shape does not fit in 64 bits");
	expect_error("d.npy", 1,
		     "{'descr': '<f4', 'fortran_order': False, 'shape': (1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1), }",
		     4, KVD_NPY_ACCEPT_FLOAT, KVD_NPY_ANY_NDIM, -E2BIG, "d.npy: more than 16 dimensions");
}

TEST(malformed_headers) {
	static const char *const dicts[] = {
		"{'descr': '<f4', 'fortran_order': False}",
		"{'descr': '<f4', 'shape': (2,)}",
		"{'fortran_order': False, 'shape': (2,)}",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'extra': 1}",
		"{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'shape': (2,)}",
		"{'descr': '<f4', 'fortran_order': False, 'fortran_order': False, 'shape': (2,)}",
		"{'descr': '<f4', 'fortran_order': false, 'shape': (2,)}",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (-2,)}",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (2 2)}",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (2,,)}",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (,)}",
		"{'descr': '<f4', 'fortran_order': False, 'shape': [2]}",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (2,)",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} x",
		"{'descr': '<f4' 'fortran_order': False, 'shape': (2,)}",
		"{'descr' '<f4', 'fortran_order': False, 'shape': (2,)}",
		"{'descr': '<f4\\', 'fortran_order': False, 'shape': (2,)}",
		"{'descr': '<f4, 'fortran_order': False, 'shape': (2,)}",
		"{descr: '<f4', 'fortran_order': False, 'shape': (2,)}",
		"'descr': '<f4', 'fortran_order': False, 'shape': (2,)}",
		"",
		"{",
		"{'",
	};

	for (size_t i = 0; i < sizeof(dicts) / sizeof(dicts[0]); i++) {
		struct kvd_npy a;
		char err[KVD_NPY_ERROR_MAX];
		int r = try_open("m.npy", 1, dicts[i], 8, KVD_NPY_ACCEPT_FLOAT, KVD_NPY_ANY_NDIM, &a, err);

		if (r != -EBADMSG)
			fprintf(stderr, "dict %zu: %s: %d (%s)\n", i, dicts[i], r, err);
		ASSERT_ERRNO(r, -EBADMSG);
		ASSERT_EQ(strncmp(err, "m.npy: ", 7), 0);
	}
}

TEST(not_npy_and_preamble) {
	unsigned char *b;
	size_t len;
	char err[KVD_NPY_ERROR_MAX], big[80000];
	struct kvd_npy a;

	put_file("x.npy", "hello, world, not numpy", 23);
	ASSERT_ERRNO(kvd_npy_open("x.npy", KVD_NPY_ACCEPT_FLOAT, 1, &a, err, sizeof(err)), -EBADMSG);
	ASSERT_STREQ(err, "x.npy: not a .npy file");
	put_file("x.npy", "", 0);
	ASSERT_ERRNO(kvd_npy_open("x.npy", KVD_NPY_ACCEPT_FLOAT, 1, &a, err, sizeof(err)), -EBADMSG);
	ASSERT_STREQ(err, "x.npy: not a .npy file");
	put_file("x.npy", "\x93NUMPY\x01", 7);
	ASSERT_ERRNO(kvd_npy_open("x.npy", KVD_NPY_ACCEPT_FLOAT, 1, &a, err, sizeof(err)), -EBADMSG);
	ASSERT_STREQ(err, "x.npy: not a .npy file");

	len = build(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", 64, NULL, 8, &b);
	b[6] = 4;
	put_file("x.npy", b, len);
	ASSERT_ERRNO(kvd_npy_open("x.npy", KVD_NPY_ACCEPT_FLOAT, 1, &a, err, sizeof(err)), -EOPNOTSUPP);
	ASSERT_STREQ(err, "x.npy: .npy format version 4.0 not supported (want 1.0, 2.0 or 3.0)");
	b[6] = 1;
	b[7] = 1;
	put_file("x.npy", b, len);
	ASSERT_ERRNO(kvd_npy_open("x.npy", KVD_NPY_ACCEPT_FLOAT, 1, &a, err, sizeof(err)), -EOPNOTSUPP);
	b[7] = 0;
	/* Every proper prefix of a good file is refused. */
	for (size_t cut = 0; cut < len; cut++) {
		put_file("x.npy", b, cut);
		ASSERT_ERRNO(kvd_npy_open("x.npy", KVD_NPY_ACCEPT_FLOAT, 1, &a, err, sizeof(err)), -EBADMSG);
		ASSERT_ERRNO(kvd_npy_parse("mem", b, cut, KVD_NPY_ACCEPT_FLOAT, 1, &a, err, sizeof(err)),
			     -EBADMSG);
	}
	put_file("x.npy", b, len - 5);
	ASSERT_ERRNO(kvd_npy_open("x.npy", KVD_NPY_ACCEPT_FLOAT, 1, &a, err, sizeof(err)), -EBADMSG);
	ASSERT_STREQ(err, "x.npy: truncated: 8 bytes of data expected, 3 present");
	put_file("x.npy", b, 30);
	ASSERT_ERRNO(kvd_npy_open("x.npy", KVD_NPY_ACCEPT_FLOAT, 1, &a, err, sizeof(err)), -EBADMSG);
	ASSERT_STREQ(err, "x.npy: truncated header: 128 bytes expected, 30 present");
	free(b);

	/* A 64 KiB header is fine, one byte more is not. */
	memset(big, ' ', sizeof(big));
	memcpy(big, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }",
	       strlen("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }"));
	big[65535] = '\0';
	len = build(2, big, 0, NULL, 8, &b);
	ASSERT_OK(kvd_npy_parse("big.npy", b, len, KVD_NPY_ACCEPT_FLOAT, 1, &a, err, sizeof(err)));
	free(b);
	big[65535] = ' ';
	big[65536] = '\0';
	len = build(2, big, 0, NULL, 8, &b);
	ASSERT_ERRNO(kvd_npy_parse("big.npy", b, len, KVD_NPY_ACCEPT_FLOAT, 1, &a, err, sizeof(err)), -E2BIG);
	ASSERT_STREQ(err, "big.npy: header of 65537 bytes is larger than the 65536 allowed");
	free(b);
	/* A version 2 length far past the end of the file. */
	len = build(2, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", 64, NULL, 8, &b);
	b[9] = 0xfe;
	ASSERT_ERRNO(kvd_npy_parse("x.npy", b, len, KVD_NPY_ACCEPT_FLOAT, 1, &a, err, sizeof(err)), -EBADMSG);
	free(b);
}

TEST(files_that_are_not_there) {
	char err[KVD_NPY_ERROR_MAX];
	struct kvd_npy a;

	ASSERT_ERRNO(kvd_npy_open("missing.npy", KVD_NPY_ACCEPT_FLOAT, 1, &a, err, sizeof(err)), -ENOENT);
	ASSERT_STREQ(err, "missing.npy: No such file or directory");
	ASSERT_ERRNO(kvd_npy_open(".", KVD_NPY_ACCEPT_FLOAT, 1, &a, err, sizeof(err)), -EISDIR);
	ASSERT_STREQ(err, ".: not a regular file");
	/* A NULL or short message buffer is fine. */
	ASSERT_ERRNO(kvd_npy_open("missing.npy", KVD_NPY_ACCEPT_FLOAT, 1, &a, NULL, 0), -ENOENT);
	ASSERT_ERRNO(kvd_npy_open("missing.npy", KVD_NPY_ACCEPT_FLOAT, 1, &a, err, 4), -ENOENT);
	ASSERT_STREQ(err, "mis");
}

TEST(unaligned_data_is_copied) {
	unsigned char *b;
	size_t len;
	char err[KVD_NPY_ERROR_MAX];
	struct kvd_npy a;
	const float want[3] = { 1.5f, -2.0f, 3.25f };

	/* No padding: the data starts at an odd offset. */
	len = build(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,)}", 0, want, 12, &b);
	ASSERT_NE((len - 12) % 4, 0u);
	put_file("u.npy", b, len);
	free(b);
	ASSERT_OK(kvd_npy_open("u.npy", KVD_NPY_ACCEPT_FLOAT, 1, &a, err, sizeof(err)));
	ASSERT_EQ((uintptr_t)a.data % 4, 0u);
	ASSERT_EQ(memcmp(a.data, want, sizeof(want)), 0);
	kvd_npy_close(&a);
}

TEST(write_read_back) {
	const uint64_t shape3[] = { 2, 3, 4 }, shape1[] = { 5 }, shape0[] = { 0, 7 };
	float f[24];
	int64_t x[5] = { -1, 0, 1, INT64_MAX, INT64_MIN };
	char err[KVD_NPY_ERROR_MAX];
	struct kvd_npy a;
	struct stat st;

	for (int i = 0; i < 24; i++)
		f[i] = (float)i * 0.5f - 3;
	put_file("w.npy", "", 0);
	ASSERT_OK(kvd_npy_write("w.npy", KVD_NPY_F32, 3, shape3, f, err, sizeof(err)));
	ASSERT_OK(stat("w.npy", &st));
	/* The data starts on a 64-byte boundary, as numpy writes it. */
	ASSERT_EQ(((size_t)st.st_size - sizeof(f)) % 64, 0u);
	ASSERT_OK(kvd_npy_open("w.npy", KVD_NPY_ACCEPT_FLOAT, 3, &a, err, sizeof(err)));
	ASSERT_EQ(a.shape[0], 2u);
	ASSERT_EQ(a.shape[2], 4u);
	ASSERT_EQ(memcmp(a.data, f, sizeof(f)), 0);
	kvd_npy_close(&a);

	ASSERT_OK(kvd_npy_write("w.npy", KVD_NPY_I64, 1, shape1, x, err, sizeof(err)));
	ASSERT_OK(kvd_npy_open("w.npy", KVD_NPY_ACCEPT_INT, 1, &a, err, sizeof(err)));
	ASSERT_EQ(a.dtype, (uint32_t)KVD_NPY_I64);
	ASSERT_EQ(memcmp(a.data, x, sizeof(x)), 0);
	kvd_npy_close(&a);

	ASSERT_OK(kvd_npy_write("w.npy", KVD_NPY_F32, 2, shape0, NULL, err, sizeof(err)));
	ASSERT_OK(kvd_npy_open("w.npy", KVD_NPY_ACCEPT_FLOAT, 2, &a, err, sizeof(err)));
	ASSERT_EQ(a.count, 0u);
	ASSERT_EQ(a.shape[1], 7u);
	kvd_npy_close(&a);
	ASSERT_OK(kvd_npy_write("w.npy", KVD_NPY_I32, 0, NULL, x, err, sizeof(err)));
	ASSERT_OK(kvd_npy_open("w.npy", KVD_NPY_ACCEPT_INT, 0, &a, err, sizeof(err)));
	ASSERT_EQ(a.count, 1u);
	kvd_npy_close(&a);

	ASSERT_ERRNO(kvd_npy_write("w.npy", 77, 1, shape1, x, err, sizeof(err)), -EINVAL);
	ASSERT_ERRNO(kvd_npy_write("w.npy", KVD_NPY_F32, 1, shape1, NULL, err, sizeof(err)), -EINVAL);
	ASSERT_ERRNO(kvd_npy_write("no/such/dir/w.npy", KVD_NPY_F32, 1, shape1, f, err, sizeof(err)),
		     -ENOENT);
	ASSERT_STREQ(kvd_npy_dtype_name(KVD_NPY_F16), "float16");
	ASSERT_NULL(kvd_npy_dtype_name(2));
}

/* Random damage to a good header: any result, never a crash or a read out of bounds. */
TEST(damaged_headers_never_crash) {
	unsigned char *good, *b;
	size_t len = build(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 2), }", 64, NULL,
			   24, &good);
	uint64_t s = 1;

	b = malloc(len);
	ASSERT_NOT_NULL(b);
	for (int trial = 0; trial < 20000; trial++) {
		struct kvd_npy a;
		char err[KVD_NPY_ERROR_MAX];
		size_t cut;
		int r;

		memcpy(b, good, len);
		for (int k = 0; k < 1 + trial % 4; k++) {
			s = s * 6364136223846793005ull + 1442695040888963407ull;
			b[(s >> 33) % len] = (unsigned char)(s >> 20);
		}
		cut = trial % 3 ? len : (size_t)((s >> 13) % len);
		/* A private copy of the right size, so that ASan sees any overrun. */
		unsigned char *exact = malloc(cut ? cut : 1);

		ASSERT_NOT_NULL(exact);
		memcpy(exact, b, cut);
		r = kvd_npy_parse("f.npy", exact, cut, KVD_NPY_ACCEPT_FLOAT | KVD_NPY_ACCEPT_INT,
				  KVD_NPY_ANY_NDIM, &a, err, sizeof(err));
		if (r >= 0)
			ASSERT_EQ((size_t)((const unsigned char *)a.data - exact) + a.data_bytes, cut);
		else
			ASSERT_EQ(strncmp(err, "f.npy: ", 7), 0);
		free(exact);
	}
	free(b);
	free(good);
}
