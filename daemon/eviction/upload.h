/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Output projection uploads, computed off the loop: deriving a layer's Gram matrices from
 * an 8B model's W_o takes a fraction of a second of gemm, which would stall every other
 * client if the loop did it. Each upload runs on its own short-lived thread; the reply
 * comes when it is done, from the loop, which installs the result if the model's
 * connection is still there (a connection that went away loses nothing but the result).
 */

#include <stdint.h>

#include "observe.h"

struct server;
struct conn;
struct uploader;

/* Uploads computing at once, all connections together; more are refused with -EBUSY. */
#define UPLOADS_MAX 4

int uploader_new(struct server *s, struct uploader **ret);
/* Waits for the uploads still computing and drops their results. */
struct uploader *uploader_free(struct uploader *u);

/*
 * Starts computing layer `layer` of model model_id of connection c from wo (taken, even on
 * failure); replies to request id when done. Returns 0, or -EBUSY (UPLOADS_MAX running),
 * -ENOMEM, -EAGAIN (no thread).
 */
int upload_start(struct uploader *u, struct conn *c, uint64_t id, uint32_t model_id,
                 uint32_t layer, struct wo_map *wo);
