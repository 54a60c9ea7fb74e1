/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Who may do what (docs/security.md). Three gates:
 *
 *   connect:  the socket file, mode 0660 and group socket-group (server.c);
 *   tenant:   at hello, a tenant the config file declares with allow-users or allow-groups
 *             only for peers whose uid is listed or whose groups include a listed group; a
 *             declared tenant without lists for anyone; a tenant the file does not declare
 *             as tenant-create says (any, admin, none); root always;
 *   admin:    budget set/reset and tenant set/reset only for root and members of
 *             admin-group.
 *
 * A peer's uid and primary gid are the SO_PEERCRED of connect(); its supplementary groups
 * come from SO_PEERGROUPS on the same socket, which the kernel also takes at connect().
 * Unlike getgrouplist() on the uid's name, that is what the process really holds (a
 * setgroups() is seen, a group added to /etc/group after login is not), it needs no NSS
 * lookup in the event loop, and unlike /proc/PID/status it cannot read a different process
 * that reused the pid. When the kernel cannot say (no SO_PEERGROUPS), only the primary
 * group counts: a refusal, never a wrong grant.
 *
 * Names are resolved to ids at start and on every reload (getpwnam, getgrnam; numbers are
 * taken as ids); a name that does not resolve grants nothing and is logged.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/socket.h>

#include "settings.h"

/* Resolves the tenants' allow lists and admin-group of s in place; logs names unknown. */
void access_resolve(struct settings *s);

/*
 * For --check-config: writes a line to f for every name of the allow lists, admin-group and
 * socket-group that names no user or group on this machine (it would grant nothing, or
 * fail at start); returns how many.
 */
unsigned access_check_names(const struct settings *s, FILE *f);

/* Whether the peer (cred, on socket fd) is root or in s's admin-group. */
bool access_admin(const struct settings *s, int fd, const struct ucred *cred);

/* Whether the peer may act as tenant: 0, or -EACCES with why saying so. */
int access_tenant(const struct settings *s, int fd, const struct ucred *cred, const char *tenant,
                  char *why, size_t why_n);
