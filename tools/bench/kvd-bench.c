/* SPDX-License-Identifier: MIT */
/*
 * kvd-bench: load generator and end-to-end checker for kvd; `kvd-bench score` (score.c)
 * times the scoring kernels and policies next to the machine's ceilings, `kvd-bench evict`
 * (evict.c) the node-wide eviction selection.
 *
 * `load` forks one client process per tenant. Each registers its own model shape and
 * layout, opens sequences, grows them round-robin in prefill-sized steps and writes a
 * pattern into every new K and V row through its own mapping of the pool. With --verify it
 * reads every resident byte back and asks the daemon for a digest of what it sees through
 * its mapping, so that a block handed to two owners, a wrong address or a stale mapping
 * shows up as a mismatch. The pattern of a byte depends on (tenant, sequence, layer,
 * kv head, original position, byte offset, K or V), so bytes that land in the wrong place
 * never compare equal by accident.
 *
 * Children report to the parent through one pipe each: a 'R' byte when set up, a 'H' byte
 * when holding (--hold), then 'D' and a struct report followed by the latency samples. A
 * shared "go" pipe, closed by the parent, starts every child's load at the same moment, so
 * that the aggregate rate is measured over one common interval.
 *
 * With --unit the models are registered with eviction, and the daemon may drop tokens of
 * any sequence that is not pinned. Each child then pins a sequence around its step (grow,
 * write the new rows, publish the observation windows) and around its verification, finds
 * the new rows by their original positions rather than by slot, drains its events after
 * every step (the library gives chunks back inside kvd_client_next_event), and writes a
 * pattern of numbers instead of raw hash bytes, since the daemon computes with K and V. The
 * parent polls the node's usage every 100 ms for the peak.
 */

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "latency.h"
#include "common/digest.h"
#include "common/layout.h"
#include "basic/macro.h"
#include "basic/number.h"
#include "basic/size.h"
#include "config.h"
#include "dtype.h"
#include "kvd/kvd.h"
#include "basic/io-util.h"
#include "basic/time-util.h"
#include "cli.h"

#define TENANTS_MAX 16
#define SEQS_MAX 4096
#define TOKENS_MAX (1u << 20)
#define HOLD_MAX 3600
/* Bounds the latency sample arrays, i.e. the parent's memory. */
#define GROWS_PER_TENANT_MAX (1u << 22)
/* Eviction: leading positions every table keeps, and the observation window's range. */
#define EVICT_SINKS 4
/* --over-budget: how long one refused grow is retried, and the pause between tries. */
#define GROW_WAIT_NS (UINT64_C(5) * 1000000000)
#define GROW_RETRY_NS (UINT64_C(2) * 1000000)
/* The parent's usage poll (--unit). */
#define POLL_NS (UINT64_C(100) * 1000000)

/* Longest "layers,q_heads,kv_heads,head_dim,dtype,block_tokens,layout", with room. */
#define SHAPE_MAX 96

struct shape {
	uint32_t layers, q_heads, kv_heads, head_dim, dtype, block_tokens, layout;
};

static const struct shape default_shapes[] = {
	{ 4, 8, 2, 64, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER },
	{ 6, 8, 4, 32, KVD_DTYPE_BF16, 32, KVD_LAYOUT_PER_HEAD },
	{ 2, 4, 4, 64, KVD_DTYPE_F32, 16, KVD_LAYOUT_PER_HEAD },
};

static const char *arg_socket;
static unsigned arg_tenants = 3;
/* --tenant NAME (repeated): the tenants' names, in order; the others are bench-<i>. */
static const char *arg_tenant_names[TENANTS_MAX];
static unsigned arg_n_tenant_names;
static unsigned arg_seqs = 8;
static unsigned arg_tokens = 4096;
static unsigned arg_step = 16;
static unsigned arg_hold;
static int arg_verify;
static struct shape arg_models[TENANTS_MAX];
static unsigned arg_n_models;
static uint32_t arg_unit = KVD_UNIT_NONE;
static uint32_t arg_window = 32;
static int arg_observe;
static int arg_over_budget;

/* What a child sends to the parent after its run. Both sides are the same binary. */
struct report {
	int32_t error; /* 0, or the negative errno of the first failure */
	char message[512];
	char first_mismatch[128];
	uint64_t grows, releases;
	uint64_t sequences, tokens; /* tokens per (layer, kv head), summed over sequences */
	uint64_t kv_bytes;          /* resident K/V bytes at the end of the growth */
	uint64_t tenant_used_bytes; /* the tenant's chunk bytes then, from status */
	uint64_t bytes_written, bytes_verified;
	uint64_t write_ns, verify_ns;
	uint64_t windows, observe_ns; /* --observe: windows published, time spent making them */
	uint64_t grow_start_ns, grow_end_ns; /* CLOCK_MONOTONIC, shared by all processes */
	uint64_t mismatched_bytes, digests_compared, digest_mismatches;
	uint64_t n_grow_lat, n_release_lat; /* samples (ns) that follow the report */
	/* With --unit. */
	uint64_t resident_slots;    /* resident slots at the end, summed over tables and sequences */
	uint64_t evicted_bytes, evicted_tokens, rounds; /* the tenant's during the run, from status */
	uint64_t grows_waited;      /* grows refused at least once, then granted (--over-budget) */
	uint64_t grows_failed;      /* grows still refused after GROW_WAIT_NS */
	uint64_t wait_ns;           /* time spent waiting for those */
	uint64_t seq_changed;       /* KVD_EVENT_SEQ_CHANGED events */
	uint64_t needles, needles_resident; /* needle rows (--observe), per (layer, kv head) */
};


static const char *dtype_name(uint32_t d) {
	return d == KVD_DTYPE_F16 ? "f16" : d == KVD_DTYPE_BF16 ? "bf16" : d == KVD_DTYPE_F32 ? "f32" : "?";
}

static const char *unit_name(uint32_t u) {
	return u == KVD_UNIT_HEAD_TOKEN ? "head" : u == KVD_UNIT_LAYER_TOKEN ? "layer" : u == KVD_UNIT_BLOCK ? "block" : "none";
}

static const char *layout_name(uint32_t l) {
	return l == KVD_LAYOUT_PER_LAYER ? "per_layer" : l == KVD_LAYOUT_PER_HEAD ? "per_head" : "?";
}

static void shape_format(const struct shape *s, char *buf, size_t n) {
	snprintf(buf, n, "%u,%u,%u,%u,%s,%u,%s", s->layers, s->q_heads, s->kv_heads, s->head_dim,
		 dtype_name(s->dtype), s->block_tokens, layout_name(s->layout));
}

static struct shape shape_of_tenant(unsigned i) {
	struct shape s;

	if (i < arg_n_models)
		return arg_models[i];
	s = default_shapes[i % ELEMENTSOF(default_shapes)];
	s.layers += i / ELEMENTSOF(default_shapes);
	/* Per-head eviction needs per-head tables. */
	if (arg_unit == KVD_UNIT_HEAD_TOKEN)
		s.layout = KVD_LAYOUT_PER_HEAD;
	return s;
}

/* SPEC = layers,q_heads,kv_heads,head_dim,dtype,block_tokens,layout. Range checks beyond
 * the basic ones are the daemon's, so that its own message says what is wrong. */
static int shape_parse(const char *spec, struct shape *ret) {
	_cleanup_(freep) char *copy = strdup(spec);
	char *field[7], *p, *save = NULL;
	unsigned n = 0;
	struct shape s;

	if (!copy)
		return -ENOMEM;
	for (p = strtok_r(copy, ",", &save); p; p = strtok_r(NULL, ",", &save)) {
		if (n == ELEMENTSOF(field))
			return -EINVAL;
		field[n++] = p;
	}
	if (n != ELEMENTSOF(field))
		return -EINVAL;
	if (number_parse_u32(field[0], 1, UINT32_MAX, &s.layers) < 0 ||
	    number_parse_u32(field[1], 1, UINT32_MAX, &s.q_heads) < 0 ||
	    number_parse_u32(field[2], 1, UINT32_MAX, &s.kv_heads) < 0 ||
	    number_parse_u32(field[3], 1, UINT32_MAX, &s.head_dim) < 0 ||
	    number_parse_u32(field[5], 1, UINT32_MAX, &s.block_tokens) < 0)
		return -EINVAL;
	if (strcmp(field[4], "f16") == 0)
		s.dtype = KVD_DTYPE_F16;
	else if (strcmp(field[4], "bf16") == 0)
		s.dtype = KVD_DTYPE_BF16;
	else if (strcmp(field[4], "f32") == 0)
		s.dtype = KVD_DTYPE_F32;
	else
		return -EINVAL;
	if (strcmp(field[6], "per_layer") == 0)
		s.layout = KVD_LAYOUT_PER_LAYER;
	else if (strcmp(field[6], "per_head") == 0)
		s.layout = KVD_LAYOUT_PER_HEAD;
	else
		return -EINVAL;
	/* head_dim * 4 bytes must fit the row buffer's size_t and the daemon's u32 checks. */
	if (s.head_dim > 65536)
		return -EINVAL;
	*ret = s;
	return 0;
}

/* ---- The pattern ---- */

/* splitmix64's finaliser: cheap, and every output bit depends on every input bit. */
static inline uint64_t mix64(uint64_t x) {
	x ^= x >> 30;
	x *= UINT64_C(0xbf58476d1ce4e5b9);
	x ^= x >> 27;
	x *= UINT64_C(0x94d049bb133111eb);
	x ^= x >> 31;
	return x;
}

static uint64_t row_seed(uint32_t tenant, uint32_t seq, uint32_t layer, uint32_t head,
			 uint32_t position, int is_v) {
	uint64_t h = mix64(UINT64_C(0x6b76642d62656e63) ^ tenant);

	h = mix64(h ^ seq);
	h = mix64(h ^ layer);
	h = mix64(h ^ head);
	h = mix64(h ^ position);
	return mix64(h ^ (uint64_t)is_v);
}

/* Byte i of the row is byte i % 8 of mix64(seed ^ offset-of-its-word * odd constant). */
static void pattern_fill(unsigned char *dst, size_t n, uint64_t seed) {
	size_t off;

	for (off = 0; off + 8 <= n; off += 8) {
		uint64_t w = mix64(seed ^ (off * UINT64_C(0x9e3779b97f4a7c15)));

		memcpy(dst + off, &w, 8);
	}
	if (off < n) {
		uint64_t w = mix64(seed ^ (off * UINT64_C(0x9e3779b97f4a7c15)));

		memcpy(dst + off, &w, n - off);
	}
}

/*
 * The same words made into finite numbers, for eviction (--unit), where the daemon scores
 * K and V: in each element the sign and mantissa bits stay, and two hash bits pick the
 * exponent, so every value lies in +-[1/16, 1), or +-[1/8, 2) with `up` 1 (the needles'
 * keys, see below). Lanes never carry into each other.
 */
static inline uint64_t numeric_word(uint64_t w, uint32_t dtype, uint64_t up) {
	switch (dtype) {
	case KVD_DTYPE_F16: /* exponents 11..14 of bias 15 */
		return (w & UINT64_C(0x83ff83ff83ff83ff)) |
		       ((((w >> 10) & UINT64_C(0x0003000300030003)) + (11 + up) * UINT64_C(0x0001000100010001)) << 10);
	case KVD_DTYPE_BF16: /* exponents 123..126 of bias 127 */
		return (w & UINT64_C(0x807f807f807f807f)) |
		       ((((w >> 7) & UINT64_C(0x0003000300030003)) + (123 + up) * UINT64_C(0x0001000100010001)) << 7);
	default: /* f32, the same exponents */
		return (w & UINT64_C(0x807fffff807fffff)) |
		       ((((w >> 23) & UINT64_C(0x0000000300000003)) + (123 + up) * UINT64_C(0x0000000100000001)) << 23);
	}
}

static void pattern_fill_numeric(unsigned char *dst, size_t n, uint64_t seed, uint32_t dtype, uint64_t up) {
	size_t off;

	for (off = 0; off + 8 <= n; off += 8) {
		uint64_t w = numeric_word(mix64(seed ^ (off * UINT64_C(0x9e3779b97f4a7c15))), dtype, up);

		memcpy(dst + off, &w, 8);
	}
	/* Rows are whole elements, and a word holds whole elements: the tail is too. */
	if (off < n) {
		uint64_t w = numeric_word(mix64(seed ^ (off * UINT64_C(0x9e3779b97f4a7c15))), dtype, up);

		memcpy(dst + off, &w, n - off);
	}
}

/* fp32 to bf16 and f16, rounded to nearest even; the values here are normal and small. */
static uint16_t f32_to_bf16(float f) {
	uint32_t u;

	memcpy(&u, &f, 4);
	return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static void store_f32(void *row, uint32_t dtype, size_t i, float f) {
	uint16_t h;

	switch (dtype) {
	case KVD_DTYPE_F16:
		h = kvd_f32_to_f16(f);
		memcpy((uint16_t *)row + i, &h, 2);
		break;
	case KVD_DTYPE_BF16:
		h = f32_to_bf16(f);
		memcpy((uint16_t *)row + i, &h, 2);
		break;
	default:
		memcpy((float *)row + i, &f, 4);
		break;
	}
}

/* A uniform float in [-1, 1) from 24 bits of h. */
static inline float unit_float(uint64_t h) {
	return (float)(h & 0xffffff) * (2.0f / 16777216.0f) - 1.0f;
}

/* ---- The child ---- */

/* The needle positions of one (sequence, layer), ascending (--observe). */
struct needles {
	uint32_t *pos;
	float *keys; /* [cap][kv_heads][head_dim]: each needle's K rows, times its c (below) */
	uint32_t n, cap;
};

struct child {
	unsigned index;
	struct shape shape;
	char tenant[32];
	kvd_client *client;
	kvd_seq **seqs;
	uint32_t n_seqs;
	uint64_t row_bytes;
	unsigned char *expect; /* one row */
	uint64_t *grow_lat, *release_lat;
	struct needles *needles; /* [seqs][layers], with --observe */
	float *qrow;             /* head_dim floats, with --observe */
	uint64_t evict_base[3];  /* evicted_bytes, evicted_tokens, rounds at the start */
	struct report rep;
};

static _printf_(3, 4) int child_fail(struct child *ch, int r, const char *fmt, ...) {
	const char *msg = ch->client ? kvd_client_last_error(ch->client) : "";
	char what[256];
	va_list ap;

	if (ch->rep.error != 0)
		return r;
	va_start(ap, fmt);
	vsnprintf(what, sizeof(what), fmt, ap);
	va_end(ap);
	ch->rep.error = r;
	if (msg && *msg)
		snprintf(ch->rep.message, sizeof(ch->rep.message), "%s: %s: %s", what, strerror(-r), msg);
	else
		snprintf(ch->rep.message, sizeof(ch->rep.message), "%s: %s", what, strerror(-r));
	return r;
}

/* Returns 0, -EPIPE at end of file before n bytes, or another negative errno. */
static int read_all(int fd, void *buf, size_t n) {
	char *p = buf;

	while (n > 0) {
		ssize_t k = read(fd, p, n);

		if (k < 0) {
			if (errno == EINTR)
				continue;
			return negative_errno();
		}
		if (k == 0)
			return -EPIPE;
		p += k;
		n -= (size_t)k;
	}
	return 0;
}

static void sleep_ns(uint64_t ns) {
	struct timespec ts = { .tv_sec = (time_t)(ns / 1000000000), .tv_nsec = (long)(ns % 1000000000) };

	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

static int needle_is(const struct child *ch, uint32_t seq, uint32_t layer, uint32_t position);

/* The pattern of the K (is_v 0) or V row of (sequence seq, layer, kv head, position). */
static void row_fill(const struct child *ch, unsigned char *dst, uint32_t seq, uint32_t layer,
		     uint32_t head, uint32_t position, int is_v) {
	uint64_t seed = row_seed(ch->index, seq, layer, head, position, is_v);

	if (arg_unit == KVD_UNIT_NONE)
		pattern_fill(dst, ch->row_bytes, seed);
	else
		pattern_fill_numeric(dst, ch->row_bytes, seed, ch->shape.dtype,
				     arg_observe && !is_v && needle_is(ch, seq, layer, position));
}

/*
 * Reads what the daemon sent (the library gives back the chunks it asks for on the way) and
 * counts the sequence rewrites. Only with eviction on, where chunks move while we run.
 */
static int child_events(struct child *ch) {
	kvd_event ev;
	int r;

	if (arg_unit == KVD_UNIT_NONE)
		return 0;
	while ((r = kvd_client_next_event(ch->client, &ev)) > 0)
		if (ev.type == KVD_EVENT_SEQ_CHANGED)
			ch->rep.seq_changed++;
	if (r < 0)
		return child_fail(ch, r, "kvd_client_next_event");
	return 0;
}

static int child_pin(struct child *ch, uint32_t i) {
	int r;

	if (arg_unit == KVD_UNIT_NONE)
		return 0;
	r = kvd_seq_pin(ch->seqs[i]);
	if (r < 0)
		return child_fail(ch, r, "kvd_seq_pin(seq %u)", i);
	return 0;
}

static int child_unpin(struct child *ch, uint32_t i) {
	int r;

	if (arg_unit == KVD_UNIT_NONE)
		return 0;
	r = kvd_seq_unpin(ch->seqs[i]);
	if (r < 0)
		return child_fail(ch, r, "kvd_seq_unpin(seq %u)", i);
	return 0;
}

/*
 * Writes the pattern into the rows that the last grow of sequence i added: the n newest
 * slots of every (layer, kv head), which must hold original positions p0 .. p0+n-1. Without
 * eviction the table holds exactly p0 + n slots; with it, fewer may be left of the older
 * ones (the sequence is pinned, so nothing moves while we write).
 */
static int child_write(struct child *ch, uint32_t i, uint32_t p0, uint32_t n) {
	const struct shape *sh = &ch->shape;
	kvd_seq *s = ch->seqs[i];
	uint64_t t0 = now_ns();

	for (uint32_t l = 0; l < sh->layers; l++)
		for (uint32_t h = 0; h < sh->kv_heads; h++) {
			int64_t have = kvd_seq_tokens(s, l, h);

			if (have < 0)
				return child_fail(ch, (int)have, "kvd_seq_tokens(seq %u, layer %u, head %u)", i, l, h);
			if (arg_unit == KVD_UNIT_NONE ? have != (int64_t)p0 + n : have < n || have > (int64_t)p0 + n)
				return child_fail(ch, -EIO, "seq %u, layer %u, head %u holds %" PRId64 " tokens after growing to %u",
						  i, l, h, have, p0 + n);
			for (uint32_t j = 0; j < n; j++) {
				uint32_t slot = (uint32_t)have - n + j;
				void *k, *v;
				int64_t pos;
				int r;

				pos = kvd_seq_position(s, l, h, slot);
				if (pos < 0)
					return child_fail(ch, (int)pos, "kvd_seq_position(seq %u, layer %u, head %u, slot %u)",
							  i, l, h, slot);
				if (pos != (int64_t)p0 + j)
					return child_fail(ch, -EIO, "seq %u, layer %u, head %u: new slot %u holds position %" PRId64 ", expected %u",
							  i, l, h, slot, pos, p0 + j);
				r = kvd_seq_kv(s, l, h, slot, &k, &v);
				if (r < 0)
					return child_fail(ch, r, "kvd_seq_kv(seq %u, layer %u, head %u, slot %u)",
							  i, l, h, slot);
				row_fill(ch, k, i, l, h, (uint32_t)pos, 0);
				row_fill(ch, v, i, l, h, (uint32_t)pos, 1);
				ch->rep.bytes_written += 2 * ch->row_bytes;
			}
		}
	ch->rep.write_ns += now_ns() - t0;
	return 0;
}

/* ---- Observation windows (--observe) ----
 *
 * The queries are built so that a few tokens draw attention and most do not, as in a real
 * model, and so that the tokens that matter are known:
 *   - in each (sequence, layer), about 1 original position in 64 is a "needle"
 *     (needle_is(): a hash of tenant, sequence, layer and position), and its K rows are
 *     twice the size of the others (row_fill());
 *   - the query of position p and query head qh is
 *         q = sum_{j < QUERY_NEEDLES} c_j k_j + u,   c_j = QUERY_LOGIT sqrt(head_dim) / |k_j|^2,
 *     where k_j is the K row (the bench's pattern, so known without reading it back) of
 *     qh's kv head at a needle position below p, picked by a hash of (p, qh, j), and u is
 *     noise uniform in +-QUERY_NOISE per element. Then q.k_j / sqrt(head_dim) is about
 *     QUERY_LOGIT for the picked needles, while for any other key the term is a sum of
 *     products of independent signs, of standard deviation about QUERY_LOGIT / (2
 *     sqrt(head_dim)) (the 2 from the needles' larger keys): the needles take most of the
 *     softmax mass (about 90% at head_dim 32 and 4096 tokens, more at 64). Before the
 *     first needle q is noise alone.
 * A window holds the queries of the last `window` positions, oldest first; it is written
 * after every step once the sequence has grown that far. The query of a position depends
 * only on the position (its needles lie below it), so the windows of successive steps
 * agree where they overlap, as real queries would.
 */
#define NEEDLE_MASK 63
#define QUERY_NEEDLES 2
#define QUERY_LOGIT 12.0f
#define QUERY_NOISE 0.25f

static int needle_is(const struct child *ch, uint32_t seq, uint32_t layer, uint32_t position) {
	return (row_seed(ch->index, seq, layer, UINT32_MAX, position, 2) & NEEDLE_MASK) == 0;
}

/* Records the needles among positions p0 .. p0+n-1 of sequence i, with their K rows
 * times c (the pattern, as row_fill() writes it). */
static int needles_add(struct child *ch, uint32_t i, uint32_t p0, uint32_t n) {
	const struct shape *sh = &ch->shape;
	size_t row = (size_t)sh->kv_heads * sh->head_dim;

	for (uint32_t l = 0; l < sh->layers; l++) {
		struct needles *nd = &ch->needles[(size_t)i * sh->layers + l];

		for (uint32_t p = p0; p < p0 + n; p++) {
			if (!needle_is(ch, i, l, p))
				continue;
			if (nd->n == nd->cap) {
				uint32_t cap = nd->cap ? 2 * nd->cap : 16;
				uint32_t *pos = realloc(nd->pos, cap * sizeof(uint32_t));
				float *keys;

				if (!pos)
					return child_fail(ch, -ENOMEM, "allocating needles");
				nd->pos = pos;
				keys = realloc(nd->keys, cap * row * sizeof(float));
				if (!keys)
					return child_fail(ch, -ENOMEM, "allocating needles");
				nd->keys = keys;
				nd->cap = cap;
			}
			for (uint32_t h = 0; h < sh->kv_heads; h++) {
				float *k = nd->keys + nd->n * row + (size_t)h * sh->head_dim, norm2 = 0.0f, c;

				row_fill(ch, ch->expect, i, l, h, p, 0);
				kvd_row_to_f32(ch->expect, sh->dtype, sh->head_dim, k);
				for (uint32_t e = 0; e < sh->head_dim; e++)
					norm2 += k[e] * k[e];
				c = QUERY_LOGIT * sqrtf((float)sh->head_dim) / norm2;
				for (uint32_t e = 0; e < sh->head_dim; e++)
					k[e] *= c;
			}
			nd->pos[nd->n++] = p;
		}
	}
	return 0;
}

/* How many needles lie below position p. */
static uint32_t needles_below(const struct needles *nd, uint32_t p) {
	uint32_t lo = 0, hi = nd->n;

	while (lo < hi) {
		uint32_t mid = lo + (hi - lo) / 2;

		if (nd->pos[mid] < p)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

/* The query of position p and query head qh in the layer whose needles are nd and whose
 * seed is layer_seed, into ch->qrow. */
static void query_row(struct child *ch, const struct needles *nd, uint64_t layer_seed, uint32_t qh,
		      uint32_t p) {
	const struct shape *sh = &ch->shape;
	uint32_t group = sh->kv_heads && sh->q_heads >= sh->kv_heads ? sh->q_heads / sh->kv_heads : 1;
	uint32_t kv_head = MIN(qh / group, sh->kv_heads - 1), below = needles_below(nd, p);
	uint64_t seed = mix64(layer_seed ^ ((uint64_t)p << 32 | qh)), x = seed | 1;
	float *q = ch->qrow;

	/* xorshift64, four 16-bit uniforms a step. */
	for (uint32_t e = 0; e < sh->head_dim; e += 4) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		for (uint32_t b = 0; b < 4 && e + b < sh->head_dim; b++)
			q[e + b] = QUERY_NOISE * ((float)((x >> (16 * b)) & 0xffff) * (2.0f / 65536.0f) - 1.0f);
	}
	for (uint32_t j = 0; j < QUERY_NEEDLES && below > 0; j++) {
		uint32_t at = (uint32_t)(mix64(seed + j + 1) % below);
		const float *k = nd->keys + ((size_t)at * sh->kv_heads + kv_head) * sh->head_dim;

		for (uint32_t e = 0; e < sh->head_dim; e++)
			q[e] += k[e];
	}
}

/* Writes and publishes the window of every layer of sequence i, which has grown to `end`. */
static int child_observe(struct child *ch, uint32_t i, uint32_t end) {
	const struct shape *sh = &ch->shape;
	kvd_seq *s = ch->seqs[i];
	size_t es = layout_dtype_bytes(sh->dtype);
	uint64_t t0 = now_ns();

	if (end < arg_window)
		return 0;
	for (uint32_t l = 0; l < sh->layers; l++) {
		unsigned char *window;
		void *q;
		int r;

		const struct needles *nd = &ch->needles[(size_t)i * sh->layers + l];
		uint64_t layer_seed = row_seed(ch->index, i, l, UINT32_MAX, UINT32_MAX, 3);

		r = kvd_seq_observation(s, l, &q);
		if (r < 0)
			return child_fail(ch, r, "kvd_seq_observation(seq %u, layer %u)", i, l);
		window = q;
		for (uint32_t qh = 0; qh < sh->q_heads; qh++)
			for (uint32_t j = 0; j < arg_window; j++) {
				unsigned char *row = window + ((size_t)qh * arg_window + j) * sh->head_dim * es;

				query_row(ch, nd, layer_seed, qh, end - arg_window + j);
				for (uint32_t e = 0; e < sh->head_dim; e++)
					store_f32(row, sh->dtype, e, ch->qrow[e]);
			}
		r = kvd_seq_observe(s, l);
		if (r < 0)
			return child_fail(ch, r, "kvd_seq_observe(seq %u, layer %u)", i, l);
		ch->rep.windows++;
	}
	ch->rep.observe_ns += now_ns() - t0;
	return 0;
}

/* Gives the daemon a random W_o for every layer: fp32, hidden = q_heads * head_dim, entries
 * uniform with variance 1 / hidden. */
static int child_output_proj(struct child *ch, int model_id) {
	uint32_t hidden = ch->shape.q_heads * ch->shape.head_dim;
	size_t n = (size_t)hidden * hidden;
	float amp = sqrtf(3.0f / (float)hidden);
	_cleanup_(freep) float *wo = malloc(n * sizeof(float));

	if (!wo)
		return child_fail(ch, -ENOMEM, "allocating W_o (%u x %u)", hidden, hidden);
	for (uint32_t l = 0; l < ch->shape.layers; l++) {
		uint64_t seed = row_seed(ch->index, UINT32_MAX, l, UINT32_MAX, UINT32_MAX, 4);
		int r;

		for (size_t x = 0; x < n; x++)
			wo[x] = amp * unit_float(mix64(seed ^ x));
		r = kvd_model_output_proj(ch->client, model_id, l, KVD_DTYPE_F32, hidden, wo);
		if (r < 0)
			return child_fail(ch, r, "kvd_model_output_proj(layer %u, hidden %u)", l, hidden);
	}
	return 0;
}

/* ---- Load and verification ---- */

static uint64_t count_diff(const unsigned char *a, const unsigned char *b, size_t n) {
	uint64_t d = 0;

	for (size_t i = 0; i < n; i++)
		d += a[i] != b[i];
	return d;
}

/*
 * Re-reads every resident row of sequence i in digest order (layer, kv head, slot; K then
 * V), compares it with the pattern of the row's original position, and folds the expected
 * bytes into a digest, so that the daemon's digest is checked against what was meant to be
 * written, not only against what this process reads back. With eviction the sequence is
 * pinned meanwhile, and each table must also hold ascending positions below `grown`, the
 * first EVICT_SINKS positions and the last `window` ones (never evicted).
 */
static int child_verify(struct child *ch, uint32_t i, uint32_t grown) {
	const struct shape *sh = &ch->shape;
	kvd_seq *s = ch->seqs[i];
	uint64_t t0 = now_ns(), expect = DIGEST_INIT, d_daemon, d_local;
	uint32_t sinks = MIN(EVICT_SINKS, grown), window = MIN(arg_window, grown);
	int r;

	r = child_pin(ch, i);
	if (r < 0)
		return r;
	for (uint32_t l = 0; l < sh->layers; l++)
		for (uint32_t h = 0; h < sh->kv_heads; h++) {
			int64_t n = kvd_seq_tokens(s, l, h), prev = -1;
			uint32_t in_sinks = 0, in_window = 0;

			if (n < 0)
				return child_fail(ch, (int)n, "kvd_seq_tokens(seq %u, layer %u, head %u)", i, l, h);
			if (arg_unit == KVD_UNIT_NONE && n != arg_tokens)
				return child_fail(ch, -EIO, "seq %u, layer %u, head %u holds %" PRId64 " tokens, expected %u",
						  i, l, h, n, arg_tokens);
			if (n > grown)
				return child_fail(ch, -EIO, "seq %u, layer %u, head %u holds %" PRId64 " tokens of %u grown",
						  i, l, h, n, grown);
			for (uint32_t slot = 0; slot < (uint32_t)n; slot++) {
				const unsigned char *row[2];
				void *k, *v;
				int64_t pos;

				pos = kvd_seq_position(s, l, h, slot);
				if (pos < 0)
					return child_fail(ch, (int)pos, "kvd_seq_position(seq %u, layer %u, head %u, slot %u)",
							  i, l, h, slot);
				if (pos <= prev || pos >= grown)
					return child_fail(ch, -EIO, "seq %u, layer %u, head %u, slot %u holds position %" PRId64 " after %" PRId64 " (%u grown)",
							  i, l, h, slot, pos, prev, grown);
				prev = pos;
				in_sinks += pos < sinks;
				in_window += pos >= grown - window;
				r = kvd_seq_kv(s, l, h, slot, &k, &v);
				if (r < 0)
					return child_fail(ch, r, "kvd_seq_kv(seq %u, layer %u, head %u, slot %u)",
							  i, l, h, slot);
				row[0] = k;
				row[1] = v;
				for (int kv = 0; kv < 2; kv++) {
					row_fill(ch, ch->expect, i, l, h, (uint32_t)pos, kv);
					if (memcmp(row[kv], ch->expect, ch->row_bytes) != 0) {
						if (ch->rep.mismatched_bytes == 0)
							snprintf(ch->rep.first_mismatch, sizeof(ch->rep.first_mismatch),
								 "seq %u, layer %u, head %u, slot %u (position %" PRId64 "), %s row",
								 i, l, h, slot, pos, kv ? "V" : "K");
						ch->rep.mismatched_bytes +=
							count_diff(row[kv], ch->expect, ch->row_bytes);
					}
					expect = digest_update(expect, ch->expect, ch->row_bytes);
				}
				ch->rep.bytes_verified += 2 * ch->row_bytes;
			}
			if (in_sinks != sinks || in_window != window)
				return child_fail(ch, -EIO, "seq %u, layer %u, head %u lost protected tokens: holds %u of the first %u positions and %u of the last %u",
						  i, l, h, in_sinks, sinks, in_window, window);
		}
	ch->rep.verify_ns += now_ns() - t0;

	r = kvd_seq_digest(s, &d_daemon, &d_local);
	if (r < 0)
		return child_fail(ch, r, "kvd_seq_digest(seq %u)", i);
	ch->rep.digests_compared++;
	if (d_daemon != expect || d_local != expect) {
		ch->rep.digest_mismatches++;
		if (ch->rep.digest_mismatches == 1 && ch->rep.error == 0)
			snprintf(ch->rep.message, sizeof(ch->rep.message),
				 "seq %u digest: daemon %016" PRIx64 ", local %016" PRIx64 ", expected %016" PRIx64,
				 i, d_daemon, d_local, expect);
	}
	r = child_unpin(ch, i);
	if (r < 0)
		return r;
	return child_events(ch);
}

/*
 * The tenant's chunk bytes (ret_used, may be NULL) and, with eviction, its lifetime counters
 * evicted_bytes, evicted_tokens and rounds (ret_evict), from status. With missing_ok, a
 * tenant that status does not list (yet) reads as zeros.
 */
static int child_tenant_status(struct child *ch, int missing_ok, uint64_t *ret_used, uint64_t ret_evict[3]) {
	static const char *const evict_keys[] = { "evicted_bytes", "evicted_tokens", "rounds" };
	_cleanup_(kvd_status_freep) kvd_status *st = NULL;
	uint32_t n;
	int r;

	r = kvd_status_get(ch->client, &st);
	if (r < 0)
		return child_fail(ch, r, "kvd_status_get");
	n = kvd_status_tenants(st);
	for (uint32_t t = 0; t < n; t++) {
		const char *name;

		r = kvd_status_tenant_name(st, t, &name);
		if (r < 0)
			return child_fail(ch, r, "kvd_status_tenant_name(%u)", t);
		if (strcmp(name, ch->tenant) != 0)
			continue;
		if (ret_used) {
			r = kvd_status_tenant_u64(st, t, "used_bytes", ret_used);
			if (r < 0)
				return child_fail(ch, r, "kvd_status_tenant_u64(%s, used_bytes)", ch->tenant);
		}
		for (size_t x = 0; arg_unit != KVD_UNIT_NONE && x < ELEMENTSOF(evict_keys); x++) {
			r = kvd_status_tenant_u64(st, t, evict_keys[x], &ret_evict[x]);
			if (r < 0)
				return child_fail(ch, r, "kvd_status_tenant_u64(%s, %s)", ch->tenant, evict_keys[x]);
		}
		return 0;
	}
	if (missing_ok)
		return 0;
	return child_fail(ch, -ENOENT, "status lists no tenant %s", ch->tenant);
}

/* The tenant's usage at the end, and what was evicted from it during the run. */
static int child_tenant_usage(struct child *ch) {
	uint64_t ev[3] = {};
	int r;

	r = child_tenant_status(ch, 0, &ch->rep.tenant_used_bytes, ev);
	if (r < 0)
		return r;
	ch->rep.evicted_bytes = ev[0] - ch->evict_base[0];
	ch->rep.evicted_tokens = ev[1] - ch->evict_base[1];
	ch->rep.rounds = ev[2] - ch->evict_base[2];
	return 0;
}

static int child_setup(struct child *ch) {
	kvd_eviction_spec ev = { .unit = arg_unit, .window = arg_window, .sinks = EVICT_SINKS };
	kvd_model_spec spec;
	char model[48];
	int model_id, r;

	r = kvd_client_connect(arg_socket, ch->tenant, &ch->client);
	if (r < 0)
		return child_fail(ch, r, "connect to %s as %s", arg_socket, ch->tenant);
	/* The counters are the tenant's since the daemon started: report this run's part. */
	if (arg_unit != KVD_UNIT_NONE) {
		r = child_tenant_status(ch, 1, NULL, ch->evict_base);
		if (r < 0)
			return r;
	}

	snprintf(model, sizeof(model), "%s-model", ch->tenant);
	spec = (kvd_model_spec){
		.name = model,
		.layers = ch->shape.layers,
		.q_heads = ch->shape.q_heads,
		.kv_heads = ch->shape.kv_heads,
		.head_dim = ch->shape.head_dim,
		.dtype = ch->shape.dtype,
		.block_tokens = ch->shape.block_tokens,
		.layout = ch->shape.layout,
	};
	if (arg_unit == KVD_UNIT_NONE) {
		model_id = kvd_model_register(ch->client, &spec);
		if (model_id < 0)
			return child_fail(ch, model_id, "kvd_model_register");
	} else {
		model_id = kvd_model_register_evictable(ch->client, &spec, &ev);
		if (model_id < 0)
			return child_fail(ch, model_id, "kvd_model_register_evictable");
	}
	if (arg_observe) {
		r = child_output_proj(ch, model_id);
		if (r < 0)
			return r;
	}

	for (uint32_t i = 0; i < arg_seqs; i++) {
		r = kvd_seq_open(ch->client, model_id, arg_tokens, &ch->seqs[i]);
		if (r < 0)
			return child_fail(ch, r, "kvd_seq_open(seq %u, max_tokens %u)", i, arg_tokens);
		ch->n_seqs++;
	}
	ch->rep.sequences = ch->n_seqs;
	return 0;
}

/*
 * One step of sequence i, which holds positions below p0: grow it by n tokens, write their
 * rows and, with --observe, its windows. With eviction the sequence stays pinned throughout,
 * so that the daemon moves nothing under the writes. With --over-budget a grow refused for
 * want of memory is retried for up to GROW_WAIT_NS, unpinned meanwhile so that the round
 * it set off may take from this sequence too. One latency sample per step: its last grow
 * call.
 */
static int child_step(struct child *ch, uint32_t i, uint32_t p0, uint32_t n) {
	uint64_t *lat = &ch->grow_lat[ch->rep.n_grow_lat++], waiting_since = 0;
	int r;

	for (;;) {
		uint64_t t0;

		r = child_pin(ch, i);
		if (r < 0)
			return r;
		t0 = now_ns();
		r = kvd_seq_grow(ch->seqs[i], n);
		*lat = now_ns() - t0;
		if (r >= 0)
			break;
		if (!arg_over_budget || (r != -ENOSPC && r != -EDQUOT))
			return child_fail(ch, r, "kvd_seq_grow(seq %u, +%u tokens at %u)", i, n, p0);
		if (waiting_since == 0)
			waiting_since = t0;
		else if (now_ns() - waiting_since >= GROW_WAIT_NS) {
			ch->rep.grows_failed++;
			ch->rep.wait_ns += now_ns() - waiting_since;
			return child_fail(ch, r, "kvd_seq_grow(seq %u, +%u tokens at %u), still refused after %.1f s",
					  i, n, p0, (double)(now_ns() - waiting_since) / 1e9);
		}
		r = child_unpin(ch, i);
		if (r >= 0)
			r = child_events(ch);
		if (r < 0)
			return r;
		sleep_ns(GROW_RETRY_NS);
	}
	ch->rep.grows++;
	if (waiting_since != 0) {
		ch->rep.grows_waited++;
		ch->rep.wait_ns += now_ns() - waiting_since;
	}

	r = child_write(ch, i, p0, n);
	if (r >= 0 && arg_observe) {
		r = needles_add(ch, i, p0, n);
		if (r >= 0)
			r = child_observe(ch, i, p0 + n);
	}
	if (r < 0)
		return r;
	r = child_unpin(ch, i);
	if (r < 0)
		return r;
	return child_events(ch);
}

/* With eviction: what the sequences still hold, and how many of the needles. */
static int child_census(struct child *ch) {
	const struct shape *sh = &ch->shape;
	int r;

	for (uint32_t i = 0; i < ch->n_seqs; i++) {
		r = child_pin(ch, i);
		if (r < 0)
			return r;
		for (uint32_t l = 0; l < sh->layers; l++) {
			if (arg_observe)
				ch->rep.needles += (uint64_t)ch->needles[(size_t)i * sh->layers + l].n * sh->kv_heads;
			for (uint32_t h = 0; h < sh->kv_heads; h++) {
				int64_t n = kvd_seq_tokens(ch->seqs[i], l, h);

				if (n < 0)
					return child_fail(ch, (int)n, "kvd_seq_tokens(seq %u, layer %u, head %u)", i, l, h);
				ch->rep.resident_slots += (uint64_t)n;
				for (uint32_t slot = 0; arg_observe && slot < (uint32_t)n; slot++) {
					int64_t pos = kvd_seq_position(ch->seqs[i], l, h, slot);

					if (pos < 0)
						return child_fail(ch, (int)pos, "kvd_seq_position(seq %u, layer %u, head %u, slot %u)",
								  i, l, h, slot);
					ch->rep.needles_resident += needle_is(ch, i, l, (uint32_t)pos);
				}
			}
		}
		r = child_unpin(ch, i);
		if (r < 0)
			return r;
	}
	ch->rep.kv_bytes = ch->rep.resident_slots * 2 * ch->row_bytes;
	return child_events(ch);
}

static int child_load(struct child *ch) {
	_cleanup_(freep) uint32_t *done = calloc(arg_seqs, sizeof(uint32_t));
	unsigned left = arg_seqs;
	int r = 0, q;

	if (!done)
		return child_fail(ch, -ENOMEM, "allocating");

	ch->rep.grow_start_ns = now_ns();
	while (left > 0 && r >= 0)
		for (uint32_t i = 0; i < arg_seqs && r >= 0; i++) {
			uint32_t n = MIN(arg_step, arg_tokens - done[i]);

			if (n == 0)
				continue;
			r = child_step(ch, i, done[i], n);
			if (r < 0)
				break;
			done[i] += n;
			ch->rep.tokens += n;
			if (done[i] == arg_tokens)
				left--;
		}
	ch->rep.grow_end_ns = now_ns();
	/* Every resident byte was written once: that is the K/V the tenant holds, also when
	 * a grow was refused half-way. With eviction, it is what survived. */
	ch->rep.kv_bytes = ch->rep.bytes_written;
	if (arg_unit != KVD_UNIT_NONE) {
		q = child_census(ch);
		r = r < 0 ? r : q;
	}

	/* Usage is worth reporting after a refusal too: it shows where the limit bit. */
	q = child_tenant_usage(ch);
	return r < 0 ? r : q;
}

static void child_release(struct child *ch) {
	for (uint32_t i = 0; i < ch->n_seqs; i++) {
		uint64_t t0 = now_ns();
		int r;

		r = kvd_seq_release(ch->seqs[i]);
		ch->seqs[i] = NULL;
		ch->release_lat[ch->rep.n_release_lat++] = now_ns() - t0;
		if (r < 0)
			child_fail(ch, r, "kvd_seq_release(seq %u)", i);
		else
			ch->rep.releases++;
	}
	ch->n_seqs = 0;
}

/* --hold: keeps the sequences; with eviction, answers the daemon's requests meanwhile. */
static void child_hold(struct child *ch) {
	uint64_t end = now_ns() + (uint64_t)arg_hold * 1000000000;

	if (arg_unit == KVD_UNIT_NONE) {
		sleep_ns((uint64_t)arg_hold * 1000000000);
		return;
	}
	for (uint64_t t = now_ns(); t < end && ch->rep.error == 0; t = now_ns()) {
		child_events(ch);
		sleep_ns(MIN(POLL_NS, end - t));
	}
}

/* Tenant i's name: the i-th --tenant, else bench-<i>. */
static const char *tenant_name(unsigned i) {
	static char buf[TENANTS_MAX][24];

	if (i < arg_n_tenant_names)
		return arg_tenant_names[i];
	snprintf(buf[i % TENANTS_MAX], sizeof(buf[0]), "bench-%u", i);
	return buf[i % TENANTS_MAX];
}

static int child_main(unsigned index, int out_fd, int go_fd) {
	uint64_t grows = (uint64_t)arg_seqs * DIV_ROUND_UP(arg_tokens, arg_step);
	struct child ch = { .index = index, .shape = shape_of_tenant(index) };
	char byte;
	int r;

	snprintf(ch.tenant, sizeof(ch.tenant), "%s", tenant_name(index));
	ch.row_bytes = (uint64_t)ch.shape.head_dim * layout_dtype_bytes(ch.shape.dtype);
	ch.seqs = calloc(arg_seqs, sizeof(*ch.seqs));
	ch.grow_lat = calloc(grows, sizeof(uint64_t));
	ch.release_lat = calloc(arg_seqs, sizeof(uint64_t));
	ch.expect = malloc(ch.row_bytes ? ch.row_bytes : 1);
	if (arg_observe) {
		ch.needles = calloc((size_t)arg_seqs * ch.shape.layers, sizeof(*ch.needles));
		ch.qrow = calloc(ch.shape.head_dim, sizeof(float));
	}
	if (!ch.seqs || !ch.grow_lat || !ch.release_lat || !ch.expect ||
	    (arg_observe && (!ch.needles || !ch.qrow)))
		child_fail(&ch, -ENOMEM, "allocating");
	else
		child_setup(&ch);

	/* Tell the parent we are set up (or failed), then wait for everyone to start at once. */
	byte = 'R';
	if (write_all(out_fd, &byte, 1) < 0)
		return EXIT_FAILURE;
	while (read(go_fd, &byte, 1) < 0 && errno == EINTR)
		;
	go_fd = safe_close(go_fd);

	if (ch.rep.error == 0 && child_load(&ch) >= 0 && arg_verify)
		for (uint32_t i = 0; i < ch.n_seqs; i++)
			if (child_verify(&ch, i, arg_tokens) < 0)
				break;

	if (arg_hold > 0 && ch.rep.error == 0) {
		byte = 'H';
		if (write_all(out_fd, &byte, 1) < 0)
			return EXIT_FAILURE;
		child_hold(&ch);
	}

	if (ch.seqs)
		child_release(&ch);
	ch.client = kvd_client_unref(ch.client);

	byte = 'D';
	r = write_all(out_fd, &byte, 1);
	if (r >= 0)
		r = write_all(out_fd, &ch.rep, sizeof(ch.rep));
	if (r >= 0)
		r = write_all(out_fd, ch.grow_lat, ch.rep.n_grow_lat * sizeof(uint64_t));
	if (r >= 0)
		r = write_all(out_fd, ch.release_lat, ch.rep.n_release_lat * sizeof(uint64_t));
	for (size_t x = 0; ch.needles && x < (size_t)arg_seqs * ch.shape.layers; x++) {
		free(ch.needles[x].pos);
		free(ch.needles[x].keys);
	}
	free(ch.needles);
	free(ch.qrow);
	free(ch.seqs);
	free(ch.grow_lat);
	free(ch.release_lat);
	free(ch.expect);
	return r < 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}

/* ---- The parent ---- */

struct tenant_result {
	pid_t pid;
	int fd;
	int failed; /* the child died or broke the pipe protocol */
	int have_report;
	struct report rep;
	uint64_t *grow_lat, *release_lat;
};

static double mib_per_s(uint64_t bytes, uint64_t ns) {
	return ns == 0 ? 0.0 : (double)bytes / (1024.0 * 1024.0) / ((double)ns / 1e9);
}

/* Reads one tag byte; 0 at end of file. */
static int read_tag(struct tenant_result *t, char *ret) {
	int r = read_all(t->fd, ret, 1);

	if (r == -EPIPE)
		return 0;
	return r < 0 ? r : 1;
}

static int read_report(struct tenant_result *t) {
	int r;

	r = read_all(t->fd, &t->rep, sizeof(t->rep));
	if (r < 0)
		return r;
	if (t->rep.n_grow_lat > (uint64_t)arg_seqs * DIV_ROUND_UP(arg_tokens, arg_step) ||
	    t->rep.n_release_lat > arg_seqs)
		return -EPROTO;
	t->grow_lat = calloc(t->rep.n_grow_lat + 1, sizeof(uint64_t));
	t->release_lat = calloc(t->rep.n_release_lat + 1, sizeof(uint64_t));
	if (!t->grow_lat || !t->release_lat)
		return -ENOMEM;
	r = read_all(t->fd, t->grow_lat, t->rep.n_grow_lat * sizeof(uint64_t));
	if (r < 0)
		return r;
	r = read_all(t->fd, t->release_lat, t->rep.n_release_lat * sizeof(uint64_t));
	if (r < 0)
		return r;
	t->have_report = 1;
	return 0;
}

/* Reads the next message of a child that is expected to send `want` ('R' or 'H') or its
 * report; marks it failed on anything else. */
static void read_phase(struct tenant_result *t, unsigned i, char want) {
	char tag;
	int r;

	if (t->failed || t->have_report)
		return;
	r = read_tag(t, &tag);
	if (r > 0 && tag == want)
		return;
	if (r > 0 && tag == 'D') {
		r = read_report(t);
		if (r >= 0)
			return;
	}
	fprintf(stderr, "kvd-bench: %s: lost contact with the child process%s%s\n", tenant_name(i),
		r < 0 ? ": " : "", r < 0 ? strerror(-r) : "");
	t->failed = 1;
}

/*
 * The usage poll (--unit): a thread of the parent, on an administrative connection of its
 * own, reads the node's used_bytes and budget_bytes every POLL_NS while the children run
 * and keeps the peak. Started after the children are forked and stopped before their
 * reports are summed up.
 */
struct poller {
	pthread_t thread;
	pthread_mutex_t lock;
	pthread_cond_t wake;
	int started, stop;
	int error;               /* the first failure, negative errno; polling ends there */
	char message[160];
	kvd_client *client;
	uint64_t polls, used_max, budget_min, budget_max, budget_at_max, chunk_bytes;
	uint64_t over_polls;     /* polls with used > budget + one chunk per tenant */
	uint64_t rounds_total;   /* the node's, at the last poll */
};

static int poller_sample(struct poller *p) {
	_cleanup_(kvd_status_freep) kvd_status *st = NULL;
	uint64_t used, budget, chunk;
	int r;

	r = kvd_status_get(p->client, &st);
	if (r < 0)
		return r;
	r = kvd_status_u64(st, "used_bytes", &used);
	if (r >= 0)
		r = kvd_status_u64(st, "budget_bytes", &budget);
	if (r >= 0)
		r = kvd_status_u64(st, "chunk_bytes", &chunk);
	if (r < 0)
		return r;
	(void)kvd_status_u64(st, "rounds_total", &p->rounds_total);
	if (p->polls == 0 || used > p->used_max) {
		p->used_max = used;
		p->budget_at_max = budget;
	}
	p->budget_min = p->polls == 0 ? budget : MIN(p->budget_min, budget);
	p->budget_max = MAX(p->budget_max, budget);
	p->chunk_bytes = chunk;
	p->over_polls += used > budget + (uint64_t)arg_tenants * chunk;
	p->polls++;
	return 0;
}

static void *poller_run(void *userdata) {
	struct poller *p = userdata;
	struct timespec ts;
	int r = 0;

	pthread_mutex_lock(&p->lock);
	clock_gettime(CLOCK_MONOTONIC, &ts);
	while (!p->stop) {
		pthread_mutex_unlock(&p->lock);
		r = poller_sample(p);
		pthread_mutex_lock(&p->lock);
		if (r < 0) {
			p->error = r;
			snprintf(p->message, sizeof(p->message), "kvd_status_get: %s", strerror(-r));
			break;
		}
		ts.tv_nsec += (long)POLL_NS;
		if (ts.tv_nsec >= 1000000000) {
			ts.tv_sec++;
			ts.tv_nsec -= 1000000000;
		}
		while (!p->stop && pthread_cond_timedwait(&p->wake, &p->lock, &ts) == 0)
			;
	}
	pthread_mutex_unlock(&p->lock);
	return NULL;
}

/* Returns 0, or a negative errno (then there is no peak to report; p->message says why). */
static int poller_start(struct poller *p) {
	pthread_condattr_t attr;
	int r;

	r = kvd_client_connect(arg_socket, NULL, &p->client);
	if (r < 0) {
		snprintf(p->message, sizeof(p->message), "connect to %s: %s", arg_socket, strerror(-r));
		return p->error = r;
	}
	pthread_mutex_init(&p->lock, NULL);
	pthread_condattr_init(&attr);
	pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
	pthread_cond_init(&p->wake, &attr);
	pthread_condattr_destroy(&attr);
	r = -pthread_create(&p->thread, NULL, poller_run, p);
	if (r < 0) {
		snprintf(p->message, sizeof(p->message), "pthread_create: %s", strerror(-r));
		pthread_cond_destroy(&p->wake);
		pthread_mutex_destroy(&p->lock);
		p->client = kvd_client_unref(p->client);
		return p->error = r;
	}
	p->started = 1;
	return 0;
}

/* Takes a last sample (the end state), then stops the thread. */
static void poller_stop(struct poller *p) {
	if (!p->started)
		return;
	pthread_mutex_lock(&p->lock);
	p->stop = 1;
	pthread_cond_signal(&p->wake);
	pthread_mutex_unlock(&p->lock);
	pthread_join(p->thread, NULL);
	if (p->error == 0) {
		int r = poller_sample(p);

		if (r < 0) {
			p->error = r;
			snprintf(p->message, sizeof(p->message), "kvd_status_get: %s", strerror(-r));
		}
	}
	pthread_cond_destroy(&p->wake);
	pthread_mutex_destroy(&p->lock);
	p->client = kvd_client_unref(p->client);
	p->started = 0;
}

static void poller_report(const struct poller *p) {
	char a[32], b[32], c[32], d[32];

	if (p->polls == 0) {
		printf("memory: not polled (%s)\n", p->message[0] ? p->message : "no sample");
		return;
	}
	if (p->budget_min == p->budget_max)
		size_format(p->budget_max, b, sizeof(b));
	else
		snprintf(b, sizeof(b), "%s..%s", size_format(p->budget_min, c, sizeof(c)),
			 size_format(p->budget_max, d, sizeof(d)));
	printf("memory: peak used %s of budget %s, chunk %s; %" PRIu64 " polls, %" PRIu64
	       " above budget + %u chunks; %" PRIu64 " rounds on the node\n",
	       size_format(p->used_max, a, sizeof(a)), b, size_format(p->chunk_bytes, c, sizeof(c)),
	       p->polls, p->over_polls, arg_tenants, p->rounds_total);
	printf("memory: used_bytes_max=%" PRIu64 " budget_bytes_at_max=%" PRIu64 " budget_bytes_min=%" PRIu64
	       " budget_bytes_max=%" PRIu64 " chunk_bytes=%" PRIu64 "\n",
	       p->used_max, p->budget_at_max, p->budget_min, p->budget_max, p->chunk_bytes);
	if (p->error < 0)
		printf("memory: polling stopped early: %s\n", p->message);
}

static double percent(uint64_t part, uint64_t whole) {
	return whole == 0 ? 0.0 : 100.0 * (double)part / (double)whole;
}

/*
 * With --unit, per tenant: tokens grown and still resident (per (layer, kv head), summed
 * over the sequences), the share kept (and of the needles, with --observe), what status
 * says was evicted from the tenant and in how many rounds, grows that had to wait for
 * eviction and those that gave up (--over-budget), and KVD_EVENT_SEQ_CHANGED events.
 */
static void report_eviction(const struct tenant_result *t) {
	printf("%-9s %9s %9s %6s %s%14s %11s %6s %7s %6s %8s\n", "TENANT", "GROWN", "RESIDENT", "KEPT",
	       arg_observe ? "NEEDLES " : "", "EVICTED_TOKENS", "EVICTED", "ROUNDS", "WAITED", "FAILED",
	       "CHANGED");
	for (unsigned i = 0; i < arg_tenants; i++) {
		const struct report *rep = &t[i].rep;
		struct shape sh = shape_of_tenant(i);
		uint64_t tables = (uint64_t)sh.layers * sh.kv_heads;
		uint64_t resident = tables ? (rep->resident_slots + tables / 2) / tables : 0;
		char a[32], kept[16];

		if (!t[i].have_report)
			continue;
		snprintf(kept, sizeof(kept), "%.1f%%", percent(resident, rep->tokens));
		printf("%-9s %9" PRIu64 " %9" PRIu64 " %6s", tenant_name(i), rep->tokens, resident, kept);
		if (arg_observe) {
			snprintf(kept, sizeof(kept), "%.1f%%", percent(rep->needles_resident, rep->needles));
			printf(" %7s", kept);
		}
		printf(" %14" PRIu64 " %11s %6" PRIu64 " %7" PRIu64 " %6" PRIu64 " %8" PRIu64 "\n",
		       rep->evicted_tokens, size_format(rep->evicted_bytes, a, sizeof(a)), rep->rounds,
		       rep->grows_waited, rep->grows_failed, rep->seq_changed);
		if (rep->grows_waited + rep->grows_failed > 0)
			printf("%-9s waited %.3f s in all for refused grows to be granted\n", tenant_name(i),
			       (double)rep->wait_ns / 1e9);
	}
}

static int run_load(void) {
	struct tenant_result t[TENANTS_MAX] = {};
	struct poller poll = {};
	_cleanup_(closep) int go_r = -EBADF, go_w = -EBADF;
	_cleanup_(freep) uint64_t *grow_all = NULL, *release_all = NULL;
	uint64_t n_grow = 0, n_release = 0, start = UINT64_MAX, end = 0;
	uint64_t seqs = 0, tokens = 0, kv_bytes = 0, written = 0, verified = 0, write_ns = 0,
		 verify_ns = 0, mismatched = 0, digests = 0, digest_bad = 0, windows = 0, observe_ns = 0;
	unsigned errors = 0;
	int go[2], shape_width = 5;
	char buf[64];

	for (unsigned i = 0; i < TENANTS_MAX; i++)
		t[i].fd = -EBADF;

	printf("kvd-bench load: %u tenant%s x %u sequence%s x %u tokens, step %u, verify %s, socket %s\n",
	       arg_tenants, arg_tenants == 1 ? "" : "s", arg_seqs, arg_seqs == 1 ? "" : "s", arg_tokens,
	       arg_step, arg_verify ? "on" : "off", arg_socket);
	if (arg_unit != KVD_UNIT_NONE)
		printf("eviction: unit %s, window %u, sinks %u, observe %s, over budget %s\n", unit_name(arg_unit),
		       arg_window, EVICT_SINKS, arg_observe ? "on" : "off", arg_over_budget ? "on" : "off");
	fflush(stdout);

	if (pipe2(go, O_CLOEXEC) < 0) {
		fprintf(stderr, "kvd-bench: pipe: %m\n");
		return EXIT_FAILURE;
	}
	go_r = go[0];
	go_w = go[1];

	for (unsigned i = 0; i < arg_tenants; i++) {
		int p[2];
		pid_t pid;

		if (pipe2(p, O_CLOEXEC) < 0) {
			fprintf(stderr, "kvd-bench: pipe: %m\n");
			t[i].failed = 1;
			continue;
		}
		pid = fork();
		if (pid < 0) {
			fprintf(stderr, "kvd-bench: fork: %m\n");
			safe_close(p[0]);
			safe_close(p[1]);
			t[i].failed = 1;
			continue;
		}
		if (pid == 0) {
			int status;

			/* Without the write end closed here, closing it in the parent would
			 * never wake this child. */
			safe_close(go_w);
			safe_close(p[0]);
			for (unsigned j = 0; j < i; j++)
				safe_close(t[j].fd);
			status = child_main(i, p[1], go_r);
			/* _exit() would close it too, but then fd checkers (valgrind
			 * --track-fds) report it as leaked and hide real leaks among them. */
			safe_close(p[1]);
			_exit(status);
		}
		safe_close(p[1]);
		t[i].pid = pid;
		t[i].fd = p[0];
	}
	go_r = safe_close(go_r);
	/* After the forks: the children must not inherit the thread's connection. */
	if (arg_unit != KVD_UNIT_NONE)
		(void)poller_start(&poll);

	for (unsigned i = 0; i < arg_tenants; i++)
		read_phase(&t[i], i, 'R');
	go_w = safe_close(go_w);

	if (arg_hold > 0) {
		unsigned holding = 0;

		for (unsigned i = 0; i < arg_tenants; i++) {
			read_phase(&t[i], i, 'H');
			holding += !t[i].failed && !t[i].have_report;
		}
		printf("holding: %u tenants keep their sequences for %u s\n", holding, arg_hold);
		fflush(stdout);
	}

	for (unsigned i = 0; i < arg_tenants; i++) {
		char tag;
		int r;

		if (t[i].failed || t[i].have_report)
			continue;
		r = read_tag(&t[i], &tag);
		if (r > 0 && tag == 'D')
			r = read_report(&t[i]);
		else if (r >= 0)
			r = -EPROTO;
		if (r < 0) {
			fprintf(stderr, "kvd-bench: %s: no report from the child process: %s\n", tenant_name(i),
				strerror(-r));
			t[i].failed = 1;
		}
	}
	poller_stop(&poll);

	for (unsigned i = 0; i < arg_tenants; i++) {
		int status;

		t[i].fd = safe_close(t[i].fd);
		if (t[i].pid <= 0)
			continue;
		while (waitpid(t[i].pid, &status, 0) < 0)
			if (errno != EINTR) {
				status = -1;
				break;
			}
		if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
			if (status != -1 && WIFSIGNALED(status))
				fprintf(stderr, "kvd-bench: %s: child killed by signal %d (%s)\n", tenant_name(i),
					WTERMSIG(status), strsignal(WTERMSIG(status)));
			t[i].failed = 1;
		}
	}

	/* Per tenant, then totals. */
	for (unsigned i = 0; i < arg_tenants; i++) {
		struct shape sh = shape_of_tenant(i);
		char s[SHAPE_MAX];

		shape_format(&sh, s, sizeof(s));
		shape_width = MAX(shape_width, (int)strlen(s));
	}
	printf("%-9s %-*s %5s %9s %11s %11s\n", "TENANT", shape_width, "SHAPE", "SEQS", "TOKENS", "KV",
	       "CHUNKS");
	for (unsigned i = 0; i < arg_tenants; i++) {
		struct shape sh = shape_of_tenant(i);
		struct report *rep = &t[i].rep;
		char s[SHAPE_MAX], a[32], b[32];

		shape_format(&sh, s, sizeof(s));
		printf("%-9s %-*s %5" PRIu64 " %9" PRIu64 " %11s %11s\n", tenant_name(i), shape_width, s,
		       rep->sequences, rep->sequences ? rep->tokens / rep->sequences : 0,
		       size_format(rep->kv_bytes, a, sizeof(a)), size_format(rep->tenant_used_bytes, b, sizeof(b)));
		if (t[i].failed || rep->error != 0)
			errors++;
		if (!t[i].have_report)
			continue;
		if (rep->error != 0 || rep->digest_mismatches > 0)
			fprintf(stderr, "kvd-bench: bench-%u: %s\n", i, rep->message);
		if (rep->mismatched_bytes > 0)
			fprintf(stderr, "kvd-bench: bench-%u: %" PRIu64 " bytes differ from the pattern, the first in %s\n",
				i, rep->mismatched_bytes, rep->first_mismatch);
		seqs += rep->sequences;
		tokens += rep->tokens;
		kv_bytes += rep->kv_bytes;
		written += rep->bytes_written;
		verified += rep->bytes_verified;
		write_ns += rep->write_ns;
		verify_ns += rep->verify_ns;
		windows += rep->windows;
		observe_ns += rep->observe_ns;
		mismatched += rep->mismatched_bytes;
		digests += rep->digests_compared;
		digest_bad += rep->digest_mismatches;
		n_grow += rep->n_grow_lat;
		n_release += rep->n_release_lat;
		if (rep->grow_end_ns > 0) {
			start = MIN(start, rep->grow_start_ns);
			end = MAX(end, rep->grow_end_ns);
		}
	}
	printf("total: %" PRIu64 " sequences, %" PRIu64 " tokens per (layer, kv head), %s K/V\n", seqs, tokens,
	       size_format(kv_bytes, buf, sizeof(buf)));
	if (arg_unit != KVD_UNIT_NONE) {
		report_eviction(t);
		poller_report(&poll);
	}

	grow_all = calloc(n_grow + 1, sizeof(uint64_t));
	release_all = calloc(n_release + 1, sizeof(uint64_t));
	if (!grow_all || !release_all) {
		fprintf(stderr, "kvd-bench: out of memory\n");
		return EXIT_FAILURE;
	}
	n_grow = n_release = 0;
	for (unsigned i = 0; i < arg_tenants; i++) {
		if (!t[i].have_report)
			continue;
		memcpy(grow_all + n_grow, t[i].grow_lat, t[i].rep.n_grow_lat * sizeof(uint64_t));
		n_grow += t[i].rep.n_grow_lat;
		memcpy(release_all + n_release, t[i].release_lat, t[i].rep.n_release_lat * sizeof(uint64_t));
		n_release += t[i].rep.n_release_lat;
		free(t[i].grow_lat);
		free(t[i].release_lat);
	}
	latency_sort(grow_all, n_grow);
	latency_sort(release_all, n_release);

	if (end > start) {
		double secs = (double)(end - start) / 1e9;

		printf("grow: %" PRIu64 " calls of %u tokens in %.3f s (all tenants, writes included): %.0f ops/s\n",
		       n_grow, arg_step, secs, (double)n_grow / secs);
	}
	printf("grow latency (us): p50 %.1f  p90 %.1f  p99 %.1f  max %.1f\n",
	       latency_percentile_us(grow_all, n_grow, 50), latency_percentile_us(grow_all, n_grow, 90),
	       latency_percentile_us(grow_all, n_grow, 99), latency_percentile_us(grow_all, n_grow, 100));
	printf("release latency (us): p50 %.1f  p99 %.1f  (%" PRIu64 " releases)\n",
	       latency_percentile_us(release_all, n_release, 50), latency_percentile_us(release_all, n_release, 99),
	       n_release);
	printf("write: %s at %.0f MiB/s per process\n", size_format(written, buf, sizeof(buf)),
	       mib_per_s(written, write_ns));
	if (arg_observe)
		printf("observe: %" PRIu64 " windows of %u queries per q head, %.1f us each (all tenants' time)\n",
		       windows, arg_window, windows ? (double)observe_ns / 1e3 / (double)windows : 0.0);
	if (arg_verify) {
		printf("verify read: %s at %.0f MiB/s per process, %" PRIu64 " digests compared\n",
		       size_format(verified, buf, sizeof(buf)), mib_per_s(verified, verify_ns), digests);
		if (mismatched == 0 && digest_bad == 0 && errors == 0)
			printf("verify: OK\n");
		else if (mismatched == 0 && digest_bad == 0)
			printf("verify: incomplete (%u errors)\n", errors);
		else
			printf("verify: FAILED: %" PRIu64 " mismatched bytes, %" PRIu64 " digest mismatches\n",
			       mismatched, digest_bad);
	} else
		printf("verify: off (use --verify)\n");
	if (errors > 0)
		fprintf(stderr, "kvd-bench: %u tenant(s) failed\n", errors);
	fflush(stdout);
	return errors > 0 || mismatched > 0 || digest_bad > 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}

/* ---- Options ---- */

static void help(void) {
	char s[3][SHAPE_MAX];

	for (unsigned i = 0; i < ELEMENTSOF(default_shapes); i++)
		shape_format(&default_shapes[i], s[i], sizeof(s[i]));
	printf("Usage: kvd-bench load [OPTIONS]\n"
	       "       kvd-bench score [OPTIONS]   (see kvd-bench score --help)\n"
	       "       kvd-bench evict [OPTIONS]   (see kvd-bench evict --help)\n"
	       "       kvd-bench ipc [OPTIONS]     (see kvd-bench ipc --help)\n"
	       "       kvd-bench table [OPTIONS]   (see kvd-bench table --help)\n"
	       "       kvd-bench step [OPTIONS]    (see kvd-bench step --help)\n"
	       "       kvd-bench tier [OPTIONS]    (see kvd-bench tier --help)\n"
	       "       kvd-bench lookup [OPTIONS]  (see kvd-bench lookup --help)\n"
	       "\n"
	       "Load generator and end-to-end checker for kvd: forks one client process per\n"
	       "tenant (bench-0, bench-1, ...); each registers its own model shape, opens\n"
	       "sequences, grows them round-robin to the target length and writes a pattern\n"
	       "into every K/V byte it is given.\n"
	       "\n"
	       "Options:\n"
	       "  --socket PATH    Daemon socket (default: $KVD_SOCKET if set, else %s)\n"
	       "  --tenants N      Client processes, one tenant each, 1..%u (default: 3, or\n"
	       "                   as many as --tenant names)\n"
	       "  --tenant NAME    A tenant's name, repeatable, in order (the others are\n"
	       "                   bench-<i>): load-test a node's real tenants\n"
	       "  --seqs M         Sequences per tenant, 1..%u (default: 8)\n"
	       "  --tokens T       Tokens per sequence, 1..%u (default: 4096)\n"
	       "  --step S         Tokens per grow call, a prefill chunk (default: 16)\n"
	       "  --verify         Re-read every byte and compare daemon and client digests\n"
	       "                   (default: off)\n"
	       "  --model SPEC     Shape of the next tenant, from bench-0 on (the first --model\n"
	       "                   sets bench-0, the second bench-1...),\n"
	       "                   repeatable; SPEC is\n"
	       "                   layers,q_heads,kv_heads,head_dim,dtype,block_tokens,layout\n"
	       "                   with dtype f16|bf16|f32 and layout per_layer|per_head\n"
	       "                   (default: bench-0 %s,\n"
	       "                   bench-1 %s,\n"
	       "                   bench-2 %s,\n"
	       "                   then the same again with one more layer per round)\n"
	       "  --hold SECONDS   Keep the sequences this long before releasing them, e.g. to\n"
	       "                   look at `kvdctl status` (default: 0)\n"
	       "  --unit U         Register the models with eviction, U being what one\n"
	       "                   eviction frees: head (a token of one (layer, kv head);\n"
	       "                   the default shapes then use the per_head layout, and a\n"
	       "                   --model must too), layer (a token of one layer) or block\n"
	       "                   (default: none, no eviction). Sequences are pinned around\n"
	       "                   each step and check, K/V are numbers in +-[1/16, 1), and\n"
	       "                   --verify checks every surviving slot against its original\n"
	       "                   position and that sinks and window were kept; the report\n"
	       "                   adds what was evicted and the node's peak usage (polled\n"
	       "                   every 100 ms)\n"
	       "  --window N       With --unit: observation window, also the recent tokens\n"
	       "                   each table keeps, 1..%u (default: 32); %u sinks are kept\n"
	       "  --observe        With --unit: give the daemon a random W_o per layer and,\n"
	       "                   after every step, each sequence's last N queries per layer,\n"
	       "                   made so that about 1 token in %u (the needles) draws most\n"
	       "                   of the attention\n"
	       "  --over-budget    With --unit: grow past the budget, relying on eviction: a\n"
	       "                   grow refused with ENOSPC or EDQUOT is retried for up to %u s\n"
	       "                   instead of failing\n"
	       "  -h --help        Show this help and exit\n"
	       "  --version        Show the version and exit\n"
	       "\n"
	       "Exit status: 0 when everything succeeded (and verified), 1 on any error or\n"
	       "mismatch, 2 on usage errors.\n",
	       KVD_DEFAULT_SOCKET, TENANTS_MAX, SEQS_MAX, TOKENS_MAX, s[0], s[1], s[2], KVD_WINDOW_MAX,
	       EVICT_SINKS, NEEDLE_MASK + 1, (unsigned)(GROW_WAIT_NS / 1000000000));
}

#define usage_error(...) cli_usage_error("kvd-bench", __VA_ARGS__)

int main(int argc, char **argv) {
	enum { OPT_SOCKET = 0x100, OPT_TENANTS, OPT_TENANT, OPT_SEQS, OPT_TOKENS, OPT_STEP, OPT_VERIFY,
	       OPT_MODEL, OPT_HOLD, OPT_UNIT, OPT_WINDOW, OPT_OBSERVE, OPT_OVER_BUDGET, OPT_VERSION };
	static const struct option options[] = {
		{ "socket", required_argument, NULL, OPT_SOCKET },
		{ "tenants", required_argument, NULL, OPT_TENANTS },
		{ "tenant", required_argument, NULL, OPT_TENANT },
		{ "seqs", required_argument, NULL, OPT_SEQS },
		{ "tokens", required_argument, NULL, OPT_TOKENS },
		{ "step", required_argument, NULL, OPT_STEP },
		{ "verify", no_argument, NULL, OPT_VERIFY },
		{ "model", required_argument, NULL, OPT_MODEL },
		{ "hold", required_argument, NULL, OPT_HOLD },
		{ "unit", required_argument, NULL, OPT_UNIT },
		{ "window", required_argument, NULL, OPT_WINDOW },
		{ "observe", no_argument, NULL, OPT_OBSERVE },
		{ "over-budget", no_argument, NULL, OPT_OVER_BUDGET },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, OPT_VERSION },
		{},
	};
	int load = 0, window = 0, opt;
	bool tenants_given = false;
	uint32_t v;

	/* score and evict have options of their own (--tokens is a list in score): they must
	 * come first. */
	if (argc > 1 && strcmp(argv[1], "score") == 0)
		return bench_score(argc - 1, argv + 1);
	if (argc > 1 && strcmp(argv[1], "evict") == 0)
		return bench_evict(argc - 1, argv + 1);
	if (argc > 1 && strcmp(argv[1], "ipc") == 0)
		return bench_ipc(argc - 1, argv + 1);
	if (argc > 1 && strcmp(argv[1], "table") == 0)
		return bench_table(argc - 1, argv + 1);
	if (argc > 1 && strcmp(argv[1], "step") == 0)
		return bench_step(argc - 1, argv + 1);
	if (argc > 1 && strcmp(argv[1], "tier") == 0)
		return bench_tier(argc - 1, argv + 1);
	if (argc > 1 && strcmp(argv[1], "lookup") == 0)
		return bench_lookup(argc - 1, argv + 1);

	arg_socket = getenv("KVD_SOCKET");
	if (!arg_socket || !*arg_socket)
		arg_socket = KVD_DEFAULT_SOCKET;

	/* The subcommand may come before or after the options. */
	while ((opt = getopt_long(argc, argv, "-h", options, NULL)) >= 0)
		switch (opt) {
		case 1:
			if (strcmp(optarg, "score") == 0 || strcmp(optarg, "evict") == 0 ||
			    strcmp(optarg, "ipc") == 0 || strcmp(optarg, "table") == 0 ||
			    strcmp(optarg, "step") == 0 || strcmp(optarg, "tier") == 0 ||
			    strcmp(optarg, "lookup") == 0)
				return usage_error("'%s' must come first: kvd-bench %s [OPTIONS]", optarg,
						   optarg);
			if (strcmp(optarg, "load") != 0 || load)
				return usage_error("unknown command '%s' (commands: load, score, evict, ipc, table, step, tier, lookup)",
						   optarg);
			load = 1;
			break;
		case OPT_SOCKET:
			arg_socket = optarg;
			break;
		case OPT_TENANTS:
			if (number_parse_u32(optarg, 1, TENANTS_MAX, &v) < 0)
				return usage_error("--tenants: '%s' is not in 1..%u", optarg, TENANTS_MAX);
			arg_tenants = v;
			tenants_given = true;
			break;
		case OPT_TENANT:
			if (arg_n_tenant_names == TENANTS_MAX)
				return usage_error("--tenant: at most %u", TENANTS_MAX);
			if (!*optarg || strlen(optarg) > KVD_TENANT_NAME_MAX ||
			    strspn(optarg, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
			                   "0123456789_.-") != strlen(optarg))
				return usage_error("--tenant: '%s' is not a tenant name ([A-Za-z0-9_.-], "
				                   "1 to %u)", optarg, KVD_TENANT_NAME_MAX);
			arg_tenant_names[arg_n_tenant_names++] = optarg;
			break;
		case OPT_SEQS:
			if (number_parse_u32(optarg, 1, SEQS_MAX, &v) < 0)
				return usage_error("--seqs: '%s' is not in 1..%u", optarg, SEQS_MAX);
			arg_seqs = v;
			break;
		case OPT_TOKENS:
			if (number_parse_u32(optarg, 1, TOKENS_MAX, &v) < 0)
				return usage_error("--tokens: '%s' is not in 1..%u", optarg, TOKENS_MAX);
			arg_tokens = v;
			break;
		case OPT_STEP:
			if (number_parse_u32(optarg, 1, TOKENS_MAX, &v) < 0)
				return usage_error("--step: '%s' is not in 1..%u", optarg, TOKENS_MAX);
			arg_step = v;
			break;
		case OPT_VERIFY:
			arg_verify = 1;
			break;
		case OPT_MODEL:
			if (arg_n_models == TENANTS_MAX)
				return usage_error("--model: at most %u", TENANTS_MAX);
			if (shape_parse(optarg, &arg_models[arg_n_models]) < 0)
				return usage_error("--model: '%s' is not layers,q_heads,kv_heads,head_dim,"
						   "f16|bf16|f32,block_tokens,per_layer|per_head", optarg);
			arg_n_models++;
			break;
		case OPT_HOLD:
			if (number_parse_u32(optarg, 0, HOLD_MAX, &v) < 0)
				return usage_error("--hold: '%s' is not in 0..%u", optarg, HOLD_MAX);
			arg_hold = v;
			break;
		case OPT_UNIT:
			if (strcmp(optarg, "head") == 0)
				arg_unit = KVD_UNIT_HEAD_TOKEN;
			else if (strcmp(optarg, "layer") == 0)
				arg_unit = KVD_UNIT_LAYER_TOKEN;
			else if (strcmp(optarg, "block") == 0)
				arg_unit = KVD_UNIT_BLOCK;
			else if (strcmp(optarg, "none") == 0)
				arg_unit = KVD_UNIT_NONE;
			else
				return usage_error("--unit: '%s' is not head, layer, block or none", optarg);
			break;
		case OPT_WINDOW:
			if (number_parse_u32(optarg, 1, KVD_WINDOW_MAX, &v) < 0)
				return usage_error("--window: '%s' is not in 1..%u", optarg, KVD_WINDOW_MAX);
			arg_window = v;
			window = 1;
			break;
		case OPT_OBSERVE:
			arg_observe = 1;
			break;
		case OPT_OVER_BUDGET:
			arg_over_budget = 1;
			break;
		case 'h':
			help();
			return EXIT_SUCCESS;
		case OPT_VERSION:
			printf("kvd-bench %s (libkvd %s)\n", KVD_VERSION, kvd_version());
			return EXIT_SUCCESS;
		default:
			return usage_error("bad option");
		}
	if (!load)
		return usage_error("missing command: load, score, evict or ipc");
	/* --tenant names the tenants: as many as it names, unless --tenants says more. */
	if (!tenants_given && arg_n_tenant_names > 0)
		arg_tenants = arg_n_tenant_names;
	if (arg_n_tenant_names > arg_tenants)
		return usage_error("%u --tenant names for %u tenants", arg_n_tenant_names, arg_tenants);
	for (unsigned i = 0; i < arg_n_tenant_names; i++)
		for (unsigned j = 0; j < i; j++)
			if (strcmp(arg_tenant_names[i], arg_tenant_names[j]) == 0)
				return usage_error("--tenant %s given twice", arg_tenant_names[i]);
	if (arg_n_models > arg_tenants)
		return usage_error("%u --model options for %u tenants", arg_n_models, arg_tenants);
	if (arg_unit == KVD_UNIT_NONE && (window || arg_observe || arg_over_budget))
		return usage_error("--window, --observe and --over-budget need --unit");
	for (unsigned i = 0; arg_unit == KVD_UNIT_HEAD_TOKEN && i < arg_n_models; i++)
		if (arg_models[i].layout != KVD_LAYOUT_PER_HEAD)
			return usage_error("--unit head needs the per_head layout, and --model %u is per_layer", i + 1);
	if ((uint64_t)arg_seqs * DIV_ROUND_UP(arg_tokens, arg_step) > GROWS_PER_TENANT_MAX)
		return usage_error("%u sequences x %u tokens in steps of %u is too many grow calls; raise --step",
				   arg_seqs, arg_tokens, arg_step);

	/* A child that dies must not kill the parent while it writes its report. */
	signal(SIGPIPE, SIG_IGN);
	/* Errors go to stderr between result lines; line buffering keeps them in order when
	 * both streams go to one file. */
	setvbuf(stdout, NULL, _IOLBF, 0);
	return run_load();
}
