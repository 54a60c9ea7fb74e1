/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

int cli_parse_list(const char *s, unsigned max, int (*item)(const char *s, unsigned i, void *userdata),
                   void *userdata) {
	_cleanup_(freep) char *copy = strdup(s);
	char *p, *save = NULL;
	unsigned n = 0;

	if (!copy)
		return -ENOMEM;
	for (p = strtok_r(copy, ",", &save); p; p = strtok_r(NULL, ",", &save)) {
		if (n == max || item(p, n, userdata) < 0)
			return -EINVAL;
		n++;
	}
	return n ? (int)n : -EINVAL;
}
