//! ExactScore wire types: the JSON bodies of every endpoint, with serde and utoipa derives.
//! Shared by the server (which serves them) and the client (which sends and reads them), so the
//! two cannot drift; `openapi.json` is generated from the served router.

use std::collections::BTreeMap;

mod batch_input;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Token ids: one sequence or a batch of sequences.
// (Deserialized in `batch_input`, which names the element that does not fit.)
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum TokensInput {
    Single(Vec<i64>),
    Batch(Vec<Vec<i64>>),
}

/// Text: one string or a batch of strings.
// (Deserialized in `batch_input`, which names the element that does not fit.)
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum TextInput {
    Single(String),
    Batch(Vec<String>),
}

/// Which per-token details to return (all default to the cheap ones).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ReturnOptions {
    /// Per-token log-probabilities (`null` for the first token). Default true.
    pub token_logprobs: bool,
    /// The `top_k` most likely tokens at every position. Default true when `top_k` > 0.
    pub top_k: bool,
    /// Whether each token was the argmax of the distribution before it. Default false.
    pub greedy: bool,
    /// The decoded string of each token (and of top-k tokens). Default false.
    pub token_strings: bool,
}

impl Default for ReturnOptions {
    fn default() -> Self {
        Self {
            token_logprobs: true,
            top_k: true,
            greedy: false,
            token_strings: false,
        }
    }
}

/// `POST /score`: exactly one of `tokens` and `text`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ScoreRequest {
    /// Token ids to score (one sequence or a batch). Ids are checked against the vocabulary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokensInput>,
    /// Text to tokenize with the model's tokenizer and score.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<TextInput>,
    /// With `text`: let the tokenizer add its special tokens (BOS). Default true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_special_tokens: Option<bool>,
    /// Number of most likely tokens to return per position, 0..=20. Default 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, maximum = 20)]
    pub top_k: Option<i64>,
    /// Which details to return.
    #[serde(
        default,
        rename = "return",
        skip_serializing_if = "Option::is_none",
        deserialize_with = "object_only"
    )]
    pub return_options: Option<ReturnOptions>,
}

/// `return` as a JSON object (or `null`) only: serde's derive would also take a list of
/// positional values, so `"return": []` would silently mean the defaults.
fn object_only<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<ReturnOptions>, D::Error> {
    use serde::de::{value::MapAccessDeserializer, MapAccess, Visitor};
    struct Object;
    impl<'de> Visitor<'de> for Object {
        type Value = Option<ReturnOptions>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an object of booleans or null")
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_map(self)
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            ReturnOptions::deserialize(MapAccessDeserializer::new(map)).map(Some)
        }
    }
    d.deserialize_option(Object)
}

/// One of the most likely tokens at a position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TopToken {
    pub id: u32,
    pub logprob: f32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// Scores of one sequence. Position i refers to token i; position 0 has no log-probability.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SequenceScore {
    /// Position of this sequence in the request.
    pub index: usize,
    pub tokens: Vec<u32>,
    /// log p(token_i | tokens_<i) in f32; `null` at position 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_logprobs: Option<Vec<Option<f32>>>,
    /// Sum of -log p over the scored tokens (accumulated in f64).
    pub sum_nll: f64,
    /// Number of scored tokens (length - 1).
    pub num_scored: usize,
    /// `sum_nll / num_scored`; `null` when nothing was scored.
    pub mean_nll: Option<f64>,
    /// `exp(mean_nll)`; `null` when nothing was scored.
    pub perplexity: Option<f64>,
    /// `top_k[i]`: the most likely tokens after token i (predicting token i+1), best first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<Vec<Vec<TopToken>>>,
    /// `greedy[i]`: token i was the argmax after token i-1; `null` at position 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub greedy: Option<Vec<Option<bool>>>,
    /// Decoded string of every token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_strings: Option<Vec<String>>,
}

/// Work done for a request.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct Usage {
    /// Tokens sent through the model.
    pub input_tokens: usize,
    /// Tokens that received a log-probability.
    pub scored_tokens: usize,
    /// Milliseconds spent waiting in the queue.
    pub queue_ms: f64,
    /// Milliseconds of model compute for the batch(es) this request was part of.
    pub compute_ms: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ScoreResponse {
    pub model: String,
    /// One entry per input sequence, in request order.
    pub sequences: Vec<SequenceScore>,
    pub usage: Usage,
}

/// `POST /kld`: exactly one of `tokens` and `text`. Needs a server started with a reference
/// model (`--reference-model`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct KldRequest {
    /// Token ids (one sequence or a batch). Ids are checked against the vocabulary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokensInput>,
    /// Text to tokenize with the model's tokenizer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<TextInput>,
    /// With `text`: let the tokenizer add its special tokens (BOS). Default true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_special_tokens: Option<bool>,
    /// Return the per-token arrays; `false` returns only the per-sequence sums. Default true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_token: Option<bool>,
}

/// How the served model's next-token distributions differ from the reference model's over one
/// sequence. Position i refers to token i (the distribution after token i − 1); position 0 is
/// `null` in every array.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SequenceDivergence {
    /// Position of this sequence in the request.
    pub index: usize,
    pub tokens: Vec<u32>,
    /// KL(reference ‖ model) in nats, from both models' full f32 log-softmax rows, summed in
    /// f64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kld: Option<Vec<Option<f64>>>,
    /// The served model's log p(token_i | tokens_<i), f32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<Option<f32>>>,
    /// The reference model's log p(token_i | tokens_<i), f32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference_logprobs: Option<Vec<Option<f32>>>,
    /// Whether both models' most likely token (lowest id on ties) was the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub same_top: Option<Vec<Option<bool>>>,
    /// p_model(token_i) − p_reference(token_i).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta_p: Option<Vec<Option<f64>>>,
    /// Positions with a divergence (length − 1).
    pub num_scored: usize,
    pub sum_kld: f64,
    /// Σ −log p of the served model.
    pub sum_nll: f64,
    /// Σ −log p of the reference model.
    pub reference_sum_nll: f64,
    pub same_top_count: usize,
    pub sum_delta_p: f64,
    /// Σ Δp², for the RMS of Δp.
    pub sum_delta_p_squared: f64,
    /// KL(model ‖ reference) in nats: the divergence the other way round, computed like `kld`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reverse_kld: Option<Vec<Option<f64>>>,
    /// Top-K agreement as a bit mask: bit K − 1 (K = 1..=5) is set when both models' K most
    /// likely tokens (lowest id first on ties) are the same set. Bit 0 is `same_top`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k_agreement: Option<Vec<Option<u8>>>,
    /// The reference model's probability of its most likely token (its confidence).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference_top_p: Option<Vec<Option<f64>>>,
    /// Σ KL(model ‖ reference).
    #[serde(default)]
    pub sum_reverse_kld: f64,
    /// Positions whose top-K sets agree, for K = 1..=5 (`[0]` is `same_top_count`).
    #[serde(default)]
    pub top_k_agreement_counts: Vec<usize>,
    /// The divergences grouped by the reference's confidence ([`CONFIDENCE_BUCKETS`]).
    #[serde(default)]
    pub confidence_buckets: Vec<ConfidenceBucket>,
}

/// Largest K of the top-K agreement `/kld` reports.
pub const TOP_K_AGREEMENT_MAX: usize = 5;

/// Ranges of the reference's top-token probability that `/kld` groups divergences by, as
/// ExLlamaV3's evaluations do: `[lower, upper)`, the last one closed at 1.
pub const CONFIDENCE_BUCKETS: [(f64, f64); 5] = [
    (0.0, 0.25),
    (0.25, 0.5),
    (0.5, 0.75),
    (0.75, 0.95),
    (0.95, 1.0),
];

/// The index into [`CONFIDENCE_BUCKETS`] of a reference top-token probability `p` (values
/// outside `0..=1`, from rounding, go to the nearest end).
pub fn confidence_bucket(p: f64) -> usize {
    CONFIDENCE_BUCKETS
        .iter()
        .position(|&(_, upper)| p < upper)
        .unwrap_or(CONFIDENCE_BUCKETS.len() - 1)
}

/// The positions of one sequence whose reference top-token probability lies in
/// `[lower, upper)` (the last bucket includes 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ConfidenceBucket {
    pub lower: f64,
    pub upper: f64,
    pub count: usize,
    /// Σ KL(reference ‖ model) over those positions.
    pub sum_kld: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct KldResponse {
    pub model: String,
    pub reference_model: String,
    /// One entry per input sequence, in request order.
    pub sequences: Vec<SequenceDivergence>,
    pub usage: Usage,
}

/// `POST /diff`: exactly one of `tokens` and `text`. Needs a reference model (`--reference-model`)
/// with the served model's layer count and hidden size.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DiffRequest {
    /// Token ids (one sequence or a batch). Ids are checked against the vocabulary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokensInput>,
    /// Text to tokenize with the model's tokenizer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<TextInput>,
    /// With `text`: let the tokenizer add its special tokens (BOS). Default true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_special_tokens: Option<bool>,
    /// Return every layer's errors at every position too. Default false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_position: Option<bool>,
    /// The served model goes on from the reference's state after this decoder layer (0-based,
    /// below `num_layers`), and after every layer before it: the error of the layers up to here
    /// is then each layer's own, and with the last layer the final KLD is 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0)]
    pub reference_until: Option<i64>,
    /// Attribute the divergence to the quantized modules: `true` for every one, or an object
    /// that chooses some. One forward of the reference per module: meant for a few windows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attribute: Option<AttributeInput>,
}

/// `attribute` of `/diff`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum AttributeInput {
    /// `true`: every module whose weights differ in format from the reference's.
    All(bool),
    Select(AttributeSelection),
}

/// A boolean or an object only: serde's derive would also read a list as the selection's
/// members in order, so `"attribute": []` would silently mean every module.
impl<'de> Deserialize<'de> for AttributeInput {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{value::MapAccessDeserializer, MapAccess, Visitor};
        struct Input;
        impl<'de> Visitor<'de> for Input {
            type Value = AttributeInput;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a boolean or an object with `layers` and/or `pattern`")
            }
            fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
                Ok(AttributeInput::All(v))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                AttributeSelection::deserialize(MapAccessDeserializer::new(map))
                    .map(AttributeInput::Select)
            }
        }
        d.deserialize_any(Input)
    }
}

/// Which modules to attribute: those of `layers` whose name matches `pattern` (either may be
/// left out).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AttributeSelection {
    /// First and last decoder layer, inclusive: `[10, 20]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<Vec<i64>>,
    /// A module name pattern: `*` matches any run of characters, everything else itself, and
    /// the whole name must match (`*.mlp.down_proj`, `model.layers.3.*`, `lm_head`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattern: Option<String>,
}

/// One decoder layer's output: the served model's residual stream against the reference's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct LayerDiff {
    pub layer: usize,
    /// Mean over the sequence's positions of `1 − cos(served, reference)` (sums in f64).
    pub mean_cos_error: f64,
    /// Mean over the positions of `10·log10(|reference|² / |served − reference|²)`, dB; every
    /// position's value is within ±200 (200: identical states).
    pub mean_sqnr_db: f64,
    /// With `per_position`: at every position.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cos_error: Option<Vec<f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sqnr_db: Option<Vec<f64>>,
    /// The served model went on from the reference's state after this layer
    /// (`reference_until`); the errors above are taken before that.
    pub reference_state_after: bool,
}

/// What `/diff` finds for one sequence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SequenceLayerDiff {
    /// Position of this sequence in the request.
    pub index: usize,
    /// Per decoder layer, in order.
    pub layers: Vec<LayerDiff>,
    /// The final divergence, as `/kld` gives it with `per_token: false`.
    pub kld: SequenceDivergence,
}

/// One module's share of the divergence: the KLD of the reference with only this module's
/// weights replaced by the served model's dequantized ones.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ModuleAttribution {
    /// `model.layers.17.mlp.down_proj`, `lm_head`.
    pub module: String,
    /// The served model's format of it.
    pub format: String,
    /// Mean over every position of the request, nats.
    pub mean_kld: f64,
}

/// Module attribution over every sequence of a request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Attribution {
    /// Positions the means are over.
    pub positions: usize,
    /// Mean KLD of the served model from the reference.
    pub full_kld: f64,
    /// Σ of the modules' mean KLDs.
    pub sum_module_kld: f64,
    /// `sum_module_kld / full_kld`: 1 when the modules' effects add up exactly; `null` when
    /// the full KLD is 0.
    pub additivity_ratio: Option<f64>,
    /// Every attributed module, the largest KLD first.
    pub modules: Vec<ModuleAttribution>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DiffResponse {
    pub model: String,
    pub reference_model: String,
    /// One entry per input sequence, in request order.
    pub sequences: Vec<SequenceLayerDiff>,
    /// With `attribute`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attribution: Option<Attribution>,
    pub usage: Usage,
}

/// Every error response: what went wrong, its category and, for validation errors, the
/// offending field, the rule it broke and the value it had.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    pub error: String,
    /// `invalid_json`, `validation`, `unauthorized`, `payload_too_large`, `overloaded`,
    /// `not_ready`, `timeout`, `internal`, `numerical`, `not_found`, `method_not_allowed`,
    /// `unsupported_media_type`, `headers_too_large`, `invalid_header`, `body_timeout`,
    /// `no_reference_model`, `incompatible_reference`.
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<serde_json::Value>,
}

/// `POST /tokenize` (the shape lm-eval's remote tokenizer and vLLM use).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TokenizeRequest {
    pub prompt: String,
    /// Default true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_special_tokens: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TokenizeResponse {
    pub tokens: Vec<u32>,
    pub count: usize,
    pub max_model_len: usize,
}

/// `POST /detokenize`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DetokenizeRequest {
    pub tokens: Vec<i64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

/// `GET /tokenizer_info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TokenizerInfo {
    pub tokenizer_class: String,
    pub bos_token: Option<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token: Option<String>,
    pub eos_token_id: Option<u32>,
    pub pad_token: Option<String>,
    pub vocab_size: usize,
    pub model_max_length: usize,
    /// Whether encoding with special tokens prepends BOS.
    pub add_bos_token: bool,
}

/// Server limits, as configured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Limits {
    pub max_input_tokens: usize,
    pub max_batch_tokens: usize,
    pub max_batch_requests: usize,
    pub max_queued_requests: usize,
    pub max_top_k: usize,
    /// Largest compute one request may ask for (`--max-request-cost`), in token-layers: one
    /// token through one decoder layer of one model, a model's final norm and lm_head counting
    /// as one more. `/score` and `/v1/completions` cost tokens × (layers + 1), `/kld` adds the
    /// reference's tokens × (layers + 1), `/diff` runs both models and each attributed module of
    /// layer `i` adds tokens × (layers − i + 1) (the lm_head: tokens), after one reference pass
    /// up to the last attributed layer. Beyond it: 422 `max_request_cost` before any work.
    /// 0 from servers older than this field.
    #[serde(default)]
    pub max_request_cost: u64,
    /// Largest answer admitted (`--max-response-bytes`), by an upper estimate made before any
    /// work from the sequences' lengths and the details asked for. Beyond it: 422
    /// `max_response_bytes` naming the member that makes up most of the answer. 0 from servers
    /// older than this field.
    #[serde(default)]
    pub max_response_bytes: u64,
}

/// `GET /info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ModelInfo {
    /// Served model name (the checkpoint directory name unless configured).
    pub model: String,
    pub architecture: String,
    pub vocab_size: usize,
    pub num_layers: usize,
    pub hidden_size: usize,
    /// Weight format of each projection type (`q_proj`, ..., `lm_head`).
    pub formats: BTreeMap<String, String>,
    /// Activation quantization applied per projection type, if any.
    pub activation_quant: BTreeMap<String, String>,
    /// `emulate` or `off`.
    pub activation_quant_mode: String,
    /// The KV cache's quantization, when one applies: the checkpoint's `kv_cache_scheme`
    /// emulated, or labelled a simulation (`--kv-cache-dtype fp8_e4m3`). Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache: Option<String>,
    /// `--kv-cache-quant`: `emulate` or `off` (`off` on a checkpoint with a `kv_cache_scheme`
    /// leaves `kv_cache` absent). Empty from servers older than this field.
    #[serde(default)]
    pub kv_cache_quant_mode: String,
    /// `--kv-cache-dtype`: `auto` or `fp8_e4m3` (the simulation). Empty from servers older than
    /// this field.
    #[serde(default)]
    pub kv_cache_dtype: String,
    /// Average stored bits per weight over the decoder Linear layers (scales included).
    pub bits_per_weight: f64,
    /// Attention kernel: `materialized` (f32 scores) or `flash` (fused GPU kernel, bf16/f16).
    /// Absent from servers older than this field.
    #[serde(default)]
    pub attention: String,
    /// Compute dtype: `f32`, `bf16` or `f16`.
    pub dtype: String,
    pub devices: Vec<String>,
    /// Where the model's layers are: per replica, its pipeline stages. Absent from servers
    /// older than this field.
    #[serde(default)]
    pub placement: Vec<ReplicaPlacement>,
    pub limits: Limits,
    pub version: String,
    /// The reference model `/kld` compares against; absent when none is loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<ReferenceInfo>,
    /// Identifies the checkpoint (lowercase hex SHA-256), without reading all its weights. It
    /// covers, in this order: each of `config.json`, `tokenizer.json`, `tokenizer_config.json`,
    /// `special_tokens_map.json` and `model.safetensors.index.json` that exists, whole; then
    /// each safetensors file (shards in name order): its header (the 8-byte length and the
    /// JSON: every tensor's name, dtype, shape and offsets) and the first 65536 bytes of every
    /// tensor's data, tensors in name order. Each item is hashed as its name, a zero byte, its
    /// length (u64 little-endian) and its bytes. A change past a tensor's first 64 KiB that
    /// keeps the header is not seen. Absent from servers older than this field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_sha256: Option<String>,
}

/// The reference model of `/kld`, as `/info` reports it. Loaded only when its tokenizer equals
/// the served model's: the same `vocab_size` in config.json, and in `tokenizer.json` the same
/// `model` (type, vocabulary, merges and options), `normalizer`, `pre_tokenizer`,
/// `post_processor`, `decoder`, `added_tokens`, `truncation` and `padding` (as parsed JSON, so
/// formatting and key order do not count), and the same BOS and EOS ids and `add_bos_token`
/// from `tokenizer_config.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ReferenceInfo {
    pub model: String,
    pub architecture: String,
    /// Weight format of each projection type.
    pub formats: BTreeMap<String, String>,
    /// Average stored bits per weight over the decoder Linear layers (scales included).
    pub bits_per_weight: f64,
    pub devices: Vec<String>,
    /// Per replica, the reference's pipeline stages.
    #[serde(default)]
    pub placement: Vec<ReplicaPlacement>,
    /// The reference's compute dtype (`--reference-dtype`); absent from older servers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    /// Absent (0) from older servers.
    #[serde(default)]
    pub num_layers: usize,
    #[serde(default)]
    pub hidden_size: usize,
    /// The reference checkpoint's fingerprint, as `ModelInfo.checkpoint_sha256` describes it.
    /// Absent from older servers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_sha256: Option<String>,
}

/// One copy of a model: a chain of pipeline stages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ReplicaPlacement {
    pub replica: usize,
    pub stages: Vec<StagePlacement>,
}

/// A pipeline stage: a run of decoder layers on one device (the first stage also holds the
/// embedding, the last the final norm and the lm_head).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StagePlacement {
    pub device: String,
    /// First decoder layer of the stage.
    pub first_layer: usize,
    /// Decoder layers the stage holds.
    pub layers: usize,
    /// Stored bytes of the weights it holds.
    pub weight_bytes: u64,
    /// `weight_bytes` plus the expected activation peak of a batch of `--max-batch-tokens`
    /// tokens in sequences of `max_input_tokens` (an estimate: the largest layer's working set,
    /// the materialised attention of one sequence, on the last stage the logits of one chunk).
    /// It excludes what the process holds besides the batch: code, runtime, tokenizer, the
    /// answers being built (bounded by `limits.max_response_bytes`).
    pub expected_peak_bytes: u64,
}

/// `GET /v1/models` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ModelCard {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    pub max_model_len: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}

/// `GET /health/*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Health {
    /// `live`, `ready`, `starting`, `draining`, `device_lost` or `no_replica_in_rotation`.
    pub status: String,
    /// Replicas taken out of rotation, and why (absent while every replica serves).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas_out_of_rotation: Vec<ReplicaHealth>,
}

/// A replica taken out of rotation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ReplicaHealth {
    pub replica: usize,
    pub reason: String,
}

/// `prompt` of `/v1/completions`: text, texts, token ids, or lists of token ids.
// (Deserialized in `batch_input`, which names the element that does not fit.)
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    TokenBatch(Vec<Vec<i64>>),
    Tokens(Vec<i64>),
    Texts(Vec<String>),
}

/// `POST /v1/completions` (OpenAI legacy completions, as lm-eval's `local-completions` and the
/// OpenAI client send it). This is a scoring server: `max_tokens` is 0 (score the prompt) or 1
/// (also return the greedy next token, `temperature` 0). Anything that would need sampling or
/// generation is refused, never ignored.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    /// Must equal the served model name when given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub prompt: Option<PromptInput>,
    /// Return the prompt's tokens with their log-probabilities. Default false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub echo: Option<bool>,
    /// Number of most likely tokens per position, 0..=20; `null`: no log-probabilities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, maximum = 20)]
    pub logprobs: Option<i64>,
    /// 0 or 1. Required (OpenAI's default of 16 would mean generation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, maximum = 1)]
    pub max_tokens: Option<i64>,
    /// Must be 0 when `max_tokens` is 1 (the appended token is the argmax).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Accepted; results are deterministic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    /// Must be 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 1)]
    pub n: Option<i64>,
    /// Must be false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// Must be empty: one greedy token is never cut.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<serde_json::Value>,
    /// Accepted and ignored (an end-user tag).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Tokenize text prompts with the tokenizer's special tokens (BOS). Default false, as
    /// lm-eval expects: its context/continuation split counts tokens without BOS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_special_tokens: Option<bool>,
}

/// Per-token details of one choice (OpenAI shape).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CompletionLogprobs {
    /// Vocabulary strings of the tokens (unique per id, e.g. `Ġthe`).
    pub tokens: Vec<String>,
    /// `null` for the first prompt token.
    pub token_logprobs: Vec<Option<f32>>,
    /// Per position: the `logprobs` most likely tokens plus the actual one; `null` first.
    pub top_logprobs: Vec<Option<BTreeMap<String, f32>>>,
    /// Character offset of each token in `text` (per-token decoding; approximate where a token
    /// ends inside a multi-byte character).
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CompletionUsage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: CompletionUsage,
}

/// Most tokens a stored reference keeps per position (`/reference`'s `k`).
pub const MAX_STORED_K: usize = 4096;

/// `POST /reference`: the served model as a stored reference — at every position that
/// predicts a known token, its `k` most likely tokens and the log-mass of all the others
/// (docs/stored-reference.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReferenceRequest {
    /// Token ids (one sequence or a batch). Ids are checked against the vocabulary.
    pub tokens: TokensInput,
    /// Tokens kept per position, 1..=4096.
    #[schema(minimum = 1, maximum = 4096)]
    pub k: i64,
}

/// One sequence's stored-reference rows, `k` entries each, row-major: one per position
/// i = start, start + 1, … (the distribution after token i, predicting token i + 1); as many
/// rows as `tail_logmass` has entries. `/reference` returns every position, i = 0..n − 2.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StoredRows {
    /// The position of the first row. Default 0.
    #[serde(default)]
    pub start: usize,
    pub k: usize,
    /// The `k` most likely tokens of each row, best first (the lowest id first on ties).
    pub ids: Vec<u32>,
    /// Their log-probabilities (f32 of the f64 log-softmax).
    pub logprobs: Vec<f32>,
    /// log Σ p over every other token of each row, summed over them directly; `null` where
    /// that mass is 0 (k covers the vocabulary, or the rest underflows f64).
    pub tail_logmass: Vec<Option<f32>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ReferenceResponse {
    pub model: String,
    /// One entry per input sequence, in request order.
    pub sequences: Vec<StoredRows>,
    pub usage: Usage,
}

/// One sequence of a `/kld/stored` request: its tokens and the stored reference's rows for
/// them (as `/reference` returned them).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StoredSequenceInput {
    pub tokens: Vec<u32>,
    pub reference: StoredRows,
}

/// `POST /kld/stored`: the served model's KL-divergence from a stored reference, with no
/// reference model loaded: the top-K part exact, the rest bounded rigorously
/// (docs/stored-reference.md).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StoredKldRequest {
    pub sequences: Vec<StoredSequenceInput>,
    /// Return the per-token arrays; `false` returns only the per-sequence sums. Default true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_token: Option<bool>,
}

/// The divergence of one sequence from its stored reference, in nats. Per-token arrays hold one
/// entry per stored row, in the rows' order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StoredKldSequence {
    pub index: usize,
    pub num_scored: usize,
    /// Σ over positions of the exact top-K part Σ_{i∈top K} p_i ln(p_i/q_i).
    pub sum_top_k: f64,
    /// Σ of the estimate: the top-K part plus the tail as one token.
    pub sum_estimate: f64,
    /// Rigorous bounds of Σ KL(reference ‖ model).
    pub sum_lower: f64,
    pub sum_upper: f64,
    /// Σ −log p(next token) of the served model.
    pub sum_nll: f64,
    /// Positions whose most likely token is the reference's.
    pub same_top_count: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<Vec<f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimate: Option<Vec<f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lower: Option<Vec<f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upper: Option<Vec<f64>>,
    /// The served model's log p(next token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<f32>>,
    /// The served model's probability mass outside the reference's top K.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tail_mass: Option<Vec<f64>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StoredKldResponse {
    pub model: String,
    pub sequences: Vec<StoredKldSequence>,
    pub usage: Usage,
}
