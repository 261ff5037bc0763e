//! The receiver's side of notifications, as pure data: the bounded queue of arrived
//! notifications, the optional list of peers allowed to notify, and the count of what was
//! dropped. The worker offers what arrives; `TransferEngine::poll_notifications` and
//! `wait_notification` take from it.

use std::collections::{HashMap, HashSet, VecDeque};

use crate::wire::NetAddr;

/// A notification: the id a peer attached to a transfer (see
/// [`TransferEngine::notify_when_done`](crate::TransferEngine::notify_when_done)), the
/// peer's main address as the message claims it, and the sender as the transport proved it.
/// Where the transport proves a sender (verbs, the mock) a notification whose claim differs
/// is dropped as forged before it is queued, so `from` is then the proven sender; where it
/// cannot (EFA/libfabric today, plugins that do not say) `sender` is `None` and `from` is
/// only the sender's word (see docs/security.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// The id, at most [`NOTIFICATION_ID_MAX`](crate::wire::NOTIFICATION_ID_MAX) bytes.
    pub id: Vec<u8>,
    /// The sender's main address, as the message claims it.
    pub from: NetAddr,
    /// The sender as the transport proved it (the sending engine's main address), or
    /// `None` when the backend cannot tell.
    pub sender: Option<NetAddr>,
}

/// Why an arrived notification was not queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Its sender is not among the peers allowed to notify.
    Sender,
    /// The queue holds `worker.max_notifications` already.
    Full,
    /// It claims a sender other than the one the transport proved.
    Forged,
    /// Its sender has `worker.max_notifications_per_peer` queued already.
    Share,
}

/// Notifications waiting to be taken, bounded by `worker.max_notifications`.
#[derive(Debug)]
pub(crate) struct Inbox {
    queue: VecDeque<Notification>,
    allowed: Option<HashSet<NetAddr>>,
    max: usize,
    /// Most queued from one sender (`usize::MAX` until [`share`](Self::share) sets it).
    per_sender: usize,
    /// How many each sender has queued (its proven address, else its claim).
    held: HashMap<NetAddr, usize>,
    dropped: u64,
}

/// Whose share of the queue a notification takes: the proven sender where there is one.
fn holder(note: &Notification) -> &NetAddr {
    note.sender.as_ref().unwrap_or(&note.from)
}

impl Inbox {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            queue: VecDeque::new(),
            allowed: None,
            max,
            per_sender: usize::MAX,
            held: HashMap::new(),
            dropped: 0,
        }
    }

    /// At most `per_sender` notifications of one sender are queued at once, so one peer
    /// cannot fill the queue for all (issue 56).
    pub(crate) fn share(&mut self, per_sender: usize) {
        self.per_sender = per_sender;
    }

    fn taken(&mut self, note: &Notification) {
        if let Some(n) = self.held.get_mut(holder(note)) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(holder(note));
            }
        }
    }

    /// Queues `note`, or drops and counts it (a forged claim, a refused sender, or a full
    /// queue: the newest arrival is the one dropped, so what was queued keeps its order).
    /// Once a forged claim is refused, `from` is the proven sender wherever there is one, so
    /// the allowed peers are checked against it.
    pub(crate) fn offer(&mut self, note: Notification) -> Result<(), Refused> {
        let refused = if note.sender.as_ref().is_some_and(|s| *s != note.from) {
            Refused::Forged
        } else if self
            .allowed
            .as_ref()
            .is_some_and(|a| !a.contains(&note.from))
        {
            Refused::Sender
        } else if self.queue.len() >= self.max {
            Refused::Full
        } else if self.held.get(holder(&note)).copied().unwrap_or(0) >= self.per_sender {
            Refused::Share
        } else {
            *self.held.entry(holder(&note).clone()).or_insert(0) += 1;
            self.queue.push_back(note);
            return Ok(());
        };
        self.dropped += 1;
        Err(refused)
    }

    /// Only notifications from `peers` are queued from now on (`None`: from anyone).
    /// Notifications already queued stay.
    pub(crate) fn restrict(&mut self, peers: Option<Vec<NetAddr>>) {
        self.allowed = peers.map(|p| p.into_iter().collect());
    }

    pub(crate) fn pop(&mut self) -> Option<Notification> {
        let note = self.queue.pop_front()?;
        self.taken(&note);
        Some(note)
    }

    pub(crate) fn take_all(&mut self) -> Vec<Notification> {
        self.held.clear();
        self.queue.drain(..).collect()
    }

    /// Notifications dropped so far (forged claims, refused senders, a sender past its share
    /// and a full queue).
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(from: u8, id: u8) -> Notification {
        Notification {
            id: vec![id],
            from: NetAddr::new(&[from]).unwrap(),
            sender: None,
        }
    }

    fn proven(from: u8, sender: u8, id: u8) -> Notification {
        Notification {
            sender: Some(NetAddr::new(&[sender]).unwrap()),
            ..note(from, id)
        }
    }

    /// Issue 56: one sender holds at most its share of the queue; others still get in, and
    /// its share comes back as its notifications are taken.
    #[test]
    fn one_sender_holds_at_most_its_share_of_the_queue() {
        let mut inbox = Inbox::new(8);
        inbox.share(2);
        assert_eq!(inbox.offer(proven(1, 1, 0)), Ok(()));
        assert_eq!(inbox.offer(proven(1, 1, 1)), Ok(()));
        assert_eq!(inbox.offer(proven(1, 1, 2)), Err(Refused::Share));
        assert_eq!(inbox.offer(proven(2, 2, 3)), Ok(()));
        assert_eq!(inbox.pop(), Some(proven(1, 1, 0)));
        assert_eq!(inbox.offer(proven(1, 1, 4)), Ok(()));
        assert_eq!(inbox.dropped(), 1);
        assert_eq!(inbox.take_all().len(), 3);
        assert_eq!(inbox.offer(proven(1, 1, 5)), Ok(()));
        assert_eq!(inbox.offer(proven(1, 1, 6)), Ok(()));
    }

    /// A claim the transport contradicts is dropped and counted, even from an allowed peer
    /// and into an open inbox; a claim it confirms is queued like an unproven one.
    #[test]
    fn a_notification_claiming_another_sender_than_the_proven_one_is_dropped() {
        let mut inbox = Inbox::new(8);
        assert_eq!(inbox.offer(proven(2, 1, 0)), Err(Refused::Forged));
        inbox.restrict(Some(vec![NetAddr::new(&[2]).unwrap()]));
        assert_eq!(inbox.offer(proven(2, 1, 1)), Err(Refused::Forged));
        assert_eq!(inbox.offer(proven(1, 1, 2)), Err(Refused::Sender));
        assert_eq!(inbox.offer(proven(2, 2, 3)), Ok(()));
        assert_eq!(inbox.dropped(), 3);
        assert_eq!(inbox.take_all(), vec![proven(2, 2, 3)]);
    }

    #[test]
    fn a_full_inbox_drops_the_newest_and_counts_it() {
        let mut inbox = Inbox::new(2);
        assert_eq!(inbox.offer(note(1, 0)), Ok(()));
        assert_eq!(inbox.offer(note(1, 1)), Ok(()));
        assert_eq!(inbox.offer(note(1, 2)), Err(Refused::Full));
        assert_eq!(inbox.dropped(), 1);
        assert_eq!(inbox.pop(), Some(note(1, 0)));
        assert_eq!(inbox.offer(note(1, 3)), Ok(()));
        assert_eq!(inbox.take_all(), vec![note(1, 1), note(1, 3)]);
        assert_eq!(inbox.pop(), None);
    }

    #[test]
    fn a_restricted_inbox_refuses_other_senders_until_lifted() {
        let mut inbox = Inbox::new(8);
        inbox.restrict(Some(vec![NetAddr::new(&[2]).unwrap()]));
        assert_eq!(inbox.offer(note(1, 0)), Err(Refused::Sender));
        assert_eq!(inbox.offer(note(2, 1)), Ok(()));
        inbox.restrict(None);
        assert_eq!(inbox.offer(note(1, 2)), Ok(()));
        assert_eq!(inbox.dropped(), 1);
        assert_eq!(inbox.take_all(), vec![note(2, 1), note(1, 2)]);
    }
}
