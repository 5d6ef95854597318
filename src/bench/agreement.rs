//! How a GPU check compares a kernel with its fallback: relative errors, and the failures the
//! check reports when one passes its bound.

use burn::prelude::*;
use burn::tensor::FloatDType;
use verl::backend::CudaBackend;

/// ‖a − b‖ / ‖b‖ (0 when both are zero).
pub(super) fn relative_error<const D: usize>(
    a: Tensor<CudaBackend, D>,
    b: Tensor<CudaBackend, D>,
) -> f64 {
    let norm = |t: Tensor<CudaBackend, D>| {
        t.cast(FloatDType::F32)
            .powf_scalar(2.0)
            .sum()
            .sqrt()
            .into_scalar()
            .elem::<f64>()
    };
    let (a, b) = (a.cast(FloatDType::F32), b.cast(FloatDType::F32));
    let den = norm(b.clone());
    let num = norm(a - b);
    if den == 0.0 {
        num
    } else {
        num / den
    }
}

/// Records a failure named `what` unless every relative error in `errors` is finite and below
/// `bound`.
pub(super) fn require_below(failures: &mut Vec<String>, what: String, errors: &[f64], bound: f64) {
    if !errors.iter().all(|e| e.is_finite() && *e < bound) {
        failures.push(format!("{what}: {errors:?}"));
    }
}
