//! Opening a device: its port, GID and MTU, the CQ, SRQs and UD QP, the immediate receives
//! posted up front, and the handshake machine with the cluster secret.

use std::time::{Duration, Instant};

use foldhash::HashMap;
use xfer_plugin::addr::NetAddr;
use xfer_plugin::domain::{DomainConfig, DomainError, DomainErrorKind, RegionTable};

use super::connections::Connections;
use super::faults::Faults;
use super::{err, other, VerbsDomain};
use crate::ffi::{self, Device, MessageBuffers, Wc};
use crate::handshake::{self, Handshaker};
use crate::options::VerbsOptions;
use crate::wire::{choose_gid, choose_gid_for, GidEntry, GidWanted, VerbsAddr};

impl VerbsDomain {
    /// Opens the device named `config.nic`.
    pub fn open(config: &DomainConfig<'_>) -> Result<Self, DomainError> {
        let options = VerbsOptions::parse(config.options)?;
        let port = options.port_of(config.nic);
        let mut device = Device::open(config.nic, port).map_err(|e| {
            err(
                DomainErrorKind::InvalidArgument,
                format!(
                    "{e}; devices present: {:?} (see `xfer doctor`)",
                    ffi::devices()
                ),
            )
        })?;
        let gid_index = match options.gid_index {
            Some(i) => i,
            None => {
                let mut entries = Vec::new();
                for index in 0.. {
                    match device.gid(index) {
                        Ok(Some((gid, roce_v2))) => entries.push(GidEntry {
                            index: index as u32,
                            gid,
                            roce_v2,
                        }),
                        Ok(None) => {}
                        Err(()) => break,
                    }
                }
                if let Some(wanted) = &options.gid {
                    // Each GID's netdev, as sysfs shows it.
                    let netdevs: Vec<Option<String>> = entries
                        .iter()
                        .map(|e| {
                            std::fs::read_to_string(format!(
                                "/sys/class/infiniband/{}/ports/{port}/gid_attrs/ndevs/{}",
                                config.nic, e.index
                            ))
                            .ok()
                            .map(|s| s.trim().to_owned())
                        })
                        .collect();
                    let chosen = choose_gid_for(&entries, &netdevs, &GidWanted::parse(wanted));
                    chosen.ok_or_else(|| {
                        err(
                            DomainErrorKind::InvalidArgument,
                            format!(
                                "{} port {port} has no GID for gid = {wanted:?} (an IP address of, or a netdev on, this port; see `xfer info`)",
                                config.nic
                            ),
                        )
                    })? as i32
                } else {
                    choose_gid(&entries).ok_or_else(|| {
                        err(
                            DomainErrorKind::InvalidArgument,
                            format!(
                            "{} port {} has no usable GID: bring its netdev up (see `xfer doctor`)",
                            config.nic, port
                        ),
                        )
                    })? as i32
                }
            }
        };
        let faults = Faults::new(&options.faults, Instant::now());
        // The CQ holds what can complete on it: the immediate receives posted (imm_receives),
        // every message receive the message SRQ can hold, and the handshake QP's receives and
        // sends (`UD_SLOTS` each, plus slack); what each RC QP reserves is added when it is
        // created (the CQ grows: `crate::cq::CqBudget`). A fixed size overran as soon as more
        // could be outstanding.
        let srq_size = options.imm_receives.max(16) * 2;
        let cq_size = match faults.cq_entries() {
            None => options.imm_receives + srq_size + 2 * crate::ud::UD_SLOTS as i32 + 64,
            Some(fixed) => fixed as i32,
        };
        let attr = device
            .setup(gid_index, cq_size, srq_size)
            .map_err(|e| other(format!("{}: {e}", config.nic)))?;
        if faults.cq_entries().is_some() {
            device.fix_cq_size();
        }
        if attr.state != 4 {
            return Err(err(
                DomainErrorKind::InvalidArgument,
                format!(
                    "{} port {} is not ACTIVE (state {}); see `xfer doctor`",
                    config.nic, port, attr.state
                ),
            ));
        }
        let global_mode = match options.global_routing.as_str() {
            "always" => 1,
            "never" if attr.ethernet != 0 => {
                return Err(err(
                    DomainErrorKind::InvalidArgument,
                    format!(
                        "global_routing = \"never\" on {}, a RoCE port: RoCE packets always carry a GRH",
                        config.nic
                    ),
                ))
            }
            "never" => 2,
            _ => 0,
        };
        device.set_path(options.traffic_class, options.service_level, global_mode);
        // The zero-length receives that writes with immediate consume, in batches.
        let count = u32::try_from(options.imm_receives).unwrap_or(0);
        if let (_, Some(refused)) = device.post_imm_recvs(0, count) {
            return Err(other(format!("{}: {refused}", config.nic)));
        }
        // Reposted immediate receives get ids after those posted here.
        let next_imm_recv = u64::from(count);
        let me = VerbsAddr {
            gid: attr.gid,
            lid: attr.lid,
            ud_qpn: attr.ud_qpn,
        };
        let address = NetAddr::new(&me.encode()).expect("24 bytes is a valid address");
        let settings = handshake::Settings {
            retry: Duration::from_millis(options.retry_ms),
            connect: Duration::from_millis(options.connect_ms),
            max_half_open: options.max_half_open,
            max_requesting: options.max_requesting,
            cookies: true,
        };
        let mut handshake = Handshaker::new(
            me,
            attr.active_mtu as u8,
            settings,
            // Seeded from the OS's CSPRNG (see the field's doc).
            rand::make_rng(),
        );
        if let Some(path) = &options.secret_file {
            // The rule the rendezvous applies to the same file.
            let secret = xfer_plugin::secret::read(std::path::Path::new(path)).map_err(|why| {
                err(
                    DomainErrorKind::InvalidArgument,
                    format!("[security] secret_file {path}: {why}"),
                )
            })?;
            // The handshake's epoch: later at each start of this process's address, so its
            // peers take its messages over any recorded from an earlier run.
            let epoch = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            handshake = handshake.with_secret(&secret, epoch);
        }
        Ok(Self {
            connections: Connections::default(),
            handshake,
            regions: RegionTable::new(),
            receives: MessageBuffers::default(),
            sends: HashMap::default(),
            send_pool: MessageBuffers::default(),
            device,
            attr,
            me,
            address,
            name: config.nic.to_owned(),
            options,
            done: Vec::new(),
            wcs: vec![Wc::default(); 32],
            rng: fastrand::Rng::new(),
            next_wr: 0,
            polls_since_check: 0,
            ud_resets_seen: 0,
            unauthenticated_seen: 0,
            faults,
            deadline: None,
            notify: None,
            imm_deficit: 0,
            next_imm_recv,
        })
    }
}
