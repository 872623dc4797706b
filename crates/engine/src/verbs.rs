//! The engine's verbs: the one boundary between a caller (the RL loop, the server) and
//! whatever trains and samples the weights.
//!
//! The loop never touches a model or a device: it sends token ids and per-token training
//! inputs through [`Engine`] and gets token ids, log-probs and metrics back (token in,
//! token out). `LocalEngine` runs the verbs in this process on the CPU or a GPU; a remote
//! implementation sends the same requests to `floe serve` over HTTP, so the two must give
//! the same results for the same seed.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use floe_rl::tinker::TinkerLoss;
use floe_rl::AlgorithmConfig;
use serde::{Deserialize, Serialize};

use crate::policy::{OptimParams, StepOutcome};
use crate::sampler::{
    Generation, RequestIntake, SampleError, SampleEvent, SampleFeed, SampleFlow, SampleRequest,
};

/// What the loop needs to know about the engine's model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EngineInfo {
    /// The device, in words (e.g. `cpu (f32, 2 threads)`).
    pub device: String,
    /// Rows of the model's vocabulary.
    pub vocab_size: usize,
    /// Longest prompt plus response the engine accepts.
    pub max_seq_len: usize,
}

/// A prompt and responses to score; responses share the prompt.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SequenceGroup {
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// Response token ids, each scored given the prompt.
    pub responses: Vec<Vec<u32>>,
    /// Per response, what its positions score when that is not the response itself
    /// (see [`TrainResponse::targets`]); absent for ordinary scoring.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub targets: Option<Vec<Vec<u32>>>,
}

/// Per-token outputs of the model for one response.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenOutputs {
    /// `log π(token_i | prompt, tokens_<i)` at the requested temperature.
    pub logprobs: Vec<f64>,
    /// Entropy of the next-token distribution at each response position.
    pub entropy: Vec<f64>,
}

/// One response to train on, with its per-token inputs (all of `tokens.len()`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainResponse {
    /// Response token ids.
    pub tokens: Vec<u32>,
    /// 1 for tokens that train, 0 for the rest (observations of multi-turn envs).
    pub loss_mask: Vec<f64>,
    /// Per-token advantages (policy loss only).
    pub advantages: Vec<f64>,
    /// Log-probs of the weights before this batch's first update (policy loss only).
    pub old_logprobs: Vec<f64>,
    /// Log-probs reported by the sampler, for off-policy correction.
    pub rollout_logprobs: Option<Vec<f64>>,
    /// Log-probs of the frozen reference model, for a KL loss.
    pub ref_logprobs: Option<Vec<f64>>,
    /// What each position scores when that is not the response itself: position `i`,
    /// having read the prompt and `tokens[..i]`, scores `targets[i]` (Tinker datums whose
    /// `target_tokens` are any tokens, not the input shifted by one). `None`: position
    /// `i` scores `tokens[i]`, as sampled responses do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub targets: Option<Vec<u32>>,
}

/// A prompt and the responses to train on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainGroup {
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// The group's responses.
    pub responses: Vec<TrainResponse>,
}

/// The loss a [`Engine::forward_backward`] call differentiates. One call is one
/// mini-batch: reductions use the totals of the whole call, however the engine splits it
/// into micro-batches.
// One value per call: boxing the config would only burden every caller.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Loss {
    /// floe's RL policy loss (`floe_rl::compute_policy_loss`) with this configuration.
    Policy(AlgorithmConfig),
    /// Supervised fine-tuning: mean negative log-likelihood over the masked tokens.
    CrossEntropy,
    /// A Tinker `loss_fn` (`floe_rl::tinker`): a plain sum over tokens and responses.
    /// Each response's `loss_mask` carries Tinker's `weights` (any real), `old_logprobs`
    /// the sampler's log-probs and `advantages` the advantages.
    Tinker {
        /// Which loss.
        loss: TinkerLoss,
        /// Lower ratio bound of the clipped losses (Tinker's default 0.8).
        clip_low_threshold: f64,
        /// Upper ratio bound of the clipped losses (Tinker's default 1.2).
        clip_high_threshold: f64,
        /// `dro`'s quadratic penalty (Tinker's default 0.05).
        #[serde(default = "default_dro_beta")]
        beta: f64,
    },
}

fn default_dro_beta() -> f64 {
    floe_rl::tinker::TinkerLossConfig::default().beta
}

/// Which weights a [`Engine::forward`] reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Weights {
    /// The weights being trained.
    Policy,
    /// The frozen reference set by [`Engine::freeze_reference`].
    Reference,
}

/// Result of a [`Engine::forward_backward`] call.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ForwardBackwardOutput {
    /// The loss of the call.
    pub loss: f64,
    /// Loss diagnostics (`policy/*` names), combined over micro-batches.
    pub metrics: BTreeMap<String, f64>,
}

/// The verbs the RL loop uses. Gradients accumulate across `forward_backward` calls
/// until `optim_step`.
///
/// Notes for callers (the local engine, [`crate::LocalEngine`], behaves so):
/// - `temperature` of `forward` and `forward_backward` is the sampling temperature
///   (log-probs of `softmax(logits / temperature)`); 0 (greedy) scores at temperature 1,
///   the temperature the sampler reports greedy log-probs at.
/// - A call's groups are packed into micro-batches by token count; scores of the same
///   groups are bit-identical only under the same packing. For PPO's
///   `policy/ppo_kl == 0` on the first update, compute `old_logprobs` with `forward`
///   over exactly the groups of the `forward_backward` call; a different grouping can
///   differ by float rounding (about 1e-6).
/// - `save_state` also saves the frozen reference, and `load_state` restores it exactly
///   when one was saved.
pub trait Engine {
    /// The error of every verb.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Device and model facts.
    fn info(&self) -> &EngineInfo;
    /// Samples every request, calling `on_generation` as each sample finishes (so
    /// scoring overlaps generation); returns when all are done.
    fn sample(
        &mut self,
        requests: Vec<SampleRequest>,
        on_generation: &mut dyn FnMut(Generation),
    ) -> Result<(), Self::Error>;
    /// [`Engine::sample`] for a caller that streams: `on_event` also gets each running
    /// sample's tokens as they are decoded ([`SampleEvent::Progress`]), then each finished
    /// sample; answering a progress [`SampleFlow::Cancel`] stops that request's samples
    /// (never reported as finished). An engine that cannot report progress (the default)
    /// reports finished samples only, and so cancels nothing.
    fn sample_streaming(
        &mut self,
        requests: Vec<SampleRequest>,
        on_event: &mut dyn FnMut(SampleEvent<'_>) -> SampleFlow,
    ) -> Result<(), Self::Error> {
        self.sample(requests, &mut |generation| {
            on_event(SampleEvent::Finished(generation));
        })
    }
    /// A streaming sample that takes requests while it runs: before every engine step
    /// the engine asks `feed` for more ([`SampleFeed::poll`]) and mixes their prefill into
    /// the next step of its continuous batch, reports every request's events to `feed`
    /// (progress when [`SampleFeed::wants_progress`]), and returns once a poll leaves
    /// nothing unfinished. Each submitted request is checked on its own: a refused one is
    /// an error of that submission, and the batch goes on. A joined request samples the
    /// tokens it would sample alone (the sampler's determinism: a sample's random stream
    /// depends on its request's seed and its index, not on when it joined).
    ///
    /// An engine that cannot take requests mid-run (the default, and so the remote
    /// engine) polls `feed` once, accepting every request unchecked, and samples them as
    /// one [`Engine::sample_streaming`] call (or [`Engine::sample`] when no progress is
    /// wanted): later requests stay with the feed for the next call, and a request the
    /// engine refuses fails the whole call.
    fn sample_joining(&mut self, feed: &mut dyn SampleFeed) -> Result<(), Self::Error> {
        let mut taken = TakeAll(Vec::new());
        feed.poll(&mut taken);
        let TakeAll(requests) = taken;
        if requests.is_empty() {
            return Ok(());
        }
        if feed.wants_progress() {
            self.sample_streaming(requests, &mut |event| feed.on_event(event))
        } else {
            self.sample(requests, &mut |generation| {
                feed.on_event(SampleEvent::Finished(generation));
            })
        }
    }
    /// Per-token log-probs and entropies of each group's responses, in order.
    fn forward(
        &mut self,
        groups: &[SequenceGroup],
        weights: Weights,
        temperature: f32,
    ) -> Result<Vec<Vec<TokenOutputs>>, Self::Error>;
    /// Forward and backward of one mini-batch under `loss`; gradients accumulate.
    fn forward_backward(
        &mut self,
        groups: &[TrainGroup],
        loss: &Loss,
        temperature: f32,
    ) -> Result<ForwardBackwardOutput, Self::Error>;
    /// Applies the accumulated gradients and clears them.
    fn optim_step(&mut self, params: &OptimParams) -> Result<StepOutcome, Self::Error>;
    /// Makes the sampler use the latest trained weights; returns how long it took.
    fn sync_sampler_weights(&mut self) -> Result<Duration, Self::Error>;
    /// Freezes a copy of the current weights as the reference model.
    fn freeze_reference(&mut self) -> Result<(), Self::Error>;
    /// Starts a fresh optimizer: moments and step count cleared, weights kept.
    fn reset_optimizer(&mut self) -> Result<(), Self::Error>;
    /// Writes weights and optimizer state into `dir` (atomically).
    fn save_state(&mut self, dir: &Path) -> Result<(), Self::Error>;
    /// Restores what [`Engine::save_state`] wrote.
    fn load_state(&mut self, dir: &Path) -> Result<(), Self::Error>;
    /// Writes the weights as a Hugging Face folder that transformers loads.
    fn export_hf(&mut self, dir: &Path) -> Result<(), Self::Error>;

    /// Runs `sampling` (generation) beside `training` (forwards and backwards), both on
    /// the current weights, and returns what each returned. Neither side can change the
    /// weights (each gets only its verbs), so every sample and every gradient of the call
    /// comes from one policy version; the caller's next `optim_step` comes after both.
    /// Results equal those of running the two sides one after the other, which is what
    /// this default does; the local engine on the CPU runs them on two threads.
    fn overlap<RS: Send, RT>(
        &mut self,
        sampling: impl FnOnce(&mut dyn SamplingSide<Error = Self::Error>) -> RS + Send,
        training: impl FnOnce(&mut dyn TrainingSide<Error = Self::Error>) -> RT,
    ) -> Result<(RS, RT), Self::Error>
    where
        Self: Sized,
    {
        Ok(one_after_the_other(self, sampling, training))
    }
}

/// [`Engine::sample_joining`]'s one poll where the engine takes no requests mid-run:
/// every request is taken as it is, to be checked when the engine samples them.
struct TakeAll(Vec<SampleRequest>);

impl RequestIntake for TakeAll {
    fn check(&self, _request: &SampleRequest) -> Result<(), SampleError> {
        Ok(())
    }

    fn submit(&mut self, request: SampleRequest) -> Result<(), SampleError> {
        self.0.push(request);
        Ok(())
    }
}

/// The sampling verb alone: the side of [`Engine::overlap`] that generates.
pub trait SamplingSide {
    /// The error of the verb.
    type Error: std::error::Error + Send + Sync + 'static;

    /// [`Engine::sample`].
    fn sample(
        &mut self,
        requests: Vec<SampleRequest>,
        on_generation: &mut dyn FnMut(Generation),
    ) -> Result<(), Self::Error>;
}

/// The verbs that read the policy's weights without changing them: the side of
/// [`Engine::overlap`] that trains (gradients accumulate; no optimizer step).
pub trait TrainingSide {
    /// The error of the verbs.
    type Error: std::error::Error + Send + Sync + 'static;

    /// [`Engine::forward`].
    fn forward(
        &mut self,
        groups: &[SequenceGroup],
        weights: Weights,
        temperature: f32,
    ) -> Result<Vec<Vec<TokenOutputs>>, Self::Error>;

    /// [`Engine::forward_backward`].
    fn forward_backward(
        &mut self,
        groups: &[TrainGroup],
        loss: &Loss,
        temperature: f32,
    ) -> Result<ForwardBackwardOutput, Self::Error>;
}

impl<E: Engine> SamplingSide for E {
    type Error = E::Error;

    fn sample(
        &mut self,
        requests: Vec<SampleRequest>,
        on_generation: &mut dyn FnMut(Generation),
    ) -> Result<(), E::Error> {
        Engine::sample(self, requests, on_generation)
    }
}

impl<E: Engine> TrainingSide for E {
    type Error = E::Error;

    fn forward(
        &mut self,
        groups: &[SequenceGroup],
        weights: Weights,
        temperature: f32,
    ) -> Result<Vec<Vec<TokenOutputs>>, E::Error> {
        Engine::forward(self, groups, weights, temperature)
    }

    fn forward_backward(
        &mut self,
        groups: &[TrainGroup],
        loss: &Loss,
        temperature: f32,
    ) -> Result<ForwardBackwardOutput, E::Error> {
        Engine::forward_backward(self, groups, loss, temperature)
    }
}

/// [`Engine::overlap`] without overlap: `sampling`, then `training`, on `engine`.
pub fn one_after_the_other<E: Engine, RS, RT>(
    engine: &mut E,
    sampling: impl FnOnce(&mut dyn SamplingSide<Error = E::Error>) -> RS,
    training: impl FnOnce(&mut dyn TrainingSide<Error = E::Error>) -> RT,
) -> (RS, RT) {
    let sampled = sampling(engine);
    let trained = training(engine);
    (sampled, trained)
}
