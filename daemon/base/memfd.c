/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "basic/macro.h"
#include "memfd.h"

int memfd_sealed(const char *name, uint64_t bytes, unsigned extra_seals, int *ret_fd,
                 void **ret_map) {
	_cleanup_(closep) int fd = -EBADF;
	void *map;

	fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return negative_errno();
	if (ftruncate(fd, (off_t)bytes) < 0)
		return negative_errno();
	map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (map == MAP_FAILED)
		return negative_errno();
	/* After the mapping: F_SEAL_FUTURE_WRITE would refuse a writable one. */
	if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL | extra_seals) < 0) {
		int r = negative_errno();

		munmap(map, bytes);
		return r;
	}
	*ret_fd = TAKE_FD(fd);
	*ret_map = map;
	return 0;
}
