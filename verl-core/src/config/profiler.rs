use serde::{Deserialize, Serialize};

/// Profiler tools, as verl names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProfilerTool {
    /// NVIDIA Nsight Systems: NVTX ranges and `cudaProfilerStart/Stop` around the captures.
    Nsys,
    /// A Chrome trace-event file per capture (torch's profiler's format).
    Torch,
    /// A device-memory timeline per capture.
    TorchMemory,
    /// Ascend NPUs' profiler.
    Npu,
}

impl ProfilerTool {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Nsys => "nsys",
            Self::Torch => "torch",
            Self::TorchMemory => "torch_memory",
            Self::Npu => "npu",
        }
    }
}

/// `tool_config.nsys`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NsysToolConfig {
    /// One capture per annotated worker method (`true`) or one per profiled step (`false`).
    pub discrete: bool,
    /// `global_tool_config.nsys.controller_nsight_options`: verl hands these to Ray to start
    /// its driver under `nsys profile`. verl-rs's driver is the process you start, so run it
    /// under `nsys profile` yourself; refused when set.
    pub controller_nsight_options: Option<serde_json::Map<String, serde_json::Value>>,
    /// `global_tool_config.nsys.worker_nsight_options`: the same for the rank processes (run
    /// `nsys profile` around `verl train`, or around each `verl worker` under torchrun or
    /// Slurm); refused when set.
    pub worker_nsight_options: Option<serde_json::Map<String, serde_json::Value>>,
}

/// `tool_config.npu` (verl's Ascend settings; refused unless left at their defaults, since
/// verl-rs has no NPU backend).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NpuToolConfig {
    pub discrete: bool,
    pub contents: Vec<String>,
    pub level: String,
    pub analysis: bool,
}

impl Default for NpuToolConfig {
    fn default() -> Self {
        Self {
            discrete: false,
            contents: Vec::new(),
            level: "level1".into(),
            analysis: true,
        }
    }
}

/// `tool_config.torch`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TorchToolConfig {
    /// What to record: `cpu` (host spans), `cuda` (device spans), `memory` (memory samples as
    /// a counter track); empty: `cpu` and `cuda`. `shapes` and `stack` are refused.
    pub contents: Vec<String>,
    /// One capture per annotated worker method instead of one per profiled step.
    pub discrete: bool,
    /// verl's older step window inside a capture (superseded by `global_profiler.steps`).
    pub step_start: u64,
    pub step_end: Option<u64>,
}

/// `tool_config.torch_memory` / `global_tool_config.torch_memory`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TorchMemoryToolConfig {
    /// Memory samples kept per capture (the latest; torch keeps its latest allocator events).
    pub trace_alloc_max_entries: usize,
    /// Spans recorded with each sample (the innermost; torch: Python frames per allocation).
    pub stack_depth: usize,
}

impl Default for TorchMemoryToolConfig {
    fn default() -> Self {
        Self {
            trace_alloc_max_entries: 100_000,
            stack_depth: 32,
        }
    }
}

/// Per-tool settings (a role's `tool_config`, and `global_profiler.global_tool_config`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ToolConfig {
    pub nsys: NsysToolConfig,
    pub npu: NpuToolConfig,
    pub torch: TorchToolConfig,
    pub torch_memory: TorchMemoryToolConfig,
}

impl ToolConfig {
    /// Whether `tool` captures once per annotated worker method.
    pub fn discrete(&self, tool: ProfilerTool) -> bool {
        match tool {
            ProfilerTool::Nsys => self.nsys.discrete,
            ProfilerTool::Torch => self.torch.discrete,
            ProfilerTool::Npu => self.npu.discrete,
            ProfilerTool::TorchMemory => false,
        }
    }
}

/// `global_profiler`: the tool, which training steps, and where captures go.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GlobalProfilerConfig {
    pub tool: Option<ProfilerTool>,
    /// Training steps to profile (1-based); `None`: none.
    pub steps: Option<Vec<u64>>,
    /// Consecutive listed steps make one capture.
    pub profile_continuous_steps: bool,
    pub save_path: String,
    /// Tool settings every role inherits (verl's `global_tool_config`; the older name
    /// `tool_config` is read too).
    #[serde(alias = "tool_config")]
    pub global_tool_config: ToolConfig,
}

impl Default for GlobalProfilerConfig {
    fn default() -> Self {
        Self {
            tool: None,
            steps: None,
            profile_continuous_steps: false,
            save_path: "outputs/profile".into(),
            global_tool_config: ToolConfig::default(),
        }
    }
}

/// A role's `profiler` block; unset fields inherit from `global_profiler`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoleProfilerConfig {
    pub tool: Option<ProfilerTool>,
    pub enable: bool,
    pub all_ranks: bool,
    pub ranks: Vec<usize>,
    pub save_path: Option<String>,
    pub tool_config: Option<ToolConfig>,
}

impl RoleProfilerConfig {
    /// Fills the unset fields from the global profiler config.
    pub fn inherit(&mut self, global: &GlobalProfilerConfig) {
        if self.tool.is_none() {
            self.tool = global.tool;
        }
        if self.save_path.is_none() {
            self.save_path = Some(global.save_path.clone());
        }
        if self.tool_config.is_none() {
            self.tool_config = Some(global.global_tool_config.clone());
        }
    }

    /// Whether `rank` is profiled under this config.
    pub fn covers_rank(&self, rank: usize) -> bool {
        self.enable && (self.all_ranks || self.ranks.contains(&rank))
    }
}
