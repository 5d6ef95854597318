//! The pipeline schedule: Megatron's 1F1B order, the stage split (with the first / last stage
//! overrides), and a stack of layers split over 2 or 4 stages on simulated ranks giving the
//! single rank's losses and gradients, activations and gradients travelling by send / recv.

use burn::module::{Module, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::activation::tanh;
use burn::tensor::TensorData;
use verl_core::backend::{CpuAutodiff, CpuBackend};
use verl_megatron::parallel::pipeline::{
    one_f_one_b, run_one_f_one_b, stage_layers, PipelineOp, PipelineStage, StageOutput,
};
use verl_megatron::parallel::LocalCommunicator;

type A = CpuAutodiff;
const WIDTH: usize = 6;
const SEQ: usize = 3;
const ROWS: usize = 2;

#[test]
fn one_f_one_b_matches_megatrons_order() {
    use PipelineOp::{Backward as B, Forward as F};
    // 4 stages, 6 micro-batches: the first stage warms up with 3 forwards, the last with none.
    assert_eq!(
        one_f_one_b(0, 4, 6),
        vec![
            F(0),
            F(1),
            F(2),
            F(3),
            B(0),
            F(4),
            B(1),
            F(5),
            B(2),
            B(3),
            B(4),
            B(5)
        ]
    );
    assert_eq!(
        one_f_one_b(3, 4, 6),
        vec![
            F(0),
            B(0),
            F(1),
            B(1),
            F(2),
            B(2),
            F(3),
            B(3),
            F(4),
            B(4),
            F(5),
            B(5)
        ]
    );
    // Fewer micro-batches than stages: all forwards, then all backwards.
    assert_eq!(one_f_one_b(0, 4, 2), vec![F(0), F(1), B(0), B(1)]);
    for (stage, stages, m) in [(0, 2, 1), (1, 2, 5), (2, 4, 7), (0, 1, 3)] {
        let ops = one_f_one_b(stage, stages, m);
        assert_eq!(ops.len(), 2 * m);
        // Every micro-batch's backward follows its forward, in micro-batch order.
        for mb in 0..m {
            let f = ops.iter().position(|o| *o == F(mb)).unwrap();
            let b = ops.iter().position(|o| *o == B(mb)).unwrap();
            assert!(f < b);
        }
    }
}

#[test]
fn stages_split_evenly_or_by_the_overrides() {
    assert_eq!(stage_layers(8, 2, None, None).unwrap(), vec![0..4, 4..8]);
    let whole = stage_layers(8, 1, None, None).unwrap();
    assert_eq!((whole.len(), whole[0].clone()), (1, 0..8));
    // The first and last stage fixed, the middle split evenly.
    assert_eq!(
        stage_layers(10, 4, Some(1), Some(3)).unwrap(),
        vec![0..1, 1..4, 4..7, 7..10]
    );
    assert_eq!(
        stage_layers(7, 3, Some(1), None).unwrap(),
        vec![0..1, 1..4, 4..7]
    );
    assert_eq!(
        stage_layers(5, 2, Some(2), Some(3)).unwrap(),
        vec![0..2, 2..5]
    );
    let refused = |r: Result<_, verl_megatron::MegatronError>| r.unwrap_err().to_string();
    assert!(refused(stage_layers(7, 2, None, None)).contains("cannot be split evenly"));
    assert!(refused(stage_layers(2, 4, None, None)).contains("cannot be split evenly"));
    assert!(refused(stage_layers(4, 2, Some(3), Some(3))).contains("exceed"));
    assert!(refused(stage_layers(4, 2, Some(1), Some(1))).contains("add up"));
    assert!(refused(stage_layers(4, 1, Some(1), None)).contains("pipeline_model_parallel_size > 1"));
}

/// A stack of tanh layers: the toy model a stage holds a contiguous slice of.
#[derive(Module, Debug)]
struct Stack<B: Backend> {
    weights: Vec<Param<Tensor<B, 2>>>,
}

fn layer_weight(l: usize) -> Tensor<A, 2> {
    let v: Vec<f32> = (0..WIDTH * WIDTH)
        .map(|i| (((i * 13 + l * 7) % 17) as f32 / 17.0 - 0.5) * 0.8)
        .collect();
    Tensor::from_data(TensorData::new(v, [WIDTH, WIDTH]), &Default::default())
}

fn micro_input(mb: usize) -> Tensor<A, 3> {
    let v: Vec<f32> = (0..ROWS * SEQ * WIDTH)
        .map(|i| (((i * 5 + mb * 11) % 13) as f32 / 13.0 - 0.5) * 2.0)
        .collect();
    Tensor::from_data(TensorData::new(v, [ROWS, SEQ, WIDTH]), &Default::default())
}

/// The loss of a micro-batch's final activation: a fixed quadratic, scaled to be summed.
fn loss_of(h: Tensor<A, 3>, mb: usize, micro_batches: usize) -> Tensor<A, 1> {
    let target = micro_input(mb + 100).detach();
    (h - target).powi_scalar(2).mean().reshape([1]) / micro_batches as f64
}

struct ToyStage {
    stack: Stack<A>,
    first: bool,
    last: bool,
    micro_batches: usize,
    grads: Vec<GradientsParams>,
}

impl PipelineStage<A> for ToyStage {
    fn forward(
        &mut self,
        mb: usize,
        input: Option<Tensor<A, 3>>,
    ) -> verl_core::Result<StageOutput<A>> {
        let mut h = match input {
            Some(x) => x,
            None => {
                assert!(self.first);
                micro_input(mb)
            }
        };
        for w in &self.stack.weights {
            h = tanh(h.matmul(w.val().unsqueeze_dim(0)));
        }
        Ok(if self.last {
            StageOutput::Loss(loss_of(h, mb, self.micro_batches))
        } else {
            StageOutput::Activation(h, None)
        })
    }

    fn input_shape(&self, _mb: usize) -> [usize; 3] {
        [ROWS, SEQ, WIDTH]
    }

    fn backward(
        &mut self,
        _mb: usize,
        seed: Tensor<A, 1>,
        input: Option<Tensor<A, 3>>,
    ) -> verl_core::Result<Option<Tensor<CpuBackend, 3>>> {
        let grads = seed.backward();
        let input_grad = input.and_then(|leaf| leaf.grad(&grads));
        self.grads
            .push(GradientsParams::from_grads(grads, &self.stack));
        Ok(input_grad)
    }
}

/// Per-layer gradients (summed over micro-batches) and the losses.
fn stage_grads(stage: &ToyStage) -> Vec<Vec<f32>> {
    stage
        .stack
        .weights
        .iter()
        .map(|w| {
            let mut sum = vec![0f32; WIDTH * WIDTH];
            for g in &stage.grads {
                let v = g
                    .get::<CpuBackend, 2>(w.id)
                    .unwrap()
                    .into_data()
                    .to_vec::<f32>()
                    .unwrap();
                for (s, x) in sum.iter_mut().zip(v) {
                    *s += x;
                }
            }
            sum
        })
        .collect()
}

fn stack(layers: std::ops::Range<usize>) -> Stack<A> {
    Stack {
        weights: layers
            .map(|l| Param::from_tensor(layer_weight(l).require_grad()))
            .collect(),
    }
}

fn check_pipeline(stages: usize, layers: usize, micro_batches: usize) {
    // The single rank: every layer, every micro-batch forward then backward.
    let mut single = ToyStage {
        stack: stack(0..layers),
        first: true,
        last: true,
        micro_batches,
        grads: Vec::new(),
    };
    let mut single_losses = Vec::new();
    for mb in 0..micro_batches {
        let Ok(StageOutput::Loss(loss)) = single.forward(mb, None) else {
            unreachable!()
        };
        single_losses.push(loss.clone().into_scalar());
        single.backward(mb, loss, None).unwrap();
    }
    let single_grads = stage_grads(&single);
    let split = stage_layers(layers, stages, None, None).unwrap();
    let results: Vec<(Vec<f64>, Vec<Vec<f32>>)> = std::thread::scope(|s| {
        let handles: Vec<_> = LocalCommunicator::group(stages)
            .into_iter()
            .zip(split.clone())
            .enumerate()
            .map(|(rank, (comm, range))| {
                s.spawn(move || {
                    let mut stage = ToyStage {
                        stack: stack(range),
                        first: rank == 0,
                        last: rank + 1 == stages,
                        micro_batches,
                        grads: Vec::new(),
                    };
                    let losses =
                        run_one_f_one_b(&mut stage, &comm, micro_batches, &Default::default())
                            .unwrap();
                    (losses, stage_grads(&stage))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let label = format!("pp={stages} layers={layers} micro={micro_batches}");
    for (rank, ((losses, grads), range)) in results.iter().zip(&split).enumerate() {
        if rank + 1 == stages {
            assert_eq!(losses.len(), micro_batches, "{label}");
            for (a, b) in single_losses.iter().zip(losses) {
                assert!((*a as f64 - b).abs() <= 1e-6, "{label}: loss {a} vs {b}");
            }
        } else {
            assert!(losses.is_empty(), "{label}: only the last stage has losses");
        }
        for (l, g) in range.clone().zip(grads) {
            for (a, b) in single_grads[l].iter().zip(g) {
                assert!(
                    (a - b).abs() <= 1e-6 * a.abs().max(1.0),
                    "{label}: layer {l} gradient {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn a_pipelined_stack_gives_the_single_ranks_losses_and_gradients() {
    check_pipeline(2, 4, 1);
    check_pipeline(2, 4, 5);
    check_pipeline(4, 8, 3);
    check_pipeline(4, 4, 9);
}
