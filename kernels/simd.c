/* SPDX-License-Identifier: MIT */
/* Run-time choice of the SIMD path (see simd.h). */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

/* F16C straight from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not
 * know the name. The wide registers themselves are checked by the avx2/avx512f tests. */
static int cpu_has_f16c(void) {
	unsigned a, b, c, d;

	return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}
#endif

static _Atomic(const struct kvd_simd_ops *) chosen, forced;

const struct kvd_simd_ops *kvd_simd_get(const char *name) {
	if (!name)
		return NULL;
#if defined(__x86_64__) || defined(__i386__)
	__builtin_cpu_init();
	/* __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0). */
	if (strcmp(name, "avx512") == 0)
		return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
				       __builtin_cpu_supports("avx512bw") &&
				       __builtin_cpu_supports("fma") && cpu_has_f16c() ?
			       &kvd_simd_avx512 :
			       NULL;
	if (strcmp(name, "avx2") == 0)
		return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
				       cpu_has_f16c() ?
			       &kvd_simd_avx2 :
			       NULL;
#endif
	if (strcmp(name, "generic") == 0)
		return &kvd_simd_generic;
	return NULL;
}

static const struct kvd_simd_ops *choose(void) {
	static const char *const order[] = { "avx512", "avx2", "generic" };
	const char *cap = getenv("KVD_SIMD");
	size_t first = 0;

	/* A cap names the widest path allowed; unknown names are ignored. */
	for (size_t i = 0; cap && i < sizeof(order) / sizeof(order[0]); i++)
		if (strcmp(cap, order[i]) == 0)
			first = i;
	for (size_t i = first; i < sizeof(order) / sizeof(order[0]); i++) {
		const struct kvd_simd_ops *o = kvd_simd_get(order[i]);

		if (o)
			return o;
	}
	return &kvd_simd_generic;
}

const struct kvd_simd_ops *kvd_simd(void) {
	const struct kvd_simd_ops *o = atomic_load_explicit(&forced, memory_order_acquire);

	if (o)
		return o;
	o = atomic_load_explicit(&chosen, memory_order_acquire);
	if (!o) {
		/* Racing first callers all compute the same answer; any store wins. */
		o = choose();
		atomic_store_explicit(&chosen, o, memory_order_release);
	}
	return o;
}

void kvd_simd_override(const struct kvd_simd_ops *ops) {
	atomic_store_explicit(&forced, ops, memory_order_release);
}
