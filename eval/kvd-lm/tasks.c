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
#include "tokenizer.h"

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
		free(h->unit);
		free(h->piece_start);
		free(h->piece_tokens);
		free(h);
	}
	return NULL;
}

static int stream_piece(const uint8_t *p, size_t size, void *userdata) {
	struct kvd_haystack *h = userdata;
	size_t i = h->pieces++;

	h->piece_start[i + 1] = h->piece_start[i] + (uint32_t)size;
	h->piece_tokens[i + 1] = h->piece_tokens[i] + (uint32_t)kvdlm_tokenizer_count(h->tok, p, size);
	return 0;
}

/*
 * The stream the needle tasks draw from: one space, then the text without its trailing
 * spaces, cut into the tokenizer's pieces. Repeated, it reads on naturally, and no piece
 * spans two repeats (a space starts a piece).
 */
static int haystack_stream(struct kvd_haystack *h) {
	size_t n = h->size;

	while (n > 0 && h->text[n - 1] == ' ')
		n--;
	if (n == 0)
		return -EBADMSG;
	h->unit = malloc(n + 2);
	h->piece_start = malloc((n + 2) * sizeof(*h->piece_start));
	h->piece_tokens = malloc((n + 2) * sizeof(*h->piece_tokens));
	if (!h->unit || !h->piece_start || !h->piece_tokens)
		return -ENOMEM;
	h->unit[0] = ' ';
	memcpy(h->unit + 1, h->text, n);
	h->unit[n + 1] = 0;
	h->unit_size = n + 1;
	h->piece_start[0] = h->piece_tokens[0] = 0;
	return kvdlm_pieces(h->unit, h->unit_size, stream_piece, h);
}

int kvd_haystack_load(const char *path, const struct kvdlm_tokenizer *tok, struct kvd_haystack **ret) {
	_cleanup_(kvd_haystack_freep) struct kvd_haystack *h = NULL;
	_cleanup_(closep) int fd = -EBADF;
	struct stat st;
	size_t n = 0;
	int r;

	if (!path || !tok)
		return -EINVAL;
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
	h->tok = tok;
	r = haystack_stream(h);
	if (r < 0)
		return r;

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
	bool number; /* the answer starts with a number: the prompt ends with its space */
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
	p->number = true;
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
	p->number = true;
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
	p->number = true;
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
/*
 * A number's leading space is a token of its own (README, "Tokens"); where the answer
 * starts with a number, that space ends the prompt, so that the prompt's last query is the
 * one that predicts the number (README, "Tasks").
 */
#define ANSWER_NUMBER_PREFIX "\nAnswer: "

/* A growing byte buffer; on -ENOMEM it stays as it was. */
struct buf {
	char *p;
	size_t size, room;
};

static int buf_add(struct buf *b, const void *p, size_t n) {
	if (b->size + n + 1 > b->room) {
		size_t room = MAX(2 * b->room, b->size + n + 1);
		char *q = realloc(b->p, room);

		if (!q)
			return -ENOMEM;
		b->p = q;
		b->room = room;
	}
	memcpy(b->p + b->size, p, n);
	b->size += n;
	b->p[b->size] = 0;
	return 0;
}

static int buf_spaces(struct buf *b, size_t n) {
	for (; n > 0; n--)
		if (buf_add(b, " ", 1) < 0)
			return -ENOMEM;
	return 0;
}

/* unit[from..from + n) of the haystack stream repeated, wrapping around. */
static int buf_stream(struct buf *b, const struct kvd_haystack *h, uint64_t from, uint64_t n) {
	from %= h->unit_size;
	while (n > 0) {
		size_t k = (size_t)MIN(n, h->unit_size - from);

		if (buf_add(b, h->unit + from, k) < 0)
			return -ENOMEM;
		n -= k;
		from = 0;
	}
	return 0;
}

static size_t count(const struct kvd_haystack *h, const char *s) {
	return kvdlm_tokenizer_count(h->tok, s, strlen(s));
}

/* The question with its framing, the prompt's tail. */
static void suffix(const struct plan *p, char *ret, size_t size) {
	snprintf(ret, size, "%s%s%s", QUESTION_PREFIX, p->question,
		 p->number ? ANSWER_NUMBER_PREFIX : ANSWER_PREFIX);
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
	char tail[256];

	if (t < 0 || t >= _KVD_TASK_MAX)
		return 0;
	/* Every needle and question has a fixed size in bytes whatever the seed, and no
	 * tokenizer makes more tokens than bytes. */
	planners[t](&r, &p);
	suffix(&p, tail, sizeof(tail));
	return (uint32_t)(1 + strlen(tail) + needles_size(&p) +
			  (t == KVD_TASK_CWE ? MIN_CWE_LIST : MIN_FILLER));
}

/*
 * Where piece `a` (counted from the stream's start, repeats included) starts: in tokens and
 * in bytes.
 */
static uint64_t piece_token(const struct kvd_haystack *h, uint64_t a) {
	return a / h->pieces * h->piece_tokens[h->pieces] + h->piece_tokens[a % h->pieces];
}

static uint64_t piece_byte(const struct kvd_haystack *h, uint64_t a) {
	return a / h->pieces * h->unit_size + h->piece_start[a % h->pieces];
}

/* The first piece, from the stream's start, that starts at or after token `t`. */
static uint64_t piece_at_token(const struct kvd_haystack *h, uint64_t t) {
	uint64_t total = h->piece_tokens[h->pieces], rep = t / total, rem = t % total;
	size_t lo = 0, hi = h->pieces; /* the first j with piece_tokens[j] >= rem */

	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;

		if (h->piece_tokens[mid] < rem)
			lo = mid + 1;
		else
			hi = mid;
	}
	return rep * h->pieces + lo;
}

/*
 * Needle tasks: `size` tokens of context. The haystack part is the whole pieces of the
 * stream from piece `offset` on that fit in what the needles leave, then single spaces up
 * to that size; each needle goes before the first piece starting with a space at or after
 * its depth (in tokens) of the haystack part, pads included. Depths are drawn after the
 * needles and sorted, so needles keep their plan order.
 */
static int make_needles(const struct kvd_haystack *h, struct rng *r, uint64_t offset,
			const struct plan *p, size_t size, struct buf *out) {
	uint64_t n_filler = size, first_tok = h->piece_tokens[offset], end, whole, got;
	uint64_t at[NEEDLES], prev = 0, prev_byte;
	unsigned depth[NEEDLES];

	for (unsigned j = 0; j < p->n_needles; j++)
		n_filler -= count(h, p->needle[j]);
	for (unsigned j = 0; j < p->n_needles; j++) {
		unsigned d = (unsigned)rand_below(r, 101), k = j;

		for (; k > 0 && depth[k - 1] > d; k--)
			depth[k] = depth[k - 1];
		depth[k] = d;
	}

	/* Whole pieces [offset, end) hold `got` tokens; the pads make up the rest. */
	end = piece_at_token(h, first_tok + n_filler);
	if (piece_token(h, end) > first_tok + n_filler)
		end--;
	whole = end - offset;
	got = piece_token(h, end) - first_tok;

	/* Positions: 0..whole are before whole piece k (whole: the first pad), whole + i before
	 * pad i, whole + pads the end. */
	for (unsigned j = 0; j < p->n_needles; j++) {
		uint64_t t = n_filler * depth[j] / 100, k;

		k = t <= got ? piece_at_token(h, first_tok + t) - offset : whole + (t - got);
		k = MAX(k, prev);
		while (k < whole && h->unit[h->piece_start[(offset + k) % h->pieces]] != ' ')
			k++;
		at[j] = prev = k;
	}

	prev = 0;
	prev_byte = piece_byte(h, offset);
	for (unsigned j = 0; j <= p->n_needles; j++) {
		uint64_t k = j < p->n_needles ? at[j] : whole + (n_filler - got);
		uint64_t upto = MIN(k, whole);

		if (upto > prev) {
			uint64_t b = piece_byte(h, offset + upto);

			if (buf_stream(out, h, prev_byte, b - prev_byte) < 0)
				return -ENOMEM;
			prev_byte = b;
		}
		if (k > MAX(prev, whole) && buf_spaces(out, (size_t)(k - MAX(prev, whole))) < 0)
			return -ENOMEM;
		prev = k;
		if (j < p->n_needles && buf_add(out, p->needle[j], strlen(p->needle[j])) < 0)
			return -ENOMEM;
	}
	return 0;
}

/*
 * cwe: 30 distinct words (the first 3 common), then a list "1. w\n2. w\n..." of words drawn
 * with weight 6 for the common ones and 1 for the others, as long as the next item fits in
 * `size` tokens; spaces pad the rest. The answer comes from the counts in the list.
 */
static int make_cwe(const struct kvd_haystack *h, struct rng *r, size_t size, struct plan *p,
		    struct buf *out) {
	char words[CWE_WORDS][16];
	size_t count_of[CWE_WORDS] = {}, first[CWE_WORDS] = {}, o = 0;
	unsigned top[CWE_COMMON], n_top = 0;

	for (unsigned w = 0; w < CWE_WORDS; w++)
		draw_distinct_word(r, 'a', 4 + (size_t)rand_below(r, 5), words, w);

	for (size_t n = 0;; n++) {
		uint64_t x = rand_below(r, CWE_COMMON * CWE_WEIGHT + CWE_WORDS - CWE_COMMON);
		unsigned w = x < CWE_COMMON * CWE_WEIGHT ? (unsigned)(x / CWE_WEIGHT)
							 : (unsigned)(x - (CWE_COMMON * CWE_WEIGHT - CWE_COMMON));
		char item[40];
		int k = snprintf(item, sizeof(item), "%s%zu. %s", n ? "\n" : "", n + 1, words[w]);
		size_t tokens = count(h, item);

		if (o + tokens > size)
			break;
		if (buf_add(out, item, (size_t)k) < 0)
			return -ENOMEM;
		o += tokens;
		if (count_of[w]++ == 0)
			first[w] = n;
	}
	if (buf_spaces(out, size - o) < 0)
		return -ENOMEM;

	/* The 3 most frequent, ties to the earlier first appearance; fewer if fewer occur. */
	for (; n_top < CWE_COMMON; n_top++) {
		int best = -1;

		for (unsigned w = 0; w < CWE_WORDS; w++) {
			bool taken = false;

			for (unsigned i = 0; i < n_top; i++)
				taken = taken || top[i] == w;
			if (taken || count_of[w] == 0)
				continue;
			if (best < 0 || count_of[w] > count_of[best] ||
			    (count_of[w] == count_of[best] && first[w] < first[best]))
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
	return 0;
}

int kvd_task_make(const struct kvd_haystack *h, enum kvd_task t, uint64_t seed, uint32_t length,
		  struct kvd_task_sample *ret) {
	_cleanup_(freep) char *question = NULL, *answer = NULL;
	struct buf prompt = {};
	struct rng r = { seed };
	struct plan p = {};
	uint64_t offset = 0;
	size_t context_size;
	char tail[256];
	int k;

	if (!h || h->size == 0 || t < 0 || t >= _KVD_TASK_MAX)
		return -EINVAL;
	if (length < kvd_task_min_length(t) || length > KVD_TASK_LENGTH_MAX)
		return -EINVAL;

	if (t != KVD_TASK_CWE)
		offset = rand_below(&r, h->pieces);
	planners[t](&r, &p);
	suffix(&p, tail, sizeof(tail));

	if (t == KVD_TASK_CWE)
		k = make_cwe(h, &r, length - 1 - count(h, tail), &p, &prompt);
	else
		k = make_needles(h, &r, offset, &p, length - 1 - count(h, tail), &prompt);
	context_size = prompt.size;
	if (k >= 0)
		k = buf_add(&prompt, tail, strlen(tail));
	question = strdup(p.question);
	answer = strdup(p.answer);
	if (k < 0 || !question || !answer) {
		free(prompt.p);
		return -ENOMEM;
	}

	*ret = (struct kvd_task_sample){
		.prompt = prompt.p,
		.prompt_size = prompt.size,
		.context_size = context_size,
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

	if (n > 0 && generated[0] == ' ' && s->prompt[s->prompt_size - 1] != ' ') {
		generated++;
		n--;
	}
	return n == strlen(s->answer) && memcmp(generated, s->answer, n) == 0;
}
