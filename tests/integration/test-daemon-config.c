/* SPDX-License-Identifier: MIT */
/*
 * The config file, SIGHUP and the live state: keys apply and flags win over them,
 * --check-config says what is wrong and where, a reload changes the budget and tenants
 * without dropping anyone (and a bad file changes nothing), live changes survive a restart
 * and win over the file until reset, and status says where each value comes from.
 */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fixture.h"
#include "test.h"

#define MiB (UINT64_C(1) << 20)

static const kvd_model_spec shape = { "c", 2, 2, 2, 32, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_HEAD };

static void assert_contains(const char *text, const char *needle) {
	if (!strstr(text, needle))
		test_fail(__FILE__, __LINE__, "'%s' not found in:\n%s", needle, text);
}

/* Asserts a status string: node (tenant NULL) or tenant. */
static void assert_str(struct fixture *f, const char *tenant, const char *key, const char *want) {
	char buf[256];
	const char *v = fixture_status_str(f, tenant, key, buf, sizeof(buf));

	if (!v || strcmp(v, want) != 0)
		test_fail(__FILE__, __LINE__, "%s %s is '%s', want '%s'", tenant ? tenant : "node", key,
		          v ? v : "(absent)", want);
}

static void assert_tenant(struct fixture *f, const char *t, uint64_t min, const char *min_source,
                          uint64_t max, const char *max_source, uint64_t weight,
                          const char *weight_source) {
	ASSERT_EQ(fixture_status(f, t, "min_bytes"), min);
	ASSERT_EQ(fixture_status(f, t, "max_bytes"), max);
	ASSERT_EQ(fixture_status(f, t, "weight"), weight);
	assert_str(f, t, "min_source", min_source);
	assert_str(f, t, "max_source", max_source);
	assert_str(f, t, "weight_source", weight_source);
}

/* Sends SIGHUP and waits for the reload's last log line, the count-th of its kind. */
static void reload(struct fixture *f, const char *last_line, unsigned count) {
	ASSERT_OK(kill(f->pid, SIGHUP));
	if (!fixture_wait_log(f, last_line, count))
		test_fail(__FILE__, __LINE__, "no '%s' (x%u) in the daemon's log after SIGHUP", last_line,
		          count);
}

static const char *const small[] = { "--chunk-size", "1MiB", NULL };

TEST(config_applies_and_flags_win) {
	static const char *const args[] = { "--budget", "12MiB", NULL };
	struct fixture f;
	kvd_client *c;
	kvd_seq *s[3];
	int m;

	fixture_setup(&f,
	              "# a comment\n"
	              "[kvd]\n"
	              "pool-size = 16MiB\n"
	              "chunk-size = 1MiB\n"
	              "budget = 8MiB   ; the flag wins\n"
	              "max-seqs = 2\n"
	              "\n"
	              "[tenant a]\n"
	              "min = 1MiB\n"
	              "max = 4MiB\n"
	              "weight = 3\n"
	              "policy = restkv\n"
	              "allow-users = alice bob\n"
	              "\n"
	              "[tenant b]\n",
	              false);
	fixture_launch(&f, args);
	ASSERT_EQ(fixture_status(&f, NULL, "pool_bytes"), 16 * MiB);
	ASSERT_EQ(fixture_status(&f, NULL, "chunk_bytes"), 1 * MiB);
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 12 * MiB);
	assert_str(&f, NULL, "budget_source", "flag");
	/* Declared tenants are known before any of their processes connects. */
	assert_tenant(&f, "a", 1 * MiB, "config", 4 * MiB, "config", 3, "config");
	assert_str(&f, "a", "policy", "restkv");
	assert_tenant(&f, "b", 0, "default", UINT64_MAX, "default", 1, "default");
	assert_str(&f, "b", "policy", "kvd");

	/* max-seqs from the file holds. */
	c = fixture_connect(&f, "newcomer");
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 64, &s[0]));
	ASSERT_OK(kvd_seq_open(c, m, 64, &s[1]));
	ASSERT_EQ(kvd_seq_open(c, m, 64, &s[2]), -EMFILE);
	assert_tenant(&f, "newcomer", 0, "default", UINT64_MAX, "default", 1, "default");
	kvd_seq_release(s[0]);
	kvd_seq_release(s[1]);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(check_config) {
	char dir[64], path[128], args[512], out[8192];
	FILE *file;

	snprintf(dir, sizeof(dir), "/tmp/kvd-test-XXXXXX");
	ASSERT_TRUE(mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/kvd.conf", dir);

	file = fopen(path, "we");
	ASSERT_TRUE(file);
	fputs("[kvd]\npool-size = 16MiB\nchunk-size = 1MiB\n[tenant t]\nmax = 2MiB\nweight = 2\n", file);
	fclose(file);
	snprintf(args, sizeof(args), "--check-config %s", path);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 0);
	assert_contains(out, "OK");
	assert_contains(out, "tenant t: min 0 B, max 2.0 MiB, weight 2, policy kvd");
	snprintf(args, sizeof(args), "--check-config=%s", path);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 0);
	snprintf(args, sizeof(args), "--config %s --check-config", path);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 0);
	/* Names that resolve to nobody are reported, without failing the check. */
	file = fopen(path, "we");
	ASSERT_TRUE(file);
	fputs("[kvd]\nadmin-group = kvd-no-such-group\n[tenant t]\nallow-users = root kvd-no-such-user\n"
	      "allow-groups = 0 kvd-no-such-group\n", file);
	fclose(file);
	snprintf(args, sizeof(args), "--check-config %s", path);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 0);
	assert_contains(out, "warning: tenant t: allow-users: user 'kvd-no-such-user' does not exist");
	assert_contains(out, "warning: tenant t: allow-groups: group 'kvd-no-such-group' does not exist");
	assert_contains(out, "warning: admin-group: group 'kvd-no-such-group' does not exist");
	ASSERT_TRUE(!strstr(out, "'root'"));
	file = fopen(path, "we");
	ASSERT_TRUE(file);
	fputs("[kvd]\npool-size = 16MiB\nchunk-size = 1MiB\n[tenant t]\nmax = 2MiB\nweight = 2\n", file);
	fclose(file);

	/* What a start would say, said before it: the warnings it would log, the effective
	 * values with where each comes from. */
	file = fopen(path, "we");
	ASSERT_TRUE(file);
	fputs("[kvd]\npool-size = 128MiB\nchunk-size = 1MiB\nbudget = 96MiB\n"
	      "[tenant a]\nmin = 64MiB\n[tenant b]\nmin = 64MiB\n", file);
	fclose(file);
	snprintf(args, sizeof(args), "--check-config %s --backend host --max-seqs 7", path);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 0);
	assert_contains(out, "warning: the tenants' guaranteed minimums (128.0 MiB together) exceed "
	                "the budget (96.0 MiB)");
	snprintf(args, sizeof(args), "\nbudget = 96.0 MiB  (%s:4)\n", path);
	assert_contains(out, args);
	assert_contains(out, "\nbackend = host  (flag)\n");
	assert_contains(out, "\nmax-seqs = 7  (flag)\n");
	assert_contains(out, "\nmax-cached-percent = 25  (default)\n");
	ASSERT_TRUE(!strstr(out, "check-config ="));
	/* Every error at once: one in parsing does not hide those of the values together, nor
	 * those against the pool. */
	file = fopen(path, "we");
	ASSERT_TRUE(file);
	fputs("[kvd]\npool-size = 16MiB\nchunk-size = 1MiB\nbudget = 32MiB\nnope = 1\n"
	      "[tenant t]\nmin = 8MiB\nmax = 4MiB\n", file);
	fclose(file);
	snprintf(args, sizeof(args), "--check-config %s --backend host", path);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 2);
	snprintf(args, sizeof(args), "%s:5: unknown key 'nope' in [kvd]", path);
	assert_contains(out, args);
	snprintf(args, sizeof(args), "%s:7: tenant t: min above max", path);
	assert_contains(out, args);
	snprintf(args, sizeof(args), "%s:4: budget must be at most the pool (16.0 MiB)", path);
	assert_contains(out, args);
	file = fopen(path, "we");
	ASSERT_TRUE(file);
	fputs("[kvd]\npool-size = 16MiB\nchunk-size = 1MiB\n[tenant t]\nmax = 2MiB\nweight = 2\n", file);
	fclose(file);

	/* A bad command line says where to look. */
	ASSERT_EQ(fixture_run_daemon("--bogus", out, sizeof(out)), 2);
	assert_contains(out, "unrecognized option '--bogus'");
	assert_contains(out, "Try 'kvd --help'.");
	ASSERT_EQ(fixture_run_daemon("--pool-size lots", out, sizeof(out)), 2);
	assert_contains(out, "kvd: --pool-size: 'lots' is not a size");
	assert_contains(out, "Try 'kvd --help'.");

	/* The flags are checked with the file: a budget above the file's pool. */
	snprintf(args, sizeof(args), "--check-config %s --backend host --budget 32MiB", path);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 2);
	assert_contains(out, "--budget must be at most the pool (16.0 MiB)");

	/* With the default backend (auto), against the pool auto makes here, as a start: the
	 * same verdict and the same errors from both. */
	file = fopen(path, "we");
	ASSERT_TRUE(file);
	fputs("[kvd]\npool-size = 16MiB\nchunk-size = 1MiB\nbudget = 32MiB\n[tenant t]\nmin = 64MiB\n",
	      file);
	fclose(file);
	if (!fixture_backend_cuda()) {
		snprintf(args, sizeof(args), "--check-config %s", path);
		ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 2);
		assert_contains(out, "kvd.conf:4: budget must be at most the pool (16.0 MiB)");
		assert_contains(out, "kvd.conf:6: tenant t: min above the pool (16.0 MiB)");
		snprintf(args, sizeof(args), "--config %s --socket %s/refused.sock --state-dir %s/refused",
		         path, dir, dir);
		ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 2);
		assert_contains(out, "kvd.conf:4: budget must be at most the pool (16.0 MiB)");
		assert_contains(out, "kvd.conf:6: tenant t: min above the pool (16.0 MiB)");
	}

	/* Every error, each with its line. */
	file = fopen(path, "we");
	ASSERT_TRUE(file);
	fputs("[kvd]\n"                     /* 1 */
	      "pool-size = 12XB\n"          /* 2 */
	      "nope = 3\n"                  /* 3 */
	      "[tenant t]\n"                /* 4 */
	      "weight = 0\n"                /* 5 */
	      "policy = lru\n"              /* 6 */
	      "colour: blue\n"              /* 7 */
	      "[elsewhere]\n"               /* 8 */
	      "key = value\n"               /* 9 */
	      "[kvd]\n"                     /* 10 */
	      "config = /etc/other.conf\n", /* 11: a flag only */
	      file);
	fclose(file);
	snprintf(args, sizeof(args), "--check-config %s", path);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 2);
	snprintf(args, sizeof(args), "%s:2: pool-size: '12XB' is not a size", path);
	assert_contains(out, args);
	snprintf(args, sizeof(args), "%s:3: unknown key 'nope' in [kvd]", path);
	assert_contains(out, args);
	snprintf(args, sizeof(args), "%s:5: weight:", path);
	assert_contains(out, args);
	snprintf(args, sizeof(args), "%s:6: policy: unknown policy 'lru'", path);
	assert_contains(out, args);
	snprintf(args, sizeof(args), "%s:7: expected 'key = value'", path);
	assert_contains(out, args);
	snprintf(args, sizeof(args), "%s:8: unknown section [elsewhere]", path);
	assert_contains(out, args);
	snprintf(args, sizeof(args), "%s:11: unknown key 'config' in [kvd]", path);
	assert_contains(out, args);
	/* The keys of a rejected section are not reported one by one. */
	ASSERT_TRUE(!strstr(out, ":9:"));

	/* The daemon itself refuses to start on that file, with the same errors. */
	snprintf(args, sizeof(args), "--config %s --socket %s/kvd.sock", path, dir);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 2);
	snprintf(args, sizeof(args), "%s:3: unknown key 'nope' in [kvd]", path);
	assert_contains(out, args);

	/* A named file must exist; the default one need not. */
	snprintf(args, sizeof(args), "--check-config %s/missing.conf", dir);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 2);
	assert_contains(out, "missing.conf: cannot open: No such file or directory");
	snprintf(args, sizeof(args), "--config %s/missing.conf --socket %s/kvd.sock", dir, dir);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 2);
	unlink(path);
	rmdir(dir);
}

/* The example kvd.conf installed with kvd is one a start takes. */
TEST(example_config_is_valid) {
	char args[PATH_MAX + 64], out[8192];

	snprintf(args, sizeof(args), "--check-config %s --backend host", getenv("KVD_EXAMPLE_CONF"));
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 0);
	assert_contains(out, "kvd.conf.example: OK");
	assert_contains(out, "tenant chat: min 256.0 MiB, max 768.0 MiB, weight 2");
	ASSERT_TRUE(!strstr(out, "warning: the"));
}

TEST(sighup_reloads_without_dropping_clients) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *s;
	int m;

	fixture_setup(&f,
	              "[kvd]\npool-size = 16MiB\nbudget = 8MiB\n"
	              "[tenant t]\nmax = 4MiB\nweight = 2\n",
	              true);
	fixture_launch(&f, small);
	c = fixture_connect(&f, "t");
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 1024, &s));
	ASSERT_OK(kvd_seq_grow(s, 32));
	fill_seq(s, 7);

	fixture_write_config(&f,
	                     "[kvd]\npool-size = 32MiB\nbudget = 6MiB\nmax-seqs = 1\n"
	                     "[tenant t]\nmax = 2MiB\npolicy = snapkv\n"
	                     "[tenant u]\nmin = 1MiB\n");
	reload(&f, "reloaded", 1);
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 6 * MiB);
	assert_str(&f, NULL, "budget_source", "config");
	/* The pool is sized at start: a new size waits for a restart, and says so. */
	ASSERT_EQ(fixture_status(&f, NULL, "pool_bytes"), 16 * MiB);
	ASSERT_EQ(fixture_log_count(&f, "pool-size changed from 16.0 MiB to 32.0 MiB; it needs a "
	                                "restart, ignoring"), 1u);
	/* The weight left the file: back to the default. */
	assert_tenant(&f, "t", 0, "default", 2 * MiB, "config", 1, "default");
	assert_str(&f, "t", "policy", "snapkv");
	assert_tenant(&f, "u", 1 * MiB, "config", UINT64_MAX, "default", 1, "default");

	/* The client never noticed: its data is there, its sequence grows within the new cap. */
	ASSERT_EQ(fixture_status(&f, "t", "connections"), 1u);
	ASSERT_EQ(check_seq(s, 7), 0u);
	ASSERT_OK(kvd_seq_grow(s, 32));
	fill_seq(s, 8);
	ASSERT_EQ(check_seq(s, 8), 0u);
	assert_digests_agree(s);
	/* And the new limits hold for it: max-seqs is now 1. */
	{
		kvd_seq *s2;

		ASSERT_EQ(kvd_seq_open(c, m, 64, &s2), -EMFILE);
	}
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(bad_reload_changes_nothing) {
	struct fixture f;
	kvd_client *c;

	fixture_setup(&f, "[kvd]\npool-size = 16MiB\nbudget = 8MiB\n[tenant t]\nmax = 4MiB\n", true);
	fixture_launch(&f, small);
	c = fixture_connect(&f, "t");

	fixture_write_config(&f, "[kvd]\nbudget = 2MiB\nbudjet = 3MiB\n[tenant t]\nmax = lots\n");
	reload(&f, "reload failed", 1);
	ASSERT_EQ(fixture_log_count(&f, "kvd.conf:3: unknown key 'budjet' in [kvd]"), 1u);
	ASSERT_EQ(fixture_log_count(&f, "kvd.conf:5: max: 'lots' is not a size"), 1u);
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 8 * MiB);
	ASSERT_EQ(fixture_status(&f, "t", "max_bytes"), 4 * MiB);

	/* A file fine for a fresh start can still not fit what runs: a budget above the
	 * running pool. */
	fixture_write_config(&f, "[kvd]\npool-size = 64MiB\nbudget = 32MiB\n");
	reload(&f, "reload failed", 2);
	ASSERT_EQ(fixture_log_count(&f, "budget must be at most the pool (16.0 MiB)"), 1u);
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 8 * MiB);

	/* A good file after that applies. */
	fixture_write_config(&f, "[kvd]\npool-size = 16MiB\nbudget = 10MiB\n");
	reload(&f, "reloaded", 1);
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 10 * MiB);
	assert_tenant(&f, "t", 0, "default", UINT64_MAX, "default", 1, "default");
	ASSERT_EQ(kvd_client_protocol_version(c), 1);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* An edit of a tenant's value in the file that a live value shadows is said at the reload,
 * and the live value stays (it wins until kvdctl tenant reset). */
TEST(live_value_shadowing_an_edit_is_said) {
	struct fixture f;
	kvd_client *admin;

	fixture_setup(&f, "[kvd]\npool-size = 16MiB\n[tenant t]\nmax = 4MiB\nweight = 2\n", true);
	fixture_launch(&f, small);
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_tenant_set(admin, "t", 0, 2 * MiB, 0));
	fixture_write_config(&f, "[kvd]\npool-size = 16MiB\n[tenant t]\nmax = 8MiB\nweight = 3\n");
	reload(&f, "reloaded", 1);
	ASSERT_EQ(fixture_log_count(&f, "tenant t: max changed in the file, but the live value set "
	                                "with kvdctl stays until kvdctl tenant reset t"), 1u);
	/* The weight is not live: the file's new value applies, and nothing is said of it. */
	ASSERT_EQ(fixture_log_count(&f, "tenant t: weight changed in the file"), 0u);
	assert_tenant(&f, "t", 0, "live", 2 * MiB, "live", 3, "config");
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

static bool file_contains(const char *path, const char *needle) {
	char buf[4096];
	size_t k;
	FILE *file = fopen(path, "re");

	if (!file)
		return false;
	k = fread(buf, 1, sizeof(buf) - 1, file);
	buf[k] = 0;
	fclose(file);
	return strstr(buf, needle) != NULL;
}

TEST(live_changes_survive_restarts_until_reset) {
	static const char *const with_budget[] = { "--chunk-size", "1MiB", "--budget", "5MiB", NULL };
	char state[256], buf[256];
	struct fixture f;
	kvd_client *admin;

	fixture_setup(&f,
	              "[kvd]\npool-size = 16MiB\nbudget = 8MiB\n"
	              "[tenant a]\nmax = 4MiB\nweight = 2\n",
	              true);
	snprintf(state, sizeof(state), "%s/state", f.state_dir);
	fixture_launch(&f, small);
	admin = fixture_connect(&f, NULL);
	ASSERT_EQ(kvd_budget_set(admin, 6 * MiB), 0);
	ASSERT_EQ(kvd_tenant_set(admin, "a", KVD_TENANT_KEEP, 3 * MiB, 0), 0);
	ASSERT_EQ(kvd_tenant_set(admin, "x", 1 * MiB, KVD_TENANT_KEEP, 5), 0);
	assert_str(&f, NULL, "budget_source", "live");
	assert_tenant(&f, "a", 0, "default", 3 * MiB, "live", 2, "config");
	assert_tenant(&f, "x", 1 * MiB, "live", UINT64_MAX, "default", 5, "live");
	ASSERT_EQ(fixture_status_str(&f, NULL, "state_error", buf, sizeof(buf)), NULL);
	/* The state file is INI, with only what was set live. */
	ASSERT_TRUE(file_contains(state, "[kvd]\nbudget = 6291456\n"));
	ASSERT_TRUE(file_contains(state, "[tenant a]\nmax = 3145728\n"));
	ASSERT_TRUE(file_contains(state, "[tenant x]\nmin = 1048576\nweight = 5\n"));
	kvd_client_unref(admin);

	/* A restart on the same state: the live values win over the file. */
	ASSERT_EQ(fixture_halt(&f), 0);
	fixture_launch(&f, small);
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 6 * MiB);
	assert_str(&f, NULL, "budget_source", "live");
	assert_tenant(&f, "a", 0, "default", 3 * MiB, "live", 2, "config");
	assert_tenant(&f, "x", 1 * MiB, "live", UINT64_MAX, "default", 5, "live");

	/* And over a reloaded file, whose other values still apply. */
	fixture_write_config(&f, "[kvd]\npool-size = 16MiB\nbudget = 7MiB\n"
	                         "[tenant a]\nmax = 5MiB\nweight = 4\n");
	reload(&f, "reloaded", 1);
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 6 * MiB);
	assert_tenant(&f, "a", 0, "default", 3 * MiB, "live", 4, "config");

	/* Resets go back to the file. */
	admin = fixture_connect(&f, NULL);
	ASSERT_EQ(kvd_budget_reset(admin), 0);
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 7 * MiB);
	assert_str(&f, NULL, "budget_source", "config");
	ASSERT_EQ(kvd_tenant_reset(admin, "a"), 0);
	assert_tenant(&f, "a", 0, "default", 5 * MiB, "config", 4, "config");
	ASSERT_EQ(kvd_tenant_reset(admin, "nobody"), -ENOENT);
	ASSERT_EQ(kvd_tenant_reset(admin, "bad name"), -EINVAL);
	kvd_client_unref(admin);
	ASSERT_TRUE(!file_contains(state, "[kvd]"));
	ASSERT_TRUE(!file_contains(state, "[tenant a]"));

	/* What was reset stays reset; what was not stays live. */
	ASSERT_EQ(fixture_halt(&f), 0);
	fixture_launch(&f, small);
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 7 * MiB);
	assert_tenant(&f, "a", 0, "default", 5 * MiB, "config", 4, "config");
	assert_tenant(&f, "x", 1 * MiB, "live", UINT64_MAX, "default", 5, "live");

	/* A tenant only live once reset is gone after the next restart. */
	admin = fixture_connect(&f, NULL);
	ASSERT_EQ(kvd_budget_set(admin, 9 * MiB), 0);
	ASSERT_EQ(kvd_tenant_reset(admin, "x"), 0);
	assert_tenant(&f, "x", 0, "default", UINT64_MAX, "default", 1, "default");
	kvd_client_unref(admin);

	/* --budget wins over a live budget at start, which is then dropped. */
	ASSERT_EQ(fixture_halt(&f), 0);
	fixture_launch(&f, with_budget);
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 5 * MiB);
	assert_str(&f, NULL, "budget_source", "flag");
	ASSERT_EQ(fixture_status(&f, "x", "min_bytes"), UINT64_MAX);
	ASSERT_TRUE(!file_contains(state, "budget"));
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Token recall's settings: a tenant's recall from the file, checked against the host tier
 * (--check-config and a start refuse it without one), a live value over it that survives a
 * restart until reset, and recall-policy, which a reload changes (and a bad one does not). */
TEST(recall_settings) {
	static const char *const tier[] = { "--chunk-size", "1MiB", "--host-tier-size", "2MiB",
		                            NULL };
	kvd_tenant_params p = { .size = sizeof(p), .set = KVD_TENANT_SET_RECALL };
	char args[512], out[8192], state[256];
	struct fixture f;
	kvd_client *admin;

	fixture_setup(&f, "[kvd]\npool-size = 16MiB\nrecall-policy = kvd\n[tenant a]\nweight = 2\n"
	              "recall = 64\n", true);
	snprintf(state, sizeof(state), "%s/state", f.state_dir);
	snprintf(args, sizeof(args), "--check-config %s --backend host --chunk-size 1MiB", f.config);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 2);
	assert_contains(out, "kvd.conf:6: tenant a: recall needs a host tier (host-tier-size)");
	snprintf(args, sizeof(args), "--config %s --socket %s/refused.sock --backend host "
	         "--chunk-size 1MiB", f.config, f.dir);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 2);
	assert_contains(out, "kvd.conf:6: tenant a: recall needs a host tier (host-tier-size)");
	snprintf(args, sizeof(args), "--check-config %s --backend host --chunk-size 1MiB "
	         "--host-tier-size 2MiB", f.config);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 0);
	assert_contains(out, "tenant a: min 0 B, max none, weight 2, policy kvd, tier drop, "
	                     "recall 64\n");
	snprintf(args, sizeof(args), "--check-config %s --backend host --chunk-size 1MiB "
	         "--host-tier-size 2MiB --recall-policy full", f.config);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 2);
	assert_contains(out, "--recall-policy: unknown recall-policy 'full' (");

	fixture_launch(&f, tier);
	ASSERT_EQ(fixture_status(&f, "a", "recall"), 64u);
	assert_str(&f, "a", "recall_source", "config");
	admin = fixture_connect(&f, NULL);
	p.recall = KVD_TENANT_RECALL_MAX + 1;
	ASSERT_EQ(kvd_tenant_set_params(admin, "a", &p), -EINVAL);
	p.recall = 0;
	ASSERT_OK(kvd_tenant_set_params(admin, "a", &p));
	ASSERT_EQ(fixture_status(&f, "a", "recall"), 0u);
	assert_str(&f, "a", "recall_source", "live");
	ASSERT_TRUE(file_contains(state, "[tenant a]\nrecall = 0\n"));
	kvd_client_unref(admin);

	/* The live 0 wins over the file's 64 after a restart, and over a reload. */
	ASSERT_EQ(fixture_halt(&f), 0);
	fixture_launch(&f, tier);
	ASSERT_EQ(fixture_status(&f, "a", "recall"), 0u);
	assert_str(&f, "a", "recall_source", "live");
	fixture_write_config(&f, "[kvd]\npool-size = 16MiB\nrecall-policy = laprox\n[tenant a]\n"
	                         "recall = 128\n");
	reload(&f, "reloaded", 1);
	ASSERT_EQ(fixture_log_count(&f, "kvd.conf: recall-policy laprox (was kvd)"), 1u);
	ASSERT_EQ(fixture_status(&f, "a", "recall"), 0u);
	fixture_write_config(&f, "[kvd]\npool-size = 16MiB\nrecall-policy = full\n");
	reload(&f, "reload failed", 1);
	ASSERT_EQ(fixture_log_count(&f, "kvd.conf:3: recall-policy: unknown recall-policy "
	                                "'full'"), 1u);
	/* Reset: back to the file's value. */
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_tenant_reset(admin, "a"));
	ASSERT_EQ(fixture_status(&f, "a", "recall"), 128u);
	assert_str(&f, "a", "recall_source", "config");
	p.recall = 32;
	ASSERT_OK(kvd_tenant_set_params(admin, "a", &p));
	ASSERT_EQ(fixture_status_str(&f, NULL, "warnings", out, sizeof(out)), NULL);
	kvd_client_unref(admin);

	/* A live recall kept across a restart without a host tier (which the file's cannot
	 * be): it starts, and a standing warning says that nothing will be kept. */
	ASSERT_EQ(fixture_halt(&f), 0);
	fixture_write_config(&f, "[kvd]\npool-size = 16MiB\n");
	fixture_launch(&f, small);
	ASSERT_EQ(fixture_status(&f, "a", "recall"), 32u);
	ASSERT_TRUE(fixture_status_str(&f, NULL, "warnings", out, sizeof(out)));
	assert_contains(out, "tenant a: recall is 32 but kvd runs without a host tier");
	ASSERT_EQ(fixture_log_count(&f, "tenant a: recall is 32 but kvd runs without a host "
	                                "tier"), 1u);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(unsaved_live_change_says_so) {
	char blocker[256], state_dir[300], buf[512];
	const char *args[] = { "--chunk-size", "1MiB", "--state-dir", state_dir, NULL };
	struct fixture f;
	kvd_client *admin;
	FILE *file;

	fixture_setup(&f, "[kvd]\npool-size = 16MiB\n", true);
	/* A state directory below a regular file cannot be made, whoever runs the test. */
	snprintf(blocker, sizeof(blocker), "%s/blocker", f.dir);
	file = fopen(blocker, "we");
	ASSERT_TRUE(file);
	fclose(file);
	snprintf(state_dir, sizeof(state_dir), "%s/state", blocker);
	fixture_launch(&f, args);

	admin = fixture_connect(&f, NULL);
	ASSERT_EQ(kvd_budget_set(admin, 4 * MiB), 1);
	assert_contains(kvd_client_last_error(admin), "will not survive a restart");
	ASSERT_EQ(kvd_tenant_set(admin, "t", KVD_TENANT_KEEP, 2 * MiB, 0), 1);
	/* Applied all the same, and status keeps saying what is wrong. */
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 4 * MiB);
	assert_str(&f, NULL, "budget_source", "live");
	ASSERT_EQ(fixture_status(&f, "t", "max_bytes"), 2 * MiB);
	ASSERT_TRUE(fixture_status_str(&f, NULL, "state_error", buf, sizeof(buf)));
	assert_contains(buf, "blocker/state");
	ASSERT_TRUE(fixture_wait_log(&f, "will not survive a restart", 2));
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Writes text to path with mode. */
static void write_file(const char *path, const char *text, mode_t mode) {
	FILE *file = fopen(path, "we");

	ASSERT_TRUE(file);
	ASSERT_EQ(fputs(text, file) >= 0, true);
	ASSERT_OK(fclose(file));
	ASSERT_OK(chmod(path, mode));
}

/* Starts the daemon on f's state as it is now; the budget's source then, and the state
 * error into buf; stops it, keeping the directory. */
static const char *start_on_state(struct fixture *f, char *buf, size_t n) {
	char source[32];

	fixture_launch(f, small);
	ASSERT_TRUE(fixture_status_str(f, NULL, "budget_source", source, sizeof(source)));
	if (!fixture_status_str(f, NULL, "state_error", buf, n))
		buf[0] = '\0';
	ASSERT_EQ(fixture_halt(f), 0);
	return strcmp(source, "live") == 0 ? "live" : "not live";
}

/*
 * The state directory is trusted only when it is kvd's user's alone: a state file planted
 * where others may write, one that is a link (to a secret kvd could read), a FIFO, or owned
 * by another user, is refused, never applied, never quoted, and never blocks the start.
 */
TEST(state_file_trusted_only) {
	char state[256], secret[256], buf[512];
	struct fixture f;

	fixture_setup(&f, "[kvd]\npool-size = 16MiB\n", true);
	snprintf(state, sizeof(state), "%s/state", f.state_dir);
	snprintf(secret, sizeof(secret), "%s/secret", f.dir);
	ASSERT_OK(mkdir(f.state_dir, 0700));
	/* Kvd's own: applied. */
	write_file(state, "[kvd]\nbudget = 8MiB\n", 0600);
	ASSERT_STREQ(start_on_state(&f, buf, sizeof(buf)), "live");
	ASSERT_STREQ(buf, "");
	/* In a directory others may write. */
	ASSERT_OK(chmod(f.state_dir, 0777));
	ASSERT_STREQ(start_on_state(&f, buf, sizeof(buf)), "not live");
	assert_contains(buf, "writable by others (mode 0777)");
	ASSERT_OK(chmod(f.state_dir, 0700));
	/* Writable by others itself. */
	ASSERT_OK(chmod(state, 0666));
	ASSERT_STREQ(start_on_state(&f, buf, sizeof(buf)), "not live");
	assert_contains(buf, "writable by others");
	/* Another user's. */
	ASSERT_OK(chmod(state, 0600));
	if (geteuid() == 0) {
		ASSERT_OK(chown(state, 12345, 12345));
		ASSERT_STREQ(start_on_state(&f, buf, sizeof(buf)), "not live");
		assert_contains(buf, "owned by uid 12345");
	}
	/* A link to a file only kvd may read: neither applied nor quoted. */
	ASSERT_OK(unlink(state));
	write_file(secret, "[kvd]\nbudget = hunter2\n", 0600);
	ASSERT_OK(symlink(secret, state));
	ASSERT_STREQ(start_on_state(&f, buf, sizeof(buf)), "not live");
	assert_contains(buf, "a symbolic link");
	/* A second name of it. */
	ASSERT_OK(unlink(state));
	ASSERT_OK(link(secret, state));
	ASSERT_STREQ(start_on_state(&f, buf, sizeof(buf)), "not live");
	assert_contains(buf, "has 2 links");
	/* A FIFO: the start goes on. */
	ASSERT_OK(unlink(state));
	ASSERT_OK(mkfifo(state, 0600));
	ASSERT_STREQ(start_on_state(&f, buf, sizeof(buf)), "not live");
	assert_contains(buf, "not a regular file");
	ASSERT_EQ(fixture_log_count(&f, "hunter2"), 0u);
	ASSERT_TRUE(fixture_log_count(&f, "refused, the live settings there are not applied") >= 5);
	fixture_cleanup(&f);
}
