/* SPDX-License-Identifier: MIT */
/*
 * Several tenants at once against a real daemon: what a client writes through its mapping
 * is what the daemon reads, no process ever maps a chunk of another tenant, and a chunk
 * that changes owner reads as zeros.
 */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fixture.h"
#include "test.h"

#define TENANTS 3
#define MAX_INODES 200

static const kvd_model_spec shapes[TENANTS] = {
	{ "a", 4, 8, 2, 64, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER },
	{ "b", 3, 8, 4, 32, KVD_DTYPE_BF16, 32, KVD_LAYOUT_PER_HEAD },
	{ "c", 2, 4, 4, 64, KVD_DTYPE_F32, 16, KVD_LAYOUT_PER_HEAD },
};

/* One tenant's process: fills two sequences, proves the daemon sees the bytes, reports
 * its chunk inodes, and holds everything until the parent has compared all of them. */
static void tenant_main(struct fixture *f, int i, int report_fd, int go_fd) {
	char name[16];
	kvd_client *c;
	kvd_seq *s[2];
	uint64_t inodes[MAX_INODES];
	size_t n;
	char go;
	int m;

	snprintf(name, sizeof(name), "tenant-%d", i);
	c = fixture_connect(f, name);
	m = kvd_model_register(c, &shapes[i]);
	ASSERT_OK(m);
	for (int k = 0; k < 2; k++) {
		ASSERT_OK(kvd_seq_open(c, m, 1024, &s[k]));
		for (int step = 0; step < 8; step++)
			ASSERT_OK(kvd_seq_grow(s[k], 64));
		fill_seq(s[k], i * 2 + k);
	}
	for (int k = 0; k < 2; k++) {
		ASSERT_EQ(check_seq(s[k], i * 2 + k), 0u);
		assert_digests_agree(s[k]);
	}
	n = mapped_chunk_inodes(getpid(), inodes, MAX_INODES);
	ASSERT_GT(n, 0u);
	/* One write per report, below PIPE_BUF, so that reports never interleave. */
	{
		uint64_t msg[2 + MAX_INODES] = { (uint64_t)i, n };
		size_t len = (2 + n) * sizeof(uint64_t);

		memcpy(msg + 2, inodes, n * sizeof(*inodes));
		ASSERT_LE(len, (size_t)PIPE_BUF);
		ASSERT_EQ(write(report_fd, msg, len), (ssize_t)len);
	}
	ASSERT_EQ(read(go_fd, &go, 1), 1);
	for (int k = 0; k < 2; k++)
		ASSERT_OK(kvd_seq_release(s[k]));
	ASSERT_EQ(mapped_chunk_inodes(getpid(), inodes, MAX_INODES), 0u);
	kvd_client_unref(c);
	_exit(0);
}

TEST(tenants_share_nothing) {
	static const char *const args[] = { "--pool-size", "64MiB", "--chunk-size", "1MiB", NULL };
	uint64_t inodes[TENANTS][MAX_INODES];
	size_t n[TENANTS];
	struct fixture f;
	int report[2], go[2];
	pid_t pids[TENANTS];

	fixture_start(&f, args);
	ASSERT_OK(pipe(report));
	ASSERT_OK(pipe(go));
	for (int i = 0; i < TENANTS; i++) {
		pids[i] = fixture_fork();
		if (pids[i] == 0)
			tenant_main(&f, i, report[1], go[0]);
	}
	/* Reports arrive in any order; each is the tenant's index, a count, then that many
	 * inodes. */
	for (int k = 0; k < TENANTS; k++) {
		uint64_t head[2];
		int i;

		ASSERT_EQ(read(report[0], head, sizeof(head)), (ssize_t)sizeof(head));
		ASSERT_LT(head[0], (uint64_t)TENANTS);
		i = (int)head[0];
		n[i] = head[1];
		ASSERT_LE(n[i], (size_t)MAX_INODES);
		ASSERT_EQ(read(report[0], inodes[i], n[i] * sizeof(uint64_t)), (ssize_t)(n[i] * sizeof(uint64_t)));
	}
	/* Everyone holds their memory now. */
	for (int i = 0; i < TENANTS; i++)
		for (int j = i + 1; j < TENANTS; j++)
			for (size_t a = 0; a < n[i]; a++)
				for (size_t b = 0; b < n[j]; b++)
					ASSERT_NE(inodes[i][a], inodes[j][b]);
	/* The tenants, plus the administrative connection asking. */
	ASSERT_EQ(fixture_status(&f, NULL, "connections"), (uint64_t)TENANTS + 1);
	for (int i = 0; i < TENANTS; i++) {
		char name[16];

		snprintf(name, sizeof(name), "tenant-%d", i);
		ASSERT_EQ(fixture_status(&f, name, "sequences"), 2u);
		/* A process maps exactly the chunks its tenant holds (one process per tenant). */
		ASSERT_EQ(fixture_status(&f, name, "chunks"), (uint64_t)n[i]);
		ASSERT_EQ(fixture_status(&f, name, "used_bytes"), (uint64_t)n[i] << 20);
	}
	ASSERT_EQ(mapped_chunk_inodes(getpid(), inodes[0], MAX_INODES), 0u);

	ASSERT_EQ(write(go[1], "ggg", TENANTS), TENANTS);
	for (int i = 0; i < TENANTS; i++) {
		int status;

		ASSERT_EQ(waitpid(pids[i], &status, 0), pids[i]);
		ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	}
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 0u);
	ASSERT_EQ(fixture_status(&f, NULL, "block_bytes"), 0u);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(reassigned_chunk_reads_zero) {
	/* One chunk in the whole pool: whoever gets memory gets that chunk. */
	static const char *const args[] = { "--pool-size", "1MiB", "--chunk-size", "1MiB", NULL };
	static const kvd_model_spec m = { "z", 2, 2, 2, 64, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER };
	uint64_t ino_a, ino_b;
	struct fixture f;
	kvd_client *a, *b;
	kvd_seq *sa, *sb;
	int ma, mb;

	fixture_start(&f, args);
	a = fixture_connect(&f, "alice");
	b = fixture_connect(&f, "bob");
	ma = kvd_model_register(a, &m);
	mb = kvd_model_register(b, &m);
	ASSERT_OK(ma);
	ASSERT_OK(mb);

	ASSERT_OK(kvd_seq_open(a, ma, 4096, &sa));
	ASSERT_OK(kvd_seq_grow(sa, 100));
	ASSERT_EQ(mapped_chunk_inodes(getpid(), &ino_a, 1), 1u);
	/* Dirty every byte of the chunk, not only the resident slots. */
	{
		void *k, *v;

		/* Slot 0 of a fresh chunk is the start of its block 0, the chunk's first byte. */
		ASSERT_OK(kvd_seq_kv(sa, 0, 0, 0, &k, &v));
		memset(k, 0xab, kvd_client_chunk_bytes(a));
	}

	ASSERT_OK(kvd_seq_open(b, mb, 4096, &sb));
	ASSERT_EQ(kvd_seq_grow(sb, 16), -ENOSPC);

	ASSERT_OK(kvd_seq_release(sa));
	/* alice unmapped it, and the daemon has it back. */
	ASSERT_EQ(mapped_chunk_inodes(getpid(), &ino_b, 1), 0u);
	ASSERT_EQ(fixture_status(&f, NULL, "chunks_free"), 1u);

	/* bob fills the whole chunk: 1024 tokens x 2 layers of 8 KiB blocks of 16 tokens. */
	ASSERT_OK(kvd_seq_grow(sb, 1024));
	ASSERT_EQ(mapped_chunk_inodes(getpid(), &ino_b, 1), 1u);
	/* A new memfd: alice's old one may still be mapped by alice's processes. */
	ASSERT_NE(ino_a, ino_b);
	{
		const struct kvd_seq_desc *d = kvd_seq_descriptor(sb);
		uint8_t *k, *v;
		uint64_t row = d->head_dim * 2;

		for (uint32_t l = 0; l < d->layers; l++)
			for (uint32_t h = 0; h < d->kv_heads; h++)
				for (uint32_t slot = 0; slot < 1024; slot++) {
					ASSERT_OK(kvd_seq_kv(sb, l, h, slot, (void **)&k, (void **)&v));
					for (uint64_t i = 0; i < row; i++)
						ASSERT_TRUE(k[i] == 0 && v[i] == 0);
				}
	}
	ASSERT_OK(kvd_seq_release(sb));
	kvd_client_unref(a);
	kvd_client_unref(b);
	ASSERT_EQ(fixture_stop(&f), 0);
}

static bool tenant_known(struct fixture *f, const char *name) {
	return fixture_status(f, name, "weight") != UINT64_MAX;
}

/* Waits (5 s at most) for the tenant to be forgotten. */
static bool wait_forgotten(struct fixture *f, const char *name) {
	for (int i = 0; i < 500; i++) {
		if (!tenant_known(f, name))
			return true;
		usleep(10000);
	}
	return false;
}

/* A connection of tenant name that held one sequence and gave everything back. */
static kvd_client *used_and_idle(struct fixture *f, const char *name) {
	static const kvd_model_spec m = { "z", 2, 2, 2, 64, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER };
	kvd_client *c = fixture_connect(f, name);
	kvd_seq *s;
	int id = kvd_model_register(c, &m);

	ASSERT_OK(id);
	ASSERT_OK(kvd_seq_open(c, id, 1024, &s));
	ASSERT_OK(kvd_seq_grow(s, 100));
	ASSERT_OK(kvd_seq_release(s));
	return c;
}

/*
 * Tenant names that change with each job: a full table (max-tenants) refuses new tenants,
 * logged, until the tenants that hold nothing are forgotten (tenant-forget). A tenant with
 * a connection, or with settings of its own, stays.
 */
TEST(idle_tenants_are_forgotten) {
	static const char *const args[] = { "--max-tenants", "3", "--tenant-forget", "300", NULL };
	struct fixture f;
	kvd_client *a, *b, *c, *admin;

	fixture_setup(&f, NULL, true);
	fixture_launch(&f, args);
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_tenant_set(admin, "configured-live", KVD_TENANT_KEEP, KVD_TENANT_KEEP, 2));
	a = used_and_idle(&f, "job-1");
	b = fixture_connect(&f, "job-2");
	ASSERT_EQ(kvd_client_connect(f.socket, "job-3", &c), -EUSERS);
	ASSERT_TRUE(fixture_wait_log(&f, "new tenant job-3 refused: max-tenants (3)", 1));
	/* Still connected: job-1 stays. */
	usleep(600 * 1000);
	ASSERT_TRUE(tenant_known(&f, "job-1"));
	kvd_client_unref(a);
	ASSERT_TRUE(wait_forgotten(&f, "job-1"));
	ASSERT_TRUE(fixture_wait_log(&f, "tenant job-1 forgotten", 1));
	ASSERT_OK(kvd_client_connect(f.socket, "job-3", &c));
	/* Connected, or with a live setting: never forgotten. */
	ASSERT_TRUE(tenant_known(&f, "job-2"));
	ASSERT_TRUE(tenant_known(&f, "configured-live"));
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 0u);
	kvd_client_unref(b);
	kvd_client_unref(c);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* kvdctl tenant delete's request: refused while the tenant holds anything or the config
 * file declares it; then it is gone, its live values with it. */
TEST(tenant_delete) {
	static const char *const args[] = { "--tenant-forget", "0", NULL };
	struct fixture f;
	kvd_client *a, *admin;
	kvd_seq *s;
	int m;

	fixture_setup(&f, "[tenant declared]\nweight = 2\n", false);
	fixture_launch(&f, args);
	admin = fixture_connect(&f, NULL);
	a = fixture_connect(&f, "a");
	m = kvd_model_register(a, &(kvd_model_spec){ "z", 2, 2, 2, 64, KVD_DTYPE_F16, 16,
						  KVD_LAYOUT_PER_LAYER });
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(a, m, 1024, &s));
	ASSERT_OK(kvd_seq_grow(s, 100));
	ASSERT_EQ(kvd_tenant_delete(admin, "a"), -EBUSY);
	ASSERT_TRUE(strstr(kvd_client_last_error(admin), "holds 1 connections, 1 sequences, 1 chunks"));
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(a);
	ASSERT_TRUE(fixture_wait_status(&f, "a", "connections", 0));
	ASSERT_EQ(kvd_tenant_delete(admin, "a"), 0);
	ASSERT_FALSE(tenant_known(&f, "a"));
	ASSERT_EQ(kvd_tenant_delete(admin, "a"), -ENOENT);
	/* Declared in the config file: its settings are its state. */
	ASSERT_EQ(kvd_tenant_delete(admin, "declared"), -EBUSY);
	ASSERT_TRUE(strstr(kvd_client_last_error(admin), "config file"));
	/* Set live: deleted with its live values. */
	ASSERT_OK(kvd_tenant_set(admin, "live", KVD_TENANT_KEEP, KVD_TENANT_KEEP, 7));
	ASSERT_EQ(kvd_tenant_delete(admin, "live"), 0);
	ASSERT_FALSE(tenant_known(&f, "live"));
	ASSERT_EQ(kvd_tenant_delete(admin, "bad name"), -EINVAL);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_halt(&f), 0);
	/* Gone across a restart too: the state file no longer has it. */
	fixture_launch(&f, args);
	ASSERT_FALSE(tenant_known(&f, "live"));
	ASSERT_TRUE(tenant_known(&f, "declared"));
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Live changes are logged with who made them (pid and uid), a tenant's sizes for people
 * and a cap of none as "none". */
TEST(live_changes_audited) {
	struct fixture f;
	kvd_client *admin;
	char line[256];

	fixture_setup(&f, NULL, true);
	fixture_launch(&f, NULL);
	admin = fixture_connect(&f, NULL);
	ASSERT_TRUE(kvd_tenant_set(admin, "audited", 2u << 20, KVD_TENANT_NO_CAP, 3) >= 0);
	snprintf(line, sizeof(line), "tenant audited set by pid %d uid %u: min 2.0 MiB, max none, "
	         "weight 3", (int)getpid(), (unsigned)getuid());
	ASSERT_TRUE(fixture_wait_log(&f, line, 1));
	ASSERT_TRUE(kvd_tenant_reset(admin, "audited") >= 0);
	snprintf(line, sizeof(line), "tenant audited reset by pid %d uid %u: min 0 B, max none",
	         (int)getpid(), (unsigned)getuid());
	ASSERT_TRUE(fixture_wait_log(&f, line, 1));
	ASSERT_OK(kvd_tenant_delete(admin, "audited"));
	snprintf(line, sizeof(line), "tenant audited deleted by pid %d uid %u", (int)getpid(),
	         (unsigned)getuid());
	ASSERT_TRUE(fixture_wait_log(&f, line, 1));
	ASSERT_EQ(fixture_log_count(&f, "18446744073709551615"), 0u);
	ASSERT_TRUE(kvd_budget_set(admin, 32u << 20) >= 0);
	snprintf(line, sizeof(line), "budget set to %u bytes by pid %d uid %u", 32u << 20,
	         (int)getpid(), (unsigned)getuid());
	ASSERT_TRUE(fixture_wait_log(&f, line, 1));
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* A tenant's policy, set live through kvd_tenant_set_params: it wins over the config
 * file, survives a restart, and reset drops it; bad names and bad structs are refused. */
TEST(tenant_policy_live) {
	struct fixture f;
	kvd_client *admin;
	char buf[64];
	kvd_tenant_params p = { .size = sizeof(p), .set = KVD_TENANT_SET_POLICY, .policy = "h2o" };
	struct {
		kvd_tenant_params p;
		uint64_t extra;
	} big = { .p = p };

	fixture_setup(&f, "[tenant t]\npolicy = snapkv\n", false);
	fixture_launch(&f, NULL);
	admin = fixture_connect(&f, NULL);
	ASSERT_STREQ(fixture_status_str(&f, "t", "policy", buf, sizeof(buf)), "snapkv");
	ASSERT_STREQ(fixture_status_str(&f, "t", "policy_source", buf, sizeof(buf)), "config");
	ASSERT_OK(kvd_tenant_set_params(admin, "t", &p));
	ASSERT_STREQ(fixture_status_str(&f, "t", "policy", buf, sizeof(buf)), "h2o");
	ASSERT_STREQ(fixture_status_str(&f, "t", "policy_source", buf, sizeof(buf)), "live");
	/* Only what set names changes. */
	ASSERT_EQ(fixture_status(&f, "t", "weight"), 1u);
	p.set = KVD_TENANT_SET_WEIGHT;
	p.weight = 9;
	p.policy = NULL;
	ASSERT_OK(kvd_tenant_set_params(admin, "t", &p));
	ASSERT_EQ(fixture_status(&f, "t", "weight"), 9u);
	ASSERT_STREQ(fixture_status_str(&f, "t", "policy", buf, sizeof(buf)), "h2o");

	p.set = KVD_TENANT_SET_POLICY;
	p.policy = "lru";
	ASSERT_EQ(kvd_tenant_set_params(admin, "t", &p), -EINVAL);
	ASSERT_TRUE(strstr(kvd_client_last_error(admin), "unknown policy"));
	p.policy = NULL;
	ASSERT_EQ(kvd_tenant_set_params(admin, "t", &p), -EINVAL);
	p.policy = "tova";
	p.set |= 1u << 31;
	ASSERT_EQ(kvd_tenant_set_params(admin, "t", &p), -EINVAL);
	/* Sizes: below the first version, refused; a larger struct with its unknown tail 0,
	 * taken; with a byte set there, a feature this library lacks. */
	p.set = KVD_TENANT_SET_POLICY;
	p.size = 8;
	ASSERT_EQ(kvd_tenant_set_params(admin, "t", &p), -EINVAL);
	big.p.size = sizeof(big);
	big.p.set = KVD_TENANT_SET_POLICY;
	big.p.policy = "tova";
	ASSERT_OK(kvd_tenant_set_params(admin, "t", &big.p));
	ASSERT_STREQ(fixture_status_str(&f, "t", "policy", buf, sizeof(buf)), "tova");
	big.extra = 1;
	big.p.policy = "h2o";
	ASSERT_EQ(kvd_tenant_set_params(admin, "t", &big.p), -E2BIG);
	ASSERT_STREQ(fixture_status_str(&f, "t", "policy", buf, sizeof(buf)), "tova");
	kvd_client_unref(admin);

	ASSERT_EQ(fixture_halt(&f), 0);
	fixture_launch(&f, NULL);
	ASSERT_STREQ(fixture_status_str(&f, "t", "policy", buf, sizeof(buf)), "tova");
	ASSERT_STREQ(fixture_status_str(&f, "t", "policy_source", buf, sizeof(buf)), "live");
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_tenant_reset(admin, "t"));
	ASSERT_STREQ(fixture_status_str(&f, "t", "policy", buf, sizeof(buf)), "snapkv");
	ASSERT_STREQ(fixture_status_str(&f, "t", "policy_source", buf, sizeof(buf)), "config");
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* kvd_model_register_params is the four registrations in one: the same checks and ids, and
 * the struct's size rules; kvd_client_connect_params likewise for connecting. */
TEST(params_structs) {
	static const char *const args[] = { "--pool-size", "8MiB", "--chunk-size", "1MiB", NULL };
	struct fixture f;
	kvd_client *c, *bad;
	kvd_seq *s;
	kvd_connect_params cp = { .size = sizeof(cp), .tenant = "p", .flags = KVD_CONNECT_NO_RING };
	kvd_model_params mp = {
		.size = sizeof(mp),
		.spec = { "m", 2, 4, 2, 32, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_HEAD },
		.eviction = { .unit = KVD_UNIT_HEAD_TOKEN },
		.compensation = KVD_COMPENSATION_LATENT,
		.index = { .heads = 2, .dim = 16 },
	};
	int m;

	fixture_start(&f, args);
	cp.socket_path = f.socket;
	ASSERT_OK(kvd_client_connect_params(&cp, &c));
	/* KVD_CONNECT_NO_RING: the per-step calls stay on the socket. */
	ASSERT_EQ(kvd_client_get_ring(c), 0);
	ASSERT_EQ(kvd_client_set_ring(c, 1), -EOPNOTSUPP);
	cp.flags = 1u << 7;
	ASSERT_EQ(kvd_client_connect_params(&cp, &bad), -EINVAL);
	cp.flags = 0;
	cp.size = 4;
	ASSERT_EQ(kvd_client_connect_params(&cp, &bad), -EINVAL);
	/* No path: $KVD_SOCKET's, as kvdctl's and kvd-bench's. */
	ASSERT_OK(setenv("KVD_SOCKET", f.socket, 1));
	ASSERT_OK(kvd_client_connect(NULL, "env", &bad));
	kvd_client_unref(bad);
	ASSERT_OK(unsetenv("KVD_SOCKET"));

	m = kvd_model_register_params(c, &mp);
	ASSERT_TRUE(m >= 0);
	ASSERT_OK(kvd_seq_open(c, m, 256, &s));
	ASSERT_OK(kvd_seq_grow(s, 20));
	ASSERT_EQ(kvd_seq_header(s)->index_dim, 16u);
	ASSERT_EQ(kvd_seq_header(s)->compensation, (uint32_t)KVD_COMPENSATION_LATENT);
	ASSERT_OK(kvd_seq_release(s));
	/* What kvd_model_register_indexed refuses, this refuses: an indexer without eviction. */
	mp.eviction.unit = KVD_UNIT_NONE;
	mp.compensation = KVD_COMPENSATION_NONE;
	ASSERT_EQ(kvd_model_register_params(c, &mp), -EINVAL);
	/* No indexer, no eviction: kvd_model_register's model. */
	mp.index.heads = mp.index.dim = 0;
	ASSERT_TRUE(kvd_model_register_params(c, &mp) >= 0);
	mp.size = 16;
	ASSERT_EQ(kvd_model_register_params(c, &mp), -EINVAL);
	ASSERT_EQ(kvd_model_register_params(c, NULL), -EINVAL);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Runs kvd-bench load with args against f; its output into out. Returns its exit status. */
static int bench_load(struct fixture *f, const char *args, char *out, size_t n) {
	char cmd[1024];
	size_t k;
	FILE *p;
	int status;

	snprintf(cmd, sizeof(cmd), "%s load --socket %s %s 2>&1", getenv("KVD_BENCH"), f->socket, args);
	p = popen(cmd, "re");
	ASSERT_NOT_NULL(p);
	k = fread(out, 1, n - 1, p);
	out[k] = 0;
	status = pclose(p);
	ASSERT_TRUE(WIFEXITED(status));
	return WEXITSTATUS(status);
}

/* kvd-bench load takes a node's own tenant names (--tenant), the rest bench-<i>. */
TEST(bench_load_names_tenants) {
	static char out[16384];
	struct fixture f;

	if (!getenv("KVD_BENCH"))
		TEST_SKIP("KVD_BENCH is not set (run the test through meson)");
	fixture_start(&f, (const char *const[]){ "--pool-size", "64MiB", "--chunk-size", "1MiB", NULL });
	ASSERT_EQ(bench_load(&f, "--tenant llama --tenant chat --tenants 3 --seqs 2 --tokens 256 "
	                     "--verify", out, sizeof(out)), 0);
	ASSERT_TRUE(strstr(out, "verify: OK"));
	ASSERT_TRUE(strstr(out, "\nllama "));
	ASSERT_TRUE(strstr(out, "\nchat "));
	ASSERT_TRUE(strstr(out, "\nbench-2 "));
	ASSERT_TRUE(fixture_status(&f, "chat", "grants") > 0);
	ASSERT_TRUE(fixture_status(&f, "llama", "grants") > 0);
	/* Names the daemon would refuse, or given twice, are usage errors. */
	ASSERT_EQ(bench_load(&f, "--tenant 'no spaces'", out, sizeof(out)), 2);
	ASSERT_EQ(bench_load(&f, "--tenant a --tenant a", out, sizeof(out)), 2);
	ASSERT_EQ(bench_load(&f, "--tenant a --tenant b --tenants 1", out, sizeof(out)), 2);
	ASSERT_EQ(fixture_stop(&f), 0);
}
