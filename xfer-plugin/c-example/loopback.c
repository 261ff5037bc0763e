/*
 * loopback: an xfer backend plugin written in C against include/xfer_plugin.h alone.
 *
 * A "NIC" in the same process (like the mock): every Domain opened by this library joins one
 * in-process fabric, where writes and reads are memcpy between registered regions, checked
 * against keys and bounds the way a NIC checks them. Operations complete at post time and are
 * reported at the next poll; an arrival wakes the receiving Domain's engine.
 *
 * It is the vendor's starting point and the ABI's proof: `cargo xtask test` builds it with
 * `cc -Wall -Wextra -Werror` and runs `xfer conformance --plugin libxfer_loopback.so` on it.
 *
 * Threading: the engine calls each Domain from one worker thread at a time, but several
 * engines (several workers) use Domains of this library at once, and a Domain's writes reach
 * other Domains' memory and queues, so one mutex guards the whole fabric. Wakers and the
 * log function may be called from any thread.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "xfer_plugin.h"

#define ADDR_LEN 12 /* "LOOP" + 8 bytes of a never-reused Domain id */

struct region {
    uint64_t local_key, remote_key, ptr, len;
    int remote_write, remote_read;
    struct region *next;
};

struct event {
    XferRawEvent raw;   /* raw.data points into `bytes` when set */
    uint8_t *bytes;
    struct event *next;
};

struct waiting_send {   /* a message with no posted receive buffer yet */
    uint64_t sender, wr_id;
    uint8_t *data;
    size_t len;
    struct waiting_send *next;
};

struct domain {
    uint64_t id;
    struct region *regions;
    struct event *events, *events_tail;
    size_t *recv_lens;  /* posted receive buffers (lengths), a FIFO */
    size_t recv_head, recv_count, recv_cap;
    struct waiting_send *waiting, *waiting_tail;
    const void *wake_ctx;
    XferWakeFn wake;
    struct domain *next;
};

static pthread_mutex_t fabric = PTHREAD_MUTEX_INITIALIZER;
static struct domain *domains;
static uint64_t next_id = 1, next_key = 1;
static XferLogFn host_log;
static uint32_t host_log_level;

static void say(uint32_t level, const char *fmt, ...) {
    if (!host_log || level > host_log_level) return;
    char text[256];
    va_list args;
    va_start(args, fmt);
    vsnprintf(text, sizeof text, fmt, args);
    va_end(args);
    static const char target[] = "loopback";
    XferRawBytes t = {(const uint8_t *)target, sizeof target - 1};
    XferRawBytes m = {(const uint8_t *)text, strlen(text)};
    host_log(level, t, m);
}

static int32_t fail(XferRawError *err, XferDomainErrorKind kind, const char *fmt, ...) {
    if (err) {
        va_list args;
        va_start(args, fmt);
        int n = vsnprintf((char *)err->message, sizeof err->message, fmt, args);
        va_end(args);
        err->kind = kind;
        err->len = n < 0 ? 0 : (n >= (int)sizeof err->message ? sizeof err->message - 1 : (uint32_t)n);
    }
    return XFER_STATUS_ERROR;
}

static void address_of(uint64_t id, uint8_t out[ADDR_LEN]) {
    memcpy(out, "LOOP", 4);
    memcpy(out + 4, &id, 8);
}

/* The live Domain with this address, or NULL (never opened, or closed). Fabric locked. */
static struct domain *lookup(XferRawBytes addr) {
    if (addr.len != ADDR_LEN || memcmp(addr.ptr, "LOOP", 4) != 0) return NULL;
    uint64_t id;
    memcpy(&id, addr.ptr + 4, 8);
    for (struct domain *d = domains; d; d = d->next)
        if (d->id == id) return d;
    return NULL;
}

static struct domain *by_id(uint64_t id) {
    for (struct domain *d = domains; d; d = d->next)
        if (d->id == id) return d;
    return NULL;
}

/* Queues an event (copying `bytes`) and wakes the Domain's engine. Fabric locked. */
static void push(struct domain *d, uint32_t kind, uint32_t error_kind, uint64_t wr_id,
                 uint32_t imm, const void *bytes, size_t len) {
    struct event *e = calloc(1, sizeof *e);
    if (!e) abort(); /* out of memory: nothing sane to report it through */
    e->raw.kind = kind;
    e->raw.error_kind = error_kind;
    e->raw.wr_id = wr_id;
    e->raw.imm = imm;
    if (len) {
        e->bytes = malloc(len);
        if (!e->bytes) abort();
        memcpy(e->bytes, bytes, len);
    }
    e->raw.data.ptr = e->bytes;
    e->raw.data.len = len;
    if (d->events_tail) d->events_tail->next = e; else d->events = e;
    d->events_tail = e;
    if (d->wake) d->wake(d->wake_ctx);
}

static void push_failed(struct domain *d, uint64_t wr_id, XferDomainErrorKind kind, const char *text) {
    push(d, XFER_EVENT_FAILED, kind, wr_id, 0, text, strlen(text));
}

/* Delivers a message from Domain `sender_id` into the receiver's oldest posted buffer and
 * completes it at the sender. A message larger than the buffer fails, and the buffer stays
 * posted. The fabric knows who sent it, so the event names the sender (ABI 7's
 * XFER_EVENT_MESSAGE_FROM: the address's length, the address, then the message). */
static void deliver(struct domain *to, struct domain *from, uint64_t sender_id, uint64_t wr_id,
                    const uint8_t *data, size_t len) {
    size_t buf_len = to->recv_lens[to->recv_head];
    if (len > buf_len) {
        if (from) push_failed(from, wr_id, XferDomainErrorKind_RemoteAccess, "message larger than the receive buffer");
        return;
    }
    to->recv_head = (to->recv_head + 1) % to->recv_cap;
    to->recv_count--;
    uint8_t *framed = malloc(1 + ADDR_LEN + len);
    if (!framed) abort();
    framed[0] = ADDR_LEN;
    address_of(sender_id, framed + 1);
    if (len) memcpy(framed + 1 + ADDR_LEN, data, len);
    push(to, XFER_EVENT_MESSAGE_FROM, 0, 0, 0, framed, 1 + ADDR_LEN + len);
    free(framed);
    if (from) push(from, XFER_EVENT_DONE, 0, wr_id, 0, NULL, 0);
}

static int32_t parse_options(XferRawBytes options, XferRawError *err) {
    /* Flat "key=value\n" lines (XFER_OPTIONS_FLAT). The engine passes connect_ms to every
     * backend; anything else is a typo the user should hear about. */
    const char *p = (const char *)options.ptr, *end = p + options.len;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        if (!nl) nl = end;
        const char *eq = memchr(p, '=', (size_t)(nl - p));
        size_t key_len = eq ? (size_t)(eq - p) : (size_t)(nl - p);
        if (!(key_len == 10 && memcmp(p, "connect_ms", 10) == 0))
            return fail(err, XferDomainErrorKind_InvalidArgument,
                        "[backends.loopback]: unknown option %.*s (known: connect_ms)", (int)key_len, p);
        p = nl + 1;
    }
    return XFER_STATUS_OK;
}

static int32_t lb_open(XferRawBytes nic, XferRawBytes options, void **out, XferRawError *err) {
    if (parse_options(options, err) != XFER_STATUS_OK) return XFER_STATUS_ERROR;
    struct domain *d = calloc(1, sizeof *d);
    if (!d) return fail(err, XferDomainErrorKind_Other, "out of memory");
    pthread_mutex_lock(&fabric);
    d->id = next_id++;
    d->next = domains;
    domains = d;
    pthread_mutex_unlock(&fabric);
    say(XFER_LOG_DEBUG, "loopback NIC %.*s opened as Domain %llu", (int)nic.len, (const char *)nic.ptr,
        (unsigned long long)d->id);
    *out = d;
    return XFER_STATUS_OK;
}

static void lb_close(void *handle) {
    struct domain *d = handle;
    pthread_mutex_lock(&fabric);
    for (struct domain **p = &domains; *p; p = &(*p)->next)
        if (*p == d) { *p = d->next; break; }
    /* Messages waiting here fail at their senders; ours waiting elsewhere are dropped. */
    for (struct waiting_send *w = d->waiting, *next; w; w = next) {
        next = w->next;
        struct domain *sender = by_id(w->sender);
        if (sender) push_failed(sender, w->wr_id, XferDomainErrorKind_PeerUnreachable, "the receiver closed");
        free(w->data);
        free(w);
    }
    for (struct domain *o = domains; o; o = o->next) {
        struct waiting_send **p = &o->waiting;
        o->waiting_tail = NULL;
        while (*p) {
            if ((*p)->sender == d->id) {
                struct waiting_send *gone = *p;
                *p = gone->next;
                free(gone->data);
                free(gone);
            } else {
                o->waiting_tail = *p;
                p = &(*p)->next;
            }
        }
    }
    pthread_mutex_unlock(&fabric);
    for (struct region *r = d->regions, *next; r; r = next) { next = r->next; free(r); }
    for (struct event *e = d->events, *next; e; e = next) { next = e->next; free(e->bytes); free(e); }
    free(d->recv_lens);
    free(d);
}

static size_t lb_address(void *handle, uint8_t *buf, size_t cap) {
    struct domain *d = handle;
    if (cap < ADDR_LEN) return 0;
    address_of(d->id, buf);
    return ADDR_LEN;
}

static int32_t lb_register(void *handle, const XferRawRegion *region, XferRegistration *out, XferRawError *err) {
    struct domain *d = handle;
    if (region->device_kind != XFER_DEVICE_HOST)
        return fail(err, XferDomainErrorKind_InvalidArgument, "loopback registers host memory only");
    struct region *r = calloc(1, sizeof *r);
    if (!r) return fail(err, XferDomainErrorKind_Other, "out of memory");
    pthread_mutex_lock(&fabric);
    r->local_key = next_key++;
    r->remote_key = (region->remote_write || region->remote_read) ? next_key++ : 0;
    r->ptr = region->ptr;
    r->len = region->len;
    r->remote_write = region->remote_write != 0;
    r->remote_read = region->remote_read != 0;
    r->next = d->regions;
    d->regions = r;
    pthread_mutex_unlock(&fabric);
    out->local_key = r->local_key;
    out->remote_key = r->remote_key;
    return XFER_STATUS_OK;
}

static int32_t lb_deregister(void *handle, uint64_t local_key, XferRawError *err) {
    struct domain *d = handle;
    pthread_mutex_lock(&fabric);
    for (struct region **p = &d->regions; *p; p = &(*p)->next) {
        if ((*p)->local_key == local_key) {
            struct region *gone = *p;
            *p = gone->next;
            pthread_mutex_unlock(&fabric);
            free(gone);
            return XFER_STATUS_OK;
        }
    }
    pthread_mutex_unlock(&fabric);
    return fail(err, XferDomainErrorKind_InvalidArgument, "local key %llu is not registered",
                (unsigned long long)local_key);
}

static int inside(const struct region *r, uint64_t addr, uint64_t len) {
    return addr >= r->ptr && addr + len >= addr && addr + len <= r->ptr + r->len;
}

static struct region *local_region(struct domain *d, uint64_t key, uint64_t addr, uint64_t len) {
    for (struct region *r = d->regions; r; r = r->next)
        if (r->local_key == key) return inside(r, addr, len) ? r : NULL;
    return NULL;
}

static struct region *remote_region(struct domain *d, uint64_t key, uint64_t addr, uint64_t len, int write) {
    for (struct region *r = d->regions; r; r = r->next)
        if (r->remote_key == key && key != 0)
            return inside(r, addr, len) && (write ? r->remote_write : r->remote_read) ? r : NULL;
    return NULL;
}

/* One RDMA write (write = 1, with an optional immediate) or read, completed now. */
static int32_t rdma(struct domain *d, int write, uint64_t wr_id, XferRawBytes peer, uint64_t local_addr,
                    uint64_t local_key, uint64_t remote_addr, uint64_t remote_key, uint64_t len,
                    int has_imm, uint32_t imm, XferRawError *err) {
    pthread_mutex_lock(&fabric);
    /* A zero-byte write has no source (local key 0); its destination is still checked. */
    if (len > 0 && !local_region(d, local_key, local_addr, len)) {
        pthread_mutex_unlock(&fabric);
        return fail(err, XferDomainErrorKind_InvalidArgument, "local range is not inside local key %llu",
                    (unsigned long long)local_key);
    }
    struct domain *target = lookup(peer);
    if (!target) {
        push_failed(d, wr_id, XferDomainErrorKind_PeerUnreachable, "no loopback NIC has that address");
    } else if (!remote_region(target, remote_key, remote_addr, len, write)) {
        push_failed(d, wr_id, XferDomainErrorKind_RemoteAccess,
                    write ? "remote key, range or write permission refused"
                          : "remote key, range or read permission refused");
    } else {
        if (len) {
            if (write) memmove((void *)(uintptr_t)remote_addr, (const void *)(uintptr_t)local_addr, len);
            else memmove((void *)(uintptr_t)local_addr, (const void *)(uintptr_t)remote_addr, len);
        }
        /* The data is in place before the immediate is queued: an arrival means visible.
         * Its bytes name the sender, so the engine can bound what each peer makes it keep. */
        if (write && has_imm) {
            uint8_t from[ADDR_LEN];
            address_of(d->id, from);
            push(target, XFER_EVENT_IMM, 0, 0, imm, from, ADDR_LEN);
        }
        push(d, XFER_EVENT_DONE, 0, wr_id, 0, NULL, 0);
    }
    pthread_mutex_unlock(&fabric);
    return XFER_STATUS_OK;
}

static int32_t lb_post_write(void *handle, const XferRawWrite *wr, XferRawError *err) {
    return rdma(handle, 1, wr->wr_id, wr->peer, wr->local_addr, wr->local_key, wr->remote_addr,
                wr->remote_key, wr->len, wr->has_imm != 0, wr->imm, err);
}

static int32_t lb_post_read(void *handle, const XferRawRead *rd, XferRawError *err) {
    return rdma(handle, 0, rd->wr_id, rd->peer, rd->local_addr, rd->local_key, rd->remote_addr,
                rd->remote_key, rd->len, 0, 0, err);
}

static int32_t lb_post_send(void *handle, uint64_t wr_id, XferRawBytes peer, XferRawBytes data, XferRawError *err) {
    struct domain *d = handle;
    pthread_mutex_lock(&fabric);
    struct domain *target = lookup(peer);
    if (!target) {
        push_failed(d, wr_id, XferDomainErrorKind_PeerUnreachable, "no loopback NIC has that address");
    } else if (target->recv_count > 0) {
        deliver(target, d, d->id, wr_id, data.ptr, data.len);
    } else {
        /* No receive buffer posted: the message waits, as on a NIC that retries. */
        struct waiting_send *w = calloc(1, sizeof *w);
        uint8_t *copy = data.len ? malloc(data.len) : NULL;
        if (!w || (data.len && !copy)) {
            free(w);
            free(copy);
            pthread_mutex_unlock(&fabric);
            return fail(err, XferDomainErrorKind_Other, "out of memory");
        }
        if (data.len) memcpy(copy, data.ptr, data.len);
        w->sender = d->id;
        w->wr_id = wr_id;
        w->data = copy;
        w->len = data.len;
        if (target->waiting_tail) target->waiting_tail->next = w; else target->waiting = w;
        target->waiting_tail = w;
    }
    pthread_mutex_unlock(&fabric);
    return XFER_STATUS_OK;
}

static int32_t lb_post_recvs(void *handle, size_t buf_len, size_t count, XferRawError *err) {
    struct domain *d = handle;
    if (buf_len == 0) return fail(err, XferDomainErrorKind_InvalidArgument, "receive buffers of 0 bytes");
    pthread_mutex_lock(&fabric);
    if (d->recv_count + count > d->recv_cap) {
        size_t cap = (d->recv_count + count) * 2;
        size_t *grown = malloc(cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&fabric);
            return fail(err, XferDomainErrorKind_Other, "out of memory");
        }
        for (size_t i = 0; i < d->recv_count; i++) grown[i] = d->recv_lens[(d->recv_head + i) % d->recv_cap];
        free(d->recv_lens);
        d->recv_lens = grown;
        d->recv_head = 0;
        d->recv_cap = cap;
    }
    for (size_t i = 0; i < count; i++) d->recv_lens[(d->recv_head + d->recv_count++) % d->recv_cap] = buf_len;
    /* Waiting messages take the new buffers, oldest first. */
    while (d->recv_count > 0 && d->waiting) {
        struct waiting_send *w = d->waiting;
        d->waiting = w->next;
        if (!d->waiting) d->waiting_tail = NULL;
        deliver(d, by_id(w->sender), w->sender, w->wr_id, w->data, w->len);
        free(w->data);
        free(w);
    }
    pthread_mutex_unlock(&fabric);
    return XFER_STATUS_OK;
}

static int32_t lb_poll(void *handle, void *sink, XferEventSink sink_fn, XferRawError *err) {
    (void)err;
    struct domain *d = handle;
    pthread_mutex_lock(&fabric);
    struct event *events = d->events;
    d->events = d->events_tail = NULL;
    pthread_mutex_unlock(&fabric);
    /* Handed over outside the lock: the engine's sink copies what it keeps. */
    for (struct event *e = events, *next; e; e = next) {
        next = e->next;
        sink_fn(sink, &e->raw);
        free(e->bytes);
        free(e);
    }
    return XFER_STATUS_OK;
}

static uint32_t lb_set_waker(void *handle, const void *ctx, XferWakeFn wake) {
    struct domain *d = handle;
    pthread_mutex_lock(&fabric);
    d->wake_ctx = ctx;
    d->wake = wake;
    pthread_mutex_unlock(&fabric);
    return 1;
}

static int32_t lb_capabilities(void *handle, XferRawCapabilities *out) {
    (void)handle;
    memset(out, 0, sizeof *out);
    out->max_address_len = ADDR_LEN;
    out->memory_kinds = XFER_MEMORY_HOST;
    out->flags = XFER_CAP_IMMEDIATES | XFER_CAP_ZERO_BYTE_WRITES;
    return XFER_STATUS_OK;
}

static void lb_set_log(XferLogFn log, uint32_t max_level) {
    host_log = log;
    host_log_level = max_level;
}

static const char NAME[] = "loopback";

static const XferPluginTable TABLE = {
    .header = {XFER_ABI_VERSION, sizeof(XferPluginTable)},
    .name = {(const uint8_t *)NAME, sizeof NAME - 1},
    .open = lb_open,
    .close = lb_close,
    .address = lb_address,
    .register_ = lb_register,
    .deregister = lb_deregister,
    .post_write = lb_post_write,
    .post_send = lb_post_send,
    .post_recvs = lb_post_recvs,
    .poll = lb_poll,
    .set_waker = lb_set_waker,
    .post_read = lb_post_read,
    .capabilities = lb_capabilities,
    .set_log = lb_set_log,
    .options_format = XFER_OPTIONS_FLAT,
};

/* The entry point the engine looks up: xfer_plugin_entry_<backend name> (TABLE's name). */
XFER_PLUGIN_ENTRY(loopback) { return &TABLE; }
