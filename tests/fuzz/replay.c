/* SPDX-License-Identifier: MIT */
/*
 * Replays corpora through a fuzz target without libFuzzer, so that every build (gcc and its
 * sanitizers included) runs the seeds and the regression inputs:
 *
 *   replay-<target> DIR|FILE...
 *
 * Files of a directory run in name order, each from an exactly sized heap copy so that
 * AddressSanitizer sees any read past its end. A failed check aborts; a directory without
 * files is an error, so that a corpus that went missing fails the test.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fuzz.h"

static int run_file(const char *path) {
	struct stat st;
	uint8_t *buf;
	size_t off = 0;
	int fd;

	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0 || fstat(fd, &st) < 0) {
		fprintf(stderr, "%s: %s\n", path, strerror(errno));
		if (fd >= 0)
			close(fd);
		return -1;
	}
	/* Exactly the file's size (malloc(0) may return NULL: one byte then). */
	buf = malloc(st.st_size > 0 ? (size_t)st.st_size : 1);
	if (!buf) {
		close(fd);
		return -1;
	}
	while (off < (size_t)st.st_size) {
		ssize_t n = read(fd, buf + off, (size_t)st.st_size - off);

		if (n <= 0) {
			fprintf(stderr, "%s: short read\n", path);
			free(buf);
			close(fd);
			return -1;
		}
		off += (size_t)n;
	}
	close(fd);
	LLVMFuzzerTestOneInput(buf, (size_t)st.st_size);
	free(buf);
	return 0;
}

static int by_name(const struct dirent **a, const struct dirent **b) {
	return strcmp((*a)->d_name, (*b)->d_name);
}

static int not_hidden(const struct dirent *d) {
	return d->d_name[0] != '.';
}

int main(int argc, char *argv[]) {
	unsigned files = 0;

	if (argc < 2) {
		fprintf(stderr, "usage: %s DIR|FILE...\n", argv[0]);
		return 2;
	}
	for (int i = 1; i < argc; i++) {
		struct dirent **names;
		struct stat st;
		int n;

		if (stat(argv[i], &st) < 0) {
			fprintf(stderr, "%s: %s\n", argv[i], strerror(errno));
			return 1;
		}
		if (!S_ISDIR(st.st_mode)) {
			if (run_file(argv[i]) < 0)
				return 1;
			files++;
			continue;
		}
		n = scandir(argv[i], &names, not_hidden, by_name);
		if (n < 0) {
			fprintf(stderr, "%s: %s\n", argv[i], strerror(errno));
			return 1;
		}
		if (n == 0) {
			fprintf(stderr, "%s: no inputs\n", argv[i]);
			free(names);
			return 1;
		}
		for (int j = 0; j < n; j++) {
			char path[4096];
			int r;

			snprintf(path, sizeof(path), "%s/%s", argv[i], names[j]->d_name);
			free(names[j]);
			r = run_file(path);
			if (r < 0) {
				while (++j < n)
					free(names[j]);
				free(names);
				return 1;
			}
			files++;
		}
		free(names);
	}
	printf("%u inputs replayed\n", files);
	return 0;
}
