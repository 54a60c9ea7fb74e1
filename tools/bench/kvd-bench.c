/* SPDX-License-Identifier: MIT */
/*
 * kvd-bench: load generator and end-to-end checker for kvd; `kvd-bench score` (score.c)
 * times the scoring kernels and policies next to the machine's ceilings.
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
 */

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "common/digest.h"
#include "common/layout.h"
#include "common/macro.h"
#include "common/number.h"
#include "common/size.h"
#include "config.h"
#include "kvd/kvd.h"

#define TENANTS_MAX 16
#define SEQS_MAX 4096
#define TOKENS_MAX (1u << 20)
#define HOLD_MAX 3600
/* Bounds the latency sample arrays, i.e. the parent's memory. */
#define GROWS_PER_TENANT_MAX (1u << 22)

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
static unsigned arg_seqs = 8;
static unsigned arg_tokens = 4096;
static unsigned arg_step = 16;
static unsigned arg_hold;
static int arg_verify;
static struct shape arg_models[TENANTS_MAX];
static unsigned arg_n_models;

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
	uint64_t grow_start_ns, grow_end_ns; /* CLOCK_MONOTONIC, shared by all processes */
	uint64_t mismatched_bytes, digests_compared, digest_mismatches;
	uint64_t n_grow_lat, n_release_lat; /* samples (ns) that follow the report */
};

static uint64_t now_ns(void) {
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

static const char *dtype_name(uint32_t d) {
	return d == KVD_DTYPE_F16 ? "f16" : d == KVD_DTYPE_BF16 ? "bf16" : d == KVD_DTYPE_F32 ? "f32" : "?";
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

/* ---- The child ---- */

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

static int write_all(int fd, const void *buf, size_t n) {
	const char *p = buf;

	while (n > 0) {
		ssize_t k = write(fd, p, n);

		if (k < 0) {
			if (errno == EINTR)
				continue;
			return negative_errno();
		}
		p += k;
		n -= (size_t)k;
	}
	return 0;
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

/* Writes the pattern into slots [from, to) of every (layer, kv head) of sequence i. */
static int child_write(struct child *ch, uint32_t i, uint32_t from, uint32_t to) {
	const struct shape *sh = &ch->shape;
	kvd_seq *s = ch->seqs[i];
	uint64_t t0 = now_ns();

	for (uint32_t l = 0; l < sh->layers; l++)
		for (uint32_t h = 0; h < sh->kv_heads; h++)
			for (uint32_t slot = from; slot < to; slot++) {
				void *k, *v;
				int64_t pos;
				int r;

				pos = kvd_seq_position(s, l, h, slot);
				if (pos < 0)
					return child_fail(ch, (int)pos, "kvd_seq_position(seq %u, layer %u, head %u, slot %u)",
							  i, l, h, slot);
				r = kvd_seq_kv(s, l, h, slot, &k, &v);
				if (r < 0)
					return child_fail(ch, r, "kvd_seq_kv(seq %u, layer %u, head %u, slot %u)",
							  i, l, h, slot);
				pattern_fill(k, ch->row_bytes, row_seed(ch->index, i, l, h, (uint32_t)pos, 0));
				pattern_fill(v, ch->row_bytes, row_seed(ch->index, i, l, h, (uint32_t)pos, 1));
				ch->rep.bytes_written += 2 * ch->row_bytes;
			}
	ch->rep.write_ns += now_ns() - t0;
	return 0;
}

static uint64_t count_diff(const unsigned char *a, const unsigned char *b, size_t n) {
	uint64_t d = 0;

	for (size_t i = 0; i < n; i++)
		d += a[i] != b[i];
	return d;
}

/*
 * Re-reads every resident row of sequence i in digest order (layer, kv head, slot; K then
 * V), compares it with the pattern, and folds the expected bytes into a digest, so that the
 * daemon's digest is checked against what was meant to be written, not only against what
 * this process reads back.
 */
static int child_verify(struct child *ch, uint32_t i) {
	const struct shape *sh = &ch->shape;
	kvd_seq *s = ch->seqs[i];
	uint64_t t0 = now_ns(), expect = DIGEST_INIT, d_daemon, d_local;
	int r;

	for (uint32_t l = 0; l < sh->layers; l++)
		for (uint32_t h = 0; h < sh->kv_heads; h++) {
			int64_t n = kvd_seq_tokens(s, l, h);

			if (n < 0)
				return child_fail(ch, (int)n, "kvd_seq_tokens(seq %u, layer %u, head %u)", i, l, h);
			if (n != arg_tokens)
				return child_fail(ch, -EIO, "seq %u, layer %u, head %u holds %" PRId64 " tokens, expected %u",
						  i, l, h, n, arg_tokens);
			for (uint32_t slot = 0; slot < (uint32_t)n; slot++) {
				const unsigned char *row[2];
				void *k, *v;
				int64_t pos;

				pos = kvd_seq_position(s, l, h, slot);
				if (pos < 0)
					return child_fail(ch, (int)pos, "kvd_seq_position(seq %u, layer %u, head %u, slot %u)",
							  i, l, h, slot);
				r = kvd_seq_kv(s, l, h, slot, &k, &v);
				if (r < 0)
					return child_fail(ch, r, "kvd_seq_kv(seq %u, layer %u, head %u, slot %u)",
							  i, l, h, slot);
				row[0] = k;
				row[1] = v;
				for (int kv = 0; kv < 2; kv++) {
					pattern_fill(ch->expect, ch->row_bytes,
						     row_seed(ch->index, i, l, h, (uint32_t)pos, kv));
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
	return 0;
}

static int child_tenant_usage(struct child *ch) {
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
		r = kvd_status_tenant_u64(st, t, "used_bytes", &ch->rep.tenant_used_bytes);
		if (r < 0)
			return child_fail(ch, r, "kvd_status_tenant_u64(%s, used_bytes)", ch->tenant);
		return 0;
	}
	return child_fail(ch, -ENOENT, "status lists no tenant %s", ch->tenant);
}

static int child_setup(struct child *ch) {
	kvd_model_spec spec;
	char model[48];
	int model_id, r;

	r = kvd_client_connect(arg_socket, ch->tenant, &ch->client);
	if (r < 0)
		return child_fail(ch, r, "connect to %s as %s", arg_socket, ch->tenant);

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
	model_id = kvd_model_register(ch->client, &spec);
	if (model_id < 0)
		return child_fail(ch, model_id, "kvd_model_register");

	for (uint32_t i = 0; i < arg_seqs; i++) {
		r = kvd_seq_open(ch->client, model_id, arg_tokens, &ch->seqs[i]);
		if (r < 0)
			return child_fail(ch, r, "kvd_seq_open(seq %u, max_tokens %u)", i, arg_tokens);
		ch->n_seqs++;
	}
	ch->rep.sequences = ch->n_seqs;
	return 0;
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
			uint64_t t0;
			int64_t have;

			if (n == 0)
				continue;
			t0 = now_ns();
			r = kvd_seq_grow(ch->seqs[i], n);
			ch->grow_lat[ch->rep.n_grow_lat++] = now_ns() - t0;
			if (r < 0) {
				child_fail(ch, r, "kvd_seq_grow(seq %u, +%u tokens at %u)", i, n, done[i]);
				break;
			}
			ch->rep.grows++;

			/* The new slots are the last n of every table. */
			have = kvd_seq_tokens(ch->seqs[i], 0, 0);
			if (have != (int64_t)done[i] + n) {
				r = child_fail(ch, -EIO, "seq %u holds %" PRId64 " tokens after growing to %u",
					       i, have, done[i] + n);
				break;
			}
			r = child_write(ch, i, done[i], done[i] + n);
			if (r < 0)
				break;
			done[i] += n;
			ch->rep.tokens += n;
			if (done[i] == arg_tokens)
				left--;
		}
	ch->rep.grow_end_ns = now_ns();
	/* Every resident byte was written once: that is the K/V the tenant holds, also when
	 * a grow was refused half-way. */
	ch->rep.kv_bytes = ch->rep.bytes_written;

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

static void sleep_seconds(unsigned s) {
	struct timespec ts = { .tv_sec = s };

	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

static int child_main(unsigned index, int out_fd, int go_fd) {
	uint64_t grows = (uint64_t)arg_seqs * DIV_ROUND_UP(arg_tokens, arg_step);
	struct child ch = { .index = index, .shape = shape_of_tenant(index) };
	char byte;
	int r;

	snprintf(ch.tenant, sizeof(ch.tenant), "bench-%u", index);
	ch.row_bytes = (uint64_t)ch.shape.head_dim * layout_dtype_bytes(ch.shape.dtype);
	ch.seqs = calloc(arg_seqs, sizeof(*ch.seqs));
	ch.grow_lat = calloc(grows, sizeof(uint64_t));
	ch.release_lat = calloc(arg_seqs, sizeof(uint64_t));
	ch.expect = malloc(ch.row_bytes ? ch.row_bytes : 1);
	if (!ch.seqs || !ch.grow_lat || !ch.release_lat || !ch.expect)
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
			if (child_verify(&ch, i) < 0)
				break;

	if (arg_hold > 0 && ch.rep.error == 0) {
		byte = 'H';
		if (write_all(out_fd, &byte, 1) < 0)
			return EXIT_FAILURE;
		sleep_seconds(arg_hold);
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

static int cmp_u64(const void *a, const void *b) {
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

/* Nearest-rank percentile of a sorted array, in microseconds. */
static double percentile_us(const uint64_t *v, size_t n, double p) {
	size_t rank;

	if (n == 0)
		return 0.0;
	rank = (size_t)((p / 100.0) * (double)n + 0.999999);
	rank = rank == 0 ? 1 : MIN(rank, n);
	return (double)v[rank - 1] / 1000.0;
}

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
	fprintf(stderr, "kvd-bench: bench-%u: lost contact with the child process%s%s\n", i,
		r < 0 ? ": " : "", r < 0 ? strerror(-r) : "");
	t->failed = 1;
}

static int run_load(void) {
	struct tenant_result t[TENANTS_MAX] = {};
	_cleanup_(closep) int go_r = -EBADF, go_w = -EBADF;
	_cleanup_(freep) uint64_t *grow_all = NULL, *release_all = NULL;
	uint64_t n_grow = 0, n_release = 0, start = UINT64_MAX, end = 0;
	uint64_t seqs = 0, tokens = 0, kv_bytes = 0, written = 0, verified = 0, write_ns = 0,
		 verify_ns = 0, mismatched = 0, digests = 0, digest_bad = 0;
	unsigned errors = 0;
	int go[2], shape_width = 5;
	char buf[64];

	for (unsigned i = 0; i < TENANTS_MAX; i++)
		t[i].fd = -EBADF;

	printf("kvd-bench load: %u tenant%s x %u sequence%s x %u tokens, step %u, verify %s, socket %s\n",
	       arg_tenants, arg_tenants == 1 ? "" : "s", arg_seqs, arg_seqs == 1 ? "" : "s", arg_tokens,
	       arg_step, arg_verify ? "on" : "off", arg_socket);
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
			fprintf(stderr, "kvd-bench: bench-%u: no report from the child process: %s\n", i,
				strerror(-r));
			t[i].failed = 1;
		}
	}

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
				fprintf(stderr, "kvd-bench: bench-%u: child killed by signal %d (%s)\n", i,
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
		printf("bench-%-3u %-*s %5" PRIu64 " %9" PRIu64 " %11s %11s\n", i, shape_width, s,
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
	qsort(grow_all, n_grow, sizeof(uint64_t), cmp_u64);
	qsort(release_all, n_release, sizeof(uint64_t), cmp_u64);

	if (end > start) {
		double secs = (double)(end - start) / 1e9;

		printf("grow: %" PRIu64 " calls of %u tokens in %.3f s (all tenants, writes included): %.0f ops/s\n",
		       n_grow, arg_step, secs, (double)n_grow / secs);
	}
	printf("grow latency (us): p50 %.1f  p90 %.1f  p99 %.1f  max %.1f\n",
	       percentile_us(grow_all, n_grow, 50), percentile_us(grow_all, n_grow, 90),
	       percentile_us(grow_all, n_grow, 99), percentile_us(grow_all, n_grow, 100));
	printf("release latency (us): p50 %.1f  p99 %.1f  (%" PRIu64 " releases)\n",
	       percentile_us(release_all, n_release, 50), percentile_us(release_all, n_release, 99),
	       n_release);
	printf("write: %s at %.0f MiB/s per process\n", size_format(written, buf, sizeof(buf)),
	       mib_per_s(written, write_ns));
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
	       "\n"
	       "Load generator and end-to-end checker for kvd: forks one client process per\n"
	       "tenant (bench-0, bench-1, ...); each registers its own model shape, opens\n"
	       "sequences, grows them round-robin to the target length and writes a pattern\n"
	       "into every K/V byte it is given.\n"
	       "\n"
	       "Options:\n"
	       "  --socket PATH    Daemon socket (default: $KVD_SOCKET if set, else %s)\n"
	       "  --tenants N      Client processes, one tenant each, 1..%u (default: 3)\n"
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
	       "  -h --help        Show this help and exit\n"
	       "  --version        Show the version and exit\n"
	       "\n"
	       "Exit status: 0 when everything succeeded (and verified), 1 on any error or\n"
	       "mismatch, 2 on usage errors.\n",
	       KVD_DEFAULT_SOCKET, TENANTS_MAX, SEQS_MAX, TOKENS_MAX, s[0], s[1], s[2]);
}

static _printf_(1, 2) int usage_error(const char *fmt, ...) {
	va_list ap;

	fputs("kvd-bench: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputs("\nTry 'kvd-bench --help'.\n", stderr);
	return 2;
}

int main(int argc, char **argv) {
	enum { OPT_SOCKET = 0x100, OPT_TENANTS, OPT_SEQS, OPT_TOKENS, OPT_STEP, OPT_VERIFY,
	       OPT_MODEL, OPT_HOLD, OPT_VERSION };
	static const struct option options[] = {
		{ "socket", required_argument, NULL, OPT_SOCKET },
		{ "tenants", required_argument, NULL, OPT_TENANTS },
		{ "seqs", required_argument, NULL, OPT_SEQS },
		{ "tokens", required_argument, NULL, OPT_TOKENS },
		{ "step", required_argument, NULL, OPT_STEP },
		{ "verify", no_argument, NULL, OPT_VERIFY },
		{ "model", required_argument, NULL, OPT_MODEL },
		{ "hold", required_argument, NULL, OPT_HOLD },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, OPT_VERSION },
		{},
	};
	int load = 0, opt;
	uint32_t v;

	/* score has options of its own (--tokens is a list there): it must come first. */
	if (argc > 1 && strcmp(argv[1], "score") == 0)
		return bench_score(argc - 1, argv + 1);

	arg_socket = getenv("KVD_SOCKET");
	if (!arg_socket || !*arg_socket)
		arg_socket = KVD_DEFAULT_SOCKET;

	/* The subcommand may come before or after the options. */
	while ((opt = getopt_long(argc, argv, "-h", options, NULL)) >= 0)
		switch (opt) {
		case 1:
			if (strcmp(optarg, "score") == 0)
				return usage_error("'score' must come first: kvd-bench score [OPTIONS]");
			if (strcmp(optarg, "load") != 0 || load)
				return usage_error("unknown command '%s' (commands: load, score)", optarg);
			load = 1;
			break;
		case OPT_SOCKET:
			arg_socket = optarg;
			break;
		case OPT_TENANTS:
			if (number_parse_u32(optarg, 1, TENANTS_MAX, &v) < 0)
				return usage_error("--tenants: '%s' is not in 1..%u", optarg, TENANTS_MAX);
			arg_tenants = v;
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
		return usage_error("missing command: load or score");
	if (arg_n_models > arg_tenants)
		return usage_error("%u --model options for %u tenants", arg_n_models, arg_tenants);
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
