//! Rotary position embedding tables, computed in f32 exactly as transformers does
//! (`inv_freq` in f32, angles `pos * inv_freq` in f32, then cos/sin).

use candle_core::{DType, Device, Result, Tensor};

use super::config::RopeScaling;

/// Inverse frequencies for `head_dim`, with the llama3 schedule applied when configured.
pub fn inv_freq(head_dim: usize, theta: f32, scaling: &RopeScaling) -> Vec<f32> {
    let base: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    match *scaling {
        RopeScaling::Default => base,
        RopeScaling::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old_ctx,
        } => {
            let low_freq_wavelen = old_ctx / low_freq_factor;
            let high_freq_wavelen = old_ctx / high_freq_factor;
            base.into_iter()
                .map(|f| {
                    // torch evaluates `scalar / tensor` as `tensor.reciprocal() * scalar`;
                    // mirror it so boundary decisions and smoothing match to the ulp.
                    let wavelen = (1.0 / f) * std::f32::consts::TAU;
                    if wavelen > low_freq_wavelen {
                        f / factor
                    } else if wavelen < high_freq_wavelen {
                        f
                    } else {
                        let smooth = ((1.0 / wavelen) * old_ctx - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

/// cos and sin tables of shape `[len, head_dim / 2]` (candle's `rope` repeats them over both
/// halves, which equals transformers' `cat(freqs, freqs)` + `rotate_half`).
pub struct RopeTables {
    cos: Tensor,
    sin: Tensor,
}

impl RopeTables {
    pub fn new(inv_freq: &[f32], len: usize, dtype: DType, device: &Device) -> Result<Self> {
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(len * half);
        let mut sin = Vec::with_capacity(len * half);
        for pos in 0..len {
            for &f in inv_freq {
                let angle = pos as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        // Rounded on the CPU, then uploaded: no GPU conversion kernel.
        let table = |v: Vec<f32>| -> Result<Tensor> {
            Tensor::from_vec(v, (len, half), &Device::Cpu)?
                .to_dtype(dtype)?
                .to_device(device)
        };
        let (cos, sin) = (table(cos)?, table(sin)?);
        Ok(Self { cos, sin })
    }

    /// The `[max_len, head_dim / 2]` cos and sin tables, in the compute dtype.
    pub fn tables(&self) -> (&Tensor, &Tensor) {
        (&self.cos, &self.sin)
    }

    /// Longest sequence the tables cover.
    pub fn max_len(&self) -> usize {
        self.cos.dims()[0]
    }

    /// Rotates `x` of shape `[1, heads, seq, head_dim]` (contiguous) for positions `0..seq`.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let seq = x.dims()[2];
        let cos = self.cos.narrow(0, 0, seq)?;
        let sin = self.sin.narrow(0, 0, seq)?;
        candle_nn::rotary_emb::rope(x, &cos, &sin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_schedule_matches_spec_regions() {
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let plain = inv_freq(64, 500000.0, &RopeScaling::Default);
        let scaled = inv_freq(64, 500000.0, &scaling);
        // Highest frequency (short wavelength) unchanged, lowest divided by the factor.
        assert_eq!(scaled[0], plain[0]);
        assert_eq!(scaled[31], plain[31] / 8.0);
        // Everything in between lies between the two.
        for (s, p) in scaled.iter().zip(&plain) {
            assert!(*s <= *p && *s >= p / 8.0);
        }
    }
}
