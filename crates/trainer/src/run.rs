//! The RL loop: [`train`] opens the engine and [`run_loop`] walks a run's stages. A run
//! starts by restoring its checkpoint, or fresh with the SFT warm start and an eval; each
//! step then makes one RL update (the `step` module), logs and shows its metrics, and
//! evaluates and checkpoints on their intervals; the end brings the final eval and the
//! report.
//!
//! Shapes in names: `_s` per sequence (trajectory), `_t` per response token of the batch
//! (sequences end to end), `_g` per group (prompt).

mod pipeline;
mod step;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use floe_env::dataset::{DataCursor, Row};
use floe_env::env::{BuiltinConfig, Registry};
use floe_env::sandbox::{Sandbox, SandboxConfig};
use floe_model::chat_template::ChatTemplate;
use floe_model::tokenizer::Tokenizer;
use floe_rl::kl::KlController;
use floe_rl::metrics::names;
use indicatif::{ProgressBar, ProgressStyle};

use crate::checkpoint::{
    commit_checkpoint, latest_checkpoint, load_pending_batch, load_trainer_state,
    prepare_checkpoint, resume_checkpoint, save_engine_state, TrainerState, CHECKPOINTS_DIR,
    ENGINE_DIR, PENDING_BATCH_FILE,
};
use crate::config::{Config, Logger, PipelineMode, TrainerConfig};
use crate::data::{load_split, prepare_prompts, Prompt, Split};
use crate::error::{Error, Result};
use crate::eval::{evaluate, write_records, EvalSpec, EVALS_DIR};
use crate::outputs::metrics::MetricsSink;
use crate::outputs::report::{self, Sample, SAMPLES_FILE};
use crate::ranks::Ranks;
use crate::rollout::{engine_sampling_params, Rollouts};
use crate::setup::{
    check_checkpoint_space, checkpoint_bytes, engine_options, labelled_rows, model_setup,
};
use crate::sft::{run_sft, sft_examples};
use floe_dist::World;
use floe_engine::{AnyLocalEngine, DataParallelGroup, Device, Engine};
use step::{uses_reference, SampledBatch, StepSettings};

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
/// `floe serve` engine at `engine.remote`; as one rank of a data-parallel job when the
/// launcher's variables say so ([`train_with_registry`]).
pub fn train(config: &Config) -> Result<RunOutcome> {
    train_with_registry(config, registry(config))
}

/// How long ranks wait for each other at the rendezvous.
const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// [`train`] with the environments of `registry` instead of the built-ins (a test's
/// scripted rewards, a caller's own environments). Under `floe launch`, torchrun or
/// Slurm (`floe_dist::World::from_env`) with more than one rank, this process is one
/// rank of a data-parallel run on `cuda:{LOCAL_RANK}` (whatever ordinal `engine.device`
/// names), its ranks joined through NCCL; the CPU has no collective across processes and
/// is refused, and so is a remote engine.
pub fn train_with_registry(config: &Config, registry: Registry) -> Result<RunOutcome> {
    let world = World::from_env(None).map_err(|e| Error::DataParallel(e.to_string()))?;
    train_in_world(config, registry, &world)
}

/// [`train_with_registry`] as this process's place in `world`.
pub fn train_in_world(config: &Config, registry: Registry, world: &World) -> Result<RunOutcome> {
    if world.world_size == 1 {
        return train_as_rank(config, registry, None);
    }
    config.validate()?;
    let (rank, size) = (world.rank, world.world_size);
    if config.engine.remote.is_some() {
        return Err(Error::DataParallel(format!(
            "rank {rank} of WORLD_SIZE={size}, but engine.remote is set: a remote engine \
             trains on its server; run floe train as one process"
        )));
    }
    if config.engine.device == Device::Cpu {
        return Err(Error::DataParallel(format!(
            "rank {rank} of WORLD_SIZE={size} on engine.device = \"cpu\": the CPU backend \
             has no collective across processes (CPU data parallelism runs as threads of \
             one process, for tests); train on GPUs (engine.device = \"cuda\", one process \
             per GPU) or as one process"
        )));
    }
    let group = DataParallelGroup::join_nccl(world, RENDEZVOUS_TIMEOUT)?;
    let mut config = config.clone();
    config.engine.device = group.device();
    // The other ranks learn at once how this one ended: an error stops them naming it.
    let outcome = train_as_rank(&config, registry, Some(group.clone()));
    match &outcome {
        Ok(_) => group.leave(),
        Err(err) => group.fail(&err.to_string()),
    }
    outcome
}

/// [`train_with_registry`] as this process's rank of `group` (`None`: the only one) on
/// a local or, alone, a remote engine. Every rank runs the whole loop with its share of
/// each step's work (`crate::ranks`); rank 0 alone prepares the run directory (the
/// checkpoint to resume, the effective config, generated data, an embedded model's
/// tokenizer) and writes metrics, evals, the report and checkpoints. A test runs ranks
/// as threads with [`DataParallelGroup::in_process`].
pub fn train_as_rank(
    config: &Config,
    registry: Registry,
    group: Option<DataParallelGroup>,
) -> Result<RunOutcome> {
    let started = Instant::now();
    config.validate()?;
    let ranks = group
        .as_ref()
        .map_or_else(Ranks::single, |g| Ranks::new(g.exchange()));
    let run_dir = config.trainer.run_dir.clone();
    let (resume_from, train_rows, val_rows) = ranks.from_rank_zero(|| {
        std::fs::create_dir_all(&run_dir).map_err(|source| Error::Io {
            path: run_dir.clone(),
            source,
        })?;
        let resume_from = resume_checkpoint(&run_dir, &config.trainer.resume)?;
        config.save_effective(&run_dir)?;
        let train_rows = load_split(config, &run_dir, Split::Train)?;
        let val_rows = load_split(config, &run_dir, Split::Val)?;
        Ok((resume_from, train_rows, val_rows))
    })?;
    let fresh = resume_from.is_none();
    if let Some(url) = &config.engine.remote {
        if group.is_some() {
            return Err(Error::DataParallel(
                "engine.remote is set: a remote engine trains on its server, not across ranks"
                    .into(),
            ));
        }
        let (tokenizer, template, mut engine) =
            crate::remote::connect_for_run(config, url, &run_dir, &train_rows, fresh)?;
        let inputs = RunInputs {
            tokenizer,
            template,
            train_rows,
            val_rows,
            resume_from,
            started,
            registry,
            ranks,
        };
        return run_loop(&mut engine, config, inputs);
    }
    // Rank 0 sets the model up first (an embedded model's tokenizer is trained and saved
    // then); the others read what it saved.
    let mut setup = None;
    ranks.from_rank_zero(|| {
        // Hours of training must not end at a checkpoint the disk cannot hold.
        check_checkpoint_space(config, checkpoint_bytes(config)?)?;
        setup = Some(model_setup(config, &run_dir, &train_rows, fresh)?);
        Ok(())
    })?;
    let setup = match setup {
        Some(setup) => setup,
        None => model_setup(config, &run_dir, &train_rows, false)?,
    };
    let opening = Instant::now();
    let tokenizer = Some(setup.tokenizer.clone());
    let options = engine_options(config);
    let mut engine = match &group {
        Some(group) => AnyLocalEngine::open_data_parallel(group, setup.source, tokenizer, options)?,
        None => AnyLocalEngine::open(setup.source, tokenizer, options)?,
    };
    let plan = engine.memory_plan();
    if plan.budget_bytes.is_some() && ranks.writes() {
        // A GPU run: what it holds, before the first step (the CPU has no budget to show).
        println!(
            "engine on {} ready in {:.1}s\n{plan}",
            config.engine.device,
            opening.elapsed().as_secs_f64()
        );
    }
    let inputs = RunInputs {
        tokenizer: setup.tokenizer,
        template: setup.template,
        train_rows,
        val_rows,
        resume_from,
        started,
        registry,
        ranks,
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
    /// The environments rollouts are scored by ([`registry`] for the built-ins).
    pub registry: Registry,
    /// The run's ranks ([`Ranks::single`] for one process).
    pub ranks: Ranks,
}

/// The loop over any [`Engine`]: the run's start (restored, or fresh: SFT and the eval
/// before training), the RL steps with their evals and checkpoints on their intervals and
/// after the last step, then the report.
pub fn run_loop<E: Engine>(
    engine: &mut E,
    config: &Config,
    inputs: RunInputs,
) -> Result<RunOutcome> {
    let tokenizer = Arc::new(inputs.tokenizer);
    let prompts = RunPrompts::prepare(
        config,
        &tokenizer,
        &inputs.template,
        inputs.train_rows,
        inputs.val_rows,
    )?;
    let total_steps = prompts.total_steps(&config.trainer)?;
    let rollouts = rollouts_with(config, inputs.template, &tokenizer, inputs.registry)?
        .with_ranks(inputs.ranks.clone());
    let resume_from = inputs.resume_from.as_deref();
    let mut run = Run::start(
        engine,
        config,
        &prompts,
        rollouts,
        inputs.ranks,
        &tokenizer,
        total_steps,
        resume_from,
    )?;
    if resume_from.is_none() {
        run.fresh_start(&tokenizer)?;
    }
    let progress = Progress::new(
        run.console,
        run.ranks.writes(),
        total_steps,
        run.state.global_step,
    );
    let mut final_eval = BTreeMap::new();
    let mut recoveries = 0;
    let mut step = run.state.global_step + 1;
    while step <= total_steps {
        match run.step_with_eval_and_checkpoint(step, &progress) {
            Ok(Some(eval)) => final_eval = eval,
            Ok(None) => {}
            Err(error) => {
                run.recover(error, &mut recoveries)?;
                step = run.state.global_step + 1;
                progress.bar.set_position(run.state.global_step);
                continue;
            }
        }
        step += 1;
    }
    progress.finish();
    run.finish(final_eval, inputs.resume_from, inputs.started)
}

/// The rollout runner of `config`: its environments, the default environment, the turn
/// and length limits, the scoring workers. Training and `floe eval` share it.
pub(crate) fn rollouts_for(
    config: &Config,
    template: ChatTemplate,
    tokenizer: &Arc<Tokenizer>,
) -> Result<Rollouts> {
    rollouts_with(config, template, tokenizer, registry(config))
}

/// [`rollouts_for`] over the environments of `registry`.
fn rollouts_with(
    config: &Config,
    template: ChatTemplate,
    tokenizer: &Arc<Tokenizer>,
    registry: Registry,
) -> Result<Rollouts> {
    Rollouts::new(
        template,
        Arc::clone(tokenizer),
        registry,
        config
            .environment
            .env_class
            .clone()
            .unwrap_or_else(|| floe_env::env::TEXT2SQL.to_string()),
        config.model.chat_template.enable_thinking,
        config.generator.max_turns,
        max_input_length(config),
        config.environment.max_env_workers,
    )
}

/// A run's prompts, tokenized, and which of them the warm start and RL learn from.
struct RunPrompts {
    /// Training prompts within `trainer.max_prompt_length`, in data order.
    train: Vec<Prompt>,
    /// Indices into `train` of the warm start's examples.
    sft: Vec<usize>,
    /// Indices into `train` of the prompts RL draws from; the data cursor walks these.
    rl: Vec<usize>,
    /// Validation prompts within `trainer.max_prompt_length`; none disables eval.
    val: Vec<Prompt>,
    /// Training rows dropped for their prompt length.
    dropped_train: usize,
    /// Validation rows dropped for their prompt length.
    dropped_val: usize,
}

impl RunPrompts {
    /// Tokenizes both splits, dropping prompts over `trainer.max_prompt_length`, and picks
    /// the warm start's examples.
    fn prepare(
        config: &Config,
        tokenizer: &Tokenizer,
        template: &ChatTemplate,
        train_rows: Vec<Row>,
        val_rows: Vec<Row>,
    ) -> Result<Self> {
        let enable_thinking = config.model.chat_template.enable_thinking;
        let max_prompt_length = config.trainer.max_prompt_length;
        let (train, dropped_train) = prepare_prompts(
            train_rows,
            tokenizer,
            template,
            enable_thinking,
            max_prompt_length,
        )?;
        let (val, dropped_val) = prepare_prompts(
            val_rows,
            tokenizer,
            template,
            enable_thinking,
            max_prompt_length,
        )?;
        // The warm start learns from the first rows (within its per-database caps); RL then
        // draws from all or only the rest.
        let labelled = labelled_rows(config, train.iter().map(|p| &p.row))?;
        let indexed = || (0..train.len()).zip(&labelled);
        let sft = indexed().filter_map(|(i, &l)| l.then_some(i)).collect();
        let rl = indexed()
            .filter_map(|(i, &l)| (config.sft.rl_on_examples || !l).then_some(i))
            .collect();
        Ok(Self {
            train,
            sft,
            rl,
            val,
            dropped_train,
            dropped_val,
        })
    }

    /// The warm start's examples.
    fn sft_prompts(&self) -> Vec<&Prompt> {
        self.sft.iter().map(|&i| &self.train[i]).collect()
    }

    /// The prompt at `position` of the RL prompts (a data cursor index).
    fn rl_prompt(&self, position: usize) -> &Prompt {
        &self.train[self.rl[position]]
    }

    /// RL steps of the run: `trainer.epochs` passes over the RL prompts in whole batches, at
    /// most `trainer.max_training_steps`. Fails when not one batch fits.
    fn total_steps(&self, t: &TrainerConfig) -> Result<u64> {
        let steps_per_epoch = self.rl.len() / t.train_batch_size;
        if steps_per_epoch == 0 {
            return Err(Error::Data(format!(
                "{} training prompts fit trainer.max_prompt_length = {} ({} dropped), \
                 fewer than trainer.train_batch_size = {}; add data, raise max_prompt_length \
                 or lower train_batch_size",
                self.rl.len(),
                t.max_prompt_length,
                self.dropped_train,
                t.train_batch_size
            )));
        }
        Ok(((t.epochs * steps_per_epoch) as u64).min(t.max_training_steps.unwrap_or(u64::MAX)))
    }

    /// The `data/...` metrics a fresh run logs at step 0.
    fn data_metrics(&self) -> BTreeMap<String, f64> {
        let rl_prompt_tokens: usize = self.rl.iter().map(|&i| self.train[i].ids.len()).sum();
        BTreeMap::from([
            ("data/num_train_prompts".to_string(), self.rl.len() as f64),
            ("data/num_val_prompts".to_string(), self.val.len() as f64),
            (
                "data/num_dropped_prompts".to_string(),
                (self.dropped_train + self.dropped_val) as f64,
            ),
            (
                "data/avg_prompt_tokens".to_string(),
                rl_prompt_tokens as f64 / self.rl.len() as f64,
            ),
        ])
    }
}

/// A run between its start and its finish: what the stages read and move forward.
struct Run<'a, E: Engine> {
    engine: &'a mut E,
    config: &'a Config,
    prompts: &'a RunPrompts,
    /// The rollout runner (environments, scoring pool) of training and eval.
    rollouts: Rollouts,
    /// How evals sample.
    eval_spec: EvalSpec,
    /// What the RL steps sample and update with.
    step_settings: StepSettings,
    /// What a checkpoint saves: the step, data cursor, optimiser steps, KL coefficient and
    /// the latest metrics.
    state: TrainerState,
    /// The run's ranks: each does its share of a step, rank 0 writes the files.
    ranks: Ranks,
    /// `metrics.jsonl` and TensorBoard; rank 0's only.
    sink: Option<MetricsSink>,
    /// RL steps of the whole run.
    total_steps: u64,
    /// `trainer.logger` includes the console, and this rank prints (rank 0).
    console: bool,
    /// Disk bytes of one checkpoint of a local engine, checked before each is written
    /// (`None` for a remote engine, whose state stays on its server).
    checkpoint_bytes: Option<u64>,
    /// One-step-off: the next step's batch, sampled during the last step.
    pending: Option<SampledBatch>,
}

impl<'a, E: Engine> Run<'a, E> {
    /// Restores the checkpoint `resume_from` (trainer state with its data cursor, the
    /// engine's weights and optimiser, report samples up to its step) or starts a fresh
    /// state, clearing an earlier run's outputs from the run directory; then opens the
    /// metrics sinks, which on resume keep only the checkpoint's steps. Every rank loads
    /// the same checkpoint; rank 0 alone touches the run directory's files.
    #[allow(clippy::too_many_arguments)]
    fn start(
        engine: &'a mut E,
        config: &'a Config,
        prompts: &'a RunPrompts,
        rollouts: Rollouts,
        ranks: Ranks,
        tokenizer: &Tokenizer,
        total_steps: u64,
        resume_from: Option<&Path>,
    ) -> Result<Self> {
        let t = &config.trainer;
        let writes = ranks.writes();
        let console = t.logger.contains(&Logger::Console) && writes;
        let mut state = match resume_from {
            Some(checkpoint) => restore(engine, checkpoint, &t.run_dir, console, writes)?,
            None => fresh_state(config, prompts.rl.len(), writes)?,
        };
        if state.data_cursor.len != prompts.rl.len() {
            return Err(Error::Checkpoint {
                path: resume_from.map(Path::to_path_buf).unwrap_or_default(),
                message: format!(
                    "its data cursor walks {} prompts but this run has {}; resume with the \
                     same data",
                    state.data_cursor.len,
                    prompts.rl.len()
                ),
            });
        }
        let pending = match resume_from {
            Some(checkpoint) => restore_pending(config, checkpoint, &mut state, total_steps)?,
            None => None,
        };
        let sink = match writes {
            true => Some(MetricsSink::create_with(
                &t.run_dir,
                resume_from.map(|_| state.global_step),
                &t.logger,
            )?),
            false => None,
        };
        Ok(Self {
            eval_spec: EvalSpec {
                params: engine_sampling_params(&config.generator.eval_sampling_params, tokenizer),
                k: config.generator.eval_n_samples_per_prompt,
                batch_size: t.eval_batch_size,
                seed: t.seed,
            },
            step_settings: StepSettings::new(config, tokenizer, total_steps, state.kl_coef),
            engine,
            config,
            prompts,
            rollouts,
            ranks,
            state,
            sink,
            total_steps,
            console,
            checkpoint_bytes: match config.engine.remote {
                Some(_) => None,
                None => Some(checkpoint_bytes(config)?),
            },
            pending,
        })
    }

    /// A fresh run before its first step: logs the data's size, runs the SFT warm start,
    /// freezes the reference model when a KL term needs one, and evaluates once
    /// (`trainer.eval_before_train`).
    fn fresh_start(&mut self, tokenizer: &Tokenizer) -> Result<()> {
        let data_metrics = self.prompts.data_metrics();
        self.log(0, &data_metrics)?;
        if self.config.sft.enabled {
            self.warm_start(tokenizer)?;
        }
        if uses_reference(&self.config.trainer.algorithm) {
            self.engine
                .freeze_reference()
                .map_err(Error::verb("freeze_reference"))?;
        }
        if self.config.trainer.eval_before_train && !self.prompts.val.is_empty() {
            self.state.initial_eval = self.eval(0)?;
        }
        Ok(())
    }

    /// The SFT warm start on the labelled prompts, each epoch printed and logged at step 0;
    /// then a fresh optimiser for RL.
    fn warm_start(&mut self, tokenizer: &Tokenizer) -> Result<()> {
        let examples = sft_examples(&self.prompts.sft_prompts(), tokenizer)?;
        let console = self.console;
        let (mut sink, state, ranks) = (self.sink.as_mut(), &mut self.state, &self.ranks);
        run_sft(
            self.engine,
            self.config,
            &examples,
            ranks,
            &mut |epoch_metrics| {
                if console {
                    println!(
                        "sft epoch {:>2}  loss {:.4}  ({:.1}s)",
                        epoch_metrics["sft/epoch"],
                        epoch_metrics["sft/loss"],
                        epoch_metrics["timing/sft"]
                    );
                }
                log_metrics(sink.as_deref_mut(), state, 0, &epoch_metrics)
            },
        )?;
        // RL is a new phase: AdamW's second moments from the warm start's larger gradients
        // would shrink its first steps.
        self.engine
            .reset_optimizer()
            .map_err(Error::verb("reset_optimizer"))
    }

    /// RL step `step`, logged and shown, then its eval and checkpoint when due; the eval's
    /// metrics when it evaluated.
    fn step_with_eval_and_checkpoint(
        &mut self,
        step: u64,
        progress: &Progress,
    ) -> Result<Option<BTreeMap<String, f64>>> {
        let metrics = self.rl_step(step)?;
        // Logged before the step's checkpoint, so a resume keeps exactly them.
        self.log(step, &metrics)?;
        progress.show_step(step, &metrics);
        let eval = match self.eval_due(step) {
            true => Some(progress.suspend(|| self.eval(step))?),
            false => None,
        };
        self.checkpoint_on_interval(step)?;
        Ok(eval)
    }

    /// After `error`: when the remote server lost the engine (it restarted), the run
    /// rewinds to its latest checkpoint as `trainer.resume=latest` would (engine state,
    /// trainer state, the batch sampled ahead, metrics and samples files) and goes on from
    /// there, at most `engine.max_remote_recoveries` times; any other error, or one without
    /// a checkpoint to go back to, is returned.
    fn recover(&mut self, mut error: Error, recoveries: &mut u32) -> Result<()> {
        let max = self.config.engine.max_remote_recoveries;
        let run_dir = &self.config.trainer.run_dir;
        loop {
            if !error.lost_remote_engine() || *recoveries >= max {
                return Err(error);
            }
            let Some(checkpoint) = latest_checkpoint(run_dir)? else {
                return Err(error);
            };
            *recoveries += 1;
            tracing::warn!(
                "{error}\nrewinding to {} and going on (recovery {recoveries} of \
                 engine.max_remote_recoveries = {max})",
                checkpoint.display()
            );
            // The server may go away again while the state loads.
            match self.rewind(&checkpoint) {
                Err(again) => error = again,
                done => return done,
            }
        }
    }

    /// Sets the engine and the run as a resume from `checkpoint` would.
    fn rewind(&mut self, checkpoint: &Path) -> Result<()> {
        let t = &self.config.trainer;
        let run_dir = &t.run_dir;
        let writes = self.ranks.writes();
        let mut state = restore(self.engine, checkpoint, run_dir, self.console, writes)?;
        self.pending = restore_pending(self.config, checkpoint, &mut state, self.total_steps)?;
        if writes {
            self.sink = Some(MetricsSink::create_with(
                run_dir,
                Some(state.global_step),
                &t.logger,
            )?);
        }
        self.step_settings.restore_kl(&t.algorithm, state.kl_coef);
        self.state = state;
        Ok(())
    }

    /// Logs `metrics` for `step` and remembers their latest values in the trainer state.
    fn log(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> Result<()> {
        log_metrics(self.sink.as_mut(), &mut self.state, step, metrics)
    }

    /// Whether `step` evaluates: there is validation data, and `step` is on
    /// `trainer.eval_interval` or the last.
    fn eval_due(&self, step: u64) -> bool {
        !self.prompts.val.is_empty()
            && (step == self.total_steps || on_interval(step, self.config.trainer.eval_interval))
    }

    /// Evaluates at `step`, records the generations, then prints and logs the metrics;
    /// returns them.
    fn eval(&mut self, step: u64) -> Result<BTreeMap<String, f64>> {
        let metrics = eval_and_record(
            self.engine,
            &mut self.rollouts,
            &self.prompts.val,
            &self.eval_spec,
            self.ranks.writes().then_some(&self.config.trainer.run_dir),
            step,
        )?;
        print_eval(self.console, step, &metrics);
        self.log(step, &metrics)?;
        Ok(metrics)
    }

    /// Saves the checkpoint of `step` when it is on `trainer.ckpt_interval` or the last.
    /// Across ranks, rank 0 prepares the folder, every rank saves its engine's state into
    /// it (rank 0 the replicated state, each rank its shard of a sharded optimizer), and
    /// rank 0 completes it.
    fn checkpoint_on_interval(&mut self, step: u64) -> Result<()> {
        let t = &self.config.trainer;
        if step == self.total_steps || on_interval(step, t.ckpt_interval) {
            let partial = self.ranks.from_rank_zero(|| {
                if let Some(bytes) = self.checkpoint_bytes {
                    check_checkpoint_space(self.config, bytes)?;
                }
                prepare_checkpoint(&t.run_dir, self.state.global_step)
            })?;
            save_engine_state(self.engine, &partial)?;
            if !self.ranks.writes() {
                return Ok(());
            }
            // A batch sampled for the next step is saved beside the state, whose cursor
            // stands before it (what a resume without the batch samples again).
            let state = match &self.pending {
                Some(next) => TrainerState {
                    data_cursor: next.cursor_before.clone(),
                    ..self.state.clone()
                },
                None => self.state.clone(),
            };
            commit_checkpoint(
                &t.run_dir,
                &partial,
                &state,
                self.pending.as_ref(),
                t.max_ckpts_to_keep,
            )?;
        }
        Ok(())
    }

    /// The end of the run: the final eval (`final_eval`, or on a run resumed after its last
    /// step's checkpoint the one in the saved metrics), the HTML report, the outcome.
    fn finish(
        self,
        mut final_eval: BTreeMap<String, f64>,
        resumed_from: Option<PathBuf>,
        started: Instant,
    ) -> Result<RunOutcome> {
        if final_eval.is_empty() && self.state.global_step == self.total_steps {
            // Resumed after the last step's checkpoint: its eval is in the saved metrics.
            final_eval = self
                .state
                .metrics
                .iter()
                .filter(|(k, _)| k.starts_with("eval/"))
                .map(|(k, v)| (k.clone(), *v))
                .collect();
        }
        let run_dir = self.config.trainer.run_dir.clone();
        let report = match self.ranks.writes() {
            true => report::write_report(&run_dir)?,
            false => run_dir.join(report::REPORT_FILE),
        };
        Ok(RunOutcome {
            run_dir,
            steps: self.state.global_step,
            initial_eval: self.state.initial_eval,
            final_eval,
            resumed_from,
            wall_seconds: started.elapsed().as_secs_f64(),
            report,
        })
    }
}

/// The trainer state of `checkpoint`, with the engine's state loaded from it and (when
/// this rank `writes`) the report samples of later steps dropped.
fn restore<E: Engine>(
    engine: &mut E,
    checkpoint: &Path,
    run_dir: &Path,
    console: bool,
    writes: bool,
) -> Result<TrainerState> {
    let state = load_trainer_state(checkpoint)?;
    engine
        .load_state(&checkpoint.join(ENGINE_DIR))
        .map_err(Error::verb("load_state"))?;
    if writes {
        keep_samples_up_to(run_dir, state.global_step)?;
    }
    if console {
        println!(
            "resumed from {} (step {})",
            checkpoint.display(),
            state.global_step
        );
    }
    Ok(state)
}

/// The batch a one-step-off checkpoint sampled ahead, with `state`'s cursor moved past
/// it, so the resumed run trains exactly what the uninterrupted one does. A sync run
/// drops it (and samples those prompts again from the saved cursor); a one-step-off run
/// resumed from a checkpoint without one samples them again too, with the checkpoint's
/// weights, and is told it no longer replays the uninterrupted run.
fn restore_pending(
    config: &Config,
    checkpoint: &Path,
    state: &mut TrainerState,
    total_steps: u64,
) -> Result<Option<SampledBatch>> {
    let one_step_off = config.trainer.pipeline.mode == PipelineMode::OneStepOff;
    let path = checkpoint.join(PENDING_BATCH_FILE);
    match load_pending_batch::<SampledBatch>(checkpoint)? {
        Some(batch) if one_step_off => {
            if batch.cursor_before != state.data_cursor
                || batch.policy_version > state.optimizer_steps
            {
                return Err(Error::Checkpoint {
                    path,
                    message: format!(
                        "its batch was drawn at data cursor {:?} by policy version {}, but the \
                         checkpoint's trainer state stands at {:?} after {} optimizer steps; \
                         the file belongs to another checkpoint",
                        batch.cursor_before,
                        batch.policy_version,
                        state.data_cursor,
                        state.optimizer_steps
                    ),
                });
            }
            state.data_cursor = batch.cursor_after.clone();
            Ok(Some(batch))
        }
        Some(_) => {
            tracing::warn!(
                "{}: trainer.pipeline.mode = sync drops the batch a one-step-off run sampled \
                 ahead; step {} samples those prompts again with the checkpoint's weights",
                path.display(),
                state.global_step + 1
            );
            Ok(None)
        }
        None => {
            if one_step_off && state.global_step < total_steps {
                tracing::warn!(
                    "{} has no {PENDING_BATCH_FILE} (a sync run's checkpoint, the last step \
                     of a shorter run, or one written before floe saved the batch sampled \
                     ahead): step {} samples its prompts again from the saved data cursor \
                     with the checkpoint's weights, so the run from here is not bit-identical \
                     to an uninterrupted one",
                    checkpoint.display(),
                    state.global_step + 1
                );
            }
            Ok(None)
        }
    }
}

/// The trainer state before step 1 of a fresh run over `num_rl_prompts` prompts; the
/// rank that `writes` clears an earlier run's outputs.
fn fresh_state(config: &Config, num_rl_prompts: usize, writes: bool) -> Result<TrainerState> {
    let t = &config.trainer;
    // A fresh run owns its directory: outputs of an earlier run there would mix in.
    if writes {
        for stale in [CHECKPOINTS_DIR, EVALS_DIR, SAMPLES_FILE] {
            remove_if_present(&t.run_dir.join(stale))?;
        }
    }
    Ok(TrainerState {
        global_step: 0,
        optimizer_steps: 0,
        data_cursor: DataCursor::new(num_rl_prompts, t.seed),
        seed: t.seed,
        kl_coef: KlController::new(&t.algorithm).coef,
        metrics: BTreeMap::new(),
        initial_eval: BTreeMap::new(),
    })
}

/// The console's view of the steps: a progress bar and, with the console logger, one
/// line per step.
struct Progress {
    bar: ProgressBar,
    console: bool,
    total_steps: u64,
}

impl Progress {
    /// A bar over `total_steps` steps, `done` of them already; hidden unless `shown`.
    fn new(console: bool, shown: bool, total_steps: u64, done: u64) -> Self {
        if !shown {
            return Self {
                bar: ProgressBar::hidden(),
                console,
                total_steps,
            };
        }
        let bar = ProgressBar::new(total_steps).with_style(
            ProgressStyle::with_template("grpo  {bar:30} {pos}/{len} {elapsed}<{eta} {msg}")
                .expect("a valid progress template"),
        );
        bar.set_position(done);
        Self {
            bar,
            console,
            total_steps,
        }
    }

    /// Moves the bar to `step` with its reward, length and time, and prints its line.
    fn show_step(&self, step: u64, metrics: &BTreeMap<String, f64>) {
        self.bar.set_position(step);
        self.bar.set_message(format!(
            "reward {:.3}  len {:.0}  {:.1}s/step",
            metrics[names::REWARD_AVG_RAW_REWARD],
            metrics[names::GENERATE_AVG_NUM_TOKENS],
            metrics["timing/step"]
        ));
        if self.console {
            // A hidden bar (output not a terminal) drops its println; print directly then.
            let line = step_line(step, self.total_steps, metrics);
            if self.bar.is_hidden() {
                println!("{line}");
            } else {
                self.bar.println(line);
            }
        }
    }

    /// Runs `f` with the bar hidden, so that what `f` prints is not drawn over.
    fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.bar.suspend(f)
    }

    /// Clears the bar.
    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// Logs `metrics` for `step` (into the sink of the rank that has one) and remembers
/// their latest values in the trainer state.
fn log_metrics(
    sink: Option<&mut MetricsSink>,
    state: &mut TrainerState,
    step: u64,
    metrics: &BTreeMap<String, f64>,
) -> Result<()> {
    if let Some(sink) = sink {
        sink.log(step, metrics)?;
    }
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

/// Evaluates and, given the run directory (rank 0), writes
/// `<run_dir>/evals/global_step_N.jsonl` and a few generations for the report; returns
/// the metrics.
fn eval_and_record<E: Engine>(
    engine: &mut E,
    rollouts: &mut Rollouts,
    prompts: &[Prompt],
    spec: &EvalSpec,
    run_dir: Option<&PathBuf>,
    step: u64,
) -> Result<BTreeMap<String, f64>> {
    let out = evaluate(engine, rollouts, prompts, spec, step)?;
    let Some(run_dir) = run_dir else {
        return Ok(out.metrics);
    };
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
    // Through a sibling and a rename: a run killed while resuming keeps the old file whole.
    let partial = run_dir.join(format!("{SAMPLES_FILE}.partial"));
    std::fs::write(&partial, kept).map_err(|source| Error::Io {
        path: partial.clone(),
        source,
    })?;
    std::fs::rename(&partial, &path).map_err(|source| Error::Io { path, source })
}

/// The console line of a finished step.
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

/// Prints an eval's headline metrics when the console logger is on.
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
