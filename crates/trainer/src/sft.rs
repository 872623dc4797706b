//! The supervised warm start: cross-entropy on each training row's reference answer
//! (`extra_info.reference_answer`, already in the format its reward accepts), so GRPO
//! starts from a policy that sometimes earns a reward.

use std::collections::BTreeMap;
use std::time::Instant;

use floe_engine::policy::OptimParams;
use floe_env::dataset::DataCursor;
use floe_model::tokenizer::Tokenizer;
use floe_rl::optim::{lr_at, LrScheduleKind};
use indicatif::{ProgressBar, ProgressStyle};

use crate::config::{Config, Scheduler};
use crate::data::{reference_answer, Prompt};
use crate::error::{Error, Result};
use crate::ranks::Ranks;
use floe_engine::{Engine, Loss, TrainGroup, TrainResponse};

/// Stream of the SFT shuffle, apart from the RL data order of the same seed.
const SFT_SHUFFLE_STREAM: u64 = 0x5F7;

/// One supervised example: a prompt and the answer tokens (ending in end-of-sequence).
#[derive(Clone, Debug)]
pub struct SftExample {
    /// Prompt token ids (chat template with the generation prompt).
    pub prompt: Vec<u32>,
    /// Answer token ids, end-of-sequence included.
    pub answer: Vec<u32>,
}

/// The examples of the prompts that carry a reference answer.
pub fn sft_examples(prompts: &[&Prompt], tokenizer: &Tokenizer) -> Result<Vec<SftExample>> {
    let eos = tokenizer.eos_token_ids.first().copied();
    prompts
        .iter()
        .filter_map(|p| reference_answer(&p.row).map(|answer| (p, answer)))
        .map(|(p, answer)| {
            let mut tokens = tokenizer.encode(answer, false)?;
            tokens.extend(eos);
            Ok(SftExample {
                prompt: p.ids.clone(),
                answer: tokens,
            })
        })
        .collect()
}

/// Runs `sft.epochs` passes of `sft.batch_size` examples per optimiser step, the learning
/// rate following `sft.scheduler` after `sft.num_warmup_steps` of warmup. Hands each
/// epoch's metrics (`sft/loss`, `sft/grad_norm`, `sft/epoch`, `sft/num_tokens`,
/// `timing/sft`) to `on_epoch` as the epoch ends. Among several ranks each trains its
/// share of every batch ([`Ranks::sft_share`]) and the engine sums the gradients.
pub fn run_sft<E: Engine>(
    engine: &mut E,
    config: &Config,
    examples: &[SftExample],
    ranks: &Ranks,
    on_epoch: &mut dyn FnMut(BTreeMap<String, f64>) -> Result<()>,
) -> Result<()> {
    if examples.is_empty() {
        return Err(Error::Data(
            "sft.enabled is true but no training row has extra_info.reference_answer; \
             set sft.enabled = false or add reference answers"
                .into(),
        ));
    }
    let sft = &config.sft;
    let opt = &config.trainer.policy.optimizer_config;
    let mut params = OptimParams {
        lr: sft.lr as f32,
        beta1: opt.betas[0] as f32,
        beta2: opt.betas[1] as f32,
        eps: opt.eps as f32,
        weight_decay: opt.weight_decay as f32,
        max_grad_norm: opt.max_grad_norm as f32,
    };
    let batches_per_epoch = examples.len().div_ceil(sft.batch_size);
    let total_steps = (sft.epochs * batches_per_epoch) as u64;
    let schedule = match sft.scheduler {
        Scheduler::Constant => LrScheduleKind::Constant,
        Scheduler::Linear => LrScheduleKind::Linear,
        Scheduler::Cosine => LrScheduleKind::Cosine,
    };
    let mut optimizer_steps = 0u64;
    let bar = ProgressBar::new((sft.epochs * batches_per_epoch) as u64).with_style(
        ProgressStyle::with_template("sft   {bar:30} {pos}/{len} {elapsed} {msg}")
            .expect("a valid progress template"),
    );
    let order_of = DataCursor::new(examples.len(), config.trainer.seed ^ SFT_SHUFFLE_STREAM);
    for epoch in 0..sft.epochs {
        let start = Instant::now();
        let (mut loss_sum, mut norm_sum, mut tokens) = (0.0, 0.0, 0.0);
        for batch in order_of.epoch_order(epoch as u64).chunks(sft.batch_size) {
            let groups = shared_prefix_groups(batch.iter().map(|&i| &examples[i]));
            let out = engine
                .forward_backward(&ranks.sft_share(&groups), &Loss::CrossEntropy, 1.0)
                .map_err(Error::verb("forward_backward"))?;
            params.lr = lr_at(
                optimizer_steps,
                schedule,
                sft.lr,
                sft.num_warmup_steps as u64,
                total_steps,
            ) as f32;
            optimizer_steps += 1;
            let step = engine
                .optim_step(&params)
                .map_err(Error::verb("optim_step"))?;
            loss_sum += out.loss;
            norm_sum += step.grad_norm;
            tokens += out.metrics.get("sft/num_tokens").copied().unwrap_or(0.0);
            bar.inc(1);
            bar.set_message(format!("epoch {} loss {:.3}", epoch + 1, out.loss));
        }
        let batches = batches_per_epoch as f64;
        bar.suspend(|| {
            on_epoch(BTreeMap::from([
                ("sft/epoch".to_string(), (epoch + 1) as f64),
                ("sft/loss".to_string(), loss_sum / batches),
                ("sft/grad_norm".to_string(), norm_sum / batches),
                ("sft/num_tokens".to_string(), tokens),
                ("timing/sft".to_string(), start.elapsed().as_secs_f64()),
            ]))
        })?;
    }
    bar.finish_and_clear();
    engine
        .sync_sampler_weights()
        .map_err(Error::verb("sync_sampler_weights"))?;
    Ok(())
}

/// Shortest common prompt prefix worth sharing: below it, examples train on their own.
const MIN_SHARED_PREFIX: usize = 16;

/// Packs a batch's examples into groups that compute their common prompt prefix once.
///
/// Examples whose prompts start alike (the same system prompt and database schema) form one
/// group: its prompt is their longest common token prefix, and each response is the rest of
/// its own prompt (loss mask 0) followed by the answer (loss mask 1). Attention over a
/// group's prefix is exactly attention over the example's full prompt, so the loss and its
/// gradient are those of the examples alone, on fewer tokens: the schema that dominates a
/// text-to-SQL prompt is computed once per group instead of once per example.
pub fn shared_prefix_groups<'a>(examples: impl Iterator<Item = &'a SftExample>) -> Vec<TrainGroup> {
    let mut sorted: Vec<&SftExample> = examples.collect();
    sorted.sort_by(|a, b| a.prompt.cmp(&b.prompt));
    let mut groups = Vec::new();
    let mut start = 0;
    while start < sorted.len() {
        // Extend the run while the common prefix stays long enough to be worth sharing; the
        // prefix is cut one token short of the shortest prompt so every response starts
        // with at least one prompt token it owns.
        let mut shared = sorted[start].prompt.len() - 1;
        let mut end = start + 1;
        while end < sorted.len() {
            let common = common_prefix(&sorted[start].prompt, &sorted[end].prompt)
                .min(sorted[end].prompt.len() - 1);
            if common.min(shared) < MIN_SHARED_PREFIX {
                break;
            }
            shared = shared.min(common);
            end += 1;
        }
        let members = &sorted[start..end];
        let shared = if members.len() == 1 {
            members[0].prompt.len()
        } else {
            shared
        };
        groups.push(TrainGroup {
            prompt: members[0].prompt[..shared].to_vec(),
            responses: members
                .iter()
                .map(|example| {
                    let own_prompt = &example.prompt[shared..];
                    let mut tokens = own_prompt.to_vec();
                    tokens.extend_from_slice(&example.answer);
                    let mut loss_mask = vec![0.0; own_prompt.len()];
                    loss_mask.resize(tokens.len(), 1.0);
                    TrainResponse {
                        targets: None,
                        tokens,
                        loss_mask,
                        advantages: Vec::new(),
                        old_logprobs: Vec::new(),
                        rollout_logprobs: None,
                        ref_logprobs: None,
                    }
                })
                .collect(),
        });
        start = end;
    }
    groups
}

/// Length of the longest common prefix of `a` and `b`.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
