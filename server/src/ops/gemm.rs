//! The GEMM family. `x · wᵀ` for the Linears, whose rows are the tokens of every sequence of a batch: each row
//! must come out with the same bits whatever other rows share the call, so that a sequence
//! scores identically alone and in any batch.
//!
//! On the CPU candle multiplies with the `gemm` crate (0.19), whose general kernel sums every
//! output's products in an order that depends on `k` alone (depth blocks from the cache sizes;
//! rows and columns only split the work). Small problems take other kernels that sum in
//! other orders (gemm-common's `gemm_basic_generic`): a matrix-vector kernel for one row, a
//! "horizontal" kernel while rows × outputs ≤ 256, and 512-deep blocks while both are ≤ 64. A
//! batch of one or two tokens changed its numbers in the last bits. Below the sizes those
//! kernels cover, the input is padded with zero rows ([`cpu_rows`]) and the extra rows of the
//! product are dropped: a few rows more for a batch of a few tokens, nothing otherwise.
//! `server/tests/batch_invariance.rs` holds the rule to it.
//!
//! On a GPU in f32, cuBLAS picks its kernel by the shape, and some of them split k: up to 1e-5
//! between a sequence alone and batched. f32 runs ExactScore's own kernel instead
//! (kernels/gemm.cu), which sums each output in order over k whatever the shape
//! ([`matmul_t_sequential_fma`] is its reference). bf16 and f16 keep cuBLAS: bitwise invariant
//! as measured, and the fast path.

use candle_core::{DType, Result, Tensor};

use super::gpu_only;

super::gpu_entry_points!(gemm {
    fn matmul_t_f32(x: &Tensor, w: &Tensor) -> Result<Tensor>;
    fn matmul_t_add_into_rows(out: &Tensor, row0: usize, x: &Tensor, w: &Tensor) -> Result<()>;
    fn matmul_t_stacked_into_rows(out: &Tensor, row0: usize, x: &Tensor, w: &Tensor) -> Result<()>;
});

/// `x` (`[rows, k]`) times the transpose of `w` (`[n, k]`): `[rows, n]`.
pub fn matmul_t(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if x.device().is_cuda() && x.dtype() == DType::F32 {
        return gpu::matmul_t_f32(x, w);
    }
    let rows = x.dims()[0];
    let (n, k) = w.dims2()?;
    let needed = cpu_rows(n, k);
    if !x.device().is_cpu() || rows == 0 || rows >= needed {
        return x.matmul(&w.t()?);
    }
    let zeros = Tensor::zeros((needed - rows, k), x.dtype(), x.device())?;
    Tensor::cat(&[x, &zeros], 0)?
        .matmul(&w.t()?)?
        .narrow(0, 0, rows)
}

/// [`matmul_t`] of `x` cast to `w`'s dtype (a router that routes in f32 from the compute
/// dtype's hidden states). On the GPU an f32 `w` reads bf16/f16 `x` as the f32 values it holds
/// inside the f32 kernel, the same products as after a cast: a cast of 16384 rows into memory
/// took longer than the GEMM (0.32 against 0.19 ms on an H200).
pub fn matmul_t_cast(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if x.device().is_cuda() && w.dtype() == DType::F32 {
        return gpu::matmul_t_f32(x, w);
    }
    matmul_t(&x.to_dtype(w.dtype())?, w)
}

/// The fewest rows for which the CPU GEMM of `n` outputs over depth `k` takes its general
/// kernel (see the module documentation).
pub fn cpu_rows(n: usize, k: usize) -> usize {
    const HORIZONTAL_MAX_PRODUCT: usize = 16 * 16;
    const SMALL_DIM: usize = 64;
    const SMALL_KC: usize = 512;
    let mut rows = 2; // one row: the matrix-vector kernel
    rows = rows.max(HORIZONTAL_MAX_PRODUCT / n.max(1) + 1);
    if n <= SMALL_DIM && k > SMALL_KC {
        rows = rows.max(SMALL_DIM + 1);
    }
    rows
}

/// The CPU reference of the f32 GPU kernel: `x · wᵀ` (`x`: `m × k`, `w`: `n × k`, row-major)
/// with each output a fused multiply-add chain over k in order, from 0.
pub fn matmul_t_sequential_fma(x: &[f32], w: &[f32], (m, n, k): (usize, usize, usize)) -> Vec<f32> {
    let mut out = Vec::with_capacity(m * n);
    for row in x.chunks_exact(k).take(m) {
        for col in w.chunks_exact(k).take(n) {
            out.push(
                row.iter()
                    .zip(col)
                    .fold(0f32, |acc, (&a, &b)| a.mul_add(b, acc)),
            );
        }
    }
    out
}

/// Whether a mixture's experts run as batched GEMMs over their stacked weights
/// (`Mlp::forward_stacked`: a few launches per layer instead of several per expert) rather than
/// one by one: on a GPU in bf16/f16. f32 keeps one GEMM per expert, on the GPU kernel that sums
/// every output in one order ([`matmul_t`]).
pub fn stacks_experts(x: &Tensor) -> bool {
    x.device().is_cuda() && x.dtype() != DType::F32
}

/// Whether [`matmul_t_add_into_rows`] can add into `out`: a contiguous GPU tensor in bf16/f16.
pub fn adds_into_rows(out: &Tensor) -> bool {
    out.device().is_cuda() && out.is_contiguous() && matches!(out.dtype(), DType::BF16 | DType::F16)
}

/// Adds `x · wᵀ` to rows `row0..` of `out` in place, in the GEMM's epilogue (rounded once): a
/// GPU kernel only, for an `out` that [`adds_into_rows`] accepts.
pub fn matmul_t_add_into_rows(out: &Tensor, row0: usize, x: &Tensor, w: &Tensor) -> Result<()> {
    gpu_only("matmul_t_add_into_rows", out)?;
    gpu::matmul_t_add_into_rows(out, row0, x, w)
}

/// Writes `x_i · w_iᵀ` for each weight of `w` (`[g, n, k]`) and its `m`-row block of `x`
/// (`[g · m, k]`) into rows `row0..row0 + g · m` of `out`, as one batched GEMM: a GPU kernel
/// only, for an `out` that [`adds_into_rows`] accepts.
pub fn matmul_t_stacked_into_rows(out: &Tensor, row0: usize, x: &Tensor, w: &Tensor) -> Result<()> {
    gpu_only("matmul_t_stacked_into_rows", out)?;
    gpu::matmul_t_stacked_into_rows(out, row0, x, w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Every row of every row count from 1 to 80, for output widths and depths on both sides
    /// of each threshold, equals the same row computed in a call of 300 rows, bit for bit;
    /// and plain `matmul` does not (so the padding is what makes it so).
    #[test]
    fn each_row_is_independent_of_the_row_count() -> Result<()> {
        let dev = &Device::Cpu;
        let mut plain_differs = false;
        for (n, k) in [
            (1, 64),
            (16, 600),
            (64, 513),
            (100, 48),
            (128, 256),
            (256, 256),
            (257, 1000),
            (2000, 256),
        ] {
            let w = Tensor::randn(0f32, 1.0, (n, k), dev)?;
            let x = Tensor::randn(0f32, 1.0, (300, k), dev)?;
            let all = matmul_t(&x, &w)?.to_vec2::<f32>()?;
            for rows in 1..=80 {
                let part = x.narrow(0, 300 - rows, rows)?;
                let got = matmul_t(&part, &w)?.to_vec2::<f32>()?;
                assert_eq!(got[..], all[300 - rows..], "n {n} k {k} rows {rows}");
                let plain = part.matmul(&w.t()?)?.to_vec2::<f32>()?;
                plain_differs |= plain[..] != all[300 - rows..];
            }
        }
        assert!(
            plain_differs,
            "the unpadded GEMM no longer depends on the row count"
        );
        // bf16 inputs are widened to f32 by candle and take the same kernels.
        let w = Tensor::randn(0f32, 1.0, (128, 256), dev)?.to_dtype(DType::BF16)?;
        let x = Tensor::randn(0f32, 1.0, (40, 256), dev)?.to_dtype(DType::BF16)?;
        let all = matmul_t(&x, &w)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let one = matmul_t(&x.narrow(0, 39, 1)?, &w)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        assert_eq!(one[0], all[39]);
        Ok(())
    }
}
