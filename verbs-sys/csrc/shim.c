/* Why one file: it is the one translation unit the crate's build script compiles, and its
 * wrappers share the device struct and static helpers below. */
/* A flat C surface over libibverbs for Rust. ibv_post_send, ibv_poll_cq and friends are static
 * inline functions going through the context's ops, so they are wrapped here, compiled against
 * rdma-core's headers (every struct layout is the real one). Policy lives in Rust, where it is
 * unit tested: the handshake QP's slots, generations and resets (backend-verbs/src/ud.rs) and
 * the CQ's reservations and growth (backend-verbs/src/cq.rs); these are the calls they make. */
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

#define UD_QKEY 0x58464552u /* "XFER" */

typedef struct xv_dev {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    struct ibv_srq *srq_imm;
    struct ibv_srq *srq_msg;
    struct ibv_qp *ud; /* the handshake QP; its buffers and slots are Rust's */
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
    int cq_entries; /* the CQ's capacity as created (the device may round the size up) */
} xv_attr;

/* Every work request's id carries what it is in its top four bits, because a failed work
 * completion defines only wr_id, status, vendor_err and qp_num (ibv_poll_cq(3)): its opcode,
 * byte_len and immediate are undefined (mlx5 does not write them). Rust routes completions by
 * these tags, never by opcode; all of them are listed in verbs-sys/src/lib.rs. The shim makes
 * only the immediate receives' ids itself (xv_post_imm_recvs). */
#define XV_TAG_SHIFT 60
#define XV_TAG_MASK (0xfull << XV_TAG_SHIFT)
#define XV_TAG_IMM_RECV (0x2ull << XV_TAG_SHIFT) /* zero-length receive of the immediate SRQ */

/* What a failed completion's undefined fields are overwritten with, so code that reads them
 * fails on soft-RoCE too (rxe happens to fill them in). */
#define XV_POISON 0xdeadbeefu

/* One completion as polled: the fields a failed completion leaves undefined are XV_POISON. */
typedef struct xv_cqe {
    uint64_t wr_id;
    int status;
    uint32_t byte_len;
    uint32_t imm; /* host order */
    uint32_t qp_num;
    uint32_t vendor_err;
    int pad;
} xv_cqe;
/* verbs-sys/src/lib.rs mirrors these layouts and checks the same sizes. */
_Static_assert(sizeof(xv_cqe) == 32, "xv_cqe's layout is mirrored by verbs_sys::XvCqe");
_Static_assert(sizeof(xv_attr) == 48, "xv_attr's layout is mirrored by verbs_sys::XvAttr");

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

/* INIT → RTR → RTS: a new UD QP, or one just reset. Its receives are Rust's to post. 0, or the
 * failed step's errno (described in err). */
int xv_ud_bring_up(xv_dev *d, char *err, size_t cap) {
    int rc;
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = d->port, .qkey = UD_QKEY};
    if ((rc = ibv_modify_qp(d->ud, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY))) {
        set_err(err, cap, "UD QP to INIT", rc);
        return rc;
    }
    a.qp_state = IBV_QPS_RTR;
    if ((rc = ibv_modify_qp(d->ud, &a, IBV_QP_STATE))) {
        set_err(err, cap, "UD QP to RTR", rc);
        return rc;
    }
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = 0;
    if ((rc = ibv_modify_qp(d->ud, &a, IBV_QP_STATE | IBV_QP_SQ_PSN))) {
        set_err(err, cap, "UD QP to RTS", rc);
        return rc;
    }
    return 0;
}

/* Moves the UD QP to RESET (it keeps its QPN; everything it held is discarded): 0 or an errno. */
int xv_ud_reset(xv_dev *d) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RESET;
    return ibv_modify_qp(d->ud, &a, IBV_QP_STATE);
}

/* Posts one receive of the UD QP into [addr, addr + len): 0 or an errno. */
int xv_ud_post_recv(xv_dev *d, uint64_t wr_id, uint64_t addr, uint32_t len, uint32_t lkey) {
    struct ibv_sge sge = {.addr = addr, .length = len, .lkey = lkey};
    struct ibv_recv_wr wr = {.wr_id = wr_id, .sg_list = &sge, .num_sge = 1}, *bad;
    return ibv_post_recv(d->ud, &wr, &bad);
}

/* An address handle towards (dgid, dlid) with the device's path settings, or NULL (errno in
 * *err). */
struct ibv_ah *xv_ud_create_ah(xv_dev *d, const uint8_t dgid[16], uint16_t dlid, int *err) {
    struct ibv_ah_attr aa;
    memset(&aa, 0, sizeof aa);
    fill_ah(d, &aa, dgid, dlid);
    struct ibv_ah *ah = ibv_create_ah(d->pd, &aa);
    if (!ah)
        *err = errno ? errno : EINVAL;
    return ah;
}

int xv_destroy_ah(struct ibv_ah *ah) { return ibv_destroy_ah(ah); }

/* Posts a signalled datagram of [addr, addr + len) through `ah` to UD QP `dqpn`: 0 or an errno. */
int xv_ud_post_send(xv_dev *d, struct ibv_ah *ah, uint32_t dqpn, uint64_t wr_id, uint64_t addr, uint32_t len,
                    uint32_t lkey) {
    struct ibv_sge sge = {.addr = addr, .length = len, .lkey = lkey};
    struct ibv_send_wr wr = {.wr_id = wr_id, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
                             .send_flags = IBV_SEND_SIGNALED}, *bad;
    wr.wr.ud.ah = ah;
    wr.wr.ud.remote_qpn = dqpn;
    wr.wr.ud.remote_qkey = UD_QKEY;
    return ibv_post_send(d->ud, &wr, &bad);
}

/* Destroys the UD QP ahead of the rest of the device, so the buffers and address handles its
 * work requests used can go before xv_close: 0 or an errno. */
int xv_ud_destroy(xv_dev *d) {
    int rc = d->ud ? ibv_destroy_qp(d->ud) : 0;
    if (!rc)
        d->ud = NULL;
    return rc;
}

/* Test hook: puts the UD QP into the error state, as a failed datagram does. */
int xv_ud_to_error(xv_dev *d) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_ERR;
    return ibv_modify_qp(d->ud, &a, IBV_QP_STATE);
}

/* Sets O_NONBLOCK on `fd`: 0, or -1 with errno set. */
static int set_nonblocking(int fd) {
    int flags = fcntl(fd, F_GETFL);
    return flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0 ? -1 : 0;
}

/* The device's largest CQ, or 0 if it does not say. */
int xv_max_cqe(xv_dev *d) {
    struct ibv_device_attr da;
    return ibv_query_device(d->ctx, &da) ? 0 : da.max_cqe;
}

/* Creates PD, CQ (of `cq_size` entries: at most xv_max_cqe), the two SRQs and the UD handshake
 * QP (`ud_slots` sends and receives deep; in RTS, no receive posted), using GID `gid_index`. */
int xv_setup(xv_dev *d, int gid_index, int cq_size, int srq_size, int ud_slots, xv_attr *attr, char *err,
             size_t cap) {
    int rc;
    d->gid_index = gid_index;
    {
        struct ibv_device_attr da;
        d->max_rd_atomic = d->max_dest_rd_atomic = 1;
        if (!ibv_query_device(d->ctx, &da)) {
            d->max_rd_atomic = da.max_qp_init_rd_atom > 0 ? (da.max_qp_init_rd_atom < 16 ? da.max_qp_init_rd_atom : 16) : 1;
            d->max_dest_rd_atomic = da.max_qp_rd_atom > 0 ? (da.max_qp_rd_atom < 16 ? da.max_qp_rd_atom : 16) : 1;
        }
    }
    if ((rc = ibv_query_gid(d->ctx, d->port, gid_index, &d->gid))) {
        set_err(err, cap, "ibv_query_gid", rc);
        return -1;
    }
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
    struct ibv_qp_init_attr qa = {.send_cq = d->cq, .recv_cq = d->cq, .qp_type = IBV_QPT_UD,
                                  .cap = {.max_send_wr = ud_slots, .max_recv_wr = ud_slots, .max_send_sge = 1, .max_recv_sge = 1}};
    if (!(d->ud = ibv_create_qp(d->pd, &qa))) {
        set_err(err, cap, "ibv_create_qp(UD)", errno);
        return -1;
    }
    if (xv_ud_bring_up(d, err, cap))
        return -1;
    memcpy(attr->gid, d->gid.raw, 16);
    attr->gid_index = gid_index;
    attr->ud_qpn = d->ud->qp_num;
    attr->lid = d->port_attr.lid;
    attr->active_mtu = d->port_attr.active_mtu;
    attr->ethernet = d->port_attr.link_layer == IBV_LINK_LAYER_ETHERNET;
    attr->state = d->port_attr.state;
    attr->max_msg_sz = d->max_msg_sz;
    attr->cq_entries = d->cq->cqe;
    return 0;
}

void xv_close(xv_dev *d) {
    if (!d)
        return;
    if (d->ud)
        ibv_destroy_qp(d->ud);
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

int xv_destroy_qp(struct ibv_qp *qp);

/* Resizes the CQ to at least `size` entries: 0 and its capacity now in *cqe, or an errno. */
int xv_resize_cq(xv_dev *d, int size, int *cqe) {
    int rc = ibv_resize_cq(d->cq, size);
    if (!rc)
        *cqe = d->cq->cqe;
    return rc;
}

/* An RC QP in INIT, receiving from the imm or the message SRQ (`msg`). `max_inline`: in, the
 * inline data size asked for; out, what the QP has (a device that refuses the size gets a QP
 * without inline data, rather than none). The caller reserved the CQ entries for what it lets
 * the QP have outstanding. */
struct ibv_qp *xv_create_rc(xv_dev *d, int msg, int max_send_wr, uint32_t *max_inline, uint32_t *qpn, int *err) {
    struct ibv_qp_init_attr qa = {.send_cq = d->cq, .recv_cq = d->cq,
                                  .srq = msg ? d->srq_msg : d->srq_imm, .qp_type = IBV_QPT_RC,
                                  .cap = {.max_send_wr = max_send_wr, .max_send_sge = 1, .max_inline_data = *max_inline}};
    struct ibv_qp *qp = ibv_create_qp(d->pd, &qa);
    if (!qp && *max_inline) {
        qa.cap.max_inline_data = 0;
        qp = ibv_create_qp(d->pd, &qa);
    }
    if (!qp) {
        *err = errno;
        return NULL;
    }
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = d->port,
                            .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE};
    int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
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

int xv_destroy_qp(struct ibv_qp *qp) { return ibv_destroy_qp(qp); }

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

/* Asks for one completion event at the CQ's next completion (0, or an errno). Completions
 * already on the CQ raise none: the caller polls once more after arming. */
int xv_arm_cq(xv_dev *d) { return ibv_req_notify_cq(d->cq, 0); }

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

/* Polls up to `n` (at most 32) completions into `out`: how many, or a negative error. */
int xv_poll(xv_dev *d, xv_cqe *out, int n) {
    struct ibv_wc wc[32];
    if (n > 32)
        n = 32;
    int got = ibv_poll_cq(d->cq, n, wc);
    for (int i = 0; i < got; i++) {
        if (wc[i].status != IBV_WC_SUCCESS) {
            wc[i].opcode = (enum ibv_wc_opcode)XV_POISON;
            wc[i].byte_len = XV_POISON;
            wc[i].imm_data = XV_POISON;
            wc[i].src_qp = XV_POISON;
            wc[i].wc_flags = XV_POISON;
        }
        out[i] = (xv_cqe){.wr_id = wc[i].wr_id, .status = wc[i].status, .byte_len = wc[i].byte_len,
                          .imm = wc[i].status == IBV_WC_SUCCESS ? ntohl(wc[i].imm_data) : XV_POISON,
                          .qp_num = wc[i].qp_num, .vendor_err = wc[i].vendor_err};
    }
    return got;
}

const char *xv_wc_status_str(int status) { return ibv_wc_status_str((enum ibv_wc_status)status); }
