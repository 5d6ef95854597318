//! The model's own chat template as an agent loop's turns ([`ChatTurns`]), the way verl's
//! `ToolAgentLoop` uses a Hugging Face tokenizer:
//! - a model turn is read as text by the tokenizer, special tokens written out;
//! - the tools' answers are written as `tool` messages through the template with the opening of
//!   the model's next turn, less the tokens the template writes before any message (its default
//!   system turn), found as verl's `initialize_system_prompt` finds them: one empty user turn
//!   rendered, less what a second such turn adds.
//!
//! Qwen's template, for instance, writes `<|im_start|>user\n<tool_response>\n…\n</tool_response>
//! <|im_end|>\n<|im_start|>assistant\n` for an answer.

use serde_json::Value;
use verl_megatron::hf::{ChatMessage, HfTokenizer};

use super::agent_loop::ChatTurns;
use crate::error::RolloutError;

/// [`ChatTurns`] from a model's tokenizer and chat template.
///
/// ```no_run
/// use verl_megatron::hf::{ChatMessage, HfTokenizer};
/// use verl_rollout::agent::{Calculator, HfChatTurns, ToolSet};
///
/// let chat = HfChatTurns::new(HfTokenizer::from_dir("Qwen2.5-0.5B-Instruct")?)?;
/// let tools = ToolSet::new().with(Calculator);
/// let prompt = chat.prompt(&[ChatMessage::user("What is 12 * 34?")], &tools.schemas())?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct HfChatTurns {
    tokenizer: HfTokenizer,
    /// Tokens the template writes before the first message, cut from each tool turn.
    system_prefix: usize,
}

impl HfChatTurns {
    /// The turns of `tokenizer`'s chat template.
    ///
    /// # Errors
    /// The model has no chat template, or its template cannot write a tool turn (checked here,
    /// before any generation).
    pub fn new(tokenizer: HfTokenizer) -> Result<Self, RolloutError> {
        let ids = |messages: &[ChatMessage]| -> Result<Vec<u32>, RolloutError> {
            Ok(tokenizer.encode(&tokenizer.apply_chat_template(messages, false)?)?)
        };
        let one = ids(&[ChatMessage::user("")])?;
        let two = ids(&[ChatMessage::user(""), ChatMessage::user("")])?;
        let per_turn = two
            .len()
            .checked_sub(one.len())
            .filter(|&d| d > 0 && d <= one.len())
            .ok_or_else(|| RolloutError::Config {
                field: "chat_template",
                value: format!("{} then {} tokens", one.len(), two.len()),
                message: "a second user turn must add tokens to the first; the template does not \
                          write one turn per message, so a tool turn cannot be cut from it"
                    .into(),
            })?;
        let turns = Self {
            system_prefix: one.len() - per_turn,
            tokenizer,
        };
        turns.tool_turn(&[String::new()])?;
        Ok(turns)
    }

    /// A prompt's tokens: `messages` through the template with the tools' schemas (as
    /// transformers' `tools=`) and the opening of the model's turn.
    pub fn prompt(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
    ) -> Result<Vec<u32>, RolloutError> {
        let text = self
            .tokenizer
            .apply_chat_template_with_tools(messages, tools, true)?;
        Ok(self.tokenizer.encode(&text)?)
    }

    /// Tokens the template writes before the first message (verl's system prompt).
    pub fn system_prefix(&self) -> usize {
        self.system_prefix
    }

    pub fn tokenizer(&self) -> &HfTokenizer {
        &self.tokenizer
    }
}

impl ChatTurns for HfChatTurns {
    fn decode(&self, tokens: &[u32]) -> String {
        // Ids the model produced are its vocabulary's; a failure would be a damaged tokenizer,
        // and a turn read as empty simply calls no tool.
        // Special tokens kept, as verl's hermes parser decodes.
        self.tokenizer
            .decode_with_special(tokens)
            .unwrap_or_else(|e| {
                tracing::warn!("a model turn could not be decoded ({e}); read as calling no tool");
                String::new()
            })
    }

    fn tool_turn(&self, answers: &[String]) -> Result<Vec<u32>, RolloutError> {
        let messages: Vec<ChatMessage> = answers.iter().map(ChatMessage::tool).collect();
        let text = self.tokenizer.apply_chat_template(&messages, true)?;
        let ids = self.tokenizer.encode(&text)?;
        // Cut by length, as verl does.
        Ok(ids.get(self.system_prefix..).unwrap_or_default().to_vec())
    }
}
