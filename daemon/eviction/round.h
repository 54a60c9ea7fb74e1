/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The computing half of an eviction round: from a snapshot of the sequences it ranks,
 * score every (sequence, layer) against its window, smooth across rounds, and select
 * globally what to evict; or, for a token recall (round.recall), trade one sequence's kept
 * slots against its resident ones. The math, what is protected and the selection are
 * docs/algorithms.md §7; the round's life is docs/architecture.md §5.4 (and §5.8 for
 * recall). What this file holds to:
 *
 * - round_run() runs on a worker thread and touches nothing but the round: evict.c takes
 *   the snapshot and applies the result on the loop, where the sequences may meanwhile
 *   have grown, been pinned, rewritten (epoch) or gone.
 * - A sequence's costs live in rows (one per table for head-token and block units, one per
 *   layer for layer-token units); a row's smoothed costs are read at the snapshot and
 *   written back only at the apply, for a sequence still at the snapshot's epoch.
 * - A round never selects a protected slot, never takes a tenant below its minimum or a
 *   row past its floor, and a plan (dry_run) changes no smoothed cost.
 * - Compensation summaries (compensate.h) are made here for every slot dropped, so that
 *   the apply merges them with the compaction that drops the slots.
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
	 * end of the layer's published window (0: none), slots the engine has written (those
	 * below seq.written_pos: a round takes none above, nor a recall), and the first entry
	 * of its blocks in block_addr (the daemon's address of each block in use, in slot
	 * order: a device address on cuda, read through round.read). */
	uint32_t *tokens, *sink_slots, *window_end, *written_end;
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
	/* Layers (a kv-head group of one) scored on a GPU, those meant for it that the CPU
	 * scored after a device error, and the first such error; atomics (worker threads). */
	uint32_t gpu_layers, gpu_fallbacks;
	int gpu_error;
};

/* Scores, smooths and selects: fills the results of r. Runs on any thread. */
void round_run(struct round *r);

/* Row of table t, and the first table of row `row`, for the sequence's unit. */
uint32_t round_row_of_table(const struct round_seq *q, uint32_t t);
uint32_t round_table_of_row(const struct round_seq *q, uint32_t row);

/* Frees a round and drops its references. Accepts NULL. */
struct round *round_free(struct round *r);
