//! The sampler against a fake model whose logits are a hash of each token's whole
//! context as read back from the paged cache: any slot-mapping, sharing or preemption
//! mistake changes the tokens, and reading a slot that does not hold the expected
//! position is an error.

use std::cell::Cell;
use std::collections::HashMap;

use floe_backend::cpu::CpuBackend;
use floe_backend::sampling::mix64;
use floe_backend::{Backend, BufKind, SamplingRow};
use floe_engine::{
    sample_seed, CachedInput, CachedModel, Generation, NgramSpec, RequestIntake, SampleError,
    SampleEvent, SampleFeed, SampleFlow, SampleRequest, Sampler, SamplerConfig, SamplingParams,
    Stop, StopReason,
};

const VOCAB: usize = 64;
const ALPHABET: &[u8; VOCAB] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .";

#[derive(Debug)]
struct FakeError(String);

impl std::fmt::Display for FakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for FakeError {}

/// Per slot: the `(token, position)` written there.
struct SlotCache {
    block_size: usize,
    slots: Vec<Option<(u32, u32)>>,
}

/// Logits of a context: a hash of every token, spread over the vocabulary.
fn context_logits(context: &[u32]) -> Vec<f32> {
    let hash = context
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &t| mix64(h ^ u64::from(t)));
    (0..VOCAB as u64)
        .map(|v| {
            4.0 * (mix64(hash ^ v.wrapping_mul(0x9e37_79b9)) >> 40) as f32 / (1u64 << 24) as f32
        })
        .collect()
}

#[derive(Default)]
struct ContextHashModel {
    backend: CpuBackend,
    calls: Cell<usize>,
    tokens_run: Cell<usize>,
    most_tokens_in_a_call: Cell<usize>,
    most_sequences_in_a_call: Cell<usize>,
}

impl CachedModel for ContextHashModel {
    type Backend = CpuBackend;
    type Cache = SlotCache;
    type Error = FakeError;

    fn backend(&self) -> &CpuBackend {
        &self.backend
    }

    fn vocab_size(&self) -> usize {
        VOCAB
    }

    fn new_cache(&self, num_blocks: usize, block_size: usize) -> Result<SlotCache, FakeError> {
        Ok(SlotCache {
            block_size,
            slots: vec![None; num_blocks * block_size],
        })
    }

    fn forward_cached(
        &self,
        cache: &mut SlotCache,
        input: &CachedInput,
    ) -> Result<<CpuBackend as Backend>::Buf, FakeError> {
        let bs = cache.block_size;
        let slot_of = |seq: u32, pos: u32| {
            let block = input.block_tables[seq as usize * input.max_blocks + pos as usize / bs];
            block as usize * bs + pos as usize % bs
        };
        let t = input.tokens.len();
        assert!(t > 0 && input.token_seq.len() == t && input.token_pos.len() == t);
        assert_eq!(input.slots.len(), t);
        for i in 0..t {
            let expected = slot_of(input.token_seq[i], input.token_pos[i]);
            if input.slots[i] as usize != expected {
                return Err(FakeError(format!(
                    "token {i}: slot {} but the block table says {expected}",
                    input.slots[i]
                )));
            }
            cache.slots[expected] = Some((input.tokens[i], input.token_pos[i]));
        }
        let mut logits = Vec::with_capacity(input.logit_rows.len() * VOCAB);
        for &row in &input.logit_rows {
            let (seq, pos) = (input.token_seq[row as usize], input.token_pos[row as usize]);
            let mut context = Vec::with_capacity(pos as usize + 1);
            for p in 0..=pos {
                match cache.slots[slot_of(seq, p)] {
                    Some((token, at)) if at == p => context.push(token),
                    held => {
                        return Err(FakeError(format!(
                            "sequence {seq} position {p}: slot holds {held:?}"
                        )))
                    }
                }
            }
            logits.extend(context_logits(&context));
        }
        self.calls.set(self.calls.get() + 1);
        self.tokens_run.set(self.tokens_run.get() + t);
        self.most_tokens_in_a_call
            .set(self.most_tokens_in_a_call.get().max(t));
        self.most_sequences_in_a_call.set(
            self.most_sequences_in_a_call
                .get()
                .max(input.block_tables.len() / input.max_blocks.max(1)),
        );
        Ok(self.backend.upload(&logits, BufKind::Compute).unwrap())
    }
}

fn detokenize(tokens: &[u32]) -> String {
    tokens
        .iter()
        .map(|&t| ALPHABET[t as usize] as char)
        .collect()
}

/// The samples of `request` computed one token at a time from whole contexts, with the
/// stop rules the sampler documents.
fn reference(request: &SampleRequest) -> Vec<Generation> {
    let backend = CpuBackend::<f32>::new();
    let p = &request.params;
    (0..request.n)
        .map(|index| {
            let mut tokens = request.prompt.clone();
            let mut logprobs = Vec::new();
            let stop_reason = loop {
                let logits = backend
                    .upload(&context_logits(&tokens), BufKind::Compute)
                    .unwrap();
                let generated = tokens.len() - request.prompt.len();
                let row = SamplingRow {
                    temperature: p.temperature,
                    top_k: p.top_k,
                    top_p: p.top_p,
                    min_p: p.min_p,
                    seed: sample_seed(p.seed.unwrap(), index),
                    offset: generated as u64,
                    top_logprobs: 0,
                };
                let sampled = backend
                    .sample(&logits, VOCAB, &[row])
                    .unwrap()
                    .swap_remove(0);
                tokens.push(sampled.token);
                logprobs.push(sampled.logprob);
                let text = detokenize(&tokens[request.prompt.len()..]);
                if !p.force_full_length {
                    if p.stop_token_ids.contains(&sampled.token) {
                        break StopReason::Stop(Stop::Token(sampled.token));
                    }
                    if let Some(s) = p.stop_strings.iter().find(|s| text.contains(s.as_str())) {
                        break StopReason::Stop(Stop::String(s.clone()));
                    }
                }
                if generated + 1 == p.max_new_tokens {
                    break StopReason::Length;
                }
            };
            let text = (!p.stop_strings.is_empty()).then(|| {
                let text = detokenize(&tokens[request.prompt.len()..]);
                match &stop_reason {
                    StopReason::Stop(Stop::String(s)) => {
                        let at = text.find(s.as_str()).unwrap();
                        let keep = if p.include_stop_str_in_output {
                            s.len()
                        } else {
                            0
                        };
                        text[..at + keep].to_string()
                    }
                    _ => text,
                }
            });
            Generation {
                request_id: request.id,
                sample_index: index,
                tokens: tokens[request.prompt.len()..].to_vec(),
                logprobs,
                top_logprobs: Vec::new(),
                stop_reason,
                text,
            }
        })
        .collect()
}

fn request(id: u64, prompt_len: usize, n: usize, max_new_tokens: usize) -> SampleRequest {
    SampleRequest {
        id,
        prompt: (0..prompt_len)
            .map(|i| ((id as usize * 7 + i * 3) % VOCAB) as u32)
            .collect(),
        n,
        params: SamplingParams {
            max_new_tokens,
            seed: Some(1000 + id),
            ..SamplingParams::default()
        },
    }
}

fn config(num_blocks: usize, block_size: usize, max_tokens_per_step: usize) -> SamplerConfig {
    SamplerConfig {
        num_blocks,
        block_size,
        max_tokens_per_step,
        max_running_seqs: 64,
        seed: 0,
        speculative: None,
    }
}

fn generate(
    model: &ContextHashModel,
    config: SamplerConfig,
    requests: &[SampleRequest],
) -> (Vec<Generation>, floe_engine::SamplerStats) {
    let mut sampler = Sampler::new(model, config)
        .unwrap()
        .with_detokenizer(Box::new(detokenize));
    let out = sampler.generate(model, requests.to_vec()).unwrap();
    assert_eq!(
        sampler.free_blocks(),
        sampler.config().num_blocks,
        "every block returns to the pool"
    );
    (out, sampler.stats().clone())
}

fn mixed_requests() -> Vec<SampleRequest> {
    let mut requests: Vec<SampleRequest> = (0..10)
        .map(|id| {
            request(
                id,
                3 + (id as usize * 11) % 37,
                1 + id as usize % 4,
                5 + (id as usize * 7) % 19,
            )
        })
        .collect();
    requests[2].params.temperature = 0.0;
    requests[3].params.top_k = 5;
    requests[4].params.top_p = 0.8;
    requests[5].params.min_p = 0.3;
    requests[6].params.temperature = 0.7;
    requests
}

#[test]
fn matches_the_uncached_reference() {
    let model = ContextHashModel::default();
    let requests = mixed_requests();
    let (out, stats) = generate(&model, config(256, 4, 64), &requests);
    let expected: Vec<Generation> = requests.iter().flat_map(reference).collect();
    assert_eq!(out, expected);
    assert!(stats.steps as usize == model.calls.get() && stats.decode_tokens > 0);
    assert_eq!(
        (stats.prefill_tokens + stats.decode_tokens) as usize,
        model.tokens_run.get()
    );
    assert!(model.most_tokens_in_a_call.get() <= 64);
    assert_eq!(stats.finished as usize, expected.len());
}

#[test]
fn every_cache_and_budget_shape_matches_the_reference() {
    let model = ContextHashModel::default();
    let mut requests = mixed_requests();
    requests[7].params.stop_token_ids = vec![3, 17, 40];
    let expected: Vec<Generation> = requests.iter().flat_map(reference).collect();
    // (blocks, block size, tokens per step, running samples)
    for (blocks, block_size, budget, running) in [
        (16, 4, 1, 64),
        (16, 4, 64, 2),
        (48, 1, 9, 5),
        (6, 16, 100, 64),
        (9, 8, 2, 64),
        (300, 3, 1000, 64),
    ] {
        let config = SamplerConfig {
            max_running_seqs: running,
            ..config(blocks, block_size, budget)
        };
        let (out, _) = generate(&model, config.clone(), &requests);
        assert_eq!(out, expected, "{config:?}");
    }
}

/// Prompt-lookup drafts change no token or log-prob in any cache and budget shape (the
/// model reads every context back from the cache, so a rejected draft's key/value read
/// where the real token's belongs would change the tokens).
#[test]
fn speculative_decoding_samples_the_reference_tokens_in_every_shape() {
    let model = ContextHashModel::default();
    let mut requests = mixed_requests();
    requests[7].params.stop_token_ids = vec![3, 17, 40];
    let expected: Vec<Generation> = requests.iter().flat_map(reference).collect();
    let (mut drafted, mut accepted) = (0, 0);
    for (blocks, block_size, budget, running) in [
        (16, 4, 1, 64),
        (16, 4, 64, 2),
        (48, 1, 9, 5),
        (6, 16, 100, 64),
        (9, 8, 2, 64),
        (300, 3, 1000, 64),
    ] {
        let config = SamplerConfig {
            max_running_seqs: running,
            speculative: Some(NgramSpec::with_max_draft(4)),
            ..config(blocks, block_size, budget)
        };
        let calls = model.calls.get();
        let tokens_run = model.tokens_run.get();
        let (out, stats) = generate(&model, config.clone(), &requests);
        assert_eq!(out, expected, "{config:?}");
        assert_eq!(stats.steps as usize, model.calls.get() - calls);
        assert_eq!(
            (stats.prefill_tokens + stats.decode_tokens + stats.draft_tokens) as usize,
            model.tokens_run.get() - tokens_run
        );
        drafted += stats.draft_tokens;
        accepted += stats.accepted_draft_tokens;
    }
    assert!(
        accepted > 0 && drafted > 10 * accepted,
        "{accepted} of {drafted}"
    );
}

#[test]
fn a_request_samples_the_same_alone_and_in_a_busy_batch() {
    let model = ContextHashModel::default();
    let mut target = request(99, 21, 3, 30);
    target.params.temperature = 0.9;
    let (alone, _) = generate(&model, config(64, 4, 512), std::slice::from_ref(&target));

    // Busy: many other requests, a small step budget (chunked prefill) and a cache small
    // enough to force preemptions.
    let mut busy = mixed_requests();
    busy.insert(4, target.clone());
    for config in [config(24, 4, 7), config(40, 8, 16), config(1000, 2, 3)] {
        let (out, stats) = generate(&model, config.clone(), &busy);
        let mine: Vec<Generation> = out.into_iter().filter(|g| g.request_id == 99).collect();
        assert_eq!(mine, alone, "{config:?}");
        if config.num_blocks == 24 {
            assert!(stats.preemptions > 0, "the small cache preempts");
        }
    }
}

#[test]
fn samples_of_a_request_share_the_prompts_full_blocks() {
    let model = ContextHashModel::default();
    // 42 prompt tokens in blocks of 8: 40 are shared, each of the 6 samples recomputes 2.
    let requests = [request(1, 42, 6, 1)];
    let (out, stats) = generate(&model, config(64, 8, 1024), &requests);
    assert_eq!(out, reference(&requests[0]));
    assert_eq!(stats.prefill_tokens, 40 + 6 * 2);
    // One request per sample, as Tinker clients send them: the same sharing.
    let per_sample: Vec<SampleRequest> = (0..6)
        .map(|seed| SampleRequest {
            id: 10 + seed,
            params: SamplingParams {
                seed: Some(seed),
                ..requests[0].params.clone()
            },
            n: 1,
            ..requests[0].clone()
        })
        .collect();
    let (out, stats) = generate(&model, config(64, 8, 1024), &per_sample);
    assert_eq!(
        out,
        per_sample.iter().flat_map(reference).collect::<Vec<_>>()
    );
    assert_eq!(stats.prefill_tokens, 40 + 6 * 2);
    // Prompt of exactly 5 full blocks: the last block is recomputed by every sample.
    let requests = [request(2, 40, 6, 1)];
    let (_, stats) = generate(&model, config(64, 8, 1024), &requests);
    assert_eq!(stats.prefill_tokens, 32 + 6 * 8);
}

#[test]
fn stop_tokens_and_stop_strings() {
    let model = ContextHashModel::default();
    // Pick stops that occur: a token and a two-character string from a free run.
    let free = reference(&request(5, 9, 1, 40)).remove(0);
    let stop_token = free.tokens[12];
    let text = detokenize(&free.tokens);
    let stop_string = text[20..22].to_string();

    let mut by_token = request(5, 9, 1, 40);
    by_token.params.stop_token_ids = vec![stop_token];
    let mut by_string = request(5, 9, 1, 40);
    by_string.params.stop_strings = vec!["never".into(), stop_string.clone()];
    let mut forced = by_token.clone();
    forced.params.force_full_length = true;
    forced.params.stop_strings = vec![stop_string.clone()];
    let mut keeping = by_string.clone();
    keeping.params.include_stop_str_in_output = true;
    let requests = [by_token, by_string, forced, keeping];
    let (out, _) = generate(&model, config(64, 4, 64), &requests);

    let first_stop = free.tokens.iter().position(|&t| t == stop_token).unwrap();
    assert_eq!(out[0].tokens, free.tokens[..=first_stop]);
    assert_eq!(
        out[0].stop_reason,
        StopReason::Stop(Stop::Token(stop_token))
    );

    let cut = text.find(&stop_string).unwrap();
    assert_eq!(
        out[1].tokens,
        free.tokens[..cut + stop_string.len()],
        "tokens kept"
    );
    assert_eq!(out[1].text.as_deref(), Some(&text[..cut]), "text cut");
    assert_eq!(
        out[1].stop_reason,
        StopReason::Stop(Stop::String(stop_string))
    );

    assert_eq!(out[3].tokens, out[1].tokens);
    assert_eq!(
        out[3].text.as_deref(),
        Some(&text[..cut + 2]),
        "stop string kept"
    );

    assert_eq!(out[2].tokens, free.tokens);
    assert_eq!(out[2].stop_reason, StopReason::Length);

    let expected: Vec<Generation> = requests.iter().flat_map(reference).collect();
    assert_eq!(out, expected);
}

#[test]
fn samples_are_delivered_as_they_finish() {
    let model = ContextHashModel::default();
    let mut sampler = Sampler::new(&model, config(64, 4, 64)).unwrap();
    sampler.submit(request(1, 5, 2, 40)).unwrap();
    sampler.submit(request(2, 5, 1, 3)).unwrap();
    let mut delivered = Vec::new();
    sampler
        .run(&model, &mut |g| {
            delivered.push((g.request_id, model.calls.get()))
        })
        .unwrap();
    assert_eq!(delivered.len(), 3);
    assert_eq!(
        delivered[0],
        (2, 3),
        "the short request is out after its 3rd step"
    );
    // Request 1 shares its first prompt block: one step for it, one for the tails (and
    // the first token), 39 decodes.
    assert!(delivered[1..]
        .iter()
        .all(|&(id, call)| id == 1 && call == 41));
    assert!(!sampler.has_unfinished());
}

/// A streaming run reports every token of a running sample as it is decoded, one more
/// each time, a prefix of what the sample finishes with (preemption included), and
/// finishes with the samples a plain run gives.
#[test]
fn progress_reports_each_token_as_it_is_decoded() {
    let model = ContextHashModel::default();
    let requests = mixed_requests();
    // A cache small enough to preempt.
    let (expected, stats) = generate(&model, config(24, 4, 16), &requests);
    assert!(stats.preemptions > 0);
    let mut sampler = Sampler::new(&model, config(24, 4, 16))
        .unwrap()
        .with_detokenizer(Box::new(detokenize));
    for request in requests {
        sampler.submit(request).unwrap();
    }
    let mut seen: HashMap<(u64, usize), (Vec<u32>, Vec<f32>)> = HashMap::new();
    let mut finished = Vec::new();
    sampler
        .run_streaming(&model, &mut |event| {
            match event {
                SampleEvent::Progress(p) => {
                    let (tokens, logprobs) =
                        seen.entry((p.request_id, p.sample_index)).or_default();
                    assert_eq!(p.tokens.len(), tokens.len() + 1, "one new token a report");
                    assert_eq!(
                        &p.tokens[..tokens.len()],
                        &tokens[..],
                        "reported tokens stay"
                    );
                    assert_eq!(&p.logprobs[..logprobs.len()], &logprobs[..]);
                    *tokens = p.tokens.to_vec();
                    *logprobs = p.logprobs.to_vec();
                }
                SampleEvent::Finished(g) => {
                    let (tokens, logprobs) = seen
                        .remove(&(g.request_id, g.sample_index))
                        .unwrap_or_default();
                    assert_eq!(
                        tokens.len() + 1,
                        g.tokens.len(),
                        "all but the last reported"
                    );
                    assert_eq!(tokens[..], g.tokens[..tokens.len()]);
                    assert_eq!(logprobs[..], g.logprobs[..logprobs.len()]);
                    finished.push(g);
                }
            }
            SampleFlow::Continue
        })
        .unwrap();
    assert!(seen.is_empty(), "reports of samples that never finished");
    let key = |g: &Generation| (g.request_id, g.sample_index);
    finished.sort_by_key(key);
    assert_eq!(finished, expected);
}

#[test]
fn a_cancelled_request_stops_and_the_others_sample_as_alone() {
    let model = ContextHashModel::default();
    // Request 0 shares its prompt's blocks between its samples (a prefix fill); a small
    // cache makes samples preempt and queue, so cancelling meets every state.
    let requests = vec![
        request(0, 9, 3, 40),
        request(1, 5, 2, 30),
        request(2, 7, 3, 20),
    ];
    let (expected, _) = generate(&model, config(24, 4, 16), &requests[1..]);
    let mut sampler = Sampler::new(&model, config(24, 4, 16))
        .unwrap()
        .with_detokenizer(Box::new(detokenize));
    for request in requests {
        sampler.submit(request).unwrap();
    }
    let (mut finished, mut reports_after_cancel, mut cancelled) = (Vec::new(), 0, false);
    sampler
        .run_streaming(&model, &mut |event| match event {
            SampleEvent::Progress(p) if p.request_id == 0 => {
                reports_after_cancel += usize::from(cancelled);
                // Cancelled at its third token.
                cancelled |= p.tokens.len() == 3;
                match cancelled {
                    true => SampleFlow::Cancel,
                    false => SampleFlow::Continue,
                }
            }
            SampleEvent::Progress(_) => SampleFlow::Continue,
            SampleEvent::Finished(g) => {
                finished.push(g);
                SampleFlow::Continue
            }
        })
        .unwrap();
    assert!(cancelled);
    // Its other two samples may report once more in the step of the cancel, never after.
    assert!(
        reports_after_cancel <= 2,
        "request 0 decoded after its cancel: {reports_after_cancel} reports"
    );
    assert!(finished.iter().all(|g| g.request_id != 0));
    finished.sort_by_key(|g| (g.request_id, g.sample_index));
    assert_eq!(finished, expected, "the other requests' samples changed");
    assert_eq!(sampler.stats().cancelled, 3);
    assert!(!sampler.has_unfinished());
    assert_eq!(sampler.free_blocks(), 24, "every block returns to the pool");
}

#[test]
fn limits_are_respected() {
    let model = ContextHashModel::default();
    let mut config = config(512, 4, 10);
    config.max_running_seqs = 3;
    let requests = mixed_requests();
    let (out, _) = generate(&model, config, &requests);
    assert_eq!(out, requests.iter().flat_map(reference).collect::<Vec<_>>());
    assert!(model.most_tokens_in_a_call.get() <= 10);
    // A prefix fill's own samples wait while it runs, so no call holds more than 3.
    assert!(model.most_sequences_in_a_call.get() <= 3);
}

#[test]
fn unservable_requests_are_rejected() {
    let model = ContextHashModel::default();
    let mut sampler = Sampler::new(&model, config(4, 4, 64)).unwrap();
    let reject = |sampler: &mut Sampler<ContextHashModel>, request: SampleRequest| match sampler
        .submit(request)
    {
        Err(SampleError::InvalidRequest { reason, .. }) => reason,
        other => panic!("expected a rejection, got {other:?}"),
    };
    assert!(reject(&mut sampler, request(1, 10, 1, 8)).contains("KV blocks"));
    assert!(reject(&mut sampler, request(1, 0, 1, 8)).contains("empty"));
    assert!(reject(&mut sampler, request(1, 3, 0, 8)).contains("n is 0"));
    // Sizes a client could never mean are refused at once, not run for ever.
    let huge_n = request(1, 3, floe_engine::sampler::MAX_SAMPLES_PER_REQUEST + 1, 8);
    assert!(reject(&mut sampler, huge_n).contains("split it"));
    assert!(reject(&mut sampler, request(1, 3, 1, usize::MAX)).contains("KV blocks"));
    let mut bad = request(1, 3, 1, 8);
    bad.prompt[0] = VOCAB as u32;
    assert!(reject(&mut sampler, bad).contains("vocabulary"));
    let mut bad = request(1, 3, 1, 8);
    bad.params.stop_strings = vec!["x".into()];
    assert!(reject(&mut sampler, bad).contains("detokenizer"));
    // Exactly the whole cache is fine: 9 + 8 - 1 positions in 4 blocks of 4.
    sampler.submit(request(1, 9, 1, 8)).unwrap();
    assert!(matches!(
        sampler.generate(&model, vec![request(2, 3, 1, 2)]),
        Err(SampleError::Busy)
    ));
    let mut out = Vec::new();
    sampler.run(&model, &mut |g| out.push(g)).unwrap();
    assert_eq!(out, reference(&request(1, 9, 1, 8)));
}

/// A [`SampleFeed`] that submits `late[k]` at its `k`-th poll (the first poll comes before
/// the first step) and records what the run reports.
struct ScriptedFeed {
    late: Vec<Vec<SampleRequest>>,
    polls: usize,
    /// Progress reports start at this poll.
    progress_from: usize,
    /// The poll each request joined at, by id.
    joined_at: HashMap<u64, usize>,
    /// The poll before which each request's first event came, by id.
    first_event_at: HashMap<u64, usize>,
    refused: Vec<SampleError>,
    finished: Vec<Generation>,
}

impl ScriptedFeed {
    fn new(late: Vec<Vec<SampleRequest>>) -> Self {
        Self {
            late,
            polls: 0,
            progress_from: 0,
            joined_at: HashMap::new(),
            first_event_at: HashMap::new(),
            refused: Vec::new(),
            finished: Vec::new(),
        }
    }
}

impl SampleFeed for ScriptedFeed {
    fn poll(&mut self, intake: &mut dyn RequestIntake) {
        for request in self
            .late
            .get_mut(self.polls)
            .map(std::mem::take)
            .unwrap_or_default()
        {
            let id = request.id;
            match intake.check(&request).and_then(|()| intake.submit(request)) {
                Ok(()) => {
                    self.joined_at.insert(id, self.polls);
                }
                Err(error) => self.refused.push(error),
            }
        }
        self.polls += 1;
    }

    fn wants_progress(&self) -> bool {
        self.polls > self.progress_from
    }

    fn on_event(&mut self, event: SampleEvent<'_>) -> SampleFlow {
        let id = match &event {
            SampleEvent::Progress(p) => p.request_id,
            SampleEvent::Finished(g) => g.request_id,
        };
        self.first_event_at.entry(id).or_insert(self.polls);
        if let SampleEvent::Finished(g) = event {
            self.finished.push(g);
        }
        SampleFlow::Continue
    }
}

/// Requests handed to a running batch between its steps (several at one poll, one with
/// the prompt of a running request, some after others finished) sample exactly what each
/// samples alone, in caches small enough to preempt and with speculative decoding, and
/// their first events come after they joined, within one run.
#[test]
fn requests_that_join_a_running_batch_sample_as_alone() {
    let model = ContextHashModel::default();
    let requests = mixed_requests();
    let mut twin = request(20, 0, 2, 12);
    twin.prompt = requests[1].prompt.clone();
    let late = || {
        let mut late = vec![Vec::new(); 21];
        late[0] = requests[..3].to_vec();
        late[2] = vec![requests[3].clone(), requests[4].clone()];
        late[3] = vec![twin.clone()];
        late[5] = requests[5..8].to_vec();
        late[12] = vec![requests[8].clone()];
        late[20] = vec![requests[9].clone()];
        late
    };
    let mut expected: Vec<Generation> =
        requests.iter().chain([&twin]).flat_map(reference).collect();
    expected.sort_by_key(|g| (g.request_id, g.sample_index));
    let speculative = SamplerConfig {
        speculative: Some(NgramSpec::with_max_draft(4)),
        ..config(64, 4, 32)
    };
    for config in [
        config(256, 4, 64),
        config(24, 4, 16),
        config(40, 2, 5),
        speculative,
    ] {
        let mut sampler = Sampler::new(&model, config.clone())
            .unwrap()
            .with_detokenizer(Box::new(detokenize));
        let mut feed = ScriptedFeed::new(late());
        feed.progress_from = 4;
        sampler.run_feed(&model, &mut feed).unwrap();

        assert!(feed.refused.is_empty(), "{:?}", feed.refused);
        assert_eq!(
            feed.joined_at.len(),
            requests.len() + 1,
            "every request joined"
        );
        // Request 8 joined while the first ones were running: mid-run, not after.
        assert!(feed.first_event_at[&0] <= feed.joined_at[&8]);
        for (id, joined) in &feed.joined_at {
            assert!(
                feed.first_event_at[id] > *joined,
                "request {id} reported before it joined"
            );
        }
        feed.finished
            .sort_by_key(|g| (g.request_id, g.sample_index));
        assert_eq!(feed.finished, expected, "{config:?}");
        assert!(!sampler.has_unfinished());
        assert_eq!(sampler.free_blocks(), config.num_blocks);
    }
}

/// A request the engine refuses mid-run is refused alone: the batch goes on and every
/// other request samples as alone, the refused one leaving no trace.
#[test]
fn a_refused_late_request_fails_alone() {
    let model = ContextHashModel::default();
    let requests = mixed_requests();
    let mut bad_top_p = request(30, 4, 2, 8);
    bad_top_p.params.top_p = 0.0;
    let too_long = request(31, 3, 1, 10_000);
    let mut late = vec![Vec::new(); 4];
    late[0] = requests[..2].to_vec();
    late[3] = vec![
        requests[2].clone(),
        bad_top_p,
        requests[3].clone(),
        too_long,
    ];
    let mut sampler = Sampler::new(&model, config(24, 4, 16))
        .unwrap()
        .with_detokenizer(Box::new(detokenize));
    let mut feed = ScriptedFeed::new(late);
    sampler.run_feed(&model, &mut feed).unwrap();

    let refused: Vec<(u64, String)> = feed
        .refused
        .iter()
        .map(|e| match e {
            SampleError::InvalidRequest { id, reason } => (*id, reason.clone()),
            other => panic!("expected a refusal, got {other:?}"),
        })
        .collect();
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert_eq!(refused[0].0, 30);
    assert!(refused[0].1.contains("top_p"), "{refused:?}");
    assert_eq!(refused[1].0, 31);
    assert!(refused[1].1.contains("KV blocks"), "{refused:?}");
    assert_eq!(feed.joined_at[&3], 3);
    feed.finished
        .sort_by_key(|g| (g.request_id, g.sample_index));
    let expected: Vec<Generation> = requests[..4].iter().flat_map(reference).collect();
    assert_eq!(feed.finished, expected);
    assert_eq!(sampler.free_blocks(), 24);
}
