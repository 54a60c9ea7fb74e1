/* SPDX-License-Identifier: MIT */
/*
 * Loading .kvdlm weights (eval/kvd-lm/model.c): the random test model loads with the shape
 * make-random.py gave it, and corrupt copies of it (bad magic, version, header size, either
 * CRC, a truncated file, a file with bytes past the payload, insane or mismatched shapes)
 * are refused with the errno model.h documents and a message that names the problem.
 * Header fields are changed with the header CRC recomputed, so that each check is reached
 * on its own.
 *
 * Environment (set by meson): KVD_LM_DATA, the test data folder.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "basic/macro.h"
#include "model.h"
#include "test.h"

static uint8_t *image;
static size_t image_size;
static char tmp_path[64];

static void cleanup(void) {
	free(image);
	if (tmp_path[0])
		unlink(tmp_path);
}

int test_setup(void) {
	const char *dir = getenv("KVD_LM_DATA");
	char path[512];
	struct stat st;
	int fd;

	if (!dir) {
		fprintf(stderr, "KVD_LM_DATA is not set (run the tests through meson)\n");
		return -EINVAL;
	}
	snprintf(path, sizeof(path), "%s/random.kvdlm", dir);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0 || fstat(fd, &st) < 0)
		return -errno;
	image_size = (size_t)st.st_size;
	image = malloc(image_size);
	if (!image || read(fd, image, image_size) != (ssize_t)image_size)
		return -EIO;
	close(fd);
	snprintf(tmp_path, sizeof(tmp_path), "/tmp/test-kvd-lm-model-%d.kvdlm", (int)getpid());
	atexit(cleanup);
	return 0;
}

static void put32(uint8_t *p, uint32_t v) {
	for (int i = 0; i < 4; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static void put_f32(uint8_t *p, float f) {
	uint32_t u;

	memcpy(&u, &f, 4);
	put32(p, u);
}

/* Recomputes the header CRC of buf after a field changed. */
static void reseal(uint8_t *buf) {
	put32(buf + 68, kvdlm_crc32(0, buf, 68));
}

/* Writes buf[n] to the temporary file and loads it; returns the error, message in err. */
static int load_bytes(const uint8_t *buf, size_t n, char *err, size_t errlen) {
	struct kvdlm_model *m = NULL;
	int fd, r;

	fd = open(tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	ASSERT_TRUE(fd >= 0);
	ASSERT_EQ(write(fd, buf, n), (ssize_t)n);
	close(fd);
	err[0] = 0;
	r = kvdlm_model_load(tmp_path, &m, err, errlen);
	if (r >= 0)
		kvdlm_model_free(m);
	else
		ASSERT_NULL(m);
	return r;
}

/* A copy of the image, changed by edit, must fail with want and a message holding needle. */
static void expect(void (*edit)(uint8_t *buf, size_t *n), int want, const char *needle) {
	_cleanup_(freep) uint8_t *buf = malloc(image_size + 16);
	char err[KVDLM_ERROR_MAX];
	size_t n = image_size;

	ASSERT_NOT_NULL(buf);
	memcpy(buf, image, image_size);
	edit(buf, &n);
	ASSERT_ERRNO(load_bytes(buf, n, err, sizeof(err)), want);
	printf("refused: %s\n", err);
	if (!strstr(err, needle))
		test_fail(__FILE__, __LINE__, "message \"%s\" does not say \"%s\"", err, needle);
	/* Every message names the file. */
	ASSERT_NOT_NULL(strstr(err, tmp_path));
}

TEST(loads) {
	struct kvdlm_model *m = NULL;
	char err[KVDLM_ERROR_MAX];
	const struct kvdlm_config *c;

	ASSERT_OK(load_bytes(image, image_size, err, sizeof(err)));
	ASSERT_OK(kvdlm_model_load(tmp_path, &m, err, sizeof(err)));
	c = &m->cfg;
	/* make-random.py's RANDOM_CONFIG. */
	ASSERT_EQ(c->vocab, 260u);
	ASSERT_EQ(c->dim, 64u);
	ASSERT_EQ(c->layers, 2u);
	ASSERT_EQ(c->q_heads, 4u);
	ASSERT_EQ(c->kv_heads, 2u);
	ASSERT_EQ(c->head_dim, 16u);
	ASSERT_EQ(c->ffn, 128u);
	ASSERT_EQ(c->max_positions, 512u);
	ASSERT_TRUE(c->rope_theta == 10000.0f);
	ASSERT_TRUE(c->norm_eps == 1e-5f);
	ASSERT_EQ(m->params * 4 + KVDLM_HEADER_BYTES, image_size);
	/* The views follow the file order: lm_head ends the payload. */
	ASSERT_TRUE(m->lm_head + (size_t)c->vocab * c->dim == m->tok_emb + m->params);
	ASSERT_TRUE(m->layers[1].attn_norm == m->layers[0].w_down + (size_t)c->dim * c->ffn);
	kvdlm_model_free(m);
}

/* zlib's check value: crc32("123456789") == 0xcbf43926. */
TEST(crc32) {
	ASSERT_EQ(kvdlm_crc32(0, "123456789", 9), 0xcbf43926u);
	ASSERT_EQ(kvdlm_crc32(kvdlm_crc32(0, "1234", 4), "56789", 5), 0xcbf43926u);
	ASSERT_EQ(kvdlm_crc32(0, "", 0), 0u);
}

static void bad_magic(uint8_t *b, size_t *n) {
	b[0] = 'X';
}
static void bad_version(uint8_t *b, size_t *n) {
	put32(b + 8, 2);
	reseal(b);
}
static void bad_header_bytes(uint8_t *b, size_t *n) {
	put32(b + 12, 256);
	reseal(b);
}
static void bad_header_crc(uint8_t *b, size_t *n) {
	b[20] ^= 1; /* dim, not resealed */
}
static void bad_payload_crc(uint8_t *b, size_t *n) {
	b[*n / 2] ^= 0x40;
}
static void truncated(uint8_t *b, size_t *n) {
	*n -= 4;
}
static void trailing(uint8_t *b, size_t *n) {
	memset(b + *n, 0, 4);
	*n += 4;
}
static void short_header(uint8_t *b, size_t *n) {
	*n = 100;
}
static void odd_head_dim(uint8_t *b, size_t *n) {
	put32(b + 36, 15);
	reseal(b);
}
static void heads_not_multiple(uint8_t *b, size_t *n) {
	put32(b + 28, 3);
	reseal(b);
}
static void zero_layers(uint8_t *b, size_t *n) {
	put32(b + 24, 0);
	reseal(b);
}
static void wrong_vocab(uint8_t *b, size_t *n) {
	put32(b + 16, 256);
	reseal(b);
}
static void huge_dim(uint8_t *b, size_t *n) {
	put32(b + 20, KVDLM_DIM_MAX + 1);
	reseal(b);
}
static void negative_eps(uint8_t *b, size_t *n) {
	put_f32(b + 52, -1.0f);
	reseal(b);
}
/* A sane shape that is not the payload's: 3 layers instead of 2. */
static void wrong_shape(uint8_t *b, size_t *n) {
	put32(b + 24, 3);
	reseal(b);
}

TEST(corrupt) {
	expect(bad_magic, -EBADMSG, "bad magic");
	expect(bad_version, -EOPNOTSUPP, "version 2");
	expect(bad_header_bytes, -EBADMSG, "header bytes 256");
	expect(bad_header_crc, -EBADMSG, "header CRC-32 mismatch");
	expect(bad_payload_crc, -EBADMSG, "payload CRC-32 mismatch");
	expect(truncated, -EBADMSG, "is not header + payload");
	expect(trailing, -EBADMSG, "is not header + payload");
	expect(short_header, -EBADMSG, "shorter than the 128-byte header");
	expect(odd_head_dim, -EINVAL, "head_dim 15 is odd");
	expect(heads_not_multiple, -EINVAL, "q_heads 3 is not a multiple of kv_heads 2");
	expect(zero_layers, -EINVAL, "layers is 0");
	expect(wrong_vocab, -EINVAL, "vocab is 256, must be 260");
	expect(huge_dim, -EINVAL, "dim is 65537");
	expect(negative_eps, -EINVAL, "norm_eps");
	expect(wrong_shape, -EINVAL, "do not match the shape");
}

TEST(not_a_file) {
	struct kvdlm_model *m = NULL;
	char err[KVDLM_ERROR_MAX];

	ASSERT_ERRNO(kvdlm_model_load("/nonexistent/x.kvdlm", &m, err, sizeof(err)), -ENOENT);
	ASSERT_NOT_NULL(strstr(err, "/nonexistent/x.kvdlm"));
	ASSERT_ERRNO(kvdlm_model_load("/tmp", &m, err, sizeof(err)), -EISDIR);
	ASSERT_ERRNO(kvdlm_model_load(NULL, &m, NULL, 0), -EINVAL);
	ASSERT_NULL(m);
}
