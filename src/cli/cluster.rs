//! `tessera cluster init | invite | join | revoke`: a secured cluster,
//! whose links are all mutual TLS against an authority kept by the node
//! that ran `init`. A new machine joins with a single-use token (`invite`),
//! with which it obtains its own certificate (`tessera node --join TOKEN`,
//! or `tessera cluster join TOKEN` for a machine that only administers).
//! `revoke` refuses a member from then on (an event in the log).

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use tessera_trust::{ClusterDir, JoinReply, JoinToken, Role};

#[derive(Debug, Args)]
pub struct ClusterArgs {
    #[command(subcommand)]
    what: ClusterCommand,
}

#[derive(Debug, Subcommand)]
enum ClusterCommand {
    /// Secure a new cluster: make this node's data dir the authority and
    /// give this node its certificate (then restart the node).
    Init {
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// The cluster's namespace (the one `tessera node` runs in).
        #[arg(long, env = "TESSERA_NAMESPACE", default_value = "default")]
        namespace: String,
    },
    /// Print a single-use join token for one more machine (run it where
    /// `init` ran).
    Invite {
        #[arg(long)]
        data_dir: Option<PathBuf>,
        #[arg(long, env = "TESSERA_NAMESPACE", default_value = "default")]
        namespace: String,
        /// The token makes an admin machine (it administers, runs nothing)
        /// instead of a node.
        #[arg(long)]
        admin: bool,
        /// Minutes the token is valid.
        #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..=10_080))]
        ttl_minutes: u64,
        /// This node's HTTP API as the joiner reaches it (default: this
        /// machine's first network address, port 52415).
        #[arg(long)]
        join_url: Option<String>,
        /// This node's zenoh endpoint (repeatable) for a joiner on a network
        /// without multicast, e.g. tcp/192.168.1.20:5447 (start the node with
        /// a fixed --listen).
        #[arg(long)]
        connect: Vec<String>,
    },
    /// Join a secured cluster with a token without running a node (an
    /// admin machine's `tessera admin` and `tessera models` then use it).
    Join {
        token: String,
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// The name the certificate gives this machine (default: its
        /// hostname).
        #[arg(long)]
        name: Option<String>,
    },
    /// Refuse a member from now on: every node drops what it signs, its
    /// instances are placed again without it, and no machine joins by its
    /// name again. NAME is a node id (`tessera admin nodes`) or an admin
    /// machine's name.
    Revoke {
        name: String,
        #[command(flatten)]
        cluster: super::admin::ClusterArgs,
    },
}

pub fn run(args: ClusterArgs) -> anyhow::Result<()> {
    match args.what {
        ClusterCommand::Init {
            data_dir,
            namespace,
        } => init(
            &data_dir.unwrap_or_else(super::support::default_data_dir),
            &namespace,
        ),
        ClusterCommand::Invite {
            data_dir,
            namespace,
            admin,
            ttl_minutes,
            join_url,
            connect,
        } => {
            let data_dir = data_dir.unwrap_or_else(super::support::default_data_dir);
            let role = if admin { Role::Admin } else { Role::Node };
            let token = invite(&data_dir, &namespace, role, ttl_minutes, join_url, connect)?;
            println!("{token}");
            Ok(())
        }
        ClusterCommand::Join {
            token,
            data_dir,
            name,
        } => {
            let data_dir = data_dir.unwrap_or_else(super::support::default_data_dir);
            let name = name.unwrap_or_else(|| sysinfo::System::host_name().unwrap_or_default());
            let token = JoinToken::decode(&token)?;
            if token.role != Role::Admin {
                bail!("this is a node's token: use it with `tessera node --join TOKEN`");
            }
            super::support::client_runtime()?.block_on(join(&token, &data_dir, &name))?;
            eprintln!("joined cluster {:?} as admin {name:?}", token.cluster);
            Ok(())
        }
        ClusterCommand::Revoke { name, cluster } => {
            let options = cluster.options(None)?;
            if options.credentials.is_none() {
                bail!("revoking needs this machine's credentials of a secured cluster (--cluster-dir)");
            }
            let reply = super::support::client_runtime()?.block_on(async {
                let client = tessera_actors::admin::client::AdminClient::connect(options).await?;
                let reply = client.revoke(&name).await;
                let _ = client.close().await;
                anyhow::Ok(reply?)
            })?;
            if cluster.json {
                println!(
                    "{}",
                    serde_json::json!({ "revoked": name, "index": reply.index })
                );
            } else {
                println!("revoked {name} (event {})", reply.index);
            }
            Ok(())
        }
    }
}

fn init(data_dir: &Path, namespace: &str) -> anyhow::Result<()> {
    let node_id = tessera_actors::node::node_identity(data_dir)?;
    let folder = ClusterDir::of(data_dir);
    folder
        .init(namespace, &node_id)
        .with_context(|| format!("securing the cluster in {}", folder.path().display()))?;
    eprintln!(
        "cluster {namespace:?} secured: {} holds its authority (keep authority.key private \
         and backed up); restart the node, then add machines with `tessera cluster invite`",
        folder.path().display()
    );
    Ok(())
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn invite(
    data_dir: &Path,
    namespace: &str,
    role: Role,
    ttl_minutes: u64,
    join_url: Option<String>,
    connect: Vec<String>,
) -> anyhow::Result<String> {
    let folder = ClusterDir::of(data_dir);
    let expires = unix_now() + Duration::from_secs(ttl_minutes * 60).as_secs();
    let invite = folder.invite(role, expires)?;
    let join_url = match join_url {
        Some(url) => url,
        None => format!("http://{}:52415", first_address()?),
    };
    let token = invite.token(namespace, &folder.authority_pem()?, &join_url, connect)?;
    eprintln!(
        "a single-use {} token, valid for {ttl_minutes} minutes; on the new machine run:\n  \
         tessera {} TOKEN",
        role.as_str(),
        if role == Role::Admin {
            "cluster join"
        } else {
            "node --join"
        }
    );
    Ok(token.encode()?)
}

/// This machine's first non-loopback IPv4 address.
fn first_address() -> anyhow::Result<String> {
    let networks = sysinfo::Networks::new_with_refreshed_list()
        .context("listing this machine's network addresses: pass --join-url")?;
    networks
        .values()
        .flat_map(|data| data.ip_networks())
        .map(|network| network.addr)
        .find(|ip| ip.is_ipv4() && !ip.is_loopback())
        .map(|ip| ip.to_string())
        .context("no network address found: pass --join-url http://ADDRESS:PORT")
}

/// Obtains this machine's certificate with `token` (a fresh key, a
/// signing request to the authority's node, the answer checked).
pub async fn join(token: &JoinToken, data_dir: &Path, holder: &str) -> anyhow::Result<()> {
    if unix_now() > token.expires_unix {
        bail!("the join token has expired: ask for a new one (`tessera cluster invite`)");
    }
    let folder = ClusterDir::of(data_dir);
    if folder.credentials().is_some() {
        bail!(
            "{} already holds a cluster's credentials",
            folder.path().display()
        );
    }
    let (key, request) = folder.request(token, holder)?;
    let url = format!("{}/cluster/join", token.join_url.trim_end_matches('/'));
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()?;
    let answer = client
        .post(&url)
        .json(&request)
        .send()
        .await
        .with_context(|| format!("reaching the inviting node at {url}"))?;
    let status = answer.status();
    if !status.is_success() {
        let body = answer.text().await.unwrap_or_default();
        let message = serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(String::from))
            .unwrap_or(body);
        bail!("the inviting node refused to admit this machine ({status}): {message}");
    }
    let reply: JoinReply = answer
        .json()
        .await
        .context("the inviting node's answer is not a join reply")?;
    folder.store(token, &key, &reply)?;
    Ok(())
}
