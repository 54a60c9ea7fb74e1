/* SPDX-License-Identifier: MIT */
#include <arpa/inet.h>
#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "basic/macro.h"
#include "basic/number.h"
#include "http.h"
#include "log.h"
#include "basic/time-util.h"

#define CONTENT_TYPE_METRICS "text/plain; version=0.0.4; charset=utf-8"
#define CONTENT_TYPE_TEXT "text/plain; charset=utf-8"

enum http_state {
	HTTP_READING,                 /* the request, until its blank line */
	HTTP_WRITING,                 /* the response */
	HTTP_DRAINING,                /* response sent: reading until the peer hangs up */
};

struct http_conn {
	struct http *http;
	struct http_conn *next, *prev;
	int fd;
	uint64_t accepted_ms;
	enum http_state state;
	/* One operation at a time: a receive, or a send. */
	struct loop_op op;
	bool busy;
	bool closing;

	char *response;
	size_t response_size, response_off;
	size_t request_size;
	char request[HTTP_REQUEST_MAX];
};

struct http {
	struct loop *loop;
	int listen_fd;
	struct loop_op accept_op;
	char *unix_path;              /* bound by us, unlinked by http_free() */
	http_render_t render;
	void *userdata;

	/* Closing ones included, until their last operation completes. */
	struct http_conn *conns;
	unsigned n_conns;
};

int http_address_parse(const char *s, struct http_address *ret, const char **ret_why) {
	static const char *const usage = "expected 127.0.0.1:PORT, [::1]:PORT or unix:/PATH (another "
	                                 "address with metrics-remote = yes)";
	struct http_address a = {};
	char host[INET6_ADDRSTRLEN];
	const char *port, *end;
	bool bracketed;
	uint32_t n;

	if (!s || !*s) {
		*ret_why = usage;
		return -EINVAL;
	}
	if (strncmp(s, "unix:", 5) == 0) {
		const char *path = s + 5;

		if (!*path) {
			*ret_why = "unix: needs a socket path";
			return -EINVAL;
		}
		if (strlen(path) >= sizeof(a.un.sun_path)) {
			*ret_why = "the unix socket path is too long";
			return -EINVAL;
		}
		a.un.sun_family = AF_UNIX;
		strcpy(a.un.sun_path, path);
		a.len = sizeof(a.un);
		a.local = true;
		*ret = a;
		return 0;
	}

	bracketed = s[0] == '[';
	if (bracketed) {
		end = strchr(s, ']');
		if (!end || end[1] != ':') {
			*ret_why = usage;
			return -EINVAL;
		}
		port = end + 2;
		s++;
	} else {
		end = strrchr(s, ':');
		if (!end) {
			*ret_why = usage;
			return -EINVAL;
		}
		port = end + 1;
	}
	if ((size_t)(end - s) >= sizeof(host)) {
		*ret_why = usage;
		return -EINVAL;
	}
	memcpy(host, s, end - s);
	host[end - s] = '\0';

	if (number_parse_u32(port, 1, 65535, &n) < 0) {
		*ret_why = "the port must be 1..65535";
		return -EINVAL;
	}
	if (!bracketed && inet_pton(AF_INET, host, &a.in.sin_addr) == 1) {
		a.local = (ntohl(a.in.sin_addr.s_addr) >> 24) == 127;
		a.in.sin_family = AF_INET;
		a.in.sin_port = htons(n);
		a.len = sizeof(a.in);
	} else if (bracketed && inet_pton(AF_INET6, host, &a.in6.sin6_addr) == 1) {
		a.local = IN6_IS_ADDR_LOOPBACK(&a.in6.sin6_addr);
		a.in6.sin6_family = AF_INET6;
		a.in6.sin6_port = htons(n);
		a.len = sizeof(a.in6);
	} else {
		*ret_why = "not a numeric address (127.0.0.1:PORT, [::1]:PORT or unix:/PATH)";
		return -EINVAL;
	}
	*ret = a;
	return 0;
}

int http_address_check(const char *value, const char **ret_why) {
	struct http_address a;

	if (value && !*value)
		return 0;
	return http_address_parse(value, &a, ret_why);
}

static void conn_free(struct http_conn *c) {
	struct http *h = c->http;

	if (c->prev)
		c->prev->next = c->next;
	else
		h->conns = c->next;
	if (c->next)
		c->next->prev = c->prev;
	h->n_conns--;
	safe_close(c->fd);
	free(c->response);
	free(c);
}

/* Frees at once when no operation refers to c; else makes the one in flight complete. */
static void conn_close(struct http_conn *c) {
	if (!c->busy) {
		conn_free(c);
		return;
	}
	if (!c->closing) {
		c->closing = true;
		shutdown(c->fd, SHUT_RDWR);
	}
}

static int conn_arm_recv(struct http_conn *c) {
	int r;

	/* While draining, what arrives is thrown away: read it over the start of the buffer. */
	if (c->state == HTTP_DRAINING)
		r = loop_recv(c->http->loop, &c->op, c->fd, c->request, sizeof(c->request));
	else
		r = loop_recv(c->http->loop, &c->op, c->fd, c->request + c->request_size,
		              sizeof(c->request) - c->request_size);
	if (r < 0)
		return r;
	c->busy = true;
	return 0;
}

static int conn_arm_send(struct http_conn *c) {
	int r;

	r = loop_send(c->http->loop, &c->op, c->fd, c->response + c->response_off,
	              c->response_size - c->response_off);
	if (r < 0)
		return r;
	c->busy = true;
	return 0;
}

/* Queues one response; body may be NULL for an empty one. */
static int conn_respond(struct http_conn *c, int code, const char *reason, const char *extra,
                        const char *content_type, const char *body, size_t body_size) {
	char head[512];
	int n;

	n = snprintf(head, sizeof(head),
	             "HTTP/1.1 %d %s\r\n"
	             "Content-Type: %s\r\n"
	             "Content-Length: %zu\r\n"
	             "%s"
	             "Connection: close\r\n"
	             "\r\n",
	             code, reason, content_type, body_size, extra ? extra : "");
	if (n < 0 || (size_t)n >= sizeof(head))
		return -EINVAL;
	c->response = malloc(n + body_size);
	if (!c->response)
		return -ENOMEM;
	memcpy(c->response, head, n);
	if (body_size > 0)
		memcpy(c->response + n, body, body_size);
	c->response_size = n + body_size;
	c->response_off = 0;
	c->state = HTTP_WRITING;
	return conn_arm_send(c);
}

static int conn_respond_text(struct http_conn *c, int code, const char *reason, const char *extra) {
	char body[64];
	int n = snprintf(body, sizeof(body), "%d %s\n", code, reason);

	return conn_respond(c, code, reason, extra, CONTENT_TYPE_TEXT, body, n);
}

/* Answers a complete request: the request line decides everything, headers are ignored. */
static int conn_handle(struct http_conn *c) {
	char *line = c->request, *eol, *method, *target, *version, *query;
	_cleanup_(freep) char *body = NULL;
	size_t size;
	int r;

	eol = memchr(line, '\n', c->request_size);
	if (!eol)
		return conn_respond_text(c, 400, "Bad Request", NULL);
	*eol = '\0';
	if (eol > line && eol[-1] == '\r')
		eol[-1] = '\0';

	/* method SP request-target SP HTTP-version, single spaces (RFC 9112 3). */
	method = line;
	target = strchr(method, ' ');
	if (!target)
		return conn_respond_text(c, 400, "Bad Request", NULL);
	*target++ = '\0';
	version = strchr(target, ' ');
	if (!version)
		return conn_respond_text(c, 400, "Bad Request", NULL);
	*version++ = '\0';
	if (!*method || !*target)
		return conn_respond_text(c, 400, "Bad Request", NULL);
	if (strncmp(version, "HTTP/", 5) != 0 || strchr(version, ' '))
		return conn_respond_text(c, 400, "Bad Request", NULL);
	if (strcmp(version, "HTTP/1.0") != 0 && strcmp(version, "HTTP/1.1") != 0)
		return conn_respond_text(c, 505, "HTTP Version Not Supported", NULL);
	if (strcmp(method, "GET") != 0)
		return conn_respond_text(c, 405, "Method Not Allowed", "Allow: GET\r\n");
	query = strchr(target, '?');
	if (query)
		*query = '\0';
	if (strcmp(target, "/metrics") != 0)
		return conn_respond_text(c, 404, "Not Found", NULL);

	r = c->http->render(c->http->userdata, &body, &size);
	if (r < 0) {
		log_warning_errno(r, "rendering the metrics failed");
		return conn_respond_text(c, 500, "Internal Server Error", NULL);
	}
	return conn_respond(c, 200, "OK", NULL, CONTENT_TYPE_METRICS, body, size);
}

static void on_conn_op(struct loop_op *op, int res, bool more) {
	struct http_conn *c = container_of(op, struct http_conn, op);
	int r = 0;

	c->busy = false;
	if (c->closing || res <= 0) {
		/* Closed by us, a peer that hung up or failed, or the end of draining. */
		conn_free(c);
		return;
	}
	switch (c->state) {
	case HTTP_READING:
		c->request_size += res;
		if (memmem(c->request, c->request_size, "\r\n\r\n", 4) ||
		    memmem(c->request, c->request_size, "\n\n", 2))
			r = conn_handle(c);
		else if (c->request_size == sizeof(c->request))
			r = conn_respond_text(c, 431, "Request Header Fields Too Large", NULL);
		else
			r = conn_arm_recv(c);
		break;
	case HTTP_WRITING:
		c->response_off += res;
		if (c->response_off < c->response_size) {
			r = conn_arm_send(c);
			break;
		}
		/* Our FIN tells the peer the response is complete; it hangs up in turn. */
		shutdown(c->fd, SHUT_WR);
		c->state = HTTP_DRAINING;
		r = conn_arm_recv(c);
		break;
	case HTTP_DRAINING:
		r = conn_arm_recv(c);
		break;
	}
	if (r < 0) {
		log_debug("metrics connection: %s, closing", strerror(-r));
		conn_close(c);
	}
}

/* Tells a connection over the limit why, without waiting on it: the socket is new and its
 * buffer empty, so the few bytes go out at once or not at all. */
static void refuse(int fd) {
	static const char busy[] = "HTTP/1.1 503 Service Unavailable\r\n"
	                           "Content-Type: " CONTENT_TYPE_TEXT "\r\n"
	                           "Content-Length: 24\r\n"
	                           "Connection: close\r\n"
	                           "\r\n"
	                           "503 Service Unavailable\n";

	(void)!send(fd, busy, sizeof(busy) - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
	safe_close(fd);
}

static void on_accept(struct loop_op *op, int res, bool more) {
	struct http *h = container_of(op, struct http, accept_op);
	struct http_conn *c;

	if (res >= 0) {
		if (h->n_conns >= HTTP_MAX_CONNECTIONS) {
			log_warning("metrics: refusing a connection, %u already open", h->n_conns);
			refuse(res);
		} else if (!(c = calloc(1, sizeof(*c)))) {
			log_warning("metrics: out of memory for a connection, ignoring");
			safe_close(res);
		} else {
			c->http = h;
			c->fd = res;
			c->accepted_ms = now_ms();
			c->op.handler = on_conn_op;
			c->next = h->conns;
			if (h->conns)
				h->conns->prev = c;
			h->conns = c;
			h->n_conns++;
			if (conn_arm_recv(c) < 0)
				conn_free(c);
		}
	} else if (res != -EINTR && res != -ECONNABORTED) {
		log_warning_errno(res, "metrics: accept failed");
	}
	/* Multishot accept stops on errors and overflow; start it again. */
	if (!more && http_start(h) < 0)
		log_error("metrics: cannot re-arm accept; no more scrapes will be served");
}

static int listen_unix(struct http *h, const struct http_address *a) {
	_cleanup_(closep) int fd = -EBADF, probe = -EBADF;
	mode_t old;
	int r;

	/* As for the main socket: a file left by a daemon that died is replaced, a live one
	 * is not taken over. */
	probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (probe < 0)
		return negative_errno();
	if (connect(probe, &a->sa, a->len) == 0)
		return -EADDRINUSE;
	if (errno == ECONNREFUSED)
		unlink(a->un.sun_path);

	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0)
		return negative_errno();
	/* Owner and group, as the main socket: the text names every tenant. */
	old = umask(0117);
	r = bind(fd, &a->sa, a->len);
	umask(old);
	if (r < 0)
		return negative_errno();
	h->unix_path = strdup(a->un.sun_path);
	if (!h->unix_path) {
		unlink(a->un.sun_path);
		return -ENOMEM;
	}
	if (listen(fd, SOMAXCONN) < 0)
		return negative_errno();
	h->listen_fd = TAKE_FD(fd);
	return 0;
}

static int listen_inet(struct http *h, const struct http_address *a) {
	_cleanup_(closep) int fd = -EBADF;
	int one = 1;

	fd = socket(a->sa.sa_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0)
		return negative_errno();
	/* A restart must not wait for the last scrape's TIME_WAIT to expire. */
	if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) < 0)
		return negative_errno();
	if (bind(fd, &a->sa, a->len) < 0)
		return negative_errno();
	if (listen(fd, SOMAXCONN) < 0)
		return negative_errno();
	h->listen_fd = TAKE_FD(fd);
	return 0;
}

int http_new(struct loop *l, const char *address, http_render_t render, void *userdata,
             struct http **ret) {
	struct http_address a;
	const char *why;
	struct http *h;
	int r;

	r = http_address_parse(address, &a, &why);
	if (r < 0)
		return r;
	h = calloc(1, sizeof(*h));
	if (!h)
		return -ENOMEM;
	h->loop = l;
	h->listen_fd = -EBADF;
	h->accept_op.handler = on_accept;
	h->render = render;
	h->userdata = userdata;
	r = a.sa.sa_family == AF_UNIX ? listen_unix(h, &a) : listen_inet(h, &a);
	if (r < 0) {
		http_free(h);
		return r;
	}
	*ret = h;
	return 0;
}

int http_start(struct http *h) {
	return loop_accept(h->loop, &h->accept_op, h->listen_fd);
}

void http_tick(struct http *h, uint64_t now_ms, uint64_t timeout_ms) {
	for (struct http_conn *c = h->conns, *next; c; c = next) {
		next = c->next;
		if (!c->closing && now_ms - c->accepted_ms >= timeout_ms) {
			log_debug("metrics: connection open for %llu ms, closing",
			          (unsigned long long)(now_ms - c->accepted_ms));
			conn_close(c);
		}
	}
}

struct http *http_free(struct http *h) {
	if (!h)
		return NULL;
	while (h->conns)
		conn_free(h->conns);
	safe_close(h->listen_fd);
	if (h->unix_path)
		unlink(h->unix_path);
	free(h->unix_path);
	free(h);
	return NULL;
}
