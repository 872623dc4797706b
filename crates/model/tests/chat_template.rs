//! Qwen3's chat template rendered by minijinja, against strings derived from reading the
//! template (and confirmed with Python jinja2 configured as transformers configures it).

use floe_model::chat_template::{ChatMessage, ChatTemplate, TemplateError, QWEN3_CHAT_TEMPLATE};
use serde_json::{json, Value};

fn qwen3(messages: &Value, add_generation_prompt: bool, extra: Value) -> String {
    let messages = messages.as_array().unwrap();
    ChatTemplate::qwen3()
        .render(messages, add_generation_prompt, &extra)
        .unwrap()
}

#[test]
fn system_and_user_with_generation_prompt() {
    let messages = [
        ChatMessage::new("system", "You are helpful."),
        ChatMessage::new("user", "What is 2+2?"),
    ];
    let t = ChatTemplate::qwen3();
    let base = "<|im_start|>system\nYou are helpful.<|im_end|>\n\
                <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(t.render(&messages, true, &Value::Null).unwrap(), base);
    // enable_thinking = true (or absent) adds nothing; false pre-fills an empty block.
    assert_eq!(
        t.render(&messages, true, &json!({"enable_thinking": true}))
            .unwrap(),
        base
    );
    assert_eq!(
        t.render(&messages, true, &json!({"enable_thinking": false}))
            .unwrap(),
        format!("{base}<think>\n\n</think>\n\n")
    );
    // Without the generation prompt the conversation simply ends.
    assert_eq!(
        t.render(&messages, false, &Value::Null).unwrap(),
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    );
}

#[test]
fn reasoning_is_kept_only_after_the_last_user_turn() {
    // The first assistant's inline <think> is stripped (it precedes the last query); the
    // final assistant's reasoning_content field is rendered inside <think>.
    let messages = json!([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nplan\n</think>\n\nHello!"},
        {"role": "user", "content": "Add 1+1"},
        {"role": "assistant", "content": "2", "reasoning_content": "1+1 is 2"},
    ]);
    assert_eq!(
        qwen3(&messages, false, Value::Null),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n\
         <|im_start|>user\nAdd 1+1<|im_end|>\n\
         <|im_start|>assistant\n<think>\n1+1 is 2\n</think>\n\n2<|im_end|>\n"
    );
    // A final assistant turn without reasoning still gets an (empty) think block.
    let messages = json!([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]);
    assert_eq!(
        qwen3(&messages, false, Value::Null),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n"
    );
}

#[test]
fn multi_turn_drops_old_reasoning() {
    let messages = json!([
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nr1\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "<think>\nr2\n</think>\n\nA2"},
        {"role": "user", "content": "Q3"},
    ]);
    assert_eq!(
        qwen3(&messages, true, Value::Null),
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n\
         <|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\nA2<|im_end|>\n\
         <|im_start|>user\nQ3<|im_end|>\n<|im_start|>assistant\n"
    );
    // Reasoning of a non-final assistant after the last query is kept (stripped of
    // newlines); a system message that is not first renders as a turn.
    let messages = json!([
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "\nr1\n"},
        {"role": "system", "content": "late system"},
    ]);
    assert_eq!(
        qwen3(&messages, false, Value::Null),
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n<think>\nr1\n</think>\n\nA1<|im_end|>\n\
         <|im_start|>system\nlate system<|im_end|>\n"
    );
}

#[test]
fn tools_tool_calls_and_grouped_tool_responses() {
    // Keys are given in sorted order: floe's tojson prints keys sorted (see module docs).
    let messages = json!([
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"function": {"arguments": {"city": "Paris", "unit": "°C"}, "name": "get_weather"},
             "type": "function"}]},
        {"role": "tool", "content": "18C"},
        {"role": "tool", "content": "sunny"},
    ]);
    let tools = json!([{"function": {"description": "Weather \"now\"", "name": "get_weather",
        "parameters": {"properties": {"city": {"type": "string"}}, "type": "object"}},
        "type": "function"}]);
    let expected = "<|im_start|>system\nUse tools.\n\n# Tools\n\nYou may call one or more \
        functions to assist with the user query.\n\nYou are provided with function signatures \
        within <tools></tools> XML tags:\n<tools>\n\
        {\"function\": {\"description\": \"Weather \\\"now\\\"\", \"name\": \"get_weather\", \
        \"parameters\": {\"properties\": {\"city\": {\"type\": \"string\"}}, \"type\": \"object\"}}, \
        \"type\": \"function\"}\n</tools>\n\nFor each function call, return a json object with \
        function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
        {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n\
        <|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\nLet me check.\n\
        <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"°C\"}}\n\
        </tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n\
        <tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(qwen3(&messages, true, json!({ "tools": tools })), expected);
}

#[test]
fn python_compat_helpers() {
    let t = ChatTemplate::from_str(
        "{{ 'a,b'.split(',')[-1] }}|{{ '  x '.strip() }}|{{ 'xyx'.rstrip('x') }}|\
         {{ 'abc'.startswith(('z', 'a')) }}|{{ {'k': 1}.get('k') }}{{ {'k': 1}.get('q', 7) }}|\
         {% for k, v in {'b': 2}.items() %}{{ k }}={{ v }}{% endfor %}|{{ [1, 'é'] | tojson }}|\
         {{ {'a': [1]} | tojson(indent=2) }}|{{ 'A-B'.lower().replace('-', '+') }}|\
         {% set ns = namespace(n=0) %}{% for i in [1, 2, 3] %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}|\
         {{ bos_token }}{{ eos_token }}",
    )
    .unwrap();
    let out = t
        .render::<Value>(
            &[],
            false,
            &json!({"bos_token": "<s>", "eos_token": "</s>"}),
        )
        .unwrap();
    assert_eq!(
        out,
        "b|x|xy|True|17|b=2|[1, \"é\"]|{\n  \"a\": [\n    1\n  ]\n}|a+b|6|<s></s>"
    );
    let date = ChatTemplate::from_str("{{ strftime_now('%Y') }}").unwrap();
    let year: u32 = date
        .render::<Value>(&[], false, &Value::Null)
        .unwrap()
        .parse()
        .unwrap();
    assert!(year >= 2025);
}

#[test]
fn errors_name_their_origin() {
    let t = ChatTemplate::from_str(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}",
    )
    .unwrap();
    let err = t
        .render(&[ChatMessage::new("system", "s")], false, &Value::Null)
        .unwrap_err();
    assert!(matches!(err, TemplateError::Render { .. }));
    assert!(err.to_string().contains("first must be user"), "{err}");

    let err = ChatTemplate::from_str("{% if %}").unwrap_err();
    assert!(matches!(err, TemplateError::Syntax { .. }), "{err}");
    let err = ChatTemplate::qwen3()
        .render(&[ChatMessage::new("user", "x")], false, &json!([1]))
        .unwrap_err();
    assert!(err.to_string().contains("extra"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer_config.json");
    std::fs::write(&path, r#"{"eos_token": "<|im_end|>"}"#).unwrap();
    let err = ChatTemplate::from_tokenizer_config(&path).unwrap_err();
    assert!(matches!(err, TemplateError::NoTemplate { .. }));
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
    std::fs::write(&path, r#"{"chat_template": "{% for %}"}"#).unwrap();
    let err = ChatTemplate::from_tokenizer_config(&path).unwrap_err();
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
    std::fs::write(&path, "{").unwrap();
    let err = ChatTemplate::from_tokenizer_config(&path).unwrap_err();
    assert!(matches!(err, TemplateError::Json { .. }), "{err}");
}

#[test]
fn loads_from_tokenizer_config_or_a_sibling_jinja_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer_config.json");
    let config = json!({
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "eos_token": {"content": "<|im_end|>"},
        "bos_token": null,
    });
    std::fs::write(&path, config.to_string()).unwrap();
    let t = ChatTemplate::from_tokenizer_config(&path).unwrap();
    assert_eq!(t.source(), QWEN3_CHAT_TEMPLATE);
    assert_eq!(t.eos_token.as_deref(), Some("<|im_end|>"));
    assert_eq!(t.bos_token, None);

    // transformers 5 writes the template to chat_template.jinja.
    std::fs::write(&path, r#"{"eos_token": "</s>"}"#).unwrap();
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}",
    )
    .unwrap();
    let t = ChatTemplate::from_tokenizer_config(&path).unwrap();
    let out = t
        .render(&[ChatMessage::new("user", "hi")], false, &Value::Null)
        .unwrap();
    assert_eq!(out, "[user]hi</s>");

    // A list of named templates: the default one is used.
    std::fs::write(
        &path,
        json!({"chat_template": [{"name": "tool_use", "template": "T"},
                                 {"name": "default", "template": "D"}]})
        .to_string(),
    )
    .unwrap();
    let t = ChatTemplate::from_tokenizer_config(&path).unwrap();
    assert_eq!(t.source(), "D");
}
