//! A role's model as one stage of the 1F1B schedule (the whole model, and so the loss, without
//! pipeline parallelism): how the actor and the critic run a mini-batch's micro-batches.

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::{ModuleVisitor, Param};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use verl_core::traits::Communicator;
use verl_core::{DataProto, Result};

use super::batch::ModelInputs;
use crate::error::MegatronError;
use crate::models::causal_lm::RecomputeTape;
use crate::models::router_replay::Routing;
use crate::models::CausalLm;
use crate::parallel::pipeline::{run_one_f_one_b, PipelineStage, StageOutput};
use crate::parallel::{device_span, with_fresh_leaves, ParallelAutodiffBackend};

/// `model` over `micros`; the last stage turns a micro-batch's outputs into its loss with
/// `loss`.
struct ModelStage<'a, B: ParallelAutodiffBackend, L> {
    model: &'a CausalLm<B>,
    /// The model each micro-batch in flight ran its forward with: `model` with its parameters
    /// as fresh leaves (see [`with_fresh_leaves`] for why), read again for its gradients; and
    /// what its backward runs again when the model recomputes activations.
    in_flight: HashMap<usize, (CausalLm<B>, Option<RecomputeTape<B>>)>,
    micros: &'a [DataProto<B::InnerBackend>],
    pipelined: bool,
    loss: L,
    acc: GradientsAccumulator<CausalLm<B>>,
    /// What each micro-batch's MoE load-balancing losses are multiplied by (1 / the mini-batch's
    /// micro-batches over all dp ranks), and their scaled sum so far.
    aux_scale: f64,
    aux_total: f64,
    /// The temperature a fused head divides the logits by.
    temperature: f64,
    /// Each micro-batch's MoE routing to replay (router replay R2), or none at all.
    replay: &'a [Arc<Routing>],
}

impl<B, L> PipelineStage<B> for ModelStage<'_, B, L>
where
    B: ParallelAutodiffBackend,
    L: FnMut(&DataProto<B::InnerBackend>, Tensor<B, 3>) -> Result<Tensor<B, 1>>,
{
    fn forward(&mut self, mb: usize, input: Option<Tensor<B, 3>>) -> Result<StageOutput<B>> {
        let micro = &self.micros[mb];
        let inputs = ModelInputs::from_batch(micro)?
            .fused_for(self.model, micro, self.temperature)?
            .map(Tensor::from_inner, Tensor::from_inner);
        let model = with_fresh_leaves(self.model.clone());
        let run = || {
            crate::models::causal_lm::record_recompute::<B, _>(|| {
                crate::models::sparse_moe::collect_aux_losses::<B, _>(|| {
                    inputs.stage_outputs(&model, input)
                })
            })
        };
        // A replayed routing covers the recompute too: its tape runs the layers again inside.
        let ((out, aux), tape) = match self.replay.get(mb).cloned() {
            Some(routing) => crate::models::router_replay::replay_routing(routing, run),
            None => run(),
        };
        let aux = aux
            .into_iter()
            .reduce(|a, b| a + b)
            .map(|a| a * self.aux_scale);
        if let Some(a) = &aux {
            self.aux_total += a.clone().into_scalar().elem::<f64>();
        }
        // The activations of the micro-batches in flight are all held now.
        crate::parallel::sample_memory::<B>(&out.device());
        self.in_flight.insert(mb, (model, tape));
        if !self.model.stage.is_last() {
            return Ok(StageOutput::Activation(out, aux));
        }
        let loss = (self.loss)(micro, out)?.reshape([1]);
        Ok(StageOutput::Loss(match aux {
            Some(aux) => loss + aux,
            None => loss,
        }))
    }

    fn input_shape(&self, mb: usize) -> [usize; 3] {
        let micro = &self.micros[mb];
        if self.model.pack_sequences {
            // The packed row's length comes from the attention mask.
            return ModelInputs::from_batch(micro)
                .map(|inputs| inputs.stage_input_shape(self.model))
                .unwrap_or([0, 0, 0]);
        }
        let [b, t] = micro
            .int::<2>("input_ids")
            .map(|t| t.dims())
            .unwrap_or([0, 0]);
        self.model.stage_input_shape(b, t)
    }

    fn before_backward(&mut self) -> Result<()> {
        if !self.pipelined {
            return Ok(());
        }
        // Tensor-, context- and expert-parallel backwards all run collectives.
        let ep = self
            .model
            .expert_groups()
            .and_then(|(ep, _)| ep.comm::<B::InnerBackend>());
        for comm in [
            self.model.tp.comm::<B::InnerBackend>(),
            self.model.cp.comm(),
            ep,
        ]
        .into_iter()
        .flatten()
        {
            if comm.world_size() > 1 {
                comm.barrier()?;
            }
        }
        Ok(())
    }

    fn backward(
        &mut self,
        mb: usize,
        seed: Tensor<B, 1>,
        input: Option<Tensor<B, 3>>,
    ) -> Result<Option<Tensor<B::InnerBackend, 3>>> {
        let (model, tape) = self
            .in_flight
            .remove(&mb)
            .expect("the schedule runs a micro-batch's forward before its backward");
        let grads = seed.backward();
        let (grads, input_grad) = match tape {
            None => {
                let input_grad = input.and_then(|leaf| leaf.grad(&grads));
                (GradientsParams::from_grads(grads, &model), input_grad)
            }
            Some(tape) => tape.backward(&model, grads, self.aux_scale)?,
        };
        // Every trainable parameter of a stage is on its loss's path, so each backward must
        // give all of them a gradient. One missing would also leave the data-parallel buckets
        // of this rank shorter than its peers'. Checked, as a last line should burn's autodiff
        // lose one anyway.
        let mut check = GradientCoverage {
            grads: &grads,
            trainable: 0,
            missing: 0,
        };
        model.visit(&mut check);
        if check.missing > 0 {
            return Err(MegatronError::LostGradients {
                missing: check.missing,
                trainable: check.trainable,
                micro_batch: mb,
            }
            .into());
        }
        self.acc.accumulate(&model, grads);
        Ok(input_grad)
    }
}

/// Counts the trainable parameters of a model and those `grads` has no gradient for.
struct GradientCoverage<'a> {
    grads: &'a GradientsParams,
    trainable: usize,
    missing: usize,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for GradientCoverage<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !param.val().is_require_grad() {
            return;
        }
        self.trainable += 1;
        if self.grads.get::<B::InnerBackend, D>(param.id).is_none() {
            self.missing += 1;
        }
    }
}

/// Forward and backward of `model` over `micros`, in the 1F1B schedule through the pipeline
/// group `pp` when there is one: the summed gradients, and this stage's MoE load-balancing
/// losses times `aux_scale`, summed (0 without them). `loss` gives a micro-batch's loss from
/// the model's response-window outputs (on the last stage only). `replay` holds a routing to
/// replay per micro-batch (router replay), or is empty.
pub(crate) fn train_micro_batches<B, L>(
    model: &CausalLm<B>,
    micros: &[DataProto<B::InnerBackend>],
    pp: Option<&Arc<dyn Communicator<B::InnerBackend>>>,
    (aux_scale, temperature): (f64, f64),
    replay: &[Arc<Routing>],
    loss: L,
) -> Result<(GradientsParams, f64)>
where
    B: ParallelAutodiffBackend,
    L: FnMut(&DataProto<B::InnerBackend>, Tensor<B, 3>) -> Result<Tensor<B, 1>>,
{
    let mut stage = ModelStage {
        model,
        in_flight: HashMap::new(),
        micros,
        pipelined: pp.is_some(),
        loss,
        acc: GradientsAccumulator::new(),
        aux_scale,
        aux_total: 0.0,
        temperature,
        replay,
    };
    match pp {
        None => {
            for mb in 0..micros.len() {
                let _span = tracing::info_span!("micro_batch", index = mb as u64).entered();
                let StageOutput::Loss(loss) = stage.forward(mb, None)? else {
                    unreachable!("a whole model ends in a loss")
                };
                let device = loss.device();
                device_span::<B, _>(&device, "backward", || stage.backward(mb, loss, None))?;
            }
        }
        Some(pp) => {
            let device = micros[0].int::<2>("input_ids")?.device();
            run_one_f_one_b(&mut stage, pp.as_ref(), micros.len(), &device)?;
        }
    }
    Ok((stage.acc.grads(), stage.aux_total))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Distribution, TensorData};
    use verl_core::backend::{CpuAutodiff, CpuBackend};

    use super::*;
    use crate::hf::{HfModelConfig, Qwen2Dims};

    fn model() -> CausalLm<CpuAutodiff> {
        let cfg = HfModelConfig::qwen2(Qwen2Dims {
            vocab_size: 16,
            hidden_size: 16,
            intermediate_size: 16,
            num_hidden_layers: 1,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            max_position_embeddings: 16,
        });
        CausalLm::init(&cfg, 0.2, 1, &Default::default())
    }

    /// Two rows of 5 tokens, the last 2 the response.
    fn micro() -> DataProto<CpuBackend> {
        let device = Default::default();
        let int = |v: Vec<i64>, w: usize| {
            Tensor::<CpuBackend, 2, Int>::from_data(TensorData::new(v, [2, w]), &device)
        };
        let mut d = DataProto::new();
        d.insert_int("input_ids", int(vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 5))
            .unwrap();
        d.insert_int("attention_mask", int(vec![1; 10], 5)).unwrap();
        d.insert_int("position_ids", int(vec![0, 1, 2, 3, 4, 0, 1, 2, 3, 4], 5))
            .unwrap();
        d.insert_int("responses", int(vec![4, 5, 9, 10], 2))
            .unwrap();
        d
    }

    #[test]
    fn every_trainable_parameter_gets_its_gradient() {
        let model = model();
        let (grads, _) = train_micro_batches(
            &model,
            &[micro(), micro()],
            None,
            (1.0, 1.0),
            &[],
            |_, out| Ok(out.powi_scalar(2).mean().reshape([1])),
        )
        .unwrap();
        let mut check = GradientCoverage {
            grads: &grads,
            trainable: 0,
            missing: 0,
        };
        model.visit(&mut check);
        assert!(check.trainable > 0);
        assert_eq!(check.missing, 0);
    }

    /// A backward that reaches none of the model's parameters stands in for the gradients
    /// burn's autodiff can drop: the micro-batch is refused, never summed short.
    #[test]
    fn a_micro_batch_without_gradients_is_refused() {
        let model = model();
        let elsewhere =
            Tensor::<CpuAutodiff, 1>::random([3], Distribution::Default, &Default::default())
                .require_grad();
        let e = train_micro_batches(&model, &[micro()], None, (1.0, 1.0), &[], |_, _| {
            Ok(elsewhere.clone().sum())
        })
        .unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("got no gradient from micro-batch 0"),
            "{text}"
        );
        assert!(text.contains("burn#5573"), "{text}");
    }
}
