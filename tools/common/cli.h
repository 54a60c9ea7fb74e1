/* SPDX-License-Identifier: MIT */
#pragma once

/* The command-line scaffolding the tools share (kvdctl, kvd-bench, kvd-lm, kvd-quality,
 * kvd-soak): how a usage error reads and what it returns. */

#include "basic/macro.h"

/* The exit status of a usage error, for every tool. */
#define CLI_EXIT_USAGE 2

/* Prints "PROG: MESSAGE" and "Try 'PROG --help'." to stderr; returns CLI_EXIT_USAGE. prog
 * is the command as typed, e.g. "kvd-bench evict". */
_printf_(2, 3) int cli_usage_error(const char *prog, const char *fmt, ...);

/* Splits s at commas and calls item(each, its index, userdata) on each of at most max
 * items. Returns how many there were, or -EINVAL (none, more than max, or item failed),
 * -ENOMEM. Items live only during their call. */
int cli_parse_list(const char *s, unsigned max, int (*item)(const char *s, unsigned i, void *userdata),
                   void *userdata);
