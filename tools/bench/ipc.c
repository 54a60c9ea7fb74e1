/* SPDX-License-Identifier: MIT */
/*
 * kvd-bench ipc: what one per-step request costs over the socket and through the rings,
 * next to the floors under each, in one run (docs/architecture.md §4; figures in docs/benchmarks.md).
 *
 * Floors, between two processes and without kvd: a raw Unix-socket round trip of MSG_BYTES
 * each way with plain recv() and send() (the "socket" floor); the same round trip the way
 * kvd's socket path makes it (the "fd-room" floor): both sides send with sendmsg() and
 * receive with recvmsg() offering a control buffer of WIRE_CMSG_SPACE, room for
 * WIRE_FDS_MAX SCM_RIGHTS fds, with MSG_CMSG_CLOEXEC, as the daemon (daemon/net/conn.c) and
 * libkvd (client/client.c) must on a socket that carries fds, and with their flags; and a
 * raw round trip on a pair of shared-memory rings with kvd's own layout and
 * doorbell protocol (proto/common/ring.h) but no libkvd and no daemon. Then one kvd
 * operation through libkvd, against a kvd this program starts: kvd_seq_pin and
 * kvd_seq_unpin, alternately, each timed on its own, over the socket
 * (kvd_client_set_ring(c, 0)) and through the rings, with kvd's loop on io_uring and again
 * on epoll (--uring-setup=epoll, what kvd runs on where io_uring is not allowed). Floor and
 * kvd are measured under the same conditions:
 *   - waiting: "spin", both sides spin and never sleep (kvd --poll-us 1000000, a client spin
 *     of 1 s, and the floors alike); "spin-sleep", both spin for --poll-us (server) and
 *     --spin-us (client) and then sleep, kvd's defaults; "sleep", neither spins, so that
 *     every request pays the wake-ups (and also through the eventfd doorbell);
 *   - placement: the server (the daemon, or the floor's server process) on the first CPU
 *     this program may use, the client on the same one ("same-core") or on the second
 *     ("cross-core").
 * Every spin is ring.h's (pauses, and sched_yield() after RING_SPIN_PAUSE_NS, then at
 * doubling intervals), on every path alike, so that on one core the spinner lets its peer
 * run. The ratios kvd / floor, of medians and of p99s, are
 * printed against the targets: 2 for the rings, 1.5 for the socket (against both socket
 * floors; the target is the plain one's).
 *
 * Then throughput: 1, 4 and 16 client processes, each with its own connection, doing pin
 * and unpin back to back for --seconds, through the rings and over the socket, with the
 * daemon's polling at --poll-us and no process pinned to a CPU.
 *
 * This is a benchmark, not a test: nothing asserts on timings.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "latency.h"
#include "basic/macro.h"
#include "basic/number.h"
#include "common/ring.h"
#include "kvd/kvd.h"
#include "wire.h"
#include "basic/time-util.h"
#include "cli.h"

#define MSG_BYTES 32
#define ITERATIONS_MAX 10000000u
#define SECONDS_MAX 3600.0
/* "Never sleep": the longest spin both kvd and libkvd take. */
#define SPIN_FOREVER_US 1000000u
#define FLOOR_ENTRIES 64u
#define FLOOR_OP_STOP 0xff
#define RING_TARGET 2.0
#define SOCKET_TARGET 1.5
#define DAEMON_START_MS 5000

static const char *arg_kvd;
static const char *arg_backend = "host";
static uint32_t arg_iterations = 20000;
static double arg_seconds = 2.0;
static uint32_t arg_spin_us = 50;
static uint32_t arg_poll_us = 50;
static bool arg_json;

static const unsigned throughput_clients[] = { 1, 4, 16 };

/* A small model: pin and unpin do not depend on its size. */
static const kvd_model_spec shape = { "ipc", 1, 1, 1, 8, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER };

struct strategy {
	const char *name;
	uint32_t client_spin_us, server_spin_us;
};

struct stats {
	double median_us, p99_us;
};

/* One line of the latency table. */
struct row {
	const struct strategy *wait;
	const char *placement;
	struct stats socket_floor, socket_fdroom_floor, socket_kvd, ring_floor, ring_kvd;
	bool eventfd;                 /* the "sleep" rows also measure the eventfd doorbell */
	struct stats ring_eventfd_kvd;
	/* kvd on its epoll loop (--uring-setup=epoll, where io_uring is not allowed), whose
	 * rings have the eventfd doorbell. */
	struct stats socket_epoll_kvd, ring_epoll_kvd;
};

static cpu_set_t all_cpus;
static int cpus[2];
static int n_cpus;

static _printf_(1, 2) int fail(const char *fmt, ...) {
	va_list ap;

	fputs("kvd-bench ipc: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	return -EIO;
}

/* Runs the calling process on cpu, or on every CPU it may use when cpu < 0. */
static void pin_cpu(int cpu) {
	cpu_set_t set;

	if (cpu < 0)
		set = all_cpus;
	else {
		CPU_ZERO(&set);
		CPU_SET(cpu, &set);
	}
	(void)sched_setaffinity(0, sizeof(set), &set);
}

/* A child that dies with us. */
static pid_t fork_child(void) {
	pid_t parent = getpid(), pid = fork();

	if (pid == 0 && (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != parent))
		_exit(1);
	return pid;
}

static struct stats stats_of(uint64_t *ns, uint32_t n) {
	latency_sort(ns, n);
	return (struct stats){
		.median_us = latency_percentile_us(ns, n, 50),
		.p99_us = latency_percentile_us(ns, n, 99),
	};
}

static uint32_t warmup(void) {
	return MAX(arg_iterations / 10, 100u);
}

/* ---- the socket floors ---- */

/* One receive: recv(), or with fdroom the recvmsg() of kvd's socket path (libkvd's
 * client_recv(), the daemon's conn_poll()): a control buffer with room for WIRE_FDS_MAX
 * fds, MSG_CMSG_CLOEXEC, and the control data walked for SCM_RIGHTS as wire_rx_take_cmsg()
 * does (none come here; any that did would be closed). */
static ssize_t recv_some(int fd, void *buf, size_t n, int flags, bool fdroom) {
	union {
		struct cmsghdr align;
		uint8_t buf[WIRE_CMSG_SPACE];
	} control;
	struct iovec iov = { .iov_base = buf, .iov_len = n };
	struct msghdr msg = {
		.msg_iov = &iov,
		.msg_iovlen = 1,
		.msg_control = &control,
		.msg_controllen = sizeof(control),
	};
	ssize_t k;

	if (!fdroom)
		return recv(fd, buf, n, flags);
	k = recvmsg(fd, &msg, flags | MSG_CMSG_CLOEXEC);
	if (k < 0)
		return k;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
			size_t nfds = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);

			for (size_t i = 0; i < nfds; i++) {
				int f;

				memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
				close(f);
			}
		}
	if (msg.msg_flags & MSG_CTRUNC) {
		errno = EBADMSG;
		return -1;
	}
	return k;
}

/* Reads n bytes, spinning on non-blocking reads for spin_ns first, as libkvd waits for a
 * reply. Returns 1, 0 at end of file, or -errno. */
static int recv_wait(int fd, void *buf, size_t n, uint64_t spin_ns, bool fdroom) {
	struct ring_spin spin;
	size_t got = 0;

	ring_spin_start(&spin, now_ns());
	while (got < n) {
		uint64_t now = now_ns();
		ssize_t k = recv_some(fd, (char *)buf + got, n - got,
		                      now - spin.start < spin_ns ? MSG_DONTWAIT : 0, fdroom);

		if (k > 0)
			got += (size_t)k;
		else if (k == 0)
			return 0;
		else if (errno == EAGAIN || errno == EWOULDBLOCK)
			ring_spin_step(&spin, now);
		else if (errno != EINTR)
			return -errno;
	}
	return 1;
}

/* Sends n bytes with send(), or with fdroom with sendmsg() and no control data, as kvd
 * sends a frame without fds; flags as each side's: libkvd MSG_NOSIGNAL, the daemon
 * MSG_DONTWAIT | MSG_NOSIGNAL. */
static int send_all(int fd, const void *buf, size_t n, int flags, bool fdroom) {
	size_t done = 0;

	while (done < n) {
		struct iovec iov = { .iov_base = (char *)buf + done, .iov_len = n - done };
		struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };
		ssize_t k = fdroom ? sendmsg(fd, &msg, flags) : send(fd, iov.iov_base, iov.iov_len, flags);

		if (k < 0 && errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)
			return -errno;
		if (k > 0)
			done += (size_t)k;
	}
	return 0;
}

/* The raw socket round trip: plain recv()/send(), or (fdroom) kvd's recvmsg()/sendmsg(). */
static int floor_socket(const struct strategy *st, int client_cpu, bool fdroom,
                        struct stats *ret) {
	_cleanup_(freep) uint64_t *ns = calloc(arg_iterations, sizeof(uint64_t));
	uint32_t total = warmup() + arg_iterations;
	char msg[MSG_BYTES] = "kvd-bench ipc";
	int sv[2], r = 0;
	pid_t pid;

	if (!ns)
		return -ENOMEM;
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
		return -errno;
	pid = fork_child();
	if (pid < 0)
		return -errno;
	if (pid == 0) {
		close(sv[0]);
		pin_cpu(cpus[0]);
		while (recv_wait(sv[1], msg, sizeof(msg), (uint64_t)st->server_spin_us * 1000, fdroom) > 0)
			if (send_all(sv[1], msg, sizeof(msg),
			             fdroom ? MSG_DONTWAIT | MSG_NOSIGNAL : MSG_NOSIGNAL, fdroom) < 0)
				break;
		_exit(0);
	}
	close(sv[1]);
	pin_cpu(client_cpu);
	for (uint32_t i = 0; i < total && r >= 0; i++) {
		uint64_t t0 = now_ns();

		r = send_all(sv[0], msg, sizeof(msg), MSG_NOSIGNAL, fdroom);
		if (r >= 0)
			r = recv_wait(sv[0], msg, sizeof(msg), (uint64_t)st->client_spin_us * 1000,
			              fdroom) > 0 ? 0 : -EPIPE;
		if (i >= total - arg_iterations)
			ns[i - (total - arg_iterations)] = now_ns() - t0;
	}
	pin_cpu(-1);
	close(sv[0]);
	waitpid(pid, NULL, 0);
	if (r < 0)
		return fail("%s floor: %s", fdroom ? "fd-room socket" : "socket", strerror(-r));
	*ret = stats_of(ns, arg_iterations);
	return 0;
}

/* ---- the ring floor ---- */

/* Spins for spin_ns, then sleeps, until the word at *index differs from seen; the announce,
 * look again, sleep sequence of ring.h. */
static void floor_wait(struct ring_word *index, struct ring_word *wake, uint32_t seen,
                       uint64_t spin_ns) {
	struct ring_spin spin;

	ring_spin_start(&spin, now_ns());
	while (ring_load_acquire(index) == seen) {
		uint64_t now = now_ns();

		if (now - spin.start < spin_ns) {
			ring_spin_step(&spin, now);
			continue;
		}
		ring_sleep_announce(wake);
		if (ring_load_acquire(index) == seen)
			(void)ring_futex_wait(wake, 1, UINT64_C(1000000000));
		/* Like the daemon once awake: the producer need not ring any more. */
		if (__atomic_load_n(&wake->v, __ATOMIC_RELAXED) != 0)
			__atomic_store_n(&wake->v, 0, __ATOMIC_RELAXED);
	}
}

/* The floor's server: echoes every submission as a completion. */
static void floor_ring_server(struct ring_shared *sh, const struct kvd_ring_geometry *g,
                              uint64_t spin_ns) {
	uint32_t head = 0, tail = 0;

	for (;;) {
		uint32_t end;

		floor_wait(&sh->sq_tail, &sh->sq_wake, head, spin_ns);
		end = ring_load_acquire(&sh->sq_tail);
		for (; head != end; head++) {
			const struct kvd_ring_sqe *e = ring_sqe_at(sh, g, head);
			struct kvd_ring_cqe *c = ring_cqe_at(sh, g, tail++);

			if (e->op == FLOOR_OP_STOP)
				_exit(0);
			*c = (struct kvd_ring_cqe){ .user_data = e->user_data };
		}
		ring_store_release(&sh->sq_head, head);
		ring_store_release(&sh->cq_tail, tail);
		if (ring_wake_needed(&sh->cq_wake))
			(void)ring_futex_wake(&sh->cq_wake);
	}
}

static void floor_ring_submit(struct ring_shared *sh, const struct kvd_ring_geometry *g,
                              uint32_t *sq_tail, uint8_t op, uint64_t user_data) {
	*ring_sqe_at(sh, g, *sq_tail) = (struct kvd_ring_sqe){ .op = op, .user_data = user_data };
	ring_store_release(&sh->sq_tail, ++*sq_tail);
	if (ring_wake_needed(&sh->sq_wake))
		(void)ring_futex_wake(&sh->sq_wake);
}

static int floor_ring(const struct strategy *st, int client_cpu, struct stats *ret) {
	_cleanup_(freep) uint64_t *ns = calloc(arg_iterations, sizeof(uint64_t));
	uint32_t total = warmup() + arg_iterations, sq_tail = 0, cq_head = 0;
	struct ring_shared *sh;
	struct kvd_ring_geometry g;
	pid_t pid;

	if (!ns)
		return -ENOMEM;
	if (ring_layout(FLOOR_ENTRIES, KVD_RING_DOORBELL_FUTEX, &g) < 0)
		return -EINVAL;
	/* Anonymous shared memory is what a memfd mapping is to the futex: a shared page. */
	sh = mmap(NULL, g.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (sh == MAP_FAILED)
		return -errno;
	sh->geo = g;
	pid = fork_child();
	if (pid < 0) {
		munmap(sh, g.total_bytes);
		return -errno;
	}
	if (pid == 0) {
		pin_cpu(cpus[0]);
		floor_ring_server(sh, &g, (uint64_t)st->server_spin_us * 1000);
	}
	pin_cpu(client_cpu);
	for (uint32_t i = 0; i < total; i++) {
		uint64_t t0 = now_ns();

		floor_ring_submit(sh, &g, &sq_tail, 1, i);
		floor_wait(&sh->cq_tail, &sh->cq_wake, cq_head, (uint64_t)st->client_spin_us * 1000);
		ring_store_release(&sh->cq_head, ++cq_head);
		if (i >= total - arg_iterations)
			ns[i - (total - arg_iterations)] = now_ns() - t0;
	}
	pin_cpu(-1);
	floor_ring_submit(sh, &g, &sq_tail, FLOOR_OP_STOP, 0);
	waitpid(pid, NULL, 0);
	munmap(sh, g.total_bytes);
	*ret = stats_of(ns, arg_iterations);
	return 0;
}

/* ---- kvd ---- */

struct daemon {
	pid_t pid;
	char dir[64];
	char socket[128];
	char state[128];
};

static void daemon_stop(struct daemon *d) {
	char path[192];

	if (d->pid > 0) {
		kill(d->pid, SIGTERM);
		waitpid(d->pid, NULL, 0);
		d->pid = 0;
	}
	unlink(d->socket);
	snprintf(path, sizeof(path), "%s/state", d->state);
	unlink(path);
	rmdir(d->state);
	rmdir(d->dir);
}

/* Starts kvd on a socket of its own, its loop set up as loop says (--uring-setup), on cpu
 * (< 0: anywhere), and waits until it answers. */
static int daemon_start(struct daemon *d, uint32_t poll_us, const char *doorbell, const char *loop,
                        int cpu) {
	char poll[16];

	*d = (struct daemon){};
	snprintf(d->dir, sizeof(d->dir), "/tmp/kvd-bench-ipc-XXXXXX");
	if (!mkdtemp(d->dir))
		return fail("mkdtemp: %s", strerror(errno));
	snprintf(d->socket, sizeof(d->socket), "%s/kvd.sock", d->dir);
	snprintf(d->state, sizeof(d->state), "%s/state", d->dir);
	snprintf(poll, sizeof(poll), "%" PRIu32, poll_us);
	d->pid = fork_child();
	if (d->pid < 0)
		return fail("fork: %s", strerror(errno));
	if (d->pid == 0) {
		const char *argv[] = { arg_kvd, "--socket", d->socket, "--config", "/dev/null",
			               "--state-dir", d->state, "--backend", arg_backend, "--pool-size",
			               "64MiB", "--chunk-size", "1MiB", "--poll-us", poll,
			               "--ring-doorbell", doorbell, "--uring-setup", loop,
			               "--log-level", "warning", NULL };

		pin_cpu(cpu);
		if (strchr(arg_kvd, '/'))
			execv(arg_kvd, (char **)argv);
		else
			execvp(arg_kvd, (char **)argv);
		fprintf(stderr, "kvd-bench ipc: cannot run %s: %s\n", arg_kvd, strerror(errno));
		_exit(127);
	}
	for (unsigned ms = 0; ms < DAEMON_START_MS; ms += 10) {
		kvd_client *c;
		int status;

		if (kvd_client_connect(d->socket, NULL, &c) >= 0) {
			kvd_client_unref(c);
			return 0;
		}
		if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
			d->pid = 0;
			daemon_stop(d);
			return fail("%s exited with status %d (see --kvd)", arg_kvd,
			            WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
		}
		usleep(10000);
	}
	daemon_stop(d);
	return fail("%s did not answer on %s", arg_kvd, d->socket);
}

/* A client with one open sequence, on the rings or the socket, spinning spin_us. */
static int kvd_open(const char *socket, bool ring, uint32_t spin_us, kvd_client **ret_c,
                    kvd_seq **ret_s) {
	kvd_client *c;
	int m, r;

	r = kvd_client_connect(socket, "ipc", &c);
	if (r < 0)
		return fail("connect: %s", strerror(-r));
	r = kvd_client_set_ring(c, ring);
	if (r >= 0)
		r = kvd_client_set_spin(c, spin_us);
	if (r >= 0)
		r = m = kvd_model_register(c, &shape);
	if (r >= 0)
		r = kvd_seq_open(c, m, 16, ret_s);
	if (r < 0) {
		kvd_client_unref(c);
		return fail("setting up a %s client: %s", ring ? "ring" : "socket", strerror(-r));
	}
	*ret_c = c;
	return 0;
}

/* ---- chunk grants ---- */

/*
 * What a chunk costs a grow (pool.h, "Isolation"): the tenant's own freed chunk comes back
 * as the same memory object; another tenant's is replaced by a new one (the old memfd
 * unmapped and closed, a new one made, sized, sealed and mapped). Tenants a and b take
 * turns at the whole pool: each turn one sequence grows into every chunk in one request,
 * is timed, and is released. a after a is "own"; a after b and b after a are "renewed".
 * The daemon's pool of GRANT_CHUNKS chunks of 1 MiB (--backend: host by default).
 */
#define GRANT_CHUNKS 64u
#define GRANT_TURNS 21u
/* 4 KiB blocks (16 tokens x 64 dims x 2 bytes x K and V): 256 blocks a chunk. */
static const kvd_model_spec grant_shape = { "grant", 1, 1, 1, 64, KVD_DTYPE_F16, 16,
	                                    KVD_LAYOUT_PER_LAYER };

/* One turn of c: its sequence takes every chunk; the grow's time in ns. */
static int grant_turn(kvd_client *c, int model, uint64_t *ret_ns) {
	const uint32_t tokens = GRANT_CHUNKS * 256 * 16;
	kvd_seq *s;
	uint64_t t0;
	int r;

	r = kvd_seq_open(c, model, tokens, &s);
	if (r < 0)
		return fail("grant: open: %s", strerror(-r));
	t0 = now_ns();
	r = kvd_seq_grow(s, tokens);
	*ret_ns = now_ns() - t0;
	if (r < 0)
		fail("grant: grow of %u chunks: %s", GRANT_CHUNKS, strerror(-r));
	if (kvd_seq_release(s) < 0 && r >= 0)
		r = fail("grant: release failed");
	return r;
}

/* Median microseconds per chunk granted: ret[0] own, ret[1] renewed. */
static int grants(const char *socket, double *ret) {
	uint64_t own[GRANT_TURNS], renewed[GRANT_TURNS], warm;
	kvd_client *c[2] = {};
	int m[2], r = 0;

	for (int i = 0; i < 2 && r >= 0; i++) {
		r = kvd_client_connect(socket, i ? "grant-b" : "grant-a", &c[i]);
		if (r >= 0)
			r = m[i] = kvd_model_register(c[i], &grant_shape);
		if (r < 0)
			fail("grant: setting up tenant %d: %s", i, strerror(-r));
	}
	/* The first turn makes the memory (new); then a, a, ...; then b, a, b, ... */
	if (r >= 0)
		r = grant_turn(c[0], m[0], &warm);
	for (unsigned t = 0; r >= 0 && t < GRANT_TURNS; t++)
		r = grant_turn(c[0], m[0], &own[t]);
	for (unsigned t = 0; r >= 0 && t < GRANT_TURNS; t++)
		r = grant_turn(c[(t + 1) % 2], m[(t + 1) % 2], &renewed[t]);
	kvd_client_unref(c[0]);
	kvd_client_unref(c[1]);
	if (r < 0)
		return r;
	ret[0] = stats_of(own, GRANT_TURNS).median_us / GRANT_CHUNKS;
	ret[1] = stats_of(renewed, GRANT_TURNS).median_us / GRANT_CHUNKS;
	return 0;
}

static int kvd_latency(const char *socket, bool ring, uint32_t spin_us, int client_cpu,
                       struct stats *ret) {
	_cleanup_(freep) uint64_t *ns = calloc(arg_iterations, sizeof(uint64_t));
	uint32_t total = warmup() + arg_iterations;
	kvd_client *c;
	kvd_seq *s;
	int r = 0;

	if (!ns)
		return -ENOMEM;
	r = kvd_open(socket, ring, spin_us, &c, &s);
	if (r < 0)
		return r;
	pin_cpu(client_cpu);
	for (uint32_t i = 0; i < total && r >= 0; i++) {
		uint64_t t0 = now_ns();

		r = i % 2 ? kvd_seq_unpin(s) : kvd_seq_pin(s);
		if (i >= total - arg_iterations)
			ns[i - (total - arg_iterations)] = now_ns() - t0;
	}
	pin_cpu(-1);
	if (r < 0)
		fail("kvd %s: %s", ring ? "ring" : "socket", strerror(-r));
	(void)kvd_seq_release(s);
	kvd_client_unref(c);
	if (r < 0)
		return r;
	*ret = stats_of(ns, arg_iterations);
	return 0;
}

static int measure_row(struct row *row, int client_cpu) {
	const struct strategy *st = row->wait;
	struct daemon d;
	int r;

	r = floor_socket(st, client_cpu, false, &row->socket_floor);
	if (r >= 0)
		r = floor_socket(st, client_cpu, true, &row->socket_fdroom_floor);
	if (r >= 0)
		r = floor_ring(st, client_cpu, &row->ring_floor);
	if (r < 0)
		return r;
	r = daemon_start(&d, st->server_spin_us, "auto", "auto", cpus[0]);
	if (r < 0)
		return r;
	r = kvd_latency(d.socket, false, st->client_spin_us, client_cpu, &row->socket_kvd);
	if (r >= 0)
		r = kvd_latency(d.socket, true, st->client_spin_us, client_cpu, &row->ring_kvd);
	daemon_stop(&d);
	if (r < 0)
		return r;
	r = daemon_start(&d, st->server_spin_us, "auto", "epoll", cpus[0]);
	if (r < 0)
		return r;
	r = kvd_latency(d.socket, false, st->client_spin_us, client_cpu, &row->socket_epoll_kvd);
	if (r >= 0)
		r = kvd_latency(d.socket, true, st->client_spin_us, client_cpu, &row->ring_epoll_kvd);
	daemon_stop(&d);
	if (r < 0 || !row->eventfd)
		return r;
	r = daemon_start(&d, st->server_spin_us, "eventfd", "auto", cpus[0]);
	if (r < 0)
		return r;
	r = kvd_latency(d.socket, true, st->client_spin_us, client_cpu, &row->ring_eventfd_kvd);
	daemon_stop(&d);
	return r;
}

/* ---- a flooding client ---- */

/*
 * What a client that floods the daemon costs another: the victim grows a sequence one block
 * at a time (through the rings, libkvd's default), each grow timed, first alone and then
 * while another process pipelines status requests on its socket FLOOD_BATCH at a time, as
 * fast as the daemon answers them. The daemon handles at most 64 frames of a connection a
 * turn of its loop (conn.h, CONN_FRAMES_PER_TURN), so the victim waits for one share, not
 * for the whole batch.
 */
#define FLOOD_BATCH 1024u
#define FLOOD_GROWS 4000u
#define FLOOD_SEQ_BLOCKS 256u

/* The flooder: hello, then batches of status requests, every reply read; writes 'R' when
 * ready and runs until killed. */
static void flood_child(const char *path, int ready_fd) {
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	Kvd__V1__StatusRequest sr = KVD__V1__STATUS_REQUEST__INIT;
	Kvd__V1__Hello h = KVD__V1__HELLO__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *rep;
	_cleanup_(freep) uint8_t *batch = NULL;
	struct wire_rx *rx = malloc(sizeof(*rx));
	int fds[WIRE_FDS_MAX], fd;
	size_t used = 0, size;
	uint32_t nfds, want = 1;
	uint8_t *frame;

	if (strlen(path) >= sizeof(sa.sun_path))
		_exit(1);
	memcpy(sa.sun_path, path, strlen(path) + 1);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (!rx || fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0)
		_exit(1);
	wire_rx_init(rx);
	h.has_min_version = h.has_max_version = true;
	h.min_version = KVD_PROTOCOL_VERSION_MIN;
	h.max_version = KVD_PROTOCOL_VERSION_MAX;
	h.tenant = (char *)"flood";
	env.has_id = true;
	env.id = 1;
	env.body_case = KVD__V1__ENVELOPE__BODY_HELLO;
	env.hello = &h;
	if (wire_encode(&env, 0, &frame, &size) < 0 || send_all(fd, frame, size, 0, false) < 0)
		_exit(1);
	free(frame);
	env.body_case = KVD__V1__ENVELOPE__BODY_STATUS_REQUEST;
	env.status_request = &sr;
	for (uint32_t i = 0; i < FLOOD_BATCH; i++) {
		env.id = 2 + i;
		if (wire_encode(&env, 0, &frame, &size) < 0)
			_exit(1);
		batch = realloc(batch, used + size);
		if (!batch)
			_exit(1);
		memcpy(batch + used, frame, size);
		used += size;
		free(frame);
	}
	for (bool ready = false;;) {
		while (want > 0) {
			int r = wire_rx_next(rx, &rep, fds, &nfds);
			ssize_t n;
			size_t room;
			uint8_t *p;

			if (r > 0) {
				want--;
				continue;
			}
			if (r < 0)
				_exit(1);
			p = wire_rx_space(rx, &room);
			n = recv(fd, p, room, 0);
			if (n <= 0)
				_exit(n == 0 ? 0 : 1);
			wire_rx_commit(rx, (size_t)n);
		}
		if (!ready && write(ready_fd, "R", 1) != 1)
			_exit(1);
		ready = true;
		if (send_all(fd, batch, used, 0, false) < 0)
			_exit(1);
		want = FLOOD_BATCH;
	}
}

/* The victim's grows, one block each, timed; the sequence starts over every
 * FLOOD_SEQ_BLOCKS. */
static int victim_grows(const char *socket, struct stats *ret) {
	_cleanup_(freep) uint64_t *ns = calloc(FLOOD_GROWS, sizeof(uint64_t));
	kvd_seq *s = NULL;
	kvd_client *c;
	int m, r;

	if (!ns)
		return -ENOMEM;
	r = kvd_client_connect(socket, "victim", &c);
	if (r < 0)
		return fail("flood: connect: %s", strerror(-r));
	r = m = kvd_model_register(c, &grant_shape);
	for (uint32_t i = 0; r >= 0 && i < FLOOD_GROWS; i++) {
		uint64_t t0;

		if (i % FLOOD_SEQ_BLOCKS == 0) {
			if (s)
				(void)kvd_seq_release(s);
			r = kvd_seq_open(c, m, FLOOD_SEQ_BLOCKS * 16, &s);
			if (r < 0)
				break;
		}
		t0 = now_ns();
		r = kvd_seq_grow(s, 16);
		ns[i] = now_ns() - t0;
	}
	if (s)
		(void)kvd_seq_release(s);
	kvd_client_unref(c);
	if (r < 0)
		return fail("flood: the victim's grow: %s", strerror(-r));
	*ret = stats_of(ns, FLOOD_GROWS);
	return 0;
}

/* ret[0]: the victim's grows alone; ret[1]: while another client floods. */
static int flood(const char *socket, struct stats *ret) {
	int ready[2], r;
	pid_t pid;
	char b;

	r = victim_grows(socket, &ret[0]);
	if (r < 0)
		return r;
	if (pipe2(ready, O_CLOEXEC) < 0)
		return fail("pipe: %s", strerror(errno));
	pid = fork_child();
	if (pid == 0) {
		close(ready[0]);
		flood_child(socket, ready[1]);
	}
	close(ready[1]);
	if (pid < 0 || read(ready[0], &b, 1) != 1)
		r = fail("the flooding client failed to start");
	close(ready[0]);
	if (r >= 0)
		r = victim_grows(socket, &ret[1]);
	if (pid > 0) {
		kill(pid, SIGKILL);
		waitpid(pid, NULL, 0);
	}
	return r;
}

/* ---- throughput ---- */

/* One client process: pin and unpin back to back once go_fd closes, for --seconds; writes
 * 'R' when ready, then the count of operations. */
static void throughput_child(const char *socket, bool ring, int report_fd, int go_fd) {
	uint64_t ops = 0, end;
	kvd_client *c;
	kvd_seq *s;
	char b;

	if (kvd_open(socket, ring, arg_spin_us, &c, &s) < 0)
		_exit(1);
	if (write(report_fd, "R", 1) != 1 || read(go_fd, &b, 1) != 0)
		_exit(1);
	end = now_ns() + (uint64_t)(arg_seconds * 1e9);
	while (now_ns() < end) {
		if (kvd_seq_pin(s) < 0 || kvd_seq_unpin(s) < 0)
			_exit(1);
		ops += 2;
	}
	if (write(report_fd, &ops, sizeof(ops)) != sizeof(ops))
		_exit(1);
	_exit(0);
}

static int throughput(const char *socket, bool ring, unsigned clients, double *ret_ops) {
	int report[2], go[2], r = 0;
	pid_t pids[16];
	uint64_t sum = 0;
	unsigned started = 0;

	if (pipe2(report, O_CLOEXEC) < 0 || pipe2(go, O_CLOEXEC) < 0)
		return fail("pipe: %s", strerror(errno));
	for (; started < clients; started++) {
		pids[started] = fork_child();
		if (pids[started] < 0) {
			r = fail("fork: %s", strerror(errno));
			break;
		}
		if (pids[started] == 0) {
			close(report[0]);
			close(go[1]);
			throughput_child(socket, ring, report[1], go[0]);
		}
	}
	close(report[1]);
	close(go[0]);
	for (unsigned i = 0; i < started && r >= 0; i++) {
		char b;

		if (read(report[0], &b, 1) != 1)
			r = fail("a throughput client failed to set up");
	}
	/* Every client starts at once, when the pipe closes. */
	close(go[1]);
	for (unsigned i = 0; i < started && r >= 0; i++) {
		uint64_t ops;

		if (read(report[0], &ops, sizeof(ops)) != sizeof(ops))
			r = fail("a throughput client failed");
		else
			sum += ops;
	}
	close(report[0]);
	for (unsigned i = 0; i < started; i++)
		waitpid(pids[i], NULL, 0);
	*ret_ops = sum / arg_seconds;
	return r;
}

/* ---- output ---- */

static double ratio(double kvd, double floor) {
	return floor > 0 ? kvd / floor : 0;
}

static void print_pair(const char *path, const struct stats *fl, const struct stats *kv,
                       double target) {
	double rm = ratio(kv->median_us, fl->median_us), rp = ratio(kv->p99_us, fl->p99_us);

	printf("  %-16s floor %8.2f / %8.2f   kvd %8.2f / %8.2f   ratio %5.2f / %5.2f   %s %.1f\n",
	       path, fl->median_us, fl->p99_us, kv->median_us, kv->p99_us, rm, rp,
	       rm <= target ? "within" : "OVER", target);
}

static void print_text(const struct row *rows, unsigned n_rows, const double *tput,
                       const double *grant, const struct stats *flooded) {
	printf("kvd-bench ipc: %d CPUs; %" PRIu32 " round trips per figure (median / p99, us); "
	       "server on CPU %d, client on CPU %d (same-core) or %d (cross-core)\n",
	       n_cpus, arg_iterations, cpus[0], cpus[0], cpus[1]);
	for (unsigned i = 0; i < n_rows; i++) {
		const struct row *r = &rows[i];

		printf("%s, %s (client spins %" PRIu32 " us, server %" PRIu32 " us):\n", r->wait->name,
		       r->placement, r->wait->client_spin_us, r->wait->server_spin_us);
		print_pair("socket", &r->socket_floor, &r->socket_kvd, SOCKET_TARGET);
		print_pair("socket (fd room)", &r->socket_fdroom_floor, &r->socket_kvd, SOCKET_TARGET);
		print_pair("ring", &r->ring_floor, &r->ring_kvd, RING_TARGET);
		if (r->eventfd)
			print_pair("ring (eventfd)", &r->ring_floor, &r->ring_eventfd_kvd, RING_TARGET);
		print_pair("socket (epoll)", &r->socket_floor, &r->socket_epoll_kvd, SOCKET_TARGET);
		print_pair("ring (epoll)", &r->ring_floor, &r->ring_epoll_kvd, RING_TARGET);
	}
	printf("throughput, pin and unpin back to back (ops/s, %.1f s, --poll-us %" PRIu32
	       ", client spin %" PRIu32 " us, unpinned):\n", arg_seconds, arg_poll_us, arg_spin_us);
	printf("  %-8s %12s %12s\n", "clients", "ring", "socket");
	for (unsigned i = 0; i < ELEMENTSOF(throughput_clients); i++)
		printf("  %-8u %12.0f %12.0f\n", throughput_clients[i], tput[2 * i], tput[2 * i + 1]);
	printf("chunk grants (%u chunks of 1 MiB in one grow, %s; median of %u, us a chunk):\n"
	       "  own (the tenant's freed memory) %.2f, renewed (another tenant's: new memory) "
	       "%.2f, ratio %.2f\n", GRANT_CHUNKS, arg_backend, GRANT_TURNS, grant[0], grant[1],
	       ratio(grant[1], grant[0]));
	printf("a flooding client (%u status requests pipelined at a time): another client's grow "
	       "of a block, %u grows (median / p99, us):\n"
	       "  alone %.2f / %.2f, flooded %.2f / %.2f, ratio %.2f / %.2f\n", FLOOD_BATCH,
	       FLOOD_GROWS, flooded[0].median_us, flooded[0].p99_us, flooded[1].median_us,
	       flooded[1].p99_us, ratio(flooded[1].median_us, flooded[0].median_us),
	       ratio(flooded[1].p99_us, flooded[0].p99_us));
}

static void json_pair(const char *path, const struct stats *fl, const struct stats *kv,
                      double target) {
	double rm = ratio(kv->median_us, fl->median_us), rp = ratio(kv->p99_us, fl->p99_us);

	printf(",\n      \"%s_floor_median_us\": %.3f, \"%s_floor_p99_us\": %.3f", path, fl->median_us,
	       path, fl->p99_us);
	printf(",\n      \"%s_kvd_median_us\": %.3f, \"%s_kvd_p99_us\": %.3f", path, kv->median_us,
	       path, kv->p99_us);
	printf(",\n      \"%s_ratio_median\": %.3f, \"%s_ratio_p99\": %.3f, \"%s_ratio_met\": %s", path,
	       rm, path, rp, path, rm <= target ? "true" : "false");
}

/* The kvd socket op against the fd-room floor: socket_fdroom_floor_* and
 * socket_fdroom_ratio_* (the kvd figures are socket_kvd_*). */
static void json_fdroom(const struct stats *fl, const struct stats *kv, double target) {
	double rm = ratio(kv->median_us, fl->median_us), rp = ratio(kv->p99_us, fl->p99_us);

	printf(",\n      \"socket_fdroom_floor_median_us\": %.3f, \"socket_fdroom_floor_p99_us\": %.3f",
	       fl->median_us, fl->p99_us);
	printf(",\n      \"socket_fdroom_ratio_median\": %.3f, \"socket_fdroom_ratio_p99\": %.3f, "
	       "\"socket_fdroom_ratio_met\": %s", rm, rp, rm <= target ? "true" : "false");
}

static void print_json(const struct row *rows, unsigned n_rows, const double *tput,
                       const double *grant, const struct stats *flooded) {
	printf("{\n  \"cpus\": %d,\n  \"iterations\": %" PRIu32 ",\n  \"message_bytes\": %d,\n"
	       "  \"server_cpu\": %d,\n  \"client_cpus\": {\"same-core\": %d, \"cross-core\": %d},\n"
	       "  \"ring_ratio_target\": %.1f,\n  \"socket_ratio_target\": %.1f,\n  \"latency\": [",
	       n_cpus, arg_iterations, MSG_BYTES, cpus[0], cpus[0], cpus[1], RING_TARGET, SOCKET_TARGET);
	for (unsigned i = 0; i < n_rows; i++) {
		const struct row *r = &rows[i];

		printf("%s\n    {\"wait\": \"%s\", \"placement\": \"%s\", \"client_spin_us\": %" PRIu32
		       ", \"server_spin_us\": %" PRIu32, i ? "," : "", r->wait->name, r->placement,
		       r->wait->client_spin_us, r->wait->server_spin_us);
		json_pair("socket", &r->socket_floor, &r->socket_kvd, SOCKET_TARGET);
		json_fdroom(&r->socket_fdroom_floor, &r->socket_kvd, SOCKET_TARGET);
		json_pair("ring", &r->ring_floor, &r->ring_kvd, RING_TARGET);
		if (r->eventfd)
			json_pair("ring_eventfd", &r->ring_floor, &r->ring_eventfd_kvd, RING_TARGET);
		json_pair("socket_epoll", &r->socket_floor, &r->socket_epoll_kvd, SOCKET_TARGET);
		json_pair("ring_epoll", &r->ring_floor, &r->ring_epoll_kvd, RING_TARGET);
		printf("}");
	}
	printf("\n  ],\n  \"throughput_seconds\": %.3f,\n  \"throughput\": [", arg_seconds);
	for (unsigned i = 0; i < ELEMENTSOF(throughput_clients); i++)
		printf("%s\n    {\"clients\": %u, \"ring_ops_per_s\": %.0f, \"socket_ops_per_s\": %.0f}",
		       i ? "," : "", throughput_clients[i], tput[2 * i], tput[2 * i + 1]);
	printf("\n  ],\n  \"grant_chunks\": %u, \"grant_own_us\": %.3f, \"grant_renewed_us\": %.3f, "
	       "\"grant_renewed_ratio\": %.3f,\n", GRANT_CHUNKS, grant[0], grant[1],
	       ratio(grant[1], grant[0]));
	printf("  \"flood_batch\": %u, \"flood_grows\": %u, \"grow_alone_median_us\": %.3f, "
	       "\"grow_alone_p99_us\": %.3f, \"grow_flooded_median_us\": %.3f, "
	       "\"grow_flooded_p99_us\": %.3f, \"grow_flooded_ratio_median\": %.3f, "
	       "\"grow_flooded_ratio_p99\": %.3f\n}\n", FLOOD_BATCH, FLOOD_GROWS,
	       flooded[0].median_us, flooded[0].p99_us, flooded[1].median_us, flooded[1].p99_us,
	       ratio(flooded[1].median_us, flooded[0].median_us),
	       ratio(flooded[1].p99_us, flooded[0].p99_us));
}

/* ---- options ---- */

static void help(void) {
	printf("Usage: kvd-bench ipc [OPTIONS]\n"
	       "\n"
	       "The cost of one per-step kvd request (pin, unpin) over the socket and through\n"
	       "the shared-memory rings, next to floors between two processes: a raw\n"
	       "Unix-socket round trip with recv()/send(); the same with kvd's recvmsg() with\n"
	       "room for fds and sendmsg() (\"fd room\": the floor of any protocol that passes\n"
	       "fds on its socket, as kvd's does); and a raw ring round trip. Each spinning,\n"
	       "spinning then sleeping, and sleeping, on one core and across two, with kvd on\n"
	       "io_uring and again on its epoll loop (where io_uring is not allowed); then\n"
	       "pin/unpin throughput with 1, 4 and 16 clients; then what a chunk grant costs\n"
	       "when the chunk is the tenant's own freed one and when it was another tenant's\n"
	       "(a new memory object); then what a client flooding the daemon with pipelined\n"
	       "requests costs another client's grows. Starts its own kvd daemons on temporary\n"
	       "sockets.\n"
	       "\n"
	       "Options:\n"
	       "  --kvd PATH        The kvd binary (default: $KVD_DAEMON if set, else kvd from PATH)\n"
	       "  --backend NAME    The daemons' backend: host (default) or cuda (needs a GPU,\n"
	       "                    or the test driver tests/fake-cuda to count driver calls)\n"
	       "  --iterations N    Round trips per figure, 100..%u (default: 20000)\n"
	       "  --seconds S       Length of each throughput run, 0.05..%.0f (default: 2)\n"
	       "  --spin-us US      The client's spin before sleeping, in spin-sleep rows and\n"
	       "                    for throughput (default: 50, libkvd's)\n"
	       "  --poll-us US      The server's spin before sleeping, likewise (default: 50,\n"
	       "                    kvd's)\n"
	       "  --json            Print JSON instead of tables; ratio fields are named\n"
	       "                    ring_ratio_*, ring_eventfd_ratio_*, socket_ratio_* (against\n"
	       "                    the plain floor), socket_fdroom_ratio_* (against the\n"
	       "                    fd-room floor, socket_fdroom_floor_*), and socket_epoll_*,\n"
	       "                    ring_epoll_* for kvd on its epoll loop (--uring-setup=epoll)\n"
	       "  -h --help         Show this help and exit\n"
	       "\n"
	       "Exit status: 0 when every figure was measured, 1 on errors, 2 on usage errors.\n",
	       ITERATIONS_MAX, SECONDS_MAX);
}

#define usage_error(...) cli_usage_error("kvd-bench ipc", __VA_ARGS__)

int bench_ipc(int argc, char **argv) {
	enum { OPT_KVD = 0x100, OPT_BACKEND, OPT_ITERATIONS, OPT_SECONDS, OPT_SPIN_US, OPT_POLL_US,
	       OPT_JSON };
	static const struct option options[] = {
		{ "kvd", required_argument, NULL, OPT_KVD },
		{ "iterations", required_argument, NULL, OPT_ITERATIONS },
		{ "backend", required_argument, NULL, OPT_BACKEND },
		{ "seconds", required_argument, NULL, OPT_SECONDS },
		{ "spin-us", required_argument, NULL, OPT_SPIN_US },
		{ "poll-us", required_argument, NULL, OPT_POLL_US },
		{ "json", no_argument, NULL, OPT_JSON },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	struct strategy waits[] = {
		{ "spin", SPIN_FOREVER_US, SPIN_FOREVER_US },
		{ "spin-sleep", 0, 0 },
		{ "sleep", 0, 0 },
	};
	struct row rows[2 * ELEMENTSOF(waits)];
	double tput[2 * ELEMENTSOF(throughput_clients)] = {}, grant[2] = {};
	struct stats flooded[2] = {};
	unsigned n_rows = 0;
	char *end;
	int opt, r = 0;

	arg_kvd = getenv("KVD_DAEMON");
	if (!arg_kvd || !*arg_kvd)
		arg_kvd = "kvd";
	optind = 0;
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case 'h':
			help();
			return 0;
		case OPT_KVD:
			arg_kvd = optarg;
			break;
		case OPT_BACKEND:
			if (strcmp(optarg, "host") != 0 && strcmp(optarg, "cuda") != 0)
				return usage_error("--backend: '%s' is not host or cuda", optarg);
			arg_backend = optarg;
			break;
		case OPT_ITERATIONS:
			if (number_parse_u32(optarg, 100, ITERATIONS_MAX, &arg_iterations) < 0)
				return usage_error("--iterations: '%s' is not in 100..%u", optarg,
				                   ITERATIONS_MAX);
			break;
		case OPT_SECONDS:
			arg_seconds = strtod(optarg, &end);
			if (*end || !(arg_seconds >= 0.05 && arg_seconds <= SECONDS_MAX))
				return usage_error("--seconds: '%s' is not in 0.05..%.0f", optarg,
				                   SECONDS_MAX);
			break;
		case OPT_SPIN_US:
			if (number_parse_u32(optarg, 0, SPIN_FOREVER_US, &arg_spin_us) < 0)
				return usage_error("--spin-us: '%s' is not in 0..%u", optarg, SPIN_FOREVER_US);
			break;
		case OPT_POLL_US:
			if (number_parse_u32(optarg, 0, SPIN_FOREVER_US, &arg_poll_us) < 0)
				return usage_error("--poll-us: '%s' is not in 0..%u", optarg, SPIN_FOREVER_US);
			break;
		case OPT_JSON:
			arg_json = true;
			break;
		default:
			return usage_error("bad option");
		}
	if (optind < argc)
		return usage_error("unexpected argument '%s'", argv[optind]);
	waits[1].client_spin_us = arg_spin_us;
	waits[1].server_spin_us = arg_poll_us;

	if (sched_getaffinity(0, sizeof(all_cpus), &all_cpus) < 0) {
		fail("sched_getaffinity: %s", strerror(errno));
		return 1;
	}
	for (int i = 0; i < CPU_SETSIZE && n_cpus < 2; i++)
		if (CPU_ISSET(i, &all_cpus))
			cpus[n_cpus++] = i;
	n_cpus = CPU_COUNT(&all_cpus);
	if (n_cpus < 2)
		cpus[1] = cpus[0];

	for (unsigned w = 0; w < ELEMENTSOF(waits) && r >= 0; w++)
		for (int place = 0; place < (n_cpus < 2 ? 1 : 2) && r >= 0; place++) {
			struct row *row = &rows[n_rows++];

			*row = (struct row){
				.wait = &waits[w],
				.placement = place ? "cross-core" : "same-core",
				.eventfd = w == 2,
			};
			r = measure_row(row, cpus[place]);
		}
	if (r >= 0) {
		struct daemon d;

		r = daemon_start(&d, arg_poll_us, "auto", "auto", -1);
		for (unsigned i = 0; r >= 0 && i < ELEMENTSOF(throughput_clients); i++) {
			r = throughput(d.socket, true, throughput_clients[i], &tput[2 * i]);
			if (r >= 0)
				r = throughput(d.socket, false, throughput_clients[i], &tput[2 * i + 1]);
		}
		if (r >= 0)
			r = grants(d.socket, grant);
		if (r >= 0)
			r = flood(d.socket, flooded);
		if (d.pid > 0)
			daemon_stop(&d);
	}
	if (r < 0)
		return 1;
	if (arg_json)
		print_json(rows, n_rows, tput, grant, flooded);
	else
		print_text(rows, n_rows, tput, grant, flooded);
	return 0;
}
