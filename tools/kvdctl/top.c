/* SPDX-License-Identifier: MIT */
/*
 * kvdctl top: a live view of what each tenant holds and how fast that changes.
 *
 * Every INTERVAL seconds it takes a status snapshot and draws a frame: the node (budget and
 * where it comes from, use, refusals) and one row per tenant with its use, its share of the
 * budget, and rates computed between this snapshot and the last one: the change of USED,
 * and the daemon's per-tenant counters (grants, refusals, evicted bytes) where the daemon
 * reports them. A rate is never made up: it is "-" (null in JSON) when the daemon does not
 * report the counter, when there is no earlier snapshot of that tenant, or when a counter
 * went backwards (the daemon restarted).
 *
 * On a terminal, frames are redrawn in place with plain ANSI sequences (cursor home, clear
 * to end of line and of screen; the cursor is hidden meanwhile), cut to the terminal's size;
 * SIGINT and SIGTERM end the loop and give the cursor back (a second signal does it at once,
 * should a request hang). Elsewhere frames follow one another, separated by a blank line. A
 * lost daemon is retried every interval. --once samples twice, INTERVAL apart, prints one
 * frame without any escape sequence (or one JSON object) and exits.
 */

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "basic/macro.h"
#include "basic/size.h"
#include "kvdctl.h"

#define INTERVAL_DEFAULT 2.0
#define INTERVAL_MIN 0.1
#define INTERVAL_MAX 3600.0

static double arg_interval = INTERVAL_DEFAULT;
static int arg_once;

static volatile sig_atomic_t quit_signal;

/* A status snapshot and when it arrived. */
struct sample {
	kvd_status *st;
	uint64_t usec; /* CLOCK_MONOTONIC */
};

static void sample_clear(struct sample *s) {
	s->st = kvd_status_free(s->st);
	s->usec = 0;
}

/* Two samples to draw: cur, and prev (st NULL when there is none to compare with). */
struct frame {
	const struct sample *prev, *cur;
	double dt; /* seconds between them; 0 when rates cannot be computed */
};

static uint64_t now_usec(void) {
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static int sample_take(kvd_client *c, struct sample *ret) {
	kvd_status *st;
	int r;

	r = kvd_status_get(c, &st);
	if (r < 0)
		return r;
	sample_clear(ret);
	ret->st = st;
	ret->usec = now_usec();
	return 0;
}

static void frame_init(struct frame *fr, const struct sample *prev, const struct sample *cur) {
	uint64_t up0, up1;

	*fr = (struct frame){ .prev = prev, .cur = cur };
	if (!prev || !prev->st || cur->usec <= prev->usec)
		return;
	/* A daemon that restarted between the samples (its uptime went back) has new counters. */
	if (status_u64(prev->st, "uptime_ms", &up0) == 0 &&
	    status_u64(cur->st, "uptime_ms", &up1) == 0 && up1 < up0)
		return;
	fr->dt = (double)(cur->usec - prev->usec) / 1e6;
}

/*
 * Per-second change of key between the two samples, for the whole node (tenant NULL) or
 * one tenant. Counters only grow: one that went back cannot be compared. With gauge, the
 * value may go either way and the rate is signed. Returns 0 and the rate, or 1 when it
 * cannot be computed.
 */
static int rate(const struct frame *fr, const char *tenant, const char *key, int gauge,
		double *ret) {
	uint64_t a, b;
	uint32_t t0, t1;

	if (fr->dt <= 0)
		return 1;
	if (!tenant) {
		if (status_u64(fr->prev->st, key, &a) != 0 || status_u64(fr->cur->st, key, &b) != 0)
			return 1;
	} else if (tenant_find(fr->prev->st, tenant, &t0) < 0 ||
		   tenant_find(fr->cur->st, tenant, &t1) < 0 ||
		   status_tenant_u64(fr->prev->st, t0, key, &a) != 0 ||
		   status_tenant_u64(fr->cur->st, t1, key, &b) != 0)
		return 1;
	if (b < a && !gauge)
		return 1;
	*ret = b >= a ? (double)(b - a) / fr->dt : -((double)(a - b) / fr->dt);
	return 0;
}

/* "+1.5 MiB", "-512 B", "0 B". */
static void fmt_size_rate(double v, char *buf, size_t n) {
	char s[32];

	if (v > -0.5 && v < 0.5) {
		snprintf(buf, n, "0 B");
		return;
	}
	size_format((uint64_t)llround(fabs(v)), s, sizeof(s));
	snprintf(buf, n, "%c%s", v < 0 ? '-' : '+', s);
}

/* ---- Text ---- */

enum {
	TOP_NAME,
	TOP_USED,
	TOP_PCT,
	TOP_USED_RATE,
	TOP_MAX,
	TOP_SEQS,
	TOP_CONNS,
	TOP_GRANTS,
	TOP_REFUSED,
	TOP_EVICTED,
	TOP_TIER,
	TOP_CACHED,
	TOP_HITS,
	TOP_COLS,
};

static const char *const top_title[TOP_COLS] = {
	"TENANT", "USED", "%BUDGET", "USED/s", "MAX", "SEQS", "CONNS", "GRANTS/s", "REFUSED/s",
	"EVICTED/s", "HOST TIER", "CACHED", "HIT%",
};

static int top_row(const struct frame *fr, uint32_t t, uint64_t budget, char (*cells)[CELL_MAX]) {
	const kvd_status *st = fr->cur->st;
	const char *name;
	uint64_t v;
	double x = 0;
	int r;

	r = kvd_status_tenant_name(st, t, &name);
	if (r < 0)
		return r;
	snprintf(cells[TOP_NAME], CELL_MAX, "%s", name);

	r = status_tenant_u64(st, t, "used_bytes", &v);
	if (r < 0)
		return r;
	if (r > 0) {
		snprintf(cells[TOP_USED], CELL_MAX, "-");
		snprintf(cells[TOP_PCT], CELL_MAX, "-");
	} else {
		size_format(v, cells[TOP_USED], CELL_MAX);
		fmt_percent(v, budget, cells[TOP_PCT], CELL_MAX);
	}
	if (rate(fr, name, "used_bytes", 1, &x) == 0)
		fmt_size_rate(x, cells[TOP_USED_RATE], CELL_MAX);
	else
		snprintf(cells[TOP_USED_RATE], CELL_MAX, "-");

	r = status_tenant_u64(st, t, "max_bytes", &v);
	if (r < 0)
		return r;
	if (r > 0 || v == KVD_TENANT_NO_CAP)
		snprintf(cells[TOP_MAX], CELL_MAX, "-");
	else
		size_format(v, cells[TOP_MAX], CELL_MAX);

	{
		static const struct {
			int col;
			const char *key;
		} counts[] = { { TOP_SEQS, "sequences" }, { TOP_CONNS, "connections" } };

		for (size_t i = 0; i < ELEMENTSOF(counts); i++) {
			r = status_tenant_u64(st, t, counts[i].key, &v);
			if (r < 0)
				return r;
			if (r > 0)
				snprintf(cells[counts[i].col], CELL_MAX, "-");
			else
				snprintf(cells[counts[i].col], CELL_MAX, "%" PRIu64, v);
		}
	}

	if (rate(fr, name, "grants", 0, &x) == 0)
		snprintf(cells[TOP_GRANTS], CELL_MAX, "%.1f", x);
	else
		snprintf(cells[TOP_GRANTS], CELL_MAX, "-");
	if (rate(fr, name, "grants_refused", 0, &x) == 0)
		snprintf(cells[TOP_REFUSED], CELL_MAX, "%.1f", x);
	else
		snprintf(cells[TOP_REFUSED], CELL_MAX, "-");
	if (rate(fr, name, "evicted_bytes", 0, &x) == 0)
		size_format((uint64_t)llround(x), cells[TOP_EVICTED], CELL_MAX);
	else
		snprintf(cells[TOP_EVICTED], CELL_MAX, "-");
	/* What its sequences moved out hold of the host tier, outside the budget. */
	if (status_tenant_u64(st, t, "tier_bytes", &v) == 0)
		size_format(v, cells[TOP_TIER], CELL_MAX);
	else
		snprintf(cells[TOP_TIER], CELL_MAX, "-");
	/* Its prefix cache, and the share of its prefix opens that found blocks (since the
	 * start; "-" before any). */
	if (status_tenant_u64(st, t, "cached_bytes", &v) == 0)
		size_format(v, cells[TOP_CACHED], CELL_MAX);
	else
		snprintf(cells[TOP_CACHED], CELL_MAX, "-");
	{
		uint64_t hits, misses;

		if (status_tenant_u64(st, t, "prefix_hits", &hits) == 0 &&
		    status_tenant_u64(st, t, "prefix_misses", &misses) == 0 && hits + misses > 0)
			snprintf(cells[TOP_HITS], CELL_MAX, "%.0f", 100.0 * hits / (hits + misses));
		else
			snprintf(cells[TOP_HITS], CELL_MAX, "-");
	}
	return 0;
}

static int top_text(FILE *f, const void *userdata) {
	const struct frame *fr = userdata;
	const kvd_status *st = fr->cur->st;
	_cleanup_(freep) char (*cells)[CELL_MAX] = NULL;
	_cleanup_(freep) uint32_t *order = NULL;
	uint32_t n = kvd_status_tenants(st);
	uint64_t budget = 0, pool = 0, v;
	const char *s;
	char a[CELL_MAX], b[CELL_MAX];
	double x = 0;
	int r;

	(void)status_u64(st, "budget_bytes", &budget);
	(void)status_u64(st, "pool_bytes", &pool);

	/* Line 1: the daemon, and what the rates cover. */
	fprintf(f, "kvd %s at %s", status_str(st, "daemon_version", &s) == 0 ? s : "?", arg_socket);
	if (status_str(st, "backend", &s) == 0)
		fprintf(f, ", backend %s", s);
	if (status_u64(st, "uptime_ms", &v) == 0) {
		fmt_uptime(v, a, sizeof(a));
		fprintf(f, ", up %s", a);
	}
	if (!arg_once) {
		time_t now = time(NULL);
		struct tm tm;

		if (localtime_r(&now, &tm) && strftime(a, sizeof(a), "%H:%M:%S", &tm) > 0)
			fprintf(f, "; %s", a);
	}
	if (fr->dt > 0)
		fprintf(f, "; rates over %.1fs\n", fr->dt);
	else
		fprintf(f, "; rates from the next refresh\n");

	/* Line 2: budget and use. */
	if (status_u64(st, "budget_bytes", &v) == 0)
		fprintf(f, "budget %s", size_format(v, a, sizeof(a)));
	else
		fprintf(f, "budget -");
	fprintf(f, " (source: %s)", status_str(st, "budget_source", &s) == 0 && *s ? s : "-");
	if (status_u64(st, "used_bytes", &v) == 0)
		fprintf(f, ", used %s = %s of budget", size_format(v, a, sizeof(a)),
			fmt_percent(v, budget, b, sizeof(b)));
	if (status_u64(st, "block_bytes", &v) == 0)
		fprintf(f, ", in blocks %s", size_format(v, a, sizeof(a)));
	if (pool)
		fprintf(f, ", pool %s", size_format(pool, a, sizeof(a)));
	if (status_u64(st, "host_tier_bytes", &v) == 0 && v > 0) {
		uint64_t held = 0;

		(void)status_u64(st, "host_tier_used_bytes", &held);
		fprintf(f, ", host tier %s of %s", size_format(held, a, sizeof(a)),
			size_format(v, b, sizeof(b)));
	}
	if (status_u64(st, "file_tier_bytes", &v) == 0 && v > 0) {
		uint64_t held = 0;

		(void)status_u64(st, "file_tier_used_bytes", &held);
		fprintf(f, ", file tier %s of %s", size_format(held, a, sizeof(a)),
			size_format(v, b, sizeof(b)));
	}
	fputc('\n', f);
	if (status_str(st, "state_error", &s) == 0 && *s)
		fprintf(f, "warning: live changes are not saved (lost on restart): %s\n", s);
	warnings_lines(f, st, "");

	/* Line 3: connections and the node's counters, with rates where they can be had. */
	if (status_u64(st, "connections", &v) == 0)
		fprintf(f, "connections %" PRIu64, v);
	else
		fprintf(f, "connections -");
	{
		static const struct {
			const char *key, *label;
			int size;
		} counters[] = {
			{ "grants", "grants", 0 },
			{ "grants_refused", "grants refused", 0 },
			{ "evicted_bytes", "evicted", 1 },
			{ "rounds_total", "eviction rounds", 0 },
		};

		for (size_t i = 0; i < ELEMENTSOF(counters); i++) {
			if (status_u64(st, counters[i].key, &v) != 0)
				continue;
			if (counters[i].size)
				fprintf(f, ", %s %s", counters[i].label, size_format(v, a, sizeof(a)));
			else
				fprintf(f, ", %s %" PRIu64, counters[i].label, v);
			if (rate(fr, NULL, counters[i].key, 0, &x) == 0) {
				if (counters[i].size)
					fprintf(f, " (%s/s)", size_format((uint64_t)llround(x), a, sizeof(a)));
				else
					fprintf(f, " (%.1f/s)", x);
			}
		}
	}
	if (status_u64(st, "protocol_errors", &v) == 0)
		fprintf(f, ", protocol errors %" PRIu64, v);
	fputs("\n\n", f);

	if (n == 0) {
		fprintf(f, "No tenants.\n");
		return 0;
	}
	r = tenant_order(st, &order);
	if (r < 0)
		return r;
	cells = calloc((size_t)n * TOP_COLS, sizeof(*cells));
	if (!cells)
		return -ENOMEM;
	for (uint32_t i = 0; i < n; i++) {
		r = top_row(fr, order[i], budget, cells + (size_t)i * TOP_COLS);
		if (r < 0)
			return r;
	}

	/* Per-tenant grant and refusal columns only once the daemon counts them per tenant;
	 * the eviction column always, so that "-" says plainly that it is not reported yet. */
	{
		int grants = tenants_report(st, "grants"), refused = tenants_report(st, "grants_refused");
		_cleanup_(freep) char (*packed)[CELL_MAX] = NULL;
		const char *titles[TOP_COLS];
		size_t keep[TOP_COLS], k = 0;

		for (size_t c = 0; c < TOP_COLS; c++)
			if ((c != TOP_GRANTS || grants) && (c != TOP_REFUSED || refused))
				keep[k++] = c;
		packed = calloc((size_t)n * k, sizeof(*packed));
		if (!packed)
			return -ENOMEM;
		for (size_t c = 0; c < k; c++)
			titles[c] = top_title[keep[c]];
		for (uint32_t i = 0; i < n; i++)
			for (size_t c = 0; c < k; c++)
				memcpy(packed[(size_t)i * k + c], cells[(size_t)i * TOP_COLS + keep[c]],
				       CELL_MAX);
		table_print(f, &(struct table){
					.n_cols = k,
					.n_rows = n,
					.titles = titles,
					.cells = packed,
				});
	}
	return 0;
}

/* ---- JSON ---- */

/* Writes ",\n<indent>"key": <rate or null>" for rate(fr, tenant, key, gauge). */
static void json_rate(FILE *f, const struct frame *fr, const char *tenant, const char *key,
		      int gauge, const char *member, int indent) {
	double x;

	if (rate(fr, tenant, key, gauge, &x) == 0)
		fprintf(f, ",\n%*s\"%s\": %.3f", indent, "", member, x);
	else
		fprintf(f, ",\n%*s\"%s\": null", indent, "", member);
}

static int top_json(FILE *f, const void *userdata) {
	static const char *const node_u64[] = {
		"pool_bytes",  "budget_bytes",   "used_bytes",     "block_bytes",     "connections",
		"uptime_ms",   "grants",         "grants_refused", "protocol_errors", "evicted_bytes",
		"rounds_total", "last_round_us", "host_tier_bytes", "host_tier_used_bytes",
	};
	static const char *const node_str[] = {
		"daemon_version",
		"backend",
		"budget_source",
		"state_error",
	};
	static const char *const tenant_u64[] = {
		"used_bytes", "block_bytes", "min_bytes",      "max_bytes",     "weight",
		"sequences",  "connections", "grants",         "grants_refused", "evicted_bytes",
		"evicted_tokens", "rounds", "tier_bytes",
	};
	const struct frame *fr = userdata;
	const kvd_status *st = fr->cur->st;
	_cleanup_(freep) uint32_t *order = NULL;
	uint32_t n = kvd_status_tenants(st);
	uint64_t budget = 0;
	int r;

	r = tenant_order(st, &order);
	if (r < 0)
		return r;
	(void)status_u64(st, "budget_bytes", &budget);

	fprintf(f, "{\n");
	r = node_json_write(f, st, node_u64, ELEMENTSOF(node_u64), node_str, ELEMENTSOF(node_str));
	if (r < 0)
		return r;
	if (fr->dt > 0)
		fprintf(f, ",\n  \"interval_s\": %.3f", fr->dt);
	else
		fprintf(f, ",\n  \"interval_s\": null");
	json_rate(f, fr, NULL, "grants", 0, "grants_per_s", 2);
	json_rate(f, fr, NULL, "grants_refused", 0, "grants_refused_per_s", 2);
	json_rate(f, fr, NULL, "evicted_bytes", 0, "evicted_bytes_per_s", 2);
	json_rate(f, fr, NULL, "rounds_total", 0, "rounds_per_s", 2);

	fprintf(f, ",\n  \"tenants\": [");
	for (uint32_t j = 0; j < n; j++) {
		uint32_t t = order[j];
		const char *name;
		uint64_t v;

		r = kvd_status_tenant_name(st, t, &name);
		if (r < 0)
			return r;
		fprintf(f, "%s\n    {\n      \"name\": ", j ? "," : "");
		json_string(f, name);
		for (size_t i = 0; i < ELEMENTSOF(tenant_u64); i++) {
			r = status_tenant_u64(st, t, tenant_u64[i], &v);
			if (r < 0)
				return r;
			if (r > 0)
				continue;
			if (strcmp(tenant_u64[i], "max_bytes") == 0 && v == KVD_TENANT_NO_CAP)
				fprintf(f, ",\n      \"%s\": null", tenant_u64[i]);
			else
				fprintf(f, ",\n      \"%s\": %" PRIu64, tenant_u64[i], v);
		}
		r = status_tenant_u64(st, t, "used_bytes", &v);
		if (r < 0)
			return r;
		if (r == 0 && budget > 0)
			fprintf(f, ",\n      \"budget_share\": %.6f", (double)v / (double)budget);
		else
			fprintf(f, ",\n      \"budget_share\": null");
		json_rate(f, fr, name, "used_bytes", 1, "used_bytes_per_s", 6);
		json_rate(f, fr, name, "grants", 0, "grants_per_s", 6);
		json_rate(f, fr, name, "grants_refused", 0, "grants_refused_per_s", 6);
		json_rate(f, fr, name, "evicted_bytes", 0, "evicted_bytes_per_s", 6);
		fprintf(f, "\n    }");
	}
	fprintf(f, "%s]\n}\n", n ? "\n  " : "");
	return 0;
}

/* ---- The terminal ---- */

#define ESC_HIDE_CURSOR "\033[?25l"
#define ESC_SHOW_CURSOR "\033[?25h"
#define ESC_HOME "\033[H"
#define ESC_CLEAR_SCREEN "\033[2J"
#define ESC_CLEAR_LINE_END "\033[K"
#define ESC_CLEAR_SCREEN_END "\033[J"

/* Whether frames are drawn in place on a terminal (the cursor is hidden meanwhile). */
static int screen;
/* Whether keys are read from a terminal on stdin, unbuffered and unechoed meanwhile: its
 * settings before, to give back. */
static int keys;
static struct termios keys_saved;

static void on_signal(int sig) {
	/* The first signal ends the loop after the current step. A second one means that step
	 * hangs (a daemon that does not answer): give the terminal back and leave now. */
	if (quit_signal) {
		static const char restore[] = ESC_SHOW_CURSOR "\n";

		if (keys)
			(void)tcsetattr(STDIN_FILENO, TCSANOW, &keys_saved);
		if (screen)
			(void)!write(STDOUT_FILENO, restore, sizeof(restore) - 1);
		_exit(128 + sig);
	}
	quit_signal = sig;
}

/* Reads keys one at a time from a terminal on stdin (q quits), leaving Ctrl-C to the
 * terminal's signals. */
static void keys_begin(void) {
	struct termios t;

	if (!isatty(STDIN_FILENO) || tcgetattr(STDIN_FILENO, &keys_saved) < 0)
		return;
	t = keys_saved;
	t.c_lflag &= ~(tcflag_t)(ICANON | ECHO);
	t.c_cc[VMIN] = 1;
	t.c_cc[VTIME] = 0;
	keys = tcsetattr(STDIN_FILENO, TCSANOW, &t) == 0;
}

static void keys_end(void) {
	if (keys)
		(void)tcsetattr(STDIN_FILENO, TCSANOW, &keys_saved);
	keys = 0;
}

/* Takes the keys typed so far: q (or Q) quits; others are ignored. */
static void keys_read(void) {
	char b[64];
	ssize_t n = read(STDIN_FILENO, b, sizeof(b));

	if (n == 0)
		keys_end(); /* the terminal hung up: nothing more to read */
	for (ssize_t i = 0; i < n; i++)
		if (b[i] == 'q' || b[i] == 'Q')
			quit_signal = SIGTERM;
}

/*
 * Draws text over the previous frame: cursor home, each line cut to the width and followed
 * by clear-to-end-of-line, then clear-to-end-of-screen; lines past the height are left out
 * with a note, so that the screen never scrolls and the next frame lands in place.
 */
static void screen_draw(const char *buf, size_t size) {
	const char *p = buf, *end = buf + size;
	size_t rows = 24, cols = 80, lines = 0, shown = 0;
	struct winsize ws;

	if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_row > 1 && ws.ws_col > 1) {
		rows = ws.ws_row;
		cols = ws.ws_col;
	}
	for (const char *q = buf; q < end; q++)
		lines += *q == '\n';
	if (size > 0 && end[-1] != '\n')
		lines++;

	fputs(ESC_HOME, stdout);
	while (p < end) {
		const char *nl = memchr(p, '\n', (size_t)(end - p));
		size_t len = nl ? (size_t)(nl - p) : (size_t)(end - p);

		if (lines > rows - 1 && shown == rows - 2) {
			char note[CELL_MAX];
			int k = snprintf(note, sizeof(note), "... %zu more lines (a larger terminal shows them)",
					 lines - shown);

			fwrite(note, 1, MIN((size_t)k, cols - 1), stdout);
			fputs(ESC_CLEAR_LINE_END "\n", stdout);
			break;
		}
		/* One column short of the width: a full line would leave the cursor pending a
		 * wrap, where clear-to-end-of-line erases the last character. */
		fwrite(p, 1, MIN(len, cols - 1), stdout);
		fputs(ESC_CLEAR_LINE_END "\n", stdout);
		shown++;
		p = nl ? nl + 1 : end;
	}
	fputs(ESC_CLEAR_SCREEN_END, stdout);
	fflush(stdout);
}

/* ---- The loop ---- */

/* Renders into a new buffer (free it): 0, or a negative errno. */
static int render(int (*write_fn)(FILE *f, const void *userdata), const void *userdata,
		  char **ret_buf, size_t *ret_size) {
	_cleanup_(freep) char *buf = NULL;
	size_t size = 0;
	FILE *f;
	int r;

	f = open_memstream(&buf, &size);
	if (!f)
		return negative_errno();
	r = write_fn(f, userdata);
	if (fclose(f) != 0 && r >= 0)
		r = -ENOMEM;
	if (r < 0)
		return r;
	*ret_buf = TAKE_PTR(buf);
	*ret_size = size;
	return 0;
}

/* Sleeps until deadline (CLOCK_MONOTONIC, usec); returns early when a signal or q asks to
 * quit. */
static void sleep_until(uint64_t deadline) {
	struct timespec ts = {
		.tv_sec = (time_t)(deadline / 1000000u),
		.tv_nsec = (long)(deadline % 1000000u) * 1000,
	};

	while (!quit_signal && keys) {
		uint64_t now = now_usec();
		struct timespec left;
		struct pollfd pfd = { .fd = STDIN_FILENO, .events = POLLIN };

		if (now >= deadline)
			return;
		left = (struct timespec){ .tv_sec = (time_t)((deadline - now) / 1000000u),
			                  .tv_nsec = (long)((deadline - now) % 1000000u) * 1000 };
		if (ppoll(&pfd, 1, &left, NULL) > 0)
			keys_read();
	}
	while (!quit_signal && clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
		;
}

static uint64_t interval_usec(void) {
	return (uint64_t)llround(arg_interval * 1e6);
}

static int top_once(kvd_client *c) {
	struct sample s[2] = {};
	struct frame fr;
	int r;

	r = sample_take(c, &s[0]);
	if (r >= 0) {
		sleep_until(s[0].usec + interval_usec());
		r = sample_take(c, &s[1]);
	}
	if (r < 0) {
		sample_clear(&s[0]);
		return request_error(c, r, "top");
	}
	frame_init(&fr, &s[0], &s[1]);
	r = output_emit(arg_json ? top_json : top_text, &fr);
	sample_clear(&s[0]);
	sample_clear(&s[1]);
	if (r < 0) {
		fprintf(stderr, "kvdctl: top: cannot read the daemon's answer: %s\n", strerror(-r));
		return EXIT_FAIL;
	}
	return output_flush();
}

/* Shows why there is no frame this time: on the screen in place of one, else on stderr. */
static void top_problem(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void top_problem(const char *fmt, ...) {
	char msg[512];
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(msg, sizeof(msg) - 1, fmt, ap);
	va_end(ap);
	if (n < 0)
		return;
	n = MIN(n, (int)sizeof(msg) - 2);
	n += snprintf(msg + n, sizeof(msg) - (size_t)n, "; retrying every %gs\n", arg_interval);
	n = MIN(n, (int)sizeof(msg) - 1);
	if (screen)
		screen_draw(msg, (size_t)n);
	else
		fprintf(stderr, "kvdctl: top: %s", msg);
}

static int top_loop(kvd_client *c) {
	struct sigaction sa = { .sa_handler = on_signal };
	struct sample s[2] = {};
	int cur = 0, have_prev = 0, rc = EXIT_OK;
	uint64_t next = now_usec();

	/* No SA_RESTART: the sleep between frames must end at once. */
	sigemptyset(&sa.sa_mask);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);

	screen = isatty(STDOUT_FILENO);
	if (screen) {
		keys_begin();
		fputs(ESC_HIDE_CURSOR ESC_CLEAR_SCREEN, stdout);
		fflush(stdout);
	}

	kvd_client_ref(c);
	while (!quit_signal) {
		_cleanup_(freep) char *buf = NULL;
		size_t size = 0;
		struct frame fr;
		int r;

		if (!c) {
			r = kvd_client_connect(arg_socket, NULL, &c);
			if (r < 0) {
				c = NULL;
				top_problem("cannot connect to kvd at %s: %s", arg_socket, strerror(-r));
				goto next;
			}
		}
		r = sample_take(c, &s[cur]);
		if (r < 0) {
			const char *msg = kvd_client_last_error(c);

			top_problem("lost kvd at %s: %s%s%s", arg_socket, strerror(-r),
				    *msg ? ": " : "", msg);
			c = kvd_client_unref(c);
			have_prev = 0;
			goto next;
		}
		frame_init(&fr, have_prev ? &s[!cur] : NULL, &s[cur]);
		r = render(top_text, &fr, &buf, &size);
		if (r < 0) {
			top_problem("cannot read the daemon's answer: %s", strerror(-r));
			have_prev = 0;
			goto next;
		}
		if (screen)
			screen_draw(buf, size);
		else {
			fwrite(buf, 1, size, stdout);
			fputc('\n', stdout);
			if (output_flush() != EXIT_OK) {
				rc = EXIT_FAIL;
				break;
			}
		}
		have_prev = 1;
		cur = !cur;
	next:
		/* Keep the cadence; after a slow step, wait a whole interval rather than race. */
		next += interval_usec();
		if (next <= now_usec())
			next = now_usec() + interval_usec();
		sleep_until(next);
	}

	if (screen) {
		keys_end();
		fputs(ESC_SHOW_CURSOR, stdout);
		fflush(stdout);
	}
	kvd_client_unref(c);
	sample_clear(&s[0]);
	sample_clear(&s[1]);
	return rc;
}

/* Parses SECONDS: a finite decimal number in [INTERVAL_MIN, INTERVAL_MAX]. */
static int parse_interval(const char *s, double *ret) {
	char *end;
	double v;

	errno = 0;
	v = strtod(s, &end);
	if (errno != 0 || end == s || *end || !isfinite(v) || v < INTERVAL_MIN || v > INTERVAL_MAX)
		return -EINVAL;
	*ret = v;
	return 0;
}

int cmd_top(int argc, char **argv) {
	static const struct option options[] = {
		{ "interval", required_argument, NULL, 'i' },
		{ "once", no_argument, NULL, 'o' },
		{ "json", no_argument, NULL, 'j' },
		{ "socket", required_argument, NULL, 's' },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	int opt, r;

	optind = 0;
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case 'i':
			if (parse_interval(optarg, &arg_interval) < 0)
				return usage_error("top: --interval: '%s' is not a number of seconds "
						   "in %g..%g",
						   optarg, INTERVAL_MIN, INTERVAL_MAX);
			break;
		case 'o':
			arg_once = 1;
			break;
		case 'j':
			arg_json = 1;
			break;
		case 's':
			arg_socket = optarg;
			break;
		case 'h':
			help();
			return EXIT_OK;
		default:
			return usage_error("top: bad option");
		}
	if (optind < argc)
		return usage_error("top: unexpected argument '%s'", argv[optind]);
	if (arg_json && !arg_once)
		return usage_error("top: --json needs --once (it prints one JSON object)");

	r = connect_admin(&c);
	if (r != EXIT_OK)
		return r;
	return arg_once ? top_once(c) : top_loop(c);
}
