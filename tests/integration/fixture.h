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
	char config[128];             /* --config: dir/kvd.conf, or /dev/null when none given */
	char state_dir[128];          /* --state-dir: dir/state (made by the daemon when needed) */
	char log[128];                /* the daemon's stderr (dir/kvd.log), or "" for the test's */
	unsigned fd_limit;            /* when not 0, the daemon's RLIMIT_NOFILE (set before
	                               * fixture_launch) */
	bool deny_io_uring;           /* the daemon runs under a seccomp filter that refuses
	                               * io_uring_setup with EPERM, as container runtimes' default
	                               * profiles do (set before fixture_launch) */
};

/* Whether the daemon runs --backend cuda (KVD_TEST_BACKEND=cuda: tests/gpu/meson.build runs
 * integration tests so under the fake CUDA driver, whose device memory the CPU can read). */
bool fixture_backend_cuda(void);

/* fork() whose child dies with the test process. */
pid_t fixture_fork(void);

/* Runs $KVD_DAEMON with args (a shell word list) to completion; returns its exit status,
 * with its stdout and stderr in out (n bytes at most, NUL-terminated). */
int fixture_run_daemon(const char *args, char *out, size_t n);

/*
 * Starts the daemon with --socket in a fresh directory plus the NULL-terminated extra
 * arguments, and returns once the socket accepts connections. Fails the test otherwise.
 * The daemon reads no config file (--config /dev/null) and keeps its live state in the
 * directory (--state-dir), so that nothing of the machine's leaks in or out, and sleeps as
 * soon as it is idle (--poll-us=0) unless args say otherwise.
 */
void fixture_start(struct fixture *f, const char *const *args);

/*
 * fixture_start() in two steps, for tests of the config file and of restarts: setup makes
 * the directory, writes config (when not NULL) to dir/kvd.conf and, with log, sends the
 * daemon's stderr to dir/kvd.log; launch starts the daemon with --socket, --config and
 * --state-dir, then args (which may override them), and can run again after fixture_halt().
 */
void fixture_setup(struct fixture *f, const char *config, bool log);
void fixture_launch(struct fixture *f, const char *const *args);
/* Replaces the config file (fixture_setup with a config). */
void fixture_write_config(struct fixture *f, const char *text);

/* Sends SIGTERM and waits; returns the daemon's exit status (or 128+signal), and removes
 * the directory. */
int fixture_stop(struct fixture *f);
/* The same, but the directory stays, for a fixture_launch() on the same state. */
int fixture_halt(struct fixture *f);
/* Removes the directory and what the fixture and the daemon put there. */
void fixture_cleanup(struct fixture *f);

/* Waits, up to a few seconds, until the daemon's log (fixture_setup with log) holds needle
 * at least count times; returns whether it did. */
bool fixture_wait_log(struct fixture *f, const char *needle, unsigned count);
/* How many times the daemon's log holds needle. */
unsigned fixture_log_count(struct fixture *f, const char *needle);

/*
 * A test hook's gate (KVD_TEST_ROUND_GATE, KVD_TEST_MOVE_GATE): a FIFO at path (made here,
 * under /tmp, named by this process) that a daemon worker opens and reads one byte from
 * at a point of its work. fixture_gate_wait returns, with the FIFO's write end, once a
 * worker waits there; fixture_gate_release lets it go on.
 */
void fixture_gate_make(char *path, size_t n);
int fixture_gate_wait(const char *path);
void fixture_gate_release(int fd);

/* Connects as a tenant (NULL: administrative), failing the test on error. */
kvd_client *fixture_connect(struct fixture *f, const char *tenant);

/* A node value from kvd_status ("used_bytes", ...), or a tenant's value when tenant is
 * not NULL (UINT64_MAX when the tenant is unknown). Fails the test on error. */
uint64_t fixture_status(struct fixture *f, const char *tenant, const char *key);

/* A node string ("budget_source"), or a tenant's ("max_source") when tenant is not NULL,
 * copied into buf; NULL when the daemon did not send it. Fails the test on other errors. */
const char *fixture_status_str(struct fixture *f, const char *tenant, const char *key, char *buf,
                               size_t n);

/* Waits, up to a few seconds, until fixture_status(f, tenant, key) == want; returns
 * whether it got there. For state the daemon reaches asynchronously (a peer's hang-up). */
bool fixture_wait_status(struct fixture *f, const char *tenant, const char *key, uint64_t want);

/* Clock ticks of CPU (user and system, all threads) process pid has used. */
unsigned long long fixture_cpu_ticks(pid_t pid);

/* A raw connection for sending what libkvd never sends. */
int raw_connect(struct fixture *f);
/* Sends an envelope (with nfds fds attached, as the frame announces), or raw bytes. Return 0
 * or -errno. */
int raw_send(int fd, const Envelope *env);
int raw_send_fds(int fd, const Envelope *env, const int *fds, uint32_t nfds);
int raw_send_bytes(int fd, const void *p, size_t n);
/*
 * Receives the next frame within timeout_ms into *rx (heap: it is large). Returns 1 with
 * the envelope, 0 on EOF (the daemon closed the connection), -ETIMEDOUT, or another error.
 */
int raw_recv(int fd, struct wire_rx *rx, int timeout_ms, Envelope **ret);
/* raw_recv() that hands the frame's fds to the caller (ret_nfds of them) instead of closing
 * them. */
int raw_recv_fds(int fd, struct wire_rx *rx, int timeout_ms, Envelope **ret,
                 int fds[static WIRE_FDS_MAX], uint32_t *ret_nfds);
/* Sends hello as tenant (NULL: admin) with the given versions; returns the reply code. */
int raw_hello(int fd, struct wire_rx *rx, const char *tenant, uint32_t min, uint32_t max);
/* Sends env as request id (set here) and returns its reply's code; fails the test unless
 * the reply, with a status, comes within 5 s. */
int raw_call(int fd, struct wire_rx *rx, Envelope *env, uint64_t id);
/* RegisterModel of spec as request id; returns the reply's code (a connection's first model
 * is model 1). */
int raw_register_model(int fd, struct wire_rx *rx, const kvd_model_spec *spec, uint64_t id);

/* inode numbers of the kvd chunk memfds process pid has mapped, sorted; returns count. */
size_t mapped_chunk_inodes(pid_t pid, uint64_t *inodes, size_t max);

/*
 * A hostile holder (test-daemon-isolation, test-daemon-keep): what it keeps of the (first)
 * chunk its process maps, unknown to libkvd (which
 * closes the chunk's fd once mapped, and unmaps when told to): a mapping of its own (the
 * same pages mapped again with mremap) and an fd of its own (opened through
 * /proc/self/map_files, which takes CAP_SYS_ADMIN: without it, fd is -1 and only the
 * mapping is checked).
 */
struct hostile_hold {
	int fd;
	uint8_t *map;
	size_t bytes;
	uint64_t ino;
};


/* Takes the hold, of bytes of the chunk. */
void hostile_keep(struct hostile_hold *k, size_t bytes);
/* Every byte the holder can read, through its mapping and its fd, is v. */
void hostile_assert_reads(const struct hostile_hold *k, uint8_t v);
/* Writes everything it can reach: 0xcd through the mapping, then 0xee with pwrite. */
void hostile_write(const struct hostile_hold *k);
void hostile_done(struct hostile_hold *k);

/* Copies n bytes from K/V memory (kvd_seq_kv's addresses: device memory on a GPU pool) to
 * dst, and to it from src. */
void kv_read(const void *src, void *dst, size_t n);
void kv_write(void *dst, const void *src, size_t n);

/* Writes into every resident K/V byte of s a value derived from (tag, layer, kv head,
 * original position, byte, K or V). */
void fill_seq(kvd_seq *s, uint32_t tag);
/* fill_seq() for the slots whose original position is at least from (what a grow added). */
void fill_seq_from(kvd_seq *s, uint32_t tag, uint64_t from);
/* Counts the resident bytes of s that differ from fill_seq(s, tag). */
uint64_t check_seq(kvd_seq *s, uint32_t tag);
/* Asserts that every table of s holds the positions 0 .. tokens - 1, one a slot, and that
 * tokens is its next position: a sequence nothing was evicted from. */
void assert_positions_upto(kvd_seq *s, uint32_t tokens);
/* Asserts that the daemon's and this process's digests of s agree; returns the digest. */
uint64_t assert_digests_agree(kvd_seq *s);
