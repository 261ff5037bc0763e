//! Plugin discovery and the ABI check: wrong versions, non-plugins and unknown names are
//! typed errors that name the library and the versions.

mod common;

use engine_core::plugin::{find_backend, PluginError};
use engine_core::{Error, TransferEngine};

#[test]
fn a_plugin_with_the_wrong_abi_version_is_refused_with_both_versions() {
    let path = common::built_library("plugin_fixture_wrong_abi");
    let err = find_backend("mock", Some(&path)).unwrap_err();
    match &err {
        PluginError::AbiMismatch {
            path: p,
            found,
            expected,
            ..
        } => {
            assert_eq!(
                (p, *found, *expected),
                (&path, 999, engine_core::plugin::abi::ABI_VERSION)
            );
        }
        other => panic!("expected AbiMismatch, got {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("999") && text.contains("plugin_fixture_wrong_abi"),
        "{text}"
    );

    // Through the engine, the same error arrives typed.
    let mut config = common::mock_config(1, "");
    config.plugin = Some(path);
    assert!(matches!(
        TransferEngine::open(&config),
        Err(Error::Plugin(PluginError::AbiMismatch { .. }))
    ));
}

#[test]
fn a_library_without_the_entry_symbol_is_not_a_plugin() {
    let not_a_plugin = std::path::Path::new("/lib/x86_64-linux-gnu/libm.so.6");
    if !not_a_plugin.exists() {
        return; // another distribution layout; the missing-file case below still runs
    }
    let err = find_backend("mock", Some(not_a_plugin)).unwrap_err();
    assert!(matches!(err, PluginError::MissingEntry { .. }), "{err:?}");
    let err = find_backend("mock", Some(std::path::Path::new("/nonexistent/libx.so"))).unwrap_err();
    assert!(matches!(err, PluginError::Load { .. }), "{err:?}");
}

/// The dynamic loader's own words travel in the error (a vendor needs "undefined symbol" or
/// "invalid ELF header", not "dlopen failed").
#[test]
fn load_errors_keep_the_dynamic_loaders_text() {
    let missing = find_backend("mock", Some(std::path::Path::new("/nonexistent/libx.so")))
        .unwrap_err()
        .to_string();
    assert!(
        missing.contains("/nonexistent/libx.so") && missing.contains("No such file"),
        "{missing}"
    );
    let not_elf = std::env::temp_dir().join(format!("xfer-not-elf-{}.so", std::process::id()));
    std::fs::write(&not_elf, b"this is text, not a shared object").unwrap();
    let text = find_backend("mock", Some(&not_elf))
        .unwrap_err()
        .to_string();
    std::fs::remove_file(&not_elf).unwrap();
    assert!(
        text.contains("invalid ELF header") || text.contains("file too short"),
        "{text}"
    );
    let no_entry = find_backend("mock", Some(&common::built_library("backend_mock")))
        .map(|_| ())
        .and_then(|()| {
            find_backend("nosuch", Some(&common::built_library("backend_mock"))).map(|_| ())
        })
        .unwrap_err()
        .to_string();
    assert!(no_entry.contains("undefined symbol"), "{no_entry}");
}

#[test]
fn a_plugin_serving_another_backend_is_refused() {
    // The mock's library exports `xfer_plugin_entry_mock` only.
    let err = find_backend("verbs", Some(&common::built_library("backend_mock"))).unwrap_err();
    assert!(
        matches!(&err, PluginError::MissingEntry { backend, .. } if backend == "verbs"),
        "{err:?}"
    );
    assert!(err.to_string().contains("xfer_plugin_entry_verbs"), "{err}");
}

#[test]
fn plugins_are_found_on_the_search_path_and_unknown_names_list_what_exists() {
    let dir = std::env::temp_dir().join(format!("xfer-plugin-path-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        common::built_library("plugin_fixture_wrong_abi"),
        dir.join("libxfer_fancy.so"),
    )
    .unwrap();
    // This test binary's only user of the variable.
    std::env::set_var(engine_core::plugin::PLUGIN_PATH_ENV, &dir);
    let found = find_backend("fancy", None).unwrap_err();
    assert!(
        matches!(found, PluginError::AbiMismatch { .. }),
        "found on the search path: {found:?}"
    );
    backend_mock::link();
    let err = find_backend("nonesuch", None).unwrap_err();
    match &err {
        PluginError::UnknownBackend {
            name,
            builtin,
            searched,
        } => {
            assert_eq!(name, "nonesuch");
            assert!(builtin.contains(&"mock".to_string()), "{builtin:?}");
            assert_eq!(searched, &vec![dir.clone()]);
        }
        other => panic!("{other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A plugin built against ABI version 1 (before reads were appended) still loads on this
/// engine and works; the engine knows it lacks reads and refuses them naming the backend.
#[test]
fn a_plugin_built_against_an_older_abi_loads_and_its_missing_entries_are_refused() {
    let path = common::built_library("plugin_fixture_old_abi");
    let plugin = engine_core::plugin::LoadedPlugin::load(&path, "oldmock").unwrap();
    assert_eq!(plugin.abi_version(), 1);
    let mut config = common::mock_config(1, "");
    config.backend = "oldmock".into();
    config.plugin = Some(path);
    let (a, b) = (
        std::sync::Arc::new(TransferEngine::open(&config).unwrap()),
        std::sync::Arc::new(TransferEngine::open(&config).unwrap()),
    );
    let src = xfer_conformance::buffer(&a, 4096, xfer_conformance::pattern(1));
    let dst = xfer_conformance::buffer(&b, 4096, |_| 0);
    let f = engine_core::DoneFlag::new();
    a.submit_single_write(4096, Some(1), (src.mr(), 0), (dst.desc(), 0), f.clone())
        .unwrap();
    f.wait(std::time::Duration::from_secs(20)).unwrap();
    assert!(dst.to_vec() == src.to_vec());
    let r = a.submit_single_read(
        64,
        (dst.mr(), 0),
        (src.desc(), 0),
        engine_core::DoneFlag::new(),
    );
    assert!(
        matches!(&r, Err(Error::NotAvailable(m)) if m.contains("oldmock")),
        "{r:?}"
    );
}

/// A plugin that panics is contained by its shim; the panic's text comes back, the Domain is
/// not used again, and everything finishes once with the reason.
#[test]
fn a_panicking_plugin_fails_its_engine_with_the_panic_text() {
    let mut config = common::mock_config(1, "[backends.mock]\npanic_on_post = 2\n");
    config.plugin = Some(common::built_library("backend_mock"));
    let (a, b) = (
        std::sync::Arc::new(TransferEngine::open(&config).unwrap()),
        std::sync::Arc::new(TransferEngine::open(&config).unwrap()),
    );
    let src = xfer_conformance::buffer(&a, 64, xfer_conformance::pattern(1));
    let dst = xfer_conformance::buffer(&b, 64, |_| 0);
    let done = engine_core::DoneCounter::new();
    for _ in 0..2 {
        let _ = a.submit_single_write(8, None, (src.mr(), 0), (dst.desc(), 0), done.clone());
    }
    let _ = done.wait_for(2, std::time::Duration::from_secs(20));
    assert_eq!(done.finished(), 2);
    let e = done.first_error().expect("the panicking post fails");
    assert!(e.to_string().contains("panic_on_post"), "{e}");
    let r = a.submit_single_write(8, None, (src.mr(), 0), (dst.desc(), 0), done.clone());
    assert!(
        matches!(&r, Err(Error::WorkerFailed(m)) if m.contains("the plugin panicked")),
        "{r:?}"
    );
}

/// Issue 25 §7: after a plugin's post failed fatally (a panic its shim contained), the
/// engine posts nothing more to it — not the rest of the batch, not what was queued. The
/// worker is held in a slow registration so that twenty sends reach it in one batch; with a
/// send queue one deep the first is posted and the rest wait, and the second post panics
/// when the queue is flushed. The mock fails any post after its panic with "after its fatal
/// error".
#[test]
fn a_plugin_is_not_used_again_after_a_fatal_error() {
    let mut faulty = common::mock_config(
        1,
        "[timeouts]\ncontrol_ms = 50\n[backends.mock]\npanic_on_post = 2\nqueue_depth = 1\ndelay_us = 1000\nregister_delay_us = 300000\n",
    );
    faulty.plugin = Some(common::built_library("backend_mock"));
    let mut plain = common::mock_config(1, "");
    plain.plugin = Some(common::built_library("backend_mock"));
    let a = std::sync::Arc::new(TransferEngine::open(&faulty).unwrap());
    let b = std::sync::Arc::new(TransferEngine::open(&plain).unwrap());
    b.submit_recvs(64, 64, |_| {}).unwrap();
    let mut memory = vec![0u8; 64];
    // SAFETY: `memory` outlives the engine (dropped below, before it).
    let slow = unsafe { a.reg_mr(memory.as_mut_ptr(), memory.len(), engine_core::Device::Host) };
    // A timeout, unless this thread was descheduled past the registration itself (a loaded
    // clean-root run once got Ok: crossbeam returns an answer that is there when its wait
    // ends). Either way the sends below reach a worker that is busy or about to be.
    assert!(matches!(slow, Err(Error::Timeout(_)) | Ok(_)), "{slow:?}");
    let flags: Vec<_> = (0..20)
        .map(|_| {
            let f = engine_core::DoneFlag::new();
            a.submit_send(&b.main_address(), b"x", f.clone())
                .map(|()| f)
        })
        .collect();
    for f in flags.into_iter().flatten() {
        let r = f.wait(std::time::Duration::from_secs(20));
        if let Err(e) = r {
            assert!(
                !e.to_string().contains("after its fatal error"),
                "the engine posted to a Domain after its fatal error: {e}"
            );
        }
    }
    drop(a);
    drop(memory);
}

/// ABI 3: a plugin's declared capabilities cross the boundary, and the engine refuses what
/// they rule out — before posting, with the backend named — instead of letting the NIC fail
/// it (the mock fails its whole Domain if the engine ever posts such a request).
#[test]
fn the_engine_refuses_what_a_plugins_capabilities_rule_out() {
    let mut config = common::mock_config(
        1,
        "[backends.mock]\nmax_write_size = 1024\nmax_message_size = 100\nno_zero_byte_writes = true\nno_immediates = true\nneeds_receiver_polling = true\n",
    );
    config.plugin = Some(common::built_library("backend_mock"));
    let (a, b) = (
        std::sync::Arc::new(TransferEngine::open(&config).unwrap()),
        std::sync::Arc::new(TransferEngine::open(&config).unwrap()),
    );
    let caps = a.capabilities()[0];
    assert_eq!(caps.max_write_size, Some(1024));
    assert_eq!(caps.max_message_size, Some(100));
    assert!(!caps.zero_byte_writes && !caps.immediates && caps.needs_receiver_polling);
    assert!(caps.host_memory && caps.cuda_memory);

    let src = xfer_conformance::buffer(&a, 4096, xfer_conformance::pattern(1));
    let dst = xfer_conformance::buffer(&b, 4096, |_| 0);
    let refused = |len: u64, imm: Option<u32>| {
        let f = engine_core::DoneFlag::new();
        a.submit_single_write(len, imm, (src.mr(), 0), (dst.desc(), 0), f.clone())
            .unwrap();
        f.wait(std::time::Duration::from_secs(20)).unwrap_err()
    };
    for (len, imm, says) in [
        (2048, None, "limit of 1024"),
        (0, None, "zero-byte"),
        (8, Some(1), "immediate"),
    ] {
        let e = refused(len, imm);
        assert!(
            matches!(&e, Error::Refused { backend, source } if source.message.contains(says) && backend == "mock"),
            "{len} bytes, imm {imm:?}: {e}"
        );
    }
    // What the limits allow still works (the Domain was never failed by a refused post).
    let f = engine_core::DoneFlag::new();
    a.submit_single_write(1024, None, (src.mr(), 0), (dst.desc(), 0), f.clone())
        .unwrap();
    f.wait(std::time::Duration::from_secs(20)).unwrap();
    assert_eq!(dst.to_vec()[..1024], src.to_vec()[..1024]);
    let f = engine_core::DoneFlag::new();
    a.submit_send(&b.main_address(), &[7; 101], f.clone())
        .unwrap();
    let e = f.wait(std::time::Duration::from_secs(20)).unwrap_err();
    assert!(
        matches!(&e, Error::Refused { source, .. } if source.message.contains("101 bytes")),
        "{e}"
    );
}

/// A plugin built against ABI 2 (before capabilities and logging were appended) loads on this
/// engine, is assumed to have the default capabilities, and works.
#[test]
fn a_version_2_plugin_loads_with_default_capabilities() {
    let path = common::built_library("plugin_fixture_old_abi");
    let plugin = engine_core::plugin::LoadedPlugin::load(&path, "v2mock").unwrap();
    assert_eq!(plugin.abi_version(), 2);
    let mut config = common::mock_config(1, "[backends.v2mock]\nmax_write_size = 16\n");
    config.backend = "v2mock".into();
    config.plugin = Some(path);
    let (a, b) = (
        std::sync::Arc::new(TransferEngine::open(&config).unwrap()),
        std::sync::Arc::new(TransferEngine::open(&config).unwrap()),
    );
    assert_eq!(
        a.capabilities()[0],
        engine_core::domain::Capabilities {
            // ABI 2 appended `post_read`: its presence is the plugin's reads.
            reads: true,
            ..engine_core::domain::Capabilities::default()
        },
        "a version-2 table has no capabilities entry: the engine must not read past it"
    );
    let src = xfer_conformance::buffer(&a, 64, xfer_conformance::pattern(2));
    let dst = xfer_conformance::buffer(&b, 64, |_| 0);
    let f = engine_core::DoneFlag::new();
    a.submit_single_write(8, None, (src.mr(), 0), (dst.desc(), 0), f.clone())
        .unwrap();
    f.wait(std::time::Duration::from_secs(20)).unwrap();
    assert_eq!(dst.to_vec()[..8], src.to_vec()[..8]);
}

/// Issue 24 §7: a mistyped option in a plugin's table is refused when the engine opens, as a
/// config error naming the key (ABI 4's options check), before any NIC opens; a version-3
/// plugin, without the check, still refuses it, when its NIC opens.
#[test]
fn a_mistyped_plugin_option_is_a_config_error_naming_the_key() {
    let path = common::built_library("plugin_fixture_old_abi");
    let plugin = engine_core::plugin::LoadedPlugin::load(&path, "checkedmock").unwrap();
    assert_eq!(plugin.abi_version(), engine_core::plugin::abi::ABI_VERSION);
    let mut config = common::mock_config(1, "[backends.checkedmock]\nmax_write_sise = 16\n");
    config.backend = "checkedmock".into();
    config.plugin = Some(path.clone());
    match TransferEngine::open(&config) {
        Err(engine_core::Error::Config(e))
            if e.to_string().contains("[backends.checkedmock]")
                && e.to_string().contains("max_write_sise") => {}
        other => panic!("expected a config error naming the key, got {other:?}"),
    }
    let mut good = common::mock_config(1, "[backends.checkedmock]\nmax_write_size = 16\n");
    good.backend = "checkedmock".into();
    good.plugin = Some(path.clone());
    TransferEngine::open(&good).expect("a valid option passes the check");
    let mut old = common::mock_config(1, "[backends.v3mock]\nmax_write_sise = 16\n");
    old.backend = "v3mock".into();
    old.plugin = Some(path);
    match TransferEngine::open(&old) {
        Err(e)
            if !matches!(e, engine_core::Error::Config(_))
                && e.to_string().contains("max_write_sise") => {}
        other => panic!("expected the NIC's refusal naming the key, got {other:?}"),
    }
}

/// Backend `backend` of the fixture library at `path` (checked to speak ABI `version`), an
/// inline in-order mock with a queue of 3 per connection.
fn inline_fixture_config(
    path: &std::path::Path,
    backend: &str,
    version: u32,
) -> engine_core::Config {
    let plugin = engine_core::plugin::LoadedPlugin::load(path, backend).unwrap();
    assert_eq!(plugin.abi_version(), version);
    let mut config = common::mock_config(
        1,
        &format!("[backends.{backend}]\ninline = true\nreorder = false\njitter_us = 0\nqueue_depth = 3\n"),
    );
    config.backend = backend.into();
    config.plugin = Some(path.to_owned());
    config
}

/// ABI 5: a paged write reaches a current plugin as batches of pages (one call each) and a
/// version-4 plugin page by page; either way every page lands once, with its immediate, also
/// when the plugin's queue (3 deep) cuts every batch short, and a batch the NIC refuses (a
/// revoked key) fails its transfer once.
#[test]
fn paged_writes_reach_plugins_in_batches_or_page_by_page_by_their_abi() {
    use engine_core::{DoneFlag, TransferShape};
    let path = common::built_library("plugin_fixture_old_abi");
    for (backend, version) in [
        ("checkedmock", engine_core::plugin::abi::ABI_VERSION),
        ("v4mock", 4),
    ] {
        let config = inline_fixture_config(&path, backend, version);
        let (a, b) = (
            std::sync::Arc::new(TransferEngine::open(&config).unwrap()),
            std::sync::Arc::new(TransferEngine::open(&config).unwrap()),
        );
        let (n, page) = (500u32, 64u64);
        let len = (u64::from(n) * page) as usize;
        let src = xfer_conformance::buffer(&a, len, xfer_conformance::pattern(3));
        let dst = xfer_conformance::buffer(&b, len, |_| 0);
        let (from, to) = xfer_conformance::scattered_pages(n, page);
        let done = DoneFlag::new();
        a.submit_paged_writes(
            page,
            Some(4),
            (src.mr(), &from),
            (dst.desc(), &to),
            done.clone(),
        )
        .unwrap();
        done.wait(std::time::Duration::from_secs(20)).unwrap();
        xfer_conformance::assert_pages_landed(
            &src.to_vec(),
            &dst.to_vec(),
            (&from, &to),
            page,
            &[],
        );
        let arrivals = b.expected_arrivals(TransferShape::Paged {
            page_len: page,
            pages: u64::from(n),
        });
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while b.imm_count(4) < arrivals {
            assert!(
                std::time::Instant::now() < deadline,
                "{backend}: immediates missing"
            );
            std::thread::yield_now();
        }
        assert_eq!(a.stats().unwrap().stale_completions, 0, "{backend}");
        // A revoked destination: the transfer fails once, naming the key.
        let desc = dst.desc().clone();
        drop(dst);
        let failed = DoneFlag::new();
        a.submit_paged_writes(page, None, (src.mr(), &from), (&desc, &to), failed.clone())
            .unwrap();
        match failed.wait(std::time::Duration::from_secs(20)) {
            Err(Error::RemoteAccess(why)) => {
                assert!(why.message.contains("rkey"), "{backend}: {why}")
            }
            other => panic!("{backend}: expected the NIC's refusal, got {other:?}"),
        }
        assert_eq!(a.stats().unwrap().stale_completions, 0, "{backend}");
    }
}

/// ABI 6: a burst of single writes (to two peers in turns of 8, each peer's at falling
/// offsets, with reads among them) reaches a current plugin as lists of writes (one call each, a read going
/// alone) and a version-5 plugin write by write; either way, through queues of 3 that cut
/// lists short, every write lands once with its immediate and every read brings its bytes.
#[test]
fn bursts_reach_plugins_as_lists_or_one_by_one_by_their_abi() {
    use engine_core::{DoneCounter, HostBuffer, RemoteAccess};
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(20);
    let path = common::built_library("plugin_fixture_old_abi");
    for (backend, version) in [
        ("checkedmock", engine_core::plugin::abi::ABI_VERSION),
        ("v5mock", 5),
    ] {
        let config = inline_fixture_config(&path, backend, version);
        let open = || std::sync::Arc::new(TransferEngine::open(&config).unwrap());
        let (a, peers) = (open(), [open(), open()]);
        let (n, len) = (400u64, 16u64);
        let size = (n * len) as usize;
        let src = xfer_conformance::buffer(&a, size, xfer_conformance::pattern(5));
        let back = HostBuffer::new(&a, size).unwrap();
        let dst = peers.each_ref().map(|p| HostBuffer::new(p, size).unwrap());
        // What the reads fetch: a readable region per peer that no write touches.
        let readable = [0, 1].map(|p| {
            let pattern = move |i: usize| (i * 3 + p * 101 + 1) as u8;
            HostBuffer::with_access(&peers[p], size, pattern, RemoteAccess::READ).unwrap()
        });
        let is_read = |i: u64| i % 7 == 3;
        let (wrote, read) = (DoneCounter::new(), DoneCounter::new());
        for i in 0..n {
            let (to, at) = ((i / 8 % 2) as usize, i * len);
            if is_read(i) {
                a.submit_single_read(
                    len,
                    (back.mr(), at),
                    (readable[to].desc(), at),
                    read.clone(),
                )
                .unwrap();
            } else {
                let slot = (n - 1 - i) * len;
                a.submit_single_write(
                    len,
                    Some(20 + to as u32),
                    (src.mr(), at),
                    (dst[to].desc(), slot),
                    wrote.clone(),
                )
                .unwrap();
            }
        }
        let reads = (0..n).filter(|&i| is_read(i)).count() as u64;
        wrote.wait_for(n - reads, WAIT).unwrap();
        read.wait_for(reads, WAIT).unwrap();
        let (from, fetched) = (src.to_vec(), back.to_vec());
        let to = dst.each_ref().map(|d| d.to_vec());
        let there = readable.each_ref().map(|r| r.to_vec());
        let l = len as usize;
        for i in 0..n as usize {
            let (peer, at) = (i / 8 % 2, i * l);
            if is_read(i as u64) {
                assert_eq!(
                    &fetched[at..at + l],
                    &there[peer][at..at + l],
                    "{backend}: read {i}"
                );
            } else {
                let slot = (n as usize - 1 - i) * l;
                assert_eq!(
                    &to[peer][slot..slot + l],
                    &from[at..at + l],
                    "{backend}: write {i}"
                );
            }
        }
        for (p, peer) in peers.iter().enumerate() {
            let expected = (0..n)
                .filter(|&i| !is_read(i) && (i / 8 % 2) as usize == p)
                .count() as u64;
            let deadline = std::time::Instant::now() + WAIT;
            while peer.imm_count(20 + p as u32) < expected {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{backend}: immediates missing"
                );
                std::thread::yield_now();
            }
            assert_eq!(
                peer.imm_count(20 + p as u32),
                expected,
                "{backend}: counted once"
            );
        }
        assert_eq!(a.stats().unwrap().stale_completions, 0, "{backend}");
    }
}

/// ABI 7: a plugin names a message's sender, and the receive handler is told it; a plugin
/// built against ABI 6 cannot, and the handler is told nothing (never a guess).
#[test]
fn a_message_names_its_sender_through_plugins_of_abi_7_and_none_before() {
    let path = common::built_library("plugin_fixture_old_abi");
    for (backend, version, names) in [
        ("checkedmock", engine_core::plugin::abi::ABI_VERSION, true),
        ("v5mock", 5, false),
    ] {
        let config = inline_fixture_config(&path, backend, version);
        let (a, b) = (
            TransferEngine::open(&config).unwrap(),
            TransferEngine::open(&config).unwrap(),
        );
        let (tx, rx) = std::sync::mpsc::channel();
        let tx = std::sync::Mutex::new(tx);
        b.submit_recvs_with_sender(
            16,
            2,
            move |m: &[u8], from: Option<&engine_core::NetAddr>| {
                let _ = tx.lock().unwrap().send((m.to_vec(), from.cloned()));
            },
        )
        .unwrap();
        let sent = engine_core::DoneFlag::new();
        a.submit_send(&b.main_address(), b"hi", sent.clone())
            .unwrap();
        sent.wait(std::time::Duration::from_secs(10)).unwrap();
        let (data, from) = rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
        assert_eq!(data, b"hi");
        assert_eq!(from, names.then(|| a.main_address()), "{backend}");
    }
}
