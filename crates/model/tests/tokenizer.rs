//! Byte-level BPE training, encode/decode, special tokens, saving and loading.

use floe_model::chat_template::{ChatMessage, ChatTemplate};
use floe_model::tokenizer::{
    train_bpe, Tokenizer, TokenizerError, QWEN3_SPECIAL_TOKENS, THINK_TOKENS,
};
use serde_json::json;

/// A small synthetic SQL-flavoured corpus, deterministic.
fn corpus() -> Vec<String> {
    let tables = ["users", "orders", "items", "payments", "stores"];
    let cols = ["id", "name", "price", "created_at", "amount", "city"];
    let mut texts = Vec::new();
    for i in 0..400 {
        let t = tables[i % tables.len()];
        let c = cols[(i * 7) % cols.len()];
        let d = cols[(i * 3 + 1) % cols.len()];
        texts.push(format!(
            "Question: what is the {c} of {t} where {d} is {i}?\n\
             SELECT {c} FROM {t} WHERE {d} = {i} ORDER BY {c} LIMIT 10;"
        ));
    }
    texts
}

fn trained(vocab: usize) -> Tokenizer {
    train_bpe(&corpus(), vocab, &QWEN3_SPECIAL_TOKENS).unwrap()
}

#[test]
fn training_is_deterministic_and_lays_out_ids() {
    let a = trained(400);
    let b = trained(400);
    assert_eq!(a.to_json().unwrap(), b.to_json().unwrap());
    assert_eq!(a.vocab_size(), 400 + THINK_TOKENS.len());
    for (i, t) in QWEN3_SPECIAL_TOKENS.iter().enumerate() {
        assert_eq!(a.token_to_id(t), Some(i as u32), "{t}");
    }
    assert_eq!(a.token_to_id("<think>"), Some(400));
    assert_eq!(a.token_to_id("</think>"), Some(401));
    assert_eq!(a.eos_token.as_deref(), Some("<|im_end|>"));
    assert_eq!(a.eos_token_ids, vec![2]);
    assert_eq!(a.pad_token_id, Some(0));
    assert!(a.chat_template.is_some());
}

#[test]
fn merges_compress_the_corpus_and_any_text_round_trips() {
    let tok = trained(400);
    let ids = tok.encode("SELECT name FROM users", false).unwrap();
    assert!(ids.len() < 8, "merges should cover frequent words: {ids:?}");
    for text in [
        "SELECT name FROM users WHERE city = 'Zürich';",
        "never seen: ∑ 🚀 \t tabs\nand newlines  ",
        "",
    ] {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
}

#[test]
fn special_and_think_tokens_are_single_ids() {
    let tok = trained(400);
    let (im_start, im_end) = (1, 2);
    let text = "<|im_start|>assistant\n<think>\nok\n</think>\n\nSELECT 1<|im_end|>";
    let ids = tok.encode(text, false).unwrap();
    assert_eq!(ids[0], im_start);
    assert_eq!(*ids.last().unwrap(), im_end);
    assert!(ids.contains(&400) && ids.contains(&401));
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    // Skipping special tokens drops the chat markers but keeps the thinking tags.
    assert_eq!(
        tok.decode(&ids, true).unwrap(),
        "assistant\n<think>\nok\n</think>\n\nSELECT 1"
    );
}

#[test]
fn save_and_load_preserve_everything() {
    let tok = trained(400);
    let dir = tempfile::tempdir().unwrap();
    tok.save_dir(dir.path()).unwrap();
    let loaded = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(loaded.to_json().unwrap(), tok.to_json().unwrap());
    assert_eq!(loaded.eos_token_ids, tok.eos_token_ids);
    assert_eq!(loaded.pad_token_id, tok.pad_token_id);
    assert_eq!(loaded.chat_template, tok.chat_template);
    let text = "<|im_start|>user\nWhat is the price of items?<|im_end|>";
    assert_eq!(
        loaded.encode(text, true).unwrap(),
        tok.encode(text, true).unwrap()
    );

    // The saved config drives the chat template with transformers' special tokens.
    let template =
        ChatTemplate::from_tokenizer_config(dir.path().join("tokenizer_config.json")).unwrap();
    assert_eq!(template.eos_token.as_deref(), Some("<|im_end|>"));
    let prompt = template
        .render(&[ChatMessage::new("user", "hi")], true, &json!({}))
        .unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["added_tokens_decoder"]["400"]["content"], "<think>");
    assert_eq!(config["added_tokens_decoder"]["400"]["special"], false);
    assert_eq!(config["added_tokens_decoder"]["2"]["special"], true);

    let from_tokenizer = ChatTemplate::from_tokenizer(&loaded).unwrap().unwrap();
    let again = from_tokenizer
        .render(&[ChatMessage::new("user", "hi")], true, &json!({}))
        .unwrap();
    assert_eq!(again, prompt);

    // generation_config.json adds end-of-sequence ids after eos_token's.
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"eos_token_id": [2, 0], "pad_token_id": 0}"#,
    )
    .unwrap();
    assert_eq!(
        Tokenizer::from_dir(dir.path()).unwrap().eos_token_ids,
        vec![2, 0]
    );
}

#[test]
fn errors_name_the_file_or_token() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("tokenizer.json");
    let err = Tokenizer::from_file(&missing).unwrap_err();
    assert!(matches!(err, TokenizerError::Io { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    std::fs::write(&missing, r#"{"model": 12}"#).unwrap();
    let err = Tokenizer::from_file(&missing).unwrap_err();
    assert!(matches!(err, TokenizerError::Load { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    trained(300).save_dir(dir.path()).unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"eos_token": "</s>"}"#,
    )
    .unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("tokenizer_config.json") && msg.contains("</s>"),
        "{msg}"
    );
    std::fs::write(dir.path().join("tokenizer_config.json"), "{").unwrap();
    let msg = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(
        msg.contains("tokenizer_config.json") && msg.contains("JSON"),
        "{msg}"
    );

    let msg = train_bpe(&corpus(), 100, &QWEN3_SPECIAL_TOKENS)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("vocab_size 100"), "{msg}");
}

/// With `FLOE_HF_TOKENIZER_DIR` set, writes the trained tokenizer there together with
/// `floe_expected.json` (floe's encodings and chat renderings), for
/// `tools/make_hf_fixtures.py --check-tokenizer DIR` to compare against transformers.
#[test]
fn writes_the_transformers_check_folder_when_asked() {
    let Some(dir) = std::env::var_os("FLOE_HF_TOKENIZER_DIR") else {
        return;
    };
    let tok = trained(400);
    tok.save_dir(&dir).unwrap();
    let template = ChatTemplate::qwen3();
    let texts = [
        "SELECT name FROM users WHERE city = 'Zürich';",
        "never seen: ∑ 🚀 \t tabs\nand newlines  ",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nSELECT 1",
    ];
    let encode: Vec<_> = texts
        .iter()
        .map(|t| json!({"text": t, "ids": tok.encode(t, false).unwrap()}))
        .collect();
    let conversations = [
        (
            json!([{"role": "system", "content": "You write SQL."},
                   {"role": "user", "content": "Count users."}]),
            true,
            json!({"enable_thinking": false}),
        ),
        (
            json!([{"role": "user", "content": "Q1"},
                   {"role": "assistant", "content": "<think>\nr1\n</think>\n\nA1"},
                   {"role": "user", "content": "Q2"},
                   {"role": "assistant", "content": "A2", "reasoning_content": "r2"}]),
            false,
            json!({}),
        ),
    ];
    let chat: Vec<_> = conversations
        .iter()
        .map(|(messages, gen, extra)| {
            let rendered = template
                .render(messages.as_array().unwrap(), *gen, extra)
                .unwrap();
            json!({"messages": messages, "add_generation_prompt": gen, "extra": extra,
                   "rendered": rendered})
        })
        .collect();
    let expected = json!({"encode": encode, "chat": chat, "eos_token": tok.eos_token,
                          "pad_token": tok.pad_token});
    std::fs::write(
        std::path::Path::new(&dir).join("floe_expected.json"),
        serde_json::to_string_pretty(&expected).unwrap(),
    )
    .unwrap();
}
