//! The model: config, the shared stack ([`Model`]), the blocks decoder layers are built from,
//! one file per architecture family, placement and scoring.
//!
//! A new architecture is one file in `config/`: what it makes of its config.json (transformers'
//! defaults, the keys it reads and those it refuses), and which family's decoder layers it is
//! built from; then one line in the registry (`config/registry.rs`). A new family is one
//! file too: its norms around the attention and feed-forward built from [`blocks`] (each block
//! loads itself from a [`loader::Loader`]), implementing `decoder::LayerNorms`, and a
//! `decoder::Family` saying how to load it; then one arm in `decoder::family`. Device-specific
//! work goes through [`crate::ops`].

pub mod blocks;
pub mod config;
pub mod decoder;
pub mod deepseek;
pub mod diff;
pub mod gemma;
pub mod gemma4;
pub mod kld;
pub mod llama;
pub mod loader;
pub mod placement;
pub mod profile;
pub mod qwen3_next;
pub mod rope;
pub mod scoring;
pub mod stored_kld;

pub use crate::checkpoint::LoadError;
pub use crate::ops::causal_mask;
pub use config::{Architecture, ModelConfig};
pub use decoder::{keep_sequences, AttentionKernel, Keep, Model, ModelOptions, ScoreInput};
pub use diff::{diff_batch, DiffOptions, LayerError, SequenceDiff};
pub use kld::{kld_batch, SequenceKld, TokenKld};
pub use scoring::{RowScore, SequenceScores};
pub use stored_kld::{StoredOutput, StoredRequest};
