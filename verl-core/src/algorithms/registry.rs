//! A registry of named algorithm functions, shared by the advantage estimators and the policy
//! losses (verl's `register_adv_est` / `register_policy_loss`).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::error::AlgorithmError;

/// Named entries of one kind; `F` is the (unsized) function type, stored behind an `Arc`.
pub struct NamedRegistry<F: ?Sized> {
    kind: &'static str,
    entries: BTreeMap<String, Arc<F>>,
}

impl<F: ?Sized> NamedRegistry<F> {
    /// An empty registry of `kind` (used in error messages).
    pub fn new(kind: &'static str) -> Self {
        Self {
            kind,
            entries: BTreeMap::new(),
        }
    }

    /// Adds (or replaces) an entry.
    pub fn insert(&mut self, name: &str, f: Arc<F>) {
        self.entries.insert(name.to_string(), f);
    }

    /// Registered names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.entries.keys().map(String::as_str).collect()
    }

    /// The entry called `name`; an unknown name lists the registered ones.
    pub fn get(&self, name: &str) -> Result<Arc<F>, AlgorithmError> {
        self.entries
            .get(name)
            .cloned()
            .ok_or_else(|| AlgorithmError::UnknownName {
                kind: self.kind,
                name: name.to_string(),
                known: self.names().join(", "),
            })
    }
}
