//! Revoked members refused at the TLS handshake.
//!
//! Zenoh's TLS links check a peer's chain with rustls's WebPki verifiers
//! against the authority, with no revocation list: zenoh 1.10 has no
//! setting for one, nor a way to hand rustls a verifier of our own. What
//! those verifiers do use is the process's default `CryptoProvider` and
//! its signature algorithms. [`install`] makes that default ring's provider
//! with every signature algorithm wrapped: when rustls checks the
//! authority's signature over a peer certificate, the signed bytes are the
//! certificate's TBS part, which names its holder, and a holder the log
//! revoked ([`set_revoked`]) fails the check. The handshake is refused
//! both ways: a revoked machine can neither connect to a node nor be
//! connected to.

use std::collections::BTreeSet;
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};

use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls_pki_types::{AlgorithmIdentifier, InvalidSignature, SignatureVerificationAlgorithm};
use x509_parser::certificate::TbsCertificate;
use x509_parser::prelude::FromDer;

use crate::TrustError;

/// The holders refused at a handshake, for the whole process (one node).
static REVOKED: RwLock<BTreeSet<String>> = RwLock::new(BTreeSet::new());

/// The holders whose certificates every later TLS handshake of this
/// process refuses (the log's revocations, all of them).
pub fn set_revoked(holders: impl IntoIterator<Item = String>) {
    let holders: BTreeSet<String> = holders.into_iter().collect();
    if let Ok(mut revoked) = REVOKED.write() {
        *revoked = holders;
    }
}

/// Whether `signed` is a certificate's TBS part naming a revoked holder.
fn names_revoked(signed: &[u8]) -> bool {
    let Ok(revoked) = REVOKED.read() else {
        return false;
    };
    if revoked.is_empty() {
        return false;
    }
    // Other signed data (a handshake's CertificateVerify) does not parse.
    let Ok((_, tbs)) = TbsCertificate::from_der(signed) else {
        return false;
    };
    let holder = tbs
        .subject()
        .iter_common_name()
        .filter_map(|name| name.as_str().ok())
        .find(|holder| revoked.contains(*holder));
    if let Some(holder) = holder {
        say_refused(holder);
    }
    holder.is_some()
}

/// When a refusal was last logged: a revoked machine that is still up
/// dials again every second, so it is said at most once a minute.
static LAST_SAID: Mutex<Option<Instant>> = Mutex::new(None);

fn say_refused(holder: &str) {
    let Ok(mut last) = LAST_SAID.lock() else {
        return;
    };
    if last.is_none_or(|at| at.elapsed() >= Duration::from_secs(60)) {
        *last = Some(Instant::now());
        tracing::warn!(holder, "refused the TLS handshake of a revoked member");
    }
}

/// A signature algorithm that first refuses certificates of revoked
/// holders, then checks as `inner` does.
#[derive(Debug)]
struct RefusingRevoked(&'static dyn SignatureVerificationAlgorithm);

impl SignatureVerificationAlgorithm for RefusingRevoked {
    fn verify_signature(
        &self,
        public_key: &[u8],
        message: &[u8],
        signature: &[u8],
    ) -> Result<(), InvalidSignature> {
        if names_revoked(message) {
            return Err(InvalidSignature);
        }
        self.0.verify_signature(public_key, message, signature)
    }

    fn public_key_alg_id(&self) -> AlgorithmIdentifier {
        self.0.public_key_alg_id()
    }

    fn signature_alg_id(&self) -> AlgorithmIdentifier {
        self.0.signature_alg_id()
    }

    fn fips(&self) -> bool {
        self.0.fips()
    }
}

type Algorithms = &'static [&'static dyn SignatureVerificationAlgorithm];

/// `algorithms`, each wrapped (made once per process: they live as long).
fn wrapped(algorithms: Algorithms) -> Algorithms {
    let wrapped: Vec<&'static dyn SignatureVerificationAlgorithm> = algorithms
        .iter()
        .map(|inner| {
            let refusing: &'static RefusingRevoked = Box::leak(Box::new(RefusingRevoked(*inner)));
            refusing as &'static dyn SignatureVerificationAlgorithm
        })
        .collect();
    Box::leak(wrapped.into_boxed_slice())
}

/// Whether [`install`] made the process's provider ours.
static INSTALLED: std::sync::OnceLock<()> = std::sync::OnceLock::new();

/// Makes this process's default TLS provider one that refuses revoked
/// holders (ring's otherwise, as zenoh's and reqwest's would be). Call it
/// before any TLS is set up (again is harmless); it fails if another
/// default was installed first (then only the message signatures refuse
/// the revoked).
pub fn install() -> Result<(), TrustError> {
    if INSTALLED.get().is_some() {
        return Ok(());
    }
    let ring = rustls::crypto::ring::default_provider();
    let algorithms = ring.signature_verification_algorithms;
    let mapping: Vec<_> = algorithms
        .mapping
        .iter()
        .map(|(scheme, algorithms)| (*scheme, wrapped(algorithms)))
        .collect();
    let provider = rustls::crypto::CryptoProvider {
        signature_verification_algorithms: WebPkiSupportedAlgorithms {
            all: wrapped(algorithms.all),
            mapping: Box::leak(mapping.into_boxed_slice()),
        },
        ..ring
    };
    provider
        .install_default()
        .map_err(|_| TrustError::Invalid("another TLS provider was installed first".into()))?;
    let _ = INSTALLED.set(());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::authority::{key_and_request, pem_der, Authority, Role};

    #[test]
    fn a_certificate_of_a_revoked_holder_is_recognised_by_its_tbs() {
        let (authority, _) = Authority::create("home").expect("authority");
        let (_, csr) = key_and_request("b").expect("request");
        let cert = authority.issue(&csr, "b", Role::Node).expect("issued");
        let der = pem_der(&cert).expect("der");
        let (_, parsed) = x509_parser::parse_x509_certificate(&der).expect("parses");
        let tbs = parsed.tbs_certificate.as_ref();
        assert!(!names_revoked(tbs), "nothing revoked");
        set_revoked(["b".to_string()]);
        assert!(names_revoked(tbs));
        assert!(!names_revoked(b"a handshake's signed content"));
        set_revoked(["c".to_string()]);
        assert!(!names_revoked(tbs));
        set_revoked([]);
    }
}
