/* SPDX-License-Identifier: MIT */
/*
 * kvd: the node daemon that owns the KV-cache memory of every inference process on the
 * machine. This file reads the settings (the command line over the config file, see
 * settings.h) and wires the parts together.
 */
#include <errno.h>
#include <limits.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>

#include "access.h"
#include "admin.h"
#include "backend.h"
#include "basic/macro.h"
#include "basic/size.h"
#include "keep.h"
#include "log.h"
#include "policy.h"
#include "pool.h"
#include "server.h"
#include "settings.h"
#include "tier.h"
#include "warnings.h"

#define EXIT_USAGE 2

/* The command line: kept for the whole run, since every reload puts it over the file. */
static struct settings arg_flags;

static void print_errors(const struct inifile_errors *e) {
	for (unsigned i = 0; i < e->n; i++)
		fprintf(stderr, "%s\n", e->msg[i]);
	if (e->dropped)
		fprintf(stderr, "kvd: %u more errors\n", e->dropped);
}

/*
 * --check-config: every error, or what a start would do with the settings: the warnings
 * it would log, the backend and pool, every [kvd] value with where it comes from, and
 * what the file declares for each tenant.
 */
static int check_config(const struct settings *s, const struct inifile_errors *e, int r,
                        const struct backend_ops *ops, uint64_t pool_bytes, const char *backend) {
	char min[32], max[32], value[256], where[PATH_MAX + 64], warnings[WARNINGS_MAX];
	const struct setting *table;
	uint64_t mins = 0;
	size_t n;

	if (r < 0) {
		print_errors(e);
		return r == -ENOMEM ? EXIT_FAILURE : EXIT_USAGE;
	}
	if (s->path)
		printf("%s: OK\n", s->path);
	else
		printf("no %s: the defaults and flags are OK\n", s->config);
	for (uint32_t i = 0; i < s->n_tenants; i++)
		mins += s->tenants[i].min_bytes;
	warnings_of_settings(ops->host_access, pool_bytes,
	                     MIN(settings_budget(s, pool_bytes), pool_bytes), mins, warnings);
	for (const char *l = warnings, *end; *l; l = end + 1) {
		end = strchr(l, '\n');
		printf("warning: %.*s\n", (int)(end - l), l);
	}
	printf("backend %s: %s; pool %llu MiB\n", settings_backend_to_string(s->backend), backend,
	       (unsigned long long)(pool_bytes >> 20));
	/* The effective values, as a start takes them (kvd.conf(5) says what each means). */
	printf("[kvd]\n");
	table = settings_table(&n);
	for (size_t i = 0; i < n; i++) {
		if (table[i].flags & SETTING_FLAG_ONLY)
			continue;
		settings_format(s, i, value, sizeof(value));
		if (s->source[i] == SOURCE_CONFIG)
			snprintf(where, sizeof(where), "%s:%u", s->path ? s->path : "?", s->line[i]);
		else
			snprintf(where, sizeof(where), "%s", s->source[i] == SOURCE_FLAG ? "flag" : "default");
		printf("%s = %s  (%s)\n", table[i].name, value, where);
	}
	for (uint32_t i = 0; i < s->n_tenants; i++) {
		const struct settings_tenant *t = &s->tenants[i];

		size_format(t->min_bytes, min, sizeof(min));
		if (t->max_bytes == KVD_TENANT_NO_CAP)
			snprintf(max, sizeof(max), "none");
		else
			size_format(t->max_bytes, max, sizeof(max));
		printf("tenant %s: min %s, max %s, weight %" PRIu32 ", policy %s, tier %s, recall %" PRIu32
		       "%s%s%s%s\n",
		       t->name, min, max, t->weight, kvd_policy_to_string((enum kvd_policy)t->policy),
		       tier_mode_to_string(t->tier), t->recall,
		       t->allow_users ? ", allow-users " : "", t->allow_users ? t->allow_users : "",
		       t->allow_groups ? ", allow-groups " : "", t->allow_groups ? t->allow_groups : "");
	}
	/* A name nobody has is not an error (the user may come later), but it grants nothing
	 * now, and an operator checking a file wants to know. */
	(void)access_check_names(s, stdout);
	return EXIT_SUCCESS;
}

/*
 * The daemon's memory maps every tenant's KV: no core dump of it, and no ptrace or
 * /proc/PID/mem by processes of the same user (a client running as kvd's user, or a
 * compromised helper); only root (CAP_SYS_PTRACE) still can.
 */
static void keep_memory_private(void) {
	if (prctl(PR_SET_DUMPABLE, 0) < 0)
		log_warning("cannot mark the daemon not dumpable (%m): its memory, every tenant's "
		            "KV, may end up in a core dump");
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

/*
 * Opens the backend cfg names (auto: the one it picks on this machine) and sizes the pool
 * as a start does: pool-size, or pool-percent of the free memory of the GPU that has least,
 * the same share on every device (pool.h). Returns 0, or -errno with why said in why.
 */
static int resolve_pool(const struct settings *cfg, const struct backend_ops **ret_ops,
                        uint32_t *ret_devices, uint64_t *ret_pool, char *why, size_t why_n) {
	const struct backend_device *dev;
	uint32_t n_devices;
	uint64_t pool_bytes = cfg->pool_size;
	int r;

	r = backend_open(settings_backend_to_string(cfg->backend), cfg->devices, ret_ops, why, why_n);
	if (r < 0)
		return r;
	n_devices = backend_n_devices();
	dev = backend_device(0);
	for (uint32_t i = 1; dev && i < n_devices; i++)
		if (backend_device(i)->free_bytes < dev->free_bytes)
			dev = backend_device(i);
	if (cfg->pool_percent != 0 && dev) {
		pool_bytes = dev->free_bytes / 100 * cfg->pool_percent / cfg->chunk_size * cfg->chunk_size;
		if (pool_bytes == 0) {
			snprintf(why, why_n, "pool-percent %u of the %llu MiB free on GPU %d is less than "
			         "one chunk", cfg->pool_percent, (unsigned long long)(dev->free_bytes >> 20),
			         dev->index);
			return -EINVAL;
		}
	}
	*ret_devices = n_devices;
	*ret_pool = pool_bytes;
	return 0;
}

int main(int argc, char *argv[]) {
	_cleanup_(settings_done) struct settings cfg = {};
	struct inifile_errors errors = {};
	uint32_t n_devices = 0;
	const struct backend_ops *ops = NULL;
	struct server_limits limits;
	uint64_t pool_bytes = 0;
	char why[512] = "";
	struct admin *admin = NULL;
	struct server *srv = NULL;
	struct pool *pool = NULL;
	struct keep *keep = NULL;
	sigset_t mask;
	int r;

	log_setup();
	/* SIGHUP kills by default: one sent before the loop reads signals must wait for it. */
	sigemptyset(&mask);
	sigaddset(&mask, SIGHUP);
	sigprocmask(SIG_BLOCK, &mask, NULL);

	r = settings_init(&arg_flags);
	if (r >= 0)
		r = settings_parse_argv(&arg_flags, argc, argv);
	if (r <= 0) {
		settings_done(&arg_flags);
		return r == 0 ? EXIT_SUCCESS : r == -ENOMEM ? EXIT_FAILURE : EXIT_USAGE;
	}
	r = settings_init(&cfg);
	if (r >= 0)
		r = settings_load(&cfg, &arg_flags, NULL, &errors);
	/* The backend and the pool as this start makes them, and the file against them: the
	 * same verdict for --check-config as for a start on this machine, every error at once
	 * (a file with errors is still checked against the pool, with what did parse). */
	if (r >= 0 || r == -EINVAL) {
		int q = resolve_pool(&cfg, &ops, &n_devices, &pool_bytes, why, sizeof(why));

		if (q < 0) {
			print_errors(&errors);
			if (arg_flags.check_config)
				fprintf(stderr, "kvd: %s\n", why);
			else
				log_error("%s", why);
			inifile_errors_done(&errors);
			backend_close();
			settings_done(&arg_flags);
			return EXIT_FAILURE;
		}
		settings_check_pool(&cfg, ops->granularity(), pool_bytes * n_devices, &errors);
		if (inifile_errors_count(&errors) > 0)
			r = -EINVAL;
	}
	if (arg_flags.check_config || r < 0) {
		if (arg_flags.check_config) {
			r = check_config(&cfg, &errors, r, ops, pool_bytes * n_devices, why);
		} else {
			print_errors(&errors);
			r = r == -ENOMEM ? EXIT_FAILURE : EXIT_USAGE;
		}
		inifile_errors_done(&errors);
		backend_close();
		settings_done(&arg_flags);
		return r;
	}
	log_set_max_level(cfg.log_level);
	keep_memory_private();
	raise_fd_limit();

	log_info("backend %s: %s", settings_backend_to_string(cfg.backend), why);
	if (cfg.pool_percent != 0 && backend_device(0))
		log_info("pool-percent %u: %llu MiB on each of %u GPU%s", cfg.pool_percent,
		         (unsigned long long)(pool_bytes >> 20), n_devices, n_devices == 1 ? "" : "s");
	else if (cfg.pool_percent != 0)
		log_notice("pool-percent applies to a GPU pool only: using pool-size");
	r = pool_new(ops, n_devices, pool_bytes, cfg.chunk_size, MIN(settings_budget(&cfg, pool_bytes * n_devices), pool_bytes * n_devices),
	             &pool);
	if (r < 0) {
		log_error_errno(r, "cannot set up the pool");
		goto finish;
	}
	/* Before the server: the fd store's fds come in with the listening socket. */
	r = keep_new(pool, cfg.restore_claim_ms, &keep);
	if (r < 0) {
		log_error_errno(r, "cannot take the fds passed by the service manager");
		goto finish;
	}
	admin_limits(&cfg, &limits);
	r = server_new(pool, &limits, cfg.socket, keep->sockets, keep->n_sockets, &srv);
	keep->n_sockets = 0;
	if (r < 0)
		goto finish;
	srv->keep = keep;
	srv->backend_fell_back = cfg.backend == SETTINGS_BACKEND_AUTO && ops->host_access;
	if (srv->backend_fell_back && backend_nvidia_driver_loaded())
		snprintf(srv->gpu_unreachable, sizeof(srv->gpu_unreachable), "%s", why);
	/* From here the admin holds the settings the server points into (socket, metrics). */
	r = admin_new(srv, &cfg, &arg_flags, &admin);
	if (r < 0) {
		log_error_errno(r, "cannot set up the settings");
		goto finish;
	}
	srv->admin = admin;
	/* Once the config file's tenants exist, so that kept sequences find them. */
	r = keep_restore(keep, srv);
	if (r < 0)
		goto finish;
	r = server_run(srv);
finish:
	server_free(srv);
	admin_free(admin);
	keep_free(keep);
	pool_free(pool);
	backend_close();
	settings_done(&arg_flags);
	return r < 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}
