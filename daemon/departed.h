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

/* Ends every hold as if the processes had exited, without the loop, which must not run
 * again: server_free(), after loop_free(); the fuzz harness, after a stop. */
void departed_end_all(struct server *s);
