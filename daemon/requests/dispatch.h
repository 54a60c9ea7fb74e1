/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The requests: every protocol request a connection sends, on its socket or its rings, is
 * checked and answered here (the request table in dispatch.c is the one index of them),
 * and a closing connection's session state is dropped. The server installs the table
 * below as its connections' handlers (conn.h).
 */

#include <stdbool.h>

#include "conn.h"

extern const struct conn_handlers dispatch_handlers;

/* What a request needs before its handler runs. */
enum {
	REQUEST_NEEDS_TENANT = 1 << 0, /* a connection with a tenant (not an admin one) */
	REQUEST_NEEDS_ADMIN = 1 << 1,  /* root or admin-group (access.h) */
	REQUEST_TAKES_FD = 1 << 2,     /* exactly one fd travels with it */
};

/* Whether the request table serves an Envelope body (a Kvd__V1__Envelope__BodyCase) as a
 * request, and what it needs (REQUEST_*) into *ret_flags (may be NULL). */
bool dispatch_serves(int body, unsigned *ret_flags);
