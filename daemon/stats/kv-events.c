/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <zmq.h>

#include "basic/macro.h"
#include "kv-events.h"
#include "log.h"

/* What the queue may hold before events are dropped, and what the replay keeps. */
#define QUEUE_BYTES_MAX (UINT64_C(8) << 20)
#define REPLAY_BATCHES 1024
#define REPLAY_BYTES_MAX (UINT64_C(64) << 20)
/* How long the thread waits for a replay request before it sends what was queued. */
#define FLUSH_MS 5

struct buf {
	uint8_t *p;
	size_t n, cap;
};

struct batch {
	uint64_t seq;
	struct buf payload;
};

struct kv_events {
	void *ctx, *pub, *replay;
	char *topic;
	pthread_t thread;
	pthread_mutex_t lock;
	bool stop;
	/* Under lock: the events queued (each a msgpack array), and how many. */
	struct buf queue;
	uint32_t queued;
	uint64_t count, dropped;
	/* The thread's own. */
	uint64_t next_seq, batches;
	struct batch ring[REPLAY_BATCHES];
	uint32_t ring_start, ring_n;
	uint64_t ring_bytes;
};

static int buf_put(struct buf *b, const void *p, size_t n) {
	if (b->n + n > b->cap) {
		size_t cap = MAX(b->cap * 2, b->n + n + 256);
		uint8_t *q = realloc(b->p, cap);

		if (!q)
			return -ENOMEM;
		b->p = q;
		b->cap = cap;
	}
	memcpy(b->p + b->n, p, n);
	b->n += n;
	return 0;
}

/* msgpack (the spec at msgpack.org): the few types the events hold, shortest forms. */
static int mp_head(struct buf *b, uint8_t fix, uint8_t b8, uint8_t b16, uint8_t b32, uint32_t fix_max,
                   uint64_t v) {
	uint8_t h[5];

	if (fix && v <= fix_max) {
		h[0] = (uint8_t)(fix | v);
		return buf_put(b, h, 1);
	}
	if (b8 && v <= UINT8_MAX) {
		h[0] = b8, h[1] = (uint8_t)v;
		return buf_put(b, h, 2);
	}
	if (v <= UINT16_MAX) {
		h[0] = b16, h[1] = (uint8_t)(v >> 8), h[2] = (uint8_t)v;
		return buf_put(b, h, 3);
	}
	h[0] = b32, h[1] = (uint8_t)(v >> 24), h[2] = (uint8_t)(v >> 16), h[3] = (uint8_t)(v >> 8),
	h[4] = (uint8_t)v;
	return buf_put(b, h, 5);
}

static int mp_array(struct buf *b, uint32_t n) {
	return mp_head(b, 0x90, 0, 0xdc, 0xdd, 15, n);
}

static int mp_str(struct buf *b, const char *s) {
	size_t n = strlen(s);

	return mp_head(b, 0xa0, 0xd9, 0xda, 0xdb, 31, n) ?: buf_put(b, s, n);
}

static int mp_bin(struct buf *b, const void *p, size_t n) {
	return mp_head(b, 0, 0xc4, 0xc5, 0xc6, 0, n) ?: buf_put(b, p, n);
}

static int mp_uint(struct buf *b, uint64_t v) {
	uint8_t h[9];

	if (v < 128) {
		h[0] = (uint8_t)v;
		return buf_put(b, h, 1);
	}
	if (v <= UINT32_MAX)
		return mp_head(b, 0, 0xcc, 0xcd, 0xce, 0, v);
	h[0] = 0xcf;
	for (int i = 0; i < 8; i++)
		h[1 + i] = (uint8_t)(v >> (56 - 8 * i));
	return buf_put(b, h, 9);
}

static int mp_nil(struct buf *b) {
	uint8_t h = 0xc0;

	return buf_put(b, &h, 1);
}

static int mp_double(struct buf *b, double d) {
	uint8_t h[9] = { 0xcb };
	uint64_t v;

	memcpy(&v, &d, sizeof(v));
	for (int i = 0; i < 8; i++)
		h[1 + i] = (uint8_t)(v >> (56 - 8 * i));
	return buf_put(b, h, 9);
}

/* Appends one encoded event to the queue, or drops it when the queue is full. */
static void enqueue(struct kv_events *e, const struct buf *ev) {
	pthread_mutex_lock(&e->lock);
	if (e->queue.n + ev->n > QUEUE_BYTES_MAX || buf_put(&e->queue, ev->p, ev->n) < 0) {
		if (e->dropped++ == 0)
			log_warning("kv events: the queue is full (the publisher cannot keep up): "
			            "events are dropped, counted in kv_events_dropped");
	} else {
		e->queued++;
		e->count++;
	}
	pthread_mutex_unlock(&e->lock);
}

void kv_events_stored(struct kv_events *e, const uint8_t key[KV_EVENTS_KEY_BYTES],
                      const uint8_t *parent, const uint32_t *tokens, uint32_t n_tokens,
                      uint32_t block_tokens, const char *medium) {
	struct buf b = {};
	int r;

	if (!e)
		return;
	/* BlockStored, array_like and tagged: [tag, block_hashes, parent_block_hash, token_ids,
	 * block_size, lora_id, medium]. */
	r = mp_array(&b, 7) ?: mp_str(&b, "BlockStored") ?: mp_array(&b, 1) ?:
	    mp_bin(&b, key, KV_EVENTS_KEY_BYTES) ?:
	    (parent ? mp_bin(&b, parent, KV_EVENTS_KEY_BYTES) : mp_nil(&b)) ?: mp_array(&b, n_tokens);
	for (uint32_t i = 0; r == 0 && i < n_tokens; i++)
		r = mp_uint(&b, tokens[i]);
	r = r ?: mp_uint(&b, block_tokens) ?: mp_nil(&b) ?: mp_str(&b, medium);
	if (r == 0)
		enqueue(e, &b);
	free(b.p);
}

void kv_events_removed(struct kv_events *e, const uint8_t key[KV_EVENTS_KEY_BYTES],
                       const char *medium) {
	struct buf b = {};

	if (!e)
		return;
	/* [tag, block_hashes, medium] */
	if ((mp_array(&b, 3) ?: mp_str(&b, "BlockRemoved") ?: mp_array(&b, 1) ?:
	     mp_bin(&b, key, KV_EVENTS_KEY_BYTES) ?: mp_str(&b, medium)) == 0)
		enqueue(e, &b);
	free(b.p);
}

void kv_events_cleared(struct kv_events *e) {
	struct buf b = {};

	if (!e)
		return;
	if ((mp_array(&b, 1) ?: mp_str(&b, "AllBlocksCleared")) == 0)
		enqueue(e, &b);
	free(b.p);
}

/* Keeps batch (seq, payload) for replays, the oldest going past either bound. */
static void ring_keep(struct kv_events *e, uint64_t seq, struct buf *payload) {
	while (e->ring_n > 0 && (e->ring_n == REPLAY_BATCHES ||
	                         e->ring_bytes + payload->n > REPLAY_BYTES_MAX)) {
		struct batch *old = &e->ring[e->ring_start];

		e->ring_bytes -= old->payload.n;
		free(old->payload.p);
		e->ring_start = (e->ring_start + 1) % REPLAY_BATCHES;
		e->ring_n--;
	}
	e->ring[(e->ring_start + e->ring_n++) % REPLAY_BATCHES] = (struct batch){ seq, *payload };
	e->ring_bytes += payload->n;
	*payload = (struct buf){};
}

static void seq_bytes(uint64_t seq, uint8_t out[8]) {
	for (int i = 0; i < 8; i++)
		out[i] = (uint8_t)(seq >> (56 - 8 * i));
}

/* Sends what is queued as one EventBatch: [ts, events]. */
static void flush(struct kv_events *e) {
	struct buf events, payload = {};
	uint8_t seq[8];
	uint32_t n;
	struct timespec ts;

	pthread_mutex_lock(&e->lock);
	events = e->queue;
	n = e->queued;
	e->queue = (struct buf){};
	e->queued = 0;
	pthread_mutex_unlock(&e->lock);
	if (n == 0) {
		free(events.p);
		return;
	}
	clock_gettime(CLOCK_REALTIME, &ts);
	if ((mp_array(&payload, 2) ?: mp_double(&payload, ts.tv_sec + ts.tv_nsec / 1e9) ?:
	     mp_array(&payload, n) ?: buf_put(&payload, events.p, events.n)) < 0) {
		free(events.p);
		free(payload.p);
		return;
	}
	free(events.p);
	seq_bytes(e->next_seq, seq);
	/* PUB never blocks: past its high-water mark ZeroMQ drops the message for that
	 * subscriber, which the sequence numbers let it see and replay. */
	zmq_send(e->pub, e->topic, strlen(e->topic), ZMQ_SNDMORE | ZMQ_DONTWAIT);
	zmq_send(e->pub, seq, sizeof(seq), ZMQ_SNDMORE | ZMQ_DONTWAIT);
	zmq_send(e->pub, payload.p, payload.n, ZMQ_DONTWAIT);
	__atomic_add_fetch(&e->batches, 1, __ATOMIC_RELAXED);
	ring_keep(e, e->next_seq++, &payload);
}

/* A replay request: [identity, "", start (8 bytes, big-endian)]; answered with every kept
 * batch from start on as [identity, "", seq, payload], then [identity, "", -1, ""]. */
static void serve_replay(struct kv_events *e) {
	uint8_t id[256], empty[1], start_b[8], end[8];
	int n_id, n_empty, n_start;
	uint64_t start = 0;

	n_id = zmq_recv(e->replay, id, sizeof(id), ZMQ_DONTWAIT);
	if (n_id < 0)
		return;
	n_empty = zmq_recv(e->replay, empty, sizeof(empty), ZMQ_DONTWAIT);
	n_start = n_empty >= 0 ? zmq_recv(e->replay, start_b, sizeof(start_b), ZMQ_DONTWAIT) : -1;
	/* Whatever else the message holds goes, and a malformed one gets no answer. */
	for (int more = 1; more;) {
		size_t sz = sizeof(more);

		if (zmq_getsockopt(e->replay, ZMQ_RCVMORE, &more, &sz) < 0 || !more)
			break;
		(void)zmq_recv(e->replay, empty, sizeof(empty), ZMQ_DONTWAIT);
		n_start = -1;
	}
	if (n_id > (int)sizeof(id) || n_empty != 0 || n_start != 8)
		return;
	for (int i = 0; i < 8; i++)
		start = start << 8 | start_b[i];
	for (uint32_t k = 0; k < e->ring_n; k++) {
		const struct batch *b = &e->ring[(e->ring_start + k) % REPLAY_BATCHES];
		uint8_t seq[8];

		if (b->seq < start)
			continue;
		seq_bytes(b->seq, seq);
		zmq_send(e->replay, id, n_id, ZMQ_SNDMORE | ZMQ_DONTWAIT);
		zmq_send(e->replay, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
		zmq_send(e->replay, seq, sizeof(seq), ZMQ_SNDMORE | ZMQ_DONTWAIT);
		zmq_send(e->replay, b->payload.p, b->payload.n, ZMQ_DONTWAIT);
	}
	memset(end, 0xff, sizeof(end));
	zmq_send(e->replay, id, n_id, ZMQ_SNDMORE | ZMQ_DONTWAIT);
	zmq_send(e->replay, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
	zmq_send(e->replay, end, sizeof(end), ZMQ_SNDMORE | ZMQ_DONTWAIT);
	zmq_send(e->replay, "", 0, ZMQ_DONTWAIT);
}

static void *publisher(void *userdata) {
	struct kv_events *e = userdata;

	for (;;) {
		zmq_pollitem_t item = { .socket = e->replay, .events = ZMQ_POLLIN };
		bool stop;

		if (e->replay) {
			if (zmq_poll(&item, 1, FLUSH_MS) > 0)
				serve_replay(e);
		} else {
			struct timespec ts = { 0, FLUSH_MS * 1000000L };

			nanosleep(&ts, NULL);
		}
		pthread_mutex_lock(&e->lock);
		stop = e->stop;
		pthread_mutex_unlock(&e->lock);
		flush(e);
		if (stop)
			return NULL;
	}
}

/* kv_events_new(), with every signal blocked. */
static int events_new(const char *endpoint, const char *replay, const char *topic,
                      struct kv_events **ret, const char **ret_why) {
	struct kv_events *e = calloc(1, sizeof(*e));
	int r, hwm = 100000, linger = 1000;

	*ret_why = NULL;
	if (!e)
		return -ENOMEM;
	pthread_mutex_init(&e->lock, NULL);
	e->topic = strdup(topic ? topic : "");
	e->ctx = zmq_ctx_new();
	e->pub = e->ctx ? zmq_socket(e->ctx, ZMQ_PUB) : NULL;
	if (!e->topic || !e->pub) {
		kv_events_free(e);
		return -ENOMEM;
	}
	zmq_setsockopt(e->pub, ZMQ_SNDHWM, &hwm, sizeof(hwm));
	zmq_setsockopt(e->pub, ZMQ_LINGER, &linger, sizeof(linger));
	if (zmq_bind(e->pub, endpoint) < 0)
		goto bad;
	if (replay && *replay) {
		e->replay = zmq_socket(e->ctx, ZMQ_ROUTER);
		if (!e->replay)
			goto bad;
		zmq_setsockopt(e->replay, ZMQ_LINGER, &linger, sizeof(linger));
		if (zmq_bind(e->replay, replay) < 0)
			goto bad;
	}
	r = -pthread_create(&e->thread, NULL, publisher, e);
	if (r < 0) {
		kv_events_free(e);
		return r;
	}
	*ret = e;
	return 0;
bad:
	*ret_why = zmq_strerror(zmq_errno());
	kv_events_free(e);
	return -EINVAL;
}

int kv_events_new(const char *endpoint, const char *replay, const char *topic,
                  struct kv_events **ret, const char **ret_why) {
	sigset_t all, old;
	int r;

	/* The threads ZeroMQ starts, and ours, inherit the mask: with signals open they would
	 * take a SIGTERM meant for the loop's signalfd, and die of it. */
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	r = events_new(endpoint, replay, topic, ret, ret_why);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	return r;
}

struct kv_events *kv_events_free(struct kv_events *e) {
	if (!e)
		return NULL;
	if (e->thread) {
		pthread_mutex_lock(&e->lock);
		e->stop = true;
		pthread_mutex_unlock(&e->lock);
		pthread_join(e->thread, NULL);
	}
	if (e->replay)
		zmq_close(e->replay);
	if (e->pub)
		zmq_close(e->pub);
	if (e->ctx)
		zmq_ctx_term(e->ctx);
	for (uint32_t k = 0; k < e->ring_n; k++)
		free(e->ring[(e->ring_start + k) % REPLAY_BATCHES].payload.p);
	free(e->queue.p);
	free(e->topic);
	pthread_mutex_destroy(&e->lock);
	free(e);
	return NULL;
}

uint64_t kv_events_count(const struct kv_events *e) {
	return e ? __atomic_load_n(&e->count, __ATOMIC_RELAXED) : 0;
}

uint64_t kv_events_batches(const struct kv_events *e) {
	return e ? __atomic_load_n(&e->batches, __ATOMIC_RELAXED) : 0;
}

uint64_t kv_events_dropped(const struct kv_events *e) {
	return e ? __atomic_load_n(&e->dropped, __ATOMIC_RELAXED) : 0;
}
