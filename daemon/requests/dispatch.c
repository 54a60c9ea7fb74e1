/* SPDX-License-Identifier: MIT */
/*
 * Request handlers: one function per request type, each validating everything the client
 * sent before touching any state, and answering every request with exactly one reply.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "access.h"
#include "admin.h"
#include "common/layout.h"
#include "basic/macro.h"
#include "config.h"
#include "conn.h"
#include "departed.h"
#include "dispatch.h"
#include "envelope.h"
#include "evict.h"
#include "keep.h"
#include "listing.h"
#include "log.h"
#include "mover.h"
#include "node-values.h"
#include "observe.h"
#include "pins.h"
#include "policy.h"
#include "ring.h"
#include "server.h"
#include "unmap.h"
#include "recall.h"
#include "tier.h"
#include "upload.h"
#include "basic/time-util.h"


/* Answers a live change (admin.h): a reply with code 0 and a message when it applies but
 * was not saved, so that the operator learns it will not survive a restart. */
static void reply_live(struct conn *c, uint64_t id, int r, const char *why) {
	Envelope env = KVD__V1__ENVELOPE__INIT;

	if (r < 0) {
		envelope_reply_error(c, id, r, "%s", why);
		return;
	}
	if (r == 0) {
		envelope_reply(c, id, &env, NULL, 0);
		return;
	}
	r = envelope_reply_status(c, id, 0, why);
	if (r < 0 && r != -ENOBUFS && !c->closing)
		conn_close(c, "cannot queue a reply");
}

/*
 * The per-step operations (grow, pin, unpin, release) come on the socket or through the
 * ring (ring.h), and the same code serves both: a step returns 0 or a negative errno with the
 * refusal's text in `why`, and the caller packages the answer as the request came.
 */
#define WHY_MAX KVD_RING_MSG_BYTES

_printf_(3, 4) static int refuse(char why[static WHY_MAX], int code, const char *fmt, ...) {
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(why, WHY_MAX, fmt, ap);
	va_end(ap);
	return code;
}

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

/* Answers a step with nothing but its result: a status on the socket (id), a completion on
 * the ring (id is the submission's user_data). */
static void reply_step(struct conn *c, bool ring, uint64_t id, int r, const char *why) {
	Envelope env = KVD__V1__ENVELOPE__INIT;

	if (ring) {
		if (r < 0)
			log_debug("connection %llu: ring request refused: %s", (unsigned long long)c->id,
			          why);
		ring_complete(c->ring, id, r, 0, 0, 0, r < 0 ? why : NULL);
	} else if (r < 0)
		envelope_reply_error(c, id, r, "%s", why);
	else
		envelope_reply(c, id, &env, NULL, 0);
}

/* Refuses request id when c has max-outstanding replies waiting: answered, counted. Returns
 * whether it did. */
static bool refuse_if_outstanding(struct conn *c, uint64_t id) {
	if (c->outstanding < c->srv->limits.max_outstanding)
		return false;
	conn_refused(c, LIMIT_OUTSTANDING);
	envelope_reply_error(c, id, -EBUSY, "%u replies outstanding on this connection "
	                     "(max-outstanding)", c->outstanding);
	return true;
}


/* Frees a sequence with what eviction attached to it. */
static void drop_seq(struct server *s, struct seq *q, struct seq_emptied *emptied) {
	pins_release(q);
	keep_seq_dropped(s->keep, q);
	mover_forget(s->mover, q);
	tier_forget(s->tier, q);
	q->kept = recall_store_free(s->tier, q->kept);
	registry_seq_closed(s, q);
	q->obs = obs_unref(q->obs);
	q->pending = evict_plan_drop(s->evictor, q->pending);
	seq_free(q, s->pool, emptied);
}

/*
 * Sets the GPU a tenant's chunks come from, on a device pool: the one the hello names by
 * UUID (libkvd sends the GPU of the engine's current CUDA context, or the one it was asked
 * for). Chunks on another GPU than the engine's would fault in its kernels: a UUID the pool
 * does not hold is refused, and so is none at all where the pool has several GPUs to choose
 * from. Returns 0, or -EXDEV, replied and logged, the connection closing.
 */
static int hello_device(struct conn *c, uint64_t id, const Kvd__V1__Hello *req) {
	uint32_t n = c->srv->pool->n_devices;
	char named[BACKEND_UUID_STRLEN] = "", pooled[BACKEND_UUID_STRLEN * 2 + 32] = "", why[256];
	const struct backend_device *dev;

	for (uint32_t i = 0; req->has_device_uuid && i < n; i++) {
		dev = backend_device(i);
		if (dev && req->device_uuid.len == sizeof(dev->uuid) &&
		    memcmp(req->device_uuid.data, dev->uuid, sizeof(dev->uuid)) == 0) {
			c->device = i;
			return 0;
		}
	}
	if (!req->has_device_uuid && n == 1) {
		c->device = 0;
		return 0;
	}
	/* The first two pooled GPUs, for the message. */
	for (uint32_t i = 0; i < MIN(n, 2u); i++) {
		char text[BACKEND_UUID_STRLEN];

		dev = backend_device(i);
		if (!dev)
			continue;
		backend_uuid_format(dev->uuid, text);
		snprintf(pooled + strlen(pooled), sizeof(pooled) - strlen(pooled), "%s%s", i ? ", " : "", text);
	}
	if (n > 2)
		snprintf(pooled + strlen(pooled), sizeof(pooled) - strlen(pooled), " and %u more", n - 2);
	if (req->has_device_uuid && req->device_uuid.len == 16)
		backend_uuid_format(req->device_uuid.data, named);
	if (req->has_device_uuid)
		snprintf(why, sizeof(why), "GPU %s is not pooled by this daemon (it pools %s)",
		         named[0] ? named : "(a malformed UUID)", pooled);
	else
		snprintf(why, sizeof(why), "this daemon pools %u GPUs (%s): connect with the engine's "
		         "CUDA context current, or name its GPU (KVD_CONNECT_DEVICE)", n, pooled);
	log_warning("connection %llu (pid %d): tenant %s refused: %s", (unsigned long long)c->id,
	            (int)c->cred.pid, req->tenant, why);
	envelope_reply_error(c, id, -EXDEV, "%s", why);
	c->close_when_sent = true;
	return -EXDEV;
}

/*
 * Admits the tenant a hello names (NULL: an administrative connection, *ret NULL): its
 * access rules, device chunks on a GPU pool and the GPU, the per-uid and table bounds.
 * Returns 0, or a negative errno once it refused, replied and closed.
 */
static int hello_tenant(struct conn *c, uint64_t id, const Kvd__V1__Hello *req,
                        struct tenant **ret) {
	struct server *s = c->srv;
	bool creates;
	char why[256];
	int r;

	*ret = NULL;
	if (!req->tenant)
		return 0;
	if (tenant_name_valid(req->tenant)) {
		r = access_tenant(&s->admin->cfg, c->fd, &c->cred, req->tenant, why, sizeof(why));
		if (r < 0) {
			s->access_refused++;
			log_warning("connection %llu: pid %d uid %u refused: %s", (unsigned long long)c->id,
			            (int)c->cred.pid, (unsigned)c->cred.uid, why);
			envelope_reply_error(c, id, r, "%s", why);
			c->close_when_sent = true;
			return r;
		}
	}
	/* A client that does not know device chunks would mmap() a cuMem fd and fail, or
	 * worse, at its first grant; it is told now. Administrative connections get no
	 * chunks and stay welcome. */
	if (s->pool->ops->memory != BACKEND_MEMORY_HOST) {
		if (!(req->has_features && (req->features & KVD_FEATURE_DEVICE_CHUNKS))) {
			envelope_reply_error(c, id, -EPROTONOSUPPORT, "the pool is GPU memory (backend "
			                     "%s) and this client cannot import device chunks (a libkvd "
			                     "built with CUDA is needed)", s->pool->ops->name);
			c->close_when_sent = true;
			return -EPROTONOSUPPORT;
		}
		r = hello_device(c, id, req);
		if (r < 0)
			return r;
	}
	/* A user's hello that brings a tenant into being counts against its uid, so that one
	 * user cannot fill the tenant table for everyone (tenant-create = any); root's and
	 * operators' do not. */
	creates = !tenant_find(&s->tenants, req->tenant) && c->cred.uid != 0 &&
	          !access_admin(&s->admin->cfg, c->fd, &c->cred);
	if (creates && tenant_count_created_by(&s->tenants, c->cred.uid) >=
	               s->limits.max_tenants_per_uid) {
		conn_refused(c, LIMIT_TENANTS_PER_UID);
		envelope_reply_error(c, id, -EUSERS, "uid %u brought %u tenants into being already "
		                     "(max-tenants-per-uid); idle ones are forgotten after "
		                     "tenant-forget", (unsigned)c->cred.uid,
		                     s->limits.max_tenants_per_uid);
		c->close_when_sent = true;
		return -EUSERS;
	}
	r = tenant_get(&s->tenants, req->tenant, ret);
	if (r == -EUSERS) {
		conn_refused(c, LIMIT_TENANTS);
		log_warning("connection %llu (pid %d): new tenant %s refused: max-tenants (%u) are "
		            "known (idle ones are forgotten after tenant-forget; kvdctl tenant delete "
		            "forgets one now)", (unsigned long long)c->id, (int)c->cred.pid,
		            req->tenant, s->limits.max_tenants);
	}
	if (r < 0) {
		envelope_reply_error(c, id, r, r == -EINVAL ? "invalid tenant name" :
		                     "too many tenants (%u)", s->limits.max_tenants);
		c->close_when_sent = true;
		return r;
	}
	if (creates)
		(*ret)->creator_uid = c->cred.uid;
	(*ret)->connections++;
	r = conn_open_pidfd(c);
	if (r < 0)
		log_warning("connection %llu (pid %d): no pidfd of the peer (%s): chunks it leaves "
		            "mapped stop being charged when it disconnects",
		            (unsigned long long)c->id, (int)c->cred.pid, strerror(-r));
	return 0;
}

/* The hello's log line: a tenant's at info, an administrative one at debug (kvdctl top
 * connects at every refresh while it cannot reach the daemon, and scripts poll status). */
static void hello_log(const struct conn *c) {
	const struct backend_device *dev = backend_device(c->device);

	if (c->tenant && dev)
		log_info("connection %llu: hello from pid %d uid %u ('%s'), tenant %s, GPU %d",
		         (unsigned long long)c->id, (int)c->cred.pid, (unsigned)c->cred.uid,
		         c->process_name, c->tenant->name, dev->index);
	else if (c->tenant)
		log_info("connection %llu: hello from pid %d uid %u ('%s'), tenant %s",
		         (unsigned long long)c->id, (int)c->cred.pid, (unsigned)c->cred.uid,
		         c->process_name, c->tenant->name);
	else
		log_debug("connection %llu: hello from pid %d uid %u ('%s'), administrative",
		          (unsigned long long)c->id, (int)c->cred.pid, (unsigned)c->cred.uid,
		          c->process_name);
}

/* The HelloReply: the version, the features both sides have, the pool, and the rings'
 * memfd (and eventfd) when c has rings. */
static void hello_reply(struct conn *c, uint64_t id, const Kvd__V1__Hello *req) {
	struct server *s = c->srv;
	const struct backend_device *dev = backend_device(c->device);
	Kvd__V1__HelloReply rep = KVD__V1__HELLO_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;

	rep.has_version = true;
	rep.version = KVD_PROTOCOL_VERSION_MAX;
	rep.has_features = true;
	rep.features = c->ring ? KVD_FEATURE_RING : 0;
	if (req->has_features) {
		/* Every descriptor carries header_bytes; a client that offers the bit reads it. */
		rep.features |= req->features & (KVD_FEATURE_SEQ_HEADER | KVD_FEATURE_TENANT_POLICY |
		                                 KVD_FEATURE_TIERS | KVD_FEATURE_RECALL);
		if (s->pool->ops->memory != BACKEND_MEMORY_HOST)
			rep.features |= req->features & KVD_FEATURE_DEVICE_CHUNKS;
	}
	rep.has_chunk_bytes = true;
	rep.chunk_bytes = s->pool->chunk_bytes;
	rep.has_memory = rep.has_pool_bytes = true;
	rep.memory = (Kvd__V1__MemoryKind)s->pool->ops->memory;
	rep.pool_bytes = s->pool->pool_bytes;
	if (dev) {
		rep.has_device_uuid = true;
		rep.device_uuid.len = sizeof(dev->uuid);
		rep.device_uuid.data = (uint8_t *)dev->uuid;
	}
	rep.daemon_version = (char *)KVD_VERSION;
	rep.has_connection_id = true;
	rep.connection_id = c->id;
	env.body_case = KVD__V1__ENVELOPE__BODY_HELLO_REPLY;
	env.hello_reply = &rep;
	if (c->ring) {
		int fds[2] = { c->ring->memfd, c->ring->efd };

		rep.has_ring_bytes = rep.has_ring_doorbell = true;
		rep.ring_bytes = c->ring->geo.total_bytes;
		rep.ring_doorbell = (Kvd__V1__RingDoorbell)c->ring->geo.doorbell;
		envelope_reply(c, id, &env, fds, c->ring->efd >= 0 ? 2 : 1);
		/* The queued reply holds its own copy; the daemon keeps the mapping. */
		c->ring->memfd = safe_close(c->ring->memfd);
	} else
		envelope_reply(c, id, &env, NULL, 0);
}

static void handle_hello(struct conn *c, uint64_t id, const Envelope *request,
                         int request_fd _unused_) {
	const Kvd__V1__Hello *req = request->hello;
	struct server *s = c->srv;
	uint32_t min = req->has_min_version ? req->min_version : 1;
	uint32_t max = req->has_max_version ? req->max_version : min;
	struct tenant *t;
	int r;

	if (c->hello) {
		envelope_reply_error(c, id, -EPROTO, "hello was already said");
		conn_violation(c, "second hello");
		return;
	}
	if (min > KVD_PROTOCOL_VERSION_MAX || max < KVD_PROTOCOL_VERSION_MAX || min > max) {
		envelope_reply_error(c, id, -EPROTONOSUPPORT, "protocol versions %u..%u requested, "
		                     "daemon speaks %u", min, max, KVD_PROTOCOL_VERSION_MAX);
		c->close_when_sent = true;
		return;
	}
	if (hello_tenant(c, id, req, &t) < 0)
		return;
	c->hello = true;
	c->version = KVD_PROTOCOL_VERSION_MAX;
	c->tenant = t;
	/* Names go into logs: keep them printable. */
	snprintf(c->process_name, sizeof(c->process_name), "%s", req->process_name ? req->process_name : "");
	for (char *p = c->process_name; *p; p++)
		if (*p < 0x20 || *p > 0x7e)
			*p = '?';
	hello_log(c);
	/* The rings are for a tenant's per-step requests; without them, the socket serves. */
	if (t && req->has_features && (req->features & KVD_FEATURE_RING) && s->limits.ring_entries > 0) {
		r = ring_new(c, s->limits.ring_entries, s->ring_doorbell, &c->ring);
		if (r < 0)
			log_warning_errno(r, "connection %llu: cannot set up its rings, it has the socket "
			                  "only", (unsigned long long)c->id);
	}
	hello_reply(c, id, req);
}

static void handle_register_model(struct conn *c, uint64_t id, const Envelope *request,
                                  int request_fd _unused_) {
	const Kvd__V1__RegisterModel *req = request->register_model;
	Kvd__V1__RegisterModelReply rep = KVD__V1__REGISTER_MODEL_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	struct model *m;
	const char *why;
	int r;

	if (c->n_models >= c->srv->limits.max_models) {
		conn_refused(c, LIMIT_MODELS);
		envelope_reply_error(c, id, -EMFILE, "at most %u models per connection", c->srv->limits.max_models);
		return;
	}
	if (c->tenant->models >= c->srv->limits.max_models_per_tenant) {
		conn_refused(c, LIMIT_MODELS_PER_TENANT);
		envelope_reply_error(c, id, -EMFILE, "at most %u models per tenant (max-models-per-tenant)",
		            c->srv->limits.max_models_per_tenant);
		return;
	}
	m = &c->models[c->n_models];
	r = model_from_request(req, c->srv->pool->chunk_bytes, c->srv->limits.max_observation_bytes, m,
	                       &why);
	if (r == -EFBIG)
		conn_refused(c, LIMIT_OBSERVATION);
	if (r < 0) {
		envelope_reply_error(c, id, r, "bad model: %s", why);
		return;
	}
	m->id = ++c->n_models;
	c->tenant->models++;
	rep.has_model_id = true;
	rep.model_id = m->id;
	rep.has_block_bytes = true;
	rep.block_bytes = m->block_bytes;
	rep.has_blocks_per_chunk = true;
	rep.blocks_per_chunk = c->srv->pool->chunk_bytes / ALIGN_TO(m->block_bytes, LAYOUT_BLOCK_ALIGN);
	if (m->obs_bytes) {
		rep.has_observation_bytes = true;
		rep.observation_bytes = m->obs_bytes;
	}
	if (m->index_dim) {
		rep.has_index_offset = true;
		rep.index_offset = m->index_offset;
	}
	if (m->moments_bytes) {
		rep.has_moments_bytes = true;
		rep.moments_bytes = m->moments_bytes;
	}
	env.body_case = KVD__V1__ENVELOPE__BODY_REGISTER_MODEL_REPLY;
	env.register_model_reply = &rep;
	envelope_reply(c, id, &env, NULL, 0);
}

static void handle_seq_open(struct conn *c, uint64_t id, const Envelope *request,
                            int request_fd _unused_) {
	const Kvd__V1__SeqOpen *req = request->seq_open;
	struct server *s = c->srv;
	Kvd__V1__SeqOpenReply rep = KVD__V1__SEQ_OPEN_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	struct seq *q;
	int r;

	if (!req->has_model_id || req->model_id < 1 || req->model_id > c->n_models) {
		envelope_reply_error(c, id, -EINVAL, "unknown model");
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
	s->next_seq_id++;
	registry_seq_opened(s, q);
	/* While the descriptor's fd is still open, for the fd store. */
	keep_seq_opened(s->keep, q, s->next_seq_id);

	rep.has_seq_id = true;
	rep.seq_id = q->id;
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
static void handle_seq_claim(struct conn *c, uint64_t id, const Envelope *request,
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

/*
 * Grows sequence seq_id of c by tokens and answers request id, on the socket or, with ring,
 * as the completion of the ring submission whose user_data is id; when the budget cannot
 * meet it and wait_until_ms (CLOCK_MONOTONIC ms) is in the future, parks it for an eviction
 * round instead (evict.h), which hands it back to grow_retry.
 */
static void dispatch_grow(struct conn *c, uint64_t id, bool ring, uint64_t seq_id, uint32_t tokens,
                          uint64_t wait_until_ms, uint64_t since_us);

static void grow_retry(struct conn *c, const struct parked_grow *g, uint64_t wait_until_ms) {
	dispatch_grow(c, g->id, g->ring, g->seq_id, g->tokens, wait_until_ms, g->since_us);
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

static void dispatch_grow(struct conn *c, uint64_t id, bool ring, uint64_t seq_id, uint32_t tokens,
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
	/* Grows that wait for the pool are served in order: one that needs blocks queues
	 * behind them, so that the chunks a round frees for a waiting grow (often at another
	 * tenant's unpin) are not taken by whoever asks next; in a retry pass, behind those
	 * retried before it that wait on. */
	if (tokens > 0 && waits && evict_grants_queued(s->evictor, c->device) > 0 &&
	    c->outstanding < s->limits.max_outstanding && seq_grow_bytes(q, tokens) > 0 &&
	    park_grow(c, &req, false, seq_grow_bytes(q, tokens), wait_until_ms, since_us != 0))
		return;
	/* A pinned sequence's grow is held to max-pinned-percent, once it is a grow at all. */
	r = seq_grow_check(q, tokens) < 0 ? 0 : pins_may_grow(s, q, seq_grow_bytes(q, tokens),
	                                                      why, WHY_MAX);
	if (r < 0) {
		reply_step(c, ring, id, r, why);
		return;
	}
	r = seq_grow(q, p, c->id, tokens, &g, &emptied);
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
	pins_grown(q);
	if (since_us)
		metrics_observe_grant_wait(&s->metrics, now_us() - since_us);
	grow_answer(c, id, ring, q, &g);
	evict_kick(s->evictor, ROUND_WATERMARK);
}

static void handle_seq_grow(struct conn *c, uint64_t id, const Envelope *request,
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
	dispatch_grow(c, id, false, req->seq_id, req->tokens, wait ? now_ms() + wait : 0, 0);
}

/*
 * Releases sequence seq_id. The chunks this connection must unmap go to *ret_ids (allocated;
 * *ret_n of them); when there was no memory for the list, every holder, this connection
 * included, is asked through events instead.
 */
static int step_release(struct conn *c, uint64_t seq_id, uint32_t **ret_ids, uint32_t *ret_n,
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

static void handle_seq_release(struct conn *c, uint64_t id, const Envelope *request,
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

static void handle_chunks_unmapped(struct conn *c, uint64_t id, const Envelope *request,
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

static void handle_seq_digest(struct conn *c, uint64_t id, const Envelope *request,
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

/*
 * The budget a BudgetSet asks for, in bytes (a percent is of the whole pool, every device's
 * together), checked against the pool and, without force, the floor: the tenants'
 * guaranteed minimums together, and at least one chunk, below which the guarantees cannot
 * hold or nothing can be granted. Returns 0, or -EINVAL, -ERANGE with why.
 */
static int budget_change(const struct server *s, const Kvd__V1__BudgetSet *req, uint64_t *ret,
                         char why[static WHY_MAX]) {
	const struct pool *p = s->pool;
	uint64_t bytes, mins = 0, floor;
	char a[32], b[32];

	if (req->has_percent && (req->percent < 1 || req->percent > 100))
		return refuse(why, -EINVAL, "a budget in percent is 1..100 of the pool");
	if (req->has_percent == req->has_bytes)
		return refuse(why, -EINVAL, "a budget in bytes or in percent of the pool, one of them");
	bytes = req->has_percent ? p->pool_bytes / 100 * req->percent +
	                           p->pool_bytes % 100 * req->percent / 100 : req->bytes;
	if (bytes > p->pool_bytes)
		return refuse(why, -EINVAL, "the budget must be at most the pool (%s)",
		              size_format(p->pool_bytes, a, sizeof(a)));
	for (uint32_t i = 0; i < s->tenants.n; i++)
		mins += s->tenants.tenants[i]->min_bytes;
	floor = MAX(mins, p->chunk_bytes);
	if (bytes < floor && !(req->has_force && req->force))
		return refuse(why, -ERANGE, "%s is below the floor of %s (%s); force it to set it "
		              "anyway", size_format(bytes, a, sizeof(a)), size_format(floor, b, sizeof(b)),
		              mins > p->chunk_bytes ? "the tenants' guaranteed minimums together" :
		                                      "one chunk: nothing could be granted");
	*ret = bytes;
	return 0;
}

static void handle_budget_set(struct conn *c, uint64_t id, const Envelope *request,
                              int request_fd _unused_) {
	const Kvd__V1__BudgetSet *req = request->budget_set;
	struct pool *p = c->srv->pool;
	char why[512];
	uint64_t bytes = 0;
	int r;

	r = budget_change(c->srv, req, &bytes, why);
	if (r < 0) {
		envelope_reply_error(c, id, r, "%s", why);
		return;
	}
	r = admin_budget_set(c->srv->admin, bytes, why, sizeof(why));
	if (r >= 0)
		log_notice("budget set to %llu bytes by pid %d uid %u (%llu in use)%s",
		           (unsigned long long)bytes, (int)c->cred.pid, (unsigned)c->cred.uid,
		           (unsigned long long)p->used_bytes,
		           req->has_force && req->force ? ", forced below the floor" : "");
	reply_live(c, id, r, why);
	if (r >= 0 && p->used_bytes > p->budget_bytes)
		evict_kick(c->srv->evictor, ROUND_BUDGET);
}

static void handle_budget_reset(struct conn *c, uint64_t id, const Envelope *request _unused_,
                                int request_fd _unused_) {
	struct pool *p = c->srv->pool;
	char why[512];
	int r;

	r = admin_budget_reset(c->srv->admin, why, sizeof(why));
	if (r >= 0)
		log_notice("budget reset to %llu bytes (%s) by pid %d uid %u",
		           (unsigned long long)p->budget_bytes, admin_budget_source(c->srv->admin),
		           (int)c->cred.pid, (unsigned)c->cred.uid);
	reply_live(c, id, r, why);
}

/*
 * Checks a TenantSet and says what the tenant's settings would be after it: those it sets,
 * the others as the tenant has them (or the defaults, for a tenant it would create), in
 * *ret (tenant_id 0 when the tenant does not exist yet). Returns 0, or -EINVAL with why.
 */
static int tenant_change(const struct server *s, const Kvd__V1__TenantSet *req,
                         struct evict_patch *ret, char why[static WHY_MAX]) {
	const struct tenant *t;

	if (!req->name || !tenant_name_valid(req->name))
		return refuse(why, -EINVAL, "invalid tenant name");
	if (req->has_weight && (req->weight < 1 || req->weight > KVD_TENANT_WEIGHT_MAX))
		return refuse(why, -EINVAL, "weight must be 1..%u", KVD_TENANT_WEIGHT_MAX);
	if (req->policy && (int)kvd_policy_from_string(req->policy) < 0)
		return refuse(why, -EINVAL, "unknown policy (kvd.conf(5) lists them)");
	if (req->tier && tier_mode_from_string(req->tier) < 0)
		return refuse(why, -EINVAL, "unknown tier '%s': drop, host or host+file", req->tier);
	if (req->tier && tier_mode_from_string(req->tier) != TIER_DROP && s->tier->budget_bytes == 0)
		return refuse(why, -EINVAL, "tier %s needs a host tier: kvd runs without one "
		              "(host-tier-size 0)", req->tier);
	if (req->has_recall && req->recall > KVD_TENANT_RECALL_MAX)
		return refuse(why, -EINVAL, "recall must be 0..%u tokens per row",
		              KVD_TENANT_RECALL_MAX);
	if (req->has_recall && req->recall > 0 && s->tier->budget_bytes == 0)
		return refuse(why, -EINVAL, "recall needs a host tier, where evicted tokens are kept: "
		              "kvd runs without one (host-tier-size 0)");
	if (req->tier && tier_mode_from_string(req->tier) == TIER_HOST_FILE && !s->tier->file)
		return refuse(why, -EINVAL, "tier host+file needs a file tier: kvd runs without one "
		              "(file-tier-size 0)");
	t = tenant_find(&s->tenants, req->name);
	*ret = (struct evict_patch){
		.tenant_id = t ? t->id : 0,
		.min_bytes = req->has_min_bytes ? req->min_bytes : t ? t->min_bytes : 0,
		.max_bytes = req->has_max_bytes ? req->max_bytes : t ? t->max_bytes : KVD_TENANT_NO_CAP,
		.weight = req->has_weight ? req->weight : t ? t->weight : 1,
		.policy = req->policy ? (int)kvd_policy_from_string(req->policy) :
		          t ? t->policy : KVD_POLICY_KVD,
	};
	if (ret->min_bytes > ret->max_bytes)
		return refuse(why, -EINVAL, "min above max");
	if (ret->min_bytes != 0 && ret->min_bytes > s->pool->pool_bytes)
		return refuse(why, -EINVAL, "min above the pool");
	return 0;
}

static void handle_tenant_set(struct conn *c, uint64_t id, const Envelope *request,
                              int request_fd _unused_) {
	const Kvd__V1__TenantSet *req = request->tenant_set;
	struct state_tenant change = {};
	struct evict_patch after = {};
	struct tenant *t;
	uint64_t min, max;
	char why[512], min_s[32], max_s[32];
	int r;

	r = tenant_change(c->srv, req, &after, why);
	if (r < 0) {
		envelope_reply_error(c, id, r, "%s", why);
		return;
	}
	min = after.min_bytes;
	max = after.max_bytes;
	r = tenant_get(&c->srv->tenants, req->name, &t);
	if (r < 0) {
		if (r == -EUSERS) {
			conn_refused(c, LIMIT_TENANTS);
			log_warning("tenant set by pid %d: new tenant %s refused: max-tenants (%u) are "
			            "known", (int)c->cred.pid, req->name, c->srv->limits.max_tenants);
		}
		envelope_reply_error(c, id, r, "too many tenants (%u)", c->srv->limits.max_tenants);
		return;
	}
	change.has_min = req->has_min_bytes;
	change.min_bytes = min;
	change.has_max = req->has_max_bytes;
	change.max_bytes = max;
	change.has_weight = req->has_weight;
	change.weight = req->weight;
	change.has_policy = req->policy != NULL;
	change.policy = req->policy ? (int)kvd_policy_from_string(req->policy) : 0;
	change.has_tier = req->tier != NULL;
	change.tier = req->tier ? tier_mode_from_string(req->tier) : 0;
	change.has_recall = req->has_recall;
	change.recall = req->recall;
	/* Setting it again is how an operator takes back a tenant the file tier failed. */
	if (req->tier)
		t->tier_degraded = false;
	r = admin_tenant_set(c->srv->admin, t, &change, why, sizeof(why));
	if (r >= 0)
		log_notice("tenant %s set by pid %d uid %u: min %s, max %s, weight %u, policy %s, "
		           "tier %s, recall %u", t->name, (int)c->cred.pid, (unsigned)c->cred.uid,
		           size_format(t->min_bytes, min_s, sizeof(min_s)),
		           tenant_format_max(t->max_bytes, max_s, sizeof(max_s)), t->weight,
		           kvd_policy_to_string(t->policy), tier_mode_to_string(t->tier), t->recall);
	reply_live(c, id, r, why);
	/* A cap lowered below what the tenant holds: the excess goes now, as a budget. */
	if (r >= 0 && t->max_bytes != KVD_TENANT_NO_CAP && t->used_bytes > t->max_bytes)
		evict_cap_lowered(c->srv->evictor);
}

static void handle_tenant_reset(struct conn *c, uint64_t id, const Envelope *request,
                                int request_fd _unused_) {
	const Kvd__V1__TenantReset *req = request->tenant_reset;
	struct tenant *t;
	char why[512], min_s[32], max_s[32];
	int r;

	if (!req->name || !tenant_name_valid(req->name)) {
		envelope_reply_error(c, id, -EINVAL, "invalid tenant name");
		return;
	}
	r = admin_tenant_reset(c->srv->admin, req->name, why, sizeof(why));
	t = tenant_find(&c->srv->tenants, req->name);
	if (r >= 0 && t)
		log_notice("tenant %s reset by pid %d uid %u: min %s, max %s, weight %u", t->name,
		           (int)c->cred.pid, (unsigned)c->cred.uid,
		           size_format(t->min_bytes, min_s, sizeof(min_s)),
		           tenant_format_max(t->max_bytes, max_s, sizeof(max_s)), t->weight);
	reply_live(c, id, r, why);
}

static void handle_tenant_delete(struct conn *c, uint64_t id, const Envelope *request,
                                 int request_fd _unused_) {
	const Kvd__V1__TenantDelete *req = request->tenant_delete;
	char why[512];
	int r;

	if (!req->name || !tenant_name_valid(req->name)) {
		envelope_reply_error(c, id, -EINVAL, "invalid tenant name");
		return;
	}
	r = admin_tenant_delete(c->srv->admin, req->name, why, sizeof(why));
	if (r >= 0)
		log_notice("tenant %s deleted by pid %d uid %u", req->name, (int)c->cred.pid,
		           (unsigned)c->cred.uid);
	reply_live(c, id, r, why);
}

static void handle_model_output_proj(struct conn *c, uint64_t id, const Envelope *request, int fd) {
	const Kvd__V1__ModelOutputProj *req = request->model_output_proj;
	struct wo_map wo;
	struct model *m;
	const char *why = NULL;
	int r;

	if (!req->has_model_id || req->model_id < 1 || req->model_id > c->n_models) {
		envelope_reply_error(c, id, -EINVAL, "unknown model");
		return;
	}
	m = &c->models[req->model_id - 1];
	if (fd < 0 || !req->has_layer || !req->has_dtype || !req->has_hidden) {
		envelope_reply_error(c, id, -EINVAL, "layer, dtype, hidden and one memfd are needed");
		return;
	}
	r = grams_check(m, req->layer, fd, req->dtype, req->hidden, &wo, &why);
	if (r < 0) {
		envelope_reply_error(c, id, r, "bad output projection: %s", why ? why : strerror(-r));
		return;
	}
	if (c->outstanding >= c->srv->limits.max_outstanding) {
		wo_map_done(&wo);
		conn_refused(c, LIMIT_OUTSTANDING);
		envelope_reply_error(c, id, -EBUSY, "%u replies outstanding on this connection (max-outstanding)",
		            c->outstanding);
		return;
	}
	/* The reply comes from the uploader, once the Gram matrices are computed. */
	r = upload_start(c->srv->uploader, c, id, req->model_id, req->layer, &wo);
	if (r == -EBUSY)
		conn_refused(c, LIMIT_UPLOADS);
	if (r >= 0)
		c->outstanding++;
	else if (r == -EBUSY)
		envelope_reply_error(c, id, r, "too many uploads computing (%u); retry", UPLOADS_MAX);
	else if (r < 0)
		envelope_reply_error(c, id, r, "cannot start computing: %s", strerror(-r));
}

#define SEQ_PINS_MAX 255

static void dispatch_pin(struct conn *c, uint64_t id, bool ring, uint64_t seq_id,
                         uint64_t wait_until_ms, uint64_t since_us);

static void pin_retry(struct conn *c, const struct parked_grow *g, uint64_t wait_until_ms) {
	dispatch_pin(c, g->id, g->ring, g->seq_id, wait_until_ms, g->since_us);
}

/* Pins sequence seq_id of c, bringing it back from its tier first, and answers with
 * what it found (KVD_RECALL_*): in the ring completion's flags, or a SeqPinReply (none for
 * KVD_RECALL_NONE, as from daemons that predate tiers). */
static void dispatch_pin(struct conn *c, uint64_t id, bool ring, uint64_t seq_id,
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

static int step_unpin(struct conn *c, uint64_t seq_id, uint32_t event_id, char why[static WHY_MAX]) {
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
		pins_release(q);
		evict_apply_pending(c->srv->evictor, q);
	}
	return 0;
}

static void handle_seq_pin(struct conn *c, uint64_t id, const Envelope *request,
                           int request_fd _unused_) {
	const Kvd__V1__SeqPin *req = request->seq_pin;
	uint64_t wait = c->srv->limits.grant_wait_ms;

	dispatch_pin(c, id, false, req->has_seq_id ? req->seq_id : 0, wait ? now_ms() + wait : 0, 0);
}

/* ---- answers to requests that waited for a round (evict.h, evict_done_fn) ---- */

/* The connection whose request id waited, one reply less outstanding, when o is a success
 * to answer; NULL when it closed meanwhile (nobody to answer), or when o is an error,
 * answered here. */
static struct conn *waiter(struct server *s, uint64_t conn_id, uint64_t id,
                           const struct evict_outcome *o) {
	struct conn *c = registry_conn(s, conn_id);

	if (!c || c->closing)
		return NULL;
	c->outstanding--;
	if (o->error < 0) {
		envelope_reply_error(c, id, o->error, "%s", o->why);
		return NULL;
	}
	return c;
}

/* One Round of an EvictionsReply: a round of the history, or (id 0) a plan; ts and tp have
 * room for rec's tenants, of which those it took from are listed. */
static void round_message(const struct evict_record *rec, Kvd__V1__Round *r,
                          Kvd__V1__RoundTenant *ts, Kvd__V1__RoundTenant **tp) {
	bool plan = rec->id == 0;

	kvd__v1__round__init(r);
	r->trigger = (char *)round_trigger_to_string(rec->trigger);
	r->has_target_bytes = r->has_planned_bytes = r->has_sequences = r->has_units = true;
	r->has_predicted_error = r->has_score_us = r->has_select_us = true;
	r->target_bytes = rec->target;
	r->planned_bytes = rec->planned;
	r->sequences = rec->sequences;
	r->units = rec->units;
	r->predicted_error = rec->predicted_error;
	r->score_us = rec->score_us;
	r->select_us = rec->select_us;
	if (rec->note[0])
		r->note = (char *)rec->note;
	if (!plan) {
		r->has_id = r->has_start_ms = r->has_duration_us = r->has_compact_us = true;
		r->has_freed_bytes = r->has_waiting_bytes = r->has_dropped_bytes = true;
		r->id = rec->id;
		r->start_ms = rec->start_ms;
		r->duration_us = rec->duration_us;
		r->compact_us = rec->compact_us;
		r->freed_bytes = rec->freed;
		r->waiting_bytes = rec->waiting;
		r->dropped_bytes = rec->dropped;
		if (rec->trigger == ROUND_RECALL) {
			r->has_recalled_tokens = r->has_scored_tokens = true;
			r->recalled_tokens = rec->recalled;
			r->scored_tokens = rec->scored;
		}
		if (rec->error < 0)
			r->error = strerror(-rec->error);
	}
	/* A round's: what was applied (a tenant whose share waits or was dropped is in those
	 * sums); a plan's: what it would take, and at what predicted cost. */
	r->tenants = tp;
	for (uint32_t j = 0; j < rec->n_tenants; j++) {
		Kvd__V1__RoundTenant *t = &ts[r->n_tenants];

		if (rec->tenants[j].applied_bytes == 0)
			continue;
		kvd__v1__round_tenant__init(t);
		t->name = (char *)rec->tenants[j].name;
		t->has_freed_bytes = t->has_evicted_tokens = true;
		t->freed_bytes = rec->tenants[j].applied_bytes;
		t->evicted_tokens = rec->tenants[j].applied_tokens;
		if (plan) {
			t->has_predicted_error = true;
			t->predicted_error = rec->tenants[j].predicted_error;
		}
		tp[r->n_tenants++] = t;
	}
}

static void evict_answered(struct server *s, uint64_t conn_id, uint64_t id,
                           const struct evict_outcome *o) {
	struct conn *c = waiter(s, conn_id, id, o);

	if (c)
		envelope_reply_evict(c, id, o->round->id, o->round->target, o->round->freed);
}

/* A plan's answer: an EvictionsReply of the one round it would be. */
static void plan_answered(struct server *s, uint64_t conn_id, uint64_t id,
                          const struct evict_outcome *o) {
	struct conn *c = waiter(s, conn_id, id, o);
	Kvd__V1__EvictionsReply rep = KVD__V1__EVICTIONS_REPLY__INIT;
	Kvd__V1__Round round, *rounds[1] = { &round };
	Envelope env = KVD__V1__ENVELOPE__INIT;
	_cleanup_(freep) Kvd__V1__RoundTenant *ts = NULL;
	_cleanup_(freep) Kvd__V1__RoundTenant **tp = NULL;

	if (!c)
		return;
	ts = calloc(MAX(o->round->n_tenants, 1u), sizeof(*ts));
	tp = calloc(MAX(o->round->n_tenants, 1u), sizeof(*tp));
	if (!ts || !tp) {
		envelope_reply_error(c, id, -ENOMEM, "out of memory");
		return;
	}
	round_message(o->round, &round, ts, tp);
	rep.n_rounds = 1;
	rep.rounds = rounds;
	env.body_case = KVD__V1__ENVELOPE__BODY_EVICTIONS_REPLY;
	env.evictions_reply = &rep;
	envelope_reply(c, id, &env, NULL, 0);
}

static void recall_answered(struct server *s, uint64_t conn_id, uint64_t id,
                            const struct evict_outcome *o) {
	struct conn *c = waiter(s, conn_id, id, o);
	Kvd__V1__SeqRecallReply rep = KVD__V1__SEQ_RECALL_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;

	if (!c)
		return;
	rep.has_tokens = rep.has_bytes = rep.has_candidates = true;
	rep.tokens = o->tokens;
	rep.bytes = o->bytes;
	rep.candidates = o->candidates;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_RECALL_REPLY;
	env.seq_recall_reply = &rep;
	envelope_reply(c, id, &env, NULL, 0);
}

/*
 * A tenant's own requests that run a round (Evict, Plan, SeqRecall), per connection: rounds
 * run one at a time, so a tenant looping on them would keep the worker to itself. Grows'
 * rounds go first whatever waits (evict_kick), and the rate bounds what the others wait.
 * Operators (root, admin-group) are not limited.
 */
#define ROUND_RATE_BURST 8u
#define ROUND_RATE_PER_S 10u

/* Whether c may queue one more round now; when not, refuses request id and counts it. */
static bool round_rate_allows(struct conn *c, uint64_t id) {
	uint64_t now = now_ms(), add;

	if (c->round_refill_ms == 0) {
		c->round_tokens = ROUND_RATE_BURST;
		c->round_refill_ms = now;
	}
	add = (now - c->round_refill_ms) * ROUND_RATE_PER_S / 1000;
	if (add > 0) {
		c->round_tokens = (uint32_t)MIN(c->round_tokens + add, ROUND_RATE_BURST);
		c->round_refill_ms += add * 1000 / ROUND_RATE_PER_S;
	}
	if (c->round_tokens > 0) {
		c->round_tokens--;
		return true;
	}
	conn_refused(c, LIMIT_EVICT_RATE);
	envelope_reply_error(c, id, -EAGAIN, "at most %u requests a second that run a round "
	                     "(evictions, plans, recalls) per connection (%u at once)",
	                     ROUND_RATE_PER_S, ROUND_RATE_BURST);
	return false;
}

/* Brings back kept tokens the sequence's window needs (recall.h): answered when its round
 * traded them (evict_recall). */
static void handle_seq_recall(struct conn *c, uint64_t id, const Envelope *request,
                              int request_fd _unused_) {
	const Kvd__V1__SeqRecall *req = request->seq_recall;
	struct server *s = c->srv;
	struct seq *q = conn_seq(c, req->has_seq_id ? req->seq_id : 0);
	int r;

	if (!q) {
		envelope_reply_error(c, id, -ENOENT, "no such sequence on this connection");
		return;
	}
	if (c->tenant->recall == 0) {
		envelope_reply_error(c, id, -EOPNOTSUPP, "tenant %s has recall off (kvd.conf(5), "
		                     "recall; kvdctl tenant set --recall)", c->tenant->name);
		return;
	}
	if (q->model->unit == KVD_UNIT_NONE || q->model->compensation != KVD_COMPENSATION_NONE) {
		envelope_reply_error(c, id, -EOPNOTSUPP, "the sequence's model %s: only models "
		                     "registered with an eviction unit and without compensation "
		                     "recall", q->model->unit == KVD_UNIT_NONE ? "is never evicted" :
		                     "keeps moments of what is evicted");
		return;
	}
	if (refuse_if_outstanding(c, id) ||
	    (!access_admin(&s->admin->cfg, c->fd, &c->cred) && !round_rate_allows(c, id)))
		return;
	r = evict_recall(s->evictor, c, id, q, recall_answered);
	if (r == -EBUSY && q->pins > 0)
		envelope_reply_error(c, id, r, "the sequence is pinned: ask for a recall between steps");
	else if (r == -EBUSY)
		envelope_reply_error(c, id, r, "%u recalls wait already", EVICT_WAITERS_MAX);
	else if (r < 0)
		envelope_reply_error(c, id, r, "the sequence is moved out of the pool or its engine's "
		                     "last step has not completed: pin it, or wait for the step");
}

static void handle_seq_unpin(struct conn *c, uint64_t id, const Envelope *request,
                             int request_fd _unused_) {
	const Kvd__V1__SeqUnpin *req = request->seq_unpin;
	char why[WHY_MAX];

	reply_step(c, false, id,
	           step_unpin(c, req->has_seq_id ? req->seq_id : 0,
	                      req->has_event_id ? req->event_id : 0, why),
	           why);
}

static void handle_register_event(struct conn *c, uint64_t id, const Envelope *request,
                                  int request_fd _unused_) {
	const Kvd__V1__RegisterEvent *req = request->register_event;
	const struct backend_ops *ops = c->srv->pool->ops;
	Kvd__V1__RegisterEventReply rep = KVD__V1__REGISTER_EVENT_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	void *ev;
	int r;

	if (!ops->event_open) {
		envelope_reply_error(c, id, -EOPNOTSUPP, "the %s backend has no events to wait for", ops->name);
		return;
	}
	if (c->n_events == KVD_CONN_EVENTS_MAX) {
		envelope_reply_error(c, id, -ENOSPC, "this connection has its %u events already", KVD_CONN_EVENTS_MAX);
		return;
	}
	if (!req->has_ipc_handle || req->ipc_handle.len != BACKEND_EVENT_HANDLE_BYTES) {
		envelope_reply_error(c, id, -EINVAL, "an event's IPC handle is %u bytes", BACKEND_EVENT_HANDLE_BYTES);
		return;
	}
	r = ops->event_open(c->device, req->ipc_handle.data, req->ipc_handle.len, &ev);
	if (r < 0) {
		envelope_reply_error(c, id, r, "the driver does not open this event: %s", strerror(-r));
		return;
	}
	c->events[c->n_events++] = ev;
	rep.has_event_id = true;
	rep.event_id = c->n_events;
	env.body_case = KVD__V1__ENVELOPE__BODY_REGISTER_EVENT_REPLY;
	env.register_event_reply = &rep;
	envelope_reply(c, id, &env, NULL, 0);
}

static void handle_evict(struct conn *c, uint64_t id, const Envelope *request,
                         int request_fd _unused_) {
	const Kvd__V1__Evict *req = request->evict;
	struct tenant *t = NULL;
	bool admin;
	int r;

	if (req->tenant) {
		t = tenant_find(&c->srv->tenants, req->tenant);
		if (!t) {
			envelope_reply_error(c, id, -ENOENT, "no tenant %s", req->tenant);
			return;
		}
	}
	/* A tenant may always give up its own memory; anything else is the operator's. */
	admin = access_admin(&c->srv->admin->cfg, c->fd, &c->cred);
	if ((!t || t != c->tenant) && !admin) {
		c->srv->access_refused++;
		envelope_reply_error(c, id, -EPERM, "only root and members of admin-group (%s) may evict from "
		            "other tenants", c->srv->admin->cfg.admin_group);
		return;
	}
	if (refuse_if_outstanding(c, id))
		return;
	if (!admin && !round_rate_allows(c, id))
		return;
	r = evict_request(c->srv->evictor, c, id, t, req->has_bytes ? req->bytes : 0, evict_answered);
	if (r == -EBUSY)
		conn_refused(c, LIMIT_EVICT_REQUESTS);
	if (r >= 0)
		c->outstanding++;
	else
		envelope_reply_error(c, id, r, r == -EBUSY ? "too many eviction requests waiting (%u)" : "out of memory",
		            EVICT_WAITERS_MAX);
}

static void handle_evictions(struct conn *c, uint64_t id, const Envelope *request _unused_,
                             int request_fd _unused_) {
	const struct evictor *e = c->srv->evictor;
	uint32_t n = evict_records(e), n_tenants = 0;
	Kvd__V1__EvictionsReply rep = KVD__V1__EVICTIONS_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	_cleanup_(freep) Kvd__V1__Round *rounds = NULL;
	_cleanup_(freep) Kvd__V1__Round **rp = NULL;
	_cleanup_(freep) Kvd__V1__RoundTenant *ts = NULL;
	_cleanup_(freep) Kvd__V1__RoundTenant **tp = NULL;

	for (uint32_t i = 0; i < n; i++)
		n_tenants += evict_record_at(e, i)->n_tenants;
	rounds = calloc(MAX(n, 1u), sizeof(*rounds));
	rp = calloc(MAX(n, 1u), sizeof(*rp));
	ts = calloc(MAX(n_tenants, 1u), sizeof(*ts));
	tp = calloc(MAX(n_tenants, 1u), sizeof(*tp));
	if (!rounds || !rp || !ts || !tp) {
		envelope_reply_error(c, id, -ENOMEM, "out of memory");
		return;
	}
	n_tenants = 0;
	for (uint32_t i = 0; i < n; i++) {
		const struct evict_record *rec = evict_record_at(e, i);

		round_message(rec, &rounds[i], ts + n_tenants, tp + n_tenants);
		n_tenants += rec->n_tenants;
		rp[i] = &rounds[i];
	}
	rep.n_rounds = n;
	rep.rounds = rp;
	env.body_case = KVD__V1__ENVELOPE__BODY_EVICTIONS_REPLY;
	env.evictions_reply = &rep;
	envelope_reply(c, id, &env, NULL, 0);
}

static void handle_status(struct conn *c, uint64_t id, const Envelope *request _unused_,
                          int request_fd _unused_) {
	struct server *s = c->srv;
	struct pool *p = s->pool;
	Kvd__V1__StatusReply rep = KVD__V1__STATUS_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	uint32_t n = s->tenants.n;
	_cleanup_(freep) Kvd__V1__TenantStatus *ts = calloc(MAX(n, 1u), sizeof(*ts));
	_cleanup_(freep) Kvd__V1__TenantStatus **tp = calloc(MAX(n, 1u), sizeof(*tp));
	Kvd__V1__Counter refused[_LIMIT_MAX], *refused_ptrs[_LIMIT_MAX];
	/* A line of at most ~300 bytes per GPU. */
	char devices[BACKEND_DEVICES_MAX * 320];

	if (!ts || !tp) {
		envelope_reply_error(c, id, -ENOMEM, "out of memory");
		return;
	}
	rep.daemon_version = (char *)KVD_VERSION;
	rep.backend = (char *)p->ops->name;
	node_values_status(s, &rep);
	for (unsigned i = 0; i < _LIMIT_MAX; i++) {
		kvd__v1__counter__init(&refused[i]);
		refused[i].name = (char *)limit_to_string(i);
		refused[i].has_value = true;
		refused[i].value = s->refused[i];
		refused_ptrs[i] = &refused[i];
	}
	rep.n_refused = _LIMIT_MAX;
	rep.refused = refused_ptrs;
	rep.budget_source = (char *)admin_budget_source(s->admin);
	rep.state_error = (char *)admin_state_error(s->admin);
	/* What tenants hold changes without any setting changing: look again. */
	warnings_update(s);
	rep.warnings = (char *)warnings_text(s);
	backend_devices_text(devices, sizeof(devices));
	if (devices[0])
		rep.devices = devices;
	for (uint32_t i = 0; i < n; i++) {
		const struct tenant *t = s->tenants.tenants[i];

		kvd__v1__tenant_status__init(&ts[i]);
		ts[i].name = (char *)t->name;
		ts[i].has_used_bytes = ts[i].has_block_bytes = ts[i].has_min_bytes = true;
		ts[i].has_max_bytes = ts[i].has_weight = ts[i].has_sequences = true;
		ts[i].has_connections = ts[i].has_chunks = true;
		ts[i].used_bytes = t->used_bytes;
		ts[i].block_bytes = t->block_bytes;
		ts[i].min_bytes = t->min_bytes;
		ts[i].max_bytes = t->max_bytes;
		ts[i].weight = t->weight;
		ts[i].sequences = t->sequences;
		ts[i].connections = t->connections;
		ts[i].chunks = t->chunks;
		ts[i].min_source = (char *)setting_source_to_string(t->min_source);
		ts[i].max_source = (char *)setting_source_to_string(t->max_source);
		ts[i].weight_source = (char *)setting_source_to_string(t->weight_source);
		ts[i].policy_source = (char *)setting_source_to_string(t->policy_source);
		ts[i].policy = (char *)kvd_policy_to_string(t->policy);
		ts[i].has_evicted_bytes = ts[i].has_evicted_tokens = ts[i].has_rounds = true;
		ts[i].evicted_bytes = t->evicted_bytes;
		ts[i].evicted_tokens = t->evicted_tokens;
		ts[i].rounds = t->rounds;
		ts[i].has_grants = ts[i].has_grants_refused = ts[i].has_grants_waited = true;
		ts[i].grants = t->grants;
		ts[i].grants_refused = t->grants_refused;
		ts[i].grants_waited = t->grants_waited;
		ts[i].tier = (char *)tier_mode_to_string(t->tier);
		ts[i].tier_source = (char *)setting_source_to_string(t->tier_source);
		ts[i].has_tier_bytes = ts[i].has_tier_sequences = ts[i].has_tier_lost = true;
		ts[i].has_tier_file_bytes = ts[i].has_tier_degraded = true;
		ts[i].tier_file_bytes = t->tier_file_bytes;
		ts[i].tier_degraded = t->tier_degraded;
		ts[i].tier_bytes = t->tier_bytes;
		ts[i].tier_sequences = t->tier_seqs;
		ts[i].tier_lost = t->tier_lost;
		ts[i].has_recall = ts[i].has_recalled_tokens = true;
		ts[i].recall = t->recall;
		ts[i].recall_source = (char *)setting_source_to_string(t->recall_source);
		ts[i].recalled_tokens = t->recalled_tokens;
		ts[i].has_pinned_bytes = ts[i].has_pins_overdue = true;
		ts[i].pinned_bytes = t->pinned_bytes;
		ts[i].pins_overdue = t->pins_overdue;
		tp[i] = &ts[i];
	}
	rep.n_tenants = n;
	rep.tenants = tp;
	env.body_case = KVD__V1__ENVELOPE__BODY_STATUS_REPLY;
	env.status_reply = &rep;
	envelope_reply(c, id, &env, NULL, 0);
}

/* Answers a dry run of a budget, tenant or evict change with the round it would start
 * (evict_plan); the rights are the change's own. */
static void handle_plan(struct conn *c, uint64_t id, const Envelope *request,
                        int request_fd _unused_) {
	const Kvd__V1__Plan *req = request->plan;
	struct server *s = c->srv;
	bool admin = access_admin(&s->admin->cfg, c->fd, &c->cred);
	struct evict_patch patch = {};
	struct tenant *only = NULL;
	enum round_trigger trigger;
	char why[WHY_MAX];
	uint64_t bytes = 0;
	int r;

	if (!!req->budget_set + !!req->tenant_set + !!req->evict != 1) {
		envelope_reply_error(c, id, -EINVAL, "a plan is of one change: a budget, a tenant or an "
		                     "eviction");
		return;
	}
	if ((req->budget_set || req->tenant_set ||
	     (req->evict && (!req->evict->tenant || !c->tenant ||
	                     strcmp(req->evict->tenant, c->tenant->name) != 0))) && !admin) {
		s->access_refused++;
		envelope_reply_error(c, id, -EPERM, "only root and members of admin-group (%s) may plan "
		                     "this change", s->admin->cfg.admin_group);
		return;
	}
	if (refuse_if_outstanding(c, id) || (!admin && !round_rate_allows(c, id)))
		return;
	if (req->budget_set) {
		r = budget_change(s, req->budget_set, &bytes, why);
		if (r < 0) {
			envelope_reply_error(c, id, r, "%s", why);
			return;
		}
		trigger = ROUND_BUDGET;
	} else if (req->tenant_set) {
		r = tenant_change(s, req->tenant_set, &patch, why);
		if (r < 0) {
			envelope_reply_error(c, id, r, "%s", why);
			return;
		}
		trigger = ROUND_CAP;
	} else {
		if (req->evict->tenant) {
			only = tenant_find(&s->tenants, req->evict->tenant);
			if (!only) {
				envelope_reply_error(c, id, -ENOENT, "no tenant %s", req->evict->tenant);
				return;
			}
		}
		trigger = ROUND_EVICT;
		bytes = req->evict->has_bytes ? req->evict->bytes : 0;
	}
	r = evict_plan(s->evictor, c, id, trigger, only, bytes, &patch, plan_answered);
	if (r == -EBUSY)
		conn_refused(c, LIMIT_EVICT_REQUESTS);
	if (r < 0)
		envelope_reply_error(c, id, r, r == -EBUSY ? "too many eviction requests waiting (%u)" :
		                     "out of memory", EVICT_WAITERS_MAX);
}

static void handle_disconnect(struct conn *c, uint64_t id, const Envelope *request,
                              int request_fd _unused_) {
	const Kvd__V1__Disconnect *req = request->disconnect;
	struct conn *o = req->has_connection ? registry_conn(c->srv, req->connection) : NULL;
	const char *departed = req->has_connection ? departed_tenant(c->srv, req->connection) : NULL;
	char why[160];

	snprintf(why, sizeof(why), "pid %d uid %u", (int)c->cred.pid, (unsigned)c->cred.uid);
	/* A connection that closed while its process lives on and maps its chunks: what
	 * ending it means is ending that charge (departed.h). */
	if ((!o || o->closing) && departed) {
		if (!listing_may_see(c, tenant_find(&c->srv->tenants, departed))) {
			c->srv->access_refused++;
			envelope_reply_error(c, id, -EPERM, "only root and members of admin-group (%s) "
			                     "may end other tenants' charges",
			                     c->srv->admin->cfg.admin_group);
			return;
		}
		(void)departed_end(c->srv, req->connection, why);
		envelope_reply(c, id, &(Envelope)KVD__V1__ENVELOPE__INIT, NULL, 0);
		return;
	}
	if (!o || o->closing) {
		envelope_reply_error(c, id, -ENOENT, "no connection %llu",
		                     (unsigned long long)(req->has_connection ? req->connection : 0));
		return;
	}
	if (o == c) {
		envelope_reply_error(c, id, -EINVAL, "a connection cannot disconnect itself");
		return;
	}
	if (!listing_may_see(c, o->tenant)) {
		c->srv->access_refused++;
		envelope_reply_error(c, id, -EPERM, "only root and members of admin-group (%s) may "
		                     "disconnect other tenants' connections",
		                     c->srv->admin->cfg.admin_group);
		return;
	}
	snprintf(why, sizeof(why), "disconnected by pid %d uid %u", (int)c->cred.pid,
	         (unsigned)c->cred.uid);
	log_notice("connection %llu (pid %d, uid %u, tenant %s) %s", (unsigned long long)o->id,
	           (int)o->cred.pid, (unsigned)o->cred.uid, o->tenant ? o->tenant->name : "-", why);
	/* Logged here, at notice like every administrative change, not again by conn_close. */
	conn_close(o, NULL);
	envelope_reply(c, id, &(Envelope)KVD__V1__ENVELOPE__INIT, NULL, 0);
}

/* A request's handler: the body of request is what it handles; fd is its fd (REQUEST_TAKES_FD), which the
 * handler does not own, or -EBADF. */
typedef void (*request_handler)(struct conn *c, uint64_t id, const Envelope *request, int fd);

struct request_type {
	request_handler handler;
	unsigned flags;
	enum metrics_request metric;
};

/* Every request the daemon serves, by the envelope's body (kvd.proto). */
static const struct request_type request_types[] = {
#define REQUEST(body, handler, flags, metric) \
	[KVD__V1__ENVELOPE__BODY_##body] = { handler, flags, METRICS_REQUEST_##metric }
	REQUEST(HELLO, handle_hello, 0, HELLO),
	REQUEST(REGISTER_MODEL, handle_register_model, REQUEST_NEEDS_TENANT, REGISTER_MODEL),
	REQUEST(MODEL_OUTPUT_PROJ, handle_model_output_proj,
	        REQUEST_NEEDS_TENANT | REQUEST_TAKES_FD, MODEL_OUTPUT_PROJ),
	REQUEST(SEQ_OPEN, handle_seq_open, REQUEST_NEEDS_TENANT, SEQ_OPEN),
	REQUEST(SEQ_GROW, handle_seq_grow, REQUEST_NEEDS_TENANT, SEQ_GROW),
	REQUEST(SEQ_RELEASE, handle_seq_release, REQUEST_NEEDS_TENANT, SEQ_RELEASE),
	REQUEST(CHUNKS_UNMAPPED, handle_chunks_unmapped, REQUEST_NEEDS_TENANT, CHUNKS_UNMAPPED),
	REQUEST(SEQ_DIGEST, handle_seq_digest, REQUEST_NEEDS_TENANT, SEQ_DIGEST),
	REQUEST(SEQ_PIN, handle_seq_pin, REQUEST_NEEDS_TENANT, SEQ_PIN),
	REQUEST(SEQ_UNPIN, handle_seq_unpin, REQUEST_NEEDS_TENANT, SEQ_UNPIN),
	REQUEST(SEQ_CLAIM, handle_seq_claim, REQUEST_NEEDS_TENANT, SEQ_CLAIM),
	REQUEST(REGISTER_EVENT, handle_register_event, REQUEST_NEEDS_TENANT, REGISTER_EVENT),
	REQUEST(BUDGET_SET, handle_budget_set, REQUEST_NEEDS_ADMIN, BUDGET_SET),
	REQUEST(BUDGET_RESET, handle_budget_reset, REQUEST_NEEDS_ADMIN, BUDGET_RESET),
	REQUEST(TENANT_SET, handle_tenant_set, REQUEST_NEEDS_ADMIN, TENANT_SET),
	REQUEST(TENANT_RESET, handle_tenant_reset, REQUEST_NEEDS_ADMIN, TENANT_RESET),
	REQUEST(TENANT_DELETE, handle_tenant_delete, REQUEST_NEEDS_ADMIN, TENANT_DELETE),
	REQUEST(STATUS_REQUEST, handle_status, 0, STATUS),
	REQUEST(EVICT, handle_evict, 0, EVICT),
	REQUEST(EVICTIONS_REQUEST, handle_evictions, 0, EVICTIONS),
	REQUEST(CONNECTIONS_REQUEST, listing_connections, 0, CONNECTIONS),
	REQUEST(SEQUENCES_REQUEST, listing_sequences, 0, SEQUENCES),
	REQUEST(DISCONNECT, handle_disconnect, 0, DISCONNECT),
	REQUEST(PLAN, handle_plan, 0, PLAN),
	REQUEST(SEQ_RECALL, handle_seq_recall, REQUEST_NEEDS_TENANT, SEQ_RECALL),
#undef REQUEST
};

/* The request type of a body, or NULL: a newer client's request, or a reply sent the wrong
 * way. */
static const struct request_type *request_type(Kvd__V1__Envelope__BodyCase body) {
	if ((size_t)body >= ELEMENTSOF(request_types) || !request_types[body].handler)
		return NULL;
	return &request_types[body];
}

bool dispatch_serves(int body, unsigned *ret_flags) {
	const struct request_type *rt = request_type((Kvd__V1__Envelope__BodyCase)body);

	if (rt && ret_flags)
		*ret_flags = rt->flags;
	return rt != NULL;
}

static void dispatch_request(struct conn *c, const Envelope *env, int *fds, uint32_t nfds) {
	const struct request_type *rt = request_type(env->body_case);
	uint64_t id = env->has_id ? env->id : 0;
	_cleanup_(closep) int fd = -EBADF;

	if (nfds > 0 && !(nfds == 1 && rt && (rt->flags & REQUEST_TAKES_FD))) {
		for (uint32_t i = 0; i < nfds; i++)
			safe_close(fds[i]);
		envelope_reply_error(c, id, -EBADMSG, "this request carries no fds");
		conn_violation(c, "unexpected fds");
		return;
	}
	if (nfds == 1)
		fd = fds[0];
	if (id == 0) {
		envelope_reply_error(c, 0, -EINVAL, "request without an id");
		conn_violation(c, "request without an id");
		return;
	}
	if (!c->hello && env->body_case != KVD__V1__ENVELOPE__BODY_HELLO) {
		envelope_reply_error(c, id, -EPROTO, "say hello first");
		conn_violation(c, "request before hello");
		return;
	}
	if (!rt) {
		/* Not a reason to disconnect: additions must never break old peers. */
		envelope_reply_error(c, id, -EOPNOTSUPP, "unknown request");
		return;
	}
	if ((rt->flags & REQUEST_NEEDS_TENANT) && !c->tenant) {
		envelope_reply_error(c, id, -EPERM, "this request needs a tenant; say which in hello");
		return;
	}
	if ((rt->flags & REQUEST_NEEDS_ADMIN) && !access_admin(&c->srv->admin->cfg, c->fd, &c->cred)) {
		c->srv->access_refused++;
		log_warning("connection %llu: pid %d uid %u refused an admin request: not root nor in "
		            "admin-group %s", (unsigned long long)c->id, (int)c->cred.pid,
		            (unsigned)c->cred.uid, c->srv->admin->cfg.admin_group);
		envelope_reply_error(c, id, -EPERM, "only root and members of admin-group (%s) may change the "
		            "budget and tenants", c->srv->admin->cfg.admin_group);
		return;
	}
	rt->handler(c, id, env, fd);
}

/* Times every request, refused ones included, for kvd_request_duration_seconds: two reads
 * of the vDSO clock and a short bucket scan, next to a reply's encode and send. */
static void dispatch(struct conn *c, const Envelope *env, int *fds, uint32_t nfds) {
	const struct request_type *rt = request_type(env->body_case);
	struct server *s = c->srv;
	uint64_t start = now_ns();

	dispatch_request(c, env, fds, nfds);
	/* c may be closing now, but it is freed only after its receive handler returns. */
	metrics_observe_request(&s->metrics, rt ? rt->metric : METRICS_REQUEST_OTHER,
	                        now_ns() - start);
}

static void dispatch_ring(struct conn *c, const struct kvd_ring_sqe *sqe) {
	struct server *s = c->srv;
	uint64_t start = now_ns(), wait = s->limits.grant_wait_ms;
	enum metrics_request type = METRICS_REQUEST_OTHER;
	_cleanup_(freep) uint32_t *ids = NULL;
	char why[WHY_MAX];
	uint32_t n = 0;
	int r;

	/* Reserved fields are 0 today, so that a later version can tell what a client means. */
	if (sqe->flags != 0 || sqe->reserved != 0 || sqe->reserved2 != 0 ||
	    (sqe->op != KVD_RING_OP_GROW && sqe->op != KVD_RING_OP_UNPIN && sqe->arg != 0)) {
		r = refuse(why, -EINVAL, "reserved fields of a ring submission must be 0");
		reply_step(c, true, sqe->user_data, r, why);
		goto done;
	}
	switch (sqe->op) {
	case KVD_RING_OP_GROW:
		type = METRICS_REQUEST_SEQ_GROW;
		dispatch_grow(c, sqe->user_data, true, sqe->seq_id, sqe->arg, wait ? now_ms() + wait : 0, 0);
		break;
	case KVD_RING_OP_PIN:
		type = METRICS_REQUEST_SEQ_PIN;
		dispatch_pin(c, sqe->user_data, true, sqe->seq_id, wait ? now_ms() + wait : 0, 0);
		break;
	case KVD_RING_OP_UNPIN:
		type = METRICS_REQUEST_SEQ_UNPIN;
		reply_step(c, true, sqe->user_data, step_unpin(c, sqe->seq_id, sqe->arg, why), why);
		break;
	case KVD_RING_OP_RELEASE:
		type = METRICS_REQUEST_SEQ_RELEASE;
		r = step_release(c, sqe->seq_id, &ids, &n, why);
		/* Ahead of the completion, like a grow's chunks (ring.h, "Socket"). */
		envelope_event_unmap(c, ids, n);
		reply_step(c, true, sqe->user_data, r, why);
		break;
	default:
		r = refuse(why, -EOPNOTSUPP, "unknown ring operation %u", sqe->op);
		reply_step(c, true, sqe->user_data, r, why);
	}
done:
	metrics_observe_request(&s->metrics, type, now_ns() - start);
}

static void dispatch_disconnect(struct conn *c) {
	struct server *s = c->srv;
	struct pool *p = s->pool;
	struct seq_emptied emptied = { .chunks = s->scratch + s->scratch_used };
	uint32_t held = 0;

	/* Chunks it did not say it unmapped stay charged to its tenant until its process exits
	 * (departed.h). Otherwise, first forget that this connection maps anything, so that no
	 * chunk waits for an answer from it and no unmap request is queued to it. */
	for (uint32_t i = 0; i < p->n_chunks; i++)
		held += p->chunks[i].n_holders > 0 && chunk_has_holder(&p->chunks[i], c->id);
	if (held > 0 && c->pidfd >= 0 && c->tenant && !s->stopping &&
	    departed_watch(s, c->id, c->pidfd, c->cred.pid, c->tenant->name, held) == 0)
		c->pidfd = -EBADF;
	else if (held > 0)
		pool_drop_holder_everywhere(p, c->id, false);
	if (c->n_seqs > 0)
		log_info("connection %llu (pid %d, uid %u, tenant %s) went away with %u open "
		         "sequences; their blocks are back", (unsigned long long)c->id,
		         (int)c->cred.pid, (unsigned)c->cred.uid, c->tenant->name, c->n_seqs);
	else if (c->tenant)
		log_info("connection %llu (pid %d, uid %u, tenant %s) disconnected",
		         (unsigned long long)c->id, (int)c->cred.pid, (unsigned)c->cred.uid,
		         c->tenant->name);
	while (c->seqs) {
		struct seq *q = c->seqs;

		conn_seq_remove(c, q);
		drop_seq(s, q, &emptied);
	}
	unmap_reclaim(s, &emptied, NULL, NULL);
	if (c->tenant) {
		c->tenant->connections--;
		c->tenant->models -= c->n_models;
	}
}

const struct conn_handlers dispatch_handlers = {
	.request = dispatch,
	.ring = dispatch_ring,
	.disconnect = dispatch_disconnect,
};
