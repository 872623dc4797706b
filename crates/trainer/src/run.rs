//! The RL loop on one page: setup (data, tokenizer, model, engine), the SFT warm start, then
//! per step: rollouts → rewards → advantages → old/ref log-probs → mini-batch policy
//! updates → weight sync → metrics, eval and checkpoints; at the end the report.
//!
//! Shapes in names: `_s` per sequence (trajectory), `_t` per response token of the batch
//! (sequences end to end), `_g` per group (prompt).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use floe_engine::policy::OptimParams;
use floe_env::dataset::{DataCursor, Row};
use floe_env::env::{aggregate_metrics_by_env, BuiltinConfig, Registry};
use floe_env::sandbox::{Sandbox, SandboxConfig};
use floe_model::chat_template::ChatTemplate;
use floe_model::embedded::is_embedded;
use floe_model::tokenizer::Tokenizer;
use floe_rl::advantage::zero_variance_sequences;
use floe_rl::kl::{apply_kl_in_reward, KlController};
use floe_rl::metrics::{names, response_length_metrics, reward_metrics};
use floe_rl::optim::{lr_at, num_optimizer_steps, LrScheduleKind};
use floe_rl::{compute_advantages, AdvantageInputs};
use indicatif::{ProgressBar, ProgressStyle};

use crate::checkpoint::{
    load_trainer_state, resume_checkpoint, save_checkpoint, TrainerState, CHECKPOINTS_DIR,
    ENGINE_DIR,
};
use crate::config::{Config, Logger, Scheduler};
use crate::data::{load_split, next_batch, prepare_prompts, Prompt, Split};
use crate::error::{Error, Result};
use crate::eval::{evaluate, write_records, EvalSpec, EVALS_DIR};
use crate::metrics::MetricsSink;
use crate::report::{self, Sample, SAMPLES_FILE};
use crate::rollout::{derive_seed, engine_sampling_params, Rollouts, Trajectory};
use crate::setup::{engine_options, labelled_rows, model_setup, TOKENIZER_DIR};
use crate::sft::{run_sft, sft_examples};
use floe_engine::{
    AnyLocalEngine, Engine, Loss, ModelSource, SequenceGroup, TrainGroup, TrainResponse, Weights,
};

/// Stream of training sampling seeds.
const TRAIN_SEED_STREAM: u64 = 0x7A1;
/// Eval generations per eval copied into `samples.jsonl` for the report.
const REPORT_SAMPLES_PER_EVAL: usize = 6;

/// What a finished run reports.
#[derive(Clone, Debug)]
pub struct RunOutcome {
    /// The run directory.
    pub run_dir: PathBuf,
    /// RL steps completed (the last step's number).
    pub steps: u64,
    /// Eval metrics before the first RL step (after the warm start); empty without eval.
    pub initial_eval: BTreeMap<String, f64>,
    /// Eval metrics after the last step; empty without eval.
    pub final_eval: BTreeMap<String, f64>,
    /// The checkpoint this run resumed from, if any.
    pub resumed_from: Option<PathBuf>,
    /// Wall time of this process's part of the run, in seconds.
    pub wall_seconds: f64,
    /// The HTML report.
    pub report: PathBuf,
}

/// The environments of a run: the built-ins over a sandbox with `environment.sql`'s
/// deadline.
pub fn registry(config: &Config) -> Registry {
    let sandbox = Sandbox::new(SandboxConfig {
        timeout: std::time::Duration::from_secs_f64(config.environment.sql.timeout_s),
        ..SandboxConfig::default()
    });
    Registry::with_builtins_config(BuiltinConfig {
        sandbox: Arc::new(sandbox),
        sql_db_root: None,
    })
}

/// Longest conversation a trajectory may reach (`generator.max_input_length`, or room for
/// the prompt and every turn).
pub fn max_input_length(config: &Config) -> usize {
    let g = &config.generator;
    g.max_input_length.unwrap_or(
        config.trainer.max_prompt_length
            + g.max_turns.max(1) * g.sampling_params.max_generate_length,
    )
}

/// Runs `floe train` for a validated config: the local engine on `engine.device`, or a
/// `floe serve` engine at `engine.remote`.
pub fn train(config: &Config) -> Result<RunOutcome> {
    let started = Instant::now();
    config.validate()?;
    let run_dir = config.trainer.run_dir.clone();
    std::fs::create_dir_all(&run_dir).map_err(|source| Error::Io {
        path: run_dir.clone(),
        source,
    })?;
    let resume_from = resume_checkpoint(&run_dir, &config.trainer.resume)?;
    config.save_effective(&run_dir)?;
    let train_rows = load_split(config, &run_dir, Split::Train)?;
    let val_rows = load_split(config, &run_dir, Split::Val)?;
    let fresh = resume_from.is_none();
    if let Some(url) = &config.engine.remote {
        let (tokenizer, template, mut engine) =
            crate::remote::connect_for_run(config, url, &run_dir, &train_rows, fresh)?;
        let inputs = RunInputs {
            tokenizer,
            template,
            train_rows,
            val_rows,
            resume_from,
            started,
        };
        return run_loop(&mut engine, config, inputs);
    }
    let setup = model_setup(config, &run_dir, &train_rows, fresh)?;
    let mut engine = AnyLocalEngine::open(
        setup.source,
        Some(setup.tokenizer.clone()),
        engine_options(config),
    )?;
    let inputs = RunInputs {
        tokenizer: setup.tokenizer,
        template: setup.template,
        train_rows,
        val_rows,
        resume_from,
        started,
    };
    run_loop(&mut engine, config, inputs)
}

/// What [`run_loop`] needs besides the engine and the config.
pub struct RunInputs {
    /// The model's tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template.
    pub template: ChatTemplate,
    /// Training rows (before the prompt-length filter).
    pub train_rows: Vec<Row>,
    /// Validation rows; empty disables eval.
    pub val_rows: Vec<Row>,
    /// The checkpoint to restore, if any.
    pub resume_from: Option<PathBuf>,
    /// When the run started (for the wall time).
    pub started: Instant,
}

/// The loop over any [`Engine`]: SFT (fresh runs), eval before training, the RL steps,
/// evals and checkpoints on their intervals and after the last step, then the report.
pub fn run_loop<E: Engine>(
    engine: &mut E,
    config: &Config,
    inputs: RunInputs,
) -> Result<RunOutcome> {
    let t = &config.trainer;
    let g = &config.generator;
    let alg = &t.algorithm;
    let run_dir = t.run_dir.clone();
    let enable_thinking = config.model.chat_template.enable_thinking;
    let tokenizer = Arc::new(inputs.tokenizer);

    let (prompts, dropped_train) = prepare_prompts(
        inputs.train_rows,
        &tokenizer,
        &inputs.template,
        enable_thinking,
        t.max_prompt_length,
    )?;
    let (val_prompts, dropped_val) = prepare_prompts(
        inputs.val_rows,
        &tokenizer,
        &inputs.template,
        enable_thinking,
        t.max_prompt_length,
    )?;
    // The warm start learns from the first rows (within its per-database caps); RL then
    // draws from all or only the rest.
    let labelled = labelled_rows(config, prompts.iter().map(|p| &p.row))?;
    let sft_prompts: Vec<&Prompt> = prompts
        .iter()
        .zip(&labelled)
        .filter_map(|(p, &l)| l.then_some(p))
        .collect();
    let train_prompts: Vec<&Prompt> = prompts
        .iter()
        .zip(&labelled)
        .filter_map(|(p, &l)| (config.sft.rl_on_examples || !l).then_some(p))
        .collect();
    let steps_per_epoch = train_prompts.len() / t.train_batch_size;
    if steps_per_epoch == 0 {
        return Err(Error::Data(format!(
            "{} training prompts fit trainer.max_prompt_length = {} ({dropped_train} dropped), \
             fewer than trainer.train_batch_size = {}; add data, raise max_prompt_length or \
             lower train_batch_size",
            train_prompts.len(),
            t.max_prompt_length,
            t.train_batch_size
        )));
    }
    let total_steps =
        ((t.epochs * steps_per_epoch) as u64).min(t.max_training_steps.unwrap_or(u64::MAX));
    let total_optimizer_steps = num_optimizer_steps(
        total_steps,
        t.train_batch_size as u64,
        t.policy_mini_batch_size as u64,
        t.update_epochs_per_batch as u64,
    );

    let mut rollouts = Rollouts::new(
        inputs.template,
        Arc::clone(&tokenizer),
        registry(config),
        config
            .environment
            .env_class
            .clone()
            .unwrap_or_else(|| floe_env::env::TEXT2SQL.to_string()),
        enable_thinking,
        g.max_turns,
        max_input_length(config),
        config.environment.max_env_workers,
    )?;
    let train_params = engine_sampling_params(&g.sampling_params, &tokenizer);
    let eval_spec = EvalSpec {
        params: engine_sampling_params(&g.eval_sampling_params, &tokenizer),
        k: g.eval_n_samples_per_prompt,
        batch_size: t.eval_batch_size,
        seed: t.seed,
    };
    let console = t.logger.contains(&Logger::Console);
    let needs_reference = alg.use_kl_loss || alg.use_kl_in_reward;

    // Restore or start: a resumed run skips the warm start and the initial eval.
    let mut state = match &inputs.resume_from {
        Some(checkpoint) => {
            let state = load_trainer_state(checkpoint)?;
            engine
                .load_state(&checkpoint.join(ENGINE_DIR))
                .map_err(Error::verb("load_state"))?;
            keep_samples_up_to(&run_dir, state.global_step)?;
            if console {
                println!(
                    "resumed from {} (step {})",
                    checkpoint.display(),
                    state.global_step
                );
            }
            state
        }
        None => {
            // A fresh run owns its directory: outputs of an earlier run there would mix in.
            for stale in [CHECKPOINTS_DIR, EVALS_DIR, SAMPLES_FILE] {
                remove_if_present(&run_dir.join(stale))?;
            }
            TrainerState {
                global_step: 0,
                optimizer_steps: 0,
                data_cursor: DataCursor::new(train_prompts.len(), t.seed),
                seed: t.seed,
                kl_coef: KlController::new(alg).coef,
                metrics: BTreeMap::new(),
                initial_eval: BTreeMap::new(),
            }
        }
    };
    if state.data_cursor.len != train_prompts.len() {
        return Err(Error::Checkpoint {
            path: inputs.resume_from.clone().unwrap_or_default(),
            message: format!(
                "its data cursor walks {} prompts but this run has {}; resume with the same data",
                state.data_cursor.len,
                train_prompts.len()
            ),
        });
    }
    let mut sink = MetricsSink::create_with(
        &run_dir,
        inputs.resume_from.as_ref().map(|_| state.global_step),
        &t.logger,
    )?;
    if inputs.resume_from.is_none() {
        let data_metrics = BTreeMap::from([
            (
                "data/num_train_prompts".to_string(),
                train_prompts.len() as f64,
            ),
            ("data/num_val_prompts".to_string(), val_prompts.len() as f64),
            (
                "data/num_dropped_prompts".to_string(),
                (dropped_train + dropped_val) as f64,
            ),
            (
                "data/avg_prompt_tokens".to_string(),
                train_prompts.iter().map(|p| p.ids.len()).sum::<usize>() as f64
                    / train_prompts.len() as f64,
            ),
        ]);
        log_metrics(&mut sink, &mut state, 0, &data_metrics)?;
        if config.sft.enabled {
            let examples = sft_examples(&sft_prompts, &tokenizer)?;
            run_sft(engine, config, &examples, &mut |epoch_metrics| {
                if console {
                    println!(
                        "sft epoch {:>2}  loss {:.4}  ({:.1}s)",
                        epoch_metrics["sft/epoch"],
                        epoch_metrics["sft/loss"],
                        epoch_metrics["timing/sft"]
                    );
                }
                log_metrics(&mut sink, &mut state, 0, &epoch_metrics)
            })?;
            // RL is a new phase: AdamW's second moments from the warm start's larger
            // gradients would shrink its first steps.
            engine
                .reset_optimizer()
                .map_err(Error::verb("reset_optimizer"))?;
        }
        if needs_reference {
            engine
                .freeze_reference()
                .map_err(Error::verb("freeze_reference"))?;
        }
        if t.eval_before_train && !val_prompts.is_empty() {
            let metrics =
                eval_and_record(engine, &mut rollouts, &val_prompts, &eval_spec, &run_dir, 0)?;
            print_eval(console, 0, &metrics);
            log_metrics(&mut sink, &mut state, 0, &metrics)?;
            state.initial_eval = metrics;
        }
    }

    let opt = &t.policy.optimizer_config;
    let schedule = match opt.scheduler {
        Scheduler::Constant => LrScheduleKind::Constant,
        Scheduler::Linear => LrScheduleKind::Linear,
        Scheduler::Cosine => LrScheduleKind::Cosine,
    };
    let mut kl = KlController::new(alg);
    kl.coef = state.kl_coef;
    let temperature = match g.sampling_params.temperature {
        t if t > 0.0 => t as f32,
        _ => 1.0,
    };
    let policy_loss = Loss::Policy(alg.clone());
    let bar = ProgressBar::new(total_steps).with_style(
        ProgressStyle::with_template("grpo  {bar:30} {pos}/{len} {elapsed}<{eta} {msg}")
            .expect("a valid progress template"),
    );
    bar.set_position(state.global_step);
    let mut final_eval = BTreeMap::new();
    for step in (state.global_step + 1)..=total_steps {
        let step_start = Instant::now();
        let batch_idx = next_batch(
            &mut state.data_cursor,
            t.train_batch_size,
            config.data.shuffle,
        );
        let batch: Vec<&Prompt> = batch_idx.iter().map(|&i| train_prompts[i]).collect();

        // 1. Rollouts, scored as they finish.
        let (trajs, rollout_timing) = rollouts.run(
            engine,
            &batch,
            g.n_samples_per_prompt,
            &train_params,
            derive_seed(&[t.seed, TRAIN_SEED_STREAM, step]),
        )?;
        let scores_s: Vec<f64> = trajs.iter().map(|tr| tr.reward).collect();
        let group_ids_s: Vec<u64> = trajs.iter().map(|tr| tr.prompt as u64).collect();
        let seq_lens_s: Vec<usize> = trajs.iter().map(|tr| tr.response.len()).collect();
        let mut metrics = reward_metrics(&scores_s, &group_ids_s, g.n_samples_per_prompt);
        metrics.extend(response_length_metrics(&seq_lens_s, &scores_s));
        metrics.extend(aggregate_metrics_by_env(
            trajs
                .iter()
                .map(|tr| (tr.env_class.as_str(), &tr.env_metrics)),
        ));

        // 2. Old (and reference) log-probs of the sampled responses under the current weights.
        let start = Instant::now();
        let groups_g = sequence_groups(&trajs, batch.len())?;
        let old_g = engine
            .forward(&groups_g, Weights::Policy, temperature)
            .map_err(Error::verb("forward"))?;
        let ref_g = if needs_reference {
            Some(
                engine
                    .forward(&groups_g, Weights::Reference, temperature)
                    .map_err(Error::verb("forward"))?,
            )
        } else {
            None
        };
        metrics.insert("timing/fwd_logprobs".into(), start.elapsed().as_secs_f64());
        // Trajectories are ordered (prompt, sample), the same order as the flattened groups.
        let old_logprobs_t: Vec<f64> = old_g
            .iter()
            .flatten()
            .flat_map(|o| o.logprobs.clone())
            .collect();
        metrics.extend(rollout_train_logprob_diff(&trajs, &old_logprobs_t));
        let ref_logprobs_t: Option<Vec<f64>> = ref_g.as_ref().map(|r| {
            r.iter()
                .flatten()
                .flat_map(|o| o.logprobs.clone())
                .collect()
        });

        // 3. Rewards (optionally KL-penalised) → advantages.
        let mut loss_mask_t: Vec<f64> = trajs.iter().flat_map(|tr| tr.loss_mask.clone()).collect();
        let mut token_rewards_t: Vec<f64> = trajs
            .iter()
            .flat_map(|tr| tr.token_rewards.clone())
            .collect();
        if alg.use_kl_in_reward {
            let reference = ref_logprobs_t
                .as_ref()
                .expect("reference log-probs were computed");
            let with_kl = apply_kl_in_reward(
                alg.kl_estimator_type,
                kl.coef,
                &token_rewards_t,
                &old_logprobs_t,
                reference,
                &loss_mask_t,
                &seq_lens_s,
            );
            token_rewards_t = with_kl.token_rewards;
            metrics.insert(names::LOSS_AVG_KL.into(), with_kl.avg_kl);
            metrics.insert(names::LOSS_AVG_KL_MAX.into(), with_kl.avg_kl_max);
            metrics.insert(names::LOSS_KL_LOSS_COEF.into(), kl.coef);
            kl.update(with_kl.avg_kl, trajs.len());
        }
        if alg.zero_variance_filter {
            let filtered_s = zero_variance_sequences(&scores_s, &group_ids_s);
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
                seq_lens: &seq_lens_s,
                token_rewards: &token_rewards_t,
                response_mask: &loss_mask_t,
                group_ids: &group_ids_s,
            },
        );
        metrics.extend(advantage_metrics(
            &advantages_t,
            &loss_mask_t,
            &token_rewards_t,
            &seq_lens_s,
        ));

        // 4. Policy update: mini-batches of prompts × PPO epochs, one optimiser step each.
        let start = Instant::now();
        let train_g = train_groups(
            &trajs,
            &groups_g,
            &TokenInputs {
                loss_mask: &loss_mask_t,
                advantages: &advantages_t,
                old_logprobs: &old_logprobs_t,
                ref_logprobs: ref_logprobs_t.as_deref().filter(|_| alg.use_kl_loss),
            },
        );
        let mut update_metrics: Vec<BTreeMap<String, f64>> = Vec::new();
        for _ in 0..t.update_epochs_per_batch {
            for mini_batch in train_g.chunks(t.policy_mini_batch_size) {
                let out = engine
                    .forward_backward(mini_batch, &policy_loss, temperature)
                    .map_err(Error::verb("forward_backward"))?;
                let lr = lr_at(
                    state.optimizer_steps,
                    schedule,
                    opt.lr,
                    opt.num_warmup_steps,
                    total_optimizer_steps,
                );
                let outcome = engine
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
                    state.optimizer_steps += 1;
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
        }
        metrics.extend(mean_per_key(&update_metrics));
        metrics.insert("timing/train".into(), start.elapsed().as_secs_f64());

        // 5. The sampler uses the new weights from the next rollout on.
        let start = Instant::now();
        engine
            .sync_sampler_weights()
            .map_err(Error::verb("sync_sampler_weights"))?;
        metrics.insert("timing/sync".into(), start.elapsed().as_secs_f64());
        metrics.insert("timing/generate".into(), rollout_timing.generate);
        metrics.insert("timing/score".into(), rollout_timing.score);
        metrics.insert("timing/step".into(), step_start.elapsed().as_secs_f64());
        metrics.insert("trainer/epoch".into(), state.data_cursor.epoch as f64);
        state.global_step = step;
        state.kl_coef = kl.coef;
        log_metrics(&mut sink, &mut state, step, &metrics)?;
        bar.set_position(step);
        bar.set_message(format!(
            "reward {:.3}  len {:.0}  {:.1}s/step",
            metrics[names::REWARD_AVG_RAW_REWARD],
            metrics[names::GENERATE_AVG_NUM_TOKENS],
            metrics["timing/step"]
        ));
        if console {
            // A hidden bar (output not a terminal) drops its println; print directly then.
            let line = step_line(step, total_steps, &metrics);
            if bar.is_hidden() {
                println!("{line}");
            } else {
                bar.println(line);
            }
        }

        // 6. Eval and checkpoint on their intervals and after the last step; the step's
        // metrics are logged before its checkpoint, so a resume keeps exactly them.
        let last = step == total_steps;
        if !val_prompts.is_empty() && (last || on_interval(step, t.eval_interval)) {
            bar.suspend(|| -> Result<()> {
                let metrics = eval_and_record(
                    engine,
                    &mut rollouts,
                    &val_prompts,
                    &eval_spec,
                    &run_dir,
                    step,
                )?;
                print_eval(console, step, &metrics);
                log_metrics(&mut sink, &mut state, step, &metrics)?;
                final_eval = metrics;
                Ok(())
            })?;
        }
        if last || on_interval(step, t.ckpt_interval) {
            save_checkpoint(engine, &run_dir, &state, t.max_ckpts_to_keep)?;
        }
    }
    bar.finish_and_clear();
    if final_eval.is_empty() && state.global_step == total_steps {
        // Resumed after the last step's checkpoint: its eval is in the saved metrics.
        final_eval = state
            .metrics
            .iter()
            .filter(|(k, _)| k.starts_with("eval/"))
            .map(|(k, v)| (k.clone(), *v))
            .collect();
    }
    let report = report::write_report(&run_dir)?;
    Ok(RunOutcome {
        run_dir,
        steps: state.global_step,
        initial_eval: state.initial_eval,
        final_eval,
        resumed_from: inputs.resume_from,
        wall_seconds: inputs.started.elapsed().as_secs_f64(),
        report,
    })
}

/// How far the sampler's log-probs of the response tokens are from the trainer's under the
/// same weights (`policy/rollout_train_logprobs_abs_diff_{mean,max}` over loss-masked
/// tokens): near 0 unless the two paths disagree. Empty when some trajectory has none.
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
        (
            "policy/rollout_train_logprobs_abs_diff_max".to_string(),
            max,
        ),
    ])
}

/// Logs `metrics` for `step` and remembers their latest values in the trainer state.
fn log_metrics(
    sink: &mut MetricsSink,
    state: &mut TrainerState,
    step: u64,
    metrics: &BTreeMap<String, f64>,
) -> Result<()> {
    sink.log(step, metrics)?;
    state
        .metrics
        .extend(metrics.iter().map(|(k, v)| (k.clone(), *v)));
    Ok(())
}

/// Removes a file or folder if it exists.
fn remove_if_present(path: &Path) -> Result<()> {
    let result = if path.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    match result {
        Err(source) if source.kind() != std::io::ErrorKind::NotFound => Err(Error::Io {
            path: path.to_path_buf(),
            source,
        }),
        _ => Ok(()),
    }
}

/// True when `step` is a multiple of a positive `interval` (`-1` never is).
fn on_interval(step: u64, interval: i64) -> bool {
    interval > 0 && step % interval as u64 == 0
}

/// One [`SequenceGroup`] per prompt: its prompt and its samples' responses, in sample order.
fn sequence_groups(trajs: &[Trajectory], num_prompts: usize) -> Result<Vec<SequenceGroup>> {
    let mut groups_g: Vec<Option<SequenceGroup>> = vec![None; num_prompts];
    for tr in trajs {
        let group = groups_g[tr.prompt].get_or_insert_with(|| SequenceGroup {
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

/// Evaluates, writes `<run_dir>/evals/global_step_N.jsonl` and a few generations for the
/// report; returns the metrics.
fn eval_and_record<E: Engine>(
    engine: &mut E,
    rollouts: &mut Rollouts,
    prompts: &[Prompt],
    spec: &EvalSpec,
    run_dir: &Path,
    step: u64,
) -> Result<BTreeMap<String, f64>> {
    let out = evaluate(engine, rollouts, prompts, spec, step)?;
    write_records(
        &run_dir
            .join(EVALS_DIR)
            .join(format!("global_step_{step}.jsonl")),
        &out.records,
    )?;
    let samples: Vec<Sample> = out
        .records
        .iter()
        .take(REPORT_SAMPLES_PER_EVAL)
        .map(|r| Sample {
            step,
            data_source: Some(r.data_source.clone()),
            prompt: r.prompt.clone(),
            response: r.response.clone(),
            reward: r.reward,
        })
        .collect();
    report::append_samples(run_dir, &samples)?;
    Ok(out.metrics)
}

/// Drops report samples of steps after `step` (the abandoned tail of a resumed run).
fn keep_samples_up_to(run_dir: &Path, step: u64) -> Result<()> {
    let path = run_dir.join(SAMPLES_FILE);
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(());
    };
    let kept: String = text
        .lines()
        .filter(|line| serde_json::from_str::<Sample>(line).is_ok_and(|sample| sample.step <= step))
        .map(|line| format!("{line}\n"))
        .collect();
    std::fs::write(&path, kept).map_err(|source| Error::Io { path, source })
}

fn step_line(step: u64, total: u64, m: &BTreeMap<String, f64>) -> String {
    let get = |k: &str| m.get(k).copied().unwrap_or(f64::NAN);
    format!(
        "step {step:>4}/{total}  reward {:.3}  len {:>5.1}  loss {:+.4}  grad {:.3}  \
         gen {:.1}s  train {:.1}s  step {:.1}s",
        get(names::REWARD_AVG_RAW_REWARD),
        get(names::GENERATE_AVG_NUM_TOKENS),
        get(names::POLICY_FINAL_LOSS),
        get(names::POLICY_GRAD_NORM),
        get("timing/generate"),
        get("timing/train"),
        get("timing/step"),
    )
}

fn print_eval(console: bool, step: u64, m: &BTreeMap<String, f64>) {
    if console {
        println!(
            "eval @ step {step}: accuracy {:.3}  avg_score {:.3}  ({:.1}s)",
            m.get("eval/all/accuracy").copied().unwrap_or(f64::NAN),
            m.get(names::EVAL_ALL_AVG_SCORE)
                .copied()
                .unwrap_or(f64::NAN),
            m.get("timing/eval").copied().unwrap_or(f64::NAN),
        );
    }
}

/// What `floe eval` evaluates and where it writes.
#[derive(Clone, Debug)]
pub struct EvalRequest {
    /// A checkpoint folder (`.../checkpoints/global_step_N`) or a run directory (its
    /// latest checkpoint).
    pub target: PathBuf,
    /// A dataset file to evaluate on instead of the run's validation data.
    pub data: Option<PathBuf>,
    /// Samples per prompt instead of the run's `generator.eval_n_samples_per_prompt`.
    pub n: Option<usize>,
    /// Sampling temperature instead of the run's `generator.eval_sampling_params` (0 is
    /// greedy).
    pub temperature: Option<f64>,
    /// Where to write the generations (JSONL) instead of `<run_dir>/evals/`.
    pub out: Option<PathBuf>,
}

/// What `floe eval` measured.
#[derive(Clone, Debug)]
pub struct EvalReport {
    /// The checkpoint evaluated.
    pub checkpoint: PathBuf,
    /// `eval/...` metrics.
    pub metrics: BTreeMap<String, f64>,
    /// The generations file.
    pub generations: PathBuf,
    /// Prompts evaluated.
    pub num_prompts: usize,
}

/// Evaluates a checkpoint of a floe run with the run's own config (tokenizer, template,
/// environments, eval sampling parameters).
pub fn eval_checkpoint(request: &EvalRequest) -> Result<EvalReport> {
    let target = &request.target;
    let checkpoint = if target.join(crate::checkpoint::TRAINER_STATE_FILE).is_file() {
        target.clone()
    } else {
        crate::checkpoint::latest_checkpoint(target)?.ok_or_else(|| Error::Checkpoint {
            path: target.clone(),
            message: "neither a checkpoint folder nor a run directory with checkpoints".into(),
        })?
    };
    let run_dir = checkpoint
        .parent()
        .and_then(Path::parent)
        .ok_or_else(|| Error::Checkpoint {
            path: checkpoint.clone(),
            message: format!("not inside <run_dir>/{CHECKPOINTS_DIR}/"),
        })?
        .to_path_buf();
    let config = Config::load(
        Some(&run_dir.join(crate::config::EFFECTIVE_CONFIG_FILE)),
        &[],
    )?;
    let state = load_trainer_state(&checkpoint)?;
    let tokenizer = if is_embedded(&config.model.path) {
        Tokenizer::from_dir(run_dir.join(TOKENIZER_DIR))?
    } else {
        Tokenizer::from_dir(&config.model.path)?
    };
    let template = ChatTemplate::from_tokenizer(&tokenizer)?.unwrap_or_else(ChatTemplate::qwen3);
    let rows = match &request.data {
        Some(path) => floe_env::dataset::load_rows(path)?,
        None => load_split(&config, &run_dir, Split::Val)?,
    };
    let enable_thinking = config.model.chat_template.enable_thinking;
    let (prompts, _) = prepare_prompts(
        rows,
        &tokenizer,
        &template,
        enable_thinking,
        config.trainer.max_prompt_length,
    )?;
    if prompts.is_empty() {
        return Err(Error::Data(
            "no eval prompts (none given, or all longer than trainer.max_prompt_length)".into(),
        ));
    }
    let mut engine = AnyLocalEngine::open(
        ModelSource::Dir(floe_engine::saved_model_dir(&checkpoint.join(ENGINE_DIR))),
        Some(tokenizer.clone()),
        engine_options(&config),
    )?;
    let g = &config.generator;
    let tokenizer = Arc::new(tokenizer);
    let mut rollouts = Rollouts::new(
        template,
        Arc::clone(&tokenizer),
        registry(&config),
        config
            .environment
            .env_class
            .clone()
            .unwrap_or_else(|| floe_env::env::TEXT2SQL.to_string()),
        enable_thinking,
        g.max_turns,
        max_input_length(&config),
        config.environment.max_env_workers,
    )?;
    let mut sampling = g.eval_sampling_params.clone();
    if let Some(temperature) = request.temperature {
        sampling.temperature = temperature;
    }
    let spec = EvalSpec {
        params: engine_sampling_params(&sampling, &tokenizer),
        k: request.n.unwrap_or(g.eval_n_samples_per_prompt).max(1),
        batch_size: config.trainer.eval_batch_size,
        seed: config.trainer.seed,
    };
    let out = evaluate(
        &mut engine,
        &mut rollouts,
        &prompts,
        &spec,
        state.global_step,
    )?;
    let generations = request.out.clone().unwrap_or_else(|| {
        run_dir
            .join(EVALS_DIR)
            .join(format!("eval_global_step_{}.jsonl", state.global_step))
    });
    write_records(&generations, &out.records)?;
    Ok(EvalReport {
        checkpoint,
        metrics: out.metrics,
        generations,
        num_prompts: prompts.len(),
    })
}
