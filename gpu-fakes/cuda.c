/*
 * A fake CUDA driver (libcuda.so.1) for machines without a GPU: the subset of the driver API
 * xfer calls, as unkind as a real GPU where xfer could get it wrong.
 *
 * - "Device memory" is a memfd whose own address range is PROT_NONE: the CPU reaches it only
 *   through this driver's copies, a GDRCopy mapping (the fake libgdrapi) or a dma-buf fd (a dup
 *   of the memfd). Code that dereferences a device pointer on the CPU segfaults.
 * - Device pointers are 4 KiB aligned and never 64 KiB aligned (real ones are only promised
 *   256 B), so code that assumes GPU-page alignment pins the wrong range.
 * - cuMemHostAlloc'd memory has a device pointer different from its host pointer (real UVA
 *   makes them equal; nothing promises it), PROT_NONE for the CPU as well.
 * - Every call but cuInit fails with CUDA_ERROR_NOT_INITIALIZED before cuInit, allocations and
 *   copies without a current context fail, copies outside an allocation fail.
 * - Faults on request: xfer_fake_cuda_fail("cuMemAlloc_v2", n) fails the next n calls of that
 *   entry point (-1: all), and $XFER_FAKE_CUDA_FAIL="cuInit,cuMemGetHandleForAddressRange" does
 *   it for every call of a process (for tests that start programs).
 * - "Kernel" stores (xfer_fake_gpu_store_u64) land late, from a thread of the fake GPU, and
 *   stores between two xfer_fake_gpu_threadfence_system() calls land in reverse order: a
 *   producer that publishes data and then a flag without the fence shows its consumer the flag
 *   first.
 * - xfer_fake_cuda_live() counts live allocations (a leak fails the test that looks).
 *
 * Test-only: built by `cargo xtask gpu-fakes` into target/gpu-fakes and found through
 * LD_LIBRARY_PATH. Nothing in xfer knows it is a fake.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "faults.h"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct fake_context *CUcontext;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_NOT_SUPPORTED = 801,
};

enum { MEMORYTYPE_HOST = 1, MEMORYTYPE_DEVICE = 2 };
enum { ATTRIBUTE_MEMORY_TYPE = 2, ATTRIBUTE_DEVICE_ORDINAL = 9 };
enum { RANGE_HANDLE_DMA_BUF_FD = 1 };

#define MAX_DEVICES 8
#define MAX_ALLOCATIONS 4096
#define GPU_PAGE (64u << 10)
#define HOST_PAGE 4096u

struct fake_context {
    int device;
};

/* One allocation: the memfd, the PROT_NONE range the pointers name, and the CPU alias. */
struct allocation {
    int live;
    int device;
    int host_mapped; /* cuMemHostAlloc: `cpu` is the host pointer the caller got */
    int fd;
    CUdeviceptr ptr;  /* device address (PROT_NONE for the CPU) */
    size_t len;
    void *reservation; /* what to munmap for `ptr` */
    size_t reservation_len;
    unsigned char *cpu; /* the alias this driver copies through */
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct allocation allocations[MAX_ALLOCATIONS];
static struct fake_context contexts[MAX_DEVICES];
static int initialised;
static __thread CUcontext current;
/* Set while a stream runs a host function: CUDA forbids API calls there (they fail). */
static __thread int in_host_function;

/* ---- faults ------------------------------------------------------------------------------ */

/* xfer_fake_cuda_fail("cuMemAlloc_v2", n): the next n calls fail (-1: all, 0: none). */
FAKE_FAULTS_DEFINE(xfer_fake_cuda_fail, "XFER_FAKE_CUDA_FAIL", lock)

static int devices(void) {
    const char *n = getenv("XFER_FAKE_CUDA_DEVICES");
    int count = n ? atoi(n) : 2;
    return count < 0 ? 0 : count > MAX_DEVICES ? MAX_DEVICES : count;
}

/* ---- allocations ------------------------------------------------------------------------- */

/* The allocation holding [ptr, ptr + len), by device or by host (CPU alias) address. Locked. */
static struct allocation *find(CUdeviceptr ptr, size_t len, int by_cpu_alias) {
    for (int i = 0; i < MAX_ALLOCATIONS; i++) {
        struct allocation *a = &allocations[i];
        if (!a->live) continue;
        CUdeviceptr base = by_cpu_alias ? (CUdeviceptr)(uintptr_t)a->cpu : a->ptr;
        if (ptr >= base && ptr - base <= a->len && len <= a->len - (ptr - base)) return a;
    }
    return NULL;
}

static CUresult allocate(size_t len, int device, int host_mapped, struct allocation **out) {
    if (len == 0) return CUDA_ERROR_INVALID_VALUE;
    size_t rounded = (len + HOST_PAGE - 1) / HOST_PAGE * HOST_PAGE;
    const char *limit = getenv("XFER_FAKE_CUDA_MEMORY_MB");
    size_t cap = (size_t)(limit ? atol(limit) : 1024) << 20;
    size_t used = 0;
    struct allocation *slot = NULL;
    for (int i = 0; i < MAX_ALLOCATIONS; i++) {
        if (allocations[i].live) used += allocations[i].len;
        else if (!slot) slot = &allocations[i];
    }
    if (!slot || used + rounded > cap) return CUDA_ERROR_OUT_OF_MEMORY;
    int fd = memfd_create("xfer-fake-gpu", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)rounded) != 0) {
        if (fd >= 0) close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    /* Reserve two GPU pages more than needed, and place the range one host page past a GPU
     * page boundary: 4 KiB aligned, never 64 KiB aligned. */
    size_t reservation_len = rounded + 2 * GPU_PAGE;
    void *reservation = mmap(NULL, reservation_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    unsigned char *cpu = mmap(NULL, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (reservation == MAP_FAILED || cpu == MAP_FAILED) {
        if (reservation != MAP_FAILED) munmap(reservation, reservation_len);
        if (cpu != MAP_FAILED) munmap(cpu, rounded);
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    uintptr_t at = ((uintptr_t)reservation + GPU_PAGE - 1) / GPU_PAGE * GPU_PAGE + HOST_PAGE;
    if (mmap((void *)at, rounded, PROT_NONE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
        munmap(reservation, reservation_len);
        munmap(cpu, rounded);
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    memset(cpu, 0, rounded);
    *slot = (struct allocation){
        .live = 1, .device = device, .host_mapped = host_mapped, .fd = fd, .ptr = at,
        .len = rounded, .reservation = reservation, .reservation_len = reservation_len, .cpu = cpu,
    };
    *out = slot;
    return CUDA_SUCCESS;
}

static void release(struct allocation *a) {
    munmap(a->reservation, a->reservation_len);
    munmap(a->cpu, a->len);
    close(a->fd);
    a->live = 0;
}

/* Where the CPU reaches `ptr` for `len` bytes: through the alias for driver memory, the
 * address itself for plain host memory (unified addressing). NULL: crosses an allocation. */
static unsigned char *reach(CUdeviceptr ptr, size_t len) {
    struct allocation *a = find(ptr, len, 0);
    if (a) return a->cpu + (ptr - a->ptr);
    if (find(ptr, 1, 0)) return NULL; /* starts inside an allocation, ends past it */
    a = find(ptr, len, 1);
    if (a) return a->cpu + (ptr - (CUdeviceptr)(uintptr_t)a->cpu);
    if (find(ptr, 1, 1)) return NULL;
    return (unsigned char *)(uintptr_t)ptr;
}

int xfer_fake_cuda_live(void) {
    pthread_mutex_lock(&lock);
    int n = 0;
    for (int i = 0; i < MAX_ALLOCATIONS; i++) n += allocations[i].live;
    pthread_mutex_unlock(&lock);
    return n;
}

/* For the fake libgdrapi: the memfd and offset of device memory [ptr, ptr + len). */
int xfer_fake_cuda_device_range(CUdeviceptr ptr, size_t len, int *fd, size_t *offset) {
    pthread_mutex_lock(&lock);
    struct allocation *a = find(ptr, len, 0);
    int ok = a && !a->host_mapped;
    if (ok) {
        *fd = a->fd;
        *offset = ptr - a->ptr;
    }
    pthread_mutex_unlock(&lock);
    return ok ? 0 : -1;
}

/* ---- the driver API ---------------------------------------------------------------------- */

#define ENTER(name)                                                   \
    pthread_mutex_lock(&lock);                                        \
    CUresult _r = CUDA_SUCCESS;                                       \
    if (!initialised) { _r = CUDA_ERROR_NOT_INITIALIZED; goto out; }  \
    if (in_host_function) { _r = CUDA_ERROR_NOT_PERMITTED; goto out; } \
    if (failing(name)) { _r = fault_result(name); goto out; }
#define LEAVE out: pthread_mutex_unlock(&lock); return _r;

static CUresult fault_result(const char *name) {
    if (strstr(name, "Alloc")) return CUDA_ERROR_OUT_OF_MEMORY;
    if (strstr(name, "Handle")) return CUDA_ERROR_NOT_SUPPORTED;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuInit(unsigned flags) {
    pthread_mutex_lock(&lock);
    CUresult r = flags != 0 ? CUDA_ERROR_INVALID_VALUE
                 : failing("cuInit") ? CUDA_ERROR_NOT_INITIALIZED
                                     : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS) initialised = 1;
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuDriverGetVersion(int *version) {
    *version = 12080;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    ENTER("cuDeviceGetCount");
    *count = devices();
    LEAVE
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    ENTER("cuDeviceGet");
    if (ordinal < 0 || ordinal >= devices()) { _r = CUDA_ERROR_INVALID_DEVICE; goto out; }
    *device = ordinal;
    LEAVE
}

CUresult cuDeviceGetName(char *name, int len, CUdevice device) {
    ENTER("cuDeviceGetName");
    if (device < 0 || device >= devices()) { _r = CUDA_ERROR_INVALID_DEVICE; goto out; }
    snprintf(name, (size_t)len, "xfer fake GPU %d", device);
    LEAVE
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *context, CUdevice device) {
    ENTER("cuDevicePrimaryCtxRetain");
    if (device < 0 || device >= devices()) { _r = CUDA_ERROR_INVALID_DEVICE; goto out; }
    contexts[device].device = device;
    *context = &contexts[device];
    LEAVE
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
    (void)device;
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext context) {
    ENTER("cuCtxSetCurrent");
    if (context && (context < contexts || context >= contexts + MAX_DEVICES)) {
        _r = CUDA_ERROR_INVALID_CONTEXT;
        goto out;
    }
    current = context;
    LEAVE
}

CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t len) {
    ENTER("cuMemAlloc_v2");
    if (!current) { _r = CUDA_ERROR_INVALID_CONTEXT; goto out; }
    struct allocation *a;
    _r = allocate(len, current->device, 0, &a);
    if (_r == CUDA_SUCCESS) *ptr = a->ptr;
    LEAVE
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
    ENTER("cuMemFree_v2");
    struct allocation *a = find(ptr, 0, 0);
    if (!a || a->ptr != ptr || a->host_mapped) { _r = CUDA_ERROR_INVALID_VALUE; goto out; }
    release(a);
    LEAVE
}

CUresult cuMemHostAlloc(void **host, size_t len, unsigned flags) {
    (void)flags;
    ENTER("cuMemHostAlloc");
    if (!current) { _r = CUDA_ERROR_INVALID_CONTEXT; goto out; }
    struct allocation *a;
    _r = allocate(len, current->device, 1, &a);
    if (_r == CUDA_SUCCESS) *host = a->cpu;
    LEAVE
}

CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *ptr, void *host, unsigned flags) {
    ENTER("cuMemHostGetDevicePointer_v2");
    struct allocation *a = find((CUdeviceptr)(uintptr_t)host, 1, 1);
    if (flags != 0 || !a || !a->host_mapped) { _r = CUDA_ERROR_INVALID_VALUE; goto out; }
    *ptr = a->ptr + ((unsigned char *)host - a->cpu);
    LEAVE
}

CUresult cuMemFreeHost(void *host) {
    ENTER("cuMemFreeHost");
    struct allocation *a = find((CUdeviceptr)(uintptr_t)host, 0, 1);
    if (!a || a->cpu != host || !a->host_mapped) { _r = CUDA_ERROR_INVALID_VALUE; goto out; }
    release(a);
    LEAVE
}

CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
    ENTER("cuPointerGetAttribute");
    struct allocation *a = find(ptr, 1, 0);
    if (!a) a = find(ptr, 1, 1);
    if (!a) { _r = CUDA_ERROR_INVALID_VALUE; goto out; }
    if (attribute == ATTRIBUTE_MEMORY_TYPE)
        *(unsigned *)data = a->host_mapped ? MEMORYTYPE_HOST : MEMORYTYPE_DEVICE;
    else if (attribute == ATTRIBUTE_DEVICE_ORDINAL)
        *(int *)data = a->device;
    else
        _r = CUDA_ERROR_INVALID_VALUE;
    LEAVE
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr ptr) {
    ENTER("cuMemGetAddressRange_v2");
    struct allocation *a = find(ptr, 1, 0);
    if (!a || a->host_mapped) { _r = CUDA_ERROR_INVALID_VALUE; goto out; }
    if (base) *base = a->ptr;
    if (size) *size = a->len;
    LEAVE
}

static CUresult copy(CUdeviceptr dst, CUdeviceptr src, size_t len) {
    unsigned char *to = reach(dst, len), *from = reach(src, len);
    if (!to || !from) return CUDA_ERROR_INVALID_VALUE;
    memmove(to, from, len);
    return CUDA_SUCCESS;
}

static void legacy_sync(void);

CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t len) {
    legacy_sync();
    ENTER("cuMemcpy");
    if (!current) { _r = CUDA_ERROR_INVALID_CONTEXT; goto out; }
    _r = copy(dst, src, len);
    LEAVE
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t len) {
    legacy_sync();
    ENTER("cuMemcpyHtoD_v2");
    if (!current || !find(dst, len, 0)) { _r = current ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_INVALID_CONTEXT; goto out; }
    _r = copy(dst, (CUdeviceptr)(uintptr_t)src, len);
    LEAVE
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t len) {
    legacy_sync();
    ENTER("cuMemcpyDtoH_v2");
    if (!current || !find(src, len, 0)) { _r = current ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_INVALID_CONTEXT; goto out; }
    _r = copy((CUdeviceptr)(uintptr_t)dst, src, len);
    LEAVE
}

CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr ptr, size_t len, int type,
                                       unsigned long long flags) {
    ENTER("cuMemGetHandleForAddressRange");
    struct allocation *a = find(ptr, len, 0);
    if (type != RANGE_HANDLE_DMA_BUF_FD || flags != 0 || !a || a->host_mapped ||
        ptr % HOST_PAGE != 0 || len % HOST_PAGE != 0) {
        _r = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    /* A real dma-buf starts at `ptr`; a memfd cannot be cut, so only ranges from the start of
     * an allocation are exported (the rest is refused, loudly, rather than misplaced). */
    if (ptr != a->ptr) { _r = CUDA_ERROR_NOT_SUPPORTED; goto out; }
    int fd = dup(a->fd);
    if (fd < 0) { _r = CUDA_ERROR_OUT_OF_MEMORY; goto out; }
    *(int *)handle = fd;
    LEAVE
}

/* ---- the fake GPU's stores --------------------------------------------------------------- */

#define MAX_PENDING 4096
static struct {
    CUdeviceptr ptr;
    uint64_t value;
    unsigned epoch;
} pending[MAX_PENDING];
static int pending_count;
static unsigned epoch;
static pthread_cond_t drained = PTHREAD_COND_INITIALIZER;
static pthread_cond_t queued = PTHREAD_COND_INITIALIZER;
static int gpu_thread_started;

/* Lands the oldest epoch's stores, last first (nothing orders stores without a fence). */
static void *gpu_thread(void *unused) {
    (void)unused;
    pthread_mutex_lock(&lock);
    for (;;) {
        while (pending_count == 0) pthread_cond_wait(&queued, &lock);
        pthread_mutex_unlock(&lock);
        struct timespec late = {0, 200 * 1000}; /* 200 µs: "the kernel is still running" */
        nanosleep(&late, NULL);
        pthread_mutex_lock(&lock);
        unsigned oldest = pending[0].epoch;
        int end = 0;
        while (end < pending_count && pending[end].epoch == oldest) end++;
        for (int i = end - 1; i >= 0; i--) {
            unsigned char *to = reach(pending[i].ptr, 8);
            if (to) __atomic_store_n((uint64_t *)to, pending[i].value, __ATOMIC_RELEASE);
            if (i > 0) {
                /* The stores of one epoch land one by one, far enough apart to be seen so. */
                pthread_mutex_unlock(&lock);
                nanosleep(&late, NULL);
                pthread_mutex_lock(&lock);
            }
        }
        memmove(pending, pending + end, sizeof pending[0] * (size_t)(pending_count - end));
        pending_count -= end;
        pthread_cond_broadcast(&drained);
    }
    return NULL;
}

/* A kernel's 8-byte store to device (or device-mapped) memory; lands later. */
int xfer_fake_gpu_store_u64(CUdeviceptr ptr, uint64_t value) {
    pthread_mutex_lock(&lock);
    int ok = pending_count < MAX_PENDING && find(ptr, 8, 0) != NULL;
    if (ok) {
        if (!gpu_thread_started) {
            pthread_t t;
            gpu_thread_started = pthread_create(&t, NULL, gpu_thread, NULL) == 0;
            if (gpu_thread_started) pthread_detach(t);
        }
        pending[pending_count].ptr = ptr;
        pending[pending_count].value = value;
        pending[pending_count].epoch = epoch;
        pending_count++;
        pthread_cond_signal(&queued);
    }
    pthread_mutex_unlock(&lock);
    return ok ? 0 : -1;
}

/* __threadfence_system(): the kernel's stores so far land before any it makes later. */
void xfer_fake_gpu_threadfence_system(void) {
    pthread_mutex_lock(&lock);
    epoch++;
    pthread_mutex_unlock(&lock);
}

/* cuCtxSynchronize for the fake kernels: waits until every store landed. */
CUresult cuCtxSynchronize(void) {
    pthread_mutex_lock(&lock);
    while (pending_count > 0) pthread_cond_wait(&drained, &lock);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

/* ---- streams ----------------------------------------------------------------------------- */

/* A stream runs its operations one after another on a thread of its own, later than the call
 * that queued them (as a GPU does): memory operations (write-value, wait-value: the GPU path
 * of xfer.ep signals its host proxy and waits for it with these), host functions (what the
 * tests use as kernels) and copies. A wait-value spins until the word reaches its value; a
 * host that never sets it leaves the stream stuck, as a real GPU would be. */
enum { OP_WRITE64, OP_WAIT64, OP_HOST_FUNC, OP_COPY };
enum { WAIT_VALUE_GEQ = 0, WAIT_VALUE_EQ = 1 };
#define MAX_OPS 4096

typedef void (*host_fn)(void *);

struct op {
    int kind;
    CUdeviceptr ptr, src;
    uint64_t value;
    unsigned flags;
    host_fn fn;
    void *arg;
};

struct fake_stream {
    pthread_mutex_t lock;
    pthread_cond_t changed;
    struct op ops[MAX_OPS];
    int head, count, running, closing;
    unsigned flags; /* CU_STREAM_NON_BLOCKING (1) or not */
    CUcontext context;
    pthread_t thread;
    struct fake_stream *next;
};
typedef struct fake_stream *CUstream;
enum { STREAM_NON_BLOCKING = 1 };

/* Every stream, for the legacy default stream's implicit synchronisation. */
static pthread_mutex_t streams_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fake_stream *streams;

/* A synchronous copy runs on the legacy default stream, which first waits for the work of
 * every blocking stream (one created without CU_STREAM_NON_BLOCKING): a host that copies
 * while such a stream waits on that host deadlocks, as on a GPU. */
static void legacy_sync(void) {
    pthread_mutex_lock(&streams_lock);
    for (struct fake_stream *s = streams; s; s = s->next) {
        if (s->flags & STREAM_NON_BLOCKING) continue;
        pthread_mutex_lock(&s->lock);
        while (s->count > 0) pthread_cond_wait(&s->changed, &s->lock);
        pthread_mutex_unlock(&s->lock);
    }
    pthread_mutex_unlock(&streams_lock);
}

static void *stream_thread(void *arg) {
    struct fake_stream *s = arg;
    current = s->context;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        while (s->count == 0 && !s->closing) pthread_cond_wait(&s->changed, &s->lock);
        if (s->count == 0) break;
        struct op op = s->ops[s->head];
        s->running = 1;
        pthread_mutex_unlock(&s->lock);
        struct timespec spin = {0, 20 * 1000};
        switch (op.kind) {
        case OP_WRITE64: {
            pthread_mutex_lock(&lock);
            unsigned char *to = reach(op.ptr, 8);
            if (to) __atomic_store_n((uint64_t *)to, op.value, __ATOMIC_RELEASE);
            pthread_mutex_unlock(&lock);
            break;
        }
        case OP_WAIT64:
            /* A stream being destroyed gives its waits up (the test that forgot to release
             * it fails instead of hanging). */
            while (!__atomic_load_n(&s->closing, __ATOMIC_ACQUIRE)) {
                pthread_mutex_lock(&lock);
                unsigned char *at = reach(op.ptr, 8);
                uint64_t v = at ? __atomic_load_n((uint64_t *)at, __ATOMIC_ACQUIRE) : op.value;
                pthread_mutex_unlock(&lock);
                if (op.flags == WAIT_VALUE_EQ ? v == op.value : v >= op.value) break;
                nanosleep(&spin, NULL);
            }
            break;
        case OP_HOST_FUNC:
            in_host_function = 1;
            op.fn(op.arg);
            in_host_function = 0;
            break;
        case OP_COPY:
            pthread_mutex_lock(&lock);
            copy(op.ptr, op.src, (size_t)op.value);
            pthread_mutex_unlock(&lock);
            break;
        }
        pthread_mutex_lock(&s->lock);
        s->head = (s->head + 1) % MAX_OPS;
        s->count--;
        s->running = 0;
        pthread_cond_broadcast(&s->changed);
    }
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

static CUresult enqueue(CUstream s, struct op op) {
    if (!s) return CUDA_ERROR_INVALID_VALUE; /* the legacy default stream is not faked */
    pthread_mutex_lock(&s->lock);
    CUresult r = CUDA_SUCCESS;
    if (s->count == MAX_OPS || s->closing) r = CUDA_ERROR_INVALID_VALUE;
    else {
        s->ops[(s->head + s->count) % MAX_OPS] = op;
        s->count++;
        pthread_cond_broadcast(&s->changed);
    }
    pthread_mutex_unlock(&s->lock);
    return r;
}

CUresult cuStreamCreate(CUstream *out, unsigned flags) {
    (void)flags;
    ENTER("cuStreamCreate");
    if (!current) { _r = CUDA_ERROR_INVALID_CONTEXT; goto out; }
    struct fake_stream *s = calloc(1, sizeof *s);
    if (!s) { _r = CUDA_ERROR_OUT_OF_MEMORY; goto out; }
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->changed, NULL);
    s->context = current;
    s->flags = flags;
    if (pthread_create(&s->thread, NULL, stream_thread, s) != 0) {
        pthread_mutex_destroy(&s->lock);
        pthread_cond_destroy(&s->changed);
        free(s);
        _r = CUDA_ERROR_OUT_OF_MEMORY;
        goto out;
    }
    pthread_mutex_lock(&streams_lock);
    s->next = streams;
    streams = s;
    pthread_mutex_unlock(&streams_lock);
    *out = s;
    LEAVE
}

CUresult cuStreamSynchronize(CUstream s) {
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    if (in_host_function) return CUDA_ERROR_NOT_PERMITTED;
    pthread_mutex_lock(&s->lock);
    while (s->count > 0) pthread_cond_wait(&s->changed, &s->lock);
    pthread_mutex_unlock(&s->lock);
    return CUDA_SUCCESS;
}

/* 0: idle; CUDA_ERROR_NOT_READY (600) while operations are queued. */
CUresult cuStreamQuery(CUstream s) {
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&s->lock);
    int busy = s->count > 0;
    pthread_mutex_unlock(&s->lock);
    return busy ? 600 : CUDA_SUCCESS;
}

/* Waits for what is queued (as the real one lets it finish), then frees the stream. */
CUresult cuStreamDestroy_v2(CUstream s) {
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&streams_lock);
    for (struct fake_stream **at = &streams; *at; at = &(*at)->next) {
        if (*at == s) {
            *at = s->next;
            break;
        }
    }
    pthread_mutex_unlock(&streams_lock);
    pthread_mutex_lock(&s->lock);
    __atomic_store_n(&s->closing, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&s->changed);
    pthread_mutex_unlock(&s->lock);
    pthread_join(s->thread, NULL);
    pthread_mutex_destroy(&s->lock);
    pthread_cond_destroy(&s->changed);
    free(s);
    return CUDA_SUCCESS;
}

CUresult cuStreamWriteValue64_v2(CUstream s, CUdeviceptr ptr, uint64_t value, unsigned flags) {
    ENTER("cuStreamWriteValue64_v2");
    if (!find(ptr, 8, 0) || ptr % 8 != 0) { _r = CUDA_ERROR_INVALID_VALUE; goto out; }
    _r = enqueue(s, (struct op){.kind = OP_WRITE64, .ptr = ptr, .value = value, .flags = flags});
    LEAVE
}

CUresult cuStreamWaitValue64_v2(CUstream s, CUdeviceptr ptr, uint64_t value, unsigned flags) {
    ENTER("cuStreamWaitValue64_v2");
    if (!find(ptr, 8, 0) || ptr % 8 != 0 || (flags != WAIT_VALUE_GEQ && flags != WAIT_VALUE_EQ)) {
        _r = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    _r = enqueue(s, (struct op){.kind = OP_WAIT64, .ptr = ptr, .value = value, .flags = flags});
    LEAVE
}

CUresult cuLaunchHostFunc(CUstream s, host_fn fn, void *arg) {
    ENTER("cuLaunchHostFunc");
    if (!fn) { _r = CUDA_ERROR_INVALID_VALUE; goto out; }
    _r = enqueue(s, (struct op){.kind = OP_HOST_FUNC, .fn = fn, .arg = arg});
    LEAVE
}

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t len, CUstream s) {
    ENTER("cuMemcpyAsync");
    if (!reach(dst, len) || !reach(src, len)) { _r = CUDA_ERROR_INVALID_VALUE; goto out; }
    _r = enqueue(s, (struct op){.kind = OP_COPY, .ptr = dst, .src = src, .value = len});
    LEAVE
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t len, CUstream s) {
    return cuMemcpyAsync(dst, (CUdeviceptr)(uintptr_t)src, len, s);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t len, CUstream s) {
    return cuMemcpyAsync((CUdeviceptr)(uintptr_t)dst, src, len, s);
}
