/* SPDX-License-Identifier: MIT */
/*
 * The cuda backend across processes, on a real GPU (suite gpu; exits 77 without one), and
 * under the fake driver of tests/fake-cuda (suite fake-gpu, as gpu-ipc-fake-driver):
 *
 *   - the daemon (one process) starts with --backend cuda and grants chunks as cuMem fds;
 *   - this process (tenant a) imports them through libkvd, writes a pattern into every
 *     block with cuMemcpyHtoD, and the daemon's digest, computed through the daemon's own
 *     mapping of the same memory, must equal the digest of the pattern: the daemon sees
 *     the engine's writes, so the export -> SCM_RIGHTS -> import -> map path works;
 *   - a second process (tenant b, a child that execs this program) is then granted the
 *     chunk a released, as a new allocation (another tenant's memory is never given on:
 *     pool.h, "Isolation"): it must read zeros only (a's data did not leak), and its own
 *     writes must reach the daemon's digest too.
 *
 * A broken IPC path (a chunk imported as other memory, a map at the wrong place, access not
 * granted, scrubs that do not land) fails one of these comparisons or faults.
 */

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/layout.h"
#include "basic/macro.h"
#include "basic/cuda-dl.h"
#include "fixture.h"
#include "gpu-test.h"
#include "test.h"

#define TOKENS 40u
#define MAX_BLOCKS 64u
#define CHILD_ENV "KVD_GPU_TEST_CHILD_SOCKET"

static const struct cuda_dl *cu;

static const kvd_model_spec spec = {
	.name = "gpu-ipc",
	.layers = 2,
	.q_heads = 4,
	.kv_heads = 2,
	.head_dim = 64,
	.dtype = KVD_DTYPE_F16,
	.block_tokens = 16,
	.layout = KVD_LAYOUT_PER_LAYER,
};

/* The host copy of what was written to each block, to compute the expected digest. */
struct written {
	struct kvd_block_ref ref[MAX_BLOCKS];
	uint8_t *buf[MAX_BLOCKS];
	unsigned n;
};

static const void *written_block(void *userdata, struct kvd_block_ref ref) {
	const struct written *w = userdata;

	for (unsigned i = 0; i < w->n; i++)
		if (w->ref[i].chunk_id == ref.chunk_id && w->ref[i].index == ref.index)
			return w->buf[i];
	return NULL;
}

/* Makes device ordinal's primary context (the one libkvd uses) current here. */
static int make_current(int ordinal) {
	CUcontext ctx;
	CUdevice dev;

	if (cu->cuDeviceGet(&dev, ordinal) != CUDA_SUCCESS ||
	    cu->cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
	    cu->cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
		return -ENODEV;
	return 0;
}

/* Makes the GPU the daemon pooled current here. */
static int use_device(kvd_client *c) {
	int32_t ordinal = -1;

	if (kvd_client_memory(c, &ordinal) != KVD_MEMORY_CUDA || ordinal < 0)
		return -EPROTO;
	return make_current(ordinal);
}

/*
 * Every block of s: checks that it reads as zeros when want_zero, then writes a pattern
 * seeded by seed and records it in w. Returns 0, -EIO (a nonzero byte where zeros were
 * due), or another -errno.
 */
static int fill_blocks(kvd_seq *s, uint32_t seed, bool want_zero, struct written *w) {
	const struct kvd_seq_desc *d = kvd_seq_descriptor(s);
	uint64_t bytes = d->block_bytes;

	w->n = 0;
	for (uint32_t t = 0; t < d->n_tables; t++)
		for (uint32_t i = 0; i < DIV_ROUND_UP(layout_tokens(d)[t], d->block_tokens); i++) {
			uint8_t *buf = malloc(bytes);
			void *p;

			if (!buf || w->n == MAX_BLOCKS)
				return -ENOMEM;
			if (kvd_seq_block(s, t, i, &p) < 0)
				return -EINVAL;
			if (cu->cuMemcpyDtoH(buf, (CUdeviceptr)(uintptr_t)p, bytes) != CUDA_SUCCESS)
				return -EIO;
			for (uint64_t k = 0; want_zero && k < bytes; k++)
				if (buf[k] != 0)
					return -EIO;
			for (uint64_t k = 0; k < bytes; k++)
				buf[k] = (uint8_t)(seed * 131u + t * 31u + i * 7u + k * 13u + 1u);
			if (cu->cuMemcpyHtoD((CUdeviceptr)(uintptr_t)p, buf, bytes) != CUDA_SUCCESS)
				return -EIO;
			w->ref[w->n] = layout_blocks(d, t)[i];
			w->buf[w->n++] = buf;
		}
	return 0;
}

static void written_done(struct written *w) {
	for (unsigned i = 0; i < w->n; i++)
		free(w->buf[i]);
	w->n = 0;
}

/* The daemon's digest of s against the one of what was written. */
static int check_digest(kvd_seq *s, struct written *w) {
	uint64_t daemon = 0, want = 0;
	int r;

	r = kvd_seq_digest(s, &daemon, NULL);
	if (r < 0)
		return r;
	r = layout_digest(kvd_seq_header(s), kvd_seq_descriptor(s), written_block, w, &want, NULL);
	if (r < 0)
		return r;
	return daemon == want ? 0 : -EBADMSG;
}

/* The second process: prints the chunks it was granted, one id a line, then exits 0, or
 * with the step that failed. */
static int child_main(const char *socket) {
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	struct written w = {};
	uint32_t ids[MAX_BLOCKS], n = 0;
	kvd_seq *s;
	int model;

	/* An engine on the first GPU, as a in the parent. */
	if (make_current(0) < 0)
		return 9;
	if (kvd_client_connect(socket, "b", &c) < 0)
		return 10;
	if (use_device(c) < 0)
		return 11;
	model = kvd_model_register(c, &spec);
	if (model < 0 || kvd_seq_open(c, model, TOKENS, &s) < 0 || kvd_seq_grow(s, TOKENS) < 0)
		return 12;
	if (fill_blocks(s, 2, true, &w) < 0)
		return 13; /* a's data, or garbage, where the scrub should have left zeros */
	if (check_digest(s, &w) < 0)
		return 14;
	if (kvd_client_mapped_chunks(c, ids, MAX_BLOCKS, &n) < 0)
		return 15;
	for (uint32_t i = 0; i < n; i++)
		printf("%u\n", ids[i]);
	fflush(stdout);
	written_done(&w);
	return kvd_seq_release(s) < 0 ? 16 : 0;
}

int test_setup(void) {
	const char *child = getenv(CHILD_ENV);
	const char *why = NULL;
	int r;

	r = cuda_dl_load(&cu, &why);
	if (r < 0) {
		printf("no usable GPU: %s\n", why);
		return EXIT_TEST_SKIP;
	}
	if (child)
		_exit(child_main(child));
	gpu_test_ran_on(cu, why);
	/* The fixture's K/V helpers then use driver copies, as on any GPU. */
	setenv("KVD_TEST_BACKEND", "cuda", 1);
	return 0;
}

/* Runs child_main() in a new process (exec: a CUDA context does not survive fork), with
 * its stdout in out. Returns its exit status. */
static int run_child(const char *socket, char *out, size_t n) {
	int pipefd[2], status;
	size_t got = 0;
	ssize_t k;
	pid_t pid;

	ASSERT_OK(pipe(pipefd));
	pid = fixture_fork();
	if (pid == 0) {
		dup2(pipefd[1], STDOUT_FILENO);
		setenv(CHILD_ENV, socket, 1);
		execl("/proc/self/exe", "test-gpu-ipc", (char *)NULL);
		_exit(127);
	}
	close(pipefd[1]);
	while (got + 1 < n && (k = read(pipefd[0], out + got, n - 1 - got)) > 0)
		got += (size_t)k;
	out[got] = 0;
	close(pipefd[0]);
	ASSERT_EQ(waitpid(pid, &status, 0), pid);
	return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(two_processes_share_and_scrub) {
	/* One chunk: whoever gets memory gets that chunk. */
	static const char *const args[] = { "--backend=cuda", "--pool-size=4MiB",
		                            "--chunk-size=4MiB", NULL };
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	uint32_t ids[MAX_BLOCKS], n_a = 0, n = 0, reused = 0;
	struct written w = {};
	struct fixture f;
	char out[1024];
	kvd_seq *s;
	int model;

	fixture_start(&f, args);
	c = fixture_connect(&f, "a");
	ASSERT_OK(use_device(c));
	model = kvd_model_register(c, &spec);
	ASSERT_GT(model, 0);
	ASSERT_OK(kvd_seq_open(c, model, TOKENS, &s));
	ASSERT_OK(kvd_seq_grow(s, TOKENS));
	/* The first owner reads zeros too: chunks are zeroed when made. */
	ASSERT_OK(fill_blocks(s, 1, true, &w));
	ASSERT_OK(check_digest(s, &w));
	written_done(&w);
	ASSERT_OK(kvd_client_mapped_chunks(c, ids, MAX_BLOCKS, &n_a));
	ASSERT_GT(n_a, 0u);

	/* Released: unmapped here, free for b. */
	ASSERT_OK(kvd_seq_release(s));
	ASSERT_OK(kvd_client_mapped_chunks(c, NULL, 0, &n));
	ASSERT_EQ(n, 0u);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "used_bytes", 0));

	ASSERT_EQ(run_child(f.socket, out, sizeof(out)), 0);
	/* b got a's chunk, as a new allocation (a's processes may still map the old one:
	 * pool.h, "Isolation"), and read zeros there. */
	for (char *p = out; *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : p + strlen(p))
		for (uint32_t i = 0; i < n_a && i < MAX_BLOCKS; i++)
			if (ids[i] == (uint32_t)strtoul(p, NULL, 10)) {
				reused++;
				break;
			}
	ASSERT_GT(reused, 0u);
	ASSERT_OK(fixture_stop(&f));
}

/*
 * A round on the device pool (on the last GPU, which may be another than the first
 * test's): one tenant grows two sequences to twice the budget, writing
 * each step's K/V with driver copies (the fixture's helpers with KVD_TEST_BACKEND=cuda) and
 * publishing windows, so that pressure rounds score the K/V the daemon reads from the GPU
 * and compact it there. Survivors must read back bit-exact at their original positions
 * (a compaction copy that went wrong shows here), and the daemon's digest, read through its
 * own mapping, must equal this process's. The tenant's policy (laprox) scores on the GPU
 * where the kernels loaded (a GPU, kvd-hostkernels): every layer there, none fallen back.
 */
TEST(rounds_evict_and_compact_on_the_device) {
	static const char *const args[] = { "--backend=cuda", "--pool-size=64MiB",
		                            "--chunk-size=2MiB", "--budget=8MiB",
		                            "--grant-wait=5000", NULL };
	static const kvd_eviction_spec ev = { .unit = KVD_UNIT_LAYER_TOKEN, .window = 8, .sinks = 4 };
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	uint64_t row = (uint64_t)spec.q_heads * ev.window * spec.head_dim;
	_cleanup_(freep) uint16_t *q = calloc(row, sizeof(*q));
	int32_t ordinal = -1;
	struct fixture f;
	CUcontext ctx;
	CUdevice dev;
	kvd_seq *s[2];
	int model;

	ASSERT_TRUE(q);
	/* Small finite f16 queries (0.5, -0.5, 1, ...), so that attention is real. */
	for (uint64_t i = 0; i < row; i++)
		q[i] = (uint16_t[]){ 0x3800, 0xb800, 0x3c00, 0x0000 }[i % 4];
	fixture_setup(&f, "[tenant a]\npolicy = laprox\n", true);
	fixture_launch(&f, args);
	/* On the last GPU: where the daemon pools several (the fake driver's two, in CI), the
	 * device current at connect chooses the connection's. */
	ASSERT_EQ(cu->cuDeviceGet(&dev, cu->device_count - 1), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuDevicePrimaryCtxRetain(&ctx, dev), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuCtxSetCurrent(ctx), CUDA_SUCCESS);
	c = fixture_connect(&f, "a");
	ASSERT_EQ(kvd_client_memory(c, &ordinal), KVD_MEMORY_CUDA);
	ASSERT_EQ(ordinal, cu->device_count - 1);
	model = kvd_model_register_evictable(c, &spec, &ev);
	ASSERT_GT(model, 0);
	for (int i = 0; i < 2; i++)
		ASSERT_OK(kvd_seq_open(c, model, 1 << 14, &s[i]));
	/* 2 sequences x 8192 tokens x 2 layers x 512 bytes: 16 MiB into 8 MiB. */
	for (uint32_t step = 0; step < 32; step++)
		for (int i = 0; i < 2; i++) {
			uint64_t from = kvd_seq_descriptor(s[i])->next_position;

			ASSERT_OK(kvd_seq_grow(s[i], 256));
			ASSERT_OK(kvd_seq_pin(s[i]));
			fill_seq_from(s[i], 7 + i, from);
			for (uint32_t l = 0; l < spec.layers; l++) {
				void *obs;

				ASSERT_OK(kvd_seq_observation(s[i], l, &obs));
				memcpy(obs, q, row * sizeof(*q));
				ASSERT_OK(kvd_seq_observe(s[i], l));
			}
			ASSERT_OK(kvd_seq_unpin(s[i]));
		}
	ASSERT_GT(fixture_status(&f, NULL, "rounds_total"), 0u);
	ASSERT_GT(fixture_status(&f, "a", "evicted_tokens"), 0u);
	ASSERT_EQ(fixture_status(&f, NULL, "gpu_fallbacks"), 0u);
	if (fixture_log_count(&f, "rounds score restkv and laprox there") > 0)
		ASSERT_GT(fixture_status(&f, NULL, "gpu_scored_layers"), 0u);
	else
		ASSERT_EQ(fixture_status(&f, NULL, "gpu_scored_layers"), 0u);
	ASSERT_TRUE(fixture_status(&f, NULL, "used_bytes") <= (8u << 20));
	for (int i = 0; i < 2; i++) {
		ASSERT_OK(kvd_seq_pin(s[i]));
		ASSERT_TRUE(kvd_seq_tokens(s[i], 0, 0) < 8192);
		ASSERT_EQ(check_seq(s[i], 7 + i), 0u);
		assert_digests_agree(s[i]);
		ASSERT_OK(kvd_seq_unpin(s[i]));
		ASSERT_OK(kvd_seq_release(s[i]));
	}
	ASSERT_OK(fixture_stop(&f));
	ASSERT_EQ(cu->cuDevicePrimaryCtxRelease(dev), CUDA_SUCCESS);
}

/*
 * An engine's step ordered by an interprocess event (kvd_seq_unpin_after): the engine
 * queues a write of a block on its own stream, records an event after it and unpins
 * without waiting; the daemon must not read the block before the write is done, so its
 * digest (-EAGAIN while the event is pending) sees the written bytes. Where the GPU has no
 * interprocess events (status ipc_events=no), libkvd waits itself and says so (1).
 */
TEST(engine_work_ordered_by_an_event) {
	static const char *const args[] = { "--backend=cuda", "--pool-size=4MiB",
		                            "--chunk-size=4MiB", NULL };
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	struct written w = {};
	uint64_t daemon = 0, want = 0;
	unsigned again = 0;
	struct fixture f;
	char text[1024];
	CUstream st;
	CUevent ev;
	kvd_seq *s;
	void *p;
	int model, r;

	fixture_start(&f, args);
	c = fixture_connect(&f, "a");
	ASSERT_OK(use_device(c));
	model = kvd_model_register(c, &spec);
	ASSERT_GT(model, 0);
	ASSERT_OK(kvd_seq_open(c, model, TOKENS, &s));
	ASSERT_OK(kvd_seq_grow(s, TOKENS));
	ASSERT_OK(kvd_seq_pin(s));
	ASSERT_OK(fill_blocks(s, 3, true, &w));
	ASSERT_EQ(cu->cuStreamCreate(&st, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuEventCreate(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING), CUDA_SUCCESS);
	/* The step's work: block 0 rewritten on the engine's stream, not waited for. */
	ASSERT_OK(kvd_seq_block(s, 0, 0, &p));
	ASSERT_EQ(cu->cuMemsetD8Async((CUdeviceptr)(uintptr_t)p, 0x5a,
	                              kvd_seq_descriptor(s)->block_bytes, st), CUDA_SUCCESS);
	memset(w.buf[0], 0x5a, kvd_seq_descriptor(s)->block_bytes);
	ASSERT_EQ(cu->cuEventRecord(ev, st), CUDA_SUCCESS);
	r = kvd_seq_unpin_after(s, ev);
	ASSERT_TRUE(r == 0 || r == 1);
	fixture_status_str(&f, NULL, "devices", text, sizeof(text));
	printf("unpin_after: %s (%s)\n", r == 0 ? "the daemon waits for the event" :
	       "libkvd waited", text);
	if (strstr(text, "ipc_events=yes"))
		ASSERT_EQ(r, 0);
	while ((r = kvd_seq_digest(s, &daemon, NULL)) == -EAGAIN && again < 10000) {
		again++;
		usleep(1000);
	}
	ASSERT_OK(r);
	ASSERT_OK(layout_digest(kvd_seq_header(s), kvd_seq_descriptor(s), written_block, &w, &want, NULL));
	ASSERT_EQ(daemon, want);
	ASSERT_OK(kvd_seq_release(s));
	written_done(&w);
	ASSERT_EQ(cu->cuEventDestroy(ev), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuStreamDestroy(st), CUDA_SUCCESS);
	c = kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}
