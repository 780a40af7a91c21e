//! A Hugging Face checkpoint directory: `config.json` plus one or more safetensors files
//! (sharded through `model.safetensors.index.json`). Every tensor read goes through
//! [`Checkpoint::tensor`], which checks name, dtype, shape and that every float is finite, names
//! the tensor on failure, and records the read so that [`Checkpoint::refuse_unread`] can refuse
//! tensors the model never used.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use safetensors::Dtype as StDtype;

/// Everything that can go wrong while loading a checkpoint. Each variant names what is wrong
/// precisely enough to fix the file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// `--model` (or `--reference-model`) names no checkpoint directory: what it is instead,
    /// and what to do.
    #[error("{path}: {reason}")]
    NotACheckpoint { path: PathBuf, reason: String },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{file}: not a valid safetensors file (truncated or corrupt?): {reason}")]
    Safetensors { file: PathBuf, reason: String },
    #[error("config field `{field}`: {reason}")]
    Config { field: String, reason: String },
    #[error("tensor `{name}` is missing from the checkpoint")]
    MissingTensor { name: String },
    #[error("tensor `{name}` has dtype {found:?}, expected {expected}")]
    WrongDtype {
        name: String,
        found: StDtype,
        expected: String,
    },
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    WrongShape {
        name: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("tensor `{name}`: {reason}")]
    BadTensor { name: String, reason: String },
    #[error("layer `{layer}`: quantization field `{field}`: {reason}")]
    Unsupported {
        layer: String,
        field: String,
        reason: String,
    },
    #[error("device error: {0}")]
    Device(#[from] candle_core::Error),
}

impl LoadError {
    pub fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Config {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// A tensor held in host memory: dtype, shape and little-endian bytes, as in a safetensors file.
pub struct HostTensor {
    pub dtype: StDtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

enum Storage {
    Files(MmapedSafetensors),
    /// Built in memory (benchmarks with random weights of a real model's shape).
    Memory(std::collections::HashMap<String, HostTensor>),
}

/// An opened checkpoint. Tensors are memory-mapped and copied to the device on request only.
pub struct Checkpoint {
    dir: PathBuf,
    storage: Storage,
    names: BTreeSet<String>,
    /// Every name [`Self::tensor`] was asked for, found or not.
    read: Mutex<BTreeSet<String>>,
}

/// Tensors a checkpoint may hold that no architecture reads, by name suffix: the RoPE inverse
/// frequencies older transformers versions saved (recomputed from config.json here).
pub const IGNORED_TENSOR_SUFFIXES: &[&str] = &[".rotary_emb.inv_freq"];

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        let files = safetensors_files(dir)?;
        for file in &files {
            validate_header(file)?;
        }
        // SAFETY: the files are opened read-only and are not modified while the server runs;
        // memory-mapping is how every safetensors loader avoids a full copy of the weights.
        #[allow(unsafe_code)]
        let tensors =
            unsafe { MmapedSafetensors::multi(&files) }.map_err(|e| LoadError::Safetensors {
                file: dir.to_path_buf(),
                reason: e.to_string(),
            })?;
        let names = tensors.tensors().into_iter().map(|(n, _)| n).collect();
        Ok(Self {
            dir: dir.to_path_buf(),
            storage: Storage::Files(tensors),
            names,
            read: Mutex::default(),
        })
    }

    /// A checkpoint whose tensors are already in memory.
    pub fn from_memory(tensors: std::collections::HashMap<String, HostTensor>) -> Self {
        Self {
            dir: PathBuf::from("<memory>"),
            names: tensors.keys().cloned().collect(),
            storage: Storage::Memory(tensors),
            read: Mutex::default(),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn contains(&self, name: &str) -> bool {
        self.names.contains(name)
    }

    /// Shape and dtype of a tensor without loading it.
    pub fn meta(&self, name: &str) -> Result<(StDtype, Vec<usize>), LoadError> {
        let missing = || LoadError::MissingTensor { name: name.into() };
        match &self.storage {
            Storage::Files(files) => {
                let view = files.get(name).map_err(|_| missing())?;
                Ok((view.dtype(), view.shape().to_vec()))
            }
            Storage::Memory(map) => {
                let t = map.get(name).ok_or_else(missing)?;
                Ok((t.dtype, t.shape.clone()))
            }
        }
    }

    /// Loads `name` after checking its dtype is one of `dtypes` and its shape is `shape`
    /// (`None` skips the shape check). `I8` and `F8_E4M3` tensors come back as `U8` holding the
    /// same bits: the format modules decode them bit-exactly themselves, and candle has no `I8`.
    pub fn tensor(
        &self,
        name: &str,
        dtypes: &[StDtype],
        shape: Option<&[usize]>,
        device: &Device,
    ) -> Result<Tensor, LoadError> {
        let (dtype, found) = self.meta(name)?;
        if !dtypes.contains(&dtype) {
            return Err(LoadError::WrongDtype {
                name: name.into(),
                found: dtype,
                expected: dtypes
                    .iter()
                    .map(|d| format!("{d:?}"))
                    .collect::<Vec<_>>()
                    .join(" or "),
            });
        }
        if let Some(expected) = shape {
            if found != expected {
                return Err(LoadError::WrongShape {
                    name: name.into(),
                    found,
                    expected: expected.to_vec(),
                });
            }
        }
        self.read
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_string());
        // Byte-sized codes keep their bits as U8 (candle has no I8; we decode F8 ourselves).
        let as_bytes = matches!(dtype, StDtype::I8 | StDtype::F8_E4M3);
        let candle_dtype = if as_bytes {
            DType::U8
        } else {
            DType::try_from(dtype)?
        };
        let stored = match &self.storage {
            Storage::Files(files) => files.get(name)?.data(),
            Storage::Memory(map) => map[name].data.as_slice(),
        };
        // A NaN or an infinity anywhere in a weight, norm, embedding or scale reaches every
        // logit it touches: refused here, where the bytes are read anyway (a scan of the
        // memory-mapped bytes, before any copy).
        if let Some(at) = non_finite_position(dtype, stored) {
            return Err(LoadError::BadTensor {
                name: name.into(),
                reason: format!(
                    "element {:?} is {} (a checkpoint must hold finite values)",
                    unflatten(at, &found),
                    describe_non_finite(dtype, stored, at)
                ),
            });
        }
        let data = match &self.storage {
            Storage::Files(files) if !as_bytes => return Ok(files.load(name, device)?),
            Storage::Files(_) => stored.to_vec(),
            Storage::Memory(map) => map[name].data.clone(),
        };
        Ok(Tensor::from_raw_buffer(
            &data,
            candle_dtype,
            &found,
            device,
        )?)
    }

    /// [`Self::tensor`] converted to `dtype` on the CPU, then placed on `device`: no conversion
    /// kernel runs on a GPU (candle's are PTX that the driver JIT-compiles, seconds at first use).
    pub fn tensor_as(
        &self,
        name: &str,
        dtypes: &[StDtype],
        shape: Option<&[usize]>,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor, LoadError> {
        let t = self.tensor(name, dtypes, shape, &Device::Cpu)?;
        Ok(t.to_dtype(dtype)?.to_device(device)?)
    }

    /// Stored bytes of every tensor whose name starts with `prefix` (headers only).
    pub fn stored_bytes_with_prefix(&self, prefix: &str) -> u64 {
        self.names_with_prefix(prefix)
            .filter_map(|name| self.meta(name).ok())
            .map(|(dtype, shape)| {
                (shape.iter().product::<usize>() as u64 * dtype.bitsize() as u64).div_ceil(8)
            })
            .sum()
    }

    /// Every tensor name that starts with `prefix` (used to reject tensors we would ignore).
    pub fn names_with_prefix<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a str> {
        self.names
            .range(prefix.to_string()..)
            .take_while(move |n| n.starts_with(prefix))
            .map(String::as_str)
    }

    /// Fails naming the tensors that were never read (but those of
    /// [`IGNORED_TENSOR_SUFFIXES`]): a checkpoint whose config.json disagrees with its tensors
    /// (`num_hidden_layers: 1` over two layers of weights) would otherwise serve another model.
    /// Called once the whole model is built; `model` names what read them; tensors under
    /// `ignored_prefixes` are parts of the checkpoint the architecture does not serve.
    pub fn refuse_unread(&self, model: &str, ignored_prefixes: &[&str]) -> Result<(), LoadError> {
        let read = self.read.lock().unwrap_or_else(|p| p.into_inner());
        let unread: Vec<&str> = self
            .names
            .iter()
            .filter(|n| !read.contains(*n))
            .filter(|n| !IGNORED_TENSOR_SUFFIXES.iter().any(|s| n.ends_with(s)))
            .filter(|n| !ignored_prefixes.iter().any(|p| n.starts_with(p)))
            .map(String::as_str)
            .collect();
        match unread.as_slice() {
            [] => Ok(()),
            [first, rest @ ..] => Err(LoadError::BadTensor {
                name: first.to_string(),
                reason: format!(
                    "not read by {model} as config.json describes it{}; does config.json \
                     (num_hidden_layers, architectures, biases, tie_word_embeddings) match the \
                     checkpoint?",
                    match rest.len() {
                        0 => String::new(),
                        n => format!(
                            " ({n} more unread: {}{})",
                            rest.iter()
                                .take(3)
                                .map(|n| format!("`{n}`"))
                                .collect::<Vec<_>>()
                                .join(", "),
                            if n > 3 { ", …" } else { "" }
                        ),
                    }
                ),
            }),
        }
    }
}

/// Flat index of the first NaN or infinity in little-endian float bytes of `dtype` (`None` for
/// other dtypes: integer codes have no such values). Blocks are tested branch-free, so the
/// compiler vectorises the common, all-finite case; the position is looked up only on a hit.
/// A large tensor (an embedding, a dense weight) is split over the machine's cores.
pub fn non_finite_position(dtype: StDtype, bytes: &[u8]) -> Option<usize> {
    const PARALLEL_BYTES: usize = 32 << 20;
    let float = matches!(
        dtype,
        StDtype::F32 | StDtype::F64 | StDtype::BF16 | StDtype::F16 | StDtype::F8_E4M3
    );
    let width = dtype.bitsize() / 8;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if !float || bytes.len() < PARALLEL_BYTES || threads < 2 || width == 0 {
        return non_finite_position_serial(dtype, bytes);
    }
    let elements_per_part = (bytes.len() / width).div_ceil(threads);
    std::thread::scope(|scope| {
        let parts: Vec<_> = bytes
            .chunks(elements_per_part * width)
            .enumerate()
            .map(|(i, part)| {
                scope.spawn(move || {
                    non_finite_position_serial(dtype, part).map(|at| i * elements_per_part + at)
                })
            })
            .collect();
        // The first hit in file order: the parts come back in order.
        parts
            .into_iter()
            .filter_map(|p| p.join().unwrap_or(None))
            .next()
    })
}

fn non_finite_position_serial(dtype: StDtype, bytes: &[u8]) -> Option<usize> {
    // An all-ones exponent is an infinity or a NaN; e4m3fn has no infinities and S.1111.111
    // is its NaN.
    match dtype {
        StDtype::F32 => first_match::<4>(bytes, |b| {
            u32::from_le_bytes(b) & 0x7f80_0000 == 0x7f80_0000
        }),
        StDtype::F64 => first_match::<8>(bytes, |b| {
            u64::from_le_bytes(b) & 0x7ff0_0000_0000_0000 == 0x7ff0_0000_0000_0000
        }),
        StDtype::BF16 => first_match::<2>(bytes, |b| u16::from_le_bytes(b) & 0x7f80 == 0x7f80),
        StDtype::F16 => first_match::<2>(bytes, |b| u16::from_le_bytes(b) & 0x7c00 == 0x7c00),
        StDtype::F8_E4M3 => first_match::<1>(bytes, |b| b[0] & 0x7f == 0x7f),
        _ => None,
    }
}

fn first_match<const W: usize>(bytes: &[u8], bad: impl Fn([u8; W]) -> bool) -> Option<usize> {
    const BLOCK: usize = 1024;
    let element = |c: &[u8]| -> [u8; W] { c.try_into().expect("chunks of W bytes") };
    bytes
        .chunks(BLOCK * W)
        .enumerate()
        .find(|(_, block)| {
            block
                .chunks_exact(W)
                .fold(false, |hit, c| hit | bad(element(c)))
        })
        .and_then(|(b, block)| {
            let i = block.chunks_exact(W).position(|c| bad(element(c)))?;
            Some(b * BLOCK + i)
        })
}

/// `NaN`, `inf` or `-inf`, for the error message.
fn describe_non_finite(dtype: StDtype, bytes: &[u8], at: usize) -> &'static str {
    let width = dtype.bitsize() / 8;
    let element = &bytes[at * width..(at + 1) * width];
    // The sign is the top bit of the last (most significant) byte; the mantissa is non-zero
    // for a NaN (and e4m3fn has nothing but NaN there).
    let negative = element[width - 1] & 0x80 != 0;
    let mantissa_zero = match dtype {
        StDtype::F32 => u32::from_le_bytes(element.try_into().unwrap()) & 0x007f_ffff == 0,
        StDtype::F64 => {
            u64::from_le_bytes(element.try_into().unwrap()) & 0x000f_ffff_ffff_ffff == 0
        }
        StDtype::BF16 => u16::from_le_bytes(element.try_into().unwrap()) & 0x007f == 0,
        StDtype::F16 => u16::from_le_bytes(element.try_into().unwrap()) & 0x03ff == 0,
        _ => false,
    };
    match (mantissa_zero, negative) {
        (false, _) => "NaN",
        (true, false) => "inf",
        (true, true) => "-inf",
    }
}

/// The multi-dimensional index of flat element `at` of a row-major tensor of `shape`.
fn unflatten(mut at: usize, shape: &[usize]) -> Vec<usize> {
    let mut index = vec![0; shape.len()];
    for (i, &dim) in shape.iter().enumerate().rev() {
        if dim > 0 {
            index[i] = at % dim;
            at /= dim;
        }
    }
    index
}

/// The safetensors files of a checkpoint: the shards named by the index, or `model.safetensors`.
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = read_to_string(&index)?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|source| LoadError::Json {
                path: index.clone(),
                source,
            })?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| {
                LoadError::config(
                    "model.safetensors.index.json: weight_map",
                    "missing or not an object",
                )
            })?;
        let files: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(LoadError::Io {
        path: single,
        source: std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "no model.safetensors or model.safetensors.index.json",
        ),
    })
}

/// Parses the header and checks the data section is as long as the header says, so a truncated
/// file fails at start-up with its name instead of at the first forward pass.
fn validate_header(file: &Path) -> Result<(), LoadError> {
    use std::io::Read;
    let bad = |reason: String| LoadError::Safetensors {
        file: file.to_path_buf(),
        reason,
    };
    let mut f = std::fs::File::open(file).map_err(|source| LoadError::Io {
        path: file.to_path_buf(),
        source,
    })?;
    let file_len = f
        .metadata()
        .map_err(|source| LoadError::Io {
            path: file.to_path_buf(),
            source,
        })?
        .len();
    let mut len_bytes = [0u8; 8];
    f.read_exact(&mut len_bytes)
        .map_err(|_| bad(format!("file is only {file_len} bytes long")))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > file_len.saturating_sub(8) {
        return Err(bad(format!(
            "header claims {header_len} bytes but the file has {file_len}"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header)
        .map_err(|e| bad(format!("cannot read header: {e}")))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let data_len = header
        .iter()
        .filter(|(name, _)| *name != "__metadata__")
        .filter_map(|(_, info)| info.get("data_offsets")?.get(1)?.as_u64())
        .max()
        .unwrap_or(0);
    let available = file_len - 8 - header_len;
    if data_len > available {
        return Err(bad(format!(
            "tensor data needs {data_len} bytes but only {available} follow the header"
        )));
    }
    Ok(())
}

/// Checks that `dir` is a checkpoint directory (it has a config.json) before anything is read
/// from it; where it is not, says what it is (a GGUF file, a Hugging Face hub id, a hub cache
/// folder) and what to pass instead.
pub fn check_model_dir(dir: &Path) -> Result<(), LoadError> {
    let refuse = |reason: String| {
        Err(LoadError::NotACheckpoint {
            path: dir.to_path_buf(),
            reason,
        })
    };
    const EXPECTED: &str = "ExactScore loads a Hugging Face checkpoint directory (config.json, \
                            *.safetensors, tokenizer.json)";
    if dir.is_file() {
        let gguf = dir
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
            || std::fs::File::open(dir)
                .and_then(|mut f| {
                    let mut magic = [0u8; 4];
                    std::io::Read::read_exact(&mut f, &mut magic).map(|()| magic)
                })
                .is_ok_and(|magic| &magic == b"GGUF");
        if gguf {
            return refuse(format!(
                "a GGUF file, which ExactScore does not read; {EXPECTED}: download the Hugging \
                 Face checkpoint (`huggingface-cli download ORG/NAME --local-dir DIR`) and pass \
                 --model DIR"
            ));
        }
        return refuse(format!(
            "a file, not a directory; {EXPECTED}: pass the directory that holds them"
        ));
    }
    if !dir.exists() {
        let text = dir.to_string_lossy();
        let parts: Vec<&str> = text.split('/').collect();
        let hub_id = parts.len() == 2
            && parts
                .iter()
                .all(|p| !p.is_empty() && *p != "." && *p != "..")
            && !text.starts_with('.');
        if hub_id {
            return refuse(format!(
                "no such directory; it looks like a Hugging Face hub id, and ExactScore reads \
                 local directories only: `huggingface-cli download {text} --local-dir DIR`, \
                 then --model DIR"
            ));
        }
        return refuse("no such directory".into());
    }
    if dir.join("config.json").is_file() {
        return Ok(());
    }
    let snapshots = dir.join("snapshots");
    if snapshots.is_dir() {
        let mut revisions: Vec<String> = std::fs::read_dir(&snapshots)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default();
        revisions.sort();
        return refuse(format!(
            "a Hugging Face cache folder, not a checkpoint: pass {}/<revision>/ (found: {})",
            snapshots.display(),
            if revisions.is_empty() {
                "none".to_string()
            } else {
                revisions.join(", ")
            }
        ));
    }
    refuse(format!("no config.json here; {EXPECTED}"))
}

pub(crate) fn read_to_string(path: &Path) -> Result<String, LoadError> {
    std::fs::read_to_string(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Bytes of each tensor's data that [`fingerprint`] reads.
pub const FINGERPRINT_TENSOR_PREFIX: u64 = 64 * 1024;

/// The files of a checkpoint directory that [`fingerprint`] hashes whole, where present.
pub const FINGERPRINT_FILES: [&str; 5] = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "model.safetensors.index.json",
];

/// A SHA-256 that identifies a checkpoint without reading all its weights: over, in this
/// order, each of [`FINGERPRINT_FILES`] that exists (whole), then each safetensors file (the
/// shards in name order) as its header (the 8-byte length and the JSON) followed by the first
/// [`FINGERPRINT_TENSOR_PREFIX`] bytes of every tensor's data, tensors in name order. Each
/// item enters as its name, a zero byte, its length as u64 little-endian, then its bytes.
/// Lowercase hex.
pub fn fingerprint(dir: &Path) -> Result<String, LoadError> {
    use sha2::{Digest, Sha256};
    use std::io::{Read, Seek, SeekFrom};
    let mut hash = Sha256::new();
    let mut item = |name: &str, bytes: &[u8]| {
        hash.update(name.as_bytes());
        hash.update([0u8]);
        hash.update((bytes.len() as u64).to_le_bytes());
        hash.update(bytes);
    };
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| LoadError::Io { path, source }
    };
    for name in FINGERPRINT_FILES {
        let path = dir.join(name);
        match std::fs::read(&path) {
            Ok(bytes) => item(name, &bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(&path)(e)),
        }
    }
    for file in safetensors_files(dir)? {
        let name = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut f = std::fs::File::open(&file).map_err(io(&file))?;
        let mut len = [0u8; 8];
        f.read_exact(&mut len).map_err(io(&file))?;
        let header_len = u64::from_le_bytes(len);
        let file_len = f.metadata().map_err(io(&file))?.len();
        if header_len > file_len.saturating_sub(8) {
            return Err(io(&file)(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "safetensors header length past the end of the file",
            )));
        }
        let mut header = vec![0u8; header_len as usize];
        f.read_exact(&mut header).map_err(io(&file))?;
        item(&name, &[&len[..], &header].concat());
        let json: serde_json::Value =
            serde_json::from_slice(&header).map_err(|source| LoadError::Json {
                path: file.clone(),
                source,
            })?;
        let mut tensors: Vec<(&String, u64, u64)> = json
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(k, _)| k.as_str() != "__metadata__")
            .filter_map(|(k, v)| {
                let offsets = v.get("data_offsets")?.as_array()?;
                Some((k, offsets.first()?.as_u64()?, offsets.get(1)?.as_u64()?))
            })
            .collect();
        tensors.sort();
        let data = 8 + header_len;
        for (tensor, start, end) in tensors {
            let take = end.saturating_sub(start).min(FINGERPRINT_TENSOR_PREFIX);
            let at = data.saturating_add(start);
            if at.saturating_add(take) > file_len {
                return Err(io(&file)(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("tensor `{tensor}` ends past the end of the file"),
                )));
            }
            let mut bytes = vec![0u8; take as usize];
            f.seek(SeekFrom::Start(at)).map_err(io(&file))?;
            f.read_exact(&mut bytes).map_err(io(&file))?;
            item(tensor, &bytes);
        }
    }
    let digest = hash.finalize();
    Ok(digest.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_non_finite_pattern_is_found_and_no_finite_one() {
        let bf16 = |v: f32| half::bf16::from_f32(v).to_le_bytes().to_vec();
        let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes().to_vec();
        let f32b = |v: f32| v.to_le_bytes().to_vec();
        for (dtype, encode) in [
            (StDtype::BF16, &bf16 as &dyn Fn(f32) -> Vec<u8>),
            (StDtype::F16, &f16),
            (StDtype::F32, &f32b),
        ] {
            for (value, shown) in [
                (f32::NAN, "NaN"),
                (f32::INFINITY, "inf"),
                (f32::NEG_INFINITY, "-inf"),
            ] {
                let mut bytes: Vec<u8> = [1.5f32, -0.0, 65504.0, 1e-8]
                    .iter()
                    .flat_map(|&v| encode(v))
                    .collect();
                assert_eq!(non_finite_position(dtype, &bytes), None, "{dtype:?}");
                bytes.extend(encode(value));
                assert_eq!(non_finite_position(dtype, &bytes), Some(4), "{dtype:?}");
                assert_eq!(describe_non_finite(dtype, &bytes, 4), shown);
            }
        }
        // e4m3fn: 0x7e and 0xfe are ±448, 0x7f and 0xff NaN.
        assert_eq!(
            non_finite_position(StDtype::F8_E4M3, &[0x7e, 0xfe, 0x00]),
            None
        );
        assert_eq!(
            non_finite_position(StDtype::F8_E4M3, &[0x7e, 0xff]),
            Some(1)
        );
        assert_eq!(non_finite_position(StDtype::I32, &[0xff; 8]), None);
        assert_eq!(unflatten(5 * 256 + 3, &[2000, 256]), vec![5, 3]);
    }

    #[test]
    fn a_large_tensor_split_over_threads_reports_the_first_position() {
        let mut bytes = vec![0u8; 33 << 20];
        let (late, early) = (bytes.len() / 2 - 7, bytes.len() / 4 + 1);
        for at in [late, early] {
            bytes[2 * at + 1] = 0x7f;
            bytes[2 * at] = 0x80;
        }
        assert_eq!(non_finite_position(StDtype::BF16, &bytes), Some(early));
        assert_eq!(
            non_finite_position_serial(StDtype::BF16, &bytes),
            Some(early)
        );
    }
}
