/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The shared memory the daemon hands its clients (chunks on host, descriptors, observation
 * buffers, rings) and keeps in the fd store (the restart journal): a memfd that the daemon
 * maps read-write and that nobody can resize, since a file shrunk under the daemon's
 * mapping turns its next access into SIGBUS.
 */

#include <stdint.h>

/*
 * Creates a memfd called name of bytes (zeroed), maps it read-write and shared, then seals
 * it against shrinking, growing and further seals, plus extra_seals (F_SEAL_FUTURE_WRITE:
 * clients may map it read-only only, while this mapping stays writable). Returns 0 with the
 * fd (O_CLOEXEC) in *ret_fd and the mapping in *ret_map, or -errno with nothing left open.
 */
int memfd_sealed(const char *name, uint64_t bytes, unsigned extra_seals, int *ret_fd,
                 void **ret_map);
