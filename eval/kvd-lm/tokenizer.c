/* SPDX-License-Identifier: MIT */
/*
 * The kvd-lm tokenizer; see tokenizer.h. The piece rule and the merge order are part of
 * the format: tokenizer.py follows them step for step (tests/kvd-lm/test-tokenizer.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "basic/macro.h"
#include "format.h"
#include "tokenizer.h"

static const char kvdtok_magic[8] = { 'K', 'V', 'D', 'T', 'O', 'K', 0, 0 };
#define KVDTOK_VERSION 1u
#define KVDTOK_HEADER_BYTES 64u
/* The header CRC covers bytes 0..31; it sits at 32. */
#define HEADER_CRC_SPAN 32u

struct kvdlm_tokenizer {
	uint32_t vocab;
	uint32_t *merge_left, *merge_right; /* [vocab - KVDLM_BYTE_VOCAB] */
	uint32_t *offset;                   /* [vocab + 1]: token id's bytes are bytes[offset[id]..offset[id + 1]) */
	uint8_t *bytes;
	/* The merges by pair: open addressing, key (left << 32 | right) + 1 (0: empty). */
	uint64_t *keys;
	uint32_t *ranks;
	size_t mask;
};

struct kvdlm_tokenizer *kvdlm_tokenizer_free(struct kvdlm_tokenizer *t) {
	if (t) {
		free(t->merge_left);
		free(t->merge_right);
		free(t->offset);
		free(t->bytes);
		free(t->keys);
		free(t->ranks);
		free(t);
	}
	return NULL;
}

uint32_t kvdlm_tokenizer_vocab(const struct kvdlm_tokenizer *t) {
	return t->vocab;
}

static uint64_t pair_key(uint32_t a, uint32_t b) {
	return ((uint64_t)a << 32 | b) + 1;
}

static size_t pair_slot(const struct kvdlm_tokenizer *t, uint64_t key) {
	/* Fibonacci hashing: merges are dense small ids, which a plain mask would cluster. */
	size_t i = (size_t)((key * UINT64_C(0x9e3779b97f4a7c15)) >> 20) & t->mask;

	while (t->keys[i] && t->keys[i] != key)
		i = (i + 1) & t->mask;
	return i;
}

/* The rank of merge (a, b), or UINT32_MAX when there is none. */
static uint32_t pair_rank(const struct kvdlm_tokenizer *t, uint32_t a, uint32_t b) {
	size_t i;

	if (t->vocab == KVDLM_BYTE_VOCAB)
		return UINT32_MAX;
	i = pair_slot(t, pair_key(a, b));
	return t->keys[i] ? t->ranks[i] : UINT32_MAX;
}

/* Builds the token bytes and the pair table of the merges already in t. */
static int tokenizer_index(struct kvdlm_tokenizer *t, const char *name, char *err, size_t errlen) {
	static const char *const specials[] = { "<bos>", "<eos>", "<pad>", "<259>" };
	uint32_t merges = t->vocab - KVDLM_BYTE_VOCAB;
	size_t size = 256, slots = 16;

	for (size_t i = 0; i < ELEMENTSOF(specials); i++)
		size += strlen(specials[i]);
	t->offset = calloc((size_t)t->vocab + 1, sizeof(*t->offset));
	while (slots < 2 * (size_t)merges)
		slots *= 2;
	t->keys = calloc(slots, sizeof(*t->keys));
	t->ranks = calloc(slots, sizeof(*t->ranks));
	if (!t->offset || !t->keys || !t->ranks)
		return kvdlm_fail(err, errlen, -ENOMEM, "%s: out of memory", name);
	t->mask = slots - 1;

	/* Sizes first (each merge is at most 2^16 times longer than a byte: no overflow). */
	for (uint32_t i = 0; i < merges; i++) {
		uint32_t a = t->merge_left[i], b = t->merge_right[i], id = KVDLM_BYTE_VOCAB + i;
		size_t s;

		if (a >= id || b >= id || (a >= KVDLM_BOS && a < KVDLM_BYTE_VOCAB) ||
		    (b >= KVDLM_BOS && b < KVDLM_BYTE_VOCAB))
			return kvdlm_fail(err, errlen, -EBADMSG,
			            "%s: merge %u (%u, %u) uses a special or a later token", name, i, a, b);
		s = pair_slot(t, pair_key(a, b));
		if (t->keys[s])
			return kvdlm_fail(err, errlen, -EBADMSG, "%s: merge %u (%u, %u) repeats merge %u", name,
			            i, a, b, t->ranks[s]);
		t->keys[s] = pair_key(a, b);
		t->ranks[s] = i;
	}
	/* offset[id] holds the size of token id until the prefix sum below. */
	for (uint32_t id = 0; id < t->vocab; id++) {
		size_t s = id < 256                ? 1
		           : id < KVDLM_BYTE_VOCAB ? strlen(specials[id - 256])
		                                   : (size_t)t->offset[t->merge_left[id - KVDLM_BYTE_VOCAB]] +
		                                             t->offset[t->merge_right[id - KVDLM_BYTE_VOCAB]];

		if (s > UINT32_MAX / 2 || size + s > UINT32_MAX)
			return kvdlm_fail(err, errlen, -EBADMSG, "%s: token %u is too long", name, id);
		t->offset[id] = (uint32_t)s;
		size += s;
	}
	t->bytes = malloc(size);
	if (!t->bytes)
		return kvdlm_fail(err, errlen, -ENOMEM, "%s: out of memory", name);
	{
		uint32_t o = 0;

		for (uint32_t id = 0; id <= t->vocab; id++) {
			uint32_t s = id < t->vocab ? t->offset[id] : 0;

			t->offset[id] = o;
			o += s;
		}
	}
	for (uint32_t id = 0; id < t->vocab; id++) {
		uint8_t *p = t->bytes + t->offset[id];

		if (id < 256)
			*p = (uint8_t)id;
		else if (id < KVDLM_BYTE_VOCAB)
			memcpy(p, specials[id - 256], strlen(specials[id - 256]));
		else {
			uint32_t a = t->merge_left[id - KVDLM_BYTE_VOCAB], b = t->merge_right[id - KVDLM_BYTE_VOCAB];
			size_t na = t->offset[a + 1] - t->offset[a];

			memcpy(p, t->bytes + t->offset[a], na);
			memcpy(p + na, t->bytes + t->offset[b], t->offset[b + 1] - t->offset[b]);
		}
	}
	return 0;
}

int kvdlm_tokenizer_bytes(struct kvdlm_tokenizer **ret) {
	_cleanup_(kvdlm_tokenizer_freep) struct kvdlm_tokenizer *t = calloc(1, sizeof(*t));
	int r;

	if (!t)
		return -ENOMEM;
	t->vocab = KVDLM_BYTE_VOCAB;
	r = tokenizer_index(t, "bytes", NULL, 0);
	if (r < 0)
		return r;
	*ret = TAKE_PTR(t);
	return 0;
}

int kvdlm_tokenizer_load(const char *path, struct kvdlm_tokenizer **ret, char *err, size_t errlen) {
	_cleanup_(kvdlm_tokenizer_freep) struct kvdlm_tokenizer *t = NULL;
	_cleanup_(freep) uint8_t *data = NULL;
	_cleanup_(closep) int fd = -EBADF;
	uint32_t vocab, merges, payload;
	size_t n = 0, max = KVDTOK_HEADER_BYTES + 8 * (size_t)KVDLM_VOCAB_MAX;
	struct stat st;
	int r;

	if (!path)
		return kvdlm_fail(err, errlen, -EINVAL, "no tokenizer file given");
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0 || fstat(fd, &st) < 0)
		return kvdlm_fail(err, errlen, -errno, "%s: %s", path, strerror(errno));
	if (S_ISDIR(st.st_mode))
		return kvdlm_fail(err, errlen, -EISDIR, "%s: is a directory", path);
	if ((uint64_t)st.st_size > max)
		return kvdlm_fail(err, errlen, -EFBIG, "%s: %lld bytes, larger than any tokenizer", path,
		            (long long)st.st_size);
	data = malloc((size_t)st.st_size + 1);
	if (!data)
		return kvdlm_fail(err, errlen, -ENOMEM, "%s: out of memory", path);
	while (n < (size_t)st.st_size) {
		ssize_t k = read(fd, data + n, (size_t)st.st_size - n);

		if (k < 0 && errno == EINTR)
			continue;
		if (k < 0)
			return kvdlm_fail(err, errlen, -errno, "%s: %s", path, strerror(errno));
		if (k == 0)
			break;
		n += (size_t)k;
	}
	if (n < KVDTOK_HEADER_BYTES)
		return kvdlm_fail(err, errlen, -EBADMSG, "%s: %zu bytes, shorter than the %u-byte header", path,
		            n, KVDTOK_HEADER_BYTES);
	if (memcmp(data, kvdtok_magic, sizeof(kvdtok_magic)) != 0)
		return kvdlm_fail(err, errlen, -EBADMSG, "%s: not a kvd-lm tokenizer (bad magic)", path);
	if (kvdlm_le32(data + 8) != KVDTOK_VERSION)
		return kvdlm_fail(err, errlen, -EBADMSG, "%s: version %u, only %u is known", path,
		            kvdlm_le32(data + 8), KVDTOK_VERSION);
	if (kvdlm_le32(data + 12) != KVDTOK_HEADER_BYTES)
		return kvdlm_fail(err, errlen, -EBADMSG, "%s: header bytes %u, expected %u", path,
		            kvdlm_le32(data + 12), KVDTOK_HEADER_BYTES);
	if (kvdlm_crc32(0, data, HEADER_CRC_SPAN) != kvdlm_le32(data + 32))
		return kvdlm_fail(err, errlen, -EBADMSG,
		            "%s: header CRC-32 mismatch (stored %08x, computed %08x)", path,
		            kvdlm_le32(data + 32), kvdlm_crc32(0, data, HEADER_CRC_SPAN));
	vocab = kvdlm_le32(data + 16);
	merges = kvdlm_le32(data + 20);
	payload = kvdlm_le32(data + 24);
	if (vocab > KVDLM_VOCAB_MAX || vocab != KVDLM_BYTE_VOCAB + merges)
		return kvdlm_fail(err, errlen, -EBADMSG,
		            "%s: vocab %u is not %u + merges (%u) or is over %u", path, vocab,
		            KVDLM_BYTE_VOCAB, merges, KVDLM_VOCAB_MAX);
	if (payload != 8 * merges || n != KVDTOK_HEADER_BYTES + (size_t)payload)
		return kvdlm_fail(err, errlen, -EBADMSG, "%s: payload of %zu bytes, expected 8 x %u merges",
		            path, n - KVDTOK_HEADER_BYTES, merges);
	if (kvdlm_crc32(0, data + KVDTOK_HEADER_BYTES, payload) != kvdlm_le32(data + 28))
		return kvdlm_fail(err, errlen, -EBADMSG,
		            "%s: payload CRC-32 mismatch (stored %08x, computed %08x)", path,
		            kvdlm_le32(data + 28), kvdlm_crc32(0, data + KVDTOK_HEADER_BYTES, payload));

	t = calloc(1, sizeof(*t));
	if (!t)
		return kvdlm_fail(err, errlen, -ENOMEM, "%s: out of memory", path);
	t->vocab = vocab;
	t->merge_left = malloc(MAX(merges, 1u) * sizeof(uint32_t));
	t->merge_right = malloc(MAX(merges, 1u) * sizeof(uint32_t));
	if (!t->merge_left || !t->merge_right)
		return kvdlm_fail(err, errlen, -ENOMEM, "%s: out of memory", path);
	for (uint32_t i = 0; i < merges; i++) {
		t->merge_left[i] = kvdlm_le32(data + KVDTOK_HEADER_BYTES + 8 * (size_t)i);
		t->merge_right[i] = kvdlm_le32(data + KVDTOK_HEADER_BYTES + 8 * (size_t)i + 4);
	}
	r = tokenizer_index(t, path, err, errlen);
	if (r < 0)
		return r;
	*ret = TAKE_PTR(t);
	return 0;
}

int kvdlm_tokenizer_for_model(const char *model_path, uint32_t vocab,
                              struct kvdlm_tokenizer **ret, char *err, size_t errlen) {
	_cleanup_(kvdlm_tokenizer_freep) struct kvdlm_tokenizer *t = NULL;
	_cleanup_(freep) char *path = NULL;
	const char *slash = strrchr(model_path, '/'), *dot = strrchr(model_path, '.');
	size_t stem = dot && (!slash || dot > slash) ? (size_t)(dot - model_path) : strlen(model_path);
	int r;

	path = malloc(stem + sizeof(".kvdtok"));
	if (!path)
		return kvdlm_fail(err, errlen, -ENOMEM, "out of memory");
	memcpy(path, model_path, stem);
	strcpy(path + stem, ".kvdtok");
	if (access(path, F_OK) < 0 && errno == ENOENT) {
		if (vocab != KVDLM_BYTE_VOCAB)
			return kvdlm_fail(err, errlen, -EBADMSG, "%s: vocab %u needs a tokenizer file %s",
			            model_path, vocab, path);
		r = kvdlm_tokenizer_bytes(ret);
		return r < 0 ? kvdlm_fail(err, errlen, r, "out of memory") : 0;
	}
	r = kvdlm_tokenizer_load(path, &t, err, errlen);
	if (r < 0)
		return r;
	if (t->vocab != vocab)
		return kvdlm_fail(err, errlen, -EBADMSG, "%s: vocab %u, the model's is %u", path, t->vocab,
		            vocab);
	*ret = TAKE_PTR(t);
	return 0;
}

/* ---- pieces ---- */

enum { C_LETTER, C_DIGIT, C_SPACE, C_NEWLINE, C_OTHER };

static int byte_class(uint8_t b) {
	if ((b >= 'A' && b <= 'Z') || (b >= 'a' && b <= 'z'))
		return C_LETTER;
	if (b >= '0' && b <= '9')
		return C_DIGIT;
	return b == ' ' ? C_SPACE : b == '\n' ? C_NEWLINE : C_OTHER;
}

int kvdlm_pieces(const void *text, size_t n, int (*piece)(const uint8_t *p, size_t size, void *userdata),
                 void *userdata) {
	const uint8_t *s = text;

	for (size_t i = 0; i < n;) {
		size_t start = i, j;
		int c = byte_class(s[i]), r;

		if (c == C_SPACE) {
			int next = i + 1 < n ? byte_class(s[i + 1]) : C_SPACE;

			if (next != C_LETTER && next != C_OTHER) {
				r = piece(s + i, 1, userdata);
				if (r < 0)
					return r;
				i++;
				continue;
			}
			c = next;
			i++;
		}
		if (c == C_DIGIT)
			for (j = i; j < n && j - i < 3 && byte_class(s[j]) == C_DIGIT; j++)
				;
		else if (c == C_NEWLINE)
			j = i + 1;
		else
			for (j = i; j < n && j - start < KVDLM_PIECE_MAX && byte_class(s[j]) == c; j++)
				;
		r = piece(s + start, j - start, userdata);
		if (r < 0)
			return r;
		i = j;
	}
	return 0;
}

/* ---- encoding ---- */

/* The tokens of one piece into out (room for size): see tokenizer.py's encode_piece(). */
static size_t encode_piece(const struct kvdlm_tokenizer *t, const uint8_t *p, size_t size, uint32_t *out) {
	size_t n = size;

	for (size_t i = 0; i < size; i++)
		out[i] = p[i];
	while (n > 1) {
		uint32_t best = UINT32_MAX;
		size_t at = 0;

		for (size_t k = 0; k + 1 < n; k++) {
			uint32_t r = pair_rank(t, out[k], out[k + 1]);

			if (r < best) {
				best = r;
				at = k;
			}
		}
		if (best == UINT32_MAX)
			break;
		out[at] = KVDLM_BYTE_VOCAB + best;
		memmove(out + at + 1, out + at + 2, (n - at - 2) * sizeof(*out));
		n--;
	}
	return n;
}

struct encoding {
	const struct kvdlm_tokenizer *t;
	uint32_t *out; /* NULL: count only */
	size_t n;
};

static int encode_one(const uint8_t *p, size_t size, void *userdata) {
	struct encoding *e = userdata;
	uint32_t scratch[KVDLM_PIECE_MAX];

	e->n += encode_piece(e->t, p, size, e->out ? e->out + e->n : scratch);
	return 0;
}

size_t kvdlm_tokenizer_encode(const struct kvdlm_tokenizer *t, const void *text, size_t n, uint32_t *out) {
	struct encoding e = { t, out, 0 };

	if (t->vocab == KVDLM_BYTE_VOCAB) {
		for (size_t i = 0; i < n; i++)
			out[i] = ((const uint8_t *)text)[i];
		return n;
	}
	(void)kvdlm_pieces(text, n, encode_one, &e);
	return e.n;
}

size_t kvdlm_tokenizer_count(const struct kvdlm_tokenizer *t, const void *text, size_t n) {
	struct encoding e = { t, NULL, 0 };

	if (t->vocab == KVDLM_BYTE_VOCAB)
		return n;
	(void)kvdlm_pieces(text, n, encode_one, &e);
	return e.n;
}

const uint8_t *kvdlm_tokenizer_token(const struct kvdlm_tokenizer *t, uint32_t id, size_t *size) {
	if (id >= t->vocab)
		return NULL;
	*size = t->offset[id + 1] - t->offset[id];
	return t->bytes + t->offset[id];
}
