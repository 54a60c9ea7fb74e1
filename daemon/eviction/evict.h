/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The eviction scheduler, on the event loop: when a round runs, the snapshot it scores, and
 * applying its result. The triggers, targets and steps are docs/architecture.md §5; what
 * operators and engines see, docs/eviction.md (with the KVD_TEST_ROUND_GATE hook).
 *
 * Invariants: at most one round runs at a time, on a worker thread (round.h) that changes
 * no daemon state, and the loop never waits for it. A result applies only to sequences
 * that still exist and were not compacted since the snapshot; a pinned one takes it at its
 * last unpin. Bytes that earlier rounds took and that wait for their holders to unmap count
 * as freed, so a holder that does not answer loses no more than one round's share. Every
 * request that waits for a round is answered through its callback (evict_done_fn,
 * evict_grow_fn), whatever happens to the round.
 */

#include <stdbool.h>
#include <stdint.h>

#include "kvd/kvd-abi.h"
#include "round.h"

struct server;
struct conn;
struct seq;
struct seq_emptied;
struct tenant;
struct evictor;

/* A plan made while the sequence was pinned: applied at its last unpin if the sequence is
 * still at epoch. */
struct plan {
	uint64_t round_id;            /* the round that made it, and the block bytes it drops */
	uint64_t bytes;
	uint64_t epoch;
	uint32_t n_tables;
	uint32_t *drop_off, *drop_slots;
	float *fold;                  /* the round's summaries of the drops (round.h) */
	uint64_t *fold_count;
};

struct plan *plan_free(struct plan *p);
/* Frees a plan that will never be applied (its sequence is released), counting it as
 * dropped in its round's history. Returns NULL. */
struct plan *evict_plan_drop(struct evictor *e, struct plan *p);

/* What one round did, as kvdctl evictions shows it: a record of the history, or (id 0) a
 * plan's answer, what a round would do. A plan's tenants carry their predicted cost; a
 * round's, what was applied (by the round, or at a later unpin). */
struct evict_record_tenant {
	char name[KVD_TENANT_NAME_MAX + 1];
	uint64_t applied_bytes, applied_tokens;
	double predicted_error;       /* plans only */
};

struct evict_record {
	uint64_t id;                  /* 0: a plan */
	enum round_trigger trigger;
	uint64_t start_ms, duration_us, score_us, select_us, compact_us;
	uint64_t target, freed;
	/* Block bytes of what the round selected, and of that what waits for its sequences'
	 * unpin and what was dropped (sequence gone or rewritten since the snapshot): planned
	 * = applied (the tenants') + waiting + dropped. */
	uint64_t planned, waiting, dropped;
	uint64_t recalled, scored;    /* a recall: token slots brought back, kept ones scored */
	uint32_t sequences;
	uint64_t units;
	double predicted_error;
	int error;
	char note[192];               /* why it freed nothing, when it did not */
	struct evict_record_tenant *tenants;
	uint32_t n_tenants;
};

/*
 * How a request the evictor queued came out, for its answer (the evictor builds no reply:
 * the requests do, rounds.c): error < 0 and why, or, for an Evict or a plan, the round
 * (or plan) it ran; for a SeqRecall, the token slots it brought back, their bytes, and the
 * kept slots it scored.
 */
struct evict_outcome {
	int error;
	const char *why;
	const struct evict_record *round;
	uint64_t tokens, bytes, candidates;
};

/* Answers request id of connection conn_id (which may be gone by now) with outcome o; on
 * the loop. */
typedef void (*evict_done_fn)(struct server *s, uint64_t conn_id, uint64_t id,
                              const struct evict_outcome *o);

/* Rounds kept for kvdctl evictions. */
#define EVICT_HISTORY 64
/* Evict requests waiting for their round, and grows waiting for memory, at most. */
#define EVICT_WAITERS_MAX 64
#define GRANT_WAITERS_MAX 1024

int evictor_new(struct server *s, struct evictor **ret);
/* Waits for a running round (its result is dropped). */
struct evictor *evictor_free(struct evictor *e);

/* Checks the triggers and starts a round if one is due and none runs. Cheap; called on
 * every tick and after every grant. */
void evict_kick(struct evictor *e, enum round_trigger why);

/*
 * Queues an Evict request of connection c (request id): bytes 0 means down to the low
 * watermark; tenant NULL means ranked across all. The reply comes when its round is done.
 * Returns 0, or -EBUSY (too many waiting), -ENOMEM.
 */
int evict_request(struct evictor *e, struct conn *c, uint64_t id, struct tenant *t, uint64_t bytes,
                  evict_done_fn done);

/*
 * Queues a SeqRecall of connection c (request id) for q (docs/recall.md): its round runs
 * before any other waiting (its engine waits for it), and request id is answered when the
 * trade is done: a SeqRecallReply, or an error (the sequence released, pinned or rewritten
 * meanwhile: -ENOENT, -EBUSY, -EAGAIN). Returns 0, or -EBUSY (too many waiting; q
 * pinned), -EAGAIN (q moved out of the pool, or its engine's step not complete).
 */
int evict_recall(struct evictor *e, struct conn *c, uint64_t id, struct seq *q,
                 evict_done_fn done);

/* A tenant's settings as a change would make them, for a plan (evict_plan). */
struct evict_patch {
	uint32_t tenant_id;           /* 0: none */
	uint64_t min_bytes, max_bytes;
	uint32_t weight;
	int policy;
};

/*
 * Queues a dry run (kvdctl --dry-run) of the change that would start a round for trigger:
 * ROUND_BUDGET, a budget of `bytes`; ROUND_CAP, tenant patch->tenant_id's settings as patch
 * says; ROUND_EVICT, kvd_evict of `bytes` (0: down to the low watermark) from tenant only
 * (NULL: ranked across all). When its turn comes (after the round running now, so that it
 * sees what that round left), the target is worked out as the change would work it out, and
 * a round scores and selects with patch in its snapshot; request id is answered with what it
 * would take (an EvictionsReply of that one round, with the per-tenant planned bytes, tokens
 * and predicted cost), nothing applied, no smoothed score changed. A target of 0 is
 * answered without a round. Returns 0, or -EBUSY (too many waiting).
 */
int evict_plan(struct evictor *e, struct conn *c, uint64_t id, enum round_trigger trigger,
               struct tenant *only, uint64_t bytes, const struct evict_patch *patch,
               evict_done_fn done);

/*
 * Drops cached blocks (prefix.h), the least recently used first: of tenant t (NULL: any)
 * until `need` bytes of them went, or (t NULL) until chunks of `need` bytes came free.
 * Chunks emptied are reclaimed. Returns the bytes dropped (t), or of the chunks emptied.
 */
uint64_t evict_shed_cache(struct server *s, const struct tenant *t, uint64_t need);

/* What kvd_evict without a size sets out to free: down to the low watermark. */
uint64_t evict_default_target(const struct evictor *e);

/* What a round would set out to free now under a budget of `budget` bytes: down to its low
 * watermark when use is past its high watermark, else nothing. */
uint64_t evict_budget_target(const struct evictor *e, uint64_t budget);

/* What a round for lowered caps would set out to free now: what tenants hold over their
 * caps, tenant t's taken as t_max (t NULL: as they are). Such a round (ROUND_CAP) takes
 * from those tenants only. */
uint64_t evict_cap_target(const struct evictor *e, const struct tenant *t, uint64_t t_max);

/* A tenant's cap was lowered below what it holds: a round takes the excess now. */
void evict_cap_lowered(struct evictor *e);

/* A grow the evictor keeps for its requester, who alone reads it. */
struct parked_grow {
	uint64_t id;                  /* the request's id, or a ring submission's user_data */
	uint64_t seq_id;
	uint32_t tokens;
	bool ring;                    /* answered on the connection's ring, not the socket */
	uint64_t since_us;            /* when it was first parked (CLOCK_MONOTONIC) */
};

/* Retries a parked grow of c: with wait_until_ms 0 it must be answered now (refused if it
 * still cannot be met); else it may park again. */
typedef void (*evict_grow_fn)(struct conn *c, const struct parked_grow *g, uint64_t wait_until_ms);

/*
 * Parks a grow that the budget could not meet (it lacked need_bytes of new chunks) until a
 * round makes room or deadline_ms passes: retry gets it back after each round, in the
 * order they were parked, and once more at the deadline, to answer it. at_cap: it waits
 * at its tenant's max, for its own tenant's memory, so grows of others do not queue behind
 * it (evict_grants_queued). Returns 0 when parked, or -EAGAIN (too many waiting, stopping,
 * or nothing anywhere is evictable) or -ENOMEM: then refuse it now.
 */
int evict_wait_grant(struct evictor *e, struct conn *c, const struct parked_grow *grow, bool at_cap,
                     evict_grow_fn retry, uint64_t need_bytes, uint64_t deadline_ms);

/* Chunks that waited for their holders to unmap them came back to the pool: grows waiting
 * for room are retried now, not at the next round or deadline. */
void evict_chunks_back(struct evictor *e);

/* Refuses parked grows whose deadline passed, and checks the triggers; on every tick. */
void evict_tick(struct evictor *e);

/*
 * Packs the blocks of tenant t's unpinned evictable sequences so that chunks come free,
 * reclaims what emptied (*emptied, and what packing empties), and tells the owners of every
 * sequence packing rewrote. Returns the chunk bytes given back.
 */
uint64_t evict_settle_tenant(struct evictor *e, struct tenant *t, struct seq_emptied *emptied);

/* Applies q's pending plan if it is still valid (at the last unpin), then frees it. */
void evict_apply_pending(struct evictor *e, struct seq *q);

/*
 * Whether the engine's work on q is done: every event it unpinned q with (SeqUnpin
 * event_id) completed. Never blocks: events seen complete are forgotten, one that is not is
 * asked again later (a round skips q meanwhile, a plan for it waits, a tick retries). An
 * event the driver fails to query counts as done, logged (the device is failing); so does
 * every event of a connection that is gone.
 */
bool evict_engine_done(struct server *s, struct seq *q);

/* Whether a round is computing on worker threads now. */
bool evict_running(const struct evictor *e);

/* Statistics and history for status and EvictionsReply. */
uint64_t evict_rounds_total(const struct evictor *e);
uint64_t evict_rounds_failed(const struct evictor *e);
/* Layers rounds scored on a GPU, and those meant for it that the CPU scored after a device
 * error (struct round's gpu_layers and gpu_fallbacks, summed since the start). */
uint64_t evict_gpu_layers(const struct evictor *e);
uint64_t evict_gpu_fallbacks(const struct evictor *e);
/* Grows waiting for a round now. */
uint32_t evict_grants_waiting(const struct evictor *e);
/* Those of them a new grow on device queues behind: waiting for memory of that device's
 * pool under the node budget, not at their tenant's max. During a retry pass, only those
 * retried before and parked again: the grows ahead. */
uint32_t evict_grants_queued(const struct evictor *e, uint32_t device);
uint64_t evict_last_round_us(const struct evictor *e);
/* The history: how many rounds it holds, and the i-th, oldest first (valid until the
 * next round ends). */
uint32_t evict_records(const struct evictor *e);
const struct evict_record *evict_record_at(const struct evictor *e, uint32_t i);
