/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The kvd-lm tasks (eval/kvd-lm/README.md, "Tasks"): long-context retrieval and
 * aggregation prompts generated from a 64-bit seed, byte for byte the same as tasks.py
 * generates them, so that a model trained on the Python side is measured on the C side
 * with the very same prompts (tests/kvd-lm/test-tasks.c checks both against a golden file).
 *
 * A sample is a prompt, a question and an answer. The prompt holds the bytes that follow
 * BOS, sized in the tokens of the haystack's tokenizer: BOS + the prompt's tokens are
 * exactly `length` tokens. Every byte is printable ASCII or '\n', never NUL, so the
 * strings are also NUL-terminated. The prompt is the context, then its tail
 * "\nQuestion: QUESTION\nAnswer:", which ends with a space where the answer starts with a
 * number (niah, multikey, multivalue): a number's space is a token of its own, and the
 * model's answer goes on from it.
 *
 * Nothing here prints, keeps global state or depends on the locale; a haystack is read-only
 * once loaded and may be shared by threads.
 */

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tokenizer.h"

enum kvd_task {
	KVD_TASK_NIAH,
	KVD_TASK_MULTIKEY,
	KVD_TASK_MULTIVALUE,
	KVD_TASK_VT,
	KVD_TASK_CWE,
	_KVD_TASK_MAX,
	_KVD_TASK_INVALID = -EINVAL,
};

/* Seed ranges, [BEGIN, END): training and tuning never draw from the reporting range. */
#define KVD_TASK_SEED_TRAIN_BEGIN UINT64_C(0)
#define KVD_TASK_SEED_TRAIN_END (UINT64_C(1) << 32)
#define KVD_TASK_SEED_TUNE_BEGIN (UINT64_C(1) << 32)
#define KVD_TASK_SEED_TUNE_END ((UINT64_C(1) << 32) + (UINT64_C(1) << 20))
#define KVD_TASK_SEED_REPORT_BEGIN (UINT64_C(1) << 40)
#define KVD_TASK_SEED_REPORT_END ((UINT64_C(1) << 40) + (UINT64_C(1) << 20))

/* The longest prompt, BOS included. */
#define KVD_TASK_LENGTH_MAX (UINT32_C(1) << 20)

/*
 * How many tokens the engine generates at most for an answer: enough for the longest
 * expected output, multivalue's " " + 34 bytes + "\n".
 */
#define KVD_TASK_GENERATE_MAX 48

/*
 * The haystack text (data/haystack.txt without its final newline): printable ASCII; and
 * the stream the needle tasks cut from it, in the pieces of a tokenizer.
 */
struct kvd_haystack {
	char *text;
	size_t size;
	const struct kvdlm_tokenizer *tok;
	char *unit;              /* " " + text without its trailing spaces */
	size_t unit_size;
	size_t pieces;           /* how many pieces unit has */
	uint32_t *piece_start;   /* [pieces + 1]: the byte where each starts in unit */
	uint32_t *piece_tokens;  /* [pieces + 1]: the tokens before each */
};

struct kvd_task_sample {
	char *prompt; /* prompt_size bytes after BOS, NUL-terminated */
	size_t prompt_size;
	size_t context_size; /* where the question's tail ("\nQuestion: ...") starts */
	char *question;
	char *answer;
};

/* "niah", "multikey", "multivalue", "vt", "cwe"; NULL for anything else. */
const char *kvd_task_to_string(enum kvd_task t);
/* The task of a name from kvd_task_to_string(), or _KVD_TASK_INVALID. */
enum kvd_task kvd_task_from_string(const char *s);

/*
 * Reads a haystack file: one line of printable ASCII, at most 64 MiB, optionally ending
 * in '\n' (dropped), and cuts it for tok, which must outlive the haystack. Returns 0, or
 * -EINVAL (path or tok NULL), -ENOMEM, -EFBIG (too large), -EBADMSG (empty, spaces only,
 * or a byte that is not printable ASCII), or the -errno of open/fstat/read.
 */
int kvd_haystack_load(const char *path, const struct kvdlm_tokenizer *tok, struct kvd_haystack **ret);
/* Frees h (NULL is fine) and returns NULL. */
struct kvd_haystack *kvd_haystack_free(struct kvd_haystack *h);
static inline void kvd_haystack_freep(struct kvd_haystack **h) {
	*h = kvd_haystack_free(*h);
}

/*
 * The smallest length (BOS included) task t accepts: the one that leaves 64 tokens of
 * haystack around the needles, or 128 tokens of word list for cwe, whatever the tokenizer
 * (counting a token per byte of the needles and question, the most there can be). It
 * does not depend on the seed. 0 for an invalid task.
 */
uint32_t kvd_task_min_length(enum kvd_task t);

/*
 * Generates the sample of task t for seed, with a prompt of exactly `length` tokens of the
 * haystack's tokenizer (BOS included). cwe does not read the haystack, but h must be given
 * all the same (its tokenizer sizes the list). On success
 * *ret owns its strings (release them with kvd_task_sample_done()); on failure *ret is
 * untouched. Returns 0, -EINVAL (h NULL or empty, t invalid, length below
 * kvd_task_min_length(t) or above KVD_TASK_LENGTH_MAX) or -ENOMEM.
 */
int kvd_task_make(const struct kvd_haystack *h, enum kvd_task t, uint64_t seed, uint32_t length,
		  struct kvd_task_sample *ret);
/* Frees the strings of s and zeroes it; a zeroed sample is fine. */
void kvd_task_sample_done(struct kvd_task_sample *s);

/*
 * The exact-match rule: `generated` up to its first '\n' (all of it without one), less one
 * leading space if it has one and the prompt does not end with a space, must equal the
 * answer.
 */
bool kvd_task_score(const struct kvd_task_sample *s, const char *generated);
