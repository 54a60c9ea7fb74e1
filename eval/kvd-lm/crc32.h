/* SPDX-License-Identifier: MIT */
#pragma once

#include <stddef.h>
#include <stdint.h>

/*
 * zlib's CRC-32 (polynomial 0xEDB88320) of p[n], continuing from crc (0 to start): the
 * checksum of every kvd-lm file (weights, tokenizer, IndexMem weights).
 */
uint32_t kvdlm_crc32(uint32_t crc, const void *p, size_t n);
