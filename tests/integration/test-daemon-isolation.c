/* SPDX-License-Identifier: MIT */
/*
 * Isolation against a hostile tenant (README, "Security model"). memfds and cuMem fds
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
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fixture.h"
#include "test.h"

static const kvd_model_spec spec = { "z", 2, 2, 2, 64, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER };

/* One chunk in the whole pool: whoever gets memory gets that chunk. 1024 tokens of spec
 * fill it (2 layers of 8 KiB blocks of 16 tokens). */
static const char *const one_chunk[] = { "--pool-size", "1MiB", "--chunk-size", "1MiB", NULL };
#define FILL_TOKENS 1024u

/* The name of a chunk's memory in /proc: the host backend's memfds, or the fake driver's. */
static const char *chunk_memfd_name(void) {
	return fixture_backend_cuda() ? "/memfd:kvd-fake-cuda-dev" : "/memfd:kvd-chunk-";
}

/*
 * What a hostile holder keeps of the one chunk its process maps, unknown to libkvd (which
 * closes the chunk's fd once mapped, and unmaps when told to): a mapping of its own (the
 * same pages mapped again with mremap) and an fd of its own (opened through
 * /proc/self/map_files, which takes CAP_SYS_ADMIN: without it, fd is -1 and only the
 * mapping is checked).
 */
struct kept {
	int fd;
	uint8_t *map;
	size_t bytes;
	uint64_t ino;
};

static void keep_chunk(struct kept *k, size_t bytes) {
	char line[512], path[96];
	unsigned long start = 0, end = 0;
	unsigned long long ino = 0;
	FILE *maps = fopen("/proc/self/maps", "re");
	void *p;

	ASSERT_NOT_NULL(maps);
	while (fgets(line, sizeof(line), maps))
		if (strstr(line, chunk_memfd_name()) &&
		    sscanf(line, "%lx-%lx %*s %*s %*s %llu", &start, &end, &ino) == 3)
			break;
	fclose(maps);
	ASSERT_GT(end, start);
	ASSERT_GE(end - start, bytes);
	k->bytes = bytes;
	k->ino = ino;
	/* old_size 0: a second mapping of the same shared pages. */
	p = mremap((void *)start, 0, bytes, MREMAP_MAYMOVE);
	ASSERT_TRUE(p != MAP_FAILED);
	/* Device memory under the strict fake is PROT_NONE to the CPU in libkvd's mapping. */
	ASSERT_OK(mprotect(p, bytes, PROT_READ | PROT_WRITE));
	k->map = p;
	snprintf(path, sizeof(path), "/proc/self/map_files/%lx-%lx", start, end);
	k->fd = open(path, O_RDWR | O_CLOEXEC);
	if (k->fd < 0)
		printf("cannot open %s (%m): the fd path is not checked\n", path);
}

static void kept_done(struct kept *k) {
	ASSERT_OK(munmap(k->map, k->bytes));
	if (k->fd >= 0)
		close(k->fd);
}

/* Every byte alice can read through her mapping and her fd is v. */
static void assert_kept_reads(const struct kept *k, uint8_t v) {
	uint8_t *buf = malloc(k->bytes);

	ASSERT_NOT_NULL(buf);
	for (size_t i = 0; i < k->bytes; i++)
		if (k->map[i] != v)
			test_fail(__FILE__, __LINE__, "byte %zu of the kept mapping is 0x%02x, not 0x%02x",
				  i, k->map[i], v);
	if (k->fd < 0) {
		free(buf);
		return;
	}
	ASSERT_EQ(pread(k->fd, buf, k->bytes, 0), (ssize_t)k->bytes);
	for (size_t i = 0; i < k->bytes; i++)
		if (buf[i] != v)
			test_fail(__FILE__, __LINE__, "byte %zu read from the kept fd is 0x%02x, not 0x%02x",
				  i, buf[i], v);
	free(buf);
}

/* Alice writes everything she can reach: through her mapping and with pwrite on her fd. */
static void kept_write(const struct kept *k) {
	uint8_t *buf = malloc(k->bytes);

	ASSERT_NOT_NULL(buf);
	memset(k->map, 0xcd, k->bytes);
	memset(buf, 0xee, k->bytes);
	if (k->fd >= 0)
		ASSERT_EQ(pwrite(k->fd, buf, k->bytes, 0), (ssize_t)k->bytes);
	free(buf);
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

enum give_back {
	RELEASE,    /* releases the sequence: libkvd unmaps and acknowledges */
	DISCONNECT, /* closes the connection */
};

static void hostile_holder(enum give_back how) {
	struct fixture f;
	struct kept k;
	kvd_client *a, *b;
	kvd_seq *sa, *sb;
	uint64_t inos[2];
	int ma, mb, a_socket;

	fixture_start(&f, one_chunk);
	a = fixture_connect(&f, "alice");
	a_socket = newest_socket_fd();
	ASSERT_GE(a_socket, 0);
	b = fixture_connect(&f, "bob");
	ma = kvd_model_register(a, &spec);
	mb = kvd_model_register(b, &spec);
	ASSERT_OK(ma);
	ASSERT_OK(mb);

	ASSERT_OK(kvd_seq_open(a, ma, 4096, &sa));
	ASSERT_OK(kvd_seq_grow(sa, FILL_TOKENS));
	fill_seq(sa, 1);
	keep_chunk(&k, kvd_client_chunk_bytes(a));

	if (how == RELEASE)
		ASSERT_OK(kvd_seq_release(sa));
	else
		/* The connection ends; libkvd's mapping stays, as the kept one does. */
		ASSERT_OK(shutdown(a_socket, SHUT_RDWR));
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "used_bytes", 0));

	/* bob gets the pool's one chunk and writes into all of it. */
	ASSERT_OK(kvd_seq_open(b, mb, 4096, &sb));
	ASSERT_OK(kvd_seq_grow(sb, FILL_TOKENS));
	fill_seq(sb, 2);
	ASSERT_EQ(check_seq(sb, 2), 0u);
	assert_digests_agree(sb);
	if (!fixture_backend_cuda()) {
		/* Another memfd than alice's (which this process still maps: the kept mapping). */
		ASSERT_EQ(mapped_chunk_inodes(getpid(), inos, 2), 2u);
		ASSERT_TRUE(inos[0] == k.ino || inos[1] == k.ino);
	}

	/* Alice sees none of it: her memory was scrubbed when she gave it back, and stays
	 * hers. */
	assert_kept_reads(&k, 0);
	/* Nothing she writes reaches bob. */
	kept_write(&k);
	ASSERT_EQ(check_seq(sb, 2), 0u);
	assert_digests_agree(sb);
	assert_kept_reads(&k, k.fd >= 0 ? 0xee : 0xcd);

	kept_done(&k);
	ASSERT_OK(kvd_seq_release(sb));
	if (how == DISCONNECT)
		ASSERT_EQ(kvd_seq_release(sa), -ECONNRESET);
	kvd_client_unref(a);
	kvd_client_unref(b);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(kept_after_release_reaches_nothing_of_another_tenant) {
	hostile_holder(RELEASE);
}

TEST(kept_after_disconnect_reaches_nothing_of_another_tenant) {
	hostile_holder(DISCONNECT);
}

/* A tenant's own freed chunk comes back to it as the same memory object: no new memfd per
 * grant for a tenant that grows and shrinks by itself. */
TEST(own_chunk_comes_back_as_it_is) {
	struct fixture f;
	struct kept k;
	kvd_client *a;
	kvd_seq *s;
	int m;

	fixture_start(&f, one_chunk);
	a = fixture_connect(&f, "alice");
	m = kvd_model_register(a, &spec);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(a, m, 4096, &s));
	ASSERT_OK(kvd_seq_grow(s, FILL_TOKENS));
	fill_seq(s, 1);
	keep_chunk(&k, kvd_client_chunk_bytes(a));
	ASSERT_OK(kvd_seq_release(s));
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "used_bytes", 0));
	/* Scrubbed on its way back. */
	assert_kept_reads(&k, 0);

	ASSERT_OK(kvd_seq_open(a, m, 4096, &s));
	ASSERT_OK(kvd_seq_grow(s, FILL_TOKENS));
	fill_seq(s, 3);
	ASSERT_EQ(check_seq(s, 3), 0u);
	/* The same memory: what the sequence holds shows through the kept mapping. */
	{
		size_t nonzero = 0;

		for (size_t i = 0; i < k.bytes; i++)
			nonzero += k.map[i] != 0;
		ASSERT_GT(nonzero, k.bytes / 2);
	}
	kept_done(&k);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(a);
	ASSERT_EQ(fixture_stop(&f), 0);
}
