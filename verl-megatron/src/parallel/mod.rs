//! Parallelism over the `Communicator` trait: the in-process communicator that simulates ranks
//! on CPU, the TCP one that joins rank processes, the process groups of a topology, the tensor-parallel region operators whose
//! backward passes run the conjugate collectives, the pipeline schedule, the rendezvous
//! through which the processes of a multi-process job meet, and the fresh parameter leaves that
//! let ranks train as threads of one process.

mod context;
mod fresh_leaves;
mod groups;
mod launch;
mod local;
pub mod pipeline;
mod region;
mod rendezvous;
mod tcp;

pub use context::{ContextSplit, ContextWindow, CpGroup};
pub use fresh_leaves::with_fresh_leaves;
pub use groups::{membership, ModelGroups, ProcessGroups};
pub use launch::{LaunchEnv, Launcher};
pub use local::LocalCommunicator;
pub use region::{
    device_span, module_device_span, release_module_memory, run_all_to_all_rows, run_collective,
    sample_memory, sample_module_memory, Collective, CommHandle, ParallelAutodiffBackend,
    ParallelBackend, Region, TpGroup,
};
pub use rendezvous::{Rendezvous, RENDEZVOUS_TIMEOUT};
pub use tcp::TcpCommunicator;
