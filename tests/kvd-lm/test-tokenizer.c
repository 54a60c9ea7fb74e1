/* SPDX-License-Identifier: MIT */
/*
 * The kvd-lm tokenizer (eval/kvd-lm/tokenizer.c): token for token the same as
 * tokenizer.py on kvd-lm-base's vocabulary, through a golden file that it wrote; the
 * byte-level tokenizer; decoding; the tokenizer a model gets; and corrupt `.kvdtok` files
 * refused with a message that names the problem (fields changed with the header CRC
 * recomputed, so that each check is reached on its own).
 *
 * Environment (set by meson): KVD_LM_TOKENIZER, kvd-lm-base's tokenizer, KVD_LM_MODELS,
 * the models folder, and KVD_LM_TOKENIZER_GOLDEN, the golden file, regenerated from the
 * repository root with
 *
 *   python3 eval/kvd-lm/tokenizer.py golden eval/kvd-lm/models/kvd-lm-base.kvdtok \
 *       eval/kvd-lm/data/haystack.txt > tests/data/kvd-lm/tokenizer-golden.txt
 *
 * Each record there is "text N\n" + N bytes + "\ntokens ID ID ...\n\n".
 */
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "basic/macro.h"
#include "format.h"
#include "test.h"
#include "tokenizer.h"

static struct kvdlm_tokenizer *base;
static uint8_t *image;
static size_t image_size;
static char tmp_path[64];

static void cleanup(void) {
	base = kvdlm_tokenizer_free(base);
	free(image);
	if (tmp_path[0])
		unlink(tmp_path);
}

int test_setup(void) {
	const char *path = getenv("KVD_LM_TOKENIZER");
	char err[256];
	int r;

	if (!path || !getenv("KVD_LM_TOKENIZER_GOLDEN") || !getenv("KVD_LM_MODELS")) {
		fprintf(stderr, "KVD_LM_TOKENIZER, KVD_LM_TOKENIZER_GOLDEN or KVD_LM_MODELS is not set\n");
		return -EINVAL;
	}
	atexit(cleanup);
	r = kvdlm_tokenizer_load(path, &base, err, sizeof(err));
	if (r < 0) {
		fprintf(stderr, "%s\n", err);
		return r;
	}
	image = (uint8_t *)test_read_file(path, &image_size);
	snprintf(tmp_path, sizeof(tmp_path), "/tmp/test-tokenizer-%d.kvdtok", (int)getpid());
	return 0;
}

/* Parity with tokenizer.py: every record of the golden file. */
TEST(golden) {
	const char *path = getenv("KVD_LM_TOKENIZER_GOLDEN");
	_cleanup_(freep) uint8_t *golden = NULL;
	size_t size, o = 0, records = 0, tokens = 0;

	golden = (uint8_t *)test_read_file(path, &size);
	while (o < size) {
		_cleanup_(freep) uint32_t *got = NULL;
		const uint8_t *text;
		size_t n, k, want = 0;
		char *p, *end;
		int used;

		/* Not "\n" in the format: it would skip the text's own leading white space. */
		if (sscanf((char *)golden + o, "text %zu%n", &n, &used) != 1 || golden[o + used] != '\n')
			test_fail(__FILE__, __LINE__, "%s: no record at byte %zu", path, o);
		text = golden + o + used + 1;
		ASSERT_LE(o + (size_t)used + n + 8, size);
		ASSERT_EQ(memcmp(text + n, "\ntokens", 7), 0);
		got = malloc((n + 1) * sizeof(*got));
		ASSERT_NOT_NULL(got);
		k = kvdlm_tokenizer_encode(base, text, n, got);
		ASSERT_EQ(kvdlm_tokenizer_count(base, text, n), k);
		for (p = (char *)text + n + 7; *p == ' '; p = end, want++) {
			unsigned long id = strtoul(p + 1, &end, 10);

			if (want >= k || got[want] != id)
				test_fail(__FILE__, __LINE__,
				          "%s: record %zu (%zu bytes): token %zu is %lu in tokenizer.py, %ld here",
				          path, records, n, want, id, want < k ? (long)got[want] : -1L);
		}
		ASSERT_EQ(want, k);
		ASSERT_EQ(memcmp(p, "\n\n", 2), 0);
		/* Decoding gives the text back. */
		for (size_t i = 0, at = 0; i < k; i++) {
			size_t len;
			const uint8_t *b = kvdlm_tokenizer_token(base, got[i], &len);

			ASSERT_NOT_NULL(b);
			ASSERT_LE(at + len, n);
			ASSERT_EQ(memcmp(text + at, b, len), 0);
			at += len;
			if (i + 1 == k)
				ASSERT_EQ(at, n);
		}
		o = (size_t)(p + 2 - (char *)golden);
		records++;
		tokens += k;
	}
	printf("golden: %zu records, %zu tokens match tokenizer.py\n", records, tokens);
	ASSERT_GT(records, 20u);
}

static int collect(const uint8_t *p, size_t size, void *userdata) {
	char *out = userdata;
	size_t n = strlen(out);

	out[n] = '|';
	memcpy(out + n + 1, p, size);
	out[n + 1 + size] = 0;
	return 0;
}

static int stop_at_second(const uint8_t *p, size_t size, void *userdata) {
	(void)p;
	(void)size;
	return ++*(int *)userdata == 2 ? -ECANCELED : 0;
}

/* The piece rule of README.md, "Tokens". */
TEST(pieces) {
	static const struct {
		const char *text, *pieces;
	} cases[] = {
		{ "The cat", "|The| cat" },
		{ " is 1234567.", "| is| |123|456|7|." },
		{ "a  b", "|a| | b" },
		{ "x\n\ny", "|x|\n|\n|y" },
		{ " (a), b", "| (|a|),| b" },
		{ "VAR ABCDE = 12345.", "|VAR| ABCDE| =| |123|45|." },
		{ "end ", "|end| " },
	};
	char out[256];
	int seen = 0;

	for (size_t i = 0; i < ELEMENTSOF(cases); i++) {
		out[0] = 0;
		ASSERT_OK(kvdlm_pieces(cases[i].text, strlen(cases[i].text), collect, out));
		ASSERT_STREQ(out, cases[i].pieces);
	}
	/* A run is cut every KVDLM_PIECE_MAX bytes, the leading space counted. */
	{
		char run[2 * KVDLM_PIECE_MAX + 2];

		run[0] = ' ';
		memset(run + 1, 'q', sizeof(run) - 2);
		run[sizeof(run) - 1] = 0;
		out[0] = 0;
		ASSERT_OK(kvdlm_pieces(run, strlen(run), collect, out));
		ASSERT_EQ(strlen(out), strlen(run) + 3);
		ASSERT_EQ(out[KVDLM_PIECE_MAX + 1], '|');
		ASSERT_EQ(out[2 * KVDLM_PIECE_MAX + 2], '|');
	}
	ASSERT_ERRNO(kvdlm_pieces("a b c", 5, stop_at_second, &seen), -ECANCELED);
	ASSERT_EQ(seen, 2);
}

TEST(bytes) {
	_cleanup_(kvdlm_tokenizer_freep) struct kvdlm_tokenizer *t = NULL;
	static const char text[] = "Hello, 1234567 \xff";
	uint32_t ids[sizeof(text)];
	const uint8_t *b;
	size_t n;

	ASSERT_OK(kvdlm_tokenizer_bytes(&t));
	ASSERT_EQ(kvdlm_tokenizer_vocab(t), KVDLM_BYTE_VOCAB);
	ASSERT_EQ(kvdlm_tokenizer_encode(t, text, sizeof(text) - 1, ids), sizeof(text) - 1);
	for (size_t i = 0; i + 1 < sizeof(text); i++)
		ASSERT_EQ(ids[i], (uint8_t)text[i]);
	b = kvdlm_tokenizer_token(t, KVDLM_BOS, &n);
	ASSERT_TRUE(n == 5 && memcmp(b, "<bos>", 5) == 0);
	b = kvdlm_tokenizer_token(t, 259, &n);
	ASSERT_TRUE(n == 5 && memcmp(b, "<259>", 5) == 0);
	ASSERT_NULL(kvdlm_tokenizer_token(t, KVDLM_BYTE_VOCAB, &n));
	/* The merges make fewer tokens of the same text, never more. */
	ASSERT_LT(kvdlm_tokenizer_count(base, text, sizeof(text) - 1), sizeof(text) - 1);
	ASSERT_EQ(kvdlm_tokenizer_vocab(base), 3072u);
}

static void put32(uint8_t *p, uint32_t v) {
	for (int i = 0; i < 4; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

/* Writes image (changed by the caller), header CRC recomputed unless told not to, and
 * loads it: returns the errno, the message in err. */
static int load_changed(uint8_t *img, size_t size, bool fix_crc, char *err, size_t errlen) {
	_cleanup_(kvdlm_tokenizer_freep) struct kvdlm_tokenizer *t = NULL;
	FILE *f;

	if (fix_crc && size >= 36)
		put32(img + 32, kvdlm_crc32(0, img, 32));
	f = fopen(tmp_path, "we");
	ASSERT_NOT_NULL(f);
	ASSERT_EQ(fwrite(img, 1, size, f), size);
	ASSERT_EQ(fclose(f), 0);
	return kvdlm_tokenizer_load(tmp_path, &t, err, errlen);
}

TEST(refused) {
	_cleanup_(freep) uint8_t *img = malloc(image_size);
	char err[256];

	ASSERT_NOT_NULL(img);
#define CASE(fix, want, msg, ...)                                                                \
	do {                                                                                     \
		memcpy(img, image, image_size);                                                  \
		__VA_ARGS__;                                                                     \
		ASSERT_ERRNO(load_changed(img, size, fix, err, sizeof(err)), want);              \
		if (!strstr(err, msg))                                                           \
			test_fail(__FILE__, __LINE__, "message '%s' lacks '%s'", err, msg);      \
	} while (0)
	size_t size = image_size;

	CASE(true, -EBADMSG, "bad magic", img[0] = 'X');
	CASE(true, -EBADMSG, "version 2", put32(img + 8, 2));
	CASE(true, -EBADMSG, "header bytes", put32(img + 12, 128));
	CASE(false, -EBADMSG, "header CRC-32", img[20] ^= 1);
	CASE(true, -EBADMSG, "vocab 3073", put32(img + 16, 3073));
	CASE(true, -EBADMSG, "payload of", put32(img + 24, 8));
	CASE(true, -EBADMSG, "payload CRC-32", img[image_size - 1] ^= 1);
	/* Merge 0 of a later token: the payload CRC fixed too. */
	CASE(true, -EBADMSG, "uses a special or a later token", put32(img + 64, 300);
	     put32(img + 28, kvdlm_crc32(0, img + 64, image_size - 64)));
	CASE(true, -EBADMSG, "uses a special or a later token", put32(img + 64, KVDLM_BOS);
	     put32(img + 28, kvdlm_crc32(0, img + 64, image_size - 64)));
	/* Merge 1 repeating merge 0. */
	CASE(true, -EBADMSG, "repeats merge 0", memcpy(img + 72, img + 64, 8);
	     put32(img + 28, kvdlm_crc32(0, img + 64, image_size - 64)));
	size = 40;
	CASE(true, -EBADMSG, "shorter than", (void)0);
	size = image_size - 8;
	CASE(true, -EBADMSG, "payload of", (void)0);
#undef CASE
	ASSERT_ERRNO(kvdlm_tokenizer_load("/nonexistent/x.kvdtok", &(struct kvdlm_tokenizer *){ NULL },
	                                  err, sizeof(err)), -ENOENT);
	ASSERT_ERRNO(kvdlm_tokenizer_load("/tmp", &(struct kvdlm_tokenizer *){ NULL }, err, sizeof(err)),
	             -EISDIR);
}

/* A model gets the .kvdtok beside it, or bytes at vocab 260 without one. */
TEST(for_model) {
	_cleanup_(kvdlm_tokenizer_freep) struct kvdlm_tokenizer *t = NULL, *s = NULL;
	char path[512], err[512];

	snprintf(path, sizeof(path), "%s/kvd-lm-base.kvdlm", getenv("KVD_LM_MODELS"));
	ASSERT_OK(kvdlm_tokenizer_for_model(path, 3072, &t, err, sizeof(err)));
	ASSERT_EQ(kvdlm_tokenizer_vocab(t), 3072u);
	ASSERT_ERRNO(kvdlm_tokenizer_for_model(path, 260, &(struct kvdlm_tokenizer *){ NULL }, err,
	                                       sizeof(err)), -EBADMSG);
	ASSERT_TRUE(strstr(err, "the model's is 260") != NULL);
	snprintf(path, sizeof(path), "%s/kvd-lm-small.kvdlm", getenv("KVD_LM_MODELS"));
	ASSERT_OK(kvdlm_tokenizer_for_model(path, 260, &s, err, sizeof(err)));
	ASSERT_EQ(kvdlm_tokenizer_vocab(s), KVDLM_BYTE_VOCAB);
	ASSERT_ERRNO(kvdlm_tokenizer_for_model(path, 3072, &(struct kvdlm_tokenizer *){ NULL }, err,
	                                       sizeof(err)), -EBADMSG);
	ASSERT_TRUE(strstr(err, "needs a tokenizer file") != NULL);
}
