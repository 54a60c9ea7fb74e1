/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The registry: the open connections and sequences by id (idmap.h), the tenants' forgetting,
 * the node's bounds on what clients hold, and the refusals at each limit. Its state lives in
 * struct server (server.h); what is registered is the requests' and the connections' doing.
 */

#include <stdint.h>

struct conn;
struct seq;
struct server;
struct tenant;

/* The limits whose refusals are counted (status "refused", metrics kvd_refused_total). */
enum server_limit {
	LIMIT_CONNECTIONS,            /* max-connections */
	LIMIT_CONNECTIONS_PER_UID,    /* max-connections-per-uid */
	LIMIT_TENANTS,                /* max-tenants */
	LIMIT_TENANTS_PER_UID,        /* max-tenants-per-uid */
	LIMIT_MODELS,                 /* max-models, per connection */
	LIMIT_MODELS_PER_TENANT,      /* max-models-per-tenant */
	LIMIT_SEQS,                   /* max-seqs, per connection */
	LIMIT_SEQS_PER_TENANT,        /* max-seqs-per-tenant */
	LIMIT_SEQS_NODE,              /* max-seqs-node */
	LIMIT_METADATA,               /* max-metadata-bytes */
	LIMIT_SEQ_TOKENS,             /* max-seq-tokens */
	LIMIT_DESCRIPTOR,             /* a descriptor over 64 MiB */
	LIMIT_FRAME,                  /* a frame over 64 KiB */
	LIMIT_SEND_QUEUE,             /* a client that does not read its replies */
	LIMIT_OUTSTANDING,            /* max-outstanding, per connection */
	LIMIT_OBSERVATION,            /* max-observation-bytes */
	LIMIT_UPLOADS,                /* output projections computing at once */
	LIMIT_EVICT_REQUESTS,         /* Evict requests waiting */
	LIMIT_EVICT_RATE,             /* a tenant's own Evict, Plan, SeqRecall, per connection */
	LIMIT_GRANT_WAITERS,          /* grows waiting for a round, node-wide */
	LIMIT_RING_COMPLETIONS,       /* a client that leaves its completion ring full (ring.h) */
	LIMIT_UNMAP_TIMEOUT,          /* grants to a connection past unmap-timeout */
	LIMIT_PINNED,                 /* max-pinned-percent, per tenant (pins.h) */
	LIMIT_RING_DOORBELL,          /* a client whose doorbells find nothing (ring.h) */
	_LIMIT_MAX,
};

/* The names status and metrics use ("connections", "models_per_tenant", ...). */
const char *limit_to_string(enum server_limit l);

struct conn;

/* Connections past max-connections (and max-connections-per-uid) that root and
 * admin-group still get, so that kvdctl works on a node clients filled. */
#define ADMIN_CONNECTIONS_RESERVED 4u

struct conn *registry_conn(struct server *s, uint64_t id);
/* Sequence seq_id of connection conn_id, unless either is gone or the connection closes:
 * how code that sent events, which may close connections, finds what it named before. */
struct seq *registry_seq(struct server *s, uint64_t conn_id, uint64_t seq_id);

/* Counts q as open (its tenant's and the node's sequences and metadata), or no longer. */
void registry_seq_opened(struct server *s, struct seq *q);
void registry_seq_closed(struct server *s, struct seq *q);

/* The node's bounds in force: the settings, or what was derived at start for 0; the
 * connections' is also at most what the fd limit leaves room for. */
uint32_t registry_conns_max(const struct server *s);
uint32_t registry_seqs_max(const struct server *s);
uint64_t registry_metadata_max(const struct server *s);

/* Forgets t (tenant_holds_nothing): destroys its free chunks' memory and takes it out of
 * the table; logs why. */
void registry_forget_tenant(struct server *s, struct tenant *t, const char *why);
