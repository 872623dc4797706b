//! Data-parallel training on the CPU: world sizes 1 to 4 as threads of one process over
//! `InProcessCollective`, each rank a `LocalEngine` given its share of every mini-batch
//! (`floe_dist::balance_groups`). The ranks end bit-identical to one another, and equal
//! to one engine trained on the whole mini-batches up to the order of float sums: the
//! reported loss, metrics, gradient norm and the updated weights.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use floe_backend::cpu::{CpuBackend, CpuFloat};
use floe_backend::sampling::GAMMA;
use floe_backend::{Collective, InProcessCollective};
use floe_dist::{balance_groups, GroupShape};
use floe_engine::policy::{OptimParams, OptimizerPlacement, StepOutcome};
use floe_engine::{
    AdapterSource, Engine, ForwardBackwardOutput, LocalEngine, LocalEngineOptions, Loss,
    ModelSource, TrainGroup, TrainResponse,
};
use floe_model::lora::LoraConfig;
use floe_model::weights::{tensor_specs, HostTensor};
use floe_rl::tinker::TinkerLoss;
use floe_rl::{AlgorithmConfig, LossReduction};

mod support;
use support::tiny_config;

/// Most tokens in a micro-batch. Every group of [`batch`] packs to more than half of it,
/// so each group is a micro-batch of its own on any rank, and the per-micro-batch
/// metrics of the ranks are those of the single engine.
const MICROBATCH_TOKENS: usize = 48;
const SEED: u64 = 11;

/// Clipping acts: the gradients of these batches have norms above 0.01.
const OPTIM: OptimParams = OptimParams {
    lr: 1e-2,
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 0.01,
    max_grad_norm: 0.01,
};

fn options(placement: OptimizerPlacement) -> LocalEngineOptions {
    LocalEngineOptions {
        max_tokens_per_microbatch: MICROBATCH_TOKENS,
        kv_cache_bytes: Some(4 << 20),
        optimizer_placement: placement,
        ..LocalEngineOptions::default()
    }
}

fn random(seed: u64) -> ModelSource {
    ModelSource::Random {
        config: tiny_config(),
        seed,
    }
}

fn lora(adapter_rank: usize) -> ModelSource {
    ModelSource::Lora {
        base: Box::new(random(SEED)),
        adapters: AdapterSource::Fresh(LoraConfig::new(adapter_rank)),
    }
}

/// Deterministic pseudo-random values in `0..n`.
fn draws(seed: u64, len: usize, n: u64) -> Vec<u64> {
    let mut x = seed.wrapping_mul(GAMMA) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        })
        .collect()
}

fn tokens(seed: u64, len: usize) -> Vec<u32> {
    draws(seed, len, 62)
        .into_iter()
        .map(|t| 2 + t as u32)
        .collect()
}

/// `groups` groups of 2 to 4 responses whose tokens (prompt once) are 36 to 46 of
/// [`MICROBATCH_TOKENS`], with varied advantages, masks with holes, and old and reference
/// log-probs a little off the model's so the PPO clip and the KL term both act.
fn batch(seed: u64, groups: usize) -> Vec<TrainGroup> {
    (0..groups as u64)
        .map(|g| {
            let seed = seed * 1000 + g * 10;
            let n = 2 + (g % 3) as usize;
            let prompt = tokens(seed, 5 + (g % 3) as usize);
            let responses = (0..n as u64)
                .map(|r| {
                    let len = 36 / n - 1 + draws(seed + r, 1, 3)[0] as usize;
                    let jitter = |salt: u64| -> Vec<f64> {
                        draws(seed + r + salt, len, 7)
                            .into_iter()
                            .map(|d| -2.5 + 0.1 * d as f64)
                            .collect()
                    };
                    TrainResponse {
                        tokens: tokens(seed + r + 1, len),
                        loss_mask: (0..len)
                            .map(|i| if (i + r as usize) % 5 == 4 { 0.0 } else { 1.0 })
                            .collect(),
                        advantages: vec![r as f64 - (n as f64 - 1.0) / 2.0 + 0.3; len],
                        old_logprobs: jitter(100),
                        ref_logprobs: Some(jitter(200)),
                        rollout_logprobs: None,
                        targets: None,
                    }
                })
                .collect();
            TrainGroup { prompt, responses }
        })
        .collect()
}

/// Rank `rank`'s share of `groups`: its pieces under `balance_groups`, in input order.
fn share(groups: &[TrainGroup], world_size: usize, rank: usize) -> Vec<TrainGroup> {
    let shapes: Vec<GroupShape> = groups
        .iter()
        .map(|g| GroupShape {
            prompt_tokens: g.prompt.len(),
            response_tokens: g.responses.iter().map(|r| r.tokens.len()).collect(),
        })
        .collect();
    balance_groups(&shapes, world_size)[rank]
        .iter()
        .map(|piece| TrainGroup {
            prompt: groups[piece.group].prompt.clone(),
            responses: groups[piece.group].responses[piece.responses.clone()].to_vec(),
        })
        .collect()
}

fn policy_loss(loss_reduction: LossReduction) -> Loss {
    Loss::Policy(AlgorithmConfig {
        loss_reduction,
        max_seq_len: Some(32),
        entropy_coeff: 0.01,
        ..AlgorithmConfig::default()
    })
}

/// What one optimizer step reported.
#[derive(Debug, PartialEq)]
struct Step {
    output: ForwardBackwardOutput,
    outcome: StepOutcome,
}

/// What a run of steps reported, and the trained weights (a LoRA engine's adapters).
#[derive(Debug, PartialEq)]
struct Run {
    steps: Vec<Step>,
    weights: BTreeMap<String, HostTensor>,
}

fn train<T: CpuFloat>(
    mut engine: LocalEngine<CpuBackend<T>>,
    batches: &[Vec<TrainGroup>],
    loss: &Loss,
) -> Run {
    let steps = train_steps(&mut engine, batches, loss);
    finish(engine, steps)
}

/// One forward-backward and optimizer step per mini-batch.
fn train_steps<T: CpuFloat>(
    engine: &mut LocalEngine<CpuBackend<T>>,
    batches: &[Vec<TrainGroup>],
    loss: &Loss,
) -> Vec<Step> {
    batches
        .iter()
        .map(|groups| {
            let output = engine.forward_backward(groups, loss, 1.0).unwrap();
            let outcome = engine.optim_step(&OPTIM).unwrap();
            Step { output, outcome }
        })
        .collect()
}

/// `steps` with the engine's trained weights.
fn finish<T: CpuFloat>(engine: LocalEngine<CpuBackend<T>>, steps: Vec<Step>) -> Run {
    let model = engine.policy().model();
    let weights = if model.lora_config().is_some() {
        model.adapters_to_host().unwrap()
    } else {
        engine.policy().master_weights_to_host().unwrap()
    };
    Run { steps, weights }
}

/// One engine on the whole mini-batches, without a collective.
fn single<T: CpuFloat>(source: ModelSource, batches: &[Vec<TrainGroup>], loss: &Loss) -> Run {
    let backend = Arc::new(CpuBackend::<T>::new());
    let engine =
        LocalEngine::new(backend, source, None, options(OptimizerPlacement::Device)).unwrap();
    train(engine, batches, loss)
}

/// `world_size` engines as threads, rank r built from `source(r)` and given its share of
/// every mini-batch; each rank's run, in rank order.
fn data_parallel<T: CpuFloat>(
    world_size: usize,
    source: impl Fn(usize) -> ModelSource + Sync,
    placement: OptimizerPlacement,
    batches: &[Vec<TrainGroup>],
    loss: &Loss,
) -> Vec<Run> {
    let group = InProcessCollective::<T>::group(world_size, Duration::from_secs(120));
    std::thread::scope(|scope| {
        let ranks: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(rank, collective)| {
                let source = &source;
                scope.spawn(move || {
                    let shares: Vec<Vec<TrainGroup>> = batches
                        .iter()
                        .map(|groups| share(groups, world_size, rank))
                        .collect();
                    let collective: Arc<dyn Collective<CpuBackend<T>>> = Arc::new(collective);
                    let engine = LocalEngine::new_data_parallel(
                        Arc::new(CpuBackend::<T>::new()),
                        source(rank),
                        None,
                        options(placement),
                        collective,
                    )
                    .unwrap();
                    train(engine, &shares, loss)
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

/// Rank r starts from other weights than rank 0: the engine broadcasts rank 0's.
fn seeded_per_rank(rank: usize) -> ModelSource {
    random(SEED + 100 * rank as u64)
}

fn batches(groups: usize) -> Vec<Vec<TrainGroup>> {
    (1..=3).map(|seed| batch(seed, groups)).collect()
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * (1.0 + b.abs())
}

/// How far rank 0 may be from the single engine.
struct Tolerance {
    /// Loss, metrics and gradient norm, relative to 1 + |expected|.
    scalars: f64,
    /// Each weight, absolute.
    weights: f64,
}

/// In f64 the ranks' other order of sums moves the scalars by about 1e-15 (measured);
/// the weights are compared as f32 (what `HostTensor` holds), one f32 step apart at most
/// (measured: equal).
const F64: Tolerance = Tolerance {
    scalars: 1e-12,
    weights: 1e-6,
};

/// Every rank reported and holds the same bits; rank 0 equals `expected` within `tol`,
/// metrics too unless `compare_metrics` is off (a split group makes other micro-batches,
/// whose averaged metrics differ).
fn assert_matches(ranks: &[Run], expected: &Run, tol: &Tolerance, compare_metrics: bool) {
    for (rank, run) in ranks.iter().enumerate().skip(1) {
        assert!(run == &ranks[0], "rank {rank} differs from rank 0");
    }
    let got = &ranks[0];
    for (i, (g, e)) in got.steps.iter().zip(&expected.steps).enumerate() {
        let (g_out, e_out) = (&g.output, &e.output);
        assert!(
            close(g_out.loss, e_out.loss, tol.scalars),
            "step {i}: loss {} vs {}",
            g_out.loss,
            e_out.loss
        );
        if compare_metrics {
            assert_eq!(
                g_out.metrics.keys().collect::<Vec<_>>(),
                e_out.metrics.keys().collect::<Vec<_>>(),
                "step {i}"
            );
            for (key, &value) in &e_out.metrics {
                let got = g_out.metrics[key];
                assert!(
                    close(got, value, tol.scalars),
                    "step {i}: {key} {got} vs {value}"
                );
            }
        }
        let (g_step, e_step) = (&g.outcome, &e.outcome);
        assert_eq!(
            (g_step.skipped, g_step.step),
            (e_step.skipped, e_step.step),
            "step {i}"
        );
        assert!(
            close(g_step.grad_norm, e_step.grad_norm, tol.scalars),
            "step {i}: grad norm {} vs {}",
            g_step.grad_norm,
            e_step.grad_norm
        );
    }
    assert_eq!(got.steps.len(), expected.steps.len());
    assert_eq!(
        got.weights.keys().collect::<Vec<_>>(),
        expected.weights.keys().collect::<Vec<_>>()
    );
    let mut worst = (0.0f64, String::new());
    for (name, tensor) in &expected.weights {
        for (&g, &e) in got.weights[name].data.iter().zip(&tensor.data) {
            let diff = f64::from((g - e).abs());
            if diff > worst.0 {
                worst = (diff, name.clone());
            }
        }
    }
    assert!(
        worst.0 <= tol.weights,
        "weights differ by {} in {}",
        worst.0,
        worst.1
    );
}

/// The single engine's run clipped every step: its gradient norms exceed the clip.
fn assert_clipped(run: &Run) {
    for step in &run.steps {
        assert!(!step.outcome.skipped);
        assert!(
            step.outcome.grad_norm > f64::from(OPTIM.max_grad_norm),
            "grad norm {}",
            step.outcome.grad_norm
        );
    }
}

#[test]
fn world_sizes_1_to_4_train_as_one_engine_on_the_whole_batch() {
    let loss = policy_loss(LossReduction::TokenMean);
    // 7 groups: uneven shares for 2, 3 and 4 ranks.
    let batches = batches(7);
    let expected = single::<f64>(random(SEED), &batches, &loss);
    assert_clipped(&expected);
    for world_size in 1..=4 {
        let ranks = data_parallel::<f64>(
            world_size,
            seeded_per_rank,
            OptimizerPlacement::Device,
            &batches,
            &loss,
        );
        assert_matches(&ranks, &expected, &F64, true);
    }
}

#[test]
fn world_size_1_through_the_collective_is_the_engine_bit_for_bit() {
    let loss = policy_loss(LossReduction::TokenMean);
    let batches = batches(5);
    let expected = single::<f32>(random(SEED), &batches, &loss);
    let ranks = data_parallel::<f32>(
        1,
        |_| random(SEED),
        OptimizerPlacement::Device,
        &batches,
        &loss,
    );
    assert_eq!(ranks[0], expected);
}

#[test]
fn every_loss_reduction_uses_the_whole_batch_totals_on_3_ranks() {
    let batches = batches(7);
    for reduction in [
        LossReduction::SequenceMean,
        LossReduction::SeqMeanTokenSumNorm,
        LossReduction::SeqMeanTokenSum,
        LossReduction::PromptMean,
    ] {
        let loss = policy_loss(reduction);
        let expected = single::<f64>(random(SEED), &batches, &loss);
        let ranks = data_parallel::<f64>(
            3,
            seeded_per_rank,
            OptimizerPlacement::Device,
            &batches,
            &loss,
        );
        assert_matches(&ranks, &expected, &F64, true);
    }
}

#[test]
fn cross_entropy_and_tinker_losses_on_2_and_3_ranks() {
    let batches = batches(6);
    let tinker = Loss::Tinker {
        loss: TinkerLoss::Ppo,
        clip_low_threshold: 0.8,
        clip_high_threshold: 1.2,
        beta: 0.05,
    };
    for loss in [Loss::CrossEntropy, tinker] {
        let expected = single::<f64>(random(SEED), &batches, &loss);
        for world_size in [2, 3] {
            let ranks = data_parallel::<f64>(
                world_size,
                seeded_per_rank,
                OptimizerPlacement::Device,
                &batches,
                &loss,
            );
            assert_matches(&ranks, &expected, &F64, true);
        }
    }
}

#[test]
fn f32_ranks_match_within_rounding() {
    let loss = policy_loss(LossReduction::TokenMean);
    let batches = batches(7);
    let expected = single::<f32>(random(SEED), &batches, &loss);
    let ranks = data_parallel::<f32>(
        4,
        seeded_per_rank,
        OptimizerPlacement::Device,
        &batches,
        &loss,
    );
    // Measured: scalars 8e-8, weights 2e-6 apart after three AdamW steps.
    let f32_rounding = Tolerance {
        scalars: 1e-6,
        weights: 2e-5,
    };
    assert_matches(&ranks, &expected, &f32_rounding, true);
}

#[test]
fn groups_split_across_ranks_and_an_idle_rank_still_train_as_one() {
    // One group of 3 responses on 4 ranks: three ranks get a response each (the group
    // split), the fourth none and still joins every collective.
    let batches: Vec<Vec<TrainGroup>> = (1..=3)
        .map(|seed| {
            let mut groups = batch(seed, 2);
            groups.remove(0);
            groups
        })
        .collect();
    assert_eq!(batches[0][0].responses.len(), 3);
    assert!(share(&batches[0], 4, 3).is_empty());
    let loss = policy_loss(LossReduction::TokenMean);
    let expected = single::<f64>(random(SEED), &batches, &loss);
    let ranks = data_parallel::<f64>(
        4,
        seeded_per_rank,
        OptimizerPlacement::Device,
        &batches,
        &loss,
    );
    assert_matches(&ranks, &expected, &F64, false);
}

#[test]
fn the_host_optimizer_steps_with_the_summed_gradients() {
    // The host optimizer keeps f32 masters, even under the f64 backend: measured, scalars
    // 7e-9 and weights 2.4e-7 from the f64 masters on the device.
    let f32_masters = Tolerance {
        scalars: 1e-7,
        weights: 1e-6,
    };
    let loss = policy_loss(LossReduction::TokenMean);
    let batches = batches(5);
    let expected = single::<f64>(random(SEED), &batches, &loss);
    let ranks = data_parallel::<f64>(
        2,
        seeded_per_rank,
        OptimizerPlacement::Host,
        &batches,
        &loss,
    );
    assert_matches(&ranks, &expected, &f32_masters, true);
}

#[test]
fn lora_adapters_train_as_one_engine_on_3_ranks() {
    let loss = policy_loss(LossReduction::TokenMean);
    let batches = batches(7);
    let expected = single::<f64>(lora(4), &batches, &loss);
    assert_clipped(&expected);
    let ranks = data_parallel::<f64>(3, |_| lora(4), OptimizerPlacement::Device, &batches, &loss);
    assert_matches(&ranks, &expected, &F64, true);
}

#[test]
fn a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank() {
    let loss = policy_loss(LossReduction::TokenMean);
    let mut batches = batches(6);
    // A NaN advantage in the group rank 1 trains on.
    let poisoned = share(&batches[1], 3, 1)[0].clone();
    let group = batches[1]
        .iter_mut()
        .find(|g| g.prompt == poisoned.prompt)
        .unwrap();
    group.responses[0].advantages[0] = f64::NAN;
    let expected = single::<f64>(random(SEED), &batches, &loss);
    assert!(expected.steps[1].outcome.skipped);
    let ranks = data_parallel::<f64>(
        3,
        seeded_per_rank,
        OptimizerPlacement::Device,
        &batches,
        &loss,
    );
    assert!(ranks.iter().all(|run| run.steps[1].outcome.skipped));
    let weights =
        |run: &Run| -> Vec<f32> { run.weights.values().flat_map(|t| t.data.clone()).collect() };
    assert!(ranks.iter().all(|run| weights(run) == weights(&ranks[0])));
    assert!(weights(&ranks[0])
        .iter()
        .zip(weights(&expected))
        .all(|(&g, e)| f64::from((g - e).abs()) <= F64.weights));
}

/// Runs `work(rank, collective)` on `world_size` threads of one in-process group; the
/// results in rank order.
fn on_ranks<T: CpuFloat, R: Send>(
    world_size: usize,
    work: impl Fn(usize, Arc<dyn Collective<CpuBackend<T>>>) -> R + Sync,
) -> Vec<R> {
    let group = InProcessCollective::<T>::group(world_size, Duration::from_secs(120));
    std::thread::scope(|scope| {
        let work = &work;
        let ranks: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(rank, collective)| scope.spawn(move || work(rank, Arc::new(collective))))
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

fn zero_stage(stage: u8, placement: OptimizerPlacement) -> LocalEngineOptions {
    LocalEngineOptions {
        zero_stage: stage,
        ..options(placement)
    }
}

/// A rank's engine at ZeRO `stage` (1 or 2) over `collective`, from `source`.
fn sharded_engine<T: CpuFloat>(
    collective: Arc<dyn Collective<CpuBackend<T>>>,
    source: ModelSource,
    placement: OptimizerPlacement,
    stage: u8,
) -> LocalEngine<CpuBackend<T>> {
    let engine = LocalEngine::new_data_parallel(
        Arc::new(CpuBackend::<T>::new()),
        source,
        None,
        zero_stage(stage, placement),
        collective,
    )
    .unwrap();
    assert!(engine.policy().is_sharded());
    assert_eq!(engine.policy().shards_gradients(), stage == 2);
    engine
}

fn rank_shares(
    batches: &[Vec<TrainGroup>],
    world_size: usize,
    rank: usize,
) -> Vec<Vec<TrainGroup>> {
    batches
        .iter()
        .map(|groups| share(groups, world_size, rank))
        .collect()
}

#[test]
fn zero_stage_1_on_1_to_4_ranks_trains_as_one_engine() {
    let loss = policy_loss(LossReduction::TokenMean);
    let batches = batches(7);
    let expected = single::<f64>(random(SEED), &batches, &loss);
    assert_clipped(&expected);
    for world_size in 1..=4 {
        let ranks = on_ranks::<f64, _>(world_size, |rank, collective| {
            let source = seeded_per_rank(rank);
            let engine = sharded_engine(collective, source, OptimizerPlacement::Device, 1);
            train(engine, &rank_shares(&batches, world_size, rank), &loss)
        });
        assert_matches(&ranks, &expected, &F64, true);
    }
    // Host shards keep f32 masters, as the host optimizer does.
    let f32_masters = Tolerance {
        scalars: 1e-7,
        weights: 1e-6,
    };
    let ranks = on_ranks::<f64, _>(3, |rank, collective| {
        let engine = sharded_engine(
            collective,
            seeded_per_rank(rank),
            OptimizerPlacement::Host,
            1,
        );
        train(engine, &rank_shares(&batches, 3, rank), &loss)
    });
    assert_matches(&ranks, &expected, &f32_masters, true);
}

#[test]
fn zero_stage_2_on_1_to_4_ranks_trains_as_one_engine() {
    let loss = policy_loss(LossReduction::TokenMean);
    // 7 groups, one micro-batch each: ranks run unequal numbers of backwards.
    let batches = batches(7);
    let expected = single::<f64>(random(SEED), &batches, &loss);
    assert_clipped(&expected);
    let elements = tiny_config().num_parameters();
    for world_size in 1..=4 {
        let ranks = on_ranks::<f64, _>(world_size, |rank, collective| {
            let source = seeded_per_rank(rank);
            let engine = sharded_engine(collective, source, OptimizerPlacement::Device, 2);
            train(engine, &rank_shares(&batches, world_size, rank), &loss)
        });
        assert_matches(&ranks, &expected, &F64, true);
    }
    // The model holds no full gradient buffer (stage 1's does): one layer's, the final
    // norm's and one vocab-sized tensor's.
    let config = tiny_config();
    let layer: usize = tensor_specs(&config)
        .iter()
        .filter(|(name, _)| name.starts_with("model.layers.0."))
        .map(|(_, shape)| shape.iter().product::<usize>())
        .sum();
    let streamed = layer + (config.vocab_size + 1) * config.hidden_size;
    for (stage, want) in [(1, elements), (2, streamed)] {
        on_ranks::<f64, _>(2, |rank, collective| {
            let mut engine =
                sharded_engine(collective, random(SEED), OptimizerPlacement::Device, stage);
            train_steps(&mut engine, &rank_shares(&batches[..1], 2, rank), &loss);
            let held = engine.policy().model().base_gradient_elements();
            assert_eq!(
                held, want,
                "stage {stage} rank {rank}: gradient elements held"
            );
        });
    }
    // The other losses' loops even out the ranks' backwards too.
    let tinker = Loss::Tinker {
        loss: TinkerLoss::Ppo,
        clip_low_threshold: 0.8,
        clip_high_threshold: 1.2,
        beta: 0.05,
    };
    for loss in [Loss::CrossEntropy, tinker] {
        let expected = single::<f64>(random(SEED), &batches, &loss);
        let ranks = on_ranks::<f64, _>(3, |rank, collective| {
            let engine = sharded_engine(
                collective,
                seeded_per_rank(rank),
                OptimizerPlacement::Device,
                2,
            );
            train(engine, &rank_shares(&batches, 3, rank), &loss)
        });
        assert_matches(&ranks, &expected, &F64, true);
    }
}

#[test]
fn zero_stage_2_skips_a_non_finite_step_on_every_rank_and_goes_on() {
    let loss = policy_loss(LossReduction::TokenMean);
    let mut batches = batches(6);
    let poisoned = share(&batches[1], 3, 1)[0].clone();
    let group = batches[1]
        .iter_mut()
        .find(|g| g.prompt == poisoned.prompt)
        .unwrap();
    group.responses[0].advantages[0] = f64::NAN;
    let expected = single::<f64>(random(SEED), &batches, &loss);
    assert!(expected.steps[1].outcome.skipped && !expected.steps[2].outcome.skipped);
    let ranks = on_ranks::<f64, _>(3, |rank, collective| {
        let engine = sharded_engine(
            collective,
            seeded_per_rank(rank),
            OptimizerPlacement::Device,
            2,
        );
        train(engine, &rank_shares(&batches, 3, rank), &loss)
    });
    assert!(ranks.iter().all(|run| run.steps[1].outcome.skipped));
    // The skipped step's sums are dropped: the next step is the single engine's.
    let (got, want) = (&ranks[0].steps[2].outcome, &expected.steps[2].outcome);
    assert!(
        close(got.grad_norm, want.grad_norm, F64.scalars),
        "step 2: grad norm {} vs {}",
        got.grad_norm,
        want.grad_norm
    );
    for (name, tensor) in &expected.weights {
        for (&g, &e) in ranks[0].weights[name].data.iter().zip(&tensor.data) {
            assert!(
                f64::from((g - e).abs()) <= F64.weights,
                "{name}: {g} vs {e}"
            );
        }
    }
}

#[test]
fn a_zero_stage_1_checkpoint_resumes_at_other_world_sizes() {
    checkpoint_resumes_at_other_world_sizes(1, [(2, 1), (4, 1)]);
}

#[test]
fn a_zero_stage_2_checkpoint_resumes_at_other_world_sizes_and_stages() {
    checkpoint_resumes_at_other_world_sizes(2, [(2, 2), (4, 1)]);
}

/// Three ranks at ZeRO `stage` train two steps, save and train a third; the third step
/// again from the checkpoint on 3 ranks at `stage` (exactly), on each `(world size,
/// stage)` of `resumed`, and on one engine without a collective.
fn checkpoint_resumes_at_other_world_sizes(stage: u8, resumed: [(usize, u8); 2]) {
    let loss = policy_loss(LossReduction::TokenMean);
    let batches = batches(6);
    let dir = tempfile::tempdir().unwrap();
    // Checkpoints hold f32, so the f32 backend resumes exactly; other world sizes sum in
    // other orders.
    let f32_rounding = Tolerance {
        scalars: 1e-6,
        weights: 2e-5,
    };
    // Three ranks train two steps and save, each its shard; then the third step.
    let straight = on_ranks::<f32, _>(3, |rank, collective| {
        let mut engine =
            sharded_engine(collective, random(SEED), OptimizerPlacement::Device, stage);
        let shares = rank_shares(&batches, 3, rank);
        let first = train_steps(&mut engine, &shares[..2], &loss);
        engine.save_state(dir.path()).unwrap();
        let rest = train_steps(&mut engine, &shares[2..], &loss);
        (first, finish(engine, rest))
    });
    let (first, third): (Vec<_>, Vec<_>) = straight.into_iter().unzip();
    assert!(first.iter().all(|f| f == &first[0]));
    // On the same world size the resume is exact.
    let again = on_ranks::<f32, _>(3, |rank, collective| {
        let mut engine = sharded_engine(
            collective,
            random(SEED + 9),
            OptimizerPlacement::Device,
            stage,
        );
        engine.load_state(dir.path()).unwrap();
        let steps = train_steps(&mut engine, &rank_shares(&batches, 3, rank)[2..], &loss);
        finish(engine, steps)
    });
    assert!(
        again == third,
        "resumed on 3 ranks: not the uninterrupted run's bits"
    );
    // Resumed on other world sizes, and by one engine without a collective.
    for (world_size, resumed_stage) in resumed {
        let resumed = on_ranks::<f32, _>(world_size, |rank, collective| {
            // Built from other weights: the load replaces them.
            let source = seeded_per_rank(rank + 1);
            let mut engine = sharded_engine(
                collective,
                source,
                OptimizerPlacement::Device,
                resumed_stage,
            );
            engine.load_state(dir.path()).unwrap();
            assert!(engine.policy().is_sharded());
            assert_eq!(engine.policy().shards_gradients(), resumed_stage == 2);
            let shares = rank_shares(&batches, world_size, rank);
            let steps = train_steps(&mut engine, &shares[2..], &loss);
            finish(engine, steps)
        });
        assert_matches(&resumed, &third[0], &f32_rounding, true);
    }
    let backend = Arc::new(CpuBackend::<f32>::new());
    let mut engine = LocalEngine::new(
        backend,
        random(SEED + 5),
        None,
        options(OptimizerPlacement::Device),
    )
    .unwrap();
    engine.load_state(dir.path()).unwrap();
    let steps = train_steps(&mut engine, &batches[2..], &loss);
    assert_matches(&[finish(engine, steps)], &third[0], &f32_rounding, true);
}

#[test]
fn zero_stages_beyond_2_and_sharded_lora_are_refused() {
    let backend = Arc::new(CpuBackend::<f32>::new());
    let options = LocalEngineOptions {
        zero_stage: 3,
        ..options(OptimizerPlacement::Device)
    };
    let err = LocalEngine::new(backend, random(SEED), None, options)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("engine.zero_stage = 3"), "{err}");
    let errors = on_ranks::<f32, _>(2, |_, collective| {
        LocalEngine::new_data_parallel(
            Arc::new(CpuBackend::<f32>::new()),
            lora(4),
            None,
            zero_stage(1, OptimizerPlacement::Device),
            collective,
        )
        .err()
        .unwrap()
        .to_string()
    });
    assert!(
        errors[0].contains("LoRA") && errors[0].contains("zero_stage"),
        "{}",
        errors[0]
    );
    let errors = on_ranks::<f32, _>(2, |_, collective| {
        LocalEngine::new_data_parallel(
            Arc::new(CpuBackend::<f32>::new()),
            lora(4),
            None,
            zero_stage(2, OptimizerPlacement::Device),
            collective,
        )
        .err()
        .unwrap()
        .to_string()
    });
    assert!(
        errors[0].contains("LoRA") && errors[0].contains("zero_stage"),
        "{}",
        errors[0]
    );
}
