/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Who holds what: the ConnectionsRequest and SequencesRequest handlers (kvdctl connections,
 * kvdctl seqs). Each reply is one page of at most LISTING_PAGE rows, in ascending id order
 * from the request's cursor, so that any number of connections and sequences fits the
 * 64 KiB frames; the client asks for pages until one says no more follow. Root and
 * admin-group see every tenant, a tenant's connection its own tenant, others nothing.
 */

#include <stdbool.h>
#include <stdint.h>

#include "wire.h"

struct conn;
struct tenant;

#define LISTING_PAGE 256

void listing_connections(struct conn *c, uint64_t id, const Envelope *request, int fd);
void listing_sequences(struct conn *c, uint64_t id, const Envelope *request, int fd);

/* Whether c may see (and act on) what tenant t holds: the administrators, and t's own;
 * t NULL (an administrative connection): the administrators only. */
bool listing_may_see(const struct conn *c, const struct tenant *t);
