//! verl's `trainer.logger` trackers: `file` natively, and `wandb`, `mlflow`, `tensorboard`,
//! `trackio` and `clearml` in a `python3` worker. The Python libraries are stood in for by small modules on `PYTHONPATH`
//! that record every call to a JSON-lines file, so the test checks what verl-rs asks of them:
//! the names, the config, every step's metrics, the finish. Needs a `python3`, as
//! tests/python_reward.rs does.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// The stand-ins: each call appended to `$TRACKER_CALLS` as `{"lib", "call", ...}`.
const STUBS: &[(&str, &str)] = &[
    (
        "record_call.py",
        r#"
import json, os
def record(lib, call, **kw):
    with open(os.environ["TRACKER_CALLS"], "a") as f:
        f.write(json.dumps({"lib": lib, "call": call, **kw}) + "\n")
"#,
    ),
    (
        "wandb.py",
        r#"
from record_call import record
class Settings:
    def __init__(self, **kw): pass
class Table:
    def __init__(self, columns=None, data=None):
        self.columns, self.data = columns, data
def init(project=None, name=None, entity=None, config=None, settings=None):
    record("wandb", "init", project=project, name=name, config=config)
def log(data=None, step=None):
    if isinstance(data, dict) and isinstance(data.get("val/generations"), Table):
        t = data["val/generations"]
        record("wandb", "log_table", step=step, columns=t.columns, rows=t.data)
        return
    record("wandb", "log", step=step, data=data)
def finish(exit_code=0):
    record("wandb", "finish", exit_code=exit_code)
"#,
    ),
    (
        "mlflow.py",
        r#"
from record_call import record
class _Experiment:
    experiment_id = "7"
def set_tracking_uri(uri): record("mlflow", "set_tracking_uri", uri=uri)
def set_experiment(name):
    record("mlflow", "set_experiment", name=name)
    return _Experiment()
def start_run(experiment_id=None, run_name=None, run_id=None):
    record("mlflow", "start_run", experiment_id=experiment_id, run_name=run_name)
def log_params(params): record("mlflow", "log_params", count=len(params), sample=params.get("trainer/project_name"))
def log_metrics(metrics=None, step=None): record("mlflow", "log_metrics", step=step, data=metrics)
def end_run(): record("mlflow", "end_run")
def log_artifact(path):
    import json, os
    record("mlflow", "log_artifact", name=os.path.basename(path), rows=json.load(open(path)))
"#,
    ),
    (
        "trackio.py",
        r#"
from record_call import record
def init(project=None, name=None, config=None):
    record("trackio", "init", project=project, name=name, config=config)
def log(data=None, step=None):
    record("trackio", "log", step=step, data=data)
def finish():
    record("trackio", "finish")
"#,
    ),
    ("clearml/__init__.py", "from clearml.task import Task\n"),
    (
        "clearml/task.py",
        r#"
from record_call import record
class _Logger:
    def report_scalar(self, title, series, value, iteration):
        record("clearml", "report_scalar", title=title, series=series, value=value, step=iteration)
    def report_table(self, series, title, table_plot, iteration):
        record("clearml", "report_table", series=series, title=title, rows=table_plot, step=iteration)
class Task:
    @staticmethod
    def init(task_name=None, project_name=None, continue_last_task=None, output_uri=None):
        record("clearml", "init", task_name=task_name, project_name=project_name,
               continue_last_task=continue_last_task, output_uri=output_uri)
        return Task()
    def connect_configuration(self, config, name=None):
        record("clearml", "connect_configuration", name=name, project=config["trainer"]["project_name"])
    def get_logger(self):
        return _Logger()
    def close(self):
        record("clearml", "close")
"#,
    ),
    // pandas as clearml's table takes it: the records themselves.
    (
        "pandas/__init__.py",
        "class DataFrame:\n    @staticmethod\n    def from_records(records): return records\n",
    ),
    ("torch/__init__.py", ""),
    ("torch/utils/__init__.py", ""),
    (
        "torch/utils/tensorboard.py",
        r#"
from record_call import record
class SummaryWriter:
    def __init__(self, log_dir): record("tensorboard", "open", log_dir=log_dir)
    def add_scalar(self, tag, value, step): record("tensorboard", "add_scalar", tag=tag, value=value, step=step)
    def add_text(self, tag, text, step): record("tensorboard", "add_text", tag=tag, text=text, step=step)
    def flush(self): pass
    def close(self): record("tensorboard", "close")
"#,
    ),
];

fn stubs(dir: &Path) {
    for (name, text) in STUBS {
        let path = dir.join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
}

fn calls(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Runs the tiny built-in job for 2 steps with `loggers`, the stand-ins importable.
fn train(dir: &Path, loggers: &str) -> (bool, String, Vec<Value>) {
    train_with(dir, loggers, &[])
}

/// [`train`] with `extra` overrides after the job's own.
fn train_with(dir: &Path, loggers: &str, extra: &[&str]) -> (bool, String, Vec<Value>) {
    let lib = dir.join("lib");
    stubs(&lib);
    let record = dir.join("calls.jsonl");
    let out = Command::new(env!("CARGO_BIN_EXE_verl"))
        .args([
            "train",
            "data.train_files=builtin:addition:1",
            "trainer.total_training_steps=2",
            "trainer.sft_warmup_steps=0",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.project_name=tracked",
            "trainer.experiment_name=run_a",
            &format!("trainer.logger={loggers}"),
            &format!("trainer.default_local_dir={}", dir.join("run").display()),
        ])
        .args(extra)
        .env("PYTHONPATH", &lib)
        .env("TRACKER_CALLS", &record)
        .env("TENSORBOARD_DIR", dir.join("tb"))
        .env("MLFLOW_TRACKING_URI", "file:///nowhere")
        .env("VERL_FILE_LOGGER_ROOT", dir.join("files"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    (out.status.success(), err, calls(&record))
}

/// The recorded calls of `lib` named `call`, in order.
fn calls_of<'a>(calls: &'a [Value], lib: &str, call: &str) -> Vec<&'a Value> {
    calls
        .iter()
        .filter(|c| c["lib"] == lib && c["call"] == call)
        .collect()
}

/// The steps `metrics.jsonl` holds, by step.
fn logged_steps(dir: &Path) -> BTreeMap<u64, Value> {
    std::fs::read_to_string(dir.join("run/metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| Some((v.get("step")?.as_u64()?, v)))
        .collect()
}

#[test]
fn each_step_reaches_wandb_mlflow_tensorboard_and_the_file_logger() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, err, calls) = train(dir.path(), "[console,wandb,mlflow,tensorboard,file]");
    assert!(ok, "{err}");
    let steps = logged_steps(dir.path());
    assert!(
        steps.contains_key(&1) && steps.contains_key(&2),
        "{steps:?}"
    );
    let of = |lib: &str, call: &str| calls_of(&calls, lib, call);
    // wandb: verl's init (project, experiment name, the resolved config), every step, finish.
    let init = of("wandb", "init");
    assert_eq!(init.len(), 1, "{calls:?}");
    assert_eq!(init[0]["project"], "tracked");
    assert_eq!(init[0]["name"], "run_a");
    assert_eq!(init[0]["config"]["trainer"]["total_training_steps"], 2);
    for (lib, call) in [("wandb", "log"), ("mlflow", "log_metrics")] {
        let logs = of(lib, call);
        let logged: Vec<u64> = logs.iter().map(|c| c["step"].as_u64().unwrap()).collect();
        assert_eq!(logged, steps.keys().copied().collect::<Vec<_>>(), "{lib}");
        // The same numbers metrics.jsonl has.
        for c in logs {
            let line = &steps[&c["step"].as_u64().unwrap()];
            let score = c["data"]["critic/score/mean"].as_f64().unwrap();
            assert_eq!(score, line["critic/score/mean"].as_f64().unwrap(), "{lib}");
        }
    }
    assert_eq!(of("wandb", "finish").len(), 1, "{calls:?}");
    // mlflow: verl's experiment and run names, flattened params, keys made valid ("@" → _at_).
    assert_eq!(of("mlflow", "set_experiment")[0]["name"], "tracked");
    assert_eq!(of("mlflow", "start_run")[0]["run_name"], "run_a");
    assert_eq!(of("mlflow", "log_params")[0]["sample"], "tracked");
    assert_eq!(of("mlflow", "end_run").len(), 1);
    // tensorboard: TENSORBOARD_DIR, one scalar per metric and step, closed.
    assert_eq!(
        of("tensorboard", "open")[0]["log_dir"],
        dir.path().join("tb").display().to_string()
    );
    let scalars = of("tensorboard", "add_scalar");
    assert!(scalars
        .iter()
        .any(|c| c["tag"] == "critic/score/mean" && c["step"] == 2));
    assert_eq!(of("tensorboard", "close").len(), 1);
    // file: verl's {"step", "data"} lines under VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl.
    let file = std::fs::read_to_string(dir.path().join("files/tracked/run_a.jsonl")).unwrap();
    let lines: Vec<Value> = file
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), steps.len());
    assert_eq!(lines.last().unwrap()["step"], 2);
    assert!(lines[0]["data"]["timing_s/step"].as_f64().unwrap() > 0.0);
}

#[test]
fn a_tracker_that_cannot_start_stops_the_run_by_name() {
    let dir = tempfile::tempdir().unwrap();
    // The stand-ins have no swanlab: its import fails, before any training.
    let (ok, err, _) = train(dir.path(), "[console,swanlab]");
    assert!(!ok);
    assert!(err.contains("trainer.logger `swanlab`"), "{err}");
    assert!(err.contains("No module named 'swanlab'"), "{err}");
    assert!(!dir.path().join("run/metrics.jsonl").exists() || logged_steps(dir.path()).is_empty());
}

#[test]
fn each_step_reaches_trackio_and_clearml() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, err, calls) = train(dir.path(), "[console,trackio,clearml]");
    assert!(ok, "{err}");
    let steps = logged_steps(dir.path());
    let of = |lib: &str, call: &str| calls_of(&calls, lib, call);
    // trackio: verl's init (project, experiment name, the resolved config), every step, finish.
    let init = of("trackio", "init");
    assert_eq!(init.len(), 1, "{calls:?}");
    assert_eq!(
        (&init[0]["project"], &init[0]["name"]),
        (&"tracked".into(), &"run_a".into())
    );
    assert_eq!(init[0]["config"]["trainer"]["total_training_steps"], 2);
    let logged: Vec<u64> = of("trackio", "log")
        .iter()
        .map(|c| c["step"].as_u64().unwrap())
        .collect();
    assert_eq!(logged, steps.keys().copied().collect::<Vec<_>>());
    assert_eq!(of("trackio", "finish").len(), 1);
    // clearml: verl's task (continuing the last, no artifact upload), the config as its
    // hyperparameters, "title/series" scalars with the step as the iteration, closed.
    let init = of("clearml", "init");
    assert_eq!(init[0]["task_name"], "run_a");
    assert_eq!(init[0]["project_name"], "tracked");
    assert_eq!(init[0]["continue_last_task"], true);
    assert_eq!(init[0]["output_uri"], false);
    let configured = of("clearml", "connect_configuration");
    assert_eq!(configured[0]["name"], "Hyperparameters");
    assert_eq!(configured[0]["project"], "tracked");
    let score = of("clearml", "report_scalar")
        .into_iter()
        .find(|c| c["title"] == "critic" && c["series"] == "score/mean" && c["step"] == 2)
        .expect("critic/score/mean at step 2");
    assert_eq!(score["value"], steps[&2]["critic/score/mean"]);
    assert_eq!(of("clearml", "close").len(), 1);
}

/// `trainer.log_val_generations=3`: each validation's 3 samples (verl's pick: sorted by input,
/// shuffled by numpy's RandomState(42)) reach each tracker as verl's ValidationGenerationsLogger
/// writes them: a wandb table growing a row per validation, an mlflow `val_step<N>.json`
/// artifact, a tensorboard text, a clearml table.
#[test]
fn validation_generations_reach_the_trackers_as_verl_logs_them() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, err, calls) = train_with(
        dir.path(),
        "[console,wandb,mlflow,tensorboard,clearml]",
        &[
            "trainer.log_val_generations=3",
            "trainer.val_before_train=true",
            "trainer.test_freq=2",
        ],
    );
    assert!(ok, "{err}");
    // Validations before training (step 0) and after step 2.
    let tables = calls_of(&calls, "wandb", "log_table");
    assert_eq!(tables.len(), 2, "{calls:?}");
    let columns = tables[0]["columns"].as_array().unwrap();
    assert_eq!(columns.len(), 1 + 3 * 3);
    assert_eq!(columns[1], "input_1");
    assert_eq!(columns[9], "score_3");
    assert_eq!(tables[0]["rows"].as_array().unwrap().len(), 1);
    let rows = tables[1]["rows"].as_array().unwrap();
    assert_eq!(
        rows.len(),
        2,
        "the table keeps the earlier validation's row"
    );
    assert_eq!(
        (rows[0][0].as_u64(), rows[1][0].as_u64()),
        (Some(0), Some(2))
    );
    let artifacts = calls_of(&calls, "mlflow", "log_artifact");
    assert_eq!(artifacts.len(), 2);
    assert_eq!(artifacts[1]["name"], "val_step2.json");
    let samples = artifacts[1]["rows"].as_array().unwrap();
    assert_eq!(samples.len(), 3);
    for s in samples {
        assert!(s["input"].is_string() && s["output"].is_string() && s["score"].is_number());
    }
    // The same samples everywhere.
    assert_eq!(rows[1][1], samples[0]["input"]);
    let texts = calls_of(&calls, "tensorboard", "add_text");
    assert_eq!(texts.len(), 2);
    assert_eq!(texts[1]["tag"], "val/generations");
    assert!(texts[1]["text"]
        .as_str()
        .unwrap()
        .contains(samples[2]["input"].as_str().unwrap()));
    let clearml = calls_of(&calls, "clearml", "report_table");
    assert_eq!(clearml.len(), 2);
    assert_eq!(clearml[1]["title"], "Validation");
    assert_eq!(clearml[1]["rows"][0]["input"], samples[0]["input"]);
}
