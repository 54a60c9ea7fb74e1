/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Internals shared by client.c (connection, transport, chunks, events, administration,
 * eviction requests) and seq.c (models, sequences, their descriptors and observation
 * buffers). Not installed.
 *
 * Locking: everything that talks to the daemon or changes the client runs under c->lock
 * (client_lock/client_unlock). The chunk table is the exception on the reading side: its
 * pages never move or go away before the client does, and a slot's address is published
 * last with release ordering, so that the descriptor accessors look chunks up without the
 * lock while another thread grows a sequence.
 *
 * fork(): every handle records the pid that created it. The pid is cached, and the cache
 * is reset in children by a pthread_atfork() handler, so that the -ECHILD check on the hot
 * accessors costs a load and a compare instead of a system call.
 */

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <unistd.h>

#include "common/ring.h"
#include "kvd/kvd.h"
#include "wire.h"

/* Chunk ids are small integers handed out by the daemon; more than this is a broken peer. */
#define CHUNK_IDS_MAX (UINT32_C(1) << 20)
#define CHUNK_PAGE_IDS 1024u
#define CHUNK_PAGES (CHUNK_IDS_MAX / CHUNK_PAGE_IDS)
/* Models whose shape we remember to cross-check descriptors and observation buffers; ids
 * past this go unchecked, and kvd_model_output_proj() refuses them. */
#define MODELS_MAX 1024u
#define EVENTS_MAX 64u
#define LAST_ERROR_MAX 256u
/* How long a call spins for the daemon's answer before it sleeps, by default and at most
 * (kvd_client_set_spin, KVD_SPIN_US). */
#define SPIN_US_DEFAULT 50u
#define SPIN_US_MAX 1000000u
/* How long connect and hello may take (KVD_CONNECT_TIMEOUT_MS): a daemon that does not
 * accept or answer gives -ETIMEDOUT rather than a hang. */
#define CONNECT_TIMEOUT_MS_DEFAULT 10000u
#define CONNECT_TIMEOUT_MS_MAX 3600000u
/* Matches any reply body, for requests that have no reply message of their own. */
#define BODY_ANY (-1)

/*
 * Test hook (builds with -Dtest_hooks=true only): when the environment variable
 * KVD_TEST_STOP_AT (read once, at connect) names
 * one of these points, the client raise()s SIGSTOP there, so that integration tests can
 * kill or inspect a client at an exact step of a request without sleeping:
 *   "grow-sent"        the SeqGrow request is sent, its reply not read yet;
 *   "grow-mapped"      the chunks a grow granted are mapped, kvd_seq_grow has not returned;
 *   "release-replied"  the SeqReleaseReply is read, nothing is unmapped or reported yet.
 */
enum stop_at {
	STOP_NONE,
	STOP_GROW_SENT,
	STOP_GROW_MAPPED,
	STOP_RELEASE_REPLIED,
};

struct chunk_slot {
	void *addr; /* NULL: not mapped; published last, with release ordering */
	uint64_t bytes;
	/* Host range only (range.h): its place in the range is a hole, not reserved. */
	bool hole;
};

struct model {
	bool known;
	uint32_t layers, q_heads, kv_heads, head_dim, dtype, block_tokens, layout;
	uint64_t block_bytes; /* 0: the daemon did not say */
	uint32_t unit;        /* KVD_UNIT_*; NONE: registered without eviction */
	uint32_t window;      /* observation window, with the default applied */
	uint64_t obs_bytes;   /* observation buffer size from the daemon; 0: none */
	uint32_t compensation; /* KVD_COMPENSATION_* */
	uint32_t index_heads, index_dim; /* the indexer; 0: none */
};

struct client_ring;
struct client_range;


struct kvd_client {
	unsigned n_ref;
	uint64_t serial;           /* unique in the process, never 0 (error.c) */
	pid_t pid;
	pthread_mutex_t lock;
	/* The per-step rings (ring.c): replaced under the write side of ring_lock, used under
	 * its read side; NULL when the daemon offers none. */
	pthread_rwlock_t ring_lock;
	struct client_ring *ring;
	int want_ring;             /* kvd_client_set_ring(); atomic */
	uint64_t spin_ns;          /* kvd_client_set_spin(); atomic */
	bool no_ring;              /* KVD_NO_RING=1 at connect: not even offered */
	/* Requests sent without waiting for their reply (answers to unmap requests, a release
	 * after a failed open), and how many of the first ones a completed round trip covers:
	 * the daemon handles a socket's requests in order, but not the socket's and the rings'
	 * in order with each other, so a ring request waits until they are equal (see
	 * client_ring_barrier()). Written under the lock, read without it: atomics. */
	uint64_t unwaited, unwaited_done;
	/* The first error of mapping a chunk an EVENT_CHUNKS_GRANT brought, for the ring
	 * request that waits for it. */
	int grant_error;
	/* Frames read from the socket so far (under the lock), and how many of them were
	 * handled to the end when the lock was last released (atomic): a ring request compares
	 * the latter with the rings' frames word, so that it never goes on while another
	 * thread is still mapping the chunks a frame before it granted. */
	uint64_t frames_read, frames_done;
	int fd;
	int epoll_fd;
	int event_fd;
	bool event_fd_signalled;
	bool dead; /* the connection is gone: requests fail with -ECONNRESET */
	/* Which connection this is: kvd_client_reconnect() bumps it, and sequences of an
	 * earlier one are stale. */
	uint64_t epoch;
	char socket_path[108];     /* sizeof(sun_path), for kvd_client_reconnect() */
	char tenant[KVD_TENANT_NAME_MAX + 1];
	bool has_tenant;
	enum stop_at stop_at;

	uint32_t version;
	uint64_t chunk_bytes;
	uint64_t pool_bytes;       /* HelloReply.pool_bytes: the range's size (0: not said) */
	/* The pool's memory, from the HelloReply: KVD_MEMORY_HOST (chunks are mmap()ed) or
	 * KVD_MEMORY_CUDA (chunks are imported into cuda's range, cuda-import.h). */
	uint32_t memory;
	uint64_t features;         /* HelloReply.features of the current connection */
	uint32_t connect_timeout_ms; /* kvd_connect_params.timeout_ms; 0: the environment's */
	int32_t want_device;       /* KVD_CONNECT_DEVICE's ordinal; -1: the current context's */
	struct client_cuda *cuda;
	/* KVD_MEMORY_HOST, a tenant's connection: the range its chunks are mapped in (range.h);
	 * NULL when the daemon did not say the pool's size or the address space was short. */
	struct client_range *range;
	uint8_t device_uuid[16];   /* KVD_MEMORY_CUDA: the daemon's GPU, WIRE_DEVICE_UUID_BYTES */
	/* Engines' CUDA events registered with the daemon (kvd_seq_unpin_after): event i has
	 * id i + 1 on this connection; a reconnect starts over. */
	/* Known by their IPC handles, not their addresses: an event destroyed and another
	 * made at its address have different handles. */
	uint8_t cuda_events[KVD_CONN_EVENTS_MAX][64];
	uint32_t n_cuda_events;
	/* The daemon refused one (no IPC events on its GPU, none in its build, a /dev/shm it
	 * does not share): the others are waited for here without asking again. */
	bool cuda_events_refused;
	uint64_t connection_id;
	uint64_t next_id;

	struct wire_rx *rx; /* ~400 KiB: too big for a stack or an embedded member */

	struct model *models;
	uint32_t n_models;

	struct chunk_slot *chunk_pages[CHUNK_PAGES];
	uint32_t n_mapped;

	kvd_event events[EVENTS_MAX];
	uint32_t events_head, n_events;

};

/* Shared by the files of libkvd (transport.c, client.c, admin.c). */
/* Fails the connection with r (closes it; later calls get -ECONNRESET); returns r. */
int client_fail(kvd_client *c, int r);
/*
 * The calling thread's last failed call (error.c): on the client of serial `client` (0: a
 * NULL handle), with code and its message; fresh while the message was set for a failure
 * that has not returned yet.
 */
struct call_error {
	uint64_t client;
	int code;
	bool fresh;
	bool prefix;               /* the failed call's name goes before msg (client_refuse) */
	char msg[LAST_ERROR_MAX];
};
extern _Thread_local struct call_error call_error;

/* The key of c's errors: its serial, 0 for NULL. Read before a call, which may free c. */
static inline uint64_t client_key(const kvd_client *c) {
	return c ? c->serial : 0;
}

/* Keeps the daemon's message for the failure code of the call in progress (an empty one
 * leaves the library's words), or, with code 0, for a call that succeeds with a caveat. */
void client_set_error(const kvd_client *c, int code, const char *message);
/* The same in the library's own words, formatted; returns code. */
int client_error(const kvd_client *c, int code, const char *format, ...)
	__attribute__((format(printf, 3, 4)));
/* client_error() for a helper shared by several calls: the public call that fails puts its
 * name before the message ("kvd_seq_kv: layer 5, ..."). */
int client_refuse(const kvd_client *c, int code, const char *format, ...)
	__attribute__((format(printf, 3, 4)));
/* Records a public call's failure on the client of key (see error.c). */
void call_failed(uint64_t key, int code, const char *function);

/* What every public call that can fail returns: r, recorded when it is an error. */
static inline int64_t call_result(uint64_t key, int64_t r, const char *function) {
	if (r < 0)
		call_failed(key, (int)r, function);
	return r;
}
/* Whether s is a tenant name: 1 to KVD_TENANT_NAME_MAX of [A-Za-z0-9_.-]; the rule in
 * words, for the message of a refusal. */
#define TENANT_NAME_RULE "a tenant name is 1..63 of A-Z a-z 0-9 _ . -"
_Static_assert(KVD_TENANT_NAME_MAX == 63, "TENANT_NAME_RULE");
bool tenant_name_valid(const char *s);
/* The model registered as model_id on this connection, or NULL (model.c). */
const struct model *model_find(const kvd_client *c, int model_id);
/* Unmaps a chunk's mapping of bytes at addr (or hands a GPU import back); false when it
 * left a hole in the host range (range.h). */
bool chunk_mapping_drop(kvd_client *c, void *addr, uint64_t bytes);
/* Tells the daemon, without waiting, that ids are no longer mapped here. */
void client_tell_unmapped(kvd_client *c, uint32_t *ids, uint32_t n);

/* The sizes of the parameter structs' first versions (libkvd 1.4): a caller's struct is at
 * least this large. */
#define KVD_CONNECT_PARAMS_SIZE_1_4 32u
#define KVD_MODEL_PARAMS_SIZE_1_4 80u
#define KVD_TENANT_PARAMS_SIZE_1_4 40u
#define KVD_BUDGET_PARAMS_SIZE_1_6 24u
#define KVD_TENANT_PARAMS_SIZE_1_7 48u
#define KVD_TENANT_PARAMS_SIZE_1_8 56u
#define KVD_OPEN_PARAMS_SIZE_1_10 48u
_Static_assert(sizeof(kvd_connect_params) == KVD_CONNECT_PARAMS_SIZE_1_4, "kvd_connect_params");
_Static_assert(sizeof(kvd_open_params) == KVD_OPEN_PARAMS_SIZE_1_10, "kvd_open_params");
_Static_assert(sizeof(kvd_model_params) == KVD_MODEL_PARAMS_SIZE_1_4, "kvd_model_params");
_Static_assert(sizeof(kvd_tenant_params) == KVD_TENANT_PARAMS_SIZE_1_8, "kvd_tenant_params");
_Static_assert(sizeof(kvd_budget_params) == KVD_BUDGET_PARAMS_SIZE_1_6, "kvd_budget_params");

/* An empty kvd_evictions, and an EvictionsReply copied into one (status.c), for
 * kvd_evictions_get and the plans. */
kvd_evictions *evictions_new(void);
int evictions_copy(const Kvd__V1__EvictionsReply *rep, kvd_evictions *e);

/*
 * Copies a caller's parameter struct (kvd.h, "Parameter structs") into ours, ours_size bytes:
 * one shorter is zero-extended, one longer must hold only zeros past ours. Returns 0, or
 * -EINVAL (NULL, or smaller than first_size), -E2BIG.
 */
int params_copy(void *ours, size_t ours_size, const void *theirs, size_t first_size);

struct kvd_seq {
	kvd_client *client; /* a reference */
	pid_t pid;
	uint64_t epoch;     /* the client's connection it was opened on */
	uint64_t id;
	int model_id;       /* the model it was opened (or claimed) with */
	const struct kvd_seq_desc *desc; /* the daemon's mapping: counts and arrays */
	size_t desc_bytes;
	/* Its header as checked at open, zero-extended past what the daemon wrote: the geometry
	 * (kvd-abi.h, "How the shared headers grow"). */
	struct kvd_seq_desc hdr;
	uint64_t block_stride; /* distance between consecutive blocks of a chunk */

	/* The observation buffer (models with eviction; obs NULL otherwise). The daemon can
	 * write the header too, so its geometry is checked once at open and kept here. */
	void *obs;
	size_t obs_bytes;
	uint32_t obs_layers;
	uint64_t *obs_stamps;
	char *obs_q;
	uint64_t obs_layer_bytes;
	char *obs_iq;             /* the index queries (models with an indexer; NULL without) */
	uint64_t obs_iq_layer_bytes;
};

/* 0 while unknown (at start and in a fresh fork() child). */
extern pid_t client_pid_cache;
/* False if the atfork handler could not be installed: then the cache is never used. */
extern bool client_pid_cache_usable;

static inline pid_t client_self_pid(void) {
	pid_t p;

	if (!client_pid_cache_usable)
		return getpid();
	p = __atomic_load_n(&client_pid_cache, __ATOMIC_RELAXED);
	if (p == 0) {
		p = getpid();
		__atomic_store_n(&client_pid_cache, p, __ATOMIC_RELAXED);
	}
	return p;
}

static inline bool client_forked(const kvd_client *c) {
	return c->pid != client_self_pid();
}

static inline bool seq_forked(const kvd_seq *s) {
	return s->pid != client_self_pid();
}

/* Whether s belongs to a connection kvd_client_reconnect() replaced. */
static inline bool seq_stale(const kvd_seq *s) {
	return s->epoch != __atomic_load_n(&s->client->epoch, __ATOMIC_RELAXED);
}

/* Lock-free chunk lookup: the address of chunk id and its size, or NULL if not mapped. */
static inline void *chunk_addr(const kvd_client *c, uint32_t id, uint64_t *ret_bytes) {
	struct chunk_slot *page;
	void *addr;

	if (id >= CHUNK_IDS_MAX)
		return NULL;
	page = __atomic_load_n(&c->chunk_pages[id / CHUNK_PAGE_IDS], __ATOMIC_ACQUIRE);
	if (!page)
		return NULL;
	addr = __atomic_load_n(&page[id % CHUNK_PAGE_IDS].addr, __ATOMIC_ACQUIRE);
	if (addr && ret_bytes)
		*ret_bytes = page[id % CHUNK_PAGE_IDS].bytes;
	return addr;
}

void close_fds(int *fds, uint32_t n);

/* Maps a granted chunk, taking ownership of fd, under the lock. */
int chunk_map(kvd_client *c, const Kvd__V1__ChunkGrant *grant, int fd);
/* Unmaps chunks ids (those not mapped here are skipped), runs of adjacent ids in one call
 * where the host range allows, under the lock. */
void chunk_unmap_many(kvd_client *c, const uint32_t *ids, size_t n);

void client_lock(kvd_client *c);
/* Also handles the frames already buffered and updates the event fd (see client.c). */
void client_unlock(kvd_client *c);

/* Sends a request with a fresh id, under the lock, without waiting for its reply. */
int client_request(kvd_client *c, Envelope *env, uint64_t *ret_id);

/*
 * One round trip under the lock: sends env, waits for its reply and checks its status and
 * body (`want`, a KVD__V1__ENVELOPE__BODY_* value, or BODY_ANY). A refusal returns the
 * daemon's code and keeps its message for kvd_client_last_error(). With ret_nfds, the
 * reply's fds go to fds[] and belong to the caller; without, they are closed. With
 * stop_after_send, raises SIGSTOP in between (test hook). *ret_reply is valid until the
 * next read on the client, that is until the next client_call() or client_unlock().
 */
int client_call(kvd_client *c, Envelope *env, int want, bool stop_after_send,
		Envelope **ret_reply, int fds[static WIRE_FDS_MAX], uint32_t *ret_nfds);

/* client_call() for a request that carries send_fd (the daemon receives a copy; send_fd
 * stays the caller's). */
int client_call_fd(kvd_client *c, Envelope *env, int send_fd, int want, Envelope **ret_reply,
                   int fds[static WIRE_FDS_MAX], uint32_t *ret_nfds);

/* A memfd called name holding the n bytes at p, sealed against every change (the daemon
 * then reads what it checked). Returns 0 with the fd in *ret_fd, or -errno. */
int client_sealed_memfd(const char *name, const void *p, uint64_t n, int *ret_fd);

/* ---- the rings (ring.c) ---- */

/* The most ring requests client_ring_calls() submits at once. */
#define RING_BATCH_MAX 64

/* A ring request's answer. */
struct ring_done {
	struct kvd_ring_cqe cqe;
	char msg[LAST_ERROR_MAX]; /* the refusal's text, "" when the daemon sent none */
	uint32_t frames;          /* the rings' frames word when it came (ring.h, "Socket") */
};

/* Maps the region of a HelloReply (taking both fds; efd is -EBADF without the eventfd
 * doorbell) and checks it. Returns 0, or -EPROTO (not what the daemon announced), -ENOMEM,
 * -errno. */
int client_ring_map(int memfd, int efd, uint64_t bytes, uint32_t doorbell, struct client_ring **ret);
/* With forked, in a fork() child: frees memory only. */
struct client_ring *client_ring_free(struct client_ring *r, bool forked);
/* Every request in flight or to come fails with why (a negative errno); called when the
 * connection is lost. */
void client_ring_break(struct client_ring *r, int why);

/*
 * Submits the first of the n requests at reqs (user_data is filled in) that slots are free
 * for, all behind one doorbell, and waits for their completions, without the client's
 * lock. With stop_after_submit, raises SIGSTOP in between (test hook). Returns how many it
 * submitted (1 or more), their answers in rets[]; -EAGAIN when the ring is not to be used
 * (none, turned off, or every slot in flight: use the socket), or -ECONNRESET, -EPROTO (the
 * connection is lost: the caller fails the client).
 */
int client_ring_calls(kvd_client *c, const struct kvd_ring_sqe *reqs, uint32_t n,
                      bool stop_after_submit, struct ring_done *rets);

/*
 * What a ring request returns: the daemon's result, with its message kept for
 * kvd_client_last_error(), once the frames the daemon sent before it (grants, unmap
 * requests; ring.h, "Socket") are read and handled, and the daemon has the answers to the
 * unmap requests among them, as on the socket (client_sync()); with stop_before_sync,
 * SIGSTOP before those are read (test hook). Takes the client's lock when there is
 * anything to read or a message to keep.
 */
int client_ring_finish(kvd_client *c, const struct ring_done *d, bool stop_before_sync);
/* A lost connection found by a ring request: fails the client, under its lock. */
int client_ring_lost(kvd_client *c, int r);
/* Before a ring request: waits, with a round trip, until the daemon has handled the
 * requests sent on the socket without waiting (see kvd_client.unwaited). Returns 0 or the
 * round trip's error. */
int client_ring_barrier(kvd_client *c);
/* Reads and handles what the socket holds, if the lock is free right now; for a ring
 * request that waits (it holds the rings' read lock, so it must not wait for the lock). */
void client_ring_serve(kvd_client *c);
/* Sends a request whose reply nobody waits for (it is dropped when it comes). */
int client_request_unwaited(kvd_client *c, Envelope *env);

/* The id of event (a CUevent) on c's connection, registering it first (RegisterEvent) if
 * needed; under c's lock. Returns 0, -EINVAL (not an interprocess event), -ENOSPC (too many
 * events), -EOPNOTSUPP (built without CUDA, or the daemon refused one before), or what the
 * call returns. */
int client_event_id(kvd_client *c, void *event, uint32_t *ret);
