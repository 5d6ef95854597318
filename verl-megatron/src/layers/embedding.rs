use burn::module::{Module, Param};
use burn::prelude::*;
use burn::tensor::Int;

use crate::parallel::{ParallelBackend, TpGroup};

/// Token embedding with the vocabulary split over tp ranks (`[vocab / tp, hidden]` per rank).
/// Each rank looks up the ids in its range (zeros elsewhere) and the group sums the rows, so
/// exactly one rank contributes each token's embedding and only that rank's rows get gradient.
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    #[module(skip)]
    pub tp: TpGroup,
}

impl<B: ParallelBackend> VocabParallelEmbedding<B> {
    /// From this rank's rows `[vocab / tp, hidden]`.
    pub fn new(weight: Tensor<B, 2>, tp: &TpGroup) -> Self {
        Self {
            weight: Param::from_tensor(weight),
            tp: tp.clone(),
        }
    }

    /// From the full HF weight `[vocab, hidden]`, keeping this rank's rows.
    pub fn from_full(weight: Tensor<B, 2>, tp: &TpGroup) -> Self {
        let [vocab, _] = weight.dims();
        let (start, per) = tp.part(vocab);
        Self {
            weight: Param::from_tensor(weight.narrow(0, start, per)),
            tp: tp.clone(),
        }
    }

    /// The first vocabulary id of this rank's rows.
    pub fn vocab_start(&self) -> usize {
        self.tp.rank * self.weight.dims()[0]
    }

    /// `[batch, seq]` ids → `[batch, seq, hidden]` (with sequence parallelism, this rank's
    /// sequence shard `[batch, seq / tp, hidden]`).
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [b, t] = ids.dims();
        let w = self.weight.val();
        let [per, h] = w.dims();
        if !self.tp.is_parallel() {
            return w.select(0, ids.reshape([b * t])).reshape([b, t, h]);
        }
        let local = ids.reshape([b * t]) - self.vocab_start() as i64;
        let outside = local
            .clone()
            .lower_elem(0)
            .bool_or(local.clone().greater_equal_elem(per as i64));
        let rows = w
            .select(0, local.mask_fill(outside.clone(), 0))
            .mask_fill(outside.unsqueeze_dim::<2>(1).repeat_dim(1, h), 0.0);
        self.tp.exit(rows.reshape([b, t, h]))
    }
}
