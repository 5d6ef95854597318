//! [`RoleGroup`]: one role's ranks, called by method name, whichever way the ranks run.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use burn::prelude::Backend;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use super::methods::DISPATCH_INFO;
use super::threads::plan_from_infos;
use super::{MethodTable, ProcessRanks, Worker, WorkerGroup, AUTO_PADDING_KEY};
use crate::dispatch::{DispatchInfo, DispatchMode, DispatchPlan};
use crate::error::{Error, Result};
use crate::DataProto;

enum Transport<W: Worker> {
    Threads(WorkerGroup<W>),
    Processes(Arc<ProcessRanks>),
}

/// A role's ranks (`actor`, `critic`, ...) behind either transport: threads of this process,
/// or rank processes that serve the same [`MethodTable`]. The caller's code is the same for
/// both; only how the group is made differs.
///
/// ```
/// use verl_core::dispatch::DispatchInfo;
/// use verl_core::worker::{MethodTable, RoleGroup, Worker, WorkerGroup};
/// type B = verl_core::backend::CpuBackend;
///
/// struct Echo { rank: usize }
/// impl Worker for Echo {
///     fn dispatch_info(&self, _mesh: &str) -> Option<DispatchInfo> { None }
/// }
/// let table = MethodTable::<Echo, B>::new()
///     .value("whoami", |w: &mut Echo, _ctx, (): ()| Box::pin(async move { Ok(w.rank) }));
///
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let threads = WorkerGroup::spawn(2, |ctx| Ok(Echo { rank: ctx.rank }))?;
/// let group = RoleGroup::threads("echo", threads, table, Default::default());
/// let ranks: Vec<usize> = group.call_all("whoami", &()).await?;
/// assert_eq!(ranks, vec![0, 1]);
/// # Ok::<(), verl_core::Error>(())
/// # }).unwrap();
/// ```
pub struct RoleGroup<W: Worker, B: Backend> {
    role: String,
    table: Arc<MethodTable<W, B>>,
    transport: Transport<W>,
    /// Where `DataProto` replies from rank processes land.
    device: B::Device,
    auto_padding: bool,
    plans: Mutex<HashMap<String, DispatchPlan>>,
}

impl<W: Worker, B: Backend> RoleGroup<W, B> {
    /// The role's ranks as threads of this process.
    pub fn threads(
        role: &str,
        group: WorkerGroup<W>,
        table: MethodTable<W, B>,
        device: B::Device,
    ) -> Self {
        Self::with(role, Transport::Threads(group), table, device)
    }

    /// The role's ranks as rank processes (each serving `table` under `role`).
    pub fn processes(
        role: &str,
        ranks: Arc<ProcessRanks>,
        table: MethodTable<W, B>,
        device: B::Device,
    ) -> Self {
        Self::with(role, Transport::Processes(ranks), table, device)
    }

    fn with(
        role: &str,
        transport: Transport<W>,
        table: MethodTable<W, B>,
        device: B::Device,
    ) -> Self {
        Self {
            role: role.to_string(),
            table: Arc::new(table),
            transport,
            device,
            auto_padding: false,
            plans: Mutex::new(HashMap::new()),
        }
    }

    /// Pads batches that do not divide the dp size instead of refusing them.
    pub fn with_auto_padding(mut self, on: bool) -> Self {
        self.auto_padding = on;
        self
    }

    pub fn role(&self) -> &str {
        &self.role
    }

    pub fn world_size(&self) -> usize {
        match &self.transport {
            Transport::Threads(g) => g.world_size(),
            Transport::Processes(p) => p.world_size(),
        }
    }

    /// The thread group, when the ranks are threads (for closure calls in tests and tools).
    pub fn as_threads(&self) -> Option<&WorkerGroup<W>> {
        match &self.transport {
            Transport::Threads(g) => Some(g),
            Transport::Processes(_) => None,
        }
    }

    fn remote_name(&self, method: &str) -> String {
        format!("{}.{method}", self.role)
    }

    /// `OneToAll`: `input` to every rank; every rank's result, in rank order.
    pub async fn call_all<I, O>(&self, method: &str, input: &I) -> Result<Vec<O>>
    where
        I: Serialize,
        O: DeserializeOwned,
    {
        let value = serde_json::to_value(input)
            .map_err(|e| Error::backend("worker", format!("`{method}`: its argument: {e}")))?;
        let outputs: Vec<Value> = match &self.transport {
            Transport::Threads(g) => {
                let f = self.table.value_method(method)?;
                g.execute_all(method, value, move |w, ctx, v| f(w, ctx, v))
                    .await?
            }
            Transport::Processes(p) => {
                self.table.value_method(method)?;
                let bytes = serde_json::to_vec(&value)
                    .map_err(|e| Error::backend("worker", e.to_string()))?;
                let n = p.world_size();
                p.call(&self.remote_name(method), vec![Some(bytes); n])
                    .await?
                    .into_iter()
                    .flatten()
                    .map(|b| {
                        serde_json::from_slice(&b)
                            .map_err(|e| Error::backend("worker", format!("`{method}`: {e}")))
                    })
                    .collect::<Result<_>>()?
            }
        };
        outputs
            .into_iter()
            .map(|v| {
                serde_json::from_value(v)
                    .map_err(|e| Error::backend("worker", format!("`{method}`: its result: {e}")))
            })
            .collect()
    }

    /// The checked plan of a data-parallel mode (the ranks' dispatch info, asked once per mesh).
    pub async fn plan(&self, mode: &DispatchMode) -> Result<DispatchPlan> {
        let Some(mesh) = mode.mesh() else {
            return plan_from_infos(mode, None, self.world_size());
        };
        if let Some(p) = self.plans.lock().ok().and_then(|p| p.get(mesh).cloned()) {
            return Ok(p);
        }
        let infos: Vec<Option<DispatchInfo>> =
            self.call_all(DISPATCH_INFO, &mesh.to_string()).await?;
        let plan = plan_from_infos(mode, Some(infos), self.world_size())?;
        if let Ok(mut p) = self.plans.lock() {
            p.insert(mesh.to_string(), plan.clone());
        }
        Ok(plan)
    }

    /// Calls a `DataProto` method in a data-parallel mode (`DpComputeProto`, `MegatronCompute`,
    /// `MegatronPpAsDp`, `Nd`): split, each part sent only to the ranks that need it, collect.
    pub async fn call_proto(
        &self,
        mode: &DispatchMode,
        method: &str,
        data: DataProto<B>,
    ) -> Result<DataProto<B>>
    where
        DataProto<B>: Send,
    {
        let f = self.table.proto_method(method)?;
        let plan = self.plan(mode).await?;
        let auto_pad = self.auto_padding
            || data
                .meta_info
                .get(AUTO_PADDING_KEY)
                .and_then(Value::as_bool)
                .unwrap_or(false);
        let (per_rank, padding) = plan.split(&data, auto_pad)?;
        let outputs = match &self.transport {
            Transport::Threads(g) => {
                g.run(
                    method,
                    per_rank.into_iter().map(Some).collect(),
                    move |w, ctx, d| f(w, ctx, d),
                )
                .await?
            }
            Transport::Processes(p) => {
                let payloads = per_rank
                    .iter()
                    .map(|d| d.to_wire().map(Some))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                p.call(&self.remote_name(method), payloads)
                    .await?
                    .into_iter()
                    .map(|b| {
                        b.map(|b| DataProto::from_wire(&b, &self.device))
                            .transpose()
                    })
                    .collect::<std::result::Result<Vec<_>, _>>()?
            }
        };
        plan.collect(outputs, padding)
    }
}
