//! The cluster secret and the proofs built from it (pure, apart from reading the file and
//! the OS's randomness).
//!
//! A connection to the embedded service starts with a mutual challenge: the client sends a
//! fresh nonce, the service answers with its own nonce and an HMAC over both (proving it
//! holds the secret), and the client answers with an HMAC over both in the other order.
//! Fresh nonces on both sides make a recorded proof useless on another connection. This
//! authenticates who opened the connection, not the bytes that follow it (no TLS): see
//! docs/security.md for what an attacker on the path can still do.

use std::path::{Path, PathBuf};

use hmac::{KeyInit, Mac};
use xfer_plugin::secret::{derive_key, too_short, KeyUse};

use crate::{Error, Result};

/// The environment variable naming a file that holds the cluster secret (the secret itself
/// is never taken from the environment or a command line, where `ps` and logs show it).
pub const SECRET_FILE_ENV: &str = "XFER_SECRET_FILE";

/// Bytes of a nonce and of a proof.
pub(crate) const PROOF_LEN: usize = 32;

/// A nonce or a proof.
pub(crate) type Proof = [u8; PROOF_LEN];

/// The cluster secret: at least 16 bytes (32 random ones will do:
/// `(umask 077; head -c 32 /dev/urandom > FILE)`).
/// `Debug` shows its length only.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret({} bytes)", self.0.len())
    }
}

impl Secret {
    /// Reads the secret from `path` by the shared rule ([`xfer_plugin::secret::read`]: an
    /// unreadable, empty, short or group/world-accessible file is an error naming it).
    pub fn from_file(path: &Path) -> Result<Self> {
        xfer_plugin::secret::read(path)
            .map(Self)
            .map_err(|why| Error::Secret {
                path: path.to_owned(),
                why,
            })
    }

    /// The secret from the file named by `$XFER_SECRET_FILE`, if it is set.
    pub fn from_env() -> Result<Option<Self>> {
        match std::env::var_os(SECRET_FILE_ENV) {
            Some(path) if !path.is_empty() => Self::from_file(&PathBuf::from(path)).map(Some),
            _ => Ok(None),
        }
    }

    /// The secret from `path` when given, else from `$XFER_SECRET_FILE`, else none.
    pub fn from_file_or_env(path: Option<&Path>) -> Result<Option<Self>> {
        match path {
            Some(p) => Self::from_file(p).map(Some),
            None => Self::from_env(),
        }
    }

    /// Wraps secret bytes already in memory (tests, and callers with their own store).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.is_empty() {
            return Err(Error::Secret {
                path: PathBuf::from("<bytes>"),
                why: "the secret is empty".into(),
            });
        }
        if let Some(why) = too_short(bytes) {
            return Err(Error::Secret {
                path: PathBuf::from("<bytes>"),
                why,
            });
        }
        Ok(Self(bytes.to_vec()))
    }

    fn mac(&self, role: &[u8], first: &Proof, second: &Proof) -> hmac::Hmac<sha2::Sha256> {
        let key = derive_key(&self.0, KeyUse::Rendezvous);
        let mut mac = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(&key)
            .expect("HMAC takes a key of any length");
        mac.update(b"xfer-rendezvous-v1 ");
        mac.update(role);
        mac.update(first);
        mac.update(second);
        mac
    }

    /// What the service sends: proof that it holds the secret, bound to both nonces.
    pub(crate) fn service_proof(&self, client_nonce: &Proof, service_nonce: &Proof) -> Proof {
        self.mac(b"service", client_nonce, service_nonce)
            .finalize()
            .into_bytes()
            .into()
    }

    /// What the client sends back, bound to both nonces in the other order.
    pub(crate) fn client_proof(&self, client_nonce: &Proof, service_nonce: &Proof) -> Proof {
        self.mac(b"client", service_nonce, client_nonce)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Checks a proof in constant time.
    pub(crate) fn verify(
        &self,
        role: Role,
        client_nonce: &Proof,
        service_nonce: &Proof,
        proof: &Proof,
    ) -> bool {
        let mac = match role {
            Role::Service => self.mac(b"service", client_nonce, service_nonce),
            Role::Client => self.mac(b"client", service_nonce, client_nonce),
        };
        mac.verify_slice(proof).is_ok()
    }
}

/// Whose proof is checked.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Role {
    Service,
    Client,
}

/// A fresh nonce from the OS's CSPRNG.
pub(crate) fn nonce() -> Proof {
    let mut n = [0u8; PROOF_LEN];
    getrandom::fill(&mut n).expect("the OS has randomness");
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_verify_only_for_their_secret_role_and_nonces() {
        let s = Secret::from_bytes(b"the cluster's secret").unwrap();
        let other = Secret::from_bytes(b"another cluster's secret").unwrap();
        let (c, v) = (nonce(), nonce());
        let service = s.service_proof(&c, &v);
        let client = s.client_proof(&c, &v);
        assert!(s.verify(Role::Service, &c, &v, &service));
        assert!(s.verify(Role::Client, &c, &v, &client));
        // A proof for one role is not one for the other (a reflected proof fails).
        assert!(!s.verify(Role::Client, &c, &v, &service));
        assert!(!s.verify(Role::Service, &c, &v, &client));
        // Another secret, or other nonces (a replay on a new connection), fail.
        assert!(!other.verify(Role::Client, &c, &v, &client));
        assert!(!s.verify(Role::Client, &c, &nonce(), &client));
        assert!(!s.verify(Role::Client, &nonce(), &v, &client));
    }

    #[test]
    fn an_empty_or_missing_secret_is_refused_naming_the_file() {
        assert!(Secret::from_bytes(b"").is_err());
        let e = Secret::from_file(Path::new("/nonexistent/xfer-secret")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/xfer-secret"), "{e}");
        assert_eq!(
            format!("{:?}", Secret::from_bytes(&[7; 32]).unwrap()),
            "Secret(32 bytes)"
        );
    }

    /// A short secret can be guessed offline from one recorded proof: refused, saying how
    /// long it must be and how to make one.
    #[test]
    fn a_secret_shorter_than_16_bytes_is_refused_naming_its_length() {
        let e = Secret::from_bytes(b"cluster secret")
            .unwrap_err()
            .to_string();
        assert!(e.contains("14 bytes") && e.contains("at least 16"), "{e}");
        assert!(e.contains("head -c 32 /dev/urandom"), "{e}");
        let path = std::env::temp_dir().join(format!("xfer-short-secret-{}", std::process::id()));
        std::fs::write(&path, b"s").unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let e = Secret::from_file(&path).unwrap_err().to_string();
        std::fs::remove_file(&path).unwrap();
        assert!(
            e.contains(&path.display().to_string()) && e.contains("1 byte"),
            "{e}"
        );
        assert!(Secret::from_bytes(&[7; 16]).is_ok());
    }
}
