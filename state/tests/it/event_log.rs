//! The sled event log: ordering, checksums, snapshots and replay.

use tessera_state::synthetic::SyntheticEvents;
use tessera_state::{replay, EventLog, Journal, LogError, ReplayError, ReplayOptions, State};

type TestResult = Result<(), Box<dyn std::error::Error>>;

#[test]
fn append_refuses_an_index_that_is_not_next() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = EventLog::open(dir.path())?;
    let events = SyntheticEvents::new(1, 2).take_events(3);
    assert!(matches!(
        log.append(&events[1]),
        Err(LogError::OutOfOrder {
            expected: 1,
            got: 2
        })
    ));
    log.append(&events[0])?;
    assert!(matches!(
        log.append(&events[0]),
        Err(LogError::OutOfOrder {
            expected: 2,
            got: 1
        })
    ));
    assert!(matches!(
        log.append_batch(&[events[2].clone()]),
        Err(LogError::OutOfOrder {
            expected: 2,
            got: 3
        })
    ));
    log.append_batch(&events[1..])?;
    assert_eq!(log.last_index(), 3);
    assert_eq!(log.get(2)?.as_ref(), Some(&events[1]));
    Ok(())
}

#[test]
fn the_log_survives_a_reopen_and_reads_ranges() -> TestResult {
    let dir = tempfile::tempdir()?;
    let events = SyntheticEvents::new(2, 3).take_events(500);
    {
        let mut log = EventLog::open(dir.path())?;
        for event in &events {
            log.append(event)?;
        }
        log.flush()?;
    }
    let log = EventLog::open_existing(dir.path())?;
    assert_eq!(log.last_index(), 500);
    assert_eq!(log.first_index()?, Some(1));
    let middle: Vec<_> = log.range(100, 199).collect::<Result<_, _>>()?;
    assert_eq!(middle, events[99..199]);
    assert_eq!(log.range(499, 10_000).count(), 2);
    Ok(())
}

#[test]
fn a_missing_log_is_an_error_not_a_new_log() -> TestResult {
    let dir = tempfile::tempdir()?;
    let missing = dir.path().join("nope");
    assert!(matches!(
        EventLog::open_existing(&missing),
        Err(LogError::Missing { .. })
    ));
    assert!(
        !missing.exists(),
        "open_existing must not create the directory"
    );
    Ok(())
}

#[test]
fn a_flipped_byte_is_reported_with_its_index() -> TestResult {
    let dir = tempfile::tempdir()?;
    let events = SyntheticEvents::new(3, 3).take_events(300);
    let mut journal = Journal::open(dir.path(), 100)?;
    for event in &events {
        journal.commit(event)?;
    }
    journal.flush()?;
    let log = journal.log();
    for (index, byte) in [(1, 0), (150, 9), (299, 40)] {
        let original = log.raw_entry(index)?.ok_or("entry missing")?;
        let mut flipped = original.clone();
        flipped[byte] ^= 0x20;
        log.overwrite_raw_entry(index, &flipped)?;
        let full = replay(
            log,
            ReplayOptions {
                until: None,
                use_snapshots: false,
            },
        );
        match full {
            Err(ReplayError::Log(LogError::Corrupted {
                index: reported, ..
            })) => assert_eq!(reported, index),
            other => panic!("expected corruption at {index}, got {other:?}"),
        }
        assert!(matches!(log.get(index), Err(LogError::Corrupted { index: i, .. }) if i == index));
        log.overwrite_raw_entry(index, &original)?;
    }
    // A replay that starts at the snapshot of 200 does not read entry 150.
    let original = log.raw_entry(150)?.ok_or("entry missing")?;
    let mut flipped = original.clone();
    flipped[12] ^= 1;
    log.overwrite_raw_entry(150, &flipped)?;
    assert!(replay(log, ReplayOptions::default()).is_ok());
    Ok(())
}

#[test]
fn an_entry_stored_under_the_wrong_index_is_corruption() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = EventLog::open(dir.path())?;
    for event in SyntheticEvents::new(4, 2).take_events(3) {
        log.append(&event)?;
    }
    let third = log.raw_entry(3)?.ok_or("entry missing")?;
    log.overwrite_raw_entry(2, &third)?;
    let error = replay(&log, ReplayOptions::default())
        .err()
        .ok_or("replay should fail")?;
    assert_eq!(
        error.to_string(),
        "event 2 is corrupted: stored under index 2 but carries index 3"
    );
    Ok(())
}

#[test]
fn snapshots_give_the_same_state_as_a_full_fold() -> TestResult {
    let dir = tempfile::tempdir()?;
    let events = SyntheticEvents::new(5, 4).take_events(2_345);
    let mut in_memory = State::new();
    let mut journal = Journal::open(dir.path(), 500)?;
    for event in &events {
        in_memory.apply(event)?;
        journal.commit(event)?;
    }
    let log = journal.log();
    assert_eq!(log.snapshot_indices()?, vec![500, 1000, 1500, 2000]);
    let from_snapshot = replay(log, ReplayOptions::default())?;
    assert_eq!(from_snapshot.from_snapshot, Some(2000));
    assert_eq!(from_snapshot.events_applied, 345);
    assert_eq!(from_snapshot.state.digest(), in_memory.digest());
    let full = replay(
        log,
        ReplayOptions {
            until: None,
            use_snapshots: false,
        },
    )?;
    assert_eq!(full.state, in_memory);
    let until = replay(
        log,
        ReplayOptions {
            until: Some(1_234),
            use_snapshots: true,
        },
    )?;
    assert_eq!(until.from_snapshot, Some(1000));
    let mut prefix = State::new();
    for event in &events[..1_234] {
        prefix.apply(event)?;
    }
    assert_eq!(until.state.digest(), prefix.digest());
    Ok(())
}

/// A view folds as the log does at the moment it was taken: events the
/// owner appends afterwards are not in it, and past its end is an error.
#[test]
fn a_view_folds_the_log_as_it_stood() -> TestResult {
    let dir = tempfile::tempdir()?;
    let events = SyntheticEvents::new(3, 2).take_events(700);
    let mut journal = Journal::open(dir.path(), 250)?;
    for event in &events[..600] {
        journal.commit(event)?;
    }
    let view = journal.log().view();
    for event in &events[600..] {
        journal.commit(event)?;
    }
    assert_eq!(view.last_index(), 600);
    let at = |until| ReplayOptions {
        until: Some(until),
        use_snapshots: true,
    };
    let mut prefix = State::new();
    for event in &events[..321] {
        prefix.apply(event)?;
    }
    let folded = view.replay(at(321))?;
    assert_eq!(folded.from_snapshot, Some(250));
    assert_eq!(folded.state.digest(), prefix.digest());
    assert!(matches!(
        view.replay(at(601)),
        Err(ReplayError::PastEnd {
            until: 601,
            last: 600
        })
    ));
    Ok(())
}

#[test]
fn a_corrupted_snapshot_falls_back_to_an_older_one() -> TestResult {
    let dir = tempfile::tempdir()?;
    let events = SyntheticEvents::new(6, 2).take_events(250);
    let mut journal = Journal::open(dir.path(), 100)?;
    for event in &events {
        journal.commit(event)?;
    }
    let expected = journal.state().digest();
    // Corrupt the newest snapshot behind the log's back, as a disk would.
    let log = journal.log();
    let mut bytes = log.raw_snapshot(200)?.ok_or("snapshot missing")?;
    bytes[7] ^= 0xff;
    log.overwrite_raw_snapshot(200, &bytes)?;
    let replayed = replay(log, ReplayOptions::default())?;
    assert_eq!(replayed.from_snapshot, Some(100));
    assert_eq!(replayed.skipped_snapshots.len(), 1);
    assert!(replayed.skipped_snapshots[0]
        .to_string()
        .starts_with("snapshot at index 200 is corrupted"));
    assert_eq!(replayed.state.digest(), expected);
    Ok(())
}

#[test]
fn replay_past_the_end_and_gaps_are_errors() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut log = EventLog::open(dir.path())?;
    let events = SyntheticEvents::new(7, 2).take_events(10);
    for event in &events {
        log.append(event)?;
    }
    assert!(matches!(
        replay(
            &log,
            ReplayOptions {
                until: Some(11),
                use_snapshots: true
            }
        ),
        Err(ReplayError::PastEnd {
            until: 11,
            last: 10
        })
    ));
    log.remove_raw_entry(5)?;
    assert!(matches!(
        replay(&log, ReplayOptions::default()),
        Err(ReplayError::Gap { index: 5, last: 10 })
    ));
    Ok(())
}

#[test]
fn a_journal_reopens_where_it_left_off_and_refuses_bad_events() -> TestResult {
    let dir = tempfile::tempdir()?;
    let events = SyntheticEvents::new(8, 3).take_events(120);
    {
        let mut journal = Journal::open(dir.path(), 50)?;
        for event in &events[..100] {
            journal.commit(event)?;
        }
        journal.flush()?;
    }
    let mut journal = Journal::open(dir.path(), 50)?;
    assert_eq!(journal.state().last_index(), 100);
    assert!(journal.commit(&events[101]).is_err(), "a gap is refused");
    let mut stale = events[100].clone();
    stale.session = None;
    assert!(
        journal.commit(&stale).is_err(),
        "an event without a session is refused"
    );
    assert_eq!(
        journal.log().last_index(),
        100,
        "refused events are not stored"
    );
    for event in &events[100..] {
        journal.commit(event)?;
    }
    assert_eq!(journal.state().last_index(), 120);
    Ok(())
}

#[test]
fn a_truncated_journal_equals_one_that_never_had_the_tail() -> TestResult {
    let dir = tempfile::tempdir()?;
    let events = SyntheticEvents::new(9, 3).take_events(130);
    let mut journal = Journal::open(dir.path(), 50)?;
    for event in &events {
        journal.commit(event)?;
    }
    // Past the snapshot at 100, and back before it.
    for (keep, snapshots) in [(120, vec![50, 100]), (75, vec![50])] {
        let before = journal.log().last_index();
        assert_eq!(journal.truncate_after(keep)?, before - keep);
        assert_eq!(journal.log().last_index(), keep);
        let mut expected = State::new();
        for event in &events[..keep as usize] {
            expected.apply(event)?;
        }
        assert_eq!(journal.state().digest(), expected.digest(), "after {keep}");
        assert_eq!(
            journal.log().snapshot_indices()?,
            snapshots,
            "none past the cut"
        );
        // The log goes on from the cut, and survives a reopen.
        journal.commit(&events[keep as usize])?;
        journal.flush()?;
        drop(journal);
        journal = Journal::open(dir.path(), 50)?;
        assert_eq!(journal.state().last_index(), keep + 1);
    }
    assert_eq!(journal.truncate_after(500)?, 0, "nothing past the end");
    assert_eq!(journal.truncate_after(0)?, 76);
    assert_eq!(journal.state().last_index(), 0);
    assert_eq!(journal.log().range(1, 1_000).count(), 0);
    Ok(())
}
