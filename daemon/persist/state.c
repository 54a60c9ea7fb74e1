/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "basic/macro.h"
#include "basic/number.h"
#include "basic/size.h"
#include "policy.h"
#include "tier.h"
#include "state.h"
#include "basic/io-util.h"

#define WEIGHT_MAX 10000

int state_new(const char *dir, uint32_t max_tenants, struct state **ret) {
	struct state *st = calloc(1, sizeof(*st));

	if (!st)
		return -ENOMEM;
	st->max_tenants = max_tenants;
	st->dir = strdup(dir);
	if (!st->dir || asprintf(&st->path, "%s/%s", dir, STATE_FILE_NAME) < 0) {
		st->path = NULL;
		state_free(st);
		return -ENOMEM;
	}
	*ret = st;
	return 0;
}

struct state *state_free(struct state *st) {
	if (!st)
		return NULL;
	free(st->dir);
	free(st->path);
	free(st->tenants);
	free(st->saved);
	free(st);
	return NULL;
}

struct state_tenant *state_tenant_find(const struct state *st, const char *name) {
	for (uint32_t i = 0; i < st->n_tenants; i++)
		if (strcmp(st->tenants[i].name, name) == 0)
			return &st->tenants[i];
	return NULL;
}

int state_tenant_get(struct state *st, const char *name, struct state_tenant **ret) {
	struct state_tenant *t = state_tenant_find(st, name);

	if (t) {
		*ret = t;
		return 0;
	}
	if (!tenant_name_valid(name))
		return -EINVAL;
	if (st->n_tenants >= st->max_tenants)
		return -EUSERS;
	t = realloc(st->tenants, (st->n_tenants + 1) * sizeof(*t));
	if (!t)
		return -ENOMEM;
	st->tenants = t;
	t = &st->tenants[st->n_tenants++];
	*t = (struct state_tenant){};
	snprintf(t->name, sizeof(t->name), "%s", name);
	*ret = t;
	return 0;
}

bool state_tenant_remove(struct state *st, const char *name) {
	struct state_tenant *t = state_tenant_find(st, name);

	if (!t)
		return false;
	/* Order is kept, so that the file does not reshuffle on every change. */
	memmove(t, t + 1, (size_t)(st->tenants + st->n_tenants - (t + 1)) * sizeof(*t));
	st->n_tenants--;
	return true;
}

/* ---- reading ---- */

struct load {
	struct state *st;
	struct state_tenant *tenant;  /* the current [tenant] section; NULL in [kvd] */
};

static bool on_section(struct inifile_ctx *ctx, const char *name) {
	struct load *l = ctx->userdata;
	int r;

	if (strcmp(name, "kvd") == 0) {
		l->tenant = NULL;
		return true;
	}
	if (strncmp(name, "tenant ", 7) != 0) {
		inifile_ctx_error(ctx, "unknown section [%s]", name);
		return false;
	}
	r = state_tenant_get(l->st, name + 7, &l->tenant);
	if (r < 0) {
		inifile_ctx_error(ctx, "tenant '%s': %s", name + 7,
		                  r == -EUSERS ? "more tenants than max-tenants" :
		                  r == -EINVAL ? "invalid name" : strerror(-r));
		return false;
	}
	return true;
}

static int parse_size(const char *value, bool none, uint64_t *ret) {
	if (none && strcasecmp(value, "none") == 0) {
		*ret = KVD_TENANT_NO_CAP;
		return 0;
	}
	return size_parse(value, ret);
}

static void on_key(struct inifile_ctx *ctx, const char *section, const char *key,
                   const char *value) {
	struct load *l = ctx->userdata;
	struct state_tenant *t = l->tenant;
	uint64_t v;

	if (!section) {
		inifile_ctx_error(ctx, "'%s' is outside a section", key);
		return;
	}
	if (!t && strcmp(key, "budget") == 0) {
		if (parse_size(value, false, &v) < 0)
			goto bad;
		l->st->has_budget = true;
		l->st->budget = v;
	} else if (t && strcmp(key, "min") == 0) {
		if (parse_size(value, false, &v) < 0)
			goto bad;
		t->has_min = true;
		t->min_bytes = v;
	} else if (t && strcmp(key, "max") == 0) {
		if (parse_size(value, true, &v) < 0)
			goto bad;
		t->has_max = true;
		t->max_bytes = v;
	} else if (t && strcmp(key, "weight") == 0) {
		if (number_parse_u64(value, 1, WEIGHT_MAX, &v) < 0)
			goto bad;
		t->has_weight = true;
		t->weight = (uint32_t)v;
	} else if (t && strcmp(key, "policy") == 0) {
		enum kvd_policy p = kvd_policy_from_string(value);

		if (p < 0)
			goto bad;
		t->has_policy = true;
		t->policy = p;
	} else if (t && strcmp(key, "tier") == 0) {
		int m = tier_mode_from_string(value);

		if (m < 0)
			goto bad;
		t->has_tier = true;
		t->tier = m;
	} else if (t && strcmp(key, "recall") == 0) {
		if (number_parse_u64(value, 0, KVD_TENANT_RECALL_MAX, &v) < 0)
			goto bad;
		t->has_recall = true;
		t->recall = (uint32_t)v;
	} else
		inifile_ctx_error(ctx, "unknown key '%s' in [%s]", key, section);
	return;
bad:
	inifile_ctx_error(ctx, "%s: invalid value '%s'", key, value);
}

/*
 * Whether fd (the state directory, or the file) may be trusted: whoever may write either
 * decides the node's budget and tenants at the next start, so both must be kvd's user's
 * and writable by it alone, the file a regular one with no other link. When not, why says
 * so (never anything of the file's contents).
 */
static bool trusted(int fd, bool dir, char *why, size_t n) {
	struct stat sb;

	if (fstat(fd, &sb) < 0)
		snprintf(why, n, "cannot stat: %s", strerror(errno));
	else if (!dir && !S_ISREG(sb.st_mode))
		snprintf(why, n, "not a regular file");
	else if (sb.st_uid != geteuid())
		snprintf(why, n, "owned by uid %u, not by kvd's (%u)", (unsigned)sb.st_uid,
		         (unsigned)geteuid());
	else if (sb.st_mode & (S_IWGRP | S_IWOTH))
		snprintf(why, n, "writable by others (mode %04o)", (unsigned)(sb.st_mode & 07777));
	else if (!dir && sb.st_nlink != 1)
		snprintf(why, n, "has %ju links", (uintmax_t)sb.st_nlink);
	else
		return true;
	return false;
}

/* Opens the state directory when it exists and may be trusted; -ENOENT when it does not
 * exist, else -EPERM or the error, with why. */
static int open_dir(const struct state *st, char *why, size_t n) {
	int fd = open(st->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);

	if (fd < 0) {
		snprintf(why, n, "cannot open: %s", strerror(errno));
		return negative_errno();
	}
	if (!trusted(fd, true, why, n)) {
		close(fd);
		return -EPERM;
	}
	return fd;
}

/* A state that is not read: said in e (logged) and in st->error (status), until a save. */
static int refuse_load(struct state *st, struct inifile_errors *e, const char *path, const char *why) {
	inifile_error(e, path, 0, "refused, the live settings there are not applied: %s", why);
	snprintf(st->error, sizeof(st->error), "live settings in %s not read: %s", path, why);
	return 0;
}

int state_load(struct state *st, struct inifile_errors *e) {
	static const struct inifile_ops ops = { .section = on_section, .key = on_key };
	struct load l = { .st = st };
	_cleanup_(closep) int dir_fd = -EBADF;
	char why[128];
	int fd, r;

	dir_fd = open_dir(st, why, sizeof(why));
	if (dir_fd == -ENOENT)
		return 0;
	if (dir_fd < 0)
		return refuse_load(st, e, st->dir, why);
	/* Never blocks (a FIFO), never follows a link planted there. */
	fd = openat(dir_fd, STATE_FILE_NAME, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0 && errno == ENOENT)
		return 0;
	if (fd < 0)
		return refuse_load(st, e, st->path, errno == ELOOP ? "a symbolic link" : strerror(errno));
	if (!trusted(fd, false, why, sizeof(why))) {
		close(fd);
		return refuse_load(st, e, st->path, why);
	}
	r = inifile_parse_fd(fd, st->path, STATE_FILE_MAX, &ops, &l, e);
	return r == -ENOMEM ? r : 0;
}

/* ---- writing ---- */

int state_format(const struct state *st, char **ret) {
	char *text = NULL;
	size_t size = 0;
	FILE *f;

	f = open_memstream(&text, &size);
	if (!f)
		return -ENOMEM;
	fprintf(f, "# kvd live settings: what kvdctl changed while kvd ran. They win over the\n"
	        "# config file until kvdctl resets them. Written by kvd; edit only while it is\n"
	        "# stopped.\n");
	if (st->has_budget)
		fprintf(f, "\n[kvd]\nbudget = %" PRIu64 "\n", st->budget);
	for (uint32_t i = 0; i < st->n_tenants; i++) {
		const struct state_tenant *t = &st->tenants[i];

		fprintf(f, "\n[tenant %s]\n", t->name);
		if (t->has_min)
			fprintf(f, "min = %" PRIu64 "\n", t->min_bytes);
		if (t->has_max && t->max_bytes == KVD_TENANT_NO_CAP)
			fprintf(f, "max = none\n");
		else if (t->has_max)
			fprintf(f, "max = %" PRIu64 "\n", t->max_bytes);
		if (t->has_weight)
			fprintf(f, "weight = %" PRIu32 "\n", t->weight);
		if (t->has_policy)
			fprintf(f, "policy = %s\n", kvd_policy_to_string(t->policy));
		if (t->has_tier)
			fprintf(f, "tier = %s\n", tier_mode_to_string(t->tier));
		if (t->has_recall)
			fprintf(f, "recall = %" PRIu32 "\n", t->recall);
	}
	if (fclose(f) != 0) {
		free(text);
		return -ENOMEM;
	}
	*ret = text;
	return 0;
}

static int save_error(struct state *st, int r, const char *what, const char *path) {
	snprintf(st->error, sizeof(st->error), "cannot %s %s: %s", what, path, strerror(-r));
	return r;
}

int state_save(struct state *st) {
	_cleanup_(freep) char *text = NULL, *tmp = NULL;
	_cleanup_(closep) int fd = -EBADF, dir_fd = -EBADF;
	char why[128];
	size_t len;
	int r;

	r = state_format(st, &text);
	if (r < 0)
		return save_error(st, r, "format", st->path);
	if (st->saved && !st->error[0] && strcmp(st->saved, text) == 0)
		return 0;
	len = strlen(text);
	if (len > STATE_FILE_MAX)
		return save_error(st, -EFBIG, "write", st->path);
	if (mkdir(st->dir, 0700) < 0 && errno != EEXIST)
		return save_error(st, negative_errno(), "create", st->dir);
	dir_fd = open_dir(st, why, sizeof(why));
	if (dir_fd < 0) {
		snprintf(st->error, sizeof(st->error), "cannot write in %s: %s", st->dir, why);
		return dir_fd;
	}
	if (asprintf(&tmp, "%s/.%s.XXXXXX", st->dir, STATE_FILE_NAME) < 0) {
		tmp = NULL;
		return save_error(st, -ENOMEM, "write", st->path);
	}
	fd = mkostemp(tmp, O_CLOEXEC);
	if (fd < 0)
		return save_error(st, negative_errno(), "create a file in", st->dir);
	/* 0600, as mkostemp() made it: tenants' names and shares are the daemon's to tell (kvdctl
	 * status asks it, with its access rules), not every local user's to read. */
	r = write_all(fd, text, len);
	/* The data must be on disk before the rename makes it the state. */
	if (r >= 0 && fsync(fd) < 0)
		r = negative_errno();
	if (r >= 0 && close(TAKE_FD(fd)) < 0)
		r = negative_errno();
	if (r >= 0 && rename(tmp, st->path) < 0)
		r = negative_errno();
	if (r < 0) {
		unlink(tmp);
		return save_error(st, r, "write", st->path);
	}
	/* And the rename itself, so that a crash cannot bring the old file back. */
	if (fsync(dir_fd) < 0)
		return save_error(st, negative_errno(), "sync", st->dir);
	free(st->saved);
	st->saved = TAKE_PTR(text);
	st->error[0] = '\0';
	return 0;
}
