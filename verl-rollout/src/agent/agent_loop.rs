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
    /// of the model's next turn (an error where the template cannot write them).
    fn tool_turn(&self, answers: &[String]) -> Result<Vec<u32>, RolloutError>;
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
    pub fn with(self, tool: impl Tool + 'static) -> Self {
        self.with_boxed(Box::new(tool))
    }

    /// The set with a boxed `tool` added (replacing one of the same name).
    pub fn with_boxed(mut self, tool: Box<dyn Tool>) -> Self {
        self.tools.retain(|t| t.name() != tool.name());
        self.tools.push(tool);
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

/// What an engine runs as its agent loop ([`NativeRollout::with_agent`]): the chat template's
/// turns, the tools, and the loop's limits (each call's response budget and sampling replace
/// the config's).
pub struct Agent {
    pub chat: Box<dyn ChatTurns>,
    pub tools: ToolSet,
    pub config: AgentLoopConfig,
}

/// The loop's limits and sampling (verl's `rollout.multi_turn.*`).
#[derive(Debug, Clone)]
pub struct AgentLoopConfig {
    /// Most model turns per trajectory (`max_assistant_turns`); 0 = no limit, as in verl.
    pub max_assistant_turns: usize,
    /// Most tokens of one model turn; `None` (verl's way) = what is left of the budget.
    pub max_turn_tokens: Option<usize>,
    /// Most tokens of the whole response, model and tool turns together (`response_length`).
    pub response_length: usize,
    /// Most tool calls run from one model turn (`max_parallel_calls`); later ones are dropped.
    pub max_parallel_calls: usize,
    /// Most characters of one tool answer shown to the model (`max_tool_response_length`).
    pub max_tool_response_length: usize,
    /// Which part of a longer answer is kept (`tool_response_truncate_side`).
    pub tool_response_truncate_side: TruncateSide,
    pub sampling: SamplingParams,
}

/// The limits verl's `rollout.multi_turn` sets on an agent loop
/// ([`AgentLoopConfig::with_limits`]).
#[derive(Debug, Clone, PartialEq)]
pub struct AgentLimits {
    pub max_assistant_turns: usize,
    pub max_parallel_calls: usize,
    pub max_tool_response_length: usize,
    pub tool_response_truncate_side: TruncateSide,
}

impl AgentLimits {
    /// From verl's keys; what is not built (interaction files, user turns, repeated rollouts,
    /// formats other than hermes) is refused naming the key. The tool file is read by
    /// [`super::ToolConfig`].
    pub fn from_verl(mt: &verl_core::config::MultiTurnConfig) -> Result<Self, RolloutError> {
        let refuse = |field: &'static str, value: String, message: &str| RolloutError::Config {
            field,
            value,
            message: message.into(),
        };
        if let Some(p) = &mt.interaction_config_path {
            return Err(refuse(
                "actor_rollout_ref.rollout.multi_turn.interaction_config_path",
                p.clone(),
                "interactions (user turns) are not built: set it null",
            ));
        }
        if let Some(n) = mt.max_user_turns {
            return Err(refuse(
                "actor_rollout_ref.rollout.multi_turn.max_user_turns",
                n.to_string(),
                "interactions (user turns) are not built: set it null",
            ));
        }
        if let Some(n) = mt.num_repeat_rollouts {
            return Err(refuse(
                "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts",
                n.to_string(),
                "repeated agent rollouts are not built: set it null and use rollout.n",
            ));
        }
        if mt.format != "hermes" {
            return Err(refuse(
                "actor_rollout_ref.rollout.multi_turn.format",
                mt.format.clone(),
                "the tool-call format read is hermes: set it hermes",
            ));
        }
        let side = match mt.tool_response_truncate_side.as_str() {
            "left" => TruncateSide::Left,
            "right" => TruncateSide::Right,
            "middle" => TruncateSide::Middle,
            other => {
                return Err(refuse(
                    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side",
                    other.into(),
                    "use left, right or middle",
                ))
            }
        };
        Ok(Self {
            max_assistant_turns: mt.max_assistant_turns.unwrap_or(0),
            max_parallel_calls: mt.max_parallel_calls,
            max_tool_response_length: mt.max_tool_response_length,
            tool_response_truncate_side: side,
        })
    }
}

impl AgentLoopConfig {
    /// The config with verl's limits in place of its own.
    pub fn with_limits(mut self, limits: &AgentLimits) -> Self {
        self.max_assistant_turns = limits.max_assistant_turns;
        self.max_parallel_calls = limits.max_parallel_calls;
        self.max_tool_response_length = limits.max_tool_response_length;
        self.tool_response_truncate_side = limits.tool_response_truncate_side;
        self
    }
}

/// Which part of a tool answer longer than `max_tool_response_length` the model sees, with
/// verl's markers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TruncateSide {
    /// The start, then `...(truncated)` (verl's `left`).
    Left,
    /// `(truncated)...`, then the end (verl's `right`).
    Right,
    /// Half of the limit from each end around `...(truncated)...` (verl's default).
    #[default]
    Middle,
}

/// One trajectory to run: its prompt (chat template applied) and an id that seeds its samplers.
#[derive(Debug, Clone)]
pub struct AgentRequest {
    pub prompt: Vec<u32>,
    pub id: u64,
    /// The row's `extra_info.tools_kwargs` (verl's layout: `{tool name: {"create_kwargs":
    /// {...}}}`), each tool's `create_kwargs` handed to its calls ([`Tool::call_with`]); `Null`
    /// when the row has none.
    pub tools_kwargs: serde_json::Value,
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
    /// Each response token's log-prob at sampling (0 on the tools' tokens); `None` when the
    /// generator did not give them for every model token.
    pub log_probs: Option<Vec<f32>>,
    pub assistant_turns: usize,
    pub tool_calls: usize,
    /// Calls the model wrote that could not be read (not JSON, no name, cut off): skipped, as
    /// verl skips them.
    pub malformed_calls: usize,
    /// The tools' rewards, added up.
    pub tool_reward: f64,
    /// Each call's reward, for the calls whose tool gave one (verl's `tool_rewards`, which its
    /// reward managers hand the reward function in `extra_info`).
    pub tool_rewards: Vec<f64>,
    pub finish: AgentFinish,
}

impl Trajectory {
    fn push_model(&mut self, tokens: &[u32], log_probs: &[f32]) {
        self.response.extend_from_slice(tokens);
        self.response_mask
            .extend(std::iter::repeat_n(1, tokens.len()));
        match self.log_probs.as_mut() {
            Some(lp) if log_probs.len() == tokens.len() => lp.extend_from_slice(log_probs),
            _ => self.log_probs = None,
        }
    }

    fn push_tool(&mut self, tokens: &[u32]) {
        self.response.extend_from_slice(tokens);
        self.response_mask
            .extend(std::iter::repeat_n(0, tokens.len()));
        if let Some(lp) = self.log_probs.as_mut() {
            lp.extend(std::iter::repeat_n(0.0, tokens.len()));
        }
    }
}

/// SplitMix64's finaliser: a bijection of u64 that spreads every input bit.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The seed of trajectory `id`'s sampler at model turn `turn`: a stream of its own per turn (a
/// turn's draws restart at step 0), and the first turn's is the single-turn request's.
fn turn_seed(id: u64, turn: usize) -> u64 {
    match turn {
        0 => id,
        _ => mix(mix(id) ^ turn as u64),
    }
}

/// `answer` cut to `limit` characters (code points, as verl counts them) on `side`.
fn truncated(answer: String, limit: usize, side: TruncateSide) -> String {
    let chars: Vec<char> = answer.chars().collect();
    if chars.len() <= limit {
        return answer;
    }
    let text = |c: &[char]| c.iter().collect::<String>();
    match side {
        TruncateSide::Left => format!("{}...(truncated)", text(&chars[..limit])),
        TruncateSide::Right => format!("(truncated)...{}", text(&chars[chars.len() - limit..])),
        TruncateSide::Middle => {
            let half = limit / 2;
            format!(
                "{}...(truncated)...{}",
                text(&chars[..half]),
                text(&chars[chars.len() - half..])
            )
        }
    }
}

/// Runs every request's trajectory to its end; see the module doc.
///
/// # Errors
/// A turn limit of 0 tokens; what the generator returns; a tool turn the chat template cannot
/// write (a tool's failure is an answer the model reads, not an error).
pub async fn run_agent_loop(
    generator: &mut impl TurnGenerator,
    chat: &(impl ChatTurns + ?Sized),
    tools: &ToolSet,
    requests: Vec<AgentRequest>,
    cfg: &AgentLoopConfig,
) -> Result<Vec<Trajectory>, RolloutError> {
    if cfg.max_turn_tokens == Some(0) {
        return Err(RolloutError::Config {
            field: "max_turn_tokens",
            value: "0".into(),
            message: "a model turn needs at least one token; leave it unset for the budget's rest"
                .into(),
        });
    }
    let mut trajectories: Vec<Trajectory> = requests
        .iter()
        .map(|r| Trajectory {
            prompt: r.prompt.clone(),
            response: Vec::new(),
            response_mask: Vec::new(),
            log_probs: Some(Vec::new()),
            assistant_turns: 0,
            tool_calls: 0,
            malformed_calls: 0,
            tool_reward: 0.0,
            tool_rewards: Vec::new(),
            finish: AgentFinish::Length,
        })
        .collect();
    // An empty budget leaves every trajectory at Length.
    let mut open: Vec<usize> = (0..requests.len())
        .filter(|_| cfg.response_length > 0)
        .collect();
    let turns = match cfg.max_assistant_turns {
        0 => usize::MAX,
        n => n,
    };
    for turn in 0..turns {
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
                        .unwrap_or(usize::MAX)
                        .min(cfg.response_length - t.response.len()),
                })
            })
            .collect::<Result<Vec<_>, RolloutError>>()?;
        let completions = generator.generate_turn(batch)?;
        let mut still_open = Vec::new();
        for (&i, done) in open.iter().zip(completions) {
            let t = &mut trajectories[i];
            t.assistant_turns += 1;
            // Never past the budget, whatever the generator returned.
            let room = cfg.response_length - t.response.len();
            let n = done.tokens.len().min(room);
            let lp = done.log_probs.get(..n).unwrap_or(&[]);
            t.push_model(&done.tokens[..n], lp);
            if t.response.len() >= cfg.response_length {
                t.finish = AgentFinish::Length;
                continue;
            }
            // Malformed calls are skipped (verl's way); a turn without a readable call ends
            // the trajectory.
            let parsed = parse_hermes(&chat.decode(&done.tokens));
            t.malformed_calls += parsed.errors.len();
            if parsed.calls.is_empty() || cfg.max_parallel_calls == 0 {
                t.finish = AgentFinish::Answered;
                continue;
            }
            if turn + 1 == turns {
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
                    Some(tool) => {
                        let create_kwargs = requests[i]
                            .tools_kwargs
                            .get(&call.name)
                            .and_then(|k| k.get("create_kwargs"))
                            .unwrap_or(&serde_json::Value::Null);
                        match tool.call_with(&call.arguments, create_kwargs).await {
                            Ok(out) => {
                                if let Some(r) = out.reward {
                                    t.tool_reward += r;
                                    t.tool_rewards.push(r);
                                }
                                out.text
                            }
                            Err(e) => format!("Error: {e}"),
                        }
                    }
                };
                answers.push(truncated(
                    answer,
                    cfg.max_tool_response_length,
                    cfg.tool_response_truncate_side,
                ));
            }
            let tool_tokens = chat.tool_turn(&answers)?;
            if tool_tokens.len() >= cfg.response_length - t.response.len() {
                // No room for the answer and a reply: the trajectory ends without the tool
                // turn (verl's way), so the response holds no half answer.
                t.finish = AgentFinish::Length;
                continue;
            }
            t.push_tool(&tool_tokens);
            still_open.push(i);
        }
        open = still_open;
    }
    Ok(trajectories)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verls_multi_turn_keys_become_limits_or_are_refused_by_name() {
        use verl_core::config::MultiTurnConfig;
        let mt = MultiTurnConfig {
            max_assistant_turns: Some(5),
            max_parallel_calls: 2,
            max_tool_response_length: 64,
            tool_response_truncate_side: "left".into(),
            ..Default::default()
        };
        let limits = AgentLimits::from_verl(&mt).unwrap();
        assert_eq!(
            limits,
            AgentLimits {
                max_assistant_turns: 5,
                max_parallel_calls: 2,
                max_tool_response_length: 64,
                tool_response_truncate_side: TruncateSide::Left,
            }
        );
        // null turns: no limit.
        let unlimited = AgentLimits::from_verl(&MultiTurnConfig::default()).unwrap();
        assert_eq!(unlimited.max_assistant_turns, 0);
        // The tool file is ToolConfig's to read.
        let with_file = MultiTurnConfig {
            tool_config_path: Some("t.yaml".into()),
            ..Default::default()
        };
        assert!(AgentLimits::from_verl(&with_file).is_ok());
        for (bad, key) in [
            (
                MultiTurnConfig {
                    format: "gpt-oss".into(),
                    ..Default::default()
                },
                "format",
            ),
            (
                MultiTurnConfig {
                    max_user_turns: Some(1),
                    ..Default::default()
                },
                "max_user_turns",
            ),
            (
                MultiTurnConfig {
                    tool_response_truncate_side: "both".into(),
                    ..Default::default()
                },
                "truncate_side",
            ),
        ] {
            let e = AgentLimits::from_verl(&bad).unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
    }

    #[test]
    fn long_answers_are_cut_on_verls_side_with_its_markers() {
        let answer = "αβγδεζηθικ".to_string(); // 10 characters, 20 bytes
        assert_eq!(truncated(answer.clone(), 10, TruncateSide::Middle), answer);
        assert_eq!(
            truncated(answer.clone(), 4, TruncateSide::Left),
            "αβγδ...(truncated)"
        );
        assert_eq!(
            truncated(answer.clone(), 4, TruncateSide::Right),
            "(truncated)...ηθικ"
        );
        assert_eq!(
            truncated(answer, 4, TruncateSide::Middle),
            "αβ...(truncated)...ικ"
        );
    }

    #[test]
    fn every_trajectory_and_turn_has_its_own_sampler_stream() {
        // Ids as the rollout numbers them ((call << 32) | sample), over calls and turns.
        let mut seen = std::collections::HashSet::new();
        for call in [0u64, 1, 65_536, 65_537] {
            for sample in 0..64u64 {
                for turn in 0..8 {
                    assert!(seen.insert(turn_seed((call << 32) | sample, turn)));
                }
            }
        }
        // The first turn draws what a single-turn request with the same id draws.
        assert_eq!(turn_seed(42, 0), 42);
    }
}
