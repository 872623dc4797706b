//! Parity with Hugging Face transformers on tiny random Qwen3, Qwen2 and Llama models:
//! per-token log-probs within 1e-4 of transformers' (float64) and identical 16-token
//! greedy continuations through the paged KV cache.
//!
//! The fixtures in `tests/fixtures/` come from `tools/make_hf_fixtures.py` (see its
//! docstring for how to regenerate them).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use floe_backend::cpu::CpuBackend;
use floe_backend::sampling::sample_row;
use floe_backend::{Backend, SamplingRow};
use floe_model::batch::PackedBatch;
use floe_model::decode::CachedInput;
use floe_model::transformer::Transformer;
use floe_model::weights::{load_model_dir, save_model_dir, save_model_dir_sharded, SaveDType};
use serde::Deserialize;

/// The fixture format this test reads; `FIXTURE_VERSION` in the generator.
const FIXTURE_VERSION: u32 = 1;
const REGENERATE: &str = "python3 tools/make_hf_fixtures.py --out OUT && \
     tar xf OUT/fixtures.tar -C crates/model/tests/fixtures";

#[derive(Deserialize)]
struct Fixture {
    version: u32,
    sequences: Vec<Vec<u32>>,
    models: BTreeMap<String, ModelFixture>,
}

#[derive(Deserialize)]
struct ModelFixture {
    dir: String,
    dtype: String,
    logprobs: Vec<Vec<f64>>,
    greedy: Vec<Greedy>,
}

#[derive(Deserialize)]
struct Greedy {
    prompt: Vec<u32>,
    continuation: Vec<u32>,
}

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn read_fixture() -> Fixture {
    let path = fixtures_dir().join("hf_parity.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}; regenerate with: {REGENERATE}", path.display()));
    let fixture: Fixture = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{}: {e}; regenerate with: {REGENERATE}", path.display()));
    assert_eq!(
        fixture.version,
        FIXTURE_VERSION,
        "{} has fixture version {}, this test reads version {FIXTURE_VERSION}; \
         regenerate with: {REGENERATE}",
        path.display(),
        fixture.version
    );
    fixture
}

fn load(dir: &str) -> Transformer<CpuBackend<f32>> {
    let (config, weights) = load_model_dir(fixtures_dir().join(dir)).unwrap();
    Transformer::from_host_weights(Arc::new(CpuBackend::new()), config, &weights).unwrap()
}

#[test]
fn logprobs_match_transformers() {
    let fixture = read_fixture();
    assert_eq!(fixture.models.len(), 3);
    for (name, expected) in &fixture.models {
        let model = load(&expected.dir);
        let batch = PackedBatch::from_sequences(&fixture.sequences).unwrap();
        let stats = model.forward(&batch, 1.0).unwrap();
        let want: Vec<f64> = expected.logprobs.iter().flatten().copied().collect();
        assert_eq!(stats.logprobs.len(), want.len(), "{name}");
        let worst = stats
            .logprobs
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        eprintln!("{name}: max |floe − transformers| log-prob = {worst:e}");
        assert!(
            worst < 1e-4,
            "{name}: max |floe − transformers| log-prob = {worst:e}"
        );
    }
}

#[test]
fn greedy_continuations_match_transformers() {
    let fixture = read_fixture();
    const BLOCK: usize = 8;
    for (name, expected) in &fixture.models {
        let model = load(&expected.dir);
        let backend = model.backend().clone();
        let vocab = model.config().vocab_size;
        let prompts: Vec<&[u32]> = expected
            .greedy
            .iter()
            .map(|g| g.prompt.as_slice())
            .collect();
        let longest = expected
            .greedy
            .iter()
            .map(|g| g.prompt.len() + g.continuation.len())
            .max()
            .unwrap();
        // Each sequence owns its own run of blocks, interleaved so block tables matter.
        let max_blocks = longest.div_ceil(BLOCK);
        let n = prompts.len();
        let mut cache = model.new_kv_cache(n * max_blocks, BLOCK).unwrap();
        let block_tables: Vec<u32> = (0..n)
            .flat_map(|s| (0..max_blocks).map(move |j| (j * n + s) as u32))
            .collect();
        let slot = |s: usize, pos: usize| {
            block_tables[s * max_blocks + pos / BLOCK] * BLOCK as u32 + (pos % BLOCK) as u32
        };

        // One prefill call for every prompt, then one decode call per step.
        let mut input = CachedInput {
            block_tables: block_tables.clone(),
            max_blocks,
            ..Default::default()
        };
        for (s, prompt) in prompts.iter().enumerate() {
            for (pos, &tok) in prompt.iter().enumerate() {
                input.tokens.push(tok);
                input.token_seq.push(s as u32);
                input.token_pos.push(pos as u32);
                input.slots.push(slot(s, pos));
            }
            input.logit_rows.push(input.tokens.len() as u32 - 1);
        }
        let mut generated: Vec<Vec<u32>> = vec![Vec::new(); n];
        let steps = expected.greedy[0].continuation.len();
        for step in 0..steps {
            let logits = backend
                .download(&model.forward_cached(&mut cache, &input).unwrap())
                .unwrap();
            let greedy = SamplingRow {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed: 0,
                offset: 0,
                top_logprobs: 0,
            };
            input = CachedInput {
                block_tables: block_tables.clone(),
                max_blocks,
                ..Default::default()
            };
            for s in 0..n {
                let token = sample_row(&logits[s * vocab..(s + 1) * vocab], &greedy).token;
                generated[s].push(token);
                let pos = prompts[s].len() + step;
                input.tokens.push(token);
                input.token_seq.push(s as u32);
                input.token_pos.push(pos as u32);
                input.slots.push(slot(s, pos));
                input.logit_rows.push(s as u32);
            }
        }
        for (s, g) in expected.greedy.iter().enumerate() {
            assert_eq!(generated[s], g.continuation, "{name}: prompt {s}");
        }
    }
}

/// Saves each fixture model back with `save_model_dir`, in one file and in shards (f32
/// models as F32, bf16 ones as BF16, which is exact for them), and checks the reloads are
/// identical. With
/// `FLOE_HF_RESAVE_DIR` set, the saves go there too, for
/// `tools/make_hf_fixtures.py --check-floe-save DIR` to load in transformers.
#[test]
fn resaved_fixtures_reload_identically() {
    let fixture = read_fixture();
    let tmp = tempfile::tempdir().unwrap();
    let out = std::env::var_os("FLOE_HF_RESAVE_DIR").map(PathBuf::from);
    for (name, expected) in &fixture.models {
        let (config, weights) = load_model_dir(fixtures_dir().join(&expected.dir)).unwrap();
        let dtype = match expected.dtype.as_str() {
            "float32" => SaveDType::F32,
            "bfloat16" => SaveDType::BF16,
            other => panic!("{name}: unknown fixture dtype {other}"),
        };
        for root in std::iter::once(tmp.path()).chain(out.as_deref()) {
            let dir = root.join(name);
            save_model_dir(&dir, &config, &weights, dtype).unwrap();
            let (c2, w2) = load_model_dir(&dir).unwrap();
            assert_eq!((&c2, &w2), (&config, &weights), "{name}");
            // The same model in shards of at most 64 KiB, with an index.
            let sharded = root.join(format!("{name}.sharded"));
            save_model_dir_sharded(&sharded, &config, &weights, dtype, 64 << 10).unwrap();
            assert!(sharded.join("model.safetensors.index.json").is_file());
            let (c3, w3) = load_model_dir(&sharded).unwrap();
            assert_eq!((&c3, &w3), (&config, &weights), "{name} sharded");
        }
    }
}
