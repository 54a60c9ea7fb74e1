/* SPDX-License-Identifier: MIT */
/* Loading and checking .kvdlm weights; see model.h. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "basic/macro.h"
#include "format.h"
#include "model.h"

static const char kvdlm_magic[8] = { 'K', 'V', 'D', 'L', 'M', 0, 0, 0 };
#define KVDLM_VERSION 1u
/* The header CRC covers bytes 0..67; it sits at 68. */
#define HEADER_CRC_SPAN 68u

/* ---- the header ---- */

static uint64_t le64(const uint8_t *p) {
	return (uint64_t)kvdlm_le32(p) | (uint64_t)kvdlm_le32(p + 4) << 32;
}

static float lef32(const uint8_t *p) {
	uint32_t u = kvdlm_le32(p);
	float f;

	memcpy(&f, &u, 4);
	return f;
}

/* fp32 elements of the payload of cfg, or 0 when they overflow (never for a checked shape). */
static uint64_t config_elements(const struct kvdlm_config *c) {
	uint64_t qd = (uint64_t)c->q_heads * c->head_dim, kd = (uint64_t)c->kv_heads * c->head_dim;
	uint64_t layer = 2 * (uint64_t)c->dim + 2 * qd * c->dim + 2 * kd * c->dim +
	                 3 * (uint64_t)c->ffn * c->dim;

	/* With the bounds of config_check every term is below 2^52: no overflow. */
	return 2 * (uint64_t)c->vocab * c->dim + (uint64_t)c->layers * layer + c->dim;
}

static int config_check(const struct kvdlm_config *c, const char *name, char *err, size_t errlen) {
	static const struct {
		const char *field;
		size_t off;
		uint32_t max;
	} fields[] = {
		{ "vocab", offsetof(struct kvdlm_config, vocab), KVDLM_VOCAB_MAX },
		{ "dim", offsetof(struct kvdlm_config, dim), KVDLM_DIM_MAX },
		{ "layers", offsetof(struct kvdlm_config, layers), KVD_LAYERS_MAX },
		{ "q_heads", offsetof(struct kvdlm_config, q_heads), KVD_HEADS_MAX },
		{ "kv_heads", offsetof(struct kvdlm_config, kv_heads), KVD_HEADS_MAX },
		{ "head_dim", offsetof(struct kvdlm_config, head_dim), KVD_HEAD_DIM_MAX },
		{ "ffn", offsetof(struct kvdlm_config, ffn), KVDLM_FFN_MAX },
		{ "max_positions", offsetof(struct kvdlm_config, max_positions), UINT32_MAX },
	};

	for (size_t i = 0; i < ELEMENTSOF(fields); i++) {
		uint32_t v;

		memcpy(&v, (const char *)c + fields[i].off, sizeof(v));
		if (v < 1)
			return kvdlm_fail(err, errlen, -EINVAL, "%s: %s is 0, must be >= 1", name, fields[i].field);
		if (v > fields[i].max)
			return kvdlm_fail(err, errlen, -EINVAL, "%s: %s is %u, at most %u is supported", name,
			            fields[i].field, v, fields[i].max);
	}
	if (c->q_heads % c->kv_heads)
		return kvdlm_fail(err, errlen, -EINVAL, "%s: q_heads %u is not a multiple of kv_heads %u", name,
		            c->q_heads, c->kv_heads);
	if (c->head_dim % 2)
		return kvdlm_fail(err, errlen, -EINVAL, "%s: head_dim %u is odd", name, c->head_dim);
	if (c->vocab < KVDLM_BYTE_VOCAB)
		return kvdlm_fail(err, errlen, -EINVAL, "%s: vocab is %u, must be %u..%u", name, c->vocab,
		            KVDLM_BYTE_VOCAB, KVDLM_VOCAB_MAX);
	if (!(isfinite(c->rope_theta) && c->rope_theta > 0))
		return kvdlm_fail(err, errlen, -EINVAL, "%s: rope_theta %g is not a positive number", name,
		            (double)c->rope_theta);
	if (!(isfinite(c->norm_eps) && c->norm_eps > 0))
		return kvdlm_fail(err, errlen, -EINVAL, "%s: norm_eps %g is not a positive number", name,
		            (double)c->norm_eps);
	return 0;
}

/*
 * Checks header h of file `name` in the order kvdlm.py does; on success fills *cfg, the
 * payload bytes and the payload CRC.
 */
static int header_parse(const uint8_t *h, const char *name, struct kvdlm_config *cfg,
                        uint64_t *ret_payload, uint32_t *ret_crc, char *err, size_t errlen) {
	uint32_t version = kvdlm_le32(h + 8), hbytes = kvdlm_le32(h + 12), stored = kvdlm_le32(h + 68), got;
	uint64_t payload, want;
	int r;

	if (memcmp(h, kvdlm_magic, sizeof(kvdlm_magic)) != 0)
		return kvdlm_fail(err, errlen, -EBADMSG, "%s: bad magic, not a .kvdlm file", name);
	if (version != KVDLM_VERSION)
		return kvdlm_fail(err, errlen, -EOPNOTSUPP, "%s: version %u, only %u is known", name, version,
		            KVDLM_VERSION);
	if (hbytes != KVDLM_HEADER_BYTES)
		return kvdlm_fail(err, errlen, -EBADMSG, "%s: header bytes %u, expected %u", name, hbytes,
		            KVDLM_HEADER_BYTES);
	got = kvdlm_crc32(0, h, HEADER_CRC_SPAN);
	if (got != stored)
		return kvdlm_fail(err, errlen, -EBADMSG,
		            "%s: header CRC-32 mismatch (stored %08x, computed %08x)", name, stored, got);
	*cfg = (struct kvdlm_config){
		.vocab = kvdlm_le32(h + 16),
		.dim = kvdlm_le32(h + 20),
		.layers = kvdlm_le32(h + 24),
		.q_heads = kvdlm_le32(h + 28),
		.kv_heads = kvdlm_le32(h + 32),
		.head_dim = kvdlm_le32(h + 36),
		.ffn = kvdlm_le32(h + 40),
		.max_positions = kvdlm_le32(h + 44),
		.rope_theta = lef32(h + 48),
		.norm_eps = lef32(h + 52),
	};
	r = config_check(cfg, name, err, errlen);
	if (r < 0)
		return r;
	payload = le64(h + 56);
	want = 4 * config_elements(cfg);
	if (payload != want)
		return kvdlm_fail(err, errlen, -EINVAL,
		            "%s: payload bytes %llu do not match the shape (%llu expected)", name,
		            (unsigned long long)payload, (unsigned long long)want);
	*ret_payload = payload;
	*ret_crc = kvdlm_le32(h + 64);
	return 0;
}

/* ---- loading ---- */

/* Reads exactly n bytes at offset off; -EBADMSG when the file ends first. */
static int read_full(int fd, void *buf, size_t n, uint64_t off) {
	uint8_t *p = buf;

	while (n > 0) {
		ssize_t k = pread(fd, p, MIN(n, (size_t)1 << 30), (off_t)off);

		if (k < 0) {
			if (errno == EINTR)
				continue;
			return negative_errno();
		}
		if (k == 0)
			return -EBADMSG;
		p += k;
		off += (uint64_t)k;
		n -= (size_t)k;
	}
	return 0;
}

/* Points the model's tensors into its payload, in file order. */
static void model_views(struct kvdlm_model *m) {
	const struct kvdlm_config *c = &m->cfg;
	size_t qd = (size_t)c->q_heads * c->head_dim, kd = (size_t)c->kv_heads * c->head_dim;
	const float *p = m->payload_;

	m->tok_emb = p;
	p += (size_t)c->vocab * c->dim;
	for (uint32_t l = 0; l < c->layers; l++) {
		struct kvdlm_layer *L = &m->layers[l];

		L->attn_norm = p;
		p += c->dim;
		L->wq = p;
		p += qd * c->dim;
		L->wk = p;
		p += kd * c->dim;
		L->wv = p;
		p += kd * c->dim;
		L->wo = p;
		p += (size_t)c->dim * qd;
		L->ffn_norm = p;
		p += c->dim;
		L->w_gate = p;
		p += (size_t)c->ffn * c->dim;
		L->w_up = p;
		p += (size_t)c->ffn * c->dim;
		L->w_down = p;
		p += (size_t)c->dim * c->ffn;
	}
	m->final_norm = p;
	p += c->dim;
	m->lm_head = p;
}

struct kvdlm_model *kvdlm_model_free(struct kvdlm_model *m) {
	if (!m)
		return NULL;
	free(m->layers);
	free(m->payload_);
	free(m);
	return NULL;
}

int kvdlm_model_load(const char *path, struct kvdlm_model **ret, char *err, size_t errlen) {
	_cleanup_(kvdlm_model_freep) struct kvdlm_model *m = NULL;
	_cleanup_(closep) int fd = -EBADF;
	uint8_t h[KVDLM_HEADER_BYTES];
	uint64_t payload = 0;
	uint32_t crc = 0, got;
	struct stat st;
	int r;

	if (!path || !ret)
		return kvdlm_fail(err, errlen, -EINVAL, "no model file given");
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		r = negative_errno();
		return kvdlm_fail(err, errlen, r, "%s: %s", path, strerror(-r));
	}
	if (fstat(fd, &st) < 0) {
		r = negative_errno();
		return kvdlm_fail(err, errlen, r, "%s: %s", path, strerror(-r));
	}
	if (S_ISDIR(st.st_mode))
		return kvdlm_fail(err, errlen, -EISDIR, "%s: is a directory", path);
	if (!S_ISREG(st.st_mode))
		return kvdlm_fail(err, errlen, -EINVAL, "%s: not a regular file", path);
	if ((uint64_t)st.st_size < KVDLM_HEADER_BYTES)
		return kvdlm_fail(err, errlen, -EBADMSG, "%s: %llu bytes, shorter than the %u-byte header",
		            path, (unsigned long long)st.st_size, KVDLM_HEADER_BYTES);
	r = read_full(fd, h, sizeof(h), 0);
	if (r < 0)
		return kvdlm_fail(err, errlen, r, "%s: reading the header: %s", path, strerror(-r));

	m = calloc(1, sizeof(*m));
	if (!m)
		return kvdlm_fail(err, errlen, -ENOMEM, "%s: out of memory", path);
	r = header_parse(h, path, &m->cfg, &payload, &crc, err, errlen);
	if (r < 0)
		return r;
	/* The size is checked before anything of the payload's size is allocated. */
	if ((uint64_t)st.st_size != KVDLM_HEADER_BYTES + payload)
		return kvdlm_fail(err, errlen, -EBADMSG, "%s: file size %llu is not header + payload (%llu)",
		            path, (unsigned long long)st.st_size,
		            (unsigned long long)(KVDLM_HEADER_BYTES + payload));
	if (payload > SIZE_MAX / 2)
		return kvdlm_fail(err, errlen, -ENOMEM, "%s: payload of %llu bytes does not fit in memory",
		            path, (unsigned long long)payload);
	m->params = payload / 4;
	m->layers = calloc(m->cfg.layers, sizeof(*m->layers));
	if (!m->layers || posix_memalign((void **)&m->payload_, 64, (size_t)payload) != 0)
		return kvdlm_fail(err, errlen, -ENOMEM, "%s: out of memory for %llu bytes of weights", path,
		            (unsigned long long)payload);
	r = read_full(fd, m->payload_, (size_t)payload, KVDLM_HEADER_BYTES);
	if (r == -EBADMSG)
		return kvdlm_fail(err, errlen, r, "%s: truncated while reading the payload", path);
	if (r < 0)
		return kvdlm_fail(err, errlen, r, "%s: reading the payload: %s", path, strerror(-r));
	got = kvdlm_crc32(0, m->payload_, (size_t)payload);
	if (got != crc)
		return kvdlm_fail(err, errlen, -EBADMSG,
		            "%s: payload CRC-32 mismatch (stored %08x, computed %08x)", path, crc, got);
	/* fp32 little-endian in the file; this code runs on little-endian hosts only. */
	_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "little-endian host expected");
	model_views(m);
	*ret = TAKE_PTR(m);
	return 0;
}
