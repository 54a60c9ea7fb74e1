/* SPDX-License-Identifier: MIT */
/*
 * Isolation against a hostile tenant (docs/security.md). memfds and cuMem fds
 * cannot be revoked: a process that was given a chunk may keep an fd of its own and a
 * mapping of its own, whatever it answers. Here tenant alice does so, then gives the
 * chunk back (releasing its sequence, which libkvd acknowledges, or disconnecting), and
 * bob, in a one-chunk pool, is given that chunk and writes his K/V into all of it. Alice's
 * fd and mapping must never show bob's bytes, and nothing alice writes through them may
 * change bob's K/V or his digests: bob's chunk is a new memory object.
 *
 * Runs on the host backend, and on a cuda pool under the fake driver (tests/gpu), whose
 * device memory is a memfd too, so that alice's kept fd and mapping are real there as well.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef KVD_HAVE_CUDA
#include "basic/cuda-dl.h"
#endif
#include "common/digest.h"
#include "common/layout.h"
#include "fixture.h"
#include "test.h"

static const kvd_model_spec spec = { "z", 2, 2, 2, 64, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER };

/* One chunk in the whole pool: whoever gets memory gets that chunk. 1024 tokens of spec
 * fill it (2 layers of 8 KiB blocks of 16 tokens). */
static const char *const one_chunk[] = { "--pool-size", "1MiB", "--chunk-size", "1MiB", NULL };
#define FILL_TOKENS 1024u

/* The digest kvd_seq_digest gives for s when every K/V byte is zero. */
static uint64_t zero_digest(kvd_seq *s) {
	const struct kvd_seq_desc *d = kvd_seq_descriptor(s);
	uint64_t h = DIGEST_INIT, row = layout_row_bytes(d);
	uint8_t *zero = calloc(1, row);

	ASSERT_NOT_NULL(zero);
	for (uint32_t l = 0; l < d->layers; l++)
		for (uint32_t kh = 0; kh < d->kv_heads; kh++) {
			int64_t n = kvd_seq_tokens(s, l, kh);

			ASSERT_OK(n);
			for (int64_t slot = 0; slot < 2 * n; slot++) /* K and V */
				h = digest_update(h, zero, row);
		}
	free(zero);
	return h;
}

/* The highest socket fd of this process: the one a connection just made opened. */
static int newest_socket_fd(void) {
	int best = -1;

	for (int fd = 3; fd < 1024; fd++) {
		char path[64], target[64];
		ssize_t n;

		snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
		n = readlink(path, target, sizeof(target) - 1);
		if (n > 0 && strncmp(target, "socket:", 7) == 0)
			best = fd;
	}
	return best;
}

/* A connection of tenant with spec registered, its model's id in *ret_model. */
static kvd_client *connect_with_model(struct fixture *f, const char *tenant, int *ret_model) {
	kvd_client *c = fixture_connect(f, tenant);

	*ret_model = kvd_model_register(c, &spec);
	ASSERT_OK(*ret_model);
	return c;
}

/* A sequence of c's model m that fills the pool's one chunk, written with tag. */
static kvd_seq *fill_chunk(kvd_client *c, int m, uint32_t tag) {
	kvd_seq *s;

	ASSERT_OK(kvd_seq_open(c, m, 4096, &s));
	ASSERT_OK(kvd_seq_grow(s, FILL_TOKENS));
	fill_seq(s, tag);
	return s;
}

/* Alice releases (libkvd unmaps and acknowledges) but keeps her own fd and mapping. */
TEST(kept_after_release_reaches_nothing_of_another_tenant) {
	struct fixture f;
	struct hostile_hold k;
	kvd_client *a, *b;
	kvd_seq *sa, *sb;
	uint64_t inos[2];
	int ma, mb;

	fixture_start(&f, one_chunk);
	a = connect_with_model(&f, "alice", &ma);
	b = connect_with_model(&f, "bob", &mb);
	sa = fill_chunk(a, ma, 1);
	hostile_keep(&k, kvd_client_chunk_bytes(a));

	ASSERT_OK(kvd_seq_release(sa));
	/* Acknowledged: no longer charged, though this process lives on. */
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "used_bytes", 0));

	/* bob gets the pool's one chunk and writes into all of it. */
	sb = fill_chunk(b, mb, 2);
	ASSERT_EQ(check_seq(sb, 2), 0u);
	assert_digests_agree(sb);
	if (!fixture_backend_cuda()) {
		/* Another memfd than alice's (which this process still maps: the kept mapping). */
		ASSERT_EQ(mapped_chunk_inodes(getpid(), inos, 2), 2u);
		ASSERT_TRUE(inos[0] == k.ino || inos[1] == k.ino);
	}

	/* Alice sees none of it: her memory was scrubbed when bob's grant took the chunk
	 * from her, and stays hers. */
	hostile_assert_reads(&k, 0);
	/* Nothing she writes reaches bob. */
	hostile_write(&k);
	ASSERT_EQ(check_seq(sb, 2), 0u);
	assert_digests_agree(sb);
	hostile_assert_reads(&k, k.fd >= 0 ? 0xee : 0xcd);

	hostile_done(&k);
	ASSERT_OK(kvd_seq_release(sb));
	kvd_client_unref(a);
	kvd_client_unref(b);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* A tenant's own freed chunk comes back to it as the same memory object: no new memfd per
 * grant for a tenant that grows and shrinks by itself. */
TEST(own_chunk_comes_back_as_it_is) {
	struct hostile_hold k;
	struct fixture f;
	kvd_client *a;
	kvd_seq *s;
	size_t nonzero = 0;
	int m;

	fixture_start(&f, one_chunk);
	a = connect_with_model(&f, "alice", &m);
	s = fill_chunk(a, m, 1);
	hostile_keep(&k, kvd_client_chunk_bytes(a));
	ASSERT_OK(kvd_seq_release(s));
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "used_bytes", 0));
	/* Her own bytes until she takes it again (it is scrubbed then), and nobody else's. */
	for (size_t i = 0; i < k.bytes; i++)
		nonzero += k.map[i] != 0;
	ASSERT_GT(nonzero, k.bytes / 2);

	s = fill_chunk(a, m, 3);
	nonzero = 0;
	ASSERT_EQ(check_seq(s, 3), 0u);
	/* The same memory: what the sequence holds shows through the kept mapping. */
	for (size_t i = 0; i < k.bytes; i++)
		nonzero += k.map[i] != 0;
	ASSERT_GT(nonzero, k.bytes / 2);
	hostile_done(&k);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(a);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * Alice's process closes its connection without acknowledging anything (a hostile or
 * broken client: the socket shut down under libkvd) and lives on, keeping its fd and
 * mapping: her chunk stays hers and charged to her, draining, and bob gets nothing, until
 * her process exits (departed.h); then bob gets the chunk, as a new memory object.
 */
static void unacknowledged(bool pidfd_open, bool operator_ends) {
	struct fixture f;
	kvd_client *b;
	kvd_seq *sb;
	int go[2], ready[2], mb;
	pid_t alice;
	char byte;

	fixture_setup(&f, NULL, true);
	if (pidfd_open)
		ASSERT_OK(setenv("KVD_TEST_PIDFD_OPEN", "1", 1));
	fixture_launch(&f, one_chunk);
	ASSERT_OK(unsetenv("KVD_TEST_PIDFD_OPEN"));
	ASSERT_OK(pipe(go));
	ASSERT_OK(pipe(ready));
	alice = fixture_fork();
	if (alice == 0) {
		int m;
		kvd_client *a = connect_with_model(&f, "alice", &m);
		int sock = newest_socket_fd();
		struct hostile_hold k;

		close(go[1]);
		fill_chunk(a, m, 1);
		hostile_keep(&k, kvd_client_chunk_bytes(a));
		ASSERT_OK(shutdown(sock, SHUT_RDWR));
		ASSERT_EQ(write(ready[1], "r", 1), 1);
		/* Until the parent closes go. */
		(void)read(go[0], &byte, 1);
		_exit(0);
	}
	close(go[0]);
	close(ready[1]);
	ASSERT_EQ(read(ready[0], &byte, 1), 1);
	ASSERT_TRUE(fixture_wait_status(&f, "alice", "connections", 0));
	ASSERT_TRUE(fixture_wait_log(&f, "closed without unmapping 1 chunks", 1));
	ASSERT_EQ(fixture_status(&f, "alice", "used_bytes"), 1u << 20);
	ASSERT_EQ(fixture_status(&f, NULL, "chunks_draining"), 1u);

	b = connect_with_model(&f, "bob", &mb);
	ASSERT_OK(kvd_seq_open(b, mb, 4096, &sb));
	ASSERT_ERRNO(kvd_seq_grow(sb, 16), -ENOSPC);

	if (operator_ends) {
		/* The operator sees the departed holder, and ends its charge while it lives:
		 * bob gets the chunk as a new memory object, which alice's kept fd and mapping
		 * never reach. */
		kvd_client *admin = fixture_connect(&f, NULL);
		uint64_t conn = 0, v;
		kvd_table *t = NULL;
		const char *tenant;

		ASSERT_OK(kvd_connections_get(admin, &t));
		for (uint32_t i = 0; i < kvd_table_rows(t); i++)
			if (kvd_table_u64(t, i, "departed", &v) == 0 && v == 1) {
				ASSERT_OK(kvd_table_u64(t, i, "pid", &v));
				ASSERT_EQ(v, (uint64_t)alice);
				ASSERT_OK(kvd_table_u64(t, i, "chunks", &v));
				ASSERT_EQ(v, 1u);
				ASSERT_OK(kvd_table_str(t, i, "tenant", &tenant));
				ASSERT_STREQ(tenant, "alice");
				ASSERT_OK(kvd_table_u64(t, i, "id", &conn));
			}
		kvd_table_free(t);
		ASSERT_TRUE(conn != 0);
		ASSERT_OK(kvd_disconnect(admin, conn));
		ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 0u);
		ASSERT_OK(kvd_connections_get(admin, &t));
		for (uint32_t i = 0; i < kvd_table_rows(t); i++)
			ASSERT_TRUE(kvd_table_u64(t, i, "departed", &v) == 0 && v == 0);
		kvd_table_free(t);
		ASSERT_TRUE(fixture_wait_log(&f, "charge of its 1 chunks ended by", 1));
		ASSERT_ERRNO(kvd_disconnect(admin, conn), -ENOENT);
		kvd_client_unref(admin);
		ASSERT_OK(kvd_seq_grow(sb, FILL_TOKENS));
		ASSERT_EQ(assert_digests_agree(sb), zero_digest(sb));
		fill_seq(sb, 2);
		/* What alice's process still reaches is her old memory, not bob's. */
		close(go[1]);
		ASSERT_EQ(waitpid(alice, NULL, 0), alice);
		ASSERT_EQ(check_seq(sb, 2), 0u);
		ASSERT_OK(kvd_seq_release(sb));
		kvd_client_unref(b);
		close(ready[0]);
		ASSERT_EQ(fixture_log_count(&f, "exited: the"), 0u);
		ASSERT_EQ(fixture_stop(&f), 0);
		return;
	}

	/* Alice's process exits: her charge ends, and bob gets the chunk, reading zeros. */
	close(go[1]);
	ASSERT_EQ(waitpid(alice, NULL, 0), alice);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "used_bytes", 0));
	ASSERT_TRUE(fixture_wait_log(&f, "exited: the 1 chunks it still mapped", 1));
	ASSERT_OK(kvd_seq_grow(sb, FILL_TOKENS));
	ASSERT_EQ(assert_digests_agree(sb), zero_digest(sb));
	fill_seq(sb, 2);
	ASSERT_EQ(check_seq(sb, 2), 0u);
	ASSERT_OK(kvd_seq_release(sb));
	kvd_client_unref(b);
	close(ready[0]);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(unacknowledged_chunk_charged_until_the_process_exits) {
	unacknowledged(false, false);
}

/* A departed holder is listed (kvdctl connections), and an operator ends its charge while
 * its process lives (kvdctl disconnect): the budget comes back, as new memory. */
TEST(unacknowledged_chunk_charge_ended_by_an_operator) {
	unacknowledged(false, true);
}

/* The same with the peer's pidfd from pidfd_open(), the path of kernels before 6.5, which
 * newer ones take only when forced. */
TEST(unacknowledged_chunk_charged_until_the_process_exits_pidfd_open) {
	TEST_NEEDS_HOOKS();
	unacknowledged(true, false);
}

/*
 * A well-behaved engine that leaves is charged nothing after, however long its process
 * lives: libkvd acknowledges the unmap of every chunk it still maps on its way out. Here
 * two connections of alice share the one chunk; the first leaves while the second's
 * blocks keep the chunk owned, and once the second releases, the chunk is free at once,
 * not held for the first connection's process.
 */
TEST(client_that_leaves_is_not_charged_after) {
	struct fixture f;
	kvd_client *a1, *a2;
	kvd_seq *s1, *s2;
	int m1, m2;

	fixture_start(&f, one_chunk);
	a1 = connect_with_model(&f, "alice", &m1);
	a2 = connect_with_model(&f, "alice", &m2);
	ASSERT_OK(kvd_seq_open(a1, m1, 4096, &s1));
	ASSERT_OK(kvd_seq_grow(s1, 16));
	ASSERT_OK(kvd_seq_open(a2, m2, 4096, &s2));
	ASSERT_OK(kvd_seq_grow(s2, 16));
	ASSERT_OK(kvd_seq_release(s1));
	kvd_client_unref(a1);
	ASSERT_TRUE(fixture_wait_status(&f, "alice", "connections", 1));
	ASSERT_EQ(fixture_status(&f, "alice", "used_bytes"), 1u << 20);
	ASSERT_OK(kvd_seq_release(s2));
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "used_bytes", 0));
	ASSERT_EQ(fixture_status(&f, NULL, "chunks_draining"), 0u);
	kvd_client_unref(a2);
	ASSERT_EQ(fixture_stop(&f), 0);
}

#ifdef KVD_HAVE_CUDA
/*
 * GPU memory an old holder pins (cuda pools under the fake driver, whose ledger counts an
 * allocation while any process imports it: KVD_FAKE_CUDA_LEDGER). Alice's process imports
 * her chunk's fd again and keeps it after acknowledging the unmap; on a device with room for
 * one chunk, bob's grant then finds no memory for the chunk's new allocation and is refused
 * with an error that names alice, and the chunk is charged to alice; once her import goes,
 * the daemon makes the memory again, her charge ends, and bob gets it, zeroed.
 */
TEST(renewal_refused_while_an_old_holder_pins_gpu_memory) {
	const struct cuda_dl *cu;
	struct hostile_hold k;
	CUmemGenericAllocationHandle h;
	const char *why = NULL;
	char ledger[192];
	struct fixture f;
	kvd_client *a, *b;
	kvd_seq *sa, *sb;
	int ma, mb;

	if (!fixture_backend_cuda())
		TEST_SKIP("GPU memory only: on host the old memfd holds no pool memory");
	ASSERT_OK(cuda_dl_load(&cu, &why));
	fixture_setup(&f, NULL, true);
	snprintf(ledger, sizeof(ledger), "%s/ledger", f.dir);
	ASSERT_OK(mkdir(ledger, 0700));
	ASSERT_OK(setenv("KVD_FAKE_CUDA_LEDGER", ledger, 1));
	ASSERT_OK(setenv("KVD_FAKE_CUDA_MEMORY_MIB", "1", 1));
	fixture_launch(&f, one_chunk);
	ASSERT_OK(unsetenv("KVD_FAKE_CUDA_MEMORY_MIB"));

	a = connect_with_model(&f, "alice", &ma);
	b = connect_with_model(&f, "bob", &mb);
	sa = fill_chunk(a, ma, 1);
	hostile_keep(&k, kvd_client_chunk_bytes(a));
	if (k.fd < 0) {
		hostile_done(&k);
		ASSERT_OK(unsetenv("KVD_FAKE_CUDA_LEDGER"));
		ASSERT_EQ(fixture_stop(&f), 0);
		TEST_SKIP("needs the chunk's fd: /proc/self/map_files takes CAP_SYS_ADMIN");
	}
	ASSERT_EQ(cu->cuMemImportFromShareableHandle(&h, (void *)(intptr_t)k.fd,
						      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
		  CUDA_SUCCESS);
	ASSERT_OK(kvd_seq_release(sa));
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "used_bytes", 0));

	ASSERT_OK(kvd_seq_open(b, mb, 4096, &sb));
	ASSERT_ERRNO(kvd_seq_grow(sb, 16), -ENOMEM);
	ASSERT_TRUE(strstr(kvd_client_last_error(b), "tenant alice's"));
	ASSERT_TRUE(fixture_wait_log(&f, "which was tenant alice's", 1));
	/* Alice pays: the chunk is charged to her while its memory cannot be made. */
	ASSERT_EQ(fixture_status(&f, "alice", "used_bytes"), 1u << 20);
	ASSERT_ERRNO(kvd_seq_grow(sb, 16), -ENOSPC);

	/* Her import goes: the daemon makes the memory on its tick, and her charge ends. */
	ASSERT_EQ(cu->cuMemRelease(h), CUDA_SUCCESS);
	ASSERT_TRUE(fixture_wait_status(&f, "alice", "used_bytes", 0));
	ASSERT_OK(kvd_seq_grow(sb, FILL_TOKENS));
	ASSERT_EQ(assert_digests_agree(sb), zero_digest(sb));
	hostile_done(&k);
	ASSERT_OK(kvd_seq_release(sb));
	kvd_client_unref(a);
	kvd_client_unref(b);
	ASSERT_OK(unsetenv("KVD_FAKE_CUDA_LEDGER"));
	ASSERT_EQ(fixture_stop(&f), 0);
}
#endif
