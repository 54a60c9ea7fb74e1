/* SPDX-License-Identifier: MIT */
/*
 * The kvd-lm task generators (eval/kvd-lm/tasks.c): every task over seeds of each seed
 * range and several lengths, with the byte-level tokenizer and kvd-lm-base's, checked for
 * exact prompt length in tokens, ASCII, the question and the answer's needles in the
 * prompt, determinism, seed sensitivity and the scoring rule; and byte-for-byte parity
 * with tasks.py through a golden file that it wrote.
 *
 * Environment (set by meson): KVD_LM_HAYSTACK, the haystack file, KVD_LM_TOKENIZER,
 * kvd-lm-base's tokenizer, and KVD_LM_GOLDEN, the golden file. The golden file is
 * regenerated, from the repository root, with
 *
 *   (for t in bytes eval/kvd-lm/models/kvd-lm-base.kvdtok; do
 *       python3 eval/kvd-lm/tasks.py --format golden --task all --tokenizer $t \
 *           --seed 1,4294967303,1099511627779 --length min,512,1024; done) \
 *       > tests/data/kvd-lm/tasks-golden.txt
 *
 * Each record there is "task T seed S length L tokenizer K\nprompt N\n" + N prompt bytes
 * + "\nquestion Q\nanswer A\n\n" (K: bytes, or the tokenizer file's name without
 * .kvdtok); this test regenerates each record from its header line and compares.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "tasks.h"
#include "test.h"

/* The haystack cut for each tokenizer: the byte-level one, kvd-lm-base's. */
static struct kvdlm_tokenizer *toks[2];
static struct kvd_haystack *hays[2];
static const char *tok_names[2] = { "bytes", "kvd-lm-base" };
static struct kvd_haystack *haystack; /* hays[0] */

static void cleanup(void) {
	for (unsigned i = 0; i < 2; i++) {
		hays[i] = kvd_haystack_free(hays[i]);
		toks[i] = kvdlm_tokenizer_free(toks[i]);
	}
}

int test_setup(void) {
	const char *path = getenv("KVD_LM_HAYSTACK"), *tok = getenv("KVD_LM_TOKENIZER");
	char err[256];
	int r;

	if (!path || !tok) {
		fprintf(stderr, "KVD_LM_HAYSTACK or KVD_LM_TOKENIZER is not set\n");
		return -EINVAL;
	}
	atexit(cleanup);
	r = kvdlm_tokenizer_bytes(&toks[0]);
	if (r < 0)
		return r;
	r = kvdlm_tokenizer_load(tok, &toks[1], err, sizeof(err));
	if (r < 0) {
		fprintf(stderr, "%s\n", err);
		return r;
	}
	for (unsigned i = 0; i < 2; i++) {
		r = kvd_haystack_load(path, toks[i], &hays[i]);
		if (r < 0)
			return r;
	}
	haystack = hays[0];
	return 0;
}

static const uint64_t seeds[] = {
	KVD_TASK_SEED_TRAIN_BEGIN,
	1,
	12345,
	KVD_TASK_SEED_TRAIN_END - 1,
	KVD_TASK_SEED_TUNE_BEGIN,
	KVD_TASK_SEED_TUNE_BEGIN + 7,
	KVD_TASK_SEED_TUNE_END - 1,
	KVD_TASK_SEED_REPORT_BEGIN,
	KVD_TASK_SEED_REPORT_BEGIN + 3,
	KVD_TASK_SEED_REPORT_END - 1,
};

static const uint32_t lengths[] = { 256, 1024, 4096 };

static size_t count(const char *s, size_t n, const char *what) {
	size_t c = 0, k = strlen(what);

	for (const char *p = s; (p = memmem(p, n - (size_t)(p - s), what, k)); p += k)
		c++;
	return c;
}

/* Where `what` is in the prompt, which must hold it exactly once. */
static size_t find_once(const struct kvd_task_sample *s, const char *what) {
	const char *p = memmem(s->prompt, s->prompt_size, what, strlen(what));

	if (!p || count(s->prompt, s->prompt_size, what) != 1)
		test_fail(__FILE__, __LINE__, "\"%s\" is %zu times in the prompt", what,
			  count(s->prompt, s->prompt_size, what));
	return (size_t)(p - s->prompt);
}

/* The needle tasks: the answer's needles, in the order the answer gives them. */
static void check_needles(enum kvd_task t, const struct kvd_task_sample *s) {
	char key[8], value[8], names[4][8], needle[128];
	size_t at, prev = 0;

	switch (t) {
	case KVD_TASK_NIAH:
	case KVD_TASK_MULTIKEY:
		ASSERT_EQ(sscanf(s->question, "What is the special magic number for %6[a-z]?", key), 1);
		snprintf(needle, sizeof(needle), " The special magic number for %s is %s.", key,
			 s->answer);
		find_once(s, needle);
		ASSERT_EQ(count(s->prompt, s->prompt_size, " The special magic number for "),
			  t == KVD_TASK_NIAH ? 1u : 4u);
		break;
	case KVD_TASK_MULTIVALUE: {
		char v[4][8];

		ASSERT_EQ(sscanf(s->question, "What are all the special magic numbers for %6[a-z]?",
				 key), 1);
		ASSERT_EQ(sscanf(s->answer, "%7[0-9], %7[0-9], %7[0-9], %7[0-9]", v[0], v[1], v[2],
				 v[3]), 4);
		for (unsigned j = 0; j < 4; j++) {
			snprintf(needle, sizeof(needle), " The special magic number for %s is %s.",
				 key, v[j]);
			at = find_once(s, needle);
			ASSERT_TRUE(j == 0 || at > prev);
			prev = at;
		}
		break;
	}
	case KVD_TASK_VT:
		ASSERT_EQ(sscanf(s->question, "Which variables are equal to %5[0-9]?", value), 1);
		ASSERT_EQ(sscanf(s->answer, "%5[A-Z] %5[A-Z] %5[A-Z] %5[A-Z]", names[0], names[1],
				 names[2], names[3]), 4);
		for (unsigned j = 0; j < 4; j++) {
			snprintf(needle, sizeof(needle), " VAR %s = %s.", names[j],
				 j == 0 ? value : names[j - 1]);
			at = find_once(s, needle);
			ASSERT_TRUE(j == 0 || at > prev);
			prev = at;
		}
		ASSERT_EQ(count(s->prompt, s->prompt_size, " VAR "), 4u);
		break;
	default:
		test_fail(__FILE__, __LINE__, "not a needle task");
	}
}

/*
 * cwe: the context is "1. w\n2. w\n..." padded with fewer spaces than an item takes, and
 * the answer holds the 3 most frequent words, ties to the earlier first appearance.
 */
static void check_cwe(const struct kvd_task_sample *s, size_t context) {
	char words[64][16], answer[3][16];
	size_t n_words = 0, cnt[64] = {}, first[64] = {}, item = 0, o = 0;
	int k;

	/* Parsed by hand: sscanf() would measure the rest of a 1 MiB prompt at every item. */
	while (o < context && s->prompt[o] != ' ') {
		char w[16], *end;
		size_t len = 0, w_at;

		ASSERT_EQ(strtoull(s->prompt + o, &end, 10), item + 1);
		ASSERT_TRUE(end[0] == '.' && end[1] == ' ');
		o = (size_t)(end + 2 - s->prompt);
		for (; o < context && s->prompt[o] >= 'a' && s->prompt[o] <= 'z' && len < 9; o++)
			w[len++] = s->prompt[o];
		w[len] = 0;
		ASSERT_TRUE(len >= 4 && len <= 8);
		if (o < context && s->prompt[o] == '\n')
			o++;
		for (w_at = 0; w_at < n_words && strcmp(words[w_at], w) != 0; w_at++)
			;
		if (w_at == n_words) {
			ASSERT_LT(n_words, 30u);
			snprintf(words[n_words++], sizeof(words[0]), "%s", w);
			first[w_at] = item;
		}
		cnt[w_at]++;
		item++;
	}
	ASSERT_GT(item, 3u);
	/* The padding: only spaces, fewer than the longest possible next item takes. */
	ASSERT_LT(context - o, (size_t)snprintf(NULL, 0, "\n%zu. abcdefgh", item + 1));
	for (; o < context; o++)
		ASSERT_EQ(s->prompt[o], ' ');

	ASSERT_EQ(sscanf(s->answer, "%15[a-z] %15[a-z] %15[a-z]%n", answer[0], answer[1],
			 answer[2], &k), 3);
	ASSERT_EQ((size_t)k, strlen(s->answer));
	for (unsigned j = 0; j < 3; j++) {
		size_t a;

		for (a = 0; a < n_words && strcmp(words[a], answer[j]) != 0; a++)
			;
		ASSERT_LT(a, n_words);
		/* Every word not yet named ranks at most where this one does. */
		for (size_t w = 0; w < n_words; w++) {
			bool named = false;

			for (unsigned i = 0; i <= j; i++)
				named = named || strcmp(words[w], answer[i]) == 0;
			if (!named)
				ASSERT_TRUE(cnt[w] < cnt[a] || (cnt[w] == cnt[a] && first[w] > first[a]));
		}
	}
}

static void check_sample(const struct kvd_haystack *h, enum kvd_task t, uint32_t length,
			 const struct kvd_task_sample *s) {
	/* A number's answer: its space ends the prompt, and the model goes on from there. */
	bool number = t != KVD_TASK_VT && t != KVD_TASK_CWE;
	const char *lead = number ? "" : " ";
	char suffix[128], buf[128];
	size_t n = strlen(s->answer);

	ASSERT_EQ(kvdlm_tokenizer_count(h->tok, s->prompt, s->prompt_size) + 1, (size_t)length);
	ASSERT_EQ(strlen(s->prompt), s->prompt_size);
	for (size_t i = 0; i < s->prompt_size; i++)
		ASSERT_TRUE((s->prompt[i] >= 0x20 && s->prompt[i] <= 0x7e) || s->prompt[i] == '\n');

	snprintf(suffix, sizeof(suffix), "\nQuestion: %s\nAnswer:%s", s->question, number ? " " : "");
	ASSERT_GE(s->prompt_size, strlen(suffix));
	ASSERT_STREQ(s->prompt + s->prompt_size - strlen(suffix), suffix);
	ASSERT_EQ(s->context_size, s->prompt_size - strlen(suffix));
	if (number)
		ASSERT_TRUE(s->answer[0] >= '1' && s->answer[0] <= '9');
	if (t == KVD_TASK_CWE) {
		check_cwe(s, s->context_size);
	} else {
		/* The context is one line: the question's newline is the first. */
		ASSERT_EQ((size_t)(strchr(s->prompt, '\n') - s->prompt), s->context_size);
		check_needles(t, s);
	}

	ASSERT_GT(n, 0u);
	ASSERT_LE(n + 2, (size_t)KVD_TASK_GENERATE_MAX);
	snprintf(buf, sizeof(buf), "%s%s\n", lead, s->answer);
	ASSERT_TRUE(kvd_task_score(s, buf));
	snprintf(buf, sizeof(buf), "%s%s\nQuestion: anything", lead, s->answer);
	ASSERT_TRUE(kvd_task_score(s, buf));
	ASSERT_TRUE(kvd_task_score(s, s->answer));
	/* One space more than the prompt leaves: after a number's space, none. */
	snprintf(buf, sizeof(buf), " %s%s\n", lead, s->answer);
	ASSERT_FALSE(kvd_task_score(s, buf));
	snprintf(buf, sizeof(buf), "%s%s.\n", lead, s->answer);
	ASSERT_FALSE(kvd_task_score(s, buf));
	snprintf(buf, sizeof(buf), "%s%.*s\n", lead, (int)n - 1, s->answer);
	ASSERT_FALSE(kvd_task_score(s, buf));
	snprintf(buf, sizeof(buf), "%s%s\n", lead, s->answer);
	buf[strlen(lead) + n - 1] = buf[strlen(lead) + n - 1] == '0' ? '1' : '0';
	ASSERT_FALSE(kvd_task_score(s, buf));
	ASSERT_FALSE(kvd_task_score(s, ""));
	ASSERT_FALSE(kvd_task_score(s, "\n"));
}

TEST(names) {
	for (int t = 0; t < _KVD_TASK_MAX; t++) {
		const char *name = kvd_task_to_string(t);

		ASSERT_NOT_NULL(name);
		ASSERT_EQ(kvd_task_from_string(name), t);
	}
	ASSERT_STREQ(kvd_task_to_string(KVD_TASK_VT), "vt");
	ASSERT_NULL(kvd_task_to_string(_KVD_TASK_MAX));
	ASSERT_NULL(kvd_task_to_string(_KVD_TASK_INVALID));
	ASSERT_EQ(kvd_task_from_string("NIAH"), _KVD_TASK_INVALID);
	ASSERT_EQ(kvd_task_from_string(""), _KVD_TASK_INVALID);
	ASSERT_EQ(kvd_task_from_string(NULL), _KVD_TASK_INVALID);
}

TEST(haystack) {
	ASSERT_GT(haystack->size, 100000u);
	ASSERT_EQ(strlen(haystack->text), haystack->size);
	ASSERT_NULL(strstr(haystack->text, "  "));
	ASSERT_TRUE(haystack->text[0] != ' ');
	ASSERT_ERRNO(kvd_haystack_load("/nonexistent/haystack.txt", toks[0],
				       &(struct kvd_haystack *){ NULL }), -ENOENT);
	ASSERT_ERRNO(kvd_haystack_load("/dev/null", toks[0], &(struct kvd_haystack *){ NULL }),
		     -EBADMSG);
	ASSERT_ERRNO(kvd_haystack_load(getenv("KVD_LM_HAYSTACK"), NULL,
				       &(struct kvd_haystack *){ NULL }), -EINVAL);
	/* The stream: one space, then the text less its final space; its pieces tile it,
	 * and the byte-level one has a token per byte. */
	ASSERT_EQ(haystack->text[haystack->size - 1], ' ');
	for (unsigned i = 0; i < 2; i++) {
		const struct kvd_haystack *h = hays[i];

		ASSERT_EQ(h->unit_size, h->size);
		ASSERT_EQ(h->unit[0], ' ');
		ASSERT_EQ(memcmp(h->unit + 1, h->text, h->size - 1), 0);
		ASSERT_EQ(h->piece_start[h->pieces], h->unit_size);
		ASSERT_EQ(h->piece_tokens[h->pieces],
			  kvdlm_tokenizer_count(h->tok, h->unit, h->unit_size));
	}
	ASSERT_EQ(hays[0]->piece_tokens[hays[0]->pieces], hays[0]->unit_size);
	/* kvd-lm-base's tokens hold about 3 bytes each of this text. */
	ASSERT_GT(hays[1]->unit_size, 2 * (size_t)hays[1]->piece_tokens[hays[1]->pieces]);
}

/* The minimum lengths the README gives, and refusals around the bounds. */
TEST(bounds) {
	static const uint32_t min[_KVD_TASK_MAX] = {
		[KVD_TASK_NIAH] = 177,
		[KVD_TASK_MULTIKEY] = 321,
		[KVD_TASK_MULTIVALUE] = 327,
		[KVD_TASK_VT] = 195,
		[KVD_TASK_CWE] = 193,
	};
	struct kvd_task_sample s = {};

	for (unsigned i = 0; i < 2; i++)
	for (int t = 0; t < _KVD_TASK_MAX; t++) {
		const struct kvd_haystack *h = hays[i];

		ASSERT_EQ(kvd_task_min_length(t), min[t]);
		ASSERT_ERRNO(kvd_task_make(h, t, 1, min[t] - 1, &s), -EINVAL);
		ASSERT_ERRNO(kvd_task_make(h, t, 1, KVD_TASK_LENGTH_MAX + 1, &s), -EINVAL);
		ASSERT_ERRNO(kvd_task_make(NULL, t, 1, 1024, &s), -EINVAL);
		ASSERT_NULL(s.prompt);

		ASSERT_OK(kvd_task_make(h, t, 1, min[t], &s));
		check_sample(h, t, min[t], &s);
		kvd_task_sample_done(&s);

		/* The longest wraps around the haystack several times. */
		ASSERT_OK(kvd_task_make(h, t, KVD_TASK_SEED_REPORT_BEGIN, KVD_TASK_LENGTH_MAX,
					&s));
		check_sample(h, t, KVD_TASK_LENGTH_MAX, &s);
		kvd_task_sample_done(&s);
		ASSERT_NULL(s.prompt);
	}
	ASSERT_EQ(kvd_task_min_length(_KVD_TASK_MAX), 0u);
	ASSERT_ERRNO(kvd_task_make(haystack, _KVD_TASK_MAX, 1, 1024, &s), -EINVAL);
	ASSERT_ERRNO(kvd_task_make(haystack, _KVD_TASK_INVALID, 1, 1024, &s), -EINVAL);
}

TEST(samples) {
	for (unsigned k = 0; k < 2; k++)
	for (int t = 0; t < _KVD_TASK_MAX; t++)
		for (size_t l = 0; l < ELEMENTSOF(lengths); l++) {
			const struct kvd_haystack *h = hays[k];
			uint32_t length = lengths[l];
			struct kvd_task_sample prev = {};

			if (length < kvd_task_min_length(t)) {
				ASSERT_ERRNO(kvd_task_make(h, t, 1, length, &prev), -EINVAL);
				length = kvd_task_min_length(t);
			}
			for (size_t i = 0; i < ELEMENTSOF(seeds); i++) {
				struct kvd_task_sample s = {}, again = {};

				ASSERT_OK(kvd_task_make(h, t, seeds[i], length, &s));
				check_sample(h, t, length, &s);

				ASSERT_OK(kvd_task_make(h, t, seeds[i], length, &again));
				ASSERT_EQ(again.prompt_size, s.prompt_size);
				ASSERT_EQ(memcmp(again.prompt, s.prompt, s.prompt_size), 0);
				ASSERT_STREQ(again.question, s.question);
				ASSERT_STREQ(again.answer, s.answer);
				kvd_task_sample_done(&again);

				if (prev.prompt)
					ASSERT_TRUE(prev.prompt_size != s.prompt_size ||
						    memcmp(prev.prompt, s.prompt, s.prompt_size) != 0);
				kvd_task_sample_done(&prev);
				prev = s;
			}
			kvd_task_sample_done(&prev);
		}
}

/* Parity with tasks.py: every record of the golden file, regenerated here. */
TEST(golden) {
	const char *path = getenv("KVD_LM_GOLDEN");
	_cleanup_(freep) char *golden = NULL;
	size_t size, o = 0, records = 0;
	bool task_seen[_KVD_TASK_MAX] = {}, range_seen[3] = {}, tok_seen[2] = {};

	if (!path)
		test_fail(__FILE__, __LINE__, "KVD_LM_GOLDEN is not set");
	golden = test_read_file(path, &size);

	while (o < size) {
		_cleanup_(freep) char *record = NULL;
		struct kvd_task_sample s = {};
		char name[16], tok[32];
		const struct kvd_haystack *h = NULL;
		uint64_t seed;
		uint32_t length;
		size_t record_size, diff;
		FILE *f;
		enum kvd_task t;

		if (sscanf(golden + o, "task %15s seed %" SCNu64 " length %" SCNu32 " tokenizer %31s",
			   name, &seed, &length, tok) != 4)
			test_fail(__FILE__, __LINE__, "%s: no record header at byte %zu", path, o);
		t = kvd_task_from_string(name);
		ASSERT_GE(t, 0);
		for (unsigned i = 0; i < 2; i++)
			if (strcmp(tok, tok_names[i]) == 0) {
				h = hays[i];
				tok_seen[i] = true;
			}
		if (!h)
			test_fail(__FILE__, __LINE__, "%s: unknown tokenizer %s", path, tok);
		ASSERT_OK(kvd_task_make(h, t, seed, length, &s));

		f = open_memstream(&record, &record_size);
		ASSERT_NOT_NULL(f);
		fprintf(f, "task %s seed %" PRIu64 " length %" PRIu32 " tokenizer %s\nprompt %zu\n",
			name, seed, length, tok, s.prompt_size);
		fwrite(s.prompt, 1, s.prompt_size, f);
		fprintf(f, "\nquestion %s\nanswer %s\n\n", s.question, s.answer);
		ASSERT_EQ(fclose(f), 0);
		kvd_task_sample_done(&s);

		for (diff = 0; diff < record_size && o + diff < size && record[diff] == golden[o + diff];
		     diff++)
			;
		if (diff < record_size)
			test_fail(__FILE__, __LINE__,
				  "%s: %s seed %" PRIu64 " length %" PRIu32
				  " tokenizer %s differs from tasks.py at byte %zu of its record",
				  path, name, seed, length, tok, diff);
		o += record_size;
		records++;
		task_seen[t] = true;
		range_seen[0] |= seed < KVD_TASK_SEED_TRAIN_END;
		range_seen[1] |= seed >= KVD_TASK_SEED_TUNE_BEGIN && seed < KVD_TASK_SEED_TUNE_END;
		range_seen[2] |= seed >= KVD_TASK_SEED_REPORT_BEGIN && seed < KVD_TASK_SEED_REPORT_END;
	}
	printf("golden: %zu records match tasks.py\n", records);
	for (int t = 0; t < _KVD_TASK_MAX; t++)
		ASSERT_TRUE(task_seen[t]);
	for (unsigned i = 0; i < 3; i++)
		ASSERT_TRUE(range_seen[i]);
	for (unsigned i = 0; i < 2; i++)
		ASSERT_TRUE(tok_seen[i]);
}
