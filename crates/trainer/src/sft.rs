//! The supervised warm start: cross-entropy on each training row's reference answer
//! (`extra_info.reference_answer`, already in the format its reward accepts), so GRPO
//! starts from a policy that sometimes earns a reward.

use std::collections::BTreeMap;
use std::time::Instant;

use floe_engine::policy::OptimParams;
use floe_env::dataset::DataCursor;
use floe_model::tokenizer::Tokenizer;
use indicatif::{ProgressBar, ProgressStyle};

use crate::config::Config;
use crate::data::Prompt;
use crate::embedded::reference_answer;
use crate::engine::{Engine, Loss, TrainGroup, TrainResponse};
use crate::error::{Error, Result};

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
pub fn sft_examples(prompts: &[Prompt], tokenizer: &Tokenizer) -> Result<Vec<SftExample>> {
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

/// Runs `sft.epochs` passes of `sft.batch_size` examples per optimiser step at the constant
/// `sft.lr`. Returns one metrics map per epoch (`sft/loss`, `sft/grad_norm`, `sft/epoch`,
/// `sft/num_tokens`, `timing/sft`).
pub fn run_sft<E: Engine>(
    engine: &mut E,
    config: &Config,
    examples: &[SftExample],
) -> Result<Vec<BTreeMap<String, f64>>> {
    if examples.is_empty() {
        return Err(Error::Data(
            "sft.enabled is true but no training row has extra_info.reference_answer; \
             set sft.enabled = false or add reference answers"
                .into(),
        ));
    }
    let sft = &config.sft;
    let opt = &config.trainer.policy.optimizer_config;
    let params = OptimParams {
        lr: sft.lr as f32,
        beta1: opt.betas[0] as f32,
        beta2: opt.betas[1] as f32,
        eps: opt.eps as f32,
        weight_decay: opt.weight_decay as f32,
        max_grad_norm: opt.max_grad_norm as f32,
    };
    let batches_per_epoch = examples.len().div_ceil(sft.batch_size);
    let bar = ProgressBar::new((sft.epochs * batches_per_epoch) as u64).with_style(
        ProgressStyle::with_template("sft   {bar:30} {pos}/{len} {elapsed} {msg}")
            .expect("a valid progress template"),
    );
    let order_of = DataCursor::new(examples.len(), config.trainer.seed ^ SFT_SHUFFLE_STREAM);
    let mut per_epoch = Vec::with_capacity(sft.epochs);
    for epoch in 0..sft.epochs {
        let start = Instant::now();
        let (mut loss_sum, mut norm_sum, mut tokens) = (0.0, 0.0, 0.0);
        for batch in order_of.epoch_order(epoch as u64).chunks(sft.batch_size) {
            let groups: Vec<TrainGroup> = batch
                .iter()
                .map(|&i| {
                    let example = &examples[i];
                    let n = example.answer.len();
                    TrainGroup {
                        prompt: example.prompt.clone(),
                        responses: vec![TrainResponse {
                            tokens: example.answer.clone(),
                            loss_mask: vec![1.0; n],
                            advantages: Vec::new(),
                            old_logprobs: Vec::new(),
                            rollout_logprobs: None,
                            ref_logprobs: None,
                        }],
                    }
                })
                .collect();
            let out = engine
                .forward_backward(&groups, &Loss::CrossEntropy, 1.0)
                .map_err(verb_error("forward_backward"))?;
            let step = engine
                .optim_step(&params)
                .map_err(verb_error("optim_step"))?;
            loss_sum += out.loss;
            norm_sum += step.grad_norm;
            tokens += out.metrics.get("sft/num_tokens").copied().unwrap_or(0.0);
            bar.inc(1);
            bar.set_message(format!("epoch {} loss {:.3}", epoch + 1, out.loss));
        }
        let batches = batches_per_epoch as f64;
        per_epoch.push(BTreeMap::from([
            ("sft/epoch".to_string(), (epoch + 1) as f64),
            ("sft/loss".to_string(), loss_sum / batches),
            ("sft/grad_norm".to_string(), norm_sum / batches),
            ("sft/num_tokens".to_string(), tokens),
            ("timing/sft".to_string(), start.elapsed().as_secs_f64()),
        ]));
    }
    bar.finish_and_clear();
    engine
        .sync_sampler_weights()
        .map_err(verb_error("sync_sampler_weights"))?;
    Ok(per_epoch)
}

/// Wraps an engine error with the verb that failed.
pub fn verb_error<X: std::error::Error + Send + Sync + 'static>(
    verb: &'static str,
) -> impl FnOnce(X) -> Error {
    move |err| Error::EngineVerb {
        verb,
        source: Box::new(err),
    }
}
