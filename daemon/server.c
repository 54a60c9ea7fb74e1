/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <grp.h>
#include <inttypes.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <time.h>
#include <unistd.h>

#include "access.h"
#include "admin.h"
#include "basic/macro.h"
#include "basic/number.h"
#include "common/ring.h"
#include "basic/size.h"
#include "config.h"
#include "conn.h"
#include "departed.h"
#include "dispatch.h"
#include "envelope.h"
#include "evict.h"
#include "keep.h"
#include "pins.h"
#include "upload.h"
#include "log.h"
#include "mover.h"
#include "offload.h"
#include "ring.h"
#include "server.h"
#include "tier-file.h"
#include "tier.h"
#include "wire.h"
#include "basic/time-util.h"

#define STOP_GRACE_MS 2000

static const char *const limit_names[_LIMIT_MAX] = {
	[LIMIT_CONNECTIONS] = "connections",
	[LIMIT_CONNECTIONS_PER_UID] = "connections_per_uid",
	[LIMIT_TENANTS_PER_UID] = "tenants_per_uid",
	[LIMIT_TENANTS] = "tenants",
	[LIMIT_MODELS] = "models",
	[LIMIT_MODELS_PER_TENANT] = "models_per_tenant",
	[LIMIT_SEQS] = "seqs",
	[LIMIT_SEQS_PER_TENANT] = "seqs_per_tenant",
	[LIMIT_SEQS_NODE] = "seqs_node",
	[LIMIT_METADATA] = "metadata",
	[LIMIT_SEQ_TOKENS] = "seq_tokens",
	[LIMIT_DESCRIPTOR] = "descriptor",
	[LIMIT_FRAME] = "frame",
	[LIMIT_SEND_QUEUE] = "send_queue",
	[LIMIT_OUTSTANDING] = "outstanding",
	[LIMIT_OBSERVATION] = "observation",
	[LIMIT_UPLOADS] = "uploads",
	[LIMIT_EVICT_REQUESTS] = "evict_requests",
	[LIMIT_EVICT_RATE] = "evict_rate",
	[LIMIT_GRANT_WAITERS] = "grant_waiters",
	[LIMIT_RING_COMPLETIONS] = "ring_completions",
	[LIMIT_PINNED] = "pinned",
	[LIMIT_RING_DOORBELL] = "ring_doorbell",
	[LIMIT_UNMAP_TIMEOUT] = "unmap_timeout",
};

const char *server_limit_to_string(enum server_limit l) {
	return l < _LIMIT_MAX ? limit_names[l] : NULL;
}

void server_refused(struct server *s, const struct conn *c, enum server_limit l) {
	s->refused[l]++;
	log_info("connection %llu (pid %d, uid %u, tenant %s): refused at limit %s (kvd(8), LIMITS)",
	         (unsigned long long)c->id, (int)c->cred.pid, (unsigned)c->cred.uid,
	         c->tenant ? c->tenant->name : "-", limit_names[l]);
}

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
		struct ucred cred = {};
		socklen_t len = sizeof(cred);
		uint32_t same_uid = 0, max;
		bool admin;

		/* The per-user limit: a user cannot take every connection from the others. */
		if (getsockopt(res, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0)
			for (struct conn *o = s->conns; o; o = o->next)
				same_uid += o->cred.uid == cred.uid;
		/* Root and admin-group have ADMIN_CONNECTIONS_RESERVED past both limits, so that
		 * an operator can always look and act (kvdctl) on a node clients filled. */
		admin = access_admin(&s->admin->cfg, res, &cred);
		max = server_conns_max(s) + (admin ? ADMIN_CONNECTIONS_RESERVED : 0);
		if (s->stopping) {
			refuse(res, -ESHUTDOWN, "the daemon is stopping");
		} else if (s->n_conns >= max) {
			s->refused[LIMIT_CONNECTIONS]++;
			refuse(res, -EUSERS, "connection limit reached");
			log_warning("refusing a connection of pid %d uid %u: limit of %u reached",
			            (int)cred.pid, (unsigned)cred.uid, max);
		} else if (same_uid >= s->limits.max_connections_per_uid +
		                       (admin ? ADMIN_CONNECTIONS_RESERVED : 0)) {
			s->uid_connections_refused++;
			s->refused[LIMIT_CONNECTIONS_PER_UID]++;
			refuse(res, -EUSERS, "connection limit of this user reached (max-connections-per-uid)");
			log_warning("refusing a connection of pid %d uid %u: its user's limit of %u reached",
			            (int)cred.pid, (unsigned)cred.uid, s->limits.max_connections_per_uid);
		} else if ((r = conn_new(s, res, &c)) < 0) {
			log_error_errno(r, "setting up a connection failed, ignoring");
		} else {
			if (s->n_conns >= server_conns_max(s))
				log_notice("connection limit reached: administrative connection %llu "
				           "goes in on the reserve", (unsigned long long)c->id);
			c->next = s->conns;
			if (s->conns)
				s->conns->prev = c;
			s->conns = c;
			s->n_conns++;
		}
		s->accept_pause_logged = false;
	} else if ((res == -EMFILE || res == -ENFILE) && !more) {
		/* Accepting again at once would fail again at once, a core spent on it: wait for
		 * a connection to close, or the tick (an error ends the multishot accept). */
		s->accept_paused = true;
		s->accept_pauses++;
		if (!s->accept_pause_logged)
			log_warning_errno(res, "out of file descriptors: accepting paused until a "
			                  "connection closes (new clients wait in the listen backlog)");
		s->accept_pause_logged = true;
		return;
	} else if (res != -EINTR && res != -ECONNABORTED) {
		log_warning_errno(res, "accept failed");
	}
	/* Multishot accept stops on errors and overflow; start it again. */
	if (!more && !s->stopping && loop_accept(s->loop, &s->accept_op, s->listen_fd) < 0)
		log_error("cannot re-arm accept; no new connections will be served");
}

void server_accept_resume(struct server *s) {
	if (!s->accept_paused || s->stopping)
		return;
	s->accept_paused = false;
	if (loop_accept(s->loop, &s->accept_op, s->listen_fd) < 0)
		log_error("cannot re-arm accept; no new connections will be served");
}

static void on_signal(struct loop_op *op, int res, bool more) {
	struct server *s = container_of(op, struct server, signal_op);

	if (res == (int)sizeof(s->siginfo) && s->siginfo.ssi_signo == SIGHUP) {
		struct timespec ts;

		/* Tells a service manager that waits for the reload (Type=notify-reload); the time
		 * must not read earlier than its request, so no rounding to milliseconds. */
		clock_gettime(CLOCK_MONOTONIC, &ts);
		sd_notifyf(0, "RELOADING=1\nMONOTONIC_USEC=%llu",
		           (unsigned long long)ts.tv_sec * 1000000 + (unsigned long long)ts.tv_nsec / 1000);
		admin_reload(s->admin);
		sd_notify(0, "READY=1");
	} else if (res == (int)sizeof(s->siginfo)) {
		log_info("received %s, stopping", strsignal((int)s->siginfo.ssi_signo));
		server_stop(s);
		return;
	}
	if (loop_read(s->loop, &s->signal_op, s->signal_fd, &s->siginfo, sizeof(s->siginfo)) < 0)
		log_error("cannot re-arm the signal read");
}

/* STATUS= for the service manager: one line, what an operator wants at a glance. */
static void format_status(struct server *s, char *buf, size_t n) {
	char used[32], budget[32];

	if (s->stopping) {
		snprintf(buf, n, "stopping: %u connection%s left", s->n_conns,
		         s->n_conns == 1 ? "" : "s");
		return;
	}
	size_format(s->pool->used_bytes, used, sizeof(used));
	size_format(s->pool->budget_bytes, budget, sizeof(budget));
	snprintf(buf, n, "serving %s: %u connection%s, %s of %s budget used", s->socket_path,
	         s->n_conns, s->n_conns == 1 ? "" : "s", used, budget);
	/* A newline in the socket's path would end the assignment and start another. */
	for (char *p = buf; *p; p++)
		if ((unsigned char)*p < ' ' || *p == 0x7f)
			*p = '?';
}

/*
 * Once per tick: WATCHDOG=1 when the service manager watches us (the tick is then at most
 * half its interval, so a loop that stops turning stops pinging), and STATUS= when it
 * changed, in one datagram.
 */
static void notify_tick(struct server *s) {
	char status[sizeof(s->notify_status)], msg[sizeof(status) + 32];
	bool changed;

	format_status(s, status, sizeof(status));
	changed = strcmp(status, s->notify_status) != 0;
	if (!changed && !s->watchdog_usec)
		return;
	snprintf(msg, sizeof(msg), "%s%s%s", s->watchdog_usec ? "WATCHDOG=1" : "",
	         s->watchdog_usec && changed ? "\n" : "", changed ? "STATUS=" : "");
	if (changed) {
		strncat(msg, status, sizeof(msg) - strlen(msg) - 1);
		memcpy(s->notify_status, status, sizeof(status));
	}
	sd_notify(0, msg);
}

/*
 * The tick's period: a quarter of the shortest timeout it enforces (tier-idle among them),
 * between 50 ms and a
 * second, and at most half the service manager's watchdog interval. Recomputed at every
 * tick, so that a reload that shortens a timeout shortens the tick too.
 */
static uint64_t tick_interval(const struct server *s) {
	uint64_t ms = s->limits.hello_timeout_ms / 4;

	if (s->limits.unmap_timeout_ms > 0)
		ms = MIN(ms, s->limits.unmap_timeout_ms / 4);
	if (s->limits.unmap_timeout_ms > 0 && s->limits.unmap_grace_ms > 0)
		ms = MIN(ms, s->limits.unmap_grace_ms / 4);
	if (s->limits.tenant_forget_ms > 0)
		ms = MIN(ms, s->limits.tenant_forget_ms / 4);
	if (s->limits.pin_report_ms > 0)
		ms = MIN(ms, s->limits.pin_report_ms / 4);
	if (s->limits.pin_timeout_ms > 0)
		ms = MIN(ms, s->limits.pin_timeout_ms / 4);
	if (s->limits.tier_idle_ms > 0 && s->limits.host_tier_bytes > 0)
		ms = MIN(ms, s->limits.tier_idle_ms / 4);
	ms = MIN(MAX(ms, 50), 1000);
	if (s->watchdog_usec)
		ms = MIN(ms, MAX(s->watchdog_usec / 2000, 1));
	return ms;
}

uint64_t server_unmap_due(const struct server *s, const struct chunk *ch) {
	if (ch->state != CHUNK_DRAINING || ch->unmap_asked_ms == 0 || s->limits.unmap_timeout_ms == 0)
		return 0;
	return ch->unmap_asked_ms + s->limits.unmap_timeout_ms;
}

/*
 * Enforces unmap-timeout: memfds and cuMem handles cannot be revoked, so a chunk a holder
 * does not unmap stays out of the pool until it does, or disconnects. A connection that
 * missed a deadline gets no new grants (it would only take more), and once unmap-grace
 * has passed too it is disconnected, which drops its holds. The scan walks every chunk,
 * but only while some drain, and looks holders up only past their deadline.
 */
static void unmap_tick(struct server *s, uint64_t now) {
	struct pool *p = s->pool;

	for (struct conn *c = s->conns; c; c = c->next) {
		c->unmap_was_late = c->unmap_due_ms != 0;
		c->unmap_due_ms = 0;
		c->unmap_late = 0;
	}
	s->unmap_scan_ms = now;
	memset(s->draining_late, 0, sizeof(s->draining_late));
	for (uint32_t i = 0; i < p->n_chunks && p->chunks_draining > 0; i++) {
		const struct chunk *ch = &p->chunks[i];
		uint64_t due = server_unmap_due(s, ch);

		if (due == 0 || now < due)
			continue;
		s->draining_late[ch->mem.device]++;
		for (uint32_t h = 0; h < ch->n_holders; h++) {
			struct conn *c = server_find_conn(s, ch->holders[h]);

			if (!c)
				continue;
			c->unmap_late++;
			if (c->unmap_due_ms == 0 || due < c->unmap_due_ms)
				c->unmap_due_ms = due;
		}
	}
	for (struct conn *c = s->conns, *next; c; c = next) {
		next = c->next;
		/* Closed by an earlier disconnect here: its holds are gone already. */
		if (c->closing || c->unmap_due_ms == 0)
			continue;
		if (!c->unmap_was_late) {
			s->unmap_timeouts++;
			log_warning("connection %llu (pid %d, tenant %s) did not unmap a chunk within "
			            "unmap-timeout (%llu ms): no new grants, and a disconnect in %llu ms "
			            "unless it does", (unsigned long long)c->id, (int)c->cred.pid,
			            c->tenant ? c->tenant->name : "-",
			            (unsigned long long)s->limits.unmap_timeout_ms,
			            (unsigned long long)s->limits.unmap_grace_ms);
		}
		if (now - c->unmap_due_ms >= s->limits.unmap_grace_ms) {
			s->unmap_disconnects++;
			conn_close(c, "did not unmap a chunk within unmap-timeout and unmap-grace");
		}
	}
}

bool server_slowest_holder(struct server *s, char *buf, size_t n) {
	const struct pool *p = s->pool;
	const struct chunk *oldest = NULL;
	const struct conn *c;

	buf[0] = '\0';
	for (uint32_t i = 0; i < p->n_chunks && p->chunks_draining > 0; i++) {
		const struct chunk *ch = &p->chunks[i];

		if (ch->state == CHUNK_DRAINING && ch->n_holders > 0 && ch->unmap_asked_ms > 0 &&
		    (!oldest || ch->unmap_asked_ms < oldest->unmap_asked_ms))
			oldest = ch;
	}
	if (!oldest)
		return false;
	c = server_find_conn(s, oldest->holders[0]);
	if (c)
		snprintf(buf, n, "pid %d (tenant %s) for %llu ms", (int)c->cred.pid,
		         c->tenant ? c->tenant->name : "-",
		         (unsigned long long)(now_ms() - oldest->unmap_asked_ms));
	else
		snprintf(buf, n, "departed connection %llu for %llu ms",
		         (unsigned long long)oldest->holders[0],
		         (unsigned long long)(now_ms() - oldest->unmap_asked_ms));
	return true;
}

void server_forget_tenant(struct server *s, struct tenant *t, const char *why) {
	uint32_t n = pool_forget_tenant(s->pool, t);

	log_info("tenant %s forgotten: %s (the memory of its %" PRIu32 " free chunks destroyed)",
	         t->name, why, n);
	tenant_table_remove(&s->tenants, t);
}

/*
 * Forgets the tenants that held nothing for tenant-forget: with a tenant name per job, the
 * table (max-tenants) would otherwise fill and refuse every new tenant until a restart. A
 * tenant with settings of its own (config file, live) stays: its settings are its state.
 */
static void forget_tick(struct server *s, uint64_t now) {
	for (uint32_t i = 0; i < s->tenants.n;) {
		struct tenant *t = s->tenants.tenants[i];
		bool idle = tenant_holds_nothing(t) && !admin_tenant_declared(s->admin, t->name);

		if (!idle)
			t->idle_since_ms = 0;
		else if (t->idle_since_ms == 0)
			t->idle_since_ms = now;
		if (idle && s->limits.tenant_forget_ms > 0 &&
		    now - t->idle_since_ms >= s->limits.tenant_forget_ms)
			/* The next tenant moves into slot i. */
			server_forget_tenant(s, t, "it held nothing for tenant-forget");
		else
			i++;
	}
}

static void on_tick(struct loop_op *op, int res, bool more) {
	struct server *s = container_of(op, struct server, tick_op);
	uint64_t now = now_ms();

	notify_tick(s);
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
			} else if (c->partial_since_ms &&
			           now - c->partial_since_ms >= s->limits.hello_timeout_ms) {
				s->protocol_errors++;
				conn_close(c, "a frame begun made no progress within hello-timeout");
			}
		}
		unmap_tick(s, now);
		pins_tick(s, now);
		server_accept_resume(s);
		pool_retry_pinned(s->pool);
		if (s->admin)
			forget_tick(s, now);
	}
	if (s->http)
		http_tick(s->http, now, s->limits.hello_timeout_ms);
	if (!s->stopping) {
		evict_tick(s->evictor);
		offload_tick(s);
		keep_tick(s->keep, s);
	}
	s->tick_ms = tick_interval(s);
	if (loop_timeout(s->loop, &s->tick_op, s->tick_ms) < 0)
		log_error("cannot re-arm the timer");
}

/* The gid of socket-group, a name or a number. */
static int socket_gid(const char *group, gid_t *ret) {
	const struct group *g;
	uint64_t v;

	if (number_parse_u64(group, 0, UINT32_MAX - 1, &v) >= 0) {
		*ret = (gid_t)v;
		return 0;
	}
	errno = 0;
	g = getgrnam(group);
	if (!g)
		return errno > 0 ? -errno : -ENOENT;
	*ret = g->gr_gid;
	return 0;
}

static int listen_socket(const char *path, const char *group, int *ret) {
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
	if (group && *group) {
		gid_t gid;

		r = socket_gid(group, &gid);
		if (r < 0)
			return log_error_errno(r, "socket-group %s does not exist", group);
		/* Not fchown: on a socket it changes nothing on the file. lchown, so that a link
		 * put in its place is not followed; bind() already made it 0660. */
		if (lchown(path, (uid_t)-1, gid) < 0)
			return log_error_errno(negative_errno(), "cannot give %s to group %s", path,
			                       group);
	}
	if (listen(fd, SOMAXCONN) < 0)
		return negative_errno();
	*ret = TAKE_FD(fd);
	return 0;
}

/*
 * Takes the listening socket a service manager passed (kvd.socket, systemd-socket-activate):
 * exactly one, an AF_UNIX stream socket already listening. Returns 1 when it did, 0 when
 * none was passed (the caller binds its own), or a logged error.
 */
static int inherit_socket(struct server *s, int *sockets, unsigned n) {
	struct sockaddr_un sa = {};
	socklen_t len = sizeof(sa);
	int r, fd;

	/* The fd store's fds were taken out before (keep.h): what is left are sockets. */
	if (n == 0)
		return 0;
	if (n > 1) {
		log_error("the service manager passed %u sockets, expected one", n);
		for (unsigned i = 0; i < n; i++)
			safe_close(sockets[i]);
		return -EINVAL;
	}
	fd = sockets[0];
	r = sd_is_socket_unix(fd, SOCK_STREAM, 1, NULL, 0);
	if (r <= 0) {
		if (r < 0)
			log_error_errno(r, "cannot inspect the socket passed by the service manager");
		else
			log_error("the socket passed by the service manager is not a listening "
			          "AF_UNIX stream socket");
		safe_close(fd);
		return r < 0 ? r : -ENOTSOCK;
	}
	if (getsockname(fd, (struct sockaddr *)&sa, &len) < 0) {
		r = log_error_errno(negative_errno(), "getsockname on the passed socket failed");
		safe_close(fd);
		return r;
	}
	/* Not always NUL-terminated; an abstract name starts with one and is shown with '@'. */
	len = len > offsetof(struct sockaddr_un, sun_path) ?
	      MIN(len - offsetof(struct sockaddr_un, sun_path), sizeof(s->inherited_path) - 1) : 0;
	if (len > 0 && sa.sun_path[0] == 0)
		snprintf(s->inherited_path, sizeof(s->inherited_path), "@%.*s", (int)len - 1,
		         sa.sun_path + 1);
	else if (len > 0)
		snprintf(s->inherited_path, sizeof(s->inherited_path), "%.*s", (int)len, sa.sun_path);
	else
		snprintf(s->inherited_path, sizeof(s->inherited_path), "(unnamed)");
	if (strcmp(s->inherited_path, s->socket_path) != 0)
		log_notice("using the socket passed by the service manager, %s, instead of --socket %s",
		           s->inherited_path, s->socket_path);
	else
		log_info("using the socket passed by the service manager, %s", s->inherited_path);
	s->socket_path = s->inherited_path;
	s->listen_fd = fd;
	return 1;
}

/* The poller (loop.h): takes the submissions of every connection's rings, and reads the
 * hot connections' sockets (conn.h). */
static bool server_poll(void *userdata) {
	struct server *s = userdata;
	uint64_t now = s->n_hot > 0 ? now_ns() : 0;
	bool busy = false;

	/* While a round computes, its worker threads want every CPU: the loop does not spin
	 * then, and requests that come meanwhile wake it. */
	s->poller.spin_ns = evict_running(s->evictor) ? 0 : (uint64_t)s->limits.poll_us * 1000;

	/* A request may close connections (this one, or holders of a chunk it gave back), but
	 * none is freed before the sweep below, so their links stay valid. */
	for (struct conn *c = s->conns, *next; c; c = next) {
		int r;

		next = c->next;
		if (c->hot_ns)
			busy |= conn_poll(c, now) != 0;
		if (!c->ring || c->closing || c->close_when_sent)
			continue;
		r = ring_poll(c->ring);
		if (r == -EPROTO) {
			s->protocol_errors++;
			log_warning("connection %llu (pid %d): its ring's indices are corrupted, "
			            "disconnecting", (unsigned long long)c->id, (int)c->cred.pid);
			conn_close(c, NULL);
		}
		busy |= r != 0;
	}
	/* Closed connections without an operation in flight (hot ones had no receive armed)
	 * have no completion to free them: they go here, outside every handler. */
	for (struct conn *c = s->closed, *next; c; c = next) {
		next = c->closed_next;
		conn_maybe_free(c);
	}
	return busy;
}

/* Before the loop sleeps: hot connections get their receive back, every ring is told and
 * its doorbell armed; after, untold. */
static bool server_sleep(void *userdata, bool sleeping) {
	struct server *s = userdata;
	bool ok = true;

	if (sleeping)
		for (struct conn *c = s->conns, *next; c; c = next) {
			next = c->next;
			conn_cool(c);
		}
	for (struct conn *c = s->conns; c; c = c->next) {
		if (!c->ring)
			continue;
		if (sleeping)
			ok &= ring_sleep_prepare(c->ring);
		else
			ring_sleep_done(c->ring);
	}
	if (!ok)
		for (struct conn *c = s->conns; c; c = c->next)
			if (c->ring)
				ring_sleep_done(c->ring);
	return ok;
}

/* Which doorbell the rings get: --ring-doorbell, with auto resolved against the kernel. */
static int server_setup_rings(struct server *s) {
	bool futex = loop_has_futex_wait(s->loop);

	switch (s->limits.ring_doorbell) {
	case RING_BELL_FUTEX:
		if (!futex)
			return log_error_errno(-EOPNOTSUPP, "--ring-doorbell=futex: this kernel has no "
			                       "IORING_OP_FUTEX_WAIT (Linux 6.7)");
		s->ring_doorbell = KVD_RING_DOORBELL_FUTEX;
		break;
	case RING_BELL_EVENTFD:
		s->ring_doorbell = KVD_RING_DOORBELL_EVENTFD;
		break;
	default:
		s->ring_doorbell = futex ? KVD_RING_DOORBELL_FUTEX : KVD_RING_DOORBELL_EVENTFD;
	}
	return 0;
}

static int render_metrics(void *userdata, char **ret, size_t *ret_size) {
	return metrics_render(userdata, ret, ret_size);
}

/*
 * The node's bounds, derived at start from what the kernel gives the daemon, so that no
 * client can take the daemon to a limit where it fails for everyone (kvdctl included):
 *
 * - fds (RLIMIT_NOFILE, raised to the hard limit at start): a chunk's memory takes one
 *   fd, each connection CONN_FDS_OWN of the daemon's and up to CONN_FDS_QUEUED_MAX its
 *   client sent, and FDS_RESERVED go to io_uring, sockets, signals and the fd store's
 *   journal; max-connections is lowered to what is left.
 * - mappings (vm.max_map_count): an open sequence maps its descriptor and its observation
 *   buffer (SEQ_MAPPINGS), a connection its ring (CONN_MAPPINGS), a host chunk itself;
 *   MAPPINGS_RESERVED go to libraries, allocator arenas, the round threads' stacks and
 *   io_uring. What is left bounds the open sequences (max-seqs-node 0).
 * - memory: the sequences' metadata (seq.meta_bytes) may take a quarter of physical
 *   memory (max-metadata-bytes 0).
 */
#define FDS_RESERVED 64u
#define SEQ_MAPPINGS 2u
#define CONN_MAPPINGS 2u
#define MAPPINGS_RESERVED 4096u

/* Mappings the daemon has now, or 0 when that cannot be read. */
static uint64_t mappings_now(void) {
	_cleanup_(fclosep) FILE *f = fopen("/proc/self/maps", "re");
	uint64_t n = 0;
	int ch;

	while (f && (ch = fgetc(f)) != EOF)
		n += ch == '\n';
	return n;
}

static uint64_t read_sysctl(const char *path, uint64_t fallback) {
	_cleanup_(fclosep) FILE *f = fopen(path, "re");
	unsigned long long v;

	return f && fscanf(f, "%llu", &v) == 1 ? v : fallback;
}

static void derive_bounds(struct server *s) {
	uint64_t per_conn = CONN_FDS_OWN + CONN_FDS_QUEUED_MAX;
	uint64_t maps = read_sysctl("/proc/sys/vm/max_map_count", 65530);
	uint64_t taken = mappings_now() + MAPPINGS_RESERVED + (uint64_t)s->limits.max_connections *
	                 CONN_MAPPINGS + (s->pool->ops->host_access ? s->pool->n_chunks : 0);
	long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
	struct rlimit rl;

	s->conns_by_fds = UINT32_MAX;
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
		uint64_t spare = rl.rlim_cur > FDS_RESERVED + s->pool->n_chunks + per_conn ?
		                         rl.rlim_cur - FDS_RESERVED - s->pool->n_chunks : per_conn;

		s->conns_by_fds = (uint32_t)MIN(spare / per_conn, UINT32_MAX);
	}
	if (s->conns_by_fds < s->limits.max_connections)
		log_warning("the fd limit (%llu) allows %u connections besides %u chunks, below "
		            "max-connections (%u): raise LimitNOFILE= to allow more",
		            (unsigned long long)rl.rlim_cur, s->conns_by_fds, s->pool->n_chunks,
		            s->limits.max_connections);
	s->seqs_node_derived = maps > taken ? (uint32_t)MIN((maps - taken) / SEQ_MAPPINGS, UINT32_MAX) : 1;
	s->metadata_derived = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page / 4 : UINT64_C(1) << 30;
	log_info("node bounds: %u connections, %u sequences (vm.max_map_count %llu), %llu bytes of "
	         "sequence metadata (a quarter of memory), unless set lower",
	         server_conns_max(s), s->seqs_node_derived, (unsigned long long)maps,
	         (unsigned long long)s->metadata_derived);
	if (s->limits.max_seqs_node > s->seqs_node_derived)
		log_warning("max-seqs-node %u is above what vm.max_map_count (%llu) leaves for "
		            "sequences (%u): raise vm.max_map_count, or new connections may fail "
		            "once they are all open", s->limits.max_seqs_node,
		            (unsigned long long)maps, s->seqs_node_derived);
}

uint32_t server_conns_max(const struct server *s) {
	return MIN(s->limits.max_connections, s->conns_by_fds);
}

uint32_t server_seqs_max(const struct server *s) {
	return s->limits.max_seqs_node ? s->limits.max_seqs_node : s->seqs_node_derived;
}

uint64_t server_metadata_max(const struct server *s) {
	return s->limits.max_metadata_bytes ? s->limits.max_metadata_bytes : s->metadata_derived;
}

void server_seq_opened(struct server *s, struct seq *q) {
	q->tenant->sequences++;
	if (q->model->unit != KVD_UNIT_NONE)
		s->evictable_seqs++;
	s->sequences++;
	s->metadata_bytes += q->meta_bytes;
	q->used_ms = now_ms();
}

void server_seq_closed(struct server *s, struct seq *q) {
	q->tenant->sequences--;
	if (q->model->unit != KVD_UNIT_NONE)
		s->evictable_seqs--;
	s->sequences--;
	s->metadata_bytes -= q->meta_bytes;
}

int server_new_local(struct pool *pool, const struct server_limits *limits, struct server **ret) {
	struct server *s;
	int r;

	s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	s->listen_fd = s->signal_fd = -EBADF;
	s->handlers = &dispatch_handlers;
	s->pool = pool;
	s->limits = *limits;
	s->socket_path = "(in process)";
	s->start_ms = now_ms();
#if KVD_TEST_HOOKS
	s->pidfd_by_pid = getenv("KVD_TEST_PIDFD_OPEN") != NULL;
#endif
	derive_bounds(s);
	r = tenant_table_init(&s->tenants, limits->max_tenants);
	if (r < 0)
		goto fail;
	r = tier_new(limits->host_tier_bytes, pool->chunk_bytes, &s->metadata_bytes, &s->tier);
	if (r < 0)
		goto fail;
	if (limits->file_tier_bytes > 0) {
		const char *what;

		r = tier_file_add(s->tier, limits->file_tier_dir, limits->file_tier_bytes, &what);
		if (r < 0) {
			log_error_errno(r, "cannot set up the file tier in %s (%s)", limits->file_tier_dir,
			                what);
			goto fail;
		}
		if (!s->tier->file->direct)
			log_notice("file tier: the file system of %s refuses O_DIRECT: buffered I/O, "
			           "through the page cache", limits->file_tier_dir);
	}
	r = mover_new(s, &s->mover);
	if (r < 0)
		goto fail;
	/* On a GPU pool the tier's copies are DMA from and to it: pinned when the driver
	 * lets us, through its staging otherwise (slower, but the same bytes). */
	if (s->tier->base && pool->ops->host_register) {
		r = pool->ops->host_register(s->tier->base, s->tier->budget_bytes);
		if (r < 0)
			log_warning_errno(r, "the host tier (%" PRIu64 " bytes) cannot be pinned for "
			                  "the GPU: its copies go through the driver's staging",
			                  s->tier->budget_bytes);
		s->tier_pinned = r >= 0;
	}
	s->scratch = calloc(pool->n_chunks, sizeof(*s->scratch));
	if (!s->scratch) {
		r = -ENOMEM;
		goto fail;
	}
	r = evictor_new(s, &s->evictor);
	if (r < 0)
		goto fail;
	r = uploader_new(s, &s->uploader);
	if (r < 0)
		goto fail;
	r = loop_new(s->limits.uring_setup, &s->loop);
	if (r < 0) {
		log_error_errno(r, "cannot set up the event loop");
		goto fail;
	}
	log_info("event loop: %s", loop_describe(s->loop));
	r = server_setup_rings(s);
	if (r < 0)
		goto fail;
	*ret = s;
	return 0;
fail:
	server_free(s);
	return r;
}

int server_new(struct pool *pool, const struct server_limits *limits, const char *socket_path,
               int *sockets, unsigned n_sockets, struct server **ret) {
	struct server *s;
	sigset_t mask;
	int r;

	r = server_new_local(pool, limits, &s);
	if (r < 0) {
		for (unsigned i = 0; i < n_sockets; i++)
			safe_close(sockets[i]);
		return r;
	}
	s->socket_path = socket_path;
	/* The loop looks at the rings and the hot sockets between completions (loop.h). */
	s->poller = (struct loop_poller){
		.spin_ns = (uint64_t)s->limits.poll_us * 1000,
		.poll = server_poll,
		.sleep = server_sleep,
		.userdata = s,
	};
	loop_set_poller(s->loop, &s->poller);
	s->accept_op.handler = on_accept;
	s->signal_op.handler = on_signal;
	s->tick_op.handler = on_tick;
	r = sd_watchdog_enabled(0, &s->watchdog_usec);
	if (r < 0)
		log_warning_errno(r, "cannot read the service manager's watchdog settings, ignoring");
	if (r <= 0)
		s->watchdog_usec = 0;
	s->tick_ms = tick_interval(s);
	/* Before the clients' socket: a daemon that accepts connections also serves metrics. */
	if (limits->metrics_listen && *limits->metrics_listen) {
		r = http_new(s->loop, limits->metrics_listen, render_metrics, s, &s->http);
		if (r < 0) {
			log_error_errno(r, "cannot serve metrics on %s", limits->metrics_listen);
			goto fail;
		}
	}
	r = inherit_socket(s, sockets, n_sockets);
	n_sockets = 0;
	if (r < 0)
		goto fail;
	if (r == 0) {
		r = listen_socket(socket_path, limits->socket_group, &s->listen_fd);
		if (r < 0) {
			log_error_errno(r, "cannot listen on %s", socket_path);
			goto fail;
		}
		s->socket_owned = true;
	}
	sigemptyset(&mask);
	sigaddset(&mask, SIGTERM);
	sigaddset(&mask, SIGINT);
	sigaddset(&mask, SIGHUP);
	sigprocmask(SIG_BLOCK, &mask, NULL);
	s->signal_fd = signalfd(-1, &mask, SFD_CLOEXEC);
	if (s->signal_fd < 0) {
		r = log_error_errno(negative_errno(), "signalfd failed");
		goto fail;
	}
	*ret = s;
	return 0;
fail:
	for (unsigned i = 0; i < n_sockets; i++)
		safe_close(sockets[i]);
	server_free(s);
	return r;
}

struct server *server_free(struct server *s) {
	if (!s)
		return NULL;
	/* The ring goes first, so that the kernel holds no buffer of the connections. */
	s->loop = loop_free(s->loop);
	departed_end_all(s);
	s->http = http_free(s->http);
	while (s->conns)
		conn_destroy(s->conns);
	while (s->closed)
		conn_destroy(s->closed);
	idmap_done(&s->conn_ids);
	idmap_done(&s->seq_ids);
	/* A socket file the service manager made is its own: it outlives us. */
	if (s->listen_fd >= 0 && s->socket_owned)
		unlink(s->socket_path);
	safe_close(s->listen_fd);
	safe_close(s->signal_fd);
	/* After the connections: a running round holds references, not pointers, to them. */
	s->evictor = evictor_free(s->evictor);
	s->uploader = uploader_free(s->uploader);
	/* After the connections, whose sequences dropped their entries and moves. */
	s->mover = mover_free(s->mover);
	if (s->tier_pinned)
		s->pool->ops->host_unregister(s->tier->base);
	s->tier = tier_free(s->tier);
	tenant_table_done(&s->tenants);
	free(s->scratch);
	free(s);
	return NULL;
}

struct conn *server_find_conn(struct server *s, uint64_t id) {
	return idmap_get(&s->conn_ids, id);
}

struct seq *server_find_seq(struct server *s, uint64_t conn_id, uint64_t seq_id) {
	struct seq *q = idmap_get(&s->seq_ids, seq_id);

	return q && q->conn_id == conn_id ? q : NULL;
}

uint32_t server_reclaim(struct server *s, struct seq_emptied *emptied, struct conn *requester,
                        uint32_t *ret_ids) {
	uint32_t n_ids = 0, used = s->scratch_used;

	/* An unmap request that cannot be queued closes its connection, and closing frees its
	 * sequences, whose emptied chunks are reclaimed through here before this walk goes on:
	 * that list must start after this one in s->scratch, not overwrite it. Both fit: a
	 * chunk joins a list when its last block is freed, and nothing is allocated until the
	 * outermost reclaim returns, so no chunk is on two lists. */
	s->scratch_used = (uint32_t)(emptied->chunks - s->scratch) + emptied->n;
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
			 * disconnect: safe, only slow. Holders never asked are not held to
			 * unmap-timeout. */
			ch->unmap_asked_ms = 0;
			log_error("out of memory reclaiming chunk %u; it stays draining", id);
			continue;
		}
		ch->unmap_asked_ms = now_ms();
		memcpy(holders, ch->holders, n * sizeof(uint64_t));
		for (uint32_t h = 0; h < n; h++) {
			struct conn *c = server_find_conn(s, holders[h]);

			if (c == requester && ret_ids) {
				ret_ids[n_ids++] = id;
				continue;
			}
			if (!c) {
				/* A process that left without unmapping keeps its hold until it
				 * exits (departed.h). */
				if (!departed_find(s, holders[h]))
					pool_chunk_drop_holder(s->pool, ch, holders[h]);
				continue;
			}
			envelope_event_unmap(c, &id, 1);
		}
	}
	s->scratch_used = used;
	emptied->n = 0;
	return n_ids;
}

void server_stop(struct server *s) {
	if (s->stopping)
		return;
	s->stopping = true;
	s->stop_ms = now_ms();
	sd_notify(0, "STOPPING=1\nSTATUS=stopping");
	if (s->n_conns == 0) {
		loop_exit(s->loop);
		return;
	}
	for (struct conn *c = s->conns, *next; c; c = next) {
		next = c->next;
		if (envelope_event_stopping(c) < 0) {
			conn_close(c, NULL);
			continue;
		}
		c->close_when_sent = true;
		/* Sent at once, with nothing queued before it (conn_send()). */
		if (!c->tx_head)
			conn_close(c, NULL);
	}
}

int server_run(struct server *s) {
	char status[sizeof(s->notify_status) + 32];
	int r;

	r = loop_accept(s->loop, &s->accept_op, s->listen_fd);
	if (r >= 0)
		r = loop_read(s->loop, &s->signal_op, s->signal_fd, &s->siginfo, sizeof(s->siginfo));
	if (r >= 0)
		r = loop_timeout(s->loop, &s->tick_op, s->tick_ms);
	if (r >= 0 && s->http)
		r = http_start(s->http);
	if (r < 0)
		return log_error_errno(r, "cannot start the event loop");
	if (s->http && s->limits.metrics_remote)
		log_notice("serving metrics on %s, which other machines may reach (metrics-remote = "
		           "yes): no authentication, and the metrics name every tenant",
		           s->limits.metrics_listen);
	else if (s->http)
		log_info("serving metrics on %s", s->limits.metrics_listen);

	format_status(s, s->notify_status, sizeof(s->notify_status));
	snprintf(status, sizeof(status), "READY=1\nSTATUS=%s", s->notify_status);
	sd_notify(0, status);
	if (s->watchdog_usec)
		log_info("watchdog: %llu ms, pinged every %llu ms",
		         (unsigned long long)(s->watchdog_usec / 1000), (unsigned long long)s->tick_ms);
	log_info("listening on %s (backend %s, pool %llu MiB in %u chunks of %llu KiB, budget %llu MiB)",
	         s->socket_path, s->pool->ops->name, (unsigned long long)(s->pool->pool_bytes >> 20),
	         s->pool->n_chunks, (unsigned long long)(s->pool->chunk_bytes >> 10),
	         (unsigned long long)(s->pool->budget_bytes >> 20));
	if (s->limits.ring_entries > 0)
		log_info("rings of %u entries, %s doorbell, polling %u us before sleeping",
		         s->limits.ring_entries,
		         s->ring_doorbell == KVD_RING_DOORBELL_FUTEX ? "futex" : "eventfd", s->limits.poll_us);
	else
		log_info("no rings (--ring-entries=0), polling %u us before sleeping", s->limits.poll_us);
	r = loop_run(s->loop);
	if (r < 0)
		return log_error_errno(r, "event loop failed");
	log_info("stopped");
	return 0;
}
