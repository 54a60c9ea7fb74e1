/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The metrics endpoint's text: the Prometheus text exposition format, version 0.0.4, served
 * by http.c. Node values come from node-values.c, the histograms from metrics.h; the rest
 * is read where it lives when a scrape renders it (docs/metrics.md).
 */

#include <stddef.h>
#include <stdio.h>

struct server;

/* Writes value to f as the inside of a quoted label value: \, " and newline escaped. */
void prometheus_label_value(FILE *f, const char *value);

/*
 * Renders every metric of s. Returns 0 with the text (NUL-terminated, ret_size bytes
 * without the NUL) in *ret, for the caller to free(), or -ENOMEM.
 */
int prometheus_render(struct server *s, char **ret, size_t *ret_size);
