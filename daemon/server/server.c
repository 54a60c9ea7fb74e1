/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <grp.h>
#include <inttypes.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <time.h>
#include <unistd.h>

#include "access.h"
#include "admin.h"
#include "basic/macro.h"
#include "basic/number.h"
#include "common/ring.h"
#include "basic/size.h"
#include "config.h"
#include "conn.h"
#include "departed.h"
#include "dispatch.h"
#include "envelope.h"
#include "evict.h"
#include "kv-events.h"
#include "keep.h"
#include "pins.h"
#include "recall.h"
#include "upload.h"
#include "log.h"
#include "mover.h"
#include "offload.h"
#include "ring.h"
#include "listen.h"
#include "prometheus.h"
#include "server.h"
#include "unmap.h"
#include "tier-file.h"
#include "tier.h"
#include "wire.h"
#include "basic/time-util.h"

#define STOP_GRACE_MS 2000

static void on_signal(struct loop_op *op, int res, bool more) {
	struct server *s = container_of(op, struct server, signal_op);

	if (res == (int)sizeof(s->siginfo) && s->siginfo.ssi_signo == SIGHUP) {
		struct timespec ts;

		/* Tells a service manager that waits for the reload (Type=notify-reload); the time
		 * must not read earlier than its request, so no rounding to milliseconds. */
		clock_gettime(CLOCK_MONOTONIC, &ts);
		sd_notifyf(0, "RELOADING=1\nMONOTONIC_USEC=%llu",
		           (unsigned long long)ts.tv_sec * 1000000 + (unsigned long long)ts.tv_nsec / 1000);
		char why[1024];

		(void)admin_reload(s->admin, "SIGHUP", why, sizeof(why));
		sd_notify(0, "READY=1");
	} else if (res == (int)sizeof(s->siginfo)) {
		log_info("received %s, stopping", strsignal((int)s->siginfo.ssi_signo));
		server_stop(s);
		return;
	}
	if (loop_read(s->loop, &s->signal_op, s->signal_fd, &s->siginfo, sizeof(s->siginfo)) < 0)
		log_error("cannot re-arm the signal read");
}

/* STATUS= for the service manager: one line, what an operator wants at a glance. */
static void format_status(struct server *s, char *buf, size_t n) {
	char used[32], budget[32];

	if (s->stopping) {
		snprintf(buf, n, "stopping: %u connection%s left", s->n_conns,
		         s->n_conns == 1 ? "" : "s");
		return;
	}
	size_format(s->pool->used_bytes, used, sizeof(used));
	size_format(s->pool->budget_bytes, budget, sizeof(budget));
	snprintf(buf, n, "serving %s: %u connection%s, %s of %s budget used", s->socket_path,
	         s->n_conns, s->n_conns == 1 ? "" : "s", used, budget);
	/* A newline in the socket's path would end the assignment and start another. */
	for (char *p = buf; *p; p++)
		if ((unsigned char)*p < ' ' || *p == 0x7f)
			*p = '?';
}

/*
 * Once per tick: WATCHDOG=1 when the service manager watches us (the tick is then at most
 * half its interval, so a loop that stops turning stops pinging), and STATUS= when it
 * changed, in one datagram.
 */
static void notify_tick(struct server *s) {
	char status[sizeof(s->notify_status)], msg[sizeof(status) + 32];
	bool changed;

	format_status(s, status, sizeof(status));
	changed = strcmp(status, s->notify_status) != 0;
	if (!changed && !s->watchdog_usec)
		return;
	snprintf(msg, sizeof(msg), "%s%s%s", s->watchdog_usec ? "WATCHDOG=1" : "",
	         s->watchdog_usec && changed ? "\n" : "", changed ? "STATUS=" : "");
	if (changed) {
		strncat(msg, status, sizeof(msg) - strlen(msg) - 1);
		memcpy(s->notify_status, status, sizeof(status));
	}
	sd_notify(0, msg);
}

/*
 * The tick's period: a quarter of the shortest timeout it enforces (tier-idle among them),
 * between 50 ms and a
 * second, and at most half the service manager's watchdog interval. Recomputed at every
 * tick, so that a reload that shortens a timeout shortens the tick too.
 */
static uint64_t tick_interval(const struct server *s) {
	uint64_t ms = s->limits.hello_timeout_ms / 4;

	if (s->limits.unmap_timeout_ms > 0)
		ms = MIN(ms, s->limits.unmap_timeout_ms / 4);
	if (s->limits.unmap_timeout_ms > 0 && s->limits.unmap_grace_ms > 0)
		ms = MIN(ms, s->limits.unmap_grace_ms / 4);
	if (s->limits.tenant_forget_ms > 0)
		ms = MIN(ms, s->limits.tenant_forget_ms / 4);
	if (s->limits.pin_report_ms > 0)
		ms = MIN(ms, s->limits.pin_report_ms / 4);
	if (s->limits.pin_timeout_ms > 0)
		ms = MIN(ms, s->limits.pin_timeout_ms / 4);
	if (s->limits.tier_idle_ms > 0 && s->limits.host_tier_bytes > 0)
		ms = MIN(ms, s->limits.tier_idle_ms / 4);
	ms = MIN(MAX(ms, 50), 1000);
	if (s->watchdog_usec)
		ms = MIN(ms, MAX(s->watchdog_usec / 2000, 1));
	return ms;
}

/* The prefix index's news, as KV events: a key stored in the pool or gone from it. */
static void notify_kv_event(void *userdata, bool stored, const uint8_t key[PREFIX_KEY_BYTES],
                            const uint8_t *parent, const uint32_t *tokens, uint32_t n_tokens,
                            uint32_t block_tokens) {
	struct server *s = userdata;

	if (stored)
		kv_events_stored(s->events, key, parent, tokens, n_tokens, block_tokens, "GPU");
	else
		kv_events_removed(s->events, key, "GPU");
}

/*
 * Forgets the tenants that held nothing for tenant-forget: with a tenant name per job, the
 * table (max-tenants) would otherwise fill and refuse every new tenant until a restart. A
 * tenant with settings of its own (config file, live) stays: its settings are its state.
 */
static void forget_tick(struct server *s, uint64_t now) {
	for (uint32_t i = 0; i < s->tenants.n;) {
		struct tenant *t = s->tenants.tenants[i];
		bool declared = admin_tenant_declared(s->admin, t->name);
		bool idle = tenant_holds_nothing(t) && !declared;
		/* Gone but for its prefix cache, which nobody of it will read. */
		bool cache_only = !declared && t->cached_bytes > 0 && t->connections == 0 &&
		                  t->sequences == 0;

		if (!idle && !cache_only)
			t->idle_since_ms = 0;
		else if (t->idle_since_ms == 0)
			t->idle_since_ms = now;
		if (!(idle || cache_only) || s->limits.tenant_forget_ms == 0 ||
		    now - t->idle_since_ms < s->limits.tenant_forget_ms)
			i++;
		else if (cache_only)
			/* Forgotten at a later tick, once its chunks are back. */
			i++, evict_shed_cache(s, t, UINT64_MAX);
		else
			/* The next tenant moves into slot i. */
			registry_forget_tenant(s, t, "it held nothing for tenant-forget");
	}
}

static void on_tick(struct loop_op *op, int res, bool more) {
	struct server *s = container_of(op, struct server, tick_op);
	uint64_t now = now_ms();

	notify_tick(s);
	if (s->stopping) {
		if (now - s->stop_ms >= STOP_GRACE_MS) {
			log_warning("%u clients did not drain in time, exiting anyway", s->n_conns);
			loop_exit(s->loop);
			return;
		}
	} else {
		for (struct conn *c = s->conns, *next; c; c = next) {
			next = c->next;
			if (!c->hello && now - c->accepted_ms >= s->limits.hello_timeout_ms) {
				s->protocol_errors++;
				conn_close(c, "no hello in time");
			} else if (c->partial_since_ms &&
			           now - c->partial_since_ms >= s->limits.hello_timeout_ms) {
				s->protocol_errors++;
				conn_close(c, "a frame begun made no progress within hello-timeout");
			}
		}
		unmap_tick(s, now);
		pins_tick(s, now);
		listen_resume(s);
		pool_retry_pinned(s->pool);
		if (s->admin)
			forget_tick(s, now);
	}
	if (s->http)
		http_tick(s->http, now, s->limits.hello_timeout_ms);
	if (!s->stopping) {
		evict_tick(s->evictor);
		offload_tick(s);
		keep_tick(s->keep, s);
	}
	s->tick_ms = tick_interval(s);
	if (loop_timeout(s->loop, &s->tick_op, s->tick_ms) < 0)
		log_error("cannot re-arm the timer");
}

/* The poller (loop.h): takes the submissions of every connection's rings, and reads the
 * hot connections' sockets (conn.h). */
static bool server_poll(void *userdata) {
	struct server *s = userdata;
	uint64_t now = s->n_hot > 0 ? now_ns() : 0;
	bool busy = false;

	/* While a round computes, its worker threads want every CPU: the loop does not spin
	 * then, and requests that come meanwhile wake it. */
	s->poller.spin_ns = evict_running(s->evictor) ? 0 : (uint64_t)s->limits.poll_us * 1000;

	/* A request may close connections (this one, or holders of a chunk it gave back), but
	 * none is freed before the sweep below, so their links stay valid. */
	for (struct conn *c = s->conns, *next; c; c = next) {
		int r;

		next = c->next;
		if (c->hot_ns)
			busy |= conn_poll(c, now) != 0;
		if (!c->ring || c->closing || c->close_when_sent)
			continue;
		r = ring_poll(c->ring);
		if (r == -EPROTO) {
			s->protocol_errors++;
			log_warning("connection %llu (pid %d): its ring's indices are corrupted, "
			            "disconnecting", (unsigned long long)c->id, (int)c->cred.pid);
			conn_close(c, NULL);
		}
		busy |= r != 0;
	}
	/* Closed connections without an operation in flight (hot ones had no receive armed)
	 * have no completion to free them: they go here, outside every handler. */
	for (struct conn *c = s->closed, *next; c; c = next) {
		next = c->closed_next;
		conn_maybe_free(c);
	}
	return busy;
}

/* Before the loop sleeps: hot connections get their receive back, every ring is told and
 * its doorbell armed; after, untold. */
static bool server_sleep(void *userdata, bool sleeping) {
	struct server *s = userdata;
	bool ok = true;

	if (sleeping)
		for (struct conn *c = s->conns, *next; c; c = next) {
			next = c->next;
			conn_cool(c);
		}
	for (struct conn *c = s->conns; c; c = c->next) {
		if (!c->ring)
			continue;
		if (sleeping)
			ok &= ring_sleep_prepare(c->ring);
		else
			ring_sleep_done(c->ring);
	}
	if (!ok)
		for (struct conn *c = s->conns; c; c = c->next)
			if (c->ring)
				ring_sleep_done(c->ring);
	return ok;
}

/* Which doorbell the rings get: --ring-doorbell, with auto resolved against the kernel. */
static int server_setup_rings(struct server *s) {
	bool futex = loop_has_futex_wait(s->loop);

	switch (s->limits.ring_doorbell) {
	case RING_BELL_FUTEX:
		if (!futex)
			return log_error_errno(-EOPNOTSUPP, "--ring-doorbell=futex: this kernel has no "
			                       "IORING_OP_FUTEX_WAIT (Linux 6.7)");
		s->ring_doorbell = KVD_RING_DOORBELL_FUTEX;
		break;
	case RING_BELL_EVENTFD:
		s->ring_doorbell = KVD_RING_DOORBELL_EVENTFD;
		break;
	default:
		s->ring_doorbell = futex ? KVD_RING_DOORBELL_FUTEX : KVD_RING_DOORBELL_EVENTFD;
	}
	return 0;
}

static int render_metrics(void *userdata, char **ret, size_t *ret_size) {
	return prometheus_render(userdata, ret, ret_size);
}

/*
 * The node's bounds, derived at start from what the kernel gives the daemon, so that no
 * client can take the daemon to a limit where it fails for everyone (kvdctl included):
 *
 * - fds (RLIMIT_NOFILE, raised to the hard limit at start): a chunk's memory takes one
 *   fd, each connection CONN_FDS_OWN of the daemon's and up to CONN_FDS_QUEUED_MAX its
 *   client sent, and FDS_RESERVED go to io_uring, sockets, signals and the fd store's
 *   journal; max-connections is lowered to what is left.
 * - mappings (vm.max_map_count): an open sequence maps its descriptor and its observation
 *   buffer (SEQ_MAPPINGS), a connection its ring (CONN_MAPPINGS), a host chunk itself;
 *   MAPPINGS_RESERVED go to libraries, allocator arenas, the round threads' stacks and
 *   io_uring. What is left bounds the open sequences (max-seqs-node 0).
 * - memory: the sequences' metadata (seq.meta_bytes) may take a quarter of physical
 *   memory (max-metadata-bytes 0).
 */
#define FDS_RESERVED 64u
#define SEQ_MAPPINGS 2u
#define CONN_MAPPINGS 2u
#define MAPPINGS_RESERVED 4096u

/* Mappings the daemon has now, or 0 when that cannot be read. */
static uint64_t mappings_now(void) {
	_cleanup_(fclosep) FILE *f = fopen("/proc/self/maps", "re");
	uint64_t n = 0;
	int ch;

	while (f && (ch = fgetc(f)) != EOF)
		n += ch == '\n';
	return n;
}

static uint64_t read_sysctl(const char *path, uint64_t fallback) {
	_cleanup_(fclosep) FILE *f = fopen(path, "re");
	unsigned long long v;

	return f && fscanf(f, "%llu", &v) == 1 ? v : fallback;
}

static void derive_bounds(struct server *s) {
	uint64_t per_conn = CONN_FDS_OWN + CONN_FDS_QUEUED_MAX;
	uint64_t maps = read_sysctl("/proc/sys/vm/max_map_count", 65530);
	uint64_t taken = mappings_now() + MAPPINGS_RESERVED + (uint64_t)s->limits.max_connections *
	                 CONN_MAPPINGS + (s->pool->ops->host_access ? s->pool->n_chunks : 0);
	long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
	struct rlimit rl;

	s->conns_by_fds = UINT32_MAX;
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
		uint64_t spare = rl.rlim_cur > FDS_RESERVED + s->pool->n_chunks + per_conn ?
		                         rl.rlim_cur - FDS_RESERVED - s->pool->n_chunks : per_conn;

		s->conns_by_fds = (uint32_t)MIN(spare / per_conn, UINT32_MAX);
	}
	if (s->conns_by_fds < s->limits.max_connections)
		log_warning("the fd limit (%llu) allows %u connections besides %u chunks, below "
		            "max-connections (%u): raise LimitNOFILE= to allow more",
		            (unsigned long long)rl.rlim_cur, s->conns_by_fds, s->pool->n_chunks,
		            s->limits.max_connections);
	s->seqs_node_derived = maps > taken ? (uint32_t)MIN((maps - taken) / SEQ_MAPPINGS, UINT32_MAX) : 1;
	s->metadata_derived = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page / 4 : UINT64_C(1) << 30;
	log_info("node bounds: %u connections, %u sequences (vm.max_map_count %llu), %llu bytes of "
	         "sequence metadata (a quarter of memory), unless set lower",
	         registry_conns_max(s), s->seqs_node_derived, (unsigned long long)maps,
	         (unsigned long long)s->metadata_derived);
	if (s->limits.max_seqs_node > s->seqs_node_derived)
		log_warning("max-seqs-node %u is above what vm.max_map_count (%llu) leaves for "
		            "sequences (%u): raise vm.max_map_count, or new connections may fail "
		            "once they are all open", s->limits.max_seqs_node,
		            (unsigned long long)maps, s->seqs_node_derived);
}

int server_new_local(struct pool *pool, const struct server_limits *limits, struct server **ret) {
	struct server *s;
	int r;

	s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	s->listen_fd = s->signal_fd = -EBADF;
	/* The requests' handlers, and accepting again when a connection closes (fds come
	 * free). */
	s->handlers = dispatch_handlers;
	s->handlers.closed = listen_resume;
	s->pool = pool;
	s->limits = *limits;
	s->prefix.max_percent = limits->max_cached_percent;
	s->socket_path = "(in process)";
	s->start_ms = now_ms();
#if KVD_TEST_HOOKS
	s->pidfd_by_pid = getenv("KVD_TEST_PIDFD_OPEN") != NULL;
#endif
	derive_bounds(s);
	r = tenant_table_init(&s->tenants, limits->max_tenants);
	if (r < 0)
		goto fail;
	r = tier_new(limits->host_tier_bytes, pool->chunk_bytes, &s->metadata_bytes, &s->tier);
	if (r < 0)
		goto fail;
	s->tier->yield = recall_yield;
	if (limits->file_tier_bytes > 0) {
		const char *what;

		r = tier_file_add(s->tier, limits->file_tier_dir, limits->file_tier_bytes, &what);
		if (r < 0) {
			log_error_errno(r, "cannot set up the file tier in %s (%s)", limits->file_tier_dir,
			                what);
			goto fail;
		}
		if (!s->tier->file->direct)
			log_notice("file tier: the file system of %s refuses O_DIRECT: buffered I/O, "
			           "through the page cache", limits->file_tier_dir);
	}
	r = mover_new(s, &s->mover);
	if (r < 0)
		goto fail;
	/* On a GPU pool the tier's copies are DMA from and to it: pinned when the driver
	 * lets us, through its staging otherwise (slower, but the same bytes). */
	if (s->tier->base && pool->ops->host_register) {
		r = pool->ops->host_register(s->tier->base, s->tier->budget_bytes);
		if (r < 0)
			log_warning_errno(r, "the host tier (%" PRIu64 " bytes) cannot be pinned for "
			                  "the GPU: its copies go through the driver's staging",
			                  s->tier->budget_bytes);
		s->tier_pinned = r >= 0;
	}
	s->scratch = calloc(pool->n_chunks, sizeof(*s->scratch));
	if (!s->scratch) {
		r = -ENOMEM;
		goto fail;
	}
	r = evictor_new(s, &s->evictor);
	if (r < 0)
		goto fail;
	r = loop_new(s->limits.uring_setup, &s->loop);
	if (r < 0) {
		log_error_errno(r, "cannot set up the event loop");
		goto fail;
	}
	log_info("event loop: %s", loop_describe(s->loop));
	r = uploader_new(s->loop, s, &s->uploader);
	if (r < 0)
		goto fail;
	r = server_setup_rings(s);
	if (r < 0)
		goto fail;
	*ret = s;
	return 0;
fail:
	server_free(s);
	return r;
}

int server_new(struct pool *pool, const struct server_limits *limits, const char *socket_path,
               int *sockets, unsigned n_sockets, struct server **ret) {
	struct server *s;
	sigset_t mask;
	int r;

	r = server_new_local(pool, limits, &s);
	if (r < 0) {
		for (unsigned i = 0; i < n_sockets; i++)
			safe_close(sockets[i]);
		return r;
	}
	s->socket_path = socket_path;
	/* The loop looks at the rings and the hot sockets between completions (loop.h). */
	s->poller = (struct loop_poller){
		.spin_ns = (uint64_t)s->limits.poll_us * 1000,
		.poll = server_poll,
		.sleep = server_sleep,
		.userdata = s,
	};
	loop_set_poller(s->loop, &s->poller);
	s->signal_op.handler = on_signal;
	s->tick_op.handler = on_tick;
	r = sd_watchdog_enabled(0, &s->watchdog_usec);
	if (r < 0)
		log_warning_errno(r, "cannot read the service manager's watchdog settings, ignoring");
	if (r <= 0)
		s->watchdog_usec = 0;
	s->tick_ms = tick_interval(s);
	/* Before the clients' socket: a daemon that accepts connections also serves metrics. */
	if (limits->metrics_listen && *limits->metrics_listen) {
		r = http_new(s->loop, limits->metrics_listen, render_metrics, s, &s->http);
		if (r < 0) {
			log_error_errno(r, "cannot serve metrics on %s", limits->metrics_listen);
			goto fail;
		}
	}
	if (limits->kv_events && *limits->kv_events) {
		const char *why;

		r = kv_events_new(limits->kv_events, limits->kv_events_replay, limits->kv_events_topic,
		                  &s->events, &why);
		if (r < 0) {
			log_error_errno(r, "cannot publish KV events on %s%s%s: %s", limits->kv_events,
			                limits->kv_events_replay && *limits->kv_events_replay ? " and " : "",
			                limits->kv_events_replay ? limits->kv_events_replay : "",
			                why ? why : strerror(-r));
			goto fail;
		}
		s->prefix.notify = notify_kv_event;
		s->prefix.userdata = s;
		/* Whatever a subscriber remembers of an earlier daemon is gone. */
		kv_events_cleared(s->events);
	}
	r = listen_open(s, socket_path, sockets, n_sockets);
	n_sockets = 0;
	if (r < 0)
		goto fail;
	sigemptyset(&mask);
	sigaddset(&mask, SIGTERM);
	sigaddset(&mask, SIGINT);
	sigaddset(&mask, SIGHUP);
	sigprocmask(SIG_BLOCK, &mask, NULL);
	s->signal_fd = signalfd(-1, &mask, SFD_CLOEXEC);
	if (s->signal_fd < 0) {
		r = log_error_errno(negative_errno(), "signalfd failed");
		goto fail;
	}
	*ret = s;
	return 0;
fail:
	for (unsigned i = 0; i < n_sockets; i++)
		safe_close(sockets[i]);
	server_free(s);
	return r;
}

struct server *server_free(struct server *s) {
	if (!s)
		return NULL;
	/* The ring goes first, so that the kernel holds no buffer of the connections. */
	s->loop = loop_free(s->loop);
	departed_end_all(s);
	s->http = http_free(s->http);
	while (s->conns)
		conn_destroy(s->conns);
	while (s->closed)
		conn_destroy(s->closed);
	idmap_done(&s->conn_ids);
	idmap_done(&s->seq_ids);
	listen_close(s);
	safe_close(s->signal_fd);
	/* After the connections: a running round holds references, not pointers, to them. */
	s->evictor = evictor_free(s->evictor);
	s->uploader = uploader_free(s->uploader);
	/* After the connections, whose sequences dropped their entries and moves. */
	s->mover = mover_free(s->mover);
	if (s->tier_pinned)
		s->pool->ops->host_unregister(s->tier->base);
	s->tier = tier_free(s->tier);
	tenant_table_done(&s->tenants);
	/* Last: every sequence freed took its entries out (and told the events). */
	prefix_index_done(&s->prefix);
	s->events = kv_events_free(s->events);
	free(s->scratch);
	free(s);
	return NULL;
}

void server_stop(struct server *s) {
	if (s->stopping)
		return;
	s->stopping = true;
	s->stop_ms = now_ms();
	sd_notify(0, "STOPPING=1\nSTATUS=stopping");
	if (s->n_conns == 0) {
		loop_exit(s->loop);
		return;
	}
	for (struct conn *c = s->conns, *next; c; c = next) {
		next = c->next;
		if (envelope_event_stopping(c) < 0) {
			conn_close(c, NULL);
			continue;
		}
		c->close_when_sent = true;
		/* Sent at once, with nothing queued before it (conn_send()). */
		if (!c->tx_head)
			conn_close(c, NULL);
	}
}

int server_run(struct server *s) {
	char status[sizeof(s->notify_status) + 32];
	int r;

	r = listen_start(s);
	if (r >= 0)
		r = loop_read(s->loop, &s->signal_op, s->signal_fd, &s->siginfo, sizeof(s->siginfo));
	if (r >= 0)
		r = loop_timeout(s->loop, &s->tick_op, s->tick_ms);
	if (r >= 0 && s->http)
		r = http_start(s->http);
	if (r < 0)
		return log_error_errno(r, "cannot start the event loop");
	if (s->http && s->limits.metrics_remote)
		log_notice("serving metrics on %s, which other machines may reach (metrics-remote = "
		           "yes): no authentication, and the metrics name every tenant",
		           s->limits.metrics_listen);
	else if (s->http)
		log_info("serving metrics on %s", s->limits.metrics_listen);

	format_status(s, s->notify_status, sizeof(s->notify_status));
	snprintf(status, sizeof(status), "READY=1\nSTATUS=%s", s->notify_status);
	sd_notify(0, status);
	if (s->watchdog_usec)
		log_info("watchdog: %llu ms, pinged every %llu ms",
		         (unsigned long long)(s->watchdog_usec / 1000), (unsigned long long)s->tick_ms);
	log_info("listening on %s (backend %s, pool %llu MiB in %u chunks of %llu KiB, budget %llu MiB)",
	         s->socket_path, s->pool->ops->name, (unsigned long long)(s->pool->pool_bytes >> 20),
	         s->pool->n_chunks, (unsigned long long)(s->pool->chunk_bytes >> 10),
	         (unsigned long long)(s->pool->budget_bytes >> 20));
	if (s->limits.ring_entries > 0)
		log_info("rings of %u entries, %s doorbell, polling %u us before sleeping",
		         s->limits.ring_entries,
		         s->ring_doorbell == KVD_RING_DOORBELL_FUTEX ? "futex" : "eventfd", s->limits.poll_us);
	else
		log_info("no rings (--ring-entries=0), polling %u us before sleeping", s->limits.poll_us);
	r = loop_run(s->loop);
	if (r < 0)
		return log_error_errno(r, "event loop failed");
	log_info("stopped");
	return 0;
}
