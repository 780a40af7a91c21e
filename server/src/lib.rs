//! ExactScore server library: exact per-token log-probabilities of compressed-tensors
//! checkpoints (model + quantized layers), the batching engine and the HTTP API.

pub mod app;
pub mod checkpoint;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod engine;
pub mod http;
pub mod model;
pub mod ops;
pub mod quant;
pub mod tokenizer;
