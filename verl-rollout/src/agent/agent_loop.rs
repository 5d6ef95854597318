//! The agent loop (verl's `ToolAgentLoop`): each trajectory alternates model turns and tool
//! turns until the model answers without calling a tool, the response budget runs out, or it
//! has taken `max_assistant_turns` turns. Every model turn of the batch is generated together
//! (continuous batching across trajectories), each from its whole conversation so far, so an
//! engine keeping finished prefixes (`EngineConfig::retain_prefixes`) prefills only the new
//! turn. The response is the model's and the tools' tokens after the prompt, with a mask that
//! is 1 on the model's tokens only: tool outputs stay out of the loss.

use verl_core::traits::Tool;
use verl_megatron::parallel::ParallelBackend;

use super::tool_call::parse_hermes;
use crate::engine::{Completion, NativeRollout, Request};
use crate::error::RolloutError;
use crate::sampling::{Sampler, SamplingParams};

/// Generates one model turn for each of a batch of requests: the rollout engine, or a scripted
/// stand-in.
pub trait TurnGenerator {
    fn generate_turn(&mut self, requests: Vec<Request>) -> Result<Vec<Completion>, RolloutError>;
}

impl<B: ParallelBackend> TurnGenerator for NativeRollout<B> {
    fn generate_turn(&mut self, requests: Vec<Request>) -> Result<Vec<Completion>, RolloutError> {
        self.generate(requests)
    }
}

/// How a conversation's turns are written as tokens (the model's chat template).
pub trait ChatTurns {
    /// The text of a model turn's tokens (where its tool calls are read).
    fn decode(&self, tokens: &[u32]) -> String;
    /// The tokens that follow a model turn: the tools' answers handed back, then the opening
    /// of the model's next turn.
    fn tool_turn(&self, answers: &[String]) -> Vec<u32>;
}

/// The tools a trajectory may call, by name.
#[derive(Default)]
pub struct ToolSet {
    tools: Vec<Box<dyn Tool>>,
}

impl ToolSet {
    pub fn new() -> Self {
        Self::default()
    }

    /// The set with `tool` added (replacing one of the same name).
    pub fn with(mut self, tool: impl Tool + 'static) -> Self {
        self.tools.retain(|t| t.name() != tool.name());
        self.tools.push(Box::new(tool));
        self
    }

    /// The tool called `name`.
    pub fn get(&self, name: &str) -> Option<&dyn Tool> {
        self.tools.iter().find(|t| t.name() == name).map(|t| &**t)
    }

    /// The tools' schemas, for the chat template's system prompt.
    pub fn schemas(&self) -> Vec<serde_json::Value> {
        self.tools.iter().map(|t| t.schema()).collect()
    }

    fn names(&self) -> String {
        let names: Vec<&str> = self.tools.iter().map(|t| t.name()).collect();
        names.join(", ")
    }
}

/// The loop's limits and sampling (verl's `rollout.multi_turn.*`).
#[derive(Debug, Clone)]
pub struct AgentLoopConfig {
    /// Most model turns per trajectory (`max_assistant_turns`).
    pub max_assistant_turns: usize,
    /// Most tokens of one model turn.
    pub max_turn_tokens: usize,
    /// Most tokens of the whole response, model and tool turns together (`response_length`).
    pub response_length: usize,
    /// Most tool calls run from one model turn (`max_parallel_calls`); later ones are dropped.
    pub max_parallel_calls: usize,
    /// Most characters of one tool answer shown to the model (`max_tool_response_length`); a
    /// longer one keeps its start and says it was cut.
    pub max_tool_response_length: usize,
    pub sampling: SamplingParams,
}

/// One trajectory to run: its prompt (chat template applied) and an id that seeds its samplers.
#[derive(Debug, Clone)]
pub struct AgentRequest {
    pub prompt: Vec<u32>,
    pub id: u64,
}

/// Why a trajectory ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentFinish {
    /// The model's last turn called no tool.
    Answered,
    /// The response budget ran out.
    Length,
    /// `max_assistant_turns` were taken and the last one still called a tool.
    MaxTurns,
}

/// A finished trajectory.
#[derive(Debug, Clone, PartialEq)]
pub struct Trajectory {
    pub prompt: Vec<u32>,
    /// The model's and the tools' tokens after the prompt, in order.
    pub response: Vec<u32>,
    /// 1 on the model's tokens, 0 on the tools' (kept out of the loss).
    pub response_mask: Vec<u8>,
    /// Each response token's log-prob at sampling (0 on the tools' tokens; 0 throughout when
    /// the engine does not compute them).
    pub log_probs: Vec<f32>,
    pub assistant_turns: usize,
    pub tool_calls: usize,
    /// The tools' rewards, added up.
    pub tool_reward: f64,
    pub finish: AgentFinish,
}

impl Trajectory {
    fn push(&mut self, tokens: &[u32], model: bool, log_probs: Option<&[f32]>) {
        self.response.extend_from_slice(tokens);
        self.response_mask
            .extend(std::iter::repeat_n(model as u8, tokens.len()));
        match log_probs.filter(|lp| lp.len() == tokens.len()) {
            Some(lp) => self.log_probs.extend_from_slice(lp),
            None => self
                .log_probs
                .extend(std::iter::repeat_n(0.0, tokens.len())),
        }
    }
}

/// The seed of trajectory `id`'s sampler at model turn `turn`: a stream of its own per turn (a
/// turn's draws restart at step 0).
fn turn_seed(id: u64, turn: usize) -> u64 {
    id ^ ((turn as u64) << 48)
}

/// `answer` cut to `limit` characters, saying so.
fn truncated(answer: String, limit: usize) -> String {
    match answer.char_indices().nth(limit) {
        None => answer,
        Some((at, _)) => format!("{}... (cut at {limit} characters)", &answer[..at]),
    }
}

/// Runs every request's trajectory to its end; see the module doc.
///
/// # Errors
/// What the generator returns (a tool's failure is an answer the model reads, not an error).
pub async fn run_agent_loop(
    generator: &mut impl TurnGenerator,
    chat: &impl ChatTurns,
    tools: &ToolSet,
    requests: Vec<AgentRequest>,
    cfg: &AgentLoopConfig,
) -> Result<Vec<Trajectory>, RolloutError> {
    let mut trajectories: Vec<Trajectory> = requests
        .iter()
        .map(|r| Trajectory {
            prompt: r.prompt.clone(),
            response: Vec::new(),
            response_mask: Vec::new(),
            log_probs: Vec::new(),
            assistant_turns: 0,
            tool_calls: 0,
            tool_reward: 0.0,
            finish: AgentFinish::MaxTurns,
        })
        .collect();
    let mut open: Vec<usize> = (0..requests.len())
        .filter(|_| cfg.response_length > 0)
        .collect();
    for turn in 0..cfg.max_assistant_turns {
        if open.is_empty() {
            break;
        }
        let batch = open
            .iter()
            .map(|&i| {
                let t = &trajectories[i];
                Ok(Request {
                    prompt: [&t.prompt[..], &t.response[..]].concat(),
                    sampler: Sampler::new(cfg.sampling, turn_seed(requests[i].id, turn))?,
                    max_new_tokens: cfg
                        .max_turn_tokens
                        .min(cfg.response_length - t.response.len()),
                })
            })
            .collect::<Result<Vec<_>, RolloutError>>()?;
        let completions = generator.generate_turn(batch)?;
        let mut still_open = Vec::new();
        for (&i, done) in open.iter().zip(completions) {
            let t = &mut trajectories[i];
            t.assistant_turns += 1;
            t.push(&done.tokens, true, Some(&done.log_probs));
            if t.response.len() >= cfg.response_length {
                t.finish = AgentFinish::Length;
                continue;
            }
            let parsed = parse_hermes(&chat.decode(&done.tokens));
            if parsed.calls.is_empty() && parsed.errors.is_empty() {
                t.finish = AgentFinish::Answered;
                continue;
            }
            if turn + 1 == cfg.max_assistant_turns {
                t.finish = AgentFinish::MaxTurns;
                continue;
            }
            let mut answers = Vec::new();
            for call in parsed.calls.iter().take(cfg.max_parallel_calls) {
                t.tool_calls += 1;
                let answer = match tools.get(&call.name) {
                    None => format!(
                        "Error: there is no tool named {:?}; the tools are: {}",
                        call.name,
                        tools.names()
                    ),
                    Some(tool) => match tool.call(&call.arguments).await {
                        Ok(out) => {
                            t.tool_reward += out.reward.unwrap_or(0.0);
                            out.text
                        }
                        Err(e) => format!("Error: {e}"),
                    },
                };
                answers.push(truncated(answer, cfg.max_tool_response_length));
            }
            answers.extend(parsed.errors.iter().map(|e| format!("Error: {e}")));
            let tool_tokens = chat.tool_turn(&answers);
            let room = cfg.response_length - t.response.len();
            t.push(&tool_tokens[..tool_tokens.len().min(room)], false, None);
            if tool_tokens.len() >= room {
                // No room left for the model to read the answer and reply.
                t.finish = AgentFinish::Length;
                continue;
            }
            still_open.push(i);
        }
        open = still_open;
    }
    Ok(trajectories)
}
