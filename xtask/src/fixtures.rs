//! `cargo xtask fixtures`: writes the sysfs fixture trees the topology tests read
//! (`topology/tests/fixtures/sysfs/<machine>`), modelled on documented machines. The
//! output is committed; rerun this after changing a machine here.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

const NVIDIA: &str = "0x10de";
const MELLANOX: &str = "0x15b3";
const BRIDGE_VENDOR: &str = "0x10b5"; // a PCIe switch vendor
const GPU_CLASS: &str = "0x030200";
const NIC_CLASS: &str = "0x020700";
const BRIDGE_CLASS: &str = "0x060400";

struct Machine {
    root: PathBuf,
}

impl Machine {
    fn new(base: &Path, name: &str) -> std::io::Result<Self> {
        let root = base.join(name);
        if root.exists() {
            fs::remove_dir_all(&root)?;
        }
        fs::create_dir_all(root.join("bus/pci/devices"))?;
        Ok(Self { root })
    }

    fn write(&self, rel: &str, text: &str) -> std::io::Result<()> {
        let path = self.root.join(rel);
        fs::create_dir_all(path.parent().expect("has a parent"))?;
        fs::write(path, format!("{text}\n"))
    }

    /// A PCI function at `chain` below host bridge `host` (`pci0000:00`); every prefix of the
    /// chain is a bridge. Returns the device's path under `devices/`.
    fn pci(
        &self,
        host: &str,
        chain: &[&str],
        vendor: &str,
        class: &str,
        numa: i32,
    ) -> std::io::Result<String> {
        let mut rel = format!("devices/{host}");
        for (i, bdf) in chain.iter().enumerate() {
            rel = format!("{rel}/{bdf}");
            let leaf = i == chain.len() - 1;
            let (v, c) = if leaf {
                (vendor, class)
            } else {
                (BRIDGE_VENDOR, BRIDGE_CLASS)
            };
            if !self.root.join(&rel).join("class").exists() {
                self.write(&format!("{rel}/vendor"), v)?;
                self.write(&format!("{rel}/class"), c)?;
                self.write(&format!("{rel}/numa_node"), &numa.to_string())?;
                let link = self.root.join("bus/pci/devices").join(bdf);
                if !link.exists() {
                    symlink(format!("../../../{rel}"), link)?;
                }
            }
        }
        Ok(rel)
    }

    fn gpu(&self, host: &str, chain: &[&str], numa: i32) -> std::io::Result<()> {
        self.pci(host, chain, NVIDIA, GPU_CLASS, numa).map(drop)
    }

    fn nic(&self, name: &str, host: &str, chain: &[&str], numa: i32) -> std::io::Result<()> {
        let rel = self.pci(host, chain, MELLANOX, NIC_CLASS, numa)?;
        fs::create_dir_all(self.root.join("class/infiniband").join(name))?;
        symlink(
            format!("../../../{rel}"),
            self.root.join("class/infiniband").join(name).join("device"),
        )
    }

    /// A soft-RoCE device on netdev `ndev`: no PCI parent, one active Ethernet port with a
    /// link-local RoCE v1 and v2 GID, as `rdma link add` creates them.
    fn virtual_nic(&self, name: &str, ndev: &str, mac_suffix: &str) -> std::io::Result<()> {
        let port = format!("class/infiniband/{name}/ports/1");
        self.write(&format!("class/infiniband/{name}/node_type"), "1: CA")?;
        self.write(&format!("{port}/state"), "4: ACTIVE")?;
        self.write(&format!("{port}/link_layer"), "Ethernet")?;
        let gid = format!("fe80:0000:0000:0000:{mac_suffix}");
        for (i, kind) in [(0, "IB/RoCE v1"), (1, "RoCE v2")] {
            self.write(&format!("{port}/gids/{i}"), &gid)?;
            self.write(&format!("{port}/gid_attrs/types/{i}"), kind)?;
            self.write(&format!("{port}/gid_attrs/ndevs/{i}"), ndev)?;
        }
        self.write(
            &format!("{port}/gids/2"),
            "0000:0000:0000:0000:0000:0000:0000:0000",
        )?;
        self.write(&format!("class/net/{ndev}/mtu"), "1500")
    }

    /// NUMA nodes with their CPU lists; hyper-threads `i` and `i + threads/2` share a core.
    fn cpus(&self, nodes: &[&str], threads: u32) -> std::io::Result<()> {
        for (i, list) in nodes.iter().enumerate() {
            self.write(&format!("devices/system/node/node{i}/cpulist"), list)?;
        }
        let half = threads / 2;
        for cpu in 0..threads {
            let (a, b) = (cpu % half, cpu % half + half);
            self.write(
                &format!("devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"),
                &format!("{a},{b}"),
            )?;
        }
        Ok(())
    }
}

/// A PCIe switch below root port `port` of `host`: returns the chains of its downstream slots.
fn switch(port: &str, up: &str, downs: &[(&str, &str)]) -> Vec<Vec<String>> {
    downs
        .iter()
        .map(|(down, dev)| {
            vec![
                port.to_owned(),
                up.to_owned(),
                down.to_string(),
                dev.to_string(),
            ]
        })
        .collect()
}

fn refs(chain: &[String]) -> Vec<&str> {
    chain.iter().map(String::as_str).collect()
}

pub(crate) fn write_all(base: &Path) -> std::io::Result<()> {
    // The GPUDirect RDMA guide's example: 8 GPUs, 3 NICs, 2 NUMA nodes; two GPU switches of
    // node 0 share one NIC.
    let m = Machine::new(base, "gpudirect-8gpu-3nic-2numa")?;
    let a = switch(
        "0000:00:01.0",
        "0000:01:00.0",
        &[
            ("0000:02:00.0", "0000:03:00.0"),
            ("0000:02:01.0", "0000:04:00.0"),
            ("0000:02:02.0", "0000:05:00.0"),
        ],
    );
    let b = switch(
        "0000:00:02.0",
        "0000:06:00.0",
        &[
            ("0000:07:00.0", "0000:08:00.0"),
            ("0000:07:01.0", "0000:09:00.0"),
        ],
    );
    let c = switch(
        "0000:80:01.0",
        "0000:81:00.0",
        &[
            ("0000:82:00.0", "0000:83:00.0"),
            ("0000:82:01.0", "0000:84:00.0"),
            ("0000:82:02.0", "0000:85:00.0"),
        ],
    );
    let d = switch(
        "0000:80:02.0",
        "0000:86:00.0",
        &[
            ("0000:87:00.0", "0000:88:00.0"),
            ("0000:87:01.0", "0000:89:00.0"),
            ("0000:87:02.0", "0000:8a:00.0"),
        ],
    );
    m.gpu("pci0000:00", &refs(&a[0]), 0)?;
    m.gpu("pci0000:00", &refs(&a[1]), 0)?;
    m.nic("mlx5_0", "pci0000:00", &refs(&a[2]), 0)?;
    m.gpu("pci0000:00", &refs(&b[0]), 0)?;
    m.gpu("pci0000:00", &refs(&b[1]), 0)?;
    m.gpu("pci0000:80", &refs(&c[0]), 1)?;
    m.gpu("pci0000:80", &refs(&c[1]), 1)?;
    m.nic("mlx5_1", "pci0000:80", &refs(&c[2]), 1)?;
    m.gpu("pci0000:80", &refs(&d[0]), 1)?;
    m.gpu("pci0000:80", &refs(&d[1]), 1)?;
    m.nic("mlx5_2", "pci0000:80", &refs(&d[2]), 1)?;
    m.cpus(&["0-15,32-47", "16-31,48-63"], 64)?;

    // An H100/H200 node: 8 PCIe switches, each with one GPU and one NIC; 4 per NUMA node.
    let m = Machine::new(base, "h100-8gpu-8nic")?;
    for i in 0..8u32 {
        let (host, bus, numa) = if i < 4 {
            ("pci0000:00", 0x10 * (i + 1), 0)
        } else {
            ("pci0000:80", 0x80 + 0x10 * (i - 3), 1)
        };
        let dom = if i < 4 { "00" } else { "80" };
        let s = switch(
            &format!("0000:{dom}:{:02x}.0", i + 1),
            &format!("0000:{:02x}:00.0", bus),
            &[
                (
                    &format!("0000:{:02x}:00.0", bus + 1),
                    &format!("0000:{:02x}:00.0", bus + 2),
                ),
                (
                    &format!("0000:{:02x}:01.0", bus + 1),
                    &format!("0000:{:02x}:00.0", bus + 3),
                ),
            ],
        );
        m.gpu(host, &refs(&s[0]), numa)?;
        m.nic(&format!("mlx5_{i}"), host, &refs(&s[1]), numa)?;
    }
    m.cpus(&["0-47,96-143", "48-95,144-191"], 192)?;

    // A p5-like node (cut to 2 GPUs): four EFA-style NICs under each GPU's switch.
    let m = Machine::new(base, "p5-2gpu-8nic")?;
    for g in 0..2u32 {
        let bus = 0x10 + 0x10 * g;
        let mut slots: Vec<(String, String)> = Vec::new();
        for k in 0..5u32 {
            slots.push((
                format!("0000:{:02x}:{:02x}.0", bus + 1, k),
                format!("0000:{:02x}:00.0", bus + 2 + k),
            ));
        }
        let slots: Vec<(&str, &str)> = slots
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        let s = switch(
            &format!("0000:00:{:02x}.0", g + 1),
            &format!("0000:{bus:02x}:00.0"),
            &slots,
        );
        m.gpu("pci0000:00", &refs(&s[0]), 0)?;
        for k in 0..4 {
            m.nic(
                &format!("rdmap{}s0", g * 4 + k),
                "pci0000:00",
                &refs(&s[1 + k as usize]),
                0,
            )?;
        }
    }
    m.cpus(&["0-7,16-23"], 16)?;

    // A GPU with no NIC under its switch (the case that made a peer engine give up).
    let m = Machine::new(base, "gpu-without-nic")?;
    let a = switch(
        "0000:00:01.0",
        "0000:01:00.0",
        &[
            ("0000:02:00.0", "0000:03:00.0"),
            ("0000:02:01.0", "0000:04:00.0"),
        ],
    );
    let b = switch(
        "0000:00:02.0",
        "0000:05:00.0",
        &[("0000:06:00.0", "0000:07:00.0")],
    );
    m.gpu("pci0000:00", &refs(&a[0]), 0)?;
    m.nic("mlx5_0", "pci0000:00", &refs(&a[1]), 0)?;
    m.gpu("pci0000:00", &refs(&b[0]), 0)?;
    m.cpus(&["0-7"], 8)?;

    // A machine with a NIC and no GPU.
    let m = Machine::new(base, "no-gpu")?;
    m.nic("mlx5_0", "pci0000:00", &["0000:00:03.0", "0000:3b:00.0"], 0)?;
    m.cpus(&["0-3"], 4)?;

    // The soft-RoCE guest: two rxe devices with no PCI parent.
    let m = Machine::new(base, "rxe-guest")?;
    m.virtual_nic("rxe0", "rxenet0", "b8ab:10ff:fe01:0001")?;
    m.virtual_nic("rxe1", "rxenet1", "b8ab:10ff:fe01:0002")?;
    m.cpus(&["0-1"], 2)?;
    Ok(())
}
