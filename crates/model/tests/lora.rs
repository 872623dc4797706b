//! LoRA adapters: the hand-written backward of every adapter tensor against central
//! finite differences in f64 with the base frozen; a fresh adapter equals its base; cached
//! decoding (the sampler's path) and the merged export agree with the training forward;
//! two adapter sets share one base without changing it.

use std::collections::BTreeMap;
use std::sync::Arc;

use floe_backend::cpu::CpuBackend;
use floe_backend::{Backend, BufKind};
use floe_model::batch::{PackedBatch, TokenStats};
use floe_model::config::{Architecture, ModelConfig};
use floe_model::decode::CachedInput;
use floe_model::lora::{adapter_specs, load_adapter_dir, save_adapter_dir, LoraConfig};
use floe_model::transformer::Transformer;
use floe_model::weights::tensor_specs;

mod support;
use support::{random_tensors, Rng};

type B = CpuBackend<f64>;

fn tiny(architecture: Architecture, tied: bool) -> ModelConfig {
    ModelConfig {
        tie_word_embeddings: tied,
        ..ModelConfig::test_shape(architecture)
    }
}

fn base(config: &ModelConfig, seed: u64) -> Transformer<B> {
    let weights = random_tensors(tensor_specs(config), &mut Rng::new(seed));
    Transformer::from_host_weights(Arc::new(B::new()), config.clone(), &weights).unwrap()
}

/// A LoRA model whose A and B are both random (a fresh B is zero, which would hide the
/// gradient of A).
fn trained_lora(config: &ModelConfig, lora: &LoraConfig, seed: u64) -> Transformer<B> {
    let adapters = random_tensors(adapter_specs(config, lora), &mut Rng::new(seed + 100));
    base(config, seed)
        .with_lora_weights(lora.clone(), &adapters)
        .unwrap()
}

/// Three plain sequences and one prompt shared by two responses.
fn mixed_batch(rng: &mut Rng, vocab: usize) -> PackedBatch {
    let mut batch = PackedBatch::default();
    batch.push_sequence(&rng.tokens(6, vocab));
    batch.push_sequence(&rng.tokens(3, vocab));
    let prompt = rng.tokens(4, vocab);
    let responses = [rng.tokens(3, vocab), rng.tokens(2, vocab)];
    batch.push_shared_prompt(&prompt, &responses).unwrap();
    batch
}

/// `L = Σ a_t logprob_t + Σ c_t entropy_t`.
fn loss(stats: &TokenStats, a: &[f64], c: &[f64]) -> f64 {
    let dot = |x: &[f64], y: &[f64]| x.iter().zip(y).map(|(x, y)| x * y).sum::<f64>();
    dot(&stats.logprobs, a) + dot(&stats.entropy, c)
}

/// Adds `delta` to entry `i` of trained tensor `name`.
fn nudge(m: &mut Transformer<B>, name: &str, i: usize, delta: f64) {
    let backend = m.backend().clone();
    let mut found = false;
    m.visit_params(&mut |n, slot| {
        if n == name {
            let mut data = backend.download_f64(slot.param)?;
            data[i] += delta;
            *slot.param = backend.upload_f64(&data, BufKind::Full)?;
            found = true;
        }
        Ok(())
    })
    .unwrap();
    assert!(found, "no trained tensor {name}");
}

/// Checks up to `per_tensor` entries of every adapter tensor against central finite
/// differences, and that the base's weights are neither trained nor changed.
fn gradcheck(config: &ModelConfig, lora: &LoraConfig, seed: u64, per_tensor: usize) {
    let mut rng = Rng::new(seed);
    let mut m = trained_lora(config, lora, seed);
    let base_before = m.to_host_weights().unwrap();
    let batch = mixed_batch(&mut rng, config.vocab_size);
    let t = batch.len();
    let a: Vec<f64> = (0..t).map(|_| rng.uniform()).collect();
    let c: Vec<f64> = (0..t).map(|_| rng.uniform()).collect();
    let scale = 0.8;
    let (wa, wc) = (a.clone(), c.clone());
    m.forward_backward(&batch, scale, &mut |_| Ok((wa.clone(), wc.clone())))
        .unwrap();
    let specs = adapter_specs(config, lora);
    let names: Vec<String> = m.grads_to_host().unwrap().into_keys().collect();
    let mut want: Vec<String> = specs.iter().map(|(n, _)| n.clone()).collect();
    want.sort();
    assert_eq!(names, want, "gradients exist for the adapters only");
    let backend = m.backend().clone();
    let mut analytic = BTreeMap::new();
    m.visit_params(&mut |name, slot| {
        analytic.insert(name.to_string(), backend.download_f64(slot.grad)?);
        Ok(())
    })
    .unwrap();
    let h = 1e-5;
    for (name, shape) in &specs {
        let n: usize = shape.iter().product();
        let entries: Vec<usize> = if n <= per_tensor {
            (0..n).collect()
        } else {
            (0..per_tensor).map(|_| rng.below(n)).collect()
        };
        let g = &analytic[name];
        let tensor_scale = g.iter().fold(1e-6_f64, |m, &x| m.max(x.abs()));
        assert!(tensor_scale > 1e-5, "{name}: gradient is all but zero");
        for i in entries {
            nudge(&mut m, name, i, h);
            let plus = loss(&m.forward(&batch, scale).unwrap(), &a, &c);
            nudge(&mut m, name, i, -2.0 * h);
            let minus = loss(&m.forward(&batch, scale).unwrap(), &a, &c);
            nudge(&mut m, name, i, h);
            let numeric = (plus - minus) / (2.0 * h);
            let got = g[i];
            let err = (got - numeric).abs() / tensor_scale.max(numeric.abs());
            assert!(
                err < 1e-6,
                "{name}[{i}]: analytic {got} vs numeric {numeric} (relative error {err:e})"
            );
        }
    }
    assert_eq!(
        m.to_host_weights().unwrap(),
        base_before,
        "the base stays frozen"
    );
}

#[test]
fn qwen3_tied_adapter_gradients_match_finite_differences() {
    let lora = LoraConfig {
        alpha: 6.0,
        ..LoraConfig::new(3)
    };
    gradcheck(&tiny(Architecture::Qwen3, true), &lora, 31, 6);
}

#[test]
fn qwen2_untied_adapter_gradients_match_finite_differences() {
    let lora = LoraConfig {
        alpha: 2.0,
        ..LoraConfig::new(2)
    };
    gradcheck(&tiny(Architecture::Qwen2, false), &lora, 32, 6);
}

#[test]
fn attention_only_adapters_leave_the_mlp_and_head_alone() {
    let lora = LoraConfig {
        train_mlp: false,
        train_unembed: false,
        ..LoraConfig::new(2)
    };
    let names: Vec<String> = adapter_specs(&tiny(Architecture::Llama, true), &lora)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        names.len(),
        2 * 4 * 2,
        "q, k, v, o of two layers, A and B each"
    );
    assert!(names.iter().all(|n| n.contains(".self_attn.")), "{names:?}");
    gradcheck(&tiny(Architecture::Llama, true), &lora, 33, 4);
}

#[test]
fn a_fresh_adapter_equals_its_base_exactly() {
    let config = tiny(Architecture::Qwen3, true);
    let batch = mixed_batch(&mut Rng::new(1), config.vocab_size);
    let want = base(&config, 5).forward(&batch, 1.0).unwrap();
    let fresh = base(&config, 5).with_lora(LoraConfig::new(4)).unwrap();
    assert_eq!(fresh.forward(&batch, 1.0).unwrap(), want);
    // A is drawn from the seed, B is zero.
    let adapters = fresh.adapters_to_host().unwrap();
    let a = &adapters["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"];
    let bound = 1.0 / (config.hidden_size as f32).sqrt();
    assert!(a.data.iter().all(|x| x.abs() <= bound) && a.data.iter().any(|&x| x != 0.0));
    let b = &adapters["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"];
    assert!(b.data.iter().all(|&x| x == 0.0));
    let again = base(&config, 5).with_lora(LoraConfig::new(4)).unwrap();
    assert_eq!(
        again.adapters_to_host().unwrap(),
        adapters,
        "same seed, same A"
    );
}

/// Log-softmax of `logits` row `r` at `target`.
fn log_softmax_at(logits: &[f64], vocab: usize, r: usize, target: u32) -> f64 {
    let row = &logits[r * vocab..(r + 1) * vocab];
    let max = row.iter().cloned().fold(f64::MIN, f64::max);
    let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    row[target as usize] - lse
}

#[test]
fn cached_decoding_with_adapters_matches_the_training_forward() {
    for tied in [true, false] {
        let config = tiny(Architecture::Qwen3, tied);
        let m = trained_lora(&config, &LoraConfig::new(3), 7);
        let tokens = Rng::new(9).tokens(7, config.vocab_size);
        let batch = PackedBatch::from_sequences(std::slice::from_ref(&tokens)).unwrap();
        let stats = m.forward(&batch, 1.0).unwrap();
        // The whole sequence in one cached call, logits of every row.
        let t = tokens.len() - 1;
        let mut cache = m.new_kv_cache(1, 8).unwrap();
        let input = CachedInput {
            tokens: tokens[..t].to_vec(),
            token_seq: vec![0; t],
            token_pos: (0..t as u32).collect(),
            slots: (0..t as u32).collect(),
            block_tables: vec![0],
            max_blocks: 1,
            logit_rows: (0..t as u32).collect(),
        };
        let logits = m
            .backend()
            .download_f64(&m.forward_cached(&mut cache, &input).unwrap())
            .unwrap();
        for r in 0..t {
            let cached = log_softmax_at(&logits, config.vocab_size, r, tokens[r + 1]);
            assert!(
                (cached - stats.logprobs[r]).abs() < 1e-10,
                "tied {tied}, row {r}: cached {cached} vs forward {}",
                stats.logprobs[r]
            );
        }
    }
}

#[test]
fn merged_weights_compute_what_the_adapters_compute() {
    let config = tiny(Architecture::Qwen3, true);
    let m = trained_lora(&config, &LoraConfig::new(3), 8);
    let batch = mixed_batch(&mut Rng::new(2), config.vocab_size);
    let want = m.forward(&batch, 1.0).unwrap();
    let (merged_config, merged) = m.merged_host_weights().unwrap();
    assert!(
        !merged_config.tie_word_embeddings,
        "an unembed adapter unties the lm-head"
    );
    assert_eq!(
        merged["model.embed_tokens.weight"],
        m.to_host_weights().unwrap()["model.embed_tokens.weight"],
        "the input embedding keeps the base's values"
    );
    let plain = Transformer::from_host_weights(Arc::new(B::new()), merged_config, &merged).unwrap();
    let got = plain.forward(&batch, 1.0).unwrap();
    for (g, w) in got.logprobs.iter().zip(&want.logprobs) {
        // The merged file is f32, so agreement is to f32 rounding.
        assert!((g - w).abs() < 1e-5, "merged {g} vs adapters {w}");
    }
}

#[test]
fn two_adapter_sets_share_one_base_and_train_apart() {
    let config = tiny(Architecture::Qwen3, true);
    let owner = base(&config, 4);
    let base_weights = owner.to_host_weights().unwrap();
    let mut first = owner
        .share_base()
        .unwrap()
        .with_lora(LoraConfig::new(2))
        .unwrap();
    let second = owner
        .share_base()
        .unwrap()
        .with_lora(LoraConfig {
            seed: 1,
            ..LoraConfig::new(4)
        })
        .unwrap();
    assert!(owner.base_is_shared() && first.base_is_shared());
    let batch = mixed_batch(&mut Rng::new(3), config.vocab_size);
    let before = second.forward(&batch, 1.0).unwrap();
    // A plain gradient step on the first model's adapters.
    let rows = batch.len();
    first
        .forward_backward(&batch, 1.0, &mut |_| {
            Ok((vec![-1.0 / rows as f64; rows], vec![0.0; rows]))
        })
        .unwrap();
    let backend = first.backend().clone();
    first
        .visit_params(&mut |_, slot| {
            let g = backend.download_f64(slot.grad)?;
            let mut p = backend.download_f64(slot.param)?;
            p.iter_mut().zip(&g).for_each(|(p, g)| *p -= 0.5 * g);
            *slot.param = backend.upload_f64(&p, BufKind::Full)?;
            Ok(())
        })
        .unwrap();
    assert_ne!(
        first.forward(&batch, 1.0).unwrap(),
        owner.forward(&batch, 1.0).unwrap()
    );
    assert_eq!(
        second.forward(&batch, 1.0).unwrap(),
        before,
        "the other adapters see the same base"
    );
    assert_eq!(owner.to_host_weights().unwrap(), base_weights);
    // Full-weight updates of a shared base are refused, naming why.
    let mut full = owner.share_base().unwrap();
    let err = full.visit_params(&mut |_, _| Ok(())).unwrap_err();
    assert!(err.to_string().contains("shared"), "{err}");
}

#[test]
fn adapter_folders_round_trip_and_bad_ones_are_named() {
    let config = tiny(Architecture::Qwen3, true);
    let lora = LoraConfig {
        train_unembed: false,
        seed: 9,
        ..LoraConfig::new(2)
    };
    let m = trained_lora(&config, &lora, 6);
    let dir = tempfile::tempdir().unwrap();
    save_adapter_dir(
        dir.path(),
        &lora,
        Some("tiny"),
        &m.adapters_to_host().unwrap(),
    )
    .unwrap();
    let (read_config, tensors) = load_adapter_dir(dir.path()).unwrap();
    assert_eq!(read_config, lora);
    assert_eq!(tensors, m.adapters_to_host().unwrap());
    let peft: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(peft["r"], 2);
    assert_eq!(peft["peft_type"], "LORA");

    let mut missing = tensors.clone();
    missing.remove("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight");
    let err = base(&config, 6)
        .with_lora_weights(lora.clone(), &missing)
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("layers.1.mlp.down_proj.lora_B"),
        "{err}"
    );
    let err = base(&config, 6)
        .with_lora(LoraConfig::new(0))
        .err()
        .unwrap();
    assert!(err.to_string().contains("rank"), "{err}");
    let nothing = LoraConfig {
        train_attn: false,
        train_mlp: false,
        train_unembed: false,
        ..LoraConfig::new(2)
    };
    assert!(base(&config, 6).with_lora(nothing).is_err());
}
