//! The backend's diagnostic lines, written straight to stderr: they come from the device's
//! threads (the notifier) and from inside the Domain, where the host's `tracing` subscriber
//! may not reach a plugin. A module of its own so `domain` and `notify` do not import each
//! other.

/// Writes one diagnostic line, prefixed with the backend's name.
pub(crate) fn line(message: &str) {
    eprintln!("xfer backend-verbs: {message}");
}
