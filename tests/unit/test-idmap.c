/* SPDX-License-Identifier: MIT */
/*
 * The id registry (daemon/base/idmap.h): every lookup agrees with a plain array through a long
 * random run of puts, replacements and removals (counters as ids, as the daemon makes
 * them, and ids spread wide), across growth; removal leaves no hole a probe could stop at.
 */
#include <errno.h>
#include <stdlib.h>

#include "idmap.h"
#include "test.h"

#define IDS 5000u

static void random_run(uint64_t base, uint64_t stride, uint64_t seed) {
	static void *ref[IDS];
	struct idmap m = {};
	size_t n = 0;

	for (uint32_t i = 0; i < IDS; i++)
		ref[i] = NULL;
	for (uint32_t step = 0; step < 200000; step++) {
		uint32_t i;

		seed = seed * 6364136223846793005ull + 1442695040888963407ull;
		i = (uint32_t)(seed >> 33) % IDS;
		if ((seed >> 20) % 3 != 0) {
			void *v = (void *)(uintptr_t)(seed | 1);

			ASSERT_OK(idmap_put(&m, base + i * stride, v));
			n += !ref[i];
			ref[i] = v;
		} else {
			idmap_del(&m, base + i * stride);
			n -= !!ref[i];
			ref[i] = NULL;
		}
		if (step % 997 == 0)
			for (uint32_t k = 0; k < IDS; k++)
				ASSERT_TRUE(idmap_get(&m, base + k * stride) == ref[k]);
		ASSERT_EQ(m.n, n);
	}
	for (uint32_t k = 0; k < IDS; k++)
		ASSERT_TRUE(idmap_get(&m, base + k * stride) == ref[k]);
	ASSERT_NULL(idmap_get(&m, 0));
	ASSERT_LE(2 * m.n, m.cap);
	idmap_done(&m);
}

TEST(counters) {
	random_run(1, 1, 7);
}

TEST(spread_ids) {
	random_run(UINT64_C(1) << 40, UINT64_C(0x100000001), 11);
}

TEST(empty_and_zero) {
	struct idmap m = {};

	ASSERT_NULL(idmap_get(&m, 5));
	idmap_del(&m, 5);
	ASSERT_EQ(idmap_put(&m, 0, &m), -EINVAL);
	ASSERT_OK(idmap_put(&m, 5, &m));
	ASSERT_TRUE(idmap_get(&m, 5) == &m);
	idmap_del(&m, 5);
	ASSERT_NULL(idmap_get(&m, 5));
	ASSERT_EQ(m.n, 0u);
	idmap_done(&m);
}
