//! Topology discovery and group proposals on sysfs fixtures of documented machines, and on
//! this machine's real /sys.

use std::path::{Path, PathBuf};

use xfer_topology::{self as topo, link, propose, Link};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/sysfs")
        .join(name)
}

fn nic_names(p: &topo::GroupProposal) -> Vec<&str> {
    p.nics.iter().map(String::as_str).collect()
}

#[test]
fn gpudirect_example_pairs_gpus_with_their_switch_nic_and_flags_the_ones_without() {
    let t = topo::sysfs::read(&fixture("gpudirect-8gpu-3nic-2numa"));
    assert_eq!((t.gpus.len(), t.nics.len()), (8, 3));
    assert_eq!(t.nodes.len(), 2);
    let groups = propose(&t, 4);
    assert_eq!(groups.len(), 8);
    assert!(
        groups.iter().all(|g| g.nics.len() == 1),
        "peers need equal group sizes"
    );
    let want = [
        "mlx5_0", "mlx5_0", "mlx5_0", "mlx5_0", "mlx5_1", "mlx5_1", "mlx5_2", "mlx5_2",
    ];
    let got: Vec<&str> = groups.iter().map(|g| g.nics[0].as_str()).collect();
    assert_eq!(got, want);
    let links: Vec<Link> = groups.iter().map(|g| g.link.unwrap()).collect();
    assert_eq!(
        links,
        [
            Link::Pix,
            Link::Pix,
            Link::Phb,
            Link::Phb,
            Link::Pix,
            Link::Pix,
            Link::Pix,
            Link::Pix
        ]
    );
    assert!(groups[2].note.as_deref().unwrap().contains("GPU2"));
    assert!(groups[0].note.is_none());
    // Workers: one physical core each, on the GPU's node.
    let cpus: Vec<u32> = groups.iter().map(|g| g.worker_cpu.unwrap()).collect();
    assert!(
        cpus[..4].iter().all(|c| t.nodes[&0].contains(c)),
        "{cpus:?}"
    );
    assert!(
        cpus[4..].iter().all(|c| t.nodes[&1].contains(c)),
        "{cpus:?}"
    );
    let cores: std::collections::BTreeSet<_> = cpus
        .iter()
        .map(|c| t.cores.iter().position(|k| k.contains(c)).unwrap())
        .collect();
    assert_eq!(cores.len(), 8, "no two workers share a physical core");
    // The matrix is symmetric with X on the diagonal, and crosses sockets as SYS.
    let m = topo::matrix(&t);
    for (i, row) in m.iter().enumerate() {
        assert_eq!(row[i], Link::X);
        for (j, cell) in row.iter().enumerate() {
            assert_eq!(*cell, m[j][i]);
        }
    }
    assert_eq!(link(&t.gpus[0], &t.nics[1]), Link::Sys);
}

#[test]
fn h100_node_gives_each_gpu_its_own_nic() {
    let t = topo::sysfs::read(&fixture("h100-8gpu-8nic"));
    assert_eq!((t.gpus.len(), t.nics.len()), (8, 8));
    let groups = propose(&t, 4);
    for (i, g) in groups.iter().enumerate() {
        assert_eq!(nic_names(g), vec![format!("mlx5_{i}").as_str()]);
        assert_eq!(g.link, Some(Link::Pix));
        assert!(g.note.is_none());
        let node = if i < 4 { 0 } else { 1 };
        assert!(t.nodes[&node].contains(&g.worker_cpu.unwrap()));
    }
}

#[test]
fn four_nics_per_gpu_switch_make_groups_of_four() {
    let t = topo::sysfs::read(&fixture("p5-2gpu-8nic"));
    let groups = propose(&t, 4);
    assert_eq!(
        nic_names(&groups[0]),
        ["rdmap0s0", "rdmap1s0", "rdmap2s0", "rdmap3s0"]
    );
    assert_eq!(
        nic_names(&groups[1]),
        ["rdmap4s0", "rdmap5s0", "rdmap6s0", "rdmap7s0"]
    );
    // Capped by the caller's maximum, still the closest ones.
    let two = propose(&t, 2);
    assert_eq!(nic_names(&two[1]), ["rdmap4s0", "rdmap5s0"]);
}

#[test]
fn a_gpu_without_a_nic_under_its_switch_still_gets_one_with_a_warning() {
    let t = topo::sysfs::read(&fixture("gpu-without-nic"));
    let groups = propose(&t, 4);
    assert_eq!(groups.len(), 2);
    assert_eq!(groups[1].nics, vec!["mlx5_0"]);
    assert_eq!(groups[1].link, Some(Link::Phb));
    assert!(groups[1]
        .note
        .as_deref()
        .unwrap()
        .contains("no NIC shares a PCIe switch"));
    assert_ne!(groups[0].worker_cpu, groups[1].worker_cpu);
}

#[test]
fn machines_without_gpus_get_one_host_memory_group() {
    let t = topo::sysfs::read(&fixture("no-gpu"));
    assert!(t.gpus.is_empty());
    let groups = propose(&t, 4);
    assert_eq!(groups.len(), 1);
    assert_eq!(
        (groups[0].gpu.clone(), groups[0].nics.clone()),
        (None, vec!["mlx5_0".to_owned()])
    );
}

#[test]
fn rxe_devices_are_virtual_nics_close_to_every_cpu() {
    let t = topo::sysfs::read(&fixture("rxe-guest"));
    assert_eq!(t.nics.len(), 2);
    assert!(t.nics.iter().all(|n| n.pci.is_none()));
    let groups = propose(&t, 4);
    assert_eq!(nic_names(&groups[0]), ["rxe0", "rxe1"]);
    assert!(groups[0].worker_cpu.is_some());
}

#[test]
fn this_machines_sys_reads_without_error() {
    let t = topo::sysfs::read(Path::new("/sys"));
    // Every machine has CPUs; whatever GPUs and NICs it has must be consistent with /sys.
    assert!(!t.nodes.is_empty() || Path::new("/sys/devices/system/node").read_dir().is_err());
    let ib = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(t.nics.len(), ib);
    let groups = propose(&t, 4);
    assert_eq!(groups.is_empty(), t.nics.is_empty());
}
