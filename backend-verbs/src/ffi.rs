//! Why one file: it is the crate's one `unsafe` boundary — every raw libibverbs object (device,
//! CQ, QPs, regions, the UD buffer) with the safe type that owns it, so the ownership and
//! drop order the `// SAFETY:` comments rely on can be read in one place; the policies are pure
//! modules (`ud.rs`, `cq.rs`, `completion.rs`).
//!
//! Safe wrappers over `verbs-sys`. All of this backend's `unsafe` is in this file.
//!
//! Why one file: it is the backend's one unsafe boundary, audited as a whole — every wrapper
//! here (the device with its PD, CQs and SRQs; registrations; QPs and their chains; message
//! buffers) rests on the same raw device, and their soundness is an ordering between them
//! (a `Mr` or `Qp` never outlives its `Device`, a buffer is deregistered before it is freed,
//! an inline write's range was checked against a live registration). Split over files, those
//! orderings would be argued in several places; the safe logic above them already lives in
//! `domain/`, `completion.rs`, `notify.rs`, and — for what the handshake QP's slots and the
//! CQ's size decide — `ud.rs` and `cq.rs`.

use std::ffi::{c_char, CStr, CString};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use verbs_sys as sys;
use xfer_plugin::domain::{MemoryRegion, ReceivePool};

use crate::cq::CqBudget;
use crate::ud::{self, UdCompletion, UdSlots};

pub(crate) use crate::cq::{Wc, KIND_RECV_IMM, KIND_RECV_MSG, KIND_UD_RECV};
// `XvWrite` is the shim's name for any RDMA work request (its `read` flag makes it a read).
pub(crate) use sys::{XvAttr as Attr, XvWrite as WorkRequest, TAG_MASK, TAG_MSG_RECV, TAG_SEND};

const EINVAL: i32 = 22;
const EAGAIN: i32 = 11;

/// What peers may do to a registration, as the shim takes it: bit 0 write, bit 1 read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RemoteBits(pub(crate) i32);

impl RemoteBits {
    pub(crate) fn of(write: bool, read: bool) -> Self {
        Self(i32::from(write) | (i32::from(read) << 1))
    }
}

fn text(buf: &[c_char]) -> String {
    // SAFETY: the shim NUL-terminates what it writes and the buffer starts zeroed.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

fn errno_text(code: i32) -> String {
    std::io::Error::from_raw_os_error(code).to_string()
}

/// A failed `ibv_reg_mr`: its words and the errno it set (callers decide by the errno, never
/// by the text).
#[derive(Debug)]
pub(crate) struct RegistrationError {
    pub(crate) message: String,
    pub(crate) errno: i32,
}

impl RegistrationError {
    /// Whether the kernel could not pin the pages: most often the locked-memory limit.
    pub(crate) fn is_out_of_memory(&self) -> bool {
        self.errno == 12
    }
}

impl std::fmt::Display for RegistrationError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// The names of the RDMA devices present.
pub(crate) fn devices() -> Vec<String> {
    let mut buf = vec![0 as c_char; 16 * 1024];
    // SAFETY: buf has the capacity passed.
    let n = unsafe { sys::xv_list(buf.as_mut_ptr(), buf.len()) };
    if n <= 0 {
        return Vec::new();
    }
    text(&buf).lines().map(str::to_owned).collect()
}

/// An opened RDMA device with its PD, CQ, SRQs and UD handshake QP.
pub(crate) struct Device {
    raw: NonNull<sys::XvDev>,
    /// The thread waiting on the CQ's completion channel, if started: stopped and joined
    /// before the device closes.
    notifier: Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>)>,
    /// What is reserved of the CQ; each RC QP holds a share (see [`CqShare`]).
    cq: Arc<Mutex<CqBudget>>,
    /// The handshake QP's buffers and slots, once set up.
    ud: Option<HandshakeQp>,
    /// Completions as the shim polled them, before they are routed.
    polled: [sys::XvCqe; 32],
}

/// The handshake QP's registered buffer and its slots (see `crate::ud`).
struct HandshakeQp {
    slots: UdSlots<Ah>,
    /// Declared ahead of `buffer`: deregistered before it is freed.
    mr: Mr,
    /// [`ud::BUFFER_LEN`] bytes: the send slots, then the receive slots. Stays at its address
    /// while registered; the NIC reads and writes it only between a post and its completion.
    buffer: Box<[u8]>,
}

impl HandshakeQp {
    /// Posts receive slot `slot` in the slots' current generation.
    fn post_recv(&mut self, device: NonNull<sys::XvDev>, slot: usize) -> i32 {
        let at = ud::recv_offset(slot);
        let addr = self.buffer[at..at + ud::RECV_SLOT].as_mut_ptr() as u64;
        // SAFETY: the range lies in `buffer`, registered as `mr`; both live until after the
        // UD QP is destroyed (`Device::drop`), so the NIC never writes freed memory.
        unsafe {
            sys::xv_ud_post_recv(
                device.as_ptr(),
                self.slots.recv_wr_id(slot),
                addr,
                ud::RECV_SLOT as u32,
                self.mr.lkey,
            )
        }
    }

    /// Posts every receive slot: 0, or the first errno.
    fn post_every_recv(&mut self, device: NonNull<sys::XvDev>) -> i32 {
        (0..ud::UD_SLOTS)
            .map(|slot| self.post_recv(device, slot))
            .find(|&rc| rc != 0)
            .unwrap_or(0)
    }
}

/// An address handle a handshake send goes through, destroyed when its send completed.
struct Ah(NonNull<sys::IbvAh>);

impl Drop for Ah {
    fn drop(&mut self) {
        // SAFETY: created once by xv_ud_create_ah, destroyed once, after the send that used it
        // completed or its QP was reset or destroyed.
        unsafe { sys::xv_destroy_ah(self.0.as_ptr()) };
    }
}

/// An RC QP's share of its device's CQ: released when the QP is destroyed.
struct CqShare {
    /// The QP's device (a QP never outlives it: the Domain drops QPs first).
    device: NonNull<sys::XvDev>,
    budget: Arc<Mutex<CqBudget>>,
    entries: usize,
}

fn budget(cq: &Mutex<CqBudget>) -> MutexGuard<'_, CqBudget> {
    // The budget's updates cannot panic midway.
    cq.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Reserves `entries` of `device`'s CQ in `cq`, resizing the CQ if the budget says so: 0, or
/// an errno.
fn reserve_cq(device: NonNull<sys::XvDev>, cq: &Mutex<CqBudget>, entries: usize) -> i32 {
    let entries = i64::try_from(entries).unwrap_or(i64::MAX / 2);
    let result = budget(cq).reserve(entries, |size| {
        let mut cqe = 0;
        // SAFETY: a live device (see `CqShare::device`); `cqe` is a valid out-pointer. The
        // wake thread's wait on the channel may run meanwhile: libibverbs allows it.
        match unsafe { sys::xv_resize_cq(device.as_ptr(), size, &mut cqe) } {
            0 => Ok(cqe),
            e => Err(e),
        }
    });
    result.err().unwrap_or(0)
}

/// What a wait on the completion channel ended with (all false: the timeout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Wait {
    /// A completion event: the CQ got a completion after it was armed (and is disarmed now).
    pub(crate) completion: bool,
    /// [`Device::kick`] was called.
    pub(crate) kick: bool,
    /// An asynchronous event waits to be read (by the Domain: see `Device::async_event`).
    pub(crate) async_event: bool,
}

/// The wake thread's handle on the device's completion channel.
pub(crate) struct CqEvents {
    raw: NonNull<sys::XvDev>,
    stop: Arc<AtomicBool>,
}

// SAFETY: the shim's wait touches only the completion channel and the kick eventfd, which
// libibverbs and the kernel let one thread wait on while another polls and arms the CQ; the
// device outlives this handle (Device::drop joins its thread before closing).
unsafe impl Send for CqEvents {}

impl CqEvents {
    /// Waits for a completion event, a kick or (with `watch_async`) a pending asynchronous
    /// event, at most `timeout` (`None`: without limit).
    pub(crate) fn wait(
        &self,
        timeout: Option<Duration>,
        watch_async: bool,
    ) -> Result<Wait, String> {
        let ms = timeout.map_or(-1, |t| t.as_millis().clamp(1, i32::MAX as u128) as i32);
        // SAFETY: see `unsafe impl Send for CqEvents`.
        match unsafe { sys::xv_wait_cq(self.raw.as_ptr(), ms, i32::from(watch_async)) } {
            e if e < 0 => Err(format!(
                "waiting on the completion channel: {}",
                errno_text(-e)
            )),
            mask => Ok(Wait {
                completion: mask & 1 != 0,
                kick: mask & 2 != 0,
                async_event: mask & 4 != 0,
            }),
        }
    }

    /// Whether the device is closing (the thread must return).
    pub(crate) fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }
}

// SAFETY: verbs objects may be used from any thread; the Domain (and so this) is used by one
// thread at a time.
unsafe impl Send for Device {}

impl Device {
    pub(crate) fn open(name: &str, port: i32) -> Result<Self, String> {
        let cname = CString::new(name).map_err(|_| format!("{name:?} contains a NUL byte"))?;
        let mut raw = std::ptr::null_mut();
        let mut err = [0 as c_char; 512];
        // SAFETY: valid pointers for the call.
        let rc =
            unsafe { sys::xv_open(cname.as_ptr(), port, &mut raw, err.as_mut_ptr(), err.len()) };
        match NonNull::new(raw) {
            Some(raw) if rc == 0 => Ok(Self {
                raw,
                notifier: None,
                // SAFETY: the device is open.
                cq: Arc::new(Mutex::new(CqBudget::new(unsafe {
                    sys::xv_max_cqe(raw.as_ptr())
                }))),
                ud: None,
                polled: [sys::XvCqe::default(); 32],
            }),
            _ => Err(text(&err)),
        }
    }

    /// GID table entry `index`: `Ok(Some((gid, roce_v2)))`, `Ok(None)` for an empty entry,
    /// `Err(())` past the end of the table.
    pub(crate) fn gid(&mut self, index: i32) -> Result<Option<([u8; 16], bool)>, ()> {
        let mut gid = [0u8; 16];
        let mut kind = 0;
        // SAFETY: gid has 16 bytes; the device is open.
        match unsafe { sys::xv_query_gid(self.raw.as_ptr(), index, gid.as_mut_ptr(), &mut kind) } {
            0 => Ok(Some((gid, kind == 2))),
            -1 => Ok(None),
            _ => Err(()),
        }
    }

    /// Creates the PD, the CQ (room for `cq_size` completions, or the device's largest), the
    /// SRQs (`srq_size` deep) and the handshake QP with every receive slot posted.
    pub(crate) fn setup(
        &mut self,
        gid_index: i32,
        cq_size: i32,
        srq_size: i32,
    ) -> Result<Attr, String> {
        let mut attr = Attr::default();
        let mut err = [0 as c_char; 512];
        let cq_size = budget(&self.cq).initial_size(cq_size);
        // SAFETY: the device is open; out-pointers valid.
        let rc = unsafe {
            sys::xv_setup(
                self.raw.as_ptr(),
                gid_index,
                cq_size,
                srq_size,
                ud::UD_SLOTS as i32,
                &mut attr,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        if rc != 0 {
            return Err(text(&err));
        }
        budget(&self.cq).created(cq_size, attr.cq_entries);
        let mut buffer = vec![0u8; ud::BUFFER_LEN].into_boxed_slice();
        // SAFETY: `HandshakeQp` keeps the buffer at this address and drops the registration
        // before it.
        let mr = unsafe {
            self.register(
                buffer.as_mut_ptr() as u64,
                buffer.len(),
                RemoteBits::of(false, false),
            )
        }
        .map_err(|e| format!("ibv_reg_mr(handshake buffers): {e}"))?;
        let mut qp = HandshakeQp {
            slots: UdSlots::default(),
            mr,
            buffer,
        };
        let rc = qp.post_every_recv(self.raw);
        // Kept even when a post failed: receives already posted use the buffer.
        self.ud = Some(qp);
        if rc != 0 {
            return Err(format!("ibv_post_recv(UD): {}", errno_text(rc)));
        }
        Ok(attr)
    }

    /// Registers the memory of a region the engine hands to `Domain::register` (host memory,
    /// or GPU memory through nvidia-peermem, which pins GPU pages itself).
    pub(crate) fn register_region(
        &mut self,
        region: &MemoryRegion,
    ) -> Result<Mr, RegistrationError> {
        // SAFETY: `Domain::register`'s contract: the engine registers only memory its caller
        // keeps allocated until it is deregistered (`TransferEngine::reg_mr` is `unsafe` for
        // that), and deregistering drops this registration.
        unsafe {
            self.register(
                region.ptr,
                region.len as usize,
                RemoteBits::of(region.remote_write, region.remote_read),
            )
        }
    }

    /// Registers the GPU memory of a region the engine hands to `Domain::register` through a
    /// dma-buf exported for it (`cuMemGetHandleForAddressRange` → `ibv_reg_dmabuf_mr`).
    pub(crate) fn register_region_dmabuf(
        &mut self,
        region: &MemoryRegion,
        gpu: u32,
    ) -> Result<Mr, String> {
        let (fd, offset) = xfer_cuda::dmabuf(region.ptr, region.len, gpu)?;
        // SAFETY: as for `register_region`, the engine checked the range is live device
        // memory of this GPU, kept allocated until deregistration; the fd was just exported
        // for it and is ours to hand over.
        unsafe {
            self.register_dmabuf(
                offset,
                region.len as usize,
                region.ptr,
                fd,
                RemoteBits::of(region.remote_write, region.remote_read),
            )
        }
    }

    /// Registers memory.
    ///
    /// # Safety
    /// The memory must stay allocated until the registration is dropped.
    unsafe fn register(
        &mut self,
        addr: u64,
        len: usize,
        remote: RemoteBits,
    ) -> Result<Mr, RegistrationError> {
        let (mut lkey, mut rkey, mut err) = (0, 0, 0);
        // SAFETY: per this function's contract.
        let mr = unsafe {
            sys::xv_reg_mr(
                self.raw.as_ptr(),
                addr as *mut _,
                len,
                remote.0,
                &mut lkey,
                &mut rkey,
                &mut err,
            )
        };
        NonNull::new(mr)
            .map(|raw| Mr { raw, lkey, rkey })
            .ok_or_else(|| RegistrationError {
                message: format!("ibv_reg_mr of {len} bytes: {}", errno_text(err)),
                errno: err,
            })
    }

    /// Registers GPU memory exported as a dma-buf (`fd` spans whole pages; the region starts
    /// `offset` bytes into it and peers address it as `iova`). The fd is closed afterwards.
    ///
    /// # Safety
    /// The GPU memory must stay allocated until the registration is dropped; `fd` must be an
    /// open dma-buf descriptor this call may close.
    unsafe fn register_dmabuf(
        &mut self,
        offset: u64,
        len: usize,
        iova: u64,
        fd: i32,
        remote: RemoteBits,
    ) -> Result<Mr, String> {
        let (mut lkey, mut rkey, mut err) = (0, 0, 0);
        // SAFETY: per this function's contract.
        let mr = unsafe {
            sys::xv_reg_dmabuf_mr(
                self.raw.as_ptr(),
                offset,
                len,
                iova,
                fd,
                remote.0,
                &mut lkey,
                &mut rkey,
                &mut err,
            )
        };
        // SAFETY: the caller handed the descriptor over; the registration keeps its own
        // reference to the dma-buf.
        drop(unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) });
        NonNull::new(mr)
            .map(|raw| Mr { raw, lkey, rkey })
            .ok_or_else(|| format!("ibv_reg_dmabuf_mr of {len} bytes: {}", errno_text(err)))
    }

    /// A new RC QP in INIT, receiving from the message SRQ (`msg`) or the immediate SRQ.
    /// Creates an RC QP with `inline` bytes of inline data asked for (the QP may get fewer,
    /// or none: see [`Qp::max_inline`]), a send queue of `max_send_wr` and `reserve` CQ
    /// entries (see [`Qp::reserved`]).
    pub(crate) fn create_rc(
        &mut self,
        msg: bool,
        max_send_wr: i32,
        reserve: i32,
        inline: u32,
    ) -> Result<Qp, String> {
        let reserve = reserve.max(0) as usize;
        let refused = reserve_cq(self.raw, &self.cq, reserve);
        if refused != 0 {
            return Err(format!("ibv_create_qp(RC): {}", errno_text(refused)));
        }
        let share = CqShare {
            device: self.raw,
            budget: self.cq.clone(),
            entries: reserve,
        };
        let mut max_inline = inline;
        let (mut qpn, mut err) = (0, 0);
        // SAFETY: the device is open; out-pointers valid.
        let qp = unsafe {
            sys::xv_create_rc(
                self.raw.as_ptr(),
                msg as i32,
                max_send_wr,
                &mut max_inline,
                &mut qpn,
                &mut err,
            )
        };
        // Without a QP, dropping the share gives its entries back.
        NonNull::new(qp)
            .map(|raw| Qp {
                raw,
                qpn,
                max_inline,
                cq: share,
            })
            .ok_or_else(|| format!("ibv_create_qp(RC): {}", errno_text(err)))
    }

    /// INIT → RTR → RTS towards `(gid, lid, qpn, psn)`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn connect(
        &mut self,
        qp: &Qp,
        rqpn: u32,
        rpsn: u32,
        lpsn: u32,
        gid: &[u8; 16],
        lid: u16,
        mtu: i32,
        (timeout, retry_cnt, rnr_retry): (i32, i32, i32),
    ) -> Result<(), String> {
        let mut err = [0 as c_char; 512];
        // SAFETY: qp belongs to this device; gid has 16 bytes.
        let rc = unsafe {
            sys::xv_connect_rc(
                self.raw.as_ptr(),
                qp.raw.as_ptr(),
                rqpn,
                rpsn,
                lpsn,
                gid.as_ptr(),
                lid,
                mtu,
                timeout,
                retry_cnt,
                rnr_retry,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        if rc != 0 {
            return Err(text(&err));
        }
        Ok(())
    }

    /// Posts one receive on the message (`msg`) or immediate SRQ.
    ///
    /// # Safety
    /// A non-empty buffer must stay registered and allocated until its completion.
    unsafe fn post_srq_recv(
        &mut self,
        msg: bool,
        wr_id: u64,
        addr: u64,
        len: u32,
        lkey: u32,
    ) -> Result<(), String> {
        // SAFETY: per this function's contract.
        let rc =
            unsafe { sys::xv_post_srq_recv(self.raw.as_ptr(), msg as i32, wr_id, addr, len, lkey) };
        if rc != 0 {
            return Err(format!("ibv_post_srq_recv: {}", errno_text(rc)));
        }
        Ok(())
    }

    /// Posts `n` zero-length receives to the immediate SRQ in one call; returns how many went
    /// in, and the error if not all did.
    pub(crate) fn post_imm_recvs(&mut self, first: u64, n: u32) -> (u32, Option<String>) {
        let mut posted = 0;
        let n = i32::try_from(n).unwrap_or(i32::MAX);
        // SAFETY: zero-length receives touch no memory; `posted` is a valid out-pointer.
        let rc = unsafe { sys::xv_post_imm_recvs(self.raw.as_ptr(), first, n, &mut posted) };
        let error = (rc != 0).then(|| format!("ibv_post_srq_recv: {}", errno_text(rc)));
        (posted.max(0) as u32, error)
    }

    /// Sets the path settings of every later QP and handshake datagram: traffic class,
    /// service level, and the GRH policy (0 auto, 1 always, 2 never).
    pub(crate) fn set_path(&mut self, traffic_class: u8, service_level: u8, global_mode: i32) {
        // SAFETY: a live device; plain values.
        unsafe {
            sys::xv_set_path(
                self.raw.as_ptr(),
                i32::from(traffic_class),
                i32::from(service_level),
                global_mode,
            )
        };
    }

    /// Sends a handshake datagram to the UD QP `(gid, lid, qpn)` from a free send slot. The
    /// error is the errno itself: every slot still being sent (`EAGAIN`) is routine, anything
    /// else is not.
    pub(crate) fn ud_send(
        &mut self,
        gid: &[u8; 16],
        lid: u16,
        qpn: u32,
        msg: &[u8],
    ) -> Result<(), std::io::Error> {
        let fail = std::io::Error::from_raw_os_error;
        let Some(ud) = self.ud.as_mut() else {
            return Err(fail(EINVAL));
        };
        if msg.len() > ud::UD_MSG {
            return Err(fail(EINVAL));
        }
        let slot = ud.slots.free_send_slot().ok_or_else(|| fail(EAGAIN))?;
        let mut err = 0;
        // SAFETY: the device is open; gid has 16 bytes; `err` is a valid out-pointer.
        let ah = unsafe { sys::xv_ud_create_ah(self.raw.as_ptr(), gid.as_ptr(), lid, &mut err) };
        let ah = Ah(NonNull::new(ah).ok_or_else(|| fail(err))?);
        let at = ud::send_offset(slot);
        let bytes = &mut ud.buffer[at..at + msg.len()];
        bytes.copy_from_slice(msg);
        // SAFETY: the slot is free (no send of it outstanding, so the NIC does not read it)
        // and lies in the registered buffer, which outlives the UD QP; the AH stays alive in
        // the slot until the send completes or the QP is reset.
        let rc = unsafe {
            sys::xv_ud_post_send(
                self.raw.as_ptr(),
                ah.0.as_ptr(),
                qpn,
                ud.slots.send_wr_id(slot),
                bytes.as_mut_ptr() as u64,
                msg.len() as u32,
                ud.mr.lkey,
            )
        };
        if rc != 0 {
            return Err(fail(rc));
        }
        ud.slots.sent(slot, ah);
        Ok(())
    }

    /// Test fault: puts the handshake QP into the error state.
    pub(crate) fn ud_to_error(&mut self) -> Result<(), String> {
        if self.ud.is_none() {
            return Err("UD QP to ERR: the device is not set up".into());
        }
        // SAFETY: the device is set up (it has its UD QP); the shim only modifies that QP.
        let rc = unsafe { sys::xv_ud_to_error(self.raw.as_ptr()) };
        if rc != 0 {
            return Err(format!("UD QP to ERR: {}", errno_text(rc)));
        }
        Ok(())
    }

    /// The next asynchronous event (QP and port errors, CQ overrun), without blocking: its
    /// type's name, its raw type, and the QP number for QP events.
    pub(crate) fn async_event(&mut self) -> Result<Option<(String, i32, u32)>, String> {
        let (mut kind, mut qpn) = (0, 0);
        // SAFETY: the device is open; out-pointers valid; the shim acknowledges the event.
        let rc = unsafe { sys::xv_async_event(self.raw.as_ptr(), &mut kind, &mut qpn) };
        match rc {
            0 => Ok(None),
            1 => {
                // SAFETY: ibv_event_type_str returns a static string for any value.
                let name = unsafe { CStr::from_ptr(sys::xv_event_str(kind)) }
                    .to_string_lossy()
                    .into_owned();
                Ok(Some((name, kind, qpn)))
            }
            _ => Err("reading async events failed".into()),
        }
    }

    /// The completion queue's capacity and how much of it is reserved.
    pub(crate) fn cq_state(&self) -> (i32, i64) {
        budget(&self.cq).state()
    }

    /// How many times the handshake QP was reset after an error.
    pub(crate) fn ud_resets(&self) -> u64 {
        self.ud.as_ref().map_or(0, |ud| ud.slots.resets())
    }

    /// Starts `run` on a thread of its own with the device's completion channel (at most
    /// once per device).
    pub(crate) fn start_notifier(
        &mut self,
        name: String,
        run: impl FnOnce(CqEvents) + Send + 'static,
    ) -> Result<(), String> {
        if self.notifier.is_some() {
            return Err("the completion channel already has a thread".into());
        }
        let stop = Arc::new(AtomicBool::new(false));
        let events = CqEvents {
            raw: self.raw,
            stop: stop.clone(),
        };
        let handle = std::thread::Builder::new()
            .name(name)
            .spawn(move || run(events))
            .map_err(|e| format!("starting the completion thread: {e}"))?;
        self.notifier = Some((stop, handle));
        Ok(())
    }

    /// Arms the CQ: its next completion raises one event on the channel. Completions already
    /// on it raise none, so poll once more after arming.
    pub(crate) fn arm_cq(&mut self) -> Result<(), String> {
        // SAFETY: the device is open.
        match unsafe { sys::xv_arm_cq(self.raw.as_ptr()) } {
            0 => Ok(()),
            e => Err(format!("ibv_req_notify_cq: {}", errno_text(e))),
        }
    }

    /// Test fault: the CQ keeps its present size, so enough unread completions overrun it.
    pub(crate) fn fix_cq_size(&mut self) {
        budget(&self.cq).fix();
    }

    /// Ends the current wait of the notifier thread (it recomputes its timeout).
    pub(crate) fn kick(&self) {
        // SAFETY: the device is open; this writes to its eventfd.
        unsafe { sys::xv_kick(self.raw.as_ptr()) };
    }

    /// Polls up to `out.len()` (at most 32) completions of the CQ and returns how many of
    /// `out` it filled: the handshake QP's own are handled here (a datagram received is
    /// copied out and its slot reposted; a send's slot is freed), and only its datagrams are
    /// reported. After a handshake QP failure, once the poll's completions are read, the QP
    /// is reset and brought up again (tried again at the next poll if that fails).
    pub(crate) fn poll(&mut self, out: &mut [Wc]) -> Result<usize, String> {
        let asked = out.len().min(self.polled.len());
        // SAFETY: `polled` has room for `asked` completions.
        let got =
            unsafe { sys::xv_poll(self.raw.as_ptr(), self.polled.as_mut_ptr(), asked as i32) };
        if got < 0 {
            return Err(format!("ibv_poll_cq failed ({got})"));
        }
        let mut filled = 0;
        for c in &self.polled[..got as usize] {
            let Some(ud) = self.ud.as_mut().filter(|_| ud::is_ud(c.wr_id)) else {
                out[filled] =
                    Wc::routed(c.wr_id, c.status, c.byte_len, c.imm, c.qp_num, c.vendor_err);
                filled += 1;
                continue;
            };
            match ud.slots.completed(c.wr_id, c.status == 0, c.byte_len) {
                UdCompletion::Stale => {}
                // Dropping the AH destroys it: its send is done.
                UdCompletion::Sent(ah) => drop(ah),
                UdCompletion::Received {
                    slot,
                    payload,
                    repost,
                } => {
                    if let Some(payload) = payload {
                        let len = payload.len();
                        let wc = &mut out[filled];
                        // Every field but the bytes past the datagram's end.
                        *wc = Wc {
                            wr_id: c.wr_id,
                            status: c.status,
                            kind: KIND_UD_RECV,
                            byte_len: len as u32,
                            imm: 0,
                            qp_num: c.qp_num,
                            vendor_err: c.vendor_err,
                            data: wc.data,
                        };
                        wc.data[..len].copy_from_slice(&ud.buffer[payload]);
                        filled += 1;
                    }
                    if repost {
                        // A slot the QP refuses now comes back with its next reset.
                        ud.post_recv(self.raw, slot);
                    }
                }
            }
        }
        self.reset_handshake_qp_if_broken();
        Ok(filled)
    }

    /// Resets a failed handshake QP (its QPN stays: peers know it) and brings it up again in
    /// a new generation, every receive slot posted; what fails is tried again at the next poll.
    fn reset_handshake_qp_if_broken(&mut self) {
        let Some(ud) = self.ud.as_mut().filter(|ud| ud.slots.needs_reset()) else {
            return;
        };
        // SAFETY: the device and its UD QP are set up.
        if unsafe { sys::xv_ud_reset(self.raw.as_ptr()) } != 0 {
            return;
        }
        // In RESET the QP holds nothing more: the lost sends' AHs go.
        drop(ud.slots.reset_started());
        // SAFETY: as above; a null error buffer is allowed (nothing to report: retried).
        if unsafe { sys::xv_ud_bring_up(self.raw.as_ptr(), std::ptr::null_mut(), 0) } != 0 {
            return;
        }
        if ud.post_every_recv(self.raw) == 0 {
            ud.slots.reset_done();
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if let Some((stop, handle)) = self.notifier.take() {
            stop.store(true, Ordering::SeqCst);
            self.kick();
            let _ = handle.join();
        }
        if let Some(mut ud) = self.ud.take() {
            // SAFETY: the device is open. The QP goes first: no work request of it uses the
            // AHs or the buffer any more.
            unsafe { sys::xv_ud_destroy(self.raw.as_ptr()) };
            drop(ud.slots.take_all());
            drop(ud);
        }
        // SAFETY: opened once, closed once, after the notifier thread ended and the handshake
        // QP's AHs and registration are gone; QPs and MRs are dropped before (the Domain owns
        // them in fields declared ahead of the device).
        unsafe { sys::xv_close(self.raw.as_ptr()) };
    }
}

/// The text of a work-completion status.
pub(crate) fn status_text(status: i32) -> String {
    // SAFETY: ibv_wc_status_str returns a static string for any value.
    unsafe { CStr::from_ptr(sys::xv_wc_status_str(status)) }
        .to_string_lossy()
        .into_owned()
}

/// A registered region.
pub(crate) struct Mr {
    raw: NonNull<sys::IbvMr>,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
}

// SAFETY: as for Device.
unsafe impl Send for Mr {}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once.
        unsafe { sys::xv_dereg_mr(self.raw.as_ptr()) };
    }
}

/// An RC queue pair.
pub(crate) struct Qp {
    raw: NonNull<sys::IbvQp>,
    pub(crate) qpn: u32,
    /// Inline data the QP takes: writes up to this size are posted inline (no DMA read of
    /// the source, one fewer round trip on the PCIe bus for small writes).
    pub(crate) max_inline: u32,
    /// CQ entries this QP holds: the most work requests it may have outstanding, since each
    /// can complete (a QP in error flushes even its unsignalled ones).
    cq: CqShare,
}

// SAFETY: as for Device.
unsafe impl Send for Qp {}

impl Qp {
    /// Posts up to [`verbs_sys::CHAIN`] work requests (writes and reads) as one chain; returns
    /// how many were queued (fewer when the send queue is full).
    pub(crate) fn post_chain(&mut self, writes: &[WorkRequest]) -> Result<usize, String> {
        let mut posted = 0;
        // Writes small enough go inline (reads never: their bytes come back).
        let mut chain = [WorkRequest::default(); sys::CHAIN];
        let n = writes.len().min(sys::CHAIN);
        for (slot, w) in chain.iter_mut().zip(writes) {
            *slot = WorkRequest {
                inline_data: i32::from(w.read == 0 && w.len > 0 && w.len <= self.max_inline),
                ..*w
            };
        }
        let writes = &chain[..n];
        // SAFETY: `writes` has writes.len() entries (at most CHAIN). A non-inline request
        // reaches memory only through its lkey and rkey, which the NICs check against live
        // registrations: a range outside its key's region, or a key deregistered since, ends
        // in an error completion, never an access. An inline write is different: the CPU
        // copies its local range here, with no key checked. That range is sound because the
        // Domain made it: `RegionTable::source` checked it lies inside a live registration
        // when the request was queued, `deregister` drops every queued and chained request of
        // the region it removes before returning, and a registration's memory stays
        // allocated until it is deregistered (`Domain::register`'s contract).
        let rc = unsafe {
            sys::xv_post_writes(
                self.raw.as_ptr(),
                writes.as_ptr(),
                writes.len() as i32,
                &mut posted,
            )
        };
        match rc {
            0 => Ok(writes.len()),
            12 => Ok(posted.max(0) as usize), // ENOMEM: the send queue is full
            e => Err(format!("ibv_post_send: {}", errno_text(e))),
        }
    }

    /// Posts a send; `Ok(false)` when the send queue is full.
    ///
    /// # Safety
    /// The buffer must lie in a live registration with `lkey` until its completion.
    unsafe fn post_send(
        &mut self,
        wr_id: u64,
        addr: u64,
        len: u32,
        lkey: u32,
    ) -> Result<bool, String> {
        // SAFETY: per this function's contract.
        match unsafe { sys::xv_post_send(self.raw.as_ptr(), wr_id, addr, len, lkey) } {
            0 => Ok(true),
            12 => Ok(false),
            e => Err(format!("ibv_post_send: {}", errno_text(e))),
        }
    }
}

impl Qp {
    /// CQ entries this QP holds: the most work requests it may have outstanding, since each
    /// can complete (a QP in error flushes even its unsignalled ones).
    pub(crate) fn reserved(&self) -> usize {
        self.cq.entries
    }

    /// Reserves `more` CQ entries (the CQ grows if it must); false when the device's CQ
    /// cannot hold them.
    pub(crate) fn reserve(&mut self, more: usize) -> bool {
        if i32::try_from(more).is_err() {
            return false;
        }
        let ok = reserve_cq(self.cq.device, &self.cq.budget, more) == 0;
        if ok {
            self.cq.entries += more;
        }
        ok
    }

    /// Moves the QP to the error state: nothing more it holds executes, and every outstanding
    /// work request completes with a flush error.
    pub(crate) fn move_to_error(&mut self) -> Result<(), String> {
        // SAFETY: a live QP of this process.
        match unsafe { sys::xv_qp_to_error(self.raw.as_ptr()) } {
            0 => Ok(()),
            e => Err(format!("ibv_modify_qp(ERR): {}", errno_text(e))),
        }
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once. Its CQ share goes after it (a field).
        unsafe { sys::xv_destroy_qp(self.raw.as_ptr()) };
    }
}

impl Drop for CqShare {
    fn drop(&mut self) {
        budget(&self.budget).release(self.entries as i64);
    }
}

/// Message buffers the Domain owns and registers itself (its receive pool and its send pool):
/// each stays at its address and registered until the pool drops, which deregisters before
/// it frees (see `ReceivePool`), so registering and posting them asks nothing of a caller.
#[derive(Default)]
pub(crate) struct MessageBuffers(ReceivePool<Mr>);

impl MessageBuffers {
    /// A free buffer of exactly `len` bytes, or a new one registered on `device`.
    pub(crate) fn take(&mut self, device: &mut Device, len: usize) -> Result<usize, String> {
        self.0.take(len, |data| {
            // SAFETY: the pool keeps `data` at this address until it drops, and drops this
            // registration before the buffer.
            unsafe {
                device.register(
                    data.as_ptr() as u64,
                    data.len(),
                    RemoteBits::of(false, false),
                )
            }
            .map_err(|e| e.message)
        })
    }

    /// Posts buffer `index` on `device`'s message SRQ as the receive `wr_id`.
    pub(crate) fn post_recv(
        &mut self,
        device: &mut Device,
        index: usize,
        wr_id: u64,
    ) -> Result<(), String> {
        let (addr, len, mr) = self.0.get(index);
        // SAFETY: the buffer lies in its registration, and both live until the pool drops.
        unsafe { device.post_srq_recv(true, wr_id, addr as u64, len as u32, mr.lkey) }
    }

    /// Copies `bytes` into buffer `index` and posts them on `qp` as the send `wr_id`;
    /// `Ok(false)` when the send queue is full.
    pub(crate) fn post_send(
        &mut self,
        qp: &mut Qp,
        index: usize,
        wr_id: u64,
        bytes: &[u8],
    ) -> Result<bool, String> {
        if !self.0.fill(index, bytes) {
            return Err(format!(
                "a message of {} bytes does not fit its buffer",
                bytes.len()
            ));
        }
        let (addr, _, mr) = self.0.get(index);
        // SAFETY: the message's bytes lie in the buffer's registration, and both live until
        // the pool drops.
        unsafe { qp.post_send(wr_id, addr as u64, bytes.len() as u32, mr.lkey) }
    }

    /// A copy of the first `len` bytes of buffer `index`, which is then free for reuse.
    pub(crate) fn take_message(&mut self, index: usize, len: usize) -> Option<Vec<u8>> {
        self.0.take_message(index, len)
    }

    /// Puts buffer `index` back unused.
    pub(crate) fn release(&mut self, index: usize) {
        self.0.release(index)
    }
}
