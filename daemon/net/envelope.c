/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>

#include "backend.h"
#include "conn.h"
#include "envelope.h"
#include "log.h"
#include "pool.h"

static void send_or_close(struct conn *c, const Envelope *env, const int *fds, uint32_t nfds,
                          const char *what) {
	if (conn_send(c, env, fds, nfds) < 0 && !c->closing)
		conn_close(c, what);
}

void envelope_reply(struct conn *c, uint64_t id, Envelope *env, const int *fds, uint32_t nfds) {
	Kvd__V1__Status st = KVD__V1__STATUS__INIT;
	Envelope none = KVD__V1__ENVELOPE__INIT;

	if (!env)
		env = &none;
	st.has_code = true;
	st.code = 0;
	env->has_id = true;
	env->id = id;
	env->status = &st;
	send_or_close(c, env, fds, nfds, "cannot queue a reply");
}

int envelope_reply_status(struct conn *c, uint64_t id, int code, const char *message) {
	Kvd__V1__Status st = KVD__V1__STATUS__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;

	st.has_code = true;
	st.code = code;
	st.message = (char *)(message ? message : "");
	env.has_id = true;
	env.id = id;
	env.status = &st;
	return conn_send(c, &env, NULL, 0);
}

void envelope_reply_error(struct conn *c, uint64_t id, int code, const char *fmt, ...) {
	char msg[256];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	log_debug("connection %llu: request %llu refused: %s", (unsigned long long)c->id,
	          (unsigned long long)id, msg);
	if (envelope_reply_status(c, id, code, msg) < 0 && !c->closing)
		conn_close(c, "cannot queue a reply");
}

void envelope_reply_evict(struct conn *c, uint64_t id, uint64_t round_id, uint64_t target_bytes,
                          uint64_t freed_bytes) {
	Kvd__V1__EvictReply rep = KVD__V1__EVICT_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;

	rep.has_round_id = rep.has_target_bytes = rep.has_freed_bytes = true;
	rep.round_id = round_id;
	rep.target_bytes = target_bytes;
	rep.freed_bytes = freed_bytes;
	env.body_case = KVD__V1__ENVELOPE__BODY_EVICT_REPLY;
	env.evict_reply = &rep;
	envelope_reply(c, id, &env, NULL, 0);
}

void envelope_grants(struct envelope_grants *g, const struct pool *p, uint32_t device,
                     struct chunk *const *chunks, uint32_t n) {
	const struct backend_device *dev = backend_device(device);

	g->n = n;
	for (uint32_t i = 0; i < n; i++) {
		Kvd__V1__ChunkGrant *cg = &g->grants[i];

		kvd__v1__chunk_grant__init(cg);
		cg->has_chunk_id = cg->has_bytes = cg->has_memory = true;
		cg->chunk_id = chunks[i]->id;
		cg->bytes = p->chunk_bytes;
		cg->memory = (Kvd__V1__MemoryKind)p->ops->memory;
		/* The client matches the GPU by UUID: ordinals differ between processes. */
		if (dev) {
			cg->has_device_uuid = true;
			cg->device_uuid.len = sizeof(dev->uuid);
			cg->device_uuid.data = (uint8_t *)dev->uuid;
		}
		g->ptrs[i] = cg;
		g->fds[i] = chunks[i]->mem.fd;
	}
}

/* Queues ev with fds; returns conn_send()'s result. */
static int event_send(struct conn *c, Kvd__V1__Event *ev, const int *fds, uint32_t nfds) {
	Envelope env = KVD__V1__ENVELOPE__INIT;

	ev->has_type = true;
	env.body_case = KVD__V1__ENVELOPE__BODY_EVENT;
	env.event = ev;
	return conn_send(c, &env, fds, nfds);
}

static void event(struct conn *c, Kvd__V1__Event *ev, const int *fds, uint32_t nfds,
                  const char *what) {
	if (event_send(c, ev, fds, nfds) < 0 && !c->closing)
		conn_close(c, what);
}

void envelope_event_grants(struct conn *c, struct envelope_grants *g) {
	Kvd__V1__Event ev = KVD__V1__EVENT__INIT;

	ev.type = KVD__V1__EVENT_TYPE__EVENT_CHUNKS_GRANT;
	ev.n_grants = g->n;
	ev.grants = g->ptrs;
	event(c, &ev, g->fds, g->n, "cannot queue a grant");
}

void envelope_event_unmap(struct conn *c, const uint32_t *ids, uint32_t n) {
	for (uint32_t i = 0; i < n && !c->closing; i += WIRE_IDS_MAX) {
		Kvd__V1__Event ev = KVD__V1__EVENT__INIT;

		ev.type = KVD__V1__EVENT_TYPE__EVENT_CHUNKS_UNMAP;
		ev.n_chunk_ids = MIN(n - i, WIRE_IDS_MAX);
		ev.chunk_ids = (uint32_t *)ids + i;
		event(c, &ev, NULL, 0, "cannot queue an unmap request");
	}
}

void envelope_event_seq_changed(struct conn *c, uint64_t seq_id, uint64_t generation) {
	Kvd__V1__Event ev = KVD__V1__EVENT__INIT;

	ev.type = KVD__V1__EVENT_TYPE__EVENT_SEQ_CHANGED;
	ev.has_seq_id = ev.has_generation = true;
	ev.seq_id = seq_id;
	ev.generation = generation;
	event(c, &ev, NULL, 0, "cannot queue an event");
}

int envelope_event_stopping(struct conn *c) {
	Kvd__V1__Event ev = KVD__V1__EVENT__INIT;

	ev.type = KVD__V1__EVENT_TYPE__EVENT_STOPPING;
	return event_send(c, &ev, NULL, 0);
}
