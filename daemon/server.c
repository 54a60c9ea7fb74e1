/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <time.h>
#include <unistd.h>

#include "common/macro.h"
#include "conn.h"
#include "log.h"
#include "server.h"
#include "wire.h"

#define STOP_GRACE_MS 2000

uint64_t now_ms(void) {
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

#define container_of(ptr, type, member) ((type *)((char *)(ptr) - offsetof(type, member)))

/* Tells a client we cannot serve why, in a frame with id 0, and closes it. The socket
 * is new and its buffer empty, so the small frame goes out at once or not at all. */
static void refuse(int fd, int code, const char *why) {
	Kvd__V1__Status st = KVD__V1__STATUS__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	_cleanup_(freep) uint8_t *frame = NULL;
	size_t size;

	st.has_code = true;
	st.code = code;
	st.message = (char *)why;
	env.status = &st;
	if (wire_encode(&env, 0, &frame, &size) == 0)
		(void)!send(fd, frame, size, MSG_NOSIGNAL | MSG_DONTWAIT);
	safe_close(fd);
}

static void on_accept(struct loop_op *op, int res, bool more) {
	struct server *s = container_of(op, struct server, accept_op);
	struct conn *c;
	int r;

	if (res >= 0) {
		if (s->stopping || s->n_conns >= s->limits.max_connections) {
			refuse(res, s->stopping ? -ESHUTDOWN : -EUSERS,
			       s->stopping ? "the daemon is stopping" : "connection limit reached");
			if (!s->stopping)
				log_warning("refusing a connection: limit of %u reached",
				            s->limits.max_connections);
		} else if ((r = conn_new(s, res, &c)) < 0) {
			log_error_errno(r, "setting up a connection failed, ignoring");
		} else {
			c->next = s->conns;
			if (s->conns)
				s->conns->prev = c;
			s->conns = c;
			s->n_conns++;
		}
	} else if (res != -EINTR && res != -ECONNABORTED) {
		log_warning_errno(res, "accept failed");
	}
	/* Multishot accept stops on errors and overflow; start it again. */
	if (!more && !s->stopping && loop_accept(s->loop, &s->accept_op, s->listen_fd) < 0)
		log_error("cannot re-arm accept; no new connections will be served");
}

static void on_signal(struct loop_op *op, int res, bool more) {
	struct server *s = container_of(op, struct server, signal_op);

	if (res == (int)sizeof(s->siginfo)) {
		log_info("received %s, stopping", strsignal((int)s->siginfo.ssi_signo));
		server_stop(s);
		return;
	}
	if (loop_read(s->loop, &s->signal_op, s->signal_fd, &s->siginfo, sizeof(s->siginfo)) < 0)
		log_error("cannot re-arm the signal read");
}

static void on_tick(struct loop_op *op, int res, bool more) {
	struct server *s = container_of(op, struct server, tick_op);
	uint64_t now = now_ms();

	if (s->stopping) {
		if (now - s->stop_ms >= STOP_GRACE_MS) {
			log_warning("%u clients did not drain in time, exiting anyway", s->n_conns);
			loop_exit(s->loop);
			return;
		}
	} else {
		for (struct conn *c = s->conns, *next; c; c = next) {
			next = c->next;
			if (!c->hello && now - c->accepted_ms >= s->limits.hello_timeout_ms) {
				s->protocol_errors++;
				conn_close(c, "no hello in time");
			}
		}
	}
	if (loop_timeout(s->loop, &s->tick_op, s->tick_ms) < 0)
		log_error("cannot re-arm the timer");
}

static int listen_socket(const char *path, int *ret) {
	_cleanup_(closep) int fd = -EBADF, probe = -EBADF;
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	mode_t old;
	int r;

	if (strlen(path) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	strcpy(sa.sun_path, path);

	/* A socket file left by a daemon that died is removed; a live one is not taken over. */
	probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (probe < 0)
		return negative_errno();
	if (connect(probe, (struct sockaddr *)&sa, sizeof(sa)) == 0)
		return -EADDRINUSE;
	if (errno == ECONNREFUSED)
		unlink(path);

	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0)
		return negative_errno();
	/* Owner and group only: access control starts with who may connect. */
	old = umask(0117);
	r = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
	umask(old);
	if (r < 0)
		return negative_errno();
	if (listen(fd, SOMAXCONN) < 0)
		return negative_errno();
	*ret = TAKE_FD(fd);
	return 0;
}

int server_new(struct pool *pool, const struct server_limits *limits, const char *socket_path,
               struct server **ret) {
	struct server *s;
	sigset_t mask;
	int r;

	s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	s->listen_fd = s->signal_fd = -EBADF;
	s->pool = pool;
	s->limits = *limits;
	s->socket_path = socket_path;
	s->start_ms = now_ms();
	s->accept_op.handler = on_accept;
	s->signal_op.handler = on_signal;
	s->tick_op.handler = on_tick;
	s->tick_ms = MIN(MAX(limits->hello_timeout_ms / 4, 50), 1000);

	r = tenant_table_init(&s->tenants, limits->max_tenants);
	if (r < 0)
		goto fail;
	s->scratch = calloc(pool->n_chunks, sizeof(*s->scratch));
	if (!s->scratch) {
		r = -ENOMEM;
		goto fail;
	}
	r = loop_new(&s->loop);
	if (r < 0) {
		log_error_errno(r, "cannot set up io_uring");
		goto fail;
	}
	r = listen_socket(socket_path, &s->listen_fd);
	if (r < 0) {
		log_error_errno(r, "cannot listen on %s", socket_path);
		goto fail;
	}
	sigemptyset(&mask);
	sigaddset(&mask, SIGTERM);
	sigaddset(&mask, SIGINT);
	sigprocmask(SIG_BLOCK, &mask, NULL);
	s->signal_fd = signalfd(-1, &mask, SFD_CLOEXEC);
	if (s->signal_fd < 0) {
		r = log_error_errno(negative_errno(), "signalfd failed");
		goto fail;
	}
	*ret = s;
	return 0;
fail:
	server_free(s);
	return r;
}

struct server *server_free(struct server *s) {
	if (!s)
		return NULL;
	/* The ring goes first, so that the kernel holds no buffer of the connections. */
	s->loop = loop_free(s->loop);
	while (s->conns)
		conn_destroy(s->conns);
	while (s->closed)
		conn_destroy(s->closed);
	if (s->listen_fd >= 0)
		unlink(s->socket_path);
	safe_close(s->listen_fd);
	safe_close(s->signal_fd);
	tenant_table_done(&s->tenants);
	free(s->scratch);
	free(s);
	return NULL;
}

struct conn *server_find_conn(struct server *s, uint64_t id) {
	for (struct conn *c = s->conns; c; c = c->next)
		if (c->id == id)
			return c;
	return NULL;
}

uint32_t server_reclaim(struct server *s, struct seq_emptied *emptied, struct conn *requester,
                        uint32_t *ret_ids) {
	uint32_t n_ids = 0;

	for (uint32_t i = 0; i < emptied->n; i++) {
		struct chunk *ch = emptied->chunks[i];
		uint32_t id = ch->id;

		if (pool_chunk_reclaim(s->pool, ch) == 0)
			continue;
		/* Walk a copy of the holders: an event that cannot be queued closes its
		 * connection, which drops it from the list. */
		uint32_t n = ch->n_holders;
		_cleanup_(freep) uint64_t *holders = malloc(n * sizeof(uint64_t));

		if (!holders) {
			/* Without memory to ask the holders, the chunk stays DRAINING until they
			 * disconnect: safe, only slow. */
			log_error("out of memory reclaiming chunk %u; it stays draining", id);
			continue;
		}
		memcpy(holders, ch->holders, n * sizeof(uint64_t));
		for (uint32_t h = 0; h < n; h++) {
			struct conn *c = server_find_conn(s, holders[h]);
			Kvd__V1__Event ev = KVD__V1__EVENT__INIT;
			Envelope env = KVD__V1__ENVELOPE__INIT;

			if (c == requester && ret_ids) {
				ret_ids[n_ids++] = id;
				continue;
			}
			if (!c) {
				pool_chunk_drop_holder(s->pool, ch, holders[h]);
				continue;
			}
			ev.has_type = true;
			ev.type = KVD__V1__EVENT_TYPE__EVENT_CHUNKS_UNMAP;
			ev.n_chunk_ids = 1;
			ev.chunk_ids = &id;
			env.body_case = KVD__V1__ENVELOPE__BODY_EVENT;
			env.event = &ev;
			if (conn_send(c, &env, NULL, 0) < 0)
				conn_close(c, "cannot queue an unmap request");
		}
	}
	emptied->n = 0;
	return n_ids;
}

void server_stop(struct server *s) {
	Kvd__V1__Event ev = KVD__V1__EVENT__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;

	if (s->stopping)
		return;
	s->stopping = true;
	s->stop_ms = now_ms();
	sd_notify(0, "STOPPING=1\nSTATUS=stopping");
	if (s->n_conns == 0) {
		loop_exit(s->loop);
		return;
	}
	ev.has_type = true;
	ev.type = KVD__V1__EVENT_TYPE__EVENT_STOPPING;
	env.body_case = KVD__V1__ENVELOPE__BODY_EVENT;
	env.event = &ev;
	for (struct conn *c = s->conns, *next; c; c = next) {
		next = c->next;
		if (conn_send(c, &env, NULL, 0) < 0) {
			conn_close(c, NULL);
			continue;
		}
		c->close_when_sent = true;
	}
}

int server_run(struct server *s) {
	char status[256];
	int r;

	r = loop_accept(s->loop, &s->accept_op, s->listen_fd);
	if (r >= 0)
		r = loop_read(s->loop, &s->signal_op, s->signal_fd, &s->siginfo, sizeof(s->siginfo));
	if (r >= 0)
		r = loop_timeout(s->loop, &s->tick_op, s->tick_ms);
	if (r < 0)
		return log_error_errno(r, "cannot start the event loop");

	snprintf(status, sizeof(status), "READY=1\nSTATUS=serving %s, pool %llu MiB",
	         s->socket_path, (unsigned long long)(s->pool->pool_bytes >> 20));
	sd_notify(0, status);
	log_info("listening on %s (backend %s, pool %llu MiB in %u chunks of %llu KiB, budget %llu MiB)",
	         s->socket_path, s->pool->ops->name, (unsigned long long)(s->pool->pool_bytes >> 20),
	         s->pool->n_chunks, (unsigned long long)(s->pool->chunk_bytes >> 10),
	         (unsigned long long)(s->pool->budget_bytes >> 20));
	r = loop_run(s->loop);
	if (r < 0)
		return log_error_errno(r, "event loop failed");
	log_info("stopped");
	return 0;
}
