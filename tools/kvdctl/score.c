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

/* The options as given; applied over the policy's defaults once the policy is known. */
struct score_opts {
	const char *policy_s, *q_path, *k_path, *v_path, *wo_path, *granularity_s, *temporal_s,
		*pooling_s, *metric_s;
	uint32_t capacity, window, kernel, layer, layers, threads;
	bool have_capacity, have_window, have_kernel, have_alpha, per_query_head, use_norm,
	     laprox_diagonal, reference, json;
	double alpha, scale, tau, layer_weight, softmax_scale;
	enum kvd_policy policy;
};

/* Parses argv into o. Returns -1 to go on, or the exit status (after --help, or a usage
 * error, printed). */
static int parse_options(int argc, char **argv, struct score_opts *o) {
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
	int opt;

	*o = (struct score_opts){
		.granularity_s = "head", .metric_s = "after", .layers = 1,
		.alpha = KVD_TEMPORAL_EMA_ALPHA, .scale = KVD_AWS_SCALE, .tau = 1, .layer_weight = 1,
	};
	optind = 0;
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case OPT_POLICY:
			o->policy_s = optarg;
			break;
		case OPT_Q:
			o->q_path = optarg;
			break;
		case OPT_K:
			o->k_path = optarg;
			break;
		case OPT_V:
			o->v_path = optarg;
			break;
		case OPT_WO:
			o->wo_path = optarg;
			break;
		case OPT_CAPACITY:
			if (parse_u32("--capacity", optarg, &o->capacity) < 0)
				return EXIT_USAGE;
			o->have_capacity = true;
			break;
		case OPT_WINDOW:
			if (parse_u32("--window", optarg, &o->window) < 0)
				return EXIT_USAGE;
			o->have_window = true;
			break;
		case OPT_GRANULARITY:
			o->granularity_s = optarg;
			break;
		case OPT_PER_QUERY_HEAD:
			o->per_query_head = true;
			break;
		case OPT_ALPHA:
			if (parse_double("--alpha", optarg, &o->alpha) < 0)
				return EXIT_USAGE;
			if (!(o->alpha > 0) || o->alpha > 1)
				return usage("--alpha: %s is not in (0, 1]", optarg);
			o->have_alpha = true;
			break;
		case OPT_TEMPORAL:
			o->temporal_s = optarg;
			break;
		case OPT_POOLING:
			o->pooling_s = optarg;
			break;
		case OPT_KERNEL:
			if (parse_u32("--kernel", optarg, &o->kernel) < 0)
				return EXIT_USAGE;
			if (o->kernel % 2 == 0)
				return usage("--kernel: %u is not an odd number", o->kernel);
			o->have_kernel = true;
			break;
		case OPT_SCALE:
			if (parse_double("--scale", optarg, &o->scale) < 0)
				return EXIT_USAGE;
			if (!(o->scale > 0))
				return usage("--scale: %s is not positive", optarg);
			break;
		case OPT_TAU:
			if (parse_double("--tau", optarg, &o->tau) < 0)
				return EXIT_USAGE;
			if (!(o->tau > 0))
				return usage("--tau: %s is not positive", optarg);
			break;
		case OPT_METRIC:
			o->metric_s = optarg;
			break;
		case OPT_USE_NORM:
			o->use_norm = true;
			break;
		case OPT_LAPROX_DIAGONAL:
			o->laprox_diagonal = true;
			break;
		case OPT_LAYER_WEIGHT:
			if (parse_double("--layer-weight", optarg, &o->layer_weight) < 0)
				return EXIT_USAGE;
			if (o->layer_weight < 0)
				return usage("--layer-weight: %s is negative", optarg);
			break;
		case OPT_LAYER:
			if (parse_u32("--layer", optarg, &o->layer) < 0)
				return EXIT_USAGE;
			break;
		case OPT_LAYERS:
			if (parse_u32("--layers", optarg, &o->layers) < 0)
				return EXIT_USAGE;
			if (o->layers == 0)
				return usage("--layers: must be at least 1");
			break;
		case OPT_SOFTMAX_SCALE:
			if (parse_double("--softmax-scale", optarg, &o->softmax_scale) < 0)
				return EXIT_USAGE;
			if (!(o->softmax_scale > 0))
				return usage("--softmax-scale: %s is not positive", optarg);
			break;
		case OPT_THREADS:
			if (parse_u32("--threads", optarg, &o->threads) < 0)
				return EXIT_USAGE;
			break;
		case OPT_REFERENCE:
			o->reference = true;
			break;
		case OPT_JSON:
			o->json = true;
			break;
		case 'h':
			help();
			return EXIT_OK;
		default:
			return usage("bad option");
		}
	if (optind < argc)
		return usage("unexpected argument '%s'", argv[optind]);
	if (!o->policy_s)
		return usage("--policy is required");
	o->policy = kvd_policy_from_string(o->policy_s);
	if (o->policy < 0)
		return usage("--policy: unknown policy '%s'", o->policy_s);
	/* Its inputs are index keys, which only an engine's pool has. */
	if (o->policy == KVD_POLICY_INDEXMEM)
		return usage("--policy: indexmem ranks by index keys, which only an engine computes; "
		             "it is for the daemon's rounds (kvd.conf(5))");
	if (!o->q_path || !o->k_path)
		return usage("--q and --k are required");
	if (!o->have_capacity || !o->have_window)
		return usage("--capacity and --window are required");
	if (o->window == 0)
		return usage("--window: must be at least 1");
	if (o->capacity < o->window)
		return usage("--capacity %u is smaller than --window %u", o->capacity, o->window);
	if (o->layer >= o->layers)
		return usage("--layer %u: the model has %u layers (--layers)", o->layer, o->layers);
	return -1;
}

/* The options applied over the policy's defaults into pp. Returns -1 to go on, or
 * EXIT_USAGE (printed). */
static int policy_params(const struct score_opts *o, struct kvd_policy_params *pp) {
	kvd_policy_params_default(o->policy, pp);
	pp->capacity = o->capacity;
	pp->granularity = kvd_granularity_from_string(o->granularity_s);
	if ((int)pp->granularity < 0)
		return usage("--granularity: '%s' is not head or layer", o->granularity_s);
	pp->per_query_head = o->per_query_head;
	if (o->have_alpha)
		pp->alpha = (float)o->alpha;
	if (o->temporal_s) {
		pp->temporal = kvd_temporal_mode_from_string(o->temporal_s);
		if ((int)pp->temporal < 0)
			return usage("--temporal: '%s' is not ema, mean, last or sum", o->temporal_s);
	}
	if (o->pooling_s) {
		pp->pooling = kvd_pool_mode_from_string(o->pooling_s);
		if ((int)pp->pooling < 0)
			return usage("--pooling: '%s' is not none, avg, max or adaptive", o->pooling_s);
	}
	if (o->have_kernel)
		pp->kernel = o->kernel;
	pp->aws_scale = o->scale;
	pp->restkv.tau = (float)o->tau;
	pp->restkv.metric = kvd_restkv_metric_from_string(o->metric_s);
	if ((int)pp->restkv.metric < 0)
		return usage("--metric: '%s' is not after or before", o->metric_s);
	pp->restkv.use_norm = o->use_norm;
	pp->laprox_joint = !o->laprox_diagonal;
	pp->layer_weight = (float)o->layer_weight;
	pp->layer = o->layer, pp->n_layers = o->layers;
	pp->threads = o->threads;
	pp->reference = o->reference;
	if (o->pooling_s && pp->pooling == KVD_POOL_ADAPTIVE && o->policy != KVD_POLICY_RESTKV &&
	    o->policy != KVD_POLICY_KVD && o->policy != KVD_POLICY_KVD_MI &&
	    o->policy != KVD_POLICY_LAPROX)
		return usage("--pooling adaptive: only restkv, laprox, kvd and kvd-mi use it");
	return -1;
}

/* What a policy scores: the tensors as opened, float32 copies where their dtypes differ,
 * the kernels' view of them, and the Gram matrices of --wo. */
struct score_inputs {
	struct kvd_npy q, k, v, wo;
	float *qf, *kf, *vf, *gram, *gram_group;
	struct kvd_attn_in in;
	uint32_t heads, kv_heads, len, dim;
};

static void score_inputs_done(struct score_inputs *x) {
	kvd_npy_close(&x->q);
	kvd_npy_close(&x->k);
	kvd_npy_close(&x->v);
	kvd_npy_close(&x->wo);
	free(x->qf);
	free(x->kf);
	free(x->vf);
	free(x->gram);
	free(x->gram_group);
}

static bool uses_v(enum kvd_policy p) {
	return p == KVD_POLICY_RESTKV || p == KVD_POLICY_LAPROX || p == KVD_POLICY_KVD ||
	       p == KVD_POLICY_KVD_MI || p == KVD_POLICY_EXPECTED_ATTENTION;
}

/* Opens the tensors of o and checks their shapes against each other and the options:
 * every refusal names its file. Returns -1 to go on, or the exit status (printed). */
static int load_tensors(const struct score_opts *o, struct score_inputs *x) {
	uint32_t H, Hkv, L, d, dtype;
	float scale;

	if (open_tensor(o->q_path, 3, &x->q) || open_tensor(o->k_path, 3, &x->k))
		return EXIT_FAIL;
	if (o->v_path && open_tensor(o->v_path, 3, &x->v))
		return EXIT_FAIL;
	if (o->wo_path && open_tensor(o->wo_path, 2, &x->wo))
		return EXIT_FAIL;
	H = (uint32_t)x->q.shape[0], Hkv = (uint32_t)x->k.shape[0], L = (uint32_t)x->k.shape[1];
	d = (uint32_t)x->k.shape[2];
	if (x->q.shape[0] == 0 || x->q.shape[0] > UINT32_MAX || x->k.shape[0] == 0 ||
	    x->k.shape[1] > UINT32_MAX || x->k.shape[2] == 0 || x->k.shape[2] > UINT32_MAX)
		return fail("%s, %s: empty or oversized dimensions", o->q_path, o->k_path);
	if (x->q.shape[2] != d)
		return fail("%s: head dimension %llu differs from %s's %u", o->q_path,
			    (unsigned long long)x->q.shape[2], o->k_path, d);
	if (x->q.shape[1] != o->window)
		return fail("%s: %llu window queries, but --window is %u", o->q_path,
			    (unsigned long long)x->q.shape[1], o->window);
	if (H % Hkv != 0)
		return fail("%s: %u heads are not a multiple of %s's %u kv heads", o->q_path, H,
			    o->k_path, Hkv);
	if (o->window > L)
		return fail("%s: %u tokens, fewer than the window (%u)", o->k_path, L, o->window);
	if (o->v_path && (x->v.shape[0] != Hkv || x->v.shape[1] != L || x->v.shape[2] != d))
		return fail("%s: shape (%llu, %llu, %llu) differs from %s's (%u, %u, %u)", o->v_path,
			    (unsigned long long)x->v.shape[0], (unsigned long long)x->v.shape[1],
			    (unsigned long long)x->v.shape[2], o->k_path, Hkv, L, d);
	if (!o->v_path && uses_v(o->policy))
		return usage("--policy %s needs --v", o->policy_s);
	if (o->wo_path && (x->wo.shape[1] != (uint64_t)H * d || x->wo.shape[0] == 0 ||
			   x->wo.shape[0] > UINT32_MAX))
		return fail("%s: expected [c_out, heads*d] = [*, %llu], got (%llu, %llu)", o->wo_path,
			    (unsigned long long)H * d, (unsigned long long)x->wo.shape[0],
			    (unsigned long long)x->wo.shape[1]);

	/* One dtype for q, k and v, as the kernels take them: float32 copies if they differ. */
	dtype = x->q.dtype;
	if (x->k.dtype != dtype || (o->v_path && x->v.dtype != dtype)) {
		x->qf = to_f32(&x->q), x->kf = to_f32(&x->k);
		x->vf = o->v_path ? to_f32(&x->v) : NULL;
		if (!x->qf || !x->kf || (o->v_path && !x->vf))
			return fail("out of memory");
		dtype = KVD_DTYPE_F32;
	}
	scale = o->softmax_scale > 0 ? (float)o->softmax_scale : 1.0f / sqrtf((float)d);
	x->in = (struct kvd_attn_in){
		.dtype = dtype, .heads = H, .kv_heads = Hkv, .window = o->window, .len = L,
		.dim = d, .scale = scale,
		.q = x->qf ? x->qf : x->q.data, .k = x->kf ? x->kf : x->k.data,
		.v = x->vf ? x->vf : o->v_path ? x->v.data : NULL,
	};
	kvd_attn_in_contiguous(&x->in);
	x->heads = H, x->kv_heads = Hkv, x->len = L, x->dim = d;
	return -1;
}

/* The Gram matrices of --wo for the policies that reconstruct outputs: per query head, and
 * per kv head's group for LaProx's joint form. Returns -1 to go on, or EXIT_FAIL (printed). */
static int load_grams(const struct score_opts *o, const struct kvd_policy_params *pp,
                      struct score_inputs *x) {
	uint32_t H = x->heads, Hkv = x->kv_heads, d = x->dim, g = H / Hkv;
	struct kvd_wo w = {
		.dtype = x->wo.dtype, .c_out = (uint32_t)x->wo.shape[0], .heads = H, .dim = d,
		.w = x->wo.data, .row_stride = (size_t)H * d,
	};
	int r;

	if (!o->wo_path || (o->policy != KVD_POLICY_RESTKV && o->policy != KVD_POLICY_LAPROX &&
			    o->policy != KVD_POLICY_KVD && o->policy != KVD_POLICY_KVD_MI))
		return -1;
	x->gram = malloc((size_t)H * d * d * sizeof(float));
	if (!x->gram)
		return fail("out of memory");
	for (uint32_t h = 0; h < H; h++) {
		r = (o->reference ? kvd_gram_ref : kvd_gram)(&w, h, 1, x->gram + (size_t)h * d * d);
		if (r < 0)
			return fail("%s: Gram matrices: %s", o->wo_path, strerror(-r));
	}
	if (o->policy != KVD_POLICY_LAPROX || !pp->laprox_joint || o->per_query_head)
		return -1;
	x->gram_group = malloc((size_t)Hkv * g * d * g * d * sizeof(float));
	if (!x->gram_group)
		return fail("out of memory");
	for (uint32_t kv = 0; kv < Hkv; kv++) {
		r = (o->reference ? kvd_gram_ref : kvd_gram)(
			&w, kv * g, g, x->gram_group + (size_t)kv * g * d * g * d);
		if (r < 0)
			return fail("%s: Gram matrices: %s", o->wo_path, strerror(-r));
	}
	return -1;
}

static void print_json(const struct score_opts *o, const struct kvd_policy_params *pp,
                       const struct score_inputs *x, const struct kvd_keep *keep) {
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
	       o->policy_s, o->capacity, o->window, kvd_granularity_to_string(pp->granularity),
	       pp->granularity == KVD_GRANULARITY_LAYER ? "layer" :
	       o->per_query_head ? "query_head" : "kv_head",
	       x->heads, x->kv_heads, x->len, x->dim, kvd_npy_dtype_name(x->q.dtype),
	       x->gram ? "true" : "false");
	printf(", \"temporal\": \"%s\", \"alpha\": ", kvd_temporal_mode_to_string(pp->temporal));
	print_json_double(pp->alpha);
	printf(", \"pooling\": \"%s\", \"kernel\": %u, \"scale\": ",
	       kvd_pool_mode_to_string(pp->pooling), pp->kernel);
	print_json_double(pp->aws_scale);
	printf(", \"metric\": \"%s\", \"tau\": ", kvd_restkv_metric_to_string(pp->restkv.metric));
	print_json_double(pp->restkv.tau);
	printf(", \"use_norm\": %s, \"laprox_joint\": %s, \"layer_weight\": ",
	       o->use_norm ? "true" : "false", pp->laprox_joint ? "true" : "false");
	print_json_double(pp->layer_weight);
	printf(", \"layer\": %u, \"layers\": %u, \"softmax_scale\": ", o->layer, o->layers);
	print_json_double(x->in.scale);
	printf(", \"threads\": %u, \"reference\": %s}}\n", o->threads,
	       o->reference ? "true" : "false");
}

static void print_text(const struct score_opts *o, const struct kvd_policy_params *pp,
                       const struct kvd_keep *keep) {
	const char *unit = pp->granularity == KVD_GRANULARITY_LAYER ? "layer" :
			   o->per_query_head ? "head" : "kv head";

	for (uint32_t row = 0; row < keep->rows; row++) {
		if (pp->granularity == KVD_GRANULARITY_LAYER)
			printf("%s (%u kept):", unit, keep->off[row + 1] - keep->off[row]);
		else
			printf("%s %u (%u kept):", unit, row, keep->off[row + 1] - keep->off[row]);
		for (uint32_t i = keep->off[row]; i < keep->off[row + 1]; i++)
			printf(" %u", keep->pos[i]);
		printf("\n");
	}
}

int cmd_score(int argc, char **argv) {
	_cleanup_(score_inputs_done) struct score_inputs x = {};
	_cleanup_(freep) float *mi_mean_k = NULL;
	_cleanup_(freep) uint64_t *mi_count = NULL;
	struct kvd_policy_params pp;
	struct kvd_keep *keep = NULL;
	struct score_opts o;
	int r;

	if ((r = parse_options(argc, argv, &o)) >= 0 || (r = policy_params(&o, &pp)) >= 0 ||
	    (r = load_tensors(&o, &x)) >= 0 || (r = load_grams(&o, &pp, &x)) >= 0)
		return r;
	if (o.policy == KVD_POLICY_KVD_MI) {
		/* No moments offline: empty summaries, so that kvd-mi measures the misfit against
		 * its provisional one, as the daemon does for a model without moments. */
		mi_mean_k = calloc((size_t)x.kv_heads * x.dim, sizeof(float));
		mi_count = calloc(x.kv_heads, sizeof(uint64_t));
		if (!mi_mean_k || !mi_count)
			return fail("out of memory");
		pp.mi_mean_k = mi_mean_k, pp.mi_count = mi_count;
	}
	r = kvd_policy_keep(&pp, &x.in, x.gram, x.gram_group, &keep);
	if (r < 0)
		return fail("policy %s: %s", o.policy_s,
			    r == -EINVAL ? "invalid settings for these tensors" : strerror(-r));
	if (o.json)
		print_json(&o, &pp, &x, keep);
	else
		print_text(&o, &pp, keep);
	kvd_keep_free(keep);
	if (fflush(stdout) != 0)
		return fail("writing the result failed: %m");
	return EXIT_OK;
}
