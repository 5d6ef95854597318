//! Pipeline parallelism: how the layers split into stages, and the 1F1B schedule that runs a
//! mini-batch's micro-batches through the stages with activations sent forward and their
//! gradients sent back over the pipeline group's `send` / `recv`.
//!
//! A stage is anything implementing [`PipelineStage`]; [`run_one_f_one_b`] drives it and the
//! stage runs and accumulates each micro-batch's backward.

use std::collections::HashMap;
use std::ops::Range;

use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use verl_core::error::CommError;
use verl_core::traits::Communicator;
use verl_core::Result;

use crate::error::MegatronError;

/// The decoder layers of each pipeline stage, as Megatron splits them: evenly, or with
/// `num_layers_in_first_pipeline_stage` / `num_layers_in_last_pipeline_stage` fixed and the
/// remaining layers split evenly over the other stages.
pub fn stage_layers(
    num_layers: usize,
    stages: usize,
    first: Option<usize>,
    last: Option<usize>,
) -> Result<Vec<Range<usize>>, MegatronError> {
    let refuse = |field: &str, message: String| MegatronError::Setting {
        field: format!("actor_rollout_ref.actor.megatron.{field}"),
        message,
    };
    if stages == 0 {
        return Err(refuse(
            "pipeline_model_parallel_size",
            "must be at least 1".into(),
        ));
    }
    if stages == 1 {
        if first.is_some() || last.is_some() {
            return Err(refuse(
                "override_transformer_config",
                "num_layers_in_first/last_pipeline_stage need pipeline_model_parallel_size > 1"
                    .into(),
            ));
        }
        return Ok(std::iter::once(0..num_layers).collect());
    }
    let fixed = first.unwrap_or(0) + last.unwrap_or(0);
    let free_stages = stages - first.is_some() as usize - last.is_some() as usize;
    if fixed > num_layers {
        return Err(refuse(
            "override_transformer_config",
            format!(
                "num_layers_in_first/last_pipeline_stage ({fixed} together) exceed the model's \
                 {num_layers} layers"
            ),
        ));
    }
    let rest = num_layers - fixed;
    let per = match free_stages {
        0 if rest == 0 => 0,
        0 => {
            return Err(refuse(
                "override_transformer_config",
                format!(
                    "with pp = 2 the first and last stage sizes must add up to the {num_layers} \
                     layers"
                ),
            ))
        }
        n if rest.is_multiple_of(n) && rest / n > 0 => rest / n,
        n => {
            return Err(refuse(
                "pipeline_model_parallel_size",
                format!(
                    "{rest} layers cannot be split evenly over {n} stages (pp = {stages}); set \
                     override_transformer_config.num_layers_in_first_pipeline_stage / \
                     num_layers_in_last_pipeline_stage, or a pp that divides the layers"
                ),
            ))
        }
    };
    let mut out = Vec::with_capacity(stages);
    let mut start = 0;
    for s in 0..stages {
        let n = match (s, first, last) {
            (0, Some(f), _) => f,
            (s, _, Some(l)) if s == stages - 1 => l,
            _ => per,
        };
        if n == 0 {
            return Err(refuse(
                "pipeline_model_parallel_size",
                format!("stage {s} would hold no layer: {num_layers} layers, pp = {stages}"),
            ));
        }
        out.push(start..start + n);
        start += n;
    }
    Ok(out)
}

/// One step of a rank's pipeline schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PipelineOp {
    Forward(usize),
    Backward(usize),
}

/// Megatron's non-interleaved 1F1B order for `stage` of `stages` over `micro_batches`: warm-up
/// forwards (as many as stages after this one), then one forward and one backward in turn, then
/// the remaining backwards. At most `stages - stage` micro-batches are in flight on a stage.
pub fn one_f_one_b(stage: usize, stages: usize, micro_batches: usize) -> Vec<PipelineOp> {
    let warmup = (stages - stage - 1).min(micro_batches);
    let steady = micro_batches - warmup;
    let mut ops: Vec<PipelineOp> = (0..warmup).map(PipelineOp::Forward).collect();
    for i in 0..steady {
        ops.push(PipelineOp::Forward(warmup + i));
        ops.push(PipelineOp::Backward(i));
    }
    ops.extend((steady..micro_batches).map(PipelineOp::Backward));
    ops
}

/// What a stage's forward on one micro-batch produced.
pub enum StageOutput<B: AutodiffBackend> {
    /// The activation for the next stage (every stage but the last), `[batch, seq, hidden]`,
    /// and a loss of the stage's own to add to its backward (MoE load balancing), if any.
    Activation(Tensor<B, 3>, Option<Tensor<B, 1>>),
    /// The micro-batch's loss (the last stage), already scaled as it is to be summed.
    Loss(Tensor<B, 1>),
}

/// One pipeline stage's model as the schedule drives it.
pub trait PipelineStage<B: AutodiffBackend> {
    /// The forward of micro-batch `micro_batch`; `input` is the previous stage's activation
    /// (a leaf to take gradients for), `None` on the first stage.
    fn forward(
        &mut self,
        micro_batch: usize,
        input: Option<Tensor<B, 3>>,
    ) -> Result<StageOutput<B>>;

    /// The shape of the activation entering this stage for `micro_batch` (what `recv` waits
    /// for; every stage knows the micro-batch's rows and length).
    fn input_shape(&self, micro_batch: usize) -> [usize; 3];

    /// Micro-batch `micro_batch`'s backward from `seed` (its loss, or on a stage before the
    /// last its output times the next stage's gradient of it, plus any loss of its own): the
    /// stage accumulates its parameters' gradients (or returns an error when it cannot, which
    /// ends the schedule) and returns the gradient of `input`, the leaf its forward was given
    /// (`None` on the first stage).
    fn backward(
        &mut self,
        micro_batch: usize,
        seed: Tensor<B, 1>,
        input: Option<Tensor<B, 3>>,
    ) -> Result<Option<Tensor<B::InnerBackend, 3>>>;

    /// Called once this stage holds everything a micro-batch's backward needs, just before
    /// it: a stage whose backward runs collectives (tensor parallel) synchronises its group
    /// here. Why: burn's autodiff holds a graph's lock through its backward and, at the end of
    /// every backward, briefly locks every graph of the process; a rank blocked in a collective
    /// inside its backward must therefore never wait for a peer that still waits on another
    /// stage (the pipeline's gradient), or that stage's clean-up and this rank wait on each
    /// other forever.
    fn before_backward(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Runs `micro_batches` through this rank's `stage` of the pipeline group `comm` (stage index
/// = rank in the group) in the 1F1B order: activations go to the next stage, their gradients
/// come back, each micro-batch's backward runs in [`PipelineStage::backward`]. Returns
/// the losses of the micro-batches on the last stage (empty elsewhere).
pub fn run_one_f_one_b<B: AutodiffBackend, S: PipelineStage<B>>(
    stage: &mut S,
    comm: &dyn Communicator<B::InnerBackend>,
    micro_batches: usize,
    device: &burn::tensor::Device<B::InnerBackend>,
) -> Result<Vec<f64>> {
    let (me, stages) = (comm.rank(), comm.world_size());
    let (first, last) = (me == 0, me + 1 == stages);
    // Per micro-batch in flight: the input leaf (to send its gradient back) and the output.
    let mut inputs: HashMap<usize, Tensor<B, 3>> = HashMap::new();
    let mut outputs: HashMap<usize, StageOutput<B>> = HashMap::new();
    let mut losses = Vec::new();
    for op in one_f_one_b(me, stages, micro_batches) {
        match op {
            PipelineOp::Forward(mb) => {
                let input = if first {
                    None
                } else {
                    let shape = stage.input_shape(mb);
                    let n = shape.iter().product();
                    let flat = comm.recv(me - 1, n, device)?;
                    let leaf = Tensor::<B, 3>::from_inner(flat.reshape(shape)).require_grad();
                    inputs.insert(mb, leaf.clone());
                    Some(leaf)
                };
                let out = stage.forward(mb, input)?;
                match &out {
                    StageOutput::Activation(a, _) if !last => {
                        comm.send(a.clone().inner().flatten(0, 2), me + 1)?;
                    }
                    StageOutput::Loss(l) if last => {
                        losses.push(l.clone().into_scalar().elem::<f64>());
                    }
                    _ => {
                        return Err(CommError::Shape(format!(
                            "stage {me} of {stages} returned the wrong kind of output for \
                             micro-batch {mb}"
                        ))
                        .into())
                    }
                }
                outputs.insert(mb, out);
            }
            PipelineOp::Backward(mb) => {
                let out = outputs.remove(&mb).expect("forward ran before backward");
                let seed = match out {
                    StageOutput::Loss(loss) => loss,
                    StageOutput::Activation(a, own) => {
                        // The next stage's gradient of our output seeds our backward.
                        let shape = a.dims();
                        let n = shape.iter().product();
                        let g = comm.recv(me + 1, n, device)?.reshape(shape);
                        let seed = (a * Tensor::from_inner(g)).sum();
                        match own {
                            Some(own) => seed + own,
                            None => seed,
                        }
                    }
                };
                stage.before_backward()?;
                let input = inputs.remove(&mb);
                let on = seed.device();
                let g = verl_core::profiling::device_span::<B, _>(&on, "backward", || {
                    stage.backward(mb, seed, input)
                })?;
                if !first {
                    let g = g.ok_or_else(|| {
                        CommError::Shape(format!(
                            "stage {me}: micro-batch {mb}'s input got no gradient"
                        ))
                    })?;
                    comm.send(g.flatten(0, 2), me - 1)?;
                }
            }
        }
    }
    Ok(losses)
}
