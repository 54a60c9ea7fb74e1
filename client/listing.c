/* SPDX-License-Identifier: MIT */
/*
 * Who holds what: kvd_connections_get, kvd_sequences_get (the daemon's listings, fetched a
 * page at a time and kept as a kvd_table of rows whose values are read by name), and
 * kvd_disconnect; the daemon's settings as such a table (kvd_config_get).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "client-internal.h"

/* Rows at most, whatever the daemon says: its own bounds (max-connections, max-seqs-node)
 * are far below. */
#define TABLE_ROWS_MAX (UINT32_C(1) << 22)

struct kvd_table {
	uint32_t n, cap;
	ProtobufCMessage **rows;      /* each an unpacked copy, owned */
};

kvd_table *kvd_table_free(kvd_table *t) {
	if (!t)
		return NULL;
	for (uint32_t i = 0; i < t->n; i++)
		protobuf_c_message_free_unpacked(t->rows[i], NULL);
	free(t->rows);
	free(t);
	return NULL;
}

/* Appends a copy of row (packed and unpacked again: the reply's memory is the client's). */
static int table_add(kvd_table *t, const ProtobufCMessage *row) {
	_cleanup_(freep) uint8_t *buf = NULL;
	size_t size = protobuf_c_message_get_packed_size(row);
	ProtobufCMessage *copy;

	if (t->n == TABLE_ROWS_MAX)
		return -E2BIG;
	if (t->n == t->cap) {
		uint32_t cap = t->cap ? t->cap * 2 : 64;
		ProtobufCMessage **rows = realloc(t->rows, cap * sizeof(*rows));

		if (!rows)
			return -ENOMEM;
		t->rows = rows;
		t->cap = cap;
	}
	buf = malloc(MAX(size, 1u));
	if (!buf)
		return -ENOMEM;
	protobuf_c_message_pack(row, buf);
	copy = protobuf_c_message_unpack(row->descriptor, NULL, size, buf);
	if (!copy)
		return -ENOMEM;
	t->rows[t->n++] = copy;
	return 0;
}

uint32_t kvd_table_rows(const kvd_table *t) {
	return t ? t->n : 0;
}

static const ProtobufCFieldDescriptor *table_field(const kvd_table *t, uint32_t row, const char *key,
                                                   const char **ret_base) {
	const ProtobufCFieldDescriptor *f;

	if (!t || !key || row >= t->n)
		return NULL;
	f = protobuf_c_message_descriptor_get_field_by_name(t->rows[row]->descriptor, key);
	*ret_base = (const char *)t->rows[row];
	return f && f->label == PROTOBUF_C_LABEL_OPTIONAL ? f : NULL;
}

int kvd_table_u64(const kvd_table *t, uint32_t row, const char *key, uint64_t *ret) {
	const ProtobufCFieldDescriptor *f;
	const char *base;

	if (!t || !key || !ret || row >= t->n)
		return -EINVAL;
	f = table_field(t, row, key, &base);
	if (!f || !*(const protobuf_c_boolean *)(base + f->quantifier_offset))
		return -ENOENT;
	switch (f->type) {
	case PROTOBUF_C_TYPE_UINT32:
		*ret = *(const uint32_t *)(base + f->offset);
		return 0;
	case PROTOBUF_C_TYPE_UINT64:
		*ret = *(const uint64_t *)(base + f->offset);
		return 0;
	default:
		return -ENOENT;
	}
}

int kvd_table_str(const kvd_table *t, uint32_t row, const char *key, const char **ret) {
	const ProtobufCFieldDescriptor *f;
	const char *base, *v;

	if (!t || !key || !ret || row >= t->n)
		return -EINVAL;
	f = table_field(t, row, key, &base);
	if (!f || f->type != PROTOBUF_C_TYPE_STRING)
		return -ENOENT;
	v = *(char *const *)(base + f->offset);
	if (!v)
		return -ENOENT;
	*ret = v;
	return 0;
}

/* Asks for pages until the daemon says no more follow. */
static int fetch(kvd_client *c, const char *tenant, bool sequences, kvd_table **ret) {
	_cleanup_(kvd_table_freep) kvd_table *t = NULL;
	uint64_t after_conn = 0, after_seq = 0;
	bool more = true;
	int r = 0;

	if (!c || !ret)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	t = calloc(1, sizeof(*t));
	if (!t)
		return -ENOMEM;
	while (more && r >= 0) {
		Kvd__V1__ConnectionsRequest creq = KVD__V1__CONNECTIONS_REQUEST__INIT;
		Kvd__V1__SequencesRequest sreq = KVD__V1__SEQUENCES_REQUEST__INIT;
		Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
		int fds[WIRE_FDS_MAX];

		if (sequences) {
			sreq.has_after_connection = sreq.has_after_sequence = true;
			sreq.after_connection = after_conn;
			sreq.after_sequence = after_seq;
			sreq.tenant = (char *)tenant;
			env.body_case = KVD__V1__ENVELOPE__BODY_SEQUENCES_REQUEST;
			env.sequences_request = &sreq;
		} else {
			creq.has_after = true;
			creq.after = after_conn;
			env.body_case = KVD__V1__ENVELOPE__BODY_CONNECTIONS_REQUEST;
			env.connections_request = &creq;
		}
		client_lock(c);
		r = client_call(c, &env,
		                sequences ? KVD__V1__ENVELOPE__BODY_SEQUENCES_REPLY :
		                            KVD__V1__ENVELOPE__BODY_CONNECTIONS_REPLY,
		                false, &reply, fds, NULL);
		if (r >= 0 && sequences) {
			const Kvd__V1__SequencesReply *rep = reply->sequences_reply;

			for (size_t i = 0; r >= 0 && i < rep->n_sequences; i++) {
				const Kvd__V1__SequenceInfo *q = rep->sequences[i];

				r = table_add(t, &q->base);
				/* The cursor must move, or a broken daemon would keep us here. */
				if (r >= 0 && (q->connection < after_conn ||
				               (q->connection == after_conn && q->id <= after_seq)))
					r = -EPROTO;
				after_conn = q->connection;
				after_seq = q->id;
			}
			more = rep->more && rep->n_sequences > 0;
		} else if (r >= 0) {
			const Kvd__V1__ConnectionsReply *rep = reply->connections_reply;

			for (size_t i = 0; r >= 0 && i < rep->n_connections; i++) {
				r = table_add(t, &rep->connections[i]->base);
				if (r >= 0 && rep->connections[i]->id <= after_conn)
					r = -EPROTO;
				after_conn = rep->connections[i]->id;
			}
			more = rep->more && rep->n_connections > 0;
		}
		client_unlock(c);
	}
	if (r < 0)
		return r;
	*ret = TAKE_PTR(t);
	return 0;
}

static int do_connections_get(kvd_client *c, kvd_table **ret) {
	return fetch(c, NULL, false, ret);
}

int kvd_connections_get(kvd_client *c, kvd_table **ret) {
	return (int)call_result(client_key(c), do_connections_get(c, ret), __func__);
}

static int do_sequences_get(kvd_client *c, const char *tenant, kvd_table **ret) {
	if (c && tenant && !tenant_name_valid(tenant))
		return client_error(c, -EINVAL, TENANT_NAME_RULE);
	return fetch(c, tenant, true, ret);
}

int kvd_sequences_get(kvd_client *c, const char *tenant, kvd_table **ret) {
	return (int)call_result(client_key(c), do_sequences_get(c, tenant, ret), __func__);
}

static int do_disconnect(kvd_client *c, uint64_t connection) {
	Kvd__V1__Disconnect req = KVD__V1__DISCONNECT__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
	int fds[WIRE_FDS_MAX];
	int r;

	if (!c)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	req.has_connection = true;
	req.connection = connection;
	env.body_case = KVD__V1__ENVELOPE__BODY_DISCONNECT;
	env.disconnect = &req;
	client_lock(c);
	r = client_call(c, &env, BODY_ANY, false, &reply, fds, NULL);
	client_unlock(c);
	return r < 0 ? r : 0;
}

int kvd_disconnect(kvd_client *c, uint64_t connection) {
	return (int)call_result(client_key(c), do_disconnect(c, connection), __func__);
}

static int do_config_get(kvd_client *c, kvd_table **ret) {
	_cleanup_(kvd_table_freep) kvd_table *t = NULL;
	Kvd__V1__ConfigRequest req = KVD__V1__CONFIG_REQUEST__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
	int fds[WIRE_FDS_MAX], r;

	if (!c || !ret)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	t = calloc(1, sizeof(*t));
	if (!t)
		return -ENOMEM;
	env.body_case = KVD__V1__ENVELOPE__BODY_CONFIG_REQUEST;
	env.config_request = &req;
	client_lock(c);
	r = client_call(c, &env, KVD__V1__ENVELOPE__BODY_CONFIG_REPLY, false, &reply, fds, NULL);
	for (size_t i = 0; r >= 0 && i < reply->config_reply->n_settings; i++)
		r = table_add(t, &reply->config_reply->settings[i]->base);
	client_unlock(c);
	if (r < 0)
		return r;
	*ret = TAKE_PTR(t);
	return 0;
}

int kvd_config_get(kvd_client *c, kvd_table **ret) {
	return (int)call_result(client_key(c), do_config_get(c, ret), __func__);
}
