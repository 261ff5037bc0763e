//! The conformance suite on libfabric's tcp;ofi_rxm provider, on loopback.

mod common;

struct Tcp;

impl engine_core::conformance::Harness for Tcp {
    fn config(&self, nics: usize) -> engine_core::Config {
        common::config("tcp;ofi_rxm", nics)
    }

    fn max_nics(&self) -> usize {
        2
    }

    // tcp;ofi_rxm refuses a bad key at the target and cancels the operation (FI_ECANCELED),
    // so the sender sees an error but cannot tell it was the key.
    fn typed_remote_access(&self) -> bool {
        false
    }
}

engine_core::conformance_suite!(Tcp);
