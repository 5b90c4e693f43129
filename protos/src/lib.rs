//! tessera's wire protocol: the protobuf messages of package `tessera.v1`.
//!
//! # Layout
//! - `proto/tessera/v1/*.proto`: the contract. Field numbers are stable; see
//!   `README.md` beside them for which key expression carries which message.
//! - [`v1`]: prost types generated at build time, with `BTreeMap` for proto
//!   maps (so encodings are canonical) and proto3-JSON serde impls (pbjson).
//! - [`event_type_name`]: the stable name of an event's variant, for logs and
//!   the `replay --events` output.

/// Generated types of package `tessera.v1`.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/tessera.v1.rs"));
    include!(concat!(env!("OUT_DIR"), "/tessera.v1.serde.rs"));
}

/// The encoded `FileDescriptorSet` of the protocol, for reflection-based
/// clients and tools.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/tessera_descriptor.bin"));

pub use prost::Message;

use v1::event::Kind as EventKind;

/// The name of an event's variant as written in the protocol
/// (`"TaskCreated"`, ...), or `"Empty"` for an event without a body.
pub fn event_type_name(event: &v1::Event) -> &'static str {
    match &event.kind {
        None => "Empty",
        Some(kind) => match kind {
            EventKind::NodeGatheredInfo(_) => "NodeGatheredInfo",
            EventKind::NodeTimedOut(_) => "NodeTimedOut",
            EventKind::TopologyEdgeCreated(_) => "TopologyEdgeCreated",
            EventKind::TopologyEdgeDeleted(_) => "TopologyEdgeDeleted",
            EventKind::InstanceCreated(_) => "InstanceCreated",
            EventKind::InstanceDeleted(_) => "InstanceDeleted",
            EventKind::RunnerStatusUpdated(_) => "RunnerStatusUpdated",
            EventKind::RunnerDeleted(_) => "RunnerDeleted",
            EventKind::TaskCreated(_) => "TaskCreated",
            EventKind::TaskAcknowledged(_) => "TaskAcknowledged",
            EventKind::TaskStatusUpdated(_) => "TaskStatusUpdated",
            EventKind::TaskDeleted(_) => "TaskDeleted",
            EventKind::NodeDownloadProgress(_) => "NodeDownloadProgress",
            EventKind::ModelCardAdded(_) => "ModelCardAdded",
            EventKind::MemberRevoked(_) => "MemberRevoked",
            EventKind::InstanceDraftModelUpdated(_) => "InstanceDraftModelUpdated",
        },
    }
}

#[cfg(test)]
mod tests {
    use super::v1;
    use prost::Message;

    #[test]
    fn indexed_event_round_trips_through_bytes_and_json() -> Result<(), Box<dyn std::error::Error>>
    {
        let event = v1::IndexedEvent {
            index: 7,
            session: Some(v1::SessionId {
                master_node_id: "n1".into(),
                election_clock: 3,
            }),
            event: Some(v1::Event {
                kind: Some(v1::event::Kind::TaskDeleted(v1::TaskDeleted {
                    task_id: "t".into(),
                })),
            }),
            origin_node_id: "n2".into(),
            origin_seq: 11,
        };
        let bytes = event.encode_to_vec();
        assert_eq!(v1::IndexedEvent::decode(bytes.as_slice())?, event);
        let json = serde_json::to_string(&event)?;
        assert!(json.contains("\"taskDeleted\""), "{json}");
        let back: v1::IndexedEvent = serde_json::from_str(&json)?;
        assert_eq!(back, event);
        Ok(())
    }

    #[test]
    fn garbage_bytes_do_not_decode_as_an_event() {
        // A field header naming field 1 as a length-delimited value longer than the input.
        let garbage = [0x0a, 0xff, 0x01, 0x02];
        assert!(v1::IndexedEvent::decode(&garbage[..]).is_err());
    }

    #[test]
    fn descriptor_set_names_every_file() -> Result<(), prost::DecodeError> {
        let set = prost_types_lite::decode_names(super::FILE_DESCRIPTOR_SET)?;
        for file in [
            "common", "node", "model", "instance", "runner", "task", "command", "event", "chunk",
            "election", "state", "admin", "download",
        ] {
            assert!(
                set.iter()
                    .any(|name| name == &format!("tessera/v1/{file}.proto")),
                "{file} missing from {set:?}"
            );
        }
        Ok(())
    }

    /// Reads only the file names out of a FileDescriptorSet, without pulling
    /// prost-types into the crate's dependencies.
    mod prost_types_lite {
        use prost::Message;

        #[derive(Clone, PartialEq, Message)]
        struct FileDescriptorSet {
            #[prost(message, repeated, tag = "1")]
            file: Vec<FileDescriptorProto>,
        }
        #[derive(Clone, PartialEq, Message)]
        struct FileDescriptorProto {
            #[prost(string, optional, tag = "1")]
            name: Option<String>,
        }

        pub fn decode_names(bytes: &[u8]) -> Result<Vec<String>, prost::DecodeError> {
            let set = FileDescriptorSet::decode(bytes)?;
            Ok(set.file.into_iter().filter_map(|f| f.name).collect())
        }
    }
}
