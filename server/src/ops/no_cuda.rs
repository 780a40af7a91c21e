//! `crate::cuda`'s signatures for a build without the `cuda` feature. No CUDA device can be
//! opened in such a build, so no tensor reaches the kernels: each says so if called. The
//! device-level queries answer as for the CPU.

use candle_core::{bail, DType, Device, Result, Tensor};

fn no_cuda<T>() -> Result<T> {
    bail!("this build has no CUDA kernels (built without the `cuda` feature)")
}

/// A flash-attention kernel variant (none exists in this build).
#[derive(Debug, Clone, Copy)]
pub struct FlashTiling;

impl FlashTiling {
    pub fn for_device(_head_dim: usize, _device: &Device) -> Result<Self> {
        no_cuda()
    }
}

#[derive(Debug, Clone, Copy)]
pub struct FlashOptions {
    pub scale: f32,
    pub window: Option<usize>,
    pub tiling: FlashTiling,
}

pub struct RowScores {
    pub target_logprob: Vec<f32>,
    pub argmax: Vec<u32>,
    pub argmax_logprob: Vec<f32>,
    pub top_ids: Vec<u32>,
    pub top_logprobs: Vec<f32>,
}

pub struct KldRows {
    pub kld: Vec<f64>,
    pub logprob: Vec<f32>,
    pub reference_logprob: Vec<f32>,
    pub argmax: Vec<u32>,
    pub reference_argmax: Vec<u32>,
    pub reverse_kld: Vec<f64>,
    pub reference_top_p: Vec<f64>,
    pub top_k_agreement: Vec<u8>,
}

pub fn flash_attention_supported(_head_dim: usize, _dtype: DType) -> bool {
    false
}

pub fn rms_norm(_x: &Tensor, _weight: &Tensor, _eps: f32, _fp8_qdq: bool) -> Result<Tensor> {
    no_cuda()
}

pub fn silu_mul(_gate: &Tensor, _up: &Tensor, _fp8_qdq: bool) -> Result<Tensor> {
    no_cuda()
}

pub fn gelu_tanh_mul(_gate: &Tensor, _up: &Tensor, _fp8_qdq: bool) -> Result<Tensor> {
    no_cuda()
}

pub fn gather_rows(_table: &Tensor, _ids: &Tensor) -> Result<Tensor> {
    no_cuda()
}

pub const MOE_MAX_EXPERTS: usize = usize::MAX;

pub fn moe_topk(_logits: &Tensor, _k: usize, _norm: bool) -> Result<(Vec<u32>, Vec<f32>)> {
    no_cuda()
}

pub fn moe_combine(
    _y: &Tensor,
    _weights: &Tensor,
    _compute_dtype_weights: bool,
    _positions: &Tensor,
    _residual: &Tensor,
) -> Result<Tensor> {
    no_cuda()
}

pub fn row_pair_sums(_a: &Tensor, _b: &Tensor) -> Result<Vec<[f64; 4]>> {
    no_cuda()
}

pub fn with_tf32<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    f()
}

pub fn causal_softmax(
    _scores: &Tensor,
    _scale: f32,
    _window: Option<usize>,
    _dtype: DType,
) -> Result<Tensor> {
    no_cuda()
}

pub fn rope_rotate_half(
    _x: &Tensor,
    _positions: &Tensor,
    _cos: &Tensor,
    _sin: &Tensor,
) -> Result<Tensor> {
    no_cuda()
}

pub fn flash_attention(
    _q: &Tensor,
    _k: &Tensor,
    _v: &Tensor,
    _starts: &Tensor,
    _max_len: usize,
    _opts: &FlashOptions,
) -> Result<Tensor> {
    no_cuda()
}

pub fn score_rows(_logits: &Tensor, _targets: &[i32], _top_k: usize) -> Result<RowScores> {
    no_cuda()
}

pub fn kld_rows(_reference_logits: &Tensor, _logits: &Tensor, _targets: &[u32]) -> Result<KldRows> {
    no_cuda()
}

pub fn qdq_fp8(_x: &Tensor, _static_scale: Option<f32>) -> Result<Tensor> {
    no_cuda()
}

pub fn qdq_nvfp4(_x: &Tensor, _global_scale: f32) -> Result<Tensor> {
    no_cuda()
}

pub fn dequant_int(
    _codes: &Tensor,
    _scales: &Tensor,
    _zero_points: Option<&Tensor>,
    _shape: (usize, usize),
    _bits: usize,
    _group: usize,
    _dtype: DType,
) -> Result<Tensor> {
    no_cuda()
}

pub fn dequant_int_stacked(
    _weights: &[(&Tensor, &Tensor, Option<&Tensor>)],
    _shape: (usize, usize),
    _bits: usize,
    _group: usize,
    _dtype: DType,
) -> Result<Option<Tensor>> {
    no_cuda()
}

pub fn int4_gemm_applies(
    _weights: &[(&Tensor, &Tensor, Option<&Tensor>)],
    _shape: (usize, usize),
    _bits: usize,
    _group: usize,
    _dtype: DType,
) -> Result<bool> {
    no_cuda()
}

#[allow(clippy::too_many_arguments)]
pub fn matmul_t_int4_stacked_into_rows(
    _out: &Tensor,
    _row0: usize,
    _x: &Tensor,
    _weights: &[(&Tensor, &Tensor, Option<&Tensor>)],
    _rows: &[usize],
    _shape: (usize, usize),
    _group: usize,
    _tile_rows: Option<usize>,
) -> Result<()> {
    no_cuda()
}

pub fn dequant_nvfp4(
    _packed: &Tensor,
    _scales: &Tensor,
    _global_scale: f32,
    _shape: (usize, usize),
    _dtype: DType,
) -> Result<Tensor> {
    no_cuda()
}

pub fn dequant_fp8(
    _weight: &Tensor,
    _scales: &Tensor,
    _shape: (usize, usize),
    _block: (usize, usize),
    _dtype: DType,
) -> Result<Tensor> {
    no_cuda()
}

pub fn matmul_t_add_into_rows(_out: &Tensor, _row0: usize, _x: &Tensor, _w: &Tensor) -> Result<()> {
    no_cuda()
}

pub fn matmul_t_stacked_into_rows(
    _out: &Tensor,
    _row0: usize,
    _x: &Tensor,
    _w: &Tensor,
) -> Result<()> {
    no_cuda()
}

pub fn transfer(_t: &Tensor, _device: &Device) -> Result<Tensor> {
    no_cuda()
}

pub fn retain_freed_memory(_device: &Device) -> Result<()> {
    Ok(())
}

pub fn release_freed_memory(_device: &Device) -> Result<()> {
    Ok(())
}

pub fn bind(_device: &Device) -> Result<()> {
    Ok(())
}

pub fn enable_peer_access(_devices: &[&Device]) -> Result<Vec<(usize, usize)>> {
    Ok(Vec::new())
}

pub fn memory_total(_device: &Device) -> Result<Option<u64>> {
    Ok(None)
}
