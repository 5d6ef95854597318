//! Reading verl's batch columns for a forward pass, and running the model over the response
//! window in micro-batches.

use burn::prelude::*;
use burn::tensor::{Int, TensorData};
use verl_core::traits::Communicator;
use verl_core::DataProto;

use crate::models::packing::PackedSequences;
use crate::models::CausalLm;
use crate::parallel::ParallelBackend;

/// A column as f32, whatever its stored kind (masks come as ints).
pub fn float_col<B: ParallelBackend>(
    data: &DataProto<B>,
    key: &str,
) -> verl_core::Result<Tensor<B, 2>> {
    let d = data.to_data(key)?;
    let shape = d.shape.clone();
    let values: Vec<f32> = d.convert::<f32>().iter::<f32>().collect();
    Ok(Tensor::from_data(
        TensorData::new(values, [shape[0], shape[1]]),
        &data_device(data)?,
    ))
}

/// A column as integers.
pub fn int_col<B: ParallelBackend>(
    data: &DataProto<B>,
    key: &str,
) -> verl_core::Result<Tensor<B, 2, Int>> {
    Ok(data.int::<2>(key)?)
}

fn data_device<B: ParallelBackend>(data: &DataProto<B>) -> verl_core::Result<B::Device> {
    Ok(data.int::<2>("input_ids")?.device())
}

/// The inputs of a forward pass over `input_ids` = prompt ‖ response.
pub struct ModelInputs<B: ParallelBackend> {
    pub input_ids: Tensor<B, 2, Int>,
    pub attention_mask: Tensor<B, 2>,
    pub position_ids: Tensor<B, 2, Int>,
    /// Response length R.
    pub response_len: usize,
    /// With a model whose head is fused ([`CausalLm::with_fused_log_probs`]): the responses
    /// and the temperature, so the outputs are log-probs and entropies `[batch, R, 2]`.
    pub fused: Option<crate::models::causal_lm::FusedTargets<B>>,
    /// The batch's sequences packed into one row (read from the attention mask already on
    /// the host), for a model that packs them ([`CausalLm::with_packed_sequences`]).
    pub packing: PackedSequences,
}

impl<B: ParallelBackend> ModelInputs<B> {
    pub fn from_batch(data: &DataProto<B>) -> verl_core::Result<Self> {
        let responses = data.int::<2>("responses")?;
        let response_len = responses.dims()[1];
        let mask = data.to_data("attention_mask")?;
        let [rows, width] = [mask.shape[0], mask.shape[1]];
        let values: Vec<f32> = mask.convert::<f32>().iter::<f32>().collect();
        let window = (width.saturating_sub(response_len + 1), response_len);
        let packing = PackedSequences::new(&values, rows, width, window);
        Ok(Self {
            input_ids: data.int::<2>("input_ids")?,
            attention_mask: Tensor::from_data(
                TensorData::new(values, [rows, width]),
                &data_device(data)?,
            ),
            position_ids: data.int::<2>("position_ids")?,
            response_len,
            fused: None,
            packing,
        })
    }

    /// The shape of the hidden states a pipeline stage of `model` receives for these inputs.
    pub fn stage_input_shape<C: ParallelBackend>(&self, model: &CausalLm<C>) -> [usize; 3] {
        if model.pack_sequences {
            return model.stage_input_shape(1, self.packing.tokens());
        }
        let [b, t] = self.input_ids.dims();
        model.stage_input_shape(b, t)
    }

    /// Asks `model`, when its head is fused ([`CausalLm::with_fused_log_probs`]), for the
    /// log-probs of `data`'s responses at `temperature` and their entropies, instead of logits.
    pub fn fused_for<C: ParallelBackend>(
        mut self,
        model: &CausalLm<C>,
        data: &DataProto<B>,
        temperature: f64,
    ) -> verl_core::Result<Self> {
        if model.fused_head_chunk.is_some() {
            self.fused = Some(crate::models::causal_lm::FusedTargets {
                labels: data.int::<2>("responses")?,
                temperature,
            });
        }
        Ok(self)
    }

    /// The same inputs on another backend (the autodiff one, for training).
    pub fn map<C: ParallelBackend>(
        self,
        f: impl Fn(Tensor<B, 2>) -> Tensor<C, 2>,
        g: impl Fn(Tensor<B, 2, Int>) -> Tensor<C, 2, Int>,
    ) -> ModelInputs<C> {
        ModelInputs {
            input_ids: g(self.input_ids),
            attention_mask: f(self.attention_mask),
            position_ids: g(self.position_ids),
            response_len: self.response_len,
            fused: self.fused.map(|t| crate::models::causal_lm::FusedTargets {
                labels: g(t.labels),
                temperature: t.temperature,
            }),
            packing: self.packing,
        }
    }

    /// The model's outputs at the positions that predict each response token
    /// (`t − R − 1 .. t − 1`), `[batch, R, out]`.
    pub fn response_outputs(&self, model: &CausalLm<B>) -> Tensor<B, 3> {
        self.stage_outputs(model, None)
    }
}

impl<B: ParallelBackend> ModelInputs<B> {
    /// [`Self::response_outputs`] for one pipeline stage: hidden states for the next stage,
    /// or on the last stage the response-window outputs.
    pub fn stage_outputs(&self, model: &CausalLm<B>, input: Option<Tensor<B, 3>>) -> Tensor<B, 3> {
        let [b, t] = self.input_ids.dims();
        let r = self.response_len;
        if model.pack_sequences {
            let p = &self.packing;
            let index = crate::models::index_tensor::<B>(&p.gather, &self.input_ids.device());
            let pack = |x: &Tensor<B, 2, Int>| {
                x.clone()
                    .reshape([b * t])
                    .select(0, index.clone())
                    .reshape([1, p.tokens()])
            };
            let row = (pack(&self.input_ids), pack(&self.position_ids));
            return model.forward_packed_stage(input, p, row, self.fused.clone());
        }
        model.forward_stage_with(
            input,
            self.input_ids.clone(),
            Some(self.attention_mask.clone()),
            Some(self.position_ids.clone()),
            (t - r - 1, r),
            self.fused.clone(),
        )
    }
}

impl<B: ParallelBackend> ModelInputs<B> {
    /// [`Self::response_outputs`] through the pipeline group `pp` (forward only): hidden states
    /// come in from the previous stage and go out to the next; the last stage returns the
    /// outputs, the others `None`. Without a group, the whole model's outputs.
    pub fn pipelined_outputs(
        &self,
        model: &CausalLm<B>,
        pp: Option<&dyn Communicator<B>>,
    ) -> verl_core::Result<Option<Tensor<B, 3>>> {
        let Some(pp) = pp.filter(|p| p.world_size() > 1) else {
            let out = self.response_outputs(model);
            crate::parallel::sample_memory::<B>(&out.device());
            return Ok(Some(out));
        };
        let (me, stages) = (pp.rank(), pp.world_size());
        let input = if me == 0 {
            None
        } else {
            let shape = self.stage_input_shape(model);
            let n = shape.iter().product();
            let device = self.input_ids.device();
            Some(pp.recv(me - 1, n, &device)?.reshape(shape))
        };
        let out = self.stage_outputs(model, input);
        crate::parallel::sample_memory::<B>(&out.device());
        if me + 1 < stages {
            pp.send(out.flatten(0, 2), me + 1)?;
            return Ok(None);
        }
        Ok(Some(out))
    }
}

/// Row ranges of `micro`-row micro-batches over `rows` rows.
pub fn micro_batches(rows: usize, micro: usize) -> Vec<std::ops::Range<usize>> {
    let micro = micro.max(1);
    (0..rows)
        .step_by(micro)
        .map(|s| s..(s + micro).min(rows))
        .collect()
}

/// How a batch's rows are grouped into micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MicroBatching {
    /// Consecutive rows, this many per micro-batch (`*_micro_batch_size_per_gpu`).
    Rows(usize),
    /// verl's dynamic batch size (`use_dynamic_bsz`): groups of at most `max_tokens` real
    /// tokens, balanced ([`verl_core::batching`]), as many on every data-parallel rank; `key`
    /// names the budget's config key for errors.
    Tokens {
        max_tokens: usize,
        key: &'static str,
    },
}

impl MicroBatching {
    /// By a token budget when there is one, else `rows` per micro-batch; `key` names the
    /// budget's config key.
    pub fn of(max_tokens: Option<usize>, rows: usize, key: &'static str) -> Self {
        match max_tokens {
            Some(max_tokens) => Self::Tokens { max_tokens, key },
            None => Self::Rows(rows),
        }
    }
}

/// The rows of each micro-batch of `data` (every row once). With a token budget the count is
/// agreed over `dp` (the largest any rank needs), so that every rank runs as many forward
/// passes as its expert-parallel peers and pipeline schedule expect. The budget counts real
/// tokens (as verl's, which packs them); the micro-batch computed is its rows × the width
/// their prompts and responses span.
pub fn plan_micro_batches<B: ParallelBackend>(
    data: &DataProto<B>,
    how: MicroBatching,
    dp: Option<&dyn Communicator<B>>,
) -> verl_core::Result<Vec<Vec<usize>>> {
    let rows = data.len();
    let (max_tokens, key) = match how {
        MicroBatching::Rows(n) => {
            return Ok(micro_batches(rows, n)
                .into_iter()
                .map(|r| r.collect())
                .collect())
        }
        MicroBatching::Tokens { max_tokens, key } => (max_tokens, key),
    };
    let lengths: Vec<usize> = float_col(data, "attention_mask")?
        .sum_dim(1)
        .into_data()
        .convert::<f32>()
        .iter::<f32>()
        .map(|n| n.round() as usize)
        .collect();
    let mut groups = verl_core::batching::micro_batches_for(key, &lengths, max_tokens, 1)?;
    let Some(dp) = dp.filter(|c| c.world_size() > 1) else {
        return Ok(groups);
    };
    // Every rank makes as many as the rank that needs the most: one reduction, then this rank
    // splits its heaviest groups (a split never breaks the budget).
    let n = groups.len() as f32;
    let device = data_device(data)?;
    let agreed: Vec<f32> = dp
        .all_reduce(
            Tensor::<B, 1>::from_floats([n], &device),
            verl_core::traits::ReduceOp::Max,
        )?
        .into_data()
        .convert::<f32>()
        .to_vec()
        .unwrap_or_default();
    let target = agreed.first().copied().unwrap_or(n) as usize;
    if target > rows {
        return Err(verl_core::Error::backend(
            "megatron",
            format!(
                "dynamic batch size: another data-parallel rank makes {target} micro-batches but \
                 this one has only {rows} rows (the ranks' batches must be equal)"
            ),
        ));
    }
    while groups.len() < target {
        let tokens = |g: &Vec<usize>| g.iter().map(|&i| lengths[i]).sum::<usize>();
        let heaviest = (0..groups.len())
            .filter(|&i| groups[i].len() > 1)
            .max_by_key(|&i| (tokens(&groups[i]), std::cmp::Reverse(i)))
            .expect("fewer groups than rows leaves a group of several rows");
        let group = groups.remove(heaviest);
        let part_lengths: Vec<usize> = group.iter().map(|&i| lengths[i]).collect();
        let mut halves = verl_core::batching::balanced_partitions(&part_lengths, 2);
        if halves.iter().any(Vec::is_empty) {
            halves = vec![vec![0], (1..group.len()).collect()];
        }
        for half in halves {
            groups.push(half.into_iter().map(|j| group[j]).collect());
        }
    }
    groups.sort_by_key(|g| g.first().copied().unwrap_or(usize::MAX));
    Ok(groups)
}

/// `micro` without the padding columns none of its rows uses: the leading prompt columns and
/// the trailing response columns whose attention mask is 0 on every row (exact: no real token
/// attends to them). Returns it and how many response columns were dropped, to pad outputs
/// back with.
pub fn trim_padding<B: ParallelBackend>(
    micro: &DataProto<B>,
) -> verl_core::Result<(DataProto<B>, usize)> {
    let mask = float_col(micro, "attention_mask")?;
    let [_, t] = mask.dims();
    let r = micro.int::<2>("responses")?.dims()[1];
    let used: Vec<bool> = mask
        .sum_dim(0)
        .into_data()
        .convert::<f32>()
        .iter::<f32>()
        .map(|n| n > 0.0)
        .collect();
    // Never into the response window from the left, and at least one response column kept.
    // (The last prompt column predicts the first response token: always kept.)
    let lead = used
        .iter()
        .take((t - r).saturating_sub(1))
        .take_while(|u| !**u)
        .count();
    let tail = used.iter().rev().take(r - 1).take_while(|u| !**u).count();
    if lead == 0 && tail == 0 {
        return Ok((micro.clone(), 0));
    }
    // The response-wide columns first: once the input columns are cut, they could be as wide.
    let trimmed = micro
        .narrow_columns(r, 0, r - tail)
        .narrow_columns(t, lead, t - lead - tail);
    Ok((trimmed, tail))
}

/// `[rows, len]` outputs of a trimmed micro-batch with `tail` zero columns appended.
pub fn pad_response<B: Backend>(t: Tensor<B, 2>, tail: usize) -> Tensor<B, 2> {
    if tail == 0 {
        return t;
    }
    let [rows, _] = t.dims();
    let zeros = Tensor::zeros([rows, tail], &t.device());
    Tensor::cat(vec![t, zeros], 1)
}

/// Runs `per_micro` on each micro-batch of `data` (as `how` groups them, each trimmed of its
/// unused padding) and puts its `[rows, len]` outputs back together in `data`'s row order,
/// 0 at every padding position (trimmed or not): how the log-prob and value passes run.
pub fn map_micro_batches<B: ParallelBackend>(
    data: &DataProto<B>,
    how: MicroBatching,
    dp: Option<&dyn Communicator<B>>,
    mut per_micro: impl FnMut(&DataProto<B>) -> verl_core::Result<Vec<Tensor<B, 2>>>,
) -> verl_core::Result<Vec<Tensor<B, 2>>> {
    let groups = plan_micro_batches(data, how, dp)?;
    let mut outputs: Vec<Vec<Tensor<B, 2>>> = Vec::new();
    for rows in &groups {
        let (micro, tail) = trim_padding(&micro_batch(data, how, rows)?)?;
        // Padding positions read 0 whatever micro-batch a row landed in (a position trimmed
        // in one grouping is computed, as padding, in another).
        let mask = float_col(&micro, "attention_mask")?;
        let [_, t] = mask.dims();
        for (i, out) in per_micro(&micro)?.into_iter().enumerate() {
            if outputs.len() <= i {
                outputs.push(Vec::new());
            }
            let r = out.dims()[1];
            let out = out * mask.clone().narrow(1, t - r, r);
            outputs[i].push(pad_response(out, tail));
        }
    }
    let order: Vec<usize> = groups.concat();
    let in_order = order.iter().enumerate().all(|(i, &r)| i == r);
    let device = data_device(data)?;
    Ok(outputs
        .into_iter()
        .map(|parts| {
            let all = Tensor::cat(parts, 0);
            if in_order {
                return all;
            }
            let back = verl_core::batching::inverse(&order);
            all.select(0, crate::models::index_tensor(&back, &device))
        })
        .collect())
}

/// The micro-batches of a training mini-batch, as `how` groups them, each trimmed of its
/// unused padding (the loss reads only the columns left).
pub fn training_micro_batches<B: ParallelBackend>(
    mini: &DataProto<B>,
    how: MicroBatching,
    dp: Option<&dyn Communicator<B>>,
) -> verl_core::Result<Vec<DataProto<B>>> {
    plan_micro_batches(mini, how, dp)?
        .into_iter()
        .map(|rows| Ok(trim_padding(&micro_batch(mini, how, &rows)?)?.0))
        .collect()
}

/// The rows `rows` of `data` as one micro-batch (a slice when `how` made them consecutive).
fn micro_batch<B: ParallelBackend>(
    data: &DataProto<B>,
    how: MicroBatching,
    rows: &[usize],
) -> verl_core::Result<DataProto<B>> {
    Ok(match how {
        MicroBatching::Rows(_) => data.slice(rows[0], rows[rows.len() - 1] + 1)?,
        MicroBatching::Tokens { .. } => data.select_rows(rows)?,
    })
}
