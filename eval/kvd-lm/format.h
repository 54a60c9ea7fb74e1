/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * What the kvd-lm file formats (weights .kvdlm, tokenizer .kvdtok, IndexMem weights
 * .kvdim) share: their checksum, little-endian fields and the loaders' error messages.
 */

#include <stddef.h>
#include <stdint.h>

#include "basic/macro.h"

/* zlib's CRC-32 (polynomial 0xEDB88320) of p[n], continuing from crc (0 to start). */
uint32_t kvdlm_crc32(uint32_t crc, const void *p, size_t n);

static inline uint32_t kvdlm_le32(const uint8_t *p) {
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Formats a message into err[errlen] (err may be NULL) and returns r. */
_printf_(4, 5) int kvdlm_fail(char *err, size_t errlen, int r, const char *fmt, ...);
