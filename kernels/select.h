/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Selection: the step every eviction policy ends with. A policy turns K/V into one score
 * per item (a token of a head, a block of a layer...); these functions pick which items
 * stay or go, in O(n) expected time (radix and quick selection, never a full sort).
 *
 * The order. Every function ranks items by the same total order, so that a selection is
 * unique and the reference (*_ref, a full sort) and the optimised path return identical
 * sets, whatever the memory layout, thread count or input permutation:
 *
 *   - a higher score ranks higher (is kept first, evicted last);
 *   - NaN ranks below everything, -inf included, and all NaNs are equal. A NaN carries no
 *     information, and K/V are written by tenants: ranking NaN high would let a poisoned
 *     cache pin itself, ranking it low only hurts its owner. The odds-ratio NaN of
 *     docs/algorithms.md §1.8 (an attention sink) cannot arise with the clamped fp32 recipe;
 *   - -inf ranks below every finite score and +inf above; -0.0 equals +0.0;
 *   - equal scores rank by index: the LOWER index ranks higher, so it is kept first and
 *     evicted last. Where items come from several rows, the index is the position in the
 *     rows' concatenation (row 0 first).
 *
 * Keeping the k highest and evicting the n-k lowest are therefore exact complements.
 * Exactly k items are kept whatever the scores hold; no input makes a function fail
 * other than through the errno values listed.
 *
 * All functions are pure: no global state, no logging, thread-safe on distinct outputs.
 * Only functions taking a threads argument start threads, and they join them before
 * returning.
 */

#include <stddef.h>
#include <stdint.h>

/*
 * Per-row top-k: writes the indices of the k highest scores of scores[n] into keep[k], in
 * ascending index order. Allocates nothing (about 17 KiB of stack: a radix histogram).
 * Returns 0, or -EINVAL if k > n or a needed pointer is NULL (scores may be NULL when
 * n == 0, keep when k == 0). The reference sorts a copy and may also return -ENOMEM.
 */
int kvd_topk(const float *scores, uint32_t n, uint32_t k, uint32_t *keep);
int kvd_topk_ref(const float *scores, uint32_t n, uint32_t k, uint32_t *keep);

/*
 * Top-k over several rows ranked together: per layer, the rows of all heads (AdaKV's
 * flattened selection); globally, the normalised shares of every (sequence, layer). The
 * k highest of all lens[0] + ... + lens[n_rows-1] scores are kept, ties going to the
 * earlier row, then the lower index.
 *
 * ret_counts[r] receives how many of row r are kept. ret_keep[k] receives the kept
 * indices (within their row) grouped by row in row order, ascending within a row: row r's
 * are at ret_keep + ret_counts[0] + ... + ret_counts[r-1].
 *
 * threads: up to this many threads (0 or 1: the caller's only) share the work, split on
 * row boundaries; the result does not depend on it. The reference ignores it.
 *
 * Returns 0, -EINVAL (k larger than the total, a NULL row with a non-zero length, a
 * NULL array), or -ENOMEM.
 */
int kvd_topk_rows(const float *const *rows, const uint32_t *lens, uint32_t n_rows, uint64_t k,
		  unsigned threads, uint32_t *ret_counts, uint32_t *ret_keep);
int kvd_topk_rows_ref(const float *const *rows, const uint32_t *lens, uint32_t n_rows, uint64_t k,
		      unsigned threads, uint32_t *ret_counts, uint32_t *ret_keep);

/*
 * Greedy eviction by value per byte over units of different sizes (docs/algorithms.md §7.1):
 * units are taken in order of increasing density value/bytes until the bytes freed reach
 * the target. Density is kvd_density() below and ranks by the order above, so NaN value
 * goes first, ties go to the higher index first. The result is the greedy's, found by
 * weighted selection instead of a sort; it frees at least target bytes if the evictable
 * units hold that many, and then less than one unit more than needed.
 *
 * Never evicted: pinned units, and units of 0 bytes (they would free nothing).
 *
 * Floors. Units may be split into groups, e.g. one per (sequence, layer), each a
 * contiguous range of units: group g is units [group_start[g], group_start[g+1]), with
 * group_start[0] = 0 and group_start[n_groups] = n. A group may give up at most
 * group_max_units[g] units and group_max_bytes[g] bytes (either array may be NULL: no
 * limit). The limits apply to the group's own eviction order: the group gives up the
 * longest prefix of it that fits both, and once one of its units does not fit, none of
 * its later ones are taken (so a floor "keep at least m units" is max_units = evictable
 * - m, and a group never drops below it). This is exactly the sequential greedy that
 * skips groups which reached their limit.
 */
struct kvd_evict_in {
	uint32_t n;                      /* units */
	const float *value;              /* [n] cost of evicting the unit */
	const uint32_t *bytes;           /* [n] bytes it frees */
	const uint8_t *pinned;           /* [n] non-zero: never evicted; NULL: none */
	uint32_t n_groups;               /* 0: no groups, no limits */
	const uint32_t *group_start;     /* [n_groups + 1], non-decreasing */
	const uint32_t *group_max_units; /* [n_groups] or NULL */
	const uint64_t *group_max_bytes; /* [n_groups] or NULL */
	uint64_t target;                 /* bytes to free; 0 evicts nothing */
};

/*
 * Chooses the units to evict for in: ret_ids[n] receives their indices in ascending
 * order (what follows them is undefined: all n entries may be written), *ret_n_ids their
 * number and *ret_freed their bytes (less than in->target when the evictable units hold
 * less). Returns 0, -EINVAL (NULL pointers, bad group_start) or -ENOMEM: the optimised
 * path allocates kvd_evict_greedy_scratch_bytes(in->n) of scratch (2 bytes per unit and
 * 512 KiB) per call, the reference about 28 bytes per unit.
 */
int kvd_evict_greedy(const struct kvd_evict_in *in, uint32_t *ret_ids, uint32_t *ret_n_ids,
		     uint64_t *ret_freed);
int kvd_evict_greedy_ref(const struct kvd_evict_in *in, uint32_t *ret_ids, uint32_t *ret_n_ids,
			 uint64_t *ret_freed);

/*
 * kvd_evict_greedy in the caller's scratch, for a caller that selects round after round:
 * it keeps one buffer of kvd_evict_greedy_scratch_bytes(n) for the most units it will
 * pass, touched once so that no call pays its page faults, and nothing is allocated.
 * scratch needs no particular alignment and no initial contents, and is overwritten.
 * One scratch serves one call at a time. The result is kvd_evict_greedy's.
 *
 * Returns 0, -EINVAL as kvd_evict_greedy, or -ENOBUFS if scratch is NULL or
 * scratch_bytes is less than kvd_evict_greedy_scratch_bytes(in->n).
 */
size_t kvd_evict_greedy_scratch_bytes(uint32_t n);
int kvd_evict_greedy_buf(const struct kvd_evict_in *in, void *scratch, size_t scratch_bytes,
			 uint32_t *ret_ids, uint32_t *ret_n_ids, uint64_t *ret_freed);

/*
 * The density kvd_evict_greedy ranks by: value / bytes, computed in double and rounded
 * once to float. Rounding can make units with slightly different densities equal; they
 * then rank by index. Dividing by a power of two is exact (above the subnormal range),
 * so equal-size units of a power-of-two size rank exactly as their values do.
 */
static inline float kvd_density(float value, uint32_t bytes) {
	return (float)((double)value / (double)bytes);
}

/* The needle guard's default: the top 0.1% of a group's token scores, in parts per million. */
#define KVD_NEEDLE_PPM_DEFAULT 1000u

/*
 * Block aggregation with the needle guard (docs/algorithms.md §7.3), for one group (one
 * sequence and layer): block b covers tokens [b * block_tokens, (b + 1) * block_tokens)
 * of tok[n_tok], the last block possibly partial, and ret_blocks[b] is the sum of its
 * token scores (accumulated in double in token order, rounded once; IEEE rules, so a
 * block holding a NaN, or both infinities, is NaN and evicted first, as its NaN token
 * would be).
 *
 * ret_needle[b] (if not NULL) is set to 1 if one of the block's tokens is among the
 * ceil(needle_ppm * n_tok / 1e6) highest of the group by the order above and is not NaN,
 * else 0: the caller pins those blocks so that a sum cannot bury a single critical token.
 * needle_ppm 0 pins nothing; any n_tok > 0 with needle_ppm > 0 guards at least one token.
 *
 * Both outputs have DIV_ROUND_UP(n_tok, block_tokens) entries. Returns 0, -EINVAL
 * (block_tokens 0, needle_ppm over 1000000, NULL pointers) or, from the reference only,
 * -ENOMEM; the optimised path allocates nothing.
 */
int kvd_block_scores(const float *tok, uint32_t n_tok, uint32_t block_tokens, uint32_t needle_ppm,
		     float *ret_blocks, uint8_t *ret_needle);
int kvd_block_scores_ref(const float *tok, uint32_t n_tok, uint32_t block_tokens,
			 uint32_t needle_ppm, float *ret_blocks, uint8_t *ret_needle);
