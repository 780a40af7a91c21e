//! The model's tokenizer (`tokenizer.json`), plus what clients need to know about it.

use std::path::Path;

use exactscore_api::TokenizerInfo;
use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("parsing {path}: {message}")]
    Parse { path: String, message: String },
    #[error("tokenizer: {0}")]
    Tokenize(String),
}

/// The sections of `tokenizer.json` that two tokenizers must share to map text to the same
/// ids and ids to the same text ([`TextTokenizer::difference`]).
pub const COMPARED_SECTIONS: [&str; 8] = [
    "model",
    "normalizer",
    "pre_tokenizer",
    "post_processor",
    "decoder",
    "added_tokens",
    "truncation",
    "padding",
];

pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    /// The file as stored, served at `GET /tokenizer.json`.
    raw: Vec<u8>,
    info: TokenizerInfo,
}

impl TextTokenizer {
    /// Loads `dir/tokenizer.json` and, where present, `dir/tokenizer_config.json`.
    pub fn load(dir: &Path) -> Result<Self, TokenizerError> {
        let path = dir.join("tokenizer.json");
        let shown = path.display().to_string();
        let raw = std::fs::read(&path).map_err(|source| TokenizerError::Read {
            path: shown.clone(),
            source,
        })?;
        let inner = tokenizers::Tokenizer::from_bytes(&raw).map_err(|e| TokenizerError::Parse {
            path: shown,
            message: e.to_string(),
        })?;
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = match std::fs::read(&config_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| TokenizerError::Parse {
                path: config_path.display().to_string(),
                message: e.to_string(),
            })?,
            Err(_) => Value::Null, // optional
        };
        let mut tok = Self {
            inner,
            raw,
            info: TokenizerInfo {
                tokenizer_class: String::new(),
                bos_token: None,
                bos_token_id: None,
                eos_token: None,
                eos_token_id: None,
                pad_token: None,
                vocab_size: 0,
                model_max_length: 0,
                add_bos_token: false,
            },
        };
        tok.info = tok.describe(&config)?;
        Ok(tok)
    }

    fn describe(&self, config: &Value) -> Result<TokenizerInfo, TokenizerError> {
        // Special tokens may be plain strings or `{"content": ...}` objects.
        let special = |key: &str| -> Option<String> {
            match &config[key] {
                Value::String(s) => Some(s.clone()),
                Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
                _ => None,
            }
        };
        let bos_token = special("bos_token");
        let bos_token_id = bos_token.as_deref().and_then(|t| self.inner.token_to_id(t));
        let eos_token = special("eos_token");
        let add_bos_token = match bos_token_id {
            Some(bos) => self.encode("a", true)?.first() == Some(&bos),
            None => false,
        };
        Ok(TokenizerInfo {
            tokenizer_class: config["tokenizer_class"]
                .as_str()
                .unwrap_or("PreTrainedTokenizerFast")
                .to_string(),
            eos_token_id: eos_token.as_deref().and_then(|t| self.inner.token_to_id(t)),
            bos_token,
            bos_token_id,
            eos_token,
            pad_token: special("pad_token"),
            vocab_size: self.inner.get_vocab_size(true),
            model_max_length: config["model_max_length"]
                .as_u64()
                .map_or(0, |v| v.min(usize::MAX as u64) as usize),
            add_bos_token,
        })
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        self.inner
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Tokenize(e.to_string()))
    }

    /// Decodes ids, special tokens included, as vLLM's `/detokenize` does.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| TokenizerError::Tokenize(e.to_string()))
    }

    /// The vocabulary string of one token (`Ġthe`): unique per id, unlike its decoded text.
    pub fn token_string(&self, id: u32) -> String {
        self.inner.id_to_token(id).unwrap_or_default()
    }

    pub fn info(&self) -> &TokenizerInfo {
        &self.info
    }

    pub fn raw_json(&self) -> &[u8] {
        &self.raw
    }

    /// The first way in which `other` would map text to different ids, or `None` when both are
    /// the same tokenizer: every section of `tokenizer.json` that shapes tokenization
    /// ([`COMPARED_SECTIONS`], compared as parsed JSON, so formatting does not count), the
    /// vocabulary, BOS (and whether it is added) and EOS.
    pub fn difference(&self, other: &Self) -> Option<String> {
        // The vocabulary first: its message names the token.
        if let Some(difference) = self.vocabulary_difference(other) {
            return Some(difference);
        }
        let parse = |raw: &[u8]| serde_json::from_slice::<Value>(raw).unwrap_or(Value::Null);
        let (a, b) = (parse(&self.raw), parse(&other.raw));
        for section in COMPARED_SECTIONS {
            let (x, y) = (&a[section], &b[section]);
            if x != y {
                let detail = match (x, y) {
                    (Value::Object(x), Value::Object(y)) => x
                        .keys()
                        .chain(y.keys())
                        .find(|k| x.get(*k) != y.get(*k))
                        .map(|k| format!(" (`{section}.{k}`)"))
                        .unwrap_or_default(),
                    _ => String::new(),
                };
                return Some(format!("tokenizer.json `{section}` differs{detail}"));
            }
        }
        None
    }

    fn vocabulary_difference(&self, other: &Self) -> Option<String> {
        let (mine, theirs) = (self.inner.get_vocab(true), other.inner.get_vocab(true));
        if mine.len() != theirs.len() {
            return Some(format!(
                "vocabulary of {} tokens vs {}",
                mine.len(),
                theirs.len()
            ));
        }
        let mut tokens: Vec<(&String, &u32)> = mine.iter().collect();
        tokens.sort_by_key(|&(_, id)| *id);
        for (token, id) in tokens {
            match theirs.get(token) {
                Some(other_id) if other_id == id => {}
                Some(other_id) => {
                    return Some(format!("token {token:?} has id {id} vs {other_id}"))
                }
                None => return Some(format!("token {token:?} (id {id}) is missing")),
            }
        }
        let (a, b) = (&self.info, &other.info);
        if a.bos_token_id != b.bos_token_id || a.add_bos_token != b.add_bos_token {
            return Some(format!(
                "BOS id {:?} (added: {}) vs {:?} (added: {})",
                a.bos_token_id, a.add_bos_token, b.bos_token_id, b.add_bos_token
            ));
        }
        if a.eos_token_id != b.eos_token_id {
            return Some(format!(
                "EOS id {:?} vs {:?}",
                a.eos_token_id, b.eos_token_id
            ));
        }
        None
    }
}
