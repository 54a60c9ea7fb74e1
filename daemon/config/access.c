/* SPDX-License-Identifier: MIT */
/* Access control: see access.h. */
#include <errno.h>
#include <grp.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "access.h"
#include "basic/number.h"
#include "log.h"

/* A name of a list (or a number) as a uid or gid; false when it names nobody. */
static bool resolve_id(const char *name, bool group, uint32_t *ret) {
	uint64_t v;

	if (number_parse_u64(name, 0, UINT32_MAX - 1, &v) >= 0) {
		*ret = (uint32_t)v;
		return true;
	}
	if (group) {
		const struct group *g = getgrnam(name);

		if (g)
			*ret = (uint32_t)g->gr_gid;
		return g != NULL;
	}
	const struct passwd *pw = getpwnam(name);

	if (pw)
		*ret = (uint32_t)pw->pw_uid;
	return pw != NULL;
}

static uint32_t resolve_list(const char *tenant, const char *list, bool group, uint32_t *ids) {
	uint32_t n = 0;
	char name[SETTINGS_LIST_NAME_MAX];

	for (const char *p = list; p && *p; p += strspn(p, " ")) {
		size_t len = strcspn(p, " ");

		snprintf(name, sizeof(name), "%.*s", (int)len, p);
		p += len;
		if (n < SETTINGS_LIST_MAX && resolve_id(name, group, &ids[n]))
			n++;
		else
			log_warning("tenant %s: %s '%s' does not exist; it grants nothing", tenant,
			            group ? "allow-groups: group" : "allow-users: user", name);
	}
	return n;
}

/* Names of list (space-separated) that resolve to nobody, each as one line on f. */
static unsigned check_list(FILE *f, const char *what, const char *list, bool group) {
	char name[SETTINGS_LIST_NAME_MAX];
	unsigned bad = 0;
	uint32_t id;

	for (const char *p = list; p && *p; p += strspn(p, " ")) {
		size_t len = strcspn(p, " ");

		snprintf(name, sizeof(name), "%.*s", (int)len, p);
		p += len;
		if (!resolve_id(name, group, &id)) {
			fprintf(f, "warning: %s: %s '%s' does not exist on this machine\n", what,
			        group ? "group" : "user", name);
			bad++;
		}
	}
	return bad;
}

unsigned access_check_names(const struct settings *s, FILE *f) {
	char what[KVD_TENANT_NAME_MAX + 32];
	unsigned bad = 0;

	for (uint32_t i = 0; i < s->n_tenants; i++) {
		const struct settings_tenant *t = &s->tenants[i];

		snprintf(what, sizeof(what), "tenant %s: allow-users", t->name);
		bad += check_list(f, what, t->allow_users, false);
		snprintf(what, sizeof(what), "tenant %s: allow-groups", t->name);
		bad += check_list(f, what, t->allow_groups, true);
	}
	bad += check_list(f, "admin-group", s->admin_group, true);
	bad += check_list(f, "socket-group", s->socket_group, true);
	return bad;
}

void access_resolve(struct settings *s) {
	for (uint32_t i = 0; i < s->n_tenants; i++) {
		struct settings_tenant *t = &s->tenants[i];

		t->n_allow_uids = resolve_list(t->name, t->allow_users, false, t->allow_uids);
		t->n_allow_gids = resolve_list(t->name, t->allow_groups, true, t->allow_gids);
	}
	s->has_admin_gid = s->admin_group && *s->admin_group &&
	                   resolve_id(s->admin_group, true, &s->admin_gid);
	if (!s->has_admin_gid)
		log_info("admin-group %s does not exist: only root may change the budget and tenants",
		         s->admin_group ? s->admin_group : "");
}

/* Whether the peer's primary or supplementary groups include one of gids. */
static bool peer_in_groups(int fd, const struct ucred *cred, const uint32_t *gids, uint32_t n) {
	gid_t groups[256];
	socklen_t len = sizeof(groups);
	size_t n_groups = 0;

	if (n == 0)
		return false;
	for (uint32_t i = 0; i < n; i++)
		if (gids[i] == (uint32_t)cred->gid)
			return true;
#ifdef SO_PEERGROUPS
	/* ERANGE: more than 256 groups; those first are all we look at (a refusal at worst). */
	if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) == 0)
		n_groups = len / sizeof(gid_t);
#else
	(void)fd;
	(void)len;
#endif
	for (size_t k = 0; k < n_groups; k++)
		for (uint32_t i = 0; i < n; i++)
			if (gids[i] == (uint32_t)groups[k])
				return true;
	return false;
}

bool access_admin(const struct settings *s, int fd, const struct ucred *cred) {
	if (cred->uid == 0)
		return true;
	return s->has_admin_gid && peer_in_groups(fd, cred, &s->admin_gid, 1);
}

int access_tenant(const struct settings *s, int fd, const struct ucred *cred, const char *tenant,
                  char *why, size_t why_n) {
	const struct settings_tenant *t = settings_tenant_find(s, tenant);

	if (cred->uid == 0)
		return 0;
	if (!t) {
		switch (s->tenant_create) {
		case SETTINGS_TENANT_CREATE_ANY:
			return 0;
		case SETTINGS_TENANT_CREATE_ADMIN:
			if (access_admin(s, fd, cred))
				return 0;
			snprintf(why, why_n, "tenant %s is not in the config file, and uid %u may not act "
			         "as such a tenant (tenant-create = admin)", tenant, (unsigned)cred->uid);
			return -EACCES;
		default:
			snprintf(why, why_n, "tenant %s is not in the config file, and only root may act "
			         "as such a tenant (tenant-create = none)", tenant);
			return -EACCES;
		}
	}
	if (!t->allow_users && !t->allow_groups)
		return 0;
	for (uint32_t i = 0; i < t->n_allow_uids; i++)
		if (t->allow_uids[i] == (uint32_t)cred->uid)
			return 0;
	if (peer_in_groups(fd, cred, t->allow_gids, t->n_allow_gids))
		return 0;
	snprintf(why, why_n, "uid %u is not allowed to act as tenant %s (allow-users, allow-groups)",
	         (unsigned)cred->uid, tenant);
	return -EACCES;
}
