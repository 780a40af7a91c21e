//! The registry of the architectures we serve ([`Architecture`]), and what each one brings
//! (`ArchitectureConfig`, implemented in its own file beside this one).

use serde_json::Value;

use super::{
    gate_activation, gemma2, gemma3, keys_set, llama, mistral, mistral3, mixtral, qwen2, qwen3,
    qwen3_moe, required, rope_parameters, vision_language, Activation, MoeConfig, ProjectionBiases,
    Rope, ScoreShaping, SharedKeys, SlidingLayers, SOFTCAPPING_KEYS,
};
use crate::checkpoint::LoadError;

/// The registry: declares [`Architecture`], one variant per line (in the order an unsupported
/// architecture's error lists them), each bound to the [`ArchitectureConfig`] that reads it.
macro_rules! architectures {
    ($($(#[$doc:meta])* $variant:ident => $config:expr,)*) => {
        /// The model families we serve.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
        pub enum Architecture {
            $($(#[$doc])* $variant,)*
        }

        impl Architecture {
            const ALL: &'static [Self] = &[$(Self::$variant,)*];

            /// What this architecture makes of its config.json.
            pub(super) fn config(self) -> &'static dyn ArchitectureConfig {
                match self {
                    $(Self::$variant => &$config,)*
                }
            }
        }
    };
}

architectures! {
    Llama => llama::LlamaForCausalLM,
    Mistral => mistral::MistralForCausalLM,
    Qwen2 => qwen2::Qwen2ForCausalLM,
    Qwen3 => qwen3::Qwen3ForCausalLM,
    Qwen3Moe => qwen3_moe::Qwen3MoeForCausalLM,
    Mixtral => mixtral::MixtralForCausalLM,
    Gemma2 => gemma2::Gemma2ForCausalLM,
    Gemma3 => gemma3::Gemma3 { vision_language: false },
    /// The text part of a Gemma 3 vision-language checkpoint (`language_model.` weights).
    Gemma3Multimodal => gemma3::Gemma3 { vision_language: true },
    /// The text part of a Mistral 3 vision-language checkpoint (Mistral Small 3.x): a Mistral
    /// under `language_model.`.
    Mistral3Multimodal => mistral3::Mistral3ForConditionalGeneration,
}

impl Architecture {
    fn from_hf(name: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|a| a.hf_name() == name)
    }

    /// The first architecture of config.json's `architectures` that we serve.
    pub(super) fn of(root: &Value) -> Result<Self, LoadError> {
        let names: Vec<String> = required(
            root.get("architectures")
                .and_then(|a| serde_json::from_value(a.clone()).ok()),
            "architectures",
        )?;
        names.iter().find_map(|a| Self::from_hf(a)).ok_or_else(|| {
            let supported: Vec<&str> = Self::ALL.iter().map(|a| a.hf_name()).collect();
            LoadError::config(
                "architectures",
                format!(
                    "unsupported architecture {names:?}; supported: {}",
                    supported.join(", ")
                ),
            )
        })
    }

    pub fn hf_name(self) -> &'static str {
        self.config().hf_name()
    }

    /// Whose decoder layer the stack builds.
    pub fn decoder_family(self) -> DecoderFamily {
        self.config().decoder_family()
    }

    /// A vision-language checkpoint whose text model is served: config under `text_config`,
    /// weights under `model.language_model` (transformers 5) or `language_model.model` (4.x).
    pub fn is_vision_language(self) -> bool {
        self.config().is_vision_language()
    }

    /// Tensor prefixes a checkpoint of this architecture may hold that scoring never reads:
    /// the vision tower and projector of a vision-language checkpoint (only its text model is
    /// served).
    pub fn unread_prefixes(self) -> &'static [&'static str] {
        if self.is_vision_language() {
            &vision_language::UNREAD_PREFIXES
        } else {
            &[]
        }
    }
}

/// The decoder layers an architecture is built from (`model::llama`, `model::gemma`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecoderFamily {
    /// Pre-norm layers: Llama, Mistral, Qwen and their mixtures of experts.
    Llama,
    /// `(1 + w)` norms, scaled embeddings, norms after attention and MLP.
    Gemma,
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

    fn is_vision_language(&self) -> bool {
        false
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
    fn qk_norm(&self) -> bool {
        false
    }

    fn score_shaping(&self, _root: &Value) -> Result<ScoreShaping, LoadError> {
        Ok(ScoreShaping::default())
    }
}
