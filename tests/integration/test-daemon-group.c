/* SPDX-License-Identifier: MIT */
/*
 * Tensor-parallel groups (kvd_open_params.group_size, group_of; docs/engines.md
 * "Tensor-parallel groups"): one sequence per rank, each on its own connection; a step's
 * grows are admitted all or none, whichever rank asks first, and each rank's own grow
 * claims what the step made; a member that goes breaks the group; nobody outside the
 * tenant can join or find a group.
 */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fixture.h"
#include "test.h"

#define RANKS 2

static const char *const args[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB",
	                            "--grant-wait", "0", NULL };

/* Each rank holds one of the model's 2 kv heads: 2 layers x 1 kv head x 64 f16. */
static const kvd_model_spec spec = { "tp-model", 2, 2, 1, 64, KVD_DTYPE_F16, 16,
	                             KVD_LAYOUT_PER_LAYER };

static kvd_seq *open_member(kvd_client *c, int m, uint32_t size, uint64_t of, int *ret) {
	kvd_open_params p = { .size = sizeof(p), .model_id = m, .max_tokens = 4096,
		              .group_size = size, .group_of = of };
	kvd_seq *s = NULL;

	*ret = kvd_seq_open_params(c, &p, &s);
	return s;
}

TEST(group_steps_all_or_none) {
	struct fixture f;
	kvd_client *c[RANKS], *admin, *other;
	kvd_seq *s[RANKS], *x;
	int m[RANKS], r;

	fixture_start(&f, args);
	admin = fixture_connect(&f, NULL);
	for (int i = 0; i < RANKS; i++) {
		c[i] = fixture_connect(&f, "tp");
		m[i] = kvd_model_register(c[i], &spec);
		ASSERT_OK(m[i]);
	}
	s[0] = open_member(c[0], m[0], RANKS, 0, &r);
	ASSERT_OK(r);
	/* The group grows once every rank joined. */
	ASSERT_ERRNO(kvd_seq_grow(s[0], 16), -EAGAIN);
	/* Another tenant finds no such group; a bad size is refused. */
	other = fixture_connect(&f, "other");
	ASSERT_OK(kvd_model_register(other, &spec));
	ASSERT_NULL(open_member(other, 1, 0, kvd_seq_id(s[0]), &r));
	ASSERT_EQ(r, -ENOENT);
	ASSERT_NULL(open_member(c[1], m[1], 17, 0, &r));
	ASSERT_EQ(r, -EINVAL);
	ASSERT_NULL(open_member(c[1], m[1], 2, kvd_seq_id(s[0]), &r));
	ASSERT_EQ(r, -EINVAL);
	s[1] = open_member(c[1], m[1], 0, kvd_seq_id(s[0]), &r);
	ASSERT_OK(r);
	/* Full. */
	ASSERT_NULL(open_member(c[1], m[1], 0, kvd_seq_id(s[0]), &r));
	ASSERT_EQ(r, -EBUSY);

	/* Rank 0's grow makes the step: both hold 40 tokens; rank 1's grow claims its part. */
	ASSERT_OK(kvd_seq_grow(s[0], 40));
	ASSERT_EQ(kvd_seq_tokens(s[1], 0, 0), 40);
	ASSERT_OK(kvd_seq_grow(s[1], 40));
	ASSERT_EQ(kvd_seq_tokens(s[1], 1, 0), 40);
	/* Rank 1 asks first for the next step; rank 0 must grow by the same. */
	ASSERT_OK(kvd_seq_grow(s[1], 30));
	ASSERT_EQ(kvd_seq_tokens(s[0], 0, 0), 70);
	ASSERT_ERRNO(kvd_seq_grow(s[0], 20), -EINVAL);
	ASSERT_TRUE(strstr(kvd_client_last_error(c[0]), "by 30 tokens"));
	ASSERT_ERRNO(kvd_seq_grow(s[1], 30), -EINVAL);   /* rank 0 has not claimed it */
	ASSERT_OK(kvd_seq_grow(s[0], 30));
	for (int i = 0; i < RANKS; i++) {
		assert_positions_upto(s[i], 70);
		fill_seq(s[i], 1 + (uint32_t)i);
	}
	ASSERT_EQ(fixture_status(&f, NULL, "group_steps"), 2u);
	/* Joining a group that has grown. */
	ASSERT_NULL(open_member(c[1], m[1], 0, kvd_seq_id(s[0]), &r));
	ASSERT_EQ(r, -EBUSY);

	/* A step the tenant's max has room for on one rank only: neither grows. */
	{
		uint64_t used = fixture_status(&f, "tp", "used_bytes");

		/* The tenant's one chunk (256 blocks of 4 KiB) holds the 20 blocks of 70 tokens a
		 * table, 2 tables a rank: 1000 more tokens take 124 more blocks a rank, 248 for
		 * both. */
		ASSERT_EQ(used, 1u << 20);
		ASSERT_OK(kvd_tenant_set(admin, "tp", 0, used, 0));
		ASSERT_ERRNO(kvd_seq_grow(s[0], 1000), -EDQUOT);
		for (int i = 0; i < RANKS; i++)
			ASSERT_EQ(kvd_seq_tokens(s[i], 1, 0), 70);
		ASSERT_EQ(fixture_status(&f, "tp", "block_bytes"), 20u * 4096);
		ASSERT_OK(kvd_tenant_set(admin, "tp", 0, 0, 0));
	}
	for (int i = 0; i < RANKS; i++) {
		ASSERT_EQ(check_seq(s[i], 1 + (uint32_t)i), 0u);
		assert_digests_agree(s[i]);
	}

	/* Rank 1 goes: rank 0 cannot step on its own. */
	ASSERT_OK(kvd_seq_release(s[1]));
	ASSERT_ERRNO(kvd_seq_grow(s[0], 1), -EPIPE);
	ASSERT_TRUE(strstr(kvd_client_last_error(c[0]), "went away"));
	ASSERT_OK(kvd_seq_release(s[0]));
	/* A plain sequence is no group to join. */
	ASSERT_OK(kvd_seq_open(c[0], m[0], 64, &x));
	ASSERT_NULL(open_member(c[1], m[1], 0, kvd_seq_id(x), &r));
	ASSERT_EQ(r, -ENOENT);
	ASSERT_OK(kvd_seq_release(x));
	ASSERT_EQ(fixture_status(&f, "tp", "block_bytes"), 0u);
	for (int i = 0; i < RANKS; i++)
		kvd_client_unref(c[i]);
	kvd_client_unref(other);
	kvd_client_unref(admin);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "used_bytes", 0));
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* A rank whose process dies breaks the group for the others; its blocks go back. */
TEST(group_member_killed) {
	struct fixture f;
	kvd_client *c;
	uint64_t id;
	kvd_seq *s;
	int m, r;
	pid_t pid;
	int out[2];

	fixture_start(&f, args);
	c = fixture_connect(&f, "tp");
	m = kvd_model_register(c, &spec);
	ASSERT_OK(m);
	s = open_member(c, m, 2, 0, &r);
	ASSERT_OK(r);
	ASSERT_OK(pipe(out));
	/* Handles belong to the process that made them: the id goes to the child as a number. */
	id = kvd_seq_id(s);
	pid = fixture_fork();
	if (pid == 0) {
		kvd_client *k = fixture_connect(&f, "tp");
		kvd_seq *ks = open_member(k, kvd_model_register(k, &spec), 0, id, &r);
		char x = r == 0 && kvd_seq_grow(ks, 32) == 0 ? 'y' : 'n';

		(void)!write(out[1], &x, 1);
		pause();
		_exit(0);
	}
	{
		char x = 0;

		ASSERT_EQ(read(out[0], &x, 1), 1);
		ASSERT_EQ(x, 'y');
	}
	/* The other rank's step grew this one. */
	ASSERT_EQ(kvd_seq_tokens(s, 0, 0), 32);
	ASSERT_OK(kvd_seq_grow(s, 32));
	kill(pid, SIGKILL);
	ASSERT_OK(waitpid(pid, NULL, 0) == pid ? 0 : -1);
	ASSERT_TRUE(fixture_wait_status(&f, "tp", "connections", 1));
	ASSERT_ERRNO(kvd_seq_grow(s, 1), -EPIPE);
	ASSERT_OK(kvd_seq_release(s));
	close(out[0]);
	close(out[1]);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}
