/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <fcntl.h>
#include <ini.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "inifile.h"

struct inifile_stream {
	FILE *f;
	struct inifile_ctx ctx;
	const struct inifile_ops *ops;
	size_t bytes, max_bytes;
	bool stop;                    /* the file is too big or not text: read no further */
	bool have_section;
	bool bad_section;             /* the current section was rejected: skip its keys */
	char section[INI_MAX_LINE];
};

void inifile_error(struct inifile_errors *e, const char *path, unsigned line, const char *fmt, ...) {
	char what[512];
	va_list ap;
	int r;

	if (e->n >= INIFILE_ERRORS_MAX) {
		e->dropped++;
		return;
	}
	va_start(ap, fmt);
	vsnprintf(what, sizeof(what), fmt, ap);
	va_end(ap);
	if (line > 0)
		r = asprintf(&e->msg[e->n], "%s:%u: %s", path, line, what);
	else
		r = asprintf(&e->msg[e->n], "%s: %s", path, what);
	if (r < 0) {
		e->msg[e->n] = NULL;
		e->dropped++;
		return;
	}
	e->n++;
}

unsigned inifile_errors_count(const struct inifile_errors *e) {
	return e->n + e->dropped;
}

void inifile_errors_done(struct inifile_errors *e) {
	for (unsigned i = 0; i < e->n; i++)
		free(e->msg[i]);
	*e = (struct inifile_errors){};
}

static char *blank_line(char *str) {
	strcpy(str, "\n");
	return str;
}

/* Whether the rest of a line is blank or a comment. */
static bool rest_empty(const char *p) {
	p += strspn(p, " \t\r\n");
	return *p == '\0' || *p == '#' || *p == ';';
}

/*
 * inih's reader, called once per line, right before inih parses that line and calls the
 * key handler for it: so the line counted here is the handler's line too.
 */
static char *read_line(char *str, int num, void *stream) {
	struct inifile_stream *st = stream;
	struct inifile_ctx *ctx = &st->ctx;
	char *p, *eq, *colon;
	size_t n;

	if (st->stop || !fgets(str, num, st->f))
		return NULL;
	ctx->line++;
	n = strlen(str);
	if (n == 0 || (str[n - 1] != '\n' && !feof(st->f) && n + 1 < (size_t)num)) {
		/* fgets() stopped at neither a newline, the buffer's end nor the file's end:
		 * a NUL byte. */
		inifile_ctx_error(ctx, "contains a NUL byte: not a text file");
		st->stop = true;
		return NULL;
	}
	st->bytes += n;
	if (str[n - 1] != '\n' && !feof(st->f)) {
		int ch;

		/* Longer than inih's buffer: inih would take the rest for a new line. */
		while ((ch = fgetc(st->f)) != EOF && ch != '\n')
			st->bytes++;
		if (st->bytes <= st->max_bytes) {
			inifile_ctx_error(ctx, "line longer than %d characters", num - 3);
			return blank_line(str);
		}
	}
	if (st->bytes > st->max_bytes) {
		inifile_error(ctx->errors, ctx->path, 0, "larger than %zu bytes", st->max_bytes);
		st->stop = true;
		return NULL;
	}
	if (ctx->line == 1 && strncmp(str, "\xef\xbb\xbf", 3) == 0)
		memmove(str, str + 3, strlen(str + 3) + 1);
	/* Leading blanks go, so that inih never takes an indented line for the continuation
	 * of a value: the format has no multi-line values. */
	p = str + strspn(str, " \t");
	memmove(str, p, strlen(p) + 1);
	for (p = str; *p; p++)
		if (((unsigned char)*p < ' ' && *p != '\t' && *p != '\r' && *p != '\n') || *p == 0x7f) {
			inifile_ctx_error(ctx, "contains a control character");
			return blank_line(str);
		}

	if (rest_empty(str))
		return str;
	if (str[0] == '[') {
		char *end = strchr(str, ']');

		if (!end || !rest_empty(end + 1)) {
			inifile_ctx_error(ctx, "expected '[section]'");
			/* Its keys would land in the section before: skip them instead. */
			st->have_section = st->bad_section = true;
			return blank_line(str);
		}
		snprintf(st->section, sizeof(st->section), "%.*s", (int)(end - str - 1), str + 1);
		st->have_section = true;
		st->bad_section = !st->ops->section(ctx, st->section);
		return str;
	}
	eq = strchr(str, '=');
	colon = strchr(str, ':');
	/* inih also takes "key: value"; systemd's format does not. */
	if (!eq || (colon && colon < eq)) {
		inifile_ctx_error(ctx, "expected 'key = value'");
		return blank_line(str);
	}
	if (eq == str) {
		inifile_ctx_error(ctx, "a key is missing before '='");
		return blank_line(str);
	}
	return str;
}

static int on_key(void *user, const char *section, const char *name, const char *value) {
	struct inifile_stream *st = user;

	if (!st->bad_section)
		st->ops->key(&st->ctx, st->have_section ? st->section : NULL, name, value);
	/* Errors are the handler's to report: inih's own count would only repeat them. */
	return 1;
}

int inifile_parse(const char *path, bool must_exist, size_t max_bytes,
                  const struct inifile_ops *ops, void *userdata, struct inifile_errors *e) {
	int fd = open(path, O_RDONLY | O_CLOEXEC), r;

	if (fd < 0) {
		r = -errno;
		if (r == -ENOENT && !must_exist)
			return r;
		inifile_error(e, path, 0, "cannot open: %s", strerror(-r));
		return r;
	}
	return inifile_parse_fd(fd, path, max_bytes, ops, userdata, e);
}

int inifile_parse_fd(int fd, const char *path, size_t max_bytes, const struct inifile_ops *ops,
                     void *userdata, struct inifile_errors *e) {
	_cleanup_(fclosep) FILE *f = fdopen(fd, "re");
	struct inifile_stream st = {
		.ctx = { .path = path, .errors = e, .userdata = userdata },
		.ops = ops,
		.max_bytes = max_bytes,
	};
	struct stat sb;
	unsigned before = inifile_errors_count(e);
	int r;

	if (!f) {
		r = -errno;
		close(fd);
		inifile_error(e, path, 0, "cannot read: %s", strerror(-r));
		return r;
	}
	if (fstat(fileno(f), &sb) < 0) {
		r = -errno;
		inifile_error(e, path, 0, "cannot stat: %s", strerror(-r));
		return r;
	}
	if (S_ISDIR(sb.st_mode)) {
		inifile_error(e, path, 0, "is a directory");
		return -EISDIR;
	}
	/* Regular files are checked up front; others (a pipe, /dev/null) as they are read. */
	if (S_ISREG(sb.st_mode) && (uint64_t)sb.st_size > max_bytes) {
		inifile_error(e, path, 0, "larger than %zu bytes", max_bytes);
		return -EFBIG;
	}
	st.f = f;
	r = ini_parse_stream(read_line, &st, on_key, &st);
	if (ferror(f)) {
		inifile_error(e, path, 0, "read error");
		return -EIO;
	}
	if (r < 0) {
		inifile_error(e, path, 0, "out of memory");
		return -ENOMEM;
	}
	/* The reader hands inih only lines it accepts; should inih still object, say where. */
	if (r > 0 && inifile_errors_count(e) == before)
		inifile_error(e, path, (unsigned)r, "syntax error");
	return 0;
}
