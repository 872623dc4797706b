//! Streaming and batch scoring: results arrive while submission continues, ids and order
//! are kept, and a panicking job does not take the others down.

use std::time::Duration;

use floe_env::scoring::{score_all, Scorer, ScoringError};

#[test]
fn results_stream_while_submission_continues() {
    let mut scorer = Scorer::new(2).unwrap();
    let (release, gate) = crossbeam_channel::bounded::<()>(0);
    // Job 0 finishes at once; job 1 blocks until released below.
    scorer.submit(0, || 0u64);
    scorer.submit(1, move || {
        gate.recv().unwrap();
        10
    });
    let first = scorer
        .recv_timeout(Duration::from_secs(10))
        .expect("job 0 result");
    assert_eq!((first.id, first.result.unwrap()), (0, 0));
    // Submission goes on while job 1 is still running.
    scorer.submit(2, || 20);
    let second = scorer
        .recv_timeout(Duration::from_secs(10))
        .expect("job 2 result");
    assert_eq!((second.id, second.result.unwrap()), (2, 20));
    assert_eq!(scorer.outstanding(), 1);
    release.send(()).unwrap();
    let third = scorer.recv().unwrap();
    assert_eq!((third.id, third.result.unwrap()), (1, 10));
    assert!(scorer.recv().is_none());
}

#[test]
fn ids_are_preserved_and_panics_are_contained() {
    let mut scorer = Scorer::new(3).unwrap();
    for id in 0..200u64 {
        scorer.submit(id, move || {
            if id == 13 {
                panic!("bad row {id}");
            }
            std::thread::sleep(Duration::from_micros((id * 7919) % 500));
            id * id
        });
    }
    let mut results = scorer.drain();
    assert_eq!(results.len(), 200);
    results.sort_by_key(|s| s.id);
    for scored in results {
        match scored.result {
            Ok(value) => assert_eq!(value, scored.id * scored.id),
            Err(ScoringError::Panicked { id, message }) => {
                assert_eq!(id, 13);
                assert_eq!(message, "bad row 13");
            }
            Err(other) => panic!("unexpected {other}"),
        }
    }
}

#[test]
fn score_all_keeps_input_order() {
    let items: Vec<u64> = (0..1000).collect();
    let out = score_all(&items, 4, |&x| {
        if x % 97 == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        x * 3
    })
    .unwrap();
    assert_eq!(out, items.iter().map(|x| x * 3).collect::<Vec<_>>());
}
