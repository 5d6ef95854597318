//! Checks that a config can run before anything is allocated: names that must be known, the
//! parallel layouts against the world size, and verl's batch arithmetic.

use super::{Launcher, MegatronConfig, VerlConfig};
use crate::error::{ConfigError, TopologyError};

/// Advantage estimators verl defines (`algorithm.adv_estimator`).
pub const ADV_ESTIMATORS: &[&str] = &crate::algorithms::advantage::BUILTIN_ESTIMATORS;
/// Policy losses verl defines (`actor.policy_loss.loss_mode`).
pub const POLICY_LOSSES: &[&str] = &crate::algorithms::policy_loss::BUILTIN_POLICY_LOSSES;
/// Loss aggregation modes (`actor.loss_agg_mode`, `critic.loss_agg_mode`).
pub const LOSS_AGG_MODES: &[&str] = &crate::algorithms::LossAggMode::NAMES;
/// KL estimators (`actor.kl_loss_type`, `algorithm.kl_penalty`). `full` is not one: it needs
/// the full-vocabulary log-probs (`kl_full`).
pub const KL_TYPES: &[&str] = &[
    "kl",
    "k1",
    "abs",
    "mse",
    "k2",
    "low_var_kl",
    "k3",
    "k1+",
    "k2+",
    "k3+",
    "kl+",
    "mse+",
    "low_var_kl+",
];
/// Estimators that compare samples of one prompt and so need `rollout.n > 1`.
const GROUP_ESTIMATORS: &[&str] = &["grpo", "rloo", "grpo_passk", "opo"];

/// The most ranks (and samples per prompt) a size may name: far beyond any real run, low
/// enough that products of three such sizes cannot overflow.
const MAX_RANKS: u64 = 1 << 16;
/// The most any other count or length may be (batch sizes, token budgets, lengths).
const MAX_COUNT: u64 = 1 << 32;

/// Refuses, by key, any whole number in the config beyond what a run could use, before any
/// arithmetic on it: rank counts and parallel sizes above [`MAX_RANKS`], every other count
/// above [`MAX_COUNT`] (seeds excepted). The checks after this one multiply sizes freely.
fn sizes_in_range(cfg: &VerlConfig) -> Result<(), ConfigError> {
    fn walk(v: &serde_json::Value, path: &str) -> Result<(), ConfigError> {
        match v {
            serde_json::Value::Object(map) => {
                for (k, child) in map {
                    let key = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}.{k}")
                    };
                    walk(child, &key)?;
                }
            }
            serde_json::Value::Number(n) => {
                let Some(x) = n.as_u64() else { return Ok(()) };
                let leaf = path.rsplit('.').next().unwrap_or(path);
                if leaf.contains("seed") {
                    return Ok(());
                }
                let ranks = leaf.ends_with("parallel_size")
                    || matches!(leaf, "nnodes" | "n_gpus_per_node" | "n");
                let max = if ranks { MAX_RANKS } else { MAX_COUNT };
                if x > max {
                    return Err(invalid(
                        path,
                        x,
                        format!("is beyond any run (at most {max})"),
                        "give a realistic size",
                    ));
                }
            }
            _ => {}
        }
        Ok(())
    }
    // A config that cannot be written out has nothing to bound here.
    match serde_json::to_value(cfg) {
        Ok(tree) => walk(&tree, ""),
        Err(_) => Ok(()),
    }
}

/// A config that passed [`VerlConfig::validate`], with the numbers derived on the way.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedConfig {
    pub config: VerlConfig,
    /// `trainer.nnodes × trainer.n_gpus_per_node`.
    pub world_size: usize,
    /// Data-parallel size of the actor (world / (tp·cp·pp)).
    pub actor_dp: usize,
    /// Samples per actor mini-batch on one dp rank (`ppo_mini_batch_size × n / dp`).
    pub actor_mini_batch_per_dp: usize,
    /// Data-parallel size of the critic, if enabled.
    pub critic_dp: Option<usize>,
    /// Rollout data-parallel size (world / rollout tp).
    pub rollout_dp: usize,
}

fn invalid(
    key: &str,
    value: impl ToString,
    message: impl Into<String>,
    fix: impl Into<String>,
) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        value: value.to_string(),
        message: message.into(),
        fix: fix.into(),
    }
}

fn one_of(key: &str, value: &str, allowed: &[&str]) -> Result<(), ConfigError> {
    if allowed.contains(&value) {
        return Ok(());
    }
    Err(invalid(
        key,
        format!("{value:?}"),
        "is not a known name",
        format!("use one of: {}", allowed.join(", ")),
    ))
}

/// `value` must be finite and ≥ 0 (a rate, a coefficient, a bound).
fn non_negative(key: &str, value: f64, fix: &str) -> Result<(), ConfigError> {
    if value.is_finite() && value >= 0.0 {
        return Ok(());
    }
    Err(invalid(key, value, "must be a finite number ≥ 0", fix))
}

/// An optimizer block: rates, decay, betas, eps and clipping, each by field.
fn optim(prefix: &str, o: &super::OptimConfig) -> Result<(), ConfigError> {
    let key = |f: &str| format!("{prefix}.optim.{f}");
    non_negative(
        &key("lr"),
        o.lr,
        "e.g. 1e-6 for an actor, 1e-5 for a critic",
    )?;
    non_negative(&key("min_lr"), o.min_lr, "the rate a decay ends at, e.g. 0")?;
    non_negative(
        &key("lr_warmup_init"),
        o.lr_warmup_init,
        "the rate warm-up starts at, e.g. 0",
    )?;
    if !(0.0..=1.0).contains(&o.lr_warmup_steps_ratio) {
        return Err(invalid(
            &key("lr_warmup_steps_ratio"),
            o.lr_warmup_steps_ratio,
            "must be in [0, 1]",
            "the fraction of the run spent warming up, e.g. 0",
        ));
    }
    non_negative(
        &key("weight_decay"),
        o.weight_decay,
        "e.g. 0.01, or 0 for none",
    )?;
    non_negative(
        &key("clip_grad"),
        o.clip_grad,
        "the gradient-norm bound, e.g. 1.0 (0 turns clipping off)",
    )?;
    if !(o.eps.is_finite() && o.eps > 0.0) {
        return Err(invalid(
            &key("eps"),
            o.eps,
            "must be a finite number > 0",
            "e.g. 1e-8",
        ));
    }
    for (i, b) in o.betas.iter().enumerate() {
        if !(0.0..1.0).contains(b) {
            return Err(invalid(
                &key("betas"),
                format!("{:?}", o.betas),
                format!("β{} = {b} must be in [0, 1)", i + 1),
                "e.g. [0.9, 0.999]",
            ));
        }
    }
    Ok(())
}

fn layout(prefix: &str, m: &MegatronConfig, world: usize) -> Result<usize, ConfigError> {
    m.parallel().validate(world).map_err(|e| match e {
        TopologyError::Invalid { field, message } => {
            let key = format!("{prefix}.megatron.{}", MegatronConfig::key_of(field));
            invalid(&key, field, message, format!("choose sizes whose product divides trainer.nnodes × trainer.n_gpus_per_node = {world}"))
        }
        other => invalid(&format!("{prefix}.megatron"), "", other.to_string(), "check the parallel sizes"),
    })
}

fn micro_batch(
    prefix: &str,
    legacy: Option<usize>,
    per_gpu: Option<usize>,
    dynamic: bool,
    legacy_key: &str,
    per_gpu_key: &str,
) -> Result<Option<usize>, ConfigError> {
    match (legacy, per_gpu) {
        (Some(_), Some(_)) => Err(invalid(
            &format!("{prefix}.{legacy_key}"),
            legacy.unwrap_or_default(),
            format!("is set together with {prefix}.{per_gpu_key}"),
            format!("set only {prefix}.{per_gpu_key}; {legacy_key} is deprecated"),
        )),
        (Some(_), None) => Err(invalid(
            &format!("{prefix}.{legacy_key}"),
            legacy.unwrap_or_default(),
            "is the deprecated global micro-batch size",
            format!("set {prefix}.{per_gpu_key} (micro-batch per rank) instead"),
        )),
        (None, None) if !dynamic => Err(invalid(
            &format!("{prefix}.{per_gpu_key}"),
            "null",
            "must be set when dynamic batch size is off",
            format!("set {prefix}.{per_gpu_key}=N, or turn on use_dynamic_bsz"),
        )),
        (None, Some(0)) => Err(invalid(
            &format!("{prefix}.{per_gpu_key}"),
            0,
            "must be at least 1",
            "use a positive size",
        )),
        (None, p) => Ok(p),
    }
}

impl VerlConfig {
    /// Checks names, layouts and batch arithmetic; returns the derived sizes.
    pub fn validate(&self) -> Result<ValidatedConfig, ConfigError> {
        self.validate_with(&[], &[])
    }

    /// As [`Self::validate`], also accepting advantage estimators and policy losses that the
    /// embedding program registered under its own names.
    pub fn validate_with(
        &self,
        extra_estimators: &[&str],
        extra_policy_losses: &[&str],
    ) -> Result<ValidatedConfig, ConfigError> {
        let estimators: Vec<&str> = ADV_ESTIMATORS
            .iter()
            .chain(extra_estimators)
            .copied()
            .collect();
        let losses: Vec<&str> = POLICY_LOSSES
            .iter()
            .chain(extra_policy_losses)
            .copied()
            .collect();
        let mut cfg = self.clone();
        cfg.resolve();
        sizes_in_range(&cfg)?;
        super::unsupported::refuse_unsupported(&cfg)?;
        let world = check_launch(&cfg)?;
        check_names(&cfg, &estimators, &losses)?;
        check_sampling(&cfg)?;
        check_numbers(&cfg)?;
        let (actor_dp, rtp) = check_layouts(&cfg, world)?;
        let actor_mini_batch_per_dp = check_batches(&cfg, actor_dp)?;
        let critic_dp = check_critic(&cfg, world)?;
        if cfg.reward_model.enable {
            layout("reward_model", &cfg.reward_model.megatron, world)?;
        }
        Ok(ValidatedConfig {
            world_size: world,
            actor_dp,
            actor_mini_batch_per_dp,
            critic_dp,
            rollout_dp: world / rtp,
            config: cfg,
        })
    }
}

/// The launch: a positive world size, and a launcher that can place it. Returns the world size.
fn check_launch(cfg: &VerlConfig) -> Result<usize, ConfigError> {
    let t = &cfg.trainer;
    let world = t.world_size();
    if world == 0 {
        return Err(invalid(
            "trainer.n_gpus_per_node",
            t.n_gpus_per_node,
            "gives no ranks",
            "set trainer.nnodes and trainer.n_gpus_per_node to at least 1",
        ));
    }
    if t.nnodes > 1 && t.launcher == Launcher::Threads {
        return Err(invalid(
            "trainer.launcher",
            "threads",
            "cannot put ranks on several nodes (trainer.nnodes > 1)",
            "set trainer.launcher=processes (or auto)",
        ));
    }
    Ok(world)
}

/// The registered names: advantage estimator, policy loss and the other named choices.
fn check_names(cfg: &VerlConfig, estimators: &[&str], losses: &[&str]) -> Result<(), ConfigError> {
    let actor = &cfg.actor_rollout_ref.actor;
    one_of(
        "algorithm.adv_estimator",
        &cfg.algorithm.adv_estimator,
        estimators,
    )?;
    one_of(
        "actor_rollout_ref.actor.policy_loss.loss_mode",
        &actor.policy_loss.loss_mode,
        losses,
    )?;
    one_of(
        "algorithm.kl_ctrl.type",
        &cfg.algorithm.kl_ctrl.kind,
        &["fixed", "adaptive"],
    )?;
    one_of(
        "actor_rollout_ref.actor.optim.optimizer",
        &actor.optim.optimizer,
        &["adam"],
    )?;

    Ok(())
}

/// The rollout's sampling settings.
fn check_sampling(cfg: &VerlConfig) -> Result<(), ConfigError> {
    let rollout = &cfg.actor_rollout_ref.rollout;
    if rollout.n == 0 {
        return Err(invalid(
            "actor_rollout_ref.rollout.n",
            0,
            "must be at least 1",
            "set the number of samples per prompt",
        ));
    }
    if GROUP_ESTIMATORS.contains(&cfg.algorithm.adv_estimator.as_str()) && rollout.n < 2 {
        return Err(invalid(
            "actor_rollout_ref.rollout.n",
            rollout.n,
            format!(
                "`{}` compares samples of the same prompt, so it needs at least 2",
                cfg.algorithm.adv_estimator
            ),
            "set actor_rollout_ref.rollout.n=2 or more (e.g. 5 or 8)",
        ));
    }
    if rollout.temperature.is_nan() || rollout.temperature < 0.0 {
        return Err(invalid(
            "actor_rollout_ref.rollout.temperature",
            rollout.temperature,
            "must be ≥ 0",
            "0 is greedy",
        ));
    }
    if !(rollout.top_p > 0.0 && rollout.top_p <= 1.0) {
        return Err(invalid(
            "actor_rollout_ref.rollout.top_p",
            rollout.top_p,
            "must be in (0, 1]",
            "use 1.0 to turn it off",
        ));
    }
    if !(0.0..=1.0).contains(&rollout.min_p) {
        return Err(invalid(
            "actor_rollout_ref.rollout.min_p",
            rollout.min_p,
            "must be in [0, 1]",
            "use 0 to turn it off",
        ));
    }
    if rollout.top_k < -1 {
        return Err(invalid(
            "actor_rollout_ref.rollout.top_k",
            rollout.top_k,
            "must be -1 (off) or ≥ 0",
            "use -1 to turn it off",
        ));
    }
    if !(rollout.gpu_memory_utilization > 0.0 && rollout.gpu_memory_utilization <= 1.0) {
        return Err(invalid(
            "actor_rollout_ref.rollout.gpu_memory_utilization",
            rollout.gpu_memory_utilization,
            "must be in (0, 1]",
            "e.g. 0.5",
        ));
    }
    Ok(())
}

/// The optimizers' and the losses' numbers.
fn check_numbers(cfg: &VerlConfig) -> Result<(), ConfigError> {
    let actor = &cfg.actor_rollout_ref.actor;
    let t = &cfg.trainer;
    optim("actor_rollout_ref.actor", &actor.optim)?;
    if cfg.critic_enabled() {
        optim("critic", &cfg.critic.optim)?;
    }
    if let Some(lr) = t.sft_warmup_lr {
        non_negative(
            "trainer.sft_warmup_lr",
            lr,
            "e.g. 1e-3, or leave it unset to use the actor's optim.lr",
        )?;
    }
    non_negative(
        "actor_rollout_ref.actor.clip_ratio",
        actor.clip_ratio,
        "PPO's clip range ε, e.g. 0.2",
    )?;
    for (k, v) in [
        (
            "actor_rollout_ref.actor.clip_ratio_low",
            actor.clip_ratio_low,
        ),
        (
            "actor_rollout_ref.actor.clip_ratio_high",
            actor.clip_ratio_high,
        ),
    ] {
        if let Some(v) = v {
            non_negative(
                k,
                v,
                "a clip range, e.g. 0.2 (or leave it unset to use clip_ratio)",
            )?;
        }
    }
    if let Some(f) = actor.loss_scale_factor {
        if !(f.is_finite() && f > 0.0) {
            return Err(invalid(
                "actor_rollout_ref.actor.loss_scale_factor",
                f,
                "must be a positive number (the divisor of seq-mean-token-sum-norm)",
                "set it to the response length to keep, e.g. data.max_response_length, or null",
            ));
        }
    }
    if actor.clip_ratio_c.is_nan() || actor.clip_ratio_c <= 1.0 {
        return Err(invalid(
            "actor_rollout_ref.actor.clip_ratio_c",
            actor.clip_ratio_c,
            "must be greater than 1 for dual-clip PPO",
            "the default is 3.0",
        ));
    }
    for (k, v) in [
        ("data.max_prompt_length", cfg.data.max_prompt_length),
        ("data.max_response_length", cfg.data.max_response_length),
    ] {
        if v == 0 {
            return Err(invalid(
                k,
                0,
                "must be at least 1",
                "give a length in tokens",
            ));
        }
    }

    Ok(())
}

/// Each role's parallel layout against the world size: the actor's data-parallel size and the rollout's tensor-parallel size.
fn check_layouts(cfg: &VerlConfig, world: usize) -> Result<(usize, usize), ConfigError> {
    let arr = &cfg.actor_rollout_ref;
    let actor = &cfg.actor_rollout_ref.actor;
    let rollout = &cfg.actor_rollout_ref.rollout;
    let actor_dp = layout("actor_rollout_ref.actor", &actor.megatron, world)?;
    if let Some(m) = &arr.reference.megatron {
        layout("actor_rollout_ref.ref", m, world)?;
    }
    let rtp = rollout.tensor_model_parallel_size;
    if rtp == 0 || !world.is_multiple_of(rtp) {
        return Err(invalid(
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
            rtp,
            format!("must be at least 1 and divide the world size {world}"),
            format!("use a divisor of {world}"),
        ));
    }
    if rollout.update_weights_bucket_megabytes == 0 {
        return Err(invalid(
            "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
            0,
            "must be at least 1".to_string(),
            "give a bucket size in MiB (verl's default is 512)".to_string(),
        ));
    }

    Ok((actor_dp, rtp))
}

/// The batch arithmetic of verl's trainer and actor checks, and the KL loss: the actor's mini-batch per data-parallel rank.
fn check_batches(cfg: &VerlConfig, actor_dp: usize) -> Result<usize, ConfigError> {
    let arr = &cfg.actor_rollout_ref;
    let actor = &cfg.actor_rollout_ref.actor;
    let rollout = &cfg.actor_rollout_ref.rollout;
    let n = rollout.n;
    let train = cfg.data.train_batch_size;
    let mini = actor.ppo_mini_batch_size;
    if train == 0 {
        return Err(invalid(
            "data.train_batch_size",
            0,
            "must be at least 1",
            "give the number of prompts per step",
        ));
    }
    if mini == 0 || mini > train {
        return Err(invalid(
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            mini,
            format!("must be between 1 and data.train_batch_size ({train})"),
            "a mini-batch is a slice of the step's prompts",
        ));
    }
    if !train.is_multiple_of(mini) {
        return Err(invalid(
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            mini,
            format!("does not divide data.train_batch_size ({train}), so the last mini-batch would be short"),
            format!("use a divisor of {train}"),
        ));
    }
    let real_train = train * n;
    if !real_train.is_multiple_of(actor_dp) {
        return Err(invalid(
            "data.train_batch_size",
            train,
            format!("× rollout.n ({n}) = {real_train} samples cannot be split over the actor's dp = {actor_dp} ranks"),
            format!("make train_batch_size × n a multiple of {actor_dp}"),
        ));
    }
    let mini_samples = mini * n;
    if !mini_samples.is_multiple_of(actor_dp) {
        return Err(invalid(
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            mini,
            format!(
                "× rollout.n ({n}) = {mini_samples} samples cannot be split over dp = {actor_dp}"
            ),
            format!("make ppo_mini_batch_size × n a multiple of {actor_dp}"),
        ));
    }
    let actor_mini_batch_per_dp = mini_samples / actor_dp;
    let prefix = "actor_rollout_ref.actor";
    let actor_micro = micro_batch(
        prefix,
        actor.ppo_micro_batch_size,
        actor.ppo_micro_batch_size_per_gpu,
        actor.use_dynamic_bsz,
        "ppo_micro_batch_size",
        "ppo_micro_batch_size_per_gpu",
    )?;
    if let Some(micro) = actor_micro {
        if !actor_mini_batch_per_dp.is_multiple_of(micro) {
            return Err(invalid(
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                micro,
                format!("does not divide the per-rank mini-batch of {actor_mini_batch_per_dp} samples (ppo_mini_batch_size {mini} × n {n} / dp {actor_dp})"),
                format!("use a divisor of {actor_mini_batch_per_dp}"),
            ));
        }
    }
    micro_batch(
        "actor_rollout_ref.rollout",
        rollout.log_prob_micro_batch_size,
        rollout.log_prob_micro_batch_size_per_gpu,
        rollout.log_prob_use_dynamic_bsz,
        "log_prob_micro_batch_size",
        "log_prob_micro_batch_size_per_gpu",
    )?;
    if actor.use_kl_loss {
        let r = &arr.reference;
        // The reference reuses the rollout's log-prob micro-batch when its own is unset.
        if r.log_prob_micro_batch_size_per_gpu.is_some() || r.log_prob_micro_batch_size.is_some() {
            micro_batch(
                "actor_rollout_ref.ref",
                r.log_prob_micro_batch_size,
                r.log_prob_micro_batch_size_per_gpu,
                r.log_prob_use_dynamic_bsz,
                "log_prob_micro_batch_size",
                "log_prob_micro_batch_size_per_gpu",
            )?;
        }
        if cfg.algorithm.use_kl_in_reward {
            tracing::warn!("both algorithm.use_kl_in_reward and actor.use_kl_loss are on: the KL is penalised twice");
        }
    }

    Ok(actor_mini_batch_per_dp)
}

/// The critic's settings and layout when it is on (its data-parallel size), or that the
/// estimator needs none.
fn check_critic(cfg: &VerlConfig, world: usize) -> Result<Option<usize>, ConfigError> {
    let n = cfg.actor_rollout_ref.rollout.n;
    let mini = cfg.actor_rollout_ref.actor.ppo_mini_batch_size;
    if cfg.critic_enabled() {
        let c = &cfg.critic;
        let dp = layout("critic", &c.megatron, world)?;
        let cmini = c.ppo_mini_batch_size.unwrap_or(mini);
        if cmini == 0 || !(cmini * n).is_multiple_of(dp) {
            return Err(invalid(
                "critic.ppo_mini_batch_size",
                cmini,
                format!("× n ({n}) must be a positive multiple of the critic's dp = {dp}"),
                format!("make it a multiple of {dp}"),
            ));
        }
        let per_dp = cmini * n / dp;
        if let Some(micro) = micro_batch(
            "critic",
            c.ppo_micro_batch_size,
            c.ppo_micro_batch_size_per_gpu,
            c.use_dynamic_bsz,
            "ppo_micro_batch_size",
            "ppo_micro_batch_size_per_gpu",
        )? {
            if !per_dp.is_multiple_of(micro) {
                return Err(invalid(
                    "critic.ppo_micro_batch_size_per_gpu",
                    micro,
                    format!("does not divide the critic's per-rank mini-batch of {per_dp} samples"),
                    format!("use a divisor of {per_dp}"),
                ));
            }
        }
        if c.cliprange_value <= 0.0 {
            return Err(invalid(
                "critic.cliprange_value",
                c.cliprange_value,
                "must be positive",
                "the default is 0.5",
            ));
        }
        Ok(Some(dp))
    } else {
        if cfg.algorithm.adv_estimator == "gae" {
            return Err(invalid(
                "critic.enable",
                false,
                "GAE needs a critic for its values",
                "set critic.enable=true or choose another algorithm.adv_estimator",
            ));
        }
        Ok(None)
    }
}
