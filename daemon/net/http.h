/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The metrics endpoint: just enough HTTP/1.x, on the daemon's one loop, for Prometheus to
 * scrape. Every connection carries one exchange: read one request, write one response
 * (always "Connection: close"), then wait for the peer to hang up, so that unread bytes of
 * its request never turn our close into a reset that eats the response.
 *
 * Only GET /metrics is served (404 for other paths, 405 for other methods). Bounded: at most
 * HTTP_MAX_CONNECTIONS connections at once (more are answered 503 and closed at once), a
 * request of at most HTTP_REQUEST_MAX bytes (431 past it), and one deadline per connection,
 * counted from accept and enforced by http_tick(), for the whole exchange.
 *
 * It listens on loopback or a Unix socket unless the operator opts in (metrics-remote =
 * yes, checked by settings.c): the text names every tenant and there is no authentication.
 */

#include <netinet/in.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "loop.h"

#define HTTP_MAX_CONNECTIONS 8
#define HTTP_REQUEST_MAX 8192

struct http;

struct http_address {
	union {
		struct sockaddr sa;
		struct sockaddr_in in;
		struct sockaddr_in6 in6;
		struct sockaddr_un un;
	};
	socklen_t len;
	bool local;                   /* loopback (127.0.0.0/8, ::1) or a Unix socket */
};

/*
 * Parses a listen address: "IPV4:PORT", "[IPV6]:PORT" (numeric) or "unix:/path". Returns 0,
 * or -EINVAL with *ret_why (a static string) saying what is wrong. ret->local says whether
 * only this machine can reach it.
 */
int http_address_parse(const char *s, struct http_address *ret, const char **ret_why);
/* The same check for a setting's value, where "" means off: 0, or -EINVAL and *ret_why. */
int http_address_check(const char *value, const char **ret_why);

/* Renders the body of GET /metrics: 0 and a malloc'ed text, or a negative errno (500). */
typedef int (*http_render_t)(void *userdata, char **ret, size_t *ret_size);

/*
 * Listens on address (see http_address_parse; a stale Unix socket file is replaced, a live
 * one is not). Nothing is submitted before http_start(). Returns 0, or -EINVAL (bad
 * address), -EADDRINUSE, -ENOMEM, or the error of socket(), bind() or listen().
 */
int http_new(struct loop *l, const char *address, http_render_t render, void *userdata,
             struct http **ret);
/* Starts accepting. Returns 0 or -EBUSY (the submission queue is full). */
int http_start(struct http *h);
/* Closes the connections open for timeout_ms or more; call it from a periodic timer. The
 * timeout is passed each time, so that a reloaded setting applies at once. */
void http_tick(struct http *h, uint64_t now_ms, uint64_t timeout_ms);
/* Closes everything; only once the loop is gone, when no operation can complete any more. */
struct http *http_free(struct http *h);
