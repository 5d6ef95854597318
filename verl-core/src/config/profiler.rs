use serde::{Deserialize, Serialize};

/// Profiler tools, as verl names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProfilerTool {
    Nsys,
    Torch,
    Npu,
}

/// `global_profiler.tool_config.nsys`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NsysToolConfig {
    /// One capture per annotated range (`true`) or one per step (`false`).
    pub discrete: bool,
}

/// `global_profiler.tool_config.npu`.
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

/// `global_profiler.tool_config.torch`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TorchToolConfig {
    pub step_start: u64,
    pub step_end: Option<u64>,
}

/// Per-tool settings.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ToolConfig {
    pub nsys: NsysToolConfig,
    pub npu: NpuToolConfig,
    pub torch: TorchToolConfig,
}

/// `global_profiler`: the tool, which training steps, and where captures go.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GlobalProfilerConfig {
    pub tool: Option<ProfilerTool>,
    /// Training steps to profile (1-based); `None`: none.
    pub steps: Option<Vec<u64>>,
    /// Treat consecutive listed steps as one capture.
    pub profile_continuous_steps: bool,
    pub save_path: String,
    pub tool_config: ToolConfig,
}

impl Default for GlobalProfilerConfig {
    fn default() -> Self {
        Self {
            tool: None,
            steps: None,
            profile_continuous_steps: false,
            save_path: "outputs/profile".into(),
            tool_config: ToolConfig::default(),
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
            self.tool_config = Some(global.tool_config.clone());
        }
    }

    /// Whether `rank` is profiled under this config.
    pub fn covers_rank(&self, rank: usize) -> bool {
        self.enable && (self.all_ranks || self.ranks.contains(&rank))
    }
}
