/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Tenants: the parties the node budget is shared between. A tenant comes into being when a
 * process first says hello as it or when an operator sets it, and outlives its connections
 * so that its settings stay; one that holds nothing and has no settings of its own is
 * forgotten after --tenant-forget, or by kvdctl tenant delete (registry_forget_tenant). The
 * table is bounded (--max-tenants).
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "backend.h"
#include "basic/size.h"
#include "kvd/kvd-abi.h"

struct chunk;

struct tenant {
	uint32_t id;                  /* never reused while the daemon runs */
	char name[KVD_TENANT_NAME_MAX + 1];
	uint64_t min_bytes;           /* guaranteed share: eviction never takes it below */
	uint64_t max_bytes;           /* cap on used_bytes, KVD_TENANT_NO_CAP for none */
	uint32_t weight;
	int policy;                   /* enum kvd_policy: how rounds rank its tokens */
	int tier;                     /* enum tier_mode: where its idle sequences go (tier.h) */
	uint32_t recall;              /* tokens per row a recall may bring back; 0: off (recall.h) */
	/* Where min, max, weight, policy, tier and recall come from: enum setting_source (admin.h). */
	uint8_t min_source, max_source, weight_source, policy_source, tier_source, recall_source;
	/* The uid whose hello brought it into being, counted against max-tenants-per-uid;
	 * TENANT_NO_CREATOR when the config file, an operator or a restart's claim did. */
	uint32_t creator_uid;
	char *allow_users;            /* from the config file: stored and reported only */
	char *allow_groups;
	uint64_t used_bytes;          /* bytes of the chunks it holds, draining ones included */
	uint64_t block_bytes;         /* bytes of its granted blocks */
	uint32_t chunks;
	uint32_t sequences;
	uint32_t models;              /* registered, all its connections together */
	uint32_t connections;
	/* Eviction, all rounds together: block bytes and token slots taken, rounds that took. */
	uint64_t evicted_bytes, evicted_tokens, rounds;
	/* Chunk grants, and refusals (as the pool's counters, per tenant); grows that waited
	 * for an eviction round (each counted once, however often it was retried). */
	uint64_t grants, grants_refused, grants_waited;
	/* The tiers: bytes of the host tier and of the file held now, sequences in either;
	 * sequences lost from them; whether the file tier failed it (an I/O error, a full
	 * disk): its sequences are then dropped, as with tier drop, until its tier is set
	 * again. */
	uint64_t tier_bytes, tier_file_bytes;
	uint32_t tier_seqs;
	uint64_t tier_lost;
	uint32_t tier_mark;           /* tier.c's count of the tenants holding a tier */
	uint64_t tier_moving;         /* host tier bytes its moves out in flight took */
	uint64_t tier_kept_bytes;     /* host tier bytes its sequences' kept tokens hold */
	/* Pins (pins.h): resident bytes of its pinned sequences; pins held past pin-report. */
	uint64_t pinned_bytes, pins_overdue;
	/* Token recall: slots brought back by its sequences' recalls, all together. */
	uint64_t recalled_tokens;
	/* Sharing: block bytes its sequences hold beyond each block's first holder (pool.h,
	 * pool_block_share); its prefix opens that found blocks and that found none, and the
	 * tokens found. */
	uint64_t shared_bytes;
	uint64_t prefix_hits, prefix_misses, prefix_tokens;
	/* Bytes of its blocks the prefix cache holds after their last sequence (prefix.h). */
	uint64_t cached_bytes;
	bool tier_degraded;
	struct chunk *partial;        /* owned chunks with at least one free block */
	/* FREE chunks whose memory object is its own (pool.h), per device. */
	struct chunk *free_chunks[BACKEND_DEVICES_MAX];
	/* Since when it holds nothing (tenant_holds_nothing); 0 while it holds something. */
	uint64_t idle_since_ms;
};

#define TENANT_NO_CREATOR UINT32_MAX

struct tenant_table {
	struct tenant **tenants;
	uint32_t n, max;
	uint32_t next_id;
};

/* Whether name is a valid tenant name: [A-Za-z0-9_.-], 1..KVD_TENANT_NAME_MAX characters. */
bool tenant_name_valid(const char *name);

int tenant_table_init(struct tenant_table *t, uint32_t max);
void tenant_table_done(struct tenant_table *t);
struct tenant *tenant_find(const struct tenant_table *t, const char *name);
/* Tenants that uid brought into being (tenant.creator_uid). */
uint32_t tenant_count_created_by(const struct tenant_table *t, uint32_t uid);
/* Finds or creates; returns 0, or -EINVAL (bad name), -EUSERS (table full), -ENOMEM. */
int tenant_get(struct tenant_table *t, const char *name, struct tenant **ret);
/* Whether t has no connection, sequence (open or kept), model or chunk (owned or
 * draining): nothing of the daemon's state refers to it but its settings. */
bool tenant_holds_nothing(const struct tenant *t);
/* Takes t out of the table and frees it; the others keep their order. t must hold nothing
 * (and its free chunks' memory must be gone: pool_forget_tenant). */
void tenant_table_remove(struct tenant_table *tt, struct tenant *t);
struct tenant *tenant_find_id(const struct tenant_table *t, uint32_t id);

/* A cap for people: "none" for KVD_TENANT_NO_CAP, else the size ("1.5 GiB"); returns buf. */
static inline char *tenant_format_max(uint64_t v, char *buf, size_t n) {
	if (v == KVD_TENANT_NO_CAP) {
		snprintf(buf, n, "none");
		return buf;
	}
	return size_format(v, buf, n);
}
