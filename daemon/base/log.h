/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Daemon logging: one line per event on stderr. Under systemd (JOURNAL_STREAM set) each
 * line starts with a "<N>" syslog priority so that journald files it at the right level.
 * The log_*_errno() forms log and return the (negative) error, so that an error is logged
 * once, where it is handled.
 */

#include <stdint.h>
#include <syslog.h>

#include "basic/macro.h"

void log_setup(void);
void log_set_max_level(int level);
/* Each call site may log `burst` lines per `interval_ms` (default 10 per 5 s); the first
 * line after a quiet spell counts what was dropped. */
void log_set_ratelimit(uint64_t interval_ms, unsigned burst);
_printf_(2, 3) void log_full(int level, const char *fmt, ...);
_printf_(3, 4) int log_full_errno(int level, int error, const char *fmt, ...);

#define log_debug(...) log_full(LOG_DEBUG, __VA_ARGS__)
#define log_info(...) log_full(LOG_INFO, __VA_ARGS__)
#define log_notice(...) log_full(LOG_NOTICE, __VA_ARGS__)
#define log_warning(...) log_full(LOG_WARNING, __VA_ARGS__)
#define log_error(...) log_full(LOG_ERR, __VA_ARGS__)
#define log_warning_errno(e, ...) log_full_errno(LOG_WARNING, e, __VA_ARGS__)
#define log_error_errno(e, ...) log_full_errno(LOG_ERR, e, __VA_ARGS__)
