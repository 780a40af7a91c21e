//! What one architecture brings to the reading of a config.json (`ArchitectureConfig`,
//! implemented in each architecture's file), and whose decoder layers it is built from.

use serde_json::Value;

use super::rope_parameters;
use super::shared::{
    gate_activation, keys_set, Activation, LinearAttentionConfig, MlaConfig, MoeConfig,
    ProjectionBiases, ScoreShaping, SharedKeys, SlidingLayers, SOFTCAPPING_KEYS,
};
use crate::checkpoint::LoadError;
use crate::model::rope::Rope;

/// The decoder layers an architecture is built from (`model::llama`, `model::gemma`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecoderFamily {
    /// Pre-norm layers: Llama, Mistral, Qwen and their mixtures of experts.
    Llama,
    /// Llama's layers with the norms' weights kept in f32, as transformers keeps gpt-oss's.
    GptOss,
    /// `(1 + w)` norms, scaled embeddings, norms after attention and MLP.
    Gemma,
    /// Qwen3-Next, Qwen3.5: pre-norm `(1 + w)` layers of Gated DeltaNet or gated attention.
    Qwen3Next,
    /// DeepSeek-V3, GLM-4.7-Flash: pre-norm layers of multi-head latent attention.
    Mla,
    /// Gemma 4: per-layer heads, KV-shared layers, per-layer inputs, a mixture beside the MLP.
    Gemma4,
}

/// What one architecture (a transformers `*ForCausalLM` class) makes of its config.json, step by
/// step in the order [`super::ModelConfig::from_json`] reads. The provided methods are what most
/// architectures do (Llama's reading); an architecture overrides where its class differs.
pub(super) trait ArchitectureConfig: Sync {
    /// The name in config.json's `architectures`.
    fn hf_name(&self) -> &'static str;

    /// transformers' defaults (5.17) for the keys we read that a config may leave out and that
    /// change the math: an absent key means what transformers' config class makes of it (an
    /// explicit `null` is read as the file says). Sizes and vocabularies have no default: a
    /// config without them is refused.
    fn transformers_defaults(&self) -> Value;

    fn decoder_family(&self) -> DecoderFamily {
        DecoderFamily::Llama
    }

    /// Whether this reading applies to `root`: a class name shared by readings of different
    /// text models (Mistral 3's wrapper of a Mistral or a Mistral 4) picks by the file.
    fn reads(&self, _root: &Value) -> bool {
        true
    }

    fn is_vision_language(&self) -> bool {
        false
    }

    /// Whether the text model's tensors may sit under a vision-language checkpoint's prefix
    /// (`model.language_model`): a vision-language architecture's, and a text-only class
    /// that transformers loads from such a checkpoint (Qwen3.5's `PrefixChange`).
    fn reads_nested_text_model(&self) -> bool {
        self.is_vision_language()
    }

    /// The text model's keys, from the whole file (a vision-language config nests them).
    fn text_config(&self, root: Value) -> Result<Value, LoadError> {
        Ok(root)
    }

    /// Keys set in `root` that change the math in ways this architecture does not implement.
    /// Soft-capping is Gemma's.
    fn unimplemented_keys(&self, root: &Value) -> Vec<&'static str> {
        keys_set(root, &SOFTCAPPING_KEYS)
    }

    fn activation(&self, keys: &SharedKeys) -> Result<Activation, LoadError> {
        gate_activation(
            self.hf_name(),
            "hidden_act",
            keys.hidden_act.as_deref(),
            &[("silu", Activation::Silu)],
        )
    }

    /// The RoPE of every layer, and a second one for the sliding layers where they differ.
    fn rope(&self, root: &Value, keys: &SharedKeys) -> Result<(Rope, Option<Rope>), LoadError> {
        let rope = rope_parameters::parse_rope(
            &keys.rope_parameters,
            &keys.rope_scaling,
            keys.rope_theta,
            root,
        )?;
        Ok((rope, None))
    }

    /// The window of the sliding layers, from the file's `window`.
    fn sliding_window(&self, window: Option<usize>, _keys: &SharedKeys) -> Option<usize> {
        window
    }

    /// Which layers slide (`None`: every one, when there is a window), with `local_rope`.
    fn sliding_layers(
        &self,
        _root: &Value,
        _num_layers: usize,
        _local_rope: Option<Rope>,
    ) -> Result<Option<SlidingLayers>, LoadError> {
        Ok(None)
    }

    fn moe(&self, _root: &Value, _num_layers: usize) -> Result<Option<MoeConfig>, LoadError> {
        Ok(None)
    }

    /// Which projections have biases is the architecture's, whatever the config says.
    fn biases(&self, keys: &SharedKeys) -> ProjectionBiases {
        ProjectionBiases::attention_bias(keys)
    }

    /// Per-head RMSNorm of q and k before RoPE.
    fn qk_norm(&self, _root: &Value) -> bool {
        false
    }

    /// Multi-head latent attention in place of q/k/v projections (DeepSeek-V3, GLM-4.7-Flash).
    fn mla(&self, _root: &Value, _rope: &Rope) -> Result<Option<MlaConfig>, LoadError> {
        Ok(None)
    }

    /// Multi-token-prediction layers stored after the last decoder layer
    /// (`model.layers.{num_hidden_layers + i}`), which scoring never reads.
    fn mtp_layers(&self, _root: &Value) -> Result<usize, LoadError> {
        Ok(0)
    }

    fn score_shaping(&self, _root: &Value) -> Result<ScoreShaping, LoadError> {
        Ok(ScoreShaping::default())
    }

    /// Tensor prefixes a checkpoint may hold that scoring never reads: the vision tower and
    /// projector of a vision-language checkpoint.
    fn unread_prefixes(&self) -> &'static [&'static str] {
        if self.is_vision_language() {
            &super::vision_language::UNREAD_PREFIXES
        } else {
            &[]
        }
    }

    /// transformers' default `partial_rotary_factor` where the architecture reads one (each
    /// head then rotates `int(head_dim * factor)` dimensions,
    /// [`super::rope_parameters::partial_rotary_dim`]); `None` where it does not: a factor
    /// other than 1 is refused and every dimension rotates.
    fn partial_rotary_default(&self) -> Option<f64> {
        None
    }

    /// The Gated DeltaNet layers of a hybrid model.
    fn linear_attention(
        &self,
        _root: &Value,
        _num_layers: usize,
    ) -> Result<Option<LinearAttentionConfig>, LoadError> {
        Ok(None)
    }

    /// Gemma 4's structure, from its keys `root` and the rest of its config `c`.
    fn gemma4(
        &self,
        _root: &Value,
        _c: &super::ModelConfig,
    ) -> Result<Option<super::Gemma4Text>, LoadError> {
        Ok(None)
    }

    /// q_proj also yields a per-channel output gate: `attn * sigmoid(gate)` before o_proj.
    fn attn_output_gate(&self) -> bool {
        false
    }

    /// Each attention layer has `self_attn.sinks`, one softmax logit per head (gpt-oss).
    fn attention_sinks(&self) -> bool {
        false
    }
}
