/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Output projection uploads, computed off the loop: deriving a layer's Gram matrices from
 * an 8B model's W_o takes a fraction of a second of gemm, which would stall every other
 * client if the loop did it. Each upload runs on its own short-lived thread; when it is
 * done, the loop calls the upload's callback, which installs the result if the model's
 * connection is still there (a connection that went away loses nothing but the result)
 * and answers.
 */

#include <stdint.h>

#include "loop.h"
#include "observe.h"

struct uploader;

/* A finished upload, as its callback gets it. */
struct upload_done {
	uint64_t conn_id, id;         /* the connection and request that asked */
	uint32_t model_id, layer;
	struct gram_layer *result;    /* the callee takes it by setting it to NULL */
	int error;                    /* < 0: the matrices could not be computed */
};

/* Called on the loop's thread, once per upload, whatever happened to its connection;
 * userdata is uploader_new()'s. */
typedef void (*upload_done_fn)(void *userdata, struct upload_done *d);

/* Uploads computing at once, all connections together; more are refused with -EBUSY. */
#define UPLOADS_MAX 4

int uploader_new(struct loop *loop, void *userdata, struct uploader **ret);
/* Waits for the uploads still computing and drops their results. */
struct uploader *uploader_free(struct uploader *u);

/*
 * Starts computing layer `layer` of model model_id of connection conn_id from wo (taken,
 * even on failure), for request id; done is called when it finished. Returns 0, or -EBUSY
 * (UPLOADS_MAX running), -ENOMEM, -EAGAIN (no thread).
 */
int upload_start(struct uploader *u, uint64_t conn_id, uint64_t id, uint32_t model_id,
                 uint32_t layer, struct wo_map *wo, upload_done_fn done);
