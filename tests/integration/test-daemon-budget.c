/* SPDX-License-Identifier: MIT */
/*
 * The node budget and tenant caps hold: grants past them are refused and succeed again
 * once memory is given back; what kvdctl reports is what a load did.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fixture.h"
#include "test.h"

#define MiB (UINT64_C(1) << 20)

/* 8 KiB blocks of 16 tokens, one table: 2048 tokens fill one 1 MiB chunk exactly. */
static const kvd_model_spec one_chunk = { "c", 1, 2, 2, 64, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER };

static kvd_seq *chunk_seq(kvd_client *c, int m, int expect) {
	kvd_seq *s;

	ASSERT_OK(kvd_seq_open(c, m, 2048, &s));
	ASSERT_EQ(kvd_seq_grow(s, 2048), expect);
	return s;
}

TEST(budget_refuses_and_recovers) {
	static const char *const args[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB",
		                            "--budget", "4MiB", NULL };
	struct fixture f;
	kvd_client *c, *admin;
	kvd_seq *s[5];
	int m;

	fixture_start(&f, args);
	c = fixture_connect(&f, "a");
	admin = fixture_connect(&f, NULL);
	m = kvd_model_register(c, &one_chunk);
	ASSERT_OK(m);
	for (int i = 0; i < 4; i++)
		s[i] = chunk_seq(c, m, 0);
	s[4] = chunk_seq(c, m, -ENOSPC);
	ASSERT_TRUE(strstr(kvd_client_last_error(c), "budget"));
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 4 * MiB);
	ASSERT_EQ(fixture_status(&f, NULL, "block_bytes"), 4 * MiB);
	ASSERT_EQ(fixture_status(&f, NULL, "grants_refused"), 1u);
	/* The failed grow left nothing behind. */
	ASSERT_EQ(kvd_seq_tokens(s[4], 0, 0), 0);

	ASSERT_OK(kvd_seq_release(s[0]));
	/* Two chunks with room for one: the grow takes it, fails on the second and gives it
	 * back; the refusal names the budget, which was what it lacked. */
	ASSERT_OK(kvd_seq_open(c, m, 4096, &s[0]));
	ASSERT_EQ(kvd_seq_grow(s[0], 4096), -ENOSPC);
	ASSERT_TRUE(strstr(kvd_client_last_error(c), "node budget exhausted"));
	ASSERT_OK(kvd_seq_release(s[0]));
	ASSERT_OK(kvd_seq_grow(s[4], 2048));
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 4 * MiB);

	/* Lowering the budget below use is allowed; nothing new is granted until use drops
	 * below it. */
	ASSERT_OK(kvd_budget_set(admin, 2 * MiB));
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 2 * MiB);
	ASSERT_OK(kvd_seq_release(s[1]));
	ASSERT_OK(kvd_seq_release(s[2]));
	s[0] = chunk_seq(c, m, -ENOSPC);
	ASSERT_OK(kvd_budget_set(admin, 3 * MiB));
	ASSERT_OK(kvd_seq_grow(s[0], 2048));
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 3 * MiB);

	for (int i = 0; i < 5; i++)
		if (i != 1 && i != 2)
			ASSERT_OK(kvd_seq_release(s[i]));
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 0u);
	kvd_client_unref(c);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(tenant_max_enforced) {
	static const char *const args[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB", NULL };
	struct fixture f;
	kvd_client *capped, *other, *admin;
	kvd_seq *s[3], *o[3];
	int mc, mo;

	fixture_start(&f, args);
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_tenant_set(admin, "capped", KVD_TENANT_KEEP, 2 * MiB, 0));
	capped = fixture_connect(&f, "capped");
	other = fixture_connect(&f, "other");
	mc = kvd_model_register(capped, &one_chunk);
	mo = kvd_model_register(other, &one_chunk);
	ASSERT_OK(mc);
	ASSERT_OK(mo);
	s[0] = chunk_seq(capped, mc, 0);
	s[1] = chunk_seq(capped, mc, 0);
	s[2] = chunk_seq(capped, mc, -EDQUOT);
	ASSERT_TRUE(strstr(kvd_client_last_error(capped), "max"));
	ASSERT_EQ(fixture_status(&f, "capped", "used_bytes"), 2 * MiB);
	ASSERT_EQ(fixture_status(&f, "capped", "max_bytes"), 2 * MiB);
	/* Another tenant is not limited by it. */
	for (int i = 0; i < 3; i++)
		o[i] = chunk_seq(other, mo, 0);

	/* Lifting the cap lets the refused grow through. */
	ASSERT_OK(kvd_tenant_set(admin, "capped", KVD_TENANT_KEEP, KVD_TENANT_NO_CAP, 0));
	ASSERT_EQ(fixture_status(&f, "capped", "max_bytes"), UINT64_MAX);
	ASSERT_OK(kvd_seq_grow(s[2], 2048));

	/* A cap below use is allowed; it stops growth until use drops. */
	ASSERT_OK(kvd_tenant_set(admin, "capped", 1 * MiB, 1 * MiB, 5));
	ASSERT_OK(kvd_seq_release(s[2]));
	ASSERT_OK(kvd_seq_release(s[1]));
	s[1] = chunk_seq(capped, mc, -EDQUOT);
	ASSERT_EQ(fixture_status(&f, "capped", "weight"), 5u);
	ASSERT_EQ(fixture_status(&f, "capped", "min_bytes"), 1 * MiB);

	ASSERT_OK(kvd_seq_release(s[0]));
	ASSERT_OK(kvd_seq_release(s[1]));
	for (int i = 0; i < 3; i++)
		ASSERT_OK(kvd_seq_release(o[i]));
	kvd_client_unref(capped);
	kvd_client_unref(other);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Reads kvdctl's output into a string (free it). */
static char *kvdctl(struct fixture *f, const char *args) {
	char cmd[512], *out = calloc(1, 65536);
	size_t n = 0;
	FILE *p;

	ASSERT_TRUE(getenv("KVDCTL"));
	snprintf(cmd, sizeof(cmd), "%s --socket %s %s", getenv("KVDCTL"), f->socket, args);
	p = popen(cmd, "re");
	ASSERT_TRUE(p && out);
	n = fread(out, 1, 65535, p);
	ASSERT_EQ(pclose(p), 0);
	out[n] = 0;
	return out;
}

/* The number after "key": in json, starting at from; fails when absent. */
static uint64_t json_u64(const char *from, const char *key) {
	char pat[64];
	const char *p;

	snprintf(pat, sizeof(pat), "\"%s\":", key);
	p = strstr(from, pat);
	if (!p)
		test_fail(__FILE__, __LINE__, "no %s in kvdctl's JSON", key);
	return strtoull(p + strlen(pat), NULL, 10);
}

static const char *json_tenant(const char *json, const char *name) {
	char pat[80];
	const char *p;

	snprintf(pat, sizeof(pat), "\"name\": \"%s\"", name);
	p = strstr(json, pat);
	if (!p)
		test_fail(__FILE__, __LINE__, "no tenant %s in kvdctl's JSON", name);
	return p;
}

TEST(status_json_matches_load) {
	static const char *const args[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB", NULL };
	/* per_head: 2 x 32 x 32 x bf16 = 4 KiB blocks, 4 tables. */
	static const kvd_model_spec mx = { "x", 2, 4, 2, 32, KVD_DTYPE_BF16, 32, KVD_LAYOUT_PER_HEAD };
	/* per_layer: 2 x 4 heads x 8 x 16 x f32 = 4 KiB blocks, 3 tables. */
	static const kvd_model_spec my = { "y", 3, 8, 4, 16, KVD_DTYPE_F32, 8, KVD_LAYOUT_PER_LAYER };
	struct fixture f;
	kvd_client *x, *y;
	kvd_seq *sx, *sy[2];
	char *json, *text;
	const char *t;
	int m;

	fixture_start(&f, args);
	x = fixture_connect(&f, "x");
	y = fixture_connect(&f, "y");
	m = kvd_model_register(x, &mx);
	ASSERT_OK(kvd_seq_open(x, m, 1000, &sx));
	ASSERT_OK(kvd_seq_grow(sx, 100)); /* 4 blocks x 4 tables */
	m = kvd_model_register(y, &my);
	for (int i = 0; i < 2; i++) {
		ASSERT_OK(kvd_seq_open(y, m, 1000, &sy[i]));
		ASSERT_OK(kvd_seq_grow(sy[i], 50)); /* 7 blocks x 3 tables */
	}

	json = kvdctl(&f, "status --json");
	ASSERT_EQ(json_u64(json, "pool_bytes"), 16 * MiB);
	ASSERT_EQ(json_u64(json, "budget_bytes"), 16 * MiB);
	ASSERT_EQ(json_u64(json, "chunk_bytes"), 1 * MiB);
	ASSERT_EQ(json_u64(json, "used_bytes"), 2 * MiB);
	ASSERT_EQ(json_u64(json, "block_bytes"), 16 * 4096 + 2 * 21 * 4096);
	t = json_tenant(json, "x");
	ASSERT_EQ(json_u64(t, "used_bytes"), 1 * MiB);
	ASSERT_EQ(json_u64(t, "block_bytes"), 16 * 4096);
	ASSERT_EQ(json_u64(t, "sequences"), 1u);
	ASSERT_EQ(json_u64(t, "connections"), 1u);
	ASSERT_EQ(json_u64(t, "weight"), 1u);
	ASSERT_EQ(json_u64(t, "min_bytes"), 0u);
	t = json_tenant(json, "y");
	ASSERT_EQ(json_u64(t, "used_bytes"), 1 * MiB);
	ASSERT_EQ(json_u64(t, "block_bytes"), 2 * 21 * 4096);
	ASSERT_EQ(json_u64(t, "sequences"), 2u);
	ASSERT_EQ(json_u64(t, "connections"), 1u);
	free(json);

	/* The table for people names the same tenants. */
	text = kvdctl(&f, "status");
	ASSERT_TRUE(strstr(text, "\nx "));
	ASSERT_TRUE(strstr(text, "\ny "));
	free(text);

	/* kvdctl changes what status then reports. */
	free(kvdctl(&f, "budget set 8MiB"));
	json = kvdctl(&f, "status --json");
	ASSERT_EQ(json_u64(json, "budget_bytes"), 8 * MiB);
	free(json);

	ASSERT_OK(kvd_seq_release(sx));
	for (int i = 0; i < 2; i++)
		ASSERT_OK(kvd_seq_release(sy[i]));
	kvd_client_unref(x);
	kvd_client_unref(y);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(sequences_per_tenant_bounded) {
	static const char *const args[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB",
		                            "--max-seqs-per-tenant", "3", NULL };
	struct fixture f;
	kvd_client *a, *b, *other;
	kvd_seq *s[4], *o;
	int ma, mb, mo;

	fixture_start(&f, args);
	/* Two processes' worth of connections of one tenant share the limit. */
	a = fixture_connect(&f, "many");
	b = fixture_connect(&f, "many");
	other = fixture_connect(&f, "other");
	ma = kvd_model_register(a, &one_chunk);
	mb = kvd_model_register(b, &one_chunk);
	mo = kvd_model_register(other, &one_chunk);
	ASSERT_OK(ma);
	ASSERT_OK(mb);
	ASSERT_OK(mo);
	ASSERT_OK(kvd_seq_open(a, ma, 16, &s[0]));
	ASSERT_OK(kvd_seq_open(a, ma, 16, &s[1]));
	ASSERT_OK(kvd_seq_open(b, mb, 16, &s[2]));
	ASSERT_EQ(kvd_seq_open(b, mb, 16, &s[3]), -EMFILE);
	ASSERT_TRUE(strstr(kvd_client_last_error(b), "max-seqs-per-tenant"));
	/* Another tenant is not limited by it, and a release makes room. */
	ASSERT_OK(kvd_seq_open(other, mo, 16, &o));
	ASSERT_OK(kvd_seq_release(s[0]));
	ASSERT_OK(kvd_seq_open(b, mb, 16, &s[3]));
	for (int i = 1; i < 4; i++)
		ASSERT_OK(kvd_seq_release(s[i]));
	ASSERT_OK(kvd_seq_release(o));
	kvd_client_unref(a);
	kvd_client_unref(b);
	kvd_client_unref(other);
	ASSERT_EQ(fixture_stop(&f), 0);
}
