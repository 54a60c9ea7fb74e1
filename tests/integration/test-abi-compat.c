/* SPDX-License-Identifier: MIT */
/*
 * The shared headers across versions (kvd-abi.h, "How the shared headers grow"), both ways:
 *   - this libkvd against an older daemon, played by a fake one in a thread that writes
 *     descriptors as the daemons before header_bytes did (a 128-byte header with tokens[]
 *     right after it, which overlays today's index fields; a 144-byte one) and offers no
 *     feature bits: libkvd reads the geometry from what was written, the rest as 0;
 *   - a client as libkvd 1.3 was against this daemon: a hello without
 *     KVD_FEATURE_SEQ_HEADER, and a descriptor that passes 1.3's checks (version 1, fields
 *     at their 1.3 offsets, every array after 1.3's 144-byte header).
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "common/layout.h"
#include "basic/macro.h"
#include "fixture.h"
#include "test.h"

/* The model both sides use: f32, per layer, six tables so that a 128-byte header's
 * tokens[] reaches past index_offset into header_bytes. */
#define LAYERS 6u
#define KV_HEADS 2u
#define HEAD_DIM 8u
#define BLOCK_TOKENS 4u
#define MAX_TOKENS 16u
#define ROW_BYTES (HEAD_DIM * 4u)
#define BLOCK_BYTES (2u * KV_HEADS * BLOCK_TOKENS * ROW_BYTES)
#define CHUNK_ID 3u
#define CHUNK_BYTES (64u * 1024u)
#define SEQ_ID 7u

static const struct kvd_model_spec spec = {
	.layers = LAYERS, .q_heads = KV_HEADS, .kv_heads = KV_HEADS, .head_dim = HEAD_DIM,
	.dtype = KVD_DTYPE_F32, .block_tokens = BLOCK_TOKENS, .layout = KVD_LAYOUT_PER_LAYER,
};

/* A daemon from before header_bytes, for one connection. */
struct old_daemon {
	uint32_t header;              /* bytes of the descriptor header it writes */
	char dir[64];
	char path[108];
	int listen_fd;
	pthread_t thread;
	struct kvd_seq_desc geo;      /* what it writes, header bytes of it */
	int desc_fd, chunk_fd;
	uint8_t *desc, *chunk;
	bool granted;
	int result;                   /* 0, or where the thread gave up */
};

/* Row value of (layer, kv head, slot) in K (V: negated), as the fake writes them. */
static float row_value(uint32_t l, uint32_t h, uint32_t slot, uint32_t e) {
	return (float)(l * 1000 + h * 100 + slot) + (float)e / 16.0f;
}

/* Lays the descriptor out as the old daemon did: arrays from ALIGN_TO(header, 64). */
static void old_desc_new(struct old_daemon *o) {
	struct kvd_seq_desc *g = &o->geo;
	uint64_t tokens_off = ALIGN_TO(o->header, 64);
	uint64_t positions_off = ALIGN_TO(tokens_off + 4 * LAYERS, 64);
	uint64_t blocks_off = ALIGN_TO(positions_off + 4ull * LAYERS * MAX_TOKENS, 64);
	uint64_t max_blocks = MAX_TOKENS / BLOCK_TOKENS;
	uint64_t total = ALIGN_TO(blocks_off + 8 * LAYERS * max_blocks, 4096);

	*g = (struct kvd_seq_desc){
		.magic = KVD_SEQ_DESC_MAGIC, .version = KVD_SEQ_DESC_VERSION, .seq_id = SEQ_ID,
		.layers = LAYERS, .kv_heads = KV_HEADS, .head_dim = HEAD_DIM,
		.dtype = KVD_DTYPE_F32, .block_tokens = BLOCK_TOKENS, .layout = KVD_LAYOUT_PER_LAYER,
		.n_tables = LAYERS, .max_tokens = MAX_TOKENS, .max_blocks = max_blocks,
		.block_bytes = BLOCK_BYTES, .tokens_offset = tokens_off,
		.positions_offset = positions_off, .blocks_offset = blocks_off, .total_bytes = total,
	};
	o->desc_fd = memfd_create("old-desc", MFD_CLOEXEC);
	ASSERT_TRUE(o->desc_fd >= 0);
	ASSERT_OK(ftruncate(o->desc_fd, total));
	o->desc = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, o->desc_fd, 0);
	ASSERT_TRUE(o->desc != MAP_FAILED);
	memcpy(o->desc, g, o->header);
	/* Nothing promised what lies between the header and the arrays. */
	memset(o->desc + o->header, 0xa5, tokens_off - o->header);
}

/* Grows every table to n tokens: table t's blocks are CHUNK_ID's blocks t * 4 + b. */
static void old_desc_grow(struct old_daemon *o, uint32_t n) {
	const struct kvd_seq_desc *g = &o->geo;
	struct kvd_seq_desc *d = (struct kvd_seq_desc *)o->desc;

	__atomic_store_n(&d->generation, d->generation + 1, __ATOMIC_RELEASE);
	for (uint32_t t = 0; t < LAYERS; t++) {
		uint32_t *pos = (uint32_t *)layout_positions_at(g, o->desc, t);
		struct kvd_block_ref *blocks = (struct kvd_block_ref *)layout_blocks_at(g, o->desc, t);

		for (uint32_t i = 0; i < n; i++) {
			uint32_t b = i / BLOCK_TOKENS, r = i % BLOCK_TOKENS;
			float *k = (float *)(o->chunk + (uint64_t)(t * 4 + b) * BLOCK_BYTES);

			pos[i] = i;
			blocks[b] = (struct kvd_block_ref){ .chunk_id = CHUNK_ID, .index = t * 4 + b };
			for (uint32_t h = 0; h < KV_HEADS; h++)
				for (uint32_t e = 0; e < HEAD_DIM; e++) {
					float v = row_value(t, h, i, e);

					k[(h * BLOCK_TOKENS + r) * HEAD_DIM + e] = v;
					k[BLOCK_BYTES / 8 + (h * BLOCK_TOKENS + r) * HEAD_DIM + e] = -v;
				}
		}
		((uint32_t *)layout_tokens_at(g, o->desc))[t] = n;
	}
	d->next_position = n;
	__atomic_store_n(&d->generation, d->generation + 1, __ATOMIC_RELEASE);
}

/* Answers one request; returns 1 to go on, 0 when the client hung up. */
static int old_serve_one(struct old_daemon *o, int fd, struct wire_rx *rx) {
	Envelope rep = KVD__V1__ENVELOPE__INIT, *env;
	Kvd__V1__Status ok = KVD__V1__STATUS__INIT;
	int r = raw_recv(fd, rx, 10000, &env), fds[1];
	uint32_t nfds = 0;

	if (r <= 0)
		return r;
	rep.has_id = true;
	rep.id = env->id;
	rep.status = &ok;
	ok.has_code = true;
	switch (env->body_case) {
	case KVD__V1__ENVELOPE__BODY_HELLO: {
		static Kvd__V1__HelloReply h = KVD__V1__HELLO_REPLY__INIT;

		/* No feature bits: this daemon knows neither rings nor header_bytes. */
		h.has_version = h.has_chunk_bytes = true;
		h.version = 1;
		h.chunk_bytes = CHUNK_BYTES;
		rep.body_case = KVD__V1__ENVELOPE__BODY_HELLO_REPLY;
		rep.hello_reply = &h;
		break;
	}
	case KVD__V1__ENVELOPE__BODY_REGISTER_MODEL: {
		static Kvd__V1__RegisterModelReply m = KVD__V1__REGISTER_MODEL_REPLY__INIT;

		m.has_model_id = m.has_block_bytes = m.has_blocks_per_chunk = true;
		m.model_id = 0;
		m.block_bytes = BLOCK_BYTES;
		m.blocks_per_chunk = CHUNK_BYTES / BLOCK_BYTES;
		rep.body_case = KVD__V1__ENVELOPE__BODY_REGISTER_MODEL_REPLY;
		rep.register_model_reply = &m;
		break;
	}
	case KVD__V1__ENVELOPE__BODY_SEQ_OPEN: {
		static Kvd__V1__SeqOpenReply so = KVD__V1__SEQ_OPEN_REPLY__INIT;

		old_desc_new(o);
		so.has_seq_id = so.has_descriptor_bytes = true;
		so.seq_id = SEQ_ID;
		so.descriptor_bytes = o->geo.total_bytes;
		rep.body_case = KVD__V1__ENVELOPE__BODY_SEQ_OPEN_REPLY;
		rep.seq_open_reply = &so;
		fds[nfds++] = o->desc_fd;
		break;
	}
	case KVD__V1__ENVELOPE__BODY_SEQ_GROW: {
		static Kvd__V1__SeqGrowReply g = KVD__V1__SEQ_GROW_REPLY__INIT;
		static Kvd__V1__ChunkGrant grant = KVD__V1__CHUNK_GRANT__INIT;
		static Kvd__V1__ChunkGrant *grants[1] = { &grant };
		uint32_t n = env->seq_grow->tokens + ((const struct kvd_seq_desc *)o->desc)->next_position;

		if (n > MAX_TOKENS) {
			ok.code = -ENOSPC;
			break;
		}
		old_desc_grow(o, n);
		g.has_tokens = g.has_generation = true;
		g.tokens = n;
		g.generation = ((const struct kvd_seq_desc *)o->desc)->generation;
		g.n_grants = 0;
		if (!o->granted) {
			grant.has_chunk_id = grant.has_bytes = true;
			grant.chunk_id = CHUNK_ID;
			grant.bytes = CHUNK_BYTES;
			g.n_grants = 1;
			g.grants = grants;
			fds[nfds++] = o->chunk_fd;
			o->granted = true;
		}
		rep.body_case = KVD__V1__ENVELOPE__BODY_SEQ_GROW_REPLY;
		rep.seq_grow_reply = &g;
		break;
	}
	case KVD__V1__ENVELOPE__BODY_SEQ_RELEASE: {
		static Kvd__V1__SeqReleaseReply sr = KVD__V1__SEQ_RELEASE_REPLY__INIT;

		rep.body_case = KVD__V1__ENVELOPE__BODY_SEQ_RELEASE_REPLY;
		rep.seq_release_reply = &sr;
		break;
	}
	case KVD__V1__ENVELOPE__BODY_CHUNKS_UNMAPPED:
		/* Answered with the status alone; libkvd does not wait for it. */
		break;
	default:
		/* What a daemon answers a body it does not know (kvd.proto). */
		ok.code = -EOPNOTSUPP;
		break;
	}
	r = raw_send_fds(fd, &rep, fds, nfds);
	/* A client that hung up after a request it does not wait for (ChunksUnmapped). */
	if (r == -EPIPE || r == -ECONNRESET)
		return 0;
	return r < 0 ? r : 1;
}

static void *old_daemon_run(void *userdata) {
	struct old_daemon *o = userdata;
	struct wire_rx *rx = malloc(sizeof(*rx));
	struct pollfd p = { .fd = o->listen_fd, .events = POLLIN };
	int fd, r;

	if (!rx || poll(&p, 1, 10000) != 1) {
		o->result = -ETIMEDOUT;
		free(rx);
		return NULL;
	}
	fd = accept4(o->listen_fd, NULL, NULL, SOCK_CLOEXEC);
	wire_rx_init(rx);
	while ((r = old_serve_one(o, fd, rx)) > 0)
		;
	o->result = r;
	wire_rx_done(rx);
	free(rx);
	close(fd);
	return NULL;
}

static void old_daemon_start(struct old_daemon *o, uint32_t header) {
	struct sockaddr_un sa = { .sun_family = AF_UNIX };

	memset(o, 0, sizeof(*o));
	o->header = header;
	o->desc_fd = -1;
	snprintf(o->dir, sizeof(o->dir), "/tmp/kvd-abi-XXXXXX");
	ASSERT_NOT_NULL(mkdtemp(o->dir));
	snprintf(o->path, sizeof(o->path), "%s/old.sock", o->dir);
	o->chunk_fd = memfd_create("old-chunk", MFD_CLOEXEC);
	ASSERT_TRUE(o->chunk_fd >= 0);
	ASSERT_OK(ftruncate(o->chunk_fd, CHUNK_BYTES));
	o->chunk = mmap(NULL, CHUNK_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, o->chunk_fd, 0);
	ASSERT_TRUE(o->chunk != MAP_FAILED);
	o->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	ASSERT_TRUE(o->listen_fd >= 0);
	memcpy(sa.sun_path, o->path, strlen(o->path));
	ASSERT_OK(bind(o->listen_fd, (struct sockaddr *)&sa, sizeof(sa)));
	ASSERT_OK(listen(o->listen_fd, 1));
	ASSERT_EQ(pthread_create(&o->thread, NULL, old_daemon_run, o), 0);
}

static void old_daemon_stop(struct old_daemon *o) {
	ASSERT_EQ(pthread_join(o->thread, NULL), 0);
	ASSERT_EQ(o->result, 0);
	if (o->desc) {
		munmap(o->desc, o->geo.total_bytes);
		close(o->desc_fd);
	}
	munmap(o->chunk, CHUNK_BYTES);
	close(o->chunk_fd);
	close(o->listen_fd);
	unlink(o->path);
	rmdir(o->dir);
}

/* This libkvd reads the descriptor of a daemon that wrote header bytes of it. */
static void new_client_reads_old_header(uint32_t header) {
	struct old_daemon o;
	const struct kvd_seq_desc *h, *d;
	kvd_client *c;
	kvd_seq *s;
	uint64_t local;
	int model;

	old_daemon_start(&o, header);
	ASSERT_OK(kvd_client_connect(o.path, "old", &c));
	model = kvd_model_register(c, &spec);
	ASSERT_EQ(model, 0);
	ASSERT_OK(kvd_seq_open(c, model, MAX_TOKENS, &s));
	ASSERT_OK(kvd_seq_grow(s, 6));
	ASSERT_OK(kvd_seq_grow(s, 3));

	h = kvd_seq_header(s);
	d = kvd_seq_descriptor(s);
	ASSERT_NOT_NULL(h);
	ASSERT_EQ(h->header_bytes, header);
	ASSERT_EQ(h->tokens_offset, ALIGN_TO(header, 64));
	ASSERT_EQ(h->block_bytes, BLOCK_BYTES);
	/* Past what the daemon wrote, everything reads 0 in libkvd's copy... */
	ASSERT_EQ(h->compensation, 0u);
	ASSERT_EQ(h->index_heads, 0u);
	ASSERT_EQ(h->index_dim, 0u);
	ASSERT_EQ(h->index_offset, 0u);
	ASSERT_EQ(h->reserved, 0u);
	/* ...while the mapping holds tokens[] there when the header was 128 bytes: read as a
	 * header, table 1's count would be an index_dim. */
	if (header == 128) {
		ASSERT_EQ(d->index_dim, 9u);
		ASSERT_EQ(d->header_bytes, 9u);
	}
	for (uint32_t l = 0; l < LAYERS; l++)
		for (uint32_t kh = 0; kh < KV_HEADS; kh++) {
			ASSERT_EQ(kvd_seq_tokens(s, l, kh), 9);
			for (uint32_t i = 0; i < 9; i++) {
				float *k, *v;

				ASSERT_EQ(kvd_seq_position(s, l, kh, i), (int64_t)i);
				ASSERT_OK(kvd_seq_kv(s, l, kh, i, (void **)&k, (void **)&v));
				for (uint32_t e = 0; e < HEAD_DIM; e++) {
					ASSERT_TRUE(k[e] == row_value(l, kh, i, e));
					ASSERT_TRUE(v[e] == -row_value(l, kh, i, e));
				}
			}
		}
	/* Without an indexer the index keys are refused, not read from stray offsets. */
	{
		void *ik;

		ASSERT_ERRNO(kvd_seq_index_key(s, 0, 0, 0, &ik), -EOPNOTSUPP);
	}
	ASSERT_OK(kvd_seq_digest(s, NULL, &local));
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	old_daemon_stop(&o);
}

TEST(new_client_reads_128_byte_header) {
	new_client_reads_old_header(128);
}

TEST(new_client_reads_144_byte_header) {
	new_client_reads_old_header(144);
}

/* This daemon and this libkvd: the bit is offered and answered, the header is whole. */
TEST(new_client_new_daemon) {
	static const char *const args[] = { "--pool-size", "4MiB", "--chunk-size", "1MiB", NULL };
	struct fixture f;
	kvd_client *c;
	kvd_seq *s;
	int model;

	fixture_start(&f, args);
	c = fixture_connect(&f, "new");
	model = kvd_model_register(c, &spec);
	ASSERT_TRUE(model >= 0);
	ASSERT_OK(kvd_seq_open(c, model, MAX_TOKENS, &s));
	ASSERT_OK(kvd_seq_grow(s, 5));
	ASSERT_EQ(kvd_seq_header(s)->header_bytes, sizeof(struct kvd_seq_desc));
	ASSERT_EQ(kvd_seq_descriptor(s)->header_bytes, sizeof(struct kvd_seq_desc));
	ASSERT_EQ(kvd_seq_tokens(s, LAYERS - 1, 1), 5);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Receives the reply to request id (events skipped) with its fds closed. */
static Envelope *reply_to(int fd, struct wire_rx *rx, uint64_t id) {
	for (;;) {
		Envelope *env;

		ASSERT_EQ(raw_recv(fd, rx, 5000, &env), 1);
		if (env->id == id)
			return env;
	}
}

/* A client as libkvd 1.3 was: what it sent, and what it checked of a descriptor. */
TEST(old_client_new_daemon) {
	static const char *const args[] = { "--pool-size", "4MiB", "--chunk-size", "1MiB", NULL };
	Kvd__V1__Hello hello = KVD__V1__HELLO__INIT;
	Kvd__V1__RegisterModel reg = KVD__V1__REGISTER_MODEL__INIT;
	Kvd__V1__SeqOpen open = KVD__V1__SEQ_OPEN__INIT;
	Kvd__V1__SeqGrow grow = KVD__V1__SEQ_GROW__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *rep;
	struct wire_rx *rx = malloc(sizeof(*rx));
	const struct kvd_seq_desc *d;
	struct fixture f;
	struct stat st;
	int fd, dfd, fds[WIRE_FDS_MAX];
	uint32_t nfds;

	ASSERT_NOT_NULL(rx);
	fixture_start(&f, args);
	wire_rx_init(rx);
	fd = raw_connect(&f);
	ASSERT_TRUE(fd >= 0);
	/* libkvd 1.3 offered the ring and, built with CUDA, device chunks. */
	hello.has_min_version = hello.has_max_version = hello.has_features = true;
	hello.min_version = hello.max_version = 1;
	hello.features = KVD_FEATURE_DEVICE_CHUNKS;
	hello.tenant = "old";
	env.has_id = true;
	env.id = 1;
	env.body_case = KVD__V1__ENVELOPE__BODY_HELLO;
	env.hello = &hello;
	ASSERT_OK(raw_send(fd, &env));
	rep = reply_to(fd, rx, 1);
	ASSERT_EQ(rep->status->code, 0);
	ASSERT_EQ(rep->hello_reply->features & KVD_FEATURE_SEQ_HEADER, 0u);

	reg.has_layers = reg.has_q_heads = reg.has_kv_heads = reg.has_head_dim = true;
	reg.layers = LAYERS;
	reg.q_heads = reg.kv_heads = KV_HEADS;
	reg.head_dim = HEAD_DIM;
	reg.has_dtype = reg.has_block_tokens = reg.has_layout = true;
	reg.dtype = KVD_DTYPE_F32;
	reg.block_tokens = BLOCK_TOKENS;
	reg.layout = KVD_LAYOUT_PER_LAYER;
	env.id = 2;
	env.body_case = KVD__V1__ENVELOPE__BODY_REGISTER_MODEL;
	env.register_model = &reg;
	ASSERT_OK(raw_send(fd, &env));
	rep = reply_to(fd, rx, 2);
	ASSERT_EQ(rep->status->code, 0);
	open.has_model_id = open.has_max_tokens = true;
	open.model_id = rep->register_model_reply->model_id;
	open.max_tokens = MAX_TOKENS;
	env.id = 3;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_OPEN;
	env.seq_open = &open;
	ASSERT_OK(raw_send(fd, &env));
	/* The descriptor's fd stays ours. */
	ASSERT_EQ(raw_recv_fds(fd, rx, 5000, &rep, fds, &nfds), 1);
	ASSERT_EQ(rep->id, 3u);
	ASSERT_EQ(rep->status->code, 0);
	ASSERT_EQ(nfds, 1u);
	dfd = fds[0];
	grow.has_seq_id = grow.has_tokens = true;
	grow.seq_id = rep->seq_open_reply->seq_id;
	grow.tokens = 5;
	env.id = 4;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_GROW;
	env.seq_grow = &grow;
	ASSERT_OK(raw_send(fd, &env));
	rep = reply_to(fd, rx, 4);
	ASSERT_EQ(rep->status->code, 0);
	ASSERT_EQ(rep->seq_grow_reply->tokens, 5u);

	/* libkvd 1.3's checks, on its 144-byte header: the size, magic and version, and every
	 * array after the header. The fields' offsets are 1.3's: kvd-abi.h asserts them. */
	ASSERT_OK(fstat(dfd, &st));
	ASSERT_GE((uint64_t)st.st_size, 144u);
	d = mmap(NULL, st.st_size, PROT_READ, MAP_SHARED, dfd, 0);
	ASSERT_TRUE(d != MAP_FAILED);
	ASSERT_EQ(d->magic, KVD_SEQ_DESC_MAGIC);
	ASSERT_EQ(d->version, 1u);
	ASSERT_EQ(d->total_bytes, (uint64_t)st.st_size);
	ASSERT_EQ(d->block_bytes, BLOCK_BYTES);
	ASSERT_EQ(d->compensation, KVD_COMPENSATION_NONE);
	ASSERT_EQ(d->index_dim, 0u);
	ASSERT_GE(d->tokens_offset, 144u);
	ASSERT_GE(d->positions_offset, 144u);
	ASSERT_GE(d->blocks_offset, 144u);
	ASSERT_EQ(d->tokens_offset % 4, 0u);
	for (uint32_t t = 0; t < LAYERS; t++)
		ASSERT_EQ(layout_tokens(d)[t], 5u);
	ASSERT_EQ(layout_positions(d, 2)[4], 4u);
	munmap((void *)d, st.st_size);
	close(dfd);
	close(fd);
	wire_rx_done(rx);
	free(rx);
	ASSERT_EQ(fixture_stop(&f), 0);
}

struct elsewhere {
	kvd_client *c;
	kvd_seq *s;
	char seen[256];
};

/* A failure on another thread: its message is that thread's. */
static void *grow_zero_elsewhere(void *userdata) {
	struct elsewhere *e = userdata;

	ASSERT_ERRNO(kvd_seq_grow(e->s, 0), -EINVAL);
	snprintf(e->seen, sizeof(e->seen), "%s", kvd_client_last_error(e->c));
	return NULL;
}

/* Every failed call leaves its own message, on its own thread: the daemon's words for a
 * refusal, the library's for what it refuses itself, never an earlier call's. */
TEST(failed_call_leaves_its_own_message) {
	static const kvd_model_spec tiny = { "m", 1, 1, 1, 8, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER };
	struct elsewhere e = { 0 };
	struct fixture f;
	char refused[256];
	kvd_client *c, *other;
	kvd_seq *s;
	pthread_t t;
	void *k;
	int m;

	fixture_start(&f, NULL);
	c = fixture_connect(&f, "talker");
	other = fixture_connect(&f, "listener");
	m = kvd_model_register(c, &tiny);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 16, &s));
	ASSERT_STREQ(kvd_client_last_error(c), "");
	ASSERT_OK(kvd_seq_grow(s, 16));
	/* The daemon refuses: its words. */
	ASSERT_ERRNO(kvd_seq_grow(s, 1), -EFBIG);
	snprintf(refused, sizeof(refused), "%s", kvd_client_last_error(c));
	ASSERT_TRUE(refused[0] != '\0');
	ASSERT_TRUE(strncmp(refused, "kvd_seq_grow: ", 14) != 0);
	/* The library refuses: its words, not the daemon's earlier ones. */
	ASSERT_ERRNO(kvd_seq_grow(s, 0), -EINVAL);
	ASSERT_STREQ(kvd_client_last_error(c), "kvd_seq_grow: n is 0 (grow by 1 or more)");
	ASSERT_ERRNO(kvd_seq_kv(s, 5, 0, 0, &k, NULL), -EINVAL);
	ASSERT_TRUE(strncmp(kvd_client_last_error(c), "kvd_seq_kv: ", 12) == 0);
	ASSERT_ERRNO(kvd_model_register(c, &(kvd_model_spec){ "bad", 0, 1, 1, 8, KVD_DTYPE_F16, 16,
	                                                      KVD_LAYOUT_PER_LAYER }), -EINVAL);
	ASSERT_TRUE(strstr(kvd_client_last_error(c), "kvd_seq_kv") == NULL);
	/* A call that succeeds leaves it; another client has none of it. */
	snprintf(refused, sizeof(refused), "%s", kvd_client_last_error(c));
	ASSERT_OK(kvd_seq_pin(s));
	ASSERT_STREQ(kvd_client_last_error(c), refused);
	ASSERT_STREQ(kvd_client_last_error(other), "");
	/* Another thread's failure is that thread's. */
	ASSERT_OK(kvd_seq_kv(s, 0, 0, 0, &k, NULL));
	e.c = c;
	e.s = s;
	ASSERT_EQ(pthread_create(&t, NULL, grow_zero_elsewhere, &e), 0);
	ASSERT_EQ(pthread_join(t, NULL), 0);
	ASSERT_STREQ(e.seen, "kvd_seq_grow: n is 0 (grow by 1 or more)");
	ASSERT_STREQ(kvd_client_last_error(c), refused);
	ASSERT_OK(kvd_seq_unpin(s));
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(other);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* kvd_strerror: kvd's meaning where it has one, the C library's otherwise, never NULL. */
TEST(strerror_words) {
	ASSERT_TRUE(strstr(kvd_strerror(-EFBIG), "max_tokens") != NULL);
	ASSERT_TRUE(strstr(kvd_strerror(-EDQUOT), "cap") != NULL);
	ASSERT_TRUE(strstr(kvd_strerror(-ESTALE), "kvd_seq_claim") != NULL);
	ASSERT_STREQ(kvd_strerror(-ENOENT), strerror(ENOENT));
	ASSERT_STREQ(kvd_strerror(-EINVAL), strerror(EINVAL));
	ASSERT_STREQ(kvd_strerror(-100000), "unknown error");
	ASSERT_STREQ(kvd_strerror(0), "unknown error");
	ASSERT_STREQ(kvd_strerror(12), "unknown error");
}
