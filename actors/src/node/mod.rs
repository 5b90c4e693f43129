//! A tessera node: its identity, its zenoh session, and the actors that
//! keep its copy of the cluster (Replica), choose the master (Election,
//! which starts the Master when this node wins) and describe this machine
//! (node info). The router tasks here turn zenoh samples into actor
//! messages and answer the queryables.

pub mod supervisor;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;
use tessera_engine::gpu::DeviceChoice;

use ractor::{call_t, Actor, ActorRef};
use tessera_protos::v1::{
    self, event, ClusterState, Command, ElectionMessage, EventLogReply, EventLogRequest,
    GetStateReply, IndexedEvent, ListNodesReply, LocalEvent, NodeSummary,
};
use tessera_state::{Journal, State};
use tokio::sync::watch;
use zenoh::sample::SampleKind;

use crate::admin::{self, decode_request, AdminFailure};
use crate::bus::keys::{AdminMethod, KeyError, Keys};
pub use crate::bus::zenoh_config;
use crate::bus::{Asked, Bus, BusError, Signatures};
use crate::cluster::election::actor::{ElectionMsg, Leadership};
use crate::cluster::local_events::LocalEvents;
use crate::cluster::master::MasterMsg;
use crate::cluster::placement;
use crate::cluster::replica::{ReplicaArgs, ReplicaMsg};
use supervisor::{
    Children, Current, ElectionSettings, Health, NodeSupervisor, SupervisorArgs, SupervisorMsg,
    WorkerSettings,
};

/// How a node starts.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    pub namespace: String,
    /// Zenoh endpoints to listen on, e.g. `tcp/0.0.0.0:5447`.
    pub listen: Vec<String>,
    /// Zenoh endpoints of other nodes to connect to.
    pub connect: Vec<String>,
    /// Multicast scouting (off where the network blocks it; tests).
    pub multicast: bool,
    pub data_dir: PathBuf,
    /// Run models (a node without a worker still keeps the log and may lead).
    pub worker: bool,
    /// Compute threads of each runner process.
    pub runner_threads: usize,
    /// Where each runner puts its model: auto, cpu, gpu or gpu:N.
    pub runner_device: tessera_engine::gpu::DeviceChoice,
    /// Generations an instance this node's master places runs at once.
    pub max_concurrent: u32,
    /// Where to start looking for this node's slot of ring ports (`None`:
    /// a place picked from the node id; see [`claim_ring_slot`]).
    pub ring_port_base: Option<u16>,
    /// Where model files live.
    pub models: crate::worker::downloads::ModelStore,
    /// Use local model files only: never reach the hub.
    pub offline: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the node identity in {path} is not valid: {content:?}")]
    BadIdentity { path: String, content: String },
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error("event log: {0}")]
    Log(String),
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("zenoh configuration {key}: {reason}")]
    Config { key: String, reason: String },
    #[error("starting an actor: {0}")]
    Actor(String),
}

/// The node's persistent identity: created on first start in
/// `data_dir/node_key`, the same ever after.
pub fn node_identity(data_dir: &Path) -> Result<String, NodeError> {
    let path = data_dir.join("node_key");
    let io = |source| NodeError::Io {
        path: path.display().to_string(),
        source,
    };
    match std::fs::read_to_string(&path) {
        Ok(content) => {
            let id = content.trim().to_string();
            let valid = !id.is_empty()
                && id
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
            if valid {
                Ok(id)
            } else {
                Err(NodeError::BadIdentity {
                    path: path.display().to_string(),
                    content,
                })
            }
        }
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(data_dir).map_err(io)?;
            let id = uuid::Uuid::now_v7().to_string();
            // Written whole, then renamed: never a half-written identity.
            let tmp = data_dir.join("node_key.tmp");
            std::fs::write(&tmp, format!("{id}\n")).map_err(io)?;
            std::fs::rename(&tmp, &path).map_err(io)?;
            Ok(id)
        }
        Err(error) => Err(io(error)),
    }
}

/// The listen endpoints of the node's session, and the loopback endpoint its
/// runner child processes connect to: a TCP endpoint with a fixed port on
/// 127.0.0.1 or every address if the node listens on one, otherwise a free
/// loopback port added for them. With no endpoints given, zenoh's default
/// (every address, any port) is kept.
pub fn runner_endpoint(listen: &[String]) -> Result<(Vec<String>, String), NodeError> {
    let mut listen = if listen.is_empty() {
        vec!["tcp/[::]:0".to_string()]
    } else {
        listen.to_vec()
    };
    let reusable = listen.iter().find_map(|endpoint| {
        let address = endpoint.strip_prefix("tcp/")?;
        let address = address.split('#').next()?;
        let socket: std::net::SocketAddr = address.parse().ok()?;
        let loopback_reaches = match socket.ip() {
            std::net::IpAddr::V4(ip) => ip.is_loopback() || ip.is_unspecified(),
            std::net::IpAddr::V6(_) => false,
        };
        (loopback_reaches && socket.port() != 0).then(|| format!("tcp/127.0.0.1:{}", socket.port()))
    });
    if let Some(endpoint) = reusable {
        return Ok((listen, endpoint));
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|source| NodeError::Io {
            path: "a loopback port for runners".into(),
            source,
        })?
        .port();
    let endpoint = format!("tcp/127.0.0.1:{port}");
    listen.push(endpoint.clone());
    Ok((listen, endpoint))
}

/// A running node; dropping it does not stop it, [`RunningNode::shutdown`] does.
pub struct RunningNode {
    pub node_id: String,
    bus: Bus,
    supervisor: ActorRef<SupervisorMsg>,
    children: Children,
    health: watch::Receiver<Health>,
    leadership: Leadership,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    _token: zenoh::liveliness::LivelinessToken,
    _ring_slot: RingSlot,
}

/// The slot of ring ports a node claimed: its first port stays bound for as
/// long as the node runs, so that no other node on this machine (of this
/// cluster or another) claims the same slot; its ranks use the ports after.
pub struct RingSlot {
    pub base: u16,
    _held: std::net::TcpListener,
}

/// Claims the first free slot of [`placement::RING_SLOT`] ports at or after
/// `preferred` (or after a place picked from the node id, so that nodes
/// that start at once rarely try the same slot), wrapping within
/// [`placement::RING_PORTS`].
pub fn claim_ring_slot(preferred: Option<u16>, node_id: &str) -> Result<RingSlot, NodeError> {
    use crate::cluster::placement::{RING_PORTS, RING_SLOT};
    let slots = (RING_PORTS.end - RING_PORTS.start) / RING_SLOT;
    let picked = crate::cluster::placement::fnv1a(node_id.as_bytes());
    let (first, from_slot) = match preferred {
        Some(base) => (Some(base), 0),
        None => (None, (picked % u64::from(slots)) as u16),
    };
    let candidates = first
        .into_iter()
        .chain((0..slots).map(|i| RING_PORTS.start + ((from_slot + i) % slots) * RING_SLOT));
    for base in candidates {
        if let Ok(held) = std::net::TcpListener::bind(("0.0.0.0", base)) {
            return Ok(RingSlot { base, _held: held });
        }
    }
    Err(NodeError::Config {
        key: "ring ports".into(),
        reason: format!(
            "no free slot of {RING_SLOT} ports in {}..{}",
            RING_PORTS.start, RING_PORTS.end
        ),
    })
}

impl RunningNode {
    /// Stops the actors, flushes the log and closes the session.
    pub async fn shutdown(self) {
        // Children that end from here on are not restarted.
        let _ = ractor::call_t!(
            self.supervisor,
            SupervisorMsg::Stopping,
            crate::ACTOR_CALL_MS
        );
        for task in &self.tasks {
            task.abort();
        }
        if let Some(worker) = &self.children.worker {
            // Its runners are told to shut down and waited for.
            let _ = worker
                .get()
                .stop_and_wait(Some("shutdown".into()), Some(Duration::from_secs(10)))
                .await;
        }
        self.children.election.get().stop(Some("shutdown".into()));
        // The replica flushes its log as it stops.
        let _ = self
            .children
            .replica
            .stop_and_wait(Some("shutdown".into()), Some(Duration::from_secs(5)))
            .await;
        self.supervisor.stop(Some("shutdown".into()));
        self.bus.close().await;
    }

    /// Reports that the HTTP API (served beside the node) failed: the
    /// wait before serving it again, or none when it is given up (the
    /// node's `Health` then says why it cannot go on).
    pub async fn api_failed(&self, why: String) -> Option<Duration> {
        ractor::call_t!(
            self.supervisor,
            |reply| SupervisorMsg::Failed(supervisor::Child::Api, why.clone(), reply),
            crate::ACTOR_CALL_MS
        )
        .ok()
        .flatten()
    }

    /// Reports that the HTTP API is served again.
    pub fn api_restarted(&self) {
        let _ = self
            .supervisor
            .cast(SupervisorMsg::Restarted(supervisor::Child::Api));
    }

    /// How the node's actors are doing; `fatal` set: the node cannot go on
    /// and should be shut down.
    pub fn health(&self) -> watch::Receiver<Health> {
        self.health.clone()
    }

    /// The node's typed zenoh session.
    pub fn bus(&self) -> &Bus {
        &self.bus
    }

    /// The replica: the log, and the state it publishes.
    pub fn replica(&self) -> &ActorRef<ReplicaMsg> {
        &self.children.replica
    }

    /// The master this node follows, as the election publishes it.
    pub fn leadership(&self) -> &Leadership {
        &self.leadership
    }

    /// Messages dropped as malformed or invalid so far.
    pub fn dropped(&self) -> u64 {
        self.bus.dropped()
    }
}

/// Starts a node.
pub async fn start(options: NodeOptions) -> Result<RunningNode, NodeError> {
    let node_id = node_identity(&options.data_dir)?;
    let log = OpenedLog::open(&options.data_dir, &node_id)?;
    let ring_slot = claim_ring_slot(options.ring_port_base, &node_id)?;
    tracing::info!(base = ring_slot.base, "ring ports");
    let (listen, runner_endpoint) = runner_endpoint(&options.listen)?;
    // After `tessera cluster init` or `--join`: every link is mutual TLS.
    let credentials = tessera_trust::ClusterDir::of(&options.data_dir).credentials();
    let (bus, signatures) = open_bus(&options, &listen, credentials.as_ref(), &log.revoked).await?;
    let secured = credentials.is_some();
    let token = bus.declare_token(bus.keys.alive(&node_id)?).await?;
    let downloader = Arc::new(crate::worker::downloads::Downloader {
        store: options.models.clone(),
        client: hub_client(options.offline)?,
        parallel: 4,
    });
    // Every node reports itself (a node without a worker too: it is a
    // member, shown by `admin nodes`, but placement skips it).
    let events = Arc::new(LocalEvents::new(bus.clone(), node_id.clone()));
    let (health_tx, health) = watch::channel(Health::default());
    let leadership = Leadership::default();
    let args = supervisor_args(SupervisedParts {
        options: &options,
        node_id: &node_id,
        bus: &bus,
        log,
        secured,
        leadership: &leadership,
        events: &events,
        runner_endpoint,
        downloader: &downloader,
        health: health_tx,
    })?;
    let (supervisor, _) = Actor::spawn(None, NodeSupervisor, args)
        .await
        .map_err(actor_error)?;
    let children = ractor::call_t!(supervisor, SupervisorMsg::Children, crate::ACTOR_CALL_MS)
        .map_err(|e| NodeError::Actor(e.to_string()))?;
    let replica = children.replica.clone();
    let router = Router {
        downloader,
        node_id: node_id.clone(),
        bus: bus.clone(),
        replica: replica.clone(),
        election: children.election.clone(),
        leadership: leadership.clone(),
    };
    let mut tasks = router.spawn_all().await?;
    if let Some(signatures) = signatures {
        tasks.push(refuse_the_revoked(signatures, &replica).await?);
    }
    tasks.push(tokio::spawn(resend_unindexed_reports(
        events.clone(),
        replica.clone(),
    )));
    // What this node says of itself beyond what the machine tells.
    let own = v1::NodeInfo {
        no_worker: !options.worker,
        ring_port_base: u32::from(ring_slot.base),
        device: options.runner_device.to_string(),
        ..Default::default()
    };
    let speed = Arc::new(std::sync::atomic::AtomicU64::new(0));
    if options.worker {
        let (speed, dir) = (speed.clone(), options.data_dir.clone());
        let (device, threads) = (options.runner_device, options.runner_threads);
        tokio::task::spawn_blocking(move || {
            let measured = decode_speed(&dir, device, threads);
            speed.store(measured, std::sync::atomic::Ordering::Relaxed);
        });
    }
    tasks.push(tokio::spawn(publish_node_info(
        events,
        options.data_dir.clone(),
        (own, speed),
        replica,
        health.clone(),
    )));
    Ok(RunningNode {
        node_id,
        bus,
        supervisor,
        children,
        health,
        leadership,
        tasks,
        _token: token,
        _ring_slot: ring_slot,
    })
}

fn actor_error(error: ractor::SpawnErr) -> NodeError {
    NodeError::Actor(error.to_string())
}

/// The node's event log as it was left, and what the node learns from it
/// before it meets anyone.
struct OpenedLog {
    journal: Journal,
    /// The election clock of the last session in the log.
    clock: u64,
    /// Any other node is in the log (even one this node timed out while it
    /// led alone): this node has been in a cluster and rejoins it.
    was_member: bool,
    /// The members revoked so far, refused before any message is read.
    revoked: Vec<String>,
}

impl OpenedLog {
    fn open(data_dir: &Path, node_id: &str) -> Result<Self, NodeError> {
        let events_dir = data_dir.join("events");
        let journal = Journal::open(&events_dir, Journal::DEFAULT_SNAPSHOT_EVERY)
            .map_err(|e| NodeError::Log(format!("{}: {e}", events_dir.display())))?;
        let clock = journal.state().session().map_or(0, |s| s.election_clock);
        let logged = journal.state().as_proto();
        let was_member = logged
            .nodes
            .keys()
            .chain(logged.local_seqs.keys())
            .chain(logged.session.iter().map(|s| &s.master_node_id))
            .any(|node| node != node_id);
        let revoked = logged.revoked.clone();
        tracing::info!(
            node_id,
            last_index = journal.state().last_index(),
            "opened the event log"
        );
        Ok(Self {
            journal,
            clock,
            was_member,
            revoked,
        })
    }
}

/// The node's zenoh session: mutual TLS with signed messages where the
/// node holds cluster credentials, revoked members refused from the start.
async fn open_bus(
    options: &NodeOptions,
    listen: &[String],
    credentials: Option<&tessera_trust::Credentials>,
    revoked: &[String],
) -> Result<(Bus, Option<Arc<Signatures>>), NodeError> {
    if credentials.is_some() {
        tracing::info!("secured cluster: mutual TLS against the cluster's authority");
    } else {
        tracing::warn!(
            "open cluster: any machine that reaches this node's zenoh port can join it; \
             secure it with `tessera cluster init`"
        );
    }
    let mut config = zenoh_config(
        "peer",
        listen,
        &options.connect,
        options.multicast,
        credentials,
    )?;
    crate::bus::deny_revoked(&mut config, revoked)?;
    let signatures = match credentials {
        Some(credentials) => Some(Arc::new(Signatures::load(credentials)?)),
        None => None,
    };
    if let Some(signatures) = &signatures {
        signatures.verifier.set_revoked(revoked.iter().cloned());
        if let Err(error) = tessera_trust::handshake::install() {
            tracing::warn!(%error, "revoked members are refused by their signatures only");
        }
        tessera_trust::handshake::set_revoked(revoked.iter().cloned());
    }
    let session = zenoh::open(config).await.map_err(BusError::zenoh)?;
    let keys = Keys::new(&options.namespace)?;
    let bus = Bus::new(session, keys).with_signatures(signatures.clone());
    Ok((bus, signatures))
}

/// What the supervisor's children are made of.
struct SupervisedParts<'a> {
    options: &'a NodeOptions,
    node_id: &'a str,
    bus: &'a Bus,
    log: OpenedLog,
    secured: bool,
    leadership: &'a Leadership,
    events: &'a Arc<LocalEvents>,
    runner_endpoint: String,
    downloader: &'a Arc<crate::worker::downloads::Downloader>,
    health: watch::Sender<Health>,
}

/// The Replica (the log), the Election (which starts the Master on the
/// winner) and the Worker (if this node runs models), for the supervisor.
fn supervisor_args(parts: SupervisedParts<'_>) -> Result<SupervisorArgs, NodeError> {
    let SupervisedParts {
        options,
        node_id,
        bus,
        log,
        secured,
        leadership,
        events,
        runner_endpoint,
        downloader,
        health,
    } = parts;
    let applied = Arc::new(AtomicU64::new(0));
    let replica = ReplicaArgs {
        journal: log.journal,
        bus: bus.clone(),
        applied: applied.clone(),
    };
    let election = ElectionSettings {
        node_id: node_id.to_string(),
        bus: bus.clone(),
        applied,
        clock: log.clock,
        was_member: log.was_member,
        leadership: leadership.clone(),
        max_concurrent: options.max_concurrent,
        secured,
    };
    let worker = if options.worker {
        Some(WorkerSettings {
            node_id: node_id.to_string(),
            bus: bus.clone(),
            events: events.clone(),
            exe: std::env::current_exe().map_err(|source| NodeError::Io {
                path: "the tessera binary".into(),
                source,
            })?,
            data_dir: options.data_dir.clone(),
            threads: options.runner_threads.max(1),
            device: options.runner_device,
            runner_endpoint,
            downloader: downloader.clone(),
        })
    } else {
        None
    };
    Ok(SupervisorArgs {
        replica,
        election,
        worker,
        health,
    })
}

/// The hub client downloads use; none when the node is offline.
fn hub_client(offline: bool) -> Result<Option<Arc<tessera_hub::HubClient>>, NodeError> {
    if offline {
        return Ok(None);
    }
    let client = tessera_hub::HubClient::from_env().map_err(|e| NodeError::Config {
        key: "HF_ENDPOINT".into(),
        reason: e.to_string(),
    })?;
    Ok(Some(Arc::new(client)))
}

/// Keeps the verifier's revoked members those of the log, as it grows.
async fn refuse_the_revoked(
    signatures: Arc<Signatures>,
    replica: &ActorRef<ReplicaMsg>,
) -> Result<tokio::task::JoinHandle<()>, NodeError> {
    let mut changes = call_t!(replica, ReplicaMsg::Watch, crate::ACTOR_CALL_MS)
        .map_err(|e| NodeError::Actor(e.to_string()))?;
    Ok(tokio::spawn(async move {
        let mut known: Vec<String> = Vec::new();
        loop {
            let revoked = changes.borrow_and_update().revoked.clone();
            if revoked != known {
                tracing::warn!(?revoked, "refusing revoked members");
                signatures.verifier.set_revoked(revoked.iter().cloned());
                tessera_trust::handshake::set_revoked(revoked.iter().cloned());
                known = revoked;
            }
            if changes.changed().await.is_err() {
                break;
            }
        }
    }))
}

/// Turns zenoh traffic into actor messages, and answers queries.
#[derive(Clone)]
struct Router {
    node_id: String,
    bus: Bus,
    replica: ActorRef<ReplicaMsg>,
    /// The Election as it is now (the supervisor may have restarted it).
    election: Current<ElectionMsg>,
    leadership: Leadership,
    /// Its hub client builds custom model cards (`add_model`).
    downloader: Arc<crate::worker::downloads::Downloader>,
}

impl Router {
    /// The master's answer to an admin mutation, encoded: its reply, or a
    /// refusal of a request that does not decode (silence would read as a
    /// dead cluster). `None` when the master's actor did not answer (it is
    /// stopping): the asker asks again, and the next master answers.
    async fn master_answer(
        &self,
        method: AdminMethod,
        master: &ActorRef<MasterMsg>,
        key: &str,
        payload: &[u8],
    ) -> Option<Vec<u8>> {
        match self.ask_master(method, master, key, payload).await {
            Ok(answer) => answer,
            Err(failure) => Some(self.refusal(key, &failure)),
        }
    }

    async fn ask_master(
        &self,
        method: AdminMethod,
        master: &ActorRef<MasterMsg>,
        key: &str,
        payload: &[u8],
    ) -> Result<Option<Vec<u8>>, AdminFailure> {
        const MS: u64 = crate::ACTOR_CALL_MS;
        let answer = match method {
            AdminMethod::Place => {
                let request = decode_request(key, payload)?;
                encoded(call_t!(master, MasterMsg::Place, MS, request))
            }
            AdminMethod::Delete => {
                let request = decode_request(key, payload)?;
                encoded(call_t!(master, MasterMsg::Delete, MS, request))
            }
            AdminMethod::Download => {
                let request = decode_request(key, payload)?;
                encoded(call_t!(master, MasterMsg::Download, MS, request))
            }
            AdminMethod::Revoke => {
                let request = decode_request(key, payload)?;
                encoded(call_t!(master, MasterMsg::Revoke, MS, request))
            }
            AdminMethod::Draft => {
                let request = decode_request(key, payload)?;
                encoded(call_t!(master, MasterMsg::SetDraft, MS, request))
            }
            AdminMethod::AddModel => {
                let built = self.card_from_hub(&decode_request(key, payload)?).await?;
                let reply = call_t!(master, MasterMsg::AddCard, MS, built.card);
                encoded(reply.map(|reply| v1::AddModelReply {
                    bytes_fetched: built.bytes_fetched,
                    ..reply
                }))
            }
            other => {
                return Err(AdminFailure::Internal(format!(
                    "{other:?} is not a mutation"
                )))
            }
        };
        Ok(answer)
    }

    /// A custom card from the hub, built by the master's node.
    async fn card_from_hub(
        &self,
        request: &v1::AddModelRequest,
    ) -> Result<crate::catalogue::gguf_card::BuiltCard, AdminFailure> {
        let Some(client) = &self.downloader.client else {
            return Err(AdminFailure::Unavailable(
                "the master node is offline (--offline): it cannot read the hub".into(),
            ));
        };
        let choice = crate::catalogue::gguf_card::Choice {
            file: request.file.clone(),
            quant: request.quant.clone(),
        };
        Ok(
            crate::catalogue::card_from_hub(client, &request.hub_repo, &request.revision, &choice)
                .await?,
        )
    }

    /// An admin read answered from this node's state; `None` when the
    /// replica did not answer (as if this node were not there).
    async fn read_answer(&self, method: AdminMethod, key: &str, payload: &[u8]) -> Option<Vec<u8>> {
        let state = call_t!(self.replica, ReplicaMsg::GetState, crate::ACTOR_CALL_MS).ok()?;
        Some(match self.read(method, state, key, payload).await {
            Ok(bytes) => bytes,
            Err(failure) => self.refusal(key, &failure),
        })
    }

    async fn read(
        &self,
        method: AdminMethod,
        state: Arc<ClusterState>,
        key: &str,
        payload: &[u8],
    ) -> Result<Vec<u8>, AdminFailure> {
        use prost::Message;
        let bytes = match method {
            AdminMethod::State => {
                decode_request::<v1::GetStateRequest>(key, payload)?;
                state_reply(Arc::unwrap_or_clone(state)).encode_to_vec()
            }
            AdminMethod::Nodes => {
                decode_request::<v1::ListNodesRequest>(key, payload)?;
                let master = self.leadership.master().map(|(m, _)| m);
                nodes_reply(&state, master.as_deref()).encode_to_vec()
            }
            AdminMethod::Instances => {
                decode_request::<v1::ListInstancesRequest>(key, payload)?;
                v1::ListInstancesReply {
                    instances: state.instances.values().cloned().collect(),
                    error: None,
                }
                .encode_to_vec()
            }
            AdminMethod::Previews => {
                previews_reply(&state, &decode_request(key, payload)?).encode_to_vec()
            }
            AdminMethod::Events => self
                .events_reply(&state, &decode_request(key, payload)?)
                .await
                .encode_to_vec(),
            AdminMethod::Models => {
                decode_request::<v1::ListModelsRequest>(key, payload)?;
                crate::catalogue::listings(&state).encode_to_vec()
            }
            AdminMethod::Downloads => {
                downloads_reply(&state, &decode_request(key, payload)?).encode_to_vec()
            }
            other => return Err(AdminFailure::Internal(format!("{other:?} is not a read"))),
        };
        Ok(bytes)
    }

    async fn events_reply(
        &self,
        state: &ClusterState,
        request: &v1::EventsRangeRequest,
    ) -> v1::EventsRangeReply {
        let from = request.from_index.max(1);
        v1::EventsRangeReply {
            events: self.events_between(from, request.to_index).await,
            last_index: state.last_index,
            error: None,
        }
    }

    /// The replica's events from `from` to `to` (0: to the end); none if
    /// it did not answer.
    async fn events_between(&self, from: u64, to: u64) -> Vec<IndexedEvent> {
        let to = if to == 0 { u64::MAX } else { to };
        call_t!(
            self.replica,
            |reply| ReplicaMsg::GetRange { from, to, reply },
            crate::ACTOR_CALL_MS
        )
        .unwrap_or_default()
    }

    /// A refusal, encoded (and logged: it is a client's or a bug's trace).
    fn refusal(&self, key: &str, failure: &AdminFailure) -> Vec<u8> {
        tracing::warn!(key, %failure, kind = ?failure.kind(), "admin request refused");
        admin::error_reply(failure)
    }

    /// The node's routes: each subscription and queryable of the session
    /// turns its messages into one actor's messages.
    async fn spawn_all(&self) -> Result<Vec<tokio::task::JoinHandle<()>>, NodeError> {
        let keys = &self.bus.keys;
        let election = self.election.clone();
        let replica = self.replica.clone();
        let mut tasks = vec![
            self.bus
                .route(keys.election(), move |_, message: ElectionMessage| {
                    let _ = election.get().cast(ElectionMsg::Message(message));
                })
                .await?,
            self.route_liveliness().await?,
            self.bus
                // The master commits its own events before it puts them.
                .route_from_others(keys.global_events(), move |_, event: IndexedEvent| {
                    let _ = replica.cast(ReplicaMsg::Global(event));
                })
                .await?,
        ];
        // Commands and local events, for the master (if it is this node):
        // a follower does not even check their signatures.
        let leads = || {
            let leadership = self.leadership.clone();
            move || leadership.local_master().is_some()
        };
        let this = self.clone();
        tasks.push(
            self.bus
                .route_when(keys.commands(), leads(), move |_, command: Command| {
                    if let Some(master) = this.leadership.local_master() {
                        let _ = master.cast(MasterMsg::Command(command));
                    }
                })
                .await?,
        );
        let this = self.clone();
        tasks.push(
            self.bus
                .route_when(keys.local_events(), leads(), move |_, event: LocalEvent| {
                    if let Some(master) = this.leadership.local_master() {
                        let _ = master.cast(MasterMsg::Local(event));
                    }
                })
                .await?,
        );
        // The event log, answered by the master only.
        let this = self.clone();
        tasks.push(
            self.bus
                .answer(keys.event_log(), move |asked| {
                    let this = this.clone();
                    async move { this.event_log_answer(asked).await }
                })
                .await?,
        );
        // Admin mutations, answered by the master only (a custom card is
        // built from the hub by the master's node).
        for method in [
            AdminMethod::Place,
            AdminMethod::Delete,
            AdminMethod::Download,
            AdminMethod::AddModel,
            AdminMethod::Revoke,
            AdminMethod::Draft,
        ] {
            let this = self.clone();
            let answer = move |asked: Asked| {
                let this = this.clone();
                async move {
                    let master = this.leadership.local_master()?;
                    this.master_answer(method, &master, &asked.key, &asked.payload)
                        .await
                }
            };
            tasks.push(self.bus.answer(keys.admin(method), answer).await?);
        }
        // Admin reads: answered from this node's state. A query may name
        // one node with `?node=ID`.
        for method in [
            AdminMethod::State,
            AdminMethod::Nodes,
            AdminMethod::Instances,
            AdminMethod::Previews,
            AdminMethod::Events,
            AdminMethod::Models,
            AdminMethod::Downloads,
        ] {
            let this = self.clone();
            let answer = move |asked: Asked| {
                let this = this.clone();
                async move {
                    if asked.node.as_ref().is_some_and(|n| *n != this.node_id) {
                        return None;
                    }
                    this.read_answer(method, &asked.key, &asked.payload).await
                }
            };
            tasks.push(self.bus.answer(keys.admin(method), answer).await?);
        }
        Ok(tasks)
    }

    /// Liveliness: nodes coming and going (with those already there).
    async fn route_liveliness(&self) -> Result<tokio::task::JoinHandle<()>, NodeError> {
        let tokens = self
            .bus
            .subscribe_liveliness(self.bus.keys.alive_any(), true)
            .await?;
        let this = self.clone();
        Ok(tokio::spawn(async move {
            while let Ok(sample) = tokens.recv_async().await {
                let key = sample.key_expr().as_str();
                let Some(node) = this.bus.keys.node_of_alive_key(key) else {
                    continue;
                };
                let message = match sample.kind() {
                    SampleKind::Put => ElectionMsg::NodeAlive(node.to_string()),
                    SampleKind::Delete => ElectionMsg::NodeGone(node.to_string()),
                };
                let _ = this.election.get().cast(message);
            }
        }))
    }

    /// A range of the event log, when this node is the master.
    async fn event_log_answer(&self, asked: Asked) -> Option<Vec<u8>> {
        self.leadership.local_master()?;
        let (master_node_id, election_clock) = self.leadership.master()?;
        let request = self
            .bus
            .decode::<EventLogRequest>(&asked.key, &asked.payload)?;
        let events = self
            .events_between(request.from_index, request.to_index)
            .await;
        let last_index = call_t!(self.replica, ReplicaMsg::GetState, crate::ACTOR_CALL_MS)
            .map_or(0, |state| state.last_index);
        let reply = EventLogReply {
            events,
            last_index,
            session: Some(v1::SessionId {
                master_node_id,
                election_clock,
            }),
        };
        Some(prost::Message::encode_to_vec(&reply))
    }
}

/// A reply, encoded; `None` when the actor did not answer.
fn encoded<M: prost::Message, E>(reply: Result<M, E>) -> Option<Vec<u8>> {
    reply.ok().map(|m| m.encode_to_vec())
}

fn state_reply(state: ClusterState) -> GetStateReply {
    let digest = State::from_proto(state.clone()).digest();
    GetStateReply {
        state: Some(state),
        digest: digest.to_string(),
        error: None,
    }
}

/// The nodes, with the master marked; without a master, an error too.
fn nodes_reply(state: &ClusterState, master: Option<&str>) -> ListNodesReply {
    let nodes = state
        .nodes
        .iter()
        .map(|(id, node)| NodeSummary {
            node_id: id.clone(),
            info: node.info.clone(),
            is_master: master == Some(id.as_str()),
        })
        .collect();
    let error = master
        .is_none()
        .then(|| AdminFailure::Unavailable("no master elected yet".into()).to_proto());
    ListNodesReply { nodes, error }
}

fn previews_reply(
    state: &ClusterState,
    request: &v1::PlacementPreviewsRequest,
) -> v1::PlacementPreviewsReply {
    match crate::catalogue::find(state, &request.model_id) {
        Some(card) => v1::PlacementPreviewsReply {
            previews: placement::previews(
                &card,
                &placement::NodeCapacity::from_state(state),
                &request.node_ids,
            ),
            error: None,
        },
        None => v1::PlacementPreviewsReply {
            previews: Vec::new(),
            error: Some(
                AdminFailure::NotFound(format!("unknown model {:?}", request.model_id)).to_proto(),
            ),
        },
    }
}

/// Every node's downloads, or one node's (`node_id` set).
fn downloads_reply(
    state: &ClusterState,
    request: &v1::ListDownloadsRequest,
) -> v1::ListDownloadsReply {
    let downloads = state
        .downloads
        .iter()
        .filter(|(node, _)| request.node_id.is_empty() || **node == request.node_id)
        .flat_map(|(node, d)| {
            d.models.values().map(|p| v1::NodeDownloadEntry {
                node_id: node.clone(),
                progress: Some(p.clone()),
            })
        })
        .collect();
    v1::ListDownloadsReply {
        downloads,
        error: None,
    }
}

/// This machine's GPU adapters, asked once (drivers are slow to ask, and
/// the adapters do not change while a node runs).
fn gpu_adapters() -> &'static [v1::GpuAdapter] {
    static ADAPTERS: std::sync::OnceLock<Vec<v1::GpuAdapter>> = std::sync::OnceLock::new();
    ADAPTERS.get_or_init(|| {
        tessera_engine::gpu::adapters()
            .into_iter()
            .map(|a| v1::GpuAdapter {
                index: a.index as u32,
                name: a.name,
                backend: a.backend,
                kind: a.kind.name().to_string(),
                driver: a.driver,
                memory_bytes: a.memory_bytes,
                unified_memory: a.unified_memory,
                shader_f16: a.shader_f16,
                subgroups: a.subgroups,
            })
            .collect()
    })
}

/// The CPU, and the backend of each kind of GPU adapter there is.
fn engine_backends(gpus: &[v1::GpuAdapter]) -> Vec<i32> {
    let mut backends = vec![v1::EngineBackend::Cpu as i32];
    for gpu in gpus {
        let backend = match gpu.backend.as_str() {
            "vulkan" => v1::EngineBackend::Vulkan,
            "metal" => v1::EngineBackend::Metal,
            "dx12" => v1::EngineBackend::Dx12,
            _ => continue,
        } as i32;
        if !backends.contains(&backend) {
            backends.push(backend);
        }
    }
    backends
}

/// Gathers this machine's facts with `sysinfo`, and its GPU adapters.
pub fn gather_node_info(data_dir: &Path) -> v1::NodeInfo {
    use sysinfo::{Networks, System};
    let gpus = gpu_adapters();
    let (memory_total_bytes, memory_available_bytes) = match System::new() {
        Ok(mut system) => {
            system.refresh_memory();
            (system.total_memory(), system.available_memory())
        }
        Err(error) => {
            tracing::warn!(%error, "reading memory");
            (0, 0)
        }
    };
    let mut addresses = Vec::new();
    if let Ok(networks) = Networks::new_with_refreshed_list() {
        for (name, data) in networks.iter() {
            let name = name.to_string_lossy().to_string();
            for ip in data.ip_networks() {
                let kind = if ip.addr.is_loopback() {
                    v1::LinkKind::Loopback
                } else if name.starts_with("wl") {
                    v1::LinkKind::Wifi
                } else {
                    v1::LinkKind::Ethernet
                };
                if ip.addr.is_ipv4() {
                    addresses.push(v1::NetworkAddress {
                        interface: name.clone(),
                        ip: ip.addr.to_string(),
                        kind: kind as i32,
                    });
                }
            }
        }
    }
    addresses.sort_by(|a, b| (a.kind, &a.ip).cmp(&(b.kind, &b.ip)));
    let disk_available_bytes = crate::worker::downloads::free_space(data_dir).unwrap_or(0);
    v1::NodeInfo {
        hostname: System::host_name().unwrap_or_default(),
        os: System::name().unwrap_or_default(),
        os_version: System::os_version().unwrap_or_default(),
        cpu_model: System::cpu_arch(),
        cpu_cores: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        memory_total_bytes,
        memory_available_bytes,
        disk_available_bytes,
        addresses,
        engine_backends: engine_backends(gpus),
        gpus: gpus.to_vec(),
        device: String::new(),
        decode_bytes_per_second: 0,
        tessera_version: env!("CARGO_PKG_VERSION").to_string(),
        gathered_at_unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        no_worker: false,
        ring_port_base: 0,
        actor_restarts: 0,
        last_actor_failure: String::new(),
    }
}

/// Puts this node's reports that the state does not show yet again (the
/// master that was to index them died), twice a second at most.
async fn resend_unindexed_reports(events: Arc<LocalEvents>, replica: ActorRef<ReplicaMsg>) {
    let mut interval = tokio::time::interval(Duration::from_millis(500));
    loop {
        interval.tick().await;
        let Ok(state) = ractor::call_t!(replica, ReplicaMsg::GetState, 2_000) else {
            continue;
        };
        let indexed = state.local_seqs.get(events.node_id()).copied().unwrap_or(0);
        events.acknowledge(indexed).await;
    }
}

/// This node's decode speed on its device: as kept in `decode-speed.json`
/// in its data dir, else measured now (a fraction of a second) and kept.
/// It is measured again when the device, the adapters or tessera change.
fn decode_speed(data_dir: &Path, device: DeviceChoice, threads: usize) -> u64 {
    let adapters: Vec<&str> = gpu_adapters().iter().map(|g| g.name.as_str()).collect();
    let key = format!(
        "{device} {threads} [{}] {}",
        adapters.join(", "),
        env!("CARGO_PKG_VERSION")
    );
    let path = data_dir.join("decode-speed.json");
    let kept = std::fs::read_to_string(&path)
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .filter(|kept| kept["key"] == key.as_str())
        .and_then(|kept| kept["bytes_per_second"].as_u64());
    if let Some(kept) = kept {
        return kept;
    }
    match tessera_engine::speed::decode_bytes_per_second(device, threads) {
        Ok(measured) => {
            let record = serde_json::json!({"key": key, "bytes_per_second": measured});
            if let Err(error) = std::fs::write(&path, record.to_string()) {
                tracing::warn!(%error, "keeping the decode speed");
            }
            tracing::info!(device = %device, bytes_per_second = measured, "decode speed measured");
            measured
        }
        Err(error) => {
            tracing::warn!(%error, "measuring the decode speed");
            0
        }
    }
}

/// Publishes this node's info until the log holds it (a master may not be
/// elected yet), then whenever it changes materially (available memory by
/// more than 5%), at most every 2 seconds and at least every 30 seconds.
async fn publish_node_info(
    events: Arc<LocalEvents>,
    data_dir: PathBuf,
    (own, speed): (v1::NodeInfo, Arc<std::sync::atomic::AtomicU64>),
    replica: ActorRef<ReplicaMsg>,
    health: watch::Receiver<Health>,
) {
    let mut speed_sent = 0;
    let node_id = events.node_id().to_string();
    let mut last_sent: Option<(u64, std::time::Instant)> = None;
    let mut restarts_sent = 0;
    let mut interval = tokio::time::interval(Duration::from_millis(500));
    loop {
        interval.tick().await;
        let (actor_restarts, last_actor_failure) = {
            let health = health.borrow();
            let restarts: u32 = health.restarts.values().sum();
            (restarts, health.last_failure.clone().unwrap_or_default())
        };
        let info = v1::NodeInfo {
            no_worker: own.no_worker,
            ring_port_base: own.ring_port_base,
            device: own.device.clone(),
            decode_bytes_per_second: speed.load(std::sync::atomic::Ordering::Relaxed),
            actor_restarts,
            last_actor_failure,
            ..gather_node_info(&data_dir)
        };
        let available = info.memory_available_bytes;
        let known = call_t!(replica, ReplicaMsg::GetState, crate::ACTOR_CALL_MS)
            .map(|state| state.nodes.contains_key(&node_id))
            .unwrap_or(false);
        let measured = info.decode_bytes_per_second;
        let due = match last_sent {
            _ if !known || actor_restarts != restarts_sent || measured != speed_sent => true,
            None => true,
            Some((previous, at)) => {
                let change = previous.abs_diff(available) as f64 / previous.max(1) as f64;
                change > 0.05 || at.elapsed() > Duration::from_secs(30)
            }
        };
        if !due {
            continue;
        }
        let event = event::Kind::NodeGatheredInfo(v1::NodeGatheredInfo {
            node_id: node_id.clone(),
            info: Some(info),
        });
        match events.publish(event).await {
            Ok(()) => {
                last_sent = Some((available, std::time::Instant::now()));
                restarts_sent = actor_restarts;
                speed_sent = measured;
            }
            Err(error) => tracing::warn!(%error, "publishing node info"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runners_reuse_a_fixed_loopback_port_or_get_their_own() -> Result<(), NodeError> {
        let (listen, endpoint) = runner_endpoint(&["tcp/0.0.0.0:5447".into()])?;
        assert_eq!(listen, vec!["tcp/0.0.0.0:5447".to_string()]);
        assert_eq!(endpoint, "tcp/127.0.0.1:5447");
        let (_, endpoint) = runner_endpoint(&["tcp/127.0.0.1:6000".into()])?;
        assert_eq!(endpoint, "tcp/127.0.0.1:6000");
        // Zenoh's default, plus a loopback port of their own.
        let (listen, endpoint) = runner_endpoint(&[])?;
        assert_eq!(listen.len(), 2);
        assert_eq!(listen[0], "tcp/[::]:0");
        assert_eq!(listen[1], endpoint);
        assert!(endpoint.starts_with("tcp/127.0.0.1:") && !endpoint.ends_with(":0"));
        // A port chosen by the system, or another address, is not reusable.
        for given in ["tcp/0.0.0.0:0", "tcp/192.168.1.5:5447", "udp/0.0.0.0:5447"] {
            let (listen, endpoint) = runner_endpoint(&[given.into()])?;
            assert_eq!(listen.len(), 2, "{given}");
            assert_ne!(endpoint, given);
        }
        Ok(())
    }

    /// A node of its own on loopback, offline, running no models.
    async fn lone_node(dir: &Path) -> Result<RunningNode, NodeError> {
        start(lone_options(dir)).await
    }

    fn lone_options(dir: &Path) -> NodeOptions {
        NodeOptions {
            namespace: "supervised".into(),
            listen: vec!["tcp/127.0.0.1:0".into()],
            connect: Vec::new(),
            multicast: false,
            data_dir: dir.to_path_buf(),
            worker: false,
            runner_threads: 1,
            runner_device: tessera_engine::gpu::DeviceChoice::Cpu,
            max_concurrent: 1,
            ring_port_base: None,
            models: crate::worker::downloads::ModelStore::new(
                dir.join("models"),
                Vec::new(),
                Vec::new(),
            ),
            offline: true,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_worker_is_restarted_and_reported() {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let options = NodeOptions {
            worker: true,
            ..lone_options(dir.path())
        };
        let node = start(options).await.expect("a node starts");
        let mut health = node.health();
        let worker = node.children.worker.clone().expect("a worker");
        let first = worker.get();
        first.kill();
        let restarted = tokio::time::timeout(
            Duration::from_secs(20),
            health.wait_for(|h| h.restarts.get("Worker") == Some(&1)),
        )
        .await
        .map(|seen| seen.map(|h| h.clone()));
        assert!(
            matches!(restarted, Ok(Ok(_))),
            "no restart: {:?}",
            *node.health().borrow()
        );
        assert_ne!(worker.get().get_id(), first.get_id());
        node.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_election_is_restarted_and_reported() {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let node = lone_node(dir.path()).await.expect("a node starts");
        let mut health = node.health();
        let first = node.children.election.get();
        first.kill();
        let restarted = tokio::time::timeout(
            Duration::from_secs(20),
            health.wait_for(|h| h.restarts.get("Election") == Some(&1)),
        )
        .await
        .map(|seen| seen.map(|h| h.clone()));
        assert!(
            matches!(restarted, Ok(Ok(_))),
            "no restart: {:?}",
            *node.health().borrow()
        );
        let now = node.children.election.get();
        assert_ne!(now.get_id(), first.get_id());
        assert!(
            now.get_status() <= ractor::ActorStatus::Running,
            "{:?}",
            now.get_status()
        );
        assert!(health.borrow().fatal.is_none());
        assert!(health.borrow().last_failure.is_some());
        node.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_replica_stops_the_node_with_the_reason() {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let node = lone_node(dir.path()).await.expect("a node starts");
        let mut health = node.health();
        node.children.replica.kill();
        let fatal = tokio::time::timeout(
            Duration::from_secs(20),
            health.wait_for(|h| h.fatal.is_some()),
        )
        .await
        .map(|seen| seen.map(|h| h.clone()));
        assert!(
            matches!(fatal, Ok(Ok(_))),
            "not fatal: {:?}",
            *node.health().borrow()
        );
        node.shutdown().await;
    }
}
