/* SPDX-License-Identifier: MIT */
/*
 * kvd-bench lookup: what asking the node how much of a prompt it holds costs
 * (kvd_prefix_lookup), against a running daemon: by keys computed beforehand, and by token
 * ids (kvd_prefix_keys, then the lookup), with the prompt held by a live sequence and then
 * by the prefix cache alone; and a prefix open that finds the whole prompt in the cache
 * against a plain open and grow of the same tokens; then --engines processes of one tenant
 * serving requests of one system prompt and a turn each, without and with prefix opens:
 * block bytes held, prefill tokens computed, hits. The model is Llama-3.1-8B's KV (8 kv
 * heads of 128, f16, blocks of 16 tokens) with --layers layers. Figures in
 * docs/benchmarks.md. A benchmark: nothing asserts on timings.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "basic/macro.h"
#include "basic/number.h"
#include "basic/time-util.h"
#include "bench.h"
#include "kvd/kvd.h"
#include "latency.h"

#define TOKENS_MAX (1u << 20)
#define ITERATIONS_MAX 1000000u
#define BLOCK_TOKENS 16

static int usage(FILE *f) {
	fprintf(f,
	        "Usage: kvd-bench lookup [OPTIONS]\n\n"
	        "Times kvd_prefix_lookup of a prompt's keys, and of its token ids (hashed first),\n"
	        "against the daemon at --socket: while a sequence holds the prompt, then while\n"
	        "only the prefix cache does; then a prefix open that finds the prompt cached\n"
	        "against a plain open and grow of as many tokens. The model: --layers layers of\n"
	        "8 kv heads of 128, f16, blocks of 16 tokens (64 KiB a layer). The pool must hold\n"
	        "two prompts, and the tenant's max-cached-percent one (kvd's default, 25%%, with a\n"
	        "budget of four times the prompt).\n\n"
	        "Options:\n"
	        "  --socket PATH     Daemon socket (default: $KVD_SOCKET if set, else %s)\n"
	        "  --tokens N        Tokens of the prompt, 16..%u (default: 32768)\n"
	        "  --layers N        Layers of the model, 1..64 (default: 8)\n"
	        "  --iterations N    Lookups timed of each kind, 1..%u (default: 1000)\n"
	        "  --engines N       Engine processes of the system-prompt scenario, 0..64\n"
	        "                    (default: 8; 0: none): a 2048-token system prompt and a\n"
	        "                    256-token turn each\n"
	        "  -h, --help        Show this help\n",
	        KVD_DEFAULT_SOCKET, TOKENS_MAX, ITERATIONS_MAX);
	return f == stdout ? 0 : 2;
}

static void print_row(const char *what, uint64_t *ns, uint32_t n) {
	latency_sort(ns, n);
	printf("  %-36s p50 %9.1f us  p99 %9.1f us\n", what, latency_percentile_us(ns, n, 50),
	       latency_percentile_us(ns, n, 99));
}

/* Times n lookups of the prompt (by_tokens: hashing its token ids first); each must find
 * `want` blocks. */
static int time_lookups(kvd_client *c, int m, const uint32_t *tokens, uint32_t n_tokens,
                        uint8_t *keys, uint32_t n_keys, bool by_tokens, uint64_t want,
                        uint64_t *ns, uint32_t n) {
	uint8_t root[KVD_KEY_BYTES];

	(void)kvd_key_root("0", root);
	for (uint32_t i = 0; i < n; i++) {
		uint64_t t0 = now_ns();
		int64_t r = by_tokens ? kvd_prefix_keys(root, tokens, n_tokens, BLOCK_TOKENS, NULL,
		                                        keys, n_keys) : 0;

		if (r >= 0)
			r = kvd_prefix_lookup(c, m, keys, n_keys, NULL);
		ns[i] = now_ns() - t0;
		if (r < 0 || (uint64_t)r != want) {
			fprintf(stderr, "kvd-bench lookup: found %" PRId64 " blocks, not %" PRIu64 ": %s\n",
			        r, want, r < 0 ? kvd_strerror((int)r) : "");
			return -EIO;
		}
	}
	return 0;
}

#define SYSTEM_TOKENS 2048
#define TURN_TOKENS 256

/* One engine of the scenario, a child process: opens its request (with its prompt's keys
 * when sharing), prefills what it did not find, publishes, reports what it found on done_fd
 * and holds the sequence until go_fd closes. Exits 0, or 1 on a failure. */
static int engine(const char *socket, const kvd_model_spec *spec, const uint32_t *prompt,
                  uint32_t n, bool share, int done_fd, int go_fd) {
	uint32_t n_keys = n / BLOCK_TOKENS, found;
	uint8_t root[KVD_KEY_BYTES], *keys = malloc((size_t)n_keys * KVD_KEY_BYTES);
	kvd_client *c = NULL;
	kvd_seq *s = NULL;
	char x;
	int m, r;

	if (!keys || kvd_client_connect(socket, "bench-prefix", &c) < 0)
		return 1;
	m = kvd_model_register(c, spec);
	(void)kvd_key_root("0", root);
	(void)kvd_prefix_keys(root, prompt, n, BLOCK_TOKENS, NULL, keys, n_keys);
	{
		kvd_open_params p = { .size = sizeof(p), .model_id = m, .max_tokens = n,
			              .n_prefix_keys = share ? n_keys : 0, .prefix_keys = keys };

		r = m < 0 ? m : kvd_seq_open_params(c, &p, &s);
	}
	found = r >= 0 ? (uint32_t)kvd_seq_tokens(s, 0, 0) : 0;
	/* The prefill of the rest; the engine's own K/V writes are not what is measured. */
	for (uint32_t done = found; r >= 0 && done < n; done += 1024)
		r = kvd_seq_grow(s, MIN(1024u, n - done));
	if (r >= 0 && share)
		r = kvd_seq_publish(s, n_keys);
	if (r < 0) {
		fprintf(stderr, "kvd-bench lookup: engine: %s %s\n", kvd_strerror(r),
		        kvd_client_last_error(c));
		return 1;
	}
	if (write(done_fd, &found, sizeof(found)) != sizeof(found))
		return 1;
	(void)!read(go_fd, &x, 1);
	kvd_seq_release(s);
	kvd_client_unref(c);
	free(keys);
	return 0;
}

/* The scenario without (share false) and with prefix opens: each engine's request starts
 * after the previous one's prefill. */
static int engines_run(const char *socket, uint32_t layers, uint32_t n_engines, bool share) {
	kvd_model_spec spec = { share ? "bench-prefix-shared" : "bench-prefix", layers, 32, 8,
		                128, KVD_DTYPE_F16, BLOCK_TOKENS, KVD_LAYOUT_PER_LAYER };
	uint32_t n = SYSTEM_TOKENS + TURN_TOKENS, prompt[SYSTEM_TOKENS + TURN_TOKENS];
	uint64_t computed = 0, hits = 0, bytes = 0, block_bytes = (uint64_t)layers * 65536;
	uint64_t one_copy = ((uint64_t)SYSTEM_TOKENS / BLOCK_TOKENS +
	                     (uint64_t)n_engines * TURN_TOKENS / BLOCK_TOKENS) * block_bytes;
	pid_t pids[64];
	int go[2], rc = 0;
	kvd_client *admin = NULL;
	kvd_status *st = NULL;
	uint64_t t0 = now_ns(), events = 0, events0 = 0;

	if (pipe(go) < 0)
		return -errno;
	/* The daemon's KV events before, to count those the scenario makes (with --kv-events). */
	if (kvd_client_connect(socket, NULL, &admin) == 0 && kvd_status_get(admin, &st) == 0)
		(void)kvd_status_u64(st, "kv_events", &events0);
	st = kvd_status_free(st);
	for (uint32_t i = 0; i < n_engines; i++) {
		int done[2];
		uint32_t found = 0;

		/* The system prompt, then this engine's own turn. */
		for (uint32_t k = 0; k < n; k++)
			prompt[k] = k < SYSTEM_TOKENS ? (k * 2654435761u) % 128256 : 100000 + i * 1000 + k;
		if (pipe(done) < 0)
			return -errno;
		pids[i] = fork();
		if (pids[i] == 0) {
			close(go[1]);
			close(done[0]);
			_exit(engine(socket, &spec, prompt, n, share, done[1], go[0]));
		}
		close(done[1]);
		if (pids[i] < 0 || read(done[0], &found, sizeof(found)) != sizeof(found))
			rc = -EIO;
		close(done[0]);
		if (rc < 0)
			break;
		computed += n - found;
		hits += found > 0;
	}
	if (rc == 0 && admin && kvd_status_get(admin, &st) == 0)
		for (uint32_t t = 0; t < kvd_status_tenants(st); t++) {
			const char *name;

			if (kvd_status_tenant_name(st, t, &name) == 0 && strcmp(name, "bench-prefix") == 0)
				(void)kvd_status_tenant_u64(st, t, "block_bytes", &bytes);
		}
	if (st)
		(void)kvd_status_u64(st, "kv_events", &events);
	close(go[0]);
	close(go[1]);
	for (uint32_t i = 0; i < n_engines; i++) {
		int status;

		if (pids[i] > 0 && (waitpid(pids[i], &status, 0) < 0 || !WIFEXITED(status) ||
		                     WEXITSTATUS(status) != 0))
			rc = -EIO;
	}
	kvd_status_free(st);
	kvd_client_unref(admin);
	if (rc < 0)
		return rc;
	printf("  %-22s %10.1f MiB held (%.3fx one copy of the prompt and the turns), "
	       "%" PRIu64 " prefill tokens computed, %" PRIu64 " of %u opens hit\n",
	       share ? "with prefix opens" : "without", bytes / 1048576.0,
	       (double)bytes / (double)one_copy, computed, hits, n_engines);
	/* With the daemon's --kv-events: what the scenario made it publish. */
	if (events > events0)
		printf("  %-22s %" PRIu64 " KV events in %.3f s: %.0f a second\n", "",
		       events - events0, (now_ns() - t0) / 1e9,
		       (events - events0) / ((now_ns() - t0) / 1e9));
	return 0;
}

int bench_lookup(int argc, char **argv) {
	enum { OPT_SOCKET = 256, OPT_TOKENS, OPT_LAYERS, OPT_ITERATIONS, OPT_ENGINES };
	static const struct option options[] = {
		{ "socket", required_argument, NULL, OPT_SOCKET },
		{ "tokens", required_argument, NULL, OPT_TOKENS },
		{ "layers", required_argument, NULL, OPT_LAYERS },
		{ "engines", required_argument, NULL, OPT_ENGINES },
		{ "iterations", required_argument, NULL, OPT_ITERATIONS },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	const char *socket = getenv("KVD_SOCKET");
	uint32_t n_tokens = 32768, layers = 8, iterations = 1000, n_engines = 8, n_keys;
	_cleanup_(freep) uint64_t *ns = NULL;
	_cleanup_(freep) uint32_t *tokens = NULL;
	_cleanup_(freep) uint8_t *keys = NULL;
	kvd_model_spec spec = { "bench-lookup", 0, 32, 8, 128, KVD_DTYPE_F16, BLOCK_TOKENS,
		                KVD_LAYOUT_PER_LAYER };
	uint8_t root[KVD_KEY_BYTES];
	kvd_client *c = NULL;
	kvd_seq *s = NULL;
	int opt, m, r, rc = 1;

	if (!socket || !*socket)
		socket = KVD_DEFAULT_SOCKET;
	optind = 0;
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case OPT_SOCKET:
			socket = optarg;
			break;
		case OPT_TOKENS:
		case OPT_LAYERS:
		case OPT_ITERATIONS:
		case OPT_ENGINES: {
			uint32_t lo = opt == OPT_TOKENS ? BLOCK_TOKENS : opt == OPT_ENGINES ? 0 : 1;
			uint32_t hi = opt == OPT_TOKENS ? TOKENS_MAX : opt == OPT_LAYERS ? 64 :
			              opt == OPT_ENGINES ? 64 : ITERATIONS_MAX;
			uint32_t *v = opt == OPT_TOKENS ? &n_tokens : opt == OPT_LAYERS ? &layers :
			              opt == OPT_ENGINES ? &n_engines : &iterations;

			if (number_parse_u32(optarg, lo, hi, v) < 0) {
				fprintf(stderr, "kvd-bench lookup: '%s' is not in %u..%u\n", optarg, lo, hi);
				return 2;
			}
			break;
		}
		case 'h':
			return usage(stdout);
		default:
			return usage(stderr);
		}
	if (optind < argc) {
		fprintf(stderr, "kvd-bench lookup: unexpected argument '%s'\n", argv[optind]);
		return 2;
	}
	spec.layers = layers;
	n_keys = n_tokens / BLOCK_TOKENS;
	ns = calloc(iterations, sizeof(*ns));
	tokens = calloc(n_tokens, sizeof(*tokens));
	keys = calloc(n_keys, KVD_KEY_BYTES);
	if (!ns || !tokens || !keys) {
		fprintf(stderr, "kvd-bench lookup: out of memory\n");
		return 1;
	}
	for (uint32_t i = 0; i < n_tokens; i++)
		tokens[i] = (i * 2654435761u) % 128256;   /* Llama 3's vocabulary */
	(void)kvd_key_root("0", root);
	(void)kvd_prefix_keys(root, tokens, n_tokens, BLOCK_TOKENS, NULL, keys, n_keys);

	r = kvd_client_connect(socket, "bench-lookup", &c);
	if (r < 0) {
		fprintf(stderr, "kvd-bench lookup: connecting to %s: %s\n", socket, kvd_strerror(r));
		return 1;
	}
	m = kvd_model_register(c, &spec);
	if (m < 0) {
		fprintf(stderr, "kvd-bench lookup: registering the model: %s %s\n", kvd_strerror(m),
		        kvd_client_last_error(c));
		goto out;
	}
	{
		kvd_open_params p = { .size = sizeof(p), .model_id = m, .max_tokens = n_tokens,
			              .n_prefix_keys = n_keys, .prefix_keys = keys };

		r = kvd_seq_open_params(c, &p, &s);
	}
	/* In steps: one grow maps at most 253 new chunks. From what the open found: an earlier
	 * run against the same daemon may have left the prompt's head in its cache. */
	for (uint32_t done = r >= 0 ? (uint32_t)kvd_seq_tokens(s, 0, 0) : 0; r >= 0 && done < n_tokens;
	     done += 1024)
		r = kvd_seq_grow(s, MIN(1024u, n_tokens - done));
	if (r >= 0)
		r = kvd_seq_publish(s, n_keys);
	if (r < 0) {
		fprintf(stderr, "kvd-bench lookup: a prompt of %u tokens: %s %s\n", n_tokens,
		        kvd_strerror(r), kvd_client_last_error(c));
		goto out;
	}
	printf("kvd-bench lookup: a prompt of %u tokens (%u blocks of %u layers), %u lookups each\n",
	       n_tokens, n_keys, layers, iterations);
	for (int held = 0; held < 2; held++) {
		printf("%s:\n", held == 0 ? "held by a sequence" : "held by the prefix cache alone");
		if (held == 1) {
			kvd_seq_release(s);
			s = NULL;
		}
		for (int by_tokens = 0; by_tokens < 2; by_tokens++) {
			r = time_lookups(c, m, tokens, n_tokens, keys, n_keys, by_tokens, n_keys, ns,
			                 iterations);
			if (r < 0)
				goto out;
			print_row(by_tokens ? "by token ids (keys hashed, lookup)" : "by keys", ns,
			          iterations);
		}
	}
	/* An open that finds the cached prompt, against an open and grow of as many tokens. */
	for (int kind = 0; kind < 2; kind++) {
		uint32_t n = MIN(iterations, 200u);

		for (uint32_t i = 0; i < n; i++) {
			kvd_open_params p = { .size = sizeof(p), .model_id = m, .max_tokens = n_tokens,
				              .n_prefix_keys = kind ? 0 : n_keys, .prefix_keys = keys };
			uint64_t t0 = now_ns();

			r = kvd_seq_open_params(c, &p, &s);
			for (uint32_t done = 0; r >= 0 && kind == 1 && done < n_tokens; done += 1024)
				r = kvd_seq_grow(s, MIN(1024u, n_tokens - done));
			ns[i] = now_ns() - t0;
			if (r >= 0 && kind == 0 && kvd_seq_tokens(s, 0, 0) != (int64_t)n_keys * BLOCK_TOKENS)
				r = -EIO;
			kvd_seq_release(s);
			s = NULL;
			if (r < 0) {
				fprintf(stderr, "kvd-bench lookup: open: %s %s\n", kvd_strerror(r),
				        kvd_client_last_error(c));
				goto out;
			}
		}
		print_row(kind ? "open and grow of as many tokens" : "prefix open, prompt cached", ns, n);
	}
	if (n_engines > 0) {
		printf("%u engines of tenant bench-prefix, a request each: a %u-token system prompt "
		       "and a %u-token turn of its own:\n", n_engines, SYSTEM_TOKENS, TURN_TOKENS);
		for (int share = 0; share < 2; share++) {
			r = engines_run(socket, layers, n_engines, share);
			if (r < 0) {
				fprintf(stderr, "kvd-bench lookup: the engines: %s\n", kvd_strerror(r));
				goto out;
			}
		}
	}
	rc = 0;
out:
	kvd_seq_release(s);
	kvd_client_unref(c);
	return rc;
}
