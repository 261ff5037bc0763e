//! # xfer-topology: which NICs and CPUs are close to each GPU, in `nvidia-smi topo -m`'s
//! terms, and the DomainGroups that follow from it.
//!
//! Apart from the engine: the CLI (`xfer topo`, `xfer doctor`), tests and backends need it (a
//! backend explains a failed registration with [`doctor::memlock_limit`]); the engine itself
//! does not. Reading files is all it does with the machine, so it has no `unsafe`.
//!
//! [`sysfs::read`] builds a [`Topology`] from a sysfs tree (the real `/sys`, or a fixture);
//! everything else here is pure: [`link`] classifies a pair of devices, [`propose`] picks each
//! GPU's NICs and worker CPU. The config can override every choice.

#![forbid(unsafe_code)]

pub mod doctor;
pub mod sysfs;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::Serialize;

/// Where a PCI device sits: its host bridge (`pci0000:00`) and the chain of PCI functions from
/// the root port down to the device itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PciPath {
    /// The host bridge / root complex.
    pub root: String,
    /// BDFs from the root port to the device (the last one is the device).
    pub chain: Vec<String>,
}

/// A GPU or an RDMA NIC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Device {
    /// `GPU0`.. (in PCI order) or the RDMA device name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// PCI position; `None` for a virtual NIC (rxe, siw) with no PCI parent.
    pub pci: Option<PciPath>,
    /// NUMA node, when the platform reports one.
    pub numa: Option<u32>,
}

/// The devices and CPUs of one machine.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Topology {
    /// NVIDIA GPUs (3D or VGA controllers).
    pub gpus: Vec<Device>,
    /// RDMA NICs.
    pub nics: Vec<Device>,
    /// CPUs of each NUMA node.
    pub nodes: BTreeMap<u32, Vec<u32>>,
    /// Hardware threads that share a physical core, one list per core.
    pub cores: Vec<Vec<u32>>,
}

/// How two devices are connected, best first (nvidia-smi's legend).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Link {
    /// The same device.
    X,
    /// Through at most one PCIe bridge or switch.
    Pix,
    /// Through several PCIe bridges, without the host bridge.
    Pxb,
    /// Through a PCIe host bridge (one root complex).
    Phb,
    /// Between host bridges of one NUMA node (or to a virtual NIC).
    Node,
    /// Across the interconnect between NUMA nodes.
    Sys,
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::X => "X",
            Self::Pix => "PIX",
            Self::Pxb => "PXB",
            Self::Phb => "PHB",
            Self::Node => "NODE",
            Self::Sys => "SYS",
        })
    }
}

/// Classifies the connection between two devices.
///
/// A PCIe switch shows up in sysfs as an upstream port with downstream ports below it; two
/// devices each directly below a downstream port of the same switch (or both directly below
/// one bridge) count as one bridge apart (`PIX`), as nvidia-smi reports them.
pub fn link(a: &Device, b: &Device) -> Link {
    let numa_link = || match (a.numa, b.numa) {
        (Some(x), Some(y)) if x != y => Link::Sys,
        _ => Link::Node,
    };
    let (Some(pa), Some(pb)) = (&a.pci, &b.pci) else {
        return if a.name == b.name {
            Link::X
        } else {
            Link::Node
        };
    };
    if pa == pb {
        return Link::X;
    }
    if pa.root != pb.root {
        return numa_link();
    }
    let common = pa
        .chain
        .iter()
        .zip(&pb.chain)
        .take_while(|(x, y)| x == y)
        .count();
    if common == 0 {
        return Link::Phb;
    }
    let (below_a, below_b) = (pa.chain.len() - common, pb.chain.len() - common);
    if below_a <= 2 && below_b <= 2 {
        Link::Pix
    } else {
        Link::Pxb
    }
}

/// The full distance matrix, rows and columns in `gpus ++ nics` order.
pub fn matrix(topo: &Topology) -> Vec<Vec<Link>> {
    let all: Vec<&Device> = topo.gpus.iter().chain(&topo.nics).collect();
    all.iter()
        .map(|a| all.iter().map(|b| link(a, b)).collect())
        .collect()
}

/// A proposed DomainGroup.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GroupProposal {
    /// The GPU it serves (`None` on a machine without GPUs).
    pub gpu: Option<String>,
    /// Its NICs, closest first.
    pub nics: Vec<String>,
    /// The worst link between the GPU and its NICs.
    pub link: Option<Link>,
    /// A CPU for the worker: a physical core on the GPU's NUMA node, not used by another group.
    pub worker_cpu: Option<u32>,
    /// Why this group is worse than it could be, if it is.
    pub note: Option<String>,
}

/// Proposes one DomainGroup per GPU: its closest NICs (all groups the same size, at most
/// `max_nics`, since peers must agree on the NIC count; the caller bounds it by what an engine
/// drives) and a worker CPU.
///
/// The size is how many NICs every GPU has at its best link level (at least 1): on a node
/// with one NIC per GPU switch that is 1, with four EFA devices per GPU switch it is 4.
pub fn propose(topo: &Topology, max_nics: usize) -> Vec<GroupProposal> {
    let max_nics = max_nics.max(1);
    if topo.nics.is_empty() {
        return Vec::new();
    }
    let mut used_cores = BTreeSet::new();
    if topo.gpus.is_empty() {
        let size = topo.nics.len().min(max_nics);
        let numa = topo.nics[0].numa;
        return vec![GroupProposal {
            gpu: None,
            nics: topo
                .nics
                .iter()
                .take(size)
                .map(|n| n.name.clone())
                .collect(),
            link: None,
            worker_cpu: pick_cpu(topo, numa, &mut used_cores),
            note: Some("no GPU: one group for host memory".into()),
        }];
    }
    let ranked: Vec<Vec<(Link, bool, &Device)>> = topo
        .gpus
        .iter()
        .map(|g| {
            let mut r: Vec<(Link, bool, &Device)> = topo
                .nics
                .iter()
                .map(|n| (link(g, n), n.numa != g.numa, n))
                .collect();
            r.sort_by(|x, y| (x.0, x.1, &x.2.name).cmp(&(y.0, y.1, &y.2.name)));
            r
        })
        .collect();
    let size = ranked
        .iter()
        .map(|r| r.iter().take_while(|x| x.0 == r[0].0).count())
        .min()
        .unwrap_or(1)
        .clamp(1, max_nics);
    topo.gpus
        .iter()
        .zip(&ranked)
        .map(|(gpu, r)| {
            let chosen = &r[..size.min(r.len())];
            let worst = chosen.iter().map(|x| x.0).max();
            let note = match worst {
                Some(l) if l >= Link::Phb => Some(format!(
                    "no NIC shares a PCIe switch with {}; the closest is {l} (GPUDirect RDMA will be slow)",
                    gpu.name
                )),
                _ => None,
            };
            GroupProposal {
                gpu: Some(gpu.name.clone()),
                nics: chosen.iter().map(|x| x.2.name.clone()).collect(),
                link: worst,
                worker_cpu: pick_cpu(topo, gpu.numa, &mut used_cores),
                note,
            }
        })
        .collect()
}

/// The first CPU of a physical core on `numa` (any node if unknown) that no group uses yet.
fn pick_cpu(topo: &Topology, numa: Option<u32>, used: &mut BTreeSet<usize>) -> Option<u32> {
    let local: Vec<u32> = match numa.and_then(|n| topo.nodes.get(&n)) {
        Some(cpus) => cpus.clone(),
        None => topo.nodes.values().flatten().copied().collect(),
    };
    let core_of = |cpu: u32| topo.cores.iter().position(|c| c.contains(&cpu));
    for cpu in local {
        // A CPU missing from the core list is its own core.
        let core = core_of(cpu).unwrap_or(usize::MAX - cpu as usize);
        if used.insert(core) {
            return Some(cpu);
        }
    }
    None
}

/// Parses a kernel CPU list (`0-3,8,10-11`).
pub fn parse_cpu_list(text: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) {
                    out.extend(a..=b.min(a.saturating_add(65_535)));
                }
            }
            None => out.extend(part.parse::<u32>().ok()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(name: &str, root: &str, chain: &[&str], numa: u32) -> Device {
        Device {
            name: name.into(),
            pci: Some(PciPath {
                root: root.into(),
                chain: chain.iter().map(|s| s.to_string()).collect(),
            }),
            numa: Some(numa),
        }
    }

    #[test]
    fn links_follow_nvidia_smis_legend() {
        let gpu = dev(
            "GPU0",
            "pci0000:00",
            &["00:01.0", "01:00.0", "02:00.0", "03:00.0"],
            0,
        );
        let same_switch = dev(
            "nic",
            "pci0000:00",
            &["00:01.0", "01:00.0", "02:01.0", "04:00.0"],
            0,
        );
        let other_switch = dev(
            "nic",
            "pci0000:00",
            &["00:01.0", "05:00.0", "06:00.0", "07:00.0", "08:00.0"],
            0,
        );
        let other_port = dev("nic", "pci0000:00", &["00:02.0", "09:00.0"], 0);
        let other_root = dev("nic", "pci0000:40", &["40:01.0", "41:00.0"], 0);
        let other_node = dev("nic", "pci0000:80", &["80:01.0", "81:00.0"], 1);
        assert_eq!(link(&gpu, &gpu), Link::X);
        assert_eq!(link(&gpu, &same_switch), Link::Pix);
        assert_eq!(link(&gpu, &other_switch), Link::Pxb);
        assert_eq!(link(&gpu, &other_port), Link::Phb);
        assert_eq!(link(&gpu, &other_root), Link::Node);
        assert_eq!(link(&gpu, &other_node), Link::Sys);
        let rxe = Device {
            name: "rxe0".into(),
            pci: None,
            numa: None,
        };
        assert_eq!(link(&gpu, &rxe), Link::Node);
    }

    #[test]
    fn cpu_lists_parse() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list(""), Vec::<u32>::new());
        assert_eq!(parse_cpu_list("x,2"), vec![2]);
    }
}
