//! # backend-verbs (not built yet)
//!
//! The libibverbs RC backend for ConnectX / RoCE NICs. It will implement
//! [`engine_core::domain::Domain`] over RC QPs (one pair per peer, connected lazily through a
//! UD handshake) and be tested on soft-RoCE inside a qemu guest (`cargo xtask rxe`). Until it
//! lands, configs naming `backend = "verbs"` get a typed "no backend named verbs" error.

/// What this crate will provide, for `xfer info`.
pub const STATUS: &str = "planned: libibverbs RC transport (see the backend-verbs issue)";
