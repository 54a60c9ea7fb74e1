/* SPDX-License-Identifier: MIT */
/*
 * libkvd, errors: what a code means for kvd (kvd_strerror), and the message of the last
 * failed call (kvd_client_last_error). Messages are kept per thread, keyed by the client the
 * call was on (its serial: a freed client's address may be the next one's), so that threads sharing a client do not read each other's, and no call
 * takes a lock for them: every public call that can fail goes through call_result(), which
 * writes "function: meaning" for a failure unless the daemon's own words (or the library's
 * more precise ones, client_error()) were kept for that very failure.
 */

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "basic/macro.h"
#include "client-internal.h"
#include "kvd/kvd.h"

_Thread_local struct call_error call_error;

/* The codes whose meaning for kvd the C library's words do not say. */
static const struct {
	int code;
	const char *text;
} kvd_errors[] = {
	{ -EFBIG, "the sequence holds max_tokens" },
	{ -EDQUOT, "the tenant is at its cap (max)" },
	{ -ENOSPC, "no room under the node's budget or in the pool, and no eviction made room "
	           "in time" },
	{ -ESTALE, "the sequence belongs to a lost connection (kvd_seq_claim or kvd_seq_release "
	           "it)" },
	{ -ECHILD, "a handle of the parent used after fork()" },
	{ -ECONNRESET, "the connection to the daemon is lost (kvd_client_reconnect)" },
	{ -EUSERS, "a daemon limit was reached (connections, tenants, sequences or models)" },
	{ -EPROTONOSUPPORT, "no protocol version in common with the daemon, or a GPU pool and a "
	                    "libkvd without CUDA" },
	{ -EPROTO, "the daemon broke the protocol" },
	{ -EXDEV, "the sequence's memory is on another GPU than this connection's" },
};

const char *kvd_strerror(int code) {
	const char *text;

	for (size_t i = 0; i < ELEMENTSOF(kvd_errors); i++)
		if (kvd_errors[i].code == code)
			return kvd_errors[i].text;
	text = code < 0 ? strerrordesc_np(-code) : NULL;
	return text ? text : "unknown error";
}

const char *kvd_client_last_error(kvd_client *c) {
	/* NULL: a call that had no client, or whose client the failure took (a connect). */
	if (!c)
		return call_error.client == 0 ? call_error.msg : "";
	if (client_forked(c) || call_error.client != c->serial)
		return "";
	return call_error.msg;
}


static int error_v(const kvd_client *c, int code, bool prefix, const char *format, va_list ap) {
	vsnprintf(call_error.msg, sizeof(call_error.msg), format, ap);
	call_error.client = client_key(c);
	call_error.code = code;
	call_error.fresh = true;
	call_error.prefix = prefix;
	return code;
}

int client_error(const kvd_client *c, int code, const char *format, ...) {
	va_list ap;

	va_start(ap, format);
	code = error_v(c, code, false, format, ap);
	va_end(ap);
	return code;
}

int client_refuse(const kvd_client *c, int code, const char *format, ...) {
	va_list ap;

	va_start(ap, format);
	code = error_v(c, code, true, format, ap);
	va_end(ap);
	return code;
}

void client_set_error(const kvd_client *c, int code, const char *message) {
	/* Without words of the daemon's, the failure gets the library's generic ones. */
	if (message && *message)
		(void)client_error(c, code, "%s", message);
}

void call_failed(uint64_t key, int code, const char *function) {
	bool kept = call_error.fresh && call_error.client == key && call_error.code == code;

	call_error.fresh = false;
	if (kept && call_error.prefix) {
		char msg[LAST_ERROR_MAX];

		/* Cut short when both do not fit: the end of a long message matters least. */
		if (snprintf(msg, sizeof(msg), "%s: %s", function, call_error.msg) >= 0)
			memcpy(call_error.msg, msg, sizeof(msg));
		call_error.prefix = false;
	}
	if (kept)
		return;
	call_error.client = key;
	call_error.code = code;
	snprintf(call_error.msg, sizeof(call_error.msg), "%s: %s", function, kvd_strerror(code));
}
