/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * INI files as systemd writes its own: "[section]" headers, "key = value" lines, comments
 * starting with '#' or ';'. Parsed with inih, through a reader that adds what inih's
 * Debian build lacks: the line number of every key and section (so that each error names
 * file:line), a bound on the file's size and on each line's length, strict syntax (a line
 * is blank, a comment, a [section] or key = value; a line that is none of them is an error
 * and is skipped, where inih would continue a value or guess), and section headers reported
 * to the caller even when no key follows them.
 *
 * Used for the config file (settings.c) and the daemon's live state (state.c). Nothing here
 * logs: errors are collected, with their file:line, for the caller to print or log.
 */

#include <stdbool.h>
#include <stddef.h>

#include "basic/macro.h"

/* Errors kept per parse; later ones are counted, not kept. Above the number of [kvd]
 * keys, so that a file with every key wrong still names each (tests/check-docs.py). */
#define INIFILE_ERRORS_MAX 64

struct inifile_errors {
	char *msg[INIFILE_ERRORS_MAX];   /* "FILE:LINE: what", or "FILE: what" */
	unsigned n;
	unsigned dropped;                /* errors past INIFILE_ERRORS_MAX */
};

/* Adds an error about path (line 0: the file as a whole). Never fails: without memory the
 * error is counted as dropped. */
_printf_(4, 5) void inifile_error(struct inifile_errors *e, const char *path, unsigned line,
                                  const char *fmt, ...);
unsigned inifile_errors_count(const struct inifile_errors *e);
void inifile_errors_done(struct inifile_errors *e);

struct inifile_ctx {
	const char *path;
	unsigned line;                /* of the line being handled */
	struct inifile_errors *errors;
	void *userdata;
};

/* An error at the current line. */
#define inifile_ctx_error(ctx, ...)                                                           \
	inifile_error((ctx)->errors, (ctx)->path, (ctx)->line, __VA_ARGS__)

struct inifile_ops {
	/* A section header, as written between the brackets. Returns false when the section
	 * is not valid (after reporting it): its keys are then skipped without more errors. */
	bool (*section)(struct inifile_ctx *ctx, const char *name);
	/* A key = value line in a valid section (section NULL: before any header). The value
	 * is stripped of blanks and of a trailing " ;comment". */
	void (*key)(struct inifile_ctx *ctx, const char *section, const char *key, const char *value);
};

/*
 * Parses the file at path, at most max_bytes long. Returns 0 once parsed (errors in the
 * text are in e: check inifile_errors_count()), -ENOENT when the file does not exist and
 * must_exist is false (nothing is added to e), or another -errno when it cannot be read
 * (added to e too).
 */
int inifile_parse(const char *path, bool must_exist, size_t max_bytes,
                  const struct inifile_ops *ops, void *userdata, struct inifile_errors *e);
/* The same, of the file open as fd (taken, closed when done), known as path. */
int inifile_parse_fd(int fd, const char *path, size_t max_bytes, const struct inifile_ops *ops,
                     void *userdata, struct inifile_errors *e);
