//! The experts an MoE actor's old-policy pass chose for every token of a batch, kept for its
//! update to replay (router replay R2, verl's `router_replay.mode=R2`): the update's forwards
//! then route each token as the policy that computed the old log-probs did, so an optimizer
//! step that moves the router cannot flip a token's experts between the two passes whose
//! ratio the loss clips.
//!
//! The two passes group rows differently (log-prob and update micro-batches, shuffled
//! mini-batches, padding trimmed per micro-batch, sequences packed or not), so a token is
//! keyed by its row's tokens and its position id, not by where it sat in a forward.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use verl_core::{DataProto, Result};

use super::batch::ModelInputs;
use crate::models::packing::PackedSequences;
use crate::models::router_replay::Routing;
use crate::parallel::ParallelBackend;

/// A recorded id marking a token the rollout sampled but never fed (a row's last): replayed
/// as the router's own choice, and not counted missing.
const NOT_FED: i64 = -2;

/// Where each token a forward routes comes from: its row's key ([`row_key`]) and its position
/// id; `None` for padding (left to the router on replay).
pub type TokenOrigins = Vec<Option<(u64, i64)>>;

/// A row's key: a hash of its tokens (those its attention mask keeps), in order.
pub fn row_key(tokens: impl IntoIterator<Item = i64>) -> u64 {
    let mut h = DefaultHasher::new();
    for t in tokens {
        t.hash(&mut h);
    }
    h.finish()
}

/// The origins of a `[rows, width]` micro-batch's tokens (host copies of `input_ids`, the
/// attention mask and `position_ids`, row-major) in the order its forward routes them: every
/// column of every row, or with `packing` the packed tokens.
pub fn token_origins(
    ids: &[i64],
    mask: &[f32],
    positions: &[i64],
    (rows, width): (usize, usize),
    packing: Option<&PackedSequences>,
) -> TokenOrigins {
    let keys: Vec<u64> = (0..rows)
        .map(|r| {
            row_key((0..width).filter_map(|c| {
                let i = r * width + c;
                (mask[i] > 0.5).then_some(ids[i])
            }))
        })
        .collect();
    let origin = |i: usize| (mask[i] > 0.5).then(|| (keys[i / width], positions[i]));
    match packing {
        Some(p) => p.gather.iter().map(|&i| origin(i)).collect(),
        None => (0..rows * width).map(origin).collect(),
    }
}

/// Host copies of a batch's integer column `key`.
fn host_i64<C: ParallelBackend>(data: &DataProto<C>, key: &str) -> Result<Vec<i64>> {
    Ok(data.to_data(key)?.convert::<i64>().iter::<i64>().collect())
}

/// Host copies of a batch's `input_ids`, `attention_mask` and `position_ids`, row-major: what
/// [`token_origins`] reads.
fn host_tokens<C: ParallelBackend>(data: &DataProto<C>) -> Result<(Vec<i64>, Vec<f32>, Vec<i64>)> {
    let mask: Vec<f32> = data
        .to_data("attention_mask")?
        .convert::<f32>()
        .iter::<f32>()
        .collect();
    Ok((
        host_i64(data, "input_ids")?,
        mask,
        host_i64(data, "position_ids")?,
    ))
}

/// The origins of the tokens a forward over `micro` (whose inputs are `inputs`) routes, in
/// its order: every column, or the packed tokens when the model packs (`packed`).
pub(crate) fn origins_of<C: ParallelBackend>(
    micro: &DataProto<C>,
    inputs: &ModelInputs<C>,
    packed: bool,
) -> Result<TokenOrigins> {
    let (ids, mask, positions) = host_tokens(micro)?;
    let [rows, width] = inputs.input_ids.dims();
    let packing = packed.then_some(&inputs.packing);
    Ok(token_origins(
        &ids,
        &mask,
        &positions,
        (rows, width),
        packing,
    ))
}

/// Each recorded token's experts, by MoE layer (Hugging Face index), then by row: `[position,
/// k]` row-major, -1 where a position was not recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoutingStore {
    layers: BTreeMap<usize, HashMap<u64, Vec<i64>>>,
    /// Experts per token (top-k).
    k: usize,
}

impl RoutingStore {
    /// Whether nothing was recorded (no MoE layer on this rank, or no pass yet).
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// Forgets everything (the update that replays it is over).
    pub fn clear(&mut self) {
        self.layers.clear();
    }

    /// Keeps what a forward over tokens of `origins` recorded (`routing`, one `[tokens, k]`
    /// list per layer in the same order).
    pub fn record(&mut self, origins: &TokenOrigins, routing: &Routing) {
        for (&layer, chosen) in &routing.layers {
            let k = chosen.len() / origins.len().max(1);
            if k == 0 {
                continue;
            }
            self.k = k;
            let by_row = self.layers.entry(layer).or_default();
            for (origin, ids) in origins.iter().zip(chosen.chunks(k)) {
                let Some((key, pos)) = *origin else { continue };
                let Ok(pos) = usize::try_from(pos) else {
                    continue;
                };
                let row = by_row.entry(key).or_default();
                if row.len() < (pos + 1) * k {
                    row.resize((pos + 1) * k, -1);
                }
                row[pos * k..(pos + 1) * k].copy_from_slice(ids);
            }
        }
    }

    /// What a batch's rows carry in `routed_experts` `[rows, width, layers, k]` (router replay
    /// R3: the rollout's choices, each token's in its column, -1 where none), keyed as a
    /// recording pass keys its tokens. Layers whose every id is -1 (no experts) are left out.
    ///
    /// # Errors
    /// When the batch lacks `routed_experts` (the rollout did not record) or its shape is not
    /// `[rows, width of input_ids, layers, k]`.
    pub fn from_routed_experts<C: ParallelBackend>(data: &DataProto<C>) -> Result<Self> {
        let invalid = |value: String, message: String| -> verl_core::Error {
            verl_core::error::ConfigError::Invalid {
                key: "routed_experts".into(),
                value,
                message,
                fix: "give the actor the batch its rollout generated with \
                      actor_rollout_ref.rollout.enable_rollout_routing_replay=true on an MoE \
                      model (or set actor_rollout_ref.actor.router_replay.mode=R2 or disabled)"
                    .into(),
            }
            .into()
        };
        if !data.contains("routed_experts") {
            return Err(invalid(
                "absent".into(),
                "actor_rollout_ref.actor.router_replay.mode=R3 replays the rollout's routing, \
                 and the batch has no routed_experts"
                    .into(),
            ));
        }
        let (ids, mask, positions) = host_tokens(data)?;
        let routed = data.column("routed_experts")?;
        let (rows, width) = (data.len(), ids.len() / data.len().max(1));
        let [r, w, layers, k] = match routed.shape() {
            &[r, w, l, k] => [r, w, l, k],
            other => {
                return Err(invalid(
                    format!("{other:?}"),
                    "routed_experts must be [rows, width, layers, k]".into(),
                ))
            }
        };
        if (r, w) != (rows, width) || positions.len() != ids.len() {
            return Err(invalid(
                format!("{:?}", routed.shape()),
                format!("routed_experts must start [{rows}, {width}], as input_ids"),
            ));
        }
        let routed = host_i64(data, "routed_experts")?;
        let origins = token_origins(&ids, &mask, &positions, (rows, width), None);
        let mut routing = Routing::default();
        for layer in 0..layers {
            let chosen: Vec<i64> = (0..rows * width)
                .flat_map(|t| {
                    let at = (t * layers + layer) * k;
                    routed[at..at + k].iter().copied()
                })
                .collect();
            if chosen.iter().any(|&x| x >= 0) {
                routing.layers.insert(layer, chosen);
            }
        }
        // Each row's last token was sampled, never fed to the rollout: no routing exists for
        // it, and none is needed (its outputs reach no log-prob). It is marked so that replay
        // leaves it to the router without counting it missing.
        for row in 0..rows {
            let Some(last) = (0..width).rev().find(|&c| mask[row * width + c] > 0.5) else {
                continue;
            };
            let t = row * width + last;
            for chosen in routing.layers.values_mut() {
                if chosen[t * k] < 0 {
                    chosen[t * k..(t + 1) * k].fill(NOT_FED);
                }
            }
        }
        let mut store = Self::default();
        store.record(&origins, &routing);
        Ok(store)
    }

    /// The routing to replay over a forward's tokens of `origins` (`[tokens, k]` per recorded
    /// layer, -1 for a token not recorded: padding, or a row the old-policy pass never saw),
    /// and how many real tokens were not recorded.
    pub fn replay_for(&self, origins: &TokenOrigins) -> (Routing, usize) {
        let k = self.k;
        let mut missing = None;
        let mut layers = BTreeMap::new();
        for (&layer, by_row) in &self.layers {
            let mut ids = Vec::with_capacity(origins.len() * k);
            let mut absent = 0;
            for origin in origins {
                let found = origin.and_then(|(key, pos)| {
                    let pos = usize::try_from(pos).ok()?;
                    let row = by_row.get(&key)?.get(pos * k..(pos + 1) * k)?;
                    (row[0] >= 0 || row[0] == NOT_FED).then_some(row)
                });
                match found {
                    Some(row) if row[0] == NOT_FED => ids.extend(std::iter::repeat_n(-1, k)),
                    Some(row) => ids.extend_from_slice(row),
                    None => {
                        absent += usize::from(origin.is_some());
                        ids.extend(std::iter::repeat_n(-1, k));
                    }
                }
            }
            missing.get_or_insert(absent);
            layers.insert(layer, ids);
        }
        (Routing { layers }, missing.unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Two left-padded rows: [pad, 7, 8 | 9] and [4, 5, 6 | 3], prompt width 3, response 1.
    fn batch() -> (Vec<i64>, Vec<f32>, Vec<i64>) {
        let ids = vec![0, 7, 8, 9, 4, 5, 6, 3];
        let mask = vec![0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0];
        let positions = vec![0, 0, 1, 2, 0, 1, 2, 3];
        (ids, mask, positions)
    }

    #[test]
    fn padded_and_packed_orders_name_the_same_tokens() {
        let (ids, mask, positions) = batch();
        let padded = token_origins(&ids, &mask, &positions, (2, 4), None);
        assert_eq!(padded.len(), 8);
        assert_eq!(padded[0], None);
        let packing = PackedSequences::new(&mask, 2, 4, (2, 1));
        let packed = token_origins(&ids, &mask, &positions, (2, 4), Some(&packing));
        let real: Vec<_> = padded.iter().flatten().copied().collect();
        assert_eq!(packed.iter().flatten().copied().collect::<Vec<_>>(), real);
        // The rows' keys differ, positions count each row's tokens.
        assert_ne!(real[0].0, real[3].0);
        assert_eq!(
            real.iter().map(|o| o.1).collect::<Vec<_>>(),
            [0, 1, 2, 0, 1, 2, 3]
        );
    }

    #[test]
    fn a_recorded_pass_replays_onto_another_grouping() {
        let (ids, mask, positions) = batch();
        let padded = token_origins(&ids, &mask, &positions, (2, 4), None);
        // Top-2 of a layer 3: token t chose experts (t, t + 1).
        let chosen: Vec<i64> = (0..8).flat_map(|t| [t, t + 1]).collect();
        let mut store = RoutingStore::default();
        store.record(
            &padded,
            &Routing {
                layers: BTreeMap::from([(3, chosen)]),
            },
        );
        // The second row alone, packed: its tokens were 4..8 of the padded pass.
        let row = token_origins(&ids[4..], &mask[4..], &positions[4..], (1, 4), None);
        let (replay, missing) = store.replay_for(&row);
        assert_eq!(missing, 0);
        assert_eq!(replay.layers[&3], [4, 5, 5, 6, 6, 7, 7, 8]);
        // A row never recorded: every token left to the router.
        let other = token_origins(&[1, 2], &[1.0, 1.0], &[0, 1], (1, 2), None);
        let (replay, missing) = store.replay_for(&other);
        assert_eq!((replay.layers[&3].clone(), missing), (vec![-1; 4], 2));
    }

    /// A real MoE model whose routers then move: a packed forward of the same rows in the other
    /// order, replaying what the store maps from the padded pass, gives the outputs of the
    /// padded forward replaying that pass's routing as recorded (no mapping); without the replay
    /// the moved routers give other outputs.
    #[test]
    fn a_packed_regrouped_forward_replays_the_padded_pass() {
        use crate::models::feed_forward::FeedForward;
        use crate::models::router_replay::{record_routing, replay_routing};
        use crate::models::CausalLm;
        use burn::prelude::*;
        use burn::tensor::TensorData;
        use std::sync::Arc;
        use verl_core::backend::CpuBackend as B;

        let cfg = crate::models::sparse_moe::tiny_config(4, 2, 2);
        let device = Default::default();
        let model = CausalLm::<B>::init(&cfg, 0.3, 3, &device);
        let proto = |rows: &[usize]| {
            let (ids, mask, positions) = batch();
            let pick = |v: &[i64]| -> Vec<i64> {
                rows.iter()
                    .flat_map(|&r| v[r * 4..r * 4 + 4].to_vec())
                    .collect()
            };
            let mask_i: Vec<i64> = mask.iter().map(|&m| m as i64).collect();
            let n = rows.len();
            let int = |v: Vec<i64>, w: usize| {
                Tensor::<B, 2, Int>::from_data(TensorData::new(v, [n, w]), &device)
            };
            let mut d = DataProto::new();
            // Inside the tiny model's vocabulary of 8.
            let ids: Vec<i64> = pick(&ids).iter().map(|&t| t % 8).collect();
            let responses: Vec<i64> = ids.chunks(4).map(|r| r[3]).collect();
            d.insert_int("input_ids", int(ids, 4)).unwrap();
            d.insert_int("attention_mask", int(pick(&mask_i), 4))
                .unwrap();
            d.insert_int("position_ids", int(pick(&positions), 4))
                .unwrap();
            d.insert_int("responses", int(responses, 1)).unwrap();
            d
        };
        let origins = |d: &DataProto<B>, m: &CausalLm<B>| {
            let inputs = ModelInputs::from_batch(d).unwrap();
            let o = origins_of(d, &inputs, m.pack_sequences).unwrap();
            (inputs, o)
        };
        // The old policy's pass: padded, rows in order.
        let padded = proto(&[0, 1]);
        let (padded_inputs, old_origins) = origins(&padded, &model);
        let (_, old) = record_routing(|| padded_inputs.response_outputs(&model));
        let mut store = RoutingStore::default();
        store.record(&old_origins, &old);
        // The routers move a lot.
        let mut moved = model.clone();
        for layer in moved.layers.iter_mut() {
            if let FeedForward::Moe(block) = &mut layer.mlp {
                let w = block.gate.weight.val();
                block.gate.weight = burn::module::Param::from_tensor(w.neg() * 5.0);
            }
        }
        let want = replay_routing(Arc::new(old), || padded_inputs.response_outputs(&moved));
        // The update's pass: packed, rows swapped, the routing found through the store.
        let packed_model = moved.clone().with_packed_sequences(true);
        let (inputs, new_origins) = origins(&proto(&[1, 0]), &packed_model);
        let (replay, missing) = store.replay_for(&new_origins);
        assert_eq!(missing, 0);
        let got = replay_routing(Arc::new(replay), || inputs.response_outputs(&packed_model));
        let own = inputs.response_outputs(&packed_model);
        let swap =
            |t: Tensor<B, 3>| Tensor::cat(vec![t.clone().narrow(0, 1, 1), t.narrow(0, 0, 1)], 0);
        let diff = |a: Tensor<B, 3>, b: Tensor<B, 3>| -> f32 { (a - b).abs().max().into_scalar() };
        assert!(diff(swap(got), want.clone()) < 1e-4, "the replayed routing");
        assert!(
            diff(swap(own), want) > 1e-3,
            "control: the moved routers route otherwise"
        );
    }

    proptest! {
        /// Whatever rows are regrouped and however they are padded, every real token replays
        /// the experts recorded for it, and padding replays none.
        #[test]
        fn regrouped_rows_replay_their_own_tokens(
            lens in proptest::collection::vec(1usize..6, 1..5),
            pick in proptest::collection::vec(any::<bool>(), 5),
            extra in 0usize..3,
        ) {
            let width = lens.iter().max().copied().unwrap_or(1) + extra;
            let rows = lens.len();
            let mut ids = vec![0i64; rows * width];
            let mut mask = vec![0f32; rows * width];
            let mut positions = vec![0i64; rows * width];
            for (r, &len) in lens.iter().enumerate() {
                for j in 0..len {
                    // Right-aligned (left padding), distinct rows.
                    let c = width - len + j;
                    ids[r * width + c] = (r * 100 + j) as i64 + 1;
                    mask[r * width + c] = 1.0;
                    positions[r * width + c] = j as i64;
                }
            }
            let all = token_origins(&ids, &mask, &positions, (rows, width), None);
            let chosen: Vec<i64> = (0..all.len() as i64).collect();
            let mut store = RoutingStore::default();
            store.record(&all, &Routing { layers: BTreeMap::from([(0, chosen.clone())]) });
            // Some rows, packed.
            let keep: Vec<usize> = (0..rows).filter(|&r| pick[r]).collect();
            let sub = |v: &[f32]| keep.iter().flat_map(|&r| v[r * width..(r + 1) * width].to_vec()).collect::<Vec<_>>();
            let subi = |v: &[i64]| keep.iter().flat_map(|&r| v[r * width..(r + 1) * width].to_vec()).collect::<Vec<_>>();
            let (ids2, mask2, pos2) = (subi(&ids), sub(&mask), subi(&positions));
            let packing = PackedSequences::new(&mask2, keep.len(), width, (0, 0));
            let packed = token_origins(&ids2, &mask2, &pos2, (keep.len(), width), Some(&packing));
            let (replay, missing) = store.replay_for(&packed);
            prop_assert_eq!(missing, 0);
            for (t, origin) in packed.iter().enumerate() {
                let got = replay.layers[&0][t];
                match origin {
                    Some(o) => {
                        let at = all.iter().position(|x| *x == Some(*o)).unwrap();
                        prop_assert_eq!(got, chosen[at]);
                    }
                    None => prop_assert_eq!(got, -1),
                }
            }
        }
    }
}
