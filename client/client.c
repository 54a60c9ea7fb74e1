/* SPDX-License-Identifier: MIT */
/*
 * libkvd, the connection: transport, chunk table, events, administration, status and
 * eviction rounds (see kvd/kvd.h for the API, proto/kvd.proto for the wire schema,
 * client-internal.h for what is shared with seq.c).
 *
 * Requests are synchronous round trips under the client's lock: send an Envelope with a
 * fresh id, then read frames until the reply with that id arrives. Frames with id 0 are
 * daemon events and are handled on the way, whoever reads them; replies with another id are
 * answers to fire-and-forget ChunksUnmapped requests and are dropped. Before the lock is
 * released, frames that already sit complete in the receive buffer are handled too, because
 * the socket's poll state (the event fd) does not see bytes the library has already read.
 */

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "client-internal.h"
#include "basic/macro.h"
#include "basic/number.h"
#include "config.h"
#include "cuda-import.h"
#include "kvd/kvd.h"
#include "wire.h"

enum rx_mode {
	RX_BUFFERED, /* only frames already received */
	RX_NONBLOCK, /* and whatever the socket holds now */
	RX_BLOCK,    /* until the awaited reply arrives */
};

/* ---- pid cache for the fork checks ---- */

pid_t client_pid_cache;
bool client_pid_cache_usable;
static pthread_once_t pid_once = PTHREAD_ONCE_INIT;

static void pid_cache_reset(void) {
	__atomic_store_n(&client_pid_cache, 0, __ATOMIC_RELAXED);
}

static void pid_cache_setup(void) {
	/* Without the atfork handler a cached pid could survive into a child: then ask the
	 * kernel every time. */
	client_pid_cache_usable = pthread_atfork(NULL, NULL, pid_cache_reset) == 0;
}

void close_fds(int *fds, uint32_t n) {
	for (uint32_t i = 0; i < n; i++)
		fds[i] = safe_close(fds[i]);
}

/* ---- chunk table ---- */

static struct chunk_slot *chunk_slot(const kvd_client *c, uint32_t id) {
	struct chunk_slot *page;

	if (id >= CHUNK_IDS_MAX)
		return NULL;
	page = __atomic_load_n(&c->chunk_pages[id / CHUNK_PAGE_IDS], __ATOMIC_ACQUIRE);
	return page ? &page[id % CHUNK_PAGE_IDS] : NULL;
}

/* Like chunk_slot(), but allocates the page; called with the lock held. */
static int chunk_slot_make(kvd_client *c, uint32_t id, struct chunk_slot **ret) {
	struct chunk_slot **pagep = &c->chunk_pages[id / CHUNK_PAGE_IDS];

	if (!*pagep) {
		struct chunk_slot *page = calloc(CHUNK_PAGE_IDS, sizeof(*page));

		if (!page)
			return -ENOMEM;
		/* Lock-free readers may look at the page as soon as it is published. */
		__atomic_store_n(pagep, page, __ATOMIC_RELEASE);
	}
	*ret = &(*pagep)[id % CHUNK_PAGE_IDS];
	return 0;
}

/* Gives a chunk's mapping back, in the way the pool's memory was mapped. */
static void chunk_mapping_drop(kvd_client *c, void *addr, uint64_t bytes) {
	if (c->cuda)
		client_cuda_unmap(c->cuda, addr, bytes);
	else
		munmap(addr, bytes);
}

/* Unmaps chunk id if it is mapped here; called with the lock held. */
void chunk_unmap(kvd_client *c, uint32_t id) {
	struct chunk_slot *slot = chunk_slot(c, id);
	void *addr;

	if (!slot || !slot->addr)
		return;
	addr = slot->addr;
	__atomic_store_n(&slot->addr, NULL, __ATOMIC_RELEASE);
	/* bytes stays: a reader still holding the old address must not see it change. */
	chunk_mapping_drop(c, addr, slot->bytes);
	c->n_mapped--;
}

/* Imports a MEMORY_CUDA chunk into the pool's range; fd stays the caller's. */
static int chunk_map_device(kvd_client *c, const Kvd__V1__ChunkGrant *grant, int fd,
                            struct chunk_slot *slot) {
	void *p;
	int r;

	/* A grant of another memory or GPU than the hello announced is a broken peer. */
	if (!c->cuda || !grant->has_device_uuid || grant->device_uuid.len != WIRE_DEVICE_UUID_BYTES ||
	    memcmp(grant->device_uuid.data, c->device_uuid, WIRE_DEVICE_UUID_BYTES) != 0)
		return -EPROTO;
	r = client_cuda_map(c->cuda, grant->chunk_id, fd, grant->bytes, &p);
	if (r < 0)
		return r;
	slot->bytes = grant->bytes;
	__atomic_store_n(&slot->addr, p, __ATOMIC_RELEASE);
	c->n_mapped++;
	return 0;
}

/* Maps a granted chunk and takes ownership of fd. Called with the lock held. */
int chunk_map(kvd_client *c, const Kvd__V1__ChunkGrant *grant, int fd_in) {
	_cleanup_(closep) int fd = fd_in;
	struct chunk_slot *slot;
	struct stat st;
	void *p;
	int r;

	if (!grant->has_chunk_id || grant->chunk_id >= CHUNK_IDS_MAX || !grant->has_bytes ||
	    grant->bytes == 0 || grant->bytes > SIZE_MAX)
		return -EPROTO;
	r = chunk_slot_make(c, grant->chunk_id, &slot);
	if (r < 0)
		return r;
	/* The daemon sends a chunk once per connection, so a second grant is a broken peer. */
	if (slot->addr)
		return -EPROTO;
	if ((grant->has_memory ? (uint32_t)grant->memory : KVD_MEMORY_HOST) != c->memory)
		return -EPROTO;
	if (c->memory == KVD_MEMORY_CUDA)
		return chunk_map_device(c, grant, fd, slot);
	/* A file shorter than the grant would fault on access instead of failing here. */
	if (fstat(fd, &st) < 0)
		return negative_errno();
	if (S_ISREG(st.st_mode) && (uint64_t)st.st_size < grant->bytes)
		return -EPROTO;

	p = mmap(NULL, grant->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED)
		return negative_errno();
	/* KV memory must not leak into fork() children (see kvd.h). */
	if (madvise(p, grant->bytes, MADV_DONTFORK) < 0) {
		r = negative_errno();
		munmap(p, grant->bytes);
		return r;
	}
	slot->bytes = grant->bytes;
	__atomic_store_n(&slot->addr, p, __ATOMIC_RELEASE);
	c->n_mapped++;
	return 0;
}

/* ---- events ---- */

/* The event fd is readable exactly while the queue is not empty. Called with the lock. */
static void client_update_event_fd(kvd_client *c) {
	uint64_t v = 1;

	if (c->n_events > 0 && !c->event_fd_signalled) {
		if (write(c->event_fd, &v, sizeof(v)) == sizeof(v))
			c->event_fd_signalled = true;
	} else if (c->n_events == 0 && c->event_fd_signalled) {
		/* Non-blocking: EAGAIN only if somebody else drained it, which is fine. */
		(void)!read(c->event_fd, &v, sizeof(v));
		c->event_fd_signalled = false;
	}
}

static void client_queue_event(kvd_client *c, uint32_t type, uint64_t arg) {
	/* An event says "look again": a second one for the same thing (STOPPING twice, the same
	 * sequence changed twice) says nothing new. Past the bound events are dropped; for
	 * SEQ_CHANGED that is safe, since the generation tells a reader what changed. */
	for (uint32_t i = 0; i < c->n_events; i++) {
		const kvd_event *e = &c->events[(c->events_head + i) % EVENTS_MAX];

		if (e->type == type && e->arg == arg)
			return;
	}
	/* The last slot is kept for STOPPING and DISCONNECTED: many sequence changes must not
	 * hide the end of the connection. */
	if (c->n_events >= EVENTS_MAX || (c->n_events == EVENTS_MAX - 1 && type != KVD_EVENT_STOPPING &&
	                                  type != KVD_EVENT_DISCONNECTED))
		return;
	c->events[(c->events_head + c->n_events) % EVENTS_MAX] = (kvd_event){
		.type = type,
		.arg = arg,
	};
	c->n_events++;
}

/* ---- transport ---- */

/* The connection is unusable: shut it down so that the daemon drops our sequences now. The
 * fd itself stays open until the last unref, so that the event fd's epoll set stays valid
 * and reports the hangup. */
static int client_fail(kvd_client *c, int r) {
	if (!c->dead) {
		c->dead = true;
		shutdown(c->fd, SHUT_RDWR);
		/* Ring requests in flight would wait for a daemon that is not there. */
		if (c->ring)
			client_ring_break(c->ring, -ECONNRESET);
		/* The engine learns of the loss from its event loop, before -ECONNRESET. */
		client_queue_event(c, KVD_EVENT_DISCONNECTED, c->epoch);
	}
	return r;
}

static int client_peer_gone(kvd_client *c);
static int client_dial(kvd_client *c);

/* Sends a frame; with send_fd >= 0, the frame carries that fd (the peer gets a copy). */
static int client_send(kvd_client *c, const Envelope *env, int send_fd) {
	_cleanup_(freep) uint8_t *frame = NULL;
	size_t size, done = 0;
	int r;

	if (c->dead)
		return -ECONNRESET;
	r = wire_encode(env, send_fd >= 0 ? 1 : 0, &frame, &size);
	if (r == -EMSGSIZE)
		return -EINVAL; /* only caller-supplied strings or lists can make it this big */
	if (r < 0)
		return r;

	while (done < size) {
		union {
			struct cmsghdr align;
			uint8_t buf[CMSG_SPACE(sizeof(int))];
		} control;
		struct iovec iov = { .iov_base = frame + done, .iov_len = size - done };
		struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };
		ssize_t n;

		/* The fd travels with the frame's first byte, which is where the receiver's FIFO
		 * expects it (wire.h); once a byte is out, so is the fd. */
		if (send_fd >= 0 && done == 0) {
			struct cmsghdr *cm;

			memset(&control, 0, sizeof(control));
			msg.msg_control = control.buf;
			msg.msg_controllen = sizeof(control.buf);
			cm = CMSG_FIRSTHDR(&msg);
			cm->cmsg_level = SOL_SOCKET;
			cm->cmsg_type = SCM_RIGHTS;
			cm->cmsg_len = CMSG_LEN(sizeof(int));
			memcpy(CMSG_DATA(cm), &send_fd, sizeof(int));
		}
		n = sendmsg(c->fd, &msg, MSG_NOSIGNAL);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			if (errno == EPIPE || errno == ECONNRESET)
				return client_peer_gone(c);
			r = negative_errno();
			/* Half a frame on the stream cannot be taken back. */
			return done > 0 ? client_fail(c, r) : r;
		}
		done += n;
	}
	return 0;
}

static int client_request_fd(kvd_client *c, Envelope *env, int send_fd, uint64_t *ret_id) {
	if (++c->next_id == 0)
		c->next_id = 1;
	env->has_id = true;
	env->id = c->next_id;
	*ret_id = c->next_id;
	return client_send(c, env, send_fd);
}

/* Sends a request with a fresh id. */
int client_request(kvd_client *c, Envelope *env, uint64_t *ret_id) {
	return client_request_fd(c, env, -EBADF, ret_id);
}

int client_request_unwaited(kvd_client *c, Envelope *env) {
	uint64_t id;
	int r = client_request(c, env, &id);

	if (r >= 0)
		__atomic_store_n(&c->unwaited, c->unwaited + 1, __ATOMIC_RELAXED);
	return r;
}

/* One recvmsg(). Returns 1 after receiving bytes, 0 if nothing is there (non-blocking),
 * or a negative errno (the client is then dead). */
static int client_recv(kvd_client *c, bool wait) {
	union {
		struct cmsghdr align;
		uint8_t buf[WIRE_CMSG_SPACE];
	} control;
	struct iovec iov;
	struct msghdr msg = {
		.msg_iov = &iov,
		.msg_iovlen = 1,
		.msg_control = &control,
		.msg_controllen = sizeof(control),
	};
	uint64_t spin = wait ? __atomic_load_n(&c->spin_ns, __ATOMIC_RELAXED) : 0;
	struct ring_spin spinner = {};
	bool spinning = spin > 0;
	ssize_t n;
	int r;

	iov.iov_base = wire_rx_space(c->rx, &iov.iov_len);
	if (iov.iov_len == 0)
		return client_fail(c, -EPROTO); /* cannot happen with a sane wire_rx */

	/* A reply that comes while we spin costs no sleep and no wake-up (kvd_client_set_spin). */
	if (spinning)
		ring_spin_start(&spinner, ring_now_ns());
	for (;;) {
		uint64_t now;

		msg.msg_controllen = sizeof(control);
		n = recvmsg(c->fd, &msg, MSG_CMSG_CLOEXEC | (wait && !spinning ? 0 : MSG_DONTWAIT));
		if (n >= 0)
			break;
		if (errno == EINTR)
			continue;
		if (!spinning || (errno != EAGAIN && errno != EWOULDBLOCK))
			break;
		now = ring_now_ns();
		if (now - spinner.start >= spin)
			spinning = false;
		else
			ring_spin_step(&spinner, now);
	}
	if (n < 0) {
		if (!wait && (errno == EAGAIN || errno == EWOULDBLOCK))
			return 0;
		if (errno == ECONNRESET || errno == EPIPE)
			return client_fail(c, -ECONNRESET);
		return client_fail(c, negative_errno());
	}
	/* fds come before the bytes they belong to, and must be queued even with EOF. */
	r = wire_rx_take_cmsg(c->rx, &msg);
	if (r < 0)
		/* fds were lost (most likely RLIMIT_NOFILE), so frames and fds no longer pair. */
		return client_fail(c, -EMFILE);
	if (n == 0)
		return client_fail(c, -ECONNRESET);
	wire_rx_commit(c->rx, n);
	return 1;
}

static void client_set_error(kvd_client *c, const char *message);

static int client_close_reason(kvd_client *c, const Kvd__V1__Status *st) {
	client_set_error(c, st->message);
	return client_fail(c, st->code);
}

/*
 * The daemon hung up while we were sending. It may have said why first (a connection it
 * refused gets a status frame with id 0): returns that error if it did, else -ECONNRESET.
 */
static int client_peer_gone(kvd_client *c) {
	int fds[WIRE_FDS_MAX];
	uint32_t nfds;

	for (;;) {
		Envelope *env;
		int r = wire_rx_next(c->rx, &env, fds, &nfds);

		if (r < 0)
			break;
		if (r > 0) {
			close_fds(fds, nfds);
			if ((!env->has_id || env->id == 0) && env->body_case == KVD__V1__ENVELOPE__BODY__NOT_SET &&
			    env->status && env->status->code < 0)
				return client_close_reason(c, env->status);
			continue;
		}
		if (client_recv(c, false) <= 0)
			break;
	}
	return client_fail(c, -ECONNRESET);
}

/*
 * Tells the daemon that ids are no longer mapped here, without waiting (the reply is
 * dropped when it arrives): the answer to an unmap request, and what the client still
 * mapped when it goes away, since a connection that closes still mapping chunks keeps them
 * charged to its tenant until this process exits (kvd(8), ISOLATION).
 */
static void client_tell_unmapped(kvd_client *c, uint32_t *ids, uint32_t n) {
	Kvd__V1__ChunksUnmapped done = KVD__V1__CHUNKS_UNMAPPED__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;

	done.n_chunk_ids = n;
	done.chunk_ids = ids;
	env.body_case = KVD__V1__ENVELOPE__BODY_CHUNKS_UNMAPPED;
	env.chunks_unmapped = &done;
	(void)client_request_unwaited(c, &env);
}

/* Handles an event; takes its fds. Returns 0, or a negative errno when the daemon broke
 * the protocol (the client is failed then). */
static int client_handle_event(kvd_client *c, const Kvd__V1__Event *ev, int *fds, uint32_t nfds) {
	if (ev->has_type && ev->type == KVD__V1__EVENT_TYPE__EVENT_CHUNKS_GRANT) {
		int r = 0;

		if (ev->n_grants != nfds) {
			close_fds(fds, nfds);
			return client_fail(c, -EPROTO);
		}
		/* As for a SeqGrowReply: a chunk that cannot be mapped stays unmapped, and the
		 * ring request waiting for it returns the error (client_ring_finish()). */
		for (size_t i = 0; i < ev->n_grants; i++) {
			int k = chunk_map(c, ev->grants[i], TAKE_FD(fds[i]));

			if (k == -EPROTO)
				r = k;
			else if (k < 0 && c->grant_error == 0)
				c->grant_error = k;
		}
		return r < 0 ? client_fail(c, r) : 0;
	}
	close_fds(fds, nfds);
	if (!ev->has_type)
		return 0;
	switch (ev->type) {
	case KVD__V1__EVENT_TYPE__EVENT_CHUNKS_UNMAP:
		for (size_t i = 0; i < ev->n_chunk_ids; i++)
			chunk_unmap(c, ev->chunk_ids[i]);
		/* Ids we never mapped are reported too: they are not mapped here, which is all
		 * the daemon needs to hear. The reply is dropped when it arrives. */
		client_tell_unmapped(c, ev->chunk_ids, (uint32_t)ev->n_chunk_ids);
		break;
	case KVD__V1__EVENT_TYPE__EVENT_STOPPING:
		client_queue_event(c, KVD_EVENT_STOPPING, 0);
		break;
	case KVD__V1__EVENT_TYPE__EVENT_SEQ_CHANGED:
		if (ev->has_seq_id)
			client_queue_event(c, KVD_EVENT_SEQ_CHANGED, ev->seq_id);
		break;
	default:
		/* Unknown events are newer than us; ignoring them is the compatibility rule. */
		break;
	}
	return 0;
}

/*
 * Reads frames, handling events and dropping stray replies, until the reply with id
 * `awaiting` (never 0) arrives: returns 1 with it in *ret_env (valid until the next read)
 * and its fds, owned by the caller, in fds[0..*ret_nfds). Returns 0 when the mode allows no
 * more reading, or a negative errno.
 */
static int client_read(kvd_client *c, enum rx_mode mode, uint64_t awaiting, Envelope **ret_env,
		       int fds[static WIRE_FDS_MAX], uint32_t *ret_nfds) {
	for (;;) {
		Envelope *env;
		uint32_t nfds;
		int r;

		r = wire_rx_next(c->rx, &env, fds, &nfds);
		if (r < 0)
			/* Even -EBADMSG, which wire_rx could skip: if that frame was our reply we
			 * would wait forever. */
			return client_fail(c, -EPROTO);
		if (r > 0) {
			c->frames_read++;
			if (!env->has_id || env->id == 0) {
				if (env->body_case == KVD__V1__ENVELOPE__BODY_EVENT) {
					r = client_handle_event(c, env->event, fds, nfds);
					if (r < 0)
						return r;
					continue;
				}
				close_fds(fds, nfds);
				if (env->status && env->status->code < 0)
					/* Why the daemon is about to close the connection (a refusal,
					 * a broken frame): that is the error to report. */
					return client_close_reason(c, env->status);
				continue;
			}
			if (awaiting != 0 && env->id == awaiting) {
				*ret_env = env;
				*ret_nfds = nfds;
				return 1;
			}
			close_fds(fds, nfds);
			continue;
		}
		if (mode == RX_BUFFERED)
			return 0;
		if (c->dead)
			return -ECONNRESET;
		r = client_recv(c, mode == RX_BLOCK);
		if (r <= 0)
			return r;
	}
}

void client_lock(kvd_client *c) {
	pthread_mutex_lock(&c->lock);
}

/* Handles the complete frames still buffered, so that what they hold shows up on the event
 * fd, then unlocks. */
void client_unlock(kvd_client *c) {
	int fds[WIRE_FDS_MAX];
	Envelope *env;
	uint32_t nfds;

	(void)client_read(c, RX_BUFFERED, 0, &env, fds, &nfds);
	client_update_event_fd(c);
	/* Everything read is handled by now: replies by the calls that waited for them. */
	__atomic_store_n(&c->frames_done, c->frames_read, __ATOMIC_RELEASE);
	pthread_mutex_unlock(&c->lock);
}

static void client_set_error(kvd_client *c, const char *message) {
	size_t n = message ? strnlen(message, LAST_ERROR_MAX - 1) : 0;

	memcpy(c->last_error, message ? message : "", n);
	c->last_error[n] = '\0';
}

/* client_call(), sending send_fd with the request when it is >= 0. */
static int client_transact(kvd_client *c, Envelope *env, int send_fd, int want,
			   bool stop_after_send, Envelope **ret_reply, int fds[static WIRE_FDS_MAX],
			   uint32_t *ret_nfds) {
	uint64_t unwaited = c->unwaited;
	Envelope *reply;
	uint32_t nfds;
	uint64_t id;
	int r, code = 0;

	r = client_request_fd(c, env, send_fd, &id);
	if (r < 0)
		return r;
	if (stop_after_send)
		raise(SIGSTOP);
	/* No timeout: some replies come only after work that takes long (kvd_evict waits for
	 * an eviction round), and a daemon that hangs up ends the wait anyway. */
	r = client_read(c, RX_BLOCK, id, &reply, fds, &nfds);
	if (r < 0)
		return r;
	/* The daemon handled everything sent before this request. */
	__atomic_store_n(&c->unwaited_done, unwaited, __ATOMIC_RELAXED);

	if (reply->status && reply->status->has_code)
		code = reply->status->code;
	if (code != 0) {
		close_fds(fds, nfds);
		client_set_error(c, reply->status->message);
		return code < 0 ? code : -EPROTO;
	}
	if (want != BODY_ANY && (int)reply->body_case != want) {
		close_fds(fds, nfds);
		return -EPROTO;
	}
	if (ret_nfds)
		*ret_nfds = nfds;
	else
		close_fds(fds, nfds);
	if (ret_reply)
		*ret_reply = reply;
	return 0;
}

/* See client-internal.h. */
int client_call(kvd_client *c, Envelope *env, int want, bool stop_after_send,
		Envelope **ret_reply, int fds[static WIRE_FDS_MAX], uint32_t *ret_nfds) {
	return client_transact(c, env, -EBADF, want, stop_after_send, ret_reply, fds, ret_nfds);
}

int client_call_fd(kvd_client *c, Envelope *env, int send_fd) {
	int fds[WIRE_FDS_MAX];

	return client_transact(c, env, send_fd, BODY_ANY, false, NULL, fds, NULL);
}

/* ---- the rings' follow-ups (ring.c does the rings themselves) ---- */

/*
 * A round trip (an empty ChunksUnmapped, which every daemon answers with a status) while
 * requests sent without waiting are not known to be handled: since the daemon handles a
 * socket's requests in order, its reply covers every request sent before it. Unmap
 * requests read on the way are answered, so one more round trip at most covers those
 * answers too. Under the lock.
 */
static int client_sync(kvd_client *c) {
	for (int i = 0; i < 2 && c->unwaited != c->unwaited_done; i++) {
		Kvd__V1__ChunksUnmapped none = KVD__V1__CHUNKS_UNMAPPED__INIT;
		Envelope env = KVD__V1__ENVELOPE__INIT;
		int fds[WIRE_FDS_MAX];
		int r;

		env.body_case = KVD__V1__ENVELOPE__BODY_CHUNKS_UNMAPPED;
		env.chunks_unmapped = &none;
		r = client_call(c, &env, BODY_ANY, false, NULL, fds, NULL);
		if (r < 0)
			return r;
	}
	return 0;
}

int client_ring_barrier(kvd_client *c) {
	int r;

	if (__atomic_load_n(&c->unwaited, __ATOMIC_RELAXED) ==
	    __atomic_load_n(&c->unwaited_done, __ATOMIC_RELAXED))
		return 0;
	client_lock(c);
	r = client_sync(c);
	client_unlock(c);
	return r;
}

/* Whether fewer than `frames` (the rings' frames word, mod 2^32) were handled. */
static bool client_frames_behind(uint64_t done, uint32_t frames) {
	return (int32_t)(frames - (uint32_t)done) > 0;
}

/* Reads and handles frames until `frames` of them were read in all. Under the lock, when no
 * request waits for its reply: a reply read here is a stray one. */
static int client_catch_up(kvd_client *c, uint32_t frames) {
	while (client_frames_behind(c->frames_read, frames)) {
		int fds[WIRE_FDS_MAX];
		Envelope *env;
		uint32_t nfds;
		int r;

		r = client_read(c, RX_BUFFERED, 0, &env, fds, &nfds);
		if (r < 0)
			return r;
		if (client_frames_behind(c->frames_read, frames) && (r = client_recv(c, true)) < 0)
			return r;
	}
	return 0;
}

int client_ring_finish(kvd_client *c, const struct ring_done *d, bool stop_before_sync) {
	bool behind = client_frames_behind(__atomic_load_n(&c->frames_done, __ATOMIC_ACQUIRE),
	                                   d->frames);
	int r = d->cqe.res > 0 ? -EPROTO : d->cqe.res;

	/* The common case: nothing to read, no message to keep, no system call. */
	if (!behind && r == 0)
		return 0;
	if (stop_before_sync && behind)
		raise(SIGSTOP);
	client_lock(c);
	if (behind) {
		int k = client_catch_up(c, d->frames);

		if (k >= 0)
			k = client_sync(c);
		if (r >= 0)
			r = k;
		/* A chunk a grant could not map (see kvd_seq_grow). */
		if (r >= 0 && c->grant_error < 0)
			r = c->grant_error;
		c->grant_error = 0;
	}
	if (d->cqe.res < 0)
		client_set_error(c, (d->cqe.flags & RING_CQE_F_MESSAGE) ? d->msg : "");
	client_unlock(c);
	return r;
}

void client_ring_serve(kvd_client *c) {
	int fds[WIRE_FDS_MAX];
	Envelope *env;
	uint32_t nfds;

	if (pthread_mutex_trylock(&c->lock) != 0)
		return;
	/* No request is outstanding under the lock: every reply read here is a stray one. */
	(void)client_read(c, RX_NONBLOCK, 0, &env, fds, &nfds);
	client_unlock(c);
}

int client_ring_lost(kvd_client *c, int r) {
	client_lock(c);
	r = client_fail(c, r);
	client_unlock(c);
	return r;
}

/* ---- connection ---- */

/* [A-Za-z0-9_.-]; not isalnum(), which follows the locale. */
static bool tenant_char_valid(char ch) {
	return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
	       ch == '_' || ch == '.' || ch == '-';
}

static bool tenant_name_valid(const char *s) {
	size_t n = 0;

	for (; s[n]; n++)
		if (n >= KVD_TENANT_NAME_MAX || !tenant_char_valid(s[n]))
			return false;
	return n > 0;
}

static enum stop_at stop_at_from_env(void) {
#if KVD_TEST_HOOKS
	const char *e = secure_getenv("KVD_TEST_STOP_AT");
#else
	const char *e = NULL;
#endif

	if (!e)
		return STOP_NONE;
	if (strcmp(e, "grow-sent") == 0)
		return STOP_GROW_SENT;
	if (strcmp(e, "grow-mapped") == 0)
		return STOP_GROW_MAPPED;
	if (strcmp(e, "release-replied") == 0)
		return STOP_RELEASE_REPLIED;
	return STOP_NONE;
}

static void client_free(kvd_client *c) {
	bool child = client_forked(c);

	for (uint32_t p = 0; p < CHUNK_PAGES; p++) {
		struct chunk_slot *page = c->chunk_pages[p];
		uint32_t ids[CHUNK_PAGE_IDS], n = 0;

		if (!page)
			continue;
		/* In a fork() child the chunks are not mapped (MADV_DONTFORK) and their
		 * addresses may hold the child's own mappings by now: leave them alone. */
		for (uint32_t i = 0; !child && i < CHUNK_PAGE_IDS; i++)
			if (page[i].addr) {
				chunk_mapping_drop(c, page[i].addr, page[i].bytes);
				ids[n++] = p * CHUNK_PAGE_IDS + i;
			}
		free(page);
		if (n > 0 && c->fd >= 0)
			client_tell_unmapped(c, ids, n);
	}
	c->cuda = client_cuda_free(c->cuda, child);
	if (c->rx) {
		wire_rx_done(c->rx);
		free(c->rx);
	}
	c->ring = client_ring_free(c->ring, child);
	safe_close(c->epoll_fd);
	safe_close(c->event_fd);
	/* Closing the socket is how the daemon learns to drop this connection's sequences. */
	safe_close(c->fd);
	free(c->models);
	/* A child may have inherited the mutex locked by another thread: do not touch it. */
	if (!child) {
		pthread_mutex_destroy(&c->lock);
		pthread_rwlock_destroy(&c->ring_lock);
	}
	free(c);
}

/* KVD_SPIN_US, when it is a number in range; else the default. */
static uint64_t spin_ns_from_env(void) {
	const char *e = secure_getenv("KVD_SPIN_US");
	uint32_t us;

	if (!e || number_parse_u32(e, 0, SPIN_US_MAX, &us) < 0)
		us = SPIN_US_DEFAULT;
	return (uint64_t)us * 1000;
}

static int client_new(kvd_client **ret) {
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	struct epoll_event ev = { .events = EPOLLIN };
	const char *e;

	pthread_once(&pid_once, pid_cache_setup);

	c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	c->n_ref = 1;
	c->pid = client_self_pid();
	c->fd = c->epoll_fd = c->event_fd = -EBADF;
	c->dead = true; /* until the hello is through */
	if (pthread_mutex_init(&c->lock, NULL) != 0) {
		free(TAKE_PTR(c));
		return -ENOMEM;
	}
	if (pthread_rwlock_init(&c->ring_lock, NULL) != 0) {
		pthread_mutex_destroy(&c->lock);
		free(TAKE_PTR(c));
		return -ENOMEM;
	}
	c->spin_ns = spin_ns_from_env();
	c->no_ring = (e = secure_getenv("KVD_NO_RING")) && strcmp(e, "1") == 0;
	c->want_ring = !c->no_ring;
	c->rx = malloc(sizeof(*c->rx));
	if (!c->rx)
		return -ENOMEM;
	wire_rx_init(c->rx);
	c->stop_at = stop_at_from_env();

	c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (c->fd < 0)
		return negative_errno();
	c->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
	if (c->epoll_fd < 0)
		return negative_errno();
	c->event_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (c->event_fd < 0)
		return negative_errno();
	if (epoll_ctl(c->epoll_fd, EPOLL_CTL_ADD, c->fd, &ev) < 0 ||
	    epoll_ctl(c->epoll_fd, EPOLL_CTL_ADD, c->event_fd, &ev) < 0)
		return negative_errno();

	*ret = TAKE_PTR(c);
	return 0;
}

/* Replaces the client's rings (NULL: none) once no request uses the old ones. Under the
 * client's lock, or before anyone else can see the client. */
static void client_ring_install(kvd_client *c, struct client_ring *ring) {
	struct client_ring *old;

	pthread_rwlock_wrlock(&c->ring_lock);
	old = c->ring;
	c->ring = ring;
	pthread_rwlock_unlock(&c->ring_lock);
	client_ring_free(old, false);
}

static int client_hello(kvd_client *c, const char *tenant) {
	Kvd__V1__Hello hello = KVD__V1__HELLO__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
	const Kvd__V1__HelloReply *hr;
	struct client_ring *ring;
	uint8_t uuid[WIRE_DEVICE_UUID_BYTES];
	int fds[WIRE_FDS_MAX];
	uint32_t nfds = 0;
	int r;

	/* A new connection knows none of the old one's events. */
	c->n_cuda_events = 0;
	hello.has_min_version = true;
	hello.min_version = KVD_PROTOCOL_VERSION_MIN;
	hello.has_max_version = true;
	hello.max_version = KVD_PROTOCOL_VERSION_MAX;
	hello.has_features = true;
	hello.features = KVD_FEATURE_SEQ_HEADER | KVD_FEATURE_TENANT_POLICY |
	                 (c->no_ring ? 0 : KVD_FEATURE_RING);
#ifdef KVD_HAVE_CUDA
	hello.features |= KVD_FEATURE_DEVICE_CHUNKS;
#endif
	/* An engine's chunks come from its own GPU when the daemon pools several. */
	if (tenant && client_cuda_current_uuid(uuid, sizeof(uuid)) == 0) {
		hello.has_device_uuid = true;
		hello.device_uuid.len = sizeof(uuid);
		hello.device_uuid.data = uuid;
	}
	hello.tenant = (char *)tenant;
	hello.process_name = program_invocation_short_name;
	hello.has_pid = true;
	hello.pid = (uint32_t)c->pid;
	env.body_case = KVD__V1__ENVELOPE__BODY_HELLO;
	env.hello = &hello;

	r = client_call(c, &env, KVD__V1__ENVELOPE__BODY_HELLO_REPLY, false, &reply, fds, &nfds);
	if (r < 0)
		return r;
	hr = reply->hello_reply;
	if (!hr->has_version || hr->version < KVD_PROTOCOL_VERSION_MIN ||
	    hr->version > KVD_PROTOCOL_VERSION_MAX) {
		close_fds(fds, nfds);
		return -EPROTO;
	}
	c->version = hr->version;
	c->features = hr->has_features ? hr->features : 0;
	c->chunk_bytes = hr->has_chunk_bytes ? hr->chunk_bytes : 0;
	c->connection_id = hr->has_connection_id ? hr->connection_id : 0;
	c->memory = hr->has_memory ? (uint32_t)hr->memory : KVD_MEMORY_HOST;
	if (c->memory == KVD_MEMORY_CUDA && c->has_tenant) {
		if (!hr->has_device_uuid || hr->device_uuid.len != WIRE_DEVICE_UUID_BYTES ||
		    !hr->has_pool_bytes) {
			close_fds(fds, nfds);
			return -EPROTO;
		}
		memcpy(c->device_uuid, hr->device_uuid.data, WIRE_DEVICE_UUID_BYTES);
		r = client_cuda_new(c->device_uuid, WIRE_DEVICE_UUID_BYTES, hr->pool_bytes,
		                    c->chunk_bytes, &c->cuda);
		if (r < 0) {
			close_fds(fds, nfds);
			return r;
		}
	} else if (c->memory != KVD_MEMORY_HOST && c->memory != KVD_MEMORY_CUDA) {
		close_fds(fds, nfds);
		return -EPROTO;
	}
	if (!hr->has_features || !(hr->features & KVD_FEATURE_RING)) {
		close_fds(fds, nfds);
		return 0;
	}
	/* The rings' memfd, then the eventfd with that doorbell. */
	if (!hr->has_ring_bytes || !hr->has_ring_doorbell ||
	    nfds != (hr->ring_doorbell == KVD__V1__RING_DOORBELL__RING_DOORBELL_EVENTFD ? 2u : 1u)) {
		close_fds(fds, nfds);
		return -EPROTO;
	}
	r = client_ring_map(fds[0], nfds > 1 ? fds[1] : -EBADF, hr->ring_bytes, hr->ring_doorbell,
	                    &ring);
	if (r < 0)
		return r;
	client_ring_install(c, ring);
	return 0;
}

const char *kvd_version(void) {
	return KVD_VERSION;
}

int params_copy(void *ours, size_t ours_size, const void *theirs, size_t first_size) {
	uint32_t size;

	if (!theirs)
		return -EINVAL;
	memcpy(&size, theirs, sizeof(size));
	if (size < first_size)
		return -EINVAL;
	/* What this library does not know must be unset. */
	for (size_t i = ours_size; i < size; i++)
		if (((const uint8_t *)theirs)[i] != 0)
			return -E2BIG;
	memset(ours, 0, ours_size);
	memcpy(ours, theirs, MIN((size_t)size, ours_size));
	return 0;
}

int kvd_client_connect(const char *socket_path, const char *tenant, kvd_client **ret) {
	kvd_connect_params p = { .size = sizeof(p), .socket_path = socket_path, .tenant = tenant };

	return kvd_client_connect_params(&p, ret);
}

int kvd_client_connect_params(const kvd_connect_params *params, kvd_client **ret) {
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	const char *socket_path, *tenant;
	kvd_connect_params p;
	size_t len;
	int r;

	if (!ret)
		return -EINVAL;
	r = params_copy(&p, sizeof(p), params, KVD_CONNECT_PARAMS_SIZE_1_4);
	if (r < 0)
		return r;
	if ((p.flags & ~KVD_CONNECT_NO_RING) || p.reserved != 0)
		return -EINVAL;
	socket_path = p.socket_path;
	tenant = p.tenant;
	if (!socket_path)
		socket_path = KVD_DEFAULT_SOCKET;
	len = strlen(socket_path);
	if (len == 0)
		return -EINVAL;
	if (len >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	if (tenant && !tenant_name_valid(tenant))
		return -EINVAL;
	memcpy(sa.sun_path, socket_path, len);

	r = client_new(&c);
	if (r < 0)
		return r;
	if (p.flags & KVD_CONNECT_NO_RING)
		c->no_ring = true, c->want_ring = false;
	c->connect_timeout_ms = p.timeout_ms;
	memcpy(c->socket_path, socket_path, strlen(socket_path) + 1);
	if (tenant) {
		c->has_tenant = true;
		memcpy(c->tenant, tenant, strlen(tenant) + 1);
	}
	r = client_dial(c);
	if (r < 0)
		return r;

	*ret = TAKE_PTR(c);
	return 0;
}

/* KVD_CONNECT_TIMEOUT_MS, when it is a number in range; else the default. */
static uint32_t connect_timeout_ms(void) {
	const char *e = secure_getenv("KVD_CONNECT_TIMEOUT_MS");
	uint32_t ms;

	if (!e || number_parse_u32(e, 1, CONNECT_TIMEOUT_MS_MAX, &ms) < 0)
		ms = CONNECT_TIMEOUT_MS_DEFAULT;
	return ms;
}

/* Both directions of c->fd time out after ms (0: never). */
static int socket_timeouts(int fd, uint32_t ms) {
	struct timeval tv = { .tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000 };

	if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) < 0 ||
	    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) < 0)
		return negative_errno();
	return 0;
}

/*
 * Connects c->fd (a fresh socket) to the daemon and says hello, within the connect timeout:
 * a daemon that does not accept (stopped, or out of fds with a full backlog) or does not
 * answer must not hang the caller. The socket blocks without a timeout after.
 */
static int client_dial(kvd_client *c) {
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	size_t len = strlen(c->socket_path);
	int r;

	memcpy(sa.sun_path, c->socket_path, len);
	len += offsetof(struct sockaddr_un, sun_path) + 1;
	r = socket_timeouts(c->fd, c->connect_timeout_ms ? c->connect_timeout_ms : connect_timeout_ms());
	if (r < 0)
		return r;
	if (connect(c->fd, (struct sockaddr *)&sa, (socklen_t)len) < 0)
		return errno == EAGAIN ? -ETIMEDOUT : negative_errno();
	c->dead = false;
	r = client_hello(c, c->has_tenant ? c->tenant : NULL);
	if (r == -EAGAIN || r == -EWOULDBLOCK)
		return -ETIMEDOUT;
	if (r < 0)
		return r;
	r = socket_timeouts(c->fd, 0);
	return r < 0 ? client_fail(c, r) : r;
}

/* Drops what belonged to the lost connection: its chunks, models and stray input. */
static void client_forget(kvd_client *c) {
	for (uint32_t p = 0; p < CHUNK_PAGES; p++) {
		struct chunk_slot *page = c->chunk_pages[p];

		for (uint32_t i = 0; page && i < CHUNK_PAGE_IDS; i++)
			if (page[i].addr) {
				void *addr = page[i].addr;

				__atomic_store_n(&page[i].addr, NULL, __ATOMIC_RELEASE);
				chunk_mapping_drop(c, addr, page[i].bytes);
			}
	}
	c->n_mapped = 0;
	/* The next daemon may pool another GPU, or host memory. */
	c->cuda = client_cuda_free(c->cuda, false);
	c->memory = KVD_MEMORY_HOST;
	/* The counts the rings compare with are the lost connection's. */
	c->frames_read = 0;
	__atomic_store_n(&c->frames_done, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&c->unwaited, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&c->unwaited_done, 0, __ATOMIC_RELAXED);
	/* n_models is the table's size; the old ids mean nothing to the new daemon. */
	for (uint32_t i = 0; i < c->n_models; i++)
		c->models[i] = (struct model){};
	wire_rx_done(c->rx);
	wire_rx_init(c->rx);
}

int kvd_client_reconnect(kvd_client *c, uint32_t timeout_ms) {
	struct epoll_event ev = { .events = EPOLLIN };
	uint64_t deadline;
	struct timespec ts;
	int r;

	if (!c)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	client_lock(c);
	if (!c->dead) {
		client_unlock(c);
		return -EISCONN;
	}
	clock_gettime(CLOCK_MONOTONIC, &ts);
	deadline = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000 + timeout_ms;
	/* The lost connection's rings go first: ring requests read the socket's fd too. Those
	 * still in flight fail at once, since the rings are broken. */
	client_ring_install(c, NULL);
	for (;;) {
		uint64_t now;

		/* A new socket for every try: a failed connect() leaves one unusable. */
		epoll_ctl(c->epoll_fd, EPOLL_CTL_DEL, c->fd, NULL);
		safe_close(c->fd);
		c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (c->fd < 0) {
			r = negative_errno();
			break;
		}
		if (epoll_ctl(c->epoll_fd, EPOLL_CTL_ADD, c->fd, &ev) < 0) {
			r = negative_errno();
			break;
		}
		client_forget(c);
		r = client_dial(c);
		/* Only "not there (yet)" is worth waiting for; a refusal is final. */
		if (r >= 0 || (r != -ECONNREFUSED && r != -ENOENT && r != -ECONNRESET && r != -EPIPE &&
		               r != -ESHUTDOWN))
			break;
		c->dead = true;
		clock_gettime(CLOCK_MONOTONIC, &ts);
		now = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
		if (now >= deadline) {
			r = -ETIMEDOUT;
			break;
		}
		usleep((useconds_t)MIN(deadline - now, 50u) * 1000);
	}
	if (r >= 0) {
		c->epoch++;
		/* A DISCONNECTED still queued is about the old connection: keep it, the engine
		 * may want to see it; nothing else queued refers to live state any more. */
	} else
		client_fail(c, r);
	client_unlock(c);
	return r;
}

kvd_client *kvd_client_ref(kvd_client *c) {
	if (c)
		__atomic_add_fetch(&c->n_ref, 1, __ATOMIC_RELAXED);
	return c;
}

kvd_client *kvd_client_unref(kvd_client *c) {
	if (!c)
		return NULL;
	/* Acquire-release, so that the freeing thread sees every other thread's last use. */
	if (__atomic_sub_fetch(&c->n_ref, 1, __ATOMIC_ACQ_REL) == 0)
		client_free(c);
	return NULL;
}

const char *kvd_client_last_error(kvd_client *c) {
	if (!c || client_forked(c))
		return "";
	return c->last_error;
}

int kvd_client_protocol_version(kvd_client *c) {
	if (!c)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	return (int)c->version;
}

uint64_t kvd_client_chunk_bytes(kvd_client *c) {
	if (!c || client_forked(c))
		return 0;
	return c->chunk_bytes;
}

int kvd_client_memory(kvd_client *c, int32_t *ret_device) {
	int32_t device;
	int memory;

	if (!c)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	client_lock(c);
	memory = (int)c->memory;
	device = c->cuda ? client_cuda_device(c->cuda) : -1;
	client_unlock(c);
	if (ret_device)
		*ret_device = device;
	return memory;
}

int kvd_client_set_ring(kvd_client *c, int enable) {
	int r = 0;

	if (!c)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	pthread_rwlock_rdlock(&c->ring_lock);
	if (enable && !c->ring)
		r = -EOPNOTSUPP;
	else
		__atomic_store_n(&c->want_ring, !!enable, __ATOMIC_RELAXED);
	pthread_rwlock_unlock(&c->ring_lock);
	return r;
}

int kvd_client_get_ring(kvd_client *c) {
	int r;

	if (!c)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	pthread_rwlock_rdlock(&c->ring_lock);
	r = c->ring && __atomic_load_n(&c->want_ring, __ATOMIC_RELAXED);
	pthread_rwlock_unlock(&c->ring_lock);
	return r;
}

int kvd_client_set_spin(kvd_client *c, uint32_t spin_us) {
	if (!c || spin_us > SPIN_US_MAX)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	__atomic_store_n(&c->spin_ns, (uint64_t)spin_us * 1000, __ATOMIC_RELAXED);
	return 0;
}

int kvd_client_get_event_fd(kvd_client *c) {
	if (!c)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	return c->epoll_fd;
}

int kvd_client_next_event(kvd_client *c, kvd_event *ret) {
	int fds[WIRE_FDS_MAX];
	Envelope *env;
	uint32_t nfds;
	int r;

	if (!c || !ret)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;

	client_lock(c);
	/* No request is outstanding under the lock, so every reply read here is a stray one. */
	r = client_read(c, RX_NONBLOCK, 0, &env, fds, &nfds);
	/* Events that arrived before a hangup are still delivered, the hangup after them. */
	if (c->n_events > 0) {
		*ret = c->events[c->events_head];
		c->events_head = (c->events_head + 1) % EVENTS_MAX;
		c->n_events--;
		r = 1;
	}
	client_unlock(c);
	return r;
}

int kvd_client_mapped_chunks(kvd_client *c, uint32_t *ids, uint32_t n, uint32_t *ret_n) {
	uint32_t k = 0;

	if (!c)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;

	client_lock(c);
	for (uint32_t p = 0; ids && k < n && p < CHUNK_PAGES; p++) {
		const struct chunk_slot *page = c->chunk_pages[p];

		for (uint32_t i = 0; page && k < n && i < CHUNK_PAGE_IDS; i++)
			if (page[i].addr)
				ids[k++] = p * CHUNK_PAGE_IDS + i;
	}
	if (ret_n)
		*ret_n = c->n_mapped;
	client_unlock(c);
	return 0;
}

/* ---- administration ---- */

/*
 * A request whose reply carries nothing but a status. Code 0 with a message means done
 * with a caveat (a live change the daemon could not save): returns 1 and keeps the message
 * for kvd_client_last_error().
 */
static int client_simple_call(kvd_client *c, Envelope *env) {
	int fds[WIRE_FDS_MAX];
	Envelope *reply;
	int r;

	client_lock(c);
	r = client_call(c, env, BODY_ANY, false, &reply, fds, NULL);
	if (r >= 0 && reply->status && reply->status->message && *reply->status->message) {
		client_set_error(c, reply->status->message);
		r = 1;
	}
	client_unlock(c);
	return r;
}

int kvd_budget_set(kvd_client *c, uint64_t bytes) {
	Kvd__V1__BudgetSet req = KVD__V1__BUDGET_SET__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;

	if (!c)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	req.has_bytes = true;
	req.bytes = bytes;
	env.body_case = KVD__V1__ENVELOPE__BODY_BUDGET_SET;
	env.budget_set = &req;
	return client_simple_call(c, &env);
}

int kvd_tenant_set(kvd_client *c, const char *tenant, uint64_t min_bytes,
		   uint64_t max_bytes, uint32_t weight) {
	kvd_tenant_params p = {
		.size = sizeof(p),
		.set = (min_bytes != KVD_TENANT_KEEP ? KVD_TENANT_SET_MIN : 0) |
		       (max_bytes != KVD_TENANT_KEEP ? KVD_TENANT_SET_MAX : 0) |
		       (weight != 0 ? KVD_TENANT_SET_WEIGHT : 0),
		.min_bytes = min_bytes,
		.max_bytes = max_bytes,
		.weight = weight,
	};

	return kvd_tenant_set_params(c, tenant, &p);
}

int kvd_tenant_set_params(kvd_client *c, const char *tenant, const kvd_tenant_params *params) {
	Kvd__V1__TenantSet req = KVD__V1__TENANT_SET__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	kvd_tenant_params p;
	int r;

	if (!c || !tenant || !tenant_name_valid(tenant))
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	r = params_copy(&p, sizeof(p), params, KVD_TENANT_PARAMS_SIZE_1_4);
	if (r < 0)
		return r;
	if ((p.set & ~(KVD_TENANT_SET_MIN | KVD_TENANT_SET_MAX | KVD_TENANT_SET_WEIGHT |
		       KVD_TENANT_SET_POLICY)) || p.reserved != 0 ||
	    ((p.set & KVD_TENANT_SET_POLICY) && !p.policy))
		return -EINVAL;
	/* A daemon that predates the field would drop it without a word. */
	if ((p.set & KVD_TENANT_SET_POLICY) && !(c->features & KVD_FEATURE_TENANT_POLICY))
		return -EOPNOTSUPP;
	req.name = (char *)tenant;
	req.has_min_bytes = p.set & KVD_TENANT_SET_MIN;
	req.min_bytes = p.min_bytes;
	req.has_max_bytes = p.set & KVD_TENANT_SET_MAX;
	req.max_bytes = p.max_bytes;
	req.has_weight = p.set & KVD_TENANT_SET_WEIGHT;
	req.weight = p.weight;
	req.policy = p.set & KVD_TENANT_SET_POLICY ? (char *)p.policy : NULL;
	env.body_case = KVD__V1__ENVELOPE__BODY_TENANT_SET;
	env.tenant_set = &req;
	return client_simple_call(c, &env);
}

int kvd_budget_reset(kvd_client *c) {
	Kvd__V1__BudgetReset req = KVD__V1__BUDGET_RESET__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;

	if (!c)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	env.body_case = KVD__V1__ENVELOPE__BODY_BUDGET_RESET;
	env.budget_reset = &req;
	return client_simple_call(c, &env);
}

/* A request that names one tenant (env's body holds the name): checks it, then calls. */
static int tenant_call(kvd_client *c, const char *tenant, Envelope *env) {
	if (!c || !tenant || !tenant_name_valid(tenant))
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	return client_simple_call(c, env);
}

int kvd_tenant_reset(kvd_client *c, const char *tenant) {
	Kvd__V1__TenantReset req = KVD__V1__TENANT_RESET__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;

	req.name = (char *)tenant;
	env.body_case = KVD__V1__ENVELOPE__BODY_TENANT_RESET;
	env.tenant_reset = &req;
	return tenant_call(c, tenant, &env);
}

int kvd_tenant_delete(kvd_client *c, const char *tenant) {
	Kvd__V1__TenantDelete req = KVD__V1__TENANT_DELETE__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;

	req.name = (char *)tenant;
	env.body_case = KVD__V1__ENVELOPE__BODY_TENANT_DELETE;
	env.tenant_delete = &req;
	return tenant_call(c, tenant, &env);
}

/* ---- status ---- */

/* The strings kvd_status_tenant_str() knows, in the order of status_tenant.str. */
static const char *const tenant_str_keys[] = {
	"min_source", "max_source", "weight_source", "policy", "policy_source",
};
#define TENANT_STR_KEYS ELEMENTSOF(tenant_str_keys)

/* Fields of a reply message, at most: the bits of `present`. */
#define VALUES_MAX 64u

/*
 * Numbers read by name (status, tenants, evictions): every optional integer field of a
 * reply message, named as kvd.proto names it, so that a number the daemon adds is a key
 * here at once, with no list to keep in step. values[i] is the message's field i.
 */
struct status_values {
	const ProtobufCMessageDescriptor *desc; /* NULL: nothing read */
	uint64_t v[VALUES_MAX];
	uint64_t present; /* bit i: v[i] was sent */
};

struct status_tenant {
	char *name;
	struct status_values values;
	char *str[TENANT_STR_KEYS]; /* NULL: not sent */
};

struct kvd_status {
	struct status_values node;
	/* Refusals by limit, as the daemon names them ("refused_" + name for kvd_status_u64). */
	uint32_t n_refused;
	char **refused_names;
	uint64_t *refused;
	char *daemon_version;
	char *backend;
	char *budget_source;
	char *state_error;
	uint32_t n_tenants;
	struct status_tenant *tenants;
};

static bool field_is_number(const ProtobufCFieldDescriptor *f) {
	return f->label == PROTOBUF_C_LABEL_OPTIONAL &&
	       (f->type == PROTOBUF_C_TYPE_UINT32 || f->type == PROTOBUF_C_TYPE_UINT64);
}

static void status_values_read(struct status_values *sv, const ProtobufCMessage *m) {
	const ProtobufCMessageDescriptor *d = m->descriptor;
	const char *base = (const char *)m;

	sv->desc = d;
	sv->present = 0;
	for (unsigned i = 0; i < d->n_fields && i < VALUES_MAX; i++) {
		const ProtobufCFieldDescriptor *f = &d->fields[i];

		if (!field_is_number(f) || !*(const protobuf_c_boolean *)(base + f->quantifier_offset))
			continue;
		sv->v[i] = f->type == PROTOBUF_C_TYPE_UINT32 ? *(const uint32_t *)(base + f->offset) :
		                                                *(const uint64_t *)(base + f->offset);
		sv->present |= UINT64_C(1) << i;
	}
}

static int status_get(const struct status_values *sv, const char *key, uint64_t *ret) {
	for (unsigned i = 0; sv->desc && i < sv->desc->n_fields && i < VALUES_MAX; i++) {
		const ProtobufCFieldDescriptor *f = &sv->desc->fields[i];

		if (!field_is_number(f) || strcmp(f->name, key) != 0)
			continue;
		if (!(sv->present & (UINT64_C(1) << i)))
			return -ENOENT;
		*ret = sv->v[i];
		return 0;
	}
	return -ENOENT;
}

/* Copies a reply into a status that outlives the receive buffer. */
static int status_copy(const Kvd__V1__StatusReply *rep, kvd_status *st) {
	struct status_values *n = &st->node;

	if (rep->daemon_version && !(st->daemon_version = strdup(rep->daemon_version)))
		return -ENOMEM;
	if (rep->backend && !(st->backend = strdup(rep->backend)))
		return -ENOMEM;
	if (rep->budget_source && !(st->budget_source = strdup(rep->budget_source)))
		return -ENOMEM;
	if (rep->state_error && !(st->state_error = strdup(rep->state_error)))
		return -ENOMEM;
	status_values_read(n, &rep->base);
	if (rep->n_refused > 0) {
		/* Bounded by the 64 KiB frame like everything else in the reply. */
		st->refused_names = calloc(rep->n_refused, sizeof(char *));
		st->refused = calloc(rep->n_refused, sizeof(uint64_t));
		if (!st->refused_names || !st->refused)
			return -ENOMEM;
		for (size_t i = 0; i < rep->n_refused; i++) {
			const Kvd__V1__Counter *k = rep->refused[i];

			st->refused_names[i] = strdup(k->name ? k->name : "");
			if (!st->refused_names[i])
				return -ENOMEM;
			st->refused[i] = k->has_value ? k->value : 0;
			st->n_refused++;
		}
	}

	if (rep->n_tenants == 0)
		return 0;
	/* A 64 KiB message holds far fewer than UINT32_MAX tenants. */
	st->tenants = calloc(rep->n_tenants, sizeof(*st->tenants));
	if (!st->tenants)
		return -ENOMEM;
	st->n_tenants = rep->n_tenants;
	for (size_t i = 0; i < rep->n_tenants; i++) {
		const Kvd__V1__TenantStatus *ts = rep->tenants[i];
		struct status_values *tv = &st->tenants[i].values;

		st->tenants[i].name = strdup(ts->name ? ts->name : "");
		if (!st->tenants[i].name)
			return -ENOMEM;
		status_values_read(tv, &ts->base);

		const char *const strs[TENANT_STR_KEYS] = {
			ts->min_source, ts->max_source, ts->weight_source, ts->policy,
			ts->policy_source,
		};

		for (size_t k = 0; k < TENANT_STR_KEYS; k++)
			if (strs[k] && !(st->tenants[i].str[k] = strdup(strs[k])))
				return -ENOMEM;
	}
	return 0;
}

kvd_status *kvd_status_free(kvd_status *st) {
	if (!st)
		return NULL;
	for (uint32_t i = 0; i < st->n_refused; i++)
		free(st->refused_names[i]);
	free(st->refused_names);
	free(st->refused);
	for (uint32_t i = 0; i < st->n_tenants; i++) {
		free(st->tenants[i].name);
		for (size_t k = 0; k < TENANT_STR_KEYS; k++)
			free(st->tenants[i].str[k]);
	}
	free(st->tenants);
	free(st->daemon_version);
	free(st->backend);
	free(st->budget_source);
	free(st->state_error);
	free(st);
	return NULL;
}

int kvd_status_get(kvd_client *c, kvd_status **ret) {
	Kvd__V1__StatusRequest req = KVD__V1__STATUS_REQUEST__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
	_cleanup_(kvd_status_freep) kvd_status *st = NULL;
	int fds[WIRE_FDS_MAX];
	int r;

	if (!c || !ret)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	st = calloc(1, sizeof(*st));
	if (!st)
		return -ENOMEM;
	env.body_case = KVD__V1__ENVELOPE__BODY_STATUS_REQUEST;
	env.status_request = &req;

	client_lock(c);
	r = client_call(c, &env, KVD__V1__ENVELOPE__BODY_STATUS_REPLY, false, &reply, fds, NULL);
	if (r >= 0)
		r = status_copy(reply->status_reply, st);
	client_unlock(c);
	if (r < 0)
		return r;

	*ret = TAKE_PTR(st);
	return 0;
}

int kvd_status_u64(const kvd_status *st, const char *key, uint64_t *ret) {
	if (!st || !key || !ret)
		return -EINVAL;
	if (strncmp(key, "refused_", 8) == 0)
		for (uint32_t i = 0; i < st->n_refused; i++)
			if (strcmp(st->refused_names[i], key + 8) == 0) {
				*ret = st->refused[i];
				return 0;
			}
	return status_get(&st->node, key, ret);
}

uint32_t kvd_status_refusals(const kvd_status *st) {
	return st ? st->n_refused : 0;
}

int kvd_status_refusal(const kvd_status *st, uint32_t index, const char **ret_name,
		       uint64_t *ret_value) {
	if (!st || index >= st->n_refused)
		return -EINVAL;
	if (ret_name)
		*ret_name = st->refused_names[index];
	if (ret_value)
		*ret_value = st->refused[index];
	return 0;
}

int kvd_status_str(const kvd_status *st, const char *key, const char **ret) {
	const char *v = NULL;

	if (!st || !key || !ret)
		return -EINVAL;
	if (strcmp(key, "daemon_version") == 0)
		v = st->daemon_version;
	else if (strcmp(key, "backend") == 0)
		v = st->backend;
	else if (strcmp(key, "budget_source") == 0)
		v = st->budget_source;
	else if (strcmp(key, "state_error") == 0)
		v = st->state_error;
	if (!v)
		return -ENOENT;
	*ret = v;
	return 0;
}

uint32_t kvd_status_tenants(const kvd_status *st) {
	return st ? st->n_tenants : 0;
}

int kvd_status_tenant_name(const kvd_status *st, uint32_t index, const char **ret) {
	if (!st || !ret || index >= st->n_tenants)
		return -EINVAL;
	*ret = st->tenants[index].name;
	return 0;
}

int kvd_status_tenant_u64(const kvd_status *st, uint32_t index, const char *key,
			  uint64_t *ret) {
	if (!st || !key || !ret || index >= st->n_tenants)
		return -EINVAL;
	return status_get(&st->tenants[index].values, key, ret);
}

int kvd_status_tenant_str(const kvd_status *st, uint32_t index, const char *key,
			  const char **ret) {
	if (!st || !key || !ret || index >= st->n_tenants)
		return -EINVAL;
	for (size_t k = 0; k < TENANT_STR_KEYS; k++)
		if (strcmp(tenant_str_keys[k], key) == 0) {
			if (!st->tenants[index].str[k])
				return -ENOENT;
			*ret = st->tenants[index].str[k];
			return 0;
		}
	return -ENOENT;
}

/* ---- eviction ---- */

int kvd_evict(kvd_client *c, const char *tenant, uint64_t bytes, uint64_t *ret_freed) {
	Kvd__V1__Evict req = KVD__V1__EVICT__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
	int fds[WIRE_FDS_MAX];
	int r;

	if (!c || (tenant && !tenant_name_valid(tenant)))
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	req.tenant = (char *)tenant;
	req.has_bytes = bytes != 0;
	req.bytes = bytes;
	env.body_case = KVD__V1__ENVELOPE__BODY_EVICT;
	env.evict = &req;

	/* The daemon answers when the round is done; the lock is held until then, like for
	 * any other round trip. */
	client_lock(c);
	r = client_call(c, &env, KVD__V1__ENVELOPE__BODY_EVICT_REPLY, false, &reply, fds, NULL);
	if (r >= 0 && ret_freed)
		*ret_freed = reply->evict_reply->has_freed_bytes ? reply->evict_reply->freed_bytes : 0;
	client_unlock(c);
	return r;
}

struct round_tenant {
	char *name;
	uint64_t freed_bytes, evicted_tokens;
};

struct eviction_round {
	struct status_values values;
	bool has_predicted_error;
	double predicted_error;
	char *trigger; /* NULL: not sent */
	char *error;   /* NULL: the round did not fail */
	uint32_t n_tenants;
	struct round_tenant *tenants;
};

struct kvd_evictions {
	uint32_t n_rounds;
	struct eviction_round *rounds;
};

static int round_copy(const Kvd__V1__Round *in, struct eviction_round *out) {
	struct status_values *v = &out->values;

	status_values_read(v, &in->base);
	out->has_predicted_error = in->has_predicted_error;
	out->predicted_error = in->predicted_error;
	if (in->trigger && !(out->trigger = strdup(in->trigger)))
		return -ENOMEM;
	if (in->error && !(out->error = strdup(in->error)))
		return -ENOMEM;

	if (in->n_tenants == 0)
		return 0;
	/* Bounded by the 64 KiB message, like the status's tenants. */
	out->tenants = calloc(in->n_tenants, sizeof(*out->tenants));
	if (!out->tenants)
		return -ENOMEM;
	out->n_tenants = in->n_tenants;
	for (size_t i = 0; i < in->n_tenants; i++) {
		const Kvd__V1__RoundTenant *t = in->tenants[i];

		out->tenants[i].name = strdup(t->name ? t->name : "");
		if (!out->tenants[i].name)
			return -ENOMEM;
		out->tenants[i].freed_bytes = t->has_freed_bytes ? t->freed_bytes : 0;
		out->tenants[i].evicted_tokens = t->has_evicted_tokens ? t->evicted_tokens : 0;
	}
	return 0;
}

/* Copies a reply into an object that outlives the receive buffer. */
static int evictions_copy(const Kvd__V1__EvictionsReply *rep, kvd_evictions *e) {
	if (rep->n_rounds == 0)
		return 0;
	e->rounds = calloc(rep->n_rounds, sizeof(*e->rounds));
	if (!e->rounds)
		return -ENOMEM;
	e->n_rounds = rep->n_rounds;
	for (size_t i = 0; i < rep->n_rounds; i++) {
		int r = round_copy(rep->rounds[i], &e->rounds[i]);

		if (r < 0)
			return r;
	}
	return 0;
}

kvd_evictions *kvd_evictions_free(kvd_evictions *e) {
	if (!e)
		return NULL;
	for (uint32_t i = 0; i < e->n_rounds; i++) {
		struct eviction_round *rd = &e->rounds[i];

		for (uint32_t t = 0; t < rd->n_tenants; t++)
			free(rd->tenants[t].name);
		free(rd->tenants);
		free(rd->trigger);
		free(rd->error);
	}
	free(e->rounds);
	free(e);
	return NULL;
}

int kvd_evictions_get(kvd_client *c, kvd_evictions **ret) {
	Kvd__V1__EvictionsRequest req = KVD__V1__EVICTIONS_REQUEST__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
	_cleanup_(kvd_evictions_freep) kvd_evictions *e = NULL;
	int fds[WIRE_FDS_MAX];
	int r;

	if (!c || !ret)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	e = calloc(1, sizeof(*e));
	if (!e)
		return -ENOMEM;
	env.body_case = KVD__V1__ENVELOPE__BODY_EVICTIONS_REQUEST;
	env.evictions_request = &req;

	client_lock(c);
	r = client_call(c, &env, KVD__V1__ENVELOPE__BODY_EVICTIONS_REPLY, false, &reply, fds,
			NULL);
	if (r >= 0)
		r = evictions_copy(reply->evictions_reply, e);
	client_unlock(c);
	if (r < 0)
		return r;

	*ret = TAKE_PTR(e);
	return 0;
}

uint32_t kvd_evictions_count(const kvd_evictions *e) {
	return e ? e->n_rounds : 0;
}

int kvd_evictions_u64(const kvd_evictions *e, uint32_t round, const char *key, uint64_t *ret) {
	if (!e || !key || !ret || round >= e->n_rounds)
		return -EINVAL;
	return status_get(&e->rounds[round].values, key, ret);
}

int kvd_evictions_double(const kvd_evictions *e, uint32_t round, const char *key,
			 double *ret) {
	if (!e || !key || !ret || round >= e->n_rounds)
		return -EINVAL;
	if (strcmp(key, "predicted_error") != 0 || !e->rounds[round].has_predicted_error)
		return -ENOENT;
	*ret = e->rounds[round].predicted_error;
	return 0;
}

int kvd_evictions_str(const kvd_evictions *e, uint32_t round, const char *key,
		      const char **ret) {
	const char *v = NULL;

	if (!e || !key || !ret || round >= e->n_rounds)
		return -EINVAL;
	if (strcmp(key, "trigger") == 0)
		v = e->rounds[round].trigger;
	else if (strcmp(key, "error") == 0)
		v = e->rounds[round].error;
	if (!v)
		return -ENOENT;
	*ret = v;
	return 0;
}

uint32_t kvd_evictions_tenants(const kvd_evictions *e, uint32_t round) {
	if (!e || round >= e->n_rounds)
		return 0;
	return e->rounds[round].n_tenants;
}

int kvd_evictions_tenant(const kvd_evictions *e, uint32_t round, uint32_t index,
			 const char **ret_name, uint64_t *ret_freed_bytes,
			 uint64_t *ret_evicted_tokens) {
	const struct round_tenant *t;

	if (!e || round >= e->n_rounds || index >= e->rounds[round].n_tenants)
		return -EINVAL;
	t = &e->rounds[round].tenants[index];
	if (ret_name)
		*ret_name = t->name;
	if (ret_freed_bytes)
		*ret_freed_bytes = t->freed_bytes;
	if (ret_evicted_tokens)
		*ret_evicted_tokens = t->evicted_tokens;
	return 0;
}

int client_event_id(kvd_client *c, void *event, uint32_t *ret) {
	Kvd__V1__RegisterEvent req = KVD__V1__REGISTER_EVENT__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply = NULL;
	uint8_t handle[64];
	int fds[WIRE_FDS_MAX];
	int r;

	for (uint32_t i = 0; i < c->n_cuda_events; i++)
		if (c->cuda_events[i] == event) {
			*ret = i + 1;
			return 0;
		}
	if (c->n_cuda_events == KVD_CONN_EVENTS_MAX)
		return -ENOSPC;
	r = client_cuda_event_handle(event, handle, sizeof(handle));
	if (r < 0)
		return r;
	req.has_ipc_handle = true;
	req.ipc_handle.len = sizeof(handle);
	req.ipc_handle.data = handle;
	env.body_case = KVD__V1__ENVELOPE__BODY_REGISTER_EVENT;
	env.register_event = &req;
	r = client_call(c, &env, KVD__V1__ENVELOPE__BODY_REGISTER_EVENT_REPLY, false, &reply, fds, NULL);
	if (r < 0)
		return r;
	/* The reply stays the client's, as every reply does (client_read). */
	if (!reply->register_event_reply->has_event_id ||
	    reply->register_event_reply->event_id != c->n_cuda_events + 1)
		return -EPROTO;
	c->cuda_events[c->n_cuda_events++] = event;
	*ret = c->n_cuda_events;
	return 0;
}
