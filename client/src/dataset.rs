//! Evaluation texts. Every dataset becomes one UTF-8 text that is tokenized once.
//!
//! * `.txt` — the file as is (UTF-8).
//! * `.txt.gz` — the gunzipped file (UTF-8).
//! * `.jsonl` — one JSON object per non-empty line; the string at `field` (default `text`) of
//!   every line, joined with `"\n\n"`.
//! * `.parquet` — the string column `field` (default `text`) of every row, joined with `"\n\n"`.
//!   Uncompressed and snappy-compressed files are read (the parquet crate is built without its
//!   zstd/brotli/lz4 codecs to keep the build small).
//! * texts in memory (the Python API's list of strings) — joined with `"\n\n"`, as documents.
//! * `wikitext2` — the WikiText-2 raw test split as ExLlamaV3 evaluates it, built from the
//!   repository's `wikitext-2-raw-test.txt.gz` by `gunzip(file).replace(b"\r\n", b"\n\n\n")[:-2]`
//!   (rows joined with `"\n\n"`, each keeping its trailing `"\n"`); its sha256 is checked.

use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// SHA-256 of the wikitext2 evaluation text (1,293,436 bytes, 2891 rows).
pub const WIKITEXT2_SHA256: &str =
    "c5b5caea5bd655cb221545a484f2f0f59d35092a17a66840d7b9513d0b99687d";
/// The fixture's file name.
pub const WIKITEXT2_FILE: &str = "wikitext-2-raw-test.txt.gz";
/// Separator between documents of `.jsonl` and `.parquet` datasets.
pub const DOC_SEPARATOR: &str = "\n\n";

#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not valid UTF-8 (byte {offset})")]
    Utf8 { path: PathBuf, offset: usize },
    #[error("{path}:{line}: {message}")]
    Jsonl {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{path}: {message}")]
    Parquet { path: PathBuf, message: String },
    #[error(
        "{path}: wikitext2 text has sha256 {actual}, expected {WIKITEXT2_SHA256}; \
         the file is not the repository's wikitext-2-raw-test.txt.gz"
    )]
    Checksum { path: PathBuf, actual: String },
    #[error(
        "wikitext2: {WIKITEXT2_FILE} not found (looked in {tried}); pass --wikitext-path or set \
         EXACTSCORE_WIKITEXT_PATH"
    )]
    WikitextMissing { tried: String },
    #[error("{0}: unknown dataset type (expected wikitext2, .txt, .txt.gz, .jsonl or .parquet)")]
    UnknownKind(String),
    #[error(
        "{0}: a directory, not a dataset file: give one .txt, .txt.gz, .jsonl or .parquet file \
         (join the files first), or wikitext2"
    )]
    Directory(PathBuf),
}

/// What to load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DatasetSpec {
    Wikitext2,
    Txt(PathBuf),
    TxtGz(PathBuf),
    Jsonl(PathBuf),
    Parquet(PathBuf),
    /// Documents given in memory, joined with [`DOC_SEPARATOR`] like a `.jsonl` file's.
    Texts(Vec<String>),
}

impl DatasetSpec {
    /// `wikitext2` or a path, typed by its extension.
    pub fn parse(s: &str) -> Result<Self, DatasetError> {
        let lower = s.to_ascii_lowercase();
        let p = PathBuf::from(s);
        if p.is_dir() {
            return Err(DatasetError::Directory(p));
        }
        Ok(if lower == "wikitext2" || lower == "wikitext-2" {
            DatasetSpec::Wikitext2
        } else if lower.ends_with(".txt.gz") {
            DatasetSpec::TxtGz(p)
        } else if lower.ends_with(".txt") {
            DatasetSpec::Txt(p)
        } else if lower.ends_with(".jsonl") {
            DatasetSpec::Jsonl(p)
        } else if lower.ends_with(".parquet") {
            DatasetSpec::Parquet(p)
        } else {
            return Err(DatasetError::UnknownKind(s.to_string()));
        })
    }

    /// The file it is read from, if any.
    pub fn path(&self) -> Option<&Path> {
        match self {
            DatasetSpec::Txt(p)
            | DatasetSpec::TxtGz(p)
            | DatasetSpec::Jsonl(p)
            | DatasetSpec::Parquet(p) => Some(p),
            DatasetSpec::Wikitext2 | DatasetSpec::Texts(_) => None,
        }
    }

    pub fn name(&self) -> String {
        match self {
            DatasetSpec::Wikitext2 => "wikitext2".into(),
            DatasetSpec::Txt(p)
            | DatasetSpec::TxtGz(p)
            | DatasetSpec::Jsonl(p)
            | DatasetSpec::Parquet(p) => p.display().to_string(),
            DatasetSpec::Texts(t) => format!("{} texts", t.len()),
        }
    }
}

/// Options of loading.
#[derive(Debug, Clone, Default)]
pub struct DatasetOptions {
    /// `.jsonl` field / `.parquet` column (default `text`).
    pub field: Option<String>,
    /// Where `wikitext-2-raw-test.txt.gz` is (default: see [`default_wikitext_candidates`]).
    pub wikitext_path: Option<PathBuf>,
}

/// A loaded evaluation text.
#[derive(Debug, Clone)]
pub struct Dataset {
    pub name: String,
    pub text: String,
    /// Rows/documents joined into `text` (1 for plain text files).
    pub documents: usize,
    /// Hex SHA-256 of `text`'s UTF-8 bytes.
    pub sha256: String,
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// Where `wikitext2` is looked for when no path is given: `tests/fixtures/corpus/` under the
/// current directory, the same folder of the source tree this binary was built from, then
/// `../share/exactscore/` beside the executable (where the Python wheel installs it).
pub fn default_wikitext_candidates() -> Vec<PathBuf> {
    let mut out = vec![
        PathBuf::from("tests/fixtures/corpus").join(WIKITEXT2_FILE),
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/corpus")
            .join(WIKITEXT2_FILE),
    ];
    if let Some(bin) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        out.push(bin.join("../share/exactscore").join(WIKITEXT2_FILE));
    }
    out
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DatasetError + '_ {
    move |source| DatasetError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn utf8(path: &Path, bytes: Vec<u8>) -> Result<String, DatasetError> {
    String::from_utf8(bytes).map_err(|e| DatasetError::Utf8 {
        path: path.to_path_buf(),
        offset: e.utf8_error().valid_up_to(),
    })
}

fn gunzip(path: &Path) -> Result<Vec<u8>, DatasetError> {
    let f = std::fs::File::open(path).map_err(io_err(path))?;
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(std::io::BufReader::new(f))
        .read_to_end(&mut out)
        .map_err(io_err(path))?;
    Ok(out)
}

/// The wikitext2 evaluation text from the gzipped corpus file, checksum verified.
pub fn wikitext2_text(path: &Path) -> Result<String, DatasetError> {
    let raw = gunzip(path)?;
    let mut out = Vec::with_capacity(raw.len() + raw.len() / 50);
    let mut i = 0;
    while i < raw.len() {
        if raw[i] == b'\r' && raw.get(i + 1) == Some(&b'\n') {
            out.extend_from_slice(b"\n\n\n");
            i += 2;
        } else {
            out.push(raw[i]);
            i += 1;
        }
    }
    out.truncate(out.len().saturating_sub(2));
    let actual = sha256_hex(&out);
    if actual != WIKITEXT2_SHA256 {
        return Err(DatasetError::Checksum {
            path: path.to_path_buf(),
            actual,
        });
    }
    utf8(path, out)
}

fn resolve_wikitext(opts: &DatasetOptions) -> Result<PathBuf, DatasetError> {
    if let Some(p) = &opts.wikitext_path {
        return Ok(p.clone());
    }
    let cands = default_wikitext_candidates();
    cands
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| DatasetError::WikitextMissing {
            tried: cands
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

fn jsonl_text(path: &Path, field: &str) -> Result<(String, usize), DatasetError> {
    let raw = utf8(path, std::fs::read(path).map_err(io_err(path))?)?;
    let mut docs = Vec::new();
    for (i, line) in raw.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let err = |message: String| DatasetError::Jsonl {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        };
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| err(format!("invalid JSON: {e}")))?;
        match v.get(field) {
            Some(serde_json::Value::String(s)) => docs.push(s.clone()),
            Some(other) => {
                return Err(err(format!(
                    "field {field:?} is not a string (it is {})",
                    json_kind(other)
                )))
            }
            None => return Err(err(format!("no field {field:?}"))),
        }
    }
    let n = docs.len();
    Ok((docs.join(DOC_SEPARATOR), n))
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

fn parquet_text(path: &Path, column: &str) -> Result<(String, usize), DatasetError> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field;
    let perr = |message: String| DatasetError::Parquet {
        path: path.to_path_buf(),
        message,
    };
    let f = std::fs::File::open(path).map_err(io_err(path))?;
    let reader = SerializedFileReader::new(f).map_err(|e| perr(e.to_string()))?;
    let schema = reader.metadata().file_metadata().schema_descr_ptr();
    let fields = schema.root_schema().get_fields();
    let Some(col) = fields.iter().find(|f| f.name() == column) else {
        let names: Vec<_> = fields.iter().map(|f| f.name().to_string()).collect();
        return Err(perr(format!(
            "no column {column:?} (columns: {})",
            names.join(", ")
        )));
    };
    let projection = parquet::schema::types::Type::group_type_builder("schema")
        .with_fields(vec![col.clone()])
        .build()
        .map_err(|e| perr(e.to_string()))?;
    let rows = reader
        .get_row_iter(Some(projection))
        .map_err(|e| perr(e.to_string()))?;
    let mut docs = Vec::new();
    for (i, row) in rows.enumerate() {
        let row = row.map_err(|e| perr(format!("row {i}: {e}")))?;
        let (_, value) = row
            .get_column_iter()
            .next()
            .ok_or_else(|| perr(format!("row {i}: empty")))?;
        match value {
            Field::Str(s) => docs.push(s.clone()),
            other => {
                return Err(perr(format!(
                    "row {i}: column {column:?} is not a string ({other})"
                )))
            }
        }
    }
    let n = docs.len();
    Ok((docs.join(DOC_SEPARATOR), n))
}

/// Load a dataset into one text.
pub fn load(spec: &DatasetSpec, opts: &DatasetOptions) -> Result<Dataset, DatasetError> {
    let field = opts.field.as_deref().unwrap_or("text");
    if let Some(p) = spec.path().filter(|p| p.is_dir()) {
        return Err(DatasetError::Directory(p.to_path_buf()));
    }
    let (text, documents) = match spec {
        DatasetSpec::Wikitext2 => {
            let p = resolve_wikitext(opts)?;
            (wikitext2_text(&p)?, 2891)
        }
        DatasetSpec::Txt(p) => (utf8(p, std::fs::read(p).map_err(io_err(p))?)?, 1),
        DatasetSpec::TxtGz(p) => (utf8(p, gunzip(p)?)?, 1),
        DatasetSpec::Jsonl(p) => jsonl_text(p, field)?,
        DatasetSpec::Parquet(p) => parquet_text(p, field)?,
        DatasetSpec::Texts(t) => (t.join(DOC_SEPARATOR), t.len()),
    };
    Ok(Dataset {
        name: spec.name(),
        sha256: sha256_hex(text.as_bytes()),
        text,
        documents,
    })
}
