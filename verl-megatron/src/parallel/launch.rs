//! [`LaunchEnv`]: where this process sits in a multi-process job, read from the environment an
//! existing launcher sets: torchrun's (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`), or Slurm's under `srun` (`SLURM_PROCID`, `SLURM_NTASKS`,
//! `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE`, `SLURM_NODEID`, the node list and job id), the
//! torchrun names winning where both are set.

use verl_core::error::CommError;

/// The port a Slurm job's rank 0 serves on when `MASTER_PORT` is not set: derived from the job
/// id so concurrent jobs on one node do not collide.
const SLURM_PORT_BASE: u64 = 20_000;
const SLURM_PORT_SPAN: u64 = 20_000;

/// Which launcher's convention a [`LaunchEnv`] was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    Torchrun,
    Slurm,
}

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    pub launcher: Launcher,
    /// Rank in the whole job, `0..world_size`.
    pub rank: usize,
    pub world_size: usize,
    /// Rank on this node: the GPU this process drives.
    pub local_rank: usize,
    /// Processes on each node.
    pub local_world_size: usize,
    /// This node's index, `0..nnodes`.
    pub node_rank: usize,
    /// Where rank 0 serves the rendezvous: `host:port`.
    pub master: String,
}

impl LaunchEnv {
    /// From the process environment; `None` when no launcher's variables are set (a
    /// single-process run).
    pub fn from_env() -> Result<Option<Self>, CommError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// From the variables `get` returns (the environment, or a test's table).
    ///
    /// ```
    /// use std::collections::HashMap;
    /// use verl_megatron::parallel::{LaunchEnv, Launcher};
    /// let vars = HashMap::from([
    ///     ("SLURM_PROCID", "9"), ("SLURM_NTASKS", "16"), ("SLURM_LOCALID", "1"),
    ///     ("SLURM_NTASKS_PER_NODE", "8(x2)"), ("SLURM_NODEID", "1"),
    ///     ("SLURM_STEP_NODELIST", "gpu[007-008]"), ("SLURM_JOB_ID", "4242"),
    /// ]);
    /// let env = LaunchEnv::from_vars(|k| vars.get(k).map(|v| v.to_string()))?.unwrap();
    /// assert_eq!((env.launcher, env.rank, env.world_size, env.local_rank), (Launcher::Slurm, 9, 16, 1));
    /// assert_eq!((env.local_world_size, env.node_rank), (8, 1));
    /// assert_eq!(env.master, "gpu007:24242");
    /// # Ok::<(), verl_core::error::CommError>(())
    /// ```
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, CommError> {
        let number = |name: &str| -> Result<Option<usize>, CommError> {
            get(name)
                .map(|v| {
                    v.trim().parse::<usize>().map_err(|_| {
                        CommError::Backend(format!(
                            "environment variable {name}=`{v}` is not a number"
                        ))
                    })
                })
                .transpose()
        };
        // A TCP port: 1..=65535, refused by name otherwise (not silently cut to 16 bits).
        let port_of = |v: usize| -> Result<u16, CommError> {
            u16::try_from(v).ok().filter(|&p| p > 0).ok_or_else(|| {
                CommError::Backend(format!(
                    "environment variable MASTER_PORT={v} is not a TCP port (1..=65535)"
                ))
            })
        };
        let missing = |name: &str, launcher: &str| {
            CommError::Backend(format!(
                "environment variable {name} is not set ({launcher} sets it for every process)"
            ))
        };
        let env = if let Some(rank) = number("RANK")? {
            let world_size =
                number("WORLD_SIZE")?.ok_or_else(|| missing("WORLD_SIZE", "torchrun"))?;
            let local_rank = number("LOCAL_RANK")?.unwrap_or(rank);
            let local_world_size = number("LOCAL_WORLD_SIZE")?.unwrap_or(world_size);
            let port =
                port_of(number("MASTER_PORT")?.ok_or_else(|| missing("MASTER_PORT", "torchrun"))?)?;
            let host = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
            LaunchEnv {
                launcher: Launcher::Torchrun,
                rank,
                world_size,
                local_rank,
                local_world_size,
                node_rank: number("GROUP_RANK")?.unwrap_or(rank / local_world_size.max(1)),
                master: format!("{host}:{port}"),
            }
        } else if let Some(rank) = number("SLURM_PROCID")? {
            let world_size =
                number("SLURM_NTASKS")?.ok_or_else(|| missing("SLURM_NTASKS", "srun"))?;
            let local_rank = number("SLURM_LOCALID")?.unwrap_or(0);
            let local_world_size = match get("SLURM_NTASKS_PER_NODE") {
                Some(v) => tasks_per_node(&v)?,
                None => world_size,
            };
            let host = match get("MASTER_ADDR") {
                Some(h) => h,
                None => {
                    let list = get("SLURM_STEP_NODELIST")
                        .or_else(|| get("SLURM_JOB_NODELIST"))
                        .ok_or_else(|| missing("SLURM_STEP_NODELIST", "srun"))?;
                    first_host(&list)?
                }
            };
            let port = match number("MASTER_PORT")? {
                Some(p) => u64::from(port_of(p)?),
                None => {
                    let job =
                        number("SLURM_JOB_ID")?.ok_or_else(|| missing("SLURM_JOB_ID", "srun"))?;
                    SLURM_PORT_BASE + job as u64 % SLURM_PORT_SPAN
                }
            };
            LaunchEnv {
                launcher: Launcher::Slurm,
                rank,
                world_size,
                local_rank,
                local_world_size,
                node_rank: number("SLURM_NODEID")?.unwrap_or(rank / local_world_size.max(1)),
                master: format!("{host}:{port}"),
            }
        } else {
            return Ok(None);
        };
        env.check()?;
        Ok(Some(env))
    }

    /// Nodes in the job.
    pub fn nnodes(&self) -> usize {
        self.world_size.div_ceil(self.local_world_size.max(1))
    }

    fn check(&self) -> Result<(), CommError> {
        if self.rank >= self.world_size {
            return Err(CommError::BadRank {
                rank: self.rank,
                world: self.world_size,
            });
        }
        if self.local_world_size == 0 || self.local_rank >= self.local_world_size {
            return Err(CommError::Backend(format!(
                "local rank {} is not below the {} processes of a node",
                self.local_rank, self.local_world_size
            )));
        }
        Ok(())
    }
}

/// The first count of Slurm's `SLURM_NTASKS_PER_NODE` (`8`, or `8(x2)` for two nodes of 8, or
/// `8(x2),4` when nodes differ: the first node's count).
fn tasks_per_node(value: &str) -> Result<usize, CommError> {
    let first = value.split([',', '(']).next().unwrap_or("").trim();
    first.parse().map_err(|_| {
        CommError::Backend(format!(
            "environment variable SLURM_NTASKS_PER_NODE=`{value}` is not a task count"
        ))
    })
}

/// The first host of a Slurm node list: `gpu[007-008,010],cpu01` gives `gpu007`, `a,b` gives
/// `a`.
fn first_host(list: &str) -> Result<String, CommError> {
    let bad = || CommError::Backend(format!("cannot read the Slurm node list `{list}`"));
    let list = list.trim();
    let end = list.find([',', '[']).unwrap_or(list.len());
    let prefix = &list[..end];
    if list[end..].starts_with('[') {
        let inner = list[end + 1..].split(']').next().ok_or_else(bad)?;
        let first = inner.split([',', '-']).next().ok_or_else(bad)?;
        if prefix.is_empty() || first.is_empty() {
            return Err(bad());
        }
        return Ok(format!("{prefix}{first}"));
    }
    if prefix.is_empty() {
        return Err(bad());
    }
    Ok(prefix.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn read(vars: &[(&str, &str)]) -> Result<Option<LaunchEnv>, CommError> {
        let map: HashMap<&str, &str> = vars.iter().copied().collect();
        LaunchEnv::from_vars(|k| map.get(k).map(|v| v.to_string()))
    }

    #[test]
    fn torchrun_two_nodes_of_four() {
        let env = read(&[
            ("RANK", "6"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "2"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(env.launcher, Launcher::Torchrun);
        assert_eq!((env.rank, env.local_rank, env.node_rank), (6, 2, 1));
        assert_eq!(env.nnodes(), 2);
        assert_eq!(env.master, "10.0.0.1:29500");
    }

    #[test]
    fn no_launcher_means_a_single_process_run() {
        assert_eq!(read(&[]).unwrap(), None);
    }

    #[test]
    fn torchrun_names_win_over_slurm_and_errors_name_the_variable() {
        let env = read(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_PORT", "1234"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((env.launcher, env.rank), (Launcher::Torchrun, 1));
        assert_eq!(env.master, "127.0.0.1:1234");
        let err = read(&[("RANK", "1"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT"), "{err}");
        let err = read(&[("RANK", "x")]).unwrap_err();
        assert!(err.to_string().contains("RANK=`x`"), "{err}");
        let err = read(&[("RANK", "4"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")]).unwrap_err();
        assert!(
            matches!(err, CommError::BadRank { rank: 4, world: 2 }),
            "{err}"
        );
    }

    #[test]
    fn slurm_node_lists_and_task_counts() {
        for (list, host) in [
            ("gpu[007-008,010],cpu01", "gpu007"),
            ("node12", "node12"),
            ("a,b", "a"),
            ("n[3]", "n3"),
        ] {
            assert_eq!(first_host(list).unwrap(), host, "{list}");
        }
        assert!(first_host("[1-2]").is_err());
        assert_eq!(tasks_per_node("8(x2)").unwrap(), 8);
        assert_eq!(tasks_per_node("4,2").unwrap(), 4);
        assert!(tasks_per_node("many").is_err());
        // MASTER_ADDR / MASTER_PORT override the node list and the job-id port.
        let env = read(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("MASTER_ADDR", "head"),
            ("MASTER_PORT", "5000"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(env.master, "head:5000");
        let err = read(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]).unwrap_err();
        assert!(err.to_string().contains("SLURM_STEP_NODELIST"), "{err}");
    }
}
