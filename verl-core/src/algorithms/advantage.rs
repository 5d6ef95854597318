//! Advantage estimators, registered under verl's names (`algorithm.adv_estimator`).
//!
//! Every estimator maps an [`AdvantageInput`] to `(advantages, returns)`, both `[batch, len]` and
//! zero on masked positions. Group-relative estimators group samples by `index` (verl's `uid`:
//! the samples of one prompt share it). Computation is done on the host in f64 (see `host.rs`).

use std::collections::HashMap;
use std::sync::Arc;

use burn::prelude::*;

use super::host::Host2;
use super::registry::NamedRegistry;
use super::same_shape;
use crate::error::AlgorithmError;

type Result<T> = std::result::Result<T, AlgorithmError>;

/// What estimators read. Only `token_level_rewards` and `response_mask` are always needed.
#[derive(Debug, Clone)]
pub struct AdvantageInput<'a, B: Backend> {
    /// Rewards per token (for outcome rewards: the score at the last valid token).
    pub token_level_rewards: Tensor<B, 2>,
    pub response_mask: Tensor<B, 2>,
    /// Group id per sample (GRPO, RLOO, OPO, GPG, pass@k, REINFORCE++-baseline, OTB).
    pub index: Option<&'a [String]>,
    /// Critic values (GAE).
    pub values: Option<Tensor<B, 2>>,
    /// Reward of the greedy baseline response per sample (ReMax).
    pub reward_baselines: Option<Tensor<B, 1>>,
    /// Old log-probs of the sampled tokens (optimal token baseline).
    pub old_log_probs: Option<Tensor<B, 2>>,
    /// Σ_v π(v)² per position (optimal token baseline).
    pub sum_pi_squared: Option<Tensor<B, 2>>,
    pub gamma: f64,
    pub lam: f64,
    /// GRPO: divide by the group std (false gives Dr.GRPO).
    pub norm_adv_by_std_in_grpo: bool,
    pub epsilon: f64,
    /// GPG's divisor of the advantages (verl's `f_norm`, 1 unless given).
    pub f_norm: f64,
    /// Rollout correction's importance weights (optimal token baseline: each token's weight
    /// is multiplied by their square).
    pub rollout_is_weights: Option<Tensor<B, 2>>,
    /// Optimal token baseline: where one trajectory of a group is longer than all the others,
    /// its baseline is 0 past the second longest (its tail's advantage is the return, not 0).
    pub handle_zero_tail: bool,
}

impl<'a, B: Backend> AdvantageInput<'a, B> {
    /// Rewards and mask; γ = λ = 1, std-normalised GRPO, ε = 1e-6 (verl's defaults).
    pub fn new(token_level_rewards: Tensor<B, 2>, response_mask: Tensor<B, 2>) -> Self {
        Self {
            token_level_rewards,
            response_mask,
            index: None,
            values: None,
            reward_baselines: None,
            old_log_probs: None,
            sum_pi_squared: None,
            gamma: 1.0,
            lam: 1.0,
            norm_adv_by_std_in_grpo: true,
            epsilon: 1e-6,
            f_norm: 1.0,
            rollout_is_weights: None,
            handle_zero_tail: false,
        }
    }
    pub fn with_index(mut self, index: &'a [String]) -> Self {
        self.index = Some(index);
        self
    }
    pub fn with_values(mut self, values: Tensor<B, 2>) -> Self {
        self.values = Some(values);
        self
    }
    pub fn with_gamma_lam(mut self, gamma: f64, lam: f64) -> Self {
        self.gamma = gamma;
        self.lam = lam;
        self
    }

    fn dims(&self) -> [usize; 2] {
        self.token_level_rewards.dims()
    }

    fn check(&self, name: &str) -> Result<(Host2, Host2)> {
        let dims = self.dims();
        same_shape(
            &format!("{name}: response_mask"),
            &dims,
            &self.response_mask.dims(),
        )?;
        Ok((
            Host2::from_tensor(&self.token_level_rewards),
            Host2::from_tensor(&self.response_mask),
        ))
    }

    fn groups(&self, name: &str) -> Result<Vec<Vec<usize>>> {
        let index = self.index.ok_or_else(|| AlgorithmError::MissingInput {
            algorithm: name.into(),
            input: "index (uid per sample)",
        })?;
        let rows = self.dims()[0];
        if index.len() != rows {
            return Err(AlgorithmError::Shape {
                what: format!("{name}: index"),
                expected: vec![rows],
                found: vec![index.len()],
            });
        }
        // Groups in order of first appearance, members in row order.
        let mut order: Vec<Vec<usize>> = Vec::new();
        let mut at: HashMap<&str, usize> = HashMap::new();
        for (i, uid) in index.iter().enumerate() {
            let g = *at.entry(uid.as_str()).or_insert_with(|| {
                order.push(Vec::new());
                order.len() - 1
            });
            order[g].push(i);
        }
        Ok(order)
    }

    fn optional_2d(
        &self,
        name: &str,
        input: &'static str,
        t: &Option<Tensor<B, 2>>,
    ) -> Result<Host2> {
        let t = t.as_ref().ok_or_else(|| AlgorithmError::MissingInput {
            algorithm: name.into(),
            input,
        })?;
        same_shape(&format!("{name}: {input}"), &self.dims(), &t.dims())?;
        Ok(Host2::from_tensor(t))
    }
}

/// `(advantages, returns)`.
pub type AdvantageOutput<B> = (Tensor<B, 2>, Tensor<B, 2>);

/// A built-in estimator as a plain function.
type BuiltinEstimator<B> = fn(&AdvantageInput<'_, B>) -> Result<AdvantageOutput<B>>;

/// An estimator as stored in the registry.
pub type AdvantageFn<B> = Arc<DynEstimator<B>>;

/// The unsized estimator type.
pub type DynEstimator<B> =
    dyn Fn(&AdvantageInput<'_, B>) -> Result<AdvantageOutput<B>> + Send + Sync;

fn out<B: Backend>(input: &AdvantageInput<'_, B>, adv: &Host2, ret: &Host2) -> AdvantageOutput<B> {
    let d = input.token_level_rewards.device();
    (adv.to_tensor(&d), ret.to_tensor(&d))
}

fn whiten_err(name: &str, e: String) -> AlgorithmError {
    AlgorithmError::Invalid {
        algorithm: name.into(),
        message: e,
    }
}

/// Sequence scores per row: Σ of the rewards on unmasked tokens. (verl sums all tokens; rewards
/// outside the mask are zero there by construction, and masking here makes that a guarantee.)
fn scores(r: &Host2, m: &Host2) -> Vec<f64> {
    (0..r.rows)
        .map(|i| (0..r.cols).map(|t| r.at(i, t) * m.at(i, t)).sum())
        .collect()
}

/// Broadcasts one value per row over its unmasked tokens.
fn tile(values: &[f64], mask: &Host2) -> Host2 {
    let mut h = Host2::zeros(mask.rows, mask.cols);
    for (i, v) in values.iter().enumerate() {
        for t in 0..mask.cols {
            h.set(i, t, v * mask.at(i, t));
        }
    }
    h
}

fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    // torch.std: unbiased.
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

/// GAE (Schulman et al. 2016, arXiv:1506.02438). Backward over tokens:
/// δ_t = r_t + γ·V_{t+1} − V_t, A_t = δ_t + γλ·A_{t+1}, where masked tokens pass the next value and
/// advantage through unchanged. Returns = A + V (before whitening); advantages are whitened over
/// the masked tokens.
///
/// A deliberate difference from verl: advantages *and* returns are 0 at masked positions. verl
/// leaves the whitened value (0 − μ)/σ at padding and returns A + V there; every loss reads
/// them through the response mask, so the updates are the same, and a 0 cannot leak into a
/// metric or a custom loss that forgets the mask.
pub fn gae<B: Backend>(input: &AdvantageInput<'_, B>) -> Result<AdvantageOutput<B>> {
    let (r, m) = input.check("gae")?;
    let v = input.optional_2d("gae", "values", &input.values)?;
    let mut adv = Host2::zeros(r.rows, r.cols);
    for i in 0..r.rows {
        let (mut next_value, mut last_gae) = (0.0, 0.0);
        for t in (0..r.cols).rev() {
            let delta = r.at(i, t) + input.gamma * next_value - v.at(i, t);
            let gae_t = delta + input.gamma * input.lam * last_gae;
            let mt = m.at(i, t);
            next_value = v.at(i, t) * mt + (1.0 - mt) * next_value;
            last_gae = gae_t * mt + (1.0 - mt) * last_gae;
            adv.set(i, t, last_gae);
        }
    }
    let mut ret = Host2::zeros(r.rows, r.cols);
    for k in 0..ret.data.len() {
        ret.data[k] = adv.data[k] + v.data[k];
    }
    let adv = adv
        .whiten(&m)
        .map_err(|e| whiten_err("gae", e))?
        .mul_mask(&m);
    Ok(out(input, &adv, &ret.mul_mask(&m)))
}

/// GRPO outcome advantage (Shao et al. 2024, arXiv:2402.03300): the sequence score minus its
/// group's mean, divided by the group's (unbiased) std + ε unless `norm_adv_by_std_in_grpo` is
/// off (Dr.GRPO, arXiv:2503.20783). A group of one gets mean 0 and std 1.
pub fn grpo<B: Backend>(input: &AdvantageInput<'_, B>) -> Result<AdvantageOutput<B>> {
    let (r, m) = input.check("grpo")?;
    let s = scores(&r, &m);
    let mut a = vec![0.0; s.len()];
    for g in input.groups("grpo")? {
        let xs: Vec<f64> = g.iter().map(|&i| s[i]).collect();
        let (mean, std) = if xs.len() == 1 {
            (0.0, 1.0)
        } else {
            mean_std(&xs)
        };
        for &i in &g {
            a[i] = if input.norm_adv_by_std_in_grpo {
                (s[i] - mean) / (std + input.epsilon)
            } else {
                s[i] - mean
            };
        }
    }
    let h = tile(&a, &m);
    Ok(out(input, &h, &h))
}

/// GRPO pass@k (arXiv:2503.19595 style): only the best sample of a group gets an advantage, the
/// gap between the best and second-best score (divided by the group std + ε when normalising).
pub fn grpo_passk<B: Backend>(input: &AdvantageInput<'_, B>) -> Result<AdvantageOutput<B>> {
    let (r, m) = input.check("grpo_passk")?;
    let s = scores(&r, &m);
    let mut a = vec![0.0; s.len()];
    for g in input.groups("grpo_passk")? {
        if g.len() < 2 {
            return Err(AlgorithmError::Invalid {
                algorithm: "grpo_passk".into(),
                message: "pass@k needs at least 2 samples per group".into(),
            });
        }
        let mut sorted: Vec<usize> = g.clone();
        // Highest first; ties keep the earlier sample first, as torch.topk does in practice.
        sorted.sort_by(|&x, &y| s[y].total_cmp(&s[x]));
        let (best, second) = (sorted[0], sorted[1]);
        let mut adv = s[best] - s[second];
        if input.norm_adv_by_std_in_grpo {
            let xs: Vec<f64> = g.iter().map(|&i| s[i]).collect();
            adv /= mean_std(&xs).1 + input.epsilon;
        }
        a[best] = adv;
    }
    let h = tile(&a, &m);
    Ok(out(input, &h, &h))
}

/// REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted reward-to-go over unmasked tokens, whitened
/// over the batch.
pub fn reinforce_plus_plus<B: Backend>(
    input: &AdvantageInput<'_, B>,
) -> Result<AdvantageOutput<B>> {
    let (r, m) = input.check("reinforce_plus_plus")?;
    let mut ret = Host2::zeros(r.rows, r.cols);
    for i in 0..r.rows {
        let mut running = 0.0;
        for t in (0..r.cols).rev() {
            running = r.at(i, t) + input.gamma * running;
            ret.set(i, t, running);
            // A masked token resets the return that flows to earlier tokens.
            running *= m.at(i, t);
        }
    }
    let adv = ret
        .whiten(&m)
        .map_err(|e| whiten_err("reinforce_plus_plus", e))?
        .mul_mask(&m);
    Ok(out(input, &adv, &ret.mul_mask(&m)))
}

/// REINFORCE++-baseline: the score minus its group mean, broadcast over tokens, then whitened
/// over the batch.
pub fn reinforce_plus_plus_baseline<B: Backend>(
    input: &AdvantageInput<'_, B>,
) -> Result<AdvantageOutput<B>> {
    let (r, m) = input.check("reinforce_plus_plus_baseline")?;
    let s = scores(&r, &m);
    let mut a = vec![0.0; s.len()];
    for g in input.groups("reinforce_plus_plus_baseline")? {
        let mean = if g.len() == 1 {
            0.0
        } else {
            g.iter().map(|&i| s[i]).sum::<f64>() / g.len() as f64
        };
        for &i in &g {
            a[i] = s[i] - mean;
        }
    }
    let h = tile(&a, &m)
        .whiten(&m)
        .map_err(|e| whiten_err("reinforce_plus_plus_baseline", e))?
        .mul_mask(&m);
    Ok(out(input, &h, &h))
}

/// RLOO (Ahmadian et al. 2024, arXiv:2402.14740): the score minus the mean of the *other*
/// samples of its group, i.e. (n·s − Σs)/(n − 1). A group of one gets 0.
pub fn rloo<B: Backend>(input: &AdvantageInput<'_, B>) -> Result<AdvantageOutput<B>> {
    let (r, m) = input.check("rloo")?;
    let s = scores(&r, &m);
    let mut a = vec![0.0; s.len()];
    for g in input.groups("rloo")? {
        let n = g.len() as f64;
        let sum: f64 = g.iter().map(|&i| s[i]).sum();
        for &i in &g {
            // A prompt sampled once has no others to compare with: verl keeps its score.
            a[i] = if g.len() > 1 {
                (n * s[i] - sum) / (n - 1.0)
            } else {
                s[i]
            };
        }
    }
    let h = tile(&a, &m);
    Ok(out(input, &h, &h))
}

/// verl's `rloo_vectorized`: [`rloo`], except that a prompt sampled once gets 0.
pub fn rloo_vectorized<B: Backend>(input: &AdvantageInput<'_, B>) -> Result<AdvantageOutput<B>> {
    let (r, m) = input.check("rloo_vectorized")?;
    let s = scores(&r, &m);
    let mut a = vec![0.0; s.len()];
    for g in input.groups("rloo_vectorized")? {
        let n = g.len() as f64;
        let sum: f64 = g.iter().map(|&i| s[i]).sum();
        for &i in &g {
            if g.len() > 1 {
                a[i] = (n * s[i] - sum) / (n - 1.0);
            }
        }
    }
    let h = tile(&a, &m);
    Ok(out(input, &h, &h))
}

/// verl's `grpo_vectorized`: [`grpo`] with the group variance floored at ε before its square
/// root (so the std is at least √ε), and always normalised by it (verl does not pass
/// `norm_adv_by_std_in_grpo` to it).
pub fn grpo_vectorized<B: Backend>(input: &AdvantageInput<'_, B>) -> Result<AdvantageOutput<B>> {
    let (r, m) = input.check("grpo_vectorized")?;
    let s = scores(&r, &m);
    let mut a = vec![0.0; s.len()];
    for g in input.groups("grpo_vectorized")? {
        let xs: Vec<f64> = g.iter().map(|&i| s[i]).collect();
        let (mean, std) = match xs.len() {
            1 => (0.0, 1.0),
            _ => {
                let (mean, std) = mean_std(&xs);
                (mean, (std * std).max(input.epsilon).sqrt())
            }
        };
        for &i in &g {
            a[i] = (s[i] - mean) / (std + input.epsilon);
        }
    }
    let h = tile(&a, &m);
    Ok(out(input, &h, &h))
}

/// ReMax (Li et al. 2023, arXiv:2310.10505): reward-to-go minus the greedy response's reward.
pub fn remax<B: Backend>(input: &AdvantageInput<'_, B>) -> Result<AdvantageOutput<B>> {
    let (r, m) = input.check("remax")?;
    let base = input
        .reward_baselines
        .as_ref()
        .ok_or_else(|| AlgorithmError::MissingInput {
            algorithm: "remax".into(),
            input: "reward_baselines",
        })?;
    same_shape("remax: reward_baselines", &[r.rows], &base.dims())?;
    let b: Vec<f64> = base.to_data().iter::<f64>().collect();
    let mut ret = Host2::zeros(r.rows, r.cols);
    let mut adv = Host2::zeros(r.rows, r.cols);
    for (i, &baseline) in b.iter().enumerate() {
        let mut acc = 0.0;
        for t in (0..r.cols).rev() {
            acc += r.at(i, t) * m.at(i, t);
            ret.set(i, t, acc);
            adv.set(i, t, acc - baseline * m.at(i, t));
        }
    }
    Ok(out(input, &adv, &ret))
}

/// OPO (Hao et al. 2025, arXiv:2505.23585): the score minus the length-weighted group mean
/// Σ|y|·s / Σ|y| (the optimal baseline for equal per-token gradient norms). A group of one gets 0
/// as its baseline.
pub fn opo<B: Backend>(input: &AdvantageInput<'_, B>) -> Result<AdvantageOutput<B>> {
    let (r, m) = input.check("opo")?;
    let s = scores(&r, &m);
    let len: Vec<f64> = (0..m.rows).map(|i| m.row_sum(i)).collect();
    let mut a = vec![0.0; s.len()];
    for g in input.groups("opo")? {
        let baseline = if g.len() == 1 {
            0.0
        } else {
            g.iter().map(|&i| len[i] * s[i]).sum::<f64>() / g.iter().map(|&i| len[i]).sum::<f64>()
        };
        for &i in &g {
            a[i] = s[i] - baseline;
        }
    }
    let h = tile(&a, &m);
    Ok(out(input, &h, &h))
}

/// GPG (Chu et al. 2025, arXiv:2504.02546): α·(s − group mean) with α = batch / #non-zero scores,
/// which rescales the gradient when many samples carry no reward.
pub fn gpg<B: Backend>(input: &AdvantageInput<'_, B>) -> Result<AdvantageOutput<B>> {
    let (r, m) = input.check("gpg")?;
    let s = scores(&r, &m);
    let nonzero = s.iter().filter(|&&x| x != 0.0).count().max(1);
    let alpha = s.len() as f64 / nonzero as f64;
    let mut a = vec![0.0; s.len()];
    for g in input.groups("gpg")? {
        let mean = if g.len() == 1 {
            0.0
        } else {
            g.iter().map(|&i| s[i]).sum::<f64>() / g.len() as f64
        };
        for &i in &g {
            a[i] = alpha * (s[i] - mean) / input.f_norm;
        }
    }
    let h = tile(&a, &m);
    Ok(out(input, &h, &h))
}

/// The optimal token baselines' per-token inputs: the mask, each position's reward-to-go G_t
/// and the cumulative path-variance proxy W_t = Σ_{j≤t} (1 − 2π_j + Σπ²)·ρ̄_j² over unmasked
/// tokens (ρ̄: rollout correction's importance weights, 1 without them).
fn otb_inputs<B: Backend>(input: &AdvantageInput<'_, B>, name: &str) -> Result<[Host2; 3]> {
    let (r, m) = input.check(name)?;
    let lp = input.optional_2d(name, "old_log_probs", &input.old_log_probs)?;
    let sp = input.optional_2d(name, "sum_pi_squared", &input.sum_pi_squared)?;
    let is = input
        .rollout_is_weights
        .as_ref()
        .map(|w| input.optional_2d(name, "rollout_is_weights", &Some(w.clone())))
        .transpose()?;
    let (rows, cols) = (r.rows, r.cols);
    let mut ret = Host2::zeros(rows, cols);
    let mut w = Host2::zeros(rows, cols);
    for i in 0..rows {
        let mut acc = 0.0;
        for t in (0..cols).rev() {
            acc += r.at(i, t) * m.at(i, t);
            ret.set(i, t, acc);
        }
        let mut cum = 0.0;
        for t in 0..cols {
            let is2 = is.as_ref().map_or(1.0, |h| h.at(i, t).powi(2));
            cum += (1.0 - 2.0 * lp.at(i, t).exp() + sp.at(i, t)) * is2 * m.at(i, t);
            w.set(i, t, cum);
        }
    }
    Ok([m, ret, w])
}

/// verl's ε in the optimal baselines' denominators.
const OTB_EPSILON: f64 = 1e-8;

/// handle_zero_tail: the member of `lengths` (row, length) longer than every other, and the
/// second longest length, from which its baseline is 0 (alone there, its baseline would be
/// itself).
fn zero_tail(mut lengths: Vec<(usize, f64)>) -> Option<(usize, usize)> {
    lengths.sort_by(|a, b| b.1.total_cmp(&a.1));
    (lengths.len() > 1 && lengths[0].1 > lengths[1].1)
        .then(|| (lengths[0].0, lengths[1].1 as usize))
}

/// Optimal token baseline: per group and position, B_t = Σ G_t·W_t / (Σ W_t + ε) with
/// reward-to-go G_t and the cumulative path-variance proxy W_t = Σ_{j≤t} (1 − 2π_j + Σπ²)
/// over unmasked tokens. A group of one has no baseline.
pub fn optimal_token_baseline<B: Backend>(
    input: &AdvantageInput<'_, B>,
) -> Result<AdvantageOutput<B>> {
    let name = "optimal_token_baseline";
    let [m, ret, w] = otb_inputs(input, name)?;
    let (rows, cols) = (m.rows, m.cols);
    let mut adv = ret.data.clone();
    for g in input.groups(name)? {
        if g.len() == 1 {
            continue;
        }
        let tail = input
            .handle_zero_tail
            .then(|| zero_tail(g.iter().map(|&i| (i, m.row_sum(i))).collect()))
            .flatten();
        for t in 0..cols {
            let num: f64 = g
                .iter()
                .map(|&i| ret.at(i, t) * w.at(i, t) * m.at(i, t))
                .sum();
            let den: f64 = g.iter().map(|&i| w.at(i, t) * m.at(i, t)).sum::<f64>() + OTB_EPSILON;
            for &i in &g {
                if tail.is_some_and(|(longest, from)| i == longest && t >= from) {
                    continue;
                }
                adv[i * cols + t] -= num / den;
            }
        }
    }
    let adv = Host2 {
        data: adv,
        rows,
        cols,
    }
    .mul_mask(&m);
    Ok(out(input, &adv, &ret))
}

/// verl's `tir_optimal_token_baseline`: the optimal token baseline for responses whose mask
/// has gaps (multi-turn tool-integrated rollouts, where tool output is masked out). Each
/// response's trained tokens are taken in order, without the gaps, and the group's baseline at
/// a response's k-th trained token comes from every member's k-th trained token, so turns line
/// up by position in the model's own output rather than by column. Responses with no trained
/// token take no part; a group of one keeps its returns; and, as verl calls it, the zero tail
/// is always handled (a member longer than every other has baseline 0 past the second
/// longest), whatever `handle_zero_tail` says. On a gap-free mask it is
/// `optimal_token_baseline` with the zero tail handled.
pub fn tir_optimal_token_baseline<B: Backend>(
    input: &AdvantageInput<'_, B>,
) -> Result<AdvantageOutput<B>> {
    let name = "tir_optimal_token_baseline";
    let [m, ret, w] = otb_inputs(input, name)?;
    let (rows, cols) = (m.rows, m.cols);
    // Each row's trained columns, in order.
    let trained: Vec<Vec<usize>> = (0..rows)
        .map(|i| (0..cols).filter(|&t| m.at(i, t) != 0.0).collect())
        .collect();
    let mut adv = Host2::zeros(rows, cols);
    for g in input.groups(name)? {
        let g: Vec<usize> = g.into_iter().filter(|&i| !trained[i].is_empty()).collect();
        let longest = g.iter().map(|&i| trained[i].len()).max().unwrap_or(0);
        // Baseline by trained-token position (0 for a group of one).
        let mut baseline = vec![0.0; longest];
        if g.len() > 1 {
            for (k, b) in baseline.iter_mut().enumerate() {
                let (mut num, mut den) = (0.0, 0.0);
                for &i in &g {
                    if let Some(&t) = trained[i].get(k) {
                        num += ret.at(i, t) * w.at(i, t);
                        den += w.at(i, t);
                    }
                }
                *b = num / (den + OTB_EPSILON);
            }
        }
        let tail = zero_tail(g.iter().map(|&i| (i, trained[i].len() as f64)).collect());
        for &i in &g {
            for (k, &t) in trained[i].iter().enumerate() {
                let past_tail = tail.is_some_and(|(l, from)| i == l && k >= from);
                let b = if past_tail { 0.0 } else { baseline[k] };
                adv.set(i, t, (ret.at(i, t) - b) * m.at(i, t));
            }
        }
    }
    Ok(out(input, &adv, &ret))
}

/// Estimators by name. [`AdvantageRegistry::new`] holds verl's built-ins; add your own with
/// [`AdvantageRegistry::register`], as verl's `register_adv_est`.
///
/// ```
/// use burn::tensor::Tensor;
/// use verl_core::algorithms::advantage::{AdvantageInput, AdvantageRegistry};
/// use verl_core::backend::CpuBackend as B;
/// let d = Default::default();
/// let rewards = Tensor::<B, 2>::from_floats([[0., 1.], [0., 0.], [0., 1.], [0., 1.]], &d);
/// let mask = Tensor::<B, 2>::ones([4, 2], &d);
/// let uid: Vec<String> = ["a", "a", "b", "b"].map(String::from).into();
/// let registry = AdvantageRegistry::<B>::new();
/// let (adv, _) = registry.compute("grpo", &AdvantageInput::new(rewards, mask).with_index(&uid))?;
/// let a = adv.to_data().to_vec::<f32>().unwrap();
/// // Group "a" = {1, 0}: mean 0.5, std 0.7071 → ±0.7071; group "b" = {1, 1} → 0.
/// assert!((a[0] - 0.70710).abs() < 1e-4 && (a[2] + 0.70710).abs() < 1e-4 && a[4] == 0.0);
/// # Ok::<(), verl_core::error::AlgorithmError>(())
/// ```
pub struct AdvantageRegistry<B: Backend> {
    estimators: NamedRegistry<DynEstimator<B>>,
}

/// verl's built-in estimator names.
pub const BUILTIN_ESTIMATORS: [&str; 13] = [
    "gae",
    "grpo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "rloo",
    "remax",
    "opo",
    "gpg",
    "grpo_passk",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
    "grpo_vectorized",
    "rloo_vectorized",
];

impl<B: Backend> Default for AdvantageRegistry<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> AdvantageRegistry<B> {
    /// The built-in estimators.
    pub fn new() -> Self {
        let mut r = Self {
            estimators: NamedRegistry::new("advantage estimator"),
        };
        let builtins: [(&str, BuiltinEstimator<B>); 13] = [
            ("gae", gae),
            ("grpo", grpo),
            ("reinforce_plus_plus", reinforce_plus_plus),
            ("reinforce_plus_plus_baseline", reinforce_plus_plus_baseline),
            ("rloo", rloo),
            ("remax", remax),
            ("opo", opo),
            ("gpg", gpg),
            ("grpo_passk", grpo_passk),
            ("optimal_token_baseline", optimal_token_baseline),
            ("tir_optimal_token_baseline", tir_optimal_token_baseline),
            ("grpo_vectorized", grpo_vectorized),
            ("rloo_vectorized", rloo_vectorized),
        ];
        for (name, f) in builtins {
            r.register(name, f);
        }
        r
    }

    /// Adds (or replaces) an estimator.
    pub fn register(
        &mut self,
        name: &str,
        f: impl Fn(&AdvantageInput<'_, B>) -> Result<AdvantageOutput<B>> + Send + Sync + 'static,
    ) {
        self.estimators.insert(name, Arc::new(f));
    }

    /// Registered names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.estimators.names()
    }

    /// The estimator called `name`.
    pub fn get(&self, name: &str) -> Result<AdvantageFn<B>> {
        self.estimators.get(name)
    }

    /// Runs the estimator called `name`.
    pub fn compute(&self, name: &str, input: &AdvantageInput<'_, B>) -> Result<AdvantageOutput<B>> {
        (self.get(name)?)(input)
    }
}
