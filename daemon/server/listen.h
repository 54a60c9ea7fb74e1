/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The clients' listening socket: bound by the daemon or passed by a service manager, and
 * the accepts, refused at max-connections and max-connections-per-uid (with
 * ADMIN_CONNECTIONS_RESERVED past both for operators) and paused while fds run out.
 */

struct server;

/* Takes the socket a service manager passed among sockets (n_sockets of them, taken over
 * whatever happens), or binds socket_path (socket-group's, mode 0660). Returns 0, or
 * -errno, logged. */
int listen_open(struct server *s, const char *socket_path, int *sockets, unsigned n_sockets);
/* Starts accepting on the loop; -errno when it cannot. */
int listen_start(struct server *s);
/* Closes the socket, and removes its file when the daemon bound it. */
void listen_close(struct server *s);

/* Accepts again after a pause for want of fds (a connection closed, or the tick). */
void listen_resume(struct server *s);
