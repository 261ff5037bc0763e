//! Reads a [`Topology`] from a sysfs tree: `/sys`, or a fixture with the same layout
//! (`bus/pci/devices/*` links, `class/infiniband/*/device` links, `devices/system/{node,cpu}`).

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

use super::{parse_cpu_list, Device, PciPath, Topology};

/// NVIDIA's PCI vendor id.
const NVIDIA: &str = "0x10de";

fn read_trimmed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    out.sort();
    out
}

/// The PCI position of a device directory, from its resolved path under `<root>/devices`.
fn pci_path(devices: &Path, device_dir: &Path) -> Option<PciPath> {
    let resolved = std::fs::canonicalize(device_dir).ok()?;
    let rel = resolved.strip_prefix(devices).ok()?;
    let mut parts = rel.components().filter_map(|c| match c {
        Component::Normal(s) => s.to_str().map(str::to_owned),
        _ => None,
    });
    let root = parts.next().filter(|r| r.starts_with("pci"))?;
    let chain: Vec<String> = parts.collect();
    (!chain.is_empty()).then_some(PciPath { root, chain })
}

fn numa_of(device_dir: &Path) -> Option<u32> {
    read_trimmed(&device_dir.join("numa_node"))?
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

/// Reads the topology under `root` (normally `/sys`). Missing parts (no PCI bus, no
/// InfiniBand class, no NUMA information) give empty lists, not errors: that is what a
/// machine without them looks like.
pub fn read(root: &Path) -> Topology {
    let devices =
        std::fs::canonicalize(root.join("devices")).unwrap_or_else(|_| root.join("devices"));
    let mut topo = Topology::default();
    for dev in entries(&root.join("bus/pci/devices")) {
        let vendor = read_trimmed(&dev.join("vendor")).unwrap_or_default();
        let class = read_trimmed(&dev.join("class")).unwrap_or_default();
        let class = u32::from_str_radix(class.trim_start_matches("0x"), 16).unwrap_or(0) >> 8;
        if vendor == NVIDIA && (class == 0x0302 || class == 0x0300) {
            let index = topo.gpus.len();
            topo.gpus.push(Device {
                name: format!("GPU{index}"),
                pci: pci_path(&devices, &dev),
                numa: numa_of(&dev),
            });
        }
    }
    for ib in entries(&root.join("class/infiniband")) {
        let Some(name) = ib.file_name().and_then(|n| n.to_str()).map(str::to_owned) else {
            continue;
        };
        let device_dir = ib.join("device");
        let pci = device_dir
            .exists()
            .then(|| pci_path(&devices, &device_dir))
            .flatten();
        let numa = pci.as_ref().and_then(|_| numa_of(&device_dir));
        topo.nics.push(Device { name, pci, numa });
    }
    for node in entries(&root.join("devices/system/node")) {
        let Some(id) = node
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("node"))
            .and_then(|n| n.parse().ok())
        else {
            continue;
        };
        topo.nodes.insert(
            id,
            parse_cpu_list(&read_trimmed(&node.join("cpulist")).unwrap_or_default()),
        );
    }
    let mut cores = BTreeSet::new();
    for cpu in entries(&root.join("devices/system/cpu")) {
        if let Some(list) = read_trimmed(&cpu.join("topology/thread_siblings_list")) {
            cores.insert(parse_cpu_list(&list));
        }
    }
    topo.cores = cores.into_iter().collect();
    topo
}
