//! Bad input is refused at setup, before any model exists, with the cause named: fewer rows
//! than a batch, token ids the model has no embedding for, over-long prompts under
//! `data.truncation=error`. And the prompt-length settings are honoured: `data.truncation`
//! cuts as verl does, `data.filter_overlong_prompts` drops.

mod common;

use std::path::Path;

use verl::config::VerlConfig;
use verl::tasks::CharTokenizer;
use verl::trainer::builder::PpoTrainerBuilder;
use verl::trainer::data::PromptRow;
use verl::trainer::{PpoTrainer, MAIN_JOB};
use verl::ConfigBuilder;

/// A batch of 2 prompts, 2 samples each: what the runs that must build use.
const SMALL_BATCH: &[&str] = &[
    "data.train_batch_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.n=2",
];

/// The tiny built-in job (`data.max_prompt_length=8`, `data.train_batch_size=16`) writing
/// under `dir`, with `extra` overrides.
fn config(dir: &Path, extra: &[&str]) -> VerlConfig {
    common::tiny_config(dir, extra)
}

/// An arithmetic prompt given as text.
fn row(prompt: &str) -> PromptRow {
    PromptRow::new(prompt, "verl_rs/arithmetic", "0")
}

/// A prompt given as token ids (as a program that tokenised it itself would).
fn ids_row(ids: Vec<u32>) -> PromptRow {
    PromptRow {
        prompt_ids: ids,
        ..row("1+1=")
    }
}

/// The message `builder` is refused with.
fn refused(builder: PpoTrainerBuilder) -> String {
    match builder.build() {
        Ok(_) => panic!("the trainer was built"),
        Err(e) => e.to_string(),
    }
}

/// Ids of `text` in the built-in task's tokenizer.
fn char_ids(text: &str) -> Vec<u32> {
    CharTokenizer::arithmetic().encode(text).unwrap()
}

/// Fewer rows than `data.train_batch_size` is a setup error naming the key and both numbers
/// (it was a slice-range panic in the training loop): rows from the builder, and from a data
/// file.
#[test]
fn fewer_rows_than_a_batch_are_refused_naming_train_batch_size() {
    let dir = tempfile::tempdir().unwrap();
    let rows = ["1+1=", "2+2=", "3+3="].map(row);
    let e = refused(PpoTrainer::builder(config(dir.path(), &[])).data(rows));
    assert!(
        e.contains("data.train_batch_size = 16") && e.contains("has 3 rows"),
        "{e}"
    );

    let train = dir.path().join("train.jsonl");
    let line = |p: &str| {
        serde_json::json!({
            "data_source": "verl_rs/arithmetic",
            "prompt": [{"role": "user", "content": p}],
            "reward_model": {"ground_truth": "2"},
        })
        .to_string()
    };
    std::fs::write(
        &train,
        [line("1+1="), line("2+2="), line("3+3=")].join("\n"),
    )
    .unwrap();
    // The trainer of the file's rows, with verl's `data.train_max_samples`: refused here.
    let refusal = |max_samples: i64| {
        let validated = ConfigBuilder::new()
            .overrides(MAIN_JOB)
            .set("data.train_files", train.display())
            .set("data.train_max_samples", max_samples)
            .set(
                "trainer.default_local_dir",
                dir.path().join("out").display(),
            )
            .build()
            .unwrap();
        match PpoTrainer::new(validated) {
            Ok(_) => panic!("the trainer was built"),
            Err(e) => e.to_string(),
        }
    };
    let e = refusal(-1);
    assert!(
        e.contains("data.train_batch_size = 16") && e.contains("has 3 rows"),
        "{e}"
    );
    // The cap applies to the file's rows before the batch is counted.
    let e = refusal(2);
    assert!(e.contains("has 2 rows"), "{e}");
}

/// A token id at or above the model's vocab_size (a tokenizer larger than the model) is refused
/// naming the row, the id and the disagreement, instead of failing in the embedding gather:
/// ids given through the embedding API, and an HF model whose config.json has fewer rows than
/// its tokenizer.
#[test]
fn token_ids_beyond_the_models_vocabulary_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = |extra: &[&str]| {
        let mut o = vec!["+actor_rollout_ref.model.override_config.vocab_size=32"];
        o.extend_from_slice(extra);
        config(dir.path(), &o)
    };
    let fine = char_ids("1+1=");
    let e = refused(
        PpoTrainer::builder(cfg(&[])).data([ids_row(fine.clone()), ids_row(vec![2, 3, 32, 4])]),
    );
    assert!(
        e.contains("training prompt 1")
            && e.contains("token id 32")
            && e.contains("vocab_size is 32")
            && e.contains("the tokenizer and the model disagree"),
        "{e}"
    );
    // The validation rows are checked too.
    let e = refused(
        PpoTrainer::builder(cfg(SMALL_BATCH))
            .data([ids_row(fine.clone()), ids_row(fine)])
            .val_data([ids_row(vec![40])]),
    );
    assert!(
        e.contains("validation prompt 0") && e.contains("token id 40"),
        "{e}"
    );

    // An HF model: the qwen2 fixture's tokenizer has 320 tokens (`<|im_start|>` is id 3);
    // its config.json here says 3.
    let model = tempfile::tempdir().unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("verl-megatron/tests/fixtures/qwen2");
    for entry in std::fs::read_dir(&fixture).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), model.path().join(entry.file_name())).unwrap();
    }
    let config_json = model.path().join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_json).unwrap()).unwrap();
    c["vocab_size"] = serde_json::json!(3);
    std::fs::write(&config_json, c.to_string()).unwrap();
    let cfg = ConfigBuilder::new()
        .overrides(MAIN_JOB)
        .overrides([
            "trainer.total_training_steps=2",
            "trainer.sft_warmup_steps=2",
        ])
        .set("actor_rollout_ref.model.path", model.path().display())
        .set("trainer.default_local_dir", dir.path().join("hf").display())
        .resolve()
        .unwrap();
    let e = refused(PpoTrainer::builder(cfg).data([row("1+1=")]));
    assert!(
        e.contains("training prompt 0")
            && e.contains("vocab_size is 3")
            && e.contains("the tokenizer and the model disagree"),
        "{e}"
    );
}

/// `data.truncation=left|right|middle` cuts an over-long prompt to `data.max_prompt_length`
/// (8 here) as verl does — the last 8 tokens, the first 8, the first 4 and the last 4 — and
/// leaves a short one whole; `error` refuses it naming the prompt and the settings.
#[test]
fn over_long_prompts_are_truncated_as_data_truncation_says() {
    let long = "12345+67890=";
    assert_eq!(char_ids(long).len(), 12);
    for (mode, kept) in [
        ("left", "5+67890="),
        ("right", "12345+67"),
        ("middle", "1234890="),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let setting = format!("data.truncation={mode}");
        let mut o = SMALL_BATCH.to_vec();
        o.push(&setting);
        let trainer = PpoTrainer::builder(config(dir.path(), &o))
            .data([row(long), row("1+2=")])
            .build()
            .unwrap_or_else(|e| panic!("{mode}: {e}"));
        let got: Vec<Vec<u32>> = trainer
            .train_rows()
            .iter()
            .map(|r| r.prompt_ids.clone())
            .collect();
        assert_eq!(got, [char_ids(kept), char_ids("1+2=")], "{mode}");
    }

    let dir = tempfile::tempdir().unwrap();
    let mut o = SMALL_BATCH.to_vec();
    o.push("data.truncation=error");
    let cfg = config(dir.path(), &o);
    let e = refused(PpoTrainer::builder(cfg).data([row("1+2="), row(long)]));
    assert!(
        e.contains("training prompt 1")
            && e.contains("12 tokens")
            && e.contains("data.max_prompt_length = 8")
            && e.contains("data.truncation")
            && e.contains("data.filter_overlong_prompts"),
        "{e}"
    );
    // `error` is the default.
    let cfg = config(dir.path(), SMALL_BATCH);
    let e = refused(PpoTrainer::builder(cfg).data([row(long), row(long)]));
    assert!(
        e.contains("training prompt 0") && e.contains("12 tokens"),
        "{e}"
    );
}

/// `data.filter_overlong_prompts=true` drops prompts longer than `data.max_prompt_length`
/// (instead of cutting them), counts the batch after dropping, and refuses a set it would
/// leave empty.
#[test]
fn filter_overlong_prompts_drops_them_and_refuses_an_empty_set() {
    let long = "12345+67890=";
    let dir = tempfile::tempdir().unwrap();
    let mut o = SMALL_BATCH.to_vec();
    // Dropping wins over truncation, as in verl's dataset.
    o.extend(["data.filter_overlong_prompts=true", "data.truncation=left"]);
    let trainer = PpoTrainer::builder(config(dir.path(), &o))
        .data([row(long), row("1+2="), row(long), row("3+4=")])
        .build()
        .unwrap();
    let kept: Vec<&str> = trainer
        .train_rows()
        .iter()
        .map(|r| r.prompt.as_str())
        .collect();
    assert_eq!(kept, ["1+2=", "3+4="]);
    drop(trainer);

    // Every prompt too long: refused, not an empty run.
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &o);
    let e = refused(PpoTrainer::builder(cfg).data([row(long), row(long)]));
    assert!(
        e.contains("data.filter_overlong_prompts dropped every one of the 2 training prompts")
            && e.contains("data.max_prompt_length = 8"),
        "{e}"
    );

    // Fewer rows than a batch once the long ones are dropped: the batch error says so.
    let e = refused(
        PpoTrainer::builder(config(dir.path(), &["data.filter_overlong_prompts=true"]))
            .data((0..18).map(|_| row(long)).chain([row("1+2="), row("3+4=")])),
    );
    assert!(
        e.contains("data.train_batch_size = 16")
            && e.contains("has 2 rows (after data.filter_overlong_prompts)"),
        "{e}"
    );
}

/// A second run on an output directory in use is refused, naming the first run's pid; once the
/// first trainer is gone the directory is free again, and no lock file is left behind.
#[test]
fn a_second_run_on_the_same_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let validated = || {
        verl::ConfigBuilder::new()
            .overrides(verl::trainer::MAIN_JOB)
            .overrides(common::TINY_JOB.iter().copied())
            .overrides([
                "trainer.total_training_steps=1",
                "trainer.sft_warmup_steps=0",
            ])
            .set("trainer.default_local_dir", dir.path().display())
            .build()
            .unwrap()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let first = verl::trainer::PpoTrainer::new(validated()).unwrap();
        let e = match verl::trainer::PpoTrainer::new(validated()) {
            Ok(_) => panic!("a second trainer on the same directory was built"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("trainer.default_local_dir"), "{e}");
        assert!(e.contains(&format!("pid {}", std::process::id())), "{e}");
        drop(first);
        let mut again = verl::trainer::PpoTrainer::new(validated()).unwrap();
        again.fit().await.unwrap();
    });
    assert!(!dir.path().join(".verl-run.lock").exists());
}

/// A value or reward model named as the actor is refused at setup, naming the key, the
/// architecture and where such a model goes (it was accepted without a word).
#[test]
fn a_score_model_as_the_actor_is_refused_naming_the_key() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("verl-megatron/tests/fixtures/qwen2");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json")).unwrap())
            .unwrap();
    for (arch, what) in [
        ("Qwen2ForTokenClassification", "a value model"),
        ("Qwen2ForSequenceClassification", "a reward model"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model");
        std::fs::create_dir(&model).unwrap();
        config["architectures"] = serde_json::json!([arch]);
        config["num_labels"] = serde_json::json!(1);
        std::fs::write(model.join("config.json"), config.to_string()).unwrap();
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(fixture.join(f), model.join(f)).unwrap();
        }
        let cfg = config_with_model(dir.path(), &model);
        let e = refused(PpoTrainer::builder(cfg).data([row("1+1=")]));
        assert!(
            e.contains("actor_rollout_ref.model.path") && e.contains(arch) && e.contains(what),
            "{e}"
        );
    }
}

fn config_with_model(dir: &Path, model: &Path) -> VerlConfig {
    let mut cfg = config(dir, &[]);
    cfg.actor_rollout_ref.model.path = Some(model.display().to_string());
    // The tiny job's sizes are for its scratch model; a path brings its own.
    cfg.actor_rollout_ref.model.override_config.clear();
    cfg
}
