//! verl's `custom_reward_function`: a Python file's `compute_score`, scored in `python3` worker
//! processes. Needs a `python3` on the PATH (or `VERL_PYTHON`), as a verl user's machine has.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};
use verl::python::{PythonReward, RewardCalls};
use verl::traits::RewardInput;
use verl::ConfigBuilder;

mod common;

/// A reward file as a verl user writes one: exact match of the stripped answer, a dict with an
/// extra for one data source, an exception for another, a crash the first time it sees
/// `crash` (a marker file remembers), a hang for `hang`, and a print that must not break the
/// frames.
const REWARD_PY: &str = r#"
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    print("scoring", data_source)
    if data_source == "raises":
        return 1 / 0
    if solution_str == "crash":
        marker = os.path.join(os.path.dirname(__file__), "crashed_once")
        if not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(3)
    if solution_str == "hang":
        time.sleep(30)
    score = 1.0 if solution_str.strip() == ground_truth else 0.0
    if data_source == "with_extra":
        return {"score": score, "length": len(solution_str), "tag": "ignored"}
    if extra_info and "bonus" in extra_info:
        score += extra_info["bonus"]
    return score

def batch_score(data_sources, solution_strs, ground_truths, extra_infos):
    return [float(len(s)) for s in solution_strs]

def prime_score(data_source, solution_str, ground_truth, extra_info=None):
    # As PRIME's verifiers do: a (score, detail) pair, and code that may raise or never end,
    # behind a broad `except Exception` that must not swallow the time limit.
    if data_source == "raises":
        raise ValueError("cannot parse " + solution_str)
    if solution_str == "hang":
        try:
            while True:
                time.sleep(0.01)
        except Exception:
            return (1.0, "swallowed")
    return (1.0 if solution_str.strip() == ground_truth else 0.0, "checked")
"#;

fn reward_file(dir: &Path) -> PathBuf {
    let path = dir.join("my_reward.py");
    std::fs::write(&path, REWARD_PY).unwrap();
    path
}

fn row<'a>(source: &'a str, answer: &'a str, truth: &'a str, extra: &'a Value) -> RewardInput<'a> {
    RewardInput {
        data_source: source,
        solution_str: answer,
        ground_truth: truth,
        extra_info: extra,
    }
}

#[test]
fn a_verl_reward_function_scores_rows_in_order_across_workers() {
    let dir = tempfile::tempdir().unwrap();
    let reward = PythonReward::start(reward_file(dir.path()), "compute_score", false, 3).unwrap();
    let none = Value::Null;
    let bonus = json!({"bonus": 0.5});
    let rows: Vec<_> = (0..10)
        .map(|i| {
            if i % 2 == 0 {
                row("gsm8k", " 4 ", "4", &none)
            } else {
                row("gsm8k", "5", "4", &bonus)
            }
        })
        .collect();
    let scores = reward.score_rows(&rows).unwrap();
    let got: Vec<f64> = scores.iter().map(|s| s.score).collect();
    assert_eq!(got, [1.0, 0.5, 1.0, 0.5, 1.0, 0.5, 1.0, 0.5, 1.0, 0.5]);
    // A dict's numeric entries come back as extras, its score among them (verl's managers
    // keep every entry); a string is no extra.
    let scores = reward
        .score_rows(&[row("with_extra", "4", "4", &none)])
        .unwrap();
    assert_eq!(scores[0].score, 1.0);
    assert_eq!(scores[0].extra.get("length"), Some(&1.0));
    assert_eq!(scores[0].extra.get("score"), Some(&1.0));
    assert!(!scores[0].extra.contains_key("tag"));
    assert_eq!(scores[0].pred, None);
}

#[test]
fn a_batched_reward_function_gets_the_lists() {
    let dir = tempfile::tempdir().unwrap();
    let reward = PythonReward::start(reward_file(dir.path()), "batch_score", true, 2).unwrap();
    let none = Value::Null;
    let rows = [row("a", "xyz", "", &none), row("b", "", "", &none)];
    let got: Vec<f64> = reward
        .score_rows(&rows)
        .unwrap()
        .iter()
        .map(|s| s.score)
        .collect();
    assert_eq!(got, [3.0, 0.0]);
}

#[test]
fn an_exception_names_the_file_function_and_row() {
    let dir = tempfile::tempdir().unwrap();
    let reward = PythonReward::start(reward_file(dir.path()), "compute_score", false, 1).unwrap();
    let none = Value::Null;
    let rows = [
        row("gsm8k", "4", "4", &none),
        row("raises", "4", "4", &none),
    ];
    let e = reward.score_rows(&rows).unwrap_err().to_string();
    assert!(e.contains("my_reward.py::compute_score"), "{e}");
    assert!(e.contains("row 1") && e.contains("raises"), "{e}");
    assert!(e.contains("ZeroDivisionError"), "{e}");
    // The worker lives on after the function raised.
    assert_eq!(reward.score_rows(&rows[..1]).unwrap()[0].score, 1.0);
}

#[test]
fn a_crashed_worker_is_replaced_and_a_hung_one_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let reward = PythonReward::start(reward_file(dir.path()), "compute_score", false, 1)
        .unwrap()
        .with_deadline(Duration::from_secs(2));
    let none = Value::Null;
    // The first worker exits mid-request; its replacement scores the part.
    let scores = reward
        .score_rows(&[row("gsm8k", "crash", "crash", &none)])
        .unwrap();
    assert_eq!(scores[0].score, 1.0);
    let e = reward
        .score_rows(&[row("gsm8k", "hang", "", &none)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("no answer within 2 s"), "{e}");
}

/// verl's prime manager: a row that raises or runs past its limit scores 0, the others keep
/// theirs, a (score, detail) result counts its score, and the worker serves on.
#[test]
fn the_prime_manager_scores_failures_and_time_outs_zero() {
    let dir = tempfile::tempdir().unwrap();
    let reward = PythonReward::start_with(
        reward_file(dir.path()),
        "prime_score",
        RewardCalls::Prime {
            row_timeout: Duration::from_millis(500),
        },
        1,
    )
    .unwrap();
    let none = Value::Null;
    let rows = [
        row("gsm8k", "4", "4", &none),
        row("raises", "4", "4", &none),
        row("gsm8k", "hang", "hang", &none),
        row("gsm8k", "5", "4", &none),
        row("gsm8k", " 7 ", "7", &none),
    ];
    let scores: Vec<f64> = reward
        .score_rows(&rows)
        .unwrap()
        .iter()
        .map(|s| s.score)
        .collect();
    assert_eq!(scores, vec![1.0, 0.0, 0.0, 0.0, 1.0]);
    // The same worker scores the next batch.
    assert_eq!(reward.score_rows(&rows[..1]).unwrap()[0].score, 1.0);
    // Under the per-row manager the same exception is an error.
    let naive = PythonReward::start(reward_file(dir.path()), "prime_score", false, 1).unwrap();
    let e = naive.score_rows(&rows[1..2]).unwrap_err().to_string();
    assert!(e.contains("ValueError") && e.contains("row 0"), "{e}");
}

#[test]
fn a_file_that_does_not_load_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let e = PythonReward::start(reward_file(dir.path()), "no_such_function", false, 1)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("could not load") && e.contains("no_such_function"),
        "{e}"
    );
    let e = PythonReward::start(dir.path().join("missing.py"), "compute_score", false, 1)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("no such file"), "{e}");
}

/// The built-in task trained for `steps` steps with the reward function in `source` (written
/// to `dir`) set as a verl user sets it, plus `extra` overrides; its logged lines.
fn run_with_reward(
    dir: &Path,
    source: &str,
    steps: u64,
    extra: &[&str],
) -> Vec<std::collections::BTreeMap<String, f64>> {
    let path = dir.join("custom_reward.py");
    std::fs::write(&path, source).unwrap();
    let validated = ConfigBuilder::new()
        .overrides(verl::trainer::MAIN_JOB)
        .overrides(common::TINY_JOB.iter().copied())
        .overrides([
            "trainer.sft_warmup_steps=0",
            "trainer.val_before_train=false",
        ])
        .overrides(extra.iter().copied())
        .set("trainer.total_training_steps", steps)
        .set("custom_reward_function.path", path.display())
        .set("trainer.default_local_dir", dir.display())
        .build()
        .unwrap();
    let summary = common::fit(validated);
    common::step_lines(&summary.metrics_path)
}

/// The built-in addition task scored by a Python file instead of the Rust scorer, through the
/// config as a verl user sets it.
#[test]
fn a_run_scores_with_custom_reward_function_path() {
    let dir = tempfile::tempdir().unwrap();
    let lines = run_with_reward(
        dir.path(),
        "import os\n\
         def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    \
         with open(os.path.join(os.path.dirname(__file__), 'calls'), 'a') as f:\n        \
         f.write(data_source + '\\n')\n    \
         return 1.0 if solution_str.strip() == ground_truth.strip() else 0.0\n",
        2,
        &[],
    );
    let steps: Vec<_> = lines.iter().filter(|l| l["step"] >= 1.0).collect();
    assert_eq!(steps.len(), 2);
    for s in steps {
        let score = s["critic/score/mean"];
        assert!((0.0..=1.0).contains(&score), "{score}");
    }
    // Every response of both steps went through the Python function (16 prompts x 8 samples).
    let calls = std::fs::read_to_string(dir.path().join("calls")).unwrap();
    assert!(
        calls.lines().count() >= 2 * 16 * 8,
        "{} calls",
        calls.lines().count()
    );
}

/// `reward_model.reward_manager=prime` through the config: a function that raises on every
/// wrong answer would stop a naive run; under prime those rows score 0 and the run trains.
#[test]
fn a_run_with_the_prime_manager_trains_through_raising_rows() {
    let dir = tempfile::tempdir().unwrap();
    let lines = run_with_reward(
        dir.path(),
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    \
         if solution_str.strip() != ground_truth.strip():\n        \
         raise ValueError('wrong answer')\n    \
         return (1.0, 'right')\n",
        1,
        &["reward_model.reward_manager=prime"],
    );
    let step = lines
        .iter()
        .find(|l| l["step"] == 1.0)
        .expect("step 1 logged");
    let score = step["critic/score/mean"];
    assert!(
        (0.0..1.0).contains(&score),
        "most answers of a fresh policy are wrong: {score}"
    );
}

/// Validation with several responses per prompt and a reward function reporting `acc` and the
/// answer (`pred`), as verl's math_dapo does: verl's `val-core` (acc's mean, best and majority
/// vote at n) and `val-aux` (std, the smaller subsets, the reward) figures, consistent with
/// each other.
#[test]
fn validation_reports_verls_best_worst_and_majority_figures() {
    let dir = tempfile::tempdir().unwrap();
    let lines = run_with_reward(
        dir.path(),
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    \
         right = solution_str.strip() == ground_truth.strip()\n    \
         return {'score': 1.0 if right else -1.0, 'acc': float(right), 'pred': solution_str.strip()}\n",
        0,
        &[
            "trainer.val_before_train=true",
            "trainer.val_only=true",
            "actor_rollout_ref.rollout.val_kwargs.n=4",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
            "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
            &format!("+trainer.validation_data_dir={}", dir.path().join("val").display()),
        ],
    );
    let val = &lines[0];
    let source = val
        .keys()
        .find_map(|k| k.strip_prefix("val-core/")?.strip_suffix("/acc/mean@4"))
        .unwrap_or_else(|| panic!("no val-core acc mean@4: {val:?}"))
        .to_string();
    let get = |name: &str| -> f64 {
        *val.get(name)
            .unwrap_or_else(|| panic!("{name} missing: {val:?}"))
    };
    let core = |m: &str| get(&format!("val-core/{source}/acc/{m}"));
    let aux = |var: &str, m: &str| get(&format!("val-aux/{source}/{var}/{m}"));
    let (mean, best, worst) = (
        core("mean@4"),
        core("best@4/mean"),
        aux("acc", "worst@4/mean"),
    );
    assert!(worst <= mean && mean <= best, "{worst} {mean} {best}");
    assert!((0.0..=1.0).contains(&core("maj@4/mean")));
    assert!(core("best@4/std") >= 0.0 && core("maj@4/std") >= 0.0);
    assert!(aux("acc", "std@4") >= 0.0);
    assert!(aux("acc", "best@2/mean") <= best + 1e-12);
    // The shaped reward is 2·acc − 1, so its figures follow acc's.
    assert!((aux("reward", "mean@4") - (2.0 * mean - 1.0)).abs() < 1e-9);
    assert!((aux("reward", "best@4/mean") - (2.0 * best - 1.0)).abs() < 1e-9);
    // The function's own score is a variable too, as verl keeps it among the extras.
    assert_eq!(aux("score", "mean@4"), aux("reward", "mean@4"));
    // The answer is no number: no variable of its own.
    assert!(!val.keys().any(|k| k.contains("/pred/")), "{val:?}");
    // The dump has a column per extra, the answer among them, as verl's dumps.
    let dump = std::fs::read_to_string(dir.path().join("val/0.jsonl")).unwrap();
    for line in dump.lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        let (acc, output) = (v["acc"].as_f64().unwrap(), v["output"].as_str().unwrap());
        assert_eq!(v["pred"].as_str(), Some(output.trim()), "{v}");
        assert_eq!(v["score"].as_f64(), Some(2.0 * acc - 1.0), "{v}");
    }
    assert_eq!(dump.lines().count() % 4, 0);
}
