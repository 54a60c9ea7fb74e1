/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * A keyed MAC for K/V that leaves kvd's memory (the file tier's segments at rest), under a
 * key drawn from the kernel's random source when the daemon starts and never written
 * anywhere: whoever can write the file cannot make a segment whose MAC kvd would accept
 * without it (a 64-bit tag: a forgery succeeds with probability 2^-64 per try, and every
 * failed try loses the sequence it aimed at).
 *
 * The MAC is SipHash-2-4 (Aumasson and Bernstein), made as fast as the disk: the whole
 * 32-byte groups of the message are cut into four lanes (the i-th 8-byte word of a group
 * goes to lane i), each lane's words are SipHash-2-4'ed under a key of its own (derived
 * from the key with SipHash), four lanes at a time in one vector loop, and the four lane
 * tags, the tail (the last n % 32 bytes) and n are SipHash-2-4'ed under the key: the lanes
 * run side by side, about twice as fast as one SipHash over the whole (docs/tiers.md says
 * what it costs the file tier).
 */

#include <stddef.h>
#include <stdint.h>

#define MAC_LANES 4

struct mac_key {
	uint64_t k[2];
	uint64_t lane[MAC_LANES][2];  /* lane i's key: SipHash-2-4 of (2i) and (2i + 1) */
};

/* A fresh random key. Returns 0, or -errno from getrandom(2). */
int mac_key_new(struct mac_key *k);
/* The key k0, k1 and its lane keys. */
void mac_key_set(struct mac_key *k, uint64_t k0, uint64_t k1);

/* The MAC of the n bytes at p. */
uint64_t mac_sum(const struct mac_key *k, const void *p, size_t n);

/* SipHash-2-4 of the n bytes at p under the key k0, k1 (the building block). */
uint64_t siphash24(uint64_t k0, uint64_t k1, const void *p, size_t n);
