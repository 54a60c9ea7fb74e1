/* SPDX-License-Identifier: MIT */
/*
 * kvd-quality: the accuracy of every eviction policy on the kvd-lm tasks
 * (eval/kvd-lm/README.md, "Tasks"), with the KV cache in a kvd daemon that evicts it.
 *
 * One daemon per run, started here with a generated config file: one tenant per policy
 * (q-POLICY, policy = POLICY), one per compensated column (kvd+moments, kvd-mi+moments,
 * kvd+moments-mass, kvd+moments-bounded: tenants q-kvd.moments, ..., whose model keeps
 * MomentKV moments and whose engine adds them to attention, plainly, mass-corrected or with
 * the bounded mass; indexmem+latent, kvd+latent,
 * whose model keeps IndexMem's latent memory, read out through --indexmem's weights; the
 * indexmem columns' models also have an indexer: index keys in the pool, index queries in
 * the observation window), q-full for the reference sequences (its min is the whole
 * pool, so that no round ever takes from it), m-0.. for the multi-tenant scenario; chunks of
 * 64 KiB, no pressure rounds (high watermark 100, grants refused at once), no eviction floor
 * (a row may lose everything but its sinks, its window and its open tail block, which is
 * what the lower budgets need). Every eviction is a round the harness asks for with
 * kvd_evict(), so that each cell evicts exactly once, at a known point.
 *
 * A sample is BOS + context + question (its prompt's "\nQuestion: ...\nAnswer:" tail,
 * with the space of a number's answer).
 * Two settings:
 *   in-window       context and question prefilled, the last `window` queries (the end of
 *                   the question) published as the observation; evict; the first answer
 *                   token comes from the prefill's logits (full attention, as ReST-KV and
 *                   SnapKV evaluate), the rest is decoded over what the daemon left.
 *   query-agnostic  the context alone prefilled (the window holds its last tokens); evict;
 *                   then the question is prefilled and the answer decoded: the daemon
 *                   cannot know the question, as in a multi-tenant node.
 * The budget of a cell is a fraction of the context (BOS + context, the question left
 * out), ceil(fraction * context) tokens per (layer, kv head), sinks and window included,
 * the same in both settings; the round is asked for (resident - budget) slots' bytes, and
 * afterwards the resident tokens must be at most the budget or, where the protected slots
 * (sinks, window, open tail block) alone exceed it, those. The kept fraction reported is
 * what is resident after the round over what was before it.
 *
 * Shared prefill. The cells of a sample differ only after the eviction, so the prefill runs
 * once, into a "master" sequence of q-full, and each cell's sequence (in its policy's
 * tenant) is grown to the same length and given a byte copy of the master's K/V and of its
 * observation windows before the round. The engine computes the same bytes whatever cache
 * it writes to (forward.h), so this is the same as prefilling every cell, which --direct
 * does (slowly) to check it. The full-cache reference is the master itself decoding with
 * nothing evicted, and once more with the engine's private full cache: both must give the
 * same text (a mismatch fails the run).
 *
 * Multi-tenant (--multi): tenants m-0.. (policy --multi-policy) hold a query-agnostic
 * sample each, of different tasks and lengths, at once; the node's budget (the fraction of
 * all their contexts) is met either by one round ranked across all tenants (kvd_evict with
 * no tenant, on an administrative connection: the global ranking the daemon's pressure
 * rounds use) or by a static split, each tenant evicted alone down to budget / tenants.
 * Then every tenant answers its question.
 *
 * Seeds: sample i is seed KVD_TASK_SEED_REPORT_BEGIN + i (multi tenant j: + j * 65536),
 * the reporting range, never used for training or tuning.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cache.h"
#include "basic/macro.h"
#include "basic/number.h"
#include "forward.h"
#include "kvd/kvd.h"
#include "kvdlm-indexmem.h"
#include "model.h"
#include "policy.h"
#include "tasks.h"
#include "cli.h"

#define PROG "kvd-quality"
/* The subword model, whose figures transfer best; kvd-lm-small, byte-level, is the tests'. */
#define MODEL_DEFAULT "eval/kvd-lm/models/kvd-lm-base.kvdlm"
/* --indexmem's default: the model's path with .kvdim for .kvdlm, where train-indexmem.py
 * puts it (kvd-lm-small has one; kvd-lm-base not yet). */
#define INDEXMEM_SUFFIX ".kvdim"
#define HAYSTACK_DEFAULT "eval/kvd-lm/data/haystack.txt"
#define OUT_DEFAULT "quality"
#define SAMPLES_DEFAULT 20u
#define SAMPLES_MAX 65536u
#define QUICK_SAMPLES 6u
#define LIST_MAX 8
#define MULTI_MAX 4
#define GEN_MAX KVD_TASK_GENERATE_MAX
/* The most text GEN_MAX tokens make: no token is longer than a piece. */
#define GEN_TEXT_MAX (GEN_MAX * KVDLM_PIECE_MAX)
/* Room past prompt + answer in every sequence. */
#define SEQ_SLACK KVDLM_KVD_BLOCK_TOKENS
#define CHUNK_BYTES (64ull << 10)
/* New chunks one grow may need, under libkvd's 253. */
#define GROW_CHUNKS_MAX 200u
#define DAEMON_START_MS 10000u
#define SEED_TENANT_STRIDE 65536u
/* What the report calls a clear margin, in accuracy points. */
#define MARGIN_POINTS 10.0

enum setting {
	SETTING_IN_WINDOW,
	SETTING_AGNOSTIC,
	_SETTING_MAX,
};

static const char *const setting_names[_SETTING_MAX] = {
	[SETTING_IN_WINDOW] = "in-window",
	[SETTING_AGNOSTIC] = "query-agnostic",
};

static const char *arg_model = MODEL_DEFAULT;
static const char *arg_indexmem;
static const char *arg_haystack;
static const char *arg_kvd;
static const char *arg_out = OUT_DEFAULT;
static uint32_t arg_samples = SAMPLES_DEFAULT;
/* The tasks the shipped model does with a full cache (eval/kvd-lm/README.md, "Training":
 * niah and multikey 88-100% at 1k-4k tokens; multivalue, vt and cwe 0-2%). */
static enum kvd_task arg_tasks[_KVD_TASK_MAX] = { KVD_TASK_NIAH, KVD_TASK_MULTIKEY };
static unsigned arg_n_tasks = 2;
static uint32_t arg_lengths[LIST_MAX] = { 1024, 2048, 4096 };
static unsigned arg_n_lengths = 3;
static uint32_t arg_budgets[LIST_MAX] = { 5, 10, 20, 50 };
static unsigned arg_n_budgets = 4;
static bool arg_settings[_SETTING_MAX] = { true, true };
/* The compensated columns, after the policies' (written POLICY+COMPENSATION):
 * a policy's tenant with moments, and the form the engine adds them in. */
enum {
	VARIANT_KVD_MOMENTS,
	VARIANT_KVD_MI_MOMENTS,
	VARIANT_KVD_MOMENTS_MASS,
	VARIANT_KVD_MOMENTS_BOUNDED,
	VARIANT_INDEXMEM_LATENT,
	VARIANT_KVD_LATENT,
	VARIANT_KVD_RECALL,
	VARIANT_INDEXMEM_RECALL,
	_VARIANT_MAX,
};

#define COLS (_KVD_POLICY_MAX + _VARIANT_MAX)

static const struct {
	enum kvd_policy policy;
	enum kvd_moments_form form;
	const char *name, *tenant; /* '+' is not a tenant name's */
	uint32_t compensation;
	bool recall;               /* its tenant has recall on (docs/recall.md) */
} variants[_VARIANT_MAX] = {
	[VARIANT_KVD_MOMENTS] = { KVD_POLICY_KVD, KVD_MOMENTS_PLAIN, "kvd+moments", "q-kvd.moments",
		                  KVD_COMPENSATION_MOMENTS },
	[VARIANT_KVD_MI_MOMENTS] = { KVD_POLICY_KVD_MI, KVD_MOMENTS_PLAIN, "kvd-mi+moments",
		                     "q-kvd-mi.moments", KVD_COMPENSATION_MOMENTS },
	[VARIANT_KVD_MOMENTS_MASS] = { KVD_POLICY_KVD, KVD_MOMENTS_MASS, "kvd+moments-mass",
		                       "q-kvd.moments-mass", KVD_COMPENSATION_MOMENTS },
	[VARIANT_KVD_MOMENTS_BOUNDED] = { KVD_POLICY_KVD, KVD_MOMENTS_BOUNDED, "kvd+moments-bounded",
		                          "q-kvd.moments-bounded", KVD_COMPENSATION_MOMENTS },
	[VARIANT_INDEXMEM_LATENT] = { KVD_POLICY_INDEXMEM, KVD_MOMENTS_PLAIN, "indexmem+latent",
		                      "q-indexmem.latent", KVD_COMPENSATION_LATENT },
	[VARIANT_KVD_LATENT] = { KVD_POLICY_KVD, KVD_MOMENTS_PLAIN, "kvd+latent", "q-kvd.latent",
		                 KVD_COMPENSATION_LATENT },
	[VARIANT_KVD_RECALL] = { KVD_POLICY_KVD, KVD_MOMENTS_PLAIN, "kvd+recall", "q-kvd.recall",
		                 KVD_COMPENSATION_NONE, true },
	[VARIANT_INDEXMEM_RECALL] = { KVD_POLICY_INDEXMEM, KVD_MOMENTS_PLAIN, "indexmem+recall",
		                      "q-indexmem.recall", KVD_COMPENSATION_NONE, true },
};

/* Whether column p's tenant has recall on. */
static bool col_recall(int p) {
	return p >= _KVD_POLICY_MAX && variants[p - _KVD_POLICY_MAX].recall;
}

/* A column's name in every table, and the policy its tenant ranks with. */
static const char *col_name(int p) {
	return p < _KVD_POLICY_MAX ? kvd_policy_to_string(p) : variants[p - _KVD_POLICY_MAX].name;
}

static enum kvd_policy col_policy(int p) {
	return p < _KVD_POLICY_MAX ? (enum kvd_policy)p : variants[p - _KVD_POLICY_MAX].policy;
}

static bool arg_policies[COLS];
/* --policies given: its columns run or the command fails; the default (all) leaves out
 * the columns a model has no IndexMem weights for. */
static bool arg_policies_given;
static uint32_t arg_threads;
static uint32_t arg_window = KVD_WINDOW_DEFAULT;
/* Recall columns: token slots per (layer, kv head) a recall may bring back (kvd.conf(5),
 * recall). */
#define RECALL_TOKENS_DEFAULT 256
#define RECALL_TOKENS_MAX (1u << 20)     /* the daemon's bound (kvd.conf(5), recall) */
static uint32_t arg_recall_tokens = RECALL_TOKENS_DEFAULT;
static bool arg_multi, arg_direct, arg_quick, arg_keep;
static struct {
	enum kvd_task task;
	uint32_t length;
} arg_multi_tenants[MULTI_MAX] = {
	{ KVD_TASK_NIAH, 1024 },
	{ KVD_TASK_MULTIKEY, 2048 },
	{ KVD_TASK_MULTIKEY, 4096 },
};
static unsigned arg_n_multi = 3;
static enum kvd_policy arg_multi_policy = KVD_POLICY_KVD;

/* ---- results ---- */

struct cell {
	uint32_t samples, correct, violations, rounds;
	double kept, round_ms;
	/* Recall columns: the largest resident share of the context at any step (after the
	 * round, after the recall), token slots brought back, the recalls' time. */
	double max_kept, recall_ms;
	uint64_t recalled;
	uint64_t decode_steps;
	double decode_ms;
};

struct full_cell {
	uint32_t samples, correct;
};

struct tenant {
	char name[64];
	enum kvd_policy policy;
	uint32_t compensation;        /* KVD_COMPENSATION_* of its model */
	enum kvd_moments_form form;   /* with moments: how its engine adds them */
	bool indexed;                 /* its model has an indexer (policy indexmem; q-full) */
	bool recall;                  /* recall on: a new window asks for what it needs back */
	kvd_client *client;
	struct kvdlm_kvd_model km;
};

struct daemon {
	pid_t pid;
	char dir[64];
	char socket[128];
	char config[128];
	char state[128];
	char log[PATH_MAX];
};

struct quality {
	struct kvdlm_model *m;
	struct kvdlm_indexmem *im;          /* --indexmem, when a column needs it */
	char *indexmem_path;                /* its default, made from --model's */
	struct kvdlm_tokenizer *tok;
	struct kvd_haystack *hay;
	struct kvdlm_session *s;
	struct daemon d;
	kvd_client *admin;
	struct tenant ref;                  /* q-full: masters and the daemon's full-cache runs */
	struct tenant pol[COLS];            /* q-POLICY, then the compensated columns' */
	struct tenant multi[MULTI_MAX];     /* m-0 .. */
	uint32_t tables, vocab;
	uint64_t slot_bytes;                /* K and V of one token of one table */
	uint64_t index_bytes;               /* its index key, in tenants with an indexer */
	size_t obs_floats;                  /* one layer's observation window */
	size_t iobs_floats;                 /* its index queries (0 without --indexmem's) */
	float *logits, *master_logits;
	FILE *samples_csv;
	/* [setting][task][length][policy][budget] */
	struct cell *cells;
	/* [task][length] */
	struct full_cell *full;
	/* multi: [mode][budget][tenant], and the full cache per tenant */
	struct cell multi_cells[2][LIST_MAX][MULTI_MAX];
	struct full_cell multi_full[MULTI_MAX];
	uint64_t checked, mismatched, violations;
	double t_start;
	uint64_t done_samples, total_samples;
};

struct sample {
	struct kvd_task_sample ts;
	enum kvd_task task;
	uint64_t seed;
	uint32_t length;
	uint32_t *tokens; /* BOS + prompt */
	uint32_t n_ctx;   /* BOS + context */
	uint32_t n_q;     /* the question's tail */
};

/* A prefilled sequence of q-full and what its engine published last. */
struct master {
	struct kvdlm_cache *cache;
	float *obs;       /* [layers][obs_floats] */
	uint32_t n;
};

/* Set by SIGINT and SIGTERM: finish the sample, then report what ran. */
static volatile sig_atomic_t stop_requested;

static void on_stop(int sig) {
	stop_requested = 1;
}

static _printf_(1, 2) int fail(const char *fmt, ...) {
	va_list ap;

	fputs(PROG ": ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	return -EIO;
}

#define usage_error(...) cli_usage_error(PROG, __VA_ARGS__)

static double now_s(void) {
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const char *client_error(kvd_client *c, int r) {
	const char *msg = c ? kvd_client_last_error(c) : "";

	return msg && *msg ? msg : strerror(-r);
}

static size_t cell_index(unsigned setting, unsigned ti, unsigned li, unsigned p, unsigned bi) {
	return ((((size_t)setting * arg_n_tasks + ti) * arg_n_lengths + li) * COLS + p) *
	               arg_n_budgets + bi;
}

/* ceil(percent% of n) */
static uint32_t budget_tokens(uint32_t percent, uint32_t n) {
	return (uint32_t)(((uint64_t)n * percent + 99) / 100);
}

/* ---- the daemon ---- */

/* A child that dies with us. */
static pid_t fork_child(void) {
	pid_t parent = getpid(), pid = fork();

	if (pid == 0 && (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != parent))
		_exit(1);
	return pid;
}

/* --kvd, $KVD_DAEMON, the kvd of the build tree next to this kvd-quality, or kvd from PATH. */
static void find_kvd(char *buf, size_t n) {
	const char *env = getenv("KVD_DAEMON");
	char exe[PATH_MAX];
	ssize_t k;

	if (arg_kvd) {
		snprintf(buf, n, "%s", arg_kvd);
		return;
	}
	if (env && *env) {
		snprintf(buf, n, "%s", env);
		return;
	}
	k = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	if (k > 0) {
		char *slash;

		exe[k] = 0;
		slash = strrchr(exe, '/');
		if (slash) {
			*slash = 0;
			/* build/eval/quality/kvd-quality -> build/daemon/kvd */
			if ((size_t)snprintf(buf, n, "%s/../../daemon/kvd", exe) < n && access(buf, X_OK) == 0)
				return;
		}
	}
	snprintf(buf, n, "kvd");
}

static void daemon_stop(struct daemon *d) {
	char path[192];

	if (d->pid > 0) {
		int status;

		kill(d->pid, SIGTERM);
		if (waitpid(d->pid, &status, 0) == d->pid &&
		    !(WIFEXITED(status) && WEXITSTATUS(status) == 0))
			fprintf(stderr, PROG ": kvd exited with status %d (log: %s)\n",
			        WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), d->log);
		d->pid = 0;
	}
	if (!d->dir[0])
		return;
	if (arg_keep) {
		fprintf(stderr, PROG ": kept %s\n", d->dir);
		return;
	}
	unlink(d->socket);
	unlink(d->config);
	snprintf(path, sizeof(path), "%s/state", d->state);
	unlink(path);
	rmdir(d->state);
	rmdir(d->dir);
	d->dir[0] = 0;
}

/* The pool: every sequence that may be open at once, twice over, plus a few chunks per
 * tenant; at least 64 MiB. */
static uint64_t pool_bytes(const struct quality *Q, uint64_t chunk) {
	uint32_t lmax = 0, seqs = 2;
	uint64_t per_token = (Q->slot_bytes + Q->index_bytes) * Q->tables, bytes;

	for (unsigned i = 0; i < arg_n_lengths; i++)
		lmax = MAX(lmax, arg_lengths[i]);
	if (arg_multi) {
		for (unsigned j = 0; j < arg_n_multi; j++)
			lmax = MAX(lmax, arg_multi_tenants[j].length);
		seqs = MAX(seqs, 2u * arg_n_multi);
	}
	bytes = per_token * (lmax + GEN_MAX + SEQ_SLACK + KVDLM_KVD_BLOCK_TOKENS) * seqs * 2 +
	        (uint64_t)(COLS + MULTI_MAX + 4) * 4 * chunk;
	bytes = MAX(bytes, 64ull << 20);
	return ALIGN_TO(bytes, MAX(chunk, 1ull << 20));
}

/* The host tier recall columns need: a sequence of the longest length, twice over; 0 when
 * none runs. */
static uint64_t recall_tier_bytes(const struct quality *Q, uint64_t chunk) {
	uint64_t per_token = (Q->slot_bytes + Q->index_bytes) * Q->tables;
	uint32_t lmax = 0;
	bool any = false;

	for (int p = 0; p < COLS; p++)
		any |= arg_policies[p] && col_recall(p);
	if (!any)
		return 0;
	for (unsigned i = 0; i < arg_n_lengths; i++)
		lmax = MAX(lmax, arg_lengths[i]);
	return ALIGN_TO(2 * per_token * (lmax + GEN_MAX + SEQ_SLACK), chunk);
}

static int write_config(const struct quality *Q, const char *path, uint64_t pool, uint64_t chunk,
                        uint64_t tier) {
	FILE *f = fopen(path, "we");
	int r;

	if (!f)
		return fail("%s: %s", path, strerror(errno));
	fprintf(f,
	        "# Written by kvd-quality: no pressure rounds, no floor; every round is\n"
	        "# asked for.\n"
	        "[kvd]\n"
	        "pool-size = %" PRIu64 "\n"
	        "chunk-size = %" PRIu64 "\n"
	        "high-watermark = 100\n"
	        "low-watermark = 100\n"
	        "grant-wait = 0\n"
	        "round-interval = 0\n"
	        "eviction-floor = 0\n"
	        "log-level = warning\n"
	        "tenant-create = any\n"
	        "admin-group = %u\n",
	        pool, chunk, (unsigned)getgid());
	/* Room in the host tier for what a recall column's cell evicts (one at a time). */
	if (tier > 0)
		fprintf(f, "host-tier-size = %" PRIu64 "\n", tier);
	fprintf(f,
	        "\n"
	        "# The masters: never evicted.\n"
	        "[tenant q-full]\n"
	        "policy = full\n"
	        "min = %" PRIu64 "\n",
	        pool);
	for (int p = 0; p < COLS; p++) {
		if (p == KVD_POLICY_FULL)
			continue;
		fprintf(f, "\n[tenant %s]\npolicy = %s\n", Q->pol[p].name,
		        kvd_policy_to_string(col_policy(p)));
		/* A recall column: what rounds evict waits in the host tier for the question. */
		if (col_recall(p))
			fprintf(f, "recall = %u\n", arg_recall_tokens);
	}
	for (unsigned j = 0; arg_multi && j < arg_n_multi; j++)
		fprintf(f, "\n[tenant %s]\npolicy = %s\n", Q->multi[j].name,
		        kvd_policy_to_string(arg_multi_policy));
	r = ferror(f) ? -EIO : 0;
	if (fclose(f) != 0 || r < 0)
		return fail("%s: write error", path);
	return 0;
}

static int daemon_start(struct quality *Q) {
	struct daemon *d = &Q->d;
	char kvd[PATH_MAX];
	uint64_t chunk = CHUNK_BYTES, block, pool;
	int r, logfd;

	block = KVDLM_KVD_BLOCK_TOKENS * (Q->slot_bytes + Q->index_bytes);
	while (chunk < block)
		chunk *= 2;
	pool = pool_bytes(Q, chunk);
	find_kvd(kvd, sizeof(kvd));
	snprintf(d->dir, sizeof(d->dir), "/tmp/kvd-quality-XXXXXX");
	if (!mkdtemp(d->dir)) {
		d->dir[0] = 0;
		return fail("mkdtemp: %s", strerror(errno));
	}
	snprintf(d->socket, sizeof(d->socket), "%s/kvd.sock", d->dir);
	snprintf(d->config, sizeof(d->config), "%s/kvd.conf", d->dir);
	snprintf(d->state, sizeof(d->state), "%s/state", d->dir);
	snprintf(d->log, sizeof(d->log), "%s/kvd.log", arg_out);
	r = write_config(Q, d->config, pool, chunk, recall_tier_bytes(Q, chunk));
	if (r < 0)
		return r;
	logfd = open(d->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (logfd < 0)
		return fail("%s: %s", d->log, strerror(errno));
	d->pid = fork_child();
	if (d->pid < 0) {
		close(logfd);
		d->pid = 0;
		return fail("fork: %s", strerror(errno));
	}
	if (d->pid == 0) {
		/* The host backend even on a GPU machine: the engine is a CPU one, and
		 * rounds run on host pools only. */
		const char *argv[] = { kvd, "--backend=host", "--config", d->config, "--socket", d->socket,
			               "--state-dir", d->state, NULL };

		dup2(logfd, STDERR_FILENO);
		if (strchr(kvd, '/'))
			execv(kvd, (char **)argv);
		else
			execvp(kvd, (char **)argv);
		fprintf(stderr, PROG ": cannot run %s: %s\n", kvd, strerror(errno));
		_exit(127);
	}
	close(logfd);
	for (unsigned ms = 0; ms < DAEMON_START_MS; ms += 10) {
		int status;

		if (kvd_client_connect(d->socket, NULL, &Q->admin) >= 0) {
			fprintf(stderr, PROG ": %s on %s (pool %" PRIu64 " MiB, chunks %" PRIu64
			        " KiB; log %s)\n", kvd, d->socket, pool >> 20, chunk >> 10, d->log);
			return 0;
		}
		if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
			d->pid = 0;
			return fail("%s exited with status %d (see --kvd, and %s)", kvd,
			            WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), d->log);
		}
		usleep(10000);
	}
	return fail("%s did not answer on %s", kvd, d->socket);
}

/* What the daemon counts for one evicted token of one table of t: its K, V and index key. */
static uint64_t unit_bytes(const struct quality *Q, const struct tenant *t) {
	return Q->slot_bytes + (t->indexed ? Q->index_bytes : 0);
}

static int tenant_connect(struct quality *Q, struct tenant *t) {
	int r;

	r = kvd_client_connect(Q->d.socket, t->name, &t->client);
	if (r < 0)
		return fail("connecting as %s: %s", t->name, strerror(-r));
	r = kvdlm_kvd_register_indexed(t->client, Q->m, "kvd-lm", KVD_UNIT_HEAD_TOKEN, arg_window,
	                               t->compensation,
	                               t->indexed ? &(kvd_index_spec){ Q->im->index_heads, Q->im->index_dim }
	                                          : NULL,
	                               &t->km);
	if (r < 0)
		return fail("registering the model for %s: %s", t->name, client_error(t->client, r));
	t->km.form = t->form;
	return 0;
}

/* ---- samples ---- */

static void sample_done(struct sample *s) {
	kvd_task_sample_done(&s->ts);
	free(s->tokens);
	*s = (struct sample){};
}

static int sample_make(struct quality *Q, enum kvd_task task, uint64_t seed, uint32_t length,
                       struct sample *ret) {
	struct sample s = { .task = task, .seed = seed, .length = length };
	size_t nc;
	int r;

	r = kvd_task_make(Q->hay, task, seed, length, &s.ts);
	if (r < 0)
		return fail("%s at %u tokens, seed %" PRIu64 ": %s", kvd_task_to_string(task), length,
		            seed, strerror(-r));
	s.tokens = malloc((s.ts.prompt_size + 1) * sizeof(uint32_t));
	if (!s.tokens) {
		sample_done(&s);
		return -ENOMEM;
	}
	/* The question's tail starts with a newline, which starts a piece: the context and the
	 * tail tokenize apart as the whole prompt does. */
	nc = s.ts.context_size;
	s.tokens[0] = KVDLM_BOS;
	s.n_ctx = 1 + (uint32_t)kvdlm_tokenizer_encode(Q->tok, s.ts.prompt, nc, s.tokens + 1);
	s.n_q = (uint32_t)kvdlm_tokenizer_encode(Q->tok, s.ts.prompt + nc, s.ts.prompt_size - nc,
	                                         s.tokens + s.n_ctx);
	if (s.n_ctx + s.n_q != length) {
		sample_done(&s);
		return fail("%s seed %" PRIu64 ": %u tokens, not %u", kvd_task_to_string(task), seed,
		            s.n_ctx + s.n_q, length);
	}
	*ret = s;
	return 0;
}

static uint32_t sample_max_tokens(const struct sample *s) {
	return s->n_ctx + s->n_q + GEN_MAX + SEQ_SLACK;
}

/* ---- sequences ---- */

/* Tokens resident in s, summed over its tables, and its next position. */
static int seq_resident(kvd_seq *s, uint64_t *ret_resident, uint32_t *ret_positions) {
	const struct kvd_seq_desc *d;
	const uint32_t *tokens;
	uint64_t sum = 0;
	int r;

	r = kvd_seq_pin(s);
	if (r < 0)
		return r;
	d = kvd_seq_descriptor(s);
	tokens = (const uint32_t *)((const char *)d + d->tokens_offset);
	for (uint32_t t = 0; t < d->n_tables; t++)
		sum += tokens[t];
	*ret_resident = sum;
	*ret_positions = d->next_position;
	return kvd_seq_unpin(s);
}

/* Copies what the engine published last (every layer's window) out of the master. */
static int master_snapshot(struct quality *Q, struct master *ms) {
	kvd_seq *seq = kvdlm_cache_seq(ms->cache);

	for (uint32_t l = 0; l < Q->m->cfg.layers; l++) {
		void *q;
		int r;

		r = kvd_seq_observation(seq, l, &q);
		if (r < 0)
			return r;
		memcpy(ms->obs + l * (Q->obs_floats + Q->iobs_floats), q, Q->obs_floats * sizeof(float));
		if (Q->iobs_floats) {
			r = kvd_seq_index_observation(seq, l, &q);
			if (r < 0)
				return r;
			memcpy(ms->obs + l * (Q->obs_floats + Q->iobs_floats) + Q->obs_floats, q,
			       Q->iobs_floats * sizeof(float));
		}
		/* kvd_seq_observation() withdrew it: the same window, stamped again. */
		r = kvd_seq_observe(seq, l);
		if (r < 0)
			return r;
	}
	ms->n = kvdlm_cache_position(ms->cache);
	return 0;
}

/*
 * Makes the empty sequence dst what the master is: grown to its length, every block's K/V
 * copied, its observation windows published at the same position. Both are pinned while
 * the bytes move.
 */
static int seq_copy(struct quality *Q, kvd_seq *dst, const struct master *ms) {
	kvd_seq *src = kvdlm_cache_seq(ms->cache);
	const struct kvd_seq_desc *ds, *dd;
	const uint32_t *ts, *td;
	uint64_t step_tokens;
	int r, k;

	/* Grow in steps that map at most GROW_CHUNKS_MAX new chunks. */
	step_tokens = GROW_CHUNKS_MAX * kvd_client_chunk_bytes(Q->ref.client) / ((Q->slot_bytes + Q->index_bytes) * Q->tables);
	step_tokens = MAX(step_tokens / KVDLM_KVD_BLOCK_TOKENS * KVDLM_KVD_BLOCK_TOKENS,
	                  (uint64_t)KVDLM_KVD_BLOCK_TOKENS);
	for (uint32_t done = 0; done < ms->n;) {
		uint32_t n = (uint32_t)MIN((uint64_t)(ms->n - done), step_tokens);

		r = kvd_seq_grow(dst, n);
		if (r < 0)
			return r;
		done += n;
	}
	r = kvd_seq_pin(src);
	if (r < 0)
		return r;
	r = kvd_seq_pin(dst);
	if (r < 0) {
		(void)kvd_seq_unpin(src);
		return r;
	}
	ds = kvd_seq_descriptor(src);
	dd = kvd_seq_descriptor(dst);
	ts = (const uint32_t *)((const char *)ds + ds->tokens_offset);
	td = (const uint32_t *)((const char *)dd + dd->tokens_offset);
	/* The master has an indexer whenever a column does: a cell without one takes the K/V
	 * that start every block and leaves the index keys. */
	if (ds->next_position != ms->n || dd->next_position != ms->n || dd->n_tables != ds->n_tables ||
	    (dd->block_bytes != ds->block_bytes &&
	     (dd->index_dim || !ds->index_dim || dd->block_bytes != ds->index_offset)))
		r = -EPROTO;
	for (uint32_t t = 0; r >= 0 && t < ds->n_tables; t++) {
		if (ts[t] != ms->n || td[t] != ms->n) {
			r = -EPROTO;
			break;
		}
		for (uint32_t b = 0; r >= 0 && b < DIV_ROUND_UP(ms->n, ds->block_tokens); b++) {
			void *from, *to;

			r = kvd_seq_block(src, t, b, &from);
			if (r >= 0)
				r = kvd_seq_block(dst, t, b, &to);
			if (r >= 0)
				memcpy(to, from, dd->block_bytes);
		}
	}
	k = kvd_seq_unpin(dst);
	r = r < 0 ? r : k;
	k = kvd_seq_unpin(src);
	r = r < 0 ? r : k;
	for (uint32_t l = 0; r >= 0 && l < Q->m->cfg.layers; l++) {
		void *q;

		r = kvd_seq_observation(dst, l, &q);
		if (r < 0)
			break;
		memcpy(q, ms->obs + l * (Q->obs_floats + Q->iobs_floats), Q->obs_floats * sizeof(float));
		if (dd->index_dim) {
			r = kvd_seq_index_observation(dst, l, &q);
			if (r < 0)
				break;
			memcpy(q, ms->obs + l * (Q->obs_floats + Q->iobs_floats) + Q->obs_floats,
			       Q->iobs_floats * sizeof(float));
		}
		r = kvd_seq_observe(dst, l);
	}
	return r;
}

struct evict_result {
	uint64_t resident;     /* after */
	uint32_t positions;
	double kept;           /* resident / (positions * tables) */
	double ms;             /* the round, 0 when none was needed */
	bool round, ok;        /* ok: at most the budget, or only protected slots left */
};

/* Protected slots of one table of n tokens whose window ends at n: the sinks, the window,
 * the open tail block (which lies inside the window). */
static uint32_t protected_tokens(uint32_t n) {
	return MIN(n, KVD_SINKS_DEFAULT_COUNT + MAX(arg_window, n % KVDLM_KVD_BLOCK_TOKENS));
}

static int check_eviction(struct quality *Q, kvd_seq *seq, uint64_t budget_total, struct evict_result *e) {
	int r;

	r = seq_resident(seq, &e->resident, &e->positions);
	if (r < 0)
		return r;
	e->kept = (double)e->resident / ((double)e->positions * Q->tables);
	e->ok = e->resident <= MAX(budget_total, (uint64_t)protected_tokens(e->positions) * Q->tables);
	return 0;
}

/* Evicts seq (of tenant t) down to budget tokens per table, on t's own connection. */
static int evict_to(struct quality *Q, struct tenant *t, kvd_seq *seq, uint32_t budget,
                    struct evict_result *ret) {
	struct evict_result e = {};
	uint64_t budget_total = (uint64_t)budget * Q->tables;
	int r;

	r = seq_resident(seq, &e.resident, &e.positions);
	if (r < 0)
		return r;
	if (e.resident > budget_total) {
		double t0 = now_s();

		r = kvd_evict(t->client, t->name, (e.resident - budget_total) * unit_bytes(Q, t), NULL);
		if (r < 0)
			return fail("evicting from %s: %s", t->name, client_error(t->client, r));
		e.ms = (now_s() - t0) * 1e3;
		e.round = true;
	}
	r = check_eviction(Q, seq, budget_total, &e);
	if (r < 0)
		return r;
	*ret = e;
	return 0;
}

/* ---- generation ---- */

/*
 * Greedy decoding from logits (overwritten): the argmax, then decode it and so on, until a
 * newline, EOS or GEN_MAX tokens. out[GEN_TEXT_MAX + 1] receives the text, '\n' included,
 * NUL bytes and special tokens as '?' (no answer holds one), EOS dropped. Returns the
 * decode steps taken, or a negative errno.
 */
static int generate(struct quality *Q, float *logits, char *out) {
	uint32_t n = 0, tokens = 0, steps = 0;
	int r;

	for (;;) {
		uint32_t next = kvdlm_argmax(logits, Q->vocab);
		const uint8_t *b;
		size_t k;

		if (next == KVDLM_EOS)
			break;
		b = kvdlm_tokenizer_token(Q->tok, next, &k);
		if (next >= KVDLM_BOS && next < KVDLM_BYTE_VOCAB)
			out[n++] = '?';
		else
			for (size_t i = 0; i < k; i++)
				out[n++] = b[i] ? (char)b[i] : '?';
		if (next == '\n' || ++tokens == GEN_MAX)
			break;
		r = kvdlm_decode(Q->s, next, logits);
		if (r < 0)
			return r;
		steps++;
	}
	out[n] = 0;
	return (int)steps;
}

static void csv_text(FILE *f, const char *s) {
	fputc('"', f);
	for (; *s; s++) {
		if (*s == '"')
			fputs("\"\"", f);
		else if (*s == '\n')
			fputs("\\n", f);
		else
			fputc(*s >= 32 && *s < 127 ? *s : '?', f);
	}
	fputc('"', f);
}

static void sample_row(struct quality *Q, const char *setting, const struct sample *s, const char *policy,
                       uint32_t budget, bool correct, double kept, double round_ms, const char *out) {
	FILE *f = Q->samples_csv;

	fprintf(f, "%s,%s,%u,%" PRIu64 ",%s,%u,%d,%.4f,%.3f,", setting, kvd_task_to_string(s->task),
	        s->length, s->seed - KVD_TASK_SEED_REPORT_BEGIN, policy, budget, correct, kept, round_ms);
	csv_text(f, s->ts.answer);
	fputc(',', f);
	csv_text(f, out);
	fputc('\n', f);
}

/* ---- the matrix ---- */

static int cache_new(struct quality *Q, const struct tenant *t, uint32_t max_tokens,
                     struct kvdlm_cache **ret) {
	int r;

	r = kvdlm_cache_kvd_new(&t->km, &Q->m->cfg, max_tokens, ret);
	if (r < 0)
		return fail("opening a sequence of %u tokens for %s: %s", max_tokens, t->name,
		            client_error(t->client, r));
	return 0;
}

/*
 * One cell of one sample: policy p at budget percent, in setting st. The cell's sequence
 * gets the master's prefill (or, --direct, runs it itself), is evicted, and answers.
 */
static int run_cell(struct quality *Q, const struct sample *s, struct master *ms, enum setting st,
                    unsigned ti, unsigned li, int p, unsigned bi) {
	_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *c = NULL;
	struct tenant *t = &Q->pol[p];
	struct cell *cell = &Q->cells[cell_index(st, ti, li, (unsigned)p, bi)];
	struct evict_result e = {};
	char out[GEN_TEXT_MAX + 1];
	double t0, max_kept;
	bool correct;
	int r;

	r = cache_new(Q, t, sample_max_tokens(s), &c);
	if (r < 0)
		return r;
	r = kvdlm_session_reset(Q->s, c);
	if (r < 0)
		return r;
	if (arg_direct) {
		r = kvdlm_prefill(Q->s, s->tokens, s->n_ctx, KVDLM_LOGITS_NONE, NULL);
		if (r >= 0 && st == SETTING_IN_WINDOW)
			r = kvdlm_prefill(Q->s, s->tokens + s->n_ctx, s->n_q, KVDLM_LOGITS_LAST, Q->logits);
	} else {
		r = seq_copy(Q, kvdlm_cache_seq(c), ms);
		/* And the queries the engine saw, which its next steps publish from. */
		if (r >= 0)
			r = kvdlm_cache_copy_queries(c, ms->cache);
		if (r >= 0 && st == SETTING_IN_WINDOW)
			memcpy(Q->logits, Q->master_logits, Q->vocab * sizeof(float));
	}
	if (r < 0)
		return fail("%s: preparing the sequence: %s", t->name, client_error(t->client, r));
	r = evict_to(Q, t, kvdlm_cache_seq(c), budget_tokens(arg_budgets[bi], s->n_ctx), &e);
	if (r < 0)
		return r;
	max_kept = e.kept;
	if (st == SETTING_AGNOSTIC) {
		/* A recall column prefills the question but its last token, whose logits give
		 * the first answer token, then recalls: what the question's window needs may
		 * come back, each for a resident token of the context worth less, before the
		 * last token and the answer attend to the cache. */
		uint32_t first = t->recall && s->n_q > 1 ? s->n_q - 1 : 0;

		r = first ? kvdlm_prefill(Q->s, s->tokens + s->n_ctx, first, KVDLM_LOGITS_NONE, NULL) : 0;
		if (r < 0)
			return fail("%s: prefilling the question: %s", t->name, client_error(t->client, r));
		if (t->recall) {
			uint64_t tokens, before, after;
			uint32_t positions;

			/* What the round left plus the question so far: a trade must not add
			 * to it, not even for a moment (the daemon allocates nothing for it). */
			r = seq_resident(kvdlm_cache_seq(c), &before, &positions);
			t0 = now_s();
			if (r >= 0)
				r = kvd_seq_recall(kvdlm_cache_seq(c), &tokens, NULL);
			if (r < 0)
				return fail("%s: recall: %s", t->name, client_error(t->client, r));
			cell->recall_ms += (now_s() - t0) * 1e3;
			cell->recalled += tokens;
			r = seq_resident(kvdlm_cache_seq(c), &after, &positions);
			if (r < 0)
				return fail("%s: reading the tables: %s", t->name, client_error(t->client, r));
			/* As a share of the context: what is resident less the question's slots. */
			max_kept = MAX(max_kept, (double)(after - MIN(after, before - e.resident)) /
			                                 ((double)s->n_ctx * Q->tables));
			e.ok = e.ok && after <= before;
		}
		r = kvdlm_prefill(Q->s, s->tokens + s->n_ctx + first, s->n_q - first, KVDLM_LOGITS_LAST,
		                  Q->logits);
		if (r < 0)
			return fail("%s: prefilling the question: %s", t->name, client_error(t->client, r));
	}
	cell->max_kept = MAX(cell->max_kept, max_kept);
	t0 = now_s();
	r = generate(Q, Q->logits, out);
	if (r < 0)
		return fail("%s: decoding: %s", t->name, client_error(t->client, r));
	cell->decode_ms += (now_s() - t0) * 1e3;
	cell->decode_steps += (uint64_t)r;
	correct = kvd_task_score(&s->ts, out);
	cell->samples++;
	cell->correct += correct;
	cell->kept += e.kept;
	cell->round_ms += e.ms;
	cell->rounds += e.round;
	if (!e.ok) {
		cell->violations++;
		Q->violations++;
		fprintf(stderr, PROG ": %s %s %s@%u budget %u%%: %" PRIu64 " tokens resident, over the budget\n",
		        t->name, setting_names[st], kvd_task_to_string(s->task), s->length, arg_budgets[bi],
		        e.resident);
	}
	sample_row(Q, setting_names[st], s, col_name(p), arg_budgets[bi], correct, e.kept,
	           e.ms, out);
	return 0;
}

static int run_cells(struct quality *Q, const struct sample *s, struct master *ms, enum setting st,
                     unsigned ti, unsigned li) {
	if (!arg_settings[st])
		return 0;
	for (int p = 0; p < COLS; p++) {
		if (p == KVD_POLICY_FULL || !arg_policies[p])
			continue;
		for (unsigned bi = 0; bi < arg_n_budgets; bi++) {
			int r = run_cell(Q, s, ms, st, ti, li, p, bi);

			if (r < 0)
				return r;
		}
	}
	return 0;
}

/* The engine's private full cache, as the master was prefilled: must say the same. */
static int run_private(struct quality *Q, const struct sample *s, char *out) {
	_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *c = NULL;
	int r;

	r = kvdlm_cache_full_new(&Q->m->cfg, sample_max_tokens(s), &c);
	if (r < 0)
		return fail("a private cache: %s", strerror(-r));
	r = kvdlm_session_reset(Q->s, c);
	if (r >= 0)
		r = kvdlm_prefill(Q->s, s->tokens, s->n_ctx, KVDLM_LOGITS_NONE, NULL);
	if (r >= 0)
		r = kvdlm_prefill(Q->s, s->tokens + s->n_ctx, s->n_q, KVDLM_LOGITS_LAST, Q->logits);
	if (r >= 0)
		r = generate(Q, Q->logits, out);
	if (r < 0)
		return fail("the private full cache: %s", strerror(-r));
	return 0;
}

static int run_sample(struct quality *Q, unsigned ti, unsigned li, uint32_t i) {
	_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *mc = NULL;
	_cleanup_(freep) float *obs = NULL;
	struct sample s;
	struct master ms = {};
	char full[GEN_TEXT_MAX + 1], priv[GEN_TEXT_MAX + 1];
	struct full_cell *fc = &Q->full[ti * arg_n_lengths + li];
	double t0 = now_s(), el;
	bool correct;
	int r;

	r = sample_make(Q, arg_tasks[ti], KVD_TASK_SEED_REPORT_BEGIN + i, arg_lengths[li], &s);
	if (r < 0)
		return r;
	obs = malloc(Q->m->cfg.layers * (Q->obs_floats + Q->iobs_floats) * sizeof(float));
	if (!obs) {
		sample_done(&s);
		return -ENOMEM;
	}
	r = cache_new(Q, &Q->ref, sample_max_tokens(&s), &mc);
	if (r < 0)
		goto out;
	ms = (struct master){ .cache = mc, .obs = obs };

	/* The context: the master as the query-agnostic cells start. */
	r = kvdlm_session_reset(Q->s, mc);
	if (r >= 0)
		r = kvdlm_prefill(Q->s, s.tokens, s.n_ctx, KVDLM_LOGITS_NONE, NULL);
	if (r >= 0)
		r = master_snapshot(Q, &ms);
	if (r < 0) {
		fail("prefilling the context: %s", client_error(Q->ref.client, r));
		goto out;
	}
	r = run_cells(Q, &s, &ms, SETTING_AGNOSTIC, ti, li);
	if (r < 0)
		goto out;

	/* The question: the master as the in-window cells start. */
	r = kvdlm_session_reset(Q->s, mc);
	if (r >= 0)
		r = kvdlm_prefill(Q->s, s.tokens + s.n_ctx, s.n_q, KVDLM_LOGITS_LAST, Q->master_logits);
	if (r >= 0)
		r = master_snapshot(Q, &ms);
	if (r < 0) {
		fail("prefilling the question: %s", client_error(Q->ref.client, r));
		goto out;
	}
	r = run_cells(Q, &s, &ms, SETTING_IN_WINDOW, ti, li);
	if (r < 0)
		goto out;

	/* The full cache, in the daemon (the master, nothing evicted) and in this process. */
	memcpy(Q->logits, Q->master_logits, Q->vocab * sizeof(float));
	r = kvdlm_session_reset(Q->s, mc);
	if (r >= 0)
		r = generate(Q, Q->logits, full);
	if (r < 0) {
		fail("decoding the full cache: %s", client_error(Q->ref.client, r));
		goto out;
	}
	r = run_private(Q, &s, priv);
	if (r < 0)
		goto out;
	Q->checked++;
	if (strcmp(full, priv) != 0) {
		Q->mismatched++;
		fprintf(stderr, PROG ": %s@%u seed +%u: the daemon's full cache said '%s', the private one '%s'\n",
		        kvd_task_to_string(s.task), s.length, i, full, priv);
	}
	correct = kvd_task_score(&s.ts, full);
	fc->samples++;
	fc->correct += correct;
	for (unsigned st = 0; st < _SETTING_MAX; st++)
		if (arg_settings[st])
			sample_row(Q, setting_names[st], &s, "full", 100, correct, 1.0, 0.0, full);

	Q->done_samples++;
	el = now_s() - Q->t_start;
	fprintf(stderr, "[%" PRIu64 "/%" PRIu64 "] %s@%u seed +%u: full %s (%.1f s; %.0f s elapsed, ~%.0f s left)\n",
	        Q->done_samples, Q->total_samples, kvd_task_to_string(s.task), s.length, i,
	        correct ? "right" : "wrong", now_s() - t0, el,
	        el / (double)Q->done_samples * (double)(Q->total_samples - Q->done_samples));
	r = 0;
out:
	sample_done(&s);
	return r;
}

/* ---- multi-tenant ---- */

enum { MULTI_GLOBAL, MULTI_STATIC };
static const char *const multi_modes[2] = { "global", "static" };

static int multi_round(struct quality *Q, struct sample *s, struct master *ms, unsigned bi, int mode) {
	struct kvdlm_cache *c[MULTI_MAX] = {};
	uint64_t resident[MULTI_MAX] = {}, total = 0, budget = 0, share, after = 0, prot = 0;
	uint32_t pos[MULTI_MAX], over = 0;
	double ms_round = 0, kept[MULTI_MAX] = {};
	int r = 0;

	for (unsigned j = 0; j < arg_n_multi && r >= 0; j++) {
		r = cache_new(Q, &Q->multi[j], sample_max_tokens(&s[j]), &c[j]);
		if (r >= 0)
			r = seq_copy(Q, kvdlm_cache_seq(c[j]), &ms[j]);
		if (r >= 0)
			r = seq_resident(kvdlm_cache_seq(c[j]), &resident[j], &pos[j]);
		if (r < 0)
			fail("%s: preparing the sequence: %s", Q->multi[j].name, strerror(-r));
		else {
			total += resident[j];
			budget += (uint64_t)budget_tokens(arg_budgets[bi], s[j].n_ctx) * Q->tables;
		}
	}
	if (r >= 0 && mode == MULTI_GLOBAL && total > budget) {
		double t0 = now_s();

		r = kvd_evict(Q->admin, NULL, (total - budget) * unit_bytes(Q, &Q->multi[0]), NULL);
		if (r < 0)
			fail("a global round: %s", client_error(Q->admin, r));
		ms_round = (now_s() - t0) * 1e3;
	}
	share = budget / arg_n_multi;
	for (unsigned j = 0; r >= 0 && mode == MULTI_STATIC && j < arg_n_multi; j++) {
		struct tenant *t = &Q->multi[j];
		double t0 = now_s();

		if (resident[j] <= share)
			continue;
		r = kvd_evict(t->client, t->name, (resident[j] - share) * unit_bytes(Q, t), NULL);
		if (r < 0)
			fail("evicting from %s: %s", t->name, client_error(t->client, r));
		ms_round += (now_s() - t0) * 1e3;
	}
	/* Within the budget: the node's (global) or each tenant's share (static), or only
	 * protected slots left. */
	for (unsigned j = 0; r >= 0 && j < arg_n_multi; j++) {
		struct evict_result e = {};

		r = check_eviction(Q, kvdlm_cache_seq(c[j]), share, &e);
		kept[j] = e.kept;
		if (r >= 0 && mode == MULTI_STATIC && !e.ok)
			over++;
		after += e.resident;
		prot += (uint64_t)protected_tokens(e.positions) * Q->tables;
	}
	if (r >= 0 && mode == MULTI_GLOBAL && after > MAX(budget, prot))
		over++;
	if (over) {
		Q->violations += over;
		fprintf(stderr, PROG ": multi %s %u%%: over the budget after the round%s\n",
		        multi_modes[mode], arg_budgets[bi], over > 1 ? "s" : "");
	}
	for (unsigned j = 0; r >= 0 && j < arg_n_multi; j++) {
		struct cell *cell = &Q->multi_cells[mode][bi][j];
		char out[GEN_TEXT_MAX + 1];
		char setting[32];
		bool correct;

		r = kvdlm_session_reset(Q->s, c[j]);
		if (r >= 0)
			r = kvdlm_prefill(Q->s, s[j].tokens + s[j].n_ctx, s[j].n_q, KVDLM_LOGITS_LAST, Q->logits);
		if (r >= 0)
			r = generate(Q, Q->logits, out);
		if (r < 0) {
			fail("%s: answering: %s", Q->multi[j].name, client_error(Q->multi[j].client, r));
			break;
		}
		correct = kvd_task_score(&s[j].ts, out);
		cell->samples++;
		cell->correct += correct;
		cell->kept += kept[j];
		cell->round_ms += ms_round;
		cell->rounds++;
		cell->violations += over > 0;
		snprintf(setting, sizeof(setting), "multi-%s", multi_modes[mode]);
		sample_row(Q, setting, &s[j], kvd_policy_to_string(arg_multi_policy), arg_budgets[bi],
		           correct, kept[j], ms_round, out);
	}
	for (unsigned j = 0; j < arg_n_multi; j++)
		kvdlm_cache_free(c[j]);
	return r;
}

static int run_multi(struct quality *Q) {
	int r = 0;

	for (uint32_t i = 0; i < arg_samples && r >= 0; i++) {
		struct sample s[MULTI_MAX] = {};
		struct master ms[MULTI_MAX] = {};
		double t0 = now_s();

		for (unsigned j = 0; j < arg_n_multi && r >= 0; j++) {
			r = sample_make(Q, arg_multi_tenants[j].task,
			                KVD_TASK_SEED_REPORT_BEGIN + (uint64_t)j * SEED_TENANT_STRIDE + i,
			                arg_multi_tenants[j].length, &s[j]);
			if (r < 0)
				break;
			ms[j].obs = malloc(Q->m->cfg.layers * (Q->obs_floats + Q->iobs_floats) * sizeof(float));
			if (!ms[j].obs) {
				r = -ENOMEM;
				break;
			}
			r = cache_new(Q, &Q->ref, sample_max_tokens(&s[j]), &ms[j].cache);
			if (r >= 0)
				r = kvdlm_session_reset(Q->s, ms[j].cache);
			if (r >= 0)
				r = kvdlm_prefill(Q->s, s[j].tokens, s[j].n_ctx, KVDLM_LOGITS_NONE, NULL);
			if (r >= 0)
				r = master_snapshot(Q, &ms[j]);
			if (r < 0)
				fail("multi: prefilling: %s", client_error(Q->ref.client, r));
		}
		for (unsigned bi = 0; bi < arg_n_budgets && r >= 0; bi++)
			for (int mode = MULTI_GLOBAL; mode <= MULTI_STATIC && r >= 0; mode++)
				r = multi_round(Q, s, ms, bi, mode);
		for (unsigned j = 0; j < arg_n_multi && r >= 0; j++) {
			char out[GEN_TEXT_MAX + 1];
			bool correct;

			r = kvdlm_session_reset(Q->s, ms[j].cache);
			if (r >= 0)
				r = kvdlm_prefill(Q->s, s[j].tokens + s[j].n_ctx, s[j].n_q, KVDLM_LOGITS_LAST,
				                  Q->logits);
			if (r >= 0)
				r = generate(Q, Q->logits, out);
			if (r < 0) {
				fail("multi: the full cache: %s", client_error(Q->ref.client, r));
				break;
			}
			correct = kvd_task_score(&s[j].ts, out);
			Q->multi_full[j].samples++;
			Q->multi_full[j].correct += correct;
			sample_row(Q, "multi-full", &s[j], "full", 100, correct, 1.0, 0.0, out);
		}
		for (unsigned j = 0; j < arg_n_multi; j++) {
			kvdlm_cache_free(ms[j].cache);
			free(ms[j].obs);
			sample_done(&s[j]);
		}
		if (r >= 0)
			fprintf(stderr, "[multi %u/%u] %.1f s\n", i + 1, arg_samples, now_s() - t0);
	}
	return r;
}

/* ---- reports ---- */

static double acc(uint32_t correct, uint32_t samples) {
	return samples ? (double)correct / samples : NAN;
}

/* A pooled cell over the selected lengths (li < 0) or one. */
static struct cell pooled(const struct quality *Q, unsigned st, int ti, int li, int p, unsigned bi) {
	struct cell c = {};

	for (unsigned t = 0; t < arg_n_tasks; t++)
		for (unsigned l = 0; l < arg_n_lengths; l++) {
			const struct cell *x;

			if ((ti >= 0 && (unsigned)ti != t) || (li >= 0 && (unsigned)li != l))
				continue;
			if (p == KVD_POLICY_FULL) {
				const struct full_cell *f = &Q->full[t * arg_n_lengths + l];

				c.samples += f->samples;
				c.correct += f->correct;
				c.kept += f->samples;
				continue;
			}
			x = &Q->cells[cell_index(st, t, l, (unsigned)p, bi)];
			c.samples += x->samples;
			c.correct += x->correct;
			c.kept += x->kept;
			c.round_ms += x->round_ms;
			c.rounds += x->rounds;
			c.violations += x->violations;
			c.decode_ms += x->decode_ms;
			c.decode_steps += x->decode_steps;
		}
	return c;
}

/* What a column's sequences keep besides their K/V and index keys: the moments or the
 * latent memory of every (layer, kv head). */
static uint64_t state_bytes(const struct quality *Q, int p) {
	if (p < _KVD_POLICY_MAX || variants[p - _KVD_POLICY_MAX].compensation == KVD_COMPENSATION_NONE)
		return 0;
	return (uint64_t)Q->tables * (variants[p - _KVD_POLICY_MAX].compensation == KVD_COMPENSATION_LATENT
	                                      ? KVD_LATENT_BYTES(Q->m->cfg.head_dim)
	                                      : KVD_MOMENTS_BYTES(Q->m->cfg.head_dim));
}

/* Whether column p needs --indexmem's weights: an indexer, or a latent readout. */
static bool col_indexmem(int p) {
	return col_policy(p) == KVD_POLICY_INDEXMEM ||
	       (p >= _KVD_POLICY_MAX && variants[p - _KVD_POLICY_MAX].compensation == KVD_COMPENSATION_LATENT);
}

static void md_acc(FILE *f, struct cell c) {
	if (c.samples)
		fprintf(f, " %.2f |", acc(c.correct, c.samples));
	else
		fputs(" - |", f);
}

static const char *length_label(uint32_t l, char *buf, size_t n) {
	if (l % 1024 == 0)
		snprintf(buf, n, "%uk", l / 1024);
	else
		snprintf(buf, n, "%u", l);
	return buf;
}

static int write_csv(const struct quality *Q) {
	_cleanup_(freep) char *path = NULL;
	FILE *f;

	if (asprintf(&path, "%s/results.csv", arg_out) < 0)
		return -ENOMEM;
	f = fopen(path, "we");
	if (!f)
		return fail("%s: %s", path, strerror(errno));
	fprintf(f, "policy,setting,task,length,budget,samples,correct,accuracy,kept_fraction,"
	           "round_ms,over_budget,state_bytes,decode_ms,max_kept_fraction,recalled_tokens,"
	           "recall_ms\n");
	for (unsigned st = 0; st < _SETTING_MAX; st++) {
		if (!arg_settings[st])
			continue;
		for (unsigned ti = 0; ti < arg_n_tasks; ti++)
			for (unsigned li = 0; li < arg_n_lengths; li++) {
				const struct full_cell *fc = &Q->full[ti * arg_n_lengths + li];

				fprintf(f, "full,%s,%s,%u,100,%u,%u,%.4f,1.0000,0.000,0,0,,1.0000,0,0.000\n",
				        setting_names[st],
				        kvd_task_to_string(arg_tasks[ti]), arg_lengths[li], fc->samples,
				        fc->correct, acc(fc->correct, fc->samples));
				for (int p = 0; p < COLS; p++) {
					if (p == KVD_POLICY_FULL || !arg_policies[p])
						continue;
					for (unsigned bi = 0; bi < arg_n_budgets; bi++) {
						const struct cell *c = &Q->cells[cell_index(st, ti, li, (unsigned)p, bi)];

						fprintf(f, "%s,%s,%s,%u,%u,%u,%u,%.4f,%.4f,%.3f,%u,%" PRIu64 ",%.3f,"
						        "%.4f,%.1f,%.3f\n",
						        col_name(p), setting_names[st],
						        kvd_task_to_string(arg_tasks[ti]), arg_lengths[li], arg_budgets[bi],
						        c->samples, c->correct, acc(c->correct, c->samples),
						        c->samples ? c->kept / c->samples : NAN,
						        c->rounds ? c->round_ms / c->rounds : 0.0, c->violations,
						        state_bytes(Q, p),
						        c->decode_steps ? c->decode_ms / c->decode_steps : 0.0,
						        c->max_kept,
						        c->samples ? (double)c->recalled / c->samples : 0.0,
						        c->samples ? c->recall_ms / c->samples : 0.0);
					}
				}
			}
	}
	if (fclose(f) != 0)
		return fail("%s: write error", path);
	if (!arg_multi)
		return 0;
	free(path);
	if (asprintf(&path, "%s/multi.csv", arg_out) < 0)
		return -ENOMEM;
	f = fopen(path, "we");
	if (!f)
		return fail("%s: %s", path, strerror(errno));
	fprintf(f, "mode,policy,budget,tenant,task,length,samples,correct,accuracy,kept_fraction,"
	           "round_ms,full_accuracy\n");
	for (int mode = MULTI_GLOBAL; mode <= MULTI_STATIC; mode++)
		for (unsigned bi = 0; bi < arg_n_budgets; bi++)
			for (unsigned j = 0; j < arg_n_multi; j++) {
				const struct cell *c = &Q->multi_cells[mode][bi][j];

				fprintf(f, "%s,%s,%u,%s,%s,%u,%u,%u,%.4f,%.4f,%.3f,%.4f\n", multi_modes[mode],
				        kvd_policy_to_string(arg_multi_policy), arg_budgets[bi], Q->multi[j].name,
				        kvd_task_to_string(arg_multi_tenants[j].task), arg_multi_tenants[j].length,
				        c->samples, c->correct, acc(c->correct, c->samples),
				        c->samples ? c->kept / c->samples : NAN,
				        c->rounds ? c->round_ms / c->rounds : 0.0,
				        acc(Q->multi_full[j].correct, Q->multi_full[j].samples));
			}
	if (fclose(f) != 0)
		return fail("%s: write error", path);
	return 0;
}

/* The targets, on query-agnostic multikey, pooled over lengths. */
static void write_targets(const struct quality *Q, FILE *f) {
	int ti = -1, b5 = -1, b10 = -1;
	struct cell full, kvd10, kvd5, snap5, rest5;
	double ratio;

	for (unsigned t = 0; t < arg_n_tasks; t++)
		if (arg_tasks[t] == KVD_TASK_MULTIKEY)
			ti = (int)t;
	for (unsigned bi = 0; bi < arg_n_budgets; bi++) {
		if (arg_budgets[bi] == 5)
			b5 = (int)bi;
		if (arg_budgets[bi] == 10)
			b10 = (int)bi;
	}
	fprintf(f, "## Targets\n\nQuery-agnostic multikey, all lengths pooled.\n\n");
	if (ti < 0 || !arg_settings[SETTING_AGNOSTIC] || !arg_policies[KVD_POLICY_KVD]) {
		fprintf(f, "Not measured in this run (needs multikey, query-agnostic and kvd).\n\n");
		return;
	}
	full = pooled(Q, SETTING_AGNOSTIC, ti, -1, KVD_POLICY_FULL, 0);
	if (b10 >= 0) {
		kvd10 = pooled(Q, SETTING_AGNOSTIC, ti, -1, KVD_POLICY_KVD, (unsigned)b10);
		ratio = acc(kvd10.correct, kvd10.samples) / acc(full.correct, full.samples);
		fprintf(f, "- kvd at 10%%: %.2f (%u/%u), full cache %.2f (%u/%u): %.0f%% of full; "
		           "target >= 90%%: **%s**\n",
		        acc(kvd10.correct, kvd10.samples), kvd10.correct, kvd10.samples,
		        acc(full.correct, full.samples), full.correct, full.samples, ratio * 100,
		        full.correct == 0 ? "not measurable (full cache at 0)" : ratio >= 0.9 ? "met" : "not met");
	}
	if (b5 >= 0 && arg_policies[KVD_POLICY_SNAPKV] && arg_policies[KVD_POLICY_RESTKV]) {
		double k, sn, re;

		kvd5 = pooled(Q, SETTING_AGNOSTIC, ti, -1, KVD_POLICY_KVD, (unsigned)b5);
		snap5 = pooled(Q, SETTING_AGNOSTIC, ti, -1, KVD_POLICY_SNAPKV, (unsigned)b5);
		rest5 = pooled(Q, SETTING_AGNOSTIC, ti, -1, KVD_POLICY_RESTKV, (unsigned)b5);
		k = acc(kvd5.correct, kvd5.samples);
		sn = acc(snap5.correct, snap5.samples);
		re = acc(rest5.correct, rest5.samples);
		fprintf(f, "- at 5%%: kvd %.2f, snapkv %.2f, restkv %.2f: kvd ahead by %+.0f and %+.0f points; "
		           "target a clear margin (>= %.0f points) over both: **%s**\n",
		        k, sn, re, (k - sn) * 100, (k - re) * 100, MARGIN_POINTS,
		        (k - sn) * 100 >= MARGIN_POINTS && (k - re) * 100 >= MARGIN_POINTS ? "met" : "not met");
	}
	fputc('\n', f);
}

/* The 95% Wilson score interval of correct out of samples (samples > 0). */
static void wilson(uint32_t correct, uint32_t samples, double *lo, double *hi) {
	const double z = 1.959964, n = samples, p = (double)correct / samples;
	double mid = (p + z * z / (2 * n)) / (1 + z * z / n);
	double half = z * sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n);

	*lo = MAX(mid - half, 0.0);
	*hi = MIN(mid + half, 1.0);
}

static void md_acc_interval(FILE *f, struct cell c) {
	double lo, hi;

	wilson(c.correct, c.samples, &lo, &hi);
	fprintf(f, " %.2f [%.2f, %.2f] |", acc(c.correct, c.samples), lo, hi);
}

/*
 * Per setting and budget, the default policy against the best of the other policies that
 * need no trained weights (every policy but full, kvd and indexmem; the compensated columns
 * are not policies), all tasks and lengths pooled.
 */
static void write_default_vs_best(const struct quality *Q, FILE *f) {
	fprintf(f, "## The default against the best other weight-free policy\n\nAll tasks and "
	           "lengths pooled; 95%% Wilson intervals in brackets.\n\n");
	if (!arg_policies[KVD_POLICY_KVD]) {
		fprintf(f, "Not measured in this run (needs kvd).\n\n");
		return;
	}
	fprintf(f, "| setting | budget | kvd | best other | kvd - best |\n|---|---:|---:|---:|---:|\n");
	for (unsigned st = 0; st < _SETTING_MAX; st++) {
		if (!arg_settings[st])
			continue;
		for (unsigned bi = 0; bi < arg_n_budgets; bi++) {
			struct cell k = pooled(Q, st, -1, -1, KVD_POLICY_KVD, bi), best = {};
			int bp = -1;

			for (int p = 0; p < _KVD_POLICY_MAX; p++) {
				struct cell c;

				if (p == KVD_POLICY_FULL || p == KVD_POLICY_KVD || p == KVD_POLICY_INDEXMEM ||
				    !arg_policies[p])
					continue;
				c = pooled(Q, st, -1, -1, p, bi);
				if (c.samples && (bp < 0 || acc(c.correct, c.samples) > acc(best.correct, best.samples)))
					best = c, bp = p;
			}
			if (!k.samples)
				continue;
			fprintf(f, "| %s | %u%% |", setting_names[st], arg_budgets[bi]);
			md_acc_interval(f, k);
			if (bp < 0) {
				fputs(" - | - |\n", f);
				continue;
			}
			fprintf(f, " %s", col_name(bp));
			md_acc_interval(f, best);
			fprintf(f, " %+.2f |\n", acc(k.correct, k.samples) - acc(best.correct, best.samples));
		}
	}
	fputc('\n', f);
}

static void write_table(const struct quality *Q, FILE *f, const char *cmdline, double seconds) {
	char lab[16];

	fprintf(f, "# kvd-quality\n\n");
	fprintf(f, "Model `%s` (dim %u, %u layers, %u/%u heads, head dim %u); %u samples per cell, "
	           "seeds %" PRIu64 " + [0, %u) (the reporting range); window %u; %s prefill; %.0f s.\n\n"
	           "`%s`\n\n",
	        arg_model, Q->m->cfg.dim, Q->m->cfg.layers, Q->m->cfg.q_heads, Q->m->cfg.kv_heads,
	        Q->m->cfg.head_dim, arg_samples, KVD_TASK_SEED_REPORT_BEGIN, arg_samples, arg_window,
	        arg_direct ? "per-cell" : "shared", seconds, cmdline);
	if (stop_requested)
		fprintf(f, "**Stopped early** by a signal after %" PRIu64 " of %" PRIu64 " samples: cells "
		           "hold %u or %u samples%s.\n\n", Q->done_samples, Q->total_samples,
		        (unsigned)(Q->done_samples / MAX(arg_n_tasks * arg_n_lengths, 1u)),
		        (unsigned)DIV_ROUND_UP(Q->done_samples, (uint64_t)arg_n_tasks * arg_n_lengths),
		        arg_multi ? "; the multi-tenant scenario did not run" : "");
	fprintf(f, "Daemon full cache vs the engine's private one: %" PRIu64 "/%" PRIu64
	           " samples identical. Cells over their budget after the round: %" PRIu64 ".\n\n",
	        Q->checked - Q->mismatched, Q->checked, Q->violations);
	if (Q->im)
		fprintf(f, "IndexMem (`%s`): %u index heads of %u; the indexmem columns also store an "
		           "index key per token and table, %" PRIu64 " bytes per token (%.0f%% of its "
		           "K/V), not in state/seq.\n\n",
		        arg_indexmem, Q->im->index_heads, Q->im->index_dim, Q->index_bytes * Q->tables,
		        100.0 * (double)Q->index_bytes / (double)Q->slot_bytes);
	write_targets(Q, f);
	write_default_vs_best(Q, f);

	for (unsigned st = 0; st < _SETTING_MAX; st++) {
		if (!arg_settings[st])
			continue;
		fprintf(f, "## %s: accuracy by budget, all tasks and lengths pooled\n\n| policy |",
		        setting_names[st]);
		for (unsigned bi = 0; bi < arg_n_budgets; bi++)
			fprintf(f, " %u%% |", arg_budgets[bi]);
		fputs(" kept at", f);
		for (unsigned bi = 0; bi < arg_n_budgets; bi++)
			fprintf(f, " %u%%", arg_budgets[bi]);
		fprintf(f, " | round ms | state/seq | decode ms |\n|---|");
		for (unsigned bi = 0; bi < arg_n_budgets + 4; bi++)
			fputs("---:|", f);
		fputc('\n', f);
		for (int p = 0; p < COLS; p++) {
			struct cell all = {};

			if (p != KVD_POLICY_FULL && !arg_policies[p])
				continue;
			fprintf(f, "| %s |", col_name(p));
			for (unsigned bi = 0; bi < arg_n_budgets; bi++)
				md_acc(f, pooled(Q, st, -1, -1, p, bi));
			fputc(' ', f);
			for (unsigned bi = 0; bi < arg_n_budgets; bi++) {
				struct cell c = pooled(Q, st, -1, -1, p, bi);

				fprintf(f, "%s%.3f", bi ? " " : "", c.samples ? c.kept / c.samples : NAN);
				all.round_ms += c.round_ms;
				all.rounds += c.rounds;
				all.decode_ms += c.decode_ms;
				all.decode_steps += c.decode_steps;
			}
			fprintf(f, " | %.1f | %.0f KiB | %.2f |\n", all.rounds ? all.round_ms / all.rounds : 0.0,
			        state_bytes(Q, p) / 1024.0,
			        all.decode_steps ? all.decode_ms / all.decode_steps : 0.0);
		}
		fputc('\n', f);
	}

	for (unsigned st = 0; st < _SETTING_MAX; st++) {
		if (!arg_settings[st])
			continue;
		for (unsigned ti = 0; ti < arg_n_tasks; ti++) {
			fprintf(f, "## %s, %s: accuracy by length and budget\n\n| policy |", setting_names[st],
			        kvd_task_to_string(arg_tasks[ti]));
			for (unsigned li = 0; li < arg_n_lengths; li++)
				for (unsigned bi = 0; bi < arg_n_budgets; bi++)
					fprintf(f, " %s %u%% |", length_label(arg_lengths[li], lab, sizeof(lab)),
					        arg_budgets[bi]);
			fputs("\n|---|", f);
			for (unsigned k = 0; k < arg_n_lengths * arg_n_budgets; k++)
				fputs("---:|", f);
			fputc('\n', f);
			for (int p = 0; p < COLS; p++) {
				if (p != KVD_POLICY_FULL && !arg_policies[p])
					continue;
				fprintf(f, "| %s |", col_name(p));
				for (unsigned li = 0; li < arg_n_lengths; li++)
					for (unsigned bi = 0; bi < arg_n_budgets; bi++)
						md_acc(f, pooled(Q, st, (int)ti, (int)li, p, bi));
				fputc('\n', f);
			}
			fputc('\n', f);
		}
	}

	if (arg_multi) {
		fprintf(f, "## Multi-tenant: policy %s, query-agnostic, one budget for all "
		           "(global ranking) vs split statically\n\n| tenant | full |",
		        kvd_policy_to_string(arg_multi_policy));
		for (unsigned bi = 0; bi < arg_n_budgets; bi++)
			fprintf(f, " %u%% global | %u%% static |", arg_budgets[bi], arg_budgets[bi]);
		fputs("\n|---|---:|", f);
		for (unsigned bi = 0; bi < arg_n_budgets; bi++)
			fputs("---:|---:|", f);
		fputc('\n', f);
		for (unsigned j = 0; j < arg_n_multi; j++) {
			fprintf(f, "| %s (%s@%u) | %.2f |", Q->multi[j].name,
			        kvd_task_to_string(arg_multi_tenants[j].task), arg_multi_tenants[j].length,
			        acc(Q->multi_full[j].correct, Q->multi_full[j].samples));
			for (unsigned bi = 0; bi < arg_n_budgets; bi++)
				for (int mode = MULTI_GLOBAL; mode <= MULTI_STATIC; mode++) {
					const struct cell *c = &Q->multi_cells[mode][bi][j];

					fprintf(f, " %.2f (kept %.2f) |", acc(c->correct, c->samples),
					        c->samples ? c->kept / c->samples : NAN);
				}
			fputc('\n', f);
		}
		fputs("| all |", f);
		{
			struct full_cell fa = {};

			for (unsigned j = 0; j < arg_n_multi; j++) {
				fa.samples += Q->multi_full[j].samples;
				fa.correct += Q->multi_full[j].correct;
			}
			fprintf(f, " %.2f |", acc(fa.correct, fa.samples));
		}
		for (unsigned bi = 0; bi < arg_n_budgets; bi++)
			for (int mode = MULTI_GLOBAL; mode <= MULTI_STATIC; mode++) {
				struct cell a = {};

				for (unsigned j = 0; j < arg_n_multi; j++) {
					a.samples += Q->multi_cells[mode][bi][j].samples;
					a.correct += Q->multi_cells[mode][bi][j].correct;
				}
				fprintf(f, " %.2f |", acc(a.correct, a.samples));
			}
		fputs("\n\n", f);
	}
}

static const char *const plot_colors[] = {
	"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
	"#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#000080", "#b00000",
	"#006400", "#ff1493", "#4b0082", "#808000", "#00ced1", "#ff8c00", "#8b4513",
	"#2f4f4f", "#9acd32", "#dc143c", "#00008b",
};
_Static_assert(sizeof(plot_colors) / sizeof(plot_colors[0]) >= COLS, "a line type per column");

/* Accuracy vs budget, a line per policy, full dashed; one PNG per (setting, task) and one
 * per setting with every task pooled. */
static int write_plots(const struct quality *Q) {
	_cleanup_(freep) char *dir = NULL, *script = NULL;
	FILE *gp;
	pid_t pid;
	int status;

	if (asprintf(&dir, "%s/plots", arg_out) < 0 || asprintf(&script, "%s/plots/plots.gp", arg_out) < 0)
		return -ENOMEM;
	if (mkdir(dir, 0755) < 0 && errno != EEXIST)
		return fail("%s: %s", dir, strerror(errno));
	gp = fopen(script, "we");
	if (!gp)
		return fail("%s: %s", script, strerror(errno));
	fprintf(gp, "set terminal pngcairo size 960,600 noenhanced\n"
	            "set logscale x\nset xtics (");
	for (unsigned bi = 0; bi < arg_n_budgets; bi++)
		fprintf(gp, "%s%u", bi ? ", " : "", arg_budgets[bi]);
	fprintf(gp, ")\nset xrange [%g:%g]\nset yrange [0:1.05]\nset grid\n"
	            "set key outside right top\nset xlabel 'KV budget (%% of the context)'\n"
	            "set ylabel 'accuracy (exact match)'\n",
	        arg_budgets[0] * 0.8, arg_budgets[arg_n_budgets - 1] * 1.25);
	/* A line type per column, the same in every plot: a colour each, those from the ninth
	 * on dashed, kvd solid and thicker. */
	for (unsigned i = 0; i < ELEMENTSOF(plot_colors); i++)
		fprintf(gp, "set linetype %u lc rgb '%s' pt %u dt %u lw %u\n", i + 1, plot_colors[i],
		        i % 7 + 1, i >= 8 && i + 1 != KVD_POLICY_KVD ? 2 : 1, i + 1 == KVD_POLICY_KVD ? 4 : 2);
	for (unsigned st = 0; st < _SETTING_MAX; st++) {
		if (!arg_settings[st])
			continue;
		for (int ti = -1; ti < (int)arg_n_tasks; ti++) {
			_cleanup_(freep) char *dat = NULL;
			const char *task = ti < 0 ? "all" : kvd_task_to_string(arg_tasks[ti]);
			struct cell full = pooled(Q, st, ti, -1, KVD_POLICY_FULL, 0);
			unsigned cols = 1;
			FILE *f;

			/* gnuplot stops at a plot without a point: none for cells without samples
			 * (a run stopped early). */
			if ((ti < 0 && arg_n_tasks == 1) || full.samples == 0)
				continue;
			if (asprintf(&dat, "%s/%s-%s.dat", dir, setting_names[st], task) < 0) {
				fclose(gp);
				return -ENOMEM;
			}
			f = fopen(dat, "we");
			if (!f) {
				fclose(gp);
				return fail("%s: %s", dat, strerror(errno));
			}
			fputs("budget", f);
			for (int p = 0; p < COLS; p++)
				if (p != KVD_POLICY_FULL && arg_policies[p]) {
					fprintf(f, " %s", col_name(p));
					cols++;
				}
			fputc('\n', f);
			for (unsigned bi = 0; bi < arg_n_budgets; bi++) {
				fprintf(f, "%u", arg_budgets[bi]);
				for (int p = 0; p < COLS; p++)
					if (p != KVD_POLICY_FULL && arg_policies[p]) {
						struct cell c = pooled(Q, st, ti, -1, p, bi);

						fprintf(f, " %.4f", acc(c.correct, c.samples));
					}
				fputc('\n', f);
			}
			fclose(f);
			fprintf(gp, "set output '%s/%s-%s.png'\n"
			            "set title '%s, %s (%u samples per length): accuracy vs KV budget'\n"
			            "plot ",
			        dir, setting_names[st], task, setting_names[st], task, arg_samples);
			cols = 1;
			for (int p = 0; p < COLS; p++)
				if (p != KVD_POLICY_FULL && arg_policies[p])
					fprintf(gp, "'%s' using 1:%u with linespoints lt %d title '%s', ", dat, ++cols,
					        p, col_name(p));
			fprintf(gp, "%.4f with lines lc rgb 'black' dt 3 lw 2 title 'full'\n",
			        acc(full.correct, full.samples));
		}
	}
	if (fclose(gp) != 0)
		return fail("%s: write error", script);
	pid = fork();
	if (pid < 0)
		return fail("fork: %s", strerror(errno));
	if (pid == 0) {
		int null = open("/dev/null", O_WRONLY | O_CLOEXEC);

		if (null >= 0)
			dup2(null, STDOUT_FILENO);
		execlp("gnuplot", "gnuplot", script, (char *)NULL);
		_exit(errno == ENOENT ? 127 : 126);
	}
	if (waitpid(pid, &status, 0) != pid)
		return fail("waitpid: %s", strerror(errno));
	if (WIFEXITED(status) && WEXITSTATUS(status) == 127) {
		printf("gnuplot is not installed: no plots (the data and the script are in %s; "
		       "tools/setup installs gnuplot-nox)\n", dir);
		return 0;
	}
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
		return fail("gnuplot %s failed", script);
	printf("Plots: %s/*.png\n", dir);
	return 0;
}

static int write_reports(const struct quality *Q, const char *cmdline, double seconds) {
	_cleanup_(freep) char *path = NULL;
	FILE *f;
	int r;

	r = write_csv(Q);
	if (r < 0)
		return r;
	if (asprintf(&path, "%s/table.md", arg_out) < 0)
		return -ENOMEM;
	f = fopen(path, "we");
	if (!f)
		return fail("%s: %s", path, strerror(errno));
	write_table(Q, f, cmdline, seconds);
	if (fclose(f) != 0)
		return fail("%s: write error", path);
	write_table(Q, stdout, cmdline, seconds);
	printf("Wrote %s/results.csv, %s/samples.csv%s, %s\n", arg_out, arg_out,
	       arg_multi ? ", multi.csv" : "", path);
	fflush(stdout);
	return write_plots(Q);
}

/* ---- command line ---- */

static void help(void) {
	printf("Usage: kvd-quality [OPTIONS]\n"
	       "\n"
	       "Accuracy of every eviction policy on the kvd-lm tasks, with the KV cache in a kvd\n"
	       "daemon this command starts: policies x budgets x tasks x lengths x settings\n"
	       "(in-window: the question is in the observation window when the daemon evicts;\n"
	       "query-agnostic: the KV is evicted before the question arrives). Writes\n"
	       "results.csv, samples.csv, table.md and plots/*.png (gnuplot) under --out, and\n"
	       "prints the table. Samples are drawn from the reporting seed range.\n"
	       "\n"
	       "Options:\n"
	       "  --model FILE       Weights (default: %s)\n"
	       "  --haystack FILE    Task haystack (default: $KVD_LM_HAYSTACK, else %s)\n"
	       "  --kvd PATH         The kvd binary (default: $KVD_DAEMON, else the build tree's\n"
	       "                     next to kvd-quality, else kvd from PATH)\n"
	       "  --out DIR          Output directory (default: %s)\n"
	       "  --samples N        Samples per cell, 1..%u (default: %u)\n"
	       "  --tasks LIST       niah, multikey, multivalue, vt, cwe (default: niah,multikey)\n"
	       "  --lengths LIST     Prompt lengths in tokens (default: 1024,2048,4096)\n"
	       "  --budgets LIST     KV budgets, percent of the context, 1..99 (default: 5,10,20,50)\n"
	       "  --settings LIST    in-window, query-agnostic (default: both)\n"
	       "  --policies LIST    Policies besides full, which always runs, and the compensated\n"
	       "                     kvd+moments, kvd-mi+moments, kvd+moments-mass,\n"
	       "                     kvd+moments-bounded, indexmem+latent, kvd+latent, and the\n"
	       "                     recall columns kvd+recall, indexmem+recall (default: all,\n"
	       "                     less the indexmem and latent ones when the model has no\n"
	       "                     IndexMem weights)\n"
	       "  --indexmem FILE    IndexMem weights for the indexmem and latent columns\n"
	       "                     (default: the model's path ending in %s instead)\n"
	       "  --threads N        Engine threads (default: the online CPUs)\n"
	       "  --window W         Observation window, 1..%u (default: %u)\n"
	       "  --recall-tokens N  Recall columns: tokens per (layer, kv head) a recall may\n"
	       "                     bring back, 1..%u (default: %u)\n"
	       "  --multi            Also the multi-tenant scenario: one budget ranked globally\n"
	       "                     vs split statically\n"
	       "  --multi-tenants L  Its tenants, TASK:LENGTH,... 2..%u (default:\n"
	       "                     niah:1024,multikey:2048,multikey:4096)\n"
	       "  --multi-policy P   Its tenants' policy (default: kvd)\n"
	       "  --direct           Prefill every cell itself instead of copying the shared\n"
	       "                     prefill (slow: a check that both agree)\n"
	       "  --quick            %u samples, niah, 1024 tokens, budgets 10,50 (options given\n"
	       "                     explicitly win)\n"
	       "  --keep             Keep the daemon's directory (config, socket)\n"
	       "  -h --help          Show this help and exit\n"
	       "\n"
	       "Exit status: 0 when every cell ran, 1 on a failure (including a daemon full-cache\n"
	       "answer that differs from the engine's private full cache), 2 on usage errors.\n",
	       MODEL_DEFAULT, HAYSTACK_DEFAULT, OUT_DEFAULT, SAMPLES_MAX, SAMPLES_DEFAULT, INDEXMEM_SUFFIX,
	       KVD_WINDOW_MAX,
	       KVD_WINDOW_DEFAULT, RECALL_TOKENS_MAX, RECALL_TOKENS_DEFAULT, MULTI_MAX, QUICK_SAMPLES);
}

static int item_task(const char *s, unsigned i, void *userdata _unused_) {
	enum kvd_task t = kvd_task_from_string(s);

	if (t < 0)
		return -EINVAL;
	arg_tasks[i] = t;
	return 0;
}

static int item_length(const char *s, unsigned i, void *userdata _unused_) {
	return number_parse_u32(s, 1, KVDLM_FULL_MAX_TOKENS / 2, &arg_lengths[i]);
}

static int item_budget(const char *s, unsigned i, void *userdata _unused_) {
	return number_parse_u32(s, 1, 99, &arg_budgets[i]);
}

static int item_setting(const char *s, unsigned i, void *userdata _unused_) {
	for (unsigned st = 0; st < _SETTING_MAX; st++)
		if (strcmp(s, setting_names[st]) == 0) {
			arg_settings[st] = true;
			return 0;
		}
	return -EINVAL;
}

static int item_policy(const char *s, unsigned i, void *userdata _unused_) {
	for (int p = 0; p < COLS; p++)
		if (strcmp(s, col_name(p)) == 0) {
			arg_policies[p] = true;
			return 0;
		}
	return -EINVAL;
}

static int item_multi(const char *s, unsigned i, void *userdata _unused_) {
	const char *colon = strchr(s, ':');
	char task[32];
	enum kvd_task t;

	if (!colon || (size_t)(colon - s) >= sizeof(task))
		return -EINVAL;
	memcpy(task, s, (size_t)(colon - s));
	task[colon - s] = 0;
	t = kvd_task_from_string(task);
	if (t < 0)
		return -EINVAL;
	arg_multi_tenants[i].task = t;
	return number_parse_u32(colon + 1, 1, KVDLM_FULL_MAX_TOKENS / 2, &arg_multi_tenants[i].length);
}

static int u32_cmp(const void *a, const void *b) {
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;

	return x < y ? -1 : x > y;
}

/* Returns 1 to run, 0 after --help, 2 on a usage error. */
static int parse_argv(int argc, char **argv) {
	enum {
		OPT_MODEL = 0x100,
		OPT_HAYSTACK,
		OPT_KVD,
		OPT_OUT,
		OPT_SAMPLES,
		OPT_TASKS,
		OPT_LENGTHS,
		OPT_BUDGETS,
		OPT_SETTINGS,
		OPT_POLICIES,
		OPT_INDEXMEM,
		OPT_THREADS,
		OPT_WINDOW,
		OPT_RECALL_TOKENS,
		OPT_MULTI,
		OPT_MULTI_TENANTS,
		OPT_MULTI_POLICY,
		OPT_DIRECT,
		OPT_QUICK,
		OPT_KEEP,
	};
	static const struct option options[] = {
		{ "model", required_argument, NULL, OPT_MODEL },
		{ "haystack", required_argument, NULL, OPT_HAYSTACK },
		{ "kvd", required_argument, NULL, OPT_KVD },
		{ "out", required_argument, NULL, OPT_OUT },
		{ "samples", required_argument, NULL, OPT_SAMPLES },
		{ "tasks", required_argument, NULL, OPT_TASKS },
		{ "lengths", required_argument, NULL, OPT_LENGTHS },
		{ "budgets", required_argument, NULL, OPT_BUDGETS },
		{ "settings", required_argument, NULL, OPT_SETTINGS },
		{ "policies", required_argument, NULL, OPT_POLICIES },
		{ "indexmem", required_argument, NULL, OPT_INDEXMEM },
		{ "threads", required_argument, NULL, OPT_THREADS },
		{ "window", required_argument, NULL, OPT_WINDOW },
		{ "recall-tokens", required_argument, NULL, OPT_RECALL_TOKENS },
		{ "multi", no_argument, NULL, OPT_MULTI },
		{ "multi-tenants", required_argument, NULL, OPT_MULTI_TENANTS },
		{ "multi-policy", required_argument, NULL, OPT_MULTI_POLICY },
		{ "direct", no_argument, NULL, OPT_DIRECT },
		{ "quick", no_argument, NULL, OPT_QUICK },
		{ "keep", no_argument, NULL, OPT_KEEP },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	bool have_samples = false, have_tasks = false, have_lengths = false, have_budgets = false;
	int opt, n;

	arg_haystack = getenv("KVD_LM_HAYSTACK");
	if (!arg_haystack || !*arg_haystack)
		arg_haystack = HAYSTACK_DEFAULT;
	optind = 0;
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case OPT_MODEL:
			arg_model = optarg;
			break;
		case OPT_HAYSTACK:
			arg_haystack = optarg;
			break;
		case OPT_KVD:
			arg_kvd = optarg;
			break;
		case OPT_OUT:
			arg_out = optarg;
			break;
		case OPT_SAMPLES:
			if (number_parse_u32(optarg, 1, SAMPLES_MAX, &arg_samples) < 0)
				return usage_error("--samples: '%s' is not in 1..%u", optarg, SAMPLES_MAX);
			have_samples = true;
			break;
		case OPT_TASKS:
			n = cli_parse_list(optarg, _KVD_TASK_MAX, item_task, NULL);
			if (n < 0)
				return usage_error("--tasks: '%s' is not a list of niah, multikey, multivalue, "
				                   "vt, cwe", optarg);
			arg_n_tasks = (unsigned)n;
			have_tasks = true;
			break;
		case OPT_LENGTHS:
			n = cli_parse_list(optarg, LIST_MAX, item_length, NULL);
			if (n < 0)
				return usage_error("--lengths: '%s' is not a list of at most %u lengths", optarg,
				                   LIST_MAX);
			arg_n_lengths = (unsigned)n;
			have_lengths = true;
			break;
		case OPT_BUDGETS:
			n = cli_parse_list(optarg, LIST_MAX, item_budget, NULL);
			if (n < 0)
				return usage_error("--budgets: '%s' is not a list of at most %u percentages "
				                   "1..99", optarg, LIST_MAX);
			arg_n_budgets = (unsigned)n;
			have_budgets = true;
			break;
		case OPT_SETTINGS:
			memset(arg_settings, 0, sizeof(arg_settings));
			if (cli_parse_list(optarg, _SETTING_MAX, item_setting, NULL) < 0)
				return usage_error("--settings: '%s' is not a list of in-window, query-agnostic",
				                   optarg);
			break;
		case OPT_POLICIES:
			memset(arg_policies, 0, sizeof(arg_policies));
			if (cli_parse_list(optarg, COLS, item_policy, NULL) < 0)
				return usage_error("--policies: '%s' is not a list of policies", optarg);
			arg_policies_given = true;
			break;
		case OPT_INDEXMEM:
			arg_indexmem = optarg;
			break;
		case OPT_THREADS:
			if (number_parse_u32(optarg, 1, KVDLM_THREADS_MAX, &arg_threads) < 0)
				return usage_error("--threads: '%s' is not in 1..%u", optarg, KVDLM_THREADS_MAX);
			break;
		case OPT_WINDOW:
			if (number_parse_u32(optarg, 1, KVD_WINDOW_MAX, &arg_window) < 0)
				return usage_error("--window: '%s' is not in 1..%u", optarg, KVD_WINDOW_MAX);
			break;
		case OPT_RECALL_TOKENS:
			if (number_parse_u32(optarg, 1, RECALL_TOKENS_MAX, &arg_recall_tokens) < 0)
				return usage_error("--recall-tokens: '%s' is not in 1..%u", optarg,
				                   RECALL_TOKENS_MAX);
			break;
		case OPT_MULTI:
			arg_multi = true;
			break;
		case OPT_MULTI_TENANTS:
			n = cli_parse_list(optarg, MULTI_MAX, item_multi, NULL);
			if (n < 2)
				return usage_error("--multi-tenants: '%s' is not a list of 2..%u TASK:LENGTH",
				                   optarg, MULTI_MAX);
			arg_n_multi = (unsigned)n;
			break;
		case OPT_MULTI_POLICY:
			arg_multi_policy = kvd_policy_from_string(optarg);
			if (arg_multi_policy < 0 || arg_multi_policy == KVD_POLICY_FULL)
				return usage_error("--multi-policy: '%s' is not an evicting policy", optarg);
			break;
		case OPT_DIRECT:
			arg_direct = true;
			break;
		case OPT_QUICK:
			arg_quick = true;
			break;
		case OPT_KEEP:
			arg_keep = true;
			break;
		case 'h':
			help();
			return 0;
		default:
			return usage_error("bad option");
		}
	if (optind < argc)
		return usage_error("unexpected argument '%s'", argv[optind]);
	if (arg_quick) {
		if (!have_samples)
			arg_samples = QUICK_SAMPLES;
		if (!have_tasks) {
			arg_tasks[0] = KVD_TASK_NIAH;
			arg_n_tasks = 1;
		}
		if (!have_lengths) {
			arg_lengths[0] = 1024;
			arg_n_lengths = 1;
		}
		if (!have_budgets) {
			arg_budgets[0] = 10;
			arg_budgets[1] = 50;
			arg_n_budgets = 2;
		}
	}
	if (!arg_policies_given)
		for (int p = 0; p < COLS; p++)
			arg_policies[p] = true;
	if (!arg_settings[SETTING_IN_WINDOW] && !arg_settings[SETTING_AGNOSTIC])
		return usage_error("--settings: none given");
	qsort(arg_budgets, arg_n_budgets, sizeof(uint32_t), u32_cmp);
	for (unsigned t = 0; t < arg_n_tasks; t++)
		for (unsigned l = 0; l < arg_n_lengths; l++)
			if (arg_lengths[l] < kvd_task_min_length(arg_tasks[t]))
				return usage_error("--lengths: %s needs at least %u tokens",
				                   kvd_task_to_string(arg_tasks[t]),
				                   kvd_task_min_length(arg_tasks[t]));
	for (unsigned j = 0; arg_multi && j < arg_n_multi; j++)
		if (arg_multi_tenants[j].length < kvd_task_min_length(arg_multi_tenants[j].task))
			return usage_error("--multi-tenants: %s needs at least %u tokens",
			                   kvd_task_to_string(arg_multi_tenants[j].task),
			                   kvd_task_min_length(arg_multi_tenants[j].task));
	return 1;
}

static void quality_done(struct quality *Q) {
	for (int p = 0; p < COLS; p++)
		kvd_client_unref(Q->pol[p].client);
	for (unsigned j = 0; j < MULTI_MAX; j++)
		kvd_client_unref(Q->multi[j].client);
	kvd_client_unref(Q->ref.client);
	kvd_client_unref(Q->admin);
	daemon_stop(&Q->d);
	kvdlm_session_free(Q->s);
	kvdlm_indexmem_free(Q->im);
	free(Q->indexmem_path);
	kvdlm_model_free(Q->m);
	kvd_haystack_free(Q->hay);
	kvdlm_tokenizer_free(Q->tok);
	if (Q->samples_csv)
		fclose(Q->samples_csv);
	free(Q->cells);
	free(Q->full);
	free(Q->logits);
	free(Q->master_logits);
}

static int run(struct quality *Q, const char *cmdline) {
	_cleanup_(kvdlm_cache_freep) struct kvdlm_cache *boot = NULL;
	_cleanup_(freep) char *path = NULL;
	char err[KVDLM_ERROR_MAX];
	uint32_t lmax = 0;
	double seconds;
	int r;

	r = kvdlm_model_load(arg_model, &Q->m, err, sizeof(err));
	if (r < 0)
		return fail("%s", err);
	r = kvdlm_tokenizer_for_model(arg_model, Q->m->cfg.vocab, &Q->tok, err, sizeof(err));
	if (r < 0)
		return fail("%s", err);
	r = kvd_haystack_load(arg_haystack, Q->tok, &Q->hay);
	if (r < 0)
		return fail("%s: %s (--haystack)", arg_haystack, strerror(-r));
	Q->tables = Q->m->cfg.layers * Q->m->cfg.kv_heads;
	Q->vocab = Q->m->cfg.vocab;
	Q->slot_bytes = 2ull * Q->m->cfg.head_dim * sizeof(float);
	Q->obs_floats = (size_t)Q->m->cfg.q_heads * arg_window * Q->m->cfg.head_dim;
	if (!arg_indexmem && !arg_policies_given) {
		size_t n = strlen(arg_model);
		_cleanup_(freep) char *im = NULL;

		if (n > 6 && strcmp(arg_model + n - 6, ".kvdlm") == 0 &&
		    asprintf(&im, "%.*s" INDEXMEM_SUFFIX, (int)(n - 6), arg_model) < 0)
			return -ENOMEM;
		if (!im || access(im, F_OK) < 0) {
			fprintf(stderr, PROG ": no IndexMem weights for %s (%s): the columns that need "
			        "them are left out (train-indexmem.py makes them)\n", arg_model,
			        im ? im : "no default");
			for (int p = 0; p < COLS; p++)
				arg_policies[p] = arg_policies[p] && !col_indexmem(p);
		}
	}
	for (int p = 0; p < COLS && !Q->im; p++)
		if ((arg_policies[p] && col_indexmem(p)) ||
		    (arg_multi && p == KVD_POLICY_INDEXMEM && arg_multi_policy == KVD_POLICY_INDEXMEM)) {
			if (!arg_indexmem) {
				size_t n = strlen(arg_model);

				if (n > 6 && strcmp(arg_model + n - 6, ".kvdlm") == 0 &&
				    asprintf(&Q->indexmem_path, "%.*s" INDEXMEM_SUFFIX, (int)(n - 6), arg_model) < 0)
					return -ENOMEM;
				if (!Q->indexmem_path)
					return fail("--indexmem: no default for a model not named *.kvdlm (%s column)",
					            col_name(p));
				arg_indexmem = Q->indexmem_path;
			}
			r = kvdlm_indexmem_load(arg_indexmem, &Q->m->cfg, &Q->im, err, sizeof(err));
			if (r < 0)
				return fail("%s (--indexmem, for the %s column)", err, col_name(p));
			Q->iobs_floats = (size_t)arg_window * Q->im->index_heads * Q->im->index_dim;
			Q->index_bytes = Q->im->index_dim * sizeof(float);
			/* The master computes index keys and queries for the cells to copy. */
			Q->ref.indexed = true;
		}
	for (unsigned i = 0; i < arg_n_lengths; i++)
		lmax = MAX(lmax, arg_lengths[i]);
	for (unsigned j = 0; arg_multi && j < arg_n_multi; j++)
		lmax = MAX(lmax, arg_multi_tenants[j].length);
	if (lmax + GEN_MAX > Q->m->cfg.max_positions)
		fprintf(stderr, PROG ": warning: up to %u positions, more than the %u the model was "
		        "trained for\n", lmax + GEN_MAX, Q->m->cfg.max_positions);

	Q->cells = calloc((size_t)_SETTING_MAX * arg_n_tasks * arg_n_lengths * COLS *
	                          arg_n_budgets, sizeof(struct cell));
	Q->full = calloc((size_t)arg_n_tasks * arg_n_lengths, sizeof(struct full_cell));
	Q->logits = malloc(Q->vocab * sizeof(float));
	Q->master_logits = malloc(Q->vocab * sizeof(float));
	if (!Q->cells || !Q->full || !Q->logits || !Q->master_logits)
		return -ENOMEM;

	snprintf(Q->ref.name, sizeof(Q->ref.name), "q-full");
	for (int p = 0; p < COLS; p++) {
		Q->pol[p].policy = col_policy(p);
		if (p < _KVD_POLICY_MAX)
			snprintf(Q->pol[p].name, sizeof(Q->pol[p].name), "q-%s", kvd_policy_to_string(p));
		else {
			snprintf(Q->pol[p].name, sizeof(Q->pol[p].name), "%s",
			         variants[p - _KVD_POLICY_MAX].tenant);
			Q->pol[p].compensation = variants[p - _KVD_POLICY_MAX].compensation;
			Q->pol[p].form = variants[p - _KVD_POLICY_MAX].form;
			Q->pol[p].recall = variants[p - _KVD_POLICY_MAX].recall;
		}
		Q->pol[p].indexed = col_policy(p) == KVD_POLICY_INDEXMEM;
	}
	for (unsigned j = 0; j < MULTI_MAX; j++) {
		Q->multi[j].policy = arg_multi_policy;
		Q->multi[j].indexed = arg_multi_policy == KVD_POLICY_INDEXMEM;
		snprintf(Q->multi[j].name, sizeof(Q->multi[j].name), "m-%u", j);
	}
	if (mkdir(arg_out, 0755) < 0 && errno != EEXIST)
		return fail("%s: %s", arg_out, strerror(errno));
	if (asprintf(&path, "%s/samples.csv", arg_out) < 0)
		return -ENOMEM;
	Q->samples_csv = fopen(path, "we");
	if (!Q->samples_csv)
		return fail("%s: %s", path, strerror(errno));
	fprintf(Q->samples_csv, "setting,task,length,seed,policy,budget,correct,kept_fraction,round_ms,"
	                        "answer,output\n");

	r = daemon_start(Q);
	if (r < 0)
		return r;
	r = tenant_connect(Q, &Q->ref);
	for (int p = 0; r >= 0 && p < COLS; p++)
		if (p != KVD_POLICY_FULL && arg_policies[p])
			r = tenant_connect(Q, &Q->pol[p]);
	for (unsigned j = 0; r >= 0 && arg_multi && j < arg_n_multi; j++)
		r = tenant_connect(Q, &Q->multi[j]);
	if (r < 0)
		return r;
	/* The session needs a cache to start with; every sample resets it to its own. */
	r = kvdlm_cache_full_new(&Q->m->cfg, 1, &boot);
	if (r >= 0)
		r = kvdlm_session_new(Q->m, boot, &(struct kvdlm_session_opts){ arg_threads, 0, Q->im }, &Q->s);
	if (r < 0)
		return fail("starting the engine: %s", strerror(-r));

	fprintf(stderr, PROG ": %s, %u threads (%s); %u samples x %u tasks x %u lengths, %u budgets, "
	        "%s%s%s prefill\n", arg_model, kvdlm_session_threads(Q->s), kvdlm_simd_name(), arg_samples,
	        arg_n_tasks, arg_n_lengths, arg_n_budgets,
	        arg_settings[SETTING_IN_WINDOW] ? "in-window " : "",
	        arg_settings[SETTING_AGNOSTIC] ? "query-agnostic " : "", arg_direct ? "per-cell" : "shared");
	Q->t_start = now_s();
	Q->total_samples = (uint64_t)arg_samples * arg_n_tasks * arg_n_lengths;
	/* Samples outermost, so that a run stopped early (SIGINT, SIGTERM) has every cell. */
	for (uint32_t i = 0; i < arg_samples && !stop_requested; i++)
		for (unsigned ti = 0; ti < arg_n_tasks && !stop_requested; ti++)
			for (unsigned li = 0; li < arg_n_lengths && !stop_requested; li++) {
				r = run_sample(Q, ti, li, i);
				if (r < 0)
					return r;
			}
	if (arg_multi && !stop_requested) {
		r = run_multi(Q);
		if (r < 0)
			return r;
	}
	seconds = now_s() - Q->t_start;
	fflush(Q->samples_csv);
	r = write_reports(Q, cmdline, seconds);
	if (r < 0)
		return r;
	if (stop_requested)
		return fail("stopped by a signal after %" PRIu64 " of %" PRIu64 " samples%s: the tables "
		            "hold those", Q->done_samples, Q->total_samples,
		            arg_multi ? " (and no multi-tenant run)" : "");
	if (Q->mismatched)
		return fail("%" PRIu64 " of %" PRIu64 " samples: the daemon's full cache and the private "
		            "one disagree", Q->mismatched, Q->checked);
	return 0;
}

int main(int argc, char **argv) {
	struct quality Q = { .d.pid = 0 };
	_cleanup_(freep) char *cmdline = NULL;
	size_t len = 0;
	int r;

	r = parse_argv(argc, argv);
	if (r != 1)
		return r;
	for (int i = 1; i < argc; i++)
		len += strlen(argv[i]) + 1;
	cmdline = malloc(len + 16);
	if (cmdline) {
		strcpy(cmdline, "kvd-quality");
		for (int i = 1; i < argc; i++) {
			strcat(cmdline, " ");
			strcat(cmdline, argv[i]);
		}
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	/* A second signal kills as usual. */
	sigaction(SIGINT, &(struct sigaction){ .sa_handler = on_stop, .sa_flags = SA_RESTART | SA_RESETHAND }, NULL);
	sigaction(SIGTERM, &(struct sigaction){ .sa_handler = on_stop, .sa_flags = SA_RESTART | SA_RESETHAND }, NULL);
	r = run(&Q, cmdline ? cmdline : "kvd-quality");
	quality_done(&Q);
	return r < 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}
