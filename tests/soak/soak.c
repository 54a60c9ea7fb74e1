/* SPDX-License-Identifier: MIT */
/*
 * kvd-soak: many clients of several tenants do random valid and invalid operations
 * against a running daemon for a set time; then the daemon must be back where it started
 * (nothing leaked) and every byte read back must have been the one written (nothing
 * corrupted).
 *
 * Processes. The parent forks a supervisor before it opens a connection or starts a
 * thread, so that the supervisor and the clients inherit neither. On the parent's go the
 * supervisor forks one client process per slot (tenants x clients) and forks a new one
 * whenever a client ends abruptly on purpose before the deadline (one that fails, say
 * cannot connect or crashes, leaves its slot empty, its failure recorded). The parent
 * meanwhile runs, on administrative connections of its own, a monitor thread that reads
 * status every 50 ms and checks the node's invariants and, with --evict, an admin thread
 * that runs eviction rounds and changes the budget and the tenants' caps now and then.
 * Every process writes its counters and its first failures into a shared mapping, one
 * slot each, so that what a process counted survives its abrupt end.
 *
 * The clients. Each loops until the deadline over weighted random operations: register
 * models (random valid shapes, and invalid ones), open, grow, verify, digest, pin and
 * release sequences, upload output projections, publish observation windows, drain events,
 * read status, ask for eviction rounds, misuse the API (out-of-range lookups, unpin without
 * pin), send invalid frames on a raw socket of its own, cut its connection under the
 * library (shutdown(2) on its socket) or end the process without releasing anything. K and
 * V are written, after every grow, with a pattern of finite numbers that depends on
 * (tenant, daemon sequence id, layer, kv head, original position, byte, K or V), so that a
 * byte read back anywhere else never matches by accident; a verification pins the
 * sequence, checks every resident slot against the pattern of its original position (and,
 * with eviction, that positions ascend and sinks and window were kept) and compares the
 * daemon's digest and the library's with the digest of the pattern.
 *
 * Expected errors. Each call knows what the documentation says it must return: an invalid
 * call (injected) must fail with its documented errno; a valid one must succeed or be
 * refused at a limit (ENOSPC, EDQUOT, EMFILE, EBUSY, EUSERS, E2BIG), which is counted;
 * anything else is an unexpected error, recorded with the call and the daemon's message,
 * and fails the soak. Raw frames count the protocol errors the daemon must add up, which
 * the end compares with its protocol_errors.
 */

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/digest.h"
#include "common/layout.h"
#include "basic/macro.h"
#include "basic/number.h"
#include "basic/size.h"
#include "config.h"
#include "kvd/kvd.h"
#include "wire.h"
#include "basic/time-util.h"
#include "cli.h"

#define SOAK_TENANTS_MAX 16
#define SOAK_CLIENTS_MAX 16
#define SOAK_SLOTS_MAX (SOAK_TENANTS_MAX * SOAK_CLIENTS_MAX)
#define SOAK_DURATION_MAX (7u * 24 * 3600)
/* The monitor's status poll. */
#define MONITOR_NS (UINT64_C(50) * 1000000)
/* Valid models one connection registers (the daemon's default max-models is 16), and
 * sequences one client keeps open. */
#define MODELS_MAX 6
#define SEQS_MAX 8
/* Failure messages kept per slot; the rest are counted. */
#define FAILS_KEPT 4
#define FAIL_BYTES 320
/* How long a raw connection waits for an answer. */
#define RAW_TIMEOUT_MS 5000
/* The exit status of a client that ends abruptly on purpose. */
#define EXIT_ABRUPT 3
/* After the deadline: how long clients may take to finish (verify and release what they
 * hold) before they are killed, and how long the daemon has to become idle. */
#define GRACE_NS (UINT64_C(120) * 1000000000)
#define IDLE_WAIT_MS 10000
/* The daemon's limit of protocol errors per connection (a disconnect follows). */
#define VIOLATIONS_MAX 8

enum op {
	OP_CONNECT,
	OP_REGISTER,
	OP_OUTPUT_PROJ,
	OP_OPEN,
	OP_GROW,
	OP_OBSERVE,
	OP_VERIFY,
	OP_DIGEST,
	OP_PIN,
	OP_LOOKUP,
	OP_RELEASE,
	OP_EVENTS,
	OP_STATUS,
	OP_EVICT,
	OP_RAW,
	OP_CUT,
	OP_EXIT,
	OP_ADMIN_EVICT,
	OP_BUDGET,
	OP_TENANT_CAP,
	OP_MAX,
	OP_INVALID = -EINVAL,
};

static const char *const op_names[OP_MAX] = {
	[OP_CONNECT] = "connect",
	[OP_REGISTER] = "register",
	[OP_OUTPUT_PROJ] = "output_proj",
	[OP_OPEN] = "open",
	[OP_GROW] = "grow",
	[OP_OBSERVE] = "observe",
	[OP_VERIFY] = "verify",
	[OP_DIGEST] = "digest",
	[OP_PIN] = "pin",
	[OP_LOOKUP] = "lookup",
	[OP_RELEASE] = "release",
	[OP_EVENTS] = "events",
	[OP_STATUS] = "status",
	[OP_EVICT] = "evict",
	[OP_RAW] = "raw",
	[OP_CUT] = "cut",
	[OP_EXIT] = "exit",
	[OP_ADMIN_EVICT] = "admin_evict",
	[OP_BUDGET] = "budget",
	[OP_TENANT_CAP] = "tenant_cap",
};

/* The raw frames, each with the answer the daemon documents (tests/integration has them
 * one by one in test-daemon-bad-input.c). */
enum raw {
	RAW_GARBAGE,          /* random bytes read as a length over the cap: -EMSGSIZE, disconnect */
	RAW_OVERSIZE,         /* a frame header over 64 KiB: -EMSGSIZE, disconnect */
	RAW_BEFORE_HELLO,     /* a request before hello: -EPROTO, then hello works */
	RAW_UNDECODABLE,      /* a payload that does not decode: -EBADMSG, the stream goes on */
	RAW_UNKNOWN_BODY,     /* an Envelope member of a newer protocol: -EOPNOTSUPP */
	RAW_UNKNOWN_FIELDS,   /* unknown fields in a known request: ignored, answered */
	RAW_VERSION,          /* hello with no common version: -EPROTONOSUPPORT, disconnect */
	RAW_VIOLATIONS,       /* 8 requests before hello: -EPROTO each, disconnect */
	RAW_NO_ID,            /* a request without an id: -EINVAL */
	RAW_REPLY_AS_REQUEST, /* a reply sent as a request: -EOPNOTSUPP */
	RAW_SECOND_HELLO,     /* -EPROTO */
	RAW_FOREIGN_SEQ,      /* grow/pin/digest/release of another connection's sequence: -ENOENT */
	RAW_FDS,              /* fds attached to a status request: -EBADMSG */
	RAW_TRUNCATED,        /* half a frame, then hang up: nothing */
	RAW_BAD_TENANT,       /* hello with an invalid tenant name: -EINVAL, disconnect */
	RAW_ADMIN_ALLOC,      /* register a model on an administrative connection: -EPERM */
	RAW_MAX,
	RAW_INVALID = -EINVAL,
};

static const char *const raw_names[RAW_MAX] = {
	[RAW_GARBAGE] = "garbage",
	[RAW_OVERSIZE] = "oversize",
	[RAW_BEFORE_HELLO] = "before_hello",
	[RAW_UNDECODABLE] = "undecodable",
	[RAW_UNKNOWN_BODY] = "unknown_body",
	[RAW_UNKNOWN_FIELDS] = "unknown_fields",
	[RAW_VERSION] = "version",
	[RAW_VIOLATIONS] = "violations",
	[RAW_NO_ID] = "no_id",
	[RAW_REPLY_AS_REQUEST] = "reply_as_request",
	[RAW_SECOND_HELLO] = "second_hello",
	[RAW_FOREIGN_SEQ] = "foreign_seq",
	[RAW_FDS] = "fds",
	[RAW_TRUNCATED] = "truncated",
	[RAW_BAD_TENANT] = "bad_tenant",
	[RAW_ADMIN_ALLOC] = "admin_alloc",
};

/* Refusals at a limit that a valid call may meet, by errno. */
enum refusal {
	REFUSAL_ENOSPC,
	REFUSAL_EDQUOT,
	REFUSAL_EMFILE,
	REFUSAL_EBUSY,
	REFUSAL_EUSERS,
	REFUSAL_E2BIG,
	REFUSAL_ENOENT,
	REFUSAL_EAGAIN,
	REFUSAL_EOPNOTSUPP,
	REFUSAL_MAX,
	REFUSAL_INVALID = -EINVAL,
};

static const int refusal_errno[REFUSAL_MAX] = {
	ENOSPC, EDQUOT, EMFILE, EBUSY, EUSERS, E2BIG, ENOENT, EAGAIN, EOPNOTSUPP,
};

#define R_(e) (1u << REFUSAL_##e)

struct op_count {
	uint64_t calls;      /* operations of this kind */
	uint64_t injected;   /* invalid calls answered with the documented error */
	uint64_t refused;    /* valid calls refused at a limit */
	uint64_t unexpected; /* anything else */
};

/* One client slot in the shared mapping; written by one process at a time. */
struct slot {
	struct op_count ops[OP_MAX];
	uint64_t raw[RAW_MAX];
	uint64_t refusals[REFUSAL_MAX];
	uint64_t protocol_errors; /* what the daemon's protocol_errors must have grown by */
	uint64_t frames_refused;  /* and its refused "frame" counter */
	uint64_t bytes_written, bytes_verified, digests, mismatched_bytes, digest_mismatches;
	uint64_t windows, seq_changed, checks_failed;
	uint64_t recalls, lost;   /* pins that brought a sequence back from a tier, or lost it */
	uint64_t file_recalls;    /* of the recalls, from the file tier */
	uint64_t token_recalls, tokens_back; /* kvd_seq_recall answered, token slots it traded */
	uint64_t lives, exits, kills, cuts;
	int kill_intended;
	uint32_t n_fails;
	char fails[FAILS_KEPT][FAIL_BYTES];
	char first_mismatch[FAIL_BYTES];
};

struct shared {
	uint64_t deadline_ns;
	struct slot slots[SOAK_SLOTS_MAX];
};

static const char *arg_socket;
static unsigned arg_duration = 10;
static unsigned arg_tenants = 3;
static unsigned arg_clients = 3;
static uint64_t arg_seed;
static int arg_evict;
static int arg_tiers;
static int arg_json;


static void sleep_ns(uint64_t ns) {
	struct timespec ts = { .tv_sec = (time_t)(ns / 1000000000), .tv_nsec = (long)(ns % 1000000000) };

	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

static const char *errno_name(int r) {
	const char *n;

	if (r >= 0)
		return "success";
	n = strerrorname_np(-r);
	return n ? n : "an unknown errno";
}

static _printf_(2, 3) void fail(struct slot *st, const char *fmt, ...) {
	va_list ap;

	if (st->n_fails < FAILS_KEPT) {
		va_start(ap, fmt);
		vsnprintf(st->fails[st->n_fails], FAIL_BYTES, fmt, ap);
		va_end(ap);
	}
	st->n_fails++;
}

/* ---- Randomness and the pattern ---- */

/* splitmix64's finaliser: every output bit depends on every input bit. */
static inline uint64_t mix64(uint64_t x) {
	x ^= x >> 30;
	x *= UINT64_C(0xbf58476d1ce4e5b9);
	x ^= x >> 27;
	x *= UINT64_C(0x94d049bb133111eb);
	x ^= x >> 31;
	return x;
}

static uint64_t rng_next(uint64_t *s) {
	*s += UINT64_C(0x9e3779b97f4a7c15);
	return mix64(*s);
}

/* Uniform in 0..n-1 (0 for n 0). */
static uint32_t rng_below(uint64_t *s, uint32_t n) {
	return n ? (uint32_t)(rng_next(s) % n) : 0;
}

/* Uniform in lo..hi, both included. */
static uint32_t rng_range(uint64_t *s, uint32_t lo, uint32_t hi) {
	return lo + (uint32_t)(rng_next(s) % ((uint64_t)hi - lo + 1));
}

static bool rng_chance(uint64_t *s, unsigned percent) {
	return rng_below(s, 100) < percent;
}

static uint64_t row_seed(uint32_t tenant, uint64_t seq_id, uint32_t layer, uint32_t head,
			 uint32_t position, int is_v) {
	uint64_t h = mix64(UINT64_C(0x6b76642d736f616b) ^ tenant);

	h = mix64(h ^ seq_id);
	h = mix64(h ^ layer);
	h = mix64(h ^ head);
	h = mix64(h ^ position);
	return mix64(h ^ (uint64_t)is_v);
}

/*
 * A hash word made into finite numbers of the dtype (the daemon computes with K, V and the
 * queries): sign and mantissa bits stay, two hash bits pick an exponent, so every value
 * lies in +-[1/16, 1). The same construction as kvd-bench load's.
 */
static inline uint64_t numeric_word(uint64_t w, uint32_t dtype) {
	switch (dtype) {
	case KVD_DTYPE_F16: /* exponents 11..14 of bias 15 */
		return (w & UINT64_C(0x83ff83ff83ff83ff)) |
		       ((((w >> 10) & UINT64_C(0x0003000300030003)) + 11 * UINT64_C(0x0001000100010001)) << 10);
	case KVD_DTYPE_BF16: /* exponents 123..126 of bias 127 */
		return (w & UINT64_C(0x807f807f807f807f)) |
		       ((((w >> 7) & UINT64_C(0x0003000300030003)) + 123 * UINT64_C(0x0001000100010001)) << 7);
	default: /* f32, the same exponents */
		return (w & UINT64_C(0x807fffff807fffff)) |
		       ((((w >> 23) & UINT64_C(0x0000000300000003)) + 123 * UINT64_C(0x0000000100000001)) << 23);
	}
}

/* n bytes (whole elements) of numbers derived from seed. */
static void pattern_fill(unsigned char *dst, size_t n, uint64_t seed, uint32_t dtype) {
	size_t off;

	for (off = 0; off + 8 <= n; off += 8) {
		uint64_t w = numeric_word(mix64(seed ^ (off * UINT64_C(0x9e3779b97f4a7c15))), dtype);

		memcpy(dst + off, &w, 8);
	}
	if (off < n) {
		uint64_t w = numeric_word(mix64(seed ^ (off * UINT64_C(0x9e3779b97f4a7c15))), dtype);

		memcpy(dst + off, &w, n - off);
	}
}

/* ---- A client ---- */

struct model {
	int id;
	uint32_t layers, q_heads, kv_heads, head_dim, dtype, block_tokens, layout;
	uint32_t unit, window, sinks; /* the effective eviction settings */
};

struct sq {
	kvd_seq *s;
	unsigned model;       /* index into worker.models */
	uint64_t id;          /* the daemon's sequence id */
	uint32_t max_tokens;
	uint32_t grown;       /* positions grown so far, the next one's original position */
	uint64_t generation;  /* without eviction: the descriptor's after our last change */
	bool lost;            /* a pin said KVD_RECALL_LOST: its K/V are gone; left alone */
};

struct worker {
	unsigned slot, tenant;
	char name[32];       /* the tenant's */
	char who[64];        /* for messages: tenant, client, pid */
	uint64_t rng;
	struct slot *st;
	kvd_client *c;
	uint64_t chunk_bytes;
	bool dead;           /* the connection is gone: drop everything, reconnect */
	bool evictable;      /* this tenant registers evictable models (--evict) */
	bool tiers;          /* this tenant's sequences move to the host tier (--tiers) */
	struct model models[MODELS_MAX];
	unsigned n_models;
	struct sq seqs[SEQS_MAX];
	unsigned n_seqs;
	unsigned char *row;  /* scratch for one row */
	struct wire_rx *rx;  /* raw connections */
	unsigned raw_frames; /* frames received on the current raw connection */
	bool raw_refused;    /* which the daemon refused at its connection limit */
	uint64_t deadline;
};

#define ROW_MAX (128 * 4)

static uint32_t model_row_bytes(const struct model *m) {
	return m->head_dim * layout_dtype_bytes(m->dtype);
}

static uint64_t model_block_bytes(const struct model *m) {
	uint64_t b = 2 * (uint64_t)m->block_tokens * model_row_bytes(m);

	return m->layout == KVD_LAYOUT_PER_LAYER ? b * m->kv_heads : b;
}

/*
 * Accounts for the result r of one call of an operation of kind op. With want < 0 the call
 * was invalid and must fail with exactly want; with want == 0 it must succeed (r >= 0) or
 * be refused with one of the errnos in refusable (R_* bits). Returns whether r was allowed;
 * otherwise the call, described by fmt, is recorded as a failure with the daemon's message.
 */
static _printf_(6, 7) bool check(struct worker *w, enum op op, int r, int want, unsigned refusable,
				 const char *fmt, ...) {
	struct op_count *oc = &w->st->ops[op];
	char what[192];
	const char *msg;
	va_list ap;

	if (want < 0 && r == want) {
		oc->injected++;
		return true;
	}
	if (want == 0 && r >= 0)
		return true;
	if (want == 0)
		for (unsigned i = 0; i < REFUSAL_MAX; i++)
			if ((refusable & (1u << i)) && r == -refusal_errno[i]) {
				oc->refused++;
				w->st->refusals[i]++;
				return true;
			}
	oc->unexpected++;
	va_start(ap, fmt);
	vsnprintf(what, sizeof(what), fmt, ap);
	va_end(ap);
	/* The daemon's message, unless the connection is gone (then it is an old one's). */
	msg = w->c && r < 0 && r != -ECONNRESET && r != -EPROTO ? kvd_client_last_error(w->c) : "";
	fail(w->st, "%s: %s: got %s, expected %s%s%s", w->who, what, errno_name(r), errno_name(want),
	     msg && *msg ? "; daemon: " : "", msg && *msg ? msg : "");
	if (r == -ECONNRESET || r == -EPROTO)
		w->dead = true;
	return false;
}

/* A broken invariant (corruption, a wrong descriptor), described by fmt. */
static _printf_(2, 3) void corrupt(struct worker *w, const char *fmt, ...) {
	char what[256];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(what, sizeof(what), fmt, ap);
	va_end(ap);
	w->st->checks_failed++;
	fail(w->st, "%s: %s", w->who, what);
}

static void row_fill(const struct worker *w, const struct sq *q, unsigned char *dst, uint32_t layer,
		     uint32_t head, uint32_t position, int is_v) {
	const struct model *m = &w->models[q->model];

	pattern_fill(dst, model_row_bytes(m), row_seed(w->tenant, q->id, layer, head, position, is_v),
		     m->dtype);
}

/* Reads what the daemon sent; the library gives back the chunks it asks for on the way. */
static void do_events(struct worker *w) {
	kvd_event ev;
	int r;

	while ((r = kvd_client_next_event(w->c, &ev)) > 0) {
		if (ev.type == KVD_EVENT_SEQ_CHANGED)
			w->st->seq_changed++;
		else if (ev.type == KVD_EVENT_STOPPING)
			corrupt(w, "the daemon is stopping (KVD_EVENT_STOPPING) during the soak");
	}
	check(w, OP_EVENTS, r, 0, 0, "kvd_client_next_event");
}

static int do_connect(struct worker *w) {
	int r;

	for (;;) {
		w->st->ops[OP_CONNECT].calls++;
		r = kvd_client_connect(arg_socket, w->name, &w->c);
		if (!check(w, OP_CONNECT, r, 0, R_(EUSERS), "kvd_client_connect(%s, %s)", arg_socket, w->name))
			return r;
		if (r >= 0)
			break;
		if (now_ns() >= w->deadline)
			return r;
		sleep_ns(20 * 1000000);
	}
	w->chunk_bytes = kvd_client_chunk_bytes(w->c);
	w->dead = false;
	return 0;
}

/* Forgets the connection and what it held, releasing the handles (which only frees them
 * when the connection is gone). */
static void drop_all(struct worker *w, bool gone) {
	for (unsigned i = 0; i < w->n_seqs; i++) {
		int r = kvd_seq_release(w->seqs[i].s);

		if (gone) {
			/* 0 when it went without a round trip, -ECONNRESET otherwise. */
			if (r != -ECONNRESET)
				check(w, OP_RELEASE, r, 0, 0, "kvd_seq_release(seq %" PRIu64 ") after the connection was lost",
				      w->seqs[i].id);
		} else
			check(w, OP_RELEASE, r, 0, 0, "kvd_seq_release(seq %" PRIu64 ")", w->seqs[i].id);
	}
	w->n_seqs = 0;
	w->n_models = 0;
	w->c = kvd_client_unref(w->c);
}

static void seq_forget(struct worker *w, unsigned i) {
	w->seqs[i] = w->seqs[--w->n_seqs];
}

/* ---- Models ---- */

static void model_random(struct worker *w, struct model *m, bool evictable) {
	static const uint32_t dims[] = { 8, 16, 32, 64, 128 }, bts[] = { 1, 2, 4, 8, 16, 32, 64 };
	uint64_t *rng = &w->rng;

	*m = (struct model){
		.layers = rng_range(rng, 1, 4),
		.kv_heads = 1u << rng_below(rng, 3),
		.head_dim = dims[rng_below(rng, ELEMENTSOF(dims))],
		.dtype = rng_range(rng, KVD_DTYPE_F16, KVD_DTYPE_F32),
		.block_tokens = bts[rng_below(rng, ELEMENTSOF(bts))],
		.layout = rng_range(rng, KVD_LAYOUT_PER_LAYER, KVD_LAYOUT_PER_HEAD),
		.unit = KVD_UNIT_NONE,
	};
	m->q_heads = m->kv_heads << rng_below(rng, 3);
	if (evictable) {
		m->unit = rng_range(rng, KVD_UNIT_HEAD_TOKEN, KVD_UNIT_BLOCK);
		if (m->unit == KVD_UNIT_HEAD_TOKEN)
			m->layout = KVD_LAYOUT_PER_HEAD;
		/* 0 and KVD_SINKS_DEFAULT ask for the defaults, 32 and 4. */
		m->window = rng_chance(rng, 20) ? 0 : rng_range(rng, 1, 64);
		m->sinks = rng_chance(rng, 20) ? KVD_SINKS_DEFAULT : rng_range(rng, 0, 8);
	}
	while (model_block_bytes(m) > w->chunk_bytes && m->block_tokens > 1)
		m->block_tokens /= 2;
}

static int model_register(struct worker *w, const struct model *m, const kvd_eviction_spec *ev,
			  const char *name) {
	kvd_model_spec spec = {
		.name = name,
		.layers = m->layers,
		.q_heads = m->q_heads,
		.kv_heads = m->kv_heads,
		.head_dim = m->head_dim,
		.dtype = m->dtype,
		.block_tokens = m->block_tokens,
		.layout = m->layout,
	};

	return ev ? kvd_model_register_evictable(w->c, &spec, ev) : kvd_model_register(w->c, &spec);
}

static void op_register_valid(struct worker *w) {
	bool evictable = w->evictable && rng_chance(&w->rng, 75);
	struct model m;
	kvd_eviction_spec ev = {};
	char name[32];
	int r;

	model_random(w, &m, evictable);
	snprintf(name, sizeof(name), "soak-model-%u", rng_below(&w->rng, 1000));
	if (evictable) {
		ev = (kvd_eviction_spec){ .unit = m.unit, .window = m.window, .sinks = m.sinks };
		m.window = m.window ? m.window : 32;
		m.sinks = m.sinks == KVD_SINKS_DEFAULT ? 4 : m.sinks;
	}
	r = model_register(w, &m, evictable ? &ev : NULL, rng_chance(&w->rng, 10) ? NULL : name);
	if (!check(w, OP_REGISTER, r, 0, R_(EMFILE),
		   "kvd_model_register%s(%u,%u,%u,%u, dtype %u, block %u, layout %u, unit %u)",
		   evictable ? "_evictable" : "", m.layers, m.q_heads, m.kv_heads, m.head_dim, m.dtype,
		   m.block_tokens, m.layout, m.unit) ||
	    r < 0)
		return;
	m.id = r;
	w->models[w->n_models++] = m;
}

/* Shapes and eviction settings out of range: kvd.h and kvd.8 give the errno of each. */
static void op_register_invalid(struct worker *w) {
	kvd_eviction_spec ev = { .unit = KVD_UNIT_LAYER_TOKEN, .window = 8, .sinks = 2 };
	unsigned kinds = arg_evict ? 17 : 11, kind = rng_below(&w->rng, kinds);
	char long_name[80];
	const char *name = "soak-invalid";
	struct model m;
	bool use_ev = false;
	int want = -EINVAL, r;

	model_random(w, &m, false);
	switch (kind) {
	case 0: m.layers = 0; break;
	case 1: m.layers = 1025; break;
	case 2: m.kv_heads = 4; m.q_heads = 6; break;
	case 3: m.kv_heads = 0; break;
	case 4: m.head_dim = 4097; break;
	case 5: m.dtype = rng_chance(&w->rng, 50) ? 0 : 77; break;
	case 6: m.layout = rng_chance(&w->rng, 50) ? 0 : 3; break;
	case 7: m.block_tokens = rng_chance(&w->rng, 50) ? 0 : 65537; break;
	case 8: /* a block larger than a chunk */
		m.layout = KVD_LAYOUT_PER_LAYER;
		m.kv_heads = 64;
		m.q_heads = 64;
		m.head_dim = 4096;
		m.dtype = KVD_DTYPE_F32;
		m.block_tokens = 65536;
		break;
	case 9: m.q_heads = 1025; m.kv_heads = 1; break;
	case 10: /* a name over 63 bytes */
		memset(long_name, 'n', sizeof(long_name) - 1);
		long_name[sizeof(long_name) - 1] = '\0';
		name = long_name;
		break;
	case 11: use_ev = true; ev.unit = 7; break;
	case 12: use_ev = true; ev.unit = KVD_UNIT_HEAD_TOKEN; m.layout = KVD_LAYOUT_PER_LAYER; break;
	case 13: use_ev = true; ev.window = 257; break;
	case 14: use_ev = true; ev.sinks = 1025; break;
	case 15: use_ev = true; ev.reserved = 1; break;
	default: /* an observation buffer far over max-observation-bytes */
		use_ev = true;
		m.layers = 1024;
		m.kv_heads = 1;
		m.q_heads = 1024;
		m.head_dim = 4096;
		m.dtype = KVD_DTYPE_F32;
		m.block_tokens = 1;
		ev.window = 256;
		want = -EFBIG;
		break;
	}
	r = model_register(w, &m, use_ev ? &ev : NULL, name);
	check(w, OP_REGISTER, r, want, 0, "kvd_model_register%s, invalid case %u", use_ev ? "_evictable" : "",
	      kind);
	/* Something the daemon took after all: it counts against the connection like any. */
	if (r >= 0 && w->n_models < MODELS_MAX) {
		m.id = r;
		m.unit = use_ev ? ev.unit : KVD_UNIT_NONE;
		w->models[w->n_models++] = m;
	}
}

static void op_register(struct worker *w) {
	if (w->n_models < MODELS_MAX && rng_chance(&w->rng, 75))
		op_register_valid(w);
	else
		op_register_invalid(w);
}

/* A random W_o for one layer, small enough to be cheap: hidden 1..256. */
static void op_output_proj(struct worker *w) {
	const struct model *m = w->n_models ? &w->models[rng_below(&w->rng, w->n_models)] : NULL;
	uint32_t hidden = rng_range(&w->rng, 1, 256), dtype = rng_chance(&w->rng, 50) ? KVD_DTYPE_F32 : KVD_DTYPE_F16;
	uint32_t layer = m ? rng_below(&w->rng, m->layers) : 0, kind = rng_below(&w->rng, 10);
	int model_id = m ? m->id : 1000, want = 0, r;
	_cleanup_(freep) unsigned char *wo = NULL;
	size_t bytes;

	if (!m || kind == 0) {
		model_id = 1000 + (int)rng_below(&w->rng, 1000);
		want = -EINVAL;
	} else if (kind == 1) {
		layer = m->layers;
		want = -EINVAL;
	} else if (kind == 2) {
		hidden = 0;
		want = -EINVAL;
	} else if (kind == 3) {
		dtype = 9;
		want = -EINVAL;
	}
	bytes = (size_t)MAX(hidden, 1u) * (m ? m->q_heads * m->head_dim : 1) * 4;
	wo = malloc(bytes);
	if (!wo) {
		corrupt(w, "out of memory for W_o");
		return;
	}
	pattern_fill(wo, bytes, rng_next(&w->rng), dtype == KVD_DTYPE_F32 ? KVD_DTYPE_F32 : KVD_DTYPE_F16);
	r = kvd_model_output_proj(w->c, model_id, layer, dtype, hidden, wo);
	check(w, OP_OUTPUT_PROJ, r, want, R_(EBUSY), "kvd_model_output_proj(model %d, layer %u, dtype %u, hidden %u)",
	      model_id, layer, dtype, hidden);
}

/* ---- Sequences ---- */

static uint64_t desc_generation(const kvd_seq *s) {
	return __atomic_load_n(&kvd_seq_descriptor(s)->generation, __ATOMIC_ACQUIRE);
}

static void op_open(struct worker *w) {
	unsigned kind = rng_below(&w->rng, 10), mi;
	uint32_t max;
	kvd_seq *s = NULL;
	int r, model_id;

	if (w->n_models == 0 || kind == 0) {
		/* No such model on this connection. */
		model_id = rng_chance(&w->rng, 20) ? -1 : (int)(w->n_models + 1 + rng_below(&w->rng, 100));
		r = kvd_seq_open(w->c, model_id, 16, &s);
		check(w, OP_OPEN, r, -EINVAL, 0, "kvd_seq_open(unknown model %d)", model_id);
		if (r >= 0)
			kvd_seq_release(s);
		return;
	}
	mi = rng_below(&w->rng, w->n_models);
	model_id = w->models[mi].id;
	if (kind == 1) {
		max = rng_chance(&w->rng, 50) ? 0 : UINT32_MAX;
		r = kvd_seq_open(w->c, model_id, max, &s);
		check(w, OP_OPEN, r, -EINVAL, 0, "kvd_seq_open(model %d, max_tokens %u)", model_id, max);
		if (r >= 0)
			kvd_seq_release(s);
		return;
	}
	if (w->n_seqs == SEQS_MAX)
		return;
	kind = rng_below(&w->rng, 10);
	max = kind < 5 ? rng_range(&w->rng, 1, 512) : kind < 8 ? rng_range(&w->rng, 513, 4096)
		: rng_range(&w->rng, 4097, 65536);
	r = kvd_seq_open(w->c, model_id, max, &s);
	if (!check(w, OP_OPEN, r, 0, R_(EMFILE), "kvd_seq_open(model %d, max_tokens %u)", model_id, max) || r < 0)
		return;
	w->seqs[w->n_seqs++] = (struct sq){
		.s = s,
		.model = mi,
		.id = kvd_seq_id(s),
		.max_tokens = max,
		.generation = desc_generation(s),
	};
}

/*
 * Writes the pattern into the rows of positions p0 .. p0+n-1 that the last grow added: the
 * n newest slots of every (layer, kv head). Without eviction the table holds exactly p0 + n
 * slots; with it fewer of the older ones may be left. The sequence is pinned when its
 * model has eviction, so nothing moves meanwhile.
 */
static void seq_write(struct worker *w, struct sq *q, uint32_t p0, uint32_t n) {
	const struct model *m = &w->models[q->model];

	for (uint32_t l = 0; l < m->layers; l++)
		for (uint32_t h = 0; h < m->kv_heads; h++) {
			int64_t have = kvd_seq_tokens(q->s, l, h);

			if (!check(w, OP_GROW, have < 0 ? (int)have : 0, 0, 0, "kvd_seq_tokens(seq %" PRIu64 ", %u, %u)",
				   q->id, l, h))
				return;
			if (m->unit == KVD_UNIT_NONE ? have != (int64_t)p0 + n : have < n || have > (int64_t)p0 + n) {
				corrupt(w, "seq %" PRIu64 ", layer %u, head %u holds %" PRId64 " tokens after growing to %u",
					q->id, l, h, have, p0 + n);
				return;
			}
			for (uint32_t j = 0; j < n; j++) {
				uint32_t slot = (uint32_t)have - n + j;
				int64_t pos = kvd_seq_position(q->s, l, h, slot);
				void *k, *v;
				int r;

				if (pos != (int64_t)p0 + j) {
					corrupt(w, "seq %" PRIu64 ", layer %u, head %u: new slot %u holds position %" PRId64 ", expected %u",
						q->id, l, h, slot, pos, p0 + j);
					return;
				}
				r = kvd_seq_kv(q->s, l, h, slot, &k, &v);
				if (!check(w, OP_GROW, r, 0, 0, "kvd_seq_kv(seq %" PRIu64 ", %u, %u, slot %u)", q->id, l, h, slot))
					return;
				row_fill(w, q, k, l, h, (uint32_t)pos, 0);
				row_fill(w, q, v, l, h, (uint32_t)pos, 1);
				w->st->bytes_written += 2 * (uint64_t)model_row_bytes(m);
			}
		}
}

/* Publishes an observation window of random queries for every layer. */
static void seq_observe(struct worker *w, struct sq *q) {
	const struct model *m = &w->models[q->model];
	size_t bytes = (size_t)m->q_heads * m->window * model_row_bytes(m);

	for (uint32_t l = 0; l < m->layers; l++) {
		void *p;
		int r;

		r = kvd_seq_observation(q->s, l, &p);
		if (!check(w, OP_OBSERVE, r, 0, 0, "kvd_seq_observation(seq %" PRIu64 ", layer %u)", q->id, l))
			return;
		pattern_fill(p, bytes, rng_next(&w->rng), m->dtype);
		r = kvd_seq_observe(q->s, l);
		if (!check(w, OP_OBSERVE, r, 0, 0, "kvd_seq_observe(seq %" PRIu64 ", layer %u)", q->id, l))
			return;
		w->st->windows++;
	}
}

/* A pin, and what it found: a sequence back from the host tier was rewritten by the daemon
 * (its generation is the new one), a lost one is empty and left alone from then on. */
static bool seq_pin(struct worker *w, enum op op, struct sq *q) {
	int recall = KVD_RECALL_NONE;

	if (!check(w, op, kvd_seq_pin_recall(q->s, &recall), 0, 0, "kvd_seq_pin(seq %" PRIu64 ")", q->id))
		return false;
	if (recall == KVD_RECALL_HOST || recall == KVD_RECALL_FILE) {
		w->st->recalls++;
		w->st->file_recalls += recall == KVD_RECALL_FILE;
		q->generation = desc_generation(q->s);
	} else if (recall == KVD_RECALL_LOST) {
		w->st->lost++;
		q->lost = true;
	} else if (recall != KVD_RECALL_NONE)
		corrupt(w, "seq %" PRIu64 ": a pin found %d", q->id, recall);
	return true;
}

static bool seq_unpin(struct worker *w, enum op op, struct sq *q) {
	return check(w, op, kvd_seq_unpin(q->s), 0, 0, "kvd_seq_unpin(seq %" PRIu64 ")", q->id);
}

/* The most tokens a table of the sequence holds: what a grow's room is measured from.
 * Without eviction, what was grown; with it, the sequence must be pinned. */
static uint32_t seq_resident_max(const struct worker *w, const struct sq *q) {
	const struct model *m = &w->models[q->model];
	int64_t most = 0;

	if (m->unit == KVD_UNIT_NONE)
		return q->grown;
	for (uint32_t l = 0; l < m->layers; l++)
		for (uint32_t h = 0; h < m->kv_heads; h++)
			most = MAX(most, kvd_seq_tokens(q->s, l, h));
	return (uint32_t)most;
}

static void op_grow(struct worker *w) {
	struct sq *q;
	const struct model *m;
	uint32_t n, room, kind = rng_below(&w->rng, 100);
	bool pinned;
	int want = 0, r;

	if (w->n_seqs == 0)
		return;
	q = &w->seqs[rng_below(&w->rng, w->n_seqs)];
	m = &w->models[q->model];

	/* With eviction, nothing may move between the grow and the writes; and evicted
	 * tokens leave room, since max_tokens bounds what a table holds. A tenant with a
	 * host tier pins too: its sequences move whole when unpinned. */
	pinned = m->unit != KVD_UNIT_NONE || w->tiers;
	if (pinned && !seq_pin(w, OP_GROW, q))
		return;
	if (q->lost) {
		seq_unpin(w, OP_GROW, q);
		return;
	}
	room = q->max_tokens - seq_resident_max(w, q);
	if (kind < 5) {
		n = 0;
		want = -EINVAL;
	} else if (kind < 12 || room == 0) {
		uint64_t over = (uint64_t)room + 1 + rng_below(&w->rng, 1000);

		n = kind < 7 ? UINT32_MAX : (uint32_t)MIN(over, (uint64_t)UINT32_MAX);
		want = -EFBIG;
	} else {
		/* MIN() evaluates its arguments twice. */
		n = kind < 80 ? rng_range(&w->rng, 1, 32) : rng_range(&w->rng, 33, 512);
		n = MIN(room, n);
	}

	r = kvd_seq_grow(q->s, n);
	check(w, OP_GROW, r, want, R_(ENOSPC) | R_(EDQUOT) | R_(E2BIG),
	      "kvd_seq_grow(seq %" PRIu64 ", +%u at %u, %u resident of %u)", q->id, n, q->grown, q->max_tokens - room,
	      q->max_tokens);
	/* Granted, expected or not: what was grown is to be written and checked. */
	if (r >= 0) {
		uint32_t p0 = q->grown;

		q->grown += n;
		seq_write(w, q, p0, n);
		if (m->unit == KVD_UNIT_NONE)
			q->generation = desc_generation(q->s);
		else if (rng_chance(&w->rng, 50))
			seq_observe(w, q);
	}
	if (pinned) {
		seq_unpin(w, OP_GROW, q);
		do_events(w);
	}
}

/*
 * Verifies sequence i: pinned, its descriptor must be sane and stable, every resident
 * slot must hold the pattern of its original position, positions must ascend below what
 * was grown, and with eviction the sinks and the window must be there; the daemon's and
 * the library's digests must equal the pattern's.
 */
static void seq_verify(struct worker *w, unsigned i) {
	struct sq *q = &w->seqs[i];
	const struct model *m = &w->models[q->model];
	const struct kvd_seq_desc *d = kvd_seq_descriptor(q->s);
	uint32_t sinks = MIN(m->sinks, q->grown), window = MIN(m->window, q->grown);
	uint64_t expect = DIGEST_INIT, gen0, d_daemon = 0, d_local = 0, row = model_row_bytes(m);
	int r;

	if (!seq_pin(w, OP_VERIFY, q))
		return;
	if (q->lost)
		goto unpin;
	gen0 = desc_generation(q->s);
	if (d->magic != KVD_SEQ_DESC_MAGIC || d->version != KVD_SEQ_DESC_VERSION || d->seq_id != q->id ||
	    d->max_tokens != q->max_tokens || d->layers != m->layers || d->kv_heads != m->kv_heads ||
	    d->head_dim != m->head_dim || d->dtype != m->dtype || d->block_tokens != m->block_tokens) {
		corrupt(w, "seq %" PRIu64 ": the descriptor does not describe it (magic %08x, id %" PRIu64 ", max_tokens %u)",
			q->id, d->magic, d->seq_id, d->max_tokens);
		goto unpin;
	}
	if (gen0 & 1) {
		corrupt(w, "seq %" PRIu64 ": odd generation %" PRIu64 " while pinned", q->id, gen0);
		goto unpin;
	}
	if (d->next_position != q->grown) {
		corrupt(w, "seq %" PRIu64 ": next_position %u, but %u were grown", q->id, d->next_position, q->grown);
		goto unpin;
	}
	if (m->unit == KVD_UNIT_NONE && gen0 != q->generation) {
		corrupt(w, "seq %" PRIu64 " (no eviction): descriptor rewritten behind our back, generation %" PRIu64 ", was %" PRIu64,
			q->id, gen0, q->generation);
		goto unpin;
	}
	for (uint32_t l = 0; l < m->layers; l++)
		for (uint32_t h = 0; h < m->kv_heads; h++) {
			int64_t n = kvd_seq_tokens(q->s, l, h), prev = -1;
			uint32_t in_sinks = 0, in_window = 0;

			if (!check(w, OP_VERIFY, n < 0 ? (int)n : 0, 0, 0, "kvd_seq_tokens(seq %" PRIu64 ", %u, %u)", q->id, l, h))
				goto unpin;
			if ((m->unit == KVD_UNIT_NONE && n != q->grown) || n > q->grown) {
				corrupt(w, "seq %" PRIu64 ", layer %u, head %u holds %" PRId64 " tokens of %u grown",
					q->id, l, h, n, q->grown);
				goto unpin;
			}
			if (m->unit == KVD_UNIT_BLOCK && (q->grown - n) % m->block_tokens != 0) {
				corrupt(w, "seq %" PRIu64 " (block eviction, %u-token blocks), layer %u, head %u holds %" PRId64 " of %u tokens",
					q->id, m->block_tokens, l, h, n, q->grown);
				goto unpin;
			}
			for (uint32_t slot = 0; slot < (uint32_t)n; slot++) {
				int64_t pos = kvd_seq_position(q->s, l, h, slot);
				const unsigned char *kv[2];
				void *k, *v;

				if (pos <= prev || pos >= q->grown) {
					corrupt(w, "seq %" PRIu64 ", layer %u, head %u, slot %u holds position %" PRId64 " after %" PRId64 " (%u grown)",
						q->id, l, h, slot, pos, prev, q->grown);
					goto unpin;
				}
				if (m->unit == KVD_UNIT_LAYER_TOKEN && h > 0 && kvd_seq_position(q->s, l, 0, slot) != pos) {
					corrupt(w, "seq %" PRIu64 " (layer-token eviction), layer %u: heads 0 and %u differ at slot %u",
						q->id, l, h, slot);
					goto unpin;
				}
				prev = pos;
				in_sinks += pos < sinks;
				in_window += pos >= q->grown - window;
				r = kvd_seq_kv(q->s, l, h, slot, &k, &v);
				if (!check(w, OP_VERIFY, r, 0, 0, "kvd_seq_kv(seq %" PRIu64 ", %u, %u, slot %u)", q->id, l, h, slot))
					goto unpin;
				kv[0] = k;
				kv[1] = v;
				for (int x = 0; x < 2; x++) {
					row_fill(w, q, w->row, l, h, (uint32_t)pos, x);
					if (memcmp(kv[x], w->row, row) != 0) {
						uint64_t bad = 0;

						for (uint64_t b = 0; b < row; b++)
							bad += kv[x][b] != w->row[b];
						if (w->st->mismatched_bytes == 0)
							snprintf(w->st->first_mismatch, FAIL_BYTES,
								 "%s: seq %" PRIu64 ", layer %u, head %u, slot %u (position %" PRId64 "), %s row: %" PRIu64 " bytes",
								 w->who, q->id, l, h, slot, pos, x ? "V" : "K", bad);
						w->st->mismatched_bytes += bad;
					}
					expect = digest_update(expect, w->row, row);
				}
				w->st->bytes_verified += 2 * row;
			}
			if (m->unit != KVD_UNIT_NONE && (in_sinks != sinks || in_window != window)) {
				corrupt(w, "seq %" PRIu64 ", layer %u, head %u lost protected tokens: holds %u of the first %u positions and %u of the last %u",
					q->id, l, h, in_sinks, sinks, in_window, window);
				goto unpin;
			}
		}
	r = kvd_seq_digest(q->s, &d_daemon, &d_local);
	if (check(w, OP_VERIFY, r, 0, 0, "kvd_seq_digest(seq %" PRIu64 ")", q->id) && r >= 0) {
		w->st->digests++;
		if (d_daemon != expect || d_local != expect) {
			w->st->digest_mismatches++;
			corrupt(w, "seq %" PRIu64 " digest: daemon %016" PRIx64 ", library %016" PRIx64 ", pattern %016" PRIx64,
				q->id, d_daemon, d_local, expect);
		}
	}
	if (desc_generation(q->s) != gen0)
		corrupt(w, "seq %" PRIu64 ": rewritten while pinned (generation %" PRIu64 ", then %" PRIu64 ")", q->id, gen0,
			desc_generation(q->s));
unpin:
	seq_unpin(w, OP_VERIFY, q);
}

static void op_verify(struct worker *w) {
	if (w->n_seqs > 0)
		seq_verify(w, rng_below(&w->rng, w->n_seqs));
}

/* The daemon's and the library's digests agree (pinned when the model has eviction). */
static void op_digest(struct worker *w) {
	struct sq *q;
	uint64_t d_daemon, d_local;
	bool pin;
	int r;

	if (w->n_seqs == 0)
		return;
	q = &w->seqs[rng_below(&w->rng, w->n_seqs)];
	pin = w->models[q->model].unit != KVD_UNIT_NONE || w->tiers;
	if (pin && !seq_pin(w, OP_DIGEST, q))
		return;
	r = kvd_seq_digest(q->s, &d_daemon, &d_local);
	if (check(w, OP_DIGEST, r, 0, 0, "kvd_seq_digest(seq %" PRIu64 ")", q->id) && r >= 0) {
		w->st->digests++;
		if (d_daemon != d_local) {
			w->st->digest_mismatches++;
			corrupt(w, "seq %" PRIu64 " digest: daemon %016" PRIx64 ", library %016" PRIx64, q->id, d_daemon, d_local);
		}
	}
	if (pin)
		seq_unpin(w, OP_DIGEST, q);
}

/* Nested pins, stable meanwhile, and sometimes one unpin too many. */
static void op_pin(struct worker *w) {
	struct sq *q;
	uint32_t k;
	uint64_t gen;

	if (w->n_seqs == 0)
		return;
	q = &w->seqs[rng_below(&w->rng, w->n_seqs)];
	k = rng_range(&w->rng, 1, 4);
	for (uint32_t i = 0; i < k; i++)
		if (!seq_pin(w, OP_PIN, q)) {
			k = i;
			break;
		}
	gen = desc_generation(q->s);
	do_events(w);
	if (k > 0 && desc_generation(q->s) != gen)
		corrupt(w, "seq %" PRIu64 ": rewritten while pinned %u times", q->id, k);
	for (uint32_t i = 0; i < k; i++)
		seq_unpin(w, OP_PIN, q);
	if (rng_chance(&w->rng, 50))
		check(w, OP_PIN, kvd_seq_unpin(q->s), -EINVAL, 0, "kvd_seq_unpin(seq %" PRIu64 ") without pin", q->id);
}

/* Getters out of range. */
static void op_lookup(struct worker *w) {
	const struct model *m;
	struct sq *q;
	void *p;

	if (w->n_seqs == 0)
		return;
	q = &w->seqs[rng_below(&w->rng, w->n_seqs)];
	m = &w->models[q->model];
	check(w, OP_LOOKUP, (int)kvd_seq_tokens(q->s, m->layers, 0), -EINVAL, 0, "kvd_seq_tokens(layer %u of %u)",
	      m->layers, m->layers);
	check(w, OP_LOOKUP, (int)kvd_seq_tokens(q->s, 0, m->kv_heads), -EINVAL, 0, "kvd_seq_tokens(head %u of %u)",
	      m->kv_heads, m->kv_heads);
	check(w, OP_LOOKUP, (int)kvd_seq_position(q->s, 0, 0, q->max_tokens), -EINVAL, 0,
	      "kvd_seq_position(slot %u, past max_tokens)", q->max_tokens);
	check(w, OP_LOOKUP, kvd_seq_kv(q->s, 0, 0, q->max_tokens, &p, NULL), -EINVAL, 0,
	      "kvd_seq_kv(slot %u, not resident)", q->max_tokens);
	check(w, OP_LOOKUP, kvd_seq_block(q->s, kvd_seq_descriptor(q->s)->n_tables, 0, &p), -EINVAL, 0,
	      "kvd_seq_block(table %u, out of range)", kvd_seq_descriptor(q->s)->n_tables);
}

/* Windows for a sequence with eviction, or the documented refusals. */
/*
 * With --tiers (and recall, 32 tokens per row): asks for what the window just published
 * needs of what rounds evicted, then checks every resident slot against the pattern of its
 * position, which a trade must keep. Refused only as documented: the sequence moved out
 * or rewritten meanwhile (-EAGAIN), a model with compensation (-EOPNOTSUPP).
 */
static void seq_recall(struct worker *w, unsigned i) {
	struct sq *q = &w->seqs[i];
	uint64_t tokens = 0;
	int r;

	r = kvd_seq_recall(q->s, &tokens, NULL);
	if (!check(w, OP_OBSERVE, r, 0, R_(EAGAIN) | R_(EOPNOTSUPP), "kvd_seq_recall(seq %" PRIu64 ")",
	           q->id) || r < 0)
		return;
	w->st->token_recalls++;
	w->st->tokens_back += tokens;
	if (tokens > 0)
		seq_verify(w, i);
}

static void op_observe(struct worker *w) {
	const struct model *m;
	struct sq *q;
	void *p;

	if (w->n_seqs == 0)
		return;
	q = &w->seqs[rng_below(&w->rng, w->n_seqs)];
	m = &w->models[q->model];
	if (m->unit == KVD_UNIT_NONE) {
		check(w, OP_OBSERVE, kvd_seq_observation(q->s, 0, &p), -EOPNOTSUPP, 0,
		      "kvd_seq_observation(seq %" PRIu64 " without eviction)", q->id);
		check(w, OP_OBSERVE, kvd_seq_observe(q->s, 0), -EOPNOTSUPP, 0,
		      "kvd_seq_observe(seq %" PRIu64 " without eviction)", q->id);
		return;
	}
	check(w, OP_OBSERVE, kvd_seq_observation(q->s, m->layers, &p), -EINVAL, 0,
	      "kvd_seq_observation(seq %" PRIu64 ", layer %u of %u)", q->id, m->layers, m->layers);
	if (q->grown == 0) {
		check(w, OP_OBSERVE, kvd_seq_observe(q->s, 0), -EINVAL, 0, "kvd_seq_observe(seq %" PRIu64 ", empty)", q->id);
		return;
	}
	if (!seq_pin(w, OP_OBSERVE, q))
		return;
	seq_observe(w, q);
	seq_unpin(w, OP_OBSERVE, q);
	if (w->tiers)
		seq_recall(w, (unsigned)(q - w->seqs));
}

static void op_release(struct worker *w) {
	unsigned i;
	struct sq *q;
	int r;

	if (w->n_seqs == 0)
		return;
	i = rng_below(&w->rng, w->n_seqs);
	q = &w->seqs[i];
	/* Sometimes checked first, sometimes released while pinned. */
	if (rng_chance(&w->rng, 30))
		seq_verify(w, i);
	if (rng_chance(&w->rng, 20))
		seq_pin(w, OP_RELEASE, q);
	r = kvd_seq_release(q->s);
	check(w, OP_RELEASE, r, 0, 0, "kvd_seq_release(seq %" PRIu64 ")", q->id);
	seq_forget(w, i);
	do_events(w);
}

static void op_status(struct worker *w) {
	_cleanup_(kvd_status_freep) kvd_status *st = NULL;
	_cleanup_(kvd_evictions_freep) kvd_evictions *ev = NULL;
	uint64_t v;
	const char *name;
	int r;

	r = kvd_status_get(w->c, &st);
	if (!check(w, OP_STATUS, r, 0, 0, "kvd_status_get") || r < 0)
		return;
	check(w, OP_STATUS, kvd_status_u64(st, "used_bytes", &v), 0, 0, "kvd_status_u64(used_bytes)");
	check(w, OP_STATUS, kvd_status_u64(st, "no_such_value", &v), -ENOENT, 0, "kvd_status_u64(no_such_value)");
	check(w, OP_STATUS, kvd_status_tenant_name(st, kvd_status_tenants(st), &name), -EINVAL, 0,
	      "kvd_status_tenant_name(index %u of %u)", kvd_status_tenants(st), kvd_status_tenants(st));
	check(w, OP_STATUS, kvd_status_refusal(st, kvd_status_refusals(st), &name, &v), -EINVAL, 0,
	      "kvd_status_refusal(index %u of %u)", kvd_status_refusals(st), kvd_status_refusals(st));
	if (rng_chance(&w->rng, 30)) {
		r = kvd_evictions_get(w->c, &ev);
		if (check(w, OP_STATUS, r, 0, 0, "kvd_evictions_get") && r >= 0 && kvd_evictions_count(ev) > 0)
			check(w, OP_STATUS, kvd_evictions_u64(ev, kvd_evictions_count(ev) - 1, "freed_bytes", &v), 0, 0,
			      "kvd_evictions_u64(freed_bytes)");
	}
}

/* A round on our own tenant, or the refusals of a bad or unknown tenant. */
static void op_evict(struct worker *w) {
	unsigned kind = rng_below(&w->rng, 10);
	uint64_t freed = 0, bytes = rng_chance(&w->rng, 30) ? 0 : rng_range(&w->rng, 1, 4u << 20);
	char other[40];
	int r;

	if (kind == 0) {
		r = kvd_evict(w->c, "bad name!", bytes, &freed);
		check(w, OP_EVICT, r, -EINVAL, 0, "kvd_evict(\"bad name!\")");
	} else if (kind == 1) {
		snprintf(other, sizeof(other), "soak-none-%u", rng_below(&w->rng, 1000000));
		r = kvd_evict(w->c, other, bytes, &freed);
		check(w, OP_EVICT, r, -ENOENT, 0, "kvd_evict(%s, unknown)", other);
	} else {
		r = kvd_evict(w->c, w->name, bytes, &freed);
		check(w, OP_EVICT, r, 0, R_(EBUSY), "kvd_evict(%s, %" PRIu64 " bytes)", w->name, bytes);
	}
}

/* ---- Raw frames ---- */

static int raw_connect(void) {
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd;

	if (strlen(arg_socket) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	strcpy(sa.sun_path, arg_socket);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return negative_errno();
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		int r = negative_errno();

		close(fd);
		return r;
	}
	return fd;
}

static int raw_send_bytes(int fd, const void *p, size_t n) {
	ssize_t k = send(fd, p, n, MSG_NOSIGNAL);

	if (k < 0)
		return negative_errno();
	return k == (ssize_t)n ? 0 : -EIO;
}

/* Sends env, with fd attached when fd >= 0. */
static int raw_send(int fd, const Envelope *env, int attach) {
	_cleanup_(freep) uint8_t *frame = NULL;
	union {
		struct cmsghdr h;
		uint8_t buf[CMSG_SPACE(sizeof(int))];
	} cm = {};
	struct iovec iov;
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };
	size_t size;
	int r;

	r = wire_encode(env, attach >= 0, &frame, &size);
	if (r < 0)
		return r;
	if (attach < 0)
		return raw_send_bytes(fd, frame, size);
	iov.iov_base = frame;
	iov.iov_len = size;
	msg.msg_control = cm.buf;
	msg.msg_controllen = sizeof(cm.buf);
	cm.h.cmsg_level = SOL_SOCKET;
	cm.h.cmsg_type = SCM_RIGHTS;
	cm.h.cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(&cm.h), &attach, sizeof(int));
	if (sendmsg(fd, &msg, MSG_NOSIGNAL) != (ssize_t)size)
		return -EIO;
	return 0;
}

/* The next frame: 1 with the envelope (valid until the next call), 0 at EOF, -ETIMEDOUT,
 * or another negative errno. */
static int raw_recv(struct worker *w, int fd, Envelope **ret) {
	int fds[WIRE_FDS_MAX];
	uint32_t nfds;

	for (;;) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		uint8_t cmsg[WIRE_CMSG_SPACE];
		struct iovec iov;
		struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cmsg,
				      .msg_controllen = sizeof(cmsg) };
		ssize_t n;
		int r;

		r = wire_rx_next(w->rx, ret, fds, &nfds);
		if (r != 0) {
			for (uint32_t i = 0; r > 0 && i < nfds; i++)
				close(fds[i]);
			/* A connection over the daemon's limits gets one frame, then the door. */
			if (r > 0 && w->raw_frames++ == 0 && (*ret)->id == 0 && (*ret)->status &&
			    (*ret)->status->code == -EUSERS) {
				w->raw_refused = true;
				return 0;
			}
			return r;
		}
		r = poll(&p, 1, RAW_TIMEOUT_MS);
		if (r == 0)
			return -ETIMEDOUT;
		if (r < 0) {
			if (errno == EINTR)
				continue;
			return negative_errno();
		}
		iov.iov_base = wire_rx_space(w->rx, &iov.iov_len);
		n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
		if (n < 0)
			return errno == ECONNRESET ? 0 : negative_errno();
		if (n == 0)
			return 0;
		wire_rx_take_cmsg(w->rx, &msg);
		wire_rx_commit(w->rx, (size_t)n);
	}
}

/* Receives one frame that must carry id and status code `code`; returns whether it did. */
static bool raw_expect(struct worker *w, int fd, uint64_t id, int code, const char *what) {
	Envelope *env = NULL;
	int r = raw_recv(w, fd, &env), got;

	if (r <= 0) {
		if (!w->raw_refused)
			check(w, OP_RAW, r == 0 ? -ECONNRESET : r, code, 0, "raw %s: no answer", what);
		return false;
	}
	got = env->status ? env->status->code : -EBADMSG;
	if (env->id != id) {
		corrupt(w, "raw %s: answer to id %" PRIu64 ", expected %" PRIu64 " (status %s)", what, env->id, id,
			errno_name(got));
		return false;
	}
	return check(w, OP_RAW, got, code, 0, "raw %s", what);
}

/* Reads until the daemon hangs up: every frame on the way must carry status code `code`,
 * and there must be at least `min` of them. */
static void raw_expect_eof(struct worker *w, int fd, int code, unsigned min, const char *what) {
	unsigned frames = 0;

	for (;;) {
		Envelope *env;
		int r = raw_recv(w, fd, &env);

		if (r == 0 && w->raw_refused)
			return;
		if (r == 0)
			break;
		if (r < 0) {
			corrupt(w, "raw %s: no disconnect (%s after %u frames)", what, errno_name(r), frames);
			return;
		}
		if (!check(w, OP_RAW, env->status ? env->status->code : -EBADMSG, code, 0, "raw %s, frame %u", what, frames))
			return;
		frames++;
	}
	if (frames < min)
		corrupt(w, "raw %s: disconnected after %u answers, expected %u", what, frames, min);
}

/* Accounts for the result r of a send; a send may fail because the daemon refused the
 * connection at its limits, which the frame it sent first tells. */
static bool raw_sent(struct worker *w, int fd, int r, const char *what) {
	Envelope *env;

	if (r >= 0)
		return true;
	if (raw_recv(w, fd, &env) == 0 && w->raw_refused)
		return false;
	check(w, OP_RAW, r, 0, 0, "raw %s: send", what);
	return false;
}

static void raw_envelope_status(Envelope *env, Kvd__V1__StatusRequest *sr, uint64_t id) {
	kvd__v1__envelope__init(env);
	kvd__v1__status_request__init(sr);
	env->has_id = id != 0;
	env->id = id;
	env->body_case = KVD__V1__ENVELOPE__BODY_STATUS_REQUEST;
	env->status_request = sr;
}

/* Says hello as tenant (NULL: administrative) with versions min..max; returns whether the
 * answer was `code`. */
static bool raw_hello(struct worker *w, int fd, const char *tenant, uint32_t min, uint32_t max, int code) {
	Kvd__V1__Hello h = KVD__V1__HELLO__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	int r;

	h.has_min_version = h.has_max_version = true;
	h.min_version = min;
	h.max_version = max;
	h.tenant = (char *)tenant;
	env.has_id = true;
	env.id = 1;
	env.body_case = KVD__V1__ENVELOPE__BODY_HELLO;
	env.hello = &h;
	r = raw_send(fd, &env, -1);
	if (!raw_sent(w, fd, r, "hello"))
		return false;
	return raw_expect(w, fd, 1, code, "hello");
}

/* A status request that must be answered normally. */
static void raw_status_ok(struct worker *w, int fd, uint64_t id, const char *what) {
	Kvd__V1__StatusRequest sr;
	Envelope env;

	raw_envelope_status(&env, &sr, id);
	if (raw_sent(w, fd, raw_send(fd, &env, -1), what))
		raw_expect(w, fd, id, 0, what);
}

static void op_raw(struct worker *w) {
	enum raw kind = (enum raw)rng_below(&w->rng, RAW_MAX);
	Kvd__V1__StatusRequest sr;
	Envelope env;
	_cleanup_(closep) int fd = -EBADF;
	uint8_t buf[300];
	size_t n;
	uint64_t pe0 = w->st->protocol_errors, fr0 = w->st->frames_refused;

	fd = raw_connect();
	if (!check(w, OP_RAW, fd < 0 ? fd : 0, 0, 0, "raw connect to %s", arg_socket) || fd < 0)
		return;
	wire_rx_init(w->rx);
	w->raw_frames = 0;
	w->raw_refused = false;
	w->st->raw[kind]++;
	switch (kind) {
	case RAW_GARBAGE:
		/* Random bytes whose first four, read as a length, are over 64 KiB. */
		n = rng_range(&w->rng, 8, 256);
		for (size_t i = 0; i < n; i++)
			buf[i] = (uint8_t)rng_next(&w->rng);
		buf[3] |= 0x01;
		w->st->protocol_errors++;
		w->st->frames_refused++;
		if (raw_sent(w, fd, raw_send_bytes(fd, buf, n), "garbage"))
			raw_expect_eof(w, fd, -EMSGSIZE, 1, "garbage");
		break;
	case RAW_OVERSIZE: {
		uint32_t len = WIRE_PAYLOAD_MAX + 1 + rng_below(&w->rng, 1u << 20);

		memset(buf, 0, WIRE_HEADER_BYTES);
		memcpy(buf, &len, 4); /* little-endian, like the daemon */
		w->st->protocol_errors++;
		w->st->frames_refused++;
		if (raw_sent(w, fd, raw_send_bytes(fd, buf, WIRE_HEADER_BYTES), "oversize"))
			raw_expect_eof(w, fd, -EMSGSIZE, 1, "oversize frame");
		break;
	}
	case RAW_BEFORE_HELLO:
		raw_envelope_status(&env, &sr, 7);
		w->st->protocol_errors++;
		if (raw_sent(w, fd, raw_send(fd, &env, -1), "before hello") &&
		    raw_expect(w, fd, 7, -EPROTO, "status before hello") &&
		    raw_hello(w, fd, w->name, 1, 1, 0))
			raw_status_ok(w, fd, 9, "status after a late hello");
		break;
	case RAW_UNDECODABLE: {
		bool hello_first = rng_chance(&w->rng, 50);

		/* 0xff bytes: a varint that never ends, or one too long. */
		n = rng_range(&w->rng, 1, 64);
		memset(buf, 0, WIRE_HEADER_BYTES);
		buf[0] = (uint8_t)n;
		memset(buf + WIRE_HEADER_BYTES, 0xff, n);
		if (hello_first && !raw_hello(w, fd, w->name, 1, 1, 0))
			break;
		w->st->protocol_errors++;
		if (raw_sent(w, fd, raw_send_bytes(fd, buf, WIRE_HEADER_BYTES + n), "undecodable") &&
		    raw_expect(w, fd, 0, -EBADMSG, "undecodable payload") &&
		    (hello_first || raw_hello(w, fd, w->name, 1, 1, 0)))
			raw_status_ok(w, fd, 3, "status after an undecodable payload");
		break;
	}
	case RAW_UNKNOWN_BODY: {
		/* Envelope{id = 5, field 99 = 1}. */
		static const uint8_t frame[] = { 5, 0, 0, 0, 0, 0, 0, 0, 0x08, 0x05, 0x98, 0x06, 0x01 };

		if (raw_hello(w, fd, w->name, 1, 1, 0) &&
		    raw_sent(w, fd, raw_send_bytes(fd, frame, sizeof(frame)), "unknown body") &&
		    raw_expect(w, fd, 5, -EOPNOTSUPP, "unknown Envelope member"))
			raw_status_ok(w, fd, 6, "status after an unknown member");
		break;
	}
	case RAW_UNKNOWN_FIELDS: {
		/* Envelope{id = 4, field 1000 = 42, status_request = {field 7 = 1}}. */
		static const uint8_t frame[] = { 10, 0, 0, 0, 0, 0, 0, 0, 0x08, 0x04, 0xc0, 0x3e, 0x2a,
						 0xca, 0x01, 0x02, 0x38, 0x01 };

		if (raw_hello(w, fd, w->name, 1, 1, 0) &&
		    raw_sent(w, fd, raw_send_bytes(fd, frame, sizeof(frame)), "unknown fields"))
			raw_expect(w, fd, 4, 0, "status request with unknown fields");
		break;
	}
	case RAW_VERSION: {
		uint32_t min = rng_chance(&w->rng, 50) ? 2 : 0, max = min ? 3 : 0;

		if (raw_hello(w, fd, w->name, min, max, -EPROTONOSUPPORT))
			raw_expect_eof(w, fd, 0, 0, "hello without a common version");
		break;
	}
	case RAW_VIOLATIONS:
		w->st->protocol_errors += VIOLATIONS_MAX;
		for (unsigned i = 1; i <= VIOLATIONS_MAX; i++) {
			raw_envelope_status(&env, &sr, i);
			if (!raw_sent(w, fd, raw_send(fd, &env, -1), "violations"))
				break;
		}
		raw_expect_eof(w, fd, -EPROTO, VIOLATIONS_MAX, "requests before hello, again and again");
		break;
	case RAW_NO_ID:
		if (!raw_hello(w, fd, w->name, 1, 1, 0))
			break;
		raw_envelope_status(&env, &sr, 0);
		w->st->protocol_errors++;
		if (raw_sent(w, fd, raw_send(fd, &env, -1), "no id") &&
		    raw_expect(w, fd, 0, -EINVAL, "request without an id"))
			raw_status_ok(w, fd, 8, "status after a request without an id");
		break;
	case RAW_REPLY_AS_REQUEST: {
		Kvd__V1__StatusReply rep = KVD__V1__STATUS_REPLY__INIT;

		if (!raw_hello(w, fd, w->name, 1, 1, 0))
			break;
		kvd__v1__envelope__init(&env);
		env.has_id = true;
		env.id = 12;
		env.body_case = KVD__V1__ENVELOPE__BODY_STATUS_REPLY;
		env.status_reply = &rep;
		if (raw_sent(w, fd, raw_send(fd, &env, -1), "reply as request"))
			raw_expect(w, fd, 12, -EOPNOTSUPP, "a reply sent as a request");
		break;
	}
	case RAW_SECOND_HELLO:
		if (!raw_hello(w, fd, w->name, 1, 1, 0))
			break;
		w->st->protocol_errors++;
		raw_hello(w, fd, w->name, 1, 1, -EPROTO);
		break;
	case RAW_FOREIGN_SEQ: {
		/* One of our own sequences, which this connection does not hold, or any id. */
		uint64_t seq = w->n_seqs ? w->seqs[rng_below(&w->rng, w->n_seqs)].id : rng_next(&w->rng) >> 1;
		Kvd__V1__SeqGrow g = KVD__V1__SEQ_GROW__INIT;
		Kvd__V1__SeqPin p = KVD__V1__SEQ_PIN__INIT;
		Kvd__V1__SeqDigest dg = KVD__V1__SEQ_DIGEST__INIT;
		Kvd__V1__SeqRelease rl = KVD__V1__SEQ_RELEASE__INIT;

		if (!raw_hello(w, fd, w->name, 1, 1, 0))
			break;
		kvd__v1__envelope__init(&env);
		env.has_id = true;
		env.id = 20;
		switch (rng_below(&w->rng, 4)) {
		case 0:
			g.has_seq_id = g.has_tokens = true;
			g.seq_id = seq;
			g.tokens = 1;
			env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_GROW;
			env.seq_grow = &g;
			break;
		case 1:
			p.has_seq_id = true;
			p.seq_id = seq;
			env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_PIN;
			env.seq_pin = &p;
			break;
		case 2:
			dg.has_seq_id = true;
			dg.seq_id = seq;
			env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_DIGEST;
			env.seq_digest = &dg;
			break;
		default:
			rl.has_seq_id = true;
			rl.seq_id = seq;
			env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_RELEASE;
			env.seq_release = &rl;
			break;
		}
		if (raw_sent(w, fd, raw_send(fd, &env, -1), "foreign sequence"))
			raw_expect(w, fd, 20, -ENOENT, "request on another connection's sequence");
		break;
	}
	case RAW_FDS: {
		_cleanup_(closep) int passed = open("/dev/null", O_RDONLY | O_CLOEXEC);

		if (!check(w, OP_RAW, passed < 0 ? negative_errno() : 0, 0, 0, "open /dev/null") ||
		    !raw_hello(w, fd, w->name, 1, 1, 0))
			break;
		raw_envelope_status(&env, &sr, 3);
		w->st->protocol_errors++;
		if (raw_sent(w, fd, raw_send(fd, &env, passed), "fds"))
			raw_expect(w, fd, 3, -EBADMSG, "status request carrying an fd");
		break;
	}
	case RAW_TRUNCATED:
		memset(buf, 0, sizeof(buf));
		buf[0] = 100;
		raw_sent(w, fd, raw_send_bytes(fd, buf, WIRE_HEADER_BYTES + 10), "truncated");
		break;
	case RAW_BAD_TENANT:
		if (raw_hello(w, fd, "bad name!", 1, 1, -EINVAL))
			raw_expect_eof(w, fd, 0, 0, "hello with a bad tenant name");
		break;
	case RAW_ADMIN_ALLOC: {
		Kvd__V1__RegisterModel rm = KVD__V1__REGISTER_MODEL__INIT;

		if (!raw_hello(w, fd, NULL, 1, 1, 0))
			break;
		kvd__v1__envelope__init(&env);
		env.has_id = true;
		env.id = 30;
		rm.has_layers = rm.has_q_heads = rm.has_kv_heads = rm.has_head_dim = true;
		rm.layers = rm.q_heads = rm.kv_heads = 1;
		rm.head_dim = 8;
		rm.has_dtype = rm.has_block_tokens = rm.has_layout = true;
		rm.dtype = KVD__V1__DTYPE__DTYPE_F16;
		rm.block_tokens = 4;
		rm.layout = KVD__V1__LAYOUT__LAYOUT_PER_HEAD;
		env.body_case = KVD__V1__ENVELOPE__BODY_REGISTER_MODEL;
		env.register_model = &rm;
		if (raw_sent(w, fd, raw_send(fd, &env, -1), "admin register"))
			raw_expect(w, fd, 30, -EPERM, "model registration on an administrative connection");
		break;
	}
	default:
		break;
	}
	if (w->raw_refused) {
		/* Refused at the door: nothing sent was counted. */
		w->st->protocol_errors = pe0;
		w->st->frames_refused = fr0;
		w->st->ops[OP_RAW].refused++;
		w->st->refusals[REFUSAL_EUSERS]++;
	}
	wire_rx_done(w->rx);
}

/* ---- Abrupt ends ---- */

static void closedirp(DIR **d) {
	if (*d)
		closedir(*d);
}

/* The connection's socket: the only socket this process has outside op_raw. */
static int find_socket(void) {
	_cleanup_(closedirp) DIR *d = opendir("/proc/self/fd");
	struct dirent *de;
	int found = -ENOENT;

	if (!d)
		return negative_errno();
	while ((de = readdir(d))) {
		struct stat s;
		int fd;

		if (de->d_name[0] == '.' || number_parse_u32(de->d_name, 0, INT32_MAX, (uint32_t *)&fd) < 0 ||
		    fd == dirfd(d) || fstat(fd, &s) < 0 || !S_ISSOCK(s.st_mode))
			continue;
		if (found >= 0)
			return -ENOTUNIQ;
		found = fd;
	}
	return found;
}

/* Cuts the connection under the library, as a daemon that hangs up would: every call must
 * then fail with -ECONNRESET; the handles are dropped and a new connection made. */
static void op_cut(struct worker *w) {
	kvd_status *st = NULL;
	int fd = find_socket(), r;

	if (fd < 0) {
		corrupt(w, "cut: cannot tell the connection's socket (%s)", errno_name(fd));
		return;
	}
	w->st->cuts++;
	if (shutdown(fd, SHUT_RDWR) < 0) {
		corrupt(w, "cut: shutdown: %s", errno_name(negative_errno()));
		return;
	}
	r = kvd_status_get(w->c, &st);
	check(w, OP_CUT, r, -ECONNRESET, 0, "kvd_status_get after the connection was cut");
	kvd_status_free(st);
	if (w->n_seqs > 0) {
		r = kvd_seq_grow(w->seqs[0].s, 1);
		check(w, OP_CUT, r, -ECONNRESET, 0, "kvd_seq_grow after the connection was cut");
	}
	drop_all(w, true);
	do_connect(w);
}

/* Ends the process without releasing anything: pinned, mapped and granted all at once. */
static _Noreturn void op_exit(struct worker *w) {
	if (w->n_seqs > 0 && rng_chance(&w->rng, 50))
		seq_pin(w, OP_EXIT, &w->seqs[rng_below(&w->rng, w->n_seqs)]);
	if (rng_chance(&w->rng, 50)) {
		w->st->exits++;
		_exit(EXIT_ABRUPT);
	}
	w->st->kills++;
	w->st->kill_intended = 1;
	raise(SIGKILL);
	_exit(EXIT_ABRUPT);
}

/* ---- The client's loop ---- */

struct weighted {
	enum op op;
	unsigned weight;
};

/* Per mille, roughly. */
static const struct weighted weights[] = {
	{ OP_REGISTER, 30 },
	{ OP_OUTPUT_PROJ, 8 },
	{ OP_OPEN, 80 },
	{ OP_GROW, 300 },
	{ OP_OBSERVE, 30 },
	{ OP_VERIFY, 80 },
	{ OP_DIGEST, 40 },
	{ OP_RELEASE, 70 },
	{ OP_PIN, 40 },
	{ OP_LOOKUP, 20 },
	{ OP_EVENTS, 50 },
	{ OP_STATUS, 30 },
	{ OP_EVICT, 6 },
	{ OP_RAW, 25 },
	{ OP_CUT, 1 },
	{ OP_EXIT, 1 },
};

static enum op pick(struct worker *w) {
	unsigned total = 0, x;

	for (size_t i = 0; i < ELEMENTSOF(weights); i++)
		total += weights[i].weight;
	x = rng_below(&w->rng, total);
	for (size_t i = 0; i < ELEMENTSOF(weights); i++) {
		if (x < weights[i].weight)
			return weights[i].op;
		x -= weights[i].weight;
	}
	return OP_EVENTS;
}

static int worker_main(struct shared *sh, unsigned slot, unsigned life) {
	struct worker w = {
		.slot = slot,
		.tenant = slot / arg_clients,
		.rng = mix64(arg_seed ^ mix64(((uint64_t)slot << 32) | life)),
		.st = &sh->slots[slot],
		.deadline = sh->deadline_ns,
	};
	uint32_t fails0 = w.st->n_fails;

	snprintf(w.name, sizeof(w.name), "soak-%u", w.tenant);
	snprintf(w.who, sizeof(w.who), "%s client %u (pid %d)", w.name, slot % arg_clients, (int)getpid());
	w.evictable = arg_evict && w.tenant % 2 == 0;
	w.tiers = arg_tiers;
	w.row = malloc(ROW_MAX);
	w.rx = malloc(sizeof(*w.rx));
	if (!w.row || !w.rx) {
		fail(w.st, "%s: out of memory", w.who);
		return EXIT_FAILURE;
	}
	wire_rx_init(w.rx);

	if (do_connect(&w) < 0)
		goto out;
	while (now_ns() < w.deadline) {
		enum op op = pick(&w);

		if (op == OP_EVICT && !arg_evict)
			continue;
		w.st->ops[op].calls++;
		switch (op) {
		case OP_REGISTER: op_register(&w); break;
		case OP_OUTPUT_PROJ: op_output_proj(&w); break;
		case OP_OPEN: op_open(&w); break;
		case OP_GROW: op_grow(&w); break;
		case OP_OBSERVE: op_observe(&w); break;
		case OP_VERIFY: op_verify(&w); break;
		case OP_DIGEST: op_digest(&w); break;
		case OP_RELEASE: op_release(&w); break;
		case OP_PIN: op_pin(&w); break;
		case OP_LOOKUP: op_lookup(&w); break;
		case OP_EVENTS: do_events(&w); break;
		case OP_STATUS: op_status(&w); break;
		case OP_EVICT: op_evict(&w); break;
		case OP_RAW: op_raw(&w); break;
		case OP_CUT: op_cut(&w); break;
		case OP_EXIT: op_exit(&w);
		default: break;
		}
		if (w.dead) {
			/* Recorded already; start over on a new connection. */
			drop_all(&w, true);
			if (do_connect(&w) < 0)
				break;
		}
	}
	/* The end: check everything once more, then give it back properly. */
	for (unsigned i = 0; w.c && !w.dead && i < w.n_seqs; i++) {
		w.st->ops[OP_VERIFY].calls++;
		seq_verify(&w, i);
	}
	if (w.c)
		do_events(&w);
	w.st->ops[OP_RELEASE].calls += w.n_seqs;
	drop_all(&w, w.dead);
out:
	wire_rx_done(w.rx);
	free(w.rx);
	free(w.row);
	return w.st->n_fails == fails0 ? EXIT_SUCCESS : EXIT_FAILURE;
}

/* ---- The supervisor ---- */

static pid_t spawn(struct shared *sh, unsigned slot) {
	unsigned life = (unsigned)sh->slots[slot].lives++;
	pid_t parent = getpid(), pid = fork();

	if (pid != 0)
		return pid;
	/* The clients die with the supervisor, which dies with the parent. */
	if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != parent)
		_exit(EXIT_FAILURE);
	/* exit(), not _exit(): a leak checker (LSan, valgrind) looks at the client at its end.
	 * stdio was flushed before the fork, so nothing is written twice. */
	exit(worker_main(sh, slot, life));
}

/* Forks the clients on the parent's go and keeps every slot busy until the deadline. */
static _Noreturn void supervise(struct shared *sh, int go_fd) {
	unsigned n = arg_tenants * arg_clients, alive = 0;
	pid_t pids[SOAK_SLOTS_MAX] = {};
	uint32_t fails0[SOAK_SLOTS_MAX] = {};
	bool killed = false;
	char go = 0;

	while (read(go_fd, &go, 1) < 0 && errno == EINTR)
		;
	safe_close(go_fd);
	if (go != 'G')
		_exit(EXIT_SUCCESS);
	for (unsigned s = 0; s < n; s++) {
		fails0[s] = sh->slots[s].n_fails;
		pids[s] = spawn(sh, s);
		if (pids[s] < 0)
			fail(&sh->slots[s], "soak-%u client %u: fork: %s", s / arg_clients, s % arg_clients,
			     strerror(errno));
		else
			alive++;
	}
	while (alive > 0) {
		struct slot *st;
		bool abrupt;
		int status;
		unsigned s;
		pid_t pid = waitpid(-1, &status, WNOHANG);

		if (pid == 0) {
			if (!killed && now_ns() > sh->deadline_ns + GRACE_NS) {
				for (s = 0; s < n; s++)
					if (pids[s] > 0) {
						fail(&sh->slots[s], "soak-%u client %u (pid %d): still running %u s after the deadline, killed",
						     s / arg_clients, s % arg_clients, (int)pids[s],
						     (unsigned)(GRACE_NS / 1000000000));
						kill(pids[s], SIGKILL);
					}
				killed = true;
			}
			sleep_ns(5 * 1000000);
			continue;
		}
		if (pid < 0) {
			if (errno == EINTR)
				continue;
			break;
		}
		for (s = 0; s < n && pids[s] != pid; s++)
			;
		if (s == n)
			continue;
		st = &sh->slots[s];
		pids[s] = 0;
		if (WIFEXITED(status) && WEXITSTATUS(status) == EXIT_SUCCESS) {
			alive--;
			continue;
		}
		if (!(WIFEXITED(status) && WEXITSTATUS(status) == EXIT_ABRUPT) &&
		    !(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL && st->kill_intended && !killed)) {
			if (WIFSIGNALED(status))
				fail(st, "soak-%u client %u (pid %d): killed by signal %d (%s)", s / arg_clients,
				     s % arg_clients, (int)pid, WTERMSIG(status), strsignal(WTERMSIG(status)));
			else if (st->n_fails == fails0[s])
				fail(st, "soak-%u client %u (pid %d): exit status %d and no failure recorded (a sanitizer report on its stderr?)",
				     s / arg_clients, s % arg_clients, (int)pid, WEXITSTATUS(status));
		}
		/* A client that failed (it could not connect, it crashed) leaves its slot
		 * empty: forking it again would mostly repeat the failure. */
		abrupt = (WIFEXITED(status) && WEXITSTATUS(status) == EXIT_ABRUPT) ||
			 (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL && st->kill_intended && !killed);
		st->kill_intended = 0;
		fails0[s] = st->n_fails;
		if (abrupt && now_ns() < sh->deadline_ns && !killed) {
			pids[s] = spawn(sh, s);
			if (pids[s] > 0)
				continue;
			fail(st, "soak-%u client %u: fork: %s", s / arg_clients, s % arg_clients, strerror(errno));
		}
		alive--;
	}
	_exit(EXIT_SUCCESS);
}

/* ---- The monitor and the admin (threads of the parent) ---- */

/*
 * A limit that the admin changes (the budget, a tenant's cap) and that the monitor checks
 * usage against. Usage may stay above a limit that was just lowered (grants then fail
 * until use drops), so the monitor allows the highest value set since it last saw usage
 * within the current limit with no change in flight: from then on no grant may take usage
 * past it.
 */
struct limit {
	uint64_t hi;       /* the highest value that may still bound usage */
	uint64_t gen;      /* bumped at the start and end of every change */
	unsigned changing; /* changes in flight */
	bool set;          /* the admin changed it (restored at the end) */
	uint64_t last_used, last_value;
	bool was_over;
};

struct node_status {
	uint64_t pool, budget, used, block, chunk, total, free, draining, connections, protocol_errors, rounds;
	uint64_t tier_seqs, tier_moves; /* in the host tier, and moving (0 without one) */
	uint64_t file_tier, file_seqs;  /* the file tier's size, and what it holds */
	uint64_t t_used[SOAK_TENANTS_MAX], t_max[SOAK_TENANTS_MAX], t_seqs[SOAK_TENANTS_MAX],
		t_conns[SOAK_TENANTS_MAX];
	bool t_known[SOAK_TENANTS_MAX];
	uint64_t other_seqs; /* sequences of tenants that are not ours */
	uint64_t refused[32];
	char refused_name[32][32];
	uint32_t n_refused;
};

struct monitor {
	pthread_t thread;
	pthread_mutex_t lock;
	pthread_cond_t wake;
	bool started, stop;
	kvd_client *c;
	struct slot st; /* its failures */
	struct limit budget, caps[SOAK_TENANTS_MAX];
	uint64_t polls, used_max, budget_at_max, over_polls, cap_over_polls;
	struct node_status last;
	bool have_last, dead;
};

static int status_read(kvd_client *c, struct node_status *ns) {
	static const struct {
		const char *key;
		size_t off;
	} keys[] = {
		{ "pool_bytes", offsetof(struct node_status, pool) },
		{ "budget_bytes", offsetof(struct node_status, budget) },
		{ "used_bytes", offsetof(struct node_status, used) },
		{ "block_bytes", offsetof(struct node_status, block) },
		{ "chunk_bytes", offsetof(struct node_status, chunk) },
		{ "chunks_total", offsetof(struct node_status, total) },
		{ "chunks_free", offsetof(struct node_status, free) },
		{ "chunks_draining", offsetof(struct node_status, draining) },
		{ "connections", offsetof(struct node_status, connections) },
		{ "protocol_errors", offsetof(struct node_status, protocol_errors) },
		{ "rounds_total", offsetof(struct node_status, rounds) },
	};
	_cleanup_(kvd_status_freep) kvd_status *st = NULL;
	int r;

	*ns = (struct node_status){};
	r = kvd_status_get(c, &st);
	if (r < 0)
		return r;
	for (size_t i = 0; i < ELEMENTSOF(keys); i++) {
		r = kvd_status_u64(st, keys[i].key, (uint64_t *)((char *)ns + keys[i].off));
		if (r < 0)
			return r;
	}
	/* From daemons that have a host tier. */
	(void)kvd_status_u64(st, "host_tier_sequences", &ns->tier_seqs);
	(void)kvd_status_u64(st, "host_tier_moves", &ns->tier_moves);
	(void)kvd_status_u64(st, "file_tier_bytes", &ns->file_tier);
	(void)kvd_status_u64(st, "file_tier_sequences", &ns->file_seqs);
	for (uint32_t t = 0; t < kvd_status_tenants(st); t++) {
		const char *name;
		uint32_t i;
		uint64_t seqs = 0;

		r = kvd_status_tenant_name(st, t, &name);
		if (r >= 0)
			r = kvd_status_tenant_u64(st, t, "sequences", &seqs);
		if (r < 0)
			return r;
		if (strncmp(name, "soak-", 5) != 0 || number_parse_u32(name + 5, 0, arg_tenants - 1, &i) < 0) {
			ns->other_seqs += seqs;
			continue;
		}
		ns->t_known[i] = true;
		ns->t_seqs[i] = seqs;
		r = kvd_status_tenant_u64(st, t, "used_bytes", &ns->t_used[i]);
		if (r >= 0)
			r = kvd_status_tenant_u64(st, t, "max_bytes", &ns->t_max[i]);
		if (r >= 0)
			r = kvd_status_tenant_u64(st, t, "connections", &ns->t_conns[i]);
		if (r < 0)
			return r;
	}
	ns->n_refused = MIN(kvd_status_refusals(st), (uint32_t)ELEMENTSOF(ns->refused));
	for (uint32_t i = 0; i < ns->n_refused; i++) {
		const char *name;

		r = kvd_status_refusal(st, i, &name, &ns->refused[i]);
		if (r < 0)
			return r;
		snprintf(ns->refused_name[i], sizeof(ns->refused_name[i]), "%s", name);
	}
	return 0;
}

static uint64_t refused_of(const struct node_status *ns, const char *name) {
	for (uint32_t i = 0; i < ns->n_refused; i++)
		if (strcmp(ns->refused_name[i], name) == 0)
			return ns->refused[i];
	return 0;
}

/* The admin's side of a change of l to value; call limit_changed() after it. */
static void limit_changing(struct monitor *mon, struct limit *l, uint64_t value) {
	pthread_mutex_lock(&mon->lock);
	l->hi = MAX(l->hi, value);
	l->changing++;
	l->gen++;
	l->set = true;
	pthread_mutex_unlock(&mon->lock);
}

static void limit_changed(struct monitor *mon, struct limit *l) {
	pthread_mutex_lock(&mon->lock);
	l->changing--;
	l->gen++;
	pthread_mutex_unlock(&mon->lock);
}

/*
 * Checks usage `used` against the limit `value` read in the same status, with snap the
 * state of l taken before the status was read; returns whether usage was above value.
 */
static bool limit_check(struct monitor *mon, struct limit *l, const struct limit *snap, uint64_t used,
			uint64_t value, const char *what) {
	bool over = used > value;

	if (used > MAX(value, snap->hi))
		fail(&mon->st, "monitor: %s: used_bytes %" PRIu64 " above the limit %" PRIu64 " (and every recent one, at most %" PRIu64 ")",
		     what, used, value, snap->hi);
	else if (over && l->was_over && value <= l->last_value && used > l->last_used)
		fail(&mon->st, "monitor: %s: used_bytes grew from %" PRIu64 " to %" PRIu64 " while above the limit %" PRIu64,
		     what, l->last_used, used, value);
	l->was_over = over;
	l->last_used = used;
	l->last_value = value;
	if (!over && snap->changing == 0) {
		pthread_mutex_lock(&mon->lock);
		if (l->gen == snap->gen)
			l->hi = value;
		pthread_mutex_unlock(&mon->lock);
	}
	return over;
}

static void monitor_sample(struct monitor *mon) {
	struct limit budget, caps[SOAK_TENANTS_MAX];
	struct node_status ns;
	int r;

	pthread_mutex_lock(&mon->lock);
	budget = mon->budget;
	memcpy(caps, mon->caps, sizeof(caps));
	pthread_mutex_unlock(&mon->lock);

	r = status_read(mon->c, &ns);
	if (r < 0) {
		fail(&mon->st, "monitor: kvd_status_get: %s", errno_name(r));
		/* The daemon is gone: one failure says it. */
		if (r == -ECONNRESET || r == -EPROTO)
			mon->dead = true;
		return;
	}
	mon->over_polls += limit_check(mon, &mon->budget, &budget, ns.used, ns.budget, "node budget");
	for (unsigned i = 0; i < arg_tenants; i++)
		if (ns.t_known[i]) {
			char what[48];

			snprintf(what, sizeof(what), "tenant soak-%u's max", i);
			mon->cap_over_polls += limit_check(mon, &mon->caps[i], &caps[i], ns.t_used[i], ns.t_max[i], what);
		}
	if (ns.block > ns.used)
		fail(&mon->st, "monitor: block_bytes %" PRIu64 " above used_bytes %" PRIu64, ns.block, ns.used);
	if (ns.free + ns.draining > ns.total)
		fail(&mon->st, "monitor: %" PRIu64 " chunks free and %" PRIu64 " draining of %" PRIu64, ns.free, ns.draining,
		     ns.total);
	/* Draining chunks are charged until they are free again. */
	if (ns.used != (ns.total - ns.free) * ns.chunk)
		fail(&mon->st, "monitor: used_bytes %" PRIu64 " is not the %" PRIu64 " chunks not free", ns.used,
		     ns.total - ns.free);
	if (mon->have_last && ns.protocol_errors < mon->last.protocol_errors)
		fail(&mon->st, "monitor: protocol_errors went down from %" PRIu64 " to %" PRIu64,
		     mon->last.protocol_errors, ns.protocol_errors);
	if (mon->have_last && ns.rounds < mon->last.rounds)
		fail(&mon->st, "monitor: rounds_total went down from %" PRIu64 " to %" PRIu64, mon->last.rounds,
		     ns.rounds);
	if (mon->polls == 0 || ns.used > mon->used_max) {
		mon->used_max = ns.used;
		mon->budget_at_max = ns.budget;
	}
	mon->polls++;
	mon->last = ns;
	mon->have_last = true;
}

/* Waits until the deadline-free stop or timeout ns; returns whether to stop. */
static bool monitor_wait(struct monitor *mon, uint64_t ns) {
	struct timespec ts;
	bool stop;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	ts.tv_sec += (time_t)(ns / 1000000000);
	ts.tv_nsec += (long)(ns % 1000000000);
	if (ts.tv_nsec >= 1000000000) {
		ts.tv_sec++;
		ts.tv_nsec -= 1000000000;
	}
	pthread_mutex_lock(&mon->lock);
	while (!mon->stop && pthread_cond_timedwait(&mon->wake, &mon->lock, &ts) == 0)
		;
	stop = mon->stop;
	pthread_mutex_unlock(&mon->lock);
	return stop;
}

static void *monitor_run(void *userdata) {
	struct monitor *mon = userdata;

	do
		monitor_sample(mon);
	while (!mon->dead && !monitor_wait(mon, MONITOR_NS));
	return NULL;
}

struct admin {
	pthread_t thread;
	bool started;
	struct monitor *mon;
	struct worker w; /* its client, counters and failures */
	uint64_t budget0, pool, chunk;
	bool no_budget, no_caps; /* not allowed to change them (-EPERM) */
	unsigned notes;
	char note[160];
};

static void admin_budget(struct admin *a) {
	struct worker *w = &a->w;
	uint64_t b;
	int r;

	if (a->no_budget)
		return;
	if (rng_chance(&w->rng, 10)) {
		r = kvd_budget_set(w->c, a->pool + a->chunk);
		check(w, OP_BUDGET, r, -EINVAL, 0, "kvd_budget_set(%" PRIu64 ", above the pool)", a->pool + a->chunk);
		return;
	}
	/* A quarter of the start budget to all of it, in whole chunks. */
	b = a->budget0 / 4 + rng_next(&w->rng) % (a->budget0 - a->budget0 / 4 + 1);
	b = MAX(b / a->chunk * a->chunk, a->chunk);
	limit_changing(a->mon, &a->mon->budget, b);
	r = kvd_budget_set(w->c, b);
	limit_changed(a->mon, &a->mon->budget);
	if (r == -EPERM) {
		a->no_budget = true;
		snprintf(a->note, sizeof(a->note), "budget changes refused (-EPERM: not root nor in admin-group)");
		return;
	}
	check(w, OP_BUDGET, r, 0, 0, "kvd_budget_set(%" PRIu64 ")", b);
}

static void admin_cap(struct admin *a) {
	struct worker *w = &a->w;
	unsigned t = rng_below(&w->rng, arg_tenants);
	uint64_t cap;
	char name[32];
	int r;

	if (a->no_caps)
		return;
	snprintf(name, sizeof(name), "soak-%u", t);
	if (rng_chance(&w->rng, 10)) {
		r = kvd_tenant_set(w->c, name, KVD_TENANT_KEEP, KVD_TENANT_KEEP, 100000);
		check(w, OP_TENANT_CAP, r, -EINVAL, 0, "kvd_tenant_set(%s, weight 100000)", name);
		return;
	}
	cap = (a->budget0 / 8 + rng_next(&w->rng) % a->budget0) / a->chunk * a->chunk;
	cap = rng_chance(&w->rng, 40) ? KVD_TENANT_NO_CAP : MAX(2 * a->chunk, cap);
	limit_changing(a->mon, &a->mon->caps[t], cap);
	r = kvd_tenant_set(w->c, name, KVD_TENANT_KEEP, cap, 0);
	limit_changed(a->mon, &a->mon->caps[t]);
	if (r == -EPERM) {
		a->no_caps = true;
		snprintf(a->note, sizeof(a->note), "tenant changes refused (-EPERM: not root nor in admin-group)");
		return;
	}
	/* -EINVAL is right when the tenant's min is above the new max. */
	check(w, OP_TENANT_CAP, r, 0, 0, "kvd_tenant_set(%s, max %" PRIu64 ")", name, cap);
}

static void *admin_run(void *userdata) {
	struct admin *a = userdata;
	struct worker *w = &a->w;

	while (!monitor_wait(a->mon, rng_range(&w->rng, 100, 600) * UINT64_C(1000000)) && now_ns() < w->deadline) {
		unsigned kind = rng_below(&w->rng, 100);
		uint64_t freed = 0, bytes;
		char name[32];
		int r;

		if (kind < 40) {
			w->st->ops[OP_ADMIN_EVICT].calls++;
			bytes = rng_chance(&w->rng, 40) ? 0 : rng_range(&w->rng, 1, (uint32_t)MIN(a->budget0 / 4, UINT32_MAX));
			r = kvd_evict(w->c, NULL, bytes, &freed);
			check(w, OP_ADMIN_EVICT, r, 0, R_(EBUSY), "kvd_evict(all tenants, %" PRIu64 " bytes)", bytes);
		} else if (kind < 55) {
			w->st->ops[OP_ADMIN_EVICT].calls++;
			snprintf(name, sizeof(name), "soak-%u", rng_below(&w->rng, arg_tenants));
			bytes = rng_chance(&w->rng, 40) ? 0 : rng_range(&w->rng, 1, (uint32_t)MIN(a->budget0 / 4, UINT32_MAX));
			r = kvd_evict(w->c, name, bytes, &freed);
			/* -ENOENT: the tenant has not connected yet. */
			check(w, OP_ADMIN_EVICT, r, 0, R_(EBUSY) | R_(ENOENT), "kvd_evict(%s, %" PRIu64 " bytes)", name, bytes);
		} else if (kind < 85) {
			w->st->ops[OP_BUDGET].calls++;
			admin_budget(a);
		} else {
			w->st->ops[OP_TENANT_CAP].calls++;
			admin_cap(a);
		}
		if (w->dead)
			break;
	}
	return NULL;
}

/* ---- The parent ---- */

struct tenant0 {
	bool known, live;  /* known at the start; any of min, max, weight set live */
	uint64_t max;
};

/* Puts back the budget and the caps the admin changed. */
static void admin_restore(struct admin *a, const char *budget_source, const struct tenant0 *t0) {
	struct worker *w = &a->w;
	int r;

	if (a->mon->budget.set) {
		limit_changing(a->mon, &a->mon->budget, a->budget0);
		if (strcmp(budget_source, "live") == 0) {
			r = kvd_budget_set(w->c, a->budget0);
			check(w, OP_BUDGET, r, 0, 0, "kvd_budget_set(%" PRIu64 ") to restore it", a->budget0);
		} else {
			r = kvd_budget_reset(w->c);
			check(w, OP_BUDGET, r, 0, 0, "kvd_budget_reset to restore the budget");
		}
		limit_changed(a->mon, &a->mon->budget);
	}
	for (unsigned i = 0; i < arg_tenants; i++) {
		char name[32];

		if (!a->mon->caps[i].set)
			continue;
		snprintf(name, sizeof(name), "soak-%u", i);
		limit_changing(a->mon, &a->mon->caps[i], t0[i].known ? t0[i].max : KVD_TENANT_NO_CAP);
		if (t0[i].live) {
			r = kvd_tenant_set(w->c, name, KVD_TENANT_KEEP, t0[i].max, 0);
			check(w, OP_TENANT_CAP, r, 0, 0, "kvd_tenant_set(%s, max %" PRIu64 ") to restore it", name, t0[i].max);
		} else {
			r = kvd_tenant_reset(w->c, name);
			check(w, OP_TENANT_CAP, r, 0, 0, "kvd_tenant_reset(%s) to restore it", name);
		}
		limit_changed(a->mon, &a->mon->caps[i]);
	}
}

/* What the start looked like: the budget's source and each soak tenant's settings. */
static int read_start(kvd_client *c, char *budget_source, size_t n, struct tenant0 *t0) {
	_cleanup_(kvd_status_freep) kvd_status *st = NULL;
	const char *s;
	int r;

	r = kvd_status_get(c, &st);
	if (r < 0)
		return r;
	snprintf(budget_source, n, "%s", kvd_status_str(st, "budget_source", &s) >= 0 ? s : "default");
	for (uint32_t t = 0; t < kvd_status_tenants(st); t++) {
		static const char *const keys[] = { "min_source", "max_source", "weight_source" };
		const char *name;
		uint32_t i;

		if (kvd_status_tenant_name(st, t, &name) < 0 || strncmp(name, "soak-", 5) != 0 ||
		    number_parse_u32(name + 5, 0, arg_tenants - 1, &i) < 0)
			continue;
		t0[i].known = true;
		if (kvd_status_tenant_u64(st, t, "max_bytes", &t0[i].max) < 0)
			t0[i].max = KVD_TENANT_NO_CAP;
		for (size_t k = 0; k < ELEMENTSOF(keys); k++)
			if (kvd_status_tenant_str(st, t, keys[k], &s) >= 0 && strcmp(s, "live") == 0)
				t0[i].live = true;
	}
	return 0;
}

/* Whether the daemon is idle: nothing held, nobody but us connected. */
static bool idle(const struct node_status *ns) {
	uint64_t seqs = ns->other_seqs;

	for (unsigned i = 0; i < arg_tenants; i++)
		seqs += ns->t_seqs[i];
	return ns->used == 0 && ns->block == 0 && ns->free == ns->total && ns->draining == 0 &&
	       ns->connections == 1 && seqs == 0 && ns->tier_seqs == 0 && ns->tier_moves == 0 &&
	       ns->file_seqs == 0;
}

/* Waits up to IDLE_WAIT_MS for idle(); returns the last status read, or a negative errno. */
static int wait_idle(kvd_client *c, struct node_status *ns) {
	int r = 0;

	for (unsigned i = 0; i < IDLE_WAIT_MS / 20; i++) {
		r = status_read(c, ns);
		if (r < 0 || idle(ns))
			return r;
		sleep_ns(20 * 1000000);
	}
	return r;
}

/* The sum over every slot and the admin. */
static void totals(const struct shared *sh, const struct slot *admin, struct slot *sum) {
	unsigned n = arg_tenants * arg_clients;

	*sum = (struct slot){};
	for (unsigned s = 0; s <= n; s++) {
		const struct slot *st = s < n ? &sh->slots[s] : admin;

		for (unsigned o = 0; o < OP_MAX; o++) {
			sum->ops[o].calls += st->ops[o].calls;
			sum->ops[o].injected += st->ops[o].injected;
			sum->ops[o].refused += st->ops[o].refused;
			sum->ops[o].unexpected += st->ops[o].unexpected;
		}
		for (unsigned k = 0; k < RAW_MAX; k++)
			sum->raw[k] += st->raw[k];
		for (unsigned k = 0; k < REFUSAL_MAX; k++)
			sum->refusals[k] += st->refusals[k];
		sum->protocol_errors += st->protocol_errors;
		sum->frames_refused += st->frames_refused;
		sum->bytes_written += st->bytes_written;
		sum->bytes_verified += st->bytes_verified;
		sum->digests += st->digests;
		sum->mismatched_bytes += st->mismatched_bytes;
		sum->digest_mismatches += st->digest_mismatches;
		sum->windows += st->windows;
		sum->seq_changed += st->seq_changed;
		sum->recalls += st->recalls;
		sum->lost += st->lost;
		sum->file_recalls += st->file_recalls;
		sum->token_recalls += st->token_recalls;
		sum->tokens_back += st->tokens_back;
		sum->checks_failed += st->checks_failed;
		sum->lives += st->lives;
		sum->exits += st->exits;
		sum->kills += st->kills;
		sum->cuts += st->cuts;
		sum->n_fails += st->n_fails;
	}
}

/* The checks of the end, one line each in failed[] (n at most). */
struct verdict {
	char lines[16][FAIL_BYTES];
	unsigned n;
};

static _printf_(2, 3) void verdict_fail(struct verdict *v, const char *fmt, ...) {
	va_list ap;

	if (v->n == ELEMENTSOF(v->lines))
		return;
	va_start(ap, fmt);
	vsnprintf(v->lines[v->n++], FAIL_BYTES, fmt, ap);
	va_end(ap);
}

static void json_string(const char *s) {
	putchar('"');
	for (; *s; s++) {
		if (*s == '"' || *s == '\\')
			printf("\\%c", *s);
		else if ((unsigned char)*s < 0x20)
			printf("\\u%04x", (unsigned char)*s);
		else
			putchar(*s);
	}
	putchar('"');
}

struct report {
	double secs;
	const struct slot *sum;
	const struct monitor *mon;
	const struct node_status *start, *end;
	const struct verdict *v;
	const struct shared *sh;
	const struct admin *admin;
	bool have_end; /* the end's status could be read */
	uint64_t ops, injected, refused, unexpected;
};

static void report_failures(const struct report *rp, FILE *f) {
	unsigned n = arg_tenants * arg_clients;

	for (unsigned s = 0; s <= n + 1; s++) {
		const struct slot *st = s < n ? &rp->sh->slots[s] : s == n ? &rp->admin->w.st[0] : &rp->mon->st;

		for (uint32_t i = 0; i < MIN(st->n_fails, (uint32_t)FAILS_KEPT); i++)
			fprintf(f, "kvd-soak: %s\n", st->fails[i]);
		if (st->n_fails > FAILS_KEPT)
			fprintf(f, "kvd-soak: (%u more from the same process slot)\n", st->n_fails - FAILS_KEPT);
		if (st->first_mismatch[0])
			fprintf(f, "kvd-soak: first mismatch: %s\n", st->first_mismatch);
	}
	for (unsigned i = 0; i < rp->v->n; i++)
		fprintf(f, "kvd-soak: check failed: %s\n", rp->v->lines[i]);
}

static void report_text(const struct report *rp) {
	const struct slot *sum = rp->sum;
	char a[32], b[32], c[32], d[32];

	printf("duration: %.1f s, %u slots, %" PRIu64 " client processes (%" PRIu64 " exited, %" PRIu64
	       " killed themselves abruptly), %" PRIu64 " connections cut\n",
	       rp->secs, arg_tenants * arg_clients, sum->lives, sum->exits, sum->kills, sum->cuts);
	printf("%-12s %10s %9s %9s %10s\n", "OPERATION", "CALLS", "INJECTED", "REFUSED", "UNEXPECTED");
	for (unsigned o = 0; o < OP_MAX; o++)
		printf("%-12s %10" PRIu64 " %9" PRIu64 " %9" PRIu64 " %10" PRIu64 "\n", op_names[o], sum->ops[o].calls,
		       sum->ops[o].injected, sum->ops[o].refused, sum->ops[o].unexpected);
	printf("%-12s %10" PRIu64 " %9" PRIu64 " %9" PRIu64 " %10" PRIu64 "\n", "total", rp->ops, rp->injected,
	       rp->refused, rp->unexpected);
	printf("raw frames:");
	for (unsigned k = 0; k < RAW_MAX; k++)
		printf(" %s %" PRIu64, raw_names[k], sum->raw[k]);
	printf("\nrefused at limits:");
	for (unsigned k = 0; k < REFUSAL_MAX; k++)
		printf(" %s %" PRIu64, errno_name(-refusal_errno[k]), sum->refusals[k]);
	printf("\nerrors injected: %" PRIu64 ", unexpected errors: %" PRIu64 ", failed checks: %" PRIu64 "\n",
	       rp->injected, rp->unexpected, sum->checks_failed);
	printf("data: %s written, %s verified, %" PRIu64 " digests compared, %" PRIu64 " mismatched bytes, %" PRIu64
	       " digest mismatches, %" PRIu64 " windows published, %" PRIu64 " KVD_EVENT_SEQ_CHANGED\n",
	       size_format(sum->bytes_written, a, sizeof(a)), size_format(sum->bytes_verified, b, sizeof(b)), sum->digests,
	       sum->mismatched_bytes, sum->digest_mismatches, sum->windows, sum->seq_changed);
	if (arg_tiers)
		printf("tiers: %" PRIu64 " pins brought a sequence back (%" PRIu64 " from the file), %"
		       PRIu64 " found it lost; %" PRIu64 " token recalls traded %" PRIu64 " slots back\n",
		       sum->recalls, sum->file_recalls, sum->lost, sum->token_recalls, sum->tokens_back);
	printf("memory: max used %s (budget then %s; start budget %s, chunk %s), %" PRIu64 " polls, %" PRIu64
	       " above a lowered budget, %" PRIu64 " tenant polls above a lowered max\n",
	       size_format(rp->mon->used_max, a, sizeof(a)), size_format(rp->mon->budget_at_max, b, sizeof(b)),
	       size_format(rp->start->budget, c, sizeof(c)), size_format(rp->start->chunk, d, sizeof(d)),
	       rp->mon->polls, rp->mon->over_polls, rp->mon->cap_over_polls);
	if (!rp->have_end) {
		printf("end: no status from the daemon\n");
		goto notes;
	}
	printf("rounds: %" PRIu64 "; protocol errors: +%" PRIu64 " (expected %" PRIu64 ")\n",
	       rp->end->rounds - rp->start->rounds, rp->end->protocol_errors - rp->start->protocol_errors,
	       sum->protocol_errors);
	printf("refusals by limit:");
	for (uint32_t i = 0; i < rp->end->n_refused; i++)
		printf(" %s %" PRIu64, rp->end->refused_name[i],
		       rp->end->refused[i] - refused_of(rp->start, rp->end->refused_name[i]));
	printf("\nend: used %" PRIu64 ", block %" PRIu64 ", chunks free %" PRIu64 " of %" PRIu64 ", draining %" PRIu64
	       ", connections %" PRIu64 "\n",
	       rp->end->used, rp->end->block, rp->end->free, rp->end->total, rp->end->draining, rp->end->connections);
notes:
	if (rp->admin->note[0])
		printf("note: %s\n", rp->admin->note);
}

static void report_json(const struct report *rp, bool ok) {
	const struct slot *sum = rp->sum;
	unsigned n = arg_tenants * arg_clients;

	printf("{\"duration_s\":%.3f,\"tenants\":%u,\"clients\":%u,\"seed\":%" PRIu64 ",\"evict\":%s,", rp->secs,
	       arg_tenants, arg_clients, arg_seed, arg_evict ? "true" : "false");
	printf("\"processes\":%" PRIu64 ",\"exits\":%" PRIu64 ",\"kills\":%" PRIu64 ",\"cuts\":%" PRIu64 ",", sum->lives,
	       sum->exits, sum->kills, sum->cuts);
	printf("\"operations\":{");
	for (unsigned o = 0; o < OP_MAX; o++)
		printf("%s\"%s\":{\"calls\":%" PRIu64 ",\"injected\":%" PRIu64 ",\"refused\":%" PRIu64 ",\"unexpected\":%" PRIu64 "}",
		       o ? "," : "", op_names[o], sum->ops[o].calls, sum->ops[o].injected, sum->ops[o].refused,
		       sum->ops[o].unexpected);
	printf("},\"raw\":{");
	for (unsigned k = 0; k < RAW_MAX; k++)
		printf("%s\"%s\":%" PRIu64, k ? "," : "", raw_names[k], sum->raw[k]);
	printf("},\"refused_errno\":{");
	for (unsigned k = 0; k < REFUSAL_MAX; k++)
		printf("%s\"%s\":%" PRIu64, k ? "," : "", errno_name(-refusal_errno[k]), sum->refusals[k]);
	printf("},\"operations_total\":%" PRIu64 ",\"errors_injected\":%" PRIu64 ",\"refused_total\":%" PRIu64
	       ",\"unexpected_errors\":%" PRIu64 ",\"checks_failed\":%" PRIu64 ",",
	       rp->ops, rp->injected, rp->refused, rp->unexpected, sum->checks_failed);
	printf("\"bytes_written\":%" PRIu64 ",\"bytes_verified\":%" PRIu64 ",\"digests\":%" PRIu64
	       ",\"mismatched_bytes\":%" PRIu64 ",\"digest_mismatches\":%" PRIu64 ",\"windows\":%" PRIu64
	       ",\"seq_changed\":%" PRIu64 ",",
	       sum->bytes_written, sum->bytes_verified, sum->digests, sum->mismatched_bytes, sum->digest_mismatches,
	       sum->windows, sum->seq_changed);
	printf("\"used_bytes_max\":%" PRIu64 ",\"budget_bytes_at_max\":%" PRIu64 ",\"budget_bytes\":%" PRIu64
	       ",\"chunk_bytes\":%" PRIu64 ",\"polls\":%" PRIu64 ",\"polls_over_lowered_budget\":%" PRIu64 ",",
	       rp->mon->used_max, rp->mon->budget_at_max, rp->start->budget, rp->start->chunk, rp->mon->polls,
	       rp->mon->over_polls);
	printf("\"protocol_errors_expected\":%" PRIu64 ",", sum->protocol_errors);
	if (rp->have_end)
		printf("\"rounds\":%" PRIu64 ",\"protocol_errors\":%" PRIu64 ",", rp->end->rounds - rp->start->rounds,
		       rp->end->protocol_errors - rp->start->protocol_errors);
	printf("\"refusals\":{");
	for (uint32_t i = 0; rp->have_end && i < rp->end->n_refused; i++) {
		printf("%s", i ? "," : "");
		json_string(rp->end->refused_name[i]);
		printf(":%" PRIu64, rp->end->refused[i] - refused_of(rp->start, rp->end->refused_name[i]));
	}
	printf("},");
	if (rp->have_end)
		printf("\"end\":{\"used_bytes\":%" PRIu64 ",\"block_bytes\":%" PRIu64 ",\"chunks_free\":%" PRIu64
		       ",\"chunks_total\":%" PRIu64 ",\"chunks_draining\":%" PRIu64 ",\"connections\":%" PRIu64 "},",
		       rp->end->used, rp->end->block, rp->end->free, rp->end->total, rp->end->draining,
		       rp->end->connections);
	printf("\"failures\":[");
	{
		bool first = true;

		for (unsigned s = 0; s <= n + 1; s++) {
			const struct slot *st = s < n ? &rp->sh->slots[s] : s == n ? &rp->admin->w.st[0] : &rp->mon->st;

			for (uint32_t i = 0; i < MIN(st->n_fails, (uint32_t)FAILS_KEPT); i++) {
				printf("%s", first ? "" : ",");
				json_string(st->fails[i]);
				first = false;
			}
		}
		for (unsigned i = 0; i < rp->v->n; i++) {
			printf("%s", first ? "" : ",");
			json_string(rp->v->lines[i]);
			first = false;
		}
	}
	printf("],\"ok\":%s}\n", ok ? "true" : "false");
}

static int run_soak(void) {
	_cleanup_(kvd_client_unrefp) kvd_client *mc = NULL;
	struct shared *sh;
	struct monitor mon = {};
	struct admin adm = {};
	struct slot admin_slot = {}, sum;
	struct node_status start, end = {};
	struct tenant0 t0[SOAK_TENANTS_MAX] = {};
	struct verdict v = {};
	struct report rp = {};
	char budget_source[32];
	_cleanup_(closep) int go_w = -EBADF;
	uint64_t t_start, t_end;
	pid_t sup;
	int go[2], status, r;
	bool ok;

	sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (sh == MAP_FAILED) {
		fprintf(stderr, "kvd-soak: mmap: %m\n");
		return EXIT_FAILURE;
	}
	if (pipe2(go, O_CLOEXEC) < 0) {
		fprintf(stderr, "kvd-soak: pipe: %m\n");
		return EXIT_FAILURE;
	}
	/* Before any connection and any thread. */
	fflush(stdout);
	sup = fork();
	if (sup < 0) {
		fprintf(stderr, "kvd-soak: fork: %m\n");
		return EXIT_FAILURE;
	}
	if (sup == 0) {
		pid_t parent = getppid();

		safe_close(go[1]);
		if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != parent)
			_exit(EXIT_FAILURE);
		supervise(sh, go[0]);
	}
	safe_close(go[0]);
	go_w = go[1];

	r = kvd_client_connect(arg_socket, NULL, &mc);
	if (r < 0) {
		fprintf(stderr, "kvd-soak: connect to %s: %s\n", arg_socket, strerror(-r));
		goto abort;
	}
	r = wait_idle(mc, &start);
	if (r < 0) {
		fprintf(stderr, "kvd-soak: kvd_status_get: %s\n", strerror(-r));
		goto abort;
	}
	if (!idle(&start)) {
		fprintf(stderr, "kvd-soak: the daemon at %s is not idle (used %" PRIu64 " bytes, %" PRIu64
			" connections but ours, %" PRIu64 " chunks draining): the soak needs a daemon of its own\n",
			arg_socket, start.used, start.connections - 1, start.draining);
		goto abort;
	}
	for (unsigned i = 0; arg_tiers && i < arg_tenants; i++) {
		/* And token recall: what rounds evict is kept, and new windows ask for it. */
		kvd_tenant_params p = { .size = sizeof(p), .set = KVD_TENANT_SET_TIER | KVD_TENANT_SET_RECALL,
			                .tier = start.file_tier ? "host+file" : "host", .recall = 32 };
		char name[32];

		snprintf(name, sizeof(name), "soak-%u", i);
		r = kvd_tenant_set_params(mc, name, &p);
		if (r < 0) {
			fprintf(stderr, "kvd-soak: --tiers: tenant %s: %s (%s)\n", name, strerror(-r),
			        kvd_client_last_error(mc));
			goto abort;
		}
	}
	r = read_start(mc, budget_source, sizeof(budget_source), t0);
	if (r < 0) {
		fprintf(stderr, "kvd-soak: kvd_status_get: %s\n", strerror(-r));
		goto abort;
	}
	if (!arg_json) {
		printf("kvd-soak: %u tenant%s x %u client%s, %u s, seed %" PRIu64 ", eviction %s, socket %s\n",
		       arg_tenants, arg_tenants == 1 ? "" : "s", arg_clients, arg_clients == 1 ? "" : "s", arg_duration,
		       arg_seed, arg_evict ? "on" : "off", arg_socket);
		fflush(stdout);
	}

	mon.c = mc;
	mon.budget.hi = start.budget;
	for (unsigned i = 0; i < arg_tenants; i++)
		mon.caps[i].hi = t0[i].known ? t0[i].max : KVD_TENANT_NO_CAP;
	pthread_mutex_init(&mon.lock, NULL);
	{
		pthread_condattr_t attr;

		pthread_condattr_init(&attr);
		pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
		pthread_cond_init(&mon.wake, &attr);
		pthread_condattr_destroy(&attr);
	}

	t_start = now_ns();
	sh->deadline_ns = t_start + (uint64_t)arg_duration * 1000000000;
	if (arg_evict) {
		adm.mon = &mon;
		adm.budget0 = start.budget;
		adm.pool = start.pool;
		adm.chunk = start.chunk;
		adm.w.st = &admin_slot;
		adm.w.rng = mix64(arg_seed ^ UINT64_C(0xad));
		adm.w.deadline = sh->deadline_ns;
		snprintf(adm.w.name, sizeof(adm.w.name), "admin");
		snprintf(adm.w.who, sizeof(adm.w.who), "admin (pid %d)", (int)getpid());
		admin_slot.lives = 0;
		r = kvd_client_connect(arg_socket, NULL, &adm.w.c);
		if (r < 0) {
			fprintf(stderr, "kvd-soak: connect to %s: %s\n", arg_socket, strerror(-r));
			goto abort;
		}
	}
	r = -pthread_create(&mon.thread, NULL, monitor_run, &mon);
	if (r < 0) {
		fprintf(stderr, "kvd-soak: pthread_create: %s\n", strerror(-r));
		adm.w.c = kvd_client_unref(adm.w.c);
		goto abort;
	}
	mon.started = true;
	if (arg_evict && pthread_create(&adm.thread, NULL, admin_run, &adm) == 0)
		adm.started = true;
	else if (arg_evict)
		fail(&admin_slot, "admin: pthread_create failed");

	if (write(go_w, "G", 1) != 1)
		fprintf(stderr, "kvd-soak: cannot start the clients: %m\n");
	go_w = safe_close(go_w);
	while (waitpid(sup, &status, 0) < 0)
		if (errno != EINTR) {
			status = -1;
			break;
		}
	t_end = now_ns();
	if (status != 0)
		verdict_fail(&v, "the supervisor process ended with status %d", status);

	if (adm.started) {
		pthread_mutex_lock(&mon.lock);
		pthread_cond_broadcast(&mon.wake);
		pthread_mutex_unlock(&mon.lock);
		pthread_join(adm.thread, NULL);
	}
	if (adm.w.c) {
		admin_restore(&adm, budget_source, t0);
		adm.w.c = kvd_client_unref(adm.w.c);
	}
	pthread_mutex_lock(&mon.lock);
	mon.stop = true;
	pthread_cond_broadcast(&mon.wake);
	pthread_mutex_unlock(&mon.lock);
	pthread_join(mon.thread, NULL);

	/* Everything the clients held must come back once they are gone. */
	r = wait_idle(mc, &end);
	if (r < 0)
		verdict_fail(&v, "kvd_status_get at the end: %s", strerror(-r));
	else {
		for (unsigned i = 0; i < arg_tenants; i++) {
			if (end.t_seqs[i] != 0 || end.t_used[i] != 0 || end.t_conns[i] != 0)
				verdict_fail(&v, "tenant soak-%u still has %" PRIu64 " sequences, %" PRIu64 " bytes, %" PRIu64 " connections",
					     i, end.t_seqs[i], end.t_used[i], end.t_conns[i]);
		}
		if (end.used != 0 || end.block != 0)
			verdict_fail(&v, "used_bytes %" PRIu64 " and block_bytes %" PRIu64 " at the end, expected 0", end.used,
				     end.block);
		if (end.free != end.total || end.draining != 0)
			verdict_fail(&v, "%" PRIu64 " chunks free of %" PRIu64 " and %" PRIu64 " draining at the end", end.free,
				     end.total, end.draining);
		if (end.connections != 1)
			verdict_fail(&v, "%" PRIu64 " connections at the end, expected 1 (the monitor)", end.connections);
		if (end.other_seqs != 0)
			verdict_fail(&v, "%" PRIu64 " sequences of other tenants at the end", end.other_seqs);
		if (end.budget != start.budget)
			verdict_fail(&v, "budget_bytes %" PRIu64 " at the end, %" PRIu64 " at the start", end.budget, start.budget);
	}
	totals(sh, &admin_slot, &sum);
	if (r >= 0 && end.protocol_errors - start.protocol_errors != sum.protocol_errors)
		verdict_fail(&v, "protocol_errors grew by %" PRIu64 ", the raw frames sent account for %" PRIu64,
			     end.protocol_errors - start.protocol_errors, sum.protocol_errors);
	if (r >= 0 && refused_of(&end, "frame") - refused_of(&start, "frame") != sum.frames_refused)
		verdict_fail(&v, "refused frames grew by %" PRIu64 ", the raw frames sent account for %" PRIu64,
			     refused_of(&end, "frame") - refused_of(&start, "frame"), sum.frames_refused);
	if (mon.polls == 0)
		verdict_fail(&v, "the monitor never read status");

	rp = (struct report){
		.secs = (double)(t_end - t_start) / 1e9,
		.sum = &sum,
		.mon = &mon,
		.start = &start,
		.end = &end,
		.v = &v,
		.sh = sh,
		.admin = &adm,
		.have_end = r >= 0,
	};
	adm.w.st = &admin_slot;
	for (unsigned o = 0; o < OP_MAX; o++) {
		rp.ops += sum.ops[o].calls;
		rp.injected += sum.ops[o].injected;
		rp.refused += sum.ops[o].refused;
		rp.unexpected += sum.ops[o].unexpected;
	}
	ok = v.n == 0 && sum.n_fails == 0 && mon.st.n_fails == 0 && sum.mismatched_bytes == 0 &&
	     sum.digest_mismatches == 0;
	report_failures(&rp, stderr);
	if (arg_json)
		report_json(&rp, ok);
	else {
		report_text(&rp);
		printf("soak: %s\n", ok ? "OK" : "FAILED");
	}
	pthread_cond_destroy(&mon.wake);
	pthread_mutex_destroy(&mon.lock);
	munmap(sh, sizeof(*sh));
	return ok ? EXIT_SUCCESS : EXIT_FAILURE;

abort:
	/* No go: the supervisor sees the pipe close and exits. */
	go_w = safe_close(go_w);
	while (waitpid(sup, &status, 0) < 0 && errno == EINTR)
		;
	munmap(sh, sizeof(*sh));
	return EXIT_FAILURE;
}

/* ---- Options ---- */

static void help(void) {
	printf("Usage: kvd-soak [OPTIONS]\n"
	       "\n"
	       "Soak test of a running daemon, which it must have to itself: --tenants x\n"
	       "--clients client processes (tenants soak-0, soak-1, ...) do weighted random\n"
	       "valid and invalid operations until the deadline: register models (and invalid\n"
	       "shapes), open, grow (also past max_tokens and the budget), write a pattern into\n"
	       "every new K/V row, verify sequences (every resident byte against its original\n"
	       "position; daemon and library digests), pin, unpin without pin, release, digest,\n"
	       "drain events, read status, send invalid frames on a raw socket, cut their\n"
	       "connection and end abruptly (a new process takes over). A monitor reads status\n"
	       "every 50 ms: used_bytes never above the budget (or, just after the budget was\n"
	       "lowered, above the one before), nor a tenant's above its max. At the end the\n"
	       "daemon must hold nothing (used and block bytes 0, every chunk free, none\n"
	       "draining, no sequences, one connection: the monitor's), and protocol_errors must\n"
	       "have grown by what the raw frames account for.\n"
	       "\n"
	       "Options:\n"
	       "  --socket PATH       Daemon socket (default: $KVD_SOCKET if set, else %s)\n"
	       "  --duration SECONDS  How long the clients run, 1..%u (default: 10)\n"
	       "  --tenants N         Tenants, 1..%u (default: 3)\n"
	       "  --clients N         Client processes per tenant, 1..%u (default: 3)\n"
	       "  --seed S            Seed of every random choice (default: from the clock;\n"
	       "                      printed, though timing makes runs differ anyway)\n"
	       "  --evict             The even tenants (soak-0, soak-2, ...) register most of\n"
	       "                      their models with eviction, pin sequences around steps\n"
	       "                      and checks, and publish observation windows; an admin\n"
	       "                      connection asks for eviction rounds and changes the\n"
	       "                      budget and the tenants' max now and then (restored at\n"
	       "                      the end); all tenants ask for rounds on themselves\n"
	       "  --tiers             Every tenant's tier is host (the daemon needs a host\n"
	       "                      tier), or host+file where it has a file tier: idle\n"
	       "                      sequences move out whole and come back at\n"
	       "                      their next pin or grow; clients pin around every write\n"
	       "                      and digest, and leave sequences a pin found lost alone;\n"
	       "                      token recall is on (32 tokens per row): after each\n"
	       "                      window, a recall, and every resident slot checked\n"
	       "  --json              Print the summary as one JSON object\n"
	       "  -h --help           Show this help and exit\n"
	       "  --version           Show the version and exit\n"
	       "\n"
	       "Failures (unexpected errors with the call and the daemon's message, broken\n"
	       "invariants, mismatches) go to standard error, the summary (operations by kind,\n"
	       "errors injected, refusals, bytes verified, peak usage, rounds, refusals by\n"
	       "limit) to standard output.\n"
	       "\n"
	       "Exit status: 0 when every check passed, 1 when one failed, 2 on usage errors.\n",
	       KVD_DEFAULT_SOCKET, SOAK_DURATION_MAX, SOAK_TENANTS_MAX, SOAK_CLIENTS_MAX);
}

#define usage_error(...) cli_usage_error("kvd-soak", __VA_ARGS__)

int main(int argc, char **argv) {
	enum { OPT_SOCKET = 0x100, OPT_DURATION, OPT_TENANTS, OPT_CLIENTS, OPT_SEED, OPT_EVICT, OPT_TIERS,
	       OPT_JSON, OPT_VERSION };
	static const struct option options[] = {
		{ "socket", required_argument, NULL, OPT_SOCKET },
		{ "duration", required_argument, NULL, OPT_DURATION },
		{ "tenants", required_argument, NULL, OPT_TENANTS },
		{ "clients", required_argument, NULL, OPT_CLIENTS },
		{ "seed", required_argument, NULL, OPT_SEED },
		{ "evict", no_argument, NULL, OPT_EVICT },
		{ "tiers", no_argument, NULL, OPT_TIERS },
		{ "json", no_argument, NULL, OPT_JSON },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, OPT_VERSION },
		{},
	};
	bool seeded = false;
	uint32_t v;
	int opt;

	arg_socket = getenv("KVD_SOCKET");
	if (!arg_socket || !*arg_socket)
		arg_socket = KVD_DEFAULT_SOCKET;
	optind = 0;
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case OPT_SOCKET:
			arg_socket = optarg;
			break;
		case OPT_DURATION:
			if (number_parse_u32(optarg, 1, SOAK_DURATION_MAX, &v) < 0)
				return usage_error("--duration: '%s' is not in 1..%u", optarg, SOAK_DURATION_MAX);
			arg_duration = v;
			break;
		case OPT_TENANTS:
			if (number_parse_u32(optarg, 1, SOAK_TENANTS_MAX, &v) < 0)
				return usage_error("--tenants: '%s' is not in 1..%u", optarg, SOAK_TENANTS_MAX);
			arg_tenants = v;
			break;
		case OPT_CLIENTS:
			if (number_parse_u32(optarg, 1, SOAK_CLIENTS_MAX, &v) < 0)
				return usage_error("--clients: '%s' is not in 1..%u", optarg, SOAK_CLIENTS_MAX);
			arg_clients = v;
			break;
		case OPT_SEED:
			if (number_parse_u64(optarg, 0, UINT64_MAX, &arg_seed) < 0)
				return usage_error("--seed: '%s' is not a number", optarg);
			seeded = true;
			break;
		case OPT_EVICT:
			arg_evict = 1;
			break;
		case OPT_TIERS:
			arg_tiers = 1;
			break;
		case OPT_JSON:
			arg_json = 1;
			break;
		case 'h':
			help();
			return EXIT_SUCCESS;
		case OPT_VERSION:
			printf("kvd-soak %s (libkvd %s)\n", KVD_VERSION, kvd_version());
			return EXIT_SUCCESS;
		default:
			return usage_error("bad option");
		}
	if (optind < argc)
		return usage_error("unexpected argument '%s'", argv[optind]);
	if (!seeded)
		arg_seed = mix64(now_ns() ^ ((uint64_t)getpid() << 32));

	/* A client that dies must not kill whoever writes to it; sends use MSG_NOSIGNAL. */
	signal(SIGPIPE, SIG_IGN);
	setvbuf(stdout, NULL, _IOLBF, 0);
	return run_soak();
}
