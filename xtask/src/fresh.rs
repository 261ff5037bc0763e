//! `cargo xtask fresh`: runs `cargo xtask test` as a newcomer would, in a clean Debian 12 root.
//!
//! A green run on a machine where packages were installed by hand proves nothing about a new
//! user's machine (it hid a missing `libibverbs-dev` once). So CI builds a minimal Debian 12
//! root with `debootstrap` (minbase plus what a fresh machine of this kind has: build-essential,
//! pkg-config, git, ca-certificates, python3 with pip), cached between runs, copies it for this
//! run, clones HEAD into it, and runs `cargo xtask test` there with:
//!
//! - the Rust toolchain bind-mounted read-only (`$RUSTUP_HOME`, the proxies in
//!   `$CARGO_HOME/bin`) and a fresh, empty cargo home, so every crate is fetched and built anew;
//! - `/proc`, `/sys` and `/dev` mounted, so the qemu soft-RoCE guest and libfabric's shm
//!   provider work inside;
//! - the machine's resolver configuration, CA bundle and package-client settings copied in, or
//!   package downloads fail inside;
//! - the downloaded `.deb` files kept in a cache (installing them is still done every run), and
//!   likewise the serving frameworks' wheels (`serving.rs`).
//!
//! Whatever happens — failure, Ctrl-C, SIGTERM — the mounts are taken down and the run's root
//! removed; a run killed outright leaves a directory that the next run cleans up first. If the
//! clean root cannot be built (no debootstrap, no network), this fails: it never falls back to
//! testing the machine it runs on.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{ensure_packages, run, Result};

/// The Debian release and what a fresh machine of this kind has beyond minbase.
const SUITE: &str = "bookworm";
const MIRROR: &str = "http://deb.debian.org/debian";
const BASE_PACKAGES: &[&str] = &[
    "build-essential",
    "pkg-config",
    "git",
    "ca-certificates",
    "python3",
    "python3-pip",
];

/// Machine configuration (not packages) a fresh machine of this kind comes with; copied into
/// the root when present so package clients behave as they do on the machine.
const MACHINE_FILES: &[&str] = &[
    "/etc/resolv.conf",
    "/etc/hosts",
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pip.conf",
    "/etc/apt/apt.conf.d/99artifact-registry",
];

/// Where the toolchain appears inside the root.
const RUSTUP_IN_ROOT: &str = "opt/rust/rustup";
const CARGO_BIN_IN_ROOT: &str = "opt/rust/cargo-bin";
/// Where HEAD is cloned inside the root.
const SOURCE_IN_ROOT: &str = "src/xfer";

/// The whole time `cargo xtask test` may take inside the root.
const TEST_DEADLINE: Duration = Duration::from_secs(80 * 60);

fn cache_dir() -> PathBuf {
    std::env::var_os("XFER_FRESH_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/xfer-fresh"))
}

fn home() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root"))
}

/// What identifies a cached base root: rebuilt when the suite, mirror or package list change.
fn base_stamp() -> String {
    format!(
        "debootstrap --variant=minbase --include={} {SUITE} {MIRROR}\n",
        BASE_PACKAGES.join(",")
    )
}

/// Builds (or reuses) the cached minimal root and returns its path.
fn base_root(cache: &Path) -> Result<PathBuf> {
    let base = cache.join(format!("{SUITE}-minbase"));
    let stamp = cache.join(format!("{SUITE}-minbase.stamp"));
    if base.join("usr/bin/gcc").exists()
        && std::fs::read_to_string(&stamp).is_ok_and(|s| s == base_stamp())
    {
        eprintln!("xtask fresh: reusing the clean root {}", base.display());
        return Ok(base);
    }
    ensure_packages(&["debootstrap"])
        .map_err(|e| format!("cannot build the clean root: debootstrap is not available: {e}"))?;
    // Built beside the cache entry and renamed only when complete, so an interrupted build is
    // never taken for a good root.
    let partial = cache.join(format!("{SUITE}-minbase.partial"));
    remove_tree(&partial)?;
    let _ = std::fs::remove_file(&stamp);
    remove_tree(&base)?;
    let include = format!("--include={}", BASE_PACKAGES.join(","));
    run(
        "debootstrap",
        &[
            "--variant=minbase",
            &include,
            SUITE,
            &partial.display().to_string(),
            MIRROR,
        ],
    )
    .map_err(|e| format!("cannot build the clean root (no network?): {e}"))?;
    std::fs::rename(&partial, &base).map_err(|e| e.to_string())?;
    std::fs::write(&stamp, base_stamp()).map_err(|e| e.to_string())?;
    Ok(base)
}

/// Mount points under `root`, deepest first (from /proc/self/mounts).
fn mounts_under(root: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mut points: Vec<PathBuf> = text
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        // /proc/self/mounts escapes spaces as \040; our paths have none.
        .map(PathBuf::from)
        .filter(|p| p.starts_with(root))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points.dedup();
    points
}

fn unmount_all(root: &Path) -> Result {
    for _ in 0..3 {
        let points = mounts_under(root);
        if points.is_empty() {
            return Ok(());
        }
        for p in points {
            let p = p.display().to_string();
            if !quiet("umount", &[&p]) {
                // Busy (a process still inside): detach it; it goes when the last user does.
                quiet("umount", &["-l", &p]);
            }
        }
    }
    let left = mounts_under(root);
    if left.is_empty() {
        Ok(())
    } else {
        Err(format!("could not unmount {left:?}"))
    }
}

/// Removes a directory tree, only once nothing is mounted inside it: `/dev` and the toolchain
/// are bind-mounted into run roots, and removing through a mount would delete the machine's.
fn remove_tree(dir: &Path) -> Result {
    if !dir.exists() {
        return Ok(());
    }
    unmount_all(dir)?;
    if !mounts_under(dir).is_empty() {
        return Err(format!(
            "refusing to remove {}: mounts remain",
            dir.display()
        ));
    }
    let d = dir.display().to_string();
    if quiet("rm", &["-rf", "--one-file-system", &d]) {
        Ok(())
    } else {
        Err(format!("cannot remove {d}"))
    }
}

fn quiet(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Removes the roots of earlier runs whose process is gone (killed outright, say).
fn clean_stale_runs(runs: &Path) -> Result {
    let Ok(entries) = std::fs::read_dir(runs) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        let alive = Path::new("/proc").join(&pid).exists();
        if !alive || pid == std::process::id().to_string() {
            eprintln!(
                "xtask fresh: removing the stale run {}",
                entry.path().display()
            );
            remove_tree(&entry.path())?;
        }
    }
    Ok(())
}

/// One run's root: mounted and populated by `prepare`, always taken down by `drop`.
struct RunRoot {
    dir: PathBuf,
    root: PathBuf,
}

impl Drop for RunRoot {
    fn drop(&mut self) {
        if let Err(e) = remove_tree(&self.dir) {
            eprintln!("xtask fresh: cleaning up {}: {e}", self.dir.display());
        }
    }
}

fn bind(from: &Path, to: &Path, read_only: bool) -> Result {
    std::fs::create_dir_all(to).map_err(|e| format!("{}: {e}", to.display()))?;
    let (f, t) = (from.display().to_string(), to.display().to_string());
    run("mount", &["--rbind", &f, &t])?;
    // Unmounting inside must never propagate back to the machine's own mounts.
    run("mount", &["--make-rslave", &t])?;
    if read_only {
        run("mount", &["-o", "remount,bind,ro", &t])?;
    }
    Ok(())
}

impl RunRoot {
    fn prepare(base: &Path, runs: &Path, cache: &Path) -> Result<Self> {
        let dir = runs.join(std::process::id().to_string());
        let this = RunRoot {
            root: dir.join("root"),
            dir,
        };
        std::fs::create_dir_all(&this.dir).map_err(|e| e.to_string())?;
        let started = Instant::now();
        run(
            "cp",
            &[
                "-a",
                "--reflink=auto",
                &base.display().to_string(),
                &this.root.display().to_string(),
            ],
        )?;
        eprintln!(
            "xtask fresh: copied the clean root in {:.0?}",
            started.elapsed()
        );
        let root = &this.root;
        for file in MACHINE_FILES {
            let from = Path::new(file);
            if from.exists() {
                let to = root.join(file.trim_start_matches('/'));
                if let Some(parent) = to.parent() {
                    std::fs::create_dir_all(parent).map_err(|e| e.to_string())?;
                }
                // resolv.conf may be a link into /run; copy what it says.
                let _ = std::fs::remove_file(&to);
                std::fs::copy(from, &to).map_err(|e| format!("{file}: {e}"))?;
            }
        }
        std::fs::create_dir_all(root.join("proc")).map_err(|e| e.to_string())?;
        run(
            "mount",
            &[
                "-t",
                "proc",
                "proc",
                &root.join("proc").display().to_string(),
            ],
        )?;
        bind(Path::new("/sys"), &root.join("sys"), false)?;
        bind(Path::new("/dev"), &root.join("dev"), false)?;
        let rustup = std::env::var_os("RUSTUP_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| home().join(".rustup"));
        let cargo_bin = std::env::var_os("CARGO_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| home().join(".cargo"))
            .join("bin");
        bind(&rustup, &root.join(RUSTUP_IN_ROOT), true)?;
        bind(&cargo_bin, &root.join(CARGO_BIN_IN_ROOT), true)?;
        // Downloaded packages survive between runs; their installation does not.
        let archives = cache.join("apt-archives");
        std::fs::create_dir_all(archives.join("partial")).map_err(|e| e.to_string())?;
        bind(&archives, &root.join("var/cache/apt/archives"), false)?;
        // So are vLLM's and SGLang's wheels (5 GB; this machine's pip keeps no cache): see
        // `serving.rs`.
        let wheels = crate::serving::wheel_cache();
        std::fs::create_dir_all(&wheels).map_err(|e| format!("{wheels}: {e}"))?;
        bind(
            Path::new(&wheels),
            &root.join(wheels.trim_start_matches('/')),
            false,
        )?;
        Ok(this)
    }

    /// Clones the repository's HEAD (committed work only, as CI sees it) into the root.
    fn clone_head(&self) -> Result<String> {
        let top = capture("git", &["rev-parse", "--show-toplevel"])?;
        let head = capture("git", &["rev-parse", "HEAD"])?;
        let dest = self.root.join(SOURCE_IN_ROOT);
        run(
            "git",
            &[
                "clone",
                "--quiet",
                "--no-local",
                "--no-checkout",
                &top,
                &dest.display().to_string(),
            ],
        )?;
        run(
            "git",
            &[
                "-C",
                &dest.display().to_string(),
                "checkout",
                "--quiet",
                "--detach",
                &head,
            ],
        )?;
        Ok(head)
    }
}

fn capture(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    if !out.status.success() {
        return Err(format!("`{program} {}` failed", args.join(" ")));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The environment inside: nothing of this machine's but the toolchain's location.
fn chroot_command(root: &Path, inner: &str) -> Command {
    let mut cmd = Command::new("chroot");
    cmd.arg(root)
        .args(["/usr/bin/env", "-i"])
        .arg("HOME=/root")
        .arg(format!(
            "PATH=/{CARGO_BIN_IN_ROOT}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        ))
        .arg(format!("RUSTUP_HOME=/{RUSTUP_IN_ROOT}"))
        .arg("CARGO_HOME=/root/.cargo")
        .arg("CARGO_TERM_COLOR=never")
        .arg("DEBIAN_FRONTEND=noninteractive")
        .arg("LANG=C.UTF-8")
        .arg("CI=true")
        // Each serving framework's venv (about 10 GB) goes once its tests ran: the clean root
        // holds one at a time (see `serving.rs`).
        .arg("XFER_DROP_SERVING_VENVS=1")
        .args(["/bin/bash", "-c", inner])
        .stdin(Stdio::null());
    // Its own process group, so an interrupt can stop everything it started (qemu included).
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    cmd
}

pub(crate) fn fresh() -> Result {
    if !quiet("id", &["-u"]) || capture("id", &["-u"])? != "0" {
        return Err("xtask fresh needs root (debootstrap, mount, chroot)".into());
    }
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
            .map_err(|e| format!("cannot handle interrupts: {e}"))?;
    }
    let cache = cache_dir();
    let runs = cache.join("runs");
    std::fs::create_dir_all(&runs).map_err(|e| format!("{}: {e}", runs.display()))?;
    clean_stale_runs(&runs)?;
    let base = base_root(&cache)?;
    let started = Instant::now();
    let root = RunRoot::prepare(&base, &runs, &cache)?;
    let head = root.clone_head()?;
    eprintln!(
        "xtask fresh: running `cargo xtask test` on {head} in a clean Debian 12 root ({})",
        root.root.display()
    );
    let inner = format!("cd /{SOURCE_IN_ROOT} && cargo xtask test");
    let mut child = chroot_command(&root.root, &inner)
        .spawn()
        .map_err(|e| format!("cannot start chroot: {e}"))?;
    let deadline = Instant::now() + TEST_DEADLINE;
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            break Some(status);
        }
        if interrupted.load(Ordering::SeqCst) || Instant::now() > deadline {
            let group = format!("-{}", child.id());
            quiet("kill", &["-TERM", "--", &group]);
            std::thread::sleep(Duration::from_secs(2));
            quiet("kill", &["-KILL", "--", &group]);
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    drop(root);
    let elapsed = started.elapsed();
    match status {
        Some(s) if s.success() => {
            eprintln!("xtask fresh: passed in the clean root in {elapsed:.0?}");
            Ok(())
        }
        Some(s) => Err(format!(
            "`cargo xtask test` failed in the clean root with {s} after {elapsed:.0?}"
        )),
        None if interrupted.load(Ordering::SeqCst) => {
            Err("interrupted; the clean root was taken down".into())
        }
        None => Err(format!(
            "`cargo xtask test` did not finish within {} min in the clean root",
            TEST_DEADLINE.as_secs() / 60
        )),
    }
}
