/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * What integration tests share: a real kvd daemon started on a socket in a temporary
 * directory (the binary comes from $KVD_DAEMON, set by meson), raw protocol access for
 * tests that must send what libkvd never would, and status queries through libkvd.
 */

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "kvd/kvd.h"
#include "wire.h"

struct fixture {
	pid_t pid;
	char dir[64];
	char socket[128];
};

/* fork() whose child dies with the test process. */
pid_t fixture_fork(void);

/*
 * Starts the daemon with --socket in a fresh directory plus the NULL-terminated extra
 * arguments, and returns once the socket accepts connections. Fails the test otherwise.
 */
void fixture_start(struct fixture *f, const char *const *args);

/* Sends SIGTERM and waits; returns the daemon's exit status (or 128+signal). */
int fixture_stop(struct fixture *f);

/* Connects as a tenant (NULL: administrative), failing the test on error. */
kvd_client *fixture_connect(struct fixture *f, const char *tenant);

/* A node value from kvd_status ("used_bytes", ...), or a tenant's value when tenant is
 * not NULL (UINT64_MAX when the tenant is unknown). Fails the test on error. */
uint64_t fixture_status(struct fixture *f, const char *tenant, const char *key);

/* Waits, up to a few seconds, until fixture_status(f, tenant, key) == want; returns
 * whether it got there. For state the daemon reaches asynchronously (a peer's hang-up). */
bool fixture_wait_status(struct fixture *f, const char *tenant, const char *key, uint64_t want);

/* A raw connection for sending what libkvd never sends. */
int raw_connect(struct fixture *f);
/* Sends an envelope, or raw bytes. Return 0 or -errno. */
int raw_send(int fd, const Envelope *env);
int raw_send_bytes(int fd, const void *p, size_t n);
/*
 * Receives the next frame within timeout_ms into *rx (heap: it is large). Returns 1 with
 * the envelope, 0 on EOF (the daemon closed the connection), -ETIMEDOUT, or another error.
 */
int raw_recv(int fd, struct wire_rx *rx, int timeout_ms, Envelope **ret);
/* Sends hello as tenant (NULL: admin) with the given versions; returns the reply code. */
int raw_hello(int fd, struct wire_rx *rx, const char *tenant, uint32_t min, uint32_t max);

/* inode numbers of the kvd chunk memfds process pid has mapped, sorted; returns count. */
size_t mapped_chunk_inodes(pid_t pid, uint64_t *inodes, size_t max);

/* Writes into every resident K/V byte of s a value derived from (tag, layer, kv head,
 * original position, byte, K or V). */
void fill_seq(kvd_seq *s, uint32_t tag);
/* Counts the resident bytes of s that differ from fill_seq(s, tag). */
uint64_t check_seq(kvd_seq *s, uint32_t tag);
/* Asserts that the daemon's and this process's digests of s agree. */
void assert_digests_agree(kvd_seq *s);
