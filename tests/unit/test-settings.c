/* SPDX-License-Identifier: MIT */
/*
 * The settings table, the config file parser and the live state file: defaults, keys and
 * tenant sections, flags over the file, every error with its line, the bounds (line length,
 * file size, names in a list, tenants), --help listing every setting, and the state file's
 * round trip and atomic save.
 */

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <syslog.h>
#include <unistd.h>

#include "policy.h"
#include "settings.h"
#include "state.h"
#include "test.h"

#define MiB (UINT64_C(1) << 20)

static char dir[64];
static char path[128];

int test_setup(void) {
	snprintf(dir, sizeof(dir), "/tmp/kvd-test-settings-XXXXXX");
	if (!mkdtemp(dir))
		return -errno;
	snprintf(path, sizeof(path), "%s/kvd.conf", dir);
	return 0;
}

static void write_file(const char *p, const char *text, size_t n) {
	FILE *f = fopen(p, "we");

	ASSERT_NOT_NULL(f);
	ASSERT_EQ(fwrite(text, 1, n, f), n);
	ASSERT_EQ(fclose(f), 0);
}

static void write_config(const char *text) {
	write_file(path, text, strlen(text));
}

/* Loads path under the flags of argv (NULL-terminated, without argv[0]) into s. */
static int load(struct settings *s, struct inifile_errors *e, const char *const *args) {
	char *argv[32] = { (char *)"kvd" };
	struct settings flags;
	int argc = 1, r;

	for (; args && *args; args++)
		argv[argc++] = (char *)*args;
	ASSERT_OK(settings_init(&flags));
	ASSERT_EQ(settings_parse_argv(&flags, argc, argv), 1);
	ASSERT_OK(settings_init(s));
	r = settings_load(s, &flags, path, e);
	settings_done(&flags);
	return r;
}

/* Whether one of e's errors is exactly "PATH:LINE: what" (line 0: "PATH: what"). */
static bool has_error(const struct inifile_errors *e, unsigned line, const char *what) {
	char want[512];

	if (line)
		snprintf(want, sizeof(want), "%s:%u: %s", path, line, what);
	else
		snprintf(want, sizeof(want), "%s: %s", path, what);
	for (unsigned i = 0; i < e->n; i++)
		if (strncmp(e->msg[i], want, strlen(want)) == 0)
			return true;
	return false;
}

#define ASSERT_ERROR(e, line, what)                                                           \
	do {                                                                                  \
		if (!has_error(e, line, what))                                                \
			test_fail(__FILE__, __LINE__, "no error '%s' at line %u", what, line); \
	} while (0)

TEST(defaults) {
	struct settings s;

	ASSERT_OK(settings_init(&s));
	ASSERT_EQ(s.backend, SETTINGS_BACKEND_AUTO);
	ASSERT_STREQ(s.devices, "all");
	ASSERT_EQ(s.pool_percent, 0u);
	ASSERT_STREQ(s.socket, "/run/kvd/kvd.sock");
	ASSERT_EQ(s.pool_size, UINT64_C(1) << 30);
	ASSERT_EQ(s.chunk_size, 4 * MiB);
	ASSERT_EQ(s.budget, SETTINGS_UNSET);
	ASSERT_EQ(s.max_connections, 256u);
	ASSERT_EQ(s.max_tenants, 64u);
	ASSERT_EQ(s.max_models, 16u);
	ASSERT_EQ(s.max_seqs, 4096u);
	ASSERT_EQ(s.max_seq_tokens, 1u << 20);
	ASSERT_EQ(s.hello_timeout_ms, 5000u);
	ASSERT_EQ(s.log_level, LOG_INFO);
	ASSERT_STREQ(s.state_dir, "/var/lib/kvd");
	ASSERT_STREQ(s.metrics_listen, "");
	ASSERT_STREQ(s.config, "/etc/kvd/kvd.conf");
	ASSERT_NULL(s.check_config);
	for (size_t i = 0; i < SETTINGS_MAX; i++)
		ASSERT_EQ(s.source[i], SOURCE_DEFAULT);
	settings_done(&s);
}

TEST(keys_and_tenants) {
	struct inifile_errors e = {};
	struct settings s;
	const struct settings_tenant *t;

	write_config("\xef\xbb\xbf# kvd.conf\r\n"
	             "[kvd]\r\n"
	             "  pool-size = 8GiB\n"
	             "budget=6G ; inline comment\n"
	             "log-level = debug\n"
	             "backend = auto\n"
	             "metrics-listen = unix:/run/kvd/metrics.sock\n"
	             "\n"
	             "[tenant llama-3.1]\n"
	             "min = 1GiB\n"
	             "max = none\n"
	             "weight = 7\n"
	             "policy = laprox\n"
	             "allow-users = alice, bob\n"
	             "allow-users = carol\n"
	             "allow-groups = render\n"
	             "allow-groups =\n"
	             "[tenant empty]\n"
	             "[kvd]\n"
	             "max-seqs = 12\n");
	ASSERT_OK(load(&s, &e, NULL));
	ASSERT_EQ(e.n, 0u);
	ASSERT_STREQ(s.path, path);
	ASSERT_EQ(s.pool_size, UINT64_C(8) << 30);
	ASSERT_EQ(s.budget, UINT64_C(6) << 30);
	ASSERT_EQ(s.log_level, LOG_DEBUG);
	ASSERT_EQ(s.backend, SETTINGS_BACKEND_AUTO);
	ASSERT_STREQ(s.metrics_listen, "unix:/run/kvd/metrics.sock");
	ASSERT_EQ(s.max_seqs, 12u);
	ASSERT_EQ(s.source[settings_index("budget")], SOURCE_CONFIG);
	ASSERT_EQ(s.line[settings_index("budget")], 4u);
	ASSERT_EQ(s.source[settings_index("max-tenants")], SOURCE_DEFAULT);

	ASSERT_EQ(s.n_tenants, 2u);
	t = settings_tenant_find(&s, "llama-3.1");
	ASSERT_NOT_NULL(t);
	ASSERT_EQ(t->line, 9u);
	ASSERT_EQ(t->min_bytes, UINT64_C(1) << 30);
	ASSERT_EQ(t->max_bytes, KVD_TENANT_NO_CAP);
	ASSERT_EQ(t->weight, 7u);
	ASSERT_STREQ(t->allow_users, "alice bob carol");
	ASSERT_NULL(t->allow_groups);
	ASSERT_EQ(t->source[SETTINGS_TENANT_MIN], SOURCE_CONFIG);
	t = settings_tenant_find(&s, "empty");
	ASSERT_NOT_NULL(t);
	ASSERT_EQ(t->min_bytes, 0u);
	ASSERT_EQ(t->max_bytes, KVD_TENANT_NO_CAP);
	ASSERT_EQ(t->weight, 1u);
	ASSERT_EQ(t->source[SETTINGS_TENANT_MIN], SOURCE_DEFAULT);
	settings_done(&s);
}

TEST(flags_win) {
	static const char *const args[] = { "--budget", "2GiB", "--max-seqs=3", "--log-level",
		                            "err", NULL };
	struct inifile_errors e = {};
	struct settings s;

	write_config("[kvd]\nbudget = 6GiB\nmax-seqs = 12\npool-size = 8GiB\n");
	ASSERT_OK(load(&s, &e, args));
	ASSERT_EQ(s.budget, UINT64_C(2) << 30);
	ASSERT_EQ(s.source[settings_index("budget")], SOURCE_FLAG);
	ASSERT_EQ(s.max_seqs, 3u);
	ASSERT_EQ(s.log_level, LOG_ERR);
	ASSERT_EQ(s.pool_size, UINT64_C(8) << 30);
	ASSERT_EQ(s.source[settings_index("pool-size")], SOURCE_CONFIG);
	settings_done(&s);
}

TEST(every_error_with_its_line) {
	struct inifile_errors e = {};
	struct settings s;
	char long_line[400];

	memset(long_line, 'x', sizeof(long_line));
	memcpy(long_line, "socket = /", 10);
	long_line[sizeof(long_line) - 1] = '\0';
	write_config("budget = 1G\n"                         /* 1 */
	             "[kvd]\n"                               /* 2 */
	             "pool-size = 3 GiB\n"                   /* 3 */
	             "max-connections = 0\n"                 /* 4 */
	             "hello-timeout = soon\n"                /* 5 */
	             "log-level = loud\n"                    /* 6 */
	             "socket =\n"                            /* 7 */
	             "metrics-listen = localhost:9100\n"     /* 8 */
	             "= 3\n"                                 /* 9 */
	             "just words\n"                          /* 10 */
	             "[tenant]\n"                            /* 11 */
	             "[tenant no/slash]\n"                   /* 12 */
	             "min = 1\n"                             /* 13: skipped */
	             "[tenant ok]\n"                         /* 14 */
	             "max = -1\n"                            /* 15 */
	             "allow-users = -root\n"                 /* 16 */
	             "colour = red\n"                        /* 17 */
	             "[kvd\n"                                /* 18 */
	             "pool-size = 1G\n");                    /* 19: skipped */
	{
		FILE *f = fopen(path, "ae");

		ASSERT_NOT_NULL(f);
		fprintf(f, "[kvd]\n%s\nbudget = 1\x01\n", long_line); /* 20, 21, 22 */
		fclose(f);
	}
	ASSERT_ERRNO(load(&s, &e, NULL), -EINVAL);
	ASSERT_ERROR(&e, 1, "'budget' is outside a section: put it under [kvd]");
	ASSERT_ERROR(&e, 3, "pool-size: '3 GiB' is not a size");
	ASSERT_ERROR(&e, 4, "max-connections: '0' is not a number in 1..4294967295");
	ASSERT_ERROR(&e, 5, "hello-timeout: 'soon' is not a number");
	ASSERT_ERROR(&e, 6, "log-level: unknown log-level 'loud' (err, warning, notice, info, debug)");
	ASSERT_ERROR(&e, 7, "socket: must not be empty");
	ASSERT_ERROR(&e, 8, "metrics-listen: 'localhost:9100': ");
	ASSERT_ERROR(&e, 9, "a key is missing before '='");
	ASSERT_ERROR(&e, 10, "expected 'key = value'");
	ASSERT_ERROR(&e, 11, "unknown section [tenant]");
	ASSERT_ERROR(&e, 12, "invalid tenant name 'no/slash'");
	ASSERT_ERROR(&e, 15, "max: '-1' is not a size");
	ASSERT_ERROR(&e, 16, "allow-users: '-root' is not a user or group name");
	ASSERT_ERROR(&e, 17, "unknown key 'colour' in [tenant ok]");
	ASSERT_ERROR(&e, 18, "expected '[section]'");
	ASSERT_ERROR(&e, 21, "line longer than");
	ASSERT_ERROR(&e, 22, "contains a control character");
	ASSERT_EQ(e.n, 17u);
	inifile_errors_done(&e);
	settings_done(&s);
}

TEST(checks_across_values) {
	struct inifile_errors e = {};
	struct settings s;

	/* On host: the pool is pool-size (a cuda pool is pool-size on each GPU). */
	write_config("[kvd]\n"
	             "backend = host\n"
	             "pool-size = 8MiB\n"
	             "chunk-size = 1MiB\n"
	             "budget = 9MiB\n"
	             "max-tenants = 2\n"
	             "[tenant a]\nmin = 2MiB\nmax = 1MiB\n"
	             "[tenant b]\nmin = 9MiB\n"
	             "[tenant c]\n");
	ASSERT_ERRNO(load(&s, &e, NULL), -EINVAL);
	ASSERT_ERROR(&e, 8, "tenant a: min above max");
	ASSERT_ERROR(&e, 12, "tenant c: more tenants than max-tenants (2)");
	ASSERT_EQ(e.n, 2u);
	/* Against the pool the backend makes (at start, --check-config, a reload). */
	settings_check_pool(&s, 4096, 8u << 20, &e);
	ASSERT_ERROR(&e, 5, "budget must be at most the pool (8.0 MiB)");
	ASSERT_ERROR(&e, 11, "tenant b: min above the pool (8.0 MiB)");
	ASSERT_EQ(e.n, 4u);
	settings_check_pool(&s, 3u << 20, 16u << 20, &e);
	ASSERT_ERROR(&e, 4, "chunk-size must be a multiple of the backend's granularity (3145728 bytes)");
	inifile_errors_done(&e);
	settings_done(&s);

	write_config("[kvd]\nchunk-size = 1000\n");
	ASSERT_ERRNO(load(&s, &e, NULL), -EINVAL);
	ASSERT_ERROR(&e, 2, "chunk-size must be at least 64KiB and a multiple of");
	inifile_errors_done(&e);
	settings_done(&s);
}

/* A GPU pool sized from free memory is only known once the backend is open: the budget and
 * the tenants' minimums are checked against it then (settings_check_pool), not at load. */
TEST(gpu_settings) {
	struct inifile_errors e = {};
	struct settings s;

	write_config("[kvd]\n"
	             "backend = cuda\n"
	             "devices = 0, 1\n"
	             "pool-percent = 80\n"
	             "budget = 100GiB\n"
	             "[tenant a]\nmin = 50GiB\n");
	ASSERT_OK(load(&s, &e, NULL));
	ASSERT_EQ(s.backend, SETTINGS_BACKEND_CUDA);
	ASSERT_STREQ(s.devices, "0, 1");
	ASSERT_EQ(s.pool_percent, 80u);
	settings_done(&s);

	/* UUIDs as nvidia-smi -L prints them, dashed or not, any case, beside numbers. */
	write_config("[kvd]\ndevices = 1 GPU-6b76642d-6661-6b65-2d63-7564612d30fa,"
	             "gpu-6B76642D66616B652D637564612D31FA\n");
	ASSERT_OK(load(&s, &e, NULL));
	settings_done(&s);

	write_config("[kvd]\ndevices = gpu0\n");
	ASSERT_ERRNO(load(&s, &e, NULL), -EINVAL);
	ASSERT_ERROR(&e, 2, "devices: 'gpu0': must be all, or GPUs separated by spaces or commas, "
	             "each a number (0 to 255, in PCI bus order) or a UUID");
	ASSERT_EQ(e.n, 1u);
	inifile_errors_done(&e);
	settings_done(&s);

	/* A UUID one digit short, or long, and a number past 255, are typos. */
	{
		static const char *const bad[] = {
			"GPU-6b76642d-6661-6b65-2d63-7564612d30f", "GPU-6b76642d-6661-6b65-2d63-7564612d30fa0",
			"256", "-1", "0x1", "GPU-6b76642d--6661-6b65-2d63-7564612d30fa",
		};

		for (size_t i = 0; i < ELEMENTSOF(bad); i++) {
			char text[128];

			snprintf(text, sizeof(text), "[kvd]\ndevices = %s\n", bad[i]);
			write_config(text);
			ASSERT_ERRNO(load(&s, &e, NULL), -EINVAL);
			inifile_errors_done(&e);
			settings_done(&s);
		}
	}

	write_config("[kvd]\nbackend = host\npool-percent = 50\n");
	ASSERT_ERRNO(load(&s, &e, NULL), -EINVAL);
	ASSERT_ERROR(&e, 3, "pool-percent needs the cuda or auto backend");
	ASSERT_EQ(e.n, 1u);
	inifile_errors_done(&e);
	settings_done(&s);
}

TEST(files) {
	static const char *const missing[] = { "--config", "/nonexistent/kvd.conf", NULL };
	struct inifile_errors e = {};
	struct settings flags, s;
	char *argv[] = { (char *)"kvd", (char *)"--check-config", (char *)"x.conf", NULL };
	char big[4096];

	/* A missing default file is no error; a named one is. */
	ASSERT_OK(settings_init(&flags));
	ASSERT_OK(settings_init(&s));
	free(flags.config);
	flags.config = strdup("/nonexistent/kvd.conf");
	ASSERT_OK(settings_load(&s, &flags, NULL, &e));
	ASSERT_NULL(s.path);
	settings_done(&s);
	settings_done(&flags);
	{
		char *args[] = { (char *)"kvd", (char *)missing[0], (char *)missing[1], NULL };

		ASSERT_OK(settings_init(&flags));
		ASSERT_EQ(settings_parse_argv(&flags, 3, args), 1);
		ASSERT_OK(settings_init(&s));
		ASSERT_ERRNO(settings_load(&s, &flags, NULL, &e), -EINVAL);
		ASSERT_EQ(e.n, 1u);
		ASSERT_STREQ(e.msg[0], "/nonexistent/kvd.conf: cannot open: No such file or directory");
		inifile_errors_done(&e);
		settings_done(&s);
		settings_done(&flags);
	}
	/* --check-config FILE takes FILE as its argument. */
	ASSERT_OK(settings_init(&flags));
	ASSERT_EQ(settings_parse_argv(&flags, 3, argv), 1);
	ASSERT_STREQ(flags.check_config, "x.conf");
	settings_done(&flags);

	/* Bounds: the file's size, and a NUL byte. */
	for (size_t i = 0; i < sizeof(big); i++)
		big[i] = i % 64 == 63 ? '\n' : '#';
	{
		FILE *f = fopen(path, "we");

		ASSERT_NOT_NULL(f);
		for (uint64_t n = 0; n <= SETTINGS_FILE_MAX; n += sizeof(big))
			ASSERT_EQ(fwrite(big, 1, sizeof(big), f), sizeof(big));
		fclose(f);
	}
	ASSERT_ERRNO(load(&s, &e, NULL), -EINVAL);
	ASSERT_ERROR(&e, 0, "larger than");
	inifile_errors_done(&e);
	settings_done(&s);
	write_file(path, "[kvd]\nbudget = 1\0G\n", 19);
	ASSERT_ERRNO(load(&s, &e, NULL), -EINVAL);
	ASSERT_ERROR(&e, 2, "contains a NUL byte");
	inifile_errors_done(&e);
	settings_done(&s);
}

TEST(list_bounds) {
	struct inifile_errors e = {};
	struct settings s;
	char text[8192];
	size_t k = (size_t)snprintf(text, sizeof(text), "[tenant t]\n");

	for (int i = 0; i <= SETTINGS_LIST_MAX; i++)
		k += (size_t)snprintf(text + k, sizeof(text) - k, "allow-users = user%d\n", i);
	write_config(text);
	ASSERT_ERRNO(load(&s, &e, NULL), -EINVAL);
	ASSERT_ERROR(&e, SETTINGS_LIST_MAX + 2, "allow-users: more than 64 names");
	inifile_errors_done(&e);
	settings_done(&s);
}

/* Token recall: the tenant key (bounded, needing a host tier), the node's recall-policy (auto
 * or a policy that ranks: not full), and the live value's round trip through the state file. */
TEST(recall_settings) {
	static const char *const flag[] = { "--recall-policy=kvd", NULL };
	struct inifile_errors e = {};
	struct settings s;
	struct state *st, *back;
	struct state_tenant *t;
	char state_dir[160];

	ASSERT_OK(settings_init(&s));
	ASSERT_EQ(settings_recall_policy(&s), -1);
	settings_done(&s);

	write_config("[kvd]\nhost-tier-size = 8MiB\nrecall-policy = laprox\n"
	             "[tenant a]\nrecall = 256\n[tenant b]\n");
	ASSERT_OK(load(&s, &e, NULL));
	ASSERT_EQ(settings_recall_policy(&s), KVD_POLICY_LAPROX);
	ASSERT_EQ(s.source[settings_index("recall-policy")], SOURCE_CONFIG);
	ASSERT_EQ(settings_tenant_find(&s, "a")->recall, 256u);
	ASSERT_EQ(settings_tenant_find(&s, "a")->source[SETTINGS_TENANT_RECALL], SOURCE_CONFIG);
	ASSERT_EQ(settings_tenant_find(&s, "b")->recall, 0u);
	ASSERT_EQ(settings_tenant_find(&s, "b")->source[SETTINGS_TENANT_RECALL], SOURCE_DEFAULT);
	settings_done(&s);
	ASSERT_OK(load(&s, &e, flag));
	ASSERT_EQ(settings_recall_policy(&s), KVD_POLICY_KVD);
	ASSERT_EQ(s.source[settings_index("recall-policy")], SOURCE_FLAG);
	settings_done(&s);

	write_config("[kvd]\n"                   /* 1 */
	             "recall-policy = full\n"    /* 2 */
	             "[tenant a]\n"              /* 3 */
	             "recall = 1048577\n"        /* 4 */
	             "[kvd]\n"                   /* 5 */
	             "recall-policy = lru\n");   /* 6 */
	ASSERT_ERRNO(load(&s, &e, NULL), -EINVAL);
	ASSERT_ERROR(&e, 2, "recall-policy: unknown recall-policy 'full' (auto, streamingllm, ");
	ASSERT_ERROR(&e, 4, "recall: '1048577' is not a number in 0..1048576");
	ASSERT_ERROR(&e, 6, "recall-policy: unknown recall-policy 'lru'");
	ASSERT_EQ(e.n, 3u);
	inifile_errors_done(&e);
	settings_done(&s);
	/* Checked across values: kept tokens live in the host tier. */
	write_config("[kvd]\n[tenant b]\nweight = 2\nrecall = 8\n[tenant c]\nrecall = 0\n");
	ASSERT_ERRNO(load(&s, &e, NULL), -EINVAL);
	ASSERT_ERROR(&e, 4, "tenant b: recall needs a host tier (host-tier-size)");
	ASSERT_EQ(e.n, 1u);
	inifile_errors_done(&e);
	settings_done(&s);

	/* A live recall, and a live 0 over a file's value, come back from the state file. */
	snprintf(state_dir, sizeof(state_dir), "%s/recall-state", dir);
	ASSERT_OK(state_new(state_dir, 4, &st));
	ASSERT_OK(state_tenant_get(st, "a", &t));
	t->has_recall = true;
	t->recall = 1u << 20;
	ASSERT_OK(state_tenant_get(st, "b", &t));
	t->has_recall = true;
	t->recall = 0;
	ASSERT_OK(state_save(st));
	ASSERT_OK(state_new(state_dir, 4, &back));
	ASSERT_OK(state_load(back, &e));
	ASSERT_EQ(e.n, 0u);
	ASSERT_TRUE(state_tenant_find(back, "a")->has_recall);
	ASSERT_EQ(state_tenant_find(back, "a")->recall, 1u << 20);
	ASSERT_TRUE(state_tenant_find(back, "b")->has_recall);
	ASSERT_EQ(state_tenant_find(back, "b")->recall, 0u);
	state_free(back);
	unlink(st->path);
	rmdir(state_dir);
	state_free(st);
}

TEST(argv_errors) {
	char *bad_size[] = { (char *)"kvd", (char *)"--pool-size", (char *)"12XB", NULL };
	char *stray[] = { (char *)"kvd", (char *)"stray", NULL };
	char *bad_enum[] = { (char *)"kvd", (char *)"--backend=tpu", NULL };
	struct settings flags;

	ASSERT_OK(settings_init(&flags));
	ASSERT_ERRNO(settings_parse_argv(&flags, 3, bad_size), -EINVAL);
	ASSERT_ERRNO(settings_parse_argv(&flags, 2, stray), -EINVAL);
	ASSERT_ERRNO(settings_parse_argv(&flags, 2, bad_enum), -EINVAL);
	settings_done(&flags);
}

TEST(help_lists_everything) {
	size_t n, n_tenant;
	const struct setting *table = settings_table(&n), *tenant = settings_tenant_table(&n_tenant);
	char *text = NULL, want[128];
	size_t size = 0;
	FILE *f = open_memstream(&text, &size);

	ASSERT_NOT_NULL(f);
	settings_help(f);
	fclose(f);
	for (size_t i = 0; i < n; i++) {
		snprintf(want, sizeof(want), "--%s", table[i].name);
		if (!strstr(text, want))
			test_fail(__FILE__, __LINE__, "--help lacks %s", want);
		if (table[i].def && *table[i].def && !table[i].def_help) {
			snprintf(want, sizeof(want), "[%s]", table[i].def);
			if (!strstr(text, want))
				test_fail(__FILE__, __LINE__, "--help lacks %s's default %s", table[i].name,
				          want);
		}
	}
	for (size_t i = 0; i < n_tenant; i++) {
		snprintf(want, sizeof(want), "  %s = ", tenant[i].name);
		if (!strstr(text, want))
			test_fail(__FILE__, __LINE__, "--help lacks the tenant key %s", tenant[i].name);
	}
	free(text);
}

TEST(state_round_trip) {
	char state_dir[160], text[512];
	struct inifile_errors e = {};
	struct state *st, *back;
	struct state_tenant *t;
	struct stat sb;
	FILE *f;
	size_t k;

	snprintf(state_dir, sizeof(state_dir), "%s/state", dir);
	ASSERT_OK(state_new(state_dir, 2, &st));
	st->has_budget = true;
	st->budget = 6 * MiB;
	ASSERT_OK(state_tenant_get(st, "a", &t));
	t->has_max = true;
	t->max_bytes = KVD_TENANT_NO_CAP;
	ASSERT_OK(state_tenant_get(st, "b", &t));
	t->has_min = t->has_weight = true;
	t->min_bytes = 1 * MiB;
	t->weight = 9;
	ASSERT_ERRNO(state_tenant_get(st, "c", &t), -EUSERS);
	ASSERT_ERRNO(state_tenant_get(st, "no way", &t), -EINVAL);
	/* The directory is made when missing; both are the daemon's alone. */
	ASSERT_OK(state_save(st));
	ASSERT_STREQ(st->error, "");
	ASSERT_OK(stat(st->path, &sb));
	ASSERT_EQ(sb.st_mode & 0777, 0600u);
	ASSERT_OK(stat(st->dir, &sb));
	ASSERT_EQ(sb.st_mode & 0777, 0700u);
	f = fopen(st->path, "re");
	ASSERT_NOT_NULL(f);
	k = fread(text, 1, sizeof(text) - 1, f);
	text[k] = 0;
	fclose(f);
	ASSERT_TRUE(strstr(text, "\n[kvd]\nbudget = 6291456\n\n[tenant a]\nmax = none\n\n"
	                         "[tenant b]\nmin = 1048576\nweight = 9\n"));

	ASSERT_OK(state_new(state_dir, 2, &back));
	ASSERT_OK(state_load(back, &e));
	ASSERT_EQ(e.n, 0u);
	ASSERT_TRUE(back->has_budget);
	ASSERT_EQ(back->budget, 6 * MiB);
	ASSERT_EQ(back->n_tenants, 2u);
	ASSERT_TRUE(state_tenant_find(back, "a")->has_max);
	ASSERT_EQ(state_tenant_find(back, "a")->max_bytes, KVD_TENANT_NO_CAP);
	ASSERT_FALSE(state_tenant_find(back, "a")->has_min);
	ASSERT_EQ(state_tenant_find(back, "b")->weight, 9u);
	ASSERT_TRUE(state_tenant_remove(back, "a"));
	ASSERT_FALSE(state_tenant_remove(back, "a"));
	ASSERT_OK(state_save(back));
	state_free(back);

	/* Bad entries are skipped, each with its line; the good ones load. */
	snprintf(text, sizeof(text), "[kvd]\nbudget = lots\n[tenant x]\nweight = 0\nmin = 1M\n[other]\n");
	write_file(st->path, text, strlen(text));
	ASSERT_OK(state_new(state_dir, 2, &back));
	ASSERT_OK(state_load(back, &e));
	ASSERT_EQ(e.n, 3u);
	ASSERT_FALSE(back->has_budget);
	ASSERT_EQ(state_tenant_find(back, "x")->min_bytes, 1 * MiB);
	ASSERT_FALSE(state_tenant_find(back, "x")->has_weight);
	inifile_errors_done(&e);
	state_free(back);
	unlink(st->path);
	rmdir(state_dir);

	/* A directory that cannot be made: the error says what and where. */
	state_free(st);
	write_file(path, "", 0);
	snprintf(state_dir, sizeof(state_dir), "%s/state", path);
	ASSERT_OK(state_new(state_dir, 2, &st));
	st->has_budget = true;
	ASSERT_ERRNO(state_save(st), -ENOTDIR);
	ASSERT_TRUE(strstr(st->error, "cannot create"));
	ASSERT_TRUE(strstr(st->error, state_dir));
	state_free(st);
	unlink(path);
	rmdir(dir);
}
