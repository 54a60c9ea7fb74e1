/* SPDX-License-Identifier: MIT */
#include <dirent.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/layout.h"
#include "basic/macro.h"
#ifdef KVD_HAVE_CUDA
#include "basic/cuda-dl.h"
#endif
#include "fixture.h"
#include "test.h"

static void sleep_ms(int ms) {
	struct timespec ts = { .tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000 };

	nanosleep(&ts, NULL);
}

pid_t fixture_fork(void) {
	pid_t parent = getpid(), pid = fork();

	ASSERT_OK(pid);
	/* A failed assertion exits the test at once: take every helper process with it, so
	 * that nothing outlives the test and keeps meson waiting on its output. */
	if (pid == 0 && (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != parent))
		_exit(1);
	return pid;
}

void fixture_write_config(struct fixture *f, const char *text) {
	FILE *c = fopen(f->config, "we");

	ASSERT_TRUE(c);
	ASSERT_EQ(fputs(text, c) >= 0, true);
	ASSERT_EQ(fclose(c), 0);
}

void fixture_setup(struct fixture *f, const char *config, bool log) {
	f->fd_limit = 0;
	f->deny_io_uring = false;
	snprintf(f->dir, sizeof(f->dir), "/tmp/kvd-test-XXXXXX");
	ASSERT_TRUE(mkdtemp(f->dir));
	snprintf(f->socket, sizeof(f->socket), "%s/kvd.sock", f->dir);
	snprintf(f->state_dir, sizeof(f->state_dir), "%s/state", f->dir);
	if (config) {
		snprintf(f->config, sizeof(f->config), "%s/kvd.conf", f->dir);
		fixture_write_config(f, config);
	} else
		snprintf(f->config, sizeof(f->config), "/dev/null");
	if (log)
		snprintf(f->log, sizeof(f->log), "%s/kvd.log", f->dir);
	else
		f->log[0] = '\0';
	f->pid = 0;
}

bool fixture_backend_cuda(void) {
	const char *b = getenv("KVD_TEST_BACKEND");

	return b && strcmp(b, "cuda") == 0;
}

void fixture_start(struct fixture *f, const char *const *args) {
	fixture_setup(f, NULL, false);
	fixture_launch(f, args);
}

/* In the child about to run the daemon: a seccomp filter under which io_uring_setup fails
 * with EPERM, every other call allowed (what Docker's and containerd's default profiles do
 * to io_uring). */
static int deny_io_uring(void) {
	/* io_uring_setup has the same number on every architecture (the generic table's). */
	struct sock_filter code[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
	};
	struct sock_fprog prog = { .len = ELEMENTSOF(code), .filter = code };

	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 ||
	    prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) < 0)
		return -errno;
	return 0;
}

void fixture_launch(struct fixture *f, const char *const *args) {
	const char *daemon = getenv("KVD_DAEMON");
	const char *argv[64];
	size_t n = 0;

	if (!daemon)
		test_fail(__FILE__, __LINE__, "KVD_DAEMON is not set (run the tests through meson)");
	argv[n++] = daemon;
	argv[n++] = "--socket";
	argv[n++] = f->socket;
	argv[n++] = "--config";
	argv[n++] = f->config;
	argv[n++] = "--state-dir";
	argv[n++] = f->state_dir;
	/* The suite runs two tests at once on machines with two CPUs: a daemon that polls
	 * between requests takes CPU from the other test's, and tests timed against eviction
	 * rounds then see them run late. Tests of the polling itself ask for it in args. */
	argv[n++] = "--poll-us=0";
	/* What the suite tests is the host backend, GPU or not (the gpu suite tests cuda);
	 * KVD_TEST_BACKEND=cuda runs a test on the cuda backend instead (tests/gpu/meson.build
	 * does so under the fake driver of tests/fake-cuda). */
	argv[n++] = fixture_backend_cuda() ? "--backend=cuda" : "--backend=host";
	/* KVD_TEST_LOOP=epoll: the loop kvd falls back to where io_uring is not allowed
	 * (tests/integration/meson.build runs the suite so once); a daemon denied io_uring
	 * must come to it by itself. */
	if (getenv("KVD_TEST_LOOP") && strcmp(getenv("KVD_TEST_LOOP"), "epoll") == 0 &&
	    !f->deny_io_uring)
		argv[n++] = "--uring-setup=epoll";
	for (; args && *args && n < sizeof(argv) / sizeof(argv[0]) - 1; args++)
		argv[n++] = *args;
	argv[n] = NULL;

	f->pid = fixture_fork();
	if (f->pid == 0) {
		if (f->log[0]) {
			int fd = open(f->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);

			if (fd < 0 || dup2(fd, STDERR_FILENO) < 0)
				_exit(126);
		}
		if (f->fd_limit) {
			struct rlimit rl = { f->fd_limit, f->fd_limit };

			if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
				_exit(126);
		}
		if (f->deny_io_uring && deny_io_uring() < 0)
			_exit(126);
		execv(daemon, (char *const *)argv);
		_exit(127);
	}
	/* Ready means accepting: poll by connecting, and notice a daemon that died. */
	for (int i = 0; i < 500; i++) {
		struct sockaddr_un sa = { .sun_family = AF_UNIX };
		int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0), status;

		strcpy(sa.sun_path, f->socket);
		if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0) {
			close(fd);
			return;
		}
		close(fd);
		if (waitpid(f->pid, &status, WNOHANG) == f->pid)
			test_fail(__FILE__, __LINE__, "the daemon exited during start-up (status %d)", status);
		sleep_ms(10);
	}
	test_fail(__FILE__, __LINE__, "the daemon did not listen within 5 s");
}

int fixture_halt(struct fixture *f) {
	int status;

	kill(f->pid, SIGTERM);
	ASSERT_EQ(waitpid(f->pid, &status, 0), f->pid);
	f->pid = 0;
	return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* Removes the entries of dir, one level down into directories, then dir itself. */
static void remove_tree(const char *dir, int depth) {
	DIR *d = opendir(dir);
	struct dirent *de;
	char path[512];

	while (d && (de = readdir(d))) {
		if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
		if (unlink(path) < 0 && errno == EISDIR && depth > 0)
			remove_tree(path, depth - 1);
	}
	if (d)
		closedir(d);
	rmdir(dir);
}

void fixture_cleanup(struct fixture *f) {
	remove_tree(f->dir, 1);
}

int fixture_stop(struct fixture *f) {
	int status = fixture_halt(f);

	fixture_cleanup(f);
	return status;
}

unsigned fixture_log_count(struct fixture *f, const char *needle) {
	char buf[65536];
	unsigned count = 0;
	size_t k;
	FILE *l;

	ASSERT_TRUE(f->log[0]);
	l = fopen(f->log, "re");
	if (!l)
		return 0;
	k = fread(buf, 1, sizeof(buf) - 1, l);
	buf[k] = 0;
	fclose(l);
	for (const char *p = buf; (p = strstr(p, needle)); p += strlen(needle))
		count++;
	return count;
}

bool fixture_wait_log(struct fixture *f, const char *needle, unsigned count) {
	for (int i = 0; i < 500; i++) {
		if (fixture_log_count(f, needle) >= count)
			return true;
		sleep_ms(10);
	}
	return false;
}

/*
 * K/V access for the fills, checks and digests below. On the host backend rows are host
 * memory. On cuda they are device pointers, reached as an engine would, with driver copies
 * in the primary context of the daemon's GPU (found at the first tenant connection of each
 * process: a forked child connects again); so the tests that use only these helpers run on
 * a real GPU too (tools/gpu-check), not only under the fake driver.
 */
#ifdef KVD_HAVE_CUDA
static const struct cuda_dl *kv_cu;
static CUcontext kv_ctx;
static pid_t kv_ctx_pid;

static void kv_device_setup(kvd_client *c) {
	int32_t ordinal = -1;
	const char *why;
	CUdevice dev;

	if (kv_ctx && kv_ctx_pid == getpid())
		return;
	ASSERT_EQ(kvd_client_memory(c, &ordinal), KVD_MEMORY_CUDA);
	if (cuda_dl_load(&kv_cu, &why) < 0)
		test_fail(__FILE__, __LINE__, "KVD_TEST_BACKEND=cuda, but %s", why);
	ASSERT_EQ(kv_cu->cuDeviceGet(&dev, ordinal), CUDA_SUCCESS);
	ASSERT_EQ(kv_cu->cuDevicePrimaryCtxRetain(&kv_ctx, dev), CUDA_SUCCESS);
	kv_ctx_pid = getpid();
}
#endif

void kv_read(const void *src, void *dst, size_t n) {
#ifdef KVD_HAVE_CUDA
	if (fixture_backend_cuda()) {
		if (!kv_ctx || kv_ctx_pid != getpid())
			test_fail(__FILE__, __LINE__, "K/V read before a tenant connected");
		ASSERT_EQ(kv_cu->cuCtxSetCurrent(kv_ctx), CUDA_SUCCESS);
		ASSERT_EQ(kv_cu->cuMemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)src, n), CUDA_SUCCESS);
		return;
	}
#endif
	memcpy(dst, src, n);
}

void kv_write(void *dst, const void *src, size_t n) {
#ifdef KVD_HAVE_CUDA
	if (fixture_backend_cuda()) {
		if (!kv_ctx || kv_ctx_pid != getpid())
			test_fail(__FILE__, __LINE__, "K/V written before a tenant connected");
		ASSERT_EQ(kv_cu->cuCtxSetCurrent(kv_ctx), CUDA_SUCCESS);
		ASSERT_EQ(kv_cu->cuMemcpyHtoD((CUdeviceptr)(uintptr_t)dst, src, n), CUDA_SUCCESS);
		return;
	}
#endif
	memcpy(dst, src, n);
}

void fixture_gate_make(char *path, size_t n) {
	snprintf(path, n, "/tmp/kvd-test-gate-%d", (int)getpid());
	unlink(path);
	ASSERT_OK(mkfifo(path, 0600));
}

int fixture_gate_wait(const char *path) {
	int fd = open(path, O_WRONLY | O_CLOEXEC);

	ASSERT_OK(fd);
	return fd;
}

void fixture_gate_release(int fd) {
	struct pollfd pfd = { .fd = fd };
	int r;

	ASSERT_EQ(write(fd, "x", 1), 1);
	/* Held open until the worker has closed its end (POLLERR: no reader is left), so that
	 * the next fixture_gate_wait() meets the next wait's open, not this one's close: a
	 * write into that closing end would be lost, or raise SIGPIPE. */
	do
		r = poll(&pfd, 1, 60000);
	while (r < 0 && errno == EINTR);
	ASSERT_EQ(r, 1);
	ASSERT_TRUE(pfd.revents & POLLERR);
	close(fd);
}

kvd_client *fixture_connect(struct fixture *f, const char *tenant) {
	kvd_connect_params p = { .size = sizeof(p), .socket_path = f->socket, .tenant = tenant };
	kvd_client *c = NULL;

#ifdef KVD_HAVE_CUDA
	/* An engine connects with its CUDA context current, and a daemon that pools several
	 * GPUs refuses a tenant that names none: the tests' tenants are engines on the first
	 * GPU unless a test made another's context current. */
	if (tenant && fixture_backend_cuda()) {
		const struct cuda_dl *cu;
		CUcontext current = NULL;

		if (cuda_dl_load(&cu, NULL) < 0 || cu->cuCtxGetCurrent(&current) != CUDA_SUCCESS ||
		    !current)
			p.flags |= KVD_CONNECT_DEVICE;
	}
#endif
	ASSERT_OK(kvd_client_connect_params(&p, &c));
#ifdef KVD_HAVE_CUDA
	if (tenant && fixture_backend_cuda())
		kv_device_setup(c);
#else
	if (fixture_backend_cuda())
		test_fail(__FILE__, __LINE__, "KVD_TEST_BACKEND=cuda in a build without CUDA headers");
#endif
	return c;
}

uint64_t fixture_status(struct fixture *f, const char *tenant, const char *key) {
	__attribute__((cleanup(kvd_client_unrefp))) kvd_client *c = fixture_connect(f, NULL);
	kvd_status *st = NULL;
	uint64_t v = UINT64_MAX;

	ASSERT_OK(kvd_status_get(c, &st));
	if (!tenant)
		ASSERT_OK(kvd_status_u64(st, key, &v));
	else
		for (uint32_t i = 0; i < kvd_status_tenants(st); i++) {
			const char *name;

			ASSERT_OK(kvd_status_tenant_name(st, i, &name));
			if (strcmp(name, tenant) == 0)
				ASSERT_OK(kvd_status_tenant_u64(st, i, key, &v));
		}
	kvd_status_free(st);
	return v;
}

const char *fixture_status_str(struct fixture *f, const char *tenant, const char *key, char *buf,
                               size_t n) {
	__attribute__((cleanup(kvd_client_unrefp))) kvd_client *c = fixture_connect(f, NULL);
	const char *v = NULL;
	kvd_status *st = NULL;
	int r = -ENOENT;

	ASSERT_OK(kvd_status_get(c, &st));
	if (!tenant)
		r = kvd_status_str(st, key, &v);
	else
		for (uint32_t i = 0; i < kvd_status_tenants(st); i++) {
			const char *name;

			ASSERT_OK(kvd_status_tenant_name(st, i, &name));
			if (strcmp(name, tenant) == 0)
				r = kvd_status_tenant_str(st, i, key, &v);
		}
	if (r != -ENOENT)
		ASSERT_OK(r);
	if (v)
		snprintf(buf, n, "%s", v);
	kvd_status_free(st);
	return v ? buf : NULL;
}

bool fixture_wait_status(struct fixture *f, const char *tenant, const char *key, uint64_t want) {
	for (int i = 0; i < 500; i++) {
		if (fixture_status(f, tenant, key) == want)
			return true;
		sleep_ms(10);
	}
	return false;
}

int raw_connect(struct fixture *f) {
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

	ASSERT_OK(fd);
	strcpy(sa.sun_path, f->socket);
	ASSERT_OK(connect(fd, (struct sockaddr *)&sa, sizeof(sa)));
	return fd;
}

int raw_send_bytes(int fd, const void *p, size_t n) {
	ssize_t k = send(fd, p, n, MSG_NOSIGNAL);

	if (k < 0)
		return -errno;
	return k == (ssize_t)n ? 0 : -EIO;
}

int raw_send_fds(int fd, const Envelope *env, const int *fds, uint32_t nfds) {
	union {
		struct cmsghdr h;
		uint8_t buf[CMSG_SPACE(WIRE_FDS_MAX * sizeof(int))];
	} cm = { 0 };
	struct iovec iov;
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };
	uint8_t *frame;
	size_t size;
	ssize_t k;
	int r;

	if (nfds > WIRE_FDS_MAX)
		return -EINVAL;
	r = wire_encode(env, nfds, &frame, &size);
	if (r < 0)
		return r;
	iov.iov_base = frame;
	iov.iov_len = size;
	if (nfds > 0) {
		msg.msg_control = cm.buf;
		msg.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
		cm.h.cmsg_level = SOL_SOCKET;
		cm.h.cmsg_type = SCM_RIGHTS;
		cm.h.cmsg_len = CMSG_LEN(nfds * sizeof(int));
		memcpy(CMSG_DATA(&cm.h), fds, nfds * sizeof(int));
	}
	k = sendmsg(fd, &msg, MSG_NOSIGNAL);
	r = k < 0 ? -errno : k == (ssize_t)size ? 0 : -EIO;
	free(frame);
	return r;
}

int raw_send(int fd, const Envelope *env) {
	return raw_send_fds(fd, env, NULL, 0);
}

int raw_recv(int fd, struct wire_rx *rx, int timeout_ms, Envelope **ret) {
	int fds[WIRE_FDS_MAX];
	uint32_t nfds;
	int r = raw_recv_fds(fd, rx, timeout_ms, ret, fds, &nfds);

	for (uint32_t i = 0; r > 0 && i < nfds; i++)
		close(fds[i]);
	return r;
}

int raw_recv_fds(int fd, struct wire_rx *rx, int timeout_ms, Envelope **ret,
                 int fds[static WIRE_FDS_MAX], uint32_t *ret_nfds) {
	for (;;) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		uint8_t cmsg[WIRE_CMSG_SPACE];
		struct iovec iov;
		struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cmsg,
			              .msg_controllen = sizeof(cmsg) };
		ssize_t n;
		int r;

		r = wire_rx_next(rx, ret, fds, ret_nfds);
		if (r != 0)
			return r;
		r = poll(&p, 1, timeout_ms);
		if (r == 0)
			return -ETIMEDOUT;
		if (r < 0)
			return -errno;
		iov.iov_base = wire_rx_space(rx, &iov.iov_len);
		n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
		if (n < 0)
			return errno == ECONNRESET ? 0 : -errno;
		if (n == 0)
			return 0;
		wire_rx_take_cmsg(rx, &msg);
		wire_rx_commit(rx, (size_t)n);
	}
}

int raw_hello(int fd, struct wire_rx *rx, const char *tenant, uint32_t min, uint32_t max) {
	Kvd__V1__Hello h = KVD__V1__HELLO__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *rep;
#ifdef KVD_HAVE_CUDA
	CUuuid uuid;
#endif

	h.has_min_version = h.has_max_version = true;
	h.min_version = min;
	h.max_version = max;
	h.tenant = (char *)tenant;
	/* A cuda daemon refuses tenants that cannot import device chunks; a raw connection
	 * never maps any, so it may as well say it can. */
	if (fixture_backend_cuda()) {
		h.has_features = true;
		h.features = KVD_FEATURE_DEVICE_CHUNKS;
	}
#ifdef KVD_HAVE_CUDA
	/* And it names the first GPU, as fixture_connect's tenants are on it. */
	if (fixture_backend_cuda() && tenant) {
		const struct cuda_dl *cu;
		CUdevice dev;

		ASSERT_OK(cuda_dl_load(&cu, NULL));
		ASSERT_EQ(cu->cuDeviceGet(&dev, 0), CUDA_SUCCESS);
		ASSERT_EQ(cu->cuDeviceGetUuid(&uuid, dev), CUDA_SUCCESS);
		h.has_device_uuid = true;
		h.device_uuid.len = sizeof(uuid.bytes);
		h.device_uuid.data = (uint8_t *)uuid.bytes;
	}
#endif
	env.has_id = true;
	env.id = 1;
	env.body_case = KVD__V1__ENVELOPE__BODY_HELLO;
	env.hello = &h;
	ASSERT_OK(raw_send(fd, &env));
	ASSERT_EQ(raw_recv(fd, rx, 5000, &rep), 1);
	ASSERT_EQ(rep->id, 1u);
	ASSERT_TRUE(rep->status);
	return rep->status->code;
}

int raw_call(int fd, struct wire_rx *rx, Envelope *env, uint64_t id) {
	Envelope *rep;

	env->has_id = true;
	env->id = id;
	ASSERT_OK(raw_send(fd, env));
	ASSERT_EQ(raw_recv(fd, rx, 5000, &rep), 1);
	ASSERT_EQ(rep->id, id);
	ASSERT_TRUE(rep->status);
	return rep->status->code;
}

int raw_register_model(int fd, struct wire_rx *rx, const kvd_model_spec *spec, uint64_t id) {
	Kvd__V1__RegisterModel rm = KVD__V1__REGISTER_MODEL__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;

	rm.has_layers = rm.has_q_heads = rm.has_kv_heads = rm.has_head_dim = true;
	rm.has_dtype = rm.has_block_tokens = rm.has_layout = true;
	rm.layers = spec->layers;
	rm.q_heads = spec->q_heads;
	rm.kv_heads = spec->kv_heads;
	rm.head_dim = spec->head_dim;
	rm.dtype = (Kvd__V1__Dtype)spec->dtype;
	rm.block_tokens = spec->block_tokens;
	rm.layout = (Kvd__V1__Layout)spec->layout;
	rm.name = (char *)spec->name;
	env.body_case = KVD__V1__ENVELOPE__BODY_REGISTER_MODEL;
	env.register_model = &rm;
	return raw_call(fd, rx, &env, id);
}

static int cmp_u64(const void *a, const void *b) {
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

size_t mapped_chunk_inodes(pid_t pid, uint64_t *inodes, size_t max) {
	char path[64], line[512];
	size_t n = 0;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/maps", (int)pid);
	f = fopen(path, "re");
	ASSERT_TRUE(f);
	while (fgets(line, sizeof(line), f)) {
		unsigned long long ino;
		bool seen = false;

		/* addr perms offset dev inode path */
		if (!strstr(line, "/memfd:kvd-chunk-") ||
		    sscanf(line, "%*s %*s %*s %*s %llu", &ino) != 1)
			continue;
		for (size_t i = 0; i < n; i++)
			seen = seen || inodes[i] == ino;
		if (!seen && n < max)
			inodes[n++] = ino;
	}
	fclose(f);
	qsort(inodes, n, sizeof(*inodes), cmp_u64);
	return n;
}

/* The name of a chunk's memory in /proc: the host backend's memfds, or the fake driver's. */
static const char *chunk_memfd_name(void) {
	return fixture_backend_cuda() ? "/memfd:kvd-fake-cuda-dev" : "/memfd:kvd-chunk-";
}

void hostile_keep(struct hostile_hold *k, size_t bytes) {
	char line[512], path[96];
	unsigned long start = 0, end = 0;
	unsigned long long ino = 0;
	FILE *maps = fopen("/proc/self/maps", "re");
	void *p;

	ASSERT_NOT_NULL(maps);
	while (fgets(line, sizeof(line), maps))
		if (strstr(line, chunk_memfd_name()) &&
		    sscanf(line, "%lx-%lx %*s %*s %*s %llu", &start, &end, &ino) == 3)
			break;
	fclose(maps);
	ASSERT_GT(end, start);
	ASSERT_GE(end - start, bytes);
	k->bytes = bytes;
	k->ino = ino;
	/* old_size 0: a second mapping of the same shared pages. */
	p = mremap((void *)start, 0, bytes, MREMAP_MAYMOVE);
	ASSERT_TRUE(p != MAP_FAILED);
	/* Device memory under the strict fake is PROT_NONE to the CPU in libkvd's mapping. */
	ASSERT_OK(mprotect(p, bytes, PROT_READ | PROT_WRITE));
	k->map = p;
	snprintf(path, sizeof(path), "/proc/self/map_files/%lx-%lx", start, end);
	k->fd = open(path, O_RDWR | O_CLOEXEC);
	if (k->fd < 0)
		printf("cannot open %s (%m): the fd path is not checked\n", path);
}

void hostile_done(struct hostile_hold *k) {
	ASSERT_OK(munmap(k->map, k->bytes));
	if (k->fd >= 0)
		close(k->fd);
}

void hostile_assert_reads(const struct hostile_hold *k, uint8_t v) {
	uint8_t *buf = malloc(k->bytes);

	ASSERT_NOT_NULL(buf);
	for (size_t i = 0; i < k->bytes; i++)
		if (k->map[i] != v)
			test_fail(__FILE__, __LINE__, "byte %zu of the kept mapping is 0x%02x, not 0x%02x",
				  i, k->map[i], v);
	if (k->fd < 0) {
		free(buf);
		return;
	}
	ASSERT_EQ(pread(k->fd, buf, k->bytes, 0), (ssize_t)k->bytes);
	for (size_t i = 0; i < k->bytes; i++)
		if (buf[i] != v)
			test_fail(__FILE__, __LINE__, "byte %zu read from the kept fd is 0x%02x, not 0x%02x",
				  i, buf[i], v);
	free(buf);
}

void hostile_write(const struct hostile_hold *k) {
	uint8_t *buf = malloc(k->bytes);

	ASSERT_NOT_NULL(buf);
	memset(k->map, 0xcd, k->bytes);
	memset(buf, 0xee, k->bytes);
	if (k->fd >= 0)
		ASSERT_EQ(pwrite(k->fd, buf, k->bytes, 0), (ssize_t)k->bytes);
	free(buf);
}

static uint8_t pattern(uint32_t tag, uint32_t l, uint32_t h, uint64_t pos, uint64_t i, int v) {
	uint64_t x = ((uint64_t)tag << 48) ^ ((uint64_t)l << 40) ^ ((uint64_t)h << 32) ^ (pos << 12) ^
	             (i << 1) ^ (uint64_t)v;

	x *= UINT64_C(0x9e3779b97f4a7c15);
	return (uint8_t)(x >> 56);
}

/*
 * Visits every resident slot of s whose original position is at least from: writes the
 * pattern, or counts the bytes that differ from it. The top byte of each element has its
 * 0x44 bits cleared, so that K and V hold finite numbers whatever the dtype and the
 * daemon's scoring sees real attention rather than NaN.
 */
static uint64_t walk_seq(kvd_seq *s, uint32_t tag, bool write, uint64_t from) {
	const struct kvd_seq_desc *d = kvd_seq_descriptor(s);
	uint32_t elem = d->dtype == KVD_DTYPE_F32 ? 4 : 2;
	uint64_t row = (uint64_t)d->head_dim * elem, bad = 0;
	_cleanup_(freep) uint8_t *buf = malloc(row);

	ASSERT_TRUE(buf);
	for (uint32_t l = 0; l < d->layers; l++)
		for (uint32_t h = 0; h < d->kv_heads; h++) {
			int64_t n = kvd_seq_tokens(s, l, h);

			ASSERT_OK(n);
			for (uint32_t slot = 0; slot < (uint64_t)n; slot++) {
				int64_t pos = kvd_seq_position(s, l, h, slot);
				uint8_t *kv[2];

				ASSERT_OK(pos);
				if ((uint64_t)pos < from)
					continue;
				ASSERT_OK(kvd_seq_kv(s, l, h, slot, (void **)&kv[0], (void **)&kv[1]));
				for (int v = 0; v < 2; v++) {
					if (!write)
						kv_read(kv[v], buf, row);
					for (uint64_t i = 0; i < row; i++) {
						uint8_t want = pattern(tag, l, h, (uint64_t)pos, i, v);

						if (i % elem == elem - 1)
							want &= 0xbb;
						if (write)
							buf[i] = want;
						else
							bad += buf[i] != want;
					}
					if (write)
						kv_write(kv[v], buf, row);
				}
			}
		}
	return bad;
}

void fill_seq(kvd_seq *s, uint32_t tag) {
	walk_seq(s, tag, true, 0);
}

void fill_seq_from(kvd_seq *s, uint32_t tag, uint64_t from) {
	walk_seq(s, tag, true, from);
}

uint64_t check_seq(kvd_seq *s, uint32_t tag) {
	return walk_seq(s, tag, false, 0);
}

/* The digest of the K/V this process sees, as kvd_seq_digest's local one (which libkvd
 * does not compute on device memory), read through kvd_seq_kv's addresses. */
static uint64_t local_digest(kvd_seq *s) {
	const struct kvd_seq_desc *d = kvd_seq_descriptor(s);
	uint64_t h = DIGEST_INIT, row = layout_row_bytes(d);
	_cleanup_(freep) uint8_t *buf = malloc(row);

	ASSERT_TRUE(buf);
	for (uint32_t l = 0; l < d->layers; l++)
		for (uint32_t kh = 0; kh < d->kv_heads; kh++) {
			int64_t n = kvd_seq_tokens(s, l, kh);

			ASSERT_OK(n);
			for (uint32_t slot = 0; slot < (uint64_t)n; slot++) {
				void *k, *v;

				ASSERT_OK(kvd_seq_kv(s, l, kh, slot, &k, &v));
				kv_read(k, buf, row);
				h = digest_update(h, buf, row);
				kv_read(v, buf, row);
				h = digest_update(h, buf, row);
			}
		}
	return h;
}

void assert_positions_upto(kvd_seq *s, uint32_t tokens) {
	const struct kvd_seq_desc *d = kvd_seq_descriptor(s);

	ASSERT_EQ(d->next_position, tokens);
	for (uint32_t l = 0; l < d->layers; l++)
		for (uint32_t h = 0; h < (d->layout == KVD_LAYOUT_PER_HEAD ? d->kv_heads : 1); h++) {
			ASSERT_EQ(kvd_seq_tokens(s, l, h), (int64_t)tokens);
			for (uint32_t j = 0; j < tokens; j++)
				ASSERT_EQ(kvd_seq_position(s, l, h, j), (int64_t)j);
		}
}

uint64_t assert_digests_agree(kvd_seq *s) {
	uint64_t daemon = 0, local = 1;

	if (fixture_backend_cuda()) {
		ASSERT_OK(kvd_seq_digest(s, &daemon, NULL));
		local = local_digest(s);
	} else {
		ASSERT_OK(kvd_seq_digest(s, &daemon, &local));
	}
	ASSERT_EQ(daemon, local);
	return daemon;
}

int fixture_run_daemon(const char *args, char *out, size_t n) {
	char cmd[1024];
	size_t k;
	FILE *p;
	int status;

	snprintf(cmd, sizeof(cmd), "%s %s 2>&1", getenv("KVD_DAEMON"), args);
	p = popen(cmd, "re");
	ASSERT_TRUE(p);
	k = fread(out, 1, n - 1, p);
	out[k] = 0;
	/* All of it, or the test would check a part (and the daemon die of SIGPIPE). */
	if (fgetc(p) != EOF)
		test_fail(__FILE__, __LINE__, "kvd %s printed more than %zu bytes", args, n - 1);
	status = pclose(p);
	ASSERT_TRUE(WIFEXITED(status));
	return WEXITSTATUS(status);
}

unsigned long long fixture_cpu_ticks(pid_t pid) {
	unsigned long long utime = 0, stime = 0;
	char path[64], buf[1024], *p;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	f = fopen(path, "re");
	ASSERT_NOT_NULL(f);
	ASSERT_NOT_NULL(fgets(buf, sizeof(buf), f));
	fclose(f);
	/* After the command name's closing parenthesis: state is field 3, utime 14, stime 15. */
	p = strrchr(buf, ')');
	ASSERT_NOT_NULL(p);
	ASSERT_EQ(sscanf(p + 2, "%*c %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %llu %llu", &utime,
	                 &stime), 2);
	return utime + stime;
}
