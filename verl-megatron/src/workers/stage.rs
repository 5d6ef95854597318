//! A role's model as one stage of the 1F1B schedule (the whole model, and so the loss, without
//! pipeline parallelism): how the actor and the critic run a mini-batch's micro-batches.

use std::sync::Arc;

use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::prelude::*;
use verl_core::traits::Communicator;
use verl_core::{DataProto, Result};

use super::batch::ModelInputs;
use crate::models::CausalLm;
use crate::parallel::pipeline::{run_one_f_one_b, PipelineStage, StageOutput};
use crate::parallel::ParallelAutodiffBackend;

/// `model` over `micros`; the last stage turns a micro-batch's outputs into its loss with
/// `loss`.
struct ModelStage<'a, B: ParallelAutodiffBackend, L> {
    model: &'a CausalLm<B>,
    micros: &'a [DataProto<B::InnerBackend>],
    pipelined: bool,
    loss: L,
    acc: GradientsAccumulator<CausalLm<B>>,
}

impl<B, L> PipelineStage<B> for ModelStage<'_, B, L>
where
    B: ParallelAutodiffBackend,
    L: FnMut(&DataProto<B::InnerBackend>, Tensor<B, 3>) -> Result<Tensor<B, 1>>,
{
    fn forward(&mut self, mb: usize, input: Option<Tensor<B, 3>>) -> Result<StageOutput<B>> {
        let micro = &self.micros[mb];
        let inputs = ModelInputs::from_batch(micro)?.map(Tensor::from_inner, Tensor::from_inner);
        let out = inputs.stage_outputs(self.model, input);
        if !self.model.stage.is_last() {
            return Ok(StageOutput::Activation(out));
        }
        Ok(StageOutput::Loss((self.loss)(micro, out)?.reshape([1])))
    }

    fn input_shape(&self, mb: usize) -> [usize; 3] {
        let dims = self.micros[mb]
            .int::<2>("input_ids")
            .map(|t| t.dims())
            .unwrap_or([0, 0]);
        self.model.stage_input_shape(dims[0], dims[1])
    }

    fn before_backward(&mut self) -> Result<()> {
        match self.model.tp.comm::<B::InnerBackend>() {
            Some(tp) if tp.world_size() > 1 && self.pipelined => Ok(tp.barrier()?),
            _ => Ok(()),
        }
    }

    fn accumulate(&mut self, grads: B::Gradients) {
        let grads = GradientsParams::from_grads(grads, self.model);
        self.acc.accumulate(self.model, grads);
    }
}

/// Forward and backward of `model` over `micros`, in the 1F1B schedule through the pipeline
/// group `pp` when there is one: the summed gradients. `loss` gives a micro-batch's loss from
/// the model's response-window outputs (on the last stage only).
pub(crate) fn train_micro_batches<B, L>(
    model: &CausalLm<B>,
    micros: &[DataProto<B::InnerBackend>],
    pp: Option<&Arc<dyn Communicator<B::InnerBackend>>>,
    loss: L,
) -> Result<GradientsParams>
where
    B: ParallelAutodiffBackend,
    L: FnMut(&DataProto<B::InnerBackend>, Tensor<B, 3>) -> Result<Tensor<B, 1>>,
{
    let mut stage = ModelStage {
        model,
        micros,
        pipelined: pp.is_some(),
        loss,
        acc: GradientsAccumulator::new(),
    };
    match pp {
        None => {
            for mb in 0..micros.len() {
                let StageOutput::Loss(loss) = stage.forward(mb, None)? else {
                    unreachable!("a whole model ends in a loss")
                };
                stage.accumulate(loss.backward());
            }
        }
        Some(pp) => {
            let device = micros[0].int::<2>("input_ids")?.device();
            run_one_f_one_b(&mut stage, pp.as_ref(), micros.len(), &device)?;
        }
    }
    Ok(stage.acc.grads())
}
