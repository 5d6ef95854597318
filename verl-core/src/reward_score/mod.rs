//! Rule-based scorers of verifiable datasets (verl's `utils/reward_score`), and the dispatch on
//! `data_source` that verl's `default_compute_score` does.

pub mod gsm8k;

/// The score of `solution` for `data_source`, or `None` when no built-in scorer knows it.
pub fn default_compute_score(data_source: &str, solution: &str, ground_truth: &str) -> Option<f64> {
    match data_source {
        "openai/gsm8k" | "gsm8k" => Some(gsm8k::compute_score(
            solution,
            ground_truth,
            gsm8k::Method::Strict,
            0.0,
            1.0,
        )),
        _ => None,
    }
}
