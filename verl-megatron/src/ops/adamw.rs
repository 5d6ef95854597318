//! The values an AdamW update exchanges with its kernel.

/// AdamW's hyper-parameters (the learning rate comes with each step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWHyper {
    pub beta_1: f32,
    pub beta_2: f32,
    pub epsilon: f32,
    /// Decoupled weight decay: each step multiplies the parameter by `1 - lr * weight_decay`.
    pub weight_decay: f32,
}

/// The scalars of one parameter's update, computed once on the host. The learning rate, the
/// clipping factor and the decay stay f64 as the chain of burn operations multiplies by them;
/// the kernel rounds them to f32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// Multiplies the gradient first (global-norm clipping), 1 when not clipping.
    pub grad_scale: f64,
    pub beta_1: f32,
    pub beta_2: f32,
    /// `1 - beta_1^t` and `1 - beta_2^t` for this update's `t`.
    pub bias_correction_1: f32,
    pub bias_correction_2: f32,
    pub epsilon: f32,
    /// `lr * weight_decay`: the parameter is multiplied by `1 - decay_rate` first.
    pub decay_rate: f64,
    pub lr: f64,
}

impl AdamWStep {
    /// The scalars of update number `time` (1 for the first).
    pub fn new(hyper: &AdamWHyper, lr: f64, grad_scale: f64, time: usize) -> Self {
        let t = time as i32;
        Self {
            grad_scale,
            beta_1: hyper.beta_1,
            beta_2: hyper.beta_2,
            bias_correction_1: 1.0 - hyper.beta_1.powi(t),
            bias_correction_2: 1.0 - hyper.beta_2.powi(t),
            epsilon: hyper.epsilon,
            decay_rate: lr * hyper.weight_decay as f64,
            lr,
        }
    }
}
