/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * What the request handlers share inside this component. The request table (dispatch.c)
 * names every handler; each family's file defines its own: connections.c, sequences.c,
 * operator.c, rounds.c, status.c, and listing.h's.
 */

#include <stdbool.h>
#include <stdint.h>

#include "basic/macro.h"
#include "conn.h"
#include "wire.h"

struct evict_patch;
struct evict_record;
struct seq;
struct seq_emptied;
struct server;

/* A request's handler: the body of request is what it handles; fd is its fd
 * (REQUEST_TAKES_FD), which the handler does not own, or -EBADF. */
typedef void (*request_handler)(struct conn *c, uint64_t id, const Envelope *request, int fd);

/* dispatch.c */
/* The room for a refusal's text: a ring completion's message (ring.h). */
#define WHY_MAX KVD_RING_MSG_BYTES
_printf_(3, 4) int refuse(char why[static WHY_MAX], int code, const char *fmt, ...);
void reply_step(struct conn *c, bool ring, uint64_t id, int r, const char *why);
bool refuse_if_outstanding(struct conn *c, uint64_t id);

/* connections.c */
void drop_seq(struct server *s, struct seq *q, struct seq_emptied *emptied);
void session_drop(struct conn *c);
void handle_hello(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_register_model(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_model_output_proj(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_register_event(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_disconnect(struct conn *c, uint64_t id, const Envelope *request, int fd);

/* sequences.c */
/*
 * Grows sequence seq_id of c by tokens and answers request id, on the socket or, with ring,
 * as the completion of the ring submission whose user_data is id; when the budget cannot
 * meet it and wait_until_ms (CLOCK_MONOTONIC ms) is in the future, parks it for an eviction
 * round instead (evict.h), which hands it back to it again (grow_retry).
 */
void step_grow(struct conn *c, uint64_t id, bool ring, uint64_t seq_id, uint32_t tokens,
               uint64_t wait_until_ms, uint64_t since_us);
int step_release(struct conn *c, uint64_t seq_id, uint32_t **ret_ids, uint32_t *ret_n,
                 char why[static WHY_MAX]);
void step_pin(struct conn *c, uint64_t id, bool ring, uint64_t seq_id,
              uint64_t wait_until_ms, uint64_t since_us);
int step_unpin(struct conn *c, uint64_t seq_id, uint32_t event_id, char why[static WHY_MAX]);
void handle_seq_open(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_seq_claim(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_seq_grow(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_seq_release(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_chunks_unmapped(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_seq_digest(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_seq_pin(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_seq_unpin(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_seq_truncate(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_seq_publish(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_prefix_lookup(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_reload(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_config(struct conn *c, uint64_t id, const Envelope *request, int fd);

/* operator.c */
int budget_change(const struct server *s, const Kvd__V1__BudgetSet *req, uint64_t *ret,
                  char why[static WHY_MAX]);
int tenant_change(const struct server *s, const Kvd__V1__TenantSet *req,
                  struct evict_patch *ret, char why[static WHY_MAX]);
void handle_budget_set(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_budget_reset(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_tenant_set(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_tenant_reset(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_tenant_delete(struct conn *c, uint64_t id, const Envelope *request, int fd);

/* rounds.c */
void round_message(const struct evict_record *rec, Kvd__V1__Round *r,
                   Kvd__V1__RoundTenant *ts, Kvd__V1__RoundTenant **tp);
void handle_seq_recall(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_evict(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_plan(struct conn *c, uint64_t id, const Envelope *request, int fd);

/* status.c */
void handle_evictions(struct conn *c, uint64_t id, const Envelope *request, int fd);
void handle_status(struct conn *c, uint64_t id, const Envelope *request, int fd);
