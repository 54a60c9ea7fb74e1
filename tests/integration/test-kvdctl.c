/* SPDX-License-Identifier: MIT */
/*
 * kvdctl as operators and scripts use it: every command against a real daemon, its exit
 * status, its text for people and its JSON (parsed by python3's json module, which also
 * proves it valid), usage errors, an unreachable daemon, and `top` both for one frame and
 * as a live view that a signal ends (on a pipe and on a terminal).
 *
 * The binary comes from $KVDCTL (set by meson). Budget and tenant reset need a daemon that
 * knows them: where kvd answers -EOPNOTSUPP (an older kvd), those checks skip and say so.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <time.h>
#include <termios.h>
#include <unistd.h>

#include "fixture.h"
#include "test.h"

#define MiB (UINT64_C(1) << 20)
#define OUT_MAX (1 << 17)

/* 8 KiB blocks of 16 tokens, one table: 2048 tokens fill one 1 MiB chunk exactly. */
static const kvd_model_spec one_chunk = { "c", 1, 2, 2, 64, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER };

static const char *const fixture_args[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB",
	                                    "--budget", "12MiB", NULL };

static const char *const unreachable = "/nonexistent-kvd-test/kvd.sock";

int test_setup(void) {
	/* A child that exits before reading its stdin must not kill the test. */
	signal(SIGPIPE, SIG_IGN);
	if (!getenv("KVDCTL")) {
		fprintf(stderr, "KVDCTL is not set (run the tests through meson)\n");
		return -EINVAL;
	}
	return 0;
}

/* ---- Running programs ---- */

struct run {
	int status; /* exit status, or 128 + signal */
	char out[OUT_MAX];
	char err[OUT_MAX];
};

struct proc {
	pid_t pid;
	int in, out, err; /* our ends; -1 when closed */
};

/* Starts argv[0] with pipes for stdin, stdout and stderr, or with out_fd (a terminal) as
 * stdin and stdout when it is >= 0; with socket_env, $KVD_SOCKET is set to it, else
 * removed. */
static void proc_start(struct proc *p, char *const argv[], const char *socket_env, int out_fd) {
	int in[2], out[2] = { -1, -1 }, err[2];

	ASSERT_OK(pipe2(in, O_CLOEXEC));
	if (out_fd < 0)
		ASSERT_OK(pipe2(out, O_CLOEXEC));
	ASSERT_OK(pipe2(err, O_CLOEXEC));
	p->pid = fixture_fork();
	if (p->pid == 0) {
		if (socket_env)
			setenv("KVD_SOCKET", socket_env, 1);
		else
			unsetenv("KVD_SOCKET");
		signal(SIGPIPE, SIG_DFL);
		if (dup2(out_fd >= 0 ? out_fd : in[0], 0) < 0 || dup2(out_fd >= 0 ? out_fd : out[1], 1) < 0 ||
		    dup2(err[1], 2) < 0)
			_exit(127);
		execvp(argv[0], argv);
		_exit(127);
	}
	close(in[0]);
	if (out_fd < 0)
		close(out[1]);
	close(err[1]);
	p->in = in[1];
	p->out = out_fd >= 0 ? -1 : out[0];
	p->err = err[0];
}

/* Appends what fd has to buf (NUL-terminated); returns 0 at EOF (fd closed then), 1 else. */
static int drain(int *fd, char *buf, size_t *len) {
	ssize_t n = read(*fd, buf + *len, OUT_MAX - 1 - *len);

	if (n < 0 && errno == EINTR)
		return 1;
	/* EIO: a terminal whose other side closed. */
	if (n <= 0 || *len + (size_t)n >= OUT_MAX - 1) {
		if (n > 0)
			*len += (size_t)n;
		buf[*len] = 0;
		close(*fd);
		*fd = -1;
		return 0;
	}
	*len += (size_t)n;
	buf[*len] = 0;
	return 1;
}

/* Reads stdout (or extra_out, a terminal's side) until the text contains want or the time
 * runs out; returns whether it did. Output read so far stays in r->out. */
static bool proc_wait_output(struct proc *p, int *fd, struct run *r, size_t *len, const char *want,
			     int timeout_ms) {
	for (int waited = 0; waited < timeout_ms; waited += 20) {
		struct pollfd pfd = { .fd = *fd, .events = POLLIN };

		if (strstr(r->out, want))
			return true;
		if (*fd < 0)
			return false;
		if (poll(&pfd, 1, 20) > 0)
			(void)drain(fd, r->out, len);
	}
	return strstr(r->out, want) != NULL;
}

/* Writes in (may be NULL), reads stdout (from *out_fd) and stderr until both close, and
 * waits for the process. */
static void proc_finish(struct proc *p, int *out_fd, const char *in, struct run *r,
			size_t out_len) {
	size_t err_len = 0;
	int status;

	if (in) {
		size_t n = strlen(in), off = 0;

		while (off < n) {
			ssize_t k = write(p->in, in + off, n - off);

			if (k < 0 && errno == EINTR)
				continue;
			if (k <= 0)
				break; /* it stopped reading; what it says tells why */
			off += (size_t)k;
		}
	}
	close(p->in);
	p->in = -1;
	r->out[out_len] = 0;
	r->err[0] = 0;
	while (*out_fd >= 0 || p->err >= 0) {
		struct pollfd pfd[2] = { { .fd = *out_fd, .events = POLLIN },
			                 { .fd = p->err, .events = POLLIN } };

		if (poll(pfd, 2, 30000) <= 0)
			test_fail(__FILE__, __LINE__, "%s: no output for 30 s", "child");
		if (pfd[0].revents)
			(void)drain(out_fd, r->out, &out_len);
		if (pfd[1].revents)
			(void)drain(&p->err, r->err, &err_len);
	}
	ASSERT_EQ(waitpid(p->pid, &status, 0), p->pid);
	r->status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* Splits line at blanks into argv after the given first words (no quoting needed here). */
static void split_args(char *line, char **argv, size_t max, size_t n) {
	for (char *save = NULL, *w = strtok_r(line, " ", &save); w && n < max - 1;
	     w = strtok_r(NULL, " ", &save))
		argv[n++] = w;
	argv[n] = NULL;
}

/*
 * Runs kvdctl with --socket socket (none when NULL) and the blank-separated arguments
 * (printf-style), $KVD_SOCKET removed. The result is static: copy what must outlive the
 * next call.
 */
static struct run *kvdctl(const char *socket, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));
static struct run *kvdctl(const char *socket, const char *fmt, ...) {
	static struct run r;
	char line[1024], *argv[64];
	struct proc p;
	size_t n = 0;
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	argv[n++] = getenv("KVDCTL");
	if (socket) {
		argv[n++] = "--socket";
		argv[n++] = (char *)socket;
	}
	split_args(line, argv, 64, n);
	proc_start(&p, argv, NULL, -1);
	proc_finish(&p, &p.out, NULL, &r, 0);
	return &r;
}

/* Fails unless the run exited with want; prints what it said. */
#define ASSERT_EXIT(result, want)                                                             \
	do {                                                                                  \
		const struct run *_r = (result);                                                \
		if (_r->status != (want))                                                     \
			test_fail(__FILE__, __LINE__,                                         \
				  "kvdctl exited %d, expected %d\nstdout: %s\nstderr: %s",    \
				  _r->status, (want), _r->out, _r->err);                      \
	} while (0)

#define ASSERT_CONTAINS(hay, needle)                                                          \
	do {                                                                                  \
		const char *_h = (hay), *_n = (needle);                                       \
		if (!strstr(_h, _n))                                                          \
			test_fail(__FILE__, __LINE__, "expected \"%s\" in:\n%s", _n, _h);      \
	} while (0)

#define ASSERT_NOT_CONTAINS(hay, needle)                                                      \
	do {                                                                                  \
		const char *_h = (hay), *_n = (needle);                                       \
		if (strstr(_h, _n))                                                           \
			test_fail(__FILE__, __LINE__, "did not expect \"%s\" in:\n%s", _n, _h); \
	} while (0)

/*
 * Parses json with Python ($KVD_TEST_PYTHON, set by meson, else python3) (failing the test
 * when it is not one valid JSON document) and returns the Python expression expr evaluated
 * over it as `d`: strings as they are, anything else as JSON (None is "null"). Static
 * result.
 */
static const char *json_eval(const char *json, const char *expr) {
	static struct run r;
	char *python = getenv("KVD_TEST_PYTHON");
	char *argv[] = {
		python ? python : "python3", "-c",
		"import json, sys\n"
		"d = json.load(sys.stdin)\n"
		"v = eval(sys.argv[1])\n"
		"print(v if isinstance(v, str) else json.dumps(v))\n",
		(char *)expr, NULL,
	};
	struct proc p;
	size_t n;

	proc_start(&p, argv, NULL, -1);
	proc_finish(&p, &p.out, json, &r, 0);
	if (r.status != 0)
		test_fail(__FILE__, __LINE__, "python3 could not evaluate %s over:\n%s\n%s", expr,
			  json, r.err);
	n = strlen(r.out);
	if (n && r.out[n - 1] == '\n')
		r.out[n - 1] = 0;
	return r.out;
}

#define ASSERT_JSON(json, expr, want) ASSERT_STREQ(json_eval(json, expr), want)

/* The line of text that starts with prefix (static copy, without the newline), or fail. */
static const char *line_starting(const char *text, const char *prefix) {
	static char line[1024];
	size_t plen = strlen(prefix);

	for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
		if (strncmp(p, prefix, plen) == 0) {
			size_t n = strcspn(p, "\n");

			snprintf(line, sizeof(line), "%.*s", (int)n, p);
			return line;
		}
	test_fail(__FILE__, __LINE__, "no line starting with \"%s\" in:\n%s", prefix, text);
}

/* Whether this daemon reports where its values come from (newer daemons do). */
static bool reports_sources(struct fixture *f) {
	__attribute__((cleanup(kvd_client_unrefp))) kvd_client *c = fixture_connect(f, NULL);
	__attribute__((cleanup(kvd_status_freep))) kvd_status *st = NULL;
	const char *s;

	ASSERT_OK(kvd_status_get(c, &st));
	return kvd_status_str(st, "budget_source", &s) == 0;
}

/* A tenant's connection holding one-chunk sequences. */
struct holder {
	kvd_client *c;
	kvd_seq *s[8];
	int n;
};

static void hold(struct holder *h, struct fixture *f, const char *tenant, int chunks) {
	int m;

	ASSERT_LE(chunks, 8);
	h->c = fixture_connect(f, tenant);
	h->n = chunks;
	m = kvd_model_register(h->c, &one_chunk);
	ASSERT_OK(m);
	for (int i = 0; i < chunks; i++) {
		ASSERT_OK(kvd_seq_open(h->c, m, 2048, &h->s[i]));
		ASSERT_OK(kvd_seq_grow(h->s[i], 2048));
	}
}

static void unhold(struct holder *h) {
	for (int i = 0; i < h->n; i++)
		ASSERT_OK(kvd_seq_release(h->s[i]));
	h->c = kvd_client_unref(h->c);
	h->n = 0;
}

/* ---- Without a daemon ---- */

TEST(help_and_version) {
	static const char *const mentions[] = {
		"status [--json]", "tenants [--json]", "budget get [--json]", "budget set SIZE",
		"budget reset", "tenant set NAME", "tenant reset NAME",
		"top [--interval SECONDS] [--once] [--json]", "score", "--socket PATH",
		"$KVD_SOCKET", KVD_DEFAULT_SOCKET, "--min SIZE", "--max SIZE|none", "--weight N",
		"--interval SECONDS", "(default: 2)", "--once", "--json", "--help", "--version",
		"Exit status",
	};
	struct run *r;

	r = kvdctl(NULL, "--help");
	ASSERT_EXIT(r, 0);
	for (size_t i = 0; i < sizeof(mentions) / sizeof(mentions[0]); i++)
		ASSERT_CONTAINS(r->out, mentions[i]);
	ASSERT_STREQ(r->err, "");
	/* A command's --help is the same text. */
	r = kvdctl(NULL, "top --help");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "--interval SECONDS");

	r = kvdctl(NULL, "--version");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "kvdctl ");
	ASSERT_CONTAINS(r->out, "libkvd ");
	ASSERT_CONTAINS(r->out, kvd_version());
}

TEST(usage_errors_exit_2) {
	static const char *const bad[] = {
		"",
		"frobnicate",
		"--bogus status",
		"status extra",
		"status --bogus",
		"tenants extra",
		"budget",
		"budget frob",
		"budget get extra",
		"budget set",
		"budget set lots",
		"budget set 1G 2G",
		"budget set 99999999999T",
		"budget set 1G --json",
		"budget reset now",
		"budget reset --json",
		"tenant",
		"tenant frob a",
		"tenant set",
		"tenant set a b",
		"tenant set a --weight 0",
		"tenant set a --weight x",
		"tenant set a --weight 10001",   /* the daemon's range, 1..KVD_TENANT_WEIGHT_MAX */
		"--json tenant set a --weight 2",
		"--json evict",
		"tenant set a --min big",
		"tenant set a --max lots",
		"tenant set a --json",
		"tenant reset",
		"tenant reset a --min 1M",
		"tenant delete",
		"tenant delete a b",
		"tenant delete a --weight 2",
		"top extra",
		"top --interval 0",
		"top --interval -1",
		"top --interval abc",
		"top --interval 1e9",
		"top --interval nan",
		"top --json",
	};

	/* Nothing is reachable there: a usage error must be found before connecting. */
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		struct run *r = kvdctl(unreachable, "%s", bad[i]);

		if (r->status != 2)
			test_fail(__FILE__, __LINE__, "kvdctl %s: exited %d, expected 2\n%s%s", bad[i],
				  r->status, r->out, r->err);
		ASSERT_STREQ(r->out, "");
		ASSERT_CONTAINS(r->err, "kvdctl: ");
		ASSERT_CONTAINS(r->err, "Try 'kvdctl --help'.");
	}
}

TEST(unreachable_daemon_exits_1) {
	static const char *const cmds[] = {
		"status",        "status --json",   "tenants",        "tenants --json",
		"budget get",    "budget get --json", "budget set 1M", "budget reset",
		"tenant set a",  "tenant reset a",  "top --once --interval 0.1",
		"top --once --json --interval 0.1",
		"top --interval 0.1",
	};
	char *argv[] = { getenv("KVDCTL"), "status", NULL };
	static struct run env_run;
	struct run *r;
	struct proc p;

	for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
		r = kvdctl(unreachable, "%s", cmds[i]);
		if (r->status != 1)
			test_fail(__FILE__, __LINE__, "kvdctl %s: exited %d, expected 1\n%s%s", cmds[i],
				  r->status, r->out, r->err);
		ASSERT_STREQ(r->out, "");
		ASSERT_CONTAINS(r->err, "kvdctl: cannot connect to kvd at /nonexistent-kvd-test/kvd.sock: ");
		ASSERT_CONTAINS(r->err, "is the daemon running?");
	}

	/* $KVD_SOCKET is the default socket. */
	r = &env_run;
	proc_start(&p, argv, unreachable, -1);
	proc_finish(&p, &p.out, NULL, r, 0);
	ASSERT_EXIT(r, 1);
	ASSERT_CONTAINS(r->err, unreachable);
}

/* ---- Against a daemon ---- */

/* A daemon with a host tier: its line in status (and token recall's), its numbers in JSON,
 * a tenant's tier and recall. */
TEST(status_host_tier) {
	struct fixture f;
	struct run *r;

	fixture_start(&f, (const char *const[]){ "--pool-size", "16MiB", "--chunk-size", "1MiB",
	                                         "--host-tier-size", "4MiB", NULL });
	r = kvdctl(f.socket, "status");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "host tier     0 B of 4.0 MiB, 0 sequences (outside the budget); 0 moved "
	                        "out, 0 back, 0 lost\n");
	ASSERT_CONTAINS(r->out, "recall        0 evicted tokens kept (0 B of the host tier); 0 recalls "
	                        "brought 0 back; 0 not kept\n");
	r = kvdctl(f.socket, "tenant set alpha --tier host");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "tier host (live), recall 0 (default)");
	r = kvdctl(f.socket, "tenant set alpha --recall 64");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "tier host (live), recall 64 (live)");
	r = kvdctl(f.socket, "tenant set alpha --recall 2000000");
	ASSERT_EXIT(r, 1);
	ASSERT_CONTAINS(r->err, "recall must be 0..1048576 tokens per row");
	r = kvdctl(f.socket, "--json status");
	ASSERT_EXIT(r, 0);
	ASSERT_JSON(r->out, "d['host_tier_bytes']", "4194304");
	ASSERT_JSON(r->out, "d['tenants'][0]['tier']", "host");
	ASSERT_JSON(r->out, "d['tenants'][0]['recall']", "64");
	ASSERT_JSON(r->out, "d['tenants'][0]['recall_source']", "live");
	ASSERT_JSON(r->out, "d['recall_kept_tokens']", "0");
	/* The tenant table says each tenant's tier, marked as the other live values are. */
	r = kvdctl(f.socket, "tenants");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(line_starting(r->out, "TENANT "), "TIER");
	ASSERT_CONTAINS(line_starting(r->out, "alpha "), "host*");
	r = kvdctl(f.socket, "top --once --interval 0.1");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "host tier 0 B of 4.0 MiB");
	ASSERT_CONTAINS(r->out, "HOST TIER");
	/* The prefix cache's columns: nothing cached, no prefix open yet. */
	ASSERT_CONTAINS(line_starting(r->out, "TENANT "), "CACHED");
	ASSERT_CONTAINS(line_starting(r->out, "TENANT "), "HIT%");
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(status_tenants_budget) {
	struct fixture f;
	struct holder a, b;
	struct run *r;
	char json[OUT_MAX];
	const char *line;
	bool sources;

	fixture_start(&f, fixture_args);
	sources = reports_sources(&f);

	/* With no tenant yet. */
	r = kvdctl(f.socket, "tenants");
	ASSERT_EXIT(r, 0);
	ASSERT_STREQ(r->out, "No tenants.\n");
	r = kvdctl(f.socket, "tenants --json");
	ASSERT_EXIT(r, 0);
	ASSERT_JSON(r->out, "d['tenants']", "[]");
	ASSERT_JSON(r->out, "d['budget_bytes']", "12582912");

	r = kvdctl(f.socket, "tenant set alpha --min 2M --max 8M --weight 3");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "tenant alpha set: min 2.0 MiB");
	ASSERT_CONTAINS(r->out, "max 8.0 MiB");
	ASSERT_CONTAINS(r->out, "weight 3");
	ASSERT_CONTAINS(r->out, "policy kvd (default)");
	r = kvdctl(f.socket, "tenant set alpha --policy keydiff");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "weight 3 (live), policy keydiff (live)");
	r = kvdctl(f.socket, "tenant set alpha --policy nonesuch");
	ASSERT_EXIT(r, 1);
	ASSERT_CONTAINS(r->err, "unknown policy");
	/* This daemon has no host tier. */
	r = kvdctl(f.socket, "tenant set alpha --tier host");
	ASSERT_EXIT(r, 1);
	ASSERT_CONTAINS(r->err, "tier host needs a host tier");
	r = kvdctl(f.socket, "tenant set alpha --recall 8");
	ASSERT_EXIT(r, 1);
	ASSERT_CONTAINS(r->err, "recall needs a host tier");
	r = kvdctl(f.socket, "tenant set alpha --tier drop");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "policy keydiff (live), tier drop (live)");
	hold(&a, &f, "alpha", 3);
	hold(&b, &f, "beta", 1);

	/* status: the node, then the tenant table. */
	r = kvdctl(f.socket, "status");
	ASSERT_EXIT(r, 0);
	ASSERT_STREQ(r->err, "");
	ASSERT_CONTAINS(r->out, "protocol 1, backend host");
	line = line_starting(r->out, "  budget ");
	ASSERT_CONTAINS(line, "12.0 MiB");
	ASSERT_CONTAINS(line, "75.0% of pool");
	/* Set with --budget: whatever kvd calls that source, it is not a live value. */
	if (sources)
		ASSERT_FALSE(strstr(line, "(source: live)") || strstr(line, "(source: -)"));
	else
		ASSERT_CONTAINS(line, "(source: -)");
	line = line_starting(r->out, "  used ");
	ASSERT_CONTAINS(line, "4.0 MiB");
	ASSERT_CONTAINS(line, "33.3% of budget");
	line = line_starting(r->out, "alpha ");
	ASSERT_CONTAINS(line, "3.0 MiB");
	ASSERT_CONTAINS(line, "25.0%");
	ASSERT_CONTAINS(line, "8.0 MiB");
	line = line_starting(r->out, "beta ");
	ASSERT_CONTAINS(line, "8.3%");
	if (sources) {
		/* alpha's values were set live, beta's are defaults. */
		ASSERT_CONTAINS(line_starting(r->out, "alpha "), "2.0 MiB*");
		ASSERT_CONTAINS(line_starting(r->out, "alpha "), "8.0 MiB*");
		ASSERT_CONTAINS(r->out, "\n* set live with kvdctl");
	} else {
		ASSERT_CONTAINS(r->out, "does not report where MIN, MAX and WEIGHT come from");
	}

	/* --json before the command is the command's own. */
	r = kvdctl(f.socket, "--json status");
	ASSERT_EXIT(r, 0);
	snprintf(json, sizeof(json), "%s", r->out);
	ASSERT_JSON(json, "d['pool_bytes']", "16777216");
	r = kvdctl(f.socket, "status --json");
	ASSERT_EXIT(r, 0);
	snprintf(json, sizeof(json), "%s", r->out);
	ASSERT_JSON(json, "d['pool_bytes']", "16777216");
	ASSERT_JSON(json, "d['budget_bytes']", "12582912");
	ASSERT_JSON(json, "d['used_bytes']", "4194304");
	ASSERT_JSON(json, "d['protocol_version']", "1");
	ASSERT_JSON(json, "d['backend']", "host");
	ASSERT_JSON(json, "d['library_version']", kvd_version());
	ASSERT_JSON(json, "[t['name'] for t in d['tenants']]", "[\"alpha\", \"beta\"]");
	ASSERT_JSON(json, "d['tenants'][0]['used_bytes']", "3145728");
	ASSERT_JSON(json, "d['tenants'][0]['min_bytes']", "2097152");
	ASSERT_JSON(json, "d['tenants'][0]['max_bytes']", "8388608");
	ASSERT_JSON(json, "d['tenants'][0]['weight']", "3");
	ASSERT_JSON(json, "d['tenants'][0]['sequences']", "3");
	ASSERT_JSON(json, "d['tenants'][0]['connections']", "1");
	ASSERT_JSON(json, "d['tenants'][1]['max_bytes']", "null");
	if (sources) {
		ASSERT_JSON(json, "d['budget_source'] not in ('live', '')", "true");
		ASSERT_JSON(json, "d['tenants'][0]['min_source']", "live");
		ASSERT_JSON(json, "d['tenants'][1]['weight_source']", "default");
	} else {
		ASSERT_JSON(json, "'budget_source' in d", "false");
	}

	/* tenants: the table alone, every line as wide as the title line. */
	r = kvdctl(f.socket, "tenants");
	ASSERT_EXIT(r, 0);
	ASSERT_TRUE(strncmp(r->out, "TENANT ", 7) == 0);
	ASSERT_FALSE(strstr(r->out, "pool"));
	{
		size_t title = strcspn(r->out, "\n");

		ASSERT_EQ(strcspn(strstr(r->out, "\nalpha ") + 1, "\n"), title);
		ASSERT_EQ(strcspn(strstr(r->out, "\nbeta ") + 1, "\n"), title);
	}
	ASSERT_CONTAINS(r->out, "POLICY");
	ASSERT_CONTAINS(line_starting(r->out, "alpha "), "25.0%");
	r = kvdctl(f.socket, "tenants --json");
	ASSERT_EXIT(r, 0);
	ASSERT_JSON(r->out, "d['budget_bytes']", "12582912");
	ASSERT_JSON(r->out, "[t['name'] for t in d['tenants']]", "[\"alpha\", \"beta\"]");
	ASSERT_JSON(r->out, "d['tenants'][1]['used_bytes']", "1048576");

	/* budget get / set. */
	r = kvdctl(f.socket, "budget get");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(line_starting(r->out, "budget "), "12.0 MiB");
	ASSERT_CONTAINS(line_starting(r->out, "budget "), "75.0% of pool");
	if (sources)
		ASSERT_FALSE(strstr(line_starting(r->out, "source "), "live"));
	else
		ASSERT_STREQ(line_starting(r->out, "source "), "source  -");
	ASSERT_CONTAINS(line_starting(r->out, "pool "), "16.0 MiB");
	ASSERT_CONTAINS(line_starting(r->out, "used "), "33.3% of budget");
	r = kvdctl(f.socket, "budget get --json");
	ASSERT_EXIT(r, 0);
	ASSERT_JSON(r->out, "[d['budget_bytes'], d['pool_bytes'], d['used_bytes']]",
		    "[12582912, 16777216, 4194304]");

	r = kvdctl(f.socket, "budget set 8MiB");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "budget set: budget 8.0 MiB (8388608 bytes");
	r = kvdctl(f.socket, "budget get --json");
	ASSERT_JSON(r->out, "d['budget_bytes']", "8388608");
	if (sources)
		ASSERT_JSON(r->out, "d['budget_source']", "live");
	/* The share follows the budget. */
	r = kvdctl(f.socket, "tenants");
	ASSERT_CONTAINS(line_starting(r->out, "alpha "), "37.5%");

	/* Refusals carry the daemon's message and exit 1. */
	r = kvdctl(f.socket, "budget set 1G");
	ASSERT_EXIT(r, 1);
	ASSERT_STREQ(r->out, "");
	ASSERT_CONTAINS(r->err, "kvdctl: budget set 1.0 GiB: Invalid argument: ");
	ASSERT_CONTAINS(r->err, "pool");
	r = kvdctl(f.socket, "tenant set alpha --min 1G");
	ASSERT_EXIT(r, 1);
	ASSERT_CONTAINS(r->err, "kvdctl: tenant set alpha: Invalid argument: ");
	r = kvdctl(f.socket, "tenant set bad/name");
	ASSERT_EXIT(r, 1);
	ASSERT_CONTAINS(r->err, "kvdctl: tenant set bad/name: Invalid argument: a tenant name is");
	/* kvdctl knows the daemon's range of weights. */
	r = kvdctl(f.socket, "tenant set alpha --weight 4000000000");
	ASSERT_EXIT(r, 2);
	ASSERT_CONTAINS(r->err, "--weight: '4000000000' must be a number in 1..10000");

	/* --max none lifts the cap; options left out keep their value. */
	r = kvdctl(f.socket, "tenant set alpha --max none");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "max none");
	r = kvdctl(f.socket, "tenants --json");
	ASSERT_JSON(r->out, "[d['tenants'][0][k] for k in ('min_bytes', 'max_bytes', 'weight')]",
		    "[2097152, null, 3]");

	/* --socket may also follow the command. */
	r = kvdctl(NULL, "tenants --socket %s", f.socket);
	ASSERT_EXIT(r, 0);

	unhold(&a);
	unhold(&b);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Whether kvd knows "budget reset" / "tenant reset"; false (skip) only when it answers
 * -EOPNOTSUPP, as a daemon older than kvdctl does. */
static bool reset_supported(const struct run *r, const char **why) {
	if (r->status == 1 && strstr(r->err, strerror(EOPNOTSUPP))) {
		*why = r->err;
		return false;
	}
	return true;
}

/* The tenant's [min, max, weight] from `tenants --json`, and its sources. */
#define TENANT_VALUES(name)                                                                   \
	"[[t[k] for k in ('min_bytes', 'max_bytes', 'weight')] for t in d['tenants'] "        \
	"if t['name'] == '" name "'][0]"
#define TENANT_SOURCES(name)                                                                  \
	"[[t[k] for k in ('min_source', 'max_source', 'weight_source')] for t in d['tenants'] " \
	"if t['name'] == '" name "'][0]"

/* kvdctl reload: the config file read again, and the result told (what ExecReload needs):
 * errors exit 1 with the file's errors and leave the running settings; status counts. */
TEST(reload_reports_its_result) {
	static const char *const args[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB", NULL };
	struct fixture f;
	struct run *r;

	fixture_setup(&f, "[kvd]\nbudget = 12MiB\n", false);
	fixture_launch(&f, args);
	fixture_write_config(&f, "[kvd]\nbudget = 10MiB\n");
	r = kvdctl(f.socket, "reload");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "reloaded");
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 10u << 20);
	/* A bad edit: refused, said, counted; the budget stays. */
	fixture_write_config(&f, "[kvd]\nbudget = lots\n");
	r = kvdctl(f.socket, "reload");
	ASSERT_EXIT(r, 1);
	ASSERT_CONTAINS(r->err, "reload failed: 1 error in");
	ASSERT_CONTAINS(r->err, "budget");
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 10u << 20);
	ASSERT_EQ(fixture_status(&f, NULL, "reloads"), 2u);
	ASSERT_EQ(fixture_status(&f, NULL, "reload_failures"), 1u);
	{
		char buf[256];

		ASSERT_TRUE(strstr(fixture_status_str(&f, NULL, "last_reload_error", buf, sizeof(buf)),
		                   "reload failed: 1 error"));
	}
	/* Fixed: the error goes from the status. */
	fixture_write_config(&f, "[kvd]\nbudget = 8MiB\n");
	ASSERT_EXIT(kvdctl(f.socket, "reload"), 0);
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 8u << 20);
	{
		char buf[256];

		ASSERT_STREQ(fixture_status_str(&f, NULL, "last_reload_error", buf, sizeof(buf)), "");
	}
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* kvdctl config: each running value with its source, live and restart-bound ones too. */
TEST(config_shows_values_and_sources) {
	static const char *const args[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB",
		                            "--tier-idle", "1234", NULL };
	struct fixture f;
	struct run *r;
	char line[512];

	fixture_setup(&f, "[kvd]\nbudget = 50%\nmax-seqs = 99\n", false);
	fixture_launch(&f, args);
	r = kvdctl(f.socket, "config");
	ASSERT_EXIT(r, 0);
	snprintf(line, sizeof(line), "%s:2\n", f.config);
	ASSERT_CONTAINS(r->out, "50% (8.0 MiB)");
	ASSERT_CONTAINS(r->out, line);
	ASSERT_CONTAINS(r->out, "1234 ms");
	ASSERT_CONTAINS(r->out, "max-seqs-per-tenant");
	r = kvdctl(f.socket, "config --json");
	ASSERT_EXIT(r, 0);
	snprintf(line, sizeof(line), "{\"name\": \"max-seqs\", \"value\": \"99\", \"source\": "
	         "\"%s:3\"}", f.config);
	ASSERT_CONTAINS(r->out, line);
	ASSERT_CONTAINS(r->out, "{\"name\": \"tier-idle\", \"value\": \"1234 ms\", \"source\": \"flag\"}");
	ASSERT_CONTAINS(r->out, "{\"name\": \"max-tenants\", \"value\": \"64\", \"source\": \"default\"}");
	ASSERT_TRUE(!strstr(r->out, "check-config"));
	/* A live budget says so; a file edit that needs a restart leaves the running value. */
	ASSERT_EXIT(kvdctl(f.socket, "budget set 4MiB"), 0);
	fixture_write_config(&f, "[kvd]\nbudget = 50%\nmax-seqs = 99\nmax-tenants = 7\n");
	ASSERT_EXIT(kvdctl(f.socket, "reload"), 0);
	r = kvdctl(f.socket, "config --json");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "{\"name\": \"budget\", \"value\": \"4.0 MiB\", \"source\": \"live\"}");
	ASSERT_CONTAINS(r->out, "{\"name\": \"max-tenants\", \"value\": \"64\", \"source\": \"default\"}");
	ASSERT_EXIT(kvdctl(f.socket, "config extra"), 2);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(budget_and_tenant_reset) {
	static const char *const config = "[kvd]\n"
					  "budget = 12MiB\n"
					  "\n"
					  "[tenant llama]\n"
					  "min = 2MiB\n"
					  "max = 8MiB\n"
					  "weight = 2\n";
	static const char *const args[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB", NULL };
	struct fixture f;
	struct run *r;
	const char *why;

	fixture_setup(&f, config, false);
	fixture_launch(&f, args);

	/* The budget: from the config file, live after set, from the file again after reset. */
	r = kvdctl(f.socket, "budget get --json");
	ASSERT_JSON(r->out, "[d['budget_bytes'], d.get('budget_source')]", "[12582912, \"config\"]");
	ASSERT_EXIT(kvdctl(f.socket, "budget set 6M"), 0);
	r = kvdctl(f.socket, "budget get");
	ASSERT_STREQ(line_starting(r->out, "source "),
		     "source  live (set with kvdctl: kept across daemon restarts until 'kvdctl "
		     "budget reset')");
	r = kvdctl(f.socket, "budget reset");
	if (!reset_supported(r, &why)) {
		ASSERT_EQ(fixture_stop(&f), 0);
		TEST_SKIP("kvd does not support budget reset: %s", why);
	}
	ASSERT_EXIT(r, 0);
	ASSERT_STREQ(r->out, "budget reset: budget 12.0 MiB (12582912 bytes, source: config)\n");
	ASSERT_STREQ(r->err, "");
	/* Resetting what is not live is no error. */
	ASSERT_EXIT(kvdctl(f.socket, "budget reset"), 0);

	/* A tenant of the config file: live values win until reset, the marks say which. */
	r = kvdctl(f.socket, "tenant set llama --max 4M --weight 5");
	ASSERT_EXIT(r, 0);
	ASSERT_STREQ(r->out, "tenant llama set: min 2.0 MiB (config), max 4.0 MiB (live), weight 5 "
			     "(live), policy kvd (default), tier drop (default), recall 0 (default)\n");
	r = kvdctl(f.socket, "tenants");
	ASSERT_CONTAINS(line_starting(r->out, "llama "), "2.0 MiB+");
	ASSERT_CONTAINS(line_starting(r->out, "llama "), "4.0 MiB*");
	ASSERT_CONTAINS(line_starting(r->out, "llama "), "5*");
	ASSERT_CONTAINS(r->out, "\n* set live with kvdctl");
	ASSERT_CONTAINS(r->out, "\n+ from the config file");

	/* Live values survive a restart. */
	ASSERT_EQ(fixture_halt(&f), 0);
	fixture_launch(&f, args);
	r = kvdctl(f.socket, "tenants --json");
	ASSERT_JSON(r->out, TENANT_VALUES("llama"), "[2097152, 4194304, 5]");
	ASSERT_JSON(r->out, TENANT_SOURCES("llama"), "[\"config\", \"live\", \"live\"]");

	r = kvdctl(f.socket, "tenant reset llama");
	if (!reset_supported(r, &why)) {
		ASSERT_EQ(fixture_stop(&f), 0);
		TEST_SKIP("kvd does not support tenant reset: %s", why);
	}
	ASSERT_EXIT(r, 0);
	ASSERT_STREQ(r->out, "tenant llama reset: min 2.0 MiB (config), max 8.0 MiB (config), "
			     "weight 2 (config), policy kvd (default), tier drop (default), recall 0 (default)\n");
	r = kvdctl(f.socket, "tenants --json");
	ASSERT_JSON(r->out, TENANT_VALUES("llama"), "[2097152, 8388608, 2]");
	ASSERT_JSON(r->out, TENANT_SOURCES("llama"), "[\"config\", \"config\", \"config\"]");
	r = kvdctl(f.socket, "tenants");
	ASSERT_FALSE(strstr(r->out, "* set live"));

	/* A tenant the file does not name goes back to the defaults, and stays known. */
	ASSERT_EXIT(kvdctl(f.socket, "tenant set gamma --min 2M --max 4M --weight 7"), 0);
	r = kvdctl(f.socket, "tenant reset gamma");
	ASSERT_EXIT(r, 0);
	ASSERT_STREQ(r->out, "tenant gamma reset: min 0 B (default), max none (default), weight 1 "
			     "(default), policy kvd (default), tier drop (default), recall 0 (default)\n");
	r = kvdctl(f.socket, "tenants --json");
	ASSERT_JSON(r->out, TENANT_VALUES("gamma"), "[0, null, 1]");

	r = kvdctl(f.socket, "tenant reset nosuch");
	ASSERT_EXIT(r, 1);
	ASSERT_STREQ(r->out, "");
	ASSERT_CONTAINS(r->err, "kvdctl: tenant reset nosuch: ");

	/* delete: gamma holds nothing; llama is the config file's. */
	r = kvdctl(f.socket, "tenant delete gamma");
	ASSERT_EXIT(r, 0);
	ASSERT_STREQ(r->out, "tenant gamma deleted\n");
	r = kvdctl(f.socket, "tenants --json");
	ASSERT_JSON(r->out, "'gamma' in [t['name'] for t in d['tenants']]", "false");
	r = kvdctl(f.socket, "tenant delete gamma");
	ASSERT_EXIT(r, 1);
	ASSERT_CONTAINS(r->err, "kvdctl: tenant delete gamma: ");
	r = kvdctl(f.socket, "tenant delete llama");
	ASSERT_EXIT(r, 1);
	ASSERT_CONTAINS(r->err, "config file");

	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(change_not_saved_warns) {
	/* A state directory that cannot exist: changes apply but cannot be kept. */
	static const char *const args[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB",
		                            "--state-dir", "/dev/null/kvd-state", NULL };
	struct fixture f;
	struct run *r;
	const char *state_error;

	fixture_start(&f, args);
	r = kvdctl(f.socket, "budget set 8M");
	ASSERT_EXIT(r, 0);
	ASSERT_STREQ(r->out, "budget set: budget 8.0 MiB (8388608 bytes, source: live)\n");
	ASSERT_CONTAINS(r->err, "kvdctl: warning: budget set 8.0 MiB: ");
	ASSERT_CONTAINS(r->err, "not saved");
	r = kvdctl(f.socket, "tenant set a --min 1M");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->err, "kvdctl: warning: tenant set a: ");

	r = kvdctl(f.socket, "status --json");
	ASSERT_EXIT(r, 0);
	state_error = json_eval(r->out, "d['state_error']");
	ASSERT_CONTAINS(state_error, "/dev/null/kvd-state");
	r = kvdctl(f.socket, "status");
	ASSERT_CONTAINS(line_starting(r->out, "  live state "), "not saved, lost on restart: ");
	r = kvdctl(f.socket, "budget get");
	ASSERT_CONTAINS(line_starting(r->out, "state "), "/dev/null/kvd-state");
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(top_once) {
	struct fixture f;
	struct holder a, b;
	kvd_client *admin;
	struct run *r;
	char json[OUT_MAX];
	bool evicted;
	pid_t grower;

	fixture_start(&f, fixture_args);
	hold(&a, &f, "alpha", 3);
	hold(&b, &f, "beta", 1);
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_tenant_set(admin, "gamma", KVD_TENANT_KEEP, KVD_TENANT_KEEP, 0));
	{
		kvd_status *st;
		uint64_t v;

		ASSERT_OK(kvd_status_get(admin, &st));
		evicted = kvd_status_tenant_u64(st, 0, "evicted_bytes", &v) == 0;
		kvd_status_free(st);
	}

	/* One frame: no escape sequences, connected tenants with their share. */
	r = kvdctl(f.socket, "top --once --interval 0.2");
	ASSERT_EXIT(r, 0);
	ASSERT_STREQ(r->err, "");
	ASSERT_FALSE(strchr(r->out, '\033'));
	ASSERT_CONTAINS(r->out, "; rates over ");
	ASSERT_CONTAINS(line_starting(r->out, "budget "), "used 4.0 MiB = 33.3% of budget");
	ASSERT_CONTAINS(line_starting(r->out, "TENANT "), "EVICTED/s");
	ASSERT_CONTAINS(line_starting(r->out, "alpha "), "3.0 MiB");
	ASSERT_CONTAINS(line_starting(r->out, "alpha "), "25.0%");
	ASSERT_CONTAINS(line_starting(r->out, "beta "), "8.3%");
	ASSERT_CONTAINS(line_starting(r->out, "gamma "), "0 B");
	if (!evicted) {
		const char *l = line_starting(r->out, "alpha ");

		/* Not reported: "-", never a made-up number. */
		ASSERT_STREQ(l + strlen(l) - 2, " -");
	}

	/*
	 * Rates: gamma grows by 2 MiB between the two samples (taken 2 s apart; it grows 1 s
	 * in), so its rate times the measured interval is those 2 MiB.
	 */
	grower = fixture_fork();
	if (grower == 0) {
		struct timespec ts = { 1, 0 };
		struct holder g;

		nanosleep(&ts, NULL);
		hold(&g, &f, "gamma", 2);
		pause();
		_exit(0);
	}
	r = kvdctl(f.socket, "top --once --json --interval 2");
	kill(grower, SIGKILL);
	ASSERT_EQ(waitpid(grower, NULL, 0), grower);
	ASSERT_EXIT(r, 0);
	snprintf(json, sizeof(json), "%s", r->out);
	ASSERT_JSON(json, "[t['name'] for t in d['tenants']]", "[\"alpha\", \"beta\", \"gamma\"]");
	ASSERT_JSON(json, "d['budget_bytes']", "12582912");
	ASSERT_JSON(json, "d['tenants'][0]['used_bytes']", "3145728");
	ASSERT_JSON(json, "d['tenants'][0]['connections']", "1");
	ASSERT_JSON(json, "round(d['tenants'][0]['budget_share'], 4)", "0.25");
	ASSERT_JSON(json, "d['tenants'][0]['used_bytes_per_s']", "0.0");
	ASSERT_JSON(json, "d['tenants'][2]['used_bytes']", "2097152");
	ASSERT_JSON(json,
		    "abs(d['tenants'][2]['used_bytes_per_s'] * d['interval_s'] - 2097152) < 20972",
		    "true");
	ASSERT_JSON(json, "d['interval_s'] >= 2", "true");
	ASSERT_JSON(json, "d['grants_refused_per_s']", "0.0");
	if (!evicted)
		ASSERT_JSON(json, "[t['evicted_bytes_per_s'] for t in d['tenants']]", "[null, null, null]");

	unhold(&a);
	unhold(&b);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(top_live_on_a_pipe) {
	char *argv[] = { getenv("KVDCTL"), "--socket", NULL, "top", "--interval", "0.1", NULL };
	static struct run r;
	struct fixture f;
	struct holder a;
	struct proc p;
	size_t len = 0;

	fixture_start(&f, fixture_args);
	hold(&a, &f, "alpha", 1);
	argv[2] = f.socket;
	proc_start(&p, argv, NULL, -1);
	r.out[0] = 0;
	/* The second frame has rates; then SIGTERM ends it cleanly. */
	ASSERT_TRUE(proc_wait_output(&p, &p.out, &r, &len, "rates over", 10000));
	kill(p.pid, SIGTERM);
	proc_finish(&p, &p.out, NULL, &r, len);
	ASSERT_EXIT(&r, 0);
	ASSERT_FALSE(strchr(r.out, '\033'));
	ASSERT_CONTAINS(r.out, "rates from the next refresh");
	ASSERT_CONTAINS(r.out, "\nalpha ");

	unhold(&a);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* top on a terminal until Ctrl-C (SIGINT), or until q is typed. */
static void top_on_a_terminal(bool quit_key) {
	char *argv[] = { getenv("KVDCTL"), "--socket", NULL, "top", "--interval", "0.1", NULL };
	static struct run r;
	struct termios tio;
	struct fixture f;
	struct holder a;
	struct proc p;
	size_t len = 0;
	int master, slave;
	char *name;

	master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
	if (master < 0)
		TEST_SKIP("no pseudo-terminal here: %s", strerror(errno));
	ASSERT_OK(grantpt(master));
	ASSERT_OK(unlockpt(master));
	name = ptsname(master);
	ASSERT_NOT_NULL(name);
	slave = open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
	ASSERT_OK(slave);
	/* Wide enough for whole lines: kvdctl cuts them to the terminal's width. */
	ASSERT_OK(ioctl(master, TIOCSWINSZ, &(struct winsize){ .ws_row = 50, .ws_col = 200 }));

	fixture_start(&f, fixture_args);
	hold(&a, &f, "alpha", 1);
	argv[2] = f.socket;
	proc_start(&p, argv, NULL, slave);
	close(slave);
	r.out[0] = 0;
	ASSERT_TRUE(proc_wait_output(&p, &master, &r, &len, "rates over", 10000));
	/* Drawn in place: the cursor hidden, frames from the top left, lines cleared. */
	ASSERT_TRUE(strncmp(r.out, "\033[?25l\033[2J", 10) == 0);
	ASSERT_CONTAINS(r.out, "\033[H");
	ASSERT_CONTAINS(r.out, "\033[K");
	ASSERT_CONTAINS(r.out, "\nalpha ");
	/* Keys come unbuffered and unechoed while it runs. */
	ASSERT_OK(tcgetattr(master, &tio));
	ASSERT_FALSE(tio.c_lflag & (ICANON | ECHO));
	if (quit_key) {
		/* Another key changes nothing: frames go on until q. */
		ASSERT_EQ(write(master, "x", 1), 1);
		len = 0;
		r.out[0] = 0;
		ASSERT_TRUE(proc_wait_output(&p, &master, &r, &len, "rates over", 10000));
		ASSERT_EQ(write(master, "q", 1), 1);
	} else {
		kill(p.pid, SIGINT);
	}
	ASSERT_TRUE(proc_wait_output(&p, &master, &r, &len, "\033[?25h", 10000));
	/* The terminal's settings are given back before the cursor. */
	ASSERT_OK(tcgetattr(master, &tio));
	ASSERT_TRUE((tio.c_lflag & (ICANON | ECHO)) == (ICANON | ECHO));
	proc_finish(&p, &master, NULL, &r, len);
	ASSERT_EXIT(&r, 0);
	/* The cursor is given back, last. */
	ASSERT_TRUE(strstr(r.out, "\033[?25h") > strstr(r.out, "\nalpha "));

	unhold(&a);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(top_live_on_a_terminal) {
	top_on_a_terminal(false);
}

TEST(top_quits_on_q) {
	top_on_a_terminal(true);
}

/* ---- Standing warnings ---- */

TEST(standing_warnings) {
	static const char config[] = "[kvd]\npool-size = 16MiB\nchunk-size = 1MiB\nbudget = 8MiB\n"
	                             "[tenant alpha]\nmin = 6MiB\n[tenant beta]\nmin = 4MiB\n";
	static const char *const mins = "guaranteed minimums (10.0 MiB together) exceed the budget (8.0 MiB)";
	static const char *const cap = "tenant gamma: its cap (2.0 MiB) is below the 3.0 MiB it holds "
	                               "in sequences no round can evict";
	struct fixture f;
	struct holder g;
	struct run *r;

	fixture_setup(&f, config, true);
	fixture_launch(&f, NULL);
	/* Minimums above the budget: logged once at start, shown while they hold. */
	r = kvdctl(f.socket, "status");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "\n  warning: the tenants' ");
	ASSERT_CONTAINS(r->out, mins);
	r = kvdctl(f.socket, "status --json");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "\"warnings\": [\n    \"the tenants' ");
	ASSERT_EQ(fixture_log_count(&f, mins), 1u);
	ASSERT_EXIT(kvdctl(f.socket, "tenant set beta --min 0"), 0);
	r = kvdctl(f.socket, "status --json");
	ASSERT_EXIT(r, 0);
	ASSERT_NOT_CONTAINS(r->out, "\"warnings\"");

	/* A cap below what a tenant holds in sequences without an eviction unit. */
	hold(&g, &f, "gamma", 3);
	ASSERT_EXIT(kvdctl(f.socket, "tenant set gamma --max 2MiB"), 0);
	ASSERT_TRUE(fixture_wait_log(&f, cap, 1));
	r = kvdctl(f.socket, "status");
	ASSERT_CONTAINS(r->out, cap);
	r = kvdctl(f.socket, "top --once --interval 0.1");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, cap);
	/* Gone once it no longer holds them; logged only the once. */
	unhold(&g);
	r = kvdctl(f.socket, "status");
	ASSERT_NOT_CONTAINS(r->out, "warning:");
	ASSERT_EQ(fixture_log_count(&f, cap), 1u);
	ASSERT_EQ(fixture_stop(&f), 0);
}

static uint64_t physical_memory(void) {
	return (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
}

TEST(host_pool_above_memory_warns) {
	char pool[32];
	struct fixture f;
	struct run *r;

	/* Chunks are made at their first grant: a pool past memory costs nothing until used. */
	snprintf(pool, sizeof(pool), "%" PRIu64 "GiB", physical_memory() / (1u << 30) + 2);
	fixture_setup(&f, NULL, true);
	fixture_launch(&f, (const char *const[]){ "--backend", "host", "--pool-size", pool,
	                                          "--chunk-size", "1GiB", NULL });
	ASSERT_TRUE(fixture_wait_log(&f, "is larger than physical memory", 1));
	r = kvdctl(f.socket, "status");
	ASSERT_CONTAINS(r->out, "warning: the host pool (");
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* The warning a GPU node gets when auto falls back to host: on a machine with the NVIDIA
 * driver (KVD_TEST_NVIDIA_DRIVER names a file that exists), not on one without. */
static bool auto_falls_back(bool driver, bool *ret_warned) {
	struct fixture f;
	struct run *r;
	bool fell_back;

	fixture_setup(&f, NULL, true);
	ASSERT_OK(setenv("KVD_TEST_NVIDIA_DRIVER", driver ? "/proc/self/status" : "/nonexistent", 1));
	fixture_launch(&f, (const char *const[]){ "--backend", "auto", NULL });
	ASSERT_OK(unsetenv("KVD_TEST_NVIDIA_DRIVER"));
	r = kvdctl(f.socket, "status");
	ASSERT_EXIT(r, 0);
	fell_back = fixture_log_count(&f, "backend auto: no usable GPU") == 1;
	*ret_warned = strstr(r->out, "warning: this machine has the NVIDIA driver, but no usable GPU (") &&
	              fixture_log_count(&f, "this machine has the NVIDIA driver") == 1;
	ASSERT_EQ(fixture_stop(&f), 0);
	return fell_back;
}

TEST(gpu_node_fallback_warns) {
	bool warned;

	TEST_NEEDS_HOOKS();
	if (!auto_falls_back(true, &warned))
		TEST_SKIP("a usable GPU here: auto did not fall back");
	ASSERT_TRUE(warned);
	ASSERT_TRUE(auto_falls_back(false, &warned));
	ASSERT_FALSE(warned);
}

/* ---- The log ---- */

TEST(log_names_who_and_stays_quiet_for_kvdctl) {
	static const char config[] = "[kvd]\npool-size = 16MiB\nchunk-size = 1MiB\n"
	                             "[tenant alpha]\nmax = 2MiB\n";
	char want[256];
	struct fixture f;
	struct holder a;
	kvd_seq *extra;
	kvd_client *c;
	struct run *r;
	int m;

	fixture_setup(&f, config, true);
	fixture_launch(&f, NULL);
	for (int i = 0; i < 5; i++)
		ASSERT_EXIT(kvdctl(f.socket, "status"), 0);
	/* A tenant's hello, a grow refused at its cap, its disconnect: each with uid and pid. */
	hold(&a, &f, "alpha", 2);
	snprintf(want, sizeof(want), "hello from pid %d uid %u", (int)getpid(), (unsigned)getuid());
	ASSERT_TRUE(fixture_wait_log(&f, want, 1));
	c = fixture_connect(&f, "alpha");
	m = kvd_model_register(c, &one_chunk);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 2048, &extra));
	ASSERT_ERRNO(kvd_seq_grow(extra, 2048), -EDQUOT);
	snprintf(want, sizeof(want), "(pid %d, uid %u, tenant alpha): grow refused: tenant alpha "
	         "reached its max", (int)getpid(), (unsigned)getuid());
	ASSERT_TRUE(fixture_wait_log(&f, want, 1));
	kvd_seq_release(extra);
	kvd_client_unref(c);
	snprintf(want, sizeof(want), "(pid %d, uid %u, tenant alpha) disconnected", (int)getpid(),
	         (unsigned)getuid());
	ASSERT_TRUE(fixture_wait_log(&f, want, 1));
	/* Rounds are logged, one line each, with what they applied. */
	r = kvdctl(f.socket, "evict --tenant alpha --bytes 1MiB");
	ASSERT_EXIT(r, 0);
	/* It freed nothing, and says why: alpha's model has no eviction unit. */
	ASSERT_CONTAINS(r->out, "freed 0 B of 1.0 MiB requested");
	ASSERT_CONTAINS(r->out, "why: nothing to evict: no open sequence of tenant alpha");
	ASSERT_TRUE(fixture_wait_log(&f, "eviction round 1 (evict): target ", 1));
	unhold(&a);
	/* kvdctl's hellos are not there: 7 connections, 2 hellos logged (the tenant's). */
	ASSERT_EQ(fixture_log_count(&f, "hello from"), 2u);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* ---- Who holds what ---- */

TEST(connections_seqs_and_disconnect) {
	struct fixture f;
	struct holder a, b;
	char *p;
	struct run *r;
	unsigned long id;

	fixture_start(&f, fixture_args);
	hold(&a, &f, "alpha", 2);
	hold(&b, &f, "beta", 1);
	r = kvdctl(f.socket, "connections");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "TENANT");
	ASSERT_CONTAINS(r->out, "alpha");
	ASSERT_CONTAINS(r->out, "2.0 MiB");
	r = kvdctl(f.socket, "--json connections");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "\"tenant\": \"alpha\", \"process\": ");
	ASSERT_CONTAINS(r->out, "\"sequences\": 2, \"pinned\": 0, \"bytes\": 2097152");
	/* One tenant's sequences only. */
	r = kvdctl(f.socket, "seqs --tenant beta --json");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "\"tenant\": \"beta\", \"tokens\": 2048, \"max_tokens\": 2048");
	ASSERT_CONTAINS(r->out, "\"place\": \"pool\"");
	ASSERT_NOT_CONTAINS(r->out, "alpha");
	p = strstr(r->out, "\"connection\": ");
	ASSERT_NOT_NULL(p);
	id = strtoul(p + strlen("\"connection\": "), NULL, 10);
	ASSERT_EXIT(kvdctl(f.socket, "seqs --tenant nobody"), 1);
	/* Disconnect beta's connection: its sequence goes, alpha's stay. */
	r = kvdctl(f.socket, "disconnect %lu", id);
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "disconnected");
	ASSERT_TRUE(fixture_wait_status(&f, "beta", "sequences", 0));
	ASSERT_EQ(fixture_status(&f, "alpha", "sequences"), 2u);
	/* This process, which held beta's chunk, never said it unmapped it: the connection
	 * departed, listed, its chunk charged to beta until an operator ends that. */
	r = kvdctl(f.socket, "--json connections");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "\"tenant\": \"beta\"");
	ASSERT_CONTAINS(r->out, "\"departed\": 1, \"chunks\": 1");
	ASSERT_EQ(fixture_status(&f, "beta", "used_bytes"), 1u << 20);
	r = kvdctl(f.socket, "disconnect %lu", id);
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "the charge of its 1 chunks ended");
	ASSERT_EQ(fixture_status(&f, "beta", "used_bytes"), 0u);
	ASSERT_EXIT(kvdctl(f.socket, "disconnect %lu", id), 1);
	ASSERT_EXIT(kvdctl(f.socket, "disconnect"), 2);
	ASSERT_EXIT(kvdctl(f.socket, "disconnect 12x"), 2);
	/* The handle of a sequence the daemon dropped: released here, whatever it says. */
	(void)kvd_seq_release(b.s[0]);
	kvd_client_unref(b.c);
	unhold(&a);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* ---- Changes that evict ---- */

TEST(budget_percent_floor_and_dry_run) {
	struct fixture f;
	struct holder a;
	struct run *r;

	fixture_start(&f, fixture_args);
	hold(&a, &f, "alpha", 2);
	r = kvdctl(f.socket, "budget set 50%%");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "8.0 MiB");
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 8u << 20);
	ASSERT_EXIT(kvdctl(f.socket, "budget set 101%%"), 2);
	ASSERT_EXIT(kvdctl(f.socket, "budget set 0%%"), 2);
	/* Below the floor (one chunk here): refused unless forced. */
	r = kvdctl(f.socket, "budget set 4KiB");
	ASSERT_EXIT(r, 1);
	ASSERT_CONTAINS(r->err, "below the floor of 1.0 MiB");
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 8u << 20);
	/* A dry run changes nothing and says what it would take (nothing evictable here). */
	r = kvdctl(f.socket, "budget set 4MiB --dry-run");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "dry run: budget set 4.0 MiB would evict nothing now");
	ASSERT_CONTAINS(r->out, "nothing was changed");
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 8u << 20);
	r = kvdctl(f.socket, "tenant set alpha --max 1MiB --dry-run");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "dry run: tenant set alpha would evict nothing now");
	ASSERT_EQ(fixture_status(&f, "alpha", "max_bytes"), KVD_TENANT_NO_CAP);
	r = kvdctl(f.socket, "evict --tenant alpha --dry-run");
	ASSERT_EXIT(r, 0);
	ASSERT_CONTAINS(r->out, "dry run: evict --tenant alpha would evict nothing now");
	ASSERT_EXIT(kvdctl(f.socket, "status --dry-run"), 2);
	ASSERT_EXIT(kvdctl(f.socket, "budget reset --force"), 2);
	ASSERT_EXIT(kvdctl(f.socket, "tenant reset alpha --dry-run"), 2);
	ASSERT_EXIT(kvdctl(f.socket, "budget set 4KiB --force"), 0);
	ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 4096u);
	unhold(&a);
	ASSERT_EQ(fixture_stop(&f), 0);
}
