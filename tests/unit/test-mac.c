/* SPDX-License-Identifier: MIT */
/*
 * The file tier's MAC (daemon/tiers/mac.h): SipHash-2-4 as its authors published it (the
 * reference vectors of their reference code, key 00..0f, messages 00, 01, ... of every
 * length up to 15); the four-lane MAC equal to its definition computed one lane at a time
 * with that SipHash, for lengths around the 32-byte groups; a different key gives a
 * different tag, and any one-bit change is seen.
 */
#include <stdlib.h>
#include <string.h>

#include "mac.h"
#include "test.h"

#define K0 UINT64_C(0x0706050403020100)
#define K1 UINT64_C(0x0f0e0d0c0b0a0908)

TEST(reference_vectors) {
	/* The reference code's vectors_sip64[0..15], as little-endian words. */
	static const uint64_t want[16] = {
		UINT64_C(0x726fdb47dd0e0e31), UINT64_C(0x74f839c593dc67fd),
		UINT64_C(0x0d6c8009d9a94f5a), UINT64_C(0x85676696d7fb7e2d),
		UINT64_C(0xcf2794e0277187b7), UINT64_C(0x18765564cd99a68d),
		UINT64_C(0xcbc9466e58fee3ce), UINT64_C(0xab0200f58b01d137),
		UINT64_C(0x93f5f5799a932462), UINT64_C(0x9e0082df0ba9e4b0),
		UINT64_C(0x7a5dbbc594ddb9f3), UINT64_C(0xf4b32f46226bada7),
		UINT64_C(0x751e8fbc860ee5fb), UINT64_C(0x14ea5627c0843d90),
		UINT64_C(0xf723ca908e7af2ee), UINT64_C(0xa129ca6149be45e5),
	};
	unsigned char m[16];

	for (unsigned i = 0; i < 16; i++)
		m[i] = (unsigned char)i;
	for (unsigned n = 0; n < 16; n++)
		ASSERT_EQ(siphash24(K0, K1, m, n), want[n]);
}

/* mac_sum as mac.h defines it, one lane at a time. */
static uint64_t mac_by_definition(const struct mac_key *k, const unsigned char *p, size_t n) {
	size_t groups = n / 32, tail = n % 32;
	uint64_t *words = malloc((groups + 1) * 8), last[MAC_LANES + 5];

	ASSERT_NOT_NULL(words);
	for (unsigned l = 0; l < MAC_LANES; l++) {
		for (size_t g = 0; g < groups; g++)
			memcpy(&words[g], p + 32 * g + 8 * l, 8);
		last[l] = siphash24(k->lane[l][0], k->lane[l][1], words, 8 * groups);
	}
	free(words);
	memcpy(last + MAC_LANES, p + 32 * groups, tail);
	memcpy((unsigned char *)(last + MAC_LANES) + tail, &(uint64_t){ n }, 8);
	return siphash24(k->k[0], k->k[1], last, 8 * MAC_LANES + tail + 8);
}

TEST(lanes_as_defined) {
	static const size_t sizes[] = { 0, 1, 31, 32, 33, 63, 64, 100, 4096, 65536 + 7 };
	unsigned char *buf = malloc(65536 + 7);
	struct mac_key k;

	ASSERT_NOT_NULL(buf);
	for (size_t i = 0; i < 65536 + 7; i++)
		buf[i] = (unsigned char)(i * 131 + 7);
	mac_key_set(&k, K0, K1);
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
		ASSERT_EQ(mac_sum(&k, buf, sizes[i]), mac_by_definition(&k, buf, sizes[i]));
	/* The lane keys are the key's: another key, other lanes. */
	ASSERT_EQ(k.lane[0][0], siphash24(K0, K1, &(uint64_t){ 0 }, 8));
	ASSERT_EQ(k.lane[3][1], siphash24(K0, K1, &(uint64_t){ 7 }, 8));
	free(buf);
}

TEST(keys_and_bits) {
	struct mac_key a, b;
	unsigned char *buf = calloc(1, 4096);
	uint64_t tag;

	ASSERT_NOT_NULL(buf);
	ASSERT_OK(mac_key_new(&a));
	ASSERT_OK(mac_key_new(&b));
	ASSERT_TRUE(a.k[0] != b.k[0] || a.k[1] != b.k[1]);
	tag = mac_sum(&a, buf, 4096);
	ASSERT_TRUE(tag != mac_sum(&b, buf, 4096));
	for (unsigned bit = 0; bit < 4096 * 8; bit += 61) {
		buf[bit / 8] ^= (unsigned char)(1u << (bit % 8));
		ASSERT_TRUE(mac_sum(&a, buf, 4096) != tag);
		buf[bit / 8] ^= (unsigned char)(1u << (bit % 8));
	}
	ASSERT_EQ(mac_sum(&a, buf, 4096), tag);
	/* Moving bytes between lanes is seen too (a lane's words swapped with another's). */
	buf[0] = 1;
	tag = mac_sum(&a, buf, 4096);
	buf[0] = 0;
	buf[8] = 1;
	ASSERT_TRUE(mac_sum(&a, buf, 4096) != tag);
	free(buf);
}
