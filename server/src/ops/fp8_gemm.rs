//! The fp8 tensor-core GEMM family: `QDQ(x) · Wᵀ` for an e4m3 weight with one scale per output
//! channel (or per tensor) and e4m3 activations (a dynamic scale per token, or a static one),
//! computed as vLLM serves such a layer: the activations quantized to e4m3 codes and one f32
//! scale per row ([`quantize_fp8_rows`]), the codes multiplied on the tensor cores with f32
//! sums, and each sum multiplied by its row's and its column's scale and rounded once to the
//! compute dtype ([`fp8_matmul_t`], cuBLASLt's fp8 GEMM with outer-vector scales).
//!
//! The product of two e4m3 values is exact in f32, and `code · scale` is the QDQ'd activation
//! bit for bit, so this computes the emulated layer (QDQ'd activations times the dequantized
//! weight) with f32 sums in another order and one rounding where the emulated bf16 path rounds
//! the activations, the weight and the sum. It runs on CUDA GPUs with fp8 tensor cores
//! (compute capability 8.9 and newer) in bf16/f16; the f32 path and the CPU keep the emulation.

use candle_core::{DType, Device, Result, Tensor};

use super::dequant::fp8_token_scale;
use super::gpu_only;
use super::minifloat::{fp8_e4m3_from_grid, round_to_fp8_e4m3, FP8_E4M3_MAX};

super::gpu_entry_points!(fp8_gemm {
    fn fp8_gemm_supported(device: &Device) -> Result<bool>;
    fn quantize_fp8_rows(x: &Tensor, static_scale: Option<f32>) -> Result<(Tensor, Tensor)>;
    fn fp8_matmul_t(
        x_codes: &Tensor,
        x_scales: &Tensor,
        w_codes: &Tensor,
        w_scales: &Tensor,
        dtype: DType,
    ) -> Result<Tensor>;
    fn fp8_matmul_t_into_rows(
        out: &Tensor,
        row0: usize,
        x_codes: &Tensor,
        x_scales: &Tensor,
        w_codes: &Tensor,
        w_scales: &Tensor,
        accumulate: bool,
    ) -> Result<()>;
});

/// Rows of activations as e4m3 codes (`[m, k]`, u8) and one f32 scale per row (`[m]`): row
/// `i` stands for `codes[i, :] · scales[i]`.
pub struct Fp8Rows {
    pub codes: Tensor,
    pub scales: Tensor,
}

/// An e4m3 weight as the GEMM reads it: codes `[n, k]` (u8) and one f32 scale per output
/// channel (`[n]`).
pub struct Fp8Columns<'a> {
    pub codes: &'a Tensor,
    pub scales: &'a Tensor,
}

/// Whether `device` runs [`fp8_matmul_t`]: a CUDA GPU with fp8 tensor cores.
pub fn fp8_tensor_cores(device: &Device) -> bool {
    device.is_cuda() && gpu::fp8_gemm_supported(device).unwrap_or(false)
}

/// `x` (`[m, k]`) quantized per row, with the scale `static_scale` or, where it is `None`, each
/// row's own (absmax / 448, as the per-token activation QDQ computes it). On a GPU, `x` is
/// bf16/f16 with k a multiple of 8.
pub fn quantize_fp8_rows(x: &Tensor, static_scale: Option<f32>) -> Result<Fp8Rows> {
    if x.device().is_cuda() {
        let (codes, scales) = gpu::quantize_fp8_rows(x, static_scale)?;
        return Ok(Fp8Rows { codes, scales });
    }
    let (m, k) = x.dims2()?;
    let values = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut codes = Vec::with_capacity(m * k);
    let mut scales = Vec::with_capacity(m);
    for row in values.chunks(k.max(1)).take(m) {
        let scale = static_scale.unwrap_or_else(|| fp8_token_scale(row));
        codes.extend(row.iter().map(|&v| {
            // as the activation QDQ computes it, up to the multiplication by the scale
            let q = (v / scale + 0.0).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX);
            fp8_e4m3_from_grid(round_to_fp8_e4m3(q))
        }));
        scales.push(scale);
    }
    Ok(Fp8Rows {
        codes: Tensor::from_vec(codes, (m, k), x.device())?,
        scales: Tensor::from_vec(scales, m, x.device())?,
    })
}

/// `x · wᵀ` scaled (`[m, n]` in `dtype`, bf16/f16), on a GPU with fp8 tensor cores.
pub fn fp8_matmul_t(x: &Fp8Rows, w: &Fp8Columns<'_>, dtype: DType) -> Result<Tensor> {
    gpu_only("fp8_matmul_t", &x.codes)?;
    gpu::fp8_matmul_t(&x.codes, &x.scales, w.codes, w.scales, dtype)
}

/// Adds [`fp8_matmul_t`] into rows `row0..` of `out` (`[rows, n]`, bf16/f16, contiguous):
/// the sum is rounded once.
pub fn fp8_matmul_t_add_into_rows(
    out: &Tensor,
    row0: usize,
    x: &Fp8Rows,
    w: &Fp8Columns<'_>,
) -> Result<()> {
    gpu_only("fp8_matmul_t_add_into_rows", out)?;
    gpu::fp8_matmul_t_into_rows(out, row0, &x.codes, &x.scales, w.codes, w.scales, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::minifloat::fp8_e4m3_to_f32;
    use crate::ops::ActivationQdq;

    /// Rows with zeros, ties, values beyond ±448 · scale and subnormal codes.
    fn rows() -> Tensor {
        let mut v: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.173 * (1.0 + (i % 7) as f32))
            .collect();
        v[3] = 0.0;
        v[5] = -0.0;
        v.extend(std::iter::repeat_n(0.0, 64));
        v.extend((0..64).map(|i| 1e-4 * i as f32 - 2e-3));
        Tensor::from_vec(v, (6, 64), &Device::Cpu).unwrap()
    }

    #[test]
    fn codes_times_scales_are_the_qdq_bit_for_bit() {
        let x = rows();
        for (static_scale, qdq) in [
            (None, ActivationQdq::Fp8PerToken),
            (Some(0.02), ActivationQdq::Fp8Static { scale: 0.02 }),
        ] {
            let q = quantize_fp8_rows(&x, static_scale).unwrap();
            let codes = q.codes.to_vec2::<u8>().unwrap();
            let scales = q.scales.to_vec1::<f32>().unwrap();
            let expected = qdq.apply(&x).unwrap().to_vec2::<f32>().unwrap();
            for (i, row) in codes.iter().enumerate() {
                for (j, &c) in row.iter().enumerate() {
                    let value = fp8_e4m3_to_f32(c) * scales[i];
                    assert_eq!(value.to_bits(), expected[i][j].to_bits(), "row {i} col {j}");
                }
            }
        }
    }

    #[test]
    fn the_gemm_refuses_the_cpu() {
        let q = quantize_fp8_rows(&rows(), None).unwrap();
        let w = Fp8Columns {
            codes: &q.codes,
            scales: &q.scales,
        };
        let err = fp8_matmul_t(&q, &w, DType::BF16).unwrap_err().to_string();
        assert!(err.contains("CUDA devices only"), "{err}");
    }
}
