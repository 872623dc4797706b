//! Continuous batching over a paged KV cache.
//!
//! A [`Sampler`] keeps a queue of [`SampleRequest`]s (a prompt and `n` samples each)
//! and advances every admitted sequence by one [`Sampler::step`]: one model call over a
//! packed list of tokens in which running sequences decode one token each and
//! prefilling sequences contribute chunks of their prompt, all under
//! `max_tokens_per_step`. New requests are admitted first-come first-served while KV
//! blocks, the sequence limit and the step's token budget allow. Finished samples are
//! handed to a callback the moment they finish, so scoring can start while the rest
//! still generate; [`Sampler::generate`] wraps it all into a blocking call.
//!
//! # Requests that join a running batch
//! [`Sampler::run_feed`] asks a [`SampleFeed`] for new requests before every step (a
//! server's clients that arrive while the batch runs): they queue behind the others and
//! are admitted like any request, their prefill mixed into the next step, so a late
//! request neither waits for the batch to end nor stalls it. A request the feed submits
//! is checked on its own; a refused one is the feed's error alone, never the batch's.
//!
//! # Prefix sharing
//! Samples that start together with one prompt (the samples of a request, and of the
//! requests queued right behind it with the same prompt) share the KV of the prompt's
//! full blocks: a prefill-only sequence computes them once, and each sample then
//! recomputes only the prompt's last partial block (between 1 and `block_size` tokens)
//! in a block of its own before decoding (see [`crate::kv_blocks`]). Decoding samples
//! stay next to each other in the step's tokens, so the model finds them as a group
//! sharing those blocks and a backend may read the prompt's keys once for all of them
//! ([`floe_backend::PagedLayout::shared`]).
//!
//! # Determinism
//! Each sample draws token `i` with `(seed, offset = i)` from the backend's
//! counter-based generator ([`floe_backend::SamplingRow`]), where the seed depends only
//! on the request's `seed` and the sample's index. A sample's tokens therefore do not
//! depend on what else is in the batch, on chunking, on preemption or on the step a
//! request joined a running batch at, as long as the model's logits for a row do not
//! (exactly true on the CPU backend).
//!
//! # Speculative decoding
//! With [`SamplerConfig::speculative`], a decoding sample that finds a prompt-lookup
//! draft runs its last token and the draft as one chunk, gets logits for each of its
//! rows, and keeps the sampled tokens through the first that differs from the draft (see
//! [`crate::speculative`]: the tokens are the ones it would sample without speculation).
//! Drafts take what is left of the step's token budget after every decode, before
//! prefill, and only blocks beyond the one-per-sample reserve below, so they never
//! preempt; the keys and values of rejected draft tokens are overwritten later.
//!
//! # Running out of blocks
//! Admission reserves the blocks a sequence needs for its prompt, and while others run it
//! also leaves one free block per running sample; decoding grows tables a block at a
//! time. When a decoding sequence needs a block and none is free, the most
//! recently admitted sample is preempted: its blocks are freed and it goes back to the
//! front of the queue with its tokens so far, to be recomputed by prefill when blocks
//! free up (vLLM's recompute preemption). Because [`Sampler::submit`] rejects any request
//! whose single sample could not fit the whole cache, the oldest sequence always makes
//! progress.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use floe_backend::sampling::{mix64, GAMMA};
use floe_backend::{Backend, SamplingRow};
pub use floe_model::decode::CachedInput;
use floe_model::decode::KvCache;
use floe_model::transformer::{ModelError, Transformer};
use serde::{Deserialize, Serialize};

use crate::kv_blocks::{BlockManager, BlockTable};
use crate::speculative::{kept_tokens, NgramSpec};
use crate::stop::{Stop, StopConditions, StopReason};

/// Most samples one request may ask for: beyond it, a typo or a hostile client would keep
/// the engine busy for good (a GRPO group is 8 to 64).
pub const MAX_SAMPLES_PER_REQUEST: usize = 1 << 14;

/// A model that runs a packed list of new tokens against a paged KV cache.
///
/// `forward_cached` writes the keys and values of every token of `input` at its slot
/// (all of them, in every layer, before any attention of that layer reads the cache),
/// then attends each token over its sequence's cached positions, and returns the
/// Compute logits `[input.logit_rows.len(), vocab_size]`.
pub trait CachedModel {
    /// The device the model runs on.
    type Backend: Backend;
    /// The per-layer key/value caches.
    type Cache;
    /// What a forward can fail with.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The backend, used to sample from the returned logits.
    fn backend(&self) -> &Self::Backend;
    /// Rows of the logits.
    fn vocab_size(&self) -> usize;
    /// A cache of `num_blocks` blocks of `block_size` token slots.
    fn new_cache(&self, num_blocks: usize, block_size: usize) -> Result<Self::Cache, Self::Error>;
    /// One cached forward; see the trait docs.
    fn forward_cached(
        &self,
        cache: &mut Self::Cache,
        input: &CachedInput,
    ) -> Result<<Self::Backend as Backend>::Buf, Self::Error>;
}

/// How to sample one request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Nucleus threshold; 1.0 disables.
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens; 0 or less disables.
    pub top_k: i32,
    /// Drop tokens below `min_p ×` the top probability; 0 disables.
    pub min_p: f32,
    /// Most tokens to generate per sample.
    pub max_new_tokens: usize,
    /// Token ids that end a sample (the stop token is kept as its last token).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end a sample when they appear in its detokenized text.
    pub stop_strings: Vec<String>,
    /// Keep the matched stop string at the end of [`Generation::text`] (vLLM's
    /// `include_stop_str_in_output`); the text is cut before it otherwise.
    pub include_stop_str_in_output: bool,
    /// Seed of the request's random streams; `None` derives one from the sampler's seed
    /// and the submission order (reproducible only for the same sequence of submissions).
    pub seed: Option<u64>,
    /// Return each token's log-probability.
    pub logprobs: bool,
    /// Also return, for each token, this many of the most likely tokens and their
    /// log-probs (OpenAI's `top_logprobs`; see [`floe_backend::Sampled::top_logprobs`]).
    pub top_logprobs: usize,
    /// Ignore stop tokens and strings and always generate `max_new_tokens` (benchmarks).
    pub force_full_length: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            max_new_tokens: 256,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            include_stop_str_in_output: false,
            seed: None,
            logprobs: true,
            top_logprobs: 0,
            force_full_length: false,
        }
    }
}

/// A prompt to complete `n` times.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SampleRequest {
    /// Caller's id, echoed in each [`Generation`].
    pub id: u64,
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// Number of independent samples.
    pub n: usize,
    /// Sampling parameters shared by the samples.
    pub params: SamplingParams,
}

/// One finished sample.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    /// The request's id.
    pub request_id: u64,
    /// Which of the request's `n` samples.
    pub sample_index: usize,
    /// Generated tokens, including a stop token or the tokens of a stop string.
    pub tokens: Vec<u32>,
    /// Log-probability of each generated token (see [`floe_backend::Sampled`]); empty
    /// when the request did not ask for log-probs.
    pub logprobs: Vec<f32>,
    /// The most likely tokens and their log-probs at each generated token (see
    /// [`SamplingParams::top_logprobs`]); empty when the request asked for none.
    #[serde(default)]
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Why it finished.
    pub stop_reason: StopReason,
    /// The detokenized text, cut before the matched stop string (or right after it, with
    /// `include_stop_str_in_output`); present only for requests with stop strings (the
    /// only case where the sampler detokenizes).
    pub text: Option<String>,
}

/// A running sample's tokens so far, reported after each step that appends to it and does
/// not finish it (the step that finishes it reports its [`Generation`] instead).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleProgress<'a> {
    /// The request's id.
    pub request_id: u64,
    /// Which of the request's `n` samples.
    pub sample_index: usize,
    /// Every token generated so far (they only grow: a preempted sample keeps its tokens).
    pub tokens: &'a [u32],
    /// Their log-probs; empty when the request did not ask for log-probs.
    pub logprobs: &'a [f32],
    /// Their top log-probs; empty when the request did not ask for them.
    pub top_logprobs: &'a [Vec<(u32, f32)>],
}

/// What a streaming run reports: tokens as they are decoded, then each finished sample.
#[derive(Clone, Debug, PartialEq)]
pub enum SampleEvent<'a> {
    /// New tokens of a running sample.
    Progress(SampleProgress<'a>),
    /// A finished sample.
    Finished(Generation),
}

/// What a streaming caller answers to a [`SampleEvent::Progress`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SampleFlow {
    /// Go on sampling the request.
    Continue,
    /// Stop every sample of the request now (its client is gone): they free their KV
    /// blocks and are never reported as finished.
    Cancel,
}

/// Where a running batch takes new requests: what [`SampleFeed::poll`] hands them to
/// (the [`Sampler`] itself, between two of its steps).
pub trait RequestIntake {
    /// Checks `request` as [`Sampler::submit`] does, without queueing it: a caller with
    /// several requests that must start together checks them all before submitting any.
    fn check(&self, request: &SampleRequest) -> Result<(), SampleError>;
    /// Queues `request` behind every request already submitted, after the same check as
    /// [`Sampler::submit`]: a refused request is [`SampleError::InvalidRequest`] and
    /// leaves the batch as it was.
    fn submit(&mut self, request: SampleRequest) -> Result<(), SampleError>;
}

/// The caller of a run that takes requests while it runs ([`Sampler::run_feed`],
/// [`crate::Engine::sample_joining`]): it hands over requests between steps and gets the
/// run's events.
pub trait SampleFeed {
    /// Called before every step, the first included: submit to `intake` whatever should
    /// join the batch now. A request submitted here is admitted by the same rules as one
    /// submitted before the run (first come first served, as KV blocks, the running
    /// sequence limit and the step's token budget allow), its prefill mixed into the next
    /// step beside the running samples' decodes. The run ends after a poll that leaves
    /// nothing unfinished.
    fn poll(&mut self, intake: &mut dyn RequestIntake);
    /// Whether the next step reports [`SampleEvent::Progress`] (asked before each step,
    /// so a streaming request that joins can turn it on).
    fn wants_progress(&self) -> bool;
    /// Each event of the run, as [`Sampler::run_streaming`]'s `on_event`.
    fn on_event(&mut self, event: SampleEvent<'_>) -> SampleFlow;
}

/// Sizes and limits of a [`Sampler`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplerConfig {
    /// KV blocks in the cache.
    pub num_blocks: usize,
    /// Token slots per block.
    pub block_size: usize,
    /// Most tokens (decode plus prefill) in one model call.
    pub max_tokens_per_step: usize,
    /// Most samples running at once.
    pub max_running_seqs: usize,
    /// Seed for requests that bring none.
    pub seed: u64,
    /// Speculative decoding with prompt-lookup drafts; `None` decodes a token per step.
    pub speculative: Option<NgramSpec>,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            num_blocks: 1024,
            block_size: 16,
            max_tokens_per_step: 2048,
            max_running_seqs: 256,
            seed: 0,
            speculative: None,
        }
    }
}

/// Counters of the work done since the sampler was built or [`Sampler::reset_stats`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplerStats {
    /// Model calls.
    pub steps: u64,
    /// Tokens run as prefill: prompts (shared prefixes once), prompt tails, recomputes.
    pub prefill_tokens: u64,
    /// Tokens run as decode (one per running sample per step, draft tokens not counted).
    pub decode_tokens: u64,
    /// Draft tokens run for verification (speculative decoding).
    pub draft_tokens: u64,
    /// Draft tokens the samples kept.
    pub accepted_draft_tokens: u64,
    /// Samples preempted for lack of blocks.
    pub preemptions: u64,
    /// Samples finished.
    pub finished: u64,
    /// Samples cancelled before they finished ([`SampleFlow::Cancel`]).
    pub cancelled: u64,
    /// Time in the model's forward and sampling.
    pub model_time: Duration,
    /// Of `model_time`, the host's time queueing the forward's ops (a device backend runs
    /// them meanwhile; sampling then waits for them). Near `model_time`, the host sets the
    /// pace and the device waits on it.
    pub enqueue_time: Duration,
    /// Time in [`Sampler::step`] overall (scheduling, model, stop checks, callbacks).
    pub step_time: Duration,
}

/// Why sampling failed.
#[derive(Debug, thiserror::Error)]
pub enum SampleError {
    /// A request can never be served as given.
    #[error("sample request {id}: {reason}")]
    InvalidRequest {
        /// The request's id.
        id: u64,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// [`Sampler::generate`] was called while submitted requests are unfinished.
    #[error("the sampler has unfinished requests; finish them with `run` before `generate`")]
    Busy,
    /// A backend op failed.
    #[error(transparent)]
    Backend(#[from] floe_backend::Error),
    /// The model's forward failed.
    #[error("cached forward failed: {0}")]
    Model(Box<dyn std::error::Error + Send + Sync>),
}

/// Turns generated token ids into text, for stop strings.
pub type Detokenizer = Box<dyn Fn(&[u32]) -> String + Send + Sync>;

/// A request's data shared by its samples.
struct RequestState {
    id: u64,
    n: usize,
    /// Samples not yet finished; the state is dropped when it reaches zero.
    unfinished: usize,
    prompt: Vec<u32>,
    params: SamplingParams,
    stop: StopConditions,
    seed: u64,
}

/// A sequence that samples: one of a request's `n`.
struct SampleSeq {
    /// Key of its request in `Sampler::requests`.
    request: u64,
    index: usize,
    /// Prompt followed by the tokens generated so far.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Leading tokens of `tokens` whose keys/values are in the cache.
    computed: usize,
    table: BlockTable,
    logprobs: Vec<f32>,
    top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Bytes of generated text already searched for stop strings.
    searched_text: usize,
    /// The shared prefix fill it waits for, if that has not finished.
    waits_for: Option<u64>,
}

/// A prefill-only sequence computing the shared prompt blocks of samples that start
/// together.
struct PrefixFill {
    /// Unique among fills; what waiting samples refer to.
    id: u64,
    tokens: Vec<u32>,
    computed: usize,
    table: BlockTable,
    /// Samples still waiting for it; when none are left it is dropped.
    dependents: usize,
}

enum Running {
    Sample(SampleSeq),
    Prefix(PrefixFill),
}

enum Waiting {
    /// Samples `next..n` of a request, not yet started.
    Request { key: u64, next: usize },
    /// A preempted sample, to be recomputed from its tokens.
    Preempted(SampleSeq),
}

/// One sequence's share of a step.
struct Chunk {
    /// Index into `Sampler::running`.
    seq: usize,
    start: usize,
    len: usize,
    /// A decode (the sample's one newly sampled token) rather than prefill.
    decode: bool,
    /// Draft tokens run after a decode's token, positions `start + 1..start + len`.
    draft: Vec<u32>,
    /// Index of its first logits row, when the chunk ends at the sequence's last token
    /// (then it has `1 + draft.len()` rows).
    logits_row: Option<usize>,
}

impl<B: Backend> CachedModel for Transformer<B> {
    type Backend = B;
    type Cache = KvCache<B>;
    type Error = ModelError;

    fn backend(&self) -> &B {
        Transformer::backend(self)
    }

    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }

    fn new_cache(&self, num_blocks: usize, block_size: usize) -> Result<KvCache<B>, ModelError> {
        self.new_kv_cache(num_blocks, block_size)
    }

    fn forward_cached(
        &self,
        cache: &mut KvCache<B>,
        input: &CachedInput,
    ) -> Result<B::Buf, ModelError> {
        Transformer::forward_cached(self, cache, input)
    }
}

/// Continuous-batching sampler over a [`CachedModel`]; see the module docs.
///
/// It owns the KV cache but not the model, so the same weights can be trained between
/// calls. Nothing in the cache outlives a request, so weight updates need no
/// invalidation.
pub struct Sampler<M: CachedModel> {
    config: SamplerConfig,
    vocab: usize,
    cache: M::Cache,
    blocks: BlockManager,
    detokenizer: Option<Detokenizer>,
    requests: HashMap<u64, RequestState>,
    waiting: VecDeque<Waiting>,
    /// In admission order, so the newest is preempted first.
    running: Vec<Running>,
    next_key: u64,
    next_fill: u64,
    stats: SamplerStats,
}

impl<M: CachedModel> Sampler<M> {
    /// A sampler with a fresh cache for `model`.
    ///
    /// # Panics
    /// When `block_size`, `max_tokens_per_step` or `max_running_seqs` is 0, or
    /// `speculative` has a [`NgramSpec::problem`].
    pub fn new(model: &M, config: SamplerConfig) -> Result<Self, SampleError> {
        assert!(config.block_size > 0, "block_size must be positive");
        assert!(
            config.max_tokens_per_step > 0,
            "max_tokens_per_step must be positive"
        );
        assert!(
            config.max_running_seqs > 0,
            "max_running_seqs must be positive"
        );
        if let Some(problem) = config.speculative.as_ref().and_then(NgramSpec::problem) {
            panic!("speculative: {problem}");
        }
        let cache = model
            .new_cache(config.num_blocks, config.block_size)
            .map_err(|e| SampleError::Model(Box::new(e)))?;
        Ok(Self {
            blocks: BlockManager::new(config.num_blocks, config.block_size),
            vocab: model.vocab_size(),
            cache,
            config,
            detokenizer: None,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_key: 0,
            next_fill: 0,
            stats: SamplerStats::default(),
        })
    }

    /// Sets the detokenizer that stop strings are matched against.
    pub fn with_detokenizer(mut self, detokenize: Detokenizer) -> Self {
        self.detokenizer = Some(detokenize);
        self
    }

    /// The configuration.
    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// Work counters.
    pub fn stats(&self) -> &SamplerStats {
        &self.stats
    }

    /// Zeroes the work counters.
    pub fn reset_stats(&mut self) {
        self.stats = SamplerStats::default();
    }

    /// True while a submitted request has an unfinished sample.
    pub fn has_unfinished(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Blocks of the KV cache not in use.
    pub fn free_blocks(&self) -> usize {
        self.blocks.num_free()
    }

    /// Queues `request` behind those already submitted, after checking it can be served.
    pub fn submit(&mut self, request: SampleRequest) -> Result<(), SampleError> {
        self.validate(&request)?;
        let key = self.next_key;
        self.next_key += 1;
        let seed = request
            .params
            .seed
            .unwrap_or_else(|| splitmix64(self.config.seed ^ splitmix64(key)));
        self.requests.insert(
            key,
            RequestState {
                id: request.id,
                n: request.n,
                unfinished: request.n,
                stop: StopConditions::new(
                    &request.params.stop_token_ids,
                    &request.params.stop_strings,
                ),
                prompt: request.prompt,
                params: request.params,
                seed,
            },
        );
        self.waiting.push_back(Waiting::Request { key, next: 0 });
        Ok(())
    }

    fn validate(&self, request: &SampleRequest) -> Result<(), SampleError> {
        let invalid = |reason: String| SampleError::InvalidRequest {
            id: request.id,
            reason,
        };
        let params = &request.params;
        if request.prompt.is_empty() {
            return Err(invalid(
                "the prompt is empty; give at least one token".into(),
            ));
        }
        if request.n == 0 {
            return Err(invalid("n is 0; ask for at least one sample".into()));
        }
        if request.n > MAX_SAMPLES_PER_REQUEST {
            return Err(invalid(format!(
                "n is {}, above the {MAX_SAMPLES_PER_REQUEST} samples one request may ask \
                 for; split it into several requests",
                request.n
            )));
        }
        if params.max_new_tokens == 0 {
            return Err(invalid("max_new_tokens is 0".into()));
        }
        if let Some(&token) = request.prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(invalid(format!(
                "prompt token {token} is outside the vocabulary of {}",
                self.vocab
            )));
        }
        if !(params.temperature >= 0.0 && params.temperature.is_finite()) {
            return Err(invalid(format!(
                "temperature {} must be finite and non-negative",
                params.temperature
            )));
        }
        if !(params.top_p > 0.0 && params.top_p <= 1.0) {
            return Err(invalid(format!("top_p {} must be in (0, 1]", params.top_p)));
        }
        if !(0.0..=1.0).contains(&params.min_p) {
            return Err(invalid(format!("min_p {} must be in [0, 1]", params.min_p)));
        }
        if !params.stop_strings.is_empty() && self.detokenizer.is_none() {
            return Err(invalid(
                "stop strings need a detokenizer; build the sampler `with_detokenizer`".into(),
            ));
        }
        // The last generated token is never fed back, so a sample occupies at most
        // prompt + max_new_tokens - 1 positions.
        let positions = request.prompt.len().saturating_add(params.max_new_tokens) - 1;
        let needed = self.blocks.blocks_for(positions);
        if needed > self.blocks.num_blocks() {
            return Err(invalid(format!(
                "a sample of up to {positions} tokens needs {needed} KV blocks but the cache \
                 has {}; shorten the prompt or max_new_tokens, or enlarge the cache",
                self.blocks.num_blocks()
            )));
        }
        Ok(())
    }

    /// Submits `requests`, runs until all finish, and returns their samples in request
    /// order, then sample order. The sampler must be idle.
    pub fn generate(
        &mut self,
        model: &M,
        requests: Vec<SampleRequest>,
    ) -> Result<Vec<Generation>, SampleError> {
        if self.has_unfinished() {
            return Err(SampleError::Busy);
        }
        // Check all before queueing any, so a bad request leaves the sampler idle.
        for request in &requests {
            self.validate(request)?;
        }
        let first_key = self.next_key;
        let mut slots: Vec<Vec<Option<Generation>>> = Vec::with_capacity(requests.len());
        for request in requests {
            slots.push(vec![None; request.n]);
            self.submit(request)?;
        }
        while self.has_unfinished() {
            self.step_inner(model, false, &mut |key, event| {
                if let SampleEvent::Finished(generation) = event {
                    let index = generation.sample_index;
                    slots[(key - first_key) as usize][index] = Some(generation);
                }
                SampleFlow::Continue
            })?;
        }
        Ok(slots
            .into_iter()
            .flatten()
            .map(|g| g.expect("every sample finishes"))
            .collect())
    }

    /// Steps until every submitted request has finished, handing each sample to
    /// `on_finish` as it finishes.
    pub fn run(
        &mut self,
        model: &M,
        on_finish: &mut dyn FnMut(Generation),
    ) -> Result<(), SampleError> {
        while self.has_unfinished() {
            self.step(model, on_finish)?;
        }
        Ok(())
    }

    /// [`Sampler::run`] that also reports each running sample's tokens after every step
    /// that decodes one ([`SampleEvent::Progress`]), for streaming to a client; a progress
    /// answered [`SampleFlow::Cancel`] stops its request's samples after that step.
    pub fn run_streaming(
        &mut self,
        model: &M,
        on_event: &mut dyn FnMut(SampleEvent<'_>) -> SampleFlow,
    ) -> Result<(), SampleError> {
        while self.has_unfinished() {
            self.step_inner(model, true, &mut |_, event| on_event(event))?;
        }
        Ok(())
    }

    /// Runs until `feed` stops handing over requests and every sample has finished,
    /// polling it for new requests before each step (see [`SampleFeed`]); requests
    /// submitted before the call run too. A request that joins mid-run samples exactly
    /// the tokens it would sample alone: its random streams depend only on its seed and
    /// sample index, never on the step it joined at (a request without a seed gets one
    /// from the sampler's seed and its submission order, as with [`Sampler::submit`]).
    pub fn run_feed(&mut self, model: &M, feed: &mut dyn SampleFeed) -> Result<(), SampleError> {
        loop {
            feed.poll(self);
            if !self.has_unfinished() {
                return Ok(());
            }
            let progress = feed.wants_progress();
            self.step_inner(model, progress, &mut |_, event| feed.on_event(event))?;
        }
    }

    /// One scheduling round and model call; each sample that finishes goes to
    /// `on_finish`. Does nothing when idle.
    ///
    /// `on_finish` runs between model calls, so it should be quick: hand the sample to
    /// a channel or a thread pool to score it while generation goes on.
    pub fn step(
        &mut self,
        model: &M,
        on_finish: &mut dyn FnMut(Generation),
    ) -> Result<(), SampleError> {
        self.step_inner(model, false, &mut |_, event| {
            if let SampleEvent::Finished(generation) = event {
                on_finish(generation);
            }
            SampleFlow::Continue
        })
    }

    /// One step; `progress` asks for [`SampleEvent::Progress`] of the samples that
    /// decoded a token and go on. `emit` gets each event with its request's key; the
    /// requests whose progress it answers [`SampleFlow::Cancel`] stop after the step.
    fn step_inner(
        &mut self,
        model: &M,
        progress: bool,
        emit: &mut dyn FnMut(u64, SampleEvent<'_>) -> SampleFlow,
    ) -> Result<(), SampleError> {
        if !self.has_unfinished() {
            return Ok(());
        }
        let started = Instant::now();
        let chunks = self.schedule();
        assert!(
            !chunks.is_empty(),
            "scheduler stalled: {} waiting, {} running, {} free blocks",
            self.waiting.len(),
            self.running.len(),
            self.blocks.num_free()
        );

        let input = self.build_input(&chunks);
        let model_started = Instant::now();
        let logits = model
            .forward_cached(&mut self.cache, &input)
            .map_err(|e| SampleError::Model(Box::new(e)))?;
        self.stats.enqueue_time += model_started.elapsed();
        let rows = self.sampling_rows(&chunks);
        // A step of prefix fills and unfinished chunks alone has nothing to sample.
        let sampled = if rows.is_empty() {
            Vec::new()
        } else {
            model.backend().sample(&logits, self.vocab, &rows)?
        };
        self.stats.model_time += model_started.elapsed();
        self.stats.steps += 1;

        let mut finished = Vec::new();
        let mut cancelled = Vec::new();
        for chunk in &chunks {
            match &mut self.running[chunk.seq] {
                Running::Prefix(fill) => {
                    fill.computed += chunk.len;
                    self.stats.prefill_tokens += chunk.len as u64;
                }
                Running::Sample(seq) => {
                    let drafted = chunk.draft.len();
                    if chunk.decode {
                        self.stats.decode_tokens += 1;
                        self.stats.draft_tokens += drafted as u64;
                    } else {
                        self.stats.prefill_tokens += chunk.len as u64;
                    }
                    seq.computed += chunk.len - drafted;
                    if let Some(row) = chunk.logits_row {
                        let request = &self.requests[&seq.request];
                        let rows = &sampled[row..=row + drafted];
                        let kept = kept_tokens(&chunk.draft, rows.iter().map(|s| s.token));
                        let mut stopped = None;
                        for (j, token) in rows[..kept].iter().enumerate() {
                            if j + 1 < kept {
                                // An accepted draft token: its key and value stand.
                                seq.computed += 1;
                                self.stats.accepted_draft_tokens += 1;
                            }
                            stopped = append_token(seq, request, token, self.detokenizer.as_ref());
                            if stopped.is_some() {
                                break;
                            }
                        }
                        match stopped {
                            Some(reason) => finished.push((chunk.seq, reason)),
                            None if progress => {
                                let flow = emit(
                                    seq.request,
                                    SampleEvent::Progress(SampleProgress {
                                        request_id: request.id,
                                        sample_index: seq.index,
                                        tokens: &seq.tokens[seq.prompt_len..],
                                        logprobs: &seq.logprobs,
                                        top_logprobs: &seq.top_logprobs,
                                    }),
                                );
                                if flow == SampleFlow::Cancel {
                                    cancelled.push(seq.request);
                                }
                            }
                            None => {}
                        }
                    }
                }
            }
        }

        // Unblock the samples of completed prefix fills, then drop the fills and the
        // finished samples (highest index first, so lower indices stay valid).
        let mut removals: Vec<usize> = finished.iter().map(|&(seq, _)| seq).collect();
        for (index, running) in self.running.iter().enumerate() {
            if let Running::Prefix(fill) = running {
                if fill.computed == fill.tokens.len() {
                    removals.push(index);
                }
            }
        }
        for &index in &removals {
            if let Running::Prefix(fill) = &self.running[index] {
                let id = fill.id;
                for running in &mut self.running {
                    if let Running::Sample(seq) = running {
                        if seq.waits_for == Some(id) {
                            seq.waits_for = None;
                        }
                    }
                }
            }
        }
        let mut reasons: HashMap<usize, (StopReason, Option<String>)> =
            finished.into_iter().collect();
        removals.sort_unstable_by(|a, b| b.cmp(a));
        for index in removals {
            match self.running.remove(index) {
                Running::Prefix(mut fill) => self.blocks.release(&mut fill.table),
                Running::Sample(mut seq) => {
                    self.blocks.release(&mut seq.table);
                    let (stop_reason, text) = reasons.remove(&index).expect("finished sample");
                    let (key, generation) = self.finish(seq, stop_reason, text);
                    emit(key, SampleEvent::Finished(generation));
                }
            }
        }
        for key in cancelled {
            self.cancel(key);
        }
        self.stats.step_time += started.elapsed();
        Ok(())
    }

    /// Picks this step's chunks: decodes, then prefill chunks of running sequences, then
    /// newly admitted sequences, under the token budget.
    fn schedule(&mut self) -> Vec<Chunk> {
        let mut budget = self.config.max_tokens_per_step;
        let mut chunks = Vec::new();

        // Decodes, oldest first; a sequence that needs a block may preempt newer ones.
        let mut index = 0;
        while index < self.running.len() && budget > 0 {
            let needs_block = match &self.running[index] {
                Running::Sample(seq) if seq.waits_for.is_none() && seq.is_decoding() => {
                    Some(seq.tokens.len())
                }
                _ => None,
            };
            if let Some(tokens) = needs_block {
                if self.grow_or_preempt(index, tokens) {
                    let Running::Sample(seq) = &self.running[index] else {
                        unreachable!("checked above")
                    };
                    chunks.push(Chunk {
                        seq: index,
                        start: seq.computed,
                        len: 1,
                        decode: true,
                        draft: Vec::new(),
                        logits_row: None,
                    });
                    budget -= 1;
                } else {
                    // It preempted itself, and it was the newest: nothing follows.
                    break;
                }
            }
            index += 1;
        }
        if let Some(spec) = self.config.speculative {
            budget = self.add_drafts(&spec, &mut chunks, budget);
        }

        // Prefill chunks of sequences already running (their blocks were reserved at
        // admission).
        for (index, running) in self.running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            let pending = match running {
                Running::Prefix(fill) => fill.tokens.len() - fill.computed,
                Running::Sample(seq) if seq.waits_for.is_none() && !seq.is_decoding() => {
                    seq.tokens.len() - seq.computed
                }
                _ => 0,
            };
            if pending > 0 {
                let start = match running {
                    Running::Prefix(fill) => fill.computed,
                    Running::Sample(seq) => seq.computed,
                };
                let len = pending.min(budget);
                chunks.push(Chunk {
                    seq: index,
                    start,
                    len,
                    decode: false,
                    draft: Vec::new(),
                    logits_row: None,
                });
                budget -= len;
            }
        }

        // Admission, first come first served: stop at the first that does not fit.
        while budget > 0 {
            let first_new = self.running.len();
            if !self.admit_front() {
                break;
            }
            for index in first_new..self.running.len() {
                let pending = match &self.running[index] {
                    Running::Prefix(fill) => fill.tokens.len(),
                    Running::Sample(seq) if seq.waits_for.is_none() => seq.tokens.len(),
                    Running::Sample(_) => 0,
                };
                if budget == 0 || pending == 0 {
                    continue;
                }
                let len = pending.min(budget);
                chunks.push(Chunk {
                    seq: index,
                    start: 0,
                    len,
                    decode: false,
                    draft: Vec::new(),
                    logits_row: None,
                });
                budget -= len;
            }
        }

        // A sample's chunk yields logits when it reaches its last token (and its draft).
        let mut rows = 0;
        for chunk in &mut chunks {
            if let Running::Sample(seq) = &self.running[chunk.seq] {
                if chunk.start + chunk.len == seq.tokens.len() + chunk.draft.len() {
                    chunk.logits_row = Some(rows);
                    rows += 1 + chunk.draft.len();
                }
            }
        }
        chunks
    }

    /// Extends the decode `chunks` with prompt-lookup drafts, oldest sample first, within
    /// `budget` tokens and the free blocks beyond one per running sample (the admission
    /// reserve), so drafting never preempts. Returns the budget left.
    fn add_drafts(&mut self, spec: &NgramSpec, chunks: &mut [Chunk], mut budget: usize) -> usize {
        let running_samples = self
            .running
            .iter()
            .filter(|r| matches!(r, Running::Sample(_)))
            .count();
        let block_size = self.blocks.block_size();
        for chunk in chunks.iter_mut() {
            if budget == 0 {
                break;
            }
            let Running::Sample(seq) = &mut self.running[chunk.seq] else {
                unreachable!("decodes are samples")
            };
            // Of the 1 + d tokens a step can keep the last is never run, so a sample
            // stays within the positions `validate` counted.
            let generated = seq.tokens.len() - seq.prompt_len;
            let room = self.requests[&seq.request]
                .params
                .max_new_tokens
                .saturating_sub(generated + 1);
            let mut draft = spec.propose(&seq.tokens, room.min(budget));
            let spare = self.blocks.num_free().saturating_sub(running_samples);
            draft.truncate((seq.table.len() + spare) * block_size - seq.tokens.len());
            if draft.is_empty() {
                continue;
            }
            let len = draft.len();
            self.blocks
                .grow(&mut seq.table, seq.tokens.len() + len)
                .expect("within the spare blocks");
            chunk.draft = draft;
            chunk.len += len;
            budget -= len;
        }
        budget
    }

    /// Makes the sample at `index` cover `tokens` positions, preempting the newest
    /// samples while blocks are short. False when it had to preempt itself.
    fn grow_or_preempt(&mut self, index: usize, tokens: usize) -> bool {
        loop {
            let Running::Sample(seq) = &mut self.running[index] else {
                unreachable!("only samples grow")
            };
            if self.blocks.grow(&mut seq.table, tokens).is_ok() {
                return true;
            }
            let victim = self
                .running
                .iter()
                .rposition(|r| matches!(r, Running::Sample(_)))
                .expect("the growing sample itself is a candidate");
            self.preempt(victim);
            if victim == index {
                return false;
            }
        }
    }

    /// Frees the sample at `index` and queues it for recomputation, ahead of everything
    /// not yet admitted. A prefix fill left without dependents is dropped too.
    fn preempt(&mut self, index: usize) {
        let Running::Sample(mut seq) = self.running.remove(index) else {
            unreachable!("only samples are preempted")
        };
        self.blocks.release(&mut seq.table);
        seq.computed = 0;
        if let Some(id) = seq.waits_for.take() {
            self.leave_fill(id);
        }
        self.stats.preemptions += 1;
        self.waiting.push_front(Waiting::Preempted(seq));
    }

    /// A sample stops waiting for the prefix fill `id`; the fill goes when none is left.
    fn leave_fill(&mut self, id: u64) {
        let position = self
            .running
            .iter()
            .position(|r| matches!(r, Running::Prefix(f) if f.id == id))
            .expect("a waiting sample's prefix fill is running");
        let Running::Prefix(fill) = &mut self.running[position] else {
            unreachable!()
        };
        fill.dependents -= 1;
        if fill.dependents == 0 {
            let Running::Prefix(mut fill) = self.running.remove(position) else {
                unreachable!()
            };
            self.blocks.release(&mut fill.table);
        }
    }

    /// Stops every unfinished sample of the request `key`: running ones free their blocks
    /// (and a prefix fill left without dependents goes too), queued ones leave the queue.
    fn cancel(&mut self, key: u64) {
        let Some(request) = self.requests.remove(&key) else {
            return;
        };
        self.stats.cancelled += request.unfinished as u64;
        while let Some(index) = self
            .running
            .iter()
            .position(|r| matches!(r, Running::Sample(seq) if seq.request == key))
        {
            let Running::Sample(mut seq) = self.running.remove(index) else {
                unreachable!("matched above")
            };
            self.blocks.release(&mut seq.table);
            if let Some(id) = seq.waits_for {
                self.leave_fill(id);
            }
        }
        self.waiting.retain(|waiting| match waiting {
            Waiting::Request { key: k, .. } => *k != key,
            Waiting::Preempted(seq) => seq.request != key,
        });
    }

    /// Admits as much of the front of the queue as blocks and the sequence limit allow.
    /// False when nothing could be admitted.
    ///
    /// While samples are running, admission leaves one free block per running sample
    /// (new ones included), so that the next block boundary each of them crosses does
    /// not immediately preempt what was just admitted. With nothing running there is no
    /// such reserve, so a request as large as the whole cache still gets in.
    fn admit_front(&mut self) -> bool {
        let running_samples = self
            .running
            .iter()
            .filter(|r| matches!(r, Running::Sample(_)))
            .count();
        let seq_room = self.config.max_running_seqs.saturating_sub(running_samples);
        if seq_room == 0 {
            return false;
        }
        let reserve_per_sample = usize::from(running_samples > 0);
        let available = self
            .blocks
            .num_free()
            .saturating_sub(running_samples * reserve_per_sample);
        match self.waiting.pop_front() {
            None => false,
            Some(Waiting::Preempted(mut seq)) => {
                let needed = self.blocks.blocks_for(seq.tokens.len()) + reserve_per_sample;
                if needed > available {
                    self.waiting.push_front(Waiting::Preempted(seq));
                    return false;
                }
                self.blocks
                    .grow(&mut seq.table, seq.tokens.len())
                    .expect("counted above");
                self.running.push(Running::Sample(seq));
                true
            }
            Some(Waiting::Request { key, next }) => {
                // Requests queued right behind with the same prompt (as when a client
                // sends one request per sample) start together and share its blocks.
                let mut members = vec![(key, next)];
                while let Some(&Waiting::Request {
                    key: other,
                    next: 0,
                }) = self.waiting.front()
                {
                    if self.requests[&other].prompt != self.requests[&key].prompt {
                        break;
                    }
                    members.push((other, 0));
                    self.waiting.pop_front();
                }
                let started = self.admit_samples(&members, seq_room, available, reserve_per_sample);
                // Give back what did not start, keeping queue order.
                let mut left = started;
                let mut rest = Vec::new();
                for (key, next) in members {
                    let take = left.min(self.requests[&key].n - next);
                    left -= take;
                    if next + take < self.requests[&key].n {
                        rest.push(Waiting::Request {
                            key,
                            next: next + take,
                        });
                    }
                }
                for waiting in rest.into_iter().rev() {
                    self.waiting.push_front(waiting);
                }
                started > 0
            }
        }
    }

    /// Starts, in order, as many of the not-yet-started samples of `members` (requests
    /// with one prompt, each from its sample `next`) as `seq_room` and `available`
    /// blocks allow, keeping `reserve_per_sample` blocks free per started sample, and
    /// sharing the prompt's full blocks when two or more start together. Returns how
    /// many started.
    fn admit_samples(
        &mut self,
        members: &[(u64, usize)],
        seq_room: usize,
        available: usize,
        reserve_per_sample: usize,
    ) -> usize {
        let prompt = self.requests[&members[0].0].prompt.clone();
        let prompt_len = prompt.len();
        let remaining = members
            .iter()
            .map(|(key, next)| self.requests[key].n - next)
            .sum::<usize>()
            .min(seq_room);
        let block_size = self.blocks.block_size();
        // Leave at least one prompt token to each sample, for its own first logits.
        let shared_blocks = (prompt_len - 1) / block_size;
        let own_blocks_shared = self.blocks.blocks_for(prompt_len) - shared_blocks;
        let sharing_fits = available
            .checked_sub(shared_blocks)
            .map_or(0, |left| left / (own_blocks_shared + reserve_per_sample));
        let share = shared_blocks > 0 && remaining.min(sharing_fits) >= 2;
        let count = if share {
            remaining.min(sharing_fits)
        } else {
            remaining.min(available / (self.blocks.blocks_for(prompt_len) + reserve_per_sample))
        };
        if count == 0 {
            return 0;
        }

        let fill = share.then(|| {
            let mut table = BlockTable::default();
            self.blocks
                .grow(&mut table, shared_blocks * block_size)
                .expect("counted above");
            self.next_fill += 1;
            PrefixFill {
                id: self.next_fill,
                tokens: prompt[..shared_blocks * block_size].to_vec(),
                computed: 0,
                table,
                dependents: count,
            }
        });
        let starting = members
            .iter()
            .flat_map(|&(key, next)| (next..self.requests[&key].n).map(move |index| (key, index)));
        let mut samples = Vec::with_capacity(count);
        for (key, index) in starting.take(count) {
            let (mut table, computed, waits_for) = match &fill {
                Some(fill) => (
                    self.blocks.share_prefix(&fill.table, shared_blocks),
                    fill.tokens.len(),
                    Some(fill.id),
                ),
                None => (BlockTable::default(), 0, None),
            };
            self.blocks
                .grow(&mut table, prompt_len)
                .expect("counted above");
            samples.push(SampleSeq {
                request: key,
                index,
                tokens: prompt.clone(),
                prompt_len,
                computed,
                table,
                logprobs: Vec::new(),
                top_logprobs: Vec::new(),
                searched_text: 0,
                waits_for,
            });
        }
        if let Some(fill) = fill {
            self.running.push(Running::Prefix(fill));
        }
        self.running
            .extend(samples.into_iter().map(Running::Sample));
        count
    }

    /// The flat model input of `chunks`.
    fn build_input(&self, chunks: &[Chunk]) -> CachedInput {
        let tables: Vec<(&[u32], &[u32])> = chunks
            .iter()
            .map(|chunk| match &self.running[chunk.seq] {
                Running::Prefix(fill) => (fill.table.blocks(), &fill.tokens[..]),
                Running::Sample(seq) => (seq.table.blocks(), &seq.tokens[..]),
            })
            .collect();
        let max_blocks = tables.iter().map(|(t, _)| t.len()).max().unwrap_or(0);
        let mut input = CachedInput {
            max_blocks,
            block_tables: vec![0; chunks.len() * max_blocks],
            ..CachedInput::default()
        };
        for (row, (chunk, (blocks, tokens))) in chunks.iter().zip(&tables).enumerate() {
            input.block_tables[row * max_blocks..][..blocks.len()].copy_from_slice(blocks);
            for pos in chunk.start..chunk.start + chunk.len {
                let token = match pos.checked_sub(tokens.len()) {
                    Some(i) => chunk.draft[i],
                    None => tokens[pos],
                };
                input.tokens.push(token);
                input.token_seq.push(row as u32);
                input.token_pos.push(pos as u32);
                let block = blocks[pos / self.config.block_size] as usize;
                input
                    .slots
                    .push((block * self.config.block_size + pos % self.config.block_size) as u32);
            }
            if chunk.logits_row.is_some() {
                let end = input.tokens.len() as u32;
                input
                    .logit_rows
                    .extend(end - 1 - chunk.draft.len() as u32..end);
            }
        }
        input
    }

    /// The sampling parameters of each logits row, in row order: a draft's row `j`
    /// draws the token `j` places after the sample's next, as it would without a draft.
    fn sampling_rows(&self, chunks: &[Chunk]) -> Vec<SamplingRow> {
        chunks
            .iter()
            .filter(|chunk| chunk.logits_row.is_some())
            .flat_map(|chunk| {
                let Running::Sample(seq) = &self.running[chunk.seq] else {
                    unreachable!("only samples have logits rows")
                };
                let request = &self.requests[&seq.request];
                let params = &request.params;
                let next = seq.tokens.len() - seq.prompt_len;
                (next..=next + chunk.draft.len()).map(|offset| SamplingRow {
                    temperature: params.temperature,
                    top_k: params.top_k,
                    top_p: params.top_p,
                    min_p: params.min_p,
                    seed: sample_seed(request.seed, seq.index),
                    offset: offset as u64,
                    top_logprobs: params.top_logprobs,
                })
            })
            .collect()
    }

    /// Turns a finished sample into its [`Generation`], forgetting the request after
    /// its last sample.
    fn finish(
        &mut self,
        seq: SampleSeq,
        stop_reason: StopReason,
        text: Option<String>,
    ) -> (u64, Generation) {
        self.stats.finished += 1;
        let request = self.requests.get_mut(&seq.request).expect("live request");
        let generation = Generation {
            request_id: request.id,
            sample_index: seq.index,
            tokens: seq.tokens[seq.prompt_len..].to_vec(),
            logprobs: seq.logprobs,
            top_logprobs: seq.top_logprobs,
            stop_reason,
            text,
        };
        request.unfinished -= 1;
        if request.unfinished == 0 {
            self.requests.remove(&seq.request);
        }
        (seq.request, generation)
    }
}

impl<M: CachedModel> RequestIntake for Sampler<M> {
    fn check(&self, request: &SampleRequest) -> Result<(), SampleError> {
        self.validate(request)
    }

    fn submit(&mut self, request: SampleRequest) -> Result<(), SampleError> {
        Sampler::submit(self, request)
    }
}

impl SampleSeq {
    /// True when the only uncomputed token is the last one sampled.
    fn is_decoding(&self) -> bool {
        self.tokens.len() > self.prompt_len && self.computed + 1 == self.tokens.len()
    }
}

/// Appends a sampled token to `seq` and checks its stop conditions: the reason and, for
/// requests with stop strings, the text (cut before a matched stop string) when it
/// finished.
fn append_token(
    seq: &mut SampleSeq,
    request: &RequestState,
    sampled: &floe_backend::Sampled,
    detokenizer: Option<&Detokenizer>,
) -> Option<(StopReason, Option<String>)> {
    seq.tokens.push(sampled.token);
    if request.params.logprobs {
        seq.logprobs.push(sampled.logprob);
    }
    if request.params.top_logprobs > 0 {
        seq.top_logprobs.push(sampled.top_logprobs.clone());
    }
    let generated = &seq.tokens[seq.prompt_len..];
    let stops = !request.params.force_full_length;
    let reason = if stops && request.stop.is_stop_token(sampled.token) {
        StopReason::Stop(Stop::Token(sampled.token))
    } else {
        if stops && request.stop.has_strings() {
            let text = detokenize(detokenizer, generated);
            if let Some(found) = request.stop.find_string(&text, seq.searched_text) {
                let matched = &request.stop.strings()[found.index];
                let end = if request.params.include_stop_str_in_output {
                    found.start + matched.len()
                } else {
                    found.start
                };
                let cut = text[..end].to_string();
                let stop = Stop::String(matched.clone());
                return Some((StopReason::Stop(stop), Some(cut)));
            }
            seq.searched_text = text.len();
        }
        if generated.len() < request.params.max_new_tokens {
            return None;
        }
        StopReason::Length
    };
    let text = request
        .stop
        .has_strings()
        .then(|| detokenize(detokenizer, generated));
    Some((reason, text))
}

fn detokenize(detokenizer: Option<&Detokenizer>, tokens: &[u32]) -> String {
    detokenizer.expect("validated at submission")(tokens)
}

/// The seed of the random stream of sample `index` of a request seeded `seed`: its
/// token `i` is drawn with [`SamplingRow`] `{ seed: sample_seed(seed, index), offset: i }`.
pub fn sample_seed(seed: u64, index: usize) -> u64 {
    splitmix64(seed ^ splitmix64(index as u64 ^ 0x5bd1_e995))
}

/// SplitMix64's first output from state `x`: a bijective mix of 64 bits.
fn splitmix64(x: u64) -> u64 {
    mix64(x.wrapping_add(GAMMA))
}
