/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "basic/macro.h"
#include "conn.h"
#include "envelope.h"
#include "log.h"
#include "server.h"
#include "upload.h"

struct job {
	struct job *next;
	struct uploader *u;
	pthread_t thread;
	uint64_t conn_id, id;
	uint32_t model_id, layer;
	struct wo_map wo;
	struct gram_layer *result;
	int error;
	bool done;
};

struct uploader {
	struct server *srv;
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

	j->error = gram_layer_compute(&j->wo, &j->result);
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
	r = loop_read(u->srv->loop, &u->op, u->efd, &u->buf, sizeof(u->buf));
	if (r >= 0)
		u->armed = true;
	return r;
}

static void job_free(struct job *j) {
	pthread_join(j->thread, NULL);
	wo_map_done(&j->wo);
	gram_layer_unref(j->result);
	free(j);
}

/* Installs and answers a finished job, if its connection and model are still there. */
static void finish(struct uploader *u, struct job *j) {
	struct conn *c = registry_conn(u->srv, j->conn_id);
	int r = j->error;

	if (!c || c->closing)
		return;
	c->outstanding--;
	if (j->model_id > c->n_models)
		return;
	if (r >= 0) {
		r = grams_install(&c->models[j->model_id - 1], j->layer, j->result);
		if (r >= 0)
			j->result = NULL;
	}
	if (r < 0)
		log_warning("connection %llu: the Gram matrices of layer %u could not be computed: %s",
		            (unsigned long long)c->id, j->layer, strerror(-r));
	if (r < 0)
		envelope_reply_error(c, j->id, r, "cannot compute the Gram matrices");
	else
		envelope_reply(c, j->id, NULL, NULL, 0);
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
		finish(u, j);
		job_free(j);
	}
	if (u->n_jobs > 0 && arm(u) < 0)
		log_error("cannot wait for uploads: the loop refused");
}

int upload_start(struct uploader *u, struct conn *c, uint64_t id, uint32_t model_id,
                 uint32_t layer, struct wo_map *wo) {
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
		.conn_id = c->id,
		.id = id,
		.model_id = model_id,
		.layer = layer,
		.wo = *wo,
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

int uploader_new(struct server *s, struct uploader **ret) {
	struct uploader *u = calloc(1, sizeof(*u));

	if (!u)
		return -ENOMEM;
	u->srv = s;
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
