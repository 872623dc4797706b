//! Issue 20: `floe serve` restarted (killed and started again on its data folder and
//! port) between two requests of a live [`RemoteEngine`]. The engine gets its engine back
//! as it was when nothing trained it since it was created or last saved, and the verbs
//! that follow answer exactly what they answer without the restart; when something
//! trained it since, the next verb fails naming the saved state to resume from.

mod support;

use std::path::Path;
use std::time::Duration;

use floe_engine::native_api::{EngineSettings, ModelSpec};
use floe_engine::policy::OptimParams;
use floe_engine::remote::{RemoteEngine, RemoteError};
use floe_engine::{
    Engine, Generation, Loss, SampleRequest, SamplingParams, TrainGroup, TrainResponse,
};
use support::Server;

const API_KEY: &str = "tml-restart-test";

fn connect(server: &Server) -> RemoteEngine {
    let settings = EngineSettings {
        seed: Some(3),
        ..EngineSettings::default()
    };
    RemoteEngine::connect(
        &server.url,
        Some(API_KEY.to_string()),
        ModelSpec::BaseModel("tiny".into()),
        settings,
    )
    .expect("creating the engine")
    .0
}

/// What one step of the verbs gives: the samples and the loss.
type StepResult = (Vec<Generation>, f64);

/// Samples two responses of a prompt (seeded by `step`) and trains on them.
fn sample(engine: &mut RemoteEngine, step: u64) -> Result<Vec<Generation>, RemoteError> {
    let request = SampleRequest {
        id: step,
        prompt: vec![5, 6, 7, 8, 9, 10],
        n: 2,
        params: SamplingParams {
            max_new_tokens: 8,
            seed: Some(100 + step),
            ..SamplingParams::default()
        },
    };
    let mut generations = Vec::new();
    engine.sample(vec![request], &mut |g| generations.push(g))?;
    generations.sort_by_key(|g| g.sample_index);
    Ok(generations)
}

fn train_on(engine: &mut RemoteEngine, generations: &[Generation]) -> Result<f64, RemoteError> {
    let group = TrainGroup {
        prompt: vec![5, 6, 7, 8, 9, 10],
        responses: generations
            .iter()
            .map(|g| TrainResponse {
                tokens: g.tokens.clone(),
                loss_mask: vec![1.0; g.tokens.len()],
                advantages: vec![0.0; g.tokens.len()],
                old_logprobs: vec![0.0; g.tokens.len()],
                rollout_logprobs: None,
                ref_logprobs: None,
                targets: None,
            })
            .collect(),
    };
    Ok(engine
        .forward_backward(&[group], &Loss::CrossEntropy, 1.0)?
        .loss)
}

fn optim_step(engine: &mut RemoteEngine) -> Result<(), RemoteError> {
    let params = OptimParams {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        max_grad_norm: 1.0,
    };
    engine.optim_step(&params).map(|_| ())
}

fn step(engine: &mut RemoteEngine, step: u64) -> StepResult {
    let generations = sample(engine, step).unwrap();
    let loss = train_on(engine, &generations).unwrap();
    optim_step(engine).unwrap();
    (generations, loss)
}

/// Kills the server and starts it again on `data_dir` at the same port.
fn restart(server: &mut Server, data_dir: &Path) {
    let port = server.port();
    server.kill();
    *server = Server::start_at(port, data_dir, Some(API_KEY), &[]);
}

#[test]
fn a_server_restarted_between_requests_gives_the_engine_back_and_the_run_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let checkpoint = |name: &str| dir.path().join("checkpoints").join(name);

    // Uninterrupted: three steps, each saved.
    let reference = Server::start(&dir.path().join("reference"), API_KEY);
    let mut engine = connect(&reference);
    let mut expected = Vec::new();
    for k in 0..3 {
        expected.push(step(&mut engine, k));
        engine.save_state(&checkpoint(&format!("a{k}"))).unwrap();
    }
    drop(engine);
    drop(reference);

    let data_dir = dir.path().join("serve");
    let mut server = Server::start(&data_dir, API_KEY);
    let mut engine = connect(&server);
    let mut got = Vec::new();
    // Before anything trained it: the engine is created again.
    restart(&mut server, &data_dir);
    got.push(step(&mut engine, 0));
    engine.save_state(&checkpoint("b0")).unwrap();
    // After a save: created again with the saved state loaded.
    restart(&mut server, &data_dir);
    got.push(step(&mut engine, 1));
    engine.save_state(&checkpoint("b1")).unwrap();
    // Down when the next request goes out: it waits for the server, which comes back a
    // second later.
    let port = server.port();
    server.kill();
    let again = {
        let data_dir = data_dir.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(1));
            Server::start_at(port, &data_dir, Some(API_KEY), &[])
        })
    };
    let generations = sample(&mut engine, 2).unwrap();
    server = again.join().unwrap();
    let loss = train_on(&mut engine, &generations).unwrap();
    optim_step(&mut engine).unwrap();
    got.push((generations, loss));
    assert_eq!(
        got, expected,
        "the steps differ from the uninterrupted ones"
    );
    drop(server);
}

#[test]
fn a_server_restarted_after_training_names_the_state_to_resume_from() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("serve");
    let mut server = Server::start(&data_dir, API_KEY);
    let mut engine = connect(&server);

    // Trained and never saved: nothing holds what it learned.
    let generations = sample(&mut engine, 0).unwrap();
    train_on(&mut engine, &generations).unwrap();
    restart(&mut server, &data_dir);
    let error = optim_step(&mut engine).unwrap_err().to_string();
    assert!(
        error.contains("no longer has engine") && error.contains("start the run again"),
        "{error}"
    );

    // Saved, then trained: the error names the saved state.
    let mut engine = connect(&server);
    step(&mut engine, 0);
    let saved = dir.path().join("checkpoint");
    engine.save_state(&saved).unwrap();
    let record: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(saved.join(floe_engine::remote::REMOTE_STATE_FILE)).unwrap(),
    )
    .unwrap();
    let state_id = record["state_id"].as_str().unwrap();
    let generations = sample(&mut engine, 1).unwrap();
    train_on(&mut engine, &generations).unwrap();
    restart(&mut server, &data_dir);
    let error = optim_step(&mut engine).unwrap_err();
    assert!(matches!(error, RemoteError::EngineLost { .. }), "{error}");
    let error = error.to_string();
    assert!(
        error.contains(state_id)
            && error.contains("trainer.resume=latest")
            && error.contains(&server.url),
        "{error}"
    );
    // The saved state itself survived the restart: a new engine loads it.
    let mut resumed = connect(&server);
    resumed.load_state(&saved).unwrap();
    sample(&mut resumed, 1).unwrap();
}
