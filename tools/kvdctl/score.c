/* SPDX-License-Identifier: MIT */
/*
 * kvdctl score: runs one eviction policy (kernels/policy.h) on one layer's captured
 * tensors, read from numpy .npy files, and prints the positions each head (or the layer)
 * keeps. Offline: it needs no daemon. q is [heads, window, d] (the last window queries,
 * post-RoPE, oldest first), k and v are [kv_heads, L, d], wo is [c_out, heads*d] (HF's
 * o_proj.weight); float32 or float16.
 *
 * Exit codes as the rest of kvdctl: 0 success, 1 a file could not be used (unreadable,
 * not .npy, wrong shape) or scoring failed, 2 usage.
 */

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "basic/number.h"
#include "dtype.h"
#include "gram.h"
#include "npy.h"
#include "policy.h"
#include "score-cmd.h"

enum {
	EXIT_OK = 0,
	EXIT_FAIL = 1,
	EXIT_USAGE = 2,
};

static void help(void) {
	printf("Usage: kvdctl score --policy P --q q.npy --k k.npy [--v v.npy] [--wo wo.npy]\n"
	       "                    --capacity N --window W [OPTIONS]\n"
	       "\n"
	       "Score one layer's captured tensors offline with an eviction policy and print the\n"
	       "positions each kv head (or the layer) keeps, ascending, the window included.\n"
	       "\n"
	       "Tensors (numpy .npy, float32 or float16, C order):\n"
	       "  --q FILE            Window queries [heads, window, d], post-RoPE, oldest first\n"
	       "  --k FILE            Keys [kv_heads, L, d]\n"
	       "  --v FILE            Values [kv_heads, L, d] (needed by restkv, laprox, kvd,\n"
	       "                      kvd-mi, expected_attention)\n"
	       "  --wo FILE           Output projection [c_out, heads*d] (HF o_proj.weight); without\n"
	       "                      it restkv/laprox/kvd/kvd-mi use value-space norms\n"
	       "\n"
	       "Policy:\n"
	       "  --policy P          full, streamingllm, h2o, snapkv, pyramidkv, adakv, tova, knorm,\n"
	       "                      keydiff, expected_attention, restkv, laprox, kvd, kvd-mi\n"
	       "                      (required); offline kvd-mi has no moments and ranks as kvd\n"
	       "                      h2o sums the attention of the --q (window) queries only; not\n"
	       "                      prompt-wide H2O: the window is kept, so --window L keeps all\n"
	       "  --capacity N        Tokens kept per head (or layer), window included (required)\n"
	       "  --window W          Observation window; must equal q's second dimension (required)\n"
	       "  --granularity G     head (one keep set per kv head) or layer (default: head)\n"
	       "  --per-query-head    One keep set per query head, as published ReST-KV stores it\n"
	       "                      (default: per kv head, GQA groups aggregated)\n"
	       "  --alpha A           Window EMA weight of the newest query (default: 0.3)\n"
	       "  --temporal M        ema, mean, last or sum over the window queries (default: the\n"
	       "                      policy's: ema for restkv/kvd, sum for snapkv/pyramidkv, mean\n"
	       "                      for adakv)\n"
	       "  --pooling P         none, avg, max or adaptive (default: the policy's: adaptive for\n"
	       "                      restkv/kvd, avg for snapkv/pyramidkv, max for adakv, none for\n"
	       "                      laprox)\n"
	       "  --kernel K          Pooling kernel, odd; the minimum kernel of adaptive pooling\n"
	       "                      (default: 5; 7 for adakv)\n"
	       "  --scale S           Adaptive pooling scale, in positions (default: 2000)\n"
	       "  --tau T             ReST-KV norm exponent, after mode (default: 1)\n"
	       "  --metric M          ReST-KV metric mode, after or before (default: after)\n"
	       "  --use-norm          ReST-KV before mode: relative error (default: off)\n"
	       "  --laprox-diagonal   laprox: sum of per-head costs instead of the GQA-joint form\n"
	       "  --layer-weight W    laprox/kvd: per-layer weight lambda of the shares (default: 1)\n"
	       "  --layer I           pyramidkv: this layer's index (default: 0)\n"
	       "  --layers N          pyramidkv: the model's number of layers (default: 1)\n"
	       "  --softmax-scale S   Attention temperature (default: 1/sqrt(d))\n"
	       "  --threads N         Scoring threads, 0 for one per CPU (default: 0)\n"
	       "  --reference         Use the plain-C reference kernels (slow; for checks)\n"
	       "\n"
	       "Output:\n"
	       "  --json              Print {\"keep\": [[...], ...], \"settings\": {...}}\n"
	       "  -h --help           Show this help and exit\n"
	       "\n"
	       "Exit status: 0 on success, 1 when a file cannot be used or scoring fails, 2 on\n"
	       "usage errors.\n");
}

static _printf_(1, 2) int usage(const char *fmt, ...) {
	va_list ap;

	fputs("kvdctl score: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputs("\nTry 'kvdctl score --help'.\n", stderr);
	return EXIT_USAGE;
}

static _printf_(1, 2) int fail(const char *fmt, ...) {
	va_list ap;

	fputs("kvdctl score: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	return EXIT_FAIL;
}

static int parse_u32(const char *opt, const char *s, uint32_t *ret) {
	if (number_parse_u32(s, 0, UINT32_MAX, ret) < 0)
		return usage("%s: '%s' is not a number in 0..%u", opt, s, UINT32_MAX);
	return 0;
}

static int parse_double(const char *opt, const char *s, double *ret) {
	char *end;
	double v;

	errno = 0;
	v = strtod(s, &end);
	if (errno != 0 || end == s || *end || !isfinite(v))
		return usage("%s: '%s' is not a finite number", opt, s);
	*ret = v;
	return 0;
}

static void npy_closep(struct kvd_npy *a) {
	kvd_npy_close(a);
}

/* Opens path as a float32/float16 array of ndim dimensions; prints why not. */
static int open_tensor(const char *path, int ndim, struct kvd_npy *ret) {
	char err[KVD_NPY_ERROR_MAX];
	int r;

	r = kvd_npy_open(path, KVD_NPY_ACCEPT_FLOAT, ndim, ret, err, sizeof(err));
	if (r < 0)
		return fail("%s", err[0] ? err : strerror(-r));
	return 0;
}

/* A float32 copy of a (for tensors whose dtypes differ from q's). */
static float *to_f32(const struct kvd_npy *a) {
	float *out = malloc((a->count ? a->count : 1) * sizeof(float));

	if (!out)
		return NULL;
	for (uint64_t i = 0; i < a->count; i++)
		out[i] = kvd_load(a->data, a->dtype, i);
	return out;
}

static void print_json_double(double v) {
	if (isfinite(v))
		printf("%.9g", v);
	else
		printf("null");
}

int cmd_score(int argc, char **argv) {
	enum {
		OPT_POLICY = 0x100, OPT_Q, OPT_K, OPT_V, OPT_WO, OPT_CAPACITY, OPT_WINDOW,
		OPT_GRANULARITY, OPT_PER_QUERY_HEAD, OPT_ALPHA, OPT_TEMPORAL, OPT_POOLING,
		OPT_KERNEL, OPT_SCALE, OPT_TAU, OPT_METRIC, OPT_USE_NORM, OPT_LAPROX_DIAGONAL,
		OPT_LAYER_WEIGHT, OPT_LAYER, OPT_LAYERS, OPT_SOFTMAX_SCALE, OPT_THREADS,
		OPT_REFERENCE, OPT_JSON,
	};
	static const struct option options[] = {
		{ "policy", required_argument, NULL, OPT_POLICY },
		{ "q", required_argument, NULL, OPT_Q },
		{ "k", required_argument, NULL, OPT_K },
		{ "v", required_argument, NULL, OPT_V },
		{ "wo", required_argument, NULL, OPT_WO },
		{ "capacity", required_argument, NULL, OPT_CAPACITY },
		{ "window", required_argument, NULL, OPT_WINDOW },
		{ "granularity", required_argument, NULL, OPT_GRANULARITY },
		{ "per-query-head", no_argument, NULL, OPT_PER_QUERY_HEAD },
		{ "alpha", required_argument, NULL, OPT_ALPHA },
		{ "temporal", required_argument, NULL, OPT_TEMPORAL },
		{ "pooling", required_argument, NULL, OPT_POOLING },
		{ "kernel", required_argument, NULL, OPT_KERNEL },
		{ "scale", required_argument, NULL, OPT_SCALE },
		{ "tau", required_argument, NULL, OPT_TAU },
		{ "metric", required_argument, NULL, OPT_METRIC },
		{ "use-norm", no_argument, NULL, OPT_USE_NORM },
		{ "laprox-diagonal", no_argument, NULL, OPT_LAPROX_DIAGONAL },
		{ "layer-weight", required_argument, NULL, OPT_LAYER_WEIGHT },
		{ "layer", required_argument, NULL, OPT_LAYER },
		{ "layers", required_argument, NULL, OPT_LAYERS },
		{ "softmax-scale", required_argument, NULL, OPT_SOFTMAX_SCALE },
		{ "threads", required_argument, NULL, OPT_THREADS },
		{ "reference", no_argument, NULL, OPT_REFERENCE },
		{ "json", no_argument, NULL, OPT_JSON },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	/* Options as given; applied over the policy's defaults once the policy is known. */
	const char *policy_s = NULL, *q_path = NULL, *k_path = NULL, *v_path = NULL,
		   *wo_path = NULL, *granularity_s = "head", *temporal_s = NULL, *pooling_s = NULL,
		   *metric_s = "after";
	uint32_t capacity = 0, window = 0, kernel = 0, layer = 0, layers = 1, threads = 0;
	int have_capacity = 0, have_window = 0, have_kernel = 0, have_alpha = 0,
	    per_query_head = 0, use_norm = 0, laprox_diagonal = 0, reference = 0, json = 0;
	double alpha = KVD_TEMPORAL_EMA_ALPHA, scale = KVD_AWS_SCALE, tau = 1, layer_weight = 1,
	       softmax_scale = 0;
	_cleanup_(npy_closep) struct kvd_npy q = {}, k = {}, v = {}, wo = {};
	_cleanup_(freep) float *qf = NULL, *kf = NULL, *vf = NULL, *gram = NULL,
			       *gram_group = NULL, *mi_mean_k = NULL;
	_cleanup_(freep) uint64_t *mi_count = NULL;
	struct kvd_policy_params pp;
	struct kvd_attn_in in = {};
	struct kvd_keep *keep = NULL;
	enum kvd_policy policy;
	uint32_t H, Hkv, L, d, g, dtype;
	int opt, r;

	optind = 0;
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case OPT_POLICY:
			policy_s = optarg;
			break;
		case OPT_Q:
			q_path = optarg;
			break;
		case OPT_K:
			k_path = optarg;
			break;
		case OPT_V:
			v_path = optarg;
			break;
		case OPT_WO:
			wo_path = optarg;
			break;
		case OPT_CAPACITY:
			if (parse_u32("--capacity", optarg, &capacity) < 0)
				return EXIT_USAGE;
			have_capacity = 1;
			break;
		case OPT_WINDOW:
			if (parse_u32("--window", optarg, &window) < 0)
				return EXIT_USAGE;
			have_window = 1;
			break;
		case OPT_GRANULARITY:
			granularity_s = optarg;
			break;
		case OPT_PER_QUERY_HEAD:
			per_query_head = 1;
			break;
		case OPT_ALPHA:
			if (parse_double("--alpha", optarg, &alpha) < 0)
				return EXIT_USAGE;
			if (!(alpha > 0) || alpha > 1)
				return usage("--alpha: %s is not in (0, 1]", optarg);
			have_alpha = 1;
			break;
		case OPT_TEMPORAL:
			temporal_s = optarg;
			break;
		case OPT_POOLING:
			pooling_s = optarg;
			break;
		case OPT_KERNEL:
			if (parse_u32("--kernel", optarg, &kernel) < 0)
				return EXIT_USAGE;
			if (kernel % 2 == 0)
				return usage("--kernel: %u is not an odd number", kernel);
			have_kernel = 1;
			break;
		case OPT_SCALE:
			if (parse_double("--scale", optarg, &scale) < 0)
				return EXIT_USAGE;
			if (!(scale > 0))
				return usage("--scale: %s is not positive", optarg);
			break;
		case OPT_TAU:
			if (parse_double("--tau", optarg, &tau) < 0)
				return EXIT_USAGE;
			if (!(tau > 0))
				return usage("--tau: %s is not positive", optarg);
			break;
		case OPT_METRIC:
			metric_s = optarg;
			break;
		case OPT_USE_NORM:
			use_norm = 1;
			break;
		case OPT_LAPROX_DIAGONAL:
			laprox_diagonal = 1;
			break;
		case OPT_LAYER_WEIGHT:
			if (parse_double("--layer-weight", optarg, &layer_weight) < 0)
				return EXIT_USAGE;
			if (layer_weight < 0)
				return usage("--layer-weight: %s is negative", optarg);
			break;
		case OPT_LAYER:
			if (parse_u32("--layer", optarg, &layer) < 0)
				return EXIT_USAGE;
			break;
		case OPT_LAYERS:
			if (parse_u32("--layers", optarg, &layers) < 0)
				return EXIT_USAGE;
			if (layers == 0)
				return usage("--layers: must be at least 1");
			break;
		case OPT_SOFTMAX_SCALE:
			if (parse_double("--softmax-scale", optarg, &softmax_scale) < 0)
				return EXIT_USAGE;
			if (!(softmax_scale > 0))
				return usage("--softmax-scale: %s is not positive", optarg);
			break;
		case OPT_THREADS:
			if (parse_u32("--threads", optarg, &threads) < 0)
				return EXIT_USAGE;
			break;
		case OPT_REFERENCE:
			reference = 1;
			break;
		case OPT_JSON:
			json = 1;
			break;
		case 'h':
			help();
			return EXIT_OK;
		default:
			return usage("bad option");
		}
	if (optind < argc)
		return usage("unexpected argument '%s'", argv[optind]);
	if (!policy_s)
		return usage("--policy is required");
	policy = kvd_policy_from_string(policy_s);
	if (policy < 0)
		return usage("--policy: unknown policy '%s'", policy_s);
	/* Its inputs are index keys, which only an engine's pool has. */
	if (policy == KVD_POLICY_INDEXMEM)
		return usage("--policy: indexmem ranks by index keys, which only an engine computes; "
		             "it is for the daemon's rounds (kvd.conf(5))");
	if (!q_path || !k_path)
		return usage("--q and --k are required");
	if (!have_capacity || !have_window)
		return usage("--capacity and --window are required");
	if (window == 0)
		return usage("--window: must be at least 1");
	if (capacity < window)
		return usage("--capacity %u is smaller than --window %u", capacity, window);
	if (layer >= layers)
		return usage("--layer %u: the model has %u layers (--layers)", layer, layers);

	kvd_policy_params_default(policy, &pp);
	pp.capacity = capacity;
	pp.granularity = kvd_granularity_from_string(granularity_s);
	if ((int)pp.granularity < 0)
		return usage("--granularity: '%s' is not head or layer", granularity_s);
	pp.per_query_head = per_query_head;
	if (have_alpha)
		pp.alpha = (float)alpha;
	if (temporal_s) {
		pp.temporal = kvd_temporal_mode_from_string(temporal_s);
		if ((int)pp.temporal < 0)
			return usage("--temporal: '%s' is not ema, mean, last or sum", temporal_s);
	}
	if (pooling_s) {
		pp.pooling = kvd_pool_mode_from_string(pooling_s);
		if ((int)pp.pooling < 0)
			return usage("--pooling: '%s' is not none, avg, max or adaptive", pooling_s);
	}
	if (have_kernel)
		pp.kernel = kernel;
	pp.aws_scale = scale;
	pp.restkv.tau = (float)tau;
	pp.restkv.metric = kvd_restkv_metric_from_string(metric_s);
	if ((int)pp.restkv.metric < 0)
		return usage("--metric: '%s' is not after or before", metric_s);
	pp.restkv.use_norm = use_norm;
	pp.laprox_joint = !laprox_diagonal;
	pp.layer_weight = (float)layer_weight;
	pp.layer = layer, pp.n_layers = layers;
	pp.threads = threads;
	pp.reference = reference;
	if (pooling_s && pp.pooling == KVD_POOL_ADAPTIVE && policy != KVD_POLICY_RESTKV &&
	    policy != KVD_POLICY_KVD && policy != KVD_POLICY_KVD_MI && policy != KVD_POLICY_LAPROX)
		return usage("--pooling adaptive: only restkv, laprox, kvd and kvd-mi use it");

	/* The tensors: every refusal names its file. */
	if (open_tensor(q_path, 3, &q) || open_tensor(k_path, 3, &k))
		return EXIT_FAIL;
	if (v_path && open_tensor(v_path, 3, &v))
		return EXIT_FAIL;
	if (wo_path && open_tensor(wo_path, 2, &wo))
		return EXIT_FAIL;
	H = (uint32_t)q.shape[0], Hkv = (uint32_t)k.shape[0], L = (uint32_t)k.shape[1];
	d = (uint32_t)k.shape[2];
	if (q.shape[0] == 0 || q.shape[0] > UINT32_MAX || k.shape[0] == 0 ||
	    k.shape[1] > UINT32_MAX || k.shape[2] == 0 || k.shape[2] > UINT32_MAX)
		return fail("%s, %s: empty or oversized dimensions", q_path, k_path);
	if (q.shape[2] != d)
		return fail("%s: head dimension %llu differs from %s's %u", q_path,
			    (unsigned long long)q.shape[2], k_path, d);
	if (q.shape[1] != window)
		return fail("%s: %llu window queries, but --window is %u", q_path,
			    (unsigned long long)q.shape[1], window);
	if (H % Hkv != 0)
		return fail("%s: %u heads are not a multiple of %s's %u kv heads", q_path, H, k_path,
			    Hkv);
	if (window > L)
		return fail("%s: %u tokens, fewer than the window (%u)", k_path, L, window);
	if (v_path && (v.shape[0] != Hkv || v.shape[1] != L || v.shape[2] != d))
		return fail("%s: shape (%llu, %llu, %llu) differs from %s's (%u, %u, %u)", v_path,
			    (unsigned long long)v.shape[0], (unsigned long long)v.shape[1],
			    (unsigned long long)v.shape[2], k_path, Hkv, L, d);
	if (!v_path && (policy == KVD_POLICY_RESTKV || policy == KVD_POLICY_LAPROX ||
			policy == KVD_POLICY_KVD || policy == KVD_POLICY_KVD_MI ||
			policy == KVD_POLICY_EXPECTED_ATTENTION))
		return usage("--policy %s needs --v", policy_s);
	if (wo_path && (wo.shape[1] != (uint64_t)H * d || wo.shape[0] == 0 ||
			wo.shape[0] > UINT32_MAX))
		return fail("%s: expected [c_out, heads*d] = [*, %llu], got (%llu, %llu)", wo_path,
			    (unsigned long long)H * d, (unsigned long long)wo.shape[0],
			    (unsigned long long)wo.shape[1]);

	/* One dtype for q, k and v, as the kernels take them: float32 copies if they differ. */
	dtype = q.dtype;
	if (k.dtype != dtype || (v_path && v.dtype != dtype)) {
		qf = to_f32(&q), kf = to_f32(&k), vf = v_path ? to_f32(&v) : NULL;
		if (!qf || !kf || (v_path && !vf))
			return fail("out of memory");
		dtype = KVD_DTYPE_F32;
	}
	in = (struct kvd_attn_in){
		.dtype = dtype, .heads = H, .kv_heads = Hkv, .window = window, .len = L, .dim = d,
		.scale = softmax_scale > 0 ? (float)softmax_scale : 1.0f / sqrtf((float)d),
		.q = qf ? qf : q.data, .k = kf ? kf : k.data,
		.v = vf ? vf : v_path ? v.data : NULL,
	};
	kvd_attn_in_contiguous(&in);
	g = H / Hkv;

	if (wo_path && (policy == KVD_POLICY_RESTKV || policy == KVD_POLICY_LAPROX ||
			policy == KVD_POLICY_KVD || policy == KVD_POLICY_KVD_MI)) {
		struct kvd_wo w = {
			.dtype = wo.dtype, .c_out = (uint32_t)wo.shape[0], .heads = H, .dim = d,
			.w = wo.data, .row_stride = (size_t)H * d,
		};

		gram = malloc((size_t)H * d * d * sizeof(float));
		if (!gram)
			return fail("out of memory");
		for (uint32_t h = 0; h < H; h++) {
			r = (reference ? kvd_gram_ref : kvd_gram)(&w, h, 1, gram + (size_t)h * d * d);
			if (r < 0)
				return fail("%s: Gram matrices: %s", wo_path, strerror(-r));
		}
		if (policy == KVD_POLICY_LAPROX && pp.laprox_joint && !per_query_head) {
			gram_group = malloc((size_t)Hkv * g * d * g * d * sizeof(float));
			if (!gram_group)
				return fail("out of memory");
			for (uint32_t kv = 0; kv < Hkv; kv++) {
				r = (reference ? kvd_gram_ref : kvd_gram)(
					&w, kv * g, g, gram_group + (size_t)kv * g * d * g * d);
				if (r < 0)
					return fail("%s: Gram matrices: %s", wo_path, strerror(-r));
			}
		}
	}

	if (policy == KVD_POLICY_KVD_MI) {
		/* No moments offline: empty summaries, so that kvd-mi measures the misfit against
		 * its provisional one, as the daemon does for a model without moments. */
		mi_mean_k = calloc((size_t)Hkv * d, sizeof(float));
		mi_count = calloc(Hkv, sizeof(uint64_t));
		if (!mi_mean_k || !mi_count)
			return fail("out of memory");
		pp.mi_mean_k = mi_mean_k, pp.mi_count = mi_count;
	}
	r = kvd_policy_keep(&pp, &in, gram, gram_group, &keep);
	if (r < 0)
		return fail("policy %s: %s", policy_s,
			    r == -EINVAL ? "invalid settings for these tensors" : strerror(-r));

	if (json) {
		printf("{\"keep\": [");
		for (uint32_t row = 0; row < keep->rows; row++) {
			printf("%s[", row ? ", " : "");
			for (uint32_t i = keep->off[row]; i < keep->off[row + 1]; i++)
				printf("%s%u", i > keep->off[row] ? ", " : "", keep->pos[i]);
			printf("]");
		}
		printf("], \"settings\": {\"policy\": \"%s\", \"capacity\": %u, \"window\": %u, "
		       "\"granularity\": \"%s\", \"rows\": \"%s\", \"heads\": %u, \"kv_heads\": %u, "
		       "\"len\": %u, \"dim\": %u, \"dtype\": \"%s\", \"use_wo\": %s",
		       policy_s, capacity, window, kvd_granularity_to_string(pp.granularity),
		       pp.granularity == KVD_GRANULARITY_LAYER ? "layer" :
		       per_query_head ? "query_head" : "kv_head",
		       H, Hkv, L, d, kvd_npy_dtype_name(q.dtype), gram ? "true" : "false");
		printf(", \"temporal\": \"%s\", \"alpha\": ", kvd_temporal_mode_to_string(pp.temporal));
		print_json_double(pp.alpha);
		printf(", \"pooling\": \"%s\", \"kernel\": %u, \"scale\": ",
		       kvd_pool_mode_to_string(pp.pooling), pp.kernel);
		print_json_double(pp.aws_scale);
		printf(", \"metric\": \"%s\", \"tau\": ", kvd_restkv_metric_to_string(pp.restkv.metric));
		print_json_double(pp.restkv.tau);
		printf(", \"use_norm\": %s, \"laprox_joint\": %s, \"layer_weight\": ",
		       use_norm ? "true" : "false", pp.laprox_joint ? "true" : "false");
		print_json_double(pp.layer_weight);
		printf(", \"layer\": %u, \"layers\": %u, \"softmax_scale\": ", layer, layers);
		print_json_double(in.scale);
		printf(", \"threads\": %u, \"reference\": %s}}\n", threads,
		       reference ? "true" : "false");
	} else {
		const char *unit = pp.granularity == KVD_GRANULARITY_LAYER ? "layer" :
				   per_query_head ? "head" : "kv head";

		for (uint32_t row = 0; row < keep->rows; row++) {
			if (pp.granularity == KVD_GRANULARITY_LAYER)
				printf("%s (%u kept):", unit, keep->off[row + 1] - keep->off[row]);
			else
				printf("%s %u (%u kept):", unit, row, keep->off[row + 1] - keep->off[row]);
			for (uint32_t i = keep->off[row]; i < keep->off[row + 1]; i++)
				printf(" %u", keep->pos[i]);
			printf("\n");
		}
	}
	kvd_keep_free(keep);
	if (fflush(stdout) != 0)
		return fail("writing the result failed: %m");
	return EXIT_OK;
}
