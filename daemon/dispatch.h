/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The requests: every protocol request a connection sends, on its socket or its rings, is
 * checked and answered here (the request table in dispatch.c is the one index of them),
 * and a closing connection's session state is dropped. The server installs the table
 * below as its connections' handlers (conn.h).
 */

#include "conn.h"

extern const struct conn_handlers dispatch_handlers;
