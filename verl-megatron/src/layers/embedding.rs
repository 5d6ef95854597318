use burn::module::{Module, Param};
use burn::prelude::*;
use burn::tensor::Int;

use super::TpShard;

/// Token embedding with the vocabulary split over tp ranks (`[vocab / tp, hidden]` per rank).
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
}

impl<B: Backend> VocabParallelEmbedding<B> {
    /// From the full HF weight `[vocab, hidden]`, keeping this rank's rows.
    pub fn from_full(weight: Tensor<B, 2>, tp: TpShard) -> Self {
        let [vocab, _] = weight.dims();
        let per = vocab / tp.size;
        Self {
            weight: Param::from_tensor(weight.narrow(0, per * tp.rank, per)),
        }
    }

    /// `[batch, seq]` ids → `[batch, seq, hidden]`.
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [b, t] = ids.dims();
        let w = self.weight.val();
        let [_, h] = w.dims();
        w.select(0, ids.reshape([b * t])).reshape([b, t, h])
    }
}
