//! Rollouts: prompts in, scored trajectories out.
//!
//! Each trajectory is one request of one sample to [`floe_engine::Engine::sample`], seeded from
//! `(run seed, step, prompt, sample, turn)` so a run (or a resumed run) draws the same
//! samples whatever else is in flight. As each sample finishes, its environment step is
//! handed to the streaming [`Scorer`], so SQL execution overlaps generation. Multi-turn
//! environments loop sample → step until done: observations are tokenized with the
//! fixed-base chat-template trick (SkyRL's default) and appended with loss mask 0.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use floe_backend::sampling::{mix64, GAMMA};
use floe_engine::native_api::{float, float_map};
use floe_engine::{Generation, SampleRequest, SamplingParams as EngineSamplingParams, StopReason};
use floe_env::env::{Env, EnvError, Message, Registry, StepOutput};
use floe_env::scoring::Scorer;
use floe_model::chat_template::ChatTemplate;
use floe_model::tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};

use crate::config::RecipeSamplingParams;
use crate::data::{render_messages, Prompt};
use crate::error::{Error, Result};
use crate::ranks::Ranks;
use floe_engine::SamplingSide;

/// The conversation the fixed-base trick renders observations after (SkyRL's).
const BASE_CONVERSATION: [(&str, &str); 2] = [
    ("system", "You are a helpful assistant."),
    ("user", "I am a user."),
];

/// A seed from several parts (run seed, step, prompt, …): SplitMix64's finaliser folded
/// over the parts, so nearby inputs give unrelated seeds.
pub fn derive_seed(parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(GAMMA, |acc, &part| mix64(acc ^ part.wrapping_add(GAMMA)))
}

/// The engine's sampling parameters for a config section: stop at the tokenizer's
/// end-of-sequence ids or a stop string (kept in the text, as SkyRL does).
pub fn engine_sampling_params(
    params: &RecipeSamplingParams,
    tokenizer: &Tokenizer,
) -> EngineSamplingParams {
    EngineSamplingParams {
        temperature: params.temperature as f32,
        top_p: params.top_p as f32,
        top_k: params.top_k.max(0) as i32,
        min_p: params.min_p as f32,
        max_new_tokens: params.max_generate_length,
        stop_token_ids: tokenizer.eos_token_ids.clone(),
        stop_strings: params.stop.clone(),
        include_stop_str_in_output: true,
        seed: None,
        logprobs: params.logprobs > 0,
        top_logprobs: 0,
        force_full_length: false,
    }
}

/// What stays the same from one rollout to the next.
pub struct Rollouts {
    /// Renders prompts and observations.
    pub template: ChatTemplate,
    /// Encodes observations, decodes completions.
    pub tokenizer: Arc<Tokenizer>,
    /// Builds each row's environment.
    pub registry: Registry,
    /// `environment.env_class`: the environment of rows that name none.
    pub default_env: String,
    /// `model.chat_template.enable_thinking`.
    pub enable_thinking: bool,
    /// `generator.max_turns`.
    pub max_turns: usize,
    /// Longest conversation, in tokens, before another turn is refused.
    pub max_input_length: usize,
    /// The run's ranks: each samples and scores its share of a rollout's samples.
    ranks: Ranks,
    scorer: Scorer<(Box<dyn Env>, std::result::Result<StepOutput, EnvError>)>,
}

/// One scored trajectory: a prompt and the model's turns (with observations between them).
/// Serde with exact floats (non-finite ones included): the batch a one-step-off checkpoint
/// holds, and the exchange among ranks.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Trajectory {
    /// Index of its prompt in the rollout's prompt list.
    pub prompt: usize,
    /// Which sample of that prompt.
    pub sample: usize,
    /// Prompt token ids (the environment's first prompt, rendered).
    pub prompt_ids: Vec<u32>,
    /// Response token ids: generated tokens and, multi-turn, observation tokens.
    pub response: Vec<u32>,
    /// 1 on generated tokens, 0 on observation tokens.
    #[serde(with = "crate::checkpoint::float_vec")]
    pub loss_mask: Vec<f64>,
    /// Each turn's reward on the last token of that turn.
    #[serde(with = "crate::checkpoint::float_vec")]
    pub token_rewards: Vec<f64>,
    /// The sampler's log-probs (0 on observation tokens); empty if not requested.
    #[serde(with = "crate::checkpoint::float_vec")]
    pub rollout_logprobs: Vec<f64>,
    /// Total reward (sum over turns).
    #[serde(with = "float")]
    pub reward: f64,
    /// The decoded response, turns and observations in order.
    pub text: String,
    /// Environment metrics, averaged over the turns.
    #[serde(with = "float_map")]
    pub env_metrics: BTreeMap<String, f64>,
    /// The environment that scored it.
    pub env_class: String,
    /// Model turns taken.
    pub turns: usize,
    /// Whether the last model turn stopped at its token limit rather than at a stop token
    /// or string (what DAPO's overlong filtering drops).
    pub truncated: bool,
    /// The policy version (RL optimizer steps taken) of the weights that sampled it; the
    /// RL step that samples it sets it (0 from [`Rollouts::run`] alone).
    pub policy_version: u64,
}

/// Seconds spent generating and then waiting on scoring that had not overlapped.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct RolloutTiming {
    /// Wall time inside [`floe_engine::Engine::sample`].
    pub generate: f64,
    /// Wall time waiting for environment steps after sampling returned.
    pub score: f64,
}

/// A trajectory in progress.
struct Live {
    env: Option<Box<dyn Env>>,
    trajectory: Trajectory,
    turn_metrics: Vec<BTreeMap<String, f64>>,
    /// Prompt plus response so far, the context of the next turn.
    context: Vec<u32>,
    done: bool,
}

impl Rollouts {
    /// A rollout runner scoring on `env_workers` threads.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        template: ChatTemplate,
        tokenizer: Arc<Tokenizer>,
        registry: Registry,
        default_env: String,
        enable_thinking: bool,
        max_turns: usize,
        max_input_length: usize,
        env_workers: usize,
    ) -> Result<Self> {
        Ok(Self {
            template,
            tokenizer,
            registry,
            default_env,
            enable_thinking,
            max_turns: max_turns.max(1),
            max_input_length,
            ranks: Ranks::single(),
            scorer: Scorer::new(env_workers)?,
        })
    }

    /// Rollouts shared among `ranks`: each samples and scores its share of the samples
    /// ([`Ranks::sampling_share`]) and [`Rollouts::run`] gathers every rank's.
    pub fn with_ranks(self, ranks: Ranks) -> Self {
        Self { ranks, ..self }
    }

    /// Samples `n` trajectories of every prompt and scores them; output is ordered by
    /// (prompt, sample). `seed` keys this rollout (e.g. derived from run seed and step).
    /// Among several ranks each samples its share and every rank returns all of them, as
    /// one process samples them (up to the float rounding of other batch shapes); the
    /// timing is this rank's.
    pub fn run<S: SamplingSide + ?Sized>(
        &mut self,
        engine: &mut S,
        prompts: &[&Prompt],
        n: usize,
        params: &EngineSamplingParams,
        seed: u64,
    ) -> Result<(Vec<Trajectory>, RolloutTiming)> {
        let prompt_lens: Vec<usize> = prompts.iter().map(|p| p.ids.len()).collect();
        let mut live = Vec::with_capacity(prompts.len() * n);
        for (p, samples) in self.ranks.sampling_share(&prompt_lens, n) {
            for k in samples {
                live.push(self.start(p, k, prompts[p])?);
            }
        }
        let mut timing = RolloutTiming::default();
        for turn in 0..self.max_turns {
            let requests: Vec<SampleRequest> = live
                .iter()
                .enumerate()
                .filter(|(_, l)| !l.done)
                .map(|(id, l)| SampleRequest {
                    id: id as u64,
                    prompt: l.context.clone(),
                    n: 1,
                    params: EngineSamplingParams {
                        seed: Some(derive_seed(&[
                            seed,
                            l.trajectory.prompt as u64,
                            l.trajectory.sample as u64,
                            turn as u64,
                        ])),
                        max_new_tokens: params
                            .max_new_tokens
                            .min(self.max_input_length.saturating_sub(l.context.len()))
                            .max(1),
                        ..params.clone()
                    },
                })
                .collect();
            if requests.is_empty() {
                break;
            }
            let start = Instant::now();
            let mut failed = None;
            let tokenizer = Arc::clone(&self.tokenizer);
            let scorer = &mut self.scorer;
            let live_ref = &mut live;
            let sampled = engine.sample(requests, &mut |generation: Generation| {
                if failed.is_some() {
                    return;
                }
                let id = generation.request_id;
                let l = &mut live_ref[id as usize];
                let text = match append_generation(l, &generation, &tokenizer) {
                    Ok(text) => text,
                    Err(err) => {
                        failed = Some(err);
                        return;
                    }
                };
                let mut env = l.env.take().expect("a live trajectory holds its env");
                scorer.submit(id, move || {
                    let out = env.step(&text);
                    (env, out)
                });
            });
            if let Err(err) = sampled {
                // The scoring of the samples delivered before the failure must not reach
                // the next rollout (a run that recovers from a lost remote engine goes on).
                self.scorer.drain();
                return Err(Error::EngineVerb {
                    verb: "sample",
                    source: Box::new(err),
                });
            }
            timing.generate += start.elapsed().as_secs_f64();
            let start = Instant::now();
            let scored = self.scorer.drain();
            timing.score += start.elapsed().as_secs_f64();
            if let Some(err) = failed {
                return Err(err);
            }
            for done in scored {
                let l = &mut live[done.id as usize];
                match done.result {
                    Ok((env, step)) => {
                        l.env = Some(env);
                        self.finish_turn(l, step?, turn + 1)?;
                    }
                    // A panicking environment (a bug in its scoring) loses its trajectory's
                    // reward, not the run: the trajectory ends with what it has.
                    Err(err) => {
                        tracing::warn!("{err}; the trajectory ends unscored");
                        l.trajectory.turns = turn + 1;
                        l.turn_metrics
                            .push(BTreeMap::from([("scoring_panicked".to_string(), 1.0)]));
                        l.done = true;
                    }
                }
            }
        }
        let trajectories: Vec<Trajectory> = live
            .into_iter()
            .map(|l| {
                let mut trajectory = l.trajectory;
                trajectory.env_metrics = floe_env::env::aggregate_metrics(&l.turn_metrics);
                trajectory
            })
            .collect();
        if self.ranks.world_size() == 1 {
            return Ok((trajectories, timing));
        }
        let mut all: Vec<Trajectory> = self
            .ranks
            .all_gather(trajectories)?
            .into_iter()
            .flatten()
            .collect();
        all.sort_by_key(|t| (t.prompt, t.sample));
        Ok((all, timing))
    }

    fn start(&self, p: usize, k: usize, prompt: &Prompt) -> Result<Live> {
        let row = &prompt.row;
        let env_class = row
            .env_class
            .clone()
            .unwrap_or_else(|| self.default_env.clone());
        let mut extras = row.extras.clone();
        // SkyRL passes generator.max_turns to every env through its extras.
        if let Some(map) = extras.as_object_mut() {
            map.entry("max_turns")
                .or_insert_with(|| serde_json::json!(self.max_turns));
        }
        let mut env = self.registry.make(&env_class, &extras)?;
        let first = env.init(&row.prompt)?;
        let prompt_ids = if first == row.prompt {
            prompt.ids.clone()
        } else {
            let text = render_messages(&self.template, &first, true, self.enable_thinking)?;
            self.tokenizer.encode(&text, false)?
        };
        Ok(Live {
            env: Some(env),
            context: prompt_ids.clone(),
            trajectory: Trajectory {
                prompt: p,
                sample: k,
                prompt_ids,
                response: Vec::new(),
                loss_mask: Vec::new(),
                token_rewards: Vec::new(),
                rollout_logprobs: Vec::new(),
                reward: 0.0,
                text: String::new(),
                env_metrics: BTreeMap::new(),
                env_class,
                turns: 0,
                truncated: false,
                policy_version: 0,
            },
            turn_metrics: Vec::new(),
            done: false,
        })
    }

    /// Records a turn's step: its reward on the turn's last token, then (not done) the
    /// observation tokens, or the end of the episode when no further turn fits.
    fn finish_turn(&self, l: &mut Live, step: StepOutput, turns: usize) -> Result<()> {
        let t = &mut l.trajectory;
        t.turns = turns;
        t.reward += step.reward;
        if let Some(last) = t.token_rewards.last_mut() {
            *last += step.reward;
        }
        l.turn_metrics.push(step.metrics);
        if step.done || turns >= self.max_turns {
            l.done = true;
            return Ok(());
        }
        let eos = self.tokenizer.eos_token_ids.first().copied();
        let mut observation = Vec::new();
        // A turn cut by a stop string gets the end-of-turn token the template expects,
        // outside the loss (SkyRL's generator does the same).
        if let Some(eos) = eos {
            if t.response.last() != Some(&eos) {
                observation.push(eos);
            }
        }
        observation.extend(self.observation_tokens(&step.observations)?);
        if l.context.len() + observation.len() >= self.max_input_length {
            l.done = true;
            return Ok(());
        }
        t.text.push_str(&self.tokenizer.decode(&observation, true)?);
        l.context.extend_from_slice(&observation);
        t.response.extend_from_slice(&observation);
        t.loss_mask
            .extend(std::iter::repeat_n(0.0, observation.len()));
        t.token_rewards
            .extend(std::iter::repeat_n(0.0, observation.len()));
        if !t.rollout_logprobs.is_empty() {
            t.rollout_logprobs
                .extend(std::iter::repeat_n(0.0, observation.len()));
        }
        Ok(())
    }

    /// The tokens that follow an assistant turn's end token for `observations`: the
    /// template's rendering of base + observations (with the next generation prompt)
    /// minus that of the base alone, after the newline the template puts after a turn.
    fn observation_tokens(&self, observations: &[Message]) -> Result<Vec<u32>> {
        let base: Vec<Message> = BASE_CONVERSATION
            .iter()
            .map(|(role, content)| Message::new(*role, *content))
            .collect();
        let with: Vec<Message> = base.iter().chain(observations).cloned().collect();
        let base_text = render_messages(&self.template, &base, false, self.enable_thinking)?;
        let with_text = render_messages(&self.template, &with, true, self.enable_thinking)?;
        let tail = with_text.strip_prefix(&base_text).ok_or_else(|| {
            Error::Data(
                "the chat template renders a conversation differently once messages are added; \
                 multi-turn observations cannot be tokenized with the fixed-base trick"
                    .into(),
            )
        })?;
        Ok(self.tokenizer.encode(&format!("\n{tail}"), false)?)
    }
}

/// Appends a finished generation to its trajectory (all generated tokens train) and
/// returns the turn's text (the sampler's, when it detokenized for stop strings): what the
/// environment steps on.
fn append_generation(
    l: &mut Live,
    generation: &Generation,
    tokenizer: &Tokenizer,
) -> Result<String> {
    let t = &mut l.trajectory;
    let n = generation.tokens.len();
    if !generation.logprobs.is_empty() {
        if generation.logprobs.len() != n {
            return Err(Error::Data(format!(
                "sample of request {} has {} log-probs for {n} tokens",
                generation.request_id,
                generation.logprobs.len()
            )));
        }
        t.rollout_logprobs
            .extend(generation.logprobs.iter().map(|&lp| f64::from(lp)));
    }
    let text = match &generation.text {
        Some(text) => text.clone(),
        None => tokenizer.decode(&generation.tokens, true)?,
    };
    t.truncated = generation.stop_reason == StopReason::Length;
    t.text.push_str(&text);
    t.response.extend_from_slice(&generation.tokens);
    t.loss_mask.extend(std::iter::repeat_n(1.0, n));
    t.token_rewards.extend(std::iter::repeat_n(0.0, n));
    l.context.extend_from_slice(&generation.tokens);
    Ok(text)
}
