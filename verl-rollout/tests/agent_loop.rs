//! The agent loop: model and tool turns in one response with the tools' tokens masked out of
//! the loss, the budgets and turn limits, tool errors handed back to the model, and the real
//! engine as the turn generator.

use std::collections::{HashMap, VecDeque};

use futures::executor::block_on;
use proptest::prelude::*;
use verl_rollout::agent::{
    render_hermes, run_agent_loop, AgentFinish, AgentLoopConfig, AgentRequest, Calculator,
    ChatTurns, PythonCode, ToolCall, ToolSet, Trajectory, TruncateSide, TurnGenerator,
};
use verl_rollout::{Completion, FinishReason, Request, RolloutError, SamplingParams};

/// One token a byte.
struct Bytes;

impl ChatTurns for Bytes {
    fn decode(&self, tokens: &[u32]) -> String {
        tokens.iter().map(|&t| t as u8 as char).collect()
    }
    fn tool_turn(&self, answers: &[String]) -> Result<Vec<u32>, RolloutError> {
        let text: String = answers.iter().map(|a| format!("[{a}]")).collect();
        Ok(tokens(&format!("<{text}>")))
    }
}

fn tokens(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// Replies from a script per trajectory (found by the first byte of its prompt), each token's
/// log-prob -0.5; keeps the requests it saw.
struct Script {
    replies: HashMap<u32, VecDeque<String>>,
    seen: Vec<(Vec<u32>, usize)>,
}

impl Script {
    fn new(replies: &[(char, &[&str])]) -> Self {
        Self {
            replies: replies
                .iter()
                .map(|(k, r)| (*k as u32, r.iter().map(|s| s.to_string()).collect()))
                .collect(),
            seen: Vec::new(),
        }
    }
}

impl TurnGenerator for Script {
    fn generate_turn(&mut self, requests: Vec<Request>) -> Result<Vec<Completion>, RolloutError> {
        Ok(requests
            .into_iter()
            .map(|r| {
                self.seen.push((r.prompt.clone(), r.max_new_tokens));
                let reply = self
                    .replies
                    .get_mut(&r.prompt[0])
                    .and_then(VecDeque::pop_front)
                    .unwrap_or_else(|| "done".into());
                let mut t = tokens(&reply);
                let finish = match t.len() > r.max_new_tokens {
                    true => FinishReason::Length,
                    false => FinishReason::Stop,
                };
                t.truncate(r.max_new_tokens);
                Completion {
                    log_probs: vec![-0.5; t.len()],
                    tokens: t,
                    finish,
                    routed_experts: Vec::new(),
                }
            })
            .collect())
    }
}

/// One trajectory of prompt "A" through the loop.
fn run_one(script: &mut Script, tools: &ToolSet, cfg: &AgentLoopConfig) -> Trajectory {
    let out = block_on(run_agent_loop(
        script,
        &Bytes,
        tools,
        vec![request("A", 1)],
        cfg,
    ));
    out.unwrap().remove(0)
}

fn config(response_length: usize) -> AgentLoopConfig {
    AgentLoopConfig {
        max_assistant_turns: 4,
        max_turn_tokens: Some(200),
        response_length,
        max_parallel_calls: 2,
        max_tool_response_length: 16,
        tool_response_truncate_side: TruncateSide::Middle,
        sampling: SamplingParams::default(),
    }
}

fn call(expression: &str) -> String {
    render_hermes(
        "",
        &[ToolCall {
            name: "calculator".into(),
            arguments: serde_json::json!({ "expression": expression }),
        }],
    )
}

fn request(prompt: &str, id: u64) -> AgentRequest {
    AgentRequest {
        prompt: tokens(prompt),
        id,
        tools_kwargs: serde_json::Value::Null,
    }
}

/// A trajectory that calls the calculator and then answers, beside one that answers at once:
/// the response is model turn, tool turn, model turn; the mask covers the model's tokens only
/// and so do the log-probs; the second turn is generated from the whole conversation.
#[test]
fn a_tool_turn_sits_between_model_turns_masked_out() {
    let first = call("6*7");
    let mut script = Script::new(&[('A', &[&first, "It is 42."]), ('B', &["No tool."])]);
    let tools = ToolSet::new().with(Calculator);
    let requests = vec![request("A: 6 times 7?", 1), request("B: hi", 2)];
    let out = block_on(run_agent_loop(
        &mut script,
        &Bytes,
        &tools,
        requests,
        &config(300),
    ))
    .unwrap();
    let a = &out[0];
    let expected = [tokens(&first), tokens("<[42]>"), tokens("It is 42.")];
    assert_eq!(a.response, expected.concat());
    let mask: Vec<u8> = expected
        .iter()
        .zip([1u8, 0, 1])
        .flat_map(|(t, m)| std::iter::repeat_n(m, t.len()))
        .collect();
    assert_eq!(a.response_mask, mask);
    let lp: Vec<f32> = mask
        .iter()
        .map(|&m| if m == 1 { -0.5 } else { 0.0 })
        .collect();
    assert_eq!(a.log_probs, Some(lp));
    assert_eq!(
        (a.assistant_turns, a.tool_calls, a.finish),
        (2, 1, AgentFinish::Answered)
    );
    let b = &out[1];
    assert_eq!(b.response, tokens("No tool."));
    assert_eq!(
        (b.assistant_turns, b.tool_calls, b.finish),
        (1, 0, AgentFinish::Answered)
    );
    // Turn 2 of A was asked with the prompt, turn 1 and the tool turn.
    let (second, _) = &script.seen[2];
    assert_eq!(
        second,
        &[tokens("A: 6 times 7?"), tokens(&first), tokens("<[42]>")].concat()
    );
}

/// The Python code tool in a trajectory (needs `python3`, as the reward-function tests do):
/// the model's program runs and its output is the tool turn the next model turn sees.
#[test]
fn the_code_tool_answers_with_what_the_program_printed() {
    let first = render_hermes(
        "",
        &[ToolCall {
            name: "code_interpreter".into(),
            arguments: serde_json::json!({ "code": "print(6 * 7)" }),
        }],
    );
    let mut script = Script::new(&[('A', &[&first, "It is 42."])]);
    let tools = ToolSet::new().with(PythonCode::default());
    let t = run_one(&mut script, &tools, &config(300));
    let expected = [tokens(&first), tokens("<[42\n]>"), tokens("It is 42.")];
    assert_eq!(t.response, expected.concat());
    assert_eq!((t.tool_calls, t.finish), (1, AgentFinish::Answered));
}

/// Unknown tools and bad arguments come back to the model as errors; malformed calls are
/// skipped and counted; calls past max_parallel_calls are dropped; long answers are cut in the
/// middle.
#[test]
fn tool_errors_are_answers_the_model_reads() {
    let calls = render_hermes(
        "",
        &[
            ToolCall {
                name: "search".into(),
                arguments: serde_json::json!({}),
            },
            ToolCall {
                name: "calculator".into(),
                arguments: serde_json::json!({"expression": "x + 1"}),
            },
            ToolCall {
                name: "calculator".into(),
                arguments: serde_json::json!({"expression": "1 + 1"}),
            },
        ],
    ) + "<tool_call>oops</tool_call>";
    let tools = ToolSet::new().with(Calculator);
    let run = |limit: usize| {
        let mut script = Script::new(&[('A', &[&calls, "ok"])]);
        let cfg = AgentLoopConfig {
            max_tool_response_length: limit,
            max_turn_tokens: None,
            ..config(2000)
        };
        run_one(&mut script, &tools, &cfg)
    };
    let t = run(200);
    let text = Bytes.decode(&t.response);
    assert!(
        text.contains("[Error: there is no tool named \"search\"; the tools are: calculator]"),
        "{text}"
    );
    assert!(
        text.contains("[Error: tool calculator: bad arguments: "),
        "{text}"
    );
    // The malformed call is skipped, as verl skips it.
    assert_eq!(t.malformed_calls, 1);
    assert!(!text.contains("not JSON"), "{text}");
    // The third call was past max_parallel_calls = 2.
    assert_eq!(t.tool_calls, 2);
    assert!(!text.contains("[2]"), "{text}");
    // Answers cut at 16 characters.
    let text = Bytes.decode(&run(16).response);
    assert!(
        text.contains("[Error: t...(truncated)...lculator]"),
        "{text}"
    );
}

/// The budget bounds the whole response: a tool turn that does not leave room for a reply
/// ends the trajectory without being added (verl's way), and each model turn is asked for at
/// most what is left; a model that keeps calling stops at max_assistant_turns.
#[test]
fn budgets_and_turn_limits_end_trajectories() {
    let c = call("1+1");
    let mut script = Script::new(&[('A', &[&c, &c, &c, &c, &c])]);
    let tools = ToolSet::new().with(Calculator);
    let limit = c.len() + 3;
    let out = [run_one(&mut script, &tools, &config(limit))];
    // The tool turn "<[2]>" does not fit the 3 tokens left: the trajectory ends without it.
    assert_eq!(out[0].response, tokens(&c));
    assert_eq!(out[0].finish, AgentFinish::Length);
    assert!(out[0].response_mask.iter().all(|&m| m == 1));
    // A budget the tool turn fits: the next model turn is asked for what is left.
    let mut script = Script::new(&[('A', &[&c, &c])]);
    let limit = c.len() + 5 + 7;
    let out = [run_one(&mut script, &tools, &config(limit))];
    assert_eq!(script.seen[1].1, 7);
    assert_eq!(out[0].response.len(), limit);
    assert_eq!(out[0].finish, AgentFinish::Length);
    let mut script = Script::new(&[('A', &[&c, &c, &c, &c, &c])]);
    let out = [run_one(&mut script, &tools, &config(10_000))];
    assert_eq!(
        (out[0].assistant_turns, out[0].finish),
        (4, AgentFinish::MaxTurns)
    );
    assert_eq!(out[0].tool_calls, 3, "the last turn's call is not run");
    assert!(script.seen.iter().all(|(_, max)| *max <= 200));
}

proptest! {
    /// Whatever the model writes, turn by turn: the response never exceeds the budget, the
    /// mask's ones are exactly the tokens the model generated (in order), its zeros the tool
    /// turns, and no trajectory takes more than max_assistant_turns turns.
    #[test]
    fn masks_and_budgets_hold_for_any_script(
        turns in proptest::collection::vec((any::<bool>(), "[a-z ]{0,30}"), 1..6),
        budget in 1usize..400,
    ) {
        let replies: Vec<String> = turns
            .iter()
            .map(|(calls, text)| if *calls { format!("{text}{}", call("2*3")) } else { text.clone() })
            .collect();
        let refs: Vec<&str> = replies.iter().map(String::as_str).collect();
        let mut script = Script::new(&[('A', &refs)]);
        let tools = ToolSet::new().with(Calculator);
        let out = [run_one(&mut script, &tools, &config(budget))];
        let t = &out[0];
        prop_assert!(t.response.len() <= budget);
        prop_assert_eq!(t.response.len(), t.response_mask.len());
        prop_assert!(t.assistant_turns <= 4);
        let model: Vec<u32> = t.response.iter().zip(&t.response_mask).filter(|(_, &m)| m == 1).map(|(&x, _)| x).collect();
        // The script answers "done" once its replies run out.
        let generated: Vec<u32> = replies
            .iter()
            .map(String::as_str)
            .chain(std::iter::repeat("done"))
            .take(t.assistant_turns)
            .flat_map(tokens)
            .collect();
        // The model's tokens are its replies in order (the last one possibly cut by the budget).
        prop_assert!(generated.starts_with(&model), "{:?}", t);
        prop_assert_eq!(t.response_mask.iter().filter(|&&m| m == 1).count(), model.len());
    }
}

/// Each trajectory's tools read its row's `tools_kwargs` (verl's `create_kwargs`): the GSM8K
/// tool scores the submitted answer against that row's ground truth, and a row without them
/// scores nothing.
#[test]
fn tools_read_their_rows_create_kwargs() {
    use verl_rollout::agent::Gsm8kTool;
    let submit = render_hermes(
        "",
        &[ToolCall {
            name: "calc_gsm8k_reward".into(),
            arguments: serde_json::json!({ "answer": "4" }),
        }],
    );
    let mut script = Script::new(&[('A', &[&submit, "ok"]), ('B', &[&submit, "ok"])]);
    let tools = ToolSet::new().with(Gsm8kTool::default());
    let mut with_truth = request("A", 1);
    with_truth.tools_kwargs =
        serde_json::json!({"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "4"}}});
    let mut cfg = config(300);
    cfg.max_tool_response_length = 100;
    let out = block_on(run_agent_loop(
        &mut script,
        &Bytes,
        &tools,
        vec![with_truth, request("B", 2)],
        &cfg,
    ))
    .unwrap();
    // The tool's answer between the Bytes template's "<[" and "]>", then the reply.
    let response = |reward: &str| {
        let answer = format!("<[Current parsed answer='4' reward={reward}]>");
        [tokens(&submit), tokens(&answer), tokens("ok")].concat()
    };
    assert_eq!(out[0].response, response("1.0"));
    assert_eq!(out[0].tool_reward, 0.0);
    assert_eq!(out[0].tool_rewards, [0.0]);
    assert_eq!(out[1].response, response("0.0"));
    assert_eq!(out[1].tool_rewards, [-0.05]);
    assert_eq!(out[1].tool_reward, -0.05);
}
