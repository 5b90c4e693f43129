//! `tessera bench log`: the event log's append and replay speed, against raw
//! sled inserts of the very same bytes in the same run, so that the log's own
//! overhead (encoding, checksums, order checks) shows as a ratio.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{ensure, Context};
use clap::Args;
use serde::Serialize;
use tessera_protos::v1::IndexedEvent;
use tessera_state::log::encode_entry;
use tessera_state::synthetic::SyntheticEvents;
use tessera_state::{replay, EventLog, Journal, ReplayOptions, State};

use super::stats::Spread;

#[derive(Debug, Args)]
pub struct LogBenchArgs {
    /// Events per run.
    #[arg(long, default_value_t = 1_000_000)]
    events: u64,
    /// Flush (fsync) every this many events, in every variant.
    #[arg(long, default_value_t = 10_000)]
    flush_every: u64,
    /// Write a State snapshot every this many events (the commit path).
    #[arg(long, default_value_t = Journal::DEFAULT_SNAPSHOT_EVERY)]
    snapshot_every: u64,
    /// Repetitions; figures are min/median/max over them.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
    /// Where to put the temporary logs (default: the system temp dir).
    #[arg(long)]
    dir: Option<PathBuf>,
}

#[derive(Debug, Serialize)]
struct Report {
    bench: &'static str,
    events: u64,
    flush_every: u64,
    snapshot_every: u64,
    repeat: usize,
    mean_entry_bytes: f64,
    /// Raw `Tree::insert` of the pre-encoded entries, same flushes.
    raw_sled_insert_events_per_s: Spread,
    /// `EventLog::append`: order check, protobuf encoding, CRC, insert.
    append_events_per_s: Spread,
    /// Per repetition, append rate / raw rate.
    append_to_raw_ratio: Spread,
    /// `Journal::commit`: check, append, apply, periodic snapshots.
    commit_events_per_s: Spread,
    commit_to_raw_ratio: Spread,
    /// Fold of the whole log from the first event, snapshots ignored.
    replay_full_events_per_s: Spread,
    /// Reopen the log and fold from its last snapshot to the end.
    replay_from_last_snapshot_seconds: Spread,
    replay_from_last_snapshot_events_folded: u64,
    /// Every replay reproduced the in-memory state's digest.
    digests_match: bool,
}

pub fn run(args: LogBenchArgs) -> anyhow::Result<()> {
    ensure!(args.events > 0, "--events must be at least 1");
    ensure!(args.repeat > 0, "--repeat must be at least 1");
    ensure!(args.flush_every > 0, "--flush-every must be at least 1");
    let events = SyntheticEvents::new(42, 3).take_events(usize::try_from(args.events)?);
    let mut expected = State::new();
    for event in &events {
        expected.apply(event)?;
    }
    let expected_digest = expected.digest();
    let entries: Vec<Vec<u8>> = events
        .iter()
        .map(|event| {
            let mut buf = Vec::new();
            encode_entry(event, &mut buf);
            buf
        })
        .collect();
    let mean_entry_bytes =
        entries.iter().map(Vec::len).sum::<usize>() as f64 / entries.len() as f64;

    let base = match &args.dir {
        Some(dir) => tempfile::tempdir_in(dir),
        None => tempfile::tempdir(),
    }
    .context("creating a temporary directory for the benchmark logs")?;

    let (mut raw, mut append, mut commit, mut full, mut from_snap) =
        (vec![], vec![], vec![], vec![], vec![]);
    let mut folded = 0;
    let mut digests_match = true;
    for rep in 0..args.repeat {
        if !args.json {
            eprintln!("repetition {}/{}", rep + 1, args.repeat);
        }
        let raw_rate = time_raw(
            &base.path().join(format!("raw-{rep}")),
            &entries,
            args.flush_every,
        )?;
        let append_rate = time_append(
            &base.path().join(format!("append-{rep}")),
            &events,
            args.flush_every,
        )?;
        let commit_dir = base.path().join(format!("commit-{rep}"));
        let commit_rate = time_commit(&commit_dir, &events, &args)?;
        raw.push(raw_rate);
        append.push(append_rate);
        commit.push(commit_rate);

        let timed = time_replays(&commit_dir, events.len(), expected_digest)?;
        full.push(timed.full_events_per_s);
        from_snap.push(timed.from_snapshot_seconds);
        folded = timed.folded;
        digests_match &= timed.digests_match;
        for name in ["raw", "append", "commit"] {
            std::fs::remove_dir_all(base.path().join(format!("{name}-{rep}"))).ok();
        }
    }
    let ratio = |a: &[f64]| {
        let ratios: Vec<f64> = a.iter().zip(&raw).map(|(x, r)| x / r).collect();
        Spread::of(&ratios)
    };
    let report = Report {
        bench: "log",
        events: args.events,
        flush_every: args.flush_every,
        snapshot_every: args.snapshot_every,
        repeat: args.repeat,
        mean_entry_bytes,
        append_to_raw_ratio: ratio(&append),
        commit_to_raw_ratio: ratio(&commit),
        raw_sled_insert_events_per_s: Spread::of(&raw),
        append_events_per_s: Spread::of(&append),
        commit_events_per_s: Spread::of(&commit),
        replay_full_events_per_s: Spread::of(&full),
        replay_from_last_snapshot_seconds: Spread::of(&from_snap),
        replay_from_last_snapshot_events_folded: folded,
        digests_match,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    ensure!(
        report.digests_match,
        "a replay did not reproduce the in-memory state"
    );
    Ok(())
}

/// One repetition's replays of a committed log.
struct Replays {
    full_events_per_s: f64,
    /// Reopening and folding from the last snapshot: a restart's cost.
    from_snapshot_seconds: f64,
    folded: u64,
    digests_match: bool,
}

/// Replays the log in `dir` (`events` long) in full, then reopens it and
/// replays from its last snapshot, each checked against `expected`.
fn time_replays(
    dir: &std::path::Path,
    events: usize,
    expected: tessera_state::state::Digest,
) -> anyhow::Result<Replays> {
    let log = EventLog::open_existing(dir)?;
    let start = Instant::now();
    let every_event = ReplayOptions {
        until: None,
        use_snapshots: false,
    };
    let replayed = replay(&log, every_event)?;
    let full_events_per_s = events as f64 / start.elapsed().as_secs_f64();
    let mut digests_match = replayed.state.digest() == expected;
    drop(log);
    // Reopening is part of a restart's cost: time it with the fold.
    let start = Instant::now();
    let log = EventLog::open_existing(dir)?;
    let replayed = replay(&log, ReplayOptions::default())?;
    let from_snapshot_seconds = start.elapsed().as_secs_f64();
    digests_match &= replayed.state.digest() == expected;
    Ok(Replays {
        full_events_per_s,
        from_snapshot_seconds,
        folded: replayed.events_applied,
        digests_match,
    })
}

/// Writes `count` items with `write(i, flush_now)` and returns items per
/// second; every variant flushes at the same points, and once at the end.
fn time_writes(
    count: usize,
    flush_every: u64,
    mut write: impl FnMut(usize, bool) -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    let start = Instant::now();
    for i in 0..count {
        let index = i as u64 + 1;
        write(i, index.is_multiple_of(flush_every) || i + 1 == count)?;
    }
    Ok(count as f64 / start.elapsed().as_secs_f64())
}

fn time_raw(dir: &Path, entries: &[Vec<u8>], flush_every: u64) -> anyhow::Result<f64> {
    // The same settings EventLog::open uses, so the comparison is like for like.
    let db = EventLog::sled_config(dir).open()?;
    let tree = db.open_tree("events")?;
    time_writes(entries.len(), flush_every, |i, flush| {
        tree.insert((i as u64 + 1).to_be_bytes(), entries[i].as_slice())?;
        if flush {
            db.flush()?;
        }
        Ok(())
    })
}

fn time_append(dir: &Path, events: &[IndexedEvent], flush_every: u64) -> anyhow::Result<f64> {
    let mut log = EventLog::open(dir)?;
    time_writes(events.len(), flush_every, |i, flush| {
        log.append(&events[i])?;
        if flush {
            log.flush()?;
        }
        Ok(())
    })
}

fn time_commit(dir: &Path, events: &[IndexedEvent], args: &LogBenchArgs) -> anyhow::Result<f64> {
    let mut journal = Journal::open(dir, args.snapshot_every)?;
    time_writes(events.len(), args.flush_every, |i, flush| {
        journal.commit(&events[i])?;
        if flush {
            journal.flush()?;
        }
        Ok(())
    })
}

fn print_table(r: &Report) {
    println!("event log benchmark: {} events of {:.0} bytes on average, flush every {}, snapshot every {}, {} repetitions (min / median / max)",
        r.events, r.mean_entry_bytes, r.flush_every, r.snapshot_every, r.repeat);
    let row = |name: &str, s: &Spread, unit: &str| {
        println!(
            "  {name:<34} {:>12.0} {:>12.0} {:>12.0} {unit}",
            s.min, s.median, s.max
        );
    };
    row(
        "raw sled insert",
        &r.raw_sled_insert_events_per_s,
        "events/s",
    );
    row("log append", &r.append_events_per_s, "events/s");
    println!(
        "  {:<34} {:>12.2} {:>12.2} {:>12.2}",
        "append / raw",
        r.append_to_raw_ratio.min,
        r.append_to_raw_ratio.median,
        r.append_to_raw_ratio.max
    );
    row(
        "commit (append+apply+snapshots)",
        &r.commit_events_per_s,
        "events/s",
    );
    println!(
        "  {:<34} {:>12.2} {:>12.2} {:>12.2}",
        "commit / raw",
        r.commit_to_raw_ratio.min,
        r.commit_to_raw_ratio.median,
        r.commit_to_raw_ratio.max
    );
    row("replay, full", &r.replay_full_events_per_s, "events/s");
    println!(
        "  {:<34} {:>12.3} {:>12.3} {:>12.3} s ({} events folded)",
        "replay from last snapshot",
        r.replay_from_last_snapshot_seconds.min,
        r.replay_from_last_snapshot_seconds.median,
        r.replay_from_last_snapshot_seconds.max,
        r.replay_from_last_snapshot_events_folded
    );
    println!("  digests match: {}", r.digests_match);
}
