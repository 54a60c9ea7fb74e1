/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * libkvd's address range for a host pool (KVD_MEMORY_HOST): at hello, a tenant's connection
 * reserves address space for the whole pool (PROT_NONE, no memory behind it), and chunk id i
 * is mapped at base + i * chunk_bytes, as the cuda backend's chunks are in their device
 * range (cuda-import.h). One base for every chunk is what a paged block table needs
 * (kvd_client_block_pool): a block's index is its offset from the base over the stride.
 *
 * Taking a chunk back maps PROT_NONE memory over it again, so that nothing else of the
 * process lands there; adjacent chunks go in one call. If that fails (the process is out of
 * mappings), the chunk is unmapped and its place becomes a hole that anything may take: the
 * next grant of that id maps there only if the place is still free, else elsewhere (and
 * block tables refuse blocks outside the range).
 */

#include <stdbool.h>
#include <stdint.h>

struct client_range;

/* At most this much address space is reserved (16 TiB: a 47-bit user space has 128). */
#define CLIENT_RANGE_MAX (UINT64_C(1) << 44)

/* Reserves the range for pool_bytes in chunks of chunk_bytes. Returns 0, or -EINVAL (sizes
 * that do not make a pool, or over CLIENT_RANGE_MAX), -ENOMEM. */
int client_range_new(uint64_t pool_bytes, uint64_t chunk_bytes, struct client_range **ret);
/* Unmaps the range with whatever is still mapped in it; in a fork() child, where the range
 * is not inherited (MADV_DONTFORK), only frees the struct. */
struct client_range *client_range_free(struct client_range *r, bool child);
/* The range's first byte. */
void *client_range_base(const struct client_range *r);
/* Maps chunk id from fd (not closed: the caller owns it) at its place, or, with hole (its
 * place was left a hole), there if still free, else anywhere. Returns 0 and the address, or
 * -EPROTO (id or bytes outside the pool), -errno of mmap(2) or madvise(2). */
int client_range_map(struct client_range *r, uint32_t id, int fd, uint64_t bytes, bool hole,
                     void **ret_addr);
/* Takes back bytes at addr: one chunk, or several adjacent ones of the range. Returns false
 * when a chunk of the range was left a hole (see above). */
bool client_range_unmap(struct client_range *r, void *addr, uint64_t bytes);
