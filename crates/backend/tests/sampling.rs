//! The reference sampler: determinism, greedy limits, exact truncation supports and
//! empirical frequencies, log-probabilities.

use floe_backend::cpu::CpuBackend;
use floe_backend::sampling::{mix64, normal, sample_row, top_logprobs, uniform, GAMMA};
use floe_backend::{Backend, BufKind, SamplingRow};
use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::SplitMix64;

fn row(
    temperature: f32,
    top_k: i32,
    top_p: f32,
    min_p: f32,
    seed: u64,
    offset: u64,
) -> SamplingRow {
    SamplingRow {
        temperature,
        top_k,
        top_p,
        min_p,
        seed,
        offset,
        top_logprobs: 0,
    }
}

/// Logits whose softmax is exactly `probs` (up to rounding).
fn logits_of(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|p| p.ln() as f32).collect()
}

fn log_softmax(logits: &[f32], t: f64) -> Vec<f64> {
    let z: Vec<f64> = logits.iter().map(|&x| x as f64 / t).collect();
    let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + z.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
    z.iter().map(|v| v - lse).collect()
}

/// Draws `n` tokens at offsets `0..n` and returns the empirical frequency of each id.
fn frequencies(logits: &[f32], r: SamplingRow, n: u64) -> Vec<f64> {
    let mut counts = vec![0u64; logits.len()];
    for offset in 0..n {
        let s = sample_row(logits, &SamplingRow { offset, ..r });
        counts[s.token as usize] += 1;
    }
    counts.iter().map(|&c| c as f64 / n as f64).collect()
}

/// Asserts every frequency is within 5 standard errors of `expected` (and zero where
/// `expected` is zero: a truncated token must never be drawn).
fn assert_frequencies(got: &[f64], expected: &[f64], n: u64) {
    for (i, (&g, &e)) in got.iter().zip(expected).enumerate() {
        if e == 0.0 {
            assert_eq!(g, 0.0, "token {i} is outside the support but was drawn");
        } else {
            let se = (e * (1.0 - e) / n as f64).sqrt();
            assert!((g - e).abs() < 5.0 * se + 1e-12, "token {i}: {g} vs {e}");
        }
    }
}

/// Renormalises `probs` over the ids in `support`.
fn truncated(probs: &[f64], support: &[usize]) -> Vec<f64> {
    let mass: f64 = support.iter().map(|&i| probs[i]).sum();
    (0..probs.len())
        .map(|i| {
            if support.contains(&i) {
                probs[i] / mass
            } else {
                0.0
            }
        })
        .collect()
}

const PROBS: [f64; 6] = [0.05, 0.4, 0.1, 0.25, 0.15, 0.05];
const N: u64 = 40_000;

#[test]
fn uniform_follows_the_documented_formula_and_is_uniform() {
    // The formula in the docs, spelled out independently.
    let gamma: u64 = 0x9E37_79B9_7F4A_7C15;
    for (seed, offset) in [(0u64, 0u64), (42, 7), (u64::MAX, u64::MAX)] {
        let bits = mix64(mix64(seed).wrapping_add(offset.wrapping_add(1).wrapping_mul(gamma)));
        assert_eq!(
            uniform(seed, offset),
            (bits >> 11) as f64 / 9007199254740992.0
        );
    }
    // splitmix64's known first output from state 0 is 0xE220A8397B1DCDAF.
    assert_eq!(mix64(gamma), 0xE220_A839_7B1D_CDAF);
    assert_eq!(GAMMA, gamma);
    let draws: Vec<f64> = (0..100_000).map(|o| uniform(3, o)).collect();
    assert!(draws.iter().all(|&u| (0.0..1.0).contains(&u)));
    let mean = draws.iter().sum::<f64>() / draws.len() as f64;
    assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
    let below_tenth = draws.iter().filter(|&&u| u < 0.1).count() as f64 / draws.len() as f64;
    assert!((below_tenth - 0.1).abs() < 0.005, "{below_tenth}");
    // Neighbouring seeds give unrelated streams.
    assert_ne!(uniform(1, 0), uniform(2, 0));
    assert_ne!(uniform(1, 1), uniform(2, 0));
}

#[test]
fn the_seeded_generator_is_mix64_of_its_state() {
    // rand_xoshiro's SplitMix64, the generator of random weights, datasets and test data,
    // and `mix64` are one splitmix64: the k-th output from state s is mix64(s + k·GAMMA).
    for state in [0u64, 1, 42, 0xDEAD_BEEF, u64::MAX] {
        let mut rng = SplitMix64::seed_from_u64(state);
        for k in 1..=64u64 {
            let expected = mix64(state.wrapping_add(k.wrapping_mul(GAMMA)));
            assert_eq!(rng.next_u64(), expected, "state {state:#x}, output {k}");
        }
    }
    // Vigna's splitmix64.c from state 0.
    let mut rng = SplitMix64::seed_from_u64(0);
    let first: Vec<u64> = (0..3).map(|_| rng.next_u64()).collect();
    assert_eq!(
        first,
        [
            0xE220_A839_7B1D_CDAF,
            0x6E78_9E6A_A1B9_65F4,
            0x06C4_5D18_8009_454F
        ]
    );
}

#[test]
fn random_weights_are_the_seeded_streams_normals_from_their_place() {
    // normal(seed, k) is the k-th Box–Muller normal of SplitMix64 seeded with `seed`.
    let seed = 9;
    let mut rng = SplitMix64::seed_from_u64(seed);
    let mut unit = || ((rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
    let stream: Vec<f64> = (0..40)
        .map(|_| {
            let (u, v) = (unit(), unit());
            (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
        })
        .collect();
    for (k, z) in stream.iter().enumerate() {
        assert_eq!(normal(seed, k as u64).to_bits(), z.to_bits(), "normal {k}");
    }
    // A tensor that starts 25 normals into the stream gets normals 25, 26, ...
    let cpu = CpuBackend::<f64>::new();
    let mut buf = cpu.zeros(15, BufKind::Full).unwrap();
    cpu.fill_normal(&mut buf, seed, 25, 0.02).unwrap();
    let want: Vec<f64> = stream[25..]
        .iter()
        .map(|z| f64::from((0.02 * z) as f32))
        .collect();
    assert_eq!(cpu.download_f64(&buf).unwrap(), want);
}

#[test]
fn same_seed_and_offset_give_the_same_token() {
    let logits = logits_of(&PROBS);
    let r = row(1.0, 0, 1.0, 0.0, 99, 5);
    let first = sample_row(&logits, &r);
    for _ in 0..10 {
        assert_eq!(sample_row(&logits, &r), first);
    }
    let tokens: Vec<u32> = (0..64)
        .map(|o| sample_row(&logits, &SamplingRow { offset: o, ..r }).token)
        .collect();
    let other: Vec<u32> = (0..64)
        .map(|o| {
            sample_row(
                &logits,
                &SamplingRow {
                    offset: o,
                    seed: 100,
                    ..r
                },
            )
            .token
        })
        .collect();
    assert_ne!(tokens, other, "different seeds must give different streams");
}

#[test]
fn greedy_takes_the_lowest_id_among_maxima_with_temperature_one_logprob() {
    let logits = [0.5f32, 2.0, -1.0, 2.0, 1.0];
    let s = sample_row(&logits, &row(0.0, 0, 1.0, 0.0, 1, 1));
    assert_eq!(s.token, 1);
    let expected = log_softmax(&logits, 1.0)[1];
    assert!((s.logprob as f64 - expected).abs() < 1e-6);
    // Truncation settings do not change greedy.
    let s2 = sample_row(&logits, &row(0.0, 1, 0.1, 0.9, 1, 1));
    assert_eq!(s2, s);
}

#[test]
fn vanishing_temperature_equals_greedy() {
    let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 53) as f32 * 0.1).collect();
    let greedy = sample_row(&logits, &row(0.0, 0, 1.0, 0.0, 0, 0)).token;
    for offset in 0..200 {
        let s = sample_row(&logits, &row(1e-6, 0, 1.0, 0.0, 7, offset));
        assert_eq!(s.token, greedy);
        assert!(s.logprob.abs() < 1e-6, "all the mass is on the argmax");
    }
}

#[test]
fn logprob_is_under_the_tempered_distribution_before_truncation() {
    let logits = logits_of(&PROBS);
    for t in [0.5f32, 1.0, 2.0] {
        let reference = log_softmax(&logits, t as f64);
        for offset in 0..50 {
            // Top-k 2 truncates, yet the log-prob is under the full tempered softmax.
            let s = sample_row(&logits, &row(t, 2, 1.0, 0.0, 11, offset));
            assert!((s.logprob as f64 - reference[s.token as usize]).abs() < 1e-6);
        }
    }
}

#[test]
fn plain_sampling_matches_the_distribution() {
    let logits = logits_of(&PROBS);
    let got = frequencies(&logits, row(1.0, 0, 1.0, 0.0, 5, 0), N);
    assert_frequencies(&got, &PROBS, N);
    // Temperature 2 flattens: p ∝ sqrt(p).
    let flat: Vec<f64> = PROBS.iter().map(|p| p.sqrt()).collect();
    let total: f64 = flat.iter().sum();
    let flat: Vec<f64> = flat.iter().map(|p| p / total).collect();
    let got = frequencies(&logits, row(2.0, 0, 1.0, 0.0, 6, 0), N);
    assert_frequencies(&got, &flat, N);
}

#[test]
fn top_k_keeps_the_k_most_likely() {
    let logits = logits_of(&PROBS);
    let got = frequencies(&logits, row(1.0, 3, 1.0, 0.0, 8, 0), N);
    assert_frequencies(&got, &truncated(&PROBS, &[1, 3, 4]), N);
    let got = frequencies(&logits, row(1.0, 1, 1.0, 0.0, 8, 0), 1000);
    assert_eq!(got[1], 1.0);
    // k at least the vocabulary disables it.
    let got = frequencies(&logits, row(1.0, 6, 1.0, 0.0, 8, 0), N);
    assert_frequencies(&got, &PROBS, N);
    // Ties with the k-th value are kept, as in transformers.
    let tied = [1.0f32, 3.0, 2.0, 2.0, 0.0];
    let got = frequencies(&tied, row(1.0, 2, 1.0, 0.0, 9, 0), 4000);
    assert!(got[2] > 0.0 && got[3] > 0.0 && got[0] == 0.0 && got[4] == 0.0);
}

#[test]
fn top_p_keeps_the_smallest_set_reaching_p() {
    let logits = logits_of(&PROBS);
    // Sorted: 0.4 (id 1), 0.25 (3), 0.15 (4), 0.1 (2), 0.05 (0), 0.05 (5).
    // p = 0.6: 0.4 < 0.6 so id 3 is needed; 0.65 ≥ 0.6 stops before id 4.
    let got = frequencies(&logits, row(1.0, 0, 0.6, 0.0, 10, 0), N);
    assert_frequencies(&got, &truncated(&PROBS, &[1, 3]), N);
    // p = 0.85: 0.8 < 0.85 needs id 2 as well.
    let got = frequencies(&logits, row(1.0, 0, 0.85, 0.0, 10, 0), N);
    assert_frequencies(&got, &truncated(&PROBS, &[1, 3, 4, 2]), N);
    // A tiny p keeps the top token only.
    let got = frequencies(&logits, row(1.0, 0, 0.01, 0.0, 10, 0), 1000);
    assert_eq!(got[1], 1.0);
    // After top-k 3 the renormalised masses are 0.5, 0.3125, 0.1875: p = 0.85 needs
    // all three, p = 0.45 only the first.
    let got = frequencies(&logits, row(1.0, 3, 0.85, 0.0, 12, 0), N);
    assert_frequencies(&got, &truncated(&PROBS, &[1, 3, 4]), N);
    let got = frequencies(&logits, row(1.0, 3, 0.45, 0.0, 12, 0), 1000);
    assert_eq!(got[1], 1.0);
}

#[test]
fn min_p_drops_tokens_below_a_fraction_of_the_top() {
    let logits = logits_of(&PROBS);
    // min_p 0.3 × 0.4 = 0.12: keeps 0.4, 0.25, 0.15.
    let got = frequencies(&logits, row(1.0, 0, 1.0, 0.3, 13, 0), N);
    assert_frequencies(&got, &truncated(&PROBS, &[1, 3, 4]), N);
    // min_p 0.2 × 0.4 = 0.08: also 0.1.
    let got = frequencies(&logits, row(1.0, 0, 1.0, 0.2, 13, 0), N);
    assert_frequencies(&got, &truncated(&PROBS, &[1, 2, 3, 4]), N);
    // Applied to the tempered distribution: at T = 0.5, p ∝ p², top 0.16; 0.3 × 0.16 =
    // 0.048 keeps 0.0625 (id 3) but not 0.0225 (id 4).
    let sq: Vec<f64> = PROBS.iter().map(|p| p * p).collect();
    let got = frequencies(&logits, row(0.5, 0, 1.0, 0.3, 14, 0), N);
    assert_frequencies(&got, &truncated(&sq, &[1, 3]), N);
}

#[test]
fn nan_and_masked_logits_are_never_drawn() {
    let logits = [f32::NAN, 1.0, f32::NEG_INFINITY, 1.0];
    let got = frequencies(&logits, row(1.0, 0, 1.0, 0.0, 15, 0), 4000);
    assert_eq!((got[0], got[2]), (0.0, 0.0));
    assert!((got[1] - 0.5).abs() < 0.05);
    let s = sample_row(&logits, &row(0.0, 0, 1.0, 0.0, 0, 0));
    assert_eq!(s.token, 1);
    assert!((s.logprob - 0.5f32.ln()).abs() < 1e-6);
}

/// Asserts `top` holds the `k` (capped at the vocabulary) largest of `reference` by
/// decreasing value, lower id first on ties, with their values, and that the sampled
/// token's entry, when there, is its log-prob bit for bit.
fn assert_top_logprobs(
    top: &[(u32, f32)],
    reference: &[f64],
    k: usize,
    sampled: (u32, f32),
    what: &str,
) {
    let mut order: Vec<usize> = (0..reference.len()).collect();
    order.sort_by(|&a, &b| reference[b].total_cmp(&reference[a]).then(a.cmp(&b)));
    let ids: Vec<u32> = top.iter().map(|&(id, _)| id).collect();
    let expected: Vec<u32> = order[..k.min(reference.len())]
        .iter()
        .map(|&i| i as u32)
        .collect();
    assert_eq!(ids, expected, "{what}");
    for &(id, lp) in top {
        let want = reference[id as usize];
        assert!(
            (f64::from(lp) - want).abs() < 1e-5,
            "{what}: {id}: {lp} vs {want}"
        );
        if id == sampled.0 {
            assert_eq!(
                lp.to_bits(),
                sampled.1.to_bits(),
                "{what}: the sampled token"
            );
        }
    }
}

#[test]
fn top_logprobs_are_the_k_most_likely_under_the_sampled_tokens_distribution() {
    let mut rng = SplitMix64::seed_from_u64(21);
    let vocab = 40;
    let mut logits: Vec<f32> = (0..vocab)
        .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 22) as f32 - 2.0)
        .collect();
    // A tie among the most likely: the lower id comes first.
    logits[17] = 3.0;
    logits[5] = 3.0;
    for (temperature, top_k, top_p, k) in [
        (0.0, 0, 1.0, 5),
        (0.7, 0, 1.0, 3),
        (1.3, 8, 0.9, 20),
        (1.0, 0, 1.0, 1),
        (1.0, 0, 1.0, 100),
    ] {
        let t = if temperature > 0.0 { temperature } else { 1.0 };
        let reference = log_softmax(&logits, f64::from(t));
        for offset in 0..20 {
            let plain = row(temperature, top_k, top_p, 0.0, 3, offset);
            let asking = SamplingRow {
                top_logprobs: k,
                ..plain
            };
            let s = sample_row(&logits, &asking);
            let what = format!("T={temperature} k={k} offset {offset}");
            assert_top_logprobs(&s.top_logprobs, &reference, k, (s.token, s.logprob), &what);
            // The draw and its log-prob do not depend on asking.
            let p = sample_row(&logits, &plain);
            assert_eq!((p.token, p.logprob), (s.token, s.logprob), "{what}");
            assert!(p.top_logprobs.is_empty());
            assert_eq!(top_logprobs(&logits, &asking), s.top_logprobs, "{what}");
        }
    }
    // Greedy: the sampled token is the first of the top ones.
    let s = sample_row(
        &logits,
        &SamplingRow {
            top_logprobs: 2,
            ..row(0.0, 0, 1.0, 0.0, 0, 0)
        },
    );
    assert_eq!(s.top_logprobs[0], (5, s.logprob));
    assert_eq!(s.top_logprobs[1].0, 17);
}

/// The CPU backend's rows, plain and batch invariant (where the log-probs come from the
/// training forward's arithmetic): only the rows that ask get top log-probs, and those
/// agree with the sampled token's.
#[test]
fn the_cpu_backend_reports_top_logprobs_only_for_the_rows_that_ask() {
    let mut rng = SplitMix64::seed_from_u64(22);
    let vocab = 64;
    let logits: Vec<f32> = (0..3 * vocab)
        .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 21) as f32 - 4.0)
        .collect();
    let rows = [
        SamplingRow {
            top_logprobs: 4,
            ..row(0.8, 0, 1.0, 0.0, 1, 0)
        },
        row(1.0, 0, 1.0, 0.0, 2, 0),
        SamplingRow {
            top_logprobs: 20,
            ..row(0.0, 0, 1.0, 0.0, 3, 0)
        },
    ];
    for backend_is_invariant in [false, true] {
        let cpu = CpuBackend::<f32>::new();
        cpu.set_batch_invariant(backend_is_invariant).unwrap();
        let buf = cpu.upload(&logits, BufKind::Full).unwrap();
        let got = cpu.sample(&buf, vocab, &rows).unwrap();
        for (r, (s, asked)) in got.iter().zip(&rows).enumerate() {
            let row_logits = &logits[r * vocab..(r + 1) * vocab];
            let t = if asked.temperature > 0.0 {
                asked.temperature
            } else {
                1.0
            };
            let reference = log_softmax(row_logits, f64::from(t));
            let what = format!("row {r}, invariant {backend_is_invariant}");
            assert_eq!(s.top_logprobs.len(), asked.top_logprobs, "{what}");
            assert_top_logprobs(
                &s.top_logprobs,
                &reference,
                asked.top_logprobs,
                (s.token, s.logprob),
                &what,
            );
        }
    }
}
