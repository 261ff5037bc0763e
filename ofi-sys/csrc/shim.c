/* A flat, stable C surface over libfabric's inline fi_* calls, for Rust.
 *
 * libfabric's public calls are static inline functions going through per-object ops tables,
 * so they cannot be called from Rust directly. This file wraps the handful xfer needs, built
 * against the system headers (so every struct layout is the real one), and requests API
 * version 1.17 so the same binary runs against newer libfabric (2.x keeps the soname).
 */
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_ext.h>
#include <rdma/fi_rma.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The API version asked of fi_getinfo: the newest that both the headers this was built
 * against and the library loaded at run time offer (at least 1.17, what the shim needs):
 * a newer library (AWS's 2.x) enables what it gates on the version, an older one still
 * works. */
static uint32_t xfer_fi_api(void) {
    uint32_t built = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
    uint32_t loaded = fi_version();
    uint32_t v = loaded < built ? loaded : built;
    return v < FI_VERSION(1, 17) ? FI_VERSION(1, 17) : v;
}
#define XFER_FI_API xfer_fi_api()

/* Endpoint options that exist only in newer headers (enum values, so no #ifdef): built in
 * when the headers have them; at run time an older library refuses them (-FI_ENOPROTOOPT),
 * which the shim reports as "not set" rather than failing. */
#define XFER_HEADERS_AT_LEAST(major, minor) \
    (FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION) >= FI_VERSION(major, minor))

/* The API version in use, for `xfer doctor` and logs. */
uint32_t xfer_ofi_api_version(void) { return xfer_fi_api(); }

typedef struct xfer_ofi_ep {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_ep *ep;
    struct fid_av *av;
    struct fid_cq *cq;
} xfer_ofi_ep;

/* What the Rust side needs to know about the chosen provider. */
typedef struct xfer_ofi_attr {
    int mr_local;     /* FI_MR_LOCAL: local buffers need a registered descriptor */
    int mr_virt_addr; /* FI_MR_VIRT_ADDR: peers address regions by virtual address */
    int mr_prov_key;  /* FI_MR_PROV_KEY: the provider picks keys */
    int mr_endpoint;  /* FI_MR_ENDPOINT: regions are bound to the endpoint */
    uint64_t mr_mode;
    size_t cq_data_size;
    size_t max_msg_size;
    int rma_read; /* FI_READ | FI_REMOTE_READ were granted: RDMA reads work */
    int hmem;     /* FI_HMEM was granted: device (CUDA) memory is registered as such */
    /* FI_OPT_CUDA_API_PERMITTED = false took: the provider makes no CUDA calls of its own on
     * the worker (1); not asked, or refused by this library (0). */
    int cuda_api_forbidden;
    /* FI_OPT_SHARED_MEMORY_PERMITTED as set: 0 or 1; -1 = left at the provider's default
     * (not asked, or the library does not have the option). */
    int shared_memory;
    /* FI_OPT_EFA_EMULATED_WRITE read back: 1 = RDMA write (and immediates) emulated with
     * send/recv, 0 = native; -1 = unknown (not EFA, or the library cannot say). */
    int emulated_write;
    /* FI_SOURCE was granted: completions of received messages and remote CQ data name the
     * sender's address-vector entry (or FI_ADDR_NOTAVAIL). */
    int source;
    /* The most local and remote iovec entries one fi_readmsg / fi_writemsg takes. */
    size_t iov_limit;
    size_t rma_iov_limit;
} xfer_ofi_attr;

/* One completion, classified. */
typedef struct xfer_ofi_completion {
    void *context;
    int kind; /* 0: our operation finished; 1: a peer's write carried remote CQ data; 2: a message arrived */
    size_t len;
    uint64_t data;
    uint64_t src; /* the sender's fi_addr for kinds 1 and 2 (FI_ADDR_NOTAVAIL if unknown or no FI_SOURCE) */
} xfer_ofi_completion;

static void set_err(char *err, size_t cap, const char *what, int rc) {
    if (err && cap)
        snprintf(err, cap, "%s: %s (%d)", what, fi_strerror(rc < 0 ? -rc : rc), rc);
}

static struct fi_info *make_hints(const char *prov, const char *fabric, int with_read, int with_hmem,
                                  int with_source) {
    struct fi_info *hints = fi_allocinfo();
    if (!hints)
        return NULL;
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_MSG | FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_SEND | FI_RECV |
                  (with_read ? FI_READ | FI_REMOTE_READ : 0) | (with_hmem ? FI_HMEM : 0) |
                  (with_source ? FI_SOURCE : 0);
    /* Every operation's context points at 64 bytes of scratch the provider may use. */
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    /* Everything the Rust side can honour; the provider keeps what it needs. */
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                                  FI_MR_PROV_KEY | FI_MR_ENDPOINT | FI_MR_HMEM;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    /* xfer's model: a write's completion at the sender means its data is placed at the
     * receiver (what RC acks and EFA's delivery-complete give). Without this, tcp;ofi_rxm
     * completes small writes when they leave the sender. */
    hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    if (prov)
        hints->fabric_attr->prov_name = strdup(prov);
    /* Pinned by config (e.g. `efa` rather than `efa-direct` on libfabric 2.x), not left to
     * whichever fabric the library lists first. */
    if (fabric)
        hints->fabric_attr->name = strdup(fabric);
    return hints;
}

/* Lists "provider domain" lines of every RDM+RMA endpoint libfabric offers (prov may be NULL). */
int xfer_ofi_list(const char *prov, char *buf, size_t cap) {
    struct fi_info *hints = make_hints(prov, NULL, 0, 0, 0), *info = NULL;
    if (!hints)
        return -FI_ENOMEM;
    int rc = fi_getinfo(XFER_FI_API, NULL, NULL, 0, hints, &info);
    fi_freeinfo(hints);
    if (rc)
        return rc;
    size_t used = 0;
    if (cap)
        buf[0] = 0;
    for (struct fi_info *i = info; i; i = i->next) {
        int n = snprintf(buf + used, cap > used ? cap - used : 0, "%s %s\n",
                         i->fabric_attr->prov_name, i->domain_attr->name);
        if (n > 0)
            used += (size_t)n;
    }
    fi_freeinfo(info);
    return 0;
}

/* Closes just the endpoint (cancelling what is posted), so memory registrations can be closed
 * before the domain. */
void xfer_ofi_close_ep(xfer_ofi_ep *e) {
    if (e && e->ep) {
        fi_close(&e->ep->fid);
        e->ep = NULL;
    }
}

void xfer_ofi_close(xfer_ofi_ep *e) {
    if (!e)
        return;
    xfer_ofi_close_ep(e);
    if (e->av)
        fi_close(&e->av->fid);
    if (e->cq)
        fi_close(&e->cq->fid);
    if (e->domain)
        fi_close(&e->domain->fid);
    if (e->fabric)
        fi_close(&e->fabric->fid);
    if (e->info)
        fi_freeinfo(e->info);
    free(e);
}

/* Sets a boolean endpoint option; returns 1 if it took, 0 if this library refused it. */
#if XFER_HEADERS_AT_LEAST(1, 18)
static int set_bool_opt(struct fid_ep *ep, int level, int name, int value) {
    bool v = value != 0;
    return fi_setopt(&ep->fid, level, name, &v, sizeof v) == 0;
}
#endif

/* Opens an RDM endpoint of `prov` on the domain named `domain_name` (NULL: the first).
 * `shared_memory`: -1 leaves the provider's same-host shared-memory path at its default;
 * 0 forbids it, 1 permits it (FI_OPT_SHARED_MEMORY_PERMITTED, where the library has it). */
int xfer_ofi_open(const char *prov, const char *fabric, const char *domain_name, int shared_memory, xfer_ofi_ep **out,
                  xfer_ofi_attr *attr, char *err, size_t errcap) {
    /* The most the provider grants, tried in order: reads and device memory (FI_HMEM), then
     * without one, then without both. A provider without reads still serves writes (the
     * engine refuses reads, naming the backend); one without FI_HMEM registers host memory
     * only (the engine refuses device memory rather than let it be treated as host memory). Each
     * first with FI_SOURCE (senders named by the CQ), then without (senders never named). */
    static const int tries[8][3] = {{1, 1, 1}, {1, 0, 1}, {0, 1, 1}, {0, 0, 1},
                                    {1, 1, 0}, {1, 0, 0}, {0, 1, 0}, {0, 0, 0}};
    int with_read = 0, with_hmem = 0, with_source = 0;
    struct fi_info *hints = NULL, *info = NULL, *chosen = NULL;
    xfer_ofi_ep *e = calloc(1, sizeof *e);
    int rc = -FI_ENODATA;
    if (!e) {
        set_err(err, errcap, "allocation", -FI_ENOMEM);
        return -FI_ENOMEM;
    }
    for (int t = 0; t < 8 && rc == -FI_ENODATA; t++) {
        with_read = tries[t][0];
        with_hmem = tries[t][1];
        with_source = tries[t][2];
        if (!(hints = make_hints(prov, fabric, with_read, with_hmem, with_source))) {
            free(e);
            set_err(err, errcap, "allocation", -FI_ENOMEM);
            return -FI_ENOMEM;
        }
        rc = fi_getinfo(XFER_FI_API, NULL, NULL, 0, hints, &info);
        fi_freeinfo(hints);
    }
    if (rc) {
        set_err(err, errcap, "fi_getinfo", rc);
        free(e);
        return rc;
    }
    for (struct fi_info *i = info; i; i = i->next) {
        /* Checked here too: some providers (1.17's shm) ignore the fabric name in hints. */
        if (fabric && strcmp(i->fabric_attr->name, fabric) != 0)
            continue;
        if (!domain_name || strcmp(i->domain_attr->name, domain_name) == 0) {
            chosen = i;
            break;
        }
    }
    if (!chosen) {
        snprintf(err, errcap, "no domain named \"%s\" on fabric \"%s\" for provider %s",
                 domain_name ? domain_name : "(any)", fabric ? fabric : "(any)", prov ? prov : "(any)");
        fi_freeinfo(info);
        free(e);
        return -FI_ENODATA;
    }
    e->info = fi_dupinfo(chosen);
    fi_freeinfo(info);
    if (!e->info) {
        set_err(err, errcap, "fi_dupinfo", -FI_ENOMEM);
        free(e);
        return -FI_ENOMEM;
    }
    if ((rc = fi_fabric(e->info->fabric_attr, &e->fabric, NULL))) {
        set_err(err, errcap, "fi_fabric", rc);
        goto fail;
    }
    if ((rc = fi_domain(e->fabric, e->info, &e->domain, NULL))) {
        set_err(err, errcap, "fi_domain", rc);
        goto fail;
    }
    struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_DATA, .wait_obj = FI_WAIT_NONE};
    if ((rc = fi_cq_open(e->domain, &cq_attr, &e->cq, NULL))) {
        set_err(err, errcap, "fi_cq_open", rc);
        goto fail;
    }
    struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
    if ((rc = fi_av_open(e->domain, &av_attr, &e->av, NULL))) {
        set_err(err, errcap, "fi_av_open", rc);
        goto fail;
    }
    if ((rc = fi_endpoint(e->domain, e->info, &e->ep, NULL))) {
        set_err(err, errcap, "fi_endpoint", rc);
        goto fail;
    }
    /* Options are set before fi_enable; a library without them leaves the defaults. */
    attr->cuda_api_forbidden = 0;
    attr->shared_memory = -1;
#if XFER_HEADERS_AT_LEAST(1, 18)
    /* The worker thread must not block in CUDA calls the provider makes by itself (GPU
     * memory is only ever touched by the NIC); where the provider needs them, it says so
     * by refusing, and then keeps its default. */
    if (with_hmem)
        attr->cuda_api_forbidden = set_bool_opt(e->ep, FI_OPT_ENDPOINT, FI_OPT_CUDA_API_PERMITTED, 0);
#endif
#if XFER_HEADERS_AT_LEAST(1, 19)
    if (shared_memory >= 0 &&
        set_bool_opt(e->ep, FI_OPT_ENDPOINT, FI_OPT_SHARED_MEMORY_PERMITTED, shared_memory))
        attr->shared_memory = shared_memory;
#else
    (void)shared_memory;
#endif
    if ((rc = fi_ep_bind(e->ep, &e->cq->fid, FI_TRANSMIT | FI_RECV))) {
        set_err(err, errcap, "fi_ep_bind(cq)", rc);
        goto fail;
    }
    if ((rc = fi_ep_bind(e->ep, &e->av->fid, 0))) {
        set_err(err, errcap, "fi_ep_bind(av)", rc);
        goto fail;
    }
    if ((rc = fi_enable(e->ep))) {
        set_err(err, errcap, "fi_enable", rc);
        goto fail;
    }
    uint64_t mode = e->info->domain_attr->mr_mode;
    attr->mr_mode = mode;
    attr->rma_read = with_read;
    attr->hmem = with_hmem && (e->info->caps & FI_HMEM);
    attr->emulated_write = -1;
#if XFER_HEADERS_AT_LEAST(2, 0)
    {
        bool emulated = false;
        size_t len = sizeof emulated;
        if (fi_getopt(&e->ep->fid, FI_OPT_ENDPOINT, FI_OPT_EFA_EMULATED_WRITE, &emulated, &len) == 0)
            attr->emulated_write = emulated ? 1 : 0;
    }
#endif
    attr->source = with_source && (e->info->caps & FI_SOURCE);
    attr->iov_limit = e->info->tx_attr->iov_limit;
    attr->rma_iov_limit = e->info->tx_attr->rma_iov_limit;
    attr->mr_local = !!(mode & FI_MR_LOCAL);
    attr->mr_virt_addr = !!(mode & FI_MR_VIRT_ADDR);
    attr->mr_prov_key = !!(mode & FI_MR_PROV_KEY);
    attr->mr_endpoint = !!(mode & FI_MR_ENDPOINT);
    attr->cq_data_size = e->info->domain_attr->cq_data_size;
    attr->max_msg_size = e->info->ep_attr->max_msg_size;
    *out = e;
    return 0;
fail:
    xfer_ofi_close(e);
    return rc;
}

const char *xfer_ofi_provider(const xfer_ofi_ep *e) { return e->info->fabric_attr->prov_name; }
const char *xfer_ofi_domain_name(const xfer_ofi_ep *e) { return e->info->domain_attr->name; }

int xfer_ofi_getname(xfer_ofi_ep *e, void *buf, size_t *len) { return fi_getname(&e->ep->fid, buf, len); }

int xfer_ofi_av_insert(xfer_ofi_ep *e, const void *addr, uint64_t *fi_addr) {
    fi_addr_t a = FI_ADDR_UNSPEC;
    int n = fi_av_insert(e->av, addr, 1, &a, 0, NULL);
    if (n != 1)
        return n < 0 ? n : -FI_EADDRNOTAVAIL;
    *fi_addr = a;
    return 0;
}

int xfer_ofi_av_remove(xfer_ofi_ep *e, uint64_t fi_addr) {
    fi_addr_t a = fi_addr;
    return fi_av_remove(e->av, &a, 1, 0);
}

/* Registers host memory (`cuda_device` < 0) or memory of that CUDA device (FI_HMEM_CUDA),
 * binding it to the endpoint when the provider asks for FI_MR_ENDPOINT. `remote`: bit 0
 * peers may write, bit 1 peers may read (a local-only registration grants neither). */
int xfer_ofi_mr_reg(xfer_ofi_ep *e, const void *buf, size_t len, int cuda_device, uint64_t requested_key,
                    int remote, struct fid_mr **mr, uint64_t *key, void **desc) {
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    struct fi_mr_attr attr = {.mr_iov = &iov, .iov_count = 1,
                              .access = FI_SEND | FI_RECV | FI_WRITE | FI_READ |
                                        (remote & 1 ? FI_REMOTE_WRITE : 0) | (remote & 2 ? FI_REMOTE_READ : 0),
                              .requested_key = requested_key,
                              .iface = cuda_device < 0 ? FI_HMEM_SYSTEM : FI_HMEM_CUDA};
    if (cuda_device >= 0)
        attr.device.cuda = cuda_device;
    int rc = fi_mr_regattr(e->domain, &attr, 0, mr);
    if (rc)
        return rc;
    if (e->info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
        if ((rc = fi_mr_bind(*mr, &e->ep->fid, 0)) || (rc = fi_mr_enable(*mr))) {
            fi_close(&(*mr)->fid);
            return rc;
        }
    }
    *key = fi_mr_key(*mr);
    *desc = fi_mr_desc(*mr);
    return 0;
}

int xfer_ofi_mr_close(struct fid_mr *mr) { return fi_close(&mr->fid); }

/* Posting returns 0 when queued, 1 when the provider asks to retry later (-FI_EAGAIN), or a
 * negative libfabric error. */
static int post_status(ssize_t rc) { return rc == 0 ? 0 : rc == -FI_EAGAIN ? 1 : (int)rc; }

int xfer_ofi_write(xfer_ofi_ep *e, const void *buf, size_t len, void *desc, uint64_t dest,
                   uint64_t raddr, uint64_t rkey, int has_data, uint64_t data, void *context) {
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    struct fi_rma_iov rma = {.addr = raddr, .len = len, .key = rkey};
    struct fi_msg_rma msg = {
        .msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = dest,
        .rma_iov = &rma, .rma_iov_count = 1, .context = context, .data = data,
    };
    uint64_t flags = FI_COMPLETION | (len ? FI_DELIVERY_COMPLETE : 0) | (has_data ? FI_REMOTE_CQ_DATA : 0);
    return post_status(fi_writemsg(e->ep, &msg, flags));
}

/* An RDMA read of the peer's (raddr, rkey) into buf; its completion means the bytes are here. */
int xfer_ofi_read(xfer_ofi_ep *e, void *buf, size_t len, void *desc, uint64_t dest, uint64_t raddr, uint64_t rkey,
                  void *context) {
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    struct fi_rma_iov rma = {.addr = raddr, .len = len, .key = rkey};
    struct fi_msg_rma msg = {
        .msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = dest,
        .rma_iov = &rma, .rma_iov_count = 1, .context = context,
    };
    return post_status(fi_readmsg(e->ep, &msg, FI_COMPLETION));
}

/* One RDMA read of `count` (at most 16) segments: the peer's (raddrs[i], lens[i]) under one key
 * into bufs[i]; its one completion means every segment is here. */
int xfer_ofi_readv(xfer_ofi_ep *e, size_t count, void *const *bufs, const size_t *lens, void **descs,
                   uint64_t dest, const uint64_t *raddrs, uint64_t rkey, void *context) {
    struct iovec iov[16];
    struct fi_rma_iov rma[16];
    if (count == 0 || count > 16)
        return -FI_EINVAL;
    for (size_t i = 0; i < count; i++) {
        iov[i].iov_base = bufs[i];
        iov[i].iov_len = lens[i];
        rma[i].addr = raddrs[i];
        rma[i].len = lens[i];
        rma[i].key = rkey;
    }
    struct fi_msg_rma msg = {
        .msg_iov = iov, .desc = descs, .iov_count = count, .addr = dest,
        .rma_iov = rma, .rma_iov_count = count, .context = context,
    };
    return post_status(fi_readmsg(e->ep, &msg, FI_COMPLETION));
}

/* A message's completion means it is in the peer's receive buffer (delivery-complete, as an
 * RC send's ack), except for a zero-byte one: shm never completes a zero-byte
 * delivery-complete send, and every later send to that peer stalls behind it (seen on 1.17);
 * it is sent transmit-complete, as zero-byte writes are. */
int xfer_ofi_send(xfer_ofi_ep *e, const void *buf, size_t len, void *desc, uint64_t dest, void *context) {
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    struct fi_msg msg = {
        .msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = dest, .context = context,
    };
    uint64_t flags = FI_COMPLETION | (len ? FI_DELIVERY_COMPLETE : FI_TRANSMIT_COMPLETE);
    return post_status(fi_sendmsg(e->ep, &msg, flags));
}

int xfer_ofi_recv(xfer_ofi_ep *e, void *buf, size_t len, void *desc, void *context) {
    return post_status(fi_recv(e->ep, buf, len, desc, FI_ADDR_UNSPEC, context));
}

/* Reads up to `count` completions; returns how many, 0 if none, -1 if an error completion is
 * waiting (read it with xfer_ofi_cq_readerr), or another negative libfabric error. */
long xfer_ofi_cq_read(xfer_ofi_ep *e, xfer_ofi_completion *out, size_t count) {
    struct fi_cq_data_entry entries[64];
    fi_addr_t src[64];
    if (count > 64)
        count = 64;
    int with_source = (e->info->caps & FI_SOURCE) != 0;
    ssize_t n = with_source ? fi_cq_readfrom(e->cq, entries, count, src) : fi_cq_read(e->cq, entries, count);
    if (n == -FI_EAGAIN)
        return 0;
    if (n == -FI_EAVAIL)
        return -1;
    if (n < 0)
        return (long)n;
    for (ssize_t i = 0; i < n; i++) {
        uint64_t f = entries[i].flags;
        out[i].context = entries[i].op_context;
        out[i].len = entries[i].len;
        out[i].data = entries[i].data;
        out[i].src = with_source ? src[i] : FI_ADDR_NOTAVAIL;
        /* A peer's write with remote CQ data: FI_REMOTE_CQ_DATA on a completion that is not a
         * receive. Providers differ in the other flags: 1.17's shm and tcp add
         * FI_RMA | FI_REMOTE_WRITE, 2.1's shm sets FI_REMOTE_CQ_DATA alone (with a context
         * that is not ours) — requiring FI_RMA lost every immediate there. */
        if ((f & FI_REMOTE_CQ_DATA) && !(f & (FI_RECV | FI_MSG)))
            out[i].kind = 1;
        else if (f & FI_RECV)
            out[i].kind = 2;
        else
            out[i].kind = 0;
    }
    return (long)n;
}

/* Reads one error completion: its context, libfabric error, provider errno and both texts. */
int xfer_ofi_cq_readerr(xfer_ofi_ep *e, void **context, int *err, int *prov_errno, char *msg, size_t cap) {
    struct fi_cq_err_entry entry;
    memset(&entry, 0, sizeof entry);
    ssize_t n = fi_cq_readerr(e->cq, &entry, 0);
    if (n < 0)
        return (int)n;
    *context = entry.op_context;
    *err = entry.err;
    *prov_errno = entry.prov_errno;
    char prov_text[256] = {0};
    fi_cq_strerror(e->cq, entry.prov_errno, entry.err_data, prov_text, sizeof prov_text);
    snprintf(msg, cap, "%s (provider: %s, errno %d)", fi_strerror(entry.err), prov_text, entry.prov_errno);
    return 0;
}

const char *xfer_ofi_strerror(int err) { return fi_strerror(err < 0 ? -err : err); }
