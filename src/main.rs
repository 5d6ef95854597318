//! The `verl` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

mod bench;

/// Counts live heap bytes, so the CPU backend reports `perf/max_memory_*_gb` like a GPU.
#[global_allocator]
static ALLOCATOR: verl::memory::CountingAllocator = verl::memory::CountingAllocator;
use verl::rollout::SamplingParams;
use verl::topology::{GroupKind, Topology};
use verl::ConfigBuilder;

#[derive(Parser)]
#[command(
    name = "verl",
    version,
    about = "Reinforcement-learning post-training of LLMs (PPO, GRPO) on burn, Megatron-style"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Args)]
struct ConfigArgs {
    /// A YAML, TOML or JSON config file loaded over the defaults.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Dotted overrides, e.g. `actor_rollout_ref.rollout.n=8 trainer.total_epochs=3`.
    overrides: Vec<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Resolve a config (defaults, file, overrides) and check it.
    Config {
        #[command(flatten)]
        args: ConfigArgs,
        /// Print the resolved config as YAML.
        #[arg(long)]
        print: bool,
        /// Only resolve; skip the layout and batch-arithmetic checks.
        #[arg(long)]
        no_validate: bool,
    },
    /// Show the actor's parallel layout: every rank's coordinates and process groups.
    Topology {
        #[command(flatten)]
        args: ConfigArgs,
    },
    /// Train with PPO / GRPO. With no --config, the built-in main job: a tiny Qwen2 trained from
    /// scratch on multi-digit addition (supervised warm-up, then GRPO) on the CPU.
    Train {
        #[command(flatten)]
        args: ConfigArgs,
    },
    /// Run one rank of a `trainer.launcher=processes` job (as `verl train` starts its own
    /// ranks; on other nodes, start these with `verl worker --nproc-per-node` with NNODES /
    /// NODE_RANK / MASTER_ADDR / MASTER_PORT set, or srun, or any launcher that sets RANK /
    /// WORLD_SIZE / LOCAL_RANK; not torchrun itself, whose rendezvous holds the master port).
    Worker {
        /// Start this many local ranks (ranks NODE_RANK × N ..) instead of being one.
        #[arg(long)]
        nproc_per_node: Option<usize>,
    },
    /// Read the profiler's captures.
    Profile {
        #[command(subcommand)]
        what: ProfileCommand,
    },
    /// Measure throughput on this machine (figures for docs/PERFORMANCE.md).
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
    /// Generate from a Hugging Face causal LM directory (an `…ForCausalLM` architecture; value
    /// and reward models are refused) with the native rollout engine.
    Generate {
        /// The model directory (config.json, safetensors, tokenizer.json).
        #[arg(long)]
        model: PathBuf,
        /// A prompt (repeat for a batch); wrapped in the model's chat template unless --raw or
        /// the model has none (a base model: the prompt is used as is, with a note on stderr).
        #[arg(long, required = true)]
        prompt: Vec<String>,
        #[arg(long, default_value_t = 64)]
        max_new_tokens: usize,
        /// 0 is greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f64,
        /// Keep the k most likely tokens (-1: off).
        #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
        top_k: i64,
        #[arg(long, default_value_t = 1.0)]
        top_p: f64,
        /// Keep tokens at least min-p times as likely as the most likely one (0: off).
        #[arg(long, default_value_t = 0.0)]
        min_p: f64,
        /// Samples per prompt.
        #[arg(long, default_value_t = 1)]
        n: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// End a response at the token that completes this string (repeatable; the token is
        /// kept).
        #[arg(long)]
        stop: Vec<String>,
        /// Use the prompt as is, without the chat template (what a model with no chat
        /// template gets anyway).
        #[arg(long)]
        raw: bool,
        /// Print prompt and response token ids and text as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum ProfileCommand {
    /// The spans of a trace (ours or torch's, `.json` or `.json.gz`) by total time.
    Summarize {
        trace: PathBuf,
        /// How many span names to print.
        #[arg(long, default_value_t = 20)]
        top: usize,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Our GPU kernels against their plain-burn fallbacks (fails on a mismatch), then each
    /// cubek strategy's time on the training step's product shapes (the `cuda` build).
    Kernels {
        /// Timed repeats per product.
        #[arg(long, default_value_t = 10)]
        repeat: usize,
        /// Only the checks, no strategy timing.
        #[arg(long)]
        no_timing: bool,
        /// Only these families (comma-separated: adamw, gemm, attention, vocab, norm, swiglu,
        /// bias, rope, sum_squares, sampling, decode, upload, launches); all by default.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
    },
    /// Decode tokens/s of the native rollout engine per batch size (random-init Qwen2).
    Rollout {
        /// Model size: tiny, small, qwen2-0.5b, qwen2-1.5b, llama3.2-3b, qwen2.5-3b or
        /// qwen2.5-7b (drawn at random).
        #[arg(long, default_value = "small")]
        preset: String,
        /// An HF checkpoint directory to load instead of a preset.
        #[arg(long)]
        model: Option<std::path::PathBuf>,
        /// The HBM bandwidth (TB/s) the memory-bound fraction is counted against: H100 SXM
        /// 3.35, H200 4.8.
        #[arg(long, default_value_t = 3.35)]
        hbm_tbs: f64,
        /// Batch sizes, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
        batch: Vec<usize>,
        #[arg(long, default_value_t = 32)]
        prompt_len: usize,
        #[arg(long, default_value_t = 64)]
        new_tokens: usize,
        /// Compute dtype of the products: float32 or bfloat16.
        #[arg(long, default_value = "float32")]
        dtype: String,
        /// Requests per prompt (the GRPO group size; they share one prefill).
        #[arg(long, default_value_t = 1)]
        n: usize,
        /// Turns of a multi-turn conversation: each turn's prompt is the last turn's prompt and
        /// response plus a few tokens, generated with prefixes kept across calls and without
        /// prefix caching (prefilled and reused tokens, prefill time per turn).
        #[arg(long, default_value_t = 1)]
        turns: usize,
    },
    /// One training step (forward, loss, backward, AdamW) of a random-init Qwen2: tokens/s, MFU
    /// and the time per phase (peer: bench/peers/train_step.py).
    TrainStep {
        /// Model size: tiny, small, qwen2-0.5b or qwen2-1.5b.
        #[arg(long, default_value = "small")]
        preset: String,
        #[arg(long, default_value_t = 4)]
        batch: usize,
        #[arg(long, default_value_t = 512)]
        seq: usize,
        /// Timed steps (after 3 warm-up steps); the median is reported.
        #[arg(long, default_value_t = 10)]
        steps: usize,
        /// The peak TFLOP/s MFU is counted against (H100 SXM: 989 bf16 dense, 67 fp32).
        #[arg(long, default_value_t = 989.0)]
        peak_tflops: f64,
        /// Compute dtype of the products: float32 or bfloat16 (master weights stay f32).
        #[arg(long, default_value = "float32")]
        dtype: String,
        /// GPU products: own (our CUDA kernel, wgmma on Hopper; cubek where it does not
        /// apply), wmma (our wmma kernel on every GPU), cubek (fixed strategy per shape) or burn
        /// (burn's own product).
        #[arg(long, default_value = "own")]
        gemm: String,
        /// GPU AdamW: fused (one kernel per tensor) or chain (burn's tensor operations).
        #[arg(long, default_value = "fused")]
        adamw: String,
        /// GPU attention: fused (our kernel, forward and backward) or decomposed (burn's
        /// operations).
        #[arg(long, default_value = "fused")]
        attention: String,
        /// GPU log-probs over the vocabulary: fused (our kernel, forward and backward) or
        /// decomposed (burn's log_softmax + gather).
        #[arg(long, default_value = "fused")]
        vocab: String,
        /// Print where the host threads' time goes over the timed steps (a build with the
        /// host-profile feature).
        #[arg(long)]
        host_profile: bool,
        /// Activation recompute: none, uniform:N (chunks of N layers) or block:N (the first
        /// N layers), Megatron's `recompute_method` and `recompute_num_layers`.
        #[arg(long, default_value = "none")]
        recompute: String,
    },
    /// Square matrix-product TFLOP/s of the backend (peer: bench/peers/gemm.py).
    Gemm {
        /// Matrix sizes, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "4096,8192")]
        sizes: Vec<usize>,
        #[arg(long, default_value_t = 20)]
        repeat: usize,
    },
    /// NCCL all-reduce bus bandwidth over this node's GPUs (`cuda` build): threads of this
    /// process, or, with torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, one rank
    /// of a multi-process job.
    Nccl {
        #[arg(long, default_value_t = 2)]
        gpus: usize,
        /// All-reduce sizes, comma-separated: bytes with a k, m or g suffix, or MiB.
        #[arg(long, value_delimiter = ',', default_value = "4k,64k,256k,1m,16m,256m")]
        sizes: Vec<String>,
        #[arg(long, default_value_t = 10)]
        repeat: usize,
    },
    /// The hybrid engine's actor → rollout weight sync on one device (f32 actor, bf16
    /// rollout) per bucket size, against the device's copy bound (peer:
    /// bench/peers/weight_sync.py).
    WeightSync {
        /// Model size: tiny, small, qwen2-0.5b or qwen2-1.5b.
        #[arg(long, default_value = "small")]
        preset: String,
        /// Bucket sizes in MiB (`update_weights_bucket_megabytes`), comma-separated; 0 sends
        /// each shard as it is (the rollout's layout is the actor's).
        #[arg(long, value_delimiter = ',', default_value = "0,512")]
        bucket_mb: Vec<usize>,
        #[arg(long, default_value_t = 5)]
        repeat: usize,
    },
    /// The actor's log-prob pass and PPO update on mixed prompt and response lengths, with and
    /// without the fused head (`model.use_fused_kernels`), dynamic batch size
    /// (`use_dynamic_bsz`) and sequence packing (`use_remove_padding`): time, peak memory and
    /// the log-probs' distance from the plain padded pass.
    LogProb {
        #[arg(long, default_value = "small")]
        preset: String,
        #[arg(long, default_value_t = 16)]
        rows: usize,
        #[arg(long, default_value_t = 64)]
        prompt: usize,
        /// Responses have 1..=this many tokens.
        #[arg(long, default_value_t = 256)]
        response: usize,
        /// Rows per fixed micro-batch.
        #[arg(long, default_value_t = 4)]
        micro: usize,
        /// Token budget per dynamic micro-batch.
        #[arg(long, default_value_t = 1024)]
        max_tokens: usize,
        #[arg(long, default_value = "float32")]
        dtype: String,
        #[arg(long, default_value_t = 2)]
        repeat: usize,
    },
    /// Qwen2-MoE's expert block with token dispatch against the dense every-expert form,
    /// forward and forward + backward (peer: bench/peers/moe.py). The defaults are
    /// Qwen1.5-MoE-A2.7B's block: hidden 2048, experts of 1408, shared expert 5632, top-4.
    Moe {
        /// Routed expert counts, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "8,64")]
        experts: Vec<usize>,
        #[arg(long, default_value_t = 4096)]
        tokens: usize,
        #[arg(long, default_value_t = 2048)]
        hidden: usize,
        #[arg(long, default_value_t = 1408)]
        moe_ffn: usize,
        #[arg(long, default_value_t = 5632)]
        shared_ffn: usize,
        #[arg(long, default_value_t = 4)]
        top_k: usize,
        /// Matrix products in f32 or bf16.
        #[arg(long, default_value = "bf16")]
        dtype: String,
        #[arg(long, default_value_t = 5)]
        repeat: usize,
    },
    /// GPU-host transfer rates of the offload stores, checked bit for bit, and how much of a
    /// prefetch hides behind compute (`cuda` build; peer: bench/peers/offload.py).
    Offload {
        /// GiB of f32 state moved.
        #[arg(long, default_value_t = 2.0)]
        gib: f64,
        /// Tensors the state is split into.
        #[arg(long, default_value_t = 290)]
        tensors: usize,
        #[arg(long, default_value_t = 5)]
        repeat: usize,
    },
    /// One training step with tensor parallel over two GPUs (NCCL) against one GPU (`cuda`
    /// build): loss, gradient norm, loss after the update.
    TpCheck {
        #[arg(long, default_value = "small")]
        preset: String,
        #[arg(long, default_value_t = 4)]
        batch: usize,
        #[arg(long, default_value_t = 128)]
        seq: usize,
    },
    /// Training-step strong scaling under tensor parallelism on the GPUs of this node (one
    /// thread each): tp=1, then each tp size with the device collectives and with NCCL behind
    /// host waits.
    TpScaling {
        #[arg(long, default_value = "qwen2-0.5b")]
        preset: String,
        #[arg(long, default_value_t = 4)]
        batch: usize,
        #[arg(long, default_value_t = 512)]
        seq: usize,
        #[arg(long, default_value_t = 5)]
        steps: usize,
        #[arg(long, default_value = "bfloat16")]
        dtype: String,
        /// Tensor-parallel sizes, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "2,4")]
        tp: Vec<usize>,
        /// Sequence parallelism off (it is on by default, as in verl's Megatron config).
        #[arg(long)]
        no_sequence_parallel: bool,
        /// Which collectives each tp size runs with, comma-separated: device (our kernels on
        /// burn's stream) and nccl (NCCL behind host waits, the fallback).
        #[arg(long, value_delimiter = ',', default_value = "device,nccl")]
        collectives: Vec<String>,
        /// The tp = 1 step (ms) the efficiency of a rank process's row is counted against
        /// (with torchrun's RANK / WORLD_SIZE set, this process is one rank of a tp group of
        /// WORLD_SIZE, and rank 0 prints; `bench/gpu/tp_scaling.sh` runs it so).
        #[arg(long)]
        tp1_ms: Option<f64>,
        /// Sample the host threads over the timed steps and print where their time goes
        /// (rank 0 of a process group, or the tp = 1 run; needs the host-profile feature).
        #[arg(long)]
        host_profile: bool,
    },
}

/// The config `verl train` and `verl config` both start from: the `--config` file; else, when
/// the overrides name a model or a data file of the user's own, verl's defaults (as verl would
/// run that command); else the built-in task's settings (`MAIN_JOB`). A note on stderr says
/// which applied when no file was given.
fn builder(args: &ConfigArgs) -> ConfigBuilder {
    let b = ConfigBuilder::new();
    let b = match &args.config {
        Some(p) => b.file(p),
        None if names_own_model_or_data(&args.overrides) => {
            eprintln!(
                "note: a model or data of your own is named, so verl's defaults apply (not the \
                 built-in task's settings); pass --config to start from a file"
            );
            b
        }
        None => {
            eprintln!(
                "note: the built-in task's settings apply (verl::trainer::MAIN_JOB: tiny Qwen2 \
                 on addition); name actor_rollout_ref.model.path or data.train_files, or pass \
                 --config, to start from verl's defaults"
            );
            b.overrides(verl::trainer::MAIN_JOB)
        }
    };
    b.overrides(&args.overrides)
}

/// Whether `overrides` set `actor_rollout_ref.model.path` or a data file that is not one of
/// the built-in tasks (`builtin:...`).
fn names_own_model_or_data(overrides: &[String]) -> bool {
    overrides.iter().any(|o| {
        let (key, value) = o.split_once('=').unwrap_or((o, ""));
        let key = key.trim().trim_start_matches('+');
        let value = value.trim();
        let set = !value.is_empty() && value != "null";
        match key {
            "actor_rollout_ref.model.path" => set,
            "data.train_files" => set && !value.starts_with("builtin:"),
            _ => false,
        }
    })
}

fn run(cli: Cli) -> Result<(), String> {
    match cli.command {
        Command::Config {
            args,
            print,
            no_validate,
        } => config_cmd(&args, print, no_validate),
        Command::Train { args } => train_cmd(&args),
        Command::Worker { nproc_per_node } => match nproc_per_node {
            None => verl::trainer::ranks::run_rank_process(),
            Some(n) => verl::trainer::ranks::run_node(n),
        },
        Command::Bench { what } => bench_cmd(what),
        Command::Profile {
            what: ProfileCommand::Summarize { trace, top },
        } => summarize_cmd(&trace, top),
        Command::Generate {
            model,
            prompt,
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            n,
            seed,
            stop,
            raw,
            json,
        } => generate_cmd(
            &model,
            &prompt,
            max_new_tokens,
            SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                seed,
            },
            (n, stop),
            raw,
            json,
        ),
        Command::Topology { args } => {
            let cfg = builder(&args).resolve().map_err(|e| e.to_string())?;
            let world = cfg.trainer.world_size();
            let topo = Topology::new(cfg.actor_rollout_ref.actor.megatron.parallel(), world)
                .map_err(|e| e.to_string())?;
            println!(
                "world {world}: tp {} · cp {} · dp {} · pp {} | etp {} · ep {} · edp {}",
                topo.config().tp,
                topo.config().cp,
                topo.dp(),
                topo.config().pp,
                topo.config().expert_tp(),
                topo.config().ep,
                topo.expert_dp()
            );
            println!(
                "{:>5} {:>4} {:>4} {:>4} {:>4} {:>4} {:>4} {:>4}",
                "rank", "tp", "cp", "dp", "pp", "etp", "ep", "edp"
            );
            for r in 0..world {
                let c = topo.coords(r).map_err(|e| e.to_string())?;
                println!(
                    "{:>5} {:>4} {:>4} {:>4} {:>4} {:>4} {:>4} {:>4}",
                    r,
                    c.tp_rank,
                    c.cp_rank,
                    c.dp_rank,
                    c.pp_rank,
                    c.etp_rank,
                    c.ep_rank,
                    c.edp_rank
                );
            }
            for kind in GroupKind::ALL {
                println!("{kind:?}: {:?}", topo.groups(kind));
            }
            Ok(())
        }
    }
}

/// `verl config`: the resolved config (printed with `--print`) and its layout figures.
fn config_cmd(args: &ConfigArgs, print: bool, no_validate: bool) -> Result<(), String> {
    let b = builder(args);
    let cfg = b.resolve().map_err(|e| e.to_string())?;
    for note in &cfg.notes {
        eprintln!("note: {note}");
    }
    if print {
        print!("{}", cfg.to_yaml());
    }
    if !no_validate {
        let v = b.build().map_err(|e| e.to_string())?;
        eprintln!(
            "config ok: world {} · actor dp {} · {} samples per actor mini-batch per rank · \
             rollout dp {}{}",
            v.world_size,
            v.actor_dp,
            v.actor_mini_batch_per_dp,
            v.rollout_dp,
            v.critic_dp
                .map(|d| format!(" · critic dp {d}"))
                .unwrap_or_default()
        );
    }
    Ok(())
}

/// `verl bench ...`: each benchmark with its arguments.
fn bench_cmd(what: BenchCommand) -> Result<(), String> {
    match what {
        BenchCommand::Rollout {
            preset,
            model,
            hbm_tbs,
            batch,
            prompt_len,
            new_tokens,
            dtype,
            n,
            turns,
        } => bench::rollout(bench::RolloutBench {
            preset: &preset,
            model_dir: model.as_deref(),
            batches: &batch,
            prompt_len,
            new_tokens,
            dtype: &dtype,
            samples: n,
            hbm_tbs,
            turns,
        }),
        BenchCommand::TrainStep {
            preset,
            batch,
            seq,
            steps,
            peak_tflops,
            dtype,
            gemm,
            adamw,
            attention,
            vocab,
            host_profile,
            recompute,
        } => bench::train_step(
            &preset,
            batch,
            seq,
            steps,
            peak_tflops,
            &dtype,
            &bench::StepLevers {
                gemm,
                adamw,
                attention,
                vocab,
                host_profile,
                recompute,
            },
        ),
        BenchCommand::Gemm { sizes, repeat } => bench::gemm(&sizes, repeat),
        #[cfg(feature = "cuda")]
        BenchCommand::Nccl {
            gpus,
            sizes,
            repeat,
        } => bench::gpu::nccl_bandwidth(gpus, &sizes, repeat),
        #[cfg(feature = "cuda")]
        BenchCommand::TpCheck { preset, batch, seq } => bench::gpu::tp_check(&preset, batch, seq),
        #[cfg(feature = "cuda")]
        BenchCommand::TpScaling {
            preset,
            batch,
            seq,
            steps,
            dtype,
            tp,
            no_sequence_parallel,
            collectives,
            tp1_ms,
            host_profile,
        } => bench::gpu::tp_scaling(
            &preset,
            (batch, seq, steps),
            &dtype,
            &tp,
            !no_sequence_parallel,
            &collectives,
            (tp1_ms, host_profile),
        ),
        #[cfg(feature = "cuda")]
        BenchCommand::Kernels {
            repeat,
            no_timing,
            only,
        } => bench::kernels::kernels(repeat, !no_timing, &only),
        #[cfg(feature = "cuda")]
        BenchCommand::Offload {
            gib,
            tensors,
            repeat,
        } => bench::offload::offload(gib, tensors, repeat),
        BenchCommand::WeightSync {
            preset,
            bucket_mb,
            repeat,
        } => bench::weight_sync::weight_sync(&preset, &bucket_mb, repeat),
        BenchCommand::LogProb {
            preset,
            rows,
            prompt,
            response,
            micro,
            max_tokens,
            dtype,
            repeat,
        } => bench::log_prob::log_prob(
            &preset, rows, prompt, response, micro, max_tokens, &dtype, repeat,
        ),
        BenchCommand::Moe {
            experts,
            tokens,
            hidden,
            moe_ffn,
            shared_ffn,
            top_k,
            dtype,
            repeat,
        } => bench::moe::moe(
            &experts,
            &bench::moe::MoeShape {
                hidden,
                moe_ffn,
                shared_ffn,
                top_k,
                tokens,
            },
            &dtype,
            repeat,
        ),
        #[cfg(not(feature = "cuda"))]
        BenchCommand::Nccl { .. }
        | BenchCommand::TpCheck { .. }
        | BenchCommand::TpScaling { .. }
        | BenchCommand::Kernels { .. }
        | BenchCommand::Offload { .. } => {
            Err("this command needs GPUs: build with `--features cuda`".into())
        }
    }
}

fn generate_cmd(
    model: &std::path::Path,
    prompts: &[String],
    max_new_tokens: usize,
    sampling: SamplingParams,
    (n, stop): (usize, Vec<String>),
    raw: bool,
    json: bool,
) -> Result<(), String> {
    use verl::backend::DefaultBackend;
    use verl::megatron::hf::{HfCheckpoint, HfModelConfig, HfTokenizer};
    use verl::megatron::models::CausalLm;
    use verl::rollout::{EngineConfig, KvBudget, NativeRollout, Request, Sampler};
    // A directory, or a hub id already in the local Hugging Face cache.
    let resolved = verl::megatron::hf::resolve_model_dir(&model.display().to_string())
        .map_err(|e| e.to_string())?;
    let model = resolved.as_path();
    let cfg = HfModelConfig::from_dir(model).map_err(|e| e.to_string())?;
    refuse_score_heads(model, &cfg)?;
    if max_new_tokens == 0 {
        return Err("--max-new-tokens must be at least 1".into());
    }
    // The prompts first: a tokenizer that does not fit the model, or a request past its
    // context, is refused before the weights load.
    let tok = HfTokenizer::from_dir(model).map_err(|e| e.to_string())?;
    let (texts, ids) = encode_prompts(model, &tok, prompts, raw)?;
    check_prompt_ids(model, &cfg, &ids, max_new_tokens)?;
    let started = std::time::Instant::now();
    let ckpt = HfCheckpoint::open(model).map_err(|e| e.to_string())?;
    let device = Default::default();
    let lm = CausalLm::<DefaultBackend>::from_checkpoint(&cfg, &ckpt, &device)
        .map_err(|e| e.to_string())?;
    let _ = <DefaultBackend as burn::tensor::backend::Backend>::sync(&device);
    let load = ckpt.load_stats();
    tracing::info!(
        seconds = started.elapsed().as_secs_f64(),
        gb = load.bytes as f64 / 1e9,
        read_s = load.read_seconds,
        device_s = load.device_seconds,
        "weights of {} loaded",
        model.display()
    );
    let eos = if tok.eos_token_ids.is_empty() {
        cfg.eos_token_ids.clone()
    } else {
        tok.eos_token_ids.clone()
    };
    let longest = ids.iter().map(Vec::len).max().unwrap_or(1);
    let engine_cfg = EngineConfig {
        prompt_length: longest.max(1),
        response_length: max_new_tokens.max(1),
        kv_budget: KvBudget::MemoryFraction(0.5),
        sampling,
        n,
        eos_token_ids: eos,
        stop,
        ..EngineConfig::default()
    };
    let mut engine = NativeRollout::new(cfg, lm, engine_cfg, device)
        .map_err(|e| {
            e.to_string()
                .replace("actor_rollout_ref.rollout.", "--")
                .replace("response_length", "max-new-tokens")
        })?
        .with_detokenizer(std::sync::Arc::new(tok.clone()));
    tracing::info!(
        seconds = started.elapsed().as_secs_f64(),
        "rollout engine ready"
    );
    let mut requests = Vec::new();
    for (i, p) in ids.iter().enumerate() {
        for k in 0..n.max(1) {
            requests.push(Request {
                prompt: p.clone(),
                sampler: Sampler::new(sampling, (i * n.max(1) + k) as u64)
                    .map_err(|e| format!("{e} (the --{} flag)", sampling_flag(&e)))?,
                max_new_tokens,
            });
        }
    }
    let completions = engine.generate(requests).map_err(|e| e.to_string())?;
    print_completions(&tok, &completions, (&texts, &ids), n.max(1), json)?;
    let s = engine.last_stats();
    tracing::info!(
        tokens = s.generated_tokens,
        seconds = s.seconds,
        "generated {:.1} tokens/s",
        s.generated_tokens as f64 / s.seconds.max(1e-9)
    );
    Ok(())
}

/// Refuses prompts the model cannot take: a token id past its vocabulary (the tokenizer is not
/// the model's), or a prompt whose length plus `--max-new-tokens` passes its context
/// (`max_position_embeddings`). Each error names the prompt and the fix.
fn check_prompt_ids(
    model: &std::path::Path,
    cfg: &verl::megatron::hf::HfModelConfig,
    ids: &[Vec<u32>],
    max_new_tokens: usize,
) -> Result<(), String> {
    for (i, p) in ids.iter().enumerate() {
        if let Some(&id) = p.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(format!(
                "--prompt {}: the tokenizer of {} gives token id {id}, past the model's vocabulary of {} (config.json vocab_size); the tokenizer and the weights do not belong together",
                i + 1,
                model.display(),
                cfg.vocab_size
            ));
        }
        let context = cfg.max_position_embeddings;
        if p.len() + max_new_tokens > context {
            return Err(format!(
                "--max-new-tokens {max_new_tokens}: prompt {} has {} tokens, and with the new ones that passes the model's context of {context} tokens (config.json max_position_embeddings); lower --max-new-tokens to at most {}{}",
                i + 1,
                p.len(),
                context.saturating_sub(p.len()),
                if p.len() >= context { " and shorten the prompt" } else { "" }
            ));
        }
    }
    Ok(())
}

/// Refuses a value or reward model: a score head scores tokens rather than predicting the next
/// one, so sampling from it would yield nothing useful (checked before the weights load).
fn refuse_score_heads(
    model: &std::path::Path,
    cfg: &verl::megatron::hf::HfModelConfig,
) -> Result<(), String> {
    if let Some(what) = cfg.head.score_head() {
        let config_json = cfg.to_config_json();
        let arch = config_json["architectures"][0]
            .as_str()
            .unwrap_or("this architecture");
        return Err(format!(
            "{}: {arch} is {what}; `verl generate` needs a causal LM (an `…ForCausalLM` \
             architecture in config.json)",
            model.display()
        ));
    }
    Ok(())
}

/// Each prompt as the model reads it (through its chat template unless `raw`, or when it has
/// none: a base model's prompts are plain text) and its token ids.
fn encode_prompts(
    model: &std::path::Path,
    tok: &verl::megatron::hf::HfTokenizer,
    prompts: &[String],
    raw: bool,
) -> Result<(Vec<String>, Vec<Vec<u32>>), String> {
    use verl::megatron::hf::ChatMessage;
    let raw = raw || {
        let missing = !tok.has_chat_template();
        if missing {
            eprintln!(
                "note: {} has no chat template; using each prompt as is (as --raw does)",
                model.display()
            );
        }
        missing
    };
    let mut texts = Vec::new();
    let mut ids = Vec::new();
    for p in prompts {
        let text = if raw {
            p.clone()
        } else {
            tok.apply_chat_template(&[ChatMessage::user(p)], true)
                .map_err(|e| e.to_string())?
        };
        ids.push(tok.encode(&text).map_err(|e| e.to_string())?);
        texts.push(text);
    }
    Ok((texts, ids))
}

/// Prints each completion (request `j` is sample `j % n` of prompt `j / n`): its text, or with
/// `json` one JSON object a line with the ids and the finish reason.
fn print_completions(
    tok: &verl::megatron::hf::HfTokenizer,
    completions: &[verl::rollout::Completion],
    (texts, ids): (&[String], &[Vec<u32>]),
    n: usize,
    json: bool,
) -> Result<(), String> {
    for (j, c) in completions.iter().enumerate() {
        let i = j / n;
        let response = tok.decode(&c.tokens).map_err(|e| e.to_string())?;
        if json {
            let out = serde_json::json!({
                "prompt": texts[i],
                "prompt_ids": ids[i],
                "response": response,
                "response_ids": c.tokens,
                "finish_reason": format!("{:?}", c.finish).to_lowercase(),
            });
            println!("{out}");
        } else {
            if completions.len() > 1 {
                println!("--- [{i}.{}]", j % n);
            }
            println!("{response}");
        }
    }
    Ok(())
}

fn train_cmd(args: &ConfigArgs) -> Result<(), String> {
    use verl::trainer::PpoTrainer;
    let validated = builder(args).build().map_err(|e| e.to_string())?;
    // What the config reader did with verl's keys that do nothing here or run differently.
    for note in &validated.config.notes {
        eprintln!("note: {note}");
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let summary = runtime.block_on(async {
        let mut trainer = PpoTrainer::new(validated).map_err(|e| e.to_string())?;
        trainer.fit().await.map_err(|e| e.to_string())
    })?;
    let resumed = summary
        .resumed_at
        .map_or(String::new(), |s| format!(" (resumed after step {s})"));
    println!(
        "done: {} steps{resumed} in {:.0}s; val/score/mean {} → {}; metrics in {}",
        summary.steps,
        summary.seconds,
        summary
            .val_score_before
            .map_or("-".into(), |v| format!("{v:.3}")),
        summary
            .val_score_after
            .map_or("-".into(), |v| format!("{v:.3}")),
        summary.metrics_path.display()
    );
    Ok(())
}

fn sampling_flag(e: &verl::rollout::SamplingError) -> &'static str {
    let verl::rollout::SamplingError::Invalid { field, .. } = e;
    match *field {
        "top_k" => "top-k",
        "top_p" => "top-p",
        "min_p" => "min-p",
        other => other,
    }
}

/// `verl profile summarize`: a table of the top spans by total time, with each one's share of
/// the capture's wall time (a nested span's time is also its parent's).
fn summarize_cmd(path: &std::path::Path, top: usize) -> Result<(), String> {
    let trace = verl::profiler::ChromeTrace::read(path).map_err(|e| e.to_string())?;
    let spans: Vec<_> = trace.events.iter().filter(|e| e.ph == "X").collect();
    let start = spans.iter().map(|e| e.ts).fold(f64::INFINITY, f64::min);
    let end = spans
        .iter()
        .map(|e| e.ts + e.dur)
        .fold(f64::NEG_INFINITY, f64::max);
    let wall = (end - start).max(0.0);
    println!(
        "{}: {} spans over {:.1} ms",
        path.display(),
        spans.len(),
        wall / 1e3
    );
    println!(
        "{:<32} {:<7} {:>7} {:>12} {:>10} {:>10} {:>7}",
        "span", "track", "count", "total ms", "mean ms", "max ms", "% wall"
    );
    for t in trace.summarize(top) {
        println!(
            "{:<32} {:<7} {:>7} {:>12.3} {:>10.3} {:>10.3} {:>6.1}%",
            t.name,
            t.cat,
            t.count,
            t.total_us / 1e3,
            t.total_us / 1e3 / t.count as f64,
            t.max_us / 1e3,
            if wall > 0.0 {
                100.0 * t.total_us / wall
            } else {
                0.0
            }
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    // Every command (rank processes included): a failure on burn-cuda's device thread is
    // recorded and reported by the rank instead of leaving garbage behind.
    #[cfg(feature = "cuda")]
    verl::megatron::device_faults::install_panic_hook();
    // Logs go to stderr as RUST_LOG says; without it, verl-rs's own information (what runs,
    // from where, what was skipped and why, a line per step off a terminal) and everyone's
    // warnings. The profiler's layer sees every span (it records only while a capture is open).
    use tracing_subscriber::prelude::*;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(
            "warn,verl=info,verl_core=info,verl_megatron=info,verl_rollout=info,\
             verl_offload=info,verl_profiler=info",
        )
    });
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .with_filter(filter),
        )
        .with(verl::profiler::TraceLayer)
        .init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
