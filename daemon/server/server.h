/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The server: the listening socket, the connections, the pool and the tenants, driven by
 * one loop. It owns every piece of daemon state; handlers reach it through their conn.
 */

#include <stdbool.h>
#include <stdint.h>
#include <sys/signalfd.h>

#include "idmap.h"
#include "registry.h"
#include "conn.h"
#include "http.h"
#include "loop.h"
#include "metrics.h"
#include "pool.h"
#include "seq.h"
#include "tenant.h"
#include "warnings.h"
#include "basic/time-util.h"

struct admin;
struct conn;
struct evictor;
struct tier;
struct mover;
struct keep;
struct uploader;

/* Limits on what clients control; most are settings (settings.c), see admin_limits(). */
struct server_limits {
	int recall_policy;            /* enum kvd_policy recalls score with; -1: auto (recall.h) */
	uint32_t max_connections;
	uint32_t max_connections_per_uid;
	uint32_t max_tenants;
	uint32_t max_tenants_per_uid;
	uint32_t max_models;          /* per connection */
	uint32_t max_models_per_tenant;
	uint32_t max_outstanding;     /* replies a connection may be waiting for */
	uint32_t max_seqs;            /* per connection */
	uint32_t max_seqs_per_tenant;
	uint32_t max_seqs_node;       /* 0: derived at start (server.seqs_node_derived) */
	uint64_t max_metadata_bytes;  /* 0: derived at start (server.metadata_derived) */
	uint32_t max_seq_tokens;
	uint64_t max_descriptor_bytes;
	uint64_t hello_timeout_ms;
	uint64_t unmap_timeout_ms;    /* 0: holders of a draining chunk may take forever */
	uint64_t unmap_grace_ms;      /* past unmap_timeout_ms, before the disconnect */
	uint32_t max_pinned_percent;  /* of the budget, per tenant (pins.h) */
	uint32_t max_cached_percent;  /* of the budget, per tenant (prefix.h) */
	uint32_t tier_max_percent;    /* of each tier, per tenant (tier.h) */
	uint64_t pin_report_ms;       /* 0: never */
	uint64_t pin_timeout_ms;      /* 0: never */
	uint64_t tenant_forget_ms;    /* a tenant that holds nothing is forgotten after; 0: never */
	uint64_t max_tx_bytes;        /* queued replies and events per connection */
	uint32_t max_violations;      /* protocol errors before a disconnect */
	const char *metrics_listen;   /* --metrics-listen: NULL or "" for no metrics endpoint */
	/* --kv-events, --kv-events-replay, --kv-events-topic: "" or NULL for no events */
	const char *kv_events, *kv_events_replay, *kv_events_topic;
	bool metrics_remote;          /* --metrics-remote: it may be reachable from elsewhere */
	const char *socket_group;     /* --socket-group: NULL or "" for the daemon's group */
	/* Eviction (evict.h). */
	uint32_t high_watermark, low_watermark; /* percent of the budget */
	uint32_t eviction_floor;      /* percent of a (sequence, layer) never taken */
	uint32_t round_threads;       /* 0: the online CPUs */
	uint64_t grant_wait_ms;
	uint64_t round_interval_ms;   /* 0: off */
	uint64_t max_observation_bytes;
	/* The host tier (tier.h, offload.h). */
	uint64_t host_tier_bytes;     /* 0: none */
	uint64_t file_tier_bytes;     /* 0: none */
	const char *file_tier_dir;
	uint64_t tier_idle_ms;        /* 0: offloads under pressure only */
	/* The per-step rings (ring.h). */
	uint32_t ring_entries;        /* of each ring; 0: no rings, clients use the socket */
	int ring_doorbell;            /* enum ring_doorbell */
	int uring_setup;              /* enum loop_setup */
	uint32_t poll_us;             /* the loop spins this long before it sleeps */
};

struct server {
	struct loop *loop;
	struct pool *pool;
	struct tenant_table tenants;
	struct server_limits limits;
	const char *socket_path;      /* the inherited socket's path when socket-activated */
	char inherited_path[108];     /* sizeof(sun_path) */
	bool socket_owned;            /* we bound it, so the file is ours to unlink */

	int listen_fd;
	struct loop_op accept_op;
	/* Out of fds (EMFILE, ENFILE): accepting waits for a connection to close or the tick,
	 * and new clients wait in the listen backlog, rather than the loop spinning on the
	 * error. accept_pauses counts the pauses; one is logged until an accept works again. */
	bool accept_paused, accept_pause_logged;
	uint64_t accept_pauses;
	uint64_t turns_yielded;       /* connections that used up CONN_FRAMES_PER_TURN */
	int signal_fd;
	struct loop_op signal_op;
	struct signalfd_siginfo siginfo;
	struct loop_op tick_op;
	uint64_t tick_ms;
	uint64_t watchdog_usec;       /* the service manager's watchdog interval, 0: none */
	char notify_status[256];      /* the STATUS= last sent to the service manager */

	struct conn_handlers handlers; /* the requests' (dispatch.h), and listen_resume() */
	struct conn *conns;
	uint32_t n_conns;
	/* By id: the open connections, and their sequences (idmap.h): what registry_conn()
	 * and registry_seq() look up. */
	struct idmap conn_ids, seq_ids;
	/* The content keys sequences published, per tenant and model (prefix.h). */
	struct prefix_index prefix;
	struct kv_events *events;     /* KV events' publisher (kv-events.h); NULL: off */
	/* Closed, but an operation still refers to them: freed when it completes, or by
	 * server_free() when the loop stopped first. */
	struct conn *closed;
	uint64_t next_conn_id;
	uint64_t next_seq_id;
	uint32_t evictable_seqs;      /* open sequences of models with an eviction unit */
	/* Open sequences (kept ones waiting to be claimed included) and their metadata's
	 * bound (seq.meta_bytes), node-wide; and the bounds derived at start for
	 * max-seqs-node and max-metadata-bytes 0 (registry_seqs_max()). */
	uint32_t sequences;
	uint64_t metadata_bytes;
	uint32_t seqs_node_derived;
	uint64_t metadata_derived;
	uint32_t conns_by_fds;        /* connections the fd limit leaves room for */
	struct chunk **scratch;       /* room for every chunk: see struct seq_emptied */
	/* Entries of scratch that lists being reclaimed hold: a list starts after them (see
	 * unmap_reclaim()). */
	uint32_t scratch_used;

	uint64_t start_ms;
	uint64_t protocol_errors;
	uint64_t access_refused;      /* hellos and admin requests refused (access.h) */
	uint64_t uid_connections_refused; /* connections over max-connections-per-uid */
	uint64_t pins_overdue;        /* pins held past pin-report (pins.h) */
	uint64_t truncates, truncated_tokens; /* SeqTruncates applied, positions dropped */
	uint64_t forks;               /* SeqOpens that forked a sequence */
	uint64_t group_steps;         /* steps tensor-parallel groups made (group.h) */
	/* Config reloads (admin_reload: SIGHUP, kvdctl reload), those that failed, when the
	 * last ran (ms since the start), whether it failed and its first error line. */
	uint64_t reloads, reload_failures, last_reload_ms;
	bool last_reload_failed;
	char last_reload_error[256];
	/* Prefix opens that found blocks, that found none; the tokens they found. */
	uint64_t prefix_hits, prefix_misses, prefix_tokens;
	uint64_t prefix_cached_hits;  /* blocks prefix opens found cached (prefix.h) */
	uint64_t pin_disconnects;     /* connections closed for a pin past pin-timeout */
	uint64_t refused[_LIMIT_MAX];     /* refusals at each limit */
	uint64_t unmap_scan_ms;       /* the tick that last counted struct conn's unmap_late */
	/* DRAINING chunks past their unmap deadline at that tick, per device: what rounds no
	 * longer count on getting back (evict.h). */
	uint32_t draining_late[BACKEND_DEVICES_MAX];
	uint64_t unmap_timeouts;      /* connections that missed unmap-timeout */
	uint64_t unmap_disconnects;   /* ... and unmap-grace after it */
	uint64_t engine_events_done;  /* engines' events seen complete (evict_engine_done) */
	/* Processes that left while they still mapped chunks (departed.h). */
	struct departed *departed;
	uint32_t n_departed;
	bool pidfd_by_pid;            /* KVD_TEST_PIDFD_OPEN: no SO_PEERPIDFD (conn_open_pidfd) */
	struct metrics metrics;
	struct http *http;            /* the metrics endpoint, NULL when off */
	struct admin *admin;          /* settings and live state (admin.h); set by main() */
	struct evictor *evictor;      /* eviction rounds (evict.h) */
	struct tier *tier;            /* the host tier (tier.h) */
	struct mover *mover;          /* moves to and from it, off the loop (mover.h) */
	bool tier_pinned;             /* its memory is the backend's registered (host_register) */
	struct uploader *uploader;    /* output projection uploads (upload.h) */
	struct keep *keep;            /* KV kept across a restart (keep.h); set by main() */
	bool stopping;
	uint64_t stop_ms;
	uint32_t ring_doorbell;       /* RING_DOORBELL_*: limits.ring_doorbell, resolved at start */
	bool backend_fell_back;       /* backend auto found no usable GPU: the pool is host memory */
	/* ... on a machine with the NVIDIA driver (a standing warning): why the GPU was not
	 * usable; empty otherwise. */
	char gpu_unreachable[256];
	uint32_t n_hot;               /* connections the poller reads itself (conn.h) */
	char warnings[WARNINGS_MAX];  /* standing warnings, one per line (warnings.h) */
	struct loop_poller poller;    /* the rings, and the spin before sleeping (loop.h) */
};

/*
 * What a daemon is without its sockets, signals, timer and loop poller: the registry,
 * tenants, tiers, mover, evictor, uploader and the event loop, over pool with limits (the
 * node's bounds derived from the machine, as server_new() does). server_new() adds the
 * rest; the fuzz harnesses drive it as it is, handing it connections and turning the loop
 * themselves. Returns 0, or -errno
 * (logged where it says why).
 */
int server_new_local(struct pool *pool, const struct server_limits *limits, struct server **ret);

/* sockets: the fds a service manager passed that are not the fd store's (keep.h), n_sockets
 * of them, taken over whatever happens; the listening socket is among them when
 * socket-activated. */
int server_new(struct pool *pool, const struct server_limits *limits, const char *socket_path,
               int *sockets, unsigned n_sockets, struct server **ret);
struct server *server_free(struct server *s);

/* Runs the loop until a stop signal; returns the exit status. */
int server_run(struct server *s);

/* Starts a clean stop: clients are told, then disconnected. */
void server_stop(struct server *s);
