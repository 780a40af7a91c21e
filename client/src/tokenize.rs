//! Tokenizing the evaluation text: locally with the server's own `tokenizer.json` (checked
//! against the server's `/tokenize` on samples), or on the server.

use serde::{Deserialize, Serialize};

use crate::http::{Client, ClientError};

/// Where the text is tokenized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TokenizeMode {
    /// Download `/tokenizer.json` and tokenize here (verified against `/tokenize`).
    Local,
    /// One `POST /tokenize` with the whole text.
    Server,
}

#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("cannot load the server's tokenizer.json: {0}")]
    Load(String),
    #[error("local tokenizer failed: {0}")]
    Encode(String),
    #[error(
        "local tokenization differs from the server's /tokenize on sample {sample} \
         (bytes {start}..{end}): first difference at token {position}: local {local:?} vs \
         server {server:?}; use --tokenize server"
    )]
    Mismatch {
        sample: usize,
        start: usize,
        end: usize,
        position: usize,
        local: Option<u32>,
        server: Option<u32>,
    },
}

/// Samples checked against the server: byte ranges (on char boundaries) of about 4 KiB at the
/// start, the middle and the end of the text.
pub fn verification_samples(text: &str) -> Vec<(usize, usize)> {
    const LEN: usize = 4096;
    let floor = |mut i: usize| {
        while !text.is_char_boundary(i) {
            i -= 1;
        }
        i
    };
    let n = text.len();
    if n <= LEN {
        return vec![(0, n)];
    }
    let mid = floor(n / 2);
    let end_start = floor(n - LEN);
    vec![
        (0, floor(LEN)),
        (mid, floor((mid + LEN).min(n))),
        (end_start, n),
    ]
}

/// Tokenize `text` (whole) with the chosen mode.
pub async fn tokenize(
    client: &Client,
    text: &str,
    add_special_tokens: bool,
    mode: TokenizeMode,
) -> Result<Vec<u32>, TokenizeError> {
    match mode {
        TokenizeMode::Server => Ok(client.tokenize(text, add_special_tokens).await?.tokens),
        TokenizeMode::Local => {
            let bytes = client.tokenizer_json().await?;
            let tok = tokenizers::Tokenizer::from_bytes(&bytes)
                .map_err(|e| TokenizeError::Load(e.to_string()))?;
            let tok = std::sync::Arc::new(tok);
            for (i, (start, end)) in verification_samples(text).into_iter().enumerate() {
                let sample = &text[start..end];
                let server = client.tokenize(sample, add_special_tokens).await?.tokens;
                let local = tok
                    .encode_fast(sample, add_special_tokens)
                    .map_err(|e| TokenizeError::Encode(e.to_string()))?
                    .get_ids()
                    .to_vec();
                if local != server {
                    let position = local
                        .iter()
                        .zip(&server)
                        .position(|(a, b)| a != b)
                        .unwrap_or(local.len().min(server.len()));
                    return Err(TokenizeError::Mismatch {
                        sample: i,
                        start,
                        end,
                        position,
                        local: local.get(position).copied(),
                        server: server.get(position).copied(),
                    });
                }
            }
            let owned = text.to_string();
            tokio::task::spawn_blocking(move || {
                tok.encode_fast(owned, add_special_tokens)
                    .map(|e| e.get_ids().to_vec())
                    .map_err(|e| TokenizeError::Encode(e.to_string()))
            })
            .await
            .map_err(|e| TokenizeError::Encode(e.to_string()))?
        }
    }
}
