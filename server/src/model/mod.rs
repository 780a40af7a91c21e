//! The model: checkpoint reading, config, the Llama block family and scoring.

pub mod checkpoint;
pub mod config;
pub mod kld;
pub mod llama;
pub mod placement;
pub mod profile;
pub mod rope;
pub mod scoring;

pub use checkpoint::LoadError;
pub use config::{Architecture, ModelConfig};
pub use kld::{kld_batch, SequenceKld, TokenKld};
pub(crate) use llama::LM_HEAD_CHUNK;
pub use llama::{causal_mask, AttentionKernel, Model, ModelOptions, ScoreInput};
pub use scoring::{RowScore, SequenceScores};
