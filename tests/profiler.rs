//! The profiler on the CPU default: `verl train` with `global_profiler` and the roles'
//! `profiler` blocks. The "torch" tool writes one gzipped Chrome trace per capture with verl's
//! file names, for the chosen steps, ranks and roles; each holds its role's worker methods with
//! what ran inside them (device spans and a memory track when the contents ask), and discrete
//! mode writes one file per method call. "torch_memory" writes a memory timeline per capture
//! (JSON and PNG); "nsys" hands NVTX ranges to the tool Nsight Systems injects.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Mutex, Once};

mod common;

use tracing_subscriber::prelude::*;
use verl::profiler::{ChromeTrace, TraceLayer};
use verl::trainer::MAIN_JOB;
use verl::ConfigBuilder;

// Memory samples on the CPU backend count the process's heap.
#[global_allocator]
static ALLOCATOR: verl::memory::CountingAllocator = verl::memory::CountingAllocator;

/// Captures are process-wide: the runs here go one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn install_layer() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(TraceLayer))
            .expect("no other subscriber in this test binary");
    });
}

/// Runs a small PPO job (actor, reference, critic) with `extra` overrides; the profile
/// directory and every file in it, relative to it.
fn run(extra: &[&str]) -> (tempfile::TempDir, BTreeSet<PathBuf>) {
    install_layer();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let validated = ConfigBuilder::new()
        .overrides(MAIN_JOB)
        .overrides([
            "data.train_files=builtin:addition:1",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "trainer.save_freq=-1",
            "+actor_rollout_ref.model.override_config.hidden_size=32",
            "+actor_rollout_ref.model.override_config.intermediate_size=64",
            "+actor_rollout_ref.model.override_config.num_hidden_layers=1",
            "algorithm.adv_estimator=gae",
            "critic.enable=true",
            "critic.ppo_micro_batch_size_per_gpu=32",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
            "trainer.sft_warmup_steps=0",
            "trainer.total_training_steps=3",
            "global_profiler.tool=torch",
        ])
        .overrides(extra.iter().copied())
        .set(
            "trainer.default_local_dir",
            dir.path().join("run").display(),
        )
        .set(
            "global_profiler.save_path",
            dir.path().join("profile").display(),
        )
        .build()
        .unwrap();
    common::fit(validated);
    let root = dir.path().join("profile");
    let files = common::files_under(&root)
        .into_iter()
        .map(|p| p.strip_prefix(&root).unwrap().to_path_buf())
        .collect();
    (dir, files)
}

fn set(paths: &[&str]) -> BTreeSet<PathBuf> {
    paths.iter().map(PathBuf::from).collect()
}

/// How many spans of each name a trace holds.
fn count(trace: &ChromeTrace, name: &str) -> usize {
    trace.events.iter().filter(|e| e.name == name).count()
}

#[test]
fn continuous_steps_give_one_capture_per_role_and_rank_with_the_methods_inside() {
    let (dir, files) = run(&[
        "trainer.n_gpus_per_node=2",
        "global_profiler.steps=[2,3]",
        "global_profiler.profile_continuous_steps=true",
        "actor_rollout_ref.actor.profiler.enable=true",
        "actor_rollout_ref.actor.profiler.all_ranks=true",
        "actor_rollout_ref.ref.profiler.enable=true",
        "actor_rollout_ref.ref.profiler.ranks=[0]",
        "critic.profiler.enable=true",
        "critic.profiler.ranks=[1]",
    ]);
    assert_eq!(
        files,
        set(&[
            "actor/step2-3_prof_rank-0.json.gz",
            "actor/step2-3_prof_rank-1.json.gz",
            "critic/step2-3_prof_rank-1.json.gz",
            "ref/step2-3_prof_rank-0.json.gz",
        ])
    );
    let read = |f: &str| ChromeTrace::read(&dir.path().join("profile").join(f)).unwrap();
    for rank in [0, 1] {
        let actor = read(&format!("actor/step2-3_prof_rank-{rank}.json.gz"));
        // Two steps: each generates and updates once.
        assert_eq!(count(&actor, "generate_sequences"), 2, "rank {rank}");
        assert_eq!(count(&actor, "update_actor"), 2, "rank {rank}");
        assert_eq!(
            count(&actor, "compute_ref_log_prob"),
            0,
            "the reference's own capture"
        );
        assert!(count(&actor, "micro_batch") >= 2);
        assert!(count(&actor, "optimizer_step") >= 2);
        assert_eq!(count(&actor, "reshard"), 2);
        assert_eq!(count(&actor, "rollout_generate"), 2);
        assert!(actor.events.iter().all(|e| e.pid == rank as u64));
        // What ran inside an update lies inside it.
        let updates: Vec<_> = actor
            .events
            .iter()
            .filter(|e| e.name == "update_actor")
            .collect();
        for mb in actor.events.iter().filter(|e| e.name == "optimizer_step") {
            assert!(
                updates
                    .iter()
                    .any(|u| mb.ts >= u.ts && mb.ts + mb.dur <= u.ts + u.dur + 1.0),
                "an optimizer step outside every update"
            );
        }
        let top = actor.summarize(3);
        assert!(top
            .iter()
            .any(|t| t.name == "update_actor" || t.name == "generate_sequences"));
    }
    let reference = read("ref/step2-3_prof_rank-0.json.gz");
    assert_eq!(count(&reference, "compute_ref_log_prob"), 2);
    assert_eq!(count(&reference, "update_actor"), 0);
    let critic = read("critic/step2-3_prof_rank-1.json.gz");
    assert_eq!(count(&critic, "compute_values"), 2);
    assert_eq!(count(&critic, "update_critic"), 2);
}

#[test]
fn separate_steps_and_discrete_methods_give_their_own_files() {
    let (_dir, files) = run(&[
        "global_profiler.steps=[1,3]",
        "actor_rollout_ref.actor.profiler.enable=true",
        "actor_rollout_ref.actor.profiler.ranks=[0]",
    ]);
    assert_eq!(
        files,
        set(&[
            "actor/step1_prof_rank-0.json.gz",
            "actor/step3_prof_rank-0.json.gz"
        ])
    );

    let (dir, files) = run(&[
        "global_profiler.steps=[2]",
        "critic.profiler.enable=true",
        "critic.profiler.all_ranks=true",
        "critic.profiler.tool_config.torch.discrete=true",
    ]);
    assert_eq!(
        files,
        set(&[
            "critic/step2_compute_values_prof_rank-0.json.gz",
            "critic/step2_update_critic_prof_rank-0.json.gz",
        ])
    );
    let one = ChromeTrace::read(
        &dir.path()
            .join("profile/critic/step2_update_critic_prof_rank-0.json.gz"),
    )
    .unwrap();
    assert_eq!(count(&one, "update_critic"), 1);
    assert_eq!(count(&one, "compute_values"), 0);
}

#[test]
fn settings_it_cannot_honour_are_refused_by_name() {
    let refused = |extra: &[&str]| {
        ConfigBuilder::new()
            .overrides(MAIN_JOB)
            .overrides(extra.iter().copied())
            .build()
            .unwrap_err()
            .to_string()
    };
    for (extra, key) in [
        (&["global_profiler.tool=npu"][..], "global_profiler.tool"),
        (
            &[
                "global_profiler.tool=torch",
                "actor_rollout_ref.rollout.profiler.enable=true",
            ][..],
            "actor_rollout_ref.rollout.profiler.enable",
        ),
        (
            &[
                "global_profiler.tool=torch",
                "actor_rollout_ref.actor.profiler.enable=true",
                "actor_rollout_ref.actor.profiler.tool_config.torch.contents=[cpu,stack]",
            ][..],
            "actor_rollout_ref.actor.profiler.tool_config.torch.contents",
        ),
        (
            &["actor_rollout_ref.actor.profiler.enable=true"][..],
            "actor_rollout_ref.actor.profiler.tool",
        ),
        (
            &["global_profiler.tool=perfetto"][..],
            "global_profiler.tool",
        ),
        (
            &["global_profiler.global_tool_config.npu.contents=[npu, cpu]"][..],
            "global_profiler.global_tool_config.npu",
        ),
        (
            &["global_profiler.global_tool_config.npu.discrete=true"][..],
            "global_profiler.global_tool_config.npu",
        ),
        (
            &["global_profiler.global_tool_config.npu.level=level2"][..],
            "global_profiler.global_tool_config.npu",
        ),
        (
            &["global_profiler.global_tool_config.npu.analysis=false"][..],
            "global_profiler.global_tool_config.npu",
        ),
        (
            &["global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=0"][..],
            "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries",
        ),
        (
            &["global_profiler.global_tool_config.torch.contents=[cuda,shapes]"][..],
            "global_profiler.global_tool_config.torch.contents",
        ),
        (
            &["+critic.profiler.tool_config.nsys.worker_nsight_options.trace=cuda"][..],
            "critic.profiler.tool_config.nsys.worker_nsight_options",
        ),
        (&["global_profiler.colour=red"][..], "global_profiler"),
    ] {
        let e = refused(extra);
        assert!(e.contains(key), "{extra:?}: {e}");
    }
}

#[test]
fn device_spans_and_a_memory_track_come_when_the_contents_ask() {
    let (dir, files) = run(&[
        "global_profiler.steps=[2]",
        "actor_rollout_ref.actor.profiler.enable=true",
        "actor_rollout_ref.actor.profiler.ranks=[0]",
        "actor_rollout_ref.actor.profiler.tool_config.torch.contents=[cpu,cuda,memory]",
    ]);
    assert_eq!(files, set(&["actor/step2_prof_rank-0.json.gz"]));
    let trace =
        ChromeTrace::read(&dir.path().join("profile/actor/step2_prof_rank-0.json.gz")).unwrap();
    let device = |name: &str| {
        trace
            .events
            .iter()
            .filter(|e| e.cat == "device" && e.name == name)
            .count()
    };
    // One layer: an attention and an MLP span per forward pass, and the heavy steps.
    for name in [
        "attention",
        "mlp",
        "lm_head",
        "backward",
        "optimizer_step",
        "decode_step",
    ] {
        assert!(device(name) >= 1, "no device span {name}");
    }
    assert_eq!(device("attention"), device("mlp"));
    assert!(trace
        .events
        .iter()
        .filter(|e| e.cat == "device")
        .all(|e| e.tid == verl::profiler::DEVICE_TRACK));
    // Each device span lies inside a host span of the same rank.
    let updates: Vec<_> = trace
        .events
        .iter()
        .filter(|e| e.cat == "host" && e.name == "update_actor")
        .collect();
    let backward = trace.events.iter().find(|e| e.name == "backward").unwrap();
    assert!(updates
        .iter()
        .any(|u| backward.ts >= u.ts && backward.ts + backward.dur <= u.ts + u.dur + 1.0));
    let memory: Vec<_> = trace.events.iter().filter(|e| e.ph == "C").collect();
    assert!(memory.len() >= 10, "{} memory samples", memory.len());
    assert!(memory
        .iter()
        .all(|m| m.args["allocated"].as_f64().unwrap() > 0.0
            && m.args["reserved"].as_f64().unwrap() >= m.args["allocated"].as_f64().unwrap()));
    let top = trace.summarize(50);
    assert!(top.iter().any(|t| t.cat == "device" && t.name == "mlp"));
    assert!(top
        .iter()
        .any(|t| t.cat == "host" && t.name == "update_actor"));
}

#[test]
fn the_memory_tool_writes_a_timeline_per_capture_with_its_phases() {
    let (dir, files) = run(&[
        "global_profiler.tool=torch_memory",
        "global_profiler.steps=[1,2]",
        "global_profiler.profile_continuous_steps=true",
        "global_profiler.global_tool_config.torch_memory.stack_depth=2",
        "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=500",
        "actor_rollout_ref.actor.profiler.enable=true",
        "actor_rollout_ref.actor.profiler.ranks=[0]",
        "critic.profiler.enable=true",
        "critic.profiler.ranks=[0]",
    ]);
    assert_eq!(
        files,
        set(&[
            "actor/step1-2_memory_rank-0.json",
            "actor/step1-2_memory_rank-0.png",
            "critic/step1-2_memory_rank-0.json",
            "critic/step1-2_memory_rank-0.png",
        ])
    );
    let root = dir.path().join("profile");
    let actor: serde_json::Value = serde_json::from_slice(
        &std::fs::read(root.join("actor/step1-2_memory_rank-0.json")).unwrap(),
    )
    .unwrap();
    let samples = actor["samples"].as_array().unwrap();
    assert!(
        samples.len() > 10 && samples.len() <= 500,
        "{}",
        samples.len()
    );
    assert!(samples
        .iter()
        .all(|s| s["stack"].as_array().unwrap().len() <= 2));
    let mut times = samples.iter().map(|s| s["t_us"].as_f64().unwrap());
    let first = times.next().unwrap();
    assert!(
        times
            .try_fold(first, |prev, t| (t >= prev).then_some(t))
            .is_some(),
        "samples in time order"
    );
    let phases: BTreeSet<&str> = actor["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["phase"].as_str().unwrap())
        .collect();
    for phase in ["generate_sequences", "update_actor"] {
        assert!(phases.contains(phase), "{phases:?}");
    }
    assert!(
        !phases.contains("update_critic"),
        "the critic's own timeline"
    );
    let peak = actor["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["peak_allocated"].as_u64().unwrap())
        .max()
        .unwrap();
    assert!(peak > 0);
    let png = std::fs::read(root.join("actor/step1-2_memory_rank-0.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
}

/// What the fake NVTX tool below received, in order.
static NVTX_SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn nvtx_push(name: *const std::ffi::c_char) -> std::ffi::c_int {
    let name = unsafe { std::ffi::CStr::from_ptr(name) };
    NVTX_SEEN
        .lock()
        .unwrap()
        .push(name.to_string_lossy().into_owned());
    0
}

unsafe extern "C" fn nvtx_pop() -> std::ffi::c_int {
    NVTX_SEEN.lock().unwrap().push("<pop>".into());
    0
}

/// A tool attached as Nsight Systems attaches: it asks for the CORE module's slots and writes
/// its RangePushA (9) and RangePop (11).
unsafe extern "C" fn nvtx_tool(
    get: unsafe extern "C" fn(u32) -> *const std::ffi::c_void,
) -> std::ffi::c_int {
    #[repr(C)]
    struct Callbacks {
        size: usize,
        get_module: unsafe extern "C" fn(u32, *mut *const usize, *mut u32) -> std::ffi::c_int,
    }
    unsafe {
        let callbacks = &*(get(1) as *const Callbacks);
        let (mut table, mut size) = (std::ptr::null(), 0u32);
        assert_eq!((callbacks.get_module)(1, &mut table, &mut size), 1);
        let table = std::slice::from_raw_parts(table, size as usize + 1);
        *(table[9] as *mut usize) = nvtx_push as *const () as usize;
        *(table[11] as *mut usize) = nvtx_pop as *const () as usize;
    }
    1
}

#[test]
fn the_nsys_tool_hands_the_profiled_steps_spans_to_nvtx() {
    assert!(unsafe { verl::profiler::nvtx::initialize(nvtx_tool) });
    NVTX_SEEN.lock().unwrap().clear();
    let (_dir, files) = run(&[
        "global_profiler.tool=nsys",
        "global_profiler.steps=[2]",
        "actor_rollout_ref.actor.profiler.enable=true",
        "actor_rollout_ref.actor.profiler.ranks=[0]",
    ]);
    assert!(
        files.is_empty(),
        "Nsight Systems writes the report: {files:?}"
    );
    let seen = std::mem::take(&mut *NVTX_SEEN.lock().unwrap());
    let count = |name: &str| seen.iter().filter(|s| *s == name).count();
    assert!(count("generate_sequences") >= 1, "{seen:?}");
    assert!(count("update_actor") >= 1);
    assert!(count("micro_batch") >= 1);
    assert_eq!(
        count("compute_ref_log_prob"),
        0,
        "the reference is not profiled"
    );
    assert_eq!(
        count("<pop>"),
        seen.len() - count("<pop>"),
        "every range closes"
    );
}
