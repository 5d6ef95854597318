//! The `verl` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
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
    /// Generate from a Hugging Face model directory (a plain loop for trying a checkpoint).
    Generate {
        /// The model directory (config.json, safetensors, tokenizer.json).
        #[arg(long)]
        model: PathBuf,
        /// The prompt; wrapped in the model's chat template unless --raw.
        #[arg(long)]
        prompt: String,
        #[arg(long, default_value_t = 64)]
        max_new_tokens: usize,
        /// 0 is greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f64,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Use the prompt as is, without the chat template.
        #[arg(long)]
        raw: bool,
        /// Print prompt and response token ids and text as JSON.
        #[arg(long)]
        json: bool,
    },
}

fn builder(args: &ConfigArgs) -> ConfigBuilder {
    let b = ConfigBuilder::new().overrides(&args.overrides);
    match &args.config {
        Some(p) => b.file(p),
        None => b,
    }
}

fn run(cli: Cli) -> Result<(), String> {
    match cli.command {
        Command::Config {
            args,
            print,
            no_validate,
        } => {
            let b = builder(&args);
            let cfg = b.resolve().map_err(|e| e.to_string())?;
            if print {
                print!("{}", cfg.to_yaml());
            }
            if !no_validate {
                let v = b.build().map_err(|e| e.to_string())?;
                eprintln!(
                    "config ok: world {} · actor dp {} · {} samples per actor mini-batch per rank · rollout dp {}{}",
                    v.world_size,
                    v.actor_dp,
                    v.actor_mini_batch_per_dp,
                    v.rollout_dp,
                    v.critic_dp.map(|d| format!(" · critic dp {d}")).unwrap_or_default()
                );
            }
            Ok(())
        }
        Command::Generate {
            model,
            prompt,
            max_new_tokens,
            temperature,
            seed,
            raw,
            json,
        } => generate_cmd(
            &model,
            &prompt,
            max_new_tokens,
            temperature,
            seed,
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

#[allow(clippy::too_many_arguments)]
fn generate_cmd(
    model: &std::path::Path,
    prompt: &str,
    max_new_tokens: usize,
    temperature: f64,
    seed: u64,
    raw: bool,
    json: bool,
) -> Result<(), String> {
    use verl::backend::CpuBackend;
    use verl::megatron::hf::{ChatMessage, HfCheckpoint, HfModelConfig, HfTokenizer};
    use verl::megatron::models::{generate, CausalLm, GenerateOptions};
    if temperature.is_nan() || temperature < 0.0 {
        return Err(format!(
            "--temperature must be ≥ 0 (0 is greedy), got {temperature}"
        ));
    }
    let cfg = HfModelConfig::from_dir(model).map_err(|e| e.to_string())?;
    let ckpt = HfCheckpoint::open(model).map_err(|e| e.to_string())?;
    let device = Default::default();
    let lm =
        CausalLm::<CpuBackend>::from_checkpoint(&cfg, &ckpt, &device).map_err(|e| e.to_string())?;
    let tok = HfTokenizer::from_dir(model).map_err(|e| e.to_string())?;
    let text = if raw {
        prompt.to_string()
    } else {
        tok.apply_chat_template(&[ChatMessage::user(prompt)], true)
            .map_err(|e| e.to_string())?
    };
    let prompt_ids = tok.encode(&text).map_err(|e| e.to_string())?;
    let eos = if tok.eos_token_ids.is_empty() {
        cfg.eos_token_ids.clone()
    } else {
        tok.eos_token_ids.clone()
    };
    let opts = GenerateOptions {
        max_new_tokens,
        temperature,
        seed,
        eos_token_ids: eos,
    };
    let response_ids = generate(&lm, &prompt_ids, &opts, &device);
    let response = tok.decode(&response_ids).map_err(|e| e.to_string())?;
    if json {
        let out = serde_json::json!({ "prompt": text, "prompt_ids": prompt_ids, "response": response, "response_ids": response_ids });
        println!("{out}");
    } else {
        println!("{response}");
    }
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
