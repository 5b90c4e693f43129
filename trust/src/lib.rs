//! Trust between the machines of a cluster: an authority (a CA kept by
//! the node that ran `tessera cluster init`), certificates for nodes and
//! admin machines, and single-use join tokens with which a new machine
//! obtains its certificate without the authority's key ever leaving its
//! node. Zenoh's mutual TLS uses the files this crate writes.
//!
//! # Layout
//! - [`authority`]: the CA, certificates named by holder and role.
//! - [`invite`]: join tokens and the HMAC-authenticated join exchange.
//! - [`dir`]: a data dir's `cluster/` folder: init, invite, admit, store.
//! - [`signature`]: who sent a message: members sign what they put.
//! - [`handshake`]: revoked members refused at every TLS handshake.

pub mod authority;
pub mod dir;
pub mod handshake;
pub mod invite;
pub mod signature;

pub use authority::Role;
pub use dir::{ClusterDir, Credentials};
pub use invite::{Invite, JoinReply, JoinRequest, JoinToken};
pub use signature::{Sender, SignatureError, Signer, Verifier};

#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("certificate: {0}")]
    Certificate(#[from] rcgen::Error),
    #[error("{0}")]
    Invalid(String),
    /// A join request or answer that must not be accepted.
    #[error("refused: {0}")]
    Refused(String),
    #[error("{0} already holds a cluster's credentials")]
    Exists(String),
    #[error("{0} does not keep the cluster's authority: invite from the node that ran `tessera cluster init`")]
    NotAuthority(String),
    #[error("the system's random number generator failed")]
    Random,
}
