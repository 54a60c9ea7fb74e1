/* SPDX-License-Identifier: MIT */
/*
 * The optimised selections. Scores become order keys: unsigned integers that compare as
 * select.h's order does (NaN lowest, -0.0 == +0.0), so every selection is a radix or
 * quick selection on integers, free of floating-point comparisons.
 *
 * Top-k on float rows is a radix selection on the key from the top digit down (11, 11 and
 * 10 bits): each pass histograms the items still at the cut, which narrows the cut to one
 * bin, until that bin holds exactly as many items as are still wanted or the key is
 * resolved. Items equal at the cut are then taken in scan order, which is the index order
 * of the tie rule. The passes re-read the scores instead of copying candidates, so that
 * nothing is allocated: a per-head row is small and stays in cache between passes.
 *
 * Greedy eviction is a weighted radix selection (weights = bytes) on 64-bit composites
 * (key << 32 | ~index), distinct for distinct units, so that the answer is one unit: a
 * histogram of bytes on the top 16 bits of the key finds the bucket of the last unit to
 * go, and only that bucket's units, and those of the groups whose limits bind, are
 * looked at more closely (see the section below).
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "select.h"
#include "simd.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
/* The eviction passes also come in AVX-512, taken when kvd_simd() chose that path; the
 * attribute compiles only these functions for it (gcc and clang alike). */
#define EVICT_AVX512 1
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#endif

/* ---- The order key ---- */

static inline uint32_t score_key(float f) {
	uint32_t u;

	memcpy(&u, &f, sizeof(u));
	if ((u & 0x7fffffffu) > 0x7f800000u)
		return 0; /* NaN, whatever its sign and payload */
	if (u == 0x80000000u)
		u = 0; /* -0.0 ties with +0.0 */
	/* Negative floats order backwards as integers: flip them; lift the positives. */
	return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

/* ---- Top-k on rows ---- */

#define RADIX_LEVELS 3
#define RADIX_BINS 2048
static const unsigned radix_shift[RADIX_LEVELS] = { 21, 10, 0 };
static const unsigned radix_bits[RADIX_LEVELS] = { 11, 11, 10 };

/* Rows below this many scores per thread are not worth a thread. */
#define ROWS_PER_THREAD_MIN (1u << 16)

/*
 * One thread's share of a row selection: rows [r0, r1). The passes fill hist; the cut
 * tells, per item, whether it is above the cut (kept), at it (kept while quota lasts, in
 * scan order) or below (dropped).
 */
struct rows_job {
	const float *const *rows;
	const uint32_t *lens;
	uint32_t r0, r1;
	unsigned level;          /* the pass: radix_shift[level] is its digit */
	uint32_t prefix;         /* level > 0: the key's digits above this level */
	uint64_t above, at;      /* items of these rows above the cut, at the cut */
	uint64_t quota;          /* at-the-cut items this share keeps */
	unsigned cut_shift;      /* the cut: key >> cut_shift compared with cut_prefix */
	uint32_t cut_prefix;
	uint32_t *keep, *counts; /* output: this share's first kept index, its rows' counts */
	uint8_t *needle;         /* kvd_block_scores: mark blocks instead of writing indices */
	uint32_t block_tokens;
	uint64_t hist[RADIX_BINS];
};

static void *rows_hist(void *p) {
	struct rows_job *j = p;
	unsigned shift = radix_shift[j->level], mask = (1u << radix_bits[j->level]) - 1;

	memset(j->hist, 0, sizeof(j->hist));
	for (uint32_t r = j->r0; r < j->r1; r++) {
		const float *s = j->rows[r];
		uint32_t n = j->lens[r];

		if (j->level == 0) {
			for (uint32_t i = 0; i < n; i++)
				j->hist[score_key(s[i]) >> shift]++;
			continue;
		}
		unsigned pshift = radix_shift[j->level - 1];

		/* Adding the match rather than branching on it: which items match is
		 * data-dependent and mispredicts. */
		for (uint32_t i = 0; i < n; i++) {
			uint32_t key = score_key(s[i]);

			j->hist[(key >> shift) & mask] += key >> pshift == j->prefix;
		}
	}
	return NULL;
}

static void *rows_output(void *p) {
	struct rows_job *j = p;
	uint32_t *out = j->keep;
	uint64_t taken = 0;

	for (uint32_t r = j->r0; r < j->r1; r++) {
		const float *s = j->rows[r];
		uint32_t n = j->lens[r], c = 0;

		for (uint32_t i = 0; i < n; i++) {
			uint32_t key = score_key(s[i]), d = key >> j->cut_shift;

			if (d > j->cut_prefix || (d == j->cut_prefix && taken < j->quota)) {
				taken += d == j->cut_prefix;
				if (j->needle) {
					/* NaN is never a needle, even when there are too few others. */
					if (key != 0)
						j->needle[i / j->block_tokens] = 1;
				} else
					out[c++] = i;
			}
		}
		if (!j->needle) {
			j->counts[r] = c;
			out += c;
		}
	}
	return NULL;
}

/* Runs fn on every job, jobs[1...] on their own threads if they can be started. */
static void run_jobs(struct rows_job *jobs, unsigned n, void *(*fn)(void *)) {
	pthread_t tid[64];
	unsigned started[64] = { 0 };

	for (unsigned t = 1; t < n; t++)
		started[t] = pthread_create(&tid[t], NULL, fn, &jobs[t]) == 0;
	fn(&jobs[0]);
	for (unsigned t = 1; t < n; t++) {
		if (started[t])
			pthread_join(tid[t], NULL);
		else
			fn(&jobs[t]); /* the result is the same either way, only slower */
	}
}

/*
 * Finds the cut for keeping the k highest of the jobs' rows (0 < k <= total), sets every
 * job's cut, above, at and quota, then writes the output. With several jobs, sum (of
 * RADIX_BINS) receives their summed histograms; one job's is its own.
 */
static void rows_select(struct rows_job *jobs, unsigned n_jobs, uint64_t k, uint64_t *sum) {
	const uint64_t *hist = n_jobs == 1 ? jobs[0].hist : sum;
	uint64_t need = k;
	uint32_t prefix = 0;
	unsigned shift = 0;

	for (unsigned t = 0; t < n_jobs; t++)
		jobs[t].above = jobs[t].at = 0;
	for (unsigned level = 0; level < RADIX_LEVELS; level++) {
		unsigned nbins = 1u << radix_bits[level];
		uint64_t acc = 0;
		uint32_t b;

		for (unsigned t = 0; t < n_jobs; t++) {
			jobs[t].level = level;
			jobs[t].prefix = prefix;
		}
		run_jobs(jobs, n_jobs, rows_hist);
		if (n_jobs > 1) {
			memset(sum, 0, RADIX_BINS * sizeof(*sum));
			for (unsigned t = 0; t < n_jobs; t++)
				for (uint32_t i = 0; i < nbins; i++)
					sum[i] += jobs[t].hist[i];
		}
		/* From the highest bin down to the one where the k-th item lies. The items at
		 * this pass number at least need, so b stops at a bin. */
		for (b = nbins - 1; b > 0 && acc + hist[b] < need; b--)
			acc += hist[b];
		need -= acc;
		for (unsigned t = 0; t < n_jobs; t++)
			for (uint32_t i = b + 1; i < nbins; i++)
				jobs[t].above += jobs[t].hist[i];
		prefix = prefix << radix_bits[level] | b;
		shift = radix_shift[level];
		if (hist[b] == need || level == RADIX_LEVELS - 1) {
			for (unsigned t = 0; t < n_jobs; t++)
				jobs[t].at = jobs[t].hist[b];
			break;
		}
	}

	/* Ties at the cut go to the earliest items: earlier shares fill their quota first. */
	uint32_t *keep = jobs[0].keep;

	for (unsigned t = 0; t < n_jobs; t++) {
		jobs[t].quota = jobs[t].at < need ? jobs[t].at : need;
		need -= jobs[t].quota;
		jobs[t].cut_shift = shift;
		jobs[t].cut_prefix = prefix;
		if (keep) {
			jobs[t].keep = keep;
			keep += jobs[t].above + jobs[t].quota;
		}
	}
	run_jobs(jobs, n_jobs, rows_output);
}

int kvd_topk(const float *scores, uint32_t n, uint32_t k, uint32_t *keep) {
	struct rows_job job = { 0 };
	uint32_t count;

	if ((n > 0 && !scores) || k > n || (k > 0 && !keep))
		return -EINVAL;
	if (k == 0)
		return 0;
	if (k == n) {
		for (uint32_t i = 0; i < n; i++)
			keep[i] = i;
		return 0;
	}
	job.rows = &scores;
	job.lens = &n;
	job.r0 = 0;
	job.r1 = 1;
	job.keep = keep;
	job.counts = &count;
	rows_select(&job, 1, k, NULL);
	return 0;
}

int kvd_topk_rows(const float *const *rows, const uint32_t *lens, uint32_t n_rows, uint64_t k,
		  unsigned threads, uint32_t *ret_counts, uint32_t *ret_keep) {
	struct rows_job *jobs;
	uint64_t total = 0, per, acc = 0;
	unsigned n_jobs;

	if (n_rows > 0 && (!rows || !lens || !ret_counts))
		return -EINVAL;
	for (uint32_t r = 0; r < n_rows; r++) {
		if (lens[r] > 0 && !rows[r])
			return -EINVAL;
		total += lens[r];
	}
	if (k > total || (k > 0 && !ret_keep))
		return -EINVAL;
	if (k == 0 || k == total) {
		for (uint32_t r = 0; r < n_rows; r++) {
			ret_counts[r] = k ? lens[r] : 0;
			for (uint32_t i = 0; k && i < lens[r]; i++)
				*ret_keep++ = i;
		}
		return 0;
	}

	n_jobs = threads > 1 ? threads : 1;
	if (n_jobs > 64)
		n_jobs = 64;
	if (n_jobs > n_rows)
		n_jobs = n_rows;
	if (n_jobs > total / ROWS_PER_THREAD_MIN)
		n_jobs = (unsigned)(total / ROWS_PER_THREAD_MIN);
	if (n_jobs == 0)
		n_jobs = 1;
	/* One more job's worth for the summed histogram. */
	jobs = calloc(n_jobs + 1, sizeof(*jobs));
	if (!jobs)
		return -ENOMEM;

	/* Contiguous runs of rows of about equal numbers of scores. */
	per = total / n_jobs;
	for (unsigned t = 0, r = 0; t < n_jobs; t++) {
		jobs[t].rows = rows;
		jobs[t].lens = lens;
		jobs[t].counts = ret_counts;
		jobs[t].r0 = r;
		while (r < n_rows && (t == n_jobs - 1 || acc < per * (t + 1)))
			acc += lens[r++];
		jobs[t].r1 = r;
	}
	jobs[0].keep = ret_keep;
	rows_select(jobs, n_jobs, k, jobs[n_jobs].hist);
	free(jobs);
	return 0;
}

/* ---- Block aggregation ---- */

int kvd_block_scores(const float *tok, uint32_t n_tok, uint32_t block_tokens, uint32_t needle_ppm,
		     float *ret_blocks, uint8_t *ret_needle) {
	struct rows_job job = { 0 };
	uint32_t n_blocks, m;

	if (block_tokens == 0 || needle_ppm > 1000000 || (n_tok > 0 && (!tok || !ret_blocks)))
		return -EINVAL;
	n_blocks = n_tok / block_tokens + (n_tok % block_tokens != 0);
	/* Summed in token order in double: the same additions as the reference, so the same
	 * bits, and one rounding per block. */
	for (uint32_t b = 0, i = 0; b < n_blocks; b++) {
		uint32_t end = n_tok - i < block_tokens ? n_tok : i + block_tokens;
		double sum = 0;

		for (; i < end; i++)
			sum += tok[i];
		ret_blocks[b] = (float)sum;
	}
	if (!ret_needle)
		return 0;
	memset(ret_needle, 0, n_blocks);
	m = (uint32_t)(((uint64_t)needle_ppm * n_tok + 999999) / 1000000);
	if (m == 0)
		return 0;
	job.rows = &tok;
	job.lens = &n_tok;
	job.r0 = 0;
	job.r1 = 1;
	job.needle = ret_needle;
	job.block_tokens = block_tokens;
	if (m == n_tok) {
		/* Every token is a needle but the NaNs: a cut below every key but NaN's. */
		job.cut_shift = 0;
		job.cut_prefix = 0;
		job.quota = 0;
		rows_output(&job);
		return 0;
	}
	rows_select(&job, 1, m, NULL);
	return 0;
}

/* ---- Greedy eviction by value per byte ---- */

/*
 * The greedy's result, restated so that it needs no sort. Let c(i) = key << 32 | ~i be a
 * unit's composite: ascending c is the eviction order. A group's limit binds at its cut,
 * the first of its units (by c) that does not fit; the group gives up exactly its units
 * below the cut, whatever the others do. The greedy then takes, among the units below
 * their group's cut, those up to T, the first at which the running bytes reach the target.
 *
 * Pass 1 keeps 2 bytes per unit, the top 16 bits of its key (its bucket: sign, exponent
 * and 7 mantissa bits of the density), and sums the bytes per bucket. The bucket that
 * holds T follows from that histogram; cuts can only move T up, and only a group whose
 * units up to T's bucket do not fit has a cut that matters, so the groups are checked
 * against that bucket, only those that fail are cut exactly, and a cut unit leaves the
 * histogram (its bucket becomes BKT_NONE). If the bucket moved, the groups are checked
 * again against the new one; after GROUP_PASSES_MAX passes, against all their units.
 * Finally T is selected among the units of its bucket only, a few per thousand on a
 * spread of densities, and everything up to it is written out in one pass.
 *
 * Full keys are recomputed from value and bytes where needed (in a cut's bucket and in
 * T's) instead of being stored: the arithmetic is the same, so are the keys; a selection
 * in one bucket keeps the low 16 bits in bkt meanwhile. The passes
 * over all units also come in AVX-512, taken when kvd_simd() chose that path (KVD_SIMD
 * or kvd_simd_override() select the plain ones); both compute the same bits.
 */

#define EVICT_BUCKETS 65536u
#define BKT_TOP 0xff80u  /* +inf's bucket: no density has a higher one */
#define BKT_NONE 0xffffu /* not evictable: pinned, 0 bytes, or at or past its group's cut */
#define GROUP_PASSES_MAX 4
#define EVICT_SCRATCH_ALIGN 64
/* list_select sorts the composites of this many units at most, instead of more levels. */
#define LIST_SORT_MAX 32

_Static_assert(BKT_TOP == 0xff800000u >> 16, "BKT_TOP is +inf's bucket");

struct evict {
	const struct kvd_evict_in *in;
	uint64_t *hist; /* [EVICT_BUCKETS] bytes per bucket of the units that may go */
	uint16_t *bkt;  /* [n] their buckets */
	int avx512;     /* take the AVX-512 passes */
};

/*
 * score_key(kvd_density(v, b)), faster: dividing by a power of two is multiplying by its
 * reciprocal, which is exact (2046 - e is the reciprocal's exponent field for b's e), so
 * the product rounds to the same float. b == 0 goes that way too, and its key is unused.
 */
static inline uint32_t density_key(float v, uint32_t b) {
	double db = (double)b, d;

	if (b & (b - 1))
		d = (double)v / db;
	else {
		uint64_t u;
		double inv;

		memcpy(&u, &db, sizeof(u));
		u = (UINT64_C(2046) << 52) - u;
		memcpy(&inv, &u, sizeof(inv));
		d = (double)v * inv;
	}
	return score_key((float)d);
}

static inline uint32_t unit_key(const struct kvd_evict_in *in, uint32_t i) {
	return density_key(in->value[i], in->bytes[i]);
}

static inline uint64_t unit_composite(const struct kvd_evict_in *in, uint32_t i) {
	/* On equal keys the higher index has the lower ~index, so it goes first. */
	return (uint64_t)unit_key(in, i) << 32 | (uint32_t)~i;
}

/*
 * The passes over all units, plain first. bkt_fill: pass 1 over [from, to), the buckets
 * and the bytes per bucket. Units that cannot go add to BKT_NONE's, which is never read.
 */
static void bkt_fill(struct evict *e, uint32_t from, uint32_t to) {
	const struct kvd_evict_in *in = e->in;

	for (uint32_t i = from; i < to; i++) {
		uint32_t w = in->bytes[i], k = BKT_NONE;

		if (w && !(in->pinned && in->pinned[i]))
			k = density_key(in->value[i], w) >> 16;
		e->bkt[i] = (uint16_t)k;
		e->hist[k] += w;
	}
}

/* The units of [from, to) in buckets up to bmax, and (if bytes) their bytes in *ret_bytes. */
static uint32_t bkt_count(const struct evict *e, const uint32_t *bytes, uint32_t from,
			  uint32_t to, uint32_t bmax, uint64_t *ret_bytes) {
	uint64_t sum = 0;
	uint32_t cnt = 0;

	if (!bytes)
		for (uint32_t i = from; i < to; i++)
			cnt += e->bkt[i] <= bmax;
	else
		for (uint32_t i = from; i < to; i++) {
			uint32_t in_b = e->bkt[i] <= bmax;

			cnt += in_b;
			sum += in_b ? bytes[i] : 0;
		}
	*ret_bytes += sum;
	return cnt;
}

/* Appends the units of [from, to) in bucket b to list; returns how many. */
static uint32_t bkt_find(const struct evict *e, uint32_t from, uint32_t to, uint32_t b,
			 uint32_t *list) {
	uint32_t m = 0;

	for (uint32_t i = from; i < to; i++)
		if (e->bkt[i] == b)
			list[m++] = i;
	return m;
}

/* Writes the units of [from, to) in buckets up to b to out, ascending; returns how many.
 * out may be written up to out[to - from - 1] whatever the count. */
static uint32_t bkt_output(const struct evict *e, uint32_t from, uint32_t to, uint32_t b,
			   uint32_t *out) {
	uint32_t m = 0;

	/* m <= i - from: the store is in bounds, and needs no branch. */
	for (uint32_t i = from; i < to; i++) {
		out[m] = i;
		m += e->bkt[i] <= b;
	}
	return m;
}

/* Stores the low 16 bits of the keys of the units list[m] in their bkt. */
static void list_low16(struct evict *e, const uint32_t *list, uint32_t m) {
	for (uint32_t j = 0; j < m; j++)
		e->bkt[list[j]] = (uint16_t)unit_key(e->in, list[j]);
}

/* The units of [from, to) at or past cut (in bucket cb) leave: BKT_NONE, out of hist. */
static void bkt_cut(struct evict *e, uint32_t from, uint32_t to, uint32_t cb, uint64_t cut) {
	for (uint32_t i = from; i < to; i++) {
		uint32_t k = e->bkt[i], drop = k > cb;

		/* Which go is data-dependent: no branch but for the cut's bucket. */
		if (k == cb)
			drop = unit_composite(e->in, i) >= cut;
		e->hist[k] -= drop ? e->in->bytes[i] : 0;
		e->bkt[i] = (uint16_t)(drop ? BKT_NONE : k);
	}
}

#ifdef EVICT_AVX512
/*
 * The keys of 16 units of values v and sizes w as density_key() makes them: the density
 * in double (a multiply by the exact reciprocal, or a division in the lanes whose size is
 * no power of two), rounded to float, then score_key's mapping.
 */
TARGET_AVX512 static inline __m512i density_keys16(__m512 v, __m512i w) {
	const __m512i one = _mm512_set1_epi32(1), top = _mm512_set1_epi32((int)0x80000000u);
	const __m512i inf = _mm512_set1_epi32(0x7f800000), abs = _mm512_set1_epi32(0x7fffffff);
	const __m512i recip = _mm512_set1_epi64((long long)(UINT64_C(2046) << 52));
	__m512i u, a, m;
	__mmask16 odd = _mm512_test_epi32_mask(w, _mm512_sub_epi32(w, one));
	__m512d wlo = _mm512_cvtepu32_pd(_mm512_castsi512_si256(w));
	__m512d whi = _mm512_cvtepu32_pd(_mm512_extracti64x4_epi64(w, 1));
	__m512d vlo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
	__m512d vhi = _mm512_cvtps_pd(
		_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
	__m512d rlo = _mm512_castsi512_pd(_mm512_sub_epi64(recip, _mm512_castpd_si512(wlo)));
	__m512d rhi = _mm512_castsi512_pd(_mm512_sub_epi64(recip, _mm512_castpd_si512(whi)));
	__m512d qlo = _mm512_mul_pd(vlo, rlo), qhi = _mm512_mul_pd(vhi, rhi);

	if (odd) {
		qlo = _mm512_mask_div_pd(qlo, (__mmask8)odd, vlo, wlo);
		qhi = _mm512_mask_div_pd(qhi, (__mmask8)(odd >> 8), vhi, whi);
	}
	u = _mm512_castpd_si512(_mm512_insertf64x4(
		_mm512_castpd256_pd512(_mm256_castps_pd(_mm512_cvtpd_ps(qlo))),
		_mm256_castps_pd(_mm512_cvtpd_ps(qhi)), 1));
	/* -0.0 to +0.0; negatives flipped, positives lifted; NaN to 0. */
	a = _mm512_and_si512(u, abs);
	u = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(a, a), u);
	m = _mm512_srli_epi32(_mm512_srai_epi32(u, 31), 1);
	return _mm512_maskz_mov_epi32(_mm512_cmple_epu32_mask(a, inf),
				      _mm512_xor_si512(_mm512_xor_si512(u, m), top));
}

/* The keys of units i..i+15. */
TARGET_AVX512 static inline __m512i keys16_avx512(const struct kvd_evict_in *in, uint32_t i) {
	return density_keys16(_mm512_loadu_ps(in->value + i), _mm512_loadu_si512(in->bytes + i));
}

/* The keys of the 16 units list[0..16). */
TARGET_AVX512 static inline __m512i list_keys16_avx512(const struct kvd_evict_in *in,
						       const uint32_t *list) {
	__m512i idx = _mm512_loadu_si512(list);

	return density_keys16(_mm512_i32gather_ps(idx, in->value, 4),
			      _mm512_i32gather_epi32(idx, (const int *)in->bytes, 4));
}

/* The lanes of idx (unit indices) with keys k whose composite exceeds c. */
TARGET_AVX512 static inline __mmask16 after16_avx512(__m512i k, __m512i idx, uint64_t c) {
	__m512i ck = _mm512_set1_epi32((int)(uint32_t)(c >> 32));
	__m512i ci = _mm512_set1_epi32((int)~(uint32_t)c);

	/* ~i > ~ci when i < ci. */
	return _mm512_cmpgt_epu32_mask(k, ck) |
	       (_mm512_cmpeq_epi32_mask(k, ck) & _mm512_cmplt_epu32_mask(idx, ci));
}

#define IOTA16 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)

/* bkt_fill over the whole 16s of [0, n); returns where the rest starts. */
TARGET_AVX512 static uint32_t bkt_fill_avx512(struct evict *e, uint32_t n) {
	const struct kvd_evict_in *in = e->in;
	const __m512i none = _mm512_set1_epi32(BKT_NONE);
	uint32_t i;

	for (i = 0; n - i >= 16; i += 16) {
		__m512i w = _mm512_loadu_si512(in->bytes + i), k = keys16_avx512(in, i);
		__mmask16 ev = _mm512_test_epi32_mask(w, w);
		uint32_t kk[16];

		if (in->pinned)
			ev &= (__mmask16)~_mm_test_epi8_mask(
				_mm_loadu_si128((const __m128i *)(in->pinned + i)),
				_mm_set1_epi8(-1));
		k = _mm512_mask_blend_epi32(ev, none, _mm512_srli_epi32(k, 16));
		_mm256_storeu_si256((__m256i *)(e->bkt + i), _mm512_cvtepi32_epi16(k));
		_mm512_storeu_si512(kk, k);
		for (unsigned j = 0; j < 16; j++)
			e->hist[kk[j]] += in->bytes[i + j];
	}
	return i;
}

TARGET_AVX512 static uint32_t bkt_count_avx512(const struct evict *e, const uint32_t *bytes,
					       uint32_t from, uint32_t to, uint32_t bmax,
					       uint64_t *ret_bytes) {
	const __m256i lim = _mm256_set1_epi16((short)bmax);
	__m512i sum = _mm512_setzero_si512();
	uint32_t cnt = 0, i;

	for (i = from; to - i >= 16; i += 16) {
		__mmask16 in_b = _mm256_cmple_epu16_mask(
			_mm256_loadu_si256((const __m256i *)(e->bkt + i)), lim);

		cnt += (uint32_t)__builtin_popcount(in_b);
		if (bytes && in_b) {
			__m512i w = _mm512_loadu_si512(bytes + i);
			__m512i lo = _mm512_cvtepu32_epi64(_mm512_castsi512_si256(w));
			__m512i hi = _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(w, 1));

			sum = _mm512_mask_add_epi64(sum, (__mmask8)in_b, sum, lo);
			sum = _mm512_mask_add_epi64(sum, (__mmask8)(in_b >> 8), sum, hi);
		}
	}
	*ret_bytes += (uint64_t)_mm512_reduce_add_epi64(sum);
	return cnt + bkt_count(e, bytes, i, to, bmax, ret_bytes);
}

TARGET_AVX512 static uint32_t bkt_find_avx512(const struct evict *e, uint32_t from, uint32_t to,
					      uint32_t b, uint32_t *list) {
	const __m512i key = _mm512_set1_epi16((short)b);
	uint32_t m = 0, i;

	for (i = from; to - i >= 32; i += 32) {
		__mmask32 eq = _mm512_cmpeq_epi16_mask(_mm512_loadu_si512(e->bkt + i), key);

		for (; eq; eq &= eq - 1)
			list[m++] = i + (uint32_t)__builtin_ctz(eq);
	}
	return m + bkt_find(e, i, to, b, list + m);
}

TARGET_AVX512 static uint32_t bkt_output_avx512(const struct evict *e, uint32_t from, uint32_t to,
						uint32_t b, uint32_t *out) {
	const __m256i lim = _mm256_set1_epi16((short)b);
	__m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)from), IOTA16);
	uint32_t m = 0, i;

	/* A whole vector is stored at out + m <= out + i - from: in bounds (see bkt_output).
	 * Compressing in a register: the memory form is slow on some CPUs. */
	for (i = from; to - i >= 16; i += 16) {
		__mmask16 take = _mm256_cmple_epu16_mask(
			_mm256_loadu_si256((const __m256i *)(e->bkt + i)), lim);

		_mm512_storeu_si512(out + m, _mm512_maskz_compress_epi32(take, idx));
		m += (uint32_t)__builtin_popcount(take);
		idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
	}
	return m + bkt_output(e, i, to, b, out + m);
}

TARGET_AVX512 static void list_low16_avx512(struct evict *e, const uint32_t *list, uint32_t m) {
	uint32_t j;

	for (j = 0; m - j >= 16; j += 16) {
		uint32_t k[16];

		/* The list ascends (list_select's survivors keep their order): 16 that span 16
		 * indices are a run of units, loaded without a gather. */
		if (list[j + 15] - list[j] == 15) {
			__m512i keys = keys16_avx512(e->in, list[j]);

			_mm256_storeu_si256((__m256i *)(e->bkt + list[j]),
					    _mm512_cvtepi32_epi16(keys));
			continue;
		}
		_mm512_storeu_si512(k, list_keys16_avx512(e->in, list + j));
		for (unsigned x = 0; x < 16; x++)
			e->bkt[list[j + x]] = (uint16_t)k[x];
	}
	list_low16(e, list + j, m - j);
}

TARGET_AVX512 static void bkt_cut_avx512(struct evict *e, uint32_t from, uint32_t to, uint32_t cb,
					 uint64_t cut) {
	const __m256i lim = _mm256_set1_epi16((short)cb);
	const __m256i none = _mm256_set1_epi16((short)BKT_NONE);
	__m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)from), IOTA16);
	uint32_t i, kd;

	for (i = from; to - i >= 16; i += 16) {
		__m256i k = _mm256_loadu_si256((const __m256i *)(e->bkt + i));
		__mmask16 at = _mm256_cmpeq_epi16_mask(k, lim), drop;

		drop = _mm256_cmpgt_epu16_mask(k, lim) & _mm256_cmpneq_epi16_mask(k, none);
		/* At or past cut is after cut - 1 (no unit's composite is 0: index < 2^32 - 1). */
		if (at)
			drop |= at & after16_avx512(keys16_avx512(e->in, i), idx, cut - 1);
		idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
		if (!drop)
			continue;
		/* Often all go from one bucket (equal keys): one add, not a chain of them. */
		kd = e->bkt[i + (uint32_t)__builtin_ctz(drop)];
		if (!_mm256_mask_cmpneq_epi16_mask(drop, k, _mm256_set1_epi16((short)kd))) {
			__m512i w = _mm512_maskz_loadu_epi32(drop, e->in->bytes + i);
			__m512i lo = _mm512_cvtepu32_epi64(_mm512_castsi512_si256(w));
			__m512i hi = _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(w, 1));

			e->hist[kd] -= (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi));
		} else
			for (__mmask16 d = drop; d; d &= d - 1) {
				uint32_t j = i + (uint32_t)__builtin_ctz(d);

				e->hist[e->bkt[j]] -= e->in->bytes[j];
			}
		_mm256_mask_storeu_epi16(e->bkt + i, drop, none);
	}
	bkt_cut(e, i, to, cb, cut);
}
#endif

static uint32_t evict_count(const struct evict *e, const uint32_t *bytes, uint32_t from,
			    uint32_t to, uint32_t bmax, uint64_t *ret_bytes) {
#ifdef EVICT_AVX512
	if (e->avx512)
		return bkt_count_avx512(e, bytes, from, to, bmax, ret_bytes);
#endif
	return bkt_count(e, bytes, from, to, bmax, ret_bytes);
}

static uint32_t evict_find(const struct evict *e, uint32_t from, uint32_t to, uint32_t b,
			   uint32_t *list) {
#ifdef EVICT_AVX512
	if (e->avx512)
		return bkt_find_avx512(e, from, to, b, list);
#endif
	return bkt_find(e, from, to, b, list);
}

static uint32_t evict_output(const struct evict *e, uint32_t from, uint32_t to, uint32_t b,
			     uint32_t *out) {
#ifdef EVICT_AVX512
	if (e->avx512)
		return bkt_output_avx512(e, from, to, b, out);
#endif
	return bkt_output(e, from, to, b, out);
}

static void evict_low16(struct evict *e, const uint32_t *list, uint32_t m) {
#ifdef EVICT_AVX512
	if (e->avx512) {
		list_low16_avx512(e, list, m);
		return;
	}
#endif
	list_low16(e, list, m);
}

static void evict_cut(struct evict *e, uint32_t from, uint32_t to, uint32_t cb, uint64_t cut) {
#ifdef EVICT_AVX512
	if (e->avx512) {
		bkt_cut_avx512(e, from, to, cb, cut);
		return;
	}
#endif
	bkt_cut(e, from, to, cb, cut);
}

/*
 * The bucket in which the running bytes of hist reach target (>= 1), with *ret_below the
 * bytes of the buckets under it; BKT_TOP + 1 and the total if they never do.
 */
static uint32_t hist_cross(const uint64_t *hist, uint64_t target, uint64_t *ret_below) {
	uint64_t acc = 0;
	uint32_t b;

	for (b = 0; b <= BKT_TOP; b++) {
		if (hist[b] >= target - acc)
			break;
		acc += hist[b];
	}
	*ret_below = acc;
	return b;
}

/* Lists from this long are counted in four histograms (see list_hist). */
#define LIST_HIST4_MIN 1024

/*
 * Fills hist[256] with the weights (bytes, or 1 if unit) of the units list[m] by the digit
 * bkt >> shift & 0xff; returns their total. A long list is counted in four histograms: an
 * add to a bin waits for the previous one to it, and on equal keys all go to one bin.
 */
static uint64_t list_hist(const struct evict *e, const uint32_t *list, uint32_t m,
			  unsigned shift, int unit, uint64_t *hist) {
	const uint32_t *bytes = e->in->bytes;
	uint64_t h4[4][256], total = 0;
	uint32_t j = 0;

	memset(hist, 0, 256 * sizeof(*hist));
	if (m >= LIST_HIST4_MIN) {
		memset(h4, 0, sizeof(h4));
		for (; m - j >= 4; j += 4)
			for (unsigned x = 0; x < 4; x++) {
				uint32_t i = list[j + x];

				h4[x][e->bkt[i] >> shift & 0xff] += unit ? 1 : bytes[i];
			}
		for (unsigned d = 0; d < 256; d++)
			hist[d] = h4[0][d] + h4[1][d] + h4[2][d] + h4[3][d];
	}
	for (; j < m; j++)
		hist[e->bkt[list[j]] >> shift & 0xff] += unit ? 1 : bytes[list[j]];
	for (unsigned d = 0; d < 256; d++)
		total += hist[d];
	return total;
}

/*
 * Weighted selection on the units list[m] (in ascending index order; permuted on
 * return, the same set): returns the composite of T, the unit at which the running
 * weight (bytes, or 1 per unit if unit) in eviction order reaches need, 1 <= need <= the
 * total, and (if ret_through) the running weight up to T included. b: the bucket of all
 * the units, or BKT_NONE if they have several. If drop (with one bucket only), the units
 * of the list after T leave bkt (BKT_NONE; hist is not updated).
 *
 * A radix selection on the key, 8 bits a level; each level moves the units still in the
 * running to the front of list, in order. The top two levels read bkt. Then the key's low
 * 16 bits are computed once and kept in bkt for the two others (and put back at the end).
 * Equal keys go by index, the highest first. Once few units are left, their composites
 * are sorted instead.
 */
static uint64_t list_select(struct evict *e, uint32_t *list, uint32_t m, uint32_t b,
			    uint64_t need, int unit, int drop, uint64_t *ret_through) {
	const struct kvd_evict_in *in = e->in;
	uint64_t hist[256], c[LIST_SORT_MAX], start = need, t = 0;
	uint32_t key = b <= BKT_TOP ? b << 16 : 0, m_low = 0, m_all = m, tb;

	for (unsigned level = b <= BKT_TOP ? 2 : 0; level < 4 && m > LIST_SORT_MAX; level++) {
		unsigned shift = level % 2 ? 0 : 8;
		uint64_t acc = 0, total;
		uint32_t d, w = 0;

		if (level == 2) {
			evict_low16(e, list, m);
			m_low = m;
		}
		total = list_hist(e, list, m, shift, unit, hist);
		for (d = 0; acc + hist[d] < need; d++)
			acc += hist[d];
		need -= acc;
		key |= d << (24 - 8 * level);
		/* Weights are never 0: all in d means all stay, in order. */
		if (hist[d] == total)
			continue;
		/* Swapping whether or not i stays: list[w] is then one that goes, or i itself;
		 * which stay is data-dependent, and a branch would mispredict. */
		for (uint32_t j = 0; j < m; j++) {
			uint32_t i = list[j];

			list[j] = list[w];
			list[w] = i;
			w += (e->bkt[i] >> shift & 0xff) == d;
		}
		m = w;
	}
	if (m > LIST_SORT_MAX) {
		/* All m have this key: the highest index goes first. */
		uint32_t j = m - 1;

		for (; j > 0 && need > (unit ? 1 : in->bytes[list[j]]); j--)
			need -= unit ? 1 : in->bytes[list[j]];
		t = (uint64_t)key << 32 | (uint32_t)~list[j];
	} else {
		uint32_t j;

		for (j = 0; j < m; j++) {
			uint64_t x = unit_composite(in, list[j]);
			uint32_t y = j;

			for (; y > 0 && c[y - 1] > x; y--)
				c[y] = c[y - 1];
			c[y] = x;
		}
		for (j = 0; j + 1 < m && need > (unit ? 1 : in->bytes[~(uint32_t)c[j]]); j++)
			need -= unit ? 1 : in->bytes[~(uint32_t)c[j]];
		t = c[j];
	}
	if (ret_through)
		*ret_through = start - need + (unit ? 1 : in->bytes[~(uint32_t)t]);

	/*
	 * The buckets back, or with drop, BKT_NONE for the units after T. Those with low bits
	 * in bkt are in T's bucket, their composites at hand. With drop, all are in bucket b:
	 * either they all have low bits, or they are few and were sorted.
	 */
	tb = (uint32_t)(t >> 48);
	for (uint32_t j = 0; j < m_low; j++) {
		uint32_t i = list[j];
		int after = ((uint64_t)(tb << 16 | e->bkt[i]) << 32 | (uint32_t)~i) > t;

		e->bkt[i] = (uint16_t)(drop && after ? BKT_NONE : tb);
	}
	for (uint32_t j = m_low; drop && j < m_all; j++)
		if (unit_composite(in, list[j]) > t)
			e->bkt[list[j]] = BKT_NONE;
	return t;
}

/*
 * Checks group [from, to) with limits mu units and mb bytes against bucket bmax: if its
 * units up to bmax fit, nothing changes and 0 is returned. Otherwise its cut, which lies
 * at or below bmax, is found exactly; its units from the cut on leave (see bkt_cut);
 * returns 1. list has room for to - from units.
 */
static int group_cut(struct evict *e, uint32_t from, uint32_t to, uint64_t mu, uint64_t mb,
		     uint32_t bmax, uint32_t *list) {
	uint64_t bsum = 0, cut = UINT64_MAX;
	uint32_t cnt, m;

	cnt = evict_count(e, mb == UINT64_MAX ? NULL : e->in->bytes, from, to, bmax, &bsum);
	if (cnt <= mu && bsum <= mb)
		return 0;
	if (bsum > mb) {
		m = evict_output(e, from, to, bmax, list);
		cut = list_select(e, list, m, BKT_NONE, mb + 1, 0, 0, NULL);
	}
	if (cnt > mu) {
		uint64_t cu;

		/* Again: list_select permuted the list. */
		m = evict_output(e, from, to, bmax, list);
		cu = list_select(e, list, m, BKT_NONE, mu + 1, 1, 0, NULL);
		if (cu < cut)
			cut = cu;
	}
	evict_cut(e, from, to, (uint32_t)(cut >> 48), cut);
	return 1;
}

/* Applies every group's limits up to bucket bmax (see group_cut). Returns whether any
 * group was cut. list: room for n units. */
static int groups_cut(struct evict *e, uint32_t bmax, uint32_t *list) {
	const struct kvd_evict_in *in = e->in;
	int changed = 0;

	for (uint32_t g = 0; g < in->n_groups; g++) {
		uint32_t from = in->group_start[g], to = in->group_start[g + 1];
		uint64_t mu = in->group_max_units ? in->group_max_units[g] : UINT64_MAX;
		uint64_t mb = in->group_max_bytes ? in->group_max_bytes[g] : UINT64_MAX;

		/* Limits no group this size can reach. */
		if (mu >= to - from)
			mu = UINT64_MAX;
		if (mb >= (uint64_t)(to - from) * UINT32_MAX)
			mb = UINT64_MAX;
		if (mu == UINT64_MAX && mb == UINT64_MAX)
			continue;
		changed |= group_cut(e, from, to, mu, mb, bmax, list);
	}
	return changed;
}

size_t kvd_evict_greedy_scratch_bytes(uint32_t n) {
	size_t fixed = EVICT_SCRATCH_ALIGN + EVICT_BUCKETS * sizeof(uint64_t);

	/* Only where size_t is 32 bits: a size no allocation can meet. */
	if (n > (SIZE_MAX - fixed) / sizeof(uint16_t))
		return SIZE_MAX;
	return fixed + (size_t)n * sizeof(uint16_t);
}

/* kvd_evict_greedy's -EINVAL cases. */
static int evict_check(const struct kvd_evict_in *in, const uint32_t *ret_ids,
		       const uint32_t *ret_n_ids, const uint64_t *ret_freed) {
	if (!in || !ret_n_ids || !ret_freed || (in->n > 0 && (!in->value || !in->bytes || !ret_ids)))
		return -EINVAL;
	if (in->n_groups > 0) {
		if (!in->group_start || in->group_start[0] != 0 || in->group_start[in->n_groups] != in->n)
			return -EINVAL;
		for (uint32_t g = 0; g < in->n_groups; g++)
			if (in->group_start[g] > in->group_start[g + 1])
				return -EINVAL;
	}
	return 0;
}

int kvd_evict_greedy_buf(const struct kvd_evict_in *in, void *scratch, size_t scratch_bytes,
			 uint32_t *ret_ids, uint32_t *ret_n_ids, uint64_t *ret_freed) {
	struct evict e = { .in = in };
	uint64_t below, freed;
	uint32_t n, b, first = 0;
	uintptr_t base;
	int r;

	r = evict_check(in, ret_ids, ret_n_ids, ret_freed);
	if (r < 0)
		return r;
	if (!scratch || scratch_bytes < kvd_evict_greedy_scratch_bytes(in->n))
		return -ENOBUFS;
	n = in->n;
	if (n == 0 || in->target == 0) {
		*ret_n_ids = 0;
		*ret_freed = 0;
		return 0;
	}

	base = ((uintptr_t)scratch + EVICT_SCRATCH_ALIGN - 1) &
	       ~(uintptr_t)(EVICT_SCRATCH_ALIGN - 1);
	e.hist = (uint64_t *)base;
	e.bkt = (uint16_t *)(e.hist + EVICT_BUCKETS);
	memset(e.hist, 0, EVICT_BUCKETS * sizeof(uint64_t));
#ifdef EVICT_AVX512
	e.avx512 = kvd_simd() == &kvd_simd_avx512;
	if (e.avx512)
		first = bkt_fill_avx512(&e, n);
#endif
	bkt_fill(&e, first, n);

	/* The limits: ret_ids is the groups' scratch list until the output. */
	b = hist_cross(e.hist, in->target, &below);
	if (in->n_groups > 0 && (in->group_max_units || in->group_max_bytes))
		for (unsigned pass = 0;; pass++) {
			uint32_t bmax = pass == GROUP_PASSES_MAX || b > BKT_TOP ? BKT_TOP : b;

			if (!groups_cut(&e, bmax, ret_ids))
				break;
			b = hist_cross(e.hist, in->target, &below);
			/* Groups not cut fit up to bmax; the others were cut exactly. */
			if (b <= bmax || bmax == BKT_TOP)
				break;
		}

	if (b > BKT_TOP) {
		/* Everything that may go goes. */
		b = BKT_TOP;
		freed = below;
	} else {
		/* T among the units of bucket b; those after it leave. */
		uint32_t m = evict_find(&e, 0, n, b, ret_ids);
		uint64_t through;

		list_select(&e, ret_ids, m, b, in->target - below, 0, 1, &through);
		freed = below + through;
	}
	*ret_n_ids = evict_output(&e, 0, n, b, ret_ids);
	*ret_freed = freed;
	return 0;
}

int kvd_evict_greedy(const struct kvd_evict_in *in, uint32_t *ret_ids, uint32_t *ret_n_ids,
		     uint64_t *ret_freed) {
	size_t size;
	void *scratch;
	int r;

	r = evict_check(in, ret_ids, ret_n_ids, ret_freed);
	if (r < 0)
		return r;
	if (in->n == 0 || in->target == 0) {
		*ret_n_ids = 0;
		*ret_freed = 0;
		return 0;
	}
	size = kvd_evict_greedy_scratch_bytes(in->n);
	scratch = malloc(size);
	if (!scratch)
		return -ENOMEM;
	r = kvd_evict_greedy_buf(in, scratch, size, ret_ids, ret_n_ids, ret_freed);
	free(scratch);
	return r;
}
