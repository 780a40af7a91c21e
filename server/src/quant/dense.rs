//! Unquantized weights (bf16 / f16 / f32 `weight`).

use candle_core::{DType, Device, Result, Tensor};

use super::{to_f32_vec, QuantizedWeight, SCALE_DTYPES};
use crate::checkpoint::{Checkpoint, LoadError};

pub struct DenseWeight {
    weight: Tensor,
}

impl DenseWeight {
    pub fn load(
        ckpt: &Checkpoint,
        name: &str,
        (out, inp): (usize, usize),
        device: &Device,
    ) -> std::result::Result<Self, LoadError> {
        let weight = ckpt.tensor(
            &format!("{name}.weight"),
            SCALE_DTYPES,
            Some(&[out, inp]),
            device,
        )?;
        Ok(Self { weight })
    }

    /// Wraps an already loaded matrix (tied embeddings).
    pub fn from_tensor(weight: Tensor) -> Self {
        Self { weight }
    }
}

impl QuantizedWeight for DenseWeight {
    fn shape(&self) -> (usize, usize) {
        let d = self.weight.dims();
        (d[0], d[1])
    }

    fn describe(&self) -> String {
        format!("dense {:?}", self.weight.dtype()).to_lowercase()
    }

    fn bits_per_weight(&self) -> f64 {
        (self.weight.dtype().size_in_bytes() * 8) as f64
    }

    fn dequantize_f32(&self) -> Result<Vec<f32>> {
        to_f32_vec(&self.weight)
    }

    fn dequantize(&self, dtype: DType, device: &Device) -> Result<Tensor> {
        self.weight.to_dtype(dtype)?.to_device(device)
    }
}
