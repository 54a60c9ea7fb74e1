/* SPDX-License-Identifier: MIT */
/*
 * A minimal engine on kvd: the loop an inference engine runs, without the model.
 *
 * It connects as a tenant, registers a model whose KV the daemon may evict, opens one
 * sequence, and runs a prefill and then decode steps. Every step:
 *   1. grows the sequence by the step's tokens (a grow may wait while an eviction round
 *      makes room under the node's budget);
 *   2. pins it, so that no round rewrites it while the step reads it;
 *   3. writes the new tokens' K and V in place, into the blocks the daemon granted;
 *   4. "attends": reads every resident token's K and checks it is the token written at
 *      its original position, which an eviction keeps with the token;
 *   5. publishes its last queries as the layer's observation window, which rounds score
 *      the tokens against;
 *   6. unpins, and reads the daemon's events (an eviction that rewrote the sequence).
 * The "model" writes K[d] = position + d / 1000 and V = -K, so that step 4 can tell any
 * token from any other. A real engine runs its attention kernel where step 4 is.
 *
 * Usage: engine [SOCKET [TENANT [STEPS]]]; SOCKET "" or missing: $KVD_SOCKET, else the
 * default socket. Prints what was evicted; exits 0, or 1 on an error or a wrong token.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvd/kvd.h>

#define LAYERS 2
#define Q_HEADS 4
#define KV_HEADS 2
#define HEAD_DIM 64
#define WINDOW 8
#define MAX_TOKENS 4096
#define PREFILL 256

static const kvd_model_spec spec = {
	.name = "example",
	.layers = LAYERS,
	.q_heads = Q_HEADS,
	.kv_heads = KV_HEADS,
	.head_dim = HEAD_DIM,
	.dtype = KVD_DTYPE_F32,
	.block_tokens = 16,
	.layout = KVD_LAYOUT_PER_LAYER,
};

static int fail(kvd_client *c, const char *what, int r) {
	const char *msg = c ? kvd_client_last_error(c) : "";

	fprintf(stderr, "engine: %s: %s%s%s\n", what, kvd_strerror(r), *msg ? ": " : "", msg);
	return 1;
}

static float k_value(int64_t pos, uint32_t d) {
	return (float)pos + (float)d / 1000.0f;
}

/* Writes K and V of the resident slots whose original position is at least from. */
static int write_new(kvd_seq *s, int64_t from) {
	for (uint32_t l = 0; l < LAYERS; l++)
		for (uint32_t h = 0; h < KV_HEADS; h++) {
			int64_t n = kvd_seq_tokens(s, l, h);

			for (int64_t i = n - 1; i >= 0; i--) {
				int64_t pos = kvd_seq_position(s, l, h, (uint32_t)i);
				float *k, *v;
				int r;

				if (pos < from)
					break;
				r = kvd_seq_kv(s, l, h, (uint32_t)i, (void **)&k, (void **)&v);
				if (r < 0)
					return r;
				for (uint32_t d = 0; d < HEAD_DIM; d++) {
					k[d] = k_value(pos, d);
					v[d] = -k[d];
				}
			}
		}
	return 0;
}

/* What attention would read: every resident token must be the one written at its
 * original position. Returns the tokens read, or -EBADMSG for a wrong one. */
static int64_t read_all(kvd_seq *s) {
	int64_t total = 0;

	for (uint32_t l = 0; l < LAYERS; l++)
		for (uint32_t h = 0; h < KV_HEADS; h++) {
			int64_t n = kvd_seq_tokens(s, l, h);

			for (int64_t i = 0; i < n; i++) {
				int64_t pos = kvd_seq_position(s, l, h, (uint32_t)i);
				float *k, *v;

				if (pos < 0 || kvd_seq_kv(s, l, h, (uint32_t)i, (void **)&k, (void **)&v) < 0)
					return -EBADMSG;
				for (uint32_t d = 0; d < HEAD_DIM; d++)
					if (k[d] != k_value(pos, d) || v[d] != -k[d])
						return -EBADMSG;
			}
			total += n;
		}
	return total;
}

/* Publishes each layer's last WINDOW queries (here: made up from the step). */
static int publish_window(kvd_seq *s, uint32_t step) {
	for (uint32_t l = 0; l < LAYERS; l++) {
		float *q;
		int r = kvd_seq_observation(s, l, (void **)&q);

		if (r < 0)
			return r;
		for (uint32_t i = 0; i < Q_HEADS * WINDOW * HEAD_DIM; i++)
			q[i] = (float)((step * 31 + i * 7) % 97) / 97.0f - 0.5f;
		r = kvd_seq_observe(s, l);
		if (r < 0)
			return r;
	}
	return 0;
}

/* One step of n tokens: steps 1 to 6 above. Returns the resident tokens read, or -errno. */
static int64_t step(kvd_client *c, kvd_seq *s, uint32_t n, uint32_t i, uint32_t *changed) {
	int64_t from, read;
	kvd_event ev;
	int r;

	r = kvd_seq_grow(s, n);
	if (r < 0)
		return r;
	r = kvd_seq_pin(s);
	if (r < 0)
		return r;
	/* The new tokens are the last n positions. */
	from = (int64_t)kvd_seq_descriptor(s)->next_position - n;
	r = write_new(s, from);
	read = r < 0 ? r : read_all(s);
	if (read >= 0)
		r = publish_window(s, i);
	if (kvd_seq_unpin(s) < 0 && r >= 0)
		r = -EIO;
	if (r < 0)
		return r;
	/* Rounds compact unpinned sequences: the next step reads the new layout. */
	while ((r = kvd_client_next_event(c, &ev)) > 0)
		if (ev.type == KVD_EVENT_SEQ_CHANGED)
			(*changed)++;
	return r < 0 ? r : read;
}

int main(int argc, char **argv) {
	const char *socket_path = argc > 1 && *argv[1] ? argv[1] : NULL;
	const char *tenant = argc > 2 ? argv[2] : "example";
	uint32_t steps = argc > 3 ? (uint32_t)strtoul(argv[3], NULL, 10) : 1024, changed = 0;
	kvd_eviction_spec ev = { .unit = KVD_UNIT_LAYER_TOKEN, .window = WINDOW, .sinks = 4 };
	kvd_client *c = NULL;
	kvd_seq *s = NULL;
	int64_t read = 0;
	int model, r;

	r = kvd_client_connect(socket_path, tenant, &c);
	if (r < 0)
		return fail(NULL, "connect", r);
	model = kvd_model_register_evictable(c, &spec, &ev);
	if (model < 0)
		return fail(c, "register the model", model);
	r = kvd_seq_open(c, model, MAX_TOKENS, &s);
	if (r < 0)
		return fail(c, "open a sequence", r);

	read = step(c, s, PREFILL, 0, &changed);
	for (uint32_t i = 1; read >= 0 && i <= steps; i++)
		read = step(c, s, 1, i, &changed);
	if (read == -EBADMSG) {
		fprintf(stderr, "engine: a token is not the one written at its position\n");
		return 1;
	}
	if (read < 0)
		return fail(c, "a step", (int)read);
	printf("engine: %u tokens generated after a prefill of %u; %lld of %u positions resident "
	       "(all layers and kv heads); %u evictions rewrote the sequence\n",
	       steps, PREFILL, (long long)read / (LAYERS * KV_HEADS), PREFILL + steps, changed);
	r = kvd_seq_release(s);
	if (r < 0)
		return fail(c, "release", r);
	kvd_client_unref(c);
	return 0;
}
