//! Quantized Linear layers. [`load_linear`] is the only place that matches on formats; model
//! code holds a [`QuantLinear`] and never asks what is inside.

pub mod act_qdq;
pub mod auto_round;
pub mod awq;
pub mod compressed_tensors;
pub mod dense;
pub mod float_quantized;
pub mod fused_shards;
pub mod gptq;
pub mod hf_fp8;
pub mod kv_cache;
pub mod modelopt;
pub mod mxfp4;
pub mod nvfp4;
pub mod pack_quantized;

pub use crate::ops::minifloat;

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};
use safetensors::Dtype as StDtype;

use crate::checkpoint::{Checkpoint, LoadError};
use crate::ops::{self, StackRows};
pub use act_qdq::{ActivationQdq, ActivationQuantMode, Fp8Matmul};
pub use compressed_tensors::{Format, LayerScheme, QuantType, QuantizationConfig};
pub use kv_cache::{KvCacheDtype, KvCacheOptions, KvCacheQdq, KvCacheQuant, KvCacheScheme};

/// A weight matrix `[out, in]` stored in one format. Stays compressed in memory.
pub trait QuantizedWeight: Send + Sync {
    /// `(out_features, in_features)`.
    fn shape(&self) -> (usize, usize);
    /// Human-readable format name, e.g. `pack-quantized int4 g128 sym`.
    fn describe(&self) -> String;
    /// Bits stored per weight, scales and zero points included.
    fn bits_per_weight(&self) -> f64;
    /// The specification: the dequantized weight as compressed-tensors computes it for a float32
    /// model, row-major. Plain Rust over slices; the reference for every faster path.
    fn dequantize_f32(&self) -> Result<Vec<f32>>;
    /// The tensors a GPU dequantization kernel reads, for the formats that have one.
    fn packed(&self) -> Option<ops::Packed<'_>> {
        None
    }
    /// The dequantized weight `[out, in]` in `dtype` on the layer's device: by the format's
    /// GPU kernel where its [`Self::packed`] tensors lie on a GPU, else the reference.
    fn dequantize(&self, dtype: DType, device: &Device) -> Result<Tensor> {
        match self.packed() {
            Some(packed) => ops::dequantize(packed, self.shape(), dtype, || {
                self.dequantize_reference(dtype, device)
            }),
            None => self.dequantize_reference(dtype, device),
        }
    }
    /// [`Self::dequantize_f32`] rounded to `dtype` (nearest even) and moved to `device`.
    fn dequantize_reference(&self, dtype: DType, device: &Device) -> Result<Tensor> {
        let (out, inp) = self.shape();
        Tensor::from_vec(self.dequantize_f32()?, (out, inp), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)
    }
}

/// `y = QDQ(x) · Wᵀ (+ b)` for a weight in any supported format. A clone shares the weight.
#[derive(Clone)]
pub struct QuantLinear {
    weight: Arc<dyn QuantizedWeight>,
    bias: Option<Tensor>,
    activation: Option<ActivationQdq>,
    /// Set where the layer multiplies on the fp8 tensor cores: it then quantizes its own input
    /// (its [`Self::input_qdq`] is `None`).
    fp8_tensor_cores: Option<Arc<Fp8TensorCores>>,
}

/// A Linear's weight ready for several row chunks of one input ([`QuantLinear::prepared_like`]):
/// dequantized to the input's dtype, or nothing for a layer that multiplies its codes.
pub struct PreparedWeight(Option<Tensor>);

impl QuantLinear {
    pub fn new(weight: Box<dyn QuantizedWeight>, bias: Option<Tensor>) -> Self {
        Self {
            weight: Arc::from(weight),
            bias,
            activation: None,
            fp8_tensor_cores: None,
        }
    }

    /// `x`: `[tokens, in]` in the compute dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self.input_qdq() {
            Some(qdq) => self.forward_quantized(&qdq.apply(x)?),
            None => self.forward_quantized(x),
        }
    }

    /// `x · Wᵀ (+ b)` of an input that has been through this layer's [`Self::input_qdq`]
    /// already (see [`quantized_inputs`]).
    pub fn forward_quantized(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_prepared(x, &self.prepared_like(x)?)
    }

    /// The weight ready for `x`'s dtype and device, for several [`Self::forward_prepared`]
    /// calls (row chunks of one input) that share it.
    pub fn prepared_like(&self, x: &Tensor) -> Result<PreparedWeight> {
        Ok(PreparedWeight(match self.fp8_tensor_cores {
            Some(_) => None,
            None => Some(self.weight.dequantize(x.dtype(), x.device())?),
        }))
    }

    /// [`Self::forward_quantized`] with the weight [`Self::prepared_like`] gave.
    pub fn forward_prepared(&self, x: &Tensor, w: &PreparedWeight) -> Result<Tensor> {
        let y = match (&self.fp8_tensor_cores, &w.0) {
            (Some(fp8), _) => fp8.forward(x)?,
            (None, Some(w)) => ops::matmul_t(x, w)?,
            (None, None) => candle_core::bail!("a weight prepared for another layer"),
        };
        self.add_bias(y)
    }

    /// `x · Wᵀ (+ b)` of input rows already quantized as [`Self::fp8_input_scale`] says, for a
    /// layer on the fp8 tensor cores.
    pub fn forward_fp8_rows(&self, rows: &ops::Fp8Rows) -> Result<Tensor> {
        let Some(fp8) = &self.fp8_tensor_cores else {
            candle_core::bail!("fp8 rows given to a layer that is not on the fp8 tensor cores");
        };
        self.add_bias(ops::fp8_matmul_t(rows, &fp8.columns(), fp8.dtype)?)
    }

    /// `residual + x · Wᵀ (+ b)` of an input that has been through this layer's activation QDQ
    /// already: this layer's output added to the residual stream. See [`RowChunks`].
    pub fn add_to_residual(&self, residual: Tensor, x: &Tensor) -> Result<Tensor> {
        let mut out = self.row_chunks_added_to(residual)?;
        out.push(x, &self.prepared_like(x)?)?;
        out.finish()
    }

    /// [`Self::add_to_residual`] over an input whose `residual.dims()[0]` rows arrive in order
    /// as chunks through [`RowChunks::push`], each multiplied by the same dequantized weight.
    pub fn row_chunks_added_to(&self, residual: Tensor) -> Result<RowChunks<'_>> {
        let (out_features, _) = self.weight.shape();
        let rows = residual.dims()[0];
        if residual.dims() != [rows, out_features] {
            candle_core::bail!(
                "a residual stream {:?} for a layer of {out_features} outputs",
                residual.dims()
            );
        }
        let in_place = self.bias.is_none() && ops::adds_into_rows(&residual);
        Ok(RowChunks {
            linear: self,
            rows,
            filled: 0,
            residual,
            in_place,
            parts: Vec::new(),
        })
    }

    fn add_bias(&self, y: Tensor) -> Result<Tensor> {
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    pub fn weight(&self) -> &dyn QuantizedWeight {
        self.weight.as_ref()
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The activation QDQ the checkpoint declares for this layer's input (and that is applied).
    pub fn activation(&self) -> Option<&ActivationQdq> {
        self.activation.as_ref()
    }

    /// The activation QDQ that whatever feeds this layer applies to its input: [`Self::activation`],
    /// except for a layer on the fp8 tensor cores, which quantizes its input itself.
    pub fn input_qdq(&self) -> Option<&ActivationQdq> {
        match self.fp8_tensor_cores {
            Some(_) => None,
            None => self.activation.as_ref(),
        }
    }

    /// Whether this layer multiplies on the fp8 tensor cores ([`ops::fp8_gemm`]).
    pub fn on_fp8_tensor_cores(&self) -> bool {
        self.fp8_tensor_cores.is_some()
    }

    /// For a layer on the fp8 tensor cores, how it multiplies (`/info`).
    pub fn fp8_tensor_cores_summary(&self) -> Option<&'static str> {
        let fp8 = self.fp8_tensor_cores.as_ref()?;
        Some(match fp8.fast_accum && fp8.input.per_row().is_some() {
            true => "on the fp8 tensor cores, fast accumulation",
            false => "on the fp8 tensor cores",
        })
    }

    /// For a layer on the fp8 tensor cores, the scale its input rows are quantized with
    /// ([`ops::quantize_fp8_rows`]). Whatever produces the input may quantize it so and hand
    /// the rows to [`RowChunks::push_fp8_rows`].
    pub fn fp8_input_scale(&self) -> Option<ops::Fp8InputScale> {
        self.fp8_tensor_cores.as_ref().map(|fp8| fp8.input)
    }
}

/// A Linear with e4m3 weights (one scale per output channel or per tensor, with e4m3
/// activations per token or static; or one scale per 128 × 128 block, with activations per
/// token and 128 inputs) that multiplies on the fp8 tensor cores.
#[derive(Clone)]
struct Fp8TensorCores {
    codes: Tensor,
    /// f32, one per output channel (`[out]`) or per block (`[out / 128, in / 128]`).
    scales: Tensor,
    input: ops::Fp8InputScale,
    /// [`Fp8Matmul::TensorCoresFastAccum`].
    fast_accum: bool,
    /// The compute dtype, which the products are rounded to.
    dtype: DType,
}

impl Fp8TensorCores {
    /// The layer's settings where `opts` and the device let it run on the fp8 tensor cores:
    /// bf16/f16 compute on a GPU that has them, a weight and an activation scheme the GEMM
    /// computes as the emulation does, and shapes cuBLASLt's fp8 GEMM takes.
    fn for_layer(
        weight: &dyn QuantizedWeight,
        activation: Option<&ActivationQdq>,
        opts: &LinearOptions,
    ) -> Result<Option<Self>> {
        let Some(input) = activation.and_then(ops::Fp8InputScale::of) else {
            return Ok(None);
        };
        let (out, inp) = weight.shape();
        let applies = opts.fp8_matmul.on_tensor_cores()
            && matches!(opts.dtype, DType::BF16 | DType::F16)
            && inp.is_multiple_of(16)
            && out.is_multiple_of(8)
            && ops::fp8_tensor_cores(&opts.device);
        let Some(ops::Packed::Fp8 {
            weight: codes,
            scale,
            block,
        }) = weight.packed().filter(|_| applies)
        else {
            return Ok(None);
        };
        let b = ops::FP8_BLOCK;
        let scales = match (block, input) {
            (_, ops::Fp8InputScale::PerTokenGroup128 { .. }) => {
                // cuBLASLt's block scales: whole blocks
                if block != (b, b) || !out.is_multiple_of(b) || !inp.is_multiple_of(b) {
                    return Ok(None);
                }
                ops::fp8_block_scales_for_gemm(&scale.reshape((out / b, inp / b))?)?
            }
            ((1, cols), _) if cols == inp => scale.flatten_all()?,
            ((rows, cols), _) if (rows, cols) == (out, inp) => {
                scale.flatten_all()?.broadcast_as(out)?.contiguous()?
            }
            _ => return Ok(None),
        };
        Ok(Some(Self {
            codes: codes.clone(),
            scales,
            input,
            fast_accum: opts.fp8_matmul == Fp8Matmul::TensorCoresFastAccum,
            dtype: opts.dtype,
        }))
    }

    fn columns(&self) -> ops::Fp8Columns<'_> {
        ops::Fp8Columns {
            codes: &self.codes,
            scales: &self.scales,
            fast_accum: self.fast_accum,
        }
    }

    /// `QDQ(x) · Wᵀ` of the unquantized `x`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rows = ops::quantize_fp8_rows(x, self.input)?;
        ops::fp8_matmul_t(&rows, &self.columns(), x.dtype())
    }
}

/// A Linear's output added to the residual stream, over an input that arrives in row chunks.
/// It owns the stream: on a GPU in bf16/f16 without a bias, each chunk's GEMM adds its product
/// into the stream's own rows (cuBLAS's epilogue, beta = 1), so the sum is rounded once and
/// there is neither an output buffer nor a separate pass over the stream. Elsewhere the chunks'
/// products are rounded to the compute dtype, concatenated, and added (as PyTorch adds them; in
/// f32 the two ways give the same bits).
pub struct RowChunks<'a> {
    linear: &'a QuantLinear,
    rows: usize,
    filled: usize,
    residual: Tensor,
    in_place: bool,
    parts: Vec<Tensor>,
}

impl RowChunks<'_> {
    /// `x · wᵀ` for the next `x.dims()[0]` rows; `w` from [`QuantLinear::prepared_like`].
    pub fn push(&mut self, x: &Tensor, w: &PreparedWeight) -> Result<()> {
        if let Some(fp8) = &self.linear.fp8_tensor_cores {
            return self.push_fp8_rows(&ops::quantize_fp8_rows(x, fp8.input)?);
        }
        let row0 = self.take_rows(x.dims()[0])?;
        match &w.0 {
            Some(w) if self.in_place => ops::matmul_t_add_into_rows(&self.residual, row0, x, w)?,
            _ => self.parts.push(self.linear.forward_prepared(x, w)?),
        }
        Ok(())
    }

    /// [`Self::push`] of rows already quantized as the layer's [`QuantLinear::fp8_input_scale`]
    /// says, for a layer on the fp8 tensor cores.
    pub fn push_fp8_rows(&mut self, rows: &ops::Fp8Rows) -> Result<()> {
        let Some(fp8) = self.linear.fp8_tensor_cores.clone() else {
            candle_core::bail!("fp8 rows pushed into a layer that is not on the fp8 tensor cores");
        };
        let row0 = self.take_rows(rows.codes.dims()[0])?;
        if self.in_place {
            ops::fp8_matmul_t_add_into_rows(&self.residual, row0, rows, &fp8.columns())?;
        } else {
            let y = ops::fp8_matmul_t(rows, &fp8.columns(), self.residual.dtype())?;
            self.parts.push(self.linear.add_bias(y)?);
        }
        Ok(())
    }

    /// The first of the next `n` output rows, now counted as filled.
    fn take_rows(&mut self, n: usize) -> Result<usize> {
        if self.filled + n > self.rows {
            candle_core::bail!(
                "{} rows pushed into an output of {}",
                self.filled + n,
                self.rows
            );
        }
        self.filled += n;
        Ok(self.filled - n)
    }

    /// The residual stream with the whole output added.
    pub fn finish(mut self) -> Result<Tensor> {
        if self.filled != self.rows {
            candle_core::bail!("{} of {} output rows were computed", self.filled, self.rows);
        }
        if self.in_place {
            return Ok(self.residual);
        }
        let y = match self.parts.len() {
            1 => self.parts.remove(0),
            _ => Tensor::cat(&self.parts, 0)?,
        };
        self.residual + y
    }
}

/// [`QuantLinear::forward_prepared`] of each layer on its input (with the weight given, else
/// prepared just for this product: [`QuantLinear::forward_quantized`], so that no two layers'
/// dequantized weights are alive at once). Layers on the fp8 tensor cores that follow one
/// another and read the same input (one tensor, as q/k/v and gate/up do) with the same
/// activation scale quantize it once.
pub fn forward_prepared_all<const N: usize>(
    layers: [(&QuantLinear, &Tensor, Option<&PreparedWeight>); N],
) -> Result<[Tensor; N]> {
    let mut shared: Option<(candle_core::TensorId, ops::Fp8InputScale, ops::Fp8Rows)> = None;
    let mut out = Vec::with_capacity(N);
    for (linear, x, w) in layers {
        let Some(fp8) = &linear.fp8_tensor_cores else {
            out.push(match w {
                Some(w) => linear.forward_prepared(x, w)?,
                None => linear.forward_quantized(x)?,
            });
            continue;
        };
        let rows = match shared.take() {
            Some(same) if (same.0, same.1) == (x.id(), fp8.input) => same,
            _ => (x.id(), fp8.input, ops::quantize_fp8_rows(x, fp8.input)?),
        };
        out.push(linear.add_bias(ops::fp8_matmul_t(&rows.2, &fp8.columns(), x.dtype())?)?);
        shared = Some(rows);
    }
    Ok(out
        .try_into()
        .unwrap_or_else(|_| unreachable!("one output per layer")))
}

/// [`forward_prepared_all`] with each weight prepared for its own product.
pub fn forward_quantized_all<const N: usize>(
    layers: [(&QuantLinear, &Tensor); N],
) -> Result<[Tensor; N]> {
    forward_prepared_all(layers.map(|(l, x)| (l, x, None)))
}

/// The weights of `linears` (of one shape: a mixture's experts) dequantized into one `[linears,
/// out, in]` tensor in `dtype` on `device`, by one launch where the format allows it
/// ([`ops::dequantize_stacked`]).
pub fn dequantize_stacked(
    linears: &[&QuantLinear],
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let shape = linears.first().map_or((0, 0), |l| l.weight.shape());
    let packed: Vec<_> = linears.iter().map(|l| l.weight.packed()).collect();
    ops::dequantize_stacked(&packed, shape, dtype, |i| {
        linears[i].weight.dequantize(dtype, device)
    })
}

/// Rows per weight, on average, up to which a stack of int4 weights multiplies by the kernel
/// that decodes them inside the GEMM: above it, cuBLAS on the stack dequantized into memory is
/// faster (H100, Qwen3-30B-A3B's experts, `exactscore-bench moe-gemm`: 0.23 against 0.40 ms at
/// 128 rows per expert, 1.5 against 0.78 ms at 1024).
const DECODE_IN_GEMM_MAX_ROWS: usize = 256;

/// Whether [`matmul_t_stacked_into_rows`] multiplies `linears` (one shape: a mixture's experts),
/// `mean_rows` rows each on average, by the kernel that decodes int4 weights inside the GEMM,
/// which takes any number of rows per weight (no padding to a common count).
pub fn decodes_in_gemm(linears: &[&QuantLinear], mean_rows: usize, dtype: DType) -> Result<bool> {
    if mean_rows > DECODE_IN_GEMM_MAX_ROWS {
        return Ok(false);
    }
    let shape = linears.first().map_or((0, 0), |l| l.weight.shape());
    let packed: Vec<_> = linears.iter().map(|l| l.weight.packed()).collect();
    ops::decodes_int4_in_gemm(&packed, shape, dtype)
}

/// `x_z · w_zᵀ` for each of `linears` (one shape `[n, k]`: a mixture's experts) and its block of
/// rows of `x` (`[Σ rows, k]`, split by `rows`), as one `[Σ rows, n]` tensor: by the kernel that
/// decodes the weights inside the GEMM where [`decodes_in_gemm`], else (every block the same
/// size, counted on the host) the weights dequantized together and one batched GEMM.
pub fn matmul_t_stacked(linears: &[&QuantLinear], x: &Tensor, rows: StackRows) -> Result<Tensor> {
    let n = linears.first().map_or(0, |l| l.weight.shape().0);
    let total = rows.total();
    match dequantized_unless_decoded(linears, x, rows)? {
        Some(w) => {
            let m = total / linears.len().max(1);
            x.reshape((linears.len(), m, x.dim(1)?))?
                .matmul(&w.t()?)?
                .reshape((total, n))
        }
        None => {
            let y = ops::expert_rows(total, n, x)?;
            matmul_t_stacked_into_rows(linears, x, rows, &y, 0)?;
            Ok(y)
        }
    }
}

/// [`matmul_t_stacked`] written into rows `row0..` of `out` (a GPU tensor that
/// [`ops::adds_into_rows`] accepts).
pub fn matmul_t_stacked_into_rows(
    linears: &[&QuantLinear],
    x: &Tensor,
    rows: StackRows,
    out: &Tensor,
    row0: usize,
) -> Result<()> {
    match dequantized_unless_decoded(linears, x, rows)? {
        Some(w) => ops::matmul_t_stacked_into_rows(out, row0, x, &w),
        None => {
            let shape = linears.first().map_or((0, 0), |l| l.weight.shape());
            let packed: Vec<_> = linears.iter().map(|l| l.weight.packed()).collect();
            ops::matmul_t_int4_stacked_into_rows(out, row0, x, &packed, shape, rows)
        }
    }
}

/// `None` where `linears` decode inside the GEMM for these rows, else their weights dequantized
/// into one `[linears, n, k]` tensor (which needs blocks of one size, counted on the host).
fn dequantized_unless_decoded(
    linears: &[&QuantLinear],
    x: &Tensor,
    rows: StackRows,
) -> Result<Option<Tensor>> {
    if decodes_in_gemm(linears, rows.mean(linears.len()), x.dtype())? {
        return Ok(None);
    }
    match rows {
        StackRows::Counts(rows) if rows.windows(2).all(|w| w[0] == w[1]) => {}
        StackRows::Counts(_) => candle_core::bail!(
            "stacked GEMM: blocks of different sizes need weights that decode in the GEMM"
        ),
        StackRows::Planned(_) => candle_core::bail!(
            "stacked GEMM: a plan made on the GPU needs weights that decode in the GEMM"
        ),
    }
    Ok(Some(dequantize_stacked(linears, x.dtype(), x.device())?))
}

/// What the layers that read one tensor (q/k/v, gate/up) let the op that produces it apply
/// for all of them, in its own kernel.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SharedInput<'a> {
    /// Nothing: each layer prepares its input itself.
    Separate,
    /// One activation QDQ ([`common_qdq`]; `None`: none of them quantizes its input).
    Qdq(Option<&'a ActivationQdq>),
    /// All on the fp8 tensor cores with one input scale per row: the producer may write their
    /// e4m3 codes ([`QuantLinear::forward_fp8_rows`]).
    Fp8Rows(ops::Fp8InputScale),
}

/// [`SharedInput`] of `linears`.
pub fn shared_input<'a>(linears: &[&'a QuantLinear]) -> SharedInput<'a> {
    if let Some(qdq) = common_qdq(linears) {
        return SharedInput::Qdq(qdq);
    }
    let scales: Vec<_> = linears.iter().map(|l| l.fp8_input_scale()).collect();
    match scales.first() {
        Some(&Some(scale))
            if scale.per_row().is_some() && scales.iter().all(|&s| s == Some(scale)) =>
        {
            SharedInput::Fp8Rows(scale)
        }
        _ => SharedInput::Separate,
    }
}

/// The activation QDQ that every layer of `linears` applies to its input, when they all apply
/// the same one (`Some(None)`: none of them quantizes its input); `None` when they differ, or
/// when one quantizes its input on the fp8 tensor cores (the stacked experts' GEMMs do not).
/// Where it is `Some`, whatever produces the shared input may apply it once (fused into its own
/// kernel), and each layer then runs [`QuantLinear::forward_quantized`].
pub fn common_qdq<'a>(linears: &[&'a QuantLinear]) -> Option<Option<&'a ActivationQdq>> {
    if linears.iter().any(|l| l.on_fp8_tensor_cores()) {
        return None;
    }
    let first = linears.first()?.activation.as_ref();
    linears[1..]
        .iter()
        .all(|l| l.activation.as_ref() == first)
        .then_some(first)
}

/// The inputs of several layers that read the same `x` (q/k/v, gate/up), each through its own
/// activation QDQ (or `x` itself for a weights-only layer), for
/// [`QuantLinear::forward_quantized`]. A layer whose QDQ equals the previous layer's (same
/// scheme and scale: every per-token dynamic fp8 scheme, and static scales that calibration
/// made equal) shares that quantized input instead of computing it again, so the results are
/// identical to separate [`QuantLinear::forward`]s.
pub fn quantized_inputs<const N: usize>(
    linears: [&QuantLinear; N],
    x: &Tensor,
) -> Result<[Tensor; N]> {
    let mut last: Option<(&ActivationQdq, Tensor)> = None;
    let mut inputs = Vec::with_capacity(N);
    for linear in linears {
        let input = match linear.input_qdq() {
            None => x.clone(),
            Some(qdq) => {
                let input = match last.take() {
                    Some((prev, input)) if prev == qdq => input,
                    _ => qdq.apply(x)?,
                };
                last = Some((qdq, input.clone()));
                input
            }
        };
        inputs.push(input);
    }
    Ok(inputs
        .try_into()
        .unwrap_or_else(|_| unreachable!("one input per layer")))
}

/// Where and how layers are materialised.
#[derive(Debug, Clone)]
pub struct LinearOptions {
    pub device: Device,
    pub dtype: DType,
    pub activation_quant: ActivationQuantMode,
    pub kv_cache: KvCacheOptions,
    pub fp8_matmul: Fp8Matmul,
    pub fused_fp8_scales: fused_shards::FusedFp8Scales,
}

/// Loads the Linear `name` (`name.weight` or its compressed tensors, optional `name.bias`).
/// Checks every tensor and refuses any tensor under `name.` it would not use.
pub fn load_linear(
    ckpt: &Checkpoint,
    name: &str,
    (out, inp): (usize, usize),
    bias: bool,
    scheme: Option<&LayerScheme>,
    opts: &LinearOptions,
) -> std::result::Result<QuantLinear, LoadError> {
    let dev = &opts.device;
    // A GPTQ, AWQ or FP8 config does not list the Linears it quantized: their `qweight`s
    // (`weight_scale_inv`s) do.
    let scheme = scheme.filter(|s| match s.format {
        Format::Gptq | Format::GptqV2 | Format::Awq => {
            ckpt.contains(&format!("{name}.qweight")) || !ckpt.contains(&format!("{name}.weight"))
        }
        Format::HfFp8 => ckpt.contains(&format!("{name}.{}", hf_fp8::SCALE)),
        _ => true,
    });
    let (weight, mut used): (Box<dyn QuantizedWeight>, Vec<&str>) = match scheme {
        None => (
            Box::new(dense::DenseWeight::load(ckpt, name, (out, inp), dev)?),
            vec!["weight"],
        ),
        Some(s) => match s.format {
            Format::PackQuantized | Format::IntQuantized => (
                Box::new(pack_quantized::IntWeight::load(
                    ckpt,
                    name,
                    (out, inp),
                    s,
                    dev,
                )?),
                vec![
                    pack_quantized::codes_tensor(s.format),
                    "weight_scale",
                    "weight_zero_point",
                    "weight_shape",
                    if s.weights.actorder {
                        "weight_g_idx"
                    } else {
                        "weight_scale"
                    },
                ],
            ),
            Format::Gptq | Format::GptqV2 => (
                Box::new(gptq::load(ckpt, name, (out, inp), s, dev)?),
                gptq::TENSORS.to_vec(),
            ),
            Format::Awq => (
                Box::new(awq::load(ckpt, name, (out, inp), s, dev)?),
                awq::TENSORS.to_vec(),
            ),
            Format::Nvfp4PackQuantized => (
                Box::new(nvfp4::Nvfp4Weight::load(ckpt, name, (out, inp), dev)?),
                vec!["weight_packed", "weight_scale", "weight_global_scale"],
            ),
            Format::ModeloptNvfp4 => (
                Box::new(nvfp4::Nvfp4Weight::load_modelopt(
                    ckpt,
                    name,
                    (out, inp),
                    dev,
                )?),
                vec!["weight", "weight_scale", "weight_scale_2"],
            ),
            Format::Mxfp4PackQuantized => (
                Box::new(mxfp4::Mxfp4Weight::load(ckpt, name, (out, inp), dev)?),
                vec!["weight_packed", "weight_scale"],
            ),
            Format::FloatQuantized | Format::HfFp8 | Format::ModeloptFp8 => (
                Box::new(float_quantized::Fp8Weight::load(
                    ckpt,
                    name,
                    (out, inp),
                    s,
                    || fused_shards::served_weight_scale(ckpt, name, s, opts.fused_fp8_scales),
                    dev,
                )?),
                vec!["weight", float_quantized::scale_tensor(s.format)],
            ),
        },
    };
    let bias = if bias {
        used.push("bias");
        Some(ckpt.tensor_as(
            &format!("{name}.bias"),
            &[StDtype::BF16, StDtype::F16, StDtype::F32],
            Some(&[out]),
            opts.dtype,
            dev,
        )?)
    } else {
        None
    };
    let activation = match scheme.and_then(|s| s.input_activations.as_ref()) {
        // W4A8-FP8: vLLM's kernels for integer weights with fp8 activations first convert the
        // group scales to fp8 (`convert_bf16_scales_to_fp8`), which is not emulated.
        Some(args)
            if args.kind == QuantType::Float
                && scheme.is_some_and(|s| s.weights.kind == QuantType::Int)
                && opts.activation_quant == ActivationQuantMode::Emulate =>
        {
            return Err(LoadError::Unsupported {
                layer: name.into(),
                field: "input_activations".into(),
                reason: "integer weights with fp8 activations (W4A8-FP8): vLLM's kernels convert \
                         the weights' group scales to fp8, which is not emulated; \
                         --activation-quant off scores the stored weights with unquantized \
                         activations"
                    .into(),
            });
        }
        Some(args) => {
            used.extend(["input_global_scale", "input_scale", "input_zero_point"]);
            let qdq = match scheme {
                Some(s) if s.format == Format::ModeloptNvfp4 => modelopt::input_qdq(ckpt, name)?,
                Some(s) => match ActivationQdq::load(ckpt, name, args)? {
                    ActivationQdq::Fp8Static { .. } => ActivationQdq::Fp8Static {
                        scale: fused_shards::served_input_scale(
                            ckpt,
                            name,
                            s,
                            opts.fused_fp8_scales,
                        )?,
                    },
                    qdq => qdq,
                },
                None => unreachable!("activations come with a scheme"),
            };
            (opts.activation_quant == ActivationQuantMode::Emulate).then_some(qdq)
        }
        None => None,
    };
    let prefix = format!("{name}.");
    if let Some(extra) = ckpt
        .names_with_prefix(&prefix)
        .find(|n| !used.contains(&&n[prefix.len()..]))
    {
        return Err(LoadError::BadTensor {
            name: extra.into(),
            reason: format!(
                "unexpected for {} (unsupported feature such as g_idx or a second weight?)",
                scheme.map_or("an unquantized layer", |s| s.format.name())
            ),
        });
    }
    let fp8_tensor_cores =
        Fp8TensorCores::for_layer(weight.as_ref(), activation.as_ref(), opts)?.map(Arc::new);
    Ok(QuantLinear {
        weight: Arc::from(weight),
        bias,
        activation,
        fp8_tensor_cores,
    })
}

/// Reads a small float tensor (scales) as f32 values.
pub(crate) fn to_f32_vec(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()
}

/// Float dtypes a scale may be stored in.
pub(crate) const SCALE_DTYPES: &[StDtype] = &[StDtype::BF16, StDtype::F16, StDtype::F32];

/// Loads a tensor holding exactly one f32 (a global scale).
pub(crate) fn load_scalar(ckpt: &Checkpoint, name: &str) -> std::result::Result<f32, LoadError> {
    let t = ckpt.tensor(name, SCALE_DTYPES, None, &Device::Cpu)?;
    if t.elem_count() != 1 {
        return Err(LoadError::WrongShape {
            name: name.into(),
            found: t.dims().to_vec(),
            expected: vec![1],
        });
    }
    let v = to_f32_vec(&t)?[0];
    if !v.is_finite() || v == 0.0 {
        return Err(LoadError::BadTensor {
            name: name.into(),
            reason: format!("global scale must be finite and non-zero, found {v}"),
        });
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn linear(seed: u64, activation: Option<ActivationQdq>) -> Result<QuantLinear> {
        let w = Tensor::rand(-1f32, 1f32, (8, 32), &Device::Cpu)?;
        let w = (w + seed as f64)?.affine(0.5, 0.0)?;
        Ok(QuantLinear {
            weight: Arc::new(dense::DenseWeight::from_tensor(w)),
            bias: None,
            activation,
            fp8_tensor_cores: None,
        })
    }

    /// A layer on the fp8 tensor cores quantizes its own input: nothing upstream may apply its
    /// QDQ (norms fuse none for it, stacked experts never share one), though `/info` still
    /// reports the scheme.
    #[test]
    fn a_layer_on_the_fp8_tensor_cores_takes_its_input_unquantized() -> Result<()> {
        let qdq = ActivationQdq::Fp8Static { scale: 0.5 };
        let mut on_cores = linear(0, Some(qdq.clone()))?;
        let codes = Tensor::zeros((8, 32), DType::U8, &Device::Cpu)?;
        on_cores.fp8_tensor_cores = Some(Arc::new(Fp8TensorCores {
            codes,
            scales: Tensor::ones(8, DType::F32, &Device::Cpu)?,
            input: ops::Fp8InputScale::Static(0.5),
            fast_accum: false,
            dtype: DType::BF16,
        }));
        let emulated = linear(1, Some(qdq.clone()))?;
        assert_eq!(on_cores.activation(), Some(&qdq));
        assert_eq!(on_cores.input_qdq(), None);
        assert_eq!(
            on_cores.fp8_input_scale(),
            Some(ops::Fp8InputScale::Static(0.5))
        );
        assert_eq!(emulated.input_qdq(), Some(&qdq));
        assert_eq!(emulated.fp8_input_scale(), None);
        assert_eq!(common_qdq(&[&emulated, &emulated]), Some(Some(&qdq)));
        assert_eq!(common_qdq(&[&on_cores, &on_cores]), None);
        assert_eq!(common_qdq(&[&emulated, &on_cores]), None);
        // the norm writes codes only for layers that all take the same per-row scale
        let static_fp8 = SharedInput::Fp8Rows(ops::Fp8InputScale::Static(0.5));
        assert_eq!(shared_input(&[&on_cores, &on_cores]), static_fp8);
        assert_eq!(shared_input(&[&on_cores, &emulated]), SharedInput::Separate);
        assert_eq!(
            shared_input(&[&emulated, &emulated]),
            SharedInput::Qdq(Some(&qdq))
        );
        let mut other_scale = on_cores.clone();
        other_scale.fp8_tensor_cores = Some(Arc::new(Fp8TensorCores {
            input: ops::Fp8InputScale::Static(0.25),
            ..(**on_cores.fp8_tensor_cores.as_ref().unwrap()).clone()
        }));
        assert_eq!(
            shared_input(&[&on_cores, &other_scale]),
            SharedInput::Separate
        );
        let mut per_group = on_cores.clone();
        per_group.fp8_tensor_cores = Some(Arc::new(Fp8TensorCores {
            input: ops::Fp8InputScale::PerTokenGroup128 {
                power_of_two: false,
            },
            ..(**on_cores.fp8_tensor_cores.as_ref().unwrap()).clone()
        }));
        assert_eq!(
            shared_input(&[&per_group, &per_group]),
            SharedInput::Separate
        );
        // its input reaches it as it is
        let x = Tensor::randn(0f32, 3f32, (5, 32), &Device::Cpu)?;
        let [a, b] = quantized_inputs([&on_cores, &emulated], &x)?;
        assert_eq!(a.to_vec2::<f32>()?, x.to_vec2::<f32>()?);
        assert_eq!(b.to_vec2::<f32>()?, qdq.apply(&x)?.to_vec2::<f32>()?);
        Ok(())
    }

    #[test]
    fn sharing_the_input_gives_each_layer_its_own_qdq() -> Result<()> {
        let x = Tensor::randn(0f32, 3f32, (5, 32), &Device::Cpu)?;
        let nvfp4 = |global_scale| Some(ActivationQdq::Nvfp4 { global_scale });
        // Two global scales whose QDQs differ: reusing the first for the second would show.
        assert_ne!(
            nvfp4(448.0).unwrap().apply(&x)?.to_vec2::<f32>()?,
            nvfp4(5.0).unwrap().apply(&x)?.to_vec2::<f32>()?
        );
        let layers = [
            linear(0, nvfp4(448.0))?,
            linear(1, nvfp4(448.0))?,
            linear(2, nvfp4(5.0))?,
            linear(3, None)?,
            linear(4, Some(ActivationQdq::Fp8PerToken))?,
            linear(5, Some(ActivationQdq::Fp8PerToken))?,
        ];
        let inputs = quantized_inputs(
            [
                &layers[0], &layers[1], &layers[2], &layers[3], &layers[4], &layers[5],
            ],
            &x,
        )?;
        for (layer, input) in layers.iter().zip(&inputs) {
            assert_eq!(
                layer.forward_quantized(input)?.to_vec2::<f32>()?,
                layer.forward(&x)?.to_vec2::<f32>()?
            );
        }
        Ok(())
    }
}
