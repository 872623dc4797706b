//! GSM8K strict extraction and exact-match reward.

use floe_env::env::Registry;
use floe_env::gsm8k::{compute_score, extract_answer};
use serde_json::json;

#[test]
fn strict_extraction_and_exact_match() {
    let cases: &[(&str, &str, f64)] = &[
        ("so 3 + 4 = 7\n#### 7", "7", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("#### -5", "-5", 1.0),
        ("#### 3.50", "3.5", 0.0),
        ("#### 72 and later #### 8", "72", 1.0),
        ("####72", "72", 0.0),
        ("#### $72", "72", 0.0),
        ("The answer is 72.", "72", 0.0),
        ("#### 72.", "72", 0.0),
        ("#### 7\n#### 8", "8", 0.0),
    ];
    for &(response, truth, want) in cases {
        assert_eq!(
            compute_score(response, truth),
            want,
            "{response:?} vs {truth:?}"
        );
    }
    assert_eq!(
        extract_answer("#### 1,000,000 dollars").as_deref(),
        Some("1000000")
    );
    assert_eq!(extract_answer("no answer"), None);
}

#[test]
fn env_reads_reward_spec() {
    let registry = Registry::with_builtins();
    let mut env = registry
        .make(
            "gsm8k",
            &json!({"reward_spec": {"method": "rule", "ground_truth": "18"}}),
        )
        .unwrap();
    let out = env.step("16 - 3 - 4 = 9; 9 * 2 = 18\n#### 18").unwrap();
    assert_eq!((out.reward, out.done), (1.0, true));
    assert_eq!(out.metrics["format_correct"], 1.0);
    let err = registry
        .make("gsm8k", &json!({}))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("reward_spec.ground_truth is missing"), "{err}");
    let err = registry.make("nope", &json!({})).err().unwrap().to_string();
    assert!(
        err.contains("unknown env_class \"nope\"") && err.contains("gsm8k"),
        "{err}"
    );
}
