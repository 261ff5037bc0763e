/*
 * A fake GDRCopy (libgdrapi.so.2) over the fake CUDA driver (cuda.c): pins of its "device
 * memory" and CPU mappings that are a separate alias of the allocation's memfd.
 *
 * As strict as the real one where xfer could get it wrong: pins must start on a 64 KiB GPU
 * page and cover whole pages of one live device allocation; a mapping has the pinned size;
 * copies must stay inside a live mapping; live pins and mappings are counted
 * (xfer_fake_gdr_live: a leak fails the test that looks). Faults on request:
 * xfer_fake_gdr_fail("gdr_pin_buffer", n) as in the fake driver; $XFER_FAKE_GDR_FAIL=gdr_open
 * makes the driver look unloaded.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "faults.h"

#define GPU_PAGE (64u << 10)
#define MAX_PINS 1024

typedef struct { unsigned long h; } gdr_mh_t;
struct gdr { int open; };

int xfer_fake_cuda_device_range(unsigned long long ptr, size_t len, int *fd, size_t *offset);

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct pin {
    int live;
    unsigned long long ptr;
    size_t len;
    int fd;
    size_t offset;
    unsigned char *map; /* NULL until gdr_map */
} pins[MAX_PINS + 1]; /* handle h = index; 0 is never used */

FAKE_FAULTS_DEFINE(xfer_fake_gdr_fail, "XFER_FAKE_GDR_FAIL", lock)

/* Live pins and live mappings, for leak checks. */
void xfer_fake_gdr_live(int *pinned, int *mapped) {
    pthread_mutex_lock(&lock);
    *pinned = *mapped = 0;
    for (int i = 1; i <= MAX_PINS; i++) {
        *pinned += pins[i].live;
        *mapped += pins[i].live && pins[i].map;
    }
    pthread_mutex_unlock(&lock);
}

void gdr_runtime_get_version(int *major, int *minor) {
    *major = 2;
    *minor = 4;
}

struct gdr *gdr_open(void) {
    pthread_mutex_lock(&lock);
    struct gdr *g = failing("gdr_open") ? NULL : calloc(1, sizeof *g);
    if (g) g->open = 1;
    pthread_mutex_unlock(&lock);
    return g;
}

int gdr_close(struct gdr *g) {
    free(g);
    return 0;
}

static struct pin *pin_of(gdr_mh_t mh) {
    return mh.h >= 1 && mh.h <= MAX_PINS && pins[mh.h].live ? &pins[mh.h] : NULL;
}

int gdr_pin_buffer(struct gdr *g, unsigned long addr, size_t size, uint64_t p2p_token,
                   uint32_t va_space, gdr_mh_t *handle) {
    (void)p2p_token;
    (void)va_space;
    pthread_mutex_lock(&lock);
    int rc = 0, fd = -1;
    size_t offset = 0;
    if (!g || failing("gdr_pin_buffer")) rc = -1;
    else if (addr % GPU_PAGE != 0 || size == 0 || size % GPU_PAGE != 0) rc = 22; /* EINVAL */
    else if (xfer_fake_cuda_device_range(addr, size, &fd, &offset) != 0) rc = 22;
    int h = 0;
    for (int i = 1; rc == 0 && i <= MAX_PINS; i++)
        if (!pins[i].live) { h = i; break; }
    if (rc == 0 && h == 0) rc = 12; /* ENOMEM */
    if (rc == 0) {
        pins[h] = (struct pin){.live = 1, .ptr = addr, .len = size, .fd = fd, .offset = offset};
        handle->h = (unsigned long)h;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

int gdr_unpin_buffer(struct gdr *g, gdr_mh_t handle) {
    pthread_mutex_lock(&lock);
    struct pin *p = pin_of(handle);
    int rc = !g || !p || p->map ? 22 : 0; /* unmap first, as GDRCopy requires */
    if (rc == 0) p->live = 0;
    pthread_mutex_unlock(&lock);
    return rc;
}

int gdr_map(struct gdr *g, gdr_mh_t handle, void **va, size_t size) {
    pthread_mutex_lock(&lock);
    struct pin *p = pin_of(handle);
    int rc = !g || !p || p->map || size != p->len || failing("gdr_map") ? 22 : 0;
    if (rc == 0) {
        void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, p->fd, (off_t)p->offset);
        if (m == MAP_FAILED) rc = 12;
        else *va = p->map = m;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

int gdr_unmap(struct gdr *g, gdr_mh_t handle, void *va, size_t size) {
    pthread_mutex_lock(&lock);
    struct pin *p = pin_of(handle);
    int rc = !g || !p || p->map != va || size != p->len ? 22 : 0;
    if (rc == 0) {
        munmap(p->map, p->len);
        p->map = NULL;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

static int inside(struct pin *p, const void *at, size_t len) {
    uintptr_t a = (uintptr_t)at, base = (uintptr_t)p->map;
    return p->map && a >= base && a - base <= p->len && len <= p->len - (a - base);
}

int gdr_copy_from_mapping(gdr_mh_t handle, void *dst, const void *src, size_t len) {
    pthread_mutex_lock(&lock);
    struct pin *p = pin_of(handle);
    int ok = p && inside(p, src, len);
    if (ok) memcpy(dst, src, len);
    pthread_mutex_unlock(&lock);
    if (!ok) {
        fprintf(stderr, "fake gdrapi: gdr_copy_from_mapping outside its mapping\n");
        abort(); /* the real one reads whatever lies there, or faults */
    }
    return 0;
}

int gdr_copy_to_mapping(gdr_mh_t handle, void *dst, const void *src, size_t len) {
    pthread_mutex_lock(&lock);
    struct pin *p = pin_of(handle);
    int ok = p && inside(p, dst, len);
    if (ok) {
        memcpy(dst, src, len);
        __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the real routine ends with a store fence */
    }
    pthread_mutex_unlock(&lock);
    if (!ok) {
        fprintf(stderr, "fake gdrapi: gdr_copy_to_mapping outside its mapping\n");
        abort();
    }
    return 0;
}
