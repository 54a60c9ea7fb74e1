/* SPDX-License-Identifier: MIT */
/*
 * libkvd, the sequences: opening, growing and releasing sequences, and reading their
 * descriptors (see the top of kvd/kvd.h for the layout).
 *
 * The daemon writes descriptors; we only map them read-only. Their geometry is checked once
 * when the sequence opens, and every count or index read afterwards is checked against it
 * before it is used, so that a broken descriptor yields -EINVAL, not a wild pointer.
 *
 * Models with eviction also get an observation buffer per sequence, which the daemon
 * creates and both sides may write: the engine its query windows and their stamps, the
 * daemon anything at all. Its geometry is checked once at open and copied into the kvd_seq,
 * so nothing read from the buffer later can send a write elsewhere.
 */

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "client-internal.h"
#include "cuda-import.h"
#include "common/layout.h"
#include "basic/macro.h"
#include "kvd/kvd.h"
#include "wire.h"

/* Address of a block in this process, or NULL when its chunk is not mapped here or the
 * block does not fit in it. */
static const void *seq_block_addr(const kvd_seq *s, struct kvd_block_ref ref) {
	uint64_t bytes = 0, need = s->hdr.block_bytes;
	char *base = chunk_addr(s->client, ref.chunk_id, &bytes);

	if (!base || bytes < need || ref.index > (bytes - need) / s->block_stride)
		return NULL;
	return base + (uint64_t)ref.index * s->block_stride;
}

/* Checks that an array of n entries of `entry` bytes at off fits in a region of size bytes
 * after its header of head bytes. */
static bool array_fits(uint64_t off, uint64_t n, uint64_t entry, uint64_t head, uint64_t size) {
	uint64_t len;

	if (off < head || off > size)
		return false;
	if (mul_u64(n, entry, &len) < 0)
		return false;
	return len <= size - off;
}

/* array_fits() for a descriptor array after the header h, aligned for its 4-byte members. */
static bool desc_array_fits(const struct kvd_seq_desc *h, uint64_t off, uint64_t n,
			    uint64_t entry, uint64_t size) {
	return off % 4 == 0 && array_fits(off, n, entry, h->header_bytes, size);
}

/*
 * Checks the geometry of a freshly mapped descriptor once, on h, the copy of its header
 * (layout_desc_header), so that the accessors can trust it afterwards: the daemon only
 * rewrites the counts and tables, never the geometry.
 */
static int desc_check(const struct kvd_seq_desc *d, uint64_t size, uint64_t seq_id,
		      const struct model *m) {
	uint64_t n_tables, block_bytes, index_bytes;

	if (d->magic != KVD_SEQ_DESC_MAGIC || d->version != KVD_SEQ_DESC_VERSION)
		return -EPROTO;
	if (d->total_bytes != size || d->seq_id != seq_id)
		return -EPROTO;
	if (d->layers == 0 || d->kv_heads == 0 || d->head_dim == 0 || d->block_tokens == 0 ||
	    d->max_tokens == 0 || layout_dtype_bytes(d->dtype) == 0)
		return -EPROTO;
	if (d->layout == KVD_LAYOUT_PER_LAYER)
		n_tables = d->layers;
	else if (d->layout == KVD_LAYOUT_PER_HEAD)
		n_tables = (uint64_t)d->layers * d->kv_heads;
	else
		return -EPROTO;
	if (d->n_tables != n_tables)
		return -EPROTO;
	if (d->max_blocks < DIV_ROUND_UP((uint64_t)d->max_tokens, d->block_tokens))
		return -EPROTO;
	/* K then V of block_tokens rows, for every head of the block, then the index keys: the
	 * offsets in layout.h are only right for exactly this size. */
	if (mul_u64(2 * layout_row_bytes(d), d->block_tokens, &block_bytes) < 0 ||
	    mul_u64(block_bytes, d->layout == KVD_LAYOUT_PER_LAYER ? d->kv_heads : 1,
		    &block_bytes) < 0)
		return -EPROTO;
	if (d->index_dim > KVD_INDEX_DIM_MAX || d->index_heads > KVD_INDEX_HEADS_MAX || !d->index_dim != !d->index_heads ||
	    (d->index_dim && d->index_offset != block_bytes) || (!d->index_dim && d->index_offset))
		return -EPROTO;
	index_bytes = (uint64_t)d->block_tokens * layout_index_row_bytes(d);
	if (d->block_bytes != block_bytes + index_bytes)
		return -EPROTO;
	/* n_tables is a u32 now, so neither product overflows. */
	if (!desc_array_fits(d, d->tokens_offset, n_tables, 4, size) ||
	    !desc_array_fits(d, d->positions_offset, n_tables * d->max_tokens, 4, size) ||
	    !desc_array_fits(d, d->blocks_offset, n_tables * d->max_blocks, 8, size))
		return -EPROTO;
	if (d->compensation == KVD_COMPENSATION_MOMENTS || d->compensation == KVD_COMPENSATION_LATENT) {
		/* moments_blocks, a count the daemon rewrites, is read from the mapping: it must be
		 * in the header the daemon wrote. */
		if (d->header_bytes < offsetof(struct kvd_seq_desc, moments_bytes) + 8 ||
		    d->moments_bytes != (d->compensation == KVD_COMPENSATION_MOMENTS
						 ? KVD_MOMENTS_BYTES(d->head_dim)
						 : KVD_LATENT_BYTES(d->head_dim)) ||
		    !desc_array_fits(d, d->moments_offset, (uint64_t)d->layers * d->kv_heads,
				     sizeof(struct kvd_block_ref), size))
			return -EPROTO;
	} else if (d->compensation != KVD_COMPENSATION_NONE)
		return -EPROTO;
	if (m && m->known && (m->compensation != d->compensation || m->index_dim != d->index_dim ||
			      m->index_heads != d->index_heads))
		return -EPROTO;
	if (m && m->known &&
	    (m->layers != d->layers || m->kv_heads != d->kv_heads || m->head_dim != d->head_dim ||
	     m->dtype != d->dtype || m->block_tokens != d->block_tokens || m->layout != d->layout ||
	     (m->block_bytes != 0 && m->block_bytes != d->block_bytes)))
		return -EPROTO;
	return 0;
}

/* Maps and checks the descriptor; takes ownership of fd. */
static int seq_map_desc(kvd_seq *s, int fd_in, uint64_t announced, const struct model *m) {
	_cleanup_(closep) int fd = fd_in;
	struct stat st;
	void *p;
	int r;

	if (fstat(fd, &st) < 0)
		return negative_errno();
	if (st.st_size < (off_t)KVD_SEQ_DESC_HEADER_MIN || (uint64_t)st.st_size > SIZE_MAX ||
	    (announced != 0 && announced != (uint64_t)st.st_size))
		return -EPROTO;
	p = mmap(NULL, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED)
		return negative_errno();
	s->desc = p;
	s->desc_bytes = st.st_size;
	/* Like the chunks, so that fork() children hold nothing of the parent's sequences and
	 * unref there never needs to unmap. */
	if (madvise(p, st.st_size, MADV_DONTFORK) < 0)
		return negative_errno();
	r = layout_desc_header(p, st.st_size, s->client->features & KVD_FEATURE_SEQ_HEADER, &s->hdr);
	if (r < 0)
		return r;
	r = desc_check(&s->hdr, st.st_size, s->id, m);
	if (r < 0)
		return r;
	s->block_stride = ALIGN_TO(s->hdr.block_bytes, LAYOUT_BLOCK_ALIGN);
	return 0;
}

/*
 * Checks a copy of the observation buffer's header against the buffer's size and the model
 * (m, when known): the layer windows must fit whole, the stamps too, aligned, and neither
 * may overlap the other, since the engine writes both.
 */
static int obs_check(const struct kvd_obs_header *h, uint64_t size, const struct model *m) {
	uint64_t elem = layout_dtype_bytes(h->dtype), window_bytes, stamps_end, q_end;

	if (h->magic != KVD_OBS_MAGIC || h->version != KVD_OBS_VERSION || h->total_bytes != size)
		return -EPROTO;
	if (h->layers == 0 || h->q_heads == 0 || h->window == 0 || h->head_dim == 0 || elem == 0)
		return -EPROTO;
	if (m && (m->layers != h->layers || m->q_heads != h->q_heads || m->window != h->window ||
		  m->head_dim != h->head_dim || m->dtype != h->dtype))
		return -EPROTO;
	if (mul_u64((uint64_t)h->q_heads * h->window, h->head_dim, &window_bytes) < 0 ||
	    mul_u64(window_bytes, elem, &window_bytes) < 0 || h->layer_bytes < window_bytes)
		return -EPROTO;
	if (h->stamps_offset % 8 != 0 || h->q_offset % elem != 0 ||
	    !array_fits(h->stamps_offset, h->layers, 8, h->header_bytes, size) ||
	    !array_fits(h->q_offset, h->layers, h->layer_bytes, h->header_bytes, size))
		return -EPROTO;
	/* Both ends are at most size now, so neither sum overflows. */
	stamps_end = h->stamps_offset + (uint64_t)h->layers * 8;
	q_end = h->q_offset + (uint64_t)h->layers * h->layer_bytes;
	if (h->stamps_offset < q_end && h->q_offset < stamps_end)
		return -EPROTO;
	if (m && (m->index_heads != h->index_heads || m->index_dim != h->index_dim))
		return -EPROTO;
	if (h->index_dim) {
		/* index_heads <= 64, index_dim <= 256, window <= 256: no overflow. */
		uint64_t iq_bytes = (uint64_t)h->window * h->index_heads * h->index_dim * elem, iq_end;

		if (h->index_heads > KVD_INDEX_HEADS_MAX || h->index_dim > KVD_INDEX_DIM_MAX || h->iq_layer_bytes < iq_bytes ||
		    h->iq_offset % elem != 0 ||
		    !array_fits(h->iq_offset, h->layers, h->iq_layer_bytes, h->header_bytes, size))
			return -EPROTO;
		iq_end = h->iq_offset + (uint64_t)h->layers * h->iq_layer_bytes;
		if ((h->iq_offset < q_end && h->q_offset < iq_end) ||
		    (h->iq_offset < stamps_end && h->stamps_offset < iq_end))
			return -EPROTO;
	}
	return 0;
}

/* Maps the observation buffer writable and checks it; takes ownership of fd. */
static int seq_map_obs(kvd_seq *s, int fd_in, uint64_t announced, const struct model *m) {
	_cleanup_(closep) int fd = fd_in;
	struct kvd_obs_header h;
	struct stat st;
	int seals, r;
	void *p;

	if (fstat(fd, &st) < 0)
		return negative_errno();
	if (announced < KVD_OBS_HEADER_MIN || announced > SIZE_MAX || (uint64_t)st.st_size != announced)
		return -EPROTO;
	/* We write into it: a file the daemon could shrink would turn writes into SIGBUS. */
	seals = fcntl(fd, F_GET_SEALS);
	if (seals < 0 || !(seals & F_SEAL_SHRINK))
		return -EPROTO;
	p = mmap(NULL, announced, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED)
		return negative_errno();
	s->obs = p;
	s->obs_bytes = announced;
	/* Like the descriptor: a fork() child holds nothing of the parent's sequences. */
	if (madvise(p, announced, MADV_DONTFORK) < 0)
		return negative_errno();
	/* A copy: the daemon may write the header while, or after, we check it. */
	r = layout_obs_header(p, announced, &h);
	if (r < 0)
		return r;
	r = obs_check(&h, announced, m);
	if (r < 0)
		return r;
	s->obs_layers = h.layers;
	s->obs_stamps = (uint64_t *)((char *)p + h.stamps_offset);
	s->obs_q = (char *)p + h.q_offset;
	s->obs_layer_bytes = h.layer_bytes;
	if (h.index_dim) {
		s->obs_iq = (char *)p + h.iq_offset;
		s->obs_iq_layer_bytes = h.iq_layer_bytes;
	}
	return 0;
}

/* Unmaps what the sequence has mapped; not in a fork() child, which has none of it. */
static void seq_unmap(kvd_seq *s) {
	if (seq_forked(s))
		return;
	if (s->desc)
		munmap((void *)s->desc, s->desc_bytes);
	if (s->obs)
		munmap(s->obs, s->obs_bytes);
	s->desc = NULL;
	s->obs = NULL;
}

static kvd_seq *seq_free(kvd_seq *s) {
	if (!s)
		return NULL;
	seq_unmap(s);
	kvd_client_unref(s->client);
	free(s);
	return NULL;
}

static void seq_freep(kvd_seq **s) {
	seq_free(*s);
}

/* Releases sequence seq_id without waiting for the answer: one the daemon gave this
 * connection but that it cannot use, and would otherwise live as long as the connection.
 * Under c's lock. */
static void seq_give_back(kvd_client *c, uint64_t seq_id) {
	Kvd__V1__SeqRelease rel = KVD__V1__SEQ_RELEASE__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;

	rel.has_seq_id = true;
	rel.seq_id = seq_id;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_RELEASE;
	env.seq_release = &rel;
	(void)client_request_unwaited(c, &env);
}

/* Opens a sequence of model_id: a fork of sequence fork_of (not 0), or one starting with
 * the blocks of its n_keys prefix keys that the daemon finds. */
static int seq_open(kvd_client *c, int model_id, uint32_t max_tokens, uint64_t fork_of,
                    const uint8_t *keys, uint32_t n_keys, const uint32_t *tokens,
                    uint32_t group_size, uint64_t group_of, kvd_seq **ret) {
	Kvd__V1__SeqOpen req = KVD__V1__SEQ_OPEN__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
	_cleanup_(seq_freep) kvd_seq *s = NULL;
	_cleanup_(closep) int keys_fd = -EBADF;
	const Kvd__V1__SeqOpenReply *rep;
	int fds[WIRE_FDS_MAX];
	bool opened = false;
	uint32_t nfds = 0;
	int r;

	if (!c || !ret || model_id < 0 || max_tokens == 0 || (n_keys > 0 && !keys))
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	if (n_keys > 0 && !(c->features & KVD_FEATURE_PREFIX))
		return client_error(c, -EOPNOTSUPP, "kvd_seq_open_params: the daemon cannot share "
		                    "prefixes (it predates KVD_1.10)");
	if ((group_size || group_of) && !(c->features & KVD_FEATURE_GROUPS))
		return client_error(c, -EOPNOTSUPP, "kvd_seq_open_params: the daemon has no "
		                    "sequence groups (it predates KVD_1.10)");
	/* The keys travel in a memfd: 2,048 of them (a 32k-token prompt) pass a frame. The
	 * token ids follow them. */
	if (n_keys > 0) {
		const struct model *m;
		_cleanup_(freep) uint8_t *buf = NULL;
		uint64_t key_bytes = (uint64_t)n_keys * KVD_KEY_BYTES, tok_bytes = 0;

		client_lock(c);
		m = model_find(c, model_id);
		if (tokens && m)
			tok_bytes = (uint64_t)n_keys * m->block_tokens * sizeof(*tokens);
		client_unlock(c);
		if (tokens && !m)
			return -EINVAL;
		buf = malloc(key_bytes + tok_bytes);
		if (!buf)
			return -ENOMEM;
		memcpy(buf, keys, key_bytes);
		if (tok_bytes)
			memcpy(buf + key_bytes, tokens, tok_bytes);
		r = client_sealed_memfd("kvd-prefix-keys", buf, key_bytes + tok_bytes, &keys_fd);
		if (r < 0)
			return r;
	}
	s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	s->client = kvd_client_ref(c);
	s->epoch = c->epoch;
	s->pid = c->pid;
	s->model_id = model_id;

	req.has_model_id = true;
	req.model_id = (uint32_t)model_id;
	req.has_max_tokens = true;
	req.max_tokens = max_tokens;
	req.has_fork_of = fork_of != 0;
	req.fork_of = fork_of;
	req.has_prefix_blocks = n_keys > 0;
	req.prefix_blocks = n_keys;
	req.has_prefix_tokens = n_keys > 0 && tokens;
	req.prefix_tokens = n_keys > 0 && tokens;
	req.has_group_size = group_size != 0;
	req.group_size = group_size;
	req.has_group_of = group_of != 0;
	req.group_of = group_of;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_OPEN;
	env.seq_open = &req;

	client_lock(c);
	r = client_call_fd(c, &env, keys_fd, KVD__V1__ENVELOPE__BODY_SEQ_OPEN_REPLY, &reply, fds,
	                   &nfds);
	if (r >= 0) {
		const struct model *m = model_find(c, model_id);
		uint64_t obs_bytes;

		rep = reply->seq_open_reply;
		opened = rep->has_seq_id;
		s->id = rep->seq_id;
		obs_bytes = rep->has_observation_bytes ? rep->observation_bytes : 0;
		/* The descriptor's fd, then the observation buffer's when there is one. */
		if (nfds != (obs_bytes ? 2u : 1u) || !rep->has_seq_id ||
		    (m && m->obs_bytes != obs_bytes)) {
			close_fds(fds, nfds);
			r = -EPROTO;
		} else {
			r = seq_map_desc(s, fds[0],
					 rep->has_descriptor_bytes ? rep->descriptor_bytes : 0, m);
			if (obs_bytes != 0 && r >= 0)
				r = seq_map_obs(s, fds[1], obs_bytes, m);
			else if (obs_bytes != 0)
				safe_close(fds[1]);
		}
	}
	/* A sequence the daemon opened but we cannot use would live as long as the connection;
	 * release it right away. */
	if (r < 0 && opened)
		seq_give_back(c, s->id);
	client_unlock(c);
	if (r < 0)
		return r;

	*ret = TAKE_PTR(s);
	return 0;
}

static int do_seq_open(kvd_client *c, int model_id, uint32_t max_tokens, kvd_seq **ret) {
	return seq_open(c, model_id, max_tokens, 0, NULL, 0, NULL, 0, 0, ret);
}

int kvd_seq_open(kvd_client *c, int model_id, uint32_t max_tokens, kvd_seq **ret) {
	return (int)call_result(client_key(c), do_seq_open(c, model_id, max_tokens, ret), __func__);
}

static int do_seq_open_params(kvd_client *c, const kvd_open_params *params, kvd_seq **ret) {
	kvd_open_params p;
	int r;

	r = params_copy(&p, sizeof(p), params, KVD_OPEN_PARAMS_SIZE_1_10);
	if (r < 0)
		return r;
	if (p.reserved != 0)
		return -EINVAL;
	return seq_open(c, p.model_id, p.max_tokens, 0, p.prefix_keys, p.n_prefix_keys,
	                p.prefix_tokens, p.group_size, p.group_of, ret);
}

int kvd_seq_open_params(kvd_client *c, const kvd_open_params *p, kvd_seq **ret) {
	return (int)call_result(client_key(c), do_seq_open_params(c, p, ret), __func__);
}

static int64_t do_prefix_lookup(kvd_client *c, int model_id, const uint8_t *keys,
                                uint32_t n_keys, uint32_t *ret_cached) {
	Kvd__V1__PrefixLookup req = KVD__V1__PREFIX_LOOKUP__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
	_cleanup_(closep) int fd = -EBADF;
	const Kvd__V1__PrefixLookupReply *rep;
	int fds[WIRE_FDS_MAX];
	int64_t r;

	if (!c || model_id < 0 || n_keys == 0 || !keys)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	if (!(c->features & KVD_FEATURE_PREFIX))
		return client_error(c, -EOPNOTSUPP, "kvd_prefix_lookup: the daemon cannot share "
		                    "prefixes (it predates KVD_1.10)");
	r = client_sealed_memfd("kvd-prefix-keys", keys, (uint64_t)n_keys * KVD_KEY_BYTES, &fd);
	if (r < 0)
		return r;
	req.has_model_id = req.has_prefix_blocks = true;
	req.model_id = (uint32_t)model_id;
	req.prefix_blocks = n_keys;
	env.body_case = KVD__V1__ENVELOPE__BODY_PREFIX_LOOKUP;
	env.prefix_lookup = &req;
	client_lock(c);
	r = client_call_fd(c, &env, fd, KVD__V1__ENVELOPE__BODY_PREFIX_LOOKUP_REPLY, &reply, fds,
	                   NULL);
	if (r >= 0) {
		rep = reply->prefix_lookup_reply;
		if (!rep->has_blocks || rep->blocks > n_keys || rep->cached_blocks > rep->blocks)
			r = -EPROTO;
		else {
			r = rep->blocks;
			if (ret_cached)
				*ret_cached = rep->cached_blocks;
		}
	}
	client_unlock(c);
	return r;
}

int64_t kvd_prefix_lookup(kvd_client *c, int model_id, const uint8_t *keys, uint32_t n_keys,
                          uint32_t *ret_cached) {
	return call_result(client_key(c), do_prefix_lookup(c, model_id, keys, n_keys, ret_cached),
	                   __func__);
}

static int do_seq_fork(kvd_seq *s, kvd_seq **ret) {
	if (!s || !ret)
		return -EINVAL;
	if (seq_forked(s))
		return -ECHILD;
	if (seq_stale(s))
		return -ESTALE;
	if (!(s->client->features & KVD_FEATURE_FORK))
		return client_error(s->client, -EOPNOTSUPP, "kvd_seq_fork: the daemon cannot fork "
		                    "(it predates KVD_1.9)");
	return seq_open(s->client, s->model_id, s->hdr.max_tokens, s->id, NULL, 0, NULL, 0, 0, ret);
}

int kvd_seq_fork(kvd_seq *s, kvd_seq **ret) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_fork(s, ret), __func__);
}

/* Whether every block of the descriptor lies in a chunk mapped here. */
static bool seq_chunks_mapped(const kvd_seq *s) {
	const struct kvd_seq_desc *d = &s->hdr;

	for (uint32_t t = 0; t < d->n_tables; t++) {
		const struct kvd_block_ref *refs = layout_blocks_at(d, s->desc, t);
		uint32_t tokens = layout_tokens_at(d, s->desc)[t];

		if (tokens > d->max_tokens)
			return false;
		for (uint32_t b = 0; b < DIV_ROUND_UP(tokens, d->block_tokens); b++)
			if (!chunk_addr(s->client, refs[b].chunk_id, NULL))
				return false;
	}
	return true;
}

static int do_seq_claim(kvd_seq *s, int model_id) {
	Kvd__V1__SeqClaim req = KVD__V1__SEQ_CLAIM__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
	kvd_seq fresh = {};
	bool claimed = false;
	int fds[WIRE_FDS_MAX];
	uint32_t nfds = 0;
	kvd_client *c;
	int r;

	if (!s || model_id <= 0)
		return -EINVAL;
	if (seq_forked(s))
		return -ECHILD;
	c = s->client;
	if (!seq_stale(s))
		return 0;
	/* A daemon keeps no sequence with eviction: it does not keep observation buffers. */
	if (s->obs)
		return -EOPNOTSUPP;
	req.has_seq_id = true;
	req.seq_id = s->id;
	req.has_model_id = true;
	req.model_id = (uint32_t)model_id;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_CLAIM;
	env.seq_claim = &req;

	client_lock(c);
	/* The chunks come first, as grant events, mapped while the reply is awaited; the
	 * first error of those mappings is kept in grant_error. */
	c->grant_error = 0;
	r = client_call(c, &env, KVD__V1__ENVELOPE__BODY_SEQ_CLAIM_REPLY, false, &reply, fds, &nfds);
	if (r >= 0) {
		const Kvd__V1__SeqClaimReply *rep = reply->seq_claim_reply;

		claimed = true;
		fresh.client = c;
		fresh.pid = s->pid;
		fresh.id = s->id;
		if (nfds != 1 || !rep->has_seq_id || rep->seq_id != s->id) {
			close_fds(fds, nfds);
			r = -EPROTO;
		} else
			r = seq_map_desc(&fresh, fds[0],
					 rep->has_descriptor_bytes ? rep->descriptor_bytes : 0,
					 model_find(c, model_id));
		/* A chunk that could not be mapped (its grant event's mmap failed). */
		if (r >= 0 && !seq_chunks_mapped(&fresh))
			r = c->grant_error < 0 ? c->grant_error : -EPROTO;
		c->grant_error = 0;
	}
	if (r >= 0) {
		/* Nobody reads s meanwhile (the contract), so the swap needs no ordering. */
		munmap((void *)s->desc, s->desc_bytes);
		s->desc = fresh.desc;
		s->desc_bytes = fresh.desc_bytes;
		s->hdr = fresh.hdr;
		s->block_stride = fresh.block_stride;
		s->epoch = c->epoch;
		s->model_id = model_id;
	} else if (claimed) {
		if (fresh.desc)
			munmap((void *)fresh.desc, fresh.desc_bytes);
		/* Ours now, but unusable: give it back, as kvd_seq_open does. */
		seq_give_back(c, s->id);
	}
	client_unlock(c);
	return r;
}

int kvd_seq_claim(kvd_seq *s, int model_id) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_claim(s, model_id), __func__);
}

static int seq_grow_locked(kvd_seq *s, uint32_t n) {
	kvd_client *c = s->client;
	Kvd__V1__SeqGrow req = KVD__V1__SEQ_GROW__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
	const Kvd__V1__SeqGrowReply *rep;
	int fds[WIRE_FDS_MAX];
	uint32_t nfds = 0;
	int r;

	req.has_seq_id = true;
	req.seq_id = s->id;
	req.has_tokens = true;
	req.tokens = n;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_GROW;
	env.seq_grow = &req;

	r = client_call(c, &env, KVD__V1__ENVELOPE__BODY_SEQ_GROW_REPLY,
			c->stop_at == STOP_GROW_SENT, &reply, fds, &nfds);
	if (r < 0)
		return r;
	rep = reply->seq_grow_reply;
	if (rep->n_grants != nfds) {
		close_fds(fds, nfds);
		return -EPROTO;
	}
	/*
	 * The daemon has granted everything by now. A chunk that fails to map stays unmapped
	 * (kvd_seq_kv refuses its blocks) and the error is returned, but the others are still
	 * mapped, because the daemon will not send them again.
	 */
	for (size_t i = 0; i < rep->n_grants; i++) {
		int k = chunk_map(c, rep->grants[i], TAKE_FD(fds[i]));

		if (k < 0 && r >= 0)
			r = k;
	}
	if (r < 0)
		return r;
	if (c->stop_at == STOP_GROW_MAPPED)
		raise(SIGSTOP);
	return 0;
}

/*
 * A per-step request through the client's rings. Returns what the request returns, or
 * -EAGAIN when it must go on the socket instead (no rings, turned off, or all in use).
 */
/* seq_ring_call, with the completion's flags in *ret_flags. */
static int seq_ring_call_flags(kvd_seq *s, uint8_t op, uint32_t arg, bool stop_after_submit,
                               bool stop_before_sync, uint32_t *ret_flags) {
	struct kvd_ring_sqe req = { .op = op, .arg = arg, .seq_id = s->id };
	struct ring_done done;
	int r;

	/* What went on the socket before goes first, as it would on the socket alone. */
	if (__atomic_load_n(&s->client->want_ring, __ATOMIC_RELAXED)) {
		r = client_ring_barrier(s->client);
		if (r < 0)
			return r;
	}
	r = client_ring_calls(s->client, &req, 1, stop_after_submit, &done);
	if (r == -EAGAIN)
		return r;
	if (r < 0)
		return client_ring_lost(s->client, r);
	*ret_flags = done.cqe.flags;
	return client_ring_finish(s->client, &done, stop_before_sync);
}

static int seq_ring_call(kvd_seq *s, uint8_t op, uint32_t arg, bool stop_after_submit,
                         bool stop_before_sync) {
	uint32_t flags;

	return seq_ring_call_flags(s, op, arg, stop_after_submit, stop_before_sync, &flags);
}

static int do_seq_grow(kvd_seq *s, uint32_t n) {
	kvd_client *c;
	int r;

	if (!s)
		return -EINVAL;
	if (n == 0)
		return client_error(s->client, -EINVAL, "kvd_seq_grow: n is 0 (grow by 1 or more)");
	if (seq_forked(s))
		return -ECHILD;
	if (seq_stale(s))
		return -ESTALE;
	c = s->client;
	r = seq_ring_call(s, KVD_RING_OP_GROW, n, c->stop_at == STOP_GROW_SENT, false);
	if (r != -EAGAIN) {
		if (r >= 0 && c->stop_at == STOP_GROW_MAPPED)
			raise(SIGSTOP);
		return r;
	}
	client_lock(s->client);
	r = seq_grow_locked(s, n);
	client_unlock(s->client);
	return r;
}

int kvd_seq_grow(kvd_seq *s, uint32_t n) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_grow(s, n), __func__);
}

static int seq_release_locked(kvd_seq *s) {
	kvd_client *c = s->client;
	Kvd__V1__SeqRelease req = KVD__V1__SEQ_RELEASE__INIT;
	Kvd__V1__ChunksUnmapped done = KVD__V1__CHUNKS_UNMAPPED__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
	const Kvd__V1__SeqReleaseReply *rep;
	int fds[WIRE_FDS_MAX];
	int r;

	req.has_seq_id = true;
	req.seq_id = s->id;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_RELEASE;
	env.seq_release = &req;
	r = client_call(c, &env, KVD__V1__ENVELOPE__BODY_SEQ_RELEASE_REPLY, false, &reply, fds,
			NULL);
	if (r < 0)
		return r;
	rep = reply->seq_release_reply;
	if (rep->n_unmap_chunk_ids == 0)
		return 0;

	if (c->stop_at == STOP_RELEASE_REPLIED)
		raise(SIGSTOP);
	chunk_unmap_many(c, rep->unmap_chunk_ids, rep->n_unmap_chunk_ids);

	/* The ids can point into the reply: the request is encoded before the next read
	 * reuses the receive buffer. Waited for, so that the chunks are the daemon's again
	 * when release returns. */
	done.n_chunk_ids = rep->n_unmap_chunk_ids;
	done.chunk_ids = rep->unmap_chunk_ids;
	env = (Envelope)KVD__V1__ENVELOPE__INIT;
	env.body_case = KVD__V1__ENVELOPE__BODY_CHUNKS_UNMAPPED;
	env.chunks_unmapped = &done;
	return client_call(c, &env, BODY_ANY, false, NULL, fds, NULL);
}

static int do_seq_release(kvd_seq *s) {
	kvd_client *c;
	int r;

	if (!s)
		return 0;
	c = s->client;
	if (seq_forked(s)) {
		seq_free(s);
		return -ECHILD;
	}
	/* The daemon that knew it is gone: only our side is left to free. */
	if (seq_stale(s)) {
		seq_free(s);
		return 0;
	}
	r = seq_ring_call(s, KVD_RING_OP_RELEASE, 0, false, c->stop_at == STOP_RELEASE_REPLIED);
	if (r != -EAGAIN) {
		seq_free(s);
		return r;
	}
	client_lock(c);
	r = seq_release_locked(s);
	/* Unmapped under the lock, since the client may go away with the sequence's ref. */
	seq_unmap(s);
	client_unlock(c);
	seq_free(s);
	return r;
}

int kvd_seq_release(kvd_seq *s) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_release(s), __func__);
}

/* A round trip about the sequence whose reply is a status only. */
static int seq_simple_call(kvd_seq *s, Envelope *env) {
	int fds[WIRE_FDS_MAX];
	int r;

	client_lock(s->client);
	r = client_call(s->client, env, BODY_ANY, false, NULL, fds, NULL);
	client_unlock(s->client);
	return r;
}

static int do_seq_pin(kvd_seq *s, int *ret_recall) {
	Kvd__V1__SeqPin req = KVD__V1__SEQ_PIN__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
	uint32_t flags = 0;
	int fds[WIRE_FDS_MAX];
	int r;

	if (ret_recall)
		*ret_recall = KVD_RECALL_NONE;
	if (!s)
		return -EINVAL;
	if (seq_forked(s))
		return -ECHILD;
	if (seq_stale(s))
		return -ESTALE;
	r = seq_ring_call_flags(s, KVD_RING_OP_PIN, 0, false, false, &flags);
	if (r != -EAGAIN) {
		if (r >= 0 && ret_recall)
			*ret_recall = (int)((flags & KVD_RING_CQE_F_RECALL_MASK) >>
			                    KVD_RING_CQE_F_RECALL_SHIFT);
		return r;
	}
	req.has_seq_id = true;
	req.seq_id = s->id;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_PIN;
	env.seq_pin = &req;
	client_lock(s->client);
	r = client_call(s->client, &env, BODY_ANY, false, &reply, fds, NULL);
	/* The body is there only when there is something to say (a recall). */
	if (r >= 0 && ret_recall && reply->body_case == KVD__V1__ENVELOPE__BODY_SEQ_PIN_REPLY &&
	    reply->seq_pin_reply->has_recall)
		*ret_recall = (int)reply->seq_pin_reply->recall;
	client_unlock(s->client);
	return r;
}

int kvd_seq_pin(kvd_seq *s) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_pin(s, NULL), __func__);
}

int kvd_seq_pin_recall(kvd_seq *s, int *ret_recall) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_pin(s, ret_recall), __func__);
}

static int do_seq_recall(kvd_seq *s, uint64_t *ret_tokens, uint64_t *ret_bytes) {
	Kvd__V1__SeqRecall req = KVD__V1__SEQ_RECALL__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
	int fds[WIRE_FDS_MAX];
	int r;

	if (ret_tokens)
		*ret_tokens = 0;
	if (ret_bytes)
		*ret_bytes = 0;
	if (!s)
		return -EINVAL;
	if (seq_forked(s))
		return -ECHILD;
	if (seq_stale(s))
		return -ESTALE;
	if (!(s->client->features & KVD_FEATURE_RECALL))
		return -EOPNOTSUPP;
	req.has_seq_id = true;
	req.seq_id = s->id;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_RECALL;
	env.seq_recall = &req;
	client_lock(s->client);
	r = client_call(s->client, &env, KVD__V1__ENVELOPE__BODY_SEQ_RECALL_REPLY, false, &reply, fds,
	                NULL);
	if (r >= 0) {
		const Kvd__V1__SeqRecallReply *rep = reply->seq_recall_reply;

		if (ret_tokens && rep->has_tokens)
			*ret_tokens = rep->tokens;
		if (ret_bytes && rep->has_bytes)
			*ret_bytes = rep->bytes;
	}
	client_unlock(s->client);
	return r;
}

int kvd_seq_recall(kvd_seq *s, uint64_t *ret_tokens, uint64_t *ret_bytes) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_recall(s, ret_tokens, ret_bytes), __func__);
}

static int do_seq_truncate(kvd_seq *s, uint32_t n) {
	Kvd__V1__SeqTruncate req = KVD__V1__SEQ_TRUNCATE__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;

	if (!s)
		return -EINVAL;
	if (n == 0)
		return client_error(s->client, -EINVAL, "kvd_seq_truncate: n is 0 (drop 1 or more)");
	if (seq_forked(s))
		return -ECHILD;
	if (seq_stale(s))
		return -ESTALE;
	req.has_seq_id = req.has_tokens = true;
	req.seq_id = s->id;
	req.tokens = n;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_TRUNCATE;
	env.seq_truncate = &req;
	return seq_simple_call(s, &env);
}

int kvd_seq_truncate(kvd_seq *s, uint32_t n) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_truncate(s, n), __func__);
}

static int do_seq_publish(kvd_seq *s, uint32_t blocks) {
	Kvd__V1__SeqPublish req = KVD__V1__SEQ_PUBLISH__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;

	if (!s)
		return -EINVAL;
	if (seq_forked(s))
		return -ECHILD;
	if (seq_stale(s))
		return -ESTALE;
	if (!(s->client->features & KVD_FEATURE_PREFIX))
		return client_error(s->client, -EOPNOTSUPP, "kvd_seq_publish: the daemon cannot "
		                    "share prefixes (it predates KVD_1.10)");
	req.has_seq_id = req.has_blocks = true;
	req.seq_id = s->id;
	req.blocks = blocks;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_PUBLISH;
	env.seq_publish = &req;
	return seq_simple_call(s, &env);
}

int kvd_seq_publish(kvd_seq *s, uint32_t blocks) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_publish(s, blocks), __func__);
}

/* kvd_seq_unpin, with an event id of the connection (0: none). */
static int seq_unpin(kvd_seq *s, uint32_t event_id) {
	Kvd__V1__SeqUnpin req = KVD__V1__SEQ_UNPIN__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	int r;

	r = seq_ring_call(s, KVD_RING_OP_UNPIN, event_id, false, false);
	if (r != -EAGAIN)
		return r;
	req.has_seq_id = true;
	req.seq_id = s->id;
	req.has_event_id = event_id > 0;
	req.event_id = event_id;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_UNPIN;
	env.seq_unpin = &req;
	return seq_simple_call(s, &env);
}

static int do_seq_unpin(kvd_seq *s) {
	if (!s)
		return -EINVAL;
	if (seq_forked(s))
		return -ECHILD;
	if (seq_stale(s))
		return -ESTALE;
	return seq_unpin(s, 0);
}

int kvd_seq_unpin(kvd_seq *s) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_unpin(s), __func__);
}

/* One sequence's step on the socket (the ring refused it): its result, as seqs_step's. */
static int seq_step_alone(kvd_seq *s, uint8_t op, uint32_t tokens) {
	int recall = KVD_RECALL_NONE, r;

	switch (op) {
	case KVD_RING_OP_GROW:
		return do_seq_grow(s, tokens);
	case KVD_RING_OP_PIN:
		r = do_seq_pin(s, &recall);
		return r < 0 ? r : recall;
	default:
		return seq_unpin(s, 0);
	}
}

/*
 * One step (op: a grow by tokens, a pin, an unpin) of the n sequences at seqs, all of one
 * client: on the ring as batches behind one doorbell each, else one by one on the socket.
 * codes[i] (may be NULL) gets each one's result. Returns 0, or the first error.
 */
static int seqs_step(kvd_seq *const *seqs, uint32_t n, uint8_t op, uint32_t tokens, int *codes) {
	struct kvd_ring_sqe reqs[RING_BATCH_MAX];
	struct ring_done done[RING_BATCH_MAX];
	kvd_client *c;
	uint32_t i = 0;
	int first = 0, r;

	if (!seqs || n == 0 || !seqs[0])
		return -EINVAL;
	c = seqs[0]->client;
	for (uint32_t k = 0; k < n; k++) {
		if (!seqs[k] || seqs[k]->client != c)
			return client_error(c, -EINVAL, "the sequences of a batch are of one client");
		if (seq_forked(seqs[k]))
			return -ECHILD;
		if (seq_stale(seqs[k]))
			return -ESTALE;
	}
	if (op == KVD_RING_OP_GROW && tokens == 0)
		return client_error(c, -EINVAL, "kvd_seqs_grow: tokens is 0 (grow by 1 or more)");
	/* What went on the socket before goes first, as it would on the socket alone. */
	if (__atomic_load_n(&c->want_ring, __ATOMIC_RELAXED)) {
		r = client_ring_barrier(c);
		if (r < 0)
			return r;
	}
	while (i < n) {
		uint32_t m = MIN(n - i, (uint32_t)RING_BATCH_MAX);
		int got;

		for (uint32_t k = 0; k < m; k++)
			reqs[k] = (struct kvd_ring_sqe){ .op = op, .arg = op == KVD_RING_OP_GROW ? tokens : 0,
			                                 .seq_id = seqs[i + k]->id };
		got = client_ring_calls(c, reqs, m, false, done);
		if (got == -EAGAIN) {
			/* No ring, or every slot in flight: this one on the socket. */
			got = 1;
			r = seq_step_alone(seqs[i], op, tokens);
			if (codes)
				codes[i] = r;
			if (r < 0 && first == 0)
				first = r;
		} else if (got < 0) {
			return client_ring_lost(c, got);
		} else {
			for (int k = 0; k < got; k++) {
				r = client_ring_finish(c, &done[k], false);
				if (r >= 0 && op == KVD_RING_OP_PIN)
					r = (int)((done[k].cqe.flags & KVD_RING_CQE_F_RECALL_MASK) >>
					          KVD_RING_CQE_F_RECALL_SHIFT);
				if (codes)
					codes[i + k] = r;
				if (r < 0 && first == 0)
					first = r;
			}
		}
		i += (uint32_t)got;
	}
	return first;
}

int kvd_seqs_grow(kvd_seq *const *seqs, uint32_t n, uint32_t tokens, int *codes) {
	uint64_t key = seqs && n > 0 && seqs[0] ? client_key(seqs[0]->client) : 0;

	return (int)call_result(key, seqs_step(seqs, n, KVD_RING_OP_GROW, tokens, codes), __func__);
}

int kvd_seqs_pin(kvd_seq *const *seqs, uint32_t n, int *codes) {
	uint64_t key = seqs && n > 0 && seqs[0] ? client_key(seqs[0]->client) : 0;

	return (int)call_result(key, seqs_step(seqs, n, KVD_RING_OP_PIN, 0, codes), __func__);
}

int kvd_seqs_unpin(kvd_seq *const *seqs, uint32_t n, int *codes) {
	uint64_t key = seqs && n > 0 && seqs[0] ? client_key(seqs[0]->client) : 0;

	return (int)call_result(key, seqs_step(seqs, n, KVD_RING_OP_UNPIN, 0, codes), __func__);
}

static int do_seq_unpin_after(kvd_seq *s, void *cuda_event) {
	uint32_t id = 0;
	int r = 0;

	if (!s)
		return -EINVAL;
	if (seq_forked(s))
		return -ECHILD;
	if (seq_stale(s))
		return -ESTALE;
	/* On host memory there is nothing to order. */
	if (cuda_event && s->client->memory == KVD_MEMORY_CUDA) {
		client_lock(s->client);
		r = client_event_id(s->client, cuda_event, &id);
		client_unlock(s->client);
		/* An event the daemon cannot take (16 registered, not interprocess, a daemon
		 * without events): waited for here, so that the unpin still happens. */
		if (r < 0) {
			r = client_cuda_event_sync(cuda_event);
			if (r < 0)
				return r;
			r = seq_unpin(s, 0);
			return r < 0 ? r : 1;
		}
	}
	return seq_unpin(s, id);
}

int kvd_seq_unpin_after(kvd_seq *s, void *cuda_event) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_unpin_after(s, cuda_event), __func__);
}

/* Whether layer's window can be used: 0, or -EINVAL, -ECHILD, -EOPNOTSUPP. */
static int seq_obs_check_layer(const kvd_seq *s, uint32_t layer) {
	if (!s)
		return -EINVAL;
	if (seq_forked(s))
		return -ECHILD;
	if (seq_stale(s))
		return -ESTALE;
	if (!s->obs)
		return -EOPNOTSUPP;
	if (layer >= s->obs_layers)
		return -EINVAL;
	return 0;
}

static int do_seq_observation(kvd_seq *s, uint32_t layer, void **ret_q) {
	int r;

	if (!ret_q)
		return -EINVAL;
	r = seq_obs_check_layer(s, layer);
	if (r < 0)
		return r;
	/*
	 * The caller is about to rewrite the window: withdraw its stamp first (0: no window),
	 * and order that before the writes. The daemon reads the stamp once, when a round
	 * snapshots the sequence; a round that takes the stamp before this withdrawal may
	 * still read the window while it is rewritten, which costs that round's scores for
	 * the layer, never memory safety (the buffer's geometry is fixed).
	 */
	__atomic_store_n(&s->obs_stamps[layer], 0, __ATOMIC_RELAXED);
	__atomic_thread_fence(__ATOMIC_RELEASE);
	*ret_q = s->obs_q + (uint64_t)layer * s->obs_layer_bytes;
	return 0;
}

int kvd_seq_observation(kvd_seq *s, uint32_t layer, void **ret_q) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_observation(s, layer, ret_q), __func__);
}

static int do_seq_index_observation(kvd_seq *s, uint32_t layer, void **ret_iq) {
	int r;

	if (!ret_iq)
		return -EINVAL;
	r = seq_obs_check_layer(s, layer);
	if (r < 0)
		return r;
	if (!s->obs_iq)
		return -EOPNOTSUPP;
	/* The same withdrawal as kvd_seq_observation's: one stamp covers both. */
	__atomic_store_n(&s->obs_stamps[layer], 0, __ATOMIC_RELAXED);
	__atomic_thread_fence(__ATOMIC_RELEASE);
	*ret_iq = s->obs_iq + (uint64_t)layer * s->obs_iq_layer_bytes;
	return 0;
}

int kvd_seq_index_observation(kvd_seq *s, uint32_t layer, void **ret_iq) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_index_observation(s, layer, ret_iq), __func__);
}

static int do_seq_observe(kvd_seq *s, uint32_t layer) {
	uint32_t next;
	int r;

	r = seq_obs_check_layer(s, layer);
	if (r < 0)
		return r;
	/* Acquire, like every read of what the daemon writes while we run. */
	next = __atomic_load_n(&s->desc->next_position, __ATOMIC_ACQUIRE);
	/* An empty sequence has no last position for a window to end at. */
	if (next == 0)
		return -EINVAL;
	/* Release: the window's bytes reach the daemon before the stamp that vouches for them. */
	__atomic_store_n(&s->obs_stamps[layer], (uint64_t)next, __ATOMIC_RELEASE);
	return 0;
}

int kvd_seq_observe(kvd_seq *s, uint32_t layer) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_observe(s, layer), __func__);
}

uint64_t kvd_seq_id(const kvd_seq *s) {
	if (!s || seq_forked(s))
		return 0;
	return s->id;
}

const struct kvd_seq_desc *kvd_seq_descriptor(const kvd_seq *s) {
	if (!s || seq_forked(s))
		return NULL;
	return s->desc;
}

const struct kvd_seq_desc *kvd_seq_header(const kvd_seq *s) {
	if (!s || seq_forked(s))
		return NULL;
	return &s->hdr;
}

/* Resident tokens of (layer, kv_head) and its table, checked against the geometry. */
static int64_t seq_table_tokens(const kvd_seq *s, uint32_t layer, uint32_t kv_head,
				uint32_t *ret_table) {
	const struct kvd_seq_desc *d = &s->hdr;
	uint32_t t, n;

	if (layer >= d->layers || kv_head >= d->kv_heads)
		return client_refuse(s->client, -EINVAL, "layer %u, kv head %u: the sequence's model "
		                    "has layers 0..%u and kv heads 0..%u", layer, kv_head,
		                    d->layers - 1, d->kv_heads - 1);
	t = layout_table(d, layer, kv_head);
	n = __atomic_load_n(&layout_tokens_at(d, s->desc)[t], __ATOMIC_RELAXED);
	if (n > d->max_tokens)
		return -EINVAL;
	if (ret_table)
		*ret_table = t;
	return n;
}

static int64_t do_seq_tokens(const kvd_seq *s, uint32_t layer, uint32_t kv_head) {
	if (!s)
		return -EINVAL;
	if (seq_forked(s))
		return -ECHILD;
	if (seq_stale(s))
		return -ESTALE;
	return seq_table_tokens(s, layer, kv_head, NULL);
}

int64_t kvd_seq_tokens(const kvd_seq *s, uint32_t layer, uint32_t kv_head) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int64_t)call_result(key, do_seq_tokens(s, layer, kv_head), __func__);
}

static int64_t do_seq_position(const kvd_seq *s, uint32_t layer, uint32_t kv_head,
			 uint32_t slot) {
	uint32_t t;
	int64_t n;

	if (!s)
		return -EINVAL;
	if (seq_forked(s))
		return -ECHILD;
	if (seq_stale(s))
		return -ESTALE;
	n = seq_table_tokens(s, layer, kv_head, &t);
	if (n < 0)
		return n;
	if (slot >= n)
		return -EINVAL;
	return layout_positions_at(&s->hdr, s->desc, t)[slot];
}

int64_t kvd_seq_position(const kvd_seq *s, uint32_t layer, uint32_t kv_head,
			 uint32_t slot) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int64_t)call_result(key, do_seq_position(s, layer, kv_head, slot), __func__);
}

/*
 * The block that holds resident slot `slot` of (layer, kv_head), for the calls that point
 * into it; with `index`, the model must store index keys (-EOPNOTSUPP otherwise).
 */
static int seq_slot_block(const kvd_seq *s, uint32_t layer, uint32_t kv_head, uint32_t slot,
			  bool index, const char **ret) {
	const struct kvd_seq_desc *d;
	const char *b;
	uint32_t t;
	int64_t n;

	if (seq_forked(s))
		return -ECHILD;
	if (seq_stale(s))
		return -ESTALE;
	d = &s->hdr;
	if (index && d->index_dim == 0)
		return -EOPNOTSUPP;
	n = seq_table_tokens(s, layer, kv_head, &t);
	if (n < 0)
		return (int)n;
	if (slot >= n)
		return -EINVAL;
	/* slot < max_tokens, so the block index is below max_blocks (checked at open). */
	b = seq_block_addr(s, layout_blocks_at(d, s->desc, t)[slot / d->block_tokens]);
	if (!b)
		return -EINVAL;
	*ret = b;
	return 0;
}

static int do_seq_kv(const kvd_seq *s, uint32_t layer, uint32_t kv_head, uint32_t slot,
	       void **ret_k, void **ret_v) {
	const char *b;
	uint32_t row;
	int r;

	if (!s)
		return -EINVAL;
	r = seq_slot_block(s, layer, kv_head, slot, false, &b);
	if (r < 0)
		return r;
	row = slot % s->hdr.block_tokens;
	if (ret_k)
		*ret_k = (void *)(b + layout_k_offset(&s->hdr, kv_head, row));
	if (ret_v)
		*ret_v = (void *)(b + layout_v_offset(&s->hdr, kv_head, row));
	return 0;
}

int kvd_seq_kv(const kvd_seq *s, uint32_t layer, uint32_t kv_head, uint32_t slot,
	       void **ret_k, void **ret_v) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_kv(s, layer, kv_head, slot, ret_k, ret_v), __func__);
}

static int do_seq_index_key(const kvd_seq *s, uint32_t layer, uint32_t kv_head, uint32_t slot,
		      void **ret) {
	const char *b;
	int r;

	if (!s || !ret)
		return -EINVAL;
	r = seq_slot_block(s, layer, kv_head, slot, true, &b);
	if (r < 0)
		return r;
	*ret = (void *)(b + layout_index_offset(&s->hdr, slot % s->hdr.block_tokens));
	return 0;
}

int kvd_seq_index_key(const kvd_seq *s, uint32_t layer, uint32_t kv_head, uint32_t slot,
		      void **ret) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_index_key(s, layer, kv_head, slot, ret), __func__);
}

static int do_seq_block(const kvd_seq *s, uint32_t table, uint32_t index, void **ret) {
	const struct kvd_seq_desc *d;
	const void *b;
	uint32_t n;

	if (!s || !ret)
		return -EINVAL;
	if (seq_forked(s))
		return -ECHILD;
	if (seq_stale(s))
		return -ESTALE;
	d = &s->hdr;
	if (table >= d->n_tables)
		return -EINVAL;
	n = __atomic_load_n(&layout_tokens_at(d, s->desc)[table], __ATOMIC_RELAXED);
	/* Only blocks that hold resident slots are meaningful. */
	if (n > d->max_tokens || index >= DIV_ROUND_UP((uint64_t)n, d->block_tokens))
		return -EINVAL;
	b = seq_block_addr(s, layout_blocks_at(d, s->desc, table)[index]);
	if (!b)
		return -EINVAL;
	*ret = (void *)b;
	return 0;
}

int kvd_seq_block(const kvd_seq *s, uint32_t table, uint32_t index, void **ret) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_block(s, table, index, ret), __func__);
}

/* The compensation block of (layer, kv_head) when the model keeps `compensation`. */
static int seq_compensation(const kvd_seq *s, uint32_t compensation, uint32_t layer,
			    uint32_t kv_head, const void **ret) {
	const struct kvd_seq_desc *d;
	struct kvd_block_ref ref;
	uint64_t bytes = 0, stride;
	uint32_t n;
	char *base;

	if (!s || !ret)
		return -EINVAL;
	if (seq_forked(s))
		return -ECHILD;
	if (seq_stale(s))
		return -ESTALE;
	d = &s->hdr;
	if (d->compensation != compensation)
		return -EOPNOTSUPP;
	if (layer >= d->layers || kv_head >= d->kv_heads)
		return -EINVAL;
	/* In the header the daemon wrote (desc_check()), and rewritten by it. */
	n = __atomic_load_n(&s->desc->moments_blocks, __ATOMIC_ACQUIRE);
	if (n == 0)
		return -ENODATA;
	if (n != d->layers * d->kv_heads)
		return -EINVAL;
	ref = ((const struct kvd_block_ref *)((const char *)s->desc + d->moments_offset))[layer * d->kv_heads +
											    kv_head];
	/* Compensation blocks live in chunks carved for their own size (pool.h). */
	stride = ALIGN_TO(d->moments_bytes, LAYOUT_BLOCK_ALIGN);
	base = chunk_addr(s->client, ref.chunk_id, &bytes);
	if (!base || bytes < d->moments_bytes || ref.index > (bytes - d->moments_bytes) / stride)
		return -EINVAL;
	*ret = base + (uint64_t)ref.index * stride;
	return 0;
}

static int do_seq_moments(const kvd_seq *s, uint32_t layer, uint32_t kv_head,
		    const struct kvd_moments_header **ret) {
	return seq_compensation(s, KVD_COMPENSATION_MOMENTS, layer, kv_head, (const void **)ret);
}

int kvd_seq_moments(const kvd_seq *s, uint32_t layer, uint32_t kv_head,
		    const struct kvd_moments_header **ret) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_moments(s, layer, kv_head, ret), __func__);
}

static int do_seq_latent(const kvd_seq *s, uint32_t layer, uint32_t kv_head,
		   const struct kvd_latent_header **ret) {
	return seq_compensation(s, KVD_COMPENSATION_LATENT, layer, kv_head, (const void **)ret);
}

int kvd_seq_latent(const kvd_seq *s, uint32_t layer, uint32_t kv_head,
		   const struct kvd_latent_header **ret) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_latent(s, layer, kv_head, ret), __func__);
}

static const void *digest_block_addr(void *userdata, struct kvd_block_ref ref) {
	return seq_block_addr(userdata, ref);
}

static int seq_digest_locked(kvd_seq *s, uint64_t *ret_daemon, uint64_t *ret_local) {
	const struct kvd_seq_desc *d = &s->hdr;
	int r;

	if (ret_daemon) {
		Kvd__V1__SeqDigest req = KVD__V1__SEQ_DIGEST__INIT;
		Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
		int fds[WIRE_FDS_MAX];

		req.has_seq_id = true;
		req.seq_id = s->id;
		env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_DIGEST;
		env.seq_digest = &req;
		r = client_call(s->client, &env, KVD__V1__ENVELOPE__BODY_SEQ_DIGEST_REPLY, false,
				&reply, fds, NULL);
		if (r < 0)
			return r;
		if (!reply->seq_digest_reply->has_digest)
			return -EPROTO;
		*ret_daemon = reply->seq_digest_reply->digest;
	}
	if (ret_local) {
		/* Device pointers: the CPU cannot read the blocks. */
		if (s->client->memory == KVD_MEMORY_CUDA)
			return -EOPNOTSUPP;
		/* layout_digest() trusts the counts; block indices then stay below max_blocks. */
		for (uint32_t t = 0; t < d->n_tables; t++)
			if (layout_tokens_at(d, s->desc)[t] > d->max_tokens)
				return -EINVAL;
		r = layout_digest(d, s->desc, digest_block_addr, (void *)s, ret_local, NULL);
		if (r < 0)
			return -EINVAL; /* a block whose chunk is not mapped here */
	}
	return 0;
}

static int do_seq_digest(kvd_seq *s, uint64_t *ret_daemon, uint64_t *ret_local) {
	int r;

	if (!s)
		return -EINVAL;
	if (seq_forked(s))
		return -ECHILD;
	if (seq_stale(s))
		return -ESTALE;
	client_lock(s->client);
	r = seq_digest_locked(s, ret_daemon, ret_local);
	client_unlock(s->client);
	return r;
}

int kvd_seq_digest(kvd_seq *s, uint64_t *ret_daemon, uint64_t *ret_local) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_digest(s, ret_daemon, ret_local), __func__);
}
