//! Messages to a peer's main address, the receive pool, and notifications (a request id a
//! peer sees after the data of its transfer).

use super::*;

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
            data: data.to_vec(),
            on_done: on_done.into(),
        })
    }

    /// Posts `count` receive buffers of `len` bytes; `handler` is called (on the callback
    /// thread) with each message, after which its buffer is posted again. One pool per engine.
    pub fn submit_recvs(
        &self,
        len: usize,
        count: usize,
        handler: impl Fn(&[u8]) + Send + Sync + 'static,
    ) -> Result<()> {
        if len == 0 || count == 0 {
            return Err(Error::InvalidArgument(
                "receive buffers need a non-zero length and count".into(),
            ));
        }
        if self
            .shared
            .recv_handler
            .set((len, Arc::new(handler)))
            .is_err()
        {
            return Err(Error::InvalidArgument(
                "this engine already has a receive pool".into(),
            ));
        }
        // Nothing is registered by the caller here, so a plain timeout is safe.
        self.control(|reply| Command::PostRecvs {
            buf_len: len,
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
    /// [`listen_notifications`](Self::listen_notifications). See ARCHITECTURE, "Notifications".
    pub fn notify_when_done(
        &self,
        peer: &NetAddr,
        id: &[u8],
        on_done: impl Into<OnDone>,
    ) -> Result<OnDone> {
        let message = crate::wire::encode_notification(id);
        let max = self.shared.config.worker.max_message;
        if message.len() > max {
            return Err(Error::InvalidArgument(format!(
                "a notification id of {} bytes does not fit a message of worker.max_message ({max}) bytes with its {}-byte tag",
                id.len(),
                crate::wire::NOTIFY_TAG.len()
            )));
        }
        let (peer, on_done) = (peer.clone(), on_done.into());
        let shared = Arc::downgrade(&self.shared);
        // This runs on the callback thread, so `on_done` is finished right here.
        Ok(OnDone::callback(move |result| {
            if let Err(e) = result {
                return on_done.complete_inline(Err(e));
            }
            let Some(s) = shared.upgrade() else {
                return on_done.complete_inline(Err(Error::Shutdown));
            };
            // The send's own completion finishes `on_done`; if it cannot even be queued,
            // `on_done` gets that error (and is never lost).
            let slot = Arc::new(Mutex::new(Some(on_done)));
            let take = |slot: &Mutex<Option<OnDone>>| {
                slot.lock().unwrap_or_else(|p| p.into_inner()).take()
            };
            let inner = Arc::clone(&slot);
            let queued = s.submit_counted(Command::Send {
                peer,
                data: message,
                on_done: OnDone::callback(move |r| {
                    if let Some(d) = take(&inner) {
                        d.complete_inline(r);
                    }
                }),
            });
            if let Err(e) = queued {
                if let Some(d) = take(&slot) {
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
        let len = (crate::wire::NOTIFY_TAG.len() + 256)
            .min(self.shared.config.worker.max_message.max(64));
        match self.submit_recvs(len, count, |m: &[u8]| {
            tracing::warn!("a message of {} bytes arrived at an engine that only listens for notifications; dropped", m.len());
        }) {
            // Raced with another listener or submit_recvs: a pool exists, which is enough.
            Err(Error::InvalidArgument(m)) if m.contains("already has a receive pool") => Ok(()),
            other => other,
        }
    }

    /// Takes every notification that arrived so far (ids, in arrival order).
    pub fn poll_notifications(&self) -> Vec<Vec<u8>> {
        self.shared
            .notifications
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect()
    }

    /// Takes the next notification, waiting up to `timeout` for one (`Err(Timeout)`).
    pub fn wait_notification(&self, timeout: Duration) -> Result<Vec<u8>> {
        // A timeout too large for the clock waits without end.
        let deadline = Instant::now().checked_add(timeout);
        let mut q = self
            .shared
            .notifications
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(id) = q.pop_front() {
                return Ok(id);
            }
            if self.shared.is_closed() {
                return Err(Error::Shutdown);
            }
            let left = deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            });
            if left.is_zero() {
                return Err(Error::Timeout(timeout));
            }
            q = self
                .shared
                .notified
                .wait_timeout(q, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}
