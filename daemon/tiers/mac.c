/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <string.h>
#include <sys/random.h>

#include "mac.h"

#define ROTL(x, b) (((x) << (b)) | ((x) >> (64 - (b))))

/* One SipRound on v0..v3: scalars, or vectors of a lane each. */
#define SIPROUND(v0, v1, v2, v3)                                                           \
	do {                                                                               \
		v0 += v1;                                                                  \
		v1 = ROTL(v1, 13);                                                         \
		v1 ^= v0;                                                                  \
		v0 = ROTL(v0, 32);                                                         \
		v2 += v3;                                                                  \
		v3 = ROTL(v3, 16);                                                         \
		v3 ^= v2;                                                                  \
		v0 += v3;                                                                  \
		v3 = ROTL(v3, 21);                                                         \
		v3 ^= v0;                                                                  \
		v2 += v1;                                                                  \
		v1 = ROTL(v1, 17);                                                         \
		v1 ^= v2;                                                                  \
		v2 = ROTL(v2, 32);                                                         \
	} while (0)

/* One message block m through the state, and the finish after the last block. */
#define SIPBLOCK(v0, v1, v2, v3, m)                                                        \
	do {                                                                               \
		v3 ^= (m);                                                                 \
		SIPROUND(v0, v1, v2, v3);                                                  \
		SIPROUND(v0, v1, v2, v3);                                                  \
		v0 ^= (m);                                                                 \
	} while (0)
#define SIPFINISH(v0, v1, v2, v3)                                                          \
	do {                                                                               \
		v2 ^= 0xff;                                                                \
		for (int r_ = 0; r_ < 4; r_++)                                             \
			SIPROUND(v0, v1, v2, v3);                                          \
	} while (0)

#define C0 UINT64_C(0x736f6d6570736575)
#define C1 UINT64_C(0x646f72616e646f6d)
#define C2 UINT64_C(0x6c7967656e657261)
#define C3 UINT64_C(0x7465646279746573)

/* Little-endian, as SipHash reads its input (the machines kvd runs on are). */
static uint64_t load64(const unsigned char *p) {
	uint64_t m;

	memcpy(&m, p, 8);
	return m;
}

uint64_t siphash24(uint64_t k0, uint64_t k1, const void *data, size_t n) {
	const unsigned char *p = data;
	uint64_t v0 = k0 ^ C0, v1 = k1 ^ C1, v2 = k0 ^ C2, v3 = k1 ^ C3;
	uint64_t last = (uint64_t)n << 56;
	size_t i = 0;

	for (; i + 8 <= n; i += 8)
		SIPBLOCK(v0, v1, v2, v3, load64(p + i));
	for (size_t j = 0; i + j < n; j++)
		last |= (uint64_t)p[i + j] << (8 * j);
	SIPBLOCK(v0, v1, v2, v3, last);
	SIPFINISH(v0, v1, v2, v3);
	return v0 ^ v1 ^ v2 ^ v3;
}

void mac_key_set(struct mac_key *k, uint64_t k0, uint64_t k1) {
	k->k[0] = k0;
	k->k[1] = k1;
	for (uint64_t i = 0; i < MAC_LANES; i++)
		for (uint64_t j = 0; j < 2; j++) {
			uint64_t x = 2 * i + j;

			k->lane[i][j] = siphash24(k0, k1, &x, sizeof(x));
		}
}

int mac_key_new(struct mac_key *k) {
	uint64_t b[2];
	size_t got = 0;

	while (got < sizeof(b)) {
		ssize_t n = getrandom((char *)b + got, sizeof(b) - got, 0);

		if (n < 0 && errno != EINTR)
			return -errno;
		if (n > 0)
			got += (size_t)n;
	}
	mac_key_set(k, b[0], b[1]);
	return 0;
}

typedef uint64_t u64x4 __attribute__((vector_size(32)));

/* The four lanes' SipHash-2-4 tags of the groups whole 32-byte groups at p. With AVX2 where
 * the CPU has it (a lane per 64-bit element), else as two SSE2 halves: the same tags. */
__attribute__((target_clones("avx2", "default")))
static void lanes(const struct mac_key *k, const unsigned char *p, size_t groups,
                  uint64_t tags[static MAC_LANES]) {
	u64x4 k0 = { k->lane[0][0], k->lane[1][0], k->lane[2][0], k->lane[3][0] };
	u64x4 k1 = { k->lane[0][1], k->lane[1][1], k->lane[2][1], k->lane[3][1] };
	u64x4 v0 = k0 ^ C0, v1 = k1 ^ C1, v2 = k0 ^ C2, v3 = k1 ^ C3, m;

	for (size_t g = 0; g < groups; g++) {
		memcpy(&m, p + 32 * g, 32);
		SIPBLOCK(v0, v1, v2, v3, m);
	}
	/* Each lane's message is groups words long: its last block is the length alone. */
	m = (u64x4){ 0, 0, 0, 0 } + ((uint64_t)(8 * groups) << 56);
	SIPBLOCK(v0, v1, v2, v3, m);
	SIPFINISH(v0, v1, v2, v3);
	v0 ^= v1 ^ v2 ^ v3;
	memcpy(tags, &v0, 32);
}

uint64_t mac_sum(const struct mac_key *k, const void *data, size_t n) {
	const unsigned char *p = data;
	size_t groups = n / 32, tail = n % 32;
	uint64_t last[MAC_LANES + 4 + 1];

	lanes(k, p, groups, last);
	memcpy(last + MAC_LANES, p + 32 * groups, tail);
	memcpy((unsigned char *)(last + MAC_LANES) + tail, &(uint64_t){ n }, 8);
	return siphash24(k->k[0], k->k[1], last, 8 * MAC_LANES + tail + 8);
}
