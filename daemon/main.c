/* SPDX-License-Identifier: MIT */
/*
 * kvd: the node daemon that owns the KV-cache memory of every inference process on the
 * machine. This file parses the command line and wires the parts together.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "backend.h"
#include "common/number.h"
#include "common/size.h"
#include "config.h"
#include "kvd/kvd.h"
#include "log.h"
#include "pool.h"
#include "server.h"

#define EXIT_USAGE 2

static const char *arg_backend = "host";
static const char *arg_socket = KVD_DEFAULT_SOCKET;
static uint64_t arg_pool_size = UINT64_C(1) << 30;
static uint64_t arg_chunk_size = UINT64_C(4) << 20;
static uint64_t arg_budget = UINT64_MAX; /* the pool */
static struct server_limits arg_limits = {
	.max_connections = 256,
	.max_tenants = 64,
	.max_models = 16,
	.max_seqs = 4096,
	.max_seq_tokens = 1u << 20,
	.max_descriptor_bytes = UINT64_C(64) << 20,
	.hello_timeout_ms = 5000,
	.max_tx_bytes = UINT64_C(4) << 20,
	.max_violations = 8,
};

static void help(void) {
	printf("Usage: kvd [OPTIONS]\n"
	       "\n"
	       "The kvd KV-cache daemon: owns a pool of KV memory and shares it with inference\n"
	       "processes through a Unix socket, within one node-wide budget.\n"
	       "\n"
	       "  --backend NAME          memory backend: host, or auto (picks host: the only one\n"
	       "                          built so far) [host]\n"
	       "  --socket PATH           listening socket [%s]\n"
	       "  --pool-size SIZE        pool capacity, whole chunks [1GiB]\n"
	       "  --chunk-size SIZE       unit of allocation and sharing, a multiple of the page\n"
	       "                          size [4MiB]\n"
	       "  --budget SIZE           node budget, at most the pool [the pool size]\n"
	       "  --max-connections N     client connections in total [%u]\n"
	       "  --max-tenants N         tenants known at once [%u]\n"
	       "  --max-models N          models per connection [%u]\n"
	       "  --max-seqs N            open sequences per connection [%u]\n"
	       "  --max-seq-tokens N      tokens one sequence may hold per (layer, kv head) [%u]\n"
	       "  --hello-timeout MS      time a new connection has to say hello [%" PRIu64 "]\n"
	       "  --log-level LEVEL       debug, info, notice, warning or err [info]\n"
	       "  -h, --help              show this help and exit\n"
	       "  --version               show the version and exit\n"
	       "\n"
	       "SIZE takes K, M, G, T suffixes (binary: KiB, MiB, GiB, TiB).\n"
	       "Exit status: 0 after a clean stop (SIGTERM, SIGINT), 1 when the pool, socket or\n"
	       "event loop cannot be set up or fails, 2 for a bad command line.\n",
	       KVD_DEFAULT_SOCKET, arg_limits.max_connections, arg_limits.max_tenants,
	       arg_limits.max_models, arg_limits.max_seqs, arg_limits.max_seq_tokens,
	       arg_limits.hello_timeout_ms);
}

static int parse_u32(const char *opt, const char *s, uint32_t min, uint32_t *ret) {
	if (number_parse_u32(s, min, UINT32_MAX, ret) < 0) {
		fprintf(stderr, "kvd: --%s: invalid number '%s' (%u..%u)\n", opt, s, min, UINT32_MAX);
		return -EINVAL;
	}
	return 0;
}

static int parse_size_arg(const char *opt, const char *s, uint64_t *ret) {
	if (size_parse(s, ret) < 0) {
		fprintf(stderr, "kvd: --%s: invalid size '%s'\n", opt, s);
		return -EINVAL;
	}
	return 0;
}

static int parse_argv(int argc, char *argv[]) {
	enum {
		ARG_BACKEND = 0x100,
		ARG_SOCKET,
		ARG_POOL_SIZE,
		ARG_CHUNK_SIZE,
		ARG_BUDGET,
		ARG_MAX_CONNECTIONS,
		ARG_MAX_TENANTS,
		ARG_MAX_MODELS,
		ARG_MAX_SEQS,
		ARG_MAX_SEQ_TOKENS,
		ARG_HELLO_TIMEOUT,
		ARG_LOG_LEVEL,
		ARG_VERSION,
	};
	static const struct option options[] = {
		{ "backend", required_argument, NULL, ARG_BACKEND },
		{ "socket", required_argument, NULL, ARG_SOCKET },
		{ "pool-size", required_argument, NULL, ARG_POOL_SIZE },
		{ "chunk-size", required_argument, NULL, ARG_CHUNK_SIZE },
		{ "budget", required_argument, NULL, ARG_BUDGET },
		{ "max-connections", required_argument, NULL, ARG_MAX_CONNECTIONS },
		{ "max-tenants", required_argument, NULL, ARG_MAX_TENANTS },
		{ "max-models", required_argument, NULL, ARG_MAX_MODELS },
		{ "max-seqs", required_argument, NULL, ARG_MAX_SEQS },
		{ "max-seq-tokens", required_argument, NULL, ARG_MAX_SEQ_TOKENS },
		{ "hello-timeout", required_argument, NULL, ARG_HELLO_TIMEOUT },
		{ "log-level", required_argument, NULL, ARG_LOG_LEVEL },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, ARG_VERSION },
		{}
	};
	static const char *const levels[] = {
		[LOG_ERR] = "err", [LOG_WARNING] = "warning", [LOG_NOTICE] = "notice",
		[LOG_INFO] = "info", [LOG_DEBUG] = "debug",
	};
	uint32_t ms;
	int c, r = 0;

	while ((c = getopt_long(argc, argv, "h", options, NULL)) >= 0) {
		const char *name = c >= ARG_BACKEND ? options[c - ARG_BACKEND].name : "";

		switch (c) {
		case 'h':
			help();
			return 0;
		case ARG_VERSION:
			printf("kvd %s (protocol %d)\n", KVD_VERSION, KVD_PROTOCOL_VERSION_MAX);
			return 0;
		case ARG_BACKEND:
			if (!backend_find(optarg)) {
				fprintf(stderr, "kvd: --backend: unknown backend '%s' (host, auto)\n", optarg);
				return -EINVAL;
			}
			arg_backend = optarg;
			break;
		case ARG_SOCKET:
			arg_socket = optarg;
			break;
		case ARG_POOL_SIZE:
			r = parse_size_arg(name, optarg, &arg_pool_size);
			break;
		case ARG_CHUNK_SIZE:
			r = parse_size_arg(name, optarg, &arg_chunk_size);
			break;
		case ARG_BUDGET:
			r = parse_size_arg(name, optarg, &arg_budget);
			break;
		case ARG_MAX_CONNECTIONS:
			r = parse_u32(name, optarg, 1, &arg_limits.max_connections);
			break;
		case ARG_MAX_TENANTS:
			r = parse_u32(name, optarg, 1, &arg_limits.max_tenants);
			break;
		case ARG_MAX_MODELS:
			r = parse_u32(name, optarg, 1, &arg_limits.max_models);
			break;
		case ARG_MAX_SEQS:
			r = parse_u32(name, optarg, 1, &arg_limits.max_seqs);
			break;
		case ARG_MAX_SEQ_TOKENS:
			r = parse_u32(name, optarg, 1, &arg_limits.max_seq_tokens);
			break;
		case ARG_HELLO_TIMEOUT:
			r = parse_u32(name, optarg, 1, &ms);
			arg_limits.hello_timeout_ms = ms;
			break;
		case ARG_LOG_LEVEL:
			r = -EINVAL;
			for (size_t i = 0; i < ELEMENTSOF(levels); i++)
				if (levels[i] && strcmp(levels[i], optarg) == 0) {
					log_set_max_level((int)i);
					r = 0;
				}
			if (r < 0)
				fprintf(stderr, "kvd: --log-level: unknown level '%s'\n", optarg);
			break;
		default:
			return -EINVAL;
		}
		if (r < 0)
			return r;
	}
	if (optind < argc) {
		fprintf(stderr, "kvd: unexpected argument '%s'\n", argv[optind]);
		return -EINVAL;
	}
	return 1;
}

/* Every chunk and descriptor in flight is an fd: take what the hard limit allows. */
static void raise_fd_limit(void) {
	struct rlimit rl;

	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
			log_warning("cannot raise the fd limit, ignoring");
	}
}

int main(int argc, char *argv[]) {
	const struct backend_ops *ops;
	struct server *srv = NULL;
	struct pool *pool = NULL;
	int r;

	log_setup();
	r = parse_argv(argc, argv);
	if (r <= 0)
		return r < 0 ? EXIT_USAGE : EXIT_SUCCESS;

	ops = backend_find(arg_backend);
	if (arg_chunk_size % ops->granularity() != 0 || arg_chunk_size < (UINT64_C(64) << 10)) {
		fprintf(stderr, "kvd: --chunk-size must be at least 64KiB and a multiple of %" PRIu64 " bytes\n",
		        ops->granularity());
		return EXIT_USAGE;
	}
	if (arg_pool_size < arg_chunk_size) {
		fprintf(stderr, "kvd: --pool-size must hold at least one chunk\n");
		return EXIT_USAGE;
	}
	if (arg_budget != UINT64_MAX && arg_budget > arg_pool_size) {
		fprintf(stderr, "kvd: --budget must be at most --pool-size\n");
		return EXIT_USAGE;
	}
	raise_fd_limit();

	r = pool_new(ops, arg_pool_size, arg_chunk_size, MIN(arg_budget, arg_pool_size), &pool);
	if (r < 0) {
		log_error_errno(r, "cannot set up the pool");
		return EXIT_FAILURE;
	}
	if (arg_backend && strcmp(arg_backend, "auto") == 0)
		log_info("backend auto: using %s", ops->name);
	r = server_new(pool, &arg_limits, arg_socket, &srv);
	if (r >= 0)
		r = server_run(srv);
	server_free(srv);
	pool_free(pool);
	return r < 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}
