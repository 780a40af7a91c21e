//! The model: checkpoint reading, config, the decoder families, placement and scoring.

pub mod checkpoint;
pub mod config;
pub mod kld;
pub mod llama;
pub mod moe;
pub mod placement;
pub mod profile;
pub mod rope;
pub mod scoring;

pub use checkpoint::LoadError;
pub use config::{Architecture, ModelConfig};
pub use kld::{kld_batch, SequenceKld, TokenKld};
pub(crate) use llama::lm_head_rows;
pub use llama::{causal_mask, AttentionKernel, Model, ModelOptions, ScoreInput};
pub use scoring::{RowScore, SequenceScores};
