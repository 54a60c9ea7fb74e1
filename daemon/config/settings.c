/* SPDX-License-Identifier: MIT */
/*
 * The settings tables, and what reads them: the command line, the config file, --help and
 * the checks across values. See settings.h.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <syslog.h>

#include "basic/macro.h"
#include "basic/number.h"
#include "basic/size.h"
#include "config.h"
#include "http.h"
#include "kvd/kvd-abi.h"
#include "loop.h"
#include "policy.h"
#include "ring.h"
#include "settings.h"
#include "tier.h"

/* The smallest chunk: below it, the per-chunk bookkeeping outweighs what it manages. */
#define CHUNK_SIZE_MIN (UINT64_C(64) << 10)
/* Where --help starts the text of an option, and how wide it is. */
#define HELP_COLUMN 26
#define HELP_WIDTH 90

static const char *const source_names[_SOURCE_MAX] = {
	[SOURCE_DEFAULT] = "default",
	[SOURCE_CONFIG] = "config",
	[SOURCE_FLAG] = "flag",
	[SOURCE_LIVE] = "live",
};

const char *setting_source_to_string(enum setting_source s) {
	return (int)s >= 0 && s < _SOURCE_MAX ? source_names[s] : NULL;
}

const char *settings_backend_to_string(int v) {
	static const char *const names[_SETTINGS_BACKEND_MAX] = {
		[SETTINGS_BACKEND_HOST] = "host",
		[SETTINGS_BACKEND_AUTO] = "auto",
		[SETTINGS_BACKEND_CUDA] = "cuda",
	};

	return v >= 0 && v < _SETTINGS_BACKEND_MAX ? names[v] : NULL;
}

const char *settings_yes_no_to_string(int v) {
	static const char *const names[_SETTINGS_YES_NO_MAX] = {
		[SETTINGS_NO] = "no",
		[SETTINGS_YES] = "yes",
	};

	return v >= 0 && v < _SETTINGS_YES_NO_MAX ? names[v] : NULL;
}

const char *settings_tenant_create_to_string(int v) {
	static const char *const names[_SETTINGS_TENANT_CREATE_MAX] = {
		[SETTINGS_TENANT_CREATE_ANY] = "any",
		[SETTINGS_TENANT_CREATE_ADMIN] = "admin",
		[SETTINGS_TENANT_CREATE_NONE] = "none",
	};

	return v >= 0 && v < _SETTINGS_TENANT_CREATE_MAX ? names[v] : NULL;
}

static const char *log_level_name(int v) {
	static const char *const names[] = {
		[LOG_ERR] = "err", [LOG_WARNING] = "warning", [LOG_NOTICE] = "notice",
		[LOG_INFO] = "info", [LOG_DEBUG] = "debug",
	};

	return v >= 0 && v < (int)ELEMENTSOF(names) ? names[v] : NULL;
}

static const char *policy_name(int v) {
	return kvd_policy_to_string((enum kvd_policy)v);
}

/* recall-policy: 0 auto, else a policy + 1 (full is not one: it ranks nothing). */
static const char *recall_policy_name(int v) {
	if (v == 0)
		return "auto";
	return v - 1 == KVD_POLICY_FULL ? NULL : kvd_policy_to_string((enum kvd_policy)(v - 1));
}

static char *mfree_str(char *p) {
	free(p);
	return NULL;
}

/* Replaces the string in *dst with a copy of src. Returns 0 or -ENOMEM (*dst unchanged). */
static int strdup_to(char **dst, const char *src) {
	char *copy = strdup(src);

	if (!copy)
		return -ENOMEM;
	free(*dst);
	*dst = copy;
	return 0;
}

#define NODE(field) offsetof(struct settings, field)
#define TENANT(field) offsetof(struct settings_tenant, field)

/*
 * The node's settings, in --help's order. Each is a flag and, unless SETTING_FLAG_ONLY, a
 * key of [kvd]; SETTING_RUNTIME ones change on SIGHUP, the others need a restart (the pool,
 * the socket, and the tables sized at start).
 */
static const struct setting node_table[] = {
	{ "backend", SETTING_ENUM, 0, "NAME", "auto", NULL,
	  "memory backend: cuda (GPU memory, driver loaded at start), host (memfd chunks) or auto, "
	  "cuda when a GPU is usable and host otherwise, saying why", NODE(backend),
	  .enum_name = settings_backend_to_string, .enum_n = _SETTINGS_BACKEND_MAX },
	{ "devices", SETTING_STRING, 0, "LIST", "all", NULL,
	  "cuda: the GPUs to pool (all, or numbers in PCI bus order as nvidia-smi gives them, or "
	  "UUIDs: 0,1 or GPU-...), each with a pool of its own (pool-size each); unusable ones "
	  "are skipped, saying why", NODE(devices), 1,
	  1023, .check = backend_devices_check },
	{ "pool-percent", SETTING_U32, 0, "PERCENT", "0", NULL,
	  "cuda: size each GPU's pool as this percent of the free memory of the GPU with least "
	  "at start, whole chunks; 0: pool-size", NODE(pool_percent), 0, 100 },
	{ "socket", SETTING_STRING, 0, "PATH", KVD_DEFAULT_SOCKET, NULL,
	  "listening socket", NODE(socket), 1, 0 },
	{ "socket-group", SETTING_STRING, 0, "GROUP", "", "",
	  "group (name or number) that owns the socket kvd binds, mode 0660; empty: kvd's own "
	  "group", NODE(socket_group), 0, SETTINGS_LIST_NAME_MAX - 1 },
	{ "admin-group", SETTING_STRING, SETTING_RUNTIME, "GROUP", "kvd-admin", NULL,
	  "group (name or number) whose members may change the budget and tenants, besides root; "
	  "a group that does not exist leaves it to root", NODE(admin_group), 1,
	  SETTINGS_LIST_NAME_MAX - 1 },
	{ "admin-on-tenant-connections", SETTING_ENUM, SETTING_RUNTIME, "YES|NO", "yes", NULL,
	  "whether root and admin-group may change the budget and tenants from a connection that "
	  "acts for a tenant (an engine's); no: only from administrative connections (kvdctl's)",
	  NODE(admin_on_tenant_connections), .enum_name = settings_yes_no_to_string,
	  .enum_n = _SETTINGS_YES_NO_MAX },
	{ "tenant-create", SETTING_ENUM, SETTING_RUNTIME, "WHO", "any", NULL,
	  "who may act as a tenant the config file does not declare: any peer, admin (root and "
	  "admin-group) or none (root only); production configs should say none",
	  NODE(tenant_create), .enum_name = settings_tenant_create_to_string,
	  .enum_n = _SETTINGS_TENANT_CREATE_MAX },
	{ "pool-size", SETTING_SIZE, 0, "SIZE", "1GiB", NULL,
	  "pool capacity, whole chunks; with cuda, on each GPU", NODE(pool_size) },
	{ "chunk-size", SETTING_SIZE, 0, "SIZE", "4MiB", NULL,
	  "unit of allocation and sharing: at least 64KiB, a multiple of the backend's "
	  "granularity (the page size on host)", NODE(chunk_size) },
	{ "budget", SETTING_SIZE, SETTING_RUNTIME | SETTING_PERCENT, "SIZE|N%", NULL, "the pool size",
	  "node budget, at most the pool, or N% of the pool (of every GPU's together); kvdctl "
	  "budget set changes it live", NODE(budget) },
	{ "max-connections", SETTING_U32, SETTING_RUNTIME, "N", "256", NULL,
	  "client connections in total", NODE(max_connections), 1, UINT32_MAX },
	{ "max-connections-per-uid", SETTING_U32, SETTING_RUNTIME, "N", "64", NULL,
	  "client connections of one user (root included)", NODE(max_connections_per_uid), 1,
	  UINT32_MAX },
	{ "max-tenants", SETTING_U32, 0, "N", "64", NULL,
	  "tenants known at once", NODE(max_tenants), 1, UINT32_MAX },
	{ "max-tenants-per-uid", SETTING_U32, SETTING_RUNTIME, "N", "8", NULL,
	  "tenants one user (not root or admin-group) may bring into being by a hello as a tenant "
	  "the config file does not declare", NODE(max_tenants_per_uid), 1, UINT32_MAX },
	{ "max-models", SETTING_U32, 0, "N", "16", NULL,
	  "models per connection", NODE(max_models), 1, UINT32_MAX },
	{ "max-models-per-tenant", SETTING_U32, SETTING_RUNTIME, "N", "64", NULL,
	  "models registered by one tenant, all its connections together",
	  NODE(max_models_per_tenant), 1, UINT32_MAX },
	{ "max-outstanding", SETTING_U32, SETTING_RUNTIME, "N", "16", NULL,
	  "replies one connection may be waiting for at once: grows waiting for eviction, "
	  "eviction requests, output projections being computed", NODE(max_outstanding), 1, 1024 },
	{ "max-seqs", SETTING_U32, SETTING_RUNTIME, "N", "4096", NULL,
	  "open sequences per connection", NODE(max_seqs), 1, UINT32_MAX },
	{ "max-seqs-per-tenant", SETTING_U32, SETTING_RUNTIME, "N", "16384", NULL,
	  "open sequences of one tenant, all its connections together", NODE(max_seqs_per_tenant),
	  1, UINT32_MAX },
	{ "max-seqs-node", SETTING_U32, SETTING_RUNTIME, "N", "0", NULL,
	  "open sequences on the node, every tenant's together; 0: what vm.max_map_count leaves "
	  "(each maps 2 areas in kvd), so that kvd never reaches it", NODE(max_seqs_node), 0,
	  UINT32_MAX },
	{ "max-metadata-bytes", SETTING_SIZE, SETTING_RUNTIME, "SIZE", "0", NULL,
	  "memory the open sequences' metadata may take in kvd (descriptors, observation "
	  "buffers, smoothed costs); 0: a quarter of physical memory", NODE(max_metadata_bytes) },
	{ "max-seq-tokens", SETTING_U32, SETTING_RUNTIME, "N", "1048576", NULL,
	  "tokens one sequence may hold per (layer, kv head)", NODE(max_seq_tokens), 1, UINT32_MAX },
	{ "hello-timeout", SETTING_MS, SETTING_RUNTIME, "MS", "5000", NULL,
	  "time a new connection has to say hello, and a frame begun has to arrive in full",
	  NODE(hello_timeout_ms), 1, UINT32_MAX },
	{ "unmap-timeout", SETTING_MS, SETTING_RUNTIME, "MS", "5000", NULL,
	  "time a connection has to unmap a chunk the daemon takes back; past it, its grows are "
	  "refused; 0: wait forever", NODE(unmap_timeout_ms), 0, UINT32_MAX },
	{ "unmap-grace", SETTING_MS, SETTING_RUNTIME, "MS", "5000", NULL,
	  "time a connection past unmap-timeout has before it is disconnected; 0: at once",
	  NODE(unmap_grace_ms), 0, UINT32_MAX },
	{ "max-pinned-percent", SETTING_U32, SETTING_RUNTIME, "PERCENT", "100", NULL,
	  "of the budget one tenant may hold pinned (its pinned sequences' resident bytes); past "
	  "it a first pin, or a grow of a pinned sequence, is refused",
	  NODE(max_pinned_percent), 1, 100 },
	{ "max-cached-percent", SETTING_U32, SETTING_RUNTIME, "PERCENT", "25", NULL,
	  "of the budget one tenant's prefix cache may hold: blocks kept after their last "
	  "sequence for later prefix opens (0: none kept); past it its least recently used go",
	  NODE(max_cached_percent), 0, 100 },
	{ "pin-report", SETTING_MS, SETTING_RUNTIME, "MS", "600000", NULL,
	  "a sequence pinned this long is reported (a warning naming the holder, pins_overdue); "
	  "0: never", NODE(pin_report_ms), 0, UINT32_MAX },
	{ "pin-timeout", SETTING_MS, SETTING_RUNTIME, "MS", "0", NULL,
	  "a connection holding a pin this long is disconnected as a stuck holder, which drops "
	  "its pins; 0: never (long decodes and live Python views are not cut short)",
	  NODE(pin_timeout_ms), 0, UINT32_MAX },
	{ "tenant-forget", SETTING_MS, SETTING_RUNTIME, "MS", "300000", NULL,
	  "time a tenant that holds nothing (no connection, sequence or chunk, and no setting in "
	  "the config file or set live) stays known before it is forgotten; 0: never",
	  NODE(tenant_forget_ms), 0, UINT32_MAX },
	{ "high-watermark", SETTING_U32, SETTING_RUNTIME, "PERCENT", "95", NULL,
	  "use of the budget (and, with several GPUs, of each one's pool), in percent, above "
	  "which an eviction round starts",
	  NODE(high_watermark), 1, 100 },
	{ "low-watermark", SETTING_U32, SETTING_RUNTIME, "PERCENT", "85", NULL,
	  "use of the budget (or of the GPU's pool), in percent, that a round evicts down to",
	  NODE(low_watermark), 0,
	  100 },
	{ "grant-wait", SETTING_MS, SETTING_RUNTIME, "MS", "2000", NULL,
	  "how long a grow the budget cannot meet waits for an eviction round before it is "
	  "refused; 0: refuse at once", NODE(grant_wait_ms), 0, 60000 },
	{ "round-interval", SETTING_MS, SETTING_RUNTIME, "MS", "0", NULL,
	  "a round every MS even without memory pressure, to keep the smoothed costs fresh; "
	  "0: off", NODE(round_interval_ms), 0, UINT32_MAX },
	{ "round-threads", SETTING_U32, SETTING_RUNTIME, "N", "0", "the online CPUs",
	  "threads a round scores with", NODE(round_threads), 0, 1024 },
	{ "eviction-floor", SETTING_U32, SETTING_RUNTIME, "PERCENT", "10", NULL,
	  "share of a (sequence, layer)'s tokens a round never takes, so that no layer is emptied",
	  NODE(eviction_floor), 0, 100 },
	{ "max-observation-bytes", SETTING_SIZE, SETTING_RUNTIME, "SIZE", "64MiB", NULL,
	  "largest observation buffer of one sequence (layers x q heads x window x head dim)",
	  NODE(max_observation_bytes) },
	{ "host-tier-size", SETTING_SIZE, 0, "SIZE", "0", NULL,
	  "host memory kvd may keep sequences moved out of the pool in (tenants with tier = "
	  "host), outside the budget; 0: no host tier", NODE(host_tier_size) },
	{ "file-tier-size", SETTING_SIZE, 0, "SIZE", "0", NULL,
	  "disk space kvd may keep sequences in when the host tier is full (tenants with tier = "
	  "host+file), in a file of file-tier-dir; 0: no file tier", NODE(file_tier_size) },
	{ "file-tier-dir", SETTING_STRING, 0, "DIR", "/var/cache/kvd", NULL,
	  "where the file tier's file is (mode 0600, emptied at every start); under systemd the "
	  "unit's CacheDirectory", NODE(file_tier_dir), 1, PATH_MAX - 16 },
	{ "tier-max-percent", SETTING_U32, SETTING_RUNTIME, "PERCENT", "100", NULL,
	  "of the host tier, and of the file tier, one tenant's sequences may hold; a move past "
	  "it makes room from the tenant's own oldest first", NODE(tier_max_percent), 1, 100 },
	{ "tier-idle", SETTING_MS, SETTING_RUNTIME, "MS", "60000", NULL,
	  "a sequence of a tenant with tier = host that was not used for MS moves to the host "
	  "tier whole, and comes back at its next pin or grow; under memory pressure, those "
	  "unused for a second go before any token is evicted; 0: under pressure only",
	  NODE(tier_idle_ms), 0, UINT32_MAX },
	{ "recall-policy", SETTING_ENUM, SETTING_RUNTIME, "NAME", "auto", NULL,
	  "what a recall scores kept and resident tokens with against the new window "
	  "(docs/recall.md): auto is indexmem for a model with an indexer, else restkv; or any "
	  "eviction policy but full", NODE(recall_policy),
	  .enum_name = recall_policy_name, .enum_n = _KVD_POLICY_MAX + 1 },
	{ "poll-us", SETTING_U32, 0, "US", "50", NULL,
	  "how long the event loop keeps looking at the rings and sockets once idle, before it "
	  "sleeps; clients whose requests come within it make no system call; 0: sleep at once",
	  NODE(poll_us), 0, 1000000 },
	{ "ring-entries", SETTING_U32, 0, "N", "64", NULL,
	  "entries of each connection's submission and completion rings, a power of two from 2 "
	  "to 4096; 0: no rings, clients use the socket", NODE(ring_entries), 0, KVD_RING_ENTRIES_MAX },
	{ "ring-doorbell", SETTING_ENUM, 0, "KIND", "auto", NULL,
	  "how a client wakes the daemon asleep on its rings: futex (needs IORING_OP_FUTEX_WAIT, "
	  "Linux 6.7), eventfd, or auto, futex when the kernel has it", NODE(ring_doorbell),
	  .enum_name = ring_doorbell_to_string, .enum_n = _RING_BELL_MAX },
	{ "uring-setup", SETTING_ENUM, 0, "KIND", "auto", NULL,
	  "how the event loop sets up io_uring: auto (deferred task running where the kernel has "
	  "it, Linux 6.1), basic (without it, as on older kernels) or epoll (no io_uring, what "
	  "both fall back to where io_uring is not allowed)", NODE(uring_setup),
	  .enum_name = loop_setup_to_string, .enum_n = _LOOP_SETUP_MAX },
	{ "log-level", SETTING_ENUM, SETTING_RUNTIME, "LEVEL", "info", NULL,
	  "least important messages logged", NODE(log_level),
	  .enum_name = log_level_name, .enum_n = LOG_DEBUG + 1 },
	{ "restore-claim", SETTING_MS, 0, "MS", "30000", NULL,
	  "under a service manager with a file descriptor store, KV is kept across a crash: how "
	  "long the sequences kept wait for their tenant to claim them before they are freed; "
	  "0: keep nothing", NODE(restore_claim_ms), 0, 3600000 },
	{ "state-dir", SETTING_STRING, 0, "DIR", "/var/lib/kvd", NULL,
	  "where live changes (kvdctl budget set, tenant set) are kept across restarts",
	  NODE(state_dir), 1, PATH_MAX - 16 },
	{ "metrics-listen", SETTING_STRING, 0, "ADDR", "", "",
	  "Prometheus endpoint: 127.0.0.1:PORT, [::1]:PORT or unix:PATH; off by default",
	  NODE(metrics_listen), 0, 0, .check = http_address_check },
	{ "kv-events", SETTING_STRING, 0, "ADDR", "", "",
	  "publish KV events (blocks stored and removed) on this ZeroMQ PUB address, as vLLM "
	  "does: tcp://127.0.0.1:PORT or ipc://PATH; off by default",
	  NODE(kv_events), 0, 0 },
	{ "kv-events-replay", SETTING_STRING, 0, "ADDR", "", "",
	  "ZeroMQ ROUTER address where a subscriber asks for the event batches it missed",
	  NODE(kv_events_replay), 0, 0 },
	{ "kv-events-topic", SETTING_STRING, 0, "TOPIC", "", "",
	  "the topic (first frame) of every KV events message",
	  NODE(kv_events_topic), 0, 0 },
	{ "metrics-remote", SETTING_ENUM, 0, "YES|NO", "no", NULL,
	  "let metrics-listen be an address other machines reach: the endpoint has no "
	  "authentication and its metrics name every tenant",
	  NODE(metrics_remote), .enum_name = settings_yes_no_to_string, .enum_n = _SETTINGS_YES_NO_MAX },
	{ "config", SETTING_STRING, SETTING_FLAG_ONLY, "FILE", SETTINGS_DEFAULT_CONFIG, NULL,
	  "config file; a missing default one is fine, a missing named one is an error",
	  NODE(config), 1, PATH_MAX },
	{ "check-config", SETTING_STRING, SETTING_FLAG_ONLY | SETTING_OPTIONAL, "FILE", NULL, "",
	  "check the config file (FILE, or --config's) with the other flags, against the pool a "
	  "start would make on this machine, print every error with its file:line, and exit 0 "
	  "(good) or 2",
	  NODE(check_config), 0, PATH_MAX },
};

/* The keys of a [tenant NAME] section. */
static const struct setting tenant_table[] = {
	[SETTINGS_TENANT_MIN] = { "min", SETTING_SIZE, 0, "SIZE", "0", NULL,
	  "guaranteed share: eviction never takes the tenant below it", TENANT(min_bytes) },
	[SETTINGS_TENANT_MAX] = { "max", SETTING_SIZE, SETTING_NONE, "SIZE|none", "none", NULL,
	  "cap on the chunks the tenant holds", TENANT(max_bytes) },
	[SETTINGS_TENANT_WEIGHT] = { "weight", SETTING_U32, 0, "N", "1", NULL,
	  "scales the tenant's scores in eviction rounds, 1..10000",
	  TENANT(weight), 1, KVD_TENANT_WEIGHT_MAX },
	[SETTINGS_TENANT_POLICY] = { "policy", SETTING_ENUM, 0, "NAME", "kvd", NULL,
	  "eviction policy", TENANT(policy),
	  .enum_name = policy_name, .enum_n = _KVD_POLICY_MAX },
	[SETTINGS_TENANT_TIER] = { "tier", SETTING_ENUM, 0, "WHERE", "drop", NULL,
	  "what memory pressure does with the tenant's sequences: drop (evict tokens), host "
	  "(move idle sequences whole to the host tier first, host-tier-size) or host+file (and "
	  "from a full host tier to the file tier, file-tier-size)", TENANT(tier),
	  .enum_name = tier_mode_to_string, .enum_n = _TIER_MODE_MAX },
	[SETTINGS_TENANT_RECALL] = { "recall", SETTING_U32, 0, "N", "0", NULL,
	  "token recall: the tokens rounds evict from the tenant's sequences are kept in the host "
	  "tier, and a recall (kvd_seq_recall) brings back at most N per row of those its new "
	  "window needs, each for a resident one worth less; 0: off (docs/recall.md)",
	  TENANT(recall), 0, KVD_TENANT_RECALL_MAX },
	[SETTINGS_TENANT_ALLOW_USERS] = { "allow-users", SETTING_LIST, 0, "NAMES", NULL, "none",
	  "users (names or numbers) whose processes may act as the tenant, besides root; with "
	  "neither list, anyone who may connect; repeat the key to add names, an empty value "
	  "clears the list",
	  TENANT(allow_users) },
	[SETTINGS_TENANT_ALLOW_GROUPS] = { "allow-groups", SETTING_LIST, 0, "NAMES", NULL, "none",
	  "the same for groups: the peer's primary or supplementary groups", TENANT(allow_groups) },
};

_Static_assert(ELEMENTSOF(node_table) <= SETTINGS_MAX, "raise SETTINGS_MAX");
_Static_assert(ELEMENTSOF(tenant_table) == _SETTINGS_TENANT_KEY_MAX, "one entry per key");

const struct setting *settings_table(size_t *ret_n) {
	*ret_n = ELEMENTSOF(node_table);
	return node_table;
}

const struct setting *settings_tenant_table(size_t *ret_n) {
	*ret_n = ELEMENTSOF(tenant_table);
	return tenant_table;
}

static int table_index(const struct setting *table, size_t n, const char *name) {
	for (size_t i = 0; i < n; i++)
		if (strcmp(table[i].name, name) == 0)
			return (int)i;
	return -ENOENT;
}

int settings_index(const char *name) {
	return table_index(node_table, ELEMENTSOF(node_table), name);
}

#define FIELD(base, e, type) ((type *)((char *)(base) + (e)->offset))
#define CFIELD(base, e, type) ((const type *)((const char *)(base) + (e)->offset))

/* [A-Za-z0-9._-], not starting with '-': user and group names, and numeric ids. */
static bool list_name_valid(const char *s, size_t n) {
	if (n == 0 || n >= SETTINGS_LIST_NAME_MAX || s[0] == '-')
		return false;
	for (size_t i = 0; i < n; i++)
		if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') ||
		      (s[i] >= '0' && s[i] <= '9') || s[i] == '_' || s[i] == '.' || s[i] == '-'))
			return false;
	return true;
}

/* Adds the names of value (separated by blanks or commas) to the list in *list. */
static int list_append(char **list, const char *value, char *why, size_t why_n) {
	static const char seps[] = " \t,";
	size_t count = 0, len = *list ? strlen(*list) : 0;
	char *next;

	if (!*value) {
		/* An empty assignment clears the list, as in systemd's files. */
		*list = mfree_str(*list);
		return 0;
	}
	for (const char *p = *list; p && *p; p += strcspn(p, " "), p += strspn(p, " "))
		count++;
	next = malloc(len + strlen(value) + 2);
	if (!next)
		return -ENOMEM;
	memcpy(next, *list ? *list : "", len + 1);
	for (const char *p = value + strspn(value, seps); *p; p += strspn(p, seps)) {
		size_t n = strcspn(p, seps);

		if (!list_name_valid(p, n)) {
			snprintf(why, why_n, "'%.*s' is not a user or group name", (int)MIN(n, 64u), p);
			free(next);
			return -EINVAL;
		}
		if (++count > SETTINGS_LIST_MAX) {
			snprintf(why, why_n, "more than %d names", SETTINGS_LIST_MAX);
			free(next);
			return -EINVAL;
		}
		if (len > 0)
			next[len++] = ' ';
		memcpy(next + len, p, n);
		len += n;
		next[len] = '\0';
		p += n;
	}
	free(*list);
	*list = next;
	if (len == 0)
		*list = mfree_str(*list); /* only separators: still no names */
	return 0;
}

/* The names of an enum entry, "a, b, c", into buf. */
static void enum_names(const struct setting *e, char *buf, size_t n) {
	size_t k = 0;

	buf[0] = '\0';
	for (int v = 0; v < e->enum_n && k < n; v++)
		if (e->enum_name(v))
			k += (size_t)snprintf(buf + k, n - k, "%s%s", k ? ", " : "", e->enum_name(v));
}

/* Parses value into entry e of the struct at base. On error, why says what is wrong. */
static int parse_value(const struct setting *e, void *base, const char *value, char *why,
                       size_t why_n) {
	uint64_t max = e->max ? e->max : UINT64_MAX, v;
	const char *reason = NULL;
	size_t len;
	int r;

	switch (e->type) {
	case SETTING_SIZE:
		if ((e->flags & SETTING_NONE) && strcasecmp(value, "none") == 0)
			v = UINT64_MAX;
		else if ((e->flags & SETTING_PERCENT) && *value && value[strlen(value) - 1] == '%') {
			char digits[8] = "";
			size_t n = strlen(value) - 1;

			if (n < sizeof(digits))
				memcpy(digits, value, n);
			if (n == 0 || n >= sizeof(digits) || number_parse_u64(digits, 1, 100, &v) < 0) {
				snprintf(why, why_n, "'%s' is not a percent of the pool (1%% to 100%%)", value);
				return -EINVAL;
			}
			v |= SETTINGS_PERCENT;
		} else if (size_parse(value, &v) < 0) {
			snprintf(why, why_n, "'%s' is not a size (a number with an optional K, M, G or "
			         "T suffix%s)", value, e->flags & SETTING_NONE ? ", or none" :
			         e->flags & SETTING_PERCENT ? ", or a percent of the pool" : "");
			return -EINVAL;
		} else if (v < e->min || v > max) {
			snprintf(why, why_n, "%s is out of range", value);
			return -ERANGE;
		}
		*FIELD(base, e, uint64_t) = v;
		return 0;
	case SETTING_U32:
	case SETTING_MS:
		if (number_parse_u64(value, e->min, MIN(max, UINT32_MAX), &v) < 0) {
			snprintf(why, why_n, "'%s' is not a number in %" PRIu64 "..%" PRIu64, value,
			         e->min, MIN(max, UINT32_MAX));
			return -EINVAL;
		}
		if (e->type == SETTING_U32)
			*FIELD(base, e, uint32_t) = (uint32_t)v;
		else
			*FIELD(base, e, uint64_t) = v;
		return 0;
	case SETTING_STRING:
		len = strlen(value);
		if (len < e->min) {
			snprintf(why, why_n, "must not be empty");
			return -EINVAL;
		}
		if (e->max && len > e->max) {
			snprintf(why, why_n, "longer than %" PRIu64 " characters", e->max);
			return -EINVAL;
		}
		if (e->check && e->check(value, &reason) < 0) {
			snprintf(why, why_n, "'%s': %s", value, reason ? reason : "invalid");
			return -EINVAL;
		}
		r = strdup_to(FIELD(base, e, char *), value);
		if (r < 0)
			snprintf(why, why_n, "out of memory");
		return r;
	case SETTING_ENUM: {
		char names[256];

		for (int i = 0; i < e->enum_n; i++)
			if (e->enum_name(i) && strcmp(e->enum_name(i), value) == 0) {
				*FIELD(base, e, int) = i;
				return 0;
			}
		enum_names(e, names, sizeof(names));
		snprintf(why, why_n, "unknown %s '%s' (%s)", e->name, value, names);
		return -EINVAL;
	}
	case SETTING_LIST:
		r = list_append(FIELD(base, e, char *), value, why, why_n);
		if (r == -ENOMEM)
			snprintf(why, why_n, "out of memory");
		return r;
	default:
		snprintf(why, why_n, "bad table entry");
		return -EINVAL;
	}
}

static void free_strings(const struct setting *table, size_t n, void *base) {
	for (size_t i = 0; i < n; i++)
		if (table[i].type == SETTING_STRING || table[i].type == SETTING_LIST)
			*FIELD(base, &table[i], char *) = mfree_str(*FIELD(base, &table[i], char *));
}

/* Sets every entry of table to its default. */
static int init_defaults(const struct setting *table, size_t n, void *base) {
	char why[256];

	for (size_t i = 0; i < n; i++) {
		const struct setting *e = &table[i];

		if (e->def) {
			int r = parse_value(e, base, e->def, why, sizeof(why));

			if (r < 0)
				return r == -ENOMEM ? r : -EINVAL;
		} else if (e->type == SETTING_SIZE)
			*FIELD(base, e, uint64_t) = SETTINGS_UNSET;
	}
	return 0;
}

int settings_init(struct settings *s) {
	int r;

	*s = (struct settings){};
	r = init_defaults(node_table, ELEMENTSOF(node_table), s);
	if (r < 0)
		settings_done(s);
	return r;
}

static void tenant_done(struct settings_tenant *t) {
	free_strings(tenant_table, ELEMENTSOF(tenant_table), t);
}

void settings_done(struct settings *s) {
	free_strings(node_table, ELEMENTSOF(node_table), s);
	for (uint32_t i = 0; i < s->n_tenants; i++)
		tenant_done(&s->tenants[i]);
	free(s->tenants);
	free(s->path);
	*s = (struct settings){};
}

/* ---- the command line ---- */

static void help_wrap(FILE *f, const char *lead, const char *text) {
	int col = fprintf(f, "%s", lead);

	/* Leads too long for the column get their text on the next line. */
	if (col >= HELP_COLUMN - 1) {
		fputc('\n', f);
		col = 0;
	}
	for (const char *p = text; *p;) {
		size_t word = strcspn(p, " ");

		if (col <= HELP_COLUMN - 1) {
			col += fprintf(f, "%*s", HELP_COLUMN - col, "");
		} else if (col + 1 + (int)word > HELP_WIDTH) {
			col = fprintf(f, "\n%*s", HELP_COLUMN, "") - 1;
		} else {
			fputc(' ', f);
			col++;
		}
		col += fprintf(f, "%.*s", (int)word, p);
		p += word;
		p += strspn(p, " ");
	}
	fputc('\n', f);
}

/* The help text of e: its own, the names of an enum, and the default. */
static void help_entry(FILE *f, const struct setting *e, const char *lead) {
	char text[1024], names[256];
	size_t k = (size_t)snprintf(text, sizeof(text), "%s", e->help);

	if (e->type == SETTING_ENUM) {
		enum_names(e, names, sizeof(names));
		k += (size_t)snprintf(text + k, sizeof(text) - k, " (%s)", names);
	}
	if (k < sizeof(text) && (e->def_help ? *e->def_help : e->def != NULL))
		snprintf(text + k, sizeof(text) - k, " [%s]", e->def_help ? e->def_help : e->def);
	help_wrap(f, lead, text);
}

void settings_help(FILE *f) {
	char lead[64];

	fprintf(f, "Usage: kvd [OPTIONS]\n"
	        "\n"
	        "The kvd KV-cache daemon: owns a pool of KV memory and shares it with inference\n"
	        "processes through a Unix socket, within one node-wide budget.\n"
	        "\n");
	for (size_t i = 0; i < ELEMENTSOF(node_table); i++) {
		const struct setting *e = &node_table[i];

		snprintf(lead, sizeof(lead), "  --%s%s%s%s%s", e->name,
		         e->flags & SETTING_OPTIONAL ? "[=" : " ", e->metavar,
		         e->flags & SETTING_OPTIONAL ? "]" : "", e->flags & SETTING_RUNTIME ? " *" : "");
		help_entry(f, e, lead);
	}
	help_wrap(f, "  -h, --help", "show this help and exit");
	help_wrap(f, "  --version", "show the version and exit");
	fprintf(f, "\n"
	        "Config file (--config): INI, like systemd's. Every option but --config and\n"
	        "--check-config is also a key of its [kvd] section (pool-size = 8GiB); options\n"
	        "given here win over the file. Each tenant is a [tenant NAME] section, with:\n");
	for (size_t i = 0; i < ELEMENTSOF(tenant_table); i++) {
		snprintf(lead, sizeof(lead), "  %s = %s", tenant_table[i].name, tenant_table[i].metavar);
		help_entry(f, &tenant_table[i], lead);
	}
	fprintf(f, "\n"
	        "kvdctl budget set and tenant set change the budget and tenants live; those changes\n"
	        "are kept in STATE-DIR/state and win over the file until kvdctl resets them.\n"
	        "Precedence: options > live changes > config file > defaults.\n"
	        "SIGHUP reloads the file without dropping anyone: the budget, the tenants and the\n"
	        "options marked * change at once; a change to the others needs a restart.\n"
	        "\n"
	        "SIZE takes K, M, G, T suffixes (binary: KiB, MiB, GiB, TiB).\n"
	        "Exit status: 0 after a clean stop (SIGTERM, SIGINT) or a good --check-config;\n"
	        "1 when the pool, socket or event loop cannot be set up or fails; 2 for a bad\n"
	        "command line or config file.\n");
}

int settings_parse_argv(struct settings *flags, int argc, char *argv[]) {
	enum { ARG_HELP = 'h', ARG_VERSION = 0x100, ARG_FIRST };
	struct option options[ELEMENTSOF(node_table) + 3] = {};
	int c, check = settings_index("check-config");
	char why[512];
	size_t n = 0;

	for (size_t i = 0; i < ELEMENTSOF(node_table); i++)
		options[n++] = (struct option){
			node_table[i].name,
			node_table[i].flags & SETTING_OPTIONAL ? optional_argument : required_argument,
			NULL, ARG_FIRST + (int)i,
		};
	options[n++] = (struct option){ "help", no_argument, NULL, ARG_HELP };
	options[n++] = (struct option){ "version", no_argument, NULL, ARG_VERSION };
	/* From the start, also when called again (the unit tests do). */
	optind = 0;

	while ((c = getopt_long(argc, argv, "h", options, NULL)) >= 0) {
		const struct setting *e;
		int r;

		switch (c) {
		case ARG_HELP:
			settings_help(stdout);
			return 0;
		case ARG_VERSION:
			printf("kvd %s (protocol %d)\n", KVD_VERSION, KVD_PROTOCOL_VERSION_MAX);
			return 0;
		default:
			if (c < ARG_FIRST || c >= ARG_FIRST + (int)ELEMENTSOF(node_table)) {
				/* getopt_long said what. */
				fprintf(stderr, "Try 'kvd --help'.\n");
				return -EINVAL;
			}
			e = &node_table[c - ARG_FIRST];
			r = parse_value(e, flags, optarg ? optarg : "", why, sizeof(why));
			if (r < 0) {
				fprintf(stderr, "kvd: --%s: %s\nTry 'kvd --help'.\n", e->name, why);
				return r == -ENOMEM ? r : -EINVAL;
			}
			flags->source[c - ARG_FIRST] = SOURCE_FLAG;
		}
	}
	/* "--check-config FILE", as people type it: FILE is the one argument kvd takes. */
	if (flags->check_config && !*flags->check_config && optind < argc) {
		if (strdup_to(&flags->check_config, argv[optind++]) < 0)
			return -ENOMEM;
		flags->source[check] = SOURCE_FLAG;
	}
	if (optind < argc) {
		fprintf(stderr, "kvd: unexpected argument '%s'\nTry 'kvd --help'.\n", argv[optind]);
		return -EINVAL;
	}
	return 1;
}

/* ---- the config file ---- */

struct load {
	struct settings *s;
	int tenant;                   /* index of the current [tenant] section, -1 in [kvd] */
};

static int tenant_add(struct settings *s, const char *name, unsigned line, int *ret) {
	struct settings_tenant *t;
	int r;

	for (uint32_t i = 0; i < s->n_tenants; i++)
		if (strcmp(s->tenants[i].name, name) == 0) {
			*ret = (int)i;
			return 0;
		}
	/* The file's size bounds the count; max-tenants is checked once it is known. */
	t = realloc(s->tenants, (s->n_tenants + 1) * sizeof(*t));
	if (!t)
		return -ENOMEM;
	s->tenants = t;
	t = &s->tenants[s->n_tenants];
	*t = (struct settings_tenant){ .line = line };
	snprintf(t->name, sizeof(t->name), "%s", name);
	r = init_defaults(tenant_table, ELEMENTSOF(tenant_table), t);
	if (r < 0) {
		tenant_done(t);
		return r;
	}
	*ret = (int)s->n_tenants++;
	return 0;
}

static bool on_section(struct inifile_ctx *ctx, const char *name) {
	struct load *l = ctx->userdata;
	const char *tenant;
	int r;

	if (strcmp(name, "kvd") == 0) {
		l->tenant = -1;
		return true;
	}
	if (strncmp(name, "tenant", 6) != 0 || (name[6] != ' ' && name[6] != '\t')) {
		inifile_ctx_error(ctx, "unknown section [%s] (expected [kvd] or [tenant NAME])", name);
		return false;
	}
	tenant = name + 6 + strspn(name + 6, " \t");
	if (!tenant_name_valid(tenant)) {
		inifile_ctx_error(ctx, "invalid tenant name '%s' (1..%d of A-Z a-z 0-9 _ . -)", tenant,
		                  KVD_TENANT_NAME_MAX);
		return false;
	}
	r = tenant_add(l->s, tenant, ctx->line, &l->tenant);
	if (r < 0) {
		inifile_ctx_error(ctx, "out of memory");
		return false;
	}
	return true;
}

static void on_key(struct inifile_ctx *ctx, const char *section, const char *key,
                   const char *value) {
	struct load *l = ctx->userdata;
	const struct setting *table = l->tenant < 0 ? node_table : tenant_table;
	size_t n = l->tenant < 0 ? ELEMENTSOF(node_table) : ELEMENTSOF(tenant_table);
	void *base = l->tenant < 0 ? (void *)l->s : (void *)&l->s->tenants[l->tenant];
	char why[512];
	int i;

	if (!section) {
		inifile_ctx_error(ctx, "'%s' is outside a section: put it under [kvd]", key);
		return;
	}
	i = table_index(table, n, key);
	if (i < 0 || (table[i].flags & SETTING_FLAG_ONLY)) {
		inifile_ctx_error(ctx, "unknown key '%s' in [%s]", key, section);
		return;
	}
	if (parse_value(&table[i], base, value, why, sizeof(why)) < 0) {
		inifile_ctx_error(ctx, "%s: %s", key, why);
		return;
	}
	if (l->tenant < 0) {
		l->s->source[i] = SOURCE_CONFIG;
		l->s->line[i] = ctx->line;
	} else {
		l->s->tenants[l->tenant].source[i] = SOURCE_CONFIG;
		l->s->tenants[l->tenant].key_line[i] = ctx->line;
	}
}

static int copy_value(const struct setting *e, void *dst, const void *src) {
	switch (e->type) {
	case SETTING_SIZE:
	case SETTING_MS:
		*FIELD(dst, e, uint64_t) = *CFIELD(src, e, uint64_t);
		return 0;
	case SETTING_U32:
		*FIELD(dst, e, uint32_t) = *CFIELD(src, e, uint32_t);
		return 0;
	case SETTING_ENUM:
		*FIELD(dst, e, int) = *CFIELD(src, e, int);
		return 0;
	case SETTING_STRING:
	case SETTING_LIST:
		if (!*CFIELD(src, e, char *)) {
			*FIELD(dst, e, char *) = mfree_str(*FIELD(dst, e, char *));
			return 0;
		}
		return strdup_to(FIELD(dst, e, char *), *CFIELD(src, e, char *));
	default:
		return -EINVAL;
	}
}

int settings_load(struct settings *s, const struct settings *flags, const char *path,
                  struct inifile_errors *e) {
	static const struct inifile_ops ops = { .section = on_section, .key = on_key };
	int config = settings_index("config");
	struct load l = { .s = s, .tenant = -1 };
	unsigned before = inifile_errors_count(e);
	bool named = true;
	int r;

	if (!path && flags->check_config && *flags->check_config)
		path = flags->check_config;
	if (!path) {
		path = flags->config;
		named = flags->source[config] == SOURCE_FLAG;
	}
	r = inifile_parse(path, named, SETTINGS_FILE_MAX, &ops, &l, e);
	if (r == -ENOMEM)
		return r;
	if (r >= 0 && strdup_to(&s->path, path) < 0)
		return -ENOMEM;

	for (size_t i = 0; i < ELEMENTSOF(node_table); i++) {
		if (flags->source[i] != SOURCE_FLAG)
			continue;
		if (copy_value(&node_table[i], s, flags) < 0)
			return -ENOMEM;
		s->source[i] = SOURCE_FLAG;
		s->line[i] = 0;
	}
	/* Every error at once: the values that did parse are checked together too (one that
	 * did not keeps its default, so no error here names it). */
	settings_check(s, e);
	return inifile_errors_count(e) == before ? 0 : -EINVAL;
}

void settings_where(const struct settings *s, size_t i, char *buf, size_t n) {
	switch (s->source[i]) {
	case SOURCE_CONFIG:
		snprintf(buf, n, "%s:%u: %s", s->path ? s->path : "?", s->line[i], node_table[i].name);
		break;
	case SOURCE_FLAG:
		snprintf(buf, n, "--%s", node_table[i].name);
		break;
	default:
		snprintf(buf, n, "the default %s", node_table[i].name);
	}
}

/* An error about entry i: at its line when it comes from the file. */
/*
 * Reports that entry i's value is wrong (what), where it was set. When i is at its default
 * and the check is against entry other (>= 0) that was set, the error is where other was
 * set: that is the line to change (a high-watermark of 10 under the default low-watermark).
 */
_printf_(5, 6) static void check_error(const struct settings *s, struct inifile_errors *e,
                                       size_t i, int other, const char *fmt, ...) {
	char what[512];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(what, sizeof(what), fmt, ap);
	va_end(ap);
	if (s->source[i] == SOURCE_DEFAULT && other >= 0 && s->source[other] == SOURCE_CONFIG)
		inifile_error(e, s->path ? s->path : "?", s->line[other], "%s: the default %s %s",
		              node_table[other].name, node_table[i].name, what);
	else if (s->source[i] == SOURCE_DEFAULT && other >= 0 && s->source[other] == SOURCE_FLAG)
		inifile_error(e, "kvd", 0, "--%s: the default %s %s", node_table[other].name,
		              node_table[i].name, what);
	else if (s->source[i] == SOURCE_CONFIG)
		inifile_error(e, s->path ? s->path : "?", s->line[i], "%s %s", node_table[i].name, what);
	else if (s->source[i] == SOURCE_FLAG)
		inifile_error(e, "kvd", 0, "--%s %s", node_table[i].name, what);
	else
		inifile_error(e, "kvd", 0, "the default %s %s", node_table[i].name, what);
}

void settings_check(const struct settings *s, struct inifile_errors *e) {
	int chunk = settings_index("chunk-size"), pool = settings_index("pool-size");
	char b[32];

	if (s->chunk_size % 4096 != 0 || s->chunk_size < CHUNK_SIZE_MIN)
		check_error(s, e, chunk, -1, "must be at least 64KiB and a multiple of 4096 bytes");
	else if (s->pool_size < s->chunk_size)
		check_error(s, e, pool, chunk, "must hold at least one chunk (%s)",
		            size_format(s->chunk_size, b, sizeof(b)));
	else if (s->pool_size / s->chunk_size > UINT32_MAX)
		check_error(s, e, pool, chunk, "holds more than %" PRIu32 " chunks", UINT32_MAX);
	if (s->host_tier_size != 0 && s->host_tier_size < s->chunk_size)
		check_error(s, e, settings_index("host-tier-size"), chunk, "must be 0 or at least "
		            "chunk-size (%s): the tier holds whole chunks",
		            size_format(s->chunk_size, b, sizeof(b)));
	if (s->file_tier_size != 0 && s->file_tier_size < s->chunk_size)
		check_error(s, e, settings_index("file-tier-size"), chunk, "must be 0 or at least "
		            "chunk-size (%s): the tier holds whole chunks",
		            size_format(s->chunk_size, b, sizeof(b)));
	else if (s->file_tier_size != 0 && s->host_tier_size == 0)
		check_error(s, e, settings_index("file-tier-size"), settings_index("host-tier-size"),
		            "needs a host tier: sequences reach the file through it");
	if (s->low_watermark > s->high_watermark)
		check_error(s, e, settings_index("low-watermark"), settings_index("high-watermark"),
		            "must be at most high-watermark (%u)", s->high_watermark);
	if (s->ring_entries != 0 && !ring_entries_valid(s->ring_entries))
		check_error(s, e, settings_index("ring-entries"), -1, "must be 0 or a power of two from %u "
		            "to %u", KVD_RING_ENTRIES_MIN, KVD_RING_ENTRIES_MAX);
	if (s->pool_percent != 0 && s->backend == SETTINGS_BACKEND_HOST)
		check_error(s, e, settings_index("pool-percent"), settings_index("backend"),
		            "needs the cuda or auto backend");
	if (s->metrics_listen && *s->metrics_listen && s->metrics_remote != SETTINGS_YES) {
		struct http_address a;
		const char *why;

		/* The endpoint has no authentication and names every tenant: beyond this
		 * machine only when the operator says so. */
		if (http_address_parse(s->metrics_listen, &a, &why) == 0 && !a.local)
			check_error(s, e, settings_index("metrics-listen"), settings_index("metrics-remote"),
			            "is reachable from other machines: set metrics-remote = yes to serve "
			            "metrics there (no authentication; they name every tenant)");
	}

	for (uint32_t i = 0; i < s->n_tenants; i++) {
		const struct settings_tenant *t = &s->tenants[i];
		const char *path = s->path ? s->path : "?";

		if (i == s->max_tenants)
			inifile_error(e, path, t->line, "tenant %s: more tenants than max-tenants (%"
			              PRIu32 ")", t->name, s->max_tenants);
		if (t->min_bytes > t->max_bytes)
			inifile_error(e, path, t->key_line[SETTINGS_TENANT_MIN] ?: t->line,
			              "tenant %s: min above max", t->name);
		if (t->tier != TIER_DROP && s->host_tier_size == 0)
			inifile_error(e, path, t->key_line[SETTINGS_TENANT_TIER] ?: t->line,
			              "tenant %s: tier %s needs a host tier (host-tier-size)", t->name,
			              tier_mode_to_string(t->tier));
		else if (t->tier == TIER_HOST_FILE && s->file_tier_size == 0)
			inifile_error(e, path, t->key_line[SETTINGS_TENANT_TIER] ?: t->line,
			              "tenant %s: tier host+file needs a file tier (file-tier-size)", t->name);
		if (t->recall > 0 && s->host_tier_size == 0)
			inifile_error(e, path, t->key_line[SETTINGS_TENANT_RECALL] ?: t->line,
			              "tenant %s: recall needs a host tier (host-tier-size)", t->name);
	}
}

int settings_recall_policy(const struct settings *s) {
	return s->recall_policy - 1;
}

uint64_t settings_budget(const struct settings *s, uint64_t pool_bytes) {
	if (s->budget == SETTINGS_UNSET)
		return pool_bytes;
	if (s->budget & SETTINGS_PERCENT)
		return pool_bytes / 100 * (s->budget & ~SETTINGS_PERCENT) +
		       pool_bytes % 100 * (s->budget & ~SETTINGS_PERCENT) / 100;
	return s->budget;
}

void settings_check_pool(const struct settings *s, uint64_t granularity, uint64_t pool_bytes,
                         struct inifile_errors *e) {
	int chunk = settings_index("chunk-size"), budget = settings_index("budget");
	char b[32];

	size_format(pool_bytes, b, sizeof(b));
	if (granularity && s->chunk_size % granularity != 0)
		check_error(s, e, chunk, -1, "must be a multiple of the backend's granularity (%" PRIu64
		            " bytes)", granularity);
	if (s->budget != SETTINGS_UNSET && !(s->budget & SETTINGS_PERCENT) && s->budget > pool_bytes)
		check_error(s, e, budget, -1, "must be at most the pool (%s)", b);
	for (uint32_t i = 0; i < s->n_tenants; i++) {
		const struct settings_tenant *t = &s->tenants[i];

		if (t->min_bytes <= t->max_bytes && t->min_bytes > pool_bytes)
			inifile_error(e, s->path ? s->path : "?",
			              t->key_line[SETTINGS_TENANT_MIN] ?: t->line,
			              "tenant %s: min above the pool (%s)", t->name, b);
	}
}

/* ---- comparing and printing ---- */

bool settings_equal(const struct settings *a, const struct settings *b, size_t i) {
	const struct setting *e = &node_table[i];

	switch (e->type) {
	case SETTING_SIZE:
	case SETTING_MS:
		return *CFIELD(a, e, uint64_t) == *CFIELD(b, e, uint64_t);
	case SETTING_U32:
		return *CFIELD(a, e, uint32_t) == *CFIELD(b, e, uint32_t);
	case SETTING_ENUM:
		return *CFIELD(a, e, int) == *CFIELD(b, e, int);
	case SETTING_STRING:
	case SETTING_LIST: {
		const char *x = *CFIELD(a, e, char *), *y = *CFIELD(b, e, char *);

		return x == y || (x && y && strcmp(x, y) == 0);
	}
	default:
		return false;
	}
}

void settings_swap(struct settings *a, struct settings *b, size_t i) {
	const struct setting *e = &node_table[i];
	size_t n = e->type == SETTING_SIZE || e->type == SETTING_MS ? sizeof(uint64_t) :
	           e->type == SETTING_U32 ? sizeof(uint32_t) :
	           e->type == SETTING_ENUM ? sizeof(int) : sizeof(char *);
	char tmp[sizeof(uint64_t) > sizeof(char *) ? sizeof(uint64_t) : sizeof(char *)];
	uint8_t source = a->source[i];
	unsigned line = a->line[i];

	memcpy(tmp, FIELD(a, e, char), n);
	memcpy(FIELD(a, e, char), FIELD(b, e, char), n);
	memcpy(FIELD(b, e, char), tmp, n);
	a->source[i] = b->source[i];
	a->line[i] = b->line[i];
	b->source[i] = source;
	b->line[i] = line;
}

void settings_format(const struct settings *s, size_t i, char *buf, size_t n) {
	const struct setting *e = &node_table[i];
	const char *str;

	switch (e->type) {
	case SETTING_SIZE:
		if (*CFIELD(s, e, uint64_t) == SETTINGS_UNSET)
			snprintf(buf, n, "%s", e->def_help ? e->def_help : "none");
		else if ((e->flags & SETTING_PERCENT) && (*CFIELD(s, e, uint64_t) & SETTINGS_PERCENT))
			snprintf(buf, n, "%" PRIu64 "%%", *CFIELD(s, e, uint64_t) & ~SETTINGS_PERCENT);
		else
			size_format(*CFIELD(s, e, uint64_t), buf, n);
		break;
	case SETTING_MS:
		snprintf(buf, n, "%" PRIu64 " ms", *CFIELD(s, e, uint64_t));
		break;
	case SETTING_U32:
		snprintf(buf, n, "%" PRIu32, *CFIELD(s, e, uint32_t));
		break;
	case SETTING_ENUM:
		str = e->enum_name(*CFIELD(s, e, int));
		snprintf(buf, n, "%s", str ? str : "?");
		break;
	default:
		str = *CFIELD(s, e, char *);
		if (!str || !*str)
			str = e->def_help && *e->def_help ? e->def_help : "(none)";
		snprintf(buf, n, "%s", str);
	}
}

const struct settings_tenant *settings_tenant_find(const struct settings *s, const char *name) {
	for (uint32_t i = 0; i < s->n_tenants; i++)
		if (strcmp(s->tenants[i].name, name) == 0)
			return &s->tenants[i];
	return NULL;
}
