//! One RL step: rollouts of a batch, scored as they finish → old (and reference) log-probs
//! → rewards (optionally KL-penalised) → advantages → mini-batch policy updates → weight
//! sync, giving the step's metrics.

use std::collections::BTreeMap;
use std::time::Instant;

use floe_engine::native_api::float_map;
use floe_engine::policy::OptimParams;
use floe_engine::{
    Engine, ForwardBackwardOutput, Loss, SamplingParams, SamplingSide, SequenceGroup, TrainGroup,
    TrainResponse, TrainingSide, Weights,
};
use floe_env::dataset::DataCursor;
use floe_env::env::aggregate_metrics_by_env;
use floe_model::tokenizer::Tokenizer;
use floe_rl::advantage::zero_variance_sequences;
use floe_rl::config::DynamicSamplingType;
use floe_rl::dapo::{group_signal, overlong_penalty, replacement_groups};
use floe_rl::kl::{apply_kl_in_reward, KlController};
use floe_rl::metrics::{names, response_length_metrics, reward_metrics};
use floe_rl::optim::{lr_at, num_optimizer_steps, LrScheduleKind};
use floe_rl::{compute_advantages, AdvantageInputs, AlgorithmConfig};
use serde::{Deserialize, Serialize};

use super::pipeline::{overlap_metrics, too_stale, Span, Staleness};
use super::{Run, RunPrompts};
use crate::config::{Config, PipelineConfig, PipelineMode, Scheduler};
use crate::data::{next_batch, Prompt};
use crate::error::{Error, Result};
use crate::ranks::Ranks;
use crate::rollout::{derive_seed, engine_sampling_params, RolloutTiming, Rollouts, Trajectory};

/// Stream of training sampling seeds.
const TRAIN_SEED_STREAM: u64 = 0x7A1;
/// Stream of `replace` dynamic sampling's draws of which groups fill silent ones.
const REPLACE_SEED_STREAM: u64 = 0x7A2;

/// Whether `alg` needs the reference model's log-probs (a KL loss or a KL penalty in the
/// reward).
pub(super) fn uses_reference(alg: &AlgorithmConfig) -> bool {
    alg.use_kl_loss || alg.use_kl_in_reward
}

/// What every RL step samples and updates with: fixed for the run but for the KL
/// coefficient, which its controller moves.
pub(super) struct StepSettings {
    /// Sampling parameters of the training rollouts.
    sampling: SamplingParams,
    /// The temperature log-probs are taken at: the sampling one, 1 for greedy sampling.
    temperature: f32,
    /// `trainer.algorithm`'s policy loss.
    policy_loss: Loss,
    /// The shape of the learning-rate schedule.
    schedule: LrScheduleKind,
    /// Optimiser steps of the whole run, the schedule's length.
    total_optimizer_steps: u64,
    /// The KL-in-reward coefficient and its controller.
    kl: KlController,
}

impl StepSettings {
    /// The settings of `config`'s run of `total_steps` RL steps, with the KL coefficient
    /// where the trainer state left it.
    pub(super) fn new(
        config: &Config,
        tokenizer: &Tokenizer,
        total_steps: u64,
        kl_coef: f64,
    ) -> Self {
        let t = &config.trainer;
        let sampling = &config.generator.sampling_params;
        let mut settings = Self {
            sampling: engine_sampling_params(sampling, tokenizer),
            temperature: match sampling.temperature {
                t if t > 0.0 => t as f32,
                _ => 1.0,
            },
            policy_loss: Loss::Policy(t.algorithm.clone()),
            schedule: match t.policy.optimizer_config.scheduler {
                Scheduler::Constant => LrScheduleKind::Constant,
                Scheduler::Linear => LrScheduleKind::Linear,
                Scheduler::Cosine => LrScheduleKind::Cosine,
            },
            total_optimizer_steps: num_optimizer_steps(
                total_steps,
                t.train_batch_size as u64,
                t.policy_mini_batch_size as u64,
                t.update_epochs_per_batch as u64,
            ),
            kl: KlController::new(&t.algorithm),
        };
        settings.restore_kl(&t.algorithm, kl_coef);
        settings
    }

    /// The KL controller of `algorithm` at the coefficient `kl_coef` a trainer state saved.
    pub(super) fn restore_kl(&mut self, algorithm: &AlgorithmConfig, kl_coef: f64) {
        self.kl = KlController::new(algorithm);
        self.kl.coef = kl_coef;
    }
}

/// The per-sequence facts of a batch's trajectories that the step's stages share.
struct Sequences {
    /// Each trajectory's reward.
    scores_s: Vec<f64>,
    /// Each trajectory's group: the index of its prompt in the batch.
    group_ids_s: Vec<u64>,
    /// Each trajectory's response length in tokens.
    seq_lens_s: Vec<usize>,
}

impl Sequences {
    /// The facts of `trajs`, in their order.
    fn of(trajs: &[Trajectory]) -> Self {
        Self {
            scores_s: trajs.iter().map(|tr| tr.reward).collect(),
            group_ids_s: trajs.iter().map(|tr| tr.prompt as u64).collect(),
            seq_lens_s: trajs.iter().map(|tr| tr.response.len()).collect(),
        }
    }
}

impl<E: Engine> Run<'_, E> {
    /// RL step `step`; returns its metrics. Moves the data cursor, the optimiser step
    /// count and the KL coefficient of the trainer state, and sets its step.
    ///
    /// Sync: samples the cursor's next batch, then trains on it. One-step-off: trains on
    /// the batch sampled during the last step (the first step samples its own first; the
    /// first after a resume trains the one its checkpoint saved), while the next step's
    /// batch is sampled beside the forwards and the first backward ([`Engine::overlap`]);
    /// the first optimizer step waits for that sampling to finish.
    pub(super) fn rl_step(&mut self, step: u64) -> Result<BTreeMap<String, f64>> {
        let step_start = Instant::now();
        let pipeline = &self.config.trainer.pipeline;
        let report_pipeline = *pipeline != PipelineConfig::default();
        let sample_next = pipeline.mode == PipelineMode::OneStepOff && step < self.total_steps;

        // 1. Rollouts, scored as they finish, shaped for length, and (dynamic sampling)
        //    filtered for groups with a learning signal.
        let batch = match self.pending.take() {
            Some(batch) => batch,
            None => self.sample_now(step)?,
        };
        let SampledBatch {
            trajs,
            num_prompts,
            timing: rollout_timing,
            mut metrics,
            policy_version,
            epoch,
            ..
        } = batch;
        let mut staleness = Staleness::default();
        let first_trains = !too_stale(
            policy_version,
            self.state.optimizer_steps,
            pipeline.max_staleness,
        );
        // Exact log-probs of the current weights are the old log-probs as they are.
        let old_from_sampler = self.config.engine.exact_logprobs
            && policy_version == self.state.optimizer_steps
            && trajs
                .iter()
                .all(|tr| tr.rollout_logprobs.len() == tr.response.len());

        if num_prompts > 0 {
            // 2. Old (and reference) log-probs under the current weights → rewards
            //    (optionally KL-penalised) → advantages → the first mini-batch's forward and
            //    backward: reads of the weights only, beside the next batch's sampling.
            let algorithm = &self.config.trainer.algorithm;
            let mini_batch_size = self.config.trainer.policy_mini_batch_size;
            let ranks = &self.ranks;
            let (kl, temperature, policy_loss) = (
                &mut self.step_settings.kl,
                self.step_settings.temperature,
                &self.step_settings.policy_loss,
            );
            let mut prepare = |trainer: &mut dyn TrainingSide<Error = E::Error>| {
                let start = Instant::now();
                let prepared = prepare_update(
                    trainer,
                    &UpdateInputs {
                        ranks,
                        algorithm,
                        temperature,
                        policy_loss,
                        mini_batch_size,
                        first_trains,
                        old_from_sampler,
                    },
                    kl,
                    &trajs,
                    num_prompts,
                );
                (prepared, Span::since(start))
            };
            let (prepared, next) = if sample_next {
                let sampler = BatchSampler {
                    config: self.config,
                    prompts: self.prompts,
                    rollouts: &mut self.rollouts,
                    cursor: &mut self.state.data_cursor,
                    sampling: &self.step_settings.sampling,
                    policy_version: self.state.optimizer_steps,
                };
                let sample = |engine: &mut dyn SamplingSide<Error = E::Error>| {
                    let start = Instant::now();
                    (sampler.sample(engine, step + 1), Span::since(start))
                };
                let ((next, sampling), (prepared, training)) = self
                    .engine
                    .overlap(sample, prepare)
                    .map_err(Error::verb("overlap"))?;
                metrics.extend(overlap_metrics(sampling, training));
                (prepared, Some(next?))
            } else {
                (prepare(&mut *self.engine).0, None)
            };
            let prepared = prepared?;
            metrics.extend(prepared.metrics);

            // 3. Policy update: mini-batches of prompts × PPO epochs, one optimiser step each.
            let start = Instant::now();
            let update = self.update_policy(
                &prepared.train_g,
                policy_version,
                prepared.first,
                &mut staleness,
            )?;
            metrics.extend(update);
            metrics.insert(
                "timing/train".into(),
                prepared.first_seconds + start.elapsed().as_secs_f64(),
            );
            self.pending = next;
        } else {
            tracing::warn!(
                "step {step}: every group of {} sampled batches had equal rewards; no update \
                 (trainer.algorithm.dynamic_sampling.max_sample_batches caps the batches)",
                self.config
                    .trainer
                    .algorithm
                    .dynamic_sampling
                    .max_sample_batches
            );
            if sample_next {
                self.pending = Some(self.sample_now(step + 1)?);
            }
        }
        if report_pipeline {
            metrics.extend(staleness.metrics());
        }

        // 4. The sampler uses the new weights from the next rollout on.
        let start = Instant::now();
        self.engine
            .sync_sampler_weights()
            .map_err(Error::verb("sync_sampler_weights"))?;
        metrics.insert("timing/sync".into(), start.elapsed().as_secs_f64());
        metrics.insert("timing/generate".into(), rollout_timing.generate);
        metrics.insert("timing/score".into(), rollout_timing.score);
        metrics.insert("timing/step".into(), step_start.elapsed().as_secs_f64());
        metrics.insert("trainer/epoch".into(), epoch as f64);
        self.state.global_step = step;
        self.state.kl_coef = self.step_settings.kl.coef;
        Ok(metrics)
    }

    /// The batch of step `step`, sampled now by the current weights.
    fn sample_now(&mut self, step: u64) -> Result<SampledBatch> {
        BatchSampler {
            config: self.config,
            prompts: self.prompts,
            rollouts: &mut self.rollouts,
            cursor: &mut self.state.data_cursor,
            sampling: &self.step_settings.sampling,
            policy_version: self.state.optimizer_steps,
        }
        .sample(&mut *self.engine, step)
    }

    /// `trainer.update_epochs_per_batch` passes over mini-batches of
    /// `trainer.policy_mini_batch_size` prompts: forward and backward, then one optimiser
    /// step at the schedule's learning rate each. `first` is the first mini-batch's forward
    /// and backward when it already ran. A mini-batch whose samples are more than
    /// `trainer.pipeline.max_staleness` versions older than the weights is left out (and
    /// so are the later ones, which are older still). Returns the mini-batches' mean
    /// metrics.
    fn update_policy(
        &mut self,
        train_g: &[TrainGroup],
        policy_version: u64,
        mut first: Option<ForwardBackwardOutput>,
        staleness: &mut Staleness,
    ) -> Result<BTreeMap<String, f64>> {
        let t = &self.config.trainer;
        let opt = &t.policy.optimizer_config;
        let settings = &self.step_settings;
        let mut update_metrics: Vec<BTreeMap<String, f64>> = Vec::new();
        let mini_batches = (0..t.update_epochs_per_batch)
            .flat_map(|_| train_g.chunks(t.policy_mini_batch_size))
            .enumerate();
        for (i, mini_batch) in mini_batches {
            let samples = mini_batch.iter().map(|g| g.responses.len()).sum();
            let trains = staleness.admit(
                samples,
                policy_version,
                self.state.optimizer_steps,
                t.pipeline.max_staleness,
            );
            if !trains {
                continue;
            }
            let out = match first.take().filter(|_| i == 0) {
                Some(out) => out,
                None => self
                    .engine
                    .forward_backward(
                        &self.ranks.train_share(mini_batch),
                        &settings.policy_loss,
                        settings.temperature,
                    )
                    .map_err(Error::verb("forward_backward"))?,
            };
            let lr = lr_at(
                self.state.optimizer_steps,
                settings.schedule,
                opt.lr,
                opt.num_warmup_steps,
                settings.total_optimizer_steps,
            );
            let outcome = self
                .engine
                .optim_step(&OptimParams {
                    lr: lr as f32,
                    beta1: opt.betas[0] as f32,
                    beta2: opt.betas[1] as f32,
                    eps: opt.eps as f32,
                    weight_decay: opt.weight_decay as f32,
                    max_grad_norm: opt.max_grad_norm as f32,
                })
                .map_err(Error::verb("optim_step"))?;
            // A skipped (non-finite) step advances neither the optimiser nor the schedule.
            if !outcome.skipped {
                self.state.optimizer_steps += 1;
            }
            let mut m = out.metrics;
            m.insert(names::POLICY_FINAL_LOSS.into(), out.loss);
            m.insert(names::POLICY_GRAD_NORM.into(), outcome.grad_norm);
            m.insert(names::POLICY_LR.into(), lr);
            m.insert(
                "policy/skipped_steps".into(),
                f64::from(u8::from(outcome.skipped)),
            );
            update_metrics.push(m);
        }
        Ok(mean_per_key(&update_metrics))
    }
}

/// What one RL step's sampling reads and moves: the run's prompts and rollout runner, the
/// data cursor, and the version of the weights that sample.
struct BatchSampler<'a> {
    config: &'a Config,
    prompts: &'a RunPrompts,
    rollouts: &'a mut Rollouts,
    cursor: &'a mut DataCursor,
    sampling: &'a SamplingParams,
    policy_version: u64,
}

impl BatchSampler<'_> {
    /// The trajectories step `step` trains on: the data cursor's next batch of prompts,
    /// sampled and scored, with DAPO's overlong shaping when configured. With dynamic
    /// sampling, groups whose rewards are all equal are dropped and further batches are
    /// sampled (each from the cursor, with its own seed) until `trainer.train_batch_size`
    /// groups are kept or `max_sample_batches` batches were sampled; the rollout metrics
    /// then cover every sampled trajectory, the training every kept one. With `replace`,
    /// a batch where enough groups carry a signal trains with its silent groups replaced
    /// by copies of those (further batches are sampled while too few do).
    fn sample<S: SamplingSide + ?Sized>(self, engine: &mut S, step: u64) -> Result<SampledBatch> {
        let (config, prompts) = (self.config, self.prompts);
        let cursor_before = self.cursor.clone();
        let t = &config.trainer;
        let n = config.generator.n_samples_per_prompt;
        let dynamic = &t.algorithm.dynamic_sampling;
        let filter = dynamic.kind.is_some();
        let mut replaced_groups = 0usize;
        let max_batches = if filter {
            dynamic.max_sample_batches.max(1)
        } else {
            1
        };
        let mut timing = RolloutTiming::default();
        let mut overlong = OverlongStats::default();
        // Kept trajectories, their prompts renumbered in the order kept.
        let mut kept: Vec<Trajectory> = Vec::new();
        let mut kept_groups = 0usize;
        // Every sampled trajectory, its prompt numbered across the step's batches.
        let mut sampled: Vec<Trajectory> = Vec::new();
        let mut sampled_groups = 0usize;
        let mut batches = 0usize;
        while batches < max_batches && (batches == 0 || kept_groups < t.train_batch_size) {
            let batch_idx = next_batch(self.cursor, t.train_batch_size, config.data.shuffle);
            let batch: Vec<&Prompt> = batch_idx.iter().map(|&i| prompts.rl_prompt(i)).collect();
            // The first batch keeps the seed a step had before dynamic sampling.
            let seed = match batches {
                0 => derive_seed(&[t.seed, TRAIN_SEED_STREAM, step]),
                b => derive_seed(&[t.seed, TRAIN_SEED_STREAM, step, b as u64]),
            };
            let (mut trajs, batch_timing) =
                self.rollouts.run(engine, &batch, n, self.sampling, seed)?;
            for tr in &mut trajs {
                tr.policy_version = self.policy_version;
            }
            timing.generate += batch_timing.generate;
            timing.score += batch_timing.score;
            batches += 1;
            overlong.shape(&mut trajs, config);
            if !filter {
                kept = trajs;
                kept_groups = batch.len();
                break;
            }
            let scores_s: Vec<f64> = trajs.iter().map(|tr| tr.reward).collect();
            let group_ids_s: Vec<u64> = trajs.iter().map(|tr| tr.prompt as u64).collect();
            if dynamic.kind == Some(DynamicSamplingType::Replace) {
                let mut has_signal = vec![false; batch.len()];
                for (group, signal) in group_signal(&scores_s, &group_ids_s) {
                    has_signal[group as usize] = signal;
                }
                let mut draw = 0u64;
                let sources = replacement_groups(&has_signal, dynamic.min_replace_ratio, |bound| {
                    draw += 1;
                    (derive_seed(&[t.seed, REPLACE_SEED_STREAM, step, batches as u64, draw])
                        % bound as u64) as usize
                });
                let last = batches == max_batches;
                for tr in &trajs {
                    sampled.push(Trajectory {
                        prompt: tr.prompt + sampled_groups,
                        ..tr.clone()
                    });
                }
                sampled_groups += batch.len();
                if sources.is_some() || last {
                    // Each place filled by its source group's samples (itself when it has
                    // a signal, or the last batch as sampled when too few have one).
                    let sources = sources.unwrap_or_else(|| (0..batch.len()).collect());
                    replaced_groups = sources.iter().enumerate().filter(|(g, s)| g != *s).count();
                    kept = sources
                        .iter()
                        .enumerate()
                        .flat_map(|(place, &source)| {
                            trajs
                                .iter()
                                .filter(move |tr| tr.prompt == source)
                                .map(move |tr| Trajectory {
                                    prompt: place,
                                    ..tr.clone()
                                })
                        })
                        .collect();
                    kept_groups = batch.len();
                    break;
                }
                continue;
            }
            let mut new_index: Vec<Option<usize>> = vec![None; batch.len()];
            for (group, has_signal) in group_signal(&scores_s, &group_ids_s) {
                if has_signal && kept_groups < t.train_batch_size {
                    new_index[group as usize] = Some(kept_groups);
                    kept_groups += 1;
                }
            }
            for mut tr in trajs {
                if let Some(index) = new_index[tr.prompt] {
                    kept.push(Trajectory {
                        prompt: index,
                        ..tr.clone()
                    });
                }
                tr.prompt += sampled_groups;
                sampled.push(tr);
            }
            sampled_groups += batch.len();
        }
        // Trained groups in the order kept, samples in order.
        kept.sort_by_key(|tr| (tr.prompt, tr.sample));

        let mut metrics = if filter {
            let sequences = Sequences::of(&sampled);
            let mut metrics = rollout_metrics(&sampled, &sequences, n);
            let filtered = sampled_groups
                - group_signal(&sequences.scores_s, &sequences.group_ids_s)
                    .iter()
                    .filter(|(_, signal)| *signal)
                    .count();
            metrics.extend([
                (
                    names::DYNAMIC_SAMPLING_NUM_GEN_BATCHES.to_string(),
                    batches as f64,
                ),
                (
                    names::DYNAMIC_SAMPLING_NUM_SAMPLED_GROUPS.to_string(),
                    sampled_groups as f64,
                ),
                (
                    names::DYNAMIC_SAMPLING_NUM_FILTERED_GROUPS.to_string(),
                    filtered as f64,
                ),
                (
                    names::DYNAMIC_SAMPLING_FILTERED_GROUPS_FRAC.to_string(),
                    filtered as f64 / sampled_groups.max(1) as f64,
                ),
                (
                    names::DYNAMIC_SAMPLING_NUM_TRAINED_GROUPS.to_string(),
                    kept_groups as f64,
                ),
            ]);
            if dynamic.kind == Some(DynamicSamplingType::Replace) {
                metrics.insert(
                    names::DYNAMIC_SAMPLING_NUM_REPLACED_GROUPS.to_string(),
                    replaced_groups as f64,
                );
            }
            metrics
        } else {
            rollout_metrics(&kept, &Sequences::of(&kept), n)
        };
        metrics.extend(overlong.metrics(config));
        Ok(SampledBatch {
            trajs: kept,
            num_prompts: kept_groups,
            timing,
            metrics,
            policy_version: self.policy_version,
            cursor_before,
            cursor_after: self.cursor.clone(),
            epoch: self.cursor.epoch,
        })
    }
}

/// A sampled batch: what [`BatchSampler::sample`] gives the step that trains on it. A
/// one-step-off checkpoint saves the one sampled ahead (exact floats), so a resume trains
/// it as the uninterrupted run does.
#[derive(Serialize, Deserialize)]
pub(super) struct SampledBatch {
    /// The trajectories to train on, ordered (prompt, sample), prompts numbered from 0.
    trajs: Vec<Trajectory>,
    /// Prompts (groups) among `trajs`.
    num_prompts: usize,
    /// Generation and scoring time over every sampled batch.
    timing: RolloutTiming,
    /// Rollout, dynamic-sampling and overlong metrics.
    #[serde(with = "float_map")]
    metrics: BTreeMap<String, f64>,
    /// The version (RL optimizer steps) of the weights that sampled it.
    pub(super) policy_version: u64,
    /// The data cursor before its prompts were drawn: the trainer state of a checkpoint
    /// taken while it waits to be trained saves this one, so a resume without the batch
    /// draws the same prompts again.
    pub(super) cursor_before: DataCursor,
    /// The data cursor after its prompts were drawn: where a resume that trains the saved
    /// batch goes on.
    pub(super) cursor_after: DataCursor,
    /// The data epoch after its prompts were drawn (`trainer/epoch`).
    epoch: u64,
}

/// What [`prepare_update`] reads besides the batch.
struct UpdateInputs<'a> {
    /// The run's ranks, which share the log-probs' forwards and each mini-batch.
    ranks: &'a Ranks,
    algorithm: &'a AlgorithmConfig,
    /// The temperature log-probs are taken at.
    temperature: f32,
    policy_loss: &'a Loss,
    /// Prompts per mini-batch.
    mini_batch_size: usize,
    /// Whether the first mini-batch trains (it is not too stale).
    first_trains: bool,
    /// The rollouts' log-probs are exact and of the current weights
    /// (`engine.exact_logprobs`, sampled since the last optimizer step): they are the old
    /// log-probs, and the forward that would recompute them is skipped.
    old_from_sampler: bool,
}

/// What the update needs from [`prepare_update`].
struct Prepared {
    /// The batch's training groups, in prompt order.
    train_g: Vec<TrainGroup>,
    /// The first mini-batch's forward and backward, when it trains.
    first: Option<ForwardBackwardOutput>,
    /// Its wall time, in seconds.
    first_seconds: f64,
    /// Log-prob, KL and advantage metrics.
    metrics: BTreeMap<String, f64>,
}

/// The step's work before its first optimizer step, which reads the weights and changes
/// none: old (and reference) log-probs, rewards (optionally KL-penalised, moving `kl`),
/// advantages, the training groups, and the first mini-batch's forward and backward.
fn prepare_update<X: std::error::Error + Send + Sync + 'static>(
    trainer: &mut dyn TrainingSide<Error = X>,
    inputs: &UpdateInputs,
    kl: &mut KlController,
    trajs: &[Trajectory],
    num_prompts: usize,
) -> Result<Prepared> {
    let mut metrics = BTreeMap::new();
    let sequences = Sequences::of(trajs);
    let start = Instant::now();
    let groups_g = sequence_groups(trajs, num_prompts)?;
    let (ranks, temperature) = (inputs.ranks, inputs.temperature);
    let old_logprobs_t = if inputs.old_from_sampler {
        // Tokens the sampler did not draw (observations) carry 0; their loss mask is 0,
        // so nothing reads them.
        trajs
            .iter()
            .flat_map(|tr| tr.rollout_logprobs.iter().copied())
            .collect()
    } else {
        let old_g = ranks.forward_logprobs(trainer, &groups_g, Weights::Policy, temperature)?;
        // Trajectories are ordered (prompt, sample), the same order as the flattened
        // groups.
        let old_logprobs_t = flat_logprobs(&old_g);
        metrics.extend(rollout_train_logprob_diff(trajs, &old_logprobs_t));
        old_logprobs_t
    };
    let ref_g = if uses_reference(inputs.algorithm) {
        Some(ranks.forward_logprobs(trainer, &groups_g, Weights::Reference, temperature)?)
    } else {
        None
    };
    metrics.insert("timing/fwd_logprobs".into(), start.elapsed().as_secs_f64());
    let ref_logprobs_t = ref_g.as_deref().map(flat_logprobs);
    let advantages = advantages(
        inputs.algorithm,
        kl,
        trajs,
        &sequences,
        &old_logprobs_t,
        ref_logprobs_t.as_deref(),
    );
    metrics.extend(advantages.metrics);
    let start = Instant::now();
    let train_g = train_groups(
        trajs,
        &groups_g,
        &TokenInputs {
            loss_mask: &advantages.loss_mask_t,
            advantages: &advantages.advantages_t,
            old_logprobs: &old_logprobs_t,
            ref_logprobs: ref_logprobs_t
                .as_deref()
                .filter(|_| inputs.algorithm.use_kl_loss),
        },
    );
    let first = match train_g.chunks(inputs.mini_batch_size).next() {
        Some(mini_batch) if inputs.first_trains => Some(
            trainer
                .forward_backward(
                    &ranks.train_share(mini_batch),
                    inputs.policy_loss,
                    temperature,
                )
                .map_err(Error::verb("forward_backward"))?,
        ),
        _ => None,
    };
    if let (true, Some(first)) = (inputs.old_from_sampler, &first) {
        // The first update's train log-probs against the sampler's: the rollout-vs-train
        // difference, measured on the first mini-batch (0 when exact).
        if let Some(&max) = first.metrics.get(names::POLICY_PPO_LOG_RATIO_ABS_MAX) {
            metrics.insert(ROLLOUT_TRAIN_ABS_DIFF_MAX.into(), max);
        }
    }
    Ok(Prepared {
        train_g,
        first,
        first_seconds: start.elapsed().as_secs_f64(),
        metrics,
    })
}

/// DAPO's overlong shaping of sampled trajectories, and its counts over a step.
#[derive(Default)]
struct OverlongStats {
    /// Trajectories shaped.
    count: usize,
    /// Those whose last turn stopped at the token limit.
    truncated: usize,
    /// Those masked out of the loss for it.
    filtered: usize,
    /// Those given a penalty.
    penalized: usize,
    /// Sum of the penalties.
    penalty_sum: f64,
}

impl OverlongStats {
    /// Shapes a batch's trajectories in place before their groups are judged: the soft
    /// overlong penalty (`trainer.algorithm.overlong_buffer`) on the reward and on the last
    /// generated token's reward, over the trajectory's generated tokens against
    /// `generator.sampling_params.max_generate_length`; then, with
    /// `generator.apply_overlong_filtering`, a zero loss mask for truncated trajectories.
    fn shape(&mut self, trajs: &mut [Trajectory], config: &Config) {
        let buffer = &config.trainer.algorithm.overlong_buffer;
        let max_len = config.generator.sampling_params.max_generate_length;
        for tr in trajs {
            self.count += 1;
            self.truncated += usize::from(tr.truncated);
            if buffer.len > 0 {
                let generated = tr.loss_mask.iter().filter(|&&m| m > 0.0).count();
                let penalty =
                    overlong_penalty(generated, max_len, buffer.len, buffer.penalty_factor);
                if penalty != 0.0 {
                    tr.reward += penalty;
                    let last = tr.loss_mask.iter().rposition(|&m| m > 0.0);
                    if let Some(reward) = last.and_then(|i| tr.token_rewards.get_mut(i)) {
                        *reward += penalty;
                    }
                    self.penalized += 1;
                    self.penalty_sum += penalty;
                }
            }
            if config.generator.apply_overlong_filtering && tr.truncated {
                tr.loss_mask.fill(0.0);
                self.filtered += 1;
            }
        }
    }

    /// `overlong/*`, only when some overlong shaping is configured.
    fn metrics(&self, config: &Config) -> BTreeMap<String, f64> {
        let filtering = config.generator.apply_overlong_filtering;
        let buffer = config.trainer.algorithm.overlong_buffer.len > 0;
        let mut metrics = BTreeMap::new();
        if !(filtering || buffer) {
            return metrics;
        }
        let count = self.count.max(1) as f64;
        metrics.insert(
            names::OVERLONG_TRUNCATED_FRAC.to_string(),
            self.truncated as f64 / count,
        );
        if filtering {
            metrics.insert(
                names::OVERLONG_NUM_FILTERED.to_string(),
                self.filtered as f64,
            );
        }
        if buffer {
            metrics.insert(
                names::OVERLONG_PENALTY_MEAN.to_string(),
                self.penalty_sum / count,
            );
            metrics.insert(
                names::OVERLONG_PENALIZED_FRAC.to_string(),
                self.penalized as f64 / count,
            );
        }
        metrics
    }
}

/// The rollouts' reward, response-length and per-environment metrics.
fn rollout_metrics(
    trajs: &[Trajectory],
    sequences: &Sequences,
    n_samples_per_prompt: usize,
) -> BTreeMap<String, f64> {
    let mut metrics = reward_metrics(
        &sequences.scores_s,
        &sequences.group_ids_s,
        n_samples_per_prompt,
    );
    metrics.extend(response_length_metrics(
        &sequences.seq_lens_s,
        &sequences.scores_s,
    ));
    metrics.extend(aggregate_metrics_by_env(
        trajs
            .iter()
            .map(|tr| (tr.env_class.as_str(), &tr.env_metrics)),
    ));
    metrics
}

/// Per-token log-probs of the batch, sequences end to end, from per-group ones.
fn flat_logprobs(logprobs_g: &[Vec<Vec<f64>>]) -> Vec<f64> {
    logprobs_g.iter().flatten().flatten().copied().collect()
}

/// What [`advantages`] gives the policy update.
struct Advantages {
    /// The loss mask per token, zero on filtered sequences.
    loss_mask_t: Vec<f64>,
    /// The advantage per token.
    advantages_t: Vec<f64>,
    /// KL, filter and advantage metrics.
    metrics: BTreeMap<String, f64>,
}

/// The advantages of the batch: the token rewards, KL-penalised when `alg` says so (which
/// moves the KL controller), the zero-variance filter on the loss mask, then `alg`'s
/// estimator.
fn advantages(
    alg: &AlgorithmConfig,
    kl: &mut KlController,
    trajs: &[Trajectory],
    sequences: &Sequences,
    old_logprobs_t: &[f64],
    ref_logprobs_t: Option<&[f64]>,
) -> Advantages {
    let Sequences {
        scores_s,
        group_ids_s,
        seq_lens_s,
    } = sequences;
    let mut metrics = BTreeMap::new();
    let mut loss_mask_t: Vec<f64> = trajs.iter().flat_map(|tr| tr.loss_mask.clone()).collect();
    let mut token_rewards_t: Vec<f64> = trajs
        .iter()
        .flat_map(|tr| tr.token_rewards.clone())
        .collect();
    if alg.use_kl_in_reward {
        let reference = ref_logprobs_t.expect("reference log-probs were computed");
        let with_kl = apply_kl_in_reward(
            alg.kl_estimator_type,
            kl.coef,
            &token_rewards_t,
            old_logprobs_t,
            reference,
            &loss_mask_t,
            seq_lens_s,
        );
        token_rewards_t = with_kl.token_rewards;
        metrics.insert(names::LOSS_AVG_KL.into(), with_kl.avg_kl);
        metrics.insert(names::LOSS_AVG_KL_MAX.into(), with_kl.avg_kl_max);
        metrics.insert(names::LOSS_KL_LOSS_COEF.into(), kl.coef);
        kl.update(with_kl.avg_kl, trajs.len());
    }
    if alg.zero_variance_filter {
        let filtered_s = zero_variance_sequences(scores_s, group_ids_s);
        let mut offset = 0;
        for (&len, &filtered) in seq_lens_s.iter().zip(&filtered_s) {
            if filtered {
                loss_mask_t[offset..offset + len].fill(0.0);
            }
            offset += len;
        }
        metrics.insert(
            names::REWARD_NUM_ZERO_VARIANCE_FILTERED.into(),
            filtered_s.iter().filter(|&&f| f).count() as f64,
        );
    }
    let advantages_t = compute_advantages(
        alg,
        &AdvantageInputs {
            seq_lens: seq_lens_s,
            token_rewards: &token_rewards_t,
            response_mask: &loss_mask_t,
            group_ids: group_ids_s,
        },
    );
    metrics.extend(advantage_metrics(
        &advantages_t,
        &loss_mask_t,
        &token_rewards_t,
        seq_lens_s,
    ));
    Advantages {
        loss_mask_t,
        advantages_t,
        metrics,
    }
}

/// How far the sampler's log-probs of the response tokens are from the trainer's under the
/// same weights (`policy/rollout_train_logprobs_abs_diff_{mean,max}` over loss-masked
/// tokens): near 0 unless the two paths disagree. Empty when some trajectory has none.
/// Largest |sampler log-prob − trainer log-prob| over a step's valid tokens.
const ROLLOUT_TRAIN_ABS_DIFF_MAX: &str = "policy/rollout_train_logprobs_abs_diff_max";

fn rollout_train_logprob_diff(trajs: &[Trajectory], train_t: &[f64]) -> BTreeMap<String, f64> {
    if trajs
        .iter()
        .any(|tr| tr.rollout_logprobs.len() != tr.response.len())
    {
        return BTreeMap::new();
    }
    let rollout_t = trajs.iter().flat_map(|tr| &tr.rollout_logprobs);
    let mask_t = trajs.iter().flat_map(|tr| &tr.loss_mask);
    let (mut sum, mut max, mut count) = (0.0_f64, 0.0_f64, 0usize);
    for ((rollout, train), mask) in rollout_t.zip(train_t).zip(mask_t) {
        if *mask > 0.0 {
            let diff = (rollout - train).abs();
            sum += diff;
            max = max.max(diff);
            count += 1;
        }
    }
    if count == 0 {
        return BTreeMap::new();
    }
    BTreeMap::from([
        (
            "policy/rollout_train_logprobs_abs_diff_mean".to_string(),
            sum / count as f64,
        ),
        (ROLLOUT_TRAIN_ABS_DIFF_MAX.to_string(), max),
    ])
}

/// One [`SequenceGroup`] per prompt: its prompt and its samples' responses, in sample order.
fn sequence_groups(trajs: &[Trajectory], num_prompts: usize) -> Result<Vec<SequenceGroup>> {
    let mut groups_g: Vec<Option<SequenceGroup>> = vec![None; num_prompts];
    for tr in trajs {
        let group = groups_g[tr.prompt].get_or_insert_with(|| SequenceGroup {
            targets: None,
            prompt: tr.prompt_ids.clone(),
            responses: Vec::new(),
        });
        if group.prompt != tr.prompt_ids {
            return Err(Error::Data(format!(
                "the environment of prompt {} gave its samples different first prompts; \
                 Env::init must be deterministic",
                tr.prompt
            )));
        }
        group.responses.push(tr.response.clone());
    }
    Ok(groups_g.into_iter().flatten().collect())
}

/// Per-token training inputs of the whole batch, sequences end to end.
struct TokenInputs<'a> {
    loss_mask: &'a [f64],
    advantages: &'a [f64],
    old_logprobs: &'a [f64],
    ref_logprobs: Option<&'a [f64]>,
}

/// Splits the batch's per-token inputs back into [`TrainGroup`]s of the same layout as
/// `groups_g`. Rollout log-probs go along when every sample has them.
fn train_groups(
    trajs: &[Trajectory],
    groups_g: &[SequenceGroup],
    inputs: &TokenInputs,
) -> Vec<TrainGroup> {
    let with_rollout = trajs
        .iter()
        .all(|tr| tr.rollout_logprobs.len() == tr.response.len());
    let mut trajs = trajs.iter();
    let mut offset = 0;
    groups_g
        .iter()
        .map(|group| TrainGroup {
            prompt: group.prompt.clone(),
            responses: group
                .responses
                .iter()
                .map(|tokens| {
                    let tr = trajs.next().expect("one trajectory per response");
                    let range = offset..offset + tokens.len();
                    offset = range.end;
                    TrainResponse {
                        targets: None,
                        tokens: tokens.clone(),
                        loss_mask: inputs.loss_mask[range.clone()].to_vec(),
                        advantages: inputs.advantages[range.clone()].to_vec(),
                        old_logprobs: inputs.old_logprobs[range.clone()].to_vec(),
                        rollout_logprobs: with_rollout.then(|| tr.rollout_logprobs.clone()),
                        ref_logprobs: inputs.ref_logprobs.map(|r| r[range].to_vec()),
                    }
                })
                .collect(),
        })
        .collect()
}

/// `loss/avg_raw_advantages(_abs)` over trained tokens and `loss/avg_final_rewards` per
/// sequence.
fn advantage_metrics(
    advantages_t: &[f64],
    loss_mask_t: &[f64],
    token_rewards_t: &[f64],
    seq_lens_s: &[usize],
) -> BTreeMap<String, f64> {
    let count: f64 = loss_mask_t.iter().sum::<f64>().max(1.0);
    let masked = |f: fn(f64) -> f64| {
        advantages_t
            .iter()
            .zip(loss_mask_t)
            .map(|(a, m)| f(*a) * m)
            .sum::<f64>()
            / count
    };
    let final_rewards = token_rewards_t.iter().sum::<f64>() / seq_lens_s.len().max(1) as f64;
    BTreeMap::from([
        (names::LOSS_AVG_RAW_ADVANTAGES.to_string(), masked(|a| a)),
        (
            names::LOSS_AVG_RAW_ADVANTAGES_ABS.to_string(),
            masked(f64::abs),
        ),
        (names::LOSS_AVG_FINAL_REWARDS.to_string(), final_rewards),
    ])
}

/// The mean of each key over the maps that have it (mini-batch metrics of one step).
fn mean_per_key(maps: &[BTreeMap<String, f64>]) -> BTreeMap<String, f64> {
    let mut sums: BTreeMap<&str, (f64, f64)> = BTreeMap::new();
    for map in maps {
        for (k, v) in map {
            let e = sums.entry(k).or_default();
            e.0 += v;
            e.1 += 1.0;
        }
    }
    sums.into_iter()
        .map(|(k, (sum, n))| (k.to_string(), sum / n))
        .collect()
}
