/* SPDX-License-Identifier: MIT */
/*
 * Fuzz target: the config file (kvd.conf) as the daemon reads it at start, on a reload and
 * for --check-config: the input is the whole file, parsed over the defaults and checked
 * (settings_load). Checked: the documented results only. Success means no error was
 * reported and every value is within its entry's range: each formats, the tenants are
 * within max-tenants, named validly and found by name, and loading the same file again
 * gives equal settings; failure (-EINVAL) means at least one error was reported, each a
 * terminated line naming the file. No fd stays open either way.
 */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fuzz.h"
#include "inifile.h"
#include "settings.h"
#include "tenant.h"

/* Loads the file at path over the defaults; the result and the errors in *ret_e. */
static int load(const char *path, struct settings *s, struct inifile_errors *e) {
	struct settings flags;
	int r;

	FUZZ_CHECK(settings_init(&flags) == 0);
	FUZZ_CHECK(settings_init(s) == 0);
	r = settings_load(s, &flags, path, e);
	settings_done(&flags);
	return r;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
	struct inifile_errors e = {}, again_e = {};
	struct settings s, again;
	unsigned fds = fuzz_fd_count();
	char path[64];
	size_t n;
	int fd, r;

	fd = memfd_create("fuzz-config", MFD_CLOEXEC);
	FUZZ_CHECK(fd >= 0);
	FUZZ_CHECK(write(fd, data, size) == (ssize_t)size);
	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);

	r = load(path, &s, &e);
	FUZZ_CHECK(r == 0 || r == -EINVAL || r == -ENOMEM, "settings_load: %d", r);
	if (r == 0) {
		FUZZ_CHECK(inifile_errors_count(&e) == 0);
		settings_table(&n);
		for (size_t i = 0; i < n; i++) {
			char buf[256];

			settings_format(&s, i, buf, sizeof(buf));
			FUZZ_CHECK(strlen(buf) < sizeof(buf));
		}
		FUZZ_CHECK(s.n_tenants <= s.max_tenants, "%u tenants, max %u", s.n_tenants,
		           s.max_tenants);
		for (uint32_t i = 0; i < s.n_tenants; i++) {
			FUZZ_CHECK(tenant_name_valid(s.tenants[i].name), "tenant '%s'", s.tenants[i].name);
			FUZZ_CHECK(settings_tenant_find(&s, s.tenants[i].name) == &s.tenants[i]);
		}
		/* The same file, read again, is the same settings. */
		FUZZ_CHECK(load(path, &again, &again_e) == 0);
		for (size_t i = 0; i < n; i++)
			FUZZ_CHECK(settings_equal(&s, &again, i), "entry %zu differs", i);
		FUZZ_CHECK(again.n_tenants == s.n_tenants);
		settings_done(&again);
	} else if (r == -EINVAL) {
		FUZZ_CHECK(inifile_errors_count(&e) > 0);
		for (unsigned i = 0; i < e.n; i++)
			FUZZ_CHECK(e.msg[i] && strncmp(e.msg[i], path, strlen(path)) == 0 &&
			           !strchr(e.msg[i], '\n'), "error: %s", e.msg[i] ? e.msg[i] : "(null)");
	}
	settings_done(&s);
	inifile_errors_done(&e);
	inifile_errors_done(&again_e);
	close(fd);
	FUZZ_CHECK(fuzz_fd_count() == fds, "an fd was left open");
	return 0;
}
