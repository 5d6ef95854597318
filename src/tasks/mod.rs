//! Built-in verifiable tasks: a generator of prompts with ground truths, a tokenizer, and a
//! rule-based scorer, so the main job runs with no downloads.

pub mod arithmetic;

pub use arithmetic::{ArithmeticTask, CharTokenizer};
