/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The kvd-lm tokenizer (eval/kvd-lm/README.md, "Tokens"): byte-level BPE, token for token
 * as tokenizer.py. Tokens 0..255 are the bytes, 256..259 the special tokens, and merge i
 * of a `.kvdtok` file makes token 260 + i of two earlier ones. Text is first cut into
 * pieces that merges never cross (kvdlm_pieces()).
 *
 * A tokenizer is read-only once loaded and may be shared by threads. Nothing here prints.
 */

#include <stddef.h>
#include <stdint.h>

#define KVDLM_BOS 256u
#define KVDLM_EOS 257u
#define KVDLM_PAD 258u
/* The vocabulary without merges (the byte-level kvd-lm-small, the test models). */
#define KVDLM_BYTE_VOCAB 260u
#define KVDLM_VOCAB_MAX 65536u
/* The longest piece, a leading space included: longer runs are cut. */
#define KVDLM_PIECE_MAX 64u

struct kvdlm_tokenizer;

/*
 * Reads a `.kvdtok` file. Returns 0, or -ENOMEM, -EBADMSG (a file that is not one: the
 * message in err says what), -EFBIG, or the -errno of open/read. err, if not NULL,
 * receives a message on failure.
 */
int kvdlm_tokenizer_load(const char *path, struct kvdlm_tokenizer **ret, char *err, size_t errlen);
/* The byte-level tokenizer (no merges). Returns 0 or -ENOMEM. */
int kvdlm_tokenizer_bytes(struct kvdlm_tokenizer **ret);
/*
 * The tokenizer of a model file: the `.kvdtok` beside it (the model's name with `.kvdlm`
 * replaced), or the byte-level one for a model of vocab 260 that has none. -EBADMSG when
 * the tokenizer's vocabulary is not the model's or a larger model has no tokenizer file.
 */
int kvdlm_tokenizer_for_model(const char *model_path, uint32_t vocab,
                              struct kvdlm_tokenizer **ret, char *err, size_t errlen);
struct kvdlm_tokenizer *kvdlm_tokenizer_free(struct kvdlm_tokenizer *t);
static inline void kvdlm_tokenizer_freep(struct kvdlm_tokenizer **t) {
	*t = kvdlm_tokenizer_free(*t);
}

uint32_t kvdlm_tokenizer_vocab(const struct kvdlm_tokenizer *t);

/*
 * The pieces of text[n]: calls piece(text + start, size, userdata) for each, in order,
 * stopping at the first negative return (which it returns); 0 when all were seen.
 */
int kvdlm_pieces(const void *text, size_t n, int (*piece)(const uint8_t *p, size_t size, void *userdata),
                 void *userdata);

/*
 * The tokens of text[n] (no BOS) into out, which has room for n (a token is at least one
 * byte); returns how many.
 */
size_t kvdlm_tokenizer_encode(const struct kvdlm_tokenizer *t, const void *text, size_t n, uint32_t *out);
/* How many tokens kvdlm_tokenizer_encode() gives for text[n]. */
size_t kvdlm_tokenizer_count(const struct kvdlm_tokenizer *t, const void *text, size_t n);
/*
 * The bytes of token id (specials as "<bos>", "<eos>", "<pad>", "<259>"), *size set; NULL
 * for an id outside the vocabulary.
 */
const uint8_t *kvdlm_tokenizer_token(const struct kvdlm_tokenizer *t, uint32_t id, size_t *size);
