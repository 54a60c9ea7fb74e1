/* SPDX-License-Identifier: MIT */
/*
 * libkvd, the models: registering a model's shape, its eviction settings, compensation and
 * indexer (kvd_model_register_params and its older forms), and its output projections.
 * The library remembers what it registered, to check each sequence's descriptor against it.
 */

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "client-internal.h"
#include "common/layout.h"
#include "basic/macro.h"
#include "kvd/kvd.h"
#include "wire.h"

/* W_o goes through a memfd the size of the matrix; a larger one is a caller's mistake. */
#define OUTPUT_PROJ_MAX_BYTES (UINT64_C(1) << 30)
#define HIDDEN_MAX 65536u

static void model_remember(kvd_client *c, uint32_t id, const struct model *m) {
	if (id >= MODELS_MAX)
		return;
	if (id >= c->n_models) {
		uint32_t n = MIN(MAX(id + 1, 2 * c->n_models), MODELS_MAX);
		struct model *p = realloc(c->models, n * sizeof(*p));

		/* Only the cross-checks (and kvd_model_output_proj) are lost without the entry. */
		if (!p)
			return;
		memset(p + c->n_models, 0, (n - c->n_models) * sizeof(*p));
		c->models = p;
		c->n_models = n;
	}
	c->models[id] = *m;
}

/* The model's entry, or NULL when the library does not know it. Under the lock. */
const struct model *model_find(const kvd_client *c, int model_id) {
	if (model_id < 0 || (uint32_t)model_id >= c->n_models || !c->models[model_id].known)
		return NULL;
	return &c->models[model_id];
}

/* Fills in the eviction settings of m from ev (NULL: none), applying the defaults. */
static int eviction_settings(const kvd_model_spec *spec, const kvd_eviction_spec *ev,
			     struct model *m, uint32_t *ret_sinks) {
	m->unit = KVD_UNIT_NONE;
	if (!ev)
		return 0;
	if (ev->reserved != 0)
		return -EINVAL;
	if (ev->unit == KVD_UNIT_NONE)
		return 0;
	if (ev->unit > KVD_UNIT_BLOCK)
		return -EINVAL;
	if (ev->unit == KVD_UNIT_HEAD_TOKEN && spec->layout != KVD_LAYOUT_PER_HEAD)
		return -EINVAL;
	m->window = ev->window == 0 ? KVD_WINDOW_DEFAULT : ev->window;
	*ret_sinks = ev->sinks == KVD_SINKS_DEFAULT ? KVD_SINKS_DEFAULT_COUNT : ev->sinks;
	if (m->window > KVD_WINDOW_MAX || *ret_sinks > KVD_SINKS_MAX)
		return -EINVAL;
	m->unit = ev->unit;
	return 0;
}

static int model_register(kvd_client *c, const kvd_model_spec *spec,
			  const kvd_eviction_spec *ev, uint32_t compensation,
			  const kvd_index_spec *ix) {
	Kvd__V1__RegisterModel req = KVD__V1__REGISTER_MODEL__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
	const Kvd__V1__RegisterModelReply *rep;
	struct model m = {};
	int fds[WIRE_FDS_MAX];
	uint32_t sinks = 0;
	int r;

	if (!c || !spec)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	/* The obvious mistakes; the daemon checks the limits. */
	if (spec->layers == 0 || spec->q_heads == 0 || spec->kv_heads == 0 || spec->head_dim == 0 ||
	    spec->block_tokens == 0 || layout_dtype_bytes(spec->dtype) == 0 ||
	    (spec->layout != KVD_LAYOUT_PER_LAYER && spec->layout != KVD_LAYOUT_PER_HEAD))
		return -EINVAL;
	r = eviction_settings(spec, ev, &m, &sinks);
	if (r < 0)
		return r;
	/* Moments summarise what eviction takes: without eviction there is nothing to keep. */
	if (compensation > KVD_COMPENSATION_LATENT ||
	    (compensation != KVD_COMPENSATION_NONE && m.unit == KVD_UNIT_NONE))
		return -EINVAL;
	m.compensation = compensation;
	/* An indexer feeds eviction, like compensation; the daemon checks the limits too. */
	if (ix && (ix->heads == 0 || ix->heads > KVD_INDEX_HEADS_MAX || ix->dim == 0 || ix->dim > KVD_INDEX_DIM_MAX ||
		   ix->reserved[0] || ix->reserved[1] || m.unit == KVD_UNIT_NONE))
		return -EINVAL;
	if (ix)
		m.index_heads = ix->heads, m.index_dim = ix->dim;

	req.name = (char *)spec->name;
	req.has_layers = req.has_q_heads = req.has_kv_heads = req.has_head_dim = true;
	req.layers = spec->layers;
	req.q_heads = spec->q_heads;
	req.kv_heads = spec->kv_heads;
	req.head_dim = spec->head_dim;
	req.has_dtype = true;
	req.dtype = (Kvd__V1__Dtype)spec->dtype;
	req.has_block_tokens = true;
	req.block_tokens = spec->block_tokens;
	req.has_layout = true;
	req.layout = (Kvd__V1__Layout)spec->layout;
	/* Absent for KVD_UNIT_NONE: then the daemon never rewrites the model's sequences. */
	if (m.unit != KVD_UNIT_NONE) {
		req.has_eviction_unit = req.has_window = req.has_sinks = true;
		req.eviction_unit = (Kvd__V1__EvictionUnit)m.unit;
		req.window = m.window;
		req.sinks = sinks;
	}
	if (compensation != KVD_COMPENSATION_NONE) {
		req.has_compensation = true;
		req.compensation = (Kvd__V1__Compensation)compensation;
	}
	if (ix) {
		req.has_index_heads = req.has_index_dim = true;
		req.index_heads = ix->heads;
		req.index_dim = ix->dim;
	}
	env.body_case = KVD__V1__ENVELOPE__BODY_REGISTER_MODEL;
	env.register_model = &req;

	client_lock(c);
	r = client_call(c, &env, KVD__V1__ENVELOPE__BODY_REGISTER_MODEL_REPLY, false, &reply, fds,
			NULL);
	if (r >= 0) {
		rep = reply->register_model_reply;
		m.obs_bytes = rep->has_observation_bytes ? rep->observation_bytes : 0;
		/* An observation buffer belongs to eviction only. (A daemon that predates
		 * eviction ignores the fields and sends none: the model then simply has none.) */
		if (!rep->has_model_id || rep->model_id > INT_MAX ||
		    (m.unit == KVD_UNIT_NONE && m.obs_bytes != 0))
			r = -EPROTO;
		else if (compensation != KVD_COMPENSATION_NONE && !rep->has_moments_bytes)
			/* A daemon that predates compensation ignored the field: the model it
			 * registered keeps nothing, which is not what was asked for. */
			r = -EOPNOTSUPP;
		else if (ix && !rep->has_index_offset)
			/* Likewise for an indexer: its blocks would have no room for index keys. */
			r = -EOPNOTSUPP;
		else {
			m.known = true;
			m.layers = spec->layers;
			m.q_heads = spec->q_heads;
			m.kv_heads = spec->kv_heads;
			m.head_dim = spec->head_dim;
			m.dtype = spec->dtype;
			m.block_tokens = spec->block_tokens;
			m.layout = spec->layout;
			m.block_bytes = rep->has_block_bytes ? rep->block_bytes : 0;
			model_remember(c, rep->model_id, &m);
			r = (int)rep->model_id;
		}
	}
	client_unlock(c);
	return r;
}

static int do_model_register_params(kvd_client *c, const kvd_model_params *params) {
	kvd_model_params p;
	int r;

	r = params_copy(&p, sizeof(p), params, KVD_MODEL_PARAMS_SIZE_1_4);
	if (r < 0)
		return r;
	return model_register(c, &p.spec, &p.eviction, p.compensation,
			      p.index.heads || p.index.dim || p.index.reserved[0] || p.index.reserved[1]
				      ? &p.index : NULL);
}

int kvd_model_register_params(kvd_client *c, const kvd_model_params *params) {
	return (int)call_result(client_key(c), do_model_register_params(c, params), __func__);
}

static int do_model_register(kvd_client *c, const kvd_model_spec *spec) {
	return model_register(c, spec, NULL, KVD_COMPENSATION_NONE, NULL);
}

int kvd_model_register(kvd_client *c, const kvd_model_spec *spec) {
	return (int)call_result(client_key(c), do_model_register(c, spec), __func__);
}

static int do_model_register_evictable(kvd_client *c, const kvd_model_spec *spec,
				 const kvd_eviction_spec *ev) {
	return model_register(c, spec, ev, KVD_COMPENSATION_NONE, NULL);
}

int kvd_model_register_evictable(kvd_client *c, const kvd_model_spec *spec,
				 const kvd_eviction_spec *ev) {
	return (int)call_result(client_key(c), do_model_register_evictable(c, spec, ev), __func__);
}

static int do_model_register_compensated(kvd_client *c, const kvd_model_spec *spec,
				   const kvd_eviction_spec *ev, uint32_t compensation) {
	return model_register(c, spec, ev, compensation, NULL);
}

int kvd_model_register_compensated(kvd_client *c, const kvd_model_spec *spec,
				   const kvd_eviction_spec *ev, uint32_t compensation) {
	return (int)call_result(client_key(c), do_model_register_compensated(c, spec, ev, compensation), __func__);
}

static int do_model_register_indexed(kvd_client *c, const kvd_model_spec *spec,
			       const kvd_eviction_spec *ev, uint32_t compensation,
			       const kvd_index_spec *ix) {
	return model_register(c, spec, ev, compensation, ix);
}

int kvd_model_register_indexed(kvd_client *c, const kvd_model_spec *spec,
			       const kvd_eviction_spec *ev, uint32_t compensation,
			       const kvd_index_spec *ix) {
	return (int)call_result(client_key(c), do_model_register_indexed(c, spec, ev, compensation, ix), __func__);
}

static int do_model_output_proj(kvd_client *c, int model_id, uint32_t layer, uint32_t dtype,
			  uint32_t hidden, const void *wo) {
	Kvd__V1__ModelOutputProj req = KVD__V1__MODEL_OUTPUT_PROJ__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	_cleanup_(closep) int fd = -EBADF;
	int fds[WIRE_FDS_MAX];
	const struct model *m;
	uint64_t bytes = 0;
	int r;

	if (!c || !wo || hidden == 0 || hidden > HIDDEN_MAX || layout_dtype_bytes(dtype) == 0)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;

	client_lock(c);
	m = model_find(c, model_id);
	if (!m || layer >= m->layers)
		r = -EINVAL;
	else if (mul_u64((uint64_t)hidden * m->q_heads, m->head_dim, &bytes) < 0 ||
		 mul_u64(bytes, layout_dtype_bytes(dtype), &bytes) < 0 || bytes > OUTPUT_PROJ_MAX_BYTES)
		r = -EFBIG;
	else
		r = 0;
	client_unlock(c);
	if (r < 0)
		return r;

	/* Copied without the lock: up to a GiB, which other threads need not wait for. */
	r = client_sealed_memfd("kvd-output-proj", wo, bytes, &fd);
	if (r < 0)
		return r;

	req.has_model_id = true;
	req.model_id = (uint32_t)model_id;
	req.has_layer = true;
	req.layer = layer;
	req.has_dtype = true;
	req.dtype = (Kvd__V1__Dtype)dtype;
	req.has_hidden = true;
	req.hidden = hidden;
	env.body_case = KVD__V1__ENVELOPE__BODY_MODEL_OUTPUT_PROJ;
	env.model_output_proj = &req;

	client_lock(c);
	r = client_call_fd(c, &env, fd, BODY_ANY, NULL, fds, NULL);
	client_unlock(c);
	return r;
}

int kvd_model_output_proj(kvd_client *c, int model_id, uint32_t layer, uint32_t dtype,
			  uint32_t hidden, const void *wo) {
	return (int)call_result(client_key(c), do_model_output_proj(c, model_id, layer, dtype, hidden, wo), __func__);
}
