/* SPDX-License-Identifier: MIT */
/*
 * ReST-KV parity: for each case under tests/data/restkv-parity/ (tensors and the token sets
 * the published implementation keeps, see its README), the restkv policy with the case's
 * params.json settings must keep EXACTLY the positions in keep.npy: at the kernel level
 * (optimised path on every SIMD path and several thread counts, and the reference) and
 * through `kvdctl score --json`.
 *
 * Environment: KVD_PARITY_DATA (the folder of the cases) and KVDCTL (the binary), set by
 * meson.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gram.h"
#include "ktest.h"
#include "npy.h"
#include "policy.h"

struct params {
	uint32_t heads, len, dim, c_out, capacity, window, kernel, gqa_groups, use_wo;
	double scale, alpha, tau;
	char pooling[32], metric[32];
};

/* The value text after "key": in a flat JSON object, or NULL. */
static const char *json_value(const char *json, const char *key) {
	char pat[64];
	const char *p;

	snprintf(pat, sizeof(pat), "\"%s\"", key);
	p = strstr(json, pat);
	if (!p)
		return NULL;
	p = strchr(p + strlen(pat), ':');
	if (!p)
		return NULL;
	for (p++; *p == ' ' || *p == '\n' || *p == '\t'; p++)
		;
	return p;
}

static double json_num(const char *json, const char *key) {
	const char *p = json_value(json, key);

	if (!p)
		test_fail(__FILE__, __LINE__, "params.json: no \"%s\"", key);
	if (strncmp(p, "true", 4) == 0)
		return 1;
	if (strncmp(p, "false", 5) == 0)
		return 0;
	return strtod(p, NULL);
}

static void json_str(const char *json, const char *key, char *out, size_t n) {
	const char *p = json_value(json, key), *e;

	if (!p || *p != '"')
		test_fail(__FILE__, __LINE__, "params.json: no string \"%s\"", key);
	e = strchr(p + 1, '"');
	ASSERT_NOT_NULL(e);
	snprintf(out, n, "%.*s", (int)(e - p - 1), p + 1);
}

static char *read_text(const char *path) {
	FILE *f = fopen(path, "re");
	char *buf = calloc(1, 1 << 16);
	size_t n;

	if (!f)
		test_fail(__FILE__, __LINE__, "cannot open %s", path);
	ASSERT_NOT_NULL(buf);
	n = fread(buf, 1, (1 << 16) - 1, f);
	buf[n] = 0;
	fclose(f);
	return buf;
}

static void load_params(const char *dir, struct params *p) {
	char path[4096], *json;

	snprintf(path, sizeof(path), "%s/params.json", dir);
	json = read_text(path);
	p->heads = (uint32_t)json_num(json, "heads");
	p->len = (uint32_t)json_num(json, "L");
	p->dim = (uint32_t)json_num(json, "d");
	p->c_out = (uint32_t)json_num(json, "c_out");
	p->capacity = (uint32_t)json_num(json, "capacity");
	p->window = (uint32_t)json_num(json, "window");
	p->kernel = (uint32_t)json_num(json, "kernel");
	p->gqa_groups = (uint32_t)json_num(json, "gqa_groups");
	p->use_wo = (uint32_t)json_num(json, "use_wo");
	p->scale = json_num(json, "scale");
	p->alpha = json_num(json, "alpha");
	p->tau = json_num(json, "tau");
	json_str(json, "pooling", p->pooling, sizeof(p->pooling));
	json_str(json, "metric_mode", p->metric, sizeof(p->metric));
	free(json);
}

static void open_npy(const char *dir, const char *name, uint32_t accept, struct kvd_npy *a) {
	char path[4096], err[KVD_NPY_ERROR_MAX];

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	if (kvd_npy_open(path, accept, KVD_NPY_ANY_NDIM, a, err, sizeof(err)) < 0)
		test_fail(__FILE__, __LINE__, "%s", err);
}

/* keep.npy as int64 [rows][capacity]. */
static int64_t expected(const struct kvd_npy *keep, size_t i) {
	return keep->dtype == KVD_NPY_I64 ? ((const int64_t *)keep->data)[i] :
					    ((const int32_t *)keep->data)[i];
}

/* Compares a keep set with keep.npy; prints every differing row. */
static int same_keep(const char *what, const struct kvd_keep *k, const struct kvd_npy *keep) {
	uint32_t rows = (uint32_t)keep->shape[0], cap = (uint32_t)keep->shape[1];
	int ok = 1;

	if (k->rows != rows) {
		fprintf(stderr, "%s: %u rows, expected %u\n", what, k->rows, rows);
		return 0;
	}
	for (uint32_t r = 0; r < rows; r++) {
		uint32_t n = k->off[r + 1] - k->off[r], bad = 0;

		if (n != cap) {
			fprintf(stderr, "%s: row %u keeps %u, expected %u\n", what, r, n, cap);
			ok = 0;
			continue;
		}
		for (uint32_t i = 0; i < cap; i++)
			bad += k->pos[k->off[r] + i] != expected(keep, (size_t)r * cap + i);
		if (bad) {
			fprintf(stderr, "%s: row %u: %u positions differ\n", what, r, bad);
			ok = 0;
		}
	}
	return ok;
}

static void policy_params(const struct params *p, struct kvd_policy_params *pp) {
	kvd_policy_params_default(KVD_POLICY_RESTKV, pp);
	pp->capacity = p->capacity;
	pp->per_query_head = 1; /* as published; the cases are MHA, where it changes nothing */
	pp->alpha = (float)p->alpha;
	pp->pooling = kvd_pool_mode_from_string(p->pooling);
	pp->kernel = p->kernel;
	pp->aws_scale = p->scale;
	pp->restkv.tau = (float)p->tau;
	pp->restkv.metric = kvd_restkv_metric_from_string(p->metric);
	ASSERT_GE((int)pp->pooling, 0);
	ASSERT_GE((int)pp->restkv.metric, 0);
}

static void kernel_level(const char *dir) {
	struct kvd_npy q = {}, k = {}, v = {}, wo = {}, keep = {};
	struct kvd_policy_params pp;
	struct kvd_attn_in in;
	struct params p;
	float *gram = NULL;
	char what[4400];

	load_params(dir, &p);
	open_npy(dir, "q.npy", KVD_NPY_ACCEPT_FLOAT, &q);
	open_npy(dir, "k.npy", KVD_NPY_ACCEPT_FLOAT, &k);
	open_npy(dir, "v.npy", KVD_NPY_ACCEPT_FLOAT, &v);
	open_npy(dir, "wo.npy", KVD_NPY_ACCEPT_FLOAT, &wo);
	open_npy(dir, "keep.npy", KVD_NPY_ACCEPT_INT, &keep);
	ASSERT_EQ(q.shape[0], p.heads);
	ASSERT_EQ(k.shape[1], p.len);
	ASSERT_EQ(keep.shape[1], p.capacity);
	ASSERT_EQ(p.gqa_groups, 1u);

	in = (struct kvd_attn_in){
		.dtype = q.dtype, .heads = p.heads, .kv_heads = (uint32_t)k.shape[0],
		.window = p.window, .len = p.len, .dim = p.dim,
		.scale = 1.0f / sqrtf((float)p.dim), .q = q.data, .k = k.data, .v = v.data,
	};
	kvd_attn_in_contiguous(&in);
	if (p.use_wo) {
		struct kvd_wo w = {
			.dtype = wo.dtype, .c_out = p.c_out, .heads = p.heads, .dim = p.dim,
			.w = wo.data, .row_stride = (size_t)p.heads * p.dim,
		};

		gram = kt_floats((size_t)p.heads * p.dim * p.dim);
		for (uint32_t h = 0; h < p.heads; h++)
			ASSERT_OK(kvd_gram(&w, h, 1, gram + (size_t)h * p.dim * p.dim));
	}
	policy_params(&p, &pp);

	KT_FOREACH_PATH(path)
		for (uint32_t threads = 1; threads <= 3; threads++) {
			struct kvd_keep *kp = NULL;

			pp.threads = threads;
			ASSERT_OK(kvd_policy_keep(&pp, &in, gram, NULL, &kp));
			snprintf(what, sizeof(what), "%s: %s, %u threads", dir, path, threads);
			ASSERT_TRUE(same_keep(what, kp, &keep));
			kvd_keep_free(kp);
		}
	{
		struct kvd_keep *kp = NULL;

		pp.reference = 1;
		ASSERT_OK(kvd_policy_keep(&pp, &in, gram, NULL, &kp));
		snprintf(what, sizeof(what), "%s: reference", dir);
		ASSERT_TRUE(same_keep(what, kp, &keep));
		kvd_keep_free(kp);
	}
	free(gram);
	kvd_npy_close(&q), kvd_npy_close(&k), kvd_npy_close(&v), kvd_npy_close(&wo);
	kvd_npy_close(&keep);
}

/* Parses the "keep" lists of kvdctl's JSON into a kvd_keep (rows of up to cap). */
static struct kvd_keep *parse_keep(const char *json, uint32_t rows, uint32_t cap) {
	struct kvd_keep *k = calloc(1, sizeof(*k));
	const char *p = strstr(json, "\"keep\"");
	uint32_t r = 0, n = 0;

	ASSERT_NOT_NULL(k);
	ASSERT_NOT_NULL(p);
	k->off = calloc(rows + 1, sizeof(uint32_t));
	k->pos = calloc((size_t)rows * cap + 1, sizeof(uint32_t));
	ASSERT_TRUE(k->off && k->pos);
	p = strchr(p, '[');
	ASSERT_NOT_NULL(p);
	for (p++; *p && *p != ']'; p++) {
		char *end;

		if (*p != '[')
			continue;
		ASSERT_LT(r, rows);
		for (p++; *p != ']';) {
			unsigned long v = strtoul(p, &end, 10);

			ASSERT_TRUE(end != p);
			ASSERT_LT(n, rows * cap);
			k->pos[n++] = (uint32_t)v;
			p = end;
			while (*p == ',' || *p == ' ')
				p++;
		}
		k->off[++r] = n;
	}
	k->rows = r;
	return k;
}

static void cli_level(const char *dir) {
	const char *kvdctl = getenv("KVDCTL");
	struct kvd_npy keep = {};
	struct kvd_keep *kp;
	struct params p;
	char cmd[32768], *out;
	FILE *f;
	size_t len = 0;
	int status;

	if (!kvdctl)
		test_fail(__FILE__, __LINE__, "KVDCTL is not set");
	load_params(dir, &p);
	open_npy(dir, "keep.npy", KVD_NPY_ACCEPT_INT, &keep);
	snprintf(cmd, sizeof(cmd),
		 "'%s' score --policy restkv --q '%s/q.npy' --k '%s/k.npy' --v '%s/v.npy' %s%s%s"
		 "--capacity %u --window %u --alpha %.17g --pooling %s --kernel %u --scale %.17g "
		 "--tau %.17g --metric %s --per-query-head --json",
		 kvdctl, dir, dir, dir, p.use_wo ? "--wo '" : "", p.use_wo ? dir : "",
		 p.use_wo ? "/wo.npy' " : "", p.capacity, p.window, p.alpha, p.pooling, p.kernel,
		 p.scale, p.tau, p.metric);
	f = popen(cmd, "re");
	ASSERT_NOT_NULL(f);
	out = malloc(1 << 22);
	ASSERT_NOT_NULL(out);
	while (len < (1 << 22) - 1) {
		size_t got = fread(out + len, 1, (1 << 22) - 1 - len, f);

		if (got == 0)
			break;
		len += got;
	}
	out[len] = 0;
	status = pclose(f);
	if (status != 0)
		test_fail(__FILE__, __LINE__, "%s: exit status %d", cmd, status);
	ASSERT_NOT_NULL(strstr(out, "\"settings\""));
	kp = parse_keep(out, (uint32_t)keep.shape[0], (uint32_t)keep.shape[1]);
	ASSERT_TRUE(same_keep("kvdctl score", kp, &keep));
	kvd_keep_free(kp);
	free(out);
	kvd_npy_close(&keep);
}

static const char *const cases[] = { "case-mha8-L2048", "case-drift-mha4-L2048" };

static void case_dir(const char *name, char *out, size_t n) {
	const char *root = getenv("KVD_PARITY_DATA");

	if (!root)
		test_fail(__FILE__, __LINE__, "KVD_PARITY_DATA is not set");
	snprintf(out, n, "%s/%s", root, name);
}

TEST(parity_kernels) {
	char dir[4096];

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		case_dir(cases[i], dir, sizeof(dir));
		kernel_level(dir);
	}
}

TEST(parity_kvdctl) {
	char dir[4096];

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		case_dir(cases[i], dir, sizeof(dir));
		cli_level(dir);
	}
}
