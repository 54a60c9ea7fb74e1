/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <grp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "access.h"
#include "admin.h"
#include "basic/macro.h"
#include "basic/number.h"
#include "conn.h"
#include "listen.h"
#include "log.h"
#include "server.h"
#include "wire.h"

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
		max = registry_conns_max(s) + (admin ? ADMIN_CONNECTIONS_RESERVED : 0);
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
			if (s->n_conns >= registry_conns_max(s))
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

void listen_resume(struct server *s) {
	if (!s->accept_paused || s->stopping)
		return;
	s->accept_paused = false;
	if (loop_accept(s->loop, &s->accept_op, s->listen_fd) < 0)
		log_error("cannot re-arm accept; no new connections will be served");
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

static int bind_socket(const char *path, const char *group, int *ret) {
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

int listen_open(struct server *s, const char *socket_path, int *sockets, unsigned n_sockets) {
	int r;

	s->accept_op.handler = on_accept;
	r = inherit_socket(s, sockets, n_sockets);
	if (r != 0)
		return r < 0 ? r : 0;
	r = bind_socket(socket_path, s->limits.socket_group, &s->listen_fd);
	if (r < 0)
		return log_error_errno(r, "cannot listen on %s", socket_path);
	s->socket_owned = true;
	return 0;
}

int listen_start(struct server *s) {
	return loop_accept(s->loop, &s->accept_op, s->listen_fd);
}

void listen_close(struct server *s) {
	/* A socket file the service manager made is its own: it outlives us. */
	if (s->listen_fd >= 0 && s->socket_owned)
		unlink(s->socket_path);
	s->listen_fd = safe_close(s->listen_fd);
}
