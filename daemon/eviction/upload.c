/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "basic/macro.h"
#include "log.h"
#include "upload.h"

struct job {
	struct job *next;
	struct uploader *u;
	pthread_t thread;
	struct wo_map wo;
	struct upload_done d;         /* what the callback gets */
	upload_done_fn done_fn;
	bool done;
};

struct uploader {
	struct loop *loop;
	void *userdata;               /* the callbacks' */
	int efd;
	struct loop_op op;
	uint64_t buf;
	bool armed;
	pthread_mutex_t lock;         /* guards job.done, read by the loop */
	struct job *jobs;             /* running or done, not yet collected */
	uint32_t n_jobs;
};

static void *job_thread(void *userdata) {
	struct job *j = userdata;
	uint64_t one = 1;

	j->d.error = gram_layer_compute(&j->wo, &j->d.result);
	pthread_mutex_lock(&j->u->lock);
	j->done = true;
	pthread_mutex_unlock(&j->u->lock);
	(void)!write(j->u->efd, &one, sizeof(one));
	return NULL;
}

static int arm(struct uploader *u) {
	int r;

	if (u->armed)
		return 0;
	r = loop_read(u->loop, &u->op, u->efd, &u->buf, sizeof(u->buf));
	if (r >= 0)
		u->armed = true;
	return r;
}

static void job_free(struct job *j) {
	pthread_join(j->thread, NULL);
	wo_map_done(&j->wo);
	gram_layer_unref(j->d.result);
	free(j);
}

static void on_done(struct loop_op *op, int res, bool more) {
	struct uploader *u = container_of(op, struct uploader, op);
	struct job **l = &u->jobs;

	(void)res, (void)more;
	u->armed = false;
	while (*l) {
		struct job *j = *l;
		bool done;

		pthread_mutex_lock(&u->lock);
		done = j->done;
		pthread_mutex_unlock(&u->lock);
		if (!done) {
			l = &j->next;
			continue;
		}
		*l = j->next;
		u->n_jobs--;
		j->done_fn(u->userdata, &j->d);
		job_free(j);
	}
	if (u->n_jobs > 0 && arm(u) < 0)
		log_error("cannot wait for uploads: the loop refused");
}

int upload_start(struct uploader *u, uint64_t conn_id, uint64_t id, uint32_t model_id,
                 uint32_t layer, struct wo_map *wo, upload_done_fn done) {
	struct job *j;
	int r;

	if (u->n_jobs >= UPLOADS_MAX) {
		wo_map_done(wo);
		return -EBUSY;
	}
	j = calloc(1, sizeof(*j));
	if (!j) {
		wo_map_done(wo);
		return -ENOMEM;
	}
	*j = (struct job){
		.u = u,
		.wo = *wo,
		.d = { .conn_id = conn_id, .id = id, .model_id = model_id, .layer = layer },
		.done_fn = done,
	};
	*wo = (struct wo_map){};
	r = arm(u);
	if (r >= 0)
		r = -pthread_create(&j->thread, NULL, job_thread, j);
	if (r < 0) {
		wo_map_done(&j->wo);
		free(j);
		return r == -ENOMEM ? r : -EAGAIN;
	}
	j->next = u->jobs;
	u->jobs = j;
	u->n_jobs++;
	return 0;
}

int uploader_new(struct loop *loop, void *userdata, struct uploader **ret) {
	struct uploader *u = calloc(1, sizeof(*u));

	if (!u)
		return -ENOMEM;
	u->loop = loop;
	u->userdata = userdata;
	u->op.handler = on_done;
	pthread_mutex_init(&u->lock, NULL);
	u->efd = eventfd(0, EFD_CLOEXEC);
	if (u->efd < 0) {
		int r = negative_errno();

		pthread_mutex_destroy(&u->lock);
		free(u);
		return r;
	}
	*ret = u;
	return 0;
}

struct uploader *uploader_free(struct uploader *u) {
	if (!u)
		return NULL;
	while (u->jobs) {
		struct job *j = u->jobs;

		u->jobs = j->next;
		job_free(j);
	}
	safe_close(u->efd);
	pthread_mutex_destroy(&u->lock);
	free(u);
	return NULL;
}
