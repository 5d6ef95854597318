//! The PPO / GRPO trainer: verl's single-controller fit loop over the role workers.
//!
//! Each step, in verl's order: generate → reward → old log-prob → reference log-prob → values →
//! advantages → critic update → actor update; validation every `trainer.test_freq` steps. Every
//! step appends one JSON object to `<trainer.default_local_dir>/metrics.jsonl`.

pub mod builder;
pub mod checkpoint;
pub mod data;
mod data_metrics;
mod dump;
mod error;
mod groups;
pub mod log;
mod main_job;
mod model;
pub mod plot;
mod ppo_trainer;
pub mod ranks;
mod roles;
mod run_lock;
mod scorer;
mod setup;
pub mod step;
mod trackers;
pub mod val_metrics;

pub use error::TrainError;
pub use main_job::MAIN_JOB;
pub use ppo_trainer::{PpoTrainer, RunSummary};
pub use scorer::Scorer;
