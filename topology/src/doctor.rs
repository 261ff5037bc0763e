//! Why one file: the `Facts`, the checks `evaluate` makes of them and the `gather` that fills
//! them are one list read in parallel (a check added without its fact, or a fact nobody
//! judges, is the mistake to avoid); a third of the file is the checks' tests.
//!
//! `xfer doctor`: the set-up problems behind most "RDMA does not work" reports, each with a
//! verdict and its fix. [`gather`] reads the machine (sysfs, /dev, /proc); [`evaluate`] is pure
//! and tested on made-up facts.

use std::path::Path;

use serde::Serialize;

/// A check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Status {
    /// Fine.
    Pass,
    /// Works, but slower or less robust than it could be.
    Warn,
    /// Transfers would fail.
    Fail,
    /// Does not apply to this configuration.
    Skip,
}

/// One check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Short name.
    pub name: &'static str,
    /// Verdict.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// What to do about it (for warnings and failures).
    pub fix: Option<String>,
}

/// One RDMA port as sysfs shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Port {
    /// RDMA device (`mlx5_0`, `rxe0`).
    pub device: String,
    /// Port number.
    pub port: u32,
    /// `ACTIVE`, `DOWN`, ...
    pub state: String,
    /// `Ethernet` (RoCE) or `InfiniBand`.
    pub link_layer: String,
    /// Non-zero GIDs: (index, GID, type such as `RoCE v2`).
    pub gids: Vec<(u32, String, String)>,
    /// MTU of the netdev behind the first GID (RoCE), in bytes.
    pub netdev_mtu: Option<u32>,
}

/// What the checks look at.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Facts {
    /// The configured backend.
    pub backend: String,
    /// The configured NICs (all groups).
    pub nics: Vec<String>,
    /// The soft `RLIMIT_MEMLOCK` in bytes (`None`: unlimited or unknown).
    pub memlock_bytes: Option<u64>,
    /// Bytes the caller plans to register.
    pub register_bytes: u64,
    /// `/dev/infiniband/uverbs*` devices and whether this process may open them.
    pub uverbs: Vec<(String, bool)>,
    /// Every RDMA port.
    pub ports: Vec<Port>,
    /// NVIDIA GPUs found.
    pub gpus: usize,
    /// The CUDA devices the driver library reports, by name, or why none (`None`: not asked).
    pub cuda_devices: Option<Result<Vec<String>, String>>,
    /// Kernel (major, minor).
    pub kernel: Option<(u32, u32)>,
    /// `nvidia_peermem` loaded.
    pub nvidia_peermem: bool,
    /// `/dev/gdrdrv` present (GDRCopy's driver).
    pub gdrdrv: bool,
    /// The libfabric provider the config asks for (efa backend).
    pub libfabric_provider: Option<String>,
    /// Providers libfabric offers (`None` if not known in this build).
    pub libfabric_providers: Option<Vec<String>>,
    /// What an endpoint of the configured provider was granted (efa backend), or why none
    /// could be opened.
    pub libfabric_endpoint: Option<Result<EndpointFacts, String>>,
    /// `[watcher] memory` as configured.
    pub watcher_memory_request: String,
    /// What the watcher's slots would be on this machine (`host`, `device_mapped`,
    /// `gpu_gdrcopy`) with why better kinds were passed over, or why the requested kind
    /// cannot be had.
    pub watcher_memory: Result<(String, Vec<String>), String>,
}

impl Default for Facts {
    fn default() -> Self {
        Self {
            backend: String::new(),
            nics: Vec::new(),
            memlock_bytes: None,
            register_bytes: 0,
            uverbs: Vec::new(),
            ports: Vec::new(),
            gpus: 0,
            cuda_devices: None,
            kernel: None,
            nvidia_peermem: false,
            gdrdrv: false,
            libfabric_provider: None,
            libfabric_providers: None,
            libfabric_endpoint: None,
            watcher_memory_request: "auto".into(),
            watcher_memory: Ok(("host".into(), Vec::new())),
        }
    }
}

fn check(
    name: &'static str,
    status: Status,
    detail: impl Into<String>,
    fix: Option<&str>,
) -> Check {
    Check {
        name,
        status,
        detail: detail.into(),
        fix: fix.map(str::to_owned),
    }
}

/// The largest RoCE MTU (256..4096) that fits a netdev MTU (RoCE headers take about 60 bytes).
pub fn roce_mtu(netdev_mtu: u32) -> u32 {
    [4096, 2048, 1024, 512, 256]
        .into_iter()
        .find(|m| m + 60 <= netdev_mtu)
        .unwrap_or(256)
}

/// What a libfabric endpoint was granted, as far as the doctor's checks go.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EndpointFacts {
    /// `FI_HMEM`: device memory registered as device memory.
    pub hmem: bool,
    /// `FI_OPT_CUDA_API_PERMITTED = false` took.
    pub cuda_api_forbidden: bool,
    /// `FI_OPT_SHARED_MEMORY_PERMITTED` as set; `None`: left at the provider's default.
    pub shared_memory: Option<bool>,
    /// What the config asked of it (`None`: nothing).
    pub shared_memory_wanted: Option<bool>,
    /// `FI_OPT_EFA_EMULATED_WRITE`; `None`: the provider cannot say.
    pub emulated_write: Option<bool>,
}

/// The checks of a libfabric endpoint's grants (efa backend only).
fn endpoint_checks(f: &Facts, out: &mut Vec<Check>) {
    let Some(probe) = &f.libfabric_endpoint else {
        return;
    };
    let e = match probe {
        Ok(e) => e,
        Err(why) => {
            out.push(check(
                "libfabric endpoint",
                Status::Fail,
                format!("cannot open an endpoint: {why}"),
                Some("see `xfer info` for what libfabric offers"),
            ));
            return;
        }
    };
    out.push(match (f.gpus, e.hmem) {
        (0, _) => check("gpu memory", Status::Skip, "no NVIDIA GPU", None),
        (_, true) => check("gpu memory", Status::Pass, format!("FI_HMEM granted: GPU memory is registered as such{}", if e.cuda_api_forbidden { "; the provider makes no CUDA calls of its own" } else { "" }), None),
        (_, false) => check("gpu memory", Status::Warn, "the provider did not grant FI_HMEM: GPU memory would be bounced through host memory, so the engine refuses CUDA registrations", Some("use a libfabric built with CUDA (AWS's /opt/amazon/efa, LIBFABRIC_DIR=/opt/amazon/efa when building)")),
    });
    out.push(match e.emulated_write {
        Some(true) => check("rdma write", Status::Warn, "RDMA write is emulated with send/recv: immediates travel as messages (slower, a few hundred in flight)", Some("a device with RDMA write (p4d/p5 and newer EFA instances)")),
        Some(false) => check("rdma write", Status::Pass, "native RDMA write", None),
        None => check("rdma write", Status::Skip, "the provider cannot say whether writes are emulated (not EFA, or libfabric < 2.0)", None),
    });
    out.push(match (e.shared_memory_wanted, e.shared_memory) {
        (None, _) => check("shared memory path", Status::Skip, "left at the provider's default", None),
        (Some(w), Some(s)) if w == s => check("shared memory path", Status::Pass, format!("same-host peers {} the provider's shared-memory path", if s { "use" } else { "do not use" }), None),
        (Some(w), _) => check("shared memory path", Status::Warn, format!("asked to {} the shared-memory path for same-host peers, but this libfabric cannot set it (FI_OPT_SHARED_MEMORY_PERMITTED needs 1.19)", if w { "permit" } else { "forbid" }), Some("a newer libfabric (AWS's 2.x)")),
    });
}

/// Runs every check.
pub fn evaluate(f: &Facts) -> Vec<Check> {
    let verbs = f.backend == "verbs";
    let efa = f.backend == "efa";
    // Only real NICs pin memory and need /dev/infiniband; libfabric's shm and tcp do not.
    let hw = verbs || (efa && f.libfabric_provider.as_deref() == Some("efa"));
    let pins = hw;
    let mut out = Vec::new();

    out.push(match (pins, f.memlock_bytes) {
        (false, _) => check("memlock", Status::Skip, format!("backend {} does not pin memory here", f.backend), None),
        (true, None) => check("memlock", Status::Pass, "locked-memory limit: unlimited", None),
        (true, Some(limit)) if limit >= f.register_bytes => {
            check("memlock", Status::Pass, format!("locked-memory limit {limit} B covers {} B", f.register_bytes), None)
        }
        (true, Some(limit)) => check(
            "memlock",
            Status::Fail,
            format!("locked-memory limit is {limit} B but {} B will be registered: memory registration fails with ENOMEM", f.register_bytes),
            Some("raise it: `ulimit -l unlimited`, `memlock` in /etc/security/limits.conf, LimitMEMLOCK=infinity for systemd units, or `--ulimit memlock=-1` for containers"),
        ),
    });

    let rdma_fix = "load the RDMA stack (`modprobe ib_uverbs` and the NIC's driver), or for testing create a soft-RoCE device (`rdma link add rxe0 type rxe netdev eth0`)";
    out.push(if !hw {
        check(
            "rdma devices",
            Status::Skip,
            format!("backend {} needs no RDMA device", f.backend),
            None,
        )
    } else if f.uverbs.is_empty() {
        check(
            "rdma devices",
            Status::Fail,
            "no /dev/infiniband/uverbs* device: this kernel exposes no RDMA NIC",
            Some(rdma_fix),
        )
    } else if let Some((dev, _)) = f.uverbs.iter().find(|(_, ok)| !ok) {
        check(
            "rdma devices",
            Status::Fail,
            format!("{dev} exists but this user cannot open it"),
            Some("add the user to the `rdma` group or fix the udev rule for /dev/infiniband"),
        )
    } else {
        check(
            "rdma devices",
            Status::Pass,
            format!("{} uverbs device(s) accessible", f.uverbs.len()),
            None,
        )
    });

    let ports: Vec<&Port> = f
        .ports
        .iter()
        .filter(|p| {
            f.nics.is_empty()
                || f.nics
                    .iter()
                    .any(|n| n.split('#').next() == Some(p.device.as_str()))
        })
        .collect();
    out.push(if !verbs {
        check("ports active", Status::Skip, "only the verbs backend drives ports directly", None)
    } else if ports.is_empty() {
        check("ports active", Status::Fail, format!("no port of the configured NICs {:?} was found", f.nics), Some(rdma_fix))
    } else if let Some(p) = ports.iter().find(|p| !p.state.contains("ACTIVE")) {
        check("ports active", Status::Fail, format!("{} port {} is {}", p.device, p.port, p.state), Some("bring the link up (`ip link set <netdev> up`, check the cable/switch); IB ports also need a subnet manager"))
    } else {
        check("ports active", Status::Pass, format!("{} port(s) ACTIVE", ports.len()), None)
    });

    let roce: Vec<&&Port> = ports
        .iter()
        .filter(|p| p.link_layer == "Ethernet")
        .collect();
    out.push(if !verbs || roce.is_empty() {
        check("RoCE v2 GID", Status::Skip, "no RoCE port in use", None)
    } else {
        match roce.iter().find(|p| !p.gids.iter().any(|g| g.2 == "RoCE v2")) {
            None => check("RoCE v2 GID", Status::Pass, "every RoCE port has a RoCE v2 GID", None),
            Some(p) if p.gids.is_empty() => check("RoCE v2 GID", Status::Fail, format!("{} port {} has no usable GID", p.device, p.port), Some("give the netdev an address or bring it up; GID 0 (link-local) appears once it is up")),
            Some(p) => check("RoCE v2 GID", Status::Warn, format!("{} port {} has only RoCE v1 GIDs", p.device, p.port), Some("assign an IP address to the netdev (RoCE v2 GIDs follow IP addresses), or set gid_index in [backends.verbs]")),
        }
    });

    let mtus: Vec<u32> = roce
        .iter()
        .filter_map(|p| p.netdev_mtu.map(roce_mtu))
        .collect();
    out.push(match (verbs, mtus.iter().min(), mtus.iter().max()) {
        (true, Some(lo), Some(hi)) if lo != hi => check("MTU consistent", Status::Warn, format!("RoCE MTUs differ across the group's ports ({lo}..{hi}); connections use the smaller"), Some("set the same MTU on every netdev of the group and its peers")),
        (true, Some(lo), Some(_)) => check("MTU consistent", Status::Pass, format!("RoCE MTU {lo} on every port"), None),
        _ => check("MTU consistent", Status::Skip, "no RoCE port in use", None),
    });

    // The driver's view beside sysfs': a GPU the driver cannot reach is as good as none.
    out.push(match (&f.cuda_devices, f.gpus) {
        (None, _) => check("CUDA driver", Status::Skip, "not asked", None),
        (Some(Ok(names)), _) if !names.is_empty() => check(
            "CUDA driver",
            Status::Pass,
            format!("{} device(s): {}", names.len(), names.join(", ")),
            None,
        ),
        (Some(Err(why)), 0) => check("CUDA driver", Status::Skip, why.clone(), None),
        (Some(Ok(_)), 0) => check("CUDA driver", Status::Skip, "the driver reports no device", None),
        (Some(result), gpus) => check(
            "CUDA driver",
            Status::Warn,
            format!(
                "{gpus} NVIDIA GPU(s) in sysfs, but the driver gives {}: GPU memory and GPU watcher slots are refused",
                match result {
                    Ok(_) => "no device".to_owned(),
                    Err(why) => why.clone(),
                }
            ),
            Some("install the NVIDIA driver's libcuda.so.1 where the dynamic loader finds it"),
        ),
    });

    let dmabuf = f.kernel.is_some_and(|k| k >= (5, 12));
    out.push(if f.gpus == 0 {
        check(
            "GPU memory registration",
            Status::Skip,
            "no NVIDIA GPU",
            None,
        )
    } else if !hw {
        check(
            "GPU memory registration",
            Status::Skip,
            format!(
                "backend {} does not register GPU memory with a NIC",
                f.backend
            ),
            None,
        )
    } else if f.nvidia_peermem || dmabuf {
        let how = if dmabuf {
            "dma-buf (kernel >= 5.12)"
        } else {
            "nvidia_peermem"
        };
        check(
            "GPU memory registration",
            Status::Pass,
            format!("GPU memory can be registered through {how}"),
            None,
        )
    } else {
        check(
            "GPU memory registration",
            Status::Fail,
            "neither dma-buf (kernel >= 5.12) nor nvidia_peermem is available",
            Some("`modprobe nvidia_peermem`, or run a kernel >= 5.12 with an open NVIDIA driver"),
        )
    });

    out.push(if f.gpus == 0 {
        check("GDRCopy", Status::Skip, "no NVIDIA GPU", None)
    } else if f.gdrdrv {
        check("GDRCopy", Status::Pass, "/dev/gdrdrv present", None)
    } else {
        check(
            "GDRCopy",
            Status::Warn,
            "/dev/gdrdrv missing: CPU-to-GPU flags fall back to device-mapped host memory",
            Some("install GDRCopy and load gdrdrv"),
        )
    });

    out.push(match &f.watcher_memory {
        Err(why) => check(
            "watcher slots",
            Status::Fail,
            format!("[watcher] memory = {:?} cannot be had: {why}", f.watcher_memory_request),
            Some("install what it needs (the CUDA driver; GDRCopy with gdrdrv loaded), or choose another [watcher] memory"),
        ),
        Ok((kind, _)) if f.gpus > 0 && kind == "host" => check(
            "watcher slots",
            Status::Warn,
            "slots in host memory on a GPU machine: kernels cannot signal them",
            Some("install the CUDA driver (device_mapped) or GDRCopy (gpu_gdrcopy)"),
        ),
        Ok((kind, passed_over)) if passed_over.is_empty() => {
            check("watcher slots", Status::Pass, format!("slots in {kind} memory"), None)
        }
        Ok((kind, passed_over)) => check(
            "watcher slots",
            Status::Pass,
            format!("slots in {kind} memory ({})", passed_over.join("; ")),
            None,
        ),
    });

    out.push(match (efa, &f.libfabric_provider, &f.libfabric_providers) {
        (false, _, _) => check("libfabric provider", Status::Skip, "backend is not efa", None),
        (true, Some(p), Some(offered)) if offered.iter().any(|o| o == p) => check("libfabric provider", Status::Pass, format!("provider {p} is available"), None),
        (true, p, Some(offered)) => check("libfabric provider", Status::Fail, format!("provider {:?} is not offered; libfabric offers {offered:?}", p.as_deref().unwrap_or("efa")), Some("install the provider (on AWS: the EFA installer), or choose one of those offered in [backends.efa] provider")),
        (true, _, None) => check("libfabric provider", Status::Warn, "this build cannot list libfabric providers", None),
    });
    out.push(remote_access_check(f));
    endpoint_checks(f, &mut out);
    out
}

/// Whether the NIC enforces a region's remote access rights (a read of a write-only region
/// fails with `RemoteAccess`). libfabric's tcp and shm providers (1.17) do not: a read of a
/// write-only region succeeds on tcp and times out on shm, so any holder of a key can read.
fn remote_access_check(f: &Facts) -> Check {
    const NAME: &str = "remote access rights";
    let provider = f.libfabric_provider.as_deref().unwrap_or("efa");
    match f.backend.as_str() {
        "verbs" => check(NAME, Status::Pass, "enforced by the NIC (a read of a write-only region fails)", None),
        "efa" if provider == "efa" => check(NAME, Status::Pass, "enforced by the NIC (a read of a write-only region fails)", None),
        "efa" => check(
            NAME,
            Status::Warn,
            format!("libfabric provider {provider:?} does not enforce them: a read of a write-only region succeeds (tcp) or hangs until the transfer timeout (shm), so any holder of a region's descriptor can read it"),
            Some("use it only among trusted processes (tests, one machine); across machines use the efa provider or verbs"),
        ),
        other => check(NAME, Status::Skip, format!("backend {other}: no NIC"), None),
    }
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

fn list(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The soft locked-memory limit from `/proc/self/limits` (`None`: unlimited or unreadable).
pub fn memlock_limit(proc_root: &Path) -> Option<u64> {
    let text = read(&proc_root.join("self/limits"))?;
    let line = text.lines().find(|l| l.starts_with("Max locked memory"))?;
    line["Max locked memory".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Every RDMA port under `<sys>/class/infiniband`.
pub fn ports(sys: &Path) -> Vec<Port> {
    let mut out = Vec::new();
    for device in list(&sys.join("class/infiniband")) {
        let dir = sys.join("class/infiniband").join(&device).join("ports");
        for port in list(&dir) {
            let p = dir.join(&port);
            let mut gids = Vec::new();
            let mut netdev = None;
            for index in list(&p.join("gids")) {
                let gid = read(&p.join("gids").join(&index)).unwrap_or_default();
                if gid.is_empty() || gid.chars().all(|c| c == '0' || c == ':') {
                    continue;
                }
                let kind = read(&p.join("gid_attrs/types").join(&index)).unwrap_or_default();
                netdev = netdev.or_else(|| read(&p.join("gid_attrs/ndevs").join(&index)));
                gids.push((index.parse().unwrap_or(0), gid, kind));
            }
            gids.sort();
            out.push(Port {
                device: device.clone(),
                port: port.parse().unwrap_or(0),
                state: read(&p.join("state")).unwrap_or_default(),
                link_layer: read(&p.join("link_layer")).unwrap_or_default(),
                gids,
                netdev_mtu: netdev.and_then(|n| {
                    read(&sys.join("class/net").join(n).join("mtu"))?
                        .parse()
                        .ok()
                }),
            });
        }
    }
    out
}

/// Reads the machine-dependent facts; the caller fills in the backend, NICs, sizes and
/// libfabric's providers.
pub fn gather(sys: &Path, dev: &Path, proc_root: &Path) -> Facts {
    let uverbs = list(&dev.join("infiniband"))
        .into_iter()
        .filter(|n| n.starts_with("uverbs"))
        .map(|n| {
            let path = dev.join("infiniband").join(&n);
            let ok = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .is_ok();
            (path.display().to_string(), ok)
        })
        .collect();
    let kernel = read(&proc_root.join("sys/kernel/osrelease")).and_then(|r| {
        let mut it = r
            .split(|c: char| !c.is_ascii_digit())
            .filter(|s| !s.is_empty());
        Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
    });
    Facts {
        memlock_bytes: memlock_limit(proc_root),
        uverbs,
        ports: ports(sys),
        gpus: super::sysfs::read(sys).gpus.len(),
        kernel,
        nvidia_peermem: sys.join("module/nvidia_peermem").exists(),
        gdrdrv: dev.join("gdrdrv").exists(),
        ..Facts::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cuda_driver_check_names_the_devices_or_warns_when_gpus_are_unreachable() {
        let mut f = Facts::default();
        assert_eq!(status(&evaluate(&f), "CUDA driver"), Status::Skip);
        f.cuda_devices = Some(Ok(vec!["GPU A".into(), "GPU B".into()]));
        let checks = evaluate(&f);
        let c = checks.iter().find(|c| c.name == "CUDA driver").unwrap();
        assert!(c.status == Status::Pass && c.detail.contains("2 device(s): GPU A, GPU B"));
        f.cuda_devices = Some(Err("no CUDA driver library".into()));
        assert_eq!(
            status(&evaluate(&f), "CUDA driver"),
            Status::Skip,
            "no GPU, no driver"
        );
        f.gpus = 2;
        let checks = evaluate(&f);
        let c = checks.iter().find(|c| c.name == "CUDA driver").unwrap();
        assert!(
            c.status == Status::Warn && c.detail.contains("no CUDA driver library"),
            "{c:?}"
        );
    }

    #[test]
    fn the_watcher_check_says_which_slots_and_fails_an_impossible_request() {
        let mut f = Facts::default();
        assert_eq!(status(&evaluate(&f), "watcher slots"), Status::Pass);
        f.gpus = 1;
        assert_eq!(status(&evaluate(&f), "watcher slots"), Status::Warn);
        f.watcher_memory_request = "gpu_gdrcopy".into();
        f.watcher_memory = Err("gdr_open failed: is the gdrdrv kernel module loaded".into());
        let checks = evaluate(&f);
        assert_eq!(status(&checks, "watcher slots"), Status::Fail);
        assert!(checks.iter().any(|c| c.detail.contains("gdrdrv")));
        f.watcher_memory = Ok(("gpu_gdrcopy".into(), Vec::new()));
        assert_eq!(status(&evaluate(&f), "watcher slots"), Status::Pass);
    }

    /// Issue 25 §8: libfabric tcp serves a read of a write-only region and shm hangs on it;
    /// xfer cannot enforce it there, so doctor says so.
    #[test]
    fn providers_that_do_not_enforce_access_rights_are_warned_about() {
        let mut f = Facts {
            backend: "efa".into(),
            ..Facts::default()
        };
        for (provider, want) in [
            ("tcp;ofi_rxm", Status::Warn),
            ("shm", Status::Warn),
            ("efa", Status::Pass),
        ] {
            f.libfabric_provider = Some(provider.into());
            let checks = evaluate(&f);
            assert_eq!(status(&checks, "remote access rights"), want, "{provider}");
            if want == Status::Warn {
                let c = checks
                    .iter()
                    .find(|c| c.name == "remote access rights")
                    .unwrap();
                assert!(c.detail.contains(provider) && c.fix.is_some(), "{c:?}");
            }
        }
        assert_eq!(
            status(&evaluate(&healthy_roce()), "remote access rights"),
            Status::Pass
        );
    }

    fn status(checks: &[Check], name: &str) -> Status {
        checks.iter().find(|c| c.name == name).unwrap().status
    }

    fn healthy_roce() -> Facts {
        Facts {
            backend: "verbs".into(),
            nics: vec!["rxe0".into()],
            memlock_bytes: None,
            register_bytes: 1 << 30,
            uverbs: vec![("/dev/infiniband/uverbs0".into(), true)],
            ports: vec![Port {
                device: "rxe0".into(),
                port: 1,
                state: "4: ACTIVE".into(),
                link_layer: "Ethernet".into(),
                gids: vec![
                    (0, "fe80::1".into(), "IB/RoCE v1".into()),
                    (1, "fe80::1".into(), "RoCE v2".into()),
                ],
                netdev_mtu: Some(1500),
            }],
            kernel: Some((6, 1)),
            ..Facts::default()
        }
    }

    #[test]
    fn a_healthy_roce_machine_passes_everything_that_applies() {
        let checks = evaluate(&healthy_roce());
        assert!(
            checks
                .iter()
                .all(|c| matches!(c.status, Status::Pass | Status::Skip)),
            "{checks:#?}"
        );
        assert_eq!(status(&checks, "ports active"), Status::Pass);
    }

    #[test]
    fn each_setup_failure_is_named_with_its_fix() {
        let mut f = healthy_roce();
        f.memlock_bytes = Some(64 << 10);
        f.ports[0].state = "1: DOWN".into();
        f.ports[0].gids.retain(|g| g.2 != "RoCE v2");
        let checks = evaluate(&f);
        let memlock = checks.iter().find(|c| c.name == "memlock").unwrap();
        assert_eq!(memlock.status, Status::Fail);
        assert!(
            memlock.detail.contains("65536")
                && memlock.fix.as_deref().unwrap().contains("ulimit -l")
        );
        assert_eq!(status(&checks, "ports active"), Status::Fail);
        assert_eq!(status(&checks, "RoCE v2 GID"), Status::Warn);
    }

    #[test]
    fn no_rdma_at_all_fails_verbs_but_not_the_mock() {
        let mut f = healthy_roce();
        f.uverbs.clear();
        f.ports.clear();
        let checks = evaluate(&f);
        assert_eq!(status(&checks, "rdma devices"), Status::Fail);
        assert_eq!(status(&checks, "ports active"), Status::Fail);
        f.backend = "mock".into();
        // Only the watcher's check is about the machine rather than the backend.
        assert!(evaluate(&f)
            .iter()
            .filter(|c| c.name != "watcher slots")
            .all(|c| c.status == Status::Skip));
    }

    #[test]
    fn gpus_need_dmabuf_or_peermem_and_mtus_should_match() {
        let mut f = healthy_roce();
        f.gpus = 8;
        f.kernel = Some((5, 4));
        let checks = evaluate(&f);
        assert_eq!(status(&checks, "GPU memory registration"), Status::Fail);
        assert_eq!(status(&checks, "GDRCopy"), Status::Warn);
        f.nvidia_peermem = true;
        let mut second = f.ports[0].clone();
        second.device = "rxe1".into();
        second.netdev_mtu = Some(9000);
        f.ports.push(second);
        f.nics.push("rxe1".into());
        let checks = evaluate(&f);
        assert_eq!(status(&checks, "GPU memory registration"), Status::Pass);
        assert_eq!(status(&checks, "MTU consistent"), Status::Warn);
        assert_eq!(roce_mtu(1500), 1024);
        assert_eq!(roce_mtu(9000), 4096);
    }

    #[test]
    fn an_efa_endpoint_without_fi_hmem_or_native_writes_is_reported() {
        let f = Facts {
            backend: "efa".into(),
            gpus: 8,
            libfabric_provider: Some("efa".into()),
            libfabric_providers: Some(vec!["efa".into()]),
            libfabric_endpoint: Some(Ok(EndpointFacts {
                hmem: false,
                cuda_api_forbidden: false,
                shared_memory: None,
                shared_memory_wanted: Some(false),
                emulated_write: Some(true),
            })),
            ..Facts::default()
        };
        let checks = evaluate(&f);
        let status = |name: &str| checks.iter().find(|c| c.name == name).map(|c| c.status);
        assert_eq!(status("gpu memory"), Some(Status::Warn));
        assert_eq!(status("rdma write"), Some(Status::Warn));
        assert_eq!(status("shared memory path"), Some(Status::Warn));
        let f = Facts {
            libfabric_endpoint: Some(Ok(EndpointFacts {
                hmem: true,
                cuda_api_forbidden: true,
                shared_memory: Some(false),
                shared_memory_wanted: Some(false),
                emulated_write: Some(false),
            })),
            ..f
        };
        let checks = evaluate(&f);
        assert!(
            ["gpu memory", "rdma write", "shared memory path"]
                .iter()
                .all(|n| checks
                    .iter()
                    .any(|c| c.name == *n && c.status == Status::Pass)),
            "{checks:?}"
        );
    }

    #[test]
    fn a_missing_libfabric_provider_lists_the_offered_ones() {
        let f = Facts {
            backend: "efa".into(),
            libfabric_provider: Some("efa".into()),
            libfabric_providers: Some(vec!["shm".into(), "tcp;ofi_rxm".into()]),
            ..Facts::default()
        };
        let c = evaluate(&f)
            .into_iter()
            .find(|c| c.name == "libfabric provider")
            .unwrap();
        assert_eq!(c.status, Status::Fail);
        assert!(c.detail.contains("shm"));
    }

    #[test]
    fn this_machine_can_be_read() {
        let f = gather(Path::new("/sys"), Path::new("/dev"), Path::new("/proc"));
        assert!(
            f.kernel.is_some_and(|(major, _)| major >= 3),
            "{:?}",
            f.kernel
        );
        let port_dirs: usize = list(Path::new("/sys/class/infiniband"))
            .iter()
            .map(|d| list(&Path::new("/sys/class/infiniband").join(d).join("ports")).len())
            .sum();
        assert_eq!(f.ports.len(), port_dirs);
    }
}
