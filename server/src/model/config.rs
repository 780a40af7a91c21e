//! `config.json` of a Hugging Face causal LM, in both key styles: transformers v4
//! (`rope_theta` + `rope_scaling`, `torch_dtype`) and v5 (`rope_parameters`, `dtype`).

use serde::Deserialize;
use serde_json::Value;

use super::checkpoint::LoadError;
use super::rope::inv_freq;

/// The model families that share the Llama block structure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Architecture {
    fn from_hf(name: &str) -> Option<Self> {
        match name {
            "LlamaForCausalLM" => Some(Self::Llama),
            "MistralForCausalLM" => Some(Self::Mistral),
            "Qwen2ForCausalLM" => Some(Self::Qwen2),
            "Qwen3ForCausalLM" => Some(Self::Qwen3),
            _ => None,
        }
    }

    pub fn hf_name(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
        }
    }
}

/// RoPE frequency schedule.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    Default,
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: f32,
    },
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2, or Llama with `attention_bias`).
    pub attention_bias: bool,
    pub mlp_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Mistral-style sliding-window attention: a token sees at most this many positions.
    pub sliding_window: Option<usize>,
    /// dtype the checkpoint was saved in (informational; compute dtype is chosen separately).
    pub checkpoint_dtype: String,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The raw `quantization_config`, parsed by `quant::compressed_tensors`.
    pub quantization_config: Option<Value>,
}

/// The keys we read; everything else in config.json is ignored.
#[derive(Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    hidden_act: Option<String>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    sliding_window: Option<Value>,
    use_sliding_window: Option<bool>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
    quantization_config: Option<Value>,
}

fn required<T>(value: Option<T>, field: &str) -> Result<T, LoadError> {
    value.ok_or_else(|| LoadError::config(field, "missing"))
}

/// A size from config.json, checked before anything is allocated from it: a corrupt or
/// hostile file must fail here, not ask for 10^15 layers. The bounds are far above any real
/// model (Llama 3.1 405B: 126 layers, hidden 16384, intermediate 53248, vocab 128256).
fn size(value: usize, field: &str, max: usize) -> Result<usize, LoadError> {
    if value == 0 || value > max {
        return Err(LoadError::config(
            field,
            format!("{value} is out of range (1..={max})"),
        ));
    }
    Ok(value)
}

/// A float from config.json that the math divides by, takes the root or the power of: NaN, ±∞,
/// 0 and negative values would turn every logit into NaN (`rms_norm_eps: -1` is a square root
/// of a negative number for a row of zeros; `rope_theta: 0` makes every frequency infinite).
/// The model computes in f32, so the value must also be finite and non-zero as an f32.
fn positive_finite(value: f64, field: &str) -> Result<f64, LoadError> {
    let as_f32 = value as f32;
    if !(as_f32.is_finite() && as_f32 > 0.0) {
        return Err(LoadError::config(
            field,
            format!("{value} is out of range (finite and > 0 in f32)"),
        ));
    }
    Ok(value)
}

fn token_ids(value: Option<&Value>) -> Vec<u32> {
    match value {
        Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(|v| v.as_u64().map(|v| v as u32))
            .collect(),
        _ => Vec::new(),
    }
}

impl ModelConfig {
    pub fn from_json(text: &str) -> Result<Self, LoadError> {
        // The path names the member of a wrong type (`num_hidden_layers: -1` is not a size).
        let raw: RawConfig =
            serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(text))
                .map_err(|e| {
                    let field = match e.path().to_string() {
                        path if path == "." => "config.json".to_string(),
                        path => path,
                    };
                    LoadError::config(field, e.into_inner().to_string())
                })?;
        let arch_names = required(raw.architectures, "architectures")?;
        let architecture = arch_names
            .iter()
            .find_map(|a| Architecture::from_hf(a))
            .ok_or_else(|| {
                LoadError::config(
                    "architectures",
                    format!(
                        "unsupported architecture {arch_names:?}; supported: LlamaForCausalLM, \
                         MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
                    ),
                )
            })?;
        let act = raw.hidden_act.as_deref().unwrap_or("silu");
        if act != "silu" {
            return Err(LoadError::config(
                "hidden_act",
                format!("`{act}` is not supported (only silu)"),
            ));
        }
        let hidden_size = size(
            required(raw.hidden_size, "hidden_size")?,
            "hidden_size",
            1 << 17,
        )?;
        let num_heads = size(
            required(raw.num_attention_heads, "num_attention_heads")?,
            "num_attention_heads",
            1 << 12,
        )?;
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(num_heads);
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(LoadError::config(
                "num_key_value_heads",
                format!("{num_kv_heads} must divide num_attention_heads = {num_heads}"),
            ));
        }
        // Without `head_dim` the heads split the hidden size: a remainder would be dropped.
        if raw.head_dim.is_none() && !hidden_size.is_multiple_of(num_heads) {
            return Err(LoadError::config(
                "num_attention_heads",
                format!(
                    "{num_heads} does not divide hidden_size = {hidden_size} (and no head_dim \
                     is given)"
                ),
            ));
        }
        let head_dim = size(
            raw.head_dim.unwrap_or(hidden_size / num_heads),
            "head_dim",
            1 << 12,
        )?;
        if !head_dim.is_multiple_of(2) {
            return Err(LoadError::config(
                "head_dim",
                format!("{head_dim} must be even"),
            ));
        }
        let (rope_theta, rope_scaling) =
            parse_rope(&raw.rope_parameters, &raw.rope_scaling, raw.rope_theta)?;
        // Each parameter in its range can still combine into a frequency that is not (a theta
        // near the smallest f32 gives infinite ones).
        if let Some(f) = inv_freq(head_dim, rope_theta, &rope_scaling)
            .into_iter()
            .find(|f| !(f.is_finite() && *f > 0.0))
        {
            return Err(LoadError::config(
                "rope_theta",
                format!("{rope_theta} gives a RoPE frequency of {f} (must be finite and > 0)"),
            ));
        }
        let sliding_window = match (architecture, raw.use_sliding_window, &raw.sliding_window) {
            // Qwen2/3 configs carry a `sliding_window` value that is only active with the flag.
            (Architecture::Qwen2 | Architecture::Qwen3, flag, _) if flag != Some(true) => None,
            (_, _, None | Some(Value::Null)) => None,
            // A window of 0 would leave a token nothing to attend to (a softmax over nothing).
            (_, _, Some(v)) => Some(size(
                v.as_u64().map_or(0, |v| v as usize),
                "sliding_window",
                1 << 30,
            )?),
        };
        Ok(Self {
            architecture,
            vocab_size: size(
                required(raw.vocab_size, "vocab_size")?,
                "vocab_size",
                1 << 24,
            )?,
            hidden_size,
            intermediate_size: size(
                required(raw.intermediate_size, "intermediate_size")?,
                "intermediate_size",
                1 << 20,
            )?,
            num_layers: size(
                required(raw.num_hidden_layers, "num_hidden_layers")?,
                "num_hidden_layers",
                1 << 12,
            )?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: positive_finite(raw.rms_norm_eps.unwrap_or(1e-6), "rms_norm_eps")?,
            rope_theta,
            rope_scaling,
            max_position_embeddings: size(
                raw.max_position_embeddings.unwrap_or(4096),
                "max_position_embeddings",
                1 << 30,
            )?,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            attention_bias: architecture == Architecture::Qwen2
                || raw.attention_bias.unwrap_or(false),
            mlp_bias: raw.mlp_bias.unwrap_or(false),
            qk_norm: architecture == Architecture::Qwen3,
            sliding_window,
            checkpoint_dtype: raw
                .dtype
                .or(raw.torch_dtype)
                .unwrap_or_else(|| "float32".into()),
            bos_token_id: token_ids(raw.bos_token_id.as_ref()).first().copied(),
            eos_token_ids: token_ids(raw.eos_token_id.as_ref()),
            quantization_config: raw.quantization_config,
        })
    }
}

/// v5 puts everything in `rope_parameters`; v4 has `rope_theta` at the top level and the
/// schedule in `rope_scaling` (whose type key is `rope_type`, or `type` in old files).
fn parse_rope(
    v5: &Option<Value>,
    v4_scaling: &Option<Value>,
    v4_theta: Option<f64>,
) -> Result<(f32, RopeScaling), LoadError> {
    let (field, params) = match (v5, v4_scaling) {
        (Some(p), _) => ("rope_parameters", Some(p)),
        (None, Some(Value::Null)) | (None, None) => ("rope_scaling", None),
        (None, Some(s)) => ("rope_scaling", Some(s)),
    };
    let get = |key: &str| params.and_then(|p| p.get(key)).and_then(Value::as_f64);
    let theta_field = match get("rope_theta") {
        Some(_) => format!("{field}.rope_theta"),
        None => "rope_theta".into(),
    };
    let theta = get("rope_theta").or(v4_theta).ok_or_else(|| {
        LoadError::config(
            "rope_theta",
            "missing (neither rope_parameters.rope_theta nor rope_theta)",
        )
    })?;
    let theta = positive_finite(theta, &theta_field)?;
    let rope_type = params
        .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let scaling = match rope_type {
        "default" => RopeScaling::Default,
        "llama3" => {
            // Each is a divisor of the schedule (transformers' own checks: factor >= 1 and
            // low_freq_factor < high_freq_factor, else the smoothing divides by zero or less).
            let need = |key: &str| {
                let name = format!("{field}.{key}");
                let value = get(key)
                    .ok_or_else(|| LoadError::config(&name, "missing for rope_type llama3"))?;
                positive_finite(value, &name).map(|v| v as f32)
            };
            let factor = need("factor")?;
            if factor < 1.0 {
                return Err(LoadError::config(
                    format!("{field}.factor"),
                    format!("{factor} is out of range (>= 1)"),
                ));
            }
            let (low_freq_factor, high_freq_factor) =
                (need("low_freq_factor")?, need("high_freq_factor")?);
            if low_freq_factor >= high_freq_factor {
                return Err(LoadError::config(
                    format!("{field}.high_freq_factor"),
                    format!(
                        "{high_freq_factor} must be greater than low_freq_factor = \
                         {low_freq_factor}"
                    ),
                ));
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: need("original_max_position_embeddings")?,
            }
        }
        other => {
            return Err(LoadError::config(
                format!("{field}.rope_type"),
                format!("`{other}` is not supported (supported: default, llama3)"),
            ))
        }
    };
    Ok((theta as f32, scaling))
}

#[cfg(test)]
mod tests {
    use super::*;

    const V5: &str = r#"{"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":8,
        "intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,
        "rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":8.0,"low_freq_factor":1.0,
        "high_freq_factor":4.0,"original_max_position_embeddings":8192},"dtype":"bfloat16","eos_token_id":[3,4]}"#;
    const V4: &str = r#"{"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":8,
        "intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,
        "rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
        "high_freq_factor":4.0,"original_max_position_embeddings":8192},"torch_dtype":"bfloat16","eos_token_id":3}"#;

    #[test]
    fn v4_and_v5_styles_agree() {
        let a = ModelConfig::from_json(V5).unwrap();
        let b = ModelConfig::from_json(V4).unwrap();
        assert_eq!(a.rope_scaling, b.rope_scaling);
        assert_eq!(a.rope_theta, 500000.0);
        assert_eq!(b.rope_theta, 500000.0);
        assert_eq!(a.checkpoint_dtype, "bfloat16");
        assert_eq!(b.checkpoint_dtype, "bfloat16");
        assert_eq!(a.eos_token_ids, vec![3, 4]);
        assert_eq!(b.eos_token_ids, vec![3]);
        assert_eq!(a.head_dim, 4);
    }

    #[test]
    fn unknown_rope_type_is_refused_with_field() {
        let text = V4.replace("\"rope_type\":\"llama3\"", "\"rope_type\":\"yarn\"");
        let err = ModelConfig::from_json(&text).unwrap_err().to_string();
        assert!(
            err.contains("rope_scaling.rope_type") && err.contains("yarn"),
            "{err}"
        );
    }

    #[test]
    fn unsupported_architecture_is_refused() {
        let text = V4.replace("LlamaForCausalLM", "GPT2LMHeadModel");
        let err = ModelConfig::from_json(&text).unwrap_err().to_string();
        assert!(
            err.contains("architectures") && err.contains("GPT2LMHeadModel"),
            "{err}"
        );
    }

    #[test]
    fn negative_or_fractional_sizes_name_their_field() {
        for (from, to, field) in [
            (
                r#""num_hidden_layers":1"#,
                r#""num_hidden_layers":-1"#,
                "num_hidden_layers",
            ),
            (r#""hidden_size":8"#, r#""hidden_size":8.5"#, "hidden_size"),
            (r#""vocab_size":10"#, r#""vocab_size":"10""#, "vocab_size"),
        ] {
            let err = ModelConfig::from_json(&V4.replace(from, to))
                .unwrap_err()
                .to_string();
            assert!(err.starts_with(&format!("config field `{field}`")), "{err}");
        }
    }

    #[test]
    fn old_type_key_and_plain_theta() {
        let text = r#"{"architectures":["MistralForCausalLM"],"vocab_size":10,"hidden_size":8,
        "intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,"rope_theta":10000.0,
        "rope_scaling":null,"sliding_window":4096}"#;
        let c = ModelConfig::from_json(text).unwrap();
        assert_eq!(c.rope_scaling, RopeScaling::Default);
        assert_eq!(c.num_kv_heads, 2);
        assert_eq!(c.sliding_window, Some(4096));
    }
}
