//! Typed builders: assemble a run's configuration in layers and refuse it, with the key and the
//! fix, before anything is allocated.

use std::fmt::Display;
use std::path::{Path, PathBuf};

use verl_core::config::{ValidatedConfig, VerlConfig};
use verl_core::error::ConfigError;

/// Builds a [`ValidatedConfig`] from defaults, an optional file and `key=value` settings.
#[derive(Debug, Clone, Default)]
pub struct ConfigBuilder {
    file: Option<PathBuf>,
    overrides: Vec<String>,
}

impl ConfigBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Loads a YAML, TOML or JSON file over the defaults.
    pub fn file(mut self, path: impl AsRef<Path>) -> Self {
        self.file = Some(path.as_ref().to_path_buf());
        self
    }

    /// Sets one dotted key, as `key=value` on the command line would.
    pub fn set(mut self, key: &str, value: impl Display) -> Self {
        self.overrides.push(format!("{key}={value}"));
        self
    }

    /// Adds raw `key=value` overrides.
    pub fn overrides<S: AsRef<str>>(mut self, overrides: impl IntoIterator<Item = S>) -> Self {
        self.overrides
            .extend(overrides.into_iter().map(|s| s.as_ref().to_string()));
        self
    }

    /// The resolved config, unchecked (what `verl config --print` shows).
    pub fn resolve(&self) -> Result<VerlConfig, ConfigError> {
        let refs: Vec<&str> = self.overrides.iter().map(String::as_str).collect();
        VerlConfig::from_layers(self.file.as_deref(), &refs)
    }

    /// The resolved config after names, parallel layouts and batch arithmetic are checked.
    pub fn build(&self) -> Result<ValidatedConfig, ConfigError> {
        self.resolve()?.validate()
    }
}
