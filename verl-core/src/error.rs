//! The crate's error enums: one per concern, gathered in [`Error`].

use std::path::PathBuf;

/// Result alias used throughout verl-core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A boxed error from an implementation crate (megatron, rollout, ...).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Errors of collective communication ([`crate::traits::Communicator`]).
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("rank {rank} is not in this group of {world} ranks")]
    BadRank { rank: usize, world: usize },
    #[error("collective shapes differ across ranks: {0}")]
    Shape(String),
    #[error("a peer of this group is gone (its rank ended, failed or stopped answering): {0}")]
    PeerGone(String),
    #[error("{0}")]
    Backend(String),
    /// The driver ↔ worker connection failed or carried something unreadable.
    #[error("driver/worker connection: {0}")]
    Transport(String),
    /// A peer failed and aborted the group; the message says which rank and where.
    #[error("{0}")]
    Aborted(String),
    /// A communication setting (an environment variable) is not usable.
    #[error("{0}")]
    Setting(String),
}

/// Errors of [`crate::DataProto`] operations.
#[derive(Debug, thiserror::Error)]
pub enum DataProtoError {
    #[error("DataProto has no key `{key}`; keys present: [{available}]")]
    MissingKey { key: String, available: String },
    #[error("column `{key}` has {found} rows but the batch has {expected}; every column must share the batch dimension")]
    LengthMismatch {
        key: String,
        expected: usize,
        found: usize,
    },
    #[error("column `{key}` holds {found} tensors, not {expected}")]
    KindMismatch {
        key: String,
        expected: &'static str,
        found: &'static str,
    },
    #[error("column `{key}` has shape {shape:?} (rank {found}); asked for rank {expected}")]
    RankMismatch {
        key: String,
        shape: Vec<usize>,
        expected: usize,
        found: usize,
    },
    #[error("column `{key}` has shape {shape:?}, whose elements per row overflow a machine word")]
    ShapeOverflow { key: String, shape: Vec<usize> },
    #[error("a batch tensor needs a leading batch dimension; `{key}` is a scalar (rank 0)")]
    ScalarColumn { key: String },
    #[error("union: key `{key}` is present on both sides with different values; rename one side or pop it first")]
    UnionConflict { key: String },
    #[error("union: batch sizes differ ({left} vs {right})")]
    UnionLength { left: usize, right: usize },
    #[error("cannot chunk {len} rows into {chunks} equal chunks; pad first with `pad_to_divisor({chunks})`")]
    NotDivisible { len: usize, chunks: usize },
    #[error("`{what}` must be at least 1, got 0")]
    Zero { what: &'static str },
    #[error("split sizes {sizes:?} add up to {sum}, but the batch has {len} rows")]
    SplitSizes {
        sizes: Vec<usize>,
        sum: usize,
        len: usize,
    },
    #[error("row index {index} is out of range for a batch of {len} rows")]
    RowOutOfRange { index: usize, len: usize },
    #[error("reorder needs a permutation of 0..{len}; {detail}")]
    NotAPermutation { len: usize, detail: String },
    #[error("unpad: cannot remove {pad} rows from a batch of {len}")]
    Unpad { pad: usize, len: usize },
    #[error("concat: part {index} lacks or adds keys (expected [{expected}], found [{found}])")]
    ConcatKeys {
        index: usize,
        expected: String,
        found: String,
    },
    #[error("concat: meta_info key `{key}` differs between parts")]
    ConcatMeta { key: String },
    #[error("concat needs at least one DataProto")]
    ConcatEmpty,
    #[error("{path}: {message}")]
    Io { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
}

/// Errors of the parallel topology: an impossible layout, named by field.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error("invalid parallel layout: `{field}` {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    #[error("rank {rank} is outside a world of {world_size} ranks")]
    RankOutOfRange { rank: usize, world_size: usize },
}

/// Errors of dispatching a batch to ranks and collecting their results.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    #[error("dispatch `{mode}`: {message}")]
    Plan { mode: String, message: String },
    #[error("dispatch `{mode}`: rank {rank} published no dispatch info for mesh `{mesh}`")]
    NoMeshInfo {
        mode: String,
        mesh: String,
        rank: usize,
    },
    #[error("dispatch `{mode}`: {inputs} inputs given for {world_size} ranks; give exactly one per rank")]
    InputCount {
        mode: String,
        inputs: usize,
        world_size: usize,
    },
}

/// Errors of the worker group (the single controller's view of its ranks).
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("rank {rank} failed in `{method}`: {source}")]
    Failed {
        rank: usize,
        method: String,
        #[source]
        source: Box<Error>,
    },
    #[error("rank {rank} panicked in `{method}`: {message}")]
    Panicked {
        rank: usize,
        method: String,
        message: String,
    },
    #[error("`{method}` timed out after {timeout_s:.1}s; ranks still running: {pending:?}")]
    Timeout {
        method: String,
        timeout_s: f64,
        pending: Vec<usize>,
    },
    #[error("`{method}` was cancelled on rank {rank} because another rank failed")]
    Cancelled { rank: usize, method: String },
    #[error("the worker group is unusable after an earlier failure in `{method}`; rebuild it (ranks may be mid-collective)")]
    Poisoned { method: String },
    #[error("rank {rank}'s thread has exited")]
    RankGone { rank: usize },
    #[error(
        "rank {rank} (a process) was lost during `{method}`: {how}; the other ranks were stopped"
    )]
    Lost {
        rank: usize,
        method: String,
        how: String,
    },
    #[error("rank {rank} failed in `{method}`: {message}; the other ranks were stopped")]
    Remote {
        rank: usize,
        method: String,
        message: String,
    },
    #[error("could not start rank {rank}: {message}")]
    Spawn { rank: usize, message: String },
}

/// Errors of configuration: unknown keys, type mismatches, impossible batch arithmetic.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {message}")]
    Read { path: PathBuf, message: String },
    /// A config file sets one key twice (YAML's and JSON's readers would keep the last
    /// silently); `key` is dotted from the top.
    #[error("{path}: `{key}` is set twice; set each key once (the later value would silently replace the earlier)")]
    DuplicateKey { path: PathBuf, key: String },
    #[error("config key `{key}`: {message}")]
    Key { key: String, message: String },
    #[error("override `{text}` is not of the form key=value (e.g. trainer.total_epochs=3)")]
    OverrideSyntax { text: String },
    #[error("config `{key}` = {value}: {message}. Fix: {fix}")]
    Invalid {
        key: String,
        value: String,
        message: String,
        fix: String,
    },
}

/// Errors of a tool call ([`crate::traits::Tool`]): the agent loop shows them to the model as
/// the tool's answer.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error("tool {tool}: bad arguments: {message}")]
    Arguments { tool: String, message: String },
    #[error("tool {tool} failed: {message}")]
    Failed { tool: String, message: String },
}

/// Errors of the RL algorithms: unknown names, mismatched shapes, missing inputs.
#[derive(Debug, thiserror::Error)]
pub enum AlgorithmError {
    #[error("unknown {kind} `{name}`; registered: {known}")]
    UnknownName {
        kind: &'static str,
        name: String,
        known: String,
    },
    #[error("{what}: expected shape {expected:?}, got {found:?}")]
    Shape {
        what: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{algorithm} needs `{input}`, which was not given")]
    MissingInput {
        algorithm: String,
        input: &'static str,
    },
    #[error("{algorithm}: {message}")]
    Invalid { algorithm: String, message: String },
}

/// Any verl-core error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    DataProto(#[from] DataProtoError),
    #[error(transparent)]
    Topology(#[from] TopologyError),
    #[error(transparent)]
    Dispatch(#[from] DispatchError),
    #[error(transparent)]
    Worker(#[from] WorkerError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Algorithm(#[from] AlgorithmError),
    #[error(transparent)]
    Comm(#[from] CommError),
    /// An error raised by a backend implementation of a core trait, tagged with the role.
    #[error("{role}: {source}")]
    Backend {
        role: &'static str,
        #[source]
        source: BoxError,
    },
}

impl Error {
    /// Wraps an implementation crate's typed error, tagging it with the role that raised it.
    pub fn backend(role: &'static str, source: impl Into<BoxError>) -> Self {
        Error::Backend {
            role,
            source: source.into(),
        }
    }
}

/// The message of a caught panic (`std::panic::catch_unwind`'s payload): what a rank reports
/// when its method panicked, and what a reader reports when a third-party parser panicked on a
/// damaged file.
pub fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}
