//! The rule for a cluster secret, shared by everything that reads `secret_file` (the
//! rendezvous and the backends the path is handed to), so a file one accepts the others do too.

/// Fewest bytes a secret may have: a shorter one could be guessed offline from one recorded
/// proof or handshake MAC (both are HMACs keyed by the secret alone).
pub const MIN_SECRET_LEN: usize = 16;

/// Why `secret` is too short to use, if it is (a sentence for an error naming the file).
pub fn too_short(secret: &[u8]) -> Option<String> {
    let n = secret.len();
    (n < MIN_SECRET_LEN).then(|| {
        format!(
            "the secret is {n} byte{}; it must be at least {MIN_SECRET_LEN} (make one with \
             `head -c 32 /dev/urandom > FILE`)",
            if n == 1 { "" } else { "s" }
        )
    })
}
