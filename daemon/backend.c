/* SPDX-License-Identifier: MIT */
#include <string.h>

#include "backend.h"

const struct backend_ops *backend_find(const char *name) {
	/* Only the host backend exists so far; "auto" resolves to it. */
	if (strcmp(name, "host") == 0 || strcmp(name, "auto") == 0)
		return &backend_host_ops;
	return NULL;
}
