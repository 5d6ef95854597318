//! Helpers shared by the verl-megatron tests: the committed fixtures and loading them.
#![allow(dead_code)] // each test file uses a subset

use std::path::{Path, PathBuf};

use verl_core::backend::CpuBackend as B;
use verl_megatron::hf::{HfCheckpoint, HfModelConfig};
use verl_megatron::models::CausalLm;

/// A fixture directory written by `tools/make_fixtures.py`.
pub(crate) fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Config and model of an HF directory, on the CPU backend.
pub(crate) fn load_model(dir: &Path) -> (HfModelConfig, CausalLm<B>) {
    let cfg = HfModelConfig::from_dir(dir).unwrap();
    let model =
        CausalLm::from_checkpoint(&cfg, &HfCheckpoint::open(dir).unwrap(), &Default::default())
            .unwrap();
    (cfg, model)
}

/// `reference.json` of a fixture.
pub(crate) fn reference_json(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap())
        .unwrap()
}
