/* SPDX-License-Identifier: MIT */
#ifndef KVD_KVD_H
#define KVD_KVD_H

/*
 * libkvd: the client library of the kvd KV-cache daemon.
 *
 * An engine process connects to the daemon (kvd_client_connect), registers the shape of its
 * model (kvd_model_register), opens sequences (kvd_seq_open) and grows them token by token
 * (kvd_seq_grow). The daemon owns the memory: a grow hands this process the pool chunks
 * that hold the sequence's new blocks, and the library maps them, so the engine reads and
 * writes K/V in place (kvd_seq_kv, kvd_seq_block) without copies.
 *
 * Memory model. The pool is cut into chunks (kvd_client_chunk_bytes() each); a chunk belongs
 * to one tenant at a time and is carved into blocks of one model's block size. A block holds
 * `block_tokens` consecutive token slots:
 *   - KVD_LAYOUT_PER_LAYER: one layer, all kv heads: K[kv_heads][block_tokens][head_dim]
 *     followed by V[kv_heads][block_tokens][head_dim];
 *   - KVD_LAYOUT_PER_HEAD: one (layer, kv head): K[block_tokens][head_dim] followed by
 *     V[block_tokens][head_dim].
 * Elements are dtype-sized (f16, bf16: 2 bytes; f32: 4), rows are contiguous, and blocks
 * start at multiples of 64 bytes inside a chunk. A block is named by (chunk id, index),
 * never by an address, since every process maps chunks at its own addresses.
 *
 * Sequence descriptor. Each sequence has a descriptor that the daemon creates, seals and
 * rewrites; the library maps it read-only. It is struct kvd_seq_desc (header_bytes of it:
 * see kvd_seq_header()) followed by three arrays, one entry per table (a table is a layer
 * with KVD_LAYOUT_PER_LAYER, a
 * (layer, kv head) with KVD_LAYOUT_PER_HEAD, index layer * kv_heads + kv_head):
 *   uint32_t tokens[n_tables]                       resident tokens of the table
 *   uint32_t positions[n_tables][max_tokens]        original position of each resident slot
 *   struct kvd_block_ref blocks[n_tables][max_blocks]  the table's blocks, in slot order
 * Slot i of a table lives in block blocks[t][i / block_tokens], row i % block_tokens.
 * `generation` is even while the descriptor is stable and odd while the daemon rewrites it
 * (a sequence lock): read it, copy what you need, read it again and retry if it changed or
 * is odd. The daemon rewrites a descriptor in answer to this process's own requests and,
 * for models registered with eviction (kvd_model_register_evictable), when an eviction
 * round compacts an unpinned sequence; a pinned sequence (kvd_seq_pin) and every sequence
 * of a model without eviction stay stable between this process's calls.
 * Per-table token counts. seq_grow appends to every table; with KVD_UNIT_HEAD_TOKEN,
 * tables of one layer may hold different numbers of tokens after an eviction.
 *
 * Errors. Every fallible function returns 0 (or a count) on success and a negative errno
 * on failure; each documents the values it returns. Errors reported by the daemon are
 * passed through, and kvd_client_last_error() gives the message of the last failed call on
 * that client from the calling thread. Any call that talks to the daemon may also return -EPROTO
 * (the daemon broke the protocol) or -EMFILE (fds the daemon sent could not be received);
 * the connection is closed then, and later calls return -ECONNRESET. NULL handles give
 * -EINVAL. The library never logs and never calls exit().
 *
 * Threads. A kvd_client may be used from several threads. Calls that go over the socket
 * are serialised by an internal lock (requests are synchronous round trips). The per-step
 * calls (kvd_seq_grow, kvd_seq_pin, kvd_seq_unpin, kvd_seq_release) go through
 * shared-memory rings when the daemon offers them (see kvd_client_set_ring): they do not
 * take that lock, only a short one that serialises their submissions, so requests of several
 * threads are in flight together and each returns when its own answer comes, in whatever
 * order the daemon answers (a grow that waits for an eviction round does not hold up a
 * pin on another thread). Up to the daemon's ring size may be in flight; past that, and for
 * a ring request whose answer needs the socket (new chunks to map, chunks to unmap), the
 * call also takes the lock. A kvd_seq may be read (kvd_seq_tokens, kvd_seq_kv, ...) from
 * any thread, but must not be used while another thread releases it. Reference counting
 * (ref/unref) is atomic.
 *
 * fork(). Handles belong to the process that created them. After fork() the child gets
 * -ECHILD from every call on an inherited handle (getters that cannot return an error
 * return "", 0 or NULL instead, as documented), and the chunk and descriptor mappings are
 * not inherited at all (MADV_DONTFORK), so a child never sees KV memory. The child may
 * still release and unref what it inherited: that only frees memory and closes its copies
 * of the fds, and never touches the parent's connection. All fds are O_CLOEXEC.
 *
 * The header compiles as C99 and C++ and uses fixed-width types only.
 */

#include <stddef.h>
#include <stdint.h>

/* The protocol's constants, limits and shared-memory layouts (descriptor, observation
 * buffer, compensation blocks): what the daemon and this library share. */
#include <kvd/kvd-abi.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library's version this header belongs to (libkvd.so.MAJOR.MINOR; symbols versioned
 * KVD_MAJOR.MINOR in libkvd.sym): a program may test for a function with it. */
#define KVD_VERSION_MAJOR 1
#define KVD_VERSION_MINOR 10

#if defined(__GNUC__)
#define KVD_EXPORT __attribute__((visibility("default")))
#else
#define KVD_EXPORT
#endif

typedef struct kvd_client kvd_client;
typedef struct kvd_seq kvd_seq;

/* The shape of a model's KV cache; everything the daemon needs to lay out its blocks. */
typedef struct kvd_model_spec {
	const char *name;      /* for logs and status; may be NULL */
	uint32_t layers;       /* 1..1024 */
	uint32_t q_heads;      /* 1..1024, a multiple of kv_heads */
	uint32_t kv_heads;     /* 1..1024 */
	uint32_t head_dim;     /* 1..4096 */
	uint32_t dtype;        /* KVD_DTYPE_* */
	uint32_t block_tokens; /* 1..65536; a block must fit in one chunk */
	uint32_t layout;       /* KVD_LAYOUT_* */
} kvd_model_spec;

/*
 * How the daemon may evict a model's KV. With a unit other than KVD_UNIT_NONE the daemon
 * may rewrite the descriptors of the model's sequences whenever they are not pinned
 * (kvd_seq_pin): tokens disappear from tables, the survivors keep their order and their
 * original positions but move to lower slots, and the generation changes. Engines read the
 * descriptor (or call kvd_seq_tokens & co.) after pinning, and get a KVD_EVENT_SEQ_CHANGED
 * event after each rewrite. Protected, never evicted: positions below `sinks`, each table's
 * last `window` slots, the slots of its open (partially filled) tail block, and the slots
 * grown since the sequence's last unpin (kvd_seq_unpin: the engine writes a step's K/V
 * pinned, so a round between a grow and the pin that writes it leaves the new slots
 * alone; since KVD_1.10). A sequence grown and never unpinned is therefore not evicted.
 * The same holds for every model of a tenant whose tier is host (kvd_seq_pin_recall):
 * the daemon may move an unpinned sequence out of the pool whole, so such an engine
 * writes and reads K/V only while the sequence is pinned, whatever the model's unit.
 */
typedef struct kvd_eviction_spec {
	uint32_t unit;         /* KVD_UNIT_* */
	uint32_t window;       /* observation window w, 1..256 (0: 32) */
	uint32_t sinks;        /* leading positions kept, 0..1024 (KVD_SINKS_DEFAULT: 4) */
	uint32_t reserved;     /* 0 */
} kvd_eviction_spec;

/*
 * IndexMem's indexer (kvd_model_register_indexed): per layer, `heads` index query heads
 * and one index key per token, all of `dim` elements (docs/algorithms.md §3). The engine
 * computes them (it alone sees hidden states), writes each token's index key into its block
 * (see kvd_seq_index_key) and its recent index queries into the observation buffer (see
 * kvd_seq_index_observation); rounds of a tenant whose policy is "indexmem" score tokens
 * from them alone, without the model's keys.
 */
typedef struct kvd_index_spec {
	uint32_t heads;        /* 1..64 */
	uint32_t dim;          /* 1..256 */
	uint32_t reserved[2];  /* 0 */
} kvd_index_spec;

/*
 * Parameter structs (kvd_client_connect_params, kvd_model_register_params,
 * kvd_tenant_set_params, kvd_budget_set_params). Each starts with `size`, which the caller sets to the struct's
 * size as it compiled it (sizeof); new features extend these structs at their end, not the
 * function list. The library reads `size` bytes: a field past them (a caller built against
 * an older kvd.h) reads as 0, which always means the default or "unchanged"; a struct larger
 * than the library knows is accepted when the bytes it does not know are all 0, else refused
 * with -E2BIG (a feature this library lacks). Reserved fields must be 0. Since KVD_1.4.
 */

/* kvd_client_connect_params() flags. */
#define KVD_CONNECT_NO_RING (1u << 0) /* keep the per-step calls on the socket (KVD_NO_RING=1) */
#define KVD_CONNECT_DEVICE (1u << 1)  /* the tenant's GPU is `device`, not the current context's
                                       * (since KVD_1.6) */

typedef struct kvd_connect_params {
	uint32_t size;             /* sizeof(kvd_connect_params) */
	uint32_t flags;            /* KVD_CONNECT_* */
	const char *socket_path;   /* NULL: $KVD_SOCKET, else KVD_DEFAULT_SOCKET */
	const char *tenant;        /* NULL: an administrative connection */
	uint32_t timeout_ms;       /* for the connect and hello; 0: KVD_CONNECT_TIMEOUT_MS from
	                            * the environment, or 5000 */
	uint32_t device;           /* with KVD_CONNECT_DEVICE: the CUDA ordinal, in this process,
	                            * of the GPU whose chunks a tenant gets; else 0 (the field was
	                            * reserved, 0, before KVD_1.6) */
} kvd_connect_params;

typedef struct kvd_model_params {
	uint32_t size;             /* sizeof(kvd_model_params) */
	uint32_t compensation;     /* KVD_COMPENSATION_*; other than NONE needs an eviction unit */
	kvd_model_spec spec;
	kvd_eviction_spec eviction; /* unit KVD_UNIT_NONE (0): the daemon never evicts it */
	kvd_index_spec index;      /* heads and dim 0: no indexer */
} kvd_model_params;

/* kvd_tenant_params.set: the fields to change; the others keep their values. */
#define KVD_TENANT_SET_MIN (1u << 0)
#define KVD_TENANT_SET_MAX (1u << 1)
#define KVD_TENANT_SET_WEIGHT (1u << 2)
#define KVD_TENANT_SET_POLICY (1u << 3)
#define KVD_TENANT_SET_TIER (1u << 4)   /* since KVD_1.7 */
#define KVD_TENANT_SET_RECALL (1u << 5) /* since KVD_1.8 */

typedef struct kvd_tenant_params {
	uint32_t size;             /* sizeof(kvd_tenant_params) */
	uint32_t set;              /* KVD_TENANT_SET_* */
	uint64_t min_bytes;        /* guaranteed minimum */
	uint64_t max_bytes;        /* cap; KVD_TENANT_NO_CAP: none */
	uint32_t weight;           /* 1..10000 */
	uint32_t reserved;         /* 0 */
	const char *policy;        /* eviction policy, by the names of kvd.conf(5) (policy) */
	/* Since KVD_1.7: what memory pressure does with its sequences, "drop", "host" or
	 * "host+file" (kvd.conf(5), tier). */
	const char *tier;
	/* Since KVD_1.8: token recall, at most this many tokens per row a kvd_seq_recall may
	 * bring back; 0: off (kvd.conf(5), recall; docs/recall.md). Needs a host tier. */
	uint32_t recall;
	uint32_t reserved2;        /* 0 */
} kvd_tenant_params;

/* kvd_budget_params.flags */
#define KVD_BUDGET_FORCE (1u << 0) /* set it even below the floor (kvd_budget_set_params) */

typedef struct kvd_budget_params {
	uint32_t size;             /* sizeof(kvd_budget_params) */
	uint32_t flags;            /* KVD_BUDGET_* */
	uint64_t bytes;            /* the budget, when percent is 0 */
	uint32_t percent;          /* 1..100: this share of the pool instead (every device's
	                            * together); 0: bytes */
	uint32_t reserved;         /* 0 */
} kvd_budget_params;

typedef struct kvd_event {
	uint32_t type; /* KVD_EVENT_* */
	uint32_t reserved;
	uint64_t arg;
} kvd_event;

/* The kvd release this library comes from, e.g. "1.10.0": the daemon's, kvdctl's and the
 * library's one version, whose major and minor are KVD_VERSION_MAJOR.KVD_VERSION_MINOR.
 * Never NULL. */
KVD_EXPORT const char *kvd_version(void);

/*
 * Connects to the daemon at socket_path (NULL: $KVD_SOCKET when set and not empty, else
 * KVD_DEFAULT_SOCKET; since KVD_1.4, before which NULL always meant KVD_DEFAULT_SOCKET) and
 * says hello.
 * tenant names the tenant this process acts for ([A-Za-z0-9_.-], 1..63 characters), or is
 * NULL for an administrative connection that may only use kvd_status_get,
 * kvd_budget_set and kvd_tenant_set.
 * Returns 0 and a new client in *ret, or: -EINVAL (bad argument or tenant name),
 * -ENAMETOOLONG (socket path too long), -ENOENT/-ECONNREFUSED/-EACCES (no daemon there, or
 * not allowed), -EPROTONOSUPPORT (no common protocol version, or a daemon whose pool is GPU
 * memory and a libkvd built without CUDA), -EUSERS (daemon connection limit), -ETIMEDOUT
 * (the daemon did not accept or answer within 10 s, or KVD_CONNECT_TIMEOUT_MS from the
 * environment), -ENOMEM, or another error of socket(2)/connect(2). With a tenant and a GPU
 * pool (KVD_MEMORY_CUDA), the tenant's chunks are on the GPU of the CUDA context current on
 * the calling thread (the engine's), or with none, on the daemon's only GPU; errors:
 * -EXDEV when that GPU is not one the daemon pools, or no context is current and the daemon
 * pools several (make the engine's context current first, or use KVD_CONNECT_DEVICE),
 * -ENOENT/-ENOSYS/-ENODEV/-ENXIO when no usable CUDA driver or device is found here,
 * -ENODEV when the daemon's GPU is not among this process's (CUDA_VISIBLE_DEVICES).
 */
KVD_EXPORT int kvd_client_connect(const char *socket_path, const char *tenant, kvd_client **ret);

/* kvd_client_connect with parameters (see "Parameter structs"): also -E2BIG, and -EINVAL
 * for a bad p (NULL, size below the first version's, unknown flags, reserved not 0).
 * Since KVD_1.4. */
KVD_EXPORT int kvd_client_connect_params(const kvd_connect_params *p, kvd_client **ret);

/*
 * After the daemon went away (a KVD_EVENT_DISCONNECTED event, or -ECONNRESET from a call),
 * connects the same handle again, as the same tenant, to the same socket path, trying for up
 * to timeout_ms while the daemon is not back. What the lost connection had is gone on both
 * sides: models must be registered again (new ids; their output projections too) and
 * sequences reopened; the old kvd_seq handles return -ESTALE from every call but
 * kvd_seq_release, which frees them, and kvd_seq_claim, which takes one back when the
 * daemon kept it across its restart. No other thread may use the client or its sequences
 * during the call. Returns 0, or -EISCONN (the connection is alive), -ETIMEDOUT (the daemon
 * did not come back in time), an error of kvd_client_connect (a refusal is not retried),
 * -ECHILD.
 * Since KVD_1.1.
 */
KVD_EXPORT int kvd_client_reconnect(kvd_client *c, uint32_t timeout_ms);

/*
 * The per-step rings. A daemon that offers them (kvd.8, --ring-entries) gives each
 * connection a pair of shared-memory rings at hello, and kvd_seq_grow, kvd_seq_pin,
 * kvd_seq_unpin and kvd_seq_release then go through them: no system call while the daemon
 * is awake (it polls for --poll-us after its last work), a futex or eventfd wake-up when it
 * is asleep. Everything else stays on the socket, and so do the fds: a grow that needs chunks
 * this process has not mapped, or a release that empties chunks, reads them from the
 * socket before it returns. The environment variable KVD_NO_RING=1, set when the client
 * connects, keeps that client on the socket.
 * kvd_client_set_ring(c, 0) sends the per-step calls over the socket from now on, and
 * kvd_client_set_ring(c, 1) through the rings again. Returns 0, or -EOPNOTSUPP (enable, but
 * this connection has no rings: an older daemon, --ring-entries=0 or KVD_NO_RING),
 * -EINVAL, -ECHILD.
 * kvd_client_get_ring returns 1 while the per-step calls use the rings, 0 while they use
 * the socket, or -EINVAL, -ECHILD.
 * Since KVD_1.1.
 */
KVD_EXPORT int kvd_client_set_ring(kvd_client *c, int enable);
KVD_EXPORT int kvd_client_get_ring(kvd_client *c);

/*
 * How long a call waits for the daemon's answer spinning before it sleeps, in microseconds:
 * an answer that comes within it costs no sleep and no wake-up (tens of microseconds on a
 * virtual machine), at the price of this thread's CPU meanwhile (it yields the CPU after
 * 2 us, then at doubling intervals, so that a daemon on the same CPU runs). 0 sleeps at once.
 * The default is 50, or KVD_SPIN_US from the environment when the client connects. Applies
 * to the rings and the socket. Returns 0, or -EINVAL (above 1000000), -ECHILD.
 * Since KVD_1.1.
 */
KVD_EXPORT int kvd_client_set_spin(kvd_client *c, uint32_t spin_us);

/* Reference counting. Every kvd_seq holds a reference on its client, so the connection
 * stays open until the last kvd_seq is released too. unref on the last reference closes
 * the connection (the daemon then drops whatever it still held for it) and unmaps all
 * chunks; it returns NULL. Both accept NULL. */
KVD_EXPORT kvd_client *kvd_client_ref(kvd_client *c);
KVD_EXPORT kvd_client *kvd_client_unref(kvd_client *c);

/* The message of the last call on this client, made on this thread, that failed: the
 * daemon's words when it refused the call, else the library's ("kvd_seq_grow: n is 0 ...",
 * or the function's name and kvd_strerror()'s words). "" when none failed (and after fork).
 * A call that succeeds leaves it, except one that succeeds with a caveat (kvd_tenant_set()
 * returning 1 with the daemon's words). Per thread since KVD_1.5, before which it was
 * per client and kept the daemon's refusals only. Copy it before this thread's next call.
 * With NULL: the message of this thread's last failed call that had no client, or whose
 * client the failure freed (kvd_client_connect: "tenant name ... is not valid", the
 * daemon's refusal of the hello); since KVD_1.10. */
KVD_EXPORT const char *kvd_client_last_error(kvd_client *c);

/*
 * What a negative errno from libkvd means for kvd, for messages to users: -EFBIG "the
 * sequence holds max_tokens", -EDQUOT "the tenant is at its cap", and so on for the codes
 * kvd gives a meaning of its own; the C library's description for the others, "unknown
 * error" for what is none. A static string, never NULL; thread-safe. The daemon's own words
 * for a refusal are kvd_client_last_error()'s. Since KVD_1.4.
 */
KVD_EXPORT const char *kvd_strerror(int code);

/* Negotiated protocol version (>= 1), or -ECHILD after fork. */
KVD_EXPORT int kvd_client_protocol_version(kvd_client *c);

/* Bytes of one pool chunk, as the daemon announced at hello; 0 after fork. */
KVD_EXPORT uint64_t kvd_client_chunk_bytes(kvd_client *c);

/* The memory of the daemon's pool (kvd_client_memory). */
#define KVD_MEMORY_HOST 1 /* shared memory: block addresses are ordinary pointers */
#define KVD_MEMORY_CUDA 2 /* GPU memory: block addresses are device pointers */

/*
 * What the daemon's pool is: returns KVD_MEMORY_HOST or KVD_MEMORY_CUDA, or -ECHILD after
 * fork. With CUDA, *ret_device (may be NULL; -1 for host) is the ordinal in this process of
 * the connection's GPU (the engine's: kvd_client_connect): the addresses kvd_seq_kv and
 * kvd_seq_block return are device pointers on it, valid in every context of the process (the CUDA runtime's too), and the CPU must not
 * dereference them. A chunk is unmapped when the daemon takes it back (after a release, or
 * a KVD_EVENT_CHUNKS_UNMAP event that kvd_client_next_event handles): work the engine
 * queued on a released sequence's blocks must be complete before it calls kvd_seq_release
 * or drains events. Since KVD_1.2.
 */
KVD_EXPORT int kvd_client_memory(kvd_client *c, int32_t *ret_device);

/*
 * A file descriptor that becomes readable when the daemon may have sent events; poll it
 * from the engine's own loop and then call kvd_client_next_event() until it returns 0.
 * Owned by the client; do not close it. Returns the fd, or -ECHILD after fork.
 */
KVD_EXPORT int kvd_client_get_event_fd(kvd_client *c);

/*
 * Reads what the daemon sent without blocking, acts on what the library handles itself
 * (requests to unmap chunks) and returns the next event for the engine in *ret.
 * Returns 1 with an event, 0 when none is pending, or -ECONNRESET (the daemon closed the
 * connection), -ECHILD (after fork), -EPROTO (the daemon broke the protocol).
 */
KVD_EXPORT int kvd_client_next_event(kvd_client *c, kvd_event *ret);

/*
 * Registers a model shape for this connection. Returns a model id (>= 0) or -EINVAL (shape
 * out of range, unknown dtype or layout, block larger than a chunk), -EPERM (administrative
 * connection), -EMFILE (too many models on this connection or of this tenant), -ECONNRESET,
 * -ECHILD.
 */
KVD_EXPORT int kvd_model_register(kvd_client *c, const kvd_model_spec *spec);

/*
 * kvd_model_register with eviction: ev (NULL is KVD_UNIT_NONE) says how the daemon may evict
 * the model's sequences. Returns a model id, or the errors of kvd_model_register (-EINVAL
 * also for a bad ev: unknown unit, KVD_UNIT_HEAD_TOKEN without KVD_LAYOUT_PER_HEAD, window or
 * sinks out of range, reserved not 0), or -EFBIG (its observation buffer would exceed the
 * daemon's max-observation-bytes).
 * Since KVD_1.1.
 */
KVD_EXPORT int kvd_model_register_evictable(kvd_client *c, const kvd_model_spec *spec,
		                            const kvd_eviction_spec *ev);

/*
 * kvd_model_register_evictable with compensation: KVD_COMPENSATION_NONE, or
 * KVD_COMPENSATION_MOMENTS, which needs an eviction unit (ev). With moments, each sequence's
 * first grow also allocates layers * kv_heads moments blocks of KVD_MOMENTS_BYTES(head_dim)
 * bytes from the pool, counted against the tenant like its K/V (so that grow may fail with
 * -ENOSPC or -EDQUOT for them), freed with the sequence. Returns a model id, or the errors
 * of kvd_model_register_evictable (-EINVAL also for an unknown compensation, moments
 * without an eviction unit, or a moments block larger than a chunk), -EOPNOTSUPP (the
 * daemon does not keep moments).
 * Since KVD_1.2.
 */
KVD_EXPORT int kvd_model_register_compensated(kvd_client *c, const kvd_model_spec *spec,
		                              const kvd_eviction_spec *ev, uint32_t compensation);

/*
 * kvd_model_register_compensated with an indexer ix (NULL: none), which needs an eviction
 * unit: every block gets room for one index key per slot (see struct kvd_seq_desc) and the
 * observation buffer room for the index queries. compensation may also be
 * KVD_COMPENSATION_LATENT (blocks of KVD_LATENT_BYTES(head_dim), allocated and counted as
 * moments blocks are). Returns a model id, or the errors of kvd_model_register_compensated
 * (-EINVAL also for ix out of range or with reserved not 0, or ix without an eviction
 * unit), -EOPNOTSUPP (the daemon has no indexer or no latent memory). Since KVD_1.2.
 */
KVD_EXPORT int kvd_model_register_indexed(kvd_client *c, const kvd_model_spec *spec,
		                          const kvd_eviction_spec *ev, uint32_t compensation,
		                          const kvd_index_spec *ix);

/* Every registration in one call (see "Parameter structs"): the model p->spec with
 * p->eviction, p->compensation and the indexer p->index. Returns what
 * kvd_model_register_indexed returns, and -E2BIG, or -EINVAL for a bad p (NULL, size below
 * the first version's). The four calls above are this one with fewer fields. Since KVD_1.4. */
KVD_EXPORT int kvd_model_register_params(kvd_client *c, const kvd_model_params *p);

/*
 * Gives the daemon layer `layer`'s output projection, so that costs are measured in the
 * model's output space rather than in value space: wo[hidden][q_heads * head_dim] of dtype
 * (KVD_DTYPE_*), row-major, as in an o_proj weight. The library copies it into a sealed
 * memfd; the daemon derives what it needs and keeps nothing else. Call it once per layer
 * after registration; calling it again replaces the layer's. Returns 0, or -EINVAL (unknown
 * model, layer out of range, hidden not 1..65536, bad dtype), -EFBIG (over 1 GiB, or the
 * model's Gram state over the daemon's limit), -EBUSY (the daemon is computing too many
 * uploads, or this connection has max-outstanding replies waiting: retry), -ENOMEM, an error of memfd_create(2) or write(2) (e.g. -EMFILE),
 * -ECONNRESET, -ECHILD.
 * Since KVD_1.1.
 */
KVD_EXPORT int kvd_model_output_proj(kvd_client *c, int model_id, uint32_t layer, uint32_t dtype,
		                     uint32_t hidden, const void *wo);

/*
 * Opens an empty sequence of a registered model that can hold up to max_tokens tokens per
 * (layer, kv head), and maps its descriptor. Returns 0 and the sequence in *ret, or
 * -EINVAL (unknown model, max_tokens 0 or above the daemon's limit), -EMFILE (too many
 * sequences on this connection), -ENOMEM, -ECONNRESET, -ECHILD.
 */
KVD_EXPORT int kvd_seq_open(kvd_client *c, int model_id, uint32_t max_tokens, kvd_seq **ret);

/*
 * Appends n tokens to every (layer, kv head) of the sequence, mapping any chunk the new
 * blocks live in. The new slots are the last n of each table; their K/V are for the caller
 * to write. All or nothing: when the daemon refuses, the sequence is unchanged. (If the
 * daemon granted the tokens but a chunk cannot be mapped here, the error of mmap(2), e.g.
 * -ENOMEM, is returned and the tokens are resident but kvd_seq_kv refuses the slots in
 * that chunk: release the sequence.)
 * Returns 0, or -EINVAL (n is 0), -EFBIG (past max_tokens), -ENOSPC (the node budget or the
 * pool is exhausted, or the grow alone needs more than the whole budget), -EDQUOT (the tenant's max is reached), -E2BIG (one grow would need
 * more than 253 new chunks: grow in smaller steps), -ETIMEDOUT (this connection did not
 * answer the daemon's request to unmap a chunk within kvd's unmap-timeout: handle events,
 * see kvd_client_next_event(); the call handled them, so a retry may succeed), -ENOMEM,
 * -ECONNRESET, -ECHILD.
 */
KVD_EXPORT int kvd_seq_grow(kvd_seq *s, uint32_t n);

/*
 * Opens a fork of s, as parallel sampling and beam search branch a prompt: a new sequence of
 * s's model and max_tokens, with s's tokens, positions and K/V. Every full block of s is
 * shared, held by both and counted once against the budget; the partly filled last blocks
 * (and the moments blocks) are copied, so both grow and write their new slots
 * independently. A shared block is read-only for both: an engine writes only the slots its
 * grows add, and a truncate into shared blocks makes the next grow copy the last one first.
 * Rounds never evict, move nor compact shared blocks, nor move a sequence that holds one to
 * a tier; releasing either leaves the other's bytes intact (docs/engines.md, "Fork"). Kept
 * tokens (token recall) stay s's. Blocks until the daemon made the fork (its new chunks
 * mapped). Returns 0 with the fork in *ret, or -EOPNOTSUPP (a daemon older than KVD_1.9),
 * -EBUSY (s is moved out of the pool or being recalled into: pin it first), -EAGAIN (the
 * event of s's last kvd_seq_unpin_after has not completed), -ENOSPC, -EDQUOT (no room for
 * the copied blocks), the refusals of kvd_seq_open (limits), -ENOENT, -ECONNRESET, -ECHILD,
 * -ESTALE.
 * Since KVD_1.9.
 */
KVD_EXPORT int kvd_seq_fork(kvd_seq *s, kvd_seq **ret);

/*
 * Prefix sharing (docs/engines.md, "Prefix sharing"). A full block's content key is the
 * SHA-256 of the canonical CBOR encoding of (parent key, token ids, extra keys): vLLM's
 * sha256_cbor block hash, so that kvd's keys are the ones vLLM-family routers compute. The
 * first block's parent is the root key (kvd_key_root), which every process of a fleet
 * derives from one shared seed, as vLLM derives it from PYTHONHASHSEED. A sequence opened
 * with its prompt's keys (kvd_seq_open_params) starts with the longest leading run of
 * blocks that sequences of the same tenant published (kvd_seq_publish) for a model of the
 * same name and block layout; it shares them, so the engine prefills only the rest.
 */
#define KVD_KEY_BYTES 32

/* One extra key of a block (vLLM's extra_keys: a LoRA id, a multimodal input's hash, the
 * cache salt): the text when text is not NULL, else the integer. */
typedef struct kvd_key_extra {
	const char *text;
	int64_t integer;
} kvd_key_extra;

/* The root key for a seed: the SHA-256 of the seed's CBOR encoding (vLLM's NONE_HASH with
 * PYTHONHASHSEED=seed). Returns 0, or -EINVAL (NULL). Since KVD_1.10. */
KVD_EXPORT int kvd_key_root(const char *seed, uint8_t out[KVD_KEY_BYTES]);

/* The key of one full block: its parent's key (the root key for the first block), its n
 * token ids and n_extra extra keys (0: vLLM's None). Returns 0, or -EINVAL (NULL pointers
 * where n or n_extra are not 0). Since KVD_1.10. */
KVD_EXPORT int kvd_block_key(const uint8_t parent[KVD_KEY_BYTES], const uint32_t *tokens,
                             uint32_t n, const kvd_key_extra *extra, uint32_t n_extra,
                             uint8_t out[KVD_KEY_BYTES]);

/* The keys of the full blocks of n_tokens token ids, block_tokens each, chained from root,
 * with cache_salt (NULL: none) as the first block's one extra key, as vLLM keys a request
 * without LoRA or multimodal inputs; at most max_keys into out (KVD_KEY_BYTES each).
 * Returns the number of keys written, or -EINVAL. Since KVD_1.10. */
KVD_EXPORT int64_t kvd_prefix_keys(const uint8_t root[KVD_KEY_BYTES], const uint32_t *tokens,
                                   uint64_t n_tokens, uint32_t block_tokens,
                                   const char *cache_salt, uint8_t *out, uint64_t max_keys);

typedef struct kvd_open_params {
	uint32_t size;             /* sizeof(kvd_open_params) */
	int model_id;
	uint32_t max_tokens;
	uint32_t n_prefix_keys;    /* keys at prefix_keys: of the prompt's first full blocks */
	const uint8_t *prefix_keys; /* n_prefix_keys * KVD_KEY_BYTES, or NULL */
	uint32_t group_size;       /* 2..16: the first member of a tensor-parallel group */
	uint32_t reserved;         /* 0 */
	uint64_t group_of;         /* a group's id (its first member's kvd_seq_id): join it */
	const uint32_t *prefix_tokens; /* with prefix_keys, NULL or their blocks' token ids:
	                            * n_prefix_keys x block_tokens, for the KV events */
} kvd_open_params;

/*
 * kvd_seq_open with parameters (see "Parameter structs"). With prefix keys (at most
 * max_tokens / block_tokens; the model must have a name), the new sequence starts with the
 * blocks of the longest leading run of those keys that this tenant's sequences published
 * for a model of the same name and block layout: kvd_seq_tokens() says how many tokens
 * (whole blocks, positions 0 onwards), and the engine prefills the rest. Those blocks are
 * shared, as a fork's (kvd_seq_fork): counted once, read-only for every sharer, never
 * evicted nor moved while shared; a grow after a truncate into them copies the last one.
 * The keys stay with the sequence for kvd_seq_publish.
 *
 * With group_size or group_of, a member of a tensor-parallel group (docs/engines.md,
 * "Tensor-parallel groups"): one sequence per rank, each on its rank's connection and model
 * (its kv heads), all of one tenant. Rank 0 opens with group_size, the number of ranks, and
 * gives its kvd_seq_id to the others, which open with group_of = that id before any member
 * grows. Then a step's grows are admitted all or none: the first member to grow by n grows
 * every member by n (their new chunks reach their processes as grants) or none, and each
 * other member's own kvd_seq_grow by n claims what the step made. When a member is
 * released, or its process exits, the others' grows fail with -EPIPE: release them too.
 * Rounds evict per member, each rank's tables on their own.
 *
 * Returns what kvd_seq_open returns, and -EINVAL (a bad p, too many keys, a model without
 * a name, group_size not 2..16, more than one of keys, group_size and group_of), -ENOENT (no
 * such group of this tenant), -EBUSY (the group is full, broken, or has grown), -E2BIG,
 * -EOPNOTSUPP (a daemon older than KVD_1.10, with keys or a group), -ETIMEDOUT (as
 * kvd_seq_grow's), an error of memfd_create(2). Since KVD_1.10.
 */
KVD_EXPORT int kvd_seq_open_params(kvd_client *c, const kvd_open_params *p, kvd_seq **ret);

/*
 * How many leading blocks of the n_keys keys at keys this tenant holds for model_id, as a
 * prefix open would attach them now (what vLLM's KV connector asks with
 * get_num_new_matched_tokens), without opening anything or counting a hit; *ret_cached (may
 * be NULL) gets how many of them only the prefix cache holds. Returns the blocks, or
 * -EINVAL (unknown model, one without a name, n_keys 0 or more than max-seq-tokens holds),
 * -EOPNOTSUPP (a daemon older than KVD_1.10), an error of memfd_create(2), -ECONNRESET,
 * -ECHILD. Since KVD_1.10.
 */
KVD_EXPORT int64_t kvd_prefix_lookup(kvd_client *c, int model_id, const uint8_t *keys,
                                     uint32_t n_keys, uint32_t *ret_cached);

/*
 * Says that the first `blocks` full blocks of a sequence opened with prefix keys hold the
 * K/V of their keys (the engine wrote them; call after the prefill's kernels completed):
 * from now on this tenant's prefix opens may share them. A block stays published until a
 * truncate reaches it or the sequence is released; a round that evicts tokens of it makes
 * it no longer found. Returns 0, or -EINVAL (more blocks than keys, or a block not whole in
 * every table: not grown yet, or evicted from), -EBUSY, -EAGAIN (as kvd_seq_truncate's),
 * -EOPNOTSUPP, -ENOENT, -ECONNRESET, -ECHILD, -ESTALE. Since KVD_1.10.
 */
KVD_EXPORT int kvd_seq_publish(kvd_seq *s, uint32_t blocks);

/*
 * One decode step's calls for a whole batch: kvd_seq_grow (by `tokens`), kvd_seq_pin and
 * kvd_seq_unpin of the n sequences at seqs, all of one client, each as the call alone
 * would do it, in order. On the ring (see "Rings") a batch of up to 64 is submitted behind
 * one doorbell and its completions reaped together, so the daemon wakes once per batch;
 * without a ring each goes on the socket. codes (NULL, or room for n) gets each one's
 * result: 0 or a negative errno, and for a pin the KVD_RECALL_* it found (as
 * kvd_seq_pin_recall). Returns 0 when every one succeeded, else the first error; -EINVAL
 * (NULL, n 0, sequences of different clients, tokens 0), -ECHILD, -ESTALE before any is
 * sent. Since KVD_1.10.
 */
KVD_EXPORT int kvd_seqs_grow(kvd_seq *const *seqs, uint32_t n, uint32_t tokens, int *codes);
KVD_EXPORT int kvd_seqs_pin(kvd_seq *const *seqs, uint32_t n, int *codes);
KVD_EXPORT int kvd_seqs_unpin(kvd_seq *const *seqs, uint32_t n, int *codes);

/*
 * Drops the last n positions of the sequence: what a speculative decoder does with the draft
 * tokens it rejected. Every table keeps its slots of the positions before
 * next_position - n (a table that lost some of those to eviction keeps fewer), the blocks
 * left without a slot go back to the pool, and the next grow gives positions from
 * next_position - n on. The tables change in one generation step; a truncate of a pinned
 * sequence is the caller's own change and keeps its pin. A round scored before the
 * truncate leaves the sequence as it is (docs/engines.md, "Rollback"); kept tokens of the
 * dropped positions are forgotten. Blocks until the daemon applied it.
 * Returns 0, or -EINVAL (n is 0 or more than next_position), -EBUSY (s is moved out of the
 * pool or being recalled into: pin it first), -EAGAIN (the event of its last
 * kvd_seq_unpin_after has not completed), -EOPNOTSUPP (a daemon older than KVD_1.9),
 * -ENOENT, -ECONNRESET, -ECHILD, -ESTALE.
 * Since KVD_1.9.
 */
KVD_EXPORT int kvd_seq_truncate(kvd_seq *s, uint32_t n);

/*
 * Releases the sequence: its blocks go back to the daemon, chunks that became empty are
 * unmapped here, and the handle is freed. Accepts NULL (returns 0). Returns 0, or
 * -ECONNRESET / -ECHILD (the handle is freed all the same).
 */
KVD_EXPORT int kvd_seq_release(kvd_seq *s);

/*
 * After kvd_client_reconnect(), takes back a sequence of the lost connection that the
 * daemon kept across its restart (kvd.8, "KEEPING KV ACROSS A RESTART"): a daemon that died
 * and was started again by a service manager with a file descriptor store keeps the
 * sequences of models without eviction, with their K/V, for its restore-claim time. model_id
 * is a model registered on the new connection with the sequence's shape (the same
 * kvd_model_spec). On success s is usable again, with the same id, tokens, positions and
 * K/V; its descriptor is a new mapping (kvd_seq_descriptor() changes), and so are its chunks:
 * pointers from before the reconnect must be looked up again. No other thread may use s
 * during the call. Returns 0 (also when s is not stale: nothing to claim), or -ENOENT (the
 * daemon kept nothing of it: it came back empty, the claim time passed, or another process
 * claimed it), -EINVAL (no such model, or not the sequence's shape), -EOPNOTSUPP (a
 * sequence with eviction: never kept), -EMFILE (too many sequences on this connection),
 * -EXDEV (its K/V are on another of the daemon's GPUs than this connection's: connect with
 * that GPU's context current), -ENOMEM, -ECONNRESET, -ECHILD. On failure s stays stale:
 * kvd_seq_release() frees it.
 * Since KVD_1.2.
 */
KVD_EXPORT int kvd_seq_claim(kvd_seq *s, int model_id);

/*
 * Pins the sequence around a step that reads its KV: while pinned, the daemon does not
 * rewrite it (an eviction plan waits). kvd_seq_unpin applies a waiting plan before it
 * returns. Pins nest (up to 255). Both return 0, or -ENOENT (released), -EBUSY (nesting
 * limit), -EINVAL (unpin without pin), -ECONNRESET, -ECHILD.
 *
 * On a GPU pool (KVD_MEMORY_CUDA) the daemon reads and moves an unpinned sequence's K/V
 * with its own device copies, which are complete when the call that reports them returns
 * (kvd_seq_unpin, or the rewrite kvd_seq_pin sees). The engine's side of the order is its
 * own: the work it enqueued on the sequence's K/V must have completed before kvd_seq_unpin
 * (synchronise the stream, or wait for an event recorded after that work).
 * Since KVD_1.1.
 */
KVD_EXPORT int kvd_seq_pin(kvd_seq *s);
KVD_EXPORT int kvd_seq_unpin(kvd_seq *s);

/*
 * kvd_seq_pin, saying in *ret_recall (may be NULL) what the pin found: KVD_RECALL_NONE, the
 * sequence was in the pool; KVD_RECALL_HOST, the daemon had moved it to its host tier
 * (its tenant's tier is host: kvd.conf(5)) and brought it back, every K/V byte, token count
 * and position as they were, in new blocks (the pin took longer; re-read the tables);
 * KVD_RECALL_FILE, the same from the file tier (tier host+file); or KVD_RECALL_LOST, it had been moved out and could not come back (the tier was full and
 * dropped it, a block failed its checksum, or no memory came for it within grant-wait):
 * or reading the file tier failed): every table is empty, as if evicted whole, and the
 * engine prefills it again (releasing it and opening a new one is simplest: next_position
 * went on). A recall or loss is told
 * once, at the first pin after it, even when a kvd_seq_grow brought the sequence back
 * first. With a daemon that predates tiers, always KVD_RECALL_NONE. kvd_seq_pin does all
 * the same without telling. Returns what kvd_seq_pin returns, which since KVD_1.7 also
 * includes, for a recall, -ETIMEDOUT (the connection did not unmap a chunk in time: no new
 * chunk until it does) and -ENOMEM. Since KVD_1.7.
 */
KVD_EXPORT int kvd_seq_pin_recall(kvd_seq *s, int *ret_recall);

/*
 * Token recall (docs/recall.md; the tenant's recall setting on, KVD_TENANT_SET_RECALL):
 * after publishing the window of a new question (kvd_seq_observe), asks the daemon for the
 * tokens its rounds evicted from s and kept that this window needs most. Each comes back
 * in place of a resident token worth less, at its original position in position order, in
 * the same blocks: token counts and blocks do not change, positions and K/V of the slots
 * traded do (one generation step and a KVD_EVENT_SEQ_CHANGED, as after a round: re-read
 * the tables after pinning). Call it between steps, unpinned. Blocks until the trade is
 * done; *ret_tokens (may be NULL) gets the token slots brought back over every table,
 * *ret_bytes (may be NULL) their K/V bytes. Returns 0, or -EOPNOTSUPP (the daemon has no
 * recall, the tenant's recall is 0, or the model was registered without an eviction unit
 * or with compensation), -EBUSY (s is pinned, or too many recalls wait), -EAGAIN (s is
 * moved out of the pool, its engine's last step has not completed, or s was rewritten
 * while its recall was scored: ask again), -ENOENT, -ECONNRESET, -ECHILD, -ESTALE.
 * Since KVD_1.8.
 */
KVD_EXPORT int kvd_seq_recall(kvd_seq *s, uint64_t *ret_tokens, uint64_t *ret_bytes);

/*
 * kvd_seq_unpin without waiting for the GPU first: cuda_event, a CUevent of this process
 * created with CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING on the connection's GPU and
 * recorded on the engine's stream after the step's work on the sequence's K/V, tells the
 * daemon when that work is done, and the daemon waits for it before it reads or moves
 * those K/V (rounds, compaction, digests). Call it with the context that made the event
 * current. The event is registered with the daemon at its first use, known by its IPC
 * handle (cuIpcGetEventHandle, asked at every call), and stays registered for the
 * connection's life (a reconnect registers it again); a new event is registered anew, even
 * at a destroyed one's address. An event the daemon cannot take (16 registered on this
 * connection already, not interprocess, a GPU without interprocess events, a daemon that
 * cannot open it: engine and daemon in containers that do not share /dev/shm, where the
 * driver keeps events' shared memory; a daemon or libkvd without them) is waited for here
 * instead, and the call returns 1 after unpinning; after the daemon refused one, the
 * connection's later events are waited for here without asking it again.
 * With a host pool, or cuda_event NULL, this is kvd_seq_unpin. The engine's work must be
 * done before kvd_seq_release too (the daemon frees the blocks at once). Returns 0, 1, what
 * kvd_seq_unpin returns, or -errno from the driver's wait. Since KVD_1.3.
 */
KVD_EXPORT int kvd_seq_unpin_after(kvd_seq *s, void *cuda_event);

/*
 * The observation window of `layer` in this process: *ret_q receives the address of
 * q[q_heads][window][head_dim] (model dtype) to write the last `window` post-RoPE queries
 * of the layer into, oldest first; it also withdraws the layer's published window, so that
 * a round never reads one half written: call it before every rewrite. kvd_seq_observe then
 * publishes them as the window that ends at the sequence's current last position. Both
 * return 0, or -EINVAL (layer out of range; kvd_seq_observe: the sequence is empty),
 * -EOPNOTSUPP (the model has no eviction), -ECHILD. No system call.
 * Since KVD_1.1.
 */
KVD_EXPORT int kvd_seq_observation(kvd_seq *s, uint32_t layer, void **ret_q);
KVD_EXPORT int kvd_seq_observe(kvd_seq *s, uint32_t layer);

/*
 * Address, in this process, of the moments block of (layer, kv_head) (see struct
 * kvd_moments_header): read it while the sequence is pinned. Returns 0, or -EOPNOTSUPP (the
 * model has no moments), -ENODATA (not allocated yet: the sequence was never grown),
 * -EINVAL (out of range, or its chunk not mapped here), -ESTALE, -ECHILD.
 * Since KVD_1.2.
 */
KVD_EXPORT int kvd_seq_moments(const kvd_seq *s, uint32_t layer, uint32_t kv_head,
		               const struct kvd_moments_header **ret);

/*
 * The index queries of `layer`'s observation window (models with an indexer): *ret_iq
 * receives the address of iq[window][index_heads][index_dim] (model dtype) to write the
 * index queries of the same `window` queries as kvd_seq_observation's, oldest first. Like
 * kvd_seq_observation it withdraws the layer's window, and kvd_seq_observe publishes both.
 * Returns 0, or -EINVAL (layer out of range), -EOPNOTSUPP (no eviction, or no indexer),
 * -ESTALE, -ECHILD. No system call. Since KVD_1.2.
 */
KVD_EXPORT int kvd_seq_index_observation(kvd_seq *s, uint32_t layer, void **ret_iq);

/*
 * Address, in this process, of the index key (index_dim elements of the model's dtype) of
 * resident slot `slot` of (layer, kv_head), for the engine to write with the slot's K/V.
 * Returns 0, or -EOPNOTSUPP (no indexer), -EINVAL (out of range, slot not resident, or its
 * chunk not mapped here), -ESTALE, -ECHILD. Since KVD_1.2.
 */
KVD_EXPORT int kvd_seq_index_key(const kvd_seq *s, uint32_t layer, uint32_t kv_head, uint32_t slot,
		                 void **ret);

/*
 * Address, in this process, of the latent block of (layer, kv_head) (see struct
 * kvd_latent_header): read it while the sequence is pinned. Returns 0, or -EOPNOTSUPP (the
 * model has no latent memory), -ENODATA (not allocated yet: the sequence was never grown),
 * -EINVAL (out of range, or its chunk not mapped here), -ESTALE, -ECHILD. Since KVD_1.2.
 */
KVD_EXPORT int kvd_seq_latent(const kvd_seq *s, uint32_t layer, uint32_t kv_head,
		              const struct kvd_latent_header **ret);

/* The sequence's daemon-wide id; 0 after fork. */
KVD_EXPORT uint64_t kvd_seq_id(const kvd_seq *s);

/* The descriptor as mapped in this process (read-only); see the top of this file. Read its
 * counts and arrays here and its geometry from kvd_seq_header(): a daemon older than this
 * library wrote a shorter header, and what follows it is not header. NULL after fork, since
 * the child does not have the mapping. */
KVD_EXPORT const struct kvd_seq_desc *kvd_seq_descriptor(const kvd_seq *s);

/* The descriptor's header as libkvd checked it when the sequence opened: the fields the
 * daemon wrote, every later one 0, and header_bytes the size the daemon wrote (kvd-abi.h,
 * "How the shared headers grow"). Its geometry never changes; its counts (generation,
 * next_position, moments_blocks) are the ones of that moment: read those from
 * kvd_seq_descriptor(). Valid as long as s; NULL after fork. Since KVD_1.4. */
KVD_EXPORT const struct kvd_seq_desc *kvd_seq_header(const kvd_seq *s);

/* Resident tokens of (layer, kv_head), or -EINVAL when either is out of range, -ECHILD. */
KVD_EXPORT int64_t kvd_seq_tokens(const kvd_seq *s, uint32_t layer, uint32_t kv_head);

/* Original position of resident slot `slot` of (layer, kv_head), or -EINVAL, -ECHILD. */
KVD_EXPORT int64_t kvd_seq_position(const kvd_seq *s, uint32_t layer, uint32_t kv_head,
		                    uint32_t slot);

/*
 * Addresses, in this process, of the K row and the V row (head_dim elements each) of
 * resident slot `slot` of (layer, kv_head). Either output may be NULL. Returns 0, or
 * -EINVAL (out of range, slot not resident, or its chunk not mapped here), -ECHILD.
 */
KVD_EXPORT int kvd_seq_kv(const kvd_seq *s, uint32_t layer, uint32_t kv_head, uint32_t slot,
		          void **ret_k, void **ret_v);

/*
 * Address, in this process, of block `index` of table `table` (see the descriptor), for
 * engines that work block by block. Only blocks that hold resident slots count. Returns 0,
 * or -EINVAL (out of range, or its chunk not mapped here), -ECHILD.
 */
KVD_EXPORT int kvd_seq_block(const kvd_seq *s, uint32_t table, uint32_t index, void **ret);

/*
 * Paged block tables, for attention kernels that take one base address per cache, int32
 * block indices with a uniform stride, and the tokens per sequence (vLLM's and
 * FlashInfer's paged attention). A tenant's connection maps every chunk in one address
 * range, chunk id i at base + i * kvd_client_chunk_bytes() (host pools since KVD_1.5, GPU
 * pools always), so a model whose block stride divides the chunk size has its blocks at
 * base + b * stride, b = chunk id * (chunk bytes / stride) + index in the chunk. The stride
 * is the block's bytes rounded up to 64; docs/engines.md says how to pick block_tokens or
 * the daemon's --chunk-size so that it divides the chunk size.
 *
 * kvd_model_block_pool: for model_id, the base (in this process; a device pointer with
 * KVD_MEMORY_CUDA), the stride in bytes, and the number of block indices the range holds in
 * *ret_blocks (may be NULL). Only the blocks of this connection's sequences are memory:
 * the rest of the range faults (a GPU kernel gets an illegal address). The base stays
 * until the client is freed or reconnects. Returns 0, or -EINVAL (unknown model, NULL
 * output), -EOPNOTSUPP (the stride does not divide the chunk size; or the connection has no
 * range: an administrative one, a daemon that does not say its pool's size, or address
 * space this process could not reserve), -EOVERFLOW (more blocks than an int32 holds),
 * -ECHILD. Since KVD_1.5.
 *
 * kvd_seq_block_table: fills the caller's buffers for (layer, kv_head) (kv_head 0 with
 * KVD_LAYOUT_PER_LAYER) without allocating: blocks[i] the index of the block that holds
 * slots i * block_tokens onwards, for the ceil(n / block_tokens) blocks with resident
 * slots, and, when positions is not NULL, positions[j] the original position of slot j
 * for the n resident slots (slot j's position is j until an eviction compacts the table).
 * Returns n, the resident tokens, with the descriptor's generation in *ret_generation (may
 * be NULL). The table holds until the sequence changes: this process's next grow or
 * release of it and, for a model with eviction, a round while it is not pinned (the
 * generation changes and a KVD_EVENT_SEQ_CHANGED event follows): pin around the step that
 * uses it. Returns -EINVAL (out of range, NULL buffer with a size), -ENOBUFS (max_blocks
 * or max_positions too small: kvd_seq_tokens says how many are needed), -EOPNOTSUPP (as
 * kvd_model_block_pool), -EFAULT (a block's chunk is not mapped at its place), -EAGAIN (the
 * daemon kept rewriting the descriptor: pin the sequence), -EPROTO, -ESTALE, -ECHILD.
 * Since KVD_1.5.
 */
KVD_EXPORT int kvd_model_block_pool(kvd_client *c, int model_id, void **ret_base,
                                    uint64_t *ret_stride, uint32_t *ret_blocks);
KVD_EXPORT int kvd_seq_block_table(kvd_seq *s, uint32_t layer, uint32_t kv_head, int32_t *blocks,
                                   uint32_t max_blocks, uint32_t *positions,
                                   uint32_t max_positions, uint64_t *ret_generation);

/*
 * The block tables of a batch, in one call: for each of layers layers from first_layer
 * (kv_head as kvd_seq_block_table's) and each of the n sequences (tables of one client's
 * connection, whose blocks share one range), row (l, i) of tables, [layers][n][width] int32,
 * gets kvd_seq_block_table's blocks of seqs[i] for layer first_layer + l, then zeros, and
 * seq_lens[l * n + i] its resident tokens (tables of a layer may differ after evictions).
 * What a decode step hands a paged-attention kernel for every layer. Returns the most
 * blocks a row holds, or -EINVAL (NULL arrays, n, layers or width 0), -ENOBUFS (a row needs
 * more than width blocks; tables and seq_lens are then partly written), and the errors of
 * kvd_seq_block_table. Pin the sequences around the step that uses the tables.
 * Since KVD_1.9.
 */
KVD_EXPORT int kvd_seq_block_tables(kvd_seq *const *seqs, uint32_t n, uint32_t first_layer,
                                    uint32_t layers, uint32_t kv_head, int32_t *tables,
                                    uint32_t width, int32_t *seq_lens);

/*
 * Digest of the sequence's resident K/V, once computed by the daemon through its own
 * mapping and once here through this process's mapping; equal digests mean both sides see
 * the same bytes. Either output may be NULL. The traversal is, for each layer, kv head and
 * resident slot in order, the K row then the V row, hashed with 64-bit FNV-1a over 8-byte
 * words. Returns 0, or -EINVAL (a block's chunk is not mapped here), -EOPNOTSUPP (ret_local
 * when the pool is GPU memory, KVD_MEMORY_CUDA: the daemon's digest copies blocks to the
 * host, this process's does not), -ECONNRESET, -ECHILD.
 */
KVD_EXPORT int kvd_seq_digest(kvd_seq *s, uint64_t *ret_daemon, uint64_t *ret_local);

/*
 * Administrative requests: for root and the daemon's admin group (--admin-group); others
 * get -EPERM.
 * kvd_budget_set: sets the node budget in bytes (at most the pool; below what is in use,
 * the daemon starts an eviction round at once that frees down to its low watermark).
 * kvd_tenant_set: creates or changes a tenant's guaranteed minimum, cap and weight (1..10000);
 * pass KVD_TENANT_KEEP (bytes) or 0 (weight) to leave a value unchanged, and
 * KVD_TENANT_NO_CAP as max_bytes to lift the cap. A new tenant starts with min 0, no cap
 * and weight 1. The min may not exceed the max nor the pool.
 * Both are live changes (see below). Return 0; 1 when the daemon applied the change but
 * could not save it, so that it will not survive a restart (kvd_client_last_error() says
 * why); or -EINVAL (out of range, bad name), -EPERM (not root nor in the admin group),
 * -EUSERS (too many tenants), -ENOMEM, -ECONNRESET, -ECHILD.
 */
KVD_EXPORT int kvd_budget_set(kvd_client *c, uint64_t bytes);

/*
 * Makes the daemon read its config file again and apply it, as SIGHUP does, and says
 * whether that worked (what a service manager's reload needs: `kvdctl reload`). Returns 0,
 * or -EINVAL (errors in the file: the running settings stay; kvd_client_last_error() has
 * them, the count and file first, then the errors a line each), -EPERM (not an
 * administrative connection with the rights), -EOPNOTSUPP (a daemon older than KVD_1.10),
 * -ENOMEM, -ECONNRESET, -ECHILD. Since KVD_1.10.
 */
KVD_EXPORT int kvd_reload(kvd_client *c);
KVD_EXPORT int kvd_tenant_set(kvd_client *c, const char *tenant, uint64_t min_bytes,
		              uint64_t max_bytes, uint32_t weight);

/*
 * kvd_tenant_set with parameters (see "Parameter structs"): the fields p->set names, which
 * may also be the tenant's eviction policy, a live change like the others (kvd_tenant_reset
 * drops it). A tenant created here starts from the defaults for the fields not set. Returns
 * what kvd_tenant_set returns, and -EINVAL also for an unknown policy, unknown bits in set or
 * reserved not 0; -EOPNOTSUPP (a policy, and a daemon that predates live policies); -E2BIG.
 * Since KVD_1.4.
 */
KVD_EXPORT int kvd_tenant_set_params(kvd_client *c, const char *tenant,
		                     const kvd_tenant_params *p);

/*
 * kvd_budget_set with parameters (see "Parameter structs"): the budget in bytes or as a
 * percent of the pool. The daemon refuses a budget below its floor, the tenants' guaranteed
 * minimums together and at least one chunk, with -ERANGE unless p->flags has
 * KVD_BUDGET_FORCE. Returns what kvd_budget_set returns, and -ERANGE, -E2BIG; -EINVAL also
 * for unknown flags, a percent above 100 or reserved not 0.
 * Since KVD_1.6.
 */
KVD_EXPORT int kvd_budget_set_params(kvd_client *c, const kvd_budget_params *p);


/*
 * Live settings are kept across daemon restarts (in the daemon's state directory) and win
 * over the config file until reset.
 * kvd_budget_reset: the budget goes back to the daemon's --budget, the config file's value,
 * or the pool size.
 * kvd_tenant_reset: the tenant's min, max, weight, policy, tier and recall go back to the
 * config file's (or the defaults); the tenant stays known.
 * Return 0; 1 as for kvd_budget_set; or -ENOENT (kvd_tenant_reset: unknown tenant),
 * -EINVAL, -ECONNRESET, -ECHILD.
 */
KVD_EXPORT int kvd_budget_reset(kvd_client *c);
KVD_EXPORT int kvd_tenant_reset(kvd_client *c, const char *tenant);

/*
 * Forgets a tenant now, as the daemon does by itself once a tenant has held nothing for its
 * tenant-forget time (kvd(8)): the tenant leaves the table (making room under max-tenants),
 * with its live values and the memory of its free chunks. Administrators only. Returns 0;
 * 1 as for kvd_budget_set; or -ENOENT (unknown tenant), -EBUSY (it holds a connection, a
 * sequence or a chunk, or the config file declares it), -EPERM, -EINVAL, -ECONNRESET,
 * -ECHILD. Since KVD_1.4.
 */
KVD_EXPORT int kvd_tenant_delete(kvd_client *c, const char *tenant);

/*
 * A snapshot of the daemon's state. Values are read by name, so that new ones never break
 * old programs:
 *   node:   "pool_bytes", "budget_bytes", "used_bytes" (chunk bytes held by tenants),
 *           "block_bytes" (bytes inside granted blocks), "chunk_bytes" (one chunk),
 *           "chunks_total", "chunks_free", "chunks_draining", "connections",
 *           "protocol_version", "uptime_ms", "grants_refused", "protocol_errors",
 *           "access_refused" (hellos and admin requests refused for want of rights),
 *           "uid_connections_refused" (connections over kvd's max-connections-per-uid),
 *           "rounds_total" (eviction rounds run), "last_round_us" (the last one's duration),
 *           "gpu_scored_layers" (layers rounds scored on a GPU), "gpu_fallbacks" (layers
 *           meant for a GPU that the CPU scored after a device error; since KVD_1.10),
 *           "unmap_timeouts" (connections that did not unmap a chunk within kvd's
 *           unmap-timeout), "unmap_disconnects" (those disconnected for it),
 *           "engine_events_done" (waits for engines' events, kvd_seq_unpin_after),
 *           "sequences" (open on the node), "sequences_max" (their bound),
 *           "metadata_bytes" (what their metadata may take of the daemon's memory),
 *           "metadata_max_bytes" (its bound), the host tier (kvd(8), TIERS; since
 *           KVD_1.7): "host_tier_bytes" (its size), "host_tier_used_bytes",
 *           "host_tier_sequences" (what it holds), "host_tier_moves" (sequences being
 *           moved to or from it now), "tier_offloads", "tier_offload_bytes",
 *           "tier_offload_us", "tier_recalls", "tier_recall_bytes", "tier_recall_us"
 *           (sequences moved out and back, their bytes and time), "tier_lost_full",
 *           "tier_lost_corrupt", "tier_lost_no_memory" (sequences lost from it, by cause),
 *           the file tier: "file_tier_bytes", "file_tier_used_bytes",
 *           "file_tier_sequences", "tier_demotes", "tier_demote_bytes", "tier_demote_us"
 *           (moved to it from a full host tier), "tier_file_recalls",
 *           "tier_file_recall_bytes", "tier_file_recall_us" (of which waiting for the
 *           file's reads: "tier_file_read_us"), "tier_lost_io" (lost to its
 *           I/O failing),
 *           "refused_LIMIT" for each limit the daemon counts refusals at (LIMIT one of
 *           "connections", "connections_per_uid", "tenants", "tenants_per_uid", "models",
 *           "models_per_tenant", "seqs", "seqs_per_tenant", "seqs_node", "metadata",
 *           "seq_tokens", "descriptor",
 *           "frame", "send_queue", "outstanding", "observation", "uploads",
 *           "evict_requests", "evict_rate", "grant_waiters", "ring_completions", "unmap_timeout",
 *           "pinned", "ring_doorbell";
 *           kvd_status_refusal() lists them all);
 *           strings "daemon_version", "backend", "budget_source": where the budget
 *           comes from, "default", "config", "flag" (kvd --budget) or "live" (set with
 *           kvdctl, kept in the state file), "state_error": why live changes cannot
 *           be saved (present only while they cannot), and "warnings": the daemon's
 *           standing warnings about its settings, one per line (present only while there
 *           are some; see kvd(8), WARNINGS), and "devices": the pooled GPUs, one per line,
 *           "GPU <n> <uuid> <pci bus id> <key>=<value>..." (on GPU pools only; kvd(8), GPU),
 *           and "last_reload_error": the first line of the last config reload's errors
 *           ("" when it worked; since KVD_1.10);
 *   tenant: "used_bytes", "block_bytes", "min_bytes", "max_bytes" (UINT64_MAX: no cap),
 *           "weight", "sequences", "connections", "chunks", "evicted_bytes" (block bytes
 *           evicted from it), "evicted_tokens" (token slots, summed over tables),
 *           "rounds" (rounds that evicted from it), "grants", "grants_refused" (chunk
 *           grants to it and refused to it), "grants_waited" (its grows that waited for an
 *           eviction round), "tier_bytes", "tier_file_bytes", "tier_sequences" (what
 *           the host and file tiers hold of it), "tier_lost" (its sequences lost from
 *           them), "tier_degraded" (1: the file tier failed it, it drops until its tier is
 *           set again); strings "min_source", "max_source", "weight_source" ("default",
 *           "config" or "live"), "policy", "policy_source", "tier" ("drop", "host" or
 *           "host+file"), "tier_source".
 * kvd_status_get returns 0, or -ENOMEM, -ECONNRESET, -ECHILD. The getters return 0, or
 * -ENOENT (no such value), -EINVAL (index out of range). Strings live as long as the status.
 */
typedef struct kvd_status kvd_status;

KVD_EXPORT int kvd_status_get(kvd_client *c, kvd_status **ret);
KVD_EXPORT kvd_status *kvd_status_free(kvd_status *st);
KVD_EXPORT int kvd_status_u64(const kvd_status *st, const char *key, uint64_t *ret);
KVD_EXPORT int kvd_status_str(const kvd_status *st, const char *key, const char **ret);
KVD_EXPORT uint32_t kvd_status_tenants(const kvd_status *st);
KVD_EXPORT int kvd_status_tenant_name(const kvd_status *st, uint32_t index, const char **ret);
KVD_EXPORT int kvd_status_tenant_u64(const kvd_status *st, uint32_t index, const char *key,
		                     uint64_t *ret);
KVD_EXPORT int kvd_status_tenant_str(const kvd_status *st, uint32_t index, const char *key,
		                     const char **ret);
/* The refusal counters by limit, in the daemon's order: their number, and the name and value
 * of one (either output may be NULL; -EINVAL when index is out of range). Since KVD_1.1. */
KVD_EXPORT uint32_t kvd_status_refusals(const kvd_status *st);
KVD_EXPORT int kvd_status_refusal(const kvd_status *st, uint32_t index, const char **ret_name,
		                  uint64_t *ret_value);

/*
 * Runs an eviction round now and waits for it: frees `bytes` (0: down to the daemon's low
 * watermark) from `tenant` (NULL: ranked across all tenants). An administrative connection
 * may name any tenant; a tenant's connection only its own. *ret_freed (may be NULL)
 * receives the chunk bytes the round gave back. The call holds the client's lock until the
 * round is done, so other calls on the same client wait for it. Returns 0, or -EINVAL (bad
 * tenant name), -EPERM, -ENOENT (unknown tenant), -EBUSY (too many rounds waiting, or
 * max-outstanding on this connection), or the
 * round's error, -ECONNRESET, -ECHILD.
 * Since KVD_1.1.
 */
KVD_EXPORT int kvd_evict(kvd_client *c, const char *tenant, uint64_t bytes, uint64_t *ret_freed);

/*
 * The daemon's recent eviction rounds, oldest first. Values by name, like kvd_status:
 *   u64: "id", "start_ms", "duration_us", "score_us", "select_us", "compact_us",
 *        "target_bytes", "freed_bytes" (chunk bytes given back), "sequences", "units",
 *        "planned_bytes" (block bytes the round selected), "waiting_bytes" (of those, what
 *        waits for pinned sequences' unpin), "dropped_bytes" (what was dropped: sequences
 *        released or rewritten meanwhile);
 *   double: "predicted_error";  str: "trigger", "error" (only when the round failed),
 *        "note" (only when it gave no chunk back: why);
 *   per tenant (kvd_evictions_tenant): name, and the block bytes and token slots evicted
 *   from it: what was applied, by the round or at a later unpin, not what it planned
 *   (planned = the tenants' bytes + waiting + dropped).
 */
typedef struct kvd_evictions kvd_evictions;

/* kvd_evictions_get returns 0, or -ENOMEM, -ECONNRESET, -ECHILD; the getters return 0, or
 * -ENOENT (no such value), -EINVAL (index out of range); kvd_evictions_tenant's outputs
 * may be NULL. Since KVD_1.1. */
KVD_EXPORT int kvd_evictions_get(kvd_client *c, kvd_evictions **ret);
KVD_EXPORT kvd_evictions *kvd_evictions_free(kvd_evictions *e);
KVD_EXPORT uint32_t kvd_evictions_count(const kvd_evictions *e);
KVD_EXPORT int kvd_evictions_u64(const kvd_evictions *e, uint32_t round, const char *key,
		                 uint64_t *ret);
KVD_EXPORT int kvd_evictions_double(const kvd_evictions *e, uint32_t round, const char *key,
		                    double *ret);
KVD_EXPORT int kvd_evictions_str(const kvd_evictions *e, uint32_t round, const char *key,
		                 const char **ret);
KVD_EXPORT uint32_t kvd_evictions_tenants(const kvd_evictions *e, uint32_t round);
KVD_EXPORT int kvd_evictions_tenant(const kvd_evictions *e, uint32_t round, uint32_t index,
		                    const char **ret_name, uint64_t *ret_freed_bytes,
		                    uint64_t *ret_evicted_tokens);
/* A tenant's value of a round by name: "predicted_error" (plans only, see below): -ENOENT
 * when absent. Since KVD_1.6. */
KVD_EXPORT int kvd_evictions_tenant_double(const kvd_evictions *e, uint32_t round,
		                           uint32_t index, const char *key, double *ret);

/*
 * Dry runs: what a change would evict, without making it. The daemon plans the round the
 * change would start now (kvd_budget_set_params: a budget below use; kvd_tenant_set_params:
 * a cap below what the tenant holds; kvd_evict), scoring and selecting as that round would,
 * and applies nothing. *ret gets it as a kvd_evictions of one round (see kvd_evictions_get)
 * with no "id": "target_bytes", "planned_bytes", "sequences", "units", "predicted_error",
 * "trigger", "note" (when it would take nothing: why), and per tenant (kvd_evictions_tenant)
 * the block bytes and token slots it would take, and its predicted cost
 * (kvd_evictions_tenant_double, "predicted_error"). A change that evicts nothing gives a
 * round with target 0. Made right after, with nothing else changing in between, the change
 * takes what the plan says. The rights are those of the change; the errors are the change's
 * (a budget below the floor without KVD_BUDGET_FORCE is -ERANGE here too) and -EBUSY (too
 * many rounds waiting).
 * Since KVD_1.6.
 */
KVD_EXPORT int kvd_budget_plan(kvd_client *c, const kvd_budget_params *p, kvd_evictions **ret);
KVD_EXPORT int kvd_tenant_plan(kvd_client *c, const char *tenant, const kvd_tenant_params *p,
		               kvd_evictions **ret);
KVD_EXPORT int kvd_evict_plan(kvd_client *c, const char *tenant, uint64_t bytes,
		              kvd_evictions **ret);

/*
 * Who holds what on the node, as rows whose values are read by name (a kvd_table):
 * kvd_connections_get: a row per connection that said hello, in id order: u64 "id", "pid",
 *   "uid", "age_ms", "sequences", "pinned" (sequences pinned now), "bytes" (block bytes of
 *   its sequences' resident tokens), "outstanding" (replies it waits for), "ring" (1: its
 *   per-step requests use the rings), "device" (the GPU ordinal of its chunks; tenant
 *   connections), "departed" (1: a departed holder, a connection that closed while its
 *   process lives on and maps chunks it never said it unmapped, charged to its tenant;
 *   such a row has "id", "pid", "age_ms" since it closed, "chunks" and "tenant", and
 *   kvd_disconnect of its id ends that charge); str "tenant" (absent: administrative),
 *   "process" (its hello's name).
 * kvd_sequences_get: a row per open sequence (of `tenant` only, unless NULL), in
 *   (connection, id) order: u64 "id", "connection", "tokens" (first table; of a sequence
 *   moved out to a tier, those it holds there, since KVD_1.10),
 *   "max_tokens", "pins", "bytes", "evictable" (1: its model has an eviction unit),
 *   "evicted_tokens", "evicted_bytes", "waiting_bytes" (an eviction plan waiting for its
 *   unpin), "layers", "kv_heads", "head_dim"; str "tenant", "place" (since KVD_1.7:
 *   "pool", "host" or "file" in a tier, "leaving" or "returning" while moving).
 * Root and the daemon's admin group see every tenant; a tenant's connection sees its own
 * tenant's; an administrative connection of anyone else gets -EPERM. The listing is read a
 * page at a time, so it is not one instant's: a connection or sequence may come or go
 * between pages. Return 0, or -EINVAL (bad tenant name), -EPERM, -ENOENT (unknown tenant),
 * -ENOMEM, -ECONNRESET, -ECHILD. The getters return 0, or -ENOENT (no such value in that
 * row), -EINVAL (row out of range); strings live as long as the table.
 * kvd_disconnect: closes connection `connection` (an id from kvd_connections_get): the
 * daemon releases its sequences; chunks its process still maps stay charged to its tenant
 * until the process unmaps them or exits (a departed holder, listed so). Of a departed
 * holder's id, it ends that charge: its chunks come back, each with a new memory object.
 * Administrators may close any connection, a tenant's connection those of its own tenant
 * (not itself). Returns 0, or -ENOENT (no such connection), -EPERM, -EINVAL (itself),
 * -ECONNRESET, -ECHILD.
 * Since KVD_1.6.
 */
typedef struct kvd_table kvd_table;

KVD_EXPORT int kvd_connections_get(kvd_client *c, kvd_table **ret);
KVD_EXPORT int kvd_sequences_get(kvd_client *c, const char *tenant, kvd_table **ret);
KVD_EXPORT kvd_table *kvd_table_free(kvd_table *t);
KVD_EXPORT uint32_t kvd_table_rows(const kvd_table *t);
KVD_EXPORT int kvd_table_u64(const kvd_table *t, uint32_t row, const char *key, uint64_t *ret);
KVD_EXPORT int kvd_table_str(const kvd_table *t, uint32_t row, const char *key, const char **ret);
KVD_EXPORT int kvd_disconnect(kvd_client *c, uint64_t connection);

/*
 * The settings the daemon runs with: a row per key of kvd.conf's [kvd] section, in
 * kvd --help's order, with str "name", "value" (as kvd(8) writes it: "8.0 MiB", "5000 ms",
 * "auto"; a budget given in percent also in bytes) and "source": "default", "flag",
 * "live" (kvdctl budget) or "FILE:LINE". A value a reload could not apply (one that needs
 * a restart) is the running one. Root and the daemon's admin group only. Returns 0, or
 * -EPERM, -EOPNOTSUPP (a daemon older than KVD_1.10), -ENOMEM, -ECONNRESET, -ECHILD.
 * Since KVD_1.10.
 */
KVD_EXPORT int kvd_config_get(kvd_client *c, kvd_table **ret);

/*
 * Chunks currently mapped by this client: *ret_n gets their number; with ids non-NULL, up
 * to n ids are written, in increasing order. Either pointer may be NULL. Returns 0 or
 * -ECHILD.
 */
KVD_EXPORT int kvd_client_mapped_chunks(kvd_client *c, uint32_t *ids, uint32_t n,
		                        uint32_t *ret_n);

/* Cleanup helpers for __attribute__((cleanup)). */
static inline void kvd_client_unrefp(kvd_client **c) {
	if (c && *c)
		kvd_client_unref(*c);
}
static inline void kvd_status_freep(kvd_status **st) {
	if (st && *st)
		kvd_status_free(*st);
}
static inline void kvd_evictions_freep(kvd_evictions **e) {
	if (e && *e)
		kvd_evictions_free(*e);
}
static inline void kvd_table_freep(kvd_table **t) {
	if (t && *t)
		kvd_table_free(*t);
}

#ifdef __cplusplus
}
#endif

#endif
