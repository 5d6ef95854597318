//! Reading verl's batch columns for a forward pass, and running the model over the response
//! window in micro-batches.

use burn::prelude::*;
use burn::tensor::{Int, TensorData};
use verl_core::traits::Communicator;
use verl_core::DataProto;

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
}

impl<B: ParallelBackend> ModelInputs<B> {
    pub fn from_batch(data: &DataProto<B>) -> verl_core::Result<Self> {
        let responses = data.int::<2>("responses")?;
        Ok(Self {
            input_ids: data.int::<2>("input_ids")?,
            attention_mask: float_col(data, "attention_mask")?,
            position_ids: data.int::<2>("position_ids")?,
            response_len: responses.dims()[1],
        })
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
        }
    }

    /// The model's outputs at the positions that predict each response token
    /// (`t − R − 1 .. t − 1`), `[batch, R, out]`.
    pub fn response_outputs(&self, model: &CausalLm<B>) -> Tensor<B, 3> {
        let t = self.input_ids.dims()[1];
        let r = self.response_len;
        model.forward_window(
            self.input_ids.clone(),
            Some(self.attention_mask.clone()),
            Some(self.position_ids.clone()),
            t - r - 1,
            r,
        )
    }
}

impl<B: ParallelBackend> ModelInputs<B> {
    /// [`Self::response_outputs`] for one pipeline stage: hidden states for the next stage,
    /// or on the last stage the response-window outputs.
    pub fn stage_outputs(&self, model: &CausalLm<B>, input: Option<Tensor<B, 3>>) -> Tensor<B, 3> {
        let t = self.input_ids.dims()[1];
        let r = self.response_len;
        model.forward_stage(
            input,
            self.input_ids.clone(),
            Some(self.attention_mask.clone()),
            Some(self.position_ids.clone()),
            t - r - 1,
            r,
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
        let [b, t] = self.input_ids.dims();
        let input = if me == 0 {
            None
        } else {
            let shape = model.stage_input_shape(b, t);
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
