//! compressed-tensors `quantization_config`: config groups, `targets` / `ignore` resolution, and
//! the refusal of everything we cannot compute exactly.

use std::collections::BTreeMap;

use regex::Regex;
use serde::Deserialize;
use serde_json::Value;

use super::kv_cache::KvCacheScheme;
use crate::checkpoint::LoadError;

/// On-disk layout of a quantized Linear (the `format` key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Format {
    /// Integer codes packed into int32 words (`weight_packed`).
    PackQuantized,
    /// Integer codes stored one per byte in `weight` (`int-quantized`, `naive-quantized`).
    IntQuantized,
    /// NVFP4: fp4 e2m1 codes, fp8 group scales, f32 global scale.
    Nvfp4PackQuantized,
    /// MXFP4: fp4 e2m1 codes, a UE8M0 (power of two) scale per 32.
    Mxfp4PackQuantized,
    /// FP8 e4m3 weights with tensor, channel or block scales.
    FloatQuantized,
    /// Native GPTQ (`quant_method: gptq`), zero points stored minus one (`checkpoint_format:
    /// gptq`, "v1").
    Gptq,
    /// Native GPTQ with zero points stored as they are (`checkpoint_format: gptq_v2`).
    GptqV2,
    /// Native AWQ (`quant_method: awq`, `version: gemm`).
    Awq,
    /// Hugging Face FP8 (`quant_method: fp8`): e4m3 weights, `weight_scale_inv` per block.
    HfFp8,
    /// NVIDIA ModelOpt NVFP4 (`quant_method: modelopt`): NVFP4 codes in `weight`, a
    /// multiplying `weight_scale_2`, a static `input_scale`.
    ModeloptNvfp4,
    /// NVIDIA ModelOpt FP8: e4m3 `weight`, per-tensor `weight_scale`, static `input_scale`.
    ModeloptFp8,
}

impl Format {
    fn parse(name: &str, layer: &str) -> Result<Self, LoadError> {
        match name {
            "pack-quantized" => Ok(Self::PackQuantized),
            "int-quantized" | "naive-quantized" => Ok(Self::IntQuantized),
            "nvfp4-pack-quantized" => Ok(Self::Nvfp4PackQuantized),
            "mxfp4-pack-quantized" => Ok(Self::Mxfp4PackQuantized),
            "float-quantized" => Ok(Self::FloatQuantized),
            other => Err(unsupported(
                layer,
                "format",
                format!(
                    "`{other}` is not supported (supported: pack-quantized, int-quantized, \
                     naive-quantized, nvfp4-pack-quantized, mxfp4-pack-quantized, \
                     float-quantized)"
                ),
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::PackQuantized => "pack-quantized",
            Self::IntQuantized => "int-quantized",
            Self::Nvfp4PackQuantized => "nvfp4-pack-quantized",
            Self::Mxfp4PackQuantized => "mxfp4-pack-quantized",
            Self::FloatQuantized => "float-quantized",
            Self::Gptq => "gptq",
            Self::GptqV2 => "gptq_v2",
            Self::Awq => "awq",
            Self::HfFp8 => "fp8",
            Self::ModeloptNvfp4 => "modelopt nvfp4",
            Self::ModeloptFp8 => "modelopt fp8",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantType {
    Int,
    Float,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Tensor,
    Channel,
    Group,
    Block,
    Token,
    TensorGroup,
}

/// One `weights` / `input_activations` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantArgs {
    pub num_bits: u32,
    pub kind: QuantType,
    pub symmetric: bool,
    pub strategy: Strategy,
    pub group_size: Option<usize>,
    pub block_structure: Option<[usize; 2]>,
    pub dynamic: bool,
    /// Act-order with a stored group index per input (`actorder: group`, GPTQ's `desc_act`).
    pub actorder: bool,
    /// Scales that are powers of two (UE8M0: Hugging Face FP8's `scale_fmt: ue8m0`): stored so
    /// for weights, rounded up to one for dynamic activations.
    pub power_of_two_scales: bool,
}

#[derive(Deserialize)]
struct RawArgs {
    num_bits: u32,
    #[serde(rename = "type")]
    kind: String,
    #[serde(default = "yes")]
    symmetric: bool,
    group_size: Option<i64>,
    strategy: Option<String>,
    #[serde(default)]
    block_structure: Value,
    #[serde(default)]
    dynamic: Value,
    #[serde(default)]
    actorder: Value,
}

fn yes() -> bool {
    true
}

fn unsupported(layer: &str, field: impl Into<String>, reason: impl Into<String>) -> LoadError {
    LoadError::Unsupported {
        layer: layer.into(),
        field: field.into(),
        reason: reason.into(),
    }
}

impl QuantArgs {
    /// Static integer weights of `num_bits`, per group of `group_size` inputs (per output
    /// channel without one): what the native GPTQ and AWQ configs describe.
    pub fn int_weights(
        num_bits: u32,
        symmetric: bool,
        group_size: Option<usize>,
        actorder: bool,
    ) -> Self {
        Self {
            num_bits,
            kind: QuantType::Int,
            symmetric,
            strategy: match group_size {
                Some(_) => Strategy::Group,
                None => Strategy::Channel,
            },
            group_size,
            block_structure: None,
            dynamic: false,
            actorder,
            power_of_two_scales: false,
        }
    }

    fn parse(raw: &Value, group: &str, role: &str) -> Result<Self, LoadError> {
        let field = |f: &str| format!("config_groups.{group}.{role}.{f}");
        let raw: RawArgs = serde_json::from_value(raw.clone()).map_err(|e| {
            unsupported(
                group,
                format!("config_groups.{group}.{role}"),
                e.to_string(),
            )
        })?;
        let kind = match raw.kind.as_str() {
            "int" => QuantType::Int,
            "float" => QuantType::Float,
            other => {
                return Err(unsupported(
                    group,
                    field("type"),
                    format!("`{other}` is not supported"),
                ))
            }
        };
        let strategy = match raw.strategy.as_deref() {
            Some("tensor") => Strategy::Tensor,
            Some("channel") => Strategy::Channel,
            Some("group") => Strategy::Group,
            Some("block") => Strategy::Block,
            Some("token") => Strategy::Token,
            Some("tensor_group") => Strategy::TensorGroup,
            None if raw.group_size.is_some_and(|g| g > 0) => Strategy::Group,
            None => Strategy::Tensor,
            Some(other) => {
                return Err(unsupported(
                    group,
                    field("strategy"),
                    format!("`{other}` is not supported"),
                ))
            }
        };
        let actorder = match &raw.actorder {
            Value::Null | Value::Bool(false) => false,
            // "weight"/"static" reorder only during calibration and store no g_idx.
            Value::String(s) if s == "weight" || s == "static" => false,
            // "group" (and `true`, its old spelling): a `weight_g_idx` per Linear.
            Value::String(s) if s == "group" => true,
            Value::Bool(true) => true,
            other => {
                return Err(unsupported(
                    group,
                    field("actorder"),
                    format!("{other} is not supported (group, weight, static, null)"),
                ))
            }
        };
        let dynamic = match &raw.dynamic {
            Value::Null | Value::Bool(false) => false,
            Value::Bool(true) => true,
            // NVFP4 activations: per-group scales computed at run time against a stored global scale.
            Value::String(s) if s == "local" => true,
            other => {
                return Err(unsupported(
                    group,
                    field("dynamic"),
                    format!("{other} is not supported"),
                ))
            }
        };
        let block_structure = match &raw.block_structure {
            Value::Null => None,
            Value::Array(items) if items.len() == 2 => {
                let dims: Vec<usize> = items
                    .iter()
                    .filter_map(|v| v.as_u64().map(|v| v as usize))
                    .collect();
                match dims[..] {
                    [a, b] if a > 0 && b > 0 => Some([a, b]),
                    _ => {
                        return Err(unsupported(
                            group,
                            field("block_structure"),
                            format!("{items:?}"),
                        ))
                    }
                }
            }
            other => {
                return Err(unsupported(
                    group,
                    field("block_structure"),
                    format!("{other} is not [rows, cols]"),
                ))
            }
        };
        Ok(Self {
            num_bits: raw.num_bits,
            kind,
            symmetric: raw.symmetric,
            strategy,
            group_size: raw.group_size.filter(|g| *g > 0).map(|g| g as usize),
            block_structure,
            dynamic,
            actorder,
            power_of_two_scales: false,
        })
    }
}

/// What one Linear layer is: its on-disk format, weight arguments and optional activation
/// quantization.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerScheme {
    pub group: String,
    pub format: Format,
    pub weights: QuantArgs,
    pub input_activations: Option<QuantArgs>,
}

/// A target or ignore pattern: exact module name, `re:` regex (Python `re.match`, so anchored
/// at the start), or a module class name such as `Linear`.
#[derive(Debug, Clone)]
enum Target {
    Name(String),
    Regex(Regex),
    Class(String),
}

impl Target {
    fn parse(text: &str, field: &str) -> Result<Self, LoadError> {
        if let Some(pattern) = text.strip_prefix("re:") {
            let regex = Regex::new(&format!("^(?:{pattern})"))
                .map_err(|e| LoadError::config(field, format!("bad regex `{pattern}`: {e}")))?;
            Ok(Self::Regex(regex))
        } else if text.contains('.') || text.chars().next().is_some_and(char::is_lowercase) {
            Ok(Self::Name(text.into()))
        } else {
            Ok(Self::Class(text.into()))
        }
    }

    /// Match precedence as in compressed-tensors: exact name beats regex beats class.
    fn precedence(&self, module: &str, class: &str) -> Option<u8> {
        match self {
            Self::Name(n) if n == module => Some(0),
            Self::Regex(r) if r.is_match(module) => Some(1),
            Self::Class(c) if c == class => Some(2),
            _ => None,
        }
    }
}

struct Group {
    name: String,
    targets: Vec<Target>,
    scheme: LayerScheme,
}

/// A parsed `quantization_config`.
pub struct QuantizationConfig {
    groups: Vec<Group>,
    ignore: Vec<Target>,
    /// Patterns tried in order before the groups, the first match deciding (GPTQModel's
    /// `dynamic`): `None` for not quantized.
    ordered: Vec<(Regex, Option<LayerScheme>)>,
    /// The `kv_cache_scheme`, where the checkpoint has one.
    pub kv_cache: Option<KvCacheScheme>,
    /// gpt-oss's native MXFP4 (`quant_method: mxfp4`): its experts' `*_blocks` / `*_scales`
    /// (`quant::mxfp4::load_native_experts`); no Linear is quantized.
    pub native_mxfp4: bool,
}

#[derive(Deserialize)]
struct RawConfig {
    quant_method: Option<String>,
    format: Option<String>,
    quantization_status: Option<String>,
    #[serde(default)]
    config_groups: BTreeMap<String, Value>,
    #[serde(default)]
    ignore: Vec<String>,
    #[serde(default)]
    sparsity_config: Value,
    #[serde(default)]
    transform_config: Value,
    #[serde(default)]
    kv_cache_scheme: Value,
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(m) => m.is_empty(),
        _ => false,
    }
}

/// transformers' `should_convert_module` match of a `modules_to_not_convert` entry `key`
/// (`re.match(key, name) or name.endswith(key)`), for the config field `field`.
pub(crate) fn skip_pattern(key: &str, field: &str) -> Result<Regex, LoadError> {
    Regex::new(&format!("^(?:{key})|{}$", regex::escape(key)))
        .map_err(|e| LoadError::config(field, format!("bad pattern `{key}`: {e}")))
}

/// Why a checkpoint quantized by `method` is refused, and what to do instead.
fn unsupported_method(method: Option<&str>) -> String {
    const READS: &str = "ExactScore reads compressed-tensors checkpoints (quant_method \
                         \"compressed-tensors\": what llm-compressor writes and vLLM serves), \
                         native GPTQ (\"gptq\"), AutoRound (\"auto-round\"), AWQ (\"awq\"), \
                         FP8 (\"fp8\"), ModelOpt NVFP4 (\"modelopt\") and gpt-oss's MXFP4 \
                         (\"mxfp4\")";
    match method {
        Some(m) => format!(
            "\"{m}\" is not supported. {READS}: quantize the original with llm-compressor, \
             or score the unquantized original"
        ),
        None => format!("missing. {READS}"),
    }
}

impl QuantizationConfig {
    pub fn parse(raw: &Value) -> Result<Self, LoadError> {
        const ROOT: &str = "quantization_config";
        match raw.get("quant_method").and_then(Value::as_str) {
            Some("gptq") => return Self::gptq(raw),
            Some("auto-round") => return Self::auto_round(raw),
            Some("awq") => return Self::awq(raw),
            Some("fp8") => return Self::hf_fp8(raw),
            Some("modelopt") => return Self::modelopt(raw),
            Some("mxfp4") => return Self::native_mxfp4(raw),
            // hf_quant_config.json names its producer instead.
            None if raw.pointer("/producer/name").and_then(Value::as_str) == Some("modelopt") => {
                return Self::modelopt(raw)
            }
            _ => {}
        }
        let cfg: RawConfig = serde_json::from_value(raw.clone())
            .map_err(|e| LoadError::config(ROOT, e.to_string()))?;
        match cfg.quant_method.as_deref() {
            Some("compressed-tensors") => {}
            other => {
                return Err(LoadError::config(
                    format!("{ROOT}.quant_method"),
                    unsupported_method(other),
                ))
            }
        }
        if let Some(status) = cfg.quantization_status.as_deref() {
            if status != "compressed" {
                return Err(LoadError::config(
                    format!("{ROOT}.quantization_status"),
                    format!("`{status}` is not supported (only compressed checkpoints)"),
                ));
            }
        }
        for (field, value) in [
            ("sparsity_config", &cfg.sparsity_config),
            ("transform_config", &cfg.transform_config),
        ] {
            if !is_empty(value) {
                return Err(LoadError::config(
                    format!("{ROOT}.{field}"),
                    format!("is set ({value}); not supported: it would be silently ignored"),
                ));
            }
        }
        // The top-level format is the default of every group; "mixed-precision" says the
        // groups differ and each names its own.
        if let Some(top) = cfg.format.as_deref().filter(|f| *f != "mixed-precision") {
            Format::parse(top, ROOT)?;
        }
        let mut groups = Vec::new();
        for (name, group) in &cfg.config_groups {
            let field = |f: &str| format!("{ROOT}.config_groups.{name}.{f}");
            if !is_empty(group.get("output_activations").unwrap_or(&Value::Null)) {
                return Err(unsupported(
                    name,
                    field("output_activations"),
                    "output activation quantization is not supported",
                ));
            }
            let weights = match group.get("weights") {
                Some(w) if !w.is_null() => QuantArgs::parse(w, name, "weights")?,
                _ => {
                    return Err(unsupported(
                        name,
                        field("weights"),
                        "groups without weight quantization are not supported",
                    ))
                }
            };
            let input_activations = match group.get("input_activations") {
                Some(a) if !a.is_null() => Some(QuantArgs::parse(a, name, "input_activations")?),
                _ => None,
            };
            let format_name = group
                .get("format")
                .and_then(Value::as_str)
                .or(cfg.format.as_deref())
                .ok_or_else(|| {
                    unsupported(
                        name,
                        field("format"),
                        "no format in the group nor at the top level",
                    )
                })?;
            let format = Format::parse(format_name, name)?;
            let targets = group
                .get("targets")
                .and_then(Value::as_array)
                .ok_or_else(|| LoadError::config(field("targets"), "missing or not a list"))?
                .iter()
                .map(|t| {
                    let text = t.as_str().ok_or_else(|| {
                        LoadError::config(field("targets"), format!("{t} is not a string"))
                    })?;
                    Target::parse(text, &field("targets"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let scheme = LayerScheme {
                group: name.clone(),
                format,
                weights,
                input_activations,
            };
            check_scheme(&scheme)?;
            groups.push(Group {
                name: name.clone(),
                targets,
                scheme,
            });
        }
        let ignore = cfg
            .ignore
            .iter()
            .map(|t| Target::parse(t, &format!("{ROOT}.ignore")))
            .collect::<Result<Vec<_>, _>>()?;
        let kv_cache = KvCacheScheme::parse(&cfg.kv_cache_scheme)?;
        Ok(Self {
            groups,
            ignore,
            kv_cache,
            ordered: Vec::new(),
            native_mxfp4: false,
        })
    }

    /// A GPTQ config as one group: every Linear (only those `modules_in_block_to_quantize`
    /// names, where it is set), `lm_head` unless the config quantizes it too. Which of them a
    /// checkpoint actually quantized, its `qweight` tensors say (`load_linear`): GPTQ configs
    /// do not list them (GPTQModel's model definitions do, and leave out e.g. MoE gates).
    fn gptq(raw: &Value) -> Result<Self, LoadError> {
        let mut cfg = super::gptq::parse_config(raw)?;
        let ordered = std::mem::take(&mut cfg.dynamic);
        let targets = match &cfg.modules {
            None => vec![Target::Class("Linear".into())],
            Some(names) => {
                let names: Vec<String> = names.iter().map(|n| regex::escape(n)).collect();
                let pattern = format!(r".*\.(?:{})$", names.join("|"));
                vec![Target::Regex(Regex::new(&pattern).map_err(|e| {
                    LoadError::config(
                        "quantization_config.modules_in_block_to_quantize",
                        e.to_string(),
                    )
                })?)]
            }
        };
        let ignore = match cfg.lm_head {
            true => vec![],
            false => vec![Target::Name("lm_head".into())],
        };
        Ok(Self {
            groups: vec![Group {
                name: cfg.scheme.group.clone(),
                targets,
                scheme: cfg.scheme,
            }],
            ignore,
            kv_cache: None,
            ordered,
            native_mxfp4: false,
        })
    }

    /// An AutoRound config: one group for the Linears under its blocks (every Linear but
    /// `lm_head` without them), one per `extra_config` entry by exact name, which beats the
    /// blocks (an entry of 16 bits or more: that module is not quantized). Which Linears a
    /// checkpoint quantized, their `qweight` tensors say, as for GPTQ.
    fn auto_round(raw: &Value) -> Result<Self, LoadError> {
        let cfg = super::auto_round::parse_config(raw)?;
        let targets = match &cfg.blocks {
            None => vec![Target::Class("Linear".into())],
            Some(prefixes) => {
                let prefixes: Vec<String> = prefixes.iter().map(|p| regex::escape(p)).collect();
                let pattern = format!(r"^(?:{})", prefixes.join("|"));
                vec![Target::Regex(Regex::new(&pattern).map_err(|e| {
                    LoadError::config("quantization_config.block_name_to_quantize", e.to_string())
                })?)]
            }
        };
        let mut groups = vec![Group {
            name: "auto-round".into(),
            targets,
            scheme: cfg.scheme,
        }];
        let mut ignore = Vec::new();
        let mut lm_head_named = false;
        for (name, scheme) in cfg.overrides {
            lm_head_named |= name == "lm_head";
            match scheme {
                None => ignore.push(Target::Name(name)),
                Some(scheme) => groups.push(Group {
                    name: format!("extra_config.{name}"),
                    targets: vec![Target::Name(name)],
                    scheme,
                }),
            }
        }
        if !lm_head_named {
            ignore.push(Target::Name("lm_head".into()));
        }
        Ok(Self {
            groups,
            ignore,
            kv_cache: None,
            ordered: Vec::new(),
            native_mxfp4: false,
        })
    }

    /// An AWQ config as one group: every Linear but `modules_to_not_convert` and `lm_head`.
    /// Which of them a checkpoint actually quantized, its `qweight` tensors say, as for GPTQ.
    fn awq(raw: &Value) -> Result<Self, LoadError> {
        let cfg = super::awq::parse_config(raw)?;
        Ok(Self {
            groups: vec![Group {
                name: cfg.scheme.group.clone(),
                targets: vec![Target::Class("Linear".into())],
                scheme: cfg.scheme,
            }],
            ignore: cfg.not_converted.into_iter().map(Target::Regex).collect(),
            kv_cache: None,
            ordered: Vec::new(),
            native_mxfp4: false,
        })
    }

    /// An FP8 config as one group: every Linear but `modules_to_not_convert`. Which of them a
    /// checkpoint quantized, their `weight_scale_inv` tensors say (transformers dequantizes
    /// exactly the weights that have one).
    fn hf_fp8(raw: &Value) -> Result<Self, LoadError> {
        let cfg = super::hf_fp8::parse_config(raw)?;
        Ok(Self {
            groups: vec![Group {
                name: cfg.scheme.group.clone(),
                targets: vec![Target::Class("Linear".into())],
                scheme: cfg.scheme,
            }],
            ignore: cfg.not_converted.into_iter().map(Target::Regex).collect(),
            kv_cache: None,
            ordered: Vec::new(),
            native_mxfp4: false,
        })
    }

    /// transformers' `Mxfp4Config` (gpt-oss): only the experts, which are not Linears, are
    /// quantized, so no group; `modules_to_not_convert` (the attention, router, embeddings and
    /// head) are Linears and stay dense either way.
    fn native_mxfp4(raw: &Value) -> Result<Self, LoadError> {
        const FIELD: &str = "quantization_config.modules_to_not_convert";
        match raw.get("modules_to_not_convert") {
            None | Some(Value::Null) => {}
            Some(Value::Array(names)) if names.iter().all(Value::is_string) => {}
            Some(other) => {
                return Err(LoadError::config(
                    FIELD,
                    format!("{other} is not a list of module names"),
                ))
            }
        }
        Ok(Self {
            groups: Vec::new(),
            ignore: Vec::new(),
            kv_cache: None,
            ordered: Vec::new(),
            native_mxfp4: true,
        })
    }

    /// A ModelOpt config as one group (every Linear but the excluded modules) or, for
    /// MIXED_PRECISION, its listed modules in order, each covering the modules under it.
    fn modelopt(raw: &Value) -> Result<Self, LoadError> {
        use super::modelopt::ModeloptLayers;
        let cfg = super::modelopt::parse_config(raw)?;
        let (groups, ordered) = match cfg.layers {
            ModeloptLayers::All(scheme) => (
                vec![Group {
                    name: scheme.group.clone(),
                    targets: vec![Target::Class("Linear".into())],
                    scheme,
                }],
                Vec::new(),
            ),
            ModeloptLayers::Listed(layers) => {
                let ordered = layers
                    .into_iter()
                    .map(|(name, scheme)| {
                        // a mixture's `….experts` entry covers every expert's projections
                        let under = match name.ends_with("experts") {
                            true => "(?:\\..*)?",
                            false => "",
                        };
                        let pattern = format!("^{}{under}$", regex::escape(&name));
                        let regex = Regex::new(&pattern).map_err(|e| {
                            LoadError::config("quantization_config.quantized_layers", e.to_string())
                        })?;
                        Ok((regex, Some(scheme)))
                    })
                    .collect::<Result<_, LoadError>>()?;
                (Vec::new(), ordered)
            }
        };
        Ok(Self {
            groups,
            ignore: cfg.excluded.into_iter().map(Target::Regex).collect(),
            kv_cache: None,
            ordered,
            native_mxfp4: false,
        })
    }

    /// The scheme of the module `name` of class `class` (`Linear`, `Embedding`), or `None`
    /// when it is not quantized.
    pub fn scheme_for(&self, name: &str, class: &str) -> Result<Option<&LayerScheme>, LoadError> {
        if self
            .ignore
            .iter()
            .any(|t| t.precedence(name, class).is_some())
        {
            return Ok(None);
        }
        if class == "Linear" {
            if let Some((_, scheme)) = self.ordered.iter().find(|(r, _)| r.is_match(name)) {
                return Ok(scheme.as_ref());
            }
        }
        let mut best: Option<(u8, &Group)> = None;
        for group in &self.groups {
            let Some(p) = group
                .targets
                .iter()
                .filter_map(|t| t.precedence(name, class))
                .min()
            else {
                continue;
            };
            match best {
                Some((bp, other)) if bp == p => {
                    return Err(unsupported(
                        name,
                        "config_groups",
                        format!(
                            "matched equally by groups `{}` and `{}`",
                            other.name, group.name
                        ),
                    ))
                }
                Some((bp, _)) if bp < p => {}
                _ => best = Some((p, group)),
            }
        }
        Ok(best.map(|(_, g)| &g.scheme))
    }
}

/// Refuses argument combinations the format modules do not implement exactly.
fn check_scheme(s: &LayerScheme) -> Result<(), LoadError> {
    let w = &s.weights;
    let g = &s.group;
    let bad =
        |field: &str, reason: String| unsupported(g, format!("config_groups.{g}.{field}"), reason);
    match s.format {
        Format::PackQuantized | Format::IntQuantized => {
            if w.kind != QuantType::Int || !(w.num_bits == 4 || w.num_bits == 8) {
                return Err(bad(
                    "weights",
                    format!(
                        "{} {:?} bits with format {} (need int, 4 or 8 bits)",
                        w.num_bits,
                        w.kind,
                        s.format.name()
                    ),
                ));
            }
            if !matches!(w.strategy, Strategy::Group | Strategy::Channel) {
                return Err(bad(
                    "weights.strategy",
                    format!(
                        "{:?} is not supported for integer weights (group, channel)",
                        w.strategy
                    ),
                ));
            }
            if w.strategy == Strategy::Group && w.group_size.is_none() {
                return Err(bad(
                    "weights.group_size",
                    "strategy group needs a group_size".into(),
                ));
            }
        }
        Format::Nvfp4PackQuantized => {
            if w.kind != QuantType::Float
                || w.num_bits != 4
                || w.group_size != Some(16)
                || !w.symmetric
            {
                return Err(bad(
                    "weights",
                    "nvfp4-pack-quantized needs float, 4 bits, symmetric, group_size 16".into(),
                ));
            }
        }
        Format::Mxfp4PackQuantized => {
            if w.kind != QuantType::Float
                || w.num_bits != 4
                || w.strategy != Strategy::Group
                || w.group_size != Some(32)
                || !w.symmetric
            {
                return Err(bad(
                    "weights",
                    "mxfp4-pack-quantized needs float, 4 bits, symmetric, strategy group, \
                     group_size 32"
                        .into(),
                ));
            }
        }
        // Checked where the GPTQ and AWQ configs are parsed (`super::gptq`, `super::awq`).
        Format::Gptq
        | Format::GptqV2
        | Format::Awq
        | Format::HfFp8
        | Format::ModeloptNvfp4
        | Format::ModeloptFp8 => {}
        Format::FloatQuantized => {
            if w.kind != QuantType::Float || w.num_bits != 8 || !w.symmetric {
                return Err(bad(
                    "weights",
                    "float-quantized needs float, 8 bits, symmetric".into(),
                ));
            }
            if !matches!(
                w.strategy,
                Strategy::Tensor | Strategy::Channel | Strategy::Block
            ) {
                return Err(bad(
                    "weights.strategy",
                    format!(
                        "{:?} is not supported for fp8 weights (tensor, channel, block)",
                        w.strategy
                    ),
                ));
            }
            if w.strategy == Strategy::Block && w.block_structure.is_none() {
                return Err(bad(
                    "weights.block_structure",
                    "strategy block needs block_structure".into(),
                ));
            }
        }
    }
    let integer = matches!(
        s.format,
        Format::PackQuantized | Format::IntQuantized | Format::Gptq | Format::GptqV2 | Format::Awq
    );
    if w.actorder && !(integer && w.strategy == Strategy::Group) {
        return Err(bad(
            "weights.actorder",
            format!(
                "group (a g_idx per input) needs integer weights of strategy group, not {} {:?}",
                s.format.name(),
                w.strategy
            ),
        ));
    }
    if matches!(
        s.format,
        Format::HfFp8 | Format::ModeloptNvfp4 | Format::ModeloptFp8
    ) {
        return Ok(());
    }
    if w.dynamic {
        return Err(bad(
            "weights.dynamic",
            "dynamic weight quantization is not supported".into(),
        ));
    }
    if let Some(a) = &s.input_activations {
        if a.kind == QuantType::Int && !a.symmetric {
            // vLLM's azp path adds a zero-point correction term to the GEMM: not emulated.
            return Err(bad(
                "input_activations.symmetric",
                "asymmetric int8 activations (a zero point per token) are not supported".into(),
            ));
        }
        let supported = match (a.kind, a.num_bits, a.strategy) {
            (QuantType::Int, 8, Strategy::Token) => a.dynamic,
            (QuantType::Float, 8, Strategy::Token) => a.dynamic && a.symmetric,
            (QuantType::Float, 8, Strategy::Tensor) => !a.dynamic && a.symmetric,
            (QuantType::Float, 4, Strategy::TensorGroup) => a.group_size == Some(16) && a.symmetric,
            _ => false,
        };
        if !supported {
            return Err(bad(
                "input_activations",
                format!(
                    "{:?} {} bits, strategy {:?}, dynamic {} is not supported (fp8 per-token dynamic, \
                     fp8 per-tensor static, nvfp4 group 16, int8 per-token dynamic)",
                    a.kind, a.num_bits, a.strategy, a.dynamic
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn w4a16(targets: Value, ignore: Value) -> Value {
        json!({
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": targets, "weights": {"num_bits": 4, "type": "int",
                "symmetric": true, "strategy": "group", "group_size": 128}}},
            "ignore": ignore, "sparsity_config": {}, "kv_cache_scheme": null
        })
    }

    #[test]
    fn class_target_with_ignore() {
        let cfg = QuantizationConfig::parse(&w4a16(json!(["Linear"]), json!(["lm_head"]))).unwrap();
        let s = cfg
            .scheme_for("model.layers.0.self_attn.q_proj", "Linear")
            .unwrap()
            .unwrap();
        assert_eq!(s.format, Format::PackQuantized);
        assert_eq!(s.weights.group_size, Some(128));
        assert!(cfg.scheme_for("lm_head", "Linear").unwrap().is_none());
        assert!(cfg
            .scheme_for("model.embed_tokens", "Embedding")
            .unwrap()
            .is_none());
    }

    #[test]
    fn regex_targets_and_ignores_are_anchored_at_the_start() {
        let cfg = QuantizationConfig::parse(&w4a16(
            json!(["re:.*mlp\\..*_proj"]),
            json!(["re:model.layers.1.*"]),
        ))
        .unwrap();
        assert!(cfg
            .scheme_for("model.layers.0.mlp.up_proj", "Linear")
            .unwrap()
            .is_some());
        assert!(cfg
            .scheme_for("model.layers.0.self_attn.q_proj", "Linear")
            .unwrap()
            .is_none());
        assert!(cfg
            .scheme_for("model.layers.1.mlp.up_proj", "Linear")
            .unwrap()
            .is_none());
    }

    #[test]
    fn sparsity_and_unknown_format_and_actorder_group_are_refused() {
        let mut c = w4a16(json!(["Linear"]), json!([]));
        c["sparsity_config"] = json!({"format": "sparse-24-bitmask"});
        assert!(QuantizationConfig::parse(&c)
            .err()
            .unwrap()
            .to_string()
            .contains("sparsity_config"));

        let mut c = w4a16(json!(["Linear"]), json!([]));
        c["format"] = json!("marlin-24");
        let e = QuantizationConfig::parse(&c).err().unwrap().to_string();
        assert!(e.contains("format") && e.contains("marlin-24"), "{e}");

        let mut c = w4a16(json!(["Linear"]), json!([]));
        c["config_groups"]["group_0"]["weights"]["actorder"] = json!("dynamic");
        let e = QuantizationConfig::parse(&c).err().unwrap().to_string();
        assert!(e.contains("actorder") && e.contains("group_0"), "{e}");

        let mut c = w4a16(json!(["Linear"]), json!([]));
        c["config_groups"]["group_0"]["weights"]["actorder"] = json!("group");
        c["config_groups"]["group_0"]["weights"]["strategy"] = json!("channel");
        let e = QuantizationConfig::parse(&c).err().unwrap().to_string();
        assert!(e.contains("weights.actorder"), "{e}");
    }

    #[test]
    fn int8_activations_per_token_are_read_and_the_rest_refused_by_name() {
        let w8a8 = |act: Value| {
            let mut c = w4a16(json!(["Linear"]), json!([]));
            c["config_groups"]["group_0"]["weights"] = json!({"num_bits": 8, "type": "int",
                "symmetric": true, "strategy": "channel"});
            c["config_groups"]["group_0"]["input_activations"] = act;
            c["format"] = json!("int-quantized");
            QuantizationConfig::parse(&c)
        };
        let cfg = w8a8(json!({"num_bits": 8, "type": "int", "symmetric": true,
            "strategy": "token", "dynamic": true}))
        .unwrap();
        let s = cfg.scheme_for("model.layers.0.mlp.up_proj", "Linear");
        let act = s.unwrap().unwrap().input_activations.clone().unwrap();
        assert_eq!(
            (act.kind, act.num_bits, act.strategy),
            (QuantType::Int, 8, Strategy::Token)
        );
        // llm-compressor's asymmetric int8 activations: refused by name.
        let e = w8a8(json!({"num_bits": 8, "type": "int", "symmetric": false,
            "strategy": "token", "dynamic": true}))
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("input_activations.symmetric"), "{e}");
        // Static per-tensor int8 activations: not implemented, refused.
        let e = w8a8(json!({"num_bits": 8, "type": "int", "symmetric": true,
            "strategy": "tensor", "dynamic": false}))
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains("input_activations") && e.contains("Tensor"),
            "{e}"
        );
    }
}
