//! The conformance suite on libfabric's shm provider.

mod common;

struct Shm;

impl xfer_conformance::Harness for Shm {
    fn config(&self, nics: usize) -> engine_core::Config {
        common::config("shm", nics)
    }

    fn max_nics(&self) -> usize {
        2
    }

    /// The source address libfabric reports (`FI_SOURCE`), checked against each message's
    /// claim (see src/sender.rs).
    fn names_senders(&self) -> bool {
        true
    }

    fn skip(&self, check: &str) -> Option<&'static str> {
        // Set to see whether a newer libfabric lifts these limits (checked on 1.17 and 2.1:
        // neither does; 2.1's shm segfaults on a forged key too). A closed peer in this
        // process crashed shm too: the backend keeps such endpoints (src/shm_lifetime.rs).
        if std::env::var_os("XFER_SHM_NO_SKIPS").is_some() {
            return None;
        }
        match check {
            // libfabric's shm (1.17 and 2.1) copies with process_vm_writev at the virtual address it is
            // given and does not check the key; a real NIC (and tcp;ofi_rxm) refuses.
            "remote_access_error" | "read_of_an_unreadable_region_by_a_forged_descriptor" => {
                Some("shm does not validate remote keys or access")
            }
            _ => None,
        }
    }
}

xfer_conformance::conformance_suite!(Shm);
