/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The node's numbers, each written down once: the StatusReply field that carries it
 * (kvdctl status, libkvd's status keys, which read StatusReply by field name), the
 * Prometheus series that exports it, and how to read it from the server. Numbers with
 * labels (chunks by state, refusals by reason or limit) and the one in seconds are the
 * metrics module's own.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvd.pb-c.h"

struct server;

struct node_value {
	const char *status;       /* StatusReply field, or NULL: only a metric */
	const char *metric;       /* Prometheus name, or NULL: only in status */
	bool counter;             /* only ever grows (a Prometheus counter); else a gauge */
	const char *help;         /* the metric's HELP text */
	uint64_t (*read)(const struct server *s);
};

extern const struct node_value node_values[];
extern const size_t n_node_values;

/* Sets every node value that status carries in rep. */
void node_values_status(const struct server *s, Kvd__V1__StatusReply *rep);

/* Sets the optional integer field `name` of m to v. Returns 0, or -ENOENT (no such field, or
 * not an optional uint32/uint64 one). */
int message_set_u64(ProtobufCMessage *m, const char *name, uint64_t v);
