//! Parallelism over the `Communicator` trait: the in-process communicator that simulates ranks
//! on CPU, the process groups of a topology, the tensor-parallel region operators whose
//! backward passes run the conjugate collectives, and the pipeline schedule.

mod groups;
mod local;
pub mod pipeline;
mod region;

pub use groups::ProcessGroups;
pub use local::LocalCommunicator;
pub use region::{
    run_collective, Collective, CommHandle, ParallelAutodiffBackend, ParallelBackend, Region,
    TpGroup,
};
