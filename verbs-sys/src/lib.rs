//! Raw bindings to xfer's libibverbs shim (`csrc/shim.c`). `backend-verbs`'s `ffi` module
//! wraps them; everything here is `unsafe` to call.
#![allow(missing_docs)]

use std::ffi::{c_char, c_int, c_void};

/// The shim's device bundle (context, PD, CQ, SRQs, UD QP); opaque here.
#[repr(C)]
pub struct XvDev {
    _opaque: [u8; 0],
}

/// `struct ibv_qp` / `struct ibv_mr` / `struct ibv_ah`, opaque here.
#[repr(C)]
pub struct IbvQp {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct IbvMr {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct IbvAh {
    _opaque: [u8; 0],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct XvAttr {
    pub gid: [u8; 16],
    pub gid_index: c_int,
    pub ud_qpn: u32,
    pub lid: u16,
    pub active_mtu: c_int,
    pub ethernet: c_int,
    pub state: c_int,
    pub max_msg_sz: u32,
    /// The CQ's capacity as created (the device may round the size asked up).
    pub cq_entries: c_int,
}

/// Writes posted per doorbell (`xv_post_writes` takes at most this many): set in build.rs,
/// the one place it is written, which hands it to the C shim too.
pub const CHAIN: usize = parse_usize(env!("XFER_VERBS_CHAIN"));

const fn parse_usize(digits: &str) -> usize {
    let bytes = digits.as_bytes();
    let mut n = 0;
    let mut i = 0;
    while i < bytes.len() {
        assert!(
            bytes[i].is_ascii_digit(),
            "XFER_VERBS_CHAIN is not a number"
        );
        n = n * 10 + (bytes[i] - b'0') as usize;
        i += 1;
    }
    n
}

/// Work-request id tags (top four bits): a failed completion defines only `wr_id`, `status`,
/// `vendor_err` and `qp_num`, so completions are routed by these. `shim.c` writes the ones it
/// uses itself (`TAG_SHIFT`, `TAG_MASK`, `TAG_IMM_RECV`) with the same values.
pub const TAG_SHIFT: u32 = 60;
/// The tag bits.
pub const TAG_MASK: u64 = 0xf << TAG_SHIFT;
/// An RC write or message send.
pub const TAG_SEND: u64 = 0x1 << TAG_SHIFT;
/// A zero-length receive of the immediate SRQ.
pub const TAG_IMM_RECV: u64 = 0x2 << TAG_SHIFT;
/// A message buffer of the message SRQ.
pub const TAG_MSG_RECV: u64 = 0x4 << TAG_SHIFT;
/// A receive of the handshake (UD) QP.
pub const TAG_UD_RECV: u64 = 0x8 << TAG_SHIFT;
/// A send of the handshake (UD) QP.
pub const TAG_UD_SEND: u64 = 0x9 << TAG_SHIFT;

/// One completion as `xv_poll` read it: the fields a failed completion leaves undefined
/// (`byte_len`, `imm`) read `0xdeadbeef`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct XvCqe {
    pub wr_id: u64,
    pub status: c_int,
    pub byte_len: u32,
    /// The immediate, host order.
    pub imm: u32,
    pub qp_num: u32,
    pub vendor_err: u32,
    pub pad: c_int,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct XvWrite {
    pub wr_id: u64,
    pub laddr: u64,
    pub raddr: u64,
    pub len: u32,
    pub lkey: u32,
    pub rkey: u32,
    pub imm: u32,
    pub has_imm: c_int,
    pub signaled: c_int,
    /// The caller's own id for the write (not given to the NIC).
    pub user: u64,
    /// 1: an RDMA READ of `raddr` into `laddr` (no immediate).
    pub read: c_int,
    /// 1: the bytes are copied into the work request at post time (`IBV_SEND_INLINE`).
    pub inline_data: c_int,
    /// The caller's count of connection flushes the write survived (not given to the NIC).
    pub flushes: c_int,
    pub pad: c_int,
}

// shim.c checks the same sizes of its structs.
const _: () = assert!(std::mem::size_of::<XvCqe>() == 32);
const _: () = assert!(std::mem::size_of::<XvAttr>() == 48);

extern "C" {
    pub fn xv_list(buf: *mut c_char, cap: usize) -> c_int;
    pub fn xv_arm_cq(d: *mut XvDev) -> c_int;
    pub fn xv_wait_cq(d: *mut XvDev, timeout_ms: c_int, watch_async: c_int) -> c_int;
    pub fn xv_kick(d: *mut XvDev) -> c_int;
    pub fn xv_open(
        name: *const c_char,
        port: c_int,
        out: *mut *mut XvDev,
        err: *mut c_char,
        cap: usize,
    ) -> c_int;
    pub fn xv_query_gid(d: *mut XvDev, index: c_int, gid: *mut u8, kind: *mut c_int) -> c_int;
    pub fn xv_max_cqe(d: *mut XvDev) -> c_int;
    pub fn xv_setup(
        d: *mut XvDev,
        gid_index: c_int,
        cq_size: c_int,
        srq_size: c_int,
        ud_slots: c_int,
        attr: *mut XvAttr,
        err: *mut c_char,
        cap: usize,
    ) -> c_int;
    pub fn xv_close(d: *mut XvDev);
    pub fn xv_reg_mr(
        d: *mut XvDev,
        addr: *mut c_void,
        len: usize,
        remote_write: c_int,
        lkey: *mut u32,
        rkey: *mut u32,
        err: *mut c_int,
    ) -> *mut IbvMr;
    pub fn xv_dereg_mr(mr: *mut IbvMr) -> c_int;
    pub fn xv_reg_dmabuf_mr(
        d: *mut XvDev,
        offset: u64,
        len: usize,
        iova: u64,
        fd: c_int,
        remote_write: c_int,
        lkey: *mut u32,
        rkey: *mut u32,
        err: *mut c_int,
    ) -> *mut IbvMr;
    pub fn xv_create_rc(
        d: *mut XvDev,
        msg: c_int,
        max_send_wr: c_int,
        max_inline: *mut u32,
        qpn: *mut u32,
        err: *mut c_int,
    ) -> *mut IbvQp;
    pub fn xv_connect_rc(
        d: *mut XvDev,
        qp: *mut IbvQp,
        rqpn: u32,
        rpsn: u32,
        lpsn: u32,
        rgid: *const u8,
        rlid: u16,
        mtu: c_int,
        timeout: c_int,
        retry_cnt: c_int,
        rnr_retry: c_int,
        err: *mut c_char,
        cap: usize,
    ) -> c_int;
    pub fn xv_qp_to_error(qp: *mut IbvQp) -> c_int;
    pub fn xv_set_path(
        d: *mut XvDev,
        traffic_class: c_int,
        service_level: c_int,
        global_mode: c_int,
    );
    pub fn xv_destroy_qp(qp: *mut IbvQp) -> c_int;
    pub fn xv_post_writes(qp: *mut IbvQp, w: *const XvWrite, n: c_int, posted: *mut c_int)
        -> c_int;
    pub fn xv_post_send(qp: *mut IbvQp, wr_id: u64, addr: u64, len: u32, lkey: u32) -> c_int;
    pub fn xv_post_imm_recvs(d: *mut XvDev, first: u64, n: c_int, posted: *mut c_int) -> c_int;
    pub fn xv_post_srq_recv(
        d: *mut XvDev,
        msg: c_int,
        wr_id: u64,
        addr: u64,
        len: u32,
        lkey: u32,
    ) -> c_int;
    pub fn xv_ud_bring_up(d: *mut XvDev, err: *mut c_char, cap: usize) -> c_int;
    pub fn xv_ud_reset(d: *mut XvDev) -> c_int;
    pub fn xv_ud_post_recv(d: *mut XvDev, wr_id: u64, addr: u64, len: u32, lkey: u32) -> c_int;
    pub fn xv_ud_create_ah(
        d: *mut XvDev,
        dgid: *const u8,
        dlid: u16,
        err: *mut c_int,
    ) -> *mut IbvAh;
    pub fn xv_destroy_ah(ah: *mut IbvAh) -> c_int;
    pub fn xv_ud_post_send(
        d: *mut XvDev,
        ah: *mut IbvAh,
        dqpn: u32,
        wr_id: u64,
        addr: u64,
        len: u32,
        lkey: u32,
    ) -> c_int;
    pub fn xv_ud_destroy(d: *mut XvDev) -> c_int;
    pub fn xv_poll(d: *mut XvDev, out: *mut XvCqe, n: c_int) -> c_int;
    pub fn xv_ud_to_error(d: *mut XvDev) -> c_int;
    pub fn xv_async_event(d: *mut XvDev, event_type: *mut c_int, qpn: *mut u32) -> c_int;
    pub fn xv_event_str(event_type: c_int) -> *const c_char;
    pub fn xv_resize_cq(d: *mut XvDev, size: c_int, cqe: *mut c_int) -> c_int;
    pub fn xv_wc_status_str(status: c_int) -> *const c_char;
}
