//! llama.cpp's `--kl-divergence-base` file, as `llama-perplexity` writes (`--kl-divergence-base
//! F` with `--save-all-logits`) and reads (`--kl-divergence`) it in tools/perplexity/
//! perplexity.cpp. All numbers are native-endian there (little-endian on every platform it
//! ships for); here little-endian:
//!
//! | bytes | what |
//! |---|---|
//! | 8 | `_logits_` |
//! | 4 | n_ctx (`int`, read back as `uint32_t`) |
//! | 4 | n_vocab (`int`) |
//! | 4 | n_chunk (`int`) |
//! | 4·n_ctx·n_chunk | the tokens of the chunks (`llama_token` = int32), as tokenized (no BOS swapped in) |
//! | 2·nv per row | for each chunk, for each of its n_ctx − 1 − n_ctx/2 scored rows (the distributions after positions n_ctx/2 … n_ctx − 2): nv = 2·⌈n_vocab/2⌉ + 4 `uint16_t` words: `float scale`, `float min_log_prob` (words 0–3), then one word per token, q = round((logit − min_logit)/scale) for logits above min_logit, else 0; the pad word of an odd vocabulary is 0 |
//!
//! with max_logit the row's largest logit, min_logit = max(smallest logit, max_logit − 16),
//! scale = (max_logit − min_logit)/65535 and min_log_prob = min_logit − max_logit −
//! log Σ exp(logit − max_logit). A token's log-probability reads back as scale·q +
//! min_log_prob. Windowing: the text tokenized once (BOS added where the vocabulary adds one),
//! cut into n_chunk = ⌊tokens/n_ctx⌋ non-overlapping chunks; each chunk is evaluated with its
//! first token replaced by BOS (where added), and only its second half is scored.
//!
//! Here a row is encoded from log-probabilities (logits shifted by −(max_logit + log-sum-exp):
//! the same row, so the same min/max and scale up to f32 rounding).

use std::path::Path;

pub const MAGIC: &[u8; 8] = b"_logits_";

/// A whole base file.
#[derive(Debug, Clone, PartialEq)]
pub struct BaseFile {
    pub n_ctx: u32,
    pub n_vocab: i32,
    pub n_chunk: i32,
    /// n_ctx · n_chunk tokens.
    pub tokens: Vec<i32>,
    /// n_chunk · [`scored_rows`] rows of [`row_words`] words.
    pub words: Vec<u16>,
}

/// Words of one row: two floats, then one word per token, padded to an even count.
pub fn row_words(n_vocab: usize) -> usize {
    2 * n_vocab.div_ceil(2) + 4
}

/// Scored rows of one chunk: the second half, whose last position predicts nothing.
pub fn scored_rows(n_ctx: usize) -> usize {
    n_ctx - 1 - n_ctx / 2
}

/// llama.cpp's `nearest_int`: round to nearest, ties to even, through the f32 mantissa.
fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Encodes one row of log-probabilities (`n_vocab` of them) into `out` ([`row_words`] words).
pub fn encode_row(logprobs: &[f32], out: &mut [u16]) {
    let max = logprobs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let min = logprobs
        .iter()
        .copied()
        .fold(f32::INFINITY, f32::min)
        .max(max - 16.0);
    let scale = (max - min) / 65535.0;
    let (head, rest) = out.split_at_mut(4);
    for (w, bits) in head
        .chunks_exact_mut(2)
        .zip([scale.to_bits(), min.to_bits()])
    {
        w[0] = bits as u16;
        w[1] = (bits >> 16) as u16;
    }
    rest.fill(0);
    if scale != 0.0 {
        let inv = 1.0 / scale;
        for (q, &lp) in rest.iter_mut().zip(logprobs) {
            if lp > min {
                *q = nearest_int(inv * (lp - min)) as u16;
            }
        }
    }
}

/// The log-probabilities llama.cpp reads back from one row: scale·q + min_log_prob.
pub fn decode_row(words: &[u16], n_vocab: usize) -> Vec<f32> {
    let float = |i: usize| f32::from_bits(u32::from(words[i]) | (u32::from(words[i + 1]) << 16));
    let (scale, min) = (float(0), float(2));
    words[4..4 + n_vocab]
        .iter()
        .map(|&q| scale * f32::from(q) + min)
        .collect()
}

impl BaseFile {
    pub fn row(&self, i: usize) -> &[u16] {
        let nv = row_words(self.n_vocab as usize);
        &self.words[i * nv..(i + 1) * nv]
    }

    pub fn rows(&self) -> usize {
        self.words.len() / row_words(self.n_vocab as usize)
    }

    /// Chunk `c`'s tokens.
    pub fn chunk(&self, c: usize) -> &[i32] {
        let n = self.n_ctx as usize;
        &self.tokens[c * n..(c + 1) * n]
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(20 + 4 * self.tokens.len() + 2 * self.words.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.n_ctx.to_le_bytes());
        out.extend_from_slice(&self.n_vocab.to_le_bytes());
        out.extend_from_slice(&self.n_chunk.to_le_bytes());
        self.tokens
            .iter()
            .for_each(|t| out.extend_from_slice(&t.to_le_bytes()));
        self.words
            .iter()
            .for_each(|w| out.extend_from_slice(&w.to_le_bytes()));
        out
    }

    /// Reads a file as llama.cpp does, and refuses what it would misread: a size that is not
    /// exactly the header, the tokens and every chunk's rows.
    pub fn from_bytes(bytes: &[u8]) -> anyhow::Result<Self> {
        anyhow::ensure!(
            bytes.len() >= 20 && &bytes[..8] == MAGIC,
            "does not look like a llama.cpp file of log-probabilities (no `_logits_` header)"
        );
        let int = |at: usize| {
            i32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let (n_ctx, n_vocab, n_chunk) = (int(8), int(12), int(16));
        anyhow::ensure!(
            n_ctx >= 2 && n_vocab >= 1 && n_chunk >= 0,
            "n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk}: not a valid header"
        );
        let (ctx, vocab, chunks) = (n_ctx as usize, n_vocab as usize, n_chunk as usize);
        let tokens_end = 20 + 4 * ctx * chunks;
        let want = tokens_end + 2 * chunks * scored_rows(ctx) * row_words(vocab);
        anyhow::ensure!(
            bytes.len() == want,
            "{} bytes; n_ctx {ctx}, n_vocab {vocab} and n_chunk {chunks} make {want}",
            bytes.len()
        );
        let tokens: Vec<i32> = bytes[20..tokens_end]
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if let Some(i) = tokens.iter().position(|&t| t < 0 || t >= n_vocab) {
            anyhow::bail!(
                "token {i} is {}, outside the vocabulary of {vocab}",
                tokens[i]
            );
        }
        Ok(Self {
            n_ctx: n_ctx as u32,
            n_vocab,
            n_chunk,
            tokens,
            words: bytes[tokens_end..]
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect(),
        })
    }

    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let bytes =
            std::fs::read(path).map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
        Self::from_bytes(&bytes).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }

    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        std::fs::write(path, self.to_bytes())
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))
    }
}

/// The request sequence of a chunk: its tokens with the first replaced by `bos` (llama.cpp
/// evaluates it so where the vocabulary adds BOS).
pub fn chunk_sequence(chunk: &[i32], bos: Option<u32>) -> Vec<u32> {
    let mut seq: Vec<u32> = chunk.iter().map(|&t| t as u32).collect();
    if let (Some(first), Some(bos)) = (seq.first_mut(), bos) {
        *first = bos;
    }
    seq
}

/// A row as ExactScore's stored reference takes it: the decoded row renormalized (what
/// llama.cpp stored is a clamped, quantized log-softmax that does not sum to one), its `k`
/// likeliest tokens (lowest id first on ties) and the log-mass of the rest.
pub fn stored_row(words: &[u16], n_vocab: usize, k: usize) -> (Vec<u32>, Vec<f32>, Option<f32>) {
    let decoded: Vec<f64> = decode_row(words, n_vocab)
        .into_iter()
        .map(f64::from)
        .collect();
    let max = decoded.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + decoded.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
    let mut order: Vec<usize> = (0..n_vocab).collect();
    order.sort_by(|&a, &b| decoded[b].total_cmp(&decoded[a]).then(a.cmp(&b)));
    let k = k.min(n_vocab);
    let tail: f64 = order[k..].iter().map(|&i| (decoded[i] - max).exp()).sum();
    (
        order[..k].iter().map(|&i| i as u32).collect(),
        order[..k]
            .iter()
            .map(|&i| (decoded[i] - lse) as f32)
            .collect(),
        (tail > 0.0).then(|| (max + tail.ln() - lse) as f32),
    )
}

/// BOS where the server's tokenizer adds one: llama.cpp swaps it into each chunk's first place.
async fn bos(client: &crate::http::Client) -> anyhow::Result<Option<u32>> {
    let info = client.tokenizer_info().await?;
    Ok(info.bos_token_id.filter(|_| info.add_bos_token))
}

/// Writes a base file of `config`'s server (the reference) over its dataset, with llama.cpp's
/// windowing at `--ctx` (`--max-windows` as `--chunks`). The full rows travel through
/// `/reference` with k = the vocabulary, so this is for vocabularies up to that route's limit.
pub async fn save_base(config: &crate::PplConfig, path: &Path) -> anyhow::Result<BaseFile> {
    let client = crate::reference::connect(config)?;
    let info = client.info().await?;
    let ds = crate::dataset::load(&config.dataset, &config.dataset_options)?;
    let tokens = crate::tokenize::tokenize(&client, &ds.text, true, config.tokenize).await?;
    let (n_ctx, vocab) = (config.ctx, info.vocab_size);
    let n_chunk = (tokens.len() / n_ctx).min(config.max_windows.unwrap_or(usize::MAX));
    anyhow::ensure!(
        n_chunk > 0,
        "{} tokens make no chunk of --ctx {n_ctx}",
        tokens.len()
    );
    let bos = bos(&client).await?;
    let nv = row_words(vocab);
    let mut words = Vec::with_capacity(n_chunk * scored_rows(n_ctx) * nv);
    let chunks: Vec<i32> = tokens[..n_chunk * n_ctx]
        .iter()
        .map(|&t| t as i32)
        .collect();
    for chunk in chunks.chunks_exact(n_ctx) {
        let seq = chunk_sequence(chunk, bos);
        let resp = client
            .reference(&exactscore_api::ReferenceRequest {
                tokens: exactscore_api::TokensInput::Single(
                    seq.iter().map(|&t| i64::from(t)).collect(),
                ),
                k: vocab as i64,
            })
            .await?;
        let rows = resp
            .sequences
            .into_iter()
            .next()
            .ok_or_else(|| anyhow::anyhow!("/reference returned no sequence"))?;
        let mut logprobs = vec![0f32; vocab];
        for row in n_ctx / 2..n_ctx - 1 {
            let at = row * vocab..(row + 1) * vocab;
            for (&id, &lp) in rows.ids[at.clone()].iter().zip(&rows.logprobs[at]) {
                logprobs[id as usize] = lp;
            }
            let start = words.len();
            words.resize(start + nv, 0);
            encode_row(&logprobs, &mut words[start..]);
        }
    }
    let file = BaseFile {
        n_ctx: n_ctx as u32,
        n_vocab: vocab as i32,
        n_chunk: n_chunk as i32,
        tokens: chunks,
        words,
    };
    file.write(path)?;
    Ok(file)
}

/// Scores `config`'s server against a base file that llama.cpp (or [`save_base`]) wrote: each
/// chunk as llama.cpp evaluates it, its scored rows as a stored reference of `k` tokens.
pub async fn kld_base(
    config: &crate::PplConfig,
    file: &BaseFile,
    k: usize,
) -> anyhow::Result<crate::reference::StoredKldReport> {
    let client = crate::reference::connect(config)?;
    let info = client.info().await?;
    let vocab = file.n_vocab as usize;
    anyhow::ensure!(
        info.vocab_size == vocab,
        "the base file's vocabulary has {vocab} tokens, the served model's {}",
        info.vocab_size
    );
    let bos = bos(&client).await?;
    let n_ctx = file.n_ctx as usize;
    let rows_per_chunk = scored_rows(n_ctx);
    let windows: Vec<crate::reference::StoredWindow> = (0..file.n_chunk as usize)
        .map(|c| {
            let mut rows = exactscore_api::StoredRows {
                start: n_ctx / 2,
                k: k.min(vocab),
                ..Default::default()
            };
            for r in c * rows_per_chunk..(c + 1) * rows_per_chunk {
                let (ids, logprobs, tail) = stored_row(file.row(r), vocab, k);
                rows.ids.extend(ids);
                rows.logprobs.extend(logprobs);
                rows.tail_logmass.push(tail);
            }
            crate::reference::StoredWindow {
                tokens: chunk_sequence(file.chunk(c), bos),
                rows,
            }
        })
        .collect();
    let mut report = crate::reference::bounded(&client, &windows).await?;
    report.model = info.model;
    report.reference_model = "llama.cpp base file".into();
    report.k = k.min(vocab);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n_vocab: usize, n_ctx: usize, n_chunk: usize) -> BaseFile {
        let rows = n_chunk * scored_rows(n_ctx);
        let mut words = vec![0u16; rows * row_words(n_vocab)];
        for (r, out) in words.chunks_exact_mut(row_words(n_vocab)).enumerate() {
            let logits: Vec<f64> = (0..n_vocab)
                .map(|i| ((i * 37 + r * 11) % 23) as f64 * 0.9 - 20.0 * ((i % 5 == 0) as u8 as f64))
                .collect();
            let lse = logits.iter().map(|l| l.exp()).sum::<f64>().ln();
            let lp: Vec<f32> = logits.iter().map(|l| (l - lse) as f32).collect();
            encode_row(&lp, out);
        }
        BaseFile {
            n_ctx: n_ctx as u32,
            n_vocab: n_vocab as i32,
            n_chunk: n_chunk as i32,
            tokens: (0..n_ctx * n_chunk).map(|i| (i % n_vocab) as i32).collect(),
            words,
        }
    }

    #[test]
    fn a_base_file_round_trips_bit_for_bit_with_llama_cpp_sizes() {
        for (vocab, ctx) in [(7, 8), (10, 9)] {
            let file = sample(vocab, ctx, 3);
            let bytes = file.to_bytes();
            // Header, tokens, and per scored row nv words: what llama.cpp seeks through.
            let nv = 2 * vocab.div_ceil(2) + 4;
            assert_eq!(
                bytes.len(),
                20 + 4 * ctx * 3 + 2 * nv * 3 * (ctx - 1 - ctx / 2)
            );
            assert_eq!(&bytes[..8], b"_logits_");
            assert_eq!(bytes[8..12], (ctx as u32).to_le_bytes());
            let back = BaseFile::from_bytes(&bytes).unwrap();
            assert_eq!(back, file);
            assert_eq!(back.to_bytes(), bytes);
        }
        let bytes = sample(7, 8, 2).to_bytes();
        let e = BaseFile::from_bytes(&bytes[..bytes.len() - 2]).unwrap_err();
        assert!(e.to_string().contains("make"), "{e}");
    }

    #[test]
    fn a_row_reads_back_within_half_a_step_and_clamps_below_sixteen_nats() {
        let lp: Vec<f32> = vec![-0.1, -2.5, -7.0, -30.0, -16.05, -0.1];
        let mut words = vec![0u16; row_words(lp.len())];
        encode_row(&lp, &mut words);
        let back = decode_row(&words, lp.len());
        let scale = 16.0 / 65535.0;
        for (i, (&a, &b)) in lp.iter().zip(&back).enumerate() {
            // Below max − 16 llama.cpp keeps only the floor.
            let expect = a.max(-0.1 - 16.0);
            assert!((expect - b).abs() <= scale * 0.51 + 1e-5, "{i}: {a} -> {b}");
        }
        assert_eq!(words[4 + 3], 0);
        // Ties to even, as llama.cpp's float trick does.
        assert_eq!(
            (nearest_int(2.5), nearest_int(3.5), nearest_int(-1.5)),
            (2, 4, -2)
        );
        // A flat row has scale 0 and every word 0.
        let mut flat = vec![1u16; row_words(4)];
        encode_row(&[-4f32.ln(); 4], &mut flat);
        assert!(flat[4..].iter().all(|&w| w == 0));
        assert_eq!(decode_row(&flat, 4), vec![-4f32.ln(); 4]);
    }

    #[test]
    fn a_stored_row_is_the_renormalized_top_k_and_its_tail() {
        let lp: Vec<f32> = [0.5f64, 0.3, 0.15, 0.05]
            .iter()
            .map(|p| p.ln() as f32)
            .collect();
        let mut words = vec![0u16; row_words(4)];
        encode_row(&lp, &mut words);
        let (ids, top, tail) = stored_row(&words, 4, 2);
        assert_eq!(ids, vec![0, 1]);
        assert!((top[0] as f64 - 0.5f64.ln()).abs() < 2e-4, "{top:?}");
        assert!(
            (tail.unwrap() as f64 - 0.2f64.ln()).abs() < 2e-4,
            "{tail:?}"
        );
        assert_eq!(stored_row(&words, 4, 4).2, None);
    }
}
