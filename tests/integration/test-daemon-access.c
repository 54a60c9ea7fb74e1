/* SPDX-License-Identifier: MIT */
/*
 * Access control (docs/security.md): the socket is 0660 and group socket-group, a
 * tenant with allow-users or allow-groups only for those peers, tenant-create for the
 * others, admin requests only for root and admin-group, max-connections-per-uid. The
 * clients are children that drop root for unused uids and gids (the groups are numbers,
 * so that nothing of the machine's /etc/group is needed); the test needs root.
 */
#include <errno.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fixture.h"
#include "test.h"

#define SOCK_GID 4242u                /* socket-group */
#define ADMIN_GID 4243u               /* admin-group */
#define BETA_GID 4244u                /* allow-groups of tenant beta */
#define USER_A 12345u                 /* allow-users of tenant alpha */
#define NOBODY 65534u

static const char config[] =
	"[kvd]\n"
	"pool-size = 16MiB\n"
	"socket-group = 4242\n"
	"admin-group = 4243\n"
	"tenant-create = none\n"
	"max-connections-per-uid = 3\n"
	"host-tier-size = 4MiB\n"
	"\n"
	"[tenant alpha]\n"
	"allow-users = 12345\n"
	"recall = 16\n"
	"\n"
	"[tenant beta]\n"
	"allow-groups = 4244\n"
	"\n"
	"[tenant open]\n";

enum op {
	OP_TENANT,                    /* hello as tenant */
	OP_BUDGET,                    /* an admin connection, then budget set */
	OP_TENANT_SET,                /* an admin connection, then tenant set */
	OP_STATUS,                    /* an admin connection, then status */
	OP_CONNECTIONS,               /* 4 connections as tenant open at once: the 4th's result */
	OP_EVICT_FLOOD,               /* 12 kvd_evict on its own tenant at once: the first error */
	OP_PLAN_FLOOD,                /* 12 kvd_evict_plan on its own tenant: the first error */
	OP_RECALL_FLOOD,              /* 12 kvd_seq_recall: the first error other than nothing
	                               * kept */
	OP_LIST,                      /* an admin connection, then kvd_connections_get */
	OP_LIST_OWN,                  /* as tenant: its listing has its own tenant only; then
	                               * kvd_sequences_get of tenant open */
	OP_DISCONNECT,                /* as tenant (or admin), kvd_disconnect(disconnect_target) */
	OP_CONFIG,                    /* kvd_config_get, as tenant (NULL: administrative) */
	OP_NEW_TENANTS,               /* hellos as tenant-0, tenant-1, ... tenant-3 (tenant is
	                               * the prefix), one after the other: the first error */
};

/* The connection OP_DISCONNECT asks to close. */
static uint64_t disconnect_target;

/* Opens a sequence of an evictable model, grown a little, for recalls (nothing kept:
 * each is answered -ENODATA once it passed the rate limit). */
static int recall_seq(kvd_client *c, kvd_seq **ret) {
	kvd_model_spec spec = { .name = "access", .layers = 1, .q_heads = 1, .kv_heads = 1,
	                        .head_dim = 16, .dtype = KVD_DTYPE_F16, .block_tokens = 16,
	                        .layout = KVD_LAYOUT_PER_LAYER };
	kvd_eviction_spec ev = { .unit = KVD_UNIT_LAYER_TOKEN, .window = 4 };
	int model = kvd_model_register_evictable(c, &spec, &ev), r;

	if (model < 0)
		return model;
	r = kvd_seq_open(c, model, 256, ret);
	return r < 0 ? r : kvd_seq_grow(*ret, 32);
}

/*
 * Runs op in a child as uid/gid with the given supplementary groups; returns the libkvd
 * result (0 or -errno), or fails the test when the child could not drop root.
 */
static int run_as(struct fixture *f, uid_t uid, gid_t gid, const gid_t *groups, size_t n,
                  enum op op, const char *tenant) {
	int status;
	pid_t pid = fixture_fork();

	if (pid == 0) {
		kvd_client *c[4] = {};
		kvd_status *st = NULL;
		int r;

		if (setgroups(n, groups) < 0 || setgid(gid) < 0 || setuid(uid) < 0 || getuid() != uid)
			_exit(200);
		switch (op) {
		case OP_TENANT:
			r = kvd_client_connect(f->socket, tenant, &c[0]);
			break;
		case OP_BUDGET:
		case OP_TENANT_SET:
		case OP_STATUS:
			r = kvd_client_connect(f->socket, NULL, &c[0]);
			if (r < 0)
				_exit(201);
			r = op == OP_BUDGET ? kvd_budget_set(c[0], UINT64_C(8) << 20) :
			    op == OP_TENANT_SET ? kvd_tenant_set(c[0], tenant, 0, KVD_TENANT_KEEP, 2) :
			    kvd_status_get(c[0], &st);
			kvd_status_free(st);
			break;
		case OP_CONFIG: {
			kvd_table *t = NULL;

			r = kvd_client_connect(f->socket, tenant, &c[0]);
			if (r < 0)
				_exit(201);
			r = kvd_config_get(c[0], &t);
			kvd_table_free(t);
			break;
		}
		case OP_LIST:
		case OP_LIST_OWN:
		case OP_DISCONNECT: {
			kvd_table *t = NULL;

			r = kvd_client_connect(f->socket, tenant, &c[0]);
			if (r < 0)
				_exit(201);
			if (op == OP_DISCONNECT) {
				r = kvd_disconnect(c[0], disconnect_target);
				break;
			}
			r = kvd_connections_get(c[0], &t);
			if (op == OP_LIST_OWN) {
				const char *name;

				if (r < 0 || kvd_table_rows(t) != 1 ||
				    kvd_table_str(t, 0, "tenant", &name) < 0 || strcmp(name, tenant) != 0)
					_exit(204);
				kvd_table_free(t);
				t = NULL;
				r = kvd_sequences_get(c[0], "open", &t);
			}
			kvd_table_free(t);
			break;
		}
		case OP_EVICT_FLOOD:
		case OP_PLAN_FLOOD:
		case OP_RECALL_FLOOD: {
			kvd_seq *s = NULL;

			r = kvd_client_connect(f->socket, tenant, &c[0]);
			if (r < 0)
				_exit(201);
			if (op == OP_RECALL_FLOOD && (r = recall_seq(c[0], &s)) < 0) {
				fprintf(stderr, "recall_seq: %d %s\n", r, kvd_client_last_error(c[0]));
				_exit(205);
			}
			for (unsigned i = 0; i < 12 && (r >= 0 || r == -ENODATA); i++) {
				kvd_evictions *plan = NULL;

				r = op == OP_EVICT_FLOOD ? kvd_evict(c[0], tenant, 4096, NULL) :
				    op == OP_PLAN_FLOOD ? kvd_evict_plan(c[0], tenant, 4096, &plan) :
				    kvd_seq_recall(s, NULL, NULL);
				kvd_evictions_free(plan);
			}
			if (r == -EAGAIN && !strstr(kvd_client_last_error(c[0]), "a second"))
				_exit(203);
			break;
		}
		case OP_NEW_TENANTS:
			r = 0;
			for (unsigned i = 0; i < 4 && r >= 0; i++) {
				char name[64];

				snprintf(name, sizeof(name), "%s-%u", tenant, i);
				r = kvd_client_connect(f->socket, name, &c[0]);
				if (r >= 0)
					c[0] = kvd_client_unref(c[0]);
			}
			break;
		default:
			for (unsigned i = 0; i < 3; i++)
				if (kvd_client_connect(f->socket, tenant, &c[i]) < 0)
					_exit(202);
			r = kvd_client_connect(f->socket, tenant, &c[3]);
			break;
		}
		for (unsigned i = 0; i < 4; i++)
			kvd_client_unref(c[i]);
		/* r is 0 or -errno; 1 (applied, not saved) counts as applied. */
		_exit(r >= 0 ? 0 : r < -199 ? 199 : -r);
	}
	ASSERT_EQ(waitpid(pid, &status, 0), pid);
	ASSERT_TRUE(WIFEXITED(status));
	if (WEXITSTATUS(status) >= 200)
		test_fail(__FILE__, __LINE__, "child as uid %u failed (%d)", (unsigned)uid,
		          WEXITSTATUS(status));
	return -WEXITSTATUS(status);
}

static void start(struct fixture *f) {
	fixture_setup(f, config, true);
	/* The temporary directory is 0700: let the children reach the socket in it. */
	ASSERT_OK(chmod(f->dir, 0711));
	fixture_launch(f, NULL);
}

TEST(socket_is_group_owned_and_not_world_writable) {
	static const gid_t sock[] = { SOCK_GID };
	struct fixture f;
	struct stat st;

	if (geteuid() != 0)
		TEST_SKIP("needs root to run clients as other users");
	start(&f);
	ASSERT_OK(stat(f.socket, &st));
	ASSERT_EQ(st.st_mode & 07777, 0660u);
	ASSERT_EQ(st.st_gid, SOCK_GID);
	/* Not in the socket's group: no connection at all. */
	ASSERT_EQ(run_as(&f, NOBODY, NOBODY, NULL, 0, OP_TENANT, "open"), -EACCES);
	/* In it: status is open to everyone. */
	ASSERT_EQ(run_as(&f, NOBODY, NOBODY, sock, 1, OP_STATUS, NULL), 0);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(tenants_by_user_and_group) {
	static const gid_t sock[] = { SOCK_GID }, beta[] = { SOCK_GID, BETA_GID };
	struct fixture f;

	if (geteuid() != 0)
		TEST_SKIP("needs root to run clients as other users");
	start(&f);
	/* By user. */
	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_TENANT, "alpha"), 0);
	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_TENANT, "beta"), -EACCES);
	ASSERT_EQ(run_as(&f, NOBODY, NOBODY, sock, 1, OP_TENANT, "alpha"), -EACCES);
	/* By a supplementary group, and by the primary group. */
	ASSERT_EQ(run_as(&f, NOBODY, NOBODY, beta, 2, OP_TENANT, "beta"), 0);
	ASSERT_EQ(run_as(&f, NOBODY, BETA_GID, sock, 1, OP_TENANT, "beta"), 0);
	/* A declared tenant without lists: anyone who may connect. */
	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_TENANT, "open"), 0);
	/* tenant-create = none: a tenant the file does not declare, root only. */
	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_TENANT, "adhoc"), -EACCES);
	ASSERT_EQ(fixture_status(&f, "adhoc", "connections"), UINT64_MAX);
	/* Root may act as anyone. */
	kvd_client_unref(fixture_connect(&f, "alpha"));
	kvd_client_unref(fixture_connect(&f, "adhoc"));
	ASSERT_EQ(fixture_status(&f, NULL, "access_refused"), 3u);
	ASSERT_TRUE(fixture_wait_log(&f, "uid 12345 is not allowed to act as tenant beta", 1));
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(admin_requests_need_root_or_admin_group) {
	static const gid_t sock[] = { SOCK_GID }, admin[] = { SOCK_GID, ADMIN_GID };
	struct fixture f;

	if (geteuid() != 0)
		TEST_SKIP("needs root to run clients as other users");
	start(&f);
	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_BUDGET, NULL), -EPERM);
	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_TENANT_SET, "alpha"), -EPERM);
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), UINT64_C(16) << 20);
	ASSERT_EQ(fixture_status(&f, "alpha", "weight"), 1u);
	ASSERT_EQ(fixture_status(&f, NULL, "access_refused"), 2u);

	ASSERT_EQ(run_as(&f, NOBODY, NOBODY, admin, 2, OP_BUDGET, NULL), 0);
	ASSERT_EQ(run_as(&f, NOBODY, NOBODY, admin, 2, OP_TENANT_SET, "alpha"), 0);
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), UINT64_C(8) << 20);
	ASSERT_EQ(fixture_status(&f, "alpha", "weight"), 2u);

	/* Root, in no admin group. */
	{
		__attribute__((cleanup(kvd_client_unrefp))) kvd_client *c = fixture_connect(&f, NULL);

		ASSERT_TRUE(kvd_budget_reset(c) >= 0);
	}
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), UINT64_C(16) << 20);
	ASSERT_EQ(fixture_status(&f, NULL, "access_refused"), 2u);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Who holds what, and closing a connection: a tenant's user sees and closes only its own
 * tenant's; an admin connection needs root or admin-group; so does reading the settings. */
TEST(listing_and_disconnect_are_administrative) {
	static const gid_t sock[] = { SOCK_GID }, admin[] = { SOCK_GID, ADMIN_GID };
	kvd_table *t = NULL;
	struct fixture f;
	kvd_client *open, *root;
	const char *name;

	if (geteuid() != 0)
		TEST_SKIP("needs root to run clients as other users");
	start(&f);
	open = fixture_connect(&f, "open");
	root = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_connections_get(root, &t));
	for (uint32_t i = 0; i < kvd_table_rows(t); i++)
		if (kvd_table_str(t, i, "tenant", &name) == 0 && strcmp(name, "open") == 0)
			ASSERT_OK(kvd_table_u64(t, i, "id", &disconnect_target));
	kvd_table_free(t);
	ASSERT_NE(disconnect_target, 0u);

	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_LIST, NULL), -EPERM);
	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_LIST_OWN, "alpha"), -EPERM);
	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_DISCONNECT, "alpha"), -EPERM);
	ASSERT_EQ(fixture_status(&f, "open", "connections"), 1u);
	/* The settings name paths, users and groups: the operator's to read. */
	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_CONFIG, NULL), -EPERM);
	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_CONFIG, "alpha"), -EPERM);
	ASSERT_EQ(run_as(&f, NOBODY, NOBODY, admin, 2, OP_CONFIG, NULL), 0);
	ASSERT_EQ(run_as(&f, NOBODY, NOBODY, admin, 2, OP_LIST, NULL), 0);
	ASSERT_EQ(run_as(&f, NOBODY, NOBODY, admin, 2, OP_DISCONNECT, NULL), 0);
	ASSERT_TRUE(fixture_wait_status(&f, "open", "connections", 0));
	ASSERT_TRUE(fixture_wait_log(&f, "disconnected by pid", 1));
	kvd_client_unref(open);
	kvd_client_unref(root);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(reload_changes_who_may_act) {
	static const gid_t sock[] = { SOCK_GID };
	struct fixture f;

	if (geteuid() != 0)
		TEST_SKIP("needs root to run clients as other users");
	start(&f);
	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_TENANT, "alpha"), 0);
	fixture_write_config(&f, "[kvd]\npool-size = 16MiB\nsocket-group = 4242\n"
	                     "tenant-create = none\n[tenant alpha]\nallow-users = 65534\n");
	ASSERT_OK(kill(f.pid, SIGHUP));
	ASSERT_TRUE(fixture_wait_log(&f, "reloaded", 1));
	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_TENANT, "alpha"), -EACCES);
	ASSERT_EQ(run_as(&f, NOBODY, NOBODY, sock, 1, OP_TENANT, "alpha"), 0);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* A tenant's own requests that run a round (evictions, plans, recalls) are rate-limited
 * per connection (8 at once, then 10 a second), together: a loop on them would otherwise
 * keep the round worker to itself. Operators are not. */
TEST(evict_rate_limited) {
	static const gid_t sock[] = { SOCK_GID };
	struct fixture f;
	kvd_client *admin;
	uint64_t freed;

	if (geteuid() != 0)
		TEST_SKIP("needs root to run clients as other users");
	start(&f);
	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_EVICT_FLOOD, "alpha"), -EAGAIN);
	ASSERT_EQ(fixture_status(&f, NULL, "refused_evict_rate"), 1u);
	admin = fixture_connect(&f, NULL);
	for (int i = 0; i < 12; i++)
		ASSERT_OK(kvd_evict(admin, "alpha", 4096, &freed));
	ASSERT_EQ(fixture_status(&f, NULL, "refused_evict_rate"), 1u);
	/* Dry runs and recalls too: each the work of a round. */
	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_PLAN_FLOOD, "alpha"), -EAGAIN);
	ASSERT_EQ(fixture_status(&f, NULL, "refused_evict_rate"), 2u);
	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_RECALL_FLOOD, "alpha"), -EAGAIN);
	ASSERT_EQ(fixture_status(&f, NULL, "refused_evict_rate"), 3u);
	for (int i = 0; i < 12; i++) {
		kvd_evictions *plan = NULL;

		ASSERT_OK(kvd_evict_plan(admin, "alpha", 4096, &plan));
		kvd_evictions_free(plan);
	}
	ASSERT_EQ(fixture_status(&f, NULL, "refused_evict_rate"), 3u);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(connections_per_uid) {
	static const gid_t sock[] = { SOCK_GID };
	struct fixture f;

	if (geteuid() != 0)
		TEST_SKIP("needs root to run clients as other users");
	start(&f);
	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_CONNECTIONS, "open"), -EUSERS);
	ASSERT_EQ(fixture_status(&f, NULL, "uid_connections_refused"), 1u);
	/* Another user is not held back by the first. */
	ASSERT_TRUE(fixture_wait_status(&f, "open", "connections", 0));
	ASSERT_EQ(run_as(&f, NOBODY, NOBODY, sock, 1, OP_TENANT, "open"), 0);
	ASSERT_TRUE(fixture_wait_log(&f, "uid 12345: its user's limit of", 1));
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* With tenant-create = any, one user brings at most max-tenants-per-uid tenants into being:
 * it cannot fill the table for everyone else; a tenant that exists takes it as ever, and
 * root is not counted. */
TEST(tenants_per_uid) {
	static const gid_t sock[] = { SOCK_GID };
	struct fixture f;

	if (geteuid() != 0)
		TEST_SKIP("needs root to run clients as other users");
	fixture_setup(&f, "[kvd]\npool-size = 16MiB\nsocket-group = 4242\ntenant-create = any\n"
	              "max-tenants-per-uid = 3\n", true);
	ASSERT_OK(chmod(f.dir, 0711));
	fixture_launch(&f, NULL);
	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_NEW_TENANTS, "mine"), -EUSERS);
	ASSERT_EQ(fixture_status(&f, NULL, "refused_tenants_per_uid"), 1u);
	ASSERT_EQ(fixture_status(&f, "mine-2", "connections"), 0u);
	ASSERT_EQ(fixture_status(&f, "mine-3", "connections"), UINT64_MAX);
	ASSERT_EQ(run_as(&f, USER_A, USER_A, sock, 1, OP_TENANT, "mine-0"), 0);
	ASSERT_EQ(run_as(&f, NOBODY, NOBODY, sock, 1, OP_NEW_TENANTS, "other"), -EUSERS);
	ASSERT_EQ(fixture_status(&f, NULL, "refused_tenants_per_uid"), 2u);
	ASSERT_EQ(run_as(&f, 0, 0, sock, 1, OP_NEW_TENANTS, "root"), 0);
	ASSERT_TRUE(fixture_wait_log(&f, "refused at limit tenants_per_uid", 1));
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* admin-on-tenant-connections = no: an engine's connection changes no node setting, even as
 * root (an engine's error probe once set the budget); kvdctl's administrative connection
 * still does. The default lets root do it from either. */
TEST(admin_only_from_administrative_connections) {
	struct fixture f;
	kvd_client *engine, *admin;

	fixture_start(&f, (const char *const[]){ "--pool-size", "16MiB", "--chunk-size", "1MiB",
	                                         "--admin-on-tenant-connections", "no", NULL });
	engine = fixture_connect(&f, "engine");
	admin = fixture_connect(&f, NULL);
	ASSERT_ERRNO(kvd_budget_set(engine, 1u << 20), -EPERM);
	ASSERT_TRUE(strstr(kvd_client_last_error(engine), "admin-on-tenant-connections = no"));
	ASSERT_ERRNO(kvd_tenant_set(engine, "engine", 0, 1u << 20, 0), -EPERM);
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 16u << 20);
	ASSERT_OK(kvd_budget_set(admin, 8u << 20));
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 8u << 20);
	kvd_client_unref(engine);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);

	/* By default root may, from a tenant's connection too. */
	fixture_start(&f, (const char *const[]){ "--pool-size", "16MiB", "--chunk-size", "1MiB", NULL });
	engine = fixture_connect(&f, "engine");
	ASSERT_OK(kvd_budget_set(engine, 4u << 20));
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 4u << 20);
	kvd_client_unref(engine);
	ASSERT_EQ(fixture_stop(&f), 0);
}
