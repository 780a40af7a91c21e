//! A Hugging Face checkpoint directory: `config.json` plus one or more safetensors files
//! (sharded through `model.safetensors.index.json`). Every tensor read goes through
//! [`Checkpoint::tensor`], which checks name, dtype and shape and names the tensor on failure.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

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
}

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
        })
    }

    /// A checkpoint whose tensors are already in memory.
    pub fn from_memory(tensors: std::collections::HashMap<String, HostTensor>) -> Self {
        Self {
            dir: PathBuf::from("<memory>"),
            names: tensors.keys().cloned().collect(),
            storage: Storage::Memory(tensors),
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
        // Byte-sized codes keep their bits as U8 (candle has no I8; we decode F8 ourselves).
        let as_bytes = matches!(dtype, StDtype::I8 | StDtype::F8_E4M3);
        let candle_dtype = if as_bytes {
            DType::U8
        } else {
            DType::try_from(dtype)?
        };
        let data = match &self.storage {
            Storage::Files(files) if !as_bytes => return Ok(files.load(name, device)?),
            Storage::Files(files) => files.get(name)?.data().to_vec(),
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

pub(crate) fn read_to_string(path: &Path) -> Result<String, LoadError> {
    std::fs::read_to_string(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })
}
