//! The pieces of verl's agent loop (multi-turn rollouts with tool calls): parsing the tool
//! calls a model writes ([`tool_call`]) and the example tools ([`calculator`]). Tools
//! implement [`verl_core::traits::Tool`].

pub mod calculator;
pub mod tool_call;

pub use calculator::Calculator;
pub use tool_call::{parse_hermes, render_hermes, ParsedTurn, ToolCall};
