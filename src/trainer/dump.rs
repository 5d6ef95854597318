//! verl's generation dumps: `trainer.rollout_data_dir` (every training step's samples) and
//! `trainer.validation_data_dir` (every validation's), one `<step>.jsonl` a step with a line
//! per response: `input` (the prompt's text), `output` (the response's text), `gts` (the row's
//! ground truth), `score` (the response's summed token-level score) and `step`, then a column
//! per reward extra (a reward function's dict entries, `acc`, `pred`, …), as verl's
//! `_dump_generations` writes them.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use verl_core::traits::RewardScore;
use verl_core::DataProto;

use super::data::Codec;
use super::error::{setup, TrainError};
use super::model::Infer;

/// The lines of one dump: a JSON object per response of `gen` (the rollout's output: its
/// `prompts`, `responses`, `attention_mask`, `response_mask` and `reward_model` columns), with
/// `scores[i]` for response `i` and the reward extras of `extras[i]` (none where `extras` is
/// shorter).
pub(crate) fn generation_lines(
    gen: &DataProto<Infer>,
    codec: &Codec,
    scores: &[f64],
    extras: &[RewardScore],
    step: u64,
) -> Result<Vec<Value>, TrainError> {
    let ints = |key: &str| -> Result<Vec<i64>, TrainError> {
        Ok(gen.to_data(key)?.convert::<i64>().iter::<i64>().collect())
    };
    let (prompts, responses) = (ints("prompts")?, ints("responses")?);
    let (attention, response_mask) = (ints("attention_mask")?, ints("response_mask")?);
    let rows = gen.len();
    if scores.len() != rows {
        return Err(setup(format!(
            "generation dump: {} scores for {rows} responses",
            scores.len()
        )));
    }
    let p = prompts.len() / rows.max(1);
    let r = responses.len() / rows.max(1);
    let width = attention.len() / rows.max(1);
    let truths = gen.non_tensor("reward_model").ok();
    (0..rows)
        .map(|i| {
            // The prompt's real tokens: its columns of the attention mask (left padding off).
            let prompt: Vec<u32> = (0..p)
                .filter(|&j| attention[i * width + j] != 0)
                .map(|j| prompts[i * p + j] as u32)
                .collect();
            let len = response_mask[i * r..(i + 1) * r].iter().sum::<i64>() as usize;
            let response: Vec<u32> = responses[i * r..i * r + len]
                .iter()
                .map(|&t| t as u32)
                .collect();
            let gts = truths
                .and_then(|t| t[i].get("ground_truth").cloned())
                .unwrap_or(Value::Null);
            let mut line = json!({
                "input": codec.decode_all(&prompt),
                "output": codec.decode(&response),
                "gts": gts,
                "score": scores[i],
                "step": step,
            });
            // The reward extras, one column each, set after the five as verl sets them (so a
            // function's own `score` entry replaces the summed one, as in verl's dumps).
            if let (Some(extra), Some(map)) = (extras.get(i), line.as_object_mut()) {
                for (name, &v) in &extra.extra {
                    map.insert(name.clone(), json!(v));
                }
                // A numeric answer is already there as a number, as verl dumps it.
                if let Some(pred) = extra
                    .pred
                    .as_ref()
                    .filter(|_| !extra.extra.contains_key("pred"))
                {
                    map.insert("pred".into(), json!(pred));
                }
            }
            Ok(line)
        })
        .collect()
}

/// Writes `lines` to `<dir>/<step>.jsonl` (the directory made first) and returns the path.
pub(crate) fn write_generations(
    dir: &str,
    step: u64,
    lines: &[Value],
) -> Result<PathBuf, TrainError> {
    let dir = Path::new(dir);
    std::fs::create_dir_all(dir).map_err(|e| {
        setup(format!(
            "generation dump: cannot make {}: {e}",
            dir.display()
        ))
    })?;
    let path = dir.join(format!("{step}.jsonl"));
    let mut text = String::new();
    for line in lines {
        text.push_str(&line.to_string());
        text.push('\n');
    }
    std::fs::write(&path, text).map_err(|e| {
        setup(format!(
            "generation dump: cannot write {}: {e}",
            path.display()
        ))
    })?;
    tracing::info!("dumped {} generations to {}", lines.len(), path.display());
    Ok(path)
}
