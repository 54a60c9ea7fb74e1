/* SPDX-License-Identifier: MIT */
/*
 * kvd-lm with its KV cache in a real daemon (integration suite).
 *
 * With a budget that never runs short, the kvd cache must give bit for bit the logits of
 * the private full cache: the same keys in the same order go through the same arithmetic,
 * only read from daemon blocks of 16 tokens instead of one private array. Checked through
 * the library (every prefill logit and 16 greedy decode steps, for --unit head and layer)
 * and through the kvd-lm command line (--print-logits output byte for byte).
 *
 * With a budget far below the context, eviction rounds take tokens per (layer, kv head)
 * while the engine runs: generation must still finish, the daemon must stay within its
 * budget and report evicted tokens, the tables the engine attends over must keep the
 * protected tokens (sinks, the last window) with ascending positions, and both sides must
 * see the same bytes (digests). And one decode step after eviction must give the logits of
 * attention over exactly the resident slots by their original positions, recomputed here
 * in double by plain loops from the daemon's K/V.
 *
 * Moved to the host tier while it idles and brought back by its next pin, twice: bit for
 * bit the full cache's logits too.
 *
 * With compensation (MomentKV moments), the same: bit for bit the full cache's logits while
 * nothing is evicted, and after eviction the reference step adds each table's moments as
 * one more softmax entry, in both forms, from the moments the daemon folded.
 *
 * Environment (set by meson): KVD_DAEMON, KVD_LM (the kvd-lm binary), KVD_LM_DATA.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cache.h"
#include "basic/macro.h"
#include "fixture.h"
#include "forward.h"
#include "model.h"
#include "test.h"

#define POOL "--pool-size=64MiB"
#define CHUNK "--chunk-size=256KiB"
#define GREEDY_STEPS 16
#define WINDOW 32u
#define SINKS 4u
#define THREADS 2u

static struct kvdlm_model *model;
static char model_path[512], input_path[512];

static void cleanup(void) {
	model = kvdlm_model_free(model);
}

int test_setup(void) {
	const char *dir = getenv("KVD_LM_DATA");
	char err[KVDLM_ERROR_MAX];
	int r;

	if (!dir || !getenv("KVD_LM")) {
		fprintf(stderr, "KVD_LM_DATA or KVD_LM is not set (run the tests through meson)\n");
		return -EINVAL;
	}
	snprintf(model_path, sizeof(model_path), "%s/random.kvdlm", dir);
	snprintf(input_path, sizeof(input_path), "%s/random-input.txt", dir);
	r = kvdlm_model_load(model_path, &model, err, sizeof(err));
	if (r < 0) {
		fprintf(stderr, "%s\n", err);
		return r;
	}
	atexit(cleanup);
	return 0;
}

/* BOS + the reference input repeated `times`, in *ret; returns the token count. */
static uint32_t prompt_tokens(uint32_t times, uint32_t **ret) {
	char text[4096];
	FILE *f = fopen(input_path, "re");
	size_t n;
	uint32_t *t, k = 0;

	ASSERT_NOT_NULL(f);
	n = fread(text, 1, sizeof(text), f);
	fclose(f);
	ASSERT_TRUE(n > 0 && n < sizeof(text));
	t = malloc((1 + n * times) * sizeof(uint32_t));
	ASSERT_NOT_NULL(t);
	t[k++] = KVDLM_BOS;
	for (uint32_t i = 0; i < times; i++)
		for (size_t j = 0; j < n; j++)
			t[k++] = (uint8_t)text[j];
	*ret = t;
	return k;
}

/* With tiers: the daemon whose host tier takes the engine's sequence when it idles, and
 * how many moves out it made so far. */
struct idle {
	struct fixture *f;
	uint64_t offloads;
};

/* The engine idles until the daemon moved its sequence to the host tier. */
static void idle_until_moved_out(struct idle *idle) {
	if (!idle)
		return;
	ASSERT_TRUE(fixture_wait_status(idle->f, NULL, "tier_offloads", idle->offloads + 1));
	idle->offloads++;
}

/*
 * Prefill (all logits into prefill[n][vocab]) then `steps` greedy decode steps (their
 * logits into decode[steps][vocab]); returns the generated tokens in out[steps]. With
 * idle, the engine idles until its sequence is moved out after the prefill and half way
 * through the steps, so that the next step's pin brings it back.
 */
static void generate(struct kvdlm_cache *c, const uint32_t *tokens, uint32_t n, uint32_t chunk,
                     uint32_t steps, float *prefill, float *decode, uint32_t *out,
                     struct idle *idle) {
	_cleanup_(kvdlm_session_freep) struct kvdlm_session *s = NULL;
	float *last = prefill + (size_t)(n - 1) * KVDLM_BYTE_VOCAB;

	ASSERT_OK(kvdlm_session_new(model, c, &(struct kvdlm_session_opts){ THREADS, chunk }, &s));
	ASSERT_OK(kvdlm_prefill(s, tokens, n, KVDLM_LOGITS_ALL, prefill));
	idle_until_moved_out(idle);
	for (uint32_t i = 0; i < steps; i++) {
		if (i == steps / 2)
			idle_until_moved_out(idle);
		out[i] = kvdlm_argmax(i ? decode + (size_t)(i - 1) * KVDLM_BYTE_VOCAB : last, KVDLM_BYTE_VOCAB);
		ASSERT_OK(kvdlm_decode(s, out[i], decode + (size_t)i * KVDLM_BYTE_VOCAB));
	}
}

/* Every table's positions ascend, sinks and the last window are there, the digests agree. */
static void check_tables(struct kvdlm_cache *c) {
	kvd_seq *s = kvdlm_cache_seq(c);
	const struct kvd_seq_desc *d = kvd_seq_descriptor(s);

	ASSERT_OK(kvd_seq_pin(s));
	for (uint32_t l = 0; l < model->cfg.layers; l++)
		for (uint32_t h = 0; h < model->cfg.kv_heads; h++) {
			int64_t n = kvd_seq_tokens(s, l, h), prev = -1;

			ASSERT_TRUE(n >= WINDOW);
			for (int64_t j = 0; j < n; j++) {
				int64_t pos = kvd_seq_position(s, l, h, (uint32_t)j);

				ASSERT_TRUE(pos > prev);
				if (j < SINKS)
					ASSERT_EQ(pos, j);
				prev = pos;
			}
			ASSERT_EQ(kvd_seq_position(s, l, h, (uint32_t)(n - WINDOW)),
			          (int64_t)d->next_position - WINDOW);
			ASSERT_EQ(prev, (int64_t)d->next_position - 1);
		}
	assert_digests_agree(s);
	ASSERT_OK(kvd_seq_unpin(s));
}

static void same_as_full(uint32_t unit, uint32_t chunk, uint32_t compensation, bool tiers) {
	struct fixture f;
	struct idle idle = { .f = &f };
	_cleanup_(freep) uint32_t *tokens = NULL;
	_cleanup_(freep) float *pf = NULL, *pk = NULL, *df = NULL, *dk = NULL;
	uint32_t n = prompt_tokens(3, &tokens), of[GREEDY_STEPS], ok[GREEDY_STEPS];
	size_t pn = (size_t)n * KVDLM_BYTE_VOCAB, dn = (size_t)GREEDY_STEPS * KVDLM_BYTE_VOCAB;
	struct kvdlm_cache_stats st;
	struct kvdlm_kvd_model km;
	kvd_client *c;

	pf = malloc(pn * sizeof(float));
	pk = malloc(pn * sizeof(float));
	df = malloc(dn * sizeof(float));
	dk = malloc(dn * sizeof(float));
	ASSERT_TRUE(pf && pk && df && dk);
	{
		_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *full = NULL;

		ASSERT_OK(kvdlm_cache_full_new(&model->cfg, n + GREEDY_STEPS, &full));
		generate(full, tokens, n, chunk, GREEDY_STEPS, pf, df, of, NULL);
	}

	if (tiers) {
		kvd_client *admin;

		fixture_start(&f, (const char *const[]){ POOL, CHUNK, "--host-tier-size=16MiB",
		                                         "--tier-idle=100", NULL });
		admin = fixture_connect(&f, NULL);
		ASSERT_OK(kvd_tenant_set_params(admin, "lm", &(kvd_tenant_params){
			.size = sizeof(kvd_tenant_params), .set = KVD_TENANT_SET_TIER, .tier = "host" }));
		kvd_client_unref(admin);
	} else
		fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	c = fixture_connect(&f, "lm");
	ASSERT_OK(kvdlm_kvd_register_compensated(c, model, "kvd-lm-test", unit, WINDOW, compensation, &km));
	{
		_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *kc = NULL;

		ASSERT_OK(kvdlm_cache_kvd_new(&km, &model->cfg, n + GREEDY_STEPS, &kc));
		generate(kc, tokens, n, chunk, GREEDY_STEPS, pk, dk, ok, tiers ? &idle : NULL);
		ASSERT_OK(kvdlm_cache_stats(kc, &st));
		ASSERT_EQ(st.positions, (uint64_t)n + GREEDY_STEPS);
		ASSERT_EQ(st.resident, st.positions * model->cfg.layers * model->cfg.kv_heads);
		/* Each move out rewrites the descriptor (and says so); nothing else does. */
		ASSERT_EQ(st.changed, tiers ? 2u : 0u);
		check_tables(kc);
	}
	ASSERT_TRUE(memcmp(pf, pk, pn * sizeof(float)) == 0);
	ASSERT_TRUE(memcmp(df, dk, dn * sizeof(float)) == 0);
	ASSERT_TRUE(memcmp(of, ok, sizeof(of)) == 0);
	ASSERT_EQ(fixture_status(&f, "lm", "evicted_tokens"), 0u);
	if (tiers)
		ASSERT_EQ(fixture_status(&f, NULL, "tier_recalls"), 2u);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(same_as_full_unit_head) {
	same_as_full(KVD_UNIT_HEAD_TOKEN, KVDLM_CHUNK_DEFAULT, KVD_COMPENSATION_NONE, false);
}

/* Chunks that end inside daemon blocks, and another unit. */
TEST(same_as_full_unit_layer_chunk_7) {
	same_as_full(KVD_UNIT_LAYER_TOKEN, 7, KVD_COMPENSATION_NONE, false);
}

/* Moments that hold nothing add nothing: still bit for bit. */
TEST(same_as_full_moments) {
	same_as_full(KVD_UNIT_HEAD_TOKEN, KVDLM_CHUNK_DEFAULT, KVD_COMPENSATION_MOMENTS, false);
}

/* Moved to the host tier after the prefill and again half way, brought back by the next
 * step's pin each time: still bit for bit (moments blocks included). */
TEST(same_as_full_after_recalls) {
	same_as_full(KVD_UNIT_HEAD_TOKEN, KVDLM_CHUNK_DEFAULT, KVD_COMPENSATION_MOMENTS, true);
}

/* Runs command (a shell line), its stdout into out[n]; returns the exit status. */
#define SAMPLES 4

/* Decodes GREEDY_STEPS tokens of sample i over c (after a prompt whose last logits are
 * last): each sample branches from the greedy choice by i, then goes greedy. */
static void decode_sample(struct kvdlm_cache *c, uint32_t i, const float *last, float *logits) {
	_cleanup_(kvdlm_session_freep) struct kvdlm_session *s = NULL;

	ASSERT_OK(kvdlm_session_new(model, c, &(struct kvdlm_session_opts){ THREADS, 0 }, &s));
	for (uint32_t k = 0; k < GREEDY_STEPS; k++) {
		const float *prev = k ? logits + (size_t)(k - 1) * KVDLM_BYTE_VOCAB : last;
		uint32_t tok = kvdlm_argmax(prev, KVDLM_BYTE_VOCAB);

		if (k == 0)
			tok = (tok + i) % KVDLM_BYTE_VOCAB;
		ASSERT_OK(kvdlm_decode(s, tok, logits + (size_t)k * KVDLM_BYTE_VOCAB));
	}
}

/* Parallel sampling by fork: SAMPLES samples of one prompt, the prompt prefilled once and
 * forked, give bit for bit the logits of samples run each on its own sequence, and hold
 * one copy of the prompt's full blocks. */
TEST(forked_samples_same_as_separate) {
	struct fixture f;
	_cleanup_(freep) uint32_t *tokens = NULL;
	_cleanup_(freep) float *last = NULL, *sep = NULL, *forked = NULL;
	uint32_t n = prompt_tokens(3, &tokens);
	size_t dn = (size_t)GREEDY_STEPS * KVDLM_BYTE_VOCAB;
	uint64_t one_prompt = 0, separate, shared, per_block;
	struct kvdlm_cache *caches[SAMPLES] = {};
	struct kvdlm_kvd_model km;
	kvd_client *c;

	last = malloc(KVDLM_BYTE_VOCAB * sizeof(float));
	sep = malloc(SAMPLES * dn * sizeof(float));
	forked = malloc(SAMPLES * dn * sizeof(float));
	ASSERT_TRUE(last && sep && forked);
	fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	c = fixture_connect(&f, "lm");
	ASSERT_OK(kvdlm_kvd_register_compensated(c, model, "kvd-lm-test", KVD_UNIT_HEAD_TOKEN,
	                                         WINDOW, KVD_COMPENSATION_NONE, &km));

	/* Each sample on its own sequence, its prompt prefilled again. */
	for (uint32_t i = 0; i < SAMPLES; i++) {
		_cleanup_(kvdlm_session_freep) struct kvdlm_session *s = NULL;

		ASSERT_OK(kvdlm_cache_kvd_new(&km, &model->cfg, n + GREEDY_STEPS, &caches[i]));
		ASSERT_OK(kvdlm_session_new(model, caches[i], &(struct kvdlm_session_opts){ THREADS, 0 }, &s));
		ASSERT_OK(kvdlm_prefill(s, tokens, n, KVDLM_LOGITS_LAST, last));
		if (i == 0)
			one_prompt = fixture_status(&f, "lm", "block_bytes");
		decode_sample(caches[i], i, last, sep + i * dn);
	}
	separate = fixture_status(&f, "lm", "block_bytes");
	for (uint32_t i = 0; i < SAMPLES; i++)
		caches[i] = kvdlm_cache_free(caches[i]);

	/* The prompt once, then forks: nothing prefilled again. */
	{
		_cleanup_(kvdlm_session_freep) struct kvdlm_session *s = NULL;

		ASSERT_OK(kvdlm_cache_kvd_new(&km, &model->cfg, n + GREEDY_STEPS, &caches[0]));
		ASSERT_OK(kvdlm_session_new(model, caches[0], &(struct kvdlm_session_opts){ THREADS, 0 }, &s));
		ASSERT_OK(kvdlm_prefill(s, tokens, n, KVDLM_LOGITS_LAST, last));
	}
	for (uint32_t i = 1; i < SAMPLES; i++)
		ASSERT_OK(kvdlm_cache_kvd_fork(&km, &model->cfg, caches[0], &caches[i]));
	for (uint32_t i = 0; i < SAMPLES; i++)
		decode_sample(caches[i], i, last, forked + i * dn);
	shared = fixture_status(&f, "lm", "block_bytes");
	ASSERT_TRUE(memcmp(sep, forked, SAMPLES * dn * sizeof(float)) == 0);
	ASSERT_EQ(fixture_status(&f, "lm", "evicted_tokens"), 0u);

	/* One copy of the prompt's blocks, and each sample's own: what its steps grew and
	 * its copy of the prompt's partly filled last block, per table. */
	per_block = kvd_seq_descriptor(kvdlm_cache_seq(caches[0]))->block_bytes *
	            model->cfg.layers * model->cfg.kv_heads;
	printf("# %u samples of a %u-token prompt: %" PRIu64 " block bytes on their own "
	       "sequences, %" PRIu64 " forked (one prompt: %" PRIu64 "); %u prefill tokens "
	       "skipped\n", SAMPLES, n, separate, shared, one_prompt, (SAMPLES - 1) * n);
	ASSERT_TRUE(shared <= one_prompt + SAMPLES * per_block *
	                      (1 + DIV_ROUND_UP(GREEDY_STEPS, KVDLM_KVD_BLOCK_TOKENS)));
	ASSERT_TRUE(shared * 2 < separate);
	for (uint32_t i = 0; i < SAMPLES; i++)
		caches[i] = kvdlm_cache_free(caches[i]);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Prefill of tokens[from, n) over c, then GREEDY_STEPS greedy steps: logits into out. */
static void run_request(struct kvdlm_cache *c, const uint32_t *tokens, uint32_t from, uint32_t n,
                        float *out) {
	_cleanup_(kvdlm_session_freep) struct kvdlm_session *s = NULL;
	_cleanup_(freep) float *last = malloc(KVDLM_BYTE_VOCAB * sizeof(float));

	ASSERT_NOT_NULL(last);
	ASSERT_OK(kvdlm_session_new(model, c, &(struct kvdlm_session_opts){ THREADS, 0 }, &s));
	ASSERT_OK(kvdlm_prefill(s, tokens + from, n - from, KVDLM_LOGITS_LAST, last));
	for (uint32_t k = 0; k < GREEDY_STEPS; k++) {
		const float *prev = k ? out + (size_t)(k - 1) * KVDLM_BYTE_VOCAB : last;

		ASSERT_OK(kvdlm_decode(s, kvdlm_argmax(prev, KVDLM_BYTE_VOCAB),
		                       out + (size_t)k * KVDLM_BYTE_VOCAB));
	}
}

/* Two requests with one system prompt and their own questions: the second, opened with its
 * prompt's keys after the first published, finds the system prompt's full blocks, prefills
 * only the rest, and gives bit for bit the logits of a run without sharing. */
TEST(prefix_open_same_as_full_prefill) {
	static const char *const questions[2] = { " Which tiers hold it?", " How are keys made?" };
	struct fixture f;
	_cleanup_(freep) uint32_t *sys = NULL;
	uint32_t *prompt[2] = {};
	_cleanup_(freep) float *alone = NULL, *shared = NULL;
	size_t dn = (size_t)GREEDY_STEPS * KVDLM_BYTE_VOCAB;
	uint32_t n_sys = prompt_tokens(3, &sys), n[2], found;
	uint64_t separate, together;
	struct kvdlm_cache *a, *b;
	struct kvdlm_kvd_model km;
	kvd_client *c;

	alone = malloc(dn * sizeof(float));
	shared = malloc(dn * sizeof(float));
	ASSERT_TRUE(alone && shared);
	for (int i = 0; i < 2; i++) {
		n[i] = n_sys + (uint32_t)strlen(questions[i]);
		prompt[i] = malloc(n[i] * sizeof(uint32_t));
		ASSERT_NOT_NULL(prompt[i]);
		memcpy(prompt[i], sys, n_sys * sizeof(uint32_t));
		for (uint32_t j = n_sys; j < n[i]; j++)
			prompt[i][j] = (uint8_t)questions[i][j - n_sys];
	}
	fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	c = fixture_connect(&f, "lm");
	ASSERT_OK(kvdlm_kvd_register_compensated(c, model, "kvd-lm-test", KVD_UNIT_HEAD_TOKEN,
	                                         WINDOW, KVD_COMPENSATION_NONE, &km));

	/* Request 1, then request 2 on its own sequence, each prefilled whole. */
	ASSERT_OK(kvdlm_cache_kvd_new(&km, &model->cfg, n[0] + GREEDY_STEPS, &a));
	run_request(a, prompt[0], 0, n[0], shared);
	ASSERT_OK(kvdlm_cache_kvd_new(&km, &model->cfg, n[1] + GREEDY_STEPS, &b));
	run_request(b, prompt[1], 0, n[1], alone);
	separate = fixture_status(&f, "lm", "block_bytes");
	a = kvdlm_cache_free(a);
	b = kvdlm_cache_free(b);

	/* Request 1 publishes its prompt; request 2 finds the system prompt's full blocks. */
	ASSERT_OK(kvdlm_cache_kvd_open_prefix(&km, &model->cfg, n[0] + GREEDY_STEPS, prompt[0], n[0], &a));
	ASSERT_EQ(kvd_seq_tokens(kvdlm_cache_seq(a), 0, 0), 0);
	run_request(a, prompt[0], 0, n[0], shared);
	ASSERT_OK(kvdlm_cache_kvd_publish(a));
	ASSERT_OK(kvdlm_cache_kvd_open_prefix(&km, &model->cfg, n[1] + GREEDY_STEPS, prompt[1], n[1], &b));
	found = (uint32_t)kvd_seq_tokens(kvdlm_cache_seq(b), 0, 0);
	ASSERT_EQ(found, n_sys / KVDLM_KVD_BLOCK_TOKENS * KVDLM_KVD_BLOCK_TOKENS);
	run_request(b, prompt[1], found, n[1], shared);
	together = fixture_status(&f, "lm", "block_bytes");
	ASSERT_TRUE(memcmp(alone, shared, dn * sizeof(float)) == 0);
	ASSERT_EQ(fixture_status(&f, "lm", "evicted_tokens"), 0u);
	ASSERT_EQ(fixture_status(&f, "lm", "prefix_tokens"), found);
	printf("# 2 requests of a %u-token system prompt and a question each: %" PRIu64 " block "
	       "bytes on their own, %" PRIu64 " sharing; %u of %u prefill tokens skipped\n",
	       n_sys, separate, together, found, n[0] + n[1]);
	/* The second holds only what follows the shared blocks. */
	ASSERT_EQ(separate - together, (uint64_t)found / KVDLM_KVD_BLOCK_TOKENS *
	          kvd_seq_descriptor(kvdlm_cache_seq(b))->block_bytes * model->cfg.layers *
	          model->cfg.kv_heads);
	kvdlm_cache_free(a);
	kvdlm_cache_free(b);
	for (int i = 0; i < 2; i++)
		free(prompt[i]);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

static int run_capture(const char *command, char *out, size_t n) {
	FILE *p = popen(command, "re");
	size_t k;
	int status;

	ASSERT_NOT_NULL(p);
	k = fread(out, 1, n - 1, p);
	out[k] = 0;
	status = pclose(p);
	ASSERT_TRUE(WIFEXITED(status));
	return WEXITSTATUS(status);
}

/* The command line: the same --print-logits output with and without the daemon. */
TEST(cli_same_output) {
	static char a[1 << 20], b[1 << 20];
	char cmd[2048];
	struct fixture f;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	snprintf(cmd, sizeof(cmd),
	         "'%s' --model '%s' --prompt-file '%s' --max-new %d --no-stop --threads %u --chunk 40 "
	         "--print-logits --no-daemon",
	         getenv("KVD_LM"), model_path, input_path, GREEDY_STEPS, THREADS);
	ASSERT_EQ(run_capture(cmd, a, sizeof(a)), 0);
	snprintf(cmd, sizeof(cmd),
	         "'%s' --model '%s' --prompt-file '%s' --max-new %d --no-stop --threads %u --chunk 40 "
	         "--print-logits --socket '%s' --tenant cli --unit head",
	         getenv("KVD_LM"), model_path, input_path, GREEDY_STEPS, THREADS, f.socket);
	ASSERT_EQ(run_capture(cmd, b, sizeof(b)), 0);
	ASSERT_TRUE(strlen(a) > 0);
	ASSERT_STREQ(a, b);
	/* One line per generated token, then the text. */
	ASSERT_TRUE(strncmp(a, "logits 105 78 ", 14) == 0);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Usage errors exit 2, and a missing daemon 1. */
TEST(cli_exit_codes) {
	char out[4096], cmd[2048];

	snprintf(cmd, sizeof(cmd), "'%s' --help", getenv("KVD_LM"));
	ASSERT_EQ(run_capture(cmd, out, sizeof(out)), 0);
	ASSERT_NOT_NULL(strstr(out, "--no-daemon"));
	snprintf(cmd, sizeof(cmd), "'%s' --model '%s' --threads 0 2>/dev/null", getenv("KVD_LM"), model_path);
	ASSERT_EQ(run_capture(cmd, out, sizeof(out)), 2);
	snprintf(cmd, sizeof(cmd), "'%s' --prompt x 2>/dev/null", getenv("KVD_LM"));
	ASSERT_EQ(run_capture(cmd, out, sizeof(out)), 2);
	snprintf(cmd, sizeof(cmd), "'%s' --model '%s' --unit token 2>/dev/null", getenv("KVD_LM"), model_path);
	ASSERT_EQ(run_capture(cmd, out, sizeof(out)), 2);
	snprintf(cmd, sizeof(cmd), "'%s' --model '%s' --no-daemon --socket /x 2>/dev/null", getenv("KVD_LM"),
	         model_path);
	ASSERT_EQ(run_capture(cmd, out, sizeof(out)), 2);
	/* Moments summarise evictions: they need the daemon and a unit. */
	snprintf(cmd, sizeof(cmd), "'%s' --model '%s' --no-daemon --compensation moments 2>/dev/null",
	         getenv("KVD_LM"), model_path);
	ASSERT_EQ(run_capture(cmd, out, sizeof(out)), 2);
	snprintf(cmd, sizeof(cmd), "'%s' --model '%s' --unit none --compensation moments-mass 2>/dev/null",
	         getenv("KVD_LM"), model_path);
	ASSERT_EQ(run_capture(cmd, out, sizeof(out)), 2);
	snprintf(cmd, sizeof(cmd), "'%s' --model '%s' --compensation latent 2>/dev/null", getenv("KVD_LM"),
	         model_path);
	ASSERT_EQ(run_capture(cmd, out, sizeof(out)), 2);
	snprintf(cmd, sizeof(cmd), "'%s' --model '%s' --socket /nonexistent/kvd.sock 2>/dev/null",
	         getenv("KVD_LM"), model_path);
	ASSERT_EQ(run_capture(cmd, out, sizeof(out)), 1);
	snprintf(cmd, sizeof(cmd), "'%s' --model /nonexistent.kvdlm --no-daemon 2>/dev/null", getenv("KVD_LM"));
	ASSERT_EQ(run_capture(cmd, out, sizeof(out)), 1);
}

/*
 * A 3,000-token prompt of the random model holds 1.5 MiB of K/V (4 tables x 128 bytes a
 * token); the budget is 512 KiB. Rounds must evict, per (layer, kv head), while the engine
 * prefills and decodes.
 */
TEST(evicts_within_budget) {
	const uint64_t budget = 512u << 10;
	struct fixture f;
	_cleanup_(freep) uint32_t *tokens = NULL;
	_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *kc = NULL;
	_cleanup_(kvdlm_session_freep) struct kvdlm_session *s = NULL;
	uint32_t n = prompt_tokens(29, &tokens), steps = 48;
	float lg[KVDLM_BYTE_VOCAB];
	struct kvdlm_cache_stats st;
	struct kvdlm_kvd_model km;
	kvd_client *c;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, "--budget=512KiB", "--grant-wait=10000", NULL });
	c = fixture_connect(&f, "small");
	ASSERT_OK(kvdlm_kvd_register(c, model, "kvd-lm-test", KVD_UNIT_HEAD_TOKEN, WINDOW, &km));
	ASSERT_OK(kvdlm_cache_kvd_new(&km, &model->cfg, n + steps, &kc));
	ASSERT_OK(kvdlm_session_new(model, kc, &(struct kvdlm_session_opts){ THREADS, 0 }, &s));
	for (uint32_t i = 0; i < n; i += KVDLM_CHUNK_DEFAULT) {
		uint32_t k = MIN(KVDLM_CHUNK_DEFAULT, n - i);

		ASSERT_OK(kvdlm_prefill(s, tokens + i, k, KVDLM_LOGITS_LAST, lg));
		ASSERT_TRUE(fixture_status(&f, NULL, "used_bytes") <= budget);
	}
	for (uint32_t i = 0; i < steps; i++) {
		uint32_t t = kvdlm_argmax(lg, KVDLM_BYTE_VOCAB);

		for (uint32_t j = 0; j < KVDLM_BYTE_VOCAB; j++)
			ASSERT_TRUE(isfinite(lg[j]));
		ASSERT_OK(kvdlm_decode(s, t, lg));
	}
	ASSERT_TRUE(fixture_status(&f, NULL, "used_bytes") <= budget);
	ASSERT_TRUE(fixture_status(&f, NULL, "rounds_total") > 0);
	ASSERT_TRUE(fixture_status(&f, "small", "evicted_tokens") > 0);
	ASSERT_OK(kvdlm_cache_stats(kc, &st));
	printf("%" PRIu64 " positions, %" PRIu64 " of %" PRIu64 " table tokens resident (%u..%u per table), "
	       "%" PRIu64 " rewrites seen, daemon: %" PRIu64 " evicted\n",
	       st.positions, st.resident, st.positions * st.tables, st.resident_min, st.resident_max, st.changed,
	       fixture_status(&f, "small", "evicted_tokens"));
	ASSERT_EQ(st.positions, (uint64_t)n + steps);
	ASSERT_TRUE(st.resident < st.positions * st.tables);
	check_tables(kc);
	s = kvdlm_session_free(s);
	kc = kvdlm_cache_free(kc);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* ---- a reference step over what the daemon kept ---- */

static void ref_rmsnorm(const double *x, const float *w, uint32_t n, double *y) {
	double ss = 0;

	for (uint32_t i = 0; i < n; i++)
		ss += x[i] * x[i];
	ss = 1.0 / sqrt(ss / n + model->cfg.norm_eps);
	for (uint32_t i = 0; i < n; i++)
		y[i] = x[i] * ss * w[i];
}

/* y[rows] = W[rows][cols] x */
static void ref_matvec(const float *w, uint32_t rows, uint32_t cols, const double *x, double *y) {
	for (uint32_t r = 0; r < rows; r++) {
		double a = 0;

		for (uint32_t c = 0; c < cols; c++)
			a += (double)w[(size_t)r * cols + c] * x[c];
		y[r] = a;
	}
}

/* RoPE as the spec says: the angle in fp32, the rotation in double. */
static void ref_rope(double *x, uint32_t pos) {
	uint32_t hd = model->cfg.head_dim, half = hd / 2;

	for (uint32_t i = 0; i < half; i++) {
		float inv = (float)pow((double)model->cfg.rope_theta, -2.0 * i / hd);
		float ang = (float)pos * inv;
		double c = cos((double)ang), sn = sin((double)ang), a = x[i], b = x[i + half];

		x[i] = a * c - b * sn;
		x[i + half] = b * c + a * sn;
	}
}

/*
 * The moments entry of (layer, kv head) for query q[hd] (double), as eval/kvd-lm/README.md
 * "Compensation" says; false when the sequence has no moments there or they are empty.
 */
static bool ref_moments(kvd_seq *s, uint32_t l, uint32_t kh, const double *q, bool mass,
                        double *ret_logit, double *ret_value) {
	const struct kvd_moments_header *m;
	uint32_t hd = model->cfg.head_dim;
	const float *mk, *mv, *var, *cov;
	double z = 0, extra = 0, sc = 1 / sqrt((double)hd);

	if (kvd_seq_moments(s, l, kh, &m) < 0 || m->count == 0)
		return false;
	mk = (const float *)((const char *)m + KVD_MOMENTS_HEADER_BYTES);
	mv = mk + hd, var = mv + hd, cov = var + hd;
	for (uint32_t a = 0; a < hd; a++) {
		double c = 0;

		z += q[a] * mk[a];
		extra += var[a] * q[a] * q[a];
		for (uint32_t b = 0; b < hd; b++)
			c += (double)cov[(size_t)a * hd + b] * q[b];
		ret_value[a] = mv[a] + sc * c;
	}
	*ret_logit = sc * z + log((double)m->count) + (mass ? sc * sc * extra / 2 : 0);
	return true;
}

/*
 * The logits after `token` at position `pos`, computed in double by plain loops from the
 * K/V the pinned sequence s holds: every table is read with its own resident positions,
 * and the token's own K and V rows (written by the engine) are checked on the way; with
 * moments, each table's entry joins the softmax (mass: the mass-corrected form).
 */
static void ref_step(kvd_seq *s, uint32_t token, uint32_t pos, bool mass, double *logits) {
	const struct kvdlm_config *c = &model->cfg;
	uint32_t dim = c->dim, hd = c->head_dim, qd = c->q_heads * hd, kd = c->kv_heads * hd;
	uint32_t g = c->q_heads / c->kv_heads;
	_cleanup_(freep) double *buf = calloc(3 * (size_t)dim + 2 * qd + 2 * (size_t)kd + 2 * (size_t)c->ffn, sizeof(double));
	double *h = buf, *a = h + dim, *q = a + dim, *k = q + qd, *v = k + kd, *o = v + kd, *t = o + qd;
	double *gate = t + dim, *up = gate + c->ffn;

	ASSERT_NOT_NULL(buf);
	for (uint32_t i = 0; i < dim; i++)
		h[i] = model->tok_emb[(size_t)token * dim + i];
	for (uint32_t l = 0; l < c->layers; l++) {
		const struct kvdlm_layer *L = &model->layers[l];

		ref_rmsnorm(h, L->attn_norm, dim, a);
		ref_matvec(L->wq, qd, dim, a, q);
		ref_matvec(L->wk, kd, dim, a, k);
		ref_matvec(L->wv, kd, dim, a, v);
		for (uint32_t hh = 0; hh < c->q_heads; hh++)
			ref_rope(q + hh * hd, pos);
		for (uint32_t kh = 0; kh < c->kv_heads; kh++)
			ref_rope(k + kh * hd, pos);
		for (uint32_t hh = 0; hh < c->q_heads; hh++) {
			uint32_t kh = hh / g;
			int64_t n = kvd_seq_tokens(s, l, kh);
			double mx = -INFINITY, sum = 0, mz = -INFINITY;
			_cleanup_(freep) double *p = malloc((size_t)n * sizeof(double));
			_cleanup_(freep) double *mval = malloc(hd * sizeof(double));
			bool has_m;

			ASSERT_TRUE(n > 0 && n <= 65536 && p && mval);
			has_m = ref_moments(s, l, kh, q + hh * hd, mass, &mz, mval);
			for (int64_t j = 0; j < n; j++) {
				int64_t pj = kvd_seq_position(s, l, kh, (uint32_t)j);
				float *kr, *vr;
				double d = 0;

				ASSERT_OK(kvd_seq_kv(s, l, kh, (uint32_t)j, (void **)&kr, (void **)&vr));
				ASSERT_TRUE(pj <= pos);
				if (pj == pos)
					for (uint32_t i = 0; i < hd; i++) {
						ASSERT_TRUE(fabs(kr[i] - k[kh * hd + i]) <= 1e-4 * (1 + fabs(k[kh * hd + i])));
						ASSERT_TRUE(fabs(vr[i] - v[kh * hd + i]) <= 1e-4 * (1 + fabs(v[kh * hd + i])));
					}
				for (uint32_t i = 0; i < hd; i++)
					d += q[hh * hd + i] * kr[i];
				p[j] = d / sqrt((double)hd);
				mx = fmax(mx, p[j]);
			}
			mx = fmax(mx, mz);
			for (int64_t j = 0; j < n; j++)
				sum += p[j] = exp(p[j] - mx);
			if (has_m)
				sum += mz = exp(mz - mx);
			for (uint32_t i = 0; i < hd; i++)
				o[hh * hd + i] = has_m ? mz / sum * mval[i] : 0;
			for (int64_t j = 0; j < n; j++) {
				float *vr;

				ASSERT_OK(kvd_seq_kv(s, l, kh, (uint32_t)j, NULL, (void **)&vr));
				for (uint32_t i = 0; i < hd; i++)
					o[hh * hd + i] += p[j] / sum * vr[i];
			}
		}
		ref_matvec(L->wo, dim, qd, o, t);
		for (uint32_t i = 0; i < dim; i++)
			h[i] += t[i];
		ref_rmsnorm(h, L->ffn_norm, dim, a);
		ref_matvec(L->w_gate, c->ffn, dim, a, gate);
		ref_matvec(L->w_up, c->ffn, dim, a, up);
		for (uint32_t i = 0; i < c->ffn; i++)
			gate[i] = gate[i] / (1 + exp(-gate[i])) * up[i];
		ref_matvec(L->w_down, dim, c->ffn, gate, t);
		for (uint32_t i = 0; i < dim; i++)
			h[i] += t[i];
	}
	ref_rmsnorm(h, model->final_norm, dim, a);
	ref_matvec(model->lm_head, c->vocab, dim, a, logits);
}

/*
 * After rounds evicted per (layer, kv head), one decode step's logits must be those of
 * attention over exactly the resident slots, by their original positions: recomputed
 * here in double from the daemon's K/V. The budget is raised first so that nothing
 * changes the tables around the checked step (their sizes are compared to make sure).
 */
static void evicted_attention(uint32_t compensation, enum kvd_moments_form form) {
	struct fixture f;
	_cleanup_(freep) uint32_t *tokens = NULL;
	_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *kc = NULL;
	_cleanup_(kvdlm_session_freep) struct kvdlm_session *s = NULL;
	uint32_t n = prompt_tokens(20, &tokens), tables = model->cfg.layers * model->cfg.kv_heads;
	int64_t before[64];
	float lg[KVDLM_BYTE_VOCAB];
	double want[KVDLM_BYTE_VOCAB], err = 0, scale = 1;
	struct kvdlm_kvd_model km;
	kvd_client *c, *admin;
	kvd_seq *seq;
	uint32_t tok, pos;
	bool uneven = false;

	ASSERT_TRUE(tables <= ELEMENTSOF(before));
	/* The moments blocks have a size of their own, so they take a chunk of their own: the
	 * budget grows by one, so that K/V get the same room. */
	fixture_start(&f, (const char *const[]){ POOL, CHUNK,
	                                         compensation ? "--budget=640KiB" : "--budget=384KiB",
	                                         "--grant-wait=10000", NULL });
	c = fixture_connect(&f, "check");
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvdlm_kvd_register_compensated(c, model, "kvd-lm-test", KVD_UNIT_HEAD_TOKEN, WINDOW,
	                                         compensation, &km));
	km.form = form;
	ASSERT_OK(kvdlm_cache_kvd_new(&km, &model->cfg, n + 4, &kc));
	ASSERT_OK(kvdlm_session_new(model, kc, &(struct kvdlm_session_opts){ THREADS, 0 }, &s));
	seq = kvdlm_cache_seq(kc);
	ASSERT_OK(kvdlm_prefill(s, tokens, n, KVDLM_LOGITS_LAST, lg));
	ASSERT_TRUE(fixture_status(&f, "check", "evicted_tokens") > 0);

	ASSERT_OK(kvd_budget_set(admin, 64u << 20));
	/* Two steps flush whatever plan was waiting for an unpin. */
	for (int i = 0; i < 2; i++) {
		tok = kvdlm_argmax(lg, KVDLM_BYTE_VOCAB);
		ASSERT_OK(kvdlm_decode(s, tok, lg));
	}
	ASSERT_OK(kvd_seq_pin(seq));
	for (uint32_t t = 0; t < tables; t++) {
		before[t] = kvd_seq_tokens(seq, t / model->cfg.kv_heads, t % model->cfg.kv_heads);
		uneven = uneven || before[t] != before[0];
	}
	ASSERT_OK(kvd_seq_unpin(seq));
	tok = kvdlm_argmax(lg, KVDLM_BYTE_VOCAB);
	pos = kvdlm_session_position(s);
	ASSERT_OK(kvdlm_decode(s, tok, lg));
	ASSERT_OK(kvd_seq_pin(seq));
	for (uint32_t t = 0; t < tables; t++)
		ASSERT_EQ(kvd_seq_tokens(seq, t / model->cfg.kv_heads, t % model->cfg.kv_heads), before[t] + 1);
	ref_step(seq, tok, pos, form == KVD_MOMENTS_MASS, want);
	if (compensation != KVD_COMPENSATION_NONE) {
		const struct kvd_moments_header *m;

		/* The correction was there to check: the daemon folded what it evicted. */
		ASSERT_OK(kvd_seq_moments(seq, 0, 0, &m));
		ASSERT_EQ(m->count, (uint64_t)pos - (uint64_t)before[0]);
	}
	ASSERT_OK(kvd_seq_unpin(seq));
	for (uint32_t i = 0; i < KVDLM_BYTE_VOCAB; i++) {
		err = fmax(err, fabs(lg[i] - want[i]));
		scale = fmax(scale, fabs(want[i]));
	}
	printf("step at position %u over %" PRId64 "..%" PRId64 " resident tokens per table%s, compensation %u "
	       "form %d: max |error| / %.3g = %.3g\n",
	       pos, before[0] + 1, before[tables - 1] + 1, uneven ? " (tables differ)" : "", compensation,
	       (int)form, scale, err / scale);
	ASSERT_TRUE(err / scale <= 1e-4);
	ASSERT_TRUE(before[0] + 1 < (int64_t)pos);
	s = kvdlm_session_free(s);
	kc = kvdlm_cache_free(kc);
	kvd_client_unref(admin);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(evicted_attention_by_position) {
	evicted_attention(KVD_COMPENSATION_NONE, KVD_MOMENTS_PLAIN);
}

TEST(evicted_attention_with_moments) {
	evicted_attention(KVD_COMPENSATION_MOMENTS, KVD_MOMENTS_PLAIN);
}

TEST(evicted_attention_with_moments_mass) {
	evicted_attention(KVD_COMPENSATION_MOMENTS, KVD_MOMENTS_MASS);
}

/* The command line under the same pressure: it finishes and says what was evicted. */
TEST(cli_evicts) {
	char cmd[2048], path[128], out[4096];
	_cleanup_(freep) uint32_t *tokens = NULL;
	uint32_t n = prompt_tokens(29, &tokens);
	struct fixture f;
	FILE *p;

	snprintf(path, sizeof(path), "/tmp/test-kvd-lm-prompt-%d.txt", (int)getpid());
	p = fopen(path, "we");
	ASSERT_NOT_NULL(p);
	for (uint32_t i = 1; i < n; i++)
		fputc((int)tokens[i], p);
	ASSERT_EQ(fclose(p), 0);
	fixture_start(&f, (const char *const[]){ POOL, CHUNK, "--budget=512KiB", "--grant-wait=10000", NULL });
	snprintf(cmd, sizeof(cmd),
	         "'%s' --model '%s' --prompt-file '%s' --max-new 48 --no-stop --threads %u --socket '%s' "
	         "--tenant cli --stats 2>&1 >/dev/null",
	         getenv("KVD_LM"), model_path, path, THREADS, f.socket);
	ASSERT_EQ(run_capture(cmd, out, sizeof(out)), 0);
	unlink(path);
	printf("%s", out);
	ASSERT_NOT_NULL(strstr(out, "tokens/s"));
	ASSERT_NOT_NULL(strstr(out, "the daemon evicted"));
	ASSERT_TRUE(fixture_status(&f, "cli", "evicted_tokens") > 0);
	ASSERT_TRUE(fixture_status(&f, "cli", "evicted_tokens") != UINT64_MAX);
	ASSERT_TRUE(fixture_status(&f, NULL, "used_bytes") <= 512u << 10);
	ASSERT_EQ(fixture_stop(&f), 0);
}
