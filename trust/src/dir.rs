//! A node's cluster folder, `DATA_DIR/cluster/`: the authority's
//! certificate (`authority.pem`) on every member, its key
//! (`authority.key`) on the node that ran `init` only, this holder's
//! certificate and key (`cert.pem`, `key.pem`), and the open invites
//! (`invites/ID.json`). Keys and invites are written readable by their
//! owner only.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::authority::{key_and_request, Authority, Role};
use crate::invite::{Invite, JoinReply, JoinRequest, JoinToken};
use crate::TrustError;

const AUTHORITY_CERT: &str = "authority.pem";
const AUTHORITY_KEY: &str = "authority.key";
const CERT: &str = "cert.pem";
const KEY: &str = "key.pem";
const INVITES: &str = "invites";

/// The files zenoh's TLS needs: the authority to check peers against, and
/// this holder's certificate and key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credentials {
    pub authority: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Clone, Debug)]
pub struct ClusterDir {
    root: PathBuf,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> TrustError + '_ {
    move |source| TrustError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Writes `text` to `path`, readable by its owner only when `secret`.
fn write(path: &Path, text: &str, secret: bool) -> Result<(), TrustError> {
    let temporary = path.with_extension("part");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(&temporary)
        .map_err(io(&temporary))?;
    file.write_all(text.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(io(&temporary))?;
    std::fs::rename(&temporary, path).map_err(io(path))
}

pub(crate) fn read(path: &Path) -> Result<String, TrustError> {
    std::fs::read_to_string(path).map_err(io(path))
}

impl ClusterDir {
    /// The cluster folder of the data dir `data_dir`.
    pub fn of(data_dir: &Path) -> ClusterDir {
        ClusterDir {
            root: data_dir.join("cluster"),
        }
    }

    /// A cluster folder at `root` itself.
    pub fn at(root: impl Into<PathBuf>) -> ClusterDir {
        ClusterDir { root: root.into() }
    }

    pub fn path(&self) -> &Path {
        &self.root
    }

    fn file(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    /// This holder's credentials, when it has joined (or made) a cluster.
    pub fn credentials(&self) -> Option<Credentials> {
        let credentials = Credentials {
            authority: self.file(AUTHORITY_CERT),
            cert: self.file(CERT),
            key: self.file(KEY),
        };
        [&credentials.authority, &credentials.cert, &credentials.key]
            .iter()
            .all(|p| p.is_file())
            .then_some(credentials)
    }

    /// Whether this node keeps the authority's key (it can admit others).
    pub fn is_authority(&self) -> bool {
        self.file(AUTHORITY_KEY).is_file()
    }

    /// `tessera cluster init`: a new authority for `cluster`, and a node
    /// certificate for `holder` (this node) from it.
    pub fn init(&self, cluster: &str, holder: &str) -> Result<Credentials, TrustError> {
        if self.credentials().is_some() || self.is_authority() {
            return Err(TrustError::Exists(self.root.display().to_string()));
        }
        std::fs::create_dir_all(&self.root).map_err(io(&self.root))?;
        let (authority, authority_key) = Authority::create(cluster)?;
        write(&self.file(AUTHORITY_KEY), &authority_key, true)?;
        write(&self.file(AUTHORITY_CERT), &authority.cert_pem, false)?;
        let (key, csr) = key_and_request(holder)?;
        let cert = authority.issue(&csr, holder, Role::Node)?;
        write(&self.file(KEY), &key, true)?;
        write(&self.file(CERT), &cert, false)?;
        self.credentials()
            .ok_or_else(|| TrustError::Invalid("the credentials were not written".into()))
    }

    fn authority(&self) -> Result<Authority, TrustError> {
        if !self.is_authority() {
            return Err(TrustError::NotAuthority(self.root.display().to_string()));
        }
        Authority::load(
            &read(&self.file(AUTHORITY_CERT))?,
            &read(&self.file(AUTHORITY_KEY))?,
        )
    }

    /// The authority's certificate (every member has it).
    pub fn authority_pem(&self) -> Result<String, TrustError> {
        read(&self.file(AUTHORITY_CERT))
    }

    /// A new invite, kept until it is used (the authority's node only).
    pub fn invite(&self, role: Role, expires_unix: u64) -> Result<Invite, TrustError> {
        self.authority()?;
        let invites = self.file(INVITES);
        std::fs::create_dir_all(&invites).map_err(io(&invites))?;
        let invite = Invite::new(role, expires_unix)?;
        let json =
            serde_json::to_string(&invite).map_err(|e| TrustError::Invalid(e.to_string()))?;
        write(&invites.join(format!("{}.json", invite.id)), &json, true)?;
        Ok(invite)
    }

    /// Answers a join request: checks it against its invite, uses the
    /// invite up (a second request with the same token is refused), and
    /// issues the certificate.
    pub fn admit(&self, request: &JoinRequest, now_unix: u64) -> Result<JoinReply, TrustError> {
        let authority = self.authority()?;
        let unknown = || TrustError::Refused("unknown or already used join token".into());
        if request.id.is_empty() || !request.id.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(unknown());
        }
        let open = self.file(INVITES).join(format!("{}.json", request.id));
        let invite: Invite = match std::fs::read_to_string(&open) {
            Ok(json) => {
                serde_json::from_str(&json).map_err(|e| TrustError::Invalid(e.to_string()))?
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Err(unknown()),
            Err(error) => return Err(io(&open)(error)),
        };
        invite.check(request, now_unix)?;
        let holder = request.holder.trim();
        if holder.is_empty() || holder.len() > 128 {
            return Err(TrustError::Refused(
                "a joiner's name must have 1 to 128 characters".into(),
            ));
        }
        // Used up before the certificate exists: of two racing requests,
        // one renames the file and the other finds it gone.
        let used = open.with_extension("used");
        std::fs::rename(&open, &used).map_err(|_| unknown())?;
        let cert = authority.issue(&request.csr_pem, holder, invite.role)?;
        invite.reply(cert, authority.cert_pem.clone())
    }

    /// The joiner's side: a fresh key and its request for `holder`.
    pub fn request(
        &self,
        token: &JoinToken,
        holder: &str,
    ) -> Result<(String, JoinRequest), TrustError> {
        let (key, csr) = key_and_request(holder)?;
        Ok((key, token.request(holder, csr)?))
    }

    /// Keeps what the authority answered (checked against the token).
    pub fn store(
        &self,
        token: &JoinToken,
        key_pem: &str,
        reply: &JoinReply,
    ) -> Result<Credentials, TrustError> {
        token.accept(reply)?;
        std::fs::create_dir_all(&self.root).map_err(io(&self.root))?;
        write(&self.file(AUTHORITY_CERT), &reply.authority_pem, false)?;
        write(&self.file(KEY), key_pem, true)?;
        write(&self.file(CERT), &reply.cert_pem, false)?;
        self.credentials()
            .ok_or_else(|| TrustError::Invalid("the credentials were not written".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::authority::holder_of;

    #[test]
    fn init_invite_admit_store_and_a_token_used_twice() -> Result<(), TrustError> {
        let tmp = tempfile::tempdir().map_err(io(Path::new("tmp")))?;
        let first = ClusterDir::of(&tmp.path().join("a"));
        let credentials = first.init("home", "node-a")?;
        assert!(first.is_authority());
        assert!(matches!(
            first.init("home", "node-a"),
            Err(TrustError::Exists(_))
        ));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&credentials.key).map_err(io(&credentials.key))?;
        assert_eq!(mode.permissions().mode() & 0o777, 0o600);
        let invite = first.invite(Role::Node, u64::MAX)?;
        let token = invite.token("home", &first.authority_pem()?, "http://x", vec![])?;
        let second = ClusterDir::of(&tmp.path().join("b"));
        assert!(second.credentials().is_none());
        let (key, request) = second.request(&token, "node-b")?;
        let reply = first.admit(&request, 0)?;
        let stored = second.store(&token, &key, &reply)?;
        assert_eq!(
            holder_of(&read(&stored.cert)?)?,
            ("node-b".into(), Role::Node)
        );
        assert!(!second.is_authority());
        assert!(
            second.invite(Role::Node, u64::MAX).is_err(),
            "only the authority invites"
        );
        let again = first.admit(&request, 0);
        assert!(matches!(again, Err(TrustError::Refused(_))), "{again:?}");
        let mut probe = request;
        probe.id = "../../etc".into();
        assert!(first.admit(&probe, 0).is_err());
        Ok(())
    }
}
