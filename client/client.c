/* SPDX-License-Identifier: MIT */
/*
 * libkvd, the connection: connecting and saying hello, reconnecting after the daemon went
 * away, the handle's lifetime and getters, and engine events (see kvd/kvd.h for the API,
 * proto/kvd.proto for the wire schema, client-internal.h for what the files of libkvd
 * share).
 */

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "client-internal.h"
#include "basic/macro.h"
#include "basic/number.h"
#include "config.h"
#include "cuda-import.h"
#include "range.h"
#include "kvd/kvd.h"
#include "wire.h"

/* ---- pid cache for the fork checks ---- */

pid_t client_pid_cache;
bool client_pid_cache_usable;
/* Numbers every client of the process, for error.c's keys: addresses are reused. */
static uint64_t client_serials;
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

/* ---- connection ---- */

static int client_dial(kvd_client *c);

/* [A-Za-z0-9_.-]; not isalnum(), which follows the locale. */
static bool tenant_char_valid(char ch) {
	return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
	       ch == '_' || ch == '.' || ch == '-';
}

bool tenant_name_valid(const char *s) {
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
	c->range = client_range_free(c->range, child);
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
	c->serial = __atomic_add_fetch(&client_serials, 1, __ATOMIC_RELAXED);
	c->pid = client_self_pid();
	c->fd = c->epoll_fd = c->event_fd = -EBADF;
	c->want_device = -1;
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
	int named_r = -ENODEV, r;

	/* A new connection knows none of the old one's events. */
	c->n_cuda_events = 0;
	c->cuda_events_refused = false;
	hello.has_min_version = true;
	hello.min_version = KVD_PROTOCOL_VERSION_MIN;
	hello.has_max_version = true;
	hello.max_version = KVD_PROTOCOL_VERSION_MAX;
	hello.has_features = true;
	hello.features = KVD_FEATURE_SEQ_HEADER | KVD_FEATURE_TENANT_POLICY | KVD_FEATURE_TIERS |
	                 KVD_FEATURE_RECALL | KVD_FEATURE_FORK | KVD_FEATURE_PREFIX |
	                 KVD_FEATURE_GROUPS |
	                 (c->no_ring ? 0 : KVD_FEATURE_RING);
#ifdef KVD_HAVE_CUDA
	hello.features |= KVD_FEATURE_DEVICE_CHUNKS;
#endif
	/* An engine's chunks must come from its own GPU: the daemon refuses a GPU it does not
	 * pool, and where it pools several, a tenant that names none. */
	if (tenant)
		named_r = c->want_device >= 0 ? client_cuda_device_uuid(c->want_device, uuid, sizeof(uuid)) :
		          client_cuda_current_uuid(uuid, sizeof(uuid));
	if (named_r == 0) {
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
	c->pool_bytes = hr->has_pool_bytes ? hr->pool_bytes : 0;
	c->connection_id = hr->has_connection_id ? hr->connection_id : 0;
	c->memory = hr->has_memory ? (uint32_t)hr->memory : KVD_MEMORY_HOST;
	if (c->memory == KVD_MEMORY_CUDA && c->has_tenant) {
		if (!hr->has_device_uuid || hr->device_uuid.len != WIRE_DEVICE_UUID_BYTES ||
		    !hr->has_pool_bytes) {
			close_fds(fds, nfds);
			return -EPROTO;
		}
		/* The GPU asked for is not one of this process's. */
		if (named_r < 0 && c->want_device >= 0) {
			close_fds(fds, nfds);
			return named_r;
		}
		/* A daemon from before the refusal gave its first GPU for one it does not pool. */
		if (named_r == 0 && memcmp(hr->device_uuid.data, uuid, sizeof(uuid)) != 0) {
			close_fds(fds, nfds);
			return -EXDEV;
		}
		memcpy(c->device_uuid, hr->device_uuid.data, WIRE_DEVICE_UUID_BYTES);
		r = client_cuda_new(c->device_uuid, WIRE_DEVICE_UUID_BYTES, hr->pool_bytes,
		                    c->chunk_bytes, &c->cuda);
		if (r < 0) {
			close_fds(fds, nfds);
			return r;
		}
	} else if (c->memory == KVD_MEMORY_HOST && c->has_tenant && hr->has_pool_bytes) {
		/* Without the range, chunks go anywhere and block tables are refused: a daemon
		 * whose pool is larger than the address space this process may have is still
		 * served. */
		(void)client_range_new(hr->pool_bytes, c->chunk_bytes, &c->range);
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

/* kvd_client_connect_params; *ret_key gets the serial of the client it made, if any. */
static int do_client_connect_params(const kvd_connect_params *params, kvd_client **ret,
                                    uint64_t *ret_key) {
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
	if ((p.flags & ~(KVD_CONNECT_NO_RING | KVD_CONNECT_DEVICE)) ||
	    (!(p.flags & KVD_CONNECT_DEVICE) && p.device != 0) || p.device > INT32_MAX)
		return -EINVAL;
	socket_path = p.socket_path;
	tenant = p.tenant;
	/* Like kvdctl and kvd-bench, so that one variable points every tool and engine at a
	 * daemon of one's own. */
	if (!socket_path)
		socket_path = secure_getenv("KVD_SOCKET");
	if (!socket_path || !*socket_path)
		socket_path = KVD_DEFAULT_SOCKET;
	len = strlen(socket_path);
	if (len == 0)
		return -EINVAL;
	if (len >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	if (tenant && !tenant_name_valid(tenant))
		return client_refuse(NULL, -EINVAL, "tenant name '%.64s' is not valid: 1 to %u of "
		                    "A-Z a-z 0-9 _ . -", tenant, KVD_TENANT_NAME_MAX);
	memcpy(sa.sun_path, socket_path, len);

	r = client_new(&c);
	if (r < 0)
		return r;
	*ret_key = c->serial;
	if (p.flags & KVD_CONNECT_NO_RING)
		c->no_ring = true, c->want_ring = false;
	c->connect_timeout_ms = p.timeout_ms;
	c->want_device = p.flags & KVD_CONNECT_DEVICE ? (int32_t)p.device : -1;
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

int kvd_client_connect_params(const kvd_connect_params *params, kvd_client **ret) {
	uint64_t key = 0;
	int r = do_client_connect_params(params, ret, &key);

	if (r >= 0)
		return r;
	/* The client it made is gone with the failure: its message is the thread's, for
	 * kvd_client_last_error(NULL). */
	if (key != 0 && call_error.client == key)
		call_error.client = 0;
	return (int)call_result(0, r, "kvd_client_connect");
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
	c->range = client_range_free(c->range, false);
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

static int do_client_reconnect(kvd_client *c, uint32_t timeout_ms) {
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

int kvd_client_reconnect(kvd_client *c, uint32_t timeout_ms) {
	return (int)call_result(client_key(c), do_client_reconnect(c, timeout_ms), __func__);
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

static int do_client_protocol_version(kvd_client *c) {
	if (!c)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	return (int)c->version;
}

int kvd_client_protocol_version(kvd_client *c) {
	return (int)call_result(client_key(c), do_client_protocol_version(c), __func__);
}

uint64_t kvd_client_chunk_bytes(kvd_client *c) {
	if (!c || client_forked(c))
		return 0;
	return c->chunk_bytes;
}

static int do_client_memory(kvd_client *c, int32_t *ret_device) {
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

int kvd_client_memory(kvd_client *c, int32_t *ret_device) {
	return (int)call_result(client_key(c), do_client_memory(c, ret_device), __func__);
}

static int do_client_set_ring(kvd_client *c, int enable) {
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

int kvd_client_set_ring(kvd_client *c, int enable) {
	return (int)call_result(client_key(c), do_client_set_ring(c, enable), __func__);
}

static int do_client_get_ring(kvd_client *c) {
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

int kvd_client_get_ring(kvd_client *c) {
	return (int)call_result(client_key(c), do_client_get_ring(c), __func__);
}

static int do_client_set_spin(kvd_client *c, uint32_t spin_us) {
	if (!c || spin_us > SPIN_US_MAX)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	__atomic_store_n(&c->spin_ns, (uint64_t)spin_us * 1000, __ATOMIC_RELAXED);
	return 0;
}

int kvd_client_set_spin(kvd_client *c, uint32_t spin_us) {
	return (int)call_result(client_key(c), do_client_set_spin(c, spin_us), __func__);
}

static int do_client_mapped_chunks(kvd_client *c, uint32_t *ids, uint32_t n, uint32_t *ret_n) {
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

int kvd_client_mapped_chunks(kvd_client *c, uint32_t *ids, uint32_t n, uint32_t *ret_n) {
	return (int)call_result(client_key(c), do_client_mapped_chunks(c, ids, n, ret_n), __func__);
}

int client_event_id(kvd_client *c, void *event, uint32_t *ret) {
	Kvd__V1__RegisterEvent req = KVD__V1__REGISTER_EVENT__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply = NULL;
	uint8_t handle[64];
	int fds[WIRE_FDS_MAX];
	int r;

	if (c->cuda_events_refused)
		return -EOPNOTSUPP;
	r = client_cuda_event_handle(event, handle, sizeof(handle));
	if (r < 0)
		return r;
	for (uint32_t i = 0; i < c->n_cuda_events; i++)
		if (memcmp(c->cuda_events[i], handle, sizeof(handle)) == 0) {
			*ret = i + 1;
			return 0;
		}
	if (c->n_cuda_events == KVD_CONN_EVENTS_MAX)
		return -ENOSPC;
	req.has_ipc_handle = true;
	req.ipc_handle.len = sizeof(handle);
	req.ipc_handle.data = handle;
	env.body_case = KVD__V1__ENVELOPE__BODY_REGISTER_EVENT;
	env.register_event = &req;
	r = client_call(c, &env, KVD__V1__ENVELOPE__BODY_REGISTER_EVENT_REPLY, false, &reply, fds, NULL);
	if (r == -EOPNOTSUPP || r == -EINVAL || r == -ENODEV || r == -EPERM || r == -EACCES)
		c->cuda_events_refused = true;
	if (r < 0)
		return r;
	/* The reply stays the client's, as every reply does (client_read). */
	if (!reply->register_event_reply->has_event_id ||
	    reply->register_event_reply->event_id != c->n_cuda_events + 1)
		return -EPROTO;
	memcpy(c->cuda_events[c->n_cuda_events++], handle, sizeof(handle));
	*ret = c->n_cuda_events;
	return 0;
}

