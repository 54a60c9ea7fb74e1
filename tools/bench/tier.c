/* SPDX-License-Identifier: MIT */
/*
 * kvd-bench tier: moving a whole sequence to the daemon's host tier and back (kvd(8),
 * TIERS), next to a memcpy floor measured in the same run: one Llama-3.1-8B-like layer
 * (8 kv heads of 128, bf16, 16-token blocks) of --tokens tokens, then --layers of them
 * (the whole model), against a running kvd started with a host tier and a short
 * --tier-idle. For each: the daemon's own time moving it out and back (status
 * tier_offload_us, tier_recall_us), the engine's wall time of the pin that recalls it
 * (kvd_seq_pin_recall: the recall plus mapping the chunks it was granted), and two floors
 * for as many bytes: memcpy between two buffers this process touched before (no page
 * faults), and memcpy into new shared memory (what writing into a host pool's scrubbed
 * chunks costs). A benchmark: nothing asserts on timings.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "basic/macro.h"
#include "basic/number.h"
#include "basic/time-util.h"
#include "bench.h"
#include "kvd/kvd.h"

#define KV_HEADS 8u
#define HEAD_DIM 128u
#define BLOCK_TOKENS 16u
/* Bytes of K and V of one token of one layer, bf16. */
#define TOKEN_LAYER_BYTES (2u * KV_HEADS * HEAD_DIM * 2u)
/* Tokens per grow: a grow maps at most 253 new chunks. */
#define GROW_STEP 1024u
#define WAIT_MS 60000
#define FLOOR_BYTES (UINT64_C(1) << 30)

static const char *arg_socket;
static uint32_t arg_tokens = 32768, arg_layers = 32;

static int usage(FILE *f) {
	fprintf(f,
	        "Usage: kvd-bench tier [OPTIONS]\n\n"
	        "Times moving one sequence to kvd's host tier and back, for one\n"
	        "Llama-3.1-8B-like layer (8 kv heads x 128, bf16) and for --layers of them,\n"
	        "next to memcpy floors. The daemon at --socket needs a host tier larger than the\n"
	        "model's sequence (kvd --host-tier-size), a pool of twice that (the recall takes\n"
	        "new chunks while the old ones wait for this process to unmap them), a short\n"
	        "--tier-idle (e.g. 100): the sequence moves out once idle, and a --grant-wait\n"
	        "long enough for the recall's memory. Run as root or a member of kvd's admin\n"
	        "group: it sets its tenant's tier to host.\n\n"
	        "Options:\n"
	        "  --socket PATH    Daemon socket (default: $KVD_SOCKET if set, else %s)\n"
	        "  --tokens N       Tokens of the sequence, 16..1048576 (default: 32768)\n"
	        "  --layers N       Layers of the whole model, 1..128 (default: 32)\n"
	        "  -h, --help       Show this help\n",
	        KVD_DEFAULT_SOCKET);
	return f == stdout ? 0 : 2;
}

static int fail(kvd_client *c, const char *what, int r) {
	fprintf(stderr, "kvd-bench tier: %s: %s (%s)\n", what, kvd_strerror(r),
	        c ? kvd_client_last_error(c) : "");
	return 1;
}

static int status_u64(kvd_client *c, const char *key, uint64_t *ret) {
	kvd_status *st;
	int r = kvd_status_get(c, &st);

	if (r < 0)
		return r;
	r = kvd_status_u64(st, key, ret);
	kvd_status_free(st);
	return r;
}

/*
 * GB/s of memcpy of bytes from a touched buffer into new shared memory (a memfd, mapped
 * shared): what every write into a host pool chunk after its scrub costs (the scrub gives
 * its pages back to the system: kvd(8), HUGE PAGES), a recall's included. The best of 3.
 */
static double fresh_shm_floor(uint64_t bytes) {
	_cleanup_(freep) char *a = malloc(bytes);
	double best = 0;

	if (!a)
		return 0;
	memset(a, 1, bytes);
	for (int i = 0; i < 3; i++) {
		int fd = memfd_create("kvd-bench-tier", MFD_CLOEXEC);
		void *m = MAP_FAILED;
		uint64_t t0, dt;

		if (fd >= 0 && ftruncate(fd, (off_t)bytes) == 0)
			m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		if (m != MAP_FAILED) {
			t0 = now_ns();
			memcpy(m, a, bytes);
			dt = now_ns() - t0;
			best = MAX(best, (double)bytes / (double)MAX(dt, 1));
			munmap(m, bytes);
		}
		if (fd >= 0)
			close(fd);
	}
	return best;
}

/* GB/s of memcpy of bytes between two buffers already touched: the best of 3. */
static double memcpy_floor(uint64_t bytes) {
	_cleanup_(freep) char *a = malloc(bytes), *b = malloc(bytes);
	double best = 0;

	if (!a || !b)
		return 0;
	memset(a, 1, bytes);
	memset(b, 2, bytes);
	for (int i = 0; i < 3; i++) {
		uint64_t t0 = now_ns(), dt;

		memcpy(i % 2 ? a : b, i % 2 ? b : a, bytes);
		dt = now_ns() - t0;
		best = MAX(best, (double)bytes / (double)MAX(dt, 1));
	}
	return best;
}

/* One sequence of `layers` layers moved out and back. */
static int run(kvd_client *c, kvd_client *admin, uint32_t layers) {
	kvd_model_spec spec = { "bench-tier", layers, 32, KV_HEADS, HEAD_DIM, KVD_DTYPE_BF16,
		                BLOCK_TOKENS, KVD_LAYOUT_PER_LAYER };
	uint64_t bytes = (uint64_t)arg_tokens * layers * TOKEN_LAYER_BYTES;
	uint64_t out0, out_us0, back_us0, out_us, back_us, pin_ns, t0, v;
	uint64_t blocks = (arg_tokens + BLOCK_TOKENS - 1) / BLOCK_TOKENS;
	double floor_gbs, shm_gbs;
	kvd_seq *s = NULL;
	int m, r, recall = -1;

	m = kvd_model_register(c, &spec);
	if (m < 0)
		return fail(c, "registering the model", m);
	r = kvd_seq_open(c, m, arg_tokens, &s);
	for (uint32_t done = 0; r >= 0 && done < arg_tokens; done += GROW_STEP)
		r = kvd_seq_grow(s, MIN(GROW_STEP, arg_tokens - done));
	if (r < 0)
		return fail(c, "growing the sequence", r);
	/* Written, so that every page is there to move. */
	r = kvd_seq_pin(s);
	for (uint32_t l = 0; r >= 0 && l < layers; l++)
		for (uint64_t b = 0; r >= 0 && b < blocks; b++) {
			void *p;

			r = kvd_seq_block(s, l, (uint32_t)b, &p);
			if (r >= 0)
				memset(p, (int)(l + b), BLOCK_TOKENS * TOKEN_LAYER_BYTES);
		}
	if (r >= 0)
		r = kvd_seq_unpin(s);
	if (r < 0)
		return fail(c, "writing the sequence", r);

	if ((r = status_u64(admin, "tier_offloads", &out0)) < 0 ||
	    (r = status_u64(admin, "tier_offload_us", &out_us0)) < 0 ||
	    (r = status_u64(admin, "tier_recall_us", &back_us0)) < 0)
		return fail(admin, "reading the status (a kvd without a host tier?)", r);
	t0 = now_ms();
	do {
		struct timespec ts = { 0, 10 * 1000 * 1000 };

		nanosleep(&ts, NULL);
		r = status_u64(admin, "tier_offloads", &v);
		if (r < 0)
			return fail(admin, "reading the status", r);
	} while (v == out0 && now_ms() - t0 < WAIT_MS);
	if (v == out0) {
		fprintf(stderr, "kvd-bench tier: the sequence did not move out within %d s: start kvd "
		        "with --host-tier-size above %" PRIu64 " bytes and a short --tier-idle\n",
		        WAIT_MS / 1000, bytes);
		return 1;
	}
	t0 = now_ns();
	r = kvd_seq_pin_recall(s, &recall);
	pin_ns = now_ns() - t0;
	if (r < 0)
		return fail(c, "pinning", r);
	if (recall != KVD_RECALL_HOST) {
		fprintf(stderr, "kvd-bench tier: the pin found %d, not KVD_RECALL_HOST\n", recall);
		return 1;
	}
	if ((r = status_u64(admin, "tier_offload_us", &out_us)) < 0 ||
	    (r = status_u64(admin, "tier_recall_us", &back_us)) < 0)
		return fail(admin, "reading the status", r);
	out_us -= out_us0;
	back_us -= back_us0;
	(void)kvd_seq_unpin(s);
	(void)kvd_seq_release(s);

	/* Rates, not totals: up to FLOOR_BYTES is as good as the whole, and leaves the machine
	 * the memory of the pool and the tier. */
	floor_gbs = memcpy_floor(MIN(bytes, FLOOR_BYTES));
	shm_gbs = fresh_shm_floor(MIN(bytes, FLOOR_BYTES));
	printf("%u layer%s x %u tokens: %.1f MiB\n", layers, layers > 1 ? "s" : "", arg_tokens,
	       (double)bytes / (1 << 20));
	printf("  memcpy floor      %8.2f GB/s (between touched buffers)\n", floor_gbs);
	printf("  fresh-shm floor   %8.2f GB/s (memcpy into new shared memory, page faults "
	       "included: a host pool's scrubbed chunks)\n", shm_gbs);
	printf("  offload (kvd)     %8.2f GB/s  %8.1f ms  %.2f of the floor\n",
	       (double)bytes / (double)MAX(out_us, 1) / 1e3, (double)out_us / 1e3,
	       (double)bytes / (double)MAX(out_us, 1) / 1e3 / floor_gbs);
	printf("  recall (kvd)      %8.2f GB/s  %8.1f ms  %.2f of the floor, %.2f of fresh-shm\n",
	       (double)bytes / (double)MAX(back_us, 1) / 1e3, (double)back_us / 1e3,
	       (double)bytes / (double)MAX(back_us, 1) / 1e3 / floor_gbs,
	       (double)bytes / (double)MAX(back_us, 1) / 1e3 / shm_gbs);
	printf("  pin that recalls  %8.1f ms (engine's wall time: the recall, the grants, "
	       "mapping them)\n", (double)pin_ns / 1e6);
	return 0;
}

int bench_tier(int argc, char **argv) {
	enum { OPT_SOCKET = 256, OPT_TOKENS, OPT_LAYERS };
	static const struct option options[] = {
		{ "socket", required_argument, NULL, OPT_SOCKET },
		{ "tokens", required_argument, NULL, OPT_TOKENS },
		{ "layers", required_argument, NULL, OPT_LAYERS },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	kvd_tenant_params tier = { .size = sizeof(tier), .set = KVD_TENANT_SET_TIER, .tier = "host" };
	kvd_client *c = NULL, *admin = NULL;
	int opt, r, rc = 1;

	arg_socket = getenv("KVD_SOCKET");
	if (!arg_socket || !*arg_socket)
		arg_socket = KVD_DEFAULT_SOCKET;
	optind = 0;
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case OPT_SOCKET:
			arg_socket = optarg;
			break;
		case OPT_TOKENS:
			if (number_parse_u32(optarg, 16, 1u << 20, &arg_tokens) < 0) {
				fprintf(stderr, "kvd-bench tier: --tokens: '%s' is not in 16..1048576\n",
				        optarg);
				return 2;
			}
			break;
		case OPT_LAYERS:
			if (number_parse_u32(optarg, 1, 128, &arg_layers) < 0) {
				fprintf(stderr, "kvd-bench tier: --layers: '%s' is not in 1..128\n", optarg);
				return 2;
			}
			break;
		case 'h':
			return usage(stdout);
		default:
			return usage(stderr);
		}
	if (optind < argc) {
		fprintf(stderr, "kvd-bench tier: unexpected argument '%s'\n", argv[optind]);
		return 2;
	}
	r = kvd_client_connect(arg_socket, NULL, &admin);
	if (r < 0)
		return fail(NULL, "connecting", r);
	r = kvd_tenant_set_params(admin, "bench-tier", &tier);
	if (r < 0) {
		fail(admin, "setting tenant bench-tier's tier to host", r);
		goto out;
	}
	r = kvd_client_connect(arg_socket, "bench-tier", &c);
	if (r < 0) {
		fail(NULL, "connecting as bench-tier", r);
		goto out;
	}
	printf("kvd-bench tier: a sequence moved to kvd's host tier and back (Llama-3.1-8B-like "
	       "layers: 8 kv heads x 128, bf16)\n");
	if (run(c, admin, 1) == 0 && (arg_layers == 1 || run(c, admin, arg_layers) == 0))
		rc = 0;
out:
	kvd_client_unref(c);
	kvd_client_unref(admin);
	return rc;
}
