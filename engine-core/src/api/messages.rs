//! Messages to a peer's main address, the receive pool, and notifications (a request id a
//! peer sees after the data of its transfer).

use super::*;
use crate::notifications::Notification;
use crate::runtime::clock::Stamp;
use crate::wire;

impl TransferEngine {
    /// Sends a message to a peer's main address; `data` is copied, the caller may reuse it.
    pub fn submit_send(
        &self,
        peer: &NetAddr,
        data: &[u8],
        on_done: impl Into<OnDone>,
    ) -> Result<()> {
        let max = self.shared.config.worker.max_message;
        if data.len() > max {
            return Err(Error::InvalidArgument(format!(
                "message of {} bytes is larger than worker.max_message ({max})",
                data.len()
            )));
        }
        self.shared.submit_counted(Command::Send {
            peer: peer.clone(),
            data: wire::encode_user_message(data),
            on_done: on_done.into(),
            submitted: Stamp::now(),
        })
    }

    /// Posts `count` receive buffers for messages of up to `len` bytes; `handler` is called
    /// (on the callback thread) with each message, after which its buffer is posted again.
    /// One pool per engine; notifications share it, so `len` is raised to at least
    /// [`wire::NOTIFICATION_WIRE_MAX`] − 1 (321) bytes: the longest notification always fits.
    /// A message longer than the buffers fails at its sender (truncation is the transport's
    /// error), and the receiver keeps its buffer. To learn who sent each message, use
    /// [`submit_recvs_with_sender`](Self::submit_recvs_with_sender).
    pub fn submit_recvs(
        &self,
        len: usize,
        count: usize,
        handler: impl Fn(&[u8]) + Send + Sync + 'static,
    ) -> Result<()> {
        self.submit_recvs_with_sender(len, count, move |data: &[u8], _: Option<&NetAddr>| {
            handler(data)
        })
    }

    /// [`submit_recvs`](Self::submit_recvs) whose `handler` is also told who sent each
    /// message, as the transport proved it: the sending engine's main address (what its
    /// [`main_address`](Self::main_address) returns), never a claim read from the message.
    /// `None` where the backend cannot tell (EFA/libfabric today; plugins that do not say):
    /// see docs/security.md, "Who sent a message".
    pub fn submit_recvs_with_sender(
        &self,
        len: usize,
        count: usize,
        handler: impl Fn(&[u8], Option<&NetAddr>) + Send + Sync + 'static,
    ) -> Result<()> {
        if len == 0 || count == 0 {
            return Err(Error::InvalidArgument(
                "receive buffers need a non-zero length and count".into(),
            ));
        }
        let buf_len = wire::receive_buffer_len(len);
        let payload_max = buf_len - wire::MESSAGE_HEADER_LEN;
        if self
            .shared
            .recv_handler
            .set((payload_max, Arc::new(handler)))
            .is_err()
        {
            return Err(Error::InvalidArgument(
                "this engine already has a receive pool".into(),
            ));
        }
        // Nothing is registered by the caller here, so a plain timeout is safe.
        self.control("submit_recvs", |reply| Command::PostRecvs {
            buf_len,
            count,
            reply: Some(reply),
        })
    }

    /// An `OnDone` for a write (or paged write, scatter to one peer, read) that, once the
    /// transfer succeeded, sends the notification `id` to `peer` and then finishes `on_done`
    /// with the send's outcome; a failed transfer finishes `on_done` with its error and
    /// sends nothing. Pass it to any `submit_*`:
    ///
    /// ```ignore
    /// let done = engine.notify_when_done(dst.owner(), b"req-42", flag)?;
    /// engine.submit_paged_writes(page_len, None, (src, &sp), (&dst, &dp), done)?;
    /// ```
    ///
    /// **The peer sees the notification only after every byte of the transfer is in its
    /// memory**: the send is posted only after the transfer's completion, and a write
    /// completes at the sender only once the target's NIC has placed it (an RC ack on verbs;
    /// delivery-complete on libfabric; the mock completes after copying). The peer takes
    /// notifications with [`poll_notifications`](Self::poll_notifications) or
    /// [`wait_notification`](Self::wait_notification), after
    /// [`listen_notifications`](Self::listen_notifications): a peer that has not called it
    /// (nor [`submit_recvs`](Self::submit_recvs)) takes no notification, and `on_done`
    /// finishes with [`Error::NotListening`] at the transfer deadline, after the data
    /// landed. See ARCHITECTURE, "Notifications".
    pub fn notify_when_done(
        &self,
        peer: &NetAddr,
        id: &[u8],
        on_done: impl Into<OnDone>,
    ) -> Result<OnDone> {
        if id.len() > wire::NOTIFICATION_ID_MAX {
            return Err(Error::InvalidArgument(format!(
                "a notification id of {} bytes is longer than the {} bytes every engine accepts",
                id.len(),
                wire::NOTIFICATION_ID_MAX
            )));
        }
        let message = wire::encode_notification(&self.main_address(), id);
        // The send takes its slot of worker.max_outstanding now: once the data landed, the
        // notification is never refused as Busy. Dropping the OnDone unused gives it back.
        let slot = self.shared.reserve()?;
        let (peer, on_done) = (peer.clone(), on_done.into());
        // This runs on the callback thread, so `on_done` is finished right here.
        Ok(OnDone::callback(move |result| {
            if let Err(e) = result {
                return on_done.complete_inline(Err(e));
            }
            // The send's own completion finishes `on_done`; if it cannot even be queued
            // (the engine shut down), `on_done` gets that error and is never lost.
            let waiting = Arc::new(Mutex::new(Some(on_done)));
            let take =
                |w: &Mutex<Option<OnDone>>| w.lock().unwrap_or_else(|p| p.into_inner()).take();
            let inner = Arc::clone(&waiting);
            let to = peer.clone();
            let queued = slot.submit(Command::Send {
                peer,
                data: message,
                submitted: Stamp::now(),
                on_done: OnDone::callback(move |r| {
                    // A send to a live peer that times out found no receive buffer posted:
                    // say that, not that the transfer (whose data landed) timed out.
                    let r = r.map_err(|e| match e {
                        Error::Timeout(waited) => Error::NotListening { peer: to, waited },
                        e => e,
                    });
                    if let Some(d) = take(&inner) {
                        d.complete_inline(r);
                    }
                }),
            });
            if let Err(e) = queued {
                if let Some(d) = take(&waiting) {
                    d.complete_inline(Err(e));
                }
            }
        }))
    }

    /// Makes sure notifications can arrive: posts `count` receive buffers for them when the
    /// engine has no receive pool yet (messages that are not notifications are then logged
    /// and dropped); with a pool from [`submit_recvs`](Self::submit_recvs), notifications
    /// share it and this does nothing.
    pub fn listen_notifications(&self, count: usize) -> Result<()> {
        if self.shared.recv_handler.get().is_some() {
            return Ok(());
        }
        match self.submit_recvs(1, count, |m: &[u8]| {
            tracing::warn!("a message of {} bytes arrived at an engine that only listens for notifications; dropped", m.len());
        }) {
            // Raced with another listener or submit_recvs: a pool exists, which is enough.
            Err(Error::InvalidArgument(m)) if m.contains("already has a receive pool") => Ok(()),
            other => other,
        }
    }

    /// Only notifications from `peers` (main addresses) are queued from now on; others are
    /// dropped and counted in [`notifications_dropped`](Self::notifications_dropped). `None`
    /// accepts every peer again. What is already queued stays. Where the transport proves
    /// the sender (verbs, the mock) that is the address checked (a notification claiming
    /// another is dropped as forged); elsewhere it is the sender's own claim: see
    /// docs/security.md for what each transport proves.
    pub fn restrict_notifications(&self, peers: Option<Vec<NetAddr>>) {
        self.inbox().restrict(peers);
    }

    /// Notifications dropped so far: claiming a sender other than the one the transport
    /// proved, from senders [`restrict_notifications`](Self::restrict_notifications)
    /// refused, or past `worker.max_notifications` queued (malformed messages are logged).
    pub fn notifications_dropped(&self) -> u64 {
        self.inbox().dropped()
    }

    /// Takes every notification that arrived so far, in arrival order.
    pub fn poll_notifications(&self) -> Vec<Notification> {
        self.inbox().take_all()
    }

    /// Takes the next notification, waiting up to `timeout` for one (`Err(Timeout)`).
    pub fn wait_notification(&self, timeout: Duration) -> Result<Notification> {
        // A timeout too large for the clock waits without end.
        let deadline = Instant::now().checked_add(timeout);
        let mut inbox = self.inbox();
        loop {
            if let Some(note) = inbox.pop() {
                return Ok(note);
            }
            if self.shared.is_closed() {
                return Err(Error::Shutdown);
            }
            // Only the worker fills the inbox.
            self.shared.check_not_on_worker("wait_notification")?;
            let left = deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            });
            if left.is_zero() {
                return Err(Error::Timeout(timeout));
            }
            inbox = self
                .shared
                .notified
                .wait_timeout(inbox, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn inbox(&self) -> std::sync::MutexGuard<'_, crate::notifications::Inbox> {
        // Every Inbox method finishes its bookkeeping before returning: poisoning is ignored.
        self.shared
            .notifications
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }
}
