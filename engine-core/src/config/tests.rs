//! Parsing, defaults and validation of the TOML configuration.

use super::*;

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::from_toml(text, Path::new("test.toml"))
}

#[test]
fn a_relative_plugin_path_is_taken_from_the_config_files_directory() {
    let dir = std::env::temp_dir().join(format!("xfer-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("nic.toml");
    std::fs::write(
        &file,
        "backend = \"mynic\"\nplugin = \"lib/libmynic.so\"\n[[groups]]\nnics = [\"n0\"]\n",
    )
    .unwrap();
    let config = Config::from_file(&file).unwrap();
    assert_eq!(config.plugin, Some(dir.join("lib/libmynic.so")));
    std::fs::write(
        &file,
        "backend = \"mynic\"\nplugin = \"/opt/x/libmynic.so\"\n[[groups]]\nnics = [\"n0\"]\n",
    )
    .unwrap();
    let config = Config::from_file(&file).unwrap();
    assert_eq!(config.plugin, Some(PathBuf::from("/opt/x/libmynic.so")));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_default_selects_the_mock() {
    let c = Config::default();
    assert_eq!(c.backend, "mock");
    assert_eq!(c.groups[0].nics, vec!["mock0"]);
}

#[test]
fn a_full_config_parses() {
    let c = parse(
        r#"
        backend = "verbs"
        nic_selection = { first = 1 }
        [[groups]]
        nics = ["mlx5_0", "mlx5_1"]
        worker_cpu = 3
        [timeouts]
        transfer_ms = 100
        [stripe]
        align = 64
        [worker]
        yield_when_idle = false
        [backends.verbs]
        gid_index = 3
        "#,
    )
    .unwrap();
    assert!(!c.worker.yield_when_idle);
    assert!(Config::default().worker.yield_when_idle);
    assert_eq!(c.nic_selection, NicSelection::First(1));
    assert_eq!(c.groups[0].worker_cpu, Some(3));
    assert_eq!(c.timeouts.transfer_ms, 100);
    assert_eq!(c.timeouts.expect_ms, Timeouts::default().expect_ms);
    assert_eq!(c.stripe.align, 64);
    assert_eq!(
        c.backend_options().trim(),
        "connect_ms = 3000\ngid_index = 3"
    );
}

/// Issue 56: `$XFER_SECRET_FILE` keys the backend's handshake too, when the config names
/// no secret; two different files are refused naming both; the same file twice is fine.
#[test]
fn the_secret_file_variable_reaches_the_backend_and_a_different_one_is_refused() {
    let same = |a: &Path, b: &Path| a == b;
    let env = std::ffi::OsStr::new("/run/env-secret");
    let mut c = parse("backend = \"mock\"\n[[groups]]\nnics = [\"a\"]").unwrap();
    assert_eq!(c.security.resolve(None, same), Ok(None));
    assert_eq!(c.security.resolve(Some("".as_ref()), same), Ok(None));
    let resolved = c.security.resolve(Some(env), same).unwrap();
    assert_eq!(resolved.as_deref(), Some(Path::new("/run/env-secret")));
    assert!(c
        .backend_options_with(resolved.as_deref())
        .contains("secret_file = \"/run/env-secret\""));
    c.security.secret_file = Some("/etc/xfer/secret".into());
    let err = c.security.resolve(Some(env), same).unwrap_err();
    assert!(
        err.contains("/etc/xfer/secret")
            && err.contains("/run/env-secret")
            && err.contains("XFER_SECRET_FILE"),
        "{err}"
    );
    assert_eq!(
        c.security.resolve(Some("/etc/xfer/secret".as_ref()), same),
        Ok(Some("/etc/xfer/secret".into()))
    );
    assert_eq!(
        c.security.resolve(None, same),
        Ok(Some("/etc/xfer/secret".into()))
    );
}

#[test]
fn unknown_keys_are_named_with_the_file() {
    let err = parse("backend = \"mock\"\nbogus_key = 1\n[[groups]]\nnics = [\"a\"]").unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("bogus_key") && text.contains("test.toml"),
        "{text}"
    );
    let err = parse("backend = \"mock\"\n[[groups]]\nnics = [\"a\"]\n[timeouts]\ntransfer = 1")
        .unwrap_err();
    assert!(err.to_string().contains("transfer"), "{err}");
}

/// Issue 42 §14: a config that leaves `groups` out gets what `xfer topo` would choose
/// where that is known without hardware (the mock's one NIC, libfabric's first domain);
/// elsewhere the error names the file and what to write.
#[test]
fn omitted_groups_default_where_the_choice_is_known_and_are_named_where_not() {
    let mock = Config::from_toml(
        "backend = \"mock\"\n[timeouts]\ntransfer_ms = 9",
        Path::new("a.toml"),
    )
    .unwrap();
    assert_eq!(mock.groups.len(), 1);
    assert_eq!(mock.groups[0].nics, vec!["mock0"]);
    assert_eq!(mock.timeouts.transfer_ms, 9);
    let efa = Config::from_toml("backend = \"efa\"", Path::new("b.toml")).unwrap();
    assert_eq!(efa.groups[0].nics, vec!["auto"]);
    let err = Config::from_toml("backend = \"verbs\"", Path::new("c.toml")).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("c.toml") && text.contains("[[groups]]") && text.contains("xfer topo"),
        "{text}"
    );
}

#[test]
fn inconsistent_values_are_refused() {
    for (text, needle) in [
        ("backend = \"m\"\ngroups = []", "empty"),
        (
            "backend = \"m\"\n[[groups]]\nnics = [\"a\",\"b\",\"c\",\"d\",\"e\"]",
            "1 to 4",
        ),
        (
            "backend = \"m\"\n[[groups]]\nnics = [\"a\"]\n[[groups]]\nnics = [\"b\",\"c\"]",
            "same size",
        ),
        (
            "backend = \"m\"\nnic_selection = { first = 2 }\n[[groups]]\nnics = [\"a\"]",
            "first = 2",
        ),
        (
            "backend = \"m\"\n[[groups]]\nnics = [\"a\"]\n[stripe]\nalign = 3",
            "power of two",
        ),
        (
            "backend = \"m\"\n[[groups]]\nnics = [\"a\"]\n[timeouts]\ntransfer_ms = 0",
            "at least 1 ms",
        ),
        (
            "backend = \"verbs\"\n[[groups]]\nnics = [\"a\"]\n[backends.verbs]\nconnect_ms = 5",
            "[timeouts] connect_ms",
        ),
        (
            "backend = \"m\"\n[[groups]]\nnics = [\"a\"]\n[worker]\nmax_outstanding = 0",
            "max_outstanding",
        ),
    ] {
        let err = parse(text).unwrap_err();
        assert!(err.to_string().contains(needle), "{text}: {err}");
    }
}
