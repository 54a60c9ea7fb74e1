/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * libkvd's side of the cuda backend: importing chunks that are cuMemCreate allocations
 * exported as POSIX fds (kvd.proto MEMORY_CUDA). The driver is loaded at run time
 * (basic/cuda-dl.h), so libkvd needs no CUDA library and works against host daemons on
 * machines without one.
 *
 * One virtual range per connection (a tenant's process and the one device of the daemon's
 * pool its chunks come from) is reserved for the whole pool at hello: chunk id i is mapped at base + i * chunk_bytes, so
 * that a block's address is a plain device pointer, stable for as long as the chunk stays
 * mapped, and found without a lock. The calls run in the device's primary context (the one
 * the CUDA runtime uses), pushed and popped around each call so that the engine's current
 * context is left as it was. Called with the client's lock held.
 *
 * UNVERIFIED on hardware: written against CUDA 13's cuda.h, run here without a driver only.
 */

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct client_cuda;

#ifdef KVD_HAVE_CUDA
/*
 * Loads the driver, finds the device whose UUID is uuid (16 bytes) among this process's
 * devices, and reserves address space for pool_bytes in chunks of chunk_bytes. Returns 0,
 * or -EPROTO (sizes that do not make a pool), -ENOENT/-ENOSYS/-ENODEV/-ENXIO (no usable
 * driver, see cuda_dl_load), -ENODEV (the daemon's GPU is not visible here, e.g. hidden by
 * CUDA_VISIBLE_DEVICES), -ENOMEM.
 */
int client_cuda_new(const uint8_t *uuid, size_t uuid_len, uint64_t pool_bytes,
                    uint64_t chunk_bytes, struct client_cuda **ret);
/* Unmaps nothing (the caller unmapped its chunks) and frees the range. In a fork() child,
 * where the driver must not be called, only the memory of the struct is freed. */
struct client_cuda *client_cuda_free(struct client_cuda *cc, bool child);
/* Imports chunk id from fd (not closed: the caller owns it), maps it at its place and
 * grants this device read-write access. Returns 0 and the device address in *ret_addr, or
 * -EPROTO (id or bytes outside the pool), -errno from the driver. */
int client_cuda_map(struct client_cuda *cc, uint32_t id, int fd, uint64_t bytes, void **ret_addr);
void client_cuda_unmap(struct client_cuda *cc, void *addr, uint64_t bytes);
/* The device's ordinal in this process. */
int client_cuda_device(const struct client_cuda *cc);
/* The range's first byte (a device pointer): chunk id i is mapped at base + i * chunk_bytes. */
char *client_cuda_base(const struct client_cuda *cc);
/* The UUID (uuid_len 16) of the device of the context current on the calling thread, for
 * the hello: 0, or -ENODEV when there is none (or the driver is not loaded in this process
 * already: libkvd does not load it just to ask). */
int client_cuda_current_uuid(uint8_t *uuid, size_t uuid_len);
/* The UUID of device `ordinal` of this process (loading the driver): 0, -ENODEV (no such
 * device), or cuda_dl_load's error. */
int client_cuda_device_uuid(int ordinal, uint8_t *uuid, size_t uuid_len);
/* The IPC handle (len 64) of event, a CUevent made with CU_EVENT_INTERPROCESS, in the
 * context current on the calling thread. Returns 0, -EINVAL (not such an event), -errno. */
int client_cuda_event_handle(void *event, uint8_t *handle, size_t len);
/* Waits until event (a CUevent) completes. Returns 0 or -errno. */
int client_cuda_event_sync(void *event);
#else
static inline int client_cuda_new(const uint8_t *uuid, size_t uuid_len, uint64_t pool_bytes,
                                  uint64_t chunk_bytes, struct client_cuda **ret) {
	(void)uuid, (void)uuid_len, (void)pool_bytes, (void)chunk_bytes, (void)ret;
	return -EOPNOTSUPP;
}
static inline struct client_cuda *client_cuda_free(struct client_cuda *cc, bool child) {
	(void)cc, (void)child;
	return NULL;
}
static inline int client_cuda_map(struct client_cuda *cc, uint32_t id, int fd, uint64_t bytes,
                                  void **ret_addr) {
	(void)cc, (void)id, (void)fd, (void)bytes, (void)ret_addr;
	return -EOPNOTSUPP;
}
static inline void client_cuda_unmap(struct client_cuda *cc, void *addr, uint64_t bytes) {
	(void)cc, (void)addr, (void)bytes;
}
static inline int client_cuda_device(const struct client_cuda *cc) {
	(void)cc;
	return -1;
}
static inline char *client_cuda_base(const struct client_cuda *cc) {
	(void)cc;
	return NULL;
}
static inline int client_cuda_current_uuid(uint8_t *uuid, size_t uuid_len) {
	(void)uuid, (void)uuid_len;
	return -ENODEV;
}
static inline int client_cuda_device_uuid(int ordinal, uint8_t *uuid, size_t uuid_len) {
	(void)ordinal, (void)uuid, (void)uuid_len;
	return -ENODEV;
}
static inline int client_cuda_event_handle(void *event, uint8_t *handle, size_t len) {
	(void)event, (void)handle, (void)len;
	return -EOPNOTSUPP;
}
static inline int client_cuda_event_sync(void *event) {
	(void)event;
	return -EOPNOTSUPP;
}
#endif
