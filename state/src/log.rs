//! [`EventLog`]: the persistent, indexed event log of a node, on sled.
//!
//! Tree `events`: big-endian u64 index → `crc32(payload) ‖ payload`, where
//! the payload is the protobuf `IndexedEvent`. Tree `snapshots`: big-endian
//! u64 index → `crc32 ‖ ClusterState` after folding events 1..=index.
//! Every read checks the checksum and that the stored event carries the index
//! of its key; a mismatch is reported with the index, never skipped.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use prost::Message;
use tessera_protos::v1::{ClusterState, IndexedEvent};

use crate::state::{validate_event, State};

/// How long `open` waits for another holder of the log to let go.
const LOCK_WAIT: Duration = Duration::from_secs(3);

/// Bytes in front of each payload: its CRC-32 (IEEE), big-endian.
const CRC_LEN: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("no event log at {}: the directory does not exist", path.display())]
    Missing { path: PathBuf },
    #[error("cannot open the event log at {}: {source}", path.display())]
    Open { path: PathBuf, source: sled::Error },
    #[error(
        "the event log at {} is in use by another process (is a node running on this data dir?)",
        path.display()
    )]
    Locked { path: PathBuf },
    #[error("the event log's storage failed: {0}")]
    Storage(#[from] sled::Error),
    #[error("refusing to append event {got}: the next index is {expected}")]
    OutOfOrder { expected: u64, got: u64 },
    #[error("event {index} is corrupted: {reason}")]
    Corrupted { index: u64, reason: String },
    #[error("snapshot at index {index} is corrupted: {reason}")]
    CorruptedSnapshot { index: u64, reason: String },
    #[error("the event log holds a key of {len} bytes, not an 8-byte index")]
    BadKey { len: usize },
}

/// The sled-backed log of indexed events and State snapshots.
pub struct EventLog {
    /// Kept so the database stays open as long as the trees are used.
    db: sled::Db,
    events: sled::Tree,
    snapshots: sled::Tree,
    /// Cached so `append` need not read the tree.
    last_index: u64,
    /// Reused encoding buffer: no allocation per append beyond sled's own.
    buf: Vec<u8>,
}

impl EventLog {
    /// Opens the log in `dir`, creating it if needed.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, LogError> {
        let dir = dir.as_ref();
        // sled releases its file lock only when its background threads let go
        // of the database, a moment after the last handle is dropped: a
        // reopen in quick succession waits for it, within a bound.
        let deadline = Instant::now() + LOCK_WAIT;
        let mut pause = Duration::from_millis(5);
        loop {
            match Self::sled_config(dir).open() {
                Ok(db) => return Self::from_db(db),
                Err(source) if is_lock_error(&source) && Instant::now() < deadline => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(200));
                }
                Err(source) if is_lock_error(&source) => {
                    return Err(LogError::Locked {
                        path: dir.to_owned(),
                    });
                }
                Err(source) => {
                    return Err(LogError::Open {
                        path: dir.to_owned(),
                        source,
                    })
                }
            }
        }
    }

    /// The sled settings of every event log (public so that benchmarks can
    /// compare against raw sled under the very same settings).
    pub fn sled_config(dir: &Path) -> sled::Config {
        sled::Config::new()
            .path(dir)
            // Events are small and written in bulk: favour throughput.
            .mode(sled::Mode::HighThroughput)
            // The owner flushes explicitly (after each batch of events); a
            // background flusher would only compete for the CPU.
            .flush_every_ms(None)
    }

    /// Opens an existing log; a missing directory is an error, not a new log.
    pub fn open_existing(dir: impl AsRef<Path>) -> Result<Self, LogError> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            return Err(LogError::Missing {
                path: dir.to_owned(),
            });
        }
        Self::open(dir)
    }

    fn from_db(db: sled::Db) -> Result<Self, LogError> {
        let events = db.open_tree("events")?;
        let snapshots = db.open_tree("snapshots")?;
        let last_index = match events.last()? {
            Some((key, _)) => decode_key(&key)?,
            None => 0,
        };
        Ok(Self {
            db,
            events,
            snapshots,
            last_index,
            buf: Vec::with_capacity(256),
        })
    }

    /// A read-only view of the log as it stands now: the same trees, its
    /// end fixed at this moment, so a fold (time travel) can read it on
    /// another thread while the owner goes on appending.
    pub fn view(&self) -> LogView {
        LogView(Self {
            db: self.db.clone(),
            events: self.events.clone(),
            snapshots: self.snapshots.clone(),
            last_index: self.last_index,
            buf: Vec::new(),
        })
    }

    /// The index of the last stored event; 0 when the log is empty.
    pub fn last_index(&self) -> u64 {
        self.last_index
    }

    /// The index of the first stored event; `None` when the log is empty.
    pub fn first_index(&self) -> Result<Option<u64>, LogError> {
        self.events
            .first()?
            .map(|(key, _)| decode_key(&key))
            .transpose()
    }

    /// Appends one event. Its index must be exactly `last_index() + 1`.
    /// Durable after the next [`EventLog::flush`].
    pub fn append(&mut self, event: &IndexedEvent) -> Result<(), LogError> {
        let expected = self.last_index + 1;
        if event.index != expected {
            return Err(LogError::OutOfOrder {
                expected,
                got: event.index,
            });
        }
        encode_entry(event, &mut self.buf);
        self.events
            .insert(event.index.to_be_bytes(), self.buf.as_slice())?;
        self.last_index = event.index;
        Ok(())
    }

    /// Appends contiguous events atomically: all or none are stored.
    pub fn append_batch(&mut self, events: &[IndexedEvent]) -> Result<(), LogError> {
        let mut batch = sled::Batch::default();
        let mut next = self.last_index + 1;
        for event in events {
            if event.index != next {
                return Err(LogError::OutOfOrder {
                    expected: next,
                    got: event.index,
                });
            }
            encode_entry(event, &mut self.buf);
            batch.insert(&event.index.to_be_bytes(), self.buf.as_slice());
            next += 1;
        }
        self.events.apply_batch(batch)?;
        self.last_index = next - 1;
        Ok(())
    }

    /// Removes every event after `index`, and every snapshot after it, in
    /// one atomic batch per tree: the log then ends at `index`. The only
    /// way a stored event is ever undone: a follower drops the tail that a
    /// master which lost its election wrote (see the Replica's fork repair).
    pub fn truncate_after(&mut self, index: u64) -> Result<u64, LogError> {
        if index >= self.last_index {
            return Ok(0);
        }
        let start = index.saturating_add(1).to_be_bytes();
        let mut events = sled::Batch::default();
        let mut removed = 0;
        for key in self.events.range(start..).keys() {
            events.remove(key?);
            removed += 1;
        }
        let mut snapshots = sled::Batch::default();
        for key in self.snapshots.range(start..).keys() {
            snapshots.remove(key?);
        }
        // Snapshots first: a crash between the two batches leaves events
        // without a newer snapshot, never a snapshot past the log's end.
        self.snapshots.apply_batch(snapshots)?;
        self.events.apply_batch(events)?;
        self.last_index = match self.events.last()? {
            Some((key, _)) => decode_key(&key)?,
            None => 0,
        };
        Ok(removed)
    }

    /// Makes everything appended so far durable.
    pub fn flush(&self) -> Result<(), LogError> {
        self.db.flush()?;
        Ok(())
    }

    /// The event at `index`, if stored.
    pub fn get(&self, index: u64) -> Result<Option<IndexedEvent>, LogError> {
        self.events
            .get(index.to_be_bytes())?
            .map(|bytes| decode_entry(index, &bytes))
            .transpose()
    }

    /// The stored events with indices in `from..=to`, in order, each checked.
    pub fn range(
        &self,
        from: u64,
        to: u64,
    ) -> impl Iterator<Item = Result<IndexedEvent, LogError>> + '_ {
        self.events
            .range(from.to_be_bytes()..=to.to_be_bytes())
            .map(|item| {
                let (key, value) = item?;
                let index = decode_key(&key)?;
                decode_entry(index, &value)
            })
    }

    /// Stores `state` as the snapshot at its last index.
    pub fn write_snapshot(&mut self, state: &State) -> Result<(), LogError> {
        self.buf.clear();
        self.buf.extend_from_slice(&[0; CRC_LEN]);
        state
            .as_proto()
            .encode(&mut self.buf)
            .map_err(|e| LogError::CorruptedSnapshot {
                index: state.last_index(),
                reason: e.to_string(),
            })?;
        let crc = crc32fast::hash(&self.buf[CRC_LEN..]);
        self.buf[..CRC_LEN].copy_from_slice(&crc.to_be_bytes());
        self.snapshots
            .insert(state.last_index().to_be_bytes(), self.buf.as_slice())?;
        Ok(())
    }

    /// Indices that have a snapshot, ascending.
    pub fn snapshot_indices(&self) -> Result<Vec<u64>, LogError> {
        self.snapshots
            .iter()
            .keys()
            .map(|key| decode_key(&key?))
            .collect()
    }

    /// The latest snapshot at or before `until`, newest first among those that
    /// read back intact. A corrupted snapshot is only a lost shortcut: it is
    /// reported to the caller in `skipped` and an older one is tried.
    pub fn latest_snapshot(&self, until: u64) -> Result<SnapshotLookup, LogError> {
        let mut skipped = Vec::new();
        for item in self.snapshots.range(..=until.to_be_bytes()).rev() {
            let (key, value) = item?;
            let index = decode_key(&key)?;
            match decode_snapshot(index, &value) {
                Ok(state) => {
                    return Ok(SnapshotLookup {
                        state: Some(state),
                        skipped,
                    })
                }
                Err(error) => skipped.push(error),
            }
        }
        Ok(SnapshotLookup {
            state: None,
            skipped,
        })
    }

    /// Rewrites the stored bytes of entry `index`, bypassing every check.
    /// For fault-injection tests of the corruption path only.
    #[doc(hidden)]
    pub fn overwrite_raw_entry(&self, index: u64, bytes: &[u8]) -> Result<(), LogError> {
        self.events.insert(index.to_be_bytes(), bytes)?;
        Ok(())
    }

    /// Rewrites the stored bytes of the snapshot at `index`, unchecked.
    #[doc(hidden)]
    pub fn overwrite_raw_snapshot(&self, index: u64, bytes: &[u8]) -> Result<(), LogError> {
        self.snapshots.insert(index.to_be_bytes(), bytes)?;
        Ok(())
    }

    /// The stored bytes of the snapshot at `index`, unchecked.
    #[doc(hidden)]
    pub fn raw_snapshot(&self, index: u64) -> Result<Option<Vec<u8>>, LogError> {
        Ok(self.snapshots.get(index.to_be_bytes())?.map(|v| v.to_vec()))
    }

    /// Removes entry `index` behind the log's back, making a gap.
    #[doc(hidden)]
    pub fn remove_raw_entry(&self, index: u64) -> Result<(), LogError> {
        self.events.remove(index.to_be_bytes())?;
        Ok(())
    }

    /// The stored bytes of entry `index`, unchecked.
    #[doc(hidden)]
    pub fn raw_entry(&self, index: u64) -> Result<Option<Vec<u8>>, LogError> {
        Ok(self.events.get(index.to_be_bytes())?.map(|v| v.to_vec()))
    }
}

/// The result of [`EventLog::latest_snapshot`].
#[derive(Debug)]
pub struct SnapshotLookup {
    pub state: Option<State>,
    /// Newer snapshots that were corrupted and passed over.
    pub skipped: Vec<LogError>,
}

/// A read-only view of an [`EventLog`] (see [`EventLog::view`]): it can only
/// be folded, never written.
pub struct LogView(EventLog);

impl LogView {
    /// The index of the last event the view holds.
    pub fn last_index(&self) -> u64 {
        self.0.last_index()
    }

    /// The log behind the view, for this crate's readers (`replay`).
    pub(crate) fn log(&self) -> &EventLog {
        &self.0
    }
}

/// Encodes `event` as a stored entry (`crc32 ‖ protobuf`) into `buf`.
pub fn encode_entry(event: &IndexedEvent, buf: &mut Vec<u8>) {
    buf.clear();
    buf.extend_from_slice(&[0; CRC_LEN]);
    // Encoding into a Vec cannot run out of capacity.
    let _ = event.encode(buf);
    let crc = crc32fast::hash(&buf[CRC_LEN..]);
    buf[..CRC_LEN].copy_from_slice(&crc.to_be_bytes());
}

/// Decodes and checks a stored entry expected at `index`.
pub fn decode_entry(index: u64, bytes: &[u8]) -> Result<IndexedEvent, LogError> {
    let corrupted = |reason: String| LogError::Corrupted { index, reason };
    let payload = checked_payload(bytes).map_err(corrupted)?;
    let event =
        IndexedEvent::decode(payload).map_err(|e| corrupted(format!("undecodable event: {e}")))?;
    if event.index != index {
        return Err(corrupted(format!(
            "stored under index {index} but carries index {}",
            event.index
        )));
    }
    validate_event(&event).map_err(|e| corrupted(e.to_string()))?;
    Ok(event)
}

fn decode_snapshot(index: u64, bytes: &[u8]) -> Result<State, LogError> {
    let corrupted = |reason: String| LogError::CorruptedSnapshot { index, reason };
    let payload = checked_payload(bytes).map_err(corrupted)?;
    let state =
        ClusterState::decode(payload).map_err(|e| corrupted(format!("undecodable state: {e}")))?;
    if state.last_index != index {
        return Err(corrupted(format!(
            "stored under index {index} but is at index {}",
            state.last_index
        )));
    }
    Ok(State::from_proto(state))
}

fn checked_payload(bytes: &[u8]) -> Result<&[u8], String> {
    if bytes.len() < CRC_LEN {
        return Err(format!(
            "entry of {} bytes is shorter than its checksum",
            bytes.len()
        ));
    }
    let (crc, payload) = bytes.split_at(CRC_LEN);
    let stored = u32::from_be_bytes([crc[0], crc[1], crc[2], crc[3]]);
    let actual = crc32fast::hash(payload);
    if stored != actual {
        return Err(format!(
            "checksum mismatch (stored {stored:08x}, computed {actual:08x})"
        ));
    }
    Ok(payload)
}

/// sled reports a held file lock only as an I/O error with this text.
fn is_lock_error(error: &sled::Error) -> bool {
    matches!(error, sled::Error::Io(io) if io.to_string().contains("could not acquire lock"))
}

fn decode_key(key: &[u8]) -> Result<u64, LogError> {
    let bytes: [u8; 8] = key
        .try_into()
        .map_err(|_| LogError::BadKey { len: key.len() })?;
    Ok(u64::from_be_bytes(bytes))
}
