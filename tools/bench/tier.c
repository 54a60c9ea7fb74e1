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
#include <fcntl.h>
#include <getopt.h>
#include <liburing.h>
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
/* The file tier's requests in flight (daemon/tiers/tier-file.h). */
#define TIER_DEPTH 16u
/* Sequences that fill the host tier until one goes to the file, at most. */
#define FILLERS_MAX 64u

static const char *arg_socket, *arg_file_dir;
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
	        "  --file-dir DIR   Also through the file tier: the daemon's file-tier-dir, whose\n"
	        "                   file system the io_uring O_DIRECT floor is measured on (the\n"
	        "                   daemon then needs a file tier larger than the sequence, and\n"
	        "                   a host tier it fills with sequences like it until the first\n"
	        "                   goes to the file: at most 64)\n"
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

/* A sequence of the model (m: its id) grown to --tokens and written, then left alone. */
static int filled(kvd_client *c, int m, uint32_t layers, kvd_seq **ret) {
	uint64_t blocks = (arg_tokens + BLOCK_TOKENS - 1) / BLOCK_TOKENS;
	kvd_seq *s = NULL;
	int r;

	r = kvd_seq_open(c, m, arg_tokens, &s);
	for (uint32_t done = 0; r >= 0 && done < arg_tokens; done += GROW_STEP)
		r = kvd_seq_grow(s, MIN(GROW_STEP, arg_tokens - done));
	/* Written, so that every page is there to move; a GPU pool's blocks are device
	 * memory, allocated whole already, which the CPU must not touch. */
	if (r >= 0)
		r = kvd_seq_pin(s);
	for (uint32_t l = 0; r >= 0 && kvd_client_memory(c, NULL) == KVD_MEMORY_HOST && l < layers;
	     l++)
		for (uint64_t b = 0; r >= 0 && b < blocks; b++) {
			void *p;

			r = kvd_seq_block(s, l, (uint32_t)b, &p);
			if (r >= 0)
				memset(p, (int)(l + b), BLOCK_TOKENS * TOKEN_LAYER_BYTES);
		}
	if (r >= 0)
		r = kvd_seq_unpin(s);
	if (r < 0) {
		(void)kvd_seq_release(s);
		return fail(c, "a sequence to move", r);
	}
	*ret = s;
	return 0;
}

/* Waits until status key passes was. Returns 0, or 1 (not within WAIT_MS, said). */
static int wait_past(kvd_client *admin, const char *key, uint64_t was) {
	uint64_t t0 = now_ms(), v = was;

	while (v <= was && now_ms() - t0 < WAIT_MS) {
		struct timespec ts = { 0, 10 * 1000 * 1000 };
		int r;

		nanosleep(&ts, NULL);
		r = status_u64(admin, key, &v);
		if (r < 0)
			return fail(admin, "reading the status", r);
	}
	if (v > was)
		return 0;
	fprintf(stderr, "kvd-bench tier: %s did not move within %d s: start kvd with a host tier "
	        "(and a file tier) large enough and a short --tier-idle (see --help)\n", key,
	        WAIT_MS / 1000);
	return 1;
}

static int model(kvd_client *c, uint32_t layers) {
	kvd_model_spec spec = { "bench-tier", layers, 32, KV_HEADS, HEAD_DIM, KVD_DTYPE_BF16,
		                BLOCK_TOKENS, KVD_LAYOUT_PER_LAYER };
	int m = kvd_model_register(c, &spec);

	return m < 0 ? fail(c, "registering the model", m), -1 : m;
}

/* One sequence of `layers` layers moved out and back. */
static int run(kvd_client *c, kvd_client *admin, uint32_t layers) {
	uint64_t bytes = (uint64_t)arg_tokens * layers * TOKEN_LAYER_BYTES;
	uint64_t out0, out_us0, back_us0, out_us, back_us, pin_ns, t0;
	double floor_gbs, shm_gbs;
	kvd_seq *s = NULL;
	int m, r, recall = -1;

	m = model(c, layers);
	if (m < 0 || filled(c, m, layers, &s) != 0)
		return 1;
	if ((r = status_u64(admin, "tier_offloads", &out0)) < 0 ||
	    (r = status_u64(admin, "tier_offload_us", &out_us0)) < 0 ||
	    (r = status_u64(admin, "tier_recall_us", &back_us0)) < 0)
		return fail(admin, "reading the status (a kvd without a host tier?)", r);
	if (wait_past(admin, "tier_offloads", out0) != 0)
		return 1;
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

/*
 * The raw floor of the file tier's I/O on dir's file system: n segments of seg bytes
 * written to a new file with O_DIRECT through io_uring, TIER_DEPTH in flight, from one
 * registered buffer, then read back the same way; GB/s of each, the best of 2.
 */
static int uring_floor(const char *dir, uint64_t seg, uint32_t n, double *ret_write,
                       double *ret_read) {
	char path[4096];
	struct io_uring ring;
	struct iovec iov;
	void *buf = NULL;
	int fd, r;

	*ret_write = *ret_read = 0;
	snprintf(path, sizeof(path), "%s/kvd-bench-tier-floor", dir);
	fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
	if (fd < 0)
		return -errno;
	(void)unlink(path);
	r = posix_memalign(&buf, 4096, seg * TIER_DEPTH) == 0 ? 0 : -ENOMEM;
	if (r == 0)
		memset(buf, 0x5a, seg * TIER_DEPTH);
	if (r == 0)
		r = io_uring_queue_init(TIER_DEPTH, &ring, 0);
	if (r < 0) {
		free(buf);
		close(fd);
		return r;
	}
	iov = (struct iovec){ buf, seg * TIER_DEPTH };
	r = io_uring_register_buffers(&ring, &iov, 1);
	for (int pass = 0; r >= 0 && pass < 4; pass++) {
		bool write = pass % 2 == 0;
		uint64_t t0 = now_ns();
		double gbs;

		for (uint32_t done = 0; r >= 0 && done < n;) {
			uint32_t batch = MIN(n - done, TIER_DEPTH);

			for (uint32_t i = 0; i < batch; i++) {
				struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
				char *p = (char *)buf + (uint64_t)i * seg;
				uint64_t off = (uint64_t)(done + i) * seg;

				if (write)
					io_uring_prep_write_fixed(sqe, fd, p, (unsigned)seg, off, 0);
				else
					io_uring_prep_read_fixed(sqe, fd, p, (unsigned)seg, off, 0);
			}
			r = io_uring_submit_and_wait(&ring, batch);
			for (uint32_t i = 0; r >= 0 && i < batch; i++) {
				struct io_uring_cqe *cqe;

				r = io_uring_wait_cqe(&ring, &cqe);
				if (r >= 0 && (uint64_t)cqe->res != seg)
					r = cqe->res < 0 ? cqe->res : -EIO;
				if (r >= 0)
					io_uring_cqe_seen(&ring, cqe);
			}
			done += batch;
		}
		gbs = (double)n * (double)seg / (double)MAX(now_ns() - t0, 1);
		if (write)
			*ret_write = MAX(*ret_write, gbs);
		else
			*ret_read = MAX(*ret_read, gbs);
	}
	io_uring_queue_exit(&ring);
	free(buf);
	close(fd);
	return r < 0 ? r : 0;
}

/*
 * One sequence of `layers` layers moved to the host tier, from there to the file (sequences
 * like it fill the host tier after it until the oldest, it, goes to the file), and back from
 * the file, next to the floor of the file's I/O on the same file system.
 */
static int run_file(kvd_client *c, kvd_client *admin, uint32_t layers) {
	uint64_t bytes = (uint64_t)arg_tokens * layers * TOKEN_LAYER_BYTES, seg = kvd_client_chunk_bytes(c);
	uint64_t out0, down0, down_us0, down_bytes0, back_us0, down_us, down_bytes, back_us, pin_ns;
	uint64_t read_us0, read_us;
	kvd_seq *x = NULL, *fill[FILLERS_MAX];
	double w_gbs, r_gbs;
	uint32_t n_fill = 0;
	int m, r, rc = 1, recall = -1;

	m = model(c, layers);
	if (m < 0)
		return 1;
	/* Before kvd's I/O and after it (below): a disk behind caches of its own (a VM's)
	 * writes slower while it flushes what came before. The floor is the better of both. */
	r = uring_floor(arg_file_dir, seg, (uint32_t)MIN(DIV_ROUND_UP(bytes, seg), FLOOR_BYTES / seg),
	                &w_gbs, &r_gbs);
	if (r < 0) {
		fprintf(stderr, "kvd-bench tier: the io_uring O_DIRECT floor in %s: %s\n", arg_file_dir,
		        strerror(-r));
		return 1;
	}
	if ((r = status_u64(admin, "tier_offloads", &out0)) < 0 ||
	    (r = status_u64(admin, "tier_demotes", &down0)) < 0 ||
	    (r = status_u64(admin, "tier_demote_us", &down_us0)) < 0 ||
	    (r = status_u64(admin, "tier_demote_bytes", &down_bytes0)) < 0 ||
	    (r = status_u64(admin, "tier_file_recall_us", &back_us0)) < 0 ||
	    (r = status_u64(admin, "tier_file_read_us", &read_us0)) < 0)
		return fail(admin, "reading the status (a kvd without a file tier?)", r);
	if (filled(c, m, layers, &x) != 0 || wait_past(admin, "tier_offloads", out0++) != 0)
		goto out;
	for (uint64_t v = down0; v == down0 && n_fill < FILLERS_MAX;) {
		if (filled(c, m, layers, &fill[n_fill]) != 0)
			goto out;
		n_fill++;
		if (wait_past(admin, "tier_offloads", out0++) != 0 ||
		    (r = status_u64(admin, "tier_demotes", &v)) < 0)
			goto out;
	}
	if (wait_past(admin, "tier_demotes", down0) != 0)
		goto out;
	/* Its demotion is done when its recall can begin: the pin waits for it anyway. */
	pin_ns = now_ns();
	r = kvd_seq_pin_recall(x, &recall);
	pin_ns = now_ns() - pin_ns;
	if (r < 0) {
		fail(c, "pinning", r);
		goto out;
	}
	if (recall != KVD_RECALL_FILE) {
		fprintf(stderr, "kvd-bench tier: the pin found %d, not KVD_RECALL_FILE\n", recall);
		goto out;
	}
	(void)kvd_seq_unpin(x);
	if ((r = status_u64(admin, "tier_demote_us", &down_us)) < 0 ||
	    (r = status_u64(admin, "tier_demote_bytes", &down_bytes)) < 0 ||
	    (r = status_u64(admin, "tier_file_recall_us", &back_us)) < 0 ||
	    (r = status_u64(admin, "tier_file_read_us", &read_us)) < 0) {
		fail(admin, "reading the status", r);
		goto out;
	}
	read_us -= read_us0;

	down_us -= down_us0;
	down_bytes -= down_bytes0;
	back_us -= back_us0;
	{
		double w2, r2;

		r = uring_floor(arg_file_dir, seg,
		                (uint32_t)MIN(DIV_ROUND_UP(bytes, seg), FLOOR_BYTES / seg), &w2, &r2);
		if (r < 0) {
			fprintf(stderr, "kvd-bench tier: the io_uring O_DIRECT floor in %s: %s\n",
			        arg_file_dir, strerror(-r));
			goto out;
		}
		w_gbs = MAX(w_gbs, w2);
		r_gbs = MAX(r_gbs, r2);
	}
	printf("%u layer%s x %u tokens through the file tier (%s; %u filler sequence%s)\n", layers,
	       layers > 1 ? "s" : "", arg_tokens, arg_file_dir, n_fill, n_fill == 1 ? "" : "s");
	printf("  io_uring O_DIRECT floor: write %.2f GB/s, read %.2f GB/s (%u in flight, %.1f MiB "
	       "each; the better of a run before kvd's and one after)\n", w_gbs, r_gbs, TIER_DEPTH,
	       (double)seg / (1 << 20));
	printf("  to the file (kvd)  %8.2f GB/s  %8.1f ms  %.2f of the write floor\n",
	       (double)down_bytes / (double)MAX(down_us, 1) / 1e3, (double)down_us / 1e3,
	       (double)down_bytes / (double)MAX(down_us, 1) / 1e3 / w_gbs);
	printf("  recall (kvd)       %8.2f GB/s  %8.1f ms  %.2f of the read floor (read, check, "
	       "write into the pool)\n", (double)bytes / (double)MAX(back_us, 1) / 1e3,
	       (double)back_us / 1e3, (double)bytes / (double)MAX(back_us, 1) / 1e3 / r_gbs);
	printf("  of which waiting   %8.1f ms  for the file: the reads (%u segments at a time) "
	       "that writing the batch before into the pool did not hide\n",
	       (double)read_us / 1e3, TIER_DEPTH / 2);
	printf("  pin that recalls   %8.1f ms\n", (double)pin_ns / 1e6);
	rc = 0;
out:
	(void)kvd_seq_release(x);
	for (uint32_t i = 0; i < n_fill; i++)
		(void)kvd_seq_release(fill[i]);
	return rc;
}

int bench_tier(int argc, char **argv) {
	enum { OPT_SOCKET = 256, OPT_TOKENS, OPT_LAYERS, OPT_FILE_DIR };
	static const struct option options[] = {
		{ "socket", required_argument, NULL, OPT_SOCKET },
		{ "tokens", required_argument, NULL, OPT_TOKENS },
		{ "layers", required_argument, NULL, OPT_LAYERS },
		{ "file-dir", required_argument, NULL, OPT_FILE_DIR },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	kvd_tenant_params tier = { .size = sizeof(tier), .set = KVD_TENANT_SET_TIER, .tier = "host" };
	kvd_client *c = NULL, *admin = NULL;
	int opt, r, rc = 1;

	/* NULL: libkvd's default, $KVD_SOCKET or KVD_DEFAULT_SOCKET. */
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
		case OPT_FILE_DIR:
			arg_file_dir = optarg;
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
	if (rc == 0 && arg_file_dir) {
		tier.tier = "host+file";
		r = kvd_tenant_set_params(admin, "bench-tier", &tier);
		if (r < 0)
			rc = fail(admin, "setting tenant bench-tier's tier to host+file", r);
		else if (run_file(c, admin, 1) != 0 ||
		         (arg_layers > 1 && run_file(c, admin, arg_layers) != 0))
			rc = 1;
	}
out:
	kvd_client_unref(c);
	kvd_client_unref(admin);
	return rc;
}
