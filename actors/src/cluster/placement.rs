//! Placement: which nodes run a model, and how it is split over them. A
//! pure function of the model card, the nodes' free memory and the request,
//! unit-tested without actors or sockets.
//!
//! - Nodes are tried largest free memory first (ties by node id), and the
//!   smallest feasible node count at or above `min_nodes` wins: fewer ranks
//!   means less traffic between them.
//! - Pipeline: layers in proportion to free memory, each node at least one.
//!   Tensor: KV-head groups as evenly as they go (3 over 2 nodes is 2 + 1),
//!   at most one rank per KV head.
//! - Every node must keep [`headroom`] free after its share; a refusal names
//!   the node and the bytes missing.

use std::collections::{BTreeMap, BTreeSet};

use tessera_engine::dist::shard::{split_evenly, split_proportionally, ShardSpec};
use tessera_protos::v1::{
    self, shard_spec, Instance, InstanceRank, ModelCard, PipelineShard, Sharding, TensorShard,
};

/// Ring ports lie below Linux's ephemeral range (32768-60999), where an
/// outgoing connection of any program could hold one, and above the
/// well-known ports.
pub const RING_PORTS: std::ops::Range<u16> = 20_000..32_000;
/// Each node claims a slot of this many ports (`node::claim_ring_slot`):
/// it holds the first, and each of its ranks gets the lowest free one after.
pub const RING_SLOT: u16 = 64;
/// A node that reports no slot is taken to hold the first.
pub const RING_BASE_PORT: u16 = RING_PORTS.start;

/// FNV-1a, 64 bits: a stable hash (the same in every process and release)
/// for ids made from other ids.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x100_0000_01b3)
    })
}

/// What placement knows about one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeCapacity {
    pub node_id: String,
    /// Memory the node reports as available.
    pub available_bytes: u64,
    /// The address other ranks reach this node at.
    pub ip: String,
    /// The first port of its ring connections.
    pub ring_port_base: u16,
    /// Models whose files it holds, each with whether all of them (rather
    /// than some shards'): placement prefers nodes that need not download.
    pub models_held: BTreeMap<String, bool>,
    /// How fast it reads weights in a decode step on its device, as it
    /// measured (0: not measured yet).
    pub decode_bytes_per_second: u64,
}

impl NodeCapacity {
    /// Capacities of every node in `state` that runs models and reported
    /// its memory.
    pub fn from_state(state: &v1::ClusterState) -> Vec<Self> {
        state
            .nodes
            .iter()
            .filter_map(|(id, node)| {
                let info = node.info.as_ref().filter(|i| !i.no_worker)?;
                let ip = info
                    .addresses
                    .iter()
                    .find(|a| a.kind != v1::LinkKind::Loopback as i32)
                    .or(info.addresses.first())
                    .map_or_else(|| "127.0.0.1".to_string(), |a| a.ip.clone());
                let models_held = state
                    .downloads
                    .get(id)
                    .map(|downloads| {
                        downloads
                            .models
                            .iter()
                            .filter_map(|(model, progress)| {
                                files_held(progress).map(|whole| (model.clone(), whole))
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                Some(Self {
                    node_id: id.clone(),
                    available_bytes: placement_memory(info),
                    decode_bytes_per_second: info.decode_bytes_per_second,
                    models_held,
                    ip,
                    ring_port_base: u16::try_from(info.ring_port_base)
                        .ok()
                        .filter(|p| *p != 0)
                        .unwrap_or(RING_BASE_PORT),
                })
            })
            .collect()
    }
}

/// The memory a node's models go to: its GPU's own memory where it runs
/// them on a discrete GPU whose memory it knows, else the machine's
/// available memory (unified-memory GPUs share it).
pub fn placement_memory(info: &v1::NodeInfo) -> u64 {
    match models_gpu(info) {
        Some(gpu) if !gpu.unified_memory && gpu.memory_bytes > 0 => gpu.memory_bytes,
        _ => info.memory_available_bytes,
    }
}

/// The adapter a node's `--device` puts its models on, as `DeviceChoice`
/// picks it: `gpu:N` that adapter; `gpu` the first hardware one, else the
/// first; `auto` the first hardware one; `cpu` none.
fn models_gpu(info: &v1::NodeInfo) -> Option<&v1::GpuAdapter> {
    let hardware = || info.gpus.iter().find(|g| g.kind != "cpu");
    match info.device.as_str() {
        "cpu" => None,
        "gpu" => hardware().or(info.gpus.first()),
        "" | "auto" => hardware(),
        other => {
            let index: u32 = other.strip_prefix("gpu:")?.parse().ok()?;
            info.gpus.iter().find(|g| g.index == index)
        }
    }
}

/// Whether a node's download of a model left its files there: `Some(true)`
/// for all of them, `Some(false)` for those of some shards only.
pub fn files_held(progress: &v1::DownloadProgress) -> Option<bool> {
    let completed = matches!(
        progress.state,
        Some(v1::download_progress::State::Completed(_))
    );
    completed.then(|| {
        progress.shards.is_empty()
            || progress.shards.iter().any(|shard| {
                crate::worker::plan::Part::of(Some(shard)) == crate::worker::plan::Part::Whole
            })
    })
}

/// The nodes that hold all the files of `model_id` (as far as the log says).
pub fn downloaded_on(state: &v1::ClusterState, model_id: &str) -> Vec<String> {
    nodes_holding(state, model_id, true)
}

/// The nodes that hold the files of some of a model's shards only.
pub fn partly_on(state: &v1::ClusterState, model_id: &str) -> Vec<String> {
    nodes_holding(state, model_id, false)
}

fn nodes_holding(state: &v1::ClusterState, model_id: &str, whole: bool) -> Vec<String> {
    state
        .downloads
        .iter()
        .filter(|(_, d)| d.models.get(model_id).and_then(files_held) == Some(whole))
        .map(|(node, _)| node.clone())
        .collect()
}

/// Each rank's shard and the bytes it needs, in rank order.
type Shares = Vec<(ShardSpec, u64)>;

/// Why a model cannot be placed. Messages say exactly what is missing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("no nodes have reported their memory yet")]
    NoNodes,
    #[error("sharding must be pipeline or tensor")]
    NoSharding,
    #[error("{model} does not support tensor parallelism; use pipeline sharding")]
    TensorUnsupported { model: String },
    #[error("{model} has no layer count or KV-head count in its card")]
    IncompleteCard { model: String },
    #[error("asked for at least {wanted} nodes, but only {available} are usable")]
    NotEnoughNodes { wanted: usize, available: usize },
    #[error("{sharding} sharding of {model} allows at most {max} ranks ({what}), asked for at least {wanted}")]
    TooManyRanks {
        model: String,
        sharding: &'static str,
        max: usize,
        what: &'static str,
        wanted: usize,
    },
    #[error("{model} does not fit on {nodes} node(s): node {node} needs {needed} but has {available} available ({missing} missing, counting {headroom} headroom)")]
    NotEnoughMemory {
        model: String,
        nodes: usize,
        node: String,
        needed: ByteCount,
        available: ByteCount,
        missing: ByteCount,
        headroom: ByteCount,
    },
    #[error("unknown node {0}")]
    UnknownNode(String),
    #[error("instance {instance} has no rank 0")]
    NoRanks { instance: String },
    #[error("the draft {draft} does not fit beside instance {instance}: rank 0's node {node} needs {needed} more but has {available} available ({missing} missing, counting {headroom} headroom)")]
    DraftDoesNotFit {
        draft: String,
        instance: String,
        node: String,
        needed: ByteCount,
        available: ByteCount,
        missing: ByteCount,
        headroom: ByteCount,
    },
}

/// Bytes, printed readably in messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteCount(pub u64);

impl std::fmt::Display for ByteCount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = self.0 as f64;
        if b >= 1e9 {
            write!(f, "{:.2} GB", b / 1e9)
        } else {
            write!(f, "{:.0} MB", b / 1e6)
        }
    }
}

/// Memory a node must keep free beyond a model's share: 10% of what it has,
/// at least 256 MB (the OS, the node itself, other programs).
pub fn headroom(available_bytes: u64) -> u64 {
    (available_bytes / 10).max(256_000_000)
}

/// Memory besides the weights a rank needs: its process, buffers and a
/// KV cache for a few thousand tokens.
const RANK_OVERHEAD: u64 = 64_000_000;

/// Memory besides its weights a draft model needs on rank 0: its own KV
/// cache and buffers (it shares the target's process).
const DRAFT_OVERHEAD: u64 = 32_000_000;

/// Memory a draft takes on rank 0's node: a draft model's weights and
/// buffers; nothing for prompt lookup.
pub fn draft_bytes(draft: &v1::InstanceDraft) -> u64 {
    match draft.method() {
        v1::DraftMethod::DraftModel => {
            draft
                .draft_card
                .as_ref()
                .map_or(0, |card| card.storage_size_bytes)
                + DRAFT_OVERHEAD
        }
        v1::DraftMethod::Ngram | v1::DraftMethod::Unspecified => 0,
    }
}

/// Whether `draft` fits beside the running `instance`, on rank 0's node:
/// the node's available memory already counts what runs there, so only
/// what the draft adds is checked (nothing when the instance keeps the same
/// draft model and changes its token count). Returns the bytes it adds.
pub fn draft_fits(
    nodes: &[NodeCapacity],
    instance: &Instance,
    draft: &v1::InstanceDraft,
) -> Result<u64, PlacementError> {
    let same_model = instance.draft.as_ref().is_some_and(|old| {
        old.method() == v1::DraftMethod::DraftModel
            && draft.method() == v1::DraftMethod::DraftModel
            && old.draft_model == draft.draft_model
    });
    let needed = if same_model { 0 } else { draft_bytes(draft) };
    if needed == 0 {
        return Ok(0);
    }
    let rank0 = instance
        .ranks
        .first()
        .ok_or_else(|| PlacementError::NoRanks {
            instance: instance.instance_id.clone(),
        })?;
    let node = nodes
        .iter()
        .find(|n| n.node_id == rank0.node_id)
        .ok_or_else(|| PlacementError::UnknownNode(rank0.node_id.clone()))?;
    let room = headroom(node.available_bytes);
    let usable = node.available_bytes.saturating_sub(room);
    if needed > usable {
        return Err(PlacementError::DraftDoesNotFit {
            draft: draft.draft_model.clone(),
            instance: instance.instance_id.clone(),
            node: node.node_id.clone(),
            needed: ByteCount(needed),
            available: ByteCount(node.available_bytes),
            missing: ByteCount(needed - usable),
            headroom: ByteCount(room),
        });
    }
    Ok(needed)
}

/// What a placement asks for.
#[derive(Clone, Debug)]
pub struct PlacementRequest<'a> {
    pub model: &'a ModelCard,
    pub sharding: Sharding,
    /// At least this many nodes (0 or 1: any).
    pub min_nodes: usize,
    /// Only these nodes; empty: any.
    pub node_ids: &'a [String],
    /// Generations the instance runs at once (0: the default).
    pub max_concurrent: u32,
    /// Speculative decoding the instance keeps (one placed again after a
    /// node was lost): a draft model's bytes count on rank 0's node.
    pub draft: Option<&'a v1::InstanceDraft>,
}

/// A chosen placement: the instance (ranks in order) and each node's share.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    pub instance: Instance,
    pub memory_bytes_by_node: BTreeMap<String, u64>,
}

/// Places `request` on the given nodes. `instance_id` names the instance,
/// `runner_ids` yields a runner id per rank, `used_addresses` are ring
/// addresses ("ip:port") other instances already hold.
pub fn place(
    request: &PlacementRequest<'_>,
    nodes: &[NodeCapacity],
    instance_id: &str,
    used_addresses: &BTreeSet<String>,
    mut runner_ids: impl FnMut(usize) -> String,
) -> Result<Placement, PlacementError> {
    let candidates = candidates(request, nodes)?;
    let (lowest, highest) = rank_bounds(request, candidates.len())?;
    let mut last_error = None;
    for count in lowest..=highest {
        match place_on_best(request, &candidates, count) {
            Ok((chosen, shares)) => {
                return Ok(build(
                    request,
                    &chosen,
                    shares,
                    instance_id,
                    used_addresses,
                    &mut runner_ids,
                ))
            }
            Err(error) => last_error = Some(error),
        }
    }
    Err(last_error.unwrap_or(PlacementError::NoNodes))
}

/// Splits the model over `count` of the candidates (roomiest first). The
/// fewest nodes always win; at a given count, the nodes that already hold
/// the model's files (all of them, then some) are tried first, since a
/// download can take far longer than anything else placement decides.
fn place_on_best(
    request: &PlacementRequest<'_>,
    candidates: &[NodeCapacity],
    count: usize,
) -> Result<(Vec<NodeCapacity>, Shares), PlacementError> {
    let model_id = &request.model.model_id;
    let held = |node: &NodeCapacity| match node.models_held.get(model_id) {
        Some(true) => 2,
        Some(false) => 1,
        None => 0,
    };
    let mut holders_first = candidates.to_vec();
    // Stable: roomiest first among nodes that hold as much.
    holders_first.sort_by_key(|node| std::cmp::Reverse(held(node)));
    let holders_first = &holders_first[..count];
    let roomiest = &candidates[..count];
    let attempts = if holders_first == roomiest {
        vec![roomiest]
    } else {
        vec![holders_first, roomiest]
    };
    let mut last_error = None;
    for nodes in attempts {
        match place_on(request, nodes) {
            Ok(shares) => return Ok((nodes.to_vec(), shares)),
            Err(error) => last_error = Some(error),
        }
    }
    Err(last_error.unwrap_or(PlacementError::NoNodes))
}

/// Every node count from 1 up to the number of usable nodes, for each
/// sharding the model supports: feasible ones with their instance, others
/// with the reason.
pub fn previews(
    model: &ModelCard,
    nodes: &[NodeCapacity],
    node_ids: &[String],
) -> Vec<v1::PlacementPreview> {
    let mut out = Vec::new();
    let shardings: &[Sharding] = if model.supports_tensor {
        &[Sharding::Pipeline, Sharding::Tensor]
    } else {
        &[Sharding::Pipeline]
    };
    for &sharding in shardings {
        let request = PlacementRequest {
            model,
            sharding,
            min_nodes: 1,
            node_ids,
            max_concurrent: 0,
            draft: None,
        };
        let candidates = match candidates(&request, nodes) {
            Ok(c) => c,
            Err(error) => {
                out.push(v1::PlacementPreview {
                    sharding: sharding as i32,
                    error: error.to_string(),
                    ..Default::default()
                });
                continue;
            }
        };
        for count in 1..=candidates.len() {
            let request = PlacementRequest {
                min_nodes: count,
                ..request.clone()
            };
            let result = rank_bounds(&request, candidates.len())
                .and_then(|_| place_on_best(&request, &candidates, count));
            let preview = match result {
                Ok((chosen, shares)) => {
                    let placement = build(
                        &request,
                        &chosen,
                        shares,
                        "preview",
                        &BTreeSet::new(),
                        &mut |rank| format!("preview-rank-{rank}"),
                    );
                    v1::PlacementPreview {
                        sharding: sharding as i32,
                        node_count: count as u32,
                        instance: Some(placement.instance),
                        error: String::new(),
                        memory_bytes_by_node: placement.memory_bytes_by_node.into_iter().collect(),
                    }
                }
                Err(error) => v1::PlacementPreview {
                    sharding: sharding as i32,
                    node_count: count as u32,
                    instance: None,
                    error: error.to_string(),
                    memory_bytes_by_node: Default::default(),
                },
            };
            out.push(preview);
        }
    }
    out
}

/// Usable nodes, most free memory first.
fn candidates(
    request: &PlacementRequest<'_>,
    nodes: &[NodeCapacity],
) -> Result<Vec<NodeCapacity>, PlacementError> {
    for id in request.node_ids {
        if !nodes.iter().any(|n| &n.node_id == id) {
            return Err(PlacementError::UnknownNode(id.clone()));
        }
    }
    let mut candidates: Vec<NodeCapacity> = nodes
        .iter()
        .filter(|n| request.node_ids.is_empty() || request.node_ids.contains(&n.node_id))
        .cloned()
        .collect();
    if candidates.is_empty() {
        return Err(PlacementError::NoNodes);
    }
    candidates.sort_by(|a, b| {
        b.available_bytes
            .cmp(&a.available_bytes)
            .then_with(|| a.node_id.cmp(&b.node_id))
    });
    Ok(candidates)
}

/// The node counts to try.
fn rank_bounds(
    request: &PlacementRequest<'_>,
    usable: usize,
) -> Result<(usize, usize), PlacementError> {
    let model = request.model;
    if model.n_layers == 0 || model.num_key_value_heads == 0 {
        return Err(PlacementError::IncompleteCard {
            model: model.model_id.clone(),
        });
    }
    let embedding = crate::catalogue::task::is_embedding(model);
    let (max, what, name) = match request.sharding {
        Sharding::Pipeline if embedding => {
            (1, "an embedding model runs whole on one node", "pipeline")
        }
        Sharding::Pipeline => (model.n_layers as usize, "one layer per rank", "pipeline"),
        Sharding::Tensor => {
            if !model.supports_tensor {
                return Err(PlacementError::TensorUnsupported {
                    model: model.model_id.clone(),
                });
            }
            (
                model.num_key_value_heads as usize,
                "one KV head per rank",
                "tensor",
            )
        }
        Sharding::Unspecified => return Err(PlacementError::NoSharding),
    };
    let lowest = request.min_nodes.max(1);
    if lowest > max {
        return Err(PlacementError::TooManyRanks {
            model: model.model_id.clone(),
            sharding: name,
            max,
            what,
            wanted: lowest,
        });
    }
    if lowest > usable {
        return Err(PlacementError::NotEnoughNodes {
            wanted: lowest,
            available: usable,
        });
    }
    Ok((lowest, usable.min(max)))
}

/// Splits the model over exactly these nodes, or says which one lacks
/// memory. Returns each rank's shard and bytes. A pipeline's layers go in
/// proportion to each node's measured decode speed where every node has
/// measured it and that split fits their memory (a GPU node takes more
/// layers than a CPU one), else in proportion to their memory.
fn place_on(
    request: &PlacementRequest<'_>,
    nodes: &[NodeCapacity],
) -> Result<Shares, PlacementError> {
    let shares = match request.sharding {
        Sharding::Pipeline => {
            let speeds: Vec<u64> = nodes.iter().map(|n| n.decode_bytes_per_second).collect();
            if speeds.iter().all(|&s| s > 0) {
                let by_speed = with_draft(request, pipeline_shares(request, &speeds)?);
                if fits(request, nodes, &by_speed).is_ok() {
                    return Ok(by_speed);
                }
            }
            let room: Vec<u64> = nodes
                .iter()
                .map(|n| {
                    n.available_bytes
                        .saturating_sub(headroom(n.available_bytes))
                })
                .collect();
            with_draft(request, pipeline_shares(request, &room)?)
        }
        Sharding::Tensor => with_draft(request, tensor_shares(request, nodes.len())?),
        Sharding::Unspecified => return Err(PlacementError::NoSharding),
    };
    fits(request, nodes, &shares)?;
    Ok(shares)
}

/// A pipeline's layers over ranks in proportion to `weights`.
fn pipeline_shares(
    request: &PlacementRequest<'_>,
    weights: &[u64],
) -> Result<Shares, PlacementError> {
    let model = request.model;
    let layers = model.n_layers;
    let storage = model.storage_size_bytes;
    let ranges = split_proportionally(layers, weights, "layers").map_err(|_| {
        PlacementError::TooManyRanks {
            model: model.model_id.clone(),
            sharding: "pipeline",
            max: layers as usize,
            what: "one layer per rank",
            wanted: weights.len(),
        }
    })?;
    Ok(ranges
        .into_iter()
        .map(|r| {
            let bytes = storage * u64::from(r.end - r.start) / u64::from(layers);
            (
                ShardSpec::Pipeline {
                    start_layer: r.start,
                    end_layer: r.end,
                    n_layers: layers,
                },
                bytes + RANK_OVERHEAD,
            )
        })
        .collect())
}

/// A tensor split's ranks, each with its KV heads' share of the layers.
fn tensor_shares(request: &PlacementRequest<'_>, world: usize) -> Result<Shares, PlacementError> {
    let model = request.model;
    let storage = model.storage_size_bytes;
    let groups = split_evenly(model.num_key_value_heads, world, "KV heads").map_err(|_| {
        PlacementError::TooManyRanks {
            model: model.model_id.clone(),
            sharding: "tensor",
            max: model.num_key_value_heads as usize,
            what: "one KV head per rank",
            wanted: world,
        }
    })?;
    Ok(groups
        .iter()
        .enumerate()
        .map(|(rank, g)| {
            // The largest group share bounds the attention part; the
            // MLP and head split evenly. Every rank keeps the whole
            // embedding table, not counted in the card: the overhead
            // covers small models, and big ones are dominated by layers.
            let kv = u64::from(model.num_key_value_heads);
            let attention_share = storage * u64::from(g.end - g.start) / kv;
            let even_share = storage / world as u64;
            let bytes = attention_share.max(even_share);
            (
                ShardSpec::Tensor {
                    rank: rank as u32,
                    world_size: world as u32,
                },
                bytes + RANK_OVERHEAD,
            )
        })
        .collect())
}

/// `shares` with the draft model's bytes on rank 0, which runs it.
fn with_draft(request: &PlacementRequest<'_>, mut shares: Shares) -> Shares {
    if let (Some(draft), Some((_, rank0))) = (request.draft, shares.first_mut()) {
        *rank0 += draft_bytes(draft);
    }
    shares
}

/// Whether every node has the memory for its share, beside its headroom.
fn fits(
    request: &PlacementRequest<'_>,
    nodes: &[NodeCapacity],
    shares: &Shares,
) -> Result<(), PlacementError> {
    for (node, (_, needed)) in nodes.iter().zip(shares) {
        let room = headroom(node.available_bytes);
        let usable = node.available_bytes.saturating_sub(room);
        if *needed > usable {
            return Err(PlacementError::NotEnoughMemory {
                model: request.model.model_id.clone(),
                nodes: nodes.len(),
                node: node.node_id.clone(),
                needed: ByteCount(*needed),
                available: ByteCount(node.available_bytes),
                missing: ByteCount(needed - usable),
                headroom: ByteCount(room),
            });
        }
    }
    Ok(())
}

fn build(
    request: &PlacementRequest<'_>,
    nodes: &[NodeCapacity],
    shares: Shares,
    instance_id: &str,
    used_addresses: &BTreeSet<String>,
    runner_ids: &mut impl FnMut(usize) -> String,
) -> Placement {
    let mut taken = used_addresses.clone();
    let mut ranks = Vec::with_capacity(nodes.len());
    let mut memory = BTreeMap::new();
    // Ranks all on one machine reach each other on loopback, whatever the
    // machine's other addresses (a cluster on loopback, a laptop whose
    // Wi-Fi address changes).
    let one_machine = nodes.windows(2).all(|pair| pair[0].ip == pair[1].ip);
    for (rank, (node, (spec, bytes))) in nodes.iter().zip(shares).enumerate() {
        let ip = if one_machine {
            "127.0.0.1"
        } else {
            node.ip.as_str()
        };
        // A port is taken on the machine whichever address names it.
        let free = |port: &u16| {
            !taken.contains(&format!("{}:{port}", node.ip))
                && !taken.contains(&format!("127.0.0.1:{port}"))
        };
        let port = (node.ring_port_base.saturating_add(1)..=u16::MAX)
            .find(free)
            .unwrap_or(0);
        let address = format!("{ip}:{port}");
        taken.insert(format!("{}:{port}", node.ip));
        taken.insert(address.clone());
        memory.insert(node.node_id.clone(), bytes);
        ranks.push(InstanceRank {
            rank: rank as u32,
            node_id: node.node_id.clone(),
            runner_id: runner_ids(rank),
            shard: Some(shard_to_proto(&spec)),
            ring_address: address,
        });
    }
    Placement {
        instance: Instance {
            instance_id: instance_id.to_string(),
            model: Some(request.model.clone()),
            sharding: request.sharding as i32,
            ranks,
            max_concurrent: request.max_concurrent,
            ring_secret: Vec::new(),
            ring_sealed: false,
            draft: request.draft.cloned(),
        },
        memory_bytes_by_node: memory,
    }
}

/// The engine's shard spec as the wire type.
pub fn shard_to_proto(spec: &ShardSpec) -> v1::ShardSpec {
    let kind = match *spec {
        ShardSpec::Pipeline {
            start_layer,
            end_layer,
            n_layers,
        } => shard_spec::Kind::Pipeline(PipelineShard {
            start_layer,
            end_layer,
            n_layers,
        }),
        ShardSpec::Tensor { rank, world_size } => {
            shard_spec::Kind::Tensor(TensorShard { rank, world_size })
        }
    };
    v1::ShardSpec { kind: Some(kind) }
}

/// The wire shard spec as the engine's, if it is complete.
pub fn shard_from_proto(spec: &v1::ShardSpec) -> Option<ShardSpec> {
    match spec.kind.as_ref()? {
        shard_spec::Kind::Pipeline(p) => Some(ShardSpec::Pipeline {
            start_layer: p.start_layer,
            end_layer: p.end_layer,
            n_layers: p.n_layers,
        }),
        shard_spec::Kind::Tensor(t) => Some(ShardSpec::Tensor {
            rank: t.rank,
            world_size: t.world_size,
        }),
    }
}

/// Ring addresses the instances in `state` already hold.
pub fn used_ring_addresses(state: &v1::ClusterState) -> BTreeSet<String> {
    state
        .instances
        .values()
        .flat_map(|i| i.ranks.iter().map(|r| r.ring_address.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1_000_000_000;

    /// A shipped card's placement fields, read from its file here (the
    /// catalogue imports this module, so these tests do not import it).
    fn shipped_card(id: &str) -> ModelCard {
        let text = match id {
            "qwen3-30b-a3b-q4_k_m" => {
                include_str!("../../../resources/model_cards/qwen3-30b-a3b-q4_k_m.toml")
            }
            "mixtral-8x7b-instruct-v0.1-q8_0" => {
                include_str!("../../../resources/model_cards/mixtral-8x7b-instruct-v0.1-q8_0.toml")
            }
            other => panic!("no card {other} in these tests"),
        };
        let value: toml::Value = toml::from_str(text).expect("a card file");
        let number = |key: &str| value[key].as_integer().expect(key) as u32;
        ModelCard {
            model_id: value["model_id"].as_str().expect("model_id").into(),
            family: value["family"].as_str().expect("family").into(),
            n_layers: number("n_layers"),
            num_key_value_heads: number("num_key_value_heads"),
            supports_tensor: value["supports_tensor"].as_bool().expect("supports_tensor"),
            storage_size_bytes: value["storage_size"]["in_bytes"]
                .as_integer()
                .expect("storage") as u64,
            ..Default::default()
        }
    }

    fn card(storage: u64, layers: u32, kv: u32) -> ModelCard {
        ModelCard {
            model_id: "test-model".into(),
            n_layers: layers,
            num_key_value_heads: kv,
            supports_tensor: true,
            storage_size_bytes: storage,
            ..Default::default()
        }
    }

    fn node(id: &str, available: u64) -> NodeCapacity {
        NodeCapacity {
            node_id: id.into(),
            available_bytes: available,
            ip: "127.0.0.1".into(),
            ring_port_base: RING_BASE_PORT,
            models_held: BTreeMap::new(),
            decode_bytes_per_second: 0,
        }
    }

    fn measured(node: NodeCapacity, bytes_per_second: u64) -> NodeCapacity {
        NodeCapacity {
            decode_bytes_per_second: bytes_per_second,
            ..node
        }
    }

    /// Each node's layers in a placement's ranks.
    fn layers_by_node(p: &Placement) -> BTreeMap<String, u32> {
        p.instance
            .ranks
            .iter()
            .map(|r| match r.shard.as_ref().and_then(shard_from_proto) {
                Some(ShardSpec::Pipeline {
                    start_layer,
                    end_layer,
                    ..
                }) => (r.node_id.clone(), end_layer - start_layer),
                other => panic!("not a pipeline shard: {other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_pipeline_gives_the_faster_node_more_layers_when_every_node_measured() {
        let model = card(GB, 30, 8);
        let nodes = [
            measured(node("gpu", 8 * GB), 4_000_000_000),
            measured(node("cpu", 8 * GB), 1_000_000_000),
        ];
        let placed = run(&model, Sharding::Pipeline, 2, &nodes).expect("fits");
        let layers = layers_by_node(&placed);
        assert_eq!((layers["gpu"], layers["cpu"]), (23, 7), "{layers:?}");
        // One node not measured yet: by memory, as before.
        let nodes = [
            measured(node("gpu", 8 * GB), 4_000_000_000),
            node("cpu", 8 * GB),
        ];
        let layers = layers_by_node(&run(&model, Sharding::Pipeline, 2, &nodes).expect("fits"));
        assert_eq!((layers["gpu"], layers["cpu"]), (15, 15), "{layers:?}");
    }

    #[test]
    fn a_split_by_speed_the_fast_nodes_memory_cannot_hold_goes_by_memory() {
        // The fast node would take 24 of 30 layers (3.2 GB of 4 GB), more
        // than its 2 GB less headroom holds.
        let model = card(4 * GB, 30, 8);
        let nodes = [
            measured(node("small-gpu", 2 * GB), 4_000_000_000),
            measured(node("big-cpu", 16 * GB), 1_000_000_000),
        ];
        let layers = layers_by_node(&run(&model, Sharding::Pipeline, 2, &nodes).expect("fits"));
        assert!(layers["small-gpu"] < layers["big-cpu"], "{layers:?}");
    }

    #[test]
    fn placement_counts_a_discrete_gpus_own_memory_and_a_unified_ones_shared() {
        let gpu = |kind: &str, memory: u64, unified: bool| v1::GpuAdapter {
            index: 0,
            name: "a GPU".into(),
            kind: kind.into(),
            memory_bytes: memory,
            unified_memory: unified,
            ..Default::default()
        };
        let info = |device: &str, gpus: Vec<v1::GpuAdapter>| v1::NodeInfo {
            memory_available_bytes: 30 * GB,
            device: device.into(),
            gpus,
            ..Default::default()
        };
        let discrete = vec![gpu("discrete", 12 * GB, false)];
        assert_eq!(placement_memory(&info("auto", discrete.clone())), 12 * GB);
        assert_eq!(placement_memory(&info("gpu:0", discrete.clone())), 12 * GB);
        assert_eq!(placement_memory(&info("cpu", discrete)), 30 * GB);
        let integrated = vec![gpu("integrated", 30 * GB, true)];
        assert_eq!(placement_memory(&info("auto", integrated)), 30 * GB);
        // A software adapter is never auto's, and memory not known is the
        // machine's.
        let lavapipe = vec![gpu("cpu", 30 * GB, true)];
        assert_eq!(placement_memory(&info("auto", lavapipe)), 30 * GB);
        assert_eq!(
            placement_memory(&info("gpu", vec![gpu("discrete", 0, false)])),
            30 * GB
        );
    }

    fn holding(mut node: NodeCapacity, model: &str, whole: bool) -> NodeCapacity {
        node.models_held.insert(model.into(), whole);
        node
    }

    fn run(
        model: &ModelCard,
        sharding: Sharding,
        min_nodes: usize,
        nodes: &[NodeCapacity],
    ) -> Result<Placement, PlacementError> {
        let request = PlacementRequest {
            model,
            sharding,
            min_nodes,
            node_ids: &[],
            max_concurrent: 0,
            draft: None,
        };
        place(&request, nodes, "i1", &BTreeSet::new(), |r| format!("r{r}"))
    }

    /// The nodes of a placement's ranks, sorted.
    fn nodes_of(p: &Placement) -> Vec<String> {
        let mut nodes: Vec<String> = p.instance.ranks.iter().map(|r| r.node_id.clone()).collect();
        nodes.sort();
        nodes
    }

    fn shards(p: &Placement) -> Vec<Option<ShardSpec>> {
        p.instance
            .ranks
            .iter()
            .map(|r| r.shard.as_ref().and_then(shard_from_proto))
            .collect()
    }

    #[test]
    fn nodes_without_a_worker_or_memory_are_not_capacity() {
        let info = |available: u64, no_worker: bool| v1::NodeState {
            info: Some(v1::NodeInfo {
                memory_available_bytes: available,
                no_worker,
                ring_port_base: 6000,
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut state = v1::ClusterState::default();
        state.nodes.insert("worker".into(), info(GB, false));
        state.nodes.insert("leader-only".into(), info(8 * GB, true));
        state
            .nodes
            .insert("silent".into(), v1::NodeState::default());
        // Its downloads: one whole, one of a shard, one still running.
        let stage = |end_layer: u32| v1::ShardSpec {
            kind: Some(v1::shard_spec::Kind::Pipeline(v1::PipelineShard {
                start_layer: 0,
                end_layer,
                n_layers: 30,
            })),
        };
        let progress = |state: v1::download_progress::State, shards: Vec<v1::ShardSpec>| {
            v1::DownloadProgress {
                state: Some(state),
                shards,
                ..Default::default()
            }
        };
        let done = || v1::download_progress::State::Completed(v1::DownloadCompleted::default());
        let running = v1::download_progress::State::Ongoing(v1::DownloadOngoing::default());
        let downloads = state.downloads.entry("worker".into()).or_default();
        let models = &mut downloads.models;
        models.insert("whole".into(), progress(done(), vec![]));
        models.insert("all-layers".into(), progress(done(), vec![stage(30)]));
        models.insert("part".into(), progress(done(), vec![stage(10)]));
        models.insert("running".into(), progress(running, vec![]));
        assert_eq!(downloaded_on(&state, "all-layers"), ["worker"]);
        assert_eq!(partly_on(&state, "part"), ["worker"]);
        assert!(downloaded_on(&state, "part").is_empty());
        assert!(
            downloaded_on(&state, "running").is_empty() && partly_on(&state, "running").is_empty()
        );
        let nodes = NodeCapacity::from_state(&state);
        assert_eq!(nodes.len(), 1);
        let held: Vec<(&str, bool)> = nodes[0]
            .models_held
            .iter()
            .map(|(model, whole)| (model.as_str(), *whole))
            .collect();
        assert_eq!(
            held,
            [("all-layers", true), ("part", false), ("whole", true)]
        );
        assert_eq!(nodes[0].node_id, "worker");
        assert_eq!(nodes[0].available_bytes, GB);
        assert_eq!(nodes[0].ring_port_base, 6000);
        // Ranks take the lowest free port from their node's base.
        let mut nodes = nodes;
        nodes.push(node("default-ports", GB));
        nodes[0].ip = "127.0.0.1".into();
        let request = PlacementRequest {
            model: &card(GB / 4, 30, 3),
            sharding: Sharding::Pipeline,
            min_nodes: 2,
            node_ids: &[],
            max_concurrent: 0,
            draft: None,
        };
        let used = BTreeSet::from(["127.0.0.1:6000".to_string()]);
        let p = place(&request, &nodes, "i", &used, |r| format!("r{r}")).expect("fits");
        let mut addresses: Vec<&str> = p
            .instance
            .ranks
            .iter()
            .map(|r| r.ring_address.as_str())
            .collect();
        addresses.sort();
        // Each after its node's held first port (6000 is also in use).
        assert_eq!(addresses, vec!["127.0.0.1:20001", "127.0.0.1:6001"]);
    }

    #[test]
    fn the_fewest_nodes_that_fit_win_and_the_roomiest_first() {
        let model = card(GB, 30, 3);
        let nodes = [node("a", 4 * GB), node("b", 8 * GB), node("c", 2 * GB)];
        let p = run(&model, Sharding::Pipeline, 1, &nodes).expect("fits");
        assert_eq!(p.instance.ranks.len(), 1);
        assert_eq!(p.instance.ranks[0].node_id, "b");
        assert_eq!(
            shards(&p),
            vec![Some(ShardSpec::Pipeline {
                start_layer: 0,
                end_layer: 30,
                n_layers: 30
            })]
        );
    }

    #[test]
    fn nodes_holding_the_files_are_preferred_but_never_over_fewer_nodes() {
        let model = card(GB, 30, 3);
        let nodes = [
            node("a", 8 * GB),
            holding(node("b", 4 * GB), "test-model", false),
            holding(node("c", 3 * GB), "test-model", true),
            holding(node("d", 8 * GB), "another-model", true),
        ];
        // One node is enough: the one with all the files, though roomier
        // nodes exist.
        let on = nodes_of(&run(&model, Sharding::Pipeline, 1, &nodes).expect("fits"));
        assert_eq!(on, ["c"]);
        // Two nodes: all the files, then some.
        let on = nodes_of(&run(&model, Sharding::Pipeline, 2, &nodes).expect("fits"));
        assert_eq!(on, ["b", "c"]);
        // A model too big for the holder alone goes to one roomier node
        // rather than to the holder and another.
        let big = card(5 * GB, 30, 3);
        let on = nodes_of(&run(&big, Sharding::Pipeline, 1, &nodes).expect("fits"));
        assert_eq!(on, ["a"]);
    }

    #[test]
    fn pipeline_layers_follow_free_memory() {
        let model = card(GB, 30, 3);
        let nodes = [node("a", 3 * GB), node("b", 6 * GB)];
        let p = run(&model, Sharding::Pipeline, 2, &nodes).expect("fits");
        // b (more memory) is rank 0 and gets twice the layers.
        let got = shards(&p);
        assert_eq!(p.instance.ranks[0].node_id, "b");
        assert_eq!(
            got,
            vec![
                Some(ShardSpec::Pipeline {
                    start_layer: 0,
                    end_layer: 20,
                    n_layers: 30
                }),
                Some(ShardSpec::Pipeline {
                    start_layer: 20,
                    end_layer: 30,
                    n_layers: 30
                }),
            ]
        );
        // Distinct ring ports on one address.
        assert_eq!(p.instance.ranks[0].ring_address, "127.0.0.1:20001");
        assert_eq!(p.instance.ranks[1].ring_address, "127.0.0.1:20002");
    }

    #[test]
    fn tensor_splits_kv_groups_unevenly_and_caps_the_rank_count() {
        let model = card(GB, 30, 3);
        let nodes = [
            node("a", 8 * GB),
            node("b", 8 * GB),
            node("c", 8 * GB),
            node("d", 8 * GB),
        ];
        let p = run(&model, Sharding::Tensor, 2, &nodes).expect("fits");
        assert_eq!(p.instance.ranks.len(), 2);
        // Rank 0 has 2 of 3 KV groups: it needs the bigger share.
        assert!(p.memory_bytes_by_node["a"] > p.memory_bytes_by_node["b"]);
        let error = run(&model, Sharding::Tensor, 4, &nodes).expect_err("4 > 3 KV heads");
        assert!(error.to_string().contains("at most 3 ranks"), "{error}");
        let mut no_tensor = model.clone();
        no_tensor.supports_tensor = false;
        assert!(matches!(
            run(&no_tensor, Sharding::Tensor, 1, &nodes),
            Err(PlacementError::TensorUnsupported { .. })
        ));
    }

    #[test]
    fn an_embedding_model_is_placed_whole_on_one_node() {
        let mut model = card(GB, 6, 12);
        model.tasks = vec![v1::ModelTask::Embedding as i32];
        let nodes = [node("a", 5 * GB), node("b", 5 * GB)];
        let p = run(&model, Sharding::Pipeline, 1, &nodes).expect("fits on one");
        assert_eq!(p.instance.ranks.len(), 1);
        let error = run(&model, Sharding::Pipeline, 2, &nodes).expect_err("never split");
        assert!(error.to_string().contains("embedding model"), "{error}");
        let too_big = [node("a", GB / 2), node("b", GB / 2)];
        assert!(run(&model, Sharding::Pipeline, 1, &too_big).is_err());
    }

    #[test]
    fn a_refusal_names_the_node_and_the_missing_bytes() {
        let model = card(10 * GB, 30, 8);
        let nodes = [node("small", 3 * GB), node("tiny", GB)];
        let error = run(&model, Sharding::Pipeline, 1, &nodes).expect_err("too big");
        let text = error.to_string();
        // Two nodes were the last try; the second has too little.
        assert!(text.contains("does not fit on 2 node(s)"), "{text}");
        assert!(text.contains("missing"), "{text}");
        match error {
            PlacementError::NotEnoughMemory { node, missing, .. } => {
                assert!(node == "small" || node == "tiny");
                assert!(missing.0 > 0);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn more_nodes_are_used_when_one_is_not_enough() {
        let model = card(6 * GB, 30, 8);
        let nodes = [node("a", 5 * GB), node("b", 5 * GB)];
        let p = run(&model, Sharding::Pipeline, 1, &nodes).expect("fits on two");
        assert_eq!(p.instance.ranks.len(), 2);
        let total: u64 = p.memory_bytes_by_node.values().sum();
        assert!(total >= 6 * GB);
    }

    #[test]
    fn bad_requests_are_refused_clearly() {
        let model = card(GB, 30, 3);
        let nodes = [node("a", 8 * GB)];
        assert_eq!(
            run(&model, Sharding::Pipeline, 1, &[]),
            Err(PlacementError::NoNodes)
        );
        assert_eq!(
            run(&model, Sharding::Unspecified, 1, &nodes),
            Err(PlacementError::NoSharding)
        );
        assert_eq!(
            run(&model, Sharding::Pipeline, 2, &nodes),
            Err(PlacementError::NotEnoughNodes {
                wanted: 2,
                available: 1
            })
        );
        let request = PlacementRequest {
            model: &model,
            sharding: Sharding::Pipeline,
            min_nodes: 1,
            node_ids: &["ghost".to_string()],
            max_concurrent: 0,
            draft: None,
        };
        assert_eq!(
            place(&request, &nodes, "i", &BTreeSet::new(), |r| r.to_string()),
            Err(PlacementError::UnknownNode("ghost".into()))
        );
        assert!(matches!(
            run(&card(GB, 0, 3), Sharding::Pipeline, 1, &nodes),
            Err(PlacementError::IncompleteCard { .. })
        ));
    }

    #[test]
    fn previews_cover_every_node_count_and_sharding() {
        let model = card(GB, 30, 3);
        let nodes = [node("a", 8 * GB), node("b", 8 * GB), node("c", 600_000_000)];
        let previews = previews(&model, &nodes, &[]);
        // Pipeline 1..=3 and tensor 1..=3.
        assert_eq!(previews.len(), 6);
        for p in &previews {
            if p.node_count == 3 && p.sharding == Sharding::Tensor as i32 {
                // Node c cannot hold a third of the model plus headroom (a
                // pipeline gives it a single layer instead).
                assert!(p.instance.is_none() && p.error.contains("node c"), "{p:?}");
            } else {
                assert!(p.instance.is_some(), "{p:?}");
                assert_eq!(p.memory_bytes_by_node.len(), p.node_count as usize);
            }
        }
    }

    #[test]
    fn ring_ports_avoid_addresses_in_use() {
        let model = card(GB, 30, 3);
        let nodes = [node("a", 8 * GB), node("b", 8 * GB)];
        let used: BTreeSet<String> = ["127.0.0.1:20001".to_string()].into();
        let request = PlacementRequest {
            model: &model,
            sharding: Sharding::Tensor,
            min_nodes: 2,
            node_ids: &[],
            max_concurrent: 0,
            draft: None,
        };
        let p = place(&request, &nodes, "i2", &used, |r| format!("r{r}")).expect("fits");
        let addresses: Vec<&str> = p
            .instance
            .ranks
            .iter()
            .map(|r| r.ring_address.as_str())
            .collect();
        assert_eq!(addresses, ["127.0.0.1:20002", "127.0.0.1:20003"]);
    }

    fn model_draft(storage: u64) -> v1::InstanceDraft {
        v1::InstanceDraft {
            method: v1::DraftMethod::DraftModel as i32,
            draft_model: "small".into(),
            num_draft_tokens: 4,
            draft_card: Some(ModelCard {
                model_id: "small".into(),
                storage_size_bytes: storage,
                ..Default::default()
            }),
        }
    }

    #[test]
    fn a_draft_model_counts_on_rank_0s_node_only_and_prompt_lookup_costs_nothing() {
        let ngram = v1::InstanceDraft {
            method: v1::DraftMethod::Ngram as i32,
            num_draft_tokens: 4,
            ..Default::default()
        };
        assert_eq!(draft_bytes(&ngram), 0);
        assert_eq!(draft_bytes(&model_draft(GB)), GB + DRAFT_OVERHEAD);
        let model = card(4 * GB, 30, 3);
        let draft = model_draft(GB);
        let request = PlacementRequest {
            model: &model,
            sharding: Sharding::Pipeline,
            min_nodes: 2,
            node_ids: &[],
            max_concurrent: 0,
            draft: Some(&draft),
        };
        let nodes = [node("a", 8 * GB), node("b", 8 * GB)];
        let with =
            place(&request, &nodes, "i", &BTreeSet::new(), |r| format!("r{r}")).expect("fits");
        let without = run(&model, Sharding::Pipeline, 2, &nodes).expect("fits");
        let rank0 = &with.instance.ranks[0].node_id;
        let rank1 = &with.instance.ranks[1].node_id;
        assert_eq!(
            with.memory_bytes_by_node[rank0],
            without.memory_bytes_by_node[rank0] + GB + DRAFT_OVERHEAD
        );
        assert_eq!(
            with.memory_bytes_by_node[rank1],
            without.memory_bytes_by_node[rank1]
        );
        assert_eq!(with.instance.draft.as_ref(), Some(&draft), "kept");
        // A draft too large for the only node makes the model not fit.
        let huge = model_draft(8 * GB);
        let request = PlacementRequest {
            min_nodes: 1,
            draft: Some(&huge),
            ..request
        };
        let refused = place(&request, &[node("a", 8 * GB)], "i", &BTreeSet::new(), |r| {
            format!("r{r}")
        });
        assert!(matches!(
            refused,
            Err(PlacementError::NotEnoughMemory { .. })
        ));
    }

    #[test]
    fn a_draft_on_a_running_instance_must_fit_beside_it() {
        let model = card(GB, 30, 3);
        let placed = run(&model, Sharding::Pipeline, 1, &[node("a", 8 * GB)]).expect("fits");
        let instance = placed.instance;
        // What the node has left now that the target runs there.
        let after = [node("a", 2 * GB)];
        assert_eq!(
            draft_fits(&after, &instance, &model_draft(GB)),
            Ok(GB + DRAFT_OVERHEAD)
        );
        let refused =
            draft_fits(&after, &instance, &model_draft(2 * GB)).map_err(|e| e.to_string());
        let why = refused.expect_err("too big");
        assert!(why.contains("rank 0's node a"), "{why}");
        assert!(why.contains("small"), "{why}");
        // Prompt lookup needs no memory, even on a full node.
        let ngram = v1::InstanceDraft {
            method: v1::DraftMethod::Ngram as i32,
            num_draft_tokens: 8,
            ..Default::default()
        };
        assert_eq!(draft_fits(&[node("a", 0)], &instance, &ngram), Ok(0));
        // The same draft model with another token count is loaded already.
        let running = Instance {
            draft: Some(model_draft(2 * GB)),
            ..instance.clone()
        };
        let fewer = v1::InstanceDraft {
            num_draft_tokens: 2,
            ..model_draft(2 * GB)
        };
        assert_eq!(draft_fits(&after, &running, &fewer), Ok(0));
        // Rank 0's node must be known.
        assert!(matches!(
            draft_fits(&[node("b", 8 * GB)], &instance, &model_draft(GB)),
            Err(PlacementError::UnknownNode(n)) if n == "a"
        ));
    }

    #[test]
    fn ranks_on_one_machine_meet_on_loopback_and_others_on_their_address() {
        let model = card(GB, 30, 3);
        let request = PlacementRequest {
            model: &model,
            sharding: Sharding::Tensor,
            min_nodes: 2,
            node_ids: &[],
            max_concurrent: 0,
            draft: None,
        };
        let on = |id: &str, ip: &str, base: u16| NodeCapacity {
            ip: ip.into(),
            ring_port_base: base,
            ..node(id, 8 * GB)
        };
        let addresses = |nodes: &[NodeCapacity], used: &BTreeSet<String>| {
            let p = place(&request, nodes, "i", used, |r| format!("r{r}")).expect("fits");
            p.instance
                .ranks
                .iter()
                .map(|r| r.ring_address.clone())
                .collect::<Vec<_>>()
        };
        // Two nodes of one machine (its LAN address): loopback, and their
        // own slots' ports.
        let same = [on("a", "192.0.2.2", 20_000), on("b", "192.0.2.2", 20_064)];
        assert_eq!(
            addresses(&same, &BTreeSet::new()),
            ["127.0.0.1:20001", "127.0.0.1:20065"]
        );
        // A port in use under the machine's address is in use on loopback.
        let used = BTreeSet::from(["192.0.2.2:20001".to_string()]);
        assert_eq!(
            addresses(&same, &used),
            ["127.0.0.1:20002", "127.0.0.1:20065"]
        );
        // Two machines: each rank at its machine's address.
        let apart = [on("a", "192.0.2.2", 20_000), on("b", "192.0.2.3", 20_000)];
        assert_eq!(
            addresses(&apart, &BTreeSet::new()),
            ["192.0.2.2:20001", "192.0.2.3:20001"]
        );
    }

    /// What one rank of a preview runs and needs: its node, its shard and
    /// its bytes.
    fn ranks_of(preview: &v1::PlacementPreview) -> Vec<(String, ShardSpec, u64)> {
        let instance = preview.instance.as_ref().expect("feasible preview");
        instance
            .ranks
            .iter()
            .map(|r| {
                let shard = r.shard.as_ref().and_then(shard_from_proto).expect("shard");
                (
                    r.node_id.clone(),
                    shard,
                    preview.memory_bytes_by_node[&r.node_id],
                )
            })
            .collect()
    }

    fn preview_of(
        previews: &[v1::PlacementPreview],
        sharding: Sharding,
        count: u32,
    ) -> &v1::PlacementPreview {
        previews
            .iter()
            .find(|p| p.sharding == sharding as i32 && p.node_count == count)
            .expect("a preview for every sharding and node count")
    }

    /// An MoE card's previews on nodes of equal memory, checked against
    /// figures worked out here from the card alone: in a pipeline each rank
    /// holds its layers' share of the file (every layer carries all its
    /// experts); in tensor mode each rank holds a slice of every expert and
    /// of attention, its KV-head groups' share (a 1/world share when the
    /// groups split evenly).
    fn check_moe_previews(model: &ModelCard, gb_per_node: u64, world: u32) {
        let nodes: Vec<NodeCapacity> = (0..world)
            .map(|i| node(&format!("n{i}"), gb_per_node * GB))
            .collect();
        let previews = previews(model, &nodes, &[]);
        assert!(model.supports_tensor, "{}", model.model_id);
        assert_eq!(
            previews.len(),
            2 * world as usize,
            "pipeline and tensor, 1..=world"
        );
        let storage = model.storage_size_bytes;
        let layers = model.n_layers;
        let kv = model.num_key_value_heads;
        assert!(
            layers.is_multiple_of(world),
            "the example splits layers evenly"
        );
        assert!(
            kv.is_multiple_of(world),
            "the example splits KV heads evenly"
        );
        // Pipeline: equal nodes, equal layer ranges.
        let per_rank = layers / world;
        let expected_bytes = storage * u64::from(per_rank) / u64::from(layers) + RANK_OVERHEAD;
        let pipeline = ranks_of(preview_of(&previews, Sharding::Pipeline, world));
        assert_eq!(pipeline.len(), world as usize);
        for (rank, (node_id, shard, bytes)) in pipeline.iter().enumerate() {
            let rank = rank as u32;
            assert_eq!(node_id, &format!("n{rank}"), "ties go by node id");
            assert_eq!(
                *shard,
                ShardSpec::Pipeline {
                    start_layer: rank * per_rank,
                    end_layer: (rank + 1) * per_rank,
                    n_layers: layers,
                },
                "{} rank {rank}",
                model.model_id
            );
            assert_eq!(
                *bytes, expected_bytes,
                "{} pipeline rank {rank}",
                model.model_id
            );
        }
        // Tensor: kv / world KV heads a rank, a 1/world share of the file.
        let kv_share = storage * u64::from(kv / world) / u64::from(kv);
        assert_eq!(kv_share, storage / u64::from(world));
        let tensor = ranks_of(preview_of(&previews, Sharding::Tensor, world));
        assert_eq!(tensor.len(), world as usize);
        for (rank, (_, shard, bytes)) in tensor.iter().enumerate() {
            let rank = rank as u32;
            assert_eq!(
                *shard,
                ShardSpec::Tensor {
                    rank,
                    world_size: world,
                }
            );
            assert_eq!(
                *bytes,
                kv_share + RANK_OVERHEAD,
                "{} tensor rank {rank}",
                model.model_id
            );
        }
        // Too few of these nodes: one node misses what the whole file needs
        // beyond its memory less headroom.
        let usable = gb_per_node * GB - headroom(gb_per_node * GB);
        let one = preview_of(&previews, Sharding::Pipeline, 1);
        assert!(one.instance.is_none(), "{one:?}");
        let missing = storage + RANK_OVERHEAD - usable;
        assert!(
            one.error.contains(&ByteCount(missing).to_string()),
            "{}: {}",
            model.model_id,
            one.error
        );
    }

    #[test]
    fn qwen3_30b_a3b_previews_on_two_and_four_nodes_follow_its_card() {
        let model = shipped_card("qwen3-30b-a3b-q4_k_m");
        assert_eq!(model.family, "qwen3moe");
        // 18.56 GB over two 16 GB nodes (14.4 GB usable each): 24 layers
        // and 9.34 GB a rank in either mode.
        check_moe_previews(&model, 16, 2);
        let two = previews(&model, &[node("a", 16 * GB), node("b", 16 * GB)], &[]);
        let bytes: Vec<u64> = ranks_of(preview_of(&two, Sharding::Pipeline, 2))
            .into_iter()
            .map(|(_, _, b)| b)
            .collect();
        assert_eq!(bytes, [9_342_342_912, 9_342_342_912]);
        // Over four 8 GB nodes (7.2 GB usable): 12 layers or one KV head,
        // 4.70 GB a rank. Two such nodes are not enough; three are for a
        // pipeline (16 layers, 6.25 GB) but not for tensor parallelism,
        // whose 4 KV heads split 2 + 1 + 1 and leave rank 0 half the model.
        check_moe_previews(&model, 8, 4);
        let four: Vec<NodeCapacity> = (0..4).map(|i| node(&format!("n{i}"), 8 * GB)).collect();
        let all = previews(&model, &four, &[]);
        let rank0 = ranks_of(preview_of(&all, Sharding::Tensor, 4))[0].2;
        assert_eq!(rank0, 4_703_171_456);
        assert!(preview_of(&all, Sharding::Pipeline, 2).instance.is_none());
        assert!(preview_of(&all, Sharding::Pipeline, 3).instance.is_some());
        let three = preview_of(&all, Sharding::Tensor, 3);
        assert!(
            three.instance.is_none() && three.error.contains("node n0"),
            "{three:?}"
        );
        // Place picks the fewest nodes that fit: three for a pipeline.
        let placed = run(&model, Sharding::Pipeline, 1, &four).expect("fits on three");
        assert_eq!(placed.instance.ranks.len(), 3);
    }

    #[test]
    fn mixtral_previews_on_two_and_four_nodes_follow_its_card() {
        let model = shipped_card("mixtral-8x7b-instruct-v0.1-q8_0");
        assert_eq!(model.family, "mixtral");
        // 49.6 GB over two 32 GB nodes: 16 layers or 4 KV heads a rank.
        check_moe_previews(&model, 32, 2);
        // Four 16 GB nodes: 8 layers or 2 KV heads a rank.
        check_moe_previews(&model, 16, 4);
    }

    #[test]
    fn a_cluster_too_small_for_an_moe_card_is_refused_with_the_bytes_missing() {
        for (id, gb) in [
            ("qwen3-30b-a3b-q4_k_m", 8),
            ("mixtral-8x7b-instruct-v0.1-q8_0", 24),
        ] {
            let model = shipped_card(id);
            let nodes = [node("a", gb * GB), node("b", gb * GB)];
            let usable = gb * GB - headroom(gb * GB);
            // The last try is both nodes, half the layers each.
            let needed = model.storage_size_bytes * u64::from(model.n_layers / 2)
                / u64::from(model.n_layers)
                + RANK_OVERHEAD;
            for sharding in [Sharding::Pipeline, Sharding::Tensor] {
                let error = run(&model, sharding, 1, &nodes).expect_err("too small");
                assert_eq!(
                    error,
                    PlacementError::NotEnoughMemory {
                        model: id.to_string(),
                        nodes: 2,
                        node: "a".into(),
                        needed: ByteCount(needed),
                        available: ByteCount(gb * GB),
                        missing: ByteCount(needed - usable),
                        headroom: ByteCount(headroom(gb * GB)),
                    },
                    "{id} {sharding:?}"
                );
                assert!(error.to_string().contains("missing"), "{error}");
            }
        }
    }
}
