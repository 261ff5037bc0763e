//! `cargo xtask rxe [--nics N] [--timeout S] -- <command>`: runs a command next to real
//! soft-RoCE devices.
//!
//! This machine's kernel has no InfiniBand support, but Debian's kernel booted under qemu
//! (TCG) has: the guest mounts this machine's `/` over 9p and chroots into it, so it runs our
//! binaries and libraries on its own kernel, with `rxe0..rxeN-1` on dummy netdevs. The
//! command runs in the current directory; its output streams through and its exit status
//! becomes ours. A deadline covers the whole run, and the work directory is removed after.
//! Two traps (from the recipe this follows): the guest cannot autoload modules, so the
//! ICRC and IPv6 modules go in by hand before `rdma_rxe`; and rxe refuses `lo`, hence dummies.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{ensure_packages, Result};

/// What the guest needs from Debian.
pub(crate) const PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "linux-image-amd64",
    "busybox-static",
    "rdma-core",
    "ibverbs-providers",
    "ibverbs-utils",
    "perftest",
    "zstd",
    "cpio",
    "kmod",
    // `ip` and `rdma` set up the dummy netdevs and rxe links inside the guest.
    "iproute2",
];

/// Modules the initramfs loads to mount the host's root over 9p.
const BOOT_MODULES: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_pci_modern_dev",
    "virtio_pci_legacy_dev",
    "virtio_pci",
    "netfs",
    "fscache",
    "9pnet",
    "9pnet_virtio",
    "9p",
];

const EXIT_MARKER: &str = "XFER_RXE_EXIT=";

fn sh(script: &str) -> Result<String> {
    let out = Command::new("bash")
        .args(["-c", script])
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "`{script}` failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Quotes a word for the guest's shell.
fn quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

fn newest_kernel() -> Result<String> {
    let mut versions: Vec<String> = std::fs::read_dir("/lib/modules")
        .map_err(|e| format!("/lib/modules: {e}"))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|v| Path::new("/boot").join(format!("vmlinuz-{v}")).exists())
        .collect();
    versions.sort_by_key(|v| {
        v.split(|c: char| !c.is_ascii_digit())
            .filter_map(|n| n.parse::<u32>().ok())
            .collect::<Vec<_>>()
    });
    versions.pop().ok_or_else(|| {
        "no kernel with modules in /boot and /lib/modules (install linux-image-amd64)".into()
    })
}

fn build_initramfs(work: &Path, kernel: &str, guest_script: &Path) -> Result<PathBuf> {
    let root = work.join("root");
    for dir in ["bin", "dev", "proc", "sys", "host", "mods"] {
        std::fs::create_dir_all(root.join(dir)).map_err(|e| e.to_string())?;
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).map_err(|e| format!("busybox: {e}"))?;
    for m in BOOT_MODULES {
        let file = sh(&format!("modinfo -k {kernel} -n {m}"))?;
        let dest = root.join("mods").join(format!("{m}.ko"));
        let d = dest.display();
        match file.rsplit('.').next() {
            Some("zst") => sh(&format!("zstd -dqf {file} -o {d}"))?,
            Some("xz") => sh(&format!("xz -dc {file} > {d}"))?,
            _ => sh(&format!("cp {file} {d}"))?,
        };
    }
    let modules = BOOT_MODULES.join(" ");
    let script = guest_script.display();
    let init = format!(
        "#!/bin/busybox sh\n\
         /bin/busybox --install -s /bin\n\
         mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev\n\
         for m in {modules}; do insmod /mods/$m.ko; done\n\
         mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 host /host || poweroff -f\n\
         mount --bind /proc /host/proc; mount --bind /sys /host/sys; mount --bind /dev /host/dev\n\
         chroot /host /bin/bash {script} > /dev/console 2>&1\n\
         echo \"{EXIT_MARKER}$?\" > /dev/console\n\
         poweroff -f\n"
    );
    std::fs::write(root.join("init"), init).map_err(|e| e.to_string())?;
    sh(&format!("chmod +x {}/init", root.display()))?;
    let image = work.join("initrd.gz");
    sh(&format!(
        "cd {} && find . | cpio -o -H newc 2>/dev/null | gzip > {}",
        root.display(),
        image.display()
    ))?;
    Ok(image)
}

fn guest_script(nics: u32, command: &[String]) -> Result<String> {
    let cwd = std::env::current_dir().map_err(|e| e.to_string())?;
    let mut s = String::from(
        "modprobe crc32_generic; modprobe ipv6; modprobe rdma_rxe; modprobe ib_uverbs; modprobe dummy\n\
         ip link set lo up\n",
    );
    for i in 0..nics {
        s.push_str(&format!("ip link add rxenet{i} type dummy; ip link set rxenet{i} up; rdma link add rxe{i} type rxe netdev rxenet{i}\n"));
    }
    s.push_str("ulimit -l unlimited\n");
    // A test opens hundreds of engines in one process (a device context, its completion
    // channel and eventfds each): the default 1,024 descriptors run out first.
    s.push_str("ulimit -n 65536\n");
    s.push_str(&format!(
        "export PATH={}\n",
        std::env::var("PATH").unwrap_or_default()
    ));
    s.push_str(&format!(
        "export HOME={}\n",
        std::env::var("HOME").unwrap_or_else(|_| "/root".into())
    ));
    s.push_str(&format!("cd {}\n", quote(&cwd.display().to_string())));
    let words: Vec<String> = command.iter().map(|w| quote(w)).collect();
    s.push_str(&words.join(" "));
    s.push('\n');
    Ok(s)
}

/// Boots the guest, runs `command` there with `nics` rxe devices, and returns its exit status.
pub(crate) fn run(nics: u32, timeout: Duration, command: &[String]) -> Result<Run> {
    if command.is_empty() {
        return Err("usage: cargo xtask rxe [--nics N] [--timeout SECONDS] -- <command>".into());
    }
    ensure_packages(PACKAGES)?;
    let kernel = newest_kernel()?;
    let work = PathBuf::from(sh("mktemp -d /tmp/xfer-rxe.XXXXXX")?);
    let result = (|| {
        let script = work.join("guest.sh");
        std::fs::write(&script, guest_script(nics, command)?).map_err(|e| e.to_string())?;
        let initrd = build_initramfs(&work, &kernel, &script)?;
        boot(&kernel, &initrd, timeout)
    })();
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn boot(kernel: &str, initrd: &Path, timeout: Duration) -> Result<Run> {
    let mut child = Command::new("qemu-system-x86_64")
        .args([
            "-accel",
            "tcg,thread=multi",
            "-cpu",
            "max",
            "-m",
            "4096",
            "-smp",
            "2",
            "-nographic",
            "-no-reboot",
        ])
        .args([
            "-kernel",
            &format!("/boot/vmlinuz-{kernel}"),
            "-initrd",
            &initrd.display().to_string(),
        ])
        // The TSC, as on a real host: under TCG the kernel's watchdog rejects it and falls
        // back to the HPET, where every clock read is a system call and an emulated device
        // access (1.3 µs measured in the guest, 0.2 µs with the TSC; 32 ns natively), which
        // taxed xfer against perftest (perftest reads the TSC itself). Its calibration in
        // the guest matches the host's frequency.
        .args([
            "-append",
            "console=ttyS0 quiet panic=-1 tsc=reliable clocksource=tsc",
        ])
        .args([
            "-virtfs",
            "local,path=/,mount_tag=host,security_model=passthrough,multidevs=remap",
            "-nic",
            "none",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot start qemu: {e}"))?;
    let stdout = child.stdout.take().expect("piped");
    // Read the console on a thread so the deadline below is enforced even if it goes quiet.
    let (tx, rx) = std::sync::mpsc::channel::<(Option<i32>, Vec<String>)>();
    let reader = std::thread::spawn(move || {
        let mut status = None;
        let mut output = Vec::new();
        for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            let Some(clean) = console_line(&line) else {
                continue;
            };
            if let Some(code) = clean.trim().strip_prefix(EXIT_MARKER) {
                status = code.trim().parse().ok();
                continue;
            }
            println!("{clean}");
            output.push(clean);
        }
        let _ = tx.send((status, output));
    });
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let _ = reader.join();
            return Err(format!(
                "the guest did not finish within {} s and was stopped",
                timeout.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, output) = rx
        .recv_timeout(Duration::from_secs(5))
        .unwrap_or((None, Vec::new()));
    let _ = reader.join();
    let status = status.ok_or_else(|| {
        "the guest stopped without reporting the command's exit status (boot failure?)".to_owned()
    })?;
    Ok(Run { status, output })
}

/// What a guest run gave back.
pub(crate) struct Run {
    /// The command's exit status.
    pub(crate) status: i32,
    /// Its console output, line by line (boot noise removed).
    pub(crate) output: Vec<String>,
}

/// What a console line says once the firmware's noise is gone: `None` for a line of only
/// noise. The firmware's last words ("Booting from ROM..") end without a newline, so the
/// guest's first line can follow them on the same line: that remainder is kept (`rxe-bench
/// lat` lost its first perftest figure when the whole line was dropped).
fn console_line(raw: &str) -> Option<String> {
    const BOOTING: &str = "Booting from ROM";
    let mut clean = strip_escapes(&raw.replace('\r', ""));
    if let Some(at) = clean.rfind(BOOTING) {
        clean = clean[at + BOOTING.len()..]
            .trim_start_matches('.')
            .to_owned();
    }
    let noise = clean.starts_with("SeaBIOS") || clean.contains("reboot: Power down");
    (!noise && !clean.trim().is_empty()).then_some(clean)
}

/// Removes terminal escape sequences the guest's console emits.
fn strip_escapes(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI sequences (ESC [ ... letter) and two-character ones (ESC c: reset).
            if chars.next() == Some('[') {
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::console_line;

    #[test]
    fn the_guest_line_after_the_firmware_banner_is_kept() {
        assert_eq!(
            console_line("\u{1b}cBooting from ROM..PERFTEST 18.2 40.1\r").as_deref(),
            Some("PERFTEST 18.2 40.1")
        );
        assert_eq!(console_line("Booting from ROM.."), None);
        assert_eq!(
            console_line("SeaBIOS (version 1.16.2-debian-1.16.2-1)"),
            None
        );
        assert_eq!(console_line("[   9.1] reboot: Power down"), None);
        assert_eq!(console_line("  \r"), None);
        assert_eq!(
            console_line("SENDLAT 20.1 41.0").as_deref(),
            Some("SENDLAT 20.1 41.0")
        );
    }
}
