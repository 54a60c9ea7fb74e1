/* SPDX-License-Identifier: MIT */
/*
 * The request table, the one index of every request the daemon serves, and what runs each
 * request through it: the checks every request gets (an id, hello first, a tenant or the
 * admin's rights, fds only where expected), its handler, its timing; and the rings' steps.
 * Each handler validates everything the client sent before touching any state, and answers
 * every request with exactly one reply.
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
#include "config.h"
#include "conn.h"
#include "dispatch.h"
#include "envelope.h"
#include "listing.h"
#include "log.h"
#include "basic/macro.h"
#include "metrics.h"
#include "requests.h"
#include "ring.h"
#include "server.h"
#include "basic/time-util.h"

/*
 * The per-step operations (grow, pin, unpin, release) come on the socket or through the
 * ring (ring.h), and the same code serves both: a step returns 0 or a negative errno with the
 * refusal's text in `why`, and the caller packages the answer as the request came.
 */
#define WHY_MAX KVD_RING_MSG_BYTES

_printf_(3, 4) int refuse(char why[static WHY_MAX], int code, const char *fmt, ...) {
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(why, WHY_MAX, fmt, ap);
	va_end(ap);
	return code;
}

/* Answers a step with nothing but its result: a status on the socket (id), a completion on
 * the ring (id is the submission's user_data). */
void reply_step(struct conn *c, bool ring, uint64_t id, int r, const char *why) {
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
bool refuse_if_outstanding(struct conn *c, uint64_t id) {
	if (c->outstanding < c->srv->limits.max_outstanding)
		return false;
	conn_refused(c, LIMIT_OUTSTANDING);
	envelope_reply_error(c, id, -EBUSY, "%u replies outstanding on this connection "
	                     "(max-outstanding)", c->outstanding);
	return true;
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
	REQUEST(SEQ_OPEN, handle_seq_open, REQUEST_NEEDS_TENANT | REQUEST_TAKES_FD, SEQ_OPEN),
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
	REQUEST(SEQ_TRUNCATE, handle_seq_truncate, REQUEST_NEEDS_TENANT, SEQ_TRUNCATE),
	REQUEST(SEQ_PUBLISH, handle_seq_publish, REQUEST_NEEDS_TENANT, SEQ_PUBLISH),
	REQUEST(PREFIX_LOOKUP, handle_prefix_lookup, REQUEST_NEEDS_TENANT | REQUEST_TAKES_FD,
	        PREFIX_LOOKUP),
	REQUEST(RELOAD, handle_reload, REQUEST_NEEDS_ADMIN, RELOAD),
	REQUEST(CONFIG_REQUEST, handle_config, 0, CONFIG),
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
	/* An engine (a tenant's connection) changes no node setting, whatever its uid, where
	 * the operator says so. */
	if ((rt->flags & REQUEST_NEEDS_ADMIN) && c->tenant &&
	    c->srv->admin->cfg.admin_on_tenant_connections == SETTINGS_NO) {
		c->srv->access_refused++;
		log_warning("connection %llu: pid %d uid %u (tenant %s) refused an admin request: "
		            "admin-on-tenant-connections = no", (unsigned long long)c->id,
		            (int)c->cred.pid, (unsigned)c->cred.uid, c->tenant->name);
		envelope_reply_error(c, id, -EPERM, "the budget and tenants change only from "
		                     "administrative connections (kvdctl's), not a tenant's "
		                     "(admin-on-tenant-connections = no)");
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
		step_grow(c, sqe->user_data, true, sqe->seq_id, sqe->arg, wait ? now_ms() + wait : 0, 0);
		break;
	case KVD_RING_OP_PIN:
		type = METRICS_REQUEST_SEQ_PIN;
		step_pin(c, sqe->user_data, true, sqe->seq_id, wait ? now_ms() + wait : 0, 0);
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

const struct conn_handlers dispatch_handlers = {
	.request = dispatch,
	.ring = dispatch_ring,
	.disconnect = session_drop,
};
