/* SPDX-License-Identifier: MIT */
/*
 * Requests that run an eviction round (Evict, Plan, SeqRecall), rate-limited per
 * connection, and their answers when the round completes (evict.h, evict_done_fn).
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
#include "envelope.h"
#include "evict.h"
#include "basic/macro.h"
#include "mover.h"
#include "recall.h"
#include "registry.h"
#include "requests.h"
#include "server.h"
#include "tenant.h"
#include "basic/time-util.h"

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
void round_message(const struct evict_record *rec, Kvd__V1__Round *r,
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
void handle_seq_recall(struct conn *c, uint64_t id, const Envelope *request,
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

void handle_evict(struct conn *c, uint64_t id, const Envelope *request,
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

/* Answers a dry run of a budget, tenant or evict change with the round it would start
 * (evict_plan); the rights are the change's own. */
void handle_plan(struct conn *c, uint64_t id, const Envelope *request,
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
