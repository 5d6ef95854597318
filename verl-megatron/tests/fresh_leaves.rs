//! Ranks as threads of one process: burn 0.21's autodiff can free the first steps of a graph
//! another thread is building (tracel-ai/burn#5573), dropping a gradient. The window opens when
//! a parameter already spent by a backward feeds a graph whose only live tensor an operation
//! has consumed; `with_fresh_leaves`, which the actor and critic apply before every
//! micro-batch, must close it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use burn::module::{Module, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::Distribution;
use verl_core::backend::{CpuAutodiff, CpuBackend};
use verl_megatron::parallel::with_fresh_leaves;

type B = CpuAutodiff;

#[derive(Module, Debug)]
struct Weight<B: Backend> {
    w: Param<Tensor<B, 2>>,
}

const SIZE: usize = 1024;

/// `micro_batches` rounds of: a throwaway backward (the leaves are now spent, as after a
/// micro-batch), then a forward whose only live tensor a large `cat` consumes (as the logits'
/// vocabulary padding does) and its backward, while `sweepers` threads run small backwards
/// (each one ends in burn's process-wide sweep). Returns how many rounds lost the gradient.
fn lost_gradients(fresh: bool, victims: usize, sweepers: usize, micro_batches: usize) -> usize {
    let stop = AtomicBool::new(false);
    let lost = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..sweepers {
            s.spawn(|| {
                let device = Default::default();
                while !stop.load(Ordering::Relaxed) {
                    let x =
                        Tensor::<B, 1>::random([4], Distribution::Default, &device).require_grad();
                    let _ = (x.clone() * x).sum().backward();
                }
            });
        }
        let victims: Vec<_> = (0..victims)
            .map(|_| {
                s.spawn(|| {
                    let device = Default::default();
                    let model = Weight::<B> {
                        w: Param::from_tensor(Tensor::random(
                            [SIZE, SIZE],
                            Distribution::Default,
                            &device,
                        )),
                    };
                    for _ in 0..micro_batches {
                        let _ = (model.w.val() * 2.0).sum().backward();
                        let used = if fresh {
                            with_fresh_leaves(model.clone())
                        } else {
                            model.clone()
                        };
                        let scaled = used.w.val() * 1.5;
                        let pad = Tensor::<B, 2>::zeros([SIZE, SIZE], &device);
                        let loss = Tensor::cat(vec![scaled, pad], 0).sum();
                        let grads = GradientsParams::from_grads(loss.backward(), &used);
                        if grads.get::<CpuBackend, 2>(model.w.id).is_none() {
                            lost.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for v in victims {
            v.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
    });
    lost.load(Ordering::Relaxed)
}

#[test]
fn fresh_leaves_keep_every_gradient_while_other_threads_run_backward() {
    // The unprotected run shows the race is live on this machine (on 2 cores it loses most
    // rounds); it is timing-dependent, so only reported.
    let spent = lost_gradients(false, 2, 2, 100);
    eprintln!("spent leaves: {spent} of 200 rounds lost the gradient");
    let fresh = lost_gradients(true, 2, 2, 100);
    assert_eq!(fresh, 0, "fresh leaves lost {fresh} of 200 gradients");
}
