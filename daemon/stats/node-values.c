/* SPDX-License-Identifier: MIT */
#include <errno.h>

#include "basic/macro.h"
#include "evict.h"
#include "kv-events.h"
#include "node-values.h"
#include "pool.h"
#include "mover.h"
#include "server.h"
#include "tier-file.h"
#include "tier.h"

#define READER(name, expr)                                                                    \
	static uint64_t read_##name(const struct server *s) {                                 \
		const struct pool *p = s->pool;                                               \
		(void)p;                                                                      \
		return (expr);                                                                \
	}

READER(protocol_version, KVD_PROTOCOL_VERSION_MAX)
READER(pool_bytes, p->pool_bytes)
READER(budget_bytes, p->budget_bytes)
READER(used_bytes, p->used_bytes)
READER(block_bytes, p->block_bytes)
READER(chunk_bytes, p->chunk_bytes)
READER(chunks_total, p->n_chunks)
READER(chunks_free, p->chunks_free)
READER(chunks_draining, p->chunks_draining)
READER(connections, s->n_conns)
READER(connections_accepted, s->next_conn_id)
READER(tenants, s->tenants.n)
READER(turns_yielded, s->turns_yielded)
READER(uptime_ms, now_ms() - s->start_ms)
READER(grants, p->grants)
READER(grants_refused, p->grants_refused)
READER(protocol_errors, s->protocol_errors)
READER(access_refused, s->access_refused)
READER(uid_connections_refused, s->uid_connections_refused)
READER(pins_overdue, s->pins_overdue)
READER(pin_disconnects, s->pin_disconnects)
READER(truncates, s->truncates)
READER(truncated_tokens, s->truncated_tokens)
READER(forks, s->forks)
READER(shared_bytes, s->pool->shared_bytes)
READER(prefix_hits, s->prefix_hits)
READER(prefix_misses, s->prefix_misses)
READER(prefix_tokens, s->prefix_tokens)
READER(group_steps, s->group_steps)
READER(cached_bytes, s->prefix.cached_bytes)
READER(cached_blocks, s->prefix.cached_blocks)
READER(cache_hits, s->prefix_cached_hits)
READER(cache_dropped, s->prefix.dropped)
READER(kv_events, kv_events_count(s->events))
READER(kv_event_batches, kv_events_batches(s->events))
READER(kv_events_dropped, kv_events_dropped(s->events))
READER(reloads, s->reloads)
READER(reload_failures, s->reload_failures)
READER(last_reload_ms, s->last_reload_ms)
READER(last_reload_failed, s->last_reload_failed)
READER(rounds_total, evict_rounds_total(s->evictor))
READER(gpu_scored_layers, evict_gpu_layers(s->evictor))
READER(gpu_fallbacks, evict_gpu_fallbacks(s->evictor))
READER(last_round_us, evict_last_round_us(s->evictor))
READER(rounds_failed, evict_rounds_failed(s->evictor))
READER(grants_waiting, evict_grants_waiting(s->evictor))
READER(backend_fell_back, s->backend_fell_back)
READER(unmap_timeouts, s->unmap_timeouts)
READER(unmap_disconnects, s->unmap_disconnects)
READER(accept_pauses, s->accept_pauses)
READER(departed_holders, s->n_departed)
READER(engine_events_done, s->engine_events_done)
READER(sequences, s->sequences)
READER(sequences_max, registry_seqs_max(s))
READER(metadata_bytes, s->metadata_bytes)
READER(metadata_max_bytes, registry_metadata_max(s))
READER(host_tier_bytes, s->tier->budget_bytes)
READER(host_tier_used_bytes, s->tier->used_bytes)
READER(host_tier_sequences, s->tier->n_seqs)
READER(tier_offloads, s->tier->offloads)
READER(tier_offload_bytes, s->tier->offload_bytes)
READER(tier_offload_us, s->tier->offload_ns / 1000)
READER(tier_recalls, s->tier->recalls)
READER(recall_kept_tokens, s->tier->kept_tokens)
READER(recall_kept_bytes, s->tier->kept_bytes)
READER(recall_lost_tokens, s->tier->kept_lost)
READER(recalls, s->tier->token_recalls)
READER(recalled_tokens, s->tier->tokens_recalled)
READER(recall_scored_tokens, s->tier->tokens_scored)
READER(recall_us, s->tier->token_recall_us)
READER(tier_recall_bytes, s->tier->recall_bytes)
READER(tier_recall_us, s->tier->recall_ns / 1000)
READER(tier_lost_full, s->tier->lost_full)
READER(tier_lost_corrupt, s->tier->lost_corrupt)
READER(tier_lost_no_memory, s->tier->lost_no_memory)
READER(host_tier_moves, mover_moves(s->mover))
READER(file_tier_bytes, s->tier->file ? (uint64_t)s->tier->file->n_segs * s->tier->seg_bytes : 0)
READER(file_tier_used_bytes, s->tier->file_used_bytes)
READER(file_tier_sequences, s->tier->file_seqs)
READER(tier_demotes, s->tier->demotes)
READER(tier_demote_bytes, s->tier->demote_bytes)
READER(tier_demote_us, s->tier->demote_ns / 1000)
READER(tier_file_recalls, s->tier->file_recalls)
READER(tier_file_recall_bytes, s->tier->file_recall_bytes)
READER(tier_file_recall_us, s->tier->file_recall_ns / 1000)
READER(tier_file_read_us, s->tier->file_read_ns / 1000)
READER(tier_lost_io, s->tier->lost_io)
#undef READER

#define GAUGE false
#define COUNTER true

const struct node_value node_values[] = {
	{ "protocol_version", NULL, GAUGE, NULL, read_protocol_version },
	{ "pool_bytes", "kvd_pool_bytes", GAUGE, "Capacity of the pool, in whole chunks.",
	  read_pool_bytes },
	{ "budget_bytes", "kvd_budget_bytes", GAUGE,
	  "Node budget: the most that all tenants may hold together.", read_budget_bytes },
	{ "used_bytes", "kvd_used_bytes", GAUGE,
	  "Bytes of the chunks tenants hold, draining ones included: what the budget limits.",
	  read_used_bytes },
	{ "block_bytes", "kvd_block_bytes", GAUGE,
	  "Bytes inside granted blocks; the difference to used bytes is fragmentation.",
	  read_block_bytes },
	{ "chunk_bytes", "kvd_chunk_bytes", GAUGE,
	  "Size of one chunk, the unit of allocation and sharing.", read_chunk_bytes },
	{ "chunks_total", NULL, GAUGE, NULL, read_chunks_total },
	{ "chunks_free", NULL, GAUGE, NULL, read_chunks_free },
	{ "chunks_draining", NULL, GAUGE, NULL, read_chunks_draining },
	{ "connections", "kvd_connections", GAUGE, "Client connections open now.",
	  read_connections },
	{ NULL, "kvd_connections_accepted_total", COUNTER,
	  "Client connections accepted since the start.", read_connections_accepted },
	{ NULL, "kvd_tenants", GAUGE, "Tenants the daemon knows.", read_tenants },
	{ NULL, "kvd_turns_yielded_total", COUNTER,
	  "Times a connection handled its most frames in one turn of the loop and let the "
	  "others go first.", read_turns_yielded },
	{ "uptime_ms", NULL, GAUGE, NULL, read_uptime_ms },
	{ "sequences", "kvd_sequences", GAUGE, "Sequences open on the node.", read_sequences },
	{ "sequences_max", "kvd_sequences_max", GAUGE,
	  "Sequences the node may have open (max-seqs-node).", read_sequences_max },
	{ "metadata_bytes", "kvd_metadata_bytes", GAUGE,
	  "Memory the open sequences' metadata may take in kvd.", read_metadata_bytes },
	{ "metadata_max_bytes", "kvd_metadata_max_bytes", GAUGE,
	  "Bound on it (max-metadata-bytes).", read_metadata_max_bytes },
	{ NULL, "kvd_grants_total", COUNTER, "Chunks granted to tenants from the pool.",
	  read_grants },
	{ "grants_refused", NULL, COUNTER, NULL, read_grants_refused },
	{ "protocol_errors", "kvd_protocol_errors_total", COUNTER,
	  "Protocol errors by clients: bad frames, undecodable or misplaced requests, no hello "
	  "in time.", read_protocol_errors },
	{ "access_refused", "kvd_access_refused_total", COUNTER,
	  "Hellos and admin requests refused for want of rights (allow-users, allow-groups, "
	  "tenant-create, admin-group).", read_access_refused },
	{ "uid_connections_refused", "kvd_uid_connections_refused_total", COUNTER,
	  "Connections refused because their user had max-connections-per-uid.",
	  read_uid_connections_refused },
	{ "pins_overdue", "kvd_pins_overdue_total", COUNTER,
	  "Sequences held pinned past pin-report (each pin reported once).", read_pins_overdue },
	{ "pin_disconnects", "kvd_pin_disconnects_total", COUNTER,
	  "Connections disconnected for holding a pin past pin-timeout.", read_pin_disconnects },
	{ "truncates", "kvd_truncates_total", COUNTER,
	  "SeqTruncates applied: sequences rolled back by engines.", read_truncates },
	{ "truncated_tokens", "kvd_truncated_tokens_total", COUNTER,
	  "Token positions SeqTruncates dropped.", read_truncated_tokens },
	{ "forks", "kvd_forks_total", COUNTER, "Sequences forked: opened sharing a sequence's "
	  "full blocks.", read_forks },
	{ "shared_bytes", "kvd_shared_bytes", GAUGE, "Block bytes sequences hold through forks "
	  "and prefix opens without having taken them: what sharing saves.", read_shared_bytes },
	{ "prefix_hits", "kvd_prefix_hits_total", COUNTER, "Prefix opens that found blocks of "
	  "their prompt to share.", read_prefix_hits },
	{ "prefix_misses", "kvd_prefix_misses_total", COUNTER, "Prefix opens that found no "
	  "block of their prompt.", read_prefix_misses },
	{ "prefix_tokens", "kvd_prefix_tokens_total", COUNTER, "Tokens prefix opens found: "
	  "prefill the engines skipped.", read_prefix_tokens },
	{ "group_steps", "kvd_group_steps_total", COUNTER, "Steps tensor-parallel sequence "
	  "groups made: each grew every member of its group, or none.", read_group_steps },
	{ "cached_bytes", "kvd_cached_bytes", GAUGE, "Bytes of blocks the prefix cache holds "
	  "after their last sequence went, for later prefix opens.", read_cached_bytes },
	{ "cached_blocks", "kvd_cached_blocks", GAUGE, "Blocks (of every table) the prefix "
	  "cache holds.", read_cached_blocks },
	{ "cache_hits", "kvd_cache_hits_total", COUNTER, "Blocks prefix opens found in the "
	  "prefix cache, held by no sequence.", read_cache_hits },
	{ "cache_dropped", "kvd_cache_dropped_total", COUNTER, "Blocks the prefix cache "
	  "dropped: for memory, or past a tenant's max-cached-percent.", read_cache_dropped },
	{ "kv_events", "kvd_kv_events_total", COUNTER, "KV events queued for the publisher "
	  "(kv-events).", read_kv_events },
	{ "kv_event_batches", "kvd_kv_event_batches_total", COUNTER, "KV event batches "
	  "published.", read_kv_event_batches },
	{ "kv_events_dropped", "kvd_kv_events_dropped_total", COUNTER, "KV events dropped: the "
	  "publisher's queue was full.", read_kv_events_dropped },
	{ "reloads", "kvd_reloads_total", COUNTER, "Config reloads (SIGHUP, kvdctl reload).",
	  read_reloads },
	{ "reload_failures", "kvd_reload_failures_total", COUNTER, "Config reloads that failed: "
	  "the running settings stayed.", read_reload_failures },
	{ "last_reload_ms", NULL, GAUGE, NULL, read_last_reload_ms },
	{ NULL, "kvd_reload_failed", GAUGE, "1 when the last config reload failed (its errors: "
	  "kvdctl status, the log).", read_last_reload_failed },
	{ "unmap_timeouts", "kvd_unmap_timeouts_total", COUNTER,
	  "Connections that did not unmap a chunk the daemon took back within unmap-timeout.",
	  read_unmap_timeouts },
	{ "unmap_disconnects", "kvd_unmap_disconnects_total", COUNTER,
	  "Connections disconnected for not unmapping a chunk within unmap-timeout and "
	  "unmap-grace.", read_unmap_disconnects },
	{ NULL, "kvd_accept_pauses_total", COUNTER,
	  "Times the daemon ran out of file descriptors and paused accepting connections until "
	  "one closed.", read_accept_pauses },
	{ NULL, "kvd_departed_holders", GAUGE,
	  "Processes whose connection closed while they still mapped chunks: those chunks stay "
	  "charged to their tenants until the processes exit.", read_departed_holders },
	{ "engine_events_done", NULL, COUNTER, NULL, read_engine_events_done },
	{ "rounds_total", "kvd_eviction_rounds_total", COUNTER,
	  "Eviction rounds run, failed ones included.", read_rounds_total },
	{ "last_round_us", NULL, GAUGE, NULL, read_last_round_us },
	{ "gpu_scored_layers", "kvd_round_gpu_layers_total", COUNTER,
	  "Layers (of a sequence, a kv-head group) eviction rounds scored on a GPU.",
	  read_gpu_scored_layers },
	{ "gpu_fallbacks", "kvd_round_gpu_fallbacks_total", COUNTER,
	  "Layers meant to be scored on a GPU that the CPU scored after a device error (its "
	  "memory, a launch): never counted as scored on the GPU.", read_gpu_fallbacks },
	{ NULL, "kvd_eviction_rounds_failed_total", COUNTER,
	  "Eviction rounds that failed (out of memory, a device error): nothing was applied.",
	  read_rounds_failed },
	{ NULL, "kvd_grants_waiting", GAUGE,
	  "Grows the budget could not meet that wait for an eviction round now (grant-wait).",
	  read_grants_waiting },
	{ "host_tier_bytes", "kvd_host_tier_bytes", GAUGE,
	  "Size of the host tier (host-tier-size), outside the budget.", read_host_tier_bytes },
	{ "host_tier_used_bytes", "kvd_host_tier_used_bytes", GAUGE,
	  "K/V bytes of sequences moved out of the pool that the host tier holds now.",
	  read_host_tier_used_bytes },
	{ "host_tier_sequences", "kvd_host_tier_sequences", GAUGE,
	  "Sequences the host tier holds now.", read_host_tier_sequences },
	{ "tier_offloads", "kvd_tier_offloads_total", COUNTER,
	  "Sequences moved out of the pool whole into the host tier.", read_tier_offloads },
	{ "tier_offload_bytes", "kvd_tier_offload_bytes_total", COUNTER,
	  "Bytes of the sequences moved into the host tier.", read_tier_offload_bytes },
	{ "tier_offload_us", NULL, COUNTER, NULL, read_tier_offload_us },
	{ "tier_recalls", "kvd_tier_recalls_total", COUNTER,
	  "Sequences brought back from the host tier at their pin or grow.", read_tier_recalls },
	{ "tier_recall_bytes", "kvd_tier_recall_bytes_total", COUNTER,
	  "Bytes of the sequences brought back from the host tier.", read_tier_recall_bytes },
	{ "tier_recall_us", NULL, COUNTER, NULL, read_tier_recall_us },
	{ "tier_lost_full", "kvd_tier_lost_full_total", COUNTER,
	  "Sequences the host tier dropped, oldest first, to make room: lost, as if evicted.",
	  read_tier_lost_full },
	{ "tier_lost_corrupt", "kvd_tier_lost_corrupt_total", COUNTER,
	  "Sequences lost at their recall because a block failed its checksum (or could not be "
	  "written back): never served.", read_tier_lost_corrupt },
	{ "tier_lost_no_memory", "kvd_tier_lost_no_memory_total", COUNTER,
	  "Sequences lost because no pool memory came for their recall within grant-wait.",
	  read_tier_lost_no_memory },
	{ "host_tier_moves", "kvd_host_tier_moves", GAUGE,
	  "Sequences being moved to or from the host tier now (queued or copying).",
	  read_host_tier_moves },
	{ "file_tier_bytes", "kvd_file_tier_bytes", GAUGE,
	  "Size of the file tier (file-tier-size), on disk, outside the budget.",
	  read_file_tier_bytes },
	{ "file_tier_used_bytes", "kvd_file_tier_used_bytes", GAUGE,
	  "Bytes of the file tier that sequences moved out hold now.", read_file_tier_used_bytes },
	{ "file_tier_sequences", "kvd_file_tier_sequences", GAUGE,
	  "Sequences the file tier holds now.", read_file_tier_sequences },
	{ "tier_demotes", "kvd_tier_demotes_total", COUNTER,
	  "Sequences moved from a full host tier to the file tier.", read_tier_demotes },
	{ "tier_demote_bytes", "kvd_tier_demote_bytes_total", COUNTER,
	  "Bytes written to the file tier.", read_tier_demote_bytes },
	{ "tier_demote_us", NULL, COUNTER, NULL, read_tier_demote_us },
	{ "tier_file_recalls", "kvd_tier_file_recalls_total", COUNTER,
	  "Sequences brought back from the file tier at their pin or grow.", read_tier_file_recalls },
	{ "tier_file_recall_bytes", "kvd_tier_file_recall_bytes_total", COUNTER,
	  "Bytes of the sequences brought back from the file tier.", read_tier_file_recall_bytes },
	{ "tier_file_recall_us", NULL, COUNTER, NULL, read_tier_file_recall_us },
	{ "tier_file_read_us", NULL, COUNTER, NULL, read_tier_file_read_us },
	{ "tier_lost_io", "kvd_tier_lost_io_total", COUNTER,
	  "Sequences lost because the file tier's I/O failed (an I/O error, a full disk); their "
	  "tenants drop from then on.", read_tier_lost_io },
	{ "recall_kept_tokens", "kvd_recall_kept_tokens", GAUGE,
	  "Token slots rounds evicted that the host tier keeps for recall now.",
	  read_recall_kept_tokens },
	{ "recall_kept_bytes", "kvd_recall_kept_bytes", GAUGE,
	  "Bytes of host tier segments the kept token slots hold now.", read_recall_kept_bytes },
	{ "recall_lost_tokens", "kvd_recall_lost_tokens_total", COUNTER,
	  "Token slots of tenants with recall that rounds evicted and the host tier had no room "
	  "to keep.", read_recall_lost_tokens },
	{ "recalls", "kvd_recalls_total", COUNTER, "SeqRecalls answered after their round.",
	  read_recalls },
	{ "recalled_tokens", "kvd_recalled_tokens_total", COUNTER,
	  "Kept token slots recalls brought back, each in place of a resident one.",
	  read_recalled_tokens },
	{ "recall_scored_tokens", "kvd_recall_scored_tokens_total", COUNTER,
	  "Kept token slots recalls scored against their windows.", read_recall_scored_tokens },
	{ "recall_us", NULL, COUNTER, NULL, read_recall_us },
	{ NULL, "kvd_backend_fell_back", GAUGE,
	  "1 when backend auto found no usable GPU and the pool is host memory (the log says "
	  "why); 0 otherwise.", read_backend_fell_back },
};

const size_t n_node_values = ELEMENTSOF(node_values);

int message_set_u64(ProtobufCMessage *m, const char *name, uint64_t v) {
	const ProtobufCFieldDescriptor *f =
		protobuf_c_message_descriptor_get_field_by_name(m->descriptor, name);

	if (!f || f->label != PROTOBUF_C_LABEL_OPTIONAL)
		return -ENOENT;
	switch (f->type) {
	case PROTOBUF_C_TYPE_UINT64:
		*(uint64_t *)((char *)m + f->offset) = v;
		break;
	case PROTOBUF_C_TYPE_UINT32:
		*(uint32_t *)((char *)m + f->offset) = (uint32_t)v;
		break;
	default:
		return -ENOENT;
	}
	*(protobuf_c_boolean *)((char *)m + f->quantifier_offset) = 1;
	return 0;
}

void node_values_status(const struct server *s, Kvd__V1__StatusReply *rep) {
	for (size_t i = 0; i < n_node_values; i++)
		if (node_values[i].status)
			/* Every name is a field: test-node-values checks the table against kvd.proto. */
			(void)message_set_u64(&rep->base, node_values[i].status, node_values[i].read(s));
}
