//! The decoder-only transformer that every architecture shares: token embedding, a stack of
//! decoder layers split into pipeline stages (one device each), final norm, lm_head and
//! scoring. What differs between architectures is the decoder layer, which each family's file
//! builds from [`super::blocks`] ([`super::llama`], [`super::gemma`], [`super::qwen3_next`]); a
//! [`Family`] says how.
//! Sequences of a batch are concatenated along the token axis for every Linear; attention runs
//! per sequence, so a sequence's result does not depend on what shares its batch.

use std::ops::Range;
use std::path::Path;

use candle_core::{Device, Result, Tensor};

use super::blocks::{Attention, BatchLayout, FeedForward, NormKind, RmsNorm, Route};
use super::config::{Architecture, DecoderFamily, ModelConfig};
use super::gemma4::PerLayerInputs;
use super::loader::Loader;
use super::profile::stage;
use super::rope::{Rope, RopeTables};
use super::scoring::{score_logits, SequenceScores};
use super::stored_kld::{stored_rows, StoredRequest};
use super::{deepseek, gemma, gemma4, llama, qwen3_next};
use crate::checkpoint::{Checkpoint, LoadError};
use crate::ops;
use crate::quant::dense::DenseWeight;
use crate::quant::{LinearOptions, QuantLinear, QuantizationConfig, SCALE_DTYPES};

/// How to materialise a model.
#[derive(Debug, Clone)]
pub struct ModelOptions {
    pub linear: LinearOptions,
    /// Longest sequence that will be scored (sizes the RoPE tables).
    pub max_seq_len: usize,
    pub attention: AttentionKernel,
}

/// How attention runs. `Materialized` computes the `[heads, T, T]` scores in f32 (every device
/// and dtype; the exact f32 path); `Flash` is the fused GPU kernel (CUDA, bf16/f16 compute,
/// head_dim 64 or 128), refused at load anywhere else. `Auto` (the default) takes `Flash` where
/// it exists and `Materialized` elsewhere; the model reports which one it resolved to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AttentionKernel {
    #[default]
    Auto,
    Materialized,
    Flash,
}

/// One sequence to score.
#[derive(Debug, Clone, Copy)]
pub struct ScoreInput<'a> {
    pub tokens: &'a [u32],
    pub top_k: usize,
    /// A stored reference's rows to write or to bound against ([`StoredRequest::NONE`]: none).
    pub stored: &'a StoredRequest,
}

/// Rows of the lm_head processed at once, so that `[rows, vocab]` f32 logits stay small.
pub(crate) const LM_HEAD_CHUNK: usize = 1024;

/// The lm_head rows of one scoring chunk for a vocabulary: [`LM_HEAD_CHUNK`], fewer where the
/// vocabulary is so large that the f32 logits would pass 512 MiB (Gemma's 262k: 512 rows).
pub(crate) fn lm_head_rows(vocab: usize) -> usize {
    ((1 << 27) / vocab.max(1)).clamp(16, LM_HEAD_CHUNK)
}

/// One decoder layer of any family, as the stack runs it.
pub(crate) trait Layer: Send + Sync {
    /// The residual stream `x` after this layer. `rope`: the tables this layer rotates with
    /// (see [`Attention::local_rope`]); `routes`: where a sparse layer records every token's
    /// experts.
    fn forward(
        &self,
        x: Tensor,
        batch: &BatchLayout,
        rope: &RopeTables,
        routes: Option<&mut Vec<Route>>,
    ) -> Result<Tensor>;

    /// Whether the layer rotates with the local RoPE tables (Gemma 3's sliding layers).
    fn local_rope(&self) -> bool;

    fn feed_forward(&self) -> &FeedForward;

    /// Whether the layer routes tokens to experts (records [`Route`]s).
    fn routes_experts(&self) -> bool {
        self.feed_forward().is_sparse()
    }

    /// Every Linear with its name under the layer (`self_attn.q_proj`, `mlp.down_proj`,
    /// `linear_attn.out_proj`), attention first.
    fn linears(&self) -> Vec<(String, &QuantLinear)>;

    /// [`Self::linears`], to replace one (`/diff`'s module attribution).
    fn linears_mut(&mut self) -> Vec<(String, &mut QuantLinear)>;

    /// A copy that shares every weight (`/diff` replaces one Linear of it).
    fn clone_box(&self) -> Box<dyn Layer>;
}

/// A decoder layer of any family: the attention and the feed-forward every family has, and
/// the family's norms around them, which decide how the residual stream flows through the two.
#[derive(Clone)]
pub(crate) struct DecoderLayer<N> {
    pub(crate) self_attn: Attention,
    pub(crate) mlp: FeedForward,
    pub(crate) norms: N,
}

/// Loads one of a family's norms by name.
pub(crate) type NormLoader<'a> = dyn Fn(&str) -> std::result::Result<RmsNorm, LoadError> + 'a;

impl<N: LayerNorms> DecoderLayer<N> {
    /// Decoder layer `layer`, whose tensors `vb` names (`model.layers.N`): the attention, the
    /// feed-forward, then the family's norms of `kind`, which `norms` loads by name.
    pub(crate) fn load(
        vb: &Loader,
        c: &ModelConfig,
        layer: usize,
        kind: NormKind,
        norms: impl FnOnce(&NormLoader) -> std::result::Result<N, LoadError>,
    ) -> std::result::Result<Self, LoadError> {
        let self_attn = Attention::load(&vb.pp("self_attn"), c, layer, kind)?;
        let mlp = FeedForward::load(vb, c, layer)?;
        let norm = |name: &str| RmsNorm::load(&vb.pp(name), c.hidden_size, c.rms_norm_eps, kind);
        Ok(Self {
            self_attn,
            mlp,
            norms: norms(&norm)?,
        })
    }
}

/// A family's norms around a decoder layer's attention and feed-forward.
pub(crate) trait LayerNorms: Clone + Send + Sync + 'static {
    /// [`Layer::forward`] of `layer`.
    fn forward(
        layer: &DecoderLayer<Self>,
        x: Tensor,
        batch: &BatchLayout,
        rope: &RopeTables,
        routes: Option<&mut Vec<Route>>,
    ) -> Result<Tensor>;
}

impl<N: LayerNorms> Layer for DecoderLayer<N> {
    fn forward(
        &self,
        x: Tensor,
        batch: &BatchLayout,
        rope: &RopeTables,
        routes: Option<&mut Vec<Route>>,
    ) -> Result<Tensor> {
        N::forward(self, x, batch, rope, routes)
    }

    fn local_rope(&self) -> bool {
        self.self_attn.local_rope()
    }

    fn feed_forward(&self) -> &FeedForward {
        &self.mlp
    }

    fn linears(&self) -> Vec<(String, &QuantLinear)> {
        attention_linears(&self.self_attn)
            .chain(self.mlp.linears())
            .collect()
    }

    fn linears_mut(&mut self) -> Vec<(String, &mut QuantLinear)> {
        let attention = self.self_attn.linears_mut().into_iter();
        attention
            .map(|(n, l)| (format!("self_attn.{n}"), l))
            .chain(self.mlp.linears_mut())
            .collect()
    }

    fn clone_box(&self) -> Box<dyn Layer> {
        Box::new(self.clone())
    }
}

/// The attention's Linears named under the layer (`self_attn.q_proj`).
pub(crate) fn attention_linears(
    attention: &Attention,
) -> impl Iterator<Item = (String, &QuantLinear)> {
    attention
        .linears()
        .into_iter()
        .map(|(n, l)| (format!("self_attn.{n}"), l))
}

impl dyn Layer {
    /// The Linear named `module` under the layer (`self_attn.q_proj`, `mlp.down_proj`), as
    /// [`Model::linears`] names it after `model.layers.N.`.
    fn linear_mut(&mut self, module: &str) -> Option<&mut QuantLinear> {
        self.linears_mut()
            .into_iter()
            .find(|(n, _)| n == module)
            .map(|(_, l)| l)
    }
}

/// What an architecture family brings to the stack: its decoder layer and how its norms weigh
/// (the final norm's too).
pub(crate) trait Family: Sync {
    /// Decoder layer `layer`, whose tensors `vb` names (`model.layers.N`).
    fn load_layer(
        &self,
        vb: &Loader,
        c: &ModelConfig,
        layer: usize,
    ) -> std::result::Result<Box<dyn Layer>, LoadError>;

    fn norm(&self) -> NormKind;

    /// The factor the embeddings are multiplied by (in the compute dtype), if any.
    fn embed_scale(&self, _c: &ModelConfig) -> Option<f64> {
        None
    }
}

/// The prefix of the text model's tensors (`model`: `model.embed_tokens`, `model.layers.N`,
/// `model.norm`) and the lm_head's name; a vision-language checkpoint keeps its text model
/// under `model.language_model` (transformers 5) or `language_model.model` (4.x), which
/// Qwen3.5's text-only classes read too.
fn text_names(ckpt: &Checkpoint, c: &ModelConfig) -> (&'static str, &'static str) {
    if c.architecture.reads_nested_text_model() {
        for names in [
            ("model.language_model", "lm_head"),
            ("language_model.model", "language_model.lm_head"),
        ] {
            if ckpt.contains(&format!("{}.embed_tokens.weight", names.0)) {
                return names;
            }
        }
    }
    ("model", "lm_head")
}

/// The family `architecture` belongs to.
fn family(architecture: Architecture) -> &'static dyn Family {
    match architecture.decoder_family() {
        DecoderFamily::Llama => &llama::Llama {
            norm: NormKind::Weight,
        },
        DecoderFamily::GptOss => &llama::Llama {
            norm: NormKind::WeightInF32,
        },
        DecoderFamily::Gemma => &gemma::Gemma,
        DecoderFamily::Qwen3Next => &qwen3_next::Qwen3Next,
        DecoderFamily::Mla => &deepseek::Mla,
        DecoderFamily::Gemma4 => &gemma4::Gemma4,
    }
}

pub struct Model {
    config: ModelConfig,
    /// `linear.device` is the first stage's device.
    opts: ModelOptions,
    /// On the first stage's device.
    embed_tokens: Tensor,
    layers: Vec<Box<dyn Layer>>,
    /// `norm` and `lm_head` are on the last stage's device.
    norm: RmsNorm,
    lm_head: QuantLinear,
    stages: Vec<Stage>,
    /// Gemma scales the embeddings by `sqrt(hidden)`, rounded to the compute dtype.
    embed_scale: Option<f64>,
    /// How the materialised attention cuts a sequence (no bit depends on it).
    attention_blocks: ops::AttentionBlocks,
    /// Gemma 4's per-layer inputs, appended to the embedded tokens (on the first stage's
    /// device).
    per_layer_inputs: Option<PerLayerInputs>,
}

/// A run of consecutive decoder layers on one device: a pipeline stage of the model.
struct Stage {
    device: Device,
    layers: Range<usize>,
    /// The RoPE tables on this stage's device.
    rope: RopeTables,
    /// The sliding layers' tables where they differ (Gemma 3's local base).
    local_rope: Option<RopeTables>,
}

/// What the caller of a checked pass ([`Model::forward_stage_checked`]) answers before each
/// decoder layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Keep {
    /// Every sequence of the batch goes on.
    All,
    /// Only the sequences marked `true`, in batch order, go on.
    Only(Vec<bool>),
}

/// The rows of `x` (sequences of lengths `lens`, concatenated) of the sequences that `keep`
/// marks, and their lengths.
pub fn keep_sequences(x: &Tensor, lens: &[usize], keep: &[bool]) -> Result<(Tensor, Vec<usize>)> {
    if keep.len() != lens.len() {
        candle_core::bail!("a keep mask of {} for {} sequences", keep.len(), lens.len());
    }
    let mut rows = Vec::new();
    let mut kept = Vec::new();
    let mut offset = 0u32;
    for (&len, &k) in lens.iter().zip(keep) {
        if k {
            rows.extend(offset..offset + len as u32);
            kept.push(len);
        }
        offset += len as u32;
    }
    let rows = Tensor::from_vec(rows, kept.iter().sum::<usize>(), x.device())?;
    Ok((ops::gather_rows(x, &rows)?, kept))
}

impl Model {
    /// Loads the checkpoint directory `dir` (config.json + safetensors).
    pub fn load(dir: &Path, opts: &ModelOptions) -> std::result::Result<Self, LoadError> {
        let config = ModelConfig::from_dir(dir)?;
        Self::from_checkpoint(config, &Checkpoint::open(dir)?, opts)
    }

    /// Builds the model from an opened checkpoint (files or memory), all on
    /// `opts.linear.device`.
    pub fn from_checkpoint(
        config: ModelConfig,
        ckpt: &Checkpoint,
        opts: &ModelOptions,
    ) -> std::result::Result<Self, LoadError> {
        let all = vec![(opts.linear.device.clone(), 0..config.num_layers)];
        Self::from_checkpoint_placed(config, ckpt, opts, all)
    }

    /// Builds the model as pipeline stages: `stages[k]` = (device, the decoder layers it
    /// holds), consecutive ranges covering every layer. The embedding goes with the first
    /// stage, the final norm and the lm_head with the last; `opts.linear.device` is ignored.
    pub fn from_checkpoint_placed(
        config: ModelConfig,
        ckpt: &Checkpoint,
        opts: &ModelOptions,
        stages: Vec<(Device, Range<usize>)>,
    ) -> std::result::Result<Self, LoadError> {
        check_stages(&stages, config.num_layers)?;
        check_rope_window(&config, opts.max_seq_len)?;
        let stage_options = |k: usize| LinearOptions {
            device: stages[k].0.clone(),
            ..opts.linear.clone()
        };
        let (first, last) = (stage_options(0), stage_options(stages.len() - 1));
        let quant = config
            .quantization_config
            .as_ref()
            .map(QuantizationConfig::parse)
            .transpose()?;
        if let Some(q) = &quant {
            let gpt_oss = config.moe.as_ref().is_some_and(|m| m.gpt_oss_experts);
            if q.native_mxfp4 && !gpt_oss {
                return Err(LoadError::config(
                    "quantization_config.quant_method",
                    format!(
                        "\"mxfp4\" is gpt-oss's own format (its experts); {} has none",
                        config.architecture.hf_name()
                    ),
                ));
            }
            if q.scheme_for("model.embed_tokens", "Embedding")?.is_some() {
                return Err(LoadError::Unsupported {
                    layer: "model.embed_tokens".into(),
                    field: "config_groups.targets".into(),
                    reason: "quantized embeddings are not supported".into(),
                });
            }
        }
        let c = &config;
        let family = family(c.architecture);
        let (base, head_name) = text_names(ckpt, c);
        let h = c.hidden_size;
        // On the CPU first: converted there to the compute dtype (no GPU conversion kernel).
        let stored_embed = ckpt.tensor(
            &format!("{base}.embed_tokens.weight"),
            SCALE_DTYPES,
            Some(&[c.vocab_size, h]),
            &Device::Cpu,
        )?;
        let embed_tokens = stored_embed
            .to_dtype(first.dtype)?
            .to_device(&first.device)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for (k, (_, range)) in stages.iter().enumerate() {
            let lin = stage_options(k);
            let vb = Loader::new(ckpt, quant.as_ref(), &lin)
                .pp(base)
                .pp("layers");
            for i in range.clone() {
                layers.push(family.load_layer(&vb.pp(i), c, i)?);
            }
        }
        let per_layer_inputs =
            PerLayerInputs::load(&Loader::new(ckpt, quant.as_ref(), &first).pp(base), c)?;
        let last_vb = Loader::new(ckpt, quant.as_ref(), &last);
        let norm = RmsNorm::load(
            &last_vb.pp(base).pp("norm"),
            h,
            c.rms_norm_eps,
            family.norm(),
        )?;
        let lm_head = if c.tie_word_embeddings && !ckpt.contains(&format!("{head_name}.weight")) {
            // The tied head keeps the stored dtype, as an untied dense head does; it shares the
            // embedding's memory where both are one tensor on one device.
            let weight = if stored_embed.dtype() == last.dtype && stages.len() == 1 {
                embed_tokens.clone()
            } else {
                stored_embed.to_device(&last.device)?
            };
            QuantLinear::new(Box::new(DenseWeight::from_tensor(weight)), None)
        } else {
            last_vb.linear(head_name, (c.vocab_size, h), false)?
        };
        // The multi-token-prediction layers after the last (DeepSeek-V3, GLM-4.5) are never read.
        let mtp: Vec<String> = (c.num_layers..c.num_layers + c.mtp_layers)
            .map(|i| format!("{base}.layers.{i}."))
            .collect();
        let unread: Vec<&str> = c
            .architecture
            .unread_prefixes()
            .iter()
            .copied()
            .chain(mtp.iter().map(String::as_str))
            .collect();
        ckpt.refuse_unread(c.architecture.hf_name(), &unread)?;
        let max_len = opts.max_seq_len.max(1);
        let local = c
            .sliding_layers
            .as_ref()
            .and_then(|s| s.local_rope.as_ref());
        let stages = stages
            .into_iter()
            .map(|(device, layers)| {
                let (global_dim, local_dim) = c.rope_table_dims();
                let tables = |r: &Rope, dim| RopeTables::new(r, dim, max_len, first.dtype, &device);
                let rope = tables(&c.rope, global_dim)?;
                let local_rope = local.map(|r| tables(r, local_dim)).transpose()?;
                // Weights were copied on this thread's stream; the stage computes on its own.
                device.synchronize()?;
                Ok(Stage {
                    device,
                    layers,
                    rope,
                    local_rope,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed_scale = family.embed_scale(c);
        let mut model = Self {
            config,
            opts: ModelOptions {
                linear: first,
                ..opts.clone()
            },
            embed_tokens,
            layers,
            norm,
            lm_head,
            stages,
            embed_scale,
            attention_blocks: ops::AttentionBlocks::default(),
            per_layer_inputs,
        };
        model.set_attention(opts.attention)?;
        Ok(model)
    }
}

/// (`N`, `self_attn.q_proj`) of a Linear named `model.layers.N.self_attn.q_proj`.
pub fn split_module_name(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (i, module) = rest.split_once('.')?;
    Some((i.parse().ok()?, module))
}

/// Windows of up to `max_seq_len` tokens get the RoPE frequencies transformers gives them.
fn check_rope_window(c: &ModelConfig, max_seq_len: usize) -> std::result::Result<(), LoadError> {
    let local = c
        .sliding_layers
        .as_ref()
        .and_then(|s| s.local_rope.as_ref());
    for rope in std::iter::once(&c.rope).chain(local) {
        if let Some(longest) = rope.longest_window().filter(|&n| max_seq_len > n) {
            return Err(LoadError::config(
                "rope_parameters.rope_type",
                format!(
                    "dynamic RoPE has fixed frequencies up to max_position_embeddings = \
                     {longest} tokens; windows of up to {max_seq_len} (--max-input-tokens) would \
                     get frequencies that transformers recomputes per length. Lower \
                     --max-input-tokens to {longest} or less"
                ),
            ));
        }
    }
    Ok(())
}

/// `stages` cover `0..layers` with consecutive, non-empty ranges.
fn check_stages(
    stages: &[(Device, Range<usize>)],
    layers: usize,
) -> std::result::Result<(), LoadError> {
    let mut next = 0;
    let mut in_order = !stages.is_empty();
    for (_, range) in stages {
        in_order &= range.start == next && !range.is_empty();
        next = range.end;
    }
    if !in_order || next != layers {
        return Err(LoadError::config(
            "layer split",
            format!(
                "stages {:?} do not cover the {layers} decoder layers in order, each with at \
                 least one",
                stages.iter().map(|(_, r)| r.clone()).collect::<Vec<_>>()
            ),
        ));
    }
    Ok(())
}

impl Model {
    /// Switches the attention kernel; `Flash` is refused where the kernel does not exist and
    /// `Auto` resolves to the fastest one that does.
    pub fn set_attention(&mut self, kernel: AttentionKernel) -> std::result::Result<(), LoadError> {
        let lin = &self.opts.linear;
        let softcap = self.config.attn_logit_softcapping.is_some();
        let head_dim = self.config.attention_head_dim();
        let flash = self.config.flash_attention_possible()
            && self
                .stages
                .iter()
                .all(|stage| ops::flash_attention_available(&stage.device, head_dim, lin.dtype));
        let kernel = match kernel {
            AttentionKernel::Auto if flash => AttentionKernel::Flash,
            AttentionKernel::Auto => AttentionKernel::Materialized,
            chosen => chosen,
        };
        if kernel == AttentionKernel::Flash && softcap {
            return Err(LoadError::config(
                "attention",
                format!(
                    "the flash kernel cannot soft-cap attention scores ({} has \
                     attn_logit_softcapping); use the materialized kernel",
                    self.config.architecture.hf_name()
                ),
            ));
        }
        if kernel == AttentionKernel::Flash && self.config.attention_sinks {
            return Err(LoadError::config(
                "attention",
                format!(
                    "the flash kernel has no attention sinks ({} has self_attn.sinks); use the \
                     materialized kernel (--attention materialized)",
                    self.config.architecture.hf_name()
                ),
            ));
        }
        if kernel == AttentionKernel::Flash && !flash {
            return Err(LoadError::Config {
                field: "attention".into(),
                reason: format!(
                    "the flash kernel needs a CUDA device, bf16 or f16 compute and a head size \
                     of 64, 128, 192 or 256 (have {:?}, {:?}, head size {head_dim})",
                    lin.device, lin.dtype
                ),
            });
        }
        self.opts.attention = kernel;
        Ok(())
    }

    /// Cuts the materialised attention into blocks of about `blocks.score_elements` scores
    /// (the tests show that no bit depends on it).
    pub fn set_attention_blocks(&mut self, blocks: ops::AttentionBlocks) {
        self.attention_blocks = blocks;
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn options(&self) -> &ModelOptions {
        &self.opts
    }

    /// Every Linear with its module name, lm_head last.
    pub fn linears(&self) -> Vec<(String, &QuantLinear)> {
        let mut out = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            for (n, lin) in l.linears() {
                out.push((format!("model.layers.{i}.{n}"), lin));
            }
        }
        out.push(("lm_head".to_string(), &self.lm_head));
        out
    }

    /// The Linear `name`, as [`Self::linears`] names it.
    pub fn linear(&self, name: &str) -> Option<&QuantLinear> {
        self.linears()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, l)| l)
    }

    /// Pipeline stages: each holds a run of decoder layers on its own device.
    pub fn stage_count(&self) -> usize {
        self.stages.len()
    }

    /// The device of stage `k`.
    pub fn stage_device(&self, k: usize) -> &Device {
        &self.stages[k].device
    }

    /// The decoder layers of stage `k`.
    pub fn stage_layers(&self, k: usize) -> Range<usize> {
        self.stages[k].layers.clone()
    }

    /// The stage that holds decoder layer `i`.
    pub fn layer_stage(&self, i: usize) -> usize {
        self.stages
            .iter()
            .position(|s| s.layers.contains(&i))
            .unwrap_or(self.stages.len() - 1)
    }

    /// Final-norm hidden states `[sum of lengths, hidden]` of the sequences, concatenated: every
    /// stage in turn on this thread, the hidden state carried from one device to the next.
    pub fn hidden_states(&self, sequences: &[&[u32]]) -> Result<Tensor> {
        self.hidden_states_routed(sequences, None)
    }

    /// The experts every token chose in every sparse layer (`[layer][token]`, tokens of the
    /// sequences concatenated), best first with their routing weights; empty for dense models.
    pub fn expert_routes(&self, sequences: &[&[u32]]) -> Result<Vec<(usize, Vec<Route>)>> {
        let mut routes = Vec::new();
        self.hidden_states_routed(sequences, Some(&mut routes))?;
        Ok(routes)
    }

    fn hidden_states_routed(
        &self,
        sequences: &[&[u32]],
        routes: Option<&mut Vec<(usize, Vec<Route>)>>,
    ) -> Result<Tensor> {
        let lens: Vec<usize> = sequences.iter().map(|s| s.len()).collect();
        let x = self.embed(sequences)?;
        let x = self.walk_layers(0..self.layers.len(), x, &lens, routes)?;
        self.final_norm(&x)
    }

    /// The embedded tokens `[sum of lengths, hidden]` on the first stage's device, after
    /// checking every sequence against the model's limits.
    pub fn embed(&self, sequences: &[&[u32]]) -> Result<Tensor> {
        let longest = sequences.iter().map(|s| s.len()).max().unwrap_or(0);
        let max_len = self.stages[0].rope.max_len();
        if longest > max_len {
            candle_core::bail!("sequence of {longest} tokens exceeds max_seq_len {max_len}");
        }
        let ids: Vec<u32> = sequences.iter().flat_map(|s| s.iter().copied()).collect();
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= self.config.vocab_size) {
            candle_core::bail!(
                "token id {bad} is outside the vocabulary ({})",
                self.config.vocab_size
            );
        }
        let ids = match self.config.gemma4.as_ref() {
            // a Gemma 4 vision-language model embeds its media placeholders as padding
            Some(g) if !g.placeholders.is_empty() => {
                let pad = g.pad_token_id.unwrap_or_default();
                let plain = |t: u32| if g.placeholders.contains(&t) { pad } else { t };
                ids.into_iter().map(plain).collect()
            }
            _ => ids,
        };
        let device = &self.stages[0].device;
        stage("embed", device, || {
            let ids = Tensor::new(ids.as_slice(), device)?;
            let x = ops::gather_rows(&self.embed_tokens, &ids)?;
            let x = match self.embed_scale {
                // the scale rounded to the compute dtype, as transformers multiplies
                Some(s) => x.broadcast_mul(&Tensor::new(s as f32, device)?.to_dtype(x.dtype())?)?,
                None => x,
            };
            match &self.per_layer_inputs {
                // the stream Gemma 4's layers pass on: [residual, per-layer inputs]
                Some(p) => {
                    let inputs = p.forward(&ids, &x)?;
                    Tensor::cat(&[x, inputs], 1)
                }
                None => Ok(x),
            }
        })
    }

    /// The residual stream of a decoder layer's output `x`: its first `hidden_size` columns
    /// (Gemma 4's layers pass on a wider stream, [`super::gemma4`]).
    pub fn residual(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.config.hidden_size;
        match x.dims()[1] {
            width if width > h => x.narrow(1, 0, h)?.contiguous(),
            _ => Ok(x.clone()),
        }
    }

    /// Stage `k`'s decoder layers over the residual stream `x` (on that stage's device) of
    /// sequences of lengths `lens`, concatenated.
    pub fn forward_stage(&self, k: usize, x: Tensor, lens: &[usize]) -> Result<Tensor> {
        self.run_layers(k, self.stages[k].layers.clone(), x, lens, None, None, None)
    }

    /// [`Self::forward_stage`], calling `boundary` before each decoder layer: an error from it
    /// stops the pass there (the engine's cancellation), and a [`Keep`] mask drops the
    /// sequences it marks `false` from the rest of the pass (nobody waits for them any more).
    /// The other sequences' numbers do not change: every kernel's rows are independent of what
    /// shares the batch. Returns the state of the sequences kept.
    pub fn forward_stage_checked(
        &self,
        k: usize,
        x: Tensor,
        lens: &[usize],
        boundary: &dyn Fn() -> Result<Keep>,
    ) -> Result<Tensor> {
        let layers = self.stages[k].layers.clone();
        self.run_layers(k, layers, x, lens, None, None, Some(boundary))
    }

    /// The decoder layers `layers` over `x`, stage by stage, the state carried to each stage's
    /// device: `/diff` runs them one layer at a time, comparing two models after every layer.
    pub fn forward_layers(
        &self,
        layers: Range<usize>,
        x: Tensor,
        lens: &[usize],
    ) -> Result<Tensor> {
        self.walk_layers(layers, x, lens, None)
    }

    /// The one walk over the stages of a forward pass on this thread (the pipelined engine runs
    /// [`Self::forward_stage`] on each stage's own thread instead): each stage's part of
    /// `layers` on its device, the state carried from one device to the next.
    fn walk_layers(
        &self,
        layers: Range<usize>,
        mut x: Tensor,
        lens: &[usize],
        mut routes: Option<&mut Vec<(usize, Vec<Route>)>>,
    ) -> Result<Tensor> {
        let mut start = layers.start;
        while start < layers.end {
            let k = self.layer_stage(start);
            let end = self.stages[k].layers.end.min(layers.end);
            x = crate::device::transfer(&x, &self.stages[k].device)?;
            x = self.run_layers(k, start..end, x, lens, routes.as_deref_mut(), None, None)?;
            start = end;
        }
        Ok(x)
    }

    /// Decoder layer `i` with its Linear `module` (named under the layer: `self_attn.q_proj`)
    /// replaced by `linear`, every other weight this model's, over `x` on the layer's device.
    pub fn forward_layer_with(
        &self,
        i: usize,
        module: &str,
        linear: QuantLinear,
        x: Tensor,
        lens: &[usize],
    ) -> Result<Tensor> {
        let mut layer = self.layers[i].clone_box();
        match layer.linear_mut(module) {
            Some(slot) => *slot = linear,
            None => candle_core::bail!("decoder layer {i} has no Linear `{module}`"),
        }
        self.run_layers(
            self.layer_stage(i),
            i..i + 1,
            x,
            lens,
            None,
            Some(&*layer),
            None,
        )
    }

    /// `layers` of stage `k`; `replaced` stands in for the first of them; `boundary` is asked
    /// before each layer.
    #[allow(clippy::too_many_arguments)]
    fn run_layers(
        &self,
        k: usize,
        layers: Range<usize>,
        mut x: Tensor,
        lens: &[usize],
        mut routes: Option<&mut Vec<(usize, Vec<Route>)>>,
        replaced: Option<&dyn Layer>,
        boundary: Option<&dyn Fn() -> Result<Keep>>,
    ) -> Result<Tensor> {
        let Stage {
            device,
            rope,
            local_rope,
            ..
        } = &self.stages[k];
        // `set_attention` never leaves `Auto` in the options.
        let flash = self.opts.attention == AttentionKernel::Flash;
        let layout = |lens: &[usize]| {
            stage("layout", device, || {
                let blocks = self.attention_blocks;
                BatchLayout::new(
                    lens,
                    flash,
                    blocks,
                    self.config.attention_head_dim(),
                    device,
                )
            })
        };
        let mut batch = layout(lens)?;
        let first = layers.start;
        for i in layers {
            if let Some(Keep::Only(keep)) = boundary.map(|b| b()).transpose()? {
                let kept = keep_sequences(&x, batch.lens(), &keep)?;
                x = kept.0;
                batch = layout(&kept.1)?;
            }
            let layer = match replaced {
                Some(layer) if i == first => layer,
                _ => &*self.layers[i],
            };
            let rope = match local_rope {
                Some(local) if layer.local_rope() => local,
                _ => rope,
            };
            let mut layer_routes = Vec::new();
            let record = routes.is_some().then_some(&mut layer_routes);
            x = layer.forward(x, &batch, rope, record)?;
            if let Some(routes) = routes.as_deref_mut() {
                if layer.routes_experts() {
                    routes.push((i, layer_routes));
                }
            }
        }
        Ok(x)
    }

    /// The final norm of the last stage's output (on the last stage's device).
    pub fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.residual(x)?;
        stage("norm", x.device(), || self.norm.forward(&x, None))
    }

    /// Logits `[rows, vocab]` (compute dtype) of final-norm hidden states `[rows, hidden]`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.logits_with(hidden, &self.lm_head)
    }

    /// [`Self::logits`] through `head` in place of the lm_head.
    pub fn logits_with(&self, hidden: &Tensor, head: &QuantLinear) -> Result<Tensor> {
        let logits = stage("lm_head", hidden.device(), || head.forward(hidden))?;
        match self.config.final_logit_softcapping {
            // transformers: logits / cap, tanh, * cap, in the logits' dtype
            Some(cap) => stage("softcap", hidden.device(), || ops::soft_cap(&logits, cap)),
            None => Ok(logits),
        }
    }

    /// Scores a batch. Results come back in input order.
    pub fn score(&self, batch: &[ScoreInput<'_>]) -> Result<Vec<SequenceScores>> {
        let sequences: Vec<&[u32]> = batch.iter().map(|b| b.tokens).collect();
        let hidden = self.hidden_states(&sequences)?;
        self.score_hidden(&hidden, batch)
    }

    /// Scores a batch from its final-norm hidden states (on the last stage's device).
    pub fn score_hidden(
        &self,
        hidden: &Tensor,
        batch: &[ScoreInput<'_>],
    ) -> Result<Vec<SequenceScores>> {
        let mut offset = 0;
        let mut out = Vec::with_capacity(batch.len());
        for input in batch {
            let n = input.tokens.len();
            let mut rows = Vec::with_capacity(n);
            let mut stored = input.stored.output();
            let chunk = lm_head_rows(self.config.vocab_size);
            for start in (0..n).step_by(chunk) {
                let len = chunk.min(n - start);
                let h = hidden.narrow(0, offset + start, len)?;
                let logits = self.logits(&h)?;
                let targets: Vec<Option<u32>> = (start..start + len)
                    .map(|i| input.tokens.get(i + 1).copied())
                    .collect();
                rows.extend(stage("scoring", h.device(), || {
                    score_logits(&logits, &targets, input.top_k)
                })?);
                let known: Vec<u32> = targets.iter().map_while(|t| *t).collect();
                stored_rows(input.stored, &logits, start, &known, &mut stored)?;
            }
            offset += n;
            out.push(SequenceScores { rows, stored });
        }
        Ok(out)
    }
}
