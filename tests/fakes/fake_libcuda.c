/*
 * A STAND-IN for NVIDIA's libcuda.so.1, for tests only: it is not the driver and touches no GPU.
 *
 * It exports the driver's process checkpoint API (cuCheckpointProcess*, CUDA 12.8+; restore GPU pairs
 * from 13.0) with the driver's per-process state machine
 *     RUNNING -lock-> LOCKED -checkpoint-> CHECKPOINTED -restore-> LOCKED -unlock-> RUNNING
 * and the CUresult codes r580 (580.159) was seen to return, so criuctl's ctypes binding and its rollback
 * can be tested on hosts without a GPU: a pid that does not exist gives CUDA_ERROR_OPERATING_SYSTEM, a
 * live one that never started CUDA CUDA_ERROR_NOT_INITIALIZED, a call in the wrong state
 * CUDA_ERROR_ILLEGAL_STATE, a lock past its timeout CUDA_ERROR_NOT_READY (the pid stays RUNNING), and a
 * restore whose GPU pairs are wrong CUDA_ERROR_INVALID_VALUE (the pid stays CHECKPOINTED).
 * State lives in files, because the dump and the restore run in different processes; or, for a job
 * that opened a stand-in CUDA context (tests/workloads/_standin_cuda.py), in the job's own memory, as
 * the real driver keeps it: CRIU then carries it to wherever the job is restored, and a source copy
 * left behind keeps its own.
 *
 * Environment (read at every call, so a test may change it between calls):
 *   FAKE_CUDA_STATE_DIR     one file per pid ("<state> <devices>"), and calls.log: one line per call
 *   FAKE_CUDA_VERSION       what cuDriverGetVersion returns (default 13000, i.e. r580)
 *   FAKE_CUDA_PIDS          comma list of the pids that use CUDA; unset: every live pid does
 *   FAKE_CUDA_CONTEXTS      a folder: a pid uses CUDA when it holds open a file "ctx-<hex address>" in
 *                           it (and FAKE_CUDA_PIDS is unset); its state and GPUs are the struct
 *                           fake_ctx at that address in its memory, read and written with
 *                           process_vm_readv/writev. A process forked from it inherits the file and the
 *                           memory but is not the struct's owner (its namespace PID differs): it has no
 *                           CUDA, as a DataLoader worker forked after CUDA started has none.
 *   FAKE_CUDA_LOCK_DELAY_MS how long a lock takes; past the lock's timeoutMs it fails with
 *                           CUDA_ERROR_NOT_READY after waiting timeoutMs, and the pid stays RUNNING
 *   FAKE_CUDA_DEVICES       comma list of GPU UUIDs a pid holds, recorded at checkpoint
 *   FAKE_CUDA_PRESENT       comma list of GPU UUIDs on this "node"; unset: any
 *   FAKE_NODE               a node's name: FAKE_CUDA_PRESENT_<FAKE_NODE>, where set, is that node's list
 *                           (one environment for every agent of a DaemonSet, each node its own GPUs)
 *   FAKE_CUDA_FAIL          comma list of OP[@PID][:CODE] (OP: lock, checkpoint, restore, unlock):
 *                           that call fails with CODE (default CUDA_ERROR_UNKNOWN), state unchanged
 *   FAKE_CUDA_FAIL_WHILE    a path: FAKE_CUDA_FAIL applies only while it exists (a passing failure)
 *
 * Built with -DFAKE_CUDA_NO_CHECKPOINT_API it exports no cuCheckpoint* symbol, like a pre-r570 driver.
 * Layouts are written from the CUDA Checkpointing reference; static asserts pin the 64-byte sizes.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "fake_node.h"

typedef int CUresult;
enum {
	CUDA_SUCCESS = 0,
	CUDA_ERROR_INVALID_VALUE = 1,
	CUDA_ERROR_NOT_INITIALIZED = 3,
	CUDA_ERROR_OPERATING_SYSTEM = 304,
	CUDA_ERROR_ILLEGAL_STATE = 401,
	CUDA_ERROR_NOT_READY = 600,
	CUDA_ERROR_NOT_SUPPORTED = 801,
	CUDA_ERROR_TIMEOUT = 909,
	CUDA_ERROR_UNKNOWN = 999,
};

typedef enum { STATE_RUNNING = 0, STATE_LOCKED = 1, STATE_CHECKPOINTED = 2, STATE_FAILED = 3 } CUprocessState;

typedef struct {
	unsigned char bytes[16];
} CUuuid;
typedef struct {
	unsigned int timeoutMs;
	unsigned int reserved0;
	unsigned long long reserved1[7];
} CUcheckpointLockArgs;
typedef struct {
	unsigned long long reserved[8];
} CUcheckpointCheckpointArgs, CUcheckpointUnlockArgs;
typedef struct {
	CUuuid oldUuid;
	CUuuid newUuid;
} CUcheckpointGpuPair;
typedef struct {
	CUcheckpointGpuPair *gpuPairs;
	unsigned int gpuPairsCount;
	char reserved[52 - sizeof(CUcheckpointGpuPair *)];
	unsigned long long reserved1;
} CUcheckpointRestoreArgs;

_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "lock args");
_Static_assert(sizeof(CUcheckpointCheckpointArgs) == 64, "checkpoint args");
_Static_assert(sizeof(CUcheckpointGpuPair) == 32, "gpu pair");
_Static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "restore args");
_Static_assert(offsetof(CUcheckpointRestoreArgs, gpuPairsCount) == sizeof(void *), "pair count");

static const struct {
	CUresult code;
	const char *name, *string;
} errors[] = {
	{CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
	{CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
	{CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
	{CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
	{CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
	{CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
	{CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
	{CUDA_ERROR_TIMEOUT, "CUDA_ERROR_TIMEOUT", "wait operation timed out"},
	{CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static int initialized;

struct pstate {
	int state;
	char devices[1024]; /* comma list of UUIDs, recorded at checkpoint */
	unsigned long ctx;  /* the address of the pid's struct fake_ctx; 0: state in FAKE_CUDA_STATE_DIR */
	unsigned long long memory, bytes; /* the context's "device memory" */
};

/* A stand-in CUDA context inside the job (tests/workloads/_standin_cuda.py lays it out the same). */
#define FAKE_CTX_MAGIC "FAKECTX1"
struct fake_ctx {
	char magic[8];
	int state;
	int owner; /* the namespace PID of the process that created it */
	char devices[240]; /* the GPUs it is on: set by the job, replaced by a restore's new GPUs */
	unsigned long long memory; /* the address of its "device memory"'s host copy */
	unsigned long long bytes;  /* and its size */
};
_Static_assert(sizeof(struct fake_ctx) == 272, "fake_ctx");

static const char *env(const char *name, const char *fallback)
{
	const char *v = getenv(name);
	return v && *v ? v : fallback;
}

static void log_call(const char *fmt, ...)
{
	char path[4096];
	FILE *f;
	va_list ap;

	snprintf(path, sizeof(path), "%s/calls.log", env("FAKE_CUDA_STATE_DIR", "/nonexistent"));
	f = fopen(path, "a");
	if (!f)
		return;
	va_start(ap, fmt);
	vfprintf(f, fmt, ap);
	va_end(ap);
	fputc('\n', f);
	fclose(f);
}

static void sleep_ms(unsigned long ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};

	while (nanosleep(&ts, &ts) && errno == EINTR)
		;
}

/* The address in "ctx-<hex>" of the first such file in FAKE_CUDA_CONTEXTS the pid holds open; 0: none. */
static unsigned long context_address(int pid)
{
	const char *dir = getenv("FAKE_CUDA_CONTEXTS");
	char fdpath[64], link[4096], prefix[4096];
	unsigned long addr = 0;
	int fd;

	if (!dir || !*dir)
		return 0;
	snprintf(prefix, sizeof(prefix), "%s/ctx-", dir);
	for (fd = 0; fd < 1024 && !addr; fd++) {
		ssize_t n;

		snprintf(fdpath, sizeof(fdpath), "/proc/%d/fd/%d", pid, fd);
		n = readlink(fdpath, link, sizeof(link) - 1);
		if (n <= 0)
			continue;
		link[n] = '\0';
		if (!strncmp(link, prefix, strlen(prefix)))
			addr = strtoul(link + strlen(prefix), NULL, 16);
	}
	return addr;
}

/* The pid's PID in its own namespace: the last field of NSpid in /proc/PID/status. */
static int ns_pid(int pid)
{
	char path[64], line[256];
	int out = -1;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/status", pid);
	f = fopen(path, "r");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f)) {
		if (!strncmp(line, "NSpid:", 6)) {
			char *last = strrchr(line, '\t');

			out = atoi(last ? last + 1 : line + 6);
		}
	}
	fclose(f);
	return out;
}

static int context_io(int pid, unsigned long addr, struct fake_ctx *ctx, int write)
{
	struct iovec local = {ctx, sizeof(*ctx)}, remote = {(void *)addr, sizeof(*ctx)};
	ssize_t n = write ? process_vm_writev(pid, &local, 1, &remote, 1, 0)
			  : process_vm_readv(pid, &local, 1, &remote, 1, 0);

	return n == (ssize_t)sizeof(*ctx) ? 0 : -1;
}

/* The "device memory"'s host copy: written at checkpoint, checked at restore, 1 MiB at a time. */
static int host_copy(int pid, unsigned long long addr, unsigned long long bytes, int write)
{
	static unsigned long long chunk[1 << 17], want[1 << 17];
	unsigned long long off;

	for (off = 0; off < bytes; off += sizeof(chunk)) {
		size_t n = bytes - off < sizeof(chunk) ? bytes - off : sizeof(chunk), i;
		struct iovec local = {write ? want : chunk, n}, remote = {(void *)(addr + off), n};

		for (i = 0; i < n / 8; i++)
			want[i] = (addr + off + 8 * i) ^ 0x5a5a5a5a5a5a5a5aULL;
		if (write ? process_vm_writev(pid, &local, 1, &remote, 1, 0) != (ssize_t)n
			  : process_vm_readv(pid, &local, 1, &remote, 1, 0) != (ssize_t)n || memcmp(chunk, want, n))
			return -1;
	}
	return 0;
}

static int state_path(int pid, char *path, size_t size)
{
	const char *dir = getenv("FAKE_CUDA_STATE_DIR");

	if (!dir || !*dir)
		return -1;
	snprintf(path, size, "%s/%d", dir, pid);
	return 0;
}

/* A pid without a file has never been touched: RUNNING, as every CUDA process starts. */
static int load(int pid, struct pstate *ps)
{
	char path[4096];
	FILE *f;

	memset(ps, 0, sizeof(*ps));
	if (!getenv("FAKE_CUDA_PIDS") && (ps->ctx = context_address(pid))) {
		struct fake_ctx ctx;

		if (context_io(pid, ps->ctx, &ctx, 0) || memcmp(ctx.magic, FAKE_CTX_MAGIC, 8))
			return -1;
		if (ctx.owner != ns_pid(pid))
			return 1; /* forked from the context's owner: no CUDA of its own */
		ps->state = ctx.state;
		snprintf(ps->devices, sizeof(ps->devices), "%.*s", (int)sizeof(ctx.devices), ctx.devices);
		ps->memory = ctx.memory;
		ps->bytes = ctx.bytes;
		return 0;
	}
	if (state_path(pid, path, sizeof(path)))
		return -1;
	f = fopen(path, "r");
	if (!f)
		return errno == ENOENT ? 0 : -1;
	if (fscanf(f, "%d %1023s", &ps->state, ps->devices) < 1)
		ps->state = STATE_RUNNING;
	fclose(f);
	return 0;
}

static int save(int pid, const struct pstate *ps)
{
	char path[4096], tmp[4200];
	FILE *f;

	if (ps->ctx) {
		struct fake_ctx ctx;

		if (context_io(pid, ps->ctx, &ctx, 0))
			return -1;
		ctx.state = ps->state;
		snprintf(ctx.devices, sizeof(ctx.devices), "%.*s", (int)sizeof(ctx.devices) - 1, ps->devices);
		return context_io(pid, ps->ctx, &ctx, 1);
	}
	if (state_path(pid, path, sizeof(path)))
		return -1;
	snprintf(tmp, sizeof(tmp), "%s.tmp", path);
	f = fopen(tmp, "w");
	if (!f)
		return -1;
	fprintf(f, "%d %s\n", ps->state, ps->devices[0] ? ps->devices : "-");
	fclose(f);
	return rename(tmp, path);
}

static int in_list(const char *list, const char *item);

static CUresult check_pid(int pid, struct pstate *ps)
{
	char text[16];
	int rc;

	if (pid <= 0 || (kill(pid, 0) && errno != EPERM))
		return CUDA_ERROR_OPERATING_SYSTEM;
	snprintf(text, sizeof(text), "%d", pid);
	if (!in_list(getenv("FAKE_CUDA_PIDS"), text))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (getenv("FAKE_CUDA_CONTEXTS") && !getenv("FAKE_CUDA_PIDS") && !context_address(pid))
		return CUDA_ERROR_NOT_INITIALIZED; /* holds no stand-in context */
	if ((rc = load(pid, ps)))
		return rc > 0 ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_UNKNOWN;
	if (!strcmp(ps->devices, "-"))
		ps->devices[0] = '\0';
	return CUDA_SUCCESS;
}

/* FAKE_CUDA_FAIL: "checkpoint", "checkpoint@123", "restore:801", "lock@123:909", comma-separated. */
static CUresult injected(const char *op, int pid)
{
	char list[1024], *save_ptr = NULL, *tok;
	const char *gate = getenv("FAKE_CUDA_FAIL_WHILE");

	if (gate && *gate && access(gate, F_OK))
		return CUDA_SUCCESS;
	snprintf(list, sizeof(list), "%s", env("FAKE_CUDA_FAIL", ""));
	for (tok = strtok_r(list, ",", &save_ptr); tok; tok = strtok_r(NULL, ",", &save_ptr)) {
		char *code = strchr(tok, ':'), *at;
		CUresult rc = CUDA_ERROR_UNKNOWN;

		if (code) {
			*code++ = '\0';
			rc = atoi(code);
		}
		at = strchr(tok, '@');
		if (at)
			*at++ = '\0';
		if (!strcmp(tok, op) && (!at || atoi(at) == pid))
			return rc;
	}
	return CUDA_SUCCESS;
}

static int all_zero(const void *p, size_t n)
{
	const unsigned char *b = p;

	while (n--)
		if (*b++)
			return 0;
	return 1;
}

/* Whether item is in the comma list (case aside); an unset list holds everything. */
static int in_list(const char *list, const char *item)
{
	size_t n = strlen(item);
	const char *p = list;

	if (!list)
		return 1;
	while (*p) {
		const char *end = strchr(p, ',');
		size_t len = end ? (size_t)(end - p) : strlen(p);

		if (len == n && !strncasecmp(p, item, n))
			return 1;
		if (!end)
			break;
		p = end + 1;
	}
	return 0;
}

static void uuid_text(const CUuuid *u, char out[41])
{
	const unsigned char *b = u->bytes;

	snprintf(out, 41, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
		 b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

CUresult cuInit(unsigned int flags)
{
	log_call("init");
	if (flags)
		return CUDA_ERROR_INVALID_VALUE;
	initialized = 1;
	return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *version)
{
	if (!version)
		return CUDA_ERROR_INVALID_VALUE;
	*version = atoi(env("FAKE_CUDA_VERSION", "13000"));
	return CUDA_SUCCESS;
}

static CUresult describe(CUresult code, const char **out, int want_name)
{
	size_t i;

	if (!out)
		return CUDA_ERROR_INVALID_VALUE;
	for (i = 0; i < sizeof(errors) / sizeof(errors[0]); i++) {
		if (errors[i].code == code) {
			*out = want_name ? errors[i].name : errors[i].string;
			return CUDA_SUCCESS;
		}
	}
	*out = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorName(CUresult code, const char **name)
{
	return describe(code, name, 1);
}

CUresult cuGetErrorString(CUresult code, const char **string)
{
	return describe(code, string, 0);
}

#ifndef FAKE_CUDA_NO_CHECKPOINT_API

/* The checks every transition makes, in the driver's order: the arguments, the pid, its state. */
static CUresult enter(int pid, struct pstate *ps, int bad_args, int from)
{
	CUresult rc;

	if (bad_args)
		return CUDA_ERROR_INVALID_VALUE;
	if ((rc = check_pid(pid, ps)))
		return rc;
	return ps->state == from ? CUDA_SUCCESS : CUDA_ERROR_ILLEGAL_STATE;
}

/* The transition once every check passed: an injected failure, or the new state saved. */
static CUresult leave(int pid, struct pstate *ps, const char *op, int to)
{
	CUresult rc;

	if ((rc = injected(op, pid)))
		return rc;
	ps->state = to;
	return save(pid, ps) ? CUDA_ERROR_UNKNOWN : CUDA_SUCCESS;
}

CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)
{
	unsigned int timeout = args ? args->timeoutMs : 0;
	unsigned long delay = strtoul(env("FAKE_CUDA_LOCK_DELAY_MS", "0"), NULL, 10);
	struct pstate ps;
	CUresult rc;

	log_call("lock %d timeout=%u", pid, timeout);
	rc = enter(pid, &ps, args && (args->reserved0 || !all_zero(args->reserved1, sizeof(args->reserved1))),
		   STATE_RUNNING);
	if (rc)
		return rc;
	if (timeout && delay > timeout) {
		sleep_ms(timeout);
		return CUDA_ERROR_NOT_READY; /* what r580 returns when the lock times out */
	}
	sleep_ms(delay);
	return leave(pid, &ps, "lock", STATE_LOCKED);
}

CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args)
{
	struct pstate ps;
	CUresult rc;

	log_call("checkpoint %d", pid);
	if ((rc = enter(pid, &ps, args && !all_zero(args, sizeof(*args)), STATE_LOCKED)))
		return rc;
	if (!ps.ctx) /* a context knows its GPUs; a pid of FAKE_CUDA_PIDS is told them */
		snprintf(ps.devices, sizeof(ps.devices), "%s", env("FAKE_CUDA_DEVICES", ""));
	if ((rc = injected("checkpoint", pid)))
		return rc;
	if (ps.bytes && host_copy(pid, ps.memory, ps.bytes, 1))
		return CUDA_ERROR_UNKNOWN;
	return leave(pid, &ps, "checkpoint", STATE_CHECKPOINTED);
}

/*
 * Pairs, when given, must name every checkpointed GPU, no other, and only GPUs present here as new ones.
 * (r580 refused a pair for a GPU the process did not use; whether for not being used or for not being
 * on the node, one GPU could not tell, so the stand-in takes the stricter reading.)
 */
static CUresult check_pairs(const struct pstate *ps, const CUcheckpointRestoreArgs *args)
{
	const char *present = node_getenv("FAKE_CUDA_PRESENT");
	char devices[1024], *save_ptr = NULL, *dev, text[41];
	unsigned int i, count = args ? args->gpuPairsCount : 0;

	if (count && !args->gpuPairs)
		return CUDA_ERROR_INVALID_VALUE;
	for (i = 0; i < count; i++) {
		uuid_text(&args->gpuPairs[i].newUuid, text);
		if (!in_list(present, text))
			return CUDA_ERROR_INVALID_VALUE;
		uuid_text(&args->gpuPairs[i].oldUuid, text);
		if (!in_list(ps->devices, text))
			return CUDA_ERROR_INVALID_VALUE;
	}
	snprintf(devices, sizeof(devices), "%s", ps->devices);
	for (dev = strtok_r(devices, ",", &save_ptr); dev; dev = strtok_r(NULL, ",", &save_ptr)) {
		int found = !count && in_list(present, dev);

		for (i = 0; i < count && !found; i++) {
			uuid_text(&args->gpuPairs[i].oldUuid, text);
			found = !strcasecmp(text, dev);
		}
		if (!found)
			return CUDA_ERROR_INVALID_VALUE;
	}
	return CUDA_SUCCESS;
}

CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)
{
	char pairs[4096] = "", old_text[41], new_text[41];
	unsigned int i, count = args && args->gpuPairs ? args->gpuPairsCount : 0;
	struct pstate ps;
	CUresult rc;

	for (i = 0; i < count; i++) {
		size_t len = strlen(pairs);

		uuid_text(&args->gpuPairs[i].oldUuid, old_text);
		uuid_text(&args->gpuPairs[i].newUuid, new_text);
		snprintf(pairs + len, sizeof(pairs) - len, "%s%s>%s", i ? "," : "", old_text, new_text);
	}
	log_call("restore %d pairs=%s", pid, pairs);
	if (!initialized)
		return CUDA_ERROR_NOT_INITIALIZED; /* without persistence mode the caller must cuInit */
	rc = enter(pid, &ps, args && (!all_zero(args->reserved, sizeof(args->reserved)) || args->reserved1),
		   STATE_CHECKPOINTED);
	if (rc || (rc = check_pairs(&ps, args)))
		return rc;
	if ((rc = injected("restore", pid)))
		return rc;
	if (ps.bytes && host_copy(pid, ps.memory, ps.bytes, 0))
		return CUDA_ERROR_UNKNOWN; /* the host copy did not come through the dump and restore intact */
	if (count) { /* the process is on the new GPUs now */
		char moved[1024] = "", *save_ptr = NULL, *dev;

		for (dev = strtok_r(ps.devices, ",", &save_ptr); dev; dev = strtok_r(NULL, ",", &save_ptr)) {
			size_t len = strlen(moved);

			for (i = 0; i < count; i++) {
				uuid_text(&args->gpuPairs[i].oldUuid, old_text);
				if (!strcasecmp(old_text, dev))
					uuid_text(&args->gpuPairs[i].newUuid, new_text), dev = new_text;
			}
			snprintf(moved + len, sizeof(moved) - len, "%s%s", len ? "," : "", dev);
		}
		snprintf(ps.devices, sizeof(ps.devices), "%s", moved);
	}
	return leave(pid, &ps, "restore", STATE_LOCKED);
}

CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args)
{
	struct pstate ps;
	CUresult rc;

	log_call("unlock %d", pid);
	if ((rc = enter(pid, &ps, args && !all_zero(args, sizeof(*args)), STATE_LOCKED)))
		return rc;
	return leave(pid, &ps, "unlock", STATE_RUNNING);
}

CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state)
{
	struct pstate ps;
	CUresult rc;

	log_call("state %d", pid);
	if (!state)
		return CUDA_ERROR_INVALID_VALUE;
	if ((rc = check_pid(pid, &ps)))
		return rc;
	*state = (CUprocessState)ps.state;
	return CUDA_SUCCESS;
}

/* The real driver names its helper thread inside the process; the stand-in has none, so the pid. */
CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
	struct pstate ps;
	CUresult rc;

	log_call("restore_tid %d", pid);
	if (!tid)
		return CUDA_ERROR_INVALID_VALUE;
	if ((rc = check_pid(pid, &ps)))
		return rc;
	*tid = pid;
	return CUDA_SUCCESS;
}

#endif /* FAKE_CUDA_NO_CHECKPOINT_API */
