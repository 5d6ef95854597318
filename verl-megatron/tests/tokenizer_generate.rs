//! The tokenizer, chat template and generation loop against the transformers references.

mod common;
use common::{fixture, load_model};

use verl_megatron::hf::{ChatMessage, HfTokenizer};
use verl_megatron::models::{generate, GenerateOptions};

fn reference(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap())
        .unwrap()
}

fn u32s(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn chat_template_and_encoding_match_transformers() {
    let tok = HfTokenizer::from_dir(fixture("qwen2")).unwrap();
    let r = reference("qwen2");
    let text = tok
        .apply_chat_template(&[ChatMessage::user("What is 12 + 7?")], true)
        .unwrap();
    assert_eq!(text, r["chat_prompt_text"].as_str().unwrap());
    assert_eq!(tok.encode(&text).unwrap(), u32s(&r["chat_prompt_ids"]));
    assert_eq!(tok.eos_token_ids, vec![2]);
    let ids = tok.encode("What is 12 + 7?").unwrap();
    assert_eq!(tok.decode(&ids).unwrap(), "What is 12 + 7?");
}

#[test]
fn greedy_generation_of_the_chat_prompt_matches_transformers() {
    for name in ["qwen2", "llama3", "qwen3", "qwen2_moe"] {
        let dir = fixture(name);
        let (_, model) = load_model(&dir);
        let r = reference(name);
        let prompt = u32s(&r["chat_prompt_ids"]);
        let expected = u32s(&r["chat_greedy_output"])[prompt.len()..].to_vec();
        let opts = GenerateOptions {
            max_new_tokens: expected.len(),
            temperature: 0.0,
            seed: 0,
            eos_token_ids: vec![],
        };
        assert_eq!(
            generate(&model, &prompt, &opts, &Default::default()),
            expected,
            "{name}"
        );
    }
}

#[test]
fn sampling_is_seeded_and_stops_at_eos() {
    let dir = fixture("qwen2");
    let (_, model) = load_model(&dir);
    let prompt = [3, 17, 40];
    let opts = |seed| GenerateOptions {
        max_new_tokens: 10,
        temperature: 1.5,
        seed,
        eos_token_ids: vec![],
    };
    let a = generate(&model, &prompt, &opts(7), &Default::default());
    assert_eq!(
        a,
        generate(&model, &prompt, &opts(7), &Default::default()),
        "same seed, same tokens"
    );
    assert!(
        (1..50).any(|s| generate(&model, &prompt, &opts(s), &Default::default()) != a),
        "seeds change the sample"
    );
    // Stop right after the first generated token when it is declared EOS.
    let stop = GenerateOptions {
        eos_token_ids: vec![a[0]],
        ..opts(7)
    };
    assert_eq!(
        generate(&model, &prompt, &stop, &Default::default()),
        vec![a[0]]
    );
}

/// A chat template is code from the model's files: one whose loops would run for 10^10 steps
/// is stopped by its step budget and named, instead of hanging the data loader.
#[test]
fn a_chat_template_that_does_not_end_is_stopped_and_named() {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture("qwen2")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "json") {
            std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    )
    .unwrap();
    let tok = HfTokenizer::from_dir(dir.path()).unwrap();
    // Without the budget this call would not return.
    let e = tok
        .apply_chat_template(&[ChatMessage::user("hi")], true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("chat_template") && e.contains("steps"), "{e}");
    // The real template is far inside the budget.
    let tok = HfTokenizer::from_dir(fixture("qwen2")).unwrap();
    let many: Vec<ChatMessage> = (0..200)
        .map(|i| ChatMessage::user(format!("turn {i}")))
        .collect();
    assert!(tok.apply_chat_template(&many, true).is_ok());
}
