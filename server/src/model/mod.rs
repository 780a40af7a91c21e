//! The model: checkpoint reading, config, the Llama block family and scoring.

pub mod checkpoint;
pub mod config;
pub mod kld;
pub mod llama;
pub mod moe;
pub mod profile;
pub mod rope;
pub mod scoring;

pub use checkpoint::LoadError;
pub use config::{Architecture, ModelConfig};
pub use kld::{kld_batch, SequenceKld, TokenKld};
pub use llama::{causal_mask, AttentionKernel, Model, ModelOptions, ScoreInput};
pub use scoring::{RowScore, SequenceScores};
