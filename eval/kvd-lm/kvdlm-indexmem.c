/* SPDX-License-Identifier: MIT */
/* The .kvdim loader; see indexmem.h and README.md, "IndexMem". */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "basic/macro.h"
#include "kvdlm-indexmem.h"

#define HEADER_BYTES 128u
#define HEADER_CRC_SPAN 60u
/* Larger than any file a checked shape makes (64 heads of 256 over dim 65536 is 1 GiB). */
#define FILE_MAX (UINT64_C(1) << 31)

static const char magic[8] = { 'K', 'V', 'D', 'I', 'M', 0, 0, 0 };

/* fp32 elements of one layer: wq, wk, ww, bw, lq, lb, lr, lbias (README.md's order). */
static uint64_t layer_floats(uint64_t dim, uint64_t ih, uint64_t id, uint64_t hd, uint64_t qh) {
	return ih * id * dim + id * dim + ih * dim + ih + hd * hd + hd + hd * hd + qh;
}

struct kvdlm_indexmem *kvdlm_indexmem_free(struct kvdlm_indexmem *im) {
	if (im) {
		free(im->indexer);
		free(im->readout);
		free(im->bias);
		free(im->payload_);
		free(im);
	}
	return NULL;
}

int kvdlm_indexmem_load(const char *path, const struct kvdlm_config *cfg,
                        struct kvdlm_indexmem **ret, char *err, size_t errlen) {
	_cleanup_(kvdlm_indexmem_freep) struct kvdlm_indexmem *im = NULL;
	_cleanup_(closep) int fd = -EBADF;
	_cleanup_(freep) uint8_t *buf = NULL;
	uint32_t f[10], ih, id, hd;
	uint64_t payload, want;
	struct stat st;
	const float *p;
	ssize_t k;

	if (!path || !cfg || !ret)
		return kvdlm_fail(err, errlen, -EINVAL, "no IndexMem file given");
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0 || fstat(fd, &st) < 0) {
		int r = negative_errno();

		return kvdlm_fail(err, errlen, r, "%s: %s", path, strerror(-r));
	}
	if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size < HEADER_BYTES || (uint64_t)st.st_size > FILE_MAX)
		return kvdlm_fail(err, errlen, -EBADMSG, "%s: not a .kvdim file (size %llu)", path,
		            (unsigned long long)st.st_size);
	buf = malloc((size_t)st.st_size);
	if (!buf)
		return kvdlm_fail(err, errlen, -ENOMEM, "%s: out of memory", path);
	k = pread(fd, buf, (size_t)st.st_size, 0);
	if (k != st.st_size)
		return kvdlm_fail(err, errlen, k < 0 ? negative_errno() : -EBADMSG, "%s: short read", path);
	if (memcmp(buf, magic, sizeof(magic)) != 0 || kvdlm_le32(buf + 8) != 1 || kvdlm_le32(buf + 12) != HEADER_BYTES)
		return kvdlm_fail(err, errlen, -EBADMSG, "%s: bad magic or version, not a version 1 .kvdim file",
		            path);
	if (kvdlm_crc32(0, buf, HEADER_CRC_SPAN) != kvdlm_le32(buf + 60))
		return kvdlm_fail(err, errlen, -EBADMSG, "%s: header CRC-32 mismatch", path);
	for (int i = 0; i < 10; i++)
		f[i] = kvdlm_le32(buf + 16 + 4 * i);
	/* layers, dim, q_heads, kv_heads, head_dim, index_heads, index_dim, zero */
	if (f[0] != cfg->layers || f[1] != cfg->dim || f[2] != cfg->q_heads || f[3] != cfg->kv_heads ||
	    f[4] != cfg->head_dim)
		return kvdlm_fail(err, errlen, -EBADMSG, "%s: made for another model shape (%u layers, dim %u, "
		            "%u/%u heads of %u)", path, f[0], f[1], f[2], f[3], f[4]);
	ih = f[5], id = f[6], hd = f[4];
	if (ih == 0 || ih > KVD_INDEX_HEADS_MAX || id == 0 || id > KVD_INDEX_DIM_MAX || f[7] != 0)
		return kvdlm_fail(err, errlen, -EBADMSG, "%s: index heads %u of %u out of range", path, ih, id);
	memcpy(&payload, buf + 48, 8);
	want = 4 * layer_floats(cfg->dim, ih, id, hd, cfg->q_heads) * cfg->layers;
	if (payload != want || (uint64_t)st.st_size != HEADER_BYTES + payload)
		return kvdlm_fail(err, errlen, -EBADMSG, "%s: payload of %llu bytes, the shape needs %llu", path,
		            (unsigned long long)payload, (unsigned long long)want);
	if (kvdlm_crc32(0, buf + HEADER_BYTES, (size_t)payload) != kvdlm_le32(buf + 56))
		return kvdlm_fail(err, errlen, -EBADMSG, "%s: payload CRC-32 mismatch", path);

	im = calloc(1, sizeof(*im));
	if (!im)
		return kvdlm_fail(err, errlen, -ENOMEM, "%s: out of memory", path);
	im->layers = cfg->layers, im->index_heads = ih, im->index_dim = id;
	im->indexer = calloc(cfg->layers, sizeof(*im->indexer));
	im->readout = calloc(cfg->layers, sizeof(*im->readout));
	im->bias = calloc(cfg->layers, sizeof(*im->bias));
	im->payload_ = malloc((size_t)payload);
	if (!im->indexer || !im->readout || !im->bias || !im->payload_)
		return kvdlm_fail(err, errlen, -ENOMEM, "%s: out of memory", path);
	/* fp32 little-endian in the file, as in the host (model.c asserts it). */
	memcpy(im->payload_, buf + HEADER_BYTES, (size_t)payload);
	p = im->payload_;
	for (uint32_t l = 0; l < cfg->layers; l++) {
		struct kvd_indexer_layer *x = &im->indexer[l];
		struct kvd_latent_readout *y = &im->readout[l];

		*x = (struct kvd_indexer_layer){ .dim = cfg->dim, .heads = ih, .index_dim = id };
		x->wq = p, p += (size_t)ih * id * cfg->dim;
		x->wk = p, p += (size_t)id * cfg->dim;
		x->ww = p, p += (size_t)ih * cfg->dim;
		x->bw = p, p += ih;
		*y = (struct kvd_latent_readout){ .dim = hd };
		y->lq = p, p += (size_t)hd * hd;
		y->lb = p, p += hd;
		y->lr = p, p += (size_t)hd * hd;
		im->bias[l] = p, p += cfg->q_heads;
	}
	*ret = TAKE_PTR(im);
	return 0;
}
