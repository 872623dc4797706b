//! A process's place in the job, from the variables its launcher set.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};

/// The port rank 0 listens on under Slurm when `MASTER_PORT` is not set (torch's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Where this process stands: one process per GPU, `world_size` processes in all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct World {
    /// This process's rank, `0 .. world_size`.
    pub rank: usize,
    /// How many processes take part.
    pub world_size: usize,
    /// This process's index on its node: the GPU it drives.
    pub local_rank: usize,
    /// Where rank 0 listens for the rendezvous.
    pub master: SocketAddr,
}

/// A launcher variable that is missing or wrong.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum WorldError {
    /// A variable the launcher's other variables call for is not set.
    #[error("{variable} is not set, but {because} is: {hint}")]
    Missing {
        /// The missing variable.
        variable: &'static str,
        /// The variable that chose the launcher.
        because: &'static str,
        /// What sets it.
        hint: &'static str,
    },
    /// A variable's value is not what it must be.
    #[error("{variable}={value:?}: {problem}")]
    Invalid {
        /// The variable (or flag) at fault.
        variable: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
        problem: String,
    },
}

impl World {
    /// A job of one process: no rendezvous, no collectives beyond the identity.
    pub fn single() -> Self {
        Self {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            master: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
        }
    }

    /// Whether this process is rank 0 (the one that logs, writes metrics and listens).
    pub fn is_master(&self) -> bool {
        self.rank == 0
    }

    /// The world from this process's environment; `master` (`HOST:PORT`, e.g. from a
    /// `--master` flag) overrides the address the environment gives.
    pub fn from_env(master: Option<&str>) -> Result<Self, WorldError> {
        Self::from_vars(|name| std::env::var(name).ok(), master)
    }

    /// The world from the variables `var` looks up (torchrun's `RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, or Slurm's `SLURM_PROCID`,
    /// `SLURM_NTASKS`, `SLURM_LOCALID` with `SLURM_LAUNCH_NODE_IPADDR`); `RANK` wins over
    /// Slurm's; with neither, [`World::single`].
    pub fn from_vars(
        var: impl Fn(&str) -> Option<String>,
        master: Option<&str>,
    ) -> Result<Self, WorldError> {
        let override_master = master.map(|m| resolve("--master", m, m)).transpose()?;
        let (names, rank, world_size, local_rank, master) = if var("RANK").is_some() {
            let need = |variable| {
                var(variable).ok_or(WorldError::Missing {
                    variable,
                    because: "RANK",
                    hint: "torchrun and floe launch set RANK, WORLD_SIZE, LOCAL_RANK, \
                           MASTER_ADDR and MASTER_PORT together",
                })
            };
            let rank = count("RANK", &need("RANK")?)?;
            let world_size = count("WORLD_SIZE", &need("WORLD_SIZE")?)?;
            let local_rank = count("LOCAL_RANK", &need("LOCAL_RANK")?)?;
            let master = match override_master {
                Some(m) => m,
                None => {
                    let addr = need("MASTER_ADDR")?;
                    let port = port(&need("MASTER_PORT")?)?;
                    resolve("MASTER_ADDR", &addr, &format!("{addr}:{port}"))?
                }
            };
            (("RANK", "WORLD_SIZE"), rank, world_size, local_rank, master)
        } else if let Some(procid) = var("SLURM_PROCID") {
            let need = |variable| {
                var(variable).ok_or(WorldError::Missing {
                    variable,
                    because: "SLURM_PROCID",
                    hint: "srun sets SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID together",
                })
            };
            let rank = count("SLURM_PROCID", &procid)?;
            let world_size = count("SLURM_NTASKS", &need("SLURM_NTASKS")?)?;
            let local_rank = count("SLURM_LOCALID", &need("SLURM_LOCALID")?)?;
            let master = match override_master {
                Some(m) => m,
                None => {
                    let port = match var("MASTER_PORT") {
                        Some(p) => port(&p)?,
                        None => DEFAULT_MASTER_PORT,
                    };
                    let (variable, addr) = match var("MASTER_ADDR") {
                        Some(addr) => ("MASTER_ADDR", addr),
                        None => (
                            "SLURM_LAUNCH_NODE_IPADDR",
                            var("SLURM_LAUNCH_NODE_IPADDR").ok_or(WorldError::Missing {
                                variable: "SLURM_LAUNCH_NODE_IPADDR",
                                because: "SLURM_PROCID",
                                hint: "srun sets it; or set MASTER_ADDR, or pass --master",
                            })?,
                        ),
                    };
                    resolve(variable, &addr, &format!("{addr}:{port}"))?
                }
            };
            (
                ("SLURM_PROCID", "SLURM_NTASKS"),
                rank,
                world_size,
                local_rank,
                master,
            )
        } else {
            return Ok(match override_master {
                Some(master) => World {
                    master,
                    ..World::single()
                },
                None => World::single(),
            });
        };
        let (rank_variable, size_variable) = names;
        if world_size == 0 {
            return Err(WorldError::Invalid {
                variable: size_variable,
                value: "0".into(),
                problem: "a job has at least one process".into(),
            });
        }
        if rank >= world_size {
            return Err(WorldError::Invalid {
                variable: rank_variable,
                value: rank.to_string(),
                problem: format!("ranks run 0 .. {size_variable}={world_size}"),
            });
        }
        Ok(World {
            rank,
            world_size,
            local_rank,
            master,
        })
    }
}

fn count(variable: &'static str, value: &str) -> Result<usize, WorldError> {
    value.trim().parse().map_err(|_| WorldError::Invalid {
        variable,
        value: value.into(),
        problem: "not a non-negative integer".into(),
    })
}

fn port(value: &str) -> Result<u16, WorldError> {
    match value.trim().parse::<u16>() {
        Ok(0) | Err(_) => Err(WorldError::Invalid {
            variable: "MASTER_PORT",
            value: value.into(),
            problem: "not a port number 1 ..= 65535".into(),
        }),
        Ok(p) => Ok(p),
    }
}

/// `host_port` (`HOST:PORT`) resolved; `value` is what `variable` held, for the error.
fn resolve(variable: &'static str, value: &str, host_port: &str) -> Result<SocketAddr, WorldError> {
    let invalid = |problem: String| WorldError::Invalid {
        variable,
        value: value.into(),
        problem,
    };
    let mut addrs = host_port
        .to_socket_addrs()
        .map_err(|e| invalid(format!("does not resolve to an address: {e}")))?;
    // IPv4 first: NCCL's and most clusters' default, and what torchrun's MASTER_ADDR means.
    let all: Vec<SocketAddr> = addrs.by_ref().collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or(all.first())
        .copied()
        .ok_or_else(|| invalid("resolves to no address".into()))
}
