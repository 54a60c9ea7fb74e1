/* SPDX-License-Identifier: MIT */
/*
 * kvd-lm with the shipped IndexMem weights (eval/kvd-lm/models/kvd-lm-small.kvdim) and its
 * KV cache in a real daemon (integration suite).
 *
 * The loader takes the shipped file for the shipped model and refuses a corrupted copy
 * and another model's shape. With an indexer and latent memory but a budget that never
 * runs short, the kvd cache gives bit for bit the full cache's logits (index keys take no
 * part in attention, and an empty latent memory adds nothing); the index keys in the pool
 * are the engine's: layer 0's attention input is the normed token embedding, so they are
 * recomputed here with the reference kernel. With a small budget and policy indexmem,
 * rounds evict while the engine runs, the latent blocks hold exactly the evicted tokens,
 * and generation goes on with their readout.
 *
 * Environment (set by meson): KVD_DAEMON, KVD_LM_MODELS.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache.h"
#include "basic/macro.h"
#include "fixture.h"
#include "forward.h"
#include "kvdlm-indexmem.h"
#include "model.h"
#include "test.h"

#define POOL "--pool-size=64MiB"
#define CHUNK "--chunk-size=256KiB"
#define WINDOW 32u
#define THREADS 2u
#define STEPS 8u

static struct kvdlm_model *model;
static struct kvdlm_indexmem *im;
static char im_path[512];

static void cleanup(void) {
	im = kvdlm_indexmem_free(im);
	model = kvdlm_model_free(model);
}

int test_setup(void) {
	const char *dir = getenv("KVD_LM_MODELS");
	char path[512], err[KVDLM_ERROR_MAX];

	if (!dir) {
		fprintf(stderr, "KVD_LM_MODELS is not set (run the tests through meson)\n");
		return -1;
	}
	snprintf(path, sizeof(path), "%s/kvd-lm-small.kvdlm", dir);
	snprintf(im_path, sizeof(im_path), "%s/kvd-lm-small.kvdim", dir);
	if (kvdlm_model_load(path, &model, err, sizeof(err)) < 0 ||
	    kvdlm_indexmem_load(im_path, &model->cfg, &im, err, sizeof(err)) < 0) {
		fprintf(stderr, "%s\n", err);
		return -1;
	}
	atexit(cleanup);
	return 0;
}

TEST(loader_checks_the_file) {
	struct kvdlm_indexmem *x = NULL;
	struct kvdlm_config other = model->cfg;
	char err[KVDLM_ERROR_MAX], tmp[] = "/tmp/kvdim-XXXXXX";
	FILE *in = fopen(im_path, "rb"), *out;
	int fd = mkstemp(tmp), c;
	long at = 0;

	ASSERT_EQ(im->layers, model->cfg.layers);
	ASSERT_TRUE(im->index_heads >= 1 && im->index_dim >= 1);
	other.layers++;
	ASSERT_ERRNO(kvdlm_indexmem_load(im_path, &other, &x, err, sizeof(err)), -EBADMSG);
	ASSERT_TRUE(strstr(err, "another model shape") != NULL);
	/* One flipped bit in the payload. */
	ASSERT_NOT_NULL(in);
	ASSERT_TRUE(fd >= 0);
	out = fdopen(fd, "wb");
	ASSERT_NOT_NULL(out);
	while ((c = fgetc(in)) != EOF)
		fputc(at++ == 1000 ? c ^ 1 : c, out);
	fclose(in);
	fclose(out);
	ASSERT_ERRNO(kvdlm_indexmem_load(tmp, &model->cfg, &x, err, sizeof(err)), -EBADMSG);
	ASSERT_TRUE(strstr(err, "CRC") != NULL);
	unlink(tmp);
	ASSERT_NULL(x);
}

static uint32_t prompt(uint32_t *tokens, uint32_t n) {
	static const char text[] = "The special magic number for qwerty is 1234567. The quick brown "
	                           "fox jumps over the lazy dog while the magic number waits. ";

	tokens[0] = KVDLM_BOS;
	for (uint32_t i = 1; i < n; i++)
		tokens[i] = (uint8_t)text[(i - 1) % (sizeof(text) - 1)];
	return n;
}

/* Prefills tokens over c and decodes STEPS greedy tokens; the logits of every step. */
static void run(struct kvdlm_cache *c, const uint32_t *tokens, uint32_t n, float *logits) {
	_cleanup_(kvdlm_session_freep) struct kvdlm_session *s = NULL;

	ASSERT_OK(kvdlm_session_new(model, c, &(struct kvdlm_session_opts){ THREADS, 64, im }, &s));
	ASSERT_OK(kvdlm_prefill(s, tokens, n, KVDLM_LOGITS_LAST, logits));
	for (uint32_t i = 0; i < STEPS; i++)
		ASSERT_OK(kvdlm_decode(s, kvdlm_argmax(logits + (size_t)i * KVDLM_BYTE_VOCAB, KVDLM_BYTE_VOCAB),
		                       logits + (size_t)(i + 1) * KVDLM_BYTE_VOCAB));
}

static const kvd_index_spec *spec(void) {
	static kvd_index_spec ix;

	ix = (kvd_index_spec){ .heads = im->index_heads, .dim = im->index_dim };
	return &ix;
}

TEST(nothing_evicted_is_the_full_cache) {
	uint32_t n = 300, tokens[300], D = model->cfg.dim, I = im->index_dim;
	float *full = malloc((STEPS + 1) * KVDLM_BYTE_VOCAB * sizeof(float));
	float *kvd = malloc((STEPS + 1) * KVDLM_BYTE_VOCAB * sizeof(float));
	float *a = malloc(D * sizeof(float)), *iq = malloc((size_t)im->index_heads * I * sizeof(float));
	float *ik = malloc(I * sizeof(float));
	struct kvdlm_kvd_model km;
	struct fixture f;
	kvd_client *c;

	ASSERT_TRUE(full && kvd && a && iq && ik);
	prompt(tokens, n);
	{
		_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *fc = NULL;

		ASSERT_OK(kvdlm_cache_full_new(&model->cfg, n + STEPS + 1, &fc));
		run(fc, tokens, n, full);
	}
	fixture_setup(&f, "[tenant lm]\npolicy = indexmem\n", false);
	fixture_launch(&f, (const char *const[]){ POOL, CHUNK, NULL });
	c = fixture_connect(&f, "lm");
	ASSERT_OK(kvdlm_kvd_register_indexed(c, model, "kvd-lm-test", KVD_UNIT_HEAD_TOKEN, WINDOW,
	                                     KVD_COMPENSATION_LATENT, spec(), &km));
	{
		_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *kc = NULL;
		kvd_seq *seq;

		ASSERT_OK(kvdlm_cache_kvd_new(&km, &model->cfg, n + STEPS + 1, &kc));
		run(kc, tokens, n, kvd);
		seq = kvdlm_cache_seq(kc);
		ASSERT_OK(kvd_seq_pin(seq));
		/* Layer 0's index keys: the indexer of the normed embedding. */
		for (uint32_t h = 0; h < model->cfg.kv_heads; h++)
			for (uint32_t j = 0; j < n; j += 7) {
				const float *e = model->tok_emb + (size_t)tokens[j] * D;
				double ss = 0;
				float *got;

				for (uint32_t i = 0; i < D; i++)
					ss += (double)e[i] * e[i];
				for (uint32_t i = 0; i < D; i++)
					a[i] = e[i] / sqrtf((float)(ss / D) + model->cfg.norm_eps) *
					       model->layers[0].attn_norm[i];
				ASSERT_OK(kvd_indexer_project_ref(&im->indexer[0], a, D, 1, iq, ik));
				ASSERT_OK(kvd_seq_index_key(seq, 0, h, j, (void **)&got));
				for (uint32_t i = 0; i < I; i++)
					ASSERT_TRUE(fabsf(got[i] - ik[i]) < 1e-4f);
			}
		ASSERT_OK(kvd_seq_unpin(seq));
	}
	ASSERT_TRUE(memcmp(full, kvd, (STEPS + 1) * KVDLM_BYTE_VOCAB * sizeof(float)) == 0);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
	free(full), free(kvd), free(a), free(iq), free(ik);
}

TEST(indexmem_evicts_and_the_latent_memory_holds_it) {
	uint32_t n = 600, tokens[600];
	float *logits = malloc((STEPS + 1) * KVDLM_BYTE_VOCAB * sizeof(float));
	struct kvdlm_kvd_model km;
	struct fixture f;
	kvd_client *c;
	_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *kc = NULL;
	kvd_seq *seq;
	uint64_t evicted = 0;

	ASSERT_NOT_NULL(logits);
	prompt(tokens, n);
	fixture_setup(&f, "[tenant lm]\npolicy = indexmem\n", false);
	/* Room for about a third of the context's K/V: rounds run during the prefill. */
	fixture_launch(&f, (const char *const[]){ POOL, CHUNK, "--budget=1MiB", "--grant-wait=10000",
	                                          NULL });
	c = fixture_connect(&f, "lm");
	ASSERT_OK(kvdlm_kvd_register_indexed(c, model, "kvd-lm-test", KVD_UNIT_HEAD_TOKEN, WINDOW,
	                                     KVD_COMPENSATION_LATENT, spec(), &km));
	ASSERT_OK(kvdlm_cache_kvd_new(&km, &model->cfg, n + STEPS + 1, &kc));
	run(kc, tokens, n, logits);
	ASSERT_TRUE(fixture_status(&f, "lm", "evicted_tokens") > 0);
	for (uint32_t i = 0; i < (STEPS + 1) * KVDLM_BYTE_VOCAB; i++)
		ASSERT_TRUE(isfinite(logits[i]));
	seq = kvdlm_cache_seq(kc);
	ASSERT_OK(kvd_seq_pin(seq));
	for (uint32_t l = 0; l < model->cfg.layers; l++)
		for (uint32_t h = 0; h < model->cfg.kv_heads; h++) {
			const struct kvd_latent_header *lat;
			int64_t resident = kvd_seq_tokens(seq, l, h);

			ASSERT_OK(kvd_seq_latent(seq, l, h, &lat));
			ASSERT_EQ(lat->count, (uint64_t)(n + STEPS - resident));
			evicted += lat->count;
		}
	/* Still pinned: a round that ends now leaves its plan waiting, counted at the unpin. */
	ASSERT_EQ(evicted, fixture_status(&f, "lm", "evicted_tokens"));
	ASSERT_OK(kvd_seq_unpin(seq));
	kc = kvdlm_cache_free(kc);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
	free(logits);
}
