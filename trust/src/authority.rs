//! The cluster authority (a CA kept by the node that ran `tessera cluster
//! init`) and the certificates it issues: one per node, one per admin
//! laptop. Every certificate names its holder (common name) and its role
//! (organisational unit), so access rules can tell a node from an admin.

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use time::{Duration, OffsetDateTime};

use crate::TrustError;

/// What a certificate lets its holder do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// A member node: it runs the cluster's protocol and models.
    Node,
    /// A machine that only administers (places models, reads the state).
    Admin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Node => "node",
            Role::Admin => "admin",
        }
    }

    fn of(text: &str) -> Option<Role> {
        match text {
            "node" => Some(Role::Node),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }
}

/// The name every certificate carries as a DNS subject alternative name:
/// peers check the chain to the authority, not host names (the addresses
/// of home machines change).
pub const CERT_DNS_NAME: &str = "tessera";

/// An authority's certificate, and its key where this node keeps it.
pub struct Authority {
    pub cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// How long the authority's and the issued certificates are valid.
const AUTHORITY_YEARS: i64 = 20;
const ISSUED_YEARS: i64 = 5;

fn validity(years: i64) -> (OffsetDateTime, OffsetDateTime) {
    let now = OffsetDateTime::now_utc();
    // A day back, for clocks of home machines that run a little behind.
    (now - Duration::days(1), now + Duration::days(365 * years))
}

impl Authority {
    /// A new authority for the cluster named `cluster` (its namespace).
    pub fn create(cluster: &str) -> Result<(Authority, String), TrustError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(
            DnType::CommonName,
            format!("tessera authority of {cluster}"),
        );
        params
            .distinguished_name
            .push(DnType::OrganizationName, "tessera");
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        (params.not_before, params.not_after) = validity(AUTHORITY_YEARS);
        let cert = params.self_signed(&key)?;
        let key_pem = key.serialize_pem();
        let authority = Authority {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        };
        Ok((authority, key_pem))
    }

    /// The authority kept on disk: its certificate and key in PEM.
    pub fn load(cert_pem: &str, key_pem: &str) -> Result<Authority, TrustError> {
        let key = KeyPair::from_pem(key_pem)?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key)?;
        Ok(Authority {
            cert_pem: cert_pem.to_string(),
            issuer,
        })
    }

    /// A certificate for the key of `csr_pem`, naming `holder` with
    /// `role`. Nothing of the request but its key is taken: the authority
    /// decides the name, the role and what the certificate may do.
    pub fn issue(&self, csr_pem: &str, holder: &str, role: Role) -> Result<String, TrustError> {
        let csr = CertificateSigningRequestParams::from_pem(csr_pem)?;
        let params = leaf_params(holder, role)?;
        Ok(params.signed_by(&csr.public_key, &self.issuer)?.pem())
    }

    /// The SHA-256 of the authority's certificate (DER), in hex: what a
    /// join token pins.
    pub fn fingerprint(&self) -> Result<String, TrustError> {
        fingerprint(&self.cert_pem)
    }
}

fn leaf_params(holder: &str, role: Role) -> Result<CertificateParams, TrustError> {
    let mut params = CertificateParams::new(vec![CERT_DNS_NAME.to_string()])?;
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, holder);
    params
        .distinguished_name
        .push(DnType::OrganizationalUnitName, role.as_str());
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    // Each side of a mutual-TLS link is both server and client.
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    (params.not_before, params.not_after) = validity(ISSUED_YEARS);
    Ok(params)
}

/// A fresh key and a signing request for it (the request's name is only a
/// hint: the authority names the certificate).
pub fn key_and_request(holder: &str) -> Result<(String, String), TrustError> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, holder);
    let csr = params.serialize_request(&key)?;
    Ok((key.serialize_pem(), csr.pem()?))
}

/// The SHA-256 of a PEM certificate's DER, in lower-case hex.
pub fn fingerprint(cert_pem: &str) -> Result<String, TrustError> {
    let der = pem_der(cert_pem)?;
    let digest = ring::digest::digest(&ring::digest::SHA256, &der);
    Ok(digest.as_ref().iter().map(|b| format!("{b:02x}")).collect())
}

pub(crate) fn pem_der(cert_pem: &str) -> Result<Vec<u8>, TrustError> {
    let block = pem::parse(cert_pem)
        .map_err(|e| TrustError::Invalid(format!("a certificate's PEM: {e}")))?;
    Ok(block.into_contents())
}

/// The holder and role a certificate of this cluster names.
pub fn holder_of(cert_pem: &str) -> Result<(String, Role), TrustError> {
    let (holder, role, _) = holder_of_der(&pem_der(cert_pem)?)?;
    Ok((holder, role))
}

/// The holder, role and expiry (Unix seconds) of a certificate's DER.
pub(crate) fn holder_of_der(der: &[u8]) -> Result<(String, Role, u64), TrustError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| TrustError::Invalid(format!("a certificate: {e}")))?;
    let subject = cert.subject();
    let holder = subject
        .iter_common_name()
        .find_map(|name| name.as_str().ok())
        .map(str::to_string)
        .ok_or_else(|| TrustError::Invalid("a certificate without a common name".into()))?;
    let role = subject
        .iter_organizational_unit()
        .find_map(|name| name.as_str().ok())
        .and_then(Role::of)
        .ok_or_else(|| TrustError::Invalid(format!("{holder}'s certificate names no role")))?;
    let not_after = u64::try_from(cert.validity().not_after.timestamp()).unwrap_or(0);
    Ok((holder, role, not_after))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_issued_certificate_names_its_holder_and_role_and_nothing_of_the_request() {
        let (authority, key_pem) = Authority::create("home").expect("authority");
        let again = Authority::load(&authority.cert_pem, &key_pem).expect("reloaded");
        let (_key, csr) = key_and_request("i-wish-to-be-the-master").expect("request");
        let cert = again.issue(&csr, "node-b", Role::Node).expect("issued");
        assert_eq!(
            holder_of(&cert).expect("holder"),
            ("node-b".to_string(), Role::Node)
        );
        let admin = authority
            .issue(&csr, "laptop", Role::Admin)
            .expect("issued");
        assert_eq!(holder_of(&admin).expect("holder").1, Role::Admin);
        let print = authority.fingerprint().expect("fingerprint");
        assert_eq!(print.len(), 64);
        assert_eq!(
            print,
            fingerprint(&authority.cert_pem).expect("fingerprint")
        );
        assert_ne!(print, fingerprint(&cert).expect("fingerprint"));
        assert!(authority.issue("not a request", "x", Role::Node).is_err());
    }
}
