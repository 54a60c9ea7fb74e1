/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Standing warnings about how the node is set up: settings that start and run, but that
 * will hurt. Recomputed after every change of the budget or the tenants (admin.h) and for
 * every status request, logged once each when they appear, and shown by status (kvdctl
 * status) while they hold:
 *   - a host pool larger than physical memory: writing chunks past it swaps, or ends in
 *     the OOM killer;
 *   - guaranteed minimums that together exceed the budget: rounds cannot honour them all;
 *   - a tenant's cap below what it holds in sequences no round can evict (models without
 *     an eviction unit): it stays above its cap until it releases them.
 */

#include <stdbool.h>
#include <stdint.h>

struct server;

/* At most this many bytes of text; more is cut with a note. */
#define WARNINGS_MAX 2048

void warnings_update(struct server *s);

/* The warnings, one per line, or NULL when there are none. */
const char *warnings_text(const struct server *s);

/* The warnings a start gives from its settings alone (a pool of pool_bytes, host memory
 * when host_pool, the budget, the tenants' minimums together), so that --check-config
 * gives them before a start: into buf, one per line; "" when none. */
void warnings_of_settings(bool host_pool, uint64_t pool_bytes, uint64_t budget_bytes,
                          uint64_t mins, char buf[WARNINGS_MAX]);
