/* SPDX-License-Identifier: MIT */
/*
 * kvd._kvd: the Python binding of libkvd, a C extension on the stable ABI (Python 3.11 and
 * later, abi3), without numpy's C API. It wraps the handles (Client, Seq, Status) and hands
 * out memory as View objects: K/V blocks, block tables, observation windows and the
 * connection's whole block range, each readable through the buffer protocol (numpy,
 * memoryview) and DLPack (torch.from_dlpack, numpy.from_dlpack) without a copy.
 *
 * The safety contract (docs/python.md): a View of a sequence's K/V pins the sequence for as
 * long as the View lives, and every array or tensor made from a View keeps the View alive,
 * so the daemon never compacts or takes back the memory under it; releasing a sequence (or
 * closing and reconnecting a client) while Views of its memory live raises BufferError
 * instead.
 * The memory behind a View therefore stays mapped until the last array over it is gone.
 *
 * Calls that talk to the daemon release the GIL. A Seq counts the calls in flight on it,
 * so that release() from another thread cannot free it under one. libkvd itself refuses a
 * handle used after fork() (-ECHILD), which raises KvdError here.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlpack/dlpack.h>
#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvd/kvd.h"

/* The module's types and exception, kept in its state. */
struct module_state {
	PyObject *error;
	PyTypeObject *client_type, *seq_type, *view_type, *status_type;
};

static struct module_state *state_of(PyObject *module) {
	return (struct module_state *)PyModule_GetState(module);
}

/* The module (found from a type by its definition, so that types need no back pointer). */
static PyModuleDef kvd_module;

static struct module_state *state_any(void) {
	PyObject *m = PyState_FindModule(&kvd_module);

	return m ? state_of(m) : NULL;
}

/* Raises KvdError(errno, message) for libkvd's code r: the message is what
 * kvd_client_last_error() says about the failed call (c may be NULL), else kvd_strerror(). */
static PyObject *raise_kvd_msg(int r, const char *msg);

static PyObject *raise_kvd(kvd_client *c, int r) {
	return raise_kvd_msg(r, c ? kvd_client_last_error(c) : "");
}

/* raise_kvd() with the message given (NULL or "": kvd_strerror()'s). */
static PyObject *raise_kvd_msg(int r, const char *msg) {
	struct module_state *st = state_any();
	PyObject *args;

	if (!msg || !*msg)
		msg = kvd_strerror(r);
	args = Py_BuildValue("(is)", -r, msg);
	if (args) {
		PyErr_SetObject(st ? st->error : PyExc_OSError, args);
		Py_DECREF(args);
	}
	return NULL;
}

/* ---- View ---- */

enum view_dtype { DT_F16, DT_BF16, DT_F32, DT_I32, DT_U8 };

static const struct {
	const char *format;   /* struct-module format for the buffer protocol */
	Py_ssize_t itemsize;
	uint8_t code, bits;   /* DLPack */
	const char *name;
} dtypes[] = {
	[DT_F16] = { "e", 2, kDLFloat, 16, "float16" },
	/* No buffer format has bfloat16: raw 16-bit words there, bfloat16 through DLPack. */
	[DT_BF16] = { "H", 2, kDLBfloat, 16, "bfloat16" },
	[DT_F32] = { "f", 4, kDLFloat, 32, "float32" },
	[DT_I32] = { "i", 4, kDLInt, 32, "int32" },
	[DT_U8] = { "B", 1, kDLUInt, 8, "uint8" },
};

#define VIEW_NDIM_MAX 5

typedef struct SeqObject SeqObject;
typedef struct ClientObject ClientObject;

typedef struct {
	PyObject_HEAD
	/* What keeps the memory: a Seq (its K/V, pinned by this view, or its observation
	 * buffer), a Client (its block range), or nothing (data is the view's own, freed with
	 * it). */
	PyObject *owner;
	bool pinned;        /* holds a pin on owner, a Seq */
	bool owns_data;
	bool readonly;
	bool device;        /* CUDA memory: DLPack only, never the buffer protocol */
	int device_id;
	void *data;
	enum view_dtype dtype;
	int ndim;
	Py_ssize_t shape[VIEW_NDIM_MAX];
	Py_ssize_t strides[VIEW_NDIM_MAX]; /* bytes, C order */
	int64_t shape64[VIEW_NDIM_MAX];    /* DLPack's copy */
} ViewObject;

struct ClientObject {
	PyObject_HEAD
	kvd_client *c;      /* NULL once closed */
	Py_ssize_t views;   /* live Views of its memory: its block range, its sequences' */
	int memory;         /* KVD_MEMORY_* */
	int device;         /* CUDA ordinal, -1 on host */
	PyObject *models;   /* model id -> its shape (struct py_model, as a tuple), for the shapes of views
	                     * and the size of W_o */
};

struct SeqObject {
	PyObject_HEAD
	ClientObject *client;
	kvd_seq *s;         /* NULL once released */
	Py_ssize_t views;   /* live Views of its memory */
	Py_ssize_t inflight; /* calls running without the GIL */
	int model;
};

static int seq_unpin_quiet(SeqObject *s);

static void view_dealloc(PyObject *self) {
	ViewObject *v = (ViewObject *)self;
	PyTypeObject *tp = Py_TYPE(self);
	struct module_state *st = state_any();

	if (v->owner && st && PyObject_TypeCheck(v->owner, st->seq_type)) {
		SeqObject *s = (SeqObject *)v->owner;

		s->views--;
		s->client->views--;
		if (v->pinned)
			(void)seq_unpin_quiet(s);
	} else if (v->owner && st && PyObject_TypeCheck(v->owner, st->client_type)) {
		((ClientObject *)v->owner)->views--;
	}
	if (v->owns_data)
		free(v->data);
	Py_XDECREF(v->owner);
	PyObject_Free(self);
	Py_DECREF(tp);
}

/* A view of data with shape (C order), of owner. */
static ViewObject *view_new(PyObject *owner, void *data, enum view_dtype dtype, int ndim,
                            const Py_ssize_t *shape, bool readonly) {
	struct module_state *st = state_any();
	ViewObject *v;
	Py_ssize_t stride;

	v = PyObject_New(ViewObject, st->view_type);
	if (!v)
		return NULL;
	v->owner = owner;
	Py_XINCREF(owner);
	v->pinned = v->owns_data = v->device = false;
	v->device_id = 0;
	v->readonly = readonly;
	v->data = data;
	v->dtype = dtype;
	v->ndim = ndim;
	stride = dtypes[dtype].itemsize;
	for (int i = ndim - 1; i >= 0; i--) {
		v->shape[i] = shape[i];
		v->shape64[i] = shape[i];
		v->strides[i] = stride;
		stride *= shape[i];
	}
	return v;
}

static int view_getbuffer(PyObject *self, Py_buffer *b, int flags) {
	ViewObject *v = (ViewObject *)self;
	Py_ssize_t len = dtypes[v->dtype].itemsize;

	if (v->device) {
		PyErr_SetString(PyExc_BufferError, "GPU memory: use DLPack (torch.from_dlpack)");
		return -1;
	}
	if ((flags & PyBUF_WRITABLE) && v->readonly) {
		PyErr_SetString(PyExc_BufferError, "read-only view");
		return -1;
	}
	for (int i = 0; i < v->ndim; i++)
		len *= v->shape[i];
	b->buf = v->data;
	b->obj = Py_NewRef(self);
	b->len = len;
	b->readonly = v->readonly;
	b->itemsize = dtypes[v->dtype].itemsize;
	b->format = (flags & PyBUF_FORMAT) ? (char *)dtypes[v->dtype].format : NULL;
	b->ndim = v->ndim;
	b->shape = (flags & PyBUF_ND) ? v->shape : NULL;
	b->strides = (flags & PyBUF_STRIDES) ? v->strides : NULL;
	b->suboffsets = NULL;
	b->internal = NULL;
	return 0;
}

/* DLPack: the tensor keeps the View alive through manager_ctx. */
static void dlpack_deleter(DLManagedTensor *t) {
	PyGILState_STATE g = PyGILState_Ensure();

	Py_XDECREF((PyObject *)t->manager_ctx);
	PyGILState_Release(g);
	free(t);
}

/* A capsule nobody consumed (its name is still "dltensor") frees its tensor. */
static void dlpack_capsule_destructor(PyObject *capsule) {
	DLManagedTensor *t;

	if (!PyCapsule_IsValid(capsule, "dltensor"))
		return;
	t = PyCapsule_GetPointer(capsule, "dltensor");
	if (t && t->deleter)
		t->deleter(t);
}

static PyObject *view_dlpack(PyObject *self, PyObject *args, PyObject *kwds) {
	static char *kwlist[] = { "stream", "max_version", "dl_device", "copy", NULL };
	ViewObject *v = (ViewObject *)self;
	PyObject *stream = NULL, *max_version = NULL, *dl_device = NULL, *copy = NULL, *cap;
	DLManagedTensor *t;

	if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$OOOO", kwlist, &stream, &max_version,
	                                 &dl_device, &copy))
		return NULL;
	/* The memory is the daemon's: a copy would not be it. */
	if (copy && PyObject_IsTrue(copy) == 1) {
		PyErr_SetString(PyExc_BufferError, "kvd views are never copied");
		return NULL;
	}
	t = calloc(1, sizeof(*t));
	if (!t)
		return PyErr_NoMemory();
	t->dl_tensor.data = v->data;
	t->dl_tensor.device.device_type = v->device ? kDLCUDA : kDLCPU;
	t->dl_tensor.device.device_id = v->device_id;
	t->dl_tensor.ndim = v->ndim;
	t->dl_tensor.dtype.code = dtypes[v->dtype].code;
	t->dl_tensor.dtype.bits = dtypes[v->dtype].bits;
	t->dl_tensor.dtype.lanes = 1;
	t->dl_tensor.shape = v->shape64;
	t->dl_tensor.strides = NULL; /* C order */
	t->dl_tensor.byte_offset = 0;
	t->manager_ctx = Py_NewRef(self);
	t->deleter = dlpack_deleter;
	cap = PyCapsule_New(t, "dltensor", dlpack_capsule_destructor);
	if (!cap) {
		Py_DECREF(self);
		free(t);
	}
	return cap;
}

static PyObject *view_dlpack_device(PyObject *self, PyObject *unused) {
	ViewObject *v = (ViewObject *)self;

	(void)unused;
	return Py_BuildValue("(ii)", v->device ? kDLCUDA : kDLCPU, v->device_id);
}

static PyObject *view_get_address(PyObject *self, void *closure) {
	(void)closure;
	return PyLong_FromVoidPtr(((ViewObject *)self)->data);
}

static PyObject *view_get_shape(PyObject *self, void *closure) {
	ViewObject *v = (ViewObject *)self;
	PyObject *t = PyTuple_New(v->ndim);

	(void)closure;
	for (int i = 0; t && i < v->ndim; i++)
		PyTuple_SetItem(t, i, PyLong_FromSsize_t(v->shape[i]));
	return t;
}

static PyObject *view_get_dtype(PyObject *self, void *closure) {
	(void)closure;
	return PyUnicode_FromString(dtypes[((ViewObject *)self)->dtype].name);
}

static PyObject *view_get_device(PyObject *self, void *closure) {
	ViewObject *v = (ViewObject *)self;

	(void)closure;
	return v->device ? PyUnicode_FromFormat("cuda:%d", v->device_id) : PyUnicode_FromString("cpu");
}

static PyMethodDef view_methods[] = {
	{ "__dlpack__", (PyCFunction)(void (*)(void))view_dlpack, METH_VARARGS | METH_KEYWORDS,
	  "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None)\n--\n\n"
	  "A DLPack capsule of the memory, which keeps this view alive." },
	{ "__dlpack_device__", view_dlpack_device, METH_NOARGS,
	  "(device type, device id): kDLCPU (1) or kDLCUDA (2)." },
	{ NULL },
};

static PyGetSetDef view_getset[] = {
	{ "address", view_get_address, NULL, "The memory's address in this process.", NULL },
	{ "shape", view_get_shape, NULL, "Shape, C order.", NULL },
	{ "dtype", view_get_dtype, NULL, "Element type: float16, bfloat16, float32, int32, uint8.", NULL },
	{ "device", view_get_device, NULL, "'cpu' or 'cuda:N'.", NULL },
	{ NULL },
};

static PyType_Slot view_slots[] = {
	{ Py_tp_doc, "Memory of kvd without a copy: numpy.asarray(v), memoryview(v), "
	             "torch.from_dlpack(v). Keeps its sequence pinned (K/V) or its client's "
	             "range reserved while it, or anything made from it, lives." },
	{ Py_tp_dealloc, view_dealloc },
	{ Py_tp_methods, view_methods },
	{ Py_tp_getset, view_getset },
	{ Py_bf_getbuffer, view_getbuffer },
	{ 0, NULL },
};

static PyType_Spec view_spec = {
	.name = "kvd._kvd.View",
	.basicsize = sizeof(ViewObject),
	.flags = Py_TPFLAGS_DEFAULT,
	.slots = view_slots,
};

/* ---- Client ---- */

static kvd_client *client_open(ClientObject *self) {
	if (!self->c)
		PyErr_SetString(PyExc_ValueError, "the client is closed");
	return self->c;
}

static PyObject *client_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
	static char *kwlist[] = { "socket", "tenant", "timeout_ms", "ring", "device", NULL };
	const char *socket = NULL, *tenant = NULL;
	unsigned int timeout_ms = 0;
	int ring = 1, r, memory, want = -1;
	int32_t device = -1;
	kvd_connect_params p = { .size = sizeof(p) };
	kvd_client *c = NULL;
	ClientObject *self;

	if (!PyArg_ParseTupleAndKeywords(args, kwds, "|zz$Ipi", kwlist, &socket, &tenant,
	                                 &timeout_ms, &ring, &want))
		return NULL;
	if (want < -1) {
		PyErr_SetString(PyExc_ValueError, "device must be a CUDA ordinal, or -1");
		return NULL;
	}
	p.socket_path = socket;
	p.tenant = tenant;
	p.timeout_ms = timeout_ms;
	p.flags = ring ? 0 : KVD_CONNECT_NO_RING;
	if (want >= 0) {
		p.flags |= KVD_CONNECT_DEVICE;
		p.device = (uint32_t)want;
	}
	Py_BEGIN_ALLOW_THREADS
	r = kvd_client_connect_params(&p, &c);
	Py_END_ALLOW_THREADS
	/* The failed connect's message has no client to ask: libkvd keeps it for NULL. */
	if (r < 0)
		return raise_kvd_msg(r, kvd_client_last_error(NULL));
	memory = kvd_client_memory(c, &device);
	self = (ClientObject *)PyType_GenericAlloc(type, 0);
	if (!self) {
		kvd_client_unref(c);
		return NULL;
	}
	self->models = PyDict_New();
	if (!self->models) {
		Py_DECREF(self);
		return NULL;
	}
	self->c = c;
	self->memory = memory;
	self->device = device;
	return (PyObject *)self;
}

static void client_dealloc(PyObject *self) {
	PyTypeObject *tp = Py_TYPE(self);
	ClientObject *c = (ClientObject *)self;

	if (c->c) {
		Py_BEGIN_ALLOW_THREADS
		kvd_client_unref(c->c);
		Py_END_ALLOW_THREADS
	}
	Py_XDECREF(c->models);
	((freefunc)PyType_GetSlot(tp, Py_tp_free))(self);
	Py_DECREF(tp);
}

/*
 * Raises BufferError when Views of c's memory live: closing or reconnecting unmaps every
 * chunk and the block range, and an array over them would then crash its reader.
 */
static bool views_alive(const ClientObject *c) {
	if (c->views == 0)
		return false;
	PyErr_Format(PyExc_BufferError, "%zd views of this client's memory (its block range, its "
	             "sequences' K/V and windows) are alive: drop them (and the arrays and tensors "
	             "made from them) first", c->views);
	return true;
}

static PyObject *client_close(PyObject *self, PyObject *unused) {
	ClientObject *c = (ClientObject *)self;
	kvd_client *k = c->c;

	(void)unused;
	if (views_alive(c))
		return NULL;
	c->c = NULL;
	if (k) {
		Py_BEGIN_ALLOW_THREADS
		kvd_client_unref(k);
		Py_END_ALLOW_THREADS
	}
	Py_RETURN_NONE;
}

static PyObject *client_enter(PyObject *self, PyObject *unused) {
	(void)unused;
	return Py_NewRef(self);
}

static PyObject *client_exit(PyObject *self, PyObject *args) {
	(void)args;
	return client_close(self, NULL);
}

/* A call that returns an int (>= 0 or -errno), without the GIL. */
#define CALL_NOGIL(r, expr)            \
	do {                           \
		Py_BEGIN_ALLOW_THREADS \
		r = (expr);            \
		Py_END_ALLOW_THREADS   \
	} while (0)

/* A registered model's shape, as the client's models dict keeps it. */
struct py_model {
	unsigned int q_heads, window, head_dim, layers, kv_heads, dtype, block_tokens, layout;
};

/* The shape of model as registered through co; -1 with ValueError when it was not. */
static int model_get(ClientObject *co, int model, struct py_model *ret) {
	PyObject *key = PyLong_FromLong(model), *v;

	v = key ? PyDict_GetItemWithError(co->models, key) : NULL;
	Py_XDECREF(key);
	if (!v) {
		if (!PyErr_Occurred())
			PyErr_Format(PyExc_ValueError, "model %d was not registered through this client",
			             model);
		return -1;
	}
	return PyArg_ParseTuple(v, "IIIIIIII", &ret->q_heads, &ret->window, &ret->head_dim,
	                        &ret->layers, &ret->kv_heads, &ret->dtype, &ret->block_tokens,
	                        &ret->layout) ? 0 : -1;
}

static PyObject *client_register_model(PyObject *self, PyObject *args, PyObject *kwds) {
	static char *kwlist[] = { "layers", "q_heads", "kv_heads", "head_dim", "dtype",
	                          "block_tokens", "layout", "name", "unit", "window", "sinks",
	                          "compensation", "index_heads", "index_dim", NULL };
	kvd_model_params p = { .size = sizeof(p) };
	kvd_client *c = client_open((ClientObject *)self);
	const char *name = NULL;
	unsigned int sinks = KVD_SINKS_DEFAULT;
	int r;

	if (!c)
		return NULL;
	p.spec.layout = KVD_LAYOUT_PER_LAYER;
	if (!PyArg_ParseTupleAndKeywords(args, kwds, "IIIIII|I$zIIIIII", kwlist, &p.spec.layers,
	                                 &p.spec.q_heads, &p.spec.kv_heads, &p.spec.head_dim,
	                                 &p.spec.dtype, &p.spec.block_tokens, &p.spec.layout, &name,
	                                 &p.eviction.unit, &p.eviction.window, &sinks,
	                                 &p.compensation, &p.index.heads, &p.index.dim))
		return NULL;
	p.spec.name = name;
	p.eviction.sinks = sinks;
	CALL_NOGIL(r, kvd_model_register_params(c, &p));
	if (r < 0)
		return raise_kvd(c, r);
	{
		PyObject *key = PyLong_FromLong(r), *value = Py_BuildValue("(IIIIIIII)", p.spec.q_heads,
		        p.eviction.window ? p.eviction.window : KVD_WINDOW_DEFAULT, p.spec.head_dim,
		        p.spec.layers, p.spec.kv_heads, p.spec.dtype, p.spec.block_tokens,
		        p.spec.layout);
		int k = key && value ? PyDict_SetItem(((ClientObject *)self)->models, key, value) : -1;

		Py_XDECREF(key);
		Py_XDECREF(value);
		if (k < 0)
			return NULL;
	}
	return PyLong_FromLong(r);
}

static PyObject *client_model_spec(PyObject *self, PyObject *args) {
	struct py_model m;
	int model;

	if (!client_open((ClientObject *)self) || !PyArg_ParseTuple(args, "i", &model) ||
	    model_get((ClientObject *)self, model, &m) < 0)
		return NULL;
	return Py_BuildValue("{sIsIsIsIsIsIsIsI}", "layers", m.layers, "q_heads", m.q_heads,
	                     "kv_heads", m.kv_heads, "head_dim", m.head_dim, "dtype", m.dtype,
	                     "block_tokens", m.block_tokens, "layout", m.layout, "window", m.window);
}

static PyObject *client_output_proj(PyObject *self, PyObject *args) {
	ClientObject *co = (ClientObject *)self;
	kvd_client *c = client_open(co);
	unsigned int layer, dtype, hidden;
	struct py_model m;
	Py_buffer b;
	size_t elem;
	int model, r;

	if (!c)
		return NULL;
	if (!PyArg_ParseTuple(args, "iIIIy*", &model, &layer, &dtype, &hidden, &b))
		return NULL;
	/* libkvd reads hidden * q_heads * head_dim elements: the buffer must hold them. */
	elem = dtype == KVD_DTYPE_F32 ? 4 : dtype == KVD_DTYPE_F16 || dtype == KVD_DTYPE_BF16 ? 2 : 0;
	if (model_get(co, model, &m) < 0 || elem == 0 ||
	    (size_t)b.len != (size_t)hidden * m.q_heads * m.head_dim * elem) {
		PyBuffer_Release(&b);
		if (!PyErr_Occurred())
			PyErr_SetString(PyExc_ValueError, elem ?
			                "wo must hold hidden x q_heads * head_dim elements of dtype" :
			                "unknown dtype");
		return NULL;
	}
	CALL_NOGIL(r, kvd_model_output_proj(c, model, layer, dtype, hidden, b.buf));
	PyBuffer_Release(&b);
	return r < 0 ? raise_kvd(c, r) : Py_NewRef(Py_None);
}

static PyObject *seq_wrap(ClientObject *client, kvd_seq *s, int model);

static PyObject *client_open_seq(PyObject *self, PyObject *args, PyObject *kwds) {
	static char *kwlist[] = { "model", "max_tokens", "prefix_keys", "group_size", "group_of",
		                  "prefix_tokens", NULL };
	kvd_client *c = client_open((ClientObject *)self);
	kvd_open_params p = { .size = sizeof(p) };
	Py_buffer keys = { .buf = NULL };
	PyObject *key_obj = Py_None, *tok_obj = Py_None;
	Py_buffer toks = { .buf = NULL };
	kvd_seq *s = NULL;
	int r;

	if (!c)
		return NULL;
	if (!PyArg_ParseTupleAndKeywords(args, kwds, "iI|O$IKO", kwlist, &p.model_id, &p.max_tokens,
	                                 &key_obj, &p.group_size, &p.group_of, &tok_obj))
		return NULL;
	if (tok_obj != Py_None) {
		struct py_model spec;

		if (PyObject_GetBuffer(tok_obj, &toks, PyBUF_SIMPLE) < 0)
			return NULL;
		/* The blocks' token ids, uint32: as many as the keys' blocks hold. */
		if (key_obj == Py_None || model_get((ClientObject *)self, p.model_id, &spec) < 0 ||
		    (size_t)toks.len != PyObject_Length(key_obj) / KVD_KEY_BYTES * spec.block_tokens *
		                        sizeof(uint32_t)) {
			PyBuffer_Release(&toks);
			if (!PyErr_Occurred())
				PyErr_SetString(PyExc_ValueError, "prefix_tokens must be the uint32 token ids "
				                "of the prefix keys' blocks");
			return NULL;
		}
		p.prefix_tokens = toks.buf;
	}
	if (key_obj != Py_None && PyObject_GetBuffer(key_obj, &keys, PyBUF_SIMPLE) < 0)
		return NULL;
	if (keys.buf) {
		if (keys.len == 0 || keys.len % KVD_KEY_BYTES != 0 ||
		    keys.len / KVD_KEY_BYTES > UINT32_MAX) {
			PyBuffer_Release(&keys);
			PyErr_SetString(PyExc_ValueError, "prefix_keys must be keys of 32 bytes, end to end");
			return NULL;
		}
		p.prefix_keys = keys.buf;
		p.n_prefix_keys = (uint32_t)(keys.len / KVD_KEY_BYTES);
	}
	CALL_NOGIL(r, kvd_seq_open_params(c, &p, &s));
	if (keys.buf)
		PyBuffer_Release(&keys);
	if (toks.buf)
		PyBuffer_Release(&toks);
	if (r < 0)
		return raise_kvd(c, r);
	return seq_wrap((ClientObject *)self, s, p.model_id);
}

static PyObject *client_lookup(PyObject *self, PyObject *args) {
	kvd_client *c = client_open((ClientObject *)self);
	uint32_t cached = 0;
	Py_buffer keys;
	int model;
	int64_t r;

	if (!c || !PyArg_ParseTuple(args, "iy*", &model, &keys))
		return NULL;
	if (keys.len == 0 || keys.len % KVD_KEY_BYTES != 0 || keys.len / KVD_KEY_BYTES > UINT32_MAX) {
		PyBuffer_Release(&keys);
		PyErr_SetString(PyExc_ValueError, "keys must be keys of 32 bytes, end to end");
		return NULL;
	}
	CALL_NOGIL(r, kvd_prefix_lookup(c, model, keys.buf, (uint32_t)(keys.len / KVD_KEY_BYTES),
	                                &cached));
	PyBuffer_Release(&keys);
	if (r < 0)
		return raise_kvd(c, (int)r);
	return Py_BuildValue("(LI)", (long long)r, cached);
}

static kvd_seq *seq_open(SeqObject *so);

/* The open sequences of list, a non-empty sequence of co's Seq objects, into a new array in
 * *ret (n of them): borrowed, since the list holds its items. Returns 0, or -1 with an
 * exception. */
static int seqs_of(ClientObject *co, PyObject *list, kvd_seq ***ret, Py_ssize_t *ret_n) {
	struct module_state *st = state_any();
	Py_ssize_t n = PySequence_Size(list);
	kvd_seq **seqs;

	if (n < 0)
		return -1;
	if (n == 0) {
		PyErr_SetString(PyExc_ValueError, "no sequences");
		return -1;
	}
	seqs = calloc((size_t)n, sizeof(*seqs));
	if (!seqs) {
		PyErr_NoMemory();
		return -1;
	}
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *o = PySequence_GetItem(list, i);
		bool ours = o && PyObject_TypeCheck(o, st->seq_type) && ((SeqObject *)o)->client == co;

		if (ours)
			seqs[i] = seq_open((SeqObject *)o);
		Py_XDECREF(o);
		if (!ours && !PyErr_Occurred())
			PyErr_SetString(PyExc_ValueError, "seqs must be this client's Seq objects");
		if (!ours || !seqs[i]) {
			free(seqs);
			return -1;
		}
	}
	*ret = seqs;
	*ret_n = n;
	return 0;
}

/* kvd_seqs_grow (tokens > 0), kvd_seqs_pin (pin) or kvd_seqs_unpin of the sequences of
 * list: each one's result in a list. */
static PyObject *client_step(ClientObject *co, PyObject *list, uint32_t tokens, bool pin) {
	PyObject *ret = NULL;
	kvd_seq **seqs;
	int *codes;
	Py_ssize_t n;
	int r;

	if (!client_open(co) || seqs_of(co, list, &seqs, &n) < 0)
		return NULL;
	codes = n <= UINT32_MAX ? malloc((size_t)n * sizeof(*codes)) : NULL;
	if (!codes) {
		free(seqs);
		return PyErr_NoMemory();
	}
	/* No result is positive but a pin's recall, at most KVD_RECALL_FILE. */
	codes[0] = INT_MAX;
	CALL_NOGIL(r, tokens ? kvd_seqs_grow(seqs, (uint32_t)n, tokens, codes) :
	              pin ? kvd_seqs_pin(seqs, (uint32_t)n, codes) :
	                    kvd_seqs_unpin(seqs, (uint32_t)n, codes));
	/* Refused before anything was sent. */
	if (r < 0 && codes[0] == INT_MAX)
		raise_kvd(co->c, r);
	else
		ret = PyList_New(n);
	for (Py_ssize_t i = 0; ret && i < n; i++) {
		PyObject *v = PyLong_FromLong(codes[i]);

		if (!v || PyList_SetItem(ret, i, v) < 0)
			Py_CLEAR(ret);
	}
	free(codes);
	free(seqs);
	return ret;
}

static PyObject *client_grow_batch(PyObject *self, PyObject *args) {
	unsigned int tokens;
	PyObject *list;

	if (!PyArg_ParseTuple(args, "OI", &list, &tokens))
		return NULL;
	if (tokens == 0) {
		PyErr_SetString(PyExc_ValueError, "tokens must be 1 or more");
		return NULL;
	}
	return client_step((ClientObject *)self, list, tokens, false);
}

static PyObject *client_pin_batch(PyObject *self, PyObject *list) {
	return client_step((ClientObject *)self, list, 0, true);
}

static PyObject *client_unpin_batch(PyObject *self, PyObject *list) {
	return client_step((ClientObject *)self, list, 0, false);
}

static PyObject *client_block_tables(PyObject *self, PyObject *args, PyObject *kwds) {
	static char *kwlist[] = { "seqs", "layer", "layers", "kv_head", NULL };
	ClientObject *co = (ClientObject *)self;
	unsigned int layer, layers = 1, head = 0, width = 1;
	kvd_seq **seqs = NULL;
	int32_t *tables = NULL, *lens = NULL;
	PyObject *list, *ret = NULL;
	ViewObject *tv = NULL, *lv;
	Py_ssize_t n, shape[3];
	int r;

	if (!client_open(co) || !PyArg_ParseTupleAndKeywords(args, kwds, "OI|II", kwlist, &list,
	                                                     &layer, &layers, &head))
		return NULL;
	if (layers == 0) {
		PyErr_SetString(PyExc_ValueError, "no layers");
		return NULL;
	}
	if (seqs_of(co, list, &seqs, &n) < 0)
		return NULL;
	for (Py_ssize_t i = 0; i < n; i++) {
		/* Room for the widest row as the tables are now, and a block more. */
		for (unsigned int l = layer; l < layer + layers; l++) {
			int64_t tokens = kvd_seq_tokens(seqs[i], l, head);
			uint32_t bt = kvd_seq_header(seqs[i])->block_tokens;

			if (tokens < 0) {
				raise_kvd(co->c, (int)tokens);
				goto out;
			}
			if ((tokens + bt - 1) / bt + 1 > width)
				width = (unsigned int)((tokens + bt - 1) / bt + 1);
		}
	}
	tables = malloc((size_t)layers * n * width * sizeof(*tables));
	lens = malloc((size_t)layers * n * sizeof(*lens));
	if (!tables || !lens) {
		PyErr_NoMemory();
		goto out;
	}
	r = kvd_seq_block_tables(seqs, (uint32_t)n, layer, layers, head, tables, width, lens);
	if (r < 0) {
		raise_kvd(co->c, r);
		goto out;
	}
	/* Rows as wide as the widest: the spare column goes. */
	for (size_t k = 1; k < (size_t)layers * n; k++)
		memmove(tables + k * r, tables + k * width, (size_t)r * sizeof(*tables));
	shape[0] = layers, shape[1] = n, shape[2] = r;
	tv = view_new(NULL, tables, DT_I32, 3, shape, false);
	if (!tv)
		goto out;
	tv->owns_data = true;
	tables = NULL;
	lv = view_new(NULL, lens, DT_I32, 2, shape, false);
	if (!lv)
		goto out;
	lv->owns_data = true;
	lens = NULL;
	ret = Py_BuildValue("(NN)", (PyObject *)tv, (PyObject *)lv);
	tv = NULL;
out:
	Py_XDECREF((PyObject *)tv);
	free(seqs);
	free(tables);
	free(lens);
	return ret;
}

static PyObject *client_block_pool(PyObject *self, PyObject *args) {
	ClientObject *co = (ClientObject *)self;
	kvd_client *c = client_open(co);
	uint64_t stride;
	uint32_t n;
	Py_ssize_t shape[2];
	ViewObject *v;
	void *base;
	int model, r;

	if (!c)
		return NULL;
	if (!PyArg_ParseTuple(args, "i", &model))
		return NULL;
	r = kvd_model_block_pool(c, model, &base, &stride, &n);
	if (r < 0)
		return raise_kvd(c, r);
	shape[0] = n;
	shape[1] = (Py_ssize_t)stride;
	v = view_new(self, base, DT_U8, 2, shape, false);
	if (!v)
		return NULL;
	v->device = co->memory == KVD_MEMORY_CUDA;
	v->device_id = co->device < 0 ? 0 : co->device;
	co->views++;
	return Py_BuildValue("(NK)", (PyObject *)v, (unsigned long long)stride);
}

static PyObject *client_next_event(PyObject *self, PyObject *unused) {
	kvd_client *c = client_open((ClientObject *)self);
	kvd_event ev;
	int r;

	(void)unused;
	if (!c)
		return NULL;
	CALL_NOGIL(r, kvd_client_next_event(c, &ev));
	if (r < 0)
		return raise_kvd(c, r);
	if (r == 0)
		Py_RETURN_NONE;
	return Py_BuildValue("(IK)", ev.type, (unsigned long long)ev.arg);
}

static PyObject *client_fileno(PyObject *self, PyObject *unused) {
	kvd_client *c = client_open((ClientObject *)self);
	int r;

	(void)unused;
	if (!c)
		return NULL;
	r = kvd_client_get_event_fd(c);
	return r < 0 ? raise_kvd(c, r) : PyLong_FromLong(r);
}

static PyObject *client_reconnect(PyObject *self, PyObject *args) {
	ClientObject *co = (ClientObject *)self;
	kvd_client *c = client_open(co);
	unsigned int timeout_ms = 10000;
	int32_t device = -1;
	int r;

	if (!c || !PyArg_ParseTuple(args, "|I", &timeout_ms))
		return NULL;
	if (views_alive(co))
		return NULL;
	CALL_NOGIL(r, kvd_client_reconnect(c, timeout_ms));
	if (r < 0)
		return raise_kvd(c, r);
	co->memory = kvd_client_memory(c, &device);
	co->device = device;
	/* Models are the lost connection's: they are registered again, with new ids. */
	PyDict_Clear(co->models);
	Py_RETURN_NONE;
}

static PyObject *client_set_ring(PyObject *self, PyObject *args) {
	kvd_client *c = client_open((ClientObject *)self);
	int enable, r;

	if (!c || !PyArg_ParseTuple(args, "p", &enable))
		return NULL;
	r = kvd_client_set_ring(c, enable);
	return r < 0 ? raise_kvd(c, r) : Py_NewRef(Py_None);
}

/* The budget of budget_set() and budget_plan(): bytes, or percent= of the pool; force=. */
static int budget_params(PyObject *args, PyObject *kwds, kvd_budget_params *p) {
	static char *kwlist[] = { "bytes", "percent", "force", NULL };
	PyObject *bytes = Py_None;
	unsigned int percent = 0;
	int force = 0;

	*p = (kvd_budget_params){ .size = sizeof(*p) };
	if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O$Ip", kwlist, &bytes, &percent, &force))
		return -1;
	if ((bytes == Py_None) == (percent == 0)) {
		PyErr_SetString(PyExc_TypeError, "give the budget in bytes or as percent=, one of them");
		return -1;
	}
	if (bytes != Py_None) {
		p->bytes = PyLong_AsUnsignedLongLong(bytes);
		if (PyErr_Occurred())
			return -1;
	}
	p->percent = percent;
	p->flags = force ? KVD_BUDGET_FORCE : 0;
	return 0;
}

static PyObject *client_budget_set(PyObject *self, PyObject *args, PyObject *kwds) {
	kvd_client *c = client_open((ClientObject *)self);
	kvd_budget_params p;
	int r;

	if (!c || budget_params(args, kwds, &p) < 0)
		return NULL;
	CALL_NOGIL(r, kvd_budget_set_params(c, &p));
	return r < 0 ? raise_kvd(c, r) : PyBool_FromLong(r == 0);
}

/* The change of tenant_set() and tenant_plan(): the fields given, by keyword. */
static int tenant_params(PyObject *args, PyObject *kwds, const char **tenant, kvd_tenant_params *p) {
	static char *kwlist[] = { "tenant", "min_bytes", "max_bytes", "weight", "policy", "tier",
		                  "recall", NULL };
	PyObject *min = Py_None, *max = Py_None, *weight = Py_None, *recall = Py_None;
	const char *policy = NULL, *tier = NULL;

	*p = (kvd_tenant_params){ .size = sizeof(*p) };
	if (!PyArg_ParseTupleAndKeywords(args, kwds, "s|$OOOzzO", kwlist, tenant, &min, &max, &weight,
	                                 &policy, &tier, &recall))
		return -1;
	if (min != Py_None) {
		p->set |= KVD_TENANT_SET_MIN;
		p->min_bytes = PyLong_AsUnsignedLongLong(min);
	}
	if (max != Py_None) {
		p->set |= KVD_TENANT_SET_MAX;
		p->max_bytes = PyLong_AsUnsignedLongLong(max);
	}
	if (weight != Py_None) {
		p->set |= KVD_TENANT_SET_WEIGHT;
		p->weight = (uint32_t)PyLong_AsUnsignedLong(weight);
	}
	if (policy) {
		p->set |= KVD_TENANT_SET_POLICY;
		p->policy = policy;
	}
	if (tier) {
		p->set |= KVD_TENANT_SET_TIER;
		p->tier = tier;
	}
	if (recall != Py_None) {
		unsigned long v = PyLong_AsUnsignedLong(recall);

		if (!PyErr_Occurred() && v > UINT32_MAX)
			PyErr_SetString(PyExc_OverflowError, "recall: at most 2^32 - 1 tokens");
		p->set |= KVD_TENANT_SET_RECALL;
		p->recall = (uint32_t)v;
	}
	return PyErr_Occurred() ? -1 : 0;
}

static PyObject *client_tenant_set(PyObject *self, PyObject *args, PyObject *kwds) {
	kvd_client *c = client_open((ClientObject *)self);
	kvd_tenant_params p;
	const char *tenant;
	int r;

	if (!c || tenant_params(args, kwds, &tenant, &p) < 0)
		return NULL;
	CALL_NOGIL(r, kvd_tenant_set_params(c, tenant, &p));
	return r < 0 ? raise_kvd(c, r) : PyBool_FromLong(r == 0);
}

/* budget_reset(), tenant_reset(name), tenant_delete(name). */
static PyObject *client_reset(PyObject *self, PyObject *args, int which) {
	kvd_client *c = client_open((ClientObject *)self);
	const char *tenant = NULL;
	int r;

	/* budget_reset is METH_NOARGS: it gets no tuple at all. */
	if (!c || (which != 0 && !PyArg_ParseTuple(args, "s", &tenant)))
		return NULL;
	CALL_NOGIL(r, which == 0 ? kvd_budget_reset(c) :
	              which == 1 ? kvd_tenant_reset(c, tenant) : kvd_tenant_delete(c, tenant));
	return r < 0 ? raise_kvd(c, r) : PyBool_FromLong(r == 0);
}

static PyObject *client_budget_reset(PyObject *self, PyObject *args) {
	return client_reset(self, args, 0);
}

static PyObject *client_tenant_reset(PyObject *self, PyObject *args) {
	return client_reset(self, args, 1);
}

static PyObject *client_tenant_delete(PyObject *self, PyObject *args) {
	return client_reset(self, args, 2);
}

static PyObject *client_evict(PyObject *self, PyObject *args, PyObject *kwds) {
	static char *kwlist[] = { "bytes", "tenant", NULL };
	kvd_client *c = client_open((ClientObject *)self);
	unsigned long long bytes = 0;
	const char *tenant = NULL;
	uint64_t freed = 0;
	int r;

	if (!c || !PyArg_ParseTupleAndKeywords(args, kwds, "|K$z", kwlist, &bytes, &tenant))
		return NULL;
	CALL_NOGIL(r, kvd_evict(c, tenant, bytes, &freed));
	return r < 0 ? raise_kvd(c, r) : PyLong_FromUnsignedLongLong(freed);
}

/* One eviction round as a dict, by the keys kvd.h lists for kvd_evictions. */
static PyObject *eviction_round(const kvd_evictions *e, uint32_t round) {
	static const char *const u64_keys[] = { "id", "start_ms", "duration_us", "score_us",
		                                "select_us", "compact_us", "target_bytes",
		                                "freed_bytes", "sequences", "units",
		                                "planned_bytes", "waiting_bytes", "dropped_bytes" };
	static const char *const str_keys[] = { "trigger", "error", "note" };
	PyObject *d = PyDict_New(), *tenants = NULL, *v;
	const char *str;
	uint64_t u;
	double x;

	if (!d)
		return NULL;
	for (size_t i = 0; i < sizeof(u64_keys) / sizeof(u64_keys[0]); i++)
		if (kvd_evictions_u64(e, round, u64_keys[i], &u) == 0) {
			v = PyLong_FromUnsignedLongLong(u);
			if (!v || PyDict_SetItemString(d, u64_keys[i], v) < 0)
				goto fail;
			Py_DECREF(v);
		}
	for (size_t i = 0; i < sizeof(str_keys) / sizeof(str_keys[0]); i++)
		if (kvd_evictions_str(e, round, str_keys[i], &str) == 0) {
			v = PyUnicode_FromString(str);
			if (!v || PyDict_SetItemString(d, str_keys[i], v) < 0)
				goto fail;
			Py_DECREF(v);
		}
	if (kvd_evictions_double(e, round, "predicted_error", &x) == 0) {
		v = PyFloat_FromDouble(x);
		if (!v || PyDict_SetItemString(d, "predicted_error", v) < 0)
			goto fail;
		Py_DECREF(v);
	}
	tenants = PyList_New(0);
	for (uint32_t i = 0; tenants && i < kvd_evictions_tenants(e, round); i++) {
		uint64_t freed, tokens;
		const char *name;

		if (kvd_evictions_tenant(e, round, i, &name, &freed, &tokens) < 0)
			continue;
		v = Py_BuildValue("{s:s,s:K,s:K}", "name", name, "freed_bytes",
		                  (unsigned long long)freed, "evicted_tokens", (unsigned long long)tokens);
		if (v && kvd_evictions_tenant_double(e, round, i, "predicted_error", &x) == 0) {
			PyObject *px = PyFloat_FromDouble(x);

			if (!px || PyDict_SetItemString(v, "predicted_error", px) < 0) {
				Py_XDECREF(px);
				goto fail;
			}
			Py_DECREF(px);
		}
		if (!v || PyList_Append(tenants, v) < 0)
			goto fail;
		Py_DECREF(v);
	}
	v = NULL;
	if (!tenants || PyDict_SetItemString(d, "tenants", tenants) < 0)
		goto fail;
	Py_DECREF(tenants);
	return d;
fail:
	Py_XDECREF(v);
	Py_XDECREF(tenants);
	Py_DECREF(d);
	return NULL;
}

static PyObject *client_evictions(PyObject *self, PyObject *unused) {
	kvd_client *c = client_open((ClientObject *)self);
	kvd_evictions *e = NULL;
	PyObject *list;
	int r;

	(void)unused;
	if (!c)
		return NULL;
	CALL_NOGIL(r, kvd_evictions_get(c, &e));
	if (r < 0)
		return raise_kvd(c, r);
	list = PyList_New(0);
	for (uint32_t i = 0; list && i < kvd_evictions_count(e); i++) {
		PyObject *d = eviction_round(e, i);

		if (!d || PyList_Append(list, d) < 0) {
			Py_XDECREF(d);
			Py_CLEAR(list);
			break;
		}
		Py_DECREF(d);
	}
	kvd_evictions_free(e);
	return list;
}

/* A dry run's answer: its one round, as evictions() gives rounds. */
static PyObject *plan_result(kvd_client *c, int r, kvd_evictions *e) {
	PyObject *d;

	if (r < 0)
		return raise_kvd(c, r);
	d = eviction_round(e, 0);
	kvd_evictions_free(e);
	return d;
}

static PyObject *client_budget_plan(PyObject *self, PyObject *args, PyObject *kwds) {
	kvd_client *c = client_open((ClientObject *)self);
	kvd_evictions *e = NULL;
	kvd_budget_params p;
	int r;

	if (!c || budget_params(args, kwds, &p) < 0)
		return NULL;
	CALL_NOGIL(r, kvd_budget_plan(c, &p, &e));
	return plan_result(c, r, e);
}

static PyObject *client_tenant_plan(PyObject *self, PyObject *args, PyObject *kwds) {
	kvd_client *c = client_open((ClientObject *)self);
	kvd_evictions *e = NULL;
	kvd_tenant_params p;
	const char *tenant;
	int r;

	if (!c || tenant_params(args, kwds, &tenant, &p) < 0)
		return NULL;
	CALL_NOGIL(r, kvd_tenant_plan(c, tenant, &p, &e));
	return plan_result(c, r, e);
}

static PyObject *client_evict_plan(PyObject *self, PyObject *args, PyObject *kwds) {
	static char *kwlist[] = { "bytes", "tenant", NULL };
	kvd_client *c = client_open((ClientObject *)self);
	unsigned long long bytes = 0;
	const char *tenant = NULL;
	kvd_evictions *e = NULL;
	int r;

	if (!c || !PyArg_ParseTupleAndKeywords(args, kwds, "|K$z", kwlist, &bytes, &tenant))
		return NULL;
	CALL_NOGIL(r, kvd_evict_plan(c, tenant, bytes, &e));
	return plan_result(c, r, e);
}

/* A kvd_table as a list of dicts, by the keys kvd.h lists for it. */
static PyObject *table_rows(const kvd_table *t, const char *const *u64_keys, size_t n_u64,
                            const char *const *str_keys, size_t n_str) {
	PyObject *list = PyList_New(0);

	for (uint32_t i = 0; list && i < kvd_table_rows(t); i++) {
		PyObject *d = PyDict_New(), *v = NULL;
		const char *s;
		uint64_t u;
		bool ok = d != NULL;

		for (size_t k = 0; ok && k < n_u64 + n_str; k++) {
			if (k < n_u64 ? kvd_table_u64(t, i, u64_keys[k], &u) != 0 :
			                kvd_table_str(t, i, str_keys[k - n_u64], &s) != 0)
				continue;
			v = k < n_u64 ? PyLong_FromUnsignedLongLong(u) : PyUnicode_FromString(s);
			ok = v && PyDict_SetItemString(d, k < n_u64 ? u64_keys[k] : str_keys[k - n_u64], v) == 0;
			Py_XDECREF(v);
		}
		if (!ok || PyList_Append(list, d) < 0)
			Py_CLEAR(list);
		Py_XDECREF(d);
	}
	return list;
}

/* connections() and sequences(tenant): a listing as a list of dicts. */
static PyObject *listing(PyObject *self, bool sequences, const char *tenant) {
	static const char *const conn_u64[] = { "id", "pid", "uid", "age_ms", "sequences", "pinned",
		                                "bytes", "outstanding", "ring", "device" };
	static const char *const conn_str[] = { "tenant", "process" };
	static const char *const seq_u64[] = { "id", "connection", "tokens", "max_tokens", "pins",
		                               "bytes", "evictable", "evicted_tokens", "evicted_bytes",
		                               "waiting_bytes", "layers", "kv_heads", "head_dim" };
	static const char *const seq_str[] = { "tenant" };
	kvd_client *c = client_open((ClientObject *)self);
	kvd_table *t = NULL;
	PyObject *list;
	int r;

	if (!c)
		return NULL;
	CALL_NOGIL(r, sequences ? kvd_sequences_get(c, tenant, &t) : kvd_connections_get(c, &t));
	if (r < 0)
		return raise_kvd(c, r);
	list = sequences ? table_rows(t, seq_u64, sizeof(seq_u64) / sizeof(seq_u64[0]), seq_str,
	                              sizeof(seq_str) / sizeof(seq_str[0])) :
	                   table_rows(t, conn_u64, sizeof(conn_u64) / sizeof(conn_u64[0]), conn_str,
	                              sizeof(conn_str) / sizeof(conn_str[0]));
	kvd_table_free(t);
	return list;
}

static PyObject *client_connections(PyObject *self, PyObject *unused) {
	(void)unused;
	return listing(self, false, NULL);
}

static PyObject *client_sequences(PyObject *self, PyObject *args, PyObject *kwds) {
	static char *kwlist[] = { "tenant", NULL };
	const char *tenant = NULL;

	if (!PyArg_ParseTupleAndKeywords(args, kwds, "|z", kwlist, &tenant))
		return NULL;
	return listing(self, true, tenant);
}

static PyObject *client_disconnect(PyObject *self, PyObject *args) {
	kvd_client *c = client_open((ClientObject *)self);
	unsigned long long id;
	int r;

	if (!c || !PyArg_ParseTuple(args, "K", &id))
		return NULL;
	CALL_NOGIL(r, kvd_disconnect(c, id));
	return r < 0 ? raise_kvd(c, r) : Py_NewRef(Py_None);
}

static PyObject *status_wrap(kvd_status *st);

static PyObject *client_status(PyObject *self, PyObject *unused) {
	kvd_client *c = client_open((ClientObject *)self);
	kvd_status *st = NULL;
	int r;

	(void)unused;
	if (!c)
		return NULL;
	CALL_NOGIL(r, kvd_status_get(c, &st));
	return r < 0 ? raise_kvd(c, r) : status_wrap(st);
}

static PyObject *client_get_chunk_bytes(PyObject *self, void *closure) {
	kvd_client *c = client_open((ClientObject *)self);

	(void)closure;
	return c ? PyLong_FromUnsignedLongLong(kvd_client_chunk_bytes(c)) : NULL;
}

static PyObject *client_get_memory(PyObject *self, void *closure) {
	ClientObject *co = (ClientObject *)self;

	(void)closure;
	return co->memory == KVD_MEMORY_CUDA ? PyUnicode_FromFormat("cuda:%d", co->device) :
	                                       PyUnicode_FromString("cpu");
}

static PyObject *client_get_last_error(PyObject *self, void *closure) {
	ClientObject *co = (ClientObject *)self;

	(void)closure;
	return PyUnicode_FromString(co->c ? kvd_client_last_error(co->c) : "");
}

static PyObject *client_get_closed(PyObject *self, void *closure) {
	(void)closure;
	return PyBool_FromLong(((ClientObject *)self)->c == NULL);
}

static PyMethodDef client_methods[] = {
	{ "close", client_close, METH_NOARGS,
	  "close()\n--\n\nDrops this handle; the connection closes once its sequences are "
	  "released too. BufferError while views of its memory live." },
	{ "__enter__", client_enter, METH_NOARGS, NULL },
	{ "__exit__", client_exit, METH_VARARGS, NULL },
	{ "register_model", (PyCFunction)(void (*)(void))client_register_model,
	  METH_VARARGS | METH_KEYWORDS,
	  "register_model($self, layers, q_heads, kv_heads, head_dim, dtype, block_tokens, "
	  "layout=1, *, name=None, unit=0, window=0, sinks=4, compensation=0, index_heads=0, "
	  "index_dim=0)\n--\n\n"
	  "Registers a model (kvd_model_register_params) and returns its id: layers, q_heads, "
	  "kv_heads, head_dim, dtype (DTYPE_*), block_tokens; layout LAYOUT_PER_LAYER (1) or "
	  "LAYOUT_PER_HEAD; name (needed for prefix sharing); eviction: unit (UNIT_*, 0: none), "
	  "window, sinks; compensation (COMPENSATION_*); the indexer's index_heads, index_dim." },
	{ "model_spec", client_model_spec, METH_VARARGS,
	  "model_spec(model)\n--\n\nThe shape a model was registered with through this client: "
	  "a dict of layers, q_heads, kv_heads, head_dim, dtype, block_tokens, layout and window "
	  "(the default applied). ValueError for a model it did not register." },
	{ "output_proj", client_output_proj, METH_VARARGS,
	  "output_proj(model, layer, dtype, hidden, wo)\n--\n\n"
	  "Gives the daemon layer's W_o (a buffer of hidden x q_heads*head_dim elements)." },
	{ "open", (PyCFunction)(void (*)(void))client_open_seq, METH_VARARGS | METH_KEYWORDS,
	  "open(model, max_tokens, prefix_keys=None, *, group_size=0, group_of=0)\n--\n\nOpens a "
	  "sequence (kvd_seq_open_params): empty, or with prefix_keys (bytes: the prompt's block "
	  "keys end to end, see kvd.prefix_keys) starting with the blocks of them this tenant "
	  "published (seq.tokens() says how many tokens it found); with group_size, the first "
	  "member of a tensor-parallel group whose id is its seq.id, with group_of, a member "
	  "joining that group." },
	{ "lookup", client_lookup, METH_VARARGS,
	  "lookup(model, keys)\n--\n\n(blocks, cached_blocks): the leading blocks of keys (bytes of "
	  "32 a key) this tenant holds for model, as a prefix open would attach them now, and how "
	  "many of them only the prefix cache holds (kvd_prefix_lookup)." },
	{ "grow_batch", client_grow_batch, METH_VARARGS,
	  "grow_batch(seqs, tokens)\n--\n\nGrows each of this client's sequences seqs by tokens "
	  "(kvd_seqs_grow: on the ring, up to 64 behind one doorbell): a list of each one's result, "
	  "0 or a negative errno (a refused one is unchanged, the others grown)." },
	{ "pin_batch", client_pin_batch, METH_O,
	  "pin_batch(seqs)\n--\n\nPins each of seqs (kvd_seqs_pin): a list of each one's result, "
	  "a RECALL_* value or a negative errno." },
	{ "unpin_batch", client_unpin_batch, METH_O,
	  "unpin_batch(seqs)\n--\n\nUnpins each of seqs (kvd_seqs_unpin): a list of each one's "
	  "result, 0 or a negative errno." },
	{ "block_tables", (PyCFunction)(void (*)(void))client_block_tables,
	  METH_VARARGS | METH_KEYWORDS,
	  "block_tables(seqs, layer, layers=1, kv_head=0)\n--\n\n(tables, seq_lens) of this "
	  "client's sequences seqs for layers layer .. layer + layers - 1, in one call "
	  "(kvd_seq_block_tables): Views of int32 [layers][len(seqs)][width], each row a "
	  "sequence's block indices then zeros, and int32 [layers][len(seqs)], its resident "
	  "tokens. Pin the sequences around the step that uses them." },
	{ "block_pool", client_block_pool, METH_VARARGS,
	  "block_pool(model)\n--\n\n(View of uint8[n_blocks][stride] at the range's base, "
	  "stride): block index b of a block table is row b. Only the connection's blocks are "
	  "memory." },
	{ "next_event", client_next_event, METH_NOARGS,
	  "next_event()\n--\n\n(type, arg) of the next event, or None (kvd_client_next_event)." },
	{ "fileno", client_fileno, METH_NOARGS,
	  "fileno()\n--\n\nThe fd that polls readable when events may be pending." },
	{ "reconnect", client_reconnect, METH_VARARGS,
	  "reconnect(timeout_ms=10000)\n--\n\nConnects again after the daemon went away. "
	  "BufferError while views of its memory live." },
	{ "set_ring", client_set_ring, METH_VARARGS,
	  "set_ring(enable)\n--\n\nPer-step calls through the rings (True) or the socket." },
	{ "budget_set", (PyCFunction)(void (*)(void))client_budget_set, METH_VARARGS | METH_KEYWORDS,
	  "budget_set(bytes=None, *, percent=0, force=False)\n--\n\nSets the node budget, in bytes "
	  "or as a percent of the pool (below the floor only with force); False when applied but "
	  "not saved." },
	{ "budget_plan", (PyCFunction)(void (*)(void))client_budget_plan, METH_VARARGS | METH_KEYWORDS,
	  "budget_plan(bytes=None, *, percent=0, force=False)\n--\n\nA dry run of budget_set: the "
	  "round it would start, as a dict like evictions() gives (planned_bytes, tenants with "
	  "freed_bytes, evicted_tokens, predicted_error), changing nothing." },
	{ "tenant_plan", (PyCFunction)(void (*)(void))client_tenant_plan, METH_VARARGS | METH_KEYWORDS,
	  "tenant_plan(tenant, *, min_bytes=None, max_bytes=None, weight=None, policy=None, tier=None, recall=None)\n--\n\n"
	  "A dry run of tenant_set, as budget_plan." },
	{ "evict_plan", (PyCFunction)(void (*)(void))client_evict_plan, METH_VARARGS | METH_KEYWORDS,
	  "evict_plan(bytes=0, *, tenant=None)\n--\n\nA dry run of evict, as budget_plan." },
	{ "connections", client_connections, METH_NOARGS,
	  "connections()\n--\n\nWho is connected, as dicts (kvd_connections_get: id, pid, uid, "
	  "tenant, process, sequences, pinned, bytes, ...)." },
	{ "sequences", (PyCFunction)(void (*)(void))client_sequences, METH_VARARGS | METH_KEYWORDS,
	  "sequences(tenant=None)\n--\n\nThe open sequences (of tenant), as dicts "
	  "(kvd_sequences_get: id, connection, tenant, tokens, pins, bytes, ...)." },
	{ "disconnect", client_disconnect, METH_VARARGS,
	  "disconnect(connection)\n--\n\nCloses a connection of connections()." },
	{ "budget_reset", client_budget_reset, METH_NOARGS,
	  "budget_reset()\n--\n\nBack to the configured budget." },
	{ "tenant_set", (PyCFunction)(void (*)(void))client_tenant_set, METH_VARARGS | METH_KEYWORDS,
	  "tenant_set(tenant, *, min_bytes=None, max_bytes=None, weight=None, policy=None, tier=None, recall=None)\n--\n\n"
	  "Changes the given settings of a tenant live; False when applied but not saved." },
	{ "tenant_reset", client_tenant_reset, METH_VARARGS,
	  "tenant_reset(tenant)\n--\n\nBack to the configured settings." },
	{ "tenant_delete", client_tenant_delete, METH_VARARGS,
	  "tenant_delete(tenant)\n--\n\nForgets a tenant that holds nothing." },
	{ "evict", (PyCFunction)(void (*)(void))client_evict, METH_VARARGS | METH_KEYWORDS,
	  "evict(bytes=0, *, tenant=None)\n--\n\nRuns an eviction round; returns the bytes freed." },
	{ "evictions", client_evictions, METH_NOARGS,
	  "evictions()\n--\n\nThe daemon's recent eviction rounds, oldest first, as dicts "
	  "(kvd_evictions_get: id, trigger, duration_us, freed_bytes, ..., tenants)." },
	{ "status", client_status, METH_NOARGS,
	  "status()\n--\n\nA Status snapshot of the daemon (kvd_status_get)." },
	{ NULL },
};

static PyGetSetDef client_getset[] = {
	{ "chunk_bytes", client_get_chunk_bytes, NULL, "Bytes of a pool chunk.", NULL },
	{ "memory", client_get_memory, NULL, "'cpu' (host pool) or 'cuda:N' (GPU pool).", NULL },
	{ "last_error", client_get_last_error, NULL,
	  "The message of this thread's last failed call on the client.", NULL },
	{ "closed", client_get_closed, NULL, "Whether close() was called.", NULL },
	{ NULL },
};

static PyType_Slot client_slots[] = {
	{ Py_tp_doc, "Client(socket=None, tenant=None, *, timeout_ms=0, ring=True, device=-1)\n--\n\n"
	             "A connection to kvd (kvd_client_connect_params): as a tenant, or "
	             "administrative with tenant None. On a GPU pool, a tenant's chunks are on "
	             "CUDA device `device` of this process (KVD_CONNECT_DEVICE), or with -1 on "
	             "the device of the current CUDA context. A context manager." },
	{ Py_tp_new, client_new },
	{ Py_tp_dealloc, client_dealloc },
	{ Py_tp_methods, client_methods },
	{ Py_tp_getset, client_getset },
	{ 0, NULL },
};

static PyType_Spec client_spec = {
	.name = "kvd._kvd.Client",
	.basicsize = sizeof(ClientObject),
	.flags = Py_TPFLAGS_DEFAULT,
	.slots = client_slots,
};

/* ---- Seq ---- */

static PyObject *seq_wrap(ClientObject *client, kvd_seq *s, int model) {
	struct module_state *st = state_any();
	SeqObject *self = (SeqObject *)PyType_GenericAlloc(st->seq_type, 0);

	if (!self) {
		kvd_seq_release(s);
		return NULL;
	}
	self->client = (ClientObject *)Py_NewRef((PyObject *)client);
	self->s = s;
	self->model = model;
	return (PyObject *)self;
}

static kvd_seq *seq_open(SeqObject *self) {
	if (!self->s)
		PyErr_SetString(PyExc_ValueError, "the sequence is released");
	return self->s;
}

static void seq_dealloc(PyObject *self) {
	PyTypeObject *tp = Py_TYPE(self);
	SeqObject *s = (SeqObject *)self;

	if (s->s) {
		Py_BEGIN_ALLOW_THREADS
		kvd_seq_release(s->s);
		Py_END_ALLOW_THREADS
	}
	Py_XDECREF((PyObject *)s->client);
	((freefunc)PyType_GetSlot(tp, Py_tp_free))(self);
	Py_DECREF(tp);
}

static int seq_unpin_quiet(SeqObject *s) {
	int r = 0;

	if (s->s)
		CALL_NOGIL(r, kvd_seq_unpin(s->s));
	return r;
}

/* Runs a libkvd call on the sequence without the GIL, counted as in flight. */
#define SEQ_CALL(self, r, expr)          \
	do {                             \
		(self)->inflight++;      \
		CALL_NOGIL(r, expr);     \
		(self)->inflight--;      \
	} while (0)

static PyObject *seq_result(SeqObject *self, int r) {
	return r < 0 ? raise_kvd(self->client->c, r) : PyLong_FromLong(r);
}

static PyObject *seq_grow(PyObject *self, PyObject *args) {
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = seq_open(so);
	unsigned int n;
	int r;

	if (!s || !PyArg_ParseTuple(args, "I", &n))
		return NULL;
	SEQ_CALL(so, r, kvd_seq_grow(s, n));
	return seq_result(so, r);
}

static PyObject *seq_fork(PyObject *self, PyObject *unused) {
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = seq_open(so), *child = NULL;
	int r;

	(void)unused;
	if (!s)
		return NULL;
	SEQ_CALL(so, r, kvd_seq_fork(s, &child));
	if (r < 0)
		return raise_kvd(so->client->c, r);
	return seq_wrap(so->client, child, so->model);
}

/* Whether views of so's memory live (BufferError set): what a release or a truncate, which
 * may unmap it, must not pull out from under them. */
static bool seq_views_alive(const SeqObject *so) {
	if (so->views == 0)
		return false;
	PyErr_Format(PyExc_BufferError, "%zd views of this sequence are alive: drop them (and the "
	             "arrays and tensors made from them) first", so->views);
	return true;
}

static PyObject *seq_truncate(PyObject *self, PyObject *args) {
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = seq_open(so);
	unsigned int n;
	int r;

	if (!s || !PyArg_ParseTuple(args, "I", &n))
		return NULL;
	/* The dropped slots' blocks go back to the pool, and their chunks may be unmapped. */
	if (seq_views_alive(so))
		return NULL;
	SEQ_CALL(so, r, kvd_seq_truncate(s, n));
	return seq_result(so, r);
}

static PyObject *seq_publish(PyObject *self, PyObject *args) {
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = seq_open(so);
	unsigned int blocks;
	int r;

	if (!s || !PyArg_ParseTuple(args, "I", &blocks))
		return NULL;
	SEQ_CALL(so, r, kvd_seq_publish(s, blocks));
	return seq_result(so, r);
}

static PyObject *seq_pin(PyObject *self, PyObject *unused) {
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = seq_open(so);
	int r, recall = KVD_RECALL_NONE;

	(void)unused;
	if (!s)
		return NULL;
	SEQ_CALL(so, r, kvd_seq_pin_recall(s, &recall));
	return seq_result(so, r < 0 ? r : recall);
}

static PyObject *seq_recall(PyObject *self, PyObject *unused) {
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = seq_open(so);
	uint64_t tokens = 0;
	int r;

	(void)unused;
	if (!s)
		return NULL;
	SEQ_CALL(so, r, kvd_seq_recall(s, &tokens, NULL));
	return r < 0 ? raise_kvd(so->client->c, r) : PyLong_FromUnsignedLongLong(tokens);
}

/* A CUevent handle from an integer or from an object that passes itself to ctypes as one
 * (_as_parameter_: torch.cuda.Event does); 0 for None. */
static int event_handle(PyObject *o, void **ret) {
	PyObject *p, *v;

	*ret = NULL;
	if (!o || o == Py_None)
		return 0;
	if (PyLong_Check(o)) {
		*ret = PyLong_AsVoidPtr(o);
		return PyErr_Occurred() ? -1 : 0;
	}
	p = PyObject_GetAttrString(o, "_as_parameter_");
	v = p ? PyObject_GetAttrString(p, "value") : NULL;
	Py_XDECREF(p);
	if (!v || v == Py_None || !PyLong_Check(v)) {
		Py_XDECREF(v);
		PyErr_Clear();
		PyErr_SetString(PyExc_TypeError, "cuda_event: an interprocess CUDA event "
		                "(torch.cuda.Event(interprocess=True)) or its handle as an int");
		return -1;
	}
	*ret = PyLong_AsVoidPtr(v);
	Py_DECREF(v);
	return PyErr_Occurred() ? -1 : 0;
}

static PyObject *seq_unpin(PyObject *self, PyObject *args) {
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = seq_open(so);
	PyObject *event = NULL;
	void *ev;
	int r;

	if (!s || !PyArg_ParseTuple(args, "|O", &event) || event_handle(event, &ev) < 0)
		return NULL;
	SEQ_CALL(so, r, ev ? kvd_seq_unpin_after(s, ev) : kvd_seq_unpin(s));
	return seq_result(so, r);
}

static PyObject *seq_release(PyObject *self, PyObject *unused) {
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = so->s;
	int r;

	(void)unused;
	if (!s)
		Py_RETURN_NONE;
	if (seq_views_alive(so))
		return NULL;
	if (so->inflight > 0) {
		PyErr_SetString(PyExc_RuntimeError, "another thread is in a call on this sequence");
		return NULL;
	}
	so->s = NULL;
	CALL_NOGIL(r, kvd_seq_release(s));
	return r < 0 ? raise_kvd(so->client->c, r) : Py_NewRef(Py_None);
}

static PyObject *seq_claim(PyObject *self, PyObject *args) {
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = seq_open(so);
	int model, r;

	if (!s || !PyArg_ParseTuple(args, "i", &model))
		return NULL;
	SEQ_CALL(so, r, kvd_seq_claim(s, model));
	if (r >= 0)
		so->model = model;
	return r < 0 ? raise_kvd(so->client->c, r) : Py_NewRef(Py_None);
}

static PyObject *seq_tokens(PyObject *self, PyObject *args) {
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = seq_open(so);
	unsigned int layer = 0, head = 0;
	int64_t n;

	if (!s || !PyArg_ParseTuple(args, "|II", &layer, &head))
		return NULL;
	n = kvd_seq_tokens(s, layer, head);
	return n < 0 ? raise_kvd(so->client->c, (int)n) : PyLong_FromLongLong(n);
}

static PyObject *seq_position(PyObject *self, PyObject *args) {
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = seq_open(so);
	unsigned int layer, head, slot;
	int64_t p;

	if (!s || !PyArg_ParseTuple(args, "III", &layer, &head, &slot))
		return NULL;
	p = kvd_seq_position(s, layer, head, slot);
	return p < 0 ? raise_kvd(so->client->c, (int)p) : PyLong_FromLongLong(p);
}

static enum view_dtype model_dtype(uint32_t dtype) {
	return dtype == KVD_DTYPE_BF16 ? DT_BF16 : dtype == KVD_DTYPE_F32 ? DT_F32 : DT_F16;
}

/* A view of memory of s's chunks at data (K/V, index keys, compensation blocks), pinning s
 * for its life. */
static PyObject *seq_chunk_view(SeqObject *so, void *data, enum view_dtype dtype, int ndim,
                                const Py_ssize_t *shape, bool readonly) {
	ViewObject *v;
	int r;

	SEQ_CALL(so, r, kvd_seq_pin(so->s));
	if (r < 0)
		return raise_kvd(so->client->c, r);
	v = view_new((PyObject *)so, data, dtype, ndim, shape, readonly);
	if (!v) {
		(void)seq_unpin_quiet(so);
		return NULL;
	}
	v->pinned = true;
	v->device = so->client->memory == KVD_MEMORY_CUDA;
	v->device_id = so->client->device < 0 ? 0 : so->client->device;
	so->views++;
	so->client->views++;
	return (PyObject *)v;
}

static PyObject *seq_block(PyObject *self, PyObject *args) {
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = seq_open(so);
	const struct kvd_seq_desc *h;
	unsigned int table, index;
	Py_ssize_t shape[4];
	void *b;
	int r, ndim;

	if (!s || !PyArg_ParseTuple(args, "II", &table, &index))
		return NULL;
	r = kvd_seq_block(s, table, index, &b);
	if (r < 0)
		return raise_kvd(so->client->c, r);
	h = kvd_seq_header(s);
	shape[0] = 2;
	if (h->layout == KVD_LAYOUT_PER_HEAD) {
		shape[1] = h->block_tokens;
		shape[2] = h->head_dim;
		ndim = 3;
	} else {
		shape[1] = h->kv_heads;
		shape[2] = h->block_tokens;
		shape[3] = h->head_dim;
		ndim = 4;
	}
	return seq_chunk_view(so, b, model_dtype(h->dtype), ndim, shape, false);
}

static PyObject *seq_kv(PyObject *self, PyObject *args) {
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = seq_open(so);
	unsigned int layer, head, slot;
	enum view_dtype dtype;
	Py_ssize_t shape[1];
	PyObject *k, *v;
	void *kp, *vp;
	int r;

	if (!s || !PyArg_ParseTuple(args, "III", &layer, &head, &slot))
		return NULL;
	r = kvd_seq_kv(s, layer, head, slot, &kp, &vp);
	if (r < 0)
		return raise_kvd(so->client->c, r);
	shape[0] = kvd_seq_header(s)->head_dim;
	dtype = model_dtype(kvd_seq_header(s)->dtype);
	k = seq_chunk_view(so, kp, dtype, 1, shape, false);
	if (!k)
		return NULL;
	v = seq_chunk_view(so, vp, dtype, 1, shape, false);
	if (!v) {
		Py_DECREF(k);
		return NULL;
	}
	return Py_BuildValue("(NN)", k, v);
}

static PyObject *seq_index_key(PyObject *self, PyObject *args) {
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = seq_open(so);
	unsigned int layer, head, slot;
	Py_ssize_t shape[1];
	void *p;
	int r;

	if (!s || !PyArg_ParseTuple(args, "III", &layer, &head, &slot))
		return NULL;
	r = kvd_seq_index_key(s, layer, head, slot, &p);
	if (r < 0)
		return raise_kvd(so->client->c, r);
	shape[0] = kvd_seq_header(s)->index_dim;
	return seq_chunk_view(so, p, model_dtype(kvd_seq_header(s)->dtype), 1, shape, false);
}

/* moments(layer, kv_head) and latent(layer, kv_head): the compensation block, read-only
 * bytes (struct kvd_moments_header or kvd_latent_header, then its data). */
static PyObject *seq_compensation(PyObject *self, PyObject *args, bool latent) {
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = seq_open(so);
	const struct kvd_moments_header *mh;
	const struct kvd_latent_header *lh;
	unsigned int layer, head;
	Py_ssize_t shape[1];
	const void *p;
	int r;

	if (!s || !PyArg_ParseTuple(args, "II", &layer, &head))
		return NULL;
	if (latent) {
		r = kvd_seq_latent(s, layer, head, &lh);
		p = lh;
	} else {
		r = kvd_seq_moments(s, layer, head, &mh);
		p = mh;
	}
	if (r < 0)
		return raise_kvd(so->client->c, r);
	shape[0] = (Py_ssize_t)kvd_seq_header(s)->moments_bytes;
	return seq_chunk_view(so, (void *)p, DT_U8, 1, shape, true);
}

static PyObject *seq_moments(PyObject *self, PyObject *args) {
	return seq_compensation(self, args, false);
}

static PyObject *seq_latent(PyObject *self, PyObject *args) {
	return seq_compensation(self, args, true);
}

static PyObject *seq_block_table(PyObject *self, PyObject *args, PyObject *kwds) {
	static char *kwlist[] = { "layer", "kv_head", "positions", NULL };
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = seq_open(so);
	unsigned int layer, head = 0;
	int want_positions = 1, n;
	int64_t tokens;
	uint32_t nb, *pos = NULL, bt;
	int32_t *blocks;
	uint64_t gen = 0;
	Py_ssize_t shape[1];
	ViewObject *bv, *pv = NULL;

	if (!s || !PyArg_ParseTupleAndKeywords(args, kwds, "I|Ip", kwlist, &layer, &head,
	                                       &want_positions))
		return NULL;
	tokens = kvd_seq_tokens(s, layer, head);
	if (tokens < 0)
		return raise_kvd(so->client->c, (int)tokens);
	bt = kvd_seq_header(s)->block_tokens;
	/* Room for what the table holds now, and a block more should a round change it. */
	nb = (uint32_t)((tokens + bt - 1) / bt) + 1;
	blocks = malloc((size_t)nb * sizeof(*blocks));
	pos = want_positions ? malloc(((size_t)tokens + 1) * sizeof(*pos)) : NULL;
	if (!blocks || (want_positions && !pos)) {
		free(blocks);
		free(pos);
		return PyErr_NoMemory();
	}
	n = kvd_seq_block_table(s, layer, head, blocks, nb, pos, pos ? (uint32_t)tokens + 1 : 0, &gen);
	if (n < 0) {
		free(blocks);
		free(pos);
		return raise_kvd(so->client->c, n);
	}
	shape[0] = (Py_ssize_t)((n + bt - 1) / bt);
	bv = view_new(NULL, blocks, DT_I32, 1, shape, false);
	if (!bv) {
		free(blocks);
		free(pos);
		return NULL;
	}
	bv->owns_data = true;
	if (pos) {
		shape[0] = n;
		/* int32, which torch has (no uint32 before torch 2.3): positions stay below
		 * max_tokens, far under 2^31. */
		pv = view_new(NULL, pos, DT_I32, 1, shape, false);
		if (!pv) {
			free(pos);
			Py_DECREF(bv);
			return NULL;
		}
		pv->owns_data = true;
	}
	return Py_BuildValue("(NNK)", (PyObject *)bv, pv ? (PyObject *)pv : Py_NewRef(Py_None),
	                     (unsigned long long)gen);
}

/* observation(layer): q[q_heads][window][head_dim]; index_observation(layer):
 * iq[window][index_heads][index_dim]; by the shape this client registered. */
static PyObject *seq_window(PyObject *self, PyObject *args, bool index) {
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = seq_open(so);
	const struct kvd_seq_desc *h;
	struct py_model m;
	unsigned int layer;
	Py_ssize_t shape[3];
	ViewObject *v;
	void *q;
	int r;

	if (!s || !PyArg_ParseTuple(args, "I", &layer))
		return NULL;
	r = index ? kvd_seq_index_observation(s, layer, &q) : kvd_seq_observation(s, layer, &q);
	if (r < 0)
		return raise_kvd(so->client->c, r);
	if (model_get(so->client, so->model, &m) < 0)
		return NULL;
	h = kvd_seq_header(s);
	if (index) {
		shape[0] = m.window;
		shape[1] = h->index_heads;
		shape[2] = h->index_dim;
	} else {
		shape[0] = m.q_heads;
		shape[1] = m.window;
		shape[2] = h->head_dim;
	}
	/* The observation buffer is the sequence's own (host memory, never a chunk): the view
	 * keeps the Seq object, not a pin. */
	v = view_new(self, q, model_dtype(h->dtype), 3, shape, false);
	if (!v)
		return NULL;
	so->views++;
	so->client->views++;
	return (PyObject *)v;
}

static PyObject *seq_observation(PyObject *self, PyObject *args) {
	return seq_window(self, args, false);
}

static PyObject *seq_index_observation(PyObject *self, PyObject *args) {
	return seq_window(self, args, true);
}

static PyObject *seq_observe(PyObject *self, PyObject *args) {
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = seq_open(so);
	unsigned int layer;
	int r;

	if (!s || !PyArg_ParseTuple(args, "I", &layer))
		return NULL;
	r = kvd_seq_observe(s, layer);
	return r < 0 ? raise_kvd(so->client->c, r) : Py_NewRef(Py_None);
}

static PyObject *seq_digest(PyObject *self, PyObject *unused) {
	SeqObject *so = (SeqObject *)self;
	kvd_seq *s = seq_open(so);
	uint64_t daemon = 0, local = 0;
	bool host;
	int r;

	(void)unused;
	if (!s)
		return NULL;
	host = so->client->memory != KVD_MEMORY_CUDA;
	SEQ_CALL(so, r, kvd_seq_digest(s, &daemon, host ? &local : NULL));
	if (r < 0)
		return raise_kvd(so->client->c, r);
	if (!host)
		return Py_BuildValue("(KO)", (unsigned long long)daemon, Py_None);
	return Py_BuildValue("(KK)", (unsigned long long)daemon, (unsigned long long)local);
}

static PyObject *seq_enter(PyObject *self, PyObject *unused) {
	(void)unused;
	return Py_NewRef(self);
}

static PyObject *seq_exit(PyObject *self, PyObject *args) {
	PyObject *type = PyTuple_Size(args) > 0 ? PyTuple_GetItem(args, 0) : NULL;

	/* Leaving on an exception with views still alive (the frames being unwound may hold
	 * them): the sequence goes when its last view does, and the exception stays the one
	 * that is raised. */
	if (type && type != Py_None && ((SeqObject *)self)->views > 0)
		Py_RETURN_NONE;
	return seq_release(self, NULL);
}

static PyObject *seq_get_id(PyObject *self, void *closure) {
	SeqObject *so = (SeqObject *)self;

	(void)closure;
	return so->s ? PyLong_FromUnsignedLongLong(kvd_seq_id(so->s)) : Py_NewRef(Py_None);
}

static PyObject *seq_get_generation(PyObject *self, void *closure) {
	SeqObject *so = (SeqObject *)self;
	const struct kvd_seq_desc *d;

	(void)closure;
	if (!seq_open(so))
		return NULL;
	d = kvd_seq_descriptor(so->s);
	if (!d)
		return raise_kvd(so->client->c, -ECHILD);
	return PyLong_FromUnsignedLongLong(__atomic_load_n(&d->generation, __ATOMIC_ACQUIRE));
}

static PyObject *seq_get_model(PyObject *self, void *closure) {
	(void)closure;
	return PyLong_FromLong(((SeqObject *)self)->model);
}

static PyObject *seq_get_client(PyObject *self, void *closure) {
	(void)closure;
	return Py_NewRef((PyObject *)((SeqObject *)self)->client);
}

static PyObject *seq_get_views(PyObject *self, void *closure) {
	(void)closure;
	return PyLong_FromSsize_t(((SeqObject *)self)->views);
}

static PyObject *seq_get_released(PyObject *self, void *closure) {
	(void)closure;
	return PyBool_FromLong(((SeqObject *)self)->s == NULL);
}

static PyMethodDef seq_methods[] = {
	{ "grow", seq_grow, METH_VARARGS,
	  "grow(n)\n--\n\nAppends n token slots to every table (kvd_seq_grow); may wait for an "
	  "eviction round, without the GIL." },
	{ "fork", seq_fork, METH_NOARGS,
	  "fork()\n--\n\nA new Seq sharing this one's full blocks, its last ones copied "
	  "(kvd_seq_fork): parallel samples and beams from one prompt." },
	{ "publish", seq_publish, METH_VARARGS,
	  "publish(blocks)\n--\n\nSays that the first blocks full blocks hold the K/V of the "
	  "prefix keys the open gave (kvd_seq_publish): the tenant's prefix opens may share them "
	  "from now on." },
	{ "truncate", seq_truncate, METH_VARARGS,
	  "truncate(n)\n--\n\nDrops the last n positions (kvd_seq_truncate): a speculative "
	  "decoder's rejected drafts. BufferError while views of the sequence live." },
	{ "pin", seq_pin, METH_NOARGS,
	  "pin()\n--\n\nKeeps rounds off the sequence (nested); returns what it found "
	  "(kvd_seq_pin_recall): RECALL_NONE, RECALL_HOST or RECALL_FILE (brought back from the "
	  "daemon's host or file tier) or RECALL_LOST (moved out and lost: every table is "
	  "empty)." },
	{ "recall", seq_recall, METH_NOARGS,
	  "recall()\n--\n\nAfter publishing a new question's window, unpinned: brings back "
	  "the evicted tokens the daemon kept that the window needs most, each for a resident one "
	  "worth less (kvd_seq_recall; the tenant's recall on, docs/recall.md), without the GIL; "
	  "returns the token slots brought back over every table." },
	{ "unpin", seq_unpin, METH_VARARGS,
	  "unpin(cuda_event=None)\n--\n\nUndoes a pin; with an interprocess CUDA event "
	  "(torch.cuda.Event(interprocess=True), or its CUevent handle as an int), once the GPU "
	  "work recorded before it is done (kvd_seq_unpin_after): 1 when libkvd waited for it "
	  "itself." },
	{ "release", seq_release, METH_NOARGS,
	  "release()\n--\n\nGives the sequence back. BufferError while views of it live." },
	{ "claim", seq_claim, METH_VARARGS,
	  "claim(model)\n--\n\nTakes a sequence kept across a daemon restart back." },
	{ "tokens", seq_tokens, METH_VARARGS,
	  "tokens(layer=0, kv_head=0)\n--\n\nResident tokens of the table." },
	{ "position", seq_position, METH_VARARGS,
	  "position(layer, kv_head, slot)\n--\n\nOriginal position of a resident slot." },
	{ "block", seq_block, METH_VARARGS,
	  "block(table, index)\n--\n\nView of a K/V block: [2][kv_heads][block_tokens][head_dim] "
	  "(per layer) or [2][block_tokens][head_dim] (per head); pins the sequence while it lives." },
	{ "kv", seq_kv, METH_VARARGS,
	  "kv(layer, kv_head, slot)\n--\n\n(K, V) views of a resident slot's rows; each pins "
	  "the sequence while it lives." },
	{ "block_table", (PyCFunction)(void (*)(void))seq_block_table, METH_VARARGS | METH_KEYWORDS,
	  "block_table(layer, kv_head=0, positions=True)\n--\n\n(blocks, positions, generation): "
	  "int32 block indices into Client.block_pool(), the slots' original positions (int32, "
	  "or None), the descriptor generation they hold for." },
	{ "observation", seq_observation, METH_VARARGS,
	  "observation(layer)\n--\n\nView of the layer's window queries, "
	  "[q_heads][window][head_dim], to write before observe(layer); withdraws the layer's "
	  "published window (kvd_seq_observation)." },
	{ "index_observation", seq_index_observation, METH_VARARGS,
	  "index_observation(layer)\n--\n\nView of the layer's window index queries, "
	  "[window][index_heads][index_dim] (models with an indexer)." },
	{ "index_key", seq_index_key, METH_VARARGS,
	  "index_key(layer, kv_head, slot)\n--\n\nView of a resident slot's index key "
	  "[index_dim]; pins the sequence while it lives." },
	{ "moments", seq_moments, METH_VARARGS,
	  "moments(layer, kv_head)\n--\n\nRead-only bytes of the moments block (struct "
	  "kvd_moments_header, then its data); pins the sequence while it lives." },
	{ "latent", seq_latent, METH_VARARGS,
	  "latent(layer, kv_head)\n--\n\nRead-only bytes of the latent block (struct "
	  "kvd_latent_header, then its data); pins the sequence while it lives." },
	{ "observe", seq_observe, METH_VARARGS,
	  "observe(layer)\n--\n\nPublishes the layer's observation window." },
	{ "digest", seq_digest, METH_NOARGS,
	  "digest()\n--\n\n(daemon's digest, this process's or None on GPU pools) of the K/V." },
	{ "__enter__", seq_enter, METH_NOARGS, NULL },
	{ "__exit__", seq_exit, METH_VARARGS, NULL },
	{ NULL },
};

static PyGetSetDef seq_getset[] = {
	{ "id", seq_get_id, NULL, "The daemon-wide id, None once released.", NULL },
	{ "generation", seq_get_generation, NULL, "The descriptor's generation now.", NULL },
	{ "model", seq_get_model, NULL, "The model id it was opened (or claimed) with.", NULL },
	{ "views", seq_get_views, NULL, "Views of its memory alive now.", NULL },
	{ "client", seq_get_client, NULL, "The Client it was opened on.", NULL },
	{ "released", seq_get_released, NULL, "Whether release() was called.", NULL },
	{ NULL },
};

static PyType_Slot seq_slots[] = {
	{ Py_tp_doc, "A sequence (Client.open). A context manager that releases it." },
	{ Py_tp_dealloc, seq_dealloc },
	{ Py_tp_methods, seq_methods },
	{ Py_tp_getset, seq_getset },
	{ 0, NULL },
};

static PyType_Spec seq_spec = {
	.name = "kvd._kvd.Seq",
	.basicsize = sizeof(SeqObject),
	.flags = Py_TPFLAGS_DEFAULT,
	.slots = seq_slots,
};

/* ---- Status ---- */

typedef struct {
	PyObject_HEAD
	kvd_status *st;
} StatusObject;

static PyObject *status_wrap(kvd_status *st) {
	StatusObject *self = (StatusObject *)PyType_GenericAlloc(state_any()->status_type, 0);

	if (!self) {
		kvd_status_free(st);
		return NULL;
	}
	self->st = st;
	return (PyObject *)self;
}

static void status_dealloc(PyObject *self) {
	PyTypeObject *tp = Py_TYPE(self);

	kvd_status_free(((StatusObject *)self)->st);
	((freefunc)PyType_GetSlot(tp, Py_tp_free))(self);
	Py_DECREF(tp);
}

/* The index of tenant name in the snapshot, or -1 with KeyError. */
static int status_tenant_index(const kvd_status *st, const char *name) {
	for (uint32_t i = 0; i < kvd_status_tenants(st); i++) {
		const char *n;

		if (kvd_status_tenant_name(st, i, &n) == 0 && strcmp(n, name) == 0)
			return (int)i;
	}
	PyErr_Format(PyExc_KeyError, "no tenant %s in the status", name);
	return -1;
}

/* A value by key: of the node (tenant NULL) or of a tenant; numbers, else strings. */
static PyObject *status_value(const kvd_status *st, const char *tenant, const char *key) {
	const char *str;
	uint64_t v;
	int i = -1, r;

	if (tenant) {
		i = status_tenant_index(st, tenant);
		if (i < 0)
			return NULL;
	}
	r = i < 0 ? kvd_status_u64(st, key, &v) : kvd_status_tenant_u64(st, (uint32_t)i, key, &v);
	if (r == 0)
		return PyLong_FromUnsignedLongLong(v);
	r = i < 0 ? kvd_status_str(st, key, &str) : kvd_status_tenant_str(st, (uint32_t)i, key, &str);
	if (r == 0)
		return PyUnicode_FromString(str);
	PyErr_Format(PyExc_KeyError, "%s", key);
	return NULL;
}

static PyObject *status_get(PyObject *self, PyObject *args) {
	const char *key;

	if (!PyArg_ParseTuple(args, "s", &key))
		return NULL;
	return status_value(((StatusObject *)self)->st, NULL, key);
}

static PyObject *status_tenant(PyObject *self, PyObject *args) {
	const char *tenant, *key;

	if (!PyArg_ParseTuple(args, "ss", &tenant, &key))
		return NULL;
	return status_value(((StatusObject *)self)->st, tenant, key);
}

static PyObject *status_tenants(PyObject *self, PyObject *unused) {
	const kvd_status *st = ((StatusObject *)self)->st;
	uint32_t n = kvd_status_tenants(st);
	PyObject *list = PyList_New(n);

	(void)unused;
	for (uint32_t i = 0; list && i < n; i++) {
		const char *name = "";

		(void)kvd_status_tenant_name(st, i, &name);
		PyList_SetItem(list, i, PyUnicode_FromString(name));
	}
	return list;
}

static PyObject *status_refusals(PyObject *self, PyObject *unused) {
	const kvd_status *st = ((StatusObject *)self)->st;
	PyObject *d = PyDict_New();

	(void)unused;
	for (uint32_t i = 0; d && i < kvd_status_refusals(st); i++) {
		const char *name;
		uint64_t v;
		PyObject *value;

		if (kvd_status_refusal(st, i, &name, &v) < 0)
			continue;
		value = PyLong_FromUnsignedLongLong(v);
		if (!value || PyDict_SetItemString(d, name, value) < 0) {
			Py_XDECREF(value);
			Py_DECREF(d);
			return NULL;
		}
		Py_DECREF(value);
	}
	return d;
}

static PyMethodDef status_methods[] = {
	{ "get", status_get, METH_VARARGS,
	  "get(key)\n--\n\nA node value by its key (kvd_status_u64, kvd_status_str): used_bytes, "
	  "budget_bytes, ...; KeyError for an unknown key." },
	{ "tenant", status_tenant, METH_VARARGS,
	  "tenant(name, key)\n--\n\nA tenant's value by its key (used_bytes, max_bytes, policy, ...)." },
	{ "tenants", status_tenants, METH_NOARGS, "tenants()\n--\n\nThe tenants' names." },
	{ "refusals", status_refusals, METH_NOARGS,
	  "refusals()\n--\n\nRefusal counters by limit name." },
	{ NULL },
};

static PyType_Slot status_slots[] = {
	{ Py_tp_doc, "A snapshot of the daemon's status (Client.status())." },
	{ Py_tp_dealloc, status_dealloc },
	{ Py_tp_methods, status_methods },
	{ 0, NULL },
};

static PyType_Spec status_spec = {
	.name = "kvd._kvd.Status",
	.basicsize = sizeof(StatusObject),
	.flags = Py_TPFLAGS_DEFAULT,
	.slots = status_slots,
};

/* ---- the module ---- */

static PyObject *module_strerror(PyObject *self, PyObject *args) {
	int code;

	(void)self;
	if (!PyArg_ParseTuple(args, "i", &code))
		return NULL;
	return PyUnicode_FromString(kvd_strerror(code < 0 ? code : -code));
}

static PyObject *module_key_root(PyObject *self, PyObject *args) {
	uint8_t key[KVD_KEY_BYTES];
	const char *seed;

	if (!PyArg_ParseTuple(args, "s", &seed))
		return NULL;
	(void)kvd_key_root(seed, key);
	return PyBytes_FromStringAndSize((const char *)key, KVD_KEY_BYTES);
}

static PyObject *module_prefix_keys(PyObject *self, PyObject *args, PyObject *kwds) {
	static char *kwlist[] = { "tokens", "block_tokens", "root", "cache_salt", NULL };
	const char *salt = NULL;
	Py_buffer tokens, root;
	PyObject *out = NULL;
	unsigned int bt;
	int64_t n;

	if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*Iy*|z", kwlist, &tokens, &bt, &root, &salt))
		return NULL;
	if (tokens.len % sizeof(uint32_t) != 0 || root.len != KVD_KEY_BYTES || bt == 0) {
		PyErr_SetString(PyExc_ValueError, "tokens must be uint32 token ids, root 32 bytes and "
		                "block_tokens at least 1");
		goto done;
	}
	n = (int64_t)(tokens.len / sizeof(uint32_t) / bt);
	out = PyBytes_FromStringAndSize(NULL, n * KVD_KEY_BYTES);
	if (!out)
		goto done;
	{
		uint8_t *keys = (uint8_t *)PyBytes_AsString(out);

		Py_BEGIN_ALLOW_THREADS
		n = kvd_prefix_keys(root.buf, tokens.buf, tokens.len / sizeof(uint32_t), bt, salt,
		                    keys, (uint64_t)n);
		Py_END_ALLOW_THREADS
	}
	if (n < 0) {
		Py_CLEAR(out);
		raise_kvd(NULL, (int)n);
	}
done:
	PyBuffer_Release(&tokens);
	PyBuffer_Release(&root);
	return out;
}

static PyMethodDef module_methods[] = {
	{ "key_root", module_key_root, METH_VARARGS,
	  "key_root(seed)\n--\n\nThe root key of a seed (kvd_key_root): vLLM's NONE_HASH with "
	  "PYTHONHASHSEED=seed under sha256_cbor." },
	{ "prefix_keys", (PyCFunction)(void (*)(void))module_prefix_keys, METH_VARARGS | METH_KEYWORDS,
	  "prefix_keys(tokens, block_tokens, root, cache_salt=None)\n--\n\nThe content keys of the "
	  "full blocks of tokens (a buffer of uint32 token ids, e.g. numpy uint32), chained from "
	  "root, as bytes of 32 per block (kvd_prefix_keys): vLLM's sha256_cbor block hashes." },
	{ "strerror", module_strerror, METH_VARARGS,
	  "strerror(errno)\n--\n\nWhat an errno from kvd means (kvd_strerror)." },
	{ NULL },
};

static int module_traverse(PyObject *m, visitproc visit, void *arg) {
	struct module_state *st = state_of(m);

	Py_VISIT(st->error);
	Py_VISIT(st->client_type);
	Py_VISIT(st->seq_type);
	Py_VISIT(st->view_type);
	Py_VISIT(st->status_type);
	return 0;
}

static int module_clear(PyObject *m) {
	struct module_state *st = state_of(m);

	Py_CLEAR(st->error);
	Py_CLEAR(st->client_type);
	Py_CLEAR(st->seq_type);
	Py_CLEAR(st->view_type);
	Py_CLEAR(st->status_type);
	return 0;
}

static PyModuleDef kvd_module = {
	PyModuleDef_HEAD_INIT,
	.m_name = "kvd._kvd",
	.m_doc = "libkvd for Python; use the kvd package.",
	.m_size = sizeof(struct module_state),
	.m_methods = module_methods,
	.m_traverse = module_traverse,
	.m_clear = module_clear,
};

static int add_int(PyObject *m, const char *name, long long v) {
	PyObject *o = PyLong_FromLongLong(v);
	int r = o ? PyModule_AddObjectRef(m, name, o) : -1;

	Py_XDECREF(o);
	return r;
}

static PyTypeObject *add_type(PyObject *m, PyType_Spec *spec, const char *name) {
	PyTypeObject *t = (PyTypeObject *)PyType_FromSpec(spec);

	if (!t || PyModule_AddObjectRef(m, name, (PyObject *)t) < 0) {
		Py_XDECREF((PyObject *)t);
		return NULL;
	}
	return t;
}

PyMODINIT_FUNC PyInit__kvd(void);
PyMODINIT_FUNC PyInit__kvd(void) {
	static const struct {
		const char *name;
		long long value;
	} constants[] = {
		{ "DTYPE_F16", KVD_DTYPE_F16 }, { "DTYPE_BF16", KVD_DTYPE_BF16 },
		{ "DTYPE_F32", KVD_DTYPE_F32 },
		{ "LAYOUT_PER_LAYER", KVD_LAYOUT_PER_LAYER }, { "LAYOUT_PER_HEAD", KVD_LAYOUT_PER_HEAD },
		{ "UNIT_NONE", KVD_UNIT_NONE }, { "UNIT_HEAD_TOKEN", KVD_UNIT_HEAD_TOKEN },
		{ "UNIT_LAYER_TOKEN", KVD_UNIT_LAYER_TOKEN }, { "UNIT_BLOCK", KVD_UNIT_BLOCK },
		{ "COMPENSATION_NONE", KVD_COMPENSATION_NONE },
		{ "COMPENSATION_MOMENTS", KVD_COMPENSATION_MOMENTS },
		{ "COMPENSATION_LATENT", KVD_COMPENSATION_LATENT },
		{ "EVENT_STOPPING", KVD_EVENT_STOPPING }, { "EVENT_SEQ_CHANGED", KVD_EVENT_SEQ_CHANGED },
		{ "EVENT_DISCONNECTED", KVD_EVENT_DISCONNECTED },
		{ "RECALL_NONE", KVD_RECALL_NONE }, { "RECALL_HOST", KVD_RECALL_HOST },
		{ "RECALL_LOST", KVD_RECALL_LOST }, { "RECALL_FILE", KVD_RECALL_FILE },
		{ "KEY_BYTES", KVD_KEY_BYTES },
		{ "VERSION_MAJOR", KVD_VERSION_MAJOR }, { "VERSION_MINOR", KVD_VERSION_MINOR },
	};
	struct module_state *st;
	PyObject *m = PyModule_Create(&kvd_module);

	if (!m)
		return NULL;
	st = state_of(m);
	st->error = PyErr_NewExceptionWithDoc("kvd.KvdError",
	                                      "A libkvd call failed: errno is the code, strerror "
	                                      "the message of the failed call.",
	                                      PyExc_OSError, NULL);
	if (!st->error || PyModule_AddObjectRef(m, "KvdError", st->error) < 0)
		goto fail;
	st->view_type = add_type(m, &view_spec, "View");
	st->client_type = st->view_type ? add_type(m, &client_spec, "Client") : NULL;
	st->seq_type = st->client_type ? add_type(m, &seq_spec, "Seq") : NULL;
	st->status_type = st->seq_type ? add_type(m, &status_spec, "Status") : NULL;
	if (!st->status_type)
		goto fail;
	for (size_t i = 0; i < sizeof(constants) / sizeof(constants[0]); i++)
		if (add_int(m, constants[i].name, constants[i].value) < 0)
			goto fail;
	if (PyModule_AddStringConstant(m, "DEFAULT_SOCKET", KVD_DEFAULT_SOCKET) < 0 ||
	    PyModule_AddStringConstant(m, "kvd_version", kvd_version()) < 0)
		goto fail;
	/* PyState_FindModule() finds it from the types' functions. */
	if (PyState_AddModule(m, &kvd_module) < 0)
		goto fail;
	return m;
fail:
	Py_DECREF(m);
	return NULL;
}
