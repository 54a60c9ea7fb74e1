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
 * Greedy eviction is a weighted quick selection (weights = bytes) on 64-bit composites
 * (key << 32 | ~index), distinct for distinct units, so that the answer is one unit and
 * does not depend on pivots; pivots only change the time it takes.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "select.h"

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

struct witem {
	uint64_t c; /* composite: eviction order is ascending c */
	uint64_t w; /* bytes */
};

static inline uint64_t unit_composite(const struct kvd_evict_in *in, uint32_t i) {
	/* On equal keys the higher index has the lower ~index, so it goes first. */
	return (uint64_t)score_key(kvd_density(in->value[i], in->bytes[i])) << 32 | (uint32_t)~i;
}

static inline int unit_evictable(const struct kvd_evict_in *in, uint32_t i) {
	return in->bytes[i] > 0 && !(in->pinned && in->pinned[i]);
}

static inline void witem_swap(struct witem *a, struct witem *b) {
	struct witem t = *a;

	*a = *b;
	*b = t;
}

static int witem_cmp(const void *pa, const void *pb) {
	const struct witem *a = pa, *b = pb;

	return a->c < b->c ? -1 : a->c > b->c;
}

/* splitmix64's finaliser, for pivot positions an input cannot line up with easily. */
static inline uint64_t mix64(uint64_t x) {
	x ^= x >> 30;
	x *= UINT64_C(0xbf58476d1ce4e5b9);
	x ^= x >> 27;
	x *= UINT64_C(0x94d049bb133111eb);
	return x ^ (x >> 31);
}

/*
 * Weighted selection: returns the position p of the first item, in ascending c, at which
 * the running weight (each item's w, or 1 if unit) reaches need, and partitions a[] so
 * that a[0..p) are the items below it and a(p..n) those above. Requires 1 <= need <= the
 * total weight. Expected O(n); a pathological run of bad pivots falls back to a sort.
 */
static size_t wselect(struct witem *a, size_t n, uint64_t need, int unit) {
	size_t lo = 0, hi = n;
	uint64_t seed = n;

	for (unsigned depth = 0;; depth++) {
		size_t len = hi - lo, i, piv[3];
		uint64_t wl = 0, wp;

		if (len <= 16 || depth > 96) {
			if (len <= 16)
				for (size_t x = lo + 1; x < hi; x++)
					for (size_t y = x; y > lo && a[y - 1].c > a[y].c; y--)
						witem_swap(&a[y - 1], &a[y]);
			else
				qsort(a + lo, len, sizeof(*a), witem_cmp);
			for (i = lo; i < hi - 1; i++) {
				wp = unit ? 1 : a[i].w;
				if (need <= wp)
					break;
				need -= wp;
			}
			return i;
		}

		/* Median of three positions drawn from a deterministic stream. */
		for (int s = 0; s < 3; s++) {
			seed = mix64(seed + UINT64_C(0x9e3779b97f4a7c15));
			piv[s] = lo + (size_t)(seed % len);
		}
		if (a[piv[0]].c > a[piv[1]].c) {
			size_t t = piv[0];
			piv[0] = piv[1];
			piv[1] = t;
		}
		if (a[piv[1]].c > a[piv[2]].c)
			piv[1] = a[piv[0]].c > a[piv[2]].c ? piv[0] : piv[2];
		witem_swap(&a[piv[1]], &a[hi - 1]);

		uint64_t pv = a[hi - 1].c;

		for (i = lo; i < hi - 1 && a[i].c < pv; i++)
			wl += unit ? 1 : a[i].w;
		for (size_t j = i + 1; j < hi - 1; j++)
			if (a[j].c < pv) {
				witem_swap(&a[i], &a[j]);
				wl += unit ? 1 : a[i].w;
				i++;
			}
		witem_swap(&a[i], &a[hi - 1]);
		wp = unit ? 1 : a[i].w;
		if (need <= wl)
			hi = i;
		else if (need <= wl + wp)
			return i;
		else {
			need -= wl + wp;
			lo = i + 1;
		}
	}
}

int kvd_evict_greedy(const struct kvd_evict_in *in, uint32_t *ret_ids, uint32_t *ret_n_ids,
		     uint64_t *ret_freed) {
	struct witem *it = NULL;
	uint64_t *cut = NULL, total = 0, last = 0, freed = 0;
	uint32_t n_groups, m = 0, n_ids = 0;
	int take = 1;

	if (!in || !ret_n_ids || !ret_freed || (in->n > 0 && (!in->value || !in->bytes || !ret_ids)))
		return -EINVAL;
	if (in->n_groups > 0) {
		if (!in->group_start || in->group_start[0] != 0 || in->group_start[in->n_groups] != in->n)
			return -EINVAL;
		for (uint32_t g = 0; g < in->n_groups; g++)
			if (in->group_start[g] > in->group_start[g + 1])
				return -EINVAL;
	}
	n_groups = in->n_groups ? in->n_groups : 1;
	it = malloc((in->n ? in->n : 1) * sizeof(*it));
	cut = malloc(n_groups * sizeof(*cut));
	if (!it || !cut) {
		free(it);
		free(cut);
		return -ENOMEM;
	}

	/*
	 * Per group: gather its evictable units, and where a limit binds, cut them at the
	 * end of the longest prefix of the group's order that fits. Items from the cut on
	 * are dropped from it[]; cut[g] is the composite of the first dropped one.
	 */
	for (uint32_t g = 0; g < n_groups; g++) {
		uint32_t from = in->n_groups ? in->group_start[g] : 0;
		uint32_t to = in->n_groups ? in->group_start[g + 1] : in->n, start = m;
		uint64_t gw = 0;
		size_t keep_n;

		for (uint32_t i = from; i < to; i++)
			if (unit_evictable(in, i)) {
				it[m++] = (struct witem){ unit_composite(in, i), in->bytes[i] };
				gw += in->bytes[i];
			}
		keep_n = m - start;
		cut[g] = UINT64_MAX; /* above every composite: keys stop at +inf's */
		if (in->n_groups && in->group_max_bytes && gw > in->group_max_bytes[g]) {
			keep_n = wselect(it + start, keep_n, in->group_max_bytes[g] + 1, 0);
			cut[g] = it[start + keep_n].c;
		}
		if (in->n_groups && in->group_max_units && keep_n > in->group_max_units[g]) {
			keep_n = wselect(it + start, keep_n, (uint64_t)in->group_max_units[g] + 1, 1);
			cut[g] = it[start + keep_n].c;
		}
		if (keep_n != m - start) {
			gw = 0;
			for (size_t x = start; x < start + keep_n; x++)
				gw += it[x].w;
		}
		m = start + (uint32_t)keep_n;
		total += gw;
	}

	/* The global cut: the first unit at which the running bytes reach the target. */
	if (in->target == 0 || total == 0)
		take = 0;
	else if (total <= in->target)
		last = UINT64_MAX;
	else
		last = it[wselect(it, m, in->target, 0)].c;

	for (uint32_t g = 0; take && g < n_groups; g++) {
		uint32_t from = in->n_groups ? in->group_start[g] : 0;
		uint32_t to = in->n_groups ? in->group_start[g + 1] : in->n;

		for (uint32_t i = from; i < to; i++) {
			uint64_t c;

			if (!unit_evictable(in, i))
				continue;
			c = unit_composite(in, i);
			if (c < cut[g] && c <= last) {
				ret_ids[n_ids++] = i;
				freed += in->bytes[i];
			}
		}
	}
	free(it);
	free(cut);
	*ret_n_ids = n_ids;
	*ret_freed = freed;
	return 0;
}
