/* SPDX-License-Identifier: MIT */
/*
 * Content keys of blocks (kvd.h, "Prefix sharing"): vLLM's sha256_cbor block hash, the
 * SHA-256 of cbor2.dumps((parent, tuple(token_ids), extra_keys), canonical=True). The
 * encoder writes the few CBOR items that tuple holds (RFC 8949: unsigned and negative
 * integers, byte and text strings, arrays, null) in their shortest form, which is what
 * canonical encoding means for them, straight into the hash.
 */
#include <errno.h>
#include <string.h>

#include "kvd/kvd.h"
#include "sha256.h"

enum {
	CBOR_UNSIGNED = 0,
	CBOR_NEGATIVE = 1,
	CBOR_BYTES = 2,
	CBOR_TEXT = 3,
	CBOR_ARRAY = 4,
};

#define CBOR_NULL 0xf6

/* An item's head: its major type and its argument in the fewest bytes. */
static void cbor_head(struct sha256 *h, unsigned major, uint64_t v) {
	uint8_t b[9];
	size_t n;

	if (v < 24) {
		b[0] = (uint8_t)(major << 5 | v);
		n = 1;
	} else {
		unsigned len = v <= UINT8_MAX ? 1 : v <= UINT16_MAX ? 2 : v <= UINT32_MAX ? 4 : 8;

		b[0] = (uint8_t)(major << 5 | (len == 1 ? 24 : len == 2 ? 25 : len == 4 ? 26 : 27));
		for (unsigned i = 0; i < len; i++)
			b[1 + i] = (uint8_t)(v >> (8 * (len - 1 - i)));
		n = 1 + len;
	}
	sha256_update(h, b, n);
}

static void cbor_int(struct sha256 *h, int64_t v) {
	if (v >= 0)
		cbor_head(h, CBOR_UNSIGNED, (uint64_t)v);
	else
		cbor_head(h, CBOR_NEGATIVE, (uint64_t)(-(v + 1)));
}

static void cbor_string(struct sha256 *h, unsigned major, const void *p, size_t n) {
	cbor_head(h, major, n);
	sha256_update(h, p, n);
}

int kvd_key_root(const char *seed, uint8_t out[KVD_KEY_BYTES]) {
	struct sha256 h;

	if (!seed || !out)
		return -EINVAL;
	sha256_init(&h);
	cbor_string(&h, CBOR_TEXT, seed, strlen(seed));
	sha256_final(&h, out);
	return 0;
}

int kvd_block_key(const uint8_t parent[KVD_KEY_BYTES], const uint32_t *tokens, uint32_t n,
                  const kvd_key_extra *extra, uint32_t n_extra, uint8_t out[KVD_KEY_BYTES]) {
	struct sha256 h;

	if (!parent || !out || (n > 0 && !tokens) || (n_extra > 0 && !extra))
		return -EINVAL;
	sha256_init(&h);
	cbor_head(&h, CBOR_ARRAY, 3);
	cbor_string(&h, CBOR_BYTES, parent, KVD_KEY_BYTES);
	cbor_head(&h, CBOR_ARRAY, n);
	for (uint32_t i = 0; i < n; i++)
		cbor_head(&h, CBOR_UNSIGNED, tokens[i]);
	if (n_extra == 0) {
		uint8_t null = CBOR_NULL;

		sha256_update(&h, &null, 1);
	} else {
		cbor_head(&h, CBOR_ARRAY, n_extra);
		for (uint32_t i = 0; i < n_extra; i++) {
			if (extra[i].text)
				cbor_string(&h, CBOR_TEXT, extra[i].text, strlen(extra[i].text));
			else
				cbor_int(&h, extra[i].integer);
		}
	}
	sha256_final(&h, out);
	return 0;
}

int64_t kvd_prefix_keys(const uint8_t root[KVD_KEY_BYTES], const uint32_t *tokens,
                        uint64_t n_tokens, uint32_t block_tokens, const char *cache_salt,
                        uint8_t *out, uint64_t max_keys) {
	kvd_key_extra salt = { .text = cache_salt };
	uint64_t n;

	if (!root || block_tokens == 0 || (n_tokens > 0 && !tokens) || (max_keys > 0 && !out))
		return -EINVAL;
	n = n_tokens / block_tokens;
	if (n > max_keys)
		n = max_keys;
	if (n > INT64_MAX)
		return -EINVAL;
	for (uint64_t b = 0; b < n; b++) {
		const uint8_t *parent = b == 0 ? root : out + (b - 1) * KVD_KEY_BYTES;
		int r = kvd_block_key(parent, tokens + b * block_tokens, block_tokens,
		                      &salt, b == 0 && cache_salt ? 1 : 0, out + b * KVD_KEY_BYTES);

		if (r < 0)
			return r;
	}
	return (int64_t)n;
}
