//! `trainer.launcher`: the ranks as threads of the driver, or as processes (one per GPU).
//!
//! With processes, the driver (this process: the fit loop, data, rewards and advantages) listens
//! on `MASTER_ADDR:MASTER_PORT`, starts this node's ranks as `verl worker` processes with the
//! torchrun variables set, and waits for every rank of the job to connect, including ranks that
//! another launcher (`verl worker` with `NNODES`/`NODE_RANK`, torchrun, `srun`) started on
//! other nodes. It then sends each rank the run's config; each rank builds its roles (the same
//! [`RolePlans`] as the thread path), joins its process groups (NCCL on GPUs, TCP on the CPU
//! backend) and serves the trainer's calls.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use verl_core::config::{Device, Launcher, VerlConfig};
use verl_core::worker::{serve_rank, ProcessRanks, Roles, Served, SETUP};
use verl_megatron::parallel::{LaunchEnv, ProcessGroups, Rendezvous};

use super::error::{setup, TrainError};
use super::model::{model_and_codec, Infer};
use super::roles::{actor_methods, critic_methods, RolePlans};
use crate::launcher::{LocalRanks, NodeLayout};
use verl_core::topology::Topology;

/// How long the driver waits for every rank to connect, and a rank for the driver.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(300);

/// The port the driver listens on for a multi-node job when `MASTER_PORT` is unset
/// (torchrun's default).
const DEFAULT_MASTER_PORT: u16 = 29_500;

/// How the ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LauncherKind {
    Threads,
    Processes,
}

/// `trainer.launcher`: `threads`, `processes`, or `auto` (processes for a multi-GPU CUDA run
/// or a multi-node one, threads otherwise).
pub(crate) fn launcher_of(cfg: &VerlConfig, world: usize) -> Result<LauncherKind, TrainError> {
    let t = &cfg.trainer;
    let multi_gpu = cfg!(feature = "cuda") && t.device == Device::Cuda && world > 1;
    let kind = match t.launcher {
        Launcher::Threads => LauncherKind::Threads,
        Launcher::Processes => LauncherKind::Processes,
        Launcher::Auto if t.nnodes > 1 || multi_gpu => LauncherKind::Processes,
        Launcher::Auto => LauncherKind::Threads,
    };
    if kind == LauncherKind::Threads && t.nnodes > 1 {
        return Err(setup(format!(
            "trainer.nnodes = {}: ranks on several nodes are processes; set \
             trainer.launcher=processes (or auto)",
            t.nnodes
        )));
    }
    Ok(kind)
}

/// What the driver sends every rank process first.
#[derive(Serialize, Deserialize)]
struct RankSetup {
    config: VerlConfig,
    /// The run's length (from the data, which only the driver reads).
    total_steps: u64,
    /// The port of the driver's rendezvous table (on `MASTER_ADDR`).
    rendezvous_port: u16,
}

/// The driver's rank processes.
pub(crate) struct RankProcesses {
    pub ranks: Arc<ProcessRanks>,
    /// This node's ranks (dropping it stops them).
    local: Option<LocalRanks>,
    _table: Rendezvous,
}

/// Runs `f` to completion on a fresh runtime of its own thread (setup happens in a synchronous
/// constructor that may itself run inside a runtime).
fn block_on_fresh<T: Send>(
    f: impl std::future::Future<Output = T> + Send,
) -> Result<T, TrainError> {
    std::thread::scope(|s| {
        s.spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map(|rt| rt.block_on(f))
                .map_err(setup)
        })
        .join()
        .map_err(|_| setup("the rank setup thread panicked"))?
    })
}

fn env_number<T: std::str::FromStr>(name: &str) -> Result<Option<T>, TrainError> {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.trim()
                .parse()
                .map_err(|_| setup(format!("environment variable {name}=`{v}` is not a number")))
        })
        .transpose()
}

/// The program rank processes run: `VERL_WORKER_PROGRAM`, else this executable.
fn worker_program() -> Result<PathBuf, TrainError> {
    match std::env::var_os("VERL_WORKER_PROGRAM") {
        Some(p) => Ok(PathBuf::from(p)),
        None => std::env::current_exe().map_err(setup),
    }
}

/// A `verl worker` command for local rank `local`, on its own GPU when there are GPUs
/// (`CUDA_VISIBLE_DEVICES` narrowed to the local rank's entry, as torchrun users expect).
fn worker_command(program: &PathBuf, local: usize) -> Command {
    let mut c = Command::new(program);
    c.arg("worker");
    if cfg!(feature = "cuda") {
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let device = match visible.as_deref().map(|v| v.split(',').collect::<Vec<_>>()) {
            Some(list) if !list.is_empty() => list[local % list.len()].trim().to_string(),
            _ => local.to_string(),
        };
        c.env("CUDA_VISIBLE_DEVICES", device);
    }
    c
}

impl RankProcesses {
    /// Starts this node's ranks, waits for all `world` ranks of the job and sets them up.
    pub(crate) fn launch(
        cfg: &VerlConfig,
        world: usize,
        total_steps: u64,
    ) -> Result<Self, TrainError> {
        let t = &cfg.trainer;
        let master_addr = std::env::var("MASTER_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
        let multi_node = t.nnodes > 1;
        let port = env_number::<u16>("MASTER_PORT")?.unwrap_or(if multi_node {
            DEFAULT_MASTER_PORT
        } else {
            0
        });
        // A single-node job stays on the loopback interface; other nodes need to reach us.
        let bind = if multi_node || std::env::var("MASTER_ADDR").is_ok() {
            "0.0.0.0"
        } else {
            "127.0.0.1"
        };
        let listener = TcpListener::bind((bind, port))
            .map_err(|e| setup(format!("the driver listening on {bind}:{port}: {e}")))?;
        let port = listener.local_addr().map_err(setup)?.port();
        let table = Rendezvous::serve(&format!("{bind}:0")).map_err(setup)?;
        let rendezvous_port = table
            .addr()
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| setup("the rendezvous table has no port"))?;
        let program = worker_program()?;
        let layout = NodeLayout {
            world_size: world,
            per_node: t.n_gpus_per_node,
            node_rank: 0,
            master_addr,
            master_port: port,
        };
        let local =
            LocalRanks::spawn(&layout, |local| worker_command(&program, local)).map_err(setup)?;
        tracing::info!(
            "driver on port {port}: {} local rank processes, {world} in the job",
            t.n_gpus_per_node.min(world)
        );
        let heartbeat = verl_core::worker::heartbeat::heartbeat_timeout().map_err(setup)?;
        let ranks = ProcessRanks::accept(&listener, world, CONNECT_TIMEOUT, || local.failure())?
            .with_exit_reports(local.exit_reports())
            .with_heartbeat_timeout(heartbeat);
        let payload = serde_json::to_vec(&RankSetup {
            config: cfg.clone(),
            total_steps,
            rendezvous_port,
        })
        .map_err(setup)?;
        let ranks = Arc::new(ranks);
        let setting_up = ranks.clone();
        block_on_fresh(async move { setting_up.call(SETUP, vec![Some(payload); world]).await })??;
        Ok(Self {
            ranks,
            local: Some(local),
            _table: table,
        })
    }

    /// Ends the run: every rank exits cleanly, and this node's are waited for.
    pub(crate) fn finish(&mut self) -> Result<(), TrainError> {
        self.ranks.shutdown();
        match self.local.take() {
            Some(local) => local.wait().map_err(setup),
            None => Ok(()),
        }
    }
}

/// `verl worker`: one rank process, as the driver (or torchrun, or srun) started it with the
/// torchrun / Slurm variables. Returns when the run is over.
pub fn run_rank_process() -> Result<(), String> {
    let env = LaunchEnv::from_env()
        .map_err(|e| e.to_string())?
        .ok_or_else(|| {
            "verl worker runs one rank of a job: set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR \
             and MASTER_PORT (as torchrun does, and as `verl train` does for its own ranks), or \
             start it under srun"
                .to_string()
        })?;
    let master_host = env
        .master
        .rsplit_once(':')
        .map(|(h, _)| h.to_string())
        .unwrap_or_else(|| env.master.clone());
    let rank = env.rank;
    serve_rank(
        &env.master,
        rank,
        env.world_size,
        CONNECT_TIMEOUT,
        |payload, link| {
            let fail = |e: String| verl_core::Error::backend("worker", e);
            let s: RankSetup = serde_json::from_slice(payload)
                .map_err(|e| fail(format!("the driver's setup: {e}")))?;
            // The driver checked the estimator's name against what its program registered; the
            // ranks never estimate advantages.
            let estimator = [s.config.algorithm.adv_estimator.as_str()];
            let validated = s
                .config
                .validate_with(&estimator, &[])
                .map_err(|e| fail(e.to_string()))?;
            let (codec, model_cfg) = model_and_codec(&s.config).map_err(|e| fail(e.to_string()))?;
            let plans = RolePlans::new(
                &s.config,
                &validated,
                &model_cfg,
                (
                    codec.detokenizer(),
                    codec.eos_token_ids(),
                    codec.pad_token_id(),
                ),
                s.total_steps,
            )
            .map_err(|e| fail(e.to_string()))?;
            let table_addr = format!("{master_host}:{}", s.rendezvous_port);
            let host = link.host.to_string();
            // NCCL on GPUs; TCP on the CPU backend.
            let groups_of =
                |topo: &Topology, role: &str| -> verl_core::Result<ProcessGroups<Infer>> {
                    let table = Rendezvous::client(&table_addr);
                    #[cfg(feature = "cuda")]
                    {
                        let _ = &host;
                        Ok(ProcessGroups::nccl(
                            topo,
                            rank,
                            table,
                            Default::default(),
                            role,
                        )?)
                    }
                    #[cfg(not(feature = "cuda"))]
                    {
                        Ok(ProcessGroups::tcp(topo, rank, &table, &host, role)?)
                    }
                };
            let mut roles = Roles::new();
            let groups = groups_of(&plans.actor.topo, "actor")?;
            roles.insert(
                "actor".into(),
                Box::new(Served {
                    worker: plans.actor.build(rank, groups)?,
                    table: Arc::new(actor_methods(&s.config)),
                    device: Default::default(),
                }),
            );
            if let Some(critic) = &plans.critic {
                let groups = groups_of(&critic.topo, "critic")?;
                roles.insert(
                    "critic".into(),
                    Box::new(Served {
                        worker: critic.build(rank, groups)?,
                        table: Arc::new(critic_methods(&s.config)),
                        device: Default::default(),
                    }),
                );
            }
            Ok(roles)
        },
    )
    .map_err(|e| format!("rank {rank}: {e}"))
}

/// `verl worker --nproc-per-node N`: this node's `N` ranks of a multi-node job (as torchrun
/// starts a node's processes), from `NNODES`, `NODE_RANK`, `MASTER_ADDR` and `MASTER_PORT`
/// (the driver's node and port). Returns when they have all ended; the first rank that fails
/// stops the others.
pub fn run_node(per_node: usize) -> Result<(), String> {
    let number = |name: &str| -> Result<usize, String> {
        let v = std::env::var(name).map_err(|_| {
            format!("verl worker --nproc-per-node needs {name} (and NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT)")
        })?;
        v.trim()
            .parse()
            .map_err(|_| format!("environment variable {name}=`{v}` is not a number"))
    };
    let (nnodes, node_rank) = (number("NNODES")?, number("NODE_RANK")?);
    if per_node == 0 || node_rank >= nnodes {
        return Err(format!(
            "NODE_RANK={node_rank} of NNODES={nnodes} with {per_node} ranks per node: the node \
             rank must be below the node count and a node needs at least one rank"
        ));
    }
    let layout = NodeLayout {
        world_size: nnodes * per_node,
        per_node,
        node_rank,
        master_addr: std::env::var("MASTER_ADDR")
            .map_err(|_| "MASTER_ADDR is not set".to_string())?,
        master_port: number("MASTER_PORT")? as u16,
    };
    let program = worker_program().map_err(|e| e.to_string())?;
    LocalRanks::spawn(&layout, |local| worker_command(&program, local))
        .map_err(|e| e.to_string())?
        .wait()
        .map_err(|e| e.to_string())
}
