//! libfabric 2.x, built from Debian 13's upstream tarball, so the EFA backend is tested against
//! the library generation AWS ships (`/opt/amazon/efa`) as well as Debian 12's 1.17.
//!
//! The tarball comes through apt with a private source list (a `deb-src` entry for trixie;
//! the machine's own apt configuration is not touched): `apt-get source --download-only`
//! fetches the `.orig.tar.xz` even where the `.dsc` is missing from the mirror. It is a git
//! snapshot, so `./autogen.sh` runs before `configure` (autoconf, automake, libtool). Only the
//! providers the tests use are built: shm, tcp, rxm, and efa (it compiles against rdma-core's
//! headers without a device). The result is kept in `target/libfabric-<version>/install` and
//! rebuilt only when missing.

use std::path::{Path, PathBuf};

use crate::{ensure_packages, run, sh_in, Result};

/// The upstream version Debian 13 carries.
pub(crate) const VERSION: &str = "2.1.0";

/// What building it needs beyond the project's packages.
const PACKAGES: &[&str] = &["autoconf", "automake", "libtool", "xz-utils"];

/// Downloads the upstream tarball into `dir` with a private apt state; returns its path.
fn download(dir: &Path) -> Result<PathBuf> {
    let tarball = dir.join(format!("libfabric_{VERSION}.orig.tar.xz"));
    if tarball.is_file() {
        return Ok(tarball);
    }
    let apt = dir.join("apt");
    for sub in ["lists/partial", "cache/archives/partial"] {
        std::fs::create_dir_all(apt.join(sub)).map_err(|e| e.to_string())?;
    }
    let sources = apt.join("sources.list");
    std::fs::write(
        &sources,
        "deb-src [trusted=yes] http://deb.debian.org/debian trixie main\n",
    )
    .map_err(|e| e.to_string())?;
    let options = [
        format!("-oDir::Etc::SourceList={}", sources.display()),
        "-oDir::Etc::SourceParts=/dev/null".into(),
        format!("-oDir::State::Lists={}", apt.join("lists").display()),
        format!("-oDir::Cache={}", apt.join("cache").display()),
        // Downloads run as root here: the sandbox user could not write into `dir`.
        "-oAPT::Sandbox::User=root".into(),
    ];
    let opts = options.join(" ");
    sh_in(dir, &format!("apt-get -q {opts} update"))?;
    // The .dsc and Debian diff may be gone from the mirror (404): only the tarball matters.
    let _ = sh_in(dir, &format!("apt-get -q {opts} source --download-only libfabric={VERSION}-1.1 || apt-get -q {opts} source --download-only libfabric"));
    if tarball.is_file() {
        Ok(tarball)
    } else {
        Err(format!(
            "apt did not download {} (is Debian 13's libfabric still {VERSION}?)",
            tarball.display()
        ))
    }
}

/// Builds libfabric 2.x once (kept in `target/libfabric-<version>/install`) and returns that
/// prefix, for `LIBFABRIC_DIR`.
pub(crate) fn ensure() -> Result<PathBuf> {
    let dir = std::env::current_dir()
        .map_err(|e| e.to_string())?
        .join(format!("target/libfabric-{VERSION}"));
    let install = dir.join("install");
    if install.join("lib/libfabric.so.1").exists() {
        return Ok(install);
    }
    ensure_packages(PACKAGES)?;
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let tarball = download(&dir)?;
    let build = dir.join("build");
    let _ = std::fs::remove_dir_all(&build);
    std::fs::create_dir_all(&build).map_err(|e| e.to_string())?;
    run(
        "tar",
        &[
            "-C",
            &build.display().to_string(),
            "-xf",
            &tarball.display().to_string(),
        ],
    )?;
    let source = build.join(format!("libfabric-{VERSION}"));
    sh_in(
        &source,
        &format!(
            "./autogen.sh >autogen.log 2>&1 || {{ tail -20 autogen.log; exit 1; }}
             ./configure --prefix={} --enable-only --enable-shm --enable-tcp --enable-rxm \
                 --enable-efa --disable-static >configure.log 2>&1 || {{ tail -40 configure.log; exit 1; }}
             make -j\"$(nproc)\" >make.log 2>&1 || {{ tail -40 make.log; exit 1; }}
             make install >install.log 2>&1 || {{ tail -20 install.log; exit 1; }}",
            install.display()
        ),
    )?;
    Ok(install)
}
