/* SPDX-License-Identifier: MIT */
/*
 * The task generators of eval/kvd-lm/README.md ("Tasks"). Every random draw, and the
 * order of the draws, is part of the format: tasks.py makes the same draws in the same
 * order, so any change here is a change there (and to the golden file).
 */
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "basic/macro.h"
#include "tasks.h"

#define HAYSTACK_SIZE_MAX (UINT64_C(64) << 20)

/* What a prompt keeps around its needles (needle tasks) or for its list (cwe), at least. */
#define MIN_FILLER 64
#define MIN_CWE_LIST 128

#define NEEDLES 4
#define CWE_WORDS 30
#define CWE_COMMON 3
#define CWE_WEIGHT 6

static const char *const task_names[_KVD_TASK_MAX] = {
	[KVD_TASK_NIAH] = "niah",
	[KVD_TASK_MULTIKEY] = "multikey",
	[KVD_TASK_MULTIVALUE] = "multivalue",
	[KVD_TASK_VT] = "vt",
	[KVD_TASK_CWE] = "cwe",
};

const char *kvd_task_to_string(enum kvd_task t) {
	if (t < 0 || t >= _KVD_TASK_MAX)
		return NULL;
	return task_names[t];
}

enum kvd_task kvd_task_from_string(const char *s) {
	if (!s)
		return _KVD_TASK_INVALID;
	for (int t = 0; t < _KVD_TASK_MAX; t++)
		if (strcmp(s, task_names[t]) == 0)
			return t;
	return _KVD_TASK_INVALID;
}

struct kvd_haystack *kvd_haystack_free(struct kvd_haystack *h) {
	if (h) {
		free(h->text);
		free(h);
	}
	return NULL;
}

int kvd_haystack_load(const char *path, struct kvd_haystack **ret) {
	_cleanup_(kvd_haystack_freep) struct kvd_haystack *h = NULL;
	_cleanup_(closep) int fd = -EBADF;
	struct stat st;
	size_t n = 0;

	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return negative_errno();
	if (fstat(fd, &st) < 0)
		return negative_errno();
	if ((uint64_t)st.st_size > HAYSTACK_SIZE_MAX)
		return -EFBIG;

	h = calloc(1, sizeof(*h));
	if (!h)
		return -ENOMEM;
	h->text = malloc((size_t)st.st_size + 1);
	if (!h->text)
		return -ENOMEM;
	/* Reads what fstat promised and no more: a file growing meanwhile is cut there. */
	while (n < (size_t)st.st_size) {
		ssize_t k = read(fd, h->text + n, (size_t)st.st_size - n);

		if (k < 0) {
			if (errno == EINTR)
				continue;
			return negative_errno();
		}
		if (k == 0)
			break;
		n += (size_t)k;
	}
	if (n > 0 && h->text[n - 1] == '\n')
		n--;
	if (n == 0)
		return -EBADMSG;
	for (size_t i = 0; i < n; i++)
		if (h->text[i] < 0x20 || h->text[i] > 0x7e)
			return -EBADMSG;
	h->text[n] = 0;
	h->size = n;

	*ret = TAKE_PTR(h);
	return 0;
}

/* splitmix64, as the README gives it. */
struct rng {
	uint64_t x;
};

static uint64_t rng_next(struct rng *r) {
	uint64_t z;

	r->x += UINT64_C(0x9e3779b97f4a7c15);
	z = r->x;
	z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
	z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
	return z ^ (z >> 31);
}

static uint64_t rand_below(struct rng *r, uint64_t n) {
	return rng_next(r) % n;
}

/* n letters from first..first+25, left to right, then a NUL. */
static void draw_word(struct rng *r, char first, size_t n, char *ret) {
	for (size_t i = 0; i < n; i++)
		ret[i] = (char)(first + (char)rand_below(r, 26));
	ret[n] = 0;
}

static bool seen(const char (*words)[16], size_t n, const char *w) {
	for (size_t i = 0; i < n; i++)
		if (strcmp(words[i], w) == 0)
			return true;
	return false;
}

/* Word j of n letters, redrawn until it differs from words[0..j). */
static void draw_distinct_word(struct rng *r, char first, size_t n, char (*words)[16], size_t j) {
	do
		draw_word(r, first, n, words[j]);
	while (seen(words, j, words[j]));
}

/* A number of `digits` digits, the first not 0, redrawn until it differs from nums[0..j). */
static void draw_distinct_number(struct rng *r, unsigned digits, char (*nums)[16], size_t j) {
	uint64_t lo = 1;

	for (unsigned i = 1; i < digits; i++)
		lo *= 10;
	do
		snprintf(nums[j], sizeof(nums[j]), "%" PRIu64, lo + rand_below(r, 9 * lo));
	while (seen(nums, j, nums[j]));
}

/*
 * The needles of a sample, in the order they go into the context, without their trailing
 * space (the haystack's space that follows each is it), and the question and answer.
 */
struct plan {
	char needle[NEEDLES][128];
	unsigned n_needles;
	char question[128];
	char answer[128];
};

static void plan_niah(struct rng *r, struct plan *p) {
	char key[1][16], value[1][16];

	draw_distinct_word(r, 'a', 6, key, 0);
	draw_distinct_number(r, 7, value, 0);
	snprintf(p->needle[0], sizeof(p->needle[0]), " The special magic number for %s is %s.",
		 key[0], value[0]);
	p->n_needles = 1;
	snprintf(p->question, sizeof(p->question), "What is the special magic number for %s?",
		 key[0]);
	snprintf(p->answer, sizeof(p->answer), "%s", value[0]);
}

static void plan_multikey(struct rng *r, struct plan *p) {
	char key[NEEDLES][16], value[NEEDLES][16];
	unsigned q;

	for (unsigned j = 0; j < NEEDLES; j++) {
		draw_distinct_word(r, 'a', 6, key, j);
		draw_distinct_number(r, 7, value, j);
		snprintf(p->needle[j], sizeof(p->needle[j]),
			 " The special magic number for %s is %s.", key[j], value[j]);
	}
	p->n_needles = NEEDLES;
	q = (unsigned)rand_below(r, NEEDLES);
	snprintf(p->question, sizeof(p->question), "What is the special magic number for %s?",
		 key[q]);
	snprintf(p->answer, sizeof(p->answer), "%s", value[q]);
}

static void plan_multivalue(struct rng *r, struct plan *p) {
	char key[1][16], value[NEEDLES][16];

	draw_distinct_word(r, 'a', 6, key, 0);
	for (unsigned j = 0; j < NEEDLES; j++) {
		draw_distinct_number(r, 7, value, j);
		snprintf(p->needle[j], sizeof(p->needle[j]),
			 " The special magic number for %s is %s.", key[0], value[j]);
	}
	p->n_needles = NEEDLES;
	snprintf(p->question, sizeof(p->question),
		 "What are all the special magic numbers for %s?", key[0]);
	snprintf(p->answer, sizeof(p->answer), "%s, %s, %s, %s", value[0], value[1], value[2],
		 value[3]);
}

static void plan_vt(struct rng *r, struct plan *p) {
	char value[1][16], name[NEEDLES][16];

	draw_distinct_number(r, 5, value, 0);
	for (unsigned j = 0; j < NEEDLES; j++) {
		draw_distinct_word(r, 'A', 5, name, j);
		snprintf(p->needle[j], sizeof(p->needle[j]), " VAR %s = %s.", name[j],
			 j == 0 ? value[0] : name[j - 1]);
	}
	p->n_needles = NEEDLES;
	snprintf(p->question, sizeof(p->question), "Which variables are equal to %s?", value[0]);
	snprintf(p->answer, sizeof(p->answer), "%s %s %s %s", name[0], name[1], name[2], name[3]);
}

/* cwe draws its words and list when the context is built; see make_cwe(). */
static void plan_cwe(struct rng *r, struct plan *p) {
	snprintf(p->question, sizeof(p->question), "What are the 3 most common words in the list?");
}

static void (*const planners[_KVD_TASK_MAX])(struct rng *r, struct plan *p) = {
	[KVD_TASK_NIAH] = plan_niah,
	[KVD_TASK_MULTIKEY] = plan_multikey,
	[KVD_TASK_MULTIVALUE] = plan_multivalue,
	[KVD_TASK_VT] = plan_vt,
	[KVD_TASK_CWE] = plan_cwe,
};

#define QUESTION_PREFIX "\nQuestion: "
#define ANSWER_PREFIX "\nAnswer:"

/* Bytes of the prompt that are not context: the question with its framing. */
static size_t suffix_size(const struct plan *p) {
	return strlen(QUESTION_PREFIX) + strlen(p->question) + strlen(ANSWER_PREFIX);
}

static size_t needles_size(const struct plan *p) {
	size_t n = 0;

	for (unsigned j = 0; j < p->n_needles; j++)
		n += strlen(p->needle[j]);
	return n;
}

uint32_t kvd_task_min_length(enum kvd_task t) {
	struct rng r = { 0 };
	struct plan p = {};

	if (t < 0 || t >= _KVD_TASK_MAX)
		return 0;
	/* Every needle, question and the cwe question have a fixed size whatever the seed. */
	planners[t](&r, &p);
	return (uint32_t)(1 + suffix_size(&p) + needles_size(&p) +
			  (t == KVD_TASK_CWE ? MIN_CWE_LIST : MIN_FILLER));
}

/*
 * Needle tasks: `size` bytes of context, the haystack from a random offset (wrapping) with
 * each needle inserted before the first space at or after its depth in the haystack part.
 * Depths are drawn after the needles and sorted, so needles keep their plan order.
 */
static int make_needles(const struct kvd_haystack *h, struct rng *r, uint64_t offset,
			const struct plan *p, size_t size, char *ret) {
	_cleanup_(freep) char *filler = NULL;
	size_t n_filler = size - needles_size(p), at[NEEDLES], prev = 0, o = 0;
	unsigned depth[NEEDLES];

	for (unsigned j = 0; j < p->n_needles; j++) {
		unsigned d = (unsigned)rand_below(r, 101), k = j;

		for (; k > 0 && depth[k - 1] > d; k--)
			depth[k] = depth[k - 1];
		depth[k] = d;
	}

	filler = malloc(n_filler);
	if (!filler)
		return -ENOMEM;
	for (size_t done = 0; done < n_filler;) {
		size_t k = MIN(n_filler - done, h->size - offset);

		memcpy(filler + done, h->text + offset, k);
		done += k;
		offset = 0;
	}

	for (unsigned j = 0; j < p->n_needles; j++) {
		size_t from = (size_t)((uint64_t)n_filler * depth[j] / 100);
		const char *sp = memchr(filler + from, ' ', n_filler - from);

		at[j] = sp ? (size_t)(sp - filler) : n_filler;
	}

	for (unsigned j = 0; j < p->n_needles; j++) {
		size_t k = strlen(p->needle[j]);

		memcpy(ret + o, filler + prev, at[j] - prev);
		o += at[j] - prev;
		memcpy(ret + o, p->needle[j], k);
		o += k;
		prev = at[j];
	}
	memcpy(ret + o, filler + prev, n_filler - prev);
	return 0;
}

/*
 * cwe: 30 distinct words (the first 3 common), then a list "1. w\n2. w\n..." of words drawn
 * with weight 6 for the common ones and 1 for the others, as long as the next item fits in
 * `size` bytes; spaces pad the rest. The answer comes from the counts in the list.
 */
static void make_cwe(struct rng *r, size_t size, struct plan *p, char *ret) {
	char words[CWE_WORDS][16];
	size_t count[CWE_WORDS] = {}, first[CWE_WORDS] = {}, o = 0;
	unsigned top[CWE_COMMON], n_top = 0;

	for (unsigned w = 0; w < CWE_WORDS; w++)
		draw_distinct_word(r, 'a', 4 + (size_t)rand_below(r, 5), words, w);

	for (size_t n = 0;; n++) {
		uint64_t x = rand_below(r, CWE_COMMON * CWE_WEIGHT + CWE_WORDS - CWE_COMMON);
		unsigned w = x < CWE_COMMON * CWE_WEIGHT ? (unsigned)(x / CWE_WEIGHT)
							 : (unsigned)(x - (CWE_COMMON * CWE_WEIGHT - CWE_COMMON));
		char item[40];
		int k = snprintf(item, sizeof(item), "%s%zu. %s", n ? "\n" : "", n + 1, words[w]);

		if (o + (size_t)k > size)
			break;
		memcpy(ret + o, item, (size_t)k);
		o += (size_t)k;
		if (count[w]++ == 0)
			first[w] = n;
	}
	memset(ret + o, ' ', size - o);

	/* The 3 most frequent, ties to the earlier first appearance; fewer if fewer occur. */
	for (; n_top < CWE_COMMON; n_top++) {
		int best = -1;

		for (unsigned w = 0; w < CWE_WORDS; w++) {
			bool taken = false;

			for (unsigned i = 0; i < n_top; i++)
				taken = taken || top[i] == w;
			if (taken || count[w] == 0)
				continue;
			if (best < 0 || count[w] > count[best] ||
			    (count[w] == count[best] && first[w] < first[best]))
				best = (int)w;
		}
		if (best < 0)
			break;
		top[n_top] = (unsigned)best;
	}
	p->answer[0] = 0;
	for (unsigned i = 0; i < n_top; i++) {
		if (i)
			strcat(p->answer, " ");
		strcat(p->answer, words[top[i]]);
	}
}

int kvd_task_make(const struct kvd_haystack *h, enum kvd_task t, uint64_t seed, uint32_t length,
		  struct kvd_task_sample *ret) {
	_cleanup_(freep) char *prompt = NULL, *question = NULL, *answer = NULL;
	struct rng r = { seed };
	struct plan p = {};
	uint64_t offset = 0;
	size_t context, o;
	int k;

	if (!h || h->size == 0 || t < 0 || t >= _KVD_TASK_MAX)
		return -EINVAL;
	if (length < kvd_task_min_length(t) || length > KVD_TASK_LENGTH_MAX)
		return -EINVAL;

	if (t != KVD_TASK_CWE)
		offset = rand_below(&r, h->size);
	planners[t](&r, &p);

	prompt = malloc(length);
	if (!prompt)
		return -ENOMEM;
	context = length - 1 - suffix_size(&p);
	if (t == KVD_TASK_CWE) {
		make_cwe(&r, context, &p, prompt);
	} else {
		k = make_needles(h, &r, offset, &p, context, prompt);
		if (k < 0)
			return k;
	}
	o = context;
	memcpy(prompt + o, QUESTION_PREFIX, strlen(QUESTION_PREFIX));
	o += strlen(QUESTION_PREFIX);
	memcpy(prompt + o, p.question, strlen(p.question));
	o += strlen(p.question);
	memcpy(prompt + o, ANSWER_PREFIX, strlen(ANSWER_PREFIX));
	o += strlen(ANSWER_PREFIX);
	prompt[o] = 0;

	question = strdup(p.question);
	answer = strdup(p.answer);
	if (!question || !answer)
		return -ENOMEM;

	*ret = (struct kvd_task_sample){
		.prompt = TAKE_PTR(prompt),
		.prompt_size = o,
		.question = TAKE_PTR(question),
		.answer = TAKE_PTR(answer),
	};
	return 0;
}

void kvd_task_sample_done(struct kvd_task_sample *s) {
	free(s->prompt);
	free(s->question);
	free(s->answer);
	*s = (struct kvd_task_sample){};
}

bool kvd_task_score(const struct kvd_task_sample *s, const char *generated) {
	size_t n = strcspn(generated, "\n");

	if (n > 0 && generated[0] == ' ') {
		generated++;
		n--;
	}
	return n == strlen(s->answer) && memcmp(generated, s->answer, n) == 0;
}
