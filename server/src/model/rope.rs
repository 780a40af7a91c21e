//! Rotary position embeddings as transformers computes them: the `rope_parameters` schedules
//! (`inv_freq` in f32, from a base and schedule parameters in f64 where transformers keeps
//! Python floats), angles `pos * inv_freq` in f32, cos/sin times the schedule's attention factor.

use std::f64::consts::PI;

use candle_core::{DType, Device, Result, Tensor};

/// A RoPE base and its frequency schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub theta: f64,
    pub scaling: RopeScaling,
}

/// RoPE frequency schedule (`rope_type`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    Default,
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        factor: f32,
    },
    /// NTK-aware base stretch. transformers recomputes the base from the longest position a
    /// forward pass has seen once that passes `max_position_embeddings`, and keeps it until a
    /// shorter one comes: windows up to that length get this fixed base, longer ones are refused.
    DynamicNtk {
        factor: f64,
        max_position_embeddings: usize,
    },
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: f32,
    },
    /// YaRN: a ramp between interpolated and original frequencies over the dimensions that
    /// rotate between `beta_slow` and `beta_fast` times in the original context, and cos/sin
    /// scaled by `attention_factor`.
    Yarn {
        factor: f64,
        attention_factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        original_max_position_embeddings: f64,
        truncate: bool,
    },
    /// Gemma 4's `proportional`: the first `int(partial_rotary_factor * head_dim / 2)` pairs
    /// rotate with the default frequencies of the whole head (`base^(-2i / head_dim)`), the
    /// other pairs not at all (frequency 0: cos 1, sin 0); every frequency divided by `factor`.
    /// The pairs stay NeoX's `(i, i + head_dim / 2)`, unlike a partial rotary's leading block.
    Proportional {
        factor: f32,
        partial_rotary_factor: f64,
    },
}

impl Rope {
    /// Inverse frequencies for `head_dim`, as transformers' `ROPE_INIT_FUNCTIONS` compute them
    /// (torch's vectorised powf can be an ulp off the correctly rounded power used here).
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f32> {
        let theta = match self.scaling {
            RopeScaling::DynamicNtk {
                factor,
                max_position_embeddings,
            } => {
                // The base at `seq_len = max_position_embeddings`, Python float arithmetic.
                let (len, dim) = (max_position_embeddings as f64, head_dim as f64);
                self.theta * ((factor * len / len) - (factor - 1.0)).powf(dim / (dim - 2.0))
            }
            _ => self.theta,
        };
        // torch: `base ** (arange(0, dim, 2).float() / dim)` in f32, `1.0 / x` as a reciprocal.
        let powers: Vec<f32> = (0..head_dim / 2)
            .map(|i| (theta as f32).powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let base: Vec<f32> = powers.iter().map(|p| 1.0 / p).collect();
        match self.scaling {
            RopeScaling::Default | RopeScaling::DynamicNtk { .. } => base,
            RopeScaling::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
            RopeScaling::Proportional { factor, .. } => {
                let rotated = self.rotated_pairs(head_dim);
                base.into_iter()
                    .enumerate()
                    .map(|(i, f)| if i < rotated { f / factor } else { 0.0 })
                    .collect()
            }
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
            RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings: old_ctx,
                truncate,
                ..
            } => {
                let dim = head_dim as f64;
                // The dimension that rotates `rotations` times over the original context.
                let correction_dim = |rotations: f64| {
                    (dim * (old_ctx / (rotations * 2.0 * PI)).ln()) / (2.0 * self.theta.ln())
                };
                let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let low = low.max(0.0);
                let high = high.min(dim - 1.0);
                // transformers widens an empty ramp by 0.001 to avoid dividing by zero.
                let span = if low == high {
                    high + 0.001 - low
                } else {
                    high - low
                };
                let factor = factor as f32;
                powers
                    .iter()
                    .zip(base)
                    .enumerate()
                    .map(|(i, (&p, extrapolated))| {
                        let interpolated = 1.0 / (factor * p);
                        let ramp = ((i as f32 - low as f32) / span as f32).clamp(0.0, 1.0);
                        let keep = 1.0 - ramp;
                        interpolated * (1.0 - keep) + extrapolated * keep
                    })
                    .collect()
            }
        }
    }

    /// The pairs of a `head_dim` head that rotate (all but Gemma 4's proportional NoPE pairs).
    pub fn rotated_pairs(&self, head_dim: usize) -> usize {
        match self.scaling {
            // transformers: `int(rope_proportion * head_dim // 2)`, a float floor division
            RopeScaling::Proportional {
                partial_rotary_factor,
                ..
            } => ((partial_rotary_factor * head_dim as f64) / 2.0).floor() as usize,
            _ => head_dim / 2,
        }
    }

    /// What cos and sin are multiplied by (transformers' `attention_scaling`).
    pub fn attention_factor(&self) -> f32 {
        match self.scaling {
            RopeScaling::Yarn {
                attention_factor, ..
            } => attention_factor as f32,
            _ => 1.0,
        }
    }

    /// The longest window these frequencies hold for, where the schedule changes with length.
    pub fn longest_window(&self) -> Option<usize> {
        match self.scaling {
            RopeScaling::DynamicNtk {
                max_position_embeddings,
                ..
            } => Some(max_position_embeddings),
            _ => None,
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
    pub fn new(
        rope: &Rope,
        head_dim: usize,
        len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let inv_freq = rope.inv_freq(head_dim);
        let scale = rope.attention_factor();
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(len * half);
        let mut sin = Vec::with_capacity(len * half);
        for pos in 0..len {
            for &f in &inv_freq {
                let angle = pos as f32 * f;
                cos.push(angle.cos() * scale);
                sin.push(angle.sin() * scale);
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
        let rope = |scaling| Rope {
            theta: 500000.0,
            scaling,
        };
        let plain = rope(RopeScaling::Default).inv_freq(64);
        let scaled = rope(scaling).inv_freq(64);
        // Highest frequency (short wavelength) unchanged, lowest divided by the factor.
        assert_eq!(scaled[0], plain[0]);
        assert_eq!(scaled[31], plain[31] / 8.0);
        // Everything in between lies between the two.
        for (s, p) in scaled.iter().zip(&plain) {
            assert!(*s <= *p && *s >= p / 8.0);
        }
    }
}
