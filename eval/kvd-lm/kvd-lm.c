/* SPDX-License-Identifier: MIT */
/*
 * kvd-lm: greedy generation with the kvd-lm transformer (eval/kvd-lm/README.md), its KV
 * cache either in a kvd daemon (through libkvd: registered with the per-head layout, W_o
 * uploaded, observation windows published, so that the daemon can evict) or, with
 * --no-daemon, in a private full cache: the reference.
 *
 * The prompt (BOS + its bytes) is prefilled in chunks, then tokens are decoded greedily
 * until a newline, EOS or --max-new. The generated text goes to stdout, as kvdlm.py
 * generate --stop-newline prints it; --stats adds speeds and cache figures on stderr.
 *
 * Exit codes: 0 success, 1 failure (model, daemon, generation), 2 usage.
 */

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cache.h"
#include "basic/macro.h"
#include "basic/number.h"
#include "config.h"
#include "forward.h"
#include "kvd/kvd.h"
#include "model.h"
#include "cli.h"

#define EXIT_USAGE 2
/* The largest --prompt-file: more than the private cache could ever hold. */
#define PROMPT_FILE_MAX ((size_t)KVDLM_FULL_MAX_TOKENS)
#define MAX_NEW_MAX (1u << 16)
/* Room past prompt + --max-new in the sequence: a block, so that the sequence never ends
 * exactly at its capacity. */
#define SEQ_SLACK KVDLM_KVD_BLOCK_TOKENS

static const char *arg_model;
static const char *arg_socket;
static const char *arg_tenant = "kvd-lm";
static const char *arg_prompt;
static const char *arg_prompt_file;
static bool arg_no_daemon;
static bool arg_no_stop;
static bool arg_print_logits;
static bool arg_stats;
static uint32_t arg_max_new = 32;
static uint32_t arg_threads;
static uint32_t arg_unit = KVD_UNIT_HEAD_TOKEN;
static uint32_t arg_compensation = KVD_COMPENSATION_NONE;
static enum kvd_moments_form arg_form = KVD_MOMENTS_PLAIN;
static const char *arg_indexmem;
static uint32_t arg_window = KVD_WINDOW_DEFAULT;
static uint32_t arg_chunk = KVDLM_CHUNK_DEFAULT;
/* Evictions at fixed points: after every decode step that ends at a multiple of
 * arg_evict_every positions, a round of arg_evict_bytes on this tenant (kvd_evict), so that
 * two engines making the same requests see the same cache (eval/kvd-lm/kvd-lm-torch.py). */
static uint32_t arg_evict_every;
static uint64_t arg_evict_bytes;

static void help(void) {
	printf("Usage: kvd-lm --model FILE [OPTIONS]\n"
	       "\n"
	       "Greedy generation with a kvd-lm model (.kvdlm), its KV cache in a kvd daemon or,\n"
	       "with --no-daemon, in a private full cache. The prompt is BOS + its tokens (the\n"
	       "tokenizer file beside the model, MODEL.kvdtok; none: one token per byte),\n"
	       "prefilled in chunks; greedy decoding stops after a newline, EOS or --max-new\n"
	       "tokens. The generated text goes to stdout, special tokens as <bos>, <eos>,\n"
	       "<pad>, <259>, with a final newline added when it did not end with one.\n"
	       "\n"
	       "Options:\n"
	       "  --model FILE        Weights file (required)\n"
	       "  --socket PATH       Daemon socket (default: $KVD_SOCKET if set, else %s)\n"
	       "  --no-daemon         Keep the KV cache in this process, every token of it\n"
	       "  --tenant NAME       Tenant to act for (default: kvd-lm)\n"
	       "  --prompt TEXT       Prompt text (default: empty, BOS alone)\n"
	       "  --prompt-file FILE  File whose bytes are the prompt (at most %zu bytes)\n"
	       "  --max-new N         Tokens to generate at most, 0..%u (default: 32)\n"
	       "  --no-stop           Do not stop at a newline (EOS still stops)\n"
	       "  --threads N         Compute threads, 1..%u (default: the online CPUs)\n"
	       "  --unit UNIT         What the daemon evicts: head (a token of one layer and kv\n"
	       "                      head), layer (a token of a layer), block (16 tokens of one\n"
	       "                      layer and kv head) or none (default: head)\n"
	       "  --window W          Observation window: recent queries per layer shown to the\n"
	       "                      daemon, 1..%u (default: %u)\n"
	       "  --compensation C    What the daemon keeps of evicted tokens: none, moments\n"
	       "                      (MomentKV moments, added to attention as one more\n"
	       "                      softmax entry), moments-mass (the same, with the\n"
	       "                      mass corrected by the keys' variance), moments-bounded\n"
	       "                      (that mass capped by bounds of the exact one) or latent\n"
	       "                      (IndexMem's latent memory, read out through the\n"
	       "                      --indexmem weights) (default: none)\n"
	       "  --indexmem FILE     IndexMem weights (.kvdim): register the model with an\n"
	       "                      indexer, store each token's index key and publish the\n"
	       "                      index queries (for tenants of policy indexmem)\n"
	       "  --chunk N           Prefill step, tokens, 1..%u (default: %u)\n"
	       "  --evict-every N     After each decode step that reaches a multiple of N\n"
	       "                      positions, ask for an eviction round of --evict-bytes\n"
	       "                      on this tenant (evictions at fixed points; default: off)\n"
	       "  --evict-bytes B     Bytes each of those rounds frees (default: one chunk)\n"
	       "  --print-logits      Before the text, print a line per generated token:\n"
	       "                      'logits POSITION TOKEN' and the vocabulary's logits that\n"
	       "                      chose it\n"
	       "  --stats             Print prefill and decode speeds (tokens/s) and what the\n"
	       "                      cache holds on stderr\n"
	       "  -h, --help          Show this help\n"
	       "      --version       Show the version\n"
	       "\n"
	       "Exit status: 0 success, 1 failure, 2 usage error.\n",
	       KVD_DEFAULT_SOCKET, PROMPT_FILE_MAX, MAX_NEW_MAX, KVDLM_THREADS_MAX, KVD_WINDOW_MAX,
	       KVD_WINDOW_DEFAULT, KVDLM_CHUNK_MAX, KVDLM_CHUNK_DEFAULT);
}

/* -EINVAL: main() turns it into the usage exit status. */
#define usage_error(...) (cli_usage_error("kvd-lm", __VA_ARGS__), -EINVAL)

static int parse_u32(const char *opt, const char *s, uint32_t min, uint32_t max, uint32_t *ret) {
	if (number_parse_u32(s, min, max, ret) < 0) {
		fprintf(stderr, "kvd-lm: %s: '%s' is not a number in %u..%u\nTry 'kvd-lm --help'.\n", opt,
		        s, min, max);
		return -EINVAL;
	}
	return 0;
}

/* Returns 1 to go on, 0 to exit successfully (--help, --version), -EINVAL on usage errors. */
static int parse_argv(int argc, char **argv) {
	enum {
		ARG_MODEL = 0x100,
		ARG_SOCKET,
		ARG_NO_DAEMON,
		ARG_TENANT,
		ARG_PROMPT,
		ARG_PROMPT_FILE,
		ARG_MAX_NEW,
		ARG_NO_STOP,
		ARG_THREADS,
		ARG_UNIT,
		ARG_WINDOW,
		ARG_COMPENSATION,
		ARG_INDEXMEM,
		ARG_CHUNK,
		ARG_PRINT_LOGITS,
		ARG_EVICT_EVERY,
		ARG_EVICT_BYTES,
		ARG_STATS,
		ARG_VERSION,
	};
	static const struct option options[] = {
		{ "model", required_argument, NULL, ARG_MODEL },
		{ "socket", required_argument, NULL, ARG_SOCKET },
		{ "no-daemon", no_argument, NULL, ARG_NO_DAEMON },
		{ "tenant", required_argument, NULL, ARG_TENANT },
		{ "prompt", required_argument, NULL, ARG_PROMPT },
		{ "prompt-file", required_argument, NULL, ARG_PROMPT_FILE },
		{ "max-new", required_argument, NULL, ARG_MAX_NEW },
		{ "no-stop", no_argument, NULL, ARG_NO_STOP },
		{ "threads", required_argument, NULL, ARG_THREADS },
		{ "unit", required_argument, NULL, ARG_UNIT },
		{ "window", required_argument, NULL, ARG_WINDOW },
		{ "compensation", required_argument, NULL, ARG_COMPENSATION },
		{ "indexmem", required_argument, NULL, ARG_INDEXMEM },
		{ "chunk", required_argument, NULL, ARG_CHUNK },
		{ "print-logits", no_argument, NULL, ARG_PRINT_LOGITS },
		{ "evict-every", required_argument, NULL, ARG_EVICT_EVERY },
		{ "evict-bytes", required_argument, NULL, ARG_EVICT_BYTES },
		{ "stats", no_argument, NULL, ARG_STATS },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, ARG_VERSION },
		{},
	};
	static const struct {
		const char *name;
		uint32_t unit;
	} units[] = {
		{ "head", KVD_UNIT_HEAD_TOKEN },
		{ "layer", KVD_UNIT_LAYER_TOKEN },
		{ "block", KVD_UNIT_BLOCK },
		{ "none", KVD_UNIT_NONE },
	};
	bool unit_ok;
	int opt;

	arg_socket = getenv("KVD_SOCKET");
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case ARG_MODEL:
			arg_model = optarg;
			break;
		case ARG_SOCKET:
			arg_socket = optarg;
			break;
		case ARG_NO_DAEMON:
			arg_no_daemon = true;
			break;
		case ARG_TENANT:
			arg_tenant = optarg;
			break;
		case ARG_PROMPT:
			arg_prompt = optarg;
			break;
		case ARG_PROMPT_FILE:
			arg_prompt_file = optarg;
			break;
		case ARG_MAX_NEW:
			if (parse_u32("--max-new", optarg, 0, MAX_NEW_MAX, &arg_max_new) < 0)
				return -EINVAL;
			break;
		case ARG_NO_STOP:
			arg_no_stop = true;
			break;
		case ARG_THREADS:
			if (parse_u32("--threads", optarg, 1, KVDLM_THREADS_MAX, &arg_threads) < 0)
				return -EINVAL;
			break;
		case ARG_UNIT:
			unit_ok = false;
			for (size_t i = 0; i < ELEMENTSOF(units); i++)
				if (strcmp(optarg, units[i].name) == 0) {
					arg_unit = units[i].unit;
					unit_ok = true;
				}
			if (!unit_ok)
				return usage_error("--unit: '%s' is not head, layer, block or none", optarg);
			break;
		case ARG_WINDOW:
			if (parse_u32("--window", optarg, 1, KVD_WINDOW_MAX, &arg_window) < 0)
				return -EINVAL;
			break;
		case ARG_COMPENSATION:
			if (strcmp(optarg, "none") == 0)
				arg_compensation = KVD_COMPENSATION_NONE;
			else if (strcmp(optarg, "moments") == 0) {
				arg_compensation = KVD_COMPENSATION_MOMENTS;
				arg_form = KVD_MOMENTS_PLAIN;
			} else if (strcmp(optarg, "moments-mass") == 0) {
				arg_compensation = KVD_COMPENSATION_MOMENTS;
				arg_form = KVD_MOMENTS_MASS;
			} else if (strcmp(optarg, "moments-bounded") == 0) {
				arg_compensation = KVD_COMPENSATION_MOMENTS;
				arg_form = KVD_MOMENTS_BOUNDED;
			} else if (strcmp(optarg, "latent") == 0)
				arg_compensation = KVD_COMPENSATION_LATENT;
			else
				return usage_error("--compensation: '%s' is not none, moments, moments-mass, "
				                   "moments-bounded or latent", optarg);
			break;
		case ARG_INDEXMEM:
			arg_indexmem = optarg;
			break;
		case ARG_CHUNK:
			if (parse_u32("--chunk", optarg, 1, KVDLM_CHUNK_MAX, &arg_chunk) < 0)
				return -EINVAL;
			break;
		case ARG_PRINT_LOGITS:
			arg_print_logits = true;
			break;
		case ARG_EVICT_EVERY:
			if (parse_u32("--evict-every", optarg, 1, KVDLM_FULL_MAX_TOKENS, &arg_evict_every) < 0)
				return -EINVAL;
			break;
		case ARG_EVICT_BYTES: {
			uint32_t bytes;

			if (parse_u32("--evict-bytes", optarg, 1, UINT32_MAX, &bytes) < 0)
				return -EINVAL;
			arg_evict_bytes = bytes;
			break;
		}
		case ARG_STATS:
			arg_stats = true;
			break;
		case 'h':
			help();
			return 0;
		case ARG_VERSION:
			printf("kvd-lm %s\n", KVD_VERSION);
			return 0;
		default:
			fprintf(stderr, "Try 'kvd-lm --help'.\n");
			return -EINVAL;
		}
	if (optind < argc)
		return usage_error("unexpected argument '%s'", argv[optind]);
	if (!arg_model)
		return usage_error("%s", "--model FILE is required");
	if (arg_prompt && arg_prompt_file)
		return usage_error("%s", "--prompt and --prompt-file exclude each other");
	/* Moments summarise what the daemon evicts: nothing to summarise without eviction. */
	if (arg_compensation != KVD_COMPENSATION_NONE && (arg_no_daemon || arg_unit == KVD_UNIT_NONE))
		return usage_error("%s", "--compensation needs the daemon and a --unit other than none");
	/* The latent memory is read out through learned weights. */
	if (arg_compensation == KVD_COMPENSATION_LATENT && !arg_indexmem)
		return usage_error("%s", "--compensation latent needs --indexmem FILE");
	if (arg_evict_every && (arg_no_daemon || arg_unit == KVD_UNIT_NONE))
		return usage_error("%s", "--evict-every needs the daemon and a --unit other than none");
	if (arg_indexmem && (arg_no_daemon || arg_unit == KVD_UNIT_NONE))
		return usage_error("%s", "--indexmem needs the daemon and a --unit other than none");
	/* --socket from the command line, not $KVD_SOCKET, conflicts with --no-daemon. */
	for (int i = 1; i < argc && arg_no_daemon; i++)
		if (strcmp(argv[i], "--socket") == 0 || strncmp(argv[i], "--socket=", 9) == 0)
			return usage_error("%s", "--socket and --no-daemon exclude each other");
	return 1;
}

/* Reads the prompt file into *ret (malloc'd) and its size. */
static int read_prompt_file(const char *path, char **ret, size_t *ret_size) {
	_cleanup_(closep) int fd = -EBADF;
	_cleanup_(freep) char *buf = NULL;
	size_t n = 0;

	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return negative_errno();
	buf = malloc(PROMPT_FILE_MAX + 1);
	if (!buf)
		return -ENOMEM;
	/* One byte more than allowed, to tell a file at the limit from a longer one. */
	while (n <= PROMPT_FILE_MAX) {
		ssize_t k = read(fd, buf + n, PROMPT_FILE_MAX + 1 - n);

		if (k < 0) {
			if (errno == EINTR)
				continue;
			return negative_errno();
		}
		if (k == 0)
			break;
		n += (size_t)k;
	}
	if (n > PROMPT_FILE_MAX)
		return -EFBIG;
	*ret = TAKE_PTR(buf);
	*ret_size = n;
	return 0;
}

static double now_s(void) {
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The token as kvdlm.py decodes it. */
static void put_token(FILE *f, const struct kvdlm_tokenizer *tok, uint32_t t) {
	size_t n;
	const uint8_t *b = kvdlm_tokenizer_token(tok, t, &n);

	fwrite(b, 1, n, f);
}

static const char *daemon_error(kvd_client *c, int r) {
	const char *msg = c ? kvd_client_last_error(c) : "";

	return msg && *msg ? msg : strerror(-r);
}

/* The tenant's evicted tokens from the daemon's status, or UINT64_MAX when unknown. */
static uint64_t tenant_evicted(kvd_client *c) {
	_cleanup_(kvd_status_freep) kvd_status *st = NULL;
	uint64_t v = UINT64_MAX;

	if (kvd_status_get(c, &st) < 0)
		return UINT64_MAX;
	for (uint32_t i = 0; i < kvd_status_tenants(st); i++) {
		const char *name;

		if (kvd_status_tenant_name(st, i, &name) == 0 && strcmp(name, arg_tenant) == 0)
			(void)kvd_status_tenant_u64(st, i, "evicted_tokens", &v);
	}
	return v;
}

static int run(void) {
	_cleanup_(kvd_client_unrefp) kvd_client *client = NULL;
	_cleanup_(kvdlm_model_freep) struct kvdlm_model *m = NULL;
	_cleanup_(kvdlm_tokenizer_freep) struct kvdlm_tokenizer *tok = NULL;
	_cleanup_(kvdlm_indexmem_freep) struct kvdlm_indexmem *im = NULL;
	_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *cache = NULL;
	_cleanup_(kvdlm_session_freep) struct kvdlm_session *s = NULL;
	_cleanup_(freep) char *file_prompt = NULL;
	_cleanup_(freep) uint32_t *tokens = NULL;
	_cleanup_(freep) float *logits = NULL;
	_cleanup_(freep) uint32_t *out = NULL;
	char err[KVDLM_ERROR_MAX];
	const char *prompt = arg_prompt ? arg_prompt : "";
	size_t prompt_size = strlen(prompt);
	uint32_t n_prompt, max_tokens, n_out = 0, decoded = 0;
	double t0, t_prefill, t_decode;
	struct kvdlm_cache_stats cs;
	int r;

	r = kvdlm_model_load(arg_model, &m, err, sizeof(err));
	if (r < 0) {
		fprintf(stderr, "kvd-lm: %s\n", err);
		return r;
	}
	r = kvdlm_tokenizer_for_model(arg_model, m->cfg.vocab, &tok, err, sizeof(err));
	if (r < 0) {
		fprintf(stderr, "kvd-lm: %s\n", err);
		return r;
	}
	if (arg_indexmem) {
		r = kvdlm_indexmem_load(arg_indexmem, &m->cfg, &im, err, sizeof(err));
		if (r < 0) {
			fprintf(stderr, "kvd-lm: %s\n", err);
			return r;
		}
	}
	if (arg_prompt_file) {
		r = read_prompt_file(arg_prompt_file, &file_prompt, &prompt_size);
		if (r < 0) {
			fprintf(stderr, "kvd-lm: %s: %s\n", arg_prompt_file,
			        r == -EFBIG ? "prompt file too large" : strerror(-r));
			return r;
		}
		prompt = file_prompt;
	}
	tokens = malloc((prompt_size + 1) * sizeof(uint32_t));
	logits = malloc(m->cfg.vocab * sizeof(float));
	out = malloc(MAX(arg_max_new, 1u) * sizeof(uint32_t));
	if (!tokens || !logits || !out)
		return -ENOMEM;
	tokens[0] = KVDLM_BOS;
	n_prompt = 1 + (uint32_t)kvdlm_tokenizer_encode(tok, prompt, prompt_size, tokens + 1);
	if (n_prompt + arg_max_new + SEQ_SLACK > KVDLM_FULL_MAX_TOKENS) {
		fprintf(stderr, "kvd-lm: prompt of %u tokens plus --max-new %u is over %u tokens\n",
		        n_prompt, arg_max_new, KVDLM_FULL_MAX_TOKENS);
		return -EFBIG;
	}
	max_tokens = n_prompt + arg_max_new + SEQ_SLACK;
	if (n_prompt + arg_max_new > m->cfg.max_positions)
		fprintf(stderr, "kvd-lm: warning: %u positions, more than the %u the model was trained for\n",
		        n_prompt + arg_max_new, m->cfg.max_positions);

	if (arg_no_daemon) {
		r = kvdlm_cache_full_new(&m->cfg, max_tokens, &cache);
		if (r < 0) {
			fprintf(stderr, "kvd-lm: cache of %u tokens: %s\n", max_tokens, strerror(-r));
			return r;
		}
	} else {
		struct kvdlm_kvd_model km;

		r = kvd_client_connect(arg_socket, arg_tenant, &client);
		if (r < 0) {
			fprintf(stderr, "kvd-lm: connecting to %s as '%s': %s (is the daemon running? "
			        "--socket, $KVD_SOCKET, or --no-daemon)\n",
			        arg_socket ? arg_socket : KVD_DEFAULT_SOCKET, arg_tenant, strerror(-r));
			return r;
		}
		r = kvdlm_kvd_register_indexed(client, m, "kvd-lm", arg_unit, arg_window, arg_compensation,
		                               im ? &(kvd_index_spec){ im->index_heads, im->index_dim } : NULL,
		                               &km);
		if (r < 0) {
			fprintf(stderr, "kvd-lm: registering the model: %s\n", daemon_error(client, r));
			return r;
		}
		km.form = arg_form;
		r = kvdlm_cache_kvd_new(&km, &m->cfg, max_tokens, &cache);
		if (r < 0) {
			fprintf(stderr, "kvd-lm: opening a sequence of %u tokens: %s\n", max_tokens,
			        daemon_error(client, r));
			return r;
		}
	}
	r = kvdlm_session_new(m, cache, &(struct kvdlm_session_opts){ arg_threads, arg_chunk, im }, &s);
	if (r < 0) {
		fprintf(stderr, "kvd-lm: starting the engine: %s\n", strerror(-r));
		return r;
	}

	t0 = now_s();
	r = kvdlm_prefill(s, tokens, n_prompt, KVDLM_LOGITS_LAST, logits);
	t_prefill = now_s() - t0;
	if (r < 0) {
		fprintf(stderr, "kvd-lm: prefill: %s\n", daemon_error(client, r));
		return r;
	}
	t0 = now_s();
	while (n_out < arg_max_new) {
		uint32_t next = kvdlm_argmax(logits, m->cfg.vocab);

		if (arg_print_logits) {
			printf("logits %u %u", kvdlm_session_position(s), next);
			for (uint32_t i = 0; i < m->cfg.vocab; i++)
				printf(" %.9g", (double)logits[i]);
			putchar('\n');
		} else {
			put_token(stdout, tok, next);
			fflush(stdout);
		}
		out[n_out++] = next;
		if (next == KVDLM_EOS || (next == '\n' && !arg_no_stop) || n_out == arg_max_new)
			break;
		r = kvdlm_decode(s, next, logits);
		if (r < 0) {
			fprintf(stderr, "kvd-lm: decoding at position %u: %s\n", kvdlm_session_position(s),
			        daemon_error(client, r));
			return r;
		}
		if (arg_evict_every && kvdlm_session_position(s) % arg_evict_every == 0) {
			r = kvd_evict(client, arg_tenant, arg_evict_bytes ? arg_evict_bytes :
			              kvd_client_chunk_bytes(client), NULL);
			if (r < 0) {
				fprintf(stderr, "kvd-lm: an eviction at position %u: %s\n",
				        kvdlm_session_position(s), daemon_error(client, r));
				return r;
			}
		}
		decoded++;
	}
	t_decode = now_s() - t0;
	if (arg_print_logits)
		for (uint32_t i = 0; i < n_out; i++)
			put_token(stdout, tok, out[i]);
	if (n_out == 0 || out[n_out - 1] != '\n')
		putchar('\n');
	if (fflush(stdout) != 0) {
		fprintf(stderr, "kvd-lm: writing the output: %s\n", strerror(errno));
		return -EIO;
	}

	if (arg_stats) {
		fprintf(stderr,
		        "kvd-lm: prefill %u tokens in %.3f s (%.1f tokens/s), decode %u tokens in %.3f s "
		        "(%.1f tokens/s); %u threads, %s, cache %s\n",
		        n_prompt, t_prefill, n_prompt / MAX(t_prefill, 1e-9), decoded, t_decode,
		        decoded / MAX(t_decode, 1e-9), kvdlm_session_threads(s), kvdlm_simd_name(),
		        arg_no_daemon ? "private" : "kvd");
		r = kvdlm_cache_stats(cache, &cs);
		if (r < 0) {
			fprintf(stderr, "kvd-lm: reading the cache: %s\n", daemon_error(client, r));
			return r;
		}
		fprintf(stderr,
		        "kvd-lm: %" PRIu64 " positions, %" PRIu64 " of %" PRIu64
		        " table tokens resident (per table %u..%u), %" PRIu64 " eviction rewrites seen\n",
		        cs.positions, cs.resident, cs.positions * cs.tables, cs.resident_min, cs.resident_max,
		        cs.changed);
		if (client) {
			uint64_t ev = tenant_evicted(client);

			if (ev != UINT64_MAX)
				fprintf(stderr, "kvd-lm: the daemon evicted %" PRIu64 " tokens of tenant %s\n", ev,
				        arg_tenant);
		}
	}
	return 0;
}

int main(int argc, char **argv) {
	int r;

	r = parse_argv(argc, argv);
	if (r <= 0)
		return r < 0 ? EXIT_USAGE : EXIT_SUCCESS;
	return run() < 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}
