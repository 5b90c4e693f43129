//! Folding a log back into a [`State`], and [`Journal`], the write path that
//! persists each event before applying it.

use std::path::Path;

use tessera_protos::v1::IndexedEvent;

use crate::log::{EventLog, LogError, LogView};
use crate::state::{Applied, ApplyError, State};

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("cannot apply event {index}: {source}")]
    Apply { index: u64, source: ApplyError },
    #[error("the log ends at index {last}; cannot replay until {until}")]
    PastEnd { until: u64, last: u64 },
    #[error("the log is missing event {index} (it ends at {last})")]
    Gap { index: u64, last: u64 },
}

/// How to replay.
#[derive(Clone, Copy, Debug)]
pub struct ReplayOptions {
    /// Fold events up to and including this index; `None`: to the end.
    pub until: Option<u64>,
    /// Start from the nearest snapshot (the default) or from the empty state.
    pub use_snapshots: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            until: None,
            use_snapshots: true,
        }
    }
}

/// The outcome of a replay.
#[derive(Debug)]
pub struct Replayed {
    pub state: State,
    /// The snapshot the fold started from, if any.
    pub from_snapshot: Option<u64>,
    /// Events folded after the snapshot.
    pub events_applied: u64,
    /// Of those, events that changed nothing but the index.
    pub events_ignored: u64,
    /// Newer snapshots that were corrupted and passed over.
    pub skipped_snapshots: Vec<LogError>,
}

impl LogView {
    /// Folds the view as [`replay`] folds a log (`tessera replay`).
    pub fn replay(&self, options: ReplayOptions) -> Result<Replayed, ReplayError> {
        replay(self.log(), options)
    }
}

/// Folds `log` into a State up to `options.until`, starting from the latest
/// intact snapshot at or before it when `options.use_snapshots`.
pub fn replay(log: &EventLog, options: ReplayOptions) -> Result<Replayed, ReplayError> {
    let last = log.last_index();
    let until = options.until.unwrap_or(last);
    if until > last {
        return Err(ReplayError::PastEnd { until, last });
    }
    let (mut state, skipped_snapshots) = if options.use_snapshots {
        let lookup = log.latest_snapshot(until)?;
        (lookup.state.unwrap_or_default(), lookup.skipped)
    } else {
        (State::new(), Vec::new())
    };
    let from_snapshot = (state.last_index() > 0).then_some(state.last_index());
    let mut events_applied = 0;
    let mut events_ignored = 0;
    for event in log.range(state.last_index() + 1, until) {
        let event = event?;
        let index = event.index;
        match state.apply(&event) {
            Ok(Applied::Changed) => {}
            Ok(Applied::Ignored(_)) => events_ignored += 1,
            Err(ApplyError::OutOfOrder { expected, .. }) => {
                return Err(ReplayError::Gap {
                    index: expected,
                    last,
                })
            }
            Err(source) => return Err(ReplayError::Apply { index, source }),
        }
        events_applied += 1;
    }
    if state.last_index() != until {
        return Err(ReplayError::Gap {
            index: state.last_index() + 1,
            last,
        });
    }
    Ok(Replayed {
        state,
        from_snapshot,
        events_applied,
        events_ignored,
        skipped_snapshots,
    })
}

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error(transparent)]
    Log(#[from] LogError),
    #[error(transparent)]
    Replay(#[from] ReplayError),
    #[error("refusing event {index}: {source}")]
    Rejected { index: u64, source: ApplyError },
}

/// A node's persistent view of the cluster: the log and the State folded from
/// it. Events are checked, persisted, then applied; a snapshot is written
/// every `snapshot_every` events.
pub struct Journal {
    log: EventLog,
    state: State,
    snapshot_every: u64,
}

impl Journal {
    /// How often snapshots are written by default: a replay from the latest
    /// snapshot then folds at most this many events.
    pub const DEFAULT_SNAPSHOT_EVERY: u64 = 10_000;

    /// Opens (or creates) the log in `dir` and replays it.
    pub fn open(dir: impl AsRef<Path>, snapshot_every: u64) -> Result<Self, JournalError> {
        let log = EventLog::open(dir)?;
        let replayed = replay(&log, ReplayOptions::default())?;
        for skipped in &replayed.skipped_snapshots {
            tracing::warn!(%skipped, "passed over a corrupted snapshot");
        }
        Ok(Self {
            log,
            state: replayed.state,
            snapshot_every: snapshot_every.max(1),
        })
    }

    pub fn state(&self) -> &State {
        &self.state
    }

    pub fn log(&self) -> &EventLog {
        &self.log
    }

    /// Checks `event` against the state, persists it, applies it, and writes
    /// a snapshot when one is due. A refused event is neither stored nor
    /// applied.
    pub fn commit(&mut self, event: &IndexedEvent) -> Result<Applied, JournalError> {
        self.state
            .check(event)
            .map_err(|source| JournalError::Rejected {
                index: event.index,
                source,
            })?;
        self.log.append(event)?;
        let applied = self
            .state
            .apply(event)
            .map_err(|source| JournalError::Rejected {
                index: event.index,
                source,
            })?;
        if let Applied::Ignored(reason) = &applied {
            tracing::debug!(index = event.index, %reason, "event changed nothing");
        }
        if event.index.is_multiple_of(self.snapshot_every) {
            self.log.write_snapshot(&self.state)?;
        }
        Ok(applied)
    }

    /// Drops every event after `index` and folds the state again up to it
    /// (from the nearest snapshot). Returns how many events were dropped.
    pub fn truncate_after(&mut self, index: u64) -> Result<u64, JournalError> {
        let removed = self.log.truncate_after(index)?;
        if removed > 0 {
            self.log.flush()?;
            self.state = replay(&self.log, ReplayOptions::default())?.state;
        }
        Ok(removed)
    }

    /// Makes every committed event durable.
    pub fn flush(&self) -> Result<(), JournalError> {
        Ok(self.log.flush()?)
    }
}
