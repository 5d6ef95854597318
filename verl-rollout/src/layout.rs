//! verl's rollout batch layout: reading prompts out of a `DataProto` and writing the generated
//! batch back in the shape verl's trainer expects.
//!
//! Input rows: `input_ids` `[batch, prompt_len]` left-padded, `attention_mask` (1 = token),
//! optionally `position_ids`, and any non-tensor columns (`uid`, `data_source`, ...).
//! Output rows (each prompt repeated `n` times, consecutively):
//! - `prompts` `[rows, prompt_len]`: the prompt, left-padded;
//! - `responses` `[rows, response_length]`: the response, right-padded with the pad id;
//! - `input_ids` = prompts ‖ responses; `attention_mask` = prompt mask ‖ response mask;
//! - `position_ids`: the prompt's, then continuing one by one through the response;
//! - `response_mask`: 1 on generated tokens (the final EOS included), 0 on padding;
//! - `rollout_log_probs` (when asked): each response token's log-prob, 0 on padding;
//! - `routed_experts` (router replay R3): `[rows, prompt_len + response_length, layers, k]`,
//!   each fed token's experts in its column, -1 elsewhere (padding, layers without experts,
//!   the last response token, which was sampled and never fed);
//! - the non-tensor columns repeated, with a `uid` per prompt (made up when missing) shared by
//!   its samples.

use burn::prelude::*;
use burn::tensor::{Int, TensorData};
use serde_json::Value;
use verl_core::config::Truncation;
use verl_core::DataProto;

use crate::engine::Completion;
use crate::error::RolloutError;

fn host_i64<B: Backend>(proto: &DataProto<B>, key: &str) -> Result<Vec<i64>, RolloutError> {
    Ok(proto.to_data(key)?.convert::<i64>().iter::<i64>().collect())
}

/// Each row's prompt tokens (where `attention_mask` is 1), truncated per `truncation` to
/// `limit` tokens, and each row's last prompt position id.
pub fn read_prompts<B: Backend>(
    proto: &DataProto<B>,
    limit: usize,
    truncation: Truncation,
) -> Result<(Vec<Vec<u32>>, usize), RolloutError> {
    let ids = host_i64(proto, "input_ids")?;
    let mask: Vec<f64> = proto
        .to_data("attention_mask")?
        .convert::<f32>()
        .iter::<f64>()
        .collect();
    let rows = proto.len();
    let width = ids.len() / rows.max(1);
    let mut prompts = Vec::with_capacity(rows);
    for r in 0..rows {
        let mut p: Vec<u32> = (0..width)
            .filter(|&j| mask[r * width + j] > 0.5)
            .map(|j| ids[r * width + j] as u32)
            .collect();
        if p.is_empty() {
            return Err(RolloutError::EmptyPrompt { row: r });
        }
        p = truncation
            .apply(p, limit)
            .map_err(|len| RolloutError::PromptTooLong {
                row: r,
                len,
                limit,
                field: "data.max_prompt_length",
            })?;
        prompts.push(p);
    }
    Ok((prompts, width))
}

/// Builds the output batch for `prompts` (one per input row, as read) and their completions
/// (`n` per prompt, consecutive). The prompt width is the input's, or `prompt_limit` when
/// prompts were truncated to it. `masks` (an agent loop's) give each row's response mask;
/// `routing` `(layers, k)` writes the completions' routed experts.
#[allow(clippy::too_many_arguments)]
pub fn build_output<B: Backend>(
    input: &DataProto<B>,
    prompts: &[Vec<u32>],
    width: usize,
    prompt_limit: usize,
    completions: &[Completion],
    masks: Option<&[Vec<u8>]>,
    n: usize,
    response_length: usize,
    pad_token_id: u32,
    with_log_probs: bool,
    routing: Option<(usize, usize)>,
    uid_prefix: &str,
    device: &B::Device,
) -> Result<DataProto<B>, RolloutError> {
    let rows = prompts.len() * n;
    assert_eq!(completions.len(), rows, "n completions per prompt");
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let p_width = width.min(prompt_limit).max(longest);
    let r = response_length;
    let total = p_width + r;
    let pad = pad_token_id as i64;
    let (mut prompt_ids, mut input_ids) = (Vec::with_capacity(rows * p_width), Vec::new());
    let mut responses = Vec::with_capacity(rows * r);
    let (mut attention, mut positions) = (Vec::with_capacity(rows * total), Vec::new());
    let mut response_mask = Vec::with_capacity(rows * r);
    let mut log_probs = Vec::new();
    let per_position = routing.map_or(0, |(layers, k)| layers * k);
    let mut routed = Vec::with_capacity(rows * total * per_position);
    for (i, c) in completions.iter().enumerate() {
        let p = &prompts[i / n];
        let left = p_width - p.len();
        let row_prompt: Vec<i64> = std::iter::repeat_n(pad, left)
            .chain(p.iter().map(|&t| t as i64))
            .collect();
        let gen = c.tokens.len().min(r);
        let row_resp: Vec<i64> = c.tokens[..gen]
            .iter()
            .map(|&t| t as i64)
            .chain(std::iter::repeat_n(pad, r - gen))
            .collect();
        prompt_ids.extend_from_slice(&row_prompt);
        input_ids.extend_from_slice(&row_prompt);
        input_ids.extend_from_slice(&row_resp);
        responses.extend_from_slice(&row_resp);
        for j in 0..total {
            let token = if j < p_width {
                j >= left
            } else {
                j - p_width < gen
            };
            attention.push(token as i64);
        }
        // Prompt positions count its tokens from 0 (padding at 0); the response continues.
        for j in 0..total {
            positions.push(if j < left { 0 } else { (j - left) as i64 });
        }
        // An agent loop's mask is 0 on the tools' tokens; otherwise every generated token is 1.
        response_mask.extend((0..r).map(|j| match masks {
            Some(m) if j < gen => m[i].get(j).copied().unwrap_or(0) as i64,
            _ => (j < gen) as i64,
        }));
        if with_log_probs {
            log_probs.extend((0..r).map(|j| if j < gen { c.log_probs[j] } else { 0.0 }));
        }
        if per_position > 0 {
            // Position q of the sequence sits in column left + q; what the response's cut
            // dropped is dropped with it.
            let start = routed.len();
            routed.resize(start + total * per_position, -1);
            let fed = (c.routed_experts.len() / per_position).min(total - left);
            let at = start + left * per_position;
            routed[at..at + fed * per_position]
                .copy_from_slice(&c.routed_experts[..fed * per_position]);
        }
    }
    let int2 = |v: Vec<i64>, w: usize| {
        Tensor::<B, 2, Int>::from_data(TensorData::new(v, [rows, w]), device)
    };
    let mut out = DataProto::new();
    out.insert_int("prompts", int2(prompt_ids, p_width))?;
    out.insert_int("responses", int2(responses, r))?;
    out.insert_int("input_ids", int2(input_ids, total))?;
    out.insert_int("attention_mask", int2(attention, total))?;
    out.insert_int("position_ids", int2(positions, total))?;
    out.insert_int("response_mask", int2(response_mask, r))?;
    if with_log_probs {
        out.insert_float(
            "rollout_log_probs",
            Tensor::<B, 2>::from_data(TensorData::new(log_probs, [rows, r]), device),
        )?;
    }
    if let Some((layers, k)) = routing {
        out.insert_int(
            "routed_experts",
            Tensor::<B, 4, Int>::from_data(
                TensorData::new(routed, [rows, total, layers, k]),
                device,
            ),
        )?;
    }
    for key in input.non_tensor_keys() {
        let values = input.non_tensor(key)?;
        let repeated = values
            .iter()
            .flat_map(|v| std::iter::repeat_n(v.clone(), n))
            .collect();
        out.insert_non_tensor(key, repeated)?;
    }
    if !out.contains("uid") {
        let uids = (0..rows)
            .map(|i| Value::String(format!("{uid_prefix}-{}", i / n)))
            .collect();
        out.insert_non_tensor("uid", uids)?;
    }
    out.meta_info = input.meta_info.clone();
    Ok(out)
}
