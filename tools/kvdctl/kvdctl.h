/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * What kvdctl's commands share (util.c): the socket, error reporting with the exit codes,
 * the administrative connection, reading status values that an older daemon may not send,
 * tables for people and JSON for scripts.
 *
 * Output rule: every command renders into memory first (output_emit), so that a failure
 * half-way never leaves half a table or half a JSON document on stdout.
 */

#include <stdint.h>
#include <stdio.h>

#include "kvd/kvd.h"
#include "cli.h"

enum {
	EXIT_OK = 0,
	EXIT_FAIL = 1,
	EXIT_USAGE = CLI_EXIT_USAGE,
};

/* The daemon's socket: --socket, else $KVD_SOCKET, else KVD_DEFAULT_SOCKET. */
extern const char *arg_socket;
/* --json before the command (kvdctl --json status): as the command's own --json, for the
 * commands that have one. */
extern int arg_json;

/* Prints "kvdctl: MESSAGE" and a hint to stderr; returns EXIT_USAGE. */
#define usage_error(...) cli_usage_error("kvdctl", __VA_ARGS__)

/* Prints "kvdctl: WHAT: strerror[: the daemon's message]" (plus a hint for -EOPNOTSUPP)
 * to stderr; returns EXIT_FAIL. */
int request_error(kvd_client *c, int r, const char *what);

/* After a change that returned r >= 0: when r is 1 (applied but not saved, so it will not
 * survive a restart), prints the daemon's reason to stderr as a warning. */
void change_warning(kvd_client *c, int r, const char *what);

/* Connects without a tenant; prints why not and returns EXIT_FAIL, or EXIT_OK. */
int connect_admin(kvd_client **ret);

/* Prints the full help to stdout. */
void help(void);

/* What parse_common() may take besides --socket and --help. */
#define ARGS_JSON (1u << 0)    /* --json (also before the command: arg_json) */
#define ARGS_TENANT (1u << 1)  /* --tenant NAME */
#define ARGS_CHANGE (1u << 2)  /* --dry-run and --force (budget set) */

struct common_args {
	int json, dry_run, force;
	const char *tenant;        /* NULL: not given */
};

/* Parses the options of a daemon command: --socket, --help and those allow names, into
 * *ret, and leaves optind at the first operand. Returns -1 to go on, or the exit code. */
int parse_common(int argc, char **argv, const char *cmd, unsigned allow,
		 struct common_args *ret);

/*
 * Status values. Each returns 0 and the value, 1 when the daemon did not send it (an older
 * daemon: show "-", leave it out of JSON), or a negative errno.
 */
int status_u64(const kvd_status *st, const char *key, uint64_t *ret);
int status_str(const kvd_status *st, const char *key, const char **ret);
/* The daemon's standing warnings, each on a line "<indent>warning: ..."; none, nothing. */
void warnings_lines(FILE *f, const kvd_status *st, const char *indent);
int status_tenant_u64(const kvd_status *st, uint32_t t, const char *key, uint64_t *ret);
int status_tenant_str(const kvd_status *st, uint32_t t, const char *key, const char **ret);

/* Whether any tenant of the status reports key (a newer daemon's value). */
int tenants_report(const kvd_status *st, const char *key);

/* Tenant indices sorted by name (free() the array): the daemon lists tenants in its own
 * table order, which changes as tenants come and go. */
int tenant_order(const kvd_status *st, uint32_t **ret);

/* Index of the tenant called name, or -ENOENT. */
int tenant_find(const kvd_status *st, const char *name, uint32_t *ret);

/* "12.5%" of whole, or "-" when whole is 0. Returns buf. */
char *fmt_percent(uint64_t part, uint64_t whole, char *buf, size_t n);
/* "42.0s", "3m 5s", "2h 10m", "4d 1h". */
void fmt_uptime(uint64_t ms, char *buf, size_t n);

/* ---- Tables ---- */

#define CELL_MAX 64

/*
 * A table for people: one title per column, n_rows * n_cols cells (row-major), the columns
 * whose left flag is set left-aligned (column 0 always), the others right-aligned, two
 * blanks between columns, no trailing blanks. With tail, a last column of strings of any
 * length follows, left-aligned, for what does not fit in a cell.
 */
struct table {
	size_t n_cols;
	size_t n_rows;
	const char *const *titles;
	const unsigned char *left; /* n_cols flags, or NULL */
	char (*cells)[CELL_MAX];
	const char *tail_title;
	char *const *tail;         /* n_rows strings, or NULL for no tail column */
};

void table_print(FILE *f, const struct table *t);

/* ---- The tenant table (status, tenants) ---- */

/*
 * Writes the tenant table, or "No tenants.". MIN, MAX and WEIGHT carry a marker for where
 * they come from ('*' live, '+' config file, '^' kvd's command line, none for defaults),
 * which a footer explains.
 */
int tenants_table_write(FILE *f, const kvd_status *st);

/* Writes "tenants": [...] (no leading separator) at the given indent. */
int tenants_json_write(FILE *f, const kvd_status *st, int indent);

/* ---- JSON ---- */

void json_string(FILE *f, const char *s);

/*
 * Writes the node's string and number values named by the keys as JSON members at indent 2,
 * separated by ",\n", leaving out those the daemon does not send, then "library_version"
 * (no trailing separator).
 */
int node_json_write(FILE *f, const kvd_status *st, const char *const *u64_keys, size_t n_u64,
		    const char *const *str_keys, size_t n_str);

/* ---- Output ---- */

/* Runs write into a memory stream and copies the result to stdout only if it succeeded.
 * Returns 0, or a negative errno (nothing written then). */
int output_emit(int (*write)(FILE *f, const void *userdata), const void *userdata);

/* Flushes stdout; prints why not and returns EXIT_FAIL, or EXIT_OK. */
int output_flush(void);

/* ---- Commands ---- */

int cmd_top(int argc, char **argv);
/* holders.c */
int cmd_connections(int argc, char **argv);
int cmd_seqs(int argc, char **argv);
int cmd_disconnect(int argc, char **argv);
