/* SPDX-License-Identifier: MIT */
/*
 * libkvd's content keys (kvd_key_root, kvd_block_key, kvd_prefix_keys) against the vectors
 * that tests/data/block-keys/make-vectors.py computes from vLLM's definition with cbor2
 * and hashlib (its test, block-keys-reference, checks that the file is what it computes).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvd/kvd.h"
#include "test.h"

#define LINE_MAX_BYTES (1 << 16)

static void unhex(const char *s, uint8_t out[KVD_KEY_BYTES]) {
	ASSERT_EQ(strlen(s), (size_t)2 * KVD_KEY_BYTES);
	for (int i = 0; i < KVD_KEY_BYTES; i++) {
		unsigned v;

		ASSERT_EQ(sscanf(s + 2 * i, "%2x", &v), 1);
		out[i] = (uint8_t)v;
	}
}

/* The comma-separated token ids of s ('-': none) into tokens; returns how many. */
static uint32_t parse_tokens(char *s, uint32_t *tokens, uint32_t max) {
	uint32_t n = 0;

	if (strcmp(s, "-") == 0)
		return 0;
	for (char *t = strtok(s, ","); t; t = strtok(NULL, ",")) {
		ASSERT_LT(n, max);
		tokens[n++] = (uint32_t)strtoul(t, NULL, 10);
	}
	return n;
}

static FILE *open_vectors(void) {
	const char *dir = getenv("KVD_KEY_VECTORS");
	FILE *f;

	ASSERT_NOT_NULL(dir);
	f = fopen(dir, "re");
	ASSERT_NOT_NULL(f);
	return f;
}

TEST(vectors) {
	static char line[LINE_MAX_BYTES];
	static uint32_t tokens[4096];
	static uint8_t keys[1024][KVD_KEY_BYTES];
	unsigned roots = 0, blocks = 0, prefixes = 0;
	FILE *f = open_vectors();

	while (fgets(line, sizeof(line), f)) {
		char *save = NULL, *kind = strtok_r(line, " \n", &save);
		uint8_t want[KVD_KEY_BYTES], got[KVD_KEY_BYTES], parent[KVD_KEY_BYTES];

		if (strcmp(kind, "root") == 0) {
			char *seed = strtok_r(NULL, " \n", &save);

			unhex(strtok_r(NULL, " \n", &save), want);
			ASSERT_OK(kvd_key_root(strcmp(seed, "-") == 0 ? "" : seed, got));
			ASSERT_EQ(memcmp(got, want, KVD_KEY_BYTES), 0);
			roots++;
		} else if (strcmp(kind, "block") == 0) {
			kvd_key_extra extra[8];
			uint32_t n, n_extra = 0;
			char *ex;

			unhex(strtok_r(NULL, " \n", &save), parent);
			n = parse_tokens(strtok_r(NULL, " \n", &save), tokens, 4096);
			ex = strtok_r(NULL, " \n", &save);
			unhex(strtok_r(NULL, " \n", &save), want);
			for (char *e = strcmp(ex, "-") == 0 ? NULL : strtok(ex, "|"); e; e = strtok(NULL, "|")) {
				ASSERT_LT(n_extra, 8u);
				extra[n_extra++] = e[0] == 's' ? (kvd_key_extra){ .text = e + 2 }
				                               : (kvd_key_extra){ .integer = strtoll(e + 2, NULL, 10) };
			}
			ASSERT_OK(kvd_block_key(parent, tokens, n, extra, n_extra, got));
			ASSERT_EQ(memcmp(got, want, KVD_KEY_BYTES), 0);
			blocks++;
		} else if (strcmp(kind, "prefix") == 0) {
			char *seed = strtok_r(NULL, " \n", &save);
			uint32_t bt = (uint32_t)strtoul(strtok_r(NULL, " \n", &save), NULL, 10);
			char *salt = strtok_r(NULL, " \n", &save);
			uint32_t n = parse_tokens(strtok_r(NULL, " \n", &save), tokens, 4096), k = 0;
			uint8_t root[KVD_KEY_BYTES];

			ASSERT_OK(kvd_key_root(seed, root));
			ASSERT_EQ(kvd_prefix_keys(root, tokens, n, bt, strcmp(salt, "-") == 0 ? NULL : salt,
			                          &keys[0][0], 1024), (int64_t)(n / bt));
			for (char *h = strtok_r(NULL, " \n", &save); h; h = strtok_r(NULL, " \n", &save)) {
				unhex(h, want);
				ASSERT_EQ(memcmp(keys[k++], want, KVD_KEY_BYTES), 0);
			}
			ASSERT_EQ(k, n / bt);
			/* max_keys bounds what is written. */
			if (n / bt > 1)
				ASSERT_EQ(kvd_prefix_keys(root, tokens, n, bt, NULL, &keys[0][0], 1), 1);
			prefixes++;
		} else {
			ASSERT_TRUE(!"unknown line kind");
		}
	}
	fclose(f);
	/* What make-vectors.py writes: a file cut short fails here. */
	ASSERT_EQ(roots, 4u);
	ASSERT_EQ(blocks, 10u);
	ASSERT_EQ(prefixes, 3u);
}

TEST(bad_arguments) {
	uint8_t k[KVD_KEY_BYTES] = { 0 }, out[KVD_KEY_BYTES];
	uint32_t t = 1;

	ASSERT_EQ(kvd_key_root(NULL, out), -EINVAL);
	ASSERT_EQ(kvd_block_key(NULL, &t, 1, NULL, 0, out), -EINVAL);
	ASSERT_EQ(kvd_block_key(k, NULL, 1, NULL, 0, out), -EINVAL);
	ASSERT_EQ(kvd_block_key(k, &t, 1, NULL, 1, out), -EINVAL);
	ASSERT_EQ(kvd_prefix_keys(k, &t, 1, 0, NULL, out, 1), -EINVAL);
	ASSERT_EQ(kvd_prefix_keys(k, &t, 1, 1, NULL, NULL, 1), -EINVAL);
	/* Fewer tokens than a block: no key. */
	ASSERT_EQ(kvd_prefix_keys(k, &t, 1, 16, NULL, out, 1), 0);
}
