//! `trainer.launcher=processes`: the ranks as `verl worker` processes that the `verl train`
//! driver starts and talks to over TCP (their collectives over TCP too, on the CPU default).
//! A 4-rank run logs the single rank's metrics (tp = 2 × dp = 2; tp = 2 × pp = 2 with a
//! critic), a rank killed with SIGKILL mid-run ends the job at once with an error naming it,
//! and a 2-"node" job on localhost (the driver's node, plus `verl worker --nproc-per-node`
//! for the other) logs what one node does.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const VERL: &str = env!("CARGO_BIN_EXE_verl");

/// A short PPO job with a critic on `common::TINY_JOB`'s model (as the thread-layout tests
/// run).
const JOB: &[&str] = &[
    "algorithm.adv_estimator=gae",
    "critic.enable=true",
    "critic.ppo_micro_batch_size_per_gpu=16",
    "trainer.sft_warmup_steps=8",
    "trainer.val_before_train=false",
];

const TP2: &[&str] = &[
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "critic.megatron.tensor_model_parallel_size=2",
];

fn train(dir: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(VERL);
    c.arg("train")
        .args(common::TINY_JOB)
        .args(JOB)
        .args(extra)
        .arg(format!("trainer.default_local_dir={}", dir.display()))
        // A hung collective fails the test instead of the CI run.
        .env("VERL_COMM_TIMEOUT_S", "120");
    c
}

fn succeed(out: Output) {
    assert!(
        out.status.success(),
        "verl train failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The step lines of a run's metrics.
fn metrics(dir: &Path) -> Vec<BTreeMap<String, f64>> {
    common::step_lines(&dir.join("metrics.jsonl"))
}

fn one_rank(dir: &Path) -> Vec<BTreeMap<String, f64>> {
    succeed(
        train(
            dir,
            &["trainer.total_training_steps=2", "trainer.launcher=threads"],
        )
        .output()
        .unwrap(),
    );
    metrics(dir)
}

fn four_processes_train_as_one_rank(layout: &[&str]) {
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let one = one_rank(d1.path());
    let mut extra = vec![
        "trainer.total_training_steps=2",
        "trainer.launcher=processes",
        "trainer.n_gpus_per_node=4",
    ];
    extra.extend(layout);
    succeed(train(d2.path(), &extra).output().unwrap());
    common::assert_same_metrics(
        &one,
        &metrics(d2.path()),
        &format!("{layout:?} as processes"),
    );
}

#[test]
fn tensor_and_data_parallel_processes_train_as_one_rank() {
    four_processes_train_as_one_rank(TP2);
}

#[test]
fn tensor_and_pipeline_parallel_processes_train_as_one_rank() {
    let mut layout = TP2.to_vec();
    layout.extend([
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "critic.megatron.pipeline_model_parallel_size=2",
    ]);
    four_processes_train_as_one_rank(&layout);
}

/// The pids of the `verl worker` processes whose parent is `driver`.
fn workers_of(driver: u32) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`: the fields after the command's closing parenthesis.
        let after = &stat[stat.rfind(')').map_or(0, |i| i + 1)..];
        let ppid: Option<u32> = after.split_whitespace().nth(1).and_then(|p| p.parse().ok());
        if ppid == Some(driver) {
            pids.push(pid);
        }
    }
    pids.sort_unstable();
    pids
}

fn wait_for_steps(dir: &Path, child: &mut Child, limit: Duration) {
    let start = Instant::now();
    loop {
        let steps = std::fs::read_to_string(dir.join("metrics.jsonl"))
            .map(|s| s.lines().filter(|l| l.contains("\"step\"")).count())
            .unwrap_or(0);
        if steps >= 1 {
            return;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended ({status}) before its first step");
        }
        assert!(start.elapsed() < limit, "no step within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A 4-process tp=2 run signalled with `signal` (`kill -<signal>`) at its rank 2 once it has
/// logged a step, with `env` set: the rank processes, the one signalled, the driver's output
/// and how long it took to end after the signal.
#[cfg(unix)]
fn signal_rank_two(
    dir: &Path,
    signal: &str,
    env: &[(&str, &str)],
) -> (Vec<u32>, u32, Output, Duration) {
    let mut extra = vec![
        "trainer.total_training_steps=500",
        "trainer.launcher=processes",
        "trainer.n_gpus_per_node=4",
    ];
    extra.extend(TP2);
    let mut cmd = train(dir, &extra);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut driver = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_steps(dir, &mut driver, Duration::from_secs(300));
    let workers = workers_of(driver.id());
    assert_eq!(workers.len(), 4, "rank processes {workers:?}");
    // The ranks start in rank order: the third is rank 2.
    let victim = workers[2];
    let signalled = Instant::now();
    let status = Command::new("kill")
        .args([&format!("-{signal}"), &victim.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = driver.wait_with_output().unwrap();
    (workers, victim, out, signalled.elapsed())
}

/// No rank process of `workers` outlives its run (a leftover is killed, then reported).
#[cfg(unix)]
fn assert_no_rank_left(workers: Vec<u32>) {
    std::thread::sleep(Duration::from_millis(500));
    for pid in workers {
        let gone = !Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| s.contains(") Z "))
                .unwrap_or(true);
        if !gone {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        assert!(gone, "rank process {pid} still runs");
    }
}

#[cfg(unix)]
#[test]
fn a_killed_rank_ends_the_run_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let (workers, victim, out, took) = signal_rank_two(dir.path(), "9", &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the run went on: {stderr}");
    assert!(took < Duration::from_secs(30), "ended after {took:?}");
    assert!(
        stderr.contains("rank 2") && stderr.contains(&format!("pid {victim}")),
        "the error does not name the killed rank: {stderr}"
    );
    assert!(stderr.contains("signal 9"), "{stderr}");
    // Reported once, by the driver: no rank prints its own panic or the rank's abort.
    assert!(
        !stderr.contains("panicked at") && !stderr.contains("stack backtrace"),
        "{stderr}"
    );
    assert_no_rank_left(workers);
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn two_nodes_on_localhost_train_as_one_node() {
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut extra = vec![
        "trainer.total_training_steps=2",
        "trainer.launcher=processes",
        "trainer.n_gpus_per_node=4",
    ];
    extra.extend(TP2);
    succeed(train(d1.path(), &extra).output().unwrap());
    let port = free_port().to_string();
    let mut two = vec![
        "trainer.total_training_steps=2",
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=2",
    ];
    two.extend(TP2);
    let node_env = |c: &mut Command| {
        c.env("MASTER_ADDR", "127.0.0.1").env("MASTER_PORT", &port);
    };
    let mut node0 = train(d2.path(), &two);
    node_env(&mut node0);
    let node0 = node0.stderr(Stdio::piped()).spawn().unwrap();
    let mut node1 = Command::new(VERL);
    node1
        .args(["worker", "--nproc-per-node", "2"])
        .env("NNODES", "2")
        .env("NODE_RANK", "1")
        .env("VERL_COMM_TIMEOUT_S", "120");
    node_env(&mut node1);
    let node1 = node1.stderr(Stdio::piped()).spawn().unwrap();
    let out0 = node0.wait_with_output().unwrap();
    let out1 = node1.wait_with_output().unwrap();
    succeed(out0);
    assert!(
        out1.status.success(),
        "node 1 failed: {}",
        String::from_utf8_lossy(&out1.stderr)
    );
    common::assert_same_metrics(&metrics(d1.path()), &metrics(d2.path()), "two nodes");
}

/// A rank process that stops (SIGSTOP: alive, silent) is named by its missing heartbeats
/// within seconds, long before its peers' collectives would time out (120 s here, 600 s by
/// default), and the run ends with one error naming it, no rank's panic, and no process left.
#[cfg(target_os = "linux")]
#[test]
fn a_stopped_rank_is_named_by_its_silence() {
    let dir = tempfile::tempdir().unwrap();
    let (workers, victim, out, took) =
        signal_rank_two(dir.path(), "STOP", &[("VERL_HEARTBEAT_TIMEOUT_S", "3")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the run went on: {stderr}");
    assert!(
        took < Duration::from_secs(60),
        "ended after {took:?}: {stderr}"
    );
    assert!(
        stderr.contains("rank 2")
            && stderr.contains(&format!("pid {victim}"))
            && stderr.contains("has not answered")
            && stderr.contains("stopped (SIGSTOP"),
        "the error does not name the stopped rank: {stderr}"
    );
    assert!(
        !stderr.contains("panicked at") && !stderr.contains("stack backtrace"),
        "{stderr}"
    );
    assert_no_rank_left(workers);
}
