//! Who may join a ring, and what its frames look like on the wire.
//!
//! An instance's ranks share a secret that cluster members learn from the
//! log. A rank proves it knows the secret when it connects (an HMAC over
//! the ring id, its rank and a fresh nonce, sent with its hello, so no
//! rank ever waits for another before accepting its own predecessor); the
//! listener answers with a nonce and an HMAC of its own, which the
//! connecting rank checks before the first frame. In a secured cluster
//! every frame is then sealed with AES-256-GCM under a key derived from the
//! secret and both nonces (HKDF-SHA256), one key per connection, a counter
//! for nonces: activations of people's prompts cross the network
//! encrypted, and a changed or replayed frame fails to open.

use ring::{aead, hkdf, hmac};

/// Bytes of each side's nonce.
pub const NONCE_BYTES: usize = 16;
/// Bytes of an HMAC-SHA256 proof.
pub const PROOF_BYTES: usize = 32;
/// Bytes a sealed frame adds (the AEAD tag).
pub const SEAL_OVERHEAD: usize = 16;
/// Bytes of an instance's ring secret.
pub const SECRET_BYTES: usize = 32;

/// A ring's security: none (tests, `--world N` on one machine), a shared
/// secret, or a secret and sealed frames.
#[derive(Clone, Default)]
pub struct RingSecurity {
    secret: Option<hmac::Key>,
    raw: Option<[u8; SECRET_BYTES]>,
    sealed: bool,
}

impl std::fmt::Debug for RingSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingSecurity")
            .field("authenticated", &self.secret.is_some())
            .field("sealed", &self.sealed)
            .finish()
    }
}

fn random<const N: usize>() -> Result<[u8; N], String> {
    let mut bytes = [0u8; N];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
        .map_err(|_| "the system's random number generator failed".to_string())?;
    Ok(bytes)
}

/// A fresh secret for an instance's ring.
pub fn new_secret() -> Result<[u8; SECRET_BYTES], String> {
    random()
}

impl RingSecurity {
    /// No proof asked or given: any process that says the right hello joins.
    pub fn open() -> Self {
        Self::default()
    }

    /// Ranks prove they know `secret`; with `sealed`, frames are encrypted.
    pub fn with_secret(secret: &[u8], sealed: bool) -> Result<Self, String> {
        let raw: [u8; SECRET_BYTES] = secret.try_into().map_err(|_| {
            format!(
                "a ring secret has {SECRET_BYTES} bytes, not {}",
                secret.len()
            )
        })?;
        Ok(Self {
            secret: Some(hmac::Key::new(hmac::HMAC_SHA256, &raw)),
            raw: Some(raw),
            sealed,
        })
    }

    pub fn is_authenticated(&self) -> bool {
        self.secret.is_some()
    }

    pub fn is_sealed(&self) -> bool {
        self.sealed && self.secret.is_some()
    }

    fn proof(&self, parts: &[&[u8]]) -> Option<hmac::Tag> {
        let key = self.secret.as_ref()?;
        let mut context = hmac::Context::with_key(key);
        for part in parts {
            context.update(&(part.len() as u32).to_le_bytes());
            context.update(part);
        }
        Some(context.sign())
    }

    fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        let Some(key) = &self.secret else {
            return true;
        };
        let mut message = Vec::new();
        for part in parts {
            message.extend_from_slice(&(part.len() as u32).to_le_bytes());
            message.extend_from_slice(part);
        }
        hmac::verify(key, &message, tag).is_ok()
    }

    /// What a connecting `rank` sends after its hello: its nonce and proof
    /// (nothing without a secret), and the nonce, kept for the key.
    pub fn connector_proof(
        &self,
        ring_id: &str,
        rank: usize,
    ) -> Result<(Vec<u8>, [u8; NONCE_BYTES]), String> {
        let nonce = random::<NONCE_BYTES>()?;
        let rank = (rank as u32).to_le_bytes();
        let Some(tag) = self.proof(&[b"hello", ring_id.as_bytes(), &rank, &nonce]) else {
            return Ok((Vec::new(), nonce));
        };
        let mut bytes = nonce.to_vec();
        bytes.extend_from_slice(tag.as_ref());
        Ok((bytes, nonce))
    }

    /// Bytes a connector's proof takes (read by the listener).
    pub fn connector_proof_len(&self) -> usize {
        if self.is_authenticated() {
            NONCE_BYTES + PROOF_BYTES
        } else {
            0
        }
    }

    /// Whether `proof` (nonce and HMAC) shows the connector, claiming
    /// `rank`, knows the secret.
    pub fn check_connector(&self, ring_id: &str, rank: usize, proof: &[u8]) -> bool {
        let (nonce, tag) = proof.split_at(proof.len().min(NONCE_BYTES));
        let rank = (rank as u32).to_le_bytes();
        self.verify(&[b"hello", ring_id.as_bytes(), &rank, nonce], tag)
    }

    /// The listener's answer to a good proof: its nonce and HMAC (nothing
    /// without a secret), and its nonce.
    pub fn listener_proof(
        &self,
        ring_id: &str,
        rank: usize,
        connector_nonce: &[u8],
    ) -> Result<(Vec<u8>, [u8; NONCE_BYTES]), String> {
        let nonce = random::<NONCE_BYTES>()?;
        let rank = (rank as u32).to_le_bytes();
        let parts: [&[u8]; 5] = [
            b"welcome",
            ring_id.as_bytes(),
            &rank,
            connector_nonce,
            &nonce,
        ];
        let Some(tag) = self.proof(&parts) else {
            return Ok((Vec::new(), nonce));
        };
        let mut bytes = nonce.to_vec();
        bytes.extend_from_slice(tag.as_ref());
        Ok((bytes, nonce))
    }

    /// Whether the listener at `rank` answered with the secret.
    pub fn check_listener(
        &self,
        ring_id: &str,
        rank: usize,
        connector_nonce: &[u8],
        proof: &[u8],
    ) -> bool {
        let (nonce, tag) = proof.split_at(proof.len().min(NONCE_BYTES));
        let rank = (rank as u32).to_le_bytes();
        self.verify(
            &[
                b"welcome",
                ring_id.as_bytes(),
                &rank,
                connector_nonce,
                nonce,
            ],
            tag,
        )
    }

    /// The sealing of one connection's frames, from both sides' nonces;
    /// `None` when frames go in the clear.
    pub fn seal_for(&self, connector_nonce: &[u8], listener_nonce: &[u8]) -> Option<Seal> {
        let raw = self.raw.as_ref().filter(|_| self.sealed)?;
        let mut salt = connector_nonce.to_vec();
        salt.extend_from_slice(listener_nonce);
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, &salt).extract(raw);
        let info: [&[u8]; 1] = [b"tessera-ring-frames"];
        let okm = prk.expand(&info, &aead::AES_256_GCM).ok()?;
        Some(Seal {
            key: aead::LessSafeKey::new(aead::UnboundKey::from(okm)),
            counter: 0,
        })
    }
}

/// One direction of a sealed connection: a key and the next frame's number
/// (each frame's nonce; a frame out of order fails to open).
pub struct Seal {
    key: aead::LessSafeKey,
    counter: u64,
}

impl Seal {
    fn next_nonce(&mut self) -> aead::Nonce {
        let mut nonce = [0u8; aead::NONCE_LEN];
        nonce[4..].copy_from_slice(&self.counter.to_be_bytes());
        self.counter = self.counter.wrapping_add(1);
        aead::Nonce::assume_unique_for_key(nonce)
    }

    /// Seals `buf[from..]` in place and appends its tag.
    pub fn seal(&mut self, buf: &mut Vec<u8>, from: usize) -> Result<(), String> {
        let nonce = self.next_nonce();
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce, aead::Aad::empty(), &mut buf[from..])
            .map_err(|_| "sealing a frame failed".to_string())?;
        buf.extend_from_slice(tag.as_ref());
        Ok(())
    }

    /// Opens a sealed frame in place; its plaintext is the first
    /// `buf.len() - SEAL_OVERHEAD` bytes.
    pub fn open(&mut self, buf: &mut [u8]) -> Result<(), String> {
        let nonce = self.next_nonce();
        self.key
            .open_in_place(nonce, aead::Aad::empty(), buf)
            .map(|_| ())
            .map_err(|_| {
                "a frame failed to open: changed, replayed or not sealed by this ring".into()
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_need_the_secret_and_seals_open_once_in_order() -> Result<(), String> {
        let secret = new_secret()?;
        let ours = RingSecurity::with_secret(&secret, true)?;
        let stranger = RingSecurity::with_secret(&new_secret()?, true)?;
        let (proof, connector_nonce) = ours.connector_proof("inst", 1)?;
        assert_eq!(proof.len(), ours.connector_proof_len());
        assert!(ours.check_connector("inst", 1, &proof));
        assert!(!ours.check_connector("inst", 2, &proof), "another rank");
        assert!(!ours.check_connector("other", 1, &proof), "another ring");
        assert!(!stranger.check_connector("inst", 1, &proof));
        let (answer, listener_nonce) = ours.listener_proof("inst", 2, &connector_nonce)?;
        assert!(ours.check_listener("inst", 2, &connector_nonce, &answer));
        assert!(!stranger.check_listener("inst", 2, &connector_nonce, &answer));

        let mut sender = ours
            .seal_for(&connector_nonce, &listener_nonce)
            .ok_or("sealed")?;
        let mut receiver = ours
            .seal_for(&connector_nonce, &listener_nonce)
            .ok_or("sealed")?;
        let mut frame = b"header".to_vec();
        frame.extend_from_slice(b"the activations");
        sender.seal(&mut frame, 6)?;
        assert_eq!(&frame[..6], b"header");
        assert_ne!(&frame[6..21], b"the activations");
        let mut body = frame[6..].to_vec();
        receiver.open(&mut body)?;
        assert_eq!(&body[..body.len() - SEAL_OVERHEAD], b"the activations");
        // The same frame again (a replay) is refused: the counter moved on.
        assert!(receiver.open(&mut frame[6..].to_vec()).is_err());
        // Open clusters authenticate without sealing; no secret, neither.
        let plain = RingSecurity::with_secret(&secret, false)?;
        assert!(plain.seal_for(&connector_nonce, &listener_nonce).is_none());
        assert!(RingSecurity::open()
            .connector_proof("inst", 1)?
            .0
            .is_empty());
        assert!(RingSecurity::with_secret(&[1, 2, 3], true).is_err());
        Ok(())
    }
}
