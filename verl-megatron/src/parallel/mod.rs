//! Parallelism over the `Communicator` trait: the in-process communicator that simulates ranks
//! on CPU, the process groups of a topology, and the tensor-parallel region operators whose
//! backward passes run the conjugate collectives.

mod groups;
mod local;
mod region;

pub use groups::ProcessGroups;
pub use local::LocalCommunicator;
pub use region::{
    run_collective, Collective, CommHandle, ParallelAutodiffBackend, ParallelBackend, Region,
    TpGroup,
};
