//! Where a model path points: a directory as written (`~` expanded), or a Hugging Face hub id
//! (`Qwen/Qwen2.5-7B-Instruct`) found in the local hub cache as transformers lays it out
//! (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`; the snapshot `main`
//! points at). Nothing is downloaded: a model that is not there is an error naming every place
//! looked at.
//!
//! ```
//! use verl_megatron::hf::resolve_model_dir;
//!
//! let dir = tempfile::tempdir()?;
//! let snapshot = dir.path().join("models--acme--tiny/snapshots/abc123");
//! std::fs::create_dir_all(&snapshot)?;
//! std::fs::write(snapshot.join("config.json"), "{}")?;
//! std::fs::create_dir_all(dir.path().join("models--acme--tiny/refs"))?;
//! std::fs::write(dir.path().join("models--acme--tiny/refs/main"), "abc123")?;
//! std::env::set_var("HF_HUB_CACHE", dir.path());
//! assert_eq!(resolve_model_dir("acme/tiny")?, snapshot);
//! assert!(resolve_model_dir("acme/missing").unwrap_err().to_string().contains("models--acme--missing"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::path::{Path, PathBuf};

use crate::error::MegatronError;

/// `~` and `~/...` against `$HOME`.
fn expand_home(path: &str) -> PathBuf {
    match (path.strip_prefix('~'), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) if rest.is_empty() || rest.starts_with('/') => {
            PathBuf::from(home).join(rest.trim_start_matches('/'))
        }
        _ => PathBuf::from(path),
    }
}

/// The hub caches to look in, in transformers' order.
fn hub_caches() -> Vec<PathBuf> {
    if let Some(c) = std::env::var_os("HF_HUB_CACHE") {
        return vec![PathBuf::from(c)];
    }
    if let Some(h) = std::env::var_os("HF_HOME") {
        return vec![PathBuf::from(h).join("hub")];
    }
    vec![expand_home("~/.cache/huggingface/hub")]
}

/// The snapshot of `id` in `cache`: the one `refs/main` names, else the only one there.
fn snapshot(cache: &Path, id: &str) -> Option<PathBuf> {
    let repo = cache.join(format!("models--{}", id.replace('/', "--")));
    let snapshots = repo.join("snapshots");
    if let Ok(rev) = std::fs::read_to_string(repo.join("refs/main")) {
        let dir = snapshots.join(rev.trim());
        if dir.is_dir() {
            return Some(dir);
        }
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&snapshots)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    (dirs.len() == 1).then(|| dirs.remove(0))
}

/// The directory a model path names: the path itself (with `~` expanded) when it exists, else
/// a hub id's snapshot in the local cache.
pub fn resolve_model_dir(path: &str) -> Result<PathBuf, MegatronError> {
    let local = expand_home(path);
    if local.exists() {
        return Ok(local);
    }
    let looks_like_id = path.split('/').count() == 2 && !path.starts_with(['/', '.', '~']);
    let mut looked = vec![local.display().to_string()];
    if looks_like_id {
        for cache in hub_caches() {
            if let Some(dir) = snapshot(&cache, path) {
                return Ok(dir);
            }
            looked.push(
                cache
                    .join(format!("models--{}", path.replace('/', "--")))
                    .display()
                    .to_string(),
            );
        }
    }
    Err(MegatronError::ModelNotFound {
        path: path.to_string(),
        looked,
    })
}
