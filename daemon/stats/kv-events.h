/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * KV events (docs/engines.md, "KV events"): what the node's prefix index gains and loses,
 * published on a ZeroMQ PUB socket in the format vLLM's engines publish, so that the routers
 * that read vLLM's events (llm-d, Dynamo) read kvd's: multipart messages (topic, an 8-byte
 * big-endian sequence number, a msgpack EventBatch), and a ROUTER socket that replays the
 * batches a subscriber missed. A thread of its own encodes and sends: the event loop only
 * appends events to a bounded queue, and a full queue drops them (counted), never waits.
 */

#include <stdint.h>

#define KV_EVENTS_KEY_BYTES 32

struct kv_events;

/* Binds endpoint (a ZeroMQ address: tcp://127.0.0.1:5557, ipc:///run/kvd/events) and, when
 * replay is not NULL or "", the replay endpoint, and starts the publisher thread. Returns 0,
 * or -EINVAL (an address ZeroMQ refuses, with its reason in *ret_why), -ENOMEM, -errno. */
int kv_events_new(const char *endpoint, const char *replay, const char *topic,
                  struct kv_events **ret, const char **ret_why);

/* Sends what is queued, stops the thread, closes the sockets. Accepts NULL. */
struct kv_events *kv_events_free(struct kv_events *e);

/* A block became findable: its key, its parent's (NULL for a prompt's first block), its
 * token ids (n_tokens: 0 when the engine gave none), the model's block_tokens, where it is
 * ("GPU": the pool). */
void kv_events_stored(struct kv_events *e, const uint8_t key[KV_EVENTS_KEY_BYTES],
                      const uint8_t *parent, const uint32_t *tokens, uint32_t n_tokens,
                      uint32_t block_tokens, const char *medium);

/* A block is findable no more. */
void kv_events_removed(struct kv_events *e, const uint8_t key[KV_EVENTS_KEY_BYTES],
                       const char *medium);

/* Everything the node held is gone (sent once at start: a restarted daemon holds nothing
 * of what a subscriber may remember). */
void kv_events_cleared(struct kv_events *e);

/* Events queued, batches sent, and events dropped for a full queue, since the start. */
uint64_t kv_events_count(const struct kv_events *e);
uint64_t kv_events_batches(const struct kv_events *e);
uint64_t kv_events_dropped(const struct kv_events *e);
