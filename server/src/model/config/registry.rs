//! The registry of the architectures we serve: one line each declares a variant of
//! [`Architecture`] and binds it to the `ArchitectureConfig` (in its own file) that reads it.

use serde_json::Value;

use super::architecture::{ArchitectureConfig, DecoderFamily};
use super::shared::required;
use super::{deepseek_v2, mistral4};
use super::{
    deepseek_v3, gemma2, gemma3, gemma4, glm4_moe, glm4_moe_lite, gpt_oss, llama, mistral,
    mistral3, mixtral, qwen2, qwen3, qwen3_5, qwen3_5_moe, qwen3_moe, qwen3_next,
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
    /// Per-layer inputs, KV-shared layers, proportional RoPE, a mixture beside the MLP.
    Gemma4 => gemma4::Gemma4 { vision_language: false },
    /// The text part of a Gemma 4 vision-language checkpoint (`model.language_model.`).
    Gemma4Multimodal => gemma4::Gemma4 { vision_language: true },
    /// Gated DeltaNet and gated-attention layers, MoE with a shared expert.
    Qwen3Next => qwen3_next::Qwen3NextForCausalLM,
    Qwen3_5 => qwen3_5::Qwen3_5 { vision_language: false },
    /// The text part of a Qwen3.5 vision-language checkpoint (`model.language_model.`).
    Qwen3_5Multimodal => qwen3_5::Qwen3_5 { vision_language: true },
    Qwen3_5Moe => qwen3_5_moe::Qwen3_5Moe { vision_language: false },
    /// The text part of a Qwen3.5-MoE vision-language checkpoint (`model.language_model.`).
    Qwen3_5MoeMultimodal => qwen3_5_moe::Qwen3_5Moe { vision_language: true },
    /// Multi-head latent attention, sigmoid group-limited routing, shared experts.
    DeepseekV3 => deepseek_v3::DeepseekV3 { vision_language: false },
    /// Mistral 3's vision-language wrapper of a DeepSeek-V3 text model (`model.language_model.`).
    DeepseekV3Multimodal => deepseek_v3::DeepseekV3 { vision_language: true },
    /// DeepSeek-V2: latent attention, softmax routing (`topk_method`), shared experts.
    DeepseekV2 => deepseek_v2::DeepseekV2ForCausalLM,
    /// GLM-4.5/4.6/4.7: partial rotary attention, DeepSeek-V3's routing.
    Glm4Moe => glm4_moe::Glm4MoeForCausalLM,
    /// GLM-4.7-Flash: DeepSeek-V3's latent attention and routing, `mlp_layer_types`.
    Glm4MoeLite => glm4_moe_lite::Glm4MoeLiteForCausalLM,
    /// Mistral Small 4: latent attention with llama-4 query scaling, softmax routing.
    Mistral4 => mistral4::Mistral4 { vision_language: false },
    /// Mistral 3's vision-language wrapper of a Mistral 4 text model (`model.language_model.`).
    Mistral4Multimodal => mistral4::Mistral4 { vision_language: true },
    /// gpt-oss: attention sinks, a router with a bias, clamped-SwiGLU experts (native MXFP4).
    GptOss => gpt_oss::GptOssForCausalLM,
}

impl Architecture {
    fn from_hf(name: &str, root: &Value) -> Option<Self> {
        let reads = |a: &Self| a.hf_name() == name && a.config().reads(root);
        Self::ALL.iter().copied().find(reads)
    }

    /// The first architecture of config.json's `architectures` that we serve.
    pub(super) fn of(root: &Value) -> Result<Self, LoadError> {
        let names: Vec<String> = required(
            root.get("architectures")
                .and_then(|a| serde_json::from_value(a.clone()).ok()),
            "architectures",
        )?;
        let from_hf = |name: &String| Self::from_hf(name, root);
        names.iter().find_map(from_hf).ok_or_else(|| {
            // One class name may be read several ways (Mistral 3 around two text models).
            let mut supported: Vec<&str> = Vec::new();
            for name in Self::ALL.iter().map(|a| a.hf_name()) {
                if !supported.contains(&name) {
                    supported.push(name);
                }
            }
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

    /// The text model's tensors may sit under `model.language_model` (or 4.x's
    /// `language_model.model`).
    pub fn reads_nested_text_model(self) -> bool {
        self.config().reads_nested_text_model()
    }

    /// Tensor prefixes a checkpoint of this architecture may hold that scoring never reads:
    /// the vision tower and projector of a vision-language checkpoint (only its text model is
    /// served), and Qwen3-Next's / Qwen3.5's multi-token-prediction head (`mtp.*`).
    pub fn unread_prefixes(self) -> &'static [&'static str] {
        self.config().unread_prefixes()
    }
}

#[cfg(test)]
mod tests {
    use super::Architecture;

    /// README's "Supported checkpoints" table names every class we serve (`/info` reports the
    /// served model's class, [`Architecture::hf_name`]).
    #[test]
    fn every_served_class_is_named_in_the_readme_table() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md");
        let readme = std::fs::read_to_string(path).unwrap();
        let section = readme
            .split("\n## ")
            .find(|s| s.starts_with("Supported checkpoints"))
            .expect("README.md has a `## Supported checkpoints` section");
        let missing: Vec<&str> = Architecture::ALL
            .iter()
            .map(|a| a.hf_name())
            .filter(|name| !section.contains(&format!("`{name}`")))
            .collect();
        assert!(missing.is_empty(), "not in README's table: {missing:?}");
    }
}
