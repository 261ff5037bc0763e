//! The conformance suite on libfabric's tcp;ofi_rxm provider, on loopback.

mod common;

struct Tcp;

impl xfer_conformance::Harness for Tcp {
    fn config(&self, nics: usize) -> engine_core::Config {
        common::config("tcp;ofi_rxm", nics)
    }

    fn max_nics(&self) -> usize {
        2
    }

    /// The source address libfabric reports (`FI_SOURCE`), checked against each message's
    /// claim (see src/sender.rs).
    fn names_senders(&self) -> bool {
        true
    }

    // tcp;ofi_rxm refuses a bad key at the target and cancels the operation (FI_ECANCELED),
    // so the sender sees an error but cannot tell it was the key.
    fn typed_remote_access(&self) -> bool {
        false
    }

    fn skip(&self, check: &str) -> Option<&'static str> {
        match check {
            // libfabric 1.17's tcp provider checks an RMA key and range but not the region's
            // FI_REMOTE_READ access: a read of a write-only region succeeds there. A real NIC
            // (and the mock, and verbs on soft-RoCE) refuses it.
            "read_of_an_unreadable_region_by_a_forged_descriptor" => {
                Some("tcp;ofi_rxm does not enforce a region's remote-read access")
            }
            // libfabric 2.1 (not 1.17): a receiver that inserts a peer whose messages already
            // wait as unexpected (they came before the receiver knew the peer) segfaults inside
            // rxm_av_insert -> util_foreach_unspec -> rxm_get_addr. Reproduced 3 of 3 here
            // with gdb (`--exact send_recv`, where the replying side inserts its sender); a
            // provider bug, not worked around. EFA does not use rxm; 1.17 runs the check.
            "send_recv" if backend_efa::api_version().starts_with("2.") => Some(
                "libfabric 2.1's tcp;ofi_rxm segfaults inserting a peer whose messages wait as unexpected",
            ),
            _ => None,
        }
    }
}

xfer_conformance::conformance_suite!(Tcp);
