/* SPDX-License-Identifier: MIT */
/*
 * Requests on sequences: open, claim (a kept one after a restart), digest, and the per-step
 * operations (grow, pin, unpin, release), the same code serving the socket and the rings.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend.h"
#include "config.h"
#include "conn.h"
#include "envelope.h"
#include "evict.h"
#include "keep.h"
#include "common/layout.h"
#include "log.h"
#include "basic/macro.h"
#include "metrics.h"
#include "mover.h"
#include "observe.h"
#include "pins.h"
#include "recall.h"
#include "pool.h"
#include "registry.h"
#include "requests.h"
#include "ring.h"
#include "seq.h"
#include "server.h"
#include "tier.h"
#include "basic/time-util.h"
#include "unmap.h"

/* A connection past unmap-timeout gets no new chunk (server.h, unmap_due): -ETIMEDOUT
 * with why, counted; 0 otherwise. */
static int refuse_if_unmap_late(struct conn *c, char why[static WHY_MAX]) {
	if (!c->unmap_due_ms)
		return 0;
	conn_refused(c, LIMIT_UNMAP_TIMEOUT);
	return refuse(why, -ETIMEDOUT, "this connection did not unmap a chunk it was asked to "
	              "within unmap-timeout (%llu ms): no grants until it does",
	              (unsigned long long)c->srv->limits.unmap_timeout_ms);
}

/*
 * Refuses request id, which reads or frees q's blocks (a fork, a truncate), while they are
 * not q's to touch: -EBUSY while they are the tier's or the mover's, or a recall's round
 * trades them (a pin brings q back, and the round ends); -EAGAIN while the engine's
 * kernels may still write them (the event of its last unpin). Returns whether it did.
 */
static bool refuse_if_blocks_busy(struct conn *c, uint64_t id, struct seq *q) {
	if (q->tiered || q->move || q->recalling) {
		envelope_reply_error(c, id, -EBUSY, "the sequence is %s; pin it first",
		                     q->recalling ? "being recalled into" : "in its host tier");
		return true;
	}
	if (!evict_engine_done(c->srv, q)) {
		envelope_reply_error(c, id, -EAGAIN, "the engine's event of its last unpin has not completed");
		return true;
	}
	return false;
}

/*
 * Reads the n content keys of a prefix open from fd, which must be a memfd sealed against
 * writing and shrinking (so that reading it can neither block nor fault) of at least
 * n * PREFIX_KEY_BYTES bytes, and then n_tokens token ids when n_tokens is not 0, into a new
 * array in *ret (the token ids right after the keys). Returns 0, or -EINVAL with why.
 */
static int read_prefix_keys(int fd, uint32_t n, uint64_t n_tokens,
                            uint8_t (**ret)[PREFIX_KEY_BYTES], char why[static WHY_MAX]) {
	_cleanup_(freep) uint8_t (*keys)[PREFIX_KEY_BYTES] = NULL;
	size_t bytes = (size_t)n * PREFIX_KEY_BYTES + n_tokens * sizeof(uint32_t);
	int seals = fd >= 0 ? fcntl(fd, F_GET_SEALS) : -1;
	struct stat st;
	ssize_t k;

	if (seals < 0 || (seals & (F_SEAL_WRITE | F_SEAL_SHRINK)) != (F_SEAL_WRITE | F_SEAL_SHRINK))
		return refuse(why, -EINVAL, "the prefix keys must come in a memfd sealed against "
		              "writing and shrinking");
	if (fstat(fd, &st) < 0 || (uint64_t)st.st_size < bytes)
		return refuse(why, -EINVAL, "the prefix keys' memfd holds fewer than %u keys of %d bytes"
		              "%s", n, PREFIX_KEY_BYTES, n_tokens ? " and their blocks' token ids" : "");
	keys = malloc(bytes);
	if (!keys)
		return refuse(why, -ENOMEM, "out of memory");
	k = pread(fd, keys, bytes, 0);
	if (k < 0 || (size_t)k != bytes)
		return refuse(why, -EINVAL, "cannot read the prefix keys");
	*ret = TAKE_PTR(keys);
	return 0;
}

/*
 * The prefix part of a SeqOpen: the checks before anything is made, and the keys in
 * *ret_keys (NULL without a prefix). Returns 0, or an error with why.
 */
static int open_prefix_check(struct conn *c, const Kvd__V1__SeqOpen *req, int fd,
                             uint8_t (**ret_keys)[PREFIX_KEY_BYTES], char why[static WHY_MAX]) {
	const struct model *m = &c->models[req->model_id - 1];

	*ret_keys = NULL;
	if (!req->has_prefix_blocks) {
		if (fd >= 0)
			return refuse(why, -EINVAL, "an open carries an fd only with prefix_blocks");
		return 0;
	}
	if (req->has_fork_of)
		return refuse(why, -EINVAL, "a fork takes its parent's blocks, not a prefix");
	if (m->name[0] == '\0')
		return refuse(why, -EINVAL, "prefix sharing needs the model's name: keys are found "
		              "among models of the same name and block layout");
	if (req->prefix_blocks == 0 || !req->has_max_tokens ||
	    req->prefix_blocks > req->max_tokens / m->block_tokens)
		return refuse(why, -EINVAL, "prefix_blocks must be 1..max_tokens / block_tokens (%u)",
		              req->has_max_tokens ? req->max_tokens / m->block_tokens : 0);
	return read_prefix_keys(fd, req->prefix_blocks,
	                        req->has_prefix_tokens && req->prefix_tokens ?
	                        (uint64_t)req->prefix_blocks * m->block_tokens : 0, ret_keys, why);
}

void handle_seq_open(struct conn *c, uint64_t id, const Envelope *request,
                     int request_fd) {
	const Kvd__V1__SeqOpen *req = request->seq_open;
	struct server *s = c->srv;
	Kvd__V1__SeqOpenReply rep = KVD__V1__SEQ_OPEN_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	_cleanup_(freep) uint8_t (*keys)[PREFIX_KEY_BYTES] = NULL;
	_cleanup_(freep) struct chunk **list = NULL;
	struct seq *q, *parent = NULL;
	struct seq_group *group = NULL;
	struct seq_grants g = {};
	uint32_t found = 0, cached = 0, n_list = 0;
	char why[WHY_MAX];
	int r;

	if (!req->has_model_id || req->model_id < 1 || req->model_id > c->n_models) {
		envelope_reply_error(c, id, -EINVAL, "unknown model");
		return;
	}
	r = open_prefix_check(c, req, request_fd, &keys, why);
	if (r < 0) {
		envelope_reply_error(c, id, r, "%s", why);
		return;
	}
	/* Attached blocks make this connection the holder of their chunks. */
	if (keys) {
		r = refuse_if_unmap_late(c, why);
		list = r < 0 ? NULL : malloc(s->pool->n_chunks * sizeof(*list));
		if (r < 0 || !list) {
			envelope_reply_error(c, id, r < 0 ? r : -ENOMEM, "%s", r < 0 ? why : "out of memory");
			return;
		}
	}
	if (req->has_group_size + req->has_group_of + req->has_fork_of + (keys != NULL) > 1 ||
	    (req->has_group_size && (req->group_size < 2 || req->group_size > SEQ_GROUP_MAX))) {
		envelope_reply_error(c, id, -EINVAL, "an open is one of a fork, a prefix open, a "
		                     "group's first member (group_size 2..%d) or a member joining",
		                     SEQ_GROUP_MAX);
		return;
	}
	if (req->has_group_of) {
		struct seq *first = idmap_get(&s->seq_ids, req->group_of);

		/* Another tenant's sequence reads as none at all. */
		group = first && first->tenant == c->tenant ? first->group : NULL;
		if (!group || group->id != req->group_of) {
			envelope_reply_error(c, id, -ENOENT, "no group %llu of this tenant",
			                     (unsigned long long)req->group_of);
			return;
		}
		if (group->broken || group->n == group->size) {
			envelope_reply_error(c, id, -EBUSY, "group %llu is %s",
			                     (unsigned long long)group->id, group->broken ? "broken" : "full");
			return;
		}
	}
	if (req->has_fork_of) {
		parent = conn_seq(c, req->fork_of);
		if (!parent) {
			envelope_reply_error(c, id, -ENOENT, "no such sequence on this connection to fork");
			return;
		}
		if (parent->model != &c->models[req->model_id - 1]) {
			envelope_reply_error(c, id, -EINVAL, "a fork has its parent's model");
			return;
		}
		/* Its last blocks are copied. */
		if (refuse_if_blocks_busy(c, id, parent))
			return;
	}
	if (!req->has_max_tokens || req->max_tokens < 1 || req->max_tokens > s->limits.max_seq_tokens) {
		if (req->has_max_tokens && req->max_tokens > s->limits.max_seq_tokens)
			conn_refused(c, LIMIT_SEQ_TOKENS);
		envelope_reply_error(c, id, -EINVAL, "max_tokens must be 1..%u", s->limits.max_seq_tokens);
		return;
	}
	if (c->n_seqs >= s->limits.max_seqs) {
		conn_refused(c, LIMIT_SEQS);
		envelope_reply_error(c, id, -EMFILE, "at most %u sequences per connection", s->limits.max_seqs);
		return;
	}
	/* One tenant's many processes must not exhaust the daemon's descriptors together. */
	if (c->tenant->sequences >= s->limits.max_seqs_per_tenant) {
		conn_refused(c, LIMIT_SEQS_PER_TENANT);
		envelope_reply_error(c, id, -EMFILE, "at most %u sequences per tenant (max-seqs-per-tenant)",
		            s->limits.max_seqs_per_tenant);
		return;
	}
	/* Every tenant's together must not take the daemon to vm.max_map_count, where it
	 * would fail for everyone (server.h, registry_seqs_max()). */
	if (s->sequences >= registry_seqs_max(s)) {
		conn_refused(c, LIMIT_SEQS_NODE);
		envelope_reply_error(c, id, -EMFILE, "the node holds its most sequences, %u (max-seqs-node)",
		            registry_seqs_max(s));
		return;
	}
	r = seq_new(s->next_seq_id + 1, &c->models[req->model_id - 1], c->tenant, req->max_tokens,
	            s->limits.max_descriptor_bytes, &q);
	if (r == -EINVAL) {
		conn_refused(c, LIMIT_DESCRIPTOR);
		envelope_reply_error(c, id, r, "the descriptor for %u tokens would exceed %llu bytes",
		            req->max_tokens, (unsigned long long)s->limits.max_descriptor_bytes);
		return;
	}
	if (r < 0) {
		log_error_errno(r, "creating a sequence descriptor failed");
		envelope_reply_error(c, id, r, "cannot create the sequence descriptor");
		return;
	}
	/* The keys and their index entries are the sequence's metadata too. */
	if (keys)
		q->meta_bytes += prefix_keys_bytes(req->prefix_blocks, q->model->block_tokens);
	if (s->metadata_bytes + q->meta_bytes > registry_metadata_max(s)) {
		struct seq_emptied none = { .chunks = s->scratch + s->scratch_used };

		conn_refused(c, LIMIT_METADATA);
		envelope_reply_error(c, id, -ENOMEM, "the sequences' metadata would pass %llu bytes "
		            "(max-metadata-bytes); this one takes %llu", (unsigned long long)
		            registry_metadata_max(s), (unsigned long long)q->meta_bytes);
		seq_free(q, s->pool, &none);
		return;
	}
	q->conn_id = c->id;
	q->device = c->device;
	if (q->model->unit != KVD_UNIT_NONE) {
		r = obs_new(q->model, q->id, &q->obs, &q->obs_fd);
		if (r < 0) {
			struct seq_emptied none = { .chunks = s->scratch + s->scratch_used };

			log_error_errno(r, "creating an observation buffer failed");
			seq_free(q, s->pool, &none);
			envelope_reply_error(c, id, r, "cannot create the observation buffer");
			return;
		}
	}
	r = conn_seq_add(c, q);
	if (r < 0) {
		struct seq_emptied none = { .chunks = s->scratch + s->scratch_used };

		seq_free(q, s->pool, &none);
		envelope_reply_error(c, id, r, "out of memory");
		return;
	}
	if (parent) {
		struct seq_emptied emptied = { .chunks = s->scratch + s->scratch_used };

		r = seq_fork(q, parent, s->pool, c->id, &g, &emptied);
		if (r < 0) {
			conn_seq_remove(c, q);
			seq_free(q, s->pool, &emptied);
			unmap_reclaim(s, &emptied, NULL, NULL);
			envelope_reply_error(c, id, r, "cannot fork sequence %llu: %s",
			                     (unsigned long long)parent->id, strerror(-r));
			return;
		}
		/* A round scored, or a plan made, before the fork knew nothing of the shared
		 * blocks it might now rewrite: neither applies (evict.h). */
		parent->epoch++;
		parent->pending = evict_plan_drop(s->evictor, parent->pending);
		s->forks++;
	}
	if (req->has_group_size || group) {
		r = group ? group_join(group, q) : group_new(q, req->group_size);
		if (r < 0) {
			struct seq_emptied none = { .chunks = s->scratch + s->scratch_used };

			conn_seq_remove(c, q);
			seq_free(q, s->pool, &none);
			envelope_reply_error(c, id, r, r == -EBUSY ? "the group's members have grown: "
			                     "every member joins before its first step" : "out of memory");
			return;
		}
	}
	if (keys) {
		r = prefix_keys_set(q, (const void *)keys, req->has_prefix_tokens && req->prefix_tokens ?
		                    (const uint32_t *)(keys + req->prefix_blocks) : NULL,
		                    req->prefix_blocks);
		if (r == 0)
			r = seq_attach_prefix(q, &s->prefix, s->pool, c->id, req->prefix_blocks, list,
			                      &n_list, &found, &cached);
		if (r < 0) {
			struct seq_emptied none = { .chunks = s->scratch + s->scratch_used };

			conn_seq_remove(c, q);
			seq_free(q, s->pool, &none);
			envelope_reply_error(c, id, r, "cannot attach the prefix: %s", strerror(-r));
			return;
		}
		if (found > 0) {
			s->prefix_hits++;
			c->tenant->prefix_hits++;
		} else {
			s->prefix_misses++;
			c->tenant->prefix_misses++;
		}
		s->prefix_tokens += (uint64_t)found * q->model->block_tokens;
		s->prefix_cached_hits += cached;
		c->tenant->prefix_tokens += (uint64_t)found * q->model->block_tokens;
	}
	s->next_seq_id++;
	registry_seq_opened(s, q);
	/* While the descriptor's fd is still open, for the fd store. */
	keep_seq_opened(s->keep, q, s->next_seq_id);
	if (g.n > 0) {
		struct envelope_grants grants;

		/* The fork's new chunks, ahead of the reply (as a claim's). */
		envelope_grants(&grants, s->pool, c->device, g.chunks, g.n);
		envelope_event_grants(c, &grants);
		/* Closing dropped the sequence with the connection's state. */
		if (c->closing)
			return;
	}
	/* The chunks of the attached blocks, as a claim's: as many grants as they need. */
	for (uint32_t i = 0; i < n_list; i += WIRE_FDS_MAX) {
		struct envelope_grants grants;

		envelope_grants(&grants, s->pool, c->device, list + i, MIN(n_list - i, WIRE_FDS_MAX));
		envelope_event_grants(c, &grants);
		if (c->closing)
			return;
	}

	rep.has_seq_id = true;
	rep.seq_id = q->id;
	rep.has_prefix_tokens = keys != NULL;
	rep.prefix_tokens = found * q->model->block_tokens;
	rep.has_descriptor_bytes = true;
	rep.descriptor_bytes = q->desc->total_bytes;
	if (q->obs) {
		rep.has_observation_bytes = true;
		rep.observation_bytes = q->obs->geo.total_bytes;
	}
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_OPEN_REPLY;
	env.seq_open_reply = &rep;
	{
		int fds[2] = { q->desc_fd, q->obs_fd };

		envelope_reply(c, id, &env, fds, q->obs ? 2 : 1);
	}
	/* The queued reply holds its own copies of the fds; the daemon keeps the mappings. */
	q->desc_fd = safe_close(q->desc_fd);
	q->obs_fd = safe_close(q->obs_fd);
}

/*
 * Hands this connection a sequence that a restart kept (keep.h). Its chunks go first, as
 * grant events of at most WIRE_FDS_MAX: a sequence may span more chunks than a frame carries.
 */
void handle_seq_claim(struct conn *c, uint64_t id, const Envelope *request,
                      int request_fd _unused_) {
	const Kvd__V1__SeqClaim *req = request->seq_claim;
	struct server *s = c->srv;
	struct pool *p = s->pool;
	Kvd__V1__SeqClaimReply rep = KVD__V1__SEQ_CLAIM_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	_cleanup_(freep) struct chunk **list = NULL;
	struct envelope_grants grants;
	const struct model *m;
	struct kvd_seq_desc *d;
	char why[WHY_MAX];
	uint32_t n = 0;
	struct seq *q;
	int r;

	if (!req->has_model_id || req->model_id < 1 || req->model_id > c->n_models) {
		envelope_reply_error(c, id, -EINVAL, "unknown model");
		return;
	}
	if (c->n_seqs >= s->limits.max_seqs) {
		conn_refused(c, LIMIT_SEQS);
		envelope_reply_error(c, id, -EMFILE, "at most %u sequences per connection", s->limits.max_seqs);
		return;
	}
	/* A claim grants chunks too. */
	r = refuse_if_unmap_late(c, why);
	if (r < 0) {
		envelope_reply_error(c, id, r, "%s", why);
		return;
	}
	m = &c->models[req->model_id - 1];
	r = keep_claim(s->keep, req->has_seq_id ? req->seq_id : 0, c->tenant, m, &q);
	if (r == -EINVAL) {
		envelope_reply_error(c, id, r, "the model's shape is not the sequence's, or it has eviction");
		return;
	}
	if (r < 0) {
		envelope_reply_error(c, id, r, "no sequence %llu of tenant %s waits to be claimed",
		            (unsigned long long)req->seq_id, c->tenant->name);
		return;
	}
	/* Its blocks stay on their GPU: only a connection to that one can take them. */
	if (q->device != c->device) {
		const struct backend_device *qd = backend_device(q->device);

		envelope_reply_error(c, id, -EXDEV, "sequence %llu is on GPU %d; connect from that GPU to claim it",
		            (unsigned long long)q->id, qd ? qd->index : (int)q->device);
		return;
	}
	list = malloc(p->n_chunks * sizeof(*list));
	if (!list) {
		envelope_reply_error(c, id, -ENOMEM, "out of memory");
		return;
	}
	/* Becoming a holder is all that can fail: it comes before anything changes hands. */
	d = q->desc;
	for (uint32_t t = 0; t < d->n_tables; t++) {
		const struct kvd_block_ref *refs = desc_blocks(d, t);

		for (uint32_t b = 0; b < DIV_ROUND_UP(desc_tokens(d)[t], d->block_tokens); b++) {
			struct chunk *ch = pool_chunk(p, refs[b].chunk_id);

			if (chunk_has_holder(ch, c->id))
				continue;
			r = chunk_add_holder(ch, c->id);
			if (r < 0) {
				while (n > 0)
					pool_chunk_drop_holder(p, list[--n], c->id);
				envelope_reply_error(c, id, r, "out of memory");
				return;
			}
			list[n++] = ch;
		}
	}
	q->conn_id = c->id;
	r = conn_seq_add(c, q);
	if (r < 0) {
		/* Still the keeper's, unclaimed. */
		q->conn_id = 0;
		while (n > 0)
			pool_chunk_drop_holder(p, list[--n], c->id);
		envelope_reply_error(c, id, r, "out of memory");
		return;
	}
	keep_adopt(s->keep, q, m);
	log_info("connection %llu (tenant %s) claimed sequence %llu kept across the restart",
	         (unsigned long long)c->id, c->tenant->name, (unsigned long long)q->id);

	for (uint32_t i = 0; i < n; i += WIRE_FDS_MAX) {
		envelope_grants(&grants, p, c->device, list + i, MIN(n - i, WIRE_FDS_MAX));
		envelope_event_grants(c, &grants);
		/* Closing dropped the sequence with the connection's state. */
		if (c->closing)
			return;
	}
	rep.has_seq_id = rep.has_descriptor_bytes = rep.has_tokens = rep.has_generation = true;
	rep.seq_id = q->id;
	rep.descriptor_bytes = d->total_bytes;
	rep.tokens = desc_tokens(d)[0];
	rep.generation = d->generation;
	env = (Envelope)KVD__V1__ENVELOPE__INIT;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_CLAIM_REPLY;
	env.seq_claim_reply = &rep;
	{
		/* Out of q first: a reply that cannot be queued closes c, and q with it. The
		 * queued reply holds its own copy; the store holds another. */
		_cleanup_(closep) int fd = TAKE_FD(q->desc_fd);

		envelope_reply(c, id, &env, &fd, 1);
	}
}

static void grow_retry(struct conn *c, const struct parked_grow *g, uint64_t wait_until_ms) {
	step_grow(c, g->id, g->ring, g->seq_id, g->tokens, wait_until_ms, g->since_us);
}

/*
 * Brings q back from its tier, if it is in one, for request req of c (a pin or a grow,
 * which retry answers). Returns 0 when q is resident or lost (q->recall says which); 1
 * when req waits: for the recall, copied off the loop (mover.h), or, parked, for an
 * eviction round or a move out to make room (its deadline: wait_until_ms; past it, q is
 * lost); or a refusal, with why.
 */
static int bring_back(struct conn *c, struct seq *q, const struct parked_grow *req,
                      evict_grow_fn retry, uint64_t wait_until_ms, char why[static WHY_MAX]) {
	struct server *s = c->srv;
	uint64_t short_bytes;
	int r;

	if (!q->tiered)
		return 0;
	r = refuse_if_unmap_late(c, why);
	if (r < 0)
		return r;
	if (c->outstanding >= s->limits.max_outstanding) {
		conn_refused(c, LIMIT_OUTSTANDING);
		return refuse(why, -EBUSY, "at most %u requests of a connection wait at once "
		              "(max-outstanding)", s->limits.max_outstanding);
	}
	r = mover_in(s->mover, c, q, req, retry, &short_bytes);
	if (r == 0)
		return 1;
	if (r == -ENOSPC || r == -EDQUOT) {
		if (wait_until_ms > now_ms() &&
		    evict_wait_grant(s->evictor, c, req, r == -EDQUOT, retry, short_bytes,
		                     wait_until_ms) == 0) {
			c->outstanding++;
			return 1;
		}
		log_info("sequence %llu (tenant %s): no memory came for its recall from the tier "
		         "within grant-wait: lost, as if evicted", (unsigned long long)q->id,
		         q->tenant->name);
		tier_lose(s->tier, q);
		return 0;
	}
	return refuse(why, r, "cannot bring the sequence back from its tier: %s",
	              strerror(-r));
}

/* since_us: when the grow was first parked, 0 when it never was. */
/* Parks grow req of c for an eviction round (evict_wait_grant: at_cap, short of need bytes)
 * until wait_until_ms; counted once per grow, however often it is retried. Returns whether
 * it waits. */
static bool park_grow(struct conn *c, const struct parked_grow *req, bool at_cap, uint64_t need,
                      uint64_t wait_until_ms, bool retried) {
	if (evict_wait_grant(c->srv->evictor, c, req, at_cap, grow_retry, need, wait_until_ms) < 0)
		return false;
	if (!retried)
		c->tenant->grants_waited++;
	c->outstanding++;
	return true;
}

/* Why grow of q failed with r (seq_grow()'s errors), into why; budget_full: whether the
 * budget had no room when it did. */
static void grow_refusal(struct conn *c, const struct seq *q, int r, bool budget_full,
                         char why[static WHY_MAX]) {
	struct server *s = c->srv;
	struct pool *p = s->pool;
	char holder[WHY_MAX];

	switch (r) {
	case -EINVAL:
		refuse(why, r, "cannot grow by 0 tokens");
		break;
	case -EFBIG:
		refuse(why, r, "the sequence holds at most %u tokens", q->desc->max_tokens);
		break;
	case -E2BIG:
		refuse(why, r, "one grow may map at most %u new chunks; grow in smaller steps",
		       WIRE_FDS_MAX);
		break;
	case -EDQUOT:
		refuse(why, r, "tenant %s reached its max of %llu bytes", c->tenant->name,
		       (unsigned long long)c->tenant->max_bytes);
		break;
	case -ENOMEM:
		if (p->pinned_by[0])
			refuse(why, r, "no device memory for a new chunk: the free one was tenant %s's, "
			       "and processes of %s that still import its old allocation keep it "
			       "allocated; it is back when they release it or exit", p->pinned_by,
			       p->pinned_by);
		else
			refuse(why, r, "grow failed: %s", strerror(-r));
		break;
	case -ENOSPC:
		if (budget_full && p->chunks_draining > 0 &&
		    unmap_slowest_holder(s, holder, sizeof(holder)))
			refuse(why, r, "node budget exhausted: %llu bytes evicted wait for %s to unmap "
			       "them", (unsigned long long)p->chunks_draining * p->chunk_bytes, holder);
		else if (budget_full)
			refuse(why, r, "node budget exhausted (%llu of %llu bytes in use)",
			       (unsigned long long)p->used_bytes, (unsigned long long)p->budget_bytes);
		else
			refuse(why, r, "pool exhausted");
		break;
	default:
		refuse(why, r, "grow failed: %s", strerror(-r));
	}
}

/* Answers a grow that took the grants g: on the ring (the new chunks on the socket ahead
 * of the completion) or with a SeqGrowReply carrying them. */
static void grow_answer(struct conn *c, uint64_t id, bool ring, const struct seq *q,
                        const struct seq_grants *g) {
	Kvd__V1__SeqGrowReply rep = KVD__V1__SEQ_GROW_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	struct envelope_grants grants;

	envelope_grants(&grants, c->srv->pool, c->device, g->chunks, g->n);
	if (ring) {
		/* fds cannot travel in a ring: the new chunks go on the socket, ahead of the
		 * completion (ring.h, "Socket"). */
		if (g->n > 0)
			envelope_event_grants(c, &grants);
		ring_complete(c->ring, id, 0, q->desc->generation, layout_tokens(q->desc)[0], 0, NULL);
		return;
	}
	rep.has_tokens = true;
	rep.tokens = layout_tokens(q->desc)[0];
	rep.has_generation = true;
	rep.generation = q->desc->generation;
	rep.n_grants = grants.n;
	rep.grants = grants.ptrs;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_GROW_REPLY;
	env.seq_grow_reply = &rep;
	envelope_reply(c, id, &env, grants.fds, grants.n);
}

/*
 * A grow of q, a member of a tensor-parallel group (group.h): claims what a step of the
 * group already grew it by, or makes the step for every member, all or none; the other
 * members' new chunks go to their connections as grant events. Parks as a grow does when
 * the step waits for memory.
 */
static void grow_group(struct conn *c, struct seq *q, const struct parked_grow *req,
                       uint64_t wait_until_ms) {
	struct server *s = c->srv;
	struct pool *p = s->pool;
	struct seq_emptied emptied = { .chunks = s->scratch + s->scratch_used };
	_cleanup_(freep) struct seq_grants *g = calloc(SEQ_GROUP_MAX, sizeof(*g));
	struct seq_group *group = q->group;
	bool grown, budget_full;
	char why[WHY_MAX];
	int r;

	if (!g) {
		reply_step(c, req->ring, req->id, -ENOMEM, "out of memory");
		return;
	}
	r = group_grow(q, p, req->tokens, g, &emptied, &grown);
	if (r < 0) {
		budget_full = !pool_budget_has_room(p);
		unmap_reclaim(s, &emptied, NULL, NULL);
		if ((r == -ENOSPC || r == -EDQUOT) && wait_until_ms > now_ms()) {
			if (c->outstanding >= s->limits.max_outstanding)
				conn_refused(c, LIMIT_OUTSTANDING);
			else if (park_grow(c, req, r == -EDQUOT, g[q->rank].short_bytes, wait_until_ms,
			                   req->since_us != 0))
				return;
		}
		if (r == -EPIPE)
			refuse(why, r, "a member of group %llu went away: release this sequence",
			       (unsigned long long)group->id);
		else if (r == -EAGAIN)
			refuse(why, r, "group %llu has %u of its %u members: they join before it grows",
			       (unsigned long long)group->id, group->n, group->size);
		else if (r == -EINVAL && group->pending[q->rank] > 0)
			refuse(why, r, "the group's step grew this sequence by %u tokens, not %u",
			       group->pending[q->rank], req->tokens);
		else if (r == -EINVAL)
			refuse(why, r, "a member has yet to claim the group's last step: every rank "
			       "grows by the step's tokens before the next step");
		else
			grow_refusal(c, q, r, budget_full, why);
		reply_step(c, req->ring, req->id, r, why);
		return;
	}
	if (grown) {
		/* The other members' chunks: on their connections, ahead of their own grows. */
		for (uint32_t i = 0; i < group->n; i++) {
			struct seq *m = group->members[i];
			struct conn *mc = m && m != q ? registry_conn(s, m->conn_id) : NULL;
			struct envelope_grants grants;

			if (!mc)
				continue;
			pins_recharge(m);
			if (g[i].n == 0 || mc->closing)
				continue;
			envelope_grants(&grants, p, mc->device, g[i].chunks, g[i].n);
			envelope_event_grants(mc, &grants);
		}
		s->group_steps++;
	}
	pins_recharge(q);
	grow_answer(c, req->id, req->ring, q, &g[q->rank]);
	evict_kick(s->evictor, ROUND_WATERMARK);
}

void step_grow(struct conn *c, uint64_t id, bool ring, uint64_t seq_id, uint32_t tokens,
               uint64_t wait_until_ms, uint64_t since_us) {
	struct server *s = c->srv;
	struct pool *p = s->pool;
	struct seq_emptied emptied = { .chunks = s->scratch + s->scratch_used };
	const struct parked_grow req = { id, seq_id, tokens, ring, since_us ? since_us : now_us() };
	bool waits = wait_until_ms > now_ms(), budget_full;
	char why[WHY_MAX];
	struct seq_grants g;
	struct seq *q;
	int r;

	q = conn_seq(c, seq_id);
	r = q ? refuse_if_unmap_late(c, why) : refuse(why, -ENOENT, "no such sequence on this connection");
	/* A sequence moved to a tier comes back before it grows. */
	if (r >= 0)
		r = bring_back(c, q, &req, grow_retry, wait_until_ms, why);
	if (r > 0)
		return;
	if (r < 0) {
		reply_step(c, ring, id, r, why);
		return;
	}
	q->used_ms = now_ms();
	if (q->group) {
		grow_group(c, q, &req, wait_until_ms);
		return;
	}
	/* Grows that wait for the pool are served in order: one that needs blocks queues
	 * behind them, so that the chunks a round frees for a waiting grow (often at another
	 * tenant's unpin) are not taken by whoever asks next; in a retry pass, behind those
	 * retried before it that wait on. */
	if (tokens > 0 && waits && evict_grants_queued(s->evictor, c->device) > 0 &&
	    c->outstanding < s->limits.max_outstanding && seq_grow_bytes(q, s->pool, tokens) > 0 &&
	    park_grow(c, &req, false, seq_grow_bytes(q, s->pool, tokens), wait_until_ms, since_us != 0))
		return;
	/* A grow that can never be served says so, with its size, rather than wait for memory
	 * and be refused as if the node were full: more new chunks than one frame maps
	 * (kvd.h: -E2BIG), or more bytes than the whole budget. */
	if (tokens > 0 && seq_grow_check(q, tokens) == 0) {
		uint64_t need = seq_grow_bytes(q, p, tokens);

		if (DIV_ROUND_UP(need, p->chunk_bytes) > WIRE_FDS_MAX + 1) {
			refuse(why, -E2BIG, "a grow by %u tokens needs about %llu chunks of %llu bytes; one "
			       "grow maps at most %d new chunks: grow in smaller steps", tokens,
			       (unsigned long long)DIV_ROUND_UP(need, p->chunk_bytes),
			       (unsigned long long)p->chunk_bytes, WIRE_FDS_MAX);
			reply_step(c, ring, id, -E2BIG, why);
			return;
		}
		if (need > p->budget_bytes) {
			refuse(why, -ENOSPC, "a grow by %u tokens needs %llu bytes, more than the whole "
			       "node budget (%llu bytes): grow in smaller steps, or raise the budget",
			       tokens, (unsigned long long)need, (unsigned long long)p->budget_bytes);
			reply_step(c, ring, id, -ENOSPC, why);
			return;
		}
	}
	/* A pinned sequence's grow is held to max-pinned-percent, once it is a grow at all. */
	r = seq_grow_check(q, tokens) < 0 ? 0 : pins_may_grow(s, q, seq_grow_bytes(q, s->pool, tokens),
	                                                      why, WHY_MAX);
	if (r < 0) {
		reply_step(c, ring, id, r, why);
		return;
	}
	r = seq_grow(q, p, c->id, tokens, &g, &emptied);
	/* At its max, a tenant's cached blocks make room for its grows first: its least
	 * recently used, twice as many each try, so that no more go than the grow needs (a
	 * chunk they empty would go back to the pool, not to the grow). */
	for (uint64_t shed = q->model->block_bytes; r == -EDQUOT && c->tenant->cached_bytes > 0;
	     shed *= 2) {
		/* The shedding's list takes the same scratch: this one goes first. */
		unmap_reclaim(s, &emptied, NULL, NULL);
		emptied.n = 0;
		if (evict_shed_cache(s, c->tenant, shed) == 0)
			break;
		r = seq_grow(q, p, c->id, tokens, &g, &emptied);
	}
	if (r < 0) {
		/* Before the reclaim, which may give the budget room again: the refusal says
		 * what was short when the grow failed. */
		budget_full = !pool_budget_has_room(p);
		unmap_reclaim(s, &emptied, NULL, NULL);
		/* Memory an eviction round may free: wait for it rather than fail. */
		if ((r == -ENOSPC || r == -EDQUOT) && waits) {
			if (c->outstanding >= s->limits.max_outstanding)
				conn_refused(c, LIMIT_OUTSTANDING);
			else if (park_grow(c, &req, r == -EDQUOT, g.short_bytes, wait_until_ms,
			                   since_us != 0))
				return;
		}
		if (since_us)
			metrics_observe_grant_wait(&s->metrics, now_us() - since_us);
		grow_refusal(c, q, r, budget_full, why);
		log_info("connection %llu (pid %d, uid %u, tenant %s): grow refused: %s",
		         (unsigned long long)c->id, (int)c->cred.pid, (unsigned)c->cred.uid,
		         c->tenant->name, why);
		reply_step(c, ring, id, r, why);
		return;
	}
	pins_recharge(q);
	if (since_us)
		metrics_observe_grant_wait(&s->metrics, now_us() - since_us);
	grow_answer(c, id, ring, q, &g);
	evict_kick(s->evictor, ROUND_WATERMARK);
}

void handle_seq_grow(struct conn *c, uint64_t id, const Envelope *request,
                     int request_fd _unused_) {
	const Kvd__V1__SeqGrow *req = request->seq_grow;
	uint64_t wait = c->srv->limits.grant_wait_ms;

	if (!req->has_seq_id || !conn_seq(c, req->seq_id)) {
		envelope_reply_error(c, id, -ENOENT, "no such sequence on this connection");
		return;
	}
	if (!req->has_tokens) {
		envelope_reply_error(c, id, -EINVAL, "tokens missing");
		return;
	}
	step_grow(c, id, false, req->seq_id, req->tokens, wait ? now_ms() + wait : 0, 0);
}

/*
 * Releases sequence seq_id. The chunks this connection must unmap go to *ret_ids (allocated;
 * *ret_n of them); when there was no memory for the list, every holder, this connection
 * included, is asked through events instead.
 */
int step_release(struct conn *c, uint64_t seq_id, uint32_t **ret_ids, uint32_t *ret_n,
                 char why[static WHY_MAX]) {
	struct server *s = c->srv;
	struct seq_emptied emptied = { .chunks = s->scratch + s->scratch_used };
	struct seq *q;
	uint32_t *ids = NULL, n = 0;

	q = conn_seq(c, seq_id);
	if (!q)
		return refuse(why, -ENOENT, "no such sequence on this connection");
	conn_seq_remove(c, q);
	drop_seq(s, q, &emptied);
	if (emptied.n > 0) {
		ids = malloc(emptied.n * sizeof(*ids));
		if (!ids) {
			/* Fall back to events for the requester too: slower, but nothing leaks. */
			unmap_reclaim(s, &emptied, NULL, NULL);
		} else
			n = unmap_reclaim(s, &emptied, c, ids);
	}
	*ret_ids = ids;
	*ret_n = n;
	return 0;
}

void handle_seq_release(struct conn *c, uint64_t id, const Envelope *request,
                        int request_fd _unused_) {
	const Kvd__V1__SeqRelease *req = request->seq_release;
	Kvd__V1__SeqReleaseReply rep = KVD__V1__SEQ_RELEASE_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	_cleanup_(freep) uint32_t *ids = NULL;
	char why[WHY_MAX];
	uint32_t n;
	int r;

	r = step_release(c, req->has_seq_id ? req->seq_id : 0, &ids, &n, why);
	if (r < 0) {
		envelope_reply_error(c, id, r, "%s", why);
		return;
	}
	/* What one message holds goes in the reply, the rest ahead of it as unmap requests,
	 * which the client answers while it waits for the reply. */
	if (n > WIRE_IDS_MAX)
		envelope_event_unmap(c, ids + WIRE_IDS_MAX, n - WIRE_IDS_MAX);
	rep.n_unmap_chunk_ids = MIN(n, WIRE_IDS_MAX);
	rep.unmap_chunk_ids = ids;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_RELEASE_REPLY;
	env.seq_release_reply = &rep;
	envelope_reply(c, id, &env, NULL, 0);
}

void handle_chunks_unmapped(struct conn *c, uint64_t id, const Envelope *request,
                            int request_fd _unused_) {
	const Kvd__V1__ChunksUnmapped *req = request->chunks_unmapped;
	struct server *s = c->srv;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	uint32_t draining = s->pool->chunks_draining;

	/* Ids this connection does not hold are ignored: the client loses nothing but its
	 * own access, and the daemon's state stays consistent. */
	for (size_t i = 0; i < req->n_chunk_ids; i++) {
		struct chunk *ch = pool_chunk(s->pool, req->chunk_ids[i]);
		uint64_t due;

		if (!ch || ch->state == CHUNK_FREE || ch->owner != c->tenant)
			continue;
		/* Before the drop, which may free the chunk. Late chunks the tick's scan
		 * counted are those due by then. */
		due = unmap_due(s, ch);
		if (pool_chunk_drop_holder(s->pool, ch, c->id) && c->unmap_late > 0 && due != 0 &&
		    due <= s->unmap_scan_ms)
			c->unmap_late--;
	}
	if (c->unmap_due_ms && c->unmap_late == 0) {
		c->unmap_due_ms = 0;
		log_info("connection %llu unmapped the chunks it was late with: it gets grants again",
		         (unsigned long long)c->id);
	}
	envelope_reply(c, id, &env, NULL, 0);
	if (s->pool->chunks_draining < draining)
		evict_chunks_back(s->evictor);
}

/* A digest of device memory reads each block through a host copy, kept while the traversal
 * stays in the same block. */
struct digest_copy {
	struct pool *pool;
	uint8_t *buf;
	struct kvd_block_ref ref;
	bool have;
	int error;
};

static const void *digest_copy_block(void *userdata, struct kvd_block_ref ref) {
	struct digest_copy *dc = userdata;
	int r;

	if (dc->have && dc->ref.chunk_id == ref.chunk_id && dc->ref.index == ref.index)
		return dc->buf;
	dc->have = false;
	r = pool_block_read(dc->pool, ref, dc->buf);
	if (r < 0) {
		dc->error = r;
		return NULL;
	}
	dc->ref = ref;
	dc->have = true;
	return dc->buf;
}

static int seq_digest_copied(struct seq *q, struct pool *p, uint64_t *ret_digest,
                             uint64_t *ret_bytes) {
	_cleanup_(freep) uint8_t *buf = malloc(MAX(q->desc->block_bytes, 1u));
	struct digest_copy dc = { .pool = p };
	int r;

	if (!buf)
		return -ENOMEM;
	dc.buf = buf;
	r = layout_digest(q->desc, q->desc, digest_copy_block, &dc, ret_digest, ret_bytes);
	return dc.error < 0 ? dc.error : r;
}

void handle_seq_truncate(struct conn *c, uint64_t id, const Envelope *request,
                         int request_fd _unused_) {
	const Kvd__V1__SeqTruncate *req = request->seq_truncate;
	struct server *s = c->srv;
	struct seq_emptied emptied = { .chunks = s->scratch + s->scratch_used };
	struct seq *q = req->has_seq_id ? conn_seq(c, req->seq_id) : NULL;
	int r;

	if (!q) {
		envelope_reply_error(c, id, -ENOENT, "no such sequence on this connection");
		return;
	}
	if (!req->has_tokens || req->tokens == 0 || req->tokens > q->desc->next_position) {
		envelope_reply_error(c, id, -EINVAL, "tokens must be 1..%u, the positions the "
		                     "sequence has", q->desc->next_position);
		return;
	}
	/* Its blocks go back to the pool. */
	if (refuse_if_blocks_busy(c, id, q))
		return;
	r = seq_truncate(q, s->pool, req->tokens, &emptied);
	if (r < 0) {
		envelope_reply_error(c, id, r, "cannot truncate: %s", strerror(-r));
		return;
	}
	/* A plan made while it was pinned no longer fits (seq_truncate moved the epoch on). */
	q->pending = evict_plan_drop(s->evictor, q->pending);
	recall_truncate(q->kept, q->desc->next_position);
	pins_recharge(q);
	q->used_ms = now_ms();
	s->truncates++;
	s->truncated_tokens += req->tokens;
	/* Chunks left empty are asked back with events, which libkvd answers while it waits
	 * for the reply. */
	unmap_reclaim(s, &emptied, NULL, NULL);
	envelope_reply(c, id, NULL, NULL, 0);
}

void handle_seq_publish(struct conn *c, uint64_t id, const Envelope *request,
                        int request_fd _unused_) {
	const Kvd__V1__SeqPublish *req = request->seq_publish;
	struct seq *q = req->has_seq_id ? conn_seq(c, req->seq_id) : NULL;
	int r;

	if (!q) {
		envelope_reply_error(c, id, -ENOENT, "no such sequence on this connection");
		return;
	}
	if (!req->has_blocks || req->blocks > q->prefix.n) {
		envelope_reply_error(c, id, -EINVAL, "blocks must be 0..%u, the keys its open gave",
		                     q->prefix.n);
		return;
	}
	/* Published blocks must hold what the engine wrote: not while its kernels may still
	 * write them, nor while they are out of the pool. */
	if (refuse_if_blocks_busy(c, id, q))
		return;
	r = prefix_publish(&c->srv->prefix, q, req->blocks);
	if (r == -EINVAL) {
		envelope_reply_error(c, id, r, "a block below %u is not whole in every table: not "
		                     "grown yet, or a round evicted tokens of it", req->blocks);
		return;
	}
	if (r < 0) {
		envelope_reply_error(c, id, r, "cannot publish: %s", strerror(-r));
		return;
	}
	envelope_reply(c, id, NULL, NULL, 0);
}

void handle_prefix_lookup(struct conn *c, uint64_t id, const Envelope *request, int fd) {
	const Kvd__V1__PrefixLookup *req = request->prefix_lookup;
	Kvd__V1__PrefixLookupReply rep = KVD__V1__PREFIX_LOOKUP_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	_cleanup_(freep) uint8_t (*keys)[PREFIX_KEY_BYTES] = NULL;
	struct prefix_who who = { .tenant = c->tenant, .device = c->device };
	char why[WHY_MAX];
	uint32_t n = 0, cached = 0;
	int r;

	if (!req->has_model_id || req->model_id < 1 || req->model_id > c->n_models) {
		envelope_reply_error(c, id, -EINVAL, "unknown model");
		return;
	}
	who.model = &c->models[req->model_id - 1];
	prefix_who_init(&who);
	if (who.model->name[0] == '\0') {
		envelope_reply_error(c, id, -EINVAL, "prefix sharing needs the model's name");
		return;
	}
	if (!req->has_prefix_blocks || req->prefix_blocks == 0 ||
	    req->prefix_blocks > c->srv->limits.max_seq_tokens / who.model->block_tokens) {
		envelope_reply_error(c, id, -EINVAL, "prefix_blocks must be 1..max-seq-tokens / "
		                     "block_tokens (%u)",
		                     c->srv->limits.max_seq_tokens / who.model->block_tokens);
		return;
	}
	r = read_prefix_keys(fd, req->prefix_blocks, 0, &keys, why);
	if (r < 0) {
		envelope_reply_error(c, id, r, "%s", why);
		return;
	}
	/* Keys chain: past the first miss nothing can match. */
	for (struct prefix_hit h, prev = {}; n < req->prefix_blocks; n++, prev = h) {
		if (!prefix_find(&c->srv->prefix, &who, n, keys[n], n ? &prev : NULL, &h))
			break;
		cached += h.cached != NULL;
	}
	rep.has_blocks = rep.has_cached_blocks = true;
	rep.blocks = n;
	rep.cached_blocks = cached;
	env.body_case = KVD__V1__ENVELOPE__BODY_PREFIX_LOOKUP_REPLY;
	env.prefix_lookup_reply = &rep;
	envelope_reply(c, id, &env, NULL, 0);
}

void handle_seq_digest(struct conn *c, uint64_t id, const Envelope *request,
                       int request_fd _unused_) {
	const Kvd__V1__SeqDigest *req = request->seq_digest;
	Kvd__V1__SeqDigestReply rep = KVD__V1__SEQ_DIGEST_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	struct seq *q;
	int r;

	q = req->has_seq_id ? conn_seq(c, req->seq_id) : NULL;
	if (!q) {
		envelope_reply_error(c, id, -ENOENT, "no such sequence on this connection");
		return;
	}
	/* Device memory is read through copies, block by block: a digest is for tests and
	 * diagnostics (and proves that the daemon sees what the engine wrote). */
	if (!evict_engine_done(c->srv, q)) {
		envelope_reply_error(c, id, -EAGAIN, "the engine's event of its last unpin has not completed");
		return;
	}
	if (c->srv->pool->ops->host_access)
		r = seq_digest(q, c->srv->pool, &rep.digest, &rep.bytes);
	else
		r = seq_digest_copied(q, c->srv->pool, &rep.digest, &rep.bytes);
	if (r < 0) {
		log_error_errno(r, "sequence %llu refers to a block not in use", (unsigned long long)q->id);
		envelope_reply_error(c, id, r, "inconsistent sequence");
		return;
	}
	rep.has_digest = rep.has_bytes = true;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_DIGEST_REPLY;
	env.seq_digest_reply = &rep;
	envelope_reply(c, id, &env, NULL, 0);
}

#define SEQ_PINS_MAX 255

static void pin_retry(struct conn *c, const struct parked_grow *g, uint64_t wait_until_ms) {
	step_pin(c, g->id, g->ring, g->seq_id, wait_until_ms, g->since_us);
}

/* Pins sequence seq_id of c, bringing it back from its tier first, and answers with
 * what it found (KVD_RECALL_*): in the ring completion's flags, or a SeqPinReply (none for
 * KVD_RECALL_NONE, as from daemons that predate tiers). */
void step_pin(struct conn *c, uint64_t id, bool ring, uint64_t seq_id,
              uint64_t wait_until_ms, uint64_t since_us) {
	Kvd__V1__SeqPinReply rep = KVD__V1__SEQ_PIN_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	struct seq *q = conn_seq(c, seq_id);
	char why[WHY_MAX];
	uint32_t recall;
	int r;

	if (!q) {
		reply_step(c, ring, id, refuse(why, -ENOENT, "no such sequence on this connection"), why);
		return;
	}
	if (q->pins == SEQ_PINS_MAX) {
		reply_step(c, ring, id, refuse(why, -EBUSY, "pinned %u times already", SEQ_PINS_MAX), why);
		return;
	}
	r = bring_back(c, q, &(struct parked_grow){ id, seq_id, 0, ring,
	                                            since_us ? since_us : now_us() },
	               pin_retry, wait_until_ms, why);
	if (r > 0)
		return;
	if (r < 0) {
		reply_step(c, ring, id, r, why);
		return;
	}
	if (since_us)
		metrics_observe_grant_wait(&c->srv->metrics, now_us() - since_us);
	/* After the recall: what comes back is what the pin holds. */
	r = pins_take(c->srv, q, why, WHY_MAX);
	if (r < 0) {
		reply_step(c, ring, id, r, why);
		return;
	}
	q->pins++;
	q->pin_serial++;
	q->used_ms = now_ms();
	recall = q->recall;
	q->recall = KVD_RECALL_NONE;
	if (ring) {
		ring_complete(c->ring, id, 0, q->desc->generation, layout_tokens(q->desc)[0],
		              recall << KVD_RING_CQE_F_RECALL_SHIFT, NULL);
		return;
	}
	if (recall != KVD_RECALL_NONE) {
		rep.has_recall = true;
		rep.recall = recall;
		env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_PIN_REPLY;
		env.seq_pin_reply = &rep;
	}
	envelope_reply(c, id, &env, NULL, 0);
}

int step_unpin(struct conn *c, uint64_t seq_id, uint32_t event_id, char why[static WHY_MAX]) {
	struct seq *q = conn_seq(c, seq_id);

	if (!q)
		return refuse(why, -ENOENT, "no such sequence on this connection");
	if (q->pins == 0)
		return refuse(why, -EINVAL, "the sequence is not pinned");
	if (event_id > c->n_events)
		return refuse(why, -EINVAL, "no event %u on this connection (RegisterEvent)", event_id);
	/* Before a waiting plan applies: its compaction moves the K/V the event guards. Every
	 * stream that unpinned it has its event waited for (pins nest). */
	if (event_id > 0)
		q->wait_events |= UINT32_C(1) << (event_id - 1);
	/* The plan applies before the answer, so that the engine sees the new tables once
	 * its unpin returns. */
	q->used_ms = now_ms();
	if (--q->pins == 0) {
		q->written_pos = q->desc->next_position;
		pins_release(q);
		evict_apply_pending(c->srv->evictor, q);
	}
	return 0;
}

void handle_seq_pin(struct conn *c, uint64_t id, const Envelope *request,
                    int request_fd _unused_) {
	const Kvd__V1__SeqPin *req = request->seq_pin;
	uint64_t wait = c->srv->limits.grant_wait_ms;

	step_pin(c, id, false, req->has_seq_id ? req->seq_id : 0, wait ? now_ms() + wait : 0, 0);
}

void handle_seq_unpin(struct conn *c, uint64_t id, const Envelope *request,
                      int request_fd _unused_) {
	const Kvd__V1__SeqUnpin *req = request->seq_unpin;
	char why[WHY_MAX];

	reply_step(c, false, id,
	           step_unpin(c, req->has_seq_id ? req->seq_id : 0,
	                      req->has_event_id ? req->event_id : 0, why),
	           why);
}
