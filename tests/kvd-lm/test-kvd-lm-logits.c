/* SPDX-License-Identifier: MIT */
/*
 * The kvd-lm forward pass (eval/kvd-lm/forward.c) against torch: the logits at every
 * position of tests/data/kvd-lm/random-input.txt, which make-random.py computed with
 * kvdlm.py (and checked against an independent float64 numpy forward), and the 16 greedy
 * tokens after it. The same logits must come out of one prefill, of prefills in chunks of
 * 7 tokens, of token-by-token decoding, and with 1 or 3 threads. The trained model
 * (eval/kvd-lm/models/kvd-lm-small.kvdlm) is checked the same way on small-input.txt, and
 * the subword model (kvd-lm-base.kvdlm, with its tokenizer) on base-input.txt.
 *
 * Tolerance. The reference is fp32 torch; this engine is fp32 too but sums in other orders
 * (FMA contraction, blocked dot products, an online softmax, a polynomial exp). Such
 * differences are a few ulp per operation and stay near 1e-6 of the logits' scale through
 * the layers; a wrong RoPE angle, mask, GQA mapping or norm moves logits by 1e-2 or more.
 * So every logit must satisfy |got - ref| <= 1e-4 * max(1, max |ref|): two orders above
 * the rounding noise, two below any real mistake. Engine paths against each other (chunked,
 * decode, threads) must agree to 1e-5 of the same scale.
 *
 * Environment (set by meson): KVD_LM_DATA, the test data folder, and KVD_LM_MODELS, the
 * folder of trained models (eval/kvd-lm/models).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache.h"
#include "basic/macro.h"
#include "forward.h"
#include "model.h"
#include "npy.h"
#include "test.h"

#define TOL_REF 1e-4
#define TOL_SELF 1e-5
#define GREEDY_STEPS 16

static char *data_path(const char *env, const char *name) {
	const char *dir = getenv(env);
	char *p;

	if (!dir)
		test_fail(__FILE__, __LINE__, "%s is not set (run the tests through meson)", env);
	ASSERT_TRUE(asprintf(&p, "%s/%s", dir, name) > 0);
	return p;
}

struct ref {
	struct kvdlm_model *m;
	uint32_t *tokens;
	uint32_t n;
	struct kvd_npy logits; /* [n][vocab] */
	float scale;           /* max(1, max |logit|) */
};

static void ref_load(struct ref *r, const char *model, const char *input, const char *logits) {
	char err[KVDLM_ERROR_MAX];
	_cleanup_(freep) char *text = NULL;
	_cleanup_(kvdlm_tokenizer_freep) struct kvdlm_tokenizer *tok = NULL;
	size_t len;

	text = test_read_file(input, &len);
	*r = (struct ref){};
	if (kvdlm_model_load(model, &r->m, err, sizeof(err)) < 0)
		test_fail(__FILE__, __LINE__, "%s", err);
	if (kvdlm_tokenizer_for_model(model, r->m->cfg.vocab, &tok, err, sizeof(err)) < 0)
		test_fail(__FILE__, __LINE__, "%s", err);
	r->tokens = malloc((len + 1) * sizeof(uint32_t));
	ASSERT_NOT_NULL(r->tokens);
	r->tokens[0] = KVDLM_BOS;
	r->n = 1 + (uint32_t)kvdlm_tokenizer_encode(tok, text, len, r->tokens + 1);
	if (kvd_npy_open(logits, KVD_NPY_ACCEPT(KVD_NPY_F32), 2, &r->logits, err, sizeof(err)) < 0)
		test_fail(__FILE__, __LINE__, "%s", err);
	ASSERT_EQ(r->logits.shape[0], r->n);
	ASSERT_EQ(r->logits.shape[1], r->m->cfg.vocab);
	r->scale = 1.0f;
	for (uint64_t i = 0; i < r->logits.count; i++)
		r->scale = fmaxf(r->scale, fabsf(((const float *)r->logits.data)[i]));
}

static void ref_done(struct ref *r) {
	kvdlm_model_free(r->m);
	free(r->tokens);
	kvd_npy_close(&r->logits);
}

/* Logits at every position with the full cache: one prefill in chunks of `chunk`, or
 * (chunk 0) the first token prefilled and the rest decoded one by one. */
static float *run_logits(const struct ref *r, uint32_t chunk, uint32_t threads) {
	_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *c = NULL;
	_cleanup_(kvdlm_session_freep) struct kvdlm_session *s = NULL;
	float *out = malloc((size_t)r->n * r->m->cfg.vocab * sizeof(float));

	ASSERT_NOT_NULL(out);
	ASSERT_OK(kvdlm_cache_full_new(&r->m->cfg, r->n, &c));
	ASSERT_OK(kvdlm_session_new(r->m, c, &(struct kvdlm_session_opts){ threads, chunk ? chunk : 1 }, &s));
	if (chunk) {
		ASSERT_OK(kvdlm_prefill(s, r->tokens, r->n, KVDLM_LOGITS_ALL, out));
	} else {
		ASSERT_OK(kvdlm_prefill(s, r->tokens, 1, KVDLM_LOGITS_LAST, out));
		for (uint32_t i = 1; i < r->n; i++)
			ASSERT_OK(kvdlm_decode(s, r->tokens[i], out + (size_t)i * r->m->cfg.vocab));
	}
	ASSERT_EQ(kvdlm_session_position(s), r->n);
	/* The cache is full now: one more token is refused, and changes nothing. */
	ASSERT_ERRNO(kvdlm_decode(s, 0, NULL), -EFBIG);
	return out;
}

/* max |a - b| over n logits, divided by scale. */
static double max_err(const float *a, const float *b, size_t n, float scale) {
	double e = 0;

	for (size_t i = 0; i < n; i++)
		e = fmax(e, fabs((double)a[i] - (double)b[i]));
	return e / scale;
}

static void check_against(const struct ref *r, const float *got, const float *want, double tol, const char *what) {
	double e = max_err(got, want, (size_t)r->n * r->m->cfg.vocab, r->scale);

	printf("%s: %u positions, max |error| / %.3g = %.3g (tolerance %.0e)\n", what, r->n, (double)r->scale,
	       e, tol);
	if (!(e <= tol))
		test_fail(__FILE__, __LINE__, "%s: logits off by %.3g of their scale", what, e);
}

static void check_model(const char *model, const char *input, const char *logits) {
	struct ref r;
	_cleanup_(freep) float *one = NULL, *chunked = NULL, *decoded = NULL, *single = NULL;

	ref_load(&r, model, input, logits);
	one = run_logits(&r, KVDLM_CHUNK_MAX, 0);
	check_against(&r, one, r.logits.data, TOL_REF, "prefill, one chunk");
	chunked = run_logits(&r, 7, 0);
	check_against(&r, chunked, r.logits.data, TOL_REF, "prefill, chunks of 7");
	check_against(&r, chunked, one, TOL_SELF, "chunks of 7 vs one chunk");
	decoded = run_logits(&r, 0, 0);
	check_against(&r, decoded, r.logits.data, TOL_REF, "token by token");
	check_against(&r, decoded, one, TOL_SELF, "token by token vs one chunk");
	single = run_logits(&r, 7, 1);
	check_against(&r, single, chunked, TOL_SELF, "1 thread vs the default");
	ref_done(&r);
}

TEST(random_logits) {
	_cleanup_(freep) char *model = data_path("KVD_LM_DATA", "random.kvdlm");
	_cleanup_(freep) char *input = data_path("KVD_LM_DATA", "random-input.txt");
	_cleanup_(freep) char *logits = data_path("KVD_LM_DATA", "random-logits.npy");

	check_model(model, input, logits);
}

/* The greedy tokens after the input, as kvdlm.py produced them (no stop). */
static void check_greedy(const char *model, const char *input, const char *logits, const char *greedy) {
	_cleanup_(freep) char *want = NULL;
	_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *c = NULL;
	_cleanup_(kvdlm_session_freep) struct kvdlm_session *s = NULL;
	_cleanup_(freep) float *lg = NULL;
	char got[GREEDY_STEPS * 6 + 1] = "";
	struct ref r;

	want = test_read_file(greedy, NULL);
	ref_load(&r, model, input, logits);
	lg = malloc(r.m->cfg.vocab * sizeof(float));
	ASSERT_NOT_NULL(lg);
	ASSERT_OK(kvdlm_cache_full_new(&r.m->cfg, r.n + GREEDY_STEPS, &c));
	ASSERT_OK(kvdlm_session_new(r.m, c, NULL, &s));
	ASSERT_OK(kvdlm_prefill(s, r.tokens, r.n, KVDLM_LOGITS_LAST, lg));
	for (uint32_t i = 0; i < GREEDY_STEPS; i++) {
		uint32_t t = kvdlm_argmax(lg, r.m->cfg.vocab);

		snprintf(got + strlen(got), sizeof(got) - strlen(got), "%s%u", i ? " " : "", t);
		ASSERT_OK(kvdlm_decode(s, t, lg));
	}
	strcat(got, "\n");
	ASSERT_STREQ(got, want);
	ref_done(&r);
}

TEST(random_greedy) {
	_cleanup_(freep) char *model = data_path("KVD_LM_DATA", "random.kvdlm");
	_cleanup_(freep) char *input = data_path("KVD_LM_DATA", "random-input.txt");
	_cleanup_(freep) char *logits = data_path("KVD_LM_DATA", "random-logits.npy");
	_cleanup_(freep) char *greedy = data_path("KVD_LM_DATA", "random-greedy.txt");

	check_greedy(model, input, logits, greedy);
}

/*
 * A longer context decoded with more threads than (kv head, query tile) pairs: attention
 * splits the keys among threads and merges the partial softmaxes. The logits must match
 * one unsplit prefill over the same tokens.
 */
TEST(split_keys) {
	_cleanup_(freep) char *model = data_path("KVD_LM_DATA", "random.kvdlm");
	_cleanup_(freep) char *input = data_path("KVD_LM_DATA", "random-input.txt");
	_cleanup_(freep) char *logits = data_path("KVD_LM_DATA", "random-logits.npy");
	_cleanup_(freep) uint32_t *tokens = NULL;
	_cleanup_(freep) float *want = NULL, *got = NULL;
	const uint32_t times = 8, first = 600;
	struct ref r;
	uint32_t n;

	ref_load(&r, model, input, logits);
	n = 1 + (r.n - 1) * times;
	ASSERT_TRUE(n > first);
	tokens = malloc(n * sizeof(uint32_t));
	want = malloc((size_t)n * KVDLM_BYTE_VOCAB * sizeof(float));
	got = malloc((size_t)n * KVDLM_BYTE_VOCAB * sizeof(float));
	ASSERT_TRUE(tokens && want && got);
	tokens[0] = KVDLM_BOS;
	for (uint32_t i = 1; i < n; i++)
		tokens[i] = r.tokens[1 + (i - 1) % (r.n - 1)];
	for (int pass = 0; pass < 2; pass++) {
		_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *c = NULL;
		_cleanup_(kvdlm_session_freep) struct kvdlm_session *s = NULL;
		float *out = pass ? got : want;

		ASSERT_OK(kvdlm_cache_full_new(&r.m->cfg, n, &c));
		ASSERT_OK(kvdlm_session_new(r.m, c, &(struct kvdlm_session_opts){ pass ? 8 : 1, KVDLM_CHUNK_MAX }, &s));
		/* Pass 0: one prefill. Pass 1: a prefill, then decoding over 600+ keys, where 2
		 * kv heads x 1 tile leave 8 threads to split the keys among. */
		ASSERT_OK(kvdlm_prefill(s, tokens, pass ? first : n, KVDLM_LOGITS_ALL, out));
		for (uint32_t i = first; pass && i < n; i++)
			ASSERT_OK(kvdlm_decode(s, tokens[i], out + (size_t)i * KVDLM_BYTE_VOCAB));
	}
	printf("split keys: ");
	r.n = n;
	check_against(&r, got, want, TOL_SELF, "decoding with split keys vs one prefill");
	ref_done(&r);
}

/* The trained model (eval/kvd-lm/models) on a multikey prompt of the tuning seeds: its
 * logits, and its greedy answer (" 9949585\n", the right one, then more text). */
TEST(small_logits) {
	_cleanup_(freep) char *model = data_path("KVD_LM_MODELS", "kvd-lm-small.kvdlm");
	_cleanup_(freep) char *input = data_path("KVD_LM_DATA", "small-input.txt");
	_cleanup_(freep) char *logits = data_path("KVD_LM_DATA", "small-logits.npy");

	check_model(model, input, logits);
}

TEST(small_greedy) {
	_cleanup_(freep) char *model = data_path("KVD_LM_MODELS", "kvd-lm-small.kvdlm");
	_cleanup_(freep) char *input = data_path("KVD_LM_DATA", "small-input.txt");
	_cleanup_(freep) char *logits = data_path("KVD_LM_DATA", "small-logits.npy");
	_cleanup_(freep) char *greedy = data_path("KVD_LM_DATA", "small-greedy.txt");

	check_greedy(model, input, logits, greedy);
}

/* The subword model (kvd-lm-base, its tokenizer beside it) on a short niah-like prompt: its
 * logits over 3,072 tokens, and its greedy answer (" 994", "958", "5", the right one). Not
 * in the sanitizer build, where the small model stands for the trained ones. */
TEST(base_logits) {
	_cleanup_(freep) char *model = data_path("KVD_LM_MODELS", "kvd-lm-base.kvdlm");
	_cleanup_(freep) char *input = data_path("KVD_LM_DATA", "base-input.txt");
	_cleanup_(freep) char *logits = data_path("KVD_LM_DATA", "base-logits.npy");

#ifdef KVD_TEST_SANITIZED
	TEST_SKIP("the base model stays out of the sanitizer build");
#endif
	check_model(model, input, logits);
}

TEST(base_greedy) {
	_cleanup_(freep) char *model = data_path("KVD_LM_MODELS", "kvd-lm-base.kvdlm");
	_cleanup_(freep) char *input = data_path("KVD_LM_DATA", "base-input.txt");
	_cleanup_(freep) char *logits = data_path("KVD_LM_DATA", "base-logits.npy");
	_cleanup_(freep) char *greedy = data_path("KVD_LM_DATA", "base-greedy.txt");

#ifdef KVD_TEST_SANITIZED
	TEST_SKIP("the base model stays out of the sanitizer build");
#endif
	check_greedy(model, input, logits, greedy);
}

/* Arguments the API refuses. */
TEST(bad_arguments) {
	_cleanup_(freep) char *model = data_path("KVD_LM_DATA", "random.kvdlm");
	_cleanup_(kvdlm_model_freep) struct kvdlm_model *m = NULL;
	_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *c = NULL;
	_cleanup_(kvdlm_session_freep) struct kvdlm_session *s = NULL;
	struct kvdlm_cache *tmp = NULL;
	uint32_t tok[2] = { KVDLM_BOS, KVDLM_BYTE_VOCAB };
	float lg[KVDLM_BYTE_VOCAB];

	ASSERT_OK(kvdlm_model_load(model, &m, NULL, 0));
	ASSERT_ERRNO(kvdlm_cache_full_new(&m->cfg, 0, &tmp), -EINVAL);
	ASSERT_ERRNO(kvdlm_cache_full_new(&m->cfg, KVDLM_FULL_MAX_TOKENS + 1, &tmp), -EINVAL);
	ASSERT_OK(kvdlm_cache_full_new(&m->cfg, 8, &c));
	ASSERT_ERRNO(kvdlm_session_new(m, c, &(struct kvdlm_session_opts){ .chunk = KVDLM_CHUNK_MAX + 1 }, &s),
	             -EINVAL);
	ASSERT_ERRNO(kvdlm_session_new(m, c, &(struct kvdlm_session_opts){ .threads = KVDLM_THREADS_MAX + 1 },
	                               &s),
	             -EINVAL);
	ASSERT_OK(kvdlm_session_new(m, c, NULL, &s));
	ASSERT_ERRNO(kvdlm_prefill(s, tok, 0, KVDLM_LOGITS_NONE, NULL), -EINVAL);
	ASSERT_ERRNO(kvdlm_prefill(s, tok, 1, KVDLM_LOGITS_LAST, NULL), -EINVAL);
	ASSERT_ERRNO(kvdlm_prefill(s, tok, 2, KVDLM_LOGITS_NONE, NULL), -EINVAL);
	ASSERT_ERRNO(kvdlm_decode(s, KVDLM_BYTE_VOCAB, lg), -EINVAL);
	/* Nothing was appended by the refusals. */
	ASSERT_EQ(kvdlm_session_position(s), 0u);
	ASSERT_OK(kvdlm_prefill(s, tok, 1, KVDLM_LOGITS_LAST, lg));
	ASSERT_EQ(kvdlm_session_position(s), 1u);
	ASSERT_ERRNO(kvdlm_prefill(s, (const uint32_t[8]){}, 8, KVDLM_LOGITS_NONE, NULL), -EFBIG);
	ASSERT_EQ(kvdlm_session_position(s), 1u);
}
