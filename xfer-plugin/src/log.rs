//! A plugin's log lines, in the host's `tracing`.
//!
//! A `cdylib` carries its own copy of `tracing`, whose global dispatcher the host never sees:
//! without a bridge, everything a plugin logs is lost. ABI 3 lets the engine hand a plugin a
//! [`LogFn`] right after loading it. A Rust plugin built with
//! [`export_plugin!`](crate::export_plugin) installs [`Forward`] as its global subscriber, so
//! its `tracing::warn!` and friends arrive in the host as events of target `xfer::plugin`
//! (field `plugin_target` says where in the plugin). A C plugin calls the function directly.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU32, Ordering};

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

use crate::raw::RawBytes;

/// `level` values of [`LogFn`]: error.
pub const LOG_ERROR: u32 = 1;
/// Warning.
pub const LOG_WARN: u32 = 2;
/// Information.
pub const LOG_INFO: u32 = 3;
/// Debugging.
pub const LOG_DEBUG: u32 = 4;
/// Tracing.
pub const LOG_TRACE: u32 = 5;

/// The host's log function: `level` (1 = error … 5 = trace), where in the plugin it was
/// logged, and the text. Callable from any thread, at any time after it was handed over.
pub type LogFn = unsafe extern "C" fn(level: u32, target: RawBytes, message: RawBytes);

/// The [`LogFn`] level of a `tracing` level.
pub fn level_number(level: &Level) -> u32 {
    match *level {
        Level::ERROR => LOG_ERROR,
        Level::WARN => LOG_WARN,
        Level::INFO => LOG_INFO,
        Level::DEBUG => LOG_DEBUG,
        Level::TRACE => LOG_TRACE,
    }
}

/// The `tracing` filter that lets through levels up to `max` (a [`LogFn`] level; 0 = off).
pub fn level_filter(max: u32) -> LevelFilter {
    match max {
        0 => LevelFilter::OFF,
        LOG_ERROR => LevelFilter::ERROR,
        LOG_WARN => LevelFilter::WARN,
        LOG_INFO => LevelFilter::INFO,
        LOG_DEBUG => LevelFilter::DEBUG,
        _ => LevelFilter::TRACE,
    }
}

/// The [`LogFn`] level of a `tracing` filter: the most verbose level it lets through (0: off).
/// The inverse of [`level_filter`].
pub fn filter_number(filter: LevelFilter) -> u32 {
    match filter {
        LevelFilter::OFF => 0,
        LevelFilter::ERROR => LOG_ERROR,
        LevelFilter::WARN => LOG_WARN,
        LevelFilter::INFO => LOG_INFO,
        LevelFilter::DEBUG => LOG_DEBUG,
        _ => LOG_TRACE,
    }
}

/// A subscriber that hands every event to the host's [`LogFn`]: the message first, then the
/// other fields as ` name=value`. Spans are not forwarded (their fields would need the host's
/// span ids); events inside them still are.
#[derive(Debug)]
pub struct Forward {
    log: LogFn,
    /// A [`LogFn`] level; the host may raise or lower it later ([`Forward::set_max_level`]).
    max: &'static AtomicU32,
}

impl Forward {
    /// Forwards events up to the level in `max` (a [`LogFn`] level) to `log`.
    pub fn new(log: LogFn, max: &'static AtomicU32) -> Self {
        Self { log, max }
    }

    /// Changes the level `max` lets through, for every `Forward` reading it.
    pub fn set_max_level(max: &AtomicU32, level: u32) {
        max.store(level, Ordering::Relaxed);
        // Call sites cache whether they are enabled; make them ask again.
        tracing::callsite::rebuild_interest_cache();
    }

    fn max(&self) -> LevelFilter {
        level_filter(self.max.load(Ordering::Relaxed))
    }
}

/// Renders an event's fields: its message, then the others as ` name=value`.
#[derive(Default)]
struct Text {
    message: String,
    fields: String,
}

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={value}", field.name());
        }
    }
}

impl Subscriber for Forward {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        *metadata.level() <= self.max()
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(self.max())
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut text = Text::default();
        event.record(&mut text);
        text.message.push_str(&text.fields);
        let meta = event.metadata();
        // SAFETY: the host's LogFn is callable from any thread for the life of the process
        // (the ABI's contract); both byte strings live for the call.
        unsafe {
            (self.log)(
                level_number(meta.level()),
                RawBytes::new(meta.target().as_bytes()),
                RawBytes::new(text.message.as_bytes()),
            )
        };
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    static SEEN: Mutex<Vec<(u32, String, String)>> = Mutex::new(Vec::new());

    unsafe extern "C" fn capture(level: u32, target: RawBytes, message: RawBytes) {
        // SAFETY: Forward passes live byte strings for the call.
        let (t, m) = unsafe { (target.as_slice(), message.as_slice()) };
        SEEN.lock().unwrap().push((
            level,
            String::from_utf8_lossy(t).into_owned(),
            String::from_utf8_lossy(m).into_owned(),
        ));
    }

    #[test]
    fn filter_numbers_and_level_filters_are_inverse() {
        for n in 0..=LOG_TRACE {
            assert_eq!(filter_number(level_filter(n)), n);
        }
    }

    #[test]
    fn events_reach_the_log_function_with_their_fields_and_levels_filtered() {
        static MAX: AtomicU32 = AtomicU32::new(LOG_INFO);
        let forward = Forward::new(capture, &MAX);
        tracing::subscriber::with_default(forward, || {
            tracing::warn!(peer = 7, "connection lost");
            tracing::debug!("not forwarded: above the host's level");
        });
        let seen = SEEN.lock().unwrap().clone();
        assert_eq!(seen.len(), 1, "{seen:?}");
        let (level, target, message) = &seen[0];
        assert_eq!(*level, LOG_WARN);
        assert!(target.contains("log"), "{target}");
        assert_eq!(message, "connection lost peer=7");
    }
}
