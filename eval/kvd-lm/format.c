/* SPDX-License-Identifier: MIT */
/* What the kvd-lm file formats share; see format.h. */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>

#include "format.h"

/* Slicing by 8: a 100 MB model is checked in well under a second. */
static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void) {
	for (uint32_t i = 0; i < 256; i++) {
		uint32_t c = i;

		for (int k = 0; k < 8; k++)
			c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
		crc_table[0][i] = c;
	}
	for (uint32_t i = 0; i < 256; i++)
		for (int t = 1; t < 8; t++)
			crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
}

uint32_t kvdlm_crc32(uint32_t crc, const void *p, size_t n) {
	const uint8_t *b = p;

	pthread_once(&crc_once, crc_init);
	crc = ~crc;
	for (; n >= 8; n -= 8, b += 8) {
		uint32_t lo = crc ^ ((uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
		                     (uint32_t)b[3] << 24);

		crc = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff] ^
		      crc_table[5][(lo >> 16) & 0xff] ^ crc_table[4][lo >> 24] ^ crc_table[3][b[4]] ^
		      crc_table[2][b[5]] ^ crc_table[1][b[6]] ^ crc_table[0][b[7]];
	}
	while (n--)
		crc = crc_table[0][(crc ^ *b++) & 0xff] ^ (crc >> 8);
	return ~crc;
}

int kvdlm_fail(char *err, size_t errlen, int r, const char *fmt, ...) {
	va_list ap;

	if (err && errlen > 0) {
		va_start(ap, fmt);
		vsnprintf(err, errlen, fmt, ap);
		va_end(ap);
	}
	return r;
}
