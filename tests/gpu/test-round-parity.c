/* SPDX-License-Identifier: MIT */
/*
 * A round keeps the same tokens whatever reads the K/V: the host backend (the CPU reads the
 * pool), the cuda backend scoring on the CPU with the K/V copied there (backend.h
 * read_rows), and the cuda backend scoring on the GPU (round-gpu.h: K/V gathered on the
 * device, queries and Gram matrices uploaded, scores copied back). Suite fake-gpu: the
 * cuda runs use the fake driver, the GPU scoring the CPU stand-ins of the kernels
 * (kvd-hostkernels), which compute what the CPU path computes, bit for bit; so any
 * difference in the kept positions is a gather, upload or layout mistake of the path.
 *
 * Per policy (restkv and laprox score on the GPU; kvd and h2o on the CPU everywhere), one
 * tenant fills a sequence with the fixture's pattern, publishes a window of fixed queries
 * per layer and gives the daemon a W_o per layer; one round on that tenant evicts half.
 *
 * On a real GPU (tools/gpu-check: KVD_DAEMON_PLAIN and KVD_DAEMON_GPU both kvd, the CPU run
 * forced with KVD_TEST_ROUND_CPU), the kernels agree with the CPU within a tolerance, not
 * bit for bit, and a token near a tie may go either way: KVD_ROUND_PARITY_TOLERANCE is the
 * fraction of each (policy, layer, head)'s kept positions that may differ (default 0).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "fixture.h"
#include "gpu-test.h"
#include "test.h"

#define TOKENS 512u
#define WINDOW 8u
#define LAYERS 2u
#define KV_HEADS 2u
#define Q_HEADS 4u
#define HEAD_DIM 64u

static const char *const policies[] = { "kvd", "restkv", "laprox", "h2o" };
#define N_POLICIES ELEMENTSOF(policies)

static const kvd_model_spec spec = {
	.name = "parity",
	.layers = LAYERS,
	.q_heads = Q_HEADS,
	.kv_heads = KV_HEADS,
	.head_dim = HEAD_DIM,
	.dtype = KVD_DTYPE_F16,
	.block_tokens = 16,
	.layout = KVD_LAYOUT_PER_LAYER,
};

/* Its daemons load the driver (the fake one in CI): without one, nothing to compare. */
int test_setup(void) {
	const struct cuda_dl *cu;
	const char *why = NULL;

	if (cuda_dl_load(&cu, &why) < 0) {
		printf("no usable GPU: %s\n", why);
		return EXIT_TEST_SKIP;
	}
	gpu_test_ran_on(cu, why);
	return 0;
}

/* What one run kept: positions per (policy, layer, kv head). */
struct kept {
	uint32_t n[N_POLICIES][LAYERS][KV_HEADS];
	uint32_t pos[N_POLICIES][LAYERS][KV_HEADS][TOKENS];
};

/* Small finite f16 numbers from a fixed sequence: the same in every run. */
static uint16_t f16_at(uint64_t i) {
	static const uint16_t v[] = { 0x3800, 0xb800, 0x3c00, 0x0000, 0x3400, 0xb400, 0x2c00, 0xbc00 };

	return v[(i * 2654435761u >> 7) % ELEMENTSOF(v)];
}

/* One tenant's sequence: filled, windows published, one round, what is left. */
static void run_policy(struct fixture *f, kvd_client *admin, uint32_t pi, struct kept *out) {
	static const kvd_eviction_spec ev = { .unit = KVD_UNIT_LAYER_TOKEN, .window = WINDOW, .sinks = 4 };
	static uint16_t wo[Q_HEADS * HEAD_DIM * Q_HEADS * HEAD_DIM];
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	char tenant[32];
	uint64_t freed = 0;
	kvd_seq *s;
	int model;

	snprintf(tenant, sizeof(tenant), "p-%s", policies[pi]);
	c = fixture_connect(f, tenant);
	model = kvd_model_register_evictable(c, &spec, &ev);
	ASSERT_GT(model, 0);
	for (uint32_t l = 0; l < LAYERS; l++) {
		for (size_t j = 0; j < ELEMENTSOF(wo); j++)
			wo[j] = f16_at(j + 7919u * l) & 0xbfff; /* |x| < 1/16 ... 1: small */
		ASSERT_OK(kvd_model_output_proj(c, model, l, KVD_DTYPE_F16, Q_HEADS * HEAD_DIM, wo));
	}
	ASSERT_OK(kvd_seq_open(c, model, TOKENS, &s));
	ASSERT_OK(kvd_seq_grow(s, TOKENS));
	ASSERT_OK(kvd_seq_pin(s));
	fill_seq(s, 3 + pi);
	for (uint32_t l = 0; l < LAYERS; l++) {
		uint16_t *q;

		ASSERT_OK(kvd_seq_observation(s, l, (void **)&q));
		for (uint32_t j = 0; j < Q_HEADS * WINDOW * HEAD_DIM; j++)
			q[j] = f16_at(j + 104729u * l + 17u * pi);
		ASSERT_OK(kvd_seq_observe(s, l));
	}
	ASSERT_OK(kvd_seq_unpin(s));

	/* Half of the tenant's K/V: 512 tokens x 2 layers x 512 bytes. */
	ASSERT_OK(kvd_evict(admin, tenant, TOKENS * LAYERS * 512u / 2, &freed));
	ASSERT_OK(kvd_seq_pin(s));
	for (uint32_t l = 0; l < LAYERS; l++)
		for (uint32_t h = 0; h < KV_HEADS; h++) {
			int64_t n = kvd_seq_tokens(s, l, h);

			ASSERT_TRUE(n > 0 && n < (int64_t)TOKENS);
			out->n[pi][l][h] = (uint32_t)n;
			for (uint32_t j = 0; j < (uint32_t)n; j++)
				out->pos[pi][l][h][j] = (uint32_t)kvd_seq_position(s, l, h, j);
		}
	/* What was kept is what was written there. */
	ASSERT_EQ(check_seq(s, 3 + pi), 0u);
	ASSERT_OK(kvd_seq_unpin(s));
	ASSERT_OK(kvd_seq_release(s));
}

/* Every policy on daemon `daemon`, host or cuda backend; with cuda, the daemon's log must
 * say where rounds score (`scored`: its first line naming GPU 0's choice), and with
 * `fallback` every layer meant for the GPU must have fallen back to the CPU, said. */
static void run(const char *daemon, bool cuda, const char *scored, bool fallback,
                struct kept *out) {
	static const char *const args[] = { "--pool-size=64MiB", "--chunk-size=2MiB", NULL };
	_cleanup_(kvd_client_unrefp) kvd_client *admin = NULL;
	char config[512];
	size_t n = 0;
	struct fixture f;

	for (uint32_t i = 0; i < N_POLICIES; i++)
		n += (size_t)snprintf(config + n, sizeof(config) - n, "[tenant p-%s]\npolicy = %s\n",
		                      policies[i], policies[i]);
	setenv("KVD_DAEMON", daemon, 1);
	if (cuda)
		setenv("KVD_TEST_BACKEND", "cuda", 1);
	else
		unsetenv("KVD_TEST_BACKEND");
	/* The CPU-scored cuda run: where the kernels would load (a real GPU), not them. */
	if (cuda && scored && strstr(scored, "on the CPU"))
		setenv("KVD_TEST_ROUND_CPU", "1", 1);
	else
		unsetenv("KVD_TEST_ROUND_CPU");
	fixture_setup(&f, config, true);
	fixture_launch(&f, args);
	admin = fixture_connect(&f, NULL);
	for (uint32_t i = 0; i < N_POLICIES; i++)
		run_policy(&f, admin, i, out);
	admin = kvd_client_unref(admin);
	/* Otherwise a path that fell back would compare the CPU with itself: the start-up line,
	 * and every layer meant for the GPU scored there (restkv and laprox: 2 policies x 2
	 * layers x one kv-head group each). */
	if (scored && fixture_log_count(&f, scored) != 1)
		test_fail(__FILE__, __LINE__, "the daemon's log does not say \"%s\"", scored);
	{
		bool gpu = cuda && strcmp(daemon, getenv("KVD_DAEMON_GPU")) == 0 &&
		           !getenv("KVD_TEST_ROUND_CPU");

		ASSERT_EQ(fixture_status(&f, NULL, "gpu_fallbacks"), fallback ? 2u * LAYERS : 0u);
		ASSERT_EQ(fixture_status(&f, NULL, "gpu_scored_layers"),
		          gpu && !fallback ? 2u * LAYERS : 0u);
		ASSERT_EQ(fixture_log_count(&f, "meant for the GPU were scored on the CPU after a "
		                                "device error (Cannot allocate memory)"), fallback ? 1 : 0);
	}
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Positions of x[0..nx) that y[0..ny) lacks, both ascending. */
static uint32_t missing(const uint32_t *x, uint32_t nx, const uint32_t *y, uint32_t ny) {
	uint32_t m = 0, j = 0;

	for (uint32_t i = 0; i < nx; i++) {
		while (j < ny && y[j] < x[i])
			j++;
		m += j == ny || y[j] != x[i];
	}
	return m;
}

static void assert_same(const struct kept *a, const struct kept *b, const char *what,
                        double tolerance) {
	for (uint32_t i = 0; i < N_POLICIES; i++)
		for (uint32_t l = 0; l < LAYERS; l++)
			for (uint32_t h = 0; h < KV_HEADS; h++) {
				uint32_t na = a->n[i][l][h], nb = b->n[i][l][h];
				uint32_t diff = missing(a->pos[i][l][h], na, b->pos[i][l][h], nb) +
				                missing(b->pos[i][l][h], nb, a->pos[i][l][h], na);

				if (diff > tolerance * na)
					test_fail(__FILE__, __LINE__, "%s: policy %s, layer %u, kv head %u: "
					          "%u tokens kept against %u, %u positions differ", what,
					          policies[i], l, h, nb, na, diff);
			}
}

TEST(same_tokens_on_every_path) {
	const char *plain = getenv("KVD_DAEMON_PLAIN"), *gpu = getenv("KVD_DAEMON_GPU");
	const char *tol = getenv("KVD_ROUND_PARITY_TOLERANCE");
	double tolerance = tol ? strtod(tol, NULL) : 0;
	_cleanup_(freep) struct kept *host = calloc(1, sizeof(*host));
	_cleanup_(freep) struct kept *copied = calloc(1, sizeof(*copied));
	_cleanup_(freep) struct kept *scored = calloc(1, sizeof(*scored));

	TEST_NEEDS_HOOKS();
	if (!plain || !gpu)
		test_fail(__FILE__, __LINE__, "KVD_DAEMON_PLAIN and KVD_DAEMON_GPU are not set "
		          "(run the test through meson)");
	ASSERT_TRUE(host && copied && scored);
	run(plain, false, NULL, false, host);
	run(plain, true, "GPU 0: rounds score on the CPU, with the K/V copied there", false, copied);
	run(gpu, true, "GPU 0: rounds score restkv and laprox there", false, scored);
	/* The copies move bytes: exact everywhere. */
	assert_same(host, copied, "cuda, scored on the CPU", 0);
	assert_same(host, scored, "cuda, scored on the GPU", tolerance);
}

/*
 * Where the driver refuses the pitches of device-to-device 2D copies (as it may for pitches
 * cuMemAllocPitch did not make), the compaction copies (CPU-scored run) and the device
 * gathers (GPU-scored run) go through cuMemcpy2DUnaligned and keep the same tokens. The
 * fake refuses them with KVD_FAKE_CUDA_PITCH_ALIGN; not on a GPU, whose pitches decide.
 */
TEST(same_tokens_when_the_driver_refuses_pitches) {
	static const char refused[] = "the driver refused a device-to-device 2D copy's pitches";
	const char *plain = getenv("KVD_DAEMON_PLAIN"), *gpu = getenv("KVD_DAEMON_GPU");
	_cleanup_(freep) struct kept *host = calloc(1, sizeof(*host));
	_cleanup_(freep) struct kept *copied = calloc(1, sizeof(*copied));
	_cleanup_(freep) struct kept *scored = calloc(1, sizeof(*scored));

	TEST_NEEDS_HOOKS();
	if (!plain || !gpu || !getenv("KVD_FAKE_CUDA_DEVICES"))
		TEST_SKIP("needs the fake driver (run the test through meson)");
	ASSERT_TRUE(host && copied && scored);
	run(plain, false, NULL, false, host);
	setenv("KVD_FAKE_CUDA_PITCH_ALIGN", "1073741824", 1);
	run(plain, true, refused, false, copied);
	run(gpu, true, refused, false, scored);
	unsetenv("KVD_FAKE_CUDA_PITCH_ALIGN");
	assert_same(host, copied, "cuda, scored on the CPU, unaligned copies", 0);
	assert_same(host, scored, "cuda, scored on the GPU, unaligned copies", 0);
}

/*
 * A GPU with no memory left for the round's buffers (an engine filled it): every layer meant
 * for it is scored on the CPU, keeps the same tokens, and is counted and said as a fallback,
 * never as GPU scoring. The fake refuses larger cuMemAllocs with KVD_FAKE_CUDA_ALLOC_MAX_KIB.
 */
TEST(fallbacks_counted_and_said) {
	const char *plain = getenv("KVD_DAEMON_PLAIN"), *gpu = getenv("KVD_DAEMON_GPU");
	_cleanup_(freep) struct kept *host = calloc(1, sizeof(*host));
	_cleanup_(freep) struct kept *fell = calloc(1, sizeof(*fell));

	TEST_NEEDS_HOOKS();
	if (!plain || !gpu || !getenv("KVD_FAKE_CUDA_DEVICES"))
		TEST_SKIP("needs the fake driver (run the test through meson)");
	ASSERT_TRUE(host && fell);
	run(plain, false, NULL, false, host);
	setenv("KVD_FAKE_CUDA_ALLOC_MAX_KIB", "4", 1);
	run(gpu, true, "GPU 0: rounds score restkv and laprox there", true, fell);
	unsetenv("KVD_FAKE_CUDA_ALLOC_MAX_KIB");
	assert_same(host, fell, "cuda, GPU scoring fallen back to the CPU", 0);
}
