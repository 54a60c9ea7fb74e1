/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The daemon's settings. One table (settings.c) drives the command line (getopt_long and
 * --help) and the [kvd] section of the config file, whose keys are the flags' names; a
 * second table gives the keys of [tenant NAME] sections. A new setting is one entry there
 * and one field in struct settings.
 *
 * Values come in layers, each over the one before: the table's defaults, the config file
 * (/etc/kvd/kvd.conf), the command line. For the budget and the tenants, the live changes
 * operators make with kvdctl (state.h) sit between the flags and the file; admin.h merges
 * them.
 *
 * The file's format (INI, see inifile.h):
 *
 *   [kvd]
 *   pool-size = 8GiB
 *   budget = 6GiB
 *
 *   [tenant llama]
 *   min = 1GiB
 *   max = 4GiB
 *   weight = 2
 *   policy = kvd
 *   tier = host
 *   allow-users = alice bob
 *
 * Nothing here logs: errors are collected with their file:line (or flag) for the caller,
 * main.c at start and admin.c on a reload, to print or log.
 */

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "inifile.h"
#include "tenant.h"

#define SETTINGS_DEFAULT_CONFIG "/etc/kvd/kvd.conf"
/* The config file's size; it is read whole at start and on every SIGHUP. */
#define SETTINGS_FILE_MAX (UINT64_C(1) << 20)
/* Names in one tenant's allow-users or allow-groups, and the length of each. */
#define SETTINGS_LIST_MAX 64
#define SETTINGS_LIST_NAME_MAX 64
/* Entries in the node table (a bound for the per-entry arrays below). */
#define SETTINGS_MAX 64
/* Budget and sizes that are not set: the budget is then the pool. */
#define SETTINGS_UNSET UINT64_MAX
/* A size given as a percent of the pool (SETTING_PERCENT): this bit, and the percent. */
#define SETTINGS_PERCENT (UINT64_C(1) << 62)

enum setting_type {
	SETTING_SIZE,                 /* uint64_t, size.h's syntax */
	SETTING_U32,                  /* uint32_t */
	SETTING_MS,                   /* uint64_t milliseconds */
	SETTING_STRING,               /* char *, owned */
	SETTING_ENUM,                 /* int, one of the names of .enum_name */
	SETTING_LIST,                 /* char *, owned: names separated by one space, or NULL */
	_SETTING_TYPE_MAX,
};

/* Where a value comes from, as status reports it. */
enum setting_source {
	SOURCE_DEFAULT,
	SOURCE_CONFIG,
	SOURCE_FLAG,
	SOURCE_LIVE,
	_SOURCE_MAX,
	_SOURCE_INVALID = -EINVAL,
};

/* "default", "config", "flag", "live". */
const char *setting_source_to_string(enum setting_source s);

/* Flags of a table entry. */
#define SETTING_RUNTIME   (1u << 0) /* SIGHUP applies a change while running */
#define SETTING_FLAG_ONLY (1u << 1) /* on the command line only, not a key of the file */
#define SETTING_OPTIONAL  (1u << 2) /* the flag's argument is optional (--flag[=VALUE]) */
#define SETTING_NONE      (1u << 3) /* sizes: "none" means no limit (UINT64_MAX) */
#define SETTING_PERCENT   (1u << 4) /* sizes: "N%" (1..100) is a share of the pool, kept as
                                     * SETTINGS_PERCENT | N until the pool is known */

struct setting {
	const char *name;             /* the flag without "--", and the key */
	enum setting_type type;
	unsigned flags;
	const char *metavar;          /* SIZE, N, ... in --help */
	const char *def;              /* the default, parsed like any value; NULL: unset */
	const char *def_help;         /* what --help shows as the default, when not def */
	const char *help;
	size_t offset;                /* of the value, in struct settings (or settings_tenant) */
	uint64_t min, max;            /* numbers: the range; strings: the length (max 0: any) */
	/* Enums: the name of value v (NULL for values that have none), v in [0, enum_n). */
	const char *(*enum_name)(int v);
	int enum_n;
	/* Optional, for a string: 0, or -EINVAL with *ret_why saying what is wrong. */
	int (*check)(const char *value, const char **ret_why);
};

enum settings_backend {
	SETTINGS_BACKEND_HOST,
	SETTINGS_BACKEND_AUTO,
	SETTINGS_BACKEND_CUDA,
	_SETTINGS_BACKEND_MAX,
};

const char *settings_backend_to_string(int v);

/* tenant-create: who may act as a tenant the config file does not declare (access.h). */
enum settings_tenant_create {
	SETTINGS_TENANT_CREATE_ANY,
	SETTINGS_TENANT_CREATE_ADMIN,
	SETTINGS_TENANT_CREATE_NONE,
	_SETTINGS_TENANT_CREATE_MAX,
};

const char *settings_tenant_create_to_string(int v);

enum settings_yes_no {
	SETTINGS_NO,
	SETTINGS_YES,
	_SETTINGS_YES_NO_MAX,
};

const char *settings_yes_no_to_string(int v);

/* The entries of the tenant table, by index. */
enum settings_tenant_key {
	SETTINGS_TENANT_MIN,
	SETTINGS_TENANT_MAX,
	SETTINGS_TENANT_WEIGHT,
	SETTINGS_TENANT_POLICY,
	SETTINGS_TENANT_TIER,
	SETTINGS_TENANT_RECALL,
	SETTINGS_TENANT_ALLOW_USERS,
	SETTINGS_TENANT_ALLOW_GROUPS,
	_SETTINGS_TENANT_KEY_MAX,
};

struct settings_tenant {
	char name[KVD_TENANT_NAME_MAX + 1];
	unsigned line;                /* of its first [tenant NAME] header */
	uint64_t min_bytes;
	uint64_t max_bytes;           /* KVD_TENANT_NO_CAP: none */
	uint32_t weight;
	int policy;                   /* enum kvd_policy */
	int tier;                     /* enum tier_mode */
	uint32_t recall;              /* tokens per row a recall may bring back; 0: off */
	char *allow_users;            /* as written; enforced at hello (access.h) */
	char *allow_groups;
	/* The lists resolved to ids by access_resolve(), at start and on every reload. */
	uint32_t n_allow_uids, n_allow_gids;
	uint32_t allow_uids[SETTINGS_LIST_MAX];
	uint32_t allow_gids[SETTINGS_LIST_MAX];
	uint8_t source[_SETTINGS_TENANT_KEY_MAX]; /* per entry of the tenant table */
	unsigned key_line[_SETTINGS_TENANT_KEY_MAX];
};

struct settings {
	/* One field per entry of the node table. */
	int backend;                  /* enum settings_backend */
	char *devices;                /* cuda: "all" or a list of GPUs (backend_devices_next) */
	uint32_t pool_percent;        /* cuda: pool as a percent of free device memory; 0: pool_size */
	char *socket;
	char *socket_group;           /* "": the daemon's group */
	char *admin_group;
	int admin_on_tenant_connections; /* enum settings_yes_no */
	int tenant_create;            /* enum settings_tenant_create */
	uint64_t pool_size;
	uint64_t chunk_size;
	uint64_t budget;              /* SETTINGS_UNSET: the pool */
	uint32_t max_connections;
	uint32_t max_connections_per_uid;
	uint32_t max_tenants;
	uint32_t max_tenants_per_uid;
	uint32_t max_models;
	uint32_t max_models_per_tenant;
	uint32_t max_outstanding;
	uint32_t max_seqs;
	uint32_t max_seqs_per_tenant;
	uint32_t max_seqs_node;       /* 0: derived at start (server.h) */
	uint64_t max_metadata_bytes;  /* 0: derived at start (server.h) */
	uint32_t max_seq_tokens;
	uint64_t hello_timeout_ms;
	uint64_t unmap_timeout_ms;    /* 0: wait forever */
	uint64_t unmap_grace_ms;
	uint32_t max_pinned_percent;
	uint32_t max_cached_percent;
	uint32_t tier_max_percent;
	uint64_t pin_report_ms;       /* 0: never */
	uint64_t pin_timeout_ms;      /* 0: never */
	uint64_t tenant_forget_ms;
	uint32_t high_watermark, low_watermark; /* percent of the budget */
	uint64_t grant_wait_ms;
	uint64_t restore_claim_ms;    /* 0: nothing is kept across a restart (keep.h) */
	uint64_t round_interval_ms;   /* 0: off */
	uint32_t round_threads;       /* 0: the online CPUs */
	uint32_t eviction_floor;      /* percent */
	uint64_t max_observation_bytes;
	uint64_t host_tier_size;      /* 0: no host tier */
	uint64_t file_tier_size;      /* 0: no file tier */
	char *file_tier_dir;
	uint64_t tier_idle_ms;        /* 0: offloads under pressure only */
	int recall_policy;            /* 0: auto; else enum kvd_policy + 1: settings_recall_policy() */
	uint32_t poll_us;
	uint32_t ring_entries;        /* 0: no rings */
	int ring_doorbell;            /* enum ring_doorbell */
	int uring_setup;              /* enum loop_setup */
	int log_level;                /* LOG_ERR..LOG_DEBUG */
	char *state_dir;
	char *metrics_listen;         /* "": off */
	char *kv_events, *kv_events_replay, *kv_events_topic; /* "": off */
	int metrics_remote;           /* enum settings_yes_no: may metrics_listen be reachable
	                               * from other machines */
	char *config;
	char *check_config;           /* NULL: not asked; "": --config's file */

	uint8_t source[SETTINGS_MAX]; /* per entry of the node table */
	unsigned line[SETTINGS_MAX];  /* of the key, for SOURCE_CONFIG */
	char *path;                   /* the config file read; NULL: none (missing default) */
	struct settings_tenant *tenants;
	uint32_t n_tenants;
	/* admin-group resolved by access_resolve(); has_admin_gid false: root only. */
	bool has_admin_gid;
	uint32_t admin_gid;
};

/* The tables. */
const struct setting *settings_table(size_t *ret_n);
const struct setting *settings_tenant_table(size_t *ret_n);
/* Index of the node entry called name, or -ENOENT. */
int settings_index(const char *name);

/* Fills s with the defaults. Returns 0 or -ENOMEM. */
int settings_init(struct settings *s);
void settings_done(struct settings *s);

/*
 * Parses the command line into flags (defaults, with the given flags marked SOURCE_FLAG).
 * Prints what is wrong to stderr. Returns 1 to go on, 0 after --help or --version (printed),
 * or -EINVAL (usage error: exit 2), -ENOMEM.
 */
int settings_parse_argv(struct settings *flags, int argc, char *argv[]);

/*
 * Fills s (initialised with settings_init) with the config file over the defaults, then the
 * flags from settings_parse_argv() over both. The file is path when not NULL, else the one
 * --config names; a missing file is an error only when it was named (path, --config or
 * --check-config FILE). Then checks the result (settings_check). Returns 0 with no error
 * added to e, -EINVAL with errors in e, or -ENOMEM.
 */
int settings_load(struct settings *s, const struct settings *flags, const char *path,
                  struct inifile_errors *e);

/* Checks what single values cannot: sizes against each other, the tenants against
 * max-tenants and their max. Adds errors to e, naming file:line or flag. */
void settings_check(const struct settings *s, struct inifile_errors *e);

/* Checks s against the pool the chosen backend makes: chunk-size a multiple of its
 * granularity (0: unchecked), the budget and every tenant's min at most pool_bytes (every
 * device's). What a start checks once the backend is open, --check-config the same way on
 * this machine, and a reload against the running pool. Adds errors to e. */
void settings_check_pool(const struct settings *s, uint64_t granularity, uint64_t pool_bytes,
                         struct inifile_errors *e);

/* The budget s says for a pool of pool_bytes (all devices together): the pool when unset,
 * a share of it when a percent (rounded down), else the bytes given. */
/* The policy recalls score with: an enum kvd_policy, or -1 for auto (recall.h). */
int settings_recall_policy(const struct settings *s);

uint64_t settings_budget(const struct settings *s, uint64_t pool_bytes);

/* Whether entry i (of the node table) has the same value in a and b. */
bool settings_equal(const struct settings *a, const struct settings *b, size_t i);
/* Swaps entry i's value (and source) between a and b: strings move, so that a pointer
 * into a value the server holds stays valid in whichever struct keeps it. */
void settings_swap(struct settings *a, struct settings *b, size_t i);
/* Entry i's value as text, for logs ("8.0 MiB", "off"). */
void settings_format(const struct settings *s, size_t i, char *buf, size_t n);

const struct settings_tenant *settings_tenant_find(const struct settings *s, const char *name);

/* Prints --help. */
void settings_help(FILE *f);

/* What names a value in messages: "FILE:LINE: key", "--flag" or "key (default)". */
void settings_where(const struct settings *s, size_t i, char *buf, size_t n);
