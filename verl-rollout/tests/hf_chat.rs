//! The model's chat template as the agent loop's turns (`HfChatTurns`): tool turns cut after the
//! template's system turn as verl cuts them, tools listed in the prompt, and templates that
//! cannot write a tool turn refused before any generation.

use std::path::{Path, PathBuf};

use verl_megatron::hf::{ChatMessage, HfTokenizer};
use verl_rollout::agent::{Calculator, ChatTurns, HfChatTurns, ToolSet};
use verl_rollout::RolloutError;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../verl-megatron/tests/fixtures/qwen2")
}

/// The fixture's tokenizer with `template` as its chat template.
fn with_template(template: &str) -> (tempfile::TempDir, HfTokenizer) {
    let dir = tempfile::tempdir().unwrap();
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "config.json",
    ] {
        std::fs::copy(fixture().join(name), dir.path().join(name)).unwrap();
    }
    std::fs::write(dir.path().join("chat_template.jinja"), template).unwrap();
    let tok = HfTokenizer::from_dir(dir.path()).unwrap();
    (dir, tok)
}

/// Qwen2.5's way with tools, shortened: a default system turn (the tools listed in it), tool
/// answers as a user turn of `<tool_response>` blocks.
const QWEN_LIKE: &str = r#"{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] }}{%- else %}{{- '<|im_start|>system\nYou are a helper.' }}{%- endif %}{%- if tools %}{{- '\n# Tools' }}{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}{%- endif %}{{- '<|im_end|>\n' }}{%- for message in messages %}{%- if message.role == 'user' or message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- elif message.role == 'tool' %}{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"#;

#[test]
fn a_tool_turn_follows_the_template_without_its_system_turn() {
    let (_dir, tok) = with_template(QWEN_LIKE);
    let chat = HfChatTurns::new(tok.clone()).unwrap();
    let system = tok
        .encode("<|im_start|>system\nYou are a helper.<|im_end|>\n")
        .unwrap();
    assert_eq!(chat.system_prefix(), system.len());
    let turn = chat.tool_turn(&["42".into(), "7".into()]).unwrap();
    let expected = tok
        .encode(
            "<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n7\n\
             </tool_response><|im_end|>\n<|im_start|>assistant\n",
        )
        .unwrap();
    assert_eq!(turn, expected);
    // The model's text comes back for the tool-call parser.
    let said = tok
        .encode("<tool_call>{\"name\": \"calculator\"}</tool_call>")
        .unwrap();
    assert!(chat.decode(&said).contains("\"name\": \"calculator\""));
}

#[test]
fn a_template_without_a_system_turn_cuts_nothing() {
    // The fixture's own template: one turn per message, no default system turn.
    let chat = HfChatTurns::new(HfTokenizer::from_dir(fixture()).unwrap()).unwrap();
    assert_eq!(chat.system_prefix(), 0);
    let tok = chat.tokenizer();
    assert_eq!(
        chat.tool_turn(&["4".into()]).unwrap(),
        tok.encode("<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n")
            .unwrap()
    );
}

/// Tools are written as transformers' `tojson` writes verl's schemas: Python's separators, the
/// fields in verl's order.
#[test]
fn the_prompt_lists_the_tools() {
    let (_dir, tok) = with_template(QWEN_LIKE);
    let chat = HfChatTurns::new(tok.clone()).unwrap();
    let tools = ToolSet::new().with(Calculator);
    let prompt = chat
        .prompt(&[ChatMessage::user("1+1?")], &tools.schemas())
        .unwrap();
    let expected = "<|im_start|>system\nYou are a helper.\n# Tools\n{\"type\": \"function\", \
        \"function\": {\"name\": \"calculator\", \"description\": \"Evaluates an arithmetic \
        expression (+ - * / % ^ and parentheses).\", \"parameters\": {\"type\": \"object\", \
        \"properties\": {\"expression\": {\"type\": \"string\", \"description\": \"for example \
        (12 + 30) * 2\"}}, \"required\": [\"expression\"]}}}<|im_end|>\n<|im_start|>user\n1+1?\
        <|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(tok.decode_with_special(&prompt).unwrap(), expected);
    assert_eq!(prompt, tok.encode(expected).unwrap());
    // Without tools, no list.
    let plain = tok
        .decode(&chat.prompt(&[ChatMessage::user("1+1?")], &[]).unwrap())
        .unwrap();
    assert!(!plain.contains("# Tools"), "{plain}");
}

#[test]
fn templates_that_cannot_write_a_tool_turn_are_refused_up_front() {
    // Refuses the tool role (as some base-model templates do).
    let (_dir, tok) = with_template(
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}\
         <|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
    );
    let err = HfChatTurns::new(tok).err().expect("refused");
    assert!(err.to_string().contains("no tool role"), "{err}");
    // Writes the conversation as one block whatever the messages: no turn to cut.
    let (_dir, tok) = with_template("<|im_start|>chat<|im_end|>");
    match HfChatTurns::new(tok) {
        Err(RolloutError::Config { field, .. }) => assert_eq!(field, "chat_template"),
        other => panic!("{:?}", other.err()),
    }
}
