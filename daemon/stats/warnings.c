/* SPDX-License-Identifier: MIT */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "basic/size.h"
#include "backend.h"
#include "conn.h"
#include "keep.h"
#include "log.h"
#include "pool.h"
#include "seq.h"
#include "server.h"
#include "tier.h"
#include "warnings.h"

struct text {
	char *buf;
	size_t len;
	bool cut;
};

static void add(struct text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void add(struct text *t, const char *fmt, ...) {
	static const char more[] = "(more warnings left out)\n";
	char line[512];
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	if (n < 0 || t->cut)
		return;
	if (t->len + strlen(line) + 1 + sizeof(more) > WARNINGS_MAX) {
		memcpy(t->buf + t->len, more, sizeof(more));
		t->len += sizeof(more) - 1;
		t->cut = true;
		return;
	}
	t->len += (size_t)snprintf(t->buf + t->len, WARNINGS_MAX - t->len, "%s\n", line);
}

static uint64_t physical_memory(void) {
	long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGESIZE);

	return pages > 0 && size > 0 ? (uint64_t)pages * (uint64_t)size : 0;
}

/* Bytes tenant t holds in sequences of models without an eviction unit. */
static uint64_t unevictable_bytes(const struct server *s, const struct tenant *t) {
	uint64_t bytes = 0;

	for (const struct conn *c = s->conns; c; c = c->next) {
		if (c->tenant != t)
			continue;
		for (const struct seq *q = c->seqs; q; q = q->next)
			if (q->model->unit == KVD_UNIT_NONE)
				bytes += seq_resident_bytes(q);
	}
	return bytes;
}

/* What the pool's size and the tenants' minimums alone make wrong. */
static void sizes(struct text *t, bool host_pool, uint64_t pool_bytes, uint64_t budget_bytes,
                  uint64_t mins) {
	uint64_t mem = physical_memory();
	char a[32], b[32];

	if (host_pool && mem && pool_bytes > mem)
		add(t, "the host pool (%s) is larger than physical memory (%s): chunks written "
		    "past it swap, or the OOM killer ends a process",
		    size_format(pool_bytes, a, sizeof(a)), size_format(mem, b, sizeof(b)));
	if (mins > budget_bytes)
		add(t, "the tenants' guaranteed minimums (%s together) exceed the budget (%s): "
		    "eviction cannot honour them all",
		    size_format(mins, a, sizeof(a)), size_format(budget_bytes, b, sizeof(b)));
}

void warnings_of_settings(bool host_pool, uint64_t pool_bytes, uint64_t budget_bytes,
                          uint64_t mins, char buf[WARNINGS_MAX]) {
	struct text t = { .buf = buf };

	buf[0] = 0;
	sizes(&t, host_pool, pool_bytes, budget_bytes, mins);
}

static void compute(const struct server *s, struct text *t) {
	const struct pool *p = s->pool;
	uint64_t mins = 0;
	char a[32], b[32];

	for (uint32_t i = 0; i < p->n_devices; i++) {
		const struct backend_device *dev = backend_device(i);
		int failed = dev ? __atomic_load_n(&dev->failed, __ATOMIC_RELAXED) : 0;

		if (failed)
			add(t, "GPU %d: the daemon's context there was lost to a sticky error (%s): "
			    "rounds no longer read or score K/V on it; restart kvd and the engines on "
			    "it (docs/gpu.md, Sticky errors)", dev->index, backend_error_name(failed));
	}
	if (s->gpu_unreachable[0])
		add(t, "this machine has the NVIDIA driver, but %s: GPU engines cannot use this pool "
		    "(under systemd: the unit's DeviceAllow= and nvidia-uvm, kvd(8) GPU)",
		    s->gpu_unreachable);
	/* A device nobody holds is torn down with every allocation on it, the fd store's too. */
	for (uint32_t i = 0; s->keep && s->keep->on && i < p->n_devices; i++) {
		const struct backend_device *dev = backend_device(i);

		if (dev && dev->persistence == 0)
			add(t, "GPU %d is not in persistence mode: the KV kept across a restart is lost "
			    "when no engine holds the GPU while kvd restarts (nvidia-persistenced, "
			    "kvd(8) GPU)", dev->index);
		else if (dev && dev->persistence < 0)
			add(t, "GPU %d: whether it is in persistence mode is unknown (no NVML): without "
			    "it, the KV kept across a restart is lost when no engine holds the GPU "
			    "while kvd restarts (kvd(8) GPU)", dev->index);
	}
	for (uint32_t i = 0; i < s->tenants.n; i++)
		mins += s->tenants.tenants[i]->min_bytes;
	sizes(t, p->ops->host_access, p->pool_bytes, p->budget_bytes, mins);
	/* A live recall outlives a restart without a host tier (the file's is refused): its
	 * rounds then keep nothing, and say so per sequence; one standing line says why. */
	for (uint32_t i = 0; s->tier->budget_bytes == 0 && i < s->tenants.n; i++) {
		const struct tenant *tn = s->tenants.tenants[i];

		if (tn->recall > 0)
			add(t, "tenant %s: recall is %" PRIu32 " but kvd runs without a host tier "
			    "(host-tier-size 0): nothing its rounds evict is kept for recall (kvdctl "
			    "tenant set %s --recall 0, or a host tier)", tn->name, tn->recall, tn->name);
	}
	for (uint32_t i = 0; i < s->tenants.n; i++) {
		const struct tenant *tn = s->tenants.tenants[i];
		uint64_t held;

		if (tn->max_bytes == KVD_TENANT_NO_CAP || tn->used_bytes <= tn->max_bytes)
			continue;
		held = unevictable_bytes(s, tn);
		if (held > tn->max_bytes)
			add(t, "tenant %s: its cap (%s) is below the %s it holds in sequences no round "
			    "can evict (models without an eviction unit): it stays over the cap until "
			    "it releases them",
			    tn->name, size_format(tn->max_bytes, a, sizeof(a)),
			    size_format(held, b, sizeof(b)));
	}
}

void warnings_update(struct server *s) {
	char buf[WARNINGS_MAX];
	struct text t = { .buf = buf };
	const char *line, *end;

	buf[0] = 0;
	compute(s, &t);
	/* Each warning is logged when it appears, not again while it holds. */
	for (line = buf; *line; line = end + 1) {
		end = strchr(line, '\n');
		if (!memmem(s->warnings, strlen(s->warnings), line, (size_t)(end - line + 1)))
			log_warning("%.*s", (int)(end - line), line);
	}
	memcpy(s->warnings, buf, t.len + 1);
}

const char *warnings_text(const struct server *s) {
	return s->warnings[0] ? s->warnings : NULL;
}
