//! verl's agent loop (multi-turn rollouts with tool calls): the loop ([`agent_loop`]), parsing
//! the tool calls a model writes ([`tool_call`]), the model's chat template as its turns
//! ([`hf_chat`]), the example tools ([`calculator`], [`python_code`]), verl's GSM8K tool
//! ([`gsm8k`]) and verl's tool config file ([`tool_config`]). Tools implement [`verl_core::traits::Tool`].

pub mod agent_loop;
pub mod calculator;
pub mod gsm8k;
pub mod hf_chat;
pub mod python_code;
pub mod tool_call;
pub mod tool_config;

pub use agent_loop::{
    run_agent_loop, Agent, AgentFinish, AgentLimits, AgentLoopConfig, AgentRequest, ChatTurns,
    ToolSet, Trajectory, TruncateSide, TurnGenerator,
};
pub use calculator::Calculator;
pub use gsm8k::Gsm8kTool;
pub use hf_chat::HfChatTurns;
pub use python_code::PythonCode;
pub use tool_call::{parse_hermes, render_hermes, ParsedTurn, ToolCall};
pub use tool_config::ToolConfig;
