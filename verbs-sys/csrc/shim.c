/* Why one file: it is the one translation unit the crate's build script compiles, and its
 * wrappers share the device struct and static helpers below. Two pieces of policy still live
 * here beside the static-inline wrappers — the UD handshake transport's slots and generations,
 * and the CQ's reservations and growth — and are the next to move to Rust, which would shrink
 * it. */
/* A flat C surface over libibverbs for Rust. ibv_post_send, ibv_poll_cq and friends are static
 * inline functions going through the context's ops, so they are wrapped here, compiled against
 * rdma-core's headers (every struct layout is the real one). */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define UD_SLOTS 64
#define UD_MSG 256
#define GRH 40
#define UD_QKEY 0x58464552u /* "XFER" */

typedef struct xv_dev {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    struct ibv_srq *srq_imm;
    struct ibv_srq *srq_msg;
    struct ibv_qp *ud;
    struct ibv_mr *ud_mr;
    uint8_t *ud_buf; /* UD_SLOTS send slots, then UD_SLOTS recv slots of GRH + UD_MSG */
    /* Handshake send slots in use (bit i: slot i), each with its AH until its completion. A
     * slot is reused only once its send completed: never overwritten while the NIC reads it. */
    uint64_t ud_busy;
    struct ibv_ah *ud_ah[UD_SLOTS];
    /* The UD QP's incarnation: a UD error completion puts the QP in the error state (soft-RoCE
     * does so under load), so it is reset (same QPN: peers know it) and brought up again.
     * Work request ids carry the generation, so completions of the old incarnation are
     * recognised and dropped, never freeing a slot or reposting into the new one. */
    uint32_t ud_gen;
    int ud_broken;
    uint64_t ud_resets;
    /* The CQ is sized from what can be outstanding on it: the receives (both SRQs, the UD
     * QP) at setup, plus what each RC QP reserved while it exists — the work requests its
     * owner lets it have outstanding, not its send queue's depth (grown with ibv_resize_cq,
     * up to the device's max_cqe; a QP or a reservation that would not fit is refused). */
    int cq_cap;
    long cq_need;
    int max_cqe;
    int port;
    int gid_index;
    union ibv_gid gid;
    struct ibv_port_attr port_attr;
    uint32_t max_msg_sz;
    /* RDMA READs in flight per QP: as initiator, and as responder (the device's limits, so
     * reads are not serialised one at a time). */
    int max_rd_atomic;
    int max_dest_rd_atomic;
    /* Path settings for every QP and handshake datagram: traffic class, service level, and
     * whether packets carry a GRH (0 auto, 1 always, 2 never). */
    uint8_t traffic_class;
    uint8_t service_level;
    int global_mode;
    /* Completion notification (see xv_arm_cq / xv_wait_cq): the CQ's completion channel, and
     * an eventfd that interrupts a wait (a new timer to keep, or the device closing). */
    struct ibv_comp_channel *chan;
    int kick_fd;
    /* Test fault: the CQ keeps its size whatever is reserved of it, so it can overrun. */
    int cq_fixed;
} xv_dev;

/* Whether a path to `dlid` carries a GRH: RoCE always does; InfiniBand only when asked, or
 * when the peer has no LID to route by. */
static int path_is_global(const xv_dev *d, uint16_t dlid) {
    if (d->global_mode == 1)
        return 1;
    if (d->global_mode == 2)
        return 0;
    return d->port_attr.link_layer == IBV_LINK_LAYER_ETHERNET || dlid == 0;
}

/* Fills an address vector towards (dgid, dlid) with the device's path settings. */
static void fill_ah(const xv_dev *d, struct ibv_ah_attr *aa, const uint8_t dgid[16], uint16_t dlid) {
    aa->dlid = dlid;
    aa->sl = d->service_level;
    aa->port_num = d->port;
    aa->is_global = path_is_global(d, dlid);
    if (aa->is_global) {
        memcpy(aa->grh.dgid.raw, dgid, 16);
        aa->grh.sgid_index = d->gid_index;
        aa->grh.hop_limit = 64;
        aa->grh.traffic_class = d->traffic_class;
    }
}

/* Sets the path settings (see xv_dev). */
void xv_set_path(xv_dev *d, int traffic_class, int service_level, int global_mode) {
    d->traffic_class = (uint8_t)traffic_class;
    d->service_level = (uint8_t)service_level;
    d->global_mode = global_mode;
}

typedef struct xv_attr {
    uint8_t gid[16];
    int gid_index;
    uint32_t ud_qpn;
    uint16_t lid;
    int active_mtu; /* enum ibv_mtu: 1=256 .. 5=4096 */
    int ethernet;
    int state; /* enum ibv_port_state: 4 = ACTIVE */
    uint32_t max_msg_sz;
} xv_attr;

/* Completion kinds, normalised for Rust. */
enum { XV_SEND_DONE = 0, XV_RECV_MSG = 1, XV_RECV_IMM = 2, XV_UD_RECV = 3, XV_UD_SEND_DONE = 4 };

/* Every work request's id carries what it is in its top four bits, because a failed work
 * completion defines only wr_id, status, vendor_err and qp_num (ibv_poll_cq(3)): its opcode,
 * byte_len and immediate are undefined (mlx5 does not write them). Completions are routed by
 * these tags, never by opcode. The Rust side uses the same values (verbs-sys/src/lib.rs). */
#define XV_TAG_SHIFT 60
#define XV_TAG_MASK (0xfull << XV_TAG_SHIFT)
#define XV_TAG_SEND (0x1ull << XV_TAG_SHIFT)     /* RC write or message send */
#define XV_TAG_IMM_RECV (0x2ull << XV_TAG_SHIFT) /* zero-length receive of the immediate SRQ */
#define XV_TAG_MSG_RECV (0x4ull << XV_TAG_SHIFT) /* message buffer of the message SRQ */
#define XV_TAG_UD_RECV (0x8ull << XV_TAG_SHIFT)  /* handshake receive */
#define XV_TAG_UD_SEND (0x9ull << XV_TAG_SHIFT)  /* handshake send; low bits: its send slot */

/* What a failed completion's undefined fields are overwritten with, so code that reads them
 * fails on soft-RoCE too (rxe happens to fill them in). */
#define XV_POISON 0xdeadbeefu

typedef struct xv_wc {
    uint64_t wr_id;
    int status;
    int kind;
    uint32_t byte_len;
    uint32_t imm; /* host order */
    uint32_t qp_num;
    uint32_t vendor_err;
    uint8_t data[UD_MSG]; /* UD payloads, copied out (the buffer is reposted at once) */
} xv_wc;

static void set_err(char *err, size_t cap, const char *what, int rc) {
    if (err && cap)
        snprintf(err, cap, "%s: %s (%d)", what, strerror(rc), rc);
}

/* Lists device names, one per line. */
int xv_list(char *buf, size_t cap) {
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (!list)
        return -errno;
    size_t used = 0;
    if (cap)
        buf[0] = 0;
    for (int i = 0; i < n; i++) {
        int w = snprintf(buf + used, cap > used ? cap - used : 0, "%s\n", ibv_get_device_name(list[i]));
        if (w > 0)
            used += (size_t)w;
    }
    ibv_free_device_list(list);
    return n;
}

/* Opens a device and queries its port; no resources yet. */
int xv_open(const char *name, int port, xv_dev **out, char *err, size_t cap) {
    int n = 0, rc;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (!list) {
        set_err(err, cap, "ibv_get_device_list", errno);
        return -1;
    }
    struct ibv_device *dev = NULL;
    for (int i = 0; i < n; i++)
        if (strcmp(ibv_get_device_name(list[i]), name) == 0)
            dev = list[i];
    if (!dev) {
        snprintf(err, cap, "no RDMA device named \"%s\" (%d devices present)", name, n);
        ibv_free_device_list(list);
        return -1;
    }
    xv_dev *d = calloc(1, sizeof *d);
    d->kick_fd = -1;
    d->ctx = ibv_open_device(dev);
    ibv_free_device_list(list);
    if (!d->ctx) {
        set_err(err, cap, "ibv_open_device", errno);
        free(d);
        return -1;
    }
    d->port = port;
    if ((rc = ibv_query_port(d->ctx, port, &d->port_attr))) {
        set_err(err, cap, "ibv_query_port", rc);
        ibv_close_device(d->ctx);
        free(d);
        return -1;
    }
    d->max_msg_sz = d->port_attr.max_msg_sz;
    *out = d;
    return 0;
}

/* GID table entry `index`: returns 0 and fills gid/type (1 = RoCE v1/IB, 2 = RoCE v2), or -1 past
 * the end / for an unused entry. */
int xv_query_gid(xv_dev *d, int index, uint8_t gid[16], int *type) {
    struct ibv_gid_entry e;
    if (index >= d->port_attr.gid_tbl_len)
        return -2;
    if (ibv_query_gid_ex(d->ctx, d->port, index, &e, 0))
        return -1;
    memcpy(gid, e.gid.raw, 16);
    *type = e.gid_type == IBV_GID_TYPE_ROCE_V2 ? 2 : 1;
    return 0;
}

/* UD work request ids: tag | generation << 16 | slot. */
static uint64_t ud_wr_id(const xv_dev *d, uint64_t tag, unsigned slot) {
    return tag | ((uint64_t)d->ud_gen << 16) | slot;
}

static uint32_t ud_gen_of(uint64_t wr_id) { return (uint32_t)((wr_id & ~XV_TAG_MASK) >> 16); }

static int ud_post_recv(xv_dev *d, unsigned slot) {
    struct ibv_sge sge = {.addr = (uintptr_t)(d->ud_buf + (UD_SLOTS + slot) * (GRH + UD_MSG)),
                          .length = GRH + UD_MSG, .lkey = d->ud_mr->lkey};
    struct ibv_recv_wr wr = {.wr_id = ud_wr_id(d, XV_TAG_UD_RECV, slot), .sg_list = &sge, .num_sge = 1}, *bad;
    return ibv_post_recv(d->ud, &wr, &bad);
}

/* INIT → RTR → RTS and every receive slot posted: a new UD QP, or one just reset. */
static int ud_bring_up(xv_dev *d, const char **what) {
    int rc;
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = d->port, .qkey = UD_QKEY};
    if ((rc = ibv_modify_qp(d->ud, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY))) {
        *what = "UD QP to INIT";
        return rc;
    }
    a.qp_state = IBV_QPS_RTR;
    if ((rc = ibv_modify_qp(d->ud, &a, IBV_QP_STATE))) {
        *what = "UD QP to RTR";
        return rc;
    }
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = 0;
    if ((rc = ibv_modify_qp(d->ud, &a, IBV_QP_STATE | IBV_QP_SQ_PSN))) {
        *what = "UD QP to RTS";
        return rc;
    }
    for (unsigned i = 0; i < UD_SLOTS; i++)
        if ((rc = ud_post_recv(d, i))) {
            *what = "ibv_post_recv(UD)";
            return rc;
        }
    return 0;
}

/* Resets a failed UD QP (RESET keeps its QPN) and brings it up again; sends in flight are
 * lost (the handshake resends requests, and answers repeated requests). */
static int ud_reset(xv_dev *d) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RESET;
    int rc = ibv_modify_qp(d->ud, &a, IBV_QP_STATE);
    if (rc)
        return rc;
    for (unsigned i = 0; i < UD_SLOTS; i++)
        if (d->ud_busy & (1ull << i)) {
            ibv_destroy_ah(d->ud_ah[i]);
            d->ud_ah[i] = NULL;
        }
    d->ud_busy = 0;
    d->ud_gen = (d->ud_gen + 1) & 0xffffffffu;
    const char *what;
    if ((rc = ud_bring_up(d, &what)))
        return rc;
    d->ud_broken = 0;
    d->ud_resets++;
    return 0;
}

/* Test hook: puts the UD QP into the error state, as a failed datagram does. */
int xv_ud_to_error(xv_dev *d) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_ERR;
    return ibv_modify_qp(d->ud, &a, IBV_QP_STATE);
}

/* How many times the UD QP was reset after an error. */
uint64_t xv_ud_resets(const xv_dev *d) { return d->ud_resets; }

/* Sets O_NONBLOCK on `fd`: 0, or -1 with errno set. */
static int set_nonblocking(int fd) {
    int flags = fcntl(fd, F_GETFL);
    return flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0 ? -1 : 0;
}

/* Creates PD, CQ, the two SRQs and the UD handshake QP, using GID `gid_index`. */
int xv_setup(xv_dev *d, int gid_index, int cq_size, int srq_size, xv_attr *attr, char *err, size_t cap) {
    int rc;
    d->gid_index = gid_index;
    d->max_cqe = 1 << 22;
    {
        struct ibv_device_attr da;
        d->max_rd_atomic = d->max_dest_rd_atomic = 1;
        if (!ibv_query_device(d->ctx, &da)) {
            if (da.max_cqe > 0)
                d->max_cqe = da.max_cqe;
            d->max_rd_atomic = da.max_qp_init_rd_atom > 0 ? (da.max_qp_init_rd_atom < 16 ? da.max_qp_init_rd_atom : 16) : 1;
            d->max_dest_rd_atomic = da.max_qp_rd_atom > 0 ? (da.max_qp_rd_atom < 16 ? da.max_qp_rd_atom : 16) : 1;
        }
    }
    if ((rc = ibv_query_gid(d->ctx, d->port, gid_index, &d->gid))) {
        set_err(err, cap, "ibv_query_gid", rc);
        return -1;
    }
    if (cq_size > d->max_cqe)
        cq_size = d->max_cqe;
    /* The channel costs nothing until the CQ is armed; a worker that parks arms it. */
    if (!(d->chan = ibv_create_comp_channel(d->ctx))) {
        set_err(err, cap, "ibv_create_comp_channel", errno);
        return -1;
    }
    if (set_nonblocking(d->chan->fd)) {
        set_err(err, cap, "making the completion channel non-blocking", errno);
        return -1;
    }
    if ((d->kick_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0) {
        set_err(err, cap, "eventfd", errno);
        return -1;
    }
    if (!(d->pd = ibv_alloc_pd(d->ctx)) || !(d->cq = ibv_create_cq(d->ctx, cq_size, NULL, d->chan, 0))) {
        set_err(err, cap, d->pd ? "ibv_create_cq" : "ibv_alloc_pd", errno);
        return -1;
    }
    d->cq_cap = d->cq->cqe;
    d->cq_need = cq_size;
    /* Async events (QP and port errors, CQ overrun) are read without blocking, from poll. */
    if (set_nonblocking(d->ctx->async_fd)) {
        set_err(err, cap, "making the async event fd non-blocking", errno);
        return -1;
    }
    struct ibv_srq_init_attr sa = {.attr = {.max_wr = srq_size, .max_sge = 1}};
    if (!(d->srq_imm = ibv_create_srq(d->pd, &sa)) || !(d->srq_msg = ibv_create_srq(d->pd, &sa))) {
        set_err(err, cap, "ibv_create_srq", errno);
        return -1;
    }
    size_t ud_len = (size_t)UD_SLOTS * UD_MSG + (size_t)UD_SLOTS * (GRH + UD_MSG);
    d->ud_buf = calloc(1, ud_len);
    if (!(d->ud_mr = ibv_reg_mr(d->pd, d->ud_buf, ud_len, IBV_ACCESS_LOCAL_WRITE))) {
        set_err(err, cap, "ibv_reg_mr(handshake buffers)", errno);
        return -1;
    }
    struct ibv_qp_init_attr qa = {.send_cq = d->cq, .recv_cq = d->cq, .qp_type = IBV_QPT_UD,
                                  .cap = {.max_send_wr = UD_SLOTS, .max_recv_wr = UD_SLOTS, .max_send_sge = 1, .max_recv_sge = 1}};
    if (!(d->ud = ibv_create_qp(d->pd, &qa))) {
        set_err(err, cap, "ibv_create_qp(UD)", errno);
        return -1;
    }
    const char *what;
    if ((rc = ud_bring_up(d, &what))) {
        set_err(err, cap, what, rc);
        return -1;
    }
    memcpy(attr->gid, d->gid.raw, 16);
    attr->gid_index = gid_index;
    attr->ud_qpn = d->ud->qp_num;
    attr->lid = d->port_attr.lid;
    attr->active_mtu = d->port_attr.active_mtu;
    attr->ethernet = d->port_attr.link_layer == IBV_LINK_LAYER_ETHERNET;
    attr->state = d->port_attr.state;
    attr->max_msg_sz = d->max_msg_sz;
    return 0;
}

void xv_close(xv_dev *d) {
    if (!d)
        return;
    if (d->ud)
        ibv_destroy_qp(d->ud);
    if (d->ud_mr)
        ibv_dereg_mr(d->ud_mr);
    free(d->ud_buf);
    if (d->srq_imm)
        ibv_destroy_srq(d->srq_imm);
    if (d->srq_msg)
        ibv_destroy_srq(d->srq_msg);
    if (d->cq)
        ibv_destroy_cq(d->cq); /* every event was acknowledged when it was read */
    if (d->chan)
        ibv_destroy_comp_channel(d->chan);
    if (d->kick_fd >= 0)
        close(d->kick_fd);
    if (d->pd)
        ibv_dealloc_pd(d->pd);
    ibv_close_device(d->ctx);
    free(d);
}

/* `remote`: bit 0 peers may write, bit 1 peers may read. */
static int remote_access(int remote) {
    return (remote & 1 ? IBV_ACCESS_REMOTE_WRITE : 0) | (remote & 2 ? IBV_ACCESS_REMOTE_READ : 0);
}

struct ibv_mr *xv_reg_mr(xv_dev *d, void *addr, size_t len, int remote, uint32_t *lkey, uint32_t *rkey, int *err) {
    int access = IBV_ACCESS_LOCAL_WRITE | remote_access(remote) | IBV_ACCESS_RELAXED_ORDERING;
    struct ibv_mr *mr = ibv_reg_mr(d->pd, addr, len, access);
    if (!mr) {
        /* Devices without relaxed ordering refuse the flag on some kernels: retry without. */
        mr = ibv_reg_mr(d->pd, addr, len, access & ~IBV_ACCESS_RELAXED_ORDERING);
    }
    if (!mr) {
        *err = errno;
        return NULL;
    }
    *lkey = mr->lkey;
    *rkey = mr->rkey;
    return mr;
}

/* GPU memory through dma-buf: the fd spans whole pages; `offset` is where the region starts in
 * it and `iova` the address peers use (the device pointer). */
struct ibv_mr *xv_reg_dmabuf_mr(xv_dev *d, uint64_t offset, size_t len, uint64_t iova, int fd, int remote_write,
                                uint32_t *lkey, uint32_t *rkey, int *err) {
    /* Relaxed ordering on GPU memory too (PCIe peer-to-peer writes gain most from it). */
    int access = IBV_ACCESS_LOCAL_WRITE | remote_access(remote_write) | IBV_ACCESS_RELAXED_ORDERING;
    struct ibv_mr *mr = ibv_reg_dmabuf_mr(d->pd, offset, len, iova, fd, access);
    if (!mr)
        mr = ibv_reg_dmabuf_mr(d->pd, offset, len, iova, fd, access & ~IBV_ACCESS_RELAXED_ORDERING);
    if (!mr) {
        *err = errno;
        return NULL;
    }
    *lkey = mr->lkey;
    *rkey = mr->rkey;
    return mr;
}

int xv_dereg_mr(struct ibv_mr *mr) { return ibv_dereg_mr(mr); }

/* An RC QP in INIT, receiving from the imm or the message SRQ. */
int xv_destroy_qp(struct ibv_qp *qp);

/* What an RC QP holds of its device's CQ, released when it is destroyed. */
typedef struct xv_cq_share {
    xv_dev *d;
    int entries;
} xv_cq_share;

/* Makes room on the CQ for `entries` more completions (growing it if needed). */
static int cq_reserve(xv_dev *d, int entries) {
    long need = d->cq_need + entries;
    if (d->cq_fixed) {
        d->cq_need = need;
        return 0;
    }
    if (need > d->max_cqe)
        return ENOSPC;
    if (need > d->cq_cap) {
        long grow = (long)d->cq_cap * 2;
        int size = (int)(need > grow ? need : (grow > d->max_cqe ? d->max_cqe : grow));
        int rc = ibv_resize_cq(d->cq, size);
        if (rc)
            return rc;
        d->cq_cap = d->cq->cqe;
    }
    d->cq_need = need;
    return 0;
}

/* CQ capacity now and what is reserved of it (for `xfer doctor` and tests). */
void xv_cq_state(const xv_dev *d, int *cap, long *need) {
    *cap = d->cq_cap;
    *need = d->cq_need;
}

/* `max_inline`: in, the inline data size asked for; out, what the QP has (a device that
 * refuses the size gets a QP without inline data, rather than none). `reserve`: the CQ
 * entries the QP holds from the start (at most `max_send_wr`); the caller keeps no more work
 * requests outstanding on it than it reserved, and reserves more with `xv_qp_reserve`. */
struct ibv_qp *xv_create_rc(xv_dev *d, int msg, int max_send_wr, int reserve, uint32_t *max_inline, uint32_t *qpn, int *err) {
    xv_cq_share *share = malloc(sizeof *share);
    if (!share) {
        *err = ENOMEM;
        return NULL;
    }
    int rc = cq_reserve(d, reserve);
    if (rc) {
        free(share);
        *err = rc;
        return NULL;
    }
    *share = (xv_cq_share){.d = d, .entries = reserve};
    struct ibv_qp_init_attr qa = {.qp_context = share, .send_cq = d->cq, .recv_cq = d->cq,
                                  .srq = msg ? d->srq_msg : d->srq_imm, .qp_type = IBV_QPT_RC,
                                  .cap = {.max_send_wr = max_send_wr, .max_send_sge = 1, .max_inline_data = *max_inline}};
    struct ibv_qp *qp = ibv_create_qp(d->pd, &qa);
    if (!qp && *max_inline) {
        qa.cap.max_inline_data = 0;
        qp = ibv_create_qp(d->pd, &qa);
    }
    if (!qp) {
        *err = errno;
        d->cq_need -= reserve;
        free(share);
        return NULL;
    }
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = d->port,
                            .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE};
    rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (rc) {
        xv_destroy_qp(qp);
        *err = rc;
        return NULL;
    }
    *qpn = qp->qp_num;
    *max_inline = qa.cap.max_inline_data;
    return qp;
}

/* INIT -> RTR -> RTS towards a remote QP. */
int xv_connect_rc(xv_dev *d, struct ibv_qp *qp, uint32_t rqpn, uint32_t rpsn, uint32_t lpsn, const uint8_t rgid[16],
                  uint16_t rlid, int mtu, int timeout, int retry_cnt, int rnr_retry, char *err, size_t cap) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = mtu;
    a.dest_qp_num = rqpn;
    a.rq_psn = rpsn;
    a.max_dest_rd_atomic = d->max_dest_rd_atomic;
    a.min_rnr_timer = 12;
    fill_ah(d, &a.ah_attr, rgid, rlid);
    int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                       IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (rc) {
        set_err(err, cap, "RC QP to RTR", rc);
        return -1;
    }
    a.qp_state = IBV_QPS_RTS;
    a.timeout = timeout;
    a.retry_cnt = retry_cnt;
    a.rnr_retry = rnr_retry;
    a.sq_psn = lpsn;
    a.max_rd_atomic = d->max_rd_atomic;
    rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                   IBV_QP_MAX_QP_RD_ATOMIC);
    if (rc) {
        set_err(err, cap, "RC QP to RTS", rc);
        return -1;
    }
    return 0;
}

/* `more` CQ entries for an RC QP (growing the CQ if needed); 0, or ENOSPC past the device's
 * max_cqe, or the resize's error. Released with the QP. */
int xv_qp_reserve(struct ibv_qp *qp, int more) {
    xv_cq_share *share = qp->qp_context;
    int rc = cq_reserve(share->d, more);
    if (!rc)
        share->entries += more;
    return rc;
}

int xv_destroy_qp(struct ibv_qp *qp) {
    xv_cq_share *share = qp->qp_context;
    int rc = ibv_destroy_qp(qp);
    if (share) {
        share->d->cq_need -= share->entries;
        free(share);
    }
    return rc;
}

/* One pending async event, without blocking: 1 (and its type, the QP number for QP events,
 * 0 otherwise), 0 if none, -1 on error. The event is acknowledged. */
int xv_async_event(xv_dev *d, int *type, uint32_t *qpn) {
    struct ibv_async_event ev;
    if (ibv_get_async_event(d->ctx, &ev)) {
        return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
    }
    *type = ev.event_type;
    *qpn = 0;
    switch (ev.event_type) {
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_COMM_EST:
    case IBV_EVENT_SQ_DRAINED:
    case IBV_EVENT_PATH_MIG:
    case IBV_EVENT_PATH_MIG_ERR:
    case IBV_EVENT_QP_LAST_WQE_REACHED:
        *qpn = ev.element.qp ? ev.element.qp->qp_num : 0;
        break;
    default:
        break;
    }
    ibv_ack_async_event(&ev);
    return 1;
}

const char *xv_event_str(int type) { return ibv_event_type_str((enum ibv_event_type)type); }

typedef struct xv_write {
    uint64_t wr_id;
    uint64_t laddr;
    uint64_t raddr;
    uint32_t len;
    uint32_t lkey;
    uint32_t rkey;
    uint32_t imm;
    int has_imm;
    int signaled;
    uint64_t user; /* the caller's own id for it; not given to the NIC */
    int read;      /* 1: RDMA READ of raddr into laddr (no immediate) */
    int inline_data; /* 1: the bytes go inside the work request (IBV_SEND_INLINE); lkey unused */
    int flushes;     /* the caller's count of flushes it survived; not given to the NIC */
    int pad;
} xv_write;

#ifndef XV_CHAIN
#error "XV_CHAIN (writes per doorbell) comes from verbs-sys/build.rs"
#endif

/* Posts up to XV_CHAIN writes as one chain (one doorbell). Returns 0 or an errno (ENOMEM: the
 * send queue is full — nothing of the chain after `*posted` was queued). */
int xv_post_writes(struct ibv_qp *qp, const xv_write *w, int n, int *posted) {
    struct ibv_sge sge[XV_CHAIN];
    struct ibv_send_wr wr[XV_CHAIN], *bad = NULL;
    if (n > XV_CHAIN)
        n = XV_CHAIN;
    for (int i = 0; i < n; i++) {
        sge[i] = (struct ibv_sge){.addr = w[i].laddr, .length = w[i].len, .lkey = w[i].lkey};
        memset(&wr[i], 0, sizeof wr[i]);
        wr[i].wr_id = w[i].wr_id;
        wr[i].sg_list = w[i].len ? &sge[i] : NULL;
        wr[i].num_sge = w[i].len ? 1 : 0;
        wr[i].opcode = w[i].read ? IBV_WR_RDMA_READ : w[i].has_imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
        wr[i].send_flags = (w[i].signaled ? IBV_SEND_SIGNALED : 0) | (w[i].inline_data ? IBV_SEND_INLINE : 0);
        wr[i].imm_data = htonl(w[i].imm);
        wr[i].wr.rdma.remote_addr = w[i].raddr;
        wr[i].wr.rdma.rkey = w[i].rkey;
        wr[i].next = i + 1 < n ? &wr[i + 1] : NULL;
    }
    int rc = ibv_post_send(qp, wr, &bad);
    *posted = rc ? (int)(bad - wr) : n;
    return rc;
}

/* Moves a QP to the error state: nothing more it holds executes, and every outstanding work
 * request completes with a flush error (signalled or not). */
int xv_qp_to_error(struct ibv_qp *qp) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_ERR;
    return ibv_modify_qp(qp, &a, IBV_QP_STATE);
}

int xv_post_send(struct ibv_qp *qp, uint64_t wr_id, uint64_t addr, uint32_t len, uint32_t lkey) {
    struct ibv_sge sge = {.addr = addr, .length = len, .lkey = lkey};
    struct ibv_send_wr wr = {.wr_id = wr_id, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
                             .send_flags = IBV_SEND_SIGNALED}, *bad;
    return ibv_post_send(qp, &wr, &bad);
}

int xv_post_srq_recv(xv_dev *d, int msg, uint64_t wr_id, uint64_t addr, uint32_t len, uint32_t lkey) {
    struct ibv_sge sge = {.addr = addr, .length = len, .lkey = lkey};
    struct ibv_recv_wr wr = {.wr_id = wr_id, .sg_list = len ? &sge : NULL, .num_sge = len ? 1 : 0}, *bad;
    return ibv_post_srq_recv(msg ? d->srq_msg : d->srq_imm, &wr, &bad);
}

/* Posts `n` zero-length receives to the immediate SRQ in one call (ids tagged, counting up from
 * `first`). Returns 0 or an errno; `*posted` says how many went in. */
int xv_post_imm_recvs(xv_dev *d, uint64_t first, int n, int *posted) {
    struct ibv_recv_wr wr[64], *bad = NULL;
    *posted = 0;
    while (n > 0) {
        int k = n < 64 ? n : 64;
        for (int i = 0; i < k; i++) {
            memset(&wr[i], 0, sizeof wr[i]);
            wr[i].wr_id = XV_TAG_IMM_RECV | ((first + (uint64_t)*posted + (uint64_t)i) & ~XV_TAG_MASK);
            wr[i].next = i + 1 < k ? &wr[i + 1] : NULL;
        }
        int rc = ibv_post_srq_recv(d->srq_imm, wr, &bad);
        if (rc) {
            *posted += (int)(bad - wr);
            return rc;
        }
        *posted += k;
        n -= k;
    }
    return 0;
}

/* Sends a handshake datagram to (gid, lid, qpn). */
int xv_ud_send(xv_dev *d, const uint8_t dgid[16], uint16_t dlid, uint32_t dqpn, const void *msg, uint32_t len) {
    if (len > UD_MSG)
        return EINVAL;
    struct ibv_ah_attr aa;
    memset(&aa, 0, sizeof aa);
    fill_ah(d, &aa, dgid, dlid);
    if (d->ud_busy == ~0ull)
        return EAGAIN; /* every slot is still being sent: try again after polling */
    unsigned slot = (unsigned)__builtin_ctzll(~d->ud_busy);
    struct ibv_ah *ah = ibv_create_ah(d->pd, &aa);
    if (!ah)
        return errno ? errno : EINVAL;
    uint8_t *buf = d->ud_buf + slot * UD_MSG;
    memcpy(buf, msg, len);
    struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = len, .lkey = d->ud_mr->lkey};
    struct ibv_send_wr wr = {.wr_id = ud_wr_id(d, XV_TAG_UD_SEND, slot), .sg_list = &sge, .num_sge = 1,
                             .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED}, *bad;
    wr.wr.ud.ah = ah;
    wr.wr.ud.remote_qpn = dqpn;
    wr.wr.ud.remote_qkey = UD_QKEY;
    int rc = ibv_post_send(d->ud, &wr, &bad);
    if (rc) {
        ibv_destroy_ah(ah);
        return rc;
    }
    d->ud_busy |= 1ull << slot;
    d->ud_ah[slot] = ah;
    return 0;
}

/* Asks for one completion event at the CQ's next completion (0, or an errno). Completions
 * already on the CQ raise none: the caller polls once more after arming. */
int xv_arm_cq(xv_dev *d) { return ibv_req_notify_cq(d->cq, 0); }

/* Test fault: the CQ never grows again (see cq_fixed). */
void xv_fix_cq(xv_dev *d) { d->cq_fixed = 1; }

/* Waits up to `timeout_ms` (-1: without limit) for a completion event, a kick or (when
 * `watch_async`) an asynchronous event waiting to be read. Returns a mask — 1 a completion
 * event came (read and acknowledged: the CQ is disarmed until armed again), 2 a kick, 4 an
 * async event is pending (left for the owner to read) — 0 on timeout, or -errno. Runs on the
 * wake thread while the owner polls, arms and resizes the CQ: libibverbs makes these calls
 * safe to make concurrently. */
int xv_wait_cq(xv_dev *d, int timeout_ms, int watch_async) {
    struct pollfd fds[3] = {{.fd = d->chan->fd, .events = POLLIN},
                            {.fd = d->kick_fd, .events = POLLIN},
                            {.fd = d->ctx->async_fd, .events = watch_async ? POLLIN : 0}};
    int rc = poll(fds, 3, timeout_ms);
    if (rc < 0)
        return errno == EINTR ? 0 : -errno;
    int result = 0;
    if (fds[1].revents & POLLIN) {
        uint64_t drained;
        if (read(d->kick_fd, &drained, sizeof drained) < 0 && errno != EAGAIN)
            return -errno;
        result |= 2;
    }
    if (fds[2].revents & POLLIN)
        result |= 4;
    if (fds[0].revents & POLLIN) {
        struct ibv_cq *cq;
        void *ctx;
        int got = 0;
        while (!ibv_get_cq_event(d->chan, &cq, &ctx)) {
            ibv_ack_cq_events(cq, 1);
            got = 1;
        }
        if (errno != EAGAIN && !got)
            return -errno;
        result |= got;
    }
    return result;
}

/* Interrupts a wait in xv_wait_cq (0, or an errno). */
int xv_kick(xv_dev *d) {
    uint64_t one = 1;
    return write(d->kick_fd, &one, sizeof one) < 0 ? errno : 0;
}

/* Polls the CQ; UD receives are copied out and reposted, UD send completions free their AH. */
int xv_poll(xv_dev *d, xv_wc *out, int n) {
    struct ibv_wc wc[32];
    if (n > 32)
        n = 32;
    int got = ibv_poll_cq(d->cq, n, wc);
    if (got < 0)
        return got;
    int k = 0;
    for (int i = 0; i < got; i++) {
        if (wc[i].status != IBV_WC_SUCCESS) {
            wc[i].opcode = (enum ibv_wc_opcode)XV_POISON;
            wc[i].byte_len = XV_POISON;
            wc[i].imm_data = XV_POISON;
            wc[i].src_qp = XV_POISON;
            wc[i].wc_flags = XV_POISON;
        }
        xv_wc *o = &out[k];
        memset(o, 0, offsetof(xv_wc, data));
        o->wr_id = wc[i].wr_id;
        o->status = wc[i].status;
        o->byte_len = wc[i].byte_len;
        o->qp_num = wc[i].qp_num;
        o->vendor_err = wc[i].vendor_err;
        uint64_t tag = wc[i].wr_id & XV_TAG_MASK;
        if ((tag == XV_TAG_UD_SEND || tag == XV_TAG_UD_RECV) && ud_gen_of(wc[i].wr_id) != d->ud_gen)
            continue; /* the QP's previous incarnation: its slots were reclaimed at the reset */
        if ((tag == XV_TAG_UD_SEND || tag == XV_TAG_UD_RECV) && wc[i].status != IBV_WC_SUCCESS)
            d->ud_broken = 1; /* an error moves a UD QP to the error state: reset below */
        if (tag == XV_TAG_UD_SEND) {
            unsigned slot = (unsigned)(wc[i].wr_id & 0xffff) % UD_SLOTS;
            if (d->ud_busy & (1ull << slot)) {
                ibv_destroy_ah(d->ud_ah[slot]);
                d->ud_ah[slot] = NULL;
                d->ud_busy &= ~(1ull << slot);
            }
            continue; /* handshake sends need no report */
        }
        if (tag == XV_TAG_UD_RECV) {
            unsigned slot = (unsigned)(wc[i].wr_id & 0xffff) % UD_SLOTS;
            if (wc[i].status == IBV_WC_SUCCESS && wc[i].byte_len > GRH) {
                uint32_t len = wc[i].byte_len - GRH;
                if (len > UD_MSG)
                    len = UD_MSG;
                memcpy(o->data, d->ud_buf + (UD_SLOTS + slot) * (GRH + UD_MSG) + GRH, len);
                o->byte_len = len;
                o->kind = XV_UD_RECV;
                k++;
            }
            /* After an error the QP is reset (every slot reposted then), never reposted into. */
            if (!d->ud_broken)
                ud_post_recv(d, slot);
            continue;
        }
        if (tag == XV_TAG_IMM_RECV) {
            o->kind = XV_RECV_IMM;
            o->imm = wc[i].status == IBV_WC_SUCCESS ? ntohl(wc[i].imm_data) : XV_POISON;
        } else if (tag == XV_TAG_MSG_RECV) {
            o->kind = XV_RECV_MSG;
        } else {
            o->kind = XV_SEND_DONE;
        }
        if (wc[i].status != IBV_WC_SUCCESS)
            o->byte_len = XV_POISON;
        k++;
    }
    /* Once its completions are read: the reset discards what the failed QP still held. A
     * failed reset is retried on the next poll. */
    if (d->ud_broken)
        ud_reset(d);
    return k;
}

const char *xv_wc_status_str(int status) { return ibv_wc_status_str((enum ibv_wc_status)status); }
