//! The `verl` binary: help, resolved config printing, refusals with the key and the fix.

use std::process::Command;

fn verl(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_verl"))
        .args(args)
        .output()
        .expect("run verl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

const SMALL: &[&str] = &[
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=4",
    "trainer.n_gpus_per_node=4",
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
];

#[test]
fn help_lists_the_commands() {
    let (ok, out, _) = verl(&["--help"]);
    assert!(ok);
    assert!(out.contains("config") && out.contains("topology"), "{out}");
}

#[test]
fn config_print_shows_the_resolved_config() {
    let mut args = vec!["config", "--print"];
    args.extend_from_slice(SMALL);
    let (ok, out, err) = verl(&args);
    assert!(ok, "{err}");
    let printed: serde_yaml::Value = serde_yaml::from_str(&out).expect("valid YAML");
    assert_eq!(
        printed["actor_rollout_ref"]["rollout"]["n"],
        serde_yaml::Value::from(4)
    );
    // Inherited values are resolved in what is printed.
    assert_eq!(
        printed["actor_rollout_ref"]["rollout"]["response_length"],
        printed["data"]["max_response_length"]
    );
    assert!(err.contains("actor dp 2"), "{err}");
}

/// `verl config` resolves what `verl train` would run: with nothing named, the built-in task's
/// settings (and they validate); with a model of the user's own, verl's defaults, and a note
/// that says which.
#[test]
fn config_starts_where_train_starts() {
    let (ok, out, err) = verl(&["config", "--print"]);
    assert!(ok, "{err}");
    assert!(err.contains("the built-in task's settings apply"), "{err}");
    let printed: serde_yaml::Value = serde_yaml::from_str(&out).expect("valid YAML");
    assert_eq!(
        printed["trainer"]["sft_warmup_steps"],
        serde_yaml::Value::from(600)
    );

    let (_, out, err) = verl(&[
        "config",
        "--print",
        "--no-validate",
        "actor_rollout_ref.model.path=/models/mine",
    ]);
    assert!(err.contains("verl's defaults apply"), "{err}");
    let printed: serde_yaml::Value = serde_yaml::from_str(&out).expect("valid YAML");
    assert_eq!(
        printed["trainer"]["sft_warmup_steps"],
        serde_yaml::Value::from(0)
    );
    assert_eq!(
        printed["data"]["train_batch_size"],
        serde_yaml::Value::from(1024)
    );
}

#[test]
fn bad_configs_exit_with_the_key_and_the_fix() {
    let mut args = vec!["config"];
    args.extend_from_slice(SMALL);
    args.push("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3");
    let (ok, _, err) = verl(&args);
    assert!(!ok);
    assert!(
        err.contains("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
            && err.contains("Fix:"),
        "{err}"
    );

    let (ok, _, err) = verl(&["config", "trainer.totl_epochs=2"]);
    assert!(!ok);
    assert!(err.contains("Did you mean `total_epochs`"), "{err}");
}

#[test]
fn topology_prints_megatron_groups() {
    let (ok, out, err) = verl(&[
        "topology",
        "trainer.n_gpus_per_node=8",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("world 8: tp 2 · cp 1 · dp 2 · pp 2"), "{out}");
    assert!(
        out.contains("Tp: [[0, 1], [2, 3], [4, 5], [6, 7]]"),
        "{out}"
    );
    assert!(
        out.contains("Pp: [[0, 4], [1, 5], [2, 6], [3, 7]]"),
        "{out}"
    );
    let (ok, _, err) = verl(&[
        "topology",
        "trainer.n_gpus_per_node=6",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
    ]);
    assert!(
        !ok && err.contains("does not divide the world size 6"),
        "{err}"
    );
}

/// `verl generate` on the qwen2, Qwen3-MoE and Mixtral fixtures: the chat prompt and greedy tokens are
/// transformers'.
#[test]
fn generate_runs_on_a_fixture_and_matches_transformers_greedy() {
    for name in ["qwen2", "qwen3_moe", "mixtral"] {
        generate_matches_transformers(&format!(
            "{}/verl-megatron/tests/fixtures/{name}",
            env!("CARGO_MANIFEST_DIR")
        ));
    }
}

fn generate_matches_transformers(dir: &str) {
    let (ok, out, err) = verl(&[
        "generate",
        "--model",
        dir,
        "--prompt",
        "What is 12 + 7?",
        "--max-new-tokens",
        "8",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{dir}/reference.json")).unwrap())
            .unwrap();
    assert_eq!(v["prompt"], reference["chat_prompt_text"]);
    assert_eq!(v["prompt_ids"], reference["chat_prompt_ids"]);
    let full: Vec<u64> = reference["chat_greedy_output"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    let n = v["prompt_ids"].as_array().unwrap().len();
    let expected: Vec<u64> = full[n..].iter().copied().take_while(|&t| t != 2).collect();
    let got: Vec<u64> = v["response_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    // Greedy tokens equal transformers' up to (and including) an EOS, where we stop.
    assert_eq!(
        got.iter()
            .copied()
            .take_while(|&t| t != 2)
            .collect::<Vec<_>>(),
        expected
    );

    let (ok, _, err) = verl(&["generate", "--model", "/nonexistent", "--prompt", "hi"]);
    assert!(!ok && err.contains("/nonexistent"), "{err}");
    let (ok, out, _) = verl(&[
        "generate",
        "--model",
        dir,
        "--prompt",
        "abc",
        "--raw",
        "--temperature",
        "0.8",
        "--seed",
        "3",
        "--max-new-tokens",
        "4",
    ]);
    assert!(ok && !out.is_empty());
}

#[test]
fn generate_batches_prompts_and_samples_n_per_prompt() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/verl-megatron/tests/fixtures/qwen2"
    );
    let args = [
        "generate",
        "--model",
        dir,
        "--prompt",
        "one",
        "--prompt",
        "two",
        "--n",
        "3",
        "--temperature",
        "1.0",
        "--top-k",
        "20",
        "--max-new-tokens",
        "6",
        "--json",
    ];
    let (ok, out, err) = verl(&args);
    assert!(ok, "{err}");
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6);
    for (j, l) in lines.iter().enumerate() {
        assert!(l["prompt"]
            .as_str()
            .unwrap()
            .contains(["one", "two"][j / 3]));
        let ids = l["response_ids"].as_array().unwrap();
        assert!(!ids.is_empty() && ids.len() <= 6);
    }
    // Seeded: the same command gives the same samples.
    let (_, again, _) = verl(&args);
    assert_eq!(out, again);
    let (ok, _, err) = verl(&[
        "generate", "--model", dir, "--prompt", "x", "--top-p", "1.5",
    ]);
    assert!(!ok && err.contains("top_p"), "{err}");
    // The fixture's context is 256 tokens: a request past it is refused by name, before any
    // weight loads, with the largest --max-new-tokens that fits.
    let (ok, _, err) = verl(&[
        "generate",
        "--model",
        dir,
        "--prompt",
        "x",
        "--raw",
        "--max-new-tokens",
        "1000",
    ]);
    assert!(!ok, "a request past the context ran");
    assert!(
        err.contains("--max-new-tokens 1000")
            && err.contains("max_position_embeddings")
            && err.contains("at most 255"),
        "{err}"
    );
}

/// A tokenizer whose ids pass the model's vocabulary is refused by name, not a panic.
#[test]
fn generate_refuses_a_tokenizer_past_the_vocabulary() {
    let fixture =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("verl-megatron/tests/fixtures/qwen2");
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&fixture).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    // The same weights, a config claiming a vocabulary smaller than the tokenizer's ids.
    let config = dir.path().join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    v["vocab_size"] = 4.into();
    std::fs::write(&config, v.to_string()).unwrap();
    let (ok, _, err) = verl(&[
        "generate",
        "--model",
        dir.path().to_str().unwrap(),
        "--prompt",
        "hello",
        "--raw",
    ]);
    assert!(!ok, "ran with a tokenizer past the vocabulary");
    assert!(
        err.contains("--prompt 1") && err.contains("vocab_size") && !err.contains("panicked"),
        "{err}"
    );
}

#[test]
fn generate_stops_at_the_token_completing_a_stop_string() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/verl-megatron/tests/fixtures/qwen2"
    );
    let run = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "generate",
            "--model",
            dir,
            "--prompt",
            "abc",
            "--raw",
            "--max-new-tokens",
            "12",
            "--json",
        ];
        args.extend_from_slice(extra);
        let (ok, out, err) = verl(&args);
        assert!(ok, "{err}");
        serde_json::from_str(out.trim()).unwrap()
    };
    let ids = |v: &serde_json::Value| -> Vec<u64> {
        v["response_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    let free = run(&[]);
    let text: Vec<char> = free["response"].as_str().unwrap().chars().collect();
    assert!(
        text.len() >= 4,
        "the fixture's greedy response is long enough: {text:?}"
    );
    // Two characters from the middle of the free response.
    let stop: String = text[text.len() / 2..text.len() / 2 + 2].iter().collect();
    let stopped = run(&["--stop", &stop]);
    let (all, cut) = (ids(&free), ids(&stopped));
    assert!(cut.len() < all.len(), "{cut:?} vs {all:?}");
    assert_eq!(cut, all[..cut.len()], "the stopped response is a prefix");
    assert!(stopped["response"].as_str().unwrap().contains(&stop));
    assert_eq!(stopped["finish_reason"], "stop");
    let (ok, _, err) = verl(&["generate", "--model", dir, "--prompt", "abc", "--stop", ""]);
    assert!(!ok && err.contains("stop"), "{err}");
}

/// A copy of the qwen2 fixture in a temporary directory, without the files `drop` names and
/// with `edit` applied to its config.json.
fn fixture_copy(drop: &[&str], edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let src = std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/verl-megatron/tests/fixtures/qwen2"
    ));
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if !drop.iter().any(|d| name.to_str() == Some(*d)) {
            std::fs::copy(entry.path(), dir.path().join(&name)).unwrap();
        }
    }
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
    dir
}

/// A value or reward model has no next-token head: `generate` refuses it by architecture
/// rather than printing empty responses.
#[test]
fn generate_refuses_value_and_reward_models() {
    for arch in [
        "Qwen2ForTokenClassification",
        "Qwen2ForSequenceClassification",
    ] {
        let dir = fixture_copy(&[], |c| {
            c["architectures"] = serde_json::json!([arch]);
            c["num_labels"] = serde_json::json!(1);
        });
        let (ok, out, err) = verl(&[
            "generate",
            "--model",
            dir.path().to_str().unwrap(),
            "--prompt",
            "abc",
            "--max-new-tokens",
            "4",
        ]);
        assert!(!ok, "{arch}: {out}");
        assert!(
            err.contains(arch) && err.contains("ForCausalLM") && err.contains("causal LM"),
            "{arch}: {err}"
        );
        assert!(out.is_empty(), "{arch}: nothing is generated: {out}");
    }
}

/// A base model with no chat template: the prompt is used as is (as with --raw), with a note on
/// stderr, and the output is the --raw output.
#[test]
fn generate_without_a_chat_template_uses_the_raw_prompt() {
    let dir = fixture_copy(&["chat_template.jinja"], |_| {});
    let model = dir.path().to_str().unwrap();
    let args = |raw: bool| {
        let mut a = vec![
            "generate",
            "--model",
            model,
            "--prompt",
            "abc",
            "--max-new-tokens",
            "6",
            "--json",
        ];
        if raw {
            a.push("--raw");
        }
        a
    };
    let (ok, out, err) = verl(&args(false));
    assert!(ok, "{err}");
    assert!(
        err.contains("no chat template") && err.contains("--raw"),
        "{err}"
    );
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["prompt"], "abc", "the prompt is not wrapped");
    let (ok, raw_out, raw_err) = verl(&args(true));
    assert!(ok, "{raw_err}");
    assert_eq!(out, raw_out);
    assert!(
        !raw_err.contains("no chat template"),
        "--raw asks for no template: no note ({raw_err})"
    );
    let (_, help, _) = verl(&["generate", "--help"]);
    assert!(help.contains("has none"), "{help}");
}

/// `verl train` with the torch profiler writes a capture that `verl profile summarize` reads
/// back into a table of the worker methods.
#[test]
fn a_profiled_step_is_summarized() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let profile = dir.path().join("profile");
    let (ok, _, err) = verl(&[
        "train",
        "data.train_files=builtin:addition:1",
        "trainer.total_training_steps=1",
        "trainer.sft_warmup_steps=0",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "global_profiler.tool=torch",
        "global_profiler.steps=[1]",
        "actor_rollout_ref.actor.profiler.enable=true",
        "actor_rollout_ref.actor.profiler.ranks=[0]",
        &format!("global_profiler.save_path={}", profile.display()),
        &format!("trainer.default_local_dir={}", out.display()),
    ]);
    assert!(ok, "{err}");
    let trace = profile.join("actor/step1_prof_rank-0.json.gz");
    let (ok, table, err) = verl(&[
        "profile",
        "summarize",
        trace.to_str().unwrap(),
        "--top",
        "5",
    ]);
    assert!(ok, "{err}");
    for name in ["generate_sequences", "update_actor"] {
        assert!(table.contains(name), "{table}");
    }
    let (ok, _, err) = verl(&["profile", "summarize", "/nonexistent.json.gz"]);
    assert!(!ok && err.contains("/nonexistent.json.gz"), "{err}");
}

/// A model named by its hub id is found in the local Hugging Face cache (the hub's layout,
/// `refs/main` naming the snapshot); one that is not there is an error saying where it looked.
#[test]
fn a_hub_id_resolves_from_the_local_cache() {
    let cache = tempfile::tempdir().unwrap();
    let repo = cache.path().join("models--acme--tiny-qwen2");
    let snapshot = repo.join("snapshots/0123abcd");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123abcd\n").unwrap();
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/verl-megatron/tests/fixtures/qwen2"
    );
    for entry in std::fs::read_dir(fixture).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), snapshot.join(entry.file_name())).unwrap();
    }
    let run = |model: &str| {
        Command::new(env!("CARGO_BIN_EXE_verl"))
            .args([
                "generate",
                "--model",
                model,
                "--prompt",
                "hi",
                "--max-new-tokens",
                "2",
            ])
            .env("HF_HUB_CACHE", cache.path())
            .output()
            .unwrap()
    };
    let out = run("acme/tiny-qwen2");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run("acme/absent");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("models--acme--absent") && err.contains("nothing is downloaded"),
        "{err}"
    );
}

/// A config named on the command line is read only if it is a regular file: a device or a
/// directory is refused naming it, where reading it would never end (or fill memory).
#[test]
fn devices_and_directories_are_refused_as_the_config() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, _, err) = verl(&["config", "--config", "/dev/zero"]);
    assert!(!ok);
    assert!(
        err.contains("/dev/zero") && err.contains("regular file"),
        "{err}"
    );
    let (ok, _, err) = verl(&["config", "--config", dir.path().to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("a directory"), "{err}");
}
