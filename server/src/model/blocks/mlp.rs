//! The gated MLP (SwiGLU or GeGLU) of a dense feed-forward, and of each expert of a mixture
//! ([`super::Moe`]), which runs its experts stacked ([`forward_stacked`]).

use candle_core::{DType, Device, Result, Tensor};

use super::{forward_fp8_rows_all, layer_inputs, Normed};
use crate::checkpoint::LoadError;
use crate::model::config::Activation;
use crate::model::loader::Loader;
use crate::model::profile::stage;
use crate::ops::{self, StackRows};
use crate::quant::dense::DenseWeight;
use crate::quant::mxfp4::{self, Mxfp4Weight};
use crate::quant::{
    common_qdq, decodes_in_gemm, forward_prepared_all, matmul_t_stacked,
    matmul_t_stacked_into_rows, shared_input, QuantLinear, QuantizedWeight, SharedInput,
    SCALE_DTYPES,
};

/// Rows of the MLP input processed at once. The `[rows, intermediate]` activations (gate, up
/// and their product) are the largest tensors of a forward pass (3.5 residual streams each for
/// Llama-3-8B); chunks bound them, while each weight is still dequantized once per forward.
pub const MLP_CHUNK: usize = 2048;

/// `down(act(gate(x)) * up(x))`.
#[derive(Clone)]
pub struct Mlp {
    gate_proj: QuantLinear,
    up_proj: QuantLinear,
    down_proj: QuantLinear,
    act: Activation,
}

/// Names of the gate, up and down projections in most checkpoints.
pub const PROJ_NAMES: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

impl Mlp {
    /// The MLP whose projections `vb` names `names` (gate, up, down), between `hidden` and
    /// `intermediate` features.
    pub fn load(
        vb: &Loader,
        names: [&str; 3],
        (hidden, intermediate): (usize, usize),
        bias: bool,
        act: Activation,
    ) -> std::result::Result<Self, LoadError> {
        let [gate, up, down] = names;
        Ok(Self {
            gate_proj: vb.linear(gate, (intermediate, hidden), bias)?,
            up_proj: vb.linear(up, (intermediate, hidden), bias)?,
            down_proj: vb.linear(down, (hidden, intermediate), bias)?,
            act,
        })
    }

    /// The experts of a mixture stored fused, as transformers keeps them (Qwen3.5-MoE's bf16
    /// releases): `{vb}.gate_up_proj` `[experts, 2 * intermediate, hidden]` (each expert's gate
    /// rows first, then its up rows) and `{vb}.down_proj` `[experts, hidden, intermediate]`,
    /// read in their stored dtype (as a dense Linear's weight is) and split into one dense
    /// MLP per expert. `F.linear` of the fused gate/up rows computes each output as the two
    /// Linears do.
    pub fn load_fused(
        vb: &Loader,
        experts: usize,
        (hidden, intermediate): (usize, usize),
        act: Activation,
    ) -> std::result::Result<Vec<Self>, LoadError> {
        let ckpt = vb.checkpoint();
        let read = |name: &str, shape: &[usize]| {
            ckpt.tensor(&vb.name(name), SCALE_DTYPES, Some(shape), &Device::Cpu)
        };
        let gate_up = read("gate_up_proj", &[experts, 2 * intermediate, hidden])?;
        let down = read("down_proj", &[experts, hidden, intermediate])?;
        let device = &vb.options().device;
        let dense = |w: Tensor| -> std::result::Result<QuantLinear, LoadError> {
            let w = w.contiguous()?.to_device(device)?;
            Ok(QuantLinear::new(
                Box::new(DenseWeight::from_tensor(w)),
                None,
            ))
        };
        (0..experts)
            .map(|e| {
                let gu = gate_up.get(e)?;
                Ok(Self {
                    gate_proj: dense(gu.narrow(0, 0, intermediate)?)?,
                    up_proj: dense(gu.narrow(0, intermediate, intermediate)?)?,
                    down_proj: dense(down.get(e)?)?,
                    act,
                })
            })
            .collect()
    }

    /// gpt-oss's experts under `vb` (`mlp.experts`), stored fused with their biases, gate and
    /// up interleaved (`gate_up[..., ::2]` gate, `[..., 1::2]` up): bf16 `gate_up_proj`
    /// `[experts, hidden, 2 * intermediate]` and `down_proj` `[experts, intermediate, hidden]`
    /// (transformers' `x @ w` layout, transposed here to Linears'), or their native MXFP4
    /// `*_blocks` / `*_scales` (already `[out, in]` per expert, kept compressed); and
    /// `gate_up_proj_bias` `[experts, 2 * intermediate]`, `down_proj_bias` `[experts, hidden]`.
    ///
    /// llm-compressor writes them per expert instead (`{vb}.E.{gate,up,down}_proj`, its
    /// `GptOssExpertMLP`: the interleaved columns already split, each Linear with its bias, in
    /// any format the quantization config gives).
    pub fn load_gpt_oss(
        vb: &Loader,
        experts: usize,
        (hidden, intermediate): (usize, usize),
    ) -> std::result::Result<Vec<Self>, LoadError> {
        let (ckpt, device) = (vb.checkpoint(), &vb.options().device);
        let per_expert = vb.pp(0).pp("gate_proj");
        if ckpt
            .names_with_prefix(&format!("{}.", per_expert.prefix()))
            .next()
            .is_some()
        {
            let act = Activation::ClampedSwiglu;
            return (0..experts)
                .map(|e| Self::load(&vb.pp(e), PROJ_NAMES, (hidden, intermediate), true, act))
                .collect();
        }
        let blocks = vb.name("gate_up_proj_blocks");
        let (gate_up, down) = if ckpt.contains(&blocks) {
            if !vb.native_mxfp4() {
                return Err(LoadError::BadTensor {
                    name: blocks,
                    reason: "gpt-oss's native MXFP4 experts need quantization_config.quant_method \
                             \"mxfp4\""
                        .into(),
                });
            }
            let load = |name: &str, shape, parts| -> std::result::Result<Vec<Vec<_>>, LoadError> {
                let weights = mxfp4::load_native_experts(
                    ckpt,
                    &vb.name(name),
                    experts,
                    shape,
                    parts,
                    device,
                )?;
                let boxed = |w: Mxfp4Weight| Box::new(w) as Box<dyn QuantizedWeight>;
                Ok(weights
                    .into_iter()
                    .map(|e| e.into_iter().map(boxed).collect())
                    .collect())
            };
            (
                load("gate_up_proj", (2 * intermediate, hidden), 2)?,
                load("down_proj", (hidden, intermediate), 1)?,
            )
        } else {
            let read = |name: &str, shape: &[usize]| {
                ckpt.tensor(&vb.name(name), SCALE_DTYPES, Some(shape), &Device::Cpu)
            };
            let gate_up = read("gate_up_proj", &[experts, hidden, 2 * intermediate])?;
            let down = read("down_proj", &[experts, intermediate, hidden])?;
            let dense = |w: Tensor| -> Result<Box<dyn QuantizedWeight>> {
                let w = w.t()?.contiguous()?.to_device(device)?;
                Ok(Box::new(DenseWeight::from_tensor(w)))
            };
            let mut fused = (Vec::with_capacity(experts), Vec::with_capacity(experts));
            for e in 0..experts {
                let pairs = gate_up.get(e)?.reshape((hidden, intermediate, 2))?;
                let part = |p| dense(pairs.narrow(2, p, 1)?.squeeze(2)?);
                fused.0.push(vec![part(0)?, part(1)?]);
                fused.1.push(vec![dense(down.get(e)?)?]);
            }
            fused
        };
        let gate_up_bias = vb.get("gate_up_proj_bias", &[experts, 2 * intermediate])?;
        let down_bias = vb.get("down_proj_bias", &[experts, hidden])?;
        let linear = |w, b: Tensor| -> Result<QuantLinear> {
            Ok(QuantLinear::new(w, Some(b.contiguous()?)))
        };
        gate_up
            .into_iter()
            .zip(down)
            .enumerate()
            .map(|(e, (gate_up, down))| {
                let [gate, up]: [Box<dyn QuantizedWeight>; 2] = gate_up
                    .try_into()
                    .unwrap_or_else(|_| unreachable!("two parts"));
                let [down]: [Box<dyn QuantizedWeight>; 1] =
                    down.try_into().unwrap_or_else(|_| unreachable!("one part"));
                let bias = gate_up_bias.get(e)?.reshape((intermediate, 2))?;
                Ok(Self {
                    gate_proj: linear(gate, bias.narrow(1, 0, 1)?.squeeze(1)?)?,
                    up_proj: linear(up, bias.narrow(1, 1, 1)?.squeeze(1)?)?,
                    down_proj: linear(down, down_bias.get(e)?)?,
                    act: Activation::ClampedSwiglu,
                })
            })
            .collect()
    }

    /// What the norm that feeds gate and up may apply for them ([`shared_input`]).
    pub fn shared_input(&self) -> SharedInput<'_> {
        shared_input(&[&self.gate_proj, &self.up_proj])
    }

    /// The projections with the names transformers gives them.
    pub fn linears(&self) -> [(&'static str, &QuantLinear); 3] {
        [
            ("gate_proj", &self.gate_proj),
            ("up_proj", &self.up_proj),
            ("down_proj", &self.down_proj),
        ]
    }

    /// [`Self::linears`], to replace one.
    pub fn linears_mut(&mut self) -> [(&'static str, &mut QuantLinear); 3] {
        [
            ("gate_proj", &mut self.gate_proj),
            ("up_proj", &mut self.up_proj),
            ("down_proj", &mut self.down_proj),
        ]
    }

    /// `residual` plus the MLP of `input` (normed for [`Self::shared_input`]).
    pub fn forward(&self, input: Normed, residual: Tensor) -> Result<Tensor> {
        let dev = input.device().clone();
        let dev = &dev;
        let rows = input.rows();
        let gate_up = [&self.gate_proj, &self.up_proj];
        // codes need no prepared weight
        let prepared = match &input {
            Normed::Rows { x, .. } => Some(stage("gate_up_proj", dev, || {
                Ok((
                    self.gate_proj.prepared_like(x)?,
                    self.up_proj.prepared_like(x)?,
                ))
            })?),
            Normed::Fp8(_) => None,
        };
        let mut w_down = None;
        let mut out = self.down_proj.row_chunks_added_to(residual)?;
        for start in (0..rows).step_by(MLP_CHUNK) {
            let [gate, up] = match input.narrow(start, MLP_CHUNK.min(rows - start))? {
                Normed::Fp8(codes) => stage("gate_up_proj", dev, || {
                    forward_fp8_rows_all(gate_up, &codes)
                })?,
                Normed::Rows { x, prequantized } => {
                    let Some((w_gate, w_up)) = &prepared else {
                        candle_core::bail!("the MLP's input changed kind between its chunks")
                    };
                    let [gate_in, up_in] = layer_inputs(gate_up, &x, prequantized)?;
                    stage("gate_up_proj", dev, || {
                        // one at a time unless they share an fp8 quantization (the order of the
                        // allocations shows in how much memory the allocator gives back after
                        // a request)
                        if !self.gate_proj.on_fp8_tensor_cores() {
                            return Ok([
                                self.gate_proj.forward_prepared(&gate_in, w_gate)?,
                                self.up_proj.forward_prepared(&up_in, w_up)?,
                            ]);
                        }
                        forward_prepared_all([
                            (&self.gate_proj, &gate_in, Some(w_gate)),
                            (&self.up_proj, &up_in, Some(w_up)),
                        ])
                    })?
                }
            };
            // On the fp8 tensor cores the activation writes the down projection's codes itself.
            if let Some(scale) = self.down_proj.fp8_input_scale() {
                let rows = stage(self.act.stage_name(), dev, || {
                    ops::gated_mul_fp8_rows(self.act, &gate, &up, scale)
                })?;
                drop((gate, up));
                stage("down_proj", dev, || out.push_fp8_rows(&rows))?;
                continue;
            }
            let qdq = self.down_proj.input_qdq();
            let down_in = stage(self.act.stage_name(), dev, || {
                ops::gated_mul(self.act, &gate, &up, qdq)
            })?;
            drop((gate, up));
            // Dequantized once gate/up of the first chunk are gone (one weight fewer alive).
            let w = match w_down.take() {
                Some(w) => w,
                None => stage("down_proj", dev, || self.down_proj.prepared_like(&down_in))?,
            };
            stage("down_proj", dev, || out.push(&down_in, &w))?;
            w_down = Some(w);
        }
        stage("down_proj", dev, || out.finish())
    }
}

/// Whether `experts` can run as one stack ([`forward_stacked`]): every gate and up apply one
/// activation QDQ, and every down one, so the first expert's stand for all; and no projection
/// has a bias (gpt-oss's), which the stacked GEMMs do not add.
pub fn stackable(experts: &[Mlp]) -> bool {
    let biased = experts
        .iter()
        .flat_map(|e| e.linears())
        .any(|(_, l)| l.bias().is_some());
    if biased {
        return false;
    }
    let all_same = |linears: Vec<&QuantLinear>| common_qdq(&linears).is_some();
    all_same(
        experts
            .iter()
            .flat_map(|e| [&e.gate_proj, &e.up_proj])
            .collect(),
    ) && all_same(experts.iter().map(|e| &e.down_proj).collect())
}

/// Whether [`forward_stacked`] multiplies every projection of `experts`, `mean_rows` rows each
/// on average, by the kernel that decodes int4 weights inside the GEMM ([`decodes_in_gemm`]),
/// which takes each expert's own row count: then the experts need no padding to a common count.
pub fn stack_decodes_in_gemm(experts: &[&Mlp], mean_rows: usize, dtype: DType) -> Result<bool> {
    let projections: [fn(&Mlp) -> &QuantLinear; 3] =
        [|e| &e.gate_proj, |e| &e.up_proj, |e| &e.down_proj];
    for proj in projections {
        let linears: Vec<&QuantLinear> = experts.iter().map(|e| proj(e)).collect();
        if !decodes_in_gemm(&linears, mean_rows, dtype)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Several [`stackable`] MLPs of one shape (a mixture's experts), each on its own block of
/// consecutive rows of `x` (`[Σ rows, hidden]`, expert by expert, as `rows` splits them; counts
/// all equal unless [`stack_decodes_in_gemm`], which a plan made on the GPU needs): each projection is one launch over the experts' weights
/// ([`matmul_t_stacked`]: decoded inside the GEMM, or dequantized together right before one
/// batched GEMM); down writes the experts' outputs into rows `row0..` of `out`
/// (`[rows, hidden]`, a GPU tensor that [`ops::adds_into_rows`] accepts), without a residual.
pub fn forward_stacked(
    experts: &[&Mlp],
    x: Tensor,
    rows: StackRows,
    out: &Tensor,
    row0: usize,
) -> Result<()> {
    let dev = x.device().clone();
    let Some(first) = experts.first() else {
        return Ok(());
    };
    let pick = |proj: fn(&Mlp) -> &QuantLinear| experts.iter().map(|e| proj(e)).collect::<Vec<_>>();
    let [gate_in, up_in] = layer_inputs([&first.gate_proj, &first.up_proj], &x, false)?;
    drop(x);
    let (gate, up) = stage("gate_up_proj", &dev, || {
        Ok((
            matmul_t_stacked(&pick(|e| &e.gate_proj), &gate_in, rows)?,
            matmul_t_stacked(&pick(|e| &e.up_proj), &up_in, rows)?,
        ))
    })?;
    drop((gate_in, up_in));
    let qdq = first.down_proj.activation();
    let down_in = stage(first.act.stage_name(), &dev, || {
        ops::gated_mul(first.act, &gate, &up, qdq)
    })?;
    drop((gate, up));
    stage("down_proj", &dev, || {
        matmul_t_stacked_into_rows(&pick(|e| &e.down_proj), &down_in, rows, out, row0)
    })
}
