//! Join tokens and the join exchange.
//!
//! `tessera cluster invite` makes an [`Invite`] (kept by the authority's
//! node) and prints its [`JoinToken`]: the invite's id and secret, the
//! authority's fingerprint and where to reach the inviter. The token never
//! holds the authority's key. The joiner makes its own key and sends a
//! signing request with an HMAC under the secret (the secret itself never
//! travels); the authority checks the HMAC, uses the invite up, and answers
//! the certificate and its own, again with an HMAC. The joiner checks that
//! and the authority's fingerprint. So an eavesdropper learns nothing it
//! can use, a man in the middle can change neither side's message, and a
//! token works once, until it expires.

use base64::Engine;
use ring::hmac;
use serde::{Deserialize, Serialize};

use crate::authority::{fingerprint, Role};
use crate::TrustError;

/// The prefix of a token's text (and its version).
const TOKEN_PREFIX: &str = "tessera-join-1.";

/// What the joiner is told.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JoinToken {
    /// The cluster (its namespace).
    pub cluster: String,
    pub id: String,
    /// 32 random bytes, base64url.
    pub secret: String,
    /// The SHA-256 of the authority's certificate, hex.
    pub authority: String,
    /// The inviting node's HTTP API, e.g. `http://192.168.1.20:52415`.
    pub join_url: String,
    /// The inviting node's zenoh endpoints (`tls/IP:PORT`).
    pub connect: Vec<String>,
    pub expires_unix: u64,
    pub role: Role,
}

/// What the authority keeps of an invite.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Invite {
    pub id: String,
    pub secret: String,
    pub expires_unix: u64,
    pub role: Role,
}

/// The joiner's request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JoinRequest {
    pub id: String,
    /// The name the joiner asks for (its node id, or an admin's name).
    pub holder: String,
    pub csr_pem: String,
    /// HMAC-SHA256 under the secret, hex.
    pub mac: String,
}

/// The authority's answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JoinReply {
    pub cert_pem: String,
    pub authority_pem: String,
    pub mac: String,
}

fn random_bytes<const N: usize>() -> Result<[u8; N], TrustError> {
    let mut bytes = [0u8; N];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
        .map_err(|_| TrustError::Random)?;
    Ok(bytes)
}

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || !text.is_ascii() {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

impl Invite {
    /// A new invite for `role`, valid until `expires_unix`.
    pub fn new(role: Role, expires_unix: u64) -> Result<Invite, TrustError> {
        Ok(Invite {
            id: hex(&random_bytes::<8>()?),
            secret: b64().encode(random_bytes::<32>()?),
            expires_unix,
            role,
        })
    }

    fn key(&self) -> Result<hmac::Key, TrustError> {
        let secret = b64()
            .decode(&self.secret)
            .map_err(|_| TrustError::Invalid("an invite's secret is not base64".into()))?;
        Ok(hmac::Key::new(hmac::HMAC_SHA256, &secret))
    }

    /// The token for this invite.
    pub fn token(
        &self,
        cluster: &str,
        authority_pem: &str,
        join_url: &str,
        connect: Vec<String>,
    ) -> Result<JoinToken, TrustError> {
        Ok(JoinToken {
            cluster: cluster.to_string(),
            id: self.id.clone(),
            secret: self.secret.clone(),
            authority: fingerprint(authority_pem)?,
            join_url: join_url.to_string(),
            connect,
            expires_unix: self.expires_unix,
            role: self.role,
        })
    }

    /// Whether `request` was made with this invite's secret, in time.
    pub fn check(&self, request: &JoinRequest, now_unix: u64) -> Result<(), TrustError> {
        if now_unix > self.expires_unix {
            return Err(TrustError::Refused("the join token has expired".into()));
        }
        let mac = unhex(&request.mac).ok_or(TrustError::Refused(BAD_MAC.into()))?;
        hmac::verify(&self.key()?, &request_text(request), &mac)
            .map_err(|_| TrustError::Refused(BAD_MAC.into()))
    }

    /// The answer to a checked request.
    pub fn reply(&self, cert_pem: String, authority_pem: String) -> Result<JoinReply, TrustError> {
        let mac = hmac::sign(&self.key()?, &reply_text(&cert_pem, &authority_pem));
        Ok(JoinReply {
            cert_pem,
            authority_pem,
            mac: hex(mac.as_ref()),
        })
    }
}

const BAD_MAC: &str = "the join request was not made with this invite's token";

fn request_text(request: &JoinRequest) -> Vec<u8> {
    format!(
        "tessera-join-request\0{}\0{}\0{}",
        request.id, request.holder, request.csr_pem
    )
    .into_bytes()
}

fn reply_text(cert_pem: &str, authority_pem: &str) -> Vec<u8> {
    format!("tessera-join-reply\0{cert_pem}\0{authority_pem}").into_bytes()
}

impl JoinToken {
    /// The token as one line of text.
    pub fn encode(&self) -> Result<String, TrustError> {
        let json = serde_json::to_vec(self).map_err(|e| TrustError::Invalid(e.to_string()))?;
        Ok(format!("{TOKEN_PREFIX}{}", b64().encode(json)))
    }

    pub fn decode(text: &str) -> Result<JoinToken, TrustError> {
        let body = text
            .trim()
            .strip_prefix(TOKEN_PREFIX)
            .ok_or_else(|| TrustError::Invalid("not a tessera join token".into()))?;
        let json = b64()
            .decode(body)
            .map_err(|_| TrustError::Invalid("the join token is damaged (not base64)".into()))?;
        serde_json::from_slice(&json)
            .map_err(|e| TrustError::Invalid(format!("the join token is damaged: {e}")))
    }

    fn key(&self) -> Result<hmac::Key, TrustError> {
        Invite {
            id: self.id.clone(),
            secret: self.secret.clone(),
            expires_unix: self.expires_unix,
            role: self.role,
        }
        .key()
    }

    /// The request for a certificate for `csr_pem`, named `holder`.
    pub fn request(&self, holder: &str, csr_pem: String) -> Result<JoinRequest, TrustError> {
        let mut request = JoinRequest {
            id: self.id.clone(),
            holder: holder.to_string(),
            csr_pem,
            mac: String::new(),
        };
        request.mac = hex(hmac::sign(&self.key()?, &request_text(&request)).as_ref());
        Ok(request)
    }

    /// Checks the authority's answer: made with the secret, and from the
    /// authority the token names.
    pub fn accept(&self, reply: &JoinReply) -> Result<(), TrustError> {
        let mac = unhex(&reply.mac).ok_or(TrustError::Refused(BAD_REPLY.into()))?;
        hmac::verify(
            &self.key()?,
            &reply_text(&reply.cert_pem, &reply.authority_pem),
            &mac,
        )
        .map_err(|_| TrustError::Refused(BAD_REPLY.into()))?;
        if fingerprint(&reply.authority_pem)? != self.authority {
            return Err(TrustError::Refused(
                "the answer names another authority than the token's".into(),
            ));
        }
        Ok(())
    }
}

const BAD_REPLY: &str = "the answer to the join request was not made with the token's secret";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::authority::{holder_of, key_and_request, Authority};

    #[test]
    fn a_token_joins_once_and_tampering_is_refused() -> Result<(), TrustError> {
        let (authority, _) = Authority::create("home")?;
        let invite = Invite::new(Role::Node, 1_000)?;
        let token = invite.token("home", &authority.cert_pem, "http://127.0.0.1:1", vec![])?;
        let text = token.encode()?;
        assert!(
            !text.contains(&authority.cert_pem),
            "the token carries no certificate"
        );
        let token = JoinToken::decode(&text)?;
        let (_key, csr) = key_and_request("node-b")?;
        let request = token.request("node-b", csr)?;
        assert!(!serde_json::to_string(&request)
            .unwrap_or_default()
            .contains(&invite.secret));
        invite.check(&request, 999)?;
        // Expired, or changed on the way: refused.
        assert!(invite.check(&request, 1_001).is_err());
        let mut renamed = request.clone();
        renamed.holder = "node-evil".into();
        assert!(invite.check(&renamed, 999).is_err());
        let other = Invite::new(Role::Node, 1_000)?;
        assert!(other.check(&request, 999).is_err());
        let cert = authority.issue(&request.csr_pem, &request.holder, invite.role)?;
        let reply = invite.reply(cert, authority.cert_pem.clone())?;
        token.accept(&reply)?;
        assert_eq!(holder_of(&reply.cert_pem)?.0, "node-b");
        // An answer from another authority, even with the right MAC, is refused.
        let (stranger, _) = Authority::create("home")?;
        let forged = invite.reply(reply.cert_pem.clone(), stranger.cert_pem.clone())?;
        assert!(token.accept(&forged).is_err());
        let mut tampered = reply;
        tampered.cert_pem.push(' ');
        assert!(token.accept(&tampered).is_err());
        assert!(JoinToken::decode("tessera-join-1.!!!").is_err());
        assert!(JoinToken::decode("hello").is_err());
        Ok(())
    }
}
