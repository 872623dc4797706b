//! The model's hand-written backward against central finite differences in f64, for
//! every parameter tensor of each architecture, and the invariances training relies on:
//! prompt sharing, activation recomputation and micro-batch accumulation.

use std::collections::BTreeMap;
use std::sync::Arc;

use floe_backend::cpu::CpuBackend;
use floe_backend::Backend;
use floe_model::batch::{PackedBatch, TokenStats};
use floe_model::config::{Architecture, Llama3RopeScaling, ModelConfig};
use floe_model::transformer::{ModelError, Transformer};
use floe_model::weights::{tensor_specs, HostTensor};

mod support;
use support::{random_weights, Rng};

type B = CpuBackend<f64>;

fn model(config: &ModelConfig, seed: u64) -> Transformer<B> {
    Transformer::from_host_weights(
        Arc::new(B::new()),
        config.clone(),
        &random_weights(config, seed),
    )
    .unwrap()
}

/// Three plain sequences of unequal lengths and one prompt shared by two responses.
fn mixed_batch(rng: &mut Rng, vocab: usize) -> PackedBatch {
    let mut batch = PackedBatch::default();
    batch.push_sequence(&rng.tokens(6, vocab));
    batch.push_sequence(&rng.tokens(3, vocab));
    let prompt = rng.tokens(4, vocab);
    let responses = [rng.tokens(3, vocab), rng.tokens(2, vocab)];
    batch.push_shared_prompt(&prompt, &responses).unwrap();
    batch.push_sequence(&rng.tokens(5, vocab));
    batch
}

/// `L = Σ a_t logprob_t + Σ c_t entropy_t`.
fn loss(stats: &TokenStats, a: &[f64], c: &[f64]) -> f64 {
    let dot = |x: &[f64], y: &[f64]| x.iter().zip(y).map(|(x, y)| x * y).sum::<f64>();
    dot(&stats.logprobs, a) + dot(&stats.entropy, c)
}

/// Runs one forward-backward with constant loss weights.
fn backward(
    m: &mut Transformer<B>,
    batch: &PackedBatch,
    scale: f32,
    a: &[f64],
    c: &[f64],
) -> TokenStats {
    let (a, c) = (a.to_vec(), c.to_vec());
    m.forward_backward(batch, scale, &mut |_| Ok((a.clone(), c.clone())))
        .unwrap()
}

/// Every parameter's gradient in f64, by name.
fn grads(m: &mut Transformer<B>) -> BTreeMap<String, Vec<f64>> {
    let backend = m.backend().clone();
    let mut out = BTreeMap::new();
    m.visit_params(&mut |name, slot| {
        out.insert(name.to_string(), backend.download_f64(slot.grad)?);
        Ok(())
    })
    .unwrap();
    out
}

/// Sets entry `i` of parameter `name` to `value`.
fn set_entry(m: &mut Transformer<B>, name: &str, i: usize, value: f64) {
    let backend = m.backend().clone();
    m.visit_params(&mut |n, slot| {
        if n == name {
            let mut data = backend.download_f64(slot.param)?;
            data[i] = value;
            *slot.param = backend.upload_f64(&data, floe_backend::BufKind::Full)?;
        }
        Ok(())
    })
    .unwrap();
}

fn get_entry(m: &mut Transformer<B>, name: &str, i: usize) -> f64 {
    let backend = m.backend().clone();
    let mut value = f64::NAN;
    m.visit_params(&mut |n, slot| {
        if n == name {
            value = backend.download_f64(slot.param)?[i];
        }
        Ok(())
    })
    .unwrap();
    value
}

/// Checks up to `per_tensor` random entries of every parameter against central finite
/// differences of the loss.
fn gradcheck(config: &ModelConfig, seed: u64, per_tensor: usize) {
    let mut rng = Rng::new(seed);
    let mut m = model(config, seed);
    let batch = mixed_batch(&mut rng, config.vocab_size);
    let t = batch.len();
    let a: Vec<f64> = (0..t).map(|_| rng.uniform()).collect();
    let c: Vec<f64> = (0..t).map(|_| rng.uniform()).collect();
    let scale = 0.8;
    backward(&mut m, &batch, scale, &a, &c);
    let analytic = grads(&mut m);
    let specs = tensor_specs(config);
    assert_eq!(analytic.len(), specs.len(), "one gradient per tensor");
    let h = 1e-5;
    for (name, shape) in specs {
        let n: usize = shape.iter().product();
        let entries: Vec<usize> = if n <= per_tensor {
            (0..n).collect()
        } else {
            (0..per_tensor).map(|_| rng.below(n)).collect()
        };
        let g = &analytic[&name];
        let tensor_scale = g.iter().fold(1e-6_f64, |m, x| m.max(x.abs()));
        for i in entries {
            let x = get_entry(&mut m, &name, i);
            set_entry(&mut m, &name, i, x + h);
            let plus = loss(&m.forward(&batch, scale).unwrap(), &a, &c);
            set_entry(&mut m, &name, i, x - h);
            let minus = loss(&m.forward(&batch, scale).unwrap(), &a, &c);
            set_entry(&mut m, &name, i, x);
            let numeric = (plus - minus) / (2.0 * h);
            let err = (g[i] - numeric).abs() / tensor_scale.max(numeric.abs());
            assert!(
                err < 1e-6,
                "{name}[{i}]: analytic {} vs numeric {numeric} (relative error {err:e})",
                g[i]
            );
        }
    }
}

#[test]
fn qwen3_tied_gradients_match_finite_differences() {
    gradcheck(&ModelConfig::test_shape(Architecture::Qwen3), 11, 12);
}

#[test]
fn qwen2_untied_gradients_match_finite_differences() {
    let mut config = ModelConfig::test_shape(Architecture::Qwen2);
    config.tie_word_embeddings = false;
    gradcheck(&config, 12, 12);
}

#[test]
fn llama_scaled_rope_gradients_match_finite_differences() {
    let mut config = ModelConfig::test_shape(Architecture::Llama);
    config.rope_scaling = Some(Llama3RopeScaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 16,
    });
    gradcheck(&config, 13, 6);
}

fn assert_grads_close(
    what: &str,
    got: &BTreeMap<String, Vec<f64>>,
    want: &BTreeMap<String, Vec<f64>>,
    tol: f64,
) {
    for (name, w) in want {
        let g = &got[name];
        let scale = w.iter().fold(1e-12_f64, |m, x| m.max(x.abs()));
        let worst = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(
            worst / scale < tol,
            "{what}: {name} differs by {worst:e} (scale {scale:e})"
        );
    }
}

#[test]
fn prompt_sharing_equals_unshared_packing() {
    let config = ModelConfig::test_shape(Architecture::Qwen3);
    let mut rng = Rng::new(21);
    let prompt = rng.tokens(5, 32);
    let responses = [rng.tokens(4, 32), rng.tokens(2, 32), rng.tokens(3, 32)];
    let mut shared = PackedBatch::default();
    let shared_rows = shared.push_shared_prompt(&prompt, &responses).unwrap();
    let mut unshared = PackedBatch::default();
    let mut unshared_rows = Vec::new();
    for r in &responses {
        let seq: Vec<u32> = prompt.iter().chain(r).copied().collect();
        let rows = unshared.push_sequence(&seq);
        // The last r.len() rows of each sequence score its response.
        unshared_rows.push(rows.end - r.len()..rows.end);
    }
    // Loss weights on response rows only; prompt rows weigh nothing in both layouts.
    let weights = |batch: &PackedBatch, rows: &[std::ops::Range<usize>], seed: u64| {
        let mut a = vec![0.0; batch.len()];
        let mut c = vec![0.0; batch.len()];
        let mut r = Rng::new(seed);
        for t in rows.iter().flat_map(|range| range.clone()) {
            a[t] = r.uniform();
            c[t] = r.uniform();
        }
        (a, c)
    };
    let (a_s, c_s) = weights(&shared, &shared_rows, 5);
    let (a_u, c_u) = weights(&unshared, &unshared_rows, 5);
    let mut m_shared = model(&config, 3);
    let mut m_unshared = model(&config, 3);
    let s = backward(&mut m_shared, &shared, 1.0, &a_s, &c_s);
    let u = backward(&mut m_unshared, &unshared, 1.0, &a_u, &c_u);
    for (rs, ru) in shared_rows.iter().zip(&unshared_rows) {
        for (ts, tu) in rs.clone().zip(ru.clone()) {
            assert!(
                (s.logprobs[ts] - u.logprobs[tu]).abs() < 1e-12,
                "logprob row {ts} vs {tu}"
            );
            assert!(
                (s.entropy[ts] - u.entropy[tu]).abs() < 1e-12,
                "entropy row {ts} vs {tu}"
            );
        }
    }
    assert_grads_close(
        "prompt sharing",
        &grads(&mut m_shared),
        &grads(&mut m_unshared),
        1e-10,
    );
}

#[test]
fn recomputing_any_number_of_layers_changes_memory_not_gradients() {
    // Four layers, so some are recomputed and some stored.
    let config = ModelConfig {
        num_hidden_layers: 4,
        ..ModelConfig::test_shape(Architecture::Qwen3)
    };
    let mut rng = Rng::new(31);
    let batch = mixed_batch(&mut rng, 32);
    let a: Vec<f64> = (0..batch.len()).map(|_| rng.uniform()).collect();
    let c: Vec<f64> = (0..batch.len()).map(|_| rng.uniform()).collect();
    // Two micro-batches, so the second reuses the activations the first allocated.
    let run = |recomputed: usize| {
        let mut m = model(&config, 4);
        m.set_recomputed_layers(recomputed);
        let stats = [
            backward(&mut m, &batch, 1.0, &a, &c),
            backward(&mut m, &batch, 0.5, &c, &a),
        ];
        (m.recomputed_layers(), stats, grads(&mut m))
    };
    let (_, stored_stats, stored_grads) = run(0);
    // None, some, all (3 of 4: the last layer's internals are still there), and a count
    // past all, which recomputes all.
    for (asked, recomputed) in [(1, 1), (2, 2), (3, 3), (usize::MAX, 3)] {
        let (actual, stats, grads) = run(asked);
        assert_eq!(actual, recomputed);
        assert_eq!(
            stats, stored_stats,
            "{recomputed} recomputed: log-probs and entropies"
        );
        for (name, stored) in &stored_grads {
            let differs = grads[name].iter().zip(stored).position(|(g, s)| g != s);
            if let Some(i) = differs {
                panic!(
                    "{recomputed} recomputed: gradient of {name} [{i}] is {} stored, {} recomputed",
                    stored[i], grads[name][i]
                );
            }
        }
    }
    let bytes = |recomputed| {
        Transformer::<B>::training_activation_bytes(&config, batch.len(), recomputed, &|_| 8)
    };
    // Each recomputed layer saves one layer's internals; the first one also needs a
    // buffer for the output it recomputes.
    let layer = bytes(2) - bytes(3);
    assert!(layer > 0);
    assert_eq!(bytes(1) - bytes(2), layer);
    assert!(bytes(0) - bytes(1) < layer);
    assert_eq!(bytes(3), bytes(usize::MAX));
}

#[test]
fn micro_batches_accumulate_the_full_batch_gradient() {
    let config = ModelConfig::test_shape(Architecture::Qwen2);
    let mut rng = Rng::new(41);
    let seqs: Vec<Vec<u32>> = [5, 3, 7, 4].iter().map(|&n| rng.tokens(n, 32)).collect();
    let full = PackedBatch::from_sequences(&seqs).unwrap();
    let first = PackedBatch::from_sequences(&seqs[..2]).unwrap();
    let second = PackedBatch::from_sequences(&seqs[2..]).unwrap();
    let a: Vec<f64> = (0..full.len()).map(|_| rng.uniform()).collect();
    let c: Vec<f64> = (0..full.len()).map(|_| rng.uniform()).collect();
    let mut whole = model(&config, 5);
    backward(&mut whole, &full, 1.0, &a, &c);
    let mut split = model(&config, 5);
    let k = first.len();
    backward(&mut split, &first, 1.0, &a[..k], &c[..k]);
    backward(&mut split, &second, 1.0, &a[k..], &c[k..]);
    assert_grads_close(
        "micro-batches",
        &grads(&mut split),
        &grads(&mut whole),
        1e-12,
    );
    let norm = split.grad_norm().unwrap();
    let want: f64 = grads(&mut whole)
        .values()
        .flatten()
        .map(|x| x * x)
        .sum::<f64>()
        .sqrt();
    assert!((norm - want).abs() < 1e-12 * want);
    split.zero_grad().unwrap();
    assert_eq!(split.grad_norm().unwrap(), 0.0);
}

#[test]
fn host_weights_round_trip_and_errors_name_the_tensor() {
    let config = ModelConfig::test_shape(Architecture::Qwen3);
    let weights = random_weights(&config, 9);
    let m = Transformer::from_host_weights(Arc::new(B::new()), config.clone(), &weights).unwrap();
    assert_eq!(m.to_host_weights().unwrap(), weights);

    let mut missing = weights.clone();
    missing.remove("model.layers.1.self_attn.k_norm.weight");
    let err = Transformer::from_host_weights(Arc::new(B::new()), config.clone(), &missing)
        .err()
        .unwrap();
    assert!(
        err.to_string()
            .contains("model.layers.1.self_attn.k_norm.weight"),
        "{err}"
    );

    let mut wrong = weights;
    wrong.insert("model.norm.weight".into(), HostTensor::zeros(vec![15]));
    let err = Transformer::from_host_weights(Arc::new(B::new()), config, &wrong)
        .err()
        .unwrap();
    assert!(err.to_string().contains("model.norm.weight"), "{err}");
}

#[test]
fn bad_batches_and_loss_gradients_are_errors() {
    let config = ModelConfig::test_shape(Architecture::Llama);
    let mut m = Transformer::new_random(Arc::new(B::new()), config, 1).unwrap();
    let batch = PackedBatch::from_sequences(&[vec![1, 2, 40]]).unwrap();
    let err = m.forward(&batch, 1.0).unwrap_err();
    assert!(err.to_string().contains("targets[1] = 40"), "{err}");
    let batch = PackedBatch::from_sequences(&[vec![1, 2, 3]]).unwrap();
    let err = m
        .forward_backward(&batch, 1.0, &mut |_| Ok((vec![0.0; 1], vec![0.0; 2])))
        .unwrap_err();
    assert!(matches!(err, ModelError::Input(_)), "{err}");
    assert!(
        err.to_string().contains("dL/dlogprob has 1 entries"),
        "{err}"
    );
}

#[test]
fn scoring_forward_matches_training_forward_for_any_lm_head_chunking() {
    let config = ModelConfig::test_shape(Architecture::Qwen3);
    let mut rng = Rng::new(51);
    let batch = mixed_batch(&mut rng, 32);
    let mut m = model(&config, 6);
    let scored = m.forward(&batch, 0.9).unwrap();
    let zeros = vec![0.0; batch.len()];
    let trained = backward(&mut m, &batch, 0.9, &zeros, &zeros);
    assert_eq!(
        scored, trained,
        "forward-only and training forwards run the same ops"
    );
    m.set_lm_head_chunk_logits(1);
    let one_row = m.forward(&batch, 0.9).unwrap();
    for t in 0..batch.len() {
        assert!((one_row.logprobs[t] - scored.logprobs[t]).abs() < 1e-12);
        assert!((one_row.entropy[t] - scored.entropy[t]).abs() < 1e-12);
    }
}

/// What a streamed backward handed out: each parameter's gradient by name, and the
/// visit-order index of each call's first parameter, in call order.
fn streamed_backward(
    m: &mut Transformer<B>,
    batch: &PackedBatch,
    a: &[f64],
    c: &[f64],
) -> (BTreeMap<String, Vec<f64>>, Vec<usize>) {
    let names: Vec<String> = tensor_specs(m.config()).into_iter().map(|s| s.0).collect();
    let backend = m.backend().clone();
    let (a, c) = (a.to_vec(), c.to_vec());
    let (mut got, mut firsts) = (BTreeMap::new(), Vec::new());
    m.forward_backward_streamed(
        batch,
        1.0,
        &mut |_| Ok((a.clone(), c.clone())),
        &mut |first, grads| {
            firsts.push(first);
            for (i, g) in grads.iter().enumerate() {
                let previous = got.insert(names[first + i].clone(), backend.download_f64(g)?);
                assert!(previous.is_none(), "{} received twice", names[first + i]);
            }
            Ok(())
        },
    )
    .unwrap();
    (got, firsts)
}

#[test]
fn streamed_gradients_are_the_held_ones_in_reverse_visit_order() {
    for (arch, tied, recomputed) in [
        (Architecture::Qwen3, true, 0),
        (Architecture::Qwen2, false, 1),
    ] {
        let mut config = ModelConfig::test_shape(arch);
        config.tie_word_embeddings = tied;
        let mut rng = Rng::new(51);
        let batch = mixed_batch(&mut rng, config.vocab_size);
        let a: Vec<f64> = (0..batch.len()).map(|_| rng.uniform()).collect();
        let c: Vec<f64> = (0..batch.len()).map(|_| rng.uniform()).collect();
        let mut held = model(&config, 6);
        held.set_recomputed_layers(recomputed);
        backward(&mut held, &batch, 1.0, &a, &c);
        let want = grads(&mut held);
        let mut streamed = model(&config, 6);
        streamed.set_recomputed_layers(recomputed);
        streamed.stream_gradients().unwrap();
        let all: usize = want.values().map(Vec::len).sum();
        let kept = streamed.base_gradient_elements();
        assert!(
            kept < all,
            "{arch:?}: streaming keeps {kept} of {all} elements"
        );
        // Two backwards: each hands out its own gradients, not a running sum.
        for pass in 0..2 {
            let (got, firsts) = streamed_backward(&mut streamed, &batch, &a, &c);
            assert_eq!(
                got.len(),
                want.len(),
                "{arch:?} pass {pass}: every parameter once"
            );
            for (name, w) in &want {
                assert!(
                    got[name] == *w,
                    "{arch:?} pass {pass}: {name} differs from the held gradient"
                );
            }
            assert!(
                firsts.windows(2).all(|w| w[0] > w[1]) && firsts.last() == Some(&0),
                "{arch:?}: calls not in reverse visit order: {firsts:?}"
            );
        }
        assert_eq!(streamed.base_gradient_elements(), kept);
        let err = streamed.forward_backward(&batch, 1.0, &mut |_| Ok((a.clone(), c.clone())));
        assert!(err
            .unwrap_err()
            .to_string()
            .contains("forward_backward_streamed"));
        let err = streamed.visit_params(&mut |_, _| Ok(())).unwrap_err();
        assert!(err.to_string().contains("visit_weights"), "{err}");
    }
}
