//! # backend-efa (not built yet)
//!
//! The libfabric RDM backend for AWS EFA (and libfabric's `shm` / `tcp;ofi_rxm` providers in
//! tests). It will implement [`engine_core::domain::Domain`] over `fi_writemsg` with remote CQ
//! data. Until it lands, configs naming `backend = "efa"` get a typed "no backend named efa"
//! error.

/// What this crate will provide, for `xfer info`.
pub const STATUS: &str = "planned: libfabric RDM transport (see the backend-efa issue)";
