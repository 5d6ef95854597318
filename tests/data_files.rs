//! verl's dataset files: parquet in the layout pandas/pyarrow write (verl's
//! `examples/data_preprocess` scripts), JSONL and JSON arrays, read to the same rows; bad rows
//! named by file, place and field.

mod common;

use std::path::Path;
use std::sync::Arc;

use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;
use serde_json::{json, Value};
use verl::tasks::CharTokenizer;
use verl::trainer::data::{file_rows, Codec, DataFileError, RowAt};

use common::verl_rows::{write_parquet as write_rows, VerlRow as Row};

fn rows() -> Vec<Row> {
    vec![
        Row::new(
            "verl_rs/arithmetic",
            &[("system", "be brief"), ("user", "12+30=")],
            Some("42"),
            0,
        ),
        Row::new("verl_rs/arithmetic", &[("user", "7+8=")], Some("15"), 1),
        Row::new("openai/gsm8k", &[("user", "1+1=")], Some("2"), 2),
    ]
}

/// Writes `rows` as pyarrow does from a pandas frame of verl's columns, snappy-compressed.
fn write_parquet(path: &Path, rows: &[Row]) {
    let props = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .build();
    write_rows(path, rows, props);
}

/// `r` as the JSON object verl's JSONL rows are.
fn row_json(r: &Row) -> Value {
    r.to_json()
}

/// `values` one per line.
fn write_lines(path: &Path, values: &[Value]) {
    let text: Vec<String> = values.iter().map(Value::to_string).collect();
    std::fs::write(path, text.join("\n") + "\n").unwrap();
}

fn write_jsonl(path: &Path, rows: &[Row]) {
    write_lines(path, &rows.iter().map(row_json).collect::<Vec<_>>());
}

fn codec() -> Codec {
    Codec::Char(CharTokenizer::arithmetic())
}

#[test]
fn parquet_and_jsonl_read_to_the_same_rows() {
    let dir = tempfile::tempdir().unwrap();
    let (pq, jl) = (
        dir.path().join("train.parquet"),
        dir.path().join("train.jsonl"),
    );
    write_parquet(&pq, &rows());
    write_jsonl(&jl, &rows());
    let from_parquet = file_rows(&pq, &codec(), "prompt", "data_source").unwrap();
    let from_jsonl = file_rows(&jl, &codec(), "prompt", "data_source").unwrap();
    assert_eq!(from_parquet, from_jsonl);

    assert_eq!(from_parquet.len(), 3);
    let first = &from_parquet[0];
    // The user turn is the prompt; the character tokenizer encodes it.
    assert_eq!(first.prompt, "12+30=");
    assert_eq!(
        first.prompt_ids,
        CharTokenizer::arithmetic().encode("12+30=").unwrap()
    );
    assert_eq!(first.ground_truth, "42");
    assert_eq!(first.data_source, "verl_rs/arithmetic");
    assert_eq!(first.extra_info, json!({"index": 0, "split": "train"}));
    assert_eq!(from_parquet[2].data_source, "openai/gsm8k");
    assert_eq!(from_parquet[2].extra_info["index"], json!(2));
}

/// `data.reward_fn_key` names the column that picks each row's scorer.
#[test]
fn reward_fn_key_names_the_data_source_column() {
    let dir = tempfile::tempdir().unwrap();
    let jl = dir.path().join("train.jsonl");
    write_jsonl(&jl, &rows());
    let text = std::fs::read_to_string(&jl)
        .unwrap()
        .replace("\"data_source\"", "\"ability\"");
    std::fs::write(&jl, text).unwrap();
    let by_ability = file_rows(&jl, &codec(), "prompt", "ability").unwrap();
    assert_eq!(by_ability[2].data_source, "openai/gsm8k");
    // The default column is gone from this file: the source is unknown.
    let by_default = file_rows(&jl, &codec(), "prompt", "data_source").unwrap();
    assert_eq!(by_default[2].data_source, "unknown");
}

#[test]
fn a_bad_row_is_named_by_its_index() {
    let dir = tempfile::tempdir().unwrap();
    let mut bad = rows();
    bad[1].truth = None;
    let (pq, jl) = (dir.path().join("bad.parquet"), dir.path().join("bad.jsonl"));
    write_parquet(&pq, &bad);
    write_jsonl(&jl, &bad);
    let err = file_rows(&pq, &codec(), "prompt", "data_source")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("row 1") && err.contains("reward_model.ground_truth"),
        "{err}"
    );
    let err = file_rows(&jl, &codec(), "prompt", "data_source")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("line 2") && err.contains("reward_model.ground_truth"),
        "{err}"
    );

    // A prompt column under another name: the error says which key to set.
    let err = file_rows(&pq, &codec(), "question", "data_source")
        .unwrap_err()
        .to_string();
    assert!(err.contains("data.prompt_key"), "{err}");
    // A character the tokenizer lacks is refused with the row.
    let mut odd = rows();
    odd[2].messages = vec![("user".into(), "what is 1+1?".into())];
    write_jsonl(&jl, &odd);
    let err = file_rows(&jl, &codec(), "prompt", "data_source")
        .unwrap_err()
        .to_string();
    assert!(err.contains("line 3"), "{err}");
    // Unknown extensions are refused.
    let err = file_rows(&dir.path().join("x.csv"), &codec(), "prompt", "data_source")
        .unwrap_err()
        .to_string();
    assert!(err.contains(".parquet, .jsonl or .json"), "{err}");
}

/// The place, field and message of a field error.
fn field_error(err: DataFileError) -> (RowAt, String, String) {
    let text = err.to_string();
    match err {
        DataFileError::Field { at, field, .. } => (at, field, text),
        other => panic!("expected a field error, got {other}"),
    }
}

/// A two-row parquet file whose `data_source` column is INT64: null in row 0 (read as
/// `unknown`, as a missing column is), 7 in row 1.
fn write_parquet_numeric_source(path: &Path) {
    let schema = parse_message_type(
        "message schema {
            OPTIONAL INT64 data_source;
            OPTIONAL BYTE_ARRAY prompt (UTF8);
            OPTIONAL group reward_model {
                OPTIONAL BYTE_ARRAY ground_truth (UTF8);
            }
        }",
    )
    .unwrap();
    let props = WriterProperties::builder().build();
    let file = std::fs::File::create(path).unwrap();
    let mut writer = SerializedFileWriter::new(file, Arc::new(schema), Arc::new(props)).unwrap();
    let mut group = writer.next_row_group().unwrap();
    let mut col = group.next_column().unwrap().unwrap();
    col.typed::<Int64Type>()
        .write_batch(&[7], Some(&[0i16, 1][..]), None)
        .unwrap();
    col.close().unwrap();
    for (values, def) in [(["1+1=", "1+2="], 1i16), (["2", "3"], 2)] {
        let mut col = group.next_column().unwrap().unwrap();
        let values: Vec<ByteArray> = values.iter().map(|v| ByteArray::from(*v)).collect();
        col.typed::<ByteArrayType>()
            .write_batch(&values, Some(&[def, def][..]), None)
            .unwrap();
        col.close().unwrap();
    }
    group.close().unwrap();
    writer.close().unwrap();
}

/// A field of the wrong type (`data_source: 7`) is refused naming the file, the row (1-based
/// line in JSONL, 0-based index in a JSON array or parquet) and the field.
#[test]
fn a_malformed_field_names_the_file_row_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let (jl, js) = (dir.path().join("bad.jsonl"), dir.path().join("bad.json"));
    let cases = [
        ("/data_source", json!(7), "data_source", "a number (7)"),
        ("/prompt", json!(5), "prompt", "a number (5)"),
        (
            "/prompt/0/content",
            json!(3),
            "prompt[0].content",
            "a number (3)",
        ),
        ("/prompt/0", json!("hi"), "prompt[0]", "a string (\"hi\")"),
        (
            "/reward_model",
            json!("15"),
            "reward_model",
            "a string (\"15\")",
        ),
    ];
    for (pointer, value, field, found) in cases {
        let mut bad: Vec<Value> = rows().iter().map(row_json).collect();
        *bad[1].pointer_mut(pointer).unwrap() = value;

        write_lines(&jl, &bad);
        let err = file_rows(&jl, &codec(), "prompt", "data_source").unwrap_err();
        let (at, named, text) = field_error(err);
        assert_eq!((at, named.as_str()), (RowAt::Line(2), field), "{text}");
        for part in [
            jl.display().to_string(),
            "line 2".to_string(),
            format!("`{field}`"),
            found.to_string(),
        ] {
            assert!(text.contains(&part), "{part}: {text}");
        }

        std::fs::write(&js, Value::Array(bad).to_string()).unwrap();
        let err = file_rows(&js, &codec(), "prompt", "data_source").unwrap_err();
        let (at, named, text) = field_error(err);
        assert_eq!((at, named.as_str()), (RowAt::Row(1), field), "{text}");
        assert!(text.contains(&js.display().to_string()), "{text}");
    }

    let pq = dir.path().join("bad.parquet");
    write_parquet_numeric_source(&pq);
    let err = file_rows(&pq, &codec(), "prompt", "data_source").unwrap_err();
    let (at, named, text) = field_error(err);
    assert_eq!(
        (at, named.as_str()),
        (RowAt::Row(1), "data_source"),
        "{text}"
    );
    assert!(
        text.contains(&pq.display().to_string()) && text.contains("a number (7)"),
        "{text}"
    );

    // A row that is no object, and bytes that are not UTF-8, are named by line.
    let good = row_json(&rows()[0]);
    write_lines(&jl, &[good.clone(), json!(7)]);
    match file_rows(&jl, &codec(), "prompt", "data_source") {
        Err(DataFileError::NotAnObject { at, found, .. }) => {
            assert_eq!((at, found.as_str()), (RowAt::Line(2), "a number (7)"))
        }
        other => panic!("{other:?}"),
    }
    let mut bytes = format!("{good}\n{{\"prompt\": \"").into_bytes();
    bytes.extend(b"\xff\"}\n");
    std::fs::write(&jl, bytes).unwrap();
    match file_rows(&jl, &codec(), "prompt", "data_source") {
        Err(DataFileError::NotUtf8 { line, .. }) => assert_eq!(line, 2),
        other => panic!("{other:?}"),
    }
}

/// Files saved with a UTF-8 byte-order mark (Windows editors, pandas' `utf-8-sig`) read as
/// without it, and their lines are counted as before.
#[test]
fn a_byte_order_mark_before_the_first_row_is_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain.jsonl");
    write_jsonl(&plain, &rows());
    let expected = file_rows(&plain, &codec(), "prompt", "data_source").unwrap();

    let bom = dir.path().join("bom.jsonl");
    let mut bytes = "\u{feff}".as_bytes().to_vec();
    bytes.extend(std::fs::read(&plain).unwrap());
    std::fs::write(&bom, &bytes).unwrap();
    assert_eq!(
        file_rows(&bom, &codec(), "prompt", "data_source").unwrap(),
        expected
    );

    let array = dir.path().join("bom.json");
    let values: Vec<Value> = rows().iter().map(row_json).collect();
    std::fs::write(&array, format!("\u{feff}{}", Value::Array(values))).unwrap();
    assert_eq!(
        file_rows(&array, &codec(), "prompt", "data_source").unwrap(),
        expected
    );

    let mut bad = rows();
    bad[0].truth = None;
    write_jsonl(&plain, &bad);
    let mut bytes = "\u{feff}".as_bytes().to_vec();
    bytes.extend(std::fs::read(&plain).unwrap());
    std::fs::write(&bom, &bytes).unwrap();
    let (at, field, text) =
        field_error(file_rows(&bom, &codec(), "prompt", "data_source").unwrap_err());
    assert_eq!(
        (at, field.as_str()),
        (RowAt::Line(1), "reward_model.ground_truth"),
        "{text}"
    );
}

/// A `.json` data file may hold a JSON array of row objects (`json.dump(rows, f)`) or one
/// object per line, and reads to the same rows as JSONL.
#[test]
fn a_json_file_holds_an_array_of_rows_or_one_row_per_line() {
    let dir = tempfile::tempdir().unwrap();
    let jl = dir.path().join("train.jsonl");
    write_jsonl(&jl, &rows());
    let expected = file_rows(&jl, &codec(), "prompt", "data_source").unwrap();

    let array = dir.path().join("train.json");
    let values: Vec<Value> = rows().iter().map(row_json).collect();
    std::fs::write(&array, serde_json::to_string_pretty(&values).unwrap()).unwrap();
    assert_eq!(
        file_rows(&array, &codec(), "prompt", "data_source").unwrap(),
        expected
    );

    let lines = dir.path().join("lines.json");
    write_jsonl(&lines, &rows());
    assert_eq!(
        file_rows(&lines, &codec(), "prompt", "data_source").unwrap(),
        expected
    );

    std::fs::write(&array, " [ ]\n").unwrap();
    assert!(matches!(
        file_rows(&array, &codec(), "prompt", "data_source"),
        Err(DataFileError::Empty { .. })
    ));
    std::fs::write(&array, format!("[{}, 7]", values[0])).unwrap();
    match file_rows(&array, &codec(), "prompt", "data_source") {
        Err(DataFileError::NotAnObject { at, found, .. }) => {
            assert_eq!((at, found.as_str()), (RowAt::Row(1), "a number (7)"))
        }
        other => panic!("{other:?}"),
    }
    std::fs::write(&array, format!("[{},\n", values[0])).unwrap();
    let err = file_rows(&array, &codec(), "prompt", "data_source").unwrap_err();
    assert!(
        matches!(err, DataFileError::NotJsonArray { .. })
            && err.to_string().contains(&array.display().to_string()),
        "{err}"
    );
}

/// `PpoTrainer::new` on data files, with a tiny model and short run.
fn trainer(train: &Path, val: &Path, out: &Path) -> Result<verl::trainer::PpoTrainer, String> {
    let validated = verl::ConfigBuilder::new()
        .overrides(verl::trainer::MAIN_JOB)
        .overrides([
            "trainer.sft_warmup_steps=2",
            "trainer.total_training_steps=2",
            // Validated after the last step.
            "trainer.test_freq=2",
            "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.n=2",
            "+actor_rollout_ref.model.override_config.hidden_size=32",
            "+actor_rollout_ref.model.override_config.intermediate_size=64",
            "+actor_rollout_ref.model.override_config.num_hidden_layers=1",
        ])
        .set("data.train_files", train.display())
        .set("data.val_files", val.display())
        .set("trainer.default_local_dir", out.display())
        .build()
        .map_err(|e| e.to_string())?;
    verl::trainer::PpoTrainer::new(validated).map_err(|e| e.to_string())
}

#[test]
fn a_run_trains_on_parquet_files() {
    let dir = tempfile::tempdir().unwrap();
    let (pq, jl) = (
        dir.path().join("train.parquet"),
        dir.path().join("val.jsonl"),
    );
    write_parquet(&pq, &rows());
    write_jsonl(&jl, &rows());
    let mut t = trainer(&pq, &jl, &dir.path().join("out")).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let summary = rt.block_on(t.fit()).unwrap();
    assert_eq!(summary.steps, 2);
    let text = std::fs::read_to_string(&summary.metrics_path).unwrap();
    let steps = text
        .lines()
        .filter(|l| l.contains("\"critic/score/mean\""))
        .count();
    assert_eq!(steps, 2);
    // The gsm8k row is scored by its own scorer; validation covered all three rows.
    assert!(summary.val_score_after.is_some());
}

#[test]
fn a_data_source_without_a_scorer_is_refused_at_setup() {
    let dir = tempfile::tempdir().unwrap();
    let mut odd = rows();
    odd[1].source = "my/unknown_task".into();
    let (pq, jl) = (
        dir.path().join("train.parquet"),
        dir.path().join("val.jsonl"),
    );
    write_parquet(&pq, &odd);
    write_jsonl(&jl, &rows());
    let err = trainer(&pq, &jl, &dir.path().join("out")).err().unwrap();
    assert!(
        err.contains("my/unknown_task") && err.contains("reward_model.enable"),
        "{err}"
    );

    // Rows without the column read as `unknown`: the error says which column was looked for.
    let text = std::fs::read_to_string(&jl)
        .unwrap()
        .replace("\"data_source\"", "\"source\"");
    let unlabelled = dir.path().join("unlabelled.jsonl");
    std::fs::write(&unlabelled, text).unwrap();
    let err = trainer(&unlabelled, &jl, &dir.path().join("out"))
        .err()
        .unwrap();
    assert!(
        err.contains("`unknown`") && err.contains("`data_source` column"),
        "{err}"
    );
}

/// Data files are read only if they are regular files: a device (behind a `.jsonl` symlink),
/// a FIFO or a directory is refused naming it, where reading would never end.
#[test]
fn devices_fifos_and_directories_are_refused_as_data_files() {
    let dir = tempfile::tempdir().unwrap();
    let zero = dir.path().join("zero.jsonl");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    let folder = dir.path().join("rows.parquet");
    std::fs::create_dir(&folder).unwrap();
    let mut paths = vec![zero, folder];
    let fifo = dir.path().join("fifo.jsonl");
    if std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success())
    {
        paths.push(fifo);
    }
    for path in paths {
        let e = file_rows(&path, &codec(), "prompt", "data_source").unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains(&path.display().to_string())
                && (text.contains("regular file") || text.contains("a directory")),
            "{text}"
        );
    }
}

/// One JSONL row longer than 64 MiB is refused naming the file, the line and its size
/// (parsed, it would take several times that); the rows before it are fine.
#[test]
fn an_enormous_row_is_refused_naming_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rows.jsonl");
    let ok = r#"{"prompt": [{"role": "user", "content": "1+1="}], "data_source": "verl_rs/arithmetic", "reward_model": {"ground_truth": "2"}}"#;
    let huge = format!(
        r#"{{"prompt": "{}", "data_source": "x"}}"#,
        "a".repeat(verl::trainer::data::MAX_ROW_BYTES)
    );
    std::fs::write(&path, format!("{ok}\n{huge}\n")).unwrap();
    let e = file_rows(&path, &codec(), "prompt", "data_source")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rows.jsonl") && e.contains("line 2") && e.contains("limit of one row"),
        "{}",
        &e[..e.len().min(300)]
    );
}

/// With an agent loop's tools, an HF model's prompts list them through the chat template (as
/// verl's `ToolAgentLoop` renders its prompts); without, the same rows read as before.
#[test]
fn an_agent_loops_tools_are_listed_in_the_prompts() {
    use verl::megatron::hf::HfTokenizer;
    use verl::rollout::agent::{Calculator, ToolSet};
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("verl-megatron/tests/fixtures/qwen2");
    let dir = tempfile::tempdir().unwrap();
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "config.json",
    ] {
        std::fs::copy(fixture.join(name), dir.path().join(name)).unwrap();
    }
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t['function']['name'] }}\n{% endfor %}\
         <|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n\
         {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    .unwrap();
    let jl = dir.path().join("rows.jsonl");
    let row = json!({
        "data_source": "arith",
        "prompt": [{"role": "user", "content": "1+2"}],
        "reward_model": {"ground_truth": "3"},
    });
    std::fs::write(&jl, format!("{row}\n")).unwrap();
    let tok = HfTokenizer::from_dir(dir.path()).unwrap();
    let schemas = ToolSet::new().with(Calculator).schemas();
    let plain = file_rows(&jl, &Codec::hf(tok.clone()), "prompt", "data_source").unwrap();
    let with_tools = Codec::hf(tok.clone()).with_tools(schemas);
    let listed = file_rows(&jl, &with_tools, "prompt", "data_source").unwrap();
    let text = |ids: &[u32]| tok.decode(ids).unwrap();
    assert_eq!(
        text(&listed[0].prompt_ids),
        text(
            &tok.encode("<|im_start|>system\ncalculator\n<|im_end|>\n")
                .unwrap()
        ) + &text(&plain[0].prompt_ids)
    );
    assert!(!text(&plain[0].prompt_ids).contains("calculator"));
    // A character codec has no template to list them in.
    let chars = codec().with_tools(ToolSet::new().with(Calculator).schemas());
    assert_eq!(
        file_rows(&jl, &chars, "prompt", "data_source").unwrap()[0].prompt_ids,
        file_rows(&jl, &codec(), "prompt", "data_source").unwrap()[0].prompt_ids
    );
}
