/* SPDX-License-Identifier: MIT */
/*
 * Requests of a connection's session: hello (tenant, device, features), models and their
 * output projections, engines' event channels, an operator's disconnect of another
 * connection; and the session's teardown when a connection closes.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "access.h"
#include "admin.h"
#include "backend.h"
#include "config.h"
#include "conn.h"
#include "departed.h"
#include "envelope.h"
#include "evict.h"
#include "keep.h"
#include "listing.h"
#include "log.h"
#include "basic/macro.h"
#include "model.h"
#include "mover.h"
#include "observe.h"
#include "pins.h"
#include "pool.h"
#include "recall.h"
#include "registry.h"
#include "requests.h"
#include "ring.h"
#include "seq.h"
#include "server.h"
#include "tenant.h"
#include "tier.h"
#include "unmap.h"
#include "upload.h"

/* Frees a sequence with what eviction attached to it. */
void drop_seq(struct server *s, struct seq *q, struct seq_emptied *emptied) {
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
		                                 KVD_FEATURE_TIERS | KVD_FEATURE_RECALL |
		                                 KVD_FEATURE_FORK | KVD_FEATURE_PREFIX |
		                                 KVD_FEATURE_GROUPS);
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

void handle_hello(struct conn *c, uint64_t id, const Envelope *request,
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

void handle_register_model(struct conn *c, uint64_t id, const Envelope *request,
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

/* Installs and answers a finished upload, if its connection and model are still there. */
static void upload_answered(void *userdata, struct upload_done *d) {
	struct conn *c = registry_conn(userdata, d->conn_id);
	int r = d->error;

	if (!c || c->closing)
		return;
	c->outstanding--;
	if (d->model_id > c->n_models)
		return;
	if (r >= 0) {
		r = grams_install(&c->models[d->model_id - 1], d->layer, d->result);
		if (r >= 0)
			d->result = NULL;
	}
	if (r < 0) {
		log_warning("connection %llu: the Gram matrices of layer %u could not be computed: %s",
		            (unsigned long long)c->id, d->layer, strerror(-r));
		envelope_reply_error(c, d->id, r, "cannot compute the Gram matrices");
	} else {
		envelope_reply(c, d->id, NULL, NULL, 0);
	}
}

void handle_model_output_proj(struct conn *c, uint64_t id, const Envelope *request, int fd) {
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
	r = upload_start(c->srv->uploader, c->id, id, req->model_id, req->layer, &wo,
	                 upload_answered);
	if (r == -EBUSY)
		conn_refused(c, LIMIT_UPLOADS);
	if (r >= 0)
		c->outstanding++;
	else if (r == -EBUSY)
		envelope_reply_error(c, id, r, "too many uploads computing (%u); retry", UPLOADS_MAX);
	else if (r < 0)
		envelope_reply_error(c, id, r, "cannot start computing: %s", strerror(-r));
}

void handle_register_event(struct conn *c, uint64_t id, const Envelope *request,
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

void handle_disconnect(struct conn *c, uint64_t id, const Envelope *request,
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

void session_drop(struct conn *c) {
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
