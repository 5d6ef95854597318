//! [`MethodTable`]: a role's worker methods by name, so that they can be called on a rank that
//! lives in another process (where a closure cannot go).

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::prelude::Backend;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use super::{MethodFuture, RankContext, Worker};
use crate::error::{Error, Result};
use crate::DataProto;

/// A method over a `DataProto` (the data-parallel dispatch modes).
pub(crate) type ProtoMethod<W, B> = Arc<
    dyn for<'a> Fn(&'a mut W, RankContext, DataProto<B>) -> MethodFuture<'a, DataProto<B>>
        + Send
        + Sync,
>;

/// A method over a small serde value (checkpoint requests, switches), as JSON.
pub(crate) type ValueMethod<W> =
    Arc<dyn for<'a> Fn(&'a mut W, RankContext, Value) -> MethodFuture<'a, Value> + Send + Sync>;

pub(crate) enum Method<W, B: Backend> {
    Proto(ProtoMethod<W, B>),
    Value(ValueMethod<W>),
}

/// The name under which every table answers [`Worker::dispatch_info`] (a mesh name in, an
/// optional [`crate::dispatch::DispatchInfo`] out).
pub const DISPATCH_INFO: &str = "dispatch_info";

/// A role's methods by name.
///
/// ```
/// use verl_core::dispatch::DispatchInfo;
/// use verl_core::worker::{MethodTable, Worker};
/// type B = verl_core::backend::CpuBackend;
///
/// struct Counter { calls: u64 }
/// impl Worker for Counter {
///     fn dispatch_info(&self, _mesh: &str) -> Option<DispatchInfo> { None }
/// }
///
/// let table = MethodTable::<Counter, B>::new()
///     .value("add", |w: &mut Counter, _ctx, n: u64| Box::pin(async move {
///         w.calls += n;
///         Ok(w.calls)
///     }));
/// assert_eq!(table.names(), vec!["add", "dispatch_info"]);
/// ```
pub struct MethodTable<W, B: Backend> {
    methods: BTreeMap<String, Method<W, B>>,
}

fn decode_err(method: &str, e: impl std::fmt::Display) -> Error {
    Error::backend("worker", format!("method `{method}`: its argument: {e}"))
}

impl<W: Worker, B: Backend> Default for MethodTable<W, B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<W: Worker, B: Backend> MethodTable<W, B> {
    /// A table with [`DISPATCH_INFO`] only.
    pub fn new() -> Self {
        Self {
            methods: BTreeMap::new(),
        }
        .value(DISPATCH_INFO, |w: &mut W, _ctx, mesh: String| {
            Box::pin(async move { Ok(w.dispatch_info(&mesh)) })
        })
    }

    /// Registers `name` as a `DataProto` method.
    pub fn proto<F>(mut self, name: &str, f: F) -> Self
    where
        F: for<'a> Fn(&'a mut W, RankContext, DataProto<B>) -> MethodFuture<'a, DataProto<B>>
            + Send
            + Sync
            + 'static,
    {
        self.methods
            .insert(name.to_string(), Method::Proto(Arc::new(f)));
        self
    }

    /// Registers `name` as a method over a serde argument and result.
    pub fn value<I, O, F>(mut self, name: &str, f: F) -> Self
    where
        I: DeserializeOwned + 'static,
        O: Serialize + 'static,
        F: for<'a> Fn(&'a mut W, RankContext, I) -> MethodFuture<'a, O> + Send + Sync + 'static,
    {
        let f = Arc::new(f);
        let owned = name.to_string();
        let wrapped: ValueMethod<W> = Arc::new(move |w, ctx, v| {
            let input = match serde_json::from_value::<I>(v) {
                Ok(i) => i,
                Err(e) => {
                    let e = decode_err(&owned, e);
                    return Box::pin(async move { Err(e) });
                }
            };
            let running = f(w, ctx, input);
            let name = owned.clone();
            Box::pin(async move {
                let out = running.await?;
                serde_json::to_value(out).map_err(|e| {
                    Error::backend("worker", format!("method `{name}`: its result: {e}"))
                })
            })
        });
        self.methods
            .insert(name.to_string(), Method::Value(wrapped));
        self
    }

    /// The registered names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.methods.keys().map(String::as_str).collect()
    }

    pub(crate) fn get(&self, name: &str) -> Result<&Method<W, B>> {
        self.methods.get(name).ok_or_else(|| {
            Error::backend(
                "worker",
                format!(
                    "no method `{name}` is registered (the table has: {})",
                    self.names().join(", ")
                ),
            )
        })
    }

    pub(crate) fn proto_method(&self, name: &str) -> Result<ProtoMethod<W, B>> {
        match self.get(name)? {
            Method::Proto(f) => Ok(f.clone()),
            Method::Value(_) => Err(Error::backend(
                "worker",
                format!("method `{name}` takes a serde value, not a DataProto"),
            )),
        }
    }

    pub(crate) fn value_method(&self, name: &str) -> Result<ValueMethod<W>> {
        match self.get(name)? {
            Method::Value(f) => Ok(f.clone()),
            Method::Proto(_) => Err(Error::backend(
                "worker",
                format!("method `{name}` takes a DataProto, not a serde value"),
            )),
        }
    }
}
