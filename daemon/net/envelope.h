/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Every envelope the daemon sends, built in one place so that the wire stays at the edge:
 * replies (a status, with a body or not) and events (kvd.proto's EventType). A connection
 * that cannot take one (its send queue full of what a stuck reader left, or no memory) is
 * closed, saying what could not be queued; the callers then see c->closing.
 */

#include <stdint.h>

#include "basic/macro.h"
#include "wire.h"

struct conn;
struct chunk;
struct pool;

/* Grants for up to WIRE_FDS_MAX chunks of one frame: the messages and the fds they carry. */
struct envelope_grants {
	Kvd__V1__ChunkGrant grants[WIRE_FDS_MAX];
	Kvd__V1__ChunkGrant *ptrs[WIRE_FDS_MAX];
	int fds[WIRE_FDS_MAX];
	uint32_t n;
};

/* A reply to request id: env's body (NULL: a status alone), status 0, fds attached. */
void envelope_reply(struct conn *c, uint64_t id, Envelope *env, const int *fds, uint32_t nfds);

/* A reply with a status alone: code, and a message (NULL: none). Returns conn_send()'s
 * result, for callers that do more than close on failure. */
int envelope_reply_status(struct conn *c, uint64_t id, int code, const char *message);

/* A refusal: code and a formatted message, logged at debug level. */
_printf_(4, 5) void envelope_reply_error(struct conn *c, uint64_t id, int code, const char *fmt, ...);

/* kvd_evict()'s answer. */
void envelope_reply_evict(struct conn *c, uint64_t id, uint64_t round_id, uint64_t target_bytes,
                          uint64_t freed_bytes);

/* Fills g with the grants of n (at most WIRE_FDS_MAX) chunks of p on device. */
void envelope_grants(struct envelope_grants *g, const struct pool *p, uint32_t device,
                     struct chunk *const *chunks, uint32_t n);

/* EVENT_CHUNKS_GRANT with g's chunks and fds. */
void envelope_event_grants(struct conn *c, struct envelope_grants *g);

/* EVENT_CHUNKS_UNMAP: the chunks c must unmap, in frames of at most a few thousand ids. */
void envelope_event_unmap(struct conn *c, const uint32_t *ids, uint32_t n);

/* EVENT_SEQ_CHANGED: an eviction rewrote the descriptor of sequence seq_id. */
void envelope_event_seq_changed(struct conn *c, uint64_t seq_id, uint64_t generation);

/* EVENT_STOPPING. Returns conn_send()'s result (the caller closes c on failure). */
int envelope_event_stopping(struct conn *c);
