/* SPDX-License-Identifier: MIT */
/*
 * libkvd, the transport: the socket and what travels on it (requests, replies, events and
 * their fds), the chunk table the grants fill, and the socket's part in the rings' work.
 *
 * Requests are synchronous round trips under the client's lock: send an Envelope with a
 * fresh id, then read frames until the reply with that id arrives. Frames with id 0 are
 * daemon events and are handled on the way, whoever reads them; replies with another id are
 * answers to fire-and-forget ChunksUnmapped requests and are dropped. Before the lock is
 * released, frames that already sit complete in the receive buffer are handled too, because
 * the socket's poll state (the event fd) does not see bytes the library has already read.
 */

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client-internal.h"
#include "basic/macro.h"
#include "cuda-import.h"
#include "range.h"
#include "kvd/kvd.h"
#include "wire.h"
#include "basic/time-util.h"

enum rx_mode {
	RX_BUFFERED, /* only frames already received */
	RX_NONBLOCK, /* and whatever the socket holds now */
	RX_BLOCK,    /* until the awaited reply arrives */
};

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

/* Gives a chunk's mapping back, in the way the pool's memory was mapped: false when it
 * left a hole in the host range (range.h). */
bool chunk_mapping_drop(kvd_client *c, void *addr, uint64_t bytes) {
	if (c->cuda) {
		client_cuda_unmap(c->cuda, addr, bytes);
		return true;
	}
	if (c->range)
		return client_range_unmap(c->range, addr, bytes);
	munmap(addr, bytes);
	return true;
}

/* Takes chunk id's slot out of the table for chunk_unmap_many(): its address, or NULL when
 * it is not mapped here. */
static char *chunk_slot_take(kvd_client *c, uint32_t id, struct chunk_slot **ret) {
	struct chunk_slot *slot = chunk_slot(c, id);
	char *addr;

	if (!slot || !slot->addr)
		return NULL;
	addr = slot->addr;
	__atomic_store_n(&slot->addr, NULL, __ATOMIC_RELEASE);
	/* bytes stays: a reader still holding the old address must not see it change. */
	c->n_mapped--;
	*ret = slot;
	return addr;
}

void chunk_unmap_many(kvd_client *c, const uint32_t *ids, size_t n) {
	for (size_t i = 0; i < n;) {
		struct chunk_slot *first, *slot;
		char *addr = chunk_slot_take(c, ids[i], &first);
		uint64_t bytes;
		size_t run = 1;

		if (!addr) {
			i++;
			continue;
		}
		bytes = first->bytes;
		/* Chunks side by side in the host range go back in one call: one walk of the
		 * page tables and one TLB shootdown instead of one per chunk. */
		while (c->range && i + run < n && ids[i + run] == ids[i] + run &&
		       chunk_addr(c, ids[i + run], NULL) == addr + bytes) {
			(void)chunk_slot_take(c, ids[i + run], &slot);
			bytes += slot->bytes;
			run++;
		}
		if (!chunk_mapping_drop(c, addr, bytes))
			for (size_t k = 0; k < run; k++)
				chunk_slot(c, ids[i + k])->hole = true;
		i += run;
	}
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

	if (c->range) {
		r = client_range_map(c->range, grant->chunk_id, fd, grant->bytes, slot->hole, &p);
		if (r < 0)
			return r;
		slot->hole = (char *)p != (char *)client_range_base(c->range) +
		                          (uint64_t)grant->chunk_id * grant->bytes;
	} else {
		p = mmap(NULL, grant->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		if (p == MAP_FAILED)
			return negative_errno();
		/* KV memory must not leak into fork() children (see kvd.h). */
		if (madvise(p, grant->bytes, MADV_DONTFORK) < 0) {
			r = negative_errno();
			munmap(p, grant->bytes);
			return r;
		}
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
int client_fail(kvd_client *c, int r) {
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
		ring_spin_start(&spinner, now_ns());
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
		now = now_ns();
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

static int client_close_reason(kvd_client *c, const Kvd__V1__Status *st) {
	client_set_error(c, st->code, st->message);
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
void client_tell_unmapped(kvd_client *c, uint32_t *ids, uint32_t n) {
	for (uint32_t i = 0; i < n; i += WIRE_IDS_MAX) {
		Kvd__V1__ChunksUnmapped done = KVD__V1__CHUNKS_UNMAPPED__INIT;
		Envelope env = KVD__V1__ENVELOPE__INIT;

		done.n_chunk_ids = MIN(n - i, WIRE_IDS_MAX);
		done.chunk_ids = ids + i;
		env.body_case = KVD__V1__ENVELOPE__BODY_CHUNKS_UNMAPPED;
		env.chunks_unmapped = &done;
		(void)client_request_unwaited(c, &env);
	}
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
		chunk_unmap_many(c, ev->chunk_ids, ev->n_chunk_ids);
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
		client_set_error(c, code < 0 ? code : -EPROTO, reply->status->message);
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

int client_call_fd(kvd_client *c, Envelope *env, int send_fd, int want, Envelope **ret_reply,
                   int fds[static WIRE_FDS_MAX], uint32_t *ret_nfds) {
	return client_transact(c, env, send_fd, want, false, ret_reply, fds, ret_nfds);
}

/* See client-internal.h. */
int client_sealed_memfd(const char *name, const void *p, uint64_t n, int *ret_fd) {
	_cleanup_(closep) int fd = -EBADF;
	uint64_t done = 0;

	fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return negative_errno();
	while (done < n) {
		ssize_t k = write(fd, (const char *)p + done, MIN(n - done, (uint64_t)SSIZE_MAX));

		if (k < 0) {
			if (errno == EINTR)
				continue;
			return negative_errno();
		}
		if (k == 0)
			return -EIO; /* cannot happen on a memfd; guards the loop */
		done += k;
	}
	/* Sealed, the bytes the daemon checks are the bytes it uses, whatever we do next. */
	if (fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0)
		return negative_errno();
	*ret_fd = TAKE_FD(fd);
	return 0;
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
		client_set_error(c, d->cqe.res, (d->cqe.flags & KVD_RING_CQE_F_MESSAGE) ? d->msg : "");
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

/* ---- events, as the engine reads them ---- */

static int do_client_get_event_fd(kvd_client *c) {
	if (!c)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	return c->epoll_fd;
}

int kvd_client_get_event_fd(kvd_client *c) {
	return (int)call_result(client_key(c), do_client_get_event_fd(c), __func__);
}

static int do_client_next_event(kvd_client *c, kvd_event *ret) {
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

int kvd_client_next_event(kvd_client *c, kvd_event *ret) {
	return (int)call_result(client_key(c), do_client_next_event(c, ret), __func__);
}
