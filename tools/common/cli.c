/* SPDX-License-Identifier: MIT */
#include <stdarg.h>
#include <stdio.h>

#include "cli.h"

int cli_usage_error(const char *prog, const char *fmt, ...) {
	va_list ap;

	fprintf(stderr, "%s: ", prog);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, "\nTry '%s --help'.\n", prog);
	return CLI_EXIT_USAGE;
}
