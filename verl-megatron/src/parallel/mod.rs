//! Parallelism over the `Communicator` trait: the in-process communicator that simulates ranks
//! on CPU, and the process groups of a topology.

mod groups;
mod local;

pub use groups::ProcessGroups;
pub use local::LocalCommunicator;
