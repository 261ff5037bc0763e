//! The rule for a cluster secret, shared by everything that reads `secret_file` (the
//! rendezvous and the backends the path is handed to), so a file one accepts the others do too.

use std::path::Path;

use hmac::{KeyInit, Mac};

/// What a key derived from the cluster secret is for: each use has its own key, so a MAC
/// made for one can never be taken for the other's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyUse {
    /// The rendezvous service's challenge proofs.
    Rendezvous,
    /// A backend's connection handshake datagrams (verbs).
    Handshake,
    /// A backend's messages where no handshake binds them to a connection (libfabric).
    Messages,
}

impl KeyUse {
    fn label(self) -> &'static [u8] {
        match self {
            Self::Rendezvous => b"xfer key: rendezvous proofs v1",
            Self::Handshake => b"xfer key: handshake datagrams v1",
            Self::Messages => b"xfer key: backend messages v1",
        }
    }
}

/// The key for `key_use` derived from `secret`: HMAC-SHA256 keyed by the secret over the
/// use's label (HKDF's extract-then-expand collapses to this for one 32-byte key from a
/// uniformly random secret; a secret of any other kind gets no weaker than its own entropy).
pub fn derive_key(secret: &[u8], key_use: KeyUse) -> [u8; 32] {
    let mut mac = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(secret)
        .expect("HMAC takes a key of any length");
    mac.update(key_use.label());
    mac.finalize().into_bytes().into()
}

/// Fewest bytes a secret may have: a shorter one could be guessed offline from one recorded
/// proof or handshake MAC (both are HMACs keyed by the secret).
pub const MIN_SECRET_LEN: usize = 16;

/// Why `secret` is too short to use, if it is (a sentence for an error naming the file).
pub fn too_short(secret: &[u8]) -> Option<String> {
    let n = secret.len();
    (n < MIN_SECRET_LEN).then(|| {
        format!(
            "the secret is {n} byte{}; it must be at least {MIN_SECRET_LEN} (make one with \
             `(umask 077; head -c 32 /dev/urandom > FILE)`)",
            if n == 1 { "" } else { "s" }
        )
    })
}

/// Reads a cluster secret from `path`: refused if the file is unreadable, empty, too short,
/// or open to other users (any group or other permission bit, as ssh refuses a private key:
/// whoever can read it can join the cluster). The error is a sentence for one that names
/// the file.
pub fn read(path: &Path) -> Result<Vec<u8>, String> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path)
            .map_err(|e| e.to_string())?
            .permissions()
            .mode();
        if mode & 0o077 != 0 {
            return Err(format!(
                "the file's mode is {:o}: other users may read it, and whoever reads it can \
                 join the cluster (`chmod 600` it, or `defaultMode: 0400` on a Kubernetes \
                 secret volume)",
                mode & 0o777
            ));
        }
    }
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    if bytes.is_empty() {
        return Err("the file is empty".into());
    }
    too_short(&bytes).map_or(Ok(bytes), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 42 §10: the rendezvous and the handshake never share a key, and each key is
    /// the secret's alone.
    #[test]
    fn each_use_gets_its_own_key() {
        let secret = b"thirty-two bytes of cluster key.";
        let (r, h) = (
            derive_key(secret, KeyUse::Rendezvous),
            derive_key(secret, KeyUse::Handshake),
        );
        assert_ne!(r, h);
        let m = derive_key(secret, KeyUse::Messages);
        assert!(m != r && m != h);
        assert_ne!(&r[..], &secret[..]);
        assert_eq!(r, derive_key(secret, KeyUse::Rendezvous));
        assert_ne!(
            r,
            derive_key(b"another cluster's secret, 32 b.", KeyUse::Rendezvous)
        );
    }

    fn file(name: &str, bytes: &[u8], mode: u32) -> std::path::PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = std::env::temp_dir().join(format!("xfer-secret-{name}-{}", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    /// Issue 42 §10: a secret file others may read is refused, naming its mode and the fix;
    /// one only its owner may read is taken; empty, short and missing files are refused.
    #[test]
    fn a_secret_file_open_to_other_users_is_refused() {
        let secret = b"thirty-two bytes of cluster key.";
        for mode in [0o644, 0o640, 0o604, 0o660, 0o602] {
            let path = file("open", secret, mode);
            let e = read(&path).unwrap_err();
            std::fs::remove_file(&path).unwrap();
            assert!(
                e.contains(&format!("{mode:o}")) && e.contains("chmod 600"),
                "mode {mode:o}: {e}"
            );
        }
        for mode in [0o600, 0o400] {
            let path = file("private", secret, mode);
            assert_eq!(read(&path).as_deref(), Ok(&secret[..]), "mode {mode:o}");
            std::fs::remove_file(&path).unwrap();
        }
        let empty = file("empty", b"", 0o600);
        let short = file("short", b"short", 0o600);
        let (e, s) = (read(&empty).unwrap_err(), read(&short).unwrap_err());
        std::fs::remove_file(&empty).unwrap();
        std::fs::remove_file(&short).unwrap();
        assert!(e.contains("empty"), "{e}");
        assert!(s.contains("5 bytes"), "{s}");
        assert!(read(Path::new("/nonexistent/xfer-secret")).is_err());
    }
}
