//! The optimizer of the actor and critic: AdamW (decoupled weight decay, as Megatron's), global
//! gradient-norm clipping, and Megatron's learning-rate schedule (linear warm-up, then constant,
//! linear or cosine decay to `min_lr`).

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use verl_core::config::OptimConfig;

use crate::error::MegatronError;

/// The learning rate at each optimizer step.
#[derive(Debug, Clone, PartialEq)]
pub struct LrSchedule {
    pub max_lr: f64,
    pub min_lr: f64,
    pub warmup_init: f64,
    pub warmup_steps: u64,
    pub decay_steps: u64,
    pub style: DecayStyle,
}

/// How the learning rate falls after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecayStyle {
    Constant,
    Linear,
    Cosine,
}

impl LrSchedule {
    /// From `*.optim`; `total_steps` is the run's optimizer-step count (for the warm-up ratio and
    /// the decay length when `lr_decay_steps` is unset).
    pub fn from_config(cfg: &OptimConfig, total_steps: u64) -> Result<Self, MegatronError> {
        let style = match cfg.lr_decay_style.as_str() {
            "constant" => DecayStyle::Constant,
            "linear" => DecayStyle::Linear,
            "cosine" => DecayStyle::Cosine,
            other => {
                return Err(MegatronError::Setting {
                    field: "optim.lr_decay_style".into(),
                    message: format!("`{other}` is not one of constant, linear, cosine"),
                })
            }
        };
        let warmup_steps = match cfg.lr_warmup_steps {
            Some(s) if s >= 0 => s as u64,
            _ => (cfg.lr_warmup_steps_ratio * total_steps as f64) as u64,
        };
        Ok(Self {
            max_lr: cfg.lr,
            min_lr: cfg.min_lr,
            warmup_init: cfg.lr_warmup_init,
            warmup_steps,
            decay_steps: cfg.lr_decay_steps.unwrap_or(total_steps).max(1),
            style,
        })
    }

    /// The learning rate of optimizer step `step` (0-based).
    ///
    /// ```
    /// use verl_megatron::workers::optim::{DecayStyle, LrSchedule};
    /// let s = LrSchedule { max_lr: 1.0, min_lr: 0.0, warmup_init: 0.0, warmup_steps: 2,
    ///                      decay_steps: 10, style: DecayStyle::Cosine };
    /// assert_eq!(s.lr(0), 0.0);
    /// assert_eq!(s.lr(1), 0.5);
    /// assert_eq!(s.lr(2), 1.0);
    /// assert!((s.lr(6) - 0.5).abs() < 1e-12); // halfway through the cosine
    /// assert_eq!(s.lr(10), 0.0);
    /// ```
    pub fn lr(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            let f = step as f64 / self.warmup_steps as f64;
            return self.warmup_init + (self.max_lr - self.warmup_init) * f;
        }
        if self.style == DecayStyle::Constant || step >= self.decay_steps {
            return match self.style {
                DecayStyle::Constant => self.max_lr,
                _ => self.min_lr,
            };
        }
        let span = (self.decay_steps - self.warmup_steps).max(1) as f64;
        let f = (step - self.warmup_steps) as f64 / span;
        let coeff = match self.style {
            DecayStyle::Linear => 1.0 - f,
            _ => 0.5 * (1.0 + (std::f64::consts::PI * f).cos()),
        };
        self.min_lr + (self.max_lr - self.min_lr) * coeff
    }
}

/// Sums the squares of every parameter's gradient.
struct SquaredNorm<'a> {
    grads: &'a GradientsParams,
    total: f64,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SquaredNorm<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            self.total += g.powi_scalar(2).sum().into_scalar().elem::<f64>();
        }
    }
}

/// Multiplies every parameter's gradient by a factor.
struct ScaleGrads<'a> {
    grads: &'a mut GradientsParams,
    factor: f64,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for ScaleGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            self.grads.register(param.id, g * self.factor);
        }
    }
}

/// The global L2 norm of all gradients of `model`.
pub fn grad_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &GradientsParams,
) -> f64 {
    let mut v = SquaredNorm { grads, total: 0.0 };
    model.visit(&mut v);
    v.total.sqrt()
}

/// Scales gradients so their global norm is at most `max_norm` (Megatron's `clip_grad`);
/// returns the norm before clipping. A non-finite norm is returned as is and the caller skips
/// the step.
pub fn clip_grad_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
) -> f64 {
    let norm = grad_norm(model, grads);
    if norm.is_finite() && max_norm > 0.0 && norm > max_norm {
        let mut s = ScaleGrads {
            grads,
            factor: max_norm / (norm + 1e-6),
        };
        model.visit(&mut s);
    }
    norm
}

/// AdamW with clipping and the schedule, stepping one model.
pub struct ModelOptimizer<B: AutodiffBackend, M: AutodiffModule<B>> {
    inner: burn::optim::adaptor::OptimizerAdaptor<burn::optim::AdamW, M, B>,
    pub schedule: LrSchedule,
    pub clip_grad: f64,
    /// Optimizer steps taken.
    pub step: u64,
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    pub grad_norm: f64,
    pub lr: f64,
    /// False when the gradient norm was not finite and the step was skipped.
    pub applied: bool,
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> ModelOptimizer<B, M> {
    pub fn new(cfg: &OptimConfig, total_steps: u64) -> Result<Self, MegatronError> {
        if cfg.optimizer != "adam" && cfg.optimizer != "adamw" {
            return Err(MegatronError::Setting {
                field: "optim.optimizer".into(),
                message: format!("`{}` is not supported; use adam (AdamW)", cfg.optimizer),
            });
        }
        let inner = AdamWConfig::new()
            .with_beta_1(cfg.betas[0] as f32)
            .with_beta_2(cfg.betas[1] as f32)
            .with_epsilon(cfg.eps as f32)
            .with_weight_decay(cfg.weight_decay as f32)
            .init();
        Ok(Self {
            inner,
            schedule: LrSchedule::from_config(cfg, total_steps)?,
            clip_grad: cfg.clip_grad,
            step: 0,
        })
    }

    /// Clips `grads`, then applies them at the scheduled learning rate.
    pub fn step(&mut self, model: M, mut grads: GradientsParams) -> (M, StepReport) {
        let lr = self.schedule.lr(self.step);
        let norm = clip_grad_norm(&model, &mut grads, self.clip_grad);
        if !norm.is_finite() {
            return (
                model,
                StepReport {
                    grad_norm: norm,
                    lr,
                    applied: false,
                },
            );
        }
        let model = self.inner.step(lr, model, grads);
        self.step += 1;
        (
            model,
            StepReport {
                grad_norm: norm,
                lr,
                applied: true,
            },
        )
    }
}
