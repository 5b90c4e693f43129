//! This node's local events (node info, runner statuses, download progress,
//! finished tasks) on their way to the master, which indexes them into the
//! log.
//!
//! The master drops a local event whose sequence number is not above the
//! last one it indexed from that node (that is how it tells a re-send), and
//! one whose predecessor it has not indexed (that one was lost). So:
//! - numbers must reach the master in the order they were given, so one
//!   lock covers taking a number and putting the event (zenoh keeps one
//!   session's puts in order): several actors publish, and a number taken
//!   by one and put after a later number of another would be lost;
//! - a restarted node keeps its identity, so its numbers must continue
//!   above its previous run's: they start at the microseconds since the
//!   Unix epoch, which a node cannot outrun by sending one event per
//!   microsecond, rather than at 1, which a master that saw the previous
//!   run would ignore until the new run had sent as many events;
//! - a report put while the master was dying is lost with it: each report
//!   is kept until the state shows it indexed (`local_seqs`), and what is
//!   not indexed a second after it was put is put again, in order
//!   ([`LocalEvents::acknowledge`]). The new master starts from the
//!   state's numbers, so a report the old one indexed is not taken twice;
//! - a report the state showed may still be dropped from it: a master that
//!   lost its election may have indexed it, and the replica then drops that
//!   forked tail. So reports indexed lately are kept a while longer, and
//!   when the state's number for this node goes back, the ones above it
//!   are put again.

use std::collections::VecDeque;
#[cfg(test)]
use std::time::Duration;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use tessera_protos::v1::{event, Event, LocalEvent};
use tokio::sync::Mutex;

use crate::bus::{Bus, BusError};

/// Reports kept for a resend; beyond it the oldest are given up (the
/// master has been away for thousands of reports).
const MAX_UNACKNOWLEDGED: usize = 4_096;
/// How long a report may go unindexed before it is put again.
const RESEND_AFTER: std::time::Duration = std::time::Duration::from_secs(1);
/// How long an indexed report is kept in case the state drops it again
/// (a forked tail is dropped within seconds of the election that ends it).
const KEEP_INDEXED_FOR: std::time::Duration = std::time::Duration::from_secs(60);

/// Publishes this node's local events in one ordered sequence. Shared by
/// the actors that report (wrap it in an `Arc`).
pub struct LocalEvents {
    bus: Bus,
    node_id: String,
    inner: Mutex<Sequence>,
}

struct Sequence {
    /// The last sequence number given.
    last_seq: u64,
    /// Put but not yet seen in the state, oldest first, with when each was
    /// last put.
    unacknowledged: VecDeque<(LocalEvent, Instant)>,
    /// Seen in the state, oldest first, with when each was first seen
    /// there: put again should the state drop them.
    indexed: VecDeque<(LocalEvent, Instant)>,
}

impl LocalEvents {
    pub fn new(bus: Bus, node_id: String) -> Self {
        Self {
            bus,
            node_id,
            inner: Mutex::new(Sequence {
                last_seq: first_seq() - 1,
                unacknowledged: VecDeque::new(),
                indexed: VecDeque::new(),
            }),
        }
    }

    /// The node these events come from.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// Numbers `kind` and puts it on the local events key.
    pub async fn publish(&self, kind: event::Kind) -> Result<(), BusError> {
        let mut sequence = self.inner.lock().await;
        let previous_seq = sequence
            .unacknowledged
            .back()
            .map_or(0, |(last, _)| last.origin_seq);
        sequence.last_seq += 1;
        let local = LocalEvent {
            origin_node_id: self.node_id.clone(),
            origin_seq: sequence.last_seq,
            event: Some(Event { kind: Some(kind) }),
            previous_seq,
        };
        if sequence.unacknowledged.len() >= MAX_UNACKNOWLEDGED {
            sequence.unacknowledged.pop_front();
            // The chain starts again: the master takes the new oldest one
            // whatever came before it.
            if let Some((oldest, _)) = sequence.unacknowledged.front_mut() {
                oldest.previous_seq = 0;
            }
            tracing::warn!("gave up the oldest unindexed report (no master for a long time)");
        }
        sequence
            .unacknowledged
            .push_back((local.clone(), Instant::now()));
        self.bus.put(&self.bus.keys.local_events(), &local).await
    }

    /// Like [`publish`](Self::publish), logging a failure (a report that
    /// could not be put is put again by [`acknowledge`](Self::acknowledge)).
    pub async fn publish_or_log(&self, kind: event::Kind) {
        if let Err(error) = self.publish(kind).await {
            tracing::warn!(%error, "publishing a local event");
        }
    }

    /// The state has indexed this node's reports up to `indexed`: those are
    /// set aside, and the rest are put again, in order, once the oldest has
    /// waited [`RESEND_AFTER`] (at once when the state dropped reports it
    /// had shown). Returns how many were put again.
    pub async fn acknowledge(&self, indexed: u64) -> usize {
        let mut sequence = self.inner.lock().await;
        let dropped = sequence.take_back_dropped(indexed);
        sequence.set_aside_indexed(indexed);
        let due = sequence
            .unacknowledged
            .front()
            .is_some_and(|(_, put)| dropped || put.elapsed() >= RESEND_AFTER);
        if !due {
            return 0;
        }
        let key = self.bus.keys.local_events();
        let mut resent = 0;
        for (local, put) in sequence.unacknowledged.iter_mut() {
            if let Err(error) = self.bus.put(&key, local).await {
                tracing::debug!(%error, "putting a report again");
                break;
            }
            *put = Instant::now();
            resent += 1;
        }
        if resent > 0 {
            tracing::info!(resent, indexed, "reports not indexed yet; sent again");
        }
        resent
    }
}

impl Sequence {
    /// Moves the reports the state showed but no longer holds (numbered
    /// above `indexed`) back to the front of the unacknowledged ones.
    /// Returns whether there were any.
    fn take_back_dropped(&mut self, indexed: u64) -> bool {
        let mut dropped = false;
        while let Some((local, _)) = self.indexed.back() {
            if local.origin_seq <= indexed {
                break;
            }
            if let Some(report) = self.indexed.pop_back() {
                self.unacknowledged.push_front(report);
                dropped = true;
            }
        }
        if let Some((oldest, _)) = self.unacknowledged.front_mut() {
            if dropped && oldest.previous_seq > indexed {
                // Its predecessor is gone from the state and from here too:
                // the chain starts again.
                oldest.previous_seq = 0;
            }
        }
        if dropped {
            tracing::warn!(
                indexed,
                "the state dropped reports it had indexed; putting them again"
            );
        }
        dropped
    }

    /// Moves the reports numbered up to `indexed` to the indexed ones, and
    /// forgets those indexed long ago.
    fn set_aside_indexed(&mut self, indexed: u64) {
        while self
            .unacknowledged
            .front()
            .is_some_and(|(local, _)| local.origin_seq <= indexed)
        {
            if let Some((local, _)) = self.unacknowledged.pop_front() {
                self.indexed.push_back((local, Instant::now()));
            }
        }
        while self.indexed.len() > MAX_UNACKNOWLEDGED
            || self
                .indexed
                .front()
                .is_some_and(|(_, seen)| seen.elapsed() >= KEEP_INDEXED_FOR)
        {
            self.indexed.pop_front();
        }
    }
}

/// The first sequence number of this run: above every number a previous
/// run of this node gave, as long as the clock has not gone back by more
/// than that run lasted.
fn first_seq() -> u64 {
    let micros = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|since| since.as_micros())
        .unwrap_or(0);
    u64::try_from(micros).unwrap_or(u64::MAX / 2).max(1)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use prost::Message;

    use super::*;
    use crate::bus::keys::Keys;

    /// A session of its own that reaches no one (no listening, no
    /// scouting), whose subscriber hears its own puts.
    async fn lonely_bus() -> Bus {
        let mut config = crate::bus::zenoh_config("peer", &[], &[], false, None).expect("config");
        config
            .insert_json5("listen/endpoints", "[]")
            .expect("no listening");
        let session = zenoh::open(config).await.expect("a zenoh session");
        Bus::new(session, Keys::new("local-events-test").expect("keys"))
    }

    fn info(node_id: &str) -> event::Kind {
        event::Kind::NodeGatheredInfo(tessera_protos::v1::NodeGatheredInfo {
            node_id: node_id.to_string(),
            info: None,
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reports_the_state_drops_after_showing_them_are_put_again_at_once() {
        let events = LocalEvents::new(lonely_bus().await, "n1".into());
        for _ in 0..3 {
            events.publish(info("n1")).await.expect("published");
        }
        let seqs: Vec<u64> = {
            let sequence = events.inner.lock().await;
            sequence
                .unacknowledged
                .iter()
                .map(|(local, _)| local.origin_seq)
                .collect()
        };
        // A master indexes all three, then loses its election; the replica
        // drops the last two with the forked tail.
        assert_eq!(events.acknowledge(seqs[2]).await, 0, "nothing due");
        assert_eq!(events.acknowledge(seqs[0]).await, 2, "the two dropped");
        // They wait for the new master like any unindexed report.
        assert_eq!(events.acknowledge(seqs[0]).await, 0, "not due yet");
        assert_eq!(events.acknowledge(seqs[2]).await, 0, "indexed again");
        let sequence = events.inner.lock().await;
        assert!(sequence.unacknowledged.is_empty());
        assert_eq!(sequence.indexed.len(), 3);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn numbers_arrive_in_order_from_concurrent_publishers_and_continue_after_a_restart() {
        let bus = lonely_bus().await;
        let subscriber = bus
            .session
            .declare_subscriber(bus.keys.local_events())
            .await
            .expect("subscriber");
        let events = Arc::new(LocalEvents::new(bus.clone(), "n1".into()));
        let publishers: Vec<_> = (0..4)
            .map(|_| {
                let events = events.clone();
                tokio::spawn(async move {
                    for _ in 0..50 {
                        events.publish(info("n1")).await.expect("published");
                    }
                })
            })
            .collect();
        for publisher in publishers {
            publisher.await.expect("publisher ran");
        }
        // The node restarts under the same identity (which takes longer than
        // this).
        tokio::time::sleep(Duration::from_millis(1)).await;
        let restarted = LocalEvents::new(bus.clone(), "n1".into());
        restarted.publish(info("n1")).await.expect("published");

        let mut seqs = Vec::new();
        while seqs.len() < 201 {
            let sample = tokio::time::timeout(Duration::from_secs(10), subscriber.recv_async())
                .await
                .expect("every event arrives")
                .expect("subscriber open");
            let local = LocalEvent::decode(&*sample.payload().to_bytes()).expect("a local event");
            seqs.push(local.origin_seq);
        }
        // What the master needs: each number above the last it saw.
        assert!(
            seqs.windows(2).all(|pair| pair[0] < pair[1]),
            "numbers in order: {seqs:?}"
        );
    }
}
