//! Who sent a message. In a secured cluster every message a member puts,
//! asks or answers on zenoh carries, as an attachment, the member's
//! certificate and its signature over the key and the payload. TLS says a
//! peer belongs to the cluster; the signature says which member wrote a
//! message, so a rule can say who may write what (only the master writes
//! the log, a node reports only for itself, an admin machine never speaks
//! for a node), and a revoked member is refused by every node at once.
//!
//! The attachment: a version byte, the certificate's DER length (two
//! bytes, big-endian), the DER, then the ECDSA P-256 signature (ASN.1) of
//! `DOMAIN || key || 0 || payload`.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Mutex, RwLock};

use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, ECDSA_P256_SHA256_ASN1_SIGNING};
use rustls_pki_types::{CertificateDer, UnixTime};

use crate::authority::{holder_of_der, pem_der, Role};
use crate::{Credentials, TrustError};

const VERSION: u8 = 1;
/// Separates these signatures from any other use of the same key.
const DOMAIN: &[u8] = b"tessera-signed-message-1\0";

/// Why a message's sender is not accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("the message is not signed")]
    Unsigned,
    #[error("the signature attachment is malformed")]
    Malformed,
    #[error("the certificate is not one of this cluster's: {0}")]
    NotOfThisCluster(String),
    #[error("the signature does not match the message")]
    Mismatch,
    #[error("{0}'s certificate was revoked")]
    Revoked(String),
}

/// The member that signed a message, as its certificate names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sender {
    pub holder: String,
    pub role: Role,
}

fn signed_bytes(key: &str, payload: &[u8]) -> Vec<u8> {
    let mut message = Vec::with_capacity(DOMAIN.len() + key.len() + 1 + payload.len());
    message.extend_from_slice(DOMAIN);
    message.extend_from_slice(key.as_bytes());
    message.push(0);
    message.extend_from_slice(payload);
    message
}

/// Signs this member's messages with its certificate's key.
pub struct Signer {
    key: EcdsaKeyPair,
    cert_der: Vec<u8>,
    holder: String,
    rng: SystemRandom,
}

impl Signer {
    /// The signer of the holder whose files `credentials` names.
    pub fn load(credentials: &Credentials) -> Result<Signer, TrustError> {
        let key_pem = crate::dir::read(&credentials.key)?;
        let cert_pem = crate::dir::read(&credentials.cert)?;
        Signer::from_pem(&key_pem, &cert_pem)
    }

    pub fn from_pem(key_pem: &str, cert_pem: &str) -> Result<Signer, TrustError> {
        let rng = SystemRandom::new();
        let key_der = pem_der(key_pem)?;
        let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &key_der, &rng)
            .map_err(|e| TrustError::Invalid(format!("the holder's key: {e}")))?;
        let cert_der = pem_der(cert_pem)?;
        let (holder, _, _) = holder_of_der(&cert_der)?;
        Ok(Signer {
            key,
            cert_der,
            holder,
            rng,
        })
    }

    /// The name this member's certificate gives it.
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// The attachment for `payload` put (or asked, or answered) on `key`.
    pub fn sign(&self, key: &str, payload: &[u8]) -> Result<Vec<u8>, TrustError> {
        let signature = self
            .key
            .sign(&self.rng, &signed_bytes(key, payload))
            .map_err(|_| TrustError::Random)?;
        let length = u16::try_from(self.cert_der.len())
            .map_err(|_| TrustError::Invalid("a certificate over 64 KiB".into()))?;
        let mut attachment = Vec::with_capacity(3 + self.cert_der.len() + 80);
        attachment.push(VERSION);
        attachment.extend_from_slice(&length.to_be_bytes());
        attachment.extend_from_slice(&self.cert_der);
        attachment.extend_from_slice(signature.as_ref());
        Ok(attachment)
    }
}

/// A certificate whose chain to the authority was checked.
#[derive(Clone)]
struct Checked {
    sender: Sender,
    not_after: UnixTime,
}

/// Checks signatures against the cluster's authority and the holders the
/// log revoked. Certificates already checked are remembered (by their
/// DER), so a message costs one signature check.
pub struct Verifier {
    authority_der: CertificateDer<'static>,
    checked: Mutex<HashMap<Vec<u8>, Checked>>,
    revoked: RwLock<BTreeSet<String>>,
}

/// Checked certificates remembered at most; past it the memory starts over
/// (a cluster has a handful of members; this bounds a flood of strangers').
const CHECKED_AT_MOST: usize = 1024;

impl Verifier {
    pub fn load(credentials: &Credentials) -> Result<Verifier, TrustError> {
        Verifier::new(&crate::dir::read(&credentials.authority)?)
    }

    pub fn new(authority_pem: &str) -> Result<Verifier, TrustError> {
        Ok(Verifier {
            authority_der: CertificateDer::from(pem_der(authority_pem)?),
            checked: Mutex::new(HashMap::new()),
            revoked: RwLock::new(BTreeSet::new()),
        })
    }

    /// The holders whose certificates are refused from now on (the log's
    /// revocations, all of them).
    pub fn set_revoked(&self, holders: impl IntoIterator<Item = String>) {
        let holders: BTreeSet<String> = holders.into_iter().collect();
        if let Ok(mut revoked) = self.revoked.write() {
            *revoked = holders;
        }
    }

    fn is_revoked(&self, holder: &str) -> bool {
        self.revoked
            .read()
            .map_or(true, |revoked| revoked.contains(holder))
    }

    /// The member that signed `payload` on `key`, or why there is none.
    pub fn verify(
        &self,
        key: &str,
        payload: &[u8],
        attachment: Option<&[u8]>,
    ) -> Result<Sender, SignatureError> {
        let attachment = attachment.ok_or(SignatureError::Unsigned)?;
        let (cert_der, signature) = split(attachment)?;
        let checked = self.check_certificate(cert_der)?;
        if self.is_revoked(&checked.sender.holder) {
            return Err(SignatureError::Revoked(checked.sender.holder));
        }
        let cert = CertificateDer::from(cert_der);
        let end_entity = webpki::EndEntityCert::try_from(&cert)
            .map_err(|e| SignatureError::NotOfThisCluster(e.to_string()))?;
        end_entity
            .verify_signature(
                webpki::ring::ECDSA_P256_SHA256,
                &signed_bytes(key, payload),
                signature,
            )
            .map_err(|_| SignatureError::Mismatch)?;
        Ok(checked.sender)
    }

    /// The certificate's holder, once its chain to the authority and its
    /// validity are checked (remembered, but its expiry is checked each
    /// time).
    fn check_certificate(&self, cert_der: &[u8]) -> Result<Checked, SignatureError> {
        let now = UnixTime::now();
        let remembered = self
            .checked
            .lock()
            .ok()
            .and_then(|checked| checked.get(cert_der).cloned());
        if let Some(checked) = remembered {
            if checked.not_after.as_secs() < now.as_secs() {
                return Err(SignatureError::NotOfThisCluster("it has expired".into()));
            }
            return Ok(checked);
        }
        let checked = self.check_chain(cert_der, now)?;
        if let Ok(mut remembered) = self.checked.lock() {
            if remembered.len() >= CHECKED_AT_MOST {
                remembered.clear();
            }
            remembered.insert(cert_der.to_vec(), checked.clone());
        }
        Ok(checked)
    }

    fn check_chain(&self, cert_der: &[u8], now: UnixTime) -> Result<Checked, SignatureError> {
        let refused = |e: String| SignatureError::NotOfThisCluster(e);
        let anchor = webpki::anchor_from_trusted_cert(&self.authority_der)
            .map_err(|e| refused(e.to_string()))?;
        let cert = CertificateDer::from(cert_der);
        let end_entity =
            webpki::EndEntityCert::try_from(&cert).map_err(|e| refused(e.to_string()))?;
        end_entity
            .verify_for_usage(
                webpki::ALL_VERIFICATION_ALGS,
                &[anchor],
                &[],
                now,
                webpki::KeyUsage::client_auth(),
                None,
                None,
            )
            .map_err(|e| refused(e.to_string()))?;
        let (holder, role, not_after) =
            holder_of_der(cert_der).map_err(|e| refused(e.to_string()))?;
        Ok(Checked {
            sender: Sender { holder, role },
            not_after: UnixTime::since_unix_epoch(std::time::Duration::from_secs(not_after)),
        })
    }
}

/// The certificate and the signature of an attachment.
fn split(attachment: &[u8]) -> Result<(&[u8], &[u8]), SignatureError> {
    let (&version, rest) = attachment.split_first().ok_or(SignatureError::Malformed)?;
    if version != VERSION {
        return Err(SignatureError::Malformed);
    }
    let (length, rest) = rest.split_at_checked(2).ok_or(SignatureError::Malformed)?;
    let length = usize::from(u16::from_be_bytes([length[0], length[1]]));
    let (cert, signature) = rest
        .split_at_checked(length)
        .ok_or(SignatureError::Malformed)?;
    if signature.is_empty() {
        return Err(SignatureError::Malformed);
    }
    Ok((cert, signature))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::authority::{key_and_request, Authority};

    fn member(authority: &Authority, holder: &str, role: Role) -> Signer {
        let (key, csr) = key_and_request(holder).expect("request");
        let cert = authority.issue(&csr, holder, role).expect("issued");
        Signer::from_pem(&key, &cert).expect("signer")
    }

    #[test]
    fn a_member_is_known_by_its_signature_and_nothing_else_passes() {
        let (authority, _) = Authority::create("home").expect("authority");
        let verifier = Verifier::new(&authority.cert_pem).expect("verifier");
        let node = member(&authority, "node-a", Role::Node);
        assert_eq!(node.holder(), "node-a");
        let laptop = member(&authority, "laptop", Role::Admin);
        let key = "tessera/home/events/global";
        let signed = node.sign(key, b"event").expect("signed");
        assert_eq!(
            verifier.verify(key, b"event", Some(&signed)),
            Ok(Sender {
                holder: "node-a".into(),
                role: Role::Node
            })
        );
        // Again, from the remembered certificate.
        assert!(verifier.verify(key, b"event", Some(&signed)).is_ok());
        let admin = laptop.sign(key, b"x").expect("signed");
        assert_eq!(
            verifier.verify(key, b"x", Some(&admin)).map(|s| s.role),
            Ok(Role::Admin)
        );
        // Another payload, another key, no attachment, a torn one.
        assert_eq!(
            verifier.verify(key, b"forged", Some(&signed)),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verifier.verify("tessera/home/commands", b"event", Some(&signed)),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verifier.verify(key, b"event", None),
            Err(SignatureError::Unsigned)
        );
        for torn in [&signed[..0], &signed[..2], &signed[..40]] {
            assert_eq!(
                verifier.verify(key, b"event", Some(torn)),
                Err(SignatureError::Malformed)
            );
        }
        // A certificate of another authority.
        let (other, _) = Authority::create("home").expect("authority");
        let stranger = member(&other, "node-a", Role::Node);
        let forged = stranger.sign(key, b"event").expect("signed");
        assert!(matches!(
            verifier.verify(key, b"event", Some(&forged)),
            Err(SignatureError::NotOfThisCluster(_))
        ));
        // Revoked: refused at once, even remembered.
        verifier.set_revoked(["node-a".to_string()]);
        assert_eq!(
            verifier.verify(key, b"event", Some(&signed)),
            Err(SignatureError::Revoked("node-a".into()))
        );
        assert!(verifier.verify(key, b"x", Some(&admin)).is_ok());
        verifier.set_revoked([]);
        assert!(verifier.verify(key, b"event", Some(&signed)).is_ok());
    }

    #[test]
    fn random_attachments_are_refused_without_a_panic() {
        let (authority, _) = Authority::create("home").expect("authority");
        let verifier = Verifier::new(&authority.cert_pem).expect("verifier");
        let mut seed = 7u64;
        for length in 0..300usize {
            let bytes: Vec<u8> = (0..length)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                    (seed >> 33) as u8
                })
                .collect();
            let mut attachment = vec![VERSION];
            attachment.extend_from_slice(&bytes);
            assert!(verifier.verify("k", b"p", Some(&attachment)).is_err());
        }
    }
}
