/* SPDX-License-Identifier: MIT */
/*
 * Fuzz target: the live state file (STATE_DIR/state), which the daemon reads once at start
 * and must survive whatever a crash, a full disk or an editor left in it. The input is the
 * whole file. Checked: loading never fails for the text (only for memory), keeps within
 * max-tenants, keeps only valid names and values; and what it kept round-trips: the text
 * state_format() writes for it loads, without errors, to exactly the same state.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "fuzz.h"
#include "inifile.h"
#include "state.h"
#include "tenant.h"

#define MAX_TENANTS 8u

/* On tmpfs where there is one: every input is written and read twice. */
static char dir[64];

static void remove_dir(void) {
	char path[96];

	snprintf(path, sizeof(path), "%s/%s", dir, STATE_FILE_NAME);
	unlink(path);
	rmdir(dir);
}

static void make_dir(void) {
	snprintf(dir, sizeof(dir), "/dev/shm/kvd-fuzz-state-XXXXXX");
	if (!mkdtemp(dir)) {
		snprintf(dir, sizeof(dir), "/tmp/kvd-fuzz-state-XXXXXX");
		FUZZ_CHECK(mkdtemp(dir), "mkdtemp");
	}
	atexit(remove_dir);
}

static void put_file(const char *path, const void *data, size_t size) {
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);

	FUZZ_CHECK(fd >= 0, "cannot write %s", path);
	FUZZ_CHECK(write(fd, data, size) == (ssize_t)size);
	close(fd);
}

static struct state *load(const void *data, size_t size, bool expect_clean) {
	struct inifile_errors e = {};
	struct state *st;

	FUZZ_CHECK(state_new(dir, MAX_TENANTS, &st) == 0);
	put_file(st->path, data, size);
	FUZZ_CHECK(state_load(st, &e) == 0);
	FUZZ_CHECK(!expect_clean || inifile_errors_count(&e) == 0, "%s", e.n ? e.msg[0] : "");
	inifile_errors_done(&e);
	return st;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
	unsigned fds = fuzz_fd_count();
	struct state *st, *again;
	char *text;

	if (!dir[0])
		make_dir();
	st = load(data, size, false);
	FUZZ_CHECK(st->n_tenants <= MAX_TENANTS);
	for (uint32_t i = 0; i < st->n_tenants; i++) {
		const struct state_tenant *t = &st->tenants[i];

		FUZZ_CHECK(tenant_name_valid(t->name), "tenant '%s'", t->name);
		FUZZ_CHECK(state_tenant_find(st, t->name) == t);
		FUZZ_CHECK(!t->has_weight || t->weight >= 1, "weight %u", t->weight);
	}
	FUZZ_CHECK(state_format(st, &text) == 0);
	again = load(text, strlen(text), true);
	FUZZ_CHECK(again->has_budget == st->has_budget);
	FUZZ_CHECK(!st->has_budget || again->budget == st->budget);
	FUZZ_CHECK(again->n_tenants == st->n_tenants, "%u tenants, then %u", st->n_tenants,
	           again->n_tenants);
	for (uint32_t i = 0; i < st->n_tenants; i++) {
		const struct state_tenant *a = &st->tenants[i];
		const struct state_tenant *b = state_tenant_find(again, a->name);

		FUZZ_CHECK(b, "tenant '%s' lost", a->name);
		FUZZ_CHECK(a->has_min == b->has_min && a->has_max == b->has_max &&
		           a->has_weight == b->has_weight);
		FUZZ_CHECK(!a->has_min || a->min_bytes == b->min_bytes);
		FUZZ_CHECK(!a->has_max || a->max_bytes == b->max_bytes);
		FUZZ_CHECK(!a->has_weight || a->weight == b->weight);
	}
	free(text);
	state_free(again);
	state_free(st);
	FUZZ_CHECK(fuzz_fd_count() == fds, "an fd was left open");
	return 0;
}
