//! The KV cache's quantization as vLLM deploys it (docs/kv-cache.md): a compressed-tensors
//! `kv_cache_scheme` (fp8 e4m3, static k/v scales per tensor or per KV head), or, on a
//! checkpoint without one, the what-if `--kv-cache-dtype fp8_e4m3` with dynamic per-head
//! scales. Where the QDQ applies (after RoPE, q too) is `model::blocks::attention`'s.

use candle_core::Device;
use serde::Deserialize;
use serde_json::Value;

use super::{to_f32_vec, SCALE_DTYPES};
use crate::checkpoint::{Checkpoint, LoadError};
use crate::ops::HeadScales;

const FIELD: &str = "quantization_config.kv_cache_scheme";

/// `--kv-cache-quant`: whether a checkpoint's `kv_cache_scheme` is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheQuant {
    /// Quantize K and V (and q) as vLLM's fp8 FlashAttention path does (default).
    #[default]
    Emulate,
    /// Attention in the compute dtype: the scales are read and checked, not applied.
    Off,
}

/// `--kv-cache-dtype`: `fp8_e4m3` simulates an fp8 KV cache on a checkpoint without a
/// `kv_cache_scheme`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheDtype {
    #[default]
    Auto,
    Fp8E4m3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvCacheOptions {
    pub quant: KvCacheQuant,
    pub dtype: KvCacheDtype,
}

impl KvCacheOptions {
    /// The flags' values as the command line spells them: (`--kv-cache-quant`,
    /// `--kv-cache-dtype`), for `/info`.
    pub fn flag_values(self) -> (&'static str, &'static str) {
        let quant = match self.quant {
            KvCacheQuant::Emulate => "emulate",
            KvCacheQuant::Off => "off",
        };
        let dtype = match self.dtype {
            KvCacheDtype::Auto => "auto",
            KvCacheDtype::Fp8E4m3 => "fp8_e4m3",
        };
        (quant, dtype)
    }
}

/// How the stored k/v scales are shaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvScaleStrategy {
    /// One scale per layer: `k_scale` / `v_scale` of shape `[1]`.
    Tensor,
    /// One scale per KV head: `[num_key_value_heads, 1, 1]`.
    AttnHead,
}

/// A parsed `kv_cache_scheme`: what vLLM serves (`CompressedTensorsKVCacheMethod`): static,
/// symmetric fp8 e4m3 scales per tensor or per attention head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheScheme {
    pub strategy: KvScaleStrategy,
}

/// compressed-tensors' `QuantizationArgs` fields, with its defaults; any other is refused.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScheme {
    #[serde(default = "eight")]
    num_bits: u32,
    #[serde(rename = "type", default = "int")]
    kind: String,
    #[serde(default = "yes")]
    symmetric: bool,
    #[serde(default)]
    strategy: Option<String>,
    #[serde(default)]
    dynamic: Value,
    #[serde(default)]
    group_size: Value,
    #[serde(default)]
    block_structure: Value,
    #[serde(default)]
    actorder: Value,
    #[serde(default)]
    scale_dtype: Value,
    #[serde(default)]
    zp_dtype: Value,
    // How llm-compressor calibrated the scales: nothing to apply.
    #[serde(default)]
    #[allow(dead_code)]
    observer: Value,
    #[serde(default)]
    #[allow(dead_code)]
    observer_kwargs: Value,
}

fn eight() -> u32 {
    8
}
fn int() -> String {
    "int".into()
}
fn yes() -> bool {
    true
}

impl KvCacheScheme {
    /// The scheme of `raw` (`None` for null or `{}`).
    pub fn parse(raw: &Value) -> Result<Option<Self>, LoadError> {
        if raw.is_null() || raw.as_object().is_some_and(|m| m.is_empty()) {
            return Ok(None);
        }
        let raw: RawScheme = serde_json::from_value(raw.clone())
            .map_err(|e| LoadError::config(FIELD, e.to_string()))?;
        let field = |f: &str| format!("{FIELD}.{f}");
        let refuse = |f: &str, why: String| Err(LoadError::config(field(f), why));
        if raw.kind != "float" {
            return refuse("type", format!("`{}`: only `float` (fp8 e4m3)", raw.kind));
        }
        if raw.num_bits != 8 {
            return refuse("num_bits", format!("{}: only 8 (fp8 e4m3)", raw.num_bits));
        }
        if !raw.symmetric {
            return refuse("symmetric", "false: vLLM's KV cache is symmetric".into());
        }
        if !matches!(raw.dynamic, Value::Null | Value::Bool(false)) {
            return refuse(
                "dynamic",
                format!(
                    "{}: only static scales (stored k_scale / v_scale)",
                    raw.dynamic
                ),
            );
        }
        for (name, value) in [
            ("group_size", &raw.group_size),
            ("block_structure", &raw.block_structure),
            ("actorder", &raw.actorder),
            ("scale_dtype", &raw.scale_dtype),
            ("zp_dtype", &raw.zp_dtype),
        ] {
            if !value.is_null() {
                return refuse(name, format!("{value}: not supported for the KV cache"));
            }
        }
        let strategy = match raw.strategy.as_deref() {
            Some("tensor") | None => KvScaleStrategy::Tensor,
            Some("attn_head") => KvScaleStrategy::AttnHead,
            Some(other) => {
                return refuse(
                    "strategy",
                    format!("`{other}`: vLLM reads `tensor` or `attn_head`"),
                )
            }
        };
        Ok(Some(Self { strategy }))
    }
}

/// What one attention layer applies to its post-RoPE q, k and v: vLLM's fp8 FlashAttention 3
/// path (docs/kv-cache.md).
#[derive(Debug, Clone, PartialEq)]
pub struct KvCacheQdq {
    /// q's static scale: 1.0, vLLM's placeholder when the checkpoint stores no `q_scale`.
    pub query: HeadScales,
    pub key: HeadScales,
    pub value: HeadScales,
}

impl KvCacheQdq {
    /// The QDQ of the attention whose tensors are `prefix.*` (`….self_attn`), with
    /// `num_kv_heads` heads, under `scheme` and `opts`; `None` when the KV cache stays in the
    /// compute dtype. A scheme's scales are read and checked even when `--kv-cache-quant off`.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        num_kv_heads: usize,
        scheme: Option<&KvCacheScheme>,
        opts: KvCacheOptions,
    ) -> Result<Option<Self>, LoadError> {
        let Some(scheme) = scheme else {
            return Ok((opts.dtype == KvCacheDtype::Fp8E4m3).then(|| Self {
                query: HeadScales::Static(vec![1.0]),
                key: HeadScales::AbsMax,
                value: HeadScales::AbsMax,
            }));
        };
        if opts.dtype == KvCacheDtype::Fp8E4m3 {
            return Err(LoadError::config(
                "--kv-cache-dtype",
                format!(
                    "fp8_e4m3 simulates a KV cache for checkpoints without one; this one \
                     declares `{FIELD}` (use --kv-cache-quant emulate|off)"
                ),
            ));
        }
        let expected = match scheme.strategy {
            KvScaleStrategy::Tensor => vec![1],
            KvScaleStrategy::AttnHead => vec![num_kv_heads, 1, 1],
        };
        let scales = |kind: &str| -> Result<HeadScales, LoadError> {
            let name = format!("{prefix}.{kind}_scale");
            let t = ckpt.tensor(&name, SCALE_DTYPES, None, &Device::Cpu)?;
            if t.dims() != expected.as_slice() {
                return Err(LoadError::WrongShape {
                    name,
                    found: t.dims().to_vec(),
                    expected: expected.clone(),
                });
            }
            let values = to_f32_vec(&t)?;
            if let Some(bad) = values.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
                return Err(LoadError::BadTensor {
                    name,
                    reason: format!("a KV-cache scale must be finite and positive, found {bad}"),
                });
            }
            Ok(HeadScales::Static(values))
        };
        let (key, value) = (scales("k")?, scales("v")?);
        Ok((opts.quant == KvCacheQuant::Emulate).then(|| Self {
            query: HeadScales::Static(vec![1.0]),
            key,
            value,
        }))
    }

    /// Refuses a KV-cache quantization for an attention of kind `what` (MLA, linear
    /// attention, …) that vLLM caches otherwise: `layer` names it.
    pub fn refuse(
        scheme: Option<&KvCacheScheme>,
        opts: KvCacheOptions,
        layer: &str,
        what: &str,
    ) -> Result<(), LoadError> {
        let reason = match (scheme, opts.dtype) {
            (Some(_), _) => format!("`{FIELD}` is set"),
            (None, KvCacheDtype::Fp8E4m3) => "--kv-cache-dtype fp8_e4m3 is set".into(),
            (None, KvCacheDtype::Auto) => return Ok(()),
        };
        Err(LoadError::Unsupported {
            layer: layer.into(),
            field: "kv_cache_scheme".into(),
            reason: format!("{reason}, but KV-cache quantization of {what} is not supported"),
        })
    }

    /// What `/info` reports of a model loaded with `scheme` and `opts` (`None`: the KV cache
    /// stays in the compute dtype).
    pub fn describe(scheme: Option<&KvCacheScheme>, opts: KvCacheOptions) -> Option<String> {
        const PATH: &str = "q static scale 1.0, after RoPE, as vLLM's FlashAttention 3 fp8 path";
        match (scheme.map(|s| s.strategy), opts.quant, opts.dtype) {
            (Some(_), KvCacheQuant::Off, _) => None,
            (Some(s), KvCacheQuant::Emulate, _) => Some(format!(
                "fp8 e4m3 k and v, {} static scales from kv_cache_scheme; {PATH}",
                match s {
                    KvScaleStrategy::Tensor => "per-tensor",
                    KvScaleStrategy::AttnHead => "per-head",
                }
            )),
            (None, _, KvCacheDtype::Fp8E4m3) => Some(format!(
                "simulation (--kv-cache-dtype fp8_e4m3, not in the checkpoint): fp8 e4m3 k and \
                 v, dynamic per-head scales absmax/448 per sequence; {PATH}"
            )),
            (None, _, KvCacheDtype::Auto) => None,
        }
    }
}
