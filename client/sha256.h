/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * SHA-256 (FIPS 180-4), for the content keys of blocks (keys.c): the scheme vLLM's prefix
 * cache uses, so that keys match what its routers compute. Plain C, no dependency.
 */

#include <stddef.h>
#include <stdint.h>

#define SHA256_BYTES 32

struct sha256 {
	uint32_t h[8];
	uint64_t bytes;               /* hashed so far */
	uint8_t buf[64];
	size_t n;                     /* bytes waiting in buf */
};

void sha256_init(struct sha256 *c);
void sha256_update(struct sha256 *c, const void *p, size_t n);
void sha256_final(struct sha256 *c, uint8_t out[SHA256_BYTES]);
