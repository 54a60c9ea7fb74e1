/* SPDX-License-Identifier: MIT */
/*
 * Choosing the backend, under the fake CUDA driver of tests/fake-cuda (suite fake-gpu;
 * meson runs it with LD_LIBRARY_PATH there): --backend auto picks cuda when a GPU is usable
 * and says so, falls back to host when the driver has no device, --backend cuda refuses to
 * start without one, and a client imports chunks from a daemon that pooled another device
 * than the first, with chunks whose size is not a power of two. --devices numbers GPUs in
 * PCI bus order or names them by UUID, and a tenant gets chunks on its own GPU or none.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "basic/macro.h"
#include "basic/cuda-dl.h"
#include "fixture.h"
#include "test.h"

#define MiB (UINT64_C(1) << 20)
/* Events a connection registers at most (kvd.h, kvd_seq_unpin_after). */
#define CLIENT_EVENTS 16u

static const kvd_model_spec spec = {
	.name = "fake-driver",
	.layers = 2,
	.q_heads = 4,
	.kv_heads = 2,
	.head_dim = 64,
	.dtype = KVD_DTYPE_F16,
	.block_tokens = 16,
	.layout = KVD_LAYOUT_PER_LAYER,
};

int test_setup(void) {
	const struct cuda_dl *cu;
	const char *why = NULL;
	char name[64] = "";

	/* This process sees two fake devices; each daemon gets its own count below. */
	setenv("KVD_FAKE_CUDA_DEVICES", "2", 1);
	if (cuda_dl_load(&cu, &why) < 0 || cu->cuDeviceGetName(name, sizeof(name), 0) != CUDA_SUCCESS ||
	    strncmp(name, "kvd fake CUDA device", 20) != 0) {
		printf("the fake CUDA driver is not what loads here (%s)\n", why ? why : name);
		return EXIT_TEST_SKIP;
	}
	return 0;
}

/* Starts a daemon with its stderr in its log, with devices fake devices. */
static void start(struct fixture *f, const char *devices, const char *const *args) {
	setenv("KVD_FAKE_CUDA_DEVICES", devices, 1);
	fixture_setup(f, NULL, true);
	fixture_launch(f, args);
	setenv("KVD_FAKE_CUDA_DEVICES", "2", 1);
}

TEST(auto_picks_cuda) {
	static const char *const args[] = { "--backend=auto", "--pool-percent=10", NULL };
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	int32_t ordinal = -1;
	struct fixture f;

	start(&f, "1", args);
	ASSERT_TRUE(fixture_wait_log(&f, "backend auto: cuda on 1 GPU: GPU 0 (kvd fake CUDA device 0, "
	                                 "1024 of 1024 MiB free", 1));
	/* 10% of the fake's 1 GiB, in whole 4 MiB chunks. */
	ASSERT_TRUE(fixture_wait_log(&f, "pool-percent 10: 100 MiB on each of 1 GPU", 1));
	c = fixture_connect(&f, "a");
	ASSERT_EQ(kvd_client_memory(c, &ordinal), KVD_MEMORY_CUDA);
	ASSERT_EQ(ordinal, 0);
	c = kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* A driver older than the kernels need: kvd pools its GPU memory, says at start that
 * rounds will score on the CPU, and the first round says why in the driver's words. */
TEST(old_driver_said_at_start) {
	static const char *const args[] = { "--backend=cuda", "--pool-size=16MiB",
		                            "--chunk-size=4MiB", NULL };
	_cleanup_(kvd_client_unrefp) kvd_client *admin = NULL;
	struct fixture f;
	uint64_t freed = 0;
	char want[256];

	/* The kernels need the toolkit's driver (CUDA_VERSION): 12.4 is older than CUDA 13's. */
	if (CUDA_VERSION <= 12040)
		TEST_SKIP("built with a CUDA 12.4 toolkit or older: its kernels load on 12.4");
	setenv("KVD_FAKE_CUDA_DRIVER_VERSION", "12040", 1);
	start(&f, "1", args);
	unsetenv("KVD_FAKE_CUDA_DRIVER_VERSION");
	snprintf(want, sizeof(want), "CUDA driver 12.4: kvd's GPU memory works with it (11.4 or "
	         "newer), but its scoring kernels need %d.%d or newer", CUDA_VERSION / 1000,
	         CUDA_VERSION % 1000 / 10);
	ASSERT_TRUE(fixture_wait_log(&f, want, 1));
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_evict(admin, NULL, 1 << 20, &freed));
	snprintf(want, sizeof(want), "rounds score on the CPU, with the K/V copied there: the "
	         "kernels did not load (CUDA_ERROR_UNSUPPORTED_PTX_VERSION): they need a CUDA "
	         "%d.%d driver or newer, this one is 12.4", CUDA_VERSION / 1000,
	         CUDA_VERSION % 1000 / 10);
	ASSERT_TRUE(fixture_wait_log(&f, want, 1));
	admin = kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(auto_falls_back_without_device) {
	static const char *const args[] = { "--backend=auto", "--pool-size=8MiB", NULL };
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	struct fixture f;

	start(&f, "0", args);
	ASSERT_TRUE(fixture_wait_log(&f, "no usable GPU (cuInit failed: 100 (no CUDA device)): "
	                                 "falling back to host", 1));
	c = fixture_connect(&f, "a");
	ASSERT_EQ(kvd_client_memory(c, NULL), KVD_MEMORY_HOST);
	c = kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(cuda_refuses_without_device) {
	char out[4096];

	setenv("KVD_FAKE_CUDA_DEVICES", "0", 1);
	ASSERT_EQ(fixture_run_daemon("--backend cuda --config /dev/null --socket /nonexistent/kvd.sock",
	                             out, sizeof(out)), 1);
	setenv("KVD_FAKE_CUDA_DEVICES", "2", 1);
	if (!strstr(out, "backend cuda unusable: cuInit failed: 100 (no CUDA device)"))
		test_fail(__FILE__, __LINE__, "no clear refusal: %s", out);
}

/*
 * The second device, chunks of 6 MiB: the client finds the daemon's GPU by UUID (not by
 * ordinal) and reserves its pool range with an alignment the driver accepts (a power of
 * two), then maps, writes and reads every block, and the daemon's digest agrees.
 */
TEST(second_device_odd_chunks) {
	static const char *const args[] = { "--backend=cuda", "--devices=1", "--chunk-size=6MiB",
		                            "--pool-size=48MiB", NULL };
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	const struct cuda_dl *cu;
	uint64_t before = 0, after = 0;
	const uint8_t one = 1;
	int32_t ordinal = -1;
	void *p;
	struct fixture f;
	CUcontext ctx;
	uint32_t n = 0;
	kvd_seq *s;
	int model;

	start(&f, "2", args);
	ASSERT_TRUE(fixture_wait_log(&f, "backend cuda: cuda on 1 GPU: GPU 1 (kvd fake CUDA device 1", 1));
	c = fixture_connect(&f, "a");
	ASSERT_EQ(kvd_client_memory(c, &ordinal), KVD_MEMORY_CUDA);
	ASSERT_EQ(ordinal, 1);
	model = kvd_model_register(c, &spec);
	ASSERT_GT(model, 0);
	ASSERT_OK(kvd_seq_open(c, model, 100, &s));
	ASSERT_OK(kvd_seq_grow(s, 100));
	ASSERT_OK(kvd_client_mapped_chunks(c, NULL, 0, &n));
	ASSERT_GT(n, 0u);
	/* A byte written through the driver here is one the daemon reads in its mapping. */
	ASSERT_OK(kvd_seq_digest(s, &before, NULL));
	ASSERT_OK(cuda_dl_load(&cu, NULL));
	ASSERT_EQ(cu->cuDevicePrimaryCtxRetain(&ctx, 1), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuCtxSetCurrent(ctx), CUDA_SUCCESS);
	ASSERT_OK(kvd_seq_block(s, 0, 6, &p));
	ASSERT_EQ(cu->cuMemcpyHtoD((CUdeviceptr)(uintptr_t)p, &one, 1), CUDA_SUCCESS);
	ASSERT_OK(kvd_seq_digest(s, &after, NULL));
	ASSERT_NE(before, after);
	ASSERT_EQ(cu->cuDevicePrimaryCtxRelease(1), CUDA_SUCCESS);
	ASSERT_OK(kvd_seq_release(s));
	c = kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Connects tenant t to f's daemon with the given flags and device (KVD_CONNECT_DEVICE):
 * returns 0 and the connection's ordinal in *ordinal, or the connect's error. */
static int connect_as(struct fixture *f, const char *t, uint32_t flags, uint32_t device,
                      int32_t *ordinal) {
	kvd_connect_params p = { .size = sizeof(p), .socket_path = f->socket, .tenant = t,
		                 .flags = flags, .device = device };
	kvd_client *c = NULL;
	int r;

	r = kvd_client_connect_params(&p, &c);
	if (r < 0)
		return r;
	*ordinal = -1;
	ASSERT_EQ(kvd_client_memory(c, ordinal), KVD_MEMORY_CUDA);
	kvd_client_unref(c);
	return 0;
}

/*
 * A tenant's chunks are on its own GPU or it is refused (-EXDEV), never on another that its
 * kernels would fault on: with two GPUs pooled, one that names none (no current context) is
 * refused and KVD_CONNECT_DEVICE names one; with one GPU pooled, a tenant on the other is
 * refused, one without a context gets the pooled GPU, and a GPU this process does not have
 * is -ENODEV.
 */
TEST(tenant_gets_its_own_gpu) {
	static const char *const two[] = { "--backend=cuda", "--pool-size=8MiB", NULL };
	static const char *const first[] = { "--backend=cuda", "--devices=0", "--pool-size=8MiB", NULL };
	const struct cuda_dl *cu;
	int32_t ordinal = -1;
	struct fixture f;
	CUcontext ctx;

	ASSERT_OK(cuda_dl_load(&cu, NULL));
	start(&f, "2", two);
	ASSERT_EQ(connect_as(&f, "a", 0, 0, &ordinal), -EXDEV);
	ASSERT_TRUE(fixture_wait_log(&f, "tenant a refused: this daemon pools 2 GPUs "
	                                 "(GPU-6b76642d-6661-6b65-2d63-7564612d30fa, "
	                                 "GPU-6b76642d-6661-6b65-2d63-7564612d31fa)", 1));
	ASSERT_OK(connect_as(&f, "a", KVD_CONNECT_DEVICE, 1, &ordinal));
	ASSERT_EQ(ordinal, 1);
	ASSERT_OK(connect_as(&f, "a", KVD_CONNECT_DEVICE, 0, &ordinal));
	ASSERT_EQ(ordinal, 0);
	ASSERT_EQ(fixture_stop(&f), 0);

	start(&f, "2", first);
	ASSERT_OK(connect_as(&f, "b", 0, 0, &ordinal));
	ASSERT_EQ(ordinal, 0);
	ASSERT_EQ(connect_as(&f, "b", KVD_CONNECT_DEVICE, 1, &ordinal), -EXDEV);
	ASSERT_TRUE(fixture_wait_log(&f, "tenant b refused: GPU GPU-6b76642d-6661-6b65-2d63-"
	                                 "7564612d31fa is not pooled by this daemon (it pools "
	                                 "GPU-6b76642d-6661-6b65-2d63-7564612d30fa)", 1));
	/* The engine's current context says the same. */
	ASSERT_EQ(cu->cuDevicePrimaryCtxRetain(&ctx, 1), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuCtxSetCurrent(ctx), CUDA_SUCCESS);
	ASSERT_EQ(connect_as(&f, "b", 0, 0, &ordinal), -EXDEV);
	ASSERT_EQ(cu->cuCtxSetCurrent(NULL), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuDevicePrimaryCtxRelease(1), CUDA_SUCCESS);
	ASSERT_EQ(connect_as(&f, "b", KVD_CONNECT_DEVICE, 7, &ordinal), -ENODEV);
	/* Administrative connections get no chunks: no GPU to name. */
	ASSERT_EQ(fixture_status(&f, NULL, "pool_bytes"), 8 * MiB);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * --devices numbers GPUs in PCI bus order, not the driver's (fastest first on a GPU; here
 * the fake puts CUDA's device 0 on bus 0x41, after device 1 on bus 0x01), and takes UUIDs;
 * a client's ordinal is its own process's, the driver's.
 */
TEST(devices_by_bus_and_uuid) {
	static const char *const by_number[] = { "--backend=cuda", "--devices=0", "--pool-size=8MiB", NULL };
	static const char *const by_uuid[] = { "--backend=cuda", "--pool-size=8MiB",
		"--devices=gpu-6b76642d66616b652d637564612d30FA", NULL };
	int32_t ordinal = -1;
	struct fixture f;
	char out[4096];

	setenv("KVD_FAKE_CUDA_PCI_BUS", "41,1", 1);
	start(&f, "2", by_number);
	ASSERT_TRUE(fixture_wait_log(&f, "backend cuda: cuda on 1 GPU: GPU 0 (kvd fake CUDA device 1, ", 1));
	ASSERT_TRUE(fixture_wait_log(&f, "GPU-6b76642d-6661-6b65-2d63-7564612d31fa at 0000:01:00.0)", 1));
	ASSERT_OK(connect_as(&f, "a", KVD_CONNECT_DEVICE, 1, &ordinal));
	ASSERT_EQ(ordinal, 1);
	ASSERT_EQ(fixture_stop(&f), 0);

	start(&f, "2", by_uuid);
	ASSERT_TRUE(fixture_wait_log(&f, "backend cuda: cuda on 1 GPU: GPU 1 (kvd fake CUDA device 0, ", 1));
	ASSERT_TRUE(fixture_wait_log(&f, "at 0000:41:00.0)", 1));
	ASSERT_OK(connect_as(&f, "a", KVD_CONNECT_DEVICE, 0, &ordinal));
	ASSERT_EQ(ordinal, 0);
	ASSERT_EQ(fixture_stop(&f), 0);
	unsetenv("KVD_FAKE_CUDA_PCI_BUS");

	/* A UUID no GPU has: skipped, and with none left, no start. */
	ASSERT_EQ(fixture_run_daemon("--backend cuda --config /dev/null --socket /nonexistent/kvd.sock "
	                             "--devices GPU-00000000-0000-0000-0000-000000000000",
	                             out, sizeof(out)), 1);
	if (!strstr(out, "device GPU-00000000-0000-0000-0000-000000000000: no such device here"))
		test_fail(__FILE__, __LINE__, "no clear refusal: %s", out);
	/* Neither a number nor a UUID: a usage error. */
	ASSERT_EQ(fixture_run_daemon("--backend cuda --config /dev/null --socket /nonexistent/kvd.sock "
	                             "--devices GPU-12", out, sizeof(out)), 2);
	if (!strstr(out, "a number (0 to 255, in PCI bus order) or a UUID"))
		test_fail(__FILE__, __LINE__, "no clear refusal: %s", out);
}

/*
 * Status lists the pooled GPUs (kvdctl status prints them), each with whether its chunks are
 * GPUDirect RDMA capable: they are made so where the device supports RDMA on VMM memory,
 * and not where it does not (the fake then refuses the flag, so a daemon that set it
 * anyway could not make a chunk).
 */
TEST(status_lists_gpus_and_rdma) {
	static const char *const args[] = { "--backend=cuda", "--pool-size=8MiB", NULL };
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	char text[1024];
	struct fixture f;
	kvd_seq *s;
	int model;

	start(&f, "2", args);
	ASSERT_STREQ(fixture_status_str(&f, NULL, "devices", text, sizeof(text)),
	             "GPU 0 GPU-6b76642d-6661-6b65-2d63-7564612d30fa 0000:01:00.0 "
	             "name=kvd_fake_CUDA_device_0 memory_mib=1024 rdma=yes persistence=on ipc_events=yes "
	             "failed=no\n"
	             "GPU 1 GPU-6b76642d-6661-6b65-2d63-7564612d31fa 0000:02:00.0 "
	             "name=kvd_fake_CUDA_device_1 memory_mib=1024 rdma=yes persistence=on ipc_events=yes "
	             "failed=no");
	ASSERT_EQ(fixture_stop(&f), 0);

	setenv("KVD_FAKE_CUDA_RDMA", "0", 1);
	start(&f, "1", args);
	unsetenv("KVD_FAKE_CUDA_RDMA");
	ASSERT_TRUE(strstr(fixture_status_str(&f, NULL, "devices", text, sizeof(text)), " rdma=no"));
	c = fixture_connect(&f, "a");
	model = kvd_model_register(c, &spec);
	ASSERT_GT(model, 0);
	ASSERT_OK(kvd_seq_open(c, model, 100, &s));
	ASSERT_OK(kvd_seq_grow(s, 100));
	ASSERT_OK(kvd_seq_release(s));
	c = kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Writes one byte through the driver in device's primary context at block 0 of table 0 of
 * s, and returns whether the daemon's digest of s changed. */
static bool daemon_sees_write(const struct cuda_dl *cu, kvd_seq *s, int device) {
	uint64_t before = 0, after = 0;
	const uint8_t one = 1;
	CUcontext ctx;
	void *p;

	ASSERT_OK(kvd_seq_digest(s, &before, NULL));
	ASSERT_EQ(cu->cuDevicePrimaryCtxRetain(&ctx, device), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuCtxPushCurrent(ctx), CUDA_SUCCESS);
	ASSERT_OK(kvd_seq_block(s, 0, 0, &p));
	ASSERT_EQ(cu->cuMemcpyHtoD((CUdeviceptr)(uintptr_t)p, &one, 1), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuCtxPopCurrent(NULL), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuDevicePrimaryCtxRelease(device), CUDA_SUCCESS);
	ASSERT_OK(kvd_seq_digest(s, &after, NULL));
	return before != after;
}

/*
 * Both devices pooled (--devices all), pool-size on each: a client whose thread has device
 * 1's context current at connect gets device 1's chunks (ids from the second half), one
 * with device 0's the first device's; both share their memory with the daemon, and a
 * device's chunks come back to that device's free list only.
 */
TEST(every_device_pooled) {
	/* A budget above pool-size: the pool is pool-size on each GPU. */
	static const char *const args[] = { "--backend=cuda", "--chunk-size=4MiB", "--pool-size=32MiB",
		                            "--budget=48MiB", NULL };
	_cleanup_(kvd_client_unrefp) kvd_client *a = NULL, *b = NULL;
	uint32_t ids[16], n = 0;
	const struct cuda_dl *cu;
	int32_t ordinal = -1;
	struct fixture f;
	kvd_seq *sa, *sb;
	CUcontext ctx;
	int ma, mb;

	ASSERT_OK(cuda_dl_load(&cu, NULL));
	start(&f, "2", args);
	ASSERT_TRUE(fixture_wait_log(&f, "backend cuda: cuda on 2 GPUs: GPU 0 (kvd fake CUDA device 0", 1));
	ASSERT_EQ(fixture_status(&f, NULL, "pool_bytes"), 64 * MiB);
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 48 * MiB);

	/* Each engine with its GPU's context current, as engines connect. */
	ASSERT_EQ(cu->cuDevicePrimaryCtxRetain(&ctx, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuCtxSetCurrent(ctx), CUDA_SUCCESS);
	a = fixture_connect(&f, "a");
	ASSERT_EQ(cu->cuDevicePrimaryCtxRelease(0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuDevicePrimaryCtxRetain(&ctx, 1), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuCtxSetCurrent(ctx), CUDA_SUCCESS);
	b = fixture_connect(&f, "b");
	ASSERT_EQ(cu->cuCtxSetCurrent(NULL), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuDevicePrimaryCtxRelease(1), CUDA_SUCCESS);
	ASSERT_TRUE(fixture_wait_log(&f, "tenant b, GPU 1", 1));
	ASSERT_EQ(kvd_client_memory(a, &ordinal), KVD_MEMORY_CUDA);
	ASSERT_EQ(ordinal, 0);
	ASSERT_EQ(kvd_client_memory(b, &ordinal), KVD_MEMORY_CUDA);
	ASSERT_EQ(ordinal, 1);

	ma = kvd_model_register(a, &spec);
	mb = kvd_model_register(b, &spec);
	ASSERT_GT(ma, 0);
	ASSERT_GT(mb, 0);
	ASSERT_OK(kvd_seq_open(a, ma, 200, &sa));
	ASSERT_OK(kvd_seq_open(b, mb, 200, &sb));
	ASSERT_OK(kvd_seq_grow(sa, 200));
	ASSERT_OK(kvd_seq_grow(sb, 200));
	/* 8 chunks of 4 MiB on each device: ids 0-7 on GPU 0, 8-15 on GPU 1. */
	ASSERT_OK(kvd_client_mapped_chunks(a, ids, 16, &n));
	ASSERT_GT(n, 0u);
	for (uint32_t i = 0; i < n; i++)
		ASSERT_TRUE(ids[i] < 8);
	ASSERT_OK(kvd_client_mapped_chunks(b, ids, 16, &n));
	ASSERT_GT(n, 0u);
	for (uint32_t i = 0; i < n; i++)
		ASSERT_TRUE(ids[i] >= 8 && ids[i] < 16);
	ASSERT_TRUE(daemon_sees_write(cu, sa, 0));
	ASSERT_TRUE(daemon_sees_write(cu, sb, 1));

	/* Released and scrubbed, b's chunks serve b again, on GPU 1. */
	ASSERT_OK(kvd_seq_release(sb));
	ASSERT_TRUE(fixture_wait_status(&f, "b", "used_bytes", 0));
	ASSERT_OK(kvd_seq_open(b, mb, 200, &sb));
	ASSERT_OK(kvd_seq_grow(sb, 200));
	ASSERT_OK(kvd_client_mapped_chunks(b, ids, 16, &n));
	for (uint32_t i = 0; i < n; i++)
		ASSERT_TRUE(ids[i] >= 8 && ids[i] < 16);
	ASSERT_OK(kvd_seq_release(sa));
	ASSERT_OK(kvd_seq_release(sb));
	a = kvd_client_unref(a);
	b = kvd_client_unref(b);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Connects as tenant on device (its primary context current while connecting). */
static kvd_client *connect_on(const struct cuda_dl *cu, struct fixture *f, const char *tenant,
                              int device) {
	kvd_client *c;
	CUcontext ctx;

	ASSERT_EQ(cu->cuDevicePrimaryCtxRetain(&ctx, device), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuCtxSetCurrent(ctx), CUDA_SUCCESS);
	c = fixture_connect(f, tenant);
	ASSERT_EQ(cu->cuCtxSetCurrent(NULL), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuDevicePrimaryCtxRelease(device), CUDA_SUCCESS);
	return c;
}

/* Two tenants of a daemon with two GPUs: a on GPU 0, b on GPU 1, each with a sequence of
 * an evictable model (16-token blocks of 8 KiB over 2 layers: 4096 tokens a 4 MiB chunk). */
struct two_gpus {
	struct fixture f;
	kvd_client *a, *b;
	kvd_seq *sa, *sb;
};

static void two_gpus_start(struct two_gpus *t, const char *const *args) {
	static const kvd_eviction_spec ev = { .unit = KVD_UNIT_LAYER_TOKEN, .window = 8, .sinks = 4 };
	const struct cuda_dl *cu;
	int ma, mb;

	ASSERT_OK(cuda_dl_load(&cu, NULL));
	start(&t->f, "2", args);
	t->a = connect_on(cu, &t->f, "a", 0);
	t->b = connect_on(cu, &t->f, "b", 1);
	ma = kvd_model_register_evictable(t->a, &spec, &ev);
	mb = kvd_model_register_evictable(t->b, &spec, &ev);
	ASSERT_GT(ma, 0);
	ASSERT_GT(mb, 0);
	ASSERT_OK(kvd_seq_open(t->a, ma, 1 << 16, &t->sa));
	ASSERT_OK(kvd_seq_open(t->b, mb, 1 << 16, &t->sb));
}

static void two_gpus_stop(struct two_gpus *t) {
	ASSERT_OK(kvd_seq_release(t->sa));
	ASSERT_OK(kvd_seq_release(t->sb));
	t->a = kvd_client_unref(t->a);
	t->b = kvd_client_unref(t->b);
	ASSERT_EQ(fixture_stop(&t->f), 0);
}

/* Grows s by n tokens and pins and unpins it, as an engine's step that writes them (this
 * process cannot touch device memory: strict mode). */
static void step(kvd_seq *s, uint32_t n) {
	ASSERT_OK(kvd_seq_grow(s, n));
	ASSERT_OK(kvd_seq_pin(s));
	ASSERT_OK(kvd_seq_unpin(s));
}

/*
 * A sticky error (a kernel's illegal address, here the fake's on the first 2D copy, which a
 * round's read of GPU 0's K/V makes) loses the daemon's context there: said once, with the
 * driver's error, in the log, status (devices, a standing warning); later rounds leave GPU
 * 0's sequences alone instead of failing again; GPU 1 goes on evicting.
 */
TEST(sticky_error_loses_one_gpu) {
	static const char *const args[] = { "--backend=cuda", "--chunk-size=4MiB", "--pool-size=16MiB",
		                            "--high-watermark=100", NULL };
	_cleanup_(kvd_client_unrefp) kvd_client *admin = NULL;
	uint64_t freed = 0;
	unsigned failed;
	struct two_gpus t;
	char text[2048];

	setenv("KVD_FAKE_CUDA_STICKY_ON", "cuMemcpy2D", 1);
	two_gpus_start(&t, args);
	unsetenv("KVD_FAKE_CUDA_STICKY_ON");
	step(t.sa, 2048);
	step(t.sb, 2048);
	admin = fixture_connect(&t.f, NULL);
	(void)kvd_evict(admin, "a", 1 << 20, &freed);
	ASSERT_TRUE(fixture_wait_log(&t.f, "GPU 0: cuMemcpy2D failed with CUDA_ERROR_ILLEGAL_ADDRESS, "
	                                   "an error that loses the daemon's context there", 1));
	ASSERT_TRUE(strstr(fixture_status_str(&t.f, NULL, "devices", text, sizeof(text)),
	                   "ipc_events=yes failed=CUDA_ERROR_ILLEGAL_ADDRESS\nGPU 1 "));
	ASSERT_TRUE(strstr(text, "failed=no"));
	ASSERT_TRUE(strstr(fixture_status_str(&t.f, NULL, "warnings", text, sizeof(text)),
	                   "GPU 0: the daemon's context there was lost to a sticky error "
	                   "(CUDA_ERROR_ILLEGAL_ADDRESS)"));
	/* No round fails on it again: its sequences are left alone. */
	failed = fixture_log_count(&t.f, " failed: ");
	ASSERT_OK(kvd_evict(admin, "a", 1 << 20, &freed));
	ASSERT_EQ(freed, 0u);
	ASSERT_OK(kvd_evict(admin, NULL, 1 << 20, &freed));
	ASSERT_EQ(fixture_log_count(&t.f, " failed: "), failed);
	/* GPU 1 goes on: its tenant's tokens are evicted, its sequence still grows. */
	ASSERT_GT(fixture_status(&t.f, "b", "evicted_tokens"), 0u);
	step(t.sb, 64);
	ASSERT_EQ(fixture_log_count(&t.f, "an error that loses the daemon's context"), 1);
	admin = kvd_client_unref(admin);
	two_gpus_stop(&t);
}

/*
 * A GPU whose pool is full while the node budget is not: a grow there waits, and the round
 * it starts takes tokens from that GPU's sequences only (evicting on the other would free
 * nothing the grow can use), then the grow goes through. Tenant b's sequence on GPU 1,
 * just as evictable and older (recency ranks both: no windows), keeps every token.
 */
TEST(full_device_gets_its_own_round) {
	/* No watermark rounds: the grow's own round is the one under test. */
	static const char *const args[] = { "--backend=cuda", "--chunk-size=4MiB", "--pool-size=16MiB",
		                            "--grant-wait=5000", "--high-watermark=100", NULL };
	struct two_gpus t;

	two_gpus_start(&t, args);
	for (int i = 0; i < 3; i++)
		ASSERT_OK(kvd_seq_grow(t.sb, 2048));
	for (int i = 0; i < 8; i++)
		ASSERT_OK(kvd_seq_grow(t.sa, 2048));
	/* Written, as an engine does it: a round takes no slot grown since the last unpin. */
	ASSERT_OK(kvd_seq_pin(t.sa));
	ASSERT_OK(kvd_seq_unpin(t.sa));
	ASSERT_EQ(fixture_status(&t.f, "a", "used_bytes"), 16 * MiB);
	ASSERT_EQ(fixture_status(&t.f, NULL, "rounds_total"), 0u);
	/* GPU 0 is full; the budget (32 MiB, 24 in use) has room: the grow waits for a round
	 * on GPU 0. */
	ASSERT_OK(kvd_seq_grow(t.sa, 2048));
	ASSERT_GT(fixture_status(&t.f, NULL, "rounds_total"), 0u);
	ASSERT_GT(fixture_status(&t.f, "a", "evicted_tokens"), 0u);
	ASSERT_EQ(fixture_status(&t.f, "b", "evicted_tokens"), 0u);
	ASSERT_EQ(kvd_seq_tokens(t.sb, 0, 0), 3 * 2048);
	ASSERT_TRUE(kvd_seq_tokens(t.sa, 0, 0) < 9 * 2048);
	two_gpus_stop(&t);
}

/*
 * The watermarks hold for each GPU's pool too: a GPU used past the high watermark while the
 * node is not gets a round of its own, down to the low watermark, from its sequences only.
 */
TEST(device_watermark_round) {
	static const char *const args[] = { "--backend=cuda", "--chunk-size=4MiB", "--pool-size=32MiB",
		                            "--high-watermark=50", "--low-watermark=25", NULL };
	struct two_gpus t;

	two_gpus_start(&t, args);
	/* b: one chunk of GPU 1 (older tokens); a: six of GPU 0 at most, 75% of its pool. The
	 * node holds 28 of 64 MiB at most, below its own high watermark (50%). */
	ASSERT_OK(kvd_seq_grow(t.sb, 2048));
	/* Each step written pinned, as an engine does (rounds take only written slots). */
	for (int i = 0; i < 12; i++) {
		ASSERT_OK(kvd_seq_grow(t.sa, 2048));
		ASSERT_OK(kvd_seq_pin(t.sa));
		ASSERT_OK(kvd_seq_unpin(t.sa));
	}
	/* Chunks a round empties come back once a unmaps them (its events). */
	for (int i = 0; i < 500 && fixture_status(&t.f, "a", "used_bytes") > 16 * MiB; i++) {
		kvd_event event;

		while (kvd_client_next_event(t.a, &event) > 0)
			;
		usleep(10000);
	}
	ASSERT_TRUE(fixture_status(&t.f, "a", "used_bytes") <= 16 * MiB);
	ASSERT_GT(fixture_status(&t.f, NULL, "rounds_total"), 0u);
	ASSERT_EQ(fixture_status(&t.f, "b", "evicted_tokens"), 0u);
	ASSERT_EQ(kvd_seq_tokens(t.sb, 0, 0), 2048);
	two_gpus_stop(&t);
}

/*
 * kvd_seq_unpin_after: the engine's interprocess event is registered once, carried by the
 * unpin (on the ring and on the socket), and waited for by the daemon before it next reads
 * the K/V (here a digest); events without CU_EVENT_INTERPROCESS are refused, and a
 * connection has 16 at most. On a host pool the event is ignored.
 */
TEST(unpin_after_an_engine_event) {
	static const char *const args[] = { "--backend=cuda", "--pool-size=16MiB", NULL };
	static const char *const host[] = { "--backend=host", "--pool-size=16MiB", NULL };
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	const struct cuda_dl *cu;
	CUevent ev[CLIENT_EVENTS + 1], plain;
	uint64_t digest = 0;
	struct fixture f;
	CUcontext ctx;
	CUstream st;
	kvd_seq *s;
	int model;

	ASSERT_OK(cuda_dl_load(&cu, NULL));
	start(&f, "1", args);
	c = connect_on(cu, &f, "a", 0);
	model = kvd_model_register(c, &spec);
	ASSERT_GT(model, 0);
	ASSERT_OK(kvd_seq_open(c, model, 64, &s));
	ASSERT_OK(kvd_seq_grow(s, 64));
	ASSERT_EQ(cu->cuDevicePrimaryCtxRetain(&ctx, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuCtxSetCurrent(ctx), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuStreamCreate(&st, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
	for (uint32_t i = 0; i <= CLIENT_EVENTS; i++)
		ASSERT_EQ(cu->cuEventCreate(&ev[i], CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING),
		          CUDA_SUCCESS);
	ASSERT_EQ(cu->cuEventCreate(&plain, CU_EVENT_DISABLE_TIMING), CUDA_SUCCESS);

	/* On the ring, then on the socket: the daemon waits at its next read, once. */
	for (int ring = 1; ring >= 0; ring--) {
		uint64_t waits = fixture_status(&f, NULL, "engine_events_done");

		ASSERT_OK(kvd_client_set_ring(c, ring));
		ASSERT_OK(kvd_seq_pin(s));
		ASSERT_EQ(cu->cuEventRecord(ev[0], st), CUDA_SUCCESS);
		ASSERT_OK(kvd_seq_unpin_after(s, ev[0]));
		ASSERT_EQ(fixture_status(&f, NULL, "engine_events_done"), waits);
		ASSERT_OK(kvd_seq_digest(s, &digest, NULL));
		ASSERT_EQ(fixture_status(&f, NULL, "engine_events_done"), waits + 1);
		ASSERT_OK(kvd_seq_digest(s, &digest, NULL));
		ASSERT_EQ(fixture_status(&f, NULL, "engine_events_done"), waits + 1);
	}
	/* Not interprocess: libkvd waits for it itself, unpins and says so (1). */
	ASSERT_OK(kvd_seq_pin(s));
	ASSERT_EQ(kvd_seq_unpin_after(s, plain), 1);
	ASSERT_ERRNO(kvd_seq_unpin(s), -EINVAL); /* unpinned: nothing left to unpin */
	/* 16 events a connection (ev[0] is one); the 17th is waited for in libkvd. */
	for (uint32_t i = 1; i < CLIENT_EVENTS; i++) {
		ASSERT_OK(kvd_seq_pin(s));
		ASSERT_OK(kvd_seq_unpin_after(s, ev[i]));
	}
	ASSERT_OK(kvd_seq_pin(s));
	ASSERT_EQ(kvd_seq_unpin_after(s, ev[CLIENT_EVENTS]), 1);
	/* A registered one again: its id, by its IPC handle. */
	ASSERT_OK(kvd_seq_pin(s));
	ASSERT_OK(kvd_seq_unpin_after(s, ev[3]));
	/* A new event, where the allocator may well put it at a destroyed one's address, is
	 * another event: the 17th, waited for here, never taken for the old one's id. */
	ASSERT_EQ(cu->cuEventDestroy(ev[3]), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuEventCreate(&ev[3], CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING),
	          CUDA_SUCCESS);
	ASSERT_OK(kvd_seq_pin(s));
	ASSERT_EQ(kvd_seq_unpin_after(s, ev[3]), 1);
	ASSERT_OK(kvd_seq_pin(s));
	ASSERT_OK(kvd_seq_unpin_after(s, NULL));
	ASSERT_OK(kvd_seq_pin(s));
	ASSERT_OK(kvd_seq_unpin(s));
	ASSERT_OK(kvd_seq_release(s));
	c = kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);

	/* Host memory: nothing to order, the event is not even looked at. */
	start(&f, "1", host);
	c = fixture_connect(&f, "a");
	model = kvd_model_register(c, &spec);
	ASSERT_OK(kvd_seq_open(c, model, 64, &s));
	ASSERT_OK(kvd_seq_grow(s, 64));
	ASSERT_OK(kvd_seq_pin(s));
	ASSERT_OK(kvd_seq_unpin_after(s, plain));
	ASSERT_OK(kvd_seq_release(s));
	c = kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
	for (uint32_t i = 0; i <= CLIENT_EVENTS; i++)
		ASSERT_EQ(cu->cuEventDestroy(ev[i]), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuEventDestroy(plain), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuStreamDestroy(st), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuCtxSetCurrent(NULL), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuDevicePrimaryCtxRelease(0), CUDA_SUCCESS);
}

/* An engine, with an interprocess event on its stream, and a sequence of 64 tokens. */
struct engine {
	kvd_client *c;
	kvd_seq *s;
	CUcontext ctx;
	CUstream st;
	CUevent ev[2];
};

static void engine_start(const struct cuda_dl *cu, struct fixture *f, struct engine *e) {
	int model;

	e->c = connect_on(cu, f, "a", 0);
	model = kvd_model_register(e->c, &spec);
	ASSERT_GT(model, 0);
	ASSERT_OK(kvd_seq_open(e->c, model, 64, &e->s));
	ASSERT_OK(kvd_seq_grow(e->s, 64));
	ASSERT_EQ(cu->cuDevicePrimaryCtxRetain(&e->ctx, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuCtxSetCurrent(e->ctx), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuStreamCreate(&e->st, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
	for (unsigned i = 0; i < ELEMENTSOF(e->ev); i++)
		ASSERT_EQ(cu->cuEventCreate(&e->ev[i], CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING),
		          CUDA_SUCCESS);
}

static void engine_stop(const struct cuda_dl *cu, struct engine *e) {
	ASSERT_OK(kvd_seq_release(e->s));
	e->c = kvd_client_unref(e->c);
	for (unsigned i = 0; i < ELEMENTSOF(e->ev); i++)
		ASSERT_EQ(cu->cuEventDestroy(e->ev[i]), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuStreamDestroy(e->st), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuCtxSetCurrent(NULL), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuDevicePrimaryCtxRelease(0), CUDA_SUCCESS);
}

/*
 * While the engine's event is not done (the fake's opened event says CUDA_ERROR_NOT_READY
 * to its first queries, KVD_FAKE_CUDA_IPC_EVENT_PENDING), the daemon leaves the sequence's
 * K/V alone: a digest answers -EAGAIN, without blocking, until it is done; then one wait
 * is counted.
 */
TEST(engine_event_not_done_yet) {
	static const char *const args[] = { "--backend=cuda", "--pool-size=16MiB", NULL };
	const struct cuda_dl *cu;
	struct fixture f;
	struct engine e;
	uint64_t digest = 0, waits;
	unsigned again = 0;
	int r;

	ASSERT_OK(cuda_dl_load(&cu, NULL));
	setenv("KVD_FAKE_CUDA_IPC_EVENT_PENDING", "20", 1);
	start(&f, "1", args);
	unsetenv("KVD_FAKE_CUDA_IPC_EVENT_PENDING");
	engine_start(cu, &f, &e);
	waits = fixture_status(&f, NULL, "engine_events_done");
	ASSERT_OK(kvd_seq_pin(e.s));
	ASSERT_EQ(cu->cuEventRecord(e.ev[0], e.st), CUDA_SUCCESS);
	ASSERT_OK(kvd_seq_unpin_after(e.s, e.ev[0]));
	while ((r = kvd_seq_digest(e.s, &digest, NULL)) == -EAGAIN && again < 10000) {
		again++;
		usleep(1000);
	}
	ASSERT_OK(r);
	ASSERT_GT(again, 0u);
	ASSERT_EQ(fixture_status(&f, NULL, "engine_events_done"), waits + 1);
	engine_stop(cu, &e);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * A GPU without interprocess events (KVD_FAKE_CUDA_IPC_EVENTS=0 for the daemon): status says
 * so, the daemon refuses the event, and libkvd waits for it itself (1), then for the
 * connection's next events too.
 */
TEST(gpu_without_ipc_events) {
	static const char *const args[] = { "--backend=cuda", "--pool-size=16MiB", NULL };
	const struct cuda_dl *cu;
	char text[1024];
	struct fixture f;
	struct engine e;

	ASSERT_OK(cuda_dl_load(&cu, NULL));
	setenv("KVD_FAKE_CUDA_IPC_EVENTS", "0", 1);
	start(&f, "1", args);
	unsetenv("KVD_FAKE_CUDA_IPC_EVENTS");
	ASSERT_TRUE(strstr(fixture_status_str(&f, NULL, "devices", text, sizeof(text)), " ipc_events=no"));
	engine_start(cu, &f, &e);
	for (unsigned i = 0; i < ELEMENTSOF(e.ev); i++) {
		ASSERT_OK(kvd_seq_pin(e.s));
		ASSERT_EQ(cu->cuEventRecord(e.ev[i], e.st), CUDA_SUCCESS);
		ASSERT_EQ(kvd_seq_unpin_after(e.s, e.ev[i]), 1);
	}
	engine_stop(cu, &e);
	ASSERT_EQ(fixture_stop(&f), 0);
}
