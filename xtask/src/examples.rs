//! The example workloads as separate processes meeting through a rendezvous (`cargo xtask
//! examples`; `test` runs them too), and the services they meet through: the embedded one and
//! etcd, each waited for by what it says, never by a pause.

use super::*;

/// Shell that starts `xfer serve` on `listen` in the background and returns once it says it
/// listens (its ready file), failing after two minutes: a client must never find it not up
/// yet because a fixed pause was too short. The service is slowed by 3 s on purpose, so the
/// wait is exercised on every run (the clients also ride out a service that is not up yet,
/// but the harness must not depend on that).
pub(crate) fn serve_in_guest(listen: &str) -> String {
    format!(
        "{{ ready=$(mktemp -u /tmp/xfer-serve-ready.XXXXXX); \
           target/debug/xfer serve --listen {listen} --delay-listen-ms 3000 --ready-file $ready >/dev/null & \
           for i in $(seq 1200); do [ -s $ready ] && break; sleep 0.1; done; \
           [ -s $ready ] && echo \"xfer serve is up: $(cat $ready)\" || {{ echo 'xfer serve did not become ready within 120 s'; false; }}; }}"
    )
}

/// The examples as separate processes meeting through a rendezvous: through `xfer serve`
/// transfer-bench's initiator and target (shm), the KV cache (shm, tcp; over verbs the rxe
/// guest runs it) and weight sync (shm); through etcd the KV cache (shm) and MoE
/// dispatch/combine (tcp). `cargo xtask examples`; `test` runs it too.
pub(crate) fn multi_process_examples() -> Result {
    ensure_packages(PACKAGES)?;
    let bins = [
        "kv_cache",
        "rl_weight_sync",
        "moe_dispatch",
        "transfer-bench",
    ];
    // With the etcd client (its build needs protoc, from PACKAGES).
    let mut args = vec!["build", "--quiet", "-p", "examples", "--features", "etcd"];
    for bin in &bins {
        args.extend(["--bin", bin]);
    }
    args.extend(["-p", "xfer-cli", "--bin", "xfer"]);
    cargo(&args)?;
    // The backends the configs name, as the plugins the examples load: their cdylibs, built
    // by a command of their own (with `--bin` filters cargo builds only binaries, and cargo
    // test builds these crates only as rlibs: a fresh root had no libbackend_efa.so).
    build_plugins(false)?;
    example_processes(
        "transfer-bench",
        &[
            &["--mode", "target", "--block-size", "4096,65536"],
            &[
                "--mode",
                "initiator",
                "--block-size",
                "4096,65536",
                "--verify",
                "--duration",
                "0.2",
            ],
        ],
        "configs/efa-shm.toml",
        false,
    )?;
    let roles: [&[&str]; 2] = [&["--role", "decode"], &["--role", "prefill"]];
    for config in ["configs/efa-shm.toml", "configs/efa-tcp.toml"] {
        example_processes("kv_cache", &roles, config, false)?;
    }
    // The same through etcd.
    example_processes("kv_cache", &roles, "configs/efa-shm.toml", true)?;
    let three = |r: &'static str| -> [&'static str; 4] { ["--rank", r, "--world", "3"] };
    let (r1, r2, r0) = (three("1"), three("2"), three("0"));
    example_processes(
        "moe_dispatch",
        &[&r1, &r2, &r0],
        "configs/efa-tcp.toml",
        true,
    )?;
    example_processes(
        "rl_weight_sync",
        &[&r1, &r2, &r0],
        "configs/efa-shm.toml",
        false,
    )
}

/// Builds the efa and verbs backends' plugin libraries (cdylibs) in `target/debug` or
/// `target/release`.
pub(crate) fn build_plugins(release: bool) -> Result {
    let mut args = vec![
        "build",
        "--quiet",
        "-p",
        "backend-efa",
        "-p",
        "backend-verbs",
    ];
    if release {
        args.push("--release");
    }
    cargo(&args)
}

/// A rendezvous service for the multi-process examples on 127.0.0.1, stopped (and its data
/// removed) when dropped: the embedded one (`xfer serve` on a free port) or etcd (free ports,
/// a temporary data directory).
pub(crate) struct RendezvousService {
    child: std::process::Child,
    url: String,
    data: Option<std::path::PathBuf>,
}

pub(crate) fn free_port() -> Result<u16> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

impl RendezvousService {
    fn embedded() -> Result<Self> {
        let mut child = Command::new("target/debug/xfer")
            .args(["serve", "--listen", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start xfer serve: {e}"))?;
        let mut url = String::new();
        BufReader::new(child.stdout.take().expect("piped"))
            .read_line(&mut url)
            .map_err(|e| e.to_string())?;
        Ok(Self {
            child,
            url: url.trim().to_owned(),
            data: None,
        })
    }

    fn etcd() -> Result<Self> {
        let (client, peer) = (free_port()?, free_port()?);
        let data = std::env::temp_dir().join(format!("xtask-etcd-{}", std::process::id()));
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = Command::new("etcd")
            .args(["--name", "xtask", "--log-level", "error", "--data-dir"])
            .arg(&data)
            .args([
                "--listen-client-urls",
                &client_url,
                "--advertise-client-urls",
                &client_url,
            ])
            .args([
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
            ])
            .args(["--initial-cluster", &format!("xtask={peer_url}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start etcd (Debian package etcd-server): {e}"))?;
        let service = Self {
            child,
            url: format!("etcd://127.0.0.1:{client}/xtask"),
            data: Some(data),
        };
        // Ready when etcd says it is healthy (a member that listens may not have elected
        // itself leader yet), not when its port accepts.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !etcd_healthy(client) {
            if std::time::Instant::now() > deadline {
                return Err(format!("etcd on {client_url} was not healthy within 60 s"));
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        Ok(service)
    }
}

/// Whether etcd on 127.0.0.1:`port` answers its `/health` endpoint with health "true".
pub(crate) fn etcd_healthy(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut conn) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = conn.set_read_timeout(Some(std::time::Duration::from_secs(2)));
    let mut answer = String::new();
    conn.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .and_then(|()| conn.read_to_string(&mut answer))
        .is_ok()
        && is_healthy(&answer)
}

/// Whether an HTTP answer from etcd's `/health` says healthy (`{"health":"true",…}`).
pub(crate) fn is_healthy(answer: &str) -> bool {
    answer.starts_with("HTTP/1.") && answer.contains("200") && answer.contains(r#""health":"true""#)
}

impl Drop for RendezvousService {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(d) = &self.data {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// An example as several processes that find each other through a rendezvous (`etcd`, or
/// the embedded service), with backend `config`: one process per argument list, the last run
/// in the foreground once the others are started.
pub(crate) fn example_processes(
    example: &str,
    members: &[&[&str]],
    config: &str,
    etcd: bool,
) -> Result {
    let service = if etcd {
        RendezvousService::etcd()?
    } else {
        RendezvousService::embedded()?
    };
    let url = service.url.clone();
    let plugins = std::env::current_dir()
        .map_err(|e| e.to_string())?
        .join("target/debug");
    let member = |args: &[&str]| {
        let mut c = Command::new(format!("target/debug/{example}"));
        c.args(args)
            .args(["--rendezvous", &url, "--config", config])
            .env("XFER_PLUGIN_PATH", &plugins);
        c
    };
    eprintln!(
        "xtask: {example} as {} processes over {config}, rendezvous {url}",
        members.len()
    );
    let result = (|| {
        let (last, others) = members.split_last().ok_or("no members")?;
        let mut background = Vec::new();
        for args in others {
            background.push(
                member(args)
                    .spawn()
                    .map_err(|e| format!("cannot start {example}: {e}"))?,
            );
        }
        let mut failed = Vec::new();
        let status = member(last).status().map_err(|e| e.to_string())?;
        if !status.success() {
            failed.push(format!("{last:?}: {status}"));
        }
        for (args, mut child) in others.iter().zip(background) {
            let status = child.wait().map_err(|e| e.to_string())?;
            if !status.success() {
                failed.push(format!("{args:?}: {status}"));
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(format!("{example} over {config}: {}", failed.join(", ")))
        }
    })();
    drop(service);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etcd_health_is_read_from_its_answer() {
        let ok = "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n{\"health\":\"true\",\"reason\":\"\"}";
        assert!(is_healthy(ok));
        let no_leader = "HTTP/1.0 503 Service Unavailable\r\n\r\n{\"health\":\"false\",\"reason\":\"RAFT NO LEADER\"}";
        assert!(!is_healthy(no_leader));
        assert!(!is_healthy(""));
    }

    /// Issue 23: a service started in the background is waited for by what it says, never
    /// by a fixed pause; this keeps the pattern from coming back to the harness, CI or the
    /// examples.
    #[test]
    fn no_fixed_pause_follows_a_background_start() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap();
        let mut files = vec![root.join(".ci/run")];
        for dir in [
            "xtask/src",
            "examples/src",
            "examples/src/bin",
            "examples/src/bin/transfer-bench",
        ] {
            for entry in std::fs::read_dir(root.join(dir)).unwrap() {
                let path = entry.unwrap().path();
                if path.extension().is_some_and(|e| e == "rs" || e == "sh") {
                    files.push(path);
                }
            }
        }
        let needle = ["&", "sleep"];
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            for (n, line) in text.lines().enumerate() {
                let squeezed: String = line.split_whitespace().collect::<Vec<_>>().join(" ");
                assert!(
                    !squeezed.contains(&needle.join(" ")),
                    "{}:{}: a background start followed by a fixed pause: {line}",
                    file.display(),
                    n + 1
                );
            }
        }
        let script = serve_in_guest("127.0.0.1:7421");
        assert!(script.contains("--ready-file $ready") && script.contains("[ -s $ready ]"));
    }
}
