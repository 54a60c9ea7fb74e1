/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The K/V digest that the daemon and libkvd both compute over a sequence, so that each side
 * can prove it sees the same bytes (kvd_seq_digest). 64-bit FNV-1a over 8-byte little-endian
 * words; a tail shorter than 8 bytes is zero-padded. Rows are always multiples of 2 bytes,
 * so the tail rule only matters for odd head dimensions in f16/bf16.
 */

#include <stdint.h>
#include <string.h>

#define DIGEST_INIT UINT64_C(0xcbf29ce484222325)

static inline uint64_t digest_update(uint64_t h, const void *data, size_t n) {
	const unsigned char *p = data;
	uint64_t w;

	for (; n >= 8; n -= 8, p += 8) {
		memcpy(&w, p, 8);
		h = (h ^ w) * UINT64_C(0x100000001b3);
	}
	if (n > 0) {
		w = 0;
		memcpy(&w, p, n);
		h = (h ^ w) * UINT64_C(0x100000001b3);
	}
	return h;
}
