//! Python where verl users have Python: their code runs in `python3` worker processes that speak
//! a framed protocol with the trainer (a 4-byte little-endian length, then UTF-8 JSON, over the
//! worker's stdin and stdout). Nothing is linked: the interpreter is found at run time
//! (`VERL_PYTHON`, else `python3` on the `PATH`), so verl-rs builds without Python.
//!
//! [`PythonReward`] is verl's `custom_reward_function` this way, and [`PythonTrackers`] its
//! `trainer.logger` trackers wandb, mlflow, tensorboard and swanlab.

mod reward;
mod tracking;
mod worker;

pub use reward::{reward_timeout, PythonReward, RewardCalls};
pub use tracking::{PythonTrackers, PYTHON_TRACKERS};
