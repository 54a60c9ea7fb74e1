/* SPDX-License-Identifier: MIT */
/*
 * Choosing the backend, under the fake CUDA driver of tests/fake-cuda (suite fake-gpu;
 * meson runs it with LD_LIBRARY_PATH there): --backend auto picks cuda when a GPU is usable
 * and says so, falls back to host when the driver has no device, --backend cuda refuses to
 * start without one, and a client imports chunks from a daemon that pooled another device
 * than the first, with chunks whose size is not a power of two.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/macro.h"
#include "cuda-dl.h"
#include "fixture.h"
#include "test.h"

#define MiB (UINT64_C(1) << 20)

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
	ASSERT_TRUE(fixture_wait_log(&f, "backend auto: cuda on GPU 0 (kvd fake CUDA device 0, 1024 of 1024 MiB free", 1));
	/* 10% of the fake's 1 GiB, in whole 4 MiB chunks. */
	ASSERT_TRUE(fixture_wait_log(&f, "pool-percent 10: a pool of 100 MiB", 1));
	c = fixture_connect(&f, "a");
	ASSERT_EQ(kvd_client_memory(c, &ordinal), KVD_MEMORY_CUDA);
	ASSERT_EQ(ordinal, 0);
	c = kvd_client_unref(c);
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
	ASSERT_TRUE(fixture_wait_log(&f, "backend cuda: cuda on GPU 1 (kvd fake CUDA device 1", 1));
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
