//! What the vision-language architectures share: their text model's keys sit under
//! `text_config`, and the vision tower and projector are never read.

use serde_json::Value;

use crate::checkpoint::LoadError;

/// Tensor prefixes of the vision tower and projector (transformers 4.x and 5 names).
pub(super) const UNREAD_PREFIXES: [&str; 4] = [
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
];

/// The keys the text model takes from the top level of the file where `text_config` has none.
const TOP_LEVEL_KEYS: [&str; 6] = [
    "quantization_config",
    "bos_token_id",
    "eos_token_id",
    "dtype",
    "torch_dtype",
    "tie_word_embeddings",
];

/// The `text_config` object of `root`.
pub(super) fn text_config(root: &Value) -> Result<Value, LoadError> {
    root.get("text_config")
        .filter(|t| t.is_object())
        .cloned()
        .ok_or_else(|| LoadError::config("text_config", "missing or not an object"))
}

/// `text` with the top-level quantization, token ids, dtype and tie flag of `root` where it
/// has none of its own.
pub(super) fn with_top_level_keys(root: &Value, mut text: Value) -> Value {
    for key in TOP_LEVEL_KEYS {
        if let (Some(v), None) = (root.get(key), text.get(key)) {
            text[key] = v.clone();
        }
    }
    text
}
