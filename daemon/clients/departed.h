/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Processes that left while they still mapped chunks. A connection that closes without
 * acknowledging the unmap of a chunk it was given may still map it, through its process
 * (which may live on after the connection) or any it passed the fd to: on a GPU that
 * memory stays allocated for as long as the process imports it. So the chunk stays
 * charged to its tenant, the connection's id staying among its holders, until the process
 * exits, which the daemon sees through a pidfd of the peer (SO_PEERPIDFD where the kernel
 * has it, else pidfd_open() of the pid SO_PEERCRED gave at connect; see conn.h). A
 * well-behaved client acknowledges before it closes (libkvd does), and is charged nothing
 * after. Descendants the process forked, or processes it passed the fd to, are not
 * watched: what they keep is the tenant's own memory, which never reaches another tenant
 * (pool.h, "Isolation"), but is no longer charged once the watched process is gone.
 */

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

struct server;

/*
 * Keeps conn_id as a holder of the n_chunks chunks it still maps until the process behind
 * pidfd (taken over) exits; logs it. Returns 0, or -ENOMEM or the loop's -errno, and then
 * takes nothing: the caller drops the holds as for a process that exited.
 */
int departed_watch(struct server *s, uint64_t conn_id, int pidfd, pid_t pid, const char *tenant,
                   uint32_t n_chunks);

/* Whether conn_id is a departed holder still watched. */
bool departed_find(const struct server *s, uint64_t conn_id);
/* The tenant departed holder conn_id held for, or NULL. */
const char *departed_tenant(const struct server *s, uint64_t conn_id);

/* A departed holder, as listings show it (kvdctl connections). */
struct departed_info {
	uint64_t conn_id;
	pid_t pid;
	const char *tenant;           /* valid until the holder ends */
	uint64_t since_ms;            /* when its connection closed (CLOCK_MONOTONIC) */
	uint32_t chunks;              /* chunks still charged for it */
};

/* The departed holders with an id above after, at most max, in no order. */
uint32_t departed_list(const struct server *s, uint64_t after, struct departed_info *out,
                       uint32_t max);

/*
 * An operator ends departed holder conn_id's charge while its process lives (kvdctl
 * disconnect): its holds go, and each chunk that comes free by it loses its memory object,
 * so that whatever the process still maps is never what kvd hands out next (on the host
 * backend its pages go back to the system; on a GPU an allocation it still imports stays
 * allocated until it lets go, and a chunk that cannot get new memory meanwhile is charged
 * as pinned, pool.h). by names the operator, for the log. Returns 0 or -ENOENT.
 */
int departed_end(struct server *s, uint64_t conn_id, const char *by);

/* Ends every hold as if the processes had exited, without the loop, which must not run
 * again: server_free(), after loop_free(); the fuzz harness, after a stop. */
void departed_end_all(struct server *s);
