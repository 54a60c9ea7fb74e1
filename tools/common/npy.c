/* SPDX-License-Identifier: MIT */
/*
 * The .npy reader and writer. The header is a Python dict literal,
 *   {'descr': '<f4', 'fortran_order': False, 'shape': (8, 4096, 128), }
 * padded with spaces and ended by a newline; the parser below accepts exactly that
 * grammar (single- or double-quoted keys and strings, True/False, a tuple of decimal
 * integers with an optional trailing comma, each of the three keys once) and checks every
 * index against the header's end before reading.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "npy.h"
#include "basic/io-util.h"

static const char npy_magic[6] = { '\x93', 'N', 'U', 'M', 'P', 'Y' };

static const struct {
	uint32_t dtype;
	const char *descr, *name;
	size_t size;
} npy_types[] = {
	{ KVD_NPY_F32, "<f4", "float32", 4 },
	{ KVD_NPY_F16, "<f2", "float16", 2 },
	{ KVD_NPY_I64, "<i8", "int64", 8 },
	{ KVD_NPY_I32, "<i4", "int32", 4 },
};

#define NPY_N_TYPES (sizeof(npy_types) / sizeof(npy_types[0]))

const char *kvd_npy_dtype_name(uint32_t dtype) {
	for (size_t i = 0; i < NPY_N_TYPES; i++)
		if (npy_types[i].dtype == dtype)
			return npy_types[i].name;
	return NULL;
}

__attribute__((format(printf, 5, 6))) static int npy_fail(char *err, size_t errlen, const char *name,
							  int r, const char *fmt, ...) {
	va_list ap;
	int n;

	if (!err || errlen == 0)
		return r;
	n = snprintf(err, errlen, "%s: ", name ? name : "(npy)");
	if (n < 0 || (size_t)n >= errlen)
		return r;
	va_start(ap, fmt);
	vsnprintf(err + n, errlen - (size_t)n, fmt, ap);
	va_end(ap);
	return r;
}

char *kvd_npy_shape_format(const struct kvd_npy *a, char *buf, size_t n) {
	size_t off = 0;

	if (!buf || n == 0)
		return buf;
	buf[0] = '\0';
	off += (size_t)snprintf(buf, n, "(");
	for (uint32_t i = 0; i < a->ndim && off < n; i++)
		off += (size_t)snprintf(buf + off, n - off, "%s%" PRIu64, i ? ", " : "", a->shape[i]);
	if (off < n)
		snprintf(buf + off, n - off, "%s)", a->ndim == 1 ? "," : "");
	return buf;
}

/* The accepted dtypes in words: "float32 or float16". */
static void accept_format(uint32_t accept, char *buf, size_t n) {
	size_t count = 0, seen = 0, off = 0;

	buf[0] = '\0';
	for (size_t i = 0; i < NPY_N_TYPES; i++)
		count += !!(accept & KVD_NPY_ACCEPT(npy_types[i].dtype));
	for (size_t i = 0; i < NPY_N_TYPES && off < n; i++) {
		if (!(accept & KVD_NPY_ACCEPT(npy_types[i].dtype)))
			continue;
		seen++;
		off += (size_t)snprintf(buf + off, n - off, "%s%s",
					seen == 1 ? "" : seen == count ? " or " : ", ", npy_types[i].name);
	}
}

/* ---- The header dict ---- */

struct cursor {
	const char *p;
	size_t pos, end;
	const char *name;
	char *err;
	size_t errlen;
};

static void skip_ws(struct cursor *c) {
	while (c->pos < c->end && (c->p[c->pos] == ' ' || c->p[c->pos] == '\t' ||
				   c->p[c->pos] == '\n' || c->p[c->pos] == '\r'))
		c->pos++;
}

static int expected(struct cursor *c, const char *what) {
	if (c->pos >= c->end)
		return npy_fail(c->err, c->errlen, c->name, -EBADMSG,
				"malformed header: ends where %s was expected", what);
	return npy_fail(c->err, c->errlen, c->name, -EBADMSG,
			"malformed header at byte %zu: expected %s", c->pos, what);
}

/* Consumes ch (after whitespace) if it is next; returns whether it did. */
static int accept_char(struct cursor *c, char ch) {
	skip_ws(c);
	if (c->pos < c->end && c->p[c->pos] == ch) {
		c->pos++;
		return 1;
	}
	return 0;
}

/* A quoted string without escapes; *ret points into the header, *ret_len bytes long. */
static int parse_string(struct cursor *c, const char **ret, size_t *ret_len) {
	char q;
	size_t start;

	skip_ws(c);
	if (c->pos >= c->end || (c->p[c->pos] != '\'' && c->p[c->pos] != '"'))
		return expected(c, "a quoted string");
	q = c->p[c->pos++];
	start = c->pos;
	while (c->pos < c->end && c->p[c->pos] != q) {
		if (c->p[c->pos] == '\\')
			return npy_fail(c->err, c->errlen, c->name, -EBADMSG,
					"malformed header at byte %zu: escapes in strings are not supported",
					c->pos);
		c->pos++;
	}
	if (c->pos >= c->end)
		return expected(c, "the end of a string");
	*ret = c->p + start;
	*ret_len = c->pos - start;
	c->pos++;
	return 0;
}

static int word_is(const char *s, size_t n, const char *w) {
	return n == strlen(w) && memcmp(s, w, n) == 0;
}

static int parse_bool(struct cursor *c, int *ret) {
	skip_ws(c);
	if (c->end - c->pos >= 4 && memcmp(c->p + c->pos, "True", 4) == 0) {
		c->pos += 4;
		*ret = 1;
		return 0;
	}
	if (c->end - c->pos >= 5 && memcmp(c->p + c->pos, "False", 5) == 0) {
		c->pos += 5;
		*ret = 0;
		return 0;
	}
	return expected(c, "True or False");
}

static int parse_shape(struct cursor *c, uint32_t *ret_ndim, uint64_t *shape) {
	uint32_t ndim = 0;

	if (!accept_char(c, '('))
		return expected(c, "'(' opening the shape");
	for (;;) {
		uint64_t v = 0;
		size_t start;

		if (accept_char(c, ')'))
			break;
		if (ndim > 0 && !accept_char(c, ','))
			return expected(c, "',' or ')' in the shape");
		if (accept_char(c, ')'))
			break;
		skip_ws(c);
		start = c->pos;
		while (c->pos < c->end && c->p[c->pos] >= '0' && c->p[c->pos] <= '9') {
			unsigned d = (unsigned)(c->p[c->pos] - '0');

			if (v > (UINT64_MAX - d) / 10)
				return npy_fail(c->err, c->errlen, c->name, -EOVERFLOW,
						"dimension %u of the shape does not fit in 64 bits", ndim);
			v = v * 10 + d;
			c->pos++;
		}
		if (c->pos == start)
			return expected(c, "a dimension (a non-negative integer)");
		/* Python 2 wrote longs with an L. */
		if (c->pos < c->end && c->p[c->pos] == 'L')
			c->pos++;
		if (ndim == KVD_NPY_MAX_DIMS)
			return npy_fail(c->err, c->errlen, c->name, -E2BIG,
					"more than %u dimensions", KVD_NPY_MAX_DIMS);
		shape[ndim++] = v;
	}
	*ret_ndim = ndim;
	return 0;
}

struct header {
	const char *descr;
	size_t descr_len;
	int fortran;
	uint32_t ndim;
	uint64_t shape[KVD_NPY_MAX_DIMS];
};

static int parse_dict(struct cursor *c, struct header *h) {
	int have_descr = 0, have_fortran = 0, have_shape = 0, r;

	if (!accept_char(c, '{'))
		return expected(c, "'{' opening the header dict");
	for (;;) {
		const char *key;
		size_t key_len;

		if (accept_char(c, '}'))
			break;
		r = parse_string(c, &key, &key_len);
		if (r < 0)
			return r;
		if (!accept_char(c, ':'))
			return expected(c, "':' after a key");
		if (word_is(key, key_len, "descr")) {
			skip_ws(c);
			if (have_descr++)
				return npy_fail(c->err, c->errlen, c->name, -EBADMSG, "header repeats 'descr'");
			if (c->pos < c->end && c->p[c->pos] == '[')
				return npy_fail(c->err, c->errlen, c->name, -EOPNOTSUPP,
						"structured dtypes are not supported");
			r = parse_string(c, &h->descr, &h->descr_len);
		} else if (word_is(key, key_len, "fortran_order")) {
			if (have_fortran++)
				return npy_fail(c->err, c->errlen, c->name, -EBADMSG,
						"header repeats 'fortran_order'");
			r = parse_bool(c, &h->fortran);
		} else if (word_is(key, key_len, "shape")) {
			if (have_shape++)
				return npy_fail(c->err, c->errlen, c->name, -EBADMSG, "header repeats 'shape'");
			r = parse_shape(c, &h->ndim, h->shape);
		} else
			return npy_fail(c->err, c->errlen, c->name, -EBADMSG,
					"header has an unknown key '%.*s'", (int)(key_len > 40 ? 40 : key_len), key);
		if (r < 0)
			return r;
		if (accept_char(c, '}'))
			break;
		if (!accept_char(c, ','))
			return expected(c, "',' or '}' after a value");
	}
	skip_ws(c);
	if (c->pos != c->end)
		return npy_fail(c->err, c->errlen, c->name, -EBADMSG,
				"malformed header at byte %zu: text after the dict", c->pos);
	if (!have_descr || !have_fortran || !have_shape)
		return npy_fail(c->err, c->errlen, c->name, -EBADMSG, "header lacks '%s'",
				!have_descr ? "descr" : !have_fortran ? "fortran_order" : "shape");
	return 0;
}

/* ---- Parsing a whole image ---- */

static uint32_t le16(const unsigned char *p) {
	return (uint32_t)p[0] | (uint32_t)p[1] << 8;
}

static uint32_t le32(const unsigned char *p) {
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

int kvd_npy_parse(const char *name, const void *buf, size_t len, uint32_t accept, int ndim,
		  struct kvd_npy *ret, char *err, size_t errlen) {
	const unsigned char *b = buf;
	struct header h = { 0 };
	struct cursor c;
	size_t pre, hlen, want, type = NPY_N_TYPES;
	uint64_t count = 1, bytes;
	char words[64];
	int r;

	if (err && errlen)
		err[0] = '\0';
	if (!ret || (!buf && len > 0))
		return npy_fail(err, errlen, name, -EINVAL, "invalid arguments");
	memset(ret, 0, sizeof(*ret));
	if (len < 10 || memcmp(b, npy_magic, sizeof(npy_magic)) != 0)
		return npy_fail(err, errlen, name, -EBADMSG, "not a .npy file");
	if (b[6] == 1 && b[7] == 0) {
		pre = 10;
		hlen = le16(b + 8);
	} else if ((b[6] == 2 || b[6] == 3) && b[7] == 0) {
		if (len < 12)
			return npy_fail(err, errlen, name, -EBADMSG,
					"truncated header: 12 bytes expected, %zu present", len);
		pre = 12;
		hlen = le32(b + 8);
	} else
		return npy_fail(err, errlen, name, -EOPNOTSUPP,
				".npy format version %u.%u not supported (want 1.0, 2.0 or 3.0)", b[6], b[7]);
	if (hlen > KVD_NPY_HEADER_MAX)
		return npy_fail(err, errlen, name, -E2BIG,
				"header of %zu bytes is larger than the %u allowed", hlen, KVD_NPY_HEADER_MAX);
	if (len - pre < hlen)
		return npy_fail(err, errlen, name, -EBADMSG,
				"truncated header: %zu bytes expected, %zu present", pre + hlen, len);

	c = (struct cursor){ (const char *)b, pre, pre + hlen, name, err, errlen };
	r = parse_dict(&c, &h);
	if (r < 0)
		return r;

	for (size_t i = 0; i < NPY_N_TYPES; i++)
		if (word_is(h.descr, h.descr_len, npy_types[i].descr))
			type = i;
	accept_format(accept, words, sizeof(words));
	if (type == NPY_N_TYPES || !(accept & KVD_NPY_ACCEPT(npy_types[type].dtype))) {
		const char *why = h.descr_len > 0 && h.descr[0] == '>' ? "big-endian dtype" : "dtype";

		return npy_fail(err, errlen, name, -EOPNOTSUPP, "%s '%.*s' not supported (want %s)", why,
				(int)(h.descr_len > 40 ? 40 : h.descr_len), h.descr, words[0] ? words : "nothing");
	}
	if (h.fortran)
		return npy_fail(err, errlen, name, -EOPNOTSUPP,
				"fortran_order arrays are not supported (save a C-order array, e.g. "
				"numpy.ascontiguousarray)");
	if (ndim >= 0 && h.ndim != (uint32_t)ndim)
		return npy_fail(err, errlen, name, -EINVAL, "expected %d dimension%s, got %u", ndim,
				ndim == 1 ? "" : "s", h.ndim);
	for (uint32_t i = 0; i < h.ndim; i++)
		if (__builtin_mul_overflow(count, h.shape[i], &count))
			return npy_fail(err, errlen, name, -EOVERFLOW, "shape overflows 64-bit sizes");
	if (__builtin_mul_overflow(count, (uint64_t)npy_types[type].size, &bytes) || bytes > SIZE_MAX ||
	    bytes > (uint64_t)(SIZE_MAX - pre - hlen))
		return npy_fail(err, errlen, name, -EOVERFLOW, "shape is too large for this machine");
	want = (size_t)bytes;
	if (len - pre - hlen < want)
		return npy_fail(err, errlen, name, -EBADMSG, "truncated: %zu bytes of data expected, %zu present",
				want, len - pre - hlen);
	if (len - pre - hlen > want)
		return npy_fail(err, errlen, name, -EBADMSG,
				"%zu bytes of data expected, %zu present (trailing bytes)", want, len - pre - hlen);

	ret->dtype = npy_types[type].dtype;
	ret->ndim = h.ndim;
	memcpy(ret->shape, h.shape, sizeof(h.shape));
	ret->count = count;
	ret->elem_size = npy_types[type].size;
	ret->data_bytes = want;
	ret->data = b + pre + hlen;
	return 0;
}

/* ---- Files ---- */

void kvd_npy_close(struct kvd_npy *a) {
	if (!a)
		return;
	if (a->map_)
		munmap(a->map_, a->map_len_);
	free(a->copy_);
	memset(a, 0, sizeof(*a));
}

int kvd_npy_open(const char *path, uint32_t accept, int ndim, struct kvd_npy *ret, char *err,
		 size_t errlen) {
	struct stat st;
	void *map;
	int fd, r;

	if (err && errlen)
		err[0] = '\0';
	if (!path || !ret)
		return npy_fail(err, errlen, path, -EINVAL, "invalid arguments");
	memset(ret, 0, sizeof(*ret));
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		r = -errno;
		return npy_fail(err, errlen, path, r, "%s", strerror(-r));
	}
	if (fstat(fd, &st) < 0) {
		r = -errno;
		close(fd);
		return npy_fail(err, errlen, path, r, "%s", strerror(-r));
	}
	if (!S_ISREG(st.st_mode)) {
		close(fd);
		r = S_ISDIR(st.st_mode) ? -EISDIR : -EINVAL;
		return npy_fail(err, errlen, path, r, "not a regular file");
	}
	if (st.st_size < 10) {
		close(fd);
		return npy_fail(err, errlen, path, -EBADMSG, "not a .npy file");
	}
	if ((uint64_t)st.st_size > SIZE_MAX) {
		close(fd);
		return npy_fail(err, errlen, path, -EOVERFLOW, "file too large for this machine");
	}
	map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
	r = map == MAP_FAILED ? -errno : 0;
	close(fd);
	if (r < 0)
		return npy_fail(err, errlen, path, r, "mmap: %s", strerror(-r));

	r = kvd_npy_parse(path, map, (size_t)st.st_size, accept, ndim, ret, err, errlen);
	if (r < 0) {
		munmap(map, (size_t)st.st_size);
		return r;
	}
	ret->map_ = map;
	ret->map_len_ = (size_t)st.st_size;
	/* The map is page-aligned, so only an odd header length misaligns the data. */
	if (((uintptr_t)ret->data % ret->elem_size) != 0) {
		ret->copy_ = aligned_alloc(64, ret->data_bytes ? (ret->data_bytes + 63) / 64 * 64 : 64);
		if (!ret->copy_) {
			kvd_npy_close(ret);
			return npy_fail(err, errlen, path, -ENOMEM, "out of memory");
		}
		memcpy(ret->copy_, ret->data, ret->data_bytes);
		ret->data = ret->copy_;
		munmap(ret->map_, ret->map_len_);
		ret->map_ = NULL;
		ret->map_len_ = 0;
	}
	return 0;
}

int kvd_npy_write(const char *path, uint32_t dtype, uint32_t ndim, const uint64_t *shape,
		  const void *data, char *err, size_t errlen) {
	/* The dict of KVD_NPY_MAX_DIMS 20-digit dimensions fits in 512 bytes with its padding. */
	char hdr[512 + 64];
	size_t type = NPY_N_TYPES, off, pre, total;
	uint64_t count = 1, bytes;
	int fd, r;

	if (err && errlen)
		err[0] = '\0';
	for (size_t i = 0; i < NPY_N_TYPES; i++)
		if (npy_types[i].dtype == dtype)
			type = i;
	if (!path || type == NPY_N_TYPES || ndim > KVD_NPY_MAX_DIMS || (ndim > 0 && !shape))
		return npy_fail(err, errlen, path, -EINVAL, "invalid arguments");
	for (uint32_t i = 0; i < ndim; i++)
		if (__builtin_mul_overflow(count, shape[i], &count))
			return npy_fail(err, errlen, path, -EOVERFLOW, "shape overflows 64-bit sizes");
	if (__builtin_mul_overflow(count, (uint64_t)npy_types[type].size, &bytes) || bytes > SIZE_MAX)
		return npy_fail(err, errlen, path, -EOVERFLOW, "shape is too large for this machine");
	if (bytes > 0 && !data)
		return npy_fail(err, errlen, path, -EINVAL, "invalid arguments");

	/* Version 1.0 always suffices here: the dict is far below 64 KiB. */
	pre = 10;
	off = pre;
	off += (size_t)snprintf(hdr + off, sizeof(hdr) - off,
				"{'descr': '%s', 'fortran_order': False, 'shape': (", npy_types[type].descr);
	for (uint32_t i = 0; i < ndim; i++)
		off += (size_t)snprintf(hdr + off, sizeof(hdr) - off, "%s%" PRIu64, i ? ", " : "", shape[i]);
	off += (size_t)snprintf(hdr + off, sizeof(hdr) - off, "%s), }", ndim == 1 ? "," : "");
	/* Spaces, then a newline, to a multiple of 64 bytes: numpy's alignment of the data. */
	total = (off + 1 + 63) / 64 * 64;
	memset(hdr + off, ' ', total - 1 - off);
	hdr[total - 1] = '\n';
	memcpy(hdr, npy_magic, sizeof(npy_magic));
	hdr[6] = 1;
	hdr[7] = 0;
	hdr[8] = (char)((total - pre) & 0xff);
	hdr[9] = (char)((total - pre) >> 8);

	fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0) {
		r = -errno;
		return npy_fail(err, errlen, path, r, "%s", strerror(-r));
	}
	r = write_all(fd, hdr, total);
	if (r >= 0)
		r = write_all(fd, data, (size_t)bytes);
	if (close(fd) < 0 && r >= 0)
		r = -errno;
	if (r < 0) {
		unlink(path);
		return npy_fail(err, errlen, path, r, "write: %s", strerror(-r));
	}
	return 0;
}
