/*
 * A STAND-IN for NVIDIA's libnccl.so.2, for tests only: it is not NCCL, holds no communicator and
 * touches no GPU. It exports the four functions criuctl's hook calls through ctypes on the libnccl a
 * job already loaded (hooks/criuctl_hook/nccl.py): ncclGetVersion, ncclCommSuspend, ncclCommResume and
 * ncclGetErrorString, with NCCL's ncclResult_t codes (0 success, 4 invalid argument, 5 invalid usage).
 * Built as libnccl.so so that the hook finds it by name in /proc/self/maps, as it finds torch's.
 *
 * Environment (read at every call):
 *   FAKE_NCCL_VERSION     what ncclGetVersion returns (NCCL_VERSION_CODE; default 22907, i.e. 2.29.7)
 *   FAKE_NCCL_SUSPEND_RC  what ncclCommSuspend returns (default 0)
 *   FAKE_NCCL_LOG         a file: one line per call, "suspend <comm> <flags>" or "resume <comm>"
 */
#include <stdio.h>
#include <stdlib.h>

static int env_int(const char *name, int fallback) {
    const char *v = getenv(name);
    return v && *v ? atoi(v) : fallback;
}

static void log_call(const char *what, void *comm, int flags) {
    const char *path = getenv("FAKE_NCCL_LOG");
    FILE *f = path ? fopen(path, "a") : NULL;
    if (!f)
        return;
    if (flags >= 0)
        fprintf(f, "%s %p %d\n", what, comm, flags);
    else
        fprintf(f, "%s %p\n", what, comm);
    fclose(f);
}

int ncclGetVersion(int *version) {
    if (!version)
        return 4;
    *version = env_int("FAKE_NCCL_VERSION", 22907);
    return 0;
}

int ncclCommSuspend(void *comm, int flags) {
    if (!comm || flags != 1)
        return 4;
    log_call("suspend", comm, flags);
    return env_int("FAKE_NCCL_SUSPEND_RC", 0);
}

int ncclCommResume(void *comm) {
    if (!comm)
        return 4;
    log_call("resume", comm, -1);
    return 0;
}

const char *ncclGetErrorString(int result) {
    switch (result) {
    case 0: return "no error";
    case 4: return "invalid argument";
    case 5: return "invalid usage";
    default: return "stand-in NCCL error";
    }
}
