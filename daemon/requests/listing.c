/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "access.h"
#include "evict.h"
#include "model.h"
#include "admin.h"
#include "backend.h"
#include "basic/macro.h"
#include "conn.h"
#include "departed.h"
#include "envelope.h"
#include "listing.h"
#include "tier.h"
#include "seq.h"
#include "server.h"

bool listing_may_see(const struct conn *c, const struct tenant *t) {
	if (access_admin(&c->srv->admin->cfg, c->fd, &c->cred))
		return true;
	return c->tenant && c->tenant == t;
}

/* A tenant's connection or an administrator: the others see nothing. */
static bool may_list(struct conn *c, uint64_t id) {
	if (c->tenant || access_admin(&c->srv->admin->cfg, c->fd, &c->cred))
		return true;
	c->srv->access_refused++;
	envelope_reply_error(c, id, -EPERM, "only root, members of admin-group (%s) and a tenant's "
	                     "own connections may list connections and sequences",
	                     c->srv->admin->cfg.admin_group);
	return false;
}

/* A row of the connections listing: a connection, or a departed holder (departed.h). */
struct conn_row {
	uint64_t id;
	const struct conn *o;         /* NULL: departed */
	struct departed_info d;
};

static int cmp_conn_row(const void *a, const void *b) {
	uint64_t x = ((const struct conn_row *)a)->id, y = ((const struct conn_row *)b)->id;

	return x < y ? -1 : x > y;
}

void listing_connections(struct conn *c, uint64_t id, const Envelope *request, int fd _unused_) {
	const Kvd__V1__ConnectionsRequest *req = request->connections_request;
	struct server *s = c->srv;
	uint64_t after = req->has_after ? req->after : 0, now = now_ms();
	_cleanup_(freep) struct conn_row *list = NULL;
	_cleanup_(freep) struct departed_info *gone = NULL;
	_cleanup_(freep) Kvd__V1__ConnectionInfo *rows = NULL;
	_cleanup_(freep) Kvd__V1__ConnectionInfo **ptrs = NULL;
	Kvd__V1__ConnectionsReply rep = KVD__V1__CONNECTIONS_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	uint32_t n = 0, n_gone, page;

	if (!may_list(c, id))
		return;
	list = calloc(s->n_conns + s->n_departed + 1, sizeof(*list));
	gone = calloc(s->n_departed + 1, sizeof(*gone));
	rows = calloc(LISTING_PAGE, sizeof(*rows));
	ptrs = calloc(LISTING_PAGE, sizeof(*ptrs));
	if (!list || !gone || !rows || !ptrs) {
		envelope_reply_error(c, id, -ENOMEM, "out of memory");
		return;
	}
	for (struct conn *o = s->conns; o && n < s->n_conns; o = o->next)
		if (!o->closing && o->id > after && o->hello &&
		    listing_may_see(c, o->tenant))
			list[n++] = (struct conn_row){ .id = o->id, .o = o };
	n_gone = departed_list(s, after, gone, s->n_departed);
	for (uint32_t i = 0; i < n_gone; i++)
		if (listing_may_see(c, tenant_find(&s->tenants, gone[i].tenant)))
			list[n++] = (struct conn_row){ .id = gone[i].conn_id, .d = gone[i] };
	qsort(list, n, sizeof(*list), cmp_conn_row);
	page = MIN(n, (uint32_t)LISTING_PAGE);
	for (uint32_t i = 0; i < page; i++) {
		const struct conn *o = list[i].o;
		Kvd__V1__ConnectionInfo *r = &rows[i];
		const struct backend_device *dev;
		uint32_t pinned = 0;
		uint64_t bytes = 0;

		kvd__v1__connection_info__init(r);
		ptrs[i] = r;
		r->has_id = r->has_pid = r->has_age_ms = r->has_departed = true;
		r->id = list[i].id;
		if (!o) {
			r->departed = 1;
			r->pid = (uint32_t)list[i].d.pid;
			r->tenant = (char *)list[i].d.tenant;
			r->age_ms = now - list[i].d.since_ms;
			r->has_chunks = true;
			r->chunks = list[i].d.chunks;
			continue;
		}
		dev = backend_device(o->device);
		for (const struct seq *q = o->seqs; q; q = q->next) {
			pinned += q->pins > 0;
			bytes += seq_resident_bytes(q);
		}
		r->has_uid = r->has_sequences = true;
		r->has_pinned = r->has_bytes = r->has_outstanding = r->has_ring = true;
		r->pid = (uint32_t)o->cred.pid;
		r->uid = (uint32_t)o->cred.uid;
		r->tenant = o->tenant ? (char *)o->tenant->name : NULL;
		r->process = (char *)o->process_name;
		r->age_ms = now - o->accepted_ms;
		r->sequences = o->n_seqs;
		r->pinned = pinned;
		r->bytes = bytes;
		r->outstanding = o->outstanding;
		r->ring = o->ring != NULL;
		if (o->tenant && dev) {
			r->has_device = true;
			r->device = (uint32_t)dev->index;
		}
	}
	rep.n_connections = page;
	rep.connections = ptrs;
	rep.has_more = true;
	rep.more = n > page;
	env.body_case = KVD__V1__ENVELOPE__BODY_CONNECTIONS_REPLY;
	env.connections_reply = &rep;
	envelope_reply(c, id, &env, NULL, 0);
}

struct seq_ref {
	uint64_t conn_id, seq_id;
	const struct seq *q;
};

static int cmp_seq_ref(const void *a, const void *b) {
	const struct seq_ref *x = a, *y = b;

	if (x->conn_id != y->conn_id)
		return x->conn_id < y->conn_id ? -1 : 1;
	return x->seq_id < y->seq_id ? -1 : x->seq_id > y->seq_id;
}

void listing_sequences(struct conn *c, uint64_t id, const Envelope *request, int fd _unused_) {
	const Kvd__V1__SequencesRequest *req = request->sequences_request;
	struct server *s = c->srv;
	uint64_t after_conn = req->has_after_connection ? req->after_connection : 0;
	uint64_t after_seq = req->has_after_sequence ? req->after_sequence : 0;
	_cleanup_(freep) struct seq_ref *list = NULL;
	_cleanup_(freep) Kvd__V1__SequenceInfo *rows = NULL;
	_cleanup_(freep) Kvd__V1__SequenceInfo **ptrs = NULL;
	Kvd__V1__SequencesReply rep = KVD__V1__SEQUENCES_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	const struct tenant *only = NULL;
	uint32_t n = 0, page;

	if (!may_list(c, id))
		return;
	if (req->tenant) {
		only = tenant_find(&s->tenants, req->tenant);
		if (!only) {
			envelope_reply_error(c, id, -ENOENT, "no tenant %s", req->tenant);
			return;
		}
		if (!listing_may_see(c, only)) {
			c->srv->access_refused++;
			envelope_reply_error(c, id, -EPERM, "a tenant's connection sees only its own "
			                     "tenant's sequences");
			return;
		}
	}
	list = calloc(MAX(s->sequences, 1u), sizeof(*list));
	rows = calloc(LISTING_PAGE, sizeof(*rows));
	ptrs = calloc(LISTING_PAGE, sizeof(*ptrs));
	if (!list || !rows || !ptrs) {
		envelope_reply_error(c, id, -ENOMEM, "out of memory");
		return;
	}
	for (const struct conn *o = s->conns; o; o = o->next) {
		if (o->closing || !o->tenant || (only && o->tenant != only) ||
		    !listing_may_see(c, o->tenant) || o->id < after_conn)
			continue;
		for (const struct seq *q = o->seqs; q && n < s->sequences; q = q->next)
			if (o->id > after_conn || q->id > after_seq)
				list[n++] = (struct seq_ref){ o->id, q->id, q };
	}
	qsort(list, n, sizeof(*list), cmp_seq_ref);
	page = MIN(n, (uint32_t)LISTING_PAGE);
	for (uint32_t i = 0; i < page; i++) {
		const struct seq *q = list[i].q;
		Kvd__V1__SequenceInfo *r = &rows[i];

		kvd__v1__sequence_info__init(r);
		r->has_id = r->has_connection = r->has_tokens = r->has_max_tokens = r->has_pins = true;
		r->has_bytes = r->has_evictable = r->has_evicted_tokens = r->has_evicted_bytes = true;
		r->has_waiting_bytes = r->has_layers = r->has_kv_heads = r->has_head_dim = true;
		r->id = q->id;
		r->connection = list[i].conn_id;
		r->tenant = (char *)q->tenant->name;
		r->tokens = tier_seq_tokens(q);
		r->max_tokens = q->desc->max_tokens;
		r->pins = q->pins;
		r->bytes = seq_resident_bytes(q);
		r->evictable = q->model->unit != KVD_UNIT_NONE;
		r->evicted_tokens = q->evicted_tokens;
		r->evicted_bytes = q->evicted_bytes;
		r->waiting_bytes = q->pending ? q->pending->bytes : 0;
		r->layers = q->model->layers;
		r->kv_heads = q->model->kv_heads;
		r->head_dim = q->model->head_dim;
		r->place = (char *)tier_place(q);
		r->has_shared_bytes = true;
		r->shared_bytes = seq_shared_bytes(q, s->pool);
		ptrs[i] = r;
	}
	rep.n_sequences = page;
	rep.sequences = ptrs;
	rep.has_more = true;
	rep.more = n > page;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQUENCES_REPLY;
	env.sequences_reply = &rep;
	envelope_reply(c, id, &env, NULL, 0);
}
