/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The computing half of an eviction round (docs/architecture.md §5, docs/algorithms.md §7): from a
 * snapshot of the sequences it ranks, score every (sequence, layer) against its window,
 * smooth across rounds, and select globally what to evict. It runs on a worker thread and
 * touches nothing but the round: evict.c takes the snapshot and applies the result on the
 * loop, where the sequences may meanwhile have grown, been pinned, or gone.
 *
 * Units and rows. A sequence's costs live in rows: one per table for KVD_UNIT_HEAD_TOKEN and
 * KVD_UNIT_BLOCK, one per layer for KVD_UNIT_LAYER_TOKEN (with the per-head layout a layer's
 * tables then stay aligned: they always lose the same slots). A row holds one smoothed cost
 * per slot; a unit is a slot of a row (token units) or a full block of it (block units).
 *
 * Costs. Per layer, kvd_policy_scores() (kernels/policy.h) with the tenant's policy gives
 * N1 shares of the layer (rank shares for the baselines), over the slots that precede the
 * window the engine last published for that layer; a layer without a window is scored by
 * recency (streamingllm) so that a tenant cannot shield its cache by publishing nothing.
 * The round's cost x then enters the cross-round EMA S <- (1 - beta) S + beta x (the first
 * observation initialises S), and a unit's value is its S (summed over a block's slots)
 * times the tenant's weight.
 *
 * Protected, never units: slots whose original position is below the model's sinks, the
 * last `window` slots scored and every slot after them, the slots of the open tail block,
 * slots that were never scored, and blocks the needle guard pins (block units). Floors:
 * each row gives up at most (100 - floor)% of its tokens.
 *
 * Selection (kvd_evict_greedy, lowest value per byte first): a tenant over its cap loses
 * the excess first, from its own units (its waiting grows count: waiting); then the rest
 * of the target is taken across the ranked tenants, none going below its fair share of
 * what the round leaves them (split by weight among those above their minimum) or its
 * guaranteed minimum; a round on one tenant takes it down to its minimum. Units are bytes
 * of K/V (block bytes); whether chunks come free is up to compaction.
 *
 * Compensation (models registered with moments or latent memory): the K/V of every slot
 * a round drops are summarised per (layer, kv head) on the worker (compensate.h), and
 * evict.c merges those summaries into the sequence's compensation blocks when it compacts,
 * so that no token leaves the pool unaccounted for. kvd-mi reads the moments' key means as
 * they were at the snapshot.
 *
 * Recall (round.recall, one sequence): every row with a window scores its resident slots
 * before the window and its kept ones (recall.h) together, in position order, with the
 * window's own slots after them as a round does, by the tenant's policy as the snapshot set
 * it (the recall policy), each candidate then worth the most of its neighbours within
 * RECALL_SPAN in position order; the kept slots with the highest costs are paired with the
 * evictable resident slots (not sinks) with the lowest, as long as the kept one's cost is
 * higher, at most recall_max pairs per row. The costs replace the slots' smoothed ones: the
 * window is new.
 *
 * Indexer (models registered with one): policy indexmem scores a layer from the index keys
 * in its blocks and the index queries of its observation window, never from its K/V.
 */

#include <stdbool.h>
#include <stdint.h>

#include "backend.h"

#include "observe.h"
#include "recall.h"
#include "tenant.h"

#define ROUND_BETA 0.5f               /* cross-round EMA weight of the new round */
#define ROUND_UNSCORED (-1.0f)        /* S of a slot never scored */
#define RECALL_SPAN 4                 /* a recall's candidate is worth the most of its
                                       * neighbours this many positions either way */

enum round_trigger {
	ROUND_WATERMARK,
	ROUND_GRANT,
	ROUND_BUDGET,
	ROUND_EVICT,
	ROUND_INTERVAL,
	ROUND_CAP,                    /* a tenant's cap was lowered below what it holds */
	ROUND_RECALL,                 /* a SeqRecall: one sequence's kept tokens against its
	                               * window (recall.h) */
	_ROUND_TRIGGER_MAX,
};

const char *round_trigger_to_string(enum round_trigger t);

struct round_tenant {
	uint32_t id;                  /* tenant id (never reused while the daemon runs) */
	char name[KVD_TENANT_NAME_MAX + 1];
	uint64_t used, min, max;      /* bytes, at the snapshot */
	uint64_t waiting;             /* bytes its grows waiting for a round lack */
	uint32_t weight;
	int policy;                   /* enum kvd_policy */
	/* Results. */
	uint64_t freed_bytes, evicted_tokens;
	double predicted;             /* sum of its evicted units' S, unweighted */
};

struct round_seq {
	uint64_t conn_id, seq_id, epoch;
	uint32_t tenant;              /* index into round.tenants */
	uint32_t device;              /* the pool's device its blocks are on */
	/* The model's geometry. */
	uint32_t layers, q_heads, kv_heads, head_dim, dtype, block_tokens, layout, unit;
	uint32_t window, n_tables, rows;
	uint64_t block_bytes, block_stride; /* a block's bytes, and its chunk's block stride */
	/* The indexer (index_dim 0: none): index keys at index_offset in every block. */
	uint32_t index_heads, index_dim;
	uint64_t index_offset;
	/* Per table, at the snapshot: resident slots, slots below the sinks, slots before the
	 * end of the layer's published window (0: none), and the first entry of its blocks
	 * in block_addr (the daemon's address of each block in use, in slot order: a device
	 * address on cuda, read through round.read). */
	uint32_t *tokens, *sink_slots, *window_end;
	uint64_t *block_off;
	const uint8_t **block_addr;
	uint32_t *block_chunk;        /* each block's chunk, alongside block_addr */
	struct obs *obs;              /* a reference; NULL when the model has no eviction */
	struct gram_layer **grams;    /* [layers], references or NULL */
	/* With moments: per (layer, kv head), the summary's key mean ([head_dim] each) and
	 * token count at the snapshot (NULL without, or before the first grow). */
	uint32_t compensation;
	float *mi_mean_k;
	uint64_t *mi_count;
	/* Per row: S before (NULL entries: none yet), and after the round ([tokens of the
	 * row's table] floats, ROUND_UNSCORED where not scored). */
	float **smooth_in, **smooth_out;
	/* Results: per table, the slots to drop (ascending): drop_slots + drop_off[t], count
	 * drop_off[t + 1] - drop_off[t]. */
	uint32_t *drop_off, *drop_slots;
	uint64_t dropped_units;
	/* With compensation and drops: per (layer, kv head), the summary of its dropped K/V
	 * (compensate_floats() floats each, count in fold_count: 0 for none). */
	float *fold;
	uint64_t *fold_count;
	/* A recall (round.recall): the sequence's kept tokens (recall.h), the round's until
	 * it is applied; each table's positions at the snapshot (positions + block_off-like
	 * pos_off[t]); tokens per row it may bring back. Results: per table, the kept slots to
	 * bring back (take_off, take: indices into the table's kept slots, ascending; take_s:
	 * the smoothed cost each comes back with), one for each resident slot of drop_slots;
	 * the kept slots scored. */
	struct recall_store *kept;
	uint32_t *positions;
	uint64_t *pos_off;
	uint32_t recall_max;
	uint32_t *take_off, *take;
	float *take_s;
	uint64_t candidates;
};

struct round {
	uint64_t id;
	enum round_trigger trigger;
	bool dry_run;                 /* a plan to show (evict_plan): nothing is applied */
	bool recall;                  /* ROUND_RECALL: scores and trades, frees nothing */
	uint64_t start_ms;
	uint64_t target;              /* bytes of units to evict */
	int only;                     /* index of the one tenant to evict from, or -1 */
	int device;                   /* the one pool device whose sequences it takes, or -1 */
	uint32_t floor_pct, threads;
	/* How K/V reach the CPU: the pool backend's read and read_rows (memcpy, or device
	 * copies). */
	const struct backend_ops *mem;
	/* Per pool device, scoring on the GPU (round-gpu.h), or NULL: the CPU scores. */
	struct round_gpu *const *gpu;
	struct round_tenant *tenants;
	uint32_t n_tenants;
	struct round_seq *seqs;
	uint32_t n_seqs;
	/* Results. */
	int error;                    /* 0 or why the round failed (nothing is applied) */
	uint64_t score_us, select_us, fold_us;
	uint64_t units, selected_bytes;
	double predicted_error;       /* sum of the evicted units' S, unweighted */
};

/* Scores, smooths and selects: fills the results of r. Runs on any thread. */
void round_run(struct round *r);

/* Row of table t, and the first table of row `row`, for the sequence's unit. */
uint32_t round_row_of_table(const struct round_seq *q, uint32_t t);
uint32_t round_table_of_row(const struct round_seq *q, uint32_t row);

/* Frees a round and drops its references. Accepts NULL. */
struct round *round_free(struct round *r);
