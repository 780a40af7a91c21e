//! Stored references (docs/stored-reference.md): `exactscore reference save` runs a reference
//! server's `/reference` over a dataset's windows and writes one file; `exactscore kld
//! --reference-file` sends its rows with the windows to a server's `/kld/stored`, which needs no
//! reference model. A file is refused where its dataset, windows or tokenizer differ.
//!
//! File layout, version 1, all numbers little-endian:
//!
//! | bytes | what |
//! |---|---|
//! | 8 | magic `ESREF\0\0\0` |
//! | 4 | u32 format version (1) |
//! | 4 | u32 header length H |
//! | H | header, UTF-8 JSON ([`Header`]) |
//! | … | per window, in order: its request tokens (u32 × `len`), then for its `rows` scored positions the top-k ids (u32 × rows·k, best first), log-probabilities (f32 × rows·k) and tail log-masses (f32 × rows, −∞ for none) |

use std::io::Write;
use std::path::Path;

use exactscore_api::{ModelInfo, ReferenceRequest, StoredRows, TokensInput};
use serde::{Deserialize, Serialize};

use crate::dataset::sha256_hex;
use crate::http::Client;
use crate::runner::{prepare, PplConfig, PplError};
use crate::windows::Window;

pub const MAGIC: &[u8; 8] = b"ESREF\0\0\0";
pub const FORMAT_VERSION: u32 = 1;

/// What a stored reference was computed from: everything that must match for its rows to be
/// about the tokens a later run sends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub dataset: String,
    pub dataset_sha256: String,
    pub windows: WindowsKey,
    /// sha256 of the server's tokenizer.json.
    pub tokenizer_sha256: String,
    pub model: String,
    /// `/info`'s `checkpoint_sha256` of the reference.
    pub checkpoint_sha256: Option<String>,
    pub dtype: String,
    pub server_version: String,
    pub client_version: String,
    pub k: usize,
    /// Per window: request tokens and stored rows (its scored positions).
    pub layout: Vec<WindowLayout>,
}

/// The window parameters a run must repeat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WindowsKey {
    pub method: String,
    pub ctx: usize,
    pub stride: usize,
    pub max_windows: Option<usize>,
    pub prefix_token: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WindowLayout {
    pub len: usize,
    /// Position of the first stored row (the distribution after token `start`).
    pub start: usize,
    pub rows: usize,
}

/// One window of a stored reference: its request tokens and its rows.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredWindow {
    pub tokens: Vec<u32>,
    pub rows: StoredRows,
}

/// A whole stored reference.
#[derive(Debug, Clone, PartialEq)]
pub struct ReferenceFile {
    pub header: Header,
    pub windows: Vec<StoredWindow>,
}

/// Reads a file front to back, naming the part it ends inside.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> anyhow::Result<&'a [u8]> {
        anyhow::ensure!(self.0.len() >= n, "the file ends inside {what}");
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    /// `n` little-endian u32 words.
    fn words(&mut self, n: usize, what: &str) -> anyhow::Result<Vec<u32>> {
        let bytes = self.take(n.saturating_mul(4), what)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

fn put_u32s(out: &mut Vec<u8>, values: impl Iterator<Item = u32>) {
    values.for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
}

impl ReferenceFile {
    pub fn to_bytes(&self) -> anyhow::Result<Vec<u8>> {
        let header = serde_json::to_vec(&self.header)?;
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        put_u32s(&mut out, [FORMAT_VERSION, header.len() as u32].into_iter());
        out.extend_from_slice(&header);
        for w in &self.windows {
            put_u32s(&mut out, w.tokens.iter().copied());
            put_u32s(&mut out, w.rows.ids.iter().copied());
            put_u32s(&mut out, w.rows.logprobs.iter().map(|v| v.to_bits()));
            let tail = w.rows.tail_logmass.iter();
            put_u32s(
                &mut out,
                tail.map(|v| v.unwrap_or(f32::NEG_INFINITY).to_bits()),
            );
        }
        Ok(out)
    }

    pub fn from_bytes(bytes: &[u8]) -> anyhow::Result<Self> {
        let mut r = Cursor(bytes);
        anyhow::ensure!(
            r.take(8, "the magic")? == MAGIC,
            "not an ExactScore stored reference (no `ESREF` magic)"
        );
        let [version, header_len] = r.words(2, "the header")?[..] else {
            unreachable!("two words read")
        };
        anyhow::ensure!(
            version == FORMAT_VERSION,
            "stored reference format version {version}; this client reads {FORMAT_VERSION}"
        );
        let header: Header = serde_json::from_slice(r.take(header_len as usize, "the header")?)
            .map_err(|e| anyhow::anyhow!("stored reference header: {e}"))?;
        let k = header.k;
        let mut windows = Vec::with_capacity(header.layout.len());
        for (i, w) in header.layout.iter().enumerate() {
            let tokens = r.words(w.len, &format!("window {i}'s tokens"))?;
            let ids = r.words(w.rows * k, &format!("window {i}'s ids"))?;
            let logprobs = r.words(w.rows * k, &format!("window {i}'s log-probabilities"))?;
            let tail = r.words(w.rows, &format!("window {i}'s tail log-masses"))?;
            windows.push(StoredWindow {
                tokens,
                rows: StoredRows {
                    start: w.start,
                    k,
                    ids,
                    logprobs: logprobs.into_iter().map(f32::from_bits).collect(),
                    tail_logmass: tail
                        .into_iter()
                        .map(f32::from_bits)
                        .map(|v| v.is_finite().then_some(v))
                        .collect(),
                },
            });
        }
        anyhow::ensure!(r.0.is_empty(), "{} bytes after the last window", r.0.len());
        Ok(Self { header, windows })
    }

    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        let mut f = std::fs::File::create(path)
            .map_err(|e| anyhow::anyhow!("creating {}: {e}", path.display()))?;
        f.write_all(&self.to_bytes()?)?;
        Ok(())
    }

    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let bytes =
            std::fs::read(path).map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
        Self::from_bytes(&bytes).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }
}

/// What a run computes from its dataset, windows and tokenizer, to set against a file's
/// header.
#[derive(Debug, Clone, PartialEq)]
pub struct RunKey {
    pub dataset_sha256: String,
    pub windows: WindowsKey,
    pub tokenizer_sha256: String,
}

impl Header {
    /// Every way `run` differs from what this reference was computed from, named.
    pub fn mismatches(&self, run: &RunKey) -> Vec<String> {
        let mut out = Vec::new();
        if self.dataset_sha256 != run.dataset_sha256 {
            out.push(format!(
                "dataset sha256 {} (file: {})",
                run.dataset_sha256, self.dataset_sha256
            ));
        }
        let (a, b) = (&self.windows, &run.windows);
        for (what, file, here) in [
            ("method", a.method.clone(), b.method.clone()),
            ("ctx", a.ctx.to_string(), b.ctx.to_string()),
            ("stride", a.stride.to_string(), b.stride.to_string()),
            (
                "max windows",
                format!("{:?}", a.max_windows),
                format!("{:?}", b.max_windows),
            ),
            (
                "prefix token",
                format!("{:?}", a.prefix_token),
                format!("{:?}", b.prefix_token),
            ),
        ] {
            if file != here {
                out.push(format!("windows: {what} {here} (file: {file})"));
            }
        }
        if self.tokenizer_sha256 != run.tokenizer_sha256 {
            out.push(format!(
                "tokenizer sha256 {} (file: {})",
                run.tokenizer_sha256, self.tokenizer_sha256
            ));
        }
        out
    }
}

/// The dataset, windows and tokenizer of a run against `client`'s server.
/// A client of `config`'s first server.
pub fn connect(config: &PplConfig) -> anyhow::Result<Client> {
    Ok(Client::new(crate::http::ClientConfig {
        api_key: config.api_key.clone(),
        timeout: config.timeout,
        retry: config.retry.clone(),
        ..crate::http::ClientConfig::new(first_server(config)?)
    })?)
}

async fn prepare_run(
    config: &PplConfig,
    client: &Client,
    info: &ModelInfo,
) -> anyhow::Result<(RunKey, Vec<(Window, Vec<u32>)>)> {
    let prepared = prepare(config, client, std::slice::from_ref(info))
        .await
        .map_err(|e: PplError| anyhow::anyhow!("{e}"))?;
    let tokenizer_sha256 = sha256_hex(&client.tokenizer_json().await?);
    let key = RunKey {
        dataset_sha256: prepared.ds.sha256.clone(),
        windows: WindowsKey {
            method: config.method.to_string(),
            ctx: config.ctx,
            stride: config.stride,
            max_windows: config.max_windows,
            prefix_token: prepared.prefix,
        },
        tokenizer_sha256,
    };
    let windows = prepared
        .all
        .into_iter()
        .map(|w| {
            let seq = w.sequence(&prepared.tokens);
            (w, seq)
        })
        .collect();
    Ok((key, windows))
}

/// `exactscore reference save`: the server's model over `config`'s windows, `k` tokens a row.
pub async fn save(config: &PplConfig, k: usize, path: &Path) -> anyhow::Result<ReferenceFile> {
    let client = connect(config)?;
    let info = client.info().await?;
    let (key, windows) = prepare_run(config, &client, &info).await?;
    let mut stored = Vec::with_capacity(windows.len());
    let mut layout = Vec::with_capacity(windows.len());
    for (w, tokens) in windows {
        let resp = client
            .reference(&ReferenceRequest {
                tokens: TokensInput::Single(tokens.iter().map(|&t| i64::from(t)).collect()),
                k: k as i64,
            })
            .await?;
        let all = resp
            .sequences
            .into_iter()
            .next()
            .ok_or_else(|| anyhow::anyhow!("/reference returned no sequence"))?;
        // The rows of the scored positions: position p is predicted by the row after p − 1.
        let (start, rows) = (w.scored.start - 1, w.scored.len());
        let at = start * k..(start + rows) * k;
        layout.push(WindowLayout {
            len: tokens.len(),
            start,
            rows,
        });
        stored.push(StoredWindow {
            tokens,
            rows: StoredRows {
                start,
                k,
                ids: all.ids[at.clone()].to_vec(),
                logprobs: all.logprobs[at].to_vec(),
                tail_logmass: all.tail_logmass[start..start + rows].to_vec(),
            },
        });
    }
    let file = ReferenceFile {
        header: Header {
            dataset: config.dataset.name(),
            dataset_sha256: key.dataset_sha256,
            windows: key.windows,
            tokenizer_sha256: key.tokenizer_sha256,
            model: info.model.clone(),
            checkpoint_sha256: info.checkpoint_sha256.clone(),
            dtype: info.dtype.clone(),
            server_version: info.version.clone(),
            client_version: env!("CARGO_PKG_VERSION").to_string(),
            k,
            layout,
        },
        windows: stored,
    };
    file.write(path)?;
    Ok(file)
}

fn first_server(config: &PplConfig) -> anyhow::Result<String> {
    config
        .servers
        .first()
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no server given"))
}

/// `exactscore kld --reference-file`: sums over every stored row.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StoredKldReport {
    pub model: String,
    pub reference_model: String,
    pub reference_checkpoint_sha256: Option<String>,
    pub k: usize,
    pub positions: usize,
    pub mean_kld_top_k: f64,
    pub mean_kld_estimate: f64,
    pub mean_kld_lower: f64,
    pub mean_kld_upper: f64,
    pub perplexity: f64,
    pub same_top: f64,
}

impl StoredKldReport {
    pub fn to_table(&self) -> String {
        format!(
            "model                {}\nreference (stored)   {} (k = {})\npositions            {}\nperplexity           {:.4}\nmean KLD estimate    {:.6}\nmean KLD bounds      [{:.6}, {:.6}]\nmean KLD top-k part  {:.6}\nsame top token       {:.2} %\n",
            self.model,
            self.reference_model,
            self.k,
            self.positions,
            self.perplexity,
            self.mean_kld_estimate,
            self.mean_kld_lower,
            self.mean_kld_upper,
            self.mean_kld_top_k,
            100.0 * self.same_top
        )
    }
}

/// Scores `config`'s server against the stored reference `file`, refusing a file whose
/// dataset, windows or tokenizer differ from this run's.
pub async fn kld(config: &PplConfig, file: &ReferenceFile) -> anyhow::Result<StoredKldReport> {
    let client = connect(config)?;
    let info = client.info().await?;
    let (key, windows) = prepare_run(config, &client, &info).await?;
    let mut differ = file.header.mismatches(&key);
    if windows.len() != file.windows.len() {
        differ.push(format!(
            "windows: {} (file: {})",
            windows.len(),
            file.windows.len()
        ));
    } else if let Some(i) = windows
        .iter()
        .zip(&file.windows)
        .position(|((_, t), s)| *t != s.tokens)
    {
        differ.push(format!("window {i}'s tokens"));
    }
    anyhow::ensure!(
        differ.is_empty(),
        "the reference file does not match this run: {}",
        differ.join("; ")
    );
    let mut report = bounded(&client, &file.windows).await?;
    report.model = info.model;
    report.reference_model = file.header.model.clone();
    report.reference_checkpoint_sha256 = file.header.checkpoint_sha256.clone();
    report.k = file.header.k;
    Ok(report)
}

/// The sums of `/kld/stored` over `windows`, one request each, as means.
pub(crate) async fn bounded(
    client: &Client,
    windows: &[StoredWindow],
) -> anyhow::Result<StoredKldReport> {
    let (mut n, mut top_k, mut estimate, mut lower, mut upper, mut nll, mut same) =
        (0usize, 0f64, 0f64, 0f64, 0f64, 0f64, 0usize);
    for stored in windows {
        let resp = client
            .kld_stored(&exactscore_api::StoredKldRequest {
                sequences: vec![exactscore_api::StoredSequenceInput {
                    tokens: stored.tokens.clone(),
                    reference: stored.rows.clone(),
                }],
                per_token: Some(false),
            })
            .await?;
        for s in resp.sequences {
            n += s.num_scored;
            top_k += s.sum_top_k;
            estimate += s.sum_estimate;
            lower += s.sum_lower;
            upper += s.sum_upper;
            nll += s.sum_nll;
            same += s.same_top_count;
        }
    }
    let mean = |x: f64| x / n.max(1) as f64;
    Ok(StoredKldReport {
        positions: n,
        mean_kld_top_k: mean(top_k),
        mean_kld_estimate: mean(estimate),
        mean_kld_lower: mean(lower),
        mean_kld_upper: mean(upper),
        perplexity: mean(nll).exp(),
        same_top: mean(same as f64),
        ..StoredKldReport::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ReferenceFile {
        ReferenceFile {
            header: Header {
                dataset: "t".into(),
                dataset_sha256: "ab".into(),
                windows: WindowsKey {
                    method: "exl3".into(),
                    ctx: 4,
                    stride: 2,
                    max_windows: None,
                    prefix_token: None,
                },
                tokenizer_sha256: "cd".into(),
                model: "m".into(),
                checkpoint_sha256: None,
                dtype: "f32".into(),
                server_version: "0".into(),
                client_version: "0".into(),
                k: 2,
                layout: vec![WindowLayout {
                    len: 4,
                    start: 1,
                    rows: 2,
                }],
            },
            windows: vec![StoredWindow {
                tokens: vec![1, 2, 3, 4],
                rows: StoredRows {
                    start: 1,
                    k: 2,
                    ids: vec![7, 3, 3, 9],
                    logprobs: vec![-0.25, -1.5, -0.125, -3.0],
                    tail_logmass: vec![Some(-2.0), None],
                },
            }],
        }
    }

    #[test]
    fn a_file_reads_back_bit_for_bit_and_a_cut_one_names_where_it_ends() {
        let file = sample();
        let bytes = file.to_bytes().unwrap();
        assert_eq!(ReferenceFile::from_bytes(&bytes).unwrap(), file);
        assert_eq!(
            ReferenceFile::from_bytes(&bytes)
                .unwrap()
                .to_bytes()
                .unwrap(),
            bytes
        );
        let e = ReferenceFile::from_bytes(&bytes[..bytes.len() - 3]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the file ends inside window 0's tail log-masses"
        );
        let mut longer = bytes.clone();
        longer.push(0);
        let e = ReferenceFile::from_bytes(&longer).unwrap_err();
        assert_eq!(e.to_string(), "1 bytes after the last window");
        let e = ReferenceFile::from_bytes(b"_logits_\0\0\0\0").unwrap_err();
        assert!(e.to_string().contains("not an ExactScore stored reference"));
    }
}
