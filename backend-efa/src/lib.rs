//! # backend-efa: libfabric RDM endpoints
//!
//! One Domain per libfabric domain (an EFA device in production). Writes are `fi_writemsg`
//! with `FI_REMOTE_CQ_DATA` carrying the immediate; the receiver's CQ reports it and the
//! engine's ImmCounter counts it. Messages use `fi_send` / `fi_recv`. The provider comes from
//! the config (`[backends.efa] provider`), so the same code runs on EFA and, in tests, on
//! libfabric's `shm` and `tcp;ofi_rxm` providers. Whatever `mr_mode` bits the provider asks
//! for (`FI_MR_LOCAL`, `VIRT_ADDR`, `PROV_KEY`, `ALLOCATED`, `ENDPOINT`) are honoured.
//!
//! NIC names in `[[groups]].nics` are libfabric domain names (`fi_info -p efa`), or `auto` for
//! the provider's first domain; a `#suffix` opens another endpoint on the same domain (tests
//! use `["auto", "auto#1"]` for a two-"NIC" group).

mod domain;
mod ffi;
mod gather;
mod options;
pub mod raw;
mod sender;
mod shm_lifetime;

pub use domain::EfaDomain;
pub use options::EfaOptions;

use xfer_plugin::domain::{Domain, DomainConfig, DomainError};
use xfer_plugin::registry::BackendRegistration;

/// The name configs select this backend by.
pub const NAME: &str = "efa";

/// Opens one libfabric domain.
pub fn open(config: &DomainConfig<'_>) -> Result<Box<dyn Domain>, DomainError> {
    Ok(Box::new(EfaDomain::open(config)?))
}

/// The providers and domains libfabric offers with RDM endpoints and RMA, as
/// `(provider, domain)` pairs.
pub fn providers() -> Result<Vec<(String, String)>, String> {
    ffi::list(None)
}

/// What an endpoint of `options.provider` (first domain) was granted, for `xfer doctor`:
/// opens one and closes it.
pub fn probe(options: &EfaOptions) -> Result<xfer_topology::doctor::EndpointFacts, String> {
    let endpoint = ffi::Endpoint::open(
        &options.provider,
        options.fabric.as_deref(),
        None,
        options.shared_memory_choice(),
    )
    .map_err(|e| e.message)?;
    let a = endpoint.attr;
    let flag = |v: i32| (v >= 0).then_some(v == 1);
    Ok(xfer_topology::doctor::EndpointFacts {
        hmem: a.hmem != 0,
        cuda_api_forbidden: a.cuda_api_forbidden != 0,
        shared_memory: flag(a.shared_memory),
        shared_memory_wanted: options.shared_memory_choice(),
        emulated_write: flag(a.emulated_write),
    })
}

/// The libfabric API version the backend requests, as `major.minor`: the newest that both
/// the headers it was built against and the library loaded now offer.
pub fn api_version() -> String {
    let v = ffi::api_version();
    format!("{}.{}", v >> 16, v & 0xffff)
}

xfer_plugin::inventory::submit! {
    BackendRegistration {
        name: NAME,
        open,
        check_options: |text| options::EfaOptions::parse(text).map(|_| ()).map_err(|e| e.message),
    }
}

xfer_plugin::export_plugin!(
    "efa",
    open,
    check = |text| options::EfaOptions::parse(text)
        .map(|_| ())
        .map_err(|e| e.message)
);

/// Makes sure this crate is linked, so its static registration is seen.
#[inline(never)]
pub fn link() {}

#[cfg(test)]
mod tests {
    #[test]
    fn the_requested_api_is_at_least_the_one_the_shim_needs() {
        let v = super::api_version();
        let (major, minor) = v.split_once('.').unwrap();
        let (major, minor): (u32, u32) = (major.parse().unwrap(), minor.parse().unwrap());
        assert!((major, minor) >= (1, 17), "{v}");
    }
}
